//! XXH3-64's long-input loop with AVX2, two 256-bit accumulators; optionally storing each
//! stripe to a destination as it is hashed (one pass over the source).

use std::arch::x86_64::*;

pub(super) const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
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
