// Norm family on the emulated GPU (built per FE_ELEM × FE_RMS × FE_CHUNKS, FE_STAGES = 3 as
// cuda.rs defines it): norm_fwd_vec, then norm_bwd_vec + norm_col_sum at every fixed grid the
// tuner may pick (sm × bpsm blocks, ≤ rows) with cp.async landing lazily and eagerly, and the
// naive backward with the same column sum — against the CPU path's outputs from refgen (the
// backward from the CPU forward's mean/rstd, as the op passes them).
//
//   norm_drv dir=CASE rows=R cols=C w=0|1 b=0|1 res=0|1 eps=E sm=132 bpsm=2,4,8 naive=0|1
#include "kernel_host.cpp"
#include "common.h"

// rows.rs: 1, 2 and MAX_CHUNKS = 4 vectors per thread, the ones whose block fits 1024 threads
// and (above 1) still has ≥ 32 threads at half the chunks.
static bool is_candidate(i64 cols, int chunks) {
  const i64 vecs = cols / VEC;
  const i64 half = chunks / 2;
  return (vecs + chunks - 1) / chunks <= 1024 && (chunks == 1 || (vecs + half - 1) / half >= 32);
}
static unsigned round_warps(i64 t) { return (unsigned)std::clamp<i64>((t + 31) / 32 * 32, 32, 1024); }

