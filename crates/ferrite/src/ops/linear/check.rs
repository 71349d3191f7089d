//! `ferrite check linear`: forward Y and Z and backward dX, dW, db of every variant against an f64
//! reference, for every activation × bias × residual × dtype on odd shapes (outputs poisoned
//! first), and the bias gradient's determinism (two backward runs, same bits).

use super::{
    backward_into, forward_into, variants, Activation, Bwd, BwdOut, Fwd, FwdOut, LinearOptions, OP,
};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::check::rel_error_in;

/// ‖out − reference‖ / ‖max(|reference|, magnitude, dtype's smallest normal)‖: the relative
/// error against the size of the terms that were summed (so cancellation in the sum does not
/// inflate it), and against the dtype's subnormal quantum for tiny values; NaN fails.
fn error_vs_terms(out: &[f64], reference: &[f64], magnitude: &[f64], dtype: DType) -> f64 {
    let tiny = dtype.min_normal().unwrap_or(0.0);
    let scale: Vec<f64> = reference
        .iter()
        .zip(magnitude)
        .map(|(r, m)| r.abs().max(*m).max(tiny))
        .collect();
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for ((&o, &r), &s) in out.iter().zip(reference).zip(&scale) {
        if !o.is_finite() || out.len() != reference.len() {
            return f64::INFINITY;
        }
        num += (o - r) * (o - r);
        den += s * s;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}
use crate::core::harness::{CheckConfig, CheckRecord, Precision};
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;
use rayon::prelude::*;

/// One problem: X is `lead + [k]`, W `[n, k]`.
#[derive(Clone, Debug)]
pub struct Case {
    pub lead: Vec<usize>,
    pub n: usize,
    pub k: usize,
    /// Check every activation × bias × residual combination (else three representative ones).
    pub all_combos: bool,
    /// Checked on CUDA devices only: a shape for a GPU scheduling path, too slow for the CPU
    /// variants' quick check.
    pub gpu_only: bool,
}

impl Case {
    fn new(lead: &[usize], n: usize, k: usize, all_combos: bool) -> Case {
        Case {
            lead: lead.to_vec(),
            n,
            k,
            all_combos,
            gpu_only: false,
        }
    }
    fn gpu_only(self) -> Case {
        Case {
            gpu_only: true,
            ..self
        }
    }
    pub fn m(&self) -> usize {
        self.lead.iter().product()
    }
    pub fn label(&self) -> String {
        let lead: Vec<String> = self.lead.iter().map(|d| d.to_string()).collect();
        format!("[{}]×{}←{}", lead.join("×"), self.n, self.k)
    }
}

/// Odd shapes (1, 3, 127, 4097 as m, n or k), a 3-D X, k = 0, and shapes whose rows are 16-byte
/// aligned (in a multiple of 8) so `persistent` (TMA) runs them, with edges in every dim and (from
/// 264×520 on) whole interior tiles, which take the kernels' pair epilogue.
pub fn cases(quick: bool) -> Vec<Case> {
    let mut v = vec![
        Case::new(&[1], 1, 1, true),
        Case::new(&[7], 5, 3, true),
        Case::new(&[2, 3], 17, 9, true),
        Case::new(&[127], 255, 33, true),
        Case::new(&[72], 136, 64, true),
        // Whole interior tiles of `persistent` (128×256 per block, clusters of two along m) beside
        // edge tiles in both dims and a cluster's block past the last row: the pair epilogue of
        // the interior tiles and the element-wise one of the edges, in every combination.
        Case::new(&[264], 520, 64, true),
        // Rows a multiple of 64 and `in` of 256: every dX tile takes the activation-backward
        // epilogue's TMA path, which then also writes db_pre's column sums (an odd count of row
        // tiles: a cluster's block past the last one writes none).
        Case::new(&[384], 136, 512, false),
        // The same with 17 × 9 = 153 dX tiles: on the H100's 132 SMs some blocks take two, so
        // the helpers finish a first tile alone and share the last with the consumer warps.
        Case::new(&[2176], 72, 2304, false).gpu_only(),
        // `skinny` (at most 64 rows of X): 4 tiles of 8 rows with n and k edges (k = 200 ends
        // inside a 32-k chunk), every epilogue combination; one row split over k-slices.
        Case::new(&[3, 7], 100, 200, true),
        Case::new(&[1], 4104, 2056, false).gpu_only(),
        // dW [200, 384] is 4 output tiles over 4096 rows: the split-K path (4 slices).
        Case::new(&[4096], 200, 384, false).gpu_only(),
        Case::new(&[5], 7, 0, false),
    ];
    if !quick {
        v.extend([
            Case::new(&[4097], 129, 95, false),
            Case::new(&[3, 333], 520, 264, false),
            Case::new(&[1000], 1000, 1000, false),
            Case::new(&[4096], 2304, 192, false),
        ]);
    }
    v
}

/// (activation, bias, residual) combinations of a case. Z is requested when bias and residual
/// are both present or both absent (`wants_z`), so every activation meets all four Z × residual
/// pairings (the pair epilogue of `persistent_pairs` is one kernel copy per pairing) and Z both
/// with and without bias.
fn combos(all: bool) -> Vec<(Activation, bool, bool)> {
    if all {
        let mut v = Vec::new();
        for a in Activation::ALL {
            for b in [false, true] {
                for r in [false, true] {
                    v.push((a, b, r));
                }
            }
        }
        v
    } else {
        vec![
            (Activation::None, false, false),
            (Activation::GeluTanh, true, true),
            (Activation::Silu, true, false),
            (Activation::GeluErf, false, true),
        ]
    }
}

/// X·Wᵀ in f64, `[m, n]`.
pub fn gemm_ref(x: &[f64], w: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0f64; m * n];
    out.par_chunks_mut(n.max(1)).enumerate().for_each(|(i, o)| {
        let xr = &x[i * k..(i + 1) * k];
        for (j, oj) in o.iter_mut().enumerate() {
            let wr = &w[j * k..(j + 1) * k];
            *oj = xr.iter().zip(wr).map(|(a, b)| a * b).sum();
        }
    });
    out
}

