// Kernels of the parts of a decoder block that only some families have (crate::families lists
// them): q/k RMSNorm per head and partial rotary fused with the KV append (Qwen3, Gemma 3, Phi-3),
// the residual add of a normed output (Gemma's post-attention and post-MLP norms) with the next
// norm, GeGLU, the embedding scale and soft-capping of logits. Llama's step launches none of them.

// The tanh approximation of GELU as PyTorch computes it (arch.rs Activation::GeluTanh).
__device__ __forceinline__ float gelu_tanh(float x) {
    const float k = 0.7978846f;  // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

// Per (token, head) of qkv [n_tokens, q_dim + 2 kv_dim] f32 (+ bias [width] when has_bias): q and k
// heads are RMS-normed over head_dim with q_norm / k_norm [head_dim] (when not null), then their
// first 2 * rot_half dimensions rotated with cos_sin [max_seq, rot_half] (cos, sin) pairs, the rest
// kept; q goes to q_out [n_tokens, q_dim] (f32 or BF16), k and v (BF16) to row pos[0] + t of the
// caches [max_seq, kv_dim] (rows at or past max_seq are not written). One warp per head;
// grid (n_tokens, ceil(heads / 4)), block 128. head_dim a multiple of 32, at most 256.
#define RH_WARPS 4
template <bool BF16_Q>
__device__ __forceinline__ void rope_heads_impl(const float* __restrict__ qkv, const float* __restrict__ bias,
                                                int has_bias, const float* __restrict__ q_norm,
                                                const float* __restrict__ k_norm, float eps,
                                                void* __restrict__ q_out, bf16_t* __restrict__ k_cache,
                                                bf16_t* __restrict__ v_cache, const int* __restrict__ pos_ptr,
                                                const float* __restrict__ cos_sin, int n_q_heads, int n_kv_heads,
                                                int head_dim, int rot_half, int interleaved, int max_seq) {
    __shared__ float s_head[RH_WARPS][256];
    pdl_wait();
    pdl_trigger();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x;
    const int head = blockIdx.y * RH_WARPS + warp;
    const int n_heads = n_q_heads + 2 * n_kv_heads;
    if (head >= n_heads) return;
    const int pos = __ldcg(pos_ptr) + t;
    const bool store_kv = pos >= 0 && pos < max_seq;
    const int q_dim = n_q_heads * head_dim, kv_dim = n_kv_heads * head_dim;
    const int width = q_dim + 2 * kv_dim;
    const int base = head * head_dim;  // q heads, k heads, v heads: contiguous in the row
    const float* row = qkv + (size_t)t * width + base;
    float* sh = s_head[warp];
    if (head >= n_q_heads + n_kv_heads) {  // a v head: copied
        if (!store_kv) return;
        for (int e = lane; e < head_dim; e += 32) {
            float v = __ldcg(row + e);
            if (has_bias) v += bias[base + e];
            v_cache[(size_t)pos * kv_dim + base - q_dim - kv_dim + e] = f32_to_bf16(v);
        }
        return;
    }
    const bool is_q = head < n_q_heads;
    const float* g = is_q ? q_norm : k_norm;
    float ss = 0.0f;
    for (int e = lane; e < head_dim; e += 32) {
        float v = __ldcg(row + e);
        if (has_bias) v += bias[base + e];
        sh[e] = v;
        ss = fmaf(v, v, ss);
    }
    __syncwarp();
    if (g) {
        const float inv = rsqrtf(warp_sum(ss) / (float)head_dim + eps);
        for (int e = lane; e < head_dim; e += 32) sh[e] = sh[e] * inv * g[e];
        __syncwarp();
    }
    const int tab = min(max(pos, 0), max_seq - 1);  // the host keeps pos < max_seq
    const float2* cs_row = (const float2*)cos_sin + (size_t)tab * rot_half;
    float* qo = (float*)q_out + (size_t)t * q_dim + base;
    bf16_t* qb = (bf16_t*)q_out + (size_t)t * q_dim + base;
    bf16_t* kc = k_cache + (size_t)pos * kv_dim + base - q_dim;
    for (int e = lane; e < head_dim; e += 32) {
        float y = sh[e];
        if (e < 2 * rot_half) {
            // Rotation pair (a, b) of dimension e, and e's place in it.
            int i, partner;
            bool first;
            if (interleaved) {
                i = e >> 1;
                first = (e & 1) == 0;
                partner = first ? e + 1 : e - 1;
            } else {
                first = e < rot_half;
                i = first ? e : e - rot_half;
                partner = first ? e + rot_half : e - rot_half;
            }
            const float2 cs = cs_row[i];
            const float x0 = first ? sh[e] : sh[partner], x1 = first ? sh[partner] : sh[e];
            // rope_append_impl's arithmetic (engine.cu): f32 rotation, no FMA.
            y = first ? __fsub_rn(__fmul_rn(x0, cs.x), __fmul_rn(x1, cs.y))
                      : __fadd_rn(__fmul_rn(x0, cs.y), __fmul_rn(x1, cs.x));
        }
        if (is_q) {
            if (BF16_Q) qb[e] = f32_to_bf16(y);
            else qo[e] = y;
        } else if (store_kv) {
            kc[e] = f32_to_bf16(y);
        }
    }
}

extern "C" __global__ void __launch_bounds__(RH_WARPS * 32)
rope_heads_f32q(const float* __restrict__ qkv, const float* __restrict__ bias, int has_bias,
                const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
                float* __restrict__ q_out, bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache,
                const int* __restrict__ pos_ptr, const float* __restrict__ cos_sin, int n_q_heads,
                int n_kv_heads, int head_dim, int rot_half, int interleaved, int max_seq) {
    rope_heads_impl<false>(qkv, bias, has_bias, q_norm, k_norm, eps, q_out, k_cache, v_cache, pos_ptr, cos_sin,
                           n_q_heads, n_kv_heads, head_dim, rot_half, interleaved, max_seq);
}

extern "C" __global__ void __launch_bounds__(RH_WARPS * 32)
rope_heads_bf16q(const float* __restrict__ qkv, const float* __restrict__ bias, int has_bias,
                 const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
                 bf16_t* __restrict__ q_out, bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache,
                 const int* __restrict__ pos_ptr, const float* __restrict__ cos_sin, int n_q_heads,
                 int n_kv_heads, int head_dim, int rot_half, int interleaved, int max_seq) {
    rope_heads_impl<true>(qkv, bias, has_bias, q_norm, k_norm, eps, q_out, k_cache, v_cache, pos_ptr, cos_sin,
                          n_q_heads, n_kv_heads, head_dim, rot_half, interleaved, max_seq);
}

// Per row r (one block): x[r] += rmsnorm(y[r]; w), then, when g is not null, h[r] = rmsnorm(x[r]; g)
// (f32, or BF16 when BF16_OUT). y and h may be the same buffer (decode: h holds the projection's
// output, then the next norm's).
template <bool BF16_OUT>
__device__ __forceinline__ void add_rmsnorm_impl(const float* y, const float* __restrict__ w, float* __restrict__ x,
                                                 const float* __restrict__ g, void* h, int dim, float eps) {
    pdl_wait();
    pdl_trigger();
    __shared__ float scratch[32];
    const size_t r = (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = __ldcg(y + r + i);
        ss = fmaf(v, v, ss);
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);
    float ss2 = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = __ldcg(x + r + i) + __ldcg(y + r + i) * inv * w[i];
        x[r + i] = v;
        ss2 = fmaf(v, v, ss2);
    }
    if (!g) return;
    const float inv2 = rsqrtf(block_sum(ss2, scratch) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = x[r + i] * inv2 * g[i];  // this thread's own write
        if (BF16_OUT) ((bf16_t*)h)[r + i] = f32_to_bf16(v);
        else ((float*)h)[r + i] = v;
    }
}

