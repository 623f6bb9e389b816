// Integer codes with group scales (model form `int`: GGUF legacy codes, GPTQ, AWQ,
// compressed-tensors pack-quantized), one module per code width (INT_BITS, 2..8), dequantisation
// kind (INT_KIND) and rows a warp (INT_ROWS). Weight (r, c) is s·(q − o) + m: q the unsigned code
// (signed codes are stored with their sign bit flipped and o raised by 2^(bits−1), the same value
// exactly), s and m the scale and min of its group, o one offset for the matrix.
//   INT_KIND 0: s·q (o = 0, no mins)   1: s·(q − o)   2: s·(q − o) + m
//
// Layout (ops/int.rs packs it; `pack` there is its host reference): a row is steps of 128 columns,
// lane l of a warp owning columns 128k + 4l .. +4 of step k. Eight steps make a superchunk of 1024
// columns, whose 32 codes a lane holds in INT_BITS consecutive u32 words (code 4k + e at bit
// (4k + e)·INT_BITS, little-endian across words), lanes one after another: a warp's load of a
// superchunk is one contiguous run. The row's last `tail_steps` (< 8) steps form a shorter
// superchunk of `tail_words` words a lane. Columns past `cols` hold code 0. The scale table holds,
// per row and group, s (KIND < 2) or the pair (s, m) (KIND 2); groups are 2^group_shift columns.
//
//   int_mv:      y = W·x for one vector, one warp INT_ROWS rows: each step's four products summed,
//                then s·(d − o·Σx) + m·Σx; the activations are loaded once for the warp's rows.
//   int_gather:  the input in a matrix's stored column order, for int_mv (GPTQ's act order).
//   int_dequant: W as BF16, row-major, in the original column order: each weight s·(q − o) + m rounded once per operation (no
//                FMA, the CPU's arithmetic) and then to BF16, bit for bit the CPU form's values.
#ifndef INT_BITS
#error INT_BITS must be defined (2..8)
#endif
#ifndef INT_KIND
#define INT_KIND 0
#endif
#ifndef INT_ROWS
#define INT_ROWS 2
#endif
#define INT_WARPS 4
#define INT_SM (INT_KIND == 2 ? 2 : 1)

struct IntParams {
    const u32* w;
    const float* sm;   // rows × groups_per_row × INT_SM
    const float* x;    // int_mv: cols
    float* y;          // int_mv: rows
    bf16_t* out;       // int_dequant: rows × cols
    const u32* perm;   // int_dequant: the original column of each stored one (null: the same)
    long long row_words;
    int rows, cols, groups_per_row, group_shift, full, tail_steps, tail_words;
    float offset;
};

// Code i (0..31) of a lane's words, i a constant after unrolling.
__device__ __forceinline__ u32 code_at(const u32 (&w)[INT_BITS], int i) {
    const int bit = i * INT_BITS, wd = bit >> 5, sh = bit & 31;
    u32 v = w[wd] >> sh;
    if (sh + INT_BITS > 32) v |= w[wd + 1] << (32 - sh);
    return v & ((1u << INT_BITS) - 1u);
}

// Code q (below 2^23) as the float q: OR-ed into the mantissa of 2^23, less 2^23.
__device__ __forceinline__ float code_f(u32 q) { return __uint_as_float(0x4B000000u | q) - 8388608.0f; }