fn rand(shape: &[usize], dtype: DType, dev: Device, seed: u64, lo: f64, hi: f64) -> Result<Tensor> {
    Tensor::rand(shape, dtype, dev, seed, lo, hi)
}

fn sync(dev: Device, what: &str) -> Result<()> {
    if let Device::Cuda(i) = dev {
        let d = crate::core::cuda::device(i)?;
        d.synchronize(d.stream(), what)?;
    }
    Ok(())
}

/// The precision a variant is held to for `dtype`: tensor-core variants run f32 as tf32.
pub fn precision_for(variant: &str, backend: Backend, dtype: DType) -> Precision {
    if dtype == DType::F32 && backend == Backend::Cuda && variant != "naive" {
        Precision::Tf32
    } else {
        Precision::of(dtype)
    }
}

struct Rec<'a> {
    variant: &'a str,
    dev: Device,
    dtype: DType,
    precision: Precision,
}

impl Rec<'_> {
    fn push(&self, out: &mut Vec<CheckRecord>, label: String, r: Result<f64>) {
        out.push(match r {
            Ok(err) => CheckRecord::compared(
                OP,
                self.variant,
                self.dev,
                self.dtype,
                self.precision,
                label,
                err,
                String::new(),
            ),
            Err(e) => {
                CheckRecord::errored(OP, self.variant, self.dev, self.dtype, label, e.to_string())
            }
        });
    }
}

/// Whether an error is a variant declining a case by its stated constraints (not a failure).
fn declined(e: &Error) -> bool {
    matches!(e, Error::NoVariant { msg, .. } if msg.contains("cannot run this request"))
}

/// The record name of matmul's `naive` kernel with the fused epilogue (no linear variant uses it;
/// checked here so that every epilogue kernel runs on the GPU).
pub const GEMM_NAIVE_EPI: &str = "matmul_naive+epilogue";

/// `forward_into`, or for GEMM_NAIVE_EPI the epilogue hook on matmul's naive kernel directly.
fn run_forward(i: &Fwd, o: &FwdOut, opts: &LinearOptions) -> Result<()> {
    if opts.variant.as_deref() != Some(GEMM_NAIVE_EPI) {
        return forward_into(i, o, opts);
    }
    let p = super::validate_fwd(i, o)?;
    if p.m == 0 || p.n == 0 {
        return Ok(());
    }
    let g = super::gemm_of(i, o.y)?;
    let dev = i.x.cuda_device()?;
    let l = crate::ops::matmul::cuda::plan_epilogue("naive", &g, &dev, opts.activation)?;
    let ptrs = crate::ops::matmul::cuda::Ptrs {
        a: i.x.device_ptr()?,
        b: i.w.device_ptr()?,
        c: o.y.device_ptr()?,
    };
    let e = super::cuda::epi_ptrs(&p, i, o)?;
    crate::ops::matmul::cuda::launch_with_epilogue(&l, &g, ptrs, 1.0, 0.0, e, dev.stream())
}

