//! The host mirror of a KV cache that lives elsewhere: the staged path of disaggregated serving.
//!
//! A node's KV transport (UCX or TCP) sends from and receives into host memory it allocated and
//! registered. When the forward runs on a GPU, the KV it reads and writes is in device memory,
//! so the engine keeps the transport's pool beside it as a [`HostMirror`] of the same layout and
//! block count (block ids mean the same bytes on both sides) and copies between them:
//!
//! - [`Staging::Push`] (a prefill node): every slab a forward pass writes is copied to the
//!   mirror layer by layer, and the layer is reported to the caller (`on_layer`, which starts
//!   the layer-wise push) only once its bytes are in the mirror; the device computes the next
//!   layer meanwhile.
//! - [`Staging::Receive`] (a decode node): the transport writes pushed KV into reserved blocks
//!   of the mirror; [`Engine::add_prefilled`](crate::Engine::add_prefilled) copies the prompt's
//!   blocks up to the device before the sequence's first step can read them.
//!
//! # Invariants
//! - Push: after a step returns, the mirror's slabs of every block the step wrote equal the
//!   device's; a block is never reported before its layer's copy has landed.
//! - Receive: the device's slabs of an adopted prompt equal the mirror's when `add_prefilled`
//!   returns; decode steps never copy out (the decode side pushes nothing).
//! - On a GPU the mirror is page-locked ([`tandem_kernels_cuda::PinnedHost`]) so copies are
//!   DMA; when the driver refuses to lock it, copies go through pageable memory, which is logged
//!   once at start-up and visible in [`HostMirror::pinned`] and the engine's stats.
//! - With a CPU model the mirror works the same way with slab copies (what the tests exercise
//!   without a GPU); nodes on the CPU keep their KV in the transport's memory and need no mirror.

use std::ops::Range;

use tandem_kernels_cuda::PinnedHost;
use tandem_kv_layout::KvLayout;

use crate::kv::KvPool;
use super::ForwardSeq;

/// Which way KV moves between a device-resident cache and its host mirror.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Staging {
    /// A prefill node: forward passes copy what they write out to the mirror, layer by layer.
    Push,
    /// A decode node: adopted prompts are copied from the mirror in to the device.
    Receive,
}

impl Staging {
    /// `push` / `receive` (logs).
    pub const fn as_str(self) -> &'static str {
        match self {
            Staging::Push => "push",
            Staging::Receive => "receive",
        }
    }
}

/// The transport's host pool beside a cache that lives elsewhere (see the module docs).
pub struct HostMirror {
    /// Declared before `host`: the registration is dropped while the memory is still mapped.
    pinned: Option<PinnedHost>,
    host: KvPool,
    staging: Staging,
    bytes_out: u64,
    bytes_in: u64,
}

impl HostMirror {
    pub(crate) fn new(host: KvPool, staging: Staging, pinned: Option<PinnedHost>) -> HostMirror {
        HostMirror { host, staging, pinned, bytes_out: 0, bytes_in: 0 }
    }

    /// The host pool (what the transport reads and writes).
    pub fn host(&self) -> &KvPool {
        &self.host
    }

    /// The host pool, writable.
    pub fn host_mut(&mut self) -> &mut KvPool {
        &mut self.host
    }

    /// Which way it copies.
    pub fn staging(&self) -> Staging {
        self.staging
    }

    /// Whether the host pool is page-locked for DMA (always false on the CPU, where it needs
    /// no locking).
    pub fn pinned(&self) -> bool {
        self.pinned.is_some()
    }

    /// Bytes copied out to the mirror (push) since start.
    pub fn bytes_out(&self) -> u64 {
        self.bytes_out
    }

    /// Bytes copied in from the mirror (receive) since start.
    pub fn bytes_in(&self) -> u64 {
        self.bytes_in
    }

    pub(crate) fn count_out(&mut self, bytes: usize) {
        self.bytes_out += bytes as u64;
    }

    pub(crate) fn count_in(&mut self, bytes: usize) {
        self.bytes_in += bytes as u64;
    }

    /// Copies layer `layer` of `blocks` from `src` (a host working pool) into the mirror.
    pub(crate) fn copy_layer_out_host(&mut self, src: &KvPool, layer: usize, blocks: &[u32]) {
        for &b in blocks {
            self.host.slab_mut(layer, b).copy_from_slice(src.slab(layer, b));
        }
        self.count_out(blocks.len() * self.host.layout().slab_bytes());
    }

