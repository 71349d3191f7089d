# Reads the real host code of the mma kernels and writes what the emulator's driver needs, so the
# driver launches the kernel as ops/matmul/cuda/ does instead of as someone remembers it:
#   launch.py CUDA_HOST_RS EPILOGUE_RS COMMON_CUH OUT_H   → OUT_H (C++), and shell assignments on stdout
# - the argument order: gemm_args' `args.push(..)` chain of the common parameters and the one
#   launch_inner adds under `if let Some(epi) = l.epilogue`, each checked name by name and type by
#   type against the kernel's FE_MATMUL_PARAMS / FE_EPI_PARAMS (common.cuh; the element-wise
#   epilogue's, without the activation backward's column sums); emitted as EMU_ARGS / EMU_EPI_ARGS over
#   driver structs named like the Rust ones (g.a.ld, p.c, e.stride_z, ...).
# - the mma arm of plan_inner: block, tile, and the stage constants (MMA_STAGES for the plain and
#   pair kernels, MMA_EPI_STAGES for the element-wise epilogue, MMA_STAGE_BYTES · stages of smem).
# - with_epilogue's FE_EPI = 1 + code and Activation::code() (core/act.rs): the activation codes.
import re, sys

cuda_rs, act_rs, common_cuh, out_h = sys.argv[1:5]
rs = open(cuda_rs).read()
def die(msg):
    sys.exit(f'launch.py: {msg} (ops/matmul/cuda/ changed? update scripts/mma-emu)')

def body(src, start):
    i = src.index('{', start)
    d = 0
    for j in range(i, len(src)):
        d += {'{': 1, '}': -1}.get(src[j], 0)
        if d == 0:
            return src[i + 1:j]
    die('unbalanced braces')

li = body(rs, rs.index('fn launch_inner('))
def chain(text):
    return [x.strip() for x in re.findall(r'\.push\(([^()]*)\)', text)]
# The leading arguments are pushed by gemm_args; launch_inner adds the epilogue's.
common = chain(re.search(r'args\.push\(p\.c\)[^;]*;', body(rs, rs.index('fn gemm_args('))).group(0).replace('args', '', 1))
m = re.search(r'if let Some\(epi\) = l\.epilogue \{([^;]*;)', li)
if not m:
    die('no epilogue argument block in launch_inner')
epi = chain(m.group(1))

# Rust expression → (kernel parameter name, kernel type).
known = {
    'p.c': ('C', 'ptr'), 'p.a': ('A', 'ptr'), 'p.b': ('B', 'ptr'),
    'g.m': ('m', 'i64'), 'g.n': ('n', 'i64'), 'g.k': ('k', 'i64'),
    'g.a.ld': ('lda', 'i64'), 'g.b.ld': ('ldb', 'i64'), 'g.c.ld': ('ldc', 'i64'),
    'g.a.trans': ('a_trans', 'int'), 'g.b.trans': ('b_trans', 'int'),
    'g.a.batch_stride': ('stride_a', 'i64'), 'g.b.batch_stride': ('stride_b', 'i64'),
    'g.c.batch_stride': ('stride_c', 'i64'), 'g.batch': ('batch', 'i64'),
    'alpha': ('alpha', 'float'), 'beta': ('beta', 'float'),
    'e.bias': ('epi_bias', 'ptr'), 'e.z': ('epi_z', 'ptr'), 'e.ldz': ('epi_ldz', 'i64'),
    'e.stride_z': ('epi_stride_z', 'i64'), 'e.r': ('epi_r', 'ptr'), 'e.ldr': ('epi_ldr', 'i64'),
    'e.stride_r': ('epi_stride_r', 'i64'),
}
cast_type = {'i64': 'i64', 'i32': 'int', None: None}
def translate(expr):
    m = re.fullmatch(r'([\w.]+)(?: as (\w+))?', expr)
    if not m or m.group(1) not in known:
        die(f'unknown launch argument `{expr}`')
    name, ty = known[m.group(1)]
    cast = cast_type.get(m.group(2), 'bad')
    if cast == 'bad':
        die(f'unexpected cast in `{expr}`')
    if cast is not None and cast != ty:
        die(f'`{expr}` is pushed as {cast} but the kernel parameter {name} is {ty}')
    cpp = f'({cast})({m.group(1)})' if cast else m.group(1)
    return name, ty, cpp

