// rotary — rotary position embeddings (RoPE): out = x with each pair of its first R dims rotated
// by the angle of the token's position, flash-attn's `apply_rotary_emb`.
//
// x, out: [B, S, H, D] (or [T, H, D] packed by cu_seqlens), the head dim contiguous, the other
// strides free (q and k may be views of a packed QKV buffer); out may be x itself (in place: each
// pair is read and written by one thread). cos, sin: [S_ro, R/2] contiguous. Pairs are
// (i, i + R/2) ("rotate half": GPT-NeoX, Llama) or (2i, 2i + 1) (interleaved: GPT-J):
//   o0 = x0·cos − x1·sin·sign,  o1 = x1·cos + x0·sin·sign     (sign −1: the inverse rotation,
//                                                               which is the backward)
// The D − R dims past the rotated ones are copied when out is not x. A token's position is
// s + offset (offset per sequence from `offsets`, else `offset0`); one outside [0, S_ro) gets NaN
// in its rotated dims — visible, and never a read past the tables.
//
// Specialisation: -DFE_ELEM=<storage type>. Arithmetic in fp32.
//
// step 1 — rotary_naive: a thread per pair (or per copied element), scalar loads.
// step 2 — rotary_vec: a thread per 16 bytes of the row: the pair's two halves (or, interleaved,
//   a vector of whole pairs) by 16-byte loads and stores; cos/sin by 16-byte loads too when the
//   pairs are split in halves. Needs R/2 (halves) or R (interleaved) and D − R a multiple of the
//   vector width, 16-byte aligned tensors and strides.

#include "ferrite.cuh"

using namespace ferrite;

#ifndef FE_ELEM
#define FE_ELEM float
#endif

typedef FE_ELEM T;
typedef Vec16<T> Vec;
constexpr int VEC = Vec::N;

struct Tok {
  i64 x, o;  // element offsets of the token's row (head 0) in x and out
  i64 pos;   // its position, or −1 when outside the tables
};

