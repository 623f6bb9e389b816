// GGUF quantised blocks as the file stores them (model form `ggml`), one module per ggml type
// (GGML_TYPE: ggml's type id). Every type is read as ggml's dequantisation regrouped, as the CPU
// form reads it (crates/model/src/forms/ggml.rs): eight consecutive weights of a block are small
// integer codes q with one factor a and one offset m (zero where the type has none), w = a·q + m.
//
//   ggml_mv:      y = W·x for one vector, one warp a row, each lane eight weights at a time:
//                 Σ a·Σ(q·x) + m·Σx in f32 (the CPU's sums, in another order).
//   ggml_dequant: W as BF16, row-major (prefill's dequantisation, then the GEMM): each weight
//                 a·q + m rounded once to f32 (no FMA: ggml's and the CPU's rounding) and then to
//                 BF16, bit for bit the CPU's dequantisation rounded.
//
// Rows are `row_bytes` apart and whole blocks; the buffer is padded by at least 8 bytes (load8
// reads aligned words up to 3 bytes past the last one it needs). Every byte pattern decodes to
// some value: there is nothing to reject.
#ifndef GGML_TYPE
#error GGML_TYPE must be defined (a ggml type id)
#endif
#ifndef GGML_WARPS
#define GGML_WARPS 4
#endif
// Rows a warp: 2 for the two-row paths (Q4_K, Q5_K, Q6_K), else 1. Set by the launcher (ops/ggml.rs).
#ifndef GGML_ROWS
#define GGML_ROWS 1
#endif
#if GGML_ROWS == 2 && GGML_TYPE != 12 && GGML_TYPE != 13 && GGML_TYPE != 14
#error two rows a warp only for Q4_K, Q5_K and Q6_K
#endif
// The two-row paths of Q4_K and Q5_K keep the activations' sums a sub-block in shared memory.
#define GGML_XSUMS (GGML_ROWS == 2 && (GGML_TYPE == 12 || GGML_TYPE == 13))

struct GgmlParams {
    const unsigned char* w;
    const float* x;    // ggml_mv: cols
    float* y;          // ggml_mv: rows
    bf16_t* out;       // ggml_dequant: rows × cols
    long long row_bytes;
    int rows, cols;
    // ggml_mv's two-row paths: 2^split_log2 warps a row pair, each over a share of its blocks.
    int split_log2;
};

__device__ __forceinline__ u32 b8(const unsigned char* p) { return (u32)__ldg(p); }
// Every f16 field sits at an even offset of a block of even size (MXFP4, of 17 bytes, has none).
__device__ __forceinline__ float f16_at(const unsigned char* p) {
    return f16_bits_to_f32(__ldg((const unsigned short*)p));
}
__device__ __forceinline__ u32 ld_word(const unsigned char* p) {
    return __ldg((const u32*)p);
}
// Four bytes at any address (little-endian), from the two aligned words around them.
__device__ __forceinline__ u32 load4(const unsigned char* p) {
    const unsigned long long a = (unsigned long long)p;
    const unsigned char* base = (const unsigned char*)(a & ~3ull);
    const u32 sh = (u32)(a & 3) * 8;
    return __funnelshift_r(ld_word(base), ld_word(base + 4), sh);
}
// Eight bytes at an address aligned to A bytes: byte i of the result is p[i] (low word bytes
// 0..3). One load where A is 8, two where it is 4, else three aligned words shifted into place.
template <int A>
__device__ __forceinline__ uint2 load8(const unsigned char* p) {
    if (A >= 8) return __ldg((const uint2*)p);
    if (A >= 4) return make_uint2(ld_word(p), ld_word(p + 4));
    const unsigned long long a = (unsigned long long)p;
    const unsigned char* base = (const unsigned char*)(a & ~3ull);
    const u32 sh = (u32)(a & 3) * 8;
    const u32 w0 = ld_word(base), w1 = ld_word(base + 4), w2 = ld_word(base + 8);
    return make_uint2(__funnelshift_r(w0, w1, sh), __funnelshift_r(w1, w2, sh));
}
__device__ __forceinline__ u32 byte_of(uint2 v, int i) {
    return ((i < 4 ? v.x : v.y) >> (8 * (i & 3))) & 0xffu;
}

// ggml's 4-bit lookup values plus a bias that makes them unsigned (the codes are converted to
// float by OR-ing them into 2^23's mantissa, GGML_OFF below), in registers (a local array indexed
// at run time would live in local memory): IQ4_NL's sixteen int8 values + 128 through byte
// permutes, and E2M1 doubled (the FP4 types' factor is halved) + 12 from its bits.
__device__ __forceinline__ u32 iq4nl_biased(u32 i) {
    // 1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241 as bytes.
    const u32 lo = __byte_perm(0x3F2D1801u, 0x766A5D4Fu, i & 7u);
    const u32 hi = __byte_perm(0xA6998D81u, 0xF1D9C5B5u, i & 7u);
    return (i & 8u ? hi : lo) & 0xFFu;
}
__device__ __forceinline__ u32 fp4_biased(u32 i) {
    const u32 k = i & 7u;
    const u32 mag = k < 4u ? k : (2u + (k & 1u)) << ((k >> 1) - 1u);
    return i & 8u ? 12u - mag : 12u + mag;
}
// Half the E8M0 scale 2^(e − 127), from its bits (the two smallest are subnormal).
__device__ __forceinline__ float e8m0_half(u32 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}
// Half the unsigned E4M3 scale (bias 7; bit 7 ignored; 0x7F, its NaN, is zero as in ggml).
__device__ __forceinline__ float ue4m3_half(u32 x) {
    if (x == 0x7Fu) return 0.0f;
    const u32 exp = (x >> 3) & 0xFu, man = x & 7u;
    return exp == 0 ? (float)man * (1.0f / 1024.0f) : __uint_as_float(((exp + 119u) << 23) | (man << 20));
}
// Eight low (shift 0) or high (shift 4) nibbles of the bytes at p.
template <int A>
__device__ __forceinline__ void nibbles(const unsigned char* p, u32 shift, u32 n[8]) {
    const uint2 v = load8<A>(p);
#pragma unroll
    for (int i = 0; i < 8; ++i) n[i] = (byte_of(v, i) >> shift) & 0xFu;
}

