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

/// (batch, Hq, Hkv, D, context, block_size, shortest context): every sequence `context` long
/// when the last equals it, else a ragged batch (see [`lens`]).
pub type Shape = (usize, usize, usize, usize, usize, usize, usize);

pub fn label((b, hq, hkv, d, ctx, bs, lo): Shape) -> String {
    if lo == ctx {
        format!("B{b} Hq{hq} Hkv{hkv} D{d} ctx{ctx} bs{bs}")
    } else {
        format!("B{b} Hq{hq} Hkv{hkv} D{d} ragged {lo}..{ctx} bs{bs}")
    }
}

/// The lengths of a shape's batch: all `context`, or a ragged batch spread evenly over
/// `lo..=context` (sequence i of B at lo + (context − lo)·i/(B − 1)), in a fixed shuffled order.
pub fn lens((b, _, _, _, ctx, _, lo): Shape) -> Vec<i32> {
    let mut v: Vec<i32> = (0..b)
        .map(|i| {
            if b <= 1 || lo >= ctx {
                ctx as i32
            } else {
                (lo + (ctx - lo) * i / (b - 1)) as i32
            }
        })
        .collect();
    // A fixed permutation (multiplicative stride coprime to B) so long and short sequences mix.
    if b > 2 {
        let stride = (1..b)
            .rev()
            .find(|s| gcd(*s, b) == 1 && *s * 2 < b + 2)
            .unwrap_or(1);
        let src = v.clone();
        for (i, x) in v.iter_mut().enumerate() {
            *x = src[(i * stride) % b];
        }
    }
    v
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Keys read per step, summed over the batch.
fn total_keys(s: Shape) -> usize {
    lens(s).iter().map(|&l| l as usize).sum()
}

/// Bytes of K and V one decode step reads.
pub fn kv_bytes(s: Shape, dtype: DType) -> f64 {
    let (_, _, hkv, d, _, _, _) = s;
    2.0 * (total_keys(s) * hkv * d * dtype.size_in_bytes()) as f64
}

fn flops(s: Shape) -> f64 {
    4.0 * (s.1 * s.3 * total_keys(s)) as f64
}

/// Shapes from `--shape B,Hq,Hkv,D,ctx[,bs[,shortest]]`, or the defaults.
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
                s.get(6).copied().unwrap_or(s[4]).min(s[4]),
            )
        })
        .collect()
}

fn case(s: Shape) -> Case {
    let (_, hq, hkv, d, _, bs, _) = s;
    Case {
        hq,
        hkv,
        d,
        block_size: bs,
        lens: lens(s),
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
        (4, 8, 2, 64, 512, 16, 512)
    } else {
        (8, 32, 8, 128, 2048, 16, 2048)
    };
    // Representative: the same single case (every rung).
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
                flops(s),
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
        vec![
            (16, 32, 8, 128, 4096, 16, 4096),
            (1, 32, 8, 128, 32768, 16, 32768),
            (32, 32, 8, 128, 8192, 16, 512),
        ]
    } else {
        vec![
            (16, 32, 8, 128, 4096, 16, 4096),
            (64, 32, 8, 128, 2048, 16, 2048),
            (1, 32, 8, 128, 32768, 16, 32768),
            // Ragged (serving) batches: lengths spread over the range, pages of 16.
            (32, 32, 8, 128, 8192, 16, 512),
            (128, 32, 8, 128, 4096, 16, 128),
            (8, 32, 8, 128, 32768, 16, 1024),
            (32, 32, 32, 128, 8192, 16, 512),
        ]
    };
    for dtype in [DType::BF16].into_iter().filter(|t| cfg.wants_dtype(*t)) {
        // Representative: B16 ctx4096 (the README's first decode figure), not the long or
        // ragged batches.
        for s in shapes(cfg, cfg.scope(&defaults)) {
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
                let record = |variant: &str, st, pr: &dc::Prepared| -> Result<BenchRecord> {
                    let mut rec = BenchRecord::new(
                        d,
                        &name,
                        OP,
                        variant,
                        dtype,
                        label(s),
                        st,
                        flops(s),
                        kv_bytes(s, dtype),
                    )
                    .with_kernel(&pr.kernel, pr.threads, pr.smem)?;
                    rec.config = pr.config.clone();
                    rec.note = "bytes = K+V read".into();
                    Ok(rec)
                };
                let Some(sc) = &pr.sched else {
                    let st = time_gpu(dev, &stream, Budget::gpu(), |_| pr.run(&p, &ptrs, &stream))?;
                    // The timed launches never read the flag; one read after them all.
                    pr.read_error(&stream, OP)?;
                    group.push(record(v.name, st, &pr)?);
                    continue;
                };
                // Scheduled: a serving step plans once and runs every layer on the plan, so the
                // run is timed on its own and the plan apart (in the config).
                pr.run(&p, &ptrs, &stream)?;
                let (chunk, chunks) = pr.planned(&stream)?.unwrap_or((0, 0));
                let st = time_gpu(dev, &stream, Budget::gpu(), |_| {
                    pr.launch_own(&p, &ptrs, &stream)
                })?;
                let plan_st = time_gpu(dev, &stream, Budget::gpu(), |_| {
                    pr.plan_own(&p, &ptrs, &stream)
                })?;
                pr.read_error(&stream, OP)?;
                let mut rec = record(v.name, st, &pr)?;
                rec.config += &format!(
                    "; plan: {chunks} chunks of ≤ {chunk} keys, {:.1} µs to make",
                    plan_st.median_ms * 1e3
                );
                group.push(rec);
                // The uniform partitions of the same kernel, as the wave planner picks them
                // from the longest possible context (the previous default): the step's baseline.
                let splits = dc::plan_splits(p.batch * sc.per_b, p.max_visible(), sc.slots);
                let uniform = dc::prepare(v.name, &p, dev, &stream, Some(splits))?;
                let st = time_gpu(dev, &stream, Budget::gpu(), |_| {
                    uniform.run(&p, &ptrs, &stream)
                })?;
                uniform.read_error(&stream, OP)?;
                group.push(record(&format!("{}/uniform", v.name), st, &uniform)?);
            }
            relate(&mut group, "naive", ceiling);
            out.extend(group);
        }
    }
    Ok(())
}