extern "C" __global__ void add_rmsnorm(const float* y, const float* __restrict__ w, float* __restrict__ x,
                                       const float* __restrict__ g, float* h, int dim, float eps) {
    add_rmsnorm_impl<false>(y, w, x, g, h, dim, eps);
}

extern "C" __global__ void add_rmsnorm_bf16out(const float* y, const float* __restrict__ w, float* __restrict__ x,
                                               const float* __restrict__ g, bf16_t* h, int dim, float eps) {
    add_rmsnorm_impl<true>(y, w, x, g, h, dim, eps);
}

// out[t, i] = gelu_tanh(gate) * up over n_tokens rows of gate_up [n_tokens, 2 inter] f32, with the
// pairs interleaved (g0, u0, g1, u1, ...: the engine's stacking) or as halves (gate row, then up
// row); out f32 or BF16 [n_tokens, inter].
template <bool BF16_OUT>
__device__ __forceinline__ void geglu_impl(const float* __restrict__ gate_up, void* __restrict__ out, int inter,
                                           int n_tokens, int halves) {
    pdl_wait();
    pdl_trigger();
    const size_t n = (size_t)inter * n_tokens;
    for (size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        const size_t t = j / inter, i = j - t * inter;
        const float* row = gate_up + t * 2 * inter;
        const float gt = __ldcg(halves ? row + i : row + 2 * i);
        const float up = __ldcg(halves ? row + inter + i : row + 2 * i + 1);
        const float v = gelu_tanh(gt) * up;
        if (BF16_OUT) ((bf16_t*)out)[j] = f32_to_bf16(v);
        else ((float*)out)[j] = v;
    }
}

