//! quantize_fp8: current and given scales against an independent reading of the definition,
//! the edge values (zero rows, inf, NaN, saturation), the GPU bit for bit against the CPU, and bad
//! input.

use super::*;
use crate::core::rng::Rng;

fn codes(q: &Tensor) -> Vec<u8> {
    match q.dtype() {
        DType::F8E4M3 => q.to_vec::<F8E4M3>().unwrap().iter().map(|c| c.0).collect(),
        _ => q.to_vec::<F8E5M2>().unwrap().iter().map(|c| c.0).collect(),
    }
}

/// Random rows of mixed magnitudes (a few orders apart, signs both ways) as `dtype`.
fn input(rows: usize, cols: usize, dtype: DType, seed: u64) -> Tensor {
    let mut r = Rng::new(seed);
    let v: Vec<f32> = (0..rows * cols)
        .map(|i| (r.next_f64() as f32 * 2.0 - 1.0) * 10f32.powi((i % 7) as i32 - 3))
        .collect();
    Tensor::from_vec(v, &[rows, cols])
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn run(
    x: &Tensor,
    scale: Option<&Tensor>,
    fmt: DType,
    per_row: bool,
) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let rows = x.shape()[0];
    let n = if per_row { rows } else { 1 };
    let dev = x.device();
    let q = Tensor::empty(x.shape(), fmt, dev).unwrap();
    let amax = Tensor::empty(&[n], DType::F32, dev).unwrap();
    let inv = Tensor::empty(&[n], DType::F32, dev).unwrap();
    // Poison the outputs: every one of them must be written.
    for t in [&amax, &inv] {
        t.write_f32(&vec![f32::NAN; n]).unwrap();
    }
    quantize_fp8_into(x, scale, &q, &amax, &inv, &QuantizeOptions::default()).unwrap();
    (
        codes(&q),
        amax.to_f32_vec().unwrap(),
        inv.to_f32_vec().unwrap(),
    )
}

#[test]
fn current_scaling_maps_each_groups_amax_to_the_largest_code() {
    for fmt in [DType::F8E4M3, DType::F8E5M2] {
        let f = Fp8Format::of(fmt).unwrap();
        for per_row in [false, true] {
            let x = input(7, 33, DType::F32, 5);
            let xs = x.to_f32_vec().unwrap();
            let (q, amax, inv) = run(&x, None, fmt, per_row);
            let groups: Vec<&[f32]> = if per_row {
                xs.chunks(33).collect()
            } else {
                vec![&xs]
            };
            for (g, vals) in groups.iter().enumerate() {
                let want = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert_eq!(amax[g], want, "{fmt} per_row {per_row} group {g}");
                let s = f.max_finite() / want;
                assert_eq!(inv[g], 1.0 / s);
                // The largest magnitude lands on the largest finite code, within one rounding.
                let at = vals.iter().position(|v| v.abs() == want).unwrap();
                let i = if per_row { g * 33 + at } else { at };
                assert_eq!(q[i] & 0x7f, f.max_code() & 0x7f, "{fmt} group {g}");
            }
            // Every code is the nearest-even encoding of x·s, decoding back within half an ulp.
            for (i, &v) in xs.iter().enumerate() {
                let s = 1.0 / inv[if per_row { i / 33 } else { 0 }];
                let d = f.decode(q[i]) as f64;
                let want = (v * s) as f64;
                let ulp =
                    2f64.powi(want.abs().max(1e-30).log2().floor() as i32 - f.man_bits as i32);
                assert!(
                    (d - want).abs() <= 0.5 * ulp.max(f.decode(1) as f64) + 1e-12,
                    "{fmt} {i}: {v}·{s} → {d}"
                );
            }
        }
    }
}

#[test]
fn given_scales_zero_rows_and_non_finite_values() {
    let f = Fp8Format::of(DType::F8E4M3).unwrap();
    // Row 0 all zero (s = 1), row 1 with an inf (s = NaN: NaN codes), row 2 with a NaN, row 3 big
    // values under a given scale that saturates them.
    let x = Tensor::from_vec(
        vec![
            0.0f32,
            -0.0,
            0.0,
            1.0,
            f32::INFINITY,
            2.0,
            3.0,
            f32::NAN,
            1.0,
            1e6,
            -1e6,
            0.5,
        ],
        &[4, 3],
    )
    .unwrap();
    let (q, amax, inv) = run(&x, None, DType::F8E4M3, true);
    assert_eq!(amax[0], 0.0);
    assert_eq!(inv[0], 1.0);
    assert_eq!(&q[0..3], &[0x00, 0x80, 0x00]);
    assert_eq!(amax[1], f32::INFINITY);
    assert!(inv[1].is_nan() && q[3..6].iter().all(|&c| c & 0x7f == 0x7f));
    assert!(amax[2].is_nan() && inv[2].is_nan() && q[6..9].iter().all(|&c| c & 0x7f == 0x7f));
    assert_eq!(amax[3], 1e6);
    let s = Tensor::from_vec(vec![1.0f32, 1.0, 1.0, 1.0], &[4]).unwrap();
    let (q, amax, inv) = run(&x, Some(&s), DType::F8E4M3, true);
    assert_eq!(amax[3], 1e6, "amax is still measured under a given scale");
    assert_eq!(inv, vec![1.0; 4]);
    assert_eq!(q[9], f.max_code(), "saturates, never overflows to NaN");
    assert_eq!(q[10], 0x80 | f.max_code());
    assert_eq!(f.decode(q[11]), 0.5);
}

