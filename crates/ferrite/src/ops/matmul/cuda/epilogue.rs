//! The fused epilogue kernels (bias, activation, Z, residual; see `matmul/epilogue.rs`) a linear
//! layer plans and launches: the element-wise and pair builds, the activation backward of
//! `wgmma`, and the specialisations `ferrite kernels` build-checks.

use super::mma::{mma_program, MMA_EPI_STAGES, MMA_STAGES};
use super::simt::naive_program;
use super::skinny::{skinny_functions, skinny_program};
use super::tma::wg_tma_store_ok;
use super::wgmma::{wgmma_function, wgmma_program, WG_CLUSTER, WG_DACT, WG_DEFAULT};
use super::{launch_inner, plan_inner, Launch, Ptrs};
use crate::core::cuda::jit::Program;
use crate::core::cuda::{CudaDevice, Stream};
use crate::core::device::Arch;
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::KernelSpec;
use crate::ops::matmul::epilogue::{Activation, EpiPtrs};
use crate::ops::matmul::{Gemm, OP};
use std::sync::Arc;

/// Which fused epilogue a kernel is compiled with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Epi {
    pub act: Activation,
    /// The pair epilogue (`-DFE_EPI_PAIRS=1`: interior tiles stored as 2-element pairs with the
    /// bias in registers, SFU activations for 16-bit outputs; `mma_pipelined` and `wgmma` only)
    /// instead of the element-wise one.
    pub pairs: bool,
    /// The activation's backward (`-DFE_EPI_DACT=1`, `wgmma` with the pair epilogue only):
    /// C = alpha·acc · act'(R), R the pre-activation of the layer below (bias and Z absent).
    pub dact: bool,
}

/// The `FE_EPI` (and `FE_EPI_PAIRS`) defines of an epilogue kernel (absent for the plain GEMM, so
/// its module, cache key and code are exactly the plain kernel's).
pub(super) fn with_epilogue(p: Program, epi: Option<Epi>) -> Program {
    match epi {
        Some(Epi { act, pairs, dact }) => {
            let p = p.define("FE_EPI", 1 + act.code());
            let p = if pairs {
                p.define("FE_EPI_PAIRS", 1)
            } else {
                p
            };
            if dact {
                p.define("FE_EPI_DACT", 1)
            } else {
                p
            }
        }
        None => p,
    }
}

/// Layouts (A transposed, B transposed) the mma pair-epilogue kernels are build-checked in: the
/// linear layer's (X row-major, W `[out, in]` = B transposed) for every activation and dtype, the
/// other three for one activation (their bodies are the plain kernel's, checked there too).
const EPI_LINEAR_LAYOUT: (bool, bool) = (false, true);
const EPI_OTHER_LAYOUTS: [(bool, bool); 3] = [(false, false), (true, false), (true, true)];

