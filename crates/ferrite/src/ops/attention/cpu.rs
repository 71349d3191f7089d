//! CPU attention in fp32 (16-bit inputs widened), indexing each tensor through the Problem's
//! strides exactly as the kernels do.
//!
//! `naive`: per (batch, head), the whole score matrix S and probability matrix P are built, then
//! P·V — O(Sq·Sk) memory per head, one thread; the backward builds P, dP and dS the same way.
//! `tiled`: per (batch, head, block of 32 queries), keys are visited in tiles of 64 with an online
//! softmax (running max and sum rescale the partial output; a tile's exponentials vectorised by
//! `core::cpu::exp_in_place`), so S is never stored; only the keys
//! some row of the block can see are visited (causal / window tiles skipped), and blocks run
//! across cores. The backward recomputes P from lse in two passes without atomics: dk/dv per
//! (batch, kv head, key block), dq per (batch, head, query block) — the same bits every run.

use super::{visible_keys, BwdTensors, Problem, Seqs};
use crate::core::cpu::exp_in_place;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::host;
use crate::core::tensor::Tensor;
use rayon::prelude::*;

const QB: usize = 32;
const KB: usize = 64;

/// The elements of `t`'s storage its view spans, widened to f32 (index with the view's strides).
fn span_f32(t: &Tensor) -> Result<Vec<f32>> {
    let n = t.layout().max_offset("attention")? - t.layout().offset();
    match t.dtype() {
        DType::F16 => t.with_cpu::<half::f16, _>(|s| s[..n].iter().map(|x| x.to_f32()).collect()),
        DType::BF16 => t.with_cpu::<half::bf16, _>(|s| s[..n].iter().map(|x| x.to_f32()).collect()),
        _ => t.with_cpu::<f32, _>(|s| s[..n].to_vec()),
    }
}

/// Writes `span` (as read by `span_f32`, then updated) back into `t`, rounding to its dtype.
fn store_span(t: &Tensor, span: &[f32]) -> Result<()> {
    let n = span.len();
    match t.dtype() {
        DType::F16 => t.with_cpu_mut::<half::f16, _>(|s| {
            s[..n]
                .iter_mut()
                .zip(span)
                .for_each(|(o, &x)| *o = half::f16::from_f32(x))
        }),
        DType::BF16 => t.with_cpu_mut::<half::bf16, _>(|s| {
            s[..n]
                .iter_mut()
                .zip(span)
                .for_each(|(o, &x)| *o = half::bf16::from_f32(x))
        }),
        _ => t.with_cpu_mut::<f32, _>(|s| s[..n].copy_from_slice(span)),
    }
}

/// dot product with 8 independent partial sums (vectorises; a single f32 chain would not).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// A tensor's span with its (batch, seq, head) strides.
struct View {
    data: Vec<f32>,
    st: [usize; 3],
}

/// Inputs and geometry shared by every variant.
struct Ctx<'a> {
    p: &'a Problem,
    seqs: &'a Seqs,
    q: View,
    k: View,
    v: View,
}

fn st(s: [i64; 3]) -> [usize; 3] {
    [s[0] as usize, s[1] as usize, s[2] as usize]
}

impl Ctx<'_> {
    /// Element offset of (sequence b, row i of it, head h) in a tensor with strides `st`;
    /// `start` is the sequence's first row (varlen) — padded tensors use the batch stride.
    #[inline]
    fn at(&self, st: [usize; 3], b: usize, start: usize, i: usize, h: usize) -> usize {
        if self.p.varlen {
            (start + i) * st[1] + h * st[2]
        } else {
            b * st[0] + i * st[1] + h * st[2]
        }
    }
    fn q_row(&self, b: usize, i: usize, h: usize) -> &[f32] {
        let o = self.at(self.q.st, b, self.seqs.q[b].0, i, h);
        &self.q.data[o..o + self.p.head_dim]
    }
    fn k_row(&self, b: usize, j: usize, h: usize) -> &[f32] {
        let o = self.at(self.k.st, b, self.seqs.k[b].0, j, h);
        &self.k.data[o..o + self.p.head_dim]
    }
    fn v_row(&self, b: usize, j: usize, h: usize) -> &[f32] {
        let o = self.at(self.v.st, b, self.seqs.k[b].0, j, h);
        &self.v.data[o..o + self.p.head_dim]
    }
    /// Soft-capped, scaled score of one (query, key) pair.
    #[inline]
    fn score(&self, q: &[f32], k: &[f32]) -> f32 {
        let s = self.p.scale * dot(q, k);
        if self.p.softcap > 0.0 {
            self.p.softcap * (s / self.p.softcap).tanh()
        } else {
            s
        }
    }
    /// d(capped)/d(raw) given the capped score: 1 − tanh².
    #[inline]
    fn cap_grad(&self, s: f32) -> f32 {
        if self.p.softcap > 0.0 {
            let t = s / self.p.softcap;
            1.0 - t * t
        } else {
            1.0
        }
    }
    fn lse_index(&self, b: usize, h: usize, i: usize) -> usize {
        let p = self.p;
        if p.varlen {
            h * self.seqs.total_q + self.seqs.q[b].0 + i
        } else {
            (b * p.heads_q + h) * p.seqlen_q + i
        }
    }
    fn visible(&self, b: usize, i: usize) -> (usize, usize) {
        visible_keys(
            i,
            self.seqs.q[b].1,
            self.seqs.k[b].1,
            self.p.window_left,
            self.p.window_right,
        )
    }
    fn group(&self) -> usize {
        self.p.heads_q / self.p.heads_kv
    }
}