#if GGML_TYPE == 2  // Q4_0: d qs[16]
#define GGML_BS 32
#define GGML_TS 18
#define GGML_MINS 0
#elif GGML_TYPE == 3  // Q4_1: d m qs[16]
#define GGML_BS 32
#define GGML_TS 20
#define GGML_MINS 1
#elif GGML_TYPE == 6  // Q5_0: d qh[4] qs[16]
#define GGML_BS 32
#define GGML_TS 22
#define GGML_MINS 0
#elif GGML_TYPE == 7  // Q5_1: d m qh[4] qs[16]
#define GGML_BS 32
#define GGML_TS 24
#define GGML_MINS 1
#elif GGML_TYPE == 8  // Q8_0: d qs[32]
#define GGML_BS 32
#define GGML_TS 34
#define GGML_MINS 0
#elif GGML_TYPE == 10  // Q2_K: scales[16] qs[64] d dmin
#define GGML_BS 256
#define GGML_TS 84
#define GGML_MINS 1
#elif GGML_TYPE == 11  // Q3_K: hmask[32] qs[64] scales[12] d
#define GGML_BS 256
#define GGML_TS 110
#define GGML_MINS 0
#elif GGML_TYPE == 12  // Q4_K: d dmin scales[12] qs[128]
#define GGML_BS 256
#define GGML_TS 144
#define GGML_MINS 1
#elif GGML_TYPE == 13  // Q5_K: d dmin scales[12] qh[32] qs[128]
#define GGML_BS 256
#define GGML_TS 176
#define GGML_MINS 1
#elif GGML_TYPE == 14  // Q6_K: ql[128] qh[64] scales[16] d
#define GGML_BS 256
#define GGML_TS 210
#define GGML_MINS 0
#elif GGML_TYPE == 20  // IQ4_NL: d qs[16]
#define GGML_BS 32
#define GGML_TS 18
#define GGML_MINS 0
#elif GGML_TYPE == 23  // IQ4_XS: d scales_h scales_l[4] qs[128]
#define GGML_BS 256
#define GGML_TS 136
#define GGML_MINS 0
#elif GGML_TYPE == 39  // MXFP4: e qs[16]
#define GGML_BS 32
#define GGML_TS 17
#define GGML_MINS 0
#elif GGML_TYPE == 40  // NVFP4: d[4] qs[32]
#define GGML_BS 64
#define GGML_TS 36
#define GGML_MINS 0
#else
#error GGML_TYPE is not a type these kernels run
#endif
// The codes decode to q + GGML_OFF, unsigned and below 256 (the signed codes biased).
#if GGML_TYPE == 2
#define GGML_OFF 8
#elif GGML_TYPE == 6
#define GGML_OFF 16
#elif GGML_TYPE == 8 || GGML_TYPE == 20 || GGML_TYPE == 23
#define GGML_OFF 128
#elif GGML_TYPE == 11
#define GGML_OFF 4
#elif GGML_TYPE == 14
#define GGML_OFF 32
#elif GGML_TYPE == 39 || GGML_TYPE == 40
#define GGML_OFF 12
#else
#define GGML_OFF 0
#endif
// Blocks start at multiples of their size in a buffer aligned to 256: their alignment is the
// largest power of two dividing GGML_TS. LOAD8(p, A) reads eight bytes at an offset of a block
// that is a multiple of A.
#define GGML_ALIGN ((GGML_TS & 15) == 0 ? 16 : (GGML_TS & 7) == 0 ? 8 : (GGML_TS & 3) == 0 ? 4 : (GGML_TS & 1) == 0 ? 2 : 1)
#define LOAD8(p, A) load8<(GGML_ALIGN < (A) ? GGML_ALIGN : (A))>(p)
#define NIBBLES(p, A, shift, n) nibbles<(GGML_ALIGN < (A) ? GGML_ALIGN : (A))>(p, shift, n)

// Weights e..e+8 of block b (e a multiple of 8): their codes + GGML_OFF, factor and offset.
__device__ __forceinline__ void ggml_decode8(const unsigned char* b, int e, u32 q[8], float& a, float& m) {
    m = 0.0f;
    u32 n[8];
#if GGML_TYPE == 2 || GGML_TYPE == 3 || GGML_TYPE == 20 || GGML_TYPE == 39
#if GGML_TYPE == 3
    const int qs = 4;
#elif GGML_TYPE == 39
    const int qs = 1;
#else
    const int qs = 2;
#endif
    NIBBLES(b + qs + (e & 15), qs == 4 ? 4 : qs == 2 ? 2 : 1, e >= 16 ? 4u : 0u, n);
#if GGML_TYPE == 39
    a = e8m0_half(b8(b));
#else
    a = f16_at(b);
#endif
#if GGML_TYPE == 3
    m = f16_at(b + 2);
#endif
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#if GGML_TYPE == 2 || GGML_TYPE == 3
        q[i] = n[i];
#elif GGML_TYPE == 20
        q[i] = iq4nl_biased(n[i]);
#else
        q[i] = fp4_biased(n[i]);
#endif
    }
