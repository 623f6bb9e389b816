//! The `q8` products of Q4_0, Q4_1, Q8_0 and Q4_K on AVX-512 VNNI over the blocks repacked at load in
//! tiles of 16 rows (llama.cpp repacks them likewise for its VNNI kernels): per tile and block,
//! the 16 rows' codes interleaved four bytes a row, so that one `vpdpbusd` multiplies four codes
//! of all 16 rows by four broadcast activation bytes, then the rows' 16 f16 scales (and Q4_1's
//! mins) as one vector (Q4_K: its 6-bit sub-block scales and mins as bytes, its two f16 scales;
//! Q4_0 and Q8_0: two blocks' scales in one line). A block's products for 16 rows then cost what
//! one row's did in place. The tiles hold the same bytes as the blocks, give or take a few
//! percent (whole cache lines; Q4_K's scales unpacked). A decode step's products, bound by how
//! fast the weights stream in, take four tiles at a time: four streams, each prefetched ahead.

use super::{scale_min_k4, GgmlType, Q8In};

/// Rows a tile holds.
pub(super) const TILE: usize = 16;

/// How far ahead of the record being multiplied each stream prefetches (bytes).
const PREFETCH: usize = 4096;

/// The block types kept as tiles.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
}

impl Kind {
    fn of(ty: GgmlType) -> Option<Kind> {
        match ty {
            GgmlType::Q4_0 => Some(Kind::Q4_0),
            GgmlType::Q4_1 => Some(Kind::Q4_1),
            GgmlType::Q8_0 => Some(Kind::Q8_0),
            GgmlType::Q4_K => Some(Kind::Q4K),
            _ => None,
        }
    }
    /// Where a stored block's codes start (after its f16 scale, min, Q4_K's packed scales).
    fn codes_at(self) -> usize {
        match self {
            Kind::Q4_0 | Kind::Q8_0 => 2,
            Kind::Q4_1 => 4,
            Kind::Q4K => 16,
        }
    }
    /// Bytes of a tile's codes of one block (16 rows' codes, nibbles packed as stored).
    fn code_bytes(self) -> usize {
        match self {
            Kind::Q8_0 => 512,
            Kind::Q4K => 2048,
            _ => 256,
        }
    }
    /// 64-byte lines of one (tile, block) record: codes, 16 f16 scales, 16 f16 mins (Q4_1);
    /// Q4_K: codes, 8 × 16 scale bytes, 8 × 16 min bytes, 16 f16 `d`, 16 f16 `dmin`. Q4_0 and
    /// Q8_0 keep two blocks a record (both blocks' codes, then one line of both blocks' 16
    /// scales), so that their scales fill a line: [`Kind::lines`] is then half a record.
    fn paired(self) -> bool {
        matches!(self, Kind::Q4_0 | Kind::Q8_0)
    }
    /// Bytes of a tile of `blocks` blocks.
    fn tile_bytes(self, blocks: usize) -> usize {
        match self.paired() {
            true => blocks.div_ceil(2) * (2 * self.code_bytes() + 64),
            false => blocks * self.record_bytes(),
        }
    }
    /// Bytes of one unpaired record.
    fn record_bytes(self) -> usize {
        match self {
            Kind::Q4_1 => 256 + 64,
            Kind::Q4K => 2048 + 5 * 64,
            _ => self.code_bytes() + 64,
        }
    }
    /// Where block `b`'s codes and scales start in its tile (bytes).
    fn at(self, b: usize) -> (usize, usize) {
        let cb = self.code_bytes();
        match self.paired() {
            true => {
                let pair = (b / 2) * (2 * cb + 64);
                (pair + (b % 2) * cb, pair + 2 * cb + (b % 2) * 32)
            }
            false => (b * self.record_bytes(), b * self.record_bytes() + cb),
        }
    }
    /// What the tiles' unsigned codes exceed the true codes by: `Σ q·x = Σ u·x − B·Σ x`.
    fn bias(self) -> i32 {
        match self {
            Kind::Q4_0 => 8,
            Kind::Q4_1 | Kind::Q4K => 0,
            Kind::Q8_0 => 128,
        }
    }
}

