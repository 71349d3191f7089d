//! linear tests (CPU, in CI): the check harness, the backward's determinism, QKV views, strided
//! inputs, and every bad input.

use super::*;

fn t(s: &[usize], seed: u64) -> Tensor {
    Tensor::rand(s, DType::F32, Device::Cpu, seed, -1.0, 1.0).unwrap()
}

fn opts(variant: &str, act: Activation) -> LinearOptions {
    LinearOptions {
        variant: Some(variant.into()),
        activation: act,
        ..Default::default()
    }
}

#[test]
fn every_variant_passes_check() {
    // CPU: 2 variants × 3 dtypes × every case, each several records.
    let recs = crate::core::harness::check::assert_quick_check_passes(
        check::run,
        2 * 3 * check::cases(true).len() * 4,
    );
    assert!(recs.iter().any(|r| r.shape.contains("db,dW bits twice")));
    assert!(recs.iter().any(|r| r.shape.contains("gelu_erf+b+res+Z Z")));
    assert!(recs.iter().any(|r| r.shape.contains("dX⊙silu'(Z_in)")));
    assert!(recs
        .iter()
        .any(|r| r.shape.contains("db_pre = Σ rows dZ_in")));
}

/// `x_pre`: dx receives the plain dX times act'(Z_in), element by element (in f32 the same bits
/// as multiplying afterwards), on both CPU variants; and a mis-shaped Z_in is refused by name.
#[test]
fn cpu_x_pre_multiplies_dx_by_the_input_activation_backward() {
    let (m, n, k) = (37, 11, 23);
    let (x, w, dy) = (t(&[m, k], 1), t(&[n, k], 2), t(&[m, n], 3));
    let z_in = Tensor::rand(&[m, k], DType::F32, Device::Cpu, 4, -3.0, 3.0).unwrap();
    let act = Activation::GeluTanh;
    for variant in ["naive", "parallel"] {
        let run = |x_pre| {
            let dx = Tensor::empty(&[m, k], DType::F32, Device::Cpu).unwrap();
            dx.poison(None).unwrap();
            backward_into(
                &Bwd {
                    dy: &dy,
                    x: &x,
                    w: &w,
                    z: None,
                    x_pre,
                },
                &BwdOut {
                    dx: Some(&dx),
                    dw: None,
                    db: None,
                    db_pre: None,
                },
                &opts(variant, Activation::None),
            )
            .unwrap();
            dx.to_f32_vec().unwrap()
        };
        let plain = run(None);
        let pre = run(Some((&z_in, act)));
        let zv = z_in.to_f32_vec().unwrap();
        for e in 0..m * k {
            assert_eq!(pre[e], plain[e] * act.grad(zv[e]), "{variant} element {e}");
        }
        assert!(pre.iter().all(|v| v.is_finite()));
    }
    let dx = Tensor::empty(&[m, k], DType::F32, Device::Cpu).unwrap();
    let e = backward_into(
        &Bwd {
            dy: &dy,
            x: &x,
            w: &w,
            z: None,
            x_pre: Some((&t(&[m, k + 1], 5), act)),
        },
        &BwdOut {
            dx: Some(&dx),
            dw: None,
            db: None,
            db_pre: None,
        },
        &opts("naive", Activation::None),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("`x_pre`") && e.contains(&format!("[{m}, {k}]")),
        "{e}"
    );
}

