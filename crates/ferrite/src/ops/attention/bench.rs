//! `ferrite bench attention`: forward and backward of every variant as TFLOP/s by the usual
//! convention (forward 4·B·Hq·Sq·Sk·D, halved when causal; backward 2.5× forward), and on the GPU
//! the peak device memory one call needed (the stream-ordered pool's high-water mark, so the
//! naive variant's O(n²) score buffers show against the flash variants' O(n)).
//!
//! The GPU backward rows are the default backward (dQ through atomics, what a call without
//! `deterministic` gets); `flash (deterministic)` is the three-kernel backward without atomics.
//!
//! Shapes (B, H, S, D; Hkv = H): GPU default B4 H16 S4096 with D128 and D64, causal and not, and
//! when not quick also S1024 and S16384, and B1 H16 S8192 D128 (the memory comparison); quick:
//! B1 H8 S1024. CPU: B1 H4 S512 D64 (S256 quick). `--size N` sets S.

use super::{attention_backward_into, attention_forward_into, variants, AttentionOptions, OP};
use crate::core::cuda::{device, CudaDevice};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::bench::{
    cpu_threads_note, relate, time_cpu_op, time_gpu, BenchRecord, Budget, Stats,
};
use crate::core::harness::{BenchConfig, Ceilings};
use crate::core::tensor::Tensor;
use crate::core::variant::Backend;
use std::sync::Arc;

/// The naive CUDA variant's score workspaces above this are not attempted.
const NAIVE_WORKSPACE_CAP: u64 = 8 << 30;

#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub b: usize,
    pub h: usize,
    pub s: usize,
    pub d: usize,
    pub causal: bool,
}

impl Shape {
    pub fn label(&self) -> String {
        format!(
            "B{} H{} S{} D{}{}",
            self.b,
            self.h,
            self.s,
            self.d,
            if self.causal { " causal" } else { "" }
        )
    }
    pub fn flops_forward(&self) -> f64 {
        let f = 4.0 * (self.b * self.h) as f64 * (self.s as f64).powi(2) * self.d as f64;
        if self.causal {
            f / 2.0
        } else {
            f
        }
    }
    /// Bytes of one B·H·S·S f32 workspace.
    pub fn score_bytes(&self) -> u64 {
        (self.b * self.h) as u64 * (self.s as u64).pow(2) * 4
    }
}

fn both(b: usize, h: usize, s: usize, d: usize) -> [Shape; 2] {
    [false, true].map(|causal| Shape { b, h, s, d, causal })
}

pub fn gpu_shapes(cfg: &BenchConfig) -> Vec<Shape> {
    if !cfg.shapes.is_empty() {
        return cfg
            .shapes
            .iter()
            .flat_map(|s| [128, 64].into_iter().flat_map(|d| both(4, 16, s[0], d)))
            .collect();
    }
    if cfg.quick {
        return [128, 64]
            .into_iter()
            .flat_map(|d| both(1, 8, 1024, d))
            .collect();
    }
    // Representative: B4 H16 S4096 D128, not causal: the README's and docs' headline case (the
    // naive rung takes ~0.6 s per call there, a few seconds in all).
    if cfg.representative {
        return both(4, 16, 4096, 128)[..1].to_vec();
    }
    let mut v = Vec::new();
    for s in [1024, 4096, 16384] {
        for d in [128, 64] {
            v.extend(both(4, 16, s, d));
        }
    }
    v.extend(both(1, 16, 8192, 128));
    v
}

pub fn cpu_shapes(cfg: &BenchConfig) -> Vec<Shape> {
    if !cfg.shapes.is_empty() {
        return cfg
            .shapes
            .iter()
            .flat_map(|s| both(1, 4, s[0], 64))
            .collect();
    }
    // Representative: B1 H4 S512 D64 not causal (the first), the one CPU shape's forward.
    cfg.scope(&both(1, 4, if cfg.quick { 256 } else { 512 }, 64))
        .to_vec()
}

