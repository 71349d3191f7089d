//! `ferrite check attention`: every variant, forward (o, lse) and backward (dq, dk, dv), against
//! an f64 reference on a table of named feature cases: both layouts, head dims 1 to 256, causal
//! with Sq ≠ Sk, sliding windows, GQA/MQA, variable length with empty sequences, custom scale,
//! soft-capping, fully masked rows, strided (packed-qkv) views. Outputs are NaN-poisoned first.
//!
//! The GPU tensor-core variants have two backwards: the default one (dQ summed with atomics, its
//! low bits vary between runs) and the deterministic one; each case runs both, and the
//! deterministic one is run twice and must give the same bits.
//!
//! The reference below is its own plain code on host f64 copies, nested per (sequence, head,
//! row): no indexing or arithmetic is shared with the variants.

// The reference reads as the formulas do, with explicit indices.
#![allow(clippy::needless_range_loop)]

use super::{
    attention_backward_into, attention_forward_into, variants, AttentionOptions, Layout, Varlen, OP,
};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::check::{self, rel_error};
use crate::core::harness::{CheckConfig, CheckRecord, Precision};
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;

/// One named feature combination.
#[derive(Clone, Debug)]
pub struct Case {
    pub name: &'static str,
    pub batch: usize,
    pub hq: usize,
    pub hkv: usize,
    pub sq: usize,
    pub sk: usize,
    pub d: usize,
    pub layout: Layout,
    pub causal: bool,
    pub window: (i64, i64),
    pub softcap: f32,
    pub scale: Option<f32>,
    /// Variable length: per-sequence q and k lengths (batch, sq, sk are then derived), and how
    /// much max_seqlen exceeds the longest sequence.
    pub varlen: Option<(Vec<usize>, Vec<usize>, usize)>,
    /// q, k, v (and the gradients) as strided views of packed [B, S, 3, H, D] buffers.
    pub packed: bool,
    /// Inputs uniform in ±amp.
    pub amp: f64,
}

impl Case {
    fn new(
        name: &'static str,
        b: usize,
        (hq, hkv): (usize, usize),
        (sq, sk): (usize, usize),
        d: usize,
    ) -> Case {
        Case {
            name,
            batch: b,
            hq,
            hkv,
            sq,
            sk,
            d,
            layout: Layout::Bshd,
            causal: false,
            window: (-1, -1),
            softcap: 0.0,
            scale: None,
            varlen: None,
            packed: false,
            amp: 1.0,
        }
    }
    fn bhsd(mut self) -> Self {
        self.layout = Layout::Bhsd;
        self
    }
    fn causal(mut self) -> Self {
        self.causal = true;
        self
    }
    fn window(mut self, l: i64, r: i64) -> Self {
        self.window = (l, r);
        self
    }
    fn varlen(mut self, lq: &[usize], lk: &[usize], extra: usize) -> Self {
        self.batch = lq.len();
        self.sq = lq.iter().copied().max().unwrap_or(0) + extra;
        self.sk = lk.iter().copied().max().unwrap_or(0) + extra;
        self.varlen = Some((lq.to_vec(), lk.to_vec(), extra));
        self
    }

    pub fn label(&self) -> String {
        let mut s = format!(
            "{}: B{} H{}/{} {}×{} D{}",
            self.name, self.batch, self.hq, self.hkv, self.sq, self.sk, self.d
        );
        if self.varlen.is_some() {
            s.push_str(" varlen");
        } else if self.layout == Layout::Bhsd {
            s.push_str(" bhsd");
        }
        s
    }

    pub fn options(&self, variant: &str, deterministic: bool) -> AttentionOptions {
        AttentionOptions {
            variant: Some(variant.into()),
            layout: self.layout,
            scale: self.scale,
            causal: self.causal,
            window: self.window,
            softcap: self.softcap,
            deterministic,
            ..Default::default()
        }
    }

    /// (sequence lengths of q, of k).
    fn lens(&self) -> (Vec<usize>, Vec<usize>) {
        match &self.varlen {
            Some((q, k, _)) => (q.clone(), k.clone()),
            None => (vec![self.sq; self.batch], vec![self.sk; self.batch]),
        }
    }

