// Kernels of the GPU forward pass that the per-op files do not have: RMSNorm with f32 weights (the CPU
// engine's norm weights, unrounded) writing f32 or BF16, SwiGLU writing BF16 (the GEMM input of
// prefill), RoPE fused with the KV-cache append, the end-of-step counter update of captured decode
// graphs, and the synthetic-weight generator of `model::synth` run on the device.

typedef unsigned long long u64;

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight (weight f32). One block per row.
template <bool BF16_OUT>
__device__ __forceinline__ void rmsnorm_row(const float* __restrict__ x, const float* __restrict__ weight,
                                            void* __restrict__ out, int dim, float eps) {
    pdl_wait();
    pdl_trigger();
    __shared__ float scratch[32];
    const float* xr = x + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = __ldcg(xr + i);  // written by the previous kernel: L2, not L1 (PDL)
        ss = fmaf(v, v, ss);
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = __ldcg(xr + i) * inv * weight[i];
        if (BF16_OUT) ((bf16_t*)out)[(size_t)blockIdx.x * dim + i] = f32_to_bf16(v);
        else ((float*)out)[(size_t)blockIdx.x * dim + i] = v;
    }
}

extern "C" __global__ void rmsnorm_f32w(const float* __restrict__ x, const float* __restrict__ weight,
                                        float* __restrict__ out, int dim, float eps) {
    rmsnorm_row<false>(x, weight, out, dim, eps);
}

extern "C" __global__ void rmsnorm_f32w_bf16out(const float* __restrict__ x, const float* __restrict__ weight,
                                                bf16_t* __restrict__ out, int dim, float eps) {
    rmsnorm_row<true>(x, weight, out, dim, eps);
}

// gate_up [n_tokens, inter] of (gate, up) pairs (the engine stacks the two projections row-interleaved,
// so one GEMV warp or GEMM tile holds both); out[t, i] = bf16(silu(gate) * up).
extern "C" __global__ void swiglu_bf16out(const float2* __restrict__ gate_up, bf16_t* __restrict__ out,
                                          int inter, int n_tokens) {
    const size_t n = (size_t)inter * n_tokens;
    for (size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        const float2 gu = gate_up[j];
        out[j] = f32_to_bf16(gu.x / (1.0f + expf(-gu.x)) * gu.y);
    }
}

