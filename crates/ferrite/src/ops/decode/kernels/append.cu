// append_kv (reshape-and-cache) — copies token t's K and V rows ([Hkv, D], row_units units of
// FE_UNIT) to cache slot slot_mapping[t] (slot = block·block_size + offset; −1 skips the token).
//
// Specialisation: -DFE_UNIT=<copy unit>: uint4 (16 bytes) when rows and pointers allow, else the
// element-sized unsigned type. A raw copy: the cache holds exactly the bits of k and v.
// A slot outside −1..capacity is not written and sets ERR_SLOT in *err (read by the host).

#include "ferrite.cuh"

using namespace ferrite;

#ifndef FE_UNIT
#define FE_UNIT unsigned short
#endif

typedef FE_UNIT U;
#define ERR_SLOT 4

// grid-stride over tokens, a block's threads over the row.
extern "C" __global__ void append_kv(U* __restrict__ kc, U* __restrict__ vc, const U* __restrict__ k,
                                     const U* __restrict__ v, const int* __restrict__ slots,
                                     int* err, i64 tokens, i64 row_units, i64 capacity) {
  for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
    const i64 s = slots[t];
    if (s == -1) continue;
    if (s < 0 || s >= capacity) {
      if (threadIdx.x == 0) atomicOr(err, ERR_SLOT);
      continue;
    }
    for (i64 u = threadIdx.x; u < row_units; u += blockDim.x) {
      kc[s * row_units + u] = k[t * row_units + u];
      vc[s * row_units + u] = v[t * row_units + u];
    }
  }
}
