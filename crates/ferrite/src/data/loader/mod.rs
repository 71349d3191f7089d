//! The loader: batches of B×(T+1) tokens (row b holds inputs `[..T]` and targets `[1..]`).
//!
//! Samples: shard s with N tokens holds `(N − 1) / T` samples; sample j covers tokens
//! `[jT, jT + T + 1)` (consecutive samples share one token, so every token after a shard's first is
//! a target exactly once). Samples never cross shards; the `(N − 1) mod T` tokens at a shard's end
//! are not used (reported by `Dataset::summary`).
//!
//! Ranks: global step g covers positions `[g·W·B, (g+1)·W·B)` of the epoch's order (see
//! `order`); rank r takes `[g·W·B + r·B, +B)`. The remainder policy (`Remainder`) says what
//! happens to the last `samples mod W·B` positions. The state `(seed, epoch, position)` is the
//! next global step's first position: the same on every rank, and independent of W, B and the
//! I/O configuration, so a run may resume with a different worker count or world size.
//!
//! Threads, one per stage, so that no stage's work stalls another's:
//! - the planner computes each window's rows and reads (only the byte ranges holding this rank's
//!   samples, widened to checksum chunks and O_DIRECT alignment) and gives it a buffer (reused,
//!   or fresh and faulted in);
//! - the I/O thread does nothing but keep `queue_depth` reads in flight, across window boundaries,
//!   and go on reading into the windows it holds while the next stage is busy;
//! - the verifier checks every chunk read against the index;
//! - the assembler copies rows into batches (a host tensor, or a pinned slot copied to the GPU on
//!   a dedicated stream) up to `prefetch` batches ahead, and returns window buffers to the
//!   planner.
//!
//! Files: `dataset` (the shards, validated), `plan` (the order, this rank's rows window by
//! window, their reads; the planner thread), `read` (the I/O thread), `verify`, `assemble`, and
//! `pipeline` (the channels and threads between the stages, and the GPU ring).

use super::gpu::DeviceRing;
use super::io::{IoConfig, ALIGN};
use super::order::Remainder;
use crate::core::cuda::Stream;
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::tensor::Tensor;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;
use std::time::Instant;

mod assemble;
mod dataset;
mod pipeline;
mod plan;
mod read;
mod verify;

use assemble::{Msg, Ready};
pub use dataset::{Dataset, ShardMeta};
use pipeline::{thread_cpu_seconds, Pipeline, Shared, STAGES};
use plan::{Geometry, Order};

/// Where a run is: resume from it with `Loader::new(.., Some(state))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LoaderState {
    /// The order's seed.
    pub seed: u64,
    /// The epoch the next step belongs to.
    pub epoch: u64,
    /// The next global step's first position in the epoch's order.
    pub position: u64,
    /// Hash of what defines the order (the shards, T, block and window sizes, shuffle); a state
    /// is refused by a loader whose order differs.
    pub fingerprint: u64,
}

/// What a loader delivers and how it reads. `Default`: B 8, T 1024, one rank, seed 0,
/// shuffled, the remainder dropped, forever, host tensors, 4 MiB blocks in 16-block windows,
/// reads verified, io_uring with O_DIRECT where the system allows.
#[derive(Clone, Debug)]
pub struct LoaderConfig {
    /// B: rows per batch (per rank).
    pub batch: usize,
    /// T: sequence length (rows hold T+1 tokens).
    pub seq: usize,
    /// This process's rank among `world` (it reads only its own rows).
    pub rank: usize,
    /// W: ranks sharing the order.
    pub world: usize,
    /// Seed of the order (with the epoch).
    pub seed: u64,
    /// Shuffle (two-level: blocks, then samples within windows); false reads in file order.
    pub shuffle: bool,
    /// What happens to the last `samples mod W·B` positions of an epoch.
    pub remainder: Remainder,
    /// Token that fills padding rows (Remainder::Pad). GPT-2's end of text by default.
    pub pad_token: u32,
    /// Stop before this epoch (None: run forever).
    pub epochs: Option<u64>,
    /// Cpu: host tensors; Cuda(i): device tensors on GPU i.
    pub device: Device,
    /// Batches prepared ahead of the consumer (ring slots in flight).
    pub prefetch: usize,
    /// Windows read and verified ahead of the assembler (on top of those the I/O thread holds
    /// while reading: enough for `queue_depth` reads of `request_bytes`, and at least two).
    pub read_ahead: usize,
    /// Target bytes per shuffle block (defines K; part of the order).
    pub block_bytes: usize,
    /// M: blocks per window (part of the order).
    pub window_blocks: usize,
    /// Check each chunk read against the index's checksum.
    pub verify: bool,
    /// The read engine and its depth.
    pub io: IoConfig,
    /// Token dtype delivered: None = the dataset's; U16, U32 or I32 (widening only).
    pub out_dtype: Option<DType>,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig {
            batch: 8,
            seq: 1024,
            rank: 0,
            world: 1,
            seed: 0,
            shuffle: true,
            remainder: Remainder::Drop,
            pad_token: 50256,
            epochs: None,
            device: Device::Cpu,
            prefetch: 4,
            read_ahead: 2,
            // 4 MiB blocks read at full speed; 16 of them (64 MiB) mix in each window.
            block_bytes: 4 << 20,
            window_blocks: 16,
            verify: true,
            io: IoConfig::default(),
            out_dtype: None,
        }
    }
}

