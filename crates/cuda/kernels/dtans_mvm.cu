// dtANS-LLM fused kernels (docs/dtans.md is the layout spec; crates/codec/src/dtans/decode.rs the
// CPU reference these kernels match bit for bit):
//   DT_OUT 0  mvm:     y = W x (+ group scales/mins in a per-group / per-slice epilogue)
//   DT_OUT 1  decode:  the source elements (u16 for bf16, one code byte for code-only payloads)
//   DT_OUT 2  dequant: BF16 weights (bf16 payload: its elements; others: scale·(v − offset) + min)
//
// One warp decodes one tile (32 rows × DT_SC columns), lane l row l; a block's warps take
// consecutive bands of ONE matrix in ONE column slice (blockIdx.y), so they share the decoding table
// and the activation slice in shared memory. Up to DT_MAXMATS matrices with the same coding and
// input (q/k/v, gate/up) go in one launch: blockIdx.x runs over the blocks of all of them.
//
// Per lane and quartet: four table lookups (index = a byte of the state word b, plus companion
// bits), x ← x·(r0 r1 r2 r3) + digits in one 32×32→64 multiply-add, then the next state word comes
// from the accumulator (x ≥ 2^32) or from the warp's stream, read through a 1 KiB shared-memory chunk
// whose header names the read step at which it runs out; the next chunk is prefetched with cp.async
// into a second 1 KiB buffer. Raw bytes and companion words (fixed rates) are loaded one iteration
// (DT_UQ quartets) ahead into registers, and the copy engine prefetches raw, companion and chunks
// DT_PD blocks of 8 quartets ahead into L2. Escapes (decoded as zero) are fixed after the main loop.
//
// The shared table holds per slot {r, d, v0, v1}: v = the value of each code of the symbol as f32
// bits (code-only payloads, from a 256-entry LUT), or for bf16 the exponent in place (code << 23):
// a bf16 weight is then (prmt(raw, sign-replicate) & 0x807F0000) | v, two instructions. The table
// is stored DT_REP times interleaved and lane l reads copy l mod DT_REP: a warp's 16-byte lookups of
// random slots then take the minimum of 4 shared-memory wavefronts instead of ~12 (bank conflicts
// made the first version shared-memory bound; measured on an H200, bench/RESULTS.md).
// DT_EB 4 (bf16): the table holds 4-byte entries instead, the codec's r | d << 8 | c0 << 16 | c1 << 24
// (Single: r | d << 8 | c0 << 23, the exponent in place), DT_REP (up to 32) copies: with 32 every
// lane reads its own bank, one wavefront per warp lookup instead of four. r and d cost a mask and a
// byte permute per lookup; the exponents need no field extraction because the merge keeps only bits
// 23..30 of the (shifted) entry: (prmt(raw, sign-replicate) & 0x807FFFFF) | (S & 0x7F800000).
// DT_EB 8 (bf16 Pair): {r | d << 8 | c0 << 23, c1 << 23}, up to 16 copies, two wavefronts per warp
// lookup but no exponent shifts.
//
// Memory safety does not depend on the data: table indices are < M by construction, shared-memory
// chunk reads are masked to the buffer, global chunk loads are bounded by the tile's stream, and
// escape columns outside the slice are ignored. Inconsistent data sets *err (if given) to 1.

#ifndef DT_K
#define DT_K 2          // codes per symbol: 1 Single, 2 Pair
#endif
#ifndef DT_LOG2M
#define DT_LOG2M 8
#endif
#ifndef DT_SC
#define DT_SC 2048
#endif
#ifndef DT_WARPS
#define DT_WARPS 4
#endif
#ifndef DT_BF16
#define DT_BF16 1       // 1: bf16 payload (exponent coded, raw sign/mantissa byte); 0: code-only
#endif
#ifndef DT_CB
#define DT_CB 8         // bits per code
#endif
#ifndef DT_GS
#define DT_GS 0         // dequant groups smaller than the slice: group size (compile time); 0: none
#endif
#ifndef DT_OUT
#define DT_OUT 0
#endif

#ifndef DT_PD
#define DT_PD 4         // L2 prefetch distance in blocks of 8 quartets (raw, companion) and chunks
#endif
#ifndef DT_NOPF
#define DT_NOPF 0       // 1: no L2 bulk prefetch (for timing comparisons)
#endif

#ifndef DT_REP
#define DT_REP 8        // copies of the table, interleaved so that lanes l mod DT_REP hit different banks
#endif
#ifndef DT_FAST
#define DT_FAST 0       // 1: byte-permute table addressing and a 32-bit high-word test (fewer instructions)
#endif
#ifndef DT_EB
#define DT_EB 16        // bytes per shared table entry: 16, or 4 / 8 for bf16 (see above)
#endif
#ifndef DT_MINW
#define DT_MINW 0       // resident warps per SM the register allocation must allow (0: no cap)
#endif
#define DT_MINB (DT_MINW > 0 ? (DT_MINW + DT_WARPS - 1) / DT_WARPS : 1)