#elif GGML_TYPE == 6 || GGML_TYPE == 7
    const int hb = GGML_TYPE == 6 ? 2 : 4;
    const u32 qh = load4(b + hb);
    NIBBLES(b + hb + 4 + (e & 15), hb == 4 ? 8 : 2, e >= 16 ? 4u : 0u, n);
    a = f16_at(b);
    if (GGML_TYPE == 7) m = f16_at(b + 2);
#pragma unroll
    for (int i = 0; i < 8; ++i)
        q[i] = n[i] | ((qh >> (e + i)) & 1u) << 4;
#elif GGML_TYPE == 8
    const uint2 v = LOAD8(b + 2 + e, 2);
    a = f16_at(b);
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = byte_of(v, i) ^ 0x80u;
#elif GGML_TYPE == 10 || GGML_TYPE == 11
    const int half = e >> 7, j = (e & 127) >> 5, l = e & 31;
    const uint2 lo = LOAD8(b + (GGML_TYPE == 10 ? 16 : 32) + 32 * half + l, 8);
#if GGML_TYPE == 10
    const u32 sc = b8(b + (e >> 4));
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
    a = d * (float)(sc & 0xFu);
    m = -(dmin * (float)(sc >> 4));
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = (byte_of(lo, i) >> (2 * j)) & 3u;
#else
    const uint2 hm = LOAD8(b + l, 8);
    const int s = e >> 4, k = s >> 2, at = s & 3;
    const u32 a0 = b8(b + 96 + at), a1 = b8(b + 100 + at), t = b8(b + 104 + at);
    u32 sc;
    if (k == 0) sc = (a0 & 0xFu) | ((t & 3u) << 4);
    else if (k == 1) sc = (a1 & 0xFu) | (((t >> 2) & 3u) << 4);
    else if (k == 2) sc = (a0 >> 4) | (((t >> 4) & 3u) << 4);
    else sc = (a1 >> 4) | (((t >> 6) & 3u) << 4);
    a = f16_at(b + 108) * (float)((int)sc - 32);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        // low − (high bit clear ? 4 : 0), + 4.
        q[i] = ((byte_of(lo, i) >> (2 * j)) & 3u) | ((byte_of(hm, i) >> (4 * half + j)) & 1u) << 2;
    }
#endif
#elif GGML_TYPE == 12 || GGML_TYPE == 13
    const int c = e >> 6, l = e & 63;
    // The 16-byte header (d, dmin, 12 bytes of scales and mins) in one load: blocks of 144 and 176
    // bytes are 16-byte aligned.
    const uint4 hd = __ldg((const uint4*)b);
    const int j = e >> 5;
    u32 sc, mn;
    {
        // scale_min_k4 on the header's bytes: byte k of the 12 (selected, not indexed: an array
        // indexed at run time would live in local memory).
#define SBYTE(k) ((((k) < 4 ? hd.y : (k) < 8 ? hd.z : hd.w) >> (8 * ((k) & 3))) & 0xFFu)
        if (j < 4) {
            sc = SBYTE(j) & 63u;
            mn = SBYTE(j + 4) & 63u;
        } else {
            sc = (SBYTE(j + 4) & 0x0Fu) | ((SBYTE(j - 4) >> 6) << 4);
            mn = (SBYTE(j + 4) >> 4) | ((SBYTE(j) >> 6) << 4);
        }
#undef SBYTE
    }
    a = f16_bits_to_f32((unsigned short)(hd.x & 0xFFFFu)) * (float)sc;
    m = -(f16_bits_to_f32((unsigned short)(hd.x >> 16)) * (float)mn);
    NIBBLES(b + (GGML_TYPE == 12 ? 16 : 48) + 32 * c + (l & 31), 8, l >= 32 ? 4u : 0u, n);
#if GGML_TYPE == 12
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = n[i];
#else
    const uint2 h = LOAD8(b + 16 + (l & 31), 8);
    const int hs = 2 * c + (l >= 32 ? 1 : 0);
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = n[i] | ((byte_of(h, i) >> hs) & 1u) << 4;
#endif
#elif GGML_TYPE == 14
    const int nh = e >> 7, r = e & 127, t = r >> 5, l = r & 31;
    NIBBLES(b + 64 * nh + l + (t & 1) * 32, 8, t >= 2 ? 4u : 0u, n);
    const uint2 h = LOAD8(b + 128 + 32 * nh + l, 8);
    a = f16_at(b + 208) * (float)(int)(signed char)b8(b + 192 + (e >> 4));
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = n[i] | ((byte_of(h, i) >> (2 * t)) & 3u) << 4;
#elif GGML_TYPE == 23
    const int ib = e >> 5, j = e & 31;
    const u32 sh = b8(b + 2) | b8(b + 3) << 8;
    const int ls = (int)(((b8(b + 4 + (ib >> 1)) >> (4 * (ib & 1))) & 0xFu) | (((sh >> (2 * ib)) & 3u) << 4));
    a = f16_at(b) * (float)(ls - 32);
    NIBBLES(b + 8 + 16 * ib + (j & 15), 8, j >= 16 ? 4u : 0u, n);
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = iq4nl_biased(n[i]);
#elif GGML_TYPE == 40
    const int s = e >> 4;
    a = ue4m3_half(b8(b + s));
    NIBBLES(b + 4 + 8 * s, 4, (e & 15) >= 8 ? 4u : 0u, n);
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = fp4_biased(n[i]);
#endif
}

