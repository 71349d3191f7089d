//! rotary tests: the check harness on every device present, the inverse undoing the rotation,
//! and bad input.

use super::*;

fn table(ro: usize, half: usize) -> (Tensor, Tensor) {
    let c = Tensor::rand(&[ro, half], DType::F32, Device::Cpu, 3, -1.0, 1.0).unwrap();
    let s = Tensor::rand(&[ro, half], DType::F32, Device::Cpu, 4, -1.0, 1.0).unwrap();
    (c, s)
}

#[test]
fn every_variant_passes_check() {
    crate::core::harness::check::assert_quick_check_passes(
        check::run,
        2 * 3 * check::cases(true).len(),
    );
}

#[test]
fn the_inverse_rotation_gives_x_back() {
    // Unit-modulus angles: cos² + sin² = 1, so rotating back returns x.
    let (ro, half) = (12, 4);
    let ang: Vec<f32> = (0..ro * half).map(|i| 0.37 * i as f32).collect();
    let cos = Tensor::from_vec(ang.iter().map(|a| a.cos()).collect(), &[ro, half]).unwrap();
    let sin = Tensor::from_vec(ang.iter().map(|a| a.sin()).collect(), &[ro, half]).unwrap();
    let x = Tensor::rand(&[2, 5, 3, 10], DType::F32, Device::Cpu, 7, -3.0, 3.0).unwrap();
    for interleaved in [false, true] {
        let fwd = RotaryOptions {
            interleaved,
            offset: 4,
            ..Default::default()
        };
        let y = rotary(&x, &cos, &sin, &fwd).unwrap();
        assert_ne!(y.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
        let back = rotary(
            &y,
            &cos,
            &sin,
            &RotaryOptions {
                conjugate: true,
                ..fwd
            },
        )
        .unwrap();
        for (a, b) in back
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .zip(x.to_vec::<f32>().unwrap())
        {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}

#[test]
fn bad_input_is_refused_with_the_argument_named() {
    let x = Tensor::rand(&[2, 5, 3, 8], DType::F32, Device::Cpu, 1, -1.0, 1.0).unwrap();
    let (cos, sin) = table(6, 4);
    let err = |x: &Tensor, c: &Tensor, s: &Tensor, o: &RotaryOptions| {
        rotary(x, c, s, o).unwrap_err().to_string()
    };
    // S + offset past the tables.
    let e = err(
        &x,
        &cos,
        &sin,
        &RotaryOptions {
            offset: 2,
            ..Default::default()
        },
    );
    assert!(e.contains("`cos`") && e.contains("5 + 2"), "{e}");
    // R wider than the head dim.
    let (c5, s5) = table(6, 5);
    let e = err(&x, &c5, &s5, &Default::default());
    assert!(e.contains("`cos`") && e.contains("head dim 8"), "{e}");
    // sin unlike cos.
    let (_, s3) = table(6, 3);
    let e = err(&x, &cos, &s3, &Default::default());
    assert!(e.contains("`sin`"), "{e}");
    // A non-contiguous head dim.
    let xt = x.transpose(2, 3).unwrap();
    let (c1, s1) = table(6, 1);
    let e = err(&xt, &c1, &s1, &Default::default());
    assert!(
        e.contains("`x`") && e.contains("contiguous last dim"),
        "{e}"
    );
    // Per-sequence offsets of the wrong length, and one past the tables (CPU: an error).
    let offs = Tensor::from_vec(vec![0i32; 3], &[3]).unwrap();
    let e = err(
        &x,
        &cos,
        &sin,
        &RotaryOptions {
            offsets: Some(offs),
            ..Default::default()
        },
    );
    assert!(e.contains("`offsets`") && e.contains("[2]"), "{e}");
    let offs = Tensor::from_vec(vec![0i32, 2], &[2]).unwrap();
    let e = err(
        &x,
        &cos,
        &sin,
        &RotaryOptions {
            offsets: Some(offs),
            ..Default::default()
        },
    );
    assert!(e.contains("`offsets`") && e.contains("position 6"), "{e}");
    // cu_seqlens that do not end at T.
    let xp = Tensor::rand(&[7, 3, 8], DType::F32, Device::Cpu, 1, -1.0, 1.0).unwrap();
    let cu = Tensor::from_vec(vec![0i32, 3, 6], &[3]).unwrap();
    let e = err(
        &xp,
        &cos,
        &sin,
        &RotaryOptions {
            cu_seqlens: Some(cu),
            ..Default::default()
        },
    );
    assert!(e.contains("`cu_seqlens`") && e.contains("7 rows"), "{e}");
    // out a different view of x.
    let out = x.as_strided(&[2, 5, 3, 8], &[0, 24, 8, 1], 0).unwrap();
    let e = rotary_into(&x, &cos, &sin, &out, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`out`") && e.contains("in place"), "{e}");
}
