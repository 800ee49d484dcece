//! The memory a node registers for transfers: one KV pool, and how a block list maps onto it.
//!
//! A [`KvPool`] owns one contiguous, 64-byte aligned, zero-initialised region of
//! `layout.pool_bytes(num_blocks)` bytes laid out as `tandem-kv-layout` says (layer-major
//! (layer, block) slabs). The engine can adopt it as its cache memory; transports register it once
//! (UCX: `ucp_mem_map`) and then move slabs in and out for the block ids they are handed. Prefer
//! [`crate::KvTransport::allocate`] to get one: UCX then places the pool in memory its peers can
//! write directly (on one host, a shared-memory segment they map: a put is one `memcpy`), where a
//! heap pool would make UCX 1.13 emulate puts over active messages (two copies).
//!
//! # Aliasing contract
//! The pool is shared (`Arc<KvPool>`) between the engine, kernels and transports, which all
//! touch disjoint slabs at any one time. Rust cannot check that, so byte access through a shared
//! pool is `unsafe` ([`KvPool::slab`], [`KvPool::slab_mut`]) and the contract is:
//! - a source slab is not written while a push that covers it is in flight (prefill finishes a
//!   layer before marking it ready);
//! - a destination slab of a reservation is neither read nor written by anyone else until the
//!   reservation's [`crate::InboundTransfer`] has resolved; after it resolves (either way), no
//!   byte of that transfer lands there any more.
//!
//! Exclusive access (`&mut KvPool`, e.g. before the pool is shared) is safe: [`KvPool::slab_mut_exclusive`].
//!
//! # Costs
//! [`block_runs`] coalesces a block list into runs of consecutive ids on both sides, once per
//! transfer (O(blocks)); every layer of a run is then one contiguous range in each pool, which is
//! what lets a transfer issue one write per (layer, run) instead of one per slab.

