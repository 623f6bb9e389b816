// Causal prefill attention, flash-attention style (FA2 layout), on BF16 tensor cores (mma.sync
// m16n8k16, f32 accumulation), with grouped-query attention.
//
// q: BF16 [n, n_q_heads, HEAD_DIM] (RoPE applied); K and V caches: BF16 [max_seq, n_kv_heads,
// HEAD_DIM] already holding positions 0 .. start + n; query t sits at position start + t and attends
// to positions 0 ..= start + t. out: BF16 [n, n_q_heads, HEAD_DIM].
// A block owns FA_BM = 64 query rows of one query head (16 per warp) and walks the keys in tiles of
// FA_BN = 64: K and V are staged in shared memory row-major (16-byte stores), padded so that the
// ldmatrix fragment loads (plain for K, transposed for V) hit 32 distinct banks. Scores stay in
// registers (log2 units, online softmax per row).
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
// Families beyond Llama: FA_WINDOW = query at position p attends to keys p - window + 1 ..= p
// (window > 0), FA_SOFTCAP = scores become softcap · tanh(score / softcap). Either appends (int
// window, float softcap) to the kernel's arguments.
#ifndef FA_WINDOW
#define FA_WINDOW 0
#endif
#ifndef FA_SOFTCAP
#define FA_SOFTCAP 0
#endif
#define FA_EXT (FA_WINDOW || FA_SOFTCAP)
// FA_SINKS = a learned logit per query head (gpt-oss's sinks[n_q_heads], unscaled) joins each
// row's softmax maximum and denominator, not the values; appends (const float* sinks).
#ifndef FA_SINKS
#define FA_SINKS 0
#endif
#define FA_WARPS 4
#define FA_BM (16 * FA_WARPS)
// Keys a tile: 64, or 32 for heads over 128 (the K and V tiles in 48 KiB of static shared memory).
#define FA_BN (HEAD_DIM > 128 ? 32 : 64)
#define KS_STRIDE (HEAD_DIM + 8)
static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "HEAD_DIM must be a multiple of 32, at most 256");
static_assert((FA_BN * HEAD_DIM / 8) % (FA_WARPS * 32) == 0, "tile copies must split evenly over the threads");

