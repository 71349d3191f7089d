//! CUDA host code of the scaled GEMM: the rungs' programs and launches, and cuBLASLt's FP8
//! matmul as the vendor peer.

use super::{Problem, ScaledMmOptions, OP};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::tma::matrix_map;
use crate::core::cuda::{device, CudaDevice, Kernel, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;
use std::sync::Arc;

const NAIVE: KernelSource = kernel_source!("scaled_mm", "kernels/naive.cu");
const WGMMA: KernelSource = kernel_source!("scaled_mm", "kernels/wgmma.cu");

/// Threads of a `wgmma` block: a producer warpgroup and two consumer warpgroups.
const WG_THREADS: u32 = 384;

/// A `wgmma` build: tile columns, ring stages, promotion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WgBuild {
    /// Columns of the 128-row tile (256 fast, 128 promoted).
    pub bn: u32,
    /// Stages of the TMA ring.
    pub stages: u32,
    /// Each stage's partial sum added into fp32 registers.
    pub promote: bool,
}

/// `wgmma_fast`: 128×256 tiles, 4 stages of 48 KiB.
pub const FAST: WgBuild = WgBuild {
    bn: 256,
    stages: 4,
    promote: false,
};
/// `wgmma` on most problems: 128×192 tiles, 4 stages of 40 KiB, promotion.
pub const PROMOTED: WgBuild = WgBuild {
    bn: 192,
    stages: 4,
    promote: true,
};
/// `wgmma` where 192-column tiles would leave the last wave short: 128×128 tiles, 6 stages.
pub const PROMOTED_128: WgBuild = WgBuild {
    bn: 128,
    stages: 6,
    promote: true,
};
/// How much faster a 128×192 promoted tile runs per multiply-add than a 128×128 one (less shared
/// memory read per multiply-add, a wider wgmma): measured on the H200 at 8192³ 1.043 → 0.938 ms
/// and at 8192×14336×4096 0.952 → 0.855 ms.
const WIDE_PROMOTED_GAIN: f64 = 1.1;

/// The promoted build for `p`: the tile width whose whole waves of tiles (⌈tiles / SMs⌉ rounds
/// of a tile's work) take least. 4096³ is 1024 tiles of 128 columns (8 rounds) against 704 of
/// 192 (6 rounds of 1.5× the work, 1.1× faster each): 128 columns (measured 0.119 against 0.128
/// ms); 8192³: 192 columns.
pub fn promoted_for(p: &Problem, sms: u32) -> WgBuild {
    let cost = |w: WgBuild| {
        let tiles = p.m.div_ceil(128) * p.n.div_ceil(w.bn as usize);
        let rounds = tiles.div_ceil(sms.max(1) as usize).max(1) as f64;
        let speed = if w.bn == 192 { WIDE_PROMOTED_GAIN } else { 1.0 };
        rounds * w.bn as f64 / speed
    };
    if cost(PROMOTED) < cost(PROMOTED_128) {
        PROMOTED
    } else {
        PROMOTED_128
    }
}

impl WgBuild {
    /// The build a `wgmma` variant runs `p` with on `sms` SMs (None: not a `wgmma` variant).
    pub fn of(variant: &str, p: &Problem, sms: u32) -> Option<WgBuild> {
        match variant {
            "wgmma_fast" => Some(FAST),
            "wgmma" => Some(promoted_for(p, sms)),
            _ => None,
        }
    }

    /// Whether the build for D of `out` has the TMA-store epilogue (16-bit D).
    pub fn tma_store(out: DType) -> bool {
        out.size_in_bytes() == 2
    }
    /// Ring stages of the build for D of `out`: the fast rung's TMA-store build gives one stage
    /// up for its staging area (3 × 48 KiB + 64 KiB).
    pub fn stages_for(self, out: DType) -> u32 {
        if Self::tma_store(out) && self.bn == 256 {
            self.stages - 1
        } else {
            self.stages
        }
    }
    /// Dynamic shared memory of the build for D of `out`: the ring (A 128 rows + B `bn` rows of
    /// 128 bytes per stage), the TMA-store staging area (8 warps × 16 rows × `bn` 16-bit
    /// values), the 2·stages mbarriers, 1 KiB of slack to align the ring to the 1024-byte
    /// swizzle atom.
    pub fn smem(self, out: DType) -> u32 {
        let stages = self.stages_for(out);
        let staging = if Self::tma_store(out) {
            8 * 16 * self.bn * 2
        } else {
            0
        };
        stages * (128 + self.bn) * 128 + staging + 16 * stages + 1024
    }
}

