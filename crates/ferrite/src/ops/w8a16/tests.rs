//! w8a16 tests: the check harness on every device present, an exact small product, the
//! quantiser's contract, bad input.

use super::*;

#[test]
fn every_variant_passes_check() {
    // The CPU's two rungs on every case at least.
    crate::core::harness::check::assert_quick_check_passes(
        check::run,
        2 * check::cases(true).len(),
    );
}

fn i8s(v: &[i8], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).unwrap()
}

fn f32s(v: &[f32]) -> Tensor {
    Tensor::from_vec(v.to_vec(), &[v.len()]).unwrap()
}

#[test]
fn small_products_are_exact_with_scales_and_bias() {
    // A 2×3 (bf16-exact values), W 2×3 int8, D = A·(s ⊙ W)ᵀ + bias.
    let a = Tensor::from_vec(vec![1.0f32, 2.0, -0.5, 3.0, 0.25, 4.0], &[2, 3])
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let w = i8s(&[1, -1, 2, 127, -128, 0], &[2, 3]);
    let s = f32s(&[0.5, 0.25]);
    let bias = Tensor::from_vec(vec![10.0f32, -10.0], &[2])
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    for v in ["naive", "parallel"] {
        let out = Tensor::empty(&[2, 2], DType::BF16, Device::Cpu).unwrap();
        let opts = W8a16Options {
            variant: Some(v.into()),
            ..Default::default()
        };
        w8a16_into(&a, &w, &s, Some(&bias), &out, &opts).unwrap();
        // Row 0: [1, 2, -.5]·[1, -1, 2] = -2 → ·0.5 + 10 = 9; ·[127, -128, 0] = -129 → ·0.25 − 10
        // = -42.25; row 1: [3, .25, 4]·[1, -1, 2] = 10.75 → 15.375; ·[127, -128, 0] = 349 →
        // 77.25, which bf16 (8 significant bits) rounds to even: 77.
        let want = [9.0f32, -42.25, 15.375, 77.0];
        let got = out.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(got, want, "{v}");
    }
}

#[test]
fn quantize_int8_rounds_per_row_and_keeps_zero_rows() {
    let w = Tensor::from_vec(
        vec![0.5f32, -1.0, 0.2, 0.0, 0.0, 0.0, 3.0, 1.5, -0.01],
        &[3, 3],
    )
    .unwrap();
    let (q, s) = quantize_int8(&w).unwrap();
    assert_eq!(q.dtype(), DType::I8);
    assert_eq!(
        s.to_vec::<f32>().unwrap(),
        vec![1.0 / 127.0, 1.0, 3.0 / 127.0]
    );
    let codes: Vec<i8> = q.to_vec::<i8>().unwrap();
    // 0.5·127 = 63.5 rounds away from zero; 0.2·127 = 25.4; 1.5/(3/127) = 63.5 → 64.
    assert_eq!(codes, vec![64, -127, 25, 0, 0, 0, 127, 64, 0]);
    // Every code dequantises within half a step of its weight.
    let (wv, sv) = (w.to_vec::<f32>().unwrap(), s.to_vec::<f32>().unwrap());
    for (i, (&c, &x)) in codes.iter().zip(&wv).enumerate() {
        assert!(
            (c as f32 * sv[i / 3] - x).abs() <= sv[i / 3] * 0.5 + 1e-7,
            "{i}"
        );
    }
    let bad = Tensor::from_vec(vec![1.0f32, f32::NAN], &[1, 2]).unwrap();
    let e = quantize_int8(&bad).unwrap_err().to_string();
    assert!(e.contains("finite") && e.contains("NaN"), "{e}");
    let e = quantize_int8(&f32s(&[1.0])).unwrap_err().to_string();
    assert!(e.contains("rank-2"), "{e}");
}

#[test]
fn bad_input_names_the_argument() {
    let a = Tensor::rand(&[2, 32], DType::BF16, Device::Cpu, 1, -1.0, 1.0).unwrap();
    let w = Tensor::from_vec(vec![1i8; 3 * 32], &[3, 32]).unwrap();
    let s = f32s(&[0.1, 0.2, 0.3]);
    let out = Tensor::empty(&[2, 3], DType::BF16, Device::Cpu).unwrap();
    let opts = W8a16Options::default();
    let err = |a: &Tensor, w: &Tensor, s: &Tensor, b: Option<&Tensor>, o: &Tensor| {
        w8a16_into(a, w, s, b, o, &opts).unwrap_err().to_string()
    };
    let a32 = a.to_dtype(DType::F32).unwrap();
    assert!(err(&a32, &w, &s, None, &out).contains("`a`"));
    let wf = w.to_dtype(DType::F32).unwrap();
    assert!(err(&a, &wf, &s, None, &out).contains("int8"));
    let w_short = Tensor::from_vec(vec![1i8; 3 * 16], &[3, 16]).unwrap();
    assert!(err(&a, &w_short, &s, None, &out).contains("[n, 32]"));
    assert!(err(&a, &w, &f32s(&[0.1, 0.2]), None, &out).contains("`scale`"));
    let o16 = Tensor::empty(&[2, 3], DType::F16, Device::Cpu).unwrap();
    assert!(err(&a, &w, &s, None, &o16).contains("`out`"));
    let bias = Tensor::empty(&[4], DType::BF16, Device::Cpu).unwrap();
    assert!(err(&a, &w, &s, Some(&bias), &out).contains("`bias`"));
    // Scales are refused on the CPU when they would give a silently wrong D.
    for bad in [0.0, f32::NAN, f32::INFINITY] {
        let e = err(&a, &w, &f32s(&[0.1, bad, 0.3]), None, &out);
        assert!(e.contains("scale"), "{e}");
    }
    // A named variant that cannot take the request says why.
    let opts = W8a16Options {
        variant: Some("mma".into()),
        ..Default::default()
    };
    assert!(w8a16_into(&a, &w, &s, None, &out, &opts).is_err());
}

#[test]
fn split_k_keeps_every_chunk_once() {
    // The split count covers ⌈k/64⌉ chunks with none empty, and stays 1 where rows fill the GPU.
    for (m, n, k) in [
        (1, 4096, 4096),
        (1, 129, 4096),
        (16, 64, 528),
        (1, 14336, 4096),
        (64, 32, 64),
    ] {
        let p = Problem::dense((m, n, k), DType::BF16, Device::Cpu);
        let s = cuda::splits_for(&p, 132) as usize;
        let chunks = k.div_ceil(64);
        let per = chunks.div_ceil(s);
        assert!(
            s >= 1 && (s - 1) * per < chunks,
            "{m}×{n}×{k}: {s} splits of {per}"
        );
        if n.div_ceil(cuda::ROWS) >= 3 * 132 {
            assert_eq!(s, 1, "{m}×{n}×{k}");
        }
    }
}
