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

template <bool NORM>
__device__ __forceinline__ void gemv_body(const bf16_t* __restrict__ w, const float* __restrict__ x,
                                          const float* __restrict__ g, float* __restrict__ y, int n, int k,
                                          float eps) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_ROWS;
    if (row0 >= n) return;
    const int chunks = k >> 3;  // 16-byte chunks per row
    const float4* xv = (const float4*)x;
    const float4* gv = (const float4*)g;
    // Rows past the end re-read the last row (valid memory, uniform control flow); never stored.
    const uint4* rows[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
        rows[r] = (const uint4*)(w + (size_t)min(row0 + r, n - 1) * k);
    float acc[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) acc[r] = 0.0f;
    float ss = 0.0f;

    // The first batch of weights is loaded before pdl_wait (weights are immutable), so under
    // programmatic dependent launch it streams while the previous kernel finishes.
    uint4 wv[GEMV_UNROLL][GEMV_ROWS];
    if (lane >= chunks) pdl_wait();  // lanes with no chunk (k < 256) wait here
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
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const int c = c0 + u * 32;
            if (c < chunks) {
                // x: a coherent load (not __ldg's ld.global.nc, which assumes x read-only while the
                // kernel runs, untrue under PDL).
                float4 a = __ldca(xv + 2 * c), b = __ldca(xv + 2 * c + 1);
                if (NORM) {
                    ss = fmaf(a.x, a.x, ss); ss = fmaf(a.y, a.y, ss); ss = fmaf(a.z, a.z, ss); ss = fmaf(a.w, a.w, ss);
                    ss = fmaf(b.x, b.x, ss); ss = fmaf(b.y, b.y, ss); ss = fmaf(b.z, b.z, ss); ss = fmaf(b.w, b.w, ss);
                    const float4 ga = __ldg(gv + 2 * c), gb = __ldg(gv + 2 * c + 1);
                    a.x *= ga.x; a.y *= ga.y; a.z *= ga.z; a.w *= ga.w;
                    b.x *= gb.x; b.y *= gb.y; b.z *= gb.z; b.w *= gb.w;
                }
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) acc[r] = dot8(wv[u][r], a, b, acc[r]);
            }
        }
    }
    const float scale = NORM ? rsqrtf(warp_sum(ss) / (float)k + eps) : 1.0f;
#if GEMV_SWIGLU
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r += 2) {
        const float gate = warp_sum(acc[r]) * scale, up = warp_sum(acc[r + 1]) * scale;
        if (lane == 0 && row0 + r + 1 < n) y[(row0 + r) >> 1] = gate / (1.0f + expf(-gate)) * up;
    }
#else
    // The residual read bypasses L1 (__ldcg): under PDL the next kernel (RMSNorm, reading all of y)
    // is launched before this one ends, so a line of y that this read left in the SM's L1 could
    // still be there, without the rows other blocks write after it, when that kernel reads y.
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        const float s = warp_sum(acc[r]) * scale;
        if (lane == 0 && row0 + r < n) y[row0 + r] = GEMV_ACCUM ? __ldcg(y + row0 + r) + s : s;
    }
#endif
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_bf16(const bf16_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int n, int k) {
    gemv_body<false>(w, x, x, y, n, k, 0.0f);
}

// y = W · rmsnorm(x; g, eps) (g f32 [k]).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_bf16_norm(const bf16_t* __restrict__ w, const float* __restrict__ x, const float* __restrict__ g,
               float* __restrict__ y, int n, int k, float eps) {
    gemv_body<true>(w, x, g, y, n, k, eps);
}

