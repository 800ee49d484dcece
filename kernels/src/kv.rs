//! Views of a paged KV pool and the cache write.
//!
//! Byte layout (defined by `tandem-kv-layout`): layer-major slabs, one per (layer, block):
//! `[K: kv_heads × block_size × head_dim][V: same][Int8 only: K scales: kv_heads × head_dim f16]
//! [Int8 only: V scales: kv_heads × block_size f16]`, elements little-endian. A head's tokens are
//! contiguous, so a (layer, block, head, K|V) tile is a dense `block_size × head_dim` matrix.
//!
//! Writes convert f32 to the layout dtype: f16/bf16 round to nearest even. Int8 is symmetric,
//! `q = round(x / scale)` (to nearest even) clamped to ±127, with KIVI's granularity:
//! - **values**: one scale per (block, head, token), `scale = f16(max|v| / 127)`: each token is
//!   quantised on its own and never touched again;
//! - **keys**: one scale per (block, head, channel): key outliers sit in fixed channels, so a
//!   per-channel scale keeps the other channels fine. A run of tokens written to a block in one
//!   call shares scales computed over the whole run; when a later token needs a larger scale in
//!   some channel, that channel's stored values are requantized first (`q' = round(q·old/new)`,
//!   at most half a step of error added per requantization). Writing offset 0 starts the block
//!   afresh, so a recycled block never inherits a previous owner's scales.
//!
//! Scales are stored as f16 and quantisation uses the stored (rounded) value, so what is read
//! back is exactly `q × stored_scale`. Because key scales grow with the tokens seen, Int8 KV
//! depends on how a block's tokens were split across calls (chunking); the float dtypes do not.
//!
//! Cost: `write_kv` is one pass over the new values, plus `block_size` values per channel whose
//! key scale grows.

use crate::KernelError;
use crate::error::check_len;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};
use std::marker::PhantomData;
use tandem_kv_layout::{KvDtype, KvLayout};

/// Read-only view of a whole KV pool (all layers), `layout.pool_bytes(num_blocks)` bytes.
///
/// The view never hands out a slice of the whole pool: kernels read one `(layer, block)` slab at
/// a time ([`slab`](Self::slab)). A pool can live in memory a KV transport writes into (blocks
/// reserved for an inbound transfer); a whole-pool slice would assert that nothing changes
/// those bytes while it lives, which the transport breaks. Slab slices cover only blocks the
/// caller vouched for when it built the view ([`from_raw_parts`](Self::from_raw_parts)).
#[derive(Clone, Copy, Debug)]
pub struct KvCacheRef<'a> {
    /// The pool's layout.
    pub layout: &'a KvLayout,
    /// Blocks in the pool.
    pub num_blocks: usize,
    base: *const u8,
    len: usize,
    _bytes: PhantomData<&'a [u8]>,
}

// SAFETY: a `KvCacheRef` is a shared borrow of bytes (as `&[u8]`, which is Send + Sync); the
// raw pointer only narrows what is borrowed at once.
unsafe impl Send for KvCacheRef<'_> {}
// SAFETY: as above.
unsafe impl Sync for KvCacheRef<'_> {}

impl<'a> KvCacheRef<'a> {
    /// A view of `bytes`, borrowed whole (an owned pool, tests).
    pub fn new(layout: &'a KvLayout, num_blocks: usize, bytes: &'a [u8]) -> Self {
        KvCacheRef {
            layout,
            num_blocks,
            base: bytes.as_ptr(),
            len: bytes.len(),
            _bytes: PhantomData,
        }
    }

    /// A view of the pool at `base`.
    ///
    /// # Safety
    /// `base` is valid for reads of `len` bytes for `'a`, and every slab a kernel reads through
    /// this view (the blocks of the sequences it is given) is written by no one while the view
    /// lives. Other blocks may change (a transport writing reserved blocks): no reference to
    /// them is ever made.
    pub unsafe fn from_raw_parts(
        layout: &'a KvLayout,
        num_blocks: usize,
        base: *const u8,
        len: usize,
    ) -> Self {
        KvCacheRef {
            layout,
            num_blocks,
            base,
            len,
            _bytes: PhantomData,
        }
    }

