//! # copy — dst = src, and the machine's memory-bandwidth ceiling
//!
//! A small family, but every memory-bound op is measured against it: `ferrite bench` starts by
//! timing the best copy to know what "% of bandwidth" means on this machine.
//! Variants: CPU `memcpy`; CUDA `naive` (a word per thread) → `vectorized` (16-byte accesses, several
//! in flight per thread); the peer is the driver's own `cuMemcpyDtoDAsync`.

use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::cuda::{device, CudaDevice, KernelArgs, Stream};
use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::bench::{relate, time_cpu, time_gpu, BenchRecord, Budget};
use crate::core::harness::check::rel_error;
use crate::core::harness::{
    BenchConfig, Ceilings, CheckConfig, CheckRecord, KernelSpec, OpFamily, Precision,
};
use crate::core::rng::Rng;
use crate::core::tensor::{describe, Tensor};
use crate::core::variant::{self, Backend, VariantInfo};
use crate::kernel_source;
use std::sync::Arc;

/// The family's name, as errors, the CLI and the tables spell it.
pub const OP: &str = "copy";
const SRC: KernelSource = kernel_source!("copy", "kernels/copy.cu");
const ANY: &[DType] = &[
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::I32,
    DType::U32,
    DType::U16,
    DType::U8,
    DType::I8,
    DType::F8E4M3,
    DType::F8E5M2,
];

/// The ladder, in order: each variant with what it supports and what it changes.
pub fn variants() -> Vec<VariantInfo> {
    vec![
        VariantInfo {
            name: "memcpy",
            backend: Backend::Cpu,
            dtypes: ANY,
            min_arch: None,
            constraints: "contiguous",
            summary: "the standard library's copy",
            rank: 1,
        },
        VariantInfo {
            name: "naive",
            backend: Backend::Cuda,
            dtypes: ANY,
            min_arch: Some(Arch::SM80),
            constraints: "contiguous",
            summary: "one 4-byte word per thread",
            rank: 1,
        },
        VariantInfo {
            name: "vectorized",
            backend: Backend::Cuda,
            dtypes: ANY,
            min_arch: Some(Arch::SM80),
            constraints: "contiguous",
            summary: "16-byte accesses, 4 in flight per thread, grid sized to the SMs",
            rank: 2,
        },
    ]
}

/// Options of one call. `Default`: best variant, the device's own stream.
#[derive(Clone, Debug, Default)]
pub struct CopyOptions {
    /// Run this variant by name; None picks the best that takes the request.
    pub variant: Option<String>,
    /// Stream to run on (GPU); the device's own stream when None.
    pub stream: Option<Stream>,
}

fn program() -> Program {
    Program::new(SRC).define("FE_UNROLL", 4)
}

/// Copies `bytes` from `src` to `dst` (device pointers) with a CUDA variant.
pub fn copy_device(
    dev: &Arc<CudaDevice>,
    variant: &str,
    dst: u64,
    src: u64,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let sms = dev.props().sm_count;
    match variant {
        "naive" if bytes.is_multiple_of(4) && dst.is_multiple_of(4) && src.is_multiple_of(4) => {
            let k = dev.kernel(&program(), "copy_naive")?;
            let words = (bytes / 4) as i64;
            let grid = (words as u64).div_ceil(256).min(u32::MAX as u64) as u32;
            let mut a = KernelArgs::new();
            a.push(dst).push(src).push(words);
            k.launch(stream, (grid, 1, 1), (256, 1, 1), 0, &mut a)
        }
        "naive" | "vectorized" => {
            // 16-byte-aligned body through the kernel, unaligned head/tail through the driver.
            let head = if dst % 16 == src % 16 {
                ((16 - dst % 16) % 16) as usize
            } else {
                bytes
            };
            let head = head.min(bytes);
            let body = (bytes - head) / 16 * 16;
            // SAFETY: dst/src address `bytes` bytes of device memory (caller's contract).
            unsafe { dev.dtod(dst, src, head, stream)? };
            if body > 0 {
                let k = dev.kernel(&program(), "copy_vectorized")?;
                let vecs = (body / 16) as i64;
                let grid = ((vecs as u64).div_ceil(256 * 4)).min(sms as u64 * 8).max(1) as u32;
                let mut a = KernelArgs::new();
                a.push(dst + head as u64).push(src + head as u64).push(vecs);
                k.launch(stream, (grid, 1, 1), (256, 1, 1), 0, &mut a)?;
            }
            let tail = bytes - head - body;
            // SAFETY: as above; the tail lies inside the same ranges.
            unsafe {
                dev.dtod(
                    dst + (head + body) as u64,
                    src + (head + body) as u64,
                    tail,
                    stream,
                )
            }
        }
        "driver" => {
            // SAFETY: as above.
            unsafe { dev.dtod(dst, src, bytes, stream) }
        }
        other => Err(Error::NoVariant {
            op: OP.into(),
            msg: format!("no CUDA variant named `{other}`"),
        }),
    }
}

