//! [`CudaError`], the crate's one error enum.
//!
//! Each variant is classified once, where its cause is known, and carries what an operator needs
//! to act on it: which library and where it was looked for, which device and what it offers, how
//! many bytes were asked for and how many were free, the compiler's own log. Callers decide what
//! to do about it (fall back to the CPU, refuse to start, shrink the KV pool).

use cudarc::driver::DriverError;
use cudarc::driver::sys::cudaError_enum;

/// Everything that can go wrong loading CUDA, compiling kernels, or running them.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The CUDA driver library (`libcuda`) could not be loaded: no NVIDIA driver on this machine,
    /// or it is not on the dynamic loader's path.
    #[error(
        "no CUDA driver: {library} not found (tried {names:?} through the dynamic loader; \
         LD_LIBRARY_PATH={ld_library_path:?})"
    )]
    NoDriver {
        /// The library's usual file name (`libcuda.so.1`).
        library: &'static str,
        /// Every file name tried, in order.
        names: Vec<String>,
        /// The loader's extra search path at the time, if set.
        ld_library_path: Option<String>,
    },

    /// A CUDA library other than the driver (NVRTC, cuBLAS, NCCL) could not be loaded.
    #[error(
        "CUDA library {lib} not found (tried {names:?} through the dynamic loader; \
         LD_LIBRARY_PATH={ld_library_path:?}){hint}"
    )]
    LibraryMissing {
        /// Which library.
        lib: CudaLib,
        /// Every file name tried, in order.
        names: Vec<String>,
        /// The loader's extra search path at the time, if set.
        ld_library_path: Option<String>,
        /// How to install it (empty when there is nothing useful to say).
        hint: &'static str,
    },

    /// The device ordinal asked for does not exist.
    #[error("no CUDA device {ordinal}: this machine has {count} device(s)")]
    NoSuchDevice {
        /// The ordinal asked for (`cuda:N`).
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },

    /// The device is older than the kernels support.
    #[error(
        "CUDA device {ordinal} ({name}) has compute capability {}.{}; tandem needs {}.{} or newer",
        cc.0, cc.1, min.0, min.1
    )]
    UnsupportedArch {
        /// Device ordinal.
        ordinal: usize,
        /// Device name as the driver reports it.
        name: String,
        /// Its compute capability (major, minor).
        cc: (u32, u32),
        /// The oldest compute capability supported ([`crate::MIN_COMPUTE_CAPABILITY`]).
        min: (u32, u32),
    },

    /// An allocation did not fit in device memory.
    #[error(
        "out of device memory on CUDA device {ordinal}: asked {asked_bytes} bytes, {free_bytes} free"
    )]
    OutOfMemory {
        /// Device ordinal.
        ordinal: usize,
        /// Bytes requested.
        asked_bytes: u64,
        /// Bytes the driver reported free (before the request).
        free_bytes: u64,
    },

    /// NVRTC refused a kernel source.
    #[error("NVRTC failed to compile `{source_name}` for {arch} ({nvrtc}):\n{log}")]
    Compile {
        /// The source's name (the `.cu` file).
        source_name: String,
        /// Target architecture (`sm_90`).
        arch: String,
        /// NVRTC's result code, rendered.
        nvrtc: String,
        /// The compiler's log: file, line and message of each diagnostic.
        log: String,
    },

    /// A CUDA driver call failed.
    #[error("CUDA driver call `{op}` failed: {code:?} ({message})")]
    Driver {
        /// What was being done (`cuCtxCreate`, `launch rms_norm_f32`, ...).
        op: &'static str,
        /// The driver's result code.
        code: cudaError_enum,
        /// The driver's error string.
        message: String,
    },

    /// A cuBLAS call failed.
    #[error("cuBLAS call `{op}` failed: {message}")]
    Cublas {
        /// Which operation.
        op: &'static str,
        /// cuBLAS's status, rendered.
        message: String,
    },

    /// An NVRTC call other than the compile itself failed (version query, PTX retrieval).
    #[error("NVRTC call `{op}` failed: {message}")]
    Nvrtc {
        /// Which call.
        op: &'static str,
        /// NVRTC's result, rendered.
        message: String,
    },

    /// A launch was given buffers or shapes that do not agree.
    #[error("{op}: {what}: expected {expected}, got {got}")]
    Shape {
        /// The kernel.
        op: &'static str,
        /// Which argument or dimension.
        what: &'static str,
        /// The value the other arguments imply.
        expected: usize,
        /// The value given.
        got: usize,
    },

    /// Something the CPU kernels support that these do not (yet).
    #[error("{op}: {what} is not supported on CUDA")]
    Unsupported {
        /// The kernel.
        op: &'static str,
        /// What (`int8 KV`, `head_dim 512`).
        what: String,
    },
}

/// The CUDA libraries this crate loads at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaLib {
    /// The driver API (`libcuda`), installed with the NVIDIA driver.
    Driver,
    /// The run-time compiler (`libnvrtc`).
    Nvrtc,
    /// cuBLAS (`libcublas`).
    Cublas,
    /// NCCL (`libnccl`).
    Nccl,
}

impl CudaLib {
    /// A stable lowercase name (logs, metric labels).
    pub const fn as_str(self) -> &'static str {
        match self {
            CudaLib::Driver => "cuda",
            CudaLib::Nvrtc => "nvrtc",
            CudaLib::Cublas => "cublas",
            CudaLib::Nccl => "nccl",
        }
    }
}

impl std::fmt::Display for CudaLib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl CudaError {
    /// A low-cardinality name for metrics and logs.
    pub const fn error_type(&self) -> &'static str {
        match self {
            CudaError::NoDriver { .. } => "no_driver",
            CudaError::LibraryMissing { .. } => "library_missing",
            CudaError::NoSuchDevice { .. } => "no_such_device",
            CudaError::UnsupportedArch { .. } => "unsupported_arch",
            CudaError::OutOfMemory { .. } => "out_of_memory",
            CudaError::Compile { .. } => "compile",
            CudaError::Driver { .. } => "driver",
            CudaError::Cublas { .. } => "cublas",
            CudaError::Nvrtc { .. } => "nvrtc",
            CudaError::Shape { .. } => "shape",
            CudaError::Unsupported { .. } => "unsupported",
        }
    }

    /// Wraps a driver error from `op`, keeping its code and the driver's message.
    pub fn driver(op: &'static str, e: DriverError) -> CudaError {
        let message = e
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "unknown error".to_string());
        CudaError::Driver {
            op,
            code: e.0,
            message,
        }
    }

    /// Whether this is the driver's out-of-memory result (before it is mapped to
    /// [`CudaError::OutOfMemory`], which needs the sizes).
    pub(crate) fn is_driver_oom(e: &DriverError) -> bool {
        e.0 == cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY
    }
}

/// Checks `got == expected` for a launch argument.
pub(crate) fn check_len(
    op: &'static str,
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), CudaError> {
    if expected == got {
        Ok(())
    } else {
        Err(CudaError::Shape {
            op,
            what,
            expected,
            got,
        })
    }
}
