//! Reading shard bytes: io_uring with O_DIRECT (the fast path: many large reads in flight, no page
//! cache copy), or a pool of threads calling pread (the fallback, used when any part of the fast
//! path's setup is refused: ring creation, an O_DIRECT open, or the probe read through both).
//!
//! Engines only move bytes; the caller owns the destination buffers and must not touch or free
//! them while a read into them is outstanding (`Engine::outstanding`). Every engine drains its
//! outstanding reads before it is dropped, so a buffer outlives the kernel's writes into it.

use super::format::{io_error, shard_error};
use crate::core::error::{Error, Result};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

/// O_DIRECT alignment for offsets, lengths and buffer addresses (covers 512 and 4096-byte sectors).
pub const ALIGN: usize = 4096;

pub fn align_down(x: u64) -> u64 {
    x & !(ALIGN as u64 - 1)
}
pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN as u64) * ALIGN as u64
}

/// Host memory aligned for O_DIRECT, zeroed. Buffers of 2 MiB and more are mapped on their own,
/// 2 MiB-aligned, and offered transparent huge pages: a 64 MiB window then costs 32 page faults
/// instead of 16 384, O_DIRECT pins 2 MiB pages, and the assembler's gathers from random rows
/// of the window miss the TLB far less.
pub struct AlignedBuf {
    ptr: *mut u8,
    cap: usize,
    /// Mapped with mmap (else from the global allocator).
    mapped: bool,
}

const HUGE: usize = 2 << 20;

/// An anonymous mapping of `len` bytes (a multiple of HUGE) aligned to HUGE, or None.
fn map_huge(len: usize) -> Option<*mut u8> {
    let span = len + HUGE;
    // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    let base = p as usize;
    let start = base.next_multiple_of(HUGE);
    // SAFETY: the head [base, start) and tail [start + len, base + span) lie inside the mapping
    // just made, are page-aligned (mmap and HUGE both are) and nothing refers to them.
    unsafe {
        if start > base {
            libc::munmap(base as *mut libc::c_void, start - base);
        }
        let end = start + len;
        if base + span > end {
            libc::munmap(end as *mut libc::c_void, base + span - end);
        }
        // Advice only: without huge pages the buffer works the same. FERRITE_DATA_NO_THP=1
        // leaves it out (to measure it: in a VM whose host backs guest memory lazily, a huge page
        // taken from never-used memory is slow to touch the first time).
        if std::env::var_os("FERRITE_DATA_NO_THP").is_none() {
            libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
    }
    Some(start as *mut u8)
}

// SAFETY: the buffer is plain heap memory owned by this value; access goes through &/&mut.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn new(cap: usize) -> AlignedBuf {
        if cap >= HUGE {
            let cap = cap.next_multiple_of(HUGE);
            // The kernel zeroes anonymous pages as they are first touched.
            if let Some(ptr) = map_huge(cap) {
                return AlignedBuf {
                    ptr,
                    cap,
                    mapped: true,
                };
            }
        }
        let cap = align_up(cap.max(1) as u64) as usize;
        let layout = std::alloc::Layout::from_size_align(cap, ALIGN).expect("aligned layout");
        // SAFETY: the layout has non-zero size; zeroed so the bytes are initialised for slices.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf {
            ptr,
            cap,
            mapped: false,
        }
    }
    pub fn capacity(&self) -> usize {
        self.cap
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is a live, initialised allocation of cap bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.cap) }
    }
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: mapped in `new` with exactly this start and length; unmapped only here.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.cap) };
            return;
        }
        let layout = std::alloc::Layout::from_size_align(self.cap, ALIGN).expect("aligned layout");
        // SAFETY: allocated in `new` with this layout; freed only here.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

/// Which engine to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// io_uring + O_DIRECT, falling back to the pread pool on any setup error.
    Auto,
    /// The pread thread pool (O_DIRECT when `direct` and the file system allows it).
    Pread,
}

/// How the loader reads. `Default`: io_uring with O_DIRECT where allowed, 32 reads of up to
/// 1 MiB in flight; a pread pool of 8 threads as the fallback.
#[derive(Clone, Debug)]
pub struct IoConfig {
    /// Which engine to use.
    pub engine: EngineKind,
    /// Reads in flight (io_uring queue depth).
    pub queue_depth: u32,
    /// Threads of the pread pool.
    pub threads: usize,
    /// Use O_DIRECT (bypass the page cache) when allowed.
    pub direct: bool,
    /// Largest single read, bytes (a multiple of 4096).
    pub request_bytes: usize,
}

