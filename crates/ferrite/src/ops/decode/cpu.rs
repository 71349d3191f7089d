//! CPU decode in fp32 (16-bit inputs widened), softmax sums in f64. Indices were checked by
//! `validate` before these run.
//!
//! `naive`: one thread; per sequence, the visible keys and values are gathered into contiguous
//! buffers, then each query head runs plain attention (all scores, max, exp, weighted sum).
//! `parallel`: cores over (sequence, kv head). The task reads through the block table directly (no
//! gather copy) and serves all query heads of the kv head, so each K/V row is loaded once for the
//! whole group; keys go in tiles of 64 with one softmax rescale per tile (online softmax), the
//! tile's sums in f32 and the running sums in f64.

use super::{PagedKv, Problem};
use crate::core::cpu::{with_f32, with_f32_out};
use crate::core::error::Result;
use crate::core::host;
use crate::core::tensor::Tensor;
use rayon::prelude::*;

/// Borrowed inputs as f32 / i32 slices.
struct In<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    table: &'a [i32],
    lens: &'a [i32],
}

fn softcapped(p: &Problem, dot: f32) -> f32 {
    let s = dot * p.scale;
    if p.softcap > 0.0 {
        p.softcap * (s / p.softcap).tanh()
    } else {
        s
    }
}

