//! CPU variants of the moe family: the CUDA pipeline's steps in the same order and layout (router,
//! plan, permutation into the padded layout, the experts' GEMMs, GLU, combine; and back), fp32
//! arithmetic, values rounded to the layer's dtype where the GPU stores them. `naive` runs on one
//! thread; `parallel` spreads the tokens and each expert's rows across cores.

use super::{MoeConfig, MoeForward, MoeGrads, MoeWeights, Problem, Score, ALIGN};
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::host;
use crate::core::tensor::Tensor;
use crate::ops::activation::cpu::act_fg;
use crate::ops::matmul::cpu as mm;
use rayon::prelude::*;

/// v as the dtype stores it.
pub fn round(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        DType::F16 => half::f16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// Writes int32 values into a caller's (validated, contiguous) i32 buffer.
fn write_i32(t: &Tensor, v: &[i32]) -> Result<()> {
    t.with_cpu_mut::<i32, _>(|d| d[..v.len()].copy_from_slice(v))
}

/// Runs `f(row, out_row)` over the rows of `out` (`cols` wide), on all cores when `par`.
fn rows_mut(par: bool, out: &mut [f32], cols: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    if cols == 0 {
        return;
    }
    if par {
        out.par_chunks_mut(cols)
            .enumerate()
            .for_each(|(r, o)| f(r, o));
    } else {
        out.chunks_mut(cols).enumerate().for_each(|(r, o)| f(r, o));
    }
}

/// One token's routing (the semantics of kernels/moe.cu's moe_router): (chosen experts, their
/// weights, all scores, logsumexp).
pub fn route(logits: &[f32], cfg: &MoeConfig) -> (Vec<usize>, Vec<f32>, Vec<f32>, f32) {
    let e = logits.len();
    let nan = logits.iter().any(|x| x.is_nan());
    let mx = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let sum: f32 = logits.iter().map(|&x| (x - mx).exp()).sum();
    let lse = mx + sum.ln();
    let sc: Vec<f32> = logits
        .iter()
        .map(|&x| match cfg.score {
            Score::Softmax => (x - lse).exp(),
            Score::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        })
        .collect();
    let mut eligible = vec![true; e];
    if cfg.topk_groups < cfg.groups {
        let gs = e / cfg.groups;
        let gscore: Vec<f32> = (0..cfg.groups)
            .map(|g| {
                let mut v: Vec<f32> = sc[g * gs..(g + 1) * gs]
                    .iter()
                    .map(|&s| if s.is_nan() { f32::NEG_INFINITY } else { s })
                    .collect();
                v.sort_by(|a, b| b.total_cmp(a));
                if gs > 1 {
                    v[0] + v[1]
                } else {
                    v[0]
                }
            })
            .collect();
        let kept = top_indices(&gscore, cfg.topk_groups, &vec![true; cfg.groups]);
        for (x, el) in eligible.iter_mut().enumerate() {
            *el = kept.contains(&(x / gs));
        }
    }
    let idx = top_indices(logits, cfg.top_k, &eligible);
    let ssum: f32 = idx.iter().map(|&i| sc[i]).sum();
    let w = idx
        .iter()
        .map(|&i| {
            let mut v = sc[i];
            if cfg.renormalize {
                v /= ssum;
            }
            v *= cfg.routed_scale;
            if nan {
                f32::NAN
            } else {
                v
            }
        })
        .collect();
    (idx, w, sc, lse)
}

/// The k eligible indices of largest key, largest first; NaN below every number, ties to the
/// lower index.
fn top_indices(keys: &[f32], k: usize, eligible: &[bool]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..keys.len()).filter(|&i| eligible[i]).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (keys[a], keys[b]);
        match (x.is_nan(), y.is_nan()) {
            (true, true) => a.cmp(&b),
            (true, false) => std::cmp::Ordering::Greater,
            (false, true) => std::cmp::Ordering::Less,
            _ => y.partial_cmp(&x).unwrap().then(a.cmp(&b)),
        }
    });
    order.truncate(k);
    order
}

