// philox.cuh — Philox4x32-10, the CUDA twin of core/philox.rs (same bits; see that file for the
// addressing: key = seed, element i takes the 16-bit half i%2 (low first) of word (i/2)%4 of the
// block at counter offset + i/8).
#ifndef FERRITE_PHILOX_CUH
#define FERRITE_PHILOX_CUH

namespace ferrite {

struct Philox4 {
  unsigned int w[4];
};

// The block at 64-bit counter `c` of the stream keyed by `seed` (counter words 2, 3 are 0).
__device__ __forceinline__ Philox4 philox4x32_10(unsigned long long c, unsigned long long seed) {
  unsigned int c0 = (unsigned int)c, c1 = (unsigned int)(c >> 32), c2 = 0u, c3 = 0u;
  unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    const unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  Philox4 o;
  o.w[0] = c0;
  o.w[1] = c1;
  o.w[2] = c2;
  o.w[3] = c3;
  return o;
}

// Whether the element drawing half `hi` of word `w` is kept, given T = thr << 16 (thr = the 16-bit
// keep threshold, < 2¹⁶, so T does not overflow): low half kept ⇔ (w & 0xFFFF) < thr ⇔ (w << 16)
// < T; high half ⇔ (w >> 16) < thr ⇔ w < T (T's low 16 bits are 0). One shift and one compare per
// two elements, no extraction.
__device__ __forceinline__ bool philox_keep16(unsigned int w, bool hi, unsigned int T) {
  return (hi ? w : (w << 16)) < T;
}

}  // namespace ferrite

#endif  // FERRITE_PHILOX_CUH
