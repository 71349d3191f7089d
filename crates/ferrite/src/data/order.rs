//! The order in which samples are delivered: a pure function of (seed, epoch, position), so a run
//! resumes exactly where it stopped whatever the I/O worker count, world size or batch size.
//!
//! Samples are numbered globally (shard by shard). Shuffling is two-level, so that reads stay large
//! and sequential while batches mix the whole corpus: the samples are cut into blocks of `K`
//! consecutive samples; the blocks are permuted by (seed, epoch); runs of `M` permuted blocks form a
//! window; inside a window the samples are permuted again by (seed, epoch, window). Both
//! permutations are keyed Feistel networks with cycle walking: bijections computed index by
//! index, with no table, so every sample appears exactly once per epoch by construction.

/// splitmix64's finaliser: a strong 64-bit mixer.
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A keyed pseudo-random permutation of `0..n`.
#[derive(Clone, Debug)]
pub struct Perm {
    n: u64,
    half_bits: u32,
    mask: u64,
    keys: [u64; 4],
}

impl Perm {
    /// The permutation of `0..n` keyed by `key`.
    pub fn new(n: u64, key: u64) -> Perm {
        // The smallest even-width power of two covering n, so cycle walking takes < 4 steps on
        // average.
        let bits = if n <= 1 {
            2
        } else {
            64 - (n - 1).leading_zeros()
        };
        let half_bits = bits.div_ceil(2).max(1);
        let mut k = mix64(key);
        let mut keys = [0u64; 4];
        for slot in keys.iter_mut() {
            k = mix64(k);
            *slot = k;
        }
        Perm {
            n,
            half_bits,
            mask: (1u64 << half_bits) - 1,
            keys,
        }
    }

    fn feistel(&self, x: u64) -> u64 {
        let (mut l, mut r) = (x >> self.half_bits, x & self.mask);
        for &k in &self.keys {
            let f = mix64(r ^ k) & self.mask;
            (l, r) = (r, l ^ f);
        }
        (l << self.half_bits) | r
    }

    /// The image of `i` (< n).
    pub fn apply(&self, i: u64) -> u64 {
        debug_assert!(i < self.n);
        if self.n <= 1 {
            return i;
        }
        let mut x = i;
        loop {
            x = self.feistel(x);
            if x < self.n {
                return x;
            }
        }
    }
}

/// What defines the order (everything else — ranks, batch size, workers — does not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OrderSpec {
    /// Samples in the dataset.
    pub samples: u64,
    /// K: samples per block (a block is read as one run of bytes).
    pub block_samples: u64,
    /// M: blocks per window (the shuffle's reach within an epoch is a window).
    pub window_blocks: u64,
    /// Permute (blocks, then samples in windows); false keeps file order.
    pub shuffle: bool,
    /// The order's seed.
    pub seed: u64,
}

/// The order of one epoch.
#[derive(Clone, Debug)]
pub struct EpochOrder {
    spec: OrderSpec,
    /// The epoch this order is for.
    pub epoch: u64,
    blocks: u64,
    block_perm: Perm,
    /// Slot (position in the permuted block order) of the last, possibly short, block.
    short_slot: u64,
    last_size: u64,
    /// Start position of each window, plus the end (= samples).
    win_start: Vec<u64>,
}

/// A window's sampler: maps positions inside the window to global sample indices.
pub struct WindowSampler<'a> {
    eo: &'a EpochOrder,
    w: usize,
    perm: Option<Perm>,
    /// The blocks of the window's M slots (the block permutation, computed once per window
    /// rather than once per sample: it was half the planner's time).
    blocks: Vec<u64>,
}

impl EpochOrder {
    /// The order of `epoch` under `spec`.
    pub fn new(spec: OrderSpec, epoch: u64) -> EpochOrder {
        let k = spec.block_samples.max(1);
        let m = spec.window_blocks.max(1);
        let blocks = spec.samples.div_ceil(k);
        let key = mix64(spec.seed ^ mix64(epoch.wrapping_mul(0x1000_0000_01b3)));
        let block_perm = Perm::new(blocks, key);
        let last_size = if blocks == 0 {
            0
        } else {
            spec.samples - (blocks - 1) * k
        };
        let short_slot = if !spec.shuffle || blocks == 0 {
            blocks.saturating_sub(1)
        } else {
            (0..blocks)
                .find(|&s| block_perm.apply(s) == blocks - 1)
                .unwrap_or(0)
        };
        let windows = blocks.div_ceil(m);
        let mut win_start = Vec::with_capacity(windows as usize + 1);
        let mut at = 0u64;
        for w in 0..windows {
            win_start.push(at);
            let slots = m.min(blocks - w * m);
            let mut n = slots * k;
            if (w * m..w * m + slots).contains(&short_slot) {
                n -= k - last_size;
            }
            at += n;
        }
        win_start.push(at);
        debug_assert_eq!(at, spec.samples);
        EpochOrder {
            spec: OrderSpec {
                block_samples: k,
                window_blocks: m,
                ..spec
            },
            epoch,
            blocks,
            block_perm,
            short_slot,
            last_size,
            win_start,
        }
    }

