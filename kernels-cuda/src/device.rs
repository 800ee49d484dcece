//! [`CudaDevice`]: one GPU, opened for `--device cuda:N`.
//!
//! Opening checks, in order: the driver library is loadable (before any cudarc call, whose
//! loader would panic), the ordinal exists, the compute capability is at least
//! [`MIN_COMPUTE_CAPABILITY`]. It then holds the device's primary context and one stream on
//! which everything of this crate is queued, in order.
//!
//! Allocations go through [`CudaDevice::alloc_zeros`], which refuses a request larger than the
//! free memory up front and maps the driver's `CUDA_ERROR_OUT_OF_MEMORY` (the check races with
//! other processes) to [`CudaError::OutOfMemory`] with both sizes.

use crate::error::{CudaError, CudaLib};
use crate::{MIN_COMPUTE_CAPABILITY, libs};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use std::sync::Arc;

/// One opened GPU: context, stream and what it is.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: usize,
    name: String,
    cc: (u32, u32),
    total_bytes: u64,
    free_bytes_at_open: u64,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

/// Number of CUDA devices, or the typed "no driver" error (never a panic).
pub fn device_count() -> Result<usize, CudaError> {
    libs::require(CudaLib::Driver)?;
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .or_else(|e| {
            // cuInit reports a driver with no GPU as CUDA_ERROR_NO_DEVICE: zero devices.
            if e.0 == cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NO_DEVICE {
                Ok(0)
            } else {
                Err(CudaError::driver("cuDeviceGetCount", e))
            }
        })
}

impl CudaDevice {
    /// Opens device `ordinal` (see the module docs for the checks and their errors).
    pub fn open(ordinal: usize) -> Result<CudaDevice, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::driver("cuCtxRetain", e))?;
        // SAFETY: every buffer this crate allocates is used on its device's one stream (the
        // crate's invariant), so cudarc's cross-stream events are not needed; they would be
        // recorded into graph captures (`graph`).
        unsafe { ctx.disable_event_tracking() };
        let name = ctx
            .name()
            .map_err(|e| CudaError::driver("cuDeviceGetName", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| CudaError::driver("cuDeviceGetAttribute(compute capability)", e))?;
        let cc = (major.max(0) as u32, minor.max(0) as u32);
        if cc < MIN_COMPUTE_CAPABILITY {
            return Err(CudaError::UnsupportedArch {
                ordinal,
                name,
                cc,
                min: MIN_COMPUTE_CAPABILITY,
            });
        }
        let (free, total) = ctx
            .mem_get_info()
            .map_err(|e| CudaError::driver("cuMemGetInfo", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| CudaError::driver("cuStreamCreate", e))?;
        tracing::info!(ordinal, %name, cc = %format_args!("{}.{}", cc.0, cc.1), total, free, "CUDA device opened");
        Ok(CudaDevice {
            ordinal,
            name,
            cc,
            total_bytes: total as u64,
            free_bytes_at_open: free as u64,
            ctx,
            stream,
        })
    }

    /// The ordinal (`cuda:N`).
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The driver's name for the device (`NVIDIA H200`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> (u32, u32) {
        self.cc
    }

    /// The NVRTC target for this device (`sm_90`).
    pub fn arch(&self) -> crate::Arch {
        crate::Arch::from_cc(self.cc)
    }

    /// Total device memory.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Free device memory when the device was opened.
    pub fn free_bytes_at_open(&self) -> u64 {
        self.free_bytes_at_open
    }

    /// Free device memory now.
    pub fn free_bytes(&self) -> Result<u64, CudaError> {
        let (free, _) = self
            .ctx
            .mem_get_info()
            .map_err(|e| CudaError::driver("cuMemGetInfo", e))?;
        Ok(free as u64)
    }

    /// The context (primary context of the device).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream this crate queues work on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for everything queued on [`CudaDevice::stream`].
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(|e| CudaError::driver("cuStreamSynchronize", e))
    }

    /// `len` zeroed elements of `T` on the device, or [`CudaError::OutOfMemory`].
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        let asked = (len as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        let free = self.free_bytes()?;
        let oom = || CudaError::OutOfMemory {
            ordinal: self.ordinal,
            asked_bytes: asked,
            free_bytes: free,
        };
        if asked > free {
            return Err(oom());
        }
        self.stream.alloc_zeros::<T>(len).map_err(|e| {
            if CudaError::is_driver_oom(&e) {
                oom()
            } else {
                CudaError::driver("cuMemAllocAsync", e)
            }
        })
    }

    /// Copies `host` to a new device buffer (checked like [`CudaDevice::alloc_zeros`]).
    pub fn upload<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        host: &[T],
    ) -> Result<CudaSlice<T>, CudaError> {
        let mut dst = self.alloc_zeros::<T>(host.len())?;
        self.stream
            .memcpy_htod(host, &mut dst)
            .map_err(|e| CudaError::driver("cuMemcpyHtoDAsync", e))?;
        Ok(dst)
    }

    /// Copies a device buffer back to the host (waits for the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        src: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        self.stream
            .clone_dtoh(src)
            .map_err(|e| CudaError::driver("cuMemcpyDtoHAsync", e))
    }
}
