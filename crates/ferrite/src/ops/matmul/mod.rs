//! # matmul — C = α·op(A)·op(B) + β·C
//!
//! The room of the matrix-multiply family: the public functions and their input checks (here),
//! the CPU ladder (`cpu/`), the CUDA host code (`cuda/`) and kernels (`kernels/*.cu`), the
//! checks against an f64 reference (`check.rs`) and the benchmark (`bench.rs`).
//!
//! **Layouts.** A is `[m, k]` or `[batch, m, k]`, B is `[k, n]` or `[batch, k, n]`; each may be
//! row-major or a transposed view (stride 1 in either of its last two dims: NN, NT, TN, TT) with
//! any leading dimension; a 2-D operand broadcasts over the batch. The output is `[m, n]` or
//! `[batch, m, n]` with stride 1 in its last dim and any row and batch stride that keeps batches
//! apart. A, B and C share one dtype (f32, f16, bf16) and one device; f32 may run as tf32
//! (tensor cores) when the caller asks for `Precision::Tf32`.
//!
//! **Variants** (the ladder; `variants()` lists what each supports):
//! - CPU f32: `naive` → `blocked` → `simd` → `parallel`, measured against the `gemm` crate.
//! - CUDA, measured against cuBLAS (docs/matmul.md explains each step):
//!   - fp32 SIMT (f32, true fp32): `naive` (one thread per output) → `coalesced` → `smem_tiled`
//!     → `blocktile_1d` → `blocktile_2d` (register blocking) → `vectorized` (128-bit loads) →
//!     `warptile` (warp tiles, cp.async ring). `naive` also takes f16/bf16.
//!   - tensor cores, sm_80+ (bf16, f16; f32 as tf32 only under `Precision::Tf32`): `mma`
//!     (mma.sync + ldmatrix, one cp.async stage) → `mma_pipelined` (4-stage cp.async ring).
//!   - Hopper, sm_90a (bf16, f16; f32 as tf32 under `Precision::Tf32`): `wgmma` (TMA into
//!     swizzled shared memory on an mbarrier ring, warpgroup MMA, producer/consumer warpgroups,
//!     persistent grid, 2-block clusters multicasting B). bf16/f16 operands whose rows TMA
//!     cannot address (4097 columns, odd offsets) are first re-pitched into 16-byte rows; C with
//!     few tiles (short M) splits k over more blocks, fp32 partials summed by a second pass.
//!     tf32 reads K-major operands only (A row-major, B transposed): an m/n-contiguous or
//!     unaligned operand is first packed into a K-major tf32-rounded copy.
//!   - Decode, sm_80+ (bf16, f16): `skinny` — m ≤ 64 with K-contiguous A and B (linear's
//!     layout): a bandwidth-bound read of B, streamed once by TMA.
//!
//! **The default** (no variant named): the highest rung that takes the problem; on Hopper a short
//! A (m ≤ 64, K-contiguous 16-bit operands) races `skinny` against `wgmma` at its shape class's
//! first use and remembers the winner (tune.json); small unaligned problems stay on
//! `mma_pipelined`. The CUDA path remembers its resolved plan per problem, so a repeated call
//! costs a map lookup and the launch. `ferrite bench matmul --sweep` measures the default
//! against cuBLAS/cuBLASLt over M × (N, K) (docs/matmul.md, "Every shape").

// The rungs (CPU code, CUDA host code) and the family's check and bench: pub for the harness,
// the CLI and the families that reuse each other's rungs; the API is this module's items.
#[doc(hidden)]
pub mod bench;
#[doc(hidden)]
pub mod check;
#[doc(hidden)]
pub mod cpu;
#[doc(hidden)]
pub mod cuda;
pub mod epilogue;
#[doc(hidden)]
pub mod sweep;

use crate::core::cuda::Stream;
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::{
    BenchConfig, BenchRecord, Ceilings, CheckConfig, CheckRecord, KernelSpec, OpFamily, Precision,
};
use crate::core::tensor::{describe, Tensor};
use crate::core::variant::{self, Backend, VariantInfo};

/// The family's name, as errors, the CLI and the tables spell it.
pub const OP: &str = "matmul";