pub fn run(
    cfg: &BenchConfig,
    ceilings: &Ceilings,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    for &d in &cfg.devices {
        match d {
            Device::Cpu => bench_cpu(cfg, ceilings, progress, out)?,
            Device::Cuda(i) => bench_gpu(cfg, &device(i)?, ceilings, progress, out)?,
        }
    }
    Ok(())
}

/// Padded Bshd inputs and outputs of one shape: q, k, v, o, lse, dout, dq, dk, dv.
struct Set {
    t: Vec<Tensor>,
}

impl Set {
    fn new(s: &Shape, dtype: DType, dev: Device) -> Result<Set> {
        let shape = [s.b, s.s, s.h, s.d];
        let r = |seed| Tensor::rand(&shape, dtype, dev, seed, -1.0, 1.0);
        let e = || Tensor::empty(&shape, dtype, dev);
        Ok(Set {
            t: vec![
                r(1)?,
                r(2)?,
                r(3)?,
                e()?,
                Tensor::empty(&[s.b, s.h, s.s], DType::F32, dev)?,
                r(4)?,
                e()?,
                e()?,
                e()?,
            ],
        })
    }
    fn bytes(&self) -> u64 {
        self.t.iter().map(|t| t.nbytes() as u64).sum()
    }
    fn forward(&self, opts: &AttentionOptions) -> Result<()> {
        let t = &self.t;
        attention_forward_into(&t[0], &t[1], &t[2], &t[3], &t[4], None, opts)
    }
    fn backward(&self, opts: &AttentionOptions) -> Result<()> {
        let t = &self.t;
        attention_backward_into(
            &t[5], &t[0], &t[1], &t[2], &t[3], &t[4], &t[6], &t[7], &t[8], None, opts,
        )
    }
}

fn bench_cpu(
    cfg: &BenchConfig,
    ceilings: &Ceilings,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    if !cfg.wants_dtype(DType::F32) {
        return Ok(());
    }
    let name = crate::core::harness::cpu_name();
    let ceiling = ceilings
        .cpu_peer_gflops
        .map(|v| ("CPU peer GEMM (all threads)", v, true));
    for s in cpu_shapes(cfg) {
        let set = Set::new(&s, DType::F32, Device::Cpu)?;
        // Representative: the forward alone.
        for &backward in cfg.scope(&[false, true]) {
            let dir = if backward { "bwd" } else { "fwd" };
            let mut group = Vec::new();
            for v in variants()
                .iter()
                .filter(|v| v.backend == Backend::Cpu && cfg.wants_variant(v.name))
            {
                progress(&format!("attention cpu {} {} {dir}", v.name, s.label()));
                let opts = AttentionOptions {
                    variant: Some(v.name.into()),
                    causal: s.causal,
                    ..Default::default()
                };
                // The backward reads the forward's o and lse.
                set.forward(&opts)?;
                let st = time_cpu_op(Budget::cpu(), || {
                    if backward {
                        set.backward(&opts)
                    } else {
                        set.forward(&opts)
                    }
                })?;
                let f = s.flops_forward() * if backward { 2.5 } else { 1.0 };
                let mut rec = BenchRecord::new(
                    Device::Cpu,
                    &name,
                    OP,
                    v.name,
                    DType::F32,
                    format!("{} {dir}", s.label()),
                    st,
                    f,
                    0.0,
                );
                rec.config = cpu_threads_note(v.name == "tiled");
                group.push(rec);
            }
            relate(&mut group, "naive", ceiling);
            out.extend(group);
        }
    }
    Ok(())
}

