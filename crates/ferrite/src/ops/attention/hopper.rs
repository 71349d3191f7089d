//! Host code of the `hopper` rung (kernels/hopper.cu): attention forward on wgmma + TMA with
//! warp-specialised producer/consumer warpgroups (sm_90a). The backward runs the `flash` kernels.

use super::{Problem, Varlen, OP};
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{CudaDevice, KernelArgs, Stream};
use crate::core::device::Arch;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::core::tensor::Tensor;
use crate::kernel_source;
use std::sync::Arc;

const SRC: KernelSource = kernel_source!("attention/hopper", "kernels/hopper.cu");
pub const HEAD_DIMS: [usize; 2] = [64, 128];
const BM: usize = 128;
const BN: usize = 128;
const THREADS: u32 = 384;

/// Kernel configuration: the depth of the (K, V) ring and whether a warpgroup overlaps its
/// softmax with its own P·V (FE_PIPE in hopper.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    pub stages: usize,
    pub pipelined: bool,
}

impl Config {
    /// Fastest or within 3% of it in every case of the H100 sweep (B4 H16 S4096, D 64/128,
    /// causal and not; see docs/attention.md).
    pub const DEFAULT: Config = Config {
        stages: 3,
        pipelined: true,
    };
    pub const ALL: [Config; 4] = [
        Config {
            stages: 2,
            pipelined: false,
        },
        Config {
            stages: 2,
            pipelined: true,
        },
        Config {
            stages: 3,
            pipelined: false,
        },
        Config {
            stages: 3,
            pipelined: true,
        },
    ];
}

pub fn program(dtype: DType, head_dim: usize, cfg: Config, softcap: bool) -> Program {
    Program::new(SRC)
        .define("FE_SOFTCAP", softcap as u32)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_HEAD_DIM", head_dim)
        .define("FE_WGMMA_BF16", (dtype == DType::BF16) as u32)
        .define("FE_STAGES", cfg.stages)
        .define("FE_PIPE", cfg.pipelined as u32)
}

pub fn kernel_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for d in [DType::BF16, DType::F16] {
        for hd in HEAD_DIMS {
            for (cfg, softcap) in [
                (Config::DEFAULT, false),
                (Config::DEFAULT, true),
                (Config::ALL[0], false),
            ] {
                v.push(KernelSpec {
                    program: program(d, hd, cfg, softcap),
                    functions: vec!["attn_hopper_fwd".into()],
                    min_arch: Arch::SM90,
                });
            }
        }
    }
    v
}

/// Why `hopper` cannot run this forward problem (None when it can).
pub fn unfit(p: &Problem, ptrs: &[u64]) -> Option<String> {
    if !matches!(p.dtype, DType::BF16 | DType::F16) {
        return Some(format!("needs bf16 or f16 (got {})", p.dtype));
    }
    if !HEAD_DIMS.contains(&p.head_dim) {
        return Some(format!("needs head dim 64 or 128 (got {})", p.head_dim));
    }
    // A packed varlen batch has no batch stride (the map gives it extent 1).
    let first = if p.varlen { 1 } else { 0 };
    let strides = [p.q_stride, p.k_stride, p.v_stride, p.o_stride];
    if strides
        .iter()
        .any(|s| s[first..].iter().any(|&x| x % 8 != 0 || x <= 0))
    {
        return Some(
            "needs positive batch/seq/head strides, multiples of 8 elements (TMA: 16-byte strides)"
                .into(),
        );
    }
    if ptrs.iter().any(|a| a % 16 != 0) {
        return Some("needs 16-byte aligned q, k, v, o (TMA)".into());
    }
    None
}

/// A CUtensorMap as the kernel's `const __grid_constant__ TmaDesc` parameter (128 bytes).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TmaDesc([u64; 16]);

/// Which tensor-map coordinate (1..=3) carries row, head and batch, as `MapOrder` in hopper.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct MapOrder {
    row: i32,
    head: i32,
    batch: i32,
    pad: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ScoreMap {
    scale_log2: f32,
    cap_in: f32,
    cap_out_log2: f32,
    capped: i32,
}

/// The 4-D tensor map (d, then row/head/batch ordered by increasing stride) of q, k or v, boxes
/// of 64 (d) × `box_rows`, 128-byte swizzle, zero fill outside.
fn tensor_map(
    dtype: DType,
    ptr: u64,
    head_dim: usize,
    (rows, heads, batch): (usize, usize, usize),
    stride: [i64; 3],
    box_rows: u32,
) -> Result<(TmaDesc, MapOrder)> {
    use cudarc::driver::sys;
    let es = dtype.size_in_bytes() as u64;
    // (extent, stride in bytes, which: 0 row, 1 head, 2 batch)
    let mut outer = [
        (rows.max(1) as u64, stride[1] as u64 * es, 0),
        (heads.max(1) as u64, stride[2] as u64 * es, 1),
        (batch.max(1) as u64, stride[0] as u64 * es, 2),
    ];
    outer.sort_by_key(|&(_, s, _)| s);
    let dims = [head_dim as u64, outer[0].0, outer[1].0, outer[2].0];
    let strides = [outer[0].1, outer[1].1, outer[2].1];
    let mut order = [0i32; 3];
    for (slot, &(_, _, which)) in outer.iter().enumerate() {
        order[which] = slot as i32 + 1;
    }
    // The box spans `box_rows` along the row dim, wherever the stride order put it.
    let mut boxd = [64u32, 1, 1, 1];
    for (slot, &(_, _, which)) in outer.iter().enumerate() {
        if which == 0 {
            boxd[slot + 1] = box_rows;
        }
    }
    let estr = [1u32; 4];
    let dt = match dtype {
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        _ => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    };
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: dims/box/element strides hold 4 entries and strides 3 (rank − 1), as the call
    // reads; the map is written by the call.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dt,
            4,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxd.as_ptr(),
            estr.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::cuda(
            format!("cuTensorMapEncodeTiled (dims {dims:?}, strides {strides:?}, box {boxd:?})"),
            format!("{r:?}"),
        ));
    }
    let order = MapOrder {
        row: order[0],
        head: order[1],
        batch: order[2],
        pad: 0,
    };
    // SAFETY: initialised by the successful call above.
    Ok((TmaDesc(unsafe { map.assume_init() }.opaque), order))
}

