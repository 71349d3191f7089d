//! Expert parallelism against the one-process layer: ranks as threads of one test, each routing
//! its own (ragged) tokens; a rank's output, dx and router gradient equal the one-process layer's
//! on its tokens, and a rank's expert weight gradients equal the sum over every rank's tokens.

use super::*;
use crate::dist::tests::ranks;
use crate::ops::moe::{moe_backward, moe_forward};
use std::time::Duration;

/// One rank's results: out, dx, d_router, dw_up, dw_down.
type Got = [Vec<f32>; 5];

struct Case {
    world: usize,
    tokens: Vec<usize>,
    hidden: usize,
    inter: usize,
    cfg: MoeConfig,
    dtype: DType,
}

fn tensors(c: &Case, rank: usize, dev: Device) -> (Tensor, Tensor, [Tensor; 3]) {
    let (h, i, e, dt) = (c.hidden, c.inter, c.cfg.experts, c.dtype);
    let r = |shape: &[usize], seed: u64, s: f64| {
        Tensor::rand(shape, dt, Device::Cpu, seed, -s, s)
            .unwrap()
            .to_device(dev)
            .unwrap()
    };
    let t = c.tokens[rank];
    (
        r(&[t, h], 100 + rank as u64, 1.0),
        r(&[t, h], 200 + rank as u64, 1.0),
        [
            r(&[e, h], 1, 1.0),
            r(&[e, h, 2 * i], 2, 0.3),
            r(&[e, i, h], 3, 0.3),
        ],
    )
}

fn run_ep(c: Case, gpu: bool) {
    let c = std::sync::Arc::new(c);
    let cc = c.clone();
    let got: Vec<Result<Got>> = ranks(c.world, Duration::from_secs(60), move |pg| {
        let c = &*cc;
        let mut pg = pg?;
        let r = pg.rank();
        let dev = if gpu { Device::Cuda(r) } else { Device::Cpu };
        pg.attach(dev)?;
        let ep = ExpertParallel::new(&pg, &c.cfg, c.hidden, c.inter, c.dtype, dev)?;
        let (x, dout, [router, wu, wd]) = tensors(c, r, dev);
        let mine = ep.experts();
        let (wu, wd) = (
            wu.narrow(0, mine.start, mine.len())?.contiguous()?,
            wd.narrow(0, mine.start, mine.len())?.contiguous()?,
        );
        let w = MoeWeights {
            router: &router,
            w_up: &wu,
            w_down: &wd,
        };
        let o = MoeOptions::default();
        let f = ep.forward(&x, &w, &o)?;
        let g = ep.backward(&dout, &x, &w, &f, None, &o)?;
        Ok([
            f.routing.out.to_f32_vec()?,
            g.dx.to_f32_vec()?,
            g.d_router.to_f32_vec()?,
            g.dw_up.to_f32_vec()?,
            g.dw_down.to_f32_vec()?,
        ])
    });
    // The one-process layer on each rank's tokens (on that rank's device).
    let el = c.cfg.experts / c.world;
    let mut sum_up = Vec::<f64>::new();
    let mut sum_down = Vec::<f64>::new();
    let mut refs = Vec::new();
    for r in 0..c.world {
        let dev = if gpu { Device::Cuda(r) } else { Device::Cpu };
        let (x, dout, [router, wu, wd]) = tensors(&c, r, dev);
        let w = MoeWeights {
            router: &router,
            w_up: &wu,
            w_down: &wd,
        };
        let o = MoeOptions::default();
        let f = moe_forward(&x, &w, &c.cfg, &o).unwrap();
        let g = moe_backward(&dout, &x, &w, &f, &c.cfg, &o).unwrap();
        let (u, d) = (
            g.dw_up.to_f32_vec().unwrap(),
            g.dw_down.to_f32_vec().unwrap(),
        );
        if sum_up.is_empty() {
            sum_up = vec![0.0; u.len()];
            sum_down = vec![0.0; d.len()];
        }
        sum_up.iter_mut().zip(&u).for_each(|(s, v)| *s += *v as f64);
        sum_down
            .iter_mut()
            .zip(&d)
            .for_each(|(s, v)| *s += *v as f64);
        refs.push([
            f.out.to_f32_vec().unwrap(),
            g.dx.to_f32_vec().unwrap(),
            g.d_router.to_f32_vec().unwrap(),
        ]);
    }
    let tol = if c.dtype == DType::F32 { 2e-4 } else { 3e-2 };
    let close = |what: &str, r: usize, a: &[f32], b: &[f64]| {
        assert_eq!(a.len(), b.len(), "rank {r} {what}: length");
        let scale = b.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
        for (j, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                x.is_finite() && ((*x as f64) - y).abs() <= tol * scale,
                "rank {r} {what}[{j}]: {x} vs {y} (scale {scale})"
            );
        }
    };
    for (r, g) in got.into_iter().enumerate() {
        let g = g.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        for (n, name) in ["out", "dx", "d_router"].iter().enumerate() {
            let want: Vec<f64> = refs[r][n].iter().map(|&v| v as f64).collect();
            close(name, r, &g[n], &want);
        }
        let nu = sum_up.len() / c.cfg.experts;
        let nd = sum_down.len() / c.cfg.experts;
        close("dw_up", r, &g[3], &sum_up[r * el * nu..(r + 1) * el * nu]);
        close(
            "dw_down",
            r,
            &g[4],
            &sum_down[r * el * nd..(r + 1) * el * nd],
        );
    }
}

