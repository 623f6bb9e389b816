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

// ---- Synthetic weights (model::synth::fill_row on the device) ----------------------------------

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64 rotl64(u64 x, int k) { return (x << k) | (x >> (64 - k)); }

struct Xoshiro {
    u64 s0, s1, s2, s3;
    __device__ __forceinline__ explicit Xoshiro(u64 seed) {
        u64 s = seed;
        s = splitmix64(s); s0 = s;
        s = splitmix64(s); s1 = s;
        s = splitmix64(s); s2 = s;
        s = splitmix64(s); s3 = s;
    }
    __device__ __forceinline__ u64 next() {
        const u64 r = rotl64(s0 + s3, 23) + s0;
        const u64 t = s1 << 17;
        s2 ^= s0; s3 ^= s1; s1 ^= s2; s0 ^= s3; s2 ^= t;
        s3 = rotl64(s3, 45);
        return r;
    }
    // Uniform in (0, 1], exactly as the CPU computes it.
    __device__ __forceinline__ float unit() {
        return __fmul_rn(__fadd_rn((float)(next() >> 40), 1.0f), 1.0f / 16777216.0f);
    }
    // Box-Muller with IEEE-rounded f32 arithmetic (no contraction); logf/sincosf/expf may differ
    // from the host libm in the last ulp.
    __device__ __forceinline__ void normal2(float& z0, float& z1) {
        const float r = sqrtf(__fmul_rn(-2.0f, logf(unit())));
        float s, c;
        sincosf(__fmul_rn(6.28318548f, unit()), &s, &c);
        z0 = __fmul_rn(r, c);
        z1 = __fmul_rn(r, s);
    }
};

// Fills rows [0, rows) of a synthetic tensor (cols wide; matrix rows ld elements apart). kind 0: RMSNorm weight 1 + 0.05 z, written
// as f32 of its BF16 rounding (out_f32); kind 1: matrix (sigma), written as BF16 bits. One thread per
// row; rng_seed = splitmix(seed ^ name_hash), col_seed = splitmix(seed ^ name_hash ^ 0xC011) from the
// host. Dynamic shared memory: ceil(cols / 32) words, the outlier-column mask.
extern "C" __global__ void synth_fill(bf16_t* __restrict__ out_bf16, float* __restrict__ out_f32, int rows,
                                      int cols, long long ld, u64 rng_seed, u64 col_seed, int kind, float sigma) {
    extern __shared__ u32 outlier_mask[];
    const int words = (cols + 31) >> 5;
    if (kind == 1) {
        for (int w = threadIdx.x; w < words; w += blockDim.x) {
            u32 m = 0;
            for (int b = 0; b < 32; ++b) {
                const int col = w * 32 + b;
                if (col < cols && (splitmix64(col_seed ^ (u64)col) & 255ull) == 0) m |= 1u << b;
            }
            outlier_mask[w] = m;
        }
        __syncthreads();
    }
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    Xoshiro rng(rng_seed ^ splitmix64((u64)row + 1));
    if (kind == 0) {
        for (int c = 0; c < cols; c += 2) {
            float a, b;
            rng.normal2(a, b);
            out_f32[(size_t)row * cols + c] = bf16_to_f32(f32_to_bf16(__fadd_rn(1.0f, __fmul_rn(0.05f, a))));
            if (c + 1 < cols)
                out_f32[(size_t)row * cols + c + 1] = bf16_to_f32(f32_to_bf16(__fadd_rn(1.0f, __fmul_rn(0.05f, b))));
        }
        return;
    }
    float n0, n1;
    rng.normal2(n0, n1);
    const float row_scale = __fmul_rn(sigma, expf(__fmul_rn(0.25f, n0)));
    bf16_t* o = out_bf16 + (size_t)row * ld;
    for (int c = 0; c < cols; c += 2) {
        float z[2];
        rng.normal2(z[0], z[1]);
        const u64 u = rng.next();
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int col = c + j;
            if (col < cols) {
                const float tau = ((u32)(u >> (32 * j))) % 100u < 3u ? 2.5f : 1.0f;
                const float outlier = (outlier_mask[col >> 5] >> (col & 31)) & 1u ? 4.0f : 1.0f;
                o[col] = f32_to_bf16(__fmul_rn(__fmul_rn(__fmul_rn(row_scale, tau), outlier), z[j]));
            }
        }
    }
}
