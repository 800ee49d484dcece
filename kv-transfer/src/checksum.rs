//! Slab checksums: XXH3-64 (seed 0, default secret), with an AVX2 path for long inputs.
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
//! hash: one stream copies+hashes at 5-7 GB/s here, four at 8.5-9.8 GB/s (glibc memcpy: 7.6-8.9
//! in the same runs). The copy can also use non-temporal stores, which skip the read-for-
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
mod avx2 {
    use std::arch::x86_64::*;

    pub(super) const SECRET: [u8; 192] = [
        0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,
        0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3,
        0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc,
        0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
        0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65,
        0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19,
        0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9,
        0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
        0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb,
        0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0,
        0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d,
        0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
        0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
    ];
    pub(super) const PRIME32_1: u64 = 0x9E37_79B1;
    pub(super) const PRIME32_2: u64 = 0x85EB_CA77;
    pub(super) const PRIME32_3: u64 = 0xC2B2_AE3D;
    pub(super) const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
    pub(super) const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    pub(super) const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
    pub(super) const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
    pub(super) const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;
    pub(super) const STRIPE: usize = 64;
    pub(super) const CONSUME: usize = 8;
    pub(super) const STRIPES_PER_BLOCK: usize = (SECRET.len() - STRIPE) / CONSUME;
    pub(super) const BLOCK: usize = STRIPE * STRIPES_PER_BLOCK;

    #[inline(always)]
    unsafe fn accumulate_512(acc: &mut [__m256i; 2], input: *const u8, secret: *const u8) {
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY (all intrinsics): AVX2 is enabled by the caller's target_feature; loads are
            // unaligned loads within the caller-checked input and the 192-byte secret.
            unsafe {
                let data = _mm256_loadu_si256(input.add(32 * i).cast());
                let key = _mm256_loadu_si256(secret.add(32 * i).cast());
                let data_key = _mm256_xor_si256(data, key);
                let data_key_hi = _mm256_srli_epi64::<32>(data_key);
                let product = _mm256_mul_epu32(data_key, data_key_hi);
                let swapped = _mm256_shuffle_epi32::<0b01_00_11_10>(data);
                *a = _mm256_add_epi64(*a, _mm256_add_epi64(product, swapped));
            }
        }
    }

    #[inline(always)]
    unsafe fn scramble(acc: &mut [__m256i; 2], secret: *const u8) {
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: as in accumulate_512.
            unsafe {
                let key = _mm256_loadu_si256(secret.add(32 * i).cast());
                let x = _mm256_xor_si256(_mm256_xor_si256(*a, _mm256_srli_epi64::<47>(*a)), key);
                let prime = _mm256_set1_epi32(PRIME32_1 as i32);
                let lo = _mm256_mul_epu32(x, prime);
                let hi = _mm256_mul_epu32(_mm256_srli_epi64::<32>(x), prime);
                *a = _mm256_add_epi64(lo, _mm256_slli_epi64::<32>(hi));
            }
        }
    }

    fn read64(p: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(p[at..at + 8].try_into().expect("8 bytes"))
    }

    fn mul128_fold64(a: u64, b: u64) -> u64 {
        let p = (a as u128) * (b as u128);
        (p as u64) ^ ((p >> 64) as u64)
    }

    fn avalanche(mut h: u64) -> u64 {
        h ^= h >> 37;
        h = h.wrapping_mul(0x1656_6791_9E37_79F9);
        h ^ (h >> 32)
    }

    /// XXH3-64 (seed 0) of an input longer than 240 bytes.
    ///
    /// # Safety
    /// The CPU supports AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn xxh3_64_long(input: &[u8]) -> u64 {
        // SAFETY: AVX2 per the caller; no copy requested.
        unsafe { long::<false>(input, std::ptr::null_mut()) }
    }

    /// Copies `input` to `dst` while hashing it: XXH3-64 (seed 0), inputs over 240 bytes.
    ///
    /// # Safety
    /// The CPU supports AVX2; `dst` is valid for `input.len()` bytes and does not overlap it.
    #[target_feature(enable = "avx2")]
    pub unsafe fn copy_xxh3_64_long(input: &[u8], dst: *mut u8) -> u64 {
        // SAFETY: AVX2 per the caller; `dst` per the caller.
        unsafe { long::<true>(input, dst) }
    }

    /// One stripe: hash it, and (COPY) store it to `dst` at the same offset.
    #[inline(always)]
    unsafe fn stripe<const COPY: bool>(
        acc: &mut [__m256i; 2],
        p: *const u8,
        dst: *mut u8,
        at: usize,
        secret: *const u8,
    ) {
        // SAFETY: the caller keeps `at + 64` within the input (and `dst`).
        unsafe {
            if COPY {
                let a = _mm256_loadu_si256(p.add(at).cast());
                let b = _mm256_loadu_si256(p.add(at + 32).cast());
                _mm256_storeu_si256(dst.add(at).cast(), a);
                _mm256_storeu_si256(dst.add(at + 32).cast(), b);
            }
            accumulate_512(acc, p.add(at), secret);
        }
    }

    #[inline(always)]
    unsafe fn long<const COPY: bool>(input: &[u8], dst: *mut u8) -> u64 {
        let len = input.len();
        debug_assert!(len > super::MIDSIZE_MAX);
        let init = [
            PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1,
        ];
        // SAFETY: `init` has 8 u64s = two 256-bit vectors.
        let mut acc: [__m256i; 2] = unsafe {
            [
                _mm256_loadu_si256(init.as_ptr().cast()),
                _mm256_loadu_si256(init.as_ptr().add(4).cast()),
            ]
        };
        let p = input.as_ptr();
        let s = SECRET.as_ptr();
        let blocks = (len - 1) / BLOCK;
        for b in 0..blocks {
            for st in 0..STRIPES_PER_BLOCK {
                // SAFETY: b * BLOCK + (st + 1) * STRIPE <= blocks * BLOCK <= len - 1; the
                // secret offset st * 8 + 64 <= 192.
                unsafe {
                    stripe::<COPY>(
                        &mut acc,
                        p,
                        dst,
                        b * BLOCK + st * STRIPE,
                        s.add(st * CONSUME),
                    )
                };
            }
            // SAFETY: secret[128..192] is in bounds.
            unsafe { scramble(&mut acc, s.add(SECRET.len() - STRIPE)) };
        }
        let stripes = ((len - 1) - BLOCK * blocks) / STRIPE;
        for st in 0..stripes {
            // SAFETY: stays below len - 1 by the definition of `stripes`.
            unsafe {
                stripe::<COPY>(
                    &mut acc,
                    p,
                    dst,
                    blocks * BLOCK + st * STRIPE,
                    s.add(st * CONSUME),
                )
            };
        }
        if COPY {
            // The bytes after the last whole stripe (1..=64 of them), then the last stripe's hash.
            let done = blocks * BLOCK + stripes * STRIPE;
            // SAFETY: done < len; both ranges are within input/dst.
            unsafe { std::ptr::copy_nonoverlapping(p.add(done), dst.add(done), len - done) };
        }
        // SAFETY: len > 240 >= 64, and the secret offset 192 - 64 - 7 = 121 leaves 64 bytes.
        unsafe {
            accumulate_512(
                &mut acc,
                p.add(len - STRIPE),
                s.add(SECRET.len() - STRIPE - 7),
            )
        };
        let mut lanes = [0u64; 8];
        // SAFETY: `lanes` has room for two 256-bit stores.
        unsafe {
            _mm256_storeu_si256(lanes.as_mut_ptr().cast(), acc[0]);
            _mm256_storeu_si256(lanes.as_mut_ptr().add(4).cast(), acc[1]);
        }
        finish(lanes, len)
    }

    /// The final merge of the eight accumulator lanes of an input of `len` bytes.
    pub(super) fn finish(lanes: [u64; 8], len: usize) -> u64 {
        let mut result = (len as u64).wrapping_mul(PRIME64_1);
        for i in 0..4 {
            let at = 11 + 16 * i;
            result = result.wrapping_add(mul128_fold64(
                lanes[2 * i] ^ read64(&SECRET, at),
                lanes[2 * i + 1] ^ read64(&SECRET, at + 8),
            ));
        }
        avalanche(result)
    }
}

