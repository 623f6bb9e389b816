// dtANS-LLM encoder for BF16 matrices (docs/dtans.md), byte-identical to the CPU encoder
// (crates/codec/src/dtans/encode.rs), given the host's plan (kept codes, padding code, table).
//
// Two kernels:
//   dtans_encode_lanes     one thread per (tile, lane): the raw bytes, the escape count, then the
//                          lane's backward pass (fold-or-emit per quartet), writing its companion
//                          words, prologue words and each emitted word at its read step, with a bit
//                          per step saying whether it emitted.
//   dtans_encode_assemble  one warp per tile: walks the read steps in order, ballots which lanes
//                          read, and lays the words out through 1 KiB chunks with their headers,
//                          then the escape records. Run twice: once to measure each tile's stream
//                          (the host turns lengths into offsets), once to write it.

#define ENC_CHUNK 256u
#define ENC_NO_DUE 0xFFFFFFFFu
#define ENC_REC_LAST (1u << 27)

struct EncParams {
    const bf16_t* w;             // rows × cols, row-major
    const u32* key_slots;        // per packed key: first slot | count << 16
    const unsigned char* coded_as;  // 256
    const unsigned char* escaped;   // 256 (0/1)
    u32* companion;              // tiles × 32 × comp_words
    unsigned char* raw;          // tiles × 32 × sc
    u32* words;                  // tiles × (quartets − 1) × 32: the word a lane emits at a step
    u32* flags;                  // tiles × flag_words × 32: bit s of word s/32: emitted at step s
    u32* prologue;               // tiles × 64: final reservoirs, then first state words
    u32* esc_count;              // tiles × 32
    u32* tiles_out;              // tiles × 2: stream offset (input when writing), escape mask
    u32* lengths;                // tiles: stream words (measuring pass)
    u32* stream;                 // writing pass
    long long rows, cols;
    int k, sc, bands, n_tiles, quartets, cbits, comp_words, flag_words, pad, write;
};

__device__ __forceinline__ unsigned enc_code(bf16_t w) { return (w >> 7) & 0xFFu; }

// The table slots of symbol i (0..3) of quartet q for this lane: first slot | count << 16.
__device__ __forceinline__ u32 enc_slots(const EncParams& p, const bf16_t* wr, bool row_in,
                                         long long col0, int q, int i) {
    u32 key = 0;
    for (int j = 0; j < p.k; ++j) {
        long long c = col0 + (long long)(4 * q + i) * p.k + j;
        u32 code = (row_in && c < p.cols) ? p.coded_as[enc_code(wr[c])] : (u32)p.pad;
        key |= code << (8 * j);
    }
    return p.key_slots[key];
}

extern "C" __global__ void __launch_bounds__(128) dtans_encode_lanes(EncParams p) {
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int tile = (int)(gid >> 5), lane = (int)(gid & 31);
    if (tile >= p.n_tiles) return;
    const int band = tile % p.bands, slice = tile / p.bands;
    const long long row = (long long)band * 32 + lane, col0 = (long long)slice * p.sc;
    const bool row_in = row < p.rows;
    const bf16_t* wr = p.w + (row_in ? row * p.cols : 0);

    // Raw bytes in 16-byte units (escaped and padding positions 0), and the escapes.
    unsigned char* rawt = p.raw + (size_t)tile * 32 * p.sc;
    u32 esc = 0;
    for (int u = 0; u < p.sc / 16; ++u) {
        u32 v[4] = {0, 0, 0, 0};
        for (int j = 0; j < 16; ++j) {
            long long c = col0 + u * 16 + j;
            if (row_in && c < p.cols) {
                bf16_t w = wr[c];
                if (p.escaped[enc_code(w)]) {
                    ++esc;
                } else {
                    u32 b = ((w >> 8) & 0x80u) | (w & 0x7Fu);
                    v[j >> 2] |= b << (8 * (j & 3));
                }
            }
        }
        *(uint4*)(rawt + ((size_t)u * 32 + lane) * 16) = make_uint4(v[0], v[1], v[2], v[3]);
    }
    p.esc_count[(size_t)tile * 32 + lane] = esc;

    // Backward pass. The companion word and the flag word being filled are kept in registers and
    // stored when the pass moves below them (q only decreases).
    const int S = p.quartets;
    u32* comp = p.companion + (size_t)tile * 32 * p.comp_words + lane;
    u32* flags = p.flags + (size_t)tile * 32 * p.flag_words + lane;
    u32* words = p.words + (size_t)tile * 32 * (S - 1) + lane;
    int comp_at = -1, flag_at = -1;
    u32 comp_acc = 0, flag_acc = 0;
    u32 sl[4];
    for (int i = 0; i < 4; ++i) sl[i] = enc_slots(p, wr, row_in, col0, S - 1, i);
    u32 dg[4] = {0, 0, 0, 0};  // the last quartet: nothing in the reservoir yet
    unsigned long long x = 1;
    u32 b = 0;
    for (int q = S - 1;; --q) {
        // The word of quartet q from its symbols' slots and digits; high slot bits to the companion.
        u32 word = 0, hi = 0;
        for (int i = 0; i < 4; ++i) {
            u32 idx = (sl[i] & 0xFFFFu) + dg[i];
            word |= (idx & 0xFFu) << (8 * i);
            hi |= (idx >> 8) << (i * p.cbits);
        }
        if (p.cbits > 0) {
            int bit = q * 4 * p.cbits;
            if (bit / 32 != comp_at) {
                if (comp_at >= 0) comp[(size_t)comp_at * 32] = comp_acc;
                comp_at = bit / 32;
                comp_acc = 0;
            }
            comp_acc |= hi << (bit % 32);
        }
        b = word;
        if (q == 0) break;
        // Quartet q − 1 takes digits; b (quartet q's word) is folded or emitted at step q − 1.
        const int qs = q - 1;
        for (int i = 0; i < 4; ++i) sl[i] = enc_slots(p, wr, row_in, col0, qs, i);
        const u32 r0 = sl[0] >> 16, r1 = sl[1] >> 16, r2 = sl[2] >> 16, r3 = sl[3] >> 16;
        const u32 big_r = r0 * r1 * r2 * r3;  // ≤ 255^4 < 2^32
        if (qs / 32 != flag_at) {
            if (flag_at >= 0) flags[(size_t)flag_at * 32] = flag_acc;
            flag_at = qs / 32;
            flag_acc = 0;
        }
        u32 d;
        if (x < big_r) {
            unsigned long long xp = (x << 32) | b;
            x = xp / big_r;
            d = (u32)(xp - x * big_r);
        } else {
            words[(size_t)qs * 32] = b;
            flag_acc |= 1u << (qs % 32);
            u32 x32 = (u32)x;
            x = x32 / big_r;
            d = x32 - (u32)x * big_r;
        }
        dg[3] = d % r3;
        d /= r3;
        dg[2] = d % r2;
        d /= r2;
        dg[1] = d % r1;
        dg[0] = d / r1;
    }
    if (comp_at >= 0) comp[(size_t)comp_at * 32] = comp_acc;
    if (flag_at >= 0) flags[(size_t)flag_at * 32] = flag_acc;
    p.prologue[(size_t)tile * 64 + lane] = (u32)x;
    p.prologue[(size_t)tile * 64 + 32 + lane] = b;
}