fn fp8_defines(p: Program, a: DType, b: DType, out: DType) -> Program {
    p.define("FE_OUT", out.cuda_name())
        .define("FE_A_E5M2", (a == DType::F8E5M2) as u32)
        .define("FE_B_E5M2", (b == DType::F8E5M2) as u32)
}

pub fn naive_program(a: DType, b: DType, out: DType) -> Program {
    fp8_defines(Program::new(NAIVE), a, b, out)
}

pub fn wgmma_program(a: DType, b: DType, out: DType, w: WgBuild) -> Program {
    fp8_defines(Program::new(WGMMA), a, b, out)
        .define("FE_BN", w.bn)
        .define("FE_STAGES", w.stages_for(out))
        .define("FE_PROMOTE", w.promote as u32)
        .define("FE_TMA_STORE", WgBuild::tma_store(out) as u32)
}

/// Every module the family compiles: the naive kernel for each (A, B, D) dtype triple, the
/// `wgmma` builds below (what the kernel build check and the ptxas spill check see; the other
/// triples compile the same source at first use).
pub fn kernel_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for &a in super::FP8 {
        for &b in super::FP8 {
            for &o in super::OUT_DTYPES {
                v.push(KernelSpec {
                    program: naive_program(a, b, o),
                    functions: vec!["scaled_mm_naive".into()],
                    min_arch: Arch::SM80,
                });
            }
        }
    }
    // e4m3 × {e4m3, e5m2} into bf16 (the TMA-store epilogue) and e4m3 × e4m3 into f32 (stores
    // from the registers).
    for (b, out) in [
        (DType::F8E4M3, DType::BF16),
        (DType::F8E5M2, DType::BF16),
        (DType::F8E4M3, DType::F32),
    ] {
        for w in [FAST, PROMOTED, PROMOTED_128] {
            v.push(KernelSpec {
                program: wgmma_program(DType::F8E4M3, b, out, w),
                functions: vec!["scaled_mm_wgmma".into(), "scaled_mm_splitk_reduce".into()],
                min_arch: Arch::SM90,
            });
        }
    }
    v
}

/// Device pointers of one call: D, A, B, the scales, the bias (0: none).
#[derive(Clone, Copy, Debug)]
pub struct Ptrs {
    pub d: u64,
    pub a: u64,
    pub b: u64,
    pub scale_a: u64,
    pub scale_b: u64,
    pub bias: u64,
}

impl Ptrs {
    #[allow(clippy::too_many_arguments)]
    pub fn of(
        a: &Tensor,
        b: &Tensor,
        scale_a: &Tensor,
        scale_b: &Tensor,
        bias: Option<&Tensor>,
        out: &Tensor,
    ) -> Result<Ptrs> {
        Ok(Ptrs {
            d: out.device_ptr()?,
            a: a.device_ptr()?,
            b: b.device_ptr()?,
            scale_a: scale_a.device_ptr()?,
            scale_b: scale_b.device_ptr()?,
            bias: match bias {
                Some(t) => t.device_ptr()?,
                None => 0,
            },
        })
    }
}

/// A planned launch: the kernel and, for `wgmma`, its build and its split-K reduce pass.
#[derive(Clone)]
pub struct Launch {
    pub kernel: Kernel,
    pub build: Option<WgBuild>,
    pub reduce: Option<Kernel>,
    /// What the bench's config column shows.
    pub config: String,
}

/// The kernel of `variant` for `p` (compiled at first use, then cached by the device).
pub fn plan(variant: &str, p: &Problem, dev: &Arc<CudaDevice>) -> Result<Launch> {
    match WgBuild::of(variant, p, dev.props().sm_count) {
        Some(w) => {
            let program = wgmma_program(p.a_dtype, p.b_dtype, p.out_dtype, w);
            let kernel = dev.kernel(&program, "scaled_mm_wgmma")?;
            let reduce = Some(dev.kernel(&program, "scaled_mm_splitk_reduce")?);
            kernel.allow_dynamic_smem(w.smem(p.out_dtype))?;
            Ok(Launch {
                kernel,
                build: Some(w),
                reduce,
                config: format!(
                    "128×{} tiles, {} stages{}{}, persistent",
                    w.bn,
                    w.stages_for(p.out_dtype),
                    if w.promote { ", promoted" } else { "" },
                    if WgBuild::tma_store(p.out_dtype) {
                        ", TMA-store epilogue"
                    } else {
                        ""
                    }
                ),
            })
        }
        None if variant == "naive" => Ok(Launch {
            kernel: dev.kernel(
                &naive_program(p.a_dtype, p.b_dtype, p.out_dtype),
                "scaled_mm_naive",
            )?,
            build: None,
            reduce: None,
            config: "16×16 outputs per block".into(),
        }),
        None => Err(Error::NoVariant {
            op: OP.into(),
            msg: format!("no CUDA variant named `{variant}`"),
        }),
    }
}

