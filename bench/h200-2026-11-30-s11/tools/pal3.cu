// Appended to gemv.cu (microbenchmark): 3-bit palette (8 slots): a pair of weights is a 6-bit
// index into a 64-entry bf16x2 table (32 lane copies, 128-byte stride: 8 KiB). Per tile block a
// lane holds 16 pairs in three words (structure of arrays: word w of lane L at w * 32 + L):
// word s < 3 = K step s's four 6-bit fields (bits 0-23) + byte s of K step 3's 24 bits.
#define PAL3_TAB_BYTES (64 * 128)
#define PAL3_BLOCK_WORDS 96
__device__ __forceinline__ u32 ld_stream_u32(const u32* p) {
    u32 r;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void pal3_fill_table(uint4 pal) {
    for (int e = threadIdx.x; e < 64 * 8; e += blockDim.x) {
        const int b = e >> 3, c = e & 7;
        const u32 v = (u32)f32_to_bf16(e4m3_to_f32(pal4_code(pal, b & 7))) |
                      (u32)f32_to_bf16(e4m3_to_f32(pal4_code(pal, b >> 3))) << 16;
        sts_u4(PAL4_BASE + b * 128 + 16 * c, make_uint4(v, v, v, v));
    }
}
// Field f (0-3) of a 24-bit step value, as a table offset (6-bit index · 128 + 4 lane).
template <int F>
__device__ __forceinline__ u32 pal3_off(u32 v, u32 lane4) {
    const u32 t = F == 0 ? v << 7 : F == 1 ? v << 1 : F == 2 ? v >> 5 : v >> 11;
    return (t & (63u << 7)) | lane4;
}
__device__ __forceinline__ void pal3_mma(u32 v, u32 b0, u32 b1, u32 lane4, float (&c)[4]) {
    const u32 a0 = pal4_entry(pal3_off<0>(v, lane4)), a1 = pal4_entry(pal3_off<1>(v, lane4));
    const u32 a2 = pal4_entry(pal3_off<2>(v, lane4)), a3 = pal4_entry(pal3_off<3>(v, lane4));
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void pal3_block(const uint3 (&w)[2], u32 xb, u32 lane4, float (&acc)[2][2][4]) {
    const uint4 b01 = lds_u4(xb), b23 = lds_u4(xb + 16);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        pal3_mma(w[t].x, b01.x, b01.y, lane4, acc[t][0]);
        pal3_mma(w[t].y, b01.z, b01.w, lane4, acc[t][1]);
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        pal3_mma(w[t].z, b23.x, b23.y, lane4, acc[t][0]);
        const u32 v3 = __byte_perm(__byte_perm(w[t].x, w[t].y, 0x0073), w[t].z, 0x0710);
        pal3_mma(v3, b23.z, b23.w, lane4, acc[t][1]);
    }
}
template <int S>
__device__ __forceinline__ void pal3_load(uint3 (&v)[GEMV_UNROLL][2], const u32* p, size_t tile_words, bool valid,
                                          bool second, int kb, int nkb, const u32* safe) {
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
        const bool ok = valid && kb + u * S < nkb;
        const u32* p0 = ok ? p + u * S * PAL3_BLOCK_WORDS : safe;
        const u32* p1 = ok && second ? p + tile_words + u * S * PAL3_BLOCK_WORDS : safe;
        v[u][0] = make_uint3(ld_stream_u32(p0), ld_stream_u32(p0 + 32), ld_stream_u32(p0 + 64));
        v[u][1] = make_uint3(ld_stream_u32(p1), ld_stream_u32(p1 + 32), ld_stream_u32(p1 + 64));
    }
}