#[test]
fn empty_inputs_write_the_scales() {
    // [5, 0] with torch's strides for it ([1, 1]), per row: amax 0 and s = 1 (or the given one).
    let x = Tensor::empty(&[5, 0], DType::F32, Device::Cpu)
        .unwrap()
        .as_strided(&[5, 0], &[1, 1], 0)
        .unwrap();
    let (q, amax, inv) = run(&x, None, DType::F8E4M3, true);
    assert!(q.is_empty());
    assert_eq!((amax, inv), (vec![0.0; 5], vec![1.0; 5]));
    let x = Tensor::empty(&[0, 7], DType::BF16, Device::Cpu).unwrap();
    let s = Tensor::from_vec(vec![4.0f32], &[1]).unwrap();
    let (_, amax, inv) = run(&x, Some(&s), DType::F8E5M2, false);
    assert_eq!((amax, inv), (vec![0.0], vec![0.25]));
}

#[test]
fn bad_input_is_refused() {
    let x = input(4, 8, DType::F32, 1);
    let q = Tensor::empty(&[4, 8], DType::F8E4M3, Device::Cpu).unwrap();
    let one = || Tensor::empty(&[1], DType::F32, Device::Cpu).unwrap();
    let o = QuantizeOptions::default();
    let err = |r: Result<()>| r.unwrap_err().to_string();
    let e = err(quantize_fp8_into(
        &x,
        None,
        &q,
        &Tensor::empty(&[3], DType::F32, Device::Cpu).unwrap(),
        &one(),
        &o,
    ));
    assert!(e.contains("`amax`") && e.contains("or 4 (per row)"), "{e}");
    let e = err(quantize_fp8_into(
        &x,
        None,
        &Tensor::empty(&[4, 8], DType::BF16, Device::Cpu).unwrap(),
        &one(),
        &one(),
        &o,
    ));
    assert!(e.contains("`q`") && e.contains("f8e4m3 or f8e5m2"), "{e}");
    let e = err(quantize_fp8_into(
        &x.narrow(1, 0, 4).unwrap(),
        None,
        &q,
        &one(),
        &one(),
        &o,
    ));
    assert!(e.contains("`x`") && e.contains("contiguous"), "{e}");
    let a = one();
    let e = err(quantize_fp8_into(&x, None, &q, &a, &a, &o));
    assert!(e.contains("distinct"), "{e}");
    let e = err(quantize_fp8_into(
        &x,
        Some(&Tensor::empty(&[4], DType::F32, Device::Cpu).unwrap()),
        &q,
        &one(),
        &one(),
        &o,
    ));
    assert!(e.contains("`scale`"), "{e}");
    assert!(quantize_fp8(&x, DType::BF16, false).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_quantize_matches_the_cpu_bit_for_bit() {
    let dev = Device::Cuda(0);
    for &dt in QUANTIZE_INPUTS {
        for fmt in [DType::F8E4M3, DType::F8E5M2] {
            for per_row in [false, true] {
                for (rows, cols) in [(1, 1), (3, 5), (37, 129), (300, 1000), (0, 7), (5, 0)] {
                    let x = input(rows, cols, dt, (rows * 131 + cols) as u64);
                    let given = Tensor::from_vec(
                        (0..if per_row { rows } else { 1 })
                            .map(|i| 0.5 + i as f32)
                            .collect::<Vec<_>>(),
                        &[if per_row { rows } else { 1 }],
                    )
                    .unwrap();
                    for scale in [None, Some(&given)] {
                        let cpu = run(&x, scale, fmt, per_row);
                        let xg = x.to_device(dev).unwrap();
                        let sg = scale.map(|s| s.to_device(dev).unwrap());
                        let gpu = run(&xg, sg.as_ref(), fmt, per_row);
                        let what = format!(
                            "{dt}→{fmt} {rows}×{cols} per_row {per_row} given {}",
                            scale.is_some()
                        );
                        assert_eq!(cpu.0, gpu.0, "codes {what}");
                        assert_eq!(cpu.1, gpu.1, "amax {what}");
                        assert_eq!(cpu.2, gpu.2, "inv_scale {what}");
                    }
                }
            }
        }
    }
    // inf and NaN: NaN amax/inv compare by class, codes exactly.
    let x = Tensor::from_vec(
        vec![1.0f32, f32::INFINITY, 2.0, f32::NAN, 0.0, 0.0],
        &[3, 2],
    )
    .unwrap();
    let cpu = run(&x, None, DType::F8E4M3, true);
    let gpu = run(&x.to_device(dev).unwrap(), None, DType::F8E4M3, true);
    assert_eq!(cpu.0, gpu.0);
    for (a, b) in cpu.1.iter().zip(&gpu.1).chain(cpu.2.iter().zip(&gpu.2)) {
        assert!(a == b || (a.is_nan() && b.is_nan()), "{a} vs {b}");
    }
}
