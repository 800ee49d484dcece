//! The shape of a paged KV cache, shared by every crate that touches KV bytes.
//!
//! The engine owns what a block id *means* (which sequence, which tokens); the kernels read and
//! write the bytes of a block; kv-transfer moves blocks between pools. All three must agree on
//! exactly where each byte lives, and two nodes must refuse to exchange blocks unless they agree
//! too. This crate is that agreement, and nothing else.
//!
//! # Byte layout of a pool
//!
//! A pool of `num_blocks` blocks is one contiguous byte region, **layer-major**:
//!
//! ```text
//! pool = [layer 0: block 0 | block 1 | ... | block N-1] [layer 1: ...] ... [layer L-1: ...]
//! one (layer, block) slab = [K: kv_heads × block_size × head_dim elems]
//!                           [V: kv_heads × block_size × head_dim elems]
//!                           [Int8 only: K scales: kv_heads × head_dim f16 (one per channel)]
//!                           [Int8 only: V scales: kv_heads × block_size f16 (one per token)]
//! ```
//!
//! Layer-major order makes "layer `l` of a run of consecutive blocks" a single contiguous range,
//! which is what layer-wise streaming from a prefill node sends while it computes layer `l + 1`.
//! Within a slab, a head's tokens are contiguous (`[token][dim]`), so the paged-attention kernel
//! walks one block of one head as a dense `block_size × head_dim` tile.
//!
//! Int8 follows KIVI's split: keys are quantised per channel (their outliers live in fixed
//! channels), values per token. Both scale sets live inside the block, so a transfer moves them
//! with the data and the block checksum covers them.
//!
//! # Invariants
//! - `slab_bytes()` is a multiple of 4, so every slab starts 4-byte aligned when the pool base is
//!   (the f16 scales inside are 2-byte aligned; the kernels read them unaligned anyway).
//! - [`KvLayout::fingerprint`] is stable across processes, machines and releases: it hashes a
//!   fixed little-endian encoding, never a `Debug` string or a `Hash` impl.

pub mod prefix;

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of the stored K and V values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// 4-byte IEEE float.
    F32,
    /// 2-byte IEEE half.
    F16,
    /// 2-byte bfloat16.
    Bf16,
    /// Signed 8-bit, `x ≈ q × scale`, with f16 scales stored in the block: keys one scale per
    /// (head, channel), values one per (head, token).
    Int8,
}

impl KvDtype {
    /// Bytes of one stored element (scales not included).
    pub const fn elem_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::Int8 => 1,
        }
    }

    /// A stable lowercase name, used in flags, metrics labels and logs.
    pub const fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Int8 => "int8",
        }
    }

    const fn wire_tag(self) -> u8 {
        match self {
            KvDtype::F32 => 1,
            KvDtype::F16 => 2,
            KvDtype::Bf16 => 3,
            KvDtype::Int8 => 4,
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for KvDtype {
    type Err = LayoutError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(KvDtype::F32),
            "f16" | "float16" | "half" => Ok(KvDtype::F16),
            "bf16" | "bfloat16" => Ok(KvDtype::Bf16),
            "int8" | "i8" | "q8" => Ok(KvDtype::Int8),
            _ => Err(LayoutError::UnknownDtype(s.to_string())),
        }
    }
}

/// Errors building or comparing layouts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A dimension that must be positive was zero.
    #[error("KV layout field `{field}` must be > 0")]
    Zero {
        /// The offending field.
        field: &'static str,
    },
    /// The dtype name is not one of f32, f16, bf16, int8.
    #[error("unknown KV dtype `{0}` (expected f32, f16, bf16 or int8)")]
    UnknownDtype(String),
    /// Two layouts that must match do not.
    #[error("KV layout mismatch: local {local} vs remote {remote}")]
    Mismatch {
        /// This side's layout, rendered.
        local: String,
        /// The peer's layout, rendered.
        remote: String,
    },
}

/// The shape of one model's paged KV cache on one node.
///
/// `model_fingerprint` ties the layout to the weights that produced it: two nodes serving
/// different checkpoints of the same shape must not exchange KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    /// Transformer layers (each has its own K and V).
    pub num_layers: usize,
    /// KV heads per layer (after GQA; per GPU shard where tensor-parallel).
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size_tokens: usize,
    /// Stored element type.
    pub dtype: KvDtype,
    /// Hash of the model weights/config that fill this cache (0 when not tied to a model).
    pub model_fingerprint: u64,
}

