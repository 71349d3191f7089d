//! The order side of the loader: which samples this rank takes at each global step, grouped by
//! window, where their bytes lie in the shards, and the reads that fetch them (the planner
//! thread).

use super::pipeline::Shared;
use super::{bad, Dataset, LoaderConfig, LoaderState, ShardMeta};
use crate::core::error::{Error, Result};
use crate::data::io::{align_down, align_up, AlignedBuf, ALIGN};
use crate::data::order::{mix64, EpochOrder, OrderSpec, Remainder, Schedule};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;

/// What defines the epoch order over a dataset: its samples, numbered shard after shard, the
/// shuffle's blocks and windows, and the fingerprint a resume state must carry.
pub(super) struct Order {
    /// First global sample of each shard, plus the total.
    pub(super) starts: Vec<u64>,
    pub(super) spec: OrderSpec,
    /// See `LoaderState::fingerprint`.
    pub(super) fingerprint: u64,
}

impl Order {
    /// Refused when the dataset holds no sample of T+1 tokens, or, with the remainder dropped,
    /// less than one global step: such a loader would never deliver a batch.
    pub(super) fn new(dataset: &Dataset, cfg: &LoaderConfig) -> Result<Order> {
        let seq = cfg.seq as u64;
        let starts = sample_starts(dataset, seq)?;
        let samples = *starts.last().unwrap();
        let global = (cfg.world * cfg.batch) as u64;
        if cfg.remainder == Remainder::Drop && samples < global {
            return Err(Error::Other(format!(
                "dataset has {samples} samples of T+1 = {} tokens, fewer than one global batch ({} ranks × {}): \
                 use Remainder::Pad or a smaller batch",
                seq + 1,
                cfg.world,
                cfg.batch
            )));
        }
        let es = dataset.dtype().size_in_bytes() as u64;
        let spec = OrderSpec {
            samples,
            block_samples: (cfg.block_bytes as u64 / (seq * es)).max(1),
            window_blocks: cfg.window_blocks.max(1) as u64,
            shuffle: cfg.shuffle,
            seed: cfg.seed,
        };
        Ok(Order {
            starts,
            spec,
            fingerprint: fingerprint(dataset, seq, &spec),
        })
    }

    /// The (epoch, position) to start at: epoch 0's start, or where `resume` stopped. A state is
    /// only meaningful for the order that saved it (its positions would name other samples in
    /// another), so a state from another order, seed or dataset size is refused.
    pub(super) fn start(&self, resume: Option<LoaderState>, seed: u64) -> Result<(u64, u64)> {
        let (fingerprint, samples) = (self.fingerprint, self.spec.samples);
        Ok(match resume {
            None => (0, 0),
            Some(s) => {
                if s.fingerprint != fingerprint {
                    return Err(Error::Other(format!(
                        "resume state was saved by a loader with another order (fingerprint {:016x}, this one {fingerprint:016x}): \
                         the shards, T, block_bytes, window_blocks or shuffle differ",
                        s.fingerprint
                    )));
                }
                if s.seed != seed {
                    return Err(bad(
                        "seed",
                        &format!("{} (the resume state's)", s.seed),
                        seed.to_string(),
                    ));
                }
                if s.position > samples {
                    return Err(bad(
                        "resume position",
                        &format!("≤ {samples} samples"),
                        s.position.to_string(),
                    ));
                }
                (s.epoch, s.position)
            }
        })
    }

    /// This rank's steps from `start`, up to the configured last epoch.
    pub(super) fn schedule(&self, cfg: &LoaderConfig, start: (u64, u64)) -> Schedule {
        Schedule::new(
            self.spec.samples,
            cfg.world as u64,
            cfg.rank as u64,
            cfg.batch as u64,
            cfg.remainder,
            start,
            cfg.epochs,
        )
    }
}

/// First global sample of each shard, plus the total; an error when no shard holds a sample.
fn sample_starts(dataset: &Dataset, seq: u64) -> Result<Vec<u64>> {
    let per = dataset.samples_per_shard(seq);
    let mut starts = vec![0u64];
    for n in &per {
        starts.push(starts.last().unwrap() + n);
    }
    let samples = *starts.last().unwrap();
    if samples == 0 {
        return Err(Error::Other(format!(
            "dataset has no sample of T+1 = {} tokens (largest shard: {} tokens)",
            seq + 1,
            dataset
                .shards
                .iter()
                .map(|s| s.header.tokens)
                .max()
                .unwrap_or(0)
        )));
    }
    Ok(starts)
}

/// Hashes what the order depends on and nothing else (not W, B or the I/O settings), so that a
/// state resumes under any of those changed but never under another order.
fn fingerprint(dataset: &Dataset, seq: u64, spec: &OrderSpec) -> u64 {
    mix64(
        dataset.fingerprint()
            ^ mix64(
                seq ^ mix64(
                    spec.block_samples ^ mix64(spec.window_blocks ^ ((spec.shuffle as u64) << 63)),
                ),
            ),
    )
}

