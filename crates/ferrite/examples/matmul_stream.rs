//! A bf16 matmul on a CUDA stream the caller created — how a framework hands ferrite its own
//! stream — into an output buffer the caller owns, B read through a transposed view (a linear
//! layer's `[out, in]` weight). Where CUDA cannot be used the program says why and runs the same
//! product on the CPU in f32.
//!
//! ```sh
//! cargo run --release -p ferrite --example matmul_stream
//! ```

use ferrite::core::cuda;
use ferrite::ops::matmul::{matmul_into, MatmulOptions};
use ferrite::{DType, Device, Result, Tensor};
use std::time::Instant;

const M: usize = 1024;
const N: usize = 1024;
const K: usize = 512;
const REPS: usize = 10;

fn main() -> Result<()> {
    match cuda::availability() {
        Ok(_) => on_gpu(),
        Err(why) => {
            println!("{why}; running the CPU path (f32) instead");
            on_cpu()
        }
    }
}

fn on_gpu() -> Result<()> {
    let dev = cuda::device(0)?;
    let d = Device::Cuda(0);
    let a = Tensor::rand(&[M, K], DType::BF16, d, 1, -1.0, 1.0)?;
    let w = Tensor::rand(&[N, K], DType::BF16, d, 2, -1.0, 1.0)?;
    // The inputs were made on ferrite's own stream: the caller's stream must not start before
    // they exist (two streams are ordered by their owner, as with two PyTorch streams).
    dev.synchronize(dev.stream(), "creating the inputs")?;

    let stream = dev.new_stream()?;
    let c = Tensor::empty_on(&[M, N], DType::BF16, &dev, &stream)?;
    let opts = MatmulOptions {
        stream: Some(stream.clone()),
        ..Default::default()
    };
    matmul_into(&a, &w.t()?, &c, &opts)?; // first call: compiles (or loads) the kernel
    dev.synchronize(&stream, "matmul warm-up")?;
    let t = Instant::now();
    for _ in 0..REPS {
        matmul_into(&a, &w.t()?, &c, &opts)?;
    }
    dev.synchronize(&stream, "matmul")?;
    report(&dev.props().name, t.elapsed().as_secs_f64() / REPS as f64);
    // to_f32_vec copies on ferrite's stream; the product was finished on ours above.
    check(&a.to_f32_vec()?, &w.to_f32_vec()?, &c.to_f32_vec()?, 2e-2)
}

fn on_cpu() -> Result<()> {
    let d = Device::Cpu;
    let a = Tensor::rand(&[M, K], DType::F32, d, 1, -1.0, 1.0)?;
    let w = Tensor::rand(&[N, K], DType::F32, d, 2, -1.0, 1.0)?;
    let c = Tensor::empty(&[M, N], DType::F32, d)?;
    let opts = MatmulOptions::default();
    matmul_into(&a, &w.t()?, &c, &opts)?;
    let t = Instant::now();
    for _ in 0..REPS {
        matmul_into(&a, &w.t()?, &c, &opts)?;
    }
    report("cpu", t.elapsed().as_secs_f64() / REPS as f64);
    check(&a.to_f32_vec()?, &w.to_f32_vec()?, &c.to_f32_vec()?, 1e-5)
}

fn report(device: &str, secs: f64) {
    let gflops = 2.0 * (M * N * K) as f64 / secs / 1e9;
    println!(
        "{M}×{N}×{K} on {device}: {:.3} ms per call, {gflops:.1} GFLOP/s",
        secs * 1e3
    );
}

/// Compares a sample of outputs with an f64 dot product of the (rounded) inputs.
fn check(a: &[f32], w: &[f32], c: &[f32], tol: f64) -> Result<()> {
    let mut worst = 0f64;
    for s in 0..64 {
        let (i, j) = ((s * 131) % M, (s * 197) % N);
        let want: f64 = (0..K)
            .map(|p| a[i * K + p] as f64 * w[j * K + p] as f64)
            .sum();
        worst = worst.max((c[i * N + j] as f64 - want).abs() / (K as f64).sqrt());
    }
    println!("largest error on 64 sampled outputs: {worst:.2e} (relative to √k)");
    if worst > tol {
        return Err(ferrite::Error::Other(format!(
            "matmul_stream: error {worst:.2e} above {tol:.0e}"
        )));
    }
    Ok(())
}
