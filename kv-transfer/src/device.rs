//! KV memory on a GPU that a transfer reaches directly: the seam between the CUDA IPC data path
//! ([`crate::cuda_ipc`]) and device code.
//!
//! A node whose engine keeps its KV on a GPU registers the host mirror with its transport as
//! usual (same layout and block count, so a pool offset names the same bytes on both) and
//! attaches the device pool as a [`DeviceKv`]. Between two such nodes on the same GPU the
//! sender copies device to device into the receiver's pool, opened by its IPC handle, and both
//! sides checksum on the device.
//!
//! Two implementations: [`CudaDeviceKv`] (the real one, over `tandem-kernels-cuda`) and
//! [`HostDeviceKv`], host memory standing in for a GPU so the protocol runs in the ordinary
//! suite without one (a test implementation: nothing named CUDA runs on the CPU).
//!
//! # Invariants
//! - `hash_slabs` and `copy_and_hash` return only once the device is done: when they return, the
//!   hashed bytes are final and copied bytes have landed.
//! - Checksums are XXH3-64 per slab, exactly [`crate::checksum::slab_checksum`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use crate::checksum::slab_checksum;
use crate::error::TransferError;

/// KV memory on a device (see the module docs).
pub trait DeviceKv: Send + Sync + 'static {
    /// `cuda:0 (NVIDIA H200)`, for logs.
    fn label(&self) -> String;

    /// The device's UUID: two pools share bytes directly only on the same device.
    fn device_uuid(&self) -> [u8; 16];

    /// Bytes of the pool.
    fn len_bytes(&self) -> usize;

    /// A handle another process on this device opens with [`DeviceKv::open_peer`].
    fn export(&self) -> Result<Vec<u8>, TransferError>;

    /// XXH3-64 of the `slab_bytes` bytes at each offset, in order.
    fn hash_slabs(&self, offsets: &[usize], slab_bytes: usize) -> Result<Vec<u64>, TransferError>;

    /// Opens a peer's exported pool (`len_bytes` long) to copy into.
    fn open_peer(
        &self,
        handle: &[u8],
        len_bytes: usize,
    ) -> Result<Box<dyn DevicePeer>, TransferError>;
}

/// A peer's pool opened here.
pub trait DevicePeer: Send + Sync {
    /// Copies each `(source offset here, destination offset there)` slab and returns the
    /// XXH3-64 of each source slab, in order, once every byte landed. `flip_at` (fault
    /// injection) inverts the destination byte at that offset afterwards.
    fn copy_and_hash(
        &self,
        slabs: &[(usize, usize)],
        slab_bytes: usize,
        flip_at: Option<usize>,
    ) -> Result<Vec<u64>, TransferError>;
}

fn device_error(op: &'static str, e: impl std::fmt::Display) -> TransferError {
    TransferError::Device {
        op,
        message: e.to_string(),
    }
}

/// The real device: a KV pool in GPU memory (`tandem-kernels-cuda`).
pub struct CudaDeviceKv(pub tandem_kernels_cuda::KvDeviceAccess);

impl DeviceKv for CudaDeviceKv {
    fn label(&self) -> String {
        self.0.label().to_string()
    }

    fn device_uuid(&self) -> [u8; 16] {
        self.0.uuid()
    }

    fn len_bytes(&self) -> usize {
        self.0.len()
    }

    fn export(&self) -> Result<Vec<u8>, TransferError> {
        self.0
            .ipc_handle()
            .map(|h| h.to_vec())
            .map_err(|e| device_error("cuIpcGetMemHandle", e))
    }

    fn hash_slabs(&self, offsets: &[usize], slab_bytes: usize) -> Result<Vec<u64>, TransferError> {
        let offsets: Vec<u64> = offsets.iter().map(|&o| o as u64).collect();
        self.0
            .hash_slabs(&offsets, slab_bytes)
            .map_err(|e| device_error("hash landed slabs", e))
    }

    fn open_peer(
        &self,
        handle: &[u8],
        len_bytes: usize,
    ) -> Result<Box<dyn DevicePeer>, TransferError> {
        let handle: &[u8; tandem_kernels_cuda::ipc::IPC_HANDLE_BYTES] =
            handle.try_into().map_err(|_| {
                TransferError::protocol("ipc_handle", format!("{} bytes, not 64", handle.len()))
            })?;
        let peer = self
            .0
            .open_peer(handle, len_bytes)
            .map_err(|e| device_error("cuIpcOpenMemHandle", e))?;
        Ok(Box::new(CudaPeer(peer)))
    }
}

struct CudaPeer(tandem_kernels_cuda::PeerKvMemory);

impl DevicePeer for CudaPeer {
    fn copy_and_hash(
        &self,
        slabs: &[(usize, usize)],
        slab_bytes: usize,
        flip_at: Option<usize>,
    ) -> Result<Vec<u64>, TransferError> {
        self.0
            .copy_and_hash(slabs, slab_bytes, flip_at)
            .map_err(|e| device_error("copy into the peer's pool", e))
    }
}

