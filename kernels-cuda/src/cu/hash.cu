// Slab checksums on the device: XXH3-64 (seed 0, the default 192-byte secret), the function
// kv-transfer's `checksum::slab_checksum` computes on the CPU, so a KV block copied between
// two processes' device pools (CUDA IPC) is verified against the same checksums the stream and
// UCX paths carry.
//
// xxh3_64_slabs: base: the pool's first byte; offsets: [n] byte offsets of the slabs; every
// slab is `slab_bytes` long; out: [n] checksums. One thread per slab (grid.x * blockDim.x >= n):
// a slab is hashed in the reference order, stripe after stripe, so the thread count does not
// change the result. Loads of 8 bytes are used where the address is 8-byte aligned (slab
// offsets of every KV layout are), byte loads elsewhere.
//
// Self-contained on purpose: the suite also compiles this file with the host's C++ compiler
// (TANDEM_HOST_CHECK) and checks it against the CPU's XXH3 on every length class, with no GPU.

typedef unsigned long long xu64;
typedef unsigned int xu32;
typedef unsigned char xu8;

#define TX_P32_1 0x9E3779B1ULL
#define TX_P32_2 0x85EBCA77ULL
#define TX_P32_3 0xC2B2AE3DULL
#define TX_P64_1 0x9E3779B185EBCA87ULL
#define TX_P64_2 0xC2B2AE3D27D4EB4FULL
#define TX_P64_3 0x165667B19E3779F9ULL
#define TX_P64_4 0x85EBCA77C2B2AE63ULL
#define TX_P64_5 0x27D4EB2F165667C5ULL

__device__ const xu8 TX_SECRET[192] = {
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
};

