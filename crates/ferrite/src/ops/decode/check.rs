//! `ferrite check decode`: every variant against an f64 reference (gather each sequence's keys
//! through the block table, then plain attention in f64) on shuffled, non-contiguous block tables
//! with unused and out-of-window entries set out of range (a variant reading them fails); lengths
//! 0, 1, block_size ± 1 and long ones; GQA ratios 1/3/4/8, MQA; D 64, 80, 96, 128, 256; softcap,
//! window, explicit scale; outputs poisoned first; split variants with and without partitions.
//! Bad indices must be refused (on the GPU through the device error flag). append_kv is checked
//! bit-exact, untouched slots staying poisoned.

use super::{
    append_kv, decode_into, variants, AppendOptions, DecodeOptions, DecodePlan, PagedKv, PlanShape,
    OP,
};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::check::rel_error;
use crate::core::harness::{CheckConfig, CheckRecord, Precision};
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;

/// One decode problem: heads, head dim, block size, the sequences' lengths and the options.
#[derive(Clone, Debug)]
pub struct Case {
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub block_size: usize,
    pub lens: Vec<i32>,
    pub softcap: f32,
    pub window: i64,
    pub scale: Option<f32>,
}

impl Case {
    pub fn label(&self) -> String {
        let mut s = format!(
            "B{} Hq{} Hkv{} D{} bs{} lens {:?}",
            self.lens.len(),
            self.hq,
            self.hkv,
            self.d,
            self.block_size,
            self.lens
        );
        if self.softcap > 0.0 {
            s += &format!(" softcap {}", self.softcap);
        }
        if self.window >= 0 {
            s += &format!(" window {}", self.window);
        }
        if let Some(sc) = self.scale {
            s += &format!(" scale {sc}");
        }
        s
    }
}

#[allow(clippy::too_many_arguments)]
fn case(
    hq: usize,
    hkv: usize,
    d: usize,
    block_size: usize,
    lens: &[i32],
    softcap: f32,
    window: i64,
    scale: Option<f32>,
) -> Case {
    Case {
        hq,
        hkv,
        d,
        block_size,
        lens: lens.to_vec(),
        softcap,
        window,
        scale,
    }
}

pub fn cases(quick: bool) -> Vec<Case> {
    let mut v = vec![
        // MQA; lengths 0, 1, block_size − 1, block_size + 1.
        case(4, 1, 64, 16, &[0, 1, 15, 17, 40], 0.0, -1, None),
        // GQA 4, soft-capping, D 128.
        case(8, 2, 128, 16, &[33, 16, 7], 2.0, -1, None),
        // GQA 1 (MHA) with a window shorter than the context.
        case(4, 4, 64, 8, &[50, 3, 21], 0.0, 20, None),
        // GQA 8, window + softcap, scale 1 (large logits: the max subtraction matters).
        case(16, 2, 128, 16, &[100, 61], 5.0, 31, Some(1.0)),
        // D 96 (not a power of two: idle lanes in the gqa kernel), GQA 3.
        case(6, 2, 96, 16, &[130, 9], 0.0, -1, None),
        // A ragged batch long enough for the schedule to split its longer sequences into chunks
        // (and leave the short ones, and the empty one, whole).
        case(8, 2, 128, 16, &[1500, 3, 700, 0, 2100, 260], 0.0, -1, None),
    ];
    if !quick {
        v.extend([
            case(32, 8, 128, 16, &[3000, 1234, 0, 4097], 0.0, -1, None),
            case(8, 1, 64, 32, &[515, 0, 1029], 1.0, -1, None),
            case(4, 2, 256, 16, &[77, 300], 0.0, -1, None),
            case(32, 4, 128, 16, &[2049, 2], 0.0, 1000, None),
            case(12, 4, 64, 16, &[1, 16, 17, 255], 0.0, 0, None),
            // D 80: an odd number of 16-dim chunks (pipelined_mma's ldmatrix.x2 tail), GQA 3.
            case(6, 2, 80, 16, &[517, 70], 0.0, 300, None),
            // Page sizes 1 and 128 (a table entry per key; keys of one tile in one page).
            case(8, 2, 128, 1, &[700, 33, 1], 0.0, -1, None),
            case(8, 8, 128, 128, &[1300, 129, 127, 0], 0.0, -1, None),
        ]);
    }
    v
}

