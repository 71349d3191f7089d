//! PLACEHOLDER until the CPU ladder lands (being written separately): interface only.
pub struct Sgemm<'a> {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub beta: f32,
    pub a: &'a [f32],
    pub lda: usize,
    pub a_trans: bool,
    pub b: &'a [f32],
    pub ldb: usize,
    pub b_trans: bool,
    pub c: &'a mut [f32],
    pub ldc: usize,
}
pub fn naive(g: Sgemm) {
    for i in 0..g.m {
        for j in 0..g.n {
            let mut acc = 0f32;
            for p in 0..g.k {
                let a = if g.a_trans {
                    g.a[p * g.lda + i]
                } else {
                    g.a[i * g.lda + p]
                };
                let b = if g.b_trans {
                    g.b[j * g.ldb + p]
                } else {
                    g.b[p * g.ldb + j]
                };
                acc += a * b;
            }
            let c = &mut g.c[i * g.ldc + j];
            *c = if g.beta == 0.0 {
                g.alpha * acc
            } else {
                g.alpha * acc + g.beta * *c
            };
        }
    }
}
pub fn blocked(g: Sgemm) {
    naive(g)
}
pub fn simd(g: Sgemm) {
    naive(g)
}
pub fn parallel(g: Sgemm, _t: usize) {
    naive(g)
}
pub fn peer(g: Sgemm, _t: usize) {
    naive(g)
}
pub fn simd_isa() -> &'static str {
    "portable"
}
