// Driver helpers for run.sh's drivers (included after the extracted kernels): key=value
// arguments, the case files refgen wrote, comparisons against the CPU path, and the H100's
// properties the host code sizes launches from.
#pragma once
#include <map>
#include <string>

using namespace ferrite;

// H100 SXM (what cuda.rs reads from the driver): SMs, threads and shared memory per SM, opt-in
// shared memory per block. `sm=` overrides the SM count (a small count makes the fixed grids of
// the backward kernels walk many rows per block, as they do at real sizes).
struct Props {
  int sm_count = 132;
  int max_threads_per_sm = 2048;
  size_t smem_per_sm = 233472;
  size_t smem_per_block_optin = 232448;
};

struct Args {
  std::map<std::string, std::string> kv;
  Args(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      auto e = a.find('=');
      if (e == std::string::npos) emu_die(("argument without '=': " + a).c_str());
      kv[a.substr(0, e)] = a.substr(e + 1);
    }
  }
  bool has(const char* k) const { return kv.count(k); }
  std::string s(const char* k) const {
    auto it = kv.find(k);
    if (it == kv.end()) emu_die((std::string("missing argument ") + k).c_str());
    return it->second;
  }
  long long i(const char* k) const { return std::stoll(s(k)); }
  unsigned long long u(const char* k) const { return std::stoull(s(k)); }
  double f(const char* k) const { return std::stod(s(k)); }
  std::vector<long long> list(const char* k) const {
    std::vector<long long> v;
    std::string t = s(k);
    size_t p = 0;
    while (p <= t.size()) {
      size_t q = t.find(',', p);
      if (q == std::string::npos) q = t.size();
      if (q > p) v.push_back(std::stoll(t.substr(p, q - p)));
      p = q + 1;
    }
    return v;
  }
};

static std::string g_dir;
static int g_fail = 0;

static std::vector<unsigned char> read_file(const std::string& name, bool must = true) {
  std::vector<unsigned char> v;
  FILE* f = fopen((g_dir + "/" + name).c_str(), "rb");
  if (!f) {
    if (must) emu_die(("cannot open " + g_dir + "/" + name).c_str());
    return v;
  }
  fseek(f, 0, SEEK_END);
  v.resize(ftell(f));
  fseek(f, 0, SEEK_SET);
  if (fread(v.data(), 1, v.size(), f) != v.size()) emu_die("short read");
  fclose(f);
  return v;
}

// A raw input file into a fresh device buffer (`extra` bytes of room before it: `lead`).
static EmuBuf load(const std::string& name, size_t lead = 0) {
  auto v = read_file(name);
  EmuBuf b(v.size() + lead, 0);
  memcpy(b.p() + lead, v.data(), v.size());
  return b;
}

static std::vector<float> load_f32(const std::string& name, bool must = true) {
  auto v = read_file(name, must);
  std::vector<float> f(v.size() / 4);
  memcpy(f.data(), v.data(), v.size());
  return f;
}

static std::map<std::string, std::string> load_meta() {
  std::map<std::string, std::string> m;
  auto v = read_file("meta.txt");
  std::string s(v.begin(), v.end());
  size_t p = 0;
  while (p < s.size()) {
    size_t e = s.find('\n', p);
    if (e == std::string::npos) e = s.size();
    std::string l = s.substr(p, e - p);
    auto sp = l.find(' ');
    if (sp != std::string::npos) m[l.substr(0, sp)] = l.substr(sp + 1);
    p = e + 1;
  }
  return m;
}

template <class E>
static std::vector<float> widen(const E* p, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = to_float(p[i]);
  return v;
}

// Storage-dtype tolerance: f32 results are held to `f32_rel` elementwise, 16-bit ones to one
// rounding step (both sides round an fp32 value that differs by a few ulp: at most 1 ulp apart,
// 2⁻⁷ relative for bf16, 2⁻¹⁰ for f16) plus the same fp32 slack.
template <class E>
static double storage_rel(double f32_rel) {
  if (sizeof(E) == 4) return f32_rel;
  return (std::is_same<E, __nv_bfloat16>::value ? 1.0 / 128 : 1.0 / 1024) * 1.001 + f32_rel;
}

// One f16 subnormal step (2⁻²⁴): below 2⁻¹⁴ an f16 ulp is that, not 2⁻¹⁰ relative.
static const double g_abs = std::is_same<T, __half>::value ? 0x1p-24 : 0.0;

// out vs ref: every element |o − r| ≤ rel·(|r| + floor) (+ g_abs), floor = `floor_frac`·RMS(ref) (the
// scale of the tensor, so results that cancel to ~0 are judged on that scale); a non-finite out
// where ref is finite (or the reverse) fails; also the checks' relative Frobenius error ≤ frob_tol.
static bool compare(const char* what, const std::vector<float>& out, const std::vector<float>& ref,
                    double rel, double frob_tol, double floor_frac = 1e-2, bool quiet = false) {
  if (out.size() != ref.size()) {
    printf("  FAIL %-28s size %zu vs %zu\n", what, out.size(), ref.size());
    ++g_fail;
    return false;
  }
  double ss = 0, num = 0, den = 0, worst = 0;
  size_t wi = 0, bad = 0, nonfin = 0;
  for (float r : ref)
    if (std::isfinite(r)) ss += (double)r * r;
  const double floor = floor_frac * sqrt(ss / std::max<size_t>(1, ref.size()));
  for (size_t i = 0; i < out.size(); ++i) {
    const double o = out[i], r = ref[i];
    if (!std::isfinite(r) || !std::isfinite(o)) {
      const bool same = (std::isnan(o) && std::isnan(r)) || o == r;
      if (!same) {
        ++nonfin;
        if (nonfin == 1) wi = i;
      }
      continue;
    }
    num += (o - r) * (o - r);
    den += r * r;
    const double e = std::max(0.0, fabs(o - r) - g_abs) / (fabs(r) + floor + 1e-30);
    if (e > rel) ++bad;
    if (e > worst) {
      worst = e;
      if (!nonfin) wi = i;
    }
  }
  const double frob = den == 0 ? sqrt(num) : sqrt(num / den);
  const bool ok = nonfin == 0 && bad == 0 && frob <= frob_tol;
  if (!ok) ++g_fail;
  if (!ok || !quiet)
    printf("  %s %-28s n=%zu frob=%.2e (tol %.0e) worst=%.2e/%.1e at %zu (out %.8g ref %.8g)%s%s\n",
           ok ? "ok  " : "FAIL", what, out.size(), frob, frob_tol, worst, rel, wi,
           out.empty() ? 0.0 : out[wi], ref.empty() ? 0.0 : ref[wi],
           bad ? (" over=" + std::to_string(bad)).c_str() : "",
           nonfin ? (" nonfinite=" + std::to_string(nonfin)).c_str() : "");
  return ok;
}

static void guard(const char* what, const EmuBuf& b) {
  if (!b.check()) {
    printf("  FAIL %s: write outside the buffer (guard band changed)\n", what);
    ++g_fail;
  }
}

static int finish(const char* label) {
  printf("%s %s\n", g_fail ? "FAIL" : "PASS", label);
  return g_fail ? 1 : 0;
}
