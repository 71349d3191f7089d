# Turns kernels/flash.cu into host C++ for run.sh: the helpers that wrap PTX are removed (emu.h
# defines host versions) and the shared-memory declaration points at the emulated block buffer.
import re,sys
src=open(sys.argv[1]).read()
remove=['smem_u32','cp_async16','cp_async_commit','cp_async_wait','ldsm_x4','ldsm_x4_t','mma','pack2','unpack2',
        'exp2_fast','tanh_fast','red_add2','ldsm_x4_s','ldsm_x4_ts','sts32','cp_async16_s']
lines=src.split('\n')
out=[];i=0
def sig_name(l):
    m=re.match(r'__device__ __forceinline__ \w+ (\w+)\(',l)
    return m.group(1) if m else None
while i<len(lines):
    l=lines[i]
    # template line followed by a removed function
    if l.startswith('template <int N>') and i+1<len(lines) and sig_name(lines[i+1]) in remove:
        i+=1; l=lines[i]
    n=sig_name(l)
    if n in remove:
        depth=0;started=False
        while True:
            depth+=lines[i].count('{')-lines[i].count('}')
            if '{' in lines[i]: started=True
            i+=1
            if started and depth==0: break
        continue
    out.append(l); i+=1
s='\n'.join(out)
s=s.replace('#include "ferrite.cuh"','#include "emu.h"')
s=s.replace('extern __shared__ __align__(128) unsigned char smem_raw[];','unsigned char* smem_raw = g_smem;')
open(sys.argv[2],'w').write(s)
