//! `ferrite bench linear`: per shape (tokens × out ← in), the bare GEMM (ferrite's best and
//! cuBLAS), the unfused `naive` and every fused variant with bias + GELU, each as a ratio of the
//! bare GEMM's speed (target ≥ 0.95), with the bare GEMM's time and the row's own kernel config
//! beside it; the backward dX + dW + db against the two cuBLAS GEMMs alone (target ≥ 0.9); and
//! the CPU against the GPU on a ~1M-parameter layer.

use super::{
    backward_into, forward_into, variants, Activation, Bwd, BwdOut, Fwd, FwdOut, LinearOptions, OP,
};
use crate::core::cuda::{device, CudaDevice, Stream};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::bench::{
    relate, time_cpu_op, time_gpu, time_gpu_interleaved, time_gpu_sustained, BenchRecord, Budget,
    Stats,
};
use crate::core::harness::{BenchConfig, Ceilings, Precision, Timing};
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;
use crate::ops::matmul::{self, cuda as mmc};
use std::sync::Arc;
use std::time::Duration;

/// The epilogue the forward rows are timed with.
const ACT: Activation = Activation::GeluTanh;

pub fn run(
    cfg: &BenchConfig,
    ceilings: &Ceilings,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    for &dev in &cfg.devices {
        if let Device::Cuda(i) = dev {
            bench_gpu(cfg, &device(i)?, ceilings, progress, out)?;
        }
    }
    bench_cpu_vs_gpu(cfg, progress, out)
}

/// A layer's tensors: x [m, k], w [n, k], b [n], y and z [m, n], dy [m, n], dx, dw, db.
struct Layer {
    x: Tensor,
    w: Tensor,
    b: Tensor,
    y: Tensor,
    z: Tensor,
    dy: Tensor,
    dx: Tensor,
    dw: Tensor,
    db: Tensor,
    /// The pre-activation of a layer below (X = act(Z_in)): the chain form of the backward.
    z_in: Tensor,
    /// The layer below's bias gradient [k] (the chain form's `db_pre`).
    db_pre: Tensor,
}

impl Layer {
    /// The forward's bare GEMM, X · Wᵀ into Y (what `select` and the plain-GEMM rows plan).
    fn gemm(&self) -> Result<crate::ops::matmul::Gemm> {
        super::gemm_of(
            &Fwd {
                x: &self.x,
                w: &self.w,
                bias: None,
                residual: None,
            },
            &self.y,
        )
    }
}

impl Layer {
    fn new(d: Device, dtype: DType, [m, n, k]: [usize; 3]) -> Result<Layer> {
        let r = |s: &[usize], seed| Tensor::rand(s, dtype, d, seed, -1.0, 1.0);
        Ok(Layer {
            x: r(&[m, k], 1)?,
            w: r(&[n, k], 2)?,
            b: r(&[n], 3)?,
            y: Tensor::empty(&[m, n], dtype, d)?,
            z: r(&[m, n], 4)?,
            dy: r(&[m, n], 5)?,
            dx: Tensor::empty(&[m, k], dtype, d)?,
            dw: Tensor::empty(&[n, k], dtype, d)?,
            db: Tensor::empty(&[n], dtype, d)?,
            z_in: r(&[m, k], 6)?,
            db_pre: Tensor::empty(&[k], dtype, d)?,
        })
    }
    fn forward(&self, opts: &LinearOptions) -> Result<()> {
        forward_into(
            &Fwd {
                x: &self.x,
                w: &self.w,
                bias: Some(&self.b),
                residual: None,
            },
            &FwdOut {
                y: &self.y,
                z: None,
            },
            opts,
        )
    }
    fn backward(&self, opts: &LinearOptions) -> Result<()> {
        backward_into(
            &Bwd {
                dy: &self.dy,
                x: &self.x,
                w: &self.w,
                z: Some(&self.z),
                x_pre: None,
            },
            &BwdOut {
                dx: Some(&self.dx),
                dw: Some(&self.dw),
                db: Some(&self.db),
                db_pre: None,
            },
            opts,
        )
    }
    /// One layer's share of a chain of `ACT` layers: dY is already this layer's dZ (the layer
    /// above formed it in its dX GEMM), and this layer's dX GEMM forms the dZ of the layer below
    /// (dX ⊙ act'(Z_in)) in its epilogue. dX + dW + db with every activation backward inside a
    /// GEMM; `opts.activation` must be none.
    /// With `fused_db`, this layer's db is not computed here — the layer above's epilogue
    /// produced it with that dZ (`db_pre`) — and this layer's dX epilogue produces the layer
    /// below's (`db_pre`): no pass over any dZ is left, only the 16-row partials' reduction.
    fn backward_chain(&self, opts: &LinearOptions, fused_db: bool) -> Result<()> {
        self.chain(opts, true, !fused_db, fused_db)
    }
    /// The chain form's dX GEMM alone (its activation-backward epilogue, with the column sums and
    /// their reduction when `colsum`): what the epilogue costs beside the plain dX GEMM.
    fn dx_chain(&self, opts: &LinearOptions, colsum: bool) -> Result<()> {
        self.chain(opts, false, false, colsum)
    }
    /// The chain form's backward with the outputs asked for: dX always (⊙ act'(Z_in)), dW, this
    /// layer's db (a pass over dY), the layer below's db from the dX epilogue.
    fn chain(&self, opts: &LinearOptions, dw: bool, db: bool, db_pre: bool) -> Result<()> {
        backward_into(
            &Bwd {
                dy: &self.dy,
                x: &self.x,
                w: &self.w,
                z: None,
                x_pre: Some((&self.z_in, ACT)),
            },
            &BwdOut {
                dx: Some(&self.dx),
                dw: dw.then_some(&self.dw),
                db: db.then_some(&self.db),
                db_pre: db_pre.then_some(&self.db_pre),
            },
            opts,
        )
    }
}

