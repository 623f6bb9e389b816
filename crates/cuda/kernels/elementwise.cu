// Small per-token kernels of the decode step. Activations are f32; weights and tables BF16.

// out[t, :] = table[tokens[t], :] as f32. Out-of-range token ids give a NaN row (the host checks ids
// it uploads; NaN makes a bad id coming from the device visible downstream).
extern "C" __global__ void embedding_gather(const bf16_t* __restrict__ table,
                                            const int* __restrict__ tokens,
                                            float* __restrict__ out, int dim, int vocab) {
    pdl_wait();
    pdl_trigger();
    const int t = blockIdx.y;
    const int tok = tokens[t];
    const bool valid = tok >= 0 && tok < vocab;
    float* o = out + (size_t)t * dim;
    const bf16_t* row = table + (size_t)(valid ? tok : 0) * dim;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < dim; i += gridDim.x * blockDim.x)
        o[i] = valid ? bf16_to_f32(row[i]) : F32_NAN;
}

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight. One block per row.
extern "C" __global__ void rmsnorm(const float* __restrict__ x, const bf16_t* __restrict__ weight,
                                   float* __restrict__ out, int dim, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* orow = out + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) orow[i] = xr[i] * inv * bf16_to_f32(weight[i]);
}

// gate_up is [n_tokens, 2 * inter] (gate rows first, then up rows, as one fused GEMV writes them);
// out[t, i] = silu(gate) * up.
extern "C" __global__ void swiglu(const float* __restrict__ gate_up, float* __restrict__ out,
                                  int inter, int n_tokens) {
    const size_t n = (size_t)inter * n_tokens;
    for (size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        const size_t t = j / inter, i = j - t * inter;
        const float g = gate_up[t * 2 * inter + i];
        const float u = gate_up[t * 2 * inter + inter + i];
        out[j] = g / (1.0f + expf(-g)) * u;
    }
}

// gate_up holds (gate, up) pairs interleaved (as the engine stacks gate/up rows);
// out[i] = silu(gate_up[2i]) * gate_up[2i + 1] (the coded gate/up matvec's epilogue).
extern "C" __global__ void swiglu_pairs(const float2* __restrict__ gate_up, float* __restrict__ out,
                                        int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float2 p = gate_up[i];
        out[i] = p.x / (1.0f + expf(-p.x)) * p.y;
    }
}

// gate_up is [n_tokens, 2 * inter] (gate rows first, then up rows: a GEMM over [gate; up] stored as
// halves); out[t, i] = bf16(silu(gate) * up), the prefill activations of the down GEMM.
extern "C" __global__ void swiglu_halves_bf16(const float* __restrict__ gate_up,
                                              bf16_t* __restrict__ out, int inter, int n_tokens) {
    const size_t n = (size_t)inter * n_tokens;
    for (size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        const size_t t = j / inter, i = j - t * inter;
        const float g = gate_up[t * 2 * inter + i];
        const float u = gate_up[t * 2 * inter + inter + i];
        out[j] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
    }
}

// x += y (the residual stream update).
extern "C" __global__ void residual_add(float* __restrict__ x, const float* __restrict__ y, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] += y[i];
}

// counters[0..n] += 1: advances decode positions / lengths kept on the device, so one captured
// CUDA graph replays for successive tokens.
extern "C" __global__ void advance_counters(int* __restrict__ counters, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) counters[i] += 1;
}