#define DT_MAXMATS 4
#define DT_CBITS (DT_LOG2M - 8)
#define DT_M (1 << DT_LOG2M)
#define DT_Q (DT_SC / DT_K / 4)   // quartets per lane per tile
#ifndef DT_UQ
#define DT_UQ 8                   // quartets per (unrolled) iteration
#endif
#define DT_IT (DT_Q / DT_UQ)      // iterations per tile
#define DT_ICOLS (4 * DT_K * DT_UQ)  // columns per iteration
#define DT_RAWU (DT_ICOLS / 16)   // 16-byte raw units per lane per iteration
#define DT_CWI (DT_UQ * DT_CBITS / 8)  // companion words per lane per iteration
#define DT_NB (DT_Q / 8)          // prefetch blocks of 8 quartets per tile
#define DT_BRAW (8 * 4 * DT_K / 16 * 512)  // raw bytes of a block
#define DT_BCOMP (DT_CBITS * 128)          // companion bytes of a block
#define DT_CW (DT_CWI > 0 ? DT_CWI : 1)  // (register array size)
#define DT_NO_DUE 0xFFFFFFFFu
#define DT_TABW (DT_M * DT_REP * DT_EB / 4)  // table words in shared memory
// Decode/dequant outputs are staged per warp in shared memory (row = lane) for one iteration, then
// stored transposed (lanes = consecutive 16-byte units of a row) so that a store instruction writes
// whole row segments instead of 32 rows' scattered 8/16-byte pieces (uncoalesced, ~0.8 TB/s).
#define DT_ES (DT_OUT == 2 || DT_BF16 ? 2 : 1)  // bytes per output element (decode/dequant)
#define DT_SW (DT_ICOLS * DT_ES)                // staged bytes of a row per iteration
#define DT_SU (DT_SW < 16 ? DT_SW : 16)         // bytes per transposed store
#define DT_SPW ((DT_SW + DT_SU) / 4)            // words per staged row (one unit of padding: fewer bank conflicts)
#define DT_STAGE (DT_OUT == 0 ? 0 : 32 * DT_SPW)  // staging words per warp

static_assert(DT_K == 1 || DT_K == 2, "DT_K must be 1 (Single) or 2 (Pair)");
static_assert(DT_LOG2M == 8 || DT_LOG2M == 9 || DT_LOG2M == 10 || DT_LOG2M == 12, "DT_LOG2M must be 8, 9, 10 or 12");
static_assert(DT_SC >= 64 && DT_SC <= 2048 && (DT_SC & (DT_SC - 1)) == 0, "DT_SC must be a power of two in 64..2048");
static_assert(DT_UQ == 2 || DT_UQ == 4 || DT_UQ == 8, "DT_UQ must be 2, 4 or 8");
static_assert(DT_Q % DT_UQ == 0, "a lane's quartets must be whole iterations");
static_assert((DT_UQ * 4 * DT_CBITS) % 32 == 0, "an iteration must use whole companion words");
static_assert(!DT_BF16 || DT_ICOLS % 16 == 0, "an iteration must use whole 16-byte raw units");
static_assert(DT_WARPS >= 1 && DT_WARPS <= 32, "DT_WARPS must be 1..32");
static_assert(DT_CB >= 2 && DT_CB <= 8 && DT_K * DT_CB <= 16, "codes must fit the 16-bit payload");
static_assert(!DT_BF16 || DT_CB == 8, "bf16 codes are 8-bit exponents");
static_assert(DT_GS == 0 || (DT_GS % (4 * DT_K) == 0 && DT_SC % DT_GS == 0 && DT_GS < DT_SC),
              "DT_GS must be a multiple of 4·k dividing DT_SC");
static_assert(DT_GS == 0 || DT_GS <= DT_ICOLS ? true : DT_GS % DT_ICOLS == 0,
              "groups larger than an iteration must be whole iterations");
static_assert((DT_REP & (DT_REP - 1)) == 0 && DT_REP >= 1 && DT_REP * DT_EB <= 128,
              "DT_REP must be a power of two with at most 128 bytes of copies per slot");
static_assert(DT_EB == 16 || (DT_BF16 && (DT_EB == 4 || (DT_EB == 8 && DT_K == 2))),
              "4-byte entries: bf16 only; 8-byte entries: bf16 Pair only");
