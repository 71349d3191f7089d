//! attention tests: the check harness on every device present (every feature case), properties
//! the check does not cover, and one test per class of bad input.

use super::*;

fn cpu(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand(shape, DType::F32, Device::Cpu, seed, -1.0, 1.0).unwrap()
}

fn err_of(r: Result<()>) -> String {
    r.unwrap_err().to_string()
}

/// q [1, 8, 4, 16], k/v [1, 8, 2, 16], o, lse.
fn qkv() -> (Tensor, Tensor, Tensor, Tensor, Tensor) {
    let q = cpu(&[1, 8, 4, 16], 1);
    let k = cpu(&[1, 8, 2, 16], 2);
    let v = cpu(&[1, 8, 2, 16], 3);
    let o = Tensor::empty(&[1, 8, 4, 16], DType::F32, Device::Cpu).unwrap();
    let lse = Tensor::empty(&[1, 4, 8], DType::F32, Device::Cpu).unwrap();
    (q, k, v, o, lse)
}

#[test]
fn every_variant_passes_check() {
    crate::core::harness::check::assert_quick_check_passes(
        check::run,
        2 * 3 * check::cases(true).len(),
    );
}

#[test]
fn naive_and_tiled_agree_and_backward_is_deterministic() {
    let q = cpu(&[2, 100, 4, 40], 7);
    let k = cpu(&[2, 130, 2, 40], 8);
    let v = cpu(&[2, 130, 2, 40], 9);
    let dout = cpu(&[2, 100, 4, 40], 10);
    let run = |name: &str| {
        let opts = AttentionOptions {
            variant: Some(name.into()),
            causal: true,
            window: (50, -1),
            ..Default::default()
        };
        let (o, lse) = attention(&q, &k, &v, &opts).unwrap();
        let (dq, dk, dv) = attention_backward(&dout, &q, &k, &v, &o, &lse, &opts).unwrap();
        [o, lse, dq, dk, dv].map(|t| t.to_vec::<f32>().unwrap())
    };
    let (a, b, again) = (run("naive"), run("tiled"), run("tiled"));
    for (x, y) in a.iter().zip(&b) {
        let e = crate::core::harness::check::rel_error(
            &x.iter().map(|&v| v as f64).collect::<Vec<_>>(),
            &y.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        );
        assert!(e < 1e-5 || x.iter().all(|v| *v == f32::NEG_INFINITY), "{e}");
    }
    assert_eq!(b, again, "tiled is not bit-reproducible");
}

#[test]
fn fully_masked_rows_give_zero_and_minus_infinity() {
    // causal with Sq = 6 > Sk = 2: rows 0..4 see no key (bottom-right alignment).
    let q = cpu(&[1, 6, 1, 8], 1);
    let k = cpu(&[1, 2, 1, 8], 2);
    let v = cpu(&[1, 2, 1, 8], 3);
    for name in ["naive", "tiled"] {
        let opts = AttentionOptions {
            variant: Some(name.into()),
            causal: true,
            ..Default::default()
        };
        let (o, lse) = attention(&q, &k, &v, &opts).unwrap();
        let (o, lse) = (o.to_vec::<f32>().unwrap(), lse.to_vec::<f32>().unwrap());
        assert!(lse[..4].iter().all(|&x| x == f32::NEG_INFINITY), "{lse:?}");
        assert!(lse[4..].iter().all(|x| x.is_finite()), "{lse:?}");
        assert!(o[..4 * 8].iter().all(|&x| x == 0.0));
        // Row 4 sees key 0 only: o = v[0].
        let v0 = v.to_vec::<f32>().unwrap();
        assert_eq!(&o[4 * 8..5 * 8], &v0[..8]);
    }
}