/// Bytes a forward with bias moves at the least: X, W, b read, Y written.
fn fwd_bytes([m, n, k]: [usize; 3], es: usize) -> f64 {
    (es * (m * k + n * k + n + m * n)) as f64
}
/// Backward: dY and Z read, dX, dW, db written, X and W read (dZ kept on chip in the ideal).
fn bwd_bytes([m, n, k]: [usize; 3], es: usize) -> f64 {
    (es * (2 * m * n + 2 * m * k + 2 * n * k + n)) as f64
}

fn record(
    d: Device,
    name: &str,
    variant: &str,
    dtype: DType,
    shape: String,
    stats: Stats,
    flops: f64,
    bytes: f64,
) -> BenchRecord {
    BenchRecord::new(d, name, OP, variant, dtype, shape, stats, flops, bytes)
}

/// Times a group of launches that a bench compares, as `timing` asks.
fn time_group(
    dev: &Arc<CudaDevice>,
    stream: &Stream,
    timing: Timing,
    fs: &mut [&mut dyn FnMut(usize) -> Result<()>],
) -> Result<Vec<Stats>> {
    match timing {
        Timing::Interleaved => time_gpu_interleaved(dev, stream, Budget::gpu(), fs),
        Timing::Sustained => time_gpu_sustained(
            dev,
            stream,
            SUSTAINED_SETTLE,
            SUSTAINED_MEASURE,
            SUSTAINED_ROUNDS,
            fs,
        ),
    }
}

/// `--timing sustained`: per round and launch, 1 s back to back untimed, then 1 s timed; 2 rounds.
const SUSTAINED_SETTLE: Duration = Duration::from_secs(1);
const SUSTAINED_MEASURE: Duration = Duration::from_secs(1);
const SUSTAINED_ROUNDS: usize = 2;

/// Writes how a group's GPU rows were timed into their notes (the JSON keeps it).
fn note_timing(group: &mut [BenchRecord], timing: Timing) {
    let how = match timing {
        Timing::Interleaved => "timing: interleaved repeats (shuffled order per cycle)".to_string(),
        Timing::Sustained => format!(
            "timing: sustained ({} s settle + {} s timed per launch, {SUSTAINED_ROUNDS} rounds)",
            SUSTAINED_SETTLE.as_secs(),
            SUSTAINED_MEASURE.as_secs()
        ),
    };
    for r in group.iter_mut().filter(|r| r.note.is_empty()) {
        r.note = how.clone();
    }
}

