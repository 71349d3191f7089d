/*
 * ferrite's C API from C: matmul, attention, RMSNorm and LayerNorm checked against naive C
 * references, then bad input checked to come back as error codes whose message names the
 * argument. Exit status 0 when every check passes.
 *
 * Host memory (the CPU path), as tests/c_test.rs builds and runs it in `cargo test`:
 *   cc -std=c11 -I crates/ferrite-capi/include test_capi.c -L DIR -lferrite_capi -lm
 * Device memory from cudaMalloc (the CUDA path, on a stream of its own), as
 * scripts/gpu-suite/capi.sh builds it on a GPU machine:
 *   cc -std=c11 -DFERRITE_TEST_CUDA -I .../include -I /usr/local/cuda/include test_capi.c \
 *      -L DIR -lferrite_capi -L /usr/local/cuda/lib64 -lcudart -lm
 * (or nvcc -x c ... / nvcc -x cu ...: the file is C and C++ alike).
 */
#include "ferrite.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef FERRITE_TEST_CUDA
#include <cuda_runtime_api.h> /* the runtime's C interface: plain C compilers take it */
#endif

static int failures = 0;

#define CHECK(cond, ...)                                                                       \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      failures++;                                                                              \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                     \
      fprintf(stderr, __VA_ARGS__);                                                            \
      fprintf(stderr, "\n");                                                                   \
    }                                                                                          \
  } while (0)

/* A call expected to succeed: on failure, the status and the message are printed. */
#define EXPECT_OK(call)                                                                        \
  do {                                                                                         \
    FerriteStatus st_ = (call);                                                                \
    CHECK(st_ == FERRITE_STATUS_OK, "%s -> %s: %s", #call, ferrite_status_name(st_),         \
          ferrite_last_error());                                                               \
  } while (0)

/* ---------------------------------------------------------------------------------------- */
/* Memory: host buffers, or device buffers filled and read through a stream.                 */

#ifdef FERRITE_TEST_CUDA
static cudaStream_t stream;

#define CUDA_OK(x)                                                                             \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__,        \
              __LINE__, cudaGetErrorString(e_));                                               \
      exit(2);                                                                                 \
    }                                                                                          \
  } while (0)