/// Peak pool bytes one call needs: inputs and outputs (`resident`) plus what the call allocates
/// on top of what was in use before it.
fn peak_of(dev: &CudaDevice, resident: u64, f: impl FnOnce() -> Result<()>) -> Result<u64> {
    let stream = dev.stream().clone();
    dev.synchronize(&stream, "attention bench: before the memory probe")?;
    let (before, _) = dev.pool_usage()?;
    dev.reset_pool_peak()?;
    f()?;
    dev.synchronize(&stream, "attention bench: memory probe")?;
    let (_, high) = dev.pool_usage()?;
    Ok(resident + high.saturating_sub(before))
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
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
    for dtype in [DType::BF16, DType::F16, DType::F32]
        .into_iter()
        .filter(|t| cfg.wants_dtype(*t))
        // Default run: bf16 only (the dtype the targets are stated in).
        .filter(|t| !cfg.dtypes.is_empty() || *t == DType::BF16)
    {
        let ceiling = ceilings
            .gpu_gemm(dtype.name())
            .map(|v| ("cuBLAS GEMM", v, true));
        for s in gpu_shapes(cfg) {
            let set = Set::new(&s, dtype, d)?;
            // Representative: the forward alone.
            for &backward in cfg.scope(&[false, true]) {
                let dir = if backward { "bwd" } else { "fwd" };
                let (mut group, mut skipped) = (Vec::new(), Vec::new());
                // (variant, row name, deterministic): flash's backward in both modes.
                let runs: Vec<(&str, &str, bool)> = variants()
                    .iter()
                    .filter(|v| v.backend == Backend::Cuda && cfg.wants_variant(v.name))
                    .flat_map(|v| {
                        let det = (backward && v.name == "flash").then_some((
                            v.name,
                            "flash (deterministic)",
                            true,
                        ));
                        std::iter::once((v.name, v.name, false)).chain(det)
                    })
                    .collect();
                for (vname, row, deterministic) in runs {
                    let label = format!("{} {dir}", s.label());
                    let workspaces = if backward { 2 } else { 1 };
                    if vname == "naive" && s.score_bytes() * workspaces > NAIVE_WORKSPACE_CAP {
                        let mut rec = BenchRecord::new(
                            d,
                            &name,
                            OP,
                            row,
                            dtype,
                            label,
                            Stats::default(),
                            0.0,
                            0.0,
                        );
                        rec.note = format!(
                            "skipped: needs {} of f32 score workspace (cap {})",
                            gib(s.score_bytes() * workspaces),
                            gib(NAIVE_WORKSPACE_CAP)
                        );
                        skipped.push(rec);
                        continue;
                    }
                    progress(&format!("attention {d} {row} {dtype} {label}"));
                    let opts = AttentionOptions {
                        variant: Some(vname.into()),
                        causal: s.causal,
                        stream: Some(stream.clone()),
                        deterministic,
                        ..Default::default()
                    };
                    set.forward(&opts)?;
                    let call = || {
                        if backward {
                            set.backward(&opts)
                        } else {
                            set.forward(&opts)
                        }
                    };
                    let peak = peak_of(dev, set.bytes(), call)?;
                    // The naive variant takes seconds per call at S4096: fewer repeats.
                    let budget = if vname == "naive" {
                        Budget {
                            warmup: 1,
                            min_reps: 3,
                            max_reps: 20,
                            ..Budget::gpu()
                        }
                    } else {
                        Budget::gpu()
                    };
                    let st = time_gpu(dev, &stream, budget, |_| call())?;
                    let f = s.flops_forward() * if backward { 2.5 } else { 1.0 };
                    let mut rec = BenchRecord::new(d, &name, OP, row, dtype, label, st, f, 0.0);
                    if backward && vname == "flash" {
                        rec.config = super::flash::BwdMode::of(deterministic, s.d).describe();
                    }
                    if backward && vname == "hopper" {
                        rec.config =
                            "wgmma: 128 keys × 64-query steps, 2 consumer warpgroups".into();
                    }
                    rec.peak_device_bytes = Some(peak);
                    rec.note = format!("peak memory {}", gib(peak));
                    group.push(rec);
                }
                relate(&mut group, "naive", ceiling);
                out.extend(group);
                out.extend(skipped);
            }
        }
    }
    Ok(())
}