    /// The pool's size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len
    }

    /// The bytes of `(layer, block)`'s slab. Panics outside the pool.
    pub fn slab(&self, layer: usize, block: usize) -> &'a [u8] {
        let (at, n) = slab_range(self.layout, self.num_blocks, self.len, layer, block);
        // SAFETY: in bounds (checked), valid for 'a and unchanged while the view lives for the
        // blocks its user reads (the constructor's contract).
        unsafe { std::slice::from_raw_parts(self.base.add(at), n) }
    }
}

/// Mutable view of a whole KV pool (all layers), slab by slab as [`KvCacheRef`].
#[derive(Debug)]
pub struct KvCacheMut<'a> {
    /// The pool's layout.
    pub layout: &'a KvLayout,
    /// Blocks in the pool.
    pub num_blocks: usize,
    base: *mut u8,
    len: usize,
    _bytes: PhantomData<&'a mut [u8]>,
}

// SAFETY: an exclusive borrow of bytes (as `&mut [u8]`, which is Send + Sync).
unsafe impl Send for KvCacheMut<'_> {}
// SAFETY: as above; shared access goes through `&self` methods that only read.
unsafe impl Sync for KvCacheMut<'_> {}

impl<'a> KvCacheMut<'a> {
    /// A view of `bytes`, borrowed whole and exclusively (an owned pool, tests).
    pub fn new(layout: &'a KvLayout, num_blocks: usize, bytes: &'a mut [u8]) -> Self {
        KvCacheMut {
            layout,
            num_blocks,
            base: bytes.as_mut_ptr(),
            len: bytes.len(),
            _bytes: PhantomData,
        }
    }

    /// A writable view of the pool at `base`.
    ///
    /// # Safety
    /// `base` is valid for reads and writes of `len` bytes for `'a`, and every slab a kernel
    /// reads or writes through this view (the blocks of the slots it is given) is accessed by
    /// no one else while the view lives.
    pub unsafe fn from_raw_parts(
        layout: &'a KvLayout,
        num_blocks: usize,
        base: *mut u8,
        len: usize,
    ) -> Self {
        KvCacheMut {
            layout,
            num_blocks,
            base,
            len,
            _bytes: PhantomData,
        }
    }

    /// The pool's size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len
    }

    /// The bytes of `(layer, block)`'s slab, writable. Panics outside the pool.
    pub fn slab_mut(&mut self, layer: usize, block: usize) -> &mut [u8] {
        let (at, n) = slab_range(self.layout, self.num_blocks, self.len, layer, block);
        // SAFETY: in bounds (checked); `&mut self` makes this the view's only live slice, and
        // the constructor's contract keeps everyone else off the slab.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(at), n) }
    }

    /// A read-only view of the same pool.
    pub fn as_ref(&self) -> KvCacheRef<'_> {
        // SAFETY: the shared borrow of `self` stops writes through this view while the read
        // view lives; the contract on other writers carries over.
        unsafe { KvCacheRef::from_raw_parts(self.layout, self.num_blocks, self.base, self.len) }
    }
}

/// `(offset, len)` of slab `(layer, block)`; panics if it is not inside a pool of `len` bytes.
fn slab_range(
    l: &KvLayout,
    num_blocks: usize,
    len: usize,
    layer: usize,
    block: usize,
) -> (usize, usize) {
    assert!(
        layer < l.num_layers && block < num_blocks,
        "KV slab ({layer}, {block}) outside a pool of {} layers × {num_blocks} blocks",
        l.num_layers
    );
    let (at, n) = (l.slab_offset(num_blocks, layer, block), l.slab_bytes());
    assert!(
        at + n <= len,
        "KV slab ({layer}, {block}) ends past the pool's {len} bytes"
    );
    (at, n)
}