static void *mem_alloc(size_t bytes) {
  void *p = NULL;
  CUDA_OK(cudaMalloc(&p, bytes ? bytes : 1));
  return p;
}
static void mem_free(void *p) { CUDA_OK(cudaFree(p)); }
static void mem_upload(void *dst, const void *src, size_t bytes) {
  CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
}
static void mem_download(void *dst, const void *src, size_t bytes) {
  CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
}
static FerriteDevice device(void) { return ferrite_device_cuda(0, (void *)stream); }
#else
static void *mem_alloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    fprintf(stderr, "out of host memory\n");
    exit(2);
  }
  return p;
}
static void mem_free(void *p) { free(p); }
static void mem_upload(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
static void mem_download(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
static FerriteDevice device(void) { return ferrite_device_cpu(); }
#endif

/* ---------------------------------------------------------------------------------------- */
/* Tensors: a descriptor with its own shape and stride arrays (so never copied), its memory.  */

typedef struct Tensor {
  FerriteTensor t;
  int64_t shape[FERRITE_MAX_DIMS];
  int64_t strides[FERRITE_MAX_DIMS];
  void *mem;
  size_t numel;
} Tensor;

static size_t dtype_size(FerriteDtype dt) { return dt == FERRITE_DTYPE_F32 ? 4 : 2; }

static const char *dtype_name(FerriteDtype dt) {
  return dt == FERRITE_DTYPE_F32 ? "f32" : dt == FERRITE_DTYPE_BF16 ? "bf16" : "f16";
}

static uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
  return (uint16_t)(u >> 16);
}

static float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* A contiguous tensor of `ndim` dims. */
static Tensor *tensor_new(FerriteDtype dt, int ndim, const int64_t *shape) {
  Tensor *x = (Tensor *)calloc(1, sizeof(Tensor));
  x->numel = 1;
  for (int i = 0; i < ndim; i++) {
    x->shape[i] = shape[i];
    x->numel *= (size_t)shape[i];
  }
  x->mem = mem_alloc(x->numel * dtype_size(dt));
  x->t.data = x->mem;
  x->t.shape = x->shape;
  x->t.strides = NULL;
  x->t.ndim = ndim;
  x->t.dtype = dt;
  return x;
}

static void tensor_free(Tensor *x) {
  mem_free(x->mem);
  free(x);
}

/* Writes `v` (numel floats) into the tensor, rounded to its dtype; `v` is rounded in place so a
 * reference computed from it sees exactly the tensor's values. */
static void tensor_set(Tensor *x, float *v) {
  size_t n = x->numel;
  if (x->t.dtype == FERRITE_DTYPE_F32) {
    mem_upload(x->mem, v, n * 4);
    return;
  }
  uint16_t *h = (uint16_t *)malloc(n * 2);
  for (size_t i = 0; i < n; i++) {
    h[i] = f32_to_bf16(v[i]);
    v[i] = bf16_to_f32(h[i]);
  }
  mem_upload(x->mem, h, n * 2);
#ifdef FERRITE_TEST_CUDA
  CUDA_OK(cudaStreamSynchronize(stream));
#endif
  free(h);
}

/* Reads the tensor into `out` (numel floats). */
static void tensor_get(const Tensor *x, float *out) {
  size_t n = x->numel;
  if (x->t.dtype == FERRITE_DTYPE_F32) {
    mem_download(out, x->mem, n * 4);
    return;
  }
  uint16_t *h = (uint16_t *)malloc(n * 2);
  mem_download(h, x->mem, n * 2);
  for (size_t i = 0; i < n; i++) out[i] = bf16_to_f32(h[i]);
  free(h);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float uniform(void) { /* in [-1, 1) */
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((rng_state >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}
static float *random_floats(size_t n) {
  float *v = (float *)malloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) v[i] = uniform();
  return v;
}

/* Compares n values; returns the number outside atol + rtol·|want| (printing the first few). */
static int compare(const char *what, const float *got, const double *want, size_t n, double atol,
                   double rtol) {
  int bad = 0;
  double worst = 0.0;
  for (size_t i = 0; i < n; i++) {
    double err = fabs((double)got[i] - want[i]);
    if (err > worst) worst = err;
    if (!(err <= atol + rtol * fabs(want[i]))) {
      if (bad < 3)
        fprintf(stderr, "  %s[%zu]: got %.6g, want %.6g\n", what, i, (double)got[i], want[i]);
      bad++;
    }
  }
  CHECK(bad == 0, "%s: %d of %zu values out of tolerance (largest error %.3g)", what, bad, n,
        worst);
  printf("  %-28s max abs error %.3g over %zu values\n", what, worst, n);
  return bad;
}

static double atol_of(FerriteDtype dt) { return dt == FERRITE_DTYPE_F32 ? 1e-4 : 2e-2; }
static double rtol_of(FerriteDtype dt) { return dt == FERRITE_DTYPE_F32 ? 1e-4 : 2e-2; }

/* ---------------------------------------------------------------------------------------- */
/* matmul: C = A·B with B given as a transposed view of a [N, K] buffer (strides in elements). */

static void test_matmul(FerriteDtype dt) {
  const int64_t M = 37, K = 64, N = 40;
  printf("matmul %s %lldx%lldx%lld (B a transposed view)\n", dtype_name(dt), (long long)M,
         (long long)K, (long long)N);
  int64_t sa[2] = {M, K}, sbt[2] = {N, K}, sc[2] = {M, N};
  Tensor *a = tensor_new(dt, 2, sa), *bt = tensor_new(dt, 2, sbt), *c = tensor_new(dt, 2, sc);
  float *va = random_floats((size_t)(M * K)), *vb = random_floats((size_t)(N * K));
  tensor_set(a, va);
  tensor_set(bt, vb);
  /* b = btᵀ: shape [K, N], strides [1, K] over bt's memory. */
  int64_t b_shape[2] = {K, N}, b_strides[2] = {1, K};
  FerriteTensor b = bt->t;
  b.shape = b_shape;
  b.strides = b_strides;
  EXPECT_OK(ferrite_matmul(device(), &a->t, &b, &c->t, 1.0f, 0.0f, false));
  double *want = (double *)malloc((size_t)(M * N) * sizeof(double));
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) {
      double s = 0;
      for (int64_t k = 0; k < K; k++) s += (double)va[i * K + k] * vb[j * K + k];
      want[i * N + j] = s;
    }
  float *got = (float *)malloc((size_t)(M * N) * sizeof(float));
  tensor_get(c, got);
  compare("matmul out", got, want, (size_t)(M * N), atol_of(dt) * 4, rtol_of(dt));
  free(va), free(vb), free(want), free(got);
  tensor_free(a), tensor_free(bt), tensor_free(c);
}

/* ---------------------------------------------------------------------------------------- */
/* attention: causal, grouped-query (4 query heads over 2 kv heads), [B, S, H, D].            */

static void test_attention(FerriteDtype dt) {
  const int64_t B = 2, S = 17, HQ = 4, HKV = 2, D = 64;
  printf("attention %s B%lld S%lld Hq%lld Hkv%lld D%lld causal\n", dtype_name(dt),
         (long long)B, (long long)S, (long long)HQ, (long long)HKV, (long long)D);
  int64_t sq[4] = {B, S, HQ, D}, skv[4] = {B, S, HKV, D}, sl[3] = {B, HQ, S};
  Tensor *q = tensor_new(dt, 4, sq), *k = tensor_new(dt, 4, skv), *v = tensor_new(dt, 4, skv);
  Tensor *o = tensor_new(dt, 4, sq), *lse = tensor_new(FERRITE_DTYPE_F32, 3, sl);
  size_t nq = q->numel, nkv = k->numel;
  float *vq = random_floats(nq), *vk = random_floats(nkv), *vv = random_floats(nkv);
  tensor_set(q, vq);
  tensor_set(k, vk);
  tensor_set(v, vv);
  FerriteAttentionOptions opts = ferrite_attention_options_default();
  opts.causal = true;
  EXPECT_OK(ferrite_attention_forward(device(), &q->t, &k->t, &v->t, &o->t, &lse->t, NULL, &opts));

  double *want_o = (double *)calloc(nq, sizeof(double));
  double *want_lse = (double *)calloc(lse->numel, sizeof(double));
  double *p = (double *)malloc((size_t)S * sizeof(double));
  const double scale = 1.0 / sqrt((double)D);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < HQ; h++) {
      int64_t hk = h / (HQ / HKV);
      for (int64_t i = 0; i < S; i++) {
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j <= i; j++) { /* causal: key j visible from query i iff j <= i */
          double s = 0;
          for (int64_t d = 0; d < D; d++)
            s += (double)vq[((b * S + i) * HQ + h) * D + d] * vk[((b * S + j) * HKV + hk) * D + d];
          p[j] = s * scale;
          if (p[j] > mx) mx = p[j];
        }
        for (int64_t j = 0; j <= i; j++) sum += (p[j] = exp(p[j] - mx));
        for (int64_t d = 0; d < D; d++) {
          double acc = 0;
          for (int64_t j = 0; j <= i; j++) acc += p[j] * vv[((b * S + j) * HKV + hk) * D + d];
          want_o[((b * S + i) * HQ + h) * D + d] = acc / sum;
        }
        want_lse[(b * HQ + h) * S + i] = mx + log(sum);
      }
    }
  float *got_o = (float *)malloc(nq * sizeof(float));
  float *got_lse = (float *)malloc(lse->numel * sizeof(float));
  tensor_get(o, got_o);
  tensor_get(lse, got_lse);
  compare("attention o", got_o, want_o, nq, atol_of(dt), rtol_of(dt));
  compare("attention lse", got_lse, want_lse, lse->numel, atol_of(dt), rtol_of(dt));
  free(vq), free(vk), free(vv), free(want_o), free(want_lse), free(p), free(got_o),
      free(got_lse);
  tensor_free(q), tensor_free(k), tensor_free(v), tensor_free(o), tensor_free(lse);
}

