# Turns CUDA kernel sources into host C++ for the emulators (emu.h):
#   extract.py OUT HEADER FERRITE_CUH --remove f1,f2,... [--count g1,g2,...] SRC [SRC...]
# concatenates SRC (as the host code does, e.g. matmul's common.cuh + mma.cu), expands
# `#include "ferrite.cuh"` with the real FERRITE_CUH, and likewise every shared header beside it
# (hopper.cuh), minus their CUDA header includes (HEADER
# provides the types), removes the PTX-wrapping helpers named by --remove (HEADER defines host
# versions; each must be found, so a rename fails here instead of silently using the kernel's asm),
# points `extern __shared__` declarations at the emulated block buffer, and makes each function
# named by --count bump emu_hits[i] (i: its place in the list) on entry, per thread, so a driver can
# tell which code path ran.
import re, sys

out, header, ferrite_cuh = sys.argv[1:4]
assert sys.argv[4] == '--remove'
remove = set(sys.argv[5].split(','))
srcs = sys.argv[6:]
count = []
if srcs[0] == '--count':
    count = srcs[1].split(',')
    srcs = srcs[2:]

import os
hdr_dir = os.path.dirname(ferrite_cuh)


def shared_header(name):
    # A shared kernel header beside ferrite.cuh (ferrite.cuh, hopper.cuh, ...), minus CUDA's own.
    return '\n'.join(l for l in open(os.path.join(hdr_dir, name)).read().split('\n')
                     if not re.match(r'\s*#include <cuda_(fp16|bf16)\.h>', l))


src = '\n'.join(open(p).read() for p in srcs)
# Expand `#include "X.cuh"` of the shared headers (recursively); their include guards make a
# second expansion harmless.
inc = re.compile(r'#include "(\w+\.cuh)"')
while True:
    m = next((m for m in inc.finditer(src) if os.path.exists(os.path.join(hdr_dir, m.group(1)))), None)
    if m is None:
        break
    src = src[:m.start()] + shared_header(m.group(1)) + src[m.end():]

lines = src.split('\n')
out_lines, i, found = [], 0, set()
sig = re.compile(r'\s*__device__ __forceinline__ [\w:<>]+ (\w+)\(')
while i < len(lines):
    l = lines[i]
    nxt = lines[i + 1] if i + 1 < len(lines) else ''
    if l.startswith('template <') and sig.match(nxt) and sig.match(nxt).group(1) in remove:
        i += 1
        l = lines[i]
    m = sig.match(l)
    if m and m.group(1) in count:
        found.add(m.group(1))
        while '{' not in lines[i]:
            out_lines.append(lines[i])
            i += 1
        out_lines.append(lines[i].replace('{', '{ emu_hits[%d]++;' % count.index(m.group(1)), 1))
        i += 1
        continue
    if m and m.group(1) in remove:
        found.add(m.group(1))
        depth, started = 0, False
        while True:
            depth += lines[i].count('{') - lines[i].count('}')
            started = started or '{' in lines[i]
            i += 1
            if started and depth == 0:
                break
        continue
    out_lines.append(l)
    i += 1
missing = (remove | set(count)) - found
if missing:
    sys.exit(f'extract.py: functions not found in {srcs}: {sorted(missing)}')
s = '\n'.join(out_lines)
s, n = re.subn(r'extern __shared__ __align__\(\d+\) ([\w ]+?) (\w+)\[\];', r'\1* \2 = (\1*)g_smem;', s)
if n == 0:
    sys.exit('extract.py: no extern __shared__ declaration found')
open(out, 'w').write(f'#include "{header}"\n' + s)