const F32: &[DType] = &[DType::F32];
const FLOATS: &[DType] = &[DType::F32, DType::F16, DType::BF16];
const HALVES: &[DType] = &[DType::F16, DType::BF16];

/// The ladder, in order.
pub fn variants() -> Vec<VariantInfo> {
    vec![
        VariantInfo {
            name: "naive",
            backend: Backend::Cpu,
            dtypes: F32,
            min_arch: None,
            constraints: "any shape",
            summary:
                "triple loop i-j-p: B is walked down a column, one cache line per multiply-add",
            rank: 1,
        },
        VariantInfo {
            name: "blocked",
            backend: Backend::Cpu,
            dtypes: F32,
            min_arch: None,
            constraints: "any shape",
            summary:
                "cache tiles and i-p-j order: the inner loop streams a row of B and vectorises",
            rank: 2,
        },
        VariantInfo {
            name: "simd",
            backend: Backend::Cpu,
            dtypes: F32,
            min_arch: None,
            constraints: "any shape",
            summary:
                "packed panels + register-blocked AVX-512/AVX2 FMA micro-kernel chosen at run time",
            rank: 3,
        },
        VariantInfo {
            name: "parallel",
            backend: Backend::Cpu,
            dtypes: F32,
            min_arch: None,
            constraints: "any shape",
            summary: "the simd kernel over all cores (rayon), B panels packed once and shared",
            rank: 4,
        },
        VariantInfo {
            name: "naive",
            backend: Backend::Cuda,
            dtypes: FLOATS,
            min_arch: Some(crate::core::device::Arch::SM80),
            constraints: "any shape, any layout",
            summary: "one thread per output element, operands straight from global memory",
            rank: 1,
        },
        cuda_rung(
            "coalesced",
            F32,
            "any shape, any layout",
            "32×32 blocks, lanes along C's columns (rows for TT): coalesced operand reads, more L1 reuse",
            2,
        ),
        cuda_rung(
            "smem_tiled",
            F32,
            "any shape, any layout",
            "32×32 tiles of A and B staged in shared memory: each global element read once per block",
            3,
        ),
        cuda_rung(
            "blocktile_1d",
            F32,
            "any shape, any layout",
            "8 outputs per thread (64×64×8 tiles): one B value in a register feeds 8 FMAs",
            4,
        ),
        cuda_rung(
            "blocktile_2d",
            F32,
            "any shape, any layout",
            "8×8 outputs per thread (128×128×8 tiles): register outer products, 0.25 shared loads per FMA",
            5,
        ),
        cuda_rung(
            "vectorized",
            F32,
            VEC_CONSTRAINTS,
            "float4 global and shared loads, A transposed into shared memory, conflict-free thread map",
            6,
        ),
        cuda_rung(
            "warptile",
            F32,
            VEC_CONSTRAINTS,
            "warp tiles of 32×64 (8×8 outputs per thread), 3-stage cp.async ring, two blocks per SM",
            7,
        ),
        cuda_rung(
            "mma",
            FLOATS,
            MMA_CONSTRAINTS,
            "tensor cores: mma.sync m16n8k16 (bf16/f16) or m16n8k8 (tf32) fed by ldmatrix, fp32 accumulate, one cp.async stage",
            8,
        ),
        cuda_rung(
            "mma_pipelined",
            FLOATS,
            MMA_CONSTRAINTS,
            "mma with a 4-stage cp.async ring: the copy of slice k+3 overlaps the math of slice k",
            9,
        ),
        VariantInfo {
            name: "wgmma",
            backend: Backend::Cuda,
            dtypes: FLOATS,
            min_arch: Some(crate::core::device::Arch::SM90),
            constraints: WGMMA_CONSTRAINTS,
            summary: "Hopper: TMA loads into 128B-swizzled smem (4-stage mbarrier ring), wgmma m64n256k16 \
                (tf32: m64n256k8) from shared memory, 1 producer + 2 consumer warpgroups (setmaxnreg), \
                persistent grid, clusters of 2 multicasting B",
            rank: 10,
        },
        VariantInfo {
            name: "skinny",
            backend: Backend::Cuda,
            dtypes: HALVES,
            min_arch: Some(crate::core::device::Arch::SM80),
            constraints: "sm_80+; bf16/f16; m ≤ 64 (declined above: the tiled rungs run taller \
                problems); A row-major and B transposed (both K-contiguous: linear's X and \
                W [n, k]); any n, k, alignment, batches and broadcast. Chosen by default for m ≤ 8 \
                (cuda::skinny_by_default); on Hopper timed against wgmma for m ≤ 64 at a shape \
                class's first use",
            summary: "decode: streams B once with every SM busy — a warp per 16 columns and a \
                k-slice, B by TMA boxes into per-warp rings (sm_90; 16-byte loads on sm_80), \
                mma.sync with B as the A operand, k-slices summed in shared memory",
            rank: 11,
        },
    ]
}