fn bench_gpu(
    cfg: &BenchConfig,
    dev: &Arc<CudaDevice>,
    ceilings: &Ceilings,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    let d = Device::Cuda(dev.ordinal());
    let name = dev.props().name.clone();
    let stream = dev.stream().clone();
    let defaults: &[[usize; 3]] = if cfg.quick {
        &[[4096, 4096, 4096]]
    } else {
        &[[8192, 4096, 4096], [8192, 14336, 4096], [8192, 4096, 14336]]
    };
    let dtypes: Vec<DType> = if cfg.dtypes.is_empty() {
        vec![DType::BF16]
    } else {
        cfg.dtypes.clone()
    };
    for dtype in dtypes {
        let (prec, label) = match dtype {
            DType::F32 => (Precision::Tf32, "tf32"),
            DType::F16 => (Precision::F16, "f16"),
            _ => (Precision::Bf16, "bf16"),
        };
        // Representative: the forward ladder at 8192×4096←4096 (bias + GELU) against the bare
        // GEMM and cuBLAS, the docs' headline; no backward group, no further shapes.
        for shape in cfg.shapes_3d(cfg.scope(defaults)) {
            let [m, n, k] = shape;
            let l = Layer::new(d, dtype, shape)?;
            let flops = 2.0 * (m * n * k) as f64;
            let es = dtype.size_in_bytes();
            let shape_s = format!("{m}×{n}←{k} bias+{ACT}");
            let mut group = Vec::new();
            // The bare GEMMs: ferrite's default pick, and cuBLAS.
            let g = l.gemm()?;
            let ptrs = mmc::Ptrs {
                a: l.x.device_ptr()?,
                b: l.w.device_ptr()?,
                c: l.y.device_ptr()?,
            };
            let mm_opts = matmul::MatmulOptions {
                precision: prec,
                ..Default::default()
            };
            let gemm_variant = matmul::select(&g, &mm_opts)?.name;
            progress(&format!(
                "linear {d} gemm ({gemm_variant}) {label} {shape_s}"
            ));
            let gl = mmc::plan(gemm_variant, &g, dev)?;
            // The variants this layer runs (a first call also plans, tunes and compiles them).
            let all = variants();
            let mut runs = Vec::new();
            for v in all.iter().filter(|v| {
                v.backend == Backend::Cuda && v.dtypes.contains(&dtype) && cfg.wants_variant(v.name)
            }) {
                let opts = LinearOptions {
                    variant: Some(v.name.into()),
                    activation: ACT,
                    precision: prec,
                    ..Default::default()
                };
                progress(&format!("linear {d} {} {label} {shape_s}", v.name));
                match l.forward(&opts) {
                    Ok(()) => runs.push((v, opts)),
                    Err(crate::core::error::Error::NoVariant { .. }) => continue,
                    Err(e) => return Err(e),
                }
            }
            // The bare GEMM, cuBLAS's, and every variant interleaved repeat by repeat, under one
            // clock history (timed one after the other, the first of a pair gained up to ~10 % on
            // the H100; docs/matmul.md).
            progress(&format!(
                "linear {d} timing {label} {shape_s} (interleaved repeats)"
            ));
            let (g_, gl_, stream_, l_) = (&g, &gl, &stream, &l);
            let mut fs: Vec<Box<dyn FnMut(usize) -> Result<()> + '_>> = vec![
                Box::new(move |_: usize| mmc::launch(gl_, g_, ptrs, 1.0, 0.0, stream_)),
                Box::new(move |_: usize| mmc::cublas(dev, g_, ptrs, 1.0, 0.0, prec, stream_)),
            ];
            for (_, opts) in &runs {
                fs.push(Box::new(move |_: usize| l_.forward(opts)));
            }
            let mut refs: Vec<&mut dyn FnMut(usize) -> Result<()>> =
                fs.iter_mut().map(|f| f.as_mut() as _).collect();
            let mut stats = time_group(dev, &stream, cfg.timing, &mut refs)?.into_iter();
            drop(refs);
            drop(fs);
            let mut r = record(
                d,
                &name,
                "gemm",
                dtype,
                shape_s.clone(),
                stats.next().expect("one Stats per closure"),
                flops,
                fwd_bytes(shape, es) - (es * n) as f64,
            );
            r.dtype = label.into();
            r.config = format!("bare GEMM, matmul `{gemm_variant}` ({})", gl.config);
            let gemm_ms = r.median_ms;
            group.push(r);
            let mut r = record(
                d,
                &name,
                "cublas",
                dtype,
                shape_s.clone(),
                stats.next().expect("one Stats per closure"),
                flops,
                fwd_bytes(shape, es) - (es * n) as f64,
            );
            r.dtype = label.into();
            r.is_peer = true;
            r.config = "bare GEMM, cublasGemmStridedBatchedEx".into();
            group.push(r);
            for (v, _) in &runs {
                let mut r = record(
                    d,
                    &name,
                    v.name,
                    dtype,
                    shape_s.clone(),
                    stats.next().expect("one Stats per closure"),
                    flops,
                    fwd_bytes(shape, es),
                );
                r.dtype = label.into();
                // The bare GEMM beside each fused row: its time, and this row's kernel config, so
                // a gap between them is visible as a config or an epilogue difference.
                r.note = format!(
                    "{:.3}× the bare GEMM's speed (bare `{gemm_variant}` {gemm_ms:.4} ms)",
                    gemm_ms / r.median_ms
                );
                let kernel = match v.name {
                    "naive" => Ok(format!(
                        "GEMM `{gemm_variant}` ({}) + 3 element-wise kernels",
                        gl.config
                    )),
                    name => super::cuda::plan_fused(name, &g, dev, ACT).map(|l| l.config),
                };
                r.config = format!(
                    "{}; {}",
                    v.summary.split(':').next().unwrap_or(""),
                    kernel.unwrap_or_else(|e| format!("(plan: {e})"))
                );
                group.push(r);
            }
            relate(
                &mut group,
                "naive",
                ceilings.gpu_gemm(label).map(|c| ("cuBLAS 4096³", c, true)),
            );
            note_timing(&mut group, cfg.timing);
            out.extend(group);
            // Representative scope stops at the forward ladder: the backward is a section of
            // its own (its rows are not the ladder's variants).
            if cfg.representative {
                continue;
            }

            // Backward: dZ + db kernel and two GEMMs vs the two cuBLAS GEMMs alone.
            let shape_b = format!("{m}×{n}←{k} backward {ACT}");
            let mut group = Vec::new();
            let opts = LinearOptions {
                activation: ACT,
                precision: prec,
                ..Default::default()
            };
            let gx = matmul::validate(&l.dy, &l.w, &l.dx)?;
            let gw = matmul::validate(&l.dy.t()?, &l.x, &l.dw)?;
            let px = mmc::Ptrs {
                a: l.dy.device_ptr()?,
                b: l.w.device_ptr()?,
                c: l.dx.device_ptr()?,
            };
            let pw = mmc::Ptrs {
                a: l.dy.device_ptr()?,
                b: l.x.device_ptr()?,
                c: l.dw.device_ptr()?,
            };
            // Ours and the two cuBLAS GEMMs interleaved repeat by repeat: neither runs under a
            // clock history the other did not share (timed one after the other, the first of a
            // pair gained up to ~10 % on the H100; docs/matmul.md).
            progress(&format!(
                "linear {d} backward and cublas dX+dW {label} {shape_b}"
            ));
            let mut ours = |_: usize| l.backward(&opts);
            let mut peer = |_: usize| {
                mmc::cublas(dev, &gx, px, 1.0, 0.0, prec, &stream)?;
                mmc::cublas(dev, &gw, pw, 1.0, 0.0, prec, &stream)
            };
            // The backward's own two GEMMs alone (matmul's default pick, as the backward runs
            // them): what is left of the backward's time beside them is the dZ + db pass.
            let mm_opts = matmul::MatmulOptions {
                precision: prec,
                ..Default::default()
            };
            let mut our_dx = |_: usize| mmc::gemm_ptrs(&gx, px, &mm_opts);
            let mut our_dw = |_: usize| mmc::gemm_ptrs(&gw, pw, &mm_opts);
            let chain_opts = LinearOptions {
                activation: Activation::None,
                precision: prec,
                ..Default::default()
            };
            let mut chain = |_: usize| l.backward_chain(&chain_opts, false);
            let mut chain_db = |_: usize| l.backward_chain(&chain_opts, true);
            let mut dx_dact = |_: usize| l.dx_chain(&chain_opts, false);
            let mut dx_dact_cs = |_: usize| l.dx_chain(&chain_opts, true);
            let mut stats = time_group(
                dev,
                &stream,
                cfg.timing,
                &mut [
                    &mut ours,
                    &mut peer,
                    &mut our_dx,
                    &mut our_dw,
                    &mut chain,
                    &mut chain_db,
                    &mut dx_dact,
                    &mut dx_dact_cs,
                ],
            )?
            .into_iter();
            // A row of this shape's backward group, with its flops and bytes: the whole backward's
            // (bwd_row) or one GEMM's (gemm_row).
            let row = |variant: &str, s, config: String, fl: f64, bytes: f64| {
                let mut r = record(d, &name, variant, dtype, shape_b.clone(), s, fl, bytes);
                r.dtype = label.into();
                r.config = config;
                r
            };
            let bwd_row = |variant: &str, s, config: String| {
                row(variant, s, config, 2.0 * flops, bwd_bytes(shape, es))
            };
            let gemm_row = |what: &str, s, config: String| {
                row(
                    what,
                    s,
                    config,
                    flops,
                    fwd_bytes(shape, es) - (es * n) as f64,
                )
            };
            let mut next = || stats.next().expect("one Stats per closure");
            group.push(bwd_row(
                "backward",
                next(),
                "dZ+db kernel (fixed-order chunks), dX and dW through matmul's default pick".into(),
            ));
            let mut r = bwd_row(
                "cublas dX+dW",
                next(),
                "two cublasGemmStridedBatchedEx (no activation backward, no db)".into(),
            );
            r.is_peer = true;
            group.push(r);
            for (what, g_) in [("dX GEMM", &gx), ("dW GEMM", &gw)] {
                let config = format!(
                    "the backward's {what} alone, matmul's default pick ({})",
                    g_.label()
                );
                group.push(gemm_row(what, next(), config));
            }
            group.push(bwd_row(
                "backward (chain)",
                next(),
                format!(
                    "one layer of a chain of {ACT} layers: dY is this layer's dZ (formed by the \
                     layer above's dX GEMM); db pass over it; dX GEMM with the {ACT}' epilogue \
                     forming the layer below's dZ; dW GEMM"
                ),
            ));
            group.push(bwd_row(
                "backward (chain, db in epilogue)",
                next(),
                format!(
                    "the chain form with every db from a GEMM epilogue: dX GEMM with the {ACT}' \
                     epilogue forming the layer below's dZ and its 16-row column sums (that \
                     layer's db after one small reduction; this layer's came from the layer \
                     above's); dW GEMM"
                ),
            ));
            for (what, config) in [
                (
                    "dX GEMM, act' epilogue",
                    format!("the chain form's dX GEMM alone: the {ACT}' epilogue, no column sums"),
                ),
                (
                    "dX GEMM, act' epilogue + db",
                    format!(
                        "the chain form's dX GEMM alone: the {ACT}' epilogue with the 16-row \
                         column sums, and their reduction"
                    ),
                ),
            ] {
                group.push(gemm_row(what, next(), config));
            }
            relate(&mut group, "backward", None);
            note_timing(&mut group, cfg.timing);
            out.extend(group);
        }
    }
    Ok(())
}

