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
// Rows a warp: 2 for the unit path (Q4_K, Q5_K), else 1. Set by the launcher (ops/ggml.rs).
#ifndef GGML_ROWS
#define GGML_ROWS 1
#endif
#if GGML_ROWS == 2 && GGML_TYPE != 12 && GGML_TYPE != 13
#error two rows a warp only for Q4_K and Q5_K
#endif

struct GgmlParams {
    const unsigned char* w;
    const float* x;    // ggml_mv: cols
    float* y;          // ggml_mv: rows
    bf16_t* out;       // ggml_dequant: rows × cols
    long long row_bytes;
    int rows, cols;
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
// Q4_K and Q5_K by units of 64 weights (a pair of sub-blocks, 32 bytes of qs) of two rows: the
// scales and mins decoded once a unit, the activations loaded and summed once for both rows, each
// code made a float by one byte permute: about four instructions a weight against the chunk path's
// eight or more (Q5_K's products faster on every shape measured, Q4_K's on two of three:
// bench/RESULTS.md).
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
// Byte i of v (a code q below 128) as the float 1/2 + q/256, exactly: one permute into the
// mantissa of 1/2, no conversion and no subtraction; the 1/2 comes off with the activations' sum.
__device__ __forceinline__ float half_plus(u32 v, int i) {
    return __uint_as_float(__byte_perm(v, 0x3F000000u, 0x7054u | ((u32)i << 8)));
}
// Σ w·x over unit c (0..4) of block b of two rows (b and b + rb), x the block's 256 activations:
// the unit is sub-blocks 2c (low nibbles of qs[32c..32c+32]) and 2c + 1 (their high nibbles). The
// activations' loads and sums are shared by the rows. With f = 1/2 + q/256,
// Σ(a·q + m)·x = 256a·Σf·x + (m − 128a)·Σx.
__device__ __forceinline__ float2 k_unit_dot2(const unsigned char* b, long long rb, int c, const float* x) {
    float a[2][2], m[2][2], s[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll
    for (int row = 0; row < 2; ++row) {
        const uint4 hd = __ldg((const uint4*)(b + row * rb));
        k_scale_min(hd, 2 * c, a[row][0], m[row][0]);
        k_scale_min(hd, 2 * c + 1, a[row][1], m[row][1]);
    }
    float t0 = 0.0f, t1 = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float* x0 = x + 64 * c + 16 * h;
        float4 xa[4], xb[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            xa[k] = __ldca((const float4*)(x0 + 4 * k));
            xb[k] = __ldca((const float4*)(x0 + 32 + 4 * k));
            t0 += (xa[k].x + xa[k].y) + (xa[k].z + xa[k].w);
            t1 += (xb[k].x + xb[k].y) + (xb[k].z + xb[k].w);
        }
#pragma unroll
        for (int row = 0; row < 2; ++row) {
            const unsigned char* br = b + row * rb;
            const uint4 qs = __ldg((const uint4*)(br + K_QS + 32 * c + 16 * h));
            const u32 qw[4] = {qs.x, qs.y, qs.z, qs.w};
#if GGML_TYPE == 13
            const uint4 qh = __ldg((const uint4*)(br + 16 + 16 * h));
            const u32 hw[4] = {qh.x, qh.y, qh.z, qh.w};
#endif
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                u32 lo = qw[k] & 0x0F0F0F0Fu, hi = (qw[k] >> 4) & 0x0F0F0F0Fu;
#if GGML_TYPE == 13
                lo |= ((hw[k] >> (2 * c)) & 0x01010101u) << 4;
                hi |= ((hw[k] >> (2 * c + 1)) & 0x01010101u) << 4;
#endif
                float s0 = s[row][0], s1 = s[row][1];
                s0 = fmaf(half_plus(lo, 0), xa[k].x, s0);
                s0 = fmaf(half_plus(lo, 1), xa[k].y, s0);
                s0 = fmaf(half_plus(lo, 2), xa[k].z, s0);
                s0 = fmaf(half_plus(lo, 3), xa[k].w, s0);
                s1 = fmaf(half_plus(hi, 0), xb[k].x, s1);
                s1 = fmaf(half_plus(hi, 1), xb[k].y, s1);
                s1 = fmaf(half_plus(hi, 2), xb[k].z, s1);
                s1 = fmaf(half_plus(hi, 3), xb[k].w, s1);
                s[row][0] = s0;
                s[row][1] = s1;
            }
        }
    }
    float r[2];
#pragma unroll
    for (int row = 0; row < 2; ++row)
        r[row] = (256.0f * a[row][0] * s[row][0] + (m[row][0] - 128.0f * a[row][0]) * t0) +
                 (256.0f * a[row][1] * s[row][1] + (m[row][1] - 128.0f * a[row][1]) * t1);
    return make_float2(r[0], r[1]);
}
#endif