    /// Windows in the epoch.
    pub fn windows(&self) -> usize {
        self.win_start.len() - 1
    }

    /// Positions `[start, end)` of window `w`.
    pub fn window_range(&self, w: usize) -> (u64, u64) {
        (self.win_start[w], self.win_start[w + 1])
    }

    /// The window holding position `pos` (< samples).
    pub fn window_of(&self, pos: u64) -> usize {
        self.win_start.partition_point(|&s| s <= pos) - 1
    }

    /// The sampler of window `w` (its permutation set up once for many positions).
    pub fn sampler(&self, w: usize) -> WindowSampler<'_> {
        let (a, b) = self.window_range(w);
        let perm = self.spec.shuffle.then(|| {
            let key =
                mix64(self.spec.seed ^ mix64(self.epoch ^ mix64(w as u64 ^ 0x005e_ed0f_3a11)));
            Perm::new(b - a, key)
        });
        let m = self.spec.window_blocks;
        let base = w as u64 * m;
        let blocks = (base..(base + m).min(self.blocks))
            .map(|slot| {
                if self.spec.shuffle {
                    self.block_perm.apply(slot)
                } else {
                    slot
                }
            })
            .collect();
        WindowSampler {
            eo: self,
            w,
            perm,
            blocks,
        }
    }

    /// The sample delivered at `pos` in this epoch.
    pub fn sample_at(&self, pos: u64) -> u64 {
        self.sampler(self.window_of(pos)).sample_at(pos)
    }
}

impl WindowSampler<'_> {
    /// The sample delivered at `pos` (a position inside this window).
    pub fn sample_at(&self, pos: u64) -> u64 {
        let eo = self.eo;
        let (k, m) = (eo.spec.block_samples, eo.spec.window_blocks);
        let (a, _) = eo.window_range(self.w);
        let local = pos - a;
        let q = self.perm.as_ref().map_or(local, |p| p.apply(local));
        let base = self.w as u64 * m;
        let (j, off) = if (base..base + m).contains(&eo.short_slot) {
            let js = eo.short_slot - base;
            if q < js * k {
                (q / k, q % k)
            } else if q < js * k + eo.last_size {
                (js, q - js * k)
            } else {
                let q2 = q - js * k - eo.last_size;
                (js + 1 + q2 / k, q2 % k)
            }
        } else {
            (q / k, q % k)
        };
        let block = self.blocks[j as usize];
        debug_assert!(block < eo.blocks);
        block * k + off
    }
}

/// What to do with the samples left over when an epoch's sample count is not a multiple of the
/// global batch (world × batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Remainder {
    /// Drop the last `samples mod (world × batch)` positions of the epoch's order (which samples
    /// those are changes every epoch when shuffling). Every batch is full.
    Drop,
    /// Deliver them: the epoch's last global batch is completed with padding rows (filled with
    /// the pad token); `Batch::valid_rows` says how many rows are real. Every sample is delivered.
    Pad,
}

/// One global step, as seen by one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// The epoch the step belongs to.
    pub epoch: u64,
    /// Position of the global step's first row.
    pub base: u64,
    /// Position of this rank's first row (= base + rank × batch).
    pub rank_start: u64,
    /// Rows of this rank that are real samples (< batch only in a padded last step).
    pub real: usize,
    /// Where a run resumes after this step: (epoch, position).
    pub next: (u64, u64),
}

/// The steps a rank takes from a start state, epoch after epoch.
#[derive(Clone, Debug)]
pub struct Schedule {
    /// Samples per epoch.
    pub samples: u64,
    /// W: ranks.
    pub world: u64,
    /// This rank.
    pub rank: u64,
    /// B: rows per rank and step.
    pub batch: u64,
    /// The policy for an epoch's last partial global batch.
    pub remainder: Remainder,
    /// Stop before this epoch (None: never stop).
    pub end_epoch: Option<u64>,
    epoch: u64,
    pos: u64,
}

