//! norm tests: the check harness on every device present, determinism, and every bad input.

use super::*;

#[test]
fn every_variant_passes_check() {
    crate::core::harness::check::assert_quick_check_passes(
        check::run,
        2 * 3 * check::cases(true).len(),
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_backward_is_deterministic() {
    let d = Device::Cuda(0);
    let (rows, cols) = (3000, 1024);
    let x = Tensor::rand(&[rows, cols], DType::BF16, d, 1, -1.0, 1.0).unwrap();
    let dy = Tensor::rand(&[rows, cols], DType::BF16, d, 2, -1.0, 1.0).unwrap();
    let w = Tensor::rand(&[cols], DType::BF16, d, 3, 0.5, 1.5).unwrap();
    let (_, rstd) = rms_norm(&x, Some(&w), 1e-5).unwrap();
    let run = || {
        let dx = Tensor::empty(&[rows, cols], DType::BF16, d).unwrap();
        let dw = Tensor::empty(&[cols], DType::BF16, d).unwrap();
        backward_into(
            NormKind::Rms,
            &Bwd {
                dy: &dy,
                x: &x,
                weight: Some(&w),
                mean: None,
                rstd: &rstd,
            },
            &BwdOut {
                dx: &dx,
                dweight: Some(&dw),
                dbias: None,
            },
            &NormOptions::default(),
        )
        .unwrap();
        (dx.to_bytes().unwrap(), dw.to_bytes().unwrap())
    };
    let first = run();
    for _ in 0..3 {
        assert!(run() == first, "backward bits changed between runs");
    }
}

#[test]
fn bad_inputs_get_clear_errors() {
    let t = |s: &[usize]| Tensor::rand(s, DType::F32, Device::Cpu, 1, -1.0, 1.0).unwrap();
    let x = t(&[4, 8]);
    let e = rms_norm(&x, None, 0.0).unwrap_err().to_string();
    assert!(e.contains("eps") && e.contains("> 0"), "{e}");
    let e = rms_norm(&x, None, -1.0).unwrap_err().to_string();
    assert!(e.contains("eps"), "{e}");
    let e = rms_norm(&x, Some(&t(&[7])), 1e-5).unwrap_err().to_string();
    assert!(
        e.contains("`weight`") && e.contains("[8]") && e.contains("[7]"),
        "{e}"
    );
    let e = layer_norm(
        &x,
        None,
        Some(&Tensor::rand(&[8], DType::BF16, Device::Cpu, 1, 0.0, 1.0).unwrap()),
        1e-5,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`bias`") && e.contains("bf16"), "{e}");
    let e = rms_norm(&x.t().unwrap(), None, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(e.contains("contiguous"), "{e}");
    let i = Tensor::from_vec(vec![1i32; 4], &[2, 2]).unwrap();
    assert!(rms_norm(&i, None, 1e-5)
        .unwrap_err()
        .to_string()
        .contains("f32/f16/bf16"));
    let e = rms_norm(&t(&[3, 0]), None, 1e-5).unwrap_err().to_string();
    assert!(e.contains("last dim"), "{e}");
    // RMSNorm has no bias; backward of LayerNorm needs the mean.
    let y = Tensor::empty(&[4, 8], DType::F32, Device::Cpu).unwrap();
    let e = forward_into(
        NormKind::Rms,
        &Fwd {
            x: &x,
            residual: None,
            weight: None,
            bias: Some(&t(&[8])),
        },
        &FwdOut {
            y: &y,
            h: None,
            mean: None,
            rstd: None,
        },
        &NormOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("RMSNorm has no bias"), "{e}");
    let rstd = t(&[4]);
    let e = backward_into(
        NormKind::Layer,
        &Bwd {
            dy: &x,
            x: &t(&[4, 8]),
            weight: None,
            mean: None,
            rstd: &rstd,
        },
        &BwdOut {
            dx: &y,
            dweight: None,
            dbias: None,
        },
        &NormOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`mean`"), "{e}");
    // Output aliasing an input.
    let e = forward_into(
        NormKind::Rms,
        &Fwd {
            x: &x,
            residual: None,
            weight: None,
            bias: None,
        },
        &FwdOut {
            y: &x,
            h: None,
            mean: None,
            rstd: None,
        },
        &NormOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("distinct"), "{e}");
    // Stats of the wrong length.
    let e = forward_into(
        NormKind::Rms,
        &Fwd {
            x: &x,
            residual: None,
            weight: None,
            bias: None,
        },
        &FwdOut {
            y: &y,
            h: None,
            mean: None,
            rstd: Some(&t(&[5])),
        },
        &NormOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`rstd`") && e.contains("4 elements"), "{e}");
}
