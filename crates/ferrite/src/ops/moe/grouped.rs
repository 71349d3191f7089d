//! `grouped_mm` — `torch._grouped_mm`'s semantics for 2-D A and 3-D B (the layer's expert GEMMs
//! exposed alone), and its weight gradient: the API and checks, the CPU path, and the CUDA host
//! code over matmul's grouped kernels.

use super::cuda::{grouped_gemm, Ctx};
use super::{cpu, expect, MoeOptions, FLOATS, MAX_EXPERTS, OP};
use crate::core::cuda::device;
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::tensor::{describe, Tensor};
use crate::ops::matmul::cuda::{self as mm, Grouping, Groups, Ptrs};

/// Checks grouped_mm's operands; returns (rows, k, n, groups, B transposed).
fn validate_grouped(
    a: &Tensor,
    b: &Tensor,
    offs: &Tensor,
    out: &Tensor,
) -> Result<(usize, usize, usize, usize, bool)> {
    let op = "grouped_mm";
    if a.rank() != 2 || !a.is_contiguous() || !FLOATS.contains(&a.dtype()) {
        return Err(Error::bad_arg(
            op,
            "a",
            "a contiguous f32/f16/bf16 [rows, k]",
            describe(a),
        ));
    }
    let (m, k) = (a.shape()[0], a.shape()[1]);
    if b.rank() != 3 || b.dtype() != a.dtype() || b.device() != a.device() || b.shape()[1] != k {
        return Err(Error::bad_arg(
            op,
            "b",
            format!("a {}[groups, {k}, n] on {}", a.dtype(), a.device()),
            describe(b),
        ));
    }
    let (g, n) = (b.shape()[0], b.shape()[2]);
    let st = b.strides();
    // Contiguous, or the transpose of a contiguous [G, n, k] (an nn.Linear weight stack).
    let b_trans = if st == [k * n, n, 1] || n * k == 0 {
        false
    } else if st == [k * n, 1, k] {
        true
    } else {
        return Err(Error::bad_arg(
            op,
            "b",
            "[G, k, n] contiguous, or the transpose of a contiguous [G, n, k]",
            describe(b),
        ));
    };
    if g == 0 || g > MAX_EXPERTS {
        return Err(Error::bad_arg(
            op,
            "b",
            format!("1..={MAX_EXPERTS} groups"),
            describe(b),
        ));
    }
    if offs.shape() != [g] || offs.dtype() != DType::I32 || offs.device() != a.device() {
        return Err(Error::bad_arg(
            op,
            "offs",
            format!("an int32 [{g}] of cumulative row ends on {}", a.device()),
            describe(offs),
        ));
    }
    let ends = offs.to_vec::<i32>()?;
    let mut prev = 0i64;
    for (i, &e) in ends.iter().enumerate() {
        if (e as i64) < prev {
            return Err(Error::bad_arg(
                op,
                "offs",
                "nondecreasing cumulative row ends",
                format!("offs[{i}] = {e} after {prev}"),
            ));
        }
        prev = e as i64;
    }
    if prev != m as i64 {
        return Err(Error::bad_arg(
            op,
            "offs",
            format!("the last end = rows of a = {m}"),
            prev,
        ));
    }
    expect(out, "out", &[m, n], a.dtype(), a.device())?;
    if out.shares_storage(a) || out.shares_storage(b) {
        return Err(Error::bad_arg(
            op,
            "out",
            "a buffer distinct from a and b",
            "a view of one",
        ));
    }
    Ok((m, k, n, g, b_trans))
}

/// `out[rows of g] = a[rows of g]·b[g]` (`torch._grouped_mm` for 2-D a and 3-D b): a `[M, K]`,
/// b `[G, K, N]` (or the transpose of a contiguous `[G, N, K]`), offs int32 `[G]` cumulative
/// row ends (nondecreasing, the last = M; read on the host to check them).
pub fn grouped_mm(
    a: &Tensor,
    b: &Tensor,
    offs: &Tensor,
    out: &Tensor,
    opts: &MoeOptions,
) -> Result<()> {
    let (m, k, n, g, b_trans) = validate_grouped(a, b, offs, out)?;
    match a.device() {
        Device::Cpu => cpu::grouped_mm(a, b, offs, out, (m, k, n, g, b_trans)),
        Device::Cuda(_) => grouped_mm_cuda(a, b, offs, out, (m, k, n, g, b_trans), opts),
    }
}

/// grouped_mm's gradient with respect to b: `db[g] = a[rows of g]ᵀ·dout[rows of g]` (a `[M, K]`,
/// dout `[M, N]`, db `[G, K, N]` contiguous; offs as for `grouped_mm`, read on the host).
pub fn grouped_mm_weight_grad(
    a: &Tensor,
    dout: &Tensor,
    offs: &Tensor,
    db: &Tensor,
    opts: &MoeOptions,
) -> Result<()> {
    let op = "grouped_mm_weight_grad";
    if db.rank() != 3 {
        return Err(Error::bad_arg(
            op,
            "db",
            "a contiguous [groups, k, n]",
            describe(db),
        ));
    }
    let (m, k, n, g, _) = validate_grouped(a, db, offs, dout)?;
    if !db.is_contiguous() {
        return Err(Error::bad_arg(
            op,
            "db",
            "a contiguous [groups, k, n]",
            describe(db),
        ));
    }
    if db.shares_storage(a) || db.shares_storage(dout) {
        return Err(Error::bad_arg(
            op,
            "db",
            "a buffer distinct from a and dout",
            "a view of one",
        ));
    }
    match a.device() {
        Device::Cpu => {
            let (av, gv, ends) = (a.to_f32_vec()?, dout.to_f32_vec()?, offs.to_vec::<i32>()?);
            let mut out = vec![0f32; g * k * n];
            let mut s = 0usize;
            for (ex, &en) in ends.iter().enumerate() {
                for r in s..en as usize {
                    for q in 0..k {
                        let x = av[r * k + q];
                        for j in 0..n {
                            out[ex * k * n + q * n + j] += x * gv[r * n + j];
                        }
                    }
                }
                s = en as usize;
            }
            let dt = a.dtype();
            db.write_f32(&out.iter().map(|&v| cpu::round(dt, v)).collect::<Vec<_>>())
        }
        Device::Cuda(_) => {
            let aligned = offs.to_vec::<i32>()?.iter().all(|&e| e % 64 == 0);
            grouped_mm_weight_grad_cuda(a, dout, offs, db, (m, k, n, g), aligned, opts)
        }
    }
}