impl Default for IoConfig {
    fn default() -> Self {
        IoConfig {
            engine: EngineKind::Auto,
            queue_depth: 32,
            threads: 8,
            direct: true,
            request_bytes: 1 << 20,
        }
    }
}

/// One read: `len` bytes at `off` of `fd` into `dst`. `token` comes back with the completion.
#[derive(Clone, Copy, Debug)]
pub struct Req {
    pub token: u64,
    pub fd: i32,
    pub off: u64,
    pub len: usize,
    pub dst: *mut u8,
}

// SAFETY: `dst` points into a buffer its submitter keeps alive and untouched until completion.
unsafe impl Send for Req {}

/// A completed read: bytes read, or a negative errno.
#[derive(Clone, Copy, Debug)]
pub struct Done {
    pub token: u64,
    pub res: i64,
}

pub trait Engine: Send {
    /// Reads that may be outstanding at once.
    fn capacity(&self) -> usize;
    fn outstanding(&self) -> usize;
    /// Queues a read.
    ///
    /// # Safety
    /// `req.dst..req.dst+req.len` must be writable memory that stays alive and is not accessed
    /// until the read's completion has been returned by `wait`; for an O_DIRECT fd, `dst`, `off`
    /// and `len` must be 4096-aligned.
    unsafe fn submit(&mut self, req: Req) -> Result<()>;
    /// Blocks until at least one read completes (when any is outstanding); appends completions.
    fn wait(&mut self, out: &mut Vec<Done>) -> Result<()>;
    fn name(&self) -> String;
}

/// io_uring engine.
pub struct Uring {
    ring: io_uring::IoUring,
    depth: usize,
    outstanding: usize,
    unsubmitted: usize,
}

impl Uring {
    pub fn new(depth: u32) -> std::io::Result<Uring> {
        let depth = depth.clamp(1, 4096);
        Ok(Uring {
            ring: io_uring::IoUring::new(depth.next_power_of_two())?,
            depth: depth as usize,
            outstanding: 0,
            unsubmitted: 0,
        })
    }
}

impl Engine for Uring {
    fn capacity(&self) -> usize {
        self.depth
    }
    fn outstanding(&self) -> usize {
        self.outstanding
    }
    unsafe fn submit(&mut self, req: Req) -> Result<()> {
        let len = u32::try_from(req.len)
            .map_err(|_| Error::Other(format!("read of {} bytes is too large", req.len)))?;
        let sqe = io_uring::opcode::Read::new(io_uring::types::Fd(req.fd), req.dst, len)
            .offset(req.off)
            .build()
            .user_data(req.token);
        loop {
            // SAFETY: the caller guarantees the destination stays valid until completion (see the
            // trait); the fd stays open while the engine's owner holds its files.
            if unsafe { self.ring.submission().push(&sqe) }.is_ok() {
                break;
            }
            // Submission queue full: hand what is queued to the kernel and retry.
            self.ring
                .submit()
                .map_err(|e| Error::io("io_uring_enter (submit)", e))?;
            self.unsubmitted = 0;
        }
        self.outstanding += 1;
        self.unsubmitted += 1;
        Ok(())
    }
    fn wait(&mut self, out: &mut Vec<Done>) -> Result<()> {
        if self.outstanding == 0 {
            return Ok(());
        }
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(Error::io("io_uring_enter (wait)", e)),
            }
        }
        self.unsubmitted = 0;
        for cqe in self.ring.completion() {
            out.push(Done {
                token: cqe.user_data(),
                res: cqe.result() as i64,
            });
            self.outstanding -= 1;
        }
        Ok(())
    }
    fn name(&self) -> String {
        format!("io_uring (queue depth {})", self.depth)
    }
}

impl Drop for Uring {
    fn drop(&mut self) {
        // Reads still in flight write into their buffers: wait for them before anyone frees one.
        let mut sink = Vec::new();
        while self.outstanding > 0 {
            if self.wait(&mut sink).is_err() {
                break;
            }
            sink.clear();
        }
    }
}

struct Job {
    req: Req,
}

/// pread thread pool.
pub struct PreadPool {
    work: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<Done>,
    threads: Vec<std::thread::JoinHandle<()>>,
    outstanding: usize,
    n: usize,
}

