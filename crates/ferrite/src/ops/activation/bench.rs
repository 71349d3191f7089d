//! `ferrite bench activation`: bias + GELU(tanh) + dropout(0.1) and SwiGLU, forward and
//! backward, unfused (`naive`) beside `fused`, as GB/s and % of the device copy bandwidth
//! measured in the same run. Bytes are the fused pass's minimum traffic for both variants (so
//! GB/s compares times directly); the note gives what the unfused chain really moves.

use super::cuda as ac;
use super::{
    bias_act_dropout_backward_into, bias_act_dropout_into, glu_backward_into, glu_into, variants,
    ActOptions, Activation, Dropout, GluOptions, Problem, OP,
};
use crate::core::cuda::{device, CudaDevice};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::bench::{
    cpu_threads_note, relate, time_cpu_op, time_gpu, BenchRecord, Budget,
};
use crate::core::harness::{BenchConfig, Ceilings};
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;
use std::sync::Arc;

const DROPOUT: Dropout = Dropout {
    p: 0.1,
    seed: 0x5eed,
    offset: 0,
};
const ACT: Activation = Activation::GeluTanh;

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

/// The measured passes: (label, tensors' worth of bytes fused, unfused). The last one, without
/// dropout, shows what drawing the mask costs. Representative scope runs the first alone (bf16 on
/// a GPU): bias + GELU + dropout forward, the op the family's docs lead with.
const PASSES: [(&str, f64, f64); 5] = [
    ("bias+gelu_tanh+dropout0.1 fwd", 2.0, 6.0),
    ("bias+gelu_tanh+dropout0.1 bwd", 3.0, 8.0),
    ("swiglu fwd", 3.0, 5.0),
    ("swiglu bwd", 5.0, 11.0),
    ("bias+gelu_tanh fwd (p=0)", 2.0, 4.0),
];