/// The epilogue specialisations a linear layer launches: every activation for `naive` and
/// `mma_pipelined` (f32 = tf32, f16, bf16) and for `wgmma` in the layer's layout (X row-major,
/// W `[out, in]` row-major = B transposed) with the cluster it runs; element-wise and pair
/// epilogues (`mma_pipelined` with pairs: one module per layout, see EPI_LINEAR_LAYOUT).
pub fn epilogue_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for act in Activation::ALL {
        let elem = Some(Epi {
            act,
            pairs: false,
            dact: false,
        });
        let pairs = Some(Epi {
            act,
            pairs: true,
            dact: false,
        });
        for d in [DType::F32, DType::F16, DType::BF16] {
            v.push(KernelSpec {
                program: naive_program(d, Some(act)),
                functions: vec!["matmul_naive".into()],
                min_arch: Arch::SM80,
            });
            v.push(KernelSpec {
                program: mma_program(d, MMA_EPI_STAGES, elem, None),
                functions: vec!["matmul_mma".into()],
                min_arch: Arch::SM80,
            });
            let others: &[(bool, bool)] = if act == Activation::GeluTanh {
                &EPI_OTHER_LAYOUTS
            } else {
                &[]
            };
            for &layout in std::iter::once(&EPI_LINEAR_LAYOUT).chain(others) {
                v.push(KernelSpec {
                    program: mma_program(d, MMA_STAGES, pairs, Some(layout)),
                    functions: vec!["matmul_mma".into()],
                    min_arch: Arch::SM80,
                });
            }
        }
        for d in [DType::F16, DType::BF16] {
            v.push(KernelSpec {
                program: skinny_program(d, elem),
                functions: skinny_functions(),
                min_arch: Arch::SM80,
            });
            for epi in [elem, pairs] {
                v.push(KernelSpec {
                    program: wgmma_program(d, false, true, WG_CLUSTER, epi),
                    functions: vec!["matmul_wgmma".into()],
                    min_arch: Arch::SM90,
                });
            }
            // The linear backward's dX GEMM (dZ row-major · W row-major) forming the layer
            // below's dZ in its epilogue.
            if act != Activation::None {
                let dact = Epi {
                    act,
                    pairs: true,
                    dact: true,
                };
                v.push(KernelSpec {
                    program: wgmma_program(d, false, false, WG_DACT.cluster, Some(dact)),
                    functions: vec![wgmma_function(Some(dact)).into()],
                    min_arch: Arch::SM90,
                });
            }
        }
    }
    v
}

/// The variants that have the pair epilogue (`plan_epilogue_pairs`).
pub const EPILOGUE_PAIR_VARIANTS: [&str; 2] = ["mma_pipelined", "wgmma"];

/// `plan_epilogue` with the pair epilogue: interior tiles (every row and column of the
/// warpgroup's / warp's block inside C, pairs of C, Z, R and the bias 2-element aligned,
/// beta == 0) stored as 2-element pairs with the bias pairs in registers, activations on the SFU
/// for 16-bit outputs; other tiles element by element. `mma_pipelined` is compiled for `g`'s
/// layout only and runs the plain kernel's 4 stages. Launch it with `launch_with_epilogue`.
pub fn plan_epilogue_pairs(
    variant: &str,
    g: &Gemm,
    dev: &Arc<CudaDevice>,
    act: Activation,
) -> Result<Launch> {
    if !EPILOGUE_PAIR_VARIANTS.contains(&variant) {
        return Err(Error::NoVariant {
            op: OP.into(),
            msg: format!(
                "CUDA variant `{variant}` has no pair epilogue (those that do: {})",
                EPILOGUE_PAIR_VARIANTS.join(", ")
            ),
        });
    }
    plan_inner(
        variant,
        g,
        dev,
        Some(Epi {
            act,
            pairs: true,
            dact: false,
        }),
        WG_DEFAULT,
    )
}

/// `wgmma` with the activation-backward epilogue: C = alpha·acc · act'(R) (`-DFE_EPI_DACT`),
/// R passed as `EpiPtrs::r` (indexed like C), bias and Z absent. Interior tiles go through the
/// TMA-store pair epilogue with R loaded a box ahead, edge tiles element by element. 16-bit
/// only. Launch it with `launch_with_epilogue`.
pub fn plan_epilogue_dact(g: &Gemm, dev: &Arc<CudaDevice>, act: Activation) -> Result<Launch> {
    if g.dtype == DType::F32 {
        return Err(Error::NoVariant {
            op: OP.into(),
            msg: "the activation-backward epilogue is bf16/f16 `wgmma` only".into(),
        });
    }
    let epi = Epi {
        act,
        pairs: true,
        dact: true,
    };
    plan_inner("wgmma", g, dev, Some(epi), WG_DACT)
}

