//! The physical KV pool: one 64-byte-aligned region of `layout.pool_bytes(num_blocks)` bytes,
//! laid out as `tandem-kv-layout` defines (layer-major (layer, block) slabs).
//!
//! The pool is sized once at start-up (from `--kv-cache-gb` or a block count) and never grows:
//! running out of blocks is the scheduler's problem (preemption), not an allocation failure.

use tandem_kernels::{KvCacheMut, KvCacheRef};
use tandem_kv_layout::KvLayout;

use crate::error::EngineError;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Owned, aligned bytes of a KV pool.
pub struct KvPool {
    layout: KvLayout,
    num_blocks: usize,
    lines: Vec<Line>,
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
        Ok(KvPool { layout, num_blocks, lines: vec![Line([0; 64]); bytes.div_ceil(64)] })
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
        // SAFETY: `lines` holds at least `len` initialised bytes (`Line` is plain bytes with no
        // padding), and the borrow of `self` keeps them alive and unaliased by `&mut`.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), len) }
    }

    /// The pool's bytes, mutable (kv-transfer receives into these).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.layout.pool_bytes(self.num_blocks);
        // SAFETY: as in `bytes`, with the exclusive borrow of `self` making this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<u8>(), len) }
    }

    /// A kernel read view.
    pub fn view(&self) -> KvCacheRef<'_> {
        KvCacheRef { layout: &self.layout, num_blocks: self.num_blocks, bytes: self.bytes() }
    }

    /// A kernel write view.
    pub fn view_mut(&mut self) -> KvCacheMut<'_> {
        let num_blocks = self.num_blocks;
        let len = self.layout.pool_bytes(num_blocks);
        // SAFETY: see `bytes_mut`; `layout` is borrowed shared alongside, which is fine because
        // it is a separate field.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<u8>(), len) };
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
