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

use super::format::{self, read_header, shard_error, Index, ShardHeader, INDEX_FILE};
use super::gpu::DeviceRing;
use super::io::{self, align_down, align_up, AlignedBuf, Files, IoConfig, Req, ALIGN};
use super::order::{mix64, EpochOrder, OrderSpec, Remainder, Schedule};
use crate::core::cuda::{self, Stream};
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::tensor::Tensor;
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One opened, validated shard.
#[derive(Clone, Debug)]
pub struct ShardMeta {
    /// The shard's file.
    pub path: PathBuf,
    /// Its validated header.
    pub header: ShardHeader,
    /// The file's size (header plus payload).
    pub file_bytes: u64,
    /// Per-chunk CRC-32 from the index (None: no index, payload not verifiable).
    pub chunk_crc32: Option<Vec<u32>>,
}

/// A set of shards, in order.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// The shards, in sample-numbering order.
    pub shards: Vec<ShardMeta>,
    /// Chunk size of the checksums (0 when there is no index).
    pub chunk_bytes: u64,
    /// The index the dataset was opened from, if any.
    pub index: Option<Index>,
}

fn is_shard_name(p: &Path) -> bool {
    matches!(
        p.extension().and_then(|e| e.to_str()),
        Some("bin") | Some("ftok")
    )
}

