//! `ferrite bench moe`: the whole layer (router → permutation → grouped SwiGLU MLP → combine),
//! forward and forward+backward, per variant, with TFLOP/s counting the expert GEMMs of the
//! routed rows (forward 6·T·k·H·I, backward twice that), peak device memory per call, and as the
//! peer in the same run a dense cuBLAS chain of the same FLOPs (the expert GEMMs as if all T·k
//! rows went to one expert). Shapes (`--shape T,H,I,E,k`): by default Mixtral-like
//! (8192, 4096, 14336, 8, 2), Qwen3-MoE-like (32768, 2048, 768, 128, 8) and a DeepSeek-V3-like
//! per-GPU slice (8192, 7168, 2048, 32, 8); `--quick`: (4096, 1024, 512, 16, 4). The routing is
//! a random router's (near-balanced); the note gives its max / mean load. On the CPU the two rungs
//! run a small f32 layer (T 1024, H 256, I 128, E 8, k 2; `--quick` half of it).

use super::{moe_backward, moe_forward, variants, MoeConfig, MoeOptions, MoeWeights, Problem, OP};
use crate::core::cuda::{device, CudaDevice};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::bench::{relate, time_gpu, BenchRecord, Budget};
use crate::core::harness::{BenchConfig, Ceilings, Precision};
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;
use crate::ops::matmul::{self, Gemm, Operand};
use std::sync::Arc;

/// (label, T, H, I, E, k).
/// A layer's random inputs: x, router, w_up, w_down (uniform in ±`scales`) and dout, fixed seeds.
fn layer_inputs(
    [t, h, i, e]: [usize; 4],
    dt: DType,
    d: Device,
    (su, sd): (f64, f64),
) -> Result<[Tensor; 5]> {
    Ok([
        Tensor::rand(&[t, h], dt, d, 11, -1.0, 1.0)?,
        Tensor::rand(&[e, h], dt, d, 12, -0.05, 0.05)?,
        Tensor::rand(&[e, h, 2 * i], dt, d, 13, -su, su)?,
        Tensor::rand(&[e, i, h], dt, d, 14, -sd, sd)?,
        Tensor::rand(&[t, h], dt, d, 15, -1.0, 1.0)?,
    ])
}

pub fn shapes(cfg: &BenchConfig) -> Result<Vec<(String, [usize; 5])>> {
    if !cfg.shapes.is_empty() {
        return cfg
            .shapes
            .iter()
            .map(|s| match s.as_slice() {
                &[t, h, i, e, k] => Ok(("custom".to_string(), [t, h, i, e, k])),
                _ => Err(Error::bad_arg(OP, "shape", "T,H,I,E,k", format!("{s:?}"))),
            })
            .collect();
    }
    Ok(if cfg.quick {
        vec![("small".into(), [4096, 1024, 512, 16, 4])]
    } else {
        // Representative: the Mixtral-like layer, the README's first.
        cfg.scope(&[
            ("mixtral", [8192, 4096, 14336, 8, 2]),
            ("qwen3-moe", [32768, 2048, 768, 128, 8]),
            ("deepseek-v3-slice", [8192, 7168, 2048, 32, 8]),
        ])
        .iter()
        .map(|&(label, shape)| (label.to_string(), shape))
        .collect()
    })
}

pub fn run(
    cfg: &BenchConfig,
    ceilings: &Ceilings,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    for &d in &cfg.devices {
        match d {
            Device::Cpu => bench_cpu(cfg, progress, out)?,
            Device::Cuda(i) => bench_gpu(cfg, &device(i)?, ceilings, progress, out)?,
        }
    }
    Ok(())
}

/// The CPU rungs at a small layer (the GPU shapes take minutes per call here): forward and
/// forward+backward, f32, `naive` against `parallel`.
fn bench_cpu(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    let [t, h, i, e, k] = if cfg.quick {
        [256, 128, 64, 8, 2]
    } else {
        [1024, 256, 128, 8, 2]
    };
    let d = Device::Cpu;
    let dt = DType::F32;
    if !(cfg.dtypes.is_empty() || cfg.wants_dtype(dt)) {
        return Ok(());
    }
    let [x, router, wu, wd, dout] = layer_inputs([t, h, i, e], dt, d, (0.1, 0.1))?;
    let w = MoeWeights {
        router: &router,
        w_up: &wu,
        w_down: &wd,
    };
    let mcfg = MoeConfig::new(e, k);
    let fwd_flops = 6.0 * (t * k) as f64 * h as f64 * i as f64;
    let name = crate::core::harness::cpu_name();
    // Representative: the forward alone (the layer as inference runs it).
    for &backward in cfg.scope(&[false, true]) {
        let pass = if backward { "fwd+bwd" } else { "fwd" };
        let shape = format!("T{t} H{h} I{i} E{e} k{k} {pass}");
        let mut group = Vec::new();
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::Cpu && cfg.wants_variant(v.name))
        {
            progress(&format!("moe cpu {} {shape}", v.name));
            let opts = MoeOptions {
                variant: Some(v.name.into()),
                stream: None,
                forward_only: false,
            };
            let mut err = None;
            let st = crate::core::harness::bench::time_cpu(Budget::cpu(), || {
                let r = moe_forward(&x, &w, &mcfg, &opts).and_then(|f| {
                    if backward {
                        moe_backward(&dout, &x, &w, &f, &mcfg, &opts).map(|_| ())
                    } else {
                        Ok(())
                    }
                });
                if let Err(e) = r {
                    err.get_or_insert(e);
                }
            });
            if let Some(e) = err {
                return Err(e);
            }
            let flops = if backward { 3.0 * fwd_flops } else { fwd_flops };
            let mut rec = BenchRecord::new(d, &name, OP, v.name, dt, shape.clone(), st, flops, 0.0);
            rec.config = v.summary.into();
            group.push(rec);
        }
        relate(&mut group, "naive", None);
        out.extend(group);
    }
    Ok(())
}

