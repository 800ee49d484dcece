// Causal paged attention with grouped-query heads over the block table (tandem-kernels
// `paged_attention`), reading K and V straight from the pool.
//
// KV layout (tandem-kv-layout; see KvGeom in common.cuh): the K of token `pos` of a sequence,
// KV head `kvh`, is row `pos % bs` of tile (K, kvh) of slab (layer, table[pos / bs]); V likewise
// in the V tile. A tile is a dense [bs x hd] matrix, so a head's tokens within a block are
// contiguous. f32 / f16 / bf16 elements, widened to f32 on load. GQA: kvh = h / (n_heads / kv_heads).
//
// Math per (query at position p, head h): s_t = dot(q, k_t) * scale for t = 0..=p;
// out = sum_t exp(s_t - max) v_t / sum_t exp(s_t - max), with tandem's canonical exp. The
// maximum and sums are taken online (running max, rescaled accumulators), so the summation
// order differs from the CPU's: results agree within float rounding, not bit for bit.
//
// Block tables: [num_seqs x max_blocks] u32, row i = sequence i's physical block ids in
// position order (entries past its context are never read).
//
// head_dim <= TANDEM_MAX_HD (256); the launcher checks.

#define TANDEM_MAX_HD 256
#define TANDEM_HD_PER_LANE (TANDEM_MAX_HD / TANDEM_WARP)
#define TANDEM_ATTN_THREADS 128
#define TANDEM_ATTN_WARPS (TANDEM_ATTN_THREADS / TANDEM_WARP)

// ================================ decode: flash-decoding ========================================
// One query token per sequence: q [num_seqs x n_heads x hd], row i = sequence i; ctx_lens[i] =
// tokens it attends to (its position + 1). The context is cut into splits of `blocks_per_split`
// KV blocks; grid = (n_heads, num_seqs, num_splits), TANDEM_ATTN_THREADS threads. Each warp
// takes every 4th token of the split (one dot per token: lanes over dims + shuffle sum) and keeps
// its own running max m, sum l and accumulator; the 4 warps are merged in shared memory and the
// split writes part_acc[(seq, h, split), :] (unnormalised, relative to its max) and
// part_ml[(seq, h, split)] = (max, sum). A split past the context writes (-inf, 0).
// paged_attn_decode_reduce then merges the splits of each (seq, head) and normalises.

template <typename Kv>
__device__ __forceinline__ void decode_impl(const float* q, float* part_acc, float* part_ml, const u8* pool,
                                            KvGeom g, const u32* block_tables, int max_blocks,
                                            const int* ctx_lens, int n_heads, float scale,
                                            int blocks_per_split) {
    typedef typename Kv::T T;
    __shared__ float qs[TANDEM_MAX_HD];
    __shared__ float wm[TANDEM_ATTN_WARPS], wl[TANDEM_ATTN_WARPS];
    __shared__ float wacc[TANDEM_ATTN_WARPS][TANDEM_MAX_HD];
    const int h = blockIdx.x, seq = blockIdx.y, split = blockIdx.z, num_splits = gridDim.z;
    const int hd = g.head_dim, bs = g.block_size;
    const int kvh = h / (n_heads / g.kv_heads);
    const int lane = threadIdx.x % TANDEM_WARP, warp = threadIdx.x / TANDEM_WARP;
    const int ctx = ctx_lens[seq];
    const int t0 = split * blocks_per_split * bs;
    const int t1 = min(ctx, t0 + blocks_per_split * bs);
    const i64 part = ((i64)seq * n_heads + h) * num_splits + split;

    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = q[((i64)seq * n_heads + h) * hd + d];
    __syncthreads();

    float m = TANDEM_NEG_INF, l = 0.0f;
    float acc[TANDEM_HD_PER_LANE];
#pragma unroll
    for (int j = 0; j < TANDEM_HD_PER_LANE; j++) acc[j] = 0.0f;

    const u32* table = block_tables + (i64)seq * max_blocks;
    for (int t = t0 + warp; t < t1; t += TANDEM_ATTN_WARPS) {
        const i64 blk = table[t / bs];
        const int off = t % bs;
        const T* kp = tandem_kv_ptr<T>((u8*)pool, g, blk, kvh, off, 0);
        const T* vp = tandem_kv_ptr<T>((u8*)pool, g, blk, kvh, off, 1);
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < TANDEM_HD_PER_LANE; j++) {
            const int d = lane + j * TANDEM_WARP;
            if (d < hd) dot = fmaf(qs[d], Kv::load(kp + d), dot);
        }
        const float s = tandem_warp_sum(dot) * scale;
        const float m_new = fmaxf(m, s);
        const float alpha = m == TANDEM_NEG_INF ? 0.0f : tandem_exp(m - m_new);
        const float p = tandem_exp(s - m_new);
        l = l * alpha + p;
#pragma unroll
        for (int j = 0; j < TANDEM_HD_PER_LANE; j++) {
            const int d = lane + j * TANDEM_WARP;
            if (d < hd) acc[j] = fmaf(p, Kv::load(vp + d), acc[j] * alpha);
        }
        m = m_new;
    }
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < TANDEM_HD_PER_LANE; j++) {
        const int d = lane + j * TANDEM_WARP;
        if (d < hd) wacc[warp][d] = acc[j];
    }
    __syncthreads();
    float mm = TANDEM_NEG_INF;
