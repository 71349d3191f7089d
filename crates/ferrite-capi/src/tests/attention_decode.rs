//! Attention, paged decode and the KV-cache append on the CPU path against ferrite's Rust API.

use super::*;

#[test]
fn attention_decode_append_match_the_rust_api() {
    use ferrite::ops::{attention as at, decode as dc};
    let (b, s, h, d) = (2usize, 5usize, 2usize, 8usize);
    let shape = [b as i64, s as i64, h as i64, d as i64];
    let n = b * s * h * d;
    let mut q = f32s(rand(n, 11), &shape);
    let mut k = f32s(rand(n, 12), &shape);
    let mut v = f32s(rand(n, 13), &shape);
    let mut o = zeros(&shape);
    let mut lse = zeros(&[b as i64, h as i64, s as i64]);
    let mut opts = ferrite_attention_options_default();
    opts.causal = true;
    // SAFETY: live buffers.
    let st = unsafe {
        ferrite_attention_forward(
            cpu(),
            &q.t(),
            &k.t(),
            &v.t(),
            &o.t(),
            &lse.t(),
            null(),
            &opts,
        )
    };
    assert_eq!(st, FerriteStatus::Ok, "{}", last_error());
    let ro = at::AttentionOptions {
        causal: true,
        ..Default::default()
    };
    let (rq, rk, rv) = (ref_tensor(&q), ref_tensor(&k), ref_tensor(&v));
    let (wo, wl) = at::attention(&rq, &rk, &rv, &ro).unwrap();
    assert_eq!(o.v, wo.to_vec::<f32>().unwrap());
    assert_eq!(lse.v, wl.to_vec::<f32>().unwrap());
    let mut dout = f32s(rand(n, 14), &shape);
    let (mut dq, mut dk, mut dv) = (zeros(&shape), zeros(&shape), zeros(&shape));
    // SAFETY: live buffers.
    let st = unsafe {
        ferrite_attention_backward(
            cpu(),
            &dout.t(),
            &q.t(),
            &k.t(),
            &v.t(),
            &o.t(),
            &lse.t(),
            &dq.t(),
            &dk.t(),
            &dv.t(),
            null(),
            &opts,
        )
    };
    assert_eq!(st, FerriteStatus::Ok, "{}", last_error());
    let (wdq, wdk, wdv) =
        at::attention_backward(&ref_tensor(&dout), &rq, &rk, &rv, &wo, &wl, &ro).unwrap();
    assert_eq!(dq.v, wdq.to_vec::<f32>().unwrap());
    assert_eq!(dk.v, wdk.to_vec::<f32>().unwrap());
    assert_eq!(dv.v, wdv.to_vec::<f32>().unwrap());

    // Paged decode: append the keys of batch 0 (5 tokens) into blocks of 4, then decode.
    let (blocks, bs) = (4usize, 4usize);
    let cache_shape = [blocks as i64, bs as i64, h as i64, d as i64];
    let mut kc = zeros(&cache_shape);
    let mut vc = zeros(&cache_shape);
    let t = s;
    let mut kt = f32s(k.v[..t * h * d].to_vec(), &[t as i64, h as i64, d as i64]);
    let mut vt = f32s(v.v[..t * h * d].to_vec(), &[t as i64, h as i64, d as i64]);
    // Tokens 0..4 → block 2, token 4 → block 0.
    let mut slots = Buf::new(vec![8i32, 9, 10, 11, 0], &[t as i64], FERRITE_DTYPE_I32);
    // SAFETY: live buffers.
    let st = unsafe { ferrite_append_kv(cpu(), &kt.t(), &vt.t(), &kc.t(), &vc.t(), &slots.t()) };
    assert_eq!(st, FerriteStatus::Ok, "{}", last_error());
    assert_eq!(&kc.v[2 * bs * h * d..3 * bs * h * d], &k.v[..4 * h * d]);
    let mut table = Buf::new(vec![2i32, 0], &[1, 2], FERRITE_DTYPE_I32);
    let mut lens = Buf::new(vec![t as i32], &[1], FERRITE_DTYPE_I32);
    let mut dq1 = f32s(
        q.v[(s - 1) * h * d..s * h * d].to_vec(),
        &[1, h as i64, d as i64],
    );
    let mut dout1 = zeros(&[1, h as i64, d as i64]);
    let mut dlse = zeros(&[1, h as i64]);
    // SAFETY: live buffers.
    let st = unsafe {
        ferrite_paged_decode(
            cpu(),
            &dq1.t(),
            &kc.t(),
            &vc.t(),
            &table.t(),
            &lens.t(),
            &dout1.t(),
            &dlse.t(),
            null(),
        )
    };
    assert_eq!(st, FerriteStatus::Ok, "{}", last_error());
    // The last query of batch 0 sees every key under the causal mask: the same output.
    for hh in 0..h {
        for dd in 0..d {
            let want = o.v[((s - 1) * h + hh) * d + dd];
            let got = dout1.v[hh * d + dd];
            assert!((want - got).abs() < 1e-5, "{want} vs {got}");
        }
    }
    let (wo2, _) = dc::decode(
        &ref_tensor(&dq1),
        &dc::PagedKv {
            key_cache: &ref_tensor(&kc),
            value_cache: &ref_tensor(&vc),
            block_table: &Tensor::from_vec(table.v.clone(), &[1, 2]).unwrap(),
            seq_lens: &Tensor::from_vec(lens.v.clone(), &[1]).unwrap(),
        },
        &Default::default(),
    )
    .unwrap();
    assert_eq!(dout1.v, wo2.to_vec::<f32>().unwrap());
    // A slot outside the cache is an error naming it.
    slots.v[1] = 99;
    // SAFETY: live buffers.
    let st = unsafe { ferrite_append_kv(cpu(), &kt.t(), &vt.t(), &kc.t(), &vc.t(), &slots.t()) };
    expect_err(
        st,
        FerriteStatus::InvalidArgument,
        &["slot_mapping[1] = 99"],
    );
}
