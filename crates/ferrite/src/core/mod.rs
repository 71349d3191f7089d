//! Shared machinery: tensors, devices, the CUDA runtime and JIT, variants and the harness.
//! Nothing here knows any op.

pub mod act;
pub mod borrow;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod dtype;
pub mod error;
pub mod fp8;
pub mod harness;
pub mod host;
pub mod layout;
pub mod philox;
pub mod rng;
pub mod tensor;
pub mod tune;
pub mod variant;