use std::alloc::{Layout as AllocLayout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

use tandem_kv_layout::KvLayout;

use crate::error::TransferError;

/// A block index into a pool (the engine decides what it means).
pub type BlockId = u32;

/// Alignment of every pool base address (a cache line; also what RDMA NICs like).
pub const POOL_ALIGN_BYTES: usize = 64;

/// Who frees a pool's memory.
#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
enum Backing {
    /// `std::alloc`, freed with the same layout.
    Heap,
    /// Memory a transport allocated (UCX: `ucp_mem_map(ALLOCATE)`, shared-memory segments peers
    /// can map); `release` frees it.
    External {
        release: Option<Box<dyn FnOnce() + Send + Sync>>,
    },
}

/// One node's KV pool: an owned, aligned, zeroed byte region of `num_blocks` blocks.
pub struct KvPool {
    layout: KvLayout,
    num_blocks: usize,
    ptr: NonNull<u8>,
    len_bytes: usize,
    backing: Backing,
}

// SAFETY: KvPool owns a plain byte allocation with no thread affinity; concurrent access to it is
// governed by the unsafe accessors' contract in the module docs.
unsafe impl Send for KvPool {}
// SAFETY: as above: shared references only expose bytes through unsafe accessors.
unsafe impl Sync for KvPool {}

impl KvPool {
    /// Allocates a zeroed pool of `num_blocks` blocks of `layout`.
    pub fn new(layout: KvLayout, num_blocks: usize) -> Result<Self, TransferError> {
        if num_blocks == 0 || num_blocks > BlockId::MAX as usize {
            return Err(TransferError::invalid(
                "num_blocks",
                format!("{num_blocks} is not in 1..=u32::MAX"),
            ));
        }
        let len_bytes = layout.pool_bytes(num_blocks);
        let alloc = AllocLayout::from_size_align(len_bytes, POOL_ALIGN_BYTES).map_err(|e| {
            TransferError::invalid("num_blocks", format!("pool of {len_bytes} bytes: {e}"))
        })?;
        // SAFETY: `alloc` has a non-zero size (num_blocks > 0 and every layout dimension is > 0).
        let raw = unsafe { alloc_zeroed(alloc) };
        let ptr = NonNull::new(raw).ok_or_else(|| TransferError::Io {
            op: "allocate KV pool",
            source: std::io::Error::from(std::io::ErrorKind::OutOfMemory),
        })?;
        Ok(Self {
            layout,
            num_blocks,
            ptr,
            len_bytes,
            backing: Backing::Heap,
        })
    }

    /// Wraps memory a transport allocated: `ptr` must be 64-byte aligned, zeroed, and valid for
    /// `layout.pool_bytes(num_blocks)` bytes until `release` runs (when the pool drops).
    ///
    /// # Safety
    /// The caller guarantees the above, and that nothing else frees or reuses the memory.
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub(crate) unsafe fn from_external(
        layout: KvLayout,
        num_blocks: usize,
        ptr: *mut u8,
        release: Box<dyn FnOnce() + Send + Sync>,
    ) -> Result<Self, TransferError> {
        let ptr = NonNull::new(ptr).ok_or_else(|| TransferError::invalid("ptr", "is null"))?;
        if !(ptr.as_ptr() as usize).is_multiple_of(POOL_ALIGN_BYTES)
            || num_blocks == 0
            || num_blocks > BlockId::MAX as usize
        {
            release();
            return Err(TransferError::invalid(
                "ptr",
                "external pool memory is misaligned or empty",
            ));
        }
        let len_bytes = layout.pool_bytes(num_blocks);
        Ok(Self {
            layout,
            num_blocks,
            ptr,
            len_bytes,
            backing: Backing::External {
                release: Some(release),
            },
        })
    }

    /// The layout every slab of this pool follows.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Bytes in the pool (`layout.pool_bytes(num_blocks)`).
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// Base address (64-byte aligned). Valid for `len_bytes()` bytes while `self` lives.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Byte offset of a (layer, block) slab, checked against the pool's bounds.
    pub fn slab_offset(&self, layer: usize, block: BlockId) -> Result<usize, TransferError> {
        if layer >= self.layout.num_layers {
            return Err(TransferError::invalid(
                "layer",
                format!("{layer} >= {} layers", self.layout.num_layers),
            ));
        }
        self.check_block(block)?;
        Ok(self
            .layout
            .slab_offset(self.num_blocks, layer, block as usize))
    }

    /// Fails unless `block` is inside the pool.
    pub fn check_block(&self, block: BlockId) -> Result<(), TransferError> {
        if (block as usize) < self.num_blocks {
            Ok(())
        } else {
            Err(TransferError::invalid(
                "block",
                format!("{block} >= {} blocks", self.num_blocks),
            ))
        }
    }

    /// The bytes of one (layer, block) slab.
    ///
    /// # Safety
    /// No one writes this slab while the returned slice lives (see the module's contract).
    pub unsafe fn slab(&self, layer: usize, block: BlockId) -> Result<&[u8], TransferError> {
        let off = self.slab_offset(layer, block)?;
        // SAFETY: off + slab_bytes <= len_bytes (checked offset of an in-range slab); the caller
        // guarantees there is no concurrent writer.
        Ok(unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().add(off), self.layout.slab_bytes())
        })
    }

    /// XXH3-64 of the slabs of `blocks` in layers `layers`, layer-major (the order of a
    /// `Chunk` frame's checksums), hashed four slabs at a time where the CPU allows.
    ///
    /// # Safety
    /// No one writes these slabs while they are hashed.
    pub unsafe fn slab_checksums(
        &self,
        layers: std::ops::Range<u32>,
        blocks: &[BlockId],
    ) -> Result<Vec<u64>, TransferError> {
        let mut slabs = Vec::with_capacity(layers.len() * blocks.len());
        for layer in layers {
            for &b in blocks {
                // SAFETY: no concurrent writer, per the caller.
                slabs.push(unsafe { self.slab(layer as usize, b) }?);
            }
        }
        let mut sums = Vec::with_capacity(slabs.len());
        crate::checksum::slab_checksums(&slabs, &mut sums);
        Ok(sums)
    }

    /// The bytes of one (layer, block) slab, writable.
    ///
    /// # Safety
    /// No one else reads or writes this slab while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slab_mut(
        &self,
        layer: usize,
        block: BlockId,
    ) -> Result<&mut [u8], TransferError> {
        let off = self.slab_offset(layer, block)?;
        // SAFETY: in bounds as above; the caller guarantees exclusive access to this slab.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), self.layout.slab_bytes())
        })
    }

    /// A writable slab through exclusive access (safe: nobody else can hold the pool).
    pub fn slab_mut_exclusive(
        &mut self,
        layer: usize,
        block: BlockId,
    ) -> Result<&mut [u8], TransferError> {
        // SAFETY: `&mut self` proves no other reference to any slab exists.
        unsafe { self.slab_mut(layer, block) }
    }

    /// Byte range `[offset, offset + len)` of the pool as a raw pointer, bounds-checked.
    pub(crate) fn range_ptr(&self, offset: usize, len: usize) -> Result<*mut u8, TransferError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len_bytes => {
                // SAFETY: offset <= len_bytes, so the result stays inside (or one past) the allocation.
                Ok(unsafe { self.ptr.as_ptr().add(offset) })
            }
            _ => Err(TransferError::invalid(
                "range",
                format!("{offset}+{len} beyond {} bytes", self.len_bytes),
            )),
        }
    }
}

impl Drop for KvPool {
    fn drop(&mut self) {
        match &mut self.backing {
            Backing::Heap => {
                let alloc = AllocLayout::from_size_align(self.len_bytes, POOL_ALIGN_BYTES)
                    .expect("layout was valid at allocation. This is a bug.");
                // SAFETY: `ptr` came from `alloc_zeroed` with this exact layout and is freed once.
                unsafe { dealloc(self.ptr.as_ptr(), alloc) };
            }
            Backing::External { release } => {
                if let Some(release) = release.take() {
                    release();
                }
            }
        }
    }
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("layout", &self.layout.to_string())
            .field("num_blocks", &self.num_blocks)
            .field("len_bytes", &self.len_bytes)
            .finish()
    }
}