__device__ __forceinline__ void mma_bf16_16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices from shared memory; lane L gives the address of row L % 8 of matrix L / 8.
__device__ __forceinline__ void ldsm_x4(u32* r, const bf16_t* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void ldsm_x4_trans(u32* r, const bf16_t* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// 16-byte global -> shared copy; `bytes` 0 zero-fills the destination.
__device__ __forceinline__ void cp_async16(bf16_t* dst, const bf16_t* src, int bytes) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}

// grid (ceil(n / FA_BM), n_q_heads), block FA_WARPS * 32. scale_log2 = softmax scale * log2(e).
extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)
flash_prefill(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
              const bf16_t* __restrict__ v_cache, bf16_t* __restrict__ out, int n, int start,
              int n_q_heads, int n_kv_heads, float scale_log2
#if FA_EXT
              , int window, float softcap
#endif
#if FA_SINKS
              , const float* __restrict__ sinks
#endif
) {
    __shared__ __align__(16) bf16_t Ks[FA_BN * KS_STRIDE];
    __shared__ __align__(16) bf16_t Vs[FA_BN * KS_STRIDE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int h = blockIdx.y;
    const int kvh = h / (n_q_heads / n_kv_heads);
    // Heaviest query blocks (most keys) first, so the tail of the grid is short.
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FA_BM;
    const int r0 = q0 + warp * 16;

    // Q fragments of the warp's 16 rows (rows past n repeat the last row; never stored).
    u32 qa[HEAD_DIM / 16][4];
    {
        const int ra = min(r0 + g, n - 1), rb = min(r0 + g + 8, n - 1);
        const bf16_t* qra = q + ((size_t)ra * n_q_heads + h) * HEAD_DIM;
        const bf16_t* qrb = q + ((size_t)rb * n_q_heads + h) * HEAD_DIM;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            qa[kk][0] = *(const u32*)(qra + kk * 16 + 2 * t4);
            qa[kk][1] = *(const u32*)(qrb + kk * 16 + 2 * t4);
            qa[kk][2] = *(const u32*)(qra + kk * 16 + 8 + 2 * t4);
            qa[kk][3] = *(const u32*)(qrb + kk * 16 + 8 + 2 * t4);
        }
    }
    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int nt = 0; nt < HEAD_DIM / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    float m_a = -F32_INF, m_b = -F32_INF, l_a = 0.0f, l_b = 0.0f;
    const int pos_a = start + r0 + g, pos_b = pos_a + 8;
    const int kv_end = min(start + q0 + FA_BM, start + n);
    const size_t row_stride = (size_t)n_kv_heads * HEAD_DIM;
    const bf16_t* kbase = k_cache + (size_t)kvh * HEAD_DIM;
    const bf16_t* vbase = v_cache + (size_t)kvh * HEAD_DIM;

#if FA_WINDOW
    // Keys before the block's first query's window are never read.
    const int kb0 = max(0, start + q0 - window + 1) / FA_BN * FA_BN;
    // The first key each of the thread's two rows sees (the host passes window >= 1).
    const int lo_a = pos_a - window + 1, lo_b = pos_b - window + 1;
#else
    const int kb0 = 0;
#endif
#if FA_SOFTCAP
    const float capl = softcap * LOG2E_F;  // the cap in the scores' log2 units
#endif
    for (int kb = kb0; kb < kv_end; kb += FA_BN) {
        __syncthreads();  // the previous tile is consumed
        // All 16-byte copies of the tile in flight at once (cp.async, no registers); keys past
        // kv_end are zero-filled. (cp.async does not block: a rolled loop keeps them all in flight.)
#pragma unroll 1
        for (int i = 0; i < FA_BN * HEAD_DIM / 8 / (FA_WARPS * 32); ++i) {
            const int c = threadIdx.x + i * FA_WARPS * 32;
            const int r = c / (HEAD_DIM / 8), col = (c - r * (HEAD_DIM / 8)) * 8;
            const int key = kb + r;
            const int bytes = key < kv_end ? 16 : 0;
            const size_t off = (size_t)min(key, kv_end - 1) * row_stride + col;
            cp_async16(Ks + r * KS_STRIDE + col, kbase + off, bytes);
            cp_async16(Vs + r * KS_STRIDE + col, vbase + off, bytes);
        }
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 0;\n" ::);
        __syncthreads();
        if (kb > start + r0 + 15) continue;  // every row of this warp is before the tile (causal)

        // S = Q Kᵀ: for n-tile j (keys j*8..) and k-steps kk, kk+1, one ldmatrix.x4 gives both
        // B fragments (matrix m: keys j*8 + row, dims (kk + m/2)*16 + (m%2)*8).
        float s[FA_BN / 8][4];
        const int lrow = lane & 7, lmat = lane >> 3;
#pragma unroll
        for (int j = 0; j < FA_BN / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
            const bf16_t* kr = Ks + (j * 8 + lrow) * KS_STRIDE + (lmat >> 1) * 16 + (lmat & 1) * 8;
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; kk += 2) {
                u32 b[4];
                ldsm_x4(b, kr + kk * 16);
                mma_bf16_16816(s[j], qa[kk], b[0], b[1]);
                mma_bf16_16816(s[j], qa[kk + 1], b[2], b[3]);
            }
        }
        float mx_a = -F32_INF, mx_b = -F32_INF;
#pragma unroll
        for (int j = 0; j < FA_BN / 8; ++j) {
            const int key = kb + j * 8 + 2 * t4;
#if FA_SOFTCAP
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = capl * tanhf(s[j][e] * scale_log2 / capl);
#define FA_SCALED(v) (v)
#else
#define FA_SCALED(v) ((v) * scale_log2)
#endif
#if FA_WINDOW
            // Visible: key in [pos - window + 1, pos].
#define FA_SEES(k, p, lo) ((k) <= (p) && (k) >= (lo))
#else
#define FA_SEES(k, p, lo) ((k) <= (p))
#endif
            s[j][0] = FA_SEES(key, pos_a, lo_a) ? FA_SCALED(s[j][0]) : -F32_INF;
            s[j][1] = FA_SEES(key + 1, pos_a, lo_a) ? FA_SCALED(s[j][1]) : -F32_INF;
            s[j][2] = FA_SEES(key, pos_b, lo_b) ? FA_SCALED(s[j][2]) : -F32_INF;
            s[j][3] = FA_SEES(key + 1, pos_b, lo_b) ? FA_SCALED(s[j][3]) : -F32_INF;
#undef FA_SEES
#undef FA_SCALED
            mx_a = fmaxf(mx_a, fmaxf(s[j][0], s[j][1]));
            mx_b = fmaxf(mx_b, fmaxf(s[j][2], s[j][3]));
        }
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
        const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
        // A row with no visible key yet keeps m = -inf: subtract 0 so nothing becomes NaN.
        const float sub_a = mn_a == -F32_INF ? 0.0f : mn_a;
        const float sub_b = mn_b == -F32_INF ? 0.0f : mn_b;
        const float corr_a = exp2f(m_a - sub_a), corr_b = exp2f(m_b - sub_b);
        m_a = mn_a;
        m_b = mn_b;
        float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
        for (int j = 0; j < FA_BN / 8; ++j) {
            s[j][0] = exp2f(s[j][0] - sub_a);
            s[j][1] = exp2f(s[j][1] - sub_a);
            s[j][2] = exp2f(s[j][2] - sub_b);
            s[j][3] = exp2f(s[j][3] - sub_b);
            sum_a += s[j][0] + s[j][1];
            sum_b += s[j][2] + s[j][3];
        }
        l_a = l_a * corr_a + sum_a;
        l_b = l_b * corr_b + sum_b;
#pragma unroll
        for (int nt = 0; nt < HEAD_DIM / 8; ++nt) {
            o[nt][0] *= corr_a;
            o[nt][1] *= corr_a;
            o[nt][2] *= corr_b;
            o[nt][3] *= corr_b;
        }
        // O += P V: for k-step kk (keys kk*16..) and n-tiles nt, nt+1, one transposed ldmatrix.x4
        // gives both B fragments (matrix m: keys kk*16 + (m%2)*8 + row, dims (nt + m/2)*8).
#pragma unroll
        for (int kk = 0; kk < FA_BN / 16; ++kk) {
            const u32 pa[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                               pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            const bf16_t* vr = Vs + (kk * 16 + (lmat & 1) * 8 + lrow) * KS_STRIDE + (lmat >> 1) * 8;
#pragma unroll
            for (int nt = 0; nt < HEAD_DIM / 8; nt += 2) {
                u32 b[4];
                ldsm_x4_trans(b, vr + nt * 8);
                mma_bf16_16816(o[nt], pa, b[0], b[1]);
                mma_bf16_16816(o[nt + 1], pa, b[2], b[3]);
            }
        }
    }
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
#if FA_SINKS
    // The sink joins the maximum (every row sees its own key: m is finite) and the denominator.
    const float sink = sinks[h] * LOG2E_F;
    const float ms_a = fmaxf(m_a, sink), ms_b = fmaxf(m_b, sink);
    const float f_a = exp2f(m_a - ms_a), f_b = exp2f(m_b - ms_b);
    const float inv_a = f_a / (l_a * f_a + exp2f(sink - ms_a));
    const float inv_b = f_b / (l_b * f_b + exp2f(sink - ms_b));
#else
    const float inv_a = 1.0f / l_a, inv_b = 1.0f / l_b;
#endif
    const int ra = r0 + g, rb = r0 + g + 8;
#pragma unroll
    for (int nt = 0; nt < HEAD_DIM / 8; ++nt) {
        const int d = nt * 8 + 2 * t4;
        if (ra < n)
            *(u32*)(out + ((size_t)ra * n_q_heads + h) * HEAD_DIM + d) = pack_bf16x2(o[nt][0] * inv_a, o[nt][1] * inv_a);
        if (rb < n)
            *(u32*)(out + ((size_t)rb * n_q_heads + h) * HEAD_DIM + d) = pack_bf16x2(o[nt][2] * inv_b, o[nt][3] * inv_b);
    }
}
