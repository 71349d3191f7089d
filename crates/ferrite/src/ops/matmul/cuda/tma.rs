//! The TMA tensor maps of matmul's kernels: A and B of `wgmma`, its TMA-stored outputs, and B of
//! `skinny` on sm_90 (encoded by `core::cuda::tma`).

use super::wgmma::{wg_bk, WG_TILE};
use super::Ptrs;
pub(super) use crate::core::cuda::tma::{encode, matrix_map as tensor_map, TmaDesc};
use crate::core::error::{Error, Result};
use crate::ops::matmul::epilogue::EpiPtrs;
use crate::ops::matmul::{Gemm, OP};

/// Whether a launch of a TMA-store `wgmma` kernel can store C (and Z) by TMA: beta = 0 (C is
/// only written), k > 0, and the base, row pitch and batch stride of C and of a present Z
/// multiples of 16 bytes (TMA's rule).
pub(super) fn wg_tma_store_ok(g: &Gemm, c: u64, beta: f32, e: &EpiPtrs) -> bool {
    let es = g.dtype.size_in_bytes();
    let aligned = |ptr: u64, ld: usize, stride: usize| {
        ptr.is_multiple_of(16)
            && (ld * es).is_multiple_of(16)
            && (g.batch <= 1 || (stride * es).is_multiple_of(16))
    };
    beta == 0.0
        && g.k > 0
        && aligned(c, g.c.ld, g.c.batch_stride)
        && (e.z == 0 || aligned(e.z, e.ldz, e.stride_z))
}

/// The tensor map of an m×n output (C or Z) for the TMA-store epilogue: boxes of 64 columns × 16
/// rows (one consumer warp's store), 128-byte swizzle, as the kernel stages them.
pub(super) fn wgmma_out_map(g: &Gemm, ptr: u64, ld: usize, batch_stride: usize) -> Result<TmaDesc> {
    tensor_map(
        g.dtype,
        ptr,
        g.n,
        g.m,
        ld,
        g.batch,
        batch_stride,
        [64, 16],
        true,
    )
}

/// Tensor maps of A and B for `wgmma`: an operand whose contiguous dim is k is one box of
/// 128 bytes of k (64 bf16/f16, 32 f32) × tile rows; one whose contiguous dim is m / n (16-bit
/// only) is loaded in 64×64 boxes.
pub(super) fn wgmma_maps(g: &Gemm, p: Ptrs, cluster: u32) -> Result<(TmaDesc, TmaDesc)> {
    if g.k == 0 {
        return Ok((TmaDesc::UNUSED, TmaDesc::UNUSED));
    }
    if !p.a.is_multiple_of(16) || !p.b.is_multiple_of(16) {
        return Err(Error::NoVariant {
            op: OP.into(),
            msg: "CUDA variant `wgmma` needs 16-byte aligned operand bases (TMA)".into(),
        });
    }
    // With a cluster, each block loads (and multicasts) 1/cluster of the B tile.
    let (bm, bn) = (WG_TILE.0, WG_TILE.1 / cluster);
    let bk = wg_bk(g.dtype);
    let a = if g.a.trans {
        tensor_map(
            g.dtype,
            p.a,
            g.m,
            g.k,
            g.a.ld,
            g.batch,
            g.a.batch_stride,
            [64, 64],
            true,
        )?
    } else {
        tensor_map(
            g.dtype,
            p.a,
            g.k,
            g.m,
            g.a.ld,
            g.batch,
            g.a.batch_stride,
            [bk, bm],
            true,
        )?
    };
    let b = if g.b.trans {
        tensor_map(
            g.dtype,
            p.b,
            g.k,
            g.n,
            g.b.ld,
            g.batch,
            g.b.batch_stride,
            [bk, bn],
            true,
        )?
    } else {
        tensor_map(
            g.dtype,
            p.b,
            g.n,
            g.k,
            g.b.ld,
            g.batch,
            g.b.batch_stride,
            [64, 64],
            true,
        )?
    };
    Ok((a, b))
}

/// B's tensor map for `skinny` on sm_90 (boxes of one pass × 16 rows, no swizzle), or zeros
/// where the kernel reads B without one (sm_80, or B rows not 16-byte aligned: the kernel's
/// `fe_aligned16` test, made here alike).
pub(super) fn skinny_b_map(g: &Gemm, b: u64, box_k: u32, sm90: bool) -> Result<TmaDesc> {
    let es = g.dtype.size_in_bytes();
    let aligned = b.is_multiple_of(16)
        && (g.b.ld * es).is_multiple_of(16)
        && (g.b.batch_stride * es).is_multiple_of(16);
    if !sm90 || !aligned {
        return Ok(TmaDesc::UNUSED);
    }
    tensor_map(
        g.dtype,
        b,
        g.k,
        g.n,
        g.b.ld,
        g.batch,
        g.b.batch_stride,
        [box_k, 16],
        false,
    )
}