/// XXH3-64 with AVX-512: several equal-length slabs hashed (and copied) in one interleaved loop.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::avx2::{BLOCK, CONSUME, PRIME32_1, SECRET, STRIPE, STRIPES_PER_BLOCK, finish};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn accumulate(acc: &mut __m512i, data: __m512i, secret: *const u8) {
        // SAFETY: AVX-512F per the caller's target_feature; the secret load stays in the
        // 192-byte secret.
        unsafe {
            let key = _mm512_loadu_si512(secret.cast());
            let data_key = _mm512_xor_si512(data, key);
            let data_key_hi = _mm512_srli_epi64::<32>(data_key);
            let product = _mm512_mul_epu32(data_key, data_key_hi);
            let swapped = _mm512_shuffle_epi32::<0b01_00_11_10>(data);
            *acc = _mm512_add_epi64(*acc, _mm512_add_epi64(product, swapped));
        }
    }

    #[inline(always)]
    unsafe fn scramble(acc: &mut __m512i, secret: *const u8) {
        // SAFETY: as in `accumulate`.
        unsafe {
            let key = _mm512_loadu_si512(secret.cast());
            let x = _mm512_xor_si512(_mm512_xor_si512(*acc, _mm512_srli_epi64::<47>(*acc)), key);
            let prime = _mm512_set1_epi32(PRIME32_1 as i32);
            let lo = _mm512_mul_epu32(x, prime);
            let hi = _mm512_mul_epu32(_mm512_srli_epi64::<32>(x), prime);
            *acc = _mm512_add_epi64(lo, _mm512_slli_epi64::<32>(hi));
        }
    }

    /// Copies each of `N` equal-length inputs (over 240 bytes) to its destination with
    /// non-temporal stores while hashing it; returns XXH3-64 (seed 0) of each. The `N` streams
    /// advance together, one 64-byte stripe of each per step: more independent misses in flight
    /// than one stream has, and `N` independent hash chains.
    ///
    /// # Safety
    /// The CPU supports AVX-512F; every `dst[i]` is 64-byte aligned, valid for `len` bytes and
    /// overlaps no input.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn copy_nt_xxh3_64_multi<const N: usize>(
        inputs: [&[u8]; N],
        dsts: [*mut u8; N],
    ) -> [u64; N] {
        // SAFETY: per the caller.
        unsafe { multi::<N, true>(inputs, dsts) }
    }

    /// XXH3-64 (seed 0) of each of `N` equal-length inputs over 240 bytes, streams interleaved
    /// as in [`copy_nt_xxh3_64_multi`].
    ///
    /// # Safety
    /// The CPU supports AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn xxh3_64_multi<const N: usize>(inputs: [&[u8]; N]) -> [u64; N] {
        // SAFETY: per the caller; nothing is stored.
        unsafe { multi::<N, false>(inputs, [std::ptr::null_mut(); N]) }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn multi<const N: usize, const COPY: bool>(
        inputs: [&[u8]; N],
        dsts: [*mut u8; N],
    ) -> [u64; N] {
        let len = inputs[0].len();
        debug_assert!(len > super::MIDSIZE_MAX && inputs.iter().all(|i| i.len() == len));
        let init = [
            super::avx2::PRIME32_3,
            super::avx2::PRIME64_1,
            super::avx2::PRIME64_2,
            super::avx2::PRIME64_3,
            super::avx2::PRIME64_4,
            super::avx2::PRIME32_2,
            super::avx2::PRIME64_5,
            PRIME32_1,
        ];
        // SAFETY: `init` is 64 bytes.
        let mut acc: [__m512i; N] = [unsafe { _mm512_loadu_si512(init.as_ptr().cast()) }; N];
        let s = SECRET.as_ptr();
        // A plain fn, not a closure: closures do not inherit the caller's target features.
        #[inline(always)]
        unsafe fn step<const N: usize, const COPY: bool>(
            acc: &mut [__m512i; N],
            inputs: &[&[u8]; N],
            dsts: &[*mut u8; N],
            at: usize,
            secret: *const u8,
        ) {
            for i in 0..N {
                // SAFETY: the callers keep `at + 64 <= len`; `dsts[i]` is aligned and valid
                // for `len` bytes.
                unsafe {
                    let d = _mm512_loadu_si512(inputs[i].as_ptr().add(at).cast());
                    if COPY {
                        _mm512_stream_si512(dsts[i].add(at).cast(), d);
                    }
                    accumulate(&mut acc[i], d, secret);
                }
            }
        }
        let blocks = (len - 1) / BLOCK;
        for b in 0..blocks {
            for st in 0..STRIPES_PER_BLOCK {
                // SAFETY: as in avx2::long; the secret offset st * 8 + 64 <= 192.
                unsafe {
                    step::<N, COPY>(
                        &mut acc,
                        &inputs,
                        &dsts,
                        b * BLOCK + st * STRIPE,
                        s.add(st * CONSUME),
                    )
                };
            }
            for a in acc.iter_mut() {
                // SAFETY: secret[128..192].
                unsafe { scramble(a, s.add(SECRET.len() - STRIPE)) };
            }
        }
        let stripes = ((len - 1) - BLOCK * blocks) / STRIPE;
        for st in 0..stripes {
            // SAFETY: below len - 1 by the definition of `stripes`.
            unsafe {
                step::<N, COPY>(
                    &mut acc,
                    &inputs,
                    &dsts,
                    blocks * BLOCK + st * STRIPE,
                    s.add(st * CONSUME),
                )
            };
        }
        let done = blocks * BLOCK + stripes * STRIPE;
        let mut out = [0u64; N];
        for i in 0..N {
            let p = inputs[i].as_ptr();
            // SAFETY: done < len; the tail and the last stripe are within the input and dst;
            // secret offset 192 - 64 - 7 leaves 64 bytes.
            unsafe {
                if COPY {
                    std::ptr::copy_nonoverlapping(p.add(done), dsts[i].add(done), len - done);
                }
                let last = _mm512_loadu_si512(p.add(len - STRIPE).cast());
                accumulate(&mut acc[i], last, s.add(SECRET.len() - STRIPE - 7));
            }
            let mut lanes = [0u64; 8];
            // SAFETY: 64 bytes of room.
            unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), acc[i]) };
            out[i] = finish(lanes, len);
        }
        if COPY {
            // Orders the streaming stores before whatever follows.
            _mm_sfence();
        }
        out
    }
}

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