/// Consecutive blocks `src_start..src_start+len` → `dst_start..dst_start+len`: per layer, one
/// contiguous byte range in each pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockRun {
    /// Index of the run's first block in the transfer's block lists.
    pub index: u32,
    /// First source block id.
    pub src_start: BlockId,
    /// First destination block id.
    pub dst_start: BlockId,
    /// Blocks in the run.
    pub len: u32,
}

/// Coalesces paired block lists into runs that are consecutive on both sides.
pub fn block_runs(src: &[BlockId], dst: &[BlockId]) -> Vec<BlockRun> {
    debug_assert_eq!(src.len(), dst.len());
    let mut runs: Vec<BlockRun> = Vec::new();
    for (i, (&s, &d)) in src.iter().zip(dst).enumerate() {
        match runs.last_mut() {
            Some(r)
                if r.src_start.checked_add(r.len) == Some(s)
                    && r.dst_start.checked_add(r.len) == Some(d) =>
            {
                r.len += 1;
            }
            _ => runs.push(BlockRun {
                index: i as u32,
                src_start: s,
                dst_start: d,
                len: 1,
            }),
        }
    }
    runs
}

/// Checks a transfer's block lists: same length, non-empty, in range, no duplicate destination.
pub fn check_block_lists(
    src: &[BlockId],
    src_pool_blocks: usize,
    dst: &[BlockId],
    dst_pool_blocks: usize,
) -> Result<(), TransferError> {
    if src.is_empty() {
        return Err(TransferError::invalid("src_blocks", "is empty"));
    }
    if src.len() != dst.len() {
        return Err(TransferError::invalid(
            "dst_blocks",
            format!("has {} blocks, src_blocks {}", dst.len(), src.len()),
        ));
    }
    if let Some(b) = src.iter().find(|&&b| b as usize >= src_pool_blocks) {
        return Err(TransferError::invalid(
            "src_blocks",
            format!("block {b} >= {src_pool_blocks}"),
        ));
    }
    if let Some(b) = dst.iter().find(|&&b| b as usize >= dst_pool_blocks) {
        return Err(TransferError::invalid(
            "dst_blocks",
            format!("block {b} >= {dst_pool_blocks}"),
        ));
    }
    let mut sorted = dst.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(TransferError::invalid(
            "dst_blocks",
            format!("block {} appears twice", w[0]),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kv_layout::KvDtype;

    fn small() -> KvLayout {
        KvLayout::new(3, 2, 8, 4, KvDtype::F16, 7).unwrap()
    }

    #[test]
    fn pool_is_aligned_zeroed_and_sized_by_the_layout() {
        let pool = KvPool::new(small(), 5).unwrap();
        assert_eq!(pool.as_ptr() as usize % POOL_ALIGN_BYTES, 0);
        assert_eq!(pool.len_bytes(), small().pool_bytes(5));
        // SAFETY: no one else holds this pool.
        let s = unsafe { pool.slab(2, 4) }.unwrap();
        assert!(s.iter().all(|&b| b == 0));
        assert!(matches!(
            pool.slab_offset(3, 0),
            Err(TransferError::InvalidRequest { field: "layer", .. })
        ));
        assert!(matches!(
            pool.slab_offset(0, 5),
            Err(TransferError::InvalidRequest { field: "block", .. })
        ));
        assert!(KvPool::new(small(), 0).is_err());
    }

    #[test]
    fn runs_coalesce_only_blocks_consecutive_on_both_sides() {
        let runs = block_runs(&[4, 5, 6, 9, 10, 11], &[0, 1, 2, 3, 5, 6]);
        assert_eq!(
            runs,
            vec![
                BlockRun {
                    index: 0,
                    src_start: 4,
                    dst_start: 0,
                    len: 3
                },
                BlockRun {
                    index: 3,
                    src_start: 9,
                    dst_start: 3,
                    len: 1
                },
                BlockRun {
                    index: 4,
                    src_start: 10,
                    dst_start: 5,
                    len: 2
                },
            ]
        );
        assert_eq!(
            block_runs(&[u32::MAX, 0], &[1, 2]).len(),
            2,
            "no wrap-around run"
        );
    }

    #[test]
    fn block_lists_with_duplicates_or_out_of_range_ids_are_refused() {
        assert!(check_block_lists(&[0, 1], 4, &[2, 3], 4).is_ok());
        assert!(check_block_lists(&[], 4, &[], 4).is_err());
        assert!(check_block_lists(&[0, 1], 4, &[2], 4).is_err());
        assert!(check_block_lists(&[0, 4], 4, &[2, 3], 4).is_err());
        assert!(check_block_lists(&[0, 1], 4, &[3, 3], 4).is_err());
    }
}
