// Batch-1 dense GEMV: y = W x, W row-major [N, K] BF16, x f32 [K], y f32 [N]; K % 8 == 0 so every
// row starts 16-byte aligned. Each warp owns GEMV_ROWS consecutive rows; each lane streams 16-byte
// chunks (8 weights) of all its rows, GEMV_UNROLL chunks per row in flight before the first FMA, and
// reuses each x chunk across the rows. One warp reduction per row, no atomics: deterministic.
#ifndef GEMV_WARPS
#define GEMV_WARPS 4
#endif
#ifndef GEMV_ROWS
#define GEMV_ROWS 2
#endif
#ifndef GEMV_UNROLL
#define GEMV_UNROLL 4
#endif
// 1: y += W x (the residual add fused into the output projections of the forward pass).
#ifndef GEMV_ACCUM
#define GEMV_ACCUM 0
#endif

static_assert(GEMV_WARPS >= 1 && GEMV_WARPS <= 32 && GEMV_ROWS >= 1 && GEMV_UNROLL >= 1,
              "GEMV tuning defines out of range");

__device__ __forceinline__ float dot8(uint4 w, float4 a, float4 b, float acc) {
    acc = fmaf(bf16_lo(w.x), a.x, acc);
    acc = fmaf(bf16_hi(w.x), a.y, acc);
    acc = fmaf(bf16_lo(w.y), a.z, acc);
    acc = fmaf(bf16_hi(w.y), a.w, acc);
    acc = fmaf(bf16_lo(w.z), b.x, acc);
    acc = fmaf(bf16_hi(w.z), b.y, acc);
    acc = fmaf(bf16_lo(w.w), b.z, acc);
    acc = fmaf(bf16_hi(w.w), b.w, acc);
    return acc;
}

// Fused variants of the forward pass: NORM = x is RMS-normalised on the fly (y = rsqrt(mean(x²) + eps)
// · W (x ∘ g): the sum of squares is accumulated over the same x chunks the dot products read, and
// the scalar applied after the reduction); SWIGLU = rows come in (gate, up) pairs and the pair's
// output is silu(gate) · up at y[row / 2] (needs GEMV_ROWS even).
#ifndef GEMV_SWIGLU
#define GEMV_SWIGLU 0
#endif
// The row-per-warp kernels (BF16, FP8) exist where SwiGLU's row pairs lie within a warp; the
// palette kernels (GEMV_ROWS: groups of warps on tile pairs) with any group count.
#define GEMV_DENSE (!GEMV_SWIGLU || GEMV_ROWS % 2 == 0)
// ROPE = the q/k/v projection of a decode step with RoPE and the KV-cache append in its epilogue
// (one kernel fewer per layer): a warp's rows are rotation pairs (i, i + half) or (2i, 2i + 1) of a
// q or k head, or two consecutive v rows, and lane 0 writes the rotated q (f32) and the k and v rows
// of position pos[0] (BF16) with rope_append_impl's arithmetic (engine.cu), so the result is the
// same bits as the GEMV followed by that kernel.
#ifndef GEMV_ROPE
#define GEMV_ROPE 0
#endif
static_assert(!GEMV_ROPE || (GEMV_ROWS % 2 == 0 && !GEMV_SWIGLU && !GEMV_ACCUM),
              "GEMV_ROPE needs an even GEMV_ROWS and no other epilogue");

struct RopeArgs {
    const float* bias;  // [n] or null
    float* q_out;       // [q_dim]
    bf16_t* k_cache;    // [max_seq, kv_dim]
    bf16_t* v_cache;
    const int* pos;     // the step's position
    const float* cos_sin;  // [max_seq, head_dim / 2] (cos, sin) pairs
    int n_q_heads, n_kv_heads, head_dim, interleaved, max_seq;
};

// The two weight rows of rotation pair `p` (q heads, then k heads, then v rows two by two).
__device__ __forceinline__ void rope_pair_rows(const RopeArgs& ra, int p, int& a, int& b) {
    const int half = ra.head_dim / 2;
    const int rot_pairs = (ra.n_q_heads + ra.n_kv_heads) * half;
    if (p < rot_pairs) {
        const int head = p / half, i = p - head * half;
        a = head * ra.head_dim + (ra.interleaved ? 2 * i : i);
        b = head * ra.head_dim + (ra.interleaved ? 2 * i + 1 : i + half);
    } else {
        a = rot_pairs * 2 + 2 * (p - rot_pairs);
        b = a + 1;
    }
}

// The position and the pair's (cos, sin), loaded right after pdl_wait so that their latency hides
// behind the weight stream.
struct RopeAt {
    int pos;
    float2 cs;
};

__device__ __forceinline__ RopeAt rope_at(const RopeArgs& ra, int p) {
    const int half = ra.head_dim / 2;
    RopeAt at;
    at.pos = __ldcg(ra.pos);  // written by the previous step's last kernel
    const int tab = min(max(at.pos, 0), ra.max_seq - 1);
    at.cs = ((const float2*)ra.cos_sin)[(size_t)tab * half + p % half];
    return at;
}

__device__ __forceinline__ void rope_store(const RopeArgs& ra, RopeAt at, int a, int b, float x0, float x1) {
    const int q_dim = ra.n_q_heads * ra.head_dim, kv_dim = ra.n_kv_heads * ra.head_dim;
    const int pos = at.pos;
    const bool store_kv = pos >= 0 && pos < ra.max_seq;
    if (ra.bias) { x0 += ra.bias[a]; x1 += ra.bias[b]; }
    if (a >= q_dim + kv_dim) {
        if (store_kv) {
            ra.v_cache[(size_t)pos * kv_dim + a - q_dim - kv_dim] = f32_to_bf16(x0);
            ra.v_cache[(size_t)pos * kv_dim + b - q_dim - kv_dim] = f32_to_bf16(x1);
        }
        return;
    }
    const float2 cs = at.cs;
    const float y0 = __fsub_rn(__fmul_rn(x0, cs.x), __fmul_rn(x1, cs.y));
    const float y1 = __fadd_rn(__fmul_rn(x0, cs.y), __fmul_rn(x1, cs.x));
    if (a < q_dim) {
        ra.q_out[a] = y0;
        ra.q_out[b] = y1;
    } else if (store_kv) {
        ra.k_cache[(size_t)pos * kv_dim + a - q_dim] = f32_to_bf16(y0);
        ra.k_cache[(size_t)pos * kv_dim + b - q_dim] = f32_to_bf16(y1);
    }
}

