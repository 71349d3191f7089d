//! Every CPU variant (and the `gemm` peer) against an f64 reference.

use super::simd::{kernels, simd_with};
use super::*;

/// SplitMix64, local so these tests depend on nothing else in the crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn f32(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn vec(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|_| self.f32()).collect()
    }
}

/// One problem: shapes, layouts (with `pad` extra columns in every leading dim) and scalars.
struct Case {
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
    alpha: f32,
    beta: f32,
    pad: usize,
}

/// A variant under test: a name and how to run it.
type Runner = (String, Box<dyn Fn(Sgemm)>);

fn runners() -> Vec<Runner> {
    let mut v: Vec<Runner> = vec![
        ("naive".into(), Box::new(naive)),
        ("blocked".into(), Box::new(blocked)),
        ("simd".into(), Box::new(simd)),
        ("parallel(1)".into(), Box::new(|g| parallel(g, 1))),
        ("parallel(2)".into(), Box::new(|g| parallel(g, 2))),
        ("parallel(3)".into(), Box::new(|g| parallel(g, 3))),
        ("parallel(0)".into(), Box::new(|g| parallel(g, 0))),
    ];
    #[cfg(feature = "bench")]
    {
        v.push(("peer(1)".into(), Box::new(|g| peer(g, 1))));
        v.push(("peer(2)".into(), Box::new(|g| peer(g, 2))));
    }
    for k in kernels() {
        v.push((
            format!("simd[{}]", k.name),
            Box::new(move |g| simd_with(k, g)),
        ));
    }
    v
}

fn check(case: Case, runners: &[Runner]) {
    let Case {
        m,
        n,
        k,
        ta,
        tb,
        alpha,
        beta,
        pad,
    } = case;
    let seed = (m * 1_000_003 + n * 10_007 + k * 101 + ta as usize * 2 + tb as usize) as u64;
    let mut rng = Rng(seed);
    // Stored shapes: op(A) is m×k, so A is k×m when transposed; likewise B.
    let (ar, ac) = if ta { (k, m) } else { (m, k) };
    let (br, bc) = if tb { (n, k) } else { (k, n) };
    let (lda, ldb, ldc) = (ac + pad, bc + pad, n + pad);
    let a = rng.vec(ar * lda);
    let b = rng.vec(br * ldb);
    // beta == 0: C starts as NaN, which must not leak into the result.
    let c0 = if beta == 0.0 {
        vec![f32::NAN; m * ldc]
    } else {
        rng.vec(m * ldc)
    };

    let mut want = vec![0f64; m * n];
    let mut want_norm = 0f64;
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0f64;
            for p in 0..k {
                let x = if ta { a[p * lda + i] } else { a[i * lda + p] };
                let y = if tb { b[j * ldb + p] } else { b[p * ldb + j] };
                acc += x as f64 * y as f64;
            }
            let mut r = alpha as f64 * acc;
            if beta != 0.0 {
                r += beta as f64 * c0[i * ldc + j] as f64;
            }
            want[i * n + j] = r;
            want_norm += r * r;
        }
    }
    let want_norm = want_norm.sqrt();

    for (name, run) in runners {
        let mut c = c0.clone();
        run(Sgemm {
            m,
            n,
            k,
            alpha,
            beta,
            a: &a,
            lda,
            a_trans: ta,
            b: &b,
            ldb,
            b_trans: tb,
            c: &mut c,
            ldc,
        });
        let mut err = 0f64;
        for i in 0..m {
            for j in 0..n {
                let got = c[i * ldc + j];
                assert!(
                    !got.is_nan(),
                    "{name}: NaN at ({i}, {j}) for {m}x{n}x{k} ta={ta} tb={tb}"
                );
                err += (got as f64 - want[i * n + j]).powi(2);
            }
            // The padding columns are not part of C and must be left alone.
            for j in n..ldc {
                let (got, was) = (c[i * ldc + j], c0[i * ldc + j]);
                assert!(
                    got.to_bits() == was.to_bits(),
                    "{name}: wrote padding at ({i}, {j})"
                );
            }
        }
        let err = err.sqrt();
        let rel = if want_norm == 0.0 {
            err
        } else {
            err / want_norm
        };
        assert!(
            rel <= 1e-5,
            "{name}: relative error {rel:e} for {m}x{n}x{k} ta={ta} tb={tb} alpha={alpha} beta={beta}"
        );
    }
}

fn case(m: usize, n: usize, k: usize) -> Case {
    Case {
        m,
        n,
        k,
        ta: false,
        tb: false,
        alpha: 1.0,
        beta: 0.0,
        pad: 0,
    }
}

/// All four transpose combinations of `base`.
fn all_layouts(base: impl Fn() -> Case, runners: &[Runner]) {
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        check(Case { ta, tb, ..base() }, runners);
    }
}

#[test]
fn odd_shapes_every_layout() {
    let r = runners();
    for (m, n, k) in [
        (1, 1, 1),
        (127, 255, 33),
        (1000, 7, 129),
        (7, 1000, 129),
        (2, 3, 1),
    ] {
        all_layouts(|| case(m, n, k), &r);
    }
}

#[test]
fn alpha_beta_and_padded_leading_dims() {
    let r = runners();
    all_layouts(
        || Case {
            alpha: 0.75,
            beta: -0.5,
            pad: 5,
            ..case(61, 77, 45)
        },
        &r,
    );
    all_layouts(
        || Case {
            alpha: -1.5,
            beta: 0.0,
            pad: 3,
            ..case(33, 129, 17)
        },
        &r,
    );
    check(
        Case {
            beta: 1.0,
            ..case(15, 31, 7)
        },
        &r,
    );
    // alpha == 0 leaves beta·C.
    check(
        Case {
            alpha: 0.0,
            beta: 2.0,
            ..case(9, 10, 11)
        },
        &r,
    );
}

#[test]
fn empty_dims() {
    let r = runners();
    for (m, n, k) in [(0, 5, 3), (4, 0, 3), (0, 0, 0), (4, 5, 0)] {
        // k == 0: C = beta·C, or C = 0 when beta == 0 (NaN in C must be overwritten).
        check(case(m, n, k), &r);
        check(
            Case {
                beta: 2.0,
                pad: 2,
                ..case(m, n, k)
            },
            &r,
        );
    }
}

/// Shapes that cross every blocking boundary (KC, MC, NC) and the threads' row and column splits.
#[test]
fn multiple_blocks() {
    let r = runners();
    // k > KC (later slices accumulate with beta = 1), m > MC (several A blocks).
    all_layouts(
        || Case {
            alpha: 0.5,
            beta: 0.25,
            pad: 1,
            ..case(300, 130, 600)
        },
        &r,
    );
    // k > KC even for the largest KC (1024).
    check(
        Case {
            ta: true,
            beta: 0.5,
            ..case(20, 40, 1100)
        },
        &r,
    );
    // n > NC (two B blocks) with an odd edge; few rows, so `parallel` splits columns.
    check(case(5, 4097, 40), &r);
    check(
        Case {
            ta: true,
            tb: true,
            beta: -1.0,
            ..case(37, 4097, 70)
        },
        &r,
    );
}
