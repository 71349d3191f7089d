# Turns one family's kernels/*.cu into host C++ for run.sh: the embedded headers (ferrite.cuh,
# philox.cuh) are expanded as the JIT does, the helpers that wrap PTX are removed (emu_rows.h
# defines host versions), `__shared__` arrays become EMU_SHARED views of the block's static area
# and the dynamic shared array points at the block's dynamic area; cluster-only code is dropped.
# Fails if any `asm` is left.
import os, re, sys

here = os.path.dirname(os.path.abspath(__file__))
hdrs = os.path.join(here, '..', '..', 'crates', 'ferrite', 'src', 'core', 'cuda', 'kernels')
REMOVE = {'ex2_approx', 'rcp_approx', 'tanh_approx', 'red_add2', 'smem_u32', 'dynamic_smem_bytes', 'cp_async16',
          'cp_async16_s', 'cp_async4', 'cp_async_commit', 'cp_async_wait'}


def expand(src):
    out = []
    for l in src.split('\n'):
        m = re.match(r'#include "(\w+\.cuh)"', l.strip())
        if m:
            out.append(expand(open(os.path.join(hdrs, m.group(1))).read()))
        elif re.match(r'#include <cuda_(fp16|bf16)\.h>', l.strip()):
            continue
        else:
            out.append(l)
    return '\n'.join(out)


def sig_name(l):
    m = re.match(r'__device__ __forceinline__ [\w ]+? (\w+)\(', l)
    return m.group(1) if m else None


# Code for thread-block clusters (cross_entropy's `ce_cluster`: distributed shared memory, cluster
# barriers) has no host model here: its `#if defined(FE_CLUSTER)` block is dropped whole.
def drop_cluster_blocks(lines):
    out, skip = [], 0
    for l in lines:
        t = l.strip()
        if skip:
            skip += t.startswith('#if')
            skip -= t.startswith('#endif')
            continue
        if t.startswith('#if defined(FE_CLUSTER)'):
            skip = 1
            continue
        out.append(l)
    return out


lines = drop_cluster_blocks(expand(open(sys.argv[1]).read()).split('\n'))
out, i = [], 0
while i < len(lines):
    l = lines[i]
    if l.startswith('template <int N>') and i + 1 < len(lines) and sig_name(lines[i + 1]) in REMOVE:
        i += 1
        l = lines[i]
    if sig_name(l) in REMOVE:
        depth, started = 0, False
        while True:
            depth += lines[i].count('{') - lines[i].count('}')
            started |= '{' in lines[i]
            i += 1
            if started and depth == 0:
                break
        continue
    out.append(l)
    i += 1
s = '\n'.join(out)
s = re.sub(r'extern __shared__ __align__\(\d+\) unsigned char (\w+)\[\];',
           r'unsigned char* \1 = g_blk->dyn;', s)
s = re.sub(r'__shared__ (\w[\w ]*?) (\w+)((?:\[\w+\])+);', r'EMU_SHARED(\1, \2, \3);', s)
# The removed PTX wrappers, under the names the host versions take.
s = s.replace('cp_async16(', 'emu_cp16(').replace('cp_async_commit()', 'emu_cp_commit()')
s = re.sub(r'cp_async_wait<(\w+(?: - \d+)?)>\(\)', r'emu_cp_wait(\1)', s)
for bad in ('asm(', 'asm volatile', '__shared__', 'cp_async16(', 'cp_async16_s(', 'cp_async4(',
            'cp_async_commit(', 'cp_async_wait<', '__cvta_generic_to_shared'):
    if bad in s:
        sys.exit(f'extract.py: `{bad}` left in {sys.argv[1]}')
open(sys.argv[2], 'w').write('#include "emu_rows.h"\n' + s)