cuh = open(common_cuh).read()
def kernel_params(macro):
    m = re.search(r'#define ' + macro + r'\s+((?:[^\n]*\\\n)*[^\n]*)', cuh)
    text = m.group(1).replace('\\\n', ' ').replace('__restrict__', '').strip().lstrip(',')
    out = []
    for p in text.split(','):
        p = p.strip()
        name = re.findall(r'\w+', p)[-1]
        ty = 'ptr' if '*' in p else p.split()[0]
        out.append((name, {'int': 'int', 'i64': 'i64', 'float': 'float'}.get(ty, ty)))
    return out
# The element-wise epilogue's parameters (the `#elif FE_EPI` branch: no activation backward).
m = re.search(r'#elif FE_EPI\n#define FE_EPI_PARAMS(.*?)\n#define FE_EPI_MAKE', cuh, re.S)
cuh_epi = '#define FE_EPI_PARAMS2 ' + m.group(1)
cuh += '\n' + cuh_epi
for pushed, macro in [(common, 'FE_MATMUL_PARAMS'), (epi, 'FE_EPI_PARAMS2')]:
    params = kernel_params(macro)
    got = [translate(x) for x in pushed]
    if [(n, t) for n, t, _ in got] != params:
        die(f'launch_inner pushes {[(n, t) for n, t, _ in got]} but the kernel takes {params}')
common_cpp = ', '.join(c for _, _, c in [translate(x) for x in common])
epi_cpp = ', '.join(c for _, _, c in [translate(x) for x in epi])

def const(name):
    m = re.search(r'const ' + name + r': u32 = ([0-9 *+]+);', rs)
    if not m:
        die(f'no const {name}')
    return eval(m.group(1))
stages, epi_stages, stage_bytes = const('MMA_STAGES'), const('MMA_EPI_STAGES'), const('MMA_STAGE_BYTES')
arm = body(rs, rs.index('"mma" | "mma_pipelined" =>'))
if 'let smem = stages * MMA_STAGE_BYTES;' not in arm:
    die('mma smem is no longer stages * MMA_STAGE_BYTES')
if not re.search(r'\(_, Some\(Epi \{ pairs: false, \.\. \}\)\) => MMA_EPI_STAGES,\s*_ => MMA_STAGES,', arm):
    die('mma stage selection changed')
if 'let layout = epi.filter(|e| e.pairs).map(|_| (g.a.trans, g.b.trans));' not in arm:
    die('the pair kernel is no longer compiled for the problem layout')
block = re.search(r'block: \((\d+), (\d+), (\d+)\)', arm).groups()
tile = re.search(r'tile: \((\d+), (\d+)\)', arm).groups()
# The non-persistent grid of an ungrouped GEMM: (column tiles, row tiles, batch).
none_arm = li[li.index('let grid'):]
none_arm = none_arm[none_arm.index('None => {'):]
for piece in ['let row_tiles = (g.m as u32).div_ceil(l.tile.0);', '_ => (row_tiles, g.batch as u32),',
              '(g.n as u32).div_ceil(l.tile.1),', 'y.clamp(1, 65535),', 'z.clamp(1, 65535),']:
    if piece not in none_arm:
        die(f'grid changed: no `{piece}`')
if 'p.define("FE_EPI", 1 + act.code())' not in rs or 'p.define("FE_EPI_PAIRS", 1)' not in rs:
    die('with_epilogue changed')
ers = open(act_rs).read()
code_fn = body(ers, ers.index('pub fn code(self)'))
acts = {int(c): re.sub(r'(?<!^)([A-Z])', r'_\1', n).lower()
        for n, c in re.findall(r'Activation::(\w+) => (\d+),', code_fn)}
names = [acts[i] for i in range(len(acts))]

with open(out_h, 'w') as f:
    f.write('// Generated by scripts/mma-emu/launch.py from ops/matmul/cuda/ / core/act.rs / common.cuh.\n')
    f.write(f'#define EMU_BLOCK {{{block[0]}, {block[1]}, {block[2]}}}\n')
    f.write(f'#define EMU_TILE_M {tile[0]}\n#define EMU_TILE_N {tile[1]}\n')
    f.write(f'#define EMU_STAGE_BYTES {stage_bytes}\n')
    f.write(f'#define EMU_ARGS {common_cpp}\n#define EMU_EPI_ARGS {epi_cpp}\n')
    f.write('static const char* EMU_ACT_NAMES[] = {' + ', '.join(f'"{n}"' for n in names) + '};\n')
print(f'MMA_STAGES={stages}\nMMA_EPI_STAGES={epi_stages}\nACTS="{" ".join(names)}"')
