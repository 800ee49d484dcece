//! XXH3-64 with AVX-512: several equal-length slabs hashed (and copied, with non-temporal
//! stores) in one interleaved loop. Each stream keeps its own 512-bit accumulator, so the
//! result per slab is exactly XXH3-64 of that slab.

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
