// Shared by every tandem CUDA source (prepended by ptx.rs; no #include, no host headers).
//
// Conventions:
// - Every kernel is `extern "C" __global__` (unmangled names, looked up by name in kernels.rs).
// - Compiled with --fmad=false, so `a * b + c` is two rounded operations as in the CPU kernels;
//   fused multiply-adds are written explicitly (`fmaf`) where the CPU uses them.
// - Element types of the KV pool: f32, f16 (IEEE half, round to nearest even by `cvt.rn`),
//   bf16 (round to nearest even, NaN kept quiet: the `half` crate's conversion, bit for bit).
// - Sizes and offsets into the KV pool are 64-bit (`long long`): a pool exceeds 4 GiB.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define TANDEM_WARP 32
#define TANDEM_NEG_INF (__int_as_float(0xff800000))

// ---- scalar conversions ------------------------------------------------------------------------

__device__ __forceinline__ float tandem_f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 tandem_f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float tandem_bf16_to_f32(u16 b) {
    return __uint_as_float(((u32)b) << 16);
}

// Round to nearest even; NaN keeps its high mantissa bits with the quiet bit set (as `half`).
__device__ __forceinline__ u16 tandem_f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((x >> 16) | 0x0040u);
    }
    const u32 round_bit = 0x00008000u;
    if ((x & round_bit) != 0 && (x & (3u * round_bit - 1u)) != 0) {
        return (u16)((x >> 16) + 1u);
    }
    return (u16)(x >> 16);
}

// KV element access by dtype tag (template parameter of the KV kernels).
struct KvF32 {
    typedef float T;
    static __device__ __forceinline__ float load(const float* p) { return *p; }
    static __device__ __forceinline__ void store(float* p, float v) { *p = v; }
};
struct KvF16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(const u16* p) { return tandem_f16_to_f32(*p); }
    static __device__ __forceinline__ void store(u16* p, float v) { *p = tandem_f32_to_f16(v); }
};
struct KvBf16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(const u16* p) { return tandem_bf16_to_f32(*p); }
    static __device__ __forceinline__ void store(u16* p, float v) { *p = tandem_f32_to_bf16(v); }
};

// ---- the canonical exp of tandem-kernels (kernels/src/simd/portable.rs) ------------------------
// Cephes-style polynomial, FMAs where the CPU has them: e^x within ~1 ulp on [-87, 88], 0 below.
__device__ __forceinline__ float tandem_exp(float x) {
    const float EXP_LO = -87.0f, EXP_HI = 88.0f;
    float xc = x > EXP_LO ? x : EXP_LO;
    xc = xc < EXP_HI ? xc : EXP_HI;
    float n = rintf(xc * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, xc);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691e-4f;
    p = fmaf(p, r, 1.3981999e-3f);
    p = fmaf(p, r, 8.333452e-3f);
    p = fmaf(p, r, 4.1665796e-2f);
    p = fmaf(p, r, 0.16666665f);
    p = fmaf(p, r, 0.5f);
    float y = fmaf(p, r * r, r) + 1.0f;
    float pow2 = __int_as_float(((int)n + 127) << 23);
    float e = y * pow2;
    return x < EXP_LO ? 0.0f : e;
}

// ---- reductions --------------------------------------------------------------------------------

__device__ __forceinline__ float tandem_warp_sum(float v) {
#pragma unroll
    for (int o = TANDEM_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float tandem_warp_max(float v) {
#pragma unroll
    for (int o = TANDEM_WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch`: 32 floats of shared memory. Contains __syncthreads(): call from all threads.
__device__ __forceinline__ float tandem_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % TANDEM_WARP, warp = threadIdx.x / TANDEM_WARP;
    const int warps = blockDim.x / TANDEM_WARP;
    v = tandem_warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return tandem_warp_sum(v);
}

// ---- the paged KV pool (tandem-kv-layout) ------------------------------------------------------
// pool = layer-major slabs: slab (layer, block) at byte (layer * num_blocks + block) * slab_bytes;
// a slab is [K: kv_heads x block_size x head_dim][V: same] (+ Int8 scales, not handled here);
// head h's tile of part P (0 = K, 1 = V) starts at element P * kv_heads * bs * hd + h * bs * hd,
// and token `off` of the tile at `off * head_dim` within it.
struct KvGeom {
    i64 layer_base;  // byte offset of (layer, block 0) = layer * num_blocks * slab_bytes
    i64 slab_bytes;
    i64 num_blocks;  // blocks in the pool (slots are < num_blocks * block_size)
    int kv_heads;
    int head_dim;
    int block_size;
};

// Element pointer of (block, head, token offset, part) for element type T.
template <typename T>
__device__ __forceinline__ T* tandem_kv_ptr(u8* pool, const KvGeom& g, i64 block, int head, int off, int part) {
    i64 elem = (i64)part * g.kv_heads * g.block_size * g.head_dim + (i64)head * g.block_size * g.head_dim +
               (i64)off * g.head_dim;
    return (T*)(pool + g.layer_base + block * g.slab_bytes) + elem;
}
