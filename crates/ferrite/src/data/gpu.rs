//! The host→device end of the loader: a ring of slots, each a page-locked host buffer (plain
//! `cuMemHostAlloc`, not write-combined: the CPU writes it but DMA reads it, and a bench may read
//! it back) and a device buffer, copied asynchronously on a dedicated copy stream.
//!
//! Per slot, two events order everything without blocking the CPU:
//! - `ready` is recorded on the copy stream after the slot's host→device copy; the consumer's
//!   compute stream waits on it (only on its own batch's event, never on the whole copy stream).
//! - `released` is recorded on the consumer's stream when the batch is dropped; the copy stream
//!   waits on it before overwriting the slot's device buffer, so a copy never races compute that
//!   still reads the previous batch.
//!
//! Before the CPU rewrites a slot's host buffer it synchronises on that slot's `ready` event
//! (the previous copy out of it has finished; by then it long has).

use crate::core::cuda::{CudaDevice, DeviceBuffer, PinnedBuffer, Stream};
use crate::core::error::{Error, Result};
use cudarc::driver::{result as drv, sys, CudaContext};
use std::sync::{Arc, Mutex};

/// A CUDA event without timing (cheaper to record and wait on).
pub struct Event {
    ev: sys::CUevent,
    ctx: Arc<CudaContext>,
}

// SAFETY: a CUevent is a handle the driver allows to be used from any thread of the process.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    pub fn new(dev: &CudaDevice) -> Result<Event> {
        dev.bind()?;
        let ev = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| Error::cuda("cuEventCreate", e))?;
        Ok(Event {
            ev,
            ctx: dev.context().clone(),
        })
    }
    fn bind(&self) -> Result<()> {
        // Event calls act on the calling thread's current context: the consumer's thread may
        // have none bound yet.
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))
    }
    pub fn record(&self, stream: &Stream) -> Result<()> {
        self.bind()?;
        // SAFETY: a live event and a live stream of the same context.
        unsafe { drv::event::record(self.ev, stream.cu_stream()) }
            .map_err(|e| Error::cuda("cuEventRecord", e))
    }
    /// Makes `stream` wait (on the GPU) for the work before this event's last record. An event
    /// never recorded is complete, so the first wait on a fresh slot is free.
    pub fn wait_on(&self, stream: &Stream) -> Result<()> {
        self.bind()?;
        // SAFETY: a live event and a live stream of the same context.
        unsafe {
            drv::stream::wait_event(
                stream.cu_stream(),
                self.ev,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| Error::cuda("cuStreamWaitEvent", e))
    }
    pub fn synchronize(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda("cuCtxSetCurrent", e))?;
        // SAFETY: a live event.
        unsafe { drv::event::synchronize(self.ev) }
            .map_err(|e| Error::cuda("cuEventSynchronize (a batch copy failed)", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: created in `new`, destroyed only here; the driver defers destruction until
        // pending work that records or waits on it is done.
        let _ = unsafe { drv::event::destroy(self.ev) };
    }
}

pub struct Slot {
    pub host: Mutex<PinnedBuffer>,
    pub dev: DeviceBuffer,
    pub ready: Event,
    pub released: Event,
}

pub struct DeviceRing {
    pub device: Arc<CudaDevice>,
    pub copy: Stream,
    pub slots: Vec<Slot>,
    pub slot_bytes: usize,
}

impl DeviceRing {
    pub fn new(device: Arc<CudaDevice>, slots: usize, slot_bytes: usize) -> Result<DeviceRing> {
        let copy = device.new_stream()?;
        let mut v = Vec::with_capacity(slots);
        for _ in 0..slots {
            v.push(Slot {
                host: Mutex::new(device.alloc_pinned(slot_bytes)?),
                dev: device.alloc(slot_bytes, &copy)?,
                ready: Event::new(&device)?,
                released: Event::new(&device)?,
            });
        }
        // The allocations are stream-ordered on the copy stream; finish them before any other
        // stream can see the pointers.
        device.synchronize(&copy, "allocating the loader's device ring")?;
        Ok(DeviceRing {
            device,
            copy,
            slots: v,
            slot_bytes,
        })
    }

    /// Fills slot `i`'s host buffer with `fill` and queues its copy to the device.
    pub fn stage(&self, i: usize, fill: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<()> {
        let s = &self.slots[i];
        // The previous copy out of this host buffer must be over before the CPU rewrites it.
        s.ready.synchronize()?;
        let mut host = s
            .host
            .lock()
            .map_err(|_| Error::Other("loader slot lock poisoned".into()))?;
        fill(&mut host.as_mut_slice()[..self.slot_bytes])?;
        // Compute that read this device buffer last time must be done before we overwrite it.
        s.released.wait_on(&self.copy)?;
        // SAFETY: the device buffer holds slot_bytes; the pinned source stays alive (owned by the
        // ring, which outlives every batch) and is not rewritten before `ready` completes (above).
        unsafe {
            self.device
                .htod(s.dev.ptr(), &host.as_slice()[..self.slot_bytes], &self.copy)?
        };
        s.ready.record(&self.copy)
    }
}

impl Drop for DeviceRing {
    fn drop(&mut self) {
        // Device buffers are freed on the copy stream: order that after every consumer's use.
        for s in &self.slots {
            let _ = s.released.wait_on(&self.copy);
        }
        let _ = self
            .device
            .synchronize(&self.copy, "dropping the loader's device ring");
    }
}