/// Which half of a slab.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvPart {
    /// Keys.
    K,
    /// Values.
    V,
}

impl KvPart {
    const fn index(self) -> usize {
        match self {
            KvPart::K => 0,
            KvPart::V => 1,
        }
    }
}

/// Byte offset of the `(head, part)` tile within its slab.
pub(crate) fn tile_offset(l: &KvLayout, head: usize, part: KvPart) -> usize {
    part.index() * l.kv_part_bytes() + head * l.head_tile_elems() * l.dtype.elem_bytes()
}

/// Byte offset within its slab of the Int8 scales of `head`: `head_dim` f16 key scales for K,
/// `block_size` f16 value scales for V.
pub(crate) fn scales_offset(l: &KvLayout, head: usize, part: KvPart) -> usize {
    match part {
        KvPart::K => l.k_scales_offset(head),
        KvPart::V => l.v_scales_offset(head),
    }
}

/// Reads the little-endian f16 at `at` as f32.
#[inline]
pub(crate) fn read_f16(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

fn write_f16(b: &mut [u8], at: usize, v: f16) {
    b[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
}

/// The smallest f16 scale ≥ `need` (so `need × 127` is representable), as f16.
fn scale_f16(need: f32) -> f16 {
    let s = f16::from_f32(need);
    if s.to_f32() < need {
        f16::from_bits(s.to_bits() + 1)
    } else {
        s
    }
}

pub(crate) fn read_f32(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn write_f32(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// Checks the pool size and layer index shared by every KV entry point.
pub(crate) fn check_pool(
    op: &'static str,
    layout: &KvLayout,
    num_blocks: usize,
    bytes_len: usize,
    layer: usize,
) -> Result<(), KernelError> {
    check_len(
        op,
        "pool bytes (layout.pool_bytes(num_blocks))",
        layout.pool_bytes(num_blocks),
        bytes_len,
    )?;
    if layer >= layout.num_layers {
        return Err(KernelError::LayerOutOfRange {
            op,
            layer,
            num_layers: layout.num_layers,
        });
    }
    Ok(())
}

/// Writes K and V of `T = slots.len()` new tokens into `layer`: `k`, `v` are
/// `[T × kv_heads × head_dim]` f32; `slots[t] = block_id * block_size + offset_in_block`.
/// Tokens are written in order (module docs give the dtype conversions and Int8 scaling).
pub fn write_kv(
    cache: &mut KvCacheMut<'_>,
    layer: usize,
    k: &[f32],
    v: &[f32],
    slots: &[usize],
) -> Result<(), KernelError> {
    const OP: &str = "write_kv";
    let l = *cache.layout;
    check_pool(OP, &l, cache.num_blocks, cache.len_bytes(), layer)?;
    let row = l.num_kv_heads * l.head_dim;
    check_len(
        OP,
        "k (T * kv_heads * head_dim)",
        slots.len() * row,
        k.len(),
    )?;
    check_len(
        OP,
        "v (T * kv_heads * head_dim)",
        slots.len() * row,
        v.len(),
    )?;
    let num_slots = cache.num_blocks * l.block_size_tokens;
    if let Some((token, &slot)) = slots.iter().enumerate().find(|&(_, &s)| s >= num_slots) {
        return Err(KernelError::SlotOutOfRange {
            op: OP,
            token,
            slot,
            num_slots,
        });
    }
    let (hd, bs) = (l.head_dim, l.block_size_tokens);
    let mut tmp16: Vec<u16> = Vec::new();
    for (t, &slot) in slots.iter().enumerate() {
        let (block, off) = (slot / bs, slot % bs);
        for (part, src) in [(KvPart::K, k), (KvPart::V, v)] {
            for h in 0..l.num_kv_heads {
                let x = &src[t * row + h * hd..t * row + (h + 1) * hd];
                let dst_at = tile_offset(&l, h, part) + off * hd * l.dtype.elem_bytes();
                let bytes = cache.slab_mut(layer, block);
                match l.dtype {
                    KvDtype::F32 => {
                        for (d, &xv) in x.iter().enumerate() {
                            write_f32(bytes, dst_at + 4 * d, xv);
                        }
                    }
                    KvDtype::F16 => {
                        tmp16.resize(hd, 0);
                        // Vectorised (F16C when present), round to nearest even either way.
                        tmp16
                            .as_mut_slice()
                            .reinterpret_cast_mut::<f16>()
                            .convert_from_f32_slice(x);
                        put_u16s(&mut bytes[dst_at..dst_at + 2 * hd], &tmp16);
                    }
                    KvDtype::Bf16 => {
                        tmp16.resize(hd, 0);
                        tmp16
                            .as_mut_slice()
                            .reinterpret_cast_mut::<bf16>()
                            .convert_from_f32_slice(x);
                        put_u16s(&mut bytes[dst_at..dst_at + 2 * hd], &tmp16);
                    }
                    KvDtype::Int8 => match part {
                        // Keys are handled per run of tokens below.
                        KvPart::K => {}
                        KvPart::V => {
                            let scale = scale_f16(abs_max(x) / 127.0);
                            let s_at = scales_offset(&l, h, KvPart::V);
                            write_f16(bytes, s_at + 2 * off, scale);
                            let sf = scale.to_f32();
                            for (d, &xv) in x.iter().enumerate() {
                                bytes[dst_at + d] = quantize(xv, sf) as u8;
                            }
                        }
                    },
                }
            }
        }
    }
    if l.dtype == KvDtype::Int8 {
        write_int8_keys(cache, layer, k, slots);
    }
    Ok(())
}

/// Int8 keys: for each run of consecutive slots in one block, per (head, channel) scales over the
/// run (and the block's earlier tokens), requantizing earlier tokens of a channel whose scale grows.
fn write_int8_keys(cache: &mut KvCacheMut<'_>, layer: usize, k: &[f32], slots: &[usize]) {
    let l = *cache.layout;
    let (hd, bs, row) = (l.head_dim, l.block_size_tokens, l.num_kv_heads * l.head_dim);
    let mut need = vec![0f32; hd];
    let mut t0 = 0;
    while t0 < slots.len() {
        let (block, off0) = (slots[t0] / bs, slots[t0] % bs);
        let mut t1 = t0 + 1;
        while t1 < slots.len() && slots[t1] == slots[t1 - 1] + 1 && slots[t1] / bs == block {
            t1 += 1;
        }
        for h in 0..l.num_kv_heads {
            let tile = tile_offset(&l, h, KvPart::K);
            let s_at = scales_offset(&l, h, KvPart::K);
            let bytes = cache.slab_mut(layer, block);
            need.iter_mut().for_each(|n| *n = 0.0);
            for t in t0..t1 {
                for (n, x) in need
                    .iter_mut()
                    .zip(&k[t * row + h * hd..t * row + (h + 1) * hd])
                {
                    *n = n.max(x.abs());
                }
            }
            for (c, n) in need.iter().enumerate() {
                let old = if off0 == 0 {
                    0.0
                } else {
                    read_f16(bytes, s_at + 2 * c)
                };
                if n / 127.0 > old {
                    let new = scale_f16(n / 127.0);
                    let newf = new.to_f32();
                    if old > 0.0 {
                        for t in 0..off0 {
                            let b = &mut bytes[tile + t * hd + c];
                            *b = quantize((*b as i8) as f32 * old, newf) as u8;
                        }
                    }
                    write_f16(bytes, s_at + 2 * c, new);
                } else if off0 == 0 {
                    write_f16(bytes, s_at + 2 * c, f16::ZERO);
                }
            }
            for t in t0..t1 {
                let off = slots[t] % bs;
                let x = &k[t * row + h * hd..t * row + (h + 1) * hd];
                for (c, &xv) in x.iter().enumerate() {
                    let sc = read_f16(bytes, s_at + 2 * c);
                    bytes[tile + off * hd + c] = quantize(xv, sc) as u8;
                }
            }
        }
        t0 = t1;
    }
}

/// `x / scale` clamped to ±127 and rounded to nearest even (by adding and subtracting
/// 1.5 × 2^23, exact for |y| < 2^22, so the loops vectorise where `f32::round` is a libm call);
/// 0 when the scale is 0 (and for NaN input: `max` drops it).
#[inline]
fn quantize(x: f32, scale: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 × 2^23
    if scale > 0.0 {
        // Not `clamp`: `max` must map NaN to -127 (`clamp` would pass NaN through).
        #[allow(clippy::manual_clamp)]
        let y = (x / scale).max(-127.0).min(127.0);
        let r = (y + MAGIC) - MAGIC;
        // SAFETY: `r` is an integer in [-127, 127] (clamped, and `max` maps NaN to -127).
        unsafe { r.to_int_unchecked::<i32>() as i8 }
    } else {
        0
    }
}

/// `max |x|` (NaN ignored), in 8 independent lanes so it vectorises.
fn abs_max(x: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l = l.max(v.abs());
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(0.0f32, |m, v| m.max(v.abs()));
    lanes.iter().fold(tail, |m, &v| m.max(v))
}

/// Writes `v` as little-endian u16s into `dst` (`2 * v.len()` bytes).
fn put_u16s(dst: &mut [u8], v: &[u16]) {
    for (d, &x) in dst.chunks_exact_mut(2).zip(v) {
        d.copy_from_slice(&x.to_le_bytes());
    }
}

/// Reads token `offset` of block `block`, head `head`, K or V, of `layer` back as f32 into
/// `out` (len head_dim). Int8 values come back as `q * scale` (key: the channel's scale; value:
/// the token's). Panics on out-of-range indices
/// or a pool of the wrong size (tests, debugging and transfer checks only).
pub fn read_kv(
    cache: &KvCacheRef<'_>,
    layer: usize,
    block: usize,
    offset: usize,
    head: usize,
    which: KvPart,
    out: &mut [f32],
) {
    let l = cache.layout;
    if let Err(e) = check_pool("read_kv", l, cache.num_blocks, cache.len_bytes(), layer) {
        panic!("{e}");
    }
    assert!(
        block < cache.num_blocks,
        "read_kv: block {block} >= {}",
        cache.num_blocks
    );
    assert!(
        offset < l.block_size_tokens,
        "read_kv: offset {offset} >= {}",
        l.block_size_tokens
    );
    assert!(
        head < l.num_kv_heads,
        "read_kv: head {head} >= {}",
        l.num_kv_heads
    );
    crate::error::assert_len("read_kv", "out (head_dim)", l.head_dim, out.len());
    let at = tile_offset(l, head, which) + offset * l.head_dim * l.dtype.elem_bytes();
    let b = cache.slab(layer, block);
    let scales_at = scales_offset(l, head, which);
    for (d, o) in out.iter_mut().enumerate() {
        *o = match l.dtype {
            KvDtype::F32 => read_f32(b, at + 4 * d),
            KvDtype::F16 => {
                f16::from_bits(u16::from_le_bytes([b[at + 2 * d], b[at + 2 * d + 1]])).to_f32()
            }
            KvDtype::Bf16 => {
                bf16::from_bits(u16::from_le_bytes([b[at + 2 * d], b[at + 2 * d + 1]])).to_f32()
            }
            KvDtype::Int8 => {
                let scale = match which {
                    KvPart::K => read_f16(b, scales_at + 2 * d),
                    KvPart::V => read_f16(b, scales_at + 2 * offset),
                };
                (b[at + d] as i8) as f32 * scale
            }
        };
    }
}