#if GEMV_WARPS % PAL4_GROUPS == 0 && PAL4_GROUPS <= 15 && !PAL4_BF16
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 1)
gemv_pal3(const u32* __restrict__ idx, uint4 pal, const u32* __restrict__ esc_ptr,
          const u32* __restrict__ esc, const float* __restrict__ rs, const float* __restrict__ x,
          float* __restrict__ y, int n, int k) {
    constexpr int S = PAL4_GROUP_WARPS, R = PAL4_PAIR_ROWS;
    unsigned char* sums = pal4_smem + PAL3_TAB_BYTES;
    float(*red)[GEMV_WARPS][R] = (float(*)[GEMV_WARPS][R])sums;
    float(*esc_red)[PAL4_GROUPS][R] = (float(*)[PAL4_GROUPS][R])(sums + 2 * GEMV_WARPS * R * 4);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, group = warp / S, wi = warp % S;
    const int nkb = k / PAL4_BLOCK_COLS, ntiles = (n + PAL4_TILE_ROWS - 1) / PAL4_TILE_ROWS;
    const int npairs = (ntiles + 1) / 2;
    const u32 x_hi = PAL4_BASE + PAL3_TAB_BYTES + PAL4_SUMS_ALIGNED, x_lo = x_hi + 2u * k;
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (smem_addr(pal4_smem) != PAL4_BASE || x_lo + 2u * k - PAL4_BASE > dyn) __trap();
    const u32 lane4 = 4u * lane;
    const u32 xq = ((lane >> 2) == 1 ? x_lo : x_hi) + 32u * (lane & 3);
    pal3_fill_table(pal);
    int pair = blockIdx.x * PAL4_GROUPS + group;
    const int pair_step = gridDim.x * PAL4_GROUPS;
    const size_t tile_words = (size_t)nkb * PAL3_BLOCK_WORDS;
    const u32* p_pair = idx + 2 * (size_t)pair * tile_words + wi * PAL3_BLOCK_WORDS + lane;
    const size_t pair_stride = 2 * (size_t)pair_step * tile_words;
    const u32* p = p_pair;
    const u32* safe = idx + lane;
    uint3 next[GEMV_UNROLL][2];
    pal3_load<S>(next, p, tile_words, pair < npairs, 2 * pair + 1 < ntiles, wi, nkb, safe);
    u32 esc_begin = 0, esc_end = 0;
    if (pair < npairs && wi == 0) {
        esc_begin = __ldg(esc_ptr + pair * R);
        esc_end = __ldg(esc_ptr + min(pair * R + R, n));
    }
    pdl_wait();
    pdl_trigger();
    pal4_fill_x<false>(x, nullptr, k, x_hi, x_lo);
    for (u32 i = (esc_begin & ~31u) + 32u * lane; i < esc_end; i += 32u * 32u) prefetch_l1(esc + i);
    __syncthreads();
    for (int buf = 0; pair < npairs; pair += pair_step, buf ^= 1) {
        const int row0 = pair * R;
        if (wi < R && row0 + wi < n) prefetch_l1(esc_ptr + row0 + wi);
        if (wi == 0) prefetch_l1(rs + min(row0 + lane, n - 1));
        float acc[2][2][4] = {};
        int kb = wi;
        const bool second = 2 * pair + 1 < ntiles;
        for (; kb + S * GEMV_UNROLL < nkb; kb += S * GEMV_UNROLL) {
            uint3 cur[GEMV_UNROLL][2];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) cur[u][0] = next[u][0], cur[u][1] = next[u][1];
            p += S * GEMV_UNROLL * PAL3_BLOCK_WORDS;
            pal3_load<S>(next, p, tile_words, true, second, kb + S * GEMV_UNROLL, nkb, safe);
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) pal3_block(cur[u], xq + 128u * (kb + u * S), lane4, acc);
        }
        {
            uint3 cur[GEMV_UNROLL][2];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) cur[u][0] = next[u][0], cur[u][1] = next[u][1];
            p_pair += pair_stride;
            p = p_pair;
            const int pair2 = pair + pair_step;
            pal3_load<S>(next, p, tile_words, pair2 < npairs, 2 * pair2 + 1 < ntiles, wi, nkb, safe);
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                const int b = kb + u * S;
                if (b < nkb) pal3_block(cur[u], xq + 128u * b, lane4, acc);
            }
        }
        if ((lane & 3) == 0) {
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                red[buf][warp][16 * t + (lane >> 2)] = (acc[t][0][0] + acc[t][1][0]) + (acc[t][0][1] + acc[t][1][1]);
                red[buf][warp][16 * t + (lane >> 2) + 8] = (acc[t][0][2] + acc[t][1][2]) + (acc[t][0][3] + acc[t][1][3]);
            }
        }
#if PAL3_ESC_LANES
        // Escapes a lane per row (this warp's share of each row: every S-th), no warp reductions.
        {
            float e = 0.0f;
            const int row = row0 + lane;
            if (row < n) {
                const u32 e_begin = __ldg(esc_ptr + row), e_end = __ldg(esc_ptr + row + 1);
                for (u32 i = e_begin + wi; i < e_end; i += S) {
                    const u32 v = __ldg(esc + i);
                    e = fmaf(e4m3_to_f32(v >> 24), pal4_x_at(x_hi, x_lo, v & 0xffffffu), e);
                }
            }
            __syncwarp();
            red[buf][warp][lane] += e;
            if (wi == 0) esc_red[buf][group][lane] = 0.0f;
        }
#else
        for (int r = wi; r < R; r += S) {
            const int row = row0 + r;
            u32 e_begin = 0, e_end = 0;
            if (row < n) {
                e_begin = __ldg(esc_ptr + row);
                e_end = __ldg(esc_ptr + row + 1);
            }
            float e = 0.0f;
            if (e_begin < e_end) {
                for (u32 i = e_begin + lane; i < e_end; i += 32) {
                    const u32 v = __ldg(esc + i);
                    e = fmaf(e4m3_to_f32(v >> 24), pal4_x_at(x_hi, x_lo, v & 0xffffffu), e);
                }
                e = warp_sum(e);
            }
            if (lane == 0) esc_red[buf][group][r] = e;
        }
#endif
        pal4_group_sync(group);
        if (wi == 0) {
            const int row = row0 + lane;
            float sum = esc_red[buf][group][lane];
#pragma unroll
            for (int w = 0; w < S; ++w) sum += red[buf][group * S + w][lane];
            const float v = sum * __ldg(rs + min(row, n - 1));
            if (row < n) y[row] = v;
        }
    }
}
#endif
