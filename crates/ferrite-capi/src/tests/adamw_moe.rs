//! AdamW, the MoE layer and grouped_mm on the CPU path against ferrite's Rust API.

use super::*;

#[test]
fn adamw_moe_grouped_mm_match_the_rust_api() {
    use ferrite::ops::{adamw, moe};
    // AdamW on two f32 tensors, against the Rust step on copies.
    let mut p0 = f32s(rand(10, 20), &[10]);
    let mut g0 = f32s(rand(10, 21), &[10]);
    let mut m0 = zeros(&[10]);
    let mut v0 = zeros(&[10]);
    let mut p1 = f32s(rand(6, 22), &[2, 3]);
    let mut g1 = f32s(rand(6, 23), &[2, 3]);
    let mut m1 = zeros(&[2, 3]);
    let mut v1 = zeros(&[2, 3]);
    let refs: Vec<Tensor> = [&p0, &g0, &m0, &v0, &p1, &g1, &m1, &v1]
        .iter()
        .map(|b| ref_tensor(b))
        .collect();
    let ds: Vec<FerriteTensor> = vec![
        p0.t(),
        g0.t(),
        m0.t(),
        v0.t(),
        p1.t(),
        g1.t(),
        m1.t(),
        v1.t(),
    ];
    let list = [
        FerriteAdamWTensor {
            param: &ds[0],
            grad: &ds[1],
            exp_avg: &ds[2],
            exp_avg_sq: &ds[3],
            master: null(),
        },
        FerriteAdamWTensor {
            param: &ds[4],
            grad: &ds[5],
            exp_avg: &ds[6],
            exp_avg_sq: &ds[7],
            master: null(),
        },
    ];
    let mut hp = ferrite_adamw_hyper_default();
    hp.lr = 0.01;
    hp.step = 3;
    // SAFETY: live buffers, a list of 2.
    let s = unsafe { ferrite_adamw_step(cpu(), list.as_ptr(), 2, &hp) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let ts = [
        adamw::AdamWTensor {
            param: &refs[0],
            grad: &refs[1],
            exp_avg: &refs[2],
            exp_avg_sq: &refs[3],
            master: None,
        },
        adamw::AdamWTensor {
            param: &refs[4],
            grad: &refs[5],
            exp_avg: &refs[6],
            exp_avg_sq: &refs[7],
            master: None,
        },
    ];
    let rh = adamw::AdamWHyper {
        lr: 0.01,
        step: 3,
        ..Default::default()
    };
    adamw::adamw_step(&ts, &rh, &Default::default()).unwrap();
    assert_eq!(p0.v, refs[0].to_vec::<f32>().unwrap());
    assert_eq!(v1.v, refs[7].to_vec::<f32>().unwrap());
    hp.step = 0;
    // SAFETY: live buffers.
    let s = unsafe { ferrite_adamw_step(cpu(), list.as_ptr(), 2, &hp) };
    expect_err(s, FerriteStatus::InvalidArgument, &["adamw", "`step`"]);

    // The MoE layer's forward against the Rust layer.
    let (t, hd, i, e) = (6usize, 8usize, 4usize, 4usize);
    let mut x = f32s(rand(t * hd, 30), &[t as i64, hd as i64]);
    let mut router = f32s(rand(e * hd, 31), &[e as i64, hd as i64]);
    let mut w_up = f32s(
        rand(e * hd * 2 * i, 32),
        &[e as i64, hd as i64, 2 * i as i64],
    );
    let mut w_down = f32s(rand(e * i * hd, 33), &[e as i64, i as i64, hd as i64]);
    let mut out = zeros(&[t as i64, hd as i64]);
    let mut losses = zeros(&[2 + e as i64]);
    let mut mo = ferrite_moe_options_default();
    mo.aux_loss_coef = 0.01;
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_moe_forward(
            cpu(),
            &x.t(),
            &router.t(),
            &w_up.t(),
            &w_down.t(),
            &out.t(),
            &losses.t(),
            &mo,
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let (rr, ru, rd) = (ref_tensor(&router), ref_tensor(&w_up), ref_tensor(&w_down));
    let w = moe::MoeWeights {
        router: &rr,
        w_up: &ru,
        w_down: &rd,
    };
    let mut cfg = moe::MoeConfig::new(e, 2);
    cfg.aux_loss_coef = 0.01;
    let f = moe::moe_forward(&ref_tensor(&x), &w, &cfg, &Default::default()).unwrap();
    assert_eq!(out.v, f.out.to_vec::<f32>().unwrap());
    assert_eq!(losses.v, f.losses.to_vec::<f32>().unwrap());
    assert!(losses.v[0] > 0.0);

    // grouped_mm: rows 0..2 through b[0], 2..6 through b[1].
    let (m, k, n, g) = (6usize, 3usize, 2usize, 2usize);
    let mut a = f32s(rand(m * k, 40), &[m as i64, k as i64]);
    let mut bw = f32s(rand(g * k * n, 41), &[g as i64, k as i64, n as i64]);
    let mut offs = Buf::new(vec![2i32, 6], &[2], FERRITE_DTYPE_I32);
    let mut go = zeros(&[m as i64, n as i64]);
    // SAFETY: live buffers.
    let s = unsafe { ferrite_grouped_mm(cpu(), &a.t(), &bw.t(), &offs.t(), &go.t()) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    for r in 0..m {
        let gi = usize::from(r >= 2);
        for c in 0..n {
            let want: f32 = (0..k)
                .map(|kk| a.v[r * k + kk] * bw.v[(gi * k + kk) * n + c])
                .sum();
            assert!((go.v[r * n + c] - want).abs() < 1e-5);
        }
    }
}
