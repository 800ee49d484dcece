// RoPE fused with the paged-KV write (tandem-kernels `rope` on q and k, then `write_kv`).
//
// Shapes: q [T x n_heads x hd] f32, rotated in place; k, v [T x kv_heads x hd] f32 (read only:
// the rotated k goes to the cache, not back to `k`). positions [T] i32, slots [T] i64 with
// slot = block_id * block_size + offset_in_block (the CPU's `slots`). cos_t, sin_t: the CPU's
// RopeTable flattened, [max_positions x hd/2] f32 (row `pos` = RopeTable::row(pos)).
//
// RoPE is rotate-half (NeoX / Hugging Face): pairs (i, i + hd/2),
//   a' = a*cos_i - b*sin_i,  b' = b*cos_i + a*sin_i,  each product rounded (--fmad=false):
// the CPU's operations exactly, so q and the stored f32 K match it bit for bit.
//
// KV layout (tandem-kv-layout, block-major slabs within each layer, see common.cuh KvGeom):
// token t's K of kv head h goes to slab (layer, slot / bs), tile (K, h), row slot % bs; V to the
// V tile. f16/bf16 round to nearest even (the CPU's `half` conversions). Int8 is not handled
// (its per-channel key scales are requantized across calls; the launcher refuses it).
//
// Launch: grid.x = T (one block per token), any blockDim.x. A token whose position is outside
// the table or whose slot is outside the pool is skipped (the host validates both; this only
// keeps every access in bounds).

template <typename Kv>
__device__ __forceinline__ void rope_write_kv_impl(float* q, const float* k, const float* v, const float* cos_t,
                                                   const float* sin_t, const int* positions, const i64* slots,
                                                   u8* pool, KvGeom g, int n_heads, int max_positions) {
    typedef typename Kv::T T;
    const int t = blockIdx.x;
    const int hd = g.head_dim, half = hd / 2;
    const int pos = positions[t];
    const i64 slot = slots[t];
    if (pos < 0 || pos >= max_positions || slot < 0 || slot >= g.num_blocks * g.block_size) return;
    const i64 block = slot / g.block_size;
    const int off = (int)(slot % g.block_size);
    const float* c = cos_t + (i64)pos * half;
    const float* s = sin_t + (i64)pos * half;
    const int pairs = (n_heads + g.kv_heads) * half;
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        const int head = i / half, p = i % half;
        if (head < n_heads) {
            float* x = q + ((i64)t * n_heads + head) * hd;
            const float a = x[p], b = x[p + half];
            x[p] = a * c[p] - b * s[p];
            x[p + half] = b * c[p] + a * s[p];
        } else {
            const int kh = head - n_heads;
            const float* x = k + ((i64)t * g.kv_heads + kh) * hd;
            const float a = x[p], b = x[p + half];
            T* dst = tandem_kv_ptr<T>(pool, g, block, kh, off, 0);
            Kv::store(dst + p, a * c[p] - b * s[p]);
            Kv::store(dst + p + half, b * c[p] + a * s[p]);
        }
    }
    for (int i = threadIdx.x; i < g.kv_heads * hd; i += blockDim.x) {
        const int kh = i / hd, d = i % hd;
        T* dst = tandem_kv_ptr<T>(pool, g, block, kh, off, 1);
        Kv::store(dst + d, v[((i64)t * g.kv_heads + kh) * hd + d]);
    }
}

#define TANDEM_ROPE_KV(SUFFIX, KV)                                                                          \
    extern "C" __global__ void rope_write_kv_##SUFFIX(float* q, const float* k, const float* v,              \
                                                      const float* cos_t, const float* sin_t,                \
                                                      const int* positions, const i64* slots, u8* pool,      \
                                                      KvGeom g, int n_heads, int max_positions) {            \
        rope_write_kv_impl<KV>(q, k, v, cos_t, sin_t, positions, slots, pool, g, n_heads, max_positions);   \
    }

TANDEM_ROPE_KV(f32, KvF32)
TANDEM_ROPE_KV(f16, KvF16)
TANDEM_ROPE_KV(bf16, KvBf16)