__device__ __forceinline__ xu64 tx_read64(const xu8* p) {
    if ((((unsigned long)p) & 7) == 0) return *(const xu64*)p;
    xu64 v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

__device__ __forceinline__ xu32 tx_read32(const xu8* p) {
    return (xu32)p[0] | ((xu32)p[1] << 8) | ((xu32)p[2] << 16) | ((xu32)p[3] << 24);
}

__device__ __forceinline__ xu64 tx_mulhi(xu64 a, xu64 b) {
#ifdef TANDEM_HOST_CHECK
    return (xu64)(((unsigned __int128)a * b) >> 64);
#else
    return __umul64hi(a, b);
#endif
}

__device__ __forceinline__ xu64 tx_fold(xu64 a, xu64 b) { return (a * b) ^ tx_mulhi(a, b); }

__device__ __forceinline__ xu64 tx_rotl(xu64 v, int r) { return (v << r) | (v >> (64 - r)); }

__device__ __forceinline__ xu64 tx_swap64(xu64 v) {
    v = ((v & 0x00FF00FF00FF00FFULL) << 8) | ((v >> 8) & 0x00FF00FF00FF00FFULL);
    v = ((v & 0x0000FFFF0000FFFFULL) << 16) | ((v >> 16) & 0x0000FFFF0000FFFFULL);
    return (v << 32) | (v >> 32);
}

__device__ __forceinline__ xu64 tx_xxh64_avalanche(xu64 h) {
    h ^= h >> 33;
    h *= TX_P64_2;
    h ^= h >> 29;
    h *= TX_P64_3;
    return h ^ (h >> 32);
}

__device__ __forceinline__ xu64 tx_avalanche(xu64 h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}

__device__ __forceinline__ xu64 tx_rrmxmx(xu64 h, xu64 len) {
    h ^= tx_rotl(h, 49) ^ tx_rotl(h, 24);
    h *= 0x9FB21C651E98DF25ULL;
    h ^= (h >> 35) + len;
    h *= 0x9FB21C651E98DF25ULL;
    return h ^ (h >> 28);
}

__device__ __forceinline__ xu64 tx_mix16(const xu8* in, const xu8* sec) {
    return tx_fold(tx_read64(in) ^ tx_read64(sec), tx_read64(in + 8) ^ tx_read64(sec + 8));
}

__device__ __forceinline__ void tx_accumulate_512(xu64* acc, const xu8* in, const xu8* sec) {
    for (int i = 0; i < 8; i++) {
        const xu64 v = tx_read64(in + 8 * i);
        const xu64 k = v ^ tx_read64(sec + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
    }
}

__device__ __forceinline__ void tx_scramble(xu64* acc, const xu8* sec) {
    for (int i = 0; i < 8; i++) {
        xu64 a = acc[i];
        a ^= a >> 47;
        a ^= tx_read64(sec + 8 * i);
        acc[i] = a * TX_P32_1;
    }
}

__device__ xu64 tandem_xxh3_64(const xu8* in, xu64 len) {
    const xu8* s = TX_SECRET;
    if (len <= 16) {
        if (len > 8) {
            const xu64 lo = tx_read64(in) ^ (tx_read64(s + 24) ^ tx_read64(s + 32));
            const xu64 hi = tx_read64(in + len - 8) ^ (tx_read64(s + 40) ^ tx_read64(s + 48));
            return tx_avalanche(len + tx_swap64(lo) + hi + tx_fold(lo, hi));
        }
        if (len >= 4) {
            const xu64 in1 = tx_read32(in), in2 = tx_read32(in + len - 4);
            const xu64 flip = tx_read64(s + 8) ^ tx_read64(s + 16);
            return tx_rrmxmx((in2 + (in1 << 32)) ^ flip, len);
        }
        if (len > 0) {
            const xu32 combo = ((xu32)in[0] << 16) | ((xu32)in[len >> 1] << 24) |
                               (xu32)in[len - 1] | ((xu32)len << 8);
            const xu64 flip = (xu64)(tx_read32(s) ^ tx_read32(s + 4));
            return tx_xxh64_avalanche((xu64)combo ^ flip);
        }
        return tx_xxh64_avalanche(tx_read64(s + 56) ^ tx_read64(s + 64));
    }
    if (len <= 128) {
        xu64 acc = len * TX_P64_1;
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += tx_mix16(in + 48, s + 96);
                    acc += tx_mix16(in + len - 64, s + 112);
                }
                acc += tx_mix16(in + 32, s + 64);
                acc += tx_mix16(in + len - 48, s + 80);
            }
            acc += tx_mix16(in + 16, s + 32);
            acc += tx_mix16(in + len - 32, s + 48);
        }
        acc += tx_mix16(in, s);
        acc += tx_mix16(in + len - 16, s + 16);
        return tx_avalanche(acc);
    }
    if (len <= 240) {
        xu64 acc = len * TX_P64_1;
        const int rounds = (int)(len / 16);
        int i = 0;
        for (; i < 8; i++) acc += tx_mix16(in + 16 * i, s + 16 * i);
        acc = tx_avalanche(acc);
        for (; i < rounds; i++) acc += tx_mix16(in + 16 * i, s + 16 * (i - 8) + 3);
        acc += tx_mix16(in + len - 16, s + 136 - 17);
        return tx_avalanche(acc);
    }
    xu64 acc[8] = {TX_P32_3, TX_P64_1, TX_P64_2, TX_P64_3, TX_P64_4, TX_P32_2, TX_P64_5, TX_P32_1};
    // 16 stripes of 64 bytes per block; scramble after each full block.
    const xu64 block_len = 64 * 16;
    const xu64 blocks = (len - 1) / block_len;
    for (xu64 b = 0; b < blocks; b++) {
        for (int st = 0; st < 16; st++) tx_accumulate_512(acc, in + b * block_len + 64 * st, s + 8 * st);
        tx_scramble(acc, s + 192 - 64);
    }
    const xu64 stripes = ((len - 1) - block_len * blocks) / 64;
    for (xu64 st = 0; st < stripes; st++) tx_accumulate_512(acc, in + blocks * block_len + 64 * st, s + 8 * st);
    tx_accumulate_512(acc, in + len - 64, s + 192 - 64 - 7);
    xu64 r = len * TX_P64_1;
    for (int i = 0; i < 4; i++) r += tx_fold(acc[2 * i] ^ tx_read64(s + 11 + 16 * i), acc[2 * i + 1] ^ tx_read64(s + 11 + 16 * i + 8));
    return tx_avalanche(r);
}

#ifndef TANDEM_HOST_CHECK
extern "C" __global__ void xxh3_64_slabs(const xu8* base, const xu64* offsets, xu64 slab_bytes, xu64* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = tandem_xxh3_64(base + offsets[i], slab_bytes);
}
#endif