/// dst = src for two contiguous tensors of one shape, dtype and device.
pub fn copy_into(src: &Tensor, dst: &Tensor, opts: &CopyOptions) -> Result<()> {
    if dst.device() != src.device() || dst.dtype() != src.dtype() || dst.shape() != src.shape() {
        return Err(Error::bad_arg(
            OP,
            "dst",
            format!("a tensor like src ({})", describe(src)),
            describe(dst),
        ));
    }
    for (t, n) in [(src, "src"), (dst, "dst")] {
        if !t.is_contiguous() {
            return Err(Error::bad_arg(OP, n, "a contiguous tensor", describe(t)));
        }
    }
    if dst.shares_storage(src) {
        return Err(Error::bad_arg(
            OP,
            "dst",
            "a buffer distinct from src",
            "a view of src",
        ));
    }
    let arch = crate::core::cuda::arch_of(src.device())?;
    let vs = variants();
    let v = variant::select(
        OP,
        &vs,
        opts.variant.as_deref(),
        Backend::of(src.device()),
        src.dtype(),
        arch,
        |_| None,
    )?;
    match src.device() {
        Device::Cpu => write_bytes(dst, &src.to_bytes()?),
        Device::Cuda(i) => {
            let dev = device(i)?;
            let stream = opts.stream.clone().unwrap_or_else(|| dev.stream().clone());
            copy_device(
                &dev,
                v.name,
                dst.device_ptr()?,
                src.device_ptr()?,
                src.nbytes(),
                &stream,
            )
        }
    }
}

fn write_bytes(dst: &Tensor, bytes: &[u8]) -> Result<()> {
    macro_rules! typed {
        ($t:ty) => {
            dst.with_cpu_mut::<$t, _>(|d| {
                bytemuck::cast_slice_mut::<$t, u8>(&mut d[..dst.numel()]).copy_from_slice(bytes)
            })
        };
    }
    match dst.dtype() {
        DType::F32 => typed!(f32),
        DType::F16 => typed!(half::f16),
        DType::BF16 => typed!(half::bf16),
        DType::I32 => typed!(i32),
        DType::U32 => typed!(u32),
        DType::U16 => typed!(u16),
        DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => typed!(u8),
        DType::I64 => typed!(i64),
    }
}

/// Measures the best device-to-device copy rate (GB/s, read + write) on `dev`.
pub fn gpu_bandwidth(dev: &Arc<CudaDevice>, bytes: usize) -> Result<f64> {
    let stream = dev.stream().clone();
    let a = dev.alloc(bytes, &stream)?;
    let b = dev.alloc(bytes, &stream)?;
    // SAFETY: fresh allocations of `bytes` each.
    unsafe { dev.memset(a.ptr(), 0x5A, bytes, &stream)? };
    let mut best = 0f64;
    for v in ["vectorized", "driver"] {
        let s = time_gpu(dev, &stream, Budget::gpu(), |_| {
            copy_device(dev, v, b.ptr(), a.ptr(), bytes, &stream)
        })?;
        best = best.max(2.0 * bytes as f64 / (s.median_ms * 1e-3) / 1e9);
    }
    Ok(best)
}

fn check_run(cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
    let mut rng = Rng::new(cfg.seed);
    for &dev in &cfg.devices {
        for v in variants()
            .iter()
            .filter(|v| v.backend == Backend::of(dev) && cfg.wants_variant(v.name))
        {
            for dtype in [DType::F32, DType::BF16, DType::U8]
                .into_iter()
                .filter(|d| cfg.wants_dtype(*d))
            {
                // (length, offset of the source view: misaligned starts take the head/tail path)
                for (n, off) in [
                    (1usize, 0usize),
                    (7, 0),
                    (127, 0),
                    (1000, 3),
                    (4097, 0),
                    (4097, 5),
                    (if cfg.quick { 65_537 } else { 1 << 22 }, 1),
                ] {
                    let res = (|| -> Result<f64> {
                        let src = Tensor::rand(&[n + off], dtype, dev, rng.next_u64(), 1.0, 200.0)?
                            .narrow(0, off, n)?;
                        let dst = Tensor::empty(&[n], dtype, dev)?;
                        dst.poison(None)?;
                        copy_into(
                            &src,
                            &dst,
                            &CopyOptions {
                                variant: Some(v.name.into()),
                                stream: None,
                            },
                        )?;
                        Ok(rel_error(&dst.to_f64_vec()?, &src.to_f64_vec()?))
                    })();
                    out.push(match res {
                        Ok(e) => CheckRecord::compared(
                            OP,
                            v.name,
                            dev,
                            dtype,
                            Precision::Exact,
                            format!("{n} +{off}"),
                            e,
                            String::new(),
                        ),
                        Err(e) => CheckRecord::errored(
                            OP,
                            v.name,
                            dev,
                            dtype,
                            format!("{n} +{off}"),
                            e.to_string(),
                        ),
                    });
                }
            }
        }
    }
    Ok(())
}