/* ---------------------------------------------------------------------------------------- */
/* RMSNorm and LayerNorm over the last dim, with weight (and bias), rstd and mean saved.      */

static void test_norms(FerriteDtype dt) {
  const int64_t R = 13, C = 96;
  const float eps = 1e-5f;
  printf("rms_norm / layer_norm %s %lldx%lld\n", dtype_name(dt), (long long)R, (long long)C);
  int64_t sx[2] = {R, C}, sw[1] = {C}, sr[1] = {R};
  Tensor *x = tensor_new(dt, 2, sx), *w = tensor_new(dt, 1, sw), *bias = tensor_new(dt, 1, sw);
  Tensor *y = tensor_new(dt, 2, sx), *rstd = tensor_new(FERRITE_DTYPE_F32, 1, sr);
  Tensor *mean = tensor_new(FERRITE_DTYPE_F32, 1, sr);
  float *vx = random_floats((size_t)(R * C)), *vw = random_floats((size_t)C);
  float *vb = random_floats((size_t)C);
  for (int64_t i = 0; i < R * C; i++) vx[i] = vx[i] * 2.0f + 0.5f; /* a mean to remove */
  tensor_set(x, vx);
  tensor_set(w, vw);
  tensor_set(bias, vb);
  double *want = (double *)malloc((size_t)(R * C) * sizeof(double));
  double *want_rstd = (double *)malloc((size_t)R * sizeof(double));
  double *want_mean = (double *)malloc((size_t)R * sizeof(double));
  float *got = (float *)malloc((size_t)(R * C) * sizeof(float));
  float *got_r = (float *)malloc((size_t)R * sizeof(float));
  float *got_m = (float *)malloc((size_t)R * sizeof(float));

  EXPECT_OK(ferrite_rms_norm_forward(device(), &x->t, NULL, &w->t, &y->t, NULL, &rstd->t, eps));
  for (int64_t r = 0; r < R; r++) {
    double ss = 0;
    for (int64_t c = 0; c < C; c++) ss += (double)vx[r * C + c] * vx[r * C + c];
    want_rstd[r] = 1.0 / sqrt(ss / (double)C + eps);
    for (int64_t c = 0; c < C; c++) want[r * C + c] = vx[r * C + c] * want_rstd[r] * vw[c];
  }
  tensor_get(y, got);
  tensor_get(rstd, got_r);
  compare("rms_norm y", got, want, (size_t)(R * C), atol_of(dt), rtol_of(dt));
  compare("rms_norm rstd", got_r, want_rstd, (size_t)R, 1e-4, 1e-4);

  EXPECT_OK(ferrite_layer_norm_forward(device(), &x->t, NULL, &w->t, &bias->t, &y->t, NULL,
                                       &mean->t, &rstd->t, eps));
  for (int64_t r = 0; r < R; r++) {
    double s = 0, ss = 0;
    for (int64_t c = 0; c < C; c++) s += vx[r * C + c];
    want_mean[r] = s / (double)C;
    for (int64_t c = 0; c < C; c++) {
      double d = vx[r * C + c] - want_mean[r];
      ss += d * d;
    }
    want_rstd[r] = 1.0 / sqrt(ss / (double)C + eps);
    for (int64_t c = 0; c < C; c++)
      want[r * C + c] = (vx[r * C + c] - want_mean[r]) * want_rstd[r] * vw[c] + vb[c];
  }
  tensor_get(y, got);
  tensor_get(rstd, got_r);
  tensor_get(mean, got_m);
  compare("layer_norm y", got, want, (size_t)(R * C), atol_of(dt), rtol_of(dt));
  compare("layer_norm mean", got_m, want_mean, (size_t)R, 1e-4, 1e-4);
  compare("layer_norm rstd", got_r, want_rstd, (size_t)R, 1e-4, 1e-4);

  free(vx), free(vw), free(vb), free(want), free(want_rstd), free(want_mean), free(got),
      free(got_r), free(got_m);
  tensor_free(x), tensor_free(w), tensor_free(bias), tensor_free(y), tensor_free(rstd),
      tensor_free(mean);
}