static_assert(DT_OUT >= 0 && DT_OUT <= 2, "DT_OUT must be 0 (mvm), 1 (decode) or 2 (dequant)");

struct DtMat {
    const u32* entries;        // M decoder entries r | d << 8 | payload << 16
    const u32* lut;            // 256 f32 bit patterns: the value of each code (code-only payloads)
    const u32* tiles;          // two words per tile
    const u32* stream;
    const u32* companion;
    const unsigned char* raw;
    const float* scales;       // groups: rows × ⌈cols / group⌉
    const float* mins;         // or null
    void* out;                 // mvm: f32 [rows]; decode: u16/u8 [rows × cols]; dequant: bf16
    unsigned long long stream_len;
    int rows, bands, block0;   // block0: first blockIdx.x of this matrix
    float offset;
};

struct DtParams {
    const float* x;
    u32* err;
    int cols, slices, n_mats, group;  // group: 0 none, else columns per group (runtime, ≥ DT_SC)
    DtMat m[DT_MAXMATS];
};

__device__ __forceinline__ u32 dt_prmt(u32 a, u32 b, u32 s) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}

__device__ __forceinline__ u32 dt_smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void dt_cp_async16(u32 saddr, const void* g, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(saddr), "l"(g), "r"(bytes) : "memory");
}
__device__ __forceinline__ void dt_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void dt_cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Asks the copy engine to bring `bytes` (a multiple of 16, 16-byte aligned) into L2, no waiting.
__device__ __forceinline__ void dt_prefetch_l2(const void* p, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

__device__ __forceinline__ u32 dt_ld_nc(const u32* p) {
    u32 r;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ u32 u4get(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The f32 bits of a bf16 weight: raw byte `j` of `rw` (sign << 7 | mantissa) merged with the
// exponent in bits 23..30 of `v` (its other bits are ignored). prmt puts the raw byte in byte 2, its
// sign replicated in byte 3 and zeros below; one LOP3 keeps the sign and the 7 mantissa bits of it.
__device__ __forceinline__ u32 dt_bf16_bits(u32 rw, int j, u32 v) {
    const u32 sel = 0x44u | ((u32)j << 8) | ((u32)(j | 8) << 12);
    u32 f;  // bit select (a & c) | (b & ~c) as one LOP3 (the compiler splits the C form in two)
    asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(f) : "r"(dt_prmt(rw, 0u, sel)), "r"(v), "n"(0x807FFFFF));
    return f;
}

// A warp's reader of its tile's stream through two 1 KiB shared-memory chunk buffers. Offsets are
// in bytes so that a read address is one multiply-add and one LOP3: cur | ((pos + 4·rank) mod 1 KiB).
struct DtReader {
    u32* buf;          // the block's chunk buffers (2 KiB per warp)
    u32 cur;           // byte offset of the current chunk buffer: warp·2048 + 0 or 1024
    u32 pos;           // byte offset of the next word in the current chunk
    u32 due, bad;
    u32 duer;          // due − (step − rel) of the caller's frame: the fast test compares a constant
    int next;          // word offset (from the tile start) of the next chunk to load
    int len;           // words in the tile's stream
    const u32* s;      // tile start
};

__device__ __forceinline__ u32 dt_buf_word(const DtReader& r, u32 off) {
    return *(const u32*)((const char*)r.buf + off);
}

// Loads the 256-word chunk at word `at` of the tile into `dst` (words past the stream are zeros).
__device__ __forceinline__ void dt_load_chunk(const DtReader& r, u32* dst, int at, int lane) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int u = lane + 32 * h;
        const int w = at + 4 * u;
        const bool ok = w + 4 <= r.len;
        dt_cp_async16(dt_smem_addr(dst + 4 * u), ok ? (const void*)(r.s + w) : (const void*)r.s, ok ? 16u : 0u);
    }
    dt_cp_commit();
}

// L2 prefetch of the chunk at word `at` of the tile (as far as the stream goes).
__device__ __forceinline__ void dt_prefetch_stream(const DtReader& r, int at) {
    const int left = r.len - at;
    if (left > 0) dt_prefetch_l2(r.s + at, (u32)(left < 256 ? left : 256) * 4u);
}

