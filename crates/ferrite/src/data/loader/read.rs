//! The I/O thread: keeps the read engine's queue full across window boundaries, and hands
//! windows on, in order, as their reads complete.

use super::pipeline::Shared;
use super::plan::{Extent, Geometry, Plan, Row};
use crate::core::error::{Error, Result};
use crate::data::format::shard_error;
use crate::data::io::{self, AlignedBuf, Files, IoConfig, Req};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;

/// A window read (and, past the verifier, verified): its rows in position order and its bytes.
pub(super) struct Window {
    pub(super) rows: VecDeque<Row>,
    pub(super) extents: Vec<Extent>,
    pub(super) buf: AlignedBuf,
}

/// A window whose reads are in progress on the I/O thread.
struct Pending {
    seq: u64,
    plan: Plan,
    next_piece: usize,
    left: usize,
}

pub(super) fn io_thread(
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