/// A case's inputs on a device, and the host copies of the index tensors.
pub struct Inputs {
    pub q: Tensor,
    pub key_cache: Tensor,
    pub value_cache: Tensor,
    pub block_table: Tensor,
    pub seq_lens: Tensor,
    pub table: Vec<i32>,
    pub num_blocks: usize,
    pub max_blocks: usize,
}

impl Inputs {
    pub fn kv(&self) -> PagedKv<'_> {
        PagedKv {
            key_cache: &self.key_cache,
            value_cache: &self.value_cache,
            block_table: &self.block_table,
            seq_lens: &self.seq_lens,
        }
    }
}

/// Entry written where a block-table slot must never be read: out of range.
pub const UNUSED_ENTRY: i32 = -7;

/// Fisher–Yates permutation of 0..n.
pub fn shuffled(n: usize, rng: &mut Rng) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        v.swap(i, rng.below(i as u64 + 1) as usize);
    }
    v
}

/// Random q and caches; each sequence's blocks taken from a shuffled pool (plus `spare` unused
/// blocks); unused and out-of-window block-table entries set to UNUSED_ENTRY.
pub fn make_inputs(c: &Case, dtype: DType, dev: Device, seed: u64, spare: usize) -> Result<Inputs> {
    let mut rng = Rng::new(seed);
    let bs = c.block_size;
    let need: Vec<usize> = c
        .lens
        .iter()
        .map(|&l| (l.max(0) as usize).div_ceil(bs))
        .collect();
    let num_blocks = need.iter().sum::<usize>() + spare;
    let max_blocks = need.iter().copied().max().unwrap_or(0) + 1;
    let pool = shuffled(num_blocks, &mut rng);
    let mut table = vec![UNUSED_ENTRY; c.lens.len() * max_blocks];
    let mut next = 0;
    for (b, (&l, &n)) in c.lens.iter().zip(&need).enumerate() {
        let lo = if c.window >= 0 {
            (l as usize).saturating_sub(1 + c.window as usize)
        } else {
            0
        };
        for i in 0..n {
            // Blocks wholly before the window stay UNUSED_ENTRY (as if freed).
            if (i + 1) * bs > lo {
                table[b * max_blocks + i] = pool[next] as i32;
            }
            next += 1;
        }
    }
    let b = c.lens.len();
    let shape = [num_blocks, bs, c.hkv, c.d];
    Ok(Inputs {
        q: Tensor::rand(&[b, c.hq, c.d], dtype, dev, rng.next_u64(), -2.0, 2.0)?,
        key_cache: Tensor::rand(&shape, dtype, dev, rng.next_u64(), -2.0, 2.0)?,
        value_cache: Tensor::rand(&shape, dtype, dev, rng.next_u64(), -1.0, 1.0)?,
        block_table: Tensor::from_vec(table.clone(), &[b, max_blocks])?.to_device(dev)?,
        seq_lens: Tensor::from_vec(c.lens.clone(), &[b])?.to_device(dev)?,
        table,
        num_blocks,
        max_blocks,
    })
}

