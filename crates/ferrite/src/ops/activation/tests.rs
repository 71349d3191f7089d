//! activation tests: the check harness on every device present, semantics, and bad input.

use super::*;
use crate::core::philox;

fn t(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand(shape, DType::F32, Device::Cpu, seed, -2.0, 2.0).unwrap()
}

#[test]
fn every_variant_passes_check() {
    let recs = crate::core::harness::check::assert_quick_check_passes(check::run, 2 * 3 * 16);
    assert!(recs
        .iter()
        .any(|r| r.shape.starts_with("dropout mask") && r.pass));
}

#[test]
fn erf_matches_known_values() {
    for (x, want) in [
        (0.0, 0.0),
        (0.5, 0.520_499_877_813_046_5),
        (1.0, 0.842_700_792_949_714_9),
        (2.0, 0.995_322_265_018_952_7),
        (-2.5, -0.999_593_047_982_555),
        (3.0, 0.999_977_909_503_001_4),
        (4.0, 1.0 - 1.541_725_790_028_002e-8),
        (7.0, 1.0),
    ] {
        assert!(
            (cpu::erf(x) - want).abs() < 1e-13,
            "erf({x}) = {}",
            cpu::erf(x)
        );
    }
    // The two branches agree where they meet.
    let below = cpu::erf(2.999_999_999);
    let above = cpu::erf(3.000_000_001);
    assert!((above - below).abs() < 1e-12);
    assert!(cpu::erf(f64::NAN).is_nan());
}

#[test]
fn derivatives_match_finite_differences() {
    for act in Activation::ALL {
        for &h in &[-2.7f64, -0.4, 0.3, 1.9] {
            let (_, d) = check::act_ref(act, h);
            let e = 1e-6;
            let fd = (check::act_ref(act, h + e).0 - check::act_ref(act, h - e).0) / (2.0 * e);
            assert!((d - fd).abs() < 1e-6, "{} at {h}: {d} vs {fd}", act.name());
            let (a32, d32) = cpu::act_fg(act, h as f32);
            assert!((a32 as f64 - check::act_ref(act, h).0).abs() < 1e-6);
            assert!((d32 as f64 - d).abs() < 1e-6);
        }
        // Saturated inputs: no inf/NaN from the exponentials.
        for h in [-100.0f32, -30.0, 30.0, 100.0] {
            let (a, d) = cpu::act_fg(act, h);
            assert!(a.is_finite() && d.is_finite(), "{} at {h}", act.name());
        }
    }
}