fn ctx<'a>(p: &'a Problem, seqs: &'a Seqs, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Ctx<'a>> {
    Ok(Ctx {
        p,
        seqs,
        q: View {
            data: span_f32(q)?,
            st: st(p.q_stride),
        },
        k: View {
            data: span_f32(k)?,
            st: st(p.k_stride),
        },
        v: View {
            data: span_f32(v)?,
            st: st(p.v_stride),
        },
    })
}

/// Row results in a compact `[row, head, D]` order (row counting through the batch, as in Seqs);
/// written into the strided output at the end.
struct Compact {
    data: Vec<f32>,
    heads: usize,
    d: usize,
}

impl Compact {
    fn new(rows: usize, heads: usize, d: usize, what: &str) -> Result<Self> {
        Ok(Compact {
            data: host::zeroed(rows * heads * d, what)?,
            heads,
            d,
        })
    }
    fn row_mut(&mut self, row: usize, h: usize) -> &mut [f32] {
        let o = (row * self.heads + h) * self.d;
        &mut self.data[o..o + self.d]
    }
    /// Writes every (sequence, row, head) of `seqs` into `t` with strides `stv`.
    fn store(&self, c: &Ctx, t: &Tensor, stv: [i64; 3], seqs: &[(usize, usize)]) -> Result<()> {
        let mut span = span_f32(t)?;
        let stv = st(stv);
        for (b, &(start, len)) in seqs.iter().enumerate() {
            for i in 0..len {
                for h in 0..self.heads {
                    let o = c.at(stv, b, start, i, h);
                    let src = ((start + i) * self.heads + h) * self.d;
                    span[o..o + self.d].copy_from_slice(&self.data[src..src + self.d]);
                }
            }
        }
        store_span(t, &span)
    }
}

fn rows_of(s: &[(usize, usize)]) -> usize {
    s.iter().map(|&(a, l)| a + l).max().unwrap_or(0)
}

#[allow(clippy::too_many_arguments)]
pub fn forward(
    variant: &str,
    p: &Problem,
    seqs: &Seqs,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
) -> Result<()> {
    let c = ctx(p, seqs, q, k, v)?;
    let mut out = Compact::new(
        rows_of(&seqs.q),
        p.heads_q,
        p.head_dim,
        "attention CPU output",
    )?;
    let mut lse_v = host::zeroed(lse.numel(), "attention CPU lse")?;
    if variant == "naive" {
        forward_naive(&c, &mut out, &mut lse_v)?;
    } else {
        forward_tiled(&c, &mut out, &mut lse_v);
    }
    out.store(&c, o, p.o_stride, &seqs.q)?;
    lse.write_f32(&lse_v)
}

