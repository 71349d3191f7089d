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

fn lt_err(what: &str, label: &str, e: cudarc::cublaslt::result::CublasError) -> Error {
    Error::cuda(format!("{what} ({label})"), format!("{e:?}"))
}

/// An FP8 problem for cuBLASLt (the scaled GEMM's peer): D `[m][n]` = sa·sb·A·Bᵀ (+ bias), A
/// `[m][k]` and B `[n][k]` (k contiguous, rows `lda` / `ldb` apart), D rows `ldc` apart; the
/// scales are device pointers to one f32 each, the bias (0: none) `[n]` in D's dtype.
pub struct LtOperands {
    pub label: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a_dtype: DType,
    pub b_dtype: DType,
    pub c_dtype: DType,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    pub scale_a: u64,
    pub scale_b: u64,
    pub bias: u64,
    /// cuBLASLt's FAST_ACCUM: the tensor core's accumulator holds the whole k sum.
    pub fast_accum: bool,
}

/// cudarc's cuBLASLt data type of a dtype.
fn lt_type(dtype: DType) -> Option<cudarc::cublaslt::sys::cudaDataType> {
    use cudarc::cublaslt::sys::cudaDataType as T;
    Some(match dtype {
        DType::F32 => T::CUDA_R_32F,
        DType::F16 => T::CUDA_R_16F,
        DType::BF16 => T::CUDA_R_16BF,
        DType::F8E4M3 => T::CUDA_R_8F_E4M3,
        DType::F8E5M2 => T::CUDA_R_8F_E5M2,
        _ => return None,
    })
}