/// Queues the planned kernel on `p` with operands at `q` (and, after a split-K `wgmma`, its
/// reduce pass).
pub fn launch(
    l: &Launch,
    p: &Problem,
    q: Ptrs,
    dev: &Arc<CudaDevice>,
    stream: &Stream,
) -> Result<()> {
    if p.m == 0 || p.n == 0 {
        return Ok(());
    }
    match l.build {
        None => launch_naive(&l.kernel, p, q, stream),
        Some(w) => launch_wgmma(l, w, p, q, dev, stream),
    }
}

fn launch_naive(kernel: &Kernel, p: &Problem, q: Ptrs, stream: &Stream) -> Result<()> {
    let mut args = KernelArgs::new();
    args.push(q.d)
        .push(q.a)
        .push(q.b)
        .push(q.scale_a)
        .push(q.scale_b)
        .push(q.bias)
        .push(p.m as i64)
        .push(p.n as i64)
        .push(p.k as i64)
        .push(p.lda as i64)
        .push(p.ldb as i64)
        .push(p.ldd as i64)
        .push(p.sa_row as i32)
        .push(p.sb_col as i32);
    let grid = (
        (p.n as u64).div_ceil(16).min(u32::MAX as u64) as u32,
        (p.m as u64).div_ceil(16).clamp(1, 65535) as u32,
        1,
    );
    kernel.launch(stream, grid, (256, 1, 1), 0, &mut args)
}

fn launch_wgmma(
    l: &Launch,
    w: WgBuild,
    p: &Problem,
    q: Ptrs,
    dev: &Arc<CudaDevice>,
    stream: &Stream,
) -> Result<()> {
    if let Some(why) = super::wgmma_declines(p, Some(dev.arch()), &[q.a, q.b]) {
        return Err(Error::NoVariant {
            op: OP.into(),
            msg: format!("CUDA variant `wgmma` {why}"),
        });
    }
    // A: boxes of 128 bytes of k × 128 rows; B: 128 bytes × the tile's columns; 128-byte
    // swizzle, zero fill past every edge.
    let ta = matrix_map(p.a_dtype, q.a, p.k, p.m, p.lda, 1, 0, [128, 128], true)?;
    let tb = matrix_map(p.b_dtype, q.b, p.k, p.n, p.ldb, 1, 0, [128, w.bn], true)?;
    // The TMA store needs D 16-byte aligned with rows of 16-byte multiples; else the direct
    // stores of the same build.
    let es = p.out_dtype.size_in_bytes();
    let store = WgBuild::tma_store(p.out_dtype)
        && q.d.is_multiple_of(16)
        && (p.ldd * es).is_multiple_of(16);
    let td = if store {
        matrix_map(p.out_dtype, q.d, p.n, p.m, p.ldd, 1, 0, [64, 16], true)?
    } else {
        crate::core::cuda::tma::TmaDesc::UNUSED
    };
    let sms = dev.props().sm_count;
    let splits = splits_for(p, w.bn, sms);
    // Split-K's fp32 partials (stream-ordered: freed after the reduce pass is queued).
    let part = if splits > 1 {
        Some(dev.alloc(splits as usize * p.m * p.n * 4, stream)?)
    } else {
        None
    };
    let mut args = KernelArgs::new();
    args.push(q.d)
        .push(q.scale_a)
        .push(q.scale_b)
        .push(q.bias)
        .push(p.m as i32)
        .push(p.n as i32)
        .push(p.k as i32)
        .push(p.ldd as i64)
        .push(p.sa_row as i32)
        .push(p.sb_col as i32)
        .push(ta)
        .push(tb)
        .push(td)
        .push(store as i32)
        .push(part.as_ref().map_or(0, |b| b.ptr()))
        .push(splits as i32);
    let tiles = (p.m as u64).div_ceil(128) * (p.n as u64).div_ceil(w.bn as u64) * splits as u64;
    let blocks = tiles.clamp(1, sms as u64) as u32;
    l.kernel.launch(
        stream,
        (blocks, 1, 1),
        (WG_THREADS, 1, 1),
        w.smem(p.out_dtype),
        &mut args,
    )?;
    match (&part, &l.reduce) {
        (Some(part), Some(reduce)) => launch_reduce(reduce, p, q, part.ptr(), splits, stream),
        _ => Ok(()),
    }
}