#[test]
fn semantics() {
    let x = t(&[6, 40], 1);
    let b = t(&[40], 2);
    let (xv, bv) = (x.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    // relu + bias, no dropout.
    let y = bias_act_dropout(
        &x,
        Some(&b),
        &ActOptions {
            act: Activation::Relu,
            ..Default::default()
        },
    )
    .unwrap()
    .to_vec::<f32>()
    .unwrap();
    for i in 0..240 {
        assert_eq!(y[i], (xv[i] + bv[i % 40]).max(0.0));
    }
    // Dropout: kept elements are scaled by 1/(1−p), the pattern is philox's, and another offset
    // gives another mask.
    let opts = |offset| ActOptions {
        dropout: Dropout {
            p: 0.5,
            seed: 42,
            offset,
        },
        ..Default::default()
    };
    let y0 = bias_act_dropout(&x, None, &opts(0))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let y1 = bias_act_dropout(&x, None, &opts(philox::blocks_used(240)))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_ne!(y0, y1);
    for i in 0..240 {
        let keep = philox::keep(42, 0, i as u64, philox::keep_threshold(0.5));
        assert_eq!(y0[i], if keep { 2.0 * xv[i] } else { 0.0 }, "element {i}");
    }
    // Naive and parallel give the same bits, forward and backward, db included.
    let dy = t(&[6, 40], 3);
    let run = |v: &str| {
        let o = ActOptions {
            variant: Some(v.into()),
            act: Activation::GeluErf,
            dropout: Dropout {
                p: 0.1,
                seed: 7,
                offset: 3,
            },
            ..Default::default()
        };
        let y = Tensor::empty(&[6, 40], DType::F32, Device::Cpu).unwrap();
        let dx = Tensor::empty(&[6, 40], DType::F32, Device::Cpu).unwrap();
        let db = Tensor::empty(&[40], DType::F32, Device::Cpu).unwrap();
        bias_act_dropout_into(&x, Some(&b), &y, &o).unwrap();
        bias_act_dropout_backward_into(&dy, &x, Some(&b), &dx, Some(&db), &o).unwrap();
        (
            y.to_bytes().unwrap(),
            dx.to_bytes().unwrap(),
            db.to_bytes().unwrap(),
        )
    };
    assert!(run("naive") == run("parallel"));
    // GLU: gate is the first half.
    let inp = t(&[3, 10], 4);
    let iv = inp.to_vec::<f32>().unwrap();
    let o = swiglu(&inp).unwrap();
    assert_eq!(o.shape(), &[3, 5]);
    let ov = o.to_vec::<f32>().unwrap();
    for r in 0..3 {
        for j in 0..5 {
            let (g, u) = (iv[r * 10 + j], iv[r * 10 + 5 + j]);
            assert_eq!(ov[r * 5 + j], cpu::act_fg(Activation::Silu, g).0 * u);
        }
    }
    assert_eq!(geglu(&inp).unwrap().shape(), &[3, 5]);
}

#[test]
fn dropout_keeps_one_minus_p() {
    // Over 2²⁰ elements, and separately over the elements drawing low and high 16-bit halves
    // (each half of a word is its own uniform draw).
    let n = 1u64 << 20;
    for p in [0.1f32, 0.5, 0.9] {
        let thr = philox::keep_threshold(p);
        let q = thr as f64 / 65_536.0;
        assert!(q <= 1.0 - p as f64 && 1.0 - p as f64 - q < 1.0 / 65_536.0);
        for (parity, count) in [(None, n), (Some(0), n / 2), (Some(1), n / 2)] {
            let kept = (0..n)
                .filter(|&i| parity.is_none_or(|par| i % 2 == par))
                .filter(|&i| philox::keep(99, 1234, i, thr))
                .count() as f64
                / count as f64;
            let sigma = (q * (1.0 - q) / count as f64).sqrt();
            assert!(
                (kept - q).abs() < 5.0 * sigma,
                "p={p} parity {parity:?}: kept {kept}"
            );
        }
    }
}

#[test]
fn bad_inputs_get_clear_errors() {
    let x = t(&[4, 8], 1);
    let err = |r: Result<Tensor>| r.unwrap_err().to_string();
    for p in [-0.1f32, 1.0, 1.5, f32::NAN] {
        let e = err(bias_act_dropout(
            &x,
            None,
            &ActOptions {
                dropout: Dropout {
                    p,
                    ..Default::default()
                },
                ..Default::default()
            },
        ));
        assert!(e.contains("dropout.p") && e.contains("[0, 1)"), "{e}");
    }
    let e = err(bias_act_dropout(
        &x,
        Some(&t(&[7], 2)),
        &ActOptions::default(),
    ));
    assert!(
        e.contains("`bias`") && e.contains("[8]") && e.contains("[7]"),
        "{e}"
    );
    let bf = Tensor::rand(&[8], DType::BF16, Device::Cpu, 1, 0.0, 1.0).unwrap();
    let e = err(bias_act_dropout(&x, Some(&bf), &ActOptions::default()));
    assert!(e.contains("`bias`") && e.contains("bf16"), "{e}");
    let e = err(bias_act_dropout(
        &x.t().unwrap(),
        None,
        &ActOptions::default(),
    ));
    assert!(e.contains("contiguous"), "{e}");
    let i = Tensor::from_vec(vec![1i32; 4], &[2, 2]).unwrap();
    assert!(err(bias_act_dropout(&i, None, &ActOptions::default())).contains("f32/f16/bf16"));
    // Outputs: shape, dtype, aliasing.
    let wrong = Tensor::empty(&[4, 9], DType::F32, Device::Cpu).unwrap();
    let e = bias_act_dropout_into(&x, None, &wrong, &ActOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`y`") && e.contains("[4, 9]"), "{e}");
    let e = bias_act_dropout_into(&x, None, &x, &ActOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("distinct"), "{e}");
    // Backward: dy shape, dbias without bias, dbias shape.
    let dx = Tensor::empty(&[4, 8], DType::F32, Device::Cpu).unwrap();
    let e =
        bias_act_dropout_backward_into(&t(&[4, 7], 3), &x, None, &dx, None, &ActOptions::default())
            .unwrap_err()
            .to_string();
    assert!(e.contains("`dy`"), "{e}");
    let db = Tensor::empty(&[8], DType::F32, Device::Cpu).unwrap();
    let e = bias_act_dropout_backward_into(
        &t(&[4, 8], 3),
        &x,
        None,
        &dx,
        Some(&db),
        &ActOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("dbias"), "{e}");
    let b = t(&[8], 5);
    let db9 = Tensor::empty(&[9], DType::F32, Device::Cpu).unwrap();
    let e = bias_act_dropout_backward_into(
        &t(&[4, 8], 3),
        &x,
        Some(&b),
        &dx,
        Some(&db9),
        &ActOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`dbias`") && e.contains("[9]"), "{e}");
    // GLU: odd last dim, wrong output, wrong dout, dtype mismatch.
    let e = err(swiglu(&t(&[3, 7], 1)));
    assert!(e.contains("even last dim"), "{e}");
    let inp = t(&[3, 8], 1);
    let o = Tensor::empty(&[3, 8], DType::F32, Device::Cpu).unwrap();
    let e = glu_into(&inp, &o, &GluOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`out`") && e.contains("[3, 4]"), "{e}");
    let din = Tensor::empty(&[3, 8], DType::F32, Device::Cpu).unwrap();
    let e = glu_backward_into(&t(&[3, 8], 2), &inp, &din, &GluOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`dout`") && e.contains("[3, 4]"), "{e}");
    let d16 = Tensor::rand(&[3, 4], DType::F16, Device::Cpu, 1, 0.0, 1.0).unwrap();
    let e = glu_backward_into(&d16, &inp, &din, &GluOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`dout`") && e.contains("f16"), "{e}");
    // Unknown variant and activation names.
    let e = bias_act_dropout(
        &x,
        None,
        &ActOptions {
            variant: Some("fused".into()),
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("fused"), "{e}");
    let e = Activation::parse_arg(OP, "act", "gelu")
        .unwrap_err()
        .to_string();
    assert!(e.contains("gelu_tanh") && e.contains("`act`"), "{e}");
    assert_eq!(Activation::parse("silu"), Some(Activation::Silu));
}

#[test]
fn empty_rows_are_fine() {
    let x = Tensor::empty(&[0, 8], DType::F32, Device::Cpu).unwrap();
    let b = t(&[8], 1);
    let dx = Tensor::empty(&[0, 8], DType::F32, Device::Cpu).unwrap();
    let db = Tensor::full(&[8], DType::F32, Device::Cpu, 5.0).unwrap();
    bias_act_dropout_backward_into(&x, &x, Some(&b), &dx, Some(&db), &ActOptions::default())
        .unwrap();
    assert!(db.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.0));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_backward_is_deterministic_and_matches_the_cpu_mask() {
    let d = Device::Cuda(0);
    let (rows, cols) = (3000, 1024);
    let x = Tensor::rand(&[rows, cols], DType::BF16, d, 1, -2.0, 2.0).unwrap();
    let dy = Tensor::rand(&[rows, cols], DType::BF16, d, 2, -1.0, 1.0).unwrap();
    let b = Tensor::rand(&[cols], DType::BF16, d, 3, -1.0, 1.0).unwrap();
    let opts = ActOptions {
        act: Activation::GeluTanh,
        dropout: Dropout {
            p: 0.25,
            seed: 11,
            offset: 5,
        },
        ..Default::default()
    };
    let run = || {
        let dx = Tensor::empty(&[rows, cols], DType::BF16, d).unwrap();
        let db = Tensor::empty(&[cols], DType::BF16, d).unwrap();
        bias_act_dropout_backward_into(&dy, &x, Some(&b), &dx, Some(&db), &opts).unwrap();
        (dx.to_bytes().unwrap(), db.to_bytes().unwrap())
    };
    let first = run();
    for _ in 0..3 {
        assert!(run() == first, "backward bits changed between runs");
    }
    // The GPU forward's zeros are exactly the CPU forward's zeros.
    let zeros =
        |t: Tensor| -> Vec<bool> { t.to_f64_vec().unwrap().iter().map(|&v| v == 0.0).collect() };
    let gpu = zeros(bias_act_dropout(&x, Some(&b), &opts).unwrap());
    let (xc, bc) = (
        x.to_device(Device::Cpu).unwrap(),
        b.to_device(Device::Cpu).unwrap(),
    );
    let cpu = zeros(bias_act_dropout(&xc, Some(&bc), &opts).unwrap());
    assert!(gpu == cpu, "GPU and CPU dropout masks differ");
}

/// ReLU keeps a NaN (as torch): a diverging run must not look healthy.
#[test]
fn relu_propagates_nan() {
    let x = Tensor::from_vec(vec![1.0f32, f32::NAN, -2.0, 0.5], &[1, 4]).unwrap();
    let y = bias_act_dropout(
        &x,
        None,
        &ActOptions {
            act: Activation::Relu,
            ..Default::default()
        },
    )
    .unwrap()
    .to_vec::<f32>()
    .unwrap();
    assert_eq!(y[0], 1.0);
    assert!(y[1].is_nan(), "{y:?}");
    assert_eq!((y[2], y[3]), (0.0, 0.5));
}