// Dense FP8 E4M3 GEMV with per-row f32 scales: y = s[row] · Σ fp8(W[row, c]) x[c] (FP8 checkpoints'
// per-channel weight_scale). W row-major [N, K] bytes, K % 16 == 0 (16-byte aligned rows); each
// 16-byte chunk holds 16 weights. Same warp/row/unroll layout, PDL handling and epilogues
// (GEMV_ACCUM, GEMV_SWIGLU, the RMSNorm entry point) as gemv_body above.
// Conversion: cvt.rn.f16x2.e4m3x2 (sm_89+, one F2FP per 2 weights, exact: every E4M3 value is an
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

template <bool NORM>
__device__ __forceinline__ void gemv_fp8_body(const unsigned char* __restrict__ w,
                                              const float* __restrict__ s, const float* __restrict__ x,
                                              const float* __restrict__ g, float* __restrict__ y, int n,
                                              int k, float eps) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_ROWS;
    if (row0 >= n) return;
    const int chunks = k >> 4;  // 16-byte chunks (16 weights) per row
    const float4* xv = (const float4*)x;
    const float4* gv = (const float4*)g;
    const uint4* rows[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r)
        rows[r] = (const uint4*)(w + (size_t)min(row0 + r, n - 1) * k);
    float acc[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) acc[r] = 0.0f;
    float ss = 0.0f;

    uint4 wv[GEMV_UNROLL][GEMV_ROWS];
    if (lane >= chunks) pdl_wait();
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
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const int c = c0 + u * 32;
            if (c < chunks) {
                float4 xq[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    float4 a = __ldca(xv + 4 * c + q);  // coherent under PDL (see gemv_body)
                    if (NORM) {
                        ss = fmaf(a.x, a.x, ss); ss = fmaf(a.y, a.y, ss);
                        ss = fmaf(a.z, a.z, ss); ss = fmaf(a.w, a.w, ss);
                        const float4 ga = __ldg(gv + 4 * c + q);
                        a.x *= ga.x; a.y *= ga.y; a.z *= ga.z; a.w *= ga.w;
                    }
                    xq[q] = a;
                }
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; ++r) {
                    float a = acc[r];
                    a = dot4_e4m3(wv[u][r].x, xq[0], a);
                    a = dot4_e4m3(wv[u][r].y, xq[1], a);
                    a = dot4_e4m3(wv[u][r].z, xq[2], a);
                    a = dot4_e4m3(wv[u][r].w, xq[3], a);
                    acc[r] = a;
                }
            }
        }
    }
    const float scale = NORM ? rsqrtf(warp_sum(ss) / (float)k + eps) : 1.0f;
    // Rows past the end read the last row's scale (never stored).
#if GEMV_SWIGLU
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r += 2) {
        const int rg = min(row0 + r, n - 1), ru = min(row0 + r + 1, n - 1);
        const float gate = warp_sum(acc[r]) * scale * __ldg(s + rg);
        const float up = warp_sum(acc[r + 1]) * scale * __ldg(s + ru);
        if (lane == 0 && row0 + r + 1 < n) y[(row0 + r) >> 1] = gate / (1.0f + expf(-gate)) * up;
    }
#else
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        const float v = warp_sum(acc[r]) * scale * __ldg(s + min(row0 + r, n - 1));
        // Residual read through L2 only, as in gemv_body.
        if (lane == 0 && row0 + r < n) y[row0 + r] = GEMV_ACCUM ? __ldcg(y + row0 + r) + v : v;
    }
#endif
}

// s: f32 [n] row scales.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_fp8(const unsigned char* __restrict__ w, const float* __restrict__ s, const float* __restrict__ x,
         float* __restrict__ y, int n, int k) {
    gemv_fp8_body<false>(w, s, x, x, y, n, k, 0.0f);
}

// y = diag(s) · W · rmsnorm(x; g, eps) (g f32 [k]).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_fp8_norm(const unsigned char* __restrict__ w, const float* __restrict__ s,
              const float* __restrict__ x, const float* __restrict__ g, float* __restrict__ y, int n,
              int k, float eps) {
    gemv_fp8_body<true>(w, s, x, g, y, n, k, eps);
}
