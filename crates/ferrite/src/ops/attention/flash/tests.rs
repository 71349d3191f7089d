//! The flash rung's tests: backward tile geometries (everywhere), flash against an f64 reference
//! on small odd shapes (GPU), and a timing for a manual GPU run.

use super::*;

mod geometry {
    use super::*;

    #[test]
    fn backward_geometries_tile_every_head_dim() {
        for d in HEAD_DIMS {
            let cands = BwdGeom::candidates(d);
            assert_eq!(cands[0], BwdGeom::default_for(d));
            for g in cands {
                assert!(g.fits(d), "{g:?} at D{d}");
                // 227 KiB of shared memory per block on the H100, 163 KiB on the A100.
                assert!(g.smem(d, DType::BF16) <= 163 * 1024, "{g:?} at D{d}");
            }
        }
        // Warp grids that do not divide the dQ product are refused.
        assert!(!BwdGeom {
            warps: 4,
            bm: 32,
            qm: 2
        }
        .fits(96));
        assert!(!BwdGeom {
            warps: 3,
            bm: 32,
            qm: 1
        }
        .fits(64));
        assert!(!BwdGeom {
            warps: 4,
            bm: 48,
            qm: 1
        }
        .fits(64));
    }
}

mod gpu_smoke {
    //! Flash vs an f64 reference on small odd shapes; runs only where a GPU is present.
    use super::*;
    use crate::core::device::Device;

    struct Case {
        b: usize,
        hq: usize,
        hkv: usize,
        sq: usize,
        sk: usize,
        d: usize,
        wl: i64,
        wr: i64,
        softcap: f32,
    }

    /// o, lse, dq, dk, dv in f64 for bshd-contiguous inputs.
    #[allow(clippy::type_complexity)]
    fn reference(
        c: &Case,
        scale: f64,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        dout: &[f32],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (d, hq, hkv) = (c.d, c.hq, c.hkv);
        let qi = |b: usize, i: usize, h: usize| ((b * c.sq + i) * hq + h) * d;
        let ki = |b: usize, j: usize, h: usize| ((b * c.sk + j) * hkv + h) * d;
        let mut o = vec![0.0; q.len()];
        let mut lse = vec![f64::NEG_INFINITY; c.b * hq * c.sq];
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        let off = c.sk as i64 - c.sq as i64;
        for b in 0..c.b {
            for h in 0..hq {
                let hk = h / (hq / hkv);
                for i in 0..c.sq {
                    let pos = i as i64 + off;
                    let vis = |j: usize| {
                        let j = j as i64;
                        (c.wl < 0 || j >= pos - c.wl) && (c.wr < 0 || j <= pos + c.wr)
                    };
                    let mut s = vec![f64::NEG_INFINITY; c.sk];
                    let mut raw = vec![0.0; c.sk];
                    for (j, sj) in s.iter_mut().enumerate() {
                        if !vis(j) {
                            continue;
                        }
                        let mut acc = 0.0;
                        for e in 0..d {
                            acc += q[qi(b, i, h) + e] as f64 * k[ki(b, j, hk) + e] as f64;
                        }
                        let x = acc * scale;
                        raw[j] = x;
                        *sj = if c.softcap > 0.0 {
                            c.softcap as f64 * (x / c.softcap as f64).tanh()
                        } else {
                            x
                        };
                    }
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    if m == f64::NEG_INFINITY {
                        continue;
                    }
                    let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
                    lse[(b * hq + h) * c.sq + i] = m + l.ln();
                    let p: Vec<f64> = s.iter().map(|x| (x - m).exp() / l).collect();
                    for e in 0..d {
                        o[qi(b, i, h) + e] =
                            (0..c.sk).map(|j| p[j] * v[ki(b, j, hk) + e] as f64).sum();
                    }
                    let delta: f64 = (0..d)
                        .map(|e| dout[qi(b, i, h) + e] as f64 * o[qi(b, i, h) + e])
                        .sum();
                    for j in 0..c.sk {
                        if p[j] == 0.0 {
                            continue;
                        }
                        let dp: f64 = (0..d)
                            .map(|e| dout[qi(b, i, h) + e] as f64 * v[ki(b, j, hk) + e] as f64)
                            .sum();
                        let mut ds = p[j] * (dp - delta);
                        if c.softcap > 0.0 {
                            let t = (raw[j] / c.softcap as f64).tanh();
                            ds *= 1.0 - t * t;
                        }
                        for e in 0..d {
                            dv[ki(b, j, hk) + e] += p[j] * dout[qi(b, i, h) + e] as f64;
                            dq[qi(b, i, h) + e] += scale * ds * k[ki(b, j, hk) + e] as f64;
                            dk[ki(b, j, hk) + e] += scale * ds * q[qi(b, i, h) + e] as f64;
                        }
                    }
                }
            }
        }
        (o, lse, dq, dk, dv)
    }

