//! `ferrite bench adamw`: one step over a GPT-2-124M-like list of 148 tensors (~124M params),
//! f32 params and bf16 params with f32 master weights, per-tensor launches (`naive`) vs one
//! multi-tensor launch, as GB/s against the device copy bandwidth. Bytes are what a step must
//! move: read param (or master), grad, exp_avg, exp_avg_sq; write them back (and the bf16 param).

use super::cuda::{launch_naive, AdamWPlan};
use super::{adamw_step, variants, AdamWHyper, AdamWOptions, AdamWTensor, Problem, OP};
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

/// Parameter sizes of a GPT-2 (tied embedding): wte, wpe, 12 per block, final LayerNorm.
pub fn gpt2_sizes(vocab: usize, ctx: usize, d: usize, layers: usize) -> Vec<usize> {
    let mut v = vec![vocab * d, ctx * d];
    for _ in 0..layers {
        v.extend([
            d,
            d,
            d * 3 * d,
            3 * d,
            d * d,
            d,
            d,
            d,
            d * 4 * d,
            4 * d,
            4 * d * d,
            d,
        ]);
    }
    v.extend([d, d]);
    v
}

/// Bytes a step moves per element.
pub fn bytes_per_element(param: DType, grad: DType) -> usize {
    let state = 4 + 4; // exp_avg, exp_avg_sq: read + write each
    let p = if param == DType::BF16 {
        4 + 4 + 2 // master read + write, bf16 param write
    } else {
        4 + 4
    };
    2 * state + p + grad.size_in_bytes()
}

struct Set {
    params: Vec<Tensor>,
    grads: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    master: Vec<Option<Tensor>>,
}

impl Set {
    fn new(sizes: &[usize], pd: DType, gd: DType, dev: Device) -> Result<Set> {
        let mk = |dt: DType, seed: u64, lo: f64, hi: f64| -> Result<Vec<Tensor>> {
            sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| Tensor::rand(&[n], dt, dev, seed + i as u64, lo, hi))
                .collect()
        };
        Ok(Set {
            params: mk(pd, 1000, -1.0, 1.0)?,
            grads: mk(gd, 2000, -0.1, 0.1)?,
            m: mk(DType::F32, 3000, -0.01, 0.01)?,
            v: mk(DType::F32, 4000, 0.0, 1e-4)?,
            master: if pd == DType::BF16 {
                mk(DType::F32, 5000, -1.0, 1.0)?
                    .into_iter()
                    .map(Some)
                    .collect()
            } else {
                sizes.iter().map(|_| None).collect()
            },
        })
    }
    fn list(&self) -> Vec<AdamWTensor<'_>> {
        (0..self.params.len())
            .map(|i| AdamWTensor {
                param: &self.params[i],
                grad: &self.grads[i],
                exp_avg: &self.m[i],
                exp_avg_sq: &self.v[i],
                master: self.master[i].as_ref(),
            })
            .collect()
    }
}

const COMBOS: [(DType, DType); 2] = [(DType::F32, DType::F32), (DType::BF16, DType::BF16)];

/// The (param, grad) dtypes a run steps; representative scope: f32 alone (the first), since the
/// bf16 + master step runs the same rungs.
fn combos(cfg: &BenchConfig) -> Vec<(DType, DType)> {
    let params = cfg.dtypes_in_scope(&COMBOS.map(|(p, _)| p));
    COMBOS
        .into_iter()
        .filter(|(p, _)| params.contains(p))
        .collect()
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

fn bench_cpu(
    cfg: &BenchConfig,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    let name = crate::core::harness::cpu_name();
    // A small GPT-2 (~1.3M params; ~0.2M quick).
    let sizes = if cfg.quick {
        gpt2_sizes(1000, 128, 64, 2)
    } else {
        gpt2_sizes(4096, 256, 128, 4)
    };
    let n: usize = sizes.iter().sum();
    for (pd, gd) in combos(cfg) {
        let set = Set::new(&sizes, pd, gd, Device::Cpu)?;
        let list = set.list();
        let mut group = Vec::new();
        for var in variants()
            .iter()
            .filter(|x| x.backend == Backend::Cpu && cfg.wants_variant(x.name))
        {
            progress(&format!("adamw cpu {} {pd} {n} params", var.name));
            let opts = AdamWOptions {
                variant: Some(var.name.into()),
                stream: None,
            };
            let s = time_cpu_op(Budget::cpu(), || {
                adamw_step(&list, &AdamWHyper::default(), &opts)
            })?;
            let mut rec = BenchRecord::new(
                Device::Cpu,
                &name,
                OP,
                var.name,
                pd,
                format!("{} tensors, {n} params", sizes.len()),
                s,
                0.0,
                (n * bytes_per_element(pd, gd)) as f64,
            );
            rec.config = cpu_threads_note(var.name == "parallel");
            group.push(rec);
        }
        relate(&mut group, "naive", None);
        out.extend(group);
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
    // GPT-2 124M: 50257 vocab, 1024 context, d 768, 12 layers; quick: 6 layers.
    let sizes = gpt2_sizes(50257, 1024, 768, if cfg.quick { 6 } else { 12 });
    let n: usize = sizes.iter().sum();
    let hp = AdamWHyper::default();
    let h = hp.validate()?;
    for (pd, gd) in combos(cfg) {
        let set = Set::new(&sizes, pd, gd, d)?;
        let list = set.list();
        let plan = AdamWPlan::new(&list, Some(&stream))?;
        let p: Problem = *plan.problem();
        let bytes = (n * bytes_per_element(pd, gd)) as f64;
        let mut group = Vec::new();
        for var in variants()
            .iter()
            .filter(|x| x.backend == Backend::Cuda && cfg.wants_variant(x.name))
        {
            progress(&format!("adamw {d} {} {pd} {n} params", var.name));
            let s = time_gpu(dev, &stream, Budget::gpu(), |_| match var.name {
                "naive" => launch_naive(&p, &list, &h, dev, &stream),
                _ => plan.step(&hp, Some(&stream)),
            })?;
            let (k, threads) = plan.kernel()?;
            let mut rec = BenchRecord::new(
                d,
                &name,
                OP,
                var.name,
                pd,
                format!("GPT-2 {} tensors, {n} params", sizes.len()),
                s,
                0.0,
                bytes,
            );
            if var.name == "multi_tensor" {
                rec = rec.with_kernel(&k, threads, 0)?;
                rec.config = format!(
                    "1 launch, {} blocks of {threads}",
                    n.div_ceil(super::cuda::CHUNK)
                );
            } else {
                rec.config = format!("{} launches", sizes.len());
            }
            rec.note = format!(
                "{} B/param{}",
                bytes_per_element(pd, gd),
                if pd == DType::BF16 {
                    " (f32 master)"
                } else {
                    ""
                }
            );
            group.push(rec);
        }
        relate(&mut group, "naive", ceiling);
        out.extend(group);
    }
    Ok(())
}
