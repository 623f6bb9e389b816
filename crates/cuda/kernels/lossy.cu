// Lossy-coded matrices (codec `lossy`): E8 or TCQ points, 32 interleaved rANS lanes a tile, row
// scales. One warp decodes one tile, lane l holding rANS state l; after every symbol step the lanes
// whose state fell below 2^16 take the next payload words in lane order (a ballot and a prefix
// count), exactly as the codec's CPU decoder does, so the decoded values are bit-identical to it.
//
//   lossy_decode: the tile's weights, point · row scale, stored as LOSSY_OUT (0 BF16, 1 F16, 2 F32)
//                 row-major: the prefill path's dequantisation (then a GEMM). LOSSY_OUT 3 (FP8
//                 E4M3) and 4 (INT8) store one byte a weight, the code of point · scales[row], where
//                 the host passes as `scales` each row's multiplier of the codec's low-precision
//                 decode (lossy::low: a row's scale is applied by whoever reads the codes).
//   lossy_mv:     y = W·x for one vector, the weights rounded to LOSSY_OUT's precision (what the
//                 container serves) and multiplied as they are decoded: the matrix is never written.
//                 BF16, F16 or F32 only (a code under a row scale is not a served weight): modules
//                 of LOSSY_OUT 3 and 4 hold lossy_decode alone.
// A launch takes up to LOSSY_MAX_PARTS matrices of the same columns (a launch's q/k/v or gate/up),
// each with its own tables and output, so their tiles decode at once.
//
// LOSSY_E8: 1 for E8 points (nine fields a vector of eight weights, 17 tables), 0 for TCQ (one
// symbol a weight from the table of its trellis state's union; the next-state table in shared
// memory). A damaged tile (a word past its payload, a coset out of range, a tile not ending where
// its states and offsets say) sets *err to 1; reads never leave the tile's payload or the tables.
#ifndef LOSSY_E8
#error LOSSY_E8 must be defined (1: E8, 0: TCQ)
#endif
#ifndef LOSSY_OUT
#error LOSSY_OUT must be defined (0: BF16, 1: F16, 2: F32, 3: FP8 E4M3, 4: INT8)
#endif
#ifndef LOSSY_WARPS
#define LOSSY_WARPS 4
#endif
#if LOSSY_OUT < 0 || LOSSY_OUT > 4
#error LOSSY_OUT must be 0, 1, 2, 3 or 4
#endif

#define LOSSY_TABLES 17
#define LOSSY_MAX_NEXT 512
#define LOSSY_MAX_PARTS 3
#define LOSSY_STATE_MIN 65536u

// One matrix of a launch (a launch's parts — q/k/v, gate/up — decode side by side: blocks
// block0.. of the grid are this part's).
struct LossyPart {
    const unsigned long long* ent;  // tables × 2^prob_bits: symbol | (frequency − 1) << 16 | bias << 32
    const float* scales;            // per row (LOSSY_OUT 3, 4: the points' multipliers)
    const u32* states;              // 32 per tile
    const u32* offsets;             // per tile its first payload word; one more at the end
    const unsigned short* payload;
    const unsigned short* next;     // TCQ: next[2·state + branch]
    void* out;                      // lossy_decode: rows × cols; lossy_mv: y (rows, f32)
    int rows, tile_rows, tiles, prob_bits, n_next, block0;
    int mins[LOSSY_TABLES];
};

struct LossyParams {
    LossyPart part[LOSSY_MAX_PARTS];
    const float* x;  // lossy_mv: the input (cols)
    u32* err;
    int cols, n_parts;
};

__device__ __forceinline__ unsigned short f32_to_f16_bits(float f) {
    f = fminf(fmaxf(f, -65504.0f), 65504.0f);
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// The value served: the decoded weight at the container's precision.
__device__ __forceinline__ float lossy_round(float w) {
#if LOSSY_OUT == 0
    return bf16_to_f32(f32_to_bf16(w));
#elif LOSSY_OUT == 1
    return f16_bits_to_f32(f32_to_f16_bits(w));
#else
    return w;
#endif
}

// FP8 E4M3 and INT8 round as the codec's LowPrecision::code: to nearest, ties to even; E4M3
// saturating at ±448 (satfinite), INT8 clamped to ±127.
__device__ __forceinline__ void lossy_store(void* out, size_t i, float w) {
#if LOSSY_OUT == 0
    ((bf16_t*)out)[i] = f32_to_bf16(w);
#elif LOSSY_OUT == 1
    ((unsigned short*)out)[i] = f32_to_f16_bits(w);
#elif LOSSY_OUT == 2
    ((float*)out)[i] = w;
#elif LOSSY_OUT == 3
    unsigned short c;  // w's code in the low byte
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(c) : "f"(0.0f), "f"(w));
    ((unsigned char*)out)[i] = (unsigned char)c;
#else
    ((signed char*)out)[i] = (signed char)(int)fminf(fmaxf(rintf(w), -127.0f), 127.0f);
#endif
}

