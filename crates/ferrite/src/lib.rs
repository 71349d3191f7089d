//! # ferrite
//!
//! Deep-learning operations, each a ladder of named variants from a CPU baseline to the best GPU
//! kernel we can write, with correctness checks against an f64 reference and benchmarks against
//! the vendor library in the same run.
//!
//! - [`core`]: tensors, devices, the CUDA runtime and run-time kernel compilation, variants, and
//!   the check/bench harness. It knows no op.
//! - [`ops`]: one module per op family (`matmul`, `copy`, ...), each holding its API and input
//!   checks, CPU code, CUDA host code and `.cu` kernels, checks and benchmark side by side.
//! - [`data`]: token shards and the streaming loader.
//! - [`train`]: a GPT trained from shards with explicit forward and backward calls into the ops.
//!
//! ```no_run
//! use ferrite::{Device, DType, Tensor};
//! let a = Tensor::rand(&[256, 128], DType::F32, Device::Cpu, 1, -1.0, 1.0)?;
//! let b = Tensor::rand(&[128, 64], DType::F32, Device::Cpu, 2, -1.0, 1.0)?;
//! let c = ferrite::ops::matmul::matmul(&a, &b)?;
//! assert_eq!(c.shape(), &[256, 64]);
//! # Ok::<(), ferrite::Error>(())
//! ```

pub mod core;
pub mod data;
pub mod ops;
pub mod train;

#[cfg(test)]
mod fuzz_tests;

pub use crate::core::device::{Arch, Device};
pub use crate::core::dtype::{DType, Element};
pub use crate::core::error::{Error, Result};
pub use crate::core::tensor::Tensor;
