// run.sh's driver: one case (argv[1]) of the attention `hopper` kernels on the emulated GPU
// against an f64 reference. Built with FE_BWD=0 it runs attn_hopper_fwd (checked on the H100:
// a pass validates the emulator's TMA, swizzle and wgmma descriptor rules); with FE_BWD=1 it runs
// attn_hopper_bwd, with lse from the reference and Δ from o rounded to bf16 (as the forward
// stores it), then dq = scale·acc as flash_bwd_dq_convert does.
// Cases: 0 GQA 4:2 with ragged tiles; 1 bhsd causal Sq > Sk (fully masked rows); 2 window
// (20, 3); 3 varlen causal GQA with an empty sequence; 4 MQA causal Sq < Sk, several key blocks;
// 5 soft-cap 4 with a window (forward only, built with FE_SOFTCAP=1).
#include "hopper_host.cpp"
#include "../emu-common/attn_ref.h"
#include <cstdio>
#include <random>
#include <functional>

struct Prob {
  int B, Hq, Hkv, Sq, Sk; bool bhsd, varlen; std::vector<int> lq, lk; long wl, wr; float softcap = 0.f;
};

// A tensor map as hopper.rs builds it: dims (d, then row/head/batch by increasing stride), boxes
// of 64 × box_rows; the kernel reads it through tma_load4 (emu.h).
static std::pair<TmaDesc, MapOrder> make_map(const void* ptr, long rows, long heads, long batch,
                                             const long (&st)[3], unsigned box_rows) {
  struct O { unsigned long long ext, stride; int which; };
  O outer[3] = {{(unsigned long long)std::max(rows, 1L), (unsigned long long)st[1] * 2, 0},
                {(unsigned long long)std::max(heads, 1L), (unsigned long long)st[2] * 2, 1},
                {(unsigned long long)std::max(batch, 1L), (unsigned long long)st[0] * 2, 2}};
  std::stable_sort(outer, outer + 3, [](const O& a, const O& b) { return a.stride < b.stride; });
  EmuMap m{};
  m.ptr = (const unsigned char*)ptr;
  m.dims[0] = D;
  m.box[0] = 64;
  int order[3];
  for (int slot = 0; slot < 3; ++slot) {
    m.dims[slot + 1] = outer[slot].ext;
    m.strides[slot] = outer[slot].stride;
    m.box[slot + 1] = outer[slot].which == 0 ? box_rows : 1;
    order[outer[slot].which] = slot + 1;
  }
  TmaDesc t{};
  memcpy(&t, &m, sizeof m);
  return {t, MapOrder{order[0], order[1], order[2], 0}};
}