/// Reads `len` bytes at `off` into `dst` with pread, retrying partial reads and EINTR; returns
/// bytes read (short only at end of file) or a negative errno.
///
/// # Safety
/// `dst..dst+len` must be writable and not accessed by anyone else during the call.
pub unsafe fn pread_full(fd: i32, dst: *mut u8, len: usize, off: u64) -> i64 {
    let mut got = 0usize;
    while got < len {
        // SAFETY: dst+got..dst+len lies inside the caller's buffer.
        let r = unsafe {
            libc::pread(
                fd,
                dst.add(got) as *mut libc::c_void,
                len - got,
                (off + got as u64) as libc::off_t,
            )
        };
        if r < 0 {
            let e = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            if e == libc::EINTR {
                continue;
            }
            return -(e as i64);
        }
        if r == 0 {
            break;
        }
        got += r as usize;
    }
    got as i64
}

impl PreadPool {
    pub fn new(threads: usize) -> PreadPool {
        let n = threads.max(1);
        let (wtx, wrx) = mpsc::channel::<Job>();
        let (dtx, drx) = mpsc::channel::<Done>();
        let wrx = Arc::new(Mutex::new(wrx));
        let threads = (0..n)
            .map(|i| {
                let (wrx, dtx) = (wrx.clone(), dtx.clone());
                std::thread::Builder::new()
                    .name(format!("ferrite-pread-{i}"))
                    .spawn(move || loop {
                        let job = match wrx.lock().map(|r| r.recv()) {
                            Ok(Ok(j)) => j,
                            _ => return,
                        };
                        let r = job.req;
                        // SAFETY: the submitter keeps dst alive and untouched until it receives
                        // this completion (Engine::submit's contract).
                        let res = unsafe { pread_full(r.fd, r.dst, r.len, r.off) };
                        if dtx
                            .send(Done {
                                token: r.token,
                                res,
                            })
                            .is_err()
                        {
                            return;
                        }
                    })
                    .expect("spawning a pread thread")
            })
            .collect();
        PreadPool {
            work: Some(wtx),
            done: drx,
            threads,
            outstanding: 0,
            n,
        }
    }
}

impl Engine for PreadPool {
    fn capacity(&self) -> usize {
        self.n * 2
    }
    fn outstanding(&self) -> usize {
        self.outstanding
    }
    unsafe fn submit(&mut self, req: Req) -> Result<()> {
        self.work
            .as_ref()
            .and_then(|w| w.send(Job { req }).ok())
            .ok_or_else(|| Error::Other("the pread pool has stopped".into()))?;
        self.outstanding += 1;
        Ok(())
    }
    fn wait(&mut self, out: &mut Vec<Done>) -> Result<()> {
        if self.outstanding == 0 {
            return Ok(());
        }
        let d = self
            .done
            .recv()
            .map_err(|_| Error::Other("a pread thread died".into()))?;
        out.push(d);
        self.outstanding -= 1;
        while let Ok(d) = self.done.try_recv() {
            out.push(d);
            self.outstanding -= 1;
        }
        Ok(())
    }
    fn name(&self) -> String {
        format!("pread pool ({} threads)", self.n)
    }
}