/// `db_pre`: the column sums of the dZ_in that dx receives (the layer below's bias gradient), on
/// both CPU variants; refused without `x_pre` or `dx`, or in the wrong shape, by name.
#[test]
fn cpu_db_pre_sums_the_rows_of_dx_and_is_refused_alone() {
    let (m, n, k) = (41, 13, 27);
    let (x, w, dy) = (t(&[m, k], 1), t(&[n, k], 2), t(&[m, n], 3));
    let z_in = Tensor::rand(&[m, k], DType::F32, Device::Cpu, 4, -3.0, 3.0).unwrap();
    let act = Activation::Silu;
    let call = |variant: &str, x_pre, dx: Option<&Tensor>, dbp: &Tensor| {
        backward_into(
            &Bwd {
                dy: &dy,
                x: &x,
                w: &w,
                z: None,
                x_pre,
            },
            &BwdOut {
                dx,
                dw: None,
                db: None,
                db_pre: Some(dbp),
            },
            &opts(variant, Activation::None),
        )
    };
    for variant in ["naive", "parallel"] {
        let dx = Tensor::empty(&[m, k], DType::F32, Device::Cpu).unwrap();
        let dbp = Tensor::empty(&[k], DType::F32, Device::Cpu).unwrap();
        dx.poison(None).unwrap();
        dbp.poison(None).unwrap();
        call(variant, Some((&z_in, act)), Some(&dx), &dbp).unwrap();
        let (d, got) = (dx.to_f32_vec().unwrap(), dbp.to_f32_vec().unwrap());
        for (c, &g) in got.iter().enumerate() {
            let want: f64 = (0..m).map(|r| d[r * k + c] as f64).sum();
            let scale: f64 = (0..m).map(|r| (d[r * k + c] as f64).abs()).sum();
            assert!(
                (g as f64 - want).abs() <= 1e-5 * scale.max(1e-30),
                "{variant} column {c}: {g} vs {want}"
            );
        }
    }
    let dx = Tensor::empty(&[m, k], DType::F32, Device::Cpu).unwrap();
    let dbp = Tensor::empty(&[k], DType::F32, Device::Cpu).unwrap();
    let e = call("naive", None, Some(&dx), &dbp)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`db_pre`") && e.contains("x_pre None"), "{e}");
    let e = call("naive", Some((&z_in, act)), None, &dbp)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`db_pre`") && e.contains("dx None"), "{e}");
    let wrong = Tensor::empty(&[n], DType::F32, Device::Cpu).unwrap();
    let e = call("naive", Some((&z_in, act)), Some(&dx), &wrong)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`db_pre`") && e.contains(&format!("[{k}]")),
        "{e}"
    );
}

/// db and dW bits: the same across runs, thread counts and the two CPU variants (fixed chunks).
#[test]
fn cpu_backward_is_deterministic() {
    let (m, n, k) = (1000, 37, 19);
    let (x, w, dy) = (t(&[m, k], 1), t(&[n, k], 2), t(&[m, n], 3));
    let z = Tensor::rand(&[m, n], DType::F32, Device::Cpu, 4, -3.0, 3.0).unwrap();
    let run = |variant: &str, threads: usize| {
        let (dx, dw, db) = (
            Tensor::empty(&[m, k], DType::F32, Device::Cpu).unwrap(),
            Tensor::empty(&[n, k], DType::F32, Device::Cpu).unwrap(),
            Tensor::empty(&[n], DType::F32, Device::Cpu).unwrap(),
        );
        let o = LinearOptions {
            threads,
            ..opts(variant, Activation::Silu)
        };
        backward_into(
            &Bwd {
                dy: &dy,
                x: &x,
                w: &w,
                z: Some(&z),
                x_pre: None,
            },
            &BwdOut {
                dx: Some(&dx),
                dw: Some(&dw),
                db: Some(&db),
                db_pre: None,
            },
            &o,
        )
        .unwrap();
        (db.to_bytes().unwrap(), dw.to_bytes().unwrap())
    };
    let first = run("parallel", 0);
    assert!(run("parallel", 0) == first);
    assert!(
        run("parallel", 1).0 == first.0,
        "db depends on the thread count"
    );
    assert!(
        run("naive", 0).0 == first.0,
        "db differs between naive and parallel"
    );
}

#[test]
fn qkv_returns_views_of_one_gemm() {
    let (heads, hd, k) = (2, 4, 8);
    let x = t(&[2, 3, k], 1);
    let w = t(&[3 * heads * hd, k], 2);
    let b = t(&[3 * heads * hd], 3);
    let (q, kk, v) = linear_qkv(&x, &w, Some(&b), heads, hd, &LinearOptions::default()).unwrap();
    assert_eq!(q.shape(), &[2, 3, heads, hd]);
    assert!(
        q.shares_storage(&kk) && kk.shares_storage(&v),
        "q, k, v must be views of one buffer"
    );
    assert_eq!(
        q.strides(),
        &[72, 24, 4, 1][..],
        "token strides of the [2, 3, 3, 2, 4] buffer"
    );
    let full = linear(&x, &w, Some(&b)).unwrap().to_f32_vec().unwrap();
    for (s, view) in [(0, &q), (1, &kk), (2, &v)] {
        let got = view.to_f32_vec().unwrap();
        for tok in 0..6 {
            for e in 0..heads * hd {
                assert_eq!(
                    got[tok * heads * hd + e],
                    full[tok * 3 * heads * hd + s * heads * hd + e]
                );
            }
        }
    }
}

