//! Cross-entropy on the CPU path against ferrite's Rust API: forward, backward, in place.

use super::*;

#[test]
fn cross_entropy_forward_backward_and_in_place() {
    use ferrite::ops::cross_entropy as ce;
    let (n, v) = (4usize, 11usize);
    let mut logits = f32s(rand(n * v, 10), &[n as i64, v as i64]);
    let mut targets = Buf::new(vec![3i64, -100, 0, 10], &[n as i64], FERRITE_DTYPE_I64);
    let mut rows = zeros(&[n as i64]);
    let mut loss = zeros(&[1]);
    let mut grad = zeros(&[n as i64, v as i64]);
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_cross_entropy(
            cpu(),
            &logits.t(),
            &targets.t(),
            &rows.t(),
            &loss.t(),
            &grad.t(),
            null(),
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let rl = ref_tensor(&logits);
    let rt = Tensor::from_vec(targets.v.clone(), &[n]).unwrap();
    let (wr, wl, wg) = ce::cross_entropy(&rl, &rt, &Default::default()).unwrap();
    assert_eq!(rows.v, wr.to_vec::<f32>().unwrap());
    assert_eq!(loss.v, wl.to_vec::<f32>().unwrap());
    assert_eq!(grad.v, wg.to_vec::<f32>().unwrap());
    // The gradient over the logits, then scaled by an incoming gradient of 2.
    let mut o = ferrite_cross_entropy_options_default();
    o.grad_in_place = true;
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_cross_entropy(
            cpu(),
            &logits.t(),
            &targets.t(),
            &rows.t(),
            null(),
            null(),
            &o,
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    assert_eq!(logits.v, grad.v);
    let mut two = f32s(vec![2.0], &[1]);
    // SAFETY: live buffers.
    let s = unsafe { ferrite_cross_entropy_scale_grad(cpu(), &logits.t(), &two.t()) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    for (a, b) in logits.v.iter().zip(&grad.v) {
        assert_eq!(*a, 2.0 * b);
    }
    // A target out of range names the row.
    targets.v[2] = 11;
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_cross_entropy(
            cpu(),
            &grad.t(),
            &targets.t(),
            &rows.t(),
            null(),
            null(),
            null(),
        )
    };
    expect_err(s, FerriteStatus::InvalidArgument, &["targets[2] = 11"]);
}
