//! `ferrite check scaled_mm`: every rung against the f64 product of the dequantised inputs
//! (the FP8 codes' exact values times the scales), outputs poisoned first; odd sizes, both
//! formats on either side, tensor-wise and row-wise scales, bias, every output dtype, and a
//! long k where the fast accumulation's error shows.

use super::{scaled_mm_into, variants, wgmma_declines, Problem, ScaledMmOptions, OP};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::check::rel_error;
use crate::core::harness::{CheckConfig, CheckRecord, Precision};
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;
use rayon::prelude::*;

/// One case: shape, formats, output dtype, scale granularity, bias.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: DType,
    pub b: DType,
    pub out: DType,
    pub sa_row: bool,
    pub sb_col: bool,
    pub bias: bool,
}

const E4: DType = DType::F8E4M3;
const E5: DType = DType::F8E5M2;

#[allow(clippy::too_many_arguments)]
const fn case(
    (m, n, k): (usize, usize, usize),
    a: DType,
    b: DType,
    out: DType,
    sa_row: bool,
    sb_col: bool,
    bias: bool,
) -> Case {
    Case {
        m,
        n,
        k,
        a,
        b,
        out,
        sa_row,
        sb_col,
        bias,
    }
}

pub fn cases(quick: bool) -> Vec<Case> {
    use DType::{BF16, F16, F32};
    let mut v = vec![
        case((1, 1, 1), E4, E4, F32, false, false, false),
        case((7, 33, 40), E4, E4, BF16, true, true, true),
        case((1, 300, 256), E4, E4, BF16, false, false, false),
        case((130, 300, 272), E4, E4, F32, false, false, false),
        case((130, 300, 272), E4, E5, BF16, true, false, true),
        case((77, 129, 144), E5, E4, F16, false, true, false),
        case((64, 260, 208), E5, E5, F32, true, true, false),
        case((257, 520, 1024), E4, E4, BF16, true, true, true),
        case((64, 256, 4096), E4, E4, F32, false, false, false),
        // Few tiles, long k: the wgmma rungs split k (partials, then the scaling pass).
        case((48, 1000, 6144), E4, E4, BF16, true, true, true),
    ];
    if !quick {
        v.extend([
            case((1000, 1000, 1008), E4, E4, BF16, false, false, true),
            case((513, 2048, 4096), E4, E4, F32, true, true, false),
            case((300, 768, 8192), E4, E5, F32, false, false, false),
            case((2048, 2048, 2048), E4, E4, F16, false, true, true),
        ]);
    }
    v
}

/// The case's inputs on the CPU: FP8 codes of uniform values (e4m3 in ±6, reaching its
/// subnormals; e5m2 in ±100), scales in [0.01, 1) and a bias in ±1.
struct Inputs {
    a: Tensor,
    b: Tensor,
    sa: Tensor,
    sb: Tensor,
    bias: Option<Tensor>,
}

fn range(d: DType) -> f64 {
    if d == E5 {
        100.0
    } else {
        6.0
    }
}

fn inputs(c: &Case, seed: u64) -> Result<Inputs> {
    let cpu = Device::Cpu;
    let a = Tensor::rand(&[c.m, c.k], c.a, cpu, seed, -range(c.a), range(c.a))?;
    let b = Tensor::rand(&[c.n, c.k], c.b, cpu, seed ^ 1, -range(c.b), range(c.b))?;
    let sa = Tensor::rand(
        &[if c.sa_row { c.m } else { 1 }],
        DType::F32,
        cpu,
        seed ^ 2,
        0.01,
        1.0,
    )?;
    let sb = Tensor::rand(
        &[if c.sb_col { c.n } else { 1 }],
        DType::F32,
        cpu,
        seed ^ 3,
        0.01,
        1.0,
    )?;
    let bias = if c.bias {
        Some(Tensor::rand(&[c.n], c.out, cpu, seed ^ 4, -1.0, 1.0)?)
    } else {
        None
    };
    Ok(Inputs { a, b, sa, sb, bias })
}

