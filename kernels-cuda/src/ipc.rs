//! KV memory two processes on one GPU share by CUDA IPC: the same-GPU path of disaggregated
//! serving (a prefill process copies its blocks straight into a decode process's pool, device to
//! device, no host staging).
//!
//! ```text
//!  decode process                                   prefill process
//!  DeviceKvPool ── KvMemory (cuMemAlloc) ──handle──▶ PeerKvMemory (cuIpcOpenMemHandle)
//!       └─ KvDeviceAccess: hash landed slabs          KvDeviceAccess::open_peer ─▶ copy_and_hash
//! ```
//!
//! # Invariants
//! - A pool that is exported is a plain `cuMemAlloc` allocation ([`KvMemory`]):
//!   `cuIpcGetMemHandle` refuses memory from the stream-ordered pool cudarc allocates from. Every
//!   [`DeviceKvPool`] is allocated this way, so any pool can be exported. The memory is freed
//!   when its last owner drops (the pool, and any [`KvDeviceAccess`] a transfer path holds).
//! - A peer's memory is opened once per process and handle (the driver refuses a second open
//!   of one handle in one context) and closed when its last [`PeerKvMemory`] drops.
//! - Copies and hashes run on the access's own stream, never the engine's (a decode step may be
//!   under graph capture there), and return only once that stream has finished them. The
//!   caller orders them after the engine's writes (a prefill node reports a layer only after
//!   the device is past it).
//! - Checksums are XXH3-64 of each slab (`cu/hash.cu`), the CPU's `slab_checksum`: a block that
//!   moved by IPC is verified like one that came over TCP or UCX.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use crate::buffers::DeviceKvPool;
use crate::device::CudaDevice;
use crate::error::CudaError;
use crate::ptx::PtxCache;

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// A `cuMemAlloc` allocation (exportable by IPC), freed when the last owner drops.
#[derive(Debug)]
pub struct KvMemory {
    ctx: Arc<CudaContext>,
    ptr: CUdeviceptr,
    len: usize,
}

// SAFETY: a device address and its context; the driver API is thread-safe once the context is
// bound, which every use here does first.
unsafe impl Send for KvMemory {}
unsafe impl Sync for KvMemory {}

impl KvMemory {
    /// `len` zeroed bytes on `dev` (checked against free memory like [`CudaDevice::alloc_zeros`]).
    pub(crate) fn alloc_zeroed(dev: &CudaDevice, len: usize) -> Result<Arc<KvMemory>, CudaError> {
        let free = dev.free_bytes()?;
        let oom = || CudaError::OutOfMemory {
            ordinal: dev.ordinal(),
            asked_bytes: len as u64,
            free_bytes: free,
        };
        if len as u64 > free {
            return Err(oom());
        }
        let ctx = Arc::clone(dev.context());
        bind(&ctx)?;
        // SAFETY: a fresh allocation of `len` bytes in the bound context, zeroed before use.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(len.max(1)) }.map_err(|e| {
            if CudaError::is_driver_oom(&e) {
                oom()
            } else {
                CudaError::driver("cuMemAlloc", e)
            }
        })?;
        let mem = Arc::new(KvMemory { ctx, ptr, len });
        // SAFETY: `ptr` holds `len` bytes.
        unsafe { cudarc::driver::result::memset_d8_sync(ptr, 0, len) }
            .map_err(|e| CudaError::driver("cuMemsetD8", e))?;
        Ok(mem)
    }

    /// The device address of the first byte.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Bytes allocated.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty allocation.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for KvMemory {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: allocated by `malloc_sync`, freed once (the last owner); the pool's
            // cudarc view of it never frees (see `DeviceKvPool`).
            if let Err(e) = unsafe { cudarc::driver::result::free_sync(self.ptr) } {
                tracing::warn!(error = %e, "cuMemFree of a KV pool failed");
            }
        }
    }
}

fn bind(ctx: &Arc<CudaContext>) -> Result<(), CudaError> {
    ctx.bind_to_thread()
        .map_err(|e| CudaError::driver("cuCtxSetCurrent", e))
}