fn smem_bytes(head_dim: usize, stages: usize) -> u32 {
    let q = BM * head_dim * 2;
    let kv = 2 * BN * head_dim * 2;
    (1024 + q + stages * kv + 8 * (1 + 3 * stages)) as u32
}

#[allow(clippy::too_many_arguments)]
pub(super) fn forward(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    varlen: Option<&Varlen>,
) -> Result<()> {
    forward_with(Config::DEFAULT, dev, stream, p, q, k, v, o, lse, varlen)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn forward_with(
    cfg: Config,
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    p: &Problem,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    varlen: Option<&Varlen>,
) -> Result<()> {
    // Padded: rows = the padded seq length per batch; varlen: rows = the packed total, batch 1.
    let (q_rows, k_rows, batch, cu_q, cu_k, lse_rows) = match varlen {
        Some(vl) => (
            q.shape()[0],
            k.shape()[0],
            1,
            vl.cu_seqlens_q.device_ptr()?,
            vl.cu_seqlens_k.device_ptr()?,
            *lse.shape().last().unwrap_or(&0) as i64,
        ),
        None => (p.seqlen_q, p.seqlen_k, p.batch, 0, 0, p.seqlen_q as i64),
    };
    // Varlen: the batch dim has extent 1; give it a valid stride past the whole tensor.
    let batch_stride = |s: [i64; 3], rows: usize| {
        if varlen.is_some() {
            [s[1].max(s[2]) * rows.max(1) as i64, s[1], s[2]]
        } else {
            s
        }
    };
    let (tq, oq) = tensor_map(
        p.dtype,
        q.device_ptr()?,
        p.head_dim,
        (q_rows, p.heads_q, batch),
        batch_stride(p.q_stride, q_rows),
        BM as u32,
    )?;
    let (tk, okv) = tensor_map(
        p.dtype,
        k.device_ptr()?,
        p.head_dim,
        (k_rows, p.heads_kv, batch),
        batch_stride(p.k_stride, k_rows),
        BN as u32,
    )?;
    let (tv, ov) = tensor_map(
        p.dtype,
        v.device_ptr()?,
        p.head_dim,
        (k_rows, p.heads_kv, batch),
        batch_stride(p.v_stride, k_rows),
        BN as u32,
    )?;
    if (ov.row, ov.head, ov.batch) != (okv.row, okv.head, okv.batch) {
        return Err(Error::NoVariant {
            op: OP.into(),
            msg: "CUDA variant `hopper` needs k and v in the same layout".into(),
        });
    }
    let log2e = std::f32::consts::LOG2_E;
    let capped = p.softcap > 0.0;
    let smap = ScoreMap {
        scale_log2: p.scale * log2e,
        cap_in: if capped { p.scale / p.softcap } else { 0.0 },
        cap_out_log2: if capped { p.softcap * log2e } else { 0.0 },
        capped: capped as i32,
    };
    let smem = smem_bytes(p.head_dim, cfg.stages);
    let kern = dev.kernel(
        &program(p.dtype, p.head_dim, cfg, p.softcap > 0.0),
        "attn_hopper_fwd",
    )?;
    kern.set_max_dynamic_smem(smem)?;
    let mut a = KernelArgs::new();
    a.push(tq)
        .push(tk)
        .push(tv)
        .push(oq)
        .push(okv)
        .push(o.device_ptr()?)
        .push(lse.device_ptr()?)
        .push(cu_q)
        .push(cu_k)
        .push(p.heads_q as i32)
        .push(p.heads_kv as i32)
        .push(p.seqlen_q as i32)
        .push(p.seqlen_k as i32)
        .push(p.o_stride[0])
        .push(p.o_stride[1])
        .push(p.o_stride[2])
        .push(lse_rows)
        .push(p.window_left)
        .push(p.window_right)
        .push(smap);
    let grid = |n: usize, what: &str| {
        u32::try_from(n).map_err(|_| Error::bad_arg(OP, what, "a launch grid within 32 bits", n))
    };
    kern.launch(
        stream,
        (
            grid(p.seqlen_q.div_ceil(BM), "seqlen_q")?,
            grid(p.heads_q, "heads_q")?,
            grid(p.batch, "batch")?,
        ),
        (THREADS, 1, 1),
        smem,
        &mut a,
    )
}
