//! scaled_mm tests: the check harness on every device present, exact small products, NaN
//! propagation, and bad input.

use super::*;
use crate::core::fp8::{F8E4M3, F8E5M2};

#[test]
fn every_variant_passes_check() {
    // The CPU's two rungs on every case at least.
    crate::core::harness::check::assert_quick_check_passes(
        check::run,
        2 * check::cases(true).len() + check::quant_cases(true).len(),
    );
}

fn e4(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.iter().map(|&x| F8E4M3::from_f32(x)).collect(), shape).unwrap()
}

fn f32s(v: &[f32]) -> Tensor {
    Tensor::from_vec(v.to_vec(), &[v.len()]).unwrap()
}

#[test]
fn small_products_are_exact_with_row_scales_and_bias() {
    // A 2×3, B 2×3 (D = A·Bᵀ is 2×2), per-row scales of A, per-column of D, a bias.
    let a = e4(&[1.0, 2.0, -0.5, 3.0, 0.25, 448.0], &[2, 3]);
    let b = Tensor::from_vec(
        [1.0f32, -1.0, 2.0, 0.5, 4.0, 0.0]
            .iter()
            .map(|&x| F8E5M2::from_f32(x))
            .collect(),
        &[2, 3],
    )
    .unwrap();
    let (sa, sb) = (f32s(&[2.0, 0.5]), f32s(&[1.0, 0.25]));
    let bias = f32s(&[10.0, -10.0]);
    for v in ["naive", "parallel"] {
        let out = Tensor::empty(&[2, 2], DType::F32, Device::Cpu).unwrap();
        let opts = ScaledMmOptions {
            variant: Some(v.into()),
            ..Default::default()
        };
        scaled_mm_into(&a, &b, &sa, &sb, Some(&bias), &out, &opts).unwrap();
        // Row 0: [1, 2, -.5]·[1, -1, 2] = -2, ·[.5, 4, 0] = 8.5; row 1: [3, .25, 448]·… = 898.75,
        // 2.5.
        let want = [
            -2.0 * 2.0 + 10.0,
            8.5 * 2.0 * 0.25 - 10.0,
            898.75 * 0.5 + 10.0,
            2.5 * 0.5 * 0.25 - 10.0,
        ];
        assert_eq!(out.to_vec::<f32>().unwrap(), want, "{v}");
    }
}

