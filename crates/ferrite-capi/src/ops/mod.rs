//! The op entry points, one module per op family. Each one: the device selector and the
//! descriptors checked and wrapped (operand.rs), ferrite's `*_into` function called with the
//! caller's buffers, CPU outputs held as copies written back, and the outcome turned into a status
//! (boundary.rs).
//!
//! Every `# Safety` section of these modules means the same thing: each `FerriteTensor` (and
//! options) pointer is NULL or points to a descriptor that meets the pointer contract stated at the
//! top of `ferrite.h` (readable descriptors; data valid for the view over the whole call).

// The docs of these modules are also the header's, where brackets are C indexing and shapes
// (`b[g]`, `cu_seqlens_q[b]`), not intra-doc links.
#![allow(rustdoc::broken_intra_doc_links)]

use crate::operand::bad;
use crate::FerriteActivation;
use ferrite::core::harness::Precision;
use ferrite::ops::activation;
use ferrite::Result;

// The families in the order the header declares them: cbindgen follows the order of the `mod`
// declarations, and the blank lines keep rustfmt from sorting them.
mod matmul;

mod linear;

mod norm;

mod softmax;

mod cross_entropy;

mod attention;

mod decode;

mod adamw;

mod moe;

pub use self::{
    adamw::*, attention::*, cross_entropy::*, decode::*, linear::*, matmul::*, moe::*, norm::*,
    softmax::*,
};

/// `v` as a size, refusing negative values.
fn size(op: &str, arg: &str, v: i64) -> Result<usize> {
    usize::try_from(v).map_err(|_| bad(op, arg, "a value ≥ 0", v))
}

/// The options at `p` (None for NULL), checked aligned.
///
/// # Safety
/// A non-null, aligned `p` points to a readable `T`.
unsafe fn read_opts<T: Copy>(op: &str, arg: &str, p: *const T) -> Result<Option<T>> {
    if p.is_null() {
        return Ok(None);
    }
    if !p.is_aligned() {
        return Err(bad(op, arg, "an aligned pointer", format!("{p:p}")));
    }
    // SAFETY: non-null and aligned (checked above), readable by the caller's contract.
    Ok(Some(unsafe { p.read() }))
}

fn precision(allow_tf32: bool) -> Precision {
    if allow_tf32 {
        Precision::Tf32
    } else {
        Precision::F32
    }
}

const ACTIVATION_CODES: &str =
    "a FERRITE_ACTIVATION_* code (0 none, 1 relu, 2 gelu_tanh, 3 gelu_erf, 4 silu)";

fn activation_of(op: &str, arg: &str, a: FerriteActivation) -> Result<activation::Activation> {
    use activation::Activation as A;
    Ok(match a.0 {
        0 => A::None,
        1 => A::Relu,
        2 => A::GeluTanh,
        3 => A::GeluErf,
        4 => A::Silu,
        other => return Err(bad(op, arg, ACTIVATION_CODES, other)),
    })
}