/// D in f64 from the inputs' exact values.
fn reference(c: &Case, x: &Inputs) -> Result<Vec<f64>> {
    let (a, b) = (x.a.to_f64_vec()?, x.b.to_f64_vec()?);
    let (sa, sb) = (x.sa.to_f64_vec()?, x.sb.to_f64_vec()?);
    let bias = match &x.bias {
        Some(t) => t.to_f64_vec()?,
        None => vec![0.0; c.n],
    };
    let mut d = vec![0f64; c.m * c.n];
    d.par_chunks_mut(c.n.max(1))
        .enumerate()
        .for_each(|(i, row)| {
            let ar = &a[i * c.k..][..c.k];
            for (j, dj) in row.iter_mut().enumerate() {
                let br = &b[j * c.k..][..c.k];
                let dot: f64 = ar.iter().zip(br).map(|(x, y)| x * y).sum();
                let s = sa[if c.sa_row { i } else { 0 }] * sb[if c.sb_col { j } else { 0 }];
                *dj = dot * s + bias[j];
            }
        });
    Ok(d)
}

/// The precision contract of `variant` writing `out`.
pub fn precision(variant: &str, out: DType) -> Precision {
    match out {
        DType::F32 if variant.ends_with("_fast") => Precision::Fp8FastAccum,
        DType::F32 => Precision::Fp8,
        d => Precision::of(d),
    }
}

/// The vendor library on the same case (`cublaslt`, `cublaslt_fast`): its error under the same
/// contract shows the bound is the hardware's accumulation, not the kernels'.
pub const PEERS: [&str; 2] = ["cublaslt", "cublaslt_fast"];

fn check_one(dev: Device, variant: &str, c: &Case, x: &Inputs, r: &[f64]) -> Result<f64> {
    let on = |t: &Tensor| t.to_device(dev);
    let (a, b, sa, sb) = (on(&x.a)?, on(&x.b)?, on(&x.sa)?, on(&x.sb)?);
    let bias = x.bias.as_ref().map(on).transpose()?;
    let out = Tensor::empty(&[c.m, c.n], c.out, dev)?;
    out.poison(None)?;
    if let (Some(fast), Device::Cuda(i)) = (
        PEERS.iter().position(|&p| p == variant).map(|i| i == 1),
        dev,
    ) {
        let d = crate::core::cuda::device(i)?;
        let q = super::cuda::Ptrs::of(&a, &b, &sa, &sb, bias.as_ref(), &out)?;
        let p = problem(c, dev);
        super::cuda::LtFp8::new(&d, &p, q, fast, d.stream())?.run(q)?;
        return Ok(rel_error(&out.to_f64_vec()?, r));
    }
    scaled_mm_into(
        &a,
        &b,
        &sa,
        &sb,
        bias.as_ref(),
        &out,
        &ScaledMmOptions {
            variant: Some(variant.into()),
            stream: None,
        },
    )?;
    Ok(rel_error(&out.to_f64_vec()?, r))
}

fn problem(c: &Case, dev: Device) -> Problem {
    Problem {
        sa_row: c.sa_row,
        sb_col: c.sb_col,
        bias: c.bias,
        ..Problem::dense((c.m, c.n, c.k), (c.a, c.b, c.out), dev)
    }
}

fn record(
    dev: Device,
    variant: &str,
    c: &Case,
    x: &Inputs,
    r: &[f64],
    label: &str,
    note: &str,
) -> CheckRecord {
    match check_one(dev, variant, c, x, r) {
        Ok(e) => CheckRecord::compared(
            OP,
            variant,
            dev,
            c.a,
            precision(variant, c.out),
            label.into(),
            e,
            note.into(),
        ),
        Err(e) => CheckRecord::errored(OP, variant, dev, c.a, label.into(), e.to_string()),
    }
}

/// A `quantize_fp8` case: x `[rows, cols]` of `input` to `fmt`, per row or per tensor, current
/// or given scales, with an all-zero row (and, where `special`, an inf and a NaN row).
#[derive(Clone, Copy, Debug)]
pub struct QuantCase {
    pub rows: usize,
    pub cols: usize,
    pub input: DType,
    pub fmt: DType,
    pub per_row: bool,
    pub given: bool,
    pub special: bool,
}