impl Schedule {
    /// The steps from `start` = (epoch, position).
    pub fn new(
        samples: u64,
        world: u64,
        rank: u64,
        batch: u64,
        remainder: Remainder,
        start: (u64, u64),
        end_epoch: Option<u64>,
    ) -> Self {
        let mut s = Schedule {
            samples,
            world,
            rank,
            batch,
            remainder,
            end_epoch,
            epoch: start.0,
            pos: start.1,
        };
        s.normalise();
        s
    }

    fn global(&self) -> u64 {
        self.world * self.batch
    }

    /// Whether a step starts at `pos` in the current epoch.
    fn has_step_at(&self, pos: u64) -> bool {
        match self.remainder {
            Remainder::Drop => pos + self.global() <= self.samples,
            Remainder::Pad => pos < self.samples,
        }
    }

    /// Moves past an exhausted epoch (a state saved at an epoch's end resumes in the next one).
    fn normalise(&mut self) {
        if !self.has_step_at(self.pos) && self.global() > 0 && self.samples > 0 {
            self.epoch += 1;
            self.pos = 0;
        }
    }

    /// The (epoch, position) the schedule will start its next step at.
    pub fn state(&self) -> (u64, u64) {
        (self.epoch, self.pos)
    }
}

impl Iterator for Schedule {
    type Item = Step;
    fn next(&mut self) -> Option<Step> {
        if self.end_epoch.is_some_and(|e| self.epoch >= e) || !self.has_step_at(self.pos) {
            return None;
        }
        let base = self.pos;
        let rank_start = base + self.rank * self.batch;
        let real = self.samples.saturating_sub(rank_start).min(self.batch) as usize;
        let epoch = self.epoch;
        self.pos += self.global();
        self.normalise();
        Some(Step {
            epoch,
            base,
            rank_start,
            real,
            next: (self.epoch, self.pos),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perm_is_a_bijection() {
        for n in [0u64, 1, 2, 3, 5, 16, 17, 100, 1000, 4097] {
            let p = Perm::new(n, 42 + n);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let j = p.apply(i) as usize;
                assert!(!seen[j], "n={n}: {j} twice");
                seen[j] = true;
            }
        }
        // Different keys give different orders.
        let (a, b) = (Perm::new(1000, 1), Perm::new(1000, 2));
        assert!((0..1000).filter(|&i| a.apply(i) != b.apply(i)).count() > 900);
    }

    #[test]
    fn epoch_order_is_a_bijection_with_short_blocks() {
        for (samples, k, m) in [
            (1u64, 1, 1),
            (10, 3, 2),
            (100, 7, 3),
            (1000, 16, 4),
            (999, 10, 100),
            (37, 64, 2),
        ] {
            for shuffle in [false, true] {
                for epoch in 0..3 {
                    let eo = EpochOrder::new(
                        OrderSpec {
                            samples,
                            block_samples: k,
                            window_blocks: m,
                            shuffle,
                            seed: 7,
                        },
                        epoch,
                    );
                    let mut seen = vec![false; samples as usize];
                    for pos in 0..samples {
                        let s = eo.sample_at(pos) as usize;
                        assert!(
                            !seen[s],
                            "{samples}/{k}/{m} shuffle {shuffle}: sample {s} twice"
                        );
                        seen[s] = true;
                        if !shuffle {
                            assert_eq!(s as u64, pos);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn schedule_drop_and_pad() {
        let steps: Vec<_> = Schedule::new(10, 2, 1, 2, Remainder::Drop, (0, 0), Some(2)).collect();
        assert_eq!(steps.len(), 4); // 2 epochs × floor(10 / 4)
        assert_eq!(steps[1].next, (1, 0));
        assert_eq!(steps[0].rank_start, 2);
        let pad: Vec<_> = Schedule::new(10, 2, 1, 2, Remainder::Pad, (0, 0), Some(1)).collect();
        assert_eq!(pad.len(), 3);
        assert_eq!(pad[2].real, 0); // rank 1's rows of the last step are all padding
        let pad0: Vec<_> = Schedule::new(10, 2, 0, 2, Remainder::Pad, (0, 0), Some(1)).collect();
        assert_eq!(pad0[2].real, 2);
        // A state saved at the end of an epoch resumes in the next one.
        let s = Schedule::new(10, 2, 0, 2, Remainder::Drop, (0, 8), None);
        assert_eq!(s.state(), (1, 0));
    }
}
