//! The prefix cache's block identity, shared by the engine (which caches blocks under it), the
//! nodes (which publish what they cache) and the router (which hashes a prompt to find the node
//! that already holds its prefix).
//!
//! Invariants: a block's hash depends on every token before it (the previous block's hash is
//! chained in) and on its own tokens, in a fixed little-endian encoding; so equal hashes mean
//! equal prefixes (up to 64-bit collisions), on every machine and release. Only *full* blocks
//! that end before a prompt's last token are cacheable: the last token always runs, to give
//! the logits of the first output token.

/// Chained hash of a full block: depends on every token before it (through `prev`, 0 for the
/// first block) and its own.
pub fn hash_block(prev: u64, tokens: &[u32]) -> u64 {
    let mut buf = Vec::with_capacity(8 + tokens.len() * 4);
    buf.extend_from_slice(&prev.to_le_bytes());
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&buf)
}

/// Blocks of a `len`-token prompt the prefix cache can serve: full blocks that end before its
/// last token.
pub fn cacheable_blocks(len: usize, block_size: usize) -> usize {
    len.saturating_sub(1) / block_size.max(1)
}

/// The chained hashes of `prompt`'s cacheable blocks, in order.
pub fn prompt_block_hashes(prompt: &[u32], block_size: usize) -> Vec<u64> {
    let bs = block_size.max(1);
    let mut prev = 0;
    (0..cacheable_blocks(prompt.len(), bs))
        .map(|j| {
            prev = hash_block(prev, &prompt[j * bs..(j + 1) * bs]);
            prev
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_hash_depends_on_every_earlier_block() {
        let h1 = hash_block(0, &[1, 2, 3, 4]);
        let h2 = hash_block(h1, &[5, 6, 7, 8]);
        let other = hash_block(hash_block(0, &[1, 2, 3, 9]), &[5, 6, 7, 8]);
        assert_ne!(h2, other);
        assert_eq!(
            prompt_block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4),
            vec![h1, h2]
        );
        // The last token is never cached: 8 tokens give one cacheable block of 4.
        assert_eq!(prompt_block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4), vec![h1]);
        assert!(prompt_block_hashes(&[1], 4).is_empty());
    }

    const PINNED: u64 = 5_576_843_613_559_543_360;

    #[test]
    fn the_encoding_is_fixed() {
        // A change here invalidates every node's published cache and the router's index.
        assert_eq!(hash_block(0, &[1, 2, 3]), PINNED);
    }
}
