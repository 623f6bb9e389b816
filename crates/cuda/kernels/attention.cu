// Decode attention over a BF16 KV cache with grouped-query attention.
// Cache layout per layer: [max_seq, n_kv_heads, HEAD_DIM] BF16 for K and for V. The current length
// is read from device memory (seq_len[0]) so a captured CUDA graph replays for every position.
// Split along the sequence: attn_decode_partial handles ATTN_CHUNK positions of one KV head for its
// ATTN_GROUP query heads (each K/V row is loaded once for the whole group), attn_decode_combine
// merges the chunks' (max, sum, weighted V) triples. Scores are kept in log2 units (q pre-scaled by
// scale * log2 e) so exp2f is the only transcendental.
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef ATTN_GROUP
#define ATTN_GROUP 4
#endif
#ifndef ATTN_CHUNK
#define ATTN_CHUNK 256
#endif
#ifndef ATTN_WARPS
#define ATTN_WARPS 4
#endif
#ifndef ATTN_PRELOAD
#define ATTN_PRELOAD 0
#endif
// Families beyond Llama: ATTN_WINDOW = attend to the last `window` positions only (window > 0),
// ATTN_SOFTCAP = scores become softcap · tanh(score / softcap). Either appends (int window, float
// softcap) to the partial and fused kernels' arguments; without them the kernels are Llama's.
#ifndef ATTN_WINDOW
#define ATTN_WINDOW 0
#endif
#ifndef ATTN_SOFTCAP
#define ATTN_SOFTCAP 0
#endif
#define ATTN_EXT (ATTN_WINDOW || ATTN_SOFTCAP)
// ATTN_SINKS = a learned logit per query head (gpt-oss's sinks, sinks[n_q_heads], unscaled) joins
// the softmax's maximum and denominator, not the values: the merge of the chunks (combine, or the
// fused kernel's last block) adds it. Appends (const float* sinks) to the combine and fused
// kernels' arguments.
#ifndef ATTN_SINKS
#define ATTN_SINKS 0
#endif
#define EPL (HEAD_DIM / 32)  // elements of a head per lane, contiguous
static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "HEAD_DIM must be a multiple of 32, at most 256");
static_assert(ATTN_GROUP >= 1 && ATTN_WARPS >= 1 && ATTN_CHUNK >= 1, "attention tuning defines must be >= 1");

// k_new, v_new: f32 [n_kv_heads * HEAD_DIM] of the current token; written at position seq_len[0] - 1.
extern "C" __global__ void kv_append(const float* __restrict__ k_new, const float* __restrict__ v_new,
                                     bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache,
                                     const int* __restrict__ seq_len, int row_elems, int max_seq) {
    const int pos = seq_len[0] - 1;
    if (pos < 0 || pos >= max_seq) return;
    const size_t base = (size_t)pos * row_elems;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < row_elems; i += gridDim.x * blockDim.x) {
        k_cache[base + i] = f32_to_bf16(k_new[i]);
        v_cache[base + i] = f32_to_bf16(v_new[i]);
    }
}

// A lane's EPL elements of a head: in 4-byte words where EPL is even; one at a time where it is
// odd (head dims of 32 × an odd number, Phi-3's 96: the slice starts at an odd element).
__device__ __forceinline__ void load_head_slice(const bf16_t* p, float* out) {
#pragma unroll
    for (int e = 0; e + 1 < EPL; e += 2) {
        if (EPL % 2 == 0) {
            const u32 w = __ldcg((const unsigned int*)(p + e));  // the newest row is the last kernel's
            out[e] = bf16_lo(w);
            out[e + 1] = bf16_hi(w);
        } else {
            out[e] = bf16_to_f32(__ldcg(p + e));
            out[e + 1] = bf16_to_f32(__ldcg(p + e + 1));
        }
    }
    if (EPL % 2 != 0) out[EPL - 1] = bf16_to_f32(__ldcg(p + EPL - 1));
}