impl Drop for PreadPool {
    fn drop(&mut self) {
        // Let outstanding reads finish (their buffers must outlive them), then stop the threads.
        while self.outstanding > 0 && self.done.recv().is_ok() {
            self.outstanding -= 1;
        }
        self.work = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The open files of a set of shards: one buffered descriptor each, plus an O_DIRECT one when the
/// fast path is in use.
pub struct Files {
    pub paths: Vec<PathBuf>,
    pub sizes: Vec<u64>,
    pub buffered: Vec<File>,
    pub direct: Vec<File>,
}

impl Files {
    pub fn open(paths: &[PathBuf], sizes: &[u64]) -> Result<Files> {
        let buffered = paths
            .iter()
            .map(|p| File::open(p).map_err(|e| io_error(p, 0, "cannot open", e)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Files {
            paths: paths.to_vec(),
            sizes: sizes.to_vec(),
            buffered,
            direct: Vec::new(),
        })
    }

    /// Opens every file with O_DIRECT too; any refusal is returned as a reason.
    fn open_direct(&mut self) -> std::result::Result<(), String> {
        let mut v = Vec::with_capacity(self.paths.len());
        for p in &self.paths {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(p)
                .map_err(|e| format!("O_DIRECT open of {} refused: {e}", p.display()))?;
            v.push(f);
        }
        self.direct = v;
        Ok(())
    }

    pub fn is_direct(&self) -> bool {
        !self.direct.is_empty()
    }

    /// The descriptor reads of shard `i` go through.
    pub fn fd(&self, i: usize) -> i32 {
        if self.is_direct() {
            self.direct[i].as_raw_fd()
        } else {
            self.buffered[i].as_raw_fd()
        }
    }
}

/// The engine chosen for a set of files, and why.
pub struct Setup {
    pub engine: Box<dyn Engine>,
    /// A line for logs: what runs and, after a fallback, why.
    pub description: String,
    pub fallback: Option<String>,
}

static FALLBACK_SAID: AtomicBool = AtomicBool::new(false);

/// Probes one aligned read at offset 0 of file 0 through `engine`.
fn probe(engine: &mut dyn Engine, files: &Files) -> std::result::Result<(), String> {
    let mut buf = AlignedBuf::new(ALIGN);
    let want = (files.sizes[0] as usize).min(ALIGN);
    let req = Req {
        token: u64::MAX,
        fd: files.fd(0),
        off: 0,
        len: ALIGN,
        dst: buf.as_mut_ptr(),
    };
    // SAFETY: buf is aligned, ALIGN bytes, alive until the wait below returns its completion.
    unsafe { engine.submit(req) }.map_err(|e| e.to_string())?;
    let mut done = Vec::new();
    while done.is_empty() {
        engine.wait(&mut done).map_err(|e| e.to_string())?;
    }
    match done[0].res {
        r if r as usize == want => Ok(()),
        r if r < 0 => Err(format!(
            "probe read of {} failed: {}",
            files.paths[0].display(),
            std::io::Error::from_raw_os_error(-r as i32)
        )),
        r => Err(format!(
            "probe read of {} returned {r} of {want} bytes",
            files.paths[0].display()
        )),
    }
}

/// Chooses the engine: io_uring + O_DIRECT when asked for and everything about it works,
/// otherwise the pread pool (with O_DIRECT if that part works). A fallback is said once per
/// process on stderr and always recorded in `Setup::fallback`.
pub fn setup(cfg: &IoConfig, files: &mut Files) -> Setup {
    let mut reasons = Vec::new();
    if cfg.direct {
        if let Err(r) = files.open_direct() {
            reasons.push(r);
        }
    }
    if cfg.engine == EngineKind::Auto {
        if !files.is_direct() && cfg.direct {
            // O_DIRECT refused: the spec'd fallback is the pread pool on buffered reads.
        } else {
            match Uring::new(cfg.queue_depth) {
                Ok(mut u) => match probe(&mut u, files) {
                    Ok(()) => {
                        let d = format!(
                            "{}{}",
                            u.name(),
                            if files.is_direct() { " + O_DIRECT" } else { "" }
                        );
                        return Setup {
                            engine: Box::new(u),
                            description: d,
                            fallback: None,
                        };
                    }
                    Err(r) => reasons.push(format!("io_uring probe: {r}")),
                },
                Err(e) => reasons.push(format!("io_uring_setup refused: {e}")),
            }
        }
    }
    let mut pool = PreadPool::new(cfg.threads);
    if files.is_direct() {
        if let Err(r) = probe(&mut pool, files) {
            reasons.push(format!("O_DIRECT read: {r}"));
            files.direct.clear();
        }
    }
    let desc = format!(
        "{}{}",
        pool.name(),
        if files.is_direct() {
            " + O_DIRECT"
        } else {
            " (page cache)"
        }
    );
    let fallback = (cfg.engine == EngineKind::Auto || (cfg.direct && !files.is_direct()))
        .then(|| reasons.join("; "));
    let fallback = fallback.filter(|r| !r.is_empty());
    if let Some(r) = &fallback {
        if !FALLBACK_SAID.swap(true, Ordering::Relaxed) {
            eprintln!("ferrite data: fast path unavailable ({r}); reading with a {desc}");
        }
    }
    Setup {
        engine: Box::new(pool),
        description: desc,
        fallback,
    }
}

/// Turns a failed or short completion into an error naming the shard and offset.
pub fn check_done(path: &Path, off: u64, res: i64, want: usize) -> Result<usize> {
    if res < 0 {
        return Err(io_error(
            path,
            off,
            "read failed",
            std::io::Error::from_raw_os_error(-res as i32),
        ));
    }
    if res == 0 && want > 0 {
        return Err(shard_error(
            path,
            off,
            format!("unexpected end of file ({want} more bytes expected; did the file shrink?)"),
        ));
    }
    Ok(res as usize)
}