/// One batch of one rank.
pub struct Batch {
    /// [B, T+1] tokens, on the loader's device.
    pub tokens: Tensor,
    /// The epoch it belongs to.
    pub epoch: u64,
    /// Position (in the epoch's order) of this rank's first row.
    pub position: u64,
    /// Rows that are real samples (the rest are padding; < B only with Remainder::Pad).
    pub valid_rows: usize,
    /// Global sample index of each real row (shard-by-shard numbering).
    pub samples: Vec<u64>,
    /// The state to save once this batch has been consumed.
    pub state_after: LoaderState,
    release: Option<Release>,
}

impl Batch {
    /// T: tokens per input row.
    pub fn seq(&self) -> usize {
        self.tokens.shape()[1] - 1
    }
    /// [B, T] inputs (a view).
    pub fn inputs(&self) -> Result<Tensor> {
        self.tokens.narrow(1, 0, self.seq())
    }
    /// [B, T] targets, the inputs shifted by one (a view).
    pub fn targets(&self) -> Result<Tensor> {
        self.tokens.narrow(1, 1, self.seq())
    }
}

/// Returns a GPU slot to the ring when its batch is dropped. The device tensor is a view of the
/// slot: it must not be used after the batch is dropped (the slot is then refilled).
struct Release {
    ring: Arc<DeviceRing>,
    slot: usize,
    stream: Stream,
    free: SyncSender<usize>,
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Some(r) = self.release.take() {
            // Work queued on the consumer's stream so far may read the slot: the next copy into
            // it waits for this event.
            let _ = r.ring.slots[r.slot].released.record(&r.stream);
            let _ = r.free.send(r.slot);
        }
    }
}

/// Counters of a loader's work so far.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct LoaderStats {
    /// Batches delivered.
    pub batches: u64,
    /// Seconds the consumer spent blocked in `next_batch`.
    pub wait_s: f64,
    /// Bytes read from the files (including alignment and chunk widening).
    pub bytes_read: u64,
    /// Token bytes delivered in real rows.
    pub bytes_delivered: u64,
    /// Which read engine runs, and why it fell back if it did.
    pub io: String,
    /// Why the fast path was not used, if it was not.
    pub fallback: Option<String>,
    /// CPU seconds used so far by each stage's thread: the planner (sample order, read plans),
    /// the I/O thread (queueing reads, handling completions), the verifier (chunk checksums)
    /// and the assembler (gathering rows into batches, queueing GPU copies).
    pub plan_s: f64,
    /// The I/O thread's CPU seconds.
    pub io_s: f64,
    /// The verifier's CPU seconds.
    pub verify_s: f64,
    /// The assembler's CPU seconds.
    pub assemble_s: f64,
    /// Window buffers allocated (the rest were reused).
    pub buffers: u64,
}