// grid (max_chunks, n_kv_heads), block ATTN_WARPS * 32.
// part_acc [n_q_heads, max_chunks, HEAD_DIM]: unnormalised sum of p * V; part_ml [n_q_heads, max_chunks, 2]:
// running max (log2 units) and sum of p. Chunks at or past seq_len write nothing.
template <bool FUSED>
__device__ __forceinline__ void attn_partial_impl(const float* __restrict__ q, const bf16_t* __restrict__ k_cache,
                                                  const bf16_t* __restrict__ v_cache,
                                                  const int* __restrict__ seq_len_ptr, float* part_acc,
                                                  float* part_ml, int n_kv_heads, int max_chunks, int max_seq,
                                                  float scale, float* __restrict__ out, int* counters,
                                                  int window, float softcap, const float* __restrict__ sinks) {
    __shared__ float s_m[ATTN_WARPS][ATTN_GROUP];
    __shared__ float s_l[ATTN_WARPS][ATTN_GROUP];
    __shared__ float s_acc[ATTN_WARPS][ATTN_GROUP][HEAD_DIM];
    // The length only finish_step (the previous decode step's end) changes: read before pdl_wait.
    const int seq_len = min(seq_len_ptr[0], max_seq);
    const int chunk = blockIdx.x, kvh = blockIdx.y;
    const int start = chunk * ATTN_CHUNK;
    if (start >= seq_len) return;
    const int end = min(start + ATTN_CHUNK, seq_len);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#if ATTN_WINDOW
    const int lo = window > 0 ? max(0, seq_len - window) : 0;  // the first position attended
#endif
#if ATTN_SOFTCAP
    const float capl = softcap * LOG2E_F;  // the cap in the scores' log2 units
#endif
    const size_t row_stride = (size_t)n_kv_heads * HEAD_DIM;
    float qr[ATTN_GROUP][EPL], m[ATTN_GROUP], l[ATTN_GROUP], acc[ATTN_GROUP][EPL];
    const float qscale = scale * LOG2E_F;
#if ATTN_PRELOAD
    // Every K/V row of the warp's positions is loaded before the first score: one memory round
    // trip per warp instead of one per position. Rows before the newest were written by earlier
    // steps and are loaded before pdl_wait; the newest (seq_len - 1: this step's append, by the
    // previous kernel) after it.
    constexpr int PER_WARP = ATTN_CHUNK / ATTN_WARPS;
    static_assert(ATTN_CHUNK % ATTN_WARPS == 0 && PER_WARP <= 8, "ATTN_PRELOAD: at most 8 positions per warp");
    float kpre[PER_WARP][EPL], vpre[PER_WARP][EPL];
#pragma unroll
    for (int i = 0; i < PER_WARP; ++i) {
        const int t = min(start + warp + i * ATTN_WARPS, end - 1);
        if (t == seq_len - 1) continue;
        const size_t off = t * row_stride + (size_t)kvh * HEAD_DIM + lane * EPL;
        load_head_slice(k_cache + off, kpre[i]);
        load_head_slice(v_cache + off, vpre[i]);
    }
    pdl_wait();
    pdl_trigger();
#pragma unroll
    for (int i = 0; i < PER_WARP; ++i) {
        const int t = min(start + warp + i * ATTN_WARPS, end - 1);
        if (t != seq_len - 1) continue;
        const size_t off = t * row_stride + (size_t)kvh * HEAD_DIM + lane * EPL;
        load_head_slice(k_cache + off, kpre[i]);
        load_head_slice(v_cache + off, vpre[i]);
    }
#else
    pdl_wait();
    pdl_trigger();
#endif
#pragma unroll
    for (int g = 0; g < ATTN_GROUP; ++g) {
        const float* qh = q + (size_t)(kvh * ATTN_GROUP + g) * HEAD_DIM + lane * EPL;
#pragma unroll
        for (int e = 0; e < EPL; ++e) { qr[g][e] = __ldcg(qh + e) * qscale; acc[g][e] = 0.0f; }
        m[g] = -F32_INF;
        l[g] = 0.0f;
    }
#if ATTN_PRELOAD
    // All the warp's scores first (independent reductions, interleaved), then one softmax pass:
    // no chain of dependent reductions and rescales a position.
    float sc[PER_WARP][ATTN_GROUP];
#pragma unroll
    for (int i = 0; i < PER_WARP; ++i) {
        const bool valid = start + warp + i * ATTN_WARPS < end
#if ATTN_WINDOW
                           && start + warp + i * ATTN_WARPS >= lo
#endif
            ;
#pragma unroll
        for (int g = 0; g < ATTN_GROUP; ++g) {
            float s = 0.0f;
#pragma unroll
            for (int e = 0; e < EPL; ++e) s = fmaf(qr[g][e], kpre[i][e], s);
            s = warp_sum(s);
#if ATTN_SOFTCAP
            s = capl * tanhf(s / capl);
#endif
            sc[i][g] = valid ? s : -F32_INF;
            m[g] = fmaxf(m[g], sc[i][g]);
        }
    }
#pragma unroll
    for (int g = 0; g < ATTN_GROUP; ++g) {
        if (m[g] == -F32_INF) continue;  // a warp with no position: weight 0 in the merge
#pragma unroll
        for (int i = 0; i < PER_WARP; ++i) {
            const float p = exp2f(sc[i][g] - m[g]);  // 0 for the positions past the end
            l[g] += p;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[g][e] = fmaf(p, vpre[i][e], acc[g][e]);
        }
    }
#else
    int t0 = start + warp;
#if ATTN_WINDOW
    while (t0 < lo) t0 += ATTN_WARPS;
#endif
    for (int t = t0; t < end; t += ATTN_WARPS) {
        const size_t off = t * row_stride + (size_t)kvh * HEAD_DIM + lane * EPL;
        float kv[EPL], vv[EPL];
        load_head_slice(k_cache + off, kv);
        load_head_slice(v_cache + off, vv);
#pragma unroll
        for (int g = 0; g < ATTN_GROUP; ++g) {
            float s = 0.0f;
#pragma unroll
            for (int e = 0; e < EPL; ++e) s = fmaf(qr[g][e], kv[e], s);
            s = warp_sum(s);
#if ATTN_SOFTCAP
            s = capl * tanhf(s / capl);
#endif
            const float m_new = fmaxf(m[g], s);
            const float corr = exp2f(m[g] - m_new);
            const float p = exp2f(s - m_new);
            l[g] = l[g] * corr + p;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[g][e] = fmaf(p, vv[e], acc[g][e] * corr);
            m[g] = m_new;
        }
    }
#endif
#pragma unroll
    for (int g = 0; g < ATTN_GROUP; ++g) {
        if (lane == 0) { s_m[warp][g] = m[g]; s_l[warp][g] = l[g]; }
#pragma unroll
        for (int e = 0; e < EPL; ++e) s_acc[warp][g][lane * EPL + e] = acc[g][e];
    }
    __syncthreads();
    // Merge the warps; warps that saw no position have m = -inf and weigh 0 (warp 0 always saw one).
    for (int j = threadIdx.x; j < ATTN_GROUP * HEAD_DIM; j += blockDim.x) {
        const int g = j / HEAD_DIM, d = j - g * HEAD_DIM;
        float mx = -F32_INF;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) mx = fmaxf(mx, s_m[w][g]);
        float a = 0.0f, lsum = 0.0f;
#if ATTN_WINDOW
        // A chunk wholly before the window saw no position: it weighs 0 in the combine.
        const float mref = mx == -F32_INF ? 0.0f : mx;
#else
        const float mref = mx;
#endif
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) {
            const float f = exp2f(s_m[w][g] - mref);
            a = fmaf(f, s_acc[w][g][d], a);
            lsum = fmaf(f, s_l[w][g], lsum);
        }
        const int qh = kvh * ATTN_GROUP + g;
        part_acc[((size_t)qh * max_chunks + chunk) * HEAD_DIM + d] = a;
        if (d == 0) {
            part_ml[((size_t)qh * max_chunks + chunk) * 2] = mx;
            part_ml[((size_t)qh * max_chunks + chunk) * 2 + 1] = lsum;
        }
    }
    if (!FUSED) return;
    // The last block of this KV head to finish merges all chunks of its query heads (threadfence
    // reduction): one launch instead of partial + combine.
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    const int n_chunks = (seq_len + ATTN_CHUNK - 1) / ATTN_CHUNK;
    if (threadIdx.x == 0) s_last = atomicAdd(&counters[kvh], 1) == n_chunks - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // Other blocks' partials are read through L2 (__ldcg: never a stale L1 line). Warp g finds the
    // max and the weight sum of query head g over the chunks; then every thread merges its outputs
    // with independent loads (unrolled, all in flight).
    __shared__ float s_mx[ATTN_GROUP], s_inv[ATTN_GROUP];
    for (int g = warp; g < ATTN_GROUP; g += ATTN_WARPS) {
        const float* ml = part_ml + (size_t)(kvh * ATTN_GROUP + g) * max_chunks * 2;
        float mx = -F32_INF;
        for (int c = lane; c < n_chunks; c += 32) mx = fmaxf(mx, __ldcg(ml + 2 * c));
        mx = warp_max(mx);
#if ATTN_SINKS
        const float sink = sinks[kvh * ATTN_GROUP + g] * LOG2E_F;  // in the scores' log2 units
        mx = fmaxf(mx, sink);
#endif
        float ls = 0.0f;
        for (int c = lane; c < n_chunks; c += 32) ls = fmaf(exp2f(__ldcg(ml + 2 * c) - mx), __ldcg(ml + 2 * c + 1), ls);
        ls = warp_sum(ls);
#if ATTN_SINKS
        ls += exp2f(sink - mx);
#endif
        if (lane == 0) { s_mx[g] = mx; s_inv[g] = 1.0f / ls; }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < ATTN_GROUP * HEAD_DIM; j += blockDim.x) {
        const int g = j / HEAD_DIM, d = j - g * HEAD_DIM;
        const int qh = kvh * ATTN_GROUP + g;
        const float* ml = part_ml + (size_t)qh * max_chunks * 2;
        const float* acc_h = part_acc + (size_t)qh * max_chunks * HEAD_DIM + d;
        const float mx = s_mx[g];
        float a0 = 0.0f, a1 = 0.0f;
        int c = 0;
        for (; c + 1 < n_chunks; c += 2) {
            a0 = fmaf(exp2f(__ldcg(ml + 2 * c) - mx), __ldcg(acc_h + (size_t)c * HEAD_DIM), a0);
            a1 = fmaf(exp2f(__ldcg(ml + 2 * c + 2) - mx), __ldcg(acc_h + (size_t)(c + 1) * HEAD_DIM), a1);
        }
        if (c < n_chunks) a0 = fmaf(exp2f(__ldcg(ml + 2 * c) - mx), __ldcg(acc_h + (size_t)c * HEAD_DIM), a0);
        out[(size_t)qh * HEAD_DIM + d] = (a0 + a1) * s_inv[g];
    }
    if (threadIdx.x == 0) counters[kvh] = 0;  // ready for the next launch
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32, 1)
attn_decode_partial(const float* __restrict__ q, const bf16_t* __restrict__ k_cache,
                    const bf16_t* __restrict__ v_cache, const int* __restrict__ seq_len_ptr,
                    float* __restrict__ part_acc, float* __restrict__ part_ml,
                    int n_kv_heads, int max_chunks, int max_seq, float scale
#if ATTN_EXT
                    , int window, float softcap
#endif
) {
#if !ATTN_EXT
    const int window = 0;
    const float softcap = 0.0f;
#endif
    attn_partial_impl<false>(q, k_cache, v_cache, seq_len_ptr, part_acc, part_ml, n_kv_heads, max_chunks,
                             max_seq, scale, nullptr, nullptr, window, softcap, nullptr);
}

