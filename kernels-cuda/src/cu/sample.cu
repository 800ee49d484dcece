// Sampling on the device: temperature, top-k, top-p and the request's draw, giving exactly the
// token tandem-kernels `sample::sample` gives on the CPU (its module docs are the definition),
// without sorting the row. Only the ids come back to the host.
//
// logits: [rows x vocab] f32; specs: [rows] SampleRow; out: [rows] i32. One thread block per
// row (grid.x = rows), any blockDim.x up to TANDEM_SAMPLE_MAX_THREADS; every branch below is
// the same for the whole block (it depends on the row's spec and on block-wide results).
//
// How: candidates are ordered by key64 = (order_key(logit) << 32) | ~index (larger = earlier).
// "The first candidate at which the running mass exceeds x" is found by radix selection over
// the 32-bit order key, 8 bits a pass: a histogram of mass per digit among the candidates that
// share the digits chosen so far. Mass is a count (top-k) or the integer weight (top-p, the
// draw). Equal logits have equal weight, so the last step is "the n-th candidate with this
// logit, in index order", a block-wide count. All sums are integers (u64, no order effects);
// the weight is the CPU's sequence of f64 operations (--fmad=false, fma written out).
//
// Greedy rows (temperature not above 0, top_k 1) and rows without a finite logit take the argmax: the
// largest non-NaN value (+0.0 and -0.0 equal), lowest index on ties, 0 when all are NaN.

#define TANDEM_SAMPLE_MAX_THREADS 1024

// Rust `tandem_kernels_cuda::SampleRow` (24 bytes, repr(C)).
struct SampleRow {
    float temperature;
    float top_p;
    u32 top_k;
    u32 pad;
    unsigned long long draw;
};

struct SampleShared {
    unsigned long long hist[256];
    u32 counts[TANDEM_SAMPLE_MAX_THREADS];
    unsigned long long u[3];
    u32 w[4];
};

struct SampleCtx {
    const float* row;
    int vocab;
    float maxv;
    double inv_t;
    int shift;
    unsigned long long lo;  // candidates: finite, key64 >= lo
};

__device__ __forceinline__ bool tandem_is_nan(float v) {
    return (__float_as_uint(v) & 0x7fffffffu) > 0x7f800000u;
}