// The warp's chunked writer: `len` words so far, `pos` used words of the current chunk (header
// included), `header` the position of its header. Mirrors ChunkWriter in encode.rs.
struct EncChunks {
    u32 len, pos, header;
};

// Read step `step`: the lanes with `has` read `word`, in lane order.
__device__ __forceinline__ void enc_step(const EncParams& p, u32* out, EncChunks& c, u32 step,
                                         bool has, u32 word, int lane) {
    const u32 bal = __ballot_sync(0xFFFFFFFFu, has);
    const u32 n = __popc(bal);
    if (n == 0) return;
    const u32 rank = __popc(bal & ((1u << lane) - 1u));
    if (c.pos + n > ENC_CHUNK) {
        // The chunk runs out at this step: its first `avail` readers finish it, the rest go on
        // after the next chunk's header.
        const u32 avail = ENC_CHUNK - c.pos;
        if (p.write) {
            if (lane == 0) out[c.header] = step;
            if (has) out[c.len + rank + (rank >= avail ? 1u : 0u)] = word;
        }
        c.header = c.len + avail;
        c.len += n + 1;
        c.pos = 1 + n - avail;
    } else {
        if (p.write && has) out[c.len + rank] = word;
        c.len += n;
        c.pos += n;
    }
}

extern "C" __global__ void __launch_bounds__(128) dtans_encode_assemble(EncParams p) {
    const int tile = (int)(((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (tile >= p.n_tiles) return;  // warp-uniform
    const int S = p.quartets;
    u32* out = p.write ? p.stream + p.tiles_out[2 * tile] : nullptr;
    const u32* pro = p.prologue + (size_t)tile * 64;
    if (p.write) {
        out[lane] = pro[lane];
        out[32 + lane] = pro[32 + lane];
    }
    EncChunks c = {65, 1, 64};
    const u32* flags = p.flags + (size_t)tile * 32 * p.flag_words + lane;
    const u32* words = p.words + (size_t)tile * 32 * (S - 1) + lane;
    u32 fl = 0;
    for (int s = 0; s < S - 1; ++s) {
        if ((s & 31) == 0) fl = flags[(size_t)(s >> 5) * 32];
        const bool has = (fl >> (s & 31)) & 1u;
        const u32 word = has ? words[(size_t)s * 32] : 0u;
        enc_step(p, out, c, (u32)s, has, word, lane);
    }
    // Escape records, one per lane per round, by column.
    const u32 cnt = p.esc_count[(size_t)tile * 32 + lane];
    u32 rounds = cnt;
    for (int o = 16; o > 0; o >>= 1) rounds = max(rounds, __shfl_xor_sync(0xFFFFFFFFu, rounds, o));
    const u32 mask = __ballot_sync(0xFFFFFFFFu, cnt > 0);
    const int band = tile % p.bands, slice = tile / p.bands;
    const long long row = (long long)band * 32 + lane, col0 = (long long)slice * p.sc;
    const bf16_t* wr = p.w + (row < p.rows ? row * p.cols : 0);
    u32 col = 0;
    for (u32 e = 0; e < rounds; ++e) {
        const bool has = e < cnt;
        u32 rec = 0;
        if (has && p.write) {
            // cnt > 0 only for rows inside the matrix, and the count says the column exists.
            bf16_t w = wr[col0 + col];
            while (!p.escaped[enc_code(w)]) w = wr[col0 + ++col];
            rec = (u32)w | col << 16 | (e + 1 == cnt ? ENC_REC_LAST : 0u);
            ++col;
        }
        enc_step(p, out, c, (u32)(S - 1) + e, has, rec, lane);
    }
    const u32 total = (c.len + 3u) & ~3u;
    if (p.write) {
        if (lane == 0) {
            out[c.header] = ENC_NO_DUE;
            p.tiles_out[2 * tile + 1] = mask;
        }
        for (u32 i = c.len + lane; i < total; i += 32) out[i] = 0;
    } else if (lane == 0) {
        p.lengths[tile] = total;
    }
}
