//! [`Gemm`]: the linear layers on cuBLAS, `out[m × n] = x[m × k] · Wᵀ` with `W` stored
//! `[n × k]` row-major (tandem's `Weight` order: out features × in features), `x` and `out`
//! row-major. f32 weights use `cublasSgemm` (f32 throughout, the default math mode: no TF32);
//! bf16 weights use `cublasGemmEx` with bf16 `W` and `x`, f32 output and f32 accumulation
//! (`CUBLAS_COMPUTE_32F`).
//!
//! Row-major through column-major cuBLAS: a row-major `[r × c]` buffer is the column-major
//! `[c × r]` matrix, its transpose. So `outᵀ (n × m) = W (n × k) · xᵀ (k × m)`: A = `W`'s buffer
//! read transposed (`CUBLAS_OP_T`, lda = k), B = `x`'s buffer as is (`CUBLAS_OP_N`, ldb = k),
//! C = `out`'s buffer (ldc = n). Weight arguments may be views of a larger matrix (a row range
//! of a fused `[q; k; v]` projection), since rows are contiguous.
//!
//! cuBLAS sums in its own order: results agree with the CPU kernels within float rounding, not
//! bit for bit. Everything is queued on the device's one stream.
//!
//! [`Out::Add`] folds a residual add into the GEMM's epilogue (`beta = 1`: `out += x · Wᵀ`),
//! one kernel and one pass over `out` instead of a GEMM into a scratch buffer and an add.

use std::sync::Arc;

use cudarc::cublas::{CudaBlas, Gemm as _, GemmConfig, result, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use crate::device::CudaDevice;
use crate::error::{CudaError, CudaLib, check_len};
use crate::libs;

/// A cuBLAS handle bound to one device's stream.
#[derive(Debug)]
pub struct Gemm {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
    /// cuBLAS's workspace, set once: a GEMM captured into a graph must not allocate.
    _workspace: CudaSlice<u8>,
}

/// What a linear layer does with its output buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Out {
    /// `out = x · Wᵀ` (`beta = 0`: `out`'s old contents are never read).
    Set,
    /// `out += x · Wᵀ` (`beta = 1`): a residual add in the GEMM's epilogue.
    Add,
}

impl Out {
    fn beta(self) -> f32 {
        match self {
            Out::Set => 0.0,
            Out::Add => 1.0,
        }
    }
}

/// Bytes of cuBLAS's workspace (what PyTorch gives it on Hopper).
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

fn dim(op: &'static str, what: &'static str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape { op, what, expected: i32::MAX as usize, got: v })
}

fn cublas(op: &'static str, e: result::CublasError) -> CudaError {
    CudaError::Cublas { op, message: format!("{:?}", e.0) }
}

impl Gemm {
    /// A handle on `dev`'s stream; [`CudaError::LibraryMissing`] when libcublas cannot be loaded.
    pub fn new(dev: &CudaDevice) -> Result<Gemm, CudaError> {
        libs::require(CudaLib::Cublas)?;
        let stream = dev.stream().clone();
        let blas = CudaBlas::new(stream.clone()).map_err(|e| cublas("cublasCreate", e))?;
        let mut workspace = dev.alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES)?;
        {
            let (ptr, _guard) = workspace.device_ptr_mut(&stream);
            // SAFETY: the workspace lives as long as the handle (both are fields of `Gemm`), is
            // used only on this stream, and is `CUBLAS_WORKSPACE_BYTES` long.
            unsafe { sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, CUBLAS_WORKSPACE_BYTES) }
                .result()
                .map_err(|e| cublas("cublasSetWorkspace", e))?;
        }
        Ok(Gemm { blas, stream, _workspace: workspace })
    }

    fn check(
        op: &'static str,
        (x_len, w_len, out_len): (usize, usize, usize),
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(i32, i32, i32), CudaError> {
        check_len(op, "x (m * k)", m * k, x_len)?;
        check_len(op, "w (n * k)", n * k, w_len)?;
        check_len(op, "out (m * n)", m * n, out_len)?;
        Ok((dim(op, "m", m)?, dim(op, "n", n)?, dim(op, "k", k)?))
    }

    /// `out = x · Wᵀ` (or `+=`, [`Out::Add`]) in f32: `x` `[m × k]`, `w` `[n × k]`, `out` `[m × n]`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_f32<X, W, O>(&self, x: &X, m: usize, w: &W, n: usize, k: usize, out: &mut O, mode: Out) -> Result<(), CudaError>
    where
        X: DevicePtr<f32>,
        W: DevicePtr<f32>,
        O: DevicePtrMut<f32>,
    {
        const OP: &str = "linear_f32 (cublasSgemm)";
        let (m32, n32, k32) = Self::check(OP, (x.len(), w.len(), out.len()), m, n, k)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let cfg = GemmConfig {
            transa: sys::cublasOperation_t::CUBLAS_OP_T,
            transb: sys::cublasOperation_t::CUBLAS_OP_N,
            m: n32,
            n: m32,
            k: k32,
            alpha: 1.0f32,
            lda: k32,
            ldb: k32,
            beta: mode.beta(),
            ldc: n32,
        };
        // SAFETY: the lengths were checked against (m, n, k) above, and the leading dimensions
        // are those of dense row-major buffers of exactly those shapes (module docs).
        unsafe { self.blas.gemm(cfg, w, x, out) }.map_err(|e| cublas(OP, e))
    }

    /// `out = x · Wᵀ` (or `+=`, [`Out::Add`]) with bf16 `x` and `w` (bits as `u16`) and an f32
    /// `out`, accumulated in f32.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_bf16<X, W, O>(&self, x: &X, m: usize, w: &W, n: usize, k: usize, out: &mut O, mode: Out) -> Result<(), CudaError>
    where
        X: DevicePtr<u16>,
        W: DevicePtr<u16>,
        O: DevicePtrMut<f32>,
    {
        const OP: &str = "linear_bf16 (cublasGemmEx)";
        let (m32, n32, k32) = Self::check(OP, (x.len(), w.len(), out.len()), m, n, k)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, mode.beta());
        let (wp, _w_guard) = w.device_ptr(&self.stream);
        let (xp, _x_guard) = x.device_ptr(&self.stream);
        let (op, _o_guard) = out.device_ptr_mut(&self.stream);
        // SAFETY: as in `linear_f32`; the pointers stay valid while their guards live (to the
        // end of this function, after the call is queued on the stream they were recorded on).
        unsafe {
            result::gemm_ex(
                *self.blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                n32,
                m32,
                k32,
                (&alpha) as *const f32 as *const _,
                wp as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                k32,
                xp as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                k32,
                (&beta) as *const f32 as *const _,
                op as *mut _,
                sys::cudaDataType_t::CUDA_R_32F,
                n32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| cublas(OP, e))
    }
}