// FP8 E4M3 weights (gemv_fp8*: FP8 checkpoints with per-row scales, y = s[row] · Σ fp8(W[row, c]) x[c];
// K % 16 == 0, each 16-byte chunk holds 16 weights). Conversion: cvt.rn.f16x2.e4m3x2 (sm_89+, one F2FP per 2 weights, exact: every E4M3 value is an
// F16 value) then f16 → f32 (exact), so the sum is over the exact weights, as the CPU reference.
__device__ __forceinline__ float4 e4m3x4_to_f32x4(u32 w) {
    float4 f;
    asm("{\n\t.reg .b16 lo, hi, h0, h1, h2, h3;\n\t.reg .b32 p, q;\n\t"
        "mov.b32 {lo, hi}, %4;\n\t"
        "cvt.rn.f16x2.e4m3x2 p, lo;\n\t"
        "cvt.rn.f16x2.e4m3x2 q, hi;\n\t"
        "mov.b32 {h0, h1}, p;\n\t"
        "mov.b32 {h2, h3}, q;\n\t"
        "cvt.f32.f16 %0, h0;\n\t"
        "cvt.f32.f16 %1, h1;\n\t"
        "cvt.f32.f16 %2, h2;\n\t"
        "cvt.f32.f16 %3, h3;\n\t}"
        : "=f"(f.x), "=f"(f.y), "=f"(f.z), "=f"(f.w)
        : "r"(w));
    return f;
}

__device__ __forceinline__ float dot4_e4m3(u32 w, float4 a, float acc) {
    const float4 f = e4m3x4_to_f32x4(w);
    acc = fmaf(f.x, a.x, acc);
    acc = fmaf(f.y, a.y, acc);
    acc = fmaf(f.z, a.z, acc);
    acc = fmaf(f.w, a.w, acc);
    return acc;
}

// The value of one FP8 E4M3 code, exact (every E4M3 value is an F16 value).
__device__ __forceinline__ float e4m3_to_f32(u32 code) {
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)code));
    float f;
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.f32.f16 %0, lo;\n\t}" : "=f"(f) : "r"(h2));
    return f;
}

// Palette-packed FP8 geometry (codec palette::Palette4): tiles of 16 rows, blocks of 64 columns.
#define PAL4_TILE_ROWS 16
#define PAL4_BLOCK_COLS 64

// Weight storage of gemv_body.
#define WFMT_BF16 0  // BF16 [n, k], 8 weights a 16-byte chunk
#define WFMT_FP8 1   // FP8 E4M3 [n, k] with per-row scales, 16 weights a chunk

// What the fused variants read and write besides w, x and y.
struct GemvFuse {
    const float* row_scale;  // FP8: per-row scales of the weights
    const float* g;      // NORM: RMSNorm weight, x normalised on the fly
    // PRENORM: x arrives multiplied by the norm weight; ss_in[0] = Σ of its unnormalised squares
    // in fixed point (SS_ONE = 1), from the producing GEMV; applied as a scale after the sums.
    const unsigned long long* ss_in;
    float eps;
    RopeArgs rope;
    // NEXTNORM (accumulating GEMVs): the next RMSNorm's input, so it needs no kernel of its own:
    // h_out = x_new ∘ g_next, and each warp adds Σ x_new² of its rows to ss_out[0] (zero before the
    // launch) in fixed point: integer addition, so the sum does not depend on the warps' order.
    const float* g_next;
    float* h_out;
    unsigned long long* ss_out;
};

#define SS_ONE 16777216.0f  // 2^24: fixed-point unit of the chained sums of squares

// WFMT: the weight storage (WFMT_*).
// gemv_rows: the GEMV_ROWS rows from row0 of one warp.
template <bool NORM, bool PRENORM, bool NEXTNORM, int WFMT>
__device__ __forceinline__ void gemv_rows(const void* __restrict__ w, const float* __restrict__ x,
                                          float* __restrict__ y, int n, int k, const GemvFuse& f, int row0) {
    static_assert(!NEXTNORM || GEMV_ACCUM, "NEXTNORM is the epilogue of an accumulating GEMV");
    const int lane = threadIdx.x & 31;
    if (row0 >= n) return;
    constexpr bool FP8 = WFMT == WFMT_FP8;
    constexpr int XQ = FP8 ? 4 : 2;  // float4s of x per 16-byte weight chunk
    const int chunks = k / (4 * XQ);  // 16-byte chunks per row
    const float4* xv = (const float4*)x;
    const float4* gv = (const float4*)f.g;
    // Rows past the end re-read the last row (valid memory, uniform control flow); never stored.
    int ri[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) ri[r] = min(row0 + r, n - 1);
#if GEMV_ROPE
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r += 2) rope_pair_rows(f.rope, min(row0 + r, n - 2) / 2, ri[r], ri[r + 1]);
#endif
    const uint4* rows[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) rows[r] = (const uint4*)((const char*)w + (size_t)ri[r] * k * (FP8 ? 1 : 2));
    float acc[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) acc[r] = 0.0f;
    float ss = 0.0f;

    // The first batch of weights is loaded before pdl_wait (weights are immutable), so under
    // programmatic dependent launch it streams while the previous kernel finishes.
    uint4 wv[GEMV_UNROLL][GEMV_ROWS];
#if GEMV_ROPE
    RopeAt at[GEMV_ROWS / 2];
    if (lane >= chunks) {  // lanes with no chunk (k < 256) wait here
        pdl_wait();
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r += 2) at[r / 2] = rope_at(f.rope, min(row0 + r, n - 2) / 2);
    }
#else
    if (lane >= chunks) pdl_wait();  // lanes with no chunk (k < 256) wait here
#endif
    for (int c0 = lane; c0 < chunks; c0 += 32 * GEMV_UNROLL) {
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const int c = c0 + u * 32;
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r)
                wv[u][r] = c < chunks ? ld_stream_u4(rows[r] + c) : make_uint4(0, 0, 0, 0);
        }
        if (c0 == lane) {
            pdl_wait();
            pdl_trigger();
#if GEMV_ROPE
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r += 2) at[r / 2] = rope_at(f.rope, min(row0 + r, n - 2) / 2);
#endif
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const int c = c0 + u * 32;
            if (c < chunks) {
                // x: a coherent load (not __ldg's ld.global.nc, which assumes x read-only while the
                // kernel runs, untrue under PDL).
                float4 xq[XQ];
#pragma unroll
                for (int q = 0; q < XQ; ++q) {
                    const int xi = XQ * c + q;
                    float4 a = __ldca(xv + xi);
                    if (NORM) {
                        ss = fmaf(a.x, a.x, ss); ss = fmaf(a.y, a.y, ss); ss = fmaf(a.z, a.z, ss); ss = fmaf(a.w, a.w, ss);
                        const float4 ga = __ldg(gv + xi);
                        a.x *= ga.x; a.y *= ga.y; a.z *= ga.z; a.w *= ga.w;
                    }
                    xq[q] = a;
                }
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) {
                    if (FP8) {
                        float a = acc[r];
                        a = dot4_e4m3(wv[u][r].x, xq[0], a);
                        a = dot4_e4m3(wv[u][r].y, xq[1 % XQ], a);
                        a = dot4_e4m3(wv[u][r].z, xq[2 % XQ], a);
                        a = dot4_e4m3(wv[u][r].w, xq[3 % XQ], a);
                        acc[r] = a;
                    } else {
                        acc[r] = dot8(wv[u][r], xq[0], xq[1], acc[r]);
                    }
                }
            }
        }
    }
    float scale = 1.0f;
    if (NORM) scale = rsqrtf(warp_sum(ss) / (float)k + f.eps);
    if (PRENORM) scale = rsqrtf((float)((double)__ldcg(f.ss_in) * (1.0 / SS_ONE)) / (float)k + f.eps);
    // Per-row weight scales (FP8; rows past the end read the last row's, never stored).
    float rs[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) rs[r] = FP8 ? __ldg(f.row_scale + ri[r]) : 1.0f;