// One lane's symbol from the table at `base` (= t << prob_bits); no renormalisation.
__device__ __forceinline__ int lossy_sym(u32& x, const LossyPart& m, u32 base, int min, u32 mask) {
    const unsigned long long e = __ldg(m.ent + base + (x & mask));
    const u32 lo = (u32)e;
    x = ((lo >> 16) + 1u) * (x >> m.prob_bits) + (u32)(e >> 32);
    return min + (int)(lo & 0xffffu);
}

// Lanes in `need` (their state below 2^16) take the next words in lane order.
__device__ __forceinline__ void lossy_renorm(u32& x, bool need, u32& pos, u32 end, const unsigned short* w,
                                             int lane, bool& bad) {
    const u32 m = __ballot_sync(0xffffffffu, need);
    if (need) {
        const u32 k = pos + __popc(m & ((1u << lane) - 1u));
        if (k < end) {
            x = (x << 16) | (u32)__ldg(w + k);
        } else {
            bad = true;
        }
    }
    pos += __popc(m);
}

// Partial sums of a product: lanes' values `v` of rows `row` (non-decreasing with the lane) added to
// y[row] in a fixed order (lane 0 of the warp owns the tile's rows), for steps that span rows.
__device__ __forceinline__ void lossy_add_rows(float* y, bool live, int row, float v, int lane) {
    bool done = !live;
    while (true) {
        const u32 a = __ballot_sync(0xffffffffu, !done);
        if (a == 0) break;
        const int r = __shfl_sync(0xffffffffu, row, __ffs(a) - 1);
        const bool mine = !done && row == r;
        const float s = warp_sum(mine ? v : 0.0f);
        if (lane == 0) y[r] += s;
        done |= mine;
    }
}

// This block's part, its fields in registers (indices into the parameter array stay constant).
__device__ __forceinline__ LossyPart lossy_part(const LossyParams& p) {
    const int b = blockIdx.x;
    LossyPart m = p.part[0];
#if LOSSY_MAX_PARTS > 1
    if (p.n_parts > 1 && b >= p.part[1].block0) m = p.part[1];
#endif
#if LOSSY_MAX_PARTS > 2
    if (p.n_parts > 2 && b >= p.part[2].block0) m = p.part[2];
#endif
    return m;
}

