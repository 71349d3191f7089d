// run.sh's driver: matmul kernels/mma.cu (matmul_mma, as built by run.sh's defines) on the
// emulated GPU against an f64 reference. `driver plain` runs the GEMM cases whose layout the build
// takes (a fixed FE_A_TRANS/FE_B_TRANS build: its own; the run-time dispatch build: all four);
// `driver epi` (FE_EPI builds) the fused-epilogue cases, every bias × Z × residual combination.
// The kernel is launched as cuda.rs launch_inner launches it: launch_args.h is generated from that
// code (launch.py), so the argument order, grid, block and shared memory come from it.
//
// Every buffer is allocated to its last element (ASan sees any access past it), output and Z are
// poisoned with NaN, the gaps between rows of every operand (ld > row length) hold NaN and must
// come back unchanged (A/B gaps: NaN would reach C if the kernel used them), and with beta == 0 C
// is all NaN (the kernel must not read it).
#include "mma_host.cpp"
#include "launch_args.h"

#include <random>
#include <string>

struct Operand { i64 ld; bool trans; i64 batch_stride; };
struct Gemm { i64 m, n, k; Operand a, b, c; i64 batch; };
struct Ptrs { T* c; const T* a; const T* b; };
struct EpiPtrs { const T* bias; T* z; i64 ldz, stride_z; const T* r; i64 ldr, stride_r; };

constexpr size_t SMEM = (size_t)FE_STAGES * EMU_STAGE_BYTES;  // plan_inner: stages · MMA_STAGE_BYTES
static_assert(STAGES * STAGE_BYTES <= (int)SMEM, "the kernel uses more shared memory than cuda.rs gives it");

// cuda.rs launch_inner (the non-persistent grid), with optional caps on grid y/z that make each
// block walk several row tiles / batches (the kernel's FE_FOR_EACH_TILE loop).
static void launch(const Gemm& g, Ptrs p, float alpha, float beta, EpiPtrs e, unsigned ycap, unsigned zcap) {
  auto clamp = [](i64 v) { return (unsigned)std::min<i64>(std::max<i64>(v, 1), 65535); };
  Dim grid{(unsigned)ceil_div(g.n, EMU_TILE_N), clamp(ceil_div(g.m, EMU_TILE_M)), clamp(g.batch)};
  if (ycap) grid.y = std::min(grid.y, ycap);
  if (zcap) grid.z = std::min(grid.z, zcap);
  const Dim block = EMU_BLOCK;
  (void)e;
  emu_launch(grid, block.x * block.y * block.z, SMEM, [&] {
#if FE_EPI
    matmul_mma(EMU_ARGS, EMU_EPI_ARGS);
#else
    matmul_mma(EMU_ARGS);
#endif
  });
}

// ---- element type --------------------------------------------------------------------------
constexpr bool IS_F32 = sizeof(T) == 4;
constexpr double U_ROUND = IS_F32 ? 0x1p-24 : FE_MMA_KIND == 1 ? 0x1p-8 : 0x1p-11;  // unit roundoff of T
static float tf(T x) { return to_float(x); }
static T fromf(float x) { return from_float<T>(x); }
static bool same_bits(T a, T b) { return memcmp(&a, &b, sizeof(T)) == 0; }
// The value the tensor cores multiply: T itself, or for f32 inputs the cvt.rna.tf32 rounding.
static double mma_val(T x) { float f = tf(x); return IS_F32 ? (double)__uint_as_float(emu_tf32(__float_as_uint(f))) : f; }

