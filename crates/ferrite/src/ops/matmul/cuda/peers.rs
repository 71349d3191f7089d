//! The vendor peers: cuBLAS (`cublas`) and cuBLASLt (`LtPlan`) on the same problem, for the
//! checks and the benchmark.

use super::Ptrs;
use crate::core::cuda::{blas, CudaDevice, Stream};
use crate::core::dtype::DType;
use crate::core::error::{Error, Result};
use crate::core::harness::Precision;
use crate::ops::matmul::Gemm;
use std::sync::Arc;

/// cuBLAS on the same problem: the vendor peer. Row-major C = op(A)·op(B) is computed as the
/// column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, so B goes first and the transposes carry over unchanged.
pub fn cublas(
    dev: &CudaDevice,
    g: &Gemm,
    p: Ptrs,
    alpha: f32,
    beta: f32,
    precision: Precision,
    stream: &Stream,
) -> Result<()> {
    use cudarc::cublas::{result as cb, sys};
    let h = blas::handle(dev, stream)?;
    let h = h.lock().unwrap();
    let (dt, compute) = match (g.dtype, precision) {
        (DType::F32, Precision::Tf32) => (
            sys::cudaDataType::CUDA_R_32F,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        ),
        (DType::F32, _) => (
            sys::cudaDataType::CUDA_R_32F,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        (DType::F16, _) => (
            sys::cudaDataType::CUDA_R_16F,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        (DType::BF16, _) => (
            sys::cudaDataType::CUDA_R_16BF,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        (d, _) => return Err(Error::bad_arg("cublas", "dtype", "f32, f16 or bf16", d)),
    };
    let op = |t: bool| {
        if t {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    dev.bind()?;
    // SAFETY: the pointers address the validated operands of `g` on this device (the caller
    // guarantees it); alpha/beta are host f32 as the compute type expects; the handle is locked.
    unsafe {
        cb::gemm_strided_batched_ex(
            h.handle(),
            op(g.b.trans),
            op(g.a.trans),
            g.n as i32,
            g.m as i32,
            g.k as i32,
            &alpha as *const f32 as *const _,
            p.b as *const _,
            dt,
            g.b.ld as i32,
            g.b.batch_stride as i64,
            p.a as *const _,
            dt,
            g.a.ld as i32,
            g.a.batch_stride as i64,
            &beta as *const f32 as *const _,
            p.c as *mut _,
            dt,
            g.c.ld as i32,
            g.c.batch_stride as i64,
            g.batch as i32,
            compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| {
        Error::cuda(
            format!("cublasGemmStridedBatchedEx ({})", g.label()),
            format!("{e:?}"),
        )
    })
}

/// cuBLASLt's pick for one problem, the second vendor peer: the matmul descriptor, the three
/// layouts (column-major, as cuBLAS sees C = A·B: Cᵀ = Bᵀ·Aᵀ, like [`cublas`]), the heuristic's
/// best algorithm for a 32 MiB workspace, and the workspace — made once and reused by every call,
/// as a framework caches them (what PyTorch's Lt path does).
pub struct LtPlan {
    handle: cudarc::cublaslt::sys::cublasLtHandle_t,
    desc: cudarc::cublaslt::sys::cublasLtMatmulDesc_t,
    layouts: [cudarc::cublaslt::sys::cublasLtMatrixLayout_t; 3],
    algo: cudarc::cublaslt::sys::cublasLtMatmulAlgo_t,
    workspace: crate::core::cuda::DeviceBuffer,
    stream: Stream,
    /// The algorithm's id and tile as cuBLASLt reports them (for the bench's config column).
    pub config: String,
}

const LT_WORKSPACE: usize = 32 << 20;

impl LtPlan {
    pub fn new(
        dev: &Arc<CudaDevice>,
        g: &Gemm,
        precision: Precision,
        stream: &Stream,
    ) -> Result<Self> {
        use cudarc::cublaslt::{result as lt, sys};
        let err = |what: &str, e: lt::CublasError| {
            Error::cuda(format!("{what} ({})", g.label()), format!("{e:?}"))
        };
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::CudaUnavailable(
                "cuBLASLt (libcublasLt.so.13) not found by the loader".into(),
            ));
        }
        // The same mapping as `cublas` above, but cudarc's cuBLASLt bindings declare their own
        // copies of these enums, so the two matches cannot share one function.
        let (dt, compute) = match (g.dtype, precision) {
            (DType::F32, Precision::Tf32) => (
                sys::cudaDataType::CUDA_R_32F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            ),
            (DType::F32, _) => (
                sys::cudaDataType::CUDA_R_32F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            (DType::F16, _) => (
                sys::cudaDataType::CUDA_R_16F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            (DType::BF16, _) => (
                sys::cudaDataType::CUDA_R_16BF,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            (d, _) => return Err(Error::bad_arg("cublaslt", "dtype", "f32, f16 or bf16", d)),
        };
        dev.bind()?;
        let workspace = dev.alloc(LT_WORKSPACE, stream)?;
        let handle = lt::create_handle().map_err(|e| err("cublasLtCreate", e))?;
        // From here every created object is owned by `plan`, whose Drop frees what exists.
        let mut plan = LtPlan {
            handle,
            desc: std::ptr::null_mut(),
            layouts: [std::ptr::null_mut(); 3],
            algo: cudarc::cublaslt::sys::cublasLtMatmulAlgo_t { data: [0; 8] },
            workspace,
            stream: stream.clone(),
            config: String::new(),
        };
        plan.desc = lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F)
            .map_err(|e| err("cublasLtMatmulDescCreate", e))?;
        // cuBLAS's column-major view: its A is our B (n × k), its B our A (k × m), C is n × m.
        let (op_a, op_b) = (g.b.trans as i32, g.a.trans as i32); // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
        for (attr, v) in [
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                op_a,
            ),
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                op_b,
            ),
        ] {
            // SAFETY: live descriptor; the attribute is an int32 cublasOperation_t.
            unsafe {
                lt::set_matmul_desc_attribute(plan.desc, attr, &v as *const i32 as *const _, 4)
            }
            .map_err(|e| err("cublasLtMatmulDescSetAttribute", e))?;
        }
        let shapes = [
            if g.b.trans {
                (g.k, g.n, g.b)
            } else {
                (g.n, g.k, g.b)
            },
            if g.a.trans {
                (g.m, g.k, g.a)
            } else {
                (g.k, g.m, g.a)
            },
            (g.n, g.m, g.c),
        ];
        for (i, (rows, cols, op)) in shapes.into_iter().enumerate() {
            let l = lt::create_matrix_layout(dt, rows as u64, cols as u64, op.ld as i64)
                .map_err(|e| err("cublasLtMatrixLayoutCreate", e))?;
            plan.layouts[i] = l;
            if g.batch > 1 {
                let (count, stride) = (g.batch as i32, op.batch_stride as i64);
                // SAFETY: live layout; BATCH_COUNT is an int32, STRIDED_BATCH_OFFSET an int64
                // (0 broadcasts the operand over the batch).
                unsafe {
                    lt::set_matrix_layout_attribute(l, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count as *const i32 as *const _, 4)
                        .and_then(|()| lt::set_matrix_layout_attribute(l, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride as *const i64 as *const _, 8))
                }
                .map_err(|e| err("cublasLtMatrixLayoutSetAttribute", e))?;
            }
        }
        let pref =
            lt::create_matmul_pref().map_err(|e| err("cublasLtMatmulPreferenceCreate", e))?;
        let ws = LT_WORKSPACE as u64;
        // SAFETY: live preference; MAX_WORKSPACE_BYTES is a uint64. The heuristic reads only the
        // live descriptors and layouts. The preference is destroyed right after.
        let heur = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const _,
                8,
            )
            .and_then(|()| {
                let [a, b, c] = plan.layouts;
                lt::get_matmul_algo_heuristic(plan.handle, plan.desc, a, b, c, c, pref)
            })
        };
        // SAFETY: created above, used by nothing else.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let heur = heur.map_err(|e| err("cublasLtMatmulAlgoGetHeuristic", e))?;
        plan.algo = heur.algo;
        plan.config = format!(
            "cublasLtMatmul, heuristic's best algorithm ({} B workspace of {} MiB), {} compute",
            heur.workspaceSize,
            LT_WORKSPACE >> 20,
            match precision {
                Precision::F32 => "fp32",
                Precision::Tf32 => "fast-tf32",
                _ => "fp32-accumulate",
            }
        );
        Ok(plan)
    }

    /// Queues C = α·A·B + β·C for operands at `p` (the problem the plan was made for).
    pub fn run(&self, p: Ptrs, alpha: f32, beta: f32) -> Result<()> {
        use cudarc::cublaslt::result as lt;
        let [a, b, c] = self.layouts;
        // SAFETY: the pointers address the validated operands of the plan's problem on this
        // device (the caller's contract, as for `cublas`); alpha/beta are host f32 (scale type
        // f32); descriptors, algorithm and workspace are live and sized as the heuristic asked.
        unsafe {
            lt::matmul(
                self.handle,
                self.desc,
                &alpha as *const f32 as *const _,
                &beta as *const f32 as *const _,
                p.b as *const _,
                a,
                p.a as *const _,
                b,
                p.c as *const _,
                c,
                p.c as *mut _,
                c,
                &self.algo,
                self.workspace.ptr() as *mut _,
                LT_WORKSPACE,
                self.stream.cu_stream() as _,
            )
        }
        .map_err(|e| Error::cuda("cublasLtMatmul", format!("{e:?}")))
    }
}

impl Drop for LtPlan {
    fn drop(&mut self) {
        use cudarc::cublaslt::result as lt;
        // SAFETY: each object was created by `new` and is destroyed only here (null: never made).
        unsafe {
            for l in self.layouts {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