/// One cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A matrix's blocks as tiles of [`TILE`] rows (the last tile padded with zero rows).
pub(super) struct Tiles {
    kind: Kind,
    rows: usize,
    blocks: usize,
    /// Weights a block holds.
    len: usize,
    lines: Vec<Line>,
}

impl Tiles {
    /// `bytes` (`rows` rows of `blocks` blocks of `ty`) repacked, or `None` for another type.
    pub(super) fn new(ty: GgmlType, bytes: &[u8], rows: usize, blocks: usize) -> Option<Tiles> {
        let kind = Kind::of(ty)?;
        let ((len, ts), at) = (ty.block_layout(), kind.codes_at());
        assert_eq!(bytes.len(), rows * blocks * ts, "ggml tile source size");
        let tb = kind.tile_bytes(blocks);
        let tiles = rows.div_ceil(TILE);
        let mut lines = vec![Line([0; 64]); tiles * tb / 64];
        // SAFETY: `Line` is 64 plain bytes.
        let all: &mut [u8] = unsafe {
            std::slice::from_raw_parts_mut(lines.as_mut_ptr() as *mut u8, lines.len() * 64)
        };
        for (t, tile) in all.chunks_exact_mut(tb).enumerate() {
            for b in 0..blocks {
                let (c, s) = kind.at(b);
                for j in 0..TILE.min(rows - t * TILE) {
                    let blk = &bytes[((t * TILE + j) * blocks + b) * ts..][..ts];
                    let codes = &blk[at..];
                    // Load g holds, at lane j, codes 4g..4g+4 of row j: stored nibble pairs
                    // (code k and k + 16) for the 4-bit types, `q + 128` for Q8_0.
                    match kind {
                        Kind::Q8_0 => {
                            for g in 0..8 {
                                for i in 0..4 {
                                    tile[c + 64 * g + 4 * j + i] = codes[4 * g + i] ^ 0x80;
                                }
                            }
                        }
                        Kind::Q4K => {
                            // Load 8c + g: bytes 4g..4g+4 of the 32 that hold sub-blocks 2c
                            // (low nibbles) and 2c + 1 (high).
                            for l in 0..32 {
                                tile[c + 64 * l + 4 * j..][..4]
                                    .copy_from_slice(&codes[4 * l..][..4]);
                            }
                            for sb in 0..8 {
                                let (sc, m) = scale_min_k4(sb, &blk[4..16]);
                                tile[s + 16 * sb + j] = sc;
                                tile[s + 128 + 16 * sb + j] = m;
                            }
                            tile[s + 256 + 2 * j..][..2].copy_from_slice(&blk[..2]);
                            tile[s + 288 + 2 * j..][..2].copy_from_slice(&blk[2..4]);
                            continue;
                        }
                        _ => {
                            for g in 0..4 {
                                tile[c + 64 * g + 4 * j..][..4]
                                    .copy_from_slice(&codes[4 * g..][..4]);
                            }
                        }
                    }
                    tile[s + 2 * j..][..2].copy_from_slice(&blk[..2]);
                    if kind == Kind::Q4_1 {
                        tile[s + 32 + 2 * j..][..2].copy_from_slice(&blk[2..4]);
                    }
                }
            }
        }
        Some(Tiles {
            kind,
            rows,
            blocks,
            len,
            lines,
        })
    }

