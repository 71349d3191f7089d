//! `ferrite bench matmul --sweep`: the default path (what `matmul_into` / `linear` run when no
//! variant is named) against both vendor libraries over a grid of shapes a model meets — decode
//! (M = 1…64), prefill and training (M up to 8192), square, odd (4097) and vocabulary-wide (50257,
//! 128256) — so that "matmul at every shape" is one number per cell, not a claim about the
//! benched ones.
//!
//! Every cell is the NT layout of a linear layer (A = X `[m, k]` row-major, B = W stored
//! `[n, k]`), timed in alternating rounds of the same call: `default` (the whole host path of
//! the op: selection, the tuner's remembered pick, planning, the launch), any variants named with
//! `--variant` (planned once, as the ladder bench times them), `cublas` and `cublaslt`. Each
//! record's `ratio_to_peer` is against the faster of the two vendor peers in that cell.

use super::bench::{gemm_record, gpu_sets, set_ptrs};
use super::cuda as mm_cuda;
use super::{validate, MatmulOptions};
use crate::core::cuda::CudaDevice;
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::Result;
use crate::core::harness::bench::{time_gpu_alternating_boxed, BenchRecord, Budget};
use crate::core::harness::{BenchConfig, Precision};
use crate::core::tensor::Tensor;
use std::sync::Arc;
use std::time::Duration;

/// Rows of A (tokens): decode batches, small and mid prefills, an odd size, a training batch.
pub const SWEEP_M: [usize; 10] = [1, 8, 16, 64, 128, 256, 1000, 2048, 4097, 8192];

/// (N, K) of B: GPT-2's 768², Llama-3-8B's projections (4096², 14336×4096 up, 4096×14336
/// down), the odd 4097² (rows TMA cannot address), GPT-2's and Llama-3's vocabulary heads.
pub const SWEEP_NK: [(usize, usize); 7] = [
    (768, 768),
    (4096, 4096),
    (4097, 4097),
    (14336, 4096),
    (4096, 14336),
    (50257, 768),
    (128256, 4096),
];

/// Calls queued back to back to measure a path's host time per call.
const HOST_CALLS: usize = 50;

/// The row of the default path in the sweep's records (as in `check matmul`).
pub const DEFAULT_ROW: &str = super::check::DEFAULT_PATH;

/// A cell's timing budget: 140 cells (two dtypes) × 3–4 timed launches must fit one GPU call, so
/// each gets a fifth of the ladder bench's target, still ≥ 10 repeats after warm-up.
fn sweep_budget() -> Budget {
    Budget {
        warmup: 3,
        min_reps: 10,
        max_reps: 100,
        target: Duration::from_millis(160),
    }
}

/// The sweep's cells in run order: (dtype, m, n, k). `--size`/`--m --n --k` shapes replace the
/// grid (each [m, n, k], a single number a cube).
fn cells(cfg: &BenchConfig) -> Vec<(DType, [usize; 3])> {
    let grid: Vec<[usize; 3]> = if cfg.shapes.is_empty() {
        SWEEP_NK
            .iter()
            .flat_map(|&(n, k)| SWEEP_M.iter().map(move |&m| [m, n, k]))
            .collect()
    } else {
        cfg.shapes
            .iter()
            .map(|s| match s.as_slice() {
                [m, n, k, ..] => [*m, *n, *k],
                [x, ..] => [*x; 3],
                [] => [1; 3],
            })
            .collect()
    };
    [DType::BF16, DType::F16]
        .into_iter()
        .filter(|d| cfg.wants_dtype(*d))
        .flat_map(|d| grid.iter().map(move |&s| (d, s)))
        .collect()
}