// A batch of row-major `rows × cols` matrices, rows `ld` apart, batches `bs` apart; the buffer
// ends at the last element; everything outside the matrices is NaN.
struct Mat {
  i64 rows, cols, ld, bs, batch;
  std::vector<T> v;
  Mat(i64 r, i64 c, i64 ld_, i64 bs_, i64 b) : rows(r), cols(c), ld(ld_), bs(bs_), batch(b) {
    size_t n = (r && c && b) ? (size_t)((b - 1) * bs + (r - 1) * ld + c) : 0;
    v.assign(n, fromf(NAN));
  }
  T& at(i64 z, i64 r, i64 c) { return v[z * bs + r * ld + c]; }
  void fill(std::mt19937& rng) {
    std::uniform_real_distribution<float> U(-1, 1);
    for (i64 z = 0; z < batch; ++z) for (i64 r = 0; r < rows; ++r) for (i64 c = 0; c < cols; ++c) at(z, r, c) = fromf(U(rng));
  }
  bool inside(size_t idx) const {
    i64 z = bs ? idx / bs : 0, o = idx - z * bs, r = o / ld, c = o % ld;
    return z < batch && r < rows && c < cols;
  }
};

struct Stats {
  double worst = 0; long bad = 0, gap_bad = 0; int shown = 0;
  void add(const char* what, i64 z, i64 i, i64 j, double got, double want, double tol) {
    double r = std::isnan(got) ? INFINITY : fabs(got - want) / tol;
    worst = std::max(worst, r);
    if (r > 1) { ++bad; if (shown++ < 6) printf("    %s[%lld][%lld][%lld] = %.6g, want %.6g (tol %.2g)\n", what, (long long)z, (long long)i, (long long)j, got, want, tol); }
  }
  void gaps(const char* what, const Mat& before, const Mat& after) {
    for (size_t x = 0; x < after.v.size(); ++x)
      if (!after.inside(x) && !same_bits(before.v[x], after.v[x])) { if (gap_bad++ < 3) printf("    %s gap element %zu written\n", what, x); }
  }
};

// The operands of one GEMM case, with op(A) (m×k) and op(B) (k×n) stored per the layout.
struct Case {
  const char* name; i64 m, n, k, batch; bool at, bt; int pad; float alpha, beta; unsigned ycap, zcap;
};
struct Problem {
  Gemm g; Mat A, B, C0; std::vector<double> acc;  // acc: alpha·op(A)op(B) + beta·C0 in f64
  std::vector<double> mag;                          // |alpha|·Σ|a·b| + |beta·C0| (error scale)
  Problem(const Case& c, std::mt19937& rng)
      : A(c.at ? c.k : c.m, c.at ? c.m : c.k, 0, 0, c.batch), B(c.bt ? c.n : c.k, c.bt ? c.k : c.n, 0, 0, c.batch),
        C0(c.m, c.n, 0, 0, c.batch) {
    // Row pitch: the row length plus `pad` (pad 8 keeps 16-byte alignment of 16-bit rows when the
    // row length is a multiple of 8); batch stride: the batch's rows plus another pad.
    auto mk = [&](i64 r, i64 cols) { i64 ld = std::max<i64>(cols + c.pad, 1); return Mat(r, cols, ld, r * ld + c.pad, c.batch); };
    A = mk(A.rows, A.cols); B = mk(B.rows, B.cols); C0 = mk(c.m, c.n);
    A.fill(rng); B.fill(rng); C0.fill(rng);
    g = Gemm{c.m, c.n, c.k, {A.ld, c.at, A.bs}, {B.ld, c.bt, B.bs}, {C0.ld, false, C0.bs}, c.batch};
    acc.assign(c.batch * c.m * c.n, 0); mag.assign(acc.size(), 0);
    for (i64 z = 0; z < c.batch; ++z)
      for (i64 i = 0; i < c.m; ++i)
        for (i64 j = 0; j < c.n; ++j) {
          double s = 0, sa = 0;
          for (i64 p = 0; p < c.k; ++p) {
            double a = mma_val(c.at ? A.at(z, p, i) : A.at(z, i, p)), b = mma_val(c.bt ? B.at(z, j, p) : B.at(z, p, j));
            s += a * b; sa += fabs(a * b);
          }
          double c0 = c.beta != 0 ? tf(C0.at(z, i, j)) : 0;
          acc[(z * c.m + i) * c.n + j] = c.alpha * s + c.beta * c0;
          mag[(z * c.m + i) * c.n + j] = fabs(c.alpha) * sa + fabs(c.beta * c0);
        }
  }
  // fp32 accumulation error over k products (plus the alpha/beta FMAs).
  double acc_tol(size_t x) const { return (g.k + 4) * 0x1p-23 * mag[x] + 1e-30; }
  Mat out_init(float beta) const { Mat C = C0; if (beta == 0) std::fill(C.v.begin(), C.v.end(), fromf(NAN)); return C; }
};