/// f64 reference: (o [B, Hq, D], lse [B, Hq]).
pub fn reference(c: &Case, x: &Inputs) -> Result<(Vec<f64>, Vec<f64>)> {
    let (q, k, v) = (
        x.q.to_f64_vec()?,
        x.key_cache.to_f64_vec()?,
        x.value_cache.to_f64_vec()?,
    );
    let (d, hkv, bs) = (c.d, c.hkv, c.block_size);
    let scale = c.scale.map_or(1.0 / (d as f64).sqrt(), |s| s as f64);
    let b_n = c.lens.len();
    let (mut o, mut lse) = (
        vec![0.0; b_n * c.hq * d],
        vec![f64::NEG_INFINITY; b_n * c.hq],
    );
    for (b, &len) in c.lens.iter().enumerate() {
        let len = len as usize;
        let lo = if c.window >= 0 {
            len.saturating_sub(1 + c.window as usize)
        } else {
            0
        };
        // Gather: the slot of each visible key.
        let slots: Vec<usize> = (lo..len)
            .map(|j| x.table[b * x.max_blocks + j / bs] as usize * bs + j % bs)
            .collect();
        for h in 0..c.hq {
            let kvh = h / (c.hq / hkv);
            let qh = &q[(b * c.hq + h) * d..][..d];
            let s: Vec<f64> = slots
                .iter()
                .map(|&sl| {
                    let kr = &k[(sl * hkv + kvh) * d..][..d];
                    let mut s = scale * qh.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>();
                    if c.softcap > 0.0 {
                        let cap = c.softcap as f64;
                        s = cap * (s / cap).tanh();
                    }
                    s
                })
                .collect();
            if s.is_empty() {
                continue;
            }
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (i, &sl) in slots.iter().enumerate() {
                let vr = &v[(sl * hkv + kvh) * d..][..d];
                for (oc, &vv) in o[(b * c.hq + h) * d..][..d].iter_mut().zip(vr) {
                    *oc += e[i] / sum * vv;
                }
            }
            lse[b * c.hq + h] = m + sum.ln();
        }
    }
    Ok((o, lse))
}

/// Relative error of lse: rows the reference marks −inf must be exactly −inf.
fn lse_error(out: &[f64], r: &[f64]) -> f64 {
    let mut fin_o = Vec::new();
    let mut fin_r = Vec::new();
    for (&a, &b) in out.iter().zip(r) {
        if b == f64::NEG_INFINITY {
            if a != f64::NEG_INFINITY {
                return f64::INFINITY;
            }
        } else {
            fin_o.push(a);
            fin_r.push(b);
        }
    }
    rel_error(&fin_o, &fin_r)
}

pub fn options(variant: &str, c: &Case) -> DecodeOptions {
    DecodeOptions {
        variant: Some(variant.into()),
        scale: c.scale,
        softcap: c.softcap,
        window_left: c.window,
        num_splits: (variant == "split_kv").then_some(3),
        ..Default::default()
    }
}

/// How a check case is run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `decode_into` with the variant's own choice (the pipelined ones: scheduled).
    Auto,
    /// `decode_into` with this many uniform partitions.
    Splits(usize),
    /// plan/run: a plan of the case's lengths, then `decode_planned_into`.
    Planned,
    /// A plan made for other lengths (each halved, the order reversed), run on the case's own.
    StalePlan,
}

impl Mode {
    fn suffix(self) -> String {
        match self {
            Mode::Auto => String::new(),
            Mode::Splits(n) => format!(" splits {n}"),
            Mode::Planned => " planned".into(),
            Mode::StalePlan => " stale plan".into(),
        }
    }
}

/// The modes each case runs a variant in: split_kv always 3 partitions; the pipelined ones
/// scheduled (one chunk per sequence for short contexts, many for long ones), a forced 3 uniform
/// partitions (the partial/merge path in every case), plan/run and a stale plan; the others
/// directly and through a plan.
pub fn modes(variant: &str) -> Vec<Mode> {
    match variant {
        "split_kv" => vec![Mode::Splits(3)],
        "pipelined" | "pipelined_mma" => {
            vec![Mode::Auto, Mode::Splits(3), Mode::Planned, Mode::StalePlan]
        }
        _ => vec![Mode::Auto, Mode::Planned],
    }
}

/// The plan shape of a case.
pub fn plan_shape(c: &Case, dtype: DType, dev: Device) -> PlanShape {
    PlanShape {
        batch: c.lens.len(),
        heads_q: c.hq,
        heads_kv: c.hkv,
        head_dim: c.d,
        dtype,
        device: dev,
    }
}