/// Host memory standing in for a device pool, for tests of the IPC protocol without a GPU:
/// "exporting" registers the memory in a process-wide table under a fresh handle, and a peer
/// in the same process "opens" it from there. Its UUID is chosen by the test (two pools with
/// the same UUID are "on the same device").
pub struct HostDeviceKv {
    uuid: [u8; 16],
    mem: Arc<Mutex<Vec<u8>>>,
    handle: OnceLock<Vec<u8>>,
}

type HostTable = Mutex<HashMap<Vec<u8>, Arc<Mutex<Vec<u8>>>>>;

fn host_table() -> &'static HostTable {
    static TABLE: OnceLock<HostTable> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

impl HostDeviceKv {
    /// `len_bytes` zeroed bytes "on" device `uuid`.
    pub fn new(uuid: [u8; 16], len_bytes: usize) -> Self {
        Self {
            uuid,
            mem: Arc::new(Mutex::new(vec![0; len_bytes])),
            handle: OnceLock::new(),
        }
    }

    /// A copy of the bytes at `offset..offset + len`.
    pub fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        self.mem.lock().expect("poisoned")[offset..offset + len].to_vec()
    }

    /// Writes `bytes` at `offset` (what a forward pass would have written).
    pub fn write(&self, offset: usize, bytes: &[u8]) {
        self.mem.lock().expect("poisoned")[offset..offset + bytes.len()].copy_from_slice(bytes);
    }
}

fn check(op: &'static str, off: usize, len: usize, limit: usize) -> Result<(), TransferError> {
    if off.checked_add(len).is_none_or(|end| end > limit) {
        return Err(device_error(
            op,
            format!("bytes {off}..+{len} outside a pool of {limit}"),
        ));
    }
    Ok(())
}

impl DeviceKv for HostDeviceKv {
    fn label(&self) -> String {
        format!("host stand-in {:02x}{:02x}", self.uuid[0], self.uuid[1])
    }

    fn device_uuid(&self) -> [u8; 16] {
        self.uuid
    }

    fn len_bytes(&self) -> usize {
        self.mem.lock().expect("poisoned").len()
    }

    fn export(&self) -> Result<Vec<u8>, TransferError> {
        Ok(self
            .handle
            .get_or_init(|| {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
                let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let mut h = vec![0u8; 64];
                h[..8].copy_from_slice(&id.to_le_bytes());
                host_table()
                    .lock()
                    .expect("poisoned")
                    .insert(h.clone(), Arc::clone(&self.mem));
                h
            })
            .clone())
    }

    fn hash_slabs(&self, offsets: &[usize], slab_bytes: usize) -> Result<Vec<u64>, TransferError> {
        let mem = self.mem.lock().expect("poisoned");
        offsets
            .iter()
            .map(|&o| {
                check("hash_slabs", o, slab_bytes, mem.len())?;
                Ok(slab_checksum(&mem[o..o + slab_bytes]))
            })
            .collect()
    }

    fn open_peer(
        &self,
        handle: &[u8],
        len_bytes: usize,
    ) -> Result<Box<dyn DevicePeer>, TransferError> {
        let dst = host_table()
            .lock()
            .expect("poisoned")
            .get(handle)
            .cloned()
            .ok_or_else(|| device_error("open_peer", "no pool exported under that handle"))?;
        if Arc::ptr_eq(&dst, &self.mem) {
            return Err(device_error(
                "open_peer",
                "a pool cannot open its own handle",
            ));
        }
        let have = dst.lock().expect("poisoned").len();
        if have != len_bytes {
            return Err(device_error(
                "open_peer",
                format!("pool of {have} bytes, offer said {len_bytes}"),
            ));
        }
        Ok(Box::new(HostPeer {
            src: Arc::clone(&self.mem),
            dst,
        }))
    }
}

struct HostPeer {
    src: Arc<Mutex<Vec<u8>>>,
    dst: Arc<Mutex<Vec<u8>>>,
}

impl DevicePeer for HostPeer {
    fn copy_and_hash(
        &self,
        slabs: &[(usize, usize)],
        slab_bytes: usize,
        flip_at: Option<usize>,
    ) -> Result<Vec<u64>, TransferError> {
        let src = self.src.lock().expect("poisoned");
        let mut dst = self.dst.lock().expect("poisoned");
        let mut sums = Vec::with_capacity(slabs.len());
        for &(s, d) in slabs {
            check("copy (source)", s, slab_bytes, src.len())?;
            check("copy (destination)", d, slab_bytes, dst.len())?;
            dst[d..d + slab_bytes].copy_from_slice(&src[s..s + slab_bytes]);
            sums.push(slab_checksum(&src[s..s + slab_bytes]));
        }
        if let Some(at) = flip_at {
            check("flip", at, 1, dst.len())?;
            dst[at] = !dst[at];
        }
        Ok(sums)
    }
}