// Code q + GGML_OFF (below 2^23) as the float q, exactly: OR-ed into the mantissa of 2^23, less
// 2^23 + GGML_OFF (one logic op and one add; an integer conversion runs at a fraction of the rate).
__device__ __forceinline__ float code_f(u32 n) {
    return __uint_as_float(0x4B000000u | n) - (8388608.0f + (float)GGML_OFF);
}

// Byte i of v (a code q below 128) as the float 1/2 + q/256, exactly: one permute into the
// mantissa of 1/2, no conversion and no subtraction (the two-row paths: with f = 1/2 + q/256,
// Σ(a·q + m)·x = 256a·Σf·x + (m − 128a)·Σx).
__device__ __forceinline__ float half_plus(u32 v, int i) {
    return __uint_as_float(__byte_perm(v, 0x3F000000u, 0x7054u | ((u32)i << 8)));
}

// Σ w·x over chunk c (weights 8c..8c+8) of the row at w, x0 and x1 its activations.
__device__ __forceinline__ float chunk_dot(const unsigned char* w, int c, float4 x0, float4 x1) {
    const int blk = c / (GGML_BS / 8), e = (c % (GGML_BS / 8)) * 8;
    u32 q[8];
    float a, m;
    ggml_decode8(w + (long long)blk * GGML_TS, e, q, a, m);
    const float s = code_f(q[0]) * x0.x + code_f(q[1]) * x0.y + code_f(q[2]) * x0.z + code_f(q[3]) * x0.w +
                    code_f(q[4]) * x1.x + code_f(q[5]) * x1.y + code_f(q[6]) * x1.z + code_f(q[7]) * x1.w;
#if GGML_MINS
    return a * s + m * ((x0.x + x0.y + x0.z + x0.w) + (x1.x + x1.y + x1.z + x1.w));
#else
    return a * s;
#endif
}

