// Elementwise kernels (tandem-kernels `silu_mul`, `add_inplace`), the embedding gather and the
// f32 <-> bf16 conversions. Grid-stride loops: any grid covers any length.

// gate_up: [m x 2*inter] rows laid out [gate (inter) | up (inter)]; out: [m x inter].
// out = (g / (1 + exp(-g))) * u with tandem's canonical exp: the same operations as the CPU.
extern "C" __global__ void silu_mul_f32(const float* gate_up, float* out, int m, int inter) {
    const i64 total = (i64)m * inter;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / inter, c = i % inter;
        const float g = gate_up[r * 2 * inter + c];
        const float u = gate_up[r * 2 * inter + inter + c];
        out[i] = (g / (1.0f + tandem_exp(-g))) * u;
    }
}

// a += b over n elements (one IEEE add each, as the CPU).
extern "C" __global__ void add_inplace_f32(float* a, const float* b, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        a[i] = a[i] + b[i];
    }
}

// out[t, :] = table[ids[t], :] for t < n_tokens; table: [vocab x hidden]. An id outside the
// vocabulary writes a row of zeros (ids are validated on the host; this only keeps reads in bounds).
extern "C" __global__ void embed_f32(const int* ids, const float* table, float* out, int n_tokens, int hidden,
                                     int vocab) {
    const i64 total = (i64)n_tokens * hidden;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / hidden, c = i % hidden;
        const int id = ids[t];
        out[i] = (id >= 0 && id < vocab) ? table[(i64)id * hidden + c] : 0.0f;
    }
}

// As embed_f32 with a bf16 table (widened exactly to f32).
extern "C" __global__ void embed_bf16(const int* ids, const u16* table, float* out, int n_tokens, int hidden,
                                      int vocab) {
    const i64 total = (i64)n_tokens * hidden;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / hidden, c = i % hidden;
        const int id = ids[t];
        out[i] = (id >= 0 && id < vocab) ? tandem_bf16_to_f32(table[(i64)id * hidden + c]) : 0.0f;
    }
}

// bf16 (u16 bits) <- f32, round to nearest even (the `half` crate's bf16::from_f32, bit for bit).
extern "C" __global__ void f32_to_bf16(const float* x, u16* out, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        out[i] = tandem_f32_to_bf16(x[i]);
    }
}

// f32 <- bf16 (u16 bits), exact.
extern "C" __global__ void bf16_to_f32(const u16* x, float* out, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        out[i] = tandem_bf16_to_f32(x[i]);
    }
}
