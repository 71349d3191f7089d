use super::*;
use crate::core::harness::CheckConfig;

fn check_on(devices: Vec<Device>, variants: Vec<String>) {
    let cfg = CheckConfig {
        devices,
        variants,
        dtypes: vec![],
        seed: 7,
        quick: true,
    };
    let mut out = Vec::new();
    check::run(&cfg, &mut out).unwrap();
    assert!(!out.is_empty());
    let bad: Vec<_> = out.iter().filter(|r| !r.pass).collect();
    assert!(bad.is_empty(), "failed: {bad:#?}");
}

#[test]
fn cpu_variants_match_the_f64_reference() {
    check_on(vec![Device::Cpu], vec![]);
}

#[test]
#[ignore = "needs a GPU"]
fn gpu_variants_match_the_f64_reference() {
    check_on(vec![Device::Cuda(0)], vec![]);
}

fn weights(e: usize, h: usize, i: usize) -> [Tensor; 4] {
    let d = Device::Cpu;
    [
        Tensor::rand(&[5, h], DType::F32, d, 1, -1.0, 1.0).unwrap(),
        Tensor::rand(&[e, h], DType::F32, d, 2, -1.0, 1.0).unwrap(),
        Tensor::rand(&[e, h, 2 * i], DType::F32, d, 3, -1.0, 1.0).unwrap(),
        Tensor::rand(&[e, i, h], DType::F32, d, 4, -1.0, 1.0).unwrap(),
    ]
}

#[test]
fn bad_configs_are_named() {
    let [x, r, u, dn] = weights(4, 8, 6);
    let w = MoeWeights {
        router: &r,
        w_up: &u,
        w_down: &dn,
    };
    let o = MoeOptions::default();
    let err = |cfg: MoeConfig| moe_forward(&x, &w, &cfg, &o).err().unwrap().to_string();
    assert!(err(MoeConfig::new(4, 0)).contains("top_k"));
    assert!(err(MoeConfig::new(4, 5)).contains("top_k"));
    assert!(err(MoeConfig::new(3, 1)).contains("router"));
    assert!(err(MoeConfig {
        capacity_factor: Some(0.0),
        ..MoeConfig::new(4, 2)
    })
    .contains("capacity_factor"));
    assert!(err(MoeConfig {
        capacity_factor: Some(f32::NAN),
        ..MoeConfig::new(4, 2)
    })
    .contains("capacity_factor"));
    assert!(err(MoeConfig {
        groups: 3,
        ..MoeConfig::new(4, 2)
    })
    .contains("groups"));
    assert!(err(MoeConfig {
        groups: 4,
        topk_groups: 1,
        ..MoeConfig::new(4, 2)
    })
    .contains("top_k"));
    // Mismatched expert weights.
    let u2 = Tensor::rand(&[4, 7, 12], DType::F32, Device::Cpu, 3, -1.0, 1.0).unwrap();
    let w2 = MoeWeights { w_up: &u2, ..w };
    let e = moe_forward(&x, &w2, &MoeConfig::new(4, 2), &o)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("w_up"), "{e}");
    let d16 = dn.to_dtype_for_test(DType::BF16);
    let w3 = MoeWeights { w_down: &d16, ..w };
    let e = moe_forward(&x, &w3, &MoeConfig::new(4, 2), &o)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("w_down"), "{e}");
}

impl Tensor {
    fn to_dtype_for_test(&self, dt: DType) -> Tensor {
        let t = Tensor::empty(self.shape(), dt, Device::Cpu).unwrap();
        t.write_f32(&self.to_f32_vec().unwrap()).unwrap();
        t
    }
}

#[test]
fn token_pair_count_overflow_is_refused() {
    let cfg = MoeConfig::new(8, 8);
    let e = cfg.validate(usize::MAX / 4).err().unwrap().to_string();
    assert!(e.contains("2³¹"), "{e}");
    assert!(cfg.validate(1 << 20).is_ok());
}

#[test]
fn nan_logits_route_in_bounds_and_poison_the_weights() {
    let cfg = MoeConfig::new(6, 2);
    let logits = [0.5, f32::NAN, 2.0, -1.0, f32::NAN, 1.0];
    let (idx, w, _, _) = cpu::route(&logits, &cfg);
    assert_eq!(idx, vec![2, 5]);
    assert!(w.iter().all(|v| v.is_nan()));
    let all_nan = [f32::NAN; 6];
    let (idx, _, _, _) = cpu::route(&all_nan, &cfg);
    assert_eq!(idx, vec![0, 1]);
}

#[test]
fn plan_pads_segments_and_drops_past_capacity() {
    // 6 pairs: experts 1, 0, 1, 1, 2, 1; capacity 2.
    let idx = [1, 0, 1, 1, 2, 1];
    let (pos, src, ends, counts, dropped) = cpu::plan(&idx, 4, Some(2), 6 + 4 * 127);
    assert_eq!(counts, vec![1, 4, 1, 0]);
    assert_eq!(ends, vec![128, 256, 384, 384]);
    assert_eq!(dropped, 2);
    assert_eq!(pos, vec![128, 0, 129, -1, 256, -1]);
    assert_eq!(src[0], 1);
    assert_eq!(src[128], 0);
    assert_eq!(src[129], 2);
    assert_eq!(src[130], -1);
}