#if GGML_TYPE == 12 || GGML_TYPE == 13
// Q4_K and Q5_K, two rows a warp, two blocks at a time. Lane (c, j) = (lane >> 3, lane & 7)
// multiplies columns 64c + 4j.. and 64c + 32 + 4j.. of each block: the low and high nibbles of qs
// word 8c + j, so a warp's loads of codes and of activations are each 128 contiguous bytes (the
// lanes of the earlier unit path read x 256 bytes apart, and L1 bound it: bench/RESULTS.md). The
// scales are decoded once a sub-block and row for the warp, one sub-block a lane, and shuffled to
// the eight lanes that use them; each code is a float by one byte permute (1/2 + q/256), and the
// offsets m·Σx of a sub-block use its activations' sum from shared memory (k_xsums).
#define K_QS (GGML_TYPE == 12 ? 16 : 48)
// Factor and offset of sub-block j (scale_min_k4 on the 16-byte header, without branches: the
// lanes of a warp take different j).
__device__ __forceinline__ void k_scale_min(uint4 hd, int j, float& a, float& m) {
    const u32 sh = 8u * (u32)(j & 3);
    const u32 by = (hd.y >> sh) & 0xFFu, bz = (hd.z >> sh) & 0xFFu, bw = (hd.w >> sh) & 0xFFu;
    const bool low = j < 4;
    const u32 sc = low ? by & 63u : (bw & 0x0Fu) | ((by >> 6) << 4);
    const u32 mn = low ? bz & 63u : (bw >> 4) | ((bz >> 6) << 4);
    a = f16_bits_to_f32((unsigned short)(hd.x & 0xFFFFu)) * (float)sc;
    m = -(f16_bits_to_f32((unsigned short)(hd.x >> 16)) * (float)mn);
}
// Σ over each sub-block of 32 activations (cols / 32 of them), by the whole block of threads,
// into shared memory (dynamic, cols / 8 bytes: ops/ggml.rs sizes it).
extern __shared__ float k_xsum[];
__device__ __forceinline__ void k_xsums(const float* x, int cols) {
    const int lane = threadIdx.x & 31;
    for (int k = threadIdx.x >> 5; k < cols >> 7; k += GGML_WARPS) {
        const float4 v = __ldca((const float4*)(x + 128 * k + 4 * lane));
        float t = (v.x + v.y) + (v.z + v.w);
        t += __shfl_xor_sync(0xffffffffu, t, 1);
        t += __shfl_xor_sync(0xffffffffu, t, 2);
        t += __shfl_xor_sync(0xffffffffu, t, 4);
        if ((lane & 7) == 0) k_xsum[4 * k + (lane >> 3)] = t;
    }
    __syncthreads();
}
// A lane's place in the two rows' blocks, advanced a block at a time by k_blocks: its codes' word
// in each row (q0, q1), the header it decodes (hd: sub-block j = lane & 7 of row (lane >> 3) & 1 of
// block lane >> 4 from here), its activations and the decoded sub-block's sum.
struct KLane {
    const unsigned char *q0, *q1, *hd;
    const float *x, *xs;
};
// NB blocks of the two rows into y0 and y1. Lane l decodes sub-block l & 7 of row (l >> 3) & 1
// of block 2i + (l >> 4) of them (i < ⌈NB/2⌉; none for lanes 16.. when NB is 1), adds that
// sub-block's offset term into ym (its row's) and hands 256a to the lanes using it.
template <int NB>
__device__ __forceinline__ void k_blocks(KLane& p, float& y0, float& y1, float& ym) {
    const int lane = threadIdx.x & 31, c = lane >> 3;
    constexpr int IT = (NB + 1) / 2;
    float A[IT];
#pragma unroll
    for (int i = 0; i < IT; ++i) {
        A[i] = 0.0f;
        if (NB == 1 && lane >= 16) continue;
        const uint4 hd = __ldg((const uint4*)(p.hd + 2 * i * GGML_TS));
        float a, m;
        k_scale_min(hd, lane & 7, a, m);
        A[i] = 256.0f * a;
        ym = fmaf(m - 128.0f * a, p.xs[16 * i], ym);
    }
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        const float4 xl = __ldca((const float4*)(p.x + 256 * b)), xh = __ldca((const float4*)(p.x + 256 * b + 32));
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const unsigned char* qp = (r ? p.q1 : p.q0) + b * GGML_TS;
            const u32 q = __ldg((const u32*)qp);
            u32 lo = q & 0x0F0F0F0Fu, hi = (q >> 4) & 0x0F0F0F0Fu;
#if GGML_TYPE == 13
            // qh[32] sits 32 bytes before qs, bytes 4j.. of it (qp is 32c + 4j into qs).
            const u32 h = __ldg((const u32*)(qp - 32 - 32 * c));
            lo |= ((h >> (2 * c)) & 0x01010101u) << 4;
            hi |= ((h >> (2 * c + 1)) & 0x01010101u) << 4;
#endif
            float sl = half_plus(lo, 0) * xl.x, sh = half_plus(hi, 0) * xh.x;
            sl = fmaf(half_plus(lo, 1), xl.y, sl);
            sh = fmaf(half_plus(hi, 1), xh.y, sh);
            sl = fmaf(half_plus(lo, 2), xl.z, sl);
            sh = fmaf(half_plus(hi, 2), xh.z, sh);
            sl = fmaf(half_plus(lo, 3), xl.w, sl);
            sh = fmaf(half_plus(hi, 3), xh.w, sh);
            const int src = ((b & 1) << 4) | (r << 3) | (2 * c);
            const float al = __shfl_sync(0xffffffffu, A[b >> 1], src);
            const float ah = __shfl_sync(0xffffffffu, A[b >> 1], src + 1);
            if (r == 0) y0 = fmaf(al, sl, fmaf(ah, sh, y0));
            else y1 = fmaf(al, sl, fmaf(ah, sh, y1));
        }
    }
    p.q0 += NB * GGML_TS;
    p.q1 += NB * GGML_TS;
    p.hd += NB * GGML_TS;
    p.x += 256 * NB;
    p.xs += 8 * NB;
}
#endif

// The q8 products (`--activations q8`, llama.cpp's precision): the activations as 8-bit codes
// per 32 (ggml_q8x), multiplied by the weights' codes four at a time with dp4a, a quarter of the
// f32 path's instructions a weight. Q4_K only.
#define GGML_Q8 (GGML_TYPE == 12)
#if GGML_Q8 && GGML_ROWS == 2
// x as 8-bit codes: per 32 activations q = round_even(x·127/max|x|), d = max|x|/127 and d·Σq
// into ds (q·d summed is what the product multiplies: the offsets' Σx is d·Σq, not Σx, so that
// the product is the dequantised weights' with the quantised activations). A thread a value;
// cols a multiple of 32.
extern "C" __global__ void __launch_bounds__(256) ggml_q8x(const float* __restrict__ x, signed char* __restrict__ q, float2* __restrict__ ds, int cols) {
    pdl_wait();
    pdl_trigger();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= cols) return;  // whole warps: cols and blockDim are multiples of 32
    const float v = x[i];
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const int c = __float2int_rn(v * id);
    int sum = c;
