//! `ferrite check rotary`: every variant against an f64 reference — both pair layouts, a partial
//! rotary dim (the rest copied), q/k as strided views of a packed QKV buffer, packed sequences of
//! ragged lengths (one empty), per-sequence offsets, in place, and the inverse rotation.

use super::{rotary_into, variants, RotaryOptions, OP};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::check::rel_error;
use crate::core::harness::{CheckConfig, CheckRecord, Precision};
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;

#[derive(Clone, Copy, Debug)]
pub enum Layout {
    /// `[B, S, H, D]`, contiguous.
    Padded,
    /// The k slice of a packed `[B, S, 3, H, D]` QKV buffer (strided rows).
    QkvView,
    /// `[T, H, D]` packed by cu_seqlens with these lengths.
    Packed(&'static [usize]),
}

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub batch: usize,
    pub seqlen: usize,
    pub heads: usize,
    pub dim: usize,
    /// R/2.
    pub half: usize,
    pub layout: Layout,
    pub interleaved: bool,
    pub conjugate: bool,
    /// Per-sequence offsets (else one scalar offset).
    pub per_seq: bool,
    pub in_place: bool,
}

impl Case {
    fn label(&self) -> String {
        let shape = match self.layout {
            Layout::Packed(l) => format!("packed {l:?}×{}×{}", self.heads, self.dim),
            Layout::QkvView => format!(
                "{}×{}×{}×{} (k of packed QKV)",
                self.batch, self.seqlen, self.heads, self.dim
            ),
            Layout::Padded => format!("{}×{}×{}×{}", self.batch, self.seqlen, self.heads, self.dim),
        };
        let mut s = format!("{shape} R={}", 2 * self.half);
        for (on, what) in [
            (self.interleaved, "interleaved"),
            (self.conjugate, "inverse"),
            (self.per_seq, "offsets[B]"),
            (self.in_place, "in place"),
        ] {
            if on {
                s += &format!(" {what}");
            }
        }
        s
    }
    fn lens(&self) -> Vec<usize> {
        match self.layout {
            Layout::Packed(l) => l.to_vec(),
            _ => vec![self.seqlen; self.batch],
        }
    }
}

pub fn cases(quick: bool) -> Vec<Case> {
    let c = |batch, seqlen, heads, dim, half, layout| Case {
        batch,
        seqlen,
        heads,
        dim,
        half,
        layout,
        interleaved: false,
        conjugate: false,
        per_seq: false,
        in_place: false,
    };
    let mut v = vec![
        c(2, 17, 3, 64, 32, Layout::Padded),
        Case {
            interleaved: true,
            ..c(1, 9, 2, 32, 16, Layout::Padded)
        },
        Case {
            conjugate: true,
            per_seq: true,
            ..c(3, 5, 4, 128, 32, Layout::Padded)
        },
        Case {
            in_place: true,
            ..c(2, 33, 4, 128, 64, Layout::QkvView)
        },
        c(2, 11, 2, 96, 40, Layout::QkvView),
        Case {
            per_seq: true,
            ..c(4, 0, 2, 64, 32, Layout::Packed(&[5, 0, 13, 1]))
        },
        Case {
            interleaved: true,
            ..c(1, 7, 1, 10, 3, Layout::Padded)
        },
    ];
    if !quick {
        v.extend([
            Case {
                in_place: true,
                interleaved: true,
                ..c(2, 300, 8, 128, 64, Layout::Padded)
            },
            c(1, 1000, 8, 64, 32, Layout::Packed(&[1000])),
            Case {
                per_seq: true,
                ..c(
                    8,
                    0,
                    4,
                    128,
                    64,
                    Layout::Packed(&[7, 129, 0, 64, 3, 250, 1, 16]),
                )
            },
        ]);
    }
    v
}

/// Tables of the usual RoPE angles, θ_j = pos · 10000^(−j/half), in `dtype` on `dev`.
pub fn tables(ro_len: usize, half: usize, dtype: DType, dev: Device) -> Result<(Tensor, Tensor)> {
    let mut c = Vec::with_capacity(ro_len * half);
    let mut s = Vec::with_capacity(ro_len * half);
    for p in 0..ro_len {
        for j in 0..half {
            let a = p as f64 * 10000f64.powf(-(j as f64) / half as f64);
            c.push(a.cos() as f32);
            s.push(a.sin() as f32);
        }
    }
    let mk = |v: &[f32]| -> Result<Tensor> {
        let t = Tensor::empty(&[ro_len, half], dtype, Device::Cpu)?;
        t.write_f32(v)?;
        t.to_device(dev)
    };
    Ok((mk(&c)?, mk(&s)?))
}

fn i32_tensor(v: &[i32], dev: Device) -> Result<Tensor> {
    Tensor::from_vec(v.to_vec(), &[v.len()])?.to_device(dev)
}