/// Runs a case in `mode` into o and lse.
fn decode_mode(
    x: &Inputs,
    c: &Case,
    dtype: DType,
    dev: Device,
    variant: &str,
    mode: Mode,
    o: &Tensor,
    lse: &Tensor,
) -> Result<()> {
    let opts = DecodeOptions {
        num_splits: match mode {
            Mode::Splits(n) => Some(n),
            _ => None,
        },
        ..options(variant, c)
    };
    let planned_lens = match mode {
        Mode::Auto | Mode::Splits(_) => return decode_into(&x.q, &x.kv(), o, Some(lse), &opts),
        Mode::Planned => x.seq_lens.clone(),
        Mode::StalePlan => {
            let other: Vec<i32> = c.lens.iter().rev().map(|l| l / 2).collect();
            Tensor::from_vec(other, &[c.lens.len()])?.to_device(dev)?
        }
    };
    let plan = DecodePlan::new(&planned_lens, plan_shape(c, dtype, dev), &opts)?;
    plan.run(&x.q, &x.kv(), o, Some(lse), &opts)?;
    plan.errors(&opts)
}

fn check_one(
    dev: Device,
    dtype: DType,
    variant: &str,
    c: &Case,
    mode: Mode,
    seed: u64,
) -> Result<(f64, &'static str)> {
    let x = make_inputs(c, dtype, dev, seed, 3)?;
    let b = c.lens.len();
    let o = Tensor::empty(&[b, c.hq, c.d], dtype, dev)?;
    let lse = Tensor::empty(&[b, c.hq], DType::F32, dev)?;
    o.poison(None)?;
    lse.poison(None)?;
    decode_mode(&x, c, dtype, dev, variant, mode, &o, &lse)?;
    let (ro, rl) = reference(c, &x)?;
    let eo = rel_error(&o.to_f64_vec()?, &ro);
    let el = lse_error(&lse.to_f64_vec()?, &rl);
    Ok(if el > eo || el.is_nan() {
        (el, "lse")
    } else {
        (eo, "o")
    })
}

/// Runs a case whose indices are bad; Ok(note) when it was refused naming `arg`.
fn refused(
    dev: Device,
    dtype: DType,
    variant: &str,
    bad_len: bool,
    planned: bool,
    seed: u64,
) -> Result<String> {
    let c = case(8, 2, 64, 16, &[40, 20], 0.0, -1, None);
    let mut x = make_inputs(&c, dtype, dev, seed, 2)?;
    let arg = if bad_len {
        let lens = vec![40, (x.max_blocks * c.block_size) as i32 + 1];
        x.seq_lens = Tensor::from_vec(lens, &[2])?.to_device(dev)?;
        "seq_lens"
    } else {
        x.table[x.max_blocks + 1] = x.num_blocks as i32;
        x.block_table = Tensor::from_vec(x.table.clone(), &[2, x.max_blocks])?.to_device(dev)?;
        "block_table"
    };
    let (o, lse) = (
        Tensor::empty(&[2, 8, 64], dtype, dev)?,
        Tensor::empty(&[2, 8], DType::F32, dev)?,
    );
    let mode = if planned { Mode::Planned } else { Mode::Auto };
    match decode_mode(&x, &c, dtype, dev, variant, mode, &o, &lse) {
        Err(e) if e.to_string().contains(&format!("`{arg}`")) => Ok(e.to_string()),
        Err(e) => Ok(format!("WRONG ERROR: {e}")),
        Ok(()) => Ok("accepted".into()),
    }
}