impl KvLayout {
    /// Builds a layout, rejecting zero dimensions.
    pub fn new(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        block_size_tokens: usize,
        dtype: KvDtype,
        model_fingerprint: u64,
    ) -> Result<Self, LayoutError> {
        for (field, v) in [
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("block_size_tokens", block_size_tokens),
        ] {
            if v == 0 {
                return Err(LayoutError::Zero { field });
            }
        }
        Ok(Self { num_layers, num_kv_heads, head_dim, block_size_tokens, dtype, model_fingerprint })
    }

    /// Elements of K (or of V) for one head of one block: `block_size × head_dim`.
    pub const fn head_tile_elems(&self) -> usize {
        self.block_size_tokens * self.head_dim
    }

    /// Bytes of the K (or V) part of one (layer, block) slab.
    pub const fn kv_part_bytes(&self) -> usize {
        self.num_kv_heads * self.head_tile_elems() * self.dtype.elem_bytes()
    }

    /// Bytes of the f16 scales at the end of a slab (0 unless Int8): per head, `head_dim` key
    /// scales and `block_size` value scales.
    pub const fn scale_bytes(&self) -> usize {
        match self.dtype {
            KvDtype::Int8 => 2 * self.num_kv_heads * (self.head_dim + self.block_size_tokens),
            _ => 0,
        }
    }

    /// Offset within a slab of head `head`'s `head_dim` f16 key scales (Int8).
    pub const fn k_scales_offset(&self, head: usize) -> usize {
        2 * self.kv_part_bytes() + 2 * head * self.head_dim
    }

    /// Offset within a slab of head `head`'s `block_size` f16 value scales (Int8).
    pub const fn v_scales_offset(&self, head: usize) -> usize {
        2 * self.kv_part_bytes() + 2 * self.num_kv_heads * self.head_dim + 2 * head * self.block_size_tokens
    }

    /// Bytes of one (layer, block) slab: K, then V, then scales (Int8 only). Always a multiple of 4.
    pub const fn slab_bytes(&self) -> usize {
        let raw = 2 * self.kv_part_bytes() + self.scale_bytes();
        raw.div_ceil(4) * 4
    }

    /// Bytes of one block across all layers.
    pub const fn block_bytes(&self) -> usize {
        self.num_layers * self.slab_bytes()
    }

    /// KV bytes stored per token, scales amortised over the block
    /// (layers × kv_heads × head_dim × 2 × elem bytes for unquantised dtypes).
    pub fn bytes_per_token(&self) -> f64 {
        self.block_bytes() as f64 / self.block_size_tokens as f64
    }

    /// Bytes per token, exact, for unquantised dtypes (`None` for Int8, whose scales amortise).
    pub const fn bytes_per_token_exact(&self) -> Option<usize> {
        match self.dtype {
            KvDtype::Int8 => None,
            d => Some(self.num_layers * self.num_kv_heads * self.head_dim * 2 * d.elem_bytes()),
        }
    }

    /// Bytes of a pool of `num_blocks` blocks.
    pub const fn pool_bytes(&self, num_blocks: usize) -> usize {
        num_blocks * self.block_bytes()
    }

    /// Byte offset of the (layer, block) slab in a pool of `num_blocks` blocks (layer-major).
    pub const fn slab_offset(&self, num_blocks: usize, layer: usize, block: usize) -> usize {
        (layer * num_blocks + block) * self.slab_bytes()
    }

    /// How many blocks of this layout fit in `bytes`.
    pub const fn blocks_for_bytes(&self, bytes: u64) -> usize {
        (bytes / self.block_bytes() as u64) as usize
    }

    /// A stable 64-bit fingerprint of everything that must match for two nodes to exchange KV.
    pub fn fingerprint(&self) -> u64 {
        let mut buf = Vec::with_capacity(48);
        buf.extend_from_slice(b"tandem.kv.v1");
        for v in [self.num_layers, self.num_kv_heads, self.head_dim, self.block_size_tokens] {
            buf.extend_from_slice(&(v as u64).to_le_bytes());
        }
        buf.push(self.dtype.wire_tag());
        buf.extend_from_slice(&self.model_fingerprint.to_le_bytes());
        xxhash_rust::xxh3::xxh3_64(&buf)
    }

