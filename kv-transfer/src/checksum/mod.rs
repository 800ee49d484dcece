//! Slab checksums: XXH3-64 (seed 0, default secret), with AVX2 and AVX-512 paths for long inputs.
//!
//! Every slab is hashed twice per transfer (sender before it leaves, receiver after it lands),
//! so the hash sits on the data path: at 320 MiB per 70B-layout transfer it costs as much CPU as
//! the copy itself. `xxhash-rust` picks its SIMD path at compile time (SSE2 in a default x86-64
//! build); [`slab_checksum`] detects AVX2 at run time and runs XXH3's long-input loop two
//! accumulators wide, about twice as fast on cache-resident data. The value is XXH3-64 either
//! way (a test checks it against `xxhash-rust` for every length class and alignment), so peers on
//! different CPUs agree.
//!
//! [`copy_with_checksum`] fuses the sender's copy into a peer's mapped pool with its hash, so the
//! source is read once.
//!
//! [`slab_checksums`] and [`copy_slabs_with_checksums`] work on a chunk's slabs at once: with
//! AVX-512 they run four equal-length slabs through one loop, a 64-byte stripe of each per step.
//! On a cold source one core's bandwidth is bounded by the misses it keeps in flight, not by the
//! hash: on this project's 2-vCPU host, one stream copies+hashes 320 MiB at 4.4-7.4 GB/s, four at
//! 7.1-9.8 GB/s (glibc `memcpy` of the whole buffer: 6.8-8.9 in the same runs; see
//! `BENCH_RESULTS.md`). The copy can also use non-temporal stores, which skip the read-for-
//! ownership of every destination line.
//!
//! A single flipped byte changes the hash with probability 1 − 2⁻⁶⁴ (XXH3's accumulation is a
//! bijection of the input stripe on the 512-bit state; only the final fold can collide).

/// XXH3-64 of one slab.
#[inline]
pub fn slab_checksum(bytes: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if bytes.len() > MIDSIZE_MAX && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is available (checked just above).
        return unsafe { avx2::xxh3_64_long(bytes) };
    }
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Copies `src` into `dst` (same length) and returns XXH3-64 of the bytes, in one pass over
/// `src` where AVX2 allows (each 64-byte stripe is loaded once, stored, and hashed): the sender's
/// path when it writes straight into a peer's mapped pool.
///
/// # Safety
/// `dst` is valid for `src.len()` bytes of writes and does not overlap `src`.
pub unsafe fn copy_with_checksum(src: &[u8], dst: *mut u8) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if src.len() > MIDSIZE_MAX && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is available; the caller's contract covers `dst`.
        return unsafe { avx2::copy_xxh3_64_long(src, dst) };
    }
    // SAFETY: the caller's contract covers `dst`.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
    xxhash_rust::xxh3::xxh3_64(src)
}

/// How many slabs the AVX-512 kernels interleave.
const STREAMS: usize = 4;

/// XXH3-64 of each slab, in order, appended to `out`. With AVX-512, runs of four equal-length
/// slabs are hashed in one interleaved pass (four streams of misses in flight instead of one:
/// on a cold source this is what keeps one core near its memory bandwidth).
pub fn slab_checksums(slabs: &[&[u8]], out: &mut Vec<u64>) {
    out.reserve(slabs.len());
    let mut rest = slabs;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        while let Some((group, tail)) = rest.split_first_chunk::<STREAMS>() {
            let len = group[0].len();
            if len <= MIDSIZE_MAX || group.iter().any(|s| s.len() != len) {
                break;
            }
            // SAFETY: AVX-512F is available (checked above); lengths are equal and over 240.
            out.extend(unsafe { avx512::xxh3_64_multi(*group) });
            rest = tail;
        }
    }
    out.extend(rest.iter().map(|s| slab_checksum(s)));
}

