//! Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
//! counter-based generator, a pure function of (counter, key). The CUDA twin is
//! `core/cuda/kernels/philox.cuh`; both produce the same bits, so a dropout mask drawn on the GPU
//! can be redrawn on the CPU (or in a backward pass) instead of being stored.
//!
//! How ferrite addresses the stream (the user's handle is `(seed, offset)`, as PyTorch's philox
//! seed/offset): key = (seed low 32 bits, seed high 32 bits); element `i` of a tensor takes a
//! **16-bit draw**: half `i % 2` (the low half first) of word `(i / 2) % 4` of the block at counter
//! `offset + i / 8` (a 64-bit counter, wrapping, in counter words 0 and 1, low first; words 2 and
//! 3 are 0). One Philox block (128 bits, ~40 integer instructions on the GPU) thus serves eight
//! elements — one 16-byte vector of a 16-bit dtype — instead of four: at bf16 and the copy
//! bandwidth the RNG was the kernels' limit (docs/activation.md). One call over `n` elements
//! consumes `blocks_used(n) = ⌈n/8⌉` counters: the next call continues at `offset + blocks_used(n)`.

/// The first round multiplier of Philox4x32 (Random123's constants, as the four below).
pub const M0: u32 = 0xD251_1F53;
/// The second round multiplier.
pub const M1: u32 = 0xCD9E_8D57;
/// The Weyl increment of key word 0 (the golden ratio's bits).
pub const W0: u32 = 0x9E37_79B9;
/// The Weyl increment of key word 1 (√3 − 1's bits).
pub const W1: u32 = 0xBB67_AE85;

#[inline(always)]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

/// The Philox4x32 block function with `rounds` rounds (10 is the standard, "Philox4x32-10").
#[inline]
pub fn philox4x32(rounds: u32, counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for r in 0..rounds {
        if r > 0 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        let (hi0, lo0) = mulhilo(M0, c0);
        let (hi1, lo1) = mulhilo(M1, c2);
        (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);
    }
    [c0, c1, c2, c3]
}

/// Philox4x32-10 of one block.
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    philox4x32(10, counter, key)
}