/// What a KV transfer path needs of a device pool: its memory, a stream of its own and the
/// slab-hash kernel. Cheap to clone.
#[derive(Clone, Debug)]
pub struct KvDeviceAccess {
    mem: Arc<KvMemory>,
    stream: Arc<CudaStream>,
    hash: CudaFunction,
    uuid: [u8; 16],
    label: Arc<str>,
}

// SAFETY: the function handle is immutable once loaded; launches go through the stream, whose
// use cudarc synchronises.
unsafe impl Send for KvDeviceAccess {}
unsafe impl Sync for KvDeviceAccess {}

impl KvDeviceAccess {
    /// Access to `pool` on `dev` for transfers; loads `hash.cu` (from `cache`).
    pub fn new(
        dev: &CudaDevice,
        pool: &DeviceKvPool,
        cache: &PtxCache,
    ) -> Result<KvDeviceAccess, CudaError> {
        let src = crate::SOURCES
            .iter()
            .find(|s| s.name == "hash.cu")
            .expect("hash.cu is one of SOURCES");
        let (compiled, _) = cache.get_or_compile(src.name, &src.full_text(), dev.arch())?;
        let ctx = dev.context();
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(compiled.ptx))
            .map_err(|e| CudaError::driver("cuModuleLoadData", e))?;
        let hash = module
            .load_function("xxh3_64_slabs")
            .map_err(|e| CudaError::driver("cuModuleGetFunction", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| CudaError::driver("cuStreamCreate", e))?;
        let uuid = ctx
            .uuid()
            .map_err(|e| CudaError::driver("cuDeviceGetUuid", e))?;
        let uuid: [u8; 16] = std::array::from_fn(|i| uuid.bytes[i] as u8);
        Ok(KvDeviceAccess {
            mem: Arc::clone(pool.memory()),
            stream,
            hash,
            uuid,
            label: format!("cuda:{} ({})", dev.ordinal(), dev.name()).into(),
        })
    }

    /// The device's UUID (two processes share a pool only on the same GPU).
    pub fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    /// `cuda:N (name)`, for logs.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Bytes of the pool.
    pub fn len(&self) -> usize {
        self.mem.len
    }

    /// True for an empty pool.
    pub fn is_empty(&self) -> bool {
        self.mem.len == 0
    }

    /// The pool's IPC handle (`cuIpcGetMemHandle`), for a process on the same GPU to open.
    pub fn ipc_handle(&self) -> Result<[u8; IPC_HANDLE_BYTES], CudaError> {
        bind(&self.mem.ctx)?;
        let mut handle = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
        // SAFETY: `mem` is a live `cuMemAlloc` allocation; the driver fills the handle.
        let handle = unsafe {
            sys::cuIpcGetMemHandle(handle.as_mut_ptr(), self.mem.ptr)
                .result()
                .map_err(|e| CudaError::driver("cuIpcGetMemHandle", e))?;
            handle.assume_init()
        };
        Ok(std::array::from_fn(|i| handle.reserved[i] as u8))
    }

    /// XXH3-64 of the `slab_bytes` bytes at each of `offsets` in this pool, in order; waits.
    pub fn hash_slabs(&self, offsets: &[u64], slab_bytes: usize) -> Result<Vec<u64>, CudaError> {
        check_ranges("hash_slabs", offsets.iter().map(|&o| o as usize), slab_bytes, self.mem.len)?;
        bind(&self.mem.ctx)?;
        let sums = self.queue_hash(self.mem.ptr, offsets, slab_bytes)?;
        self.finish(sums)
    }