// Read step `step` (`rel` in the caller's frame, see DtReader::duer): lanes with `need` take the
// next words in lane order. Uniform control flow.
__device__ __forceinline__ u32 dt_read(DtReader& r, bool need, u32 step, u32 rel, u32 lt_mask, int lane) {
    const u32 mask = __ballot_sync(0xffffffffu, need);
    const u32 n = __popc(mask);
    const u32 rank = __popc(mask & lt_mask);
    u32 w;
    if (rel != r.duer) {
        w = dt_buf_word(r, r.cur | ((r.pos + 4u * rank) & 1020u));  // lanes that do not need it ignore it
        r.pos += 4u * n;  // an overrun shows at the next due step or at the end
    } else {
        const u32 avail = 256u - (r.pos >> 2);
        dt_cp_wait<0>();
        __syncwarp();
        w = rank < avail ? dt_buf_word(r, r.cur | ((r.pos + 4u * rank) & 1020u))
                         : dt_buf_word(r, (r.cur ^ 1024u) | ((4u + 4u * (rank - avail)) & 1020u));
        r.bad |= n <= avail;
        __syncwarp();
        dt_load_chunk(r, (u32*)((char*)r.buf + r.cur), r.next, lane);
        if (!DT_NOPF && lane == 0) dt_prefetch_stream(r, r.next + 256 * (DT_PD - 1));
        r.next += 256;
        r.cur ^= 1024u;
        r.pos = ((1u + n - avail) & 511u) * 4u;
        const u32 nd = dt_buf_word(r, r.cur);
        r.bad |= nd <= step;
        r.due = nd;
        r.duer = nd - (step - rel);
    }
    return w;
}

// The value of a code as the table stores it.
__device__ __forceinline__ u32 dt_code_value(const DtMat& m, u32 c) {
#if DT_BF16
    return c << 23;
#elif DT_OUT == 1
    return c;
#else
    return __ldg(m.lut + c);
#endif
}

#if DT_OUT != 0
// Stages quartet `u` of this iteration (4·k output elements of the lane's row, DT_ES bytes each).
__device__ __forceinline__ void dt_stage_quartet(u32* st, int lane, int u, const u32 (&h)[4 * DT_K]) {
    u32* d = st + lane * DT_SPW + u * (4 * DT_K * DT_ES / 4);
#if DT_ES == 2
    if (DT_K == 2)
        *(uint4*)d = make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4 % (4 * DT_K)] | h[5 % (4 * DT_K)] << 16,
                                h[6 % (4 * DT_K)] | h[7 % (4 * DT_K)] << 16);
    else
        *(uint2*)d = make_uint2(h[0] | h[1] << 16, h[2] | h[3] << 16);
#else
    const u32 w0 = h[0] | h[1] << 8 | h[2] << 16 | h[3] << 24;
    if (DT_K == 2)
        *(uint2*)d = make_uint2(w0, h[4 % (4 * DT_K)] | h[5 % (4 * DT_K)] << 8 | h[6 % (4 * DT_K)] << 16 |
                                        h[7 % (4 * DT_K)] << 24);
    else
        *d = w0;
#endif
}

// Stores the staged iteration (32 rows × DT_ICOLS columns from column c0) transposed: lane i takes
// 16-byte unit i mod units-per-row of row i / units-per-row, so consecutive lanes write consecutive
// bytes of a row. Rows past the matrix and columns past `cols` are skipped; rows whose start is not
// unit-aligned (cols·DT_ES not a multiple of the unit) and the ragged end go element by element.
// The barriers order the staging against these reads and the next iteration's staging.
__device__ __forceinline__ void dt_flush(const u32* st, int lane, void* out, int row0, int rows, int cols, int c0) {
    constexpr int UPR = DT_SW / DT_SU;  // units per row
    constexpr int EPU = DT_SU / DT_ES;  // elements per unit
    __syncwarp();
#pragma unroll 1
    for (int t = 0; t < UPR; ++t) {
        const int i = lane + 32 * t;
        const int r = i / UPR, j = i % UPR;
        const u32* sp = st + r * DT_SPW + j * (DT_SU / 4);
        const int row = row0 + r, c = c0 + j * EPU;
        if (row >= rows || c >= cols) continue;
        unsigned char* dst = (unsigned char*)out + ((size_t)row * cols + c) * DT_ES;
        if ((cols * DT_ES) % DT_SU == 0 && c + EPU <= cols) {
            if (DT_SU == 16)
                *(uint4*)dst = *(const uint4*)sp;
            else if (DT_SU == 8)
                *(uint2*)dst = *(const uint2*)sp;
            else
                *(u32*)dst = *sp;
        } else {
            const unsigned char* sb = (const unsigned char*)sp;
#pragma unroll
            for (int e = 0; e < EPU; ++e)
                if (c + e < cols) {
                    if (DT_ES == 2)
                        ((bf16_t*)dst)[e] = ((const bf16_t*)sb)[e];
                    else
                        dst[e] = sb[e];
                }
        }
    }
    __syncwarp();
}
#endif