#pragma unroll
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    q[i] = (signed char)c;
    const float d = amax / 127.0f;
    if ((threadIdx.x & 31) == 0) ds[i >> 5] = make_float2(d, d * (float)sum);
}
// Σ w·x over blocks kb..kb1 of the Q4_K rows at w and w + rb (rb 0: the first again) with q8
// activations xq and their (d, d·Σq) a 32 ds. Two blocks a step: lane l takes block kb + h
// (h = l >> 4); in it t = l & 15 takes qs bytes 8t.. (c = t >> 2, u = t & 3): columns 64c + 8u..
// (low nibbles, sub-block 2c) and 64c + 32 + 8u.. (high nibbles, 2c + 1), each eight by two dp4a;
// the warp's loads of codes and of activations are contiguous. Lane l also decodes the scale and
// offset of sub-block l & 7 of row (l >> 3) & 1 of its block (k_scale_min), shuffled to the
// lanes using it; the offset's term m·d·Σq is added by the decoding lane.
__device__ __forceinline__ float2 q8_dot(const unsigned char* w, long long rb, const signed char* xq, const float2* ds, int kb, int kb1) {
    const int lane = threadIdx.x & 31, h = lane >> 4, t = lane & 15, c = t >> 2, u = t & 3;
    const unsigned char* q = w + (long long)(kb + h) * GGML_TS + 16 + 32 * c + 8 * u;
    const unsigned char* hd = w + ((lane >> 3) & 1) * rb + (long long)(kb + h) * GGML_TS;
    const signed char* xp = xq + 256 * (kb + h) + 64 * c + 8 * u;
    const float2* dp = ds + 8 * (kb + h) + 2 * c;
    const float2* dm = ds + 8 * (kb + h) + (lane & 7);
    float y0 = 0.0f, y1 = 0.0f, ym = 0.0f;
    for (; kb < kb1; kb += 2) {
        const bool mine = kb + h < kb1;  // a second block past the share's end: none
        float a = 0.0f;
        float4 dd = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        uint2 xl = make_uint2(0u, 0u), xh = xl, q0 = xl, q1 = xl;
        if (mine) {
            float m;
            k_scale_min(__ldg((const uint4*)hd), lane & 7, a, m);
            ym = fmaf(m, __ldg(&dm->y), ym);
            xl = __ldg((const uint2*)xp);
            xh = __ldg((const uint2*)(xp + 32));
            dd = __ldg((const float4*)dp);
            q0 = __ldg((const uint2*)q);
            q1 = __ldg((const uint2*)(q + rb));
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint2 qq = r ? q1 : q0;
            int sl = __dp4a((int)(qq.x & 0x0F0F0F0Fu), (int)xl.x, 0);
            sl = __dp4a((int)(qq.y & 0x0F0F0F0Fu), (int)xl.y, sl);
            int sh = __dp4a((int)((qq.x >> 4) & 0x0F0F0F0Fu), (int)xh.x, 0);
            sh = __dp4a((int)((qq.y >> 4) & 0x0F0F0F0Fu), (int)xh.y, sh);
            const int src = (h << 4) | (r << 3) | (2 * c);
            const float al = __shfl_sync(0xffffffffu, a, src) * dd.x;
            const float ah = __shfl_sync(0xffffffffu, a, src + 1) * dd.z;
            if (r == 0) y0 = fmaf(al, (float)sl, fmaf(ah, (float)sh, y0));
            else y1 = fmaf(al, (float)sl, fmaf(ah, (float)sh, y1));
        }
        q += 2 * GGML_TS;
        hd += 2 * GGML_TS;
        xp += 512;
        dp += 16;
        dm += 16;
    }
    const bool second = (lane >> 3) & 1;
    return make_float2(warp_sum(y0 + (second ? 0.0f : ym)), warp_sum(y1 + (second ? ym : 0.0f)));
}
#endif

#if GGML_TYPE == 14
// Four bytes at an even address (Q6_K's blocks of 210 bytes are 2-byte aligned).
__device__ __forceinline__ u32 ld_u16x2(const unsigned char* p) {
    return (u32)__ldg((const unsigned short*)p) | (u32)__ldg((const unsigned short*)(p + 2)) << 16;
}
// Q6_K, two rows a warp. Lane (h, t, l) = (lane >> 4, (lane >> 3) & 1, lane & 7) multiplies
// columns 128h + 32t + 4l.. of each block (the low nibbles of ql bytes 64h + 32t + 4l.., bits 2t of
// qh bytes 32h + 4l..) and the four 64 columns on (the high nibbles, bits 2t + 4): the warp's
// loads of ql, qh and x are each contiguous. Its pointers into each row's blocks (ql, qh, the two
// scales, d) advance a block at a time, so that a block's loads need no address arithmetic.
struct Q6Lane {
    const unsigned char *ql[2], *qh[2], *sc[2], *d[2];
    const float* x;
};
// Signed byte v (0..255 as loaded) as a float: OR-ed into 2^23's mantissa, biased by 128.
__device__ __forceinline__ float s8_f(u32 v) {
    return __uint_as_float(0x4B000000u | (v ^ 0x80u)) - 8388736.0f;
}
// Block B (0, 1, …) on from the lane's pointers into y0 and y1. With f = 1/2 + q/256,
// Σ a·(q − 32)·x = 256a·(Σf·x − (5/8)·Σx).
template <int B>
__device__ __forceinline__ void q6_block(const Q6Lane& p, float& y0, float& y1) {
    const float* xp = p.x + 256 * B;
    const float4 xl = __ldca((const float4*)xp), xh = __ldca((const float4*)(xp + 64));
    const float tl = -0.625f * ((xl.x + xl.y) + (xl.z + xl.w));
    const float th = -0.625f * ((xh.x + xh.y) + (xh.z + xh.w));
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u32 ql = ld_u16x2(p.ql[r] + B * GGML_TS), qh = ld_u16x2(p.qh[r] + B * GGML_TS);
        const int t = (threadIdx.x >> 3) & 1;
        const u32 lo = (ql & 0x0F0F0F0Fu) | ((qh >> (2 * t)) & 0x03030303u) << 4;
        const u32 hi = ((ql >> 4) & 0x0F0F0F0Fu) | ((qh >> (2 * t + 4)) & 0x03030303u) << 4;
        const float d = 256.0f * f16_at(p.d[r] + B * GGML_TS);
        const float al = d * s8_f(b8(p.sc[r] + B * GGML_TS)), ah = d * s8_f(b8(p.sc[r] + B * GGML_TS + 4));
        float sl = fmaf(half_plus(lo, 0), xl.x, tl), sh = fmaf(half_plus(hi, 0), xh.x, th);
        sl = fmaf(half_plus(lo, 1), xl.y, sl);
        sh = fmaf(half_plus(hi, 1), xh.y, sh);
        sl = fmaf(half_plus(lo, 2), xl.z, sl);
        sh = fmaf(half_plus(hi, 2), xh.z, sh);
        sl = fmaf(half_plus(lo, 3), xl.w, sl);
        sh = fmaf(half_plus(hi, 3), xh.w, sh);
        const float v = fmaf(al, sl, ah * sh);
        if (r == 0) y0 += v;
        else y1 += v;
    }
}
__device__ __forceinline__ void q6_advance(Q6Lane& p, int n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        p.ql[r] += n * GGML_TS;
        p.qh[r] += n * GGML_TS;
        p.sc[r] += n * GGML_TS;
        p.d[r] += n * GGML_TS;
    }
    p.x += 256 * n;
}
#endif

