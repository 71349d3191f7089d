//! matmul tests: the check harness on every device present, and every bad input.

use super::*;

#[test]
fn every_variant_passes_check() {
    crate::core::harness::check::assert_quick_check_passes(
        check::run,
        // Every CPU variant and the default path, on every quick case.
        (variants()
            .iter()
            .filter(|v| v.backend == Backend::Cpu)
            .count()
            + 1)
            * check::cases(true).len(),
    );
}

#[test]
fn check_catches_a_wrong_result() {
    // The harness itself must be able to fail: a perturbed output exceeds the tolerance.
    let c = check::Case {
        batch: 1,
        m: 9,
        n: 7,
        k: 5,
        a_trans: false,
        b_trans: false,
        broadcast_b: false,
        pad: 0,
        offset: 2,
        alpha: 1.0,
        beta: 0.0,
    };
    let (a, b, _) = check::inputs(&c, Device::Cpu, DType::F32, 3).unwrap();
    let r = check::reference(&c, &a, &b, None).unwrap();
    let mut out = matmul(&a, &b).unwrap().to_f64_vec().unwrap();
    assert!(crate::core::harness::check::rel_error(&out, &r) < 1e-6);
    out[17] += 0.01;
    assert!(crate::core::harness::check::rel_error(&out, &r) > 5e-6);
}

fn err_of(r: Result<()>) -> String {
    r.expect_err("expected an error").to_string()
}

#[test]
fn bad_inputs_get_clear_errors() {
    let t = |s: &[usize]| Tensor::rand(s, DType::F32, Device::Cpu, 1, -1.0, 1.0).unwrap();
    let o = MatmulOptions::default();
    // Inner dimensions.
    let e = err_of(matmul_into(&t(&[3, 4]), &t(&[5, 6]), &t(&[3, 6]), &o));
    assert!(
        e.contains("matmul") && e.contains("`b`") && e.contains("4 vs 5"),
        "{e}"
    );
    // Output shape.
    let e = err_of(matmul_into(&t(&[3, 4]), &t(&[4, 6]), &t(&[3, 5]), &o));
    assert!(e.contains("`out`") && e.contains("[3, 6]"), "{e}");
    // Dtype mismatch.
    let b16 = Tensor::rand(&[4, 6], DType::BF16, Device::Cpu, 1, -1.0, 1.0).unwrap();
    let e = err_of(matmul_into(&t(&[3, 4]), &b16, &t(&[3, 6]), &o));
    assert!(e.contains("dtype f32") && e.contains("bf16"), "{e}");
    // Integer dtype.
    let i = Tensor::from_vec(vec![1i32; 4], &[2, 2]).unwrap();
    let e = err_of(matmul_into(
        &i,
        &i.clone()
            .contiguous()
            .unwrap()
            .to_device(Device::Cpu)
            .unwrap(),
        &i,
        &o,
    ));
    assert!(
        e.contains("f32, f16 or bf16") || e.contains("distinct"),
        "{e}"
    );
    // Rank.
    let e = matmul(&t(&[4]), &t(&[4, 2])).unwrap_err().to_string();
    assert!(e.contains("2-D"), "{e}");
    // Strided: neither of the last two dims has stride 1.
    let base = t(&[48]);
    let strided = base.as_strided(&[4, 6], &[12, 2], 0).unwrap();
    let e = matmul(&strided, &t(&[6, 2])).unwrap_err().to_string();
    assert!(
        e.contains("`a`") && e.contains("stride 1") && e.contains("strides [12, 2]"),
        "{e}"
    );
    // Overlapping output batches.
    let out = t(&[16]).as_strided(&[2, 2, 2], &[2, 2, 1], 0).unwrap();
    let e = err_of(matmul_into(&t(&[2, 2, 3]), &t(&[3, 2]), &out, &o));
    assert!(e.contains("`out`") && e.contains("overlap"), "{e}");
    // Aliasing output.
    let a = t(&[4, 4]);
    let e = err_of(matmul_into(&a, &t(&[4, 4]), &a, &o));
    assert!(e.contains("distinct"), "{e}");
    // Unknown / unsupported variant.
    let e = err_of(matmul_into(
        &t(&[2, 2]),
        &t(&[2, 2]),
        &t(&[2, 2]),
        &MatmulOptions {
            variant: Some("warp9".into()),
            ..o.clone()
        },
    ));
    assert!(e.contains("warp9") && e.contains("naive"), "{e}");
    let e = err_of(matmul_into(
        &t(&[2, 2]),
        &t(&[2, 2]),
        &t(&[2, 2]),
        &MatmulOptions {
            precision: Precision::Tf32,
            ..o.clone()
        },
    ));
    assert!(e.contains("tf32"), "{e}");
    // bf16 on the CPU ladder (f32 only).
    let e = matmul(&b16.t().unwrap(), &b16).unwrap_err().to_string();
    assert!(e.contains("bf16"), "{e}");
    // Batch mismatch.
    let e = matmul(&t(&[2, 3, 4]), &t(&[3, 4, 5]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("batch 2"), "{e}");
}

#[test]
fn empty_and_transposed_views() {
    let a = Tensor::rand(&[0, 5], DType::F32, Device::Cpu, 1, -1.0, 1.0).unwrap();
    let b = Tensor::rand(&[5, 3], DType::F32, Device::Cpu, 2, -1.0, 1.0).unwrap();
    assert_eq!(matmul(&a, &b).unwrap().shape(), &[0, 3]);
    // k = 0: C = 0 (β = 0), every element written.
    let a = Tensor::rand(&[4, 0], DType::F32, Device::Cpu, 1, -1.0, 1.0).unwrap();
    let b = Tensor::rand(&[0, 3], DType::F32, Device::Cpu, 2, -1.0, 1.0).unwrap();
    let out = Tensor::empty(&[4, 3], DType::F32, Device::Cpu).unwrap();
    out.poison(None).unwrap();
    matmul_into(&a, &b, &out, &MatmulOptions::default()).unwrap();
    assert!(out.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.0));
}