extern "C" __global__ void __launch_bounds__(DT_WARPS * 32, DT_MINB) dtans_kernel(const DtParams p) {
    extern __shared__ uint4 dt_smem[];
    float* xs = (float*)dt_smem + DT_TABW;  // activation slice (mvm)
    float* xg = xs + (DT_OUT == 0 ? DT_SC : 0);  // activation sums per group (mvm with groups)
    constexpr int XG = DT_OUT == 0 ? ((DT_GS ? DT_SC / DT_GS : 1) + 3) / 4 * 4 : 0;
    u32* bufs = (u32*)(xg + XG);
    u32* stage = bufs + DT_WARPS * 512 + (threadIdx.x >> 5) * DT_STAGE;  // this warp's (decode/dequant)
    (void)stage;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int mi = 0;
#pragma unroll
    for (int i = 1; i < DT_MAXMATS; ++i)
        if (i < p.n_mats && (int)blockIdx.x >= p.m[i].block0) mi = i;
    DtMat m = p.m[0];
#pragma unroll
    for (int i = 1; i < DT_MAXMATS; ++i)
        if (mi == i) m = p.m[i];

    const int slice = blockIdx.y;
    const int col0 = slice * DT_SC;
    const int band = ((int)blockIdx.x - m.block0) * DT_WARPS + warp;

    // Slot s's entry is stored DT_REP times at s·DT_REP + c; lane l reads copy l mod DT_REP, so a
    // quarter-warp's 16-byte reads (a half-warp's 8-byte / a warp's 4-byte reads with 16 / 32
    // copies) of random slots never share a bank.
#if DT_EB == 4
    u32* tab = (u32*)dt_smem;
    for (int i = threadIdx.x; i < DT_M * DT_REP; i += blockDim.x) {
        const u32 e = __ldg(m.entries + i / DT_REP);
        tab[i] = DT_K == 1 ? (e & 0xFFFFu) | ((e >> 16) & 0xFFu) << 23 : e;
    }
#elif DT_EB == 8
    uint2* tab = (uint2*)dt_smem;
    for (int i = threadIdx.x; i < DT_M * DT_REP; i += blockDim.x) {
        const u32 e = __ldg(m.entries + i / DT_REP);
        tab[i] = make_uint2((e & 0xFFFFu) | ((e >> 16) & 0xFFu) << 23, (e >> 24) << 23);
    }
#else
    uint4* tab = dt_smem;
    for (int i = threadIdx.x; i < DT_M * DT_REP; i += blockDim.x) {
        const u32 e = __ldg(m.entries + i / DT_REP);
        const u32 pl = e >> 16, cmask = (1u << DT_CB) - 1u;
        tab[i] = make_uint4(e & 0xFFu, (e >> 8) & 0xFFu, dt_code_value(m, pl & cmask),
                            DT_K == 2 ? dt_code_value(m, (pl >> DT_CB) & cmask) : 0u);
    }
#endif
#if DT_OUT == 0
    for (int c = threadIdx.x; c < DT_SC; c += blockDim.x) xs[c] = col0 + c < p.cols ? __ldg(p.x + col0 + c) : 0.0f;
    if (p.group != 0 || DT_GS != 0) {
        __syncthreads();
        constexpr int GW = DT_GS ? DT_GS : DT_SC;
        for (int g = threadIdx.x; g < DT_SC / GW; g += blockDim.x) {
            float s = 0.0f;
            for (int c = 0; c < GW; ++c) s += xs[g * GW + c];
            xg[g] = s;
        }
    }
#endif
    __syncthreads();
    if (band >= m.bands) return;  // no block-wide barrier below

    const int tiles = m.bands * p.slices;
    const int tile = slice * m.bands + band;
    const u32 o = m.tiles[2 * tile];
    const long long tend = tile + 1 < tiles ? (long long)m.tiles[2 * tile + 2] : (long long)m.stream_len;
    const int row = band * 32 + lane;
    const int rowc = min(row, m.rows - 1);
    const int ncols = min(DT_SC, p.cols - col0);
    const auto* tabl = tab + (lane % DT_REP);  // this lane's copy of slot 0
    u32 lt_mask;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(lt_mask));

    DtReader rd;
    rd.s = m.stream + o;
    rd.len = (int)min(tend - (long long)o, (long long)(1 << 30));
    rd.buf = bufs;
    rd.cur = (u32)warp * 2048u;
    const unsigned char* rawt = m.raw + (size_t)tile * 32 * DT_SC;  // the tile's raw block
    const u32* compt = m.companion + (size_t)tile * 32 * (DT_Q * DT_CBITS / 8);
    if (!DT_NOPF && lane == 0) {
        for (int c = 2; c < 2 + DT_PD - 1; ++c) dt_prefetch_stream(rd, 64 + 256 * c);
        for (int i = 1; i < 1 + DT_PD && i < DT_NB; ++i) {
            if (DT_BF16) dt_prefetch_l2(rawt + i * DT_BRAW, DT_BRAW);
            if (DT_CBITS) dt_prefetch_l2(compt + i * (DT_BCOMP / 4), DT_BCOMP);
        }
    }
    u32 x = rd.s[lane], b = rd.s[32 + lane];
    dt_load_chunk(rd, bufs + warp * 512, 64, lane);
    dt_load_chunk(rd, bufs + warp * 512 + 256, 64 + 256, lane);
    rd.next = 64 + 512;
    rd.pos = 4;
    rd.bad = 0;
    dt_cp_wait<1>();
    __syncwarp();
    rd.due = dt_buf_word(rd, rd.cur);

    const unsigned char* rawp = rawt + lane * 16;  // unit j: + j·512
    const u32* compp = compt + lane;               // word j: + j·32
    const unsigned char* rawn = rawp + DT_RAWU * 512;  // the next iteration's units
    (void)rawp;
    (void)rawn;
    (void)compp;

