//! matmul on the CPU path: in-place copies and strided outputs.

use super::*;

#[test]
fn matmul_in_place_copies_and_strided_outputs() {
    let (m, k, n) = (5usize, 7usize, 3usize);
    let mut a = f32s(rand(m * k, 1), &[m as i64, k as i64]);
    let mut b = f32s(rand(k * n, 2), &[k as i64, n as i64]);
    let want = ferrite::ops::matmul::matmul(&ref_tensor(&a), &ref_tensor(&b))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    // Output rows 2 elements apart from each other's ends: the gaps must stay untouched.
    let ld = n + 2;
    let mut out = f32s(vec![9.0; m * ld], &[m as i64, n as i64]).strided(&[ld as i64, 1]);
    // SAFETY: live buffers.
    let s = unsafe { ferrite_matmul(cpu(), &a.t(), &b.t(), &out.t(), 1.0, 0.0, false) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    for r in 0..m {
        assert_eq!(&out.v[r * ld..r * ld + n], &want[r * n..r * n + n]);
        if r + 1 < m {
            assert_eq!(&out.v[r * ld + n..(r + 1) * ld], &[9.0, 9.0]);
        }
    }
    // The same operand twice (a·aᵀ through a transposed view): borrowed once, copied once.
    let mut at = f32s(a.v.clone(), &[k as i64, m as i64]).strided(&[1, k as i64]);
    let mut o2 = zeros(&[m as i64, m as i64]);
    let a_desc = a.t();
    let mut at_desc = at.t();
    at_desc.data = a_desc.data;
    // SAFETY: both descriptors view `a`'s live buffer.
    let s = unsafe { ferrite_matmul(cpu(), &a_desc, &at_desc, &o2.t(), 1.0, 0.0, false) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let want2 = ferrite::ops::matmul::matmul(&ref_tensor(&a), &ref_tensor(&a).t().unwrap())
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(o2.v, want2);
    // An output at a 4-byte (not 8-byte) aligned address: copied out and back, β read in.
    let mut raw = vec![1.0f32; m * n + 1];
    let mut o3 = zeros(&[m as i64, n as i64]);
    let mut d = o3.t();
    d.data = raw[1..].as_mut_ptr().cast();
    // SAFETY: the view lies inside `raw`.
    let s = unsafe { ferrite_matmul(cpu(), &a.t(), &b.t(), &d, 2.0, 1.0, false) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    for (i, w) in want.iter().enumerate() {
        assert!((raw[1 + i] - (2.0 * w + 1.0)).abs() < 1e-5);
    }
    assert_eq!(raw[0], 1.0);
}