    /// Copies every layer of `blocks` from the mirror into `dst` (a host working pool).
    pub(crate) fn copy_in_host(&mut self, dst: &mut KvPool, blocks: &[u32]) {
        for layer in 0..self.host.layout().num_layers {
            for &b in blocks {
                dst.slab_mut(layer, b).copy_from_slice(self.host.slab(layer, b));
            }
        }
        self.count_in(blocks.len() * self.host.layout().block_bytes());
    }
}

/// A step's work for a pushing mirror: the mirror and the blocks the step writes.
pub(crate) struct StageOut<'a> {
    pub mirror: &'a mut HostMirror,
    /// Sorted, without repeats.
    pub blocks: Vec<u32>,
}

/// The blocks a step writes KV into: for each sequence, those covering positions
/// `first_pos..first_pos + tokens.len()`; sorted, without repeats.
pub(crate) fn written_blocks(seqs: &[ForwardSeq<'_>], block_size_tokens: usize) -> Vec<u32> {
    let bs = block_size_tokens;
    let mut out = Vec::new();
    for s in seqs.iter().filter(|s| !s.tokens.is_empty()) {
        let (first, last) = (s.first_pos / bs, (s.first_pos + s.tokens.len() - 1) / bs);
        // A table too short is the block manager's bug; `token_slots` reports it.
        out.extend_from_slice(s.block_table.get(first..=last).unwrap_or_default());
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Byte ranges of layer `layer` of `blocks` (sorted, without repeats) in a pool of `num_blocks`
/// blocks, consecutive ids coalesced into one range (layer-major slabs make a run contiguous).
pub(crate) fn layer_ranges(layout: &KvLayout, num_blocks: usize, layer: usize, blocks: &[u32]) -> Vec<Range<usize>> {
    let slab = layout.slab_bytes();
    let mut out: Vec<Range<usize>> = Vec::new();
    for &b in blocks {
        let start = layout.slab_offset(num_blocks, layer, b as usize);
        match out.last_mut() {
            Some(r) if r.end == start => r.end += slab,
            _ => out.push(start..start + slab),
        }
    }
    out
}

/// [`layer_ranges`] of every layer, layer by layer.
pub(crate) fn all_layer_ranges(layout: &KvLayout, num_blocks: usize, blocks: &[u32]) -> Vec<Range<usize>> {
    (0..layout.num_layers).flat_map(|l| layer_ranges(layout, num_blocks, l, blocks)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kv_layout::KvDtype;

    fn layout() -> KvLayout {
        KvLayout::new(3, 2, 4, 16, KvDtype::F32, 0xfeed).unwrap()
    }

    #[test]
    fn written_blocks_are_those_under_the_steps_tokens() {
        let (a, b) = ([7u32, 3, 9, 11], [4u32, 7]);
        let seqs = [
            // positions 30..33 → blocks 1 and 2 of the table (16-token blocks)
            ForwardSeq { tokens: &[1, 2, 3], first_pos: 30, block_table: &a, want_logits: true },
            // position 16 → block 1 of its table (7, shared with the first: counted once)
            ForwardSeq { tokens: &[5], first_pos: 16, block_table: &b, want_logits: false },
            ForwardSeq { tokens: &[], first_pos: 0, block_table: &b, want_logits: false },
        ];
        assert_eq!(written_blocks(&seqs, 16), vec![3, 7, 9]);
    }

    #[test]
    fn consecutive_blocks_make_one_range_per_layer() {
        let l = layout();
        let slab = l.slab_bytes();
        let n = 10;
        assert_eq!(layer_ranges(&l, n, 0, &[2, 3, 4, 7]), vec![2 * slab..5 * slab, 7 * slab..8 * slab]);
        assert_eq!(layer_ranges(&l, n, 2, &[0]), vec![20 * slab..21 * slab]);
        assert!(layer_ranges(&l, n, 1, &[]).is_empty());
        let all = all_layer_ranges(&l, n, &[9]);
        assert_eq!(all, vec![9 * slab..10 * slab, 19 * slab..20 * slab, 29 * slab..30 * slab]);
        assert_eq!(all.last().unwrap().end, l.pool_bytes(n));
    }
}