#if GEMV_ROPE
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r += 2) {
        const float s0 = warp_sum(acc[r]) * scale, s1 = warp_sum(acc[r + 1]) * scale;
        if (lane == 0 && row0 + r + 1 < n) rope_store(f.rope, at[r / 2], ri[r], ri[r + 1], s0, s1);
    }
#elif GEMV_SWIGLU
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r += 2) {
        const float gate = warp_sum(acc[r]) * scale * rs[r], up = warp_sum(acc[r + 1]) * scale * rs[r + 1];
        if (lane == 0 && row0 + r + 1 < n) y[(row0 + r) >> 1] = gate / (1.0f + expf(-gate)) * up;
    }
#else
    // The residual read bypasses L1 (__ldcg): under PDL the next kernel (RMSNorm, reading all of y)
    // is launched before this one ends, so a line of y that this read left in the SM's L1 could
    // still be there, without the rows other blocks write after it, when that kernel reads y.
    float sq = 0.0f;
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        const float s = warp_sum(acc[r]) * scale * rs[r];
        if (lane == 0 && row0 + r < n) {
            const float v = GEMV_ACCUM ? __ldcg(y + row0 + r) + s : s;
            y[row0 + r] = v;
            if (NEXTNORM) {
                f.h_out[row0 + r] = v * f.g_next[row0 + r];
                sq = fmaf(v, v, sq);
            }
        }
    }
    if (NEXTNORM && lane == 0 && sq != 0.0f) atomicAdd(f.ss_out, (unsigned long long)__float2ull_rn(sq * SS_ONE));
#endif
}

// One warp's rows.
template <bool NORM, bool PRENORM, bool NEXTNORM, int WFMT = WFMT_BF16>
__device__ __forceinline__ void gemv_body(const void* __restrict__ w, const float* __restrict__ x,
                                          float* __restrict__ y, int n, int k, const GemvFuse& f) {
    const int row0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * GEMV_ROWS;
    gemv_rows<NORM, PRENORM, NEXTNORM, WFMT>(w, x, y, n, k, f, row0);
}

#if !GEMV_ROPE
#if GEMV_DENSE
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_bf16(const bf16_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int n, int k) {
    gemv_body<false, false, false>(w, x, y, n, k, GemvFuse{});
}

// y = W · rmsnorm(x; g, eps) (g f32 [k]).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_bf16_norm(const bf16_t* __restrict__ w, const float* __restrict__ x, const float* __restrict__ g,
               float* __restrict__ y, int n, int k, float eps) {
    GemvFuse f{};
    f.g = g;
    f.eps = eps;
    gemv_body<true, false, false>(w, x, y, n, k, f);
}

// y = rsqrt(ss[0] / k + eps) · W h, with h = x ∘ g and ss[0] = Σ x² (fixed point) from the
// producing GEMV.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_bf16_prenorm(const bf16_t* __restrict__ w, const float* __restrict__ h, const unsigned long long* ss,
                  float* __restrict__ y, int n, int k, float eps) {
    GemvFuse f{};
    f.ss_in = ss;
    f.eps = eps;
    gemv_body<false, true, false>(w, h, y, n, k, f);
}

#if GEMV_ACCUM && !GEMV_SWIGLU
// y += W x, then the next RMSNorm's input: h_out = y ∘ g_next, and Σ y² added to ss_out[0] (fixed
// point, SS_ONE = 1; zero before the launch).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_bf16_accum_norm(const bf16_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int n, int k,
                     const float* g_next, float* h_out, unsigned long long* ss_out) {
    GemvFuse f{};
    f.g_next = g_next;
    f.h_out = h_out;
    f.ss_out = ss_out;
    gemv_body<false, false, true>(w, x, y, n, k, f);
}
#endif
#if !GEMV_ACCUM
// Gathered GEMV over a stack of equal matrices w [n_experts, n, k] (a mixture of experts): one
// launch for `gridDim.y` slots, slot s = blockIdx.y multiplying expert experts[s] (null: expert 0)
// by x row s / x_group into y + s * y_stride, with this variant's epilogue (SwiGLU: n / 2
// outputs). Decode: the slots are the router's top-k, written to `experts` by moe_topk, so no
// host sync is needed per token; prefill's router: null experts, x_group 1, a slot per token.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_bf16_experts(const bf16_t* __restrict__ w, const int* __restrict__ experts, int n_experts,
                  const float* __restrict__ x, int x_group, float* __restrict__ y, int y_stride, int n, int k) {
    pdl_wait();  // the expert index is the previous kernel's output (gemv_rows waits again: a no-op)
    const int s = blockIdx.y;
    const int e = experts ? min(max(__ldcg(experts + s), 0), n_experts - 1) : 0;
    gemv_body<false, false, false>(w + (size_t)e * n * k, x + (size_t)(s / x_group) * k, y + (size_t)s * y_stride,
                                   n, k, GemvFuse{});
}
#endif
#endif  // GEMV_DENSE
#else
// The q/k/v GEMV with RoPE and the KV append (n = q_dim + 2 kv_dim rows); ss: null, or the input
// arrives as x ∘ g with ss[0] = Σ x² (as for gemv_bf16_prenorm).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_bf16_rope(const bf16_t* __restrict__ w, const float* __restrict__ x, int n, int k, const unsigned long long* ss,
               float eps,
               const float* bias, float* q_out, bf16_t* k_cache, bf16_t* v_cache, const int* pos,
               const float* cos_sin, int n_q_heads, int n_kv_heads, int head_dim, int interleaved, int max_seq) {
    GemvFuse f{};
    f.ss_in = ss;
    f.eps = eps;
    f.rope = RopeArgs{bias, q_out, k_cache, v_cache, pos, cos_sin, n_q_heads, n_kv_heads, head_dim, interleaved, max_seq};
    if (ss) gemv_body<false, true, false>(w, x, nullptr, n, k, f);
    else gemv_body<false, false, false>(w, x, nullptr, n, k, f);
}
#endif