/// Element offset of key j of sequence b, kv head 0, in the caches.
fn row(p: &Problem, table: &[i32], b: usize, j: usize) -> usize {
    let blk = table[b * p.max_blocks + j / p.block_size] as usize;
    (blk * p.block_size + j % p.block_size) * p.heads_kv * p.head_dim
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub fn decode(
    variant: &str,
    p: &Problem,
    q: &Tensor,
    kv: &PagedKv,
    o: &Tensor,
    lse: Option<&Tensor>,
) -> Result<()> {
    let table = kv.block_table.to_vec::<i32>()?;
    let lens = kv.seq_lens.to_vec::<i32>()?;
    let mut lse_buf = host::zeroed::<f32>(p.batch * p.heads_q, "paged decode CPU lse")?;
    with_f32(q, |q| {
        with_f32(kv.key_cache, |k| {
            with_f32(kv.value_cache, |v| {
                let inp = In {
                    q,
                    k,
                    v,
                    table: &table,
                    lens: &lens,
                };
                with_f32_out(o, |out| {
                    if variant == "parallel" {
                        parallel(p, &inp, out, &mut lse_buf)
                    } else {
                        naive(p, &inp, out, &mut lse_buf)
                    }
                })
            })
        })
    })????;
    if let Some(l) = lse {
        l.write_f32(&lse_buf)?;
    }
    Ok(())
}

fn naive(p: &Problem, x: &In, out: &mut [f32], lse: &mut [f32]) {
    let (d, hkv, g) = (p.head_dim, p.heads_kv, p.group());
    for b in 0..p.batch {
        let (lo, hi) = p.visible(x.lens[b] as usize);
        let n = hi - lo;
        // The gather: this sequence's visible keys/values, [n, Hkv, D] contiguous.
        let (mut kb, mut vb) = (
            Vec::with_capacity(n * hkv * d),
            Vec::with_capacity(n * hkv * d),
        );
        for j in lo..hi {
            let r = row(p, x.table, b, j);
            kb.extend_from_slice(&x.k[r..r + hkv * d]);
            vb.extend_from_slice(&x.v[r..r + hkv * d]);
        }
        for h in 0..p.heads_q {
            let kvh = h / g;
            let qh = &x.q[(b * p.heads_q + h) * d..][..d];
            let o = &mut out[(b * p.heads_q + h) * d..][..d];
            if n == 0 {
                o.fill(0.0);
                lse[b * p.heads_q + h] = f32::NEG_INFINITY;
                continue;
            }
            let s: Vec<f32> = (0..n)
                .map(|j| softcapped(p, dot(qh, &kb[(j * hkv + kvh) * d..][..d])))
                .collect();
            let m = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let e: Vec<f64> = s.iter().map(|&v| ((v - m) as f64).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (c, oc) in o.iter_mut().enumerate() {
                let acc: f64 = (0..n)
                    .map(|j| e[j] * vb[(j * hkv + kvh) * d + c] as f64)
                    .sum();
                *oc = (acc / sum) as f32;
            }
            lse[b * p.heads_q + h] = (m as f64 + sum.ln()) as f32;
        }
    }
}

const TILE: usize = 64;

fn parallel(p: &Problem, x: &In, out: &mut [f32], lse: &mut [f32]) {
    let (d, hkv, g) = (p.head_dim, p.heads_kv, p.group());
    out.par_chunks_mut(g * d)
        .zip(lse.par_chunks_mut(g))
        .enumerate()
        .for_each(|(task, (o, lse))| {
            let (b, kvh) = (task / hkv, task % hkv);
            let qg = &x.q[(b * p.heads_q + kvh * g) * d..][..g * d];
            let (lo, hi) = p.visible(x.lens[b] as usize);
            let mut m = vec![f32::NEG_INFINITY; g];
            let mut l = vec![0f64; g];
            let mut acc = vec![0f64; g * d];
            let mut s = vec![0f32; g * TILE];
            let mut rows = [0usize; TILE];
            let mut tile_acc = vec![0f32; d];
            for t0 in (lo..hi).step_by(TILE) {
                let n = TILE.min(hi - t0);
                for (jj, r) in rows[..n].iter_mut().enumerate() {
                    *r = row(p, x.table, b, t0 + jj) + kvh * d;
                    let k = &x.k[*r..][..d];
                    for gi in 0..g {
                        s[gi * TILE + jj] = softcapped(p, dot(&qg[gi * d..][..d], k));
                    }
                }
                for gi in 0..g {
                    let sg = &s[gi * TILE..][..n];
                    let m_new = sg.iter().fold(m[gi], |a, &v| a.max(v));
                    if m[gi] != m_new {
                        let alpha = ((m[gi] - m_new) as f64).exp();
                        l[gi] *= alpha;
                        acc[gi * d..][..d].iter_mut().for_each(|a| *a *= alpha);
                        m[gi] = m_new;
                    }
                    tile_acc.fill(0.0);
                    let mut tile_l = 0f32;
                    for (jj, &r) in rows[..n].iter().enumerate() {
                        let e = (sg[jj] - m_new).exp();
                        tile_l += e;
                        for (a, &vv) in tile_acc.iter_mut().zip(&x.v[r..r + d]) {
                            *a += e * vv;
                        }
                    }
                    l[gi] += tile_l as f64;
                    for (a, &t) in acc[gi * d..][..d].iter_mut().zip(&tile_acc) {
                        *a += t as f64;
                    }
                }
            }
            for gi in 0..g {
                let og = &mut o[gi * d..][..d];
                if l[gi] == 0.0 {
                    og.fill(0.0);
                    lse[gi] = f32::NEG_INFINITY;
                } else {
                    for (oc, &a) in og.iter_mut().zip(&acc[gi * d..][..d]) {
                        *oc = (a / l[gi]) as f32;
                    }
                    lse[gi] = (m[gi] as f64 + l[gi].ln()) as f32;
                }
            }
        });
}

/// Copies each token's k/v row bytes to its slot (slots checked by `validate_append`).
pub fn append(
    p: &super::AppendProblem,
    k: &Tensor,
    v: &Tensor,
    key_cache: &Tensor,
    value_cache: &Tensor,
    slot_mapping: &Tensor,
) -> Result<()> {
    let slots = slot_mapping.to_vec::<i32>()?;
    let rb = p.row_elems * p.dtype.size_in_bytes();
    for (src, dst) in [(k, key_cache), (v, value_cache)] {
        let bytes = src.to_bytes()?;
        write_bytes(dst, |cache| {
            for (t, &s) in slots.iter().enumerate() {
                if s >= 0 {
                    let s = s as usize;
                    cache[s * rb..(s + 1) * rb].copy_from_slice(&bytes[t * rb..(t + 1) * rb]);
                }
            }
        })?;
    }
    Ok(())
}

/// Runs `f` on the bytes of a contiguous CPU float tensor.
fn write_bytes(t: &Tensor, f: impl FnOnce(&mut [u8])) -> Result<()> {
    let n = t.nbytes();
    match t.dtype() {
        crate::DType::F32 => t.with_cpu_mut::<f32, _>(|s| f(&mut bytemuck::cast_slice_mut(s)[..n])),
        crate::DType::F16 => {
            t.with_cpu_mut::<half::f16, _>(|s| f(&mut bytemuck::cast_slice_mut(s)[..n]))
        }
        _ => t.with_cpu_mut::<half::bf16, _>(|s| f(&mut bytemuck::cast_slice_mut(s)[..n])),
    }
}