/// Split-K's second pass: the `splits` partials at `part` summed in order, scaled, into D.
fn launch_reduce(
    reduce: &Kernel,
    p: &Problem,
    q: Ptrs,
    part: u64,
    splits: u32,
    stream: &Stream,
) -> Result<()> {
    let mut args = KernelArgs::new();
    args.push(q.d)
        .push(part)
        .push(q.scale_a)
        .push(q.scale_b)
        .push(q.bias)
        .push(p.m as i32)
        .push(p.n as i32)
        .push(p.ldd as i64)
        .push(p.sa_row as i32)
        .push(p.sb_col as i32)
        .push(splits as i32);
    let blocks = ((p.m * p.n) as u64).div_ceil(1024).clamp(1, 4096) as u32;
    reduce.launch(stream, (blocks, 1, 1), (256, 1, 1), 0, &mut args)
}

/// Fewest k tiles (of 128) per split: a split's pipeline fill and its partial's write need a few
/// stages of work behind them.
const MIN_SPLIT_KTILES: usize = 4;
/// Most splits: beyond, the partials' traffic outgrows the gain.
const MAX_SPLITS: usize = 16;
/// Split-K's cost model (H200): µs per 128-deep k tile of one block's 128×256 tile at the FP8
/// rate (half for 128×128), the second pass's fixed cost (the workspace's allocation, a launch
/// behind the GEMM) and the rate its fp32 partials move at (bytes per µs).
const SPLIT_US_PER_KTILE_256: f64 = 0.76;
const SPLIT_REDUCE_US: f64 = 6.0;
const SPLIT_BYTES_PER_US: f64 = 2.5e6;

/// Splits of k for `p` on 128×`bn` tiles (1: none). Where fewer than half the SMs would have a
/// tile (decode batches and small prefills against a weight: 64×4096 is 16 tiles of 128×256 on
/// 132 SMs, each block walking all of k alone), k is split into s ranges — tiles·s ≤ SMs, at
/// least 4 k tiles each, none empty — whose fp32 partials a second pass adds in order; s is the
/// one whose k tiles saved per block most exceed that pass (measured on the H200: 64×4096×4096
/// `wgmma_fast` 26.4 → 17.8 µs in 8 splits, `wgmma` 18.0 → 16.7 in 4; 1000×1000×1008 `wgmma`
/// 11 → 19.5 µs in 2, which the model refuses).
pub fn splits_for(p: &Problem, bn: u32, sms: u32) -> u32 {
    let tiles = p.m.div_ceil(128) * p.n.div_ceil(bn as usize);
    if tiles == 0 || tiles * 2 > sms as usize {
        return 1;
    }
    let ktiles = p.k.div_ceil(128);
    let most = (sms as usize / tiles)
        .min(ktiles / MIN_SPLIT_KTILES)
        .min(MAX_SPLITS);
    let per_ktile = SPLIT_US_PER_KTILE_256 * bn as f64 / 256.0;
    let mn = (p.m * p.n) as f64;
    let gain = |s: usize| {
        let saved = (ktiles - ktiles.div_ceil(s)) as f64 * per_ktile;
        saved - SPLIT_REDUCE_US - 2.0 * s as f64 * mn * 4.0 / SPLIT_BYTES_PER_US
    };
    let Some(s) = (2..=most)
        .max_by(|&a, &b| gain(a).total_cmp(&gain(b)))
        .filter(|&s| gain(s) > 0.0)
    else {
        return 1;
    };
    // Split z starts at z·⌈ktiles/s⌉: as many splits as that needs, so none is empty.
    ktiles.div_ceil(ktiles.div_ceil(s)) as u32
}