/// How `select` and the CUDA path's `planned` choose when no variant is named (`ferrite info`).
pub const DEFAULT_RULE: &str = "CPU: `parallel`. CUDA f32: `warptile` from 4096² outputs, \
    `vectorized` below (true fp32), or under Precision::Tf32 `wgmma` on Hopper, `mma_pipelined` \
    elsewhere. CUDA bf16/f16: `skinny` for m ≤ 8 with K-contiguous A and B; otherwise `wgmma` on \
    Hopper (rows TMA cannot address re-pitched first, from 2^24 multiply-adds; `mma_pipelined` \
    below; k split over more blocks where C has few tiles) and `mma_pipelined` elsewhere. On \
    Hopper a short A (m ≤ 64, K-contiguous) runs whichever of `skinny` and `wgmma` measured \
    faster at its shape class's first use (remembered in tune.json, like `wgmma`'s launch \
    configuration). The plan is remembered per problem. Measured: `ferrite bench matmul --sweep`.";

const WGMMA_CONSTRAINTS: &str =
    "sm_90a (Hopper only: compute capability 9.x); bf16/f16, and f32 only as tf32 (Precision::Tf32); \
    any shape, any layout (NN/NT/TN/TT), batches and broadcast. bf16/f16: operands whose rows TMA \
    cannot address (base not 16-byte aligned, ld or batch stride not a multiple of 8 elements) \
    are first re-pitched into 16-byte rows (stream-ordered scratch; by default only from \
    cuda::REPITCH_MIN_MACS multiply-adds, mma_pipelined below); C with few tiles splits k \
    (fp32 partials and a reduce pass: cuda::wg_splits). tf32: K-major operands (A row-major, B \
    transposed) with 16-byte aligned rows are read in place, any other operand is first packed \
    into a K-major tf32-rounded copy (stream-ordered scratch)";

const VEC_CONSTRAINTS: &str = "any shape, any layout; 128-bit loads where an operand's rows are \
    16-byte aligned (base, ld and batch stride), predicated scalar loads otherwise";
const MMA_CONSTRAINTS: &str = "sm_80+; any shape, any layout; f32 inputs only as tf32 \
    (Precision::Tf32); 16-byte cp.async where an operand's rows are 16-byte aligned (base, ld and \
    batch stride), element-wise copies otherwise";

/// A CUDA rung of the ladder (sm_80 or newer).
fn cuda_rung(
    name: &'static str,
    dtypes: &'static [DType],
    constraints: &'static str,
    summary: &'static str,
    rank: u32,
) -> VariantInfo {
    VariantInfo {
        name,
        backend: Backend::Cuda,
        dtypes,
        min_arch: Some(crate::core::device::Arch::SM80),
        constraints,
        summary,
        rank,
    }
}

/// Options of one call. `Default` is α = 1, β = 0, best variant, fp32 precision, the device's
/// own stream.
#[derive(Clone, Debug)]
pub struct MatmulOptions {
    /// Run this variant by name ([`variants`] lists them); None picks the best that takes the
    /// request. A named variant that cannot take it is an error saying why, never a silent
    /// fallback.
    pub variant: Option<String>,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of the output's previous contents (0: the output is only written, never read).
    pub beta: f32,
    /// For f32 inputs: `F32` (exact fp32) or `Tf32` (tensor cores). Ignored for f16/bf16.
    pub precision: Precision,
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
    /// CPU threads for the multi-threaded variants (0 = all cores).
    pub threads: usize,
    /// A tuned variant's configuration by name, as `bench` shows it (`wgmma`: `c2g8`, ...; see
    /// `cuda::WG_CONFIGS`); None runs the tuned one (measured at a shape's first use and
    /// remembered on disk). Other variants ignore it.
    pub config: Option<String>,
}

