//! The CUDA path (the GPU suite runs these: `--ignored gpu_`).

use super::*;

/// A descriptor of a ferrite CUDA tensor (contiguous).
struct DevDesc {
    shape: Vec<i64>,
    ptr: u64,
    dtype: FerriteDtype,
}

impl DevDesc {
    fn of(t: &Tensor) -> Self {
        DevDesc {
            shape: t.shape().iter().map(|&s| s as i64).collect(),
            ptr: t.device_ptr().unwrap(),
            dtype: match t.dtype() {
                DType::F32 => FERRITE_DTYPE_F32,
                DType::BF16 => FERRITE_DTYPE_BF16,
                other => panic!("{other}"),
            },
        }
    }
    fn t(&self) -> FerriteTensor {
        FerriteTensor {
            data: self.ptr as *mut _,
            shape: self.shape.as_ptr(),
            strides: null(),
            ndim: self.shape.len() as i32,
            dtype: self.dtype,
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_device_pointers_streams_and_contexts() {
    use cudarc::driver::sys;
    use ferrite::core::cuda;
    let dev = cuda::device(0).unwrap();
    let d = ferrite::Device::Cuda(0);
    let a = Tensor::rand(&[37, 64], DType::F32, d, 1, -1.0, 1.0).unwrap();
    let b = Tensor::rand(&[64, 40], DType::F32, d, 2, -1.0, 1.0).unwrap();
    let want = ferrite::ops::matmul::matmul(&a, &b)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let (da, db) = (DevDesc::of(&a), DevDesc::of(&b));
    // On a stream of ferrite's own (the primary context), and on the legacy default stream.
    let stream = dev.new_stream().unwrap();
    for raw in [stream.cu_stream() as *mut std::ffi::c_void, null_mut()] {
        let out = Tensor::empty(&[37, 40], DType::F32, d).unwrap();
        let dout = DevDesc::of(&out);
        dev.synchronize(dev.stream(), "allocation").unwrap();
        // SAFETY: live device tensors of cuda:0.
        let s = unsafe {
            ferrite_matmul(
                ferrite_device_cuda(0, raw),
                &da.t(),
                &db.t(),
                &dout.t(),
                1.0,
                0.0,
                false,
            )
        };
        assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
        stream.synchronize().unwrap();
        dev.context().synchronize().unwrap();
        assert_eq!(out.to_vec::<f32>().unwrap(), want);
    }
    let out = Tensor::empty(&[37, 40], DType::F32, d).unwrap();
    let dout = DevDesc::of(&out);
    let call = |a: &FerriteTensor, dev: FerriteDevice| {
        // SAFETY: the descriptors' memory is checked by the call before use.
        unsafe { ferrite_matmul(dev, a, &db.t(), &dout.t(), 1.0, 0.0, false) }
    };
    let cuda0 = ferrite_device_cuda(0, null_mut());
    // Host memory on the CUDA path.
    let host = vec![0f32; 37 * 64];
    let mut t = da.t();
    t.data = host.as_ptr() as *mut _;
    expect_err(
        call(&t, cuda0),
        FerriteStatus::InvalidArgument,
        &["`a`", "CUDA does not know"],
    );
    // A view far larger than its allocation.
    let mut big = DevDesc::of(&a);
    big.shape = vec![1 << 22, 64];
    expect_err(
        call(&big.t(), cuda0),
        FerriteStatus::InvalidArgument,
        &["`a`", "allocation"],
    );
    // A device index past the last.
    let n = cuda::availability().unwrap() as i32;
    expect_err(
        call(&da.t(), ferrite_device_cuda(n, null_mut())),
        FerriteStatus::InvalidArgument,
        &["`device.index`"],
    );
    // Another context on the same device, current on this thread: ferrite runs in the primary
    // context and gives the thread its context back; a stream of that context is refused.
    let mut ctx: sys::CUcontext = null_mut();
    let mut other: sys::CUstream = null_mut();
    // SAFETY: out-pointers valid; cuCtxCreate makes the new context current on this thread; it
    // and its stream are destroyed below.
    unsafe {
        assert_eq!(
            sys::cuCtxCreate_v4(&mut ctx, null_mut(), 0, dev.context().cu_device()),
            sys::CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            sys::cuStreamCreate(&mut other, 0),
            sys::CUresult::CUDA_SUCCESS
        );
    }
    let current = || {
        let mut c: sys::CUcontext = null_mut();
        // SAFETY: a valid out-pointer.
        unsafe { sys::cuCtxGetCurrent(&mut c) };
        c
    };
    assert_eq!(call(&da.t(), cuda0), FerriteStatus::Ok, "{}", last_error());
    assert_eq!(current(), ctx, "the caller's context is current again");
    expect_err(
        call(&da.t(), ferrite_device_cuda(0, other as *mut _)),
        FerriteStatus::InvalidArgument,
        &["`device.stream`", "another context"],
    );
    assert_eq!(current(), ctx);
    // SAFETY: the stream and context created above, no longer used.
    unsafe {
        sys::cuStreamDestroy_v2(other);
        let mut popped: sys::CUcontext = null_mut();
        sys::cuCtxPopCurrent_v2(&mut popped);
        sys::cuCtxDestroy_v2(ctx);
    }
    // Still fine afterwards: bf16 attention on the tensor-core path.
    let shape = [2usize, 17, 4, 64];
    let q = Tensor::rand(&shape, DType::BF16, d, 3, -1.0, 1.0).unwrap();
    let k = Tensor::rand(&shape, DType::BF16, d, 4, -1.0, 1.0).unwrap();
    let v = Tensor::rand(&shape, DType::BF16, d, 5, -1.0, 1.0).unwrap();
    let o = Tensor::empty(&shape, DType::BF16, d).unwrap();
    let lse = Tensor::empty(&[2, 4, 17], DType::F32, d).unwrap();
    let (dq, dk, dv, dov, dl) = (
        DevDesc::of(&q),
        DevDesc::of(&k),
        DevDesc::of(&v),
        DevDesc::of(&o),
        DevDesc {
            shape: vec![2, 4, 17],
            ptr: lse.device_ptr().unwrap(),
            dtype: FERRITE_DTYPE_F32,
        },
    );
    dev.synchronize(dev.stream(), "inputs").unwrap();
    // SAFETY: live device tensors of cuda:0.
    let s = unsafe {
        ferrite_attention_forward(
            cuda0,
            &dq.t(),
            &dk.t(),
            &dv.t(),
            &dov.t(),
            &dl.t(),
            null(),
            null(),
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    dev.context().synchronize().unwrap();
    let (wo, _) = ferrite::ops::attention::attention(&q, &k, &v, &Default::default()).unwrap();
    assert_eq!(o.to_f32_vec().unwrap(), wo.to_f32_vec().unwrap());
}