// Code i (0..15) of the palette as a kernel argument (four little-endian words).
__device__ __forceinline__ unsigned char pal4_code(uint4 pal, int i) {
    const u32 w = i < 8 ? (i < 4 ? pal.x : pal.y) : (i < 12 ? pal.z : pal.w);
    return (unsigned char)(w >> (8 * (i & 3)));
}

#if !GEMV_ROPE
#if GEMV_DENSE
// s: f32 [n] row scales.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_fp8(const unsigned char* __restrict__ w, const float* __restrict__ s, const float* __restrict__ x,
         float* __restrict__ y, int n, int k) {
    GemvFuse f{};
    f.row_scale = s;
    gemv_body<false, false, false, WFMT_FP8>(w, x, y, n, k, f);
}

// y = diag(s) · W · rmsnorm(x; g, eps) (g f32 [k]).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_fp8_norm(const unsigned char* __restrict__ w, const float* __restrict__ s,
              const float* __restrict__ x, const float* __restrict__ g, float* __restrict__ y, int n,
              int k, float eps) {
    GemvFuse f{};
    f.row_scale = s;
    f.g = g;
    f.eps = eps;
    gemv_body<true, false, false, WFMT_FP8>(w, x, y, n, k, f);
}

// y = rsqrt(ss[0] / k + eps) · diag(s) · W h, with h = x ∘ g and ss[0] = Σ x² from the producing
// GEMV (as gemv_bf16_prenorm).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_fp8_prenorm(const unsigned char* __restrict__ w, const float* __restrict__ s, const float* __restrict__ h,
                 const unsigned long long* ss, float* __restrict__ y, int n, int k, float eps) {
    GemvFuse f{};
    f.row_scale = s;
    f.ss_in = ss;
    f.eps = eps;
    gemv_body<false, true, false, WFMT_FP8>(w, h, y, n, k, f);
}

#if GEMV_ACCUM && !GEMV_SWIGLU
// y += diag(s) · W x, then the next RMSNorm's input (as gemv_bf16_accum_norm).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_fp8_accum_norm(const unsigned char* __restrict__ w, const float* __restrict__ s, const float* __restrict__ x,
                    float* __restrict__ y, int n, int k, const float* g_next, float* h_out,
                    unsigned long long* ss_out) {
    GemvFuse f{};
    f.row_scale = s;
    f.g_next = g_next;
    f.h_out = h_out;
    f.ss_out = ss_out;
    gemv_body<false, false, true, WFMT_FP8>(w, x, y, n, k, f);
}
#endif
#endif  // GEMV_DENSE

// Palette-packed FP8 on the tensor cores (gemv_pal4*; codec palette::Palette4: an FP8 matrix as
// 4-bit indices into 16 codes plus per-row escapes, in tiles of 16 rows × blocks of 64 columns
// stored as the A fragments of mma.m16n8k16 BF16 products). A byte of indices is a pair of weights
// and indexes a shared table of the 256 pairs' values as bf16x2 (every E4M3 value is a BF16
// value): the looked-up word is the A register as it stands, so a pair costs one byte_perm (the
// byte · 256 + the lane's copy: the address) and one conflict-free lookup — no conversion and no
// FMA; the tensor core does the products. x goes in as two BF16 halves, x = hi + lo to within
// 2^-18 |x|, B columns 0 and 1 (lanes 0-3 and 4-7); the other columns repeat hi and are ignored.
// (The CUDA-core version, a lookup and a conversion and an FMA a weight, was issue-bound at 1.03×
// the dense FP8 GEMV: bench/RESULTS.md.)
// A block is persistent; its warps form groups, each on a pair of tiles at a time (gemv_pal4_body),
// with GEMV_UNROLL column blocks in flight a warp, the next batch — of the next pair at the end of
// one — loaded before the current one is multiplied; partial sums are added in shared memory in a
// fixed order.
// Shared memory (dynamic only): the pair table (256 entries × 256 bytes: 32 lane copies of 4,
// padded so that an entry's offset is the pair byte shifted by a whole byte), the warps' sums,
// then x's two BF16 halves (2 k bytes each); ops/gemv_fp8.rs (pal4_shared_bytes) sizes it. The
// dynamic region of a kernel without static shared memory starts right after the 1 KiB sm_90
// reserves (PAL4_BASE, checked at run time), so the table's address is a constant the lookups
// fold into their load: a lookup is one byte_perm and one load.
// PAL4_BF16: the palette holds the high bytes of BF16 values (sign, seven exponent bits) and the
// low bytes come as stored, in a parallel stream (codec palette::PaletteBf16, lossless): a table
// entry is a pair's high bytes in place, one more byte_perm merges the pair's low bytes — the A
// register. No row scales; escapes carry whole BF16 values.
#ifndef PAL4_BF16
#define PAL4_BF16 0
#endif
#define PAL4_BASE 1024u
#define PAL4_TAB_STRIDE 256
#define PAL4_TAB_BYTES (256 * PAL4_TAB_STRIDE)
#define PAL4_PAIR_ROWS (2 * PAL4_TILE_ROWS)  // a group works on two tiles at once: one B, two As
#define PAL4_SUMS_BYTES ((2 * (GEMV_WARPS + GEMV_ROWS) * PAL4_PAIR_ROWS + GEMV_WARPS) * 4)
#define PAL4_SUMS_ALIGNED ((PAL4_SUMS_BYTES + 15) / 16 * 16)
extern __shared__ __align__(16) unsigned char pal4_smem[];

__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ uint4 lds_u4(u32 a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ u32 lds_u32(u32 a) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
}
__device__ __forceinline__ void sts_u32(u32 a, u32 v) { asm volatile("st.shared.u32 [%0], %1;" ::"r"(a), "r"(v)); }
__device__ __forceinline__ void sts_u4(u32 a, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// Fills the table from the 16 codes: entry b holds codes b & 15 (low half) and b >> 4, 32 times.
// The codes come as a kernel argument, not from global memory: the fill, and the x staging after
// it, do not wait for a memory round trip.
__device__ __forceinline__ void pal4_fill_table(uint4 pal) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) {
#if PAL4_BF16
        const u32 v = (u32)pal4_code(pal, b & 15) << 8 | (u32)pal4_code(pal, b >> 4) << 24;
#else
        const u32 v = (u32)f32_to_bf16(e4m3_to_f32(pal4_code(pal, b & 15))) |
                      (u32)f32_to_bf16(e4m3_to_f32(pal4_code(pal, b >> 4))) << 16;
#endif
#pragma unroll
        for (int c = 0; c < 8; ++c) sts_u4(PAL4_BASE + b * PAL4_TAB_STRIDE + 16 * c, make_uint4(v, v, v, v));
    }
}