/// The seed's comparison: a ~1M-parameter layer (1024 → 1024, 4096 tokens, bias + GELU, f32) on
/// the CPU (`parallel`) and on the GPU (default pick, true fp32; and bf16), in one group with
/// the CPU as the baseline.
fn bench_cpu_vs_gpu(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    let shape = if cfg.quick {
        [1024, 1024, 1024]
    } else {
        [4096, 1024, 1024]
    };
    let [m, n, k] = shape;
    let flops = 2.0 * (m * n * k) as f64;
    let label = format!("{m}×{n}←{k} bias+{ACT} (1M params)");
    let mut group = Vec::new();
    // Representative: the CPU's one linear case (a GPU's headline is its forward ladder).
    for &dev in cfg
        .devices
        .iter()
        .filter(|d| !(cfg.representative && d.is_cuda()))
    {
        let dtypes: &[DType] = if dev.is_cuda() {
            &[DType::F32, DType::BF16]
        } else {
            &[DType::F32]
        };
        for &dtype in dtypes.iter().filter(|d| cfg.wants_dtype(**d)) {
            let l = Layer::new(dev, dtype, shape)?;
            let opts = LinearOptions {
                activation: ACT,
                ..Default::default()
            };
            let p = super::validate_fwd(
                &Fwd {
                    x: &l.x,
                    w: &l.w,
                    bias: Some(&l.b),
                    residual: None,
                },
                &FwdOut { y: &l.y, z: None },
            )?;
            let g = if dev.is_cuda() { Some(l.gemm()?) } else { None };
            let v = super::select(&p, g.as_ref(), &opts)?.name;
            progress(&format!("linear {dev} {v} {dtype} {label}"));
            let stats = match dev {
                Device::Cpu => time_cpu_op(Budget::cpu(), || l.forward(&opts))?,
                Device::Cuda(i) => {
                    let cd = device(i)?;
                    let s = cd.stream().clone();
                    time_gpu(&cd, &s, Budget::gpu(), |_| l.forward(&opts))?
                }
            };
            let name = match dev {
                Device::Cpu => crate::core::harness::cpu_name(),
                Device::Cuda(i) => device(i)?.props().name.clone(),
            };
            let mut r = record(
                dev,
                &name,
                &format!("{dev} {v}"),
                dtype,
                label.clone(),
                stats,
                flops,
                fwd_bytes(shape, dtype.size_in_bytes()),
            );
            r.config = if dev.is_cuda() {
                format!("{v}, default pick")
            } else {
                format!("{v}, {} threads", rayon::current_num_threads())
            };
            group.push(r);
        }
    }
    if group.len() > 1 {
        let base = group[0].variant.clone();
        relate(&mut group, &base, None);
    }
    out.extend(group);
    Ok(())
}