impl Default for MatmulOptions {
    fn default() -> Self {
        MatmulOptions {
            variant: None,
            alpha: 1.0,
            beta: 0.0,
            precision: Precision::F32,
            stream: None,
            threads: 0,
            config: None,
        }
    }
}

/// How one operand is laid out: leading dimension, whether it is stored transposed, batch stride
/// (0 = broadcast), all in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Operand {
    /// Leading dimension: elements between consecutive rows (columns when `trans`).
    pub ld: usize,
    /// Stored column-major (a transposed view of a row-major tensor).
    pub trans: bool,
    /// Elements between consecutive batches; 0 when one matrix serves every batch.
    pub batch_stride: usize,
}

impl Operand {
    /// The same `rows × cols` operand described with `trans` (column-major when true), where
    /// both descriptions address the same elements: empty operands, a single row of a row-major
    /// operand (unit stride), a single column read with unit stride. `validate` reads such
    /// degenerate operands as row-major; a caller whose kernels are specialised for one layout
    /// (linear's W, read transposed) asks for its own, so a 1-row or k = 0 problem runs the same
    /// kernel as the rest instead of compiling another. None when the layouts differ.
    pub fn relaid(self, rows: usize, cols: usize, trans: bool) -> Option<Operand> {
        if self.trans == trans {
            return Some(self);
        }
        // Elements along the stored layout's contiguous (minor) and strided (major) dims; the
        // wanted layout's minor dim is the stored major one.
        let (minor, major) = if self.trans {
            (rows, cols)
        } else {
            (cols, rows)
        };
        let ld = if minor == 0 || major == 0 {
            major.max(1)
        } else if major == 1 {
            // One line with unit stride: the wanted layout walks it one element per line.
            1
        } else if minor == 1 && self.ld == 1 {
            // One element per line, lines one element apart: contiguous in the wanted layout.
            major
        } else {
            return None;
        };
        Some(Operand {
            ld,
            trans,
            batch_stride: self.batch_stride,
        })
    }
}

/// A validated problem: sizes and layouts the variants work from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Gemm {
    /// Independent products (1 for 2-D operands).
    pub batch: usize,
    /// Rows of A and C.
    pub m: usize,
    /// Columns of B and C.
    pub n: usize,
    /// The reduction length: columns of A, rows of B.
    pub k: usize,
    /// A's layout.
    pub a: Operand,
    /// B's layout.
    pub b: Operand,
    /// `trans` is always false for C.
    pub c: Operand,
    /// The shared dtype of A, B and C.
    pub dtype: DType,
    /// The shared device.
    pub device: Device,
}

impl Gemm {
    /// 2·batch·m·n·k: a multiply and an add per term.
    pub fn flops(&self) -> f64 {
        2.0 * self.batch as f64 * self.m as f64 * self.n as f64 * self.k as f64
    }
    /// The fewest bytes any implementation moves: A, B read once, C written once.
    pub fn min_bytes(&self, beta: f32) -> f64 {
        let es = self.dtype.size_in_bytes() as f64;
        let c = self.m as f64 * self.n as f64 * if beta != 0.0 { 2.0 } else { 1.0 };
        self.batch as f64 * es * (self.m as f64 * self.k as f64 + self.k as f64 * self.n as f64 + c)
    }
    /// The problem as the tables show it: `[batch×]m×n×k` and the operand layouts (`NT`, ...).
    pub fn label(&self) -> String {
        let t = |o: &Operand| if o.trans { 'T' } else { 'N' };
        let b = if self.batch != 1 {
            format!("{}×", self.batch)
        } else {
            String::new()
        };
        format!(
            "{b}{}×{}×{} {}{}",
            self.m,
            self.n,
            self.k,
            t(&self.a),
            t(&self.b)
        )
    }
}

