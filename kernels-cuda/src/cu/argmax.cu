// Greedy sampling on the device: index of the largest logit per row (tandem-kernels `argmax`,
// which the engine's sampler uses): the lowest index wins ties, NaN never wins, a row of only
// NaN (or an empty row) gives 0. Only the ids come back to the host.
//
// logits: [rows x vocab] f32; out: [rows] i32. One thread block per row (grid.x = rows),
// blockDim.x a multiple of 32. Each thread scans indices tid, tid + blockDim, ... ascending
// (so its own ties keep the lowest index), then (value, index) pairs are combined by a tree
// that prefers the larger value and, on equal values, the lower index: the result is the
// CPU's, whatever the order of the combination.

struct ArgBest {
    float v;
    int i;  // -1: nothing seen yet (only NaN so far)
};

__device__ __forceinline__ ArgBest tandem_arg_better(ArgBest a, ArgBest b) {
    if (a.i < 0) return b;
    if (b.i < 0) return a;
    if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
    return a;
}

extern "C" __global__ void argmax_f32(const float* logits, int* out, int vocab) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* row = logits + (i64)blockIdx.x * vocab;
    ArgBest best = {TANDEM_NEG_INF, -1};
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (!isnan(v) && (best.i < 0 || v > best.v)) {
            best.v = v;
            best.i = i;
        }
    }
#pragma unroll
    for (int o = TANDEM_WARP / 2; o > 0; o >>= 1) {
        ArgBest other;
        other.v = __shfl_xor_sync(0xffffffffu, best.v, o);
        other.i = __shfl_xor_sync(0xffffffffu, best.i, o);
        best = tandem_arg_better(best, other);
    }
    const int lane = threadIdx.x % TANDEM_WARP, warp = threadIdx.x / TANDEM_WARP;
    if (lane == 0) {
        sv[warp] = best.v;
        si[warp] = best.i;
    }
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x / TANDEM_WARP;
        best.v = lane < warps ? sv[lane] : TANDEM_NEG_INF;
        best.i = lane < warps ? si[lane] : -1;
#pragma unroll
        for (int o = TANDEM_WARP / 2; o > 0; o >>= 1) {
            ArgBest other;
            other.v = __shfl_xor_sync(0xffffffffu, best.v, o);
            other.i = __shfl_xor_sync(0xffffffffu, best.i, o);
            best = tandem_arg_better(best, other);
        }
        if (lane == 0) out[blockIdx.x] = best.i < 0 ? 0 : best.i;
    }
}