/// The padded layout of a routing: (pos per pair, src per row, ends, counts, dropped).
pub fn plan(
    idx: &[usize],
    experts: usize,
    cap: Option<usize>,
    rows_cap: usize,
) -> (Vec<i32>, Vec<i32>, Vec<i32>, Vec<i32>, usize) {
    let mut counts = vec![0usize; experts];
    let mut rank = vec![0usize; idx.len()];
    for (p, &e) in idx.iter().enumerate() {
        rank[p] = counts[e];
        counts[e] += 1;
    }
    let mut ends = vec![0i32; experts];
    let (mut run, mut dropped) = (0usize, 0usize);
    for e in 0..experts {
        let kept = cap.map_or(counts[e], |c| counts[e].min(c));
        dropped += counts[e] - kept;
        run += kept.div_ceil(ALIGN) * ALIGN;
        ends[e] = run as i32;
    }
    let mut pos = vec![-1i32; idx.len()];
    let mut src = vec![-1i32; rows_cap];
    for (p, &e) in idx.iter().enumerate() {
        if cap.is_none_or(|c| rank[p] < c) {
            let row = if e > 0 { ends[e - 1] as usize } else { 0 } + rank[p];
            pos[p] = row as i32;
            src[row] = p as i32;
        }
    }
    let counts = counts.iter().map(|&c| c as i32).collect();
    (pos, src, ends, counts, dropped)
}

/// Every value of `c` rounded to `dtype` (after the `parallel` rung's GEMMs, which run in f32 on
/// matmul's packed SIMD kernel: a fixed blocking, so the same bits on every run; the `naive`
/// rung's dot-product loops below walk B down its columns, ~30× slower).
fn round_all(dtype: DType, c: &mut [f32]) {
    if dtype != DType::F32 {
        c.par_iter_mut().for_each(|v| *v = round(dtype, *v));
    }
}

/// c[r] = a[r]·op(b) for rows r of `a` (`k` wide): b `[k, n]` row-major, or with `bt` stored
/// `[n, k]` (read transposed). fp32 accumulate, rounded to `dtype`.
#[allow(clippy::too_many_arguments)]
fn gemm_rows(
    par: bool,
    a: &[f32],
    k: usize,
    b: &[f32],
    n: usize,
    bt: bool,
    dtype: DType,
    c: &mut [f32],
) {
    if par {
        let rows = c.len().checked_div(n).unwrap_or(0);
        let ldb = if bt { k } else { n };
        mm::product(true, 0, (rows, n, k), a, k, false, b, ldb, bt, c, n);
        return round_all(dtype, c);
    }
    rows_mut(par, c, n, |r, o| {
        let ar = &a[r * k..(r + 1) * k];
        for (j, oj) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for (q, &av) in ar.iter().enumerate() {
                let bv = if bt { b[j * k + q] } else { b[q * n + j] };
                acc += av * bv;
            }
            *oj = round(dtype, acc);
        }
    });
}

/// c = aᵀ·b for a `[rows, m]`, b `[rows, n]` → c `[m, n]`, rounded to `dtype`.
fn gemm_tn(par: bool, a: &[f32], m: usize, b: &[f32], n: usize, dtype: DType, c: &mut [f32]) {
    let rows = a.len().checked_div(m).unwrap_or(0);
    if par {
        mm::product(true, 0, (m, n, rows), a, m, true, b, n, false, c, n);
        return round_all(dtype, c);
    }
    rows_mut(par, c, n, |i, o| {
        for (j, oj) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for r in 0..rows {
                acc += a[r * m + i] * b[r * n + j];
            }
            *oj = round(dtype, acc);
        }
    });
}

fn seg(ends: &[i32], e: usize) -> (usize, usize) {
    (
        if e > 0 { ends[e - 1] as usize } else { 0 },
        ends[e] as usize,
    )
}

/// The host values of a routing that the later CPU steps read (also written to the forward's
/// buffers): the layout `xp` and its `ends`, each pair's row `pos` and gate `weights`, the scores
/// `probs`, `lse` and the per-expert `counts` the losses need.
pub struct Routed {
    pub xp: Vec<f32>,
    pub ends: Vec<i32>,
    pub pos: Vec<i32>,
    pub weights: Vec<f32>,
    pub probs: Vec<f32>,
    pub lse: Vec<f32>,
    pub counts: Vec<i32>,
}

