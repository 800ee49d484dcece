//! Device buffers the kernels work on: the KV pool in `tandem-kv-layout`'s byte layout and its
//! per-layer geometry ([`KvGeom`], the C struct's twin), the RoPE table (the CPU's, uploaded
//! once), and the decode workspace (allocated once, so a decode step allocates nothing).

use crate::device::CudaDevice;
use crate::error::{CudaError, check_len};
use crate::ipc::KvMemory;
use crate::launch;
use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use tandem_kernels::sample::SampleSpec;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use tandem_kernels::RopeTable;
use tandem_kv_layout::{KvDtype, KvLayout};

/// Where one layer of the KV pool is and how it is shaped, as the kernels take it (`KvGeom` in
/// `cu/common.cuh`; the field order and padding must match it).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeom {
    /// Byte offset of slab (layer, block 0): `layer * num_blocks * slab_bytes`.
    pub layer_base: i64,
    /// Bytes of one (layer, block) slab.
    pub slab_bytes: i64,
    /// Blocks in the pool.
    pub num_blocks: i64,
    /// KV heads.
    pub kv_heads: i32,
    /// Elements per head.
    pub head_dim: i32,
    /// Tokens per block.
    pub block_size: i32,
    _pad: i32,
}

// SAFETY: `#[repr(C)]`, plain integers, the same layout as the CUDA struct (3 × i64, 3 × int,
// padded to 40 bytes, 8-byte aligned).
unsafe impl DeviceRepr for KvGeom {}

/// One row's sampling parameters as `sample.cu` reads them ([`SampleSpec`] in device layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SampleRow {
    /// 0 = greedy.
    pub temperature: f32,
    /// In `(0, 1]`; 1 = no limit.
    pub top_p: f32,
    /// 0 = no limit; 1 = greedy.
    pub top_k: u32,
    _pad: u32,
    /// The row's uniform draw (low 53 bits).
    pub draw: u64,
}

// SAFETY: `#[repr(C)]`, plain numbers, the CUDA struct's layout (f32, f32, u32, u32, u64: 24
// bytes, 8-byte aligned).
unsafe impl DeviceRepr for SampleRow {}
// SAFETY: all zeros is a valid value (greedy, draw 0).
unsafe impl ValidAsZeroBits for SampleRow {}

impl From<&SampleSpec> for SampleRow {
    fn from(s: &SampleSpec) -> SampleRow {
        SampleRow { temperature: s.temperature, top_p: s.top_p, top_k: s.top_k, _pad: 0, draw: s.draw }
    }
}

impl KvGeom {
    /// The geometry of `layer` of a pool of `num_blocks` blocks.
    pub fn new(layout: &KvLayout, num_blocks: usize, layer: usize) -> KvGeom {
        KvGeom {
            layer_base: layout.slab_offset(num_blocks, layer, 0) as i64,
            slab_bytes: layout.slab_bytes() as i64,
            num_blocks: num_blocks as i64,
            kv_heads: layout.num_kv_heads as i32,
            head_dim: layout.head_dim as i32,
            block_size: layout.block_size_tokens as i32,
            _pad: 0,
        }
    }
}

/// A paged KV pool in device memory, in `tandem-kv-layout`'s byte layout.
///
/// The memory is a plain `cuMemAlloc` allocation ([`crate::ipc::KvMemory`]), so another
/// process on the GPU can open it by CUDA IPC; `bytes` is cudarc's view of it, which never
/// frees it (the allocation goes when its last owner does: this pool or a transfer path's
/// [`crate::ipc::KvDeviceAccess`]).
#[derive(Debug)]
pub struct DeviceKvPool {
    /// The layout (f32, f16 or bf16).
    pub layout: KvLayout,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// `layout.pool_bytes(num_blocks)` bytes (a view of `memory`).
    pub bytes: ManuallyDrop<CudaSlice<u8>>,
    memory: Arc<KvMemory>,
}

impl Drop for DeviceKvPool {
    fn drop(&mut self) {
        // SAFETY: dropped once, here; `leak` hands the address back without freeing it (the
        // `KvMemory` owns the allocation).
        let view = unsafe { ManuallyDrop::take(&mut self.bytes) };
        let _ = view.leak();
    }
}

impl DeviceKvPool {
    /// A zeroed pool of `num_blocks` blocks; Int8 layouts are refused.
    pub fn new(
        dev: &CudaDevice,
        layout: KvLayout,
        num_blocks: usize,
    ) -> Result<DeviceKvPool, CudaError> {
        check_dtype("DeviceKvPool::new", layout.dtype)?;
        let len = layout.pool_bytes(num_blocks);
        let memory = KvMemory::alloc_zeroed(dev, len)?;
        // SAFETY: `memory` holds `len` zeroed bytes and outlives the view (same struct; the
        // view is leaked, not freed, on drop).
        let bytes = unsafe { dev.stream().upgrade_device_ptr::<u8>(memory.device_ptr(), len) };
        Ok(DeviceKvPool {
            layout,
            num_blocks,
            bytes: ManuallyDrop::new(bytes),
            memory,
        })
    }