    /// Ok when `other` is byte-compatible with `self`; a typed mismatch otherwise.
    pub fn check_compatible(&self, other: &KvLayout) -> Result<(), LayoutError> {
        if self.fingerprint() == other.fingerprint() && self == other {
            Ok(())
        } else {
            Err(LayoutError::Mismatch { local: self.to_string(), remote: other.to_string() })
        }
    }
}

impl fmt::Display for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} layers × {} kv heads × {} dims, {} tokens/block, {}, model {:016x}",
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.block_size_tokens,
            self.dtype,
            self.model_fingerprint
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PINNED_LLAMA70B_BF16: u64 = 272_765_397_267_690_999;

    fn llama70b() -> KvLayout {
        KvLayout::new(80, 8, 128, 16, KvDtype::Bf16, 0).unwrap()
    }

    #[test]
    fn llama70b_bf16_is_320_kib_per_token_and_5_mib_per_block() {
        let l = llama70b();
        assert_eq!(l.bytes_per_token_exact(), Some(327_680));
        assert_eq!(l.block_bytes(), 5 * 1024 * 1024);
        assert_eq!(l.bytes_per_token(), 327_680.0);
    }

    #[test]
    fn int8_halves_bf16_up_to_the_scales() {
        let bf16 = KvLayout::new(30, 3, 64, 16, KvDtype::Bf16, 0).unwrap();
        let int8 = KvLayout { dtype: KvDtype::Int8, ..bf16 };
        let ratio = int8.bytes_per_token() / bf16.bytes_per_token();
        // Per head and block: 2 × 1024 data bytes + (64 + 16) f16 scales vs 4096 bytes.
        assert!((ratio - 2208.0 / 4096.0).abs() < 1e-9, "ratio {ratio}");
        assert_eq!(int8.v_scales_offset(2) + 2 * 16, int8.slab_bytes());
        assert_eq!(int8.slab_bytes() % 4, 0);
    }

    #[test]
    fn slabs_are_layer_major_and_do_not_overlap() {
        let l = KvLayout::new(3, 2, 8, 4, KvDtype::F16, 0).unwrap();
        let n = 5;
        let mut offsets: Vec<usize> =
            (0..3).flat_map(|layer| (0..n).map(move |b| l.slab_offset(n, layer, b))).collect();
        let sorted = offsets.clone();
        offsets.sort();
        assert_eq!(offsets, sorted, "layer-major order");
        for w in offsets.windows(2) {
            assert_eq!(w[1] - w[0], l.slab_bytes());
        }
        assert_eq!(offsets.last().unwrap() + l.slab_bytes(), l.pool_bytes(n));
    }

    #[test]
    fn fingerprint_is_stable_and_sensitive_to_every_field() {
        let base = llama70b();
        // Pinned: changing this value breaks compatibility between releases on purpose only.
        assert_eq!(base.fingerprint(), PINNED_LLAMA70B_BF16);
        let variants = [
            KvLayout { num_layers: 81, ..base },
            KvLayout { num_kv_heads: 4, ..base },
            KvLayout { head_dim: 64, ..base },
            KvLayout { block_size_tokens: 32, ..base },
            KvLayout { dtype: KvDtype::F16, ..base },
            KvLayout { model_fingerprint: 1, ..base },
        ];
        for v in variants {
            assert_ne!(v.fingerprint(), base.fingerprint(), "{v}");
            assert!(matches!(base.check_compatible(&v), Err(LayoutError::Mismatch { .. })));
        }
        assert!(base.check_compatible(&llama70b()).is_ok());
    }

    #[test]
    fn zero_dimensions_are_rejected_with_the_field_name() {
        assert_eq!(
            KvLayout::new(1, 0, 64, 16, KvDtype::F32, 0),
            Err(LayoutError::Zero { field: "num_kv_heads" })
        );
        assert!("fp8".parse::<KvDtype>().is_err());
        assert_eq!("BF16".parse::<KvDtype>(), Ok(KvDtype::Bf16));
    }
}