/// One buffer size per device, every variant and the driver's copy: representative scope runs
/// the same.
fn bench_run(
    cfg: &BenchConfig,
    ceilings: &Ceilings,
    progress: &mut dyn FnMut(&str),
    out: &mut Vec<BenchRecord>,
) -> Result<()> {
    for &d in &cfg.devices {
        let mut group = Vec::new();
        match d {
            Device::Cpu => {
                let bytes = if cfg.quick { 64 << 20 } else { 256 << 20 };
                let src = vec![0x5Au8; bytes];
                let mut dst = vec![0u8; bytes];
                progress("copy cpu memcpy");
                let s = time_cpu(Budget::cpu(), || {
                    dst.copy_from_slice(std::hint::black_box(&src));
                    std::hint::black_box(&mut dst);
                });
                let mut r = BenchRecord::new(
                    d,
                    &crate::core::harness::cpu_name(),
                    OP,
                    "memcpy",
                    DType::U8,
                    format!("{} MiB", bytes >> 20),
                    s,
                    0.0,
                    2.0 * bytes as f64,
                );
                r.config = "1 thread".into();
                group.push(r);
                relate(&mut group, "memcpy", None);
            }
            Device::Cuda(i) => {
                let dev = device(i)?;
                let stream = dev.stream().clone();
                let bytes: usize = if cfg.quick { 256 << 20 } else { 1 << 30 };
                let a = dev.alloc(bytes, &stream)?;
                let b = dev.alloc(bytes, &stream)?;
                // SAFETY: fresh allocations of `bytes` each.
                unsafe { dev.memset(a.ptr(), 0x5A, bytes, &stream)? };
                for v in ["naive", "vectorized", "driver"]
                    .into_iter()
                    .filter(|v| *v == "driver" || cfg.wants_variant(v))
                {
                    progress(&format!("copy {d} {v}"));
                    let s = time_gpu(&dev, &stream, Budget::gpu(), |_| {
                        copy_device(&dev, v, b.ptr(), a.ptr(), bytes, &stream)
                    })?;
                    let mut r = BenchRecord::new(
                        d,
                        &dev.props().name,
                        OP,
                        if v == "driver" { "cuMemcpyDtoD" } else { v },
                        DType::U8,
                        format!("{} MiB", bytes >> 20),
                        s,
                        0.0,
                        2.0 * bytes as f64,
                    );
                    r.is_peer = v == "driver";
                    if v != "driver" {
                        let k = dev.kernel(
                            &program(),
                            if v == "naive" {
                                "copy_naive"
                            } else {
                                "copy_vectorized"
                            },
                        )?;
                        r = r.with_kernel(&k, 256, 0)?;
                    }
                    group.push(r);
                }
                relate(
                    &mut group,
                    "naive",
                    ceilings.gpu_copy_gbps.map(|v| ("best copy", v, false)),
                );
            }
        }
        out.extend(group);
    }
    Ok(())
}

/// The family as the harness sees it (check, bench, kernels).
pub struct Copy;

impl OpFamily for Copy {
    fn name(&self) -> &'static str {
        OP
    }
    fn variants(&self) -> Vec<VariantInfo> {
        variants()
    }
    fn check(&self, cfg: &CheckConfig, out: &mut Vec<CheckRecord>) -> Result<()> {
        check_run(cfg, out)
    }
    fn bench(
        &self,
        cfg: &BenchConfig,
        ceilings: &Ceilings,
        progress: &mut dyn FnMut(&str),
        out: &mut Vec<BenchRecord>,
    ) -> Result<()> {
        bench_run(cfg, ceilings, progress, out)
    }
    fn bench_takes_size(&self) -> bool {
        false
    }
    fn kernels(&self) -> Vec<KernelSpec> {
        vec![KernelSpec {
            program: program(),
            functions: vec!["copy_naive".into(), "copy_vectorized".into()],
            min_arch: Arch::SM80,
        }]
    }
}