/// Copies each `(source, destination)` slab and appends XXH3-64 of the bytes to `out`, in one
/// pass over each source. `streaming` asks for non-temporal stores (the destination goes to
/// memory, not into this core's caches: right for transfers larger than the cache, wrong when
/// the reader is about to read the bytes from cache); it applies to runs of four equal-length,
/// 64-byte-aligned destinations with AVX-512, the rest are copied with plain stores.
///
/// # Safety
/// Every destination is valid for its source's length of writes and overlaps no source.
pub unsafe fn copy_slabs_with_checksums(
    slabs: &[(&[u8], *mut u8)],
    streaming: bool,
    out: &mut Vec<u64>,
) {
    out.reserve(slabs.len());
    let mut rest = slabs;
    #[cfg(target_arch = "x86_64")]
    if streaming && std::arch::is_x86_feature_detected!("avx512f") {
        while let Some((group, tail)) = rest.split_first_chunk::<STREAMS>() {
            let len = group[0].0.len();
            if len <= MIDSIZE_MAX
                || group
                    .iter()
                    .any(|(s, d)| s.len() != len || !(*d as usize).is_multiple_of(64))
            {
                break;
            }
            // SAFETY: AVX-512F is available; equal lengths over 240; aligned destinations valid
            // for `len` bytes per the caller.
            out.extend(unsafe {
                avx512::copy_nt_xxh3_64_multi(group.map(|(s, _)| s), group.map(|(_, d)| d))
            });
            rest = tail;
        }
    }
    for &(src, dst) in rest {
        // SAFETY: per the caller.
        out.push(unsafe { copy_with_checksum(src, dst) });
    }
}

/// A block's checksum across layers: XXH3 over its per-layer slab checksums in layer order.
pub fn block_checksum(slab_checksums_by_layer: impl Iterator<Item = u64>) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for c in slab_checksums_by_layer {
        h.update(&c.to_le_bytes());
    }
    h.digest()
}

