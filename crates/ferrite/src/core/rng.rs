//! A small, fast, seedable generator for test and bench inputs (SplitMix64). Not for cryptography.

/// SplitMix64 state: the same seed gives the same sequence on every machine.
#[derive(Clone, Debug)]
pub struct Rng(u64);

/// SplitMix64's increment: the state advances by it on every draw.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ GAMMA)
    }

    /// This generator as it will be `n` draws later, in O(1) (the state is a counter): what
    /// lets a fill split one sequence across threads and still write the same values.
    pub fn skip(&self, n: u64) -> Self {
        Rng(self.0.wrapping_add(n.wrapping_mul(GAMMA)))
    }

    /// A seed that differs on every call and every run (time, process, counter), for "fresh
    /// random inputs per run".
    pub fn fresh_seed() -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let mut r = Rng::new(t ^ ((std::process::id() as u64) << 32));
        r.next_u64()
            ^ COUNTER
                .fetch_add(1, Ordering::Relaxed)
                .wrapping_mul(0xD1B5_4A32_D192_ED03)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next_f64()
    }

    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn skip_lands_where_drawing_does() {
        let mut drawn = Rng::new(7);
        for _ in 0..1000 {
            drawn.next_u64();
        }
        let mut skipped = Rng::new(7).skip(1000);
        for _ in 0..5 {
            assert_eq!(skipped.next_u64(), drawn.next_u64());
        }
    }
}