/// `quantize_fp8`'s cases (the pseudo-variant `quantize` of the records).
pub fn quant_cases(quick: bool) -> Vec<QuantCase> {
    use DType::{BF16, F16, F32};
    let q = |rows, cols, input, fmt, per_row, given, special| QuantCase {
        rows,
        cols,
        input,
        fmt,
        per_row,
        given,
        special,
    };
    let mut v = vec![
        q(1, 1, F32, E4, false, false, false),
        q(7, 33, F32, E4, true, false, true),
        q(5, 129, BF16, E5, false, false, true),
        q(64, 1001, BF16, E4, true, true, false),
        q(33, 40, F16, E5, true, false, false),
        q(0, 9, F32, E4, false, true, false),
    ];
    if !quick {
        v.push(q(300, 4096, BF16, E4, false, false, false));
        v.push(q(1000, 777, F16, E4, true, false, true));
    }
    v
}

/// Mismatches of `quantize_fp8` on `dev` against the definition computed here (amax by a
/// NaN-propagating max, s = FMAX / amax — 1 for 0, NaN for non-finite — or the given scale, each
/// code the nearest-even saturating encoding of the f32 product): codes, amax and inv_scale
/// that differ (NaN equal to NaN).
fn check_quantize(c: &QuantCase, dev: Device, seed: u64) -> Result<f64> {
    use super::quantize::{quantize_fp8_into, QuantizeOptions};
    use crate::core::fp8::Fp8Format;
    let mut rng = Rng::new(seed);
    let mut xs: Vec<f32> = (0..c.rows * c.cols)
        .map(|i| ((rng.next_f64() * 2.0 - 1.0) * 10f64.powi((i % 9) as i32 - 4)) as f32)
        .collect();
    if c.rows > 1 {
        xs[c.cols..2 * c.cols].fill(0.0);
    }
    if c.special && c.rows > 3 {
        xs[2 * c.cols] = f32::INFINITY;
        xs[3 * c.cols + c.cols / 2] = f32::NAN;
    }
    let x = Tensor::from_vec(xs, &[c.rows, c.cols])?.to_dtype(c.input)?;
    let xv = x.to_f32_vec()?; // the values as the op reads them
    let n = if c.per_row && c.rows != 1 { c.rows } else { 1 };
    let group = if n == 1 { xv.len() } else { c.cols };
    let fmt = Fp8Format::of(c.fmt).expect("an FP8 format");
    let given: Vec<f32> = (0..n)
        .map(|_| (rng.next_f64() * 4.0 + 0.25) as f32)
        .collect();
    let mut amax = vec![0f32; n];
    for (g, m) in amax.iter_mut().enumerate() {
        *m = xv[g * group..(g + 1) * group].iter().fold(0f32, |m, v| {
            if v.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                m.max(v.abs())
            }
        });
    }
    let s: Vec<f32> = if c.given {
        given.clone()
    } else {
        amax.iter()
            .map(|&a| match a {
                0.0 => 1.0,
                a if a.is_finite() => fmt.max_finite() / a,
                _ => f32::NAN,
            })
            .collect()
    };
    let want: Vec<u8> = xv
        .iter()
        .enumerate()
        .map(|(i, &v)| fmt.encode(v * s[i / group.max(1)]))
        .collect();
    let xd = x.to_device(dev)?;
    let q = Tensor::empty(&[c.rows, c.cols], c.fmt, dev)?;
    let (am, inv) = (
        Tensor::empty(&[n], DType::F32, dev)?,
        Tensor::empty(&[n], DType::F32, dev)?,
    );
    for t in [&am, &inv] {
        t.poison(None)?;
    }
    q.poison(None)?;
    let scale = if c.given {
        Some(Tensor::from_vec(given, &[n])?.to_device(dev)?)
    } else {
        None
    };
    quantize_fp8_into(
        &xd,
        scale.as_ref(),
        &q,
        &am,
        &inv,
        &QuantizeOptions::default(),
    )?;
    let got = q.to_dtype(DType::F32)?.to_vec::<f32>()?;
    let same = |a: f32, b: f32| a == b || (a.is_nan() && b.is_nan());
    let mut bad = want
        .iter()
        .zip(&got)
        .filter(|(&w, &g)| {
            let w = fmt.decode(w);
            !(same(w, g) && w.is_sign_negative() == g.is_sign_negative())
        })
        .count();
    bad += amax
        .iter()
        .zip(&am.to_f32_vec()?)
        .filter(|(a, b)| !same(**a, **b))
        .count();
    let inv_want = s.iter().map(|v| 1.0 / v);
    bad += inv_want
        .zip(inv.to_f32_vec()?)
        .filter(|(a, b)| !same(*a, *b))
        .count();
    Ok(bad as f64)
}