// ggml_mv: two rows a warp for Q4_K and Q5_K (two blocks at a time, k_blocks) and Q6_K (a
// block at a time, q6_block), one row a warp for the other types.
#if GGML_ROWS == 2
// Σ w·x over blocks kb..kb1 of the rows at w and w + rb (none where rb is 0: the second row is
// the first again), on every lane.
__device__ __forceinline__ float2 rows2_dot(const unsigned char* w, long long rb, const float* x, int kb, int kb1) {
    const int lane = threadIdx.x & 31;
    w += (long long)kb * GGML_TS;
    x += 256 * kb;
#if GGML_TYPE == 14
    const int h = lane >> 4, t = (lane >> 3) & 1, l = lane & 7;
    Q6Lane p;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const unsigned char* b = w + r * rb;
        p.ql[r] = b + 64 * h + 32 * t + 4 * l;
        p.qh[r] = b + 128 + 32 * h + 4 * l;
        p.sc[r] = b + 192 + 8 * h + 2 * t + (l >> 2);
        p.d[r] = b + 208;
    }
    p.x = x + 128 * h + 32 * t + 4 * l;
    float y0 = 0.0f, y1 = 0.0f;
    for (; kb + 2 <= kb1; kb += 2) {
        q6_block<0>(p, y0, y1);
        q6_block<1>(p, y0, y1);
        q6_advance(p, 2);
    }
    if (kb < kb1) q6_block<0>(p, y0, y1);
    return make_float2(warp_sum(y0), warp_sum(y1));
#else
    const int c = lane >> 3, j = lane & 7;
    KLane p;
    p.q0 = w + K_QS + 32 * c + 4 * j;
    p.q1 = p.q0 + rb;
    p.hd = w + ((lane >> 3) & 1) * rb + (lane >> 4) * GGML_TS;
    p.x = x + 64 * c + 4 * j;
    p.xs = k_xsum + 8 * (kb + (lane >> 4)) + j;
    float y0 = 0.0f, y1 = 0.0f, ym = 0.0f;
    // (Four blocks at a time were no faster: bench/RESULTS.md.)
    for (; kb + 2 <= kb1; kb += 2) k_blocks<2>(p, y0, y1, ym);
    if (kb < kb1) k_blocks<1>(p, y0, y1, ym);
    const bool second = (lane >> 3) & 1;
    return make_float2(warp_sum(y0 + (second ? 0.0f : ym)), warp_sum(y1 + (second ? ym : 0.0f)));
#endif
}

// The two-row kernels' body: 2^split_log2 warps a row pair (rows from w, activations x, outputs
// y, p.rows rows of p.cols), each over its share of the blocks; their sums meet in shared memory
// (a matrix of few rows would otherwise leave most of the device idle). Every thread of the
// block must call it.
__device__ __forceinline__ void rows2_mv(const GgmlParams& p, const unsigned char* w, const float* x, float* y) {
    __shared__ float2 part[GGML_WARPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sl = p.split_log2;
    const int row = 2 * (blockIdx.x * (GGML_WARPS >> sl) + (warp >> sl)), k = warp & ((1 << sl) - 1);
    const int nb = p.cols >> 8;
    const long long rb = row + 1 < p.rows ? p.row_bytes : 0;
    float2 v = make_float2(0.0f, 0.0f);
    if (row < p.rows) v = rows2_dot(w + (long long)row * p.row_bytes, rb, x, (k * nb) >> sl, ((k + 1) * nb) >> sl);
    if (sl > 0) {
        if (lane == 0) part[warp] = v;
        __syncthreads();
        if (k != 0) return;
        for (int i = 1; i < 1 << sl; ++i) {
            v.x += part[warp + i].x;
            v.y += part[warp + i].y;
        }
    }
    if (lane == 0 && row < p.rows) {
        y[row] = v.x;
        if (rb != 0) y[row + 1] = v.y;
    }
}
#else
// One warp a row: each lane four chunks of 8 in flight (their loads issued together), then the
// rest one at a time. (A block of four warps a row, and four rows a block sharing the activations'
// loads, were no faster: bench/RESULTS.md.) Lane 0 writes *y.
__device__ __forceinline__ void ggml_mv_row(const unsigned char* w, const float* x, float* y, int cols) {
    const int lane = threadIdx.x & 31;
    const int chunks = cols >> 3;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int c = lane;
    for (; c + 96 < chunks; c += 128) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int k = c + 32 * u;
            acc[u] += chunk_dot(w, k, __ldca((const float4*)(x + 8 * k)), __ldca((const float4*)(x + 8 * k + 4)));
        }
    }
    for (; c < chunks; c += 32)
        acc[0] += chunk_dot(w, c, __ldca((const float4*)(x + 8 * c)), __ldca((const float4*)(x + 8 * c + 4)));
    const float t = warp_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
    if (lane == 0) *y = t;
}
#endif