/// Reads the layout of a 2-D/3-D operand: (rows, cols, batch, layout).
fn operand(t: &Tensor, arg: &str) -> Result<(usize, usize, usize, Operand)> {
    let r = t.rank();
    if !(2..=3).contains(&r) {
        return Err(Error::bad_arg(
            OP,
            arg,
            "a 2-D [rows, cols] or 3-D [batch, rows, cols] tensor",
            describe(t),
        ));
    }
    let s = t.shape();
    let st = t.strides();
    let (rows, cols) = (s[r - 2], s[r - 1]);
    let (sr, sc) = (st[r - 2], st[r - 1]);
    let (batch, batch_stride) = if r == 3 {
        (s[0], if s[0] > 1 { st[0] } else { 0 })
    } else {
        (1, 0)
    };
    if rows == 0 || cols == 0 {
        // Nothing is read: any layout will do.
        return Ok((
            rows,
            cols,
            batch,
            Operand {
                ld: cols.max(1),
                trans: false,
                batch_stride,
            },
        ));
    }
    // Row-major: unit stride along columns (or a single column), rows `ld` apart.
    if cols <= 1 || sc == 1 {
        let ld = if rows <= 1 { cols.max(1) } else { sr };
        if ld >= cols.max(1) {
            return Ok((
                rows,
                cols,
                batch,
                Operand {
                    ld,
                    trans: false,
                    batch_stride,
                },
            ));
        }
    }
    // Column-major (a transposed view): unit stride along rows.
    if rows <= 1 || sr == 1 {
        let ld = if cols <= 1 { rows.max(1) } else { sc };
        if ld >= rows.max(1) {
            return Ok((
                rows,
                cols,
                batch,
                Operand {
                    ld,
                    trans: true,
                    batch_stride,
                },
            ));
        }
    }
    Err(Error::bad_arg(
        OP,
        arg,
        "stride 1 in one of the last two dims (row-major or a transposed view); call .contiguous()",
        describe(t),
    ))
}

/// Checks A, B and C against each other and returns the problem.
pub fn validate(a: &Tensor, b: &Tensor, c: &Tensor) -> Result<Gemm> {
    for (t, name) in [(b, "b"), (c, "out")] {
        if t.device() != a.device() {
            return Err(Error::bad_arg(
                OP,
                name,
                format!("a tensor on {} (like a)", a.device()),
                describe(t),
            ));
        }
        if t.dtype() != a.dtype() {
            return Err(Error::bad_arg(
                OP,
                name,
                format!("dtype {} (like a)", a.dtype()),
                describe(t),
            ));
        }
    }
    if !FLOATS.contains(&a.dtype()) {
        return Err(Error::bad_arg(
            OP,
            "a",
            "dtype f32, f16 or bf16",
            describe(a),
        ));
    }
    if c.shares_storage(a) || c.shares_storage(b) {
        return Err(Error::bad_arg(
            OP,
            "out",
            "a buffer distinct from a and b",
            "a view of an input",
        ));
    }
    let (m, ka, ba, ao) = operand(a, "a")?;
    let (kb, n, bb, bo) = operand(b, "b")?;
    if ka != kb {
        return Err(Error::bad_arg(
            OP,
            "b",
            format!("{ka} rows (a is {m}×{ka})"),
            format!("{} (inner dims {ka} vs {kb})", describe(b)),
        ));
    }
    let batch = match (a.rank(), b.rank()) {
        (3, 3) if ba != bb => {
            return Err(Error::bad_arg(
                OP,
                "b",
                format!("batch {ba} (like a)"),
                describe(b),
            ));
        }
        (3, _) => ba,
        (_, 3) => bb,
        _ => 1,
    };
    let want_rank = a.rank().max(b.rank());
    let want: Vec<usize> = if want_rank == 3 {
        vec![batch, m, n]
    } else {
        vec![m, n]
    };
    if c.shape() != want.as_slice() {
        return Err(Error::bad_arg(
            OP,
            "out",
            format!("shape {want:?}"),
            describe(c),
        ));
    }
    let (_, _, _, co) = operand(c, "out")?;
    if co.trans && m > 1 && n > 1 {
        return Err(Error::bad_arg(
            OP,
            "out",
            "stride 1 in its last dim (row-major)",
            describe(c),
        ));
    }
    let co = Operand {
        ld: if co.trans { n.max(1) } else { co.ld },
        trans: false,
        ..co
    };
    if batch > 1 && m > 0 && n > 0 && co.batch_stride < (m - 1) * co.ld + n {
        return Err(Error::bad_arg(
            OP,
            "out",
            "batches that do not overlap (batch stride ≥ rows·ld)",
            describe(c),
        ));
    }
    // Sizes kernels and cuBLAS index with: keep every extent addressable in 64-bit products.
    for (name, v) in [("m", m), ("n", n), ("k", ka), ("batch", batch)] {
        if v > i32::MAX as usize {
            return Err(Error::bad_arg(OP, name, format!("≤ {}", i32::MAX), v));
        }
    }
    Ok(Gemm {
        batch,
        m,
        n,
        k: ka,
        a: ao,
        b: bo,
        c: co,
        dtype: a.dtype(),
        device: a.device(),
    })
}

