// Cross-entropy family on the emulated GPU (built per FE_ELEM × FE_TGT): ce_targets, then
// ce_resident (geometry from cuda.rs resident_geom for the H100, or a smaller shared memory per
// SM with smem_sm= so only part of the row stays resident) and ce_fused, each followed by
// ce_reduce — against the CPU path's outputs from refgen. lead=K shifts logits and dlogits K
// elements past a 256-byte boundary (rows split into head/vectors/tail differently);
// inplace=1 writes dlogits over the logits.
//
//   ce_drv dir=CASE rows=N v=V eps=E red=mean|sum|none dloss=D lead=K inplace=0|1 smem_sm=BYTES
#include "kernel_host.cpp"
#include "common.h"

// cuda.rs fused_threads.
static unsigned fused_threads(i64 v) {
  if (v * (i64)sizeof(T) > (64 << 10)) return 1024;
  const i64 vecs = (v + VEC - 1) / VEC;
  return (unsigned)std::clamp<i64>(((vecs + 3) / 4 + 31) / 32 * 32, 32, 512);
}
// cuda.rs resident_shape: (blocks per SM, vectors kept).
static std::pair<size_t, size_t> resident_shape(unsigned threads, unsigned max_threads_per_sm,
                                                size_t smem_per_sm, size_t smem_optin,
                                                size_t full) {
  const size_t reserve = 256 + 1024;
  const size_t per_block_max = smem_optin > 256 ? smem_optin - 256 : 0;
  auto fit = [&](size_t blocks) {
    const size_t a = smem_per_sm / blocks;
    return std::min(a > reserve ? a - reserve : 0, per_block_max) / 16;
  };
  const size_t most = std::max<size_t>(max_threads_per_sm / std::max(threads, 1u), 1);
  size_t blocks = 1;
  for (size_t b = most; b >= 1; --b)
    if (fit(b) >= full) {
      blocks = b;
      break;
    }
  return {blocks, std::min(full, fit(blocks))};
}

int main(int argc, char** argv) {
  Args A(argc, argv);
  g_dir = A.s("dir");
  Props P;
  if (A.has("smem_sm")) P.smem_per_sm = A.u("smem_sm");
  const i64 rows = A.i("rows"), v = A.i("v");
  const float eps = (float)A.f("eps"), dloss = (float)A.f("dloss");
  const std::string red = A.s("red");
  const int mean = red == "mean";
  const size_t lead = A.has("lead") ? A.u("lead") : 0;
  const bool inplace = A.has("inplace") && A.i("inplace");
  const i64 ignore = -100;
  char label[256];
  snprintf(label, sizeof label, "elem=%zuB tgt=%zuB rows=%lld V=%lld eps=%g red=%s lead=%zu inplace=%d",
           sizeof(T), sizeof(TG), rows, v, eps, red.c_str(), lead, inplace);
  printf("case %s\n", label);
  const size_t n = rows * v, es = sizeof(T);
  EmuBuf tgt = load("targets.raw");
  auto logits_raw = read_file("logits.raw");
  auto rloss_rows = load_f32("loss_rows.f32"), rloss = load_f32("loss.f32"),
       rgrad = load_f32("grad.f32");
  const double rel = storage_rel<T>(2e-5), frob = sizeof(T) == 4 ? 5e-6 : 1e-2;

  for (const char* variant : {"resident", "fused"}) {
    const bool res = variant[0] == 'r';
    EmuBuf x(lead * es + n * es, 0), g(inplace ? 0 : lead * es + n * es);
    memcpy(x.p() + lead * es, logits_raw.data(), n * es);
    T* xp = (T*)(x.p() + lead * es);
    T* gp = inplace ? xp : (T*)(g.p() + lead * es);
    EmuBuf status(24), loss_rows(rows * 4), loss(4);
    // cuda.rs launch: ce_targets (one block of 1024), the row kernel (a block per row), ce_reduce.
    emu_launch({{1, 1, 1}, {1024, 1, 1}, 0, false},
               [&] { ce_targets(status.as<Status>(), tgt.as<TG>(), rows, v, ignore); });
    const unsigned threads = fused_threads(v);
    size_t cap = 0, smem = 0, bps = 0;
    if (res) {
      auto [b, c] = resident_shape(threads, P.max_threads_per_sm, P.smem_per_sm,
                                   P.smem_per_block_optin, v / VEC);
      bps = b;
      cap = c;
      smem = cap * 16;
    }
    emu_launch({{(unsigned)rows, 1, 1}, {threads, 1, 1}, smem, false}, [&] {
      if (res)
        ce_resident(gp, loss_rows.as<float>(), xp, tgt.as<TG>(), status.as<Status>(), rows, v, v,
                    ignore, eps, dloss, mean, (i64)cap);
      else
        ce_fused(gp, loss_rows.as<float>(), xp, tgt.as<TG>(), status.as<Status>(), rows, v, v,
                 ignore, eps, dloss, mean);
    });
    emu_launch({{1, 1, 1}, {1024, 1, 1}, 0, false}, [&] {
      ce_reduce(loss.as<float>(), loss_rows.as<float>(), status.as<Status>(), rows, mean);
    });
    const Status* st = status.as<Status>();
    char w[128];
    if (res)
      printf("  resident: %u threads, %zu blocks/SM, cap %zu of %lld vectors, %zu B dynamic smem\n",
             threads, bps, cap, v / VEC, smem);
    if (st->bad_row != ~0ull) {
      printf("  FAIL status reports bad row %llu\n", st->bad_row);
      ++g_fail;
    }
    snprintf(w, sizeof w, "%s loss_rows", variant);
    compare(w, widen(loss_rows.as<float>(), rows), rloss_rows, 2e-5, 5e-6, 0.1);
    snprintf(w, sizeof w, "%s loss", variant);
    compare(w, widen(loss.as<float>(), 1), rloss, 2e-5, 5e-6);
    snprintf(w, sizeof w, "%s grad", variant);
    compare(w, widen(gp, n), rgrad, rel, frob, 1e-3);
    guard("logits", x);
    guard("grad", g);
    guard("loss_rows", loss_rows);
  }
  return finish(label);
}