/// Runs a batch of 2 on a plan made for a batch of 3; Ok(note) when refused naming `plan`.
fn other_shape_refused(dev: Device, dtype: DType, variant: &str) -> Result<String> {
    let c = case(8, 2, 64, 16, &[40, 20], 0.0, -1, None);
    let x = make_inputs(&c, dtype, dev, 7, 2)?;
    let opts = options(variant, &c);
    let three = Tensor::from_vec(vec![40i32, 20, 5], &[3])?.to_device(dev)?;
    let mut shape = plan_shape(&c, dtype, dev);
    shape.batch = 3;
    let plan = DecodePlan::new(&three, shape, &opts)?;
    let (o, lse) = (
        Tensor::empty(&[2, 8, 64], dtype, dev)?,
        Tensor::empty(&[2, 8], DType::F32, dev)?,
    );
    match plan.run(&x.q, &x.kv(), &o, Some(&lse), &opts) {
        Err(e) if e.to_string().contains("`plan`") => Ok(e.to_string()),
        Err(e) => Ok(format!("WRONG ERROR: {e}")),
        Ok(()) => Ok("accepted".into()),
    }
}

/// append_kv on poisoned caches: written slots bit-equal to k/v, the others still poison.
/// Returns (mismatched elements / cache elements).
fn check_append(
    dev: Device,
    dtype: DType,
    shape: [usize; 4],
    tokens: usize,
    seed: u64,
) -> Result<f64> {
    let mut rng = Rng::new(seed);
    let cap = shape[0] * shape[1];
    let row = shape[2] * shape[3];
    let perm = shuffled(cap, &mut rng);
    let slots: Vec<i32> = (0..tokens)
        .map(|t| {
            if rng.below(4) == 0 {
                -1
            } else {
                perm[t] as i32
            }
        })
        .collect();
    let k = Tensor::rand(
        &[tokens, shape[2], shape[3]],
        dtype,
        dev,
        rng.next_u64(),
        -3.0,
        3.0,
    )?;
    let v = Tensor::rand(
        &[tokens, shape[2], shape[3]],
        dtype,
        dev,
        rng.next_u64(),
        -3.0,
        3.0,
    )?;
    let kc = Tensor::empty(&shape, dtype, dev)?;
    let vc = Tensor::empty(&shape, dtype, dev)?;
    kc.poison(None)?;
    vc.poison(None)?;
    let sm = Tensor::from_vec(slots.clone(), &[tokens])?.to_device(dev)?;
    append_kv(&k, &v, &kc, &vc, &sm, &AppendOptions::default())?;
    let es = dtype.size_in_bytes();
    let rb = row * es;
    let mut bad = 0usize;
    for (src, dst) in [(&k, &kc), (&v, &vc)] {
        let (s, d) = (src.to_bytes()?, dst.to_bytes()?);
        let mut writer = vec![None; cap];
        for (t, &sl) in slots.iter().enumerate() {
            if sl >= 0 {
                writer[sl as usize] = Some(t);
            }
        }
        for (slot, w) in writer.iter().enumerate() {
            let got = &d[slot * rb..][..rb];
            for e in 0..row {
                let ok = match w {
                    Some(t) => got[e * es..][..es] == s[t * rb + e * es..][..es],
                    None => got[e * es..][..es].iter().all(|&x| x == 0xFF),
                };
                bad += usize::from(!ok);
            }
        }
    }
    Ok(bad as f64 / (2 * cap * row) as f64)
}

fn append_refused(dev: Device, dtype: DType) -> Result<String> {
    let kc = Tensor::empty(&[2, 4, 1, 8], dtype, dev)?;
    let vc = Tensor::empty(&[2, 4, 1, 8], dtype, dev)?;
    let k = Tensor::rand(&[2, 1, 8], dtype, dev, 1, -1.0, 1.0)?;
    let sm = Tensor::from_vec(vec![3i32, 8], &[2])?.to_device(dev)?;
    match append_kv(
        &k,
        &k.deep_copy()?,
        &kc,
        &vc,
        &sm,
        &AppendOptions::default(),
    ) {
        Err(e) if e.to_string().contains("`slot_mapping`") => Ok(e.to_string()),
        Err(e) => Ok(format!("WRONG ERROR: {e}")),
        Ok(()) => Ok("accepted".into()),
    }
}