/// The routing and layout steps (logits, router, plan, x into the layout) into the forward's
/// buffers — everything but `out`, `losses` and `hpre` — and their host values.
pub fn route_into(
    par: bool,
    p: &Problem,
    x: &Tensor,
    router: &Tensor,
    cfg: &MoeConfig,
    f: &MoeForward,
) -> Result<Routed> {
    let (t, h, e, k, dt) = (p.tokens, p.hidden, p.experts, p.top_k, p.dtype);
    let xs = x.to_f32_vec()?;
    let router = router.to_f32_vec()?;
    let mut logits = host::zeroed::<f32>(t * e, "moe: the CPU path's `logits` buffer")?;
    gemm_rows(par, &xs, h, &router, e, true, dt, &mut logits);
    let routes: Vec<_> = if par {
        logits.par_chunks(e).map(|l| route(l, cfg)).collect()
    } else {
        logits.chunks(e).map(|l| route(l, cfg)).collect()
    };
    let idx: Vec<usize> = routes.iter().flat_map(|r| r.0.iter().copied()).collect();
    let weights: Vec<f32> = routes.iter().flat_map(|r| r.1.iter().copied()).collect();
    let probs: Vec<f32> = routes.iter().flat_map(|r| r.2.iter().copied()).collect();
    let lse: Vec<f32> = routes.iter().map(|r| r.3).collect();
    let rows_cap = p.rows_cap();
    let (pos, src, ends, counts, dropped) = plan(&idx, e, cfg.capacity(t), rows_cap);
    let used = ends[e - 1] as usize;
    let mut xp = host::zeroed::<f32>(rows_cap * h, "moe: the CPU path's `xp` buffer")?;
    rows_mut(par, &mut xp[..used * h], h, |r, o| {
        if src[r] >= 0 {
            let tok = src[r] as usize / k;
            o.copy_from_slice(&xs[tok * h..(tok + 1) * h]);
        }
    });
    for (t, v) in [
        (&f.logits, &logits),
        (&f.probs, &probs),
        (&f.lse, &lse),
        (&f.weights, &weights),
        (&f.xp, &xp),
    ] {
        t.write_f32(v)?;
    }
    let idx: Vec<i32> = idx.iter().map(|&v| v as i32).collect();
    let stats = [dropped as i32, used as i32];
    for (t, v) in [
        (&f.idx, &idx[..]),
        (&f.pos, &pos[..]),
        (&f.src, &src[..]),
        (&f.ends, &ends[..]),
        (&f.counts, &counts[..]),
        (&f.stats, &stats[..]),
    ] {
        write_i32(t, v)?;
    }
    Ok(Routed {
        xp,
        ends,
        pos,
        weights,
        probs,
        lse,
        counts,
    })
}

/// The experts' half of the forward over the padded segments ending at `ends` (`rows` rows of
/// `xp`, `[rows, H]`): returns (hpre `[rows, 2I]`, y `[rows, H]`), values rounded to the dtype.
#[allow(clippy::too_many_arguments)]
pub fn experts_forward(
    par: bool,
    p: &Problem,
    ends: &[i32],
    rows: usize,
    xp: &[f32],
    wu: &[f32],
    wd: &[f32],
    act: crate::core::act::Activation,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (h, i, dt) = (p.hidden, p.inter, p.dtype);
    let mut hpre = host::zeroed::<f32>(rows * 2 * i, "moe: the CPU path's `hpre` buffer")?;
    let mut hh = host::zeroed::<f32>(rows * i, "moe: the CPU path's `hh` buffer")?;
    let mut y = host::zeroed::<f32>(rows * h, "moe: the CPU path's `y` buffer")?;
    for ex in 0..ends.len() {
        let (s, en) = seg(ends, ex);
        gemm_rows(
            par,
            &xp[s * h..en * h],
            h,
            &wu[ex * h * 2 * i..(ex + 1) * h * 2 * i],
            2 * i,
            false,
            dt,
            &mut hpre[s * 2 * i..en * 2 * i],
        );
        let hp = &hpre[s * 2 * i..en * 2 * i];
        rows_mut(par, &mut hh[s * i..en * i], i, |r, o| {
            for (c, oc) in o.iter_mut().enumerate() {
                let (g, u) = (hp[r * 2 * i + c], hp[r * 2 * i + i + c]);
                *oc = round(dt, act_fg(act, g).0 * u);
            }
        });
        gemm_rows(
            par,
            &hh[s * i..en * i],
            i,
            &wd[ex * i * h..(ex + 1) * i * h],
            h,
            false,
            dt,
            &mut y[s * h..en * h],
        );
    }
    Ok((hpre, y))
}