extern "C" __global__ void __launch_bounds__(GGML_WARPS * 32) ggml_mv(const GgmlParams p) {
    pdl_wait();
    pdl_trigger();
#if GGML_XSUMS
    k_xsums(p.x, p.cols);
#endif
#if GGML_ROWS == 2
    rows2_mv(p, p.w, p.x, p.y);
#else
    const int row = blockIdx.x * GGML_WARPS + (threadIdx.x >> 5);
    if (row < p.rows) ggml_mv_row(p.w + (long long)row * p.row_bytes, p.x, p.y + row, p.cols);
#endif
}

// Gathered ggml_mv over a stack of equal matrices (a mixture of experts: p.rows rows an expert,
// expert e's rows from e * p.rows): slot s = blockIdx.y multiplies expert experts[s] by x row
// s / x_group into y + s * y_stride (as gemv_bf16_experts). The expert index is the previous
// kernel's output, read after pdl_wait. (At most 128 registers: the slot's offsets spilled one
// under the compiler's default.)
extern "C" __global__ void __launch_bounds__(GGML_WARPS * 32, 4)
ggml_mv_experts(GgmlParams p, const int* __restrict__ experts, int n_experts, int x_group, int y_stride) {
    pdl_wait();
    pdl_trigger();
    const int s = blockIdx.y;
    // The slot's input, matrix and output (offsets in int where the launcher's checks keep them:
    // other spellings spilled a register for some types).
    p.x += (s / x_group) * p.cols;
#if GGML_XSUMS
    k_xsums(p.x, p.cols);
#endif
    const int e = min(max(__ldcg(experts + s), 0), n_experts - 1);
    p.w += (long long)e * p.rows * p.row_bytes;
    p.y += s * y_stride;
#if GGML_ROWS == 2
    rows2_mv(p, p.w, p.x, p.y);
#else
    const int row = blockIdx.x * GGML_WARPS + (threadIdx.x >> 5);
    if (row < p.rows) ggml_mv_row(p.w + (long long)row * p.row_bytes, p.x, p.y + row, p.cols);
#endif
}

#if GGML_Q8 && GGML_ROWS == 2
// ggml_mv with q8 activations: p.x holds ggml_q8x's codes, ds its (d, d·Σq) a 32. Its row pairs
// shared between warps as rows2_mv's. (rows2_mv over a functor choosing the dot product made the
// f32 products slower: bench/RESULTS.md.)
extern "C" __global__ void __launch_bounds__(GGML_WARPS * 32) ggml_mv_q8(const GgmlParams p, const float2* __restrict__ ds) {
    pdl_wait();
    pdl_trigger();
    __shared__ float2 part[GGML_WARPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sl = p.split_log2;
    const int row = 2 * (blockIdx.x * (GGML_WARPS >> sl) + (warp >> sl)), k = warp & ((1 << sl) - 1);
    const int nb = p.cols >> 8;
    const long long rb = row + 1 < p.rows ? p.row_bytes : 0;
    float2 v = make_float2(0.0f, 0.0f);
    if (row < p.rows)
        v = q8_dot(p.w + (long long)row * p.row_bytes, rb, (const signed char*)p.x, ds, (k * nb) >> sl, ((k + 1) * nb) >> sl);
    if (sl > 0) {
        if (lane == 0) part[warp] = v;
        __syncthreads();
        if (k != 0) return;
        for (int i = 1; i < 1 << sl; ++i) {
            v.x += part[warp + i].x;
            v.y += part[warp + i].y;
        }
    }
    if (lane == 0 && row < p.rows) {
        p.y[row] = v.x;
        if (rb != 0) p.y[row + 1] = v.y;
    }
}
#endif

extern "C" __global__ void __launch_bounds__(256) ggml_dequant(const GgmlParams p) {
    const int chunks = p.cols >> 3;
    const long long total = (long long)p.rows * chunks;
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < total;
         c += (long long)gridDim.x * blockDim.x) {
        const long long row = c / chunks;
        const int cc = (int)(c - row * chunks);
        const int blk = cc / (GGML_BS / 8), e = (cc % (GGML_BS / 8)) * 8;
        u32 q[8];
        float a, m;
        ggml_decode8(p.w + row * p.row_bytes + (long long)blk * GGML_TS, e, q, a, m);
        u32 packed[4];
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
            float w0 = __fmul_rn(a, code_f(q[i])), w1 = __fmul_rn(a, code_f(q[i + 1]));
#if GGML_MINS
            w0 = __fadd_rn(w0, m);
            w1 = __fadd_rn(w1, m);
#endif
            packed[i / 2] = (u32)f32_to_bf16(w0) | (u32)f32_to_bf16(w1) << 16;
        }
        *(uint4*)(p.out + 8 * c) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
}