fn precision_of(g: &Gemm, opts: &MatmulOptions) -> Precision {
    match g.dtype {
        DType::F32 => opts.precision,
        d => Precision::of(d),
    }
}

/// Picks the variant that will run `g` under `opts`.
pub fn select(g: &Gemm, opts: &MatmulOptions) -> Result<VariantInfo> {
    let vs = variants();
    let backend = Backend::of(g.device);
    let arch = crate::core::cuda::arch_of(g.device)?;
    let prec = precision_of(g, opts);
    let v = variant::select(
        OP,
        &vs,
        opts.variant.as_deref(),
        backend,
        g.dtype,
        arch,
        |v| {
            let tensor_core = v.backend == Backend::Cuda && cuda::tensor_core(v.name);
            if v.backend == Backend::Cuda && v.name == "skinny" {
                return cuda::skinny_refuses(g, opts.variant.is_some());
            }
            if v.backend == Backend::Cuda && v.name == "wgmma" {
                if arch.is_some_and(|a| a.major != 9) {
                    return Some(cuda::WGMMA_ARCH.to_string());
                }
                if let Some(why) = cuda::wgmma_declines(g) {
                    return Some(why);
                }
                if opts.variant.is_none() {
                    if let Some(why) = cuda::wgmma_default_refuses(g) {
                        return Some(why);
                    }
                }
            }
            match prec {
                Precision::Tf32 if !tensor_core => {
                    Some("has no tf32 mode (tensor-core variants do)".to_string())
                }
                Precision::F32 if tensor_core => Some(
                    "runs f32 inputs only as tf32 (ask for Precision::Tf32); the SIMT rungs are true fp32"
                        .to_string(),
                ),
                _ => None,
            }
        },
    )?;
    if opts.variant.is_none() && v.name == "warptile" && !warptile_fills(g) {
        // `warptile` leads where measured (H100: 0.81× / 0.82× cuBLAS fp32 at 4096³ /
        // 8192³ against `vectorized`'s 0.74×; docs/matmul.md), but its 256×128 tiles, one block
        // per SM, fill the GPU only from large outputs: below that the default stays on
        // `vectorized` (128×128 tiles, two blocks per SM).
        if let Some(fast) = vs
            .iter()
            .find(|x| x.name == F32_DEFAULT && x.backend == v.backend)
        {
            return Ok(fast.clone());
        }
    }
    Ok(v.clone())
}

/// The fp32 SIMT rung the default selection runs on CUDA below `warptile`'s size (see `select`).
pub const F32_DEFAULT: &str = "vectorized";

/// Outputs (m·n·batch) from which the default f32 selection takes `warptile`: 4096², the
/// smallest square measured ahead (3.9 waves of its 256×128 tiles on an H100).
pub const WARPTILE_MIN_OUTPUTS: u64 = 4096 * 4096;

fn warptile_fills(g: &Gemm) -> bool {
    (g.m as u64)
        .saturating_mul(g.n as u64)
        .saturating_mul(g.batch as u64)
        >= WARPTILE_MIN_OUTPUTS
}