#[test]
fn gpu_errors_without_a_gpu_are_clear() {
    if crate::core::cuda::availability().is_ok() {
        return;
    }
    let e = Tensor::empty(&[2, 2], DType::F32, Device::Cuda(0))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("CUDA unavailable:"), "{e}");
}

/// The tuner's `wgmma` configurations: the default first (what runs when measuring is not
/// possible), every one compiled by the kernel build (its cluster size is in WG_CLUSTERS), names
/// unique and accepted back by `MatmulOptions::config`, a wrong name a clear error.
#[test]
fn wgmma_tuner_configs() {
    use cuda::{wg_config_named, WG_CLUSTERS, WG_CONFIGS, WG_DEFAULT};
    assert_eq!(WG_CONFIGS[0], WG_DEFAULT);
    let mut names = std::collections::HashSet::new();
    for c in WG_CONFIGS {
        assert!(
            WG_CLUSTERS.contains(&c.cluster),
            "{c}: cluster not compiled"
        );
        assert!(c.group_m >= 1);
        assert!(names.insert(c.to_string()), "{c}: duplicate name");
        assert_eq!(wg_config_named(&c.to_string()).unwrap(), c);
        // The same launch with C stored from registers, by its `d` name.
        let direct = wg_config_named(&format!("{c}d")).unwrap();
        assert!(c.tma_store && !direct.tma_store);
        assert_eq!((direct.cluster, direct.group_m), (c.cluster, c.group_m));
    }
    assert!(wg_config_named("c2g8dd").is_err());
    let e = wg_config_named("c3g8").unwrap_err().to_string();
    assert!(
        e.contains("config") && e.contains("c3g8") && e.contains("c2g8"),
        "{e}"
    );
}

/// The developer knob forcing the activation-backward kernel's group height: 1–64 accepted, the
/// rest a clear error naming the variable.
/// Where element (r, c) of an operand lies, in elements from its start.
fn offset(o: &Operand, r: usize, c: usize) -> usize {
    if o.trans {
        c * o.ld + r
    } else {
        r * o.ld + c
    }
}

#[test]
fn relaid_operands_address_the_same_elements() {
    let mut relaid = 0;
    for rows in 0..4 {
        for cols in 0..4 {
            for ld in 1..6 {
                for trans in [false, true] {
                    let minor = if trans { rows } else { cols };
                    if ld < minor {
                        continue;
                    }
                    let o = Operand {
                        ld,
                        trans,
                        batch_stride: 7,
                    };
                    assert_eq!(o.relaid(rows, cols, trans), Some(o));
                    let Some(t) = o.relaid(rows, cols, !trans) else {
                        // Refused only where some element moves: a real 2-D layout, or a line
                        // whose elements are not adjacent.
                        assert!(
                            rows > 1 && cols > 1 || ld > 1,
                            "{rows}×{cols} ld {ld} {trans}"
                        );
                        continue;
                    };
                    relaid += 1;
                    assert_eq!((t.trans, t.batch_stride), (!trans, 7));
                    let new_minor = if t.trans { rows } else { cols };
                    assert!(t.ld >= new_minor.max(1), "{rows}×{cols}: ld {}", t.ld);
                    for r in 0..rows {
                        for c in 0..cols {
                            assert_eq!(
                                offset(&o, r, c),
                                offset(&t, r, c),
                                "{rows}×{cols} ({r},{c})"
                            );
                        }
                    }
                }
            }
        }
    }
    assert!(relaid > 40, "{relaid}");
}

