//! `ferrite check w8a16`: every rung against the f64 product of the dequantised weight (its int8
//! codes times the row scales), outputs poisoned first; m from 1 (decoding) to past one m tile,
//! odd n, weights with few rows (split-K), a k that `mma` does not take (so only `naive` runs
//! it), A as a view with a wider row pitch, bias, bf16 and f16.

use super::{mma_declines, variants, w8a16_into, Problem, W8a16Options, OP};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::check::rel_error;
use crate::core::harness::{CheckConfig, CheckRecord, Precision};
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;
use rayon::prelude::*;

/// One case: shape, activation dtype, bias, extra elements between A's rows (a view).
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub dtype: DType,
    pub bias: bool,
    pub a_pad: usize,
}

const fn case((m, n, k): (usize, usize, usize), dtype: DType, bias: bool, a_pad: usize) -> Case {
    Case {
        m,
        n,
        k,
        dtype,
        bias,
        a_pad,
    }
}

pub fn cases(quick: bool) -> Vec<Case> {
    use DType::{BF16, F16};
    let mut v = vec![
        case((1, 1, 16), BF16, false, 0),
        case((1, 300, 256), BF16, true, 0),
        case((3, 77, 160), F16, false, 0),
        case((5, 40, 40), BF16, true, 0), // k % 16 ≠ 0: naive only
        case((16, 129, 4096), BF16, false, 0), // few rows: split-K
        case((17, 64, 528), F16, true, 0), // two m tiles
        case((33, 100, 64), BF16, false, 8), // two m groups, A a view (pitch k + 8)
        case((8, 1000, 1024), F16, true, 0),
    ];
    if !quick {
        v.extend([
            case((1, 4096, 4096), BF16, false, 0),
            case((64, 1000, 1008), BF16, true, 0),
            case((130, 333, 2048), F16, false, 16),
        ]);
    }
    v
}

/// The case's inputs on the CPU: A uniform in ±1, a float weight uniform in ±1 quantised per row
/// (one row all zeros when n > 2, to cover the scale of an empty row), a bias in ±1.
struct Inputs {
    /// A's buffer, rows k + a_pad long; A is its first k columns.
    a_wide: Tensor,
    a: Tensor,
    w: Tensor,
    s: Tensor,
    bias: Option<Tensor>,
}

fn inputs(c: &Case, seed: u64) -> Result<Inputs> {
    let cpu = Device::Cpu;
    let wide = Tensor::rand(&[c.m, c.k + c.a_pad], c.dtype, cpu, seed, -1.0, 1.0)?;
    let a = wide.narrow(1, 0, c.k)?;
    let mut wf = Tensor::rand(&[c.n, c.k], DType::F32, cpu, seed ^ 1, -1.0, 1.0)?.to_f32_vec()?;
    if c.n > 2 {
        wf[c.k..2 * c.k].fill(0.0);
    }
    let (w, s) = super::quantize_int8(&Tensor::from_vec(wf, &[c.n, c.k])?)?;
    let bias = if c.bias {
        Some(Tensor::rand(&[c.n], c.dtype, cpu, seed ^ 2, -1.0, 1.0)?)
    } else {
        None
    };
    Ok(Inputs {
        a_wide: wide,
        a,
        w,
        s,
        bias,
    })
}

/// D in f64 from the inputs' exact values.
fn reference(c: &Case, x: &Inputs) -> Result<Vec<f64>> {
    let (a, w, s) = (x.a.to_f64_vec()?, x.w.to_f64_vec()?, x.s.to_f64_vec()?);
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
                let wr = &w[j * c.k..][..c.k];
                let dot: f64 = ar.iter().zip(wr).map(|(x, y)| x * y).sum();
                *dj = dot * s[j] + bias[j];
            }
        });
    Ok(d)
}

fn problem(c: &Case, dev: Device) -> Problem {
    Problem {
        lda: c.k + c.a_pad,
        bias: c.bias,
        ..Problem::dense((c.m, c.n, c.k), c.dtype, dev)
    }
}

fn check_one(dev: Device, variant: &str, c: &Case, x: &Inputs, r: &[f64]) -> Result<f64> {
    let on = |t: &Tensor| t.to_device(dev);
    // A keeps its row pitch on the device: the padded buffer goes over, then the same view.
    let a = on(&x.a_wide)?.narrow(1, 0, c.k)?;
    let (w, s) = (on(&x.w)?, on(&x.s)?);
    let bias = x.bias.as_ref().map(on).transpose()?;
    let out = Tensor::empty(&[c.m, c.n], c.dtype, dev)?;
    out.poison(None)?;
    w8a16_into(
        &a,
        &w,
        &s,
        bias.as_ref(),
        &out,
        &W8a16Options {
            variant: Some(variant.into()),
            stream: None,
        },
    )?;
    Ok(rel_error(&out.to_f64_vec()?, r))
}

pub fn run(cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
    let mut rng = Rng::new(cfg.seed);
    for c in cases(cfg.quick) {
        let seed = rng.next_u64();
        if !cfg.wants_dtype(c.dtype) {
            continue;
        }
        let x = inputs(&c, seed)?;
        let r = reference(&c, &x)?;
        let label = format!(
            "{}×{}×{} {}×i8{}{}",
            c.m,
            c.n,
            c.k,
            c.dtype,
            if c.bias { " +bias" } else { "" },
            if c.a_pad > 0 { " a-view" } else { "" }
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
                if v.backend == Backend::Cuda && v.name == "mma" && mma_declines(&p, &[]).is_some()
                {
                    continue;
                }
                out.push(match check_one(dev, v.name, &c, &x, &r) {
                    Ok(e) => CheckRecord::compared(
                        OP,
                        v.name,
                        dev,
                        c.dtype,
                        Precision::of(c.dtype),
                        label.clone(),
                        e,
                        String::new(),
                    ),
                    Err(e) => {
                        CheckRecord::errored(OP, v.name, dev, c.dtype, label.clone(), e.to_string())
                    }
                });
            }
        }
    }
    Ok(())
}