int main(int argc, char** argv) {
  Args A(argc, argv);
  g_dir = A.s("dir");
  Props P;
  if (A.has("sm")) P.sm_count = A.i("sm");
  const i64 rows = A.i("rows"), cols = A.i("cols");
  const bool rms = FE_RMS, with_w = A.i("w"), with_b = !rms && A.i("b"), res = A.i("res");
  const float eps = (float)A.f("eps");
  const double rel = storage_rel<T>(2e-5), frob = sizeof(T) == 4 ? 5e-6 : 1e-2;
  char label[256];
  snprintf(label, sizeof label, "%s elem=%zuB chunks=%d rows=%lld cols=%lld w=%d b=%d res=%d",
           rms ? "rms" : "layer", sizeof(T), FE_CHUNKS, rows, cols, with_w, with_b, res);
  printf("case %s\n", label);
  const size_t n = rows * cols, es = sizeof(T);
  const i64 vmax = 1024 * 4 * VEC, bwd_max = sizeof(T) == 4 ? 4096 : 8192;
  if (cols % VEC || cols > vmax || !is_candidate(cols, FE_CHUNKS)) {
    printf("SKIP %s: chunks=%d is not a vectorized candidate\n", label, FE_CHUNKS);
    return 0;
  }
  EmuBuf x = load("x.raw"), dy = load("dy.raw"), xb = load("xb.raw");
  EmuBuf r = res ? load("res.raw") : EmuBuf(), w = with_w ? load("w.raw") : EmuBuf(),
         b = with_b ? load("b.raw") : EmuBuf();
  auto ry = load_f32("y.f32"), rrstd = load_f32("rstd.f32"), rdx = load_f32("dx.f32");
  auto rmean = rms ? std::vector<float>() : load_f32("mean.f32");
  auto rh = res ? load_f32("h.f32") : std::vector<float>();
  auto rdw = with_w ? load_f32("dw.f32") : std::vector<float>();
  auto rdb = with_b ? load_f32("db.f32") : std::vector<float>();
  // The backward's inputs: the CPU forward's statistics.
  EmuBuf mean(rms ? 0 : rows * 4), rstd(rows * 4);
  if (!rms) memcpy(mean.p(), rmean.data(), rows * 4);
  memcpy(rstd.p(), rrstd.data(), rows * 4);
  const unsigned threads = round_warps((cols / VEC + FE_CHUNKS - 1) / FE_CHUNKS);

  {  // forward (cuda.rs launch_fwd: a block per row)
    EmuBuf y(n * es), h(res ? n * es : 0), mo(rms ? 0 : rows * 4), ro(rows * 4);
    emu_launch({{(unsigned)rows, 1, 1}, {threads, 1, 1}, 0, false}, [&] {
      norm_fwd_vec(y.as<T>(), h.as<T>(), mo.as<float>(), ro.as<float>(), x.as<T>(), r.as<T>(),
                   w.as<T>(), b.as<T>(), rows, cols, eps);
    });
    compare("fwd_vec y", widen(y.as<T>(), n), ry, rel, frob);
    if (res) compare("fwd_vec h", widen(h.as<T>(), n), rh, rel, frob);
    if (!rms) compare("fwd_vec mean", widen(mo.as<float>(), rows), rmean, 2e-5, 5e-6, 0.1);
    compare("fwd_vec rstd", widen(ro.as<float>(), rows), rrstd, 2e-5, 5e-6);
    guard("y", y);
    guard("h", h);
  }
  if (cols > bwd_max) {
    printf("  skip backward: cols > %lld (vectorized_bwd_max_cols)\n", bwd_max);
    return finish(label);
  }
  // dw, db: sums over rows, judged on the scale of the column (floor 0.1 × RMS).
  const double srel = storage_rel<T>(1e-5);
  auto bwd_run = [&](const char* tag, bool naive, unsigned grid, size_t smem) {
    EmuBuf dx(n * es), dw(with_w ? cols * es : 0), db(with_b ? cols * es : 0);
    // cuda.rs bwd_scratch_bytes / launch_bwd: dw partials first, then db's.
    const size_t part = (size_t)grid * cols * 4;
    EmuBuf scratch(part * (with_w + with_b));
    float* dw_part = with_w ? scratch.as<float>() : nullptr;
    float* db_part = with_b ? (float*)(scratch.p() + (with_w ? part : 0)) : nullptr;
    if (naive)
      emu_launch({{grid, 1, 1}, {round_warps(std::min<i64>(cols, 1024)), 1, 1}, 0, false}, [&] {
        norm_bwd_naive(dx.as<T>(), dw_part, db_part, dy.as<T>(), xb.as<T>(), w.as<T>(),
                       mean.as<float>(), rstd.as<float>(), rows, cols);
      });
    else
      emu_launch({{grid, 1, 1}, {threads, 1, 1}, smem, false}, [&] {
        norm_bwd_vec(dx.as<T>(), dw_part, db_part, dy.as<T>(), xb.as<T>(), w.as<T>(),
                     mean.as<float>(), rstd.as<float>(), rows, cols);
      });
    if (with_w || with_b)
      emu_launch({{(unsigned)((cols + 31) / 32), 2, 1}, {32, 16, 1}, 0, false}, [&] {
        norm_col_sum(dw.as<T>(), dw_part, db.as<T>(), db_part, grid, cols);
      });
    char what[96];
    snprintf(what, sizeof what, "%s dx", tag);
    compare(what, widen(dx.as<T>(), n), rdx, rel, frob);
    if (with_w) {
      snprintf(what, sizeof what, "%s dw", tag);
      compare(what, widen(dw.as<T>(), cols), rdw, srel, frob, 0.1);
    }
    if (with_b) {
      snprintf(what, sizeof what, "%s db", tag);
      compare(what, widen(db.as<T>(), cols), rdb, srel, frob, 0.1);
    }
    guard("dx", dx);
    guard("dw", dw);
    guard("db", db);
    guard("scratch", scratch);
  };
  // cuda.rs plan_bwd: grid = min(sm_count × blocks_per_sm, rows), FE_STAGES·2·cols·sizeof(T)
  // bytes of dynamic shared memory.
  const size_t smem = 3 * 2 * cols * es;
  for (long long bp : A.list("bpsm"))
    for (CpMode m : {CpMode::Lazy, CpMode::Eager}) {
      g_cp_mode = m;
      const unsigned grid = (unsigned)std::max<i64>(1, std::min<i64>((i64)P.sm_count * bp, rows));
      char tag[96];
      snprintf(tag, sizeof tag, "bwd_vec %lld/SM grid=%u %s", bp, grid,
               m == CpMode::Lazy ? "lazy" : "eager");
      bwd_run(tag, false, grid, smem);
    }
  if (A.has("naive") && A.i("naive")) bwd_run("bwd_naive", true, (unsigned)rows, 0);
  return finish(label);
}
