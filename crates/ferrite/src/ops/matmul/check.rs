//! `ferrite check matmul`: every variant on every device and dtype, against an f64 reference on
//! fresh random inputs (never zeros), outputs poisoned first, odd shapes and every layout.

use super::{matmul_into, variants, MatmulOptions, OP};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::check::rel_error;
use crate::core::harness::{CheckConfig, CheckRecord, Precision};
use crate::core::rng::Rng;
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;
use rayon::prelude::*;

/// One checked problem.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a_trans: bool,
    pub b_trans: bool,
    /// B is 2-D and broadcast over A's batch.
    pub broadcast_b: bool,
    /// Extra elements at the end of each row of the stored operands (ld > cols).
    pub pad: usize,
    /// Elements each stored operand's view starts into its rows (ld grows by as much): an odd
    /// offset puts the base off 16-byte alignment.
    pub offset: usize,
    pub alpha: f32,
    pub beta: f32,
}

impl Case {
    const fn nn(m: usize, n: usize, k: usize) -> Case {
        Case {
            batch: 1,
            m,
            n,
            k,
            a_trans: false,
            b_trans: false,
            broadcast_b: false,
            pad: 0,
            offset: 0,
            alpha: 1.0,
            beta: 0.0,
        }
    }
    pub fn label(&self) -> String {
        let t = |x: bool| if x { 'T' } else { 'N' };
        let mut s = format!(
            "{}×{}×{} {}{}",
            self.m,
            self.n,
            self.k,
            t(self.a_trans),
            t(self.b_trans)
        );
        if self.batch != 1 {
            s = format!("{}×", self.batch) + &s;
        }
        if self.broadcast_b {
            s.push_str(" bcastB");
        }
        if self.pad > 0 {
            s.push_str(&format!(" ld+{}", self.pad));
        }
        if self.offset > 0 {
            s.push_str(&format!(" off+{}", self.offset));
        }
        if self.alpha != 1.0 || self.beta != 0.0 {
            s.push_str(&format!(" α={} β={}", self.alpha, self.beta));
        }
        s
    }
}

/// Shapes for `wgmma`'s tuner configurations beside the quick set: rows 16-byte aligned (TMA),
/// many row and column tiles with edges (18 × 5 tiles of 128 × 256: groups of 4, 8 and 16 end
/// inside the grid, 32 covers it with one partial group; an odd tile count per cluster column),
/// a batched, transposed case with α/β, and a batched one with β = 0 (TMA-stored C).
pub fn config_cases() -> Vec<Case> {
    vec![
        Case {
            b_trans: true,
            ..Case::nn(2304, 1280, 200)
        },
        Case::nn(1032, 1544, 96),
        Case {
            batch: 3,
            a_trans: true,
            alpha: 0.5,
            beta: -1.0,
            ..Case::nn(520, 264, 136)
        },
        // β = 0 with 16-byte C rows: the TMA-store epilogue, batched, with edges in m and n.
        Case {
            batch: 2,
            pad: 8,
            alpha: 0.5,
            ..Case::nn(264, 520, 136)
        },
    ]
}

