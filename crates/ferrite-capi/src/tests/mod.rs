//! The C API called from Rust: bad input of every kind gives a status and a message naming the
//! argument (never a crash), the CPU path gives what ferrite's Rust API gives on the same data,
//! and the checked-in header is what cbindgen makes of this crate. This module holds the helpers
//! the test modules share.

use crate::*;
use ferrite::{DType, Tensor};
use std::ffi::CStr;
use std::ptr::{null, null_mut};

mod adamw_moe;
mod attention_decode;
mod bad_input;
mod cross_entropy;
mod cuda;
mod header;
mod linear_norm_softmax;
mod matmul;

/// A host buffer with its descriptor's shape and strides, kept alive for the descriptor.
struct Buf<T> {
    v: Vec<T>,
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    dtype: FerriteDtype,
}

impl<T: Copy> Buf<T> {
    fn new(v: Vec<T>, shape: &[i64], dtype: FerriteDtype) -> Self {
        Buf {
            v,
            shape: shape.to_vec(),
            strides: None,
            dtype,
        }
    }
    fn strided(mut self, strides: &[i64]) -> Self {
        self.strides = Some(strides.to_vec());
        self
    }
    /// The descriptor (valid while `self` lives and is not resized).
    fn t(&mut self) -> FerriteTensor {
        FerriteTensor {
            data: self.v.as_mut_ptr().cast(),
            shape: self.shape.as_ptr(),
            strides: self.strides.as_ref().map_or(null(), |s| s.as_ptr()),
            ndim: self.shape.len() as i32,
            dtype: self.dtype,
        }
    }
}

fn f32s(v: Vec<f32>, shape: &[i64]) -> Buf<f32> {
    Buf::new(v, shape, FERRITE_DTYPE_F32)
}

fn zeros(shape: &[i64]) -> Buf<f32> {
    let n = shape.iter().product::<i64>() as usize;
    f32s(vec![0.0; n], shape)
}

/// Deterministic values in [-1, 1).
fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn cpu() -> FerriteDevice {
    ferrite_device_cpu()
}

fn last_error() -> String {
    // SAFETY: ferrite_last_error never returns NULL and its string lives until the next call on
    // this thread.
    unsafe { CStr::from_ptr(ferrite_last_error()) }
        .to_str()
        .unwrap()
        .to_string()
}

/// Asserts `status` and that the message names every piece of `needles`.
#[track_caller]
fn expect_err(status: FerriteStatus, want: FerriteStatus, needles: &[&str]) -> String {
    let msg = last_error();
    assert_eq!(status, want, "{msg}");
    for n in needles {
        assert!(msg.contains(n), "`{n}` not in: {msg}");
    }
    msg
}

/// A matmul of 2×3 by 3×2 whose `a` descriptor is `a` (b and out are fine).
fn matmul_with_a(a: &FerriteTensor) -> FerriteStatus {
    let mut b = f32s(rand(6, 2), &[3, 2]);
    let mut out = zeros(&[2, 2]);
    // SAFETY: b and out are live buffers; `a` is the descriptor under test.
    unsafe { ferrite_matmul(cpu(), a, &b.t(), &out.t(), 1.0, 0.0, false) }
}

fn ref_tensor(b: &Buf<f32>) -> Tensor {
    let shape: Vec<usize> = b.shape.iter().map(|&s| s as usize).collect();
    Tensor::from_vec(b.v.clone(), &shape).unwrap()
}