/// `plan`, remembered per (device, variant, dtypes, tile width): a call's host work is then its
/// checks, the three tensor maps and the launch.
fn planned(variant: &'static str, p: &Problem, dev: &Arc<CudaDevice>) -> Result<Launch> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    type Key = (usize, &'static str, DType, DType, DType, u32);
    static PLANS: OnceLock<Mutex<HashMap<Key, Launch>>> = OnceLock::new();
    let bn = WgBuild::of(variant, p, dev.props().sm_count).map_or(0, |w| w.bn);
    let key = (
        dev.ordinal(),
        variant,
        p.a_dtype,
        p.b_dtype,
        p.out_dtype,
        bn,
    );
    let plans = PLANS.get_or_init(Default::default);
    if let Some(l) = plans.lock().unwrap().get(&key) {
        return Ok(l.clone());
    }
    let l = plan(variant, p, dev)?;
    plans.lock().unwrap().insert(key, l.clone());
    Ok(l)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    variant: &'static str,
    p: &Problem,
    a: &Tensor,
    b: &Tensor,
    scale_a: &Tensor,
    scale_b: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
    opts: &ScaledMmOptions,
) -> Result<()> {
    let Device::Cuda(i) = p.device else {
        unreachable!("scaled_mm cuda path on {}", p.device)
    };
    let dev = device(i)?;
    let stream = opts.stream.clone().unwrap_or_else(|| dev.stream().clone());
    let l = planned(variant, p, &dev)?;
    let q = Ptrs::of(a, b, scale_a, scale_b, bias, out)?;
    launch(&l, p, q, &dev, &stream)
}

/// cuBLASLt's FP8 matmul on the same problem (tensor-wise scales only, as cuBLASLt takes them
/// on Hopper; e5m2 × e5m2 is not offered): the peer of the checks and the bench. `fast_accum`:
/// cuBLASLt's FAST_ACCUM (torch's `use_fast_accum=True`), else its promoted accumulation.
pub struct LtFp8 {
    plan: crate::ops::matmul::cuda::LtPlan,
}

impl LtFp8 {
    /// Why cuBLASLt cannot run `p` (None: it can).
    pub fn declines(p: &Problem) -> Option<&'static str> {
        if p.sa_row || p.sb_col {
            Some("row-wise scales (cuBLASLt takes one scale per tensor on Hopper)")
        } else if p.a_dtype == DType::F8E5M2 && p.b_dtype == DType::F8E5M2 {
            Some("e5m2 × e5m2")
        } else if !p.lda.is_multiple_of(16)
            || !p.ldb.is_multiple_of(16)
            || !(p.ldd * p.out_dtype.size_in_bytes()).is_multiple_of(16)
        {
            Some("row pitches that are not 16-byte multiples")
        } else {
            None
        }
    }

    pub fn new(
        dev: &Arc<CudaDevice>,
        p: &Problem,
        q: Ptrs,
        fast_accum: bool,
        stream: &Stream,
    ) -> Result<LtFp8> {
        use crate::ops::matmul::cuda::{LtOperands, LtPlan};
        if let Some(why) = Self::declines(p) {
            return Err(Error::NoVariant {
                op: OP.into(),
                msg: format!("cuBLASLt FP8 does not take {why}"),
            });
        }
        // cuBLAS's column-major view of D = A·Bᵀ: Dᵀ (n × m) = op(B')·op(A') with its first
        // operand our B ([n][k] rows: k × n column-major, transposed) and its second our A.
        let plan = LtPlan::with_operands(
            dev,
            &LtOperands {
                label: p.label(),
                m: p.m,
                n: p.n,
                k: p.k,
                a_dtype: p.a_dtype,
                b_dtype: p.b_dtype,
                c_dtype: p.out_dtype,
                lda: p.lda,
                ldb: p.ldb,
                ldc: p.ldd,
                scale_a: q.scale_a,
                scale_b: q.scale_b,
                bias: q.bias,
                fast_accum,
            },
            stream,
        )?;
        Ok(LtFp8 { plan })
    }

    /// Queues D = sa·sb·A·Bᵀ (+ bias).
    pub fn run(&self, q: Ptrs) -> Result<()> {
        self.plan.run(
            crate::ops::matmul::cuda::Ptrs {
                a: q.a,
                b: q.b,
                c: q.d,
            },
            1.0,
            0.0,
        )
    }

    /// cuBLASLt's algorithm, for the bench's config column.
    pub fn config(&self) -> &str {
        &self.plan.config
    }
}