#if DT_GS
    const int gpr = (p.cols + DT_GS - 1) / DT_GS;  // groups per row
#endif
    // Per-slice scale and min (groups of at least a slice).
    float ss = 1.0f, sm = 0.0f;
    if (!DT_GS && p.group != 0) {
        const int gi = rowc * ((p.cols + p.group - 1) / p.group) + col0 / p.group;
        ss = __ldg(m.scales + gi);
        sm = m.mins ? __ldg(m.mins + gi) : 0.0f;
    }
    (void)ss;
    (void)sm;
#if DT_OUT == 0
    float acc = 0.0f, accq = 0.0f, accq2 = 0.0f;  // two product chains, summed at each flush
#endif
    // Raw units and companion words of the current iteration; each register is reloaded with the
    // next iteration's unit/word right after its last use (a prefetch distance of one iteration).
    uint4 rc[DT_BF16 ? DT_RAWU : 1];
    u32 cc[DT_CW];
#if DT_BF16
#pragma unroll
    for (int j = 0; j < DT_RAWU; ++j) rc[j] = ld_stream_u4(rawp + j * 512);
#endif
#if DT_CBITS
#pragma unroll
    for (int j = 0; j < DT_CWI; ++j) cc[j] = dt_ld_nc(compp + j * 32);
#endif

    for (int it = 0; it < DT_IT; ++it) {
        rd.duer = rd.due - (u32)(it * DT_UQ);
        if (!DT_NOPF && lane == 0 && (it * DT_UQ) % 8 == 0 && (it * DT_UQ) / 8 + 1 + DT_PD < DT_NB) {
            const int pb = (it * DT_UQ) / 8 + 1 + DT_PD;  // block of 8 quartets
            if (DT_BF16) dt_prefetch_l2(rawt + pb * DT_BRAW, DT_BRAW);
            if (DT_CBITS) dt_prefetch_l2(compt + pb * (DT_BCOMP / 4), DT_BCOMP);
        }
#if DT_GS
        // Scales (and mins) of this iteration's groups.
        constexpr int NG = DT_GS <= DT_ICOLS ? DT_ICOLS / DT_GS : 1;
        float gs[NG], gm[NG];
#pragma unroll
        for (int g = 0; g < NG; ++g) {
            const int gi = rowc * gpr + min((col0 + it * DT_ICOLS + g * (DT_GS <= DT_ICOLS ? DT_GS : 0)) / DT_GS, gpr - 1);
            gs[g] = __ldg(m.scales + gi);
            gm[g] = m.mins ? __ldg(m.mins + gi) : 0.0f;
        }
#endif
#pragma unroll
        for (int u = 0; u < DT_UQ; ++u) {
            const int q = it * DT_UQ + u;
            u32 cw = 0;
#if DT_CBITS
            cw = cc[(u * 4 * DT_CBITS) / 32] >> ((u * 4 * DT_CBITS) % 32);
#endif
            u32 rr[4], dd[4], ev[4][2];  // per lookup: r, d, and the table's value word(s)
#if DT_EB != 16
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                // Byte i of b by one byte permute (companion bits above it), then one multiply-add
                // to this lane's copy of the slot (slots are DT_EB·DT_REP bytes apart).
                u32 idx = dt_prmt(b, 0u, 0x4440u | (u32)i);
#if DT_CBITS
                idx |= ((cw >> (i * DT_CBITS)) & ((1u << DT_CBITS) - 1u)) << 8;
#endif
#if DT_EB == 8
                const uint2 e2 = *(const uint2*)((const char*)tabl + idx * (8u * DT_REP));
                const u32 e = e2.x;
                ev[i][0] = e;
                ev[i][1] = e2.y;
#else
                const u32 e = *(const u32*)((const char*)tabl + idx * (4u * DT_REP));
                // Exponents into bits 23..30 (dt_bf16_bits ignores the other bits).
                ev[i][0] = DT_K == 1 ? e : e << 7;
                ev[i][1] = e >> 1;
#endif
                rr[i] = e & 0xFFu;
                dd[i] = dt_prmt(e, 0u, 0x4441u);
            }
#else
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                uint4 e;
#if DT_FAST
                // Byte i of b zero-extended by one byte permute, then one shift-add to the slot's
                // copy for this lane (slots are 16·DT_REP bytes apart).
                u32 idx = dt_prmt(b, 0u, 0x4440u | (u32)i);
#else
                u32 idx = (b >> (8 * i)) & 0xFFu;
#endif
#if DT_CBITS
                idx |= ((cw >> (i * DT_CBITS)) & ((1u << DT_CBITS) - 1u)) << 8;
#endif
#if DT_FAST
                e = *(const uint4*)((const char*)tabl + idx * (16u * DT_REP));
#else
                e = tabl[idx * DT_REP];
#endif
                rr[i] = e.x;
                dd[i] = e.y;
                ev[i][0] = e.z;
                ev[i][1] = e.w;
            }