#[test]
fn cpu_ranks_match_the_one_process_layer() {
    // Ragged tokens, odd dims, losses on: two ranks of four experts each.
    run_ep(
        Case {
            world: 2,
            tokens: vec![37, 50],
            hidden: 24,
            inter: 20,
            cfg: MoeConfig {
                aux_loss_coef: 0.01,
                z_loss_coef: 0.001,
                ..MoeConfig::new(8, 3)
            },
            dtype: DType::F32,
        },
        false,
    );
}

#[test]
fn cpu_ranks_with_capacity_sigmoid_groups_and_bf16() {
    // Three ranks, DeepSeek-style routing, a capacity that drops pairs, bf16 values.
    run_ep(
        Case {
            world: 3,
            tokens: vec![29, 64, 1],
            hidden: 16,
            inter: 12,
            cfg: MoeConfig {
                score: crate::ops::moe::Score::Sigmoid,
                groups: 3,
                topk_groups: 2,
                routed_scale: 2.5,
                capacity_factor: Some(0.75),
                ..MoeConfig::new(6, 2)
            },
            dtype: DType::BF16,
        },
        false,
    );
}

#[test]
fn experts_must_divide_over_the_ranks_and_settings_must_agree() {
    let out = ranks(2, Duration::from_secs(20), |pg| {
        let pg = pg.unwrap();
        let bad = ExpertParallel::new(&pg, &MoeConfig::new(5, 2), 8, 8, DType::F32, Device::Cpu)
            .unwrap_err()
            .to_string();
        // rank 1 asks for another hidden size: both ranks fail, naming the disagreement
        let h = 8 + pg.rank();
        let differ = ExpertParallel::new(&pg, &MoeConfig::new(4, 2), h, 8, DType::F32, Device::Cpu)
            .unwrap_err()
            .to_string();
        (bad, differ)
    });
    for (bad, differ) in out {
        assert!(
            bad.contains("experts") && bad.contains("world size 2"),
            "{bad}"
        );
        assert!(
            differ.contains("disagree") && differ.contains("H9"),
            "{differ}"
        );
    }
}

#[test]
#[ignore = "needs two CUDA GPUs and NCCL (libnccl.so on the loader's path)"]
fn gpu_ranks_match_the_one_gpu_layer_on_two_gpus() {
    let gpus = crate::core::cuda::availability().unwrap_or(0);
    assert!(gpus >= 2, "needs two GPUs, {gpus} visible");
    for (dtype, hidden, inter) in [(DType::BF16, 256, 192), (DType::F32, 40, 24)] {
        run_ep(
            Case {
                world: 2,
                tokens: vec![300, 517],
                hidden,
                inter,
                cfg: MoeConfig {
                    aux_loss_coef: 0.01,
                    ..MoeConfig::new(8, 2)
                },
                dtype,
            },
            true,
        );
    }
}

#[test]
fn cpu_ranks_with_one_expert_each_and_experts_left_empty() {
    // One expert per rank, then three tokens over eight experts (experts that receive no rows:
    // their gradients must come out zero).
    for (tokens, experts, k) in [(vec![5, 9], 2, 1), (vec![1, 2], 8, 1)] {
        run_ep(
            Case {
                world: 2,
                tokens,
                hidden: 8,
                inter: 6,
                cfg: MoeConfig::new(experts, k),
                dtype: DType::F32,
            },
            false,
        );
    }
}

/// The gather kernel of the bookkeeping (gate weights to rows, gate gradients to pairs) against
/// its CPU twin, with skipped (negative) indices, on one GPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gather_f32_matches_the_cpu() {
    let dev = crate::core::cuda::device(0).unwrap();
    let c = cuda::Ctx::on(dev.clone(), dev.stream().clone(), DType::F32);
    let vals: Vec<f32> = (0..300).map(|i| (i as f32 * 0.37).sin()).collect();
    let idx: Vec<i32> = (0..1037)
        .map(|i| if i % 7 == 3 { -1 } else { i * 13 % 300 })
        .collect();
    let d = Device::Cuda(0);
    let out = c
        .gather_f32(
            &Tensor::from_vec(vals.clone(), &[300])
                .unwrap()
                .to_device(d)
                .unwrap(),
            &Tensor::from_vec(idx.clone(), &[1037])
                .unwrap()
                .to_device(d)
                .unwrap(),
        )
        .unwrap();
    assert_eq!(out.to_f32_vec().unwrap(), cpu::gather_f32(&vals, &idx));
}