/// `out[t] = Σ_j w[t,j]·y[pos[t,j]]` and the losses (mean score per expert, aux, z), into the
/// forward's buffers, from the routing `r`.
pub fn combine_into(
    par: bool,
    p: &Problem,
    cfg: &MoeConfig,
    (f, r): (&MoeForward, &Routed),
    y: &[f32],
) -> Result<()> {
    let (t, h, e, k, dt) = (p.tokens, p.hidden, p.experts, p.top_k, p.dtype);
    let (pos, weights, probs, lse, counts) = (&r.pos, &r.weights, &r.probs, &r.lse, &r.counts);
    let mut out = host::zeroed::<f32>(t * h, "moe: the CPU path's `out` buffer")?;
    rows_mut(par, &mut out, h, |tok, o| {
        for (c, oc) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for j in 0..k {
                let r = pos[tok * k + j];
                if r >= 0 {
                    acc += weights[tok * k + j] * y[r as usize * h + c];
                }
            }
            *oc = round(dt, acc);
        }
    });
    let mut losses = vec![0f32; 2 + e];
    let mut aux = 0f32;
    for ex in 0..e {
        let pm = (0..t).map(|tok| probs[tok * e + ex]).sum::<f32>() / t as f32;
        losses[2 + ex] = pm;
        aux += counts[ex] as f32 / (t * k) as f32 * pm;
    }
    losses[0] = cfg.aux_loss_coef * e as f32 * aux;
    losses[1] = cfg.z_loss_coef * lse.iter().map(|l| l * l).sum::<f32>() / t as f32;
    f.out.write_f32(&out)?;
    f.losses.write_f32(&losses)
}

pub fn forward(
    variant: &str,
    p: &Problem,
    x: &Tensor,
    w: &MoeWeights,
    cfg: &MoeConfig,
    f: &MoeForward,
) -> Result<()> {
    let par = variant == "parallel";
    let r = route_into(par, p, x, w.router, cfg, f)?;
    let (wu, wd) = (w.w_up.to_f32_vec()?, w.w_down.to_f32_vec()?);
    let (hpre, y) = experts_forward(par, p, &r.ends, p.rows_cap(), &r.xp, &wu, &wd, cfg.act)?;
    f.hpre.write_f32(&hpre)?;
    combine_into(par, p, cfg, (f, &r), &y)
}

/// dlogits of one token (kernels/moe.cu's moe_router_bwd).
#[allow(clippy::too_many_arguments)]
pub fn router_grad(
    dw: &[f32],
    idx: &[i32],
    probs: &[f32],
    lse: f32,
    logits: &[f32],
    counts: &[i32],
    tokens: usize,
    cfg: &MoeConfig,
) -> Vec<f32> {
    let e = probs.len();
    let k = idx.len();
    let aux = cfg.aux_loss_coef * e as f32 / (tokens as f32 * tokens as f32 * k as f32);
    let mut ds: Vec<f32> = counts.iter().map(|&c| aux * c as f32).collect();
    let s: f32 = idx.iter().map(|&i| probs[i as usize]).sum();
    let gs: f32 = idx
        .iter()
        .zip(dw)
        .map(|(&i, &g)| g * probs[i as usize])
        .sum();
    for (&i, &g) in idx.iter().zip(dw) {
        ds[i as usize] += if cfg.renormalize {
            cfg.routed_scale * (g / s - gs / (s * s))
        } else {
            cfg.routed_scale * g
        };
    }
    let dot: f32 = probs.iter().zip(&ds).map(|(p, d)| p * d).sum();
    let zc = 2.0 * cfg.z_loss_coef * lse / tokens as f32;
    (0..e)
        .map(|x| {
            let pe = probs[x];
            let mut d = match cfg.score {
                Score::Softmax => pe * (ds[x] - dot),
                Score::Sigmoid => ds[x] * pe * (1.0 - pe),
            };
            if cfg.z_loss_coef != 0.0 {
                d += zc * (logits[x] - lse).exp();
            }
            d
        })
        .collect()
}