/// grouped_mm on the GPU: the M-grouped kernel of the best variant that fits.
pub fn grouped_mm_cuda(
    a: &Tensor,
    b: &Tensor,
    offs: &Tensor,
    out: &Tensor,
    (m, k, n, g, bt): (usize, usize, usize, usize, bool),
    opts: &MoeOptions,
) -> Result<()> {
    let Device::Cuda(di) = a.device() else {
        return Err(Error::Other("moe::cuda::grouped_mm on the CPU".into()));
    };
    let dev = device(di)?;
    let stream = opts.stream.clone().unwrap_or_else(|| dev.stream().clone());
    if m == 0 || n == 0 {
        return Ok(());
    }
    let gm = grouped_gemm(Grouping::M, g, (m, n, k), bt, a.dtype(), a.device());
    let ptrs = Ptrs {
        a: a.device_ptr()?,
        b: b.device_ptr()?,
        c: out.device_ptr()?,
    };
    let wants = opts.variant.as_deref();
    let kind = match wants {
        Some("grouped") => "mma_pipelined",
        Some("wgmma") => "wgmma",
        Some(other) => {
            return Err(Error::bad_arg(
                "grouped_mm",
                "variant",
                "grouped or wgmma (CUDA)",
                other,
            ))
        }
        None => {
            let aligned = [ptrs.a, ptrs.b, ptrs.c]
                .iter()
                .all(|p| p.is_multiple_of(16));
            if dev.arch().major == 9
                && a.dtype() != DType::F32
                && aligned
                && mm::wgmma_declines_unpadded(&gm).is_none()
            {
                "wgmma"
            } else {
                "mma_pipelined"
            }
        }
    };
    if k == 0 {
        // Every row's sum is empty: zeros.
        return Ctx::on(dev.clone(), stream.clone(), a.dtype()).zero(out);
    }
    let l = mm::plan_grouped(kind, &gm, Grouping::M, &dev)?;
    let groups = Groups {
        mode: Grouping::M,
        ends: offs.device_ptr()?,
        groups: g,
    };
    mm::launch_grouped(&l, &gm, ptrs, groups, 1.0, 0.0, &stream).map_err(|e| match e {
        Error::NoVariant { msg, .. } => Error::NoVariant { op: OP.into(), msg },
        e => e,
    })
}

/// `db[g] = a[rows of g]ᵀ·dout[rows of g]` (grouped_mm's weight gradient, a K-grouped GEMM):
/// `wgmma` when every boundary is a multiple of 64 rows (whole TMA k slices), else the mma.sync
/// kernel, which predicates k against each group's own length.
#[allow(clippy::too_many_arguments)]
pub fn grouped_mm_weight_grad_cuda(
    a: &Tensor,
    dout: &Tensor,
    offs: &Tensor,
    db: &Tensor,
    (m, k, n, g): (usize, usize, usize, usize),
    aligned: bool,
    opts: &MoeOptions,
) -> Result<()> {
    let Device::Cuda(di) = a.device() else {
        return Err(Error::Other(
            "moe::cuda::grouped_mm_weight_grad on the CPU".into(),
        ));
    };
    let dev = device(di)?;
    let stream = opts.stream.clone().unwrap_or_else(|| dev.stream().clone());
    let x = Ctx::on(dev.clone(), stream.clone(), a.dtype());
    if k == 0 || n == 0 {
        return Ok(());
    }
    if m == 0 {
        return x.zero(db);
    }
    let gm = grouped_gemm(Grouping::K, g, (k, n, m), false, a.dtype(), a.device());
    let ptrs = Ptrs {
        a: a.device_ptr()?,
        b: dout.device_ptr()?,
        c: db.device_ptr()?,
    };
    let fits = [ptrs.a, ptrs.b, ptrs.c]
        .iter()
        .all(|p| p.is_multiple_of(16));
    let kind = match opts.variant.as_deref() {
        Some("grouped") => "mma_pipelined",
        _ if aligned
            && fits
            && dev.arch().major == 9
            && a.dtype() != DType::F32
            && mm::wgmma_declines_unpadded(&gm).is_none() =>
        {
            "wgmma"
        }
        _ => "mma_pipelined",
    };
    let l = mm::plan_grouped(kind, &gm, Grouping::K, &dev)?;
    let groups = Groups {
        mode: Grouping::K,
        ends: offs.device_ptr()?,
        groups: g,
    };
    mm::launch_grouped(&l, &gm, ptrs, groups, 1.0, 0.0, &stream)
}