    fn queue_hash(
        &self,
        base: CUdeviceptr,
        offsets: &[u64],
        slab_bytes: usize,
    ) -> Result<Option<cudarc::driver::CudaSlice<u64>>, CudaError> {
        if offsets.is_empty() {
            return Ok(None);
        }
        let n = offsets.len();
        let offs = self
            .stream
            .clone_htod(offsets)
            .map_err(|e| CudaError::driver("cuMemcpyHtoDAsync", e))?;
        let mut out = self
            .stream
            .alloc_zeros::<u64>(n)
            .map_err(|e| CudaError::driver("cuMemAllocAsync", e))?;
        let (slab, count) = (slab_bytes as u64, n as i32);
        let threads = 128u32;
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(threads), 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&self.hash);
        launch.arg(&base).arg(&offs).arg(&slab).arg(&mut out).arg(&count);
        // SAFETY: the arguments match `xxh3_64_slabs`; every slab lies inside the allocation
        // `base` points to (checked by the caller).
        unsafe { launch.launch(cfg) }.map_err(|e| CudaError::driver("launch xxh3_64_slabs", e))?;
        Ok(Some(out))
    }

    fn finish(&self, sums: Option<cudarc::driver::CudaSlice<u64>>) -> Result<Vec<u64>, CudaError> {
        let out = match sums {
            Some(s) => self
                .stream
                .clone_dtoh(&s)
                .map_err(|e| CudaError::driver("cuMemcpyDtoHAsync", e))?,
            None => Vec::new(),
        };
        self.stream
            .synchronize()
            .map_err(|e| CudaError::driver("cuStreamSynchronize", e))?;
        Ok(out)
    }

    /// Opens a pool another process on this GPU exported (`len` bytes), to copy into.
    pub fn open_peer(
        &self,
        handle: &[u8; IPC_HANDLE_BYTES],
        len: usize,
    ) -> Result<PeerKvMemory, CudaError> {
        let mapping = Mapping::open(&self.mem.ctx, handle, len)?;
        Ok(PeerKvMemory {
            mapping,
            local: self.clone(),
        })
    }
}

/// Every `(offset, len)` lies inside `limit` bytes.
fn check_ranges(
    op: &'static str,
    offsets: impl Iterator<Item = usize>,
    len: usize,
    limit: usize,
) -> Result<(), CudaError> {
    for off in offsets {
        if off.checked_add(len).is_none_or(|end| end > limit) {
            return Err(CudaError::Shape {
                op,
                what: "slab end (within the pool)",
                expected: limit,
                got: off.saturating_add(len),
            });
        }
    }
    Ok(())
}

/// One opened IPC handle of this process.
#[derive(Debug)]
struct Mapping {
    ctx: Arc<CudaContext>,
    ptr: CUdeviceptr,
    len: usize,
    handle: [u8; IPC_HANDLE_BYTES],
}

// SAFETY: as for `KvMemory`.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

fn open_mappings() -> &'static Mutex<HashMap<[u8; IPC_HANDLE_BYTES], Weak<Mapping>>> {
    static OPEN: OnceLock<Mutex<HashMap<[u8; IPC_HANDLE_BYTES], Weak<Mapping>>>> = OnceLock::new();
    OPEN.get_or_init(Default::default)
}

impl Mapping {
    fn open(
        ctx: &Arc<CudaContext>,
        handle: &[u8; IPC_HANDLE_BYTES],
        len: usize,
    ) -> Result<Arc<Mapping>, CudaError> {
        let mut open = open_mappings().lock().expect("IPC mapping table poisoned");
        if let Some(m) = open.get(handle).and_then(Weak::upgrade) {
            if m.len != len {
                let opened = m.len;
                // Unlocked first: if `m` was the last owner, its drop takes the lock.
                drop(open);
                drop(m);
                return Err(CudaError::Shape {
                    op: "cuIpcOpenMemHandle",
                    what: "bytes of the peer's pool (as opened before)",
                    expected: opened,
                    got: len,
                });
            }
            return Ok(m);
        }
        bind(ctx)?;
        let raw = sys::CUipcMemHandle {
            reserved: std::array::from_fn(|i| handle[i] as std::ffi::c_char),
        };
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the driver maps the exporter's allocation and writes its address here.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
            .result()
            .map_err(|e| CudaError::driver("cuIpcOpenMemHandle", e))?;
        }
        let m = Arc::new(Mapping {
            ctx: Arc::clone(ctx),
            ptr,
            len,
            handle: *handle,
        });
        open.retain(|_, w| w.strong_count() > 0);
        open.insert(*handle, Arc::downgrade(&m));
        Ok(m)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // Closed under the table's lock: an `open` of the same handle waits until the driver
        // has closed this mapping (it refuses a second open while one is live).
        let mut open = open_mappings().lock().unwrap_or_else(|p| p.into_inner());
        if bind(&self.ctx).is_ok() {
            // SAFETY: opened by `cuIpcOpenMemHandle`, closed once (the last owner).
            let r = unsafe { sys::cuIpcCloseMemHandle(self.ptr) }.result();
            if let Err(e) = r {
                tracing::warn!(error = %e, "cuIpcCloseMemHandle failed");
            }
        }
        if open.get(&self.handle).is_some_and(|w| w.strong_count() == 0) {
            open.remove(&self.handle);
        }
    }
}

