//! The loader's pipeline as a whole: the channels between the stages, the threads that run
//! them, what they share (the stop flag and the counters behind `LoaderStats`), and the GPU ring
//! the assembler copies batches through.

use super::assemble::{Assembler, Ready};
use super::plan::{plan_thread, Geometry, Plan};
use super::read::{io_thread, Window};
use super::verify::verify_thread;
use super::LoaderConfig;
use crate::core::cuda;
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::data::gpu::DeviceRing;
use crate::data::io::AlignedBuf;
use crate::data::order::{OrderSpec, Schedule};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// What the stages and the loader share.
pub(super) struct Shared {
    pub(super) stop: AtomicBool,
    pub(super) bytes_read: AtomicU64,
    pub(super) io_desc: std::sync::Mutex<(String, Option<String>)>,
    /// Window buffers allocated.
    pub(super) buffers: AtomicU64,
    /// CPU nanoseconds of each stage's thread, recorded as it ends (see `STAGES`).
    pub(super) cpu_ns: [AtomicU64; 4],
}

/// The pipeline's stages, in `LoaderStats`'s order.
pub(super) const STAGES: [&str; 4] = ["plan", "io", "verify", "assemble"];

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
pub(super) fn thread_cpu_seconds(h: &std::thread::JoinHandle<()>) -> f64 {
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

/// The loader's ends of a running pipeline.
pub(super) struct Pipeline {
    /// Batches from the assembler, `prefetch` ahead.
    pub(super) rx: Receiver<Result<Ready>>,
    /// Where a dropped batch gives its GPU slot back to the assembler.
    pub(super) free_tx: SyncSender<usize>,
    pub(super) shared: Arc<Shared>,
    /// The pipeline's threads, by stage name.
    pub(super) threads: Vec<(&'static str, JoinHandle<()>)>,
}

/// The pinned host → device ring on a GPU (None on the CPU, where each batch is a fresh host
/// tensor). Its slots cover the `prefetch` batches queued for the consumer plus the one the
/// consumer holds; the assembler waits for a slot beyond that.
pub(super) fn device_ring(cfg: &LoaderConfig, out_dtype: DType) -> Result<Option<Arc<DeviceRing>>> {
    let row_bytes = (cfg.seq + 1) * out_dtype.size_in_bytes();
    let prefetch = cfg.prefetch.max(1);
    Ok(match cfg.device {
        Device::Cpu => None,
        Device::Cuda(i) => {
            let dev = cuda::device(i)?;
            Some(Arc::new(DeviceRing::new(
                dev,
                prefetch + 1,
                row_bytes * cfg.batch,
            )?))
        }
    })
}

impl Pipeline {
    /// Starts the four stages, each on its own thread so that no stage's work holds up another's.
    /// The planner and the assembler walk the same `schedule`: the planner to know which rows to
    /// read, the assembler to put them into batches in step order.
    pub(super) fn start(
        cfg: &LoaderConfig,
        geo: Arc<Geometry>,
        spec: OrderSpec,
        schedule: Schedule,
        out_dtype: DType,
        ring: Option<Arc<DeviceRing>>,
    ) -> Result<Pipeline> {
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            bytes_read: AtomicU64::new(0),
            io_desc: std::sync::Mutex::new((String::new(), None)),
            buffers: AtomicU64::new(0),
            cpu_ns: Default::default(),
        });
        let prefetch = cfg.prefetch.max(1);
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
        let spawn =
            |stage: &'static str, f: Box<dyn FnOnce() + Send>| spawn_stage(&shared, stage, f);
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
        Ok(Pipeline {
            rx,
            free_tx,
            shared,
            threads,
        })
    }
}

/// Runs `f` on a thread named after its stage, and records the thread's CPU time as it ends
/// (`thread_cpu_seconds` cannot read the clock of a thread that has ended).
fn spawn_stage(
    shared: &Arc<Shared>,
    stage: &'static str,
    f: Box<dyn FnOnce() + Send>,
) -> Result<(&'static str, JoinHandle<()>)> {
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
}