fn forward_naive(c: &Ctx, out: &mut Compact, lse: &mut [f32]) -> Result<()> {
    let (p, d) = (c.p, c.p.head_dim);
    // One sequence's S (then P) at a time: the largest Sq·Sk of the batch, allocated once.
    let mut scratch = host::zeroed::<f32>(largest_scores(c), "attention CPU scores (naive)")?;
    for b in 0..p.batch {
        let ((qs, sq), (_, sk)) = (c.seqs.q[b], c.seqs.k[b]);
        for h in 0..p.heads_q {
            let hk = h / c.group();
            // S, then P in place.
            let s = &mut scratch[..sq * sk];
            s.fill(f32::NEG_INFINITY);
            for i in 0..sq {
                let (lo, hi) = c.visible(b, i);
                for j in lo..hi {
                    s[i * sk + j] = c.score(c.q_row(b, i, h), c.k_row(b, j, hk));
                }
            }
            for i in 0..sq {
                let row = &mut s[i * sk..(i + 1) * sk];
                let m = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                if m == f32::NEG_INFINITY {
                    row.fill(0.0);
                    lse[c.lse_index(b, h, i)] = f32::NEG_INFINITY;
                    continue;
                }
                let mut sum = 0f64;
                for x in row.iter_mut() {
                    *x = (*x - m).exp();
                    sum += *x as f64;
                }
                let inv = (1.0 / sum) as f32;
                row.iter_mut().for_each(|x| *x *= inv);
                lse[c.lse_index(b, h, i)] = m + (sum as f32).ln();
            }
            for i in 0..sq {
                let o = out.row_mut(qs + i, h);
                o.fill(0.0);
                for j in 0..sk {
                    axpy(o, s[i * sk + j], c.v_row(b, j, hk));
                }
                debug_assert_eq!(o.len(), d);
            }
        }
    }
    Ok(())
}

/// The largest Sq·Sk over the batch's sequences (a naive rung's scores of one head).
fn largest_scores(c: &Ctx) -> usize {
    c.seqs
        .q
        .iter()
        .zip(&c.seqs.k)
        .map(|(&(_, sq), &(_, sk))| sq * sk)
        .max()
        .unwrap_or(0)
}

/// One block of query rows of one (sequence, head): (o rows, lse per row).
fn forward_block(c: &Ctx, b: usize, h: usize, i0: usize, i1: usize) -> (Vec<f32>, Vec<f32>) {
    let d = c.p.head_dim;
    let hk = h / c.group();
    let n = i1 - i0;
    let ranges: Vec<(usize, usize)> = (i0..i1).map(|i| c.visible(b, i)).collect();
    let lo = ranges
        .iter()
        .filter(|r| r.1 > r.0)
        .map(|r| r.0)
        .min()
        .unwrap_or(0);
    let hi = ranges.iter().map(|r| r.1).max().unwrap_or(0);
    let mut m = vec![f32::NEG_INFINITY; n];
    let mut l = vec![0f32; n];
    let mut acc = vec![0f32; n * d];
    let mut s = [0f32; KB];
    let mut j0 = lo;
    while j0 < hi {
        let j1 = (j0 + KB).min(hi);
        for r in 0..n {
            let (rlo, rhi) = (ranges[r].0.max(j0), ranges[r].1.min(j1));
            if rlo >= rhi {
                continue;
            }
            let qi = c.q_row(b, i0 + r, h);
            let mut mt = f32::NEG_INFINITY;
            for j in rlo..rhi {
                s[j - j0] = c.score(qi, c.k_row(b, j, hk));
                mt = mt.max(s[j - j0]);
            }
            let m_new = m[r].max(mt);
            // The running sum and output were taken against the old max: rescale them.
            let alpha = (m[r] - m_new).exp();
            let a = &mut acc[r * d..(r + 1) * d];
            if alpha != 1.0 {
                a.iter_mut().for_each(|x| *x *= alpha);
            }
            // The block's probabilities at once: the exponentials vectorise (exp_in_place).
            let p = &mut s[rlo - j0..rhi - j0];
            p.iter_mut().for_each(|x| *x -= m_new);
            exp_in_place(p);
            let mut ls = 0f32;
            for (j, &pj) in (rlo..rhi).zip(p.iter()) {
                ls += pj;
                axpy(a, pj, c.v_row(b, j, hk));
            }
            l[r] = l[r] * alpha + ls;
            m[r] = m_new;
        }
        j0 = j1;
    }
    let mut lse = vec![0f32; n];
    for r in 0..n {
        let a = &mut acc[r * d..(r + 1) * d];
        if l[r] == 0.0 {
            a.fill(0.0);
            lse[r] = f32::NEG_INFINITY;
        } else {
            let inv = 1.0 / l[r];
            a.iter_mut().for_each(|x| *x *= inv);
            lse[r] = m[r] + l[r].ln();
        }
    }
    (acc, lse)
}