// (lo, hi) rounded to BF16 (nearest even), lo in the low half.
__device__ __forceinline__ u32 bf16x2_rn(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The byte offset, in each BF16 half of the staged x, of the word holding column c (even: the low
// half; odd: the high one) — the B-fragment order pal4_fill_x describes.
__device__ __forceinline__ u32 pal4_x_word(u32 c) {
    const u32 w = c & (PAL4_BLOCK_COLS - 1);
    return 4u * ((c / PAL4_BLOCK_COLS) * 32 + ((w >> 1) & 3) * 8 + 2 * (w >> 4) + ((w >> 3) & 1));
}

// Column c of the staged x (NORM: of x ∘ g), hi + lo: what the products use.
__device__ __forceinline__ float pal4_x_at(u32 x_hi, u32 x_lo, u32 c) {
    const u32 at = pal4_x_word(c), h = lds_u32(x_hi + at), l = lds_u32(x_lo + at);
    return (c & 1) ? bf16_hi(h) + bf16_hi(l) : bf16_lo(h) + bf16_lo(l);
}

// Writes x (NORM: x ∘ g) as BF16 halves in B-fragment order: for column block b and quad position
// q (lane % 4), 8 words of each half at word 32 b + 8 q of the half: K step s's two registers at
// 2 s and 2 s + 1 (columns 16 s + 2 q, +1 and 16 s + 8 + 2 q, +1). Four columns a thread and step
// (two pairs: quad positions q and q + 1). Returns this thread's Σ x² (NORM).
template <bool NORM>
__device__ __forceinline__ float pal4_fill_x(const float* __restrict__ x, const float* __restrict__ g, int k,
                                             u32 x_hi, u32 x_lo) {
    float ss = 0.0f;
    for (int p = threadIdx.x; p < k / 4; p += blockDim.x) {
        float4 v = __ldcg((const float4*)x + p);
        if (NORM) {
            ss = fmaf(v.x, v.x, ss);
            ss = fmaf(v.y, v.y, ss);
            ss = fmaf(v.z, v.z, ss);
            ss = fmaf(v.w, v.w, ss);
            const float4 gg = __ldg((const float4*)g + p);
            v.x *= gg.x;
            v.y *= gg.y;
            v.z *= gg.z;
            v.w *= gg.w;
        }
        const u32 h0 = bf16x2_rn(v.x, v.y), h1 = bf16x2_rn(v.z, v.w);
        const u32 l0 = bf16x2_rn(v.x - bf16_lo(h0), v.y - bf16_hi(h0));
        const u32 l1 = bf16x2_rn(v.z - bf16_lo(h1), v.w - bf16_hi(h1));
        const u32 at = pal4_x_word(4 * p);
        sts_u32(x_hi + at, h0);
        sts_u32(x_hi + at + 32, h1);
        sts_u32(x_lo + at, l0);
        sts_u32(x_lo + at + 32, l1);
    }
    return ss;
}

// This lane's index words of GEMV_UNROLL column blocks kb, kb + S, ... of the two tiles of a pair
// (p: the first tile's block kb; the second's is a tile further, `tile_words` on), for a group of
// S warps; `valid`: the pair exists, `second`: its second tile does. Blocks past the end of a pair
// load `safe` instead (any valid address; never multiplied): unconditional loads, so the compiler
// keeps no old values around. No pair (the group's last one was the current): no loads at all —
// a batch loaded for nothing kept every block waiting on a memory round trip at its end (with this
// and the escape offsets held in registers, the 8B FP8 decode went from 475.8 to 522.5 tok/s:
// bench/RESULTS.md, session 11).
// PAL4_BF16: also the lane's low bytes (lo: the stream's base; idx: the indices' base, so that
// p's offset locates them: two 16-byte words a lane and block, where the indices have one).
#if PAL4_BF16
#define PAL4_LO 2
#else
#define PAL4_LO 1  // (unused)
#endif
template <int S>
__device__ __forceinline__ void pal4_load(uint4 (&v)[GEMV_UNROLL][2], uint4 (&vl)[GEMV_UNROLL][2][PAL4_LO],
                                          const uint4* idx, const uint4* lo, const uint4* p, size_t tile_words,
                                          bool valid, bool second, int kb, int nkb, const uint4* safe) {
    if (!valid) {
        const uint4 z = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                v[u][t] = z;
#pragma unroll
                for (int i = 0; i < PAL4_LO; ++i) vl[u][t][i] = z;
            }
        return;
    }
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
        const bool ok = kb + u * S < nkb;
        const uint4* p0 = ok ? p + u * S * 32 : safe;
        const uint4* p1 = ok && second ? p + tile_words + u * S * 32 : safe;
        v[u][0] = ld_stream_u4(p0);
        v[u][1] = ld_stream_u4(p1);
#if PAL4_BF16
        // Low bytes of the block: at twice the index word's offset (two words a lane where the
        // indices have one).
        const uint4* l0 = lo + 2 * (p0 - idx);
        const uint4* l1 = lo + 2 * (p1 - idx);
        vl[u][0][0] = ld_stream_u4(l0);
        vl[u][0][1] = ld_stream_u4(l0 + 1);
        vl[u][1][0] = ld_stream_u4(l1);
        vl[u][1][1] = ld_stream_u4(l1 + 1);
#endif
    }
}

// The table entry at offset `off` (PAL4_BASE folded into the load).
__device__ __forceinline__ u32 pal4_entry(u32 off) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1+1024];" : "=r"(v) : "r"(off));
    return v;
}