__device__ __forceinline__ bool tandem_is_finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// f32 total order as an unsigned key (larger key = larger value; -0.0 below +0.0).
__device__ __forceinline__ u32 tandem_order_key(float v) {
    const u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float tandem_key_value(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ unsigned long long tandem_key64(u32 key, int i) {
    return ((unsigned long long)key << 32) | (unsigned long long)(~(u32)i);
}

// tandem-kernels `sample::weight`, operation for operation.
__device__ __forceinline__ unsigned long long tandem_sample_weight(double d, int shift) {
    if (!(d >= -(double)(shift + 2) * 0.6931471805599453)) return 0ull;
    const double k = round(d * 1.4426950408889634);
    double r = fma(-k, 6.9314718036912381649e-1, d);
    r = fma(-k, 1.90821492927058770002e-10, r);
    double p = 1.6059043836821613e-10;
    p = fma(p, r, 2.08767569878681e-09);
    p = fma(p, r, 2.505210838544172e-08);
    p = fma(p, r, 2.755731922398589e-07);
    p = fma(p, r, 2.7557319223985893e-06);
    p = fma(p, r, 2.48015873015873e-05);
    p = fma(p, r, 0.0001984126984126984);
    p = fma(p, r, 0.001388888888888889);
    p = fma(p, r, 0.008333333333333333);
    p = fma(p, r, 0.041666666666666664);
    p = fma(p, r, 0.16666666666666666);
    p = fma(p, r, 0.5);
    p = fma(p, r, 1.0);
    p = fma(p, r, 1.0);
    const double scale = __longlong_as_double((long long)(1023 + (long long)k) << 52);
    const double e = p * scale;
    return (unsigned long long)(e * (double)(1ull << shift) + 0.5);
}

__device__ __forceinline__ unsigned long long tandem_mass(const SampleCtx& c, float v, bool by_weight) {
    if (!by_weight) return 1ull;
    return tandem_sample_weight(((double)v - (double)c.maxv) * c.inv_t, c.shift);
}

// A candidate whose order key is `key` (one of a tie group).
__device__ __forceinline__ bool tandem_in_group(const SampleCtx& c, float v, int i, u32 key) {
    return tandem_is_finite(v) && tandem_order_key(v) == key && tandem_key64(key, i) >= c.lo;
}

// The candidate at which the running mass (in order) first exceeds x (x below the candidates'
// total mass): its key64; *before = the mass of the candidates ahead of it, *own = its mass.
__device__ unsigned long long tandem_select(
    const SampleCtx& c, bool by_weight, unsigned long long x, SampleShared& sh,
    unsigned long long* before, unsigned long long* own) {
    u32 prefix = 0;
    unsigned long long rem = x, ahead = 0;
    for (int b = 24; b >= 0; b -= 8) {
        for (int j = threadIdx.x; j < 256; j += blockDim.x) sh.hist[j] = 0ull;
        __syncthreads();
        const u32 fixed = b == 24 ? 0u : (0xffffffffu << (b + 8));
        for (int i = threadIdx.x; i < c.vocab; i += blockDim.x) {
            const float v = c.row[i];
            if (!tandem_is_finite(v)) continue;
            const u32 k = tandem_order_key(v);
            if ((k & fixed) != (prefix & fixed) || tandem_key64(k, i) < c.lo) continue;
            const unsigned long long m = tandem_mass(c, v, by_weight);
            if (m != 0ull) atomicAdd(&sh.hist[(k >> b) & 255u], m);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long acc = 0ull;
            int d = 255;
            for (; d > 0; --d) {
                if (acc + sh.hist[d] > rem) break;
                acc += sh.hist[d];
            }
            sh.u[0] = rem - acc;
            sh.u[1] = ahead + acc;
            sh.w[0] = prefix | ((u32)d << b);
        }
        __syncthreads();
        rem = sh.u[0];
        ahead = sh.u[1];
        prefix = sh.w[0];
    }
    // Every candidate with this key has the same mass: skip n of them, in index order.
    const unsigned long long m = tandem_mass(c, tandem_key_value(prefix), by_weight);
    const unsigned long long n = rem / m;
    const int seg = (c.vocab + (int)blockDim.x - 1) / (int)blockDim.x;
    const int i0 = (int)threadIdx.x * seg;
    const int i1 = i0 + seg < c.vocab ? i0 + seg : c.vocab;
    u32 mine = 0;
    for (int i = i0; i < i1; ++i) {
        if (tandem_in_group(c, c.row[i], i, prefix)) ++mine;
    }
    sh.counts[threadIdx.x] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 acc = 0;
        for (u32 t = 0; t < blockDim.x; ++t) {
            const u32 k = sh.counts[t];
            sh.counts[t] = acc;
            acc += k;
        }
    }
    __syncthreads();
    const unsigned long long start = sh.counts[threadIdx.x];
    if (n >= start && n < start + mine) {
        unsigned long long seen = start;
        for (int i = i0; i < i1; ++i) {
            if (tandem_in_group(c, c.row[i], i, prefix)) {
                if (seen == n) {
                    sh.w[1] = (u32)i;
                    break;
                }
                ++seen;
            }
        }
    }
    __syncthreads();
    const int found = (int)sh.w[1];
    __syncthreads();
    *before = ahead + n * m;
    *own = m;
    return tandem_key64(prefix, found);
}

// ceil(W * ceil(top_p * 2^32) / 2^32), W < 2^62.
__device__ __forceinline__ unsigned long long tandem_top_p_target(unsigned long long w, float top_p) {
    const unsigned long long p = (unsigned long long)ceil((double)top_p * 4294967296.0);
    const unsigned long long lo = w * p, hi = __umul64hi(w, p);
    return ((hi << 32) | (lo >> 32)) + ((lo & 0xffffffffull) != 0ull ? 1ull : 0ull);
}

// floor(draw * W / 2^53) with the draw's low 53 bits.
__device__ __forceinline__ unsigned long long tandem_draw_target(unsigned long long draw, unsigned long long w) {
    const unsigned long long d = draw & ((1ull << 53) - 1ull);
    const unsigned long long lo = d * w, hi = __umul64hi(d, w);
    return (hi << 11) | (lo >> 53);
}

extern "C" __global__ void sample_rows(
    const float* logits, const SampleRow* specs, int vocab, int shift, int* out) {
    __shared__ SampleShared sh;
    const float* row = logits + (i64)blockIdx.x * vocab;
    const SampleRow p = specs[blockIdx.x];
    if (threadIdx.x == 0) {
        sh.w[0] = 0;
        sh.w[1] = 0;
        sh.w[2] = 0;
        sh.w[3] = 0xffffffffu;
        sh.u[2] = 0ull;
    }
    __syncthreads();
    // The largest finite key, the largest non-NaN key (zeros as +0.0), the finite count.
    u32 kmax = 0, kany = 0, nfin = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (tandem_is_nan(v)) continue;
        const u32 k = tandem_order_key(v);
        const u32 kz = tandem_order_key(v == 0.0f ? 0.0f : v);
        if (kz > kany) kany = kz;
        if (tandem_is_finite(v)) {
            if (k > kmax) kmax = k;
            ++nfin;
        }
    }
    atomicMax(&sh.w[0], kmax);
    atomicMax(&sh.w[1], kany);
    atomicAdd(&sh.w[2], nfin);
    __syncthreads();
    kmax = sh.w[0];
    kany = sh.w[1];
    nfin = sh.w[2];
    if (!(p.temperature > 0.0f) || p.top_k == 1u || nfin == 0u) {
        // Non-NaN keys are nonzero: kany == 0 means every value is NaN.
        for (int i = threadIdx.x; i < vocab && kany != 0u; i += blockDim.x) {
            const float v = row[i];
            if (!tandem_is_nan(v) && tandem_order_key(v == 0.0f ? 0.0f : v) == kany) {
                atomicMin(&sh.w[3], (u32)i);
                break;
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) out[blockIdx.x] = kany == 0u ? 0 : (int)sh.w[3];
        return;
    }
    SampleCtx c;
    c.row = row;
    c.vocab = vocab;
    c.maxv = tandem_key_value(kmax);
    c.inv_t = 1.0 / (double)p.temperature;
    c.shift = shift;
    c.lo = 0ull;
    unsigned long long before, own;
    if (p.top_k > 0u && p.top_k < nfin) {
        c.lo = tandem_select(c, false, (unsigned long long)(p.top_k - 1u), sh, &before, &own);
    }
    unsigned long long total = 0ull;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (tandem_is_finite(v) && tandem_key64(tandem_order_key(v), i) >= c.lo) total += tandem_mass(c, v, true);
    }
    atomicAdd(&sh.u[2], total);
    __syncthreads();
    unsigned long long kept = sh.u[2];
    if (p.top_p < 1.0f) {
        // A target of 0 (top_p not above 0, which validation refuses) keeps the first, as on the CPU.
        const unsigned long long need = tandem_top_p_target(kept, p.top_p);
        c.lo = tandem_select(c, true, need == 0ull ? 0ull : need - 1ull, sh, &before, &own);
        kept = before + own;
    }
    const unsigned long long pick = tandem_select(c, true, tandem_draw_target(p.draw, kept), sh, &before, &own);
    if (threadIdx.x == 0) out[blockIdx.x] = (int)(~(u32)(pick & 0xffffffffull));
}