// A lane's words of a full superchunk, in as few loads as their alignment allows.
__device__ __forceinline__ void load_full(const u32* p, u32 (&w)[INT_BITS]) {
#if INT_BITS % 4 == 0
#pragma unroll
    for (int i = 0; i < INT_BITS / 4; ++i) {
        const uint4 v = __ldg((const uint4*)p + i);
        w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
#elif INT_BITS % 2 == 0
#pragma unroll
    for (int i = 0; i < INT_BITS / 2; ++i) {
        const uint2 v = __ldg((const uint2*)p + i);
        w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
#else
#pragma unroll
    for (int i = 0; i < INT_BITS; ++i) w[i] = __ldg(p + i);
#endif
}

// The warp's rows' sums over superchunk j (TAIL: the row's last, of p.tail_steps steps).
template <bool TAIL>
__device__ __forceinline__ void superchunk(const IntParams& p, int j, int row0, int lane, float (&acc)[INT_ROWS]) {
    const int steps = TAIL ? p.tail_steps : 8;
    float4 xv[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int c = (8 * j + k) * 128 + 4 * lane;
        xv[k] = (!TAIL || (k < steps && c < p.cols)) ? __ldca((const float4*)(p.x + c)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#if INT_KIND
    float xs[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) xs[k] = (xv[k].x + xv[k].y) + (xv[k].z + xv[k].w);
#endif
#pragma unroll
    for (int r = 0; r < INT_ROWS; ++r) {
        const int row = row0 + r;
        if (row >= p.rows) break;
        const u32* base = p.w + (long long)row * p.row_words;
        u32 w[INT_BITS];
        if (TAIL) {
            const u32* q = base + (long long)p.full * 32 * INT_BITS + lane * p.tail_words;
#pragma unroll
            for (int i = 0; i < INT_BITS; ++i) w[i] = i < p.tail_words ? __ldg(q + i) : 0u;
        } else {
            load_full(base + ((long long)j * 32 + lane) * INT_BITS, w);
        }
        const float* sm = p.sm + (long long)row * p.groups_per_row * INT_SM;
        float a = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int c = (8 * j + k) * 128 + 4 * lane;
            if (TAIL && (k >= steps || c >= p.cols)) continue;
            const float d = code_f(code_at(w, 4 * k)) * xv[k].x + code_f(code_at(w, 4 * k + 1)) * xv[k].y +
                            code_f(code_at(w, 4 * k + 2)) * xv[k].z + code_f(code_at(w, 4 * k + 3)) * xv[k].w;
            const int g = c >> p.group_shift;
#if INT_KIND == 0
            a += __ldg(sm + g) * d;
#elif INT_KIND == 1
            a += __ldg(sm + g) * (d - p.offset * xs[k]);
#else
            const float2 s = __ldg((const float2*)sm + g);
            a += s.x * (d - p.offset * xs[k]) + s.y * xs[k];
#endif
        }
        acc[r] += a;
    }
}

extern "C" __global__ void __launch_bounds__(INT_WARPS * 32) int_mv(const IntParams p) {
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * INT_WARPS + (threadIdx.x >> 5)) * INT_ROWS;
    pdl_wait();
    pdl_trigger();
    if (row0 >= p.rows) return;
    float acc[INT_ROWS];
#pragma unroll
    for (int r = 0; r < INT_ROWS; ++r) acc[r] = 0.0f;
    for (int j = 0; j < p.full; ++j) superchunk<false>(p, j, row0, lane, acc);
    if (p.tail_steps) superchunk<true>(p, p.full, row0, lane, acc);
#pragma unroll
    for (int r = 0; r < INT_ROWS; ++r) {
        const float t = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < p.rows) p.y[row0 + r] = t;
    }
}

// xg[k] = x[perm[k]]: the input in a matrix's stored column order (GPTQ's activation order).
extern "C" __global__ void __launch_bounds__(256) int_gather(const float* x, const u32* perm, float* xg, int n) {
    pdl_wait();
    pdl_trigger();
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += gridDim.x * blockDim.x) xg[k] = __ldcg(x + __ldg(perm + k));
}

// One thread four consecutive weights (cols is a multiple of 4).
extern "C" __global__ void __launch_bounds__(256) int_dequant(const IntParams p) {
    const int units = p.cols >> 2;
    const long long total = (long long)p.rows * units;
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < total;
         u += (long long)gridDim.x * blockDim.x) {
        const long long row = u / units;
        const int c = (int)(u - row * units) * 4;
        const int step = c >> 7, lane = (c & 127) >> 2, j = step >> 3, k = step & 7;
        const u32* q = p.w + row * p.row_words +
                       (j < p.full ? ((long long)j * 32 + lane) * INT_BITS
                                   : (long long)p.full * 32 * INT_BITS + (long long)lane * p.tail_words);
        const float* sm = p.sm + (row * p.groups_per_row + (c >> p.group_shift)) * INT_SM;
        const float s = __ldg(sm);
        const float m = INT_SM == 2 ? __ldg(sm + 1) : 0.0f;
        u32 packed[2];
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
            float v[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int bit = (4 * k + e + h) * INT_BITS, wd = bit >> 5, sh = bit & 31;
                // The second word is read only when the code spans into it (it is then the lane's).
                const u32 hi = sh + INT_BITS > 32 ? __ldg(q + wd + 1) : 0u;
                const u32 code = __funnelshift_r(__ldg(q + wd), hi, sh) & ((1u << INT_BITS) - 1u);
                // + m even when there are no mins: the CPU adds 0.0 (−0.0 becomes +0.0).
                v[h] = __fadd_rn(__fmul_rn(s, __fsub_rn(code_f(code), p.offset)), m);
            }
            packed[e / 2] = (u32)f32_to_bf16(v[0]) | (u32)f32_to_bf16(v[1]) << 16;
        }
        bf16_t* o = p.out + row * p.cols;
        if (p.perm) {
#pragma unroll
            for (int e = 0; e < 4; ++e) o[__ldg(p.perm + c + e)] = (bf16_t)(packed[e / 2] >> (16 * (e & 1)));
        } else {
            *(uint2*)(o + c) = make_uint2(packed[0], packed[1]);
        }
    }
}