/// The losses' incoming gradients folded into the coefficients (None: 1 each).
pub fn scaled_losses(cfg: &MoeConfig, loss_grad: Option<&Tensor>) -> Result<MoeConfig> {
    let lg = match loss_grad {
        Some(t) => t.to_f32_vec()?,
        None => vec![1.0, 1.0],
    };
    Ok(MoeConfig {
        aux_loss_coef: cfg.aux_loss_coef * lg[0],
        z_loss_coef: cfg.z_loss_coef * lg[1],
        ..cfg.clone()
    })
}

/// dout's rows in the layout, unscaled (zeros on padding): `rows` rows, row r from token
/// `src[r] / k`.
pub fn spread(par: bool, p: &Problem, g: &[f32], src: &[i32], used: usize) -> Result<Vec<f32>> {
    let (h, k) = (p.hidden, p.top_k);
    let mut dyu = host::zeroed::<f32>(src.len() * h, "moe: the CPU path's `dyu` buffer")?;
    rows_mut(par, &mut dyu[..used * h], h, |r, o| {
        if src[r] >= 0 {
            let tok = src[r] as usize / k;
            o.copy_from_slice(&g[tok * h..(tok + 1) * h]);
        }
    });
    Ok(dyu)
}

/// What the experts' backward produced: the gates' gradient of each row (`<gu, a>`), dxp =
/// dhpre·W_upᵀ `[rows, H]`, and the experts' weight gradients.
pub struct ExpertGrads {
    pub dots: Vec<f32>,
    pub dxp: Vec<f32>,
    pub dw_up: Vec<f32>,
    pub dw_down: Vec<f32>,
}

