//! Deterministic slab contents for tests, the peer binary and the benchmark.
//!
//! A slab's bytes are a pure function of `(seed, layer, source block)`, so a receiver in another
//! process can check, byte for byte, that what landed in a destination block is exactly what the
//! sender's source block held, without the two processes sharing memory.
//! Cost: a splitmix64 stream, 8 bytes per step (several GB/s), used only off the measured path.

use crate::error::TransferError;
use crate::pool::{BlockId, KvPool};

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn slab_seed(seed: u64, layer: usize, block: BlockId) -> u64 {
    seed ^ ((layer as u64) << 40) ^ (block as u64).wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// Fills `out` with the pattern of `(seed, layer, block)`.
pub fn fill_slab(seed: u64, layer: usize, block: BlockId, out: &mut [u8]) {
    let mut st = slab_seed(seed, layer, block);
    let mut chunks = out.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&splitmix(&mut st).to_le_bytes());
    }
    let rest = chunks.into_remainder();
    let last = splitmix(&mut st).to_le_bytes();
    rest.copy_from_slice(&last[..rest.len()]);
}

/// True when `bytes` holds exactly the pattern of `(seed, layer, block)`.
pub fn slab_matches(seed: u64, layer: usize, block: BlockId, bytes: &[u8]) -> bool {
    let mut st = slab_seed(seed, layer, block);
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        if c != splitmix(&mut st).to_le_bytes() {
            return false;
        }
    }
    let rest = chunks.remainder();
    rest == &splitmix(&mut st).to_le_bytes()[..rest.len()]
}

/// Fills every layer of `blocks` in a pool it holds exclusively.
pub fn fill_blocks(pool: &mut KvPool, seed: u64, blocks: &[BlockId]) -> Result<(), TransferError> {
    for layer in 0..pool.layout().num_layers {
        for &b in blocks {
            fill_slab(seed, layer, b, pool.slab_mut_exclusive(layer, b)?);
        }
    }
    Ok(())
}

/// Fills every layer of `blocks` in a shared pool (one a transport allocated).
///
/// # Safety
/// Nothing else reads or writes these blocks meanwhile (no transfer covers them).
pub unsafe fn fill_blocks_shared(
    pool: &KvPool,
    seed: u64,
    blocks: &[BlockId],
) -> Result<(), TransferError> {
    for layer in 0..pool.layout().num_layers {
        for &b in blocks {
            // SAFETY: the caller guarantees exclusive access to these blocks.
            fill_slab(seed, layer, b, unsafe { pool.slab_mut(layer, b) }?);
        }
    }
    Ok(())
}

/// Counts the (layer, pair) slabs where `dst_blocks[i]` does not hold source block `src_blocks[i]`'s
/// pattern.
///
/// # Safety
/// No transfer may be writing `dst_blocks` (their reservation has resolved).
pub unsafe fn mismatched_slabs(
    pool: &KvPool,
    seed: u64,
    src_blocks: &[BlockId],
    dst_blocks: &[BlockId],
) -> Result<usize, TransferError> {
    let mut bad = 0;
    for layer in 0..pool.layout().num_layers {
        for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
            // SAFETY: the caller guarantees no writer on these slabs.
            let bytes = unsafe { pool.slab(layer, d) }?;
            if !slab_matches(seed, layer, s, bytes) {
                bad += 1;
            }
        }
    }
    Ok(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_differs_per_layer_and_block_and_checks_byte_for_byte() {
        let mut a = vec![0u8; 100];
        let mut b = vec![0u8; 100];
        fill_slab(1, 0, 5, &mut a);
        fill_slab(1, 1, 5, &mut b);
        assert_ne!(a, b);
        fill_slab(1, 0, 6, &mut b);
        assert_ne!(a, b);
        assert!(slab_matches(1, 0, 5, &a));
        a[99] ^= 1;
        assert!(!slab_matches(1, 0, 5, &a));
    }
}
