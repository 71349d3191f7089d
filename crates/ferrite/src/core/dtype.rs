//! Element types. Floating types for math (f32, f16, bf16) and integer types for indices and tokens.

use super::fp8::{E4M3, E5M2};
use half::{bf16, f16};
use std::fmt;

/// The element type of a tensor. The ops compute in f32, f16 and bf16 (accumulating in f32); the
/// integer types carry token ids, class indices, offsets and block tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// IEEE half precision (5-bit exponent): tensor-core input, narrower range than bf16.
    F16,
    /// bfloat16 (f32's 8-bit exponent, 7-bit mantissa): the usual training dtype on the GPU.
    BF16,
    /// Signed 32-bit integers: token ids, offsets, block tables, targets.
    I32,
    /// Unsigned 32-bit integers: tokens of vocabularies above 65 536 (`.bin` v7 shards).
    U32,
    /// Unsigned 16-bit integers: GPT-2 tokens as llm.c's v1 shards store them.
    U16,
    /// Bytes.
    U8,
    /// Signed bytes: int8 weights of the weight-only quantised matmul (`w8a16`).
    I8,
    /// Class indices as PyTorch stores them (cross-entropy targets).
    I64,
    /// FP8 e4m3 (`float8_e4m3fn`): the scaled GEMM's inputs (weights, activations); see
    /// [`crate::core::fp8`].
    F8E4M3,
    /// FP8 e5m2 (`float8_e5m2`): wider range, for gradients.
    F8E5M2,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 11] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U32,
        DType::U16,
        DType::U8,
        DType::I8,
        DType::I64,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 | DType::U16 => 2,
            DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::I64 => 8,
        }
    }

    /// f32, f16 or bf16: the dtypes the ops compute in.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// The smallest positive normal value of a float dtype (None for integers). Below it a
    /// value is subnormal: its rounding error is a fixed quantum, no longer relative to it.
    pub fn min_normal(self) -> Option<f64> {
        let exp = match self {
            DType::F32 | DType::BF16 => -126,
            DType::F16 | DType::F8E5M2 => -14,
            DType::F8E4M3 => -6,
            _ => return None,
        };
        Some(2f64.powi(exp))
    }

    /// f8e4m3 or f8e5m2: storage the scaled GEMM multiplies (with scales), not a dtype the
    /// other ops compute in.
    pub fn is_fp8(self) -> bool {
        matches!(self, DType::F8E4M3 | DType::F8E5M2)
    }

    /// The short lowercase name (`f32`, `bf16`, `i64`, ...) used in messages, flags and JSON.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::U16 => "u16",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I64 => "i64",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
        }
    }

    /// The C++ type name the CUDA kernels use for this dtype.
    pub fn cuda_name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F16 => "__half",
            DType::BF16 => "__nv_bfloat16",
            DType::I32 => "int",
            DType::U32 => "unsigned int",
            DType::U16 => "unsigned short",
            DType::U8 => "unsigned char",
            DType::I8 => "signed char",
            DType::I64 => "long long",
            DType::F8E4M3 => "__nv_fp8_e4m3",
            DType::F8E5M2 => "__nv_fp8_e5m2",
        }
    }

    /// Reads a dtype from its [`name`](DType::name) (any case) or a common alias (`float32`,
    /// `fp16`, `bfloat16`, `int64`, ...); None for anything else.
    pub fn parse(s: &str) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
            .or(match s.to_ascii_lowercase().as_str() {
                "float" | "float32" | "fp32" => Some(DType::F32),
                "half" | "float16" | "fp16" => Some(DType::F16),
                "bfloat16" => Some(DType::BF16),
                "int32" | "int" => Some(DType::I32),
                "int64" | "long" => Some(DType::I64),
                "uint32" => Some(DType::U32),
                "uint16" => Some(DType::U16),
                "uint8" => Some(DType::U8),
                "int8" => Some(DType::I8),
                "float8_e4m3fn" | "e4m3" | "fp8e4m3" | "fp8_e4m3" => Some(DType::F8E4M3),
                "float8_e5m2" | "e5m2" | "fp8e5m2" | "fp8_e5m2" => Some(DType::F8E5M2),
                _ => None,
            })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that can live in a tensor. `to_f64`/`from_f64` are the bridge to the f64 reference.
pub trait Element:
    bytemuck::Pod + cudarc::driver::DeviceRepr + Send + Sync + Copy + PartialEq + fmt::Debug + 'static
{
    /// The dtype tag of tensors holding this type.
    const DTYPE: DType;
    /// The value as f64 (exact for every element type but i64 beyond 2^53).
    fn to_f64(self) -> f64;
    /// Rounds (floats, to nearest) or saturates and truncates (integers).
    fn from_f64(v: f64) -> Self;
}

macro_rules! int_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
        }
    };
}
int_element!(i32, DType::I32);
int_element!(u32, DType::U32);
int_element!(u16, DType::U16);
int_element!(u8, DType::U8);
int_element!(i8, DType::I8);
int_element!(i64, DType::I64);

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
}

/// Reads element `i` of a little-endian byte buffer of dtype `dtype` as f64.
pub(crate) fn read_as_f64(bytes: &[u8], dtype: DType, i: usize) -> f64 {
    let s = dtype.size_in_bytes();
    let b = &bytes[i * s..(i + 1) * s];
    match dtype {
        DType::F32 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::F16 => f16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        DType::BF16 => bf16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        DType::I32 => i32::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::U32 => u32::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::U16 => u16::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::U8 => b[0] as f64,
        DType::I8 => b[0] as i8 as f64,
        DType::I64 => i64::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::F8E4M3 => E4M3.decode(b[0]) as f64,
        DType::F8E5M2 => E5M2.decode(b[0]) as f64,
    }
}

/// Writes `v` (rounded to `dtype`) as element `i` of a little-endian byte buffer.
pub(crate) fn write_from_f64(bytes: &mut [u8], dtype: DType, i: usize, v: f64) {
    let s = dtype.size_in_bytes();
    let b = &mut bytes[i * s..(i + 1) * s];
    match dtype {
        DType::F32 => b.copy_from_slice(&(v as f32).to_le_bytes()),
        DType::F16 => b.copy_from_slice(&f16::from_f64(v).to_le_bytes()),
        DType::BF16 => b.copy_from_slice(&bf16::from_f64(v).to_le_bytes()),
        DType::I32 => b.copy_from_slice(&(v as i32).to_le_bytes()),
        DType::U32 => b.copy_from_slice(&(v as u32).to_le_bytes()),
        DType::U16 => b.copy_from_slice(&(v as u16).to_le_bytes()),
        DType::U8 => b[0] = v as u8,
        DType::I8 => b[0] = v as i8 as u8,
        DType::I64 => b.copy_from_slice(&(v as i64).to_le_bytes()),
        DType::F8E4M3 => b[0] = E4M3.encode_f64(v),
        DType::F8E5M2 => b[0] = E5M2.encode_f64(v),
    }
}
