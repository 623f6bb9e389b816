// Microbenchmark: 8-slot palette FP8 GEMV on FP8 tensor cores (mma.m16n8k32 e4m3), A from a
// byte_perm of the palette, x as TERMS e4m3 terms in B's 8 columns.
typedef unsigned int u32;
#ifndef WARPS
#define WARPS 16
#endif
#ifndef GROUPS
#define GROUPS 1
#endif
#ifndef UNROLL
#define UNROLL 2
#endif
#ifndef TERMS
#define TERMS 8
#endif
#ifndef MINB
#define MINB 1
#endif
#define S (WARPS / GROUPS)
#define R 32

__device__ __forceinline__ uint4 ld_stream_u4(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
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
__device__ __forceinline__ float e4m3_to_f32(u32 c) {
    const u32 s = (c & 0x80u) << 24, e = (c >> 3) & 15u, m = c & 7u;
    float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
    return __uint_as_float(__float_as_uint(v) | s);
}
// Four floats (already scaled) to four e4m3 codes (byte i = value i), round to nearest even.
__device__ __forceinline__ u32 to_e4m3x4(float a, float b, float c, float d) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return (u32)lo | (u32)hi << 16;
}
__device__ __forceinline__ void mma8(u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, float (&c)[4]) {
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// One 64-column block of one tile: K steps 0 (w.x, w.y) and 1 (w.z, w.w).
__device__ __forceinline__ void blk(uint4 w, uint4 b, u32 p0, u32 p1, float (&c0)[4], float (&c1)[4]) {
    mma8(__byte_perm(p0, p1, w.x), __byte_perm(p0, p1, w.x >> 16), __byte_perm(p0, p1, w.y),
         __byte_perm(p0, p1, w.y >> 16), b.x, b.y, c0);
    mma8(__byte_perm(p0, p1, w.z), __byte_perm(p0, p1, w.z >> 16), __byte_perm(p0, p1, w.w),
         __byte_perm(p0, p1, w.w >> 16), b.z, b.w, c1);
}

__device__ __forceinline__ void load_batch(uint4 (&v)[UNROLL][2], const uint4* p, size_t tile_words, bool valid,
                                           bool second, int kb, int nkb, const uint4* safe) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const bool ok = valid && kb + u * S < nkb;
        v[u][0] = ld_stream_u4(ok ? p + u * S * 32 : safe);
        v[u][1] = ld_stream_u4(ok && second ? p + tile_words + u * S * 32 : safe);
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
pal8_gemv(const uint4* __restrict__ idx, u32 p0, u32 p1, const u32* __restrict__ esc_ptr,
          const u32* __restrict__ esc, const float* __restrict__ rs, const float* __restrict__ x,
          float* __restrict__ y, int n, int k) {
    extern __shared__ __align__(16) unsigned char sm[];
    const int stride = (k % 128 == 0) ? k + 64 : k;
    float* x32 = (float*)(sm + TERMS * stride);
    float(*red)[WARPS][R] = (float(*)[WARPS][R])(x32 + k);
    float* misc = (float*)(red + 2);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, group = warp / S, wi = warp % S;
    const int nkb = k / 64, ntiles = (n + 15) / 16, npairs = (ntiles + 1) / 2;
    const size_t tile_words = (size_t)nkb * 32;
    int pair = blockIdx.x * GROUPS + group;
    const int pair_step = gridDim.x * GROUPS;
    const uint4* p_pair = idx + 2 * (size_t)pair * tile_words + wi * 32 + lane;
    const size_t pair_stride = 2 * (size_t)pair_step * tile_words;
    const uint4* p = p_pair;
    const uint4* safe = idx + lane;
    uint4 next[UNROLL][2];
    load_batch(next, p, tile_words, pair < npairs, 2 * pair + 1 < ntiles, wi, nkb, safe);
    // x: f32 copy and max |x|.
    float m = 0.0f;
    for (int i = threadIdx.x; i < k / 4; i += blockDim.x) {
        const float4 v = __ldcg((const float4*)x + i);
        ((float4*)x32)[i] = v;
        m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) misc[warp] = m;
    __syncthreads();
    m = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = fmaxf(m, misc[w]);
    // 2^e with m · 2^e <= 448.
    int e = m > 0.0f ? (int)floorf(log2f(448.0f / m)) : 0;
    if (m * exp2f((float)e) > 448.0f) --e;
    const float sc = exp2f((float)e);
    for (int i = threadIdx.x; i < k / 4; i += blockDim.x) {
        float4 v = ((const float4*)x32)[i];
        v.x *= sc, v.y *= sc, v.z *= sc, v.w *= sc;
        const int b = i >> 4, nw = i & 15, at = 64 * b + 4 * (4 * (nw & 3) + (nw >> 2));
#pragma unroll
        for (int j = 0; j < TERMS; ++j) {
            const u32 q = to_e4m3x4(v.x, v.y, v.z, v.w);
            *(u32*)(sm + j * stride + at) = q;
            v.x = (v.x - e4m3_to_f32(q & 255)) * 16.0f;
            v.y = (v.y - e4m3_to_f32((q >> 8) & 255)) * 16.0f;
            v.z = (v.z - e4m3_to_f32((q >> 16) & 255)) * 16.0f;
            v.w = (v.w - e4m3_to_f32(q >> 24)) * 16.0f;
        }
    }
    __syncthreads();
    const int col = lane >> 2, q = lane & 3;
    const u32 xb = smem_addr(sm) + (col < TERMS ? col : TERMS - 1) * stride + 16 * q;
    // Column factors: 2^-(e + 4 j), zero past TERMS.
    const float f0 = (2 * q < TERMS) ? exp2f(-(float)e - 8.0f * q) : 0.0f;
    const float f1 = (2 * q + 1 < TERMS) ? exp2f(-(float)e - 8.0f * q - 4.0f) : 0.0f;
    for (int buf = 0; pair < npairs; pair += pair_step, buf ^= 1) {
        const int row0 = pair * R;
        u32 e_begin = 0, e_end = 0;
        if (row0 + lane < n) {
            e_begin = __ldg(esc_ptr + row0 + lane);
            e_end = __ldg(esc_ptr + row0 + lane + 1);
        }
        float acc[2][2][4] = {};
        int kb = wi;
        const bool second = 2 * pair + 1 < ntiles;
        for (; kb + S * UNROLL < nkb; kb += S * UNROLL) {
            uint4 cur[UNROLL][2];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) cur[u][0] = next[u][0], cur[u][1] = next[u][1];
            p += S * UNROLL * 32;
            load_batch(next, p, tile_words, true, second, kb + S * UNROLL, nkb, safe);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint4 bb = lds_u4(xb + 64u * (kb + u * S));
                blk(cur[u][0], bb, p0, p1, acc[0][0], acc[0][1]);
                blk(cur[u][1], bb, p0, p1, acc[1][0], acc[1][1]);
            }
        }
        {
            uint4 cur[UNROLL][2];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) cur[u][0] = next[u][0], cur[u][1] = next[u][1];
            p_pair += pair_stride;
            p = p_pair;
            const int pair2 = pair + pair_step;
            load_batch(next, p, tile_words, pair2 < npairs, 2 * pair2 + 1 < ntiles, wi, nkb, safe);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int b = kb + u * S;
                if (b < nkb) {
                    const uint4 bb = lds_u4(xb + 64u * b);
                    blk(cur[u][0], bb, p0, p1, acc[0][0], acc[0][1]);
                    blk(cur[u][1], bb, p0, p1, acc[1][0], acc[1][1]);
                }
            }
        }
        // Rows g, g + 8 of each tile: columns 2q, 2q + 1 in lane 4 g + q.
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            float r0 = (acc[t][0][0] + acc[t][1][0]) * f0 + (acc[t][0][1] + acc[t][1][1]) * f1;
            float r1 = (acc[t][0][2] + acc[t][1][2]) * f0 + (acc[t][0][3] + acc[t][1][3]) * f1;
            r0 += __shfl_xor_sync(0xffffffffu, r0, 1);
            r1 += __shfl_xor_sync(0xffffffffu, r1, 1);
            r0 += __shfl_xor_sync(0xffffffffu, r0, 2);
            r1 += __shfl_xor_sync(0xffffffffu, r1, 2);
            if (q == 0) {
                red[buf][warp][16 * t + col] = r0;
                red[buf][warp][16 * t + col + 8] = r1;
            }
        }
        // Escapes: lane = row of the pair, this warp's share (every S-th).
        float es = 0.0f;
        for (u32 i = e_begin + wi; i < e_end; i += S) {
            const u32 v = __ldg(esc + i);
            es = fmaf(e4m3_to_f32(v >> 24), x32[v & 0xffffffu], es);
        }
        __syncwarp();
        red[buf][warp][lane] += es;
        if (S > 1) asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(S * 32) : "memory");
        else __syncwarp();
        if (wi == 0 && row0 + lane < n) {
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < S; ++w) s += red[buf][group * S + w][lane];
            y[row0 + lane] = rs[row0 + lane] * s;
        }
    }
}