// One warp a row, or two (GGML_ROWS). Q4_K and Q5_K: each lane a unit of 64 weights of two rows,
// two units in flight. The other types: each lane four chunks of 8 in flight (their loads issued together), then the rest one at a time.
// (A block of four warps a row, and four rows a block sharing the activations' loads, were no
// faster: bench/RESULTS.md.) Lane 0 writes *y.
__device__ __forceinline__ void ggml_mv_row(const unsigned char* w, long long rb, const float* x, float* y, int cols) {
    const int lane = threadIdx.x & 31;
#if GGML_ROWS == 2
    // Two rows a warp (y[0] and y[1]; the second's weights rb bytes on, none where rb is 0). Unit
    // v is unit v & 3 of block v >> 2; a lane's units keep their index in the block.
    const int units = (cols >> 8) * 4;
    float2 k0 = make_float2(0.0f, 0.0f), k1 = k0;
    int v = lane;
    for (; v + 32 < units; v += 64) {
        const float2 d0 = k_unit_dot2(w + (long long)(v >> 2) * GGML_TS, rb, v & 3, x + 256 * (v >> 2));
        const float2 d1 = k_unit_dot2(w + (long long)((v + 32) >> 2) * GGML_TS, rb, v & 3, x + 256 * ((v + 32) >> 2));
        k0.x += d0.x; k0.y += d0.y; k1.x += d1.x; k1.y += d1.y;
    }
    if (v < units) {
        const float2 d0 = k_unit_dot2(w + (long long)(v >> 2) * GGML_TS, rb, v & 3, x + 256 * (v >> 2));
        k0.x += d0.x; k0.y += d0.y;
    }
    const float y0 = warp_sum(k0.x + k1.x), y1 = warp_sum(k0.y + k1.y);
    if (lane == 0) {
        y[0] = y0;
        if (rb != 0) y[1] = y1;
    }
#else
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
#endif
}

extern "C" __global__ void __launch_bounds__(GGML_WARPS * 32) ggml_mv(const GgmlParams p) {
    const int row = (blockIdx.x * GGML_WARPS + (threadIdx.x >> 5)) * GGML_ROWS;
    pdl_wait();
    pdl_trigger();
    if (row >= p.rows) return;
    ggml_mv_row(p.w + (long long)row * p.row_bytes, row + 1 < p.rows ? p.row_bytes : 0, p.x, p.y + row, p.cols);
}

// Gathered ggml_mv over a stack of equal matrices (a mixture of experts: p.rows rows an expert,
// expert e's rows from e * p.rows): slot s = blockIdx.y multiplies expert experts[s] by x row
// s / x_group into y + s * y_stride (as gemv_bf16_experts). The expert index is the previous
// kernel's output, read after pdl_wait. (At most 128 registers: the slot's offsets spilled one
// under the compiler's default for the unit path.)
extern "C" __global__ void __launch_bounds__(GGML_WARPS * 32, 4)
ggml_mv_experts(GgmlParams p, const int* __restrict__ experts, int n_experts, int x_group, int y_stride) {
    const int row = (blockIdx.x * GGML_WARPS + (threadIdx.x >> 5)) * GGML_ROWS;
    pdl_wait();
    pdl_trigger();
    if (row >= p.rows) return;
    const int s = blockIdx.y;
    const int e = min(max(__ldcg(experts + s), 0), n_experts - 1);
    // The slot's matrix, input and output as ggml_mv's (offsets in int where the launcher's
    // checks keep them: other spellings spilled a register for some types).
    p.w += (long long)e * p.rows * p.row_bytes;
    p.x += (s / x_group) * p.cols;
    p.y += s * y_stride;
    ggml_mv_row(p.w + (long long)row * p.row_bytes, row + 1 < p.rows ? p.row_bytes : 0, p.x, p.y + row, p.cols);
}

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
