//! The CUDA runtime and JIT: run for real where a GPU (or NVRTC) is present, and the clear
//! errors where it is not. Each test says what it skipped and why.

use ferrite::core::cuda::jit::{self, Program};
use ferrite::core::cuda::{self, KernelArgs};
use ferrite::ops::matmul::{matmul_into, MatmulOptions};
use ferrite::{Arch, DType, Device, Tensor};

fn gpu() -> Option<Device> {
    match cuda::availability() {
        Ok(_) => Some(Device::Cuda(0)),
        Err(e) => {
            eprintln!("skipped GPU part: {e}");
            None
        }
    }
}

const BROKEN: jit::KernelSource = jit::KernelSource {
    name: "test/broken",
    src: "#include \"ferrite.cuh\"\nextern \"C\" __global__ void broken(float* x) { x[0] = undefined_name; }\n",
};
const FILL: jit::KernelSource = jit::KernelSource {
    name: "test/fill",
    src: "#include \"ferrite.cuh\"\nextern \"C\" __global__ void fill(float* x, long long n, float v) {\n  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < n) x[i] = v * FE_SCALE;\n}\n",
};

#[test]
fn compile_errors_name_the_module_and_show_nvrtc_log() {
    if let Err(e) = cuda::nvrtc_available() {
        eprintln!("skipped: {e}");
        assert!(e.to_string().contains("NVRTC"));
        return;
    }
    let e = jit::compile(&Program::new(BROKEN), Arch::SM90)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("test/broken") && e.contains("sm_90a") && e.contains("undefined_name"),
        "{e}"
    );
}

#[test]
fn ptx_is_cached_on_disk_and_specialised_by_defines() {
    if let Err(e) = cuda::nvrtc_available() {
        eprintln!("skipped: {e}");
        return;
    }
    // A define value unique to this run, so the first compile cannot come from an older cache.
    let unique = format!("{}.0f", std::process::id() % 100_000 + 2);
    let p = Program::new(FILL).define("FE_SCALE", &unique);
    let first = jit::compile(&p, Arch::SM80).unwrap();
    assert!(!first.from_cache);
    assert!(first.ptx.contains(".entry fill("));
    let second = jit::compile(&p, Arch::SM80).unwrap();
    assert!(
        second.from_cache,
        "second compile must come from the disk cache"
    );
    assert_eq!(first.key, second.key);
    let other_arch = jit::compile(&p, Arch::SM90).unwrap();
    assert_ne!(other_arch.key, first.key);
    assert!(other_arch.ptx.contains("sm_90a"));
}

#[test]
fn tensors_round_trip_through_the_gpu() {
    let Some(dev) = gpu() else { return };
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::U8, DType::I32] {
        let h = Tensor::rand(&[127, 33], dtype, Device::Cpu, 7, -100.0, 100.0).unwrap();
        let d = h.to_device(dev).unwrap();
        assert_eq!(d.device(), dev);
        assert_eq!(d.to_bytes().unwrap(), h.to_bytes().unwrap(), "{dtype}");
        // Views gather correctly from device memory.
        let v = d.t().unwrap().narrow(0, 3, 5).unwrap();
        let hv = h.t().unwrap().narrow(0, 3, 5).unwrap();
        assert_eq!(v.to_bytes().unwrap(), hv.to_bytes().unwrap());
        d.poison(None).unwrap();
        if dtype.is_float() {
            assert!(d.to_f64_vec().unwrap().iter().all(|x| x.is_nan()));
        }
    }
}

#[test]
fn launches_run_and_launch_errors_name_the_kernel() {
    let Some(Device::Cuda(i)) = gpu() else { return };
    let dev = cuda::device(i).unwrap();
    let k = dev
        .kernel(&Program::new(FILL).define("FE_SCALE", "2.0f"), "fill")
        .unwrap();
    let t = Tensor::empty(&[1000], DType::F32, Device::Cuda(i)).unwrap();
    t.poison(None).unwrap();
    let mut args = KernelArgs::new();
    args.push(t.device_ptr().unwrap())
        .push(1000i64)
        .push(1.5f32);
    k.launch(dev.stream(), (4, 1, 1), (256, 1, 1), 0, &mut args)
        .unwrap();
    assert!(t.to_vec::<f32>().unwrap().iter().all(|&v| v == 3.0));
    // An impossible block shape is refused by the driver; the error names kernel and shape.
    let e = k
        .launch(dev.stream(), (1, 1, 1), (4096, 1, 1), 0, &mut args)
        .unwrap_err()
        .to_string();
    assert!(e.contains("fill") && e.contains("4096"), "{e}");
    let e = k
        .launch(dev.stream(), (0, 1, 1), (32, 1, 1), 0, &mut args)
        .unwrap_err()
        .to_string();
    assert!(e.contains("fill") && e.contains("grid"), "{e}");
    let r = k.resources().unwrap();
    assert!(r.registers > 0 && r.local_bytes == 0);
    assert!(k.occupancy(256, 0).unwrap() > 0.0);
}