    /// The allocation behind the pool (shared with transfer paths; see [`crate::ipc`]).
    pub fn memory(&self) -> &Arc<KvMemory> {
        &self.memory
    }

    pub(crate) fn check(&self, op: &'static str, layer: usize) -> Result<KvGeom, CudaError> {
        check_dtype(op, self.layout.dtype)?;
        check_len(
            op,
            "pool bytes (layout.pool_bytes(num_blocks))",
            self.layout.pool_bytes(self.num_blocks),
            self.bytes.len(),
        )?;
        if layer >= self.layout.num_layers {
            return Err(CudaError::Shape {
                op,
                what: "layer (< num_layers)",
                expected: self.layout.num_layers,
                got: layer,
            });
        }
        Ok(KvGeom::new(&self.layout, self.num_blocks, layer))
    }
}

pub(crate) fn check_dtype(op: &'static str, dtype: KvDtype) -> Result<(), CudaError> {
    match dtype {
        KvDtype::F32 | KvDtype::F16 | KvDtype::Bf16 => Ok(()),
        KvDtype::Int8 => Err(CudaError::Unsupported {
            op,
            what: "int8 KV".to_string(),
        }),
    }
}

/// The RoPE cos/sin table on the device: `[max_positions × head_dim/2]` each, a copy of the
/// CPU kernels' [`RopeTable`] (so both backends rotate by the same bits).
#[derive(Debug)]
pub struct DeviceRopeTable {
    /// Head dimension the table was built for.
    pub head_dim: usize,
    /// Positions covered.
    pub max_positions: usize,
    /// cos, row-major by position.
    pub cos: CudaSlice<f32>,
    /// sin, row-major by position.
    pub sin: CudaSlice<f32>,
}

impl DeviceRopeTable {
    /// Uploads `table`.
    pub fn new(dev: &CudaDevice, table: &RopeTable) -> Result<DeviceRopeTable, CudaError> {
        let (cos, sin) = table.tables();
        Ok(DeviceRopeTable {
            head_dim: table.head_dim(),
            max_positions: table.max_positions(),
            cos: dev.upload(cos)?,
            sin: dev.upload(sin)?,
        })
    }
}

/// Scratch of the split decode: per (sequence, head, split) an unnormalised accumulator and
/// its (max, sum). Allocated once, for the largest batch, so a decode step allocates nothing
/// (and can be captured in a CUDA graph).
#[derive(Debug)]
pub struct DecodeWorkspace {
    pub(crate) max_seqs: usize,
    pub(crate) n_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) max_splits: usize,
    pub(crate) part_acc: CudaSlice<f32>,
    pub(crate) part_ml: CudaSlice<f32>,
}

impl DecodeWorkspace {
    /// Room for `max_seqs` sequences of `n_heads` heads of `head_dim`, cut into at most
    /// `max_splits` splits (≤ [`launch::MAX_DECODE_SPLITS`]).
    pub fn new(
        dev: &CudaDevice,
        max_seqs: usize,
        n_heads: usize,
        head_dim: usize,
        max_splits: usize,
    ) -> Result<DecodeWorkspace, CudaError> {
        let max_splits = max_splits.clamp(1, launch::MAX_DECODE_SPLITS);
        let parts = max_seqs * n_heads * max_splits;
        Ok(DecodeWorkspace {
            max_seqs,
            n_heads,
            head_dim,
            max_splits,
            part_acc: dev.alloc_zeros(parts * head_dim)?,
            part_ml: dev.alloc_zeros(parts * 2)?,
        })
    }
}

const _: () = assert!(std::mem::size_of::<KvGeom>() == 40 && std::mem::align_of::<KvGeom>() == 8);


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_geom_addresses_the_layouts_slabs() {
        let l = KvLayout::new(3, 2, 8, 4, KvDtype::F16, 0).unwrap();
        let g = KvGeom::new(&l, 5, 2);
        assert_eq!(g.layer_base as usize, l.slab_offset(5, 2, 0));
        assert_eq!(g.slab_bytes as usize, l.slab_bytes());
        assert_eq!(
            (g.num_blocks, g.kv_heads, g.head_dim, g.block_size),
            (5, 2, 8, 4)
        );
    }

    #[test]
    fn int8_kv_is_refused() {
        assert!(matches!(
            check_dtype("x", KvDtype::Int8),
            Err(CudaError::Unsupported { .. })
        ));
        assert!(check_dtype("x", KvDtype::Bf16).is_ok());
    }
}