/// out = α·a·b + β·out, into a caller-provided output.
pub fn matmul_into(a: &Tensor, b: &Tensor, out: &Tensor, opts: &MatmulOptions) -> Result<()> {
    let g = validate(a, b, out)?;
    if g.device.is_cuda() {
        // Selects, plans and remembers the plan per problem (`cuda::gemm_ptrs`).
        return cuda::run(&g, a, b, out, opts);
    }
    let v = select(&g, opts)?;
    if g.batch == 0 || g.m == 0 || g.n == 0 {
        return Ok(());
    }
    run_cpu(v.name, &g, a, b, out, opts)
}

/// a·b into a new tensor (options as in `matmul_into`, with β ignored: the output starts empty).
pub fn matmul_with(a: &Tensor, b: &Tensor, opts: &MatmulOptions) -> Result<Tensor> {
    let (ra, rb) = (a.rank(), b.rank());
    if !(2..=3).contains(&ra) || !(2..=3).contains(&rb) {
        return Err(Error::bad_arg(
            OP,
            if (2..=3).contains(&ra) { "b" } else { "a" },
            "a 2-D or 3-D tensor",
            describe(if (2..=3).contains(&ra) { b } else { a }),
        ));
    }
    let (m, n) = (a.shape()[ra - 2], b.shape()[rb - 1]);
    let shape: Vec<usize> = match (ra, rb) {
        (3, _) => vec![a.shape()[0], m, n],
        (_, 3) => vec![b.shape()[0], m, n],
        _ => vec![m, n],
    };
    let out = Tensor::empty(&shape, a.dtype(), a.device())?;
    let opts = MatmulOptions {
        beta: 0.0,
        ..opts.clone()
    };
    matmul_into(a, b, &out, &opts)?;
    Ok(out)
}

/// a·b with the best variant.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    matmul_with(a, b, &MatmulOptions::default())
}

/// Runs a CPU variant batch by batch on f32 storage.
fn run_cpu(
    variant: &str,
    g: &Gemm,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    opts: &MatmulOptions,
) -> Result<()> {
    let f: fn(cpu::Sgemm, usize) = match variant {
        "naive" => |s, _| cpu::naive(s),
        "blocked" => |s, _| cpu::blocked(s),
        "simd" => |s, _| cpu::simd(s),
        "parallel" => cpu::parallel,
        other => {
            return Err(Error::NoVariant {
                op: OP.into(),
                msg: format!("no CPU variant named `{other}`"),
            })
        }
    };
    a.with_cpu::<f32, _>(|a_s| {
        b.with_cpu::<f32, _>(|b_s| {
            c.with_cpu_mut::<f32, _>(|c_s| {
                for z in 0..g.batch {
                    f(
                        cpu::Sgemm {
                            m: g.m,
                            n: g.n,
                            k: g.k,
                            alpha: opts.alpha,
                            beta: opts.beta,
                            a: &a_s[z * g.a.batch_stride..],
                            lda: g.a.ld,
                            a_trans: g.a.trans,
                            b: &b_s[z * g.b.batch_stride..],
                            ldb: g.b.ld,
                            b_trans: g.b.trans,
                            c: &mut c_s[z * g.c.batch_stride..],
                            ldc: g.c.ld,
                        },
                        opts.threads,
                    );
                }
            })
        })
    })???;
    Ok(())
}

/// The family as the harness sees it.
pub struct Matmul;

impl OpFamily for Matmul {
    fn name(&self) -> &'static str {
        OP
    }
    fn peers(&self) -> Vec<&'static str> {
        vec!["cublas", "cublaslt", check::DEFAULT_PATH]
    }
    fn default_rule(&self) -> Option<&'static str> {
        Some(DEFAULT_RULE)
    }
    fn variants(&self) -> Vec<VariantInfo> {
        variants()
    }
    fn check(&self, cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
        check::run(cfg, out)
    }
    fn bench(
        &self,
        cfg: &BenchConfig,
        ceilings: &Ceilings,
        progress: &mut dyn FnMut(&str),
        out: &mut Vec<BenchRecord>,
    ) -> Result<()> {
        bench::run(cfg, ceilings, progress, out)
    }
    fn kernels(&self) -> Vec<KernelSpec> {
        cuda::kernel_specs()
    }
}

#[cfg(test)]
mod tests;
