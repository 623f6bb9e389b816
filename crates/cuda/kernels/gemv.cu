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
static_assert(!GEMV_SWIGLU || GEMV_ROWS % 2 == 0, "GEMV_SWIGLU needs an even GEMV_ROWS");
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

// Palette-packed FP8 (gemv_pal4*: an FP8 matrix as 4-bit indices into a 16-code palette, two a byte,
// in lane order, plus an escape list; codec `palette::Palette4`). One byte of indices is a pair of
// weights: pal4_tab holds the pair's two values as f16x2 (every E4M3 value is an F16 value) for each
// of the 256 bytes, 32 times over with copy l in bank l, so a warp's 32 lookups (any bytes) are one
// conflict-free shared-memory wavefront. 32 KB, built once per (persistent) block. (An f32 table —
// no conversion, 16 copies, two wavefronts a lookup — measured 2.5 % slower over a Llama-8B layer.)
#define PAL4_ENTRIES 256
#define PAL4_STRIDE_LOG2 7  // bytes between a copy's entries: 4 · 32 copies
__shared__ u32 pal4_tab[PAL4_ENTRIES * 32];

// Fills pal4_tab from the palette's 16 codes (global memory) and waits for the block; call before any
// early exit. A thread writes whole entries (all copies: 128 contiguous bytes).
__device__ __forceinline__ void pal4_fill(const unsigned char* __restrict__ pal) {
    for (int b = threadIdx.x; b < PAL4_ENTRIES; b += blockDim.x) {
        const unsigned short codes = (unsigned short)(pal[b & 15] | pal[b >> 4] << 8);
        u32 h2;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(codes));
        uint4* dst = (uint4*)(pal4_tab + b * 32);
#pragma unroll
        for (int c = 0; c < 8; ++c) dst[c] = make_uint4(h2, h2, h2, h2);
    }
    __syncthreads();
}

// The pair at byte offset `off` of pal4_tab, as two floats.
__device__ __forceinline__ float2 pal4_at(u32 off) {
    const u32 h2 = *(const u32*)((const char*)pal4_tab + off);
    float2 f;
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;\n\t}"
        : "=f"(f.x), "=f"(f.y)
        : "r"(h2));
    return f;
}

// Eight weights (one word of indices: four pair bytes) against x[0..8) = (a, b). lane_off = the
// lane's copy (4 · lane); each pair's offset is one shift and one and-or of the word.
__device__ __forceinline__ float dot8_pal4(u32 w, float4 a, float4 b, u32 lane_off, float acc) {
    constexpr u32 M = 0xffu << PAL4_STRIDE_LOG2;
    float2 p = pal4_at(((w << PAL4_STRIDE_LOG2) & M) | lane_off);
    acc = fmaf(p.x, a.x, acc);
    acc = fmaf(p.y, a.y, acc);
    p = pal4_at(((w >> (8 - PAL4_STRIDE_LOG2)) & M) | lane_off);
    acc = fmaf(p.x, a.z, acc);
    acc = fmaf(p.y, a.w, acc);
    p = pal4_at(((w >> (16 - PAL4_STRIDE_LOG2)) & M) | lane_off);
    acc = fmaf(p.x, b.x, acc);
    acc = fmaf(p.y, b.y, acc);
    p = pal4_at(((w >> (24 - PAL4_STRIDE_LOG2)) & M) | lane_off);
    acc = fmaf(p.x, b.z, acc);
    acc = fmaf(p.y, b.w, acc);
    return acc;
}

// Weight storage of gemv_body.
#define WFMT_BF16 0  // BF16 [n, k], 8 weights a 16-byte chunk
#define WFMT_FP8 1   // FP8 E4M3 [n, k] with per-row scales, 16 weights a chunk
#define WFMT_PAL4 2  // palette-packed FP8 with per-row scales and escapes, 32 weights a chunk