#pragma unroll
    for (int w = 0; w < TANDEM_ATTN_WARPS; w++) mm = fmaxf(mm, wm[w]);
    float f[TANDEM_ATTN_WARPS];
    float ll = 0.0f;
#pragma unroll
    for (int w = 0; w < TANDEM_ATTN_WARPS; w++) {
        f[w] = wm[w] == TANDEM_NEG_INF ? 0.0f : tandem_exp(wm[w] - mm);
        ll = fmaf(wl[w], f[w], ll);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < TANDEM_ATTN_WARPS; w++) a = fmaf(wacc[w][d], f[w], a);
        part_acc[part * hd + d] = a;
    }
    if (threadIdx.x == 0) {
        part_ml[2 * part] = mm;
        part_ml[2 * part + 1] = ll;
    }
}

// Merges the splits: grid = (n_heads, num_seqs), any blockDim.x (threads over dims).
// out [num_seqs x n_heads x hd] = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M).
extern "C" __global__ void paged_attn_decode_reduce(const float* part_acc, const float* part_ml, float* out,
                                                    int n_heads, int hd, int num_splits) {
    const int h = blockIdx.x, seq = blockIdx.y;
    const i64 base = ((i64)seq * n_heads + h) * num_splits;
    float mm = TANDEM_NEG_INF;
    for (int s = 0; s < num_splits; s++) mm = fmaxf(mm, part_ml[2 * (base + s)]);
    float ll = 0.0f;
    for (int s = 0; s < num_splits; s++) {
        const float ms = part_ml[2 * (base + s)];
        if (ms != TANDEM_NEG_INF) ll = fmaf(part_ml[2 * (base + s) + 1], tandem_exp(ms - mm), ll);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < num_splits; s++) {
            const float ms = part_ml[2 * (base + s)];
            if (ms != TANDEM_NEG_INF) a = fmaf(part_acc[(base + s) * hd + d], tandem_exp(ms - mm), a);
        }
        out[((i64)seq * n_heads + h) * hd + d] = ll > 0.0f ? a / ll : 0.0f;
    }
}

// ============================= prefill: flash-attention tiles ===================================
// Query chunks: sequence i has q_lens[i] queries in rows q_rows[i] .. of q / out
// ([rows x n_heads x hd]), at positions first_pos[i] + j, attending causally to positions
// 0..=first_pos[i] + j (earlier chunks' KV must already be in the pool; this chunk's too).
// grid = (ceil(max_q_len / PF_QT), n_heads, num_seqs), TANDEM_ATTN_THREADS threads, dynamic
// shared memory prefill_smem_bytes(hd) (launch.rs): Q tile [PF_QT x hd], K tile [PF_TK x (hd+1)]
// (padded: lane j reads row j without bank conflicts), V tile [PF_TK x hd], all f32.
// Each warp owns PF_QT / 4 queries; per KV tile of PF_TK = 32 tokens, lane j scores token j,
// the warp updates the query's running max and sum, and every lane accumulates its dims
// lane + 32k over the tile's tokens (weights broadcast by shuffle).

#define PF_QT 16
#define PF_TK 32
#define PF_QPW (PF_QT / TANDEM_ATTN_WARPS)