fn bench_cpu(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    if !cfg.wants_dtype(DType::F32) {
        return Ok(());
    }
    let d = Device::Cpu;
    for [r, c] in cfg.shapes_2d(if cfg.quick { [256, 1024] } else { [4096, 1024] }) {
        let x = Tensor::rand(&[r, c], DType::F32, d, 1, -3.0, 3.0)?;
        let b = Tensor::rand(&[c], DType::F32, d, 2, -1.0, 1.0)?;
        let dy = Tensor::rand(&[r, c], DType::F32, d, 3, -1.0, 1.0)?;
        let inp = Tensor::rand(&[r, 2 * c], DType::F32, d, 4, -3.0, 3.0)?;
        let (y, dx, db) = (
            Tensor::empty(&[r, c], DType::F32, d)?,
            Tensor::empty(&[r, c], DType::F32, d)?,
            Tensor::empty(&[c], DType::F32, d)?,
        );
        let (o, din) = (
            Tensor::empty(&[r, c], DType::F32, d)?,
            Tensor::empty(&[r, 2 * c], DType::F32, d)?,
        );
        for (pi, (label, tensors, _)) in cfg.scope(&PASSES).iter().enumerate() {
            let mut group = Vec::new();
            for v in variants()
                .iter()
                .filter(|v| v.backend == Backend::Cpu && cfg.wants_variant(v.name))
            {
                progress(&format!("activation cpu {} {r}×{c} {label}", v.name));
                let ao = ActOptions {
                    variant: Some(v.name.into()),
                    stream: None,
                    act: ACT,
                    dropout: DROPOUT,
                };
                let go = GluOptions {
                    variant: Some(v.name.into()),
                    stream: None,
                    act: Activation::Silu,
                };
                let s = time_cpu_op(Budget::cpu(), || match pi {
                    0 => bias_act_dropout_into(&x, Some(&b), &y, &ao),
                    1 => bias_act_dropout_backward_into(&dy, &x, Some(&b), &dx, Some(&db), &ao),
                    2 => glu_into(&inp, &o, &go),
                    3 => glu_backward_into(&dy, &inp, &din, &go),
                    _ => bias_act_dropout_into(
                        &x,
                        Some(&b),
                        &y,
                        &ActOptions {
                            dropout: Dropout::default(),
                            ..ao.clone()
                        },
                    ),
                })?;
                let mut rec = BenchRecord::new(
                    d,
                    &crate::core::harness::cpu_name(),
                    OP,
                    v.name,
                    DType::F32,
                    format!("{r}×{c} {label}"),
                    s,
                    0.0,
                    tensors * 4.0 * (r * c) as f64,
                );
                rec.config = cpu_threads_note(v.name == "parallel");
                group.push(rec);
            }
            relate(&mut group, "naive", None);
            out.extend(group);
        }
    }
    Ok(())
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
    let ceiling = ceilings.gpu_copy_gbps.map(|v| ("device copy", v, false));
    for dtype in cfg.dtypes_in_scope(&[DType::BF16, DType::F32]) {
        for [r, c] in cfg.shapes_2d(if cfg.quick {
            [2048, 2048]
        } else {
            [32768, 4096]
        }) {
            let x = Tensor::rand(&[r, c], dtype, d, 1, -3.0, 3.0)?;
            let b = Tensor::rand(&[c], dtype, d, 2, -1.0, 1.0)?;
            let dy = Tensor::rand(&[r, c], dtype, d, 3, -1.0, 1.0)?;
            let y = Tensor::empty(&[r, c], dtype, d)?;
            let dx = Tensor::empty(&[r, c], dtype, d)?;
            let db = Tensor::empty(&[c], dtype, d)?;
            // The GLU's input is [r, 2c]: the output has the same shape as the bias op's.
            let inp = Tensor::rand(&[r, 2 * c], dtype, d, 4, -3.0, 3.0)?;
            let din = Tensor::empty(&[r, 2 * c], dtype, d)?;
            let es = dtype.size_in_bytes() as f64;
            let n = (r * c) as f64;
            let q_fwd = ac::ActPtrs {
                out: y.device_ptr()?,
                db: 0,
                g: 0,
                x: x.device_ptr()?,
                b: b.device_ptr()?,
            };
            let q_bwd = ac::ActPtrs {
                out: dx.device_ptr()?,
                db: db.device_ptr()?,
                g: dy.device_ptr()?,
                x: x.device_ptr()?,
                b: b.device_ptr()?,
            };
            for (pi, (label, tensors, unfused)) in cfg.scope(&PASSES).iter().enumerate() {
                let glu = pi == 2 || pi == 3;
                let p = Problem {
                    rows: r,
                    cols: c,
                    dtype,
                    device: d,
                    act: if glu { Activation::Silu } else { ACT },
                    glu,
                };
                let mut group = Vec::new();
                for v in variants()
                    .iter()
                    .filter(|v| v.backend == Backend::Cuda && cfg.wants_variant(v.name))
                {
                    if v.name == "fused" && super::fused_unfit(&p, &[]).is_some() {
                        continue;
                    }
                    progress(&format!(
                        "activation {d} {} {dtype} {r}×{c} {label}",
                        v.name
                    ));
                    let s = time_gpu(dev, &stream, Budget::gpu(), |_| match pi {
                        0 => ac::run_act_fwd(v.name, &p, dev, q_fwd, &DROPOUT, &stream),
                        1 => ac::run_act_bwd(v.name, &p, dev, q_bwd, &DROPOUT, &stream),
                        2 => ac::run_glu_fwd(
                            v.name,
                            &p,
                            dev,
                            y.device_ptr()?,
                            inp.device_ptr()?,
                            &stream,
                        ),
                        4 => ac::run_act_fwd(v.name, &p, dev, q_fwd, &Dropout::default(), &stream),
                        _ => ac::run_glu_bwd(
                            v.name,
                            &p,
                            dev,
                            din.device_ptr()?,
                            dy.device_ptr()?,
                            inp.device_ptr()?,
                            &stream,
                        ),
                    })?;
                    let mut rec = BenchRecord::new(
                        d,
                        &name,
                        OP,
                        v.name,
                        dtype,
                        format!("{r}×{c} {label}"),
                        s,
                        0.0,
                        tensors * n * es,
                    );
                    if v.name == "fused" {
                        let f = [
                            ac::Fused::ActFwd,
                            ac::Fused::ActBwd,
                            ac::Fused::GluFwd,
                            ac::Fused::GluBwd,
                            ac::Fused::ActFwd,
                        ][pi];
                        if let Some((k, g, u)) = ac::fused_choice(dev, &p, f, pi < 2)? {
                            rec = rec.with_kernel(&k, g.threads, 0)?;
                            rec.config = format!("{}, {u} rows in flight, tuned", g.describe());
                        }
                    } else {
                        rec.config = "one scalar kernel per op".into();
                        rec.note = format!(
                            "unfused chain moves ≈{:.2} GB (×{:.1} the fused pass)",
                            unfused * n * es / 1e9,
                            unfused / tensors
                        );
                    }
                    group.push(rec);
                }
                relate(&mut group, "naive", ceiling);
                out.extend(group);
            }
        }
    }
    Ok(())
}
