//! The physical KV pool: one 64-byte-aligned region of `layout.pool_bytes(num_blocks)` bytes,
//! laid out as `tandem-kv-layout` defines (layer-major (layer, block) slabs).
//!
//! The pool is sized once at start-up (from `--kv-cache-gb` or a block count) and never grows:
//! running out of blocks is the scheduler's problem (preemption), not an allocation failure.
//!
//! The bytes are either owned (a zeroed allocation, pages mapped lazily by the OS) or external:
//! memory another component allocated, e.g. kv-transfer's UCX-registered segment, which a peer
//! writes into directly. With external memory, remote writes land only in blocks the engine has
//! reserved and does not touch until the transfer has completed and verified; the engine creates
//! its byte views per forward pass and never reads a block that is being written.

use std::sync::Arc;

use tandem_kernels::{KvCacheMut, KvCacheRef};
use tandem_kv_layout::KvLayout;

use crate::error::EngineError;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Memory allocated outside the engine that a pool can live in.
///
/// # Safety
/// `as_ptr()` must stay valid for `len()` bytes, writable, and at least 4-byte aligned for the
/// implementor's whole lifetime; nothing but the engine and a KV transport (writing only into
/// blocks the engine reserved for it) may access it.
pub unsafe trait KvBacking: Send + Sync {
    /// Start of the region.
    fn as_ptr(&self) -> *mut u8;
    /// Length in bytes.
    fn len_bytes(&self) -> usize;
}

enum Storage {
    Owned(Vec<Line>),
    External(Arc<dyn KvBacking>),
}

/// The bytes of a KV pool (owned, or external memory).
pub struct KvPool {
    layout: KvLayout,
    num_blocks: usize,
    storage: Storage,
}

impl KvPool {
    /// Allocates a zeroed pool of `num_blocks` blocks.
    pub fn new(layout: KvLayout, num_blocks: usize) -> Result<Self, EngineError> {
        if num_blocks == 0 {
            return Err(EngineError::InvalidConfig {
                field: "kv_blocks",
                value: "0".into(),
                reason: "the KV pool needs at least one block".into(),
            });
        }
        let bytes = layout.pool_bytes(num_blocks);
        Ok(KvPool { layout, num_blocks, storage: Storage::Owned(vec![Line([0; 64]); bytes.div_ceil(64)]) })
    }

    /// A pool in `backing`, which must hold at least `layout.pool_bytes(num_blocks)` bytes.
    pub fn external(layout: KvLayout, num_blocks: usize, backing: Arc<dyn KvBacking>) -> Result<Self, EngineError> {
        let need = layout.pool_bytes(num_blocks);
        if num_blocks == 0 || backing.len_bytes() < need || !(backing.as_ptr() as usize).is_multiple_of(4) {
            return Err(EngineError::InvalidConfig {
                field: "kv_backing",
                value: format!("{} bytes at {:p}", backing.len_bytes(), backing.as_ptr()),
                reason: format!("needs {need} bytes (4-byte aligned) for {num_blocks} blocks"),
            });
        }
        Ok(KvPool { layout, num_blocks, storage: Storage::External(backing) })
    }

    fn base(&self) -> *mut u8 {
        match &self.storage {
            Storage::Owned(lines) => lines.as_ptr() as *mut u8,
            Storage::External(b) => b.as_ptr(),
        }
    }

    /// Blocks that fit in `bytes` for `layout` (at least one is required to build a pool).
    pub fn blocks_for_bytes(layout: &KvLayout, bytes: u64) -> usize {
        layout.blocks_for_bytes(bytes)
    }

    /// The layout this pool stores.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The pool's bytes.
    pub fn bytes(&self) -> &[u8] {
        let len = self.layout.pool_bytes(self.num_blocks);
        // SAFETY: owned storage holds at least `len` initialised bytes (`Line` is plain bytes);
        // external storage promises `len` valid bytes for its lifetime (`KvBacking`), and the
        // borrow of `self` keeps it alive.
        unsafe { std::slice::from_raw_parts(self.base(), len) }
    }

    /// The pool's bytes, mutable (kv-transfer receives into these).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.layout.pool_bytes(self.num_blocks);
        // SAFETY: as in `bytes`, with the exclusive borrow of `self` making this the engine's
        // only view (see the module docs for transports writing reserved blocks).
        unsafe { std::slice::from_raw_parts_mut(self.base(), len) }
    }

    /// A kernel read view.
    pub fn view(&self) -> KvCacheRef<'_> {
        KvCacheRef { layout: &self.layout, num_blocks: self.num_blocks, bytes: self.bytes() }
    }

    /// A kernel write view.
    pub fn view_mut(&mut self) -> KvCacheMut<'_> {
        let num_blocks = self.num_blocks;
        let len = self.layout.pool_bytes(num_blocks);
        // SAFETY: see `bytes_mut`; `layout` is borrowed shared alongside, a separate field.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.base(), len) };
        KvCacheMut { layout: &self.layout, num_blocks, bytes }
    }

    /// The bytes of one block across all layers, copied out in layer order (tests, debugging).
    pub fn block_bytes(&self, block: BlockIdx) -> Vec<u8> {
        let slab = self.layout.slab_bytes();
        let mut out = Vec::with_capacity(self.layout.block_bytes());
        for layer in 0..self.layout.num_layers {
            let off = self.layout.slab_offset(self.num_blocks, layer, block as usize);
            out.extend_from_slice(&self.bytes()[off..off + slab]);
        }
        out
    }
}

/// A physical block index into a pool.
pub type BlockIdx = u32;

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kv_layout::KvDtype;

    #[test]
    fn pool_is_aligned_sized_and_zeroed() {
        let layout = KvLayout::new(2, 3, 64, 16, KvDtype::F16, 0).unwrap();
        let pool = KvPool::new(layout, 7).unwrap();
        assert_eq!(pool.bytes().len(), layout.pool_bytes(7));
        assert_eq!(pool.bytes().as_ptr() as usize % 64, 0);
        assert!(pool.bytes().iter().all(|&b| b == 0));
        assert_eq!(pool.block_bytes(3).len(), layout.block_bytes());
        assert!(KvPool::new(layout, 0).is_err());
    }
}