    /// Logical shape of a q-like (`heads`, `seq`) tensor.
    fn shape(&self, heads: usize, seq: usize, lens: &[usize]) -> Vec<usize> {
        match (&self.varlen, self.layout) {
            (Some(_), _) => vec![lens.iter().sum(), heads, self.d],
            (None, Layout::Bshd) => vec![self.batch, seq, heads, self.d],
            (None, Layout::Bhsd) => vec![self.batch, heads, seq, self.d],
        }
    }
}

/// The feature table. Quick: small sequences (CI runs the CPU naive variant on all of them).
pub fn cases(quick: bool) -> Vec<Case> {
    let mut v = vec![
        Case::new("plain d64", 2, (2, 2), (37, 37), 64),
        Case::new("bhsd d128", 1, (2, 2), (50, 50), 128).bhsd(),
        Case::new("causal sq<sk d40", 1, (2, 2), (19, 45), 40).causal(),
        Case::new("causal sq>sk d1, masked rows", 1, (1, 1), (33, 9), 1).causal(),
        Case::new("window (8,4) gqa", 2, (4, 2), (64, 64), 64).window(8, 4),
        Case::new("mqa causal left 16", 1, (4, 1), (48, 70), 32)
            .bhsd()
            .causal()
            .window(16, -1),
        Case::new("varlen causal gqa, empty seqs", 0, (4, 2), (0, 0), 64)
            .varlen(&[17, 0, 40, 5], &[23, 7, 40, 0], 0)
            .causal(),
        Case::new("varlen window right 3", 0, (2, 2), (0, 0), 48)
            .varlen(&[12, 30], &[30, 12], 5)
            .window(-1, 3),
        Case {
            softcap: 5.0,
            scale: Some(0.3),
            amp: 2.0,
            ..Case::new("softcap 5 scale 0.3", 1, (2, 2), (40, 55), 96)
        },
        Case {
            packed: true,
            ..Case::new("packed qkv views", 2, (3, 3), (29, 29), 16).causal()
        },
        Case {
            packed: true,
            ..Case::new("packed qkv views d64", 2, (2, 2), (150, 150), 64).causal()
        },
        // Several key tiles of every GPU rung (flash 32/64 keys, hopper 128), ragged last tile.
        Case::new("multi-tile d128 causal sq<sk", 1, (2, 1), (270, 333), 128).causal(),
        Case::new("varlen multi-tile d128", 0, (2, 2), (0, 0), 128).varlen(
            &[200, 333],
            &[260, 333],
            0,
        ),
        Case::new("single element", 1, (1, 1), (1, 1), 1),
        // Scores spread over tens of log2 units: a row's max keeps growing across key tiles, so
        // lazily rescaling forwards (flash) move their reference mid-row, not only at the start.
        Case {
            amp: 4.0,
            ..Case::new("large scores d64", 1, (2, 1), (130, 300), 64)
        },
    ];
    if !quick {
        v.extend([
            Case::new("gqa 8:2 causal d128", 2, (8, 2), (257, 257), 128).causal(),
            Case::new("bhsd d256 window (100,0)", 1, (2, 2), (300, 300), 256)
                .bhsd()
                .window(100, 0),
            Case::new("causal sq>sk d64", 1, (4, 4), (300, 150), 64).causal(),
            Case {
                softcap: 30.0,
                amp: 3.0,
                ..Case::new("varlen mqa causal softcap 30 d128", 0, (4, 1), (0, 0), 128)
                    .varlen(&[1, 129, 300, 64], &[300, 129, 1, 64], 0)
                    .causal()
            },
            Case::new("long d64 causal", 1, (2, 2), (1024, 1024), 64).causal(),
            Case::new("long d128 bhsd", 1, (2, 1), (777, 1030), 128).bhsd(),
        ]);
    }
    v
}

// ---- the f64 reference ----

/// [sequence][head][row][dim]
type Nested = Vec<Vec<Vec<Vec<f64>>>>;

