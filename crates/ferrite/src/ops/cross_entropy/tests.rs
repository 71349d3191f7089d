//! cross_entropy tests: the check harness on every device present, torch semantics, bad input.

use super::check::target_tensor;
use super::*;

#[test]
fn every_variant_passes_check() {
    // CPU: 2 variants × 3 dtypes × cases + 2 bad-target records.
    crate::core::harness::check::assert_quick_check_passes(
        check::run,
        2 * 3 * check::cases(true).len() + 2,
    );
}

fn cpu_case(n: usize, v: usize, t: &[i64]) -> (Tensor, Tensor, Tensor, Tensor) {
    let x = Tensor::rand(&[n, v], DType::F32, Device::Cpu, 3, -3.0, 3.0).unwrap();
    let tg = target_tensor(t, DType::I64, Device::Cpu).unwrap();
    let lr = Tensor::empty(&[n], DType::F32, Device::Cpu).unwrap();
    let l = Tensor::empty(&[1], DType::F32, Device::Cpu).unwrap();
    (x, tg, lr, l)
}

#[test]
fn torch_semantics() {
    // Uniform logits: loss = log V for every non-ignored row, whatever the smoothing.
    let v = 10;
    let x = Tensor::full(&[3, v], DType::F32, Device::Cpu, 0.25).unwrap();
    let t = target_tensor(&[2, -100, 9], DType::I64, Device::Cpu).unwrap();
    let opts = CrossEntropyOptions {
        label_smoothing: 0.3,
        ..Default::default()
    };
    let (lr, l, g) = cross_entropy(&x, &t, &opts).unwrap();
    let lr = lr.to_vec::<f32>().unwrap();
    let want = (v as f32).ln();
    assert!((lr[0] - want).abs() < 1e-6 && lr[1] == 0.0 && (lr[2] - want).abs() < 1e-6);
    // Mean over the 2 non-ignored rows, not 3.
    assert!((l.to_vec::<f32>().unwrap()[0] - want).abs() < 1e-6);
    let g = g.to_vec::<f32>().unwrap();
    // Ignored row: zero gradient; each row's gradient sums to 0.
    assert!(g[v..2 * v].iter().all(|&a| a == 0.0));
    let s: f32 = g[..v].iter().sum();
    assert!(s.abs() < 1e-6, "{s}");
    // dx = (1/V − (1−ε)[j=t] − ε/V) / 2 at the target.
    assert!((g[2] - (0.1 - 0.7 - 0.03) / 2.0).abs() < 1e-6, "{}", g[2]);

    // Every row ignored with mean: NaN loss (0/0, as torch), zero gradient.
    let t = target_tensor(&[-100, -100, -100], DType::I64, Device::Cpu).unwrap();
    let (_, l, g) = cross_entropy(&x, &t, &CrossEntropyOptions::default()).unwrap();
    assert!(l.to_vec::<f32>().unwrap()[0].is_nan());
    assert!(g.to_vec::<f32>().unwrap().iter().all(|&a| a == 0.0));

    // In place equals into a separate buffer; i32 targets equal i64.
    let (x, tg, lr, l) = cpu_case(4, 33, &[0, 32, 5, 7]);
    let opts = CrossEntropyOptions {
        reduction: Reduction::Sum,
        dloss: 0.7,
        ..Default::default()
    };
    let g = Tensor::empty(&[4, 33], DType::F32, Device::Cpu).unwrap();
    cross_entropy_into(&x, &tg, &lr, Some(&l), GradOut::Into(&g), &opts).unwrap();
    let t32 = target_tensor(&[0, 32, 5, 7], DType::I32, Device::Cpu).unwrap();
    let lr2 = Tensor::empty(&[4], DType::F32, Device::Cpu).unwrap();
    cross_entropy_into(&x, &t32, &lr2, None, GradOut::InPlace, &opts).unwrap();
    assert_eq!(g.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
    assert_eq!(lr.to_vec::<f32>().unwrap(), lr2.to_vec::<f32>().unwrap());
}

#[test]
fn bad_input_is_refused() {
    let (x, tg, lr, l) = cpu_case(3, 5, &[0, 1, 4]);
    let run = |x: &Tensor,
               tg: &Tensor,
               lr: &Tensor,
               l: Option<&Tensor>,
               g: GradOut,
               o: &CrossEntropyOptions| {
        cross_entropy_into(x, tg, lr, l, g, o)
            .unwrap_err()
            .to_string()
    };
    let d = CrossEntropyOptions::default();
    // Targets out of range: named row and value.
    for (bad, want) in [(5i64, "targets[1] = 5"), (-1, "targets[1] = -1")] {
        let t = target_tensor(&[0, bad, 4], DType::I64, Device::Cpu).unwrap();
        let e = run(&x, &t, &lr, Some(&l), GradOut::Skip, &d);
        assert!(e.contains(want) && e.contains("[0, 5)"), "{e}");
    }
    // Label smoothing outside [0, 1), non-finite dloss.
    for ls in [-0.1f32, 1.0, f32::NAN] {
        let o = CrossEntropyOptions {
            label_smoothing: ls,
            ..Default::default()
        };
        let e = run(&x, &tg, &lr, None, GradOut::Skip, &o);
        assert!(e.contains("label_smoothing"), "{e}");
    }
    let o = CrossEntropyOptions {
        dloss: f32::INFINITY,
        ..Default::default()
    };
    assert!(run(&x, &tg, &lr, None, GradOut::Skip, &o).contains("dloss"));
    // Shapes and dtypes.
    let t4 = target_tensor(&[0, 1, 2, 3], DType::I64, Device::Cpu).unwrap();
    let e = run(&x, &t4, &lr, None, GradOut::Skip, &d);
    assert!(e.contains("`targets`") && e.contains("[4]"), "{e}");
    let tf = Tensor::full(&[3], DType::F32, Device::Cpu, 1.0).unwrap();
    assert!(run(&x, &tf, &lr, None, GradOut::Skip, &d).contains("i64 or i32"));
    let x1 = Tensor::rand(&[15], DType::F32, Device::Cpu, 1, -1.0, 1.0).unwrap();
    assert!(run(&x1, &tg, &lr, None, GradOut::Skip, &d).contains("`logits`"));
    assert!(run(&x.t().unwrap(), &tg, &lr, None, GradOut::Skip, &d).contains("`logits`"));
    let lr_bad = Tensor::empty(&[4], DType::F32, Device::Cpu).unwrap();
    assert!(run(&x, &tg, &lr_bad, None, GradOut::Skip, &d).contains("`loss_rows`"));
    let l_bad = Tensor::empty(&[2], DType::F32, Device::Cpu).unwrap();
    assert!(run(&x, &tg, &lr, Some(&l_bad), GradOut::Skip, &d).contains("`loss`"));
    let g_bad = Tensor::empty(&[3, 5], DType::BF16, Device::Cpu).unwrap();
    assert!(run(&x, &tg, &lr, None, GradOut::Into(&g_bad), &d).contains("`dlogits`"));
    // Aliasing: the gradient into the logits must say so (InPlace), not pass as Into.
    let e = run(&x, &tg, &lr, None, GradOut::Into(&x), &d);
    assert!(e.contains("InPlace"), "{e}");
    let e = run(
        &x,
        &tg,
        &lr,
        Some(&lr.narrow(0, 2, 1).unwrap()),
        GradOut::Skip,
        &d,
    );
    assert!(e.contains("distinct"), "{e}");
    // Unknown variant.
    let o = CrossEntropyOptions {
        variant: Some("fused".into()),
        ..Default::default()
    };
    assert!(run(&x, &tg, &lr, None, GradOut::Skip, &o).contains("cuda"));
}

#[test]
fn resident_keeps_whole_rows_when_they_fit() {
    // H100: 228 KiB of shared memory per SM, 227 KiB per block, 2048 threads per SM.
    let h100 = |threads, full| cuda::resident_shape(threads, 2048, 233_472, 232_448, full);
    // V = 50257 bf16 (6282 vectors): two 1024-thread blocks per SM, each holding its whole row.
    assert_eq!(h100(1024, 50257 / 8), (2, 6282));
    // V = 128256 bf16 (16032 vectors, 251 KiB): one block per SM keeping 226.75 KiB of it.
    assert_eq!(h100(1024, 128_256 / 8), (1, 14_512));
    // V = 50257 f32 (201 KiB): one block per SM, the whole row.
    assert_eq!(h100(1024, 50257 / 4), (1, 12_564));
    // Short rows: as many blocks as the threads allow; tiny vocabularies keep nothing.
    assert_eq!(h100(512, 4099 / 8), (4, 512));
    assert_eq!(h100(32, 0), (64, 0));
    // Every choice fits the SM: blocks × (kept bytes + 1.25 KiB) ≤ 228 KiB.
    for full in [1, 100, 6282, 7216, 7217, 14_512, 16_032, 100_000] {
        for threads in [32, 256, 512, 1024] {
            let (b, cap) = h100(threads, full);
            assert!(
                b * (cap * 16 + 1280) <= 233_472,
                "{threads} threads, {full} vectors"
            );
            assert!(cap <= full && cap * 16 + 256 <= 232_448);
        }
    }
}

#[test]
fn cluster_shapes_fit_the_sm_and_the_rule_prefers_three_rows_per_sm() {
    // H100: 228 KiB of shared memory per SM, 227 KiB per block; the kernel's bound, 1280 threads.
    let h100 = |c, full| cuda::cluster_shape(c, cuda::CLUSTER_SM_THREADS, 233_472, 232_448, full);
    // V = 50257 bf16 (6282 vectors): pairs of blocks, four half rows per SM.
    let g = h100(2, 50257 / 8).unwrap();
    assert_eq!((g.per, g.blocks_per_sm, g.threads), (3141, 4, 320));
    // V = 128256 bf16 (16032 vectors): halves fit one per SM, quarters 3, eighths 6.
    let by = |c| h100(c, 128_256 / 8).unwrap().blocks_per_sm;
    assert_eq!((by(2), by(4), by(8)), (1, 3, 6));
    let pick = |full| {
        cuda::pick_cluster(cuda::CLUSTERS.iter().filter_map(|&c| h100(c, full)))
            .unwrap()
            .cluster
    };
    assert_eq!(pick(50257 / 8), 2);
    assert_eq!(pick(128_256 / 8), 4);
    // f32 V = 128256 (501 KiB rows): halves do not fit a block; quarters do.
    assert!(h100(2, 128_256 / 4).is_none());
    assert!(h100(4, 128_256 / 4).is_some());
    // A share that fits nowhere: a clear error, not a launch failure.
    assert!(cuda::pick_cluster(std::iter::empty()).is_err());
    for full in [0, 1, 100, 6282, 16_032, 32_064, 100_000] {
        for c in cuda::CLUSTERS {
            if let Some(g) = h100(c, full) {
                assert!(g.per * c >= full && g.smem as usize == g.per * 16);
                assert!(
                    g.blocks_per_sm * (g.per * 16 + 1536) <= 233_472,
                    "{c} {full}"
                );
                assert!(g.blocks_per_sm * g.threads as usize <= 1280);
                assert!(g.threads as usize <= cuda::CLUSTER_BLOCK_THREADS && g.threads % 32 == 0);
            }
        }
    }
}

#[test]
fn cluster_size_is_checked() {
    let x = Tensor::rand(&[2, 5], DType::F32, Device::Cpu, 1, -1.0, 1.0).unwrap();
    let tg =
        crate::ops::cross_entropy::check::target_tensor(&[1, 2], DType::I64, Device::Cpu).unwrap();
    let lr = Tensor::empty(&[2], DType::F32, Device::Cpu).unwrap();
    let o = CrossEntropyOptions {
        cluster: Some(3),
        ..Default::default()
    };
    let e = cross_entropy_into(&x, &tg, &lr, None, GradOut::Skip, &o)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cluster") && e.contains('3'), "{e}");
}

#[test]
fn scale_grad_folds_dloss_in_place_on_every_device() {
    for dev in crate::core::harness::check::devices_present() {
        for dtype in [DType::F32, DType::BF16] {
            // 37 columns: not a whole number of 16-byte vectors (the scalar loop); 64: vectorized.
            for cols in [37, 64] {
                let g = Tensor::rand(&[5, cols], dtype, dev, 3, -1.0, 1.0).unwrap();
                let before = g.to_f64_vec().unwrap();
                let scalar = |v: f64| Tensor::full(&[1], dtype, dev, v).unwrap();
                // dloss = 1: untouched (on the GPU: the kernel returns at once).
                scale_grad_in_place(&g, &scalar(1.0), None).unwrap();
                assert_eq!(g.to_f64_vec().unwrap(), before);
                scale_grad_in_place(&g, &scalar(-0.25), None).unwrap();
                for (a, b) in g.to_f64_vec().unwrap().iter().zip(&before) {
                    assert_eq!(*a, -0.25 * b, "{dev} {dtype} {cols}");
                }
                // One per row (reduction "none").
                let rows = Tensor::rand(&[5], dtype, dev, 9, 0.5, 2.0).unwrap();
                let r = rows.to_f64_vec().unwrap();
                let mid = g.to_f64_vec().unwrap();
                scale_grad_in_place(&g, &rows, None).unwrap();
                let got = g.to_f64_vec().unwrap();
                for (i, (a, b)) in got.iter().zip(&mid).enumerate() {
                    let want = b * r[i / cols];
                    assert!(
                        (a - want).abs() <= want.abs() * 8e-3,
                        "{dev} {dtype} {i}: {a} vs {want}"
                    );
                }
            }
        }
    }
    // Rows further apart than their length (dlogits in padded rows): the GPU scales the row's
    // elements and leaves the padding as it was; the CPU asks for a contiguous tensor.
    for dev in crate::core::harness::check::devices_present() {
        for (cols, ld) in [(37, 44), (32, 40)] {
            let base = Tensor::rand(&[5, ld], DType::BF16, dev, 4, -1.0, 1.0).unwrap();
            let before = base.to_f64_vec().unwrap();
            let g = base.narrow(1, 0, cols).unwrap();
            let s = Tensor::full(&[1], DType::BF16, dev, -0.5).unwrap();
            if !dev.is_cuda() {
                let e = scale_grad_in_place(&g, &s, None).unwrap_err().to_string();
                assert!(e.contains("`grad`") && e.contains("contiguous"), "{e}");
                continue;
            }
            scale_grad_in_place(&g, &s, None).unwrap();
            for (i, (a, b)) in base.to_f64_vec().unwrap().iter().zip(&before).enumerate() {
                let want = if i % ld < cols { -0.5 * b } else { *b };
                assert_eq!(*a, want, "{cols}/{ld} element {i}");
            }
        }
    }
    let g = Tensor::rand(&[5, 4], DType::F32, Device::Cpu, 3, -1.0, 1.0).unwrap();
    let bad = Tensor::full(&[4], DType::F32, Device::Cpu, 1.0).unwrap();
    let e = scale_grad_in_place(&g, &bad, None).unwrap_err().to_string();
    assert!(e.contains("`dloss`") && e.contains("[5]"), "{e}");
    let half = Tensor::full(&[1], DType::BF16, Device::Cpu, 1.0).unwrap();
    let e = scale_grad_in_place(&g, &half, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`dloss`") && e.contains("f32"), "{e}");
}
