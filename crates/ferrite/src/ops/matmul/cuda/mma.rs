//! The `mma.sync` kernels (`mma`, `mma_pipelined`; kernels/mma.cu): cp.async stages, shared
//! memory per stage and the program of each build.

use super::epilogue::{with_epilogue, Epi};
use super::MMA;
use crate::core::cuda::jit::Program;
use crate::core::dtype::DType;

/// Stages of the cp.async ring of `mma_pipelined` (`mma` has one).
pub(super) const MMA_STAGES: u32 = 4;
/// Stages of `mma_pipelined` with the element-wise fused epilogue (all four layouts in one
/// module): at 3 and 4 the 16-bit epilogue kernels spill (ptxas: 255 registers + 8–1200 bytes);
/// at 2 none does (236–253 registers). The pair epilogue is compiled for one layout and runs the
/// plain kernel's MMA_STAGES (155–175 registers, no spills).
pub(super) const MMA_EPI_STAGES: u32 = 2;
/// Shared memory per stage of the mma kernels: A and B tiles of 128 rows × (64 + 16) bytes.
pub(super) const MMA_STAGE_BYTES: u32 = 2 * 128 * 80;

/// The mma kernel for `dtype` (f32 = tf32 inputs) with `stages` cp.async stages. `layout` (A
/// transposed, B transposed) compiles that layout only (the pair epilogue kernels: one body
/// instead of four keeps their registers at ~160, see mma.cu); None compiles all four, picked at
/// run time.
pub(super) fn mma_program(
    dtype: DType,
    stages: u32,
    epi: Option<Epi>,
    layout: Option<(bool, bool)>,
) -> Program {
    let kind = match dtype {
        DType::BF16 => 1,
        DType::F32 => 2,
        _ => 0,
    };
    let mut p = Program::new(MMA)
        .define("FE_ELEM", dtype.cuda_name())
        .define("FE_MMA_KIND", kind)
        .define("FE_STAGES", stages);
    if let Some((at, bt)) = layout {
        p = p
            .define("FE_A_TRANS", at as u32)
            .define("FE_B_TRANS", bt as u32);
    }
    with_epilogue(p, epi)
}
