//! CPU rotary in fp32 (16-bit inputs widened): x is read into a row-major buffer, rotated there
//! token by token (`naive`: one thread; `parallel`: tokens across cores, the same arithmetic and
//! so the same results), then written through out's strides — so out may be x itself.
//! Offsets and cu_seqlens are read on the host, so every bad position is an error here.

use super::{Problem, RotaryOptions, OP};
use crate::core::dtype::{DType, Element};
use crate::core::error::{Error, Result};
use crate::core::host;
use crate::core::tensor::Tensor;
use half::{bf16, f16};
use rayon::prelude::*;

/// Each token row's position in the tables.
fn positions(p: &Problem, o: &RotaryOptions) -> Result<Vec<usize>> {
    let offs: Option<Vec<i32>> = o.offsets.as_ref().map(|t| t.to_vec::<i32>()).transpose()?;
    let offset_of = |b: usize| -> i64 { offs.as_ref().map_or(o.offset as i64, |v| v[b] as i64) };
    let mut pos = host::with_capacity::<usize>(p.tokens, "rotary positions")?;
    let mut seq = |b: usize, first: usize, len: usize| -> Result<()> {
        for s in 0..len {
            let q = s as i64 + offset_of(b);
            if q < 0 || q >= p.ro_len as i64 {
                return Err(Error::bad_arg(
                    OP,
                    if offs.is_some() { "offsets" } else { "cos" },
                    format!("every position inside the tables' {} rows", p.ro_len),
                    format!(
                        "token {s} of sequence {b} at position {q} (row {})",
                        first + s
                    ),
                ));
            }
            pos.push(q as usize);
        }
        Ok(())
    };
    if let Some(cu) = &o.cu_seqlens {
        let cu = cu.to_vec::<i32>()?;
        let ok = cu[0] == 0
            && cu.windows(2).all(|w| w[0] <= w[1])
            && *cu.last().unwrap() as usize == p.tokens;
        if !ok {
            return Err(Error::bad_arg(
                OP,
                "cu_seqlens",
                format!(
                    "non-decreasing offsets from 0 to the {} rows of x",
                    p.tokens
                ),
                format!("{cu:?}"),
            ));
        }
        for b in 0..p.batch {
            seq(b, cu[b] as usize, (cu[b + 1] - cu[b]) as usize)?;
        }
    } else {
        for b in 0..p.batch {
            seq(b, b * p.seqlen, p.seqlen)?;
        }
    }
    Ok(pos)
}

fn rotate_token(
    row: &mut [f32],
    p: &Problem,
    cos: &[f32],
    sin: &[f32],
    pos: usize,
    o: &RotaryOptions,
) {
    let sign = if o.conjugate { -1.0f32 } else { 1.0 };
    let (c, s) = (
        &cos[pos * p.half..][..p.half],
        &sin[pos * p.half..][..p.half],
    );
    for head in row.chunks_mut(p.dim) {
        for j in 0..p.half {
            let (d0, d1) = if o.interleaved {
                (2 * j, 2 * j + 1)
            } else {
                (j, j + p.half)
            };
            let (x0, x1) = (head[d0], head[d1]);
            let sj = sign * s[j];
            head[d0] = x0 * c[j] - x1 * sj;
            head[d1] = x1 * c[j] + x0 * sj;
        }
    }
}

fn write_strided<T: Element>(t: &Tensor, v: &[f32]) -> Result<()> {
    let base = t.layout().offset();
    t.with_cpu_mut::<T, _>(|s| {
        for (off, &x) in t.layout().offsets().zip(v) {
            s[off - base] = T::from_f64(x as f64);
        }
    })
}

pub fn rotary(
    variant: &str,
    p: &Problem,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    out: &Tensor,
    o: &RotaryOptions,
) -> Result<()> {
    let pos = positions(p, o)?;
    let (cos, sin) = (cos.to_f32_vec()?, sin.to_f32_vec()?);
    let mut buf = x.to_f32_vec()?;
    let row = p.heads * p.dim;
    let rot = |(n, r): (usize, &mut [f32])| rotate_token(r, p, &cos, &sin, pos[n], o);
    if variant == "naive" {
        buf.chunks_mut(row).enumerate().for_each(rot);
    } else {
        buf.par_chunks_mut(row).enumerate().for_each(rot);
    }
    match p.dtype {
        DType::F32 => write_strided::<f32>(out, &buf),
        DType::F16 => write_strided::<f16>(out, &buf),
        DType::BF16 => write_strided::<bf16>(out, &buf),
        other => Err(Error::bad_arg(OP, "x", "an f32/f16/bf16 tensor", other)),
    }
}