/// Forward of one case on one variant, every combination; returns false when the variant
/// declined the case.
fn check_forward(c: &Case, rec: &Rec, seed: u64, out: &mut Vec<CheckRecord>) -> Result<bool> {
    let (m, n, k) = (c.m(), c.n, c.k);
    let (dev, dtype) = (rec.dev, rec.dtype);
    let mut xs = c.lead.clone();
    xs.push(k);
    let mut ys = c.lead.clone();
    ys.push(n);
    let x = rand(&xs, dtype, dev, seed, -1.0, 1.0)?;
    let w = rand(&[n, k], dtype, dev, seed ^ 1, -1.0, 1.0)?;
    let b = rand(&[n], dtype, dev, seed ^ 2, -1.0, 1.0)?;
    let r = rand(&ys, dtype, dev, seed ^ 3, -1.0, 1.0)?;
    let acc = gemm_ref(&x.to_f64_vec()?, &w.to_f64_vec()?, m, n, k);
    let (bv, rv) = (b.to_f64_vec()?, r.to_f64_vec()?);
    for (act, has_b, has_r) in combos(c.all_combos) {
        let wants_z = has_b == has_r;
        let label = format!(
            "{} {act}{}{}",
            c.label(),
            if has_b { "+b" } else { "" },
            match (has_r, wants_z) {
                (true, true) => "+res+Z",
                (true, false) => "+res",
                (false, true) => "+Z",
                (false, false) => "",
            }
        );
        let y = Tensor::empty(&ys, dtype, dev)?;
        y.poison(None)?;
        let z = if wants_z {
            let z = Tensor::empty(&ys, dtype, dev)?;
            z.poison(None)?;
            Some(z)
        } else {
            None
        };
        let opts = LinearOptions {
            variant: Some(rec.variant.into()),
            activation: act,
            precision: rec.precision,
            ..Default::default()
        };
        let run = run_forward(
            &Fwd {
                x: &x,
                w: &w,
                bias: has_b.then_some(&b),
                residual: has_r.then_some(&r),
            },
            &FwdOut {
                y: &y,
                z: z.as_ref(),
            },
            &opts,
        )
        .and_then(|_| sync(dev, &format!("linear/{}", rec.variant)));
        match run {
            Err(e) if declined(&e) => return Ok(false),
            Err(e) => {
                rec.push(out, label, Err(e));
                continue;
            }
            Ok(()) => {}
        }
        let zref: Vec<f64> = (0..m * n)
            .map(|e| acc[e] + if has_b { bv[e % n] } else { 0.0 })
            .collect();
        let yref: Vec<f64> = (0..m * n)
            .map(|e| act.apply_f64(zref[e]) + if has_r { rv[e] } else { 0.0 })
            .collect();
        // Error relative to the size of the terms, not of their sum: Z = acc + b and
        // Y = act(Z) + R may cancel (a 1×1←1 case is one such sum), and each term carries its own
        // rounding (tf32 inputs, a 16-bit Z between the unfused kernels).
        let zmag: Vec<f64> = (0..m * n)
            .map(|e| acc[e].abs() + if has_b { bv[e % n].abs() } else { 0.0 })
            .collect();
        let ymag: Vec<f64> = (0..m * n)
            .map(|e| {
                act.apply_f64(zmag[e]).abs().max(zmag[e]) + if has_r { rv[e].abs() } else { 0.0 }
            })
            .collect();
        rec.push(
            out,
            format!("{label} Y"),
            Ok(error_vs_terms(&y.to_f64_vec()?, &yref, &ymag, dtype)),
        );
        if let Some(z) = z {
            rec.push(
                out,
                format!("{label} Z"),
                Ok(error_vs_terms(&z.to_f64_vec()?, &zref, &zmag, dtype)),
            );
        }
    }
    Ok(true)
}