template <typename Kv>
__device__ __forceinline__ void prefill_impl(const float* q, float* out, const u8* pool, KvGeom g,
                                             const u32* block_tables, int max_blocks, const int* q_rows,
                                             const int* q_lens, const int* first_pos, int n_heads, float scale) {
    typedef typename Kv::T T;
    extern __shared__ float smem[];
    const int hd = g.head_dim, bs = g.block_size;
    float* qs = smem;                     // [PF_QT][hd]
    float* ks = qs + PF_QT * hd;          // [PF_TK][hd + 1]
    float* vs = ks + PF_TK * (hd + 1);    // [PF_TK][hd]
    const int h = blockIdx.y, seq = blockIdx.z;
    const int qlen = q_lens[seq];
    const int j0 = blockIdx.x * PF_QT;
    if (j0 >= qlen) return;  // whole block exits together: no barrier is skipped by some threads only
    const int nq = min(PF_QT, qlen - j0);
    const int row0 = q_rows[seq] + j0;
    const int pos0 = first_pos[seq] + j0;
    const int last_pos = pos0 + nq - 1;
    const int kvh = h / (n_heads / g.kv_heads);
    const int lane = threadIdx.x % TANDEM_WARP, warp = threadIdx.x / TANDEM_WARP;
    const u32* table = block_tables + (i64)seq * max_blocks;

    for (int i = threadIdx.x; i < PF_QT * hd; i += blockDim.x) {
        const int qi = i / hd, d = i % hd;
        qs[i] = qi < nq ? q[((i64)(row0 + qi) * n_heads + h) * hd + d] : 0.0f;
    }

    float m[PF_QPW], l[PF_QPW], acc[PF_QPW][TANDEM_HD_PER_LANE];
#pragma unroll
    for (int a = 0; a < PF_QPW; a++) {
        m[a] = TANDEM_NEG_INF;
        l[a] = 0.0f;
#pragma unroll
        for (int j = 0; j < TANDEM_HD_PER_LANE; j++) acc[a][j] = 0.0f;
    }

    for (int t0 = 0; t0 <= last_pos; t0 += PF_TK) {
        __syncthreads();  // the previous tile is no longer read (and qs is written, first time)
        for (int i = threadIdx.x; i < PF_TK * hd; i += blockDim.x) {
            const int j = i / hd, d = i % hd;
            const int pos = t0 + j;
            float kv = 0.0f, vv = 0.0f;
            if (pos <= last_pos) {
                const i64 blk = table[pos / bs];
                kv = Kv::load(tandem_kv_ptr<T>((u8*)pool, g, blk, kvh, pos % bs, 0) + d);
                vv = Kv::load(tandem_kv_ptr<T>((u8*)pool, g, blk, kvh, pos % bs, 1) + d);
            }
            ks[j * (hd + 1) + d] = kv;
            vs[j * hd + d] = vv;
        }
        __syncthreads();
#pragma unroll
        for (int a = 0; a < PF_QPW; a++) {
            const int qi = warp * PF_QPW + a;
            const int qpos = pos0 + qi;
            if (qi >= nq || t0 > qpos) continue;  // warp-uniform
            const float* qr = qs + qi * hd;
            const float* kr = ks + lane * (hd + 1);
            float dot = 0.0f;
            for (int d = 0; d < hd; d++) dot = fmaf(qr[d], kr[d], dot);
            const float s = (t0 + lane <= qpos) ? dot * scale : TANDEM_NEG_INF;
            const float m_new = fmaxf(m[a], tandem_warp_max(s));
            const float alpha = m[a] == TANDEM_NEG_INF ? 0.0f : tandem_exp(m[a] - m_new);
            const float p = s == TANDEM_NEG_INF ? 0.0f : tandem_exp(s - m_new);
            l[a] = l[a] * alpha + tandem_warp_sum(p);
#pragma unroll
            for (int j = 0; j < TANDEM_HD_PER_LANE; j++) acc[a][j] *= alpha;
            for (int tk = 0; tk < PF_TK; tk++) {
                const float pk = __shfl_sync(0xffffffffu, p, tk);
#pragma unroll
                for (int j = 0; j < TANDEM_HD_PER_LANE; j++) {
                    const int d = lane + j * TANDEM_WARP;
                    if (d < hd) acc[a][j] = fmaf(pk, vs[tk * hd + d], acc[a][j]);
                }
            }
            m[a] = m_new;
        }
    }
#pragma unroll
    for (int a = 0; a < PF_QPW; a++) {
        const int qi = warp * PF_QPW + a;
        if (qi >= nq) continue;
        float* orow = out + ((i64)(row0 + qi) * n_heads + h) * hd;
#pragma unroll
        for (int j = 0; j < TANDEM_HD_PER_LANE; j++) {
            const int d = lane + j * TANDEM_WARP;
            if (d < hd) orow[d] = acc[a][j] / l[a];
        }
    }
}

#define TANDEM_ATTN(SUFFIX, KV)                                                                             \
    extern "C" __global__ void __launch_bounds__(TANDEM_ATTN_THREADS)                                       \
        paged_attn_decode_##SUFFIX(const float* q, float* part_acc, float* part_ml, const u8* pool, KvGeom g, \
                                   const u32* block_tables, int max_blocks, const int* ctx_lens, int n_heads,  \
                                   float scale, int blocks_per_split) {                                      \
        decode_impl<KV>(q, part_acc, part_ml, pool, g, block_tables, max_blocks, ctx_lens, n_heads, scale,  \
                        blocks_per_split);                                                                   \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(TANDEM_ATTN_THREADS)                                       \
        paged_attn_prefill_##SUFFIX(const float* q, float* out, const u8* pool, KvGeom g,                    \
                                    const u32* block_tables, int max_blocks, const int* q_rows,              \
                                    const int* q_lens, const int* first_pos, int n_heads, float scale) {     \
        prefill_impl<KV>(q, out, pool, g, block_tables, max_blocks, q_rows, q_lens, first_pos, n_heads,     \
                         scale);                                                                             \
    }

TANDEM_ATTN(f32, KvF32)
TANDEM_ATTN(f16, KvF16)
TANDEM_ATTN(bf16, KvBf16)