pub fn run(
    cfg: &BenchConfig,
    dev: &Arc<CudaDevice>,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    let stream = dev.stream().clone();
    let name = dev.props().name.clone();
    let d = Device::Cuda(dev.ordinal());
    let all = cells(cfg);
    // B's random values on the host, kept while (dtype, n, k) stays: the grid walks M inside each
    // (N, K), and a 128256×4096 weight takes seconds to draw.
    let mut host_b: Option<((DType, usize, usize), Tensor)> = None;
    for (i, &(dtype, shape)) in all.iter().enumerate() {
        let label = dtype.name();
        let prec = Precision::of(dtype);
        let [_, n, k] = shape;
        if host_b.as_ref().is_none_or(|(key, _)| *key != (dtype, n, k)) {
            drop(host_b.take()); // the previous one freed before the next is drawn
            host_b = Some((
                (dtype, n, k),
                Tensor::rand(&[n, k], dtype, Device::Cpu, 12, -1.0, 1.0)?,
            ));
        }
        let b = &host_b.as_ref().expect("drawn above").1;
        let sets = gpu_sets(dev, dtype, shape, Some(b))?;
        let g = validate(&sets[0].0, &sets[0].1, &sets[0].2)?;
        let ptrs = set_ptrs(&sets)?;
        progress(&format!(
            "matmul sweep {}/{} {label} {}",
            i + 1,
            all.len(),
            g.label()
        ));
        let opts = MatmulOptions {
            stream: Some(stream.clone()),
            ..Default::default()
        };
        // What the default path runs here (selecting, and racing `skinny` against `wgmma` for a
        // short A at the shape class's first use).
        let chosen = mm_cuda::default_variant(&g, ptrs[0], &opts)?;
        // Named variants, planned once (the tuned `wgmma` configuration, as the ladder bench).
        let mut plans = Vec::new();
        for v in cfg.variants.iter().filter(|v| v.as_str() != DEFAULT_ROW) {
            let declines = match v.as_str() {
                "skinny" => mm_cuda::skinny_declines(&g),
                "wgmma" => mm_cuda::wgmma_declines(&g),
                "mma" | "mma_pipelined" => None,
                _ => Some("not a tensor-core variant".into()),
            };
            if declines.is_some() {
                continue;
            }
            let l = if v == "wgmma" {
                let c = mm_cuda::wg_tuned(&g, ptrs[0], dev, &stream)?;
                mm_cuda::plan_with(v, &g, dev, c)?
            } else {
                mm_cuda::plan(v, &g, dev)?
            };
            plans.push((v.clone(), l));
        }
        let lt = mm_cuda::LtPlan::new(dev, &g, prec, &stream).ok();
        let n = ptrs.len();
        let (g_, ptrs_, stream_, opts_) = (&g, &ptrs, &stream, &opts);
        let mut fs: Vec<Box<dyn FnMut(usize) -> Result<()> + '_>> = Vec::new();
        fs.push(Box::new(move |i: usize| {
            mm_cuda::gemm_ptrs(g_, ptrs_[i % n], opts_)
        }));
        for (_, l) in &plans {
            fs.push(Box::new(move |i: usize| {
                mm_cuda::launch(l, g_, ptrs_[i % n], 1.0, 0.0, stream_)
            }));
        }
        fs.push(Box::new(move |i: usize| {
            mm_cuda::cublas(dev, g_, ptrs_[i % n], 1.0, 0.0, prec, stream_)
        }));
        if let Some(plan) = &lt {
            fs.push(Box::new(move |i: usize| plan.run(ptrs_[i % n], 1.0, 0.0)));
        }
        let stats = time_gpu_alternating_boxed(dev, &stream, sweep_budget(), 3, &mut fs)?;
        // Host time per call of the default path and of cuBLAS: calls queued back to back
        // without waiting (the launch queue does not fill in 50), so the wall time is the host's.
        let host_us = |f: &mut Box<dyn FnMut(usize) -> Result<()> + '_>| -> Result<f64> {
            dev.synchronize(&stream, "sweep host timing")?;
            let t = std::time::Instant::now();
            for i in 0..HOST_CALLS {
                f(i)?;
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / HOST_CALLS as f64;
            dev.synchronize(&stream, "sweep host timing")?;
            Ok(us)
        };
        let host_default = host_us(&mut fs[0])?;
        let host_cublas = host_us(&mut fs[1 + plans.len()])?;
        drop(fs);
        let mut stats = stats.into_iter();
        let mut rec = |variant: &str, is_peer: bool, config: String| {
            let stats = stats.next().expect("one Stats per closure");
            let mut r = gemm_record((d, &name), variant, (dtype, label), &g, stats);
            r.is_peer = is_peer;
            r.config = config;
            r
        };
        let mut group = vec![rec(
            DEFAULT_ROW,
            false,
            format!(
                "runs `{chosen}` (the default path's pick); host {host_default:.1} µs/call (cuBLAS {host_cublas:.1})"
            ),
        )];
        for (v, l) in &plans {
            group.push(rec(v, false, l.config.clone()));
        }
        group.push(rec("cublas", true, "cublasGemmStridedBatchedEx".into()));
        if let Some(plan) = &lt {
            group.push(rec("cublaslt", true, plan.config.clone()));
        }
        relate_to_best_peer(&mut group);
        out.extend(group);
    }
    Ok(())
}

/// Sets every record's `ratio_to_peer` against the faster peer of the group (lowest median).
pub fn relate_to_best_peer(group: &mut [BenchRecord]) {
    let best = group
        .iter()
        .filter(|r| r.is_peer && r.median_ms > 0.0)
        .min_by(|a, b| a.median_ms.total_cmp(&b.median_ms))
        .map(|r| (r.median_ms, r.variant.clone()));
    if let Some((t, peer)) = best {
        for r in group.iter_mut() {
            r.ratio_to_peer = Some(t / r.median_ms);
            r.peer = peer.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_covers_issue_shapes_and_odd_sizes() {
        let cfg = BenchConfig {
            sweep: true,
            ..Default::default()
        };
        let c = cells(&cfg);
        assert_eq!(c.len(), 2 * SWEEP_M.len() * SWEEP_NK.len());
        assert!(c.contains(&(DType::BF16, [4097, 4097, 4097])));
        assert!(c.contains(&(DType::F16, [1, 128256, 4096])));
        let one = BenchConfig {
            sweep: true,
            dtypes: vec![DType::F16],
            shapes: vec![vec![7, 9, 11], vec![5]],
            ..Default::default()
        };
        assert_eq!(
            cells(&one),
            vec![(DType::F16, [7, 9, 11]), (DType::F16, [5, 5, 5])]
        );
    }

    #[test]
    fn ratios_are_to_the_faster_peer() {
        let r = |v: &str, ms: f64, peer: bool| BenchRecord {
            variant: v.into(),
            median_ms: ms,
            is_peer: peer,
            ..Default::default()
        };
        let mut g = vec![
            r(DEFAULT_ROW, 2.0, false),
            r("cublas", 3.0, true),
            r("cublaslt", 1.0, true),
        ];
        relate_to_best_peer(&mut g);
        assert_eq!(g[0].ratio_to_peer, Some(0.5));
        assert_eq!(g[0].peer, "cublaslt");
        assert_eq!(g[1].ratio_to_peer, Some(1.0 / 3.0));
    }
}