/* ---------------------------------------------------------------------------------------- */
/* Bad input: an error code, and a message naming the argument; never a crash.              */

static void expect_error(FerriteStatus got, FerriteStatus want, const char *what,
                         const char *needle1, const char *needle2) {
  const char *msg = ferrite_last_error();
  CHECK(got == want, "%s: status %s, want %s (%s)", what, ferrite_status_name(got),
        ferrite_status_name(want), msg);
  CHECK(msg != NULL && strlen(msg) > 0, "%s: empty last error", what);
  if (needle1) CHECK(strstr(msg, needle1) != NULL, "%s: '%s' not in: %s", what, needle1, msg);
  if (needle2) CHECK(strstr(msg, needle2) != NULL, "%s: '%s' not in: %s", what, needle2, msg);
  printf("  %-28s %s: %s\n", what, ferrite_status_name(got), msg);
}

static void test_bad_input(void) {
  printf("bad input\n");
  int64_t sa[2] = {4, 8}, sb[2] = {8, 3}, sc[2] = {4, 3};
  Tensor *a = tensor_new(FERRITE_DTYPE_F32, 2, sa), *b = tensor_new(FERRITE_DTYPE_F32, 2, sb);
  Tensor *c = tensor_new(FERRITE_DTYPE_F32, 2, sc);
  float *va = random_floats(a->numel), *vb = random_floats(b->numel);
  tensor_set(a, va);
  tensor_set(b, vb);
  FerriteDevice dev = device();

  expect_error(ferrite_matmul(dev, NULL, &b->t, &c->t, 1, 0, false),
               FERRITE_STATUS_INVALID_ARGUMENT, "null tensor", "ferrite_matmul", "`a`");

  FerriteTensor t = a->t;
  t.data = NULL;
  expect_error(ferrite_matmul(dev, &t, &b->t, &c->t, 1, 0, false),
               FERRITE_STATUS_INVALID_ARGUMENT, "null data", "`a`", "null");

  int64_t negative[2] = {4, -8};
  t = a->t;
  t.shape = negative;
  expect_error(ferrite_matmul(dev, &t, &b->t, &c->t, 1, 0, false),
               FERRITE_STATUS_INVALID_ARGUMENT, "negative size", "`a`", "-8");

  int64_t huge[2] = {INT64_MAX, 2};
  t = a->t;
  t.shape = huge;
  expect_error(ferrite_matmul(dev, &t, &b->t, &c->t, 1, 0, false),
               FERRITE_STATUS_INVALID_ARGUMENT, "overflowing size", "`a`", "address space");

  t = a->t;
  t.ndim = 9;
  expect_error(ferrite_matmul(dev, &t, &b->t, &c->t, 1, 0, false),
               FERRITE_STATUS_INVALID_ARGUMENT, "ndim 9", "`a`", "ndim");

  t = a->t;
  t.dtype = 99;
  expect_error(ferrite_matmul(dev, &t, &b->t, &c->t, 1, 0, false),
               FERRITE_STATUS_INVALID_ARGUMENT, "unknown dtype", "`a`", "FERRITE_DTYPE");

  t = a->t;
  t.data = (char *)a->mem + 2;
  t.shape = sc; /* a smaller view, so the shifted span stays inside the buffer */
  expect_error(ferrite_matmul(dev, &t, &b->t, &c->t, 1, 0, false),
               FERRITE_STATUS_INVALID_ARGUMENT, "misaligned data", "`a`", "aligned");

  /* ferrite's own checks: the inner dims differ (b is [8, 3], a viewed as [4, 3]). */
  t = a->t;
  t.shape = sc;
  expect_error(ferrite_matmul(dev, &t, &b->t, &c->t, 1, 0, false),
               FERRITE_STATUS_INVALID_ARGUMENT, "inner dims differ", "matmul", "`b`");

  FerriteDevice bad_dev = dev;
  bad_dev.kind = 5;
  expect_error(ferrite_matmul(bad_dev, &a->t, &b->t, &c->t, 1, 0, false),
               FERRITE_STATUS_INVALID_ARGUMENT, "unknown device kind", "`device.kind`", "5");

  FerriteAttentionOptions o = ferrite_attention_options_default();
  o.layout = 7;
  expect_error(ferrite_attention_forward(dev, &a->t, &a->t, &a->t, &c->t, &c->t, NULL, &o),
               FERRITE_STATUS_INVALID_ARGUMENT, "unknown layout", "`options.layout`", "7");

#ifdef FERRITE_TEST_CUDA
  /* Host memory handed to the CUDA path, and a device allocation smaller than the view. */
  t = a->t;
  t.data = va;
  expect_error(ferrite_matmul(dev, &t, &b->t, &c->t, 1, 0, false),
               FERRITE_STATUS_INVALID_ARGUMENT, "host pointer on CUDA", "`a`", "CUDA does not know");
  void *small = mem_alloc(16);
  int64_t big[2] = {1 << 20, 8}; /* 32 MiB of view over a 16-byte allocation */
  t = a->t;
  t.data = small;
  t.shape = big;
  expect_error(ferrite_matmul(dev, &t, &b->t, &c->t, 1, 0, false),
               FERRITE_STATUS_INVALID_ARGUMENT, "undersized allocation", "`a`", "allocation");
  mem_free(small);
  int count = 0;
  CUDA_OK(cudaGetDeviceCount(&count));
  expect_error(ferrite_matmul(ferrite_device_cuda(count, NULL), &a->t, &b->t, &c->t, 1, 0, false),
               FERRITE_STATUS_INVALID_ARGUMENT, "device index past the last", "`device.index`", NULL);
#else
  /* The CPU path takes no stream. */
  bad_dev = dev;
  bad_dev.stream = (void *)0x1000;
  expect_error(ferrite_matmul(bad_dev, &a->t, &b->t, &c->t, 1, 0, false),
               FERRITE_STATUS_INVALID_ARGUMENT, "stream on the CPU", "`device.stream`", NULL);
  int32_t n = -1;
  FerriteStatus st = ferrite_cuda_device_count(&n);
  CHECK((st == FERRITE_STATUS_OK && n > 0) || (st == FERRITE_STATUS_CUDA_UNAVAILABLE && n == 0),
        "ferrite_cuda_device_count: %s, %d (%s)", ferrite_status_name(st), n, ferrite_last_error());
#endif

  /* A successful call clears the message. */
  EXPECT_OK(ferrite_matmul(dev, &a->t, &b->t, &c->t, 1, 0, false));
  CHECK(strcmp(ferrite_last_error(), "") == 0, "last error after success: %s",
        ferrite_last_error());

  free(va), free(vb);
  tensor_free(a), tensor_free(b), tensor_free(c);
}