/// The shape set: 1, 7, 127, 1000, 4097 appear as m, n or k; every layout; batches; α/β; K = 1.
pub fn cases(quick: bool) -> Vec<Case> {
    let mut v = vec![
        Case::nn(1, 1, 1),
        Case::nn(7, 5, 3),
        Case::nn(127, 255, 33),
        Case {
            a_trans: true,
            ..Case::nn(33, 17, 65)
        },
        Case {
            b_trans: true,
            ..Case::nn(33, 17, 65)
        },
        Case {
            a_trans: true,
            b_trans: true,
            pad: 3,
            ..Case::nn(31, 9, 127)
        },
        Case {
            batch: 3,
            broadcast_b: true,
            alpha: 0.5,
            beta: -1.5,
            ..Case::nn(31, 47, 65)
        },
        Case {
            batch: 2,
            b_trans: true,
            pad: 5,
            ..Case::nn(17, 64, 40)
        },
        Case::nn(300, 200, 1),
        Case {
            beta: 2.0,
            ..Case::nn(9, 11, 0)
        },
        Case {
            alpha: -2.0,
            beta: 0.25,
            ..Case::nn(64, 96, 128)
        },
        // Rows 16-byte aligned in every dtype (the 128-bit / cp.async fast paths) with edge
        // tiles in m, n and k, including a k edge inside a 16-byte chunk (k = 196), per layout.
        Case {
            a_trans: true,
            pad: 8,
            ..Case::nn(136, 72, 196)
        },
        Case {
            b_trans: true,
            pad: 4,
            ..Case::nn(72, 136, 196)
        },
        Case {
            batch: 2,
            pad: 4,
            alpha: 0.5,
            beta: -1.0,
            ..Case::nn(72, 140, 196)
        },
        Case {
            a_trans: true,
            b_trans: true,
            pad: 4,
            ..Case::nn(132, 60, 196)
        },
        // Aligned rows, batched with B broadcast (wgmma: batch extent 1 in B's tensor map).
        Case {
            batch: 3,
            broadcast_b: true,
            pad: 8,
            alpha: 0.5,
            beta: -1.5,
            ..Case::nn(100, 136, 72)
        },
        // `skinny` (m ≤ 64, NT): one row with a k tail inside a 32-k chunk; unaligned rows
        // (element-wise loads) with B broadcast over a batch and α/β; aligned rows with 8 tiles
        // of A's rows, edges in m and n.
        Case {
            b_trans: true,
            ..Case::nn(1, 4097, 200)
        },
        Case {
            batch: 3,
            broadcast_b: true,
            b_trans: true,
            pad: 3,
            alpha: 0.5,
            beta: -1.0,
            ..Case::nn(9, 100, 77)
        },
        Case {
            b_trans: true,
            pad: 8,
            ..Case::nn(61, 264, 1000)
        },
        // Rows 16-byte apart but bases one element off (a view at an odd offset): `wgmma`
        // re-pitches (16-bit) or packs (tf32) both operands; and rows one element off 16 bytes
        // with many tiles (the re-pitched copy walked by the persistent grid), B transposed.
        Case {
            pad: 7,
            offset: 1,
            ..Case::nn(136, 200, 72)
        },
        Case {
            b_trans: true,
            offset: 1,
            ..Case::nn(300, 520, 263)
        },
        // Split-K `wgmma` (few tiles, long k): 5 splits of 5, 5, 5, 5 and 2 k tiles with α/β and
        // B re-pitched (ld 300); 14 splits of a 68-tile k (NT, a decode-like linear layer).
        Case {
            alpha: 0.5,
            beta: -1.0,
            ..Case::nn(77, 300, 1400)
        },
        Case {
            b_trans: true,
            alpha: 0.5,
            beta: -1.0,
            ..Case::nn(64, 256, 4296)
        },
        // The same with B transposed: tf32 wgmma reads both operands in place (NT, 16-byte rows),
        // B through a broadcast tensor map; in NN above it packs B once for all batches.
        Case {
            batch: 3,
            broadcast_b: true,
            b_trans: true,
            pad: 4,
            alpha: 0.5,
            beta: -1.5,
            ..Case::nn(100, 136, 72)
        },
    ];
    if !quick {
        v.extend([
            Case::nn(1000, 7, 129),
            Case {
                a_trans: true,
                ..Case::nn(257, 1000, 300)
            },
            Case::nn(4097, 4095, 129),
            // Aligned rows with many tiles and k-slices: the wgmma ring wraps, persistent blocks
            // take several tiles (more tiles than SMs), edges in m, n and k.
            Case {
                pad: 8,
                ..Case::nn(1000, 1000, 1000)
            },
            Case {
                b_trans: true,
                ..Case::nn(4096, 2304, 192)
            },
            Case {
                a_trans: true,
                batch: 3,
                pad: 8,
                alpha: 0.5,
                beta: 0.5,
                ..Case::nn(520, 600, 264)
            },
        ]);
    }
    v
}

/// A tensor of logical shape [batch?, rows, cols] stored transposed and/or with padded rows.
fn operand(
    dev: Device,
    dtype: DType,
    batch: Option<usize>,
    rows: usize,
    cols: usize,
    trans: bool,
    (pad, offset): (usize, usize),
    seed: u64,
) -> Result<Tensor> {
    let (sr, sc) = if trans { (cols, rows) } else { (rows, cols) };
    let mut shape = vec![sr, sc + pad + offset];
    if let Some(b) = batch {
        shape.insert(0, b);
    }
    let r = shape.len();
    let base = Tensor::rand(&shape, dtype, dev, seed, -1.0, 1.0)?;
    let v = base.narrow(r - 1, offset, sc)?;
    if trans {
        v.transpose(r - 2, r - 1)
    } else {
        Ok(v)
    }
}