fn reference(x: &[f64], c: &Case, pos: &[usize], cos: &[f64], sin: &[f64]) -> Vec<f64> {
    let (h, d) = (c.heads, c.dim);
    let sign = if c.conjugate { -1.0 } else { 1.0 };
    let mut y = x.to_vec();
    for (n, &p) in pos.iter().enumerate() {
        for hh in 0..h {
            let row = &mut y[(n * h + hh) * d..][..d];
            for j in 0..c.half {
                let (d0, d1) = if c.interleaved {
                    (2 * j, 2 * j + 1)
                } else {
                    (j, j + c.half)
                };
                let (x0, x1) = (row[d0], row[d1]);
                let (cj, sj) = (cos[p * c.half + j], sign * sin[p * c.half + j]);
                row[d0] = x0 * cj - x1 * sj;
                row[d1] = x1 * cj + x0 * sj;
            }
        }
    }
    y
}

/// Runs one case; returns the relative error against the reference.
pub fn check_one(dev: Device, dtype: DType, variant: &str, c: &Case, seed: u64) -> Result<f64> {
    let mut rng = Rng::new(seed);
    let lens = c.lens();
    let tokens: usize = lens.iter().sum();
    let offs: Vec<i32> = lens.iter().map(|_| rng.below(7) as i32).collect();
    let offset = if c.per_seq { 0 } else { 3 };
    let ro_len = lens.iter().max().copied().unwrap_or(0) + 8;
    let (cos, sin) = tables(ro_len, c.half, dtype, dev)?;
    let (h, d) = (c.heads, c.dim);
    let x = match c.layout {
        Layout::QkvView => {
            let base = Tensor::rand(&[c.batch, c.seqlen, 3, h, d], dtype, dev, seed, -2.0, 2.0)?;
            let s = c.seqlen * 3 * h * d;
            base.as_strided(&[c.batch, c.seqlen, h, d], &[s, 3 * h * d, d, 1], h * d)?
        }
        Layout::Padded => Tensor::rand(&[c.batch, c.seqlen, h, d], dtype, dev, seed, -2.0, 2.0)?,
        Layout::Packed(_) => Tensor::rand(&[tokens, h, d], dtype, dev, seed, -2.0, 2.0)?,
    };
    let x_in = x.to_f64_vec()?;
    let out = if c.in_place {
        x.clone()
    } else {
        let o = Tensor::empty(x.shape(), dtype, dev)?;
        o.poison(None)?;
        o
    };
    let mut cu = vec![0i32];
    for l in &lens {
        cu.push(cu.last().unwrap() + *l as i32);
    }
    let opts = RotaryOptions {
        variant: Some(variant.into()),
        interleaved: c.interleaved,
        conjugate: c.conjugate,
        offset,
        offsets: if c.per_seq {
            Some(i32_tensor(&offs, dev)?)
        } else {
            None
        },
        cu_seqlens: match c.layout {
            Layout::Packed(_) => Some(i32_tensor(&cu, dev)?),
            _ => None,
        },
        stream: None,
    };
    rotary_into(&x, &cos, &sin, &out, &opts)?;
    let mut pos = Vec::with_capacity(tokens);
    for (b, &l) in lens.iter().enumerate() {
        let o = if c.per_seq { offs[b] as usize } else { offset };
        pos.extend((0..l).map(|s| s + o));
    }
    let want = reference(&x_in, c, &pos, &cos.to_f64_vec()?, &sin.to_f64_vec()?);
    Ok(rel_error(&out.to_f64_vec()?, &want))
}

pub fn run(cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
    let mut rng = Rng::new(cfg.seed);
    for &dev in &cfg.devices {
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::of(dev) && cfg.wants_variant(v.name))
        {
            for &dtype in v.dtypes.iter().filter(|d| cfg.wants_dtype(**d)) {
                for case in cases(cfg.quick) {
                    let seed = rng.next_u64();
                    let label = case.label();
                    let vec = 16 / dtype.size_in_bytes();
                    let rot = if case.interleaved {
                        2 * case.half
                    } else {
                        case.half
                    };
                    let tail = if case.in_place {
                        0
                    } else {
                        case.dim - 2 * case.half
                    };
                    if v.name == "vectorized" && (rot % vec != 0 || tail % vec != 0) {
                        continue; // the variant declines it (the default path runs `naive`)
                    }
                    out.push(match check_one(dev, dtype, v.name, &case, seed) {
                        Ok(e) => CheckRecord::compared(
                            OP,
                            v.name,
                            dev,
                            dtype,
                            Precision::of(dtype),
                            label,
                            e,
                            String::new(),
                        ),
                        Err(e) => {
                            CheckRecord::errored(OP, v.name, dev, dtype, label, e.to_string())
                        }
                    });
                }
            }
        }
    }
    Ok(())
}