/// The four words at block `offset + block` of the stream `seed` (see the module doc).
#[inline]
pub fn block(seed: u64, offset: u64, block: u64) -> [u32; 4] {
    let c = offset.wrapping_add(block);
    philox4x32_10(
        [c as u32, (c >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    )
}

/// The 16-bit draw of element `i` of the stream `(seed, offset)` (see the module doc), in
/// `0..2¹⁶`.
#[inline]
pub fn draw(seed: u64, offset: u64, i: u64) -> u32 {
    draw_of(&block(seed, offset, i / 8), i)
}

/// The 16-bit draw of element `i` from its block (`block(seed, offset, i / 8)`).
#[inline]
pub fn draw_of(blk: &[u32; 4], i: u64) -> u32 {
    let w = blk[((i / 2) % 4) as usize];
    (w >> (16 * (i & 1))) & 0xFFFF
}

/// Whether dropout keeps element `i` at threshold `thr` (= `keep_threshold(p)`).
#[inline]
pub fn keep(seed: u64, offset: u64, i: u64, thr: u32) -> bool {
    draw(seed, offset, i) < thr
}

/// Counters one call over `n` elements consumes.
pub fn blocks_used(n: u64) -> u64 {
    n.div_ceil(8)
}

/// The keep threshold of dropout with drop probability `p` ∈ (0, 1): an element is kept when its
/// 16-bit draw is `< keep_threshold(p)` = ⌊(1 − p)·2¹⁶⌋ (computed in f64 from the f32 `p`, at most
/// 2¹⁶ − 1), so P(keep) = threshold / 2¹⁶ ∈ (1 − p − 2⁻¹⁶, 1 − p]: the drop rate is never below
/// p and at most 1.5·10⁻⁵ above it (p = 0.1 drops 0.100006). An integer compare: no float
/// conversion of the random bits, hence the same decision on every device.
pub fn keep_threshold(p: f32) -> u32 {
    let t = ((1.0 - p as f64) * 65_536.0).floor();
    t.clamp(0.0, 65_535.0) as u32
}

/// The scale kept elements get: 1/(1 − p) rounded to f32 (the value the kernels receive).
pub fn keep_scale(p: f32) -> f32 {
    (1.0 / (1.0 - p as f64)) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's kat_vectors, "philox4x32 10" lines: counter[4] key[2] → output[4].
    #[test]
    fn known_answers() {
        let kat: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
            (
                [0; 4],
                [0; 2],
                [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
            ),
            (
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0],
                [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
            ),
        ];
        for (c, k, want) in kat {
            assert_eq!(philox4x32_10(c, k), want, "counter {c:08x?} key {k:08x?}");
        }
        // The 7-round line of the same file: the round count is honoured.
        assert_eq!(
            philox4x32(
                7,
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0x4dfccaba, 0x190a87f0, 0xc47362ba, 0xb6b5242a]
        );
    }

    /// The CUDA twin's stream: these words came from `core/cuda/kernels/philox.cuh` compiled
    /// for the host (g++, `__umulhi` as a 64-bit product), at a 64-bit seed and an offset that
    /// carries into counter word 1 after 3 blocks. `ferrite check activation` compares the
    /// device's own masks against this generator on every run.
    #[test]
    fn same_stream_as_the_cuda_header() {
        let (seed, off) = (0x1234_5678_9abc_def0u64, (1u64 << 32) - 3);
        let want: [[u32; 4]; 6] = [
            [0x35385faf, 0xa254e034, 0xeff860fa, 0x86cec999],
            [0xb6fe34d9, 0xffcf87ec, 0x12ad8b61, 0xd44f2839],
            [0x9b6a0c32, 0x93de441a, 0x08a5fbbe, 0xb12902fc],
            [0xab4806df, 0x6e8135ce, 0xbbca5391, 0xf37870f0],
            [0x8a2ae2a3, 0x89f08fa8, 0xadd06b30, 0xf9f9adeb],
            [0xd75cfe3e, 0xf25b6e4b, 0xfd77eff2, 0x8471bd47],
        ];
        for (b, w) in want.iter().enumerate() {
            assert_eq!(&block(seed, off, b as u64), w, "block {b}");
        }
    }

    #[test]
    fn addressing_and_threshold() {
        // Element i ↔ counter offset + i/8, word (i/2)%4, low half for even i; the counter is
        // 64-bit and wraps.
        assert_eq!(draw(7, 5, 19), block(7, 5, 2)[1] >> 16);
        assert_eq!(draw(7, 5, 18), block(7, 5, 2)[1] & 0xFFFF);
        assert_eq!(draw(7, 5, 8 * 3 + 7), draw(7, 6, 8 * 2 + 7));
        assert_eq!(draw(7, 5, 0), block(7, 5, 0)[0] & 0xFFFF);
        assert_eq!(
            block(1 << 40 | 3, u64::MAX, 1),
            philox4x32_10([0, 0, 0, 0], [3, 1 << 8])
        );
        assert_eq!(blocks_used(0), 0);
        assert_eq!(blocks_used(8), 1);
        assert_eq!(blocks_used(9), 2);
        assert_eq!(keep_threshold(0.5), 1 << 15);
        assert_eq!(keep_threshold(0.75), 1 << 14);
        assert_eq!(keep_threshold(0.1), 58_982);
        // p → 0: the threshold stays below 2¹⁶ (a 16-bit draw can still be dropped), and the
        // GPU's compare of (thr << 16) against 32-bit words cannot overflow.
        assert_eq!(keep_threshold(0.0), 65_535);
        assert_eq!(keep_threshold(1e-9), 65_535);
        assert_eq!(keep_threshold(0.999_999), 0);
        assert_eq!(keep_scale(0.5), 2.0);
        // Every draw is 16 bits, and the eight draws of a block are its four words split.
        let blk = block(11, 22, 33);
        for e in 0..8u64 {
            let d = draw(11, 22, 33 * 8 + e);
            assert!(d < 1 << 16);
            assert_eq!(d, draw_of(&blk, e));
        }
    }
}