/// The sample geometry shared by the threads.
pub(super) struct Geometry {
    pub(super) seq: u64,
    /// First global sample of each shard, plus the total.
    starts: Vec<u64>,
    pub(super) shards: Vec<ShardMeta>,
    pub(super) chunk_bytes: u64,
    pub(super) verify: bool,
    /// Bytes a full window reads (about; sizes the I/O thread's windows in flight).
    pub(super) window_bytes: u64,
}

impl Geometry {
    /// `starts` is the `Order`'s sample numbering. Reads are verified only where the setting asks
    /// for it and an index gives checksums to verify against.
    pub(super) fn new(
        dataset: &Dataset,
        cfg: &LoaderConfig,
        starts: Vec<u64>,
        spec: &OrderSpec,
    ) -> Geometry {
        let seq = cfg.seq as u64;
        let es = dataset.dtype().size_in_bytes() as u64;
        Geometry {
            seq,
            starts,
            shards: dataset.shards.clone(),
            chunk_bytes: dataset.chunk_bytes,
            verify: cfg.verify && dataset.checksummed(),
            window_bytes: spec.block_samples * spec.window_blocks * seq * es,
        }
    }

    /// (shard, file offset, bytes) of a sample's T+1 tokens.
    fn locate(&self, sample: u64) -> (usize, u64, u64) {
        let s = self.starts.partition_point(|&x| x <= sample) - 1;
        let h = &self.shards[s].header;
        let es = h.dtype.size_in_bytes() as u64;
        let local = sample - self.starts[s];
        (
            s,
            h.payload_offset + local * self.seq * es,
            (self.seq + 1) * es,
        )
    }
}

/// One row of a window: the sample at `pos`, whose T+1 tokens start at `off` in the buffer.
#[derive(Clone, Copy)]
pub(super) struct Row {
    pub(super) pos: u64,
    pub(super) sample: u64,
    pub(super) off: usize,
    pub(super) shard: u32,
}

/// A contiguous byte range of one shard, read into `buf[buf_off..]`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Extent {
    pub(super) shard: usize,
    pub(super) lo: u64,
    /// Bytes of data in the file (hi − lo); reads are rounded up to ALIGN.
    pub(super) hi: u64,
    pub(super) buf_off: usize,
}

/// A read piece of a window in progress.
pub(super) struct Piece {
    pub(super) shard: usize,
    pub(super) off: u64,
    pub(super) len: usize,
    /// Bytes the file holds there (≤ len at the end of the file).
    pub(super) expect: usize,
    pub(super) dst: usize,
    pub(super) got: usize,
}

/// A window's reads and buffer, prepared by the planner thread.
pub(super) struct Plan {
    pub(super) rows: Vec<Row>,
    pub(super) extents: Vec<Extent>,
    pub(super) pieces: Vec<Piece>,
    /// The buffer to read into (reused, or fresh and already faulted in).
    pub(super) buf: AlignedBuf,
}

/// Merges ranges that are closer than this: reading a small gap beats another request.
const MERGE_GAP: u64 = 64 << 10;

/// Plans the reads of one window's rows; `buffer` gives a buffer of at least the bytes asked.
fn plan(
    geo: &Geometry,
    mut rows: Vec<Row>,
    located: &[(usize, u64, u64)],
    request_bytes: usize,
    buffer: &mut dyn FnMut(usize) -> AlignedBuf,
) -> Plan {
    let mut ranges: Vec<(usize, u64, u64)> = located
        .iter()
        .map(|&(s, off, len)| {
            let sh = &geo.shards[s];
            let (po, end) = (sh.header.payload_offset, sh.file_bytes);
            let (mut lo, mut hi) = (off, off + len);
            if geo.verify {
                // Whole checksum chunks, so each can be verified on its own.
                let c = geo.chunk_bytes;
                lo = po + (lo - po) / c * c;
                hi = (po + (hi - po).div_ceil(c) * c).min(end);
            }
            (s, align_down(lo), hi.min(end))
        })
        .collect();
    ranges.sort_unstable();
    let mut extents: Vec<Extent> = Vec::new();
    let mut at = 0usize;
    for (s, lo, hi) in ranges {
        if let Some(e) = extents.last_mut() {
            if e.shard == s && lo <= e.hi + MERGE_GAP {
                if hi > e.hi {
                    at += (align_up(hi - e.lo) - align_up(e.hi - e.lo)) as usize;
                    e.hi = hi;
                }
                continue;
            }
        }
        extents.push(Extent {
            shard: s,
            lo,
            hi,
            buf_off: at,
        });
        at += align_up(hi - lo) as usize;
    }
    for (r, &(s, off, _)) in rows.iter_mut().zip(located) {
        let i = extents.partition_point(|e| (e.shard, e.lo) <= (s, off)) - 1;
        let e = &extents[i];
        debug_assert!(e.shard == s && off >= e.lo && off < e.hi);
        r.off = e.buf_off + (off - e.lo) as usize;
        r.shard = s as u32;
    }
    let mut pieces = Vec::new();
    for e in &extents {
        let mut off = e.lo;
        while off < e.hi {
            let data = (e.hi - off).min(request_bytes as u64) as usize;
            pieces.push(Piece {
                shard: e.shard,
                off,
                len: align_up(data as u64) as usize,
                expect: data,
                dst: e.buf_off + (off - e.lo) as usize,
                got: 0,
            });
            off += data as u64;
        }
    }
    Plan {
        rows,
        extents,
        pieces,
        buf: buffer(at),
    }
}