fn refusal_record(
    dev: Device,
    dtype: DType,
    variant: &str,
    label: &str,
    r: Result<String>,
) -> CheckRecord {
    match r {
        Ok(note) => {
            let ok = !(note.starts_with("WRONG ERROR") || note == "accepted");
            CheckRecord::compared(
                OP,
                variant,
                dev,
                dtype,
                Precision::Exact,
                label.into(),
                if ok { 0.0 } else { f64::INFINITY },
                note,
            )
        }
        Err(e) => CheckRecord::errored(OP, variant, dev, dtype, label.into(), e.to_string()),
    }
}

pub fn run(cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
    let mut rng = Rng::new(cfg.seed);
    for &dev in &cfg.devices {
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::of(dev) && cfg.wants_variant(v.name))
        {
            for &dtype in v.dtypes.iter().filter(|d| cfg.wants_dtype(**d)) {
                for (c, mode) in cases(cfg.quick)
                    .into_iter()
                    .flat_map(|c| modes(v.name).into_iter().map(move |m| (c.clone(), m)))
                {
                    let mut label = c.label();
                    if v.name != "split_kv" {
                        label += &mode.suffix();
                    }
                    out.push(
                        match check_one(dev, dtype, v.name, &c, mode, rng.next_u64()) {
                            Ok((e, worst)) => CheckRecord::compared(
                                OP,
                                v.name,
                                dev,
                                dtype,
                                Precision::of(dtype),
                                label,
                                e,
                                format!("worst: {worst}"),
                            ),
                            Err(e) => {
                                CheckRecord::errored(OP, v.name, dev, dtype, label, e.to_string())
                            }
                        },
                    );
                }
            }
            let dtype = if v.dtypes.contains(&DType::BF16) {
                DType::BF16
            } else {
                v.dtypes[0]
            };
            if cfg.wants_dtype(dtype) {
                for (bad_len, planned, label) in [
                    (false, false, "block_table entry ≥ num_blocks is refused"),
                    (true, false, "seq_len > max_blocks·block_size is refused"),
                    (
                        false,
                        true,
                        "planned: block_table entry ≥ num_blocks is refused",
                    ),
                    (
                        true,
                        true,
                        "planned: seq_len > max_blocks·block_size is refused",
                    ),
                ] {
                    let r = refused(dev, dtype, v.name, bad_len, planned, rng.next_u64());
                    out.push(refusal_record(dev, dtype, v.name, label, r));
                }
                let r = other_shape_refused(dev, dtype, v.name);
                out.push(refusal_record(
                    dev,
                    dtype,
                    v.name,
                    "a plan made for another batch is refused",
                    r,
                ));
            }
        }
        if !cfg.wants_variant("append_kv") {
            continue;
        }
        for dtype in [DType::F32, DType::F16, DType::BF16]
            .into_iter()
            .filter(|d| cfg.wants_dtype(*d))
        {
            for (shape, tokens) in [([8, 16, 2, 64], 37), ([5, 4, 3, 5], 9)] {
                let label = format!("append_kv cache {shape:?}, {tokens} tokens, ~¼ skipped (−1)");
                out.push(match check_append(dev, dtype, shape, tokens, rng.next_u64()) {
                    Ok(e) => CheckRecord::compared(
                        OP,
                        "append_kv",
                        dev,
                        dtype,
                        Precision::Exact,
                        label,
                        e,
                        "fraction of cache elements wrong (written ≠ k/v bits, or unwritten ≠ poison)".into(),
                    ),
                    Err(e) => CheckRecord::errored(OP, "append_kv", dev, dtype, label, e.to_string()),
                });
            }
            let r = append_refused(dev, dtype);
            out.push(refusal_record(
                dev,
                dtype,
                "append_kv",
                "slot ≥ num_blocks·block_size is refused",
                r,
            ));
        }
    }
    Ok(())
}
