//! adamw tests: the check harness on every device present, torch's numbers, bad input.

use super::*;

#[test]
fn every_variant_passes_check() {
    // CPU: 2 variants × 3 dtype combinations × cases.
    crate::core::harness::check::assert_quick_check_passes(
        check::run,
        2 * 3 * check::cases(true).len(),
    );
}

fn t(v: &[f32]) -> Tensor {
    Tensor::from_vec(v.to_vec(), &[v.len()]).unwrap()
}

#[test]
fn matches_torch_first_step() {
    // torch.optim.AdamW([p], lr=0.1, weight_decay=0.5) on p = [1, -2], grad = [0.5, -0.25], one
    // step from zero state: m̂ = g, v̂ = g², so p ← p(1 − lr·wd) − lr·g/(|g| + eps).
    let (p, g, m, v) = (
        t(&[1.0, -2.0]),
        t(&[0.5, -0.25]),
        t(&[0.0, 0.0]),
        t(&[0.0, 0.0]),
    );
    let hp = AdamWHyper {
        lr: 0.1,
        weight_decay: 0.5,
        ..Default::default()
    };
    let list = [AdamWTensor {
        param: &p,
        grad: &g,
        exp_avg: &m,
        exp_avg_sq: &v,
        master: None,
    }];
    adamw_step(&list, &hp, &AdamWOptions::default()).unwrap();
    let p = p.to_vec::<f32>().unwrap();
    let want = [
        1.0 * 0.95 - 0.1 * 0.5 / (0.5 + 1e-8),
        -2.0 * 0.95 + 0.1 * 0.25 / (0.25 + 1e-8),
    ];
    assert!(
        (p[0] - want[0] as f32).abs() < 1e-6 && (p[1] - want[1] as f32).abs() < 1e-6,
        "{p:?}"
    );
    let m = m.to_vec::<f32>().unwrap();
    assert!((m[0] - 0.05).abs() < 1e-7, "{m:?}");
}

#[test]
fn bad_input_is_refused() {
    let (p, g, m, v) = (t(&[1.0; 4]), t(&[0.1; 4]), t(&[0.0; 4]), t(&[0.0; 4]));
    let ok = AdamWTensor {
        param: &p,
        grad: &g,
        exp_avg: &m,
        exp_avg_sq: &v,
        master: None,
    };
    let err = |ts: &[AdamWTensor], hp: AdamWHyper| {
        adamw_step(ts, &hp, &AdamWOptions::default())
            .unwrap_err()
            .to_string()
    };
    let d = AdamWHyper::default();
    for (hp, arg) in [
        (AdamWHyper { lr: -1e-3, ..d }, "`lr`"),
        (AdamWHyper { lr: f64::NAN, ..d }, "`lr`"),
        (AdamWHyper { eps: -1e-8, ..d }, "`eps`"),
        (AdamWHyper { beta1: 1.0, ..d }, "`beta1`"),
        (AdamWHyper { beta2: -0.1, ..d }, "`beta2`"),
        (
            AdamWHyper {
                weight_decay: -0.1,
                ..d
            },
            "`weight_decay`",
        ),
        (AdamWHyper { step: 0, ..d }, "`step`"),
        (
            AdamWHyper {
                grad_scale: 0.0,
                ..d
            },
            "`grad_scale`",
        ),
    ] {
        let e = err(&[ok], hp);
        assert!(e.contains(arg), "{arg}: {e}");
    }
    assert!(err(&[], d).contains("at least one"));
    let short = t(&[0.0; 3]);
    let e = err(
        &[AdamWTensor {
            exp_avg: &short,
            ..ok
        }],
        d,
    );
    assert!(
        e.contains("tensors[0].exp_avg") && e.contains("4 elements"),
        "{e}"
    );
    // bf16 param without a master; f32 param with one; bf16 moments.
    let pb = Tensor::full(&[4], DType::BF16, Device::Cpu, 1.0).unwrap();
    let gb = Tensor::full(&[4], DType::BF16, Device::Cpu, 0.1).unwrap();
    let e = err(
        &[AdamWTensor {
            param: &pb,
            grad: &gb,
            ..ok
        }],
        d,
    );
    assert!(e.contains("master"), "{e}");
    let w = t(&[1.0; 4]);
    let e = err(
        &[AdamWTensor {
            master: Some(&w),
            ..ok
        }],
        d,
    );
    assert!(e.contains("master") && e.contains("f32 param"), "{e}");
    let e = err(&[AdamWTensor { exp_avg: &gb, ..ok }], d);
    assert!(e.contains("exp_avg") && e.contains("f32"), "{e}");
    // f32 param with bf16 grad: unsupported combination.
    let e = err(&[AdamWTensor { grad: &gb, ..ok }], d);
    assert!(e.contains("grad"), "{e}");
    // Mixed dtypes across the list; aliasing.
    let (m2, v2, w2) = (t(&[0.0; 4]), t(&[0.0; 4]), t(&[1.0; 4]));
    let bf = AdamWTensor {
        param: &pb,
        grad: &gb,
        exp_avg: &m2,
        exp_avg_sq: &v2,
        master: Some(&w2),
    };
    let e = err(&[ok, bf], d);
    assert!(e.contains("tensors[1].param"), "{e}");
    let e = err(
        &[AdamWTensor {
            exp_avg_sq: &m,
            ..ok
        }],
        d,
    );
    assert!(e.contains("own"), "{e}");
    let e = err(&[ok, ok], d);
    assert!(e.contains("shared with tensors[1]"), "{e}");
}