template <bool MV>
__device__ __forceinline__ void lossy_tile(const LossyParams& p, const LossyPart& m, const unsigned short* next) {
    static_assert(!MV || LOSSY_OUT <= 2, "lossy_mv multiplies by BF16, F16 or F32 weights only");
    const int lane = threadIdx.x & 31;
    const int tile = (blockIdx.x - m.block0) * LOSSY_WARPS + (threadIdx.x >> 5);
    if (tile >= m.tiles) return;
    const int r0 = tile * m.tile_rows;
    const int nr = min(m.tile_rows, m.rows - r0);
    const int cols = p.cols;
    const int n = nr * cols;
    u32 x = __ldg(m.states + (size_t)tile * 32 + lane);
    u32 pos = __ldg(m.offsets + tile);
    const u32 end = __ldg(m.offsets + tile + 1);
    const u32 mask = (1u << m.prob_bits) - 1u;
    const size_t o0 = (size_t)r0 * cols;
    float* y = MV ? (float*)m.out : nullptr;
    bool bad = false;
#if LOSSY_E8
    const int step_weights = 256;
#else
    const int step_weights = 32;
#endif
    // Steps never span rows when the row length is a multiple of a step: per-lane sums, one warp
    // sum a row. Otherwise each step's values go to their rows through lossy_add_rows.
    const bool aligned = cols % step_weights == 0;
    if (MV && !aligned) {
        for (int i = lane; i < nr; i += 32) y[r0 + i] = 0.0f;
        __syncwarp();
    }
    float acc = 0.0f;
    int acc_row = r0;
#if LOSSY_E8
    const int nvec = n >> 3;
    for (int g = 0; g < nvec; g += 32) {
        const int v = g + lane;
        const bool live = v < nvec;
        int f[9];
        f[0] = live ? lossy_sym(x, m, 0, m.mins[0], mask) : 0;
        lossy_renorm(x, live && x < LOSSY_STATE_MIN, pos, end, m.payload, lane, bad);
        int c = f[0];
        if (c != 0 && c != 1) {
            if (live) bad = true;
            c = 0;
        }
#pragma unroll
        for (int j = 1; j < 9; ++j) {
            const int t = 2 * j - 1 + c;
            const int mn = c ? m.mins[2 * j] : m.mins[2 * j - 1];
            f[j] = live ? lossy_sym(x, m, (u32)t << m.prob_bits, mn, mask) : 0;
            lossy_renorm(x, live && x < LOSSY_STATE_MIN, pos, end, m.payload, lane, bad);
        }
        const int row = live ? (v << 3) / cols : 0;
        float w[8];
        if (live) {
            const float s = __ldg(m.scales + r0 + row);
            const float h = 0.5f * (float)c;
            int par = 0;
#pragma unroll
            for (int i = 0; i < 7; ++i) {
                par += f[1 + i];
                w[i] = ((float)f[1 + i] + h) * s;
            }
            w[7] = ((float)(2 * f[8] + (par & 1)) + h) * s;
        }
        if (!MV) {
            if (live) {
#pragma unroll
                for (int i = 0; i < 8; ++i) lossy_store(m.out, o0 + ((size_t)v << 3) + i, w[i]);
            }
        } else {
            float d = 0.0f;
            if (live) {
                const int col = (v << 3) - row * cols;
                const float4 a = __ldca((const float4*)(p.x + col));
                const float4 b = __ldca((const float4*)(p.x + col + 4));
                d = lossy_round(w[0]) * a.x + lossy_round(w[1]) * a.y + lossy_round(w[2]) * a.z +
                    lossy_round(w[3]) * a.w + lossy_round(w[4]) * b.x + lossy_round(w[5]) * b.y +
                    lossy_round(w[6]) * b.z + lossy_round(w[7]) * b.w;
            }
            if (aligned) {
                const int r = r0 + (g << 3) / cols;  // the whole step's row
                if (r != acc_row) {
                    const float t = warp_sum(acc);
                    if (lane == 0) y[acc_row] = t;
                    acc = 0.0f;
                    acc_row = r;
                }
                acc += d;
            } else {
                lossy_add_rows(y, live, r0 + row, d, lane);
            }
        }
    }
#else
    u32 st = 0;
    int row = lane / cols, col = lane - (lane / cols) * cols;
    for (int g = 0; g < n; g += 32) {
        const int i = g + lane;
        const bool live = i < n;
        float w = 0.0f;
        if (live) {
            const u32 z0 = st & 1u;
            const int k = lossy_sym(x, m, z0 << m.prob_bits, z0 ? m.mins[1] : m.mins[0], mask);
            const u32 nx = 2u * st + (u32)(k & 1);
            st = nx < (u32)m.n_next ? next[nx] : 0u;
            w = (float)(2 * k + (int)z0) * __ldg(m.scales + r0 + row);
        }
        lossy_renorm(x, live && x < LOSSY_STATE_MIN, pos, end, m.payload, lane, bad);
        if (!MV) {
            if (live) lossy_store(m.out, o0 + i, w);
        } else {
            const float d = live ? lossy_round(w) * __ldca(p.x + col) : 0.0f;
            if (aligned) {
                const int r = r0 + g / cols;
                if (r != acc_row) {
                    const float t = warp_sum(acc);
                    if (lane == 0) y[acc_row] = t;
                    acc = 0.0f;
                    acc_row = r;
                }
                acc += d;
            } else {
                lossy_add_rows(y, live, r0 + row, d, lane);
            }
        }
        col += 32;
        while (col >= cols) {
            col -= cols;
            ++row;
        }
    }
#endif
    if (MV && aligned) {
        const float t = warp_sum(acc);
        if (lane == 0) y[acc_row] = t;
    }
    if (x != LOSSY_STATE_MIN || pos != end) bad = true;
    if (__any_sync(0xffffffffu, bad) && lane == 0 && p.err) atomicOr(p.err, 1u);
}

__device__ __forceinline__ const unsigned short* lossy_next(const LossyPart& m) {
#if LOSSY_E8
    return nullptr;
#else
    __shared__ unsigned short next[LOSSY_MAX_NEXT];
    for (int i = threadIdx.x; i < m.n_next && i < LOSSY_MAX_NEXT; i += blockDim.x) next[i] = m.next[i];
    __syncthreads();
    return next;
#endif
}

extern "C" __global__ void __launch_bounds__(LOSSY_WARPS * 32) lossy_decode(const LossyParams p) {
    const LossyPart m = lossy_part(p);
    const unsigned short* next = lossy_next(m);
    lossy_tile<false>(p, m, next);
}

#if LOSSY_OUT <= 2
extern "C" __global__ void __launch_bounds__(LOSSY_WARPS * 32) lossy_mv(const LossyParams p) {
    const LossyPart m = lossy_part(p);
    const unsigned short* next = lossy_next(m);
    pdl_wait();
    lossy_tile<true>(p, m, next);
    pdl_trigger();
}
#endif