/// The experts' half of the backward over the segments ending at `ends` (`rows` rows; `scale[r]`
/// is row r's gate weight, 0 on padding). Per row (kernels/moe.cu's moe_glu_bwd): gu =
/// dyu·W_downᵀ, the GLU output a recomputed from hpre, the gate's gradient <gu, a>, s·a for
/// dW_down and the GLU backward of s·gu.
#[allow(clippy::too_many_arguments)]
pub fn experts_backward(
    par: bool,
    p: &Problem,
    ends: &[i32],
    scale: &[f32],
    (dyu, xp, hpre): (&[f32], &[f32], &[f32]),
    wu: &[f32],
    wd: &[f32],
    act: crate::core::act::Activation,
) -> Result<ExpertGrads> {
    let (h, i, dt) = (p.hidden, p.inter, p.dtype);
    let (rows, e) = (scale.len(), ends.len());
    let mut gu = host::zeroed::<f32>(rows * i, "moe: the CPU path's `gu` buffer")?;
    let mut wa = host::zeroed::<f32>(rows * i, "moe: the CPU path's `wa` buffer")?;
    let mut dots = host::zeroed::<f32>(rows, "moe: the CPU path's `dots` buffer")?;
    let mut dhpre = host::zeroed::<f32>(rows * 2 * i, "moe: the CPU path's `dhpre` buffer")?;
    let mut dxp = host::zeroed::<f32>(rows * h, "moe: the CPU path's `dxp` buffer")?;
    let mut dw_up = host::zeroed::<f32>(e * h * 2 * i, "moe: the CPU path's `dw_up` buffer")?;
    let mut dw_down = host::zeroed::<f32>(e * i * h, "moe: the CPU path's `dw_down` buffer")?;
    for ex in 0..e {
        let (s, en) = seg(ends, ex);
        let wd_e = &wd[ex * i * h..(ex + 1) * i * h];
        // gu = dyu·W_downᵀ (W_down [I, H] read as [n = I, k = H] transposed).
        gemm_rows(
            par,
            &dyu[s * h..en * h],
            h,
            wd_e,
            i,
            true,
            dt,
            &mut gu[s * i..en * i],
        );
        let (hp, gus) = (&hpre[s * 2 * i..en * 2 * i], &gu[s * i..en * i]);
        let row = |r: usize| {
            let sc = scale[s + r];
            let mut d = vec![0f32; 2 * i];
            let mut wr = vec![0f32; i];
            let mut dot = 0f32;
            for c in 0..i {
                let (gt, u) = (hp[r * 2 * i + c], hp[r * 2 * i + i + c]);
                let (a, da) = act_fg(act, gt);
                let gv = gus[r * i + c];
                let hv = round(dt, a * u);
                let dd = sc * gv;
                d[c] = round(dt, dd * u * da);
                d[i + c] = round(dt, dd * a);
                wr[c] = round(dt, sc * hv);
                dot += gv * hv;
            }
            (dot, d, wr)
        };
        let rows: Vec<(f32, Vec<f32>, Vec<f32>)> = if par {
            (0..en - s).into_par_iter().map(row).collect()
        } else {
            (0..en - s).map(row).collect()
        };
        for (r, (dot, d, wr)) in rows.into_iter().enumerate() {
            dots[s + r] = dot;
            dhpre[(s + r) * 2 * i..(s + r + 1) * 2 * i].copy_from_slice(&d);
            wa[(s + r) * i..(s + r + 1) * i].copy_from_slice(&wr);
        }
        gemm_tn(
            par,
            &wa[s * i..en * i],
            i,
            &dyu[s * h..en * h],
            h,
            dt,
            &mut dw_down[ex * i * h..(ex + 1) * i * h],
        );
        let wu_e = &wu[ex * h * 2 * i..(ex + 1) * h * 2 * i];
        gemm_rows(
            par,
            &dhpre[s * 2 * i..en * 2 * i],
            2 * i,
            wu_e,
            h,
            true,
            dt,
            &mut dxp[s * h..en * h],
        );
        gemm_tn(
            par,
            &xp[s * h..en * h],
            h,
            &dhpre[s * 2 * i..en * 2 * i],
            2 * i,
            dt,
            &mut dw_up[ex * h * 2 * i..(ex + 1) * h * 2 * i],
        );
    }
    Ok(ExpertGrads {
        dots,
        dxp,
        dw_up,
        dw_down,
    })
}

/// The routing's half of the backward into `g.dx` and `g.d_router`: dx = `Σ_j dxp[pos]` +
/// dlogits·router, d_router = dlogitsᵀ·x, dlogits from the gates' gradients `dw` (per pair) and
/// the losses (`cfg`'s coefficients already scaled by their incoming gradients).
#[allow(clippy::too_many_arguments)]
pub fn router_backward(
    par: bool,
    p: &Problem,
    x: &Tensor,
    router: &Tensor,
    f: &MoeForward,
    cfg: &MoeConfig,
    (dxp, dw): (&[f32], &[f32]),
    g_out: &MoeGrads,
) -> Result<()> {
    let (t, h, e, k, dt) = (p.tokens, p.hidden, p.experts, p.top_k, p.dtype);
    let (xs, router) = (x.to_f32_vec()?, router.to_f32_vec()?);
    let (idx, probs, lse, logits, counts, pos) = (
        f.idx.to_vec::<i32>()?,
        f.probs.to_f32_vec()?,
        f.lse.to_f32_vec()?,
        f.logits.to_f32_vec()?,
        f.counts.to_vec::<i32>()?,
        f.pos.to_vec::<i32>()?,
    );
    let mut dlogits = host::zeroed::<f32>(t * e, "moe: the CPU path's `dlogits` buffer")?;
    rows_mut(par, &mut dlogits, e, |tok, o| {
        let d = router_grad(
            &dw[tok * k..(tok + 1) * k],
            &idx[tok * k..(tok + 1) * k],
            &probs[tok * e..(tok + 1) * e],
            lse[tok],
            &logits[tok * e..(tok + 1) * e],
            &counts,
            t,
            cfg,
        );
        for (oc, v) in o.iter_mut().zip(d) {
            *oc = round(dt, v);
        }
    });
    let mut dx = host::zeroed::<f32>(t * h, "moe: the CPU path's `dx` buffer")?;
    rows_mut(par, &mut dx, h, |tok, o| {
        for (c, oc) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for j in 0..k {
                let r = pos[tok * k + j];
                if r >= 0 {
                    acc += dxp[r as usize * h + c];
                }
            }
            let acc = round(dt, acc);
            let mut rd = 0f32;
            for ex in 0..e {
                rd += dlogits[tok * e + ex] * router[ex * h + c];
            }
            *oc = round(dt, acc + rd);
        }
    });
    let mut d_router = vec![0f32; e * h];
    gemm_tn(par, &dlogits, e, &xs, h, dt, &mut d_router);
    g_out.dx.write_f32(&dx)?;
    g_out.d_router.write_f32(&d_router)
}