/// Batches from a [`Dataset`] in the order of (seed, epoch), each sample once per epoch over
/// all ranks, prepared ahead by a pipeline of threads (plan, read, verify, assemble; see the
/// module doc). Dropping it stops the threads.
pub struct Loader {
    cfg: LoaderConfig,
    fingerprint: u64,
    rx: Option<Receiver<Result<Ready>>>,
    ring: Option<Arc<DeviceRing>>,
    free_tx: Option<SyncSender<usize>>,
    shared: Arc<Shared>,
    /// The pipeline's threads, by stage name.
    threads: Vec<(&'static str, std::thread::JoinHandle<()>)>,
    stats: LoaderStats,
    state: LoaderState,
    out_dtype: DType,
    done: bool,
}

impl Loader {
    /// Starts the pipeline over `dataset`, from `resume` (a state saved from a loader with the
    /// same order) or from the start of epoch 0. The configuration is checked first: an error
    /// names the field.
    pub fn new(
        dataset: &Dataset,
        cfg: LoaderConfig,
        resume: Option<LoaderState>,
    ) -> Result<Loader> {
        cfg.check_sizes()?;
        let out_dtype = cfg.delivered_dtype(dataset.dtype())?;
        let order = Order::new(dataset, &cfg)?;
        let start = order.start(resume, cfg.seed)?;
        let schedule = order.schedule(&cfg, start);
        let (e0, p0) = schedule.state();
        let fingerprint = order.fingerprint;
        let geo = Arc::new(Geometry::new(dataset, &cfg, order.starts, &order.spec));
        // The ring is allocated before any thread starts: a GPU that cannot be used fails here,
        // with no thread to stop.
        let ring = pipeline::device_ring(&cfg, out_dtype)?;
        let Pipeline {
            rx,
            free_tx,
            shared,
            threads,
        } = Pipeline::start(&cfg, geo, order.spec, schedule, out_dtype, ring.clone())?;
        Ok(Loader {
            state: LoaderState {
                seed: cfg.seed,
                epoch: e0,
                position: p0,
                fingerprint,
            },
            cfg,
            fingerprint,
            rx: Some(rx),
            ring,
            free_tx: Some(free_tx),
            shared,
            threads,
            stats: LoaderStats::default(),
            out_dtype,
            done: false,
        })
    }

    /// The next batch, or None after the last epoch. GPU batches are ordered on the device's own
    /// stream (see `next_batch_on`).
    pub fn next_batch(&mut self) -> Result<Option<Batch>> {
        let s = self.ring.as_ref().map(|r| r.device.stream().clone());
        self.next_batch_inner(s.as_ref())
    }

    /// The next batch, with `stream` (the consumer's compute stream) made to wait for this batch's
    /// copy only; dropping the batch records on `stream` when its slot may be reused.
    pub fn next_batch_on(&mut self, stream: &Stream) -> Result<Option<Batch>> {
        self.next_batch_inner(Some(stream))
    }

    fn next_batch_inner(&mut self, stream: Option<&Stream>) -> Result<Option<Batch>> {
        if self.done {
            return Ok(None);
        }
        let t0 = Instant::now();
        let got = self.rx.as_ref().map(|r| r.recv());
        self.stats.wait_s += t0.elapsed().as_secs_f64();
        let ready = match got {
            Some(Ok(Ok(r))) => r,
            Some(Ok(Err(e))) => {
                self.done = true;
                return Err(e);
            }
            _ => {
                self.done = true;
                return Ok(None);
            }
        };
        let shape = [self.cfg.batch, self.cfg.seq + 1];
        let (tokens, release) = match ready.msg {
            Msg::Host(t) => (t, None),
            Msg::Slot(i) => {
                let ring = self.ring.clone().expect("GPU slot without a ring");
                let stream = stream
                    .cloned()
                    .unwrap_or_else(|| ring.device.stream().clone());
                ring.slots[i].ready.wait_on(&stream)?;
                let strides = [self.cfg.seq + 1, 1];
                // SAFETY: the slot's device buffer holds B×(T+1) elements of out_dtype and lives
                // as long as the ring, which the batch's Release keeps alive; the slot is not
                // refilled until the batch is dropped (documented on Batch).
                let t = unsafe {
                    Tensor::from_device_ptr(
                        ring.device.clone(),
                        ring.slots[i].dev.ptr(),
                        &shape,
                        &strides,
                        self.out_dtype,
                    )?
                };
                let free = self.free_tx.clone().expect("free channel");
                (
                    t,
                    Some(Release {
                        ring,
                        slot: i,
                        stream,
                        free,
                    }),
                )
            }
        };
        self.stats.batches += 1;
        self.stats.bytes_delivered +=
            (ready.valid_rows * (self.cfg.seq + 1) * self.out_dtype.size_in_bytes()) as u64;
        self.state.epoch = ready.next.0;
        self.state.position = ready.next.1;
        Ok(Some(Batch {
            tokens,
            epoch: ready.epoch,
            position: ready.position,
            valid_rows: ready.valid_rows,
            samples: ready.samples,
            state_after: self.state,
            release,
        }))
    }