    fn rel(got: &[f32], want: &[f64]) -> f64 {
        let mut num: f64 = 0.0;
        let mut den: f64 = 1e-30;
        for (g, w) in got.iter().zip(want) {
            if w.is_infinite() {
                if (*g as f64) != *w {
                    return f64::INFINITY;
                }
                continue;
            }
            let e = (*g as f64 - w).abs();
            if e.is_nan() {
                return f64::INFINITY;
            }
            num = num.max(e);
            den = den.max(w.abs());
        }
        num / den
    }

    #[test]
    fn flash_compiles_with_nvrtc() {
        if crate::core::cuda::nvrtc_available().is_err() {
            return;
        }
        for spec in kernel_specs()
            .into_iter()
            .chain(crate::ops::attention::hopper::kernel_specs())
        {
            for arch in [
                crate::core::device::Arch::SM80,
                crate::core::device::Arch::SM90,
            ] {
                if arch < spec.min_arch {
                    continue;
                }
                crate::core::cuda::jit::compile(&spec.program, arch).unwrap();
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_flash_matches_reference() {
        let dev = crate::core::cuda::device(0).unwrap();
        let stream = dev.stream().clone();
        let cases = [
            Case {
                b: 2,
                hq: 4,
                hkv: 2,
                sq: 200,
                sk: 333,
                d: 64,
                wl: -1,
                wr: -1,
                softcap: 0.0,
            },
            Case {
                b: 2,
                hq: 4,
                hkv: 2,
                sq: 200,
                sk: 333,
                d: 128,
                wl: -1,
                wr: 0,
                softcap: 0.0,
            },
            Case {
                b: 1,
                hq: 3,
                hkv: 1,
                sq: 257,
                sk: 129,
                d: 128,
                wl: -1,
                wr: 0,
                softcap: 0.0,
            },
            Case {
                b: 1,
                hq: 2,
                hkv: 2,
                sq: 300,
                sk: 300,
                d: 64,
                wl: 37,
                wr: 5,
                softcap: 20.0,
            },
            Case {
                b: 1,
                hq: 2,
                hkv: 1,
                sq: 65,
                sk: 190,
                d: 96,
                wl: 10,
                wr: 0,
                softcap: 0.0,
            },
        ];
        for (n, c) in cases.iter().enumerate() {
            for dt in [DType::BF16, DType::F16] {
                let dv = Device::Cuda(0);
                let qs = [c.b, c.sq, c.hq, c.d];
                let ks = [c.b, c.sk, c.hkv, c.d];
                let q = Tensor::rand(&qs, dt, dv, 1 + n as u64, -1.0, 1.0).unwrap();
                let k = Tensor::rand(&ks, dt, dv, 2 + n as u64, -1.0, 1.0).unwrap();
                let v = Tensor::rand(&ks, dt, dv, 3 + n as u64, -1.0, 1.0).unwrap();
                let dout = Tensor::rand(&qs, dt, dv, 4 + n as u64, -1.0, 1.0).unwrap();
                let o = Tensor::empty(&qs, dt, dv).unwrap();
                let lse = Tensor::empty(&[c.b, c.hq, c.sq], DType::F32, dv).unwrap();
                let dq = Tensor::empty(&qs, dt, dv).unwrap();
                let dk = Tensor::empty(&ks, dt, dv).unwrap();
                let dvv = Tensor::empty(&ks, dt, dv).unwrap();
                for t in [&o, &lse, &dq, &dk, &dvv] {
                    t.poison(None).unwrap();
                }
                let scale = 1.0 / (c.d as f32).sqrt();
                let p = Problem {
                    scale,
                    softcap: c.softcap,
                    window_left: c.wl,
                    window_right: c.wr,
                    ..Problem::padded_bshd(c.b, (c.hq, c.hkv), (c.sq, c.sk), c.d, dt, dv)
                };
                forward_with(
                    3 - default_fwd_mt(c.d),
                    &dev,
                    &stream,
                    &p,
                    &q,
                    &k,
                    &v,
                    &o,
                    &lse,
                    None,
                )
                .unwrap();
                dev.synchronize(&stream, "flash smoke").unwrap();
                let o_other = o.to_f32_vec().unwrap();
                o.poison(None).unwrap();
                forward(&dev, &stream, &p, &q, &k, &v, &o, &lse, None).unwrap();
                dev.synchronize(&stream, "flash smoke").unwrap();
                let f = |t: &Tensor| t.to_f32_vec().unwrap();
                let (ro, rl, rdq, rdk, rdv) =
                    reference(c, scale as f64, &f(&q), &f(&k), &f(&v), &f(&dout));
                let errs = [
                    ("o (other fwd shape)", rel(&o_other, &ro)),
                    ("o", rel(&f(&o), &ro)),
                    ("lse", rel(&f(&lse), &rl)),
                ];
                eprintln!("case {n} {dt}: {errs:?}");
                for (name, e) in errs {
                    assert!(e < 2e-2, "case {n} {dt}: {name} rel error {e}");
                }
                // Every backward: the deterministic one and each atomic geometry.
                let modes = std::iter::once(BwdMode::Deterministic)
                    .chain(BwdGeom::candidates(c.d).into_iter().map(BwdMode::Atomic));
                for mode in modes {
                    for t in [&dq, &dk, &dvv] {
                        t.poison(None).unwrap();
                    }
                    let t = Bwd {
                        dout: &dout,
                        q: &q,
                        k: &k,
                        v: &v,
                        o: &o,
                        lse: &lse,
                        dq: &dq,
                        dk: &dk,
                        dv: &dvv,
                    };
                    backward(&dev, &stream, &p, &t, None, mode).unwrap();
                    dev.synchronize(&stream, "flash smoke").unwrap();
                    let errs = [
                        ("dq", rel(&f(&dq), &rdq)),
                        ("dk", rel(&f(&dk), &rdk)),
                        ("dv", rel(&f(&dvv), &rdv)),
                    ];
                    eprintln!("case {n} {dt} {mode:?}: {errs:?}");
                    for (name, e) in errs {
                        assert!(e < 2e-2, "case {n} {dt} {mode:?}: {name} rel error {e}");
                    }
                }
                if dev.arch().major == 9 && crate::ops::attention::hopper::unfit(&p, &[]).is_none()
                {
                    for t in [&o, &lse] {
                        t.poison(None).unwrap();
                    }
                    for cfg in crate::ops::attention::hopper::Config::ALL {
                        for t in [&o, &lse] {
                            t.poison(None).unwrap();
                        }
                        crate::ops::attention::hopper::forward_with(
                            cfg, &dev, &stream, &p, &q, &k, &v, &o, &lse, None,
                        )
                        .unwrap();
                        dev.synchronize(&stream, "hopper smoke").unwrap();
                        let errs = [("o", rel(&f(&o), &ro)), ("lse", rel(&f(&lse), &rl))];
                        eprintln!("case {n} {dt} hopper {cfg:?}: {errs:?}");
                        for (name, e) in errs {
                            assert!(
                                e < 2e-2,
                                "case {n} {dt} hopper {cfg:?}: {name} rel error {e}"
                            );
                        }
                    }
                }
            }
        }
    }
}

mod gpu_speed {
    //! `cargo test flash_speed -- --ignored --nocapture` on a GPU: TFLOP/s of the flash rung at
    //! B4 H16 S4096 (forward 4·B·H·S²·D, halved when causal; backward 2.5× forward).
    use super::*;
    use crate::core::device::Device;
    use crate::core::harness::bench::{time_gpu, Budget};

    #[test]
    #[ignore = "a timing, for a manual run on a GPU: cargo test --release -p ferrite --lib flash_speed -- --ignored --nocapture"]
    fn flash_speed() {
        let dev = crate::core::cuda::device(0).unwrap();
        let stream = dev.stream().clone();
        let dv = Device::Cuda(0);
        for d in [128usize, 64] {
            let (b, h, s) = (4usize, 16usize, 4096usize);
            let shape = [b, s, h, d];
            let t = |seed| Tensor::rand(&shape, DType::BF16, dv, seed, -1.0, 1.0).unwrap();
            let (q, k, v, dout) = (t(1), t(2), t(3), t(4));
            let (o, dq, dk, dvv) = (t(5), t(6), t(7), t(8));
            let lse = Tensor::empty(&[b, h, s], DType::F32, dv).unwrap();
            for causal in [false, true] {
                let p = Problem {
                    window_right: if causal { 0 } else { -1 },
                    ..Problem::padded_bshd(b, (h, h), (s, s), d, DType::BF16, dv)
                };
                let flops = 4.0 * (b * h * s * s * d) as f64 / if causal { 2.0 } else { 1.0 };
                for mt in [1, 2] {
                    let f = time_gpu(&dev, &stream, Budget::gpu(), |_| {
                        forward_with(mt, &dev, &stream, &p, &q, &k, &v, &o, &lse, None)
                    })
                    .unwrap();
                    eprintln!(
                        "D{d} causal={causal}: flash fwd mt={mt} {:.3} ms {:.0} TFLOP/s",
                        f.median_ms,
                        flops / f.median_ms / 1e9
                    );
                }
                let f = time_gpu(&dev, &stream, Budget::gpu(), |_| {
                    forward(&dev, &stream, &p, &q, &k, &v, &o, &lse, None)
                })
                .unwrap();
                for cfg in crate::ops::attention::hopper::Config::ALL {
                    let hf = time_gpu(&dev, &stream, Budget::gpu(), |_| {
                        crate::ops::attention::hopper::forward_with(
                            cfg, &dev, &stream, &p, &q, &k, &v, &o, &lse, None,
                        )
                    })
                    .unwrap();
                    eprintln!(
                        "D{d} causal={causal}: hopper {cfg:?} fwd {:.3} ms {:.0} TFLOP/s",
                        hf.median_ms,
                        flops / hf.median_ms / 1e9
                    );
                }
                eprintln!(
                    "D{d} causal={causal}: fwd {:.3} ms {:.0} TFLOP/s",
                    f.median_ms,
                    flops / f.median_ms / 1e9,
                );
                let t = Bwd {
                    dout: &dout,
                    q: &q,
                    k: &k,
                    v: &v,
                    o: &o,
                    lse: &lse,
                    dq: &dq,
                    dk: &dk,
                    dv: &dvv,
                };
                let modes = std::iter::once(BwdMode::Deterministic)
                    .chain(BwdGeom::candidates(d).into_iter().map(BwdMode::Atomic));
                for mode in modes {
                    let bw = time_gpu(&dev, &stream, Budget::gpu(), |_| {
                        backward(&dev, &stream, &p, &t, None, mode)
                    })
                    .unwrap();
                    eprintln!(
                        "D{d} causal={causal}: bwd {} {:.3} ms {:.0} TFLOP/s",
                        mode.describe(),
                        bw.median_ms,
                        2.5 * flops / bw.median_ms / 1e9
                    );
                }
            }
        }
    }
}