#endif
            // R = r0 r1 r2 r3, D = ((d0 r1 + d1) r2 + d2) r3 + d3 as a two-level tree.
            const u32 r23 = rr[2] * rr[3];
            const u32 R = (rr[0] * rr[1]) * r23;
            const u32 D = (dd[0] * rr[1] + dd[1]) * r23 + (dd[2] * rr[3] + dd[3]);
#if DT_FAST || DT_EB != 16
            u32 xlo, xhi;  // x·R + D as two words, so the test below is one 32-bit compare
            asm("{ mad.lo.cc.u32 %0, %2, %3, %4; madc.hi.u32 %1, %2, %3, 0; }"
                : "=r"(xlo), "=r"(xhi)
                : "r"(x), "r"(R), "r"(D));
#else
            const unsigned long long xn = (unsigned long long)x * R + D;
            const u32 xlo = (u32)xn, xhi = (u32)(xn >> 32);
#endif

            // The quartet's 4·k values.
            u32 v[4 * DT_K];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < DT_K; ++j) {
                    const u32 tv = ev[i][j];
#if DT_BF16
                    const int c = u * 4 * DT_K + i * DT_K + j;  // column in the iteration
                    v[i * DT_K + j] = dt_bf16_bits(u4get(rc[c / 16], (c % 16) / 4), c % 4, tv);
#else
                    v[i * DT_K + j] = tv;
#endif
                }
            }

#if DT_OUT == 0
            {
                const float* xq = xs + q * 4 * DT_K;
#pragma unroll
                for (int h = 0; h < DT_K; ++h) {
                    const float4 xa = *(const float4*)(xq + 4 * h);
                    accq = fmaf(__uint_as_float(v[4 * h + 0]), xa.x, accq);
                    accq2 = fmaf(__uint_as_float(v[4 * h + 1]), xa.y, accq2);
                    accq = fmaf(__uint_as_float(v[4 * h + 2]), xa.z, accq);
                    accq2 = fmaf(__uint_as_float(v[4 * h + 3]), xa.w, accq2);
                }
            }
#if DT_GS
            if (((q + 1) * 4 * DT_K) % DT_GS == 0) {
                const int g = (q * 4 * DT_K) / DT_GS;                            // group in the slice
                const int gl = DT_GS <= DT_ICOLS ? (u * 4 * DT_K) / DT_GS : 0;  // group in the iteration
                accq += accq2;
                acc += gs[gl] * accq + (gm[gl] - gs[gl] * m.offset) * xg[g];
                accq = 0.0f;
                accq2 = 0.0f;
            }
#endif
#else
            {
                // The quartet's outputs: code bytes, bf16 elements, or dequantised weights as bf16.
                u32 h[4 * DT_K];
#pragma unroll
                for (int c = 0; c < 4 * DT_K; ++c) {
#if DT_OUT == 1 && !DT_BF16
                    h[c] = v[c] & 0xFFu;
#elif DT_BF16
                    h[c] = v[c] >> 16;
#else
                    float s = 1.0f, mn = 0.0f;
#if DT_GS
                    {
                        const int gl = DT_GS <= DT_ICOLS ? (u * 4 * DT_K + c) / DT_GS : 0;
                        s = gs[gl];
                        mn = gm[gl];
                    }
#else
                    s = ss;
                    mn = sm;
#endif
                    h[c] = p.group != 0 || DT_GS ? f32_to_bf16(__fadd_rn(__fmul_rn(s, __fsub_rn(__uint_as_float(v[c]), m.offset)), mn))
                                                 : f32_to_bf16(__uint_as_float(v[c]));
#endif
                }
                dt_stage_quartet(stage, lane, u, h);
            }