// One K step: c += A(word) · B(b0, b1). The pair of byte j of word sits at table offset
// byte_perm(word, lane4, 0x55j4) = 256 · byte + 4 · lane (lane4 = 4 lane).
// PAL4_BF16: lo0, lo1 the four pairs' low bytes (pair i at bytes 2 i % 4, + 1 of word i / 2),
// merged into bytes 0 and 2 of each looked-up entry.
__device__ __forceinline__ void pal4_mma(u32 word, u32 lo0, u32 lo1, u32 b0, u32 b1, u32 lane4, float (&c)[4]) {
    u32 a0 = pal4_entry(__byte_perm(word, lane4, 0x5504)), a1 = pal4_entry(__byte_perm(word, lane4, 0x5514));
    u32 a2 = pal4_entry(__byte_perm(word, lane4, 0x5524)), a3 = pal4_entry(__byte_perm(word, lane4, 0x5534));
#if PAL4_BF16
    a0 = __byte_perm(a0, lo0, 0x3514);
    a1 = __byte_perm(a1, lo0, 0x3716);
    a2 = __byte_perm(a2, lo1, 0x3514);
    a3 = __byte_perm(a3, lo1, 0x3716);
#endif
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A column block of both tiles of a pair (four K steps, each B fragment used twice; two
// accumulator sets a tile so consecutive products do not wait on each other). xb: the shared
// address of this lane's B words of the block.
// PAL4_BF16: wl the tiles' low bytes (K step s: words 2 s, 2 s + 1 of the lane's eight).
__device__ __forceinline__ void pal4_block(const uint4 (&w)[2], const uint4 (&wl)[2][PAL4_LO], u32 xb, u32 lane4,
                                           float (&acc)[2][2][4]) {
    const uint4 b01 = lds_u4(xb), b23 = lds_u4(xb + 16);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        pal4_mma(w[t].x, wl[t][0].x, wl[t][0].y, b01.x, b01.y, lane4, acc[t][0]);
        pal4_mma(w[t].y, wl[t][0].z, wl[t][0].w, b01.z, b01.w, lane4, acc[t][1]);
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        pal4_mma(w[t].z, wl[t][PAL4_LO - 1].x, wl[t][PAL4_LO - 1].y, b23.x, b23.y, lane4, acc[t][0]);
        pal4_mma(w[t].w, wl[t][PAL4_LO - 1].z, wl[t][PAL4_LO - 1].w, b23.z, b23.w, lane4, acc[t][1]);
    }
}

// y = diag(s) · W · x' with x' = x, or rmsnorm(x; g, eps) (NORM), and the GEMV_ACCUM / GEMV_SWIGLU
// epilogue. The block's warps form GEMV_ROWS groups, each working on its own pair of tiles (32
// rows) at a time, its warps splitting the column blocks, then adding their sums at the group's
// barrier; as few warps a pair as keep the GPU busy, so that a warp's share — its column blocks
// between two barriers — is long (ops/gemv_fp8.rs: pal4_config_for).
#define PAL4_GROUPS GEMV_ROWS
#define PAL4_GROUP_WARPS (GEMV_WARPS / PAL4_GROUPS)
// The palette kernels exist in the variants whose warps split into whole groups of at most 15
// (named barriers 1..15; ops/gemv_fp8.rs launches no other).
#if GEMV_WARPS % PAL4_GROUPS == 0 && PAL4_GROUPS <= 15

// Waits for the group's warps (named barrier 1 + group; a one-warp group needs none).
__device__ __forceinline__ void pal4_group_sync(int group) {
    if (PAL4_GROUP_WARPS > 1) asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(PAL4_GROUP_WARPS * 32) : "memory");
    else __syncwarp();
}

