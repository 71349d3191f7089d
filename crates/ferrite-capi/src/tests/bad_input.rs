//! Bad input of every kind (NULL pointers, negative and overflowing sizes, unknown codes,
//! misaligned pointers, device selectors) gives a status and a message naming the argument;
//! errors carry the Rust text, panics are caught; the version, the status names and the dtype
//! codes.

use super::*;

#[test]
fn null_pointers_are_refused() {
    let mut b = f32s(rand(6, 2), &[3, 2]);
    let mut out = zeros(&[2, 2]);
    // SAFETY: NULL descriptors are refused before anything is read.
    let s = unsafe { ferrite_matmul(cpu(), null(), &b.t(), &out.t(), 1.0, 0.0, false) };
    expect_err(
        s,
        FerriteStatus::InvalidArgument,
        &["ferrite_matmul", "`a`", "null pointer"],
    );
    // A null data pointer with elements to read.
    let mut a = f32s(rand(6, 1), &[2, 3]);
    let mut d = a.t();
    d.data = null_mut();
    let s = matmul_with_a(&d);
    expect_err(
        s,
        FerriteStatus::InvalidArgument,
        &["`a`", "non-null data pointer"],
    );
    // A null shape with ndim > 0.
    let mut d = a.t();
    d.shape = null();
    expect_err(
        matmul_with_a(&d),
        FerriteStatus::InvalidArgument,
        &["`a`", "`shape`"],
    );
    // An empty tensor may have a null data pointer: the error is then the op's own (shapes).
    let mut e = f32s(vec![], &[0, 3]);
    let mut d = e.t();
    d.data = null_mut();
    let msg = expect_err(
        matmul_with_a(&d),
        FerriteStatus::InvalidArgument,
        &["matmul", "out"],
    );
    assert!(!msg.contains("null"), "{msg}");
    // Null options / hyper / count pointers.
    // SAFETY: a NULL count is refused before it is written.
    let s = unsafe { ferrite_cuda_device_count(null_mut()) };
    expect_err(s, FerriteStatus::InvalidArgument, &["`count`"]);
    // SAFETY: a NULL hyper is refused before the list is read.
    let s = unsafe { ferrite_adamw_step(cpu(), null(), 0, null()) };
    expect_err(
        s,
        FerriteStatus::InvalidArgument,
        &["ferrite_adamw_step", "`hyper`"],
    );
    let h = ferrite_adamw_hyper_default();
    // SAFETY: a NULL list with a positive count is refused before it is read.
    let s = unsafe { ferrite_adamw_step(cpu(), null(), 3, &h) };
    expect_err(s, FerriteStatus::InvalidArgument, &["`tensors`"]);
    // SAFETY: a NULL options pointer is refused for the MoE layer (top_k has no safe default).
    let mut x = zeros(&[2, 4]);
    let s = unsafe {
        ferrite_moe_forward(
            cpu(),
            &x.t(),
            &x.t(),
            &x.t(),
            &x.t(),
            &x.t(),
            null(),
            null(),
        )
    };
    expect_err(s, FerriteStatus::InvalidArgument, &["`options`"]);
    // NULL for an optional output is fine: softmax has none, so use rms_norm's rstd.
    let mut x = f32s(rand(8, 3), &[2, 4]);
    let mut y = zeros(&[2, 4]);
    // SAFETY: live buffers; NULL optional arguments.
    let s = unsafe {
        ferrite_rms_norm_forward(cpu(), &x.t(), null(), null(), &y.t(), null(), null(), 1e-5)
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
}

#[test]
fn negative_and_overflowing_sizes_are_refused() {
    let mut a = f32s(rand(6, 1), &[2, 3]);
    a.shape = vec![2, -3];
    expect_err(
        matmul_with_a(&a.t()),
        FerriteStatus::InvalidArgument,
        &["ferrite_matmul", "`a`", "sizes ≥ 0", "-3"],
    );
    let mut a = f32s(rand(6, 1), &[2, 3]).strided(&[3, -1]);
    expect_err(
        matmul_with_a(&a.t()),
        FerriteStatus::InvalidArgument,
        &["`a`", "strides ≥ 0"],
    );
    // Element count past 2^64, span past 2^64, bytes past isize::MAX: refused, never wrapped.
    for (shape, strides) in [
        (vec![1i64 << 40, 1 << 40], None),
        (vec![1i64 << 20, 3], Some(vec![1i64 << 62, 1])),
        (vec![1i64 << 62], None),
        (vec![i64::MAX, 2], None),
    ] {
        let mut a = f32s(rand(6, 1), &[2, 3]);
        a.shape = shape.clone();
        a.strides = strides;
        expect_err(
            matmul_with_a(&a.t()),
            FerriteStatus::InvalidArgument,
            &["`a`", "address space"],
        );
    }
    // A span that fits in isize but runs past the end of the address space from its pointer.
    let mut a = f32s(rand(6, 1), &[2, 3]);
    let mut d = a.t();
    d.data = (u64::MAX - 15) as *mut _;
    expect_err(
        matmul_with_a(&d),
        FerriteStatus::InvalidArgument,
        &["`a`", "address space"],
    );
    // ndim out of range.
    for ndim in [-1, 9, i32::MAX] {
        let mut d = a.t();
        d.ndim = ndim;
        expect_err(
            matmul_with_a(&d),
            FerriteStatus::InvalidArgument,
            &["`a`", "ndim"],
        );
    }
    // Negative counts and sizes in options.
    let h = ferrite_adamw_hyper_default();
    // SAFETY: a negative count is refused before the list is read.
    let s = unsafe { ferrite_adamw_step(cpu(), null(), -1, &h) };
    expect_err(s, FerriteStatus::InvalidArgument, &["`count`"]);
    let mut vl_q = Buf::new(vec![0i32, 2], &[2], FERRITE_DTYPE_I32);
    let mut vl_k = Buf::new(vec![0i32, 2], &[2], FERRITE_DTYPE_I32);
    let (cq, ck) = (vl_q.t(), vl_k.t());
    let vl = FerriteVarlen {
        cu_seqlens_q: &cq,
        cu_seqlens_k: &ck,
        max_seqlen_q: -5,
        max_seqlen_k: 2,
    };
    let mut q = zeros(&[2, 1, 4]);
    let mut lse = zeros(&[1, 2]);
    // SAFETY: live buffers; the negative max_seqlen_q is refused.
    let s = unsafe {
        ferrite_attention_forward(cpu(), &q.t(), &q.t(), &q.t(), &q.t(), &lse.t(), &vl, null())
    };
    expect_err(
        s,
        FerriteStatus::InvalidArgument,
        &["`varlen.max_seqlen_q`"],
    );
}

#[test]
fn unknown_codes_are_refused() {
    for code in [-1, 8, 42, i32::MIN] {
        let mut a = f32s(rand(6, 1), &[2, 3]);
        a.dtype = FerriteDtype(code);
        expect_err(
            matmul_with_a(&a.t()),
            FerriteStatus::InvalidArgument,
            &["ferrite_matmul", "`a`", "FERRITE_DTYPE_", &code.to_string()],
        );
    }
    // A known dtype the op does not take is the op's own error.
    let mut a = Buf::new(vec![0i32; 6], &[2, 3], FERRITE_DTYPE_I32);
    expect_err(
        matmul_with_a(&a.t()),
        FerriteStatus::InvalidArgument,
        &["matmul", "dtype"],
    );
    let mut x = f32s(rand(8, 1), &[2, 4]);
    let mut w = f32s(rand(12, 2), &[3, 4]);
    let mut y = zeros(&[2, 3]);
    // SAFETY: live buffers; the activation code is refused.
    let s = unsafe {
        ferrite_linear_forward(
            cpu(),
            &x.t(),
            &w.t(),
            null(),
            null(),
            &y.t(),
            null(),
            FerriteActivation(99),
            false,
        )
    };
    expect_err(
        s,
        FerriteStatus::InvalidArgument,
        &["ferrite_linear_forward", "`activation`", "99"],
    );
    // Device selector: kind, index, and a stream given to the CPU.
    for (dev, arg) in [
        (
            FerriteDevice {
                kind: FerriteDeviceKind(7),
                index: 0,
                stream: null_mut(),
            },
            "`device.kind`",
        ),
        (ferrite_device_cuda(-1, null_mut()), "`device.index`"),
        (
            FerriteDevice {
                kind: FERRITE_DEVICE_CPU,
                index: 0,
                stream: 0x1000 as *mut _,
            },
            "`device.stream`",
        ),
    ] {
        // SAFETY: the device selector is refused before any descriptor is read.
        let s = unsafe { ferrite_softmax_forward(dev, &x.t(), &x.t(), 1.0) };
        expect_err(s, FerriteStatus::InvalidArgument, &[arg]);
    }
    // Enum codes inside option structs.
    let mut o = ferrite_cross_entropy_options_default();
    o.reduction = FerriteReduction(5);
    let mut t = Buf::new(vec![0i64, 1], &[2], FERRITE_DTYPE_I64);
    let mut rows = zeros(&[2]);
    // SAFETY: live buffers; the reduction code is refused.
    let s = unsafe { ferrite_cross_entropy(cpu(), &x.t(), &t.t(), &rows.t(), null(), null(), &o) };
    expect_err(s, FerriteStatus::InvalidArgument, &["`options.reduction`"]);
    let mut o = ferrite_attention_options_default();
    o.layout = FerriteAttentionLayout(3);
    let mut q = zeros(&[1, 2, 1, 4]);
    let mut lse = zeros(&[1, 1, 2]);
    // SAFETY: live buffers; the layout code is refused.
    let s = unsafe {
        ferrite_attention_forward(cpu(), &q.t(), &q.t(), &q.t(), &q.t(), &lse.t(), null(), &o)
    };
    expect_err(s, FerriteStatus::InvalidArgument, &["`options.layout`"]);
    let mut o = ferrite_moe_options_default();
    o.score = FerriteMoeScore(9);
    // SAFETY: live buffers; the score code is refused.
    let s =
        unsafe { ferrite_moe_forward(cpu(), &x.t(), &x.t(), &x.t(), &x.t(), &x.t(), null(), &o) };
    expect_err(s, FerriteStatus::InvalidArgument, &["`options.score`"]);
}

#[test]
fn misaligned_pointers_are_refused() {
    // f32 data at an address 2 bytes past an aligned one.
    let mut raw = vec![0u32; 8];
    let mut a = f32s(vec![], &[2, 3]);
    let mut d = a.t();
    d.data = (raw.as_mut_ptr() as usize + 2) as *mut _;
    expect_err(
        matmul_with_a(&d),
        FerriteStatus::InvalidArgument,
        &["ferrite_matmul", "`a`", "aligned to 4 bytes (f32)"],
    );
    // i64 targets at 4-byte alignment.
    let mut x = f32s(rand(8, 1), &[2, 4]);
    let mut rows = zeros(&[2]);
    let mut t = Buf::new(vec![0i64], &[2], FERRITE_DTYPE_I64);
    let mut raw64 = vec![0u64; 4];
    let mut d = t.t();
    d.data = (raw64.as_mut_ptr() as usize + 4) as *mut _;
    // SAFETY: live buffers; the misaligned targets are refused before being read.
    let s = unsafe { ferrite_cross_entropy(cpu(), &x.t(), &d, &rows.t(), null(), null(), null()) };
    expect_err(
        s,
        FerriteStatus::InvalidArgument,
        &["`targets`", "aligned to 8 bytes (i64)"],
    );
    // A misaligned descriptor pointer and a misaligned shape array.
    let mut bytes = vec![0u8; std::mem::size_of::<FerriteTensor>() + 16];
    let base = bytes.as_mut_ptr() as usize;
    let odd = (base + 8 - base % 8 + 1) as *const FerriteTensor;
    let mut b = f32s(rand(6, 2), &[3, 2]);
    let mut out = zeros(&[2, 2]);
    // SAFETY: the misaligned descriptor pointer is refused before it is read.
    let s = unsafe { ferrite_matmul(cpu(), odd, &b.t(), &out.t(), 1.0, 0.0, false) };
    expect_err(
        s,
        FerriteStatus::InvalidArgument,
        &["`a`", "aligned FerriteTensor"],
    );
    let shape = [0u8; 24];
    let mut a = f32s(rand(6, 1), &[2, 3]);
    let mut d = a.t();
    d.shape = (shape.as_ptr() as usize | 1) as *const i64;
    expect_err(
        matmul_with_a(&d),
        FerriteStatus::InvalidArgument,
        &["`a`", "8-byte aligned"],
    );
    // f16 data at 2-byte alignment is fine (copied in: ferrite's CPU code wants 8).
    let mut h = Buf::new(vec![0u16; 9], &[8], FERRITE_DTYPE_F16);
    let mut hy = Buf::new(vec![0u16; 9], &[8], FERRITE_DTYPE_F16);
    let (mut hd, mut yd) = (h.t(), hy.t());
    hd.data = (h.v.as_mut_ptr() as usize + 2) as *mut _;
    yd.data = (hy.v.as_mut_ptr() as usize + 2) as *mut _;
    // SAFETY: both views lie inside their 9-element buffers.
    let s = unsafe { ferrite_softmax_forward(cpu(), &hd, &yd, 1.0) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    // softmax of zeros over 8 columns: 1/8 each (0x3000 in f16).
    assert_eq!(&hy.v[1..], &[0x3000u16; 8]);
    assert_eq!(hy.v[0], 0);
}

#[test]
fn cuda_requests_without_a_usable_device() {
    let mut x = f32s(rand(8, 1), &[2, 4]);
    let mut y = zeros(&[2, 4]);
    // A device index no machine has: unavailable here, an invalid index on a GPU machine.
    // SAFETY: the device selector is checked before any descriptor is read.
    let s = unsafe {
        ferrite_softmax_forward(ferrite_device_cuda(1000, null_mut()), &x.t(), &y.t(), 1.0)
    };
    let msg = last_error();
    match s {
        FerriteStatus::CudaUnavailable => assert!(msg.contains("ferrite_softmax_forward"), "{msg}"),
        FerriteStatus::InvalidArgument => assert!(msg.contains("`device.index`"), "{msg}"),
        other => panic!("{other:?}: {msg}"),
    }
    let mut n = -1;
    // SAFETY: `n` is a live int32.
    let s = unsafe { ferrite_cuda_device_count(&mut n) };
    match s {
        FerriteStatus::Ok => assert!(n > 0),
        FerriteStatus::CudaUnavailable => assert_eq!(n, 0),
        other => panic!("{other:?}: {}", last_error()),
    }
}

#[test]
fn errors_carry_the_rust_text_and_panics_are_caught() {
    // A shape mismatch: the message is the Rust error's, word for word.
    let mut a = f32s(rand(6, 1), &[2, 3]);
    let mut b = f32s(rand(8, 2), &[4, 2]);
    let mut out = zeros(&[2, 2]);
    let rust = ferrite::ops::matmul::matmul_into(
        &ref_tensor(&a),
        &ref_tensor(&b),
        &ref_tensor(&out),
        &Default::default(),
    )
    .unwrap_err()
    .to_string();
    // SAFETY: live buffers.
    let s = unsafe { ferrite_matmul(cpu(), &a.t(), &b.t(), &out.t(), 1.0, 0.0, false) };
    let msg = expect_err(s, FerriteStatus::InvalidArgument, &["`b`"]);
    assert_eq!(msg, rust);
    // A CPU dtype without an implementation is `unsupported`.
    let mut a = Buf::new(vec![0u16; 6], &[2, 3], FERRITE_DTYPE_BF16);
    let mut b = Buf::new(vec![0u16; 6], &[3, 2], FERRITE_DTYPE_BF16);
    let mut out = Buf::new(vec![0u16; 4], &[2, 2], FERRITE_DTYPE_BF16);
    // SAFETY: live buffers.
    let s = unsafe { ferrite_matmul(cpu(), &a.t(), &b.t(), &out.t(), 1.0, 0.0, false) };
    expect_err(s, FerriteStatus::Unsupported, &["matmul"]);
    // A success clears the message.
    let mut x = f32s(rand(8, 1), &[2, 4]);
    let mut y = zeros(&[2, 4]);
    // SAFETY: live buffers.
    let s = unsafe { ferrite_softmax_forward(cpu(), &x.t(), &y.t(), 1.0) };
    assert_eq!(s, FerriteStatus::Ok);
    assert_eq!(last_error(), "");
    // A panic inside an entry point's body becomes `internal`, with its message.
    let s = crate::boundary::call("ferrite_test", || panic!("boom {}", 42));
    expect_err(
        s,
        FerriteStatus::Internal,
        &["ferrite_test", "panic", "boom 42"],
    );
    // Messages are per thread.
    let other = std::thread::spawn(last_error).join().unwrap();
    assert_eq!(other, "");
    assert!(last_error().contains("boom"));
}

#[test]
fn version_and_names() {
    // SAFETY: static NUL-terminated strings.
    let v = unsafe { CStr::from_ptr(ferrite_version()) }
        .to_str()
        .unwrap();
    assert_eq!(v, env!("CARGO_PKG_VERSION"));
    let parts: Vec<i32> = v.split('.').map(|p| p.parse().unwrap()).collect();
    assert_eq!(
        parts,
        [
            FERRITE_VERSION_MAJOR,
            FERRITE_VERSION_MINOR,
            FERRITE_VERSION_PATCH
        ],
        "update FERRITE_VERSION_* in src/lib.rs (and bless the header)"
    );
    assert_eq!(
        ferrite_version_number(),
        parts[0] * 10000 + parts[1] * 100 + parts[2]
    );
    for (code, name) in [
        (0, "FERRITE_STATUS_OK"),
        (1, "FERRITE_STATUS_INVALID_ARGUMENT"),
        (6, "FERRITE_STATUS_INTERNAL"),
        (77, "unknown status"),
    ] {
        // SAFETY: static NUL-terminated strings.
        assert_eq!(
            unsafe { CStr::from_ptr(ferrite_status_name(code)) }.to_str(),
            Ok(name)
        );
    }
}

#[test]
fn dtype_codes_map_to_ferrite_dtypes() {
    for (code, dt) in [
        (FERRITE_DTYPE_F32, DType::F32),
        (FERRITE_DTYPE_F16, DType::F16),
        (FERRITE_DTYPE_BF16, DType::BF16),
        (FERRITE_DTYPE_I32, DType::I32),
        (FERRITE_DTYPE_I64, DType::I64),
        (FERRITE_DTYPE_U8, DType::U8),
        (FERRITE_DTYPE_U16, DType::U16),
        (FERRITE_DTYPE_U32, DType::U32),
    ] {
        assert_eq!(crate::operand::dtype_of(code), Some(dt));
    }
    assert_eq!(crate::operand::dtype_of(FerriteDtype(8)), None);
}
