//! Causal grouped-query attention, forward and backward, in flash-attn's layout `[B, S, H, D]`:
//! bf16 on a GPU (the `flash` kernels on sm_80, `hopper` on sm_90) or f32 on the CPU (`tiled`,
//! the online-softmax rung), the output checked against the CPU's `naive` rung, which
//! materialises the whole score matrix.
//!
//! ```sh
//! cargo run --release -p ferrite --example attention
//! ```

use ferrite::core::cuda;
use ferrite::ops::attention::{attention, attention_backward, AttentionOptions};
use ferrite::{DType, Device, Result, Tensor};
use std::time::Instant;

fn main() -> Result<()> {
    let (b, s, hq, hkv, d) = (2, 256, 8, 2, 64);
    let (device, dtype) = match cuda::availability() {
        Ok(_) => (Device::Cuda(0), DType::BF16),
        Err(why) => {
            println!("{why}; running on the CPU in f32");
            (Device::Cpu, DType::F32)
        }
    };
    let q = Tensor::rand(&[b, s, hq, d], dtype, device, 1, -1.0, 1.0)?;
    let k = Tensor::rand(&[b, s, hkv, d], dtype, device, 2, -1.0, 1.0)?;
    let v = Tensor::rand(&[b, s, hkv, d], dtype, device, 3, -1.0, 1.0)?;
    let dout = Tensor::rand(&[b, s, hq, d], dtype, device, 4, -1.0, 1.0)?;
    let opts = AttentionOptions {
        causal: true,
        ..Default::default()
    };

    let run = || -> Result<_> {
        let (o, lse) = attention(&q, &k, &v, &opts)?;
        let (dq, dk, dv) = attention_backward(&dout, &q, &k, &v, &o, &lse, &opts)?;
        Ok((o, dq, dk, dv))
    };
    run()?; // on a GPU the first call compiles the kernels (or loads them from the disk cache)
    let t = Instant::now();
    let (o, dq, dk, dv) = run()?;
    // Reading the results back waits for the GPU.
    let (o, dq) = (o.to_f32_vec()?, dq.to_f32_vec()?);
    println!(
        "B {b} S {s} Hq {hq} Hkv {hkv} D {d}, causal, {dtype} on {device}: forward + backward in \
         {:.2} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    println!(
        "dk {:?}, dv {:?}: summed over each kv head's query group",
        dk.shape(),
        dv.shape()
    );

    // The reference: the same inputs in f32 through the CPU's naive rung.
    let f32_cpu = |t: &Tensor| Tensor::from_vec(t.to_f32_vec()?, t.shape());
    let naive = AttentionOptions {
        variant: Some("naive".into()),
        ..opts.clone()
    };
    let (rq, rk, rv) = (f32_cpu(&q)?, f32_cpu(&k)?, f32_cpu(&v)?);
    let (ro, rlse) = attention(&rq, &rk, &rv, &naive)?;
    let (rdq, _, _) = attention_backward(&f32_cpu(&dout)?, &rq, &rk, &rv, &ro, &rlse, &naive)?;
    let (eo, edq) = (rel(&o, &ro.to_f32_vec()?), rel(&dq, &rdq.to_f32_vec()?));
    println!("relative error against the naive rung: o {eo:.2e}, dq {edq:.2e}");
    let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
    if eo > tol || edq > tol {
        return Err(ferrite::Error::Other(format!(
            "attention: error above {tol:.0e}"
        )));
    }
    Ok(())
}

/// ‖x − y‖ / ‖y‖.
fn rel(x: &[f32], y: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (a, b) in x.iter().zip(y) {
        num += (*a as f64 - *b as f64).powi(2);
        den += (*b as f64).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}