static bool layout_built(bool at, bool bt) {
#if defined(FE_A_TRANS) && defined(FE_B_TRANS)
  return at == (FE_A_TRANS != 0) && bt == (FE_B_TRANS != 0);
#else
  (void)at; (void)bt;
  return true;
#endif
}

static int run_plain() {
  std::vector<Case> cases;
  for (int l = 0; l < 4; ++l) {
    bool at = l & 2, bt = l & 1;
    if (!layout_built(at, bt)) continue;
    cases.push_back({"1x1x1", 1, 1, 1, 1, at, bt, 0, 1.f, 0.f, 0, 0});
    cases.push_back({"127x255x33 a=0.5 (unaligned rows)", 127, 255, 33, 1, at, bt, 0, 0.5f, 0.f, 0, 0});
    cases.push_back({"200x136x64 b2 a=1.25 b=0.75 (aligned)", 200, 136, 64, 2, at, bt, 8, 1.25f, 0.75f, 0, 0});
    cases.push_back({"130x70x1 b=0.5 (K=1)", 130, 70, 1, 1, at, bt, 0, 1.f, 0.5f, 0, 0});
    cases.push_back({"33x18x0 b=0.5 (K=0)", 33, 18, 0, 1, at, bt, 0, 1.f, 0.5f, 0, 0});
    // k = 200: more k-slices than ring stages (the ring wraps); one block per column tile walks
    // three row tiles and both batches.
    cases.push_back({"264x136x200 b2 grid y=1 z=1 (aligned)", 264, 136, 200, 2, at, bt, 8, 1.f, 0.f, 1, 1});
  }
  int fail = 0;
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& c = cases[ci];
    std::mt19937 rng(1000 + ci);
    Problem P(c, rng);
    Mat C = P.out_init(c.beta), before = C;
    launch(P.g, Ptrs{C.v.data(), P.A.v.data(), P.B.v.data()}, c.alpha, c.beta, EpiPtrs{}, c.ycap, c.zcap);
    Stats s;
    for (i64 z = 0; z < c.batch; ++z)
      for (i64 i = 0; i < c.m; ++i)
        for (i64 j = 0; j < c.n; ++j) {
          size_t x = (z * c.m + i) * c.n + j;
          s.add("C", z, i, j, tf(C.at(z, i, j)), P.acc[x], 2 * U_ROUND * fabs(P.acc[x]) + P.acc_tol(x));
        }
    s.gaps("C", before, C);
    bool ok = s.bad == 0 && s.gap_bad == 0;
    printf("  %s %c%c %-40s worst err/tol %.3f%s\n", ok ? "ok  " : "FAIL", c.at ? 'T' : 'N', c.bt ? 'T' : 'N', c.name, s.worst, ok ? "" : " <--");
    fail |= !ok;
  }
  return fail;
}

