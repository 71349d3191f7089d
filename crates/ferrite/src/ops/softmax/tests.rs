//! softmax tests: the check harness on every device present, and bad input.

use super::*;

#[test]
fn every_variant_passes_check() {
    crate::core::harness::check::assert_quick_check_passes(
        check::run,
        2 * 3 * check::cases(true).len(),
    );
}

#[test]
fn rows_sum_to_one_and_bad_input_is_refused() {
    let x = Tensor::rand(&[3, 50], DType::F32, Device::Cpu, 4, -20.0, 20.0).unwrap();
    let y = softmax(&x, 1.0).unwrap().to_vec::<f32>().unwrap();
    for r in 0..3 {
        let s: f32 = y[r * 50..][..50].iter().sum();
        assert!((s - 1.0).abs() < 1e-5, "row {r} sums to {s}");
    }
    let e = softmax(&x, f32::NAN).unwrap_err().to_string();
    assert!(e.contains("scale"), "{e}");
    let e = softmax(&x.t().unwrap(), 1.0).unwrap_err().to_string();
    assert!(e.contains("contiguous"), "{e}");
    let wrong = Tensor::empty(&[3, 49], DType::F32, Device::Cpu).unwrap();
    let e = softmax_into(&x, &wrong, &SoftmaxOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`y`") && e.contains("[3, 49]"), "{e}");
    let e = softmax_into(&x, &x, &SoftmaxOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("distinct"), "{e}");
}