#endif
#if DT_BF16
            if (((u + 1) * 4 * DT_K) % 16 == 0 && it + 1 < DT_IT) {
                const int j = ((u + 1) * 4 * DT_K) / 16 - 1;
                rc[j] = ld_stream_u4(rawn + j * 512);
            }
#endif
#if DT_CBITS
            if (((u + 1) * 4 * DT_CBITS) % 32 == 0 && it + 1 < DT_IT) {
                const int j = ((u + 1) * 4 * DT_CBITS) / 32 - 1;
                cc[j] = dt_ld_nc(compp + ((it + 1) * DT_CWI + j) * 32);
            }
#endif
            if (q + 1 < DT_Q) {
                const u32 hi = xhi, lo = xlo;
                const bool need = hi == 0;
                const u32 w = dt_read(rd, need, (u32)q, (u32)u, lt_mask, lane);
                b = need ? w : lo;
                x = need ? lo : hi;
            }
        }
#if DT_OUT != 0
        dt_flush(stage, lane, m.out, band * 32, m.rows, p.cols, col0 + it * DT_ICOLS);
#endif
        rawn += DT_RAWU * 512;
    }

#if DT_OUT == 0
    accq += accq2;
#endif
    // Escape rounds: each lane with records reads one per round until its last. Decode/dequant
    // write escapes straight to global memory: the last flush's closing __syncwarp orders the
    // transposed stores (other lanes, same addresses) before them.
    bool act = (m.tiles[2 * tile + 1] >> lane) & 1u;
    u32 step = DT_Q - 1;
    int last_col = -1;
    rd.duer = rd.due;
    while (__any_sync(0xffffffffu, act)) {
        const u32 rec = dt_read(rd, act, step, step, lt_mask, lane);
        if (act) {
            const int c = (rec >> 16) & 0x7FF;
            const u32 val = rec & 0xFFFFu;
            rd.bad |= (rec >> 28) != 0 || c <= last_col || c >= ncols || row >= m.rows;
            if (c > last_col && c < ncols && row < m.rows) {
                last_col = c;
#if DT_BF16
                const float wv = __uint_as_float(val << 16);
#elif DT_OUT == 1
                const float wv = 0.0f;
#else
                const float wv = __uint_as_float(__ldg(m.lut + (val & 0xFFu)));
#endif
                float s = 1.0f, mn = 0.0f;
#if DT_GS
                {
                    const int gi = rowc * gpr + (col0 + c) / DT_GS;
                    s = __ldg(m.scales + gi);
                    mn = m.mins ? __ldg(m.mins + gi) : 0.0f;
                }
#else
                s = ss;
                mn = sm;
#endif
                (void)s;
                (void)mn;
#if DT_OUT == 0
                // The main loop counted this weight as value 0.
#if DT_GS
                acc += s * wv * xs[c];
#else
                accq += wv * xs[c];
#endif
#elif DT_OUT == 1
#if DT_BF16
                ((bf16_t*)m.out)[(size_t)row * p.cols + col0 + c] = (bf16_t)val;
#else
                ((unsigned char*)m.out)[(size_t)row * p.cols + col0 + c] = (unsigned char)val;
#endif
#else
#if DT_BF16
                ((bf16_t*)m.out)[(size_t)row * p.cols + col0 + c] = (bf16_t)val;
#else
                ((bf16_t*)m.out)[(size_t)row * p.cols + col0 + c] =
                    p.group != 0 || DT_GS ? f32_to_bf16(__fadd_rn(__fmul_rn(s, __fsub_rn(wv, m.offset)), mn)) : f32_to_bf16(wv);
#endif
#endif
            }
            if (rec & (1u << 27)) act = false;
        }
        if (++step > DT_Q - 1 + DT_SC) {
            rd.bad = 1;
            break;
        }
    }
    rd.bad |= rd.due != DT_NO_DUE || rd.pos > 1024u;
    dt_cp_wait<0>();

#if DT_OUT == 0
#if !DT_GS
    if (p.group != 0) {
        acc = ss * accq + (sm - ss * m.offset) * xg[0];
    } else {
        acc = accq;
    }
#endif
    if (row < m.rows) {
        float* y = (float*)m.out;
        if (p.slices == 1)
            y[row] = acc;
        else
            atomicAdd(y + row, acc);
    }
#endif
    if (__any_sync(0xffffffffu, rd.bad != 0) && lane == 0 && p.err) atomicOr(p.err, 1u);
}