    /// The state after the last batch returned (the start state before any).
    pub fn state(&self) -> LoaderState {
        self.state
    }
    /// The hash of what defines the order (see [`LoaderState::fingerprint`]).
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
    /// The counters so far.
    pub fn stats(&self) -> LoaderStats {
        let mut s = self.stats.clone();
        let sh = &self.shared;
        s.bytes_read = sh.bytes_read.load(Ordering::Relaxed);
        let mut cpu = [0f64; 4];
        for (i, c) in cpu.iter_mut().enumerate() {
            *c = sh.cpu_ns[i].load(Ordering::Relaxed) as f64 * 1e-9;
        }
        for (stage, h) in &self.threads {
            if let Some(i) = STAGES.iter().position(|s| s == stage) {
                cpu[i] = cpu[i].max(thread_cpu_seconds(h));
            }
        }
        [s.plan_s, s.io_s, s.verify_s, s.assemble_s] = cpu;
        s.buffers = sh.buffers.load(Ordering::Relaxed);
        if let Ok(d) = self.shared.io_desc.lock() {
            s.io = d.0.clone();
            s.fallback = d.1.clone();
        }
        s
    }
}

impl Iterator for Loader {
    type Item = Result<Batch>;
    fn next(&mut self) -> Option<Result<Batch>> {
        self.next_batch().transpose()
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        // Closing our ends unblocks the threads' sends; they see `stop` on their timed receives.
        self.rx = None;
        self.free_tx = None;
        for (_, t) in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl LoaderConfig {
    /// Checks the sizes and counts, before the dataset is looked at or anything is allocated.
    fn check_sizes(&self) -> Result<()> {
        if self.batch == 0 || self.seq == 0 {
            return Err(bad(
                "batch/seq",
                "both ≥ 1",
                format!("{}/{}", self.batch, self.seq),
            ));
        }
        // A batch's buffer (and each ring slot) is B·(T+1) tokens: bounded before anything is
        // allocated, as are the queues (a huge request aborts the process, it cannot be caught).
        if self
            .batch
            .checked_mul(self.seq + 1)
            .is_none_or(|n| n > 1 << 31)
        {
            return Err(bad(
                "batch/seq",
                "B·(T+1) ≤ 2³¹ tokens",
                format!("{}·({} + 1)", self.batch, self.seq),
            ));
        }
        if self.read_ahead == 0
            || self.read_ahead > 1024
            || self.prefetch == 0
            || self.prefetch > 1024
        {
            return Err(bad(
                "read_ahead/prefetch",
                "both in 1..=1024",
                format!("{}/{}", self.read_ahead, self.prefetch),
            ));
        }
        if self.world == 0 || self.rank >= self.world {
            return Err(bad(
                "rank",
                "rank < world",
                format!("rank {} of {}", self.rank, self.world),
            ));
        }
        if self.io.request_bytes == 0
            || !self.io.request_bytes.is_multiple_of(ALIGN)
            || self.io.request_bytes > 1 << 30
        {
            return Err(bad(
                "io.request_bytes",
                "a multiple of 4096 up to 1 GiB",
                self.io.request_bytes.to_string(),
            ));
        }
        Ok(())
    }

    /// The token dtype batches hold: `out_dtype`, else the data's `ds_dtype`. Tokens are only
    /// ever widened, and the padding token must fit.
    fn delivered_dtype(&self, ds_dtype: DType) -> Result<DType> {
        let out_dtype = self.out_dtype.unwrap_or(ds_dtype);
        let ok_out = match ds_dtype {
            DType::U16 => matches!(out_dtype, DType::U16 | DType::U32 | DType::I32),
            _ => matches!(out_dtype, DType::U32 | DType::I32),
        };
        if !ok_out {
            return Err(bad(
                "out_dtype",
                &format!("u16, u32 or i32 at least as wide as the data ({ds_dtype})"),
                out_dtype.to_string(),
            ));
        }
        if out_dtype == DType::U16 && self.pad_token > u16::MAX as u32 {
            return Err(bad(
                "pad_token",
                "< 65536 for u16 batches",
                self.pad_token.to_string(),
            ));
        }
        Ok(out_dtype)
    }
}

/// An error naming the loader and the configuration field at fault.
fn bad(arg: &str, exp: &str, got: String) -> Error {
    Error::bad_arg("data::Loader", arg, exp, got)
}