// qkv [n_tokens, q_dim + 2 kv_dim] f32 (q | k | v, as one fused projection writes it), plus bias
// [q_dim + 2 kv_dim] when has_bias. Token t is at position pos[0] + t: its q is rotated into q_out
// ([n_tokens, q_dim], f32 or BF16), its k rotated and its v copied into row pos[0] + t of the BF16
// caches ([max_seq, kv_dim]); rows at or past max_seq are not written. cos_sin [max_seq, head_dim/2]
// of (cos, sin) f32 pairs of each position's angles (computed in f64 on the host). grid (n_tokens,
// splits): the y blocks share a token's work (decode has one token).
template <bool BF16_Q>
__device__ __forceinline__ void rope_append_impl(const float* __restrict__ qkv, const float* __restrict__ bias,
                                                 int has_bias, void* __restrict__ q_out,
                                                 bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache,
                                                 const int* __restrict__ pos_ptr,
                                                 const float* __restrict__ cos_sin, int n_q_heads,
                                                 int n_kv_heads, int head_dim, int interleaved, int max_seq) {
    // The position only finish_step (the previous decode step's end) changes, and the table is
    // immutable: the first item's angle is read before pdl_wait.
    const int t = blockIdx.x;
    const int pos = pos_ptr[0] + t;
    const int tab = min(max(pos, 0), max_seq - 1);  // the host keeps pos < max_seq
    const int half = head_dim / 2;
    const int q_dim = n_q_heads * head_dim, kv_dim = n_kv_heads * head_dim;
    const int width = q_dim + 2 * kv_dim;
    const float* row = qkv + (size_t)t * width;
    const bool store_kv = pos >= 0 && pos < max_seq;
    const int rot_pairs = (n_q_heads + n_kv_heads) * half;
    const int items = rot_pairs + kv_dim;
    const int j0 = blockIdx.y * blockDim.x + threadIdx.x;
    const float2* cs_row = (const float2*)cos_sin + (size_t)tab * half;
    const float2 cs0 = j0 < rot_pairs ? cs_row[j0 % half] : make_float2(0.0f, 0.0f);
    // Triggered before the wait: the attention that follows loads its cached K/V rows before its
    // own wait, which this short kernel's work alone would not cover (trace: bench/RESULTS.md).
    pdl_trigger();
    pdl_wait();
    for (int j = j0; j < items; j += gridDim.y * blockDim.x) {
        if (j < rot_pairs) {
            const int head = j / half, i = j - head * half;
            const int a = interleaved ? 2 * i : i;
            const int b = interleaved ? 2 * i + 1 : i + half;
            const int base = head * head_dim;  // q heads then k heads: contiguous in the row
            float x0 = __ldcg(row + base + a), x1 = __ldcg(row + base + b);
            if (has_bias) { x0 += bias[base + a]; x1 += bias[base + b]; }
            // The CPU engine's arithmetic: f32 cos/sin of the f64 angle, f32 rotation, no FMA.
            const float2 cs = j == j0 ? cs0 : cs_row[i];
            const float y0 = __fsub_rn(__fmul_rn(x0, cs.x), __fmul_rn(x1, cs.y));
            const float y1 = __fadd_rn(__fmul_rn(x0, cs.y), __fmul_rn(x1, cs.x));
            if (head < n_q_heads) {
                const size_t o = (size_t)t * q_dim + base;
                if (BF16_Q) {
                    ((bf16_t*)q_out)[o + a] = f32_to_bf16(y0);
                    ((bf16_t*)q_out)[o + b] = f32_to_bf16(y1);
                } else {
                    ((float*)q_out)[o + a] = y0;
                    ((float*)q_out)[o + b] = y1;
                }
            } else if (store_kv) {
                const size_t o = (size_t)pos * kv_dim + (base - q_dim);
                k_cache[o + a] = f32_to_bf16(y0);
                k_cache[o + b] = f32_to_bf16(y1);
            }
        } else if (store_kv) {
            const int e = j - rot_pairs;
            float v = __ldcg(row + q_dim + kv_dim + e);
            if (has_bias) v += bias[q_dim + kv_dim + e];
            v_cache[(size_t)pos * kv_dim + e] = f32_to_bf16(v);
        }
    }
}

extern "C" __global__ void rope_append_f32q(const float* __restrict__ qkv, const float* __restrict__ bias,
                                            int has_bias, float* __restrict__ q_out,
                                            bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache,
                                            const int* __restrict__ pos_ptr, const float* __restrict__ cos_sin,
                                            int n_q_heads, int n_kv_heads, int head_dim, int interleaved,
                                            int max_seq) {
    rope_append_impl<false>(qkv, bias, has_bias, q_out, k_cache, v_cache, pos_ptr, cos_sin, n_q_heads,
                            n_kv_heads, head_dim, interleaved, max_seq);
}

extern "C" __global__ void rope_append_bf16q(const float* __restrict__ qkv, const float* __restrict__ bias,
                                             int has_bias, bf16_t* __restrict__ q_out,
                                             bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache,
                                             const int* __restrict__ pos_ptr, const float* __restrict__ cos_sin,
                                             int n_q_heads, int n_kv_heads, int head_dim, int interleaved,
                                             int max_seq) {
    rope_append_impl<true>(qkv, bias, has_bias, q_out, k_cache, v_cache, pos_ptr, cos_sin, n_q_heads,
                           n_kv_heads, head_dim, interleaved, max_seq);
}

// End of a captured decode step: history[len[0]] = tok[0] (when record and in range), zero[..n_zero]
// cleared, then the position and the KV length advance by one, so the next replay works on the next
// token.
extern "C" __global__ void finish_step(const int* __restrict__ tok, int* __restrict__ history, int record,
                                       int history_len, int* __restrict__ pos, int* __restrict__ len,
                                       unsigned long long* __restrict__ zero, int n_zero) {
    pdl_wait();
    pdl_trigger();
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        const int l = len[0];
        if (record && l >= 0 && l < history_len) history[l] = __ldcg(tok);
        pos[0] = pos[0] + 1;
        len[0] = l + 1;
    }
    // The step's chained-norm accumulators, zero for the next step.
    for (int i = threadIdx.x; i < n_zero; i += blockDim.x) zero[i] = 0ull;
}