int main(void) {
  printf("ferrite %s (header %d.%d.%d)\n", ferrite_version(), FERRITE_VERSION_MAJOR,
         FERRITE_VERSION_MINOR, FERRITE_VERSION_PATCH);
  CHECK(ferrite_version_number() ==
            FERRITE_VERSION_MAJOR * 10000 + FERRITE_VERSION_MINOR * 100 + FERRITE_VERSION_PATCH,
        "library version %s does not match the header", ferrite_version());
#ifdef FERRITE_TEST_CUDA
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  /* matmul in f32 and bf16 (tensor cores); attention f32 (naive) and bf16 (flash / hopper). */
  const FerriteDtype matmul_dtypes[] = {FERRITE_DTYPE_F32, FERRITE_DTYPE_BF16};
#else
  /* The CPU path's matmul is f32 only; attention and the norms take bf16 too. */
  const FerriteDtype matmul_dtypes[] = {FERRITE_DTYPE_F32};
#endif
  const FerriteDtype dtypes[] = {FERRITE_DTYPE_F32, FERRITE_DTYPE_BF16};
  for (size_t i = 0; i < sizeof matmul_dtypes / sizeof matmul_dtypes[0]; i++)
    test_matmul(matmul_dtypes[i]);
  for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
    test_attention(dtypes[i]);
    test_norms(dtypes[i]);
  }
  test_bad_input();
#ifdef FERRITE_TEST_CUDA
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaStreamDestroy(stream));
#endif
  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("all checks passed\n");
  return 0;
}
