//! NCCL through `cudarc`'s bindings (loaded at run time, like the rest of CUDA): one communicator
//! per process, its collectives queued on ferrite's stream of the process's GPU, in place on
//! ferrite tensors.

use crate::core::cuda::{CudaDevice, Stream};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::tensor::Tensor;
use cudarc::nccl::{result, sys};
use std::sync::Arc;

/// A communicator over every rank, bound to one GPU and its ferrite stream.
pub(crate) struct NcclComm {
    comm: sys::ncclComm_t,
    stream: Stream,
    dev: Arc<CudaDevice>,
}

// SAFETY: an NCCL communicator is not tied to the thread that made it (NCCL only asks that one
// communicator is not used by two threads at once: `NcclComm` is not `Sync`, and every call
// binds the device's context on the calling thread first).
unsafe impl Send for NcclComm {}

fn nccl_err(call: &str, e: result::NcclError) -> Error {
    Error::cuda(format!("NCCL {call}"), format!("{e:?}"))
}

/// Whether libnccl can be loaded (cudarc looks for `libnccl.so`; NCCL's packages ship
/// `libnccl.so.2`, to be linked under that name on the loader's path).
pub(crate) fn available() -> bool {
    // SAFETY: loads the library by name; no NCCL call is made.
    unsafe { sys::is_culib_present() }
}

/// A fresh unique id (rank 0 makes it, the others receive it).
pub(crate) fn unique_id() -> Result<[u8; 128]> {
    let id = result::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
    Ok(id.internal.map(|c| c as u8))
}

fn nccl_dtype(op: &str, t: &Tensor) -> Result<sys::ncclDataType_t> {
    Ok(match t.dtype() {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::I32 => sys::ncclDataType_t::ncclInt32,
        other => return Err(Error::bad_arg(op, "tensor", "f32, bf16, f16 or i32", other)),
    })
}

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `world` on `dev`, its collectives queued on
    /// `stream` (every rank calls this at once).
    pub(crate) fn new(
        dev: Arc<CudaDevice>,
        stream: Stream,
        rank: usize,
        world: usize,
        id: [u8; 128],
    ) -> Result<NcclComm> {
        dev.bind()?;
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as core::ffi::c_char),
        };
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL on success; world and rank fit in i32 (checked by the
        // process group at start-up).
        let comm = unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), world as i32, id, rank as i32)
                .map_err(|e| nccl_err("ncclCommInitRank", e))?;
            comm.assume_init()
        };
        Ok(NcclComm { comm, stream, dev })
    }

    fn check(&self, op: &str, t: &Tensor) -> Result<sys::ncclDataType_t> {
        let dt = nccl_dtype(op, t)?;
        if !t.is_contiguous() {
            return Err(Error::bad_arg(
                op,
                "tensor",
                "a contiguous tensor",
                "a strided view",
            ));
        }
        match t.device() {
            crate::core::device::Device::Cuda(i) if i == self.dev.ordinal() => Ok(dt),
            d => Err(Error::bad_arg(
                op,
                "tensor",
                format!("a tensor on cuda:{}", self.dev.ordinal()),
                d,
            )),
        }
    }

    fn raw_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    /// `t ← Σ_ranks t`, in place, queued on the stream.
    pub(crate) fn all_reduce_sum(&self, t: &Tensor) -> Result<()> {
        let dt = self.check("dist::all_reduce", t)?;
        let p = t.device_ptr()? as *mut core::ffi::c_void;
        self.dev.bind()?;
        // SAFETY: `p` addresses `t.numel()` contiguous elements of `dt` on this communicator's
        // device (checked); NCCL reads and writes them in stream order.
        unsafe {
            result::all_reduce(
                p,
                p,
                t.numel(),
                dt,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                self.raw_stream(),
            )
        }
        .map_err(|e| nccl_err("ncclAllReduce", e))?;
        Ok(())
    }

    /// `out ← rank's slice of Σ_ranks input` (`input` holds `world · out.numel()` elements).
    pub(crate) fn reduce_scatter_sum(&self, input: &Tensor, out: &Tensor) -> Result<()> {
        let dt = self.check("dist::reduce_scatter", input)?;
        if self.check("dist::reduce_scatter", out)? != dt {
            return Err(Error::bad_arg(
                "dist::reduce_scatter",
                "out",
                input.dtype(),
                out.dtype(),
            ));
        }
        self.dev.bind()?;
        // SAFETY: both buffers are contiguous on this device with the element counts NCCL reads
        // and writes (the caller sizes input as world × out).
        unsafe {
            result::reduce_scatter(
                input.device_ptr()? as *const core::ffi::c_void,
                out.device_ptr()? as *mut core::ffi::c_void,
                out.numel(),
                dt,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                self.raw_stream(),
            )
        }
        .map_err(|e| nccl_err("ncclReduceScatter", e))?;
        Ok(())
    }

    /// `out ← every rank's `input`, in rank order` (`out` holds `world · input.numel()`).
    pub(crate) fn all_gather(&self, input: &Tensor, out: &Tensor) -> Result<()> {
        let dt = self.check("dist::all_gather", input)?;
        self.check("dist::all_gather", out)?;
        self.dev.bind()?;
        // SAFETY: as in reduce_scatter; in-place gathers (input inside out at this rank's slot)
        // are allowed by NCCL.
        unsafe {
            result::all_gather(
                input.device_ptr()? as *const core::ffi::c_void,
                out.device_ptr()? as *mut core::ffi::c_void,
                input.numel(),
                dt,
                self.comm,
                self.raw_stream(),
            )
        }
        .map_err(|e| nccl_err("ncclAllGather", e))?;
        Ok(())
    }
}