impl Dataset {
    /// Opens a folder (its `index.json`, else its `*.bin` / `*.ftok` files in name order), an
    /// `index.json`, or one shard file. Every header is read and validated now; with an index,
    /// each header must agree with its entry.
    pub fn open(path: &Path) -> Result<Dataset> {
        let meta = std::fs::metadata(path)
            .map_err(|e| Error::io(format!("dataset {}: cannot open", path.display()), e))?;
        if meta.is_dir() {
            let idx = path.join(INDEX_FILE);
            if idx.exists() {
                return Self::from_index(&idx);
            }
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| Error::io(format!("dataset {}: cannot list", path.display()), e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| is_shard_name(p))
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(Error::Other(format!(
                    "dataset {}: no {INDEX_FILE}, .bin or .ftok files",
                    path.display()
                )));
            }
            return Self::from_paths(&files);
        }
        if path.file_name().is_some_and(|n| n == INDEX_FILE)
            || path.extension().is_some_and(|e| e == "json")
        {
            return Self::from_index(path);
        }
        Self::from_paths(&[path.to_path_buf()])
    }

    /// Shards without an index: headers are validated, and a shard whose header carries a payload
    /// checksum (ferrite's `.ftok`) is read once here and checked against it — the loader's chunk
    /// checks need an index, and bad bytes must never reach training silently. llm.c shards have
    /// no checksum to check.
    pub fn from_paths(paths: &[PathBuf]) -> Result<Dataset> {
        let shards = paths
            .iter()
            .map(|p| {
                let header = read_header(p)?;
                format::verify_payload(p, &header)?;
                Ok(ShardMeta {
                    path: p.clone(),
                    file_bytes: header.payload_offset + header.payload_bytes(),
                    header,
                    chunk_crc32: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        if shards.is_empty() {
            return Err(Error::Other("dataset: no shards given".into()));
        }
        Ok(Dataset {
            shards,
            chunk_bytes: 0,
            index: None,
        })
    }

    /// The shards an `index.json` lists, each header checked against its entry.
    pub fn from_index(index_path: &Path) -> Result<Dataset> {
        let idx = Index::read(index_path)?;
        let dir = index_path.parent().unwrap_or(Path::new("."));
        let mut shards = Vec::with_capacity(idx.shards.len());
        for e in &idx.shards {
            let p = dir.join(&e.file);
            let header = read_header(&p)?;
            let bytes = header.payload_offset + header.payload_bytes();
            format::check_entry(&p, &header, e, bytes, idx.chunk_bytes)?;
            shards.push(ShardMeta {
                path: p,
                header,
                file_bytes: bytes,
                chunk_crc32: Some(e.chunk_crc32.clone()),
            });
        }
        Ok(Dataset {
            shards,
            chunk_bytes: idx.chunk_bytes,
            index: Some(idx),
        })
    }

    /// Tokens over all shards.
    pub fn total_tokens(&self) -> u64 {
        self.shards.iter().map(|s| s.header.tokens).sum()
    }
    /// File bytes over all shards.
    pub fn total_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.file_bytes).sum()
    }
    /// Whether reads can be verified (an index with chunk checksums).
    pub fn checksummed(&self) -> bool {
        self.chunk_bytes > 0
    }
    /// The widest token dtype of the shards.
    pub fn dtype(&self) -> DType {
        if self.shards.iter().any(|s| s.header.dtype == DType::U32) {
            DType::U32
        } else {
            DType::U16
        }
    }
    /// Samples of length T+1 per shard.
    pub fn samples_per_shard(&self, seq: u64) -> Vec<u64> {
        self.shards
            .iter()
            .map(|s| {
                if s.header.tokens > seq {
                    (s.header.tokens - 1) / seq
                } else {
                    0
                }
            })
            .collect()
    }
    /// A hash of what the shards hold (names, formats, counts, checksums).
    pub fn fingerprint(&self) -> u64 {
        let mut h = 0x243f_6a88_85a3_08d3u64;
        for s in &self.shards {
            let name = s
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            h = mix64(h ^ crc32fast::hash(name.as_bytes()) as u64);
            h = mix64(h ^ s.header.tokens ^ ((s.header.dtype.size_in_bytes() as u64) << 56));
            if let Some(c) = &s.chunk_crc32 {
                h = mix64(h ^ crc32fast::hash(bytemuck::cast_slice(c)) as u64);
            }
        }
        h
    }
    /// One line per dataset: shards, tokens, and what a given T leaves unused.
    pub fn summary(&self, seq: Option<u64>) -> String {
        let mut s = format!(
            "{} shards, {} tokens ({}), {:.1} MB, {}",
            self.shards.len(),
            self.total_tokens(),
            self.dtype(),
            self.total_bytes() as f64 / 1e6,
            if self.checksummed() {
                format!("checksummed in {} KiB chunks", self.chunk_bytes / 1024)
            } else {
                "no index: headers checked, payload not verifiable".into()
            }
        );
        if let Some(t) = seq {
            let samples: u64 = self.samples_per_shard(t).iter().sum();
            let unused = self.total_tokens() - samples * t - self.shards.len() as u64;
            s.push_str(&format!(
                "; T={t}: {samples} samples, {unused} tail tokens unused"
            ));
        }
        s
    }
}

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

enum Msg {
    Host(Tensor),
    Slot(usize),
}

struct Ready {
    msg: Msg,
    epoch: u64,
    position: u64,
    valid_rows: usize,
    samples: Vec<u64>,
    next: (u64, u64),
}

struct Shared {
    stop: AtomicBool,
    bytes_read: AtomicU64,
    io_desc: std::sync::Mutex<(String, Option<String>)>,
    /// Window buffers allocated.
    buffers: AtomicU64,
    /// CPU nanoseconds of each stage's thread, recorded as it ends (see `STAGES`).
    cpu_ns: [AtomicU64; 4],
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

/// The sample geometry shared by the threads.
struct Geometry {
    seq: u64,
    /// First global sample of each shard, plus the total.
    starts: Vec<u64>,
    shards: Vec<ShardMeta>,
    chunk_bytes: u64,
    verify: bool,
    /// Bytes a full window reads (about; sizes the I/O thread's windows in flight).
    window_bytes: u64,
}

impl Geometry {
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

impl Loader {
    /// Starts the pipeline over `dataset`, from `resume` (a state saved from a loader with the
    /// same order) or from the start of epoch 0. The configuration is checked first: an error
    /// names the field.
    pub fn new(
        dataset: &Dataset,
        cfg: LoaderConfig,
        resume: Option<LoaderState>,
    ) -> Result<Loader> {
        let bad = |arg: &str, exp: &str, got: String| Error::bad_arg("data::Loader", arg, exp, got);
        if cfg.batch == 0 || cfg.seq == 0 {
            return Err(bad(
                "batch/seq",
                "both ≥ 1",
                format!("{}/{}", cfg.batch, cfg.seq),
            ));
        }
        // A batch's buffer (and each ring slot) is B·(T+1) tokens: bounded before anything is
        // allocated, as are the queues (a huge request aborts the process, it cannot be caught).
        if cfg
            .batch
            .checked_mul(cfg.seq + 1)
            .is_none_or(|n| n > 1 << 31)
        {
            return Err(bad(
                "batch/seq",
                "B·(T+1) ≤ 2³¹ tokens",
                format!("{}·({} + 1)", cfg.batch, cfg.seq),
            ));
        }
        if cfg.read_ahead == 0 || cfg.read_ahead > 1024 || cfg.prefetch == 0 || cfg.prefetch > 1024
        {
            return Err(bad(
                "read_ahead/prefetch",
                "both in 1..=1024",
                format!("{}/{}", cfg.read_ahead, cfg.prefetch),
            ));
        }
        if cfg.world == 0 || cfg.rank >= cfg.world {
            return Err(bad(
                "rank",
                "rank < world",
                format!("rank {} of {}", cfg.rank, cfg.world),
            ));
        }
        if cfg.io.request_bytes == 0
            || !cfg.io.request_bytes.is_multiple_of(ALIGN)
            || cfg.io.request_bytes > 1 << 30
        {
            return Err(bad(
                "io.request_bytes",
                "a multiple of 4096 up to 1 GiB",
                cfg.io.request_bytes.to_string(),
            ));
        }
        let ds_dtype = dataset.dtype();
        let out_dtype = cfg.out_dtype.unwrap_or(ds_dtype);
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
        if out_dtype == DType::U16 && cfg.pad_token > u16::MAX as u32 {
            return Err(bad(
                "pad_token",
                "< 65536 for u16 batches",
                cfg.pad_token.to_string(),
            ));
        }
        let seq = cfg.seq as u64;
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
        let es = ds_dtype.size_in_bytes() as u64;
        let spec = OrderSpec {
            samples,
            block_samples: (cfg.block_bytes as u64 / (seq * es)).max(1),
            window_blocks: cfg.window_blocks.max(1) as u64,
            shuffle: cfg.shuffle,
            seed: cfg.seed,
        };
        let fingerprint = mix64(
            dataset.fingerprint()
                ^ mix64(
                    seq ^ mix64(
                        spec.block_samples
                            ^ mix64(spec.window_blocks ^ ((cfg.shuffle as u64) << 63)),
                    ),
                ),
        );
        let start = match resume {
            None => (0, 0),
            Some(s) => {
                if s.fingerprint != fingerprint {
                    return Err(Error::Other(format!(
                        "resume state was saved by a loader with another order (fingerprint {:016x}, this one {fingerprint:016x}): \
                         the shards, T, block_bytes, window_blocks or shuffle differ",
                        s.fingerprint
                    )));
                }
                if s.seed != cfg.seed {
                    return Err(bad(
                        "seed",
                        &format!("{} (the resume state's)", s.seed),
                        cfg.seed.to_string(),
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
        };
        let schedule = Schedule::new(
            samples,
            cfg.world as u64,
            cfg.rank as u64,
            cfg.batch as u64,
            cfg.remainder,
            start,
            cfg.epochs,
        );
        let (e0, p0) = schedule.state();
        let geo = Arc::new(Geometry {
            seq,
            starts,
            shards: dataset.shards.clone(),
            chunk_bytes: dataset.chunk_bytes,
            verify: cfg.verify && dataset.checksummed(),
            window_bytes: spec.block_samples * spec.window_blocks * seq * es,
        });
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            bytes_read: AtomicU64::new(0),
            io_desc: std::sync::Mutex::new((String::new(), None)),
            buffers: AtomicU64::new(0),
            cpu_ns: Default::default(),
        });
        let row_bytes = (cfg.seq + 1) * out_dtype.size_in_bytes();
        let prefetch = cfg.prefetch.max(1);
        let ring = match cfg.device {
            Device::Cpu => None,
            Device::Cuda(i) => {
                let dev = cuda::device(i)?;
                Some(Arc::new(DeviceRing::new(
                    dev,
                    prefetch + 1,
                    row_bytes * cfg.batch,
                )?))
            }
        };
        // Planner → I/O thread → (verifier →) assembler → consumer; window buffers go back from
        // the assembler to the planner. Window buffers alive when the consumer is the slower
        // end: one planned (handed over when the I/O thread asks: a rendezvous), those the I/O
        // thread holds (`pending_windows`), one at the verifier, `read_ahead` verified and
        // waiting, and the assembler's current one.
        let (plan_tx, plan_rx) = mpsc::sync_channel::<Plan>(0);
        let (win_tx, win_rx) = mpsc::sync_channel::<Result<Window>>(cfg.read_ahead.max(1));
        let (recycle_tx, recycle_rx) = mpsc::channel::<AlignedBuf>();
        let (tx, rx) = mpsc::sync_channel::<Result<Ready>>(prefetch);
        let (free_tx, free_rx) = mpsc::sync_channel::<usize>(prefetch + 1);
        if let Some(r) = &ring {
            for i in 0..r.slots.len() {
                free_tx.send(i).expect("fresh channel");
            }
        }
        let spawn = |stage: &'static str, f: Box<dyn FnOnce() + Send>| {
            let sh = shared.clone();
            std::thread::Builder::new()
                .name(format!("ferrite-data-{stage}"))
                .spawn(move || {
                    f();
                    let i = STAGES.iter().position(|&s| s == stage).unwrap_or(0);
                    sh.cpu_ns[i].store((own_cpu_seconds() * 1e9) as u64, Ordering::Relaxed);
                })
                .map(|h| (stage, h))
                .map_err(|e| Error::io(format!("spawning the loader's {stage} thread"), e))
        };
        let mut threads = Vec::new();
        {
            let (geo, shared, schedule) = (geo.clone(), shared.clone(), schedule.clone());
            let req = cfg.io.request_bytes;
            threads.push(spawn(
                "plan",
                Box::new(move || {
                    plan_thread(geo, spec, schedule, req, plan_tx, recycle_rx, shared)
                }),
            )?);
        }
        {
            // With verification, the I/O thread hands windows to the verifier when it is free (a
            // rendezvous: no window waits between the two).
            let (io_tx, verify) = if geo.verify {
                let (t, r) = mpsc::sync_channel::<Result<Window>>(0);
                (t, Some(r))
            } else {
                (win_tx.clone(), None)
            };
            let (g, sh, io_cfg) = (geo.clone(), shared.clone(), cfg.io.clone());
            threads.push(spawn(
                "io",
                Box::new(move || io_thread(g, io_cfg, plan_rx, io_tx, sh)),
            )?);
            if let Some(r) = verify {
                let (g, out) = (geo.clone(), win_tx);
                threads.push(spawn("verify", Box::new(move || verify_thread(g, r, out)))?);
            } else {
                drop(win_tx);
            }
        }
        {
            let geo = geo.clone();
            let shared = shared.clone();
            let ring = ring.clone();
            let a = Assembler {
                geo,
                schedule,
                batch: cfg.batch,
                out_dtype,
                pad_token: cfg.pad_token,
                ring,
            };
            threads.push(spawn(
                "assemble",
                Box::new(move || a.run(win_rx, recycle_tx, tx, free_rx, shared)),
            )?);
        }
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

/// One row of a window: the sample at `pos`, whose T+1 tokens start at `off` in the buffer.
#[derive(Clone, Copy)]
struct Row {
    pos: u64,
    sample: u64,
    off: usize,
    shard: u32,
}

/// A window read (and, past the verifier, verified): its rows in position order and its bytes.
struct Window {
    rows: VecDeque<Row>,
    extents: Vec<Extent>,
    buf: AlignedBuf,
}

/// A contiguous byte range of one shard, read into `buf[buf_off..]`.
#[derive(Clone, Copy, Debug)]
struct Extent {
    shard: usize,
    lo: u64,
    /// Bytes of data in the file (hi − lo); reads are rounded up to ALIGN.
    hi: u64,
    buf_off: usize,
}

/// A read piece of a window in progress.
struct Piece {
    shard: usize,
    off: u64,
    len: usize,
    /// Bytes the file holds there (≤ len at the end of the file).
    expect: usize,
    dst: usize,
    got: usize,
}

/// A window's reads and buffer, prepared by the planner thread.
struct Plan {
    rows: Vec<Row>,
    extents: Vec<Extent>,
    pieces: Vec<Piece>,
    /// The buffer to read into (reused, or fresh and already faulted in).
    buf: AlignedBuf,
}

/// A window whose reads are in progress on the I/O thread.
struct Pending {
    seq: u64,
    plan: Plan,
    next_piece: usize,
    left: usize,
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

/// Verifies every whole checksum chunk an extent covers (extents are widened to whole chunks).
fn verify(geo: &Geometry, w: &Window) -> Result<()> {
    let c = geo.chunk_bytes;
    let mut jobs = Vec::new();
    for e in &w.extents {
        let sh = &geo.shards[e.shard];
        let po = sh.header.payload_offset;
        let first = (e.lo.max(po) - po).div_ceil(c);
        let mut k = first;
        loop {
            let a = po + k * c;
            let b = (a + c).min(sh.file_bytes);
            if a >= e.hi || b > e.hi {
                break;
            }
            jobs.push((e.shard, k, a, b, e.buf_off + (a - e.lo) as usize));
            k += 1;
        }
    }
    let buf = w.buf.as_slice();
    let check = |&(s, k, a, b, at): &(usize, u64, u64, u64, usize)| -> Result<()> {
        let sh = &geo.shards[s];
        let want = sh
            .chunk_crc32
            .as_ref()
            .and_then(|v| v.get(k as usize).copied());
        let got = crc32fast::hash(&buf[at..at + (b - a) as usize]);
        match want {
            Some(w) if w == got => Ok(()),
            Some(w) => Err(shard_error(
                &sh.path,
                a,
                format!("checksum mismatch in payload bytes {a}..{b} (chunk {k}: index 0x{w:08x}, data read 0x{got:08x})"),
            )),
            None => Err(shard_error(&sh.path, a, format!("no checksum for chunk {k} in the index"))),
        }
    };
    // On the verifier's own thread, in sequence: one core hashes 5–10 GB/s (CRC-32 with
    // carry-less multiplies), several times the disks this loader meets; the global thread pool
    // is left to the training's CPU work.
    jobs.iter().try_for_each(check)
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

/// The pipeline's stages, in `LoaderStats`'s order.
const STAGES: [&str; 4] = ["plan", "io", "verify", "assemble"];

/// CPU seconds the calling thread has used.
fn own_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a local out-pointer.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// CPU seconds a thread has used so far (0 once it has ended, or where the clock is refused).
fn thread_cpu_seconds(h: &std::thread::JoinHandle<()>) -> f64 {
    use std::os::unix::thread::JoinHandleExt;
    if h.is_finished() {
        return 0.0;
    }
    let mut clock: libc::clockid_t = 0;
    // SAFETY: a pthread_t stays valid until it is joined, and we hold its unjoined handle (a
    // thread that ended meanwhile gives an error or a final value, both harmless); the
    // out-pointer is a local.
    if unsafe { libc::pthread_getcpuclockid(h.as_pthread_t(), &mut clock) } != 0 {
        return 0.0;
    }
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a local out-pointer.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// The planner thread: the sample order, each window's reads and its buffer, prepared ahead of
/// the I/O thread so that the I/O thread does nothing but keep the queue full. Buffers come back
/// from the assembler; a fresh one is faulted in here, since first touches of memory cost the
/// kernel a zeroing pass (slow in some VMs) that would otherwise hold up the I/O thread's reads.
fn plan_thread(
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

fn io_thread(
    geo: Arc<Geometry>,
    cfg: IoConfig,
    plans: Receiver<Plan>,
    out: SyncSender<Result<Window>>,
    shared: Arc<Shared>,
) {
    if let Err(e) = io_loop(&geo, &cfg, &plans, &out, &shared) {
        let _ = out.send(Err(e));
    }
}

/// Windows a loader keeps in flight on the I/O thread (being read, or read and waiting to be
/// handed on): enough that, while the oldest finishes, the others still hold a full queue's
/// worth of reads (`queue_bytes`), and at least two.
fn pending_windows(queue_bytes: u64, window_bytes: u64) -> usize {
    (queue_bytes.div_ceil(window_bytes.max(1)) as usize + 1).max(2)
}

fn io_loop(
    geo: &Geometry,
    cfg: &IoConfig,
    plans: &Receiver<Plan>,
    out: &SyncSender<Result<Window>>,
    shared: &Shared,
) -> Result<()> {
    let paths: Vec<PathBuf> = geo.shards.iter().map(|s| s.path.clone()).collect();
    let sizes: Vec<u64> = geo.shards.iter().map(|s| s.file_bytes).collect();
    // Declared before the engine so that the engine (which drains reads in flight when dropped)
    // is dropped first, before these buffers.
    let mut windows: VecDeque<Pending> = VecDeque::new();
    let mut files = Files::open(&paths, &sizes)?;
    let mut setup = io::setup(cfg, &mut files);
    if let Ok(mut d) = shared.io_desc.lock() {
        *d = (setup.description.clone(), setup.fallback.clone());
    }
    let engine = &mut setup.engine;
    let max_pending = pending_windows(
        (engine.capacity() * cfg.request_bytes) as u64,
        geo.window_bytes,
    );
    // Windows read completely, in order, that the next stage has not taken yet.
    let mut ready: VecDeque<Window> = VecDeque::new();
    // A plan received while nothing was in flight, to start next.
    let mut stash: Option<Plan> = None;
    let mut plans_done = false;
    let mut seq = 0u64;
    let mut done = Vec::new();
    loop {
        if shared.stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        // Take planned windows while the reads not yet queued would not refill the whole queue.
        while !plans_done && windows.len() + ready.len() < max_pending {
            let unqueued: usize = windows
                .iter()
                .map(|w| w.plan.pieces.len() - w.next_piece)
                .sum();
            if unqueued >= engine.capacity() {
                break;
            }
            let p = if let Some(p) = stash.take() {
                p
            } else if windows.is_empty() && ready.is_empty() {
                // Nothing else to do: wait for the planner.
                let r = plans.recv();
                match r {
                    Ok(p) => p,
                    Err(_) => {
                        plans_done = true;
                        break;
                    }
                }
            } else {
                match plans.try_recv() {
                    Ok(p) => p,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        plans_done = true;
                        break;
                    }
                }
            };
            let left = p.pieces.len();
            windows.push_back(Pending {
                seq,
                plan: p,
                next_piece: 0,
                left,
            });
            seq += 1;
        }
        // Keep the queue full, across window boundaries.
        'fill: for w in windows.iter_mut() {
            while w.next_piece < w.plan.pieces.len() {
                if engine.outstanding() >= engine.capacity() {
                    break 'fill;
                }
                let i = w.next_piece;
                let pc = &w.plan.pieces[i];
                let req = Req {
                    token: (w.seq << 32) | i as u64,
                    fd: files.fd(pc.shard),
                    off: pc.off,
                    len: pc.len,
                    // SAFETY: dst + len stays inside the buffer: its capacity is at least the
                    // plan's bytes, which hold every extent rounded up to ALIGN.
                    dst: unsafe { w.plan.buf.as_mut_ptr().add(pc.dst) },
                };
                // SAFETY: the buffer lives in `windows` until this read's completion is
                // processed (the engine is dropped first on every exit path); offsets, lengths
                // and the buffer base are ALIGN-aligned, as O_DIRECT requires.
                unsafe { engine.submit(req)? };
                w.next_piece += 1;
            }
        }
        // Finished windows move on in order; the next stage takes them when it is free, and
        // meanwhile reads go on (into the windows still pending).
        while windows.front().is_some_and(|w| w.left == 0) {
            let w = windows.pop_front().unwrap();
            ready.push_back(Window {
                rows: w.plan.rows.into(),
                extents: w.plan.extents,
                buf: w.plan.buf,
            });
        }
        while let Some(w) = ready.pop_front() {
            match out.try_send(Ok(w)) {
                Ok(()) => {}
                Err(TrySendError::Full(Ok(w))) => {
                    ready.push_front(w);
                    break;
                }
                Err(_) => return Ok(()),
            }
        }
        if windows.is_empty() && ready.is_empty() && plans_done {
            return Ok(());
        }
        if engine.outstanding() == 0 {
            // Nothing in flight (so `windows` is empty: every window read has moved to `ready`).
            if ready.is_empty() {
                continue; // the top of the loop waits for the planner, or ends
            }
            // The next stage is full: the consumer is the slower end.
            if !plans_done && windows.len() + ready.len() < max_pending {
                // Read on into another buffer meanwhile (the planner is far ahead, or nearly).
                let r = plans.recv();
                match r {
                    Ok(p) => stash = Some(p),
                    Err(_) => plans_done = true,
                }
            } else if let Some(w) = ready.pop_front() {
                // Every buffer is read: wait until the next stage takes one.
                let r = out.send(Ok(w));
                if r.is_err() {
                    return Ok(());
                }
            }
            continue;
        }
        done.clear();
        engine.wait(&mut done)?;
        for d in &done {
            let (wseq, i) = (d.token >> 32, (d.token & 0xffff_ffff) as usize);
            let w = windows
                .iter_mut()
                .find(|w| w.seq == wseq)
                .ok_or_else(|| Error::Other("internal: completion for an unknown window".into()))?;
            let pc = &mut w.plan.pieces[i];
            let want = pc.expect - pc.got;
            let n = io::check_done(
                &geo.shards[pc.shard].path,
                pc.off + pc.got as u64,
                d.res,
                want,
            )?;
            shared
                .bytes_read
                .fetch_add(n.min(want) as u64, Ordering::Relaxed);
            pc.got += n.min(want);
            if pc.got >= pc.expect {
                w.left -= 1;
                continue;
            }
            // A short read before the end of the data: read the rest with a plain pread (its
            // offset may no longer be aligned for O_DIRECT).
            let fd = std::os::fd::AsRawFd::as_raw_fd(&files.buffered[pc.shard]);
            let rest = pc.expect - pc.got;
            // SAFETY: dst + got .. dst + expect lies inside the window buffer, which no read in
            // flight targets (this piece's read has completed).
            let r = unsafe {
                io::pread_full(
                    fd,
                    w.plan.buf.as_mut_ptr().add(pc.dst + pc.got),
                    rest,
                    pc.off + pc.got as u64,
                )
            };
            let n = io::check_done(&geo.shards[pc.shard].path, pc.off + pc.got as u64, r, rest)?;
            if n < rest {
                return Err(shard_error(
                    &geo.shards[pc.shard].path,
                    pc.off + (pc.got + n) as u64,
                    "unexpected end of file (did it shrink?)",
                ));
            }
            shared.bytes_read.fetch_add(n as u64, Ordering::Relaxed);
            pc.got += n;
            w.left -= 1;
        }
    }
}

/// The verifier thread: checks each window's chunks against the index between the I/O thread
/// and the assembler, so neither waits on it (it used to run on the I/O thread, which stopped
/// queueing reads while it hashed).
fn verify_thread(
    geo: Arc<Geometry>,
    windows: Receiver<Result<Window>>,
    out: SyncSender<Result<Window>>,
) {
    for w in windows.iter() {
        let r = w.and_then(|w| verify(&geo, &w).map(|()| w));
        let failed = r.is_err();
        if out.send(r).is_err() || failed {
            return;
        }
    }
}

struct Assembler {
    geo: Arc<Geometry>,
    schedule: Schedule,
    batch: usize,
    out_dtype: DType,
    pad_token: u32,
    ring: Option<Arc<DeviceRing>>,
}

/// Copies `n` tokens from `src` (little-endian `from`) into `dst` as `to`.
fn convert(src: &[u8], from: DType, dst: &mut [u8], to: DType, n: usize) {
    if from == to {
        let b = n * from.size_in_bytes();
        dst[..b].copy_from_slice(&src[..b]);
        return;
    }
    let ts = to.size_in_bytes();
    for i in 0..n {
        let v = match from {
            DType::U16 => u16::from_le_bytes([src[2 * i], src[2 * i + 1]]) as u32,
            _ => u32::from_le_bytes(src[4 * i..4 * i + 4].try_into().unwrap()),
        };
        match to {
            DType::U16 => dst[2 * i..2 * i + 2].copy_from_slice(&(v as u16).to_le_bytes()),
            _ => dst[ts * i..ts * i + 4].copy_from_slice(&v.to_le_bytes()),
        }
    }
}

fn fill_pad(dst: &mut [u8], to: DType, pad: u32) {
    let ts = to.size_in_bytes();
    for c in dst.chunks_exact_mut(ts) {
        match to {
            DType::U16 => c.copy_from_slice(&(pad as u16).to_le_bytes()),
            _ => c.copy_from_slice(&pad.to_le_bytes()),
        }
    }
}

impl Assembler {
    fn run(
        self,
        windows: Receiver<Result<Window>>,
        recycle: mpsc::Sender<AlignedBuf>,
        out: SyncSender<Result<Ready>>,
        free: Receiver<usize>,
        shared: Arc<Shared>,
    ) {
        if let Err(e) = self.run_inner(&windows, &recycle, &out, &free, &shared) {
            let _ = out.send(Err(e));
        }
    }

    fn recv_timed<T>(rx: &Receiver<T>, shared: &Shared) -> Option<T> {
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(v) => return Some(v),
                Err(RecvTimeoutError::Timeout) if !shared.stop.load(Ordering::Relaxed) => continue,
                Err(_) => return None,
            }
        }
    }

    fn run_inner(
        &self,
        windows: &Receiver<Result<Window>>,
        recycle: &mpsc::Sender<AlignedBuf>,
        out: &SyncSender<Result<Ready>>,
        free: &Receiver<usize>,
        shared: &Shared,
    ) -> Result<()> {
        if let Some(r) = &self.ring {
            r.device.bind()?;
        }
        let t1 = self.geo.seq as usize + 1;
        let ts = self.out_dtype.size_in_bytes();
        let row_bytes = t1 * ts;
        let mut cur: Option<Window> = None;
        for step in self.schedule.clone() {
            let mut samples = Vec::with_capacity(step.real);
            let mut fill = |dst: &mut [u8]| -> Result<()> {
                for i in 0..step.real {
                    let row = loop {
                        if let Some(r) = cur.as_mut().and_then(|w| w.rows.pop_front()) {
                            break r;
                        }
                        if let Some(w) = cur.take() {
                            let _ = recycle.send(w.buf);
                        }
                        match Self::recv_timed(windows, shared) {
                            Some(Ok(w)) => cur = Some(w),
                            Some(Err(e)) => return Err(e),
                            None => return Err(Error::Other("loader stopped".into())),
                        }
                    };
                    let want = step.rank_start + i as u64;
                    if row.pos != want {
                        return Err(Error::Other(format!(
                            "internal: row for position {} where {want} was due",
                            row.pos
                        )));
                    }
                    let from = self.geo.shards[row.shard as usize].header.dtype;
                    let src = &cur.as_ref().unwrap().buf.as_slice()
                        [row.off..row.off + t1 * from.size_in_bytes()];
                    convert(
                        src,
                        from,
                        &mut dst[i * row_bytes..(i + 1) * row_bytes],
                        self.out_dtype,
                        t1,
                    );
                    samples.push(row.sample);
                }
                fill_pad(
                    &mut dst[step.real * row_bytes..self.batch * row_bytes],
                    self.out_dtype,
                    self.pad_token,
                );
                Ok(())
            };
            let msg = match &self.ring {
                None => {
                    // Gather straight into the tensor's storage: no extra copy.
                    let t = Tensor::empty(&[self.batch, t1], self.out_dtype, Device::Cpu)?;
                    let n = self.batch * t1;
                    match self.out_dtype {
                        DType::U16 => t.with_cpu_mut::<u16, _>(|s| {
                            fill(bytemuck::cast_slice_mut(&mut s[..n]))
                        })??,
                        DType::U32 => t.with_cpu_mut::<u32, _>(|s| {
                            fill(bytemuck::cast_slice_mut(&mut s[..n]))
                        })??,
                        _ => t.with_cpu_mut::<i32, _>(|s| {
                            fill(bytemuck::cast_slice_mut(&mut s[..n]))
                        })??,
                    }
                    Msg::Host(t)
                }
                Some(ring) => {
                    let Some(i) = Self::recv_timed(free, shared) else {
                        return Ok(());
                    };
                    ring.stage(i, fill)?;
                    Msg::Slot(i)
                }
            };
            let ready = Ready {
                msg,
                epoch: step.epoch,
                position: step.rank_start,
                valid_rows: step.real,
                samples,
                next: step.next,
            };
            if out.send(Ok(ready)).is_err() {
                return Ok(());
            }
        }
        Ok(())
    }
}