/// Peak pool bytes of `f` beyond what was in use before it, plus `resident`.
fn peak_of(dev: &CudaDevice, resident: u64, f: impl FnOnce() -> Result<()>) -> Result<u64> {
    let stream = dev.stream().clone();
    dev.synchronize(&stream, "moe bench: before the memory probe")?;
    let (before, _) = dev.pool_usage()?;
    dev.reset_pool_peak()?;
    f()?;
    dev.synchronize(&stream, "moe bench: memory probe")?;
    let (_, high) = dev.pool_usage()?;
    Ok(resident + high.saturating_sub(before))
}

/// The dense cuBLAS GEMMs of the same FLOPs as the experts' (rows = T·k as one expert): the
/// forward's two, and with `backward` the four of the backward.
fn dense_chain(
    dev: &Arc<CudaDevice>,
    rows: usize,
    h: usize,
    i: usize,
    dt: DType,
    backward: bool,
) -> Result<(Vec<(Gemm, [Tensor; 3])>, f64)> {
    let d = Device::Cuda(dev.ordinal());
    let mk = |m: usize, n: usize, k: usize, at: bool, bt: bool| -> Result<(Gemm, [Tensor; 3])> {
        let a = Tensor::rand(&if at { [k, m] } else { [m, k] }, dt, d, 1, -1.0, 1.0)?;
        let b = Tensor::rand(&if bt { [n, k] } else { [k, n] }, dt, d, 2, -1.0, 1.0)?;
        let c = Tensor::empty(&[m, n], dt, d)?;
        let g = Gemm {
            batch: 1,
            m,
            n,
            k,
            a: Operand {
                ld: if at { m } else { k },
                trans: at,
                batch_stride: 0,
            },
            b: Operand {
                ld: if bt { k } else { n },
                trans: bt,
                batch_stride: 0,
            },
            c: Operand {
                ld: n,
                trans: false,
                batch_stride: 0,
            },
            dtype: dt,
            device: d,
        };
        Ok((g, [a, b, c]))
    };
    let mut v = vec![
        mk(rows, 2 * i, h, false, false)?,
        mk(rows, h, i, false, false)?,
    ];
    if backward {
        v.push(mk(rows, i, h, false, true)?); // dh = dy·W_downᵀ
        v.push(mk(i, h, rows, true, false)?); // dW_down = hᵀ·dy
        v.push(mk(rows, h, 2 * i, false, true)?); // dx = dhpre·W_upᵀ
        v.push(mk(h, 2 * i, rows, true, false)?); // dW_up = xᵀ·dhpre
    }
    let flops = v.iter().map(|(g, _)| g.flops()).sum();
    Ok((v, flops))
}

