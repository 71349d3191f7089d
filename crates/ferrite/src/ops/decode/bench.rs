//! `ferrite bench decode`: the shapes (B16 Hq32 Hkv8 D128 ctx4096, B64 ctx2048, and
//! B1 ctx32768 where split_kv matters), block size 16, shuffled block tables; reported as bytes
//! of K/V read per second against the device copy bandwidth measured in the same run (decode is
//! memory-bound). The PyTorch SDPA peer on a contiguous cache is measured by the GPU suite under
//! the same op/shape labels.

use super::check::{make_inputs, Case};
use super::cuda as dc;
use super::{variants, DecodeOptions, Problem, OP};
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

/// (batch, Hq, Hkv, D, context, block_size).
pub type Shape = (usize, usize, usize, usize, usize, usize);

pub fn label((b, hq, hkv, d, ctx, bs): Shape) -> String {
    format!("B{b} Hq{hq} Hkv{hkv} D{d} ctx{ctx} bs{bs}")
}

/// Bytes of K and V one decode step reads.
pub fn kv_bytes((b, _, hkv, d, ctx, _): Shape, dtype: DType) -> f64 {
    2.0 * (b * ctx * hkv * d * dtype.size_in_bytes()) as f64
}

/// Shapes from `--shape B,Hq,Hkv,D,ctx[,bs]`, or the defaults.
fn shapes(cfg: &BenchConfig, defaults: &[Shape]) -> Vec<Shape> {
    if cfg.shapes.is_empty() {
        return defaults.to_vec();
    }
    cfg.shapes
        .iter()
        .filter(|s| s.len() >= 5)
        .map(|s| {
            (
                s[0],
                s[1],
                s[2],
                s[3],
                s[4],
                s.get(5).copied().unwrap_or(16),
            )
        })
        .collect()
}

fn case((b, hq, hkv, d, ctx, bs): Shape) -> Case {
    Case {
        hq,
        hkv,
        d,
        block_size: bs,
        lens: vec![ctx as i32; b],
        softcap: 0.0,
        window: -1,
        scale: None,
    }
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
    if !cfg.wants_dtype(DType::F32) {
        return Ok(());
    }
    let default: Shape = if cfg.quick {
        (4, 8, 2, 64, 512, 16)
    } else {
        (8, 32, 8, 128, 2048, 16)
    };
    for s in shapes(cfg, &[default]) {
        let c = case(s);
        let x = make_inputs(&c, DType::F32, Device::Cpu, 1, 0)?;
        let o = Tensor::empty(&[s.0, s.1, s.3], DType::F32, Device::Cpu)?;
        let mut group = Vec::new();
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::Cpu && cfg.wants_variant(v.name))
        {
            progress(&format!("decode cpu {} {}", v.name, label(s)));
            let opts = DecodeOptions {
                variant: Some(v.name.into()),
                ..Default::default()
            };
            let st = time_cpu_op(Budget::cpu(), || {
                super::decode_into(&x.q, &x.kv(), &o, None, &opts)
            })?;
            let mut rec = BenchRecord::new(
                Device::Cpu,
                &crate::core::harness::cpu_name(),
                OP,
                v.name,
                DType::F32,
                label(s),
                st,
                4.0 * (s.0 * s.1 * s.3 * s.4) as f64,
                kv_bytes(s, DType::F32),
            );
            rec.config = cpu_threads_note(v.name == "parallel");
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
    let defaults: Vec<Shape> = if cfg.quick {
        vec![(16, 32, 8, 128, 4096, 16), (1, 32, 8, 128, 32768, 16)]
    } else {
        vec![
            (16, 32, 8, 128, 4096, 16),
            (64, 32, 8, 128, 2048, 16),
            (1, 32, 8, 128, 32768, 16),
        ]
    };
    for dtype in [DType::BF16].into_iter().filter(|t| cfg.wants_dtype(*t)) {
        for s in shapes(cfg, &defaults) {
            let c = case(s);
            let x = make_inputs(&c, dtype, d, 1, 0)?;
            let o = Tensor::empty(&[s.0, s.1, s.3], dtype, d)?;
            let lse = Tensor::empty(&[s.0, s.1], DType::F32, d)?;
            let p = Problem {
                batch: s.0,
                heads_q: s.1,
                heads_kv: s.2,
                head_dim: s.3,
                num_blocks: x.num_blocks,
                block_size: s.5,
                max_blocks: x.max_blocks,
                dtype,
                device: d,
                scale: 1.0 / (s.3 as f32).sqrt(),
                softcap: 0.0,
                window_left: -1,
            };
            let ptrs = dc::ptrs(&x.q, &x.kv(), &o, Some(&lse))?;
            let mut group = Vec::new();
            for v in variants()
                .iter()
                .filter(|v| v.backend == Backend::Cuda && cfg.wants_variant(v.name))
            {
                if let Some(why) = super::unfit(v.name, &p, 0, Some(1), false) {
                    progress(&format!("decode {} skipped: {why}", v.name));
                    continue;
                }
                progress(&format!("decode {d} {} {dtype} {}", v.name, label(s)));
                let pr = dc::prepare(v.name, &p, dev, &stream, None)?;
                let st = time_gpu(dev, &stream, Budget::gpu(), |_| pr.run(&p, &ptrs, &stream))?;
                // The timed launches never read the flag; one read after them all.
                pr.read_error(&stream, OP)?;
                let mut rec = BenchRecord::new(
                    d,
                    &name,
                    OP,
                    v.name,
                    dtype,
                    label(s),
                    st,
                    4.0 * (s.0 * s.1 * s.3 * s.4) as f64,
                    kv_bytes(s, dtype),
                )
                .with_kernel(&pr.kernel, pr.threads, pr.smem)?;
                rec.config = pr.config.clone();
                rec.note = "bytes = K+V read".into();
                group.push(rec);
            }
            relate(&mut group, "naive", ceiling);
            out.extend(group);
        }
    }
    Ok(())
}