/// Backward of one case: dX, dW, db against f64 for each activation (bias gradient always on).
fn check_backward(c: &Case, rec: &Rec, seed: u64, out: &mut Vec<CheckRecord>) -> Result<()> {
    let (m, n, k) = (c.m(), c.n, c.k);
    let (dev, dtype) = (rec.dev, rec.dtype);
    let mut xs = c.lead.clone();
    xs.push(k);
    let mut ys = c.lead.clone();
    ys.push(n);
    let x = rand(&xs, dtype, dev, seed, -1.0, 1.0)?;
    let w = rand(&[n, k], dtype, dev, seed ^ 1, -1.0, 1.0)?;
    let dy = rand(&ys, dtype, dev, seed ^ 4, -1.0, 1.0)?;
    let z = rand(&ys, dtype, dev, seed ^ 5, -3.0, 3.0)?;
    let (xv, wv, dyv, zv) = (
        x.to_f64_vec()?,
        w.to_f64_vec()?,
        dy.to_f64_vec()?,
        z.to_f64_vec()?,
    );
    let acts: Vec<Activation> = if c.all_combos {
        Activation::ALL.to_vec()
    } else {
        vec![Activation::None, Activation::GeluTanh]
    };
    for act in acts {
        let label = format!("{} {act} backward", c.label());
        let dz: Vec<f64> = (0..m * n).map(|e| dyv[e] * act.grad_f64(zv[e])).collect();
        // dX = dZ·W, dW = dZᵀ·X, db = Σ rows dZ.
        let mut dx_ref = vec![0f64; m * k];
        dx_ref
            .par_chunks_mut(k.max(1))
            .enumerate()
            .for_each(|(i, o)| {
                for j in 0..n {
                    let g = dz[i * n + j];
                    for (p, op) in o.iter_mut().enumerate() {
                        *op += g * wv[j * k + p];
                    }
                }
            });
        let mut dw_ref = vec![0f64; n * k];
        dw_ref
            .par_chunks_mut(k.max(1))
            .enumerate()
            .for_each(|(j, o)| {
                for i in 0..m {
                    let g = dz[i * n + j];
                    for (p, op) in o.iter_mut().enumerate() {
                        *op += g * xv[i * k + p];
                    }
                }
            });
        let db_ref: Vec<f64> = (0..n)
            .map(|j| (0..m).map(|i| dz[i * n + j]).sum())
            .collect();
        // Σ |terms| per column: db is a sum whose terms cancel, so its rounding error scales
        // with them, not with the sum (error_vs_terms).
        let db_mag: Vec<f64> = (0..n)
            .map(|j| (0..m).map(|i| dz[i * n + j].abs()).sum())
            .collect();
        let dx = Tensor::empty(&xs, dtype, dev)?;
        let dw = Tensor::empty(&[n, k], dtype, dev)?;
        let db = Tensor::empty(&[n], dtype, dev)?;
        let opts = LinearOptions {
            variant: Some(rec.variant.into()),
            activation: act,
            precision: rec.precision,
            ..Default::default()
        };
        let run = |dx: &Tensor, dw: &Tensor, db: &Tensor| -> Result<()> {
            for t in [dx, dw, db] {
                t.poison(None)?;
            }
            backward_into(
                &Bwd {
                    dy: &dy,
                    x: &x,
                    w: &w,
                    z: Some(&z),
                    x_pre: None,
                },
                &BwdOut {
                    dx: Some(dx),
                    dw: Some(dw),
                    db: Some(db),
                    db_pre: None,
                },
                &opts,
            )?;
            sync(dev, "linear backward")
        };
        if let Err(e) = run(&dx, &dw, &db) {
            rec.push(out, label, Err(e));
            continue;
        }
        rec.push(
            out,
            format!("{label} dX"),
            Ok(rel_error_in(&dx.to_f64_vec()?, &dx_ref, dtype)),
        );
        rec.push(
            out,
            format!("{label} dW"),
            Ok(rel_error_in(&dw.to_f64_vec()?, &dw_ref, dtype)),
        );
        rec.push(
            out,
            format!("{label} db"),
            Ok(error_vs_terms(&db.to_f64_vec()?, &db_ref, &db_mag, dtype)),
        );
        // Determinism: a second run on the same inputs gives the same db and dW bits.
        if act == Activation::GeluTanh || c.all_combos && act == Activation::None {
            let (db2, dw2) = (
                Tensor::empty(&[n], dtype, dev)?,
                Tensor::empty(&[n, k], dtype, dev)?,
            );
            let dx2 = Tensor::empty(&xs, dtype, dev)?;
            let same = run(&dx2, &dw2, &db2).and_then(|_| {
                Ok(db2.to_bytes()? == db.to_bytes()? && dw2.to_bytes()? == dw.to_bytes()?)
            });
            let r = Rec {
                precision: Precision::Exact,
                ..*rec
            };
            r.push(
                out,
                format!("{label} db,dW bits twice"),
                same.map(|s| if s { 0.0 } else { f64::INFINITY }),
            );
        }
        // The input's own activation (X = act(Z_in), a layer below): dx receives
        // dX ⊙ act'(Z_in), formed in the dX GEMM's epilogue (`wgmma` on the H100, interior tiles
        // and edges) or by the separate pass (`naive`, other GPUs, unaligned shapes).
        if act != Activation::None {
            let z_in = rand(&xs, dtype, dev, seed ^ 6, -3.0, 3.0)?;
            let ref_pre: Vec<f64> = z_in
                .to_f64_vec()?
                .iter()
                .zip(&dx_ref)
                .map(|(&zv, &d)| d * act.grad_f64(zv))
                .collect();
            // The layer below's db: Σ rows of its dZ (from the epilogue's 16-row column sums
            // where every tile writes them — rows a multiple of 64, `in` of 256 — else a pass).
            let mut ref_db_pre = vec![0f64; k];
            let mut mag_db_pre = vec![0f64; k];
            for row in ref_pre.chunks(k.max(1)) {
                for ((a, g), &v) in ref_db_pre.iter_mut().zip(mag_db_pre.iter_mut()).zip(row) {
                    *a += v;
                    *g += v.abs();
                }
            }
            let dx = Tensor::empty(&xs, dtype, dev)?;
            let db_pre = Tensor::empty(&[k], dtype, dev)?;
            let res = dx
                .poison(None)
                .and_then(|_| db_pre.poison(None))
                .and_then(|_| {
                    backward_into(
                        &Bwd {
                            dy: &dy,
                            x: &x,
                            w: &w,
                            z: Some(&z),
                            x_pre: Some((&z_in, act)),
                        },
                        &BwdOut {
                            dx: Some(&dx),
                            dw: None,
                            db: None,
                            db_pre: Some(&db_pre),
                        },
                        &opts,
                    )?;
                    sync(dev, "linear backward (x_pre)")?;
                    Ok((
                        rel_error_in(&dx.to_f64_vec()?, &ref_pre, dtype),
                        error_vs_terms(&db_pre.to_f64_vec()?, &ref_db_pre, &mag_db_pre, dtype),
                    ))
                });
            let (e_dx, e_db) = match res {
                Ok((a, b)) => (Ok(a), Ok(b)),
                Err(e) => {
                    let again = Error::NoVariant {
                        op: super::OP_BWD.into(),
                        msg: format!("the x_pre call failed: {e}"),
                    };
                    (Err(e), Err(again))
                }
            };
            rec.push(out, format!("{label} dX⊙{act}'(Z_in)"), e_dx);
            rec.push(out, format!("{label} db_pre = Σ rows dZ_in"), e_db);
        }
    }
    Ok(())
}