int main(int argc, char** argv) {
  int which = argc > 1 ? atoi(argv[1]) : 0;
  std::vector<Prob> probs = {
      {2, 4, 2, 77, 130, false, false, {}, {}, -1, -1},               // GQA, ragged tiles
      {1, 2, 1, 150, 100, true, false, {}, {}, -1, 0},                // bhsd causal sq>sk (masked rows)
      {1, 2, 2, 90, 200, false, false, {}, {}, 20, 3},                // window
      {3, 2, 1, 0, 0, false, true, {17, 0, 70}, {40, 9, 140}, -1, 0},  // varlen causal, empty seq
      {1, 3, 1, 70, 300, false, false, {}, {}, -1, 0},                // MQA causal sq<sk, 3 key blocks
      {1, 3, 3, 100, 150, false, false, {}, {}, 40, 0, 4.f},          // soft-cap 4 + window (forward, FE_SOFTCAP=1)
  };
  Prob P = probs[which];
  // Soft-capping is compiled in or out; the backward does not take it (flash's kernels do).
  if ((P.softcap > 0) != (FE_SOFTCAP != 0) || (P.softcap > 0 && FE_BWD)) { printf("skip (soft-cap build)\n"); return 0; }
  if (P.varlen) { P.B = P.lq.size(); P.Sq = *std::max_element(P.lq.begin(), P.lq.end()); P.Sk = *std::max_element(P.lk.begin(), P.lk.end()); }
  else { P.lq.assign(P.B, P.Sq); P.lk.assign(P.B, P.Sk); }
  std::vector<int> cuq(P.B + 1, 0), cuk(P.B + 1, 0);
  for (int b = 0; b < P.B; ++b) { cuq[b + 1] = cuq[b] + P.lq[b]; cuk[b + 1] = cuk[b] + P.lk[b]; }
  const int Tq = cuq[P.B], Tk = cuk[P.B];
  // strides (elements): (b, s, h)
  auto strides = [&](int S, int H, long (&o)[3]) {
    if (P.varlen) { o[0] = 0; o[1] = (long)H * D; o[2] = D; }
    else if (P.bhsd) { o[0] = (long)H * S * D; o[1] = D; o[2] = (long)S * D; }
    else { o[0] = (long)S * H * D; o[1] = (long)H * D; o[2] = D; }
  };
  long qs[3], ks[3];
  strides(P.Sq, P.Hq, qs);
  strides(P.Sk, P.Hkv, ks);
  size_t nq = P.varlen ? (size_t)Tq * P.Hq * D : (size_t)P.B * P.Sq * P.Hq * D;
  size_t nk = P.varlen ? (size_t)Tk * P.Hkv * D : (size_t)P.B * P.Sk * P.Hkv * D;
  auto qoff = [&](int b, int i, int h) -> long { return P.varlen ? (i64)(cuq[b] + i) * qs[1] + h * qs[2] : b * qs[0] + i * qs[1] + h * qs[2]; };
  auto koff = [&](int b, int j, int h) -> long { return P.varlen ? (i64)(cuk[b] + j) * ks[1] + h * ks[2] : b * ks[0] + j * ks[1] + h * ks[2]; };
  std::mt19937 rng(1234 + which);
  std::uniform_real_distribution<float> U(-1, 1);
  auto mk = [&](size_t n) { std::vector<__nv_bfloat16> v(n); for (auto& x : v) x.x = f2bf(U(rng)); return v; };
  auto q = mk(nq), k = mk(nk), v = mk(nk), dout = mk(nq);
  std::vector<__nv_bfloat16> o(nq);
  const float scale = 1.f / sqrtf((float)D);
  i64 lse_rows = P.varlen ? Tq : P.Sq;
  size_t nl = P.varlen ? (size_t)P.Hq * Tq : (size_t)P.B * P.Hq * P.Sq;
  auto lidx = [&](int b, int h, int i) -> long { return P.varlen ? (i64)h * Tq + cuq[b] + i : ((i64)b * P.Hq + h) * P.Sq + i; };
  // Reference forward (o rounded to bf16, lse) and backward from that o.
  const AttnRef ref = attn_reference(AttnRefProblem{P.B, P.Hq, P.Hkv, D, P.lq, P.lk, P.wl, P.wr, P.softcap, scale}, q, k, v, dout, o, nl, qoff, koff, lidx);
  const std::vector<double>&ro = ref.o, &rlse = ref.lse, &rdq = ref.dq, &rdk = ref.dk, &rdv = ref.dv;
  std::vector<float> lse = ref.lse_f, delta = ref.delta;
  const int* cu_q = P.varlen ? cuq.data() : nullptr;
  const int* cu_k = P.varlen ? cuk.data() : nullptr;
  // Worst |got − want| over max |want| (bf16 outputs); NaN (an unwritten, poisoned output) fails.
  auto rel = [&](const std::vector<__nv_bfloat16>& got, const std::vector<double>& want, const char* name) {
    double num = 0, den = 1e-30; bool nan = false;
    for (size_t i = 0; i < got.size(); ++i) { double g = bf2f(got[i].x); if (std::isnan(g)) nan = true; num = std::max(num, fabs(g - want[i])); den = std::max(den, fabs(want[i])); }
    printf("  %s rel %.2e%s\n", name, num / den, nan ? " NaN!" : "");
    return nan ? 1.0 : num / den;
  };
  // Padded: the map's rows are the padded length per batch; varlen: the packed totals, batch 1.
  const long q_rows = P.varlen ? Tq : P.Sq, k_rows = P.varlen ? Tk : P.Sk, nb = P.varlen ? 1 : P.B;
  auto bstride = [&](const long (&s)[3], long rows, long (&o)[3]) {
    o[0] = P.varlen ? std::max(s[1], s[2]) * std::max(rows, 1L) : s[0]; o[1] = s[1]; o[2] = s[2];
  };
  long qsm[3], ksm[3];
  bstride(qs, q_rows, qsm);
  bstride(ks, k_rows, ksm);
  double worst = 0;
#if !FE_BWD
  {
    std::vector<__nv_bfloat16> go(nq);
    for (auto& x : go) x.x = 0x7fc0;
    std::vector<float> glse(nl, NAN);
    auto [tq, oq] = make_map(q.data(), q_rows, P.Hq, nb, qsm, BM);
    auto [tk, okv] = make_map(k.data(), k_rows, P.Hkv, nb, ksm, BN);
    auto [tv, ov] = make_map(v.data(), k_rows, P.Hkv, nb, ksm, BN);
    const bool capped = P.softcap > 0;
    ScoreMap smap{scale * 1.4426950408889634f, capped ? scale / P.softcap : 0.f,
                  capped ? P.softcap * 1.4426950408889634f : 0.f, capped};
    const size_t smem = 1024 + Q_BYTES + STAGES * STAGE_BYTES + 8 * (1 + 3 * STAGES);
    // hopper.cu's launch order with chunks of 2 units (a partial last chunk when B·Hq is odd).
    const int units = P.B * P.Hq, nblk = (P.Sq + BM - 1) / BM, chunk = 2;
    hopper_launch({(unsigned)(units * nblk), 1, 1}, NTHREADS, smem, [&] {
      attn_hopper_fwd(tq, tk, tv, oq, okv, go.data(), glse.data(), cu_q, cu_k, P.Hq, P.Hkv, P.Sq, P.Sk, qs[0], qs[1], qs[2], lse_rows, P.wl, P.wr, smap,
                      units, nblk, chunk);
    });
    printf("forward (D%d, %d stages, pipelined %d):\n", D, STAGES, FE_PIPE);
    // o rows that exist; padded rows past a sequence (varlen: none) stay unwritten by design.
    worst = std::max(worst, rel(go, ro, "o"));
    double le = 0;
    for (size_t i = 0; i < nl; ++i) {
      if (std::isinf(rlse[i])) { if (!(std::isinf(glse[i]) && glse[i] < 0)) le = 1; continue; }
      if (std::isnan(glse[i])) { le = 1; continue; }
      le = std::max(le, fabs(glse[i] - rlse[i]));
    }
    printf("  lse abs %.2e\n", le);
    worst = std::max(worst, le);
  }
#else
  {
    std::vector<__nv_bfloat16> dq(nq), dk(nk), dv(nk);
    for (auto* t : {&dq, &dk, &dv}) for (auto& x : *t) x.x = 0x7fc0;
    std::vector<float> acc(nl * D, 0.f);
    auto [tq, oq] = make_map(q.data(), q_rows, P.Hq, nb, qsm, B_BM);
    auto [tdo, odo] = make_map(dout.data(), q_rows, P.Hq, nb, qsm, B_BM);
    auto [tk, okv] = make_map(k.data(), k_rows, P.Hkv, nb, ksm, B_BN);
    auto [tv, ov] = make_map(v.data(), k_rows, P.Hkv, nb, ksm, B_BN);
    const size_t smem = 1024 + 2 * B_K_BYTES + B_STAGES * B_STAGE_BYTES + 2 * B_DS_BYTES + B_STAGES * 2 * B_BM * 4 + 8 * (1 + 2 * B_STAGES);
    const int units = P.B * P.Hkv, nblk = (P.Sk + B_BN - 1) / B_BN, chunk = 3;
    hopper_launch({(unsigned)(units * nblk), 1, 1}, NTHREADS, smem, [&] {
      attn_hopper_bwd(tq, tk, tv, tdo, oq, odo, okv, lse.data(), delta.data(), dk.data(), dv.data(), acc.data(), cu_q, cu_k, P.Hq, P.Hkv, P.Sq, P.Sk,
                      ks[0], ks[1], ks[2], ks[0], ks[1], ks[2], lse_rows, P.wl, P.wr, scale * 1.4426950408889634f, scale, units, nblk, chunk);
    });
    // flash_bwd_dq_convert: dq = scale·acc for the rows that exist.
    for (int b = 0; b < P.B; ++b)
      for (int h = 0; h < P.Hq; ++h)
        for (int i = 0; i < P.lq[b]; ++i)
          for (int d = 0; d < D; ++d) dq[qoff(b, i, h) + d].x = f2bf(scale * acc[lidx(b, h, i) * D + d]);
    printf("backward (D%d, %d stages):\n", D, B_STAGES);
    worst = std::max({worst, rel(dq, rdq, "dq"), rel(dk, rdk, "dk"), rel(dv, rdv, "dv")});
  }
#endif
  printf("%s worst %.2e\n", worst < 2e-2 ? "PASS" : "FAIL", worst);
  return worst < 2e-2 ? 0 : 1;
}