/// (sequence, head, first row, end row) blocks of `rows` rows over every sequence of `side`.
fn blocks(side: &[(usize, usize)], heads: usize, rows: usize) -> Vec<(usize, usize, usize, usize)> {
    let mut v = Vec::new();
    for (b, &(_, len)) in side.iter().enumerate() {
        for h in 0..heads {
            for i0 in (0..len).step_by(rows) {
                v.push((b, h, i0, (i0 + rows).min(len)));
            }
        }
    }
    v
}

fn forward_tiled(c: &Ctx, out: &mut Compact, lse: &mut [f32]) {
    let work = blocks(&c.seqs.q, c.p.heads_q, QB);
    let results: Vec<_> = work
        .par_iter()
        .map(|&(b, h, i0, i1)| forward_block(c, b, h, i0, i1))
        .collect();
    let d = c.p.head_dim;
    for (&(b, h, i0, i1), (o, l)) in work.iter().zip(results) {
        let qs = c.seqs.q[b].0;
        for r in 0..i1 - i0 {
            out.row_mut(qs + i0 + r, h)
                .copy_from_slice(&o[r * d..(r + 1) * d]);
            lse[c.lse_index(b, h, i0 + r)] = l[r];
        }
    }
}

/// dO, o (with o's strides), lse and D = rowsum(dO ⊙ o) of a backward call.
struct Grad {
    dout: View,
    lse: Vec<f32>,
    dsum: Vec<f32>,
}

impl Grad {
    fn do_row<'a>(&'a self, c: &Ctx, b: usize, i: usize, h: usize) -> &'a [f32] {
        let o = c.at(self.dout.st, b, c.seqs.q[b].0, i, h);
        &self.dout.data[o..o + c.p.head_dim]
    }
}

fn grad(c: &Ctx, t: &BwdTensors) -> Result<Grad> {
    let stv = st(c.p.o_stride);
    let dout = View {
        data: span_f32(t.dout)?,
        st: stv,
    };
    let o = span_f32(t.o)?;
    let mut g = Grad {
        dout,
        lse: t.lse.to_f32_vec()?,
        dsum: host::zeroed(t.lse.numel(), "attention CPU backward row sums")?,
    };
    let d = c.p.head_dim;
    for (b, &(start, len)) in c.seqs.q.iter().enumerate() {
        for h in 0..c.p.heads_q {
            for i in 0..len {
                let at = c.at(stv, b, start, i, h);
                g.dsum[c.lse_index(b, h, i)] = dot(&g.dout.data[at..at + d], &o[at..at + d]);
            }
        }
    }
    Ok(g)
}

pub fn backward(variant: &str, p: &Problem, seqs: &Seqs, t: &BwdTensors) -> Result<()> {
    let c = ctx(p, seqs, t.q, t.k, t.v)?;
    let g = grad(&c, t)?;
    let d = p.head_dim;
    let mut dq = Compact::new(rows_of(&seqs.q), p.heads_q, d, "attention CPU dq")?;
    let mut dk = Compact::new(rows_of(&seqs.k), p.heads_kv, d, "attention CPU dk")?;
    let mut dv = Compact::new(rows_of(&seqs.k), p.heads_kv, d, "attention CPU dv")?;
    if variant == "naive" {
        backward_naive(&c, &g, &mut dq, &mut dk, &mut dv)?;
    } else {
        backward_tiled(&c, &g, &mut dq, &mut dk, &mut dv);
    }
    dq.store(&c, t.dq, p.q_stride, &seqs.q)?;
    dk.store(&c, t.dk, p.k_stride, &seqs.k)?;
    dv.store(&c, t.dv, p.v_stride, &seqs.k)
}

/// P and dS of one visible pair: (p, ds) with ds already times the softcap derivative.
#[inline]
fn p_ds(c: &Ctx, g: &Grad, b: usize, h: usize, i: usize, j: usize) -> (f32, f32) {
    let hk = h / c.group();
    let lse = g.lse[c.lse_index(b, h, i)];
    if lse == f32::NEG_INFINITY {
        return (0.0, 0.0);
    }
    let s = c.score(c.q_row(b, i, h), c.k_row(b, j, hk));
    let pij = (s - lse).exp();
    let dp = dot(g.do_row(c, b, i, h), c.v_row(b, j, hk));
    (
        pij,
        pij * (dp - g.dsum[c.lse_index(b, h, i)]) * c.cap_grad(s),
    )
}