/// The default f32 selection takes `warptile` from 4096² outputs (batches counted), and the
/// product cannot overflow into a small number.
#[test]
fn warptile_is_the_f32_default_only_for_large_outputs() {
    let op = Operand {
        ld: 1,
        trans: false,
        batch_stride: 0,
    };
    let g = |batch, m, n| Gemm {
        batch,
        m,
        n,
        k: 7,
        a: op,
        b: op,
        c: op,
        dtype: DType::F32,
        device: Device::Cpu,
    };
    assert!(warptile_fills(&g(1, 4096, 4096)));
    assert!(warptile_fills(&g(4, 2048, 2048)));
    assert!(!warptile_fills(&g(1, 4095, 4096)));
    assert!(!warptile_fills(&g(3, 2048, 2048)));
    assert!(!warptile_fills(&g(1, 127, 255)));
    assert!(warptile_fills(&g(usize::MAX, usize::MAX, 2)));
}

/// `skinny` takes short, K-contiguous, 16-bit problems only, and the default gives it up to 8
/// rows of A.
#[test]
fn skinny_takes_short_k_contiguous_halves() {
    let op = |trans| Operand {
        ld: 4096,
        trans,
        batch_stride: 0,
    };
    let g = |m, n, k, dtype, at, bt| Gemm {
        batch: 1,
        m,
        n,
        k,
        a: op(at),
        b: op(bt),
        c: op(false),
        dtype,
        device: Device::Cpu,
    };
    let bf = DType::BF16;
    assert!(cuda::skinny_declines(&g(1, 4096, 4096, bf, false, true)).is_none());
    assert!(cuda::skinny_declines(&g(64, 5, 3, DType::F16, false, true)).is_none());
    let why = cuda::skinny_declines(&g(65, 4096, 4096, bf, false, true)).unwrap();
    assert!(why.contains("m ≤ 64") && why.contains("65"), "{why}");
    assert!(cuda::skinny_declines(&g(1, 4096, 4096, DType::F32, false, true)).is_some());
    assert!(cuda::skinny_declines(&g(1, 4096, 4096, bf, false, false)).is_some());
    assert!(cuda::skinny_declines(&g(1, 4096, 4096, bf, true, true)).is_some());
    assert!(cuda::skinny_by_default(&g(1, 4096, 4096, bf, false, true)));
    assert!(cuda::skinny_by_default(&g(8, 50257, 768, bf, false, true)));
    assert!(!cuda::skinny_by_default(&g(9, 4096, 4096, bf, false, true)));
    assert!(cuda::skinny_by_default(&g(
        1, 128256, 4096, bf, false, true
    )));
    // In a selection: by name up to 64 rows, by default up to 8, never where it declines.
    let tall = g(33, 4096, 4096, bf, false, true);
    assert!(cuda::skinny_refuses(&tall, true).is_none());
    assert!(cuda::skinny_refuses(&tall, false).is_some());
    assert!(cuda::skinny_refuses(&g(8, 4096, 4096, bf, false, true), false).is_none());
    assert!(cuda::skinny_refuses(&g(1, 4096, 4096, bf, false, false), true).is_some());
}

/// `ferrite info`'s words for the default rule name the thresholds the code uses.
#[test]
fn the_default_rule_text_matches_the_thresholds() {
    assert!(DEFAULT_RULE.contains("4096²") && WARPTILE_MIN_OUTPUTS == 4096 * 4096);
    assert!(DEFAULT_RULE.contains("m ≤ 8") && cuda::SKINNY_DEFAULT_MAX_M == 8);
    assert!(DEFAULT_RULE.contains("m ≤ 64") && cuda::SKINNY_MAX_M == 64);
    assert!(DEFAULT_RULE.contains("2^24") && cuda::REPITCH_MIN_MACS == 1 << 24);
    assert!(DEFAULT_RULE.contains(&format!("`{F32_DEFAULT}`")));
}