/// Whether launch `l` of the activation-backward epilogue can also write the column sums
/// (`EpiPtrs::part`): every tile holding output rows must take the kernel's TMA-store pair path,
/// which is the only one that writes them — m a multiple of 64 (a consumer's rows), n of the
/// tile width, one batch, beta = 0, C 16-byte aligned (TMA store) and R's pairs aligned.
pub fn dact_colsum_ok(l: &Launch, g: &Gemm, p: Ptrs, beta: f32, e: &EpiPtrs) -> bool {
    let es = g.dtype.size_in_bytes();
    matches!(l.epilogue, Some(Epi { dact: true, .. }))
        && l.persistent.is_some_and(|pp| pp.tma_store)
        && g.batch == 1
        && g.m.is_multiple_of(64)
        && g.n.is_multiple_of(l.tile.1 as usize)
        && wg_tma_store_ok(g, p.c, beta, e)
        && p.c.is_multiple_of(2 * es as u64)
        && g.c.ld.is_multiple_of(2)
        && e.r.is_multiple_of(2 * es as u64)
        && e.ldr.is_multiple_of(2)
}

/// The variants that have the fused epilogue.
pub const EPILOGUE_VARIANTS: [&str; 4] = ["naive", "mma_pipelined", "wgmma", "skinny"];

/// `plan` for a kernel with the fused epilogue (bias, `act`, Z, residual; see `epilogue.rs`):
/// `naive`, `mma_pipelined`, `wgmma` or `skinny`. Launch it with `launch_with_epilogue`.
pub fn plan_epilogue(
    variant: &str,
    g: &Gemm,
    dev: &Arc<CudaDevice>,
    act: Activation,
) -> Result<Launch> {
    if !EPILOGUE_VARIANTS.contains(&variant) {
        return Err(Error::NoVariant {
            op: OP.into(),
            msg: format!(
                "CUDA variant `{variant}` has no fused epilogue (those that do: {})",
                EPILOGUE_VARIANTS.join(", ")
            ),
        });
    }
    plan_inner(
        variant,
        g,
        dev,
        Some(Epi {
            act,
            pairs: false,
            dact: false,
        }),
        WG_DEFAULT,
    )
}

/// The config suffix of an epilogue kernel.
pub(super) fn epilogue_note(epi: Option<Epi>) -> String {
    match epi {
        Some(Epi {
            act, dact: true, ..
        }) => format!(
            ", fused {act}' epilogue (C = acc·{act}'(R): the layer below's dZ; consumers stage the whole tile, 3 helper warps apply {act}' and store it under the next tile's mainloop)"
        ),
        Some(Epi {
            act, pairs: true, ..
        }) => format!(
            ", fused {act} pair epilogue (interior tiles: bias pairs in registers, 2-element stores)"
        ),
        Some(Epi { act, .. }) => format!(", fused {act} epilogue element by element"),
        None => String::new(),
    }
}

/// Queues a kernel planned by `plan_epilogue`; `e` holds the bias / Z / residual addresses (0 =
/// absent) and the layouts of Z and R (indexed like C). The caller guarantees that each present
/// pointer addresses a live buffer of `g.dtype` covering the batch × m × n elements it indexes
/// (bias: n elements).
pub fn launch_with_epilogue(
    l: &Launch,
    g: &Gemm,
    p: Ptrs,
    alpha: f32,
    beta: f32,
    e: EpiPtrs,
    stream: &Stream,
) -> Result<()> {
    match l.epilogue {
        Some(Epi { dact: true, .. }) if e.r == 0 || e.bias != 0 || e.z != 0 => {
            return Err(Error::Other(format!(
                "matmul: the activation-backward epilogue ({}) takes R (the pre-activation) and \
                 no bias or Z",
                l.kernel.name
            )));
        }
        _ => {}
    }
    if l.epilogue.is_none() {
        return Err(Error::Other(format!(
            "matmul: launch_with_epilogue on a plain kernel ({}); plan it with plan_epilogue",
            l.kernel.name
        )));
    }
    launch_inner(l, g, p, alpha, beta, e, None, stream)
}
