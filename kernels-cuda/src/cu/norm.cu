// RMSNorm over rows (tandem-kernels `rms_norm`).
//
// x, out: [rows x n] f32, row-major; w: [n] f32. One thread block per row (grid.x = rows),
// blockDim.x a multiple of 32 (<= 1024; launch.rs picks it). Per row:
//   ss = sum(x_i * x_i) (fmaf per thread, then a warp/block tree: a different summation order
//   than the CPU's 16 lanes, so results agree to a few ulp, not bit for bit);
//   inv = 1 / sqrt(ss / n + eps);  out_i = (x_i * inv) * w_i   (two roundings, as the CPU).
// `out` may alias `x` (each element is read before it is written by the same thread).

extern "C" __global__ void rms_norm_f32(const float* x, const float* w, float* out, int n, float eps) {
    __shared__ float scratch[32];
    const i64 row = blockIdx.x;
    const float* xr = x + row * n;
    float* orow = out + row * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = tandem_block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) orow[i] = (xr[i] * inv) * w[i];
}