impl NcclComm {
    /// Point-to-point exchange in one NCCL group: `sends[d]`'s element ranges of `send` go to rank
    /// d, `recvs[s]`'s ranges of `recv` come from rank s, matched in order per peer (the caller
    /// gives a sent range and the range it lands in the same length; empty ranges are skipped on
    /// both sides).
    pub(crate) fn all_to_all_v(
        &self,
        send: &Tensor,
        sends: &[super::Chunks],
        recv: &Tensor,
        recvs: &[super::Chunks],
    ) -> Result<()> {
        let dt = self.check("dist::all_to_all", send)?;
        self.check("dist::all_to_all", recv)?;
        let es = send.dtype().size_in_bytes() as u64;
        let (ps, pr) = (send.device_ptr()?, recv.device_ptr()?);
        self.dev.bind()?;
        result::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
        let mut queued = Ok(());
        'peers: for (peer, (out, inn)) in sends.iter().zip(recvs).enumerate() {
            for &(o, l) in out.iter().filter(|c| c.1 > 0) {
                // SAFETY: the range lies inside `send` (checked by the process group), on this
                // communicator's device; NCCL reads it in stream order.
                let r = unsafe {
                    result::send(
                        (ps + o as u64 * es) as *const core::ffi::c_void,
                        l,
                        dt,
                        peer as i32,
                        self.comm,
                        self.raw_stream(),
                    )
                };
                if let Err(e) = r {
                    queued = Err(nccl_err("ncclSend", e));
                    break 'peers;
                }
            }
            for &(o, l) in inn.iter().filter(|c| c.1 > 0) {
                // SAFETY: as above, a range inside `recv` that NCCL writes.
                let r = unsafe {
                    result::recv(
                        (pr + o as u64 * es) as *mut core::ffi::c_void,
                        l,
                        dt,
                        peer as i32,
                        self.comm,
                        self.raw_stream(),
                    )
                };
                if let Err(e) = r {
                    queued = Err(nccl_err("ncclRecv", e));
                    break 'peers;
                }
            }
        }
        // The group is closed whatever happened inside it.
        let closed = result::group_end().map_err(|e| nccl_err("ncclGroupEnd", e));
        queued.and(closed.map(|_| ()))
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: the communicator was initialised and is destroyed once; pending work on the
        // stream finishes first.
        let _ = self.stream.synchronize();
        unsafe {
            let _ = result::comm_destroy(self.comm);
        }
    }
}