/// Logical (row-major) flat data of a q-like tensor → nested per sequence.
fn nest(c: &Case, flat: &[f64], heads: usize, seq: usize, lens: &[usize]) -> Nested {
    let d = c.d;
    let mut start = 0;
    let mut out = Vec::new();
    for (b, &len) in lens.iter().enumerate() {
        let mut hs = Vec::new();
        for h in 0..heads {
            let mut rows = Vec::new();
            for i in 0..len {
                let base = match (&c.varlen, c.layout) {
                    (Some(_), _) => ((start + i) * heads + h) * d,
                    (None, Layout::Bshd) => ((b * seq + i) * heads + h) * d,
                    (None, Layout::Bhsd) => ((b * heads + h) * seq + i) * d,
                };
                rows.push(flat[base..base + d].to_vec());
            }
            hs.push(rows);
        }
        out.push(hs);
        start += len;
    }
    out
}

/// Inverse of `nest`.
fn flatten(c: &Case, n: &Nested, heads: usize, seq: usize, lens: &[usize]) -> Vec<f64> {
    let d = c.d;
    let total: usize = match c.varlen {
        Some(_) => lens.iter().sum::<usize>() * heads * d,
        None => c.batch * seq * heads * d,
    };
    let mut flat = vec![0.0; total];
    let mut start = 0;
    for (b, &len) in lens.iter().enumerate() {
        for h in 0..heads {
            for i in 0..len {
                let base = match (&c.varlen, c.layout) {
                    (Some(_), _) => ((start + i) * heads + h) * d,
                    (None, Layout::Bshd) => ((b * seq + i) * heads + h) * d,
                    (None, Layout::Bhsd) => ((b * heads + h) * seq + i) * d,
                };
                flat[base..base + d].copy_from_slice(&n[b][h][i]);
            }
        }
        start += len;
    }
    flat
}