/// A peer process's KV pool opened here: the destination of [`PeerKvMemory::copy_and_hash`].
#[derive(Debug)]
pub struct PeerKvMemory {
    mapping: Arc<Mapping>,
    local: KvDeviceAccess,
}

impl PeerKvMemory {
    /// Bytes of the peer's pool.
    pub fn len(&self) -> usize {
        self.mapping.len
    }

    /// True for an empty pool.
    pub fn is_empty(&self) -> bool {
        self.mapping.len == 0
    }

    /// Copies each `(source offset here, destination offset there)` slab of `slab_bytes`,
    /// returns the XXH3-64 of each source slab in order, and waits until every byte landed.
    /// Slabs adjacent on both sides go as one copy. `flip_at` (fault injection) inverts the
    /// destination byte at that offset after the copy, so the receiver's check must fail.
    pub fn copy_and_hash(
        &self,
        slabs: &[(usize, usize)],
        slab_bytes: usize,
        flip_at: Option<usize>,
    ) -> Result<Vec<u64>, CudaError> {
        let local = &self.local;
        check_ranges("copy_and_hash (source)", slabs.iter().map(|s| s.0), slab_bytes, local.mem.len)?;
        check_ranges("copy_and_hash (destination)", slabs.iter().map(|s| s.1), slab_bytes, self.mapping.len)?;
        if let Some(at) = flip_at {
            check_ranges("copy_and_hash (flip)", std::iter::once(at), 1, self.mapping.len)?;
        }
        bind(&local.mem.ctx)?;
        let cu_stream = local.stream.cu_stream();
        for (src, dst, len) in runs(slabs, slab_bytes) {
            // SAFETY: both ranges are inside their allocations (checked above); the source
            // slabs are final (the caller's ordering) and the destination is reserved for us.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    self.mapping.ptr + dst as u64,
                    local.mem.ptr + src as u64,
                    len,
                    cu_stream,
                )
            }
            .map_err(|e| CudaError::driver("cuMemcpyDtoDAsync (IPC)", e))?;
        }
        let offsets: Vec<u64> = slabs.iter().map(|s| s.0 as u64).collect();
        let sums = local.queue_hash(local.mem.ptr, &offsets, slab_bytes)?;
        let sums = local.finish(sums)?;
        if let Some(at) = flip_at {
            let addr = self.mapping.ptr + at as u64;
            let mut byte = [0u8; 1];
            // SAFETY: one byte inside the mapping (checked above); the stream is idle.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_sync(&mut byte, addr)
                    .map_err(|e| CudaError::driver("cuMemcpyDtoH", e))?;
                cudarc::driver::result::memset_d8_sync(addr, !byte[0], 1)
                    .map_err(|e| CudaError::driver("cuMemsetD8", e))?;
            }
        }
        Ok(sums)
    }
}

/// `(src, dst, len)` runs of slabs adjacent on both sides, in order.
pub fn runs(slabs: &[(usize, usize)], slab_bytes: usize) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for &(s, d) in slabs {
        match out.last_mut() {
            Some((ls, ld, len)) if *ls + *len == s && *ld + *len == d => *len += slab_bytes,
            _ => out.push((s, d, slab_bytes)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slabs_adjacent_on_both_sides_merge_into_one_copy() {
        let slabs = [(0, 100), (10, 110), (20, 120), (40, 130), (50, 140), (60, 0)];
        assert_eq!(
            runs(&slabs, 10),
            vec![(0, 100, 30), (40, 130, 20), (60, 0, 10)]
        );
        assert!(runs(&[], 10).is_empty());
    }

    #[test]
    fn ranges_past_the_pool_are_refused_with_their_end() {
        assert!(check_ranges("t", [0, 90].into_iter(), 10, 100).is_ok());
        let e = check_ranges("t", [0, 91].into_iter(), 10, 100).unwrap_err();
        assert!(matches!(e, CudaError::Shape { expected: 100, got: 101, .. }), "{e}");
        assert!(check_ranges("t", [usize::MAX].into_iter(), 10, 100).is_err());
    }
}