// The sequence of packed token n: the last b with cu[b] ≤ n (cu non-decreasing, cu[0] = 0).
__device__ __forceinline__ i64 seq_of(const int* __restrict__ cu, i64 batch, i64 n) {
  i64 lo = 0, hi = batch - 1;
  while (lo < hi) {
    const i64 mid = (lo + hi + 1) >> 1;
    if ((i64)cu[mid] <= n) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ Tok token(i64 n, const int* __restrict__ offsets, const int* __restrict__ cu,
                                     i64 batch, i64 seqlen, i64 ro_len, i64 offset0, i64 xb, i64 xs,
                                     i64 ob, i64 os) {
  i64 b, s;
  Tok t;
  if (cu) {
    b = seq_of(cu, batch, n);
    s = n - (i64)cu[b];
    t.x = n * xs;
    t.o = n * os;
  } else {
    b = n / seqlen;
    s = n - b * seqlen;
    t.x = b * xb + s * xs;
    t.o = b * ob + s * os;
  }
  const i64 p = s + (offsets ? (i64)offsets[b] : offset0);
  t.pos = (p >= 0 && p < ro_len) ? p : -1;
  return t;
}

#define ROTARY_PARAMS                                                                          \
  T *__restrict__ out, const T *__restrict__ x, const T *__restrict__ cosv,                    \
      const T *__restrict__ sinv, const int *__restrict__ offsets, const int *__restrict__ cu, \
      i64 ntok, i64 batch, i64 seqlen, i64 heads, i64 dim, i64 half, i64 ro_len, i64 offset0,  \
      i64 xb, i64 xs, i64 xh, i64 ob, i64 os, i64 oh, int interleaved, float sign, int copy_tail

extern "C" __global__ void rotary_naive(ROTARY_PARAMS) {
  const i64 tail = copy_tail ? dim - 2 * half : 0;
  const i64 per_head = half + tail;
  const i64 work = ntok * heads * per_head;
  const float nan = __int_as_float(0x7fc00000);
  for (i64 w = (i64)blockIdx.x * blockDim.x + threadIdx.x; w < work; w += (i64)gridDim.x * blockDim.x) {
    const i64 j = w % per_head;
    const i64 nh = w / per_head;
    const i64 h = nh % heads, n = nh / heads;
    const Tok t = token(n, offsets, cu, batch, seqlen, ro_len, offset0, xb, xs, ob, os);
    const T* xr = x + t.x + h * xh;
    T* orow = out + t.o + h * oh;
    if (j >= half) {
      const i64 d = 2 * half + (j - half);
      orow[d] = xr[d];
      continue;
    }
    const i64 d0 = interleaved ? 2 * j : j, d1 = interleaved ? 2 * j + 1 : j + half;
    const float x0 = to_float(xr[d0]), x1 = to_float(xr[d1]);
    float o0 = nan, o1 = nan;
    if (t.pos >= 0) {
      const float c = to_float(cosv[t.pos * half + j]), s = sign * to_float(sinv[t.pos * half + j]);
      o0 = x0 * c - x1 * s;
      o1 = x1 * c + x0 * s;
    }
    orow[d0] = from_float<T>(o0);
    orow[d1] = from_float<T>(o1);
  }
}

extern "C" __global__ void rotary_vec(ROTARY_PARAMS) {
  // Per head: `rot` vectors of rotated work (halves: a vector of each half; interleaved: a vector
  // of VEC/2 whole pairs), then `tail` vectors to copy.
  const i64 rot = interleaved ? 2 * half / VEC : half / VEC;
  const i64 tail = copy_tail ? (dim - 2 * half) / VEC : 0;
  const i64 per_head = rot + tail;
  const i64 work = ntok * heads * per_head;
  const float nan = __int_as_float(0x7fc00000);
  for (i64 w = (i64)blockIdx.x * blockDim.x + threadIdx.x; w < work; w += (i64)gridDim.x * blockDim.x) {
    const i64 j = w % per_head;
    const i64 nh = w / per_head;
    const i64 h = nh % heads, n = nh / heads;
    const Tok t = token(n, offsets, cu, batch, seqlen, ro_len, offset0, xb, xs, ob, os);
    const T* xr = x + t.x + h * xh;
    T* orow = out + t.o + h * oh;
    if (j >= rot) {
      const i64 d = 2 * half + (j - rot) * VEC;
      *reinterpret_cast<Vec*>(orow + d) = *reinterpret_cast<const Vec*>(xr + d);
      continue;
    }
    if (interleaved) {
      const Vec a = *reinterpret_cast<const Vec*>(xr + j * VEC);
      Vec r;
#pragma unroll
      for (int k = 0; k < VEC / 2; ++k) {
        const i64 p = j * (VEC / 2) + k;
        const float x0 = to_float(a.v[2 * k]), x1 = to_float(a.v[2 * k + 1]);
        float o0 = nan, o1 = nan;
        if (t.pos >= 0) {
          const float c = to_float(cosv[t.pos * half + p]), s = sign * to_float(sinv[t.pos * half + p]);
          o0 = x0 * c - x1 * s;
          o1 = x1 * c + x0 * s;
        }
        r.v[2 * k] = from_float<T>(o0);
        r.v[2 * k + 1] = from_float<T>(o1);
      }
      *reinterpret_cast<Vec*>(orow + j * VEC) = r;
    } else {
      const Vec a = *reinterpret_cast<const Vec*>(xr + j * VEC);
      const Vec b = *reinterpret_cast<const Vec*>(xr + half + j * VEC);
      Vec ra, rb;
      if (t.pos >= 0) {
        const Vec c = *reinterpret_cast<const Vec*>(cosv + t.pos * half + j * VEC);
        const Vec s = *reinterpret_cast<const Vec*>(sinv + t.pos * half + j * VEC);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float x0 = to_float(a.v[k]), x1 = to_float(b.v[k]);
          const float cf = to_float(c.v[k]), sf = sign * to_float(s.v[k]);
          ra.v[k] = from_float<T>(x0 * cf - x1 * sf);
          rb.v[k] = from_float<T>(x1 * cf + x0 * sf);
        }
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) ra.v[k] = rb.v[k] = from_float<T>(nan);
      }
      *reinterpret_cast<Vec*>(orow + j * VEC) = ra;
      *reinterpret_cast<Vec*>(orow + half + j * VEC) = rb;
    }
  }
}