/// Walks the schedule and yields, window by window, this rank's rows.
struct Planner {
    spec: OrderSpec,
    schedule: Schedule,
    eo: Option<EpochOrder>,
    /// Remaining positions of the current step: (epoch, from, to).
    cur: Option<(u64, u64, u64)>,
}

impl Planner {
    fn next_segment(&mut self) -> Option<(u64, u64, u64)> {
        if let Some(c) = self.cur {
            if c.1 < c.2 {
                return Some(c);
            }
        }
        for step in self.schedule.by_ref() {
            if step.real > 0 {
                self.cur = Some((
                    step.epoch,
                    step.rank_start,
                    step.rank_start + step.real as u64,
                ));
                return self.cur;
            }
        }
        None
    }

    /// The next window's rows (positions in increasing order) with their samples.
    fn next_window(&mut self) -> Option<Vec<Row>> {
        let (epoch, from, _) = self.next_segment()?;
        let eo = match self.eo.take() {
            Some(e) if e.epoch == epoch => e,
            _ => EpochOrder::new(self.spec, epoch),
        };
        let w = eo.window_of(from);
        let (_, wend) = eo.window_range(w);
        let sampler = eo.sampler(w);
        let mut rows = Vec::new();
        while let Some((e, a, b)) = self.next_segment() {
            if e != epoch || a >= wend {
                break;
            }
            let stop = b.min(wend);
            rows.extend((a..stop).map(|pos| Row {
                pos,
                sample: sampler.sample_at(pos),
                off: 0,
                shard: 0,
            }));
            self.cur = Some((e, stop, b));
        }
        self.eo = Some(eo);
        Some(rows)
    }
}

/// The planner thread: the sample order, each window's reads and its buffer, prepared ahead of
/// the I/O thread so that the I/O thread does nothing but keep the queue full. Buffers come back
/// from the assembler; a fresh one is faulted in here, since first touches of memory cost the
/// kernel a zeroing pass (slow in some VMs) that would otherwise hold up the I/O thread's reads.
pub(super) fn plan_thread(
    geo: Arc<Geometry>,
    spec: OrderSpec,
    schedule: Schedule,
    request_bytes: usize,
    out: SyncSender<Plan>,
    recycle: Receiver<AlignedBuf>,
    shared: Arc<Shared>,
) {
    let mut planner = Planner {
        spec,
        schedule,
        eo: None,
        cur: None,
    };
    let mut pool: Vec<AlignedBuf> = Vec::new();
    let mut largest = 0usize;
    let mut buffer = |bytes: usize| {
        pool.extend(recycle.try_iter());
        largest = largest.max(bytes);
        if let Some(i) = pool.iter().position(|b| b.capacity() >= bytes) {
            return pool.swap_remove(i);
        }
        // Drop a buffer too small to reuse; size the new one for the largest window so far,
        // with headroom (windows vary a little with how their ranges merge), so that buffers
        // converge to one size that fits all.
        pool.pop();
        shared.buffers.fetch_add(1, Ordering::Relaxed);
        let mut b = AlignedBuf::new(align_up((largest + largest / 16) as u64) as usize);
        let base = b.as_mut_ptr();
        for off in (0..b.capacity()).step_by(ALIGN) {
            // SAFETY: off < capacity; nothing else refers to the fresh buffer. Volatile so the
            // touch is not elided (the memory already reads as zero).
            unsafe { base.add(off).write_volatile(0) };
        }
        b
    };
    loop {
        if shared.stop.load(Ordering::Relaxed) {
            return;
        }
        let Some(rows) = planner.next_window() else {
            return;
        };
        let located: Vec<_> = rows.iter().map(|r| geo.locate(r.sample)).collect();
        let p = plan(&geo, rows, &located, request_bytes, &mut buffer);
        if out.send(p).is_err() {
            return;
        }
    }
}