fn dotf(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

struct Reference {
    o: Nested,
    /// [sequence][head][row]
    lse: Vec<Vec<Vec<f64>>>,
    dq: Nested,
    dk: Nested,
    dv: Nested,
}

/// Forward from q, k, v; backward from dout and `o_used` (the o the variant's backward was
/// given, as D = rowsum(dO ⊙ o) is defined on it).
fn reference(
    c: &Case,
    q: &Nested,
    k: &Nested,
    v: &Nested,
    dout: &Nested,
    o_used: &Nested,
) -> Reference {
    let scale = c
        .scale
        .map(|s| s as f64)
        .unwrap_or(1.0 / (c.d as f64).sqrt());
    let cap = c.softcap as f64;
    let (wl, wr) = (c.window.0, if c.causal { 0 } else { c.window.1 });
    let group = c.hq / c.hkv;
    let zeros = |n: &Nested| -> Nested {
        n.iter()
            .map(|hs| {
                hs.iter()
                    .map(|rs| rs.iter().map(|r| vec![0.0; r.len()]).collect())
                    .collect()
            })
            .collect()
    };
    let mut r = Reference {
        o: zeros(q),
        lse: q
            .iter()
            .map(|hs| hs.iter().map(|rs| vec![0.0; rs.len()]).collect())
            .collect(),
        dq: zeros(q),
        dk: zeros(k),
        dv: zeros(v),
    };
    for b in 0..q.len() {
        let (sq, sk) = (q[b][0].len(), k[b][0].len());
        for h in 0..c.hq {
            let hk = h / group;
            for i in 0..sq {
                let pos = i as i64 + sk as i64 - sq as i64;
                let vis: Vec<usize> = (0..sk)
                    .filter(|&j| {
                        let j = j as i64;
                        (wl < 0 || j >= pos - wl) && (wr < 0 || j <= pos + wr)
                    })
                    .collect();
                if vis.is_empty() {
                    r.lse[b][h][i] = f64::NEG_INFINITY;
                    continue; // o, dq stay 0; nothing flows to dk, dv
                }
                // (score, tanh) per visible key
                let s: Vec<(f64, f64)> = vis
                    .iter()
                    .map(|&j| {
                        let raw = scale * dotf(&q[b][h][i], &k[b][hk][j]);
                        if cap > 0.0 {
                            let t = (raw / cap).tanh();
                            (cap * t, t)
                        } else {
                            (raw, 0.0)
                        }
                    })
                    .collect();
                let m = s.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = s.iter().map(|x| (x.0 - m).exp()).sum();
                r.lse[b][h][i] = m + sum.ln();
                let p: Vec<f64> = s.iter().map(|x| (x.0 - m).exp() / sum).collect();
                for (n, &j) in vis.iter().enumerate() {
                    for e in 0..c.d {
                        r.o[b][h][i][e] += p[n] * v[b][hk][j][e];
                    }
                }
                let dsum = dotf(&dout[b][h][i], &o_used[b][h][i]);
                for (n, &j) in vis.iter().enumerate() {
                    let dp = dotf(&dout[b][h][i], &v[b][hk][j]);
                    let mut ds = p[n] * (dp - dsum);
                    if cap > 0.0 {
                        ds *= 1.0 - s[n].1 * s[n].1;
                    }
                    for e in 0..c.d {
                        r.dq[b][h][i][e] += scale * ds * k[b][hk][j][e];
                        r.dk[b][hk][j][e] += scale * ds * q[b][h][i][e];
                        r.dv[b][hk][j][e] += p[n] * dout[b][h][i][e];
                    }
                }
            }
        }
    }
    r
}

/// Relative error of lse: −inf must match −inf exactly; the finite entries by rel_error.
fn lse_error(out: &[f64], reference: &[f64]) -> f64 {
    let (mut o2, mut r2) = (Vec::new(), Vec::new());
    for (&o, &r) in out.iter().zip(reference) {
        match (o == f64::NEG_INFINITY, r == f64::NEG_INFINITY) {
            (true, true) => {}
            (false, false) => {
                o2.push(o);
                r2.push(r);
            }
            _ => return f64::INFINITY,
        }
    }
    if out.len() != reference.len() {
        return f64::INFINITY;
    }
    rel_error(&o2, &r2)
}

// ---- running a case ----

/// A q/k/v-like tensor: contiguous, or (packed) a view of a [B, S, 3, H, D] buffer at slot `slot`.
/// Returns (view, the buffer to poison).
fn make(
    c: &Case,
    shape: &[usize],
    dtype: DType,
    dev: Device,
    seed: u64,
    slot: usize,
    fill: bool,
) -> Result<(Tensor, Tensor)> {
    let amp = c.amp;
    if !c.packed {
        let t = if fill {
            Tensor::rand(shape, dtype, dev, seed, -amp, amp)?
        } else {
            Tensor::empty(shape, dtype, dev)?
        };
        return Ok((t.clone(), t));
    }
    // Packed: Bshd with Hq = Hkv and Sq = Sk (the case table guarantees it).
    let (b, s, h, d) = (shape[0], shape[1], shape[2], shape[3]);
    let base = if fill {
        Tensor::rand(&[b, s, 3, h, d], dtype, dev, seed, -amp, amp)?
    } else {
        Tensor::empty(&[b, s, 3, h, d], dtype, dev)?
    };
    let view = base.as_strided(
        &[b, s, h, d],
        &[s * 3 * h * d, 3 * h * d, d, 1],
        slot * h * d,
    )?;
    Ok((view, base))
}

fn i32_tensor(v: &[usize], dev: Device) -> Result<Tensor> {
    Tensor::from_vec(
        v.iter().map(|&x| x as i32).collect::<Vec<i32>>(),
        &[v.len()],
    )?
    .to_device(dev)
}

/// Whether `variant` on `dev` has a separate deterministic backward (the others always are).
pub fn has_atomic_backward(dev: Device, variant: &str) -> bool {
    dev.is_cuda() && matches!(variant, "flash" | "hopper")
}

/// Runs one case; returns (worst error, which output). With `deterministic` on a variant that
/// has an atomic backward, the backward runs a second time into fresh poisoned outputs and any
/// bit that differs fails the case.
fn check_one(
    dev: Device,
    dtype: DType,
    variant: &str,
    c: &Case,
    seed: u64,
    deterministic: bool,
) -> Result<(f64, String)> {
    let (lq, lk) = c.lens();
    let qshape = c.shape(c.hq, c.sq, &lq);
    let kshape = c.shape(c.hkv, c.sk, &lk);
    let (q, _) = make(c, &qshape, dtype, dev, seed, 0, true)?;
    let (k, _) = make(c, &kshape, dtype, dev, seed ^ 1, 1, true)?;
    let (v, _) = make(c, &kshape, dtype, dev, seed ^ 2, 2, true)?;
    let o = Tensor::empty(&qshape, dtype, dev)?;
    let dout = Tensor::rand(&qshape, dtype, dev, seed ^ 3, -1.0, 1.0)?;
    let lse_shape = match c.varlen {
        Some(_) => vec![c.hq, lq.iter().sum()],
        None => vec![c.batch, c.hq, c.sq],
    };
    let lse = Tensor::empty(&lse_shape, DType::F32, dev)?;
    let (dq, dq_buf) = make(c, &qshape, dtype, dev, 0, 0, false)?;
    let (dk, dk_buf) = make(c, &kshape, dtype, dev, 0, 1, false)?;
    let (dv, dv_buf) = make(c, &kshape, dtype, dev, 0, 2, false)?;
    for t in [&o, &lse, &dq_buf, &dk_buf, &dv_buf] {
        t.poison(None)?;
    }
    let cum = |l: &[usize]| -> Vec<usize> {
        std::iter::once(0)
            .chain(l.iter().scan(0, |a, &x| {
                *a += x;
                Some(*a)
            }))
            .collect()
    };
    let cu = match &c.varlen {
        Some((a, b, _)) => Some((i32_tensor(&cum(a), dev)?, i32_tensor(&cum(b), dev)?)),
        None => None,
    };
    let vl = cu.as_ref().map(|(cq, ck)| Varlen {
        cu_seqlens_q: cq,
        cu_seqlens_k: ck,
        max_seqlen_q: c.sq,
        max_seqlen_k: c.sk,
    });
    let opts = c.options(variant, deterministic);
    let step = |what: &str| -> Result<()> {
        // Under --trace the host waits for each step (a read of a small output), so a kernel
        // that never finishes is named by the last step printed.
        if check::tracing() {
            lse.to_f64_vec()?;
            check::trace_step(&format!("{variant} {dtype:?} {}: {what} done", c.label()));
        }
        Ok(())
    };
    attention_forward_into(&q, &k, &v, &o, &lse, vl.as_ref(), &opts)?;
    step("forward")?;
    attention_backward_into(
        &dout,
        &q,
        &k,
        &v,
        &o,
        &lse,
        &dq,
        &dk,
        &dv,
        vl.as_ref(),
        &opts,
    )?;
    step("backward")?;

    // The deterministic backward again, into fresh poisoned buffers: the same bits or a failure.
    let mut repeat_note = String::new();
    if deterministic && has_atomic_backward(dev, variant) {
        let (dq2, dq2_buf) = make(c, &qshape, dtype, dev, 0, 0, false)?;
        let (dk2, dk2_buf) = make(c, &kshape, dtype, dev, 0, 1, false)?;
        let (dv2, dv2_buf) = make(c, &kshape, dtype, dev, 0, 2, false)?;
        for t in [&dq2_buf, &dk2_buf, &dv2_buf] {
            t.poison(None)?;
        }
        attention_backward_into(
            &dout,
            &q,
            &k,
            &v,
            &o,
            &lse,
            &dq2,
            &dk2,
            &dv2,
            vl.as_ref(),
            &opts,
        )?;
        let bits = |t: &Tensor| -> Result<Vec<u64>> {
            Ok(t.to_f64_vec()?.into_iter().map(f64::to_bits).collect())
        };
        let differ: Vec<&str> = [("dq", &dq, &dq2), ("dk", &dk, &dk2), ("dv", &dv, &dv2)]
            .into_iter()
            .filter_map(|(n, a, b)| match (bits(a), bits(b)) {
                (Ok(x), Ok(y)) if x == y => None,
                _ => Some(n),
            })
            .collect();
        if !differ.is_empty() {
            return Ok((
                f64::INFINITY,
                format!(
                    "deterministic backward not reproducible: {} differ between two runs",
                    differ.join(", ")
                ),
            ));
        }
        repeat_note = "; repeated: same bits".into();
    }

    let nq = |t: &Tensor| -> Result<Nested> { Ok(nest(c, &t.to_f64_vec()?, c.hq, c.sq, &lq)) };
    let nk = |t: &Tensor| -> Result<Nested> { Ok(nest(c, &t.to_f64_vec()?, c.hkv, c.sk, &lk)) };
    let r = reference(c, &nq(&q)?, &nk(&k)?, &nk(&v)?, &nq(&dout)?, &nq(&o)?);
    // Reference lse in the tensor's order: [B, Hq, Sq] or [Hq, total_q].
    let mut rlse = vec![f64::NAN; lse.numel()];
    let total_q: usize = lq.iter().sum();
    let mut start = 0;
    for (b, &len) in lq.iter().enumerate() {
        for h in 0..c.hq {
            for i in 0..len {
                let at = match c.varlen {
                    Some(_) => h * total_q + start + i,
                    None => (b * c.hq + h) * c.sq + i,
                };
                rlse[at] = r.lse[b][h][i];
            }
        }
        start += len;
    }
    let errs = [
        (
            "o",
            rel_error(&o.to_f64_vec()?, &flatten(c, &r.o, c.hq, c.sq, &lq)),
        ),
        ("lse", lse_error(&lse.to_f64_vec()?, &rlse)),
        (
            "dq",
            rel_error(&dq.to_f64_vec()?, &flatten(c, &r.dq, c.hq, c.sq, &lq)),
        ),
        (
            "dk",
            rel_error(&dk.to_f64_vec()?, &flatten(c, &r.dk, c.hkv, c.sk, &lk)),
        ),
        (
            "dv",
            rel_error(&dv.to_f64_vec()?, &flatten(c, &r.dv, c.hkv, c.sk, &lk)),
        ),
    ];
    let worst = errs.iter().fold(
        ("", 0.0f64),
        |w, &(n, e)| if e > w.1 || e.is_nan() { (n, e) } else { w },
    );
    let all: Vec<String> = errs.iter().map(|(n, e)| format!("{n} {e:.1e}")).collect();
    Ok((
        if worst.1.is_nan() {
            f64::INFINITY
        } else {
            worst.1
        },
        format!("worst: {}; {}{repeat_note}", worst.0, all.join(", ")),
    ))
}

pub fn run(cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
    let mut rng = Rng::new(cfg.seed);
    for &dev in &cfg.devices {
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::of(dev) && cfg.wants_variant(v.name))
        {
            for &dtype in v.dtypes.iter().filter(|d| cfg.wants_dtype(**d)) {
                // Default (atomic) backward first; the deterministic one as its own record.
                let modes: &[bool] = if has_atomic_backward(dev, v.name) {
                    &[false, true]
                } else {
                    &[false]
                };
                for (c, &det) in cases(cfg.quick)
                    .iter()
                    .flat_map(|c| modes.iter().map(move |m| (c, m)))
                {
                    let label = if det {
                        format!("{} · deterministic bwd", c.label())
                    } else {
                        c.label()
                    };
                    let rec = match check_one(dev, dtype, v.name, c, rng.next_u64(), det) {
                        Ok((e, note)) => CheckRecord::compared(
                            OP,
                            v.name,
                            dev,
                            dtype,
                            Precision::of(dtype),
                            label,
                            e,
                            note,
                        ),
                        // A variant that declines the case by its stated constraints (head dim,
                        // workspace size) did not run it: not its case, no record.
                        Err(Error::NoVariant { msg, .. })
                            if msg.contains("cannot run this request") =>
                        {
                            continue;
                        }
                        Err(e) => {
                            CheckRecord::errored(OP, v.name, dev, dtype, label, e.to_string())
                        }
                    };
                    out.push(rec);
                }
            }
        }
    }
    Ok(())
}