/// Inputs of one case: (a, b, c0 or None when β = 0).
pub fn inputs(
    c: &Case,
    dev: Device,
    dtype: DType,
    seed: u64,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let batched = c.batch != 1 || c.broadcast_b;
    let a = operand(
        dev,
        dtype,
        batched.then_some(c.batch),
        c.m,
        c.k,
        c.a_trans,
        (c.pad, c.offset),
        seed,
    )?;
    let b_batch = (batched && !c.broadcast_b).then_some(c.batch);
    let b = operand(
        dev,
        dtype,
        b_batch,
        c.k,
        c.n,
        c.b_trans,
        (c.pad, c.offset),
        seed ^ 0x5555,
    )?;
    let c0 = if c.beta != 0.0 {
        let shape: Vec<usize> = if batched {
            vec![c.batch, c.m, c.n]
        } else {
            vec![c.m, c.n]
        };
        Some(Tensor::rand(&shape, dtype, dev, seed ^ 0xAAAA, -1.0, 1.0)?)
    } else {
        None
    };
    Ok((a, b, c0))
}

/// α·op(A)·op(B) + β·C0 in f64 from the (already dtype-rounded) inputs.
pub fn reference(c: &Case, a: &Tensor, b: &Tensor, c0: Option<&Tensor>) -> Result<Vec<f64>> {
    let (av, bv) = (a.to_f64_vec()?, b.to_f64_vec()?);
    let cv = c0.map(|t| t.to_f64_vec()).transpose()?;
    let (m, n, k) = (c.m, c.n, c.k);
    let b_batch_stride = if c.broadcast_b { 0 } else { k * n };
    let mut out = vec![0f64; c.batch * m * n];
    out.par_chunks_mut(n.max(1))
        .enumerate()
        .for_each(|(row, o)| {
            let (z, i) = (row / m.max(1), row % m.max(1));
            let arow = &av[z * m * k + i * k..][..k];
            let bz = &bv[z * b_batch_stride..];
            for (j, oj) in o.iter_mut().enumerate() {
                let mut acc = 0f64;
                for p in 0..k {
                    acc += arow[p] * bz[p * n + j];
                }
                *oj = c.alpha as f64 * acc
                    + cv.as_ref()
                        .map_or(0.0, |cv| c.beta as f64 * cv[row * n + j]);
            }
        });
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn check_one(
    c: &Case,
    dev: Device,
    dtype: DType,
    variant: &str,
    config: Option<&str>,
    precision: Precision,
    seed: u64,
) -> Result<f64> {
    let (a, b, c0) = inputs(c, dev, dtype, seed)?;
    let shape: Vec<usize> = if c.batch != 1 || c.broadcast_b {
        vec![c.batch, c.m, c.n]
    } else {
        vec![c.m, c.n]
    };
    let out = match &c0 {
        Some(c0) => c0.deep_copy()?,
        None => {
            let o = Tensor::empty(&shape, dtype, dev)?;
            o.poison(None)?;
            o
        }
    };
    let opts = MatmulOptions {
        variant: (variant != DEFAULT_PATH).then(|| variant.into()),
        alpha: c.alpha,
        beta: c.beta,
        precision,
        config: config.map(str::to_string),
        ..Default::default()
    };
    match variant {
        PEER_CUBLAS | PEER_CUBLASLT => run_peer(variant, &a, &b, &out, c, precision)?,
        _ => matmul_into(&a, &b, &out, &opts)?,
    }
    if let Device::Cuda(i) = dev {
        let d = crate::core::cuda::device(i)?;
        d.synchronize(d.stream(), &format!("matmul/{variant}"))?;
    }
    let r = reference(c, &a, &b, c0.as_ref())?;
    Ok(rel_error(&out.to_f64_vec()?, &r))
}

/// The row of the default path (`matmul_into` with no variant named) in the records.
pub const DEFAULT_PATH: &str = "default";

/// The vendor peers, checked like the variants so a wrong layout or transpose in the bench's
/// peer calls (which would time a different problem) shows up as an error here.
const PEER_CUBLAS: &str = "cublas";
const PEER_CUBLASLT: &str = "cublaslt";

fn run_peer(
    peer: &str,
    a: &Tensor,
    b: &Tensor,
    out: &Tensor,
    c: &Case,
    precision: Precision,
) -> Result<()> {
    let g = super::validate(a, b, out)?;
    let Device::Cuda(i) = g.device else {
        return Ok(());
    };
    let dev = crate::core::cuda::device(i)?;
    let p = super::cuda::Ptrs {
        a: a.device_ptr()?,
        b: b.device_ptr()?,
        c: out.device_ptr()?,
    };
    let stream = dev.stream().clone();
    if peer == PEER_CUBLAS {
        super::cuda::cublas(&dev, &g, p, c.alpha, c.beta, precision, &stream)
    } else {
        // cuBLASLt refuses some layouts at run time (leading dimensions and offsets that are not
        // multiples of its alignment): the peer declines such a case, as a variant would.
        let declined = |e: crate::core::error::Error| match e.to_string() {
            m if m.contains("NOT_SUPPORTED") => crate::core::error::Error::NoVariant {
                op: OP.into(),
                msg: format!("`{PEER_CUBLASLT}` cannot run this request: {m}"),
            },
            _ => e,
        };
        let plan = super::cuda::LtPlan::new(&dev, &g, precision, &stream).map_err(declined)?;
        plan.run(p, c.alpha, c.beta).map_err(declined)?;
        // The plan (and its workspace) is freed when this returns: finish its work first.
        dev.synchronize(&stream, "cublaslt check")
    }
}

/// The record of one checked case; None when the variant declined it by its stated constraints
/// (wgmma: unaligned rows for TMA): it did not run it, so it is not its case.
fn record(
    name: &str,
    c: &Case,
    dev: Device,
    dtype: DType,
    precision: Precision,
    r: Result<f64>,
) -> Option<CheckRecord> {
    match r {
        Ok(err) => Some(CheckRecord::compared(
            OP,
            name,
            dev,
            dtype,
            precision,
            c.label(),
            err,
            String::new(),
        )),
        Err(crate::core::error::Error::NoVariant { msg, .. })
            if msg.contains("cannot run this request") =>
        {
            None
        }
        Err(e) => Some(CheckRecord::errored(
            OP,
            name,
            dev,
            dtype,
            c.label(),
            e.to_string(),
        )),
    }
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
                for c in cases(cfg.quick) {
                    // Tensor-core variants take f32 inputs only as tf32: check them at its tolerance.
                    let precision = if dtype == DType::F32
                        && backend == Backend::Cuda
                        && super::cuda::tensor_core(v.name)
                    {
                        Precision::Tf32
                    } else {
                        Precision::of(dtype)
                    };
                    let seed = rng.next_u64();
                    let r = check_one(&c, dev, dtype, v.name, None, precision, seed);
                    out.extend(record(v.name, &c, dev, dtype, precision, r));
                }
                // Every configuration the tuner may pick, on the quick cases (the full set above
                // ran whichever the tuner chose per shape), and the default with C stored from
                // registers (what `--config c2g8d` times).
                if v.name == "wgmma" && backend == Backend::Cuda {
                    let direct = super::cuda::WgConfig {
                        tma_store: false,
                        ..super::cuda::WG_DEFAULT
                    };
                    for wc in super::cuda::WG_CONFIGS.into_iter().chain([direct]) {
                        let name = format!("wgmma[{wc}]");
                        let cfg_name = wc.to_string();
                        let precision = if dtype == DType::F32 {
                            Precision::Tf32
                        } else {
                            Precision::of(dtype)
                        };
                        for c in cases(true).into_iter().chain(config_cases()) {
                            let seed = rng.next_u64();
                            let r =
                                check_one(&c, dev, dtype, v.name, Some(&cfg_name), precision, seed);
                            out.extend(record(&name, &c, dev, dtype, precision, r));
                        }
                    }
                }
            }
        }
        // The default path (no variant named): the selection as users get it — on the GPU with
        // the short-A race between `skinny` and `wgmma`, split-K and the re-pitch pre-pass.
        if cfg.wants_variant(DEFAULT_PATH) {
            let dtypes: &[DType] = match backend {
                Backend::Cuda => &[DType::BF16, DType::F16, DType::F32],
                Backend::Cpu => &[DType::F32],
            };
            for &dtype in dtypes {
                if !cfg.wants_dtype(dtype) {
                    continue;
                }
                let precision = Precision::of(dtype);
                for c in cases(cfg.quick) {
                    let seed = rng.next_u64();
                    let r = check_one(&c, dev, dtype, DEFAULT_PATH, None, precision, seed);
                    out.extend(record(DEFAULT_PATH, &c, dev, dtype, precision, r));
                }
            }
        }
        if backend == Backend::Cuda && crate::core::cuda::blas::available().is_ok() {
            for peer in [PEER_CUBLAS, PEER_CUBLASLT]
                .into_iter()
                .filter(|p| cfg.wants_variant(p))
            {
                for (dtype, precision) in [
                    (DType::F32, Precision::F32),
                    (DType::F32, Precision::Tf32),
                    (DType::F16, Precision::F16),
                    (DType::BF16, Precision::Bf16),
                ] {
                    if !cfg.wants_dtype(dtype) {
                        continue;
                    }
                    for c in cases(true) {
                        let seed = rng.next_u64();
                        let r = check_one(&c, dev, dtype, peer, None, precision, seed);
                        out.extend(record(peer, &c, dev, dtype, precision, r));
                    }
                }
            }
        }
    }
    Ok(())
}
