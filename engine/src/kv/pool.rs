//! The physical KV pool: one 64-byte-aligned region of `layout.pool_bytes(num_blocks)` bytes,
//! laid out as `tandem-kv-layout` defines (layer-major (layer, block) slabs).
//!
//! The pool is sized once at start-up (from `--kv-cache-gb` or a block count) and never grows:
//! running out of blocks is the scheduler's problem (preemption), not an allocation failure.
//!
//! The bytes are either owned (a zeroed allocation, pages mapped lazily by the OS) or external:
//! memory another component allocated, e.g. kv-transfer's UCX-registered segment, which a peer
//! writes into directly. With external memory, remote writes land only in blocks the engine has
//! reserved and does not touch until the transfer has completed and verified.
//!
//! Soundness: no reference to the whole pool is ever made, because a transport may be writing
//! reserved blocks at any moment and a whole-pool `&[u8]` / `&mut [u8]` would assert those bytes
//! unchanged (or exclusively ours). Everything goes through one `(layer, block)` slab at a time:
//! [`KvPool::slab`] / [`KvPool::slab_mut`] here, and the kernels' views ([`KvPool::view`],
//! [`KvPool::view_mut`]), which hold the base pointer and hand out slab slices only. The
//! invariant that makes each slab slice sound is the block manager's: a forward pass reads and
//! writes only blocks in its sequences' block tables, and a block reserved for an inbound
//! transfer enters a block table only after the transfer is fenced (complete and verified, or
//! cancelled). `&mut self` on the writable accessors keeps the engine's own accesses exclusive.

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

    /// The region's start and length in bytes, for a device copy engine (the CUDA staging path)
    /// that reads and writes slabs the block manager hands it; never for a whole-pool slice.
    pub(crate) fn raw_region(&self) -> (*mut u8, usize) {
        (self.base(), self.len_bytes())
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

    fn len_bytes(&self) -> usize {
        self.layout.pool_bytes(self.num_blocks)
    }

    /// The bytes of slab `(layer, block)`. Panics outside the pool.
    pub fn slab(&self, layer: usize, block: BlockIdx) -> &[u8] {
        self.view().slab(layer, block as usize)
    }

    /// The bytes of slab `(layer, block)`, writable (a copy of received KV, tests). Panics
    /// outside the pool.
    pub fn slab_mut(&mut self, layer: usize, block: BlockIdx) -> &mut [u8] {
        let (base, len) = (self.base(), self.len_bytes());
        // SAFETY: as in `view_mut`; the slice borrows `self` exclusively.
        let mut view = unsafe { KvCacheMut::from_raw_parts(&self.layout, self.num_blocks, base, len) };
        let slab = view.slab_mut(layer, block as usize);
        let (ptr, n) = (slab.as_mut_ptr(), slab.len());
        // SAFETY: the slab lies in the pool, which `&mut self` keeps alive and ours for the
        // returned lifetime (the view was only a bounds-checked way to find it).
        unsafe { std::slice::from_raw_parts_mut(ptr, n) }
    }

    /// A kernel read view (slab by slab; see the module docs).
    pub fn view(&self) -> KvCacheRef<'_> {
        // SAFETY: owned storage holds `len` initialised bytes (`Line` is plain bytes); external
        // storage promises `len` valid bytes for its lifetime (`KvBacking`), and the borrow of
        // `self` keeps it alive. Slabs read through the view are those of live sequences, which
        // no transport writes (module docs).
        unsafe { KvCacheRef::from_raw_parts(&self.layout, self.num_blocks, self.base(), self.len_bytes()) }
    }

    /// A kernel write view (slab by slab; see the module docs).
    pub fn view_mut(&mut self) -> KvCacheMut<'_> {
        let (base, len) = (self.base(), self.len_bytes());
        // SAFETY: as in `view`, writable (owned: our allocation; external: `KvBacking` promises
        // writable memory), and `&mut self` makes it the engine's only view while it lives.
        unsafe { KvCacheMut::from_raw_parts(&self.layout, self.num_blocks, base, len) }
    }

    /// The bytes of one block across all layers, copied out in layer order (tests, debugging).
    pub fn block_bytes(&self, block: BlockIdx) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.layout.block_bytes());
        for layer in 0..self.layout.num_layers {
            out.extend_from_slice(self.slab(layer, block));
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
        let mut pool = KvPool::new(layout, 7).unwrap();
        assert_eq!(pool.view().len_bytes(), layout.pool_bytes(7));
        assert_eq!(pool.slab(0, 0).as_ptr() as usize % 64, 0);
        assert!((0..7).all(|b| pool.block_bytes(b).iter().all(|&x| x == 0)));
        assert_eq!(pool.block_bytes(3).len(), layout.block_bytes());
        assert!(KvPool::new(layout, 0).is_err());
        // Slabs are disjoint: writing one changes no other.
        pool.slab_mut(1, 4).fill(7);
        for (layer, block) in (0..2).flat_map(|l| (0..7).map(move |b| (l, b))) {
            let want = if (layer, block) == (1, 4) { 7 } else { 0 };
            assert!(pool.slab(layer, block).iter().all(|&x| x == want), "({layer}, {block})");
        }
    }

    #[test]
    #[should_panic(expected = "outside a pool")]
    fn a_slab_outside_the_pool_panics_instead_of_aliasing() {
        let layout = KvLayout::new(2, 3, 64, 16, KvDtype::F16, 0).unwrap();
        let pool = KvPool::new(layout, 7).unwrap();
        let _ = pool.slab(0, 7);
    }
}