fn backward_naive(
    c: &Ctx,
    g: &Grad,
    dq: &mut Compact,
    dk: &mut Compact,
    dv: &mut Compact,
) -> Result<()> {
    let p = c.p;
    let n = largest_scores(c);
    let (mut pm_all, mut ds_all) = (
        host::zeroed::<f32>(n, "attention CPU probabilities (naive backward)")?,
        host::zeroed::<f32>(n, "attention CPU dS (naive backward)")?,
    );
    for b in 0..p.batch {
        let ((qs, sq), (ks, sk)) = (c.seqs.q[b], c.seqs.k[b]);
        for h in 0..p.heads_q {
            let hk = h / c.group();
            // P and dS materialised (dP folded into dS as each entry is made).
            let (pm, ds) = (&mut pm_all[..sq * sk], &mut ds_all[..sq * sk]);
            pm.fill(0.0);
            ds.fill(0.0);
            for i in 0..sq {
                let (lo, hi) = c.visible(b, i);
                for j in lo..hi {
                    (pm[i * sk + j], ds[i * sk + j]) = p_ds(c, g, b, h, i, j);
                }
            }
            for i in 0..sq {
                let r = dq.row_mut(qs + i, h);
                for j in 0..sk {
                    axpy(r, p.scale * ds[i * sk + j], c.k_row(b, j, hk));
                }
            }
            for j in 0..sk {
                for i in 0..sq {
                    axpy(
                        dk.row_mut(ks + j, hk),
                        p.scale * ds[i * sk + j],
                        c.q_row(b, i, h),
                    );
                    axpy(dv.row_mut(ks + j, hk), pm[i * sk + j], g.do_row(c, b, i, h));
                }
            }
        }
    }
    Ok(())
}

fn backward_tiled(c: &Ctx, g: &Grad, dq: &mut Compact, dk: &mut Compact, dv: &mut Compact) {
    let (p, d) = (c.p, c.p.head_dim);
    // dq: each query block of each head owns its rows.
    let work = blocks(&c.seqs.q, p.heads_q, QB);
    let res: Vec<Vec<f32>> = work
        .par_iter()
        .map(|&(b, h, i0, i1)| {
            let hk = h / c.group();
            let mut acc = vec![0f32; (i1 - i0) * d];
            for i in i0..i1 {
                let (lo, hi) = c.visible(b, i);
                let a = &mut acc[(i - i0) * d..(i - i0 + 1) * d];
                for j in lo..hi {
                    let (_, ds) = p_ds(c, g, b, h, i, j);
                    axpy(a, p.scale * ds, c.k_row(b, j, hk));
                }
            }
            acc
        })
        .collect();
    for (&(b, h, i0, i1), a) in work.iter().zip(res) {
        let qs = c.seqs.q[b].0;
        for r in 0..i1 - i0 {
            dq.row_mut(qs + i0 + r, h)
                .copy_from_slice(&a[r * d..(r + 1) * d]);
        }
    }
    // dk, dv: each key block of each kv head owns its rows and sums over the group's heads.
    let work = blocks(&c.seqs.k, p.heads_kv, KB);
    let res: Vec<(Vec<f32>, Vec<f32>)> = work
        .par_iter()
        .map(|&(b, hk, j0, j1)| {
            let n = j1 - j0;
            let (mut ak, mut av) = (vec![0f32; n * d], vec![0f32; n * d]);
            let sq = c.seqs.q[b].1;
            for h in hk * c.group()..(hk + 1) * c.group() {
                for i in 0..sq {
                    let (lo, hi) = c.visible(b, i);
                    let (lo, hi) = (lo.max(j0), hi.min(j1));
                    if lo >= hi {
                        continue;
                    }
                    let (qi, doi) = (c.q_row(b, i, h), g.do_row(c, b, i, h));
                    for j in lo..hi {
                        let (pij, ds) = p_ds(c, g, b, h, i, j);
                        let r = (j - j0) * d;
                        axpy(&mut ak[r..r + d], p.scale * ds, qi);
                        axpy(&mut av[r..r + d], pij, doi);
                    }
                }
            }
            (ak, av)
        })
        .collect();
    for (&(b, hk, j0, j1), (ak, av)) in work.iter().zip(res) {
        let ks = c.seqs.k[b].0;
        for r in 0..j1 - j0 {
            dk.row_mut(ks + j0 + r, hk)
                .copy_from_slice(&ak[r * d..(r + 1) * d]);
            dv.row_mut(ks + j0 + r, hk)
                .copy_from_slice(&av[r * d..(r + 1) * d]);
        }
    }
}