template <bool NORM>
__device__ __forceinline__ void gemv_pal4_body(const uint4* __restrict__ idx, uint4 pal,
                                               const u32* __restrict__ esc_ptr, const u32* __restrict__ esc,
                                               const uint4* __restrict__ lo,
                                               const float* __restrict__ rs, const float* __restrict__ x,
                                               const float* __restrict__ g, float* __restrict__ y, int n, int k,
                                               float eps) {
    constexpr int S = PAL4_GROUP_WARPS, R = PAL4_PAIR_ROWS;
    unsigned char* sums = pal4_smem + PAL4_TAB_BYTES;
    float(*red)[GEMV_WARPS][R] = (float(*)[GEMV_WARPS][R])sums;  // [2]: double-buffered
    float(*esc_red)[PAL4_GROUPS][R] = (float(*)[PAL4_GROUPS][R])(sums + 2 * GEMV_WARPS * R * 4);
    float* ss_red = (float*)(sums + 2 * (GEMV_WARPS + PAL4_GROUPS) * R * 4);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, group = warp / S, wi = warp % S;
    const int nkb = k / PAL4_BLOCK_COLS, ntiles = (n + PAL4_TILE_ROWS - 1) / PAL4_TILE_ROWS;
    const int npairs = (ntiles + 1) / 2;
    const u32 x_hi = PAL4_BASE + PAL4_TAB_BYTES + PAL4_SUMS_ALIGNED, x_lo = x_hi + 2u * k;
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (smem_addr(pal4_smem) != PAL4_BASE || x_lo + 2u * k - PAL4_BASE > dyn) __trap();  // a launch bug
    const u32 lane4 = 4u * lane;
    // This lane's B column is lane / 4: the low half for lanes 4-7, the high one elsewhere.
    const u32 xq = ((lane >> 2) == 1 ? x_lo : x_hi) + 32u * (lane & 3);
    // RMSNorm's weights (immutable) into L1 now, so that staging x after pdl_wait waits for x alone.
    if (NORM)
        for (int i = 32 * threadIdx.x; i < k; i += 32 * blockDim.x) prefetch_l1(g + i);
    pal4_fill_table(pal);
    int pair = blockIdx.x * PAL4_GROUPS + group;
    const int pair_step = gridDim.x * PAL4_GROUPS;
    // p: this warp's next column block (of the pair's first tile); p_pair: its first one of the
    // current pair.
    const size_t tile_words = (size_t)nkb * 32;
    const uint4* p_pair = idx + 2 * (size_t)pair * tile_words + wi * 32 + lane;
    const size_t pair_stride = 2 * (size_t)pair_step * tile_words;
    const uint4* p = p_pair;
    const uint4* safe = idx + lane;
    uint4 next[GEMV_UNROLL][2], next_lo[GEMV_UNROLL][2][PAL4_LO];
    // Weights are immutable: the first batch loaded and the first pair's escape range requested
    // before pdl_wait (the range is used after x is staged). (Prefetching further batches into L2
    // here measured slower: bench/RESULTS.md, session 8.)
    pal4_load<S>(next, next_lo, idx, lo, p, tile_words, pair < npairs, 2 * pair + 1 < ntiles, wi, nkb, safe);
    u32 esc_begin = 0, esc_end = 0;
    if (pair < npairs && wi == 0) {
        esc_begin = __ldg(esc_ptr + pair * R);
        esc_end = __ldg(esc_ptr + min(pair * R + R, n));
    }
    pdl_wait();
    pdl_trigger();
    float ss = pal4_fill_x<NORM>(x, g, k, x_hi, x_lo);
    // The first pair's escapes into L1 (a 128-byte line a lane), read in its epilogue.
    for (u32 i = (esc_begin & ~31u) + 32u * lane; i < esc_end; i += 32u * 32u) prefetch_l1(esc + i);
    if (NORM) {
        ss = warp_sum(ss);
        if (lane == 0) ss_red[warp] = ss;
    }
    __syncthreads();
    float scale = 1.0f;
    if (NORM) {
        float t = 0.0f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; ++w) t += ss_red[w];
        scale = rsqrtf(t / (float)k + eps);
    }
    for (int buf = 0; pair < npairs; pair += pair_step, buf ^= 1) {
        // What the epilogue reads besides the sums, requested now so that its latency hides
        // behind the products: the pair's escape offsets, a row a lane (row0 + lane's and the
        // next row's: the epilogue shuffles them from here), the row scales into L1.
        const int row0 = pair * R;
        const u32 lane_esc_begin = __ldg(esc_ptr + min(row0 + lane, n));
        const u32 lane_esc_end = __ldg(esc_ptr + min(row0 + lane + 1, n));
        // The residual (GEMV_ACCUM) is loaded outright: the add at the end does not wait for it.
        float y_in = 0.0f;
        if (wi == 0) {
            if (!PAL4_BF16) prefetch_l1(rs + min(row0 + lane, n - 1));
            if (GEMV_ACCUM && row0 + lane < n) y_in = __ldcg(y + row0 + lane);
        }
        float acc[2][2][4] = {};
        // Whole batches followed by another of this pair (no bounds checks but the next batch's
        // own), then the pair's last batch (the next one: the group's next pair's first).
        int kb = wi;
        const bool second = 2 * pair + 1 < ntiles;
        for (; kb + S * GEMV_UNROLL < nkb; kb += S * GEMV_UNROLL) {
            uint4 cur[GEMV_UNROLL][2], cur_lo[GEMV_UNROLL][2][PAL4_LO];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                cur[u][0] = next[u][0], cur[u][1] = next[u][1];
                if (PAL4_BF16)
#pragma unroll
                    for (int i = 0; i < PAL4_LO; ++i) cur_lo[u][0][i] = next_lo[u][0][i], cur_lo[u][1][i] = next_lo[u][1][i];
            }
            p += S * GEMV_UNROLL * 32;
            pal4_load<S>(next, next_lo, idx, lo, p, tile_words, true, second, kb + S * GEMV_UNROLL, nkb, safe);
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) pal4_block(cur[u], cur_lo[u], xq + 128u * (kb + u * S), lane4, acc);
        }
        {
            uint4 cur[GEMV_UNROLL][2], cur_lo[GEMV_UNROLL][2][PAL4_LO];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                cur[u][0] = next[u][0], cur[u][1] = next[u][1];
                if (PAL4_BF16)
#pragma unroll
                    for (int i = 0; i < PAL4_LO; ++i) cur_lo[u][0][i] = next_lo[u][0][i], cur_lo[u][1][i] = next_lo[u][1][i];
            }
            p_pair += pair_stride;
            p = p_pair;
            const int pair2 = pair + pair_step;
            pal4_load<S>(next, next_lo, idx, lo, p, tile_words, pair2 < npairs, 2 * pair2 + 1 < ntiles, wi, nkb, safe);
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                const int b = kb + u * S;
                if (b < nkb) pal4_block(cur[u], cur_lo[u], xq + 128u * b, lane4, acc);
            }
        }
        // Columns 0 (hi) and 1 (lo) of rows lane / 4 and lane / 4 + 8 of each tile are in lanes
        // 4i: c0, c1 and c2, c3.
        if ((lane & 3) == 0) {
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                red[buf][warp][16 * t + (lane >> 2)] = (acc[t][0][0] + acc[t][1][0]) + (acc[t][0][1] + acc[t][1][1]);
                red[buf][warp][16 * t + (lane >> 2) + 8] = (acc[t][0][2] + acc[t][1][2]) + (acc[t][0][3] + acc[t][1][3]);
            }
        }
        // Escaped weights were multiplied as zeros: their values, a row a warp (times x as the
        // products see it: its staged halves).
        for (int r = wi; r < R; r += S) {
            // (Rows past the last: begin = end = esc_ptr[n], none.)
            const u32 e_begin = __shfl_sync(0xffffffffu, lane_esc_begin, r);
            const u32 e_end = __shfl_sync(0xffffffffu, lane_esc_end, r);
            float e = 0.0f;
            if (e_begin < e_end) {
                for (u32 i = e_begin + lane; i < e_end; i += 32) {
                    const u32 v = __ldg(esc + i);
#if PAL4_BF16
                    e = fmaf(bf16_to_f32((bf16_t)(v >> 16)), pal4_x_at(x_hi, x_lo, v & 0xffffu), e);
#else
                    e = fmaf(e4m3_to_f32(v >> 24), pal4_x_at(x_hi, x_lo, v & 0xffffffu), e);
#endif
                }
                e = warp_sum(e);
            }
            if (lane == 0) esc_red[buf][group][r] = e;
        }
        pal4_group_sync(group);
        if (wi == 0) {  // the pair's 32 rows, a lane each
            const int row = row0 + lane;
            float sum = esc_red[buf][group][lane];
#pragma unroll
            for (int w = 0; w < S; ++w) sum += red[buf][group * S + w][lane];
            const float v = sum * scale * (PAL4_BF16 ? 1.0f : __ldg(rs + min(row, n - 1)));
#if GEMV_SWIGLU
            const float up = __shfl_down_sync(0xffffffffu, v, 1);
            if ((lane & 1) == 0 && row + 1 < n) y[row >> 1] = v / (1.0f + expf(-v)) * up;
#else
            if (row < n) y[row] = GEMV_ACCUM ? y_in + v : v;
#endif
        }
    }
}

// Palette-packed FP8: idx the tiles (Palette4::indices), pal the 16 codes (by value), esc_ptr
// u32 [n + 1] and esc u32 the escapes (col | code << 24), s f32 [n] row scales; k % 64 == 0.
// Dynamic shared memory PAL4_TAB_BYTES + PAL4_SUMS_ALIGNED + 4 k; grid at most the tile pairs over
// the groups, at most what fits at once. With one column block of a pair in flight a warp and no epilogue,
// registers are capped for two blocks an SM (where shared memory allows: k up to about 12 000);
// more would spill.
#define PAL4_MIN_BLOCKS (GEMV_UNROLL == 1 && !GEMV_ACCUM && !GEMV_SWIGLU && !PAL4_BF16 ? 2 : 1)
#if !PAL4_BF16
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, PAL4_MIN_BLOCKS)
gemv_pal4(const uint4* __restrict__ idx, uint4 pal, const u32* __restrict__ esc_ptr,
          const u32* __restrict__ esc, const float* __restrict__ s, const float* __restrict__ x,
          float* __restrict__ y, int n, int k) {
    gemv_pal4_body<false>(idx, pal, esc_ptr, esc, nullptr, s, x, nullptr, y, n, k, 0.0f);
}

// y = diag(s) · W · rmsnorm(x; g, eps) (g f32 [k]), W palette-packed.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, PAL4_MIN_BLOCKS)
gemv_pal4_norm(const uint4* __restrict__ idx, uint4 pal,
               const u32* __restrict__ esc_ptr, const u32* __restrict__ esc, const float* __restrict__ s,
               const float* __restrict__ x, const float* __restrict__ g, float* __restrict__ y, int n,
               int k, float eps) {
    gemv_pal4_body<true>(idx, pal, esc_ptr, esc, nullptr, s, x, g, y, n, k, eps);
}
#else
// BF16 palette-packed (PaletteBf16): lo the low bytes; escapes col | bits << 16; no row scales.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, PAL4_MIN_BLOCKS)
gemv_pal4_bf16(const uint4* __restrict__ idx, uint4 pal, const u32* __restrict__ esc_ptr,
               const u32* __restrict__ esc, const uint4* __restrict__ lo, const float* __restrict__ x,
               float* __restrict__ y, int n, int k) {
    gemv_pal4_body<false>(idx, pal, esc_ptr, esc, lo, nullptr, x, nullptr, y, n, k, 0.0f);
}