extern "C" __global__ void geglu_f32(const float* __restrict__ gate_up, float* __restrict__ out, int inter,
                                     int n_tokens, int halves) {
    geglu_impl<false>(gate_up, out, inter, n_tokens, halves);
}

extern "C" __global__ void geglu_bf16out(const float* __restrict__ gate_up, bf16_t* __restrict__ out, int inter,
                                         int n_tokens, int halves) {
    geglu_impl<true>(gate_up, out, inter, n_tokens, halves);
}

// x[i] *= s (the embedding scale).
extern "C" __global__ void scale_f32(float* __restrict__ x, int n, float s) {
    pdl_wait();
    pdl_trigger();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = __ldcg(x + i) * s;
}

// x[i] = cap * tanh(x[i] / cap) (soft-capping of logits).
extern "C" __global__ void softcap_f32(float* __restrict__ x, int n, float cap) {
    pdl_wait();
    pdl_trigger();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] = cap * tanhf(__ldcg(x + i) / cap);
}

// A mixture of experts' routing, per token t = blockIdx.x (one warp) of logits [n_tokens,
// n_experts] plus bias [n_experts] (when not null; the CPU engine's f32 add). topk_first = 0
// (Mixtral, Qwen-MoE): the softmax (f32, exp(l - max) / sum, as the CPU engine), the top_k most
// probable experts, their probabilities divided by their sum (taken in the order picked, as the
// CPU) when norm_topk. topk_first = 1 (gpt-oss): the top_k largest logits, weighted by the softmax
// of those alone (max and sum in the order picked, as the CPU). Ties go to the lower index; a NaN
// ranks as -inf, so top_k distinct experts are always written. Written to experts and weights
// [n_tokens, top_k] in ascending expert order, the order in which the CPU engine adds the
// experts' outputs.
#define MOE_MAX_EXPERTS 4096
#define MOE_MAX_K 64
extern "C" __global__ void __launch_bounds__(32)
moe_topk(const float* __restrict__ logits, const float* __restrict__ bias, int n_experts, int top_k,
         int norm_topk, int topk_first, int* __restrict__ experts, float* __restrict__ weights) {
    __shared__ float p[MOE_MAX_EXPERTS];
    __shared__ unsigned char taken[MOE_MAX_EXPERTS];
    __shared__ int pick[MOE_MAX_K];
    __shared__ float pick_p[MOE_MAX_K];
    pdl_wait();
    pdl_trigger();
    const int lane = threadIdx.x;
    const float* l = logits + (size_t)blockIdx.x * n_experts;
    float mx = -F32_INF;
    for (int i = lane; i < n_experts; i += 32) {
        float v = __ldcg(l + i);
        if (bias) v = __fadd_rn(v, bias[i]);
        p[i] = v;
        taken[i] = 0;
        mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    if (!topk_first) {
        float sum = 0.0f;
        for (int i = lane; i < n_experts; i += 32) {
            const float e = expf(p[i] - mx);
            p[i] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        __syncwarp();
        for (int i = lane; i < n_experts; i += 32) p[i] = p[i] / sum;
    }
    __syncwarp();
    for (int j = 0; j < top_k; ++j) {
        // The lane's best unpicked expert, then the warp's: the larger value, ties to the lower
        // index (NaN as -inf, so an expert is always found).
        float bv = -F32_INF;
        int bi = 0x7fffffff;
        for (int i = lane; i < n_experts; i += 32) {
            if (taken[i]) continue;
            float v = p[i];
            if (v != v) v = -F32_INF;
            if (v > bv || (v == bv && i < bi)) {
                bv = v;
                bi = i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            pick[j] = bi;
            pick_p[j] = p[bi];
            taken[bi] = 1;
        }
        __syncwarp();
    }
    if (lane != 0) return;
    float total = 0.0f;
    if (topk_first) {
        // The softmax of the picked logits (the CPU engine's exp_shifted over them).
        float m = -F32_INF;
        for (int j = 0; j < top_k; ++j) m = fmaxf(m, pick_p[j]);
        for (int j = 0; j < top_k; ++j) {
            pick_p[j] = expf(pick_p[j] - m);
            total += pick_p[j];
        }
    } else {
        for (int j = 0; j < top_k; ++j) total += pick_p[j];
    }
    const bool divide = topk_first || norm_topk;
    // Insertion sort of the k picks by expert index (k is small).
    for (int j = 1; j < top_k; ++j) {
        const int e = pick[j];
        const float v = pick_p[j];
        int i = j - 1;
        for (; i >= 0 && pick[i] > e; --i) {
            pick[i + 1] = pick[i];
            pick_p[i + 1] = pick_p[i];
        }
        pick[i + 1] = e;
        pick_p[i + 1] = v;
    }
    int* eo = experts + (size_t)blockIdx.x * top_k;
    float* wo = weights + (size_t)blockIdx.x * top_k;
    for (int j = 0; j < top_k; ++j) {
        eo[j] = pick[j];
        wo[j] = divide ? pick_p[j] / total : pick_p[j];
    }
}

// The weighted sum of a token's experts' outputs: out[t, i] = (accumulate ? out[t, i] : 0) +
// (Σ_j w[t, j] · (ys[r, i] + down_b[e, i])) with r = rows[t * top_k + j] (rows null: t * top_k + j)
// and e = slot_experts[t * top_k + j] (down_b null: no bias; gpt-oss's experts' down bias), the
// sum from j = 0 in f32 without FMA and then added (the CPU engine's order: each expert's output
// plus its bias, the weighted sum in expert order, then the residual add). ys [*, hidden],
// w [n_tokens, top_k].
extern "C" __global__ void moe_combine(const float* __restrict__ ys, const int* __restrict__ rows,
                                       const float* __restrict__ w, int top_k, int hidden, int n_tokens,
                                       float* __restrict__ out, int accumulate, const int* __restrict__ slot_experts,
                                       const float* __restrict__ down_b) {
    pdl_wait();
    pdl_trigger();
    const size_t n = (size_t)n_tokens * hidden;
    for (size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        const size_t t = j / hidden, i = j - t * hidden;
        float s = 0.0f;
        for (int k = 0; k < top_k; ++k) {
            const size_t slot = t * top_k + k;
            const size_t r = rows ? (size_t)__ldcg(rows + slot) : slot;
            float y = __ldcg(ys + r * hidden + i);
            if (down_b) y = __fadd_rn(y, down_b[(size_t)__ldcg(slot_experts + slot) * hidden + i]);
            s = __fadd_rn(s, __fmul_rn(__ldcg(w + slot), y));
        }
        out[j] = accumulate ? __fadd_rn(__ldcg(out + j), s) : s;
    }
}

// The activation of a mixture of experts' gate/up products where the gathered product's SwiGLU
// epilogue does not do it: per row r of gate_up [n_rows, 2 inter] f32 ((gate, up) pairs
// interleaved, or halves: gate row then up row), gate += gate_b[e, i] and up += up_b[e, i] with
// e = row_experts[r] (row_experts null: no biases; gpt-oss's experts' biases), then act: 0 SiLU
// (gate · σ(gate) · up), 1 GELU tanh, 2 gpt-oss's clamped SwiGLU (gate = min(gate, limit),
// up = clamp(up, -limit, limit), (up + 1) · gate · σ(alpha · gate)); each in the CPU engine's
// order of operations. out f32 or BF16 [n_rows, inter].
template <bool BF16_OUT>
__device__ __forceinline__ void moe_glu_impl(const float* __restrict__ gate_up, void* __restrict__ out, int inter,
                                             int n_rows, int halves, const int* __restrict__ row_experts,
                                             const float* __restrict__ gate_b, const float* __restrict__ up_b,
                                             int act, float alpha, float limit) {
    pdl_wait();
    pdl_trigger();
    const size_t n = (size_t)inter * n_rows;
    for (size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        const size_t r = j / inter, i = j - r * inter;
        const float* row = gate_up + r * 2 * inter;
        float g = __ldcg(halves ? row + i : row + 2 * i);
        float u = __ldcg(halves ? row + inter + i : row + 2 * i + 1);
        if (row_experts) {
            const size_t b = (size_t)__ldcg(row_experts + r) * inter + i;
            g = __fadd_rn(g, gate_b[b]);
            u = __fadd_rn(u, up_b[b]);
        }
        float v;
        if (act == 2) {
            g = fminf(g, limit);
            u = fminf(fmaxf(u, -limit), limit);
            const float glu = __fmul_rn(g, __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-__fmul_rn(g, alpha)))));
            v = __fmul_rn(__fadd_rn(u, 1.0f), glu);
        } else if (act == 1) {
            v = __fmul_rn(gelu_tanh(g), u);
        } else {
            v = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
        }
        if (BF16_OUT) ((bf16_t*)out)[j] = f32_to_bf16(v);
        else ((float*)out)[j] = v;
    }
}

