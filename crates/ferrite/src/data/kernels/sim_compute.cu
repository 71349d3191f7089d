// The simulated training step's "compute" for `ferrite data bench`: one warp spins on the GPU's
// nanosecond clock for `ns`, so the compute stream is busy exactly as long as a real step would
// keep it, after waiting (on the GPU) for its batch's copy. The bench measures the stream's idle
// gaps between consecutive steps: the time the GPU waited for data.
extern "C" __global__ void sim_compute(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
