// Appended to gemv.cu (microbenchmark): gemv_pal4 with the index words staged by TMA bulk copies
// into a per-group ring in shared memory (mbarrier full/empty pairs) instead of registers.
#ifndef TMA_STAGES
#define TMA_STAGES 4
#endif
#define TMA_TS (PAL4_GROUP_WARPS * GEMV_UNROLL)
#define TMA_TILE_BYTES (TMA_TS * 512 * (PAL4_BF16 ? 3 : 1))
#define TMA_STAGE_BYTES (2 * TMA_TILE_BYTES)
__device__ __forceinline__ void mbar_init(u32 a, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 a, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 a) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(a) : "memory");
}
__device__ __forceinline__ bool mbar_try(u32 a, u32 parity) {
    u32 ok;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(a), "r"(parity) : "memory");
    return ok;
}
__device__ __forceinline__ void mbar_wait(u32 a, u32 parity) {
    while (!mbar_try(a, parity)) {
    }
}
__device__ __forceinline__ void tma_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

#if GEMV_WARPS % PAL4_GROUPS == 0 && PAL4_GROUPS <= 15
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 1)
#if PAL4_BF16
gemv_pal4_bf16_tma(const uint4* __restrict__ idx, uint4 pal, const u32* __restrict__ esc_ptr,
              const u32* __restrict__ esc, const uint4* __restrict__ lo, const float* __restrict__ x,
              float* __restrict__ y, int n, int k) {
    const float* rs = nullptr;
#else
gemv_pal4_tma(const uint4* __restrict__ idx, uint4 pal, const u32* __restrict__ esc_ptr,
              const u32* __restrict__ esc, const float* __restrict__ rs, const float* __restrict__ x,
              float* __restrict__ y, int n, int k) {
    const uint4* lo = nullptr;
#endif
    constexpr int S = PAL4_GROUP_WARPS, R = PAL4_PAIR_ROWS, NST = TMA_STAGES;
    unsigned char* sums = pal4_smem + PAL4_TAB_BYTES;
    float(*red)[GEMV_WARPS][R] = (float(*)[GEMV_WARPS][R])sums;
    float(*esc_red)[PAL4_GROUPS][R] = (float(*)[PAL4_GROUPS][R])(sums + 2 * GEMV_WARPS * R * 4);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, group = warp / S, wi = warp % S;
    const int nkb = k / PAL4_BLOCK_COLS, ntiles = (n + PAL4_TILE_ROWS - 1) / PAL4_TILE_ROWS;
    const int npairs = (ntiles + 1) / 2;
    const u32 x_hi = PAL4_BASE + PAL4_TAB_BYTES + PAL4_SUMS_ALIGNED, x_lo = x_hi + 2u * k;
    const u32 ring = (x_lo + 2u * k + 127u) & ~127u;
    const u32 ring_g = ring + (u32)group * NST * TMA_STAGE_BYTES;
    const u32 bars = ring + (u32)PAL4_GROUPS * NST * TMA_STAGE_BYTES;
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (smem_addr(pal4_smem) != PAL4_BASE || bars + 16u * PAL4_GROUPS * NST - PAL4_BASE > dyn) __trap();
    if (threadIdx.x < 2 * PAL4_GROUPS * NST)
        mbar_init(bars + 8u * threadIdx.x, threadIdx.x < PAL4_GROUPS * NST ? 1u : (u32)S);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    const u32 full0 = bars + 8u * group * NST, empty0 = bars + 8u * (PAL4_GROUPS * NST + group * NST);
    const u32 lane4 = 4u * lane;
    const u32 xq = ((lane >> 2) == 1 ? x_lo : x_hi) + 32u * (lane & 3);
    int pair = blockIdx.x * PAL4_GROUPS + group;
    const int pair_step = gridDim.x * PAL4_GROUPS;
    const int nb = (nkb + TMA_TS - 1) / TMA_TS;
    const int my_pairs = pair < npairs ? (npairs - 1 - pair) / pair_step + 1 : 0;
    const int total = my_pairs * nb;
    const bool producer = wi == 0 && lane == 0;
    auto issue = [&](int b) {
        const int pb = pair + (b / nb) * pair_step, kb0 = (b % nb) * TMA_TS;
        const u32 bytes = (u32)min(TMA_TS, nkb - kb0) * 512u;
        const bool sec = 2 * pb + 1 < ntiles;
        const u32 st = ring_g + (u32)(b % NST) * TMA_STAGE_BYTES, fb = full0 + 8u * (b % NST);
        const u32 per_tile = PAL4_BF16 ? 3 * bytes : bytes;
        mbar_expect_tx(fb, sec ? 2 * per_tile : per_tile);
        for (int t = 0; t < (sec ? 2 : 1); ++t) {
            const size_t blk0 = (2 * (size_t)pb + t) * nkb + kb0;
            tma_load(st + t * TMA_TILE_BYTES, idx + blk0 * 32, bytes, fb);
            if (PAL4_BF16) tma_load(st + t * TMA_TILE_BYTES + TMA_TS * 512, lo + blk0 * 64, 2 * bytes, fb);
        }
    };
    if (producer)
        for (int b = 0; b < min(NST, total); ++b) issue(b);
    pal4_fill_table(pal);
    pdl_wait();
    pdl_trigger();
    pal4_fill_x<false>(x, nullptr, k, x_hi, x_lo);
    __syncthreads();
    int b = 0;
    const uint4 zero4 = make_uint4(0, 0, 0, 0);
    for (int buf = 0; pair < npairs; pair += pair_step, buf ^= 1) {
        const int row0 = pair * R;
        if (wi < R && row0 + wi < n) prefetch_l1(esc_ptr + row0 + wi);
        if (!PAL4_BF16 && wi == 0) prefetch_l1(rs + min(row0 + lane, n - 1));
        float acc[2][2][4] = {};
        const bool second = 2 * pair + 1 < ntiles;
        for (int j = 0; j < nb; ++j, ++b) {
            const int s = b % NST;
            const u32 st = ring_g + (u32)s * TMA_STAGE_BYTES;
            mbar_wait(full0 + 8u * s, (b / NST) & 1);
            const int kb0 = j * TMA_TS;
            uint4 w[GEMV_UNROLL][2], wl[GEMV_UNROLL][2][PAL4_LO];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                const int blk = wi + u * S;
                const bool ok = kb0 + blk < nkb;
#pragma unroll
                for (int t = 0; t < 2; ++t) {
                    const bool okt = ok && (t == 0 || second);
                    const u32 tb = st + t * TMA_TILE_BYTES;
                    w[u][t] = okt ? lds_u4(tb + blk * 512 + 16 * lane) : zero4;
#if PAL4_BF16
                    wl[u][t][0] = okt ? lds_u4(tb + TMA_TS * 512 + blk * 1024 + 32 * lane) : zero4;
                    wl[u][t][1] = okt ? lds_u4(tb + TMA_TS * 512 + blk * 1024 + 32 * lane + 16) : zero4;
#else
                    wl[u][t][0] = zero4;
#endif
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty0 + 8u * s);
            if (producer && b >= 1 && b - 1 + NST < total) {
                const int pb = b - 1;
                mbar_wait(empty0 + 8u * (pb % NST), (pb / NST) & 1);
                issue(pb + NST);
            }
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                const int blk = kb0 + wi + u * S;
                if (blk < nkb) {
                    pal4_block(w[u], wl[u], xq + 128u * blk, lane4, acc);
                }
            }
        }
        if ((lane & 3) == 0) {
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                red[buf][warp][16 * t + (lane >> 2)] = (acc[t][0][0] + acc[t][1][0]) + (acc[t][0][1] + acc[t][1][1]);
                red[buf][warp][16 * t + (lane >> 2) + 8] = (acc[t][0][2] + acc[t][1][2]) + (acc[t][0][3] + acc[t][1][3]);
            }
        }
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
        if (wi == 0) {
            const int row = row0 + lane;
            float sum = esc_red[buf][group][lane];
#pragma unroll
            for (int w = 0; w < S; ++w) sum += red[buf][group * S + w][lane];
            const float v = sum * (PAL4_BF16 ? 1.0f : __ldg(rs + min(row, n - 1)));
            if (row < n) y[row] = v;
        }
    }
}
#endif