#[test]
fn visible_keys_bottom_right() {
    // sq 2, sk 5: query 0 sits at 3, query 1 at 4.
    assert_eq!(visible_keys(0, 2, 5, -1, 0), (0, 4));
    assert_eq!(visible_keys(1, 2, 5, 1, 0), (3, 5));
    assert_eq!(visible_keys(0, 5, 2, -1, 0), (0, 0)); // at −3: nothing visible
    assert_eq!(visible_keys(4, 5, 2, -1, 0), (0, 2));
    assert_eq!(visible_keys(0, 3, 3, -1, 1), (0, 2));
    assert_eq!(visible_keys(2, 3, 3, 0, -1), (2, 3));
}

#[test]
fn bad_shapes_are_refused() {
    let (q, k, v, o, lse) = qkv();
    let opts = AttentionOptions::default();
    let q3 = cpu(&[8, 4, 16], 1);
    let e = err_of(attention_forward_into(&q3, &k, &v, &o, &lse, None, &opts));
    assert!(e.contains("`q`") && e.contains("bshd"), "{e}");
    let k_d = cpu(&[1, 8, 2, 8], 2);
    let e = err_of(attention_forward_into(&q, &k_d, &v, &o, &lse, None, &opts));
    assert!(e.contains("`k`") && e.contains("D = 16"), "{e}");
    let v_s = cpu(&[1, 9, 2, 16], 2);
    let e = err_of(attention_forward_into(&q, &k, &v_s, &o, &lse, None, &opts));
    assert!(e.contains("`v`") && e.contains("shape of `k`"), "{e}");
    let o_bad = Tensor::empty(&[1, 8, 4, 15], DType::F32, Device::Cpu).unwrap();
    let e = err_of(attention_forward_into(
        &q, &k, &v, &o_bad, &lse, None, &opts,
    ));
    assert!(e.contains("`o`"), "{e}");
    // A transposed q has a strided last dim.
    let e = err_of(attention_forward_into(
        &q.t().unwrap(),
        &k,
        &v,
        &o,
        &lse,
        None,
        &opts,
    ));
    assert!(e.contains("contiguous last dim"), "{e}");
}

#[test]
fn kv_heads_must_divide_query_heads() {
    let q = cpu(&[1, 8, 4, 16], 1);
    let k = cpu(&[1, 8, 3, 16], 2);
    let v = cpu(&[1, 8, 3, 16], 3);
    let e = attention(&q, &k, &v, &AttentionOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("dividing the 4 query heads") && e.contains("3 kv heads"),
        "{e}"
    );
}

#[test]
fn mixed_dtypes_are_refused() {
    let (q, _, v, o, lse) = qkv();
    let k16 = Tensor::rand(&[1, 8, 2, 16], DType::BF16, Device::Cpu, 2, -1.0, 1.0).unwrap();
    let e = err_of(attention_forward_into(
        &q,
        &k16,
        &v,
        &o,
        &lse,
        None,
        &Default::default(),
    ));
    assert!(e.contains("`k`") && e.contains("f32"), "{e}");
    let qi = Tensor::full(&[1, 8, 4, 16], DType::I32, Device::Cpu, 1.0).unwrap();
    let e = err_of(attention_forward_into(
        &qi,
        &q,
        &v,
        &o,
        &lse,
        None,
        &Default::default(),
    ));
    assert!(e.contains("`q`") && e.contains("f32/f16/bf16"), "{e}");
}

#[test]
fn bad_window_scale_softcap_are_refused() {
    let (q, k, v, o, lse) = qkv();
    let run =
        |opts: AttentionOptions| err_of(attention_forward_into(&q, &k, &v, &o, &lse, None, &opts));
    let e = run(AttentionOptions {
        window: (-2, 0),
        ..Default::default()
    });
    assert!(e.contains("window") && e.contains("(-2, 0)"), "{e}");
    let e = run(AttentionOptions {
        scale: Some(f32::NAN),
        ..Default::default()
    });
    assert!(e.contains("scale"), "{e}");
    let e = run(AttentionOptions {
        softcap: -1.0,
        ..Default::default()
    });
    assert!(e.contains("softcap"), "{e}");
}