extern "C" __global__ void moe_glu_f32(const float* __restrict__ gate_up, float* __restrict__ out, int inter,
                                       int n_rows, int halves, const int* __restrict__ row_experts,
                                       const float* __restrict__ gate_b, const float* __restrict__ up_b, int act,
                                       float alpha, float limit) {
    moe_glu_impl<false>(gate_up, out, inter, n_rows, halves, row_experts, gate_b, up_b, act, alpha, limit);
}

extern "C" __global__ void moe_glu_bf16out(const float* __restrict__ gate_up, bf16_t* __restrict__ out, int inter,
                                           int n_rows, int halves, const int* __restrict__ row_experts,
                                           const float* __restrict__ gate_b, const float* __restrict__ up_b,
                                           int act, float alpha, float limit) {
    moe_glu_impl<true>(gate_up, out, inter, n_rows, halves, row_experts, gate_b, up_b, act, alpha, limit);
}

// x[r, i] = x[r, i] + (y[r, i] + b[i]) over n_rows rows of dim: a projection's output plus its bias,
// then the residual add, in the CPU engine's order (gpt-oss's attention output bias).
extern "C" __global__ void bias_residual(const float* __restrict__ y, const float* __restrict__ b,
                                         float* __restrict__ x, int dim, int n_rows) {
    pdl_wait();
    pdl_trigger();
    const size_t n = (size_t)dim * n_rows;
    for (size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x)
        x[j] = __fadd_rn(__ldcg(x + j), __fadd_rn(__ldcg(y + j), b[j % dim]));
}

// Prefill's grouping of tokens by expert: out[r] = in[idx[r]] for n_rows rows of dim BF16 values.
extern "C" __global__ void moe_gather_rows(const bf16_t* __restrict__ in, const int* __restrict__ idx, int n_rows,
                                           int dim, bf16_t* __restrict__ out) {
    pdl_wait();
    pdl_trigger();
    const size_t n = (size_t)n_rows * dim;
    for (size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        const size_t r = j / dim, i = j - r * dim;
        out[j] = in[(size_t)__ldcg(idx + r) * dim + i];
    }
}