#[test]
fn grouped_mm_rejects_bad_offsets() {
    let d = Device::Cpu;
    let a = Tensor::rand(&[10, 4], DType::F32, d, 1, -1.0, 1.0).unwrap();
    let b = Tensor::rand(&[3, 4, 5], DType::F32, d, 2, -1.0, 1.0).unwrap();
    let o = Tensor::empty(&[10, 5], DType::F32, d).unwrap();
    let run = |ends: Vec<i32>| {
        let offs = Tensor::from_vec(ends, &[3]).unwrap();
        grouped_mm(&a, &b, &offs, &o, &MoeOptions::default())
    };
    assert!(run(vec![2, 6, 10]).is_ok());
    let e = run(vec![6, 2, 10]).err().unwrap().to_string();
    assert!(e.contains("nondecreasing"), "{e}");
    let e = run(vec![2, 6, 9]).err().unwrap().to_string();
    assert!(e.contains("last end"), "{e}");
    let bt = Tensor::rand(&[3, 5, 4], DType::F32, d, 2, -1.0, 1.0)
        .unwrap()
        .transpose(1, 2)
        .unwrap();
    let offs = Tensor::from_vec(vec![2, 6, 10], &[3]).unwrap();
    grouped_mm(&a, &bt, &offs, &o, &MoeOptions::default()).unwrap();
    let bad = Tensor::rand(&[3, 5, 4], DType::F32, d, 2, -1.0, 1.0).unwrap();
    let e = grouped_mm(&a, &bad, &offs, &o, &MoeOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("[groups, 4, n]"), "{e}");
}

#[test]
fn loss_grad_scales_the_aux_and_z_terms() {
    let d = Device::Cpu;
    let x = Tensor::rand(&[30, 8], DType::F32, d, 1, -1.0, 1.0).unwrap();
    let r = Tensor::rand(&[4, 8], DType::F32, d, 2, -1.0, 1.0).unwrap();
    let u = Tensor::rand(&[4, 8, 12], DType::F32, d, 3, -0.3, 0.3).unwrap();
    let dn = Tensor::rand(&[4, 6, 8], DType::F32, d, 4, -0.3, 0.3).unwrap();
    let g = Tensor::rand(&[30, 8], DType::F32, d, 5, -1.0, 1.0).unwrap();
    let w = MoeWeights {
        router: &r,
        w_up: &u,
        w_down: &dn,
    };
    let o = MoeOptions::default();
    let base = MoeConfig {
        aux_loss_coef: 0.3,
        z_loss_coef: 0.02,
        ..MoeConfig::new(4, 2)
    };
    let f = moe_forward(&x, &w, &base, &o).unwrap();
    let p = f.problem;
    // loss_grad (2, 0.5) with the base coefficients = coefficients scaled by (2, 0.5).
    let lg = Tensor::from_vec(vec![2.0f32, 0.5], &[2]).unwrap();
    let g1 = MoeGrads::alloc(&p, None).unwrap();
    moe_backward_into(&g, &x, &w, &f, &base, &g1, Some(&lg), &o).unwrap();
    let scaled = MoeConfig {
        aux_loss_coef: 0.6,
        z_loss_coef: 0.01,
        ..base.clone()
    };
    // One backward per forward: each gradient from a forward of its own (the same values).
    moe_forward_into(&x, &w, &base, &f, &o).unwrap();
    let g2 = moe_backward(&g, &x, &w, &f, &scaled, &o).unwrap();
    let (a, b) = (
        g1.d_router.to_f32_vec().unwrap(),
        g2.d_router.to_f32_vec().unwrap(),
    );
    assert_eq!(a, b);
    // And differs from the unscaled gradient.
    moe_forward_into(&x, &w, &base, &f, &o).unwrap();
    let g3 = moe_backward(&g, &x, &w, &f, &base, &o).unwrap();
    assert_ne!(a, g3.d_router.to_f32_vec().unwrap());
}

#[test]
fn a_forward_only_state_is_refused_by_the_backward() {
    let [x, router, wu, wd] = weights(4, 16, 8);
    let w = MoeWeights {
        router: &router,
        w_up: &wu,
        w_down: &wd,
    };
    let cfg = MoeConfig::new(4, 2);
    let inf = MoeOptions {
        forward_only: true,
        ..Default::default()
    };
    let f = moe_forward(&x, &w, &cfg, &inf).unwrap();
    let dout = Tensor::rand(&[x.shape()[0], 16], DType::F32, Device::Cpu, 5, -1.0, 1.0).unwrap();
    let e = moe_backward(&dout, &x, &w, &f, &cfg, &MoeOptions::default())
        .err()
        .expect("a forward_only state must be refused")
        .to_string();
    assert!(e.contains("forward_only"), "{e}");
    // The same buffers after a forward with a backward to come are accepted.
    moe_forward_into(&x, &w, &cfg, &f, &MoeOptions::default()).unwrap();
    moe_backward(&dout, &x, &w, &f, &cfg, &MoeOptions::default()).unwrap();
    // Once: the backward consumed the state (on CUDA its gradient is written over hpre).
    let e = moe_backward(&dout, &x, &w, &f, &cfg, &MoeOptions::default())
        .err()
        .expect("a second backward of one forward must be refused")
        .to_string();
    assert!(e.contains("one backward per forward"), "{e}");
    // A refused call does not consume it: a bad dout leaves the next forward's state usable.
    moe_forward_into(&x, &w, &cfg, &f, &MoeOptions::default()).unwrap();
    let bad = Tensor::rand(&[x.shape()[0], 15], DType::F32, Device::Cpu, 5, -1.0, 1.0).unwrap();
    assert!(moe_backward(&bad, &x, &w, &f, &cfg, &MoeOptions::default()).is_err());
    moe_backward(&dout, &x, &w, &f, &cfg, &MoeOptions::default()).unwrap();
}