fn bench_gpu(
    cfg: &BenchConfig,
    dev: &Arc<CudaDevice>,
    ceilings: &Ceilings,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    let d = Device::Cuda(dev.ordinal());
    let stream = dev.stream().clone();
    let name = dev.props().name.clone();
    let dtypes: Vec<DType> = [DType::BF16]
        .into_iter()
        .filter(|&t| cfg.dtypes.is_empty() || cfg.wants_dtype(t))
        .collect();
    for (label, [t, h, i, e, k]) in shapes(cfg)? {
        for &dt in &dtypes {
            let scales = (1.0 / (h as f64).sqrt(), 1.0 / (i as f64).sqrt());
            let [x, router, wu, wd, dout] = layer_inputs([t, h, i, e], dt, d, scales)?;
            let w = MoeWeights {
                router: &router,
                w_up: &wu,
                w_down: &wd,
            };
            let mcfg = MoeConfig::new(e, k);
            let p = Problem {
                tokens: t,
                hidden: h,
                inter: i,
                experts: e,
                top_k: k,
                dtype: dt,
                device: d,
            };
            let resident =
                (x.nbytes() + router.nbytes() + wu.nbytes() + wd.nbytes() + dout.nbytes()) as u64;
            let fwd_flops = p.expert_flops(t * k);
            let shape = |pass: &str| format!("{label} T{t} H{h} I{i} E{e} k{k} {pass}");
            // Representative: the forward alone (the layer as inference runs it).
            for &backward in cfg.scope(&[false, true]) {
                let pass = if backward { "fwd+bwd" } else { "fwd" };
                let flops = if backward { 3.0 * fwd_flops } else { fwd_flops };
                let mut group = Vec::new();
                for v in variants()
                    .iter()
                    .filter(|v| v.backend == Backend::Cuda && cfg.wants_variant(v.name))
                {
                    if v.unsupported_reason(Backend::Cuda, dt, Some(dev.arch()))
                        .is_some()
                    {
                        continue;
                    }
                    progress(&format!("moe {} {} {pass}", v.name, shape("")));
                    // The forward alone is timed as inference runs it (no pre-activations kept
                    // for a backward), as the PyTorch peers run theirs under no_grad.
                    let opts = MoeOptions {
                        variant: Some(v.name.into()),
                        stream: None,
                        forward_only: !backward,
                    };
                    let call = || -> Result<()> {
                        let f = moe_forward(&x, &w, &mcfg, &opts)?;
                        if backward {
                            moe_backward(&dout, &x, &w, &f, &mcfg, &opts)?;
                        }
                        Ok(())
                    };
                    if let Err(err) = call() {
                        if matches!(err, Error::NoVariant { .. }) {
                            continue;
                        }
                        return Err(err);
                    }
                    let peak = peak_of(dev, resident, call)?;
                    let st = time_gpu(dev, &stream, Budget::gpu(), |_| call())?;
                    let m = moe_forward(&x, &w, &mcfg, &opts)?.metrics()?;
                    let mut rec =
                        BenchRecord::new(d, &name, OP, v.name, dt, shape(pass), st, flops, 0.0);
                    rec.peak_device_bytes = Some(peak);
                    rec.config = v.summary.into();
                    rec.note = format!(
                        "load max {} / mean {:.0} (balance {:.2}), {} rows in the padded layout for {} pairs, peak {:.2} GiB",
                        m.max_load,
                        m.mean_load,
                        m.balance,
                        m.rows_used,
                        t * k,
                        peak as f64 / (1u64 << 30) as f64
                    );
                    group.push(rec);
                }
                // The expert GEMMs alone on a finished forward's layout (forward pass only; a
                // sub-bench, not in representative scope).
                for v in variants().iter().filter(|v| {
                    !backward
                        && !cfg.representative
                        && v.backend == Backend::Cuda
                        && v.name != "naive"
                        && cfg.wants_variant(v.name)
                }) {
                    if v.unsupported_reason(Backend::Cuda, dt, Some(dev.arch()))
                        .is_some()
                    {
                        continue;
                    }
                    let opts = MoeOptions {
                        variant: Some(v.name.into()),
                        stream: None,
                        forward_only: false,
                    };
                    let f = match moe_forward(&x, &w, &mcfg, &opts) {
                        Ok(f) => f,
                        Err(Error::NoVariant { .. }) => continue,
                        Err(e) => return Err(e),
                    };
                    progress(&format!("moe {} expert GEMMs {}", v.name, shape("")));
                    let gemms = super::cuda::ExpertGemms::new(&p, &opts)?;
                    let st = time_gpu(dev, &stream, Budget::gpu(), |_| {
                        gemms.run(v.name, &p, &w, &mcfg, &f, &opts)
                    })?;
                    let mut rec = BenchRecord::new(
                        d,
                        &name,
                        OP,
                        &format!("{}:expert_gemms", v.name),
                        dt,
                        shape(pass),
                        st,
                        fwd_flops,
                        0.0,
                    );
                    rec.config = "the two grouped expert GEMMs alone (up, down) on the layout of a finished forward".into();
                    rec.note = format!(
                        "{} rows in the padded layout for {} pairs",
                        f.metrics()?.rows_used,
                        t * k
                    );
                    group.push(rec);
                }
                // The peer: a dense cuBLAS chain of the same FLOPs.
                progress(&format!("moe dense cuBLAS chain {} {pass}", shape("")));
                let (chain, chain_flops) = dense_chain(dev, t * k, h, i, dt, backward)?;
                let st = time_gpu(dev, &stream, Budget::gpu(), |_| {
                    for (g, [a, b, c]) in &chain {
                        let ptrs = matmul::cuda::Ptrs {
                            a: a.device_ptr()?,
                            b: b.device_ptr()?,
                            c: c.device_ptr()?,
                        };
                        matmul::cuda::cublas(dev, g, ptrs, 1.0, 0.0, Precision::Bf16, &stream)?;
                    }
                    Ok(())
                })?;
                let mut rec = BenchRecord::new(
                    d,
                    &name,
                    OP,
                    "cublas_dense_chain",
                    dt,
                    shape(pass),
                    st,
                    chain_flops,
                    0.0,
                );
                rec.is_peer = true;
                rec.config = "the expert GEMMs' FLOPs as dense cuBLAS GEMMs (one expert holding every row); no routing".into();
                group.push(rec);
                drop(chain);
                let ceiling = ceilings.gpu_gemm("bf16").map(|g| ("cuBLAS bf16", g, true));
                relate(&mut group, "naive", ceiling);
                out.extend(group);
            }
        }
    }
    Ok(())
}
