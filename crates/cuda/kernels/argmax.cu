// Greedy sampling: index of the largest logit, smallest index on ties, NaN never chosen (-1 if every
// value is NaN). Two passes: per-block candidates, then one block reduces them.

__device__ __forceinline__ bool argmax_better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && (bi < 0 || i < bi));
}

__device__ __forceinline__ void argmax_block(float& bv, int& bi) {
    __shared__ float sv[32];
    __shared__ int si[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && argmax_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        const int n_warps = (blockDim.x + 31) >> 5;
        bv = lane < n_warps ? sv[lane] : -F32_INF;
        bi = lane < n_warps ? si[lane] : -1;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && argmax_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
    }
}

extern "C" __global__ void argmax_partial(const float* __restrict__ x, int n,
                                          float* __restrict__ part_val, int* __restrict__ part_idx) {
    pdl_wait();
    pdl_trigger();
    float bv = -F32_INF;
    int bi = -1;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = __ldcg(x + i);
        if (argmax_better(v, i, bv, bi)) { bv = v; bi = i; }  // NaN compares false
    }
    argmax_block(bv, bi);
    if (threadIdx.x == 0) { part_val[blockIdx.x] = bv; part_idx[blockIdx.x] = bi; }
}

extern "C" __global__ void argmax_final(const float* __restrict__ part_val, const int* __restrict__ part_idx,
                                        int n_parts, int* __restrict__ out) {
    pdl_wait();
    pdl_trigger();
    float bv = -F32_INF;
    int bi = -1;
    for (int j = threadIdx.x; j < n_parts; j += blockDim.x) {
        const int i = __ldcg(part_idx + j);
        const float v = __ldcg(part_val + j);
        if (i >= 0 && argmax_better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    argmax_block(bv, bi);
    if (threadIdx.x == 0) out[0] = bi;
}