impl LtPlan {
    /// An empty plan on `dev`: the library checked, its workspace and handle made; the caller
    /// sets the descriptor and layouts, then `pick_algo`.
    fn open(
        dev: &Arc<CudaDevice>,
        compute: cudarc::cublaslt::sys::cublasComputeType_t,
        label: &str,
        stream: &Stream,
    ) -> Result<Self> {
        use cudarc::cublaslt::{result as lt, sys};
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::CudaUnavailable(
                "cuBLASLt (libcublasLt.so.13) not found by the loader".into(),
            ));
        }
        dev.bind()?;
        let workspace = dev.alloc(LT_WORKSPACE, stream)?;
        let handle = lt::create_handle().map_err(|e| lt_err("cublasLtCreate", label, e))?;
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
            .map_err(|e| lt_err("cublasLtMatmulDescCreate", label, e))?;
        Ok(plan)
    }

    /// Sets one matmul-descriptor attribute to the bytes of `v`.
    fn set_attr<T: Copy>(
        &self,
        attr: cudarc::cublaslt::sys::cublasLtMatmulDescAttributes_t,
        v: T,
        label: &str,
    ) -> Result<()> {
        use cudarc::cublaslt::result as lt;
        // SAFETY: live descriptor; `v` is the attribute's C type (each caller passes the type
        // cuBLASLt documents for the attribute), read for its size only.
        unsafe {
            lt::set_matmul_desc_attribute(
                self.desc,
                attr,
                &v as *const T as *const _,
                std::mem::size_of::<T>(),
            )
        }
        .map_err(|e| lt_err("cublasLtMatmulDescSetAttribute", label, e))
    }

    /// Layout `i` (0: cuBLAS's A, 1: its B, 2: C and D), column-major `rows × cols` with
    /// leading dimension `ld`, batched when `batch > 1`.
    #[allow(clippy::too_many_arguments)]
    fn set_layout(
        &mut self,
        i: usize,
        dt: cudarc::cublaslt::sys::cudaDataType,
        (rows, cols, ld): (usize, usize, usize),
        batch: usize,
        stride: usize,
        label: &str,
    ) -> Result<()> {
        use cudarc::cublaslt::{result as lt, sys};
        let l = lt::create_matrix_layout(dt, rows as u64, cols as u64, ld as i64)
            .map_err(|e| lt_err("cublasLtMatrixLayoutCreate", label, e))?;
        self.layouts[i] = l;
        if batch > 1 {
            let (count, stride) = (batch as i32, stride as i64);
            // SAFETY: live layout; BATCH_COUNT is an int32, STRIDED_BATCH_OFFSET an int64
            // (0 broadcasts the operand over the batch).
            unsafe {
                lt::set_matrix_layout_attribute(l, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count as *const i32 as *const _, 4)
                    .and_then(|()| lt::set_matrix_layout_attribute(l, sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride as *const i64 as *const _, 8))
            }
            .map_err(|e| lt_err("cublasLtMatrixLayoutSetAttribute", label, e))?;
        }
        Ok(())
    }

    /// The heuristic's best algorithm for the descriptor and layouts (a 32 MiB workspace).
    fn pick_algo(&mut self, label: &str, compute: &str) -> Result<()> {
        use cudarc::cublaslt::{result as lt, sys};
        let pref = lt::create_matmul_pref()
            .map_err(|e| lt_err("cublasLtMatmulPreferenceCreate", label, e))?;
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
                let [a, b, c] = self.layouts;
                lt::get_matmul_algo_heuristic(self.handle, self.desc, a, b, c, c, pref)
            })
        };
        // SAFETY: created above, used by nothing else.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let heur = heur.map_err(|e| lt_err("cublasLtMatmulAlgoGetHeuristic", label, e))?;
        self.algo = heur.algo;
        self.config = format!(
            "cublasLtMatmul, heuristic's best algorithm ({} B workspace of {} MiB), {compute} compute",
            heur.workspaceSize,
            LT_WORKSPACE >> 20,
        );
        Ok(())
    }

    pub fn new(
        dev: &Arc<CudaDevice>,
        g: &Gemm,
        precision: Precision,
        stream: &Stream,
    ) -> Result<Self> {
        use cudarc::cublaslt::sys;
        let label = g.label();
        // The same mapping as `cublas` above, but cudarc's cuBLASLt bindings declare their own
        // copies of these enums, so the two matches cannot share one function.
        let (dt, compute) = match (lt_type(g.dtype), precision) {
            (Some(dt), Precision::Tf32) if g.dtype == DType::F32 => {
                (dt, sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32)
            }
            (Some(dt), _) if g.dtype.is_float() => {
                (dt, sys::cublasComputeType_t::CUBLAS_COMPUTE_32F)
            }
            _ => {
                return Err(Error::bad_arg(
                    "cublaslt",
                    "dtype",
                    "f32, f16 or bf16",
                    g.dtype,
                ))
            }
        };
        let mut plan = Self::open(dev, compute, &label, stream)?;
        // cuBLAS's column-major view: its A is our B (n × k), its B our A (k × m), C is n × m.
        // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
        use sys::cublasLtMatmulDescAttributes_t as D;
        plan.set_attr(D::CUBLASLT_MATMUL_DESC_TRANSA, g.b.trans as i32, &label)?;
        plan.set_attr(D::CUBLASLT_MATMUL_DESC_TRANSB, g.a.trans as i32, &label)?;
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
            plan.set_layout(i, dt, (rows, cols, op.ld), g.batch, op.batch_stride, &label)?;
        }
        plan.pick_algo(
            &label,
            match precision {
                Precision::F32 => "fp32",
                Precision::Tf32 => "fast-tf32",
                _ => "fp32-accumulate",
            },
        )?;
        Ok(plan)
    }

    /// cuBLASLt's FP8 matmul for `o` (Hopper takes it in the "TN" form only: in the column-major
    /// view its A is our B transposed — `[n][k]` rows are a k × n column-major matrix — and its
    /// B our A as is). The scales go in as device pointers (A_SCALE is cuBLAS's A: our B's).
    pub fn with_operands(dev: &Arc<CudaDevice>, o: &LtOperands, stream: &Stream) -> Result<Self> {
        use cudarc::cublaslt::sys;
        use sys::cublasLtMatmulDescAttributes_t as D;
        let label = &o.label;
        let ty = |d: DType| {
            lt_type(d)
                .ok_or_else(|| Error::bad_arg("cublaslt", "dtype", "an FP8 or float dtype", d))
        };
        let (ta, tb, tc) = (ty(o.a_dtype)?, ty(o.b_dtype)?, ty(o.c_dtype)?);
        let mut plan = Self::open(
            dev,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            label,
            stream,
        )?;
        plan.set_attr(D::CUBLASLT_MATMUL_DESC_TRANSA, 1i32, label)?;
        plan.set_attr(D::CUBLASLT_MATMUL_DESC_TRANSB, 0i32, label)?;
        plan.set_attr(D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, o.scale_b, label)?;
        plan.set_attr(D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, o.scale_a, label)?;
        plan.set_attr(
            D::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
            o.fast_accum as i8,
            label,
        )?;
        if o.bias != 0 {
            // CUBLASLT_EPILOGUE_BIAS = 4: a bias per row of cuBLAS's D (our columns).
            plan.set_attr(D::CUBLASLT_MATMUL_DESC_EPILOGUE, 4u32, label)?;
            plan.set_attr(D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, o.bias, label)?;
        }
        plan.set_layout(0, tb, (o.k, o.n, o.ldb), 1, 0, label)?;
        plan.set_layout(1, ta, (o.k, o.m, o.lda), 1, 0, label)?;
        plan.set_layout(2, tc, (o.n, o.m, o.ldc), 1, 0, label)?;
        plan.pick_algo(
            label,
            if o.fast_accum {
                "FP8, fast-accumulate"
            } else {
                "FP8, fp32-accumulate"
            },
        )?;
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
