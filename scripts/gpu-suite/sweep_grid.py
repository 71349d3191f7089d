"""The matmul sweep as text grids: per dtype, rows M, columns N×K; each cell the default path's
ratio to the faster of cuBLAS/cuBLASLt, the variant it ran, its median µs and host µs per call
(default / cuBLAS).   python3 scripts/gpu-suite/sweep_grid.py sweep.json bf16 [f16]"""
import json,sys
d=json.load(open(sys.argv[1]))['records']
cells={}
for r in d:
    if r['variant']=='default':
        cfg=r['config']
        host=cfg.split('host ')[1].split(' ')[0] if 'host ' in cfg else '-'
        hc=cfg.split('(cuBLAS ')[1].rstrip(')') if 'cuBLAS ' in cfg else '-'
        cells[(r['dtype'],r['shape'])]=(r['ratio_to_peer'],cfg.split('`')[1],r['median_ms'],host,hc)
for dt in sys.argv[2:]:
    print(dt, ' cell: ratio variant us host/cublas-host')
    nks=[]
    for (d_,s) in cells:
        if d_!=dt: continue
        m,n,k=s.split()[0].split('×')
        if (n,k) not in nks: nks.append((n,k))
    ms=sorted({int(s.split('×')[0]) for (d_,s) in cells if d_==dt})
    print('M     '+' '.join(f'{n+"x"+k:>26}' for n,k in nks))
    for m in ms:
        row=[]
        for n,k in nks:
            c=cells[(dt,f'{m}×{n}×{k} NT')]
            row.append(f'{c[0]:.2f} {c[1][:5]:>5} {c[2]*1000:6.1f} {c[3]}/{c[4]}')
        print(f'{m:5d} '+' '.join(f'{x:>26}' for x in row))