    /// `out[r·N + v] = row (r0 + r) · x_v` for the rows of `out` (`r0` a whole number of tiles);
    /// `xsum[v]` holds `x_v`'s offsets' sums a block (Q4_1).
    /// Safety: AVX-512 F, BW, VL and VNNI, and F16C present.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    pub(super) unsafe fn rows_q8(&self, r0: usize, x: &[Q8In], xsum: &[&[f32]], out: &mut [f32]) {
        let n = x.len();
        assert!(n > 0 && r0.is_multiple_of(TILE) && out.len().is_multiple_of(n));
        let rows = out.len() / n;
        assert!(r0 + rows <= self.rows);
        let b = self.blocks;
        let l = self.len;
        assert!(x
            .iter()
            .all(|x| x.q.len() >= l * b && x.d.len() >= l / 32 * b && x.qsum.len() >= l / 32 * b));
        assert!(self.kind != Kind::Q4_1 || (xsum.len() == n && xsum.iter().all(|s| s.len() >= b)));
        if n == 1 {
            return self.rows_one(r0 / TILE, &x[0], xsum.first().copied().unwrap_or(&[]), out);
        }
        for t in 0..rows.div_ceil(TILE) {
            let here = TILE.min(rows - t * TILE);
            let o = &mut out[t * TILE * n..(t * TILE + here) * n];
            let mut v0 = 0;
            while v0 < n {
                let k = (n - v0).min(4);
                let xs = &x[v0..v0 + k];
                let ms: &[&[f32]] = match self.kind {
                    Kind::Q4_1 => &xsum[v0..v0 + k],
                    _ => &[],
                };
                let tile = r0 / TILE + t;
                let mut put = |sums: &[[f32; TILE]]| {
                    for (v, s) in sums.iter().enumerate() {
                        for (j, &s) in s[..here].iter().enumerate() {
                            o[j * n + v0 + v] = s;
                        }
                    }
                };
                match (self.kind, k) {
                    (Kind::Q4K, 1) => put(&self.tile_q4k::<1>(tile, xs)),
                    (Kind::Q4K, 2) => put(&self.tile_q4k::<2>(tile, xs)),
                    (Kind::Q4K, 3) => put(&self.tile_q4k::<3>(tile, xs)),
                    (Kind::Q4K, _) => put(&self.tile_q4k::<4>(tile, xs)),
                    (_, 1) => put(&self.tile::<1>(tile, xs, ms)),
                    (_, 2) => put(&self.tile::<2>(tile, xs, ms)),
                    (_, 3) => put(&self.tile::<3>(tile, xs, ms)),
                    _ => put(&self.tile::<4>(tile, xs, ms)),
                }
                v0 += k;
            }
        }
    }

    /// [`Tiles::rows_q8`] with one vector: tiles four at a time from `t0` (four streams of
    /// records).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    unsafe fn rows_one(&self, t0: usize, x: &Q8In, xsum: &[f32], out: &mut [f32]) {
        let mut t = 0;
        let tiles = out.len().div_ceil(TILE);
        while t < tiles {
            let group = (tiles - t).min(4);
            let put = |out: &mut [f32], sums: &[[f32; TILE]]| {
                for (c, s) in sums.iter().enumerate() {
                    let o = &mut out[(t + c) * TILE..];
                    let here = TILE.min(o.len());
                    o[..here].copy_from_slice(&s[..here]);
                }
            };
            match (self.kind, group) {
                (Kind::Q4K, 4) => put(out, &self.group_q4k::<4>(t0 + t, x)),
                (Kind::Q4K, 3) => put(out, &self.group_q4k::<3>(t0 + t, x)),
                (Kind::Q4K, 2) => put(out, &self.group_q4k::<2>(t0 + t, x)),
                (Kind::Q4K, _) => put(out, &self.group_q4k::<1>(t0 + t, x)),
                (_, 4) => put(out, &self.group::<4>(t0 + t, x, xsum)),
                (_, 3) => put(out, &self.group::<3>(t0 + t, x, xsum)),
                (_, 2) => put(out, &self.group::<2>(t0 + t, x, xsum)),
                (_, _) => put(out, &self.group::<1>(t0 + t, x, xsum)),
            }
            t += group;
        }
    }

    /// The 16 row sums of each of tiles `t0..t0 + T` with one vector, block by block (`T`
    /// streams): [`Tiles::tile`]'s sums, bit for bit.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    #[inline]
    unsafe fn group<const T: usize>(&self, t0: usize, x: &Q8In, xsum: &[f32]) -> [[f32; TILE]; T] {
        use std::arch::x86_64::*;
        let mut acc = [[_mm512_setzero_ps(); 1]; T];
        let mut accm = [[_mm512_setzero_ps(); 1]; T];
        for b in 0..self.blocks {
            // Each activation word broadcast once for the T tiles.
            let words: [__m512i; 8] = std::array::from_fn(|k| {
                // SAFETY: 32·b + 32 ≤ x.q.len() (checked by the caller).
                _mm512_set1_epi32(std::ptr::read_unaligned(
                    x.q.as_ptr().add(32 * b + 4 * k) as *const i32
                ))
            });
            let bx = |_: usize, k: usize| words[k / 4];
            let x = std::slice::from_ref(x);
            for c in 0..T {
                self.block::<1>(t0 + c, b, x, &[xsum], bx, &mut acc[c], &mut accm[c]);
            }
        }
        let mut r = [[0f32; TILE]; T];
        for c in 0..T {
            _mm512_storeu_ps(r[c].as_mut_ptr(), _mm512_add_ps(acc[c][0], accm[c][0]));
        }
        r
    }

    /// The 16 row sums of tile `t` with each of `N` vectors.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    #[inline]
    unsafe fn tile<const N: usize>(
        &self,
        t: usize,
        x: &[Q8In],
        xsum: &[&[f32]],
    ) -> [[f32; TILE]; N] {
        use std::arch::x86_64::*;
        let mut acc = [_mm512_setzero_ps(); N];
        let mut accm = [_mm512_setzero_ps(); N];
        for b in 0..self.blocks {
            let bx = |v: usize, k: usize| {
                // SAFETY: k + 4 ≤ 32, and x[v] holds 32·blocks codes (checked by the caller).
                _mm512_set1_epi32(std::ptr::read_unaligned(
                    x[v].q.as_ptr().add(32 * b + k) as *const i32
                ))
            };
            self.block::<N>(t, b, x, xsum, bx, &mut acc, &mut accm);
        }
        let mut r = [[0f32; TILE]; N];
        for v in 0..N {
            _mm512_storeu_ps(r[v].as_mut_ptr(), _mm512_add_ps(acc[v], accm[v]));
        }
        r
    }

    /// Block `b` of tile `t` (Q4_0, Q4_1, Q8_0) with each of `N` vectors, added to `acc` (codes
    /// times scales) and `accm` (Q4_1's mins times `xsum`); `bx(v, k)`: vector `v`'s activation
    /// bytes `k..k + 4` of the block, broadcast.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    #[inline]
    #[allow(clippy::too_many_arguments)] // the block's place, its inputs, two accumulators
    unsafe fn block<const N: usize>(
        &self,
        t: usize,
        b: usize,
        x: &[Q8In],
        xsum: &[&[f32]],
        bx: impl Fn(usize, usize) -> std::arch::x86_64::__m512i,
        acc: &mut [std::arch::x86_64::__m512; N],
        accm: &mut [std::arch::x86_64::__m512; N],
    ) {
        use std::arch::x86_64::*;
        let kind = self.kind;
        let (m4, bias) = (_mm512_set1_epi8(0x0F), kind.bias());
        let tile = (self.lines.as_ptr() as *const u8).add(t * kind.tile_bytes(self.blocks));
        let (co, so) = kind.at(b);
        let (rec, sc) = (tile.add(co), tile.add(so));
        for l in 0..kind.code_bytes() / 64 {
            _mm_prefetch::<_MM_HINT_T0>(rec.wrapping_add(PREFETCH + 64 * l) as *const i8);
        }
        _mm_prefetch::<_MM_HINT_T0>(sc.wrapping_add(PREFETCH) as *const i8);
        let mut s = [[_mm512_setzero_si512(); 2]; N];
        match kind {
            Kind::Q8_0 => {
                for g in 0..8 {
                    let c = _mm512_load_si512(rec.add(64 * g) as *const __m512i);
                    for (v, s) in s.iter_mut().enumerate() {
                        s[g % 2] = _mm512_dpbusd_epi32(s[g % 2], c, bx(v, 4 * g));
                    }
                }
            }
            _ => {
                for g in 0..4 {
                    let c = _mm512_load_si512(rec.add(64 * g) as *const __m512i);
                    let lo = _mm512_and_si512(c, m4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(c), m4);
                    for (v, s) in s.iter_mut().enumerate() {
                        s[0] = _mm512_dpbusd_epi32(s[0], lo, bx(v, 4 * g));
                        s[1] = _mm512_dpbusd_epi32(s[1], hi, bx(v, 16 + 4 * g));
                    }
                }
            }
        }
        let d = _mm512_cvtph_ps(_mm256_load_si256(sc as *const __m256i));
        let m = match kind {
            Kind::Q4_1 => _mm512_cvtph_ps(_mm256_load_si256(sc.add(32) as *const __m256i)),
            _ => _mm512_setzero_ps(),
        };
        for v in 0..N {
            let mut q = _mm512_add_epi32(s[v][0], s[v][1]);
            if kind != Kind::Q4_1 {
                // The codes' bias times the activations' sum.
                q = _mm512_sub_epi32(q, _mm512_set1_epi32(bias * x[v].qsum[b]));
            }
            let f = _mm512_mul_ps(d, _mm512_set1_ps(x[v].d[b]));
            acc[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), f, acc[v]);
            if kind == Kind::Q4_1 {
                accm[v] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[v][b]), accm[v]);
            }
        }
    }

    /// [`Tiles::tile`] for Q4_K: per sub-block of 32, `Σ q·x` of 16 rows by `vpdpbusd`, times
    /// the rows' 6-bit scales (integers: a block's sum fits in 32 bits), less the mins times the
    /// activations' sums; then `d·dx` and `dmin·dx` (ggml's Q4_K × Q8_K product).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    #[inline]
    unsafe fn tile_q4k<const N: usize>(&self, t: usize, x: &[Q8In]) -> [[f32; TILE]; N] {
        use std::arch::x86_64::*;
        let mut acc = [_mm512_setzero_ps(); N];
        let mut accm = [_mm512_setzero_ps(); N];
        for b in 0..self.blocks {
            self.block_q4k::<N>(t, b, x, &mut acc, &mut accm);
        }
        let mut r = [[0f32; TILE]; N];
        for v in 0..N {
            _mm512_storeu_ps(r[v].as_mut_ptr(), _mm512_sub_ps(acc[v], accm[v]));
        }
        r
    }

    /// [`Tiles::tile_q4k`] with one vector for tiles `t0..t0 + T`, block by block (`T` streams).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    #[inline]
    unsafe fn group_q4k<const T: usize>(&self, t0: usize, x: &Q8In) -> [[f32; TILE]; T] {
        use std::arch::x86_64::*;
        let mut acc = [[_mm512_setzero_ps(); 1]; T];
        let mut accm = [[_mm512_setzero_ps(); 1]; T];
        let x = std::slice::from_ref(x);
        for b in 0..self.blocks {
            for c in 0..T {
                self.block_q4k::<1>(t0 + c, b, x, &mut acc[c], &mut accm[c]);
            }
        }
        let mut r = [[0f32; TILE]; T];
        for c in 0..T {
            _mm512_storeu_ps(r[c].as_mut_ptr(), _mm512_sub_ps(acc[c][0], accm[c][0]));
        }
        r
    }

    /// Block `b` of tile `t` with each of `N` vectors, added to `acc` (scales) and `accm`
    /// (mins).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    #[inline]
    unsafe fn block_q4k<const N: usize>(
        &self,
        t: usize,
        b: usize,
        x: &[Q8In],
        acc: &mut [std::arch::x86_64::__m512; N],
        accm: &mut [std::arch::x86_64::__m512; N],
    ) {
        use std::arch::x86_64::*;
        let kind = Kind::Q4K;
        let cb = kind.code_bytes();
        let m4 = _mm512_set1_epi8(0x0F);
        let bytes16 = |p: *const u8| _mm512_cvtepu8_epi32(_mm_load_si128(p as *const __m128i));
        let rec =
            (self.lines.as_ptr() as *const u8).add(t * kind.tile_bytes(self.blocks) + kind.at(b).0);
        let mut isum = [_mm512_setzero_si512(); N];
        let mut msum = [_mm512_setzero_si512(); N];
        for c in 0..4 {
            // Sub-blocks 2c and 2c + 1, two chains each.
            let mut s = [[_mm512_setzero_si512(); 4]; N];
            for g in 0..8 {
                let l = rec.add(64 * (8 * c + g));
                _mm_prefetch::<_MM_HINT_T0>(l.wrapping_add(PREFETCH) as *const i8);
                let v = _mm512_load_si512(l as *const __m512i);
                let lo = _mm512_and_si512(v, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
                for (xv, s) in x.iter().zip(s.iter_mut()) {
                    // SAFETY: 256·b + 64c + 32 + 4g + 4 ≤ 256·blocks ≤ xv.q.len().
                    let at = |k: usize| {
                        _mm512_set1_epi32(std::ptr::read_unaligned(
                            xv.q.as_ptr().add(256 * b + 64 * c + k) as *const i32,
                        ))
                    };
                    s[g % 2] = _mm512_dpbusd_epi32(s[g % 2], lo, at(4 * g));
                    s[2 + g % 2] = _mm512_dpbusd_epi32(s[2 + g % 2], hi, at(32 + 4 * g));
                }
            }
            let sc0 = bytes16(rec.add(cb + 16 * (2 * c)));
            let sc1 = bytes16(rec.add(cb + 16 * (2 * c + 1)));
            for (is, s) in isum.iter_mut().zip(&s) {
                let p0 = _mm512_mullo_epi32(_mm512_add_epi32(s[0], s[1]), sc0);
                let p1 = _mm512_mullo_epi32(_mm512_add_epi32(s[2], s[3]), sc1);
                *is = _mm512_add_epi32(*is, _mm512_add_epi32(p0, p1));
            }
        }
        for l in 32..kind.record_bytes() / 64 {
            _mm_prefetch::<_MM_HINT_T0>(rec.add(64 * l).wrapping_add(PREFETCH) as *const i8);
        }
        for sb in 0..8 {
            let m = bytes16(rec.add(cb + 128 + 16 * sb));
            for (ms, xv) in msum.iter_mut().zip(x) {
                let q = _mm512_set1_epi32(xv.qsum[8 * b + sb]);
                *ms = _mm512_add_epi32(*ms, _mm512_mullo_epi32(m, q));
            }
        }
        let d = _mm512_cvtph_ps(_mm256_load_si256(rec.add(cb + 256) as *const __m256i));
        let dmin = _mm512_cvtph_ps(_mm256_load_si256(rec.add(cb + 288) as *const __m256i));
        for v in 0..N {
            let dx = _mm512_set1_ps(x[v].d[8 * b]);
            let f = _mm512_mul_ps(d, dx);
            acc[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[v]), f, acc[v]);
            let fm = _mm512_mul_ps(dmin, dx);
            accm[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum[v]), fm, accm[v]);
        }
    }
}
