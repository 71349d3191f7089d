//! linear, the norms and softmax on the CPU path against ferrite's Rust API.

use super::*;

#[test]
fn linear_norms_softmax_match_the_rust_api() {
    use ferrite::ops::{linear, norm, softmax};
    let (rows, inp, out) = (6usize, 8usize, 5usize);
    let mut x = f32s(rand(rows * inp, 3), &[rows as i64, inp as i64]);
    let mut w = f32s(rand(out * inp, 4), &[out as i64, inp as i64]);
    let mut bias = f32s(rand(out, 5), &[out as i64]);
    let mut y = zeros(&[rows as i64, out as i64]);
    let mut z = zeros(&[rows as i64, out as i64]);
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_linear_forward(
            cpu(),
            &x.t(),
            &w.t(),
            &bias.t(),
            null(),
            &y.t(),
            &z.t(),
            FERRITE_ACTIVATION_GELU_TANH,
            false,
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let (ry, rz) = (ref_tensor(&y), ref_tensor(&z));
    let lo = linear::LinearOptions {
        activation: linear::Activation::GeluTanh,
        ..Default::default()
    };
    let (rx, rw, rb) = (ref_tensor(&x), ref_tensor(&w), ref_tensor(&bias));
    let fwd = linear::Fwd {
        x: &rx,
        w: &rw,
        bias: Some(&rb),
        residual: None,
    };
    linear::forward_into(
        &fwd,
        &linear::FwdOut {
            y: &ry,
            z: Some(&rz),
        },
        &lo,
    )
    .unwrap();
    assert_eq!(y.v, ry.to_vec::<f32>().unwrap());
    assert_eq!(z.v, rz.to_vec::<f32>().unwrap());
    // Backward.
    let mut dy = f32s(rand(rows * out, 6), &[rows as i64, out as i64]);
    let mut dx = zeros(&[rows as i64, inp as i64]);
    let mut dw = zeros(&[out as i64, inp as i64]);
    let mut db = zeros(&[out as i64]);
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_linear_backward(
            cpu(),
            &dy.t(),
            &x.t(),
            &w.t(),
            &z.t(),
            &dx.t(),
            &dw.t(),
            &db.t(),
            FERRITE_ACTIVATION_GELU_TANH,
            false,
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let (rdx, rdw, rdb) = (ref_tensor(&dx), ref_tensor(&dw), ref_tensor(&db));
    linear::backward_into(
        &linear::Bwd {
            dy: &ref_tensor(&dy),
            x: &rx,
            w: &rw,
            z: Some(&ref_tensor(&z)),
            x_pre: None,
        },
        &linear::BwdOut {
            dx: Some(&rdx),
            dw: Some(&rdw),
            db: Some(&rdb),
            db_pre: None,
        },
        &lo,
    )
    .unwrap();
    assert_eq!(dx.v, rdx.to_vec::<f32>().unwrap());
    assert_eq!(dw.v, rdw.to_vec::<f32>().unwrap());
    assert_eq!(db.v, rdb.to_vec::<f32>().unwrap());

    // LayerNorm forward and backward, RMSNorm forward.
    let cols = inp as i64;
    let mut g = f32s(rand(inp, 7), &[cols]);
    let mut bb = f32s(rand(inp, 8), &[cols]);
    let mut ln_y = zeros(&[rows as i64, cols]);
    let mut mean = zeros(&[rows as i64]);
    let mut rstd = zeros(&[rows as i64]);
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_layer_norm_forward(
            cpu(),
            &x.t(),
            null(),
            &g.t(),
            &bb.t(),
            &ln_y.t(),
            null(),
            &mean.t(),
            &rstd.t(),
            1e-5,
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let (want_y, want_mean, want_rstd) =
        norm::layer_norm(&rx, Some(&ref_tensor(&g)), Some(&ref_tensor(&bb)), 1e-5).unwrap();
    assert_eq!(ln_y.v, want_y.to_vec::<f32>().unwrap());
    assert_eq!(mean.v, want_mean.to_vec::<f32>().unwrap());
    assert_eq!(rstd.v, want_rstd.to_vec::<f32>().unwrap());
    let mut ddx = zeros(&[rows as i64, cols]);
    let mut dg = zeros(&[cols]);
    let mut dbb = zeros(&[cols]);
    let mut dyn_ = f32s(rand(rows * inp, 9), &[rows as i64, cols]);
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_layer_norm_backward(
            cpu(),
            &dyn_.t(),
            &x.t(),
            &g.t(),
            &mean.t(),
            &rstd.t(),
            &ddx.t(),
            &dg.t(),
            &dbb.t(),
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let (r_dx, r_dg, r_db) = (ref_tensor(&ddx), ref_tensor(&dg), ref_tensor(&dbb));
    norm::backward_into(
        norm::NormKind::Layer,
        &norm::Bwd {
            dy: &ref_tensor(&dyn_),
            x: &rx,
            weight: Some(&ref_tensor(&g)),
            mean: Some(&want_mean),
            rstd: &want_rstd,
        },
        &norm::BwdOut {
            dx: &r_dx,
            dweight: Some(&r_dg),
            dbias: Some(&r_db),
        },
        &Default::default(),
    )
    .unwrap();
    assert_eq!(ddx.v, r_dx.to_vec::<f32>().unwrap());
    assert_eq!(dg.v, r_dg.to_vec::<f32>().unwrap());
    assert_eq!(dbb.v, r_db.to_vec::<f32>().unwrap());
    let mut rms_y = zeros(&[rows as i64, cols]);
    let mut rms_r = zeros(&[rows as i64]);
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_rms_norm_forward(
            cpu(),
            &x.t(),
            null(),
            &g.t(),
            &rms_y.t(),
            null(),
            &rms_r.t(),
            1e-6,
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let (wy, wr) = norm::rms_norm(&rx, Some(&ref_tensor(&g)), 1e-6).unwrap();
    assert_eq!(rms_y.v, wy.to_vec::<f32>().unwrap());
    assert_eq!(rms_r.v, wr.to_vec::<f32>().unwrap());
    // RMSNorm backward.
    let mut rdx2 = zeros(&[rows as i64, cols]);
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_rms_norm_backward(
            cpu(),
            &dyn_.t(),
            &x.t(),
            &g.t(),
            &rms_r.t(),
            &rdx2.t(),
            null(),
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    assert!(rdx2.v.iter().all(|v| v.is_finite()) && rdx2.v.iter().any(|&v| v != 0.0));

    // Softmax forward and backward, in place (y over x: copy-in/copy-out).
    let want_sm = softmax::softmax(&rx, 0.5).unwrap().to_vec::<f32>().unwrap();
    let mut sm = f32s(x.v.clone(), &[rows as i64, cols]);
    let d = sm.t();
    // SAFETY: one live buffer as input and output.
    let s = unsafe { ferrite_softmax_forward(cpu(), &d, &d, 0.5) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    assert_eq!(sm.v, want_sm);
    let mut sdx = zeros(&[rows as i64, cols]);
    // SAFETY: live buffers.
    let s = unsafe { ferrite_softmax_backward(cpu(), &dyn_.t(), &sm.t(), &sdx.t(), 0.5) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let r = ref_tensor(&sdx);
    softmax::softmax_backward_into(
        &ref_tensor(&dyn_),
        &ref_tensor(&sm),
        &r,
        &softmax::SoftmaxOptions {
            scale: 0.5,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(sdx.v, r.to_vec::<f32>().unwrap());
}