/// `vals[idx[i]]`, 0 where `idx[i] < 0` (kernels/moe.cu's moe_ep_gather_f32): each layout row's
/// gate weight from its pair (`idx` = src), each pair's gate gradient from its row (`idx` = pos).
pub fn gather_f32(vals: &[f32], idx: &[i32]) -> Vec<f32> {
    idx.iter()
        .map(|&q| if q >= 0 { vals[q as usize] } else { 0.0 })
        .collect()
}

#[allow(clippy::too_many_arguments)]
pub fn backward(
    variant: &str,
    p: &Problem,
    dout: &Tensor,
    x: &Tensor,
    w: &MoeWeights,
    f: &MoeForward,
    cfg: &MoeConfig,
    loss_grad: Option<&Tensor>,
    g_out: &MoeGrads,
) -> Result<()> {
    let cfg = &scaled_losses(cfg, loss_grad)?;
    let par = variant == "parallel";
    let (src, ends) = (f.src.to_vec::<i32>()?, f.ends.to_vec::<i32>()?);
    let used = ends[p.experts - 1] as usize;
    let dyu = spread(par, p, &dout.to_f32_vec()?, &src, used)?;
    let scale = gather_f32(&f.weights.to_f32_vec()?, &src);
    let (wu, wd) = (w.w_up.to_f32_vec()?, w.w_down.to_f32_vec()?);
    let (xp, hpre) = (f.xp.to_f32_vec()?, f.hpre.to_f32_vec()?);
    let eg = experts_backward(par, p, &ends, &scale, (&dyu, &xp, &hpre), &wu, &wd, cfg.act)?;
    // The gates' gradients (dropped pairs: 0).
    let mut dw = host::zeroed::<f32>(p.tokens * p.top_k, "moe: the CPU path's `dw` buffer")?;
    for r in 0..used {
        if src[r] >= 0 {
            dw[src[r] as usize] = eg.dots[r];
        }
    }
    router_backward(par, p, x, w.router, f, cfg, (&eg.dxp, &dw), g_out)?;
    g_out.dw_up.write_f32(&eg.dw_up)?;
    g_out.dw_down.write_f32(&eg.dw_down)
}

/// grouped_mm on the CPU: each group's rows times its matrix, fp32 accumulate.
pub fn grouped_mm(
    a: &Tensor,
    b: &Tensor,
    offs: &Tensor,
    out: &Tensor,
    (m, k, n, g, _): (usize, usize, usize, usize, bool),
) -> Result<()> {
    let dt = a.dtype();
    let av = a.to_f32_vec()?;
    // b's elements in its logical [G, K, N] order (a transposed view is gathered).
    let bv = b.to_f32_vec()?;
    let ends = offs.to_vec::<i32>()?;
    let mut c = vec![0f32; m * n];
    for ex in 0..g {
        let (s, en) = seg(&ends, ex);
        gemm_rows(
            true,
            &av[s * k..en * k],
            k,
            &bv[ex * k * n..(ex + 1) * k * n],
            n,
            false,
            dt,
            &mut c[s * n..en * n],
        );
    }
    out.write_f32(&c)
}
