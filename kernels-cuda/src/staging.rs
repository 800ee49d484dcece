//! Moving KV bytes between a [`DeviceKvPool`] and host memory laid out the same way: the staged
//! path of disaggregated serving on a GPU. A prefill node's KV is computed in device memory and
//! copied, layer by layer, into the host pool its transport (UCX or TCP) sends from; a decode
//! node's transport writes into its host pool, and the adopted blocks are copied up to the
//! device before the first decode step reads them.
//!
//! # Invariants
//! - Host and device pools have the same layout and block count, so a byte range means the same
//!   (layer, block) slabs on both sides; the caller passes ranges in pool bytes and every range is
//!   checked against both lengths before anything is queued.
//! - Copies are queued on the device's one stream, so a copy out of the pool follows the kernel
//!   that wrote those bytes, and a copy into the pool precedes every kernel queued after it.
//! - A device → host copy into page-locked memory ([`PinnedHost`]) completes asynchronously:
//!   the host bytes may be read only after a [`StreamMark`] recorded after the copy was waited
//!   for. Into pageable memory the driver copies synchronously (slower, same result).

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, DevicePtr, DevicePtrMut, result, sys};

use crate::buffers::DeviceKvPool;
use crate::device::CudaDevice;
use crate::error::CudaError;

/// Host memory registered with the driver as page-locked (`cuMemHostRegister`), so copies to
/// and from it are DMA and run asynchronously on the stream. Unregistered on drop.
#[derive(Debug)]
pub struct PinnedHost {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the registration is a driver-side record of an address range; the pointer is never
// dereferenced here, only passed back to `cuMemHostUnregister` (callable from any thread once
// the context is bound).
unsafe impl Send for PinnedHost {}
unsafe impl Sync for PinnedHost {}

impl PinnedHost {
    /// Registers `len` bytes at `ptr` as page-locked memory of `dev`'s context (portable to
    /// every context). Fails with the driver's code when the range cannot be locked (e.g. the
    /// memory lock limit, or memory another driver mapped); callers may go on with pageable
    /// copies.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be host memory that stays mapped until the returned value is
    /// dropped.
    pub unsafe fn register(dev: &CudaDevice, ptr: *mut u8, len: usize) -> Result<PinnedHost, CudaError> {
        let ctx = dev.context().clone();
        ctx.bind_to_thread().map_err(|e| CudaError::driver("cuCtxSetCurrent", e))?;
        // SAFETY: the caller keeps the range mapped for our lifetime.
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) }
            .result()
            .map_err(|e| CudaError::driver("cuMemHostRegister", e))?;
        Ok(PinnedHost { ctx, ptr, len })
    }

    /// Bytes registered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no bytes are registered (never: registering zero bytes fails).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` was registered by `register` and is still mapped (its contract).
        let r = unsafe { sys::cuMemHostUnregister(self.ptr.cast()) }.result();
        if let Err(e) = r {
            tracing::warn!(error = ?e, bytes = self.len, "cuMemHostUnregister failed");
        }
    }
}

/// A point in the device's stream: everything queued before it has run once
/// [`wait`](StreamMark::wait) returns.
#[derive(Debug)]
pub struct StreamMark(CudaEvent);

impl StreamMark {
    /// Blocks the calling thread until the stream has passed this mark.
    pub fn wait(&self) -> Result<(), CudaError> {
        self.0.synchronize().map_err(|e| CudaError::driver("cuEventSynchronize", e))
    }
}

impl CudaDevice {
    /// Records a mark on the stream after everything queued so far (timing off: a marker only).
    pub fn mark(&self) -> Result<StreamMark, CudaError> {
        self.stream()
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map(StreamMark)
            .map_err(|e| CudaError::driver("cuEventRecord", e))
    }
}

fn check_ranges(op: &'static str, ranges: &[Range<usize>], pool_len: usize, host_len: usize) -> Result<(), CudaError> {
    for r in ranges {
        let end = r.end.max(r.start);
        if end > pool_len || end > host_len {
            return Err(CudaError::Shape {
                op,
                what: "end of a copied byte range (<= both pools' bytes)",
                expected: pool_len.min(host_len),
                got: end,
            });
        }
    }
    Ok(())
}

impl DeviceKvPool {
    /// Queues copies of `ranges` (byte ranges of the pool) into the same ranges of the host
    /// region at `host` (`host_len` bytes, laid out as this pool). Nothing is queued when a
    /// range lies outside either side.
    ///
    /// # Safety
    /// `host..host + host_len` must stay valid and writable, and be neither read nor written by
    /// anyone else within `ranges`, until a [`StreamMark`] recorded after this call was waited
    /// for (pinned memory is written asynchronously).
    pub unsafe fn copy_to_host(
        &self,
        dev: &CudaDevice,
        ranges: &[Range<usize>],
        host: *mut u8,
        host_len: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "DeviceKvPool::copy_to_host";
        check_ranges(OP, ranges, self.bytes.len(), host_len)?;
        let stream = dev.stream();
        let (base, _guard) = self.bytes.device_ptr(stream);
        for r in ranges.iter().filter(|r| !r.is_empty()) {
            // SAFETY: the range is inside both regions (checked above); the caller keeps the
            // host side valid and untouched until the copy is known to be done.
            let dst = unsafe { std::slice::from_raw_parts_mut(host.add(r.start), r.len()) };
            unsafe { result::memcpy_dtoh_async(dst, base + r.start as u64, stream.cu_stream()) }
                .map_err(|e| CudaError::driver("cuMemcpyDtoHAsync", e))?;
        }
        Ok(())
    }

    /// Queues copies of `ranges` of the host region at `host` (`host_len` bytes, laid out as
    /// this pool) into the same ranges of this pool; every kernel queued later sees them.
    /// Nothing is queued when a range lies outside either side.
    ///
    /// # Safety
    /// `host..host + host_len` must stay valid, and unchanged within `ranges`, until a
    /// [`StreamMark`] recorded after this call was waited for.
    pub unsafe fn copy_from_host(
        &mut self,
        dev: &CudaDevice,
        ranges: &[Range<usize>],
        host: *const u8,
        host_len: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "DeviceKvPool::copy_from_host";
        check_ranges(OP, ranges, self.bytes.len(), host_len)?;
        let stream = dev.stream();
        let (base, _guard) = self.bytes.device_ptr_mut(stream);
        for r in ranges.iter().filter(|r| !r.is_empty()) {
            // SAFETY: as in `copy_to_host`, read-only on the host side.
            let src = unsafe { std::slice::from_raw_parts(host.add(r.start), r.len()) };
            unsafe { result::memcpy_htod_async(base + r.start as u64, src, stream.cu_stream()) }
                .map_err(|e| CudaError::driver("cuMemcpyHtoDAsync", e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_past_either_side_are_refused_before_anything_is_queued() {
        assert!(check_ranges("t", &[0..10, 10..20], 20, 20).is_ok());
        assert!(check_ranges("t", &[0..0, 0..0], 0, 0).is_ok());
        let e = check_ranges("t", &[0..10, 15..21], 32, 20).unwrap_err();
        assert!(matches!(e, CudaError::Shape { expected: 20, got: 21, .. }), "{e}");
        let e = check_ranges("t", &[0..4, 30..33], 32, 64).unwrap_err();
        assert!(matches!(e, CudaError::Shape { expected: 32, got: 33, .. }), "{e}");
    }
}