// Partial and combine in one launch: out [n_q_heads, HEAD_DIM] f32; counters [n_kv_heads] zero
// before the first launch (each launch leaves them zero). seq_len must be >= 1.
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32, 1)
attn_decode_fused(const float* __restrict__ q, const bf16_t* __restrict__ k_cache,
                  const bf16_t* __restrict__ v_cache, const int* __restrict__ seq_len_ptr,
                  float* part_acc, float* part_ml, int n_kv_heads, int max_chunks, int max_seq, float scale,
                  float* __restrict__ out, int* counters
#if ATTN_EXT
                  , int window, float softcap
#endif
#if ATTN_SINKS
                  , const float* __restrict__ sinks
#endif
) {
#if !ATTN_EXT
    const int window = 0;
    const float softcap = 0.0f;
#endif
#if !ATTN_SINKS
    const float* sinks = nullptr;
#endif
    attn_partial_impl<true>(q, k_cache, v_cache, seq_len_ptr, part_acc, part_ml, n_kv_heads, max_chunks,
                            max_seq, scale, out, counters, window, softcap, sinks);
}

// grid n_q_heads, block HEAD_DIM. out [n_q_heads, HEAD_DIM] f32.
extern "C" __global__ void attn_decode_combine(const float* __restrict__ part_acc,
                                               const float* __restrict__ part_ml,
                                               const int* __restrict__ seq_len_ptr,
                                               float* __restrict__ out, int max_chunks, int max_seq
#if ATTN_SINKS
                                               , const float* __restrict__ sinks
#endif
) {
    // Triggered before the wait: the projection that follows fills its table and loads its first
    // weights before its own wait, more than this short kernel's work would cover.
    pdl_trigger();
    pdl_wait();
    const int qh = blockIdx.x, d = threadIdx.x;
    const int seq_len = min(seq_len_ptr[0], max_seq);
    const int n_chunks = seq_len <= 0 ? 0 : (seq_len + ATTN_CHUNK - 1) / ATTN_CHUNK;
    const float* ml = part_ml + (size_t)qh * max_chunks * 2;
    // Unrolled so that a stretch of chunks' loads are in flight together.
    float mx = -F32_INF;
#pragma unroll 8
    for (int c = 0; c < n_chunks; ++c) mx = fmaxf(mx, __ldcg(ml + 2 * c));
#if ATTN_SINKS
    const float sink = sinks[qh] * LOG2E_F;  // in the scores' log2 units
    mx = fmaxf(mx, sink);
#endif
    float a = 0.0f, lsum = 0.0f;
#pragma unroll 8
    for (int c = 0; c < n_chunks; ++c) {
        const float f = exp2f(__ldcg(ml + 2 * c) - mx);
        a = fmaf(f, __ldcg(part_acc + ((size_t)qh * max_chunks + c) * HEAD_DIM + d), a);
        lsum = fmaf(f, __ldcg(ml + 2 * c + 1), lsum);
    }
#if ATTN_SINKS
    lsum += exp2f(sink - mx);
#endif
    // An empty cache (seq_len 0) has no defined output: NaN, so it cannot pass silently.
    out[(size_t)qh * HEAD_DIM + d] = n_chunks ? a / lsum : F32_NAN;
}