#[test]
fn caller_stream_and_borrowed_output() {
    let Some(Device::Cuda(i)) = gpu() else { return };
    let dev = cuda::device(i).unwrap();
    let d = Device::Cuda(i);
    let a = Tensor::rand(&[65, 31], DType::F32, d, 1, -1.0, 1.0).unwrap();
    let b = Tensor::rand(&[31, 17], DType::F32, d, 2, -1.0, 1.0).unwrap();
    // Output memory owned by someone else (as a PyTorch tensor would be), used through a raw pointer.
    let owner = Tensor::empty(&[65, 17], DType::F32, d).unwrap();
    owner.poison(None).unwrap();
    dev.synchronize(dev.stream(), "poison").unwrap();
    // SAFETY: `owner` keeps the memory alive for the whole test.
    let out = unsafe {
        Tensor::from_device_ptr(
            dev.clone(),
            owner.device_ptr().unwrap(),
            &[65, 17],
            &[17, 1],
            DType::F32,
        )
        .unwrap()
    };
    let stream = dev.new_stream().unwrap();
    let opts = MatmulOptions {
        stream: Some(stream.clone()),
        ..Default::default()
    };
    matmul_into(&a, &b, &out, &opts).unwrap();
    stream.synchronize().unwrap();
    let cpu = ferrite::ops::matmul::matmul(
        &a.to_device(Device::Cpu).unwrap(),
        &b.to_device(Device::Cpu).unwrap(),
    )
    .unwrap();
    let (x, y) = (owner.to_vec::<f32>().unwrap(), cpu.to_vec::<f32>().unwrap());
    let err = x
        .iter()
        .zip(&y)
        .map(|(p, q)| (p - q).abs())
        .fold(0f32, f32::max);
    assert!(err < 1e-4, "max abs error {err}");
}

#[test]
fn mixed_devices_are_refused() {
    let Some(d) = gpu() else { return };
    let a = Tensor::rand(&[4, 4], DType::F32, d, 1, -1.0, 1.0).unwrap();
    let b = Tensor::rand(&[4, 4], DType::F32, Device::Cpu, 2, -1.0, 1.0).unwrap();
    let e = ferrite::ops::matmul::matmul(&a, &b)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`b`") && e.contains("cuda:0") && e.contains("on cpu"),
        "{e}"
    );
}

#[test]
fn no_gpu_and_bad_ordinals_are_clear_errors() {
    match cuda::availability() {
        Ok(n) => {
            let e = cuda::device(n + 3).unwrap_err().to_string();
            assert!(
                e.contains("ordinal") && e.contains(&format!("{}", n + 3)),
                "{e}"
            );
        }
        Err(e) => {
            let s = e.to_string();
            assert!(s.starts_with("CUDA unavailable:"), "{s}");
            let e = Tensor::rand(&[3], DType::F32, Device::Cuda(0), 1, 0.0, 1.0)
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("CUDA unavailable:"), "{e}");
        }
    }
}

#[test]
fn tensors_past_2_pow_31_elements_index_correctly() {
    let Some(Device::Cuda(i)) = gpu() else { return };
    let dev = cuda::device(i).unwrap();
    let (free, _) = dev.context().mem_get_info().unwrap();
    if free < (12usize << 30) {
        eprintln!("skipped: needs 12 GiB free, device has {}", free >> 30);
        return;
    }
    let d = Device::Cuda(i);
    // Copy: 2^31 + 21 bytes from a misaligned start; compare spans at both ends.
    let n = (1usize << 31) + 21;
    let src = Tensor::rand(&[n + 3], DType::U8, Device::Cpu, 5, 0.0, 255.0).unwrap();
    let src_d = src.to_device(d).unwrap().narrow(0, 3, n).unwrap();
    let dst = Tensor::empty(&[n], DType::U8, d).unwrap();
    dst.poison(None).unwrap();
    ferrite::ops::copy::copy_into(&src_d, &dst, &Default::default()).unwrap();
    for (start, len) in [(0, 4096), (n / 2 - 7, 4096), (n - 4096, 4096)] {
        let got = dst.narrow(0, start, len).unwrap().to_bytes().unwrap();
        let want = src.narrow(0, 3 + start, len).unwrap().to_bytes().unwrap();
        assert_eq!(got, want, "copy span at {start}");
    }
    drop((src_d, dst));
    // Matmul with more than 2^31 outputs (65537 × 32771, k = 3): rows at both ends checked.
    let (m, nn, k) = (65537usize, 32771usize, 3usize);
    let a = Tensor::rand(&[m, k], DType::BF16, d, 1, -1.0, 1.0).unwrap();
    let b = Tensor::rand(&[k, nn], DType::BF16, d, 2, -1.0, 1.0).unwrap();
    let c = Tensor::empty(&[m, nn], DType::BF16, d).unwrap();
    c.poison(None).unwrap();
    matmul_into(&a, &b, &c, &MatmulOptions::default()).unwrap();
    let bh = b.to_f64_vec().unwrap();
    for row in [0, 1, m / 2, m - 1] {
        let arow = a.narrow(0, row, 1).unwrap().to_f64_vec().unwrap();
        let got = c.narrow(0, row, 1).unwrap().to_f64_vec().unwrap();
        for j in [0, 1, nn / 3, nn - 1] {
            let want: f64 = (0..k).map(|p| arow[p] * bh[p * nn + j]).sum();
            assert!(
                (got[j] - want).abs() <= 1e-2 * want.abs().max(0.1),
                "c[{row}, {j}] = {} vs {want}",
                got[j]
            );
        }
    }
}