/// Inputs up to this length use XXH3's short/mid-size paths (never AVX2).
const MIDSIZE_MAX: usize = 240;

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_equals_xxh3_for_every_length_class_and_alignment() {
        let data: Vec<u8> = (0..70_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8)
            .collect();
        let lens = [
            0, 1, 3, 16, 17, 128, 129, 240, 241, 255, 256, 1023, 1024, 1025, 2048, 4097, 65_536,
            69_000,
        ];
        for len in lens {
            for offset in [0, 1, 7, 31] {
                let s = &data[offset..offset + len];
                assert_eq!(
                    slab_checksum(s),
                    xxhash_rust::xxh3::xxh3_64(s),
                    "len {len}, offset {offset}"
                );
            }
        }
    }

    #[test]
    fn copy_with_checksum_copies_exactly_and_hashes_like_xxh3() {
        let data: Vec<u8> = (0..70_000u32)
            .map(|i| (i.wrapping_mul(40_503) >> 3) as u8)
            .collect();
        for len in [0, 5, 240, 241, 1000, 1024, 1025, 4096, 65_536, 69_999] {
            let mut out = vec![0u8; len + 2];
            // SAFETY: `out` has room for `len` bytes at offset 1 and does not overlap `data`.
            let h = unsafe { copy_with_checksum(&data[..len], out.as_mut_ptr().add(1)) };
            assert_eq!(h, xxhash_rust::xxh3::xxh3_64(&data[..len]), "len {len}");
            assert_eq!(&out[1..=len], &data[..len], "len {len}");
            assert_eq!(
                (out[0], out[len + 1]),
                (0, 0),
                "nothing written outside, len {len}"
            );
        }
    }

    #[test]
    fn interleaved_avx512_copy_and_hash_match_xxh3_per_stream() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("no AVX-512 here: the interleaved kernels are not used on this CPU");
            return;
        }
        let data: Vec<u8> = (0..300_000u32)
            .map(|i| (i.wrapping_mul(2_246_822_519) >> 9) as u8)
            .collect();
        for len in [241, 1000, 1024, 1025, 6144, 65_536, 65_537] {
            let ins: [&[u8]; 4] = std::array::from_fn(|i| &data[i * 70_001 + 3..][..len]);
            let want: Vec<u64> = ins.iter().map(|s| xxhash_rust::xxh3::xxh3_64(s)).collect();
            // SAFETY: AVX-512F checked above.
            assert_eq!(
                unsafe { avx512::xxh3_64_multi(ins) }.to_vec(),
                want,
                "len {len}"
            );
            let stride = (len + 64).next_multiple_of(64);
            let mut out = AlignedBuf::new(4 * stride);
            let dsts: [*mut u8; 4] = std::array::from_fn(|i| out.ptr().wrapping_add(i * stride));
            // SAFETY: AVX-512F; each destination is 64-byte aligned with `len` bytes of room
            // and does not overlap `data`.
            let got = unsafe { avx512::copy_nt_xxh3_64_multi(ins, dsts) };
            assert_eq!(got.to_vec(), want, "copy len {len}");
            for (i, src) in ins.iter().enumerate() {
                assert_eq!(
                    &out.bytes()[i * stride..i * stride + len],
                    *src,
                    "stream {i} len {len}"
                );
                assert!(
                    out.bytes()[i * stride + len..(i + 1) * stride]
                        .iter()
                        .all(|&b| b == 0)
                );
            }
        }
    }

    #[test]
    fn batch_checksums_and_copies_equal_per_slab_xxh3_in_order() {
        let data: Vec<u8> = (0..200_000u32)
            .map(|i| (i.wrapping_mul(3_266_489_917) >> 11) as u8)
            .collect();
        // Six equal slabs (one interleaved group of four and a tail of two), then an odd one.
        let slab = 6144;
        let mut slabs: Vec<&[u8]> = (0..6).map(|i| &data[i * slab..(i + 1) * slab]).collect();
        slabs.push(&data[100_000..100_100]);
        let want: Vec<u64> = slabs
            .iter()
            .map(|s| xxhash_rust::xxh3::xxh3_64(s))
            .collect();
        let mut got = vec![7u64];
        slab_checksums(&slabs, &mut got);
        assert_eq!(got[1..], want[..]);
        for streaming in [false, true] {
            let mut out = AlignedBuf::new(8 * slab);
            let base = out.ptr();
            let pairs: Vec<(&[u8], *mut u8)> = slabs
                .iter()
                .enumerate()
                .map(|(i, s)| (*s, base.wrapping_add(i * slab)))
                .collect();
            let mut sums = Vec::new();
            // SAFETY: each destination has `slab` bytes of room in `out`, apart from the others.
            unsafe { copy_slabs_with_checksums(&pairs, streaming, &mut sums) };
            assert_eq!(sums, want, "streaming {streaming}");
            for (i, s) in slabs.iter().enumerate() {
                assert_eq!(&out.bytes()[i * slab..i * slab + s.len()], *s, "slab {i}");
            }
        }
    }

    /// A zeroed, 64-byte-aligned test buffer.
    struct AlignedBuf(Vec<u8>, usize);

    impl AlignedBuf {
        fn new(len: usize) -> Self {
            let v = vec![0u8; len + 64];
            let skip = v.as_ptr().align_offset(64);
            Self(v, skip)
        }
        fn ptr(&mut self) -> *mut u8 {
            self.0[self.1..].as_mut_ptr()
        }
        fn bytes(&self) -> &[u8] {
            &self.0[self.1..]
        }
    }

    #[test]
    fn a_single_flipped_byte_changes_the_checksum_at_every_position_tried() {
        let mut data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let base = slab_checksum(&data);
        for at in (0..data.len()).step_by(61) {
            data[at] ^= 0x01;
            assert_ne!(slab_checksum(&data), base, "flip at {at}");
            data[at] ^= 0x01;
        }
    }

    #[test]
    fn block_checksum_depends_on_layer_order() {
        assert_ne!(
            block_checksum([1u64, 2, 3].into_iter()),
            block_checksum([3u64, 2, 1].into_iter())
        );
    }
}
