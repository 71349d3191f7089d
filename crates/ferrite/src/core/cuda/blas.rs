//! cuBLAS, the vendor peer every GEMM-shaped op is measured against. One handle per stream.

use super::{CudaDevice, Stream};
use crate::core::error::{Error, Result};
use cudarc::cublas::{result as cb, sys};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// A cuBLAS handle bound to one stream of one device.
pub struct Blas {
    handle: sys::cublasHandle_t,
}

// SAFETY: a cuBLAS handle may be used from any thread as long as calls on it are serialised,
// which the Mutex around every `Blas` guarantees.
unsafe impl Send for Blas {}

impl Blas {
    pub fn handle(&self) -> sys::cublasHandle_t {
        self.handle
    }
}

/// Whether cuBLAS can be loaded.
pub fn available() -> Result<()> {
    // SAFETY: only probes whether the library can be opened.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::CudaUnavailable(
            "cuBLAS (libcublas.so.13) not found by the loader".into(),
        ))
    }
}

/// The handle for (`dev`, `stream`), created on first use.
pub fn handle(dev: &CudaDevice, stream: &Stream) -> Result<Arc<Mutex<Blas>>> {
    type Key = (usize, usize);
    static HANDLES: OnceLock<Mutex<HashMap<Key, Arc<Mutex<Blas>>>>> = OnceLock::new();
    available()?;
    let key = (dev.ordinal(), stream.cu_stream() as usize);
    let mut map = HANDLES.get_or_init(Default::default).lock().unwrap();
    if let Some(h) = map.get(&key) {
        return Ok(h.clone());
    }
    dev.bind()?;
    let handle = cb::create_handle().map_err(|e| Error::cuda("cublasCreate", format!("{e:?}")))?;
    // SAFETY: handle is live; the stream belongs to dev's context.
    unsafe { cb::set_stream(handle, stream.cu_stream() as _) }
        .map_err(|e| Error::cuda("cublasSetStream", format!("{e:?}")))?;
    let h = Arc::new(Mutex::new(Blas { handle }));
    map.insert(key, h.clone());
    Ok(h)
}