#[test]
fn bad_lse_is_refused() {
    let (q, k, v, o, _) = qkv();
    let lse = Tensor::empty(&[1, 8, 4], DType::F32, Device::Cpu).unwrap();
    let e = err_of(attention_forward_into(
        &q,
        &k,
        &v,
        &o,
        &lse,
        None,
        &Default::default(),
    ));
    assert!(e.contains("`lse`") && e.contains("[1, 4, 8]"), "{e}");
    let lse16 = Tensor::empty(&[1, 4, 8], DType::BF16, Device::Cpu).unwrap();
    let e = err_of(attention_forward_into(
        &q,
        &k,
        &v,
        &o,
        &lse16,
        None,
        &Default::default(),
    ));
    assert!(e.contains("`lse`"), "{e}");
}

#[test]
fn outputs_must_not_alias() {
    let (q, k, v, o, lse) = qkv();
    let e = err_of(attention_forward_into(
        &q,
        &k,
        &v,
        &q,
        &lse,
        None,
        &Default::default(),
    ));
    assert!(e.contains("`o`") && e.contains("distinct"), "{e}");
    attention_forward_into(&q, &k, &v, &o, &lse, None, &Default::default()).unwrap();
    let dout = cpu(&[1, 8, 4, 16], 9);
    let dq = Tensor::empty(q.shape(), DType::F32, Device::Cpu).unwrap();
    let dk = Tensor::empty(k.shape(), DType::F32, Device::Cpu).unwrap();
    let e = err_of(attention_backward_into(
        &dout,
        &q,
        &k,
        &v,
        &o,
        &lse,
        &dq,
        &dk,
        &dk,
        None,
        &Default::default(),
    ));
    assert!(e.contains("`dv`") && e.contains("`dk`"), "{e}");
}

#[test]
fn gradient_strides_must_match() {
    let (q, k, v, o, lse) = qkv();
    attention_forward_into(&q, &k, &v, &o, &lse, None, &Default::default()).unwrap();
    let dout = cpu(&[1, 8, 4, 16], 9);
    // dq as a [1, 8, 4, 16] view with another stride pattern than q.
    let big = Tensor::empty(&[1, 4, 8, 16], DType::F32, Device::Cpu).unwrap();
    let dq = big.transpose(1, 2).unwrap();
    let dk = Tensor::empty(k.shape(), DType::F32, Device::Cpu).unwrap();
    let dv = Tensor::empty(v.shape(), DType::F32, Device::Cpu).unwrap();
    let e = err_of(attention_backward_into(
        &dout,
        &q,
        &k,
        &v,
        &o,
        &lse,
        &dq,
        &dk,
        &dv,
        None,
        &Default::default(),
    ));
    assert!(e.contains("`dq`") && e.contains("strides of `q`"), "{e}");
}