#[test]
fn row_strided_x_and_residual_match_contiguous() {
    let (m, n, k) = (9, 6, 5);
    let wide = t(&[m, k + 3], 1);
    let x = wide.narrow(1, 1, k).unwrap();
    let xc = x.contiguous().unwrap();
    let w = t(&[n, k], 2);
    let rwide = t(&[m, n + 2], 3);
    let r = rwide.narrow(1, 2, n).unwrap();
    let rc = r.contiguous().unwrap();
    for variant in ["naive", "parallel"] {
        let run = |x: &Tensor, r: &Tensor| {
            let y = Tensor::empty(&[m, n], DType::F32, Device::Cpu).unwrap();
            forward_into(
                &Fwd {
                    x,
                    w: &w,
                    bias: None,
                    residual: Some(r),
                },
                &FwdOut { y: &y, z: None },
                &opts(variant, Activation::Relu),
            )
            .unwrap();
            y.to_bytes().unwrap()
        };
        assert!(run(&x, &r) == run(&xc, &rc), "{variant}");
    }
}

#[test]
fn bad_inputs_get_clear_errors() {
    let (x, w, b) = (t(&[4, 8], 1), t(&[6, 8], 2), t(&[6], 3));
    let y = Tensor::empty(&[4, 6], DType::F32, Device::Cpu).unwrap();
    let fwd = |x: &Tensor,
               w: &Tensor,
               b: Option<&Tensor>,
               r: Option<&Tensor>,
               y: &Tensor,
               z: Option<&Tensor>| {
        forward_into(
            &Fwd {
                x,
                w,
                bias: b,
                residual: r,
            },
            &FwdOut { y, z },
            &LinearOptions::default(),
        )
        .unwrap_err()
        .to_string()
    };
    let e = fwd(&x, &t(&[6, 7], 2), None, None, &y, None);
    assert!(e.contains("`w`") && e.contains("[out, 8]"), "{e}");
    let e = fwd(&x, &w, Some(&t(&[7], 3)), None, &y, None);
    assert!(e.contains("bias") && e.contains("[6]"), "{e}");
    let e = fwd(&x, &w, Some(&b), Some(&t(&[4, 5], 4)), &y, None);
    assert!(e.contains("residual"), "{e}");
    let e = fwd(&x, &w, None, None, &t(&[4, 5], 4), None);
    assert!(e.contains("`y`") && e.contains("[4, 6]"), "{e}");
    let e = fwd(&x, &w, None, None, &y, Some(&t(&[4, 7], 5)));
    assert!(e.contains("`z`"), "{e}");
    // dtype combinations: W bf16 with X f32; integer X.
    let wb = Tensor::rand(&[6, 8], DType::BF16, Device::Cpu, 2, -1.0, 1.0).unwrap();
    let e = fwd(&x, &wb, None, None, &y, None);
    assert!(e.contains("`w`") && e.contains("f32"), "{e}");
    let xi = Tensor::full(&[4, 8], DType::I32, Device::Cpu, 1.0).unwrap();
    let e = fwd(&xi, &w, None, None, &y, None);
    assert!(e.contains("`x`") && e.contains("f32/f16/bf16"), "{e}");
    let yb = Tensor::empty(&[4, 6], DType::BF16, Device::Cpu).unwrap();
    let e = fwd(&x, &w, None, None, &yb, None);
    assert!(e.contains("`y`"), "{e}");
    // W must be [out, in] with stride 1 in its last dim: a transposed view is refused.
    let wt = t(&[8, 6], 6).t().unwrap();
    let e = fwd(&x, &wt, None, None, &y, None);
    assert!(e.contains("stride 1"), "{e}");
    // Y aliasing an input; Z aliasing Y.
    let e = fwd(&x, &w, None, Some(&y), &y, None);
    assert!(e.contains("distinct"), "{e}");
    let e = fwd(&x, &w, None, None, &y, Some(&y));
    assert!(e.contains("distinct"), "{e}");
    // Backward: dY shape, missing Z for an activation, dW / db shapes.
    let bwd = |dy: &Tensor, z: Option<&Tensor>, o: BwdOut, act: Activation| {
        backward_into(
            &Bwd {
                dy,
                x: &x,
                w: &w,
                z,
                x_pre: None,
            },
            &o,
            &opts("naive", act),
        )
        .unwrap_err()
        .to_string()
    };
    let none = BwdOut {
        dx: None,
        dw: None,
        db: None,
        db_pre: None,
    };
    let e = bwd(&t(&[4, 5], 7), None, none, Activation::None);
    assert!(e.contains("`dy`") && e.contains("[4, 6]"), "{e}");
    let e = bwd(&t(&[4, 6], 7), None, none, Activation::GeluErf);
    assert!(e.contains("`z`") && e.contains("gelu_erf"), "{e}");
    let dy = t(&[4, 6], 7);
    let e = bwd(
        &dy,
        None,
        BwdOut {
            dx: None,
            dw: Some(&t(&[8, 6], 8)),
            db: None,
            db_pre: None,
        },
        Activation::None,
    );
    assert!(e.contains("`dw`") && e.contains("[6, 8]"), "{e}");
    let e = bwd(
        &dy,
        None,
        BwdOut {
            dx: None,
            dw: None,
            db: Some(&t(&[4], 8)),
            db_pre: None,
        },
        Activation::None,
    );
    assert!(e.contains("`db`"), "{e}");
    let e = bwd(
        &dy,
        None,
        BwdOut {
            dx: Some(&t(&[4, 6], 8)),
            dw: None,
            db: None,
            db_pre: None,
        },
        Activation::None,
    );
    assert!(e.contains("`dx`") && e.contains("[4, 8]"), "{e}");
    // QKV: W rows must be 3·heads·head_dim.
    let e = linear_qkv(&x, &w, None, 2, 2, &LinearOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("3·2·2"), "{e}");
    // A CUDA-only variant on the CPU.
    let e = linear_with(&x, &w, None, &opts("persistent", Activation::None))
        .unwrap_err()
        .to_string();
    assert!(e.contains("persistent"), "{e}");
}

