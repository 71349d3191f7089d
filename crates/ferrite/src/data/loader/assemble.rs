//! The assembler: gathers each step's rows out of the verified windows into a batch (a host
//! tensor, or a pinned slot of the GPU ring copied to the device), and returns spent window
//! buffers to the planner.

use super::pipeline::Shared;
use super::plan::Geometry;
use super::read::Window;
use crate::core::device::Device;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::tensor::Tensor;
use crate::data::gpu::DeviceRing;
use crate::data::io::AlignedBuf;
use crate::data::order::Schedule;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::Duration;

/// Where a batch's tokens are: a host tensor, or the GPU ring's slot they were copied into.
pub(super) enum Msg {
    Host(Tensor),
    Slot(usize),
}

/// A batch as the assembler hands it to the consumer, with the state after it.
pub(super) struct Ready {
    pub(super) msg: Msg,
    pub(super) epoch: u64,
    pub(super) position: u64,
    pub(super) valid_rows: usize,
    pub(super) samples: Vec<u64>,
    pub(super) next: (u64, u64),
}

/// The assembler thread's settings: it walks the same schedule as the planner, step by step.
pub(super) struct Assembler {
    pub(super) geo: Arc<Geometry>,
    pub(super) schedule: Schedule,
    pub(super) batch: usize,
    pub(super) out_dtype: DType,
    pub(super) pad_token: u32,
    pub(super) ring: Option<Arc<DeviceRing>>,
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
    pub(super) fn run(
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