fn varlen_run(cu_q: Vec<i32>, cu_k: Vec<i32>, max_q: usize) -> String {
    let q = cpu(&[10, 2, 8], 1);
    let k = cpu(&[12, 2, 8], 2);
    let v = cpu(&[12, 2, 8], 3);
    let o = Tensor::empty(&[10, 2, 8], DType::F32, Device::Cpu).unwrap();
    let lse = Tensor::empty(&[2, 10], DType::F32, Device::Cpu).unwrap();
    let (n_q, n_k) = (cu_q.len(), cu_k.len());
    let cq = Tensor::from_vec(cu_q, &[n_q]).unwrap();
    let ck = Tensor::from_vec(cu_k, &[n_k]).unwrap();
    let vl = Varlen {
        cu_seqlens_q: &cq,
        cu_seqlens_k: &ck,
        max_seqlen_q: max_q,
        max_seqlen_k: 12,
    };
    match attention_forward_into(&q, &k, &v, &o, &lse, Some(&vl), &Default::default()) {
        Ok(()) => "ok".into(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn cu_seqlens_are_checked() {
    assert_eq!(varlen_run(vec![0, 4, 10], vec![0, 12, 12], 6), "ok");
    let e = varlen_run(vec![0, 4, 9], vec![0, 12, 12], 6);
    assert!(
        e.contains("cu_seqlens_q") && e.contains("last entry = 10"),
        "{e}"
    );
    let e = varlen_run(vec![0, 6, 4, 10], vec![0, 4, 8, 12], 6);
    assert!(e.contains("non-decreasing"), "{e}");
    let e = varlen_run(vec![0, 4, 10], vec![0, 12], 6);
    assert!(e.contains("cu_seqlens_k") && e.contains("3 entries"), "{e}");
    let e = varlen_run(vec![1, 4, 10], vec![0, 12, 12], 6);
    assert!(e.contains("first entry 0"), "{e}");
    let e = varlen_run(vec![0, 4, 10], vec![0, 12, 12], 5);
    assert!(e.contains("max_seqlen_q") && e.contains("length 6"), "{e}");
    // cu_seqlens must be i32.
    let q = cpu(&[10, 2, 8], 1);
    let o = Tensor::empty(&[10, 2, 8], DType::F32, Device::Cpu).unwrap();
    let lse = Tensor::empty(&[2, 10], DType::F32, Device::Cpu).unwrap();
    let cf = cpu(&[3], 1);
    let vl = Varlen {
        cu_seqlens_q: &cf,
        cu_seqlens_k: &cf,
        max_seqlen_q: 10,
        max_seqlen_k: 10,
    };
    let e = err_of(attention_forward_into(
        &q,
        &q,
        &q,
        &o,
        &lse,
        Some(&vl),
        &Default::default(),
    ));
    assert!(e.contains("cu_seqlens_q") && e.contains("i32"), "{e}");
}

#[test]
fn unknown_variant_is_refused() {
    let (q, k, v, _, _) = qkv();
    let opts = AttentionOptions {
        variant: Some("nope".into()),
        ..Default::default()
    };
    let e = attention(&q, &k, &v, &opts).unwrap_err().to_string();
    assert!(e.contains("no variant named `nope`"), "{e}");
}

#[test]
#[ignore = "the full CPU check, for a manual run: cargo test -p ferrite --lib full_cpu_check -- --ignored --nocapture"]
fn full_cpu_check() {
    let cfg = CheckConfig {
        devices: vec![Device::Cpu],
        variants: vec![],
        dtypes: vec![],
        seed: crate::core::rng::Rng::fresh_seed(),
        quick: false,
    };
    let mut recs = Vec::new();
    check::run(&cfg, &mut recs).unwrap();
    println!("{}", crate::core::harness::report::check_table(&recs));
    assert!(recs.iter().all(|r| r.pass), "seed {}", cfg.seed);
}

/// On a Hopper GPU both directions default to `hopper`; `flash` stays reachable by name.
#[test]
fn hopper_is_the_default_in_both_directions_on_sm90() {
    use crate::core::device::Arch;
    use crate::core::variant::{select, Backend};
    let vs = variants();
    let pick = |op: &str, name: Option<&str>| {
        select(
            op,
            &vs,
            name,
            Backend::Cuda,
            DType::BF16,
            Some(Arch::SM90),
            |_| None,
        )
        .unwrap()
        .name
    };
    assert_eq!(pick(OP_BWD, None), "hopper");
    assert_eq!(pick(OP, None), "hopper");
    assert_eq!(pick(OP_BWD, Some("flash")), "flash");
}

/// The CPU `naive` rung materialises one head's Sq × Sk scores: a size the host cannot hold is an
/// error naming that buffer, not an abort of the process.
#[test]
fn naive_scores_beyond_host_memory_are_an_error() {
    let s = 400_000; // 400k × 400k f32 scores = 640 GB
    let t = |seed| Tensor::rand(&[1, s, 1, 8], DType::F32, Device::Cpu, seed, -1.0, 1.0).unwrap();
    let (q, k, v) = (t(1), t(2), t(3));
    let opts = AttentionOptions {
        variant: Some("naive".into()),
        ..Default::default()
    };
    let e = attention(&q, &k, &v, &opts).unwrap_err();
    assert!(
        matches!(e, crate::core::error::Error::HostMemory { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("scores"), "{e}");
}
