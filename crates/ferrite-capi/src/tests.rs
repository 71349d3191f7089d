//! The C API called from Rust: bad input of every kind gives a status and a message naming the
//! argument (never a crash), the CPU path gives what ferrite's Rust API gives on the same data,
//! and the checked-in header is what cbindgen makes of this crate.

use crate::*;
use ferrite::{DType, Tensor};
use std::ffi::CStr;
use std::ptr::{null, null_mut};

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

// ---------------------------------------------------------------------------------------------
// bad input

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

// ---------------------------------------------------------------------------------------------
// the CPU path against ferrite's Rust API

#[test]
fn matmul_in_place_copies_and_strided_outputs() {
    let (m, k, n) = (5usize, 7usize, 3usize);
    let mut a = f32s(rand(m * k, 1), &[m as i64, k as i64]);
    let mut b = f32s(rand(k * n, 2), &[k as i64, n as i64]);
    let want = ferrite::ops::matmul::matmul(&ref_tensor(&a), &ref_tensor(&b))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    // Output rows 2 elements apart from each other's ends: the gaps must stay untouched.
    let ld = n + 2;
    let mut out = f32s(vec![9.0; m * ld], &[m as i64, n as i64]).strided(&[ld as i64, 1]);
    // SAFETY: live buffers.
    let s = unsafe { ferrite_matmul(cpu(), &a.t(), &b.t(), &out.t(), 1.0, 0.0, false) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    for r in 0..m {
        assert_eq!(&out.v[r * ld..r * ld + n], &want[r * n..r * n + n]);
        if r + 1 < m {
            assert_eq!(&out.v[r * ld + n..(r + 1) * ld], &[9.0, 9.0]);
        }
    }
    // The same operand twice (a·aᵀ through a transposed view): borrowed once, copied once.
    let mut at = f32s(a.v.clone(), &[k as i64, m as i64]).strided(&[1, k as i64]);
    let mut o2 = zeros(&[m as i64, m as i64]);
    let a_desc = a.t();
    let mut at_desc = at.t();
    at_desc.data = a_desc.data;
    // SAFETY: both descriptors view `a`'s live buffer.
    let s = unsafe { ferrite_matmul(cpu(), &a_desc, &at_desc, &o2.t(), 1.0, 0.0, false) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let want2 = ferrite::ops::matmul::matmul(&ref_tensor(&a), &ref_tensor(&a).t().unwrap())
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(o2.v, want2);
    // An output at a 4-byte (not 8-byte) aligned address: copied out and back, β read in.
    let mut raw = vec![1.0f32; m * n + 1];
    let mut o3 = zeros(&[m as i64, n as i64]);
    let mut d = o3.t();
    d.data = raw[1..].as_mut_ptr().cast();
    // SAFETY: the view lies inside `raw`.
    let s = unsafe { ferrite_matmul(cpu(), &a.t(), &b.t(), &d, 2.0, 1.0, false) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    for (i, w) in want.iter().enumerate() {
        assert!((raw[1 + i] - (2.0 * w + 1.0)).abs() < 1e-5);
    }
    assert_eq!(raw[0], 1.0);
}

#[test]
fn linear_norms_softmax_match_the_rust_api() {
    use ferrite::ops::{linear, norm, softmax};
    let (rows, inp, out) = (6usize, 8usize, 5usize);
    let mut x = f32s(rand(rows * inp, 3), &[rows as i64, inp as i64]);
    let mut w = f32s(rand(out * inp, 4), &[out as i64, inp as i64]);
    let mut bias = f32s(rand(out, 5), &[out as i64]);
    let mut y = zeros(&[rows as i64, out as i64]);
    let mut z = zeros(&[rows as i64, out as i64]);
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_linear_forward(
            cpu(),
            &x.t(),
            &w.t(),
            &bias.t(),
            null(),
            &y.t(),
            &z.t(),
            FERRITE_ACTIVATION_GELU_TANH,
            false,
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let (ry, rz) = (ref_tensor(&y), ref_tensor(&z));
    let lo = linear::LinearOptions {
        activation: linear::Activation::GeluTanh,
        ..Default::default()
    };
    let (rx, rw, rb) = (ref_tensor(&x), ref_tensor(&w), ref_tensor(&bias));
    let fwd = linear::Fwd {
        x: &rx,
        w: &rw,
        bias: Some(&rb),
        residual: None,
    };
    linear::forward_into(
        &fwd,
        &linear::FwdOut {
            y: &ry,
            z: Some(&rz),
        },
        &lo,
    )
    .unwrap();
    assert_eq!(y.v, ry.to_vec::<f32>().unwrap());
    assert_eq!(z.v, rz.to_vec::<f32>().unwrap());
    // Backward.
    let mut dy = f32s(rand(rows * out, 6), &[rows as i64, out as i64]);
    let mut dx = zeros(&[rows as i64, inp as i64]);
    let mut dw = zeros(&[out as i64, inp as i64]);
    let mut db = zeros(&[out as i64]);
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_linear_backward(
            cpu(),
            &dy.t(),
            &x.t(),
            &w.t(),
            &z.t(),
            &dx.t(),
            &dw.t(),
            &db.t(),
            FERRITE_ACTIVATION_GELU_TANH,
            false,
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let (rdx, rdw, rdb) = (ref_tensor(&dx), ref_tensor(&dw), ref_tensor(&db));
    linear::backward_into(
        &linear::Bwd {
            dy: &ref_tensor(&dy),
            x: &rx,
            w: &rw,
            z: Some(&ref_tensor(&z)),
            x_pre: None,
        },
        &linear::BwdOut {
            dx: Some(&rdx),
            dw: Some(&rdw),
            db: Some(&rdb),
            db_pre: None,
        },
        &lo,
    )
    .unwrap();
    assert_eq!(dx.v, rdx.to_vec::<f32>().unwrap());
    assert_eq!(dw.v, rdw.to_vec::<f32>().unwrap());
    assert_eq!(db.v, rdb.to_vec::<f32>().unwrap());

    // LayerNorm forward and backward, RMSNorm forward.
    let cols = inp as i64;
    let mut g = f32s(rand(inp, 7), &[cols]);
    let mut bb = f32s(rand(inp, 8), &[cols]);
    let mut ln_y = zeros(&[rows as i64, cols]);
    let mut mean = zeros(&[rows as i64]);
    let mut rstd = zeros(&[rows as i64]);
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_layer_norm_forward(
            cpu(),
            &x.t(),
            null(),
            &g.t(),
            &bb.t(),
            &ln_y.t(),
            null(),
            &mean.t(),
            &rstd.t(),
            1e-5,
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let (want_y, want_mean, want_rstd) =
        norm::layer_norm(&rx, Some(&ref_tensor(&g)), Some(&ref_tensor(&bb)), 1e-5).unwrap();
    assert_eq!(ln_y.v, want_y.to_vec::<f32>().unwrap());
    assert_eq!(mean.v, want_mean.to_vec::<f32>().unwrap());
    assert_eq!(rstd.v, want_rstd.to_vec::<f32>().unwrap());
    let mut ddx = zeros(&[rows as i64, cols]);
    let mut dg = zeros(&[cols]);
    let mut dbb = zeros(&[cols]);
    let mut dyn_ = f32s(rand(rows * inp, 9), &[rows as i64, cols]);
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_layer_norm_backward(
            cpu(),
            &dyn_.t(),
            &x.t(),
            &g.t(),
            &mean.t(),
            &rstd.t(),
            &ddx.t(),
            &dg.t(),
            &dbb.t(),
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let (r_dx, r_dg, r_db) = (ref_tensor(&ddx), ref_tensor(&dg), ref_tensor(&dbb));
    norm::backward_into(
        norm::NormKind::Layer,
        &norm::Bwd {
            dy: &ref_tensor(&dyn_),
            x: &rx,
            weight: Some(&ref_tensor(&g)),
            mean: Some(&want_mean),
            rstd: &want_rstd,
        },
        &norm::BwdOut {
            dx: &r_dx,
            dweight: Some(&r_dg),
            dbias: Some(&r_db),
        },
        &Default::default(),
    )
    .unwrap();
    assert_eq!(ddx.v, r_dx.to_vec::<f32>().unwrap());
    assert_eq!(dg.v, r_dg.to_vec::<f32>().unwrap());
    assert_eq!(dbb.v, r_db.to_vec::<f32>().unwrap());
    let mut rms_y = zeros(&[rows as i64, cols]);
    let mut rms_r = zeros(&[rows as i64]);
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_rms_norm_forward(
            cpu(),
            &x.t(),
            null(),
            &g.t(),
            &rms_y.t(),
            null(),
            &rms_r.t(),
            1e-6,
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let (wy, wr) = norm::rms_norm(&rx, Some(&ref_tensor(&g)), 1e-6).unwrap();
    assert_eq!(rms_y.v, wy.to_vec::<f32>().unwrap());
    assert_eq!(rms_r.v, wr.to_vec::<f32>().unwrap());
    // RMSNorm backward.
    let mut rdx2 = zeros(&[rows as i64, cols]);
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_rms_norm_backward(
            cpu(),
            &dyn_.t(),
            &x.t(),
            &g.t(),
            &rms_r.t(),
            &rdx2.t(),
            null(),
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    assert!(rdx2.v.iter().all(|v| v.is_finite()) && rdx2.v.iter().any(|&v| v != 0.0));

    // Softmax forward and backward, in place (y over x: copy-in/copy-out).
    let want_sm = softmax::softmax(&rx, 0.5).unwrap().to_vec::<f32>().unwrap();
    let mut sm = f32s(x.v.clone(), &[rows as i64, cols]);
    let d = sm.t();
    // SAFETY: one live buffer as input and output.
    let s = unsafe { ferrite_softmax_forward(cpu(), &d, &d, 0.5) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    assert_eq!(sm.v, want_sm);
    let mut sdx = zeros(&[rows as i64, cols]);
    // SAFETY: live buffers.
    let s = unsafe { ferrite_softmax_backward(cpu(), &dyn_.t(), &sm.t(), &sdx.t(), 0.5) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let r = ref_tensor(&sdx);
    softmax::softmax_backward_into(
        &ref_tensor(&dyn_),
        &ref_tensor(&sm),
        &r,
        &softmax::SoftmaxOptions {
            scale: 0.5,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(sdx.v, r.to_vec::<f32>().unwrap());
}

#[test]
fn cross_entropy_forward_backward_and_in_place() {
    use ferrite::ops::cross_entropy as ce;
    let (n, v) = (4usize, 11usize);
    let mut logits = f32s(rand(n * v, 10), &[n as i64, v as i64]);
    let mut targets = Buf::new(vec![3i64, -100, 0, 10], &[n as i64], FERRITE_DTYPE_I64);
    let mut rows = zeros(&[n as i64]);
    let mut loss = zeros(&[1]);
    let mut grad = zeros(&[n as i64, v as i64]);
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_cross_entropy(
            cpu(),
            &logits.t(),
            &targets.t(),
            &rows.t(),
            &loss.t(),
            &grad.t(),
            null(),
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let rl = ref_tensor(&logits);
    let rt = Tensor::from_vec(targets.v.clone(), &[n]).unwrap();
    let (wr, wl, wg) = ce::cross_entropy(&rl, &rt, &Default::default()).unwrap();
    assert_eq!(rows.v, wr.to_vec::<f32>().unwrap());
    assert_eq!(loss.v, wl.to_vec::<f32>().unwrap());
    assert_eq!(grad.v, wg.to_vec::<f32>().unwrap());
    // The gradient over the logits, then scaled by an incoming gradient of 2.
    let mut o = ferrite_cross_entropy_options_default();
    o.grad_in_place = true;
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_cross_entropy(
            cpu(),
            &logits.t(),
            &targets.t(),
            &rows.t(),
            null(),
            null(),
            &o,
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    assert_eq!(logits.v, grad.v);
    let mut two = f32s(vec![2.0], &[1]);
    // SAFETY: live buffers.
    let s = unsafe { ferrite_cross_entropy_scale_grad(cpu(), &logits.t(), &two.t()) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    for (a, b) in logits.v.iter().zip(&grad.v) {
        assert_eq!(*a, 2.0 * b);
    }
    // A target out of range names the row.
    targets.v[2] = 11;
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_cross_entropy(
            cpu(),
            &grad.t(),
            &targets.t(),
            &rows.t(),
            null(),
            null(),
            null(),
        )
    };
    expect_err(s, FerriteStatus::InvalidArgument, &["targets[2] = 11"]);
}

#[test]
fn attention_decode_append_match_the_rust_api() {
    use ferrite::ops::{attention as at, decode as dc};
    let (b, s, h, d) = (2usize, 5usize, 2usize, 8usize);
    let shape = [b as i64, s as i64, h as i64, d as i64];
    let n = b * s * h * d;
    let mut q = f32s(rand(n, 11), &shape);
    let mut k = f32s(rand(n, 12), &shape);
    let mut v = f32s(rand(n, 13), &shape);
    let mut o = zeros(&shape);
    let mut lse = zeros(&[b as i64, h as i64, s as i64]);
    let mut opts = ferrite_attention_options_default();
    opts.causal = true;
    // SAFETY: live buffers.
    let st = unsafe {
        ferrite_attention_forward(
            cpu(),
            &q.t(),
            &k.t(),
            &v.t(),
            &o.t(),
            &lse.t(),
            null(),
            &opts,
        )
    };
    assert_eq!(st, FerriteStatus::Ok, "{}", last_error());
    let ro = at::AttentionOptions {
        causal: true,
        ..Default::default()
    };
    let (rq, rk, rv) = (ref_tensor(&q), ref_tensor(&k), ref_tensor(&v));
    let (wo, wl) = at::attention(&rq, &rk, &rv, &ro).unwrap();
    assert_eq!(o.v, wo.to_vec::<f32>().unwrap());
    assert_eq!(lse.v, wl.to_vec::<f32>().unwrap());
    let mut dout = f32s(rand(n, 14), &shape);
    let (mut dq, mut dk, mut dv) = (zeros(&shape), zeros(&shape), zeros(&shape));
    // SAFETY: live buffers.
    let st = unsafe {
        ferrite_attention_backward(
            cpu(),
            &dout.t(),
            &q.t(),
            &k.t(),
            &v.t(),
            &o.t(),
            &lse.t(),
            &dq.t(),
            &dk.t(),
            &dv.t(),
            null(),
            &opts,
        )
    };
    assert_eq!(st, FerriteStatus::Ok, "{}", last_error());
    let (wdq, wdk, wdv) =
        at::attention_backward(&ref_tensor(&dout), &rq, &rk, &rv, &wo, &wl, &ro).unwrap();
    assert_eq!(dq.v, wdq.to_vec::<f32>().unwrap());
    assert_eq!(dk.v, wdk.to_vec::<f32>().unwrap());
    assert_eq!(dv.v, wdv.to_vec::<f32>().unwrap());

    // Paged decode: append the keys of batch 0 (5 tokens) into blocks of 4, then decode.
    let (blocks, bs) = (4usize, 4usize);
    let cache_shape = [blocks as i64, bs as i64, h as i64, d as i64];
    let mut kc = zeros(&cache_shape);
    let mut vc = zeros(&cache_shape);
    let t = s;
    let mut kt = f32s(k.v[..t * h * d].to_vec(), &[t as i64, h as i64, d as i64]);
    let mut vt = f32s(v.v[..t * h * d].to_vec(), &[t as i64, h as i64, d as i64]);
    // Tokens 0..4 → block 2, token 4 → block 0.
    let mut slots = Buf::new(vec![8i32, 9, 10, 11, 0], &[t as i64], FERRITE_DTYPE_I32);
    // SAFETY: live buffers.
    let st = unsafe { ferrite_append_kv(cpu(), &kt.t(), &vt.t(), &kc.t(), &vc.t(), &slots.t()) };
    assert_eq!(st, FerriteStatus::Ok, "{}", last_error());
    assert_eq!(&kc.v[2 * bs * h * d..3 * bs * h * d], &k.v[..4 * h * d]);
    let mut table = Buf::new(vec![2i32, 0], &[1, 2], FERRITE_DTYPE_I32);
    let mut lens = Buf::new(vec![t as i32], &[1], FERRITE_DTYPE_I32);
    let mut dq1 = f32s(
        q.v[(s - 1) * h * d..s * h * d].to_vec(),
        &[1, h as i64, d as i64],
    );
    let mut dout1 = zeros(&[1, h as i64, d as i64]);
    let mut dlse = zeros(&[1, h as i64]);
    // SAFETY: live buffers.
    let st = unsafe {
        ferrite_paged_decode(
            cpu(),
            &dq1.t(),
            &kc.t(),
            &vc.t(),
            &table.t(),
            &lens.t(),
            &dout1.t(),
            &dlse.t(),
            null(),
        )
    };
    assert_eq!(st, FerriteStatus::Ok, "{}", last_error());
    // The last query of batch 0 sees every key under the causal mask: the same output.
    for hh in 0..h {
        for dd in 0..d {
            let want = o.v[((s - 1) * h + hh) * d + dd];
            let got = dout1.v[hh * d + dd];
            assert!((want - got).abs() < 1e-5, "{want} vs {got}");
        }
    }
    let (wo2, _) = dc::decode(
        &ref_tensor(&dq1),
        &dc::PagedKv {
            key_cache: &ref_tensor(&kc),
            value_cache: &ref_tensor(&vc),
            block_table: &Tensor::from_vec(table.v.clone(), &[1, 2]).unwrap(),
            seq_lens: &Tensor::from_vec(lens.v.clone(), &[1]).unwrap(),
        },
        &Default::default(),
    )
    .unwrap();
    assert_eq!(dout1.v, wo2.to_vec::<f32>().unwrap());
    // A slot outside the cache is an error naming it.
    slots.v[1] = 99;
    // SAFETY: live buffers.
    let st = unsafe { ferrite_append_kv(cpu(), &kt.t(), &vt.t(), &kc.t(), &vc.t(), &slots.t()) };
    expect_err(
        st,
        FerriteStatus::InvalidArgument,
        &["slot_mapping[1] = 99"],
    );
}

#[test]
fn adamw_moe_grouped_mm_match_the_rust_api() {
    use ferrite::ops::{adamw, moe};
    // AdamW on two f32 tensors, against the Rust step on copies.
    let mut p0 = f32s(rand(10, 20), &[10]);
    let mut g0 = f32s(rand(10, 21), &[10]);
    let mut m0 = zeros(&[10]);
    let mut v0 = zeros(&[10]);
    let mut p1 = f32s(rand(6, 22), &[2, 3]);
    let mut g1 = f32s(rand(6, 23), &[2, 3]);
    let mut m1 = zeros(&[2, 3]);
    let mut v1 = zeros(&[2, 3]);
    let refs: Vec<Tensor> = [&p0, &g0, &m0, &v0, &p1, &g1, &m1, &v1]
        .iter()
        .map(|b| ref_tensor(b))
        .collect();
    let ds: Vec<FerriteTensor> = vec![
        p0.t(),
        g0.t(),
        m0.t(),
        v0.t(),
        p1.t(),
        g1.t(),
        m1.t(),
        v1.t(),
    ];
    let list = [
        FerriteAdamWTensor {
            param: &ds[0],
            grad: &ds[1],
            exp_avg: &ds[2],
            exp_avg_sq: &ds[3],
            master: null(),
        },
        FerriteAdamWTensor {
            param: &ds[4],
            grad: &ds[5],
            exp_avg: &ds[6],
            exp_avg_sq: &ds[7],
            master: null(),
        },
    ];
    let mut hp = ferrite_adamw_hyper_default();
    hp.lr = 0.01;
    hp.step = 3;
    // SAFETY: live buffers, a list of 2.
    let s = unsafe { ferrite_adamw_step(cpu(), list.as_ptr(), 2, &hp) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let ts = [
        adamw::AdamWTensor {
            param: &refs[0],
            grad: &refs[1],
            exp_avg: &refs[2],
            exp_avg_sq: &refs[3],
            master: None,
        },
        adamw::AdamWTensor {
            param: &refs[4],
            grad: &refs[5],
            exp_avg: &refs[6],
            exp_avg_sq: &refs[7],
            master: None,
        },
    ];
    let rh = adamw::AdamWHyper {
        lr: 0.01,
        step: 3,
        ..Default::default()
    };
    adamw::adamw_step(&ts, &rh, &Default::default()).unwrap();
    assert_eq!(p0.v, refs[0].to_vec::<f32>().unwrap());
    assert_eq!(v1.v, refs[7].to_vec::<f32>().unwrap());
    hp.step = 0;
    // SAFETY: live buffers.
    let s = unsafe { ferrite_adamw_step(cpu(), list.as_ptr(), 2, &hp) };
    expect_err(s, FerriteStatus::InvalidArgument, &["adamw", "`step`"]);

    // The MoE layer's forward against the Rust layer.
    let (t, hd, i, e) = (6usize, 8usize, 4usize, 4usize);
    let mut x = f32s(rand(t * hd, 30), &[t as i64, hd as i64]);
    let mut router = f32s(rand(e * hd, 31), &[e as i64, hd as i64]);
    let mut w_up = f32s(
        rand(e * hd * 2 * i, 32),
        &[e as i64, hd as i64, 2 * i as i64],
    );
    let mut w_down = f32s(rand(e * i * hd, 33), &[e as i64, i as i64, hd as i64]);
    let mut out = zeros(&[t as i64, hd as i64]);
    let mut losses = zeros(&[2 + e as i64]);
    let mut mo = ferrite_moe_options_default();
    mo.aux_loss_coef = 0.01;
    // SAFETY: live buffers.
    let s = unsafe {
        ferrite_moe_forward(
            cpu(),
            &x.t(),
            &router.t(),
            &w_up.t(),
            &w_down.t(),
            &out.t(),
            &losses.t(),
            &mo,
        )
    };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    let (rr, ru, rd) = (ref_tensor(&router), ref_tensor(&w_up), ref_tensor(&w_down));
    let w = moe::MoeWeights {
        router: &rr,
        w_up: &ru,
        w_down: &rd,
    };
    let mut cfg = moe::MoeConfig::new(e, 2);
    cfg.aux_loss_coef = 0.01;
    let f = moe::moe_forward(&ref_tensor(&x), &w, &cfg, &Default::default()).unwrap();
    assert_eq!(out.v, f.out.to_vec::<f32>().unwrap());
    assert_eq!(losses.v, f.losses.to_vec::<f32>().unwrap());
    assert!(losses.v[0] > 0.0);

    // grouped_mm: rows 0..2 through b[0], 2..6 through b[1].
    let (m, k, n, g) = (6usize, 3usize, 2usize, 2usize);
    let mut a = f32s(rand(m * k, 40), &[m as i64, k as i64]);
    let mut bw = f32s(rand(g * k * n, 41), &[g as i64, k as i64, n as i64]);
    let mut offs = Buf::new(vec![2i32, 6], &[2], FERRITE_DTYPE_I32);
    let mut go = zeros(&[m as i64, n as i64]);
    // SAFETY: live buffers.
    let s = unsafe { ferrite_grouped_mm(cpu(), &a.t(), &bw.t(), &offs.t(), &go.t()) };
    assert_eq!(s, FerriteStatus::Ok, "{}", last_error());
    for r in 0..m {
        let gi = usize::from(r >= 2);
        for c in 0..n {
            let want: f32 = (0..k)
                .map(|kk| a.v[r * k + kk] * bw.v[(gi * k + kk) * n + c])
                .sum();
            assert!((go.v[r * n + c] - want).abs() < 1e-5);
        }
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

// ---------------------------------------------------------------------------------------------
// the CUDA path (the GPU suite runs these: `--ignored gpu_`)

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

// ---------------------------------------------------------------------------------------------
// the header

#[test]
fn header_is_current() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    // Needs the source tree (the GPU suite's run.sh skips it in the bundle).
    assert!(
        dir.join("cbindgen.toml").exists(),
        "{} is not here: this test runs from the source tree",
        dir.display()
    );
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen could not generate the header");
    let mut made = Vec::new();
    bindings.write(&mut made);
    let made = String::from_utf8(made).unwrap();
    let path = dir.join("include/ferrite.h");
    if std::env::var("FERRITE_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &made).unwrap();
        return;
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    if have != made {
        let line = have
            .lines()
            .zip(made.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(have.lines().count().min(made.lines().count()));
        panic!(
            "crates/ferrite-capi/include/ferrite.h is not what cbindgen makes of src/ (first \
             difference at line {}). Refresh it with\n    FERRITE_BLESS=1 cargo test -p \
             ferrite-capi header\nand commit the result.",
            line + 1
        );
    }
}