// y = W · rmsnorm(x; g, eps), W BF16 palette-packed.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, PAL4_MIN_BLOCKS)
gemv_pal4_bf16_norm(const uint4* __restrict__ idx, uint4 pal, const u32* __restrict__ esc_ptr,
                    const u32* __restrict__ esc, const uint4* __restrict__ lo, const float* __restrict__ x,
                    const float* __restrict__ g, float* __restrict__ y, int n, int k, float eps) {
    gemv_pal4_body<true>(idx, pal, esc_ptr, esc, lo, nullptr, x, g, y, n, k, eps);
}
#endif
#endif  // whole groups
#endif  // !GEMV_ROPE: the FP8 and palette GEMVs have no RoPE epilogue

// out = bf16(fp8(W) · s[row]) for the prefill GEMM: W FP8 E4M3 [rows, cols] (cols % 4 == 0), four
// weights per thread and step. The f32 product rounded to nearest even, as the CPU reference.
extern "C" __global__ void fp8_rows_to_bf16(const unsigned char* __restrict__ w, const float* __restrict__ s,
                                            bf16_t* __restrict__ out, long long n4, int cols4) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (long long)gridDim.x * blockDim.x) {
        const float sc = s[i / cols4];
        const float4 f = e4m3x4_to_f32x4(((const u32*)w)[i]);
        uint2 o;
        o.x = (u32)f32_to_bf16(f.x * sc) | (u32)f32_to_bf16(f.y * sc) << 16;
        o.y = (u32)f32_to_bf16(f.z * sc) | (u32)f32_to_bf16(f.w * sc) << 16;
        ((uint2*)out)[i] = o;
    }
}

// out = bf16(fp8(W) · s[row]) from the palette form, as fp8_rows_to_bf16 from the codes: a word of
// indices (one K step of one lane: four pairs) a thread, grid-strided over the tiles; then
// pal4_escapes_to_bf16 overwrites the escaped weights. rows: the matrix's (the tiles' padding rows
// are skipped); cols % 64 == 0.
extern "C" __global__ void pal4_rows_to_bf16(const u32* __restrict__ idx, uint4 pal, const float* __restrict__ s,
                                             bf16_t* __restrict__ out, long long words, int rows, int cols) {
    __shared__ float val[16];
    if (threadIdx.x < 16) val[threadIdx.x] = e4m3_to_f32(pal4_code(pal, threadIdx.x));
    __syncthreads();
    const int nkb = cols / PAL4_BLOCK_COLS;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < words;
         i += (long long)gridDim.x * blockDim.x) {
        // Word i: column block i / 128 (tile-major), lane t = i / 4 % 32, K step i % 4.
        const long long blk = i >> 7, tile = blk / nkb;
        const int b = (int)(blk - tile * nkb), t = (int)(i >> 2) & 31, st = (int)i & 3;
        const u32 w = idx[i];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const long long row = tile * PAL4_TILE_ROWS + (t >> 2) + 8 * (j & 1);
            if (row >= rows) continue;
            const int col = b * PAL4_BLOCK_COLS + 16 * st + 8 * (j >> 1) + 2 * (t & 3);
            const float sc = s[row];
            const u32 p = w >> (8 * j);
            *(u32*)(out + row * cols + col) = (u32)f32_to_bf16(val[p & 15] * sc) | (u32)f32_to_bf16(val[(p >> 4) & 15] * sc) << 16;
        }
    }
}

// out = W (BF16 bits) from the BF16 palette form (codec PaletteBf16: high bytes by index, low bytes
// as stored, lo: lane t's 32 bytes at 32 t of each 1 KiB block, so the two low-byte words of index
// word i are lo[2 i], lo[2 i + 1]), in pal4_rows_to_bf16's order; then pal4_bf16_escapes_to_bf16
// writes the escaped values.
extern "C" __global__ void pal4_bf16_rows_to_bf16(const u32* __restrict__ idx, uint4 pal, const u32* __restrict__ lo,
                                                  bf16_t* __restrict__ out, long long words, int rows, int cols) {
    __shared__ u32 high[16];
    if (threadIdx.x < 16) high[threadIdx.x] = (u32)pal4_code(pal, threadIdx.x) << 8;
    __syncthreads();
    const int nkb = cols / PAL4_BLOCK_COLS;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < words;
         i += (long long)gridDim.x * blockDim.x) {
        const long long blk = i >> 7, tile = blk / nkb;
        const int b = (int)(blk - tile * nkb), t = (int)(i >> 2) & 31, st = (int)i & 3;
        const u32 w = idx[i], l01 = lo[2 * i], l23 = lo[2 * i + 1];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const long long row = tile * PAL4_TILE_ROWS + (t >> 2) + 8 * (j & 1);
            if (row >= rows) continue;
            const int col = b * PAL4_BLOCK_COLS + 16 * st + 8 * (j >> 1) + 2 * (t & 3);
            const u32 p = w >> (8 * j), l = ((j >> 1) ? l23 : l01) >> (16 * (j & 1));
            *(u32*)(out + row * cols + col) = (high[p & 15] | (l & 0xff)) | (high[(p >> 4) & 15] | (l >> 8 & 0xff)) << 16;
        }
    }
}

// The escaped values of pal4_bf16_rows_to_bf16's output (col | bits << 16), one row a thread.
extern "C" __global__ void pal4_bf16_escapes_to_bf16(const u32* __restrict__ esc_ptr, const u32* __restrict__ esc,
                                                     bf16_t* __restrict__ out, int rows, int cols) {
    for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x)
        for (u32 e = esc_ptr[r]; e < esc_ptr[r + 1]; ++e) {
            const u32 v = esc[e];
            out[(size_t)r * cols + (v & 0xffffu)] = (bf16_t)(v >> 16);
        }
}

// The escaped weights of pal4_rows_to_bf16's output, one row a thread.
extern "C" __global__ void pal4_escapes_to_bf16(const u32* __restrict__ esc_ptr, const u32* __restrict__ esc,
                                                const float* __restrict__ s, bf16_t* __restrict__ out,
                                                int rows, int cols) {
    for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {
        const float sc = s[r];
        for (u32 e = esc_ptr[r]; e < esc_ptr[r + 1]; ++e) {
            const u32 v = esc[e];
            out[(size_t)r * cols + (v & 0xffffffu)] = f32_to_bf16(e4m3_to_f32(v >> 24) * sc);
        }
    }
}