#[test]
fn k_zero_gives_act_of_bias() {
    let x = Tensor::empty(&[3, 0], DType::F32, Device::Cpu).unwrap();
    let w = Tensor::empty(&[4, 0], DType::F32, Device::Cpu).unwrap();
    let b = t(&[4], 1);
    for variant in ["naive", "parallel"] {
        let y = linear_with(&x, &w, Some(&b), &opts(variant, Activation::Silu)).unwrap();
        let bv = b.to_f32_vec().unwrap();
        let want: Vec<f32> = (0..12).map(|e| Activation::Silu.apply(bv[e % 4])).collect();
        assert_eq!(y.to_f32_vec().unwrap(), want, "{variant}");
    }
}

#[test]
fn dw_split_k_fills_the_sms_where_the_output_is_small() {
    use super::cuda::dw_split;
    // GPT-2 124M, 16384 tokens, 132 SMs: proj 768×768 (18 tiles) → 4 slices; fc 3072×768 and
    // fcproj 768×3072 (72 tiles) → 8; qkv 2304×768 (54) → 2; the classifier's 50304×768 → none.
    assert_eq!(dw_split(768, 768, 16384, 132), 4);
    assert_eq!(dw_split(3072, 768, 16384, 132), 8);
    assert_eq!(dw_split(768, 3072, 16384, 132), 8);
    assert_eq!(dw_split(2304, 768, 16384, 132), 2);
    assert_eq!(dw_split(50304, 768, 16384, 132), 1);
    // Slices keep ≥ 1024 rows and a multiple of 64: few or odd rows never split.
    assert_eq!(dw_split(768, 768, 2048, 132), 2);
    assert_eq!(dw_split(768, 768, 1000, 132), 1);
    assert_eq!(dw_split(768, 768, 16383, 132), 1);
}

/// The ReLU epilogue keeps a NaN (as torch's F.relu(F.linear(...))).
#[test]
fn relu_epilogue_propagates_nan() {
    let x = Tensor::from_vec(vec![f32::NAN, 1.0, 1.0, -1.0], &[2, 2]).unwrap();
    let w = Tensor::from_vec(vec![1.0f32, 0.0, 0.0, 1.0], &[2, 2]).unwrap();
    let y = linear_with(
        &x,
        &w,
        None,
        &LinearOptions {
            activation: Activation::Relu,
            ..Default::default()
        },
    )
    .unwrap()
    .to_vec::<f32>()
    .unwrap();
    // row 0 = [NaN, 1]·I: both outputs NaN (NaN·0 is NaN); row 1 = relu([1, -1])
    assert!(y[0].is_nan() && y[1].is_nan(), "{y:?}");
    assert_eq!(&y[2..], &[1.0, 0.0]);
}

#[test]
fn linear_keeps_its_layout_on_degenerate_shapes() {
    // W [n, k] with k = 1 (and k = 0) reads as row-major; linear asks for its column-major B.
    for (n, k) in [(1, 1), (5, 1), (7, 0), (1, 9), (6, 4)] {
        let x = Tensor::rand(&[3, k], DType::F32, Device::Cpu, 1, -1.0, 1.0).unwrap();
        let w = Tensor::rand(&[n, k], DType::F32, Device::Cpu, 2, -1.0, 1.0).unwrap();
        let y = Tensor::empty(&[3, n], DType::F32, Device::Cpu).unwrap();
        let i = Fwd {
            x: &x,
            w: &w,
            bias: None,
            residual: None,
        };
        let g = gemm_of(&i, &y).unwrap();
        assert!(g.b.trans && !g.a.trans, "n {n} k {k}: {g:?}");
    }
}