#if FE_EPI
// epilogue.rs Activation::apply_f64, by the name launch.py read for the code.
static double act_f64(double v) {
  const std::string a = EMU_ACT_NAMES[FE_EPI - 1];
  if (a == "none") return v;
  if (a == "relu") return v > 0 ? v : 0;
  if (a == "gelu_tanh") return 0.5 * v * (1 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
  if (a == "gelu_erf") return 0.5 * v * (1 + erf(v * 0.7071067811865476));
  if (a == "silu") return v / (1 + exp(-v));
  fprintf(stderr, "unknown activation %s\n", a.c_str());
  abort();
}

// What act's fp32 evaluation in the kernel may add beyond the roundings, as a multiple of |v|.
// 16-bit pair builds (FE_FAST_ACT): gelu_tanh / silu are h + h·tanh.approx(·) with h = v/2, and
// tanh.approx is good to 2^-10.99 relative: 2^-12·|v|, taken as 2^-11; gelu_erf's erfc fit
// (1.5e-7 absolute) and __expf / __fdividef (a few ulp): 2^-20. The exact functions of the other
// builds (and the emulation, which evaluates the SFU ops exactly): a few ulp, 2^-21.
static double act_err(double v) {
  const std::string a = EMU_ACT_NAMES[FE_EPI - 1];
  if (a == "none" || a == "relu") return 0;
  if (!FE_FAST_ACT) return 0x1p-21 * fabs(v);
  return (a == "gelu_erf" ? 0x1p-20 : 0x1p-11) * fabs(v);
}

struct EpiCase {
  Case c;
  int zpad, rpad;   // Z / R row pitch = n + pad (odd: pairs misaligned)
  int bias_off;     // bias starts this many elements into its buffer (1: not pair-aligned)
};

static int run_epi() {
  std::vector<EpiCase> cases = {
      // The linear layer's launch (ops/linear: X [m,k] row-major, W [n,k] = B transposed, Y/Z/R
      // rows n apart, alpha 1, beta 0): row tiles 0 and 128 and column tiles 0..384 are whole
      // interior tiles (pair epilogue), the rest are edges in both dims (element-wise).
      {{"264x520x64 linear", 264, 520, 64, 1, false, true, 0, 1.f, 0.f, 0, 0}, 0, 0, 0},
      // Batch 2 with batch strides, padded rows, alpha; in row tile 128 warp row 0 is interior and
      // warp row 1 has 40 of its 64 rows inside, in column tile 128 warp column 0 is interior and
      // column 1 has 20 of 32 columns inside (more than half: a loose bound would store past the
      // edge); k = 40: a partial k-slice.
      {{"232x180x40 b2 a=0.5 padded", 232, 180, 40, 2, false, true, 8, 0.5f, 0.f, 0, 0}, 2, 4, 0},
      // One block per column tile walking all row tiles (fast tiles after slow ones and back).
      {{"264x264x72 grid y=1", 264, 264, 72, 1, false, true, 0, 1.f, 0.f, 1, 0}, 0, 0, 0},
      // Pair preconditions broken one at a time: everything element-wise, still right.
      {{"136x136x32 bias odd address", 136, 136, 32, 1, false, true, 0, 1.f, 0.f, 0, 0}, 0, 0, 1},
      {{"136x136x32 Z/R rows odd", 136, 136, 32, 1, false, true, 0, 1.f, 0.f, 0, 0}, 1, 1, 0},
      {{"136x136x32 beta=0.5", 136, 136, 32, 1, false, true, 0, 1.f, 0.5f, 0, 0}, 0, 0, 0},
  };
#if !(defined(FE_A_TRANS) && defined(FE_B_TRANS))
  // The run-time dispatch build (element-wise epilogue): another layout too.
  cases.push_back({{"150x140x48 TN b2", 150, 140, 48, 2, true, false, 8, 1.f, 0.f, 0, 0}, 0, 0, 0});
#endif
  int fail = 0;
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const EpiCase& ec = cases[ci];
    const Case& c = ec.c;
    if (!layout_built(c.at, c.bt)) continue;
    std::mt19937 rng(2000 + ci);
    Problem P(c, rng);
    std::vector<T> bias_buf(c.n + ec.bias_off);
    std::uniform_real_distribution<float> U(-1, 1);
    for (auto& x : bias_buf) x = fromf(U(rng));
    const T* bias_p = bias_buf.data() + ec.bias_off;
    auto pitch_mat = [&](int pad) { i64 ld = c.n + pad; return Mat(c.m, c.n, ld, c.m * ld + (c.batch > 1 ? pad : 0), c.batch); };
    Mat R = pitch_mat(ec.rpad);
    R.fill(rng);
    for (int combo = 0; combo < 8; ++combo) {
      const bool hb = combo & 1, hz = combo & 2, hr = combo & 4;
      Mat C = P.out_init(c.beta), Cb = C, Z = pitch_mat(ec.zpad), Zb = Z;
      // The linear layer passes stride 0 for Z and R with batch 1 (cuda.rs epi_ptrs).
      EpiPtrs e{hb ? bias_p : nullptr, hz ? Z.v.data() : nullptr, Z.ld, c.batch > 1 ? Z.bs : 0,
                hr ? R.v.data() : nullptr, R.ld, c.batch > 1 ? R.bs : 0};
      const long hits0 = emu_hits[0];
      launch(P.g, Ptrs{C.v.data(), P.A.v.data(), P.B.v.data()}, c.alpha, c.beta, e, c.ycap, c.zcap);
      const long hits = emu_hits[0] - hits0;
      Stats sy, sz;
      for (i64 z = 0; z < c.batch; ++z)
        for (i64 i = 0; i < c.m; ++i)
          for (i64 j = 0; j < c.n; ++j) {
            size_t x = (z * c.m + i) * c.n + j;
            const double dv = P.acc_tol(x) + (hb ? 0x1p-23 * fabs(P.acc[x]) : 0);  // v's fp32 error
            const double v = P.acc[x] + (hb ? tf(bias_p[j]) : 0);
            const double a = act_f64(v), r = hr ? tf(R.at(z, i, j)) : 0;
            const double sfu = act_err(v);
            sy.add("Y", z, i, j, tf(C.at(z, i, j)), a + r, 2 * U_ROUND * (fabs(a) + fabs(r)) + 1.2 * dv + sfu);
            if (hz) sz.add("Z", z, i, j, tf(Z.at(z, i, j)), v, 2 * U_ROUND * fabs(v) + dv);
          }
      sy.gaps("Y", Cb, C);
      if (hz) sz.gaps("Z", Zb, Z);
      else if (memcmp(Z.v.data(), Zb.v.data(), Z.v.size() * sizeof(T))) { sz.gap_bad++; printf("    Z written while absent\n"); }
      // Which warps took the pair epilogue (mma_epilogue entries, 32 per warp tile): the interior
      // ones iff every pair precondition holds.
      long want_hits = 0;
#if FE_EPI_PAIRS
      const bool pair_ok = c.beta == 0 && C.ld % 2 == 0 && C.bs % 2 == 0 && (!hb || ec.bias_off % 2 == 0) &&
                           (!hz || (Z.ld % 2 == 0 && e.stride_z % 2 == 0)) && (!hr || (R.ld % 2 == 0 && e.stride_r % 2 == 0));
      if (pair_ok)
        for (i64 m0 = 0; m0 < c.m; m0 += BM)
          for (i64 n0 = 0; n0 < c.n; n0 += BN)
            for (int w = 0; w < NT / 32; ++w)
              if (m0 + (w / (BN / WN)) * WM + WM <= c.m && n0 + (w % (BN / WN)) * WN + WN <= c.n) want_hits += 32 * c.batch;
#endif
      bool ok = sy.bad == 0 && sz.bad == 0 && sy.gap_bad == 0 && sz.gap_bad == 0 && hits == want_hits;
      printf("  %s %-32s bias=%d Z=%d R=%d  worst err/tol Y %.3f Z %.3f  pair-epilogue warps %ld/%ld%s\n", ok ? "ok  " : "FAIL",
             c.name, hb, hz, hr, sy.worst, sz.worst, hits / 32, want_hits / 32, ok ? "" : " <--");
      fail |= !ok;
    }
  }
  return fail;
}
#endif

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "plain";
  if (mode == "plain") return run_plain();
#if FE_EPI
  if (mode == "epi") return run_epi();
#endif
  fprintf(stderr, "unknown mode %s for this build\n", mode.c_str());
  return 2;
}