fn quantize_records(cfg: &CheckConfig, rng: &mut Rng, out: &mut Vec<CheckRecord>) -> Result<()> {
    if !cfg.wants_variant("quantize") {
        return Ok(());
    }
    for c in quant_cases(cfg.quick) {
        let seed = rng.next_u64();
        if !cfg.wants_dtype(c.input) && !cfg.wants_dtype(c.fmt) {
            continue;
        }
        let label = format!(
            "quantize {}×{} {}→{} {}{}{}",
            c.rows,
            c.cols,
            c.input,
            c.fmt,
            if c.per_row { "per row" } else { "per tensor" },
            if c.given { ", given scales" } else { "" },
            if c.special { ", inf/NaN rows" } else { "" }
        );
        for &dev in &cfg.devices {
            if let Device::Cuda(i) = dev {
                if crate::core::cuda::device(i)?.arch() < crate::core::device::Arch::SM89 {
                    continue;
                }
            }
            let note = "codes, amax and inv_scale that differ from the definition";
            out.push(match check_quantize(&c, dev, seed) {
                Ok(e) => CheckRecord::compared(
                    OP,
                    "quantize",
                    dev,
                    c.input,
                    Precision::Exact,
                    label.clone(),
                    e,
                    note.into(),
                ),
                Err(e) => {
                    CheckRecord::errored(OP, "quantize", dev, c.input, label.clone(), e.to_string())
                }
            });
        }
    }
    Ok(())
}

pub fn run(cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
    let mut rng = Rng::new(cfg.seed);
    quantize_records(cfg, &mut rng, out)?;
    for c in cases(cfg.quick) {
        if !cfg.wants_dtype(c.a) && !cfg.wants_dtype(c.b) {
            continue;
        }
        let x = inputs(&c, rng.next_u64())?;
        let r = reference(&c, &x)?;
        let label = format!(
            "{}×{}×{} {}×{}→{}{}{}{}",
            c.m,
            c.n,
            c.k,
            c.a,
            c.b,
            c.out,
            if c.sa_row { " sa/row" } else { "" },
            if c.sb_col { " sb/col" } else { "" },
            if c.bias { " +bias" } else { "" }
        );
        for &dev in &cfg.devices {
            let arch = crate::core::cuda::arch_of(dev)?;
            let p = problem(&c, dev);
            for v in variants()
                .iter()
                .filter(|v| v.backend == Backend::of(dev) && cfg.wants_variant(v.name))
            {
                if v.min_arch.is_some_and(|m| arch.is_some_and(|a| a < m)) {
                    continue;
                }
                if v.name.starts_with("wgmma") && wgmma_declines(&p, arch, &[]).is_some() {
                    continue;
                }
                out.push(record(dev, v.name, &c, &x, &r, &label, ""));
            }
            // The peer where it takes the case (tensor-wise scales, no bias: its bias types
            // differ by output dtype) and is asked for.
            if dev.is_cuda() && !c.bias && super::cuda::LtFp8::declines(&p).is_none() {
                for peer in PEERS.into_iter().filter(|p| cfg.wants_variant(p)) {
                    out.push(record(dev, peer, &c, &x, &r, &label, "peer"));
                }
            }
        }
    }
    Ok(())
}