// What the fused variants read and write besides w, x and y.
struct GemvFuse {
    const float* row_scale;  // FP8, PAL4: per-row scales of the weights
    // PAL4: escapes of row r at esc[esc_ptr[r] .. esc_ptr[r + 1]), each col | code << 24.
    const u32* esc_ptr;
    const u32* esc;
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

// WFMT: the weight storage (WFMT_*). PAL4 needs pal4_fill first.
// gemv_rows: the GEMV_ROWS rows from row0 of one warp.
template <bool NORM, bool PRENORM, bool NEXTNORM, int WFMT>
__device__ __forceinline__ void gemv_rows(const void* __restrict__ w, const float* __restrict__ x,
                                          float* __restrict__ y, int n, int k, const GemvFuse& f, int row0) {
    static_assert(!NEXTNORM || GEMV_ACCUM, "NEXTNORM is the epilogue of an accumulating GEMV");
    const int lane = threadIdx.x & 31;
    if (row0 >= n) return;
    constexpr bool FP8 = WFMT == WFMT_FP8, PAL4 = WFMT == WFMT_PAL4, SCALED = FP8 || PAL4;
    const u32 lane_off = 4u * lane;  // PAL4: the lane's copy of pal4_tab
    constexpr int XQ = PAL4 ? 8 : FP8 ? 4 : 2;  // float4s of x per 16-byte weight chunk
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
    for (int r = 0; r < GEMV_ROWS; ++r) rows[r] = (const uint4*)((const char*)w + (size_t)ri[r] * k * (PAL4 ? 1 : FP8 ? 2 : 4) / 2);
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
                    // PAL4 chunks are in lane order (codec palette::column_of): group q of the
                    // chunks of a 1024-column block is one contiguous run of x over the lanes.
                    const int cb = c & ~31;
                    const int xi = PAL4 ? cb * 8 + q * min(32, chunks - cb) + (c & 31) : XQ * c + q;
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
                    if (PAL4) {
                        float a = acc[r];
                        a = dot8_pal4(wv[u][r].x, xq[0], xq[1], lane_off, a);
                        a = dot8_pal4(wv[u][r].y, xq[2 % XQ], xq[3 % XQ], lane_off, a);
                        a = dot8_pal4(wv[u][r].z, xq[4 % XQ], xq[5 % XQ], lane_off, a);
                        a = dot8_pal4(wv[u][r].w, xq[6 % XQ], xq[7 % XQ], lane_off, a);
                        acc[r] = a;
                    } else if (FP8) {
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
    if (PAL4) {
        // Escaped weights were summed as zeros; add their values (x normalised as above).
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            const u32 end = __ldg(f.esc_ptr + ri[r] + 1);
            for (u32 e = __ldg(f.esc_ptr + ri[r]) + lane; e < end; e += 32) {
                const u32 v = __ldg(f.esc + e), c = v & 0xffffffu;
                float xc = __ldca(x + c);
                if (NORM) xc *= __ldg(f.g + c);
                acc[r] = fmaf(e4m3_to_f32(v >> 24), xc, acc[r]);
            }
        }
    }
    float scale = 1.0f;
    if (NORM) scale = rsqrtf(warp_sum(ss) / (float)k + f.eps);
    if (PRENORM) scale = rsqrtf((float)((double)__ldcg(f.ss_in) * (1.0 / SS_ONE)) / (float)k + f.eps);
    // Per-row weight scales (FP8; rows past the end read the last row's, never stored).
    float rs[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) rs[r] = SCALED ? __ldg(f.row_scale + ri[r]) : 1.0f;
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

// One warp's rows; PAL4 warps walk the row groups in steps of the grid: the launch caps its grid at
// what fits on the GPU at once (persistent blocks, each building pal4_tab once).
template <bool NORM, bool PRENORM, bool NEXTNORM, int WFMT = WFMT_BF16>
__device__ __forceinline__ void gemv_body(const void* __restrict__ w, const float* __restrict__ x,
                                          float* __restrict__ y, int n, int k, const GemvFuse& f) {
    const int row0 = (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * GEMV_ROWS;
    if (WFMT == WFMT_PAL4) {
        for (int r = row0; r < n; r += gridDim.x * GEMV_WARPS * GEMV_ROWS)
            gemv_rows<NORM, PRENORM, NEXTNORM, WFMT>(w, x, y, n, k, f, r);
    } else {
        gemv_rows<NORM, PRENORM, NEXTNORM, WFMT>(w, x, y, n, k, f, row0);
    }
}

#if !GEMV_ROPE
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

#if !GEMV_ROPE
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

// Palette-packed FP8: idx [n, k / 2] bytes (k % 32 == 0), pal the 16 codes, s f32 [n] row scales,
// esc_ptr u32 [n + 1], esc u32 (see GemvFuse).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_pal4(const unsigned char* __restrict__ idx, const unsigned char* __restrict__ pal,
          const u32* __restrict__ esc_ptr, const u32* __restrict__ esc, const float* __restrict__ s,
          const float* __restrict__ x, float* __restrict__ y, int n, int k) {
    pal4_fill(pal);
    GemvFuse f{};
    f.row_scale = s;
    f.esc_ptr = esc_ptr;
    f.esc = esc;
    gemv_body<false, false, false, WFMT_PAL4>(idx, x, y, n, k, f);
}

// y = diag(s) · W · rmsnorm(x; g, eps) (g f32 [k]), W palette-packed.
// Four rows a warp: without a minimum of one block per SM ptxas caps this kernel at 96 registers
// and spills (w4r4u2); with it, it takes what it needs.
#if GEMV_ROWS >= 4
#define PAL4_NORM_BOUNDS __launch_bounds__(GEMV_WARPS * 32, 1)
#else
#define PAL4_NORM_BOUNDS __launch_bounds__(GEMV_WARPS * 32)
#endif
extern "C" __global__ void PAL4_NORM_BOUNDS
gemv_pal4_norm(const unsigned char* __restrict__ idx, const unsigned char* __restrict__ pal,
               const u32* __restrict__ esc_ptr, const u32* __restrict__ esc, const float* __restrict__ s,
               const float* __restrict__ x, const float* __restrict__ g, float* __restrict__ y, int n,
               int k, float eps) {
    pal4_fill(pal);
    GemvFuse f{};
    f.row_scale = s;
    f.esc_ptr = esc_ptr;
    f.esc = esc;
    f.g = g;
    f.eps = eps;
    gemv_body<true, false, false, WFMT_PAL4>(idx, x, y, n, k, f);
}
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

// out = bf16(fp8(W) · s[row]) from the palette form, as fp8_rows_to_bf16 from the codes: words of
// indices (eight weights, two groups of four columns) grid-strided, then pal4_escapes_to_bf16
// overwrites the escaped weights.
extern "C" __global__ void pal4_rows_to_bf16(const u32* __restrict__ idx, const unsigned char* __restrict__ pal,
                                             const float* __restrict__ s, bf16_t* __restrict__ out,
                                             long long n8, int cols8) {
    __shared__ float val[16];
    if (threadIdx.x < 16) val[threadIdx.x] = e4m3_to_f32(pal[threadIdx.x]);
    __syncthreads();
    const int chunks = cols8 / 4;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n8;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / cols8;
        const int wi = (int)(i - row * cols8), c = wi >> 2, q = wi & 3;
        const float sc = s[row];
        const u32 w = idx[i];
        u32 o[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 b = w >> (8 * j);
            o[j] = (u32)f32_to_bf16(val[b & 15] * sc) | (u32)f32_to_bf16(val[(b >> 4) & 15] * sc) << 16;
        }
        // Word q of chunk c holds groups 2q and 2q + 1 (four columns each) in lane order.
        const int cb = c & ~31, m = min(32, chunks - cb);
        uint2* r = (uint2*)(out + row * (long long)cols8 * 8);
        r[cb * 8 + (2 * q) * m + (c & 31)] = make_uint2(o[0], o[1]);
        r[cb * 8 + (2 * q + 1) * m + (c & 31)] = make_uint2(o[2], o[3]);
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