#[test]
fn nan_inputs_stay_nan() {
    let mut codes: Vec<F8E4M3> = (0..8).map(|i| F8E4M3::from_f32(i as f32 * 0.5)).collect();
    codes[3] = F8E4M3(0x7F); // NaN
    let a = Tensor::from_vec(codes, &[2, 4]).unwrap();
    let b = e4(&[1.0; 8], &[2, 4]);
    let d = scaled_mm(&a, &b, &f32s(&[1.0]), &f32s(&[1.0]), None, DType::F32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert!(d[0].is_nan() && d[1].is_nan(), "{d:?}");
    assert_eq!(&d[2..], &[11.0, 11.0]);
}

#[test]
fn bad_input_is_refused_with_the_argument_named() {
    let a = e4(&[1.0; 12], &[3, 4]);
    let b = e4(&[1.0; 8], &[2, 4]);
    let one = f32s(&[1.0]);
    let err = |r: Result<Tensor>| r.unwrap_err().to_string();
    // Not FP8.
    let bf = Tensor::rand(&[3, 4], DType::BF16, Device::Cpu, 1, -1.0, 1.0).unwrap();
    let e = err(scaled_mm(&bf, &b, &one, &one, None, DType::BF16));
    assert!(e.contains("`a`") && e.contains("FP8"), "{e}");
    // k mismatch.
    let b5 = e4(&[1.0; 10], &[2, 5]);
    let e = err(scaled_mm(&a, &b5, &one, &one, None, DType::BF16));
    assert!(e.contains("`b`") && e.contains("[n, 4]"), "{e}");
    // Scales: wrong count, wrong dtype.
    let e = err(scaled_mm(
        &a,
        &b,
        &f32s(&[1.0, 2.0]),
        &one,
        None,
        DType::BF16,
    ));
    assert!(e.contains("scale_a") && e.contains("3"), "{e}");
    let e = err(scaled_mm(&a, &b, &one, &f32s(&[1.0; 3]), None, DType::BF16));
    assert!(e.contains("scale_b"), "{e}");
    let s16 = Tensor::full(&[1], DType::BF16, Device::Cpu, 1.0).unwrap();
    let e = err(scaled_mm(&a, &b, &s16, &one, None, DType::BF16));
    assert!(e.contains("scale_a") && e.contains("f32"), "{e}");
    // Scale values (checked where they live: the CPU).
    for bad in [0.0, f32::NAN, f32::INFINITY] {
        let e = err(scaled_mm(&a, &b, &one, &f32s(&[bad]), None, DType::BF16));
        assert!(
            e.contains("scale_b") && e.contains("non-zero"),
            "{bad}: {e}"
        );
    }
    // Bias of another dtype or length; output dtype.
    let e = err(scaled_mm(
        &a,
        &b,
        &one,
        &one,
        Some(&f32s(&[1.0, 2.0])),
        DType::BF16,
    ));
    assert!(e.contains("bias") && e.contains("bf16"), "{e}");
    let e = err(scaled_mm(&a, &b, &one, &one, None, DType::I32));
    assert!(e.contains("`out`"), "{e}");
    // A transposed view (k not contiguous).
    let e = err(scaled_mm(
        &a.t().unwrap(),
        &b,
        &one,
        &one,
        None,
        DType::BF16,
    ));
    assert!(e.contains("`a`") && e.contains("unit column stride"), "{e}");
    // A variant of another device, an unknown one.
    let out = Tensor::empty(&[3, 2], DType::F32, Device::Cpu).unwrap();
    for v in ["wgmma", "nope"] {
        let opts = ScaledMmOptions {
            variant: Some(v.into()),
            ..Default::default()
        };
        assert!(
            scaled_mm_into(&a, &b, &one, &one, None, &out, &opts).is_err(),
            "{v}"
        );
    }
    // The output aliasing an input.
    let e = scaled_mm_into(&a, &b, &one, &one, None, &one, &ScaledMmOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`out`"), "{e}");
}

#[test]
fn wgmma_declines_what_tma_cannot_load() {
    let p = Problem::dense(
        (100, 200, 256),
        (DType::F8E4M3, DType::F8E4M3, DType::BF16),
        Device::Cpu,
    );
    let hopper = Some(Arch::SM90);
    assert_eq!(wgmma_declines(&p, hopper, &[0x1000, 0x2000]), None);
    assert!(wgmma_declines(&p, Some(Arch::SM89), &[]).is_some());
    assert!(wgmma_declines(&p, hopper, &[0x1008, 0x2000])
        .unwrap()
        .contains("`a`"));
    let odd = Problem {
        ldb: 250,
        k: 250,
        lda: 250,
        ..p
    };
    assert!(wgmma_declines(&odd, hopper, &[]).is_some());
    let empty = Problem { k: 0, ..p };
    assert!(wgmma_declines(&empty, hopper, &[])
        .unwrap()
        .contains("k > 0"));
}

#[test]
fn splits_fill_idle_sms_without_empty_ranges() {
    let p = |m: usize, n: usize, k: usize| {
        Problem::dense(
            (m, n, k),
            (DType::F8E4M3, DType::F8E4M3, DType::BF16),
            Device::Cpu,
        )
    };
    use cuda::splits_for;
    // Decode against a 4096-wide weight: 16 tiles of 128×256 on 132 SMs.
    assert!(splits_for(&p(64, 4096, 4096), 256, 132) > 1);
    assert!(splits_for(&p(64, 4096, 14336), 128, 132) > 1);
    // Enough tiles, too little k, or a pass that costs more than it saves: none.
    assert_eq!(splits_for(&p(4096, 4096, 4096), 128, 132), 1);
    assert_eq!(splits_for(&p(64, 4096, 384), 128, 132), 1);
    assert_eq!(splits_for(&p(1000, 1000, 1008), 128, 132), 1);
    for (m, n, k, bn) in [
        (1, 256, 4296, 256),
        (64, 260, 4096, 128),
        (300, 768, 8192, 128),
        (513, 2048, 4096, 256),
    ] {
        let s = splits_for(&p(m, n, k), bn, 132) as usize;
        let ktiles = k.div_ceil(128);
        let per = ktiles.div_ceil(s);
        let tiles = m.div_ceil(128) * n.div_ceil(bn as usize);
        assert!(
            (1..=16).contains(&s) && s * tiles <= 132,
            "{m}×{n}×{k}: {s}"
        );
        assert!(s == 1 || per >= 4, "{m}×{n}×{k}: {s} splits of {per}");
        assert!(
            (s - 1) * per < ktiles,
            "{m}×{n}×{k}: split {s} of {per} is empty"
        );
    }
}

#[test]
fn promoted_tiles_are_picked_by_whole_waves() {
    let p = |m: usize, n: usize, k: usize| {
        Problem::dense(
            (m, n, k),
            (DType::F8E4M3, DType::F8E4M3, DType::BF16),
            Device::Cpu,
        )
    };
    let bn = |m, n, k| cuda::promoted_for(&p(m, n, k), 132).bn;
    // 4096³: 1024 tiles of 128 columns in 8 rounds beat 704 of 192 in 6; small problems fit one
    // wave either way (the narrower tile is less work); large ones take 192.
    assert_eq!(bn(4096, 4096, 4096), 128);
    assert_eq!(bn(1000, 1000, 1008), 128);
    assert_eq!(bn(8192, 8192, 8192), 192);
    assert_eq!(bn(8192, 14336, 4096), 192);
    assert_eq!(bn(8192, 4096, 14336), 192);
}
