//! # ferrite
//!
//! Deep-learning operations, each a ladder of named variants from a CPU baseline to the best GPU
//! kernel we can write, with correctness checks against an f64 reference and benchmarks against
//! the vendor library in the same run.
//!
//! - [`core`]: tensors, devices, the CUDA runtime and run-time kernel compilation, variants, and
//!   the check/bench harness. It knows no op.
//! - [`ops`]: one module per op family, each holding its API and input checks, CPU code, CUDA
//!   host code and `.cu` kernels, checks and benchmark side by side: [`ops::matmul`] (batched,
//!   any layout, tf32), [`ops::linear`] (bias, activation and residual in the GEMM's epilogue;
//!   backward), [`ops::norm`] (LayerNorm, RMSNorm, fused residual add), [`ops::softmax`],
//!   [`ops::activation`] (bias + activation + dropout, SwiGLU/GEGLU), [`ops::rotary`],
//!   [`ops::cross_entropy`], [`ops::adamw`], [`ops::attention`] (FlashAttention-2 and Hopper
//!   kernels, GQA, windows, soft-cap, variable lengths; backward), [`ops::decode`] (paged KV
//!   cache), [`ops::moe`] (mixture of experts, grouped GEMM) and [`ops::copy`].
//! - [`data`]: token shards and the streaming loader.
//! - [`train`]: a GPT trained from shards with explicit forward and backward calls into the ops.
//!
//! ## Calling an op
//!
//! Each family has allocating functions (`matmul`, `linear`, `attention`, ...) and `*_into`
//! forms that write into caller-provided outputs; an options struct whose `variant` picks a rung
//! by name (None: the best one that takes the request) and whose `stream` runs the op on a
//! caller's CUDA stream; and `variants()`, the ladder with what each rung supports. An op runs on
//! the device of its inputs. [`Device::Cpu`] always works; [`Device::Cuda`] needs an NVIDIA
//! driver for CUDA 13 and NVRTC at run time, both loaded dynamically, so the crate builds and
//! runs on machines without them ([`core::cuda::availability`] says why CUDA cannot be used).
//! Kernels are compiled for the GPU at first use and cached on disk. Bad input is an [`Error`]
//! naming the op, the argument, what was expected and what was given — never a panic.
//!
//! ```rust
//! use ferrite::ops::matmul::{matmul, matmul_into, MatmulOptions};
//! use ferrite::{Device, DType, Tensor};
//!
//! let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
//! let b = Tensor::from_vec(vec![1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0], &[3, 2])?;
//! assert_eq!(matmul(&a, &b)?.to_vec::<f32>()?, vec![4.0, 5.0, 10.0, 11.0]);
//!
//! // Larger, into a buffer of the caller's, with a transposed view as B (no copy):
//! let x = Tensor::rand(&[256, 128], DType::F32, Device::Cpu, 1, -1.0, 1.0)?;
//! let w = Tensor::rand(&[64, 128], DType::F32, Device::Cpu, 2, -1.0, 1.0)?;
//! let y = Tensor::empty(&[256, 64], DType::F32, Device::Cpu)?;
//! matmul_into(&x, &w.t()?, &y, &MatmulOptions::default())?;
//! # Ok::<(), ferrite::Error>(())
//! ```
//!
//! ## Examples
//!
//! `crates/ferrite/examples/` holds three small programs, each runnable with
//! `cargo run --release -p ferrite --example NAME`: `matmul_stream` (a bf16 matmul on a stream the
//! caller created, or the CPU path where there is no GPU), `attention` (causal grouped-query
//! flash attention, forward and backward) and `train_step` (a two-layer classifier trained with
//! the library's ops: linear forward and backward, cross-entropy, AdamW).
//!
//! ## Cargo features
//!
//! Both are on by default; `default-features = false` drops their dependencies.
//!
//! - `bench`: the `gemm` crate, the CPU peer that `ferrite bench` measures the CPU matmul ladder
//!   and the CPU ceiling against. Without it those peer rows are absent; every op runs as before.
//! - `pack`: `tiktoken-rs`, the GPT-2 BPE behind `data::pack_files` (text into token shards)
//!   and `data::pack::gpt2`. Without it shards are read, written from token arrays
//!   ([`data::pack::write_shards`]) and streamed as before.
//!
//! ## Environment
//!
//! `FERRITE_DISABLE_CUDA=1` runs CPU-only on a GPU machine; `FERRITE_CACHE_DIR` moves the
//! compiled-kernel and tuning cache (default `~/.cache/ferrite`); `FERRITE_CUDA_LIB_DIR` or
//! `CUDA_HOME` help the loader find NVRTC and cuBLAS, `FERRITE_CUDA_INCLUDE` the CUDA headers.

#![warn(missing_docs)]

pub mod core;
pub mod data;
pub mod dist;
pub mod ops;
pub mod train;

#[cfg(test)]
mod fuzz_tests;

pub use crate::core::device::{Arch, Device};
pub use crate::core::dtype::{DType, Element};
pub use crate::core::error::{Error, Result};
pub use crate::core::tensor::Tensor;
