// The f64 attention reference of the attention emulators (scripts/flash-emu, scripts/hopper-emu):
// forward (o rounded to bf16 as the kernels store it, and the unrounded o and lse) and backward
// from that rounded o (Δ as flash_bwd_dot computes it, in f32), bottom-right aligned masks,
// GQA, varlen (per-sequence lengths), soft-capping.
#pragma once
#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

struct AttnRefProblem {
  int B, Hq, Hkv, D;
  std::vector<int> lq, lk;  // per-sequence lengths
  long wl, wr;
  float softcap, scale;
};

struct AttnRef {
  std::vector<double> o, lse, dq, dk, dv;  // o unrounded; lse: −inf for a row that sees no key
  std::vector<float> lse_f, delta;         // what the backward kernels read
};

// qoff(b, i, h) / koff(b, j, h): element offsets of a row's d = 0 in q-like / k-like tensors;
// lidx(b, h, i): the row's index in lse-like arrays. `o` receives the bf16-rounded output.
template <class Bf>
AttnRef attn_reference(const AttnRefProblem& P, const std::vector<Bf>& q, const std::vector<Bf>& k,
                       const std::vector<Bf>& v, const std::vector<Bf>& dout, std::vector<Bf>& o,
                       size_t nl, const std::function<long(int, int, int)>& qoff,
                       const std::function<long(int, int, int)>& koff,
                       const std::function<long(int, int, int)>& lidx) {
  const int D = P.D, group = P.Hq / P.Hkv;
  AttnRef r;
  r.o.assign(q.size(), 0);
  r.dq.assign(q.size(), 0);
  r.dk.assign(k.size(), 0);
  r.dv.assign(k.size(), 0);
  r.lse.assign(nl, NAN);
  r.lse_f.assign(nl, NAN);
  r.delta.assign(nl, NAN);
  auto f = [](Bf x) { return (double)bf2f(x.x); };
  for (int b = 0; b < P.B; ++b)
    for (int h = 0; h < P.Hq; ++h) {
      const int hk = h / group, sq = P.lq[b], sk = P.lk[b];
      for (int i = 0; i < sq; ++i) {
        const long pos = i + sk - sq, qi = qoff(b, i, h), li = lidx(b, h, i);
        std::vector<int> vis;
        for (int j = 0; j < sk; ++j)
          if ((P.wl < 0 || j >= pos - P.wl) && (P.wr < 0 || j <= pos + P.wr)) vis.push_back(j);
        for (int d = 0; d < D; ++d) o[qi + d].x = 0;
        if (vis.empty()) { r.lse[li] = r.lse_f[li] = -INFINITY; r.delta[li] = 0; continue; }
        std::vector<double> s(vis.size()), th(vis.size());
        for (size_t n = 0; n < vis.size(); ++n) {
          double a = 0;
          for (int d = 0; d < D; ++d) a += f(q[qi + d]) * f(k[koff(b, vis[n], hk) + d]);
          a *= P.scale;
          if (P.softcap > 0) { th[n] = tanh(a / P.softcap); a = P.softcap * th[n]; }
          s[n] = a;
        }
        double m = *std::max_element(s.begin(), s.end()), sum = 0;
        for (double x : s) sum += exp(x - m);
        r.lse[li] = m + log(sum);
        r.lse_f[li] = (float)r.lse[li];
        std::vector<double> p(vis.size());
        for (size_t n = 0; n < vis.size(); ++n) p[n] = exp(s[n] - m) / sum;
        for (int d = 0; d < D; ++d) {
          double a = 0;
          for (size_t n = 0; n < vis.size(); ++n) a += p[n] * f(v[koff(b, vis[n], hk) + d]);
          r.o[qi + d] = a;
          o[qi + d].x = f2bf((float)a);
        }
        float dl = 0;
        for (int d = 0; d < D; ++d) dl += bf2f(dout[qi + d].x) * bf2f(o[qi + d].x);
        r.delta[li] = dl;
        double dsum = 0;
        for (int d = 0; d < D; ++d) dsum += f(dout[qi + d]) * f(o[qi + d]);
        for (size_t n = 0; n < vis.size(); ++n) {
          const long kj = koff(b, vis[n], hk);
          double dp = 0;
          for (int d = 0; d < D; ++d) dp += f(dout[qi + d]) * f(v[kj + d]);
          double ds = p[n] * (dp - dsum);
          if (P.softcap > 0) ds *= 1 - th[n] * th[n];
          for (int d = 0; d < D; ++d) {
            r.dq[qi + d] += P.scale * ds * f(k[kj + d]);
            r.dk[kj + d] += P.scale * ds * f(q[qi + d]);
            r.dv[kj + d] += p[n] * f(dout[qi + d]);
          }
        }
      }
    }
  return r;
}