pub fn run(cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
    let mut rng = Rng::new(cfg.seed);
    for &dev in &cfg.devices {
        let backend = Backend::of(dev);
        for v in variants()
            .iter()
            .filter(|v| v.backend == backend && cfg.wants_variant(v.name))
        {
            for &dtype in v.dtypes.iter().filter(|d| cfg.wants_dtype(**d)) {
                let precision = precision_for(v.name, backend, dtype);
                let rec = Rec {
                    variant: v.name,
                    dev,
                    dtype,
                    precision,
                };
                for c in cases(cfg.quick)
                    .into_iter()
                    .filter(|c| backend == Backend::Cuda || !c.gpu_only)
                {
                    let ran = check_forward(&c, &rec, rng.next_u64(), out)?;
                    // The GPU backward is one path for every variant: check it under `naive`
                    // (true fp32 GEMMs for f32) and `fused` (tf32), not again under the others.
                    let bwd = backend == Backend::Cpu || matches!(v.name, "naive" | "fused");
                    if ran && bwd {
                        check_backward(&c, &rec, rng.next_u64(), out)?;
                    }
                }
            }
        }
        if backend == Backend::Cuda && cfg.wants_variant(GEMM_NAIVE_EPI) {
            for dtype in [DType::F32, DType::F16, DType::BF16]
                .into_iter()
                .filter(|d| cfg.wants_dtype(*d))
            {
                let rec = Rec {
                    variant: GEMM_NAIVE_EPI,
                    dev,
                    dtype,
                    precision: Precision::of(dtype),
                };
                for c in cases(true) {
                    check_forward(&c, &rec, rng.next_u64(), out)?;
                }
            }
        }
    }
    Ok(())
}
