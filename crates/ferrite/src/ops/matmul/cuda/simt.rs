//! The fp32 SIMT rungs: `naive` (every dtype, with or without the fused epilogue) and the tiled
//! ladder from `coalesced` to `warptile`, one table row each.

use super::epilogue::{with_epilogue, Epi};
use super::{BLOCKTILE_1D, BLOCKTILE_2D, COALESCED, NAIVE, SMEM_TILED, VECTORIZED, WARPTILE};
use crate::core::act::Activation;
use crate::core::cuda::jit::{KernelSource, Program};
use crate::core::dtype::DType;

/// One fp32 SIMT rung: its module, entry point, threads per block, C tile per block (rows,
/// columns) and a short description of the configuration.
pub(super) struct Simt {
    pub(super) name: &'static str,
    pub(super) source: KernelSource,
    pub(super) func: &'static str,
    pub(super) threads: u32,
    pub(super) tile: (u32, u32),
    /// Dynamic shared memory per block (bytes).
    pub(super) smem: u32,
    pub(super) config: &'static str,
}

/// `warptile`'s cp.async ring: 3 stages × 16 k × (260 + 132 padded floats) × 4 bytes, the
/// kernel's W_SMEM_BYTES (it traps when given less).
const WARPTILE_SMEM: u32 = 3 * 16 * (260 + 132) * 4;

pub(super) const SIMT: &[Simt] = &[
    Simt {
        name: "coalesced",
        source: COALESCED,
        func: "matmul_coalesced",
        threads: 1024,
        tile: (32, 32),
        smem: 0,
        config: "block 32×32, 1 output/thread, lanes on the contiguous side",
    },
    Simt {
        name: "smem_tiled",
        source: SMEM_TILED,
        func: "matmul_smem_tiled",
        threads: 1024,
        tile: (32, 32),
        smem: 0,
        config: "tile 32×32×32 in smem, 1 output/thread",
    },
    Simt {
        name: "blocktile_1d",
        source: BLOCKTILE_1D,
        func: "matmul_blocktile_1d",
        threads: 512,
        tile: (64, 64),
        smem: 0,
        config: "tile 64×64×8, 8×1 outputs/thread",
    },
    Simt {
        name: "blocktile_2d",
        source: BLOCKTILE_2D,
        func: "matmul_blocktile_2d",
        threads: 256,
        tile: (128, 128),
        smem: 0,
        config: "tile 128×128×8, 8×8 outputs/thread",
    },
    Simt {
        name: "vectorized",
        source: VECTORIZED,
        func: "matmul_vectorized",
        threads: 256,
        tile: (128, 128),
        smem: 0,
        config: "tile 128×128×8, 8×8 outputs/thread, float4 loads",
    },
    Simt {
        name: "warptile",
        source: WARPTILE,
        func: "matmul_warptile",
        threads: 256,
        tile: (256, 128),
        smem: WARPTILE_SMEM,
        config: "tile 256×128×16, 8 warps of 64×64, 16×8 outputs/thread, 3-stage cp.async ring, 1 block/SM",
    },
];

pub(super) fn naive_program(dtype: DType, epi: Option<Activation>) -> Program {
    let epi = epi.map(|act| Epi {
        act,
        pairs: false,
        dact: false,
    });
    with_epilogue(
        Program::new(NAIVE).define("FE_ELEM", dtype.cuda_name()),
        epi,
    )
}
