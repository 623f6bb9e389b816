//! The `q8` products of Q4_0, Q4_1 and Q8_0 on AVX-512 VNNI over the blocks repacked at load in
//! tiles of 16 rows (llama.cpp repacks them likewise for its VNNI kernels): per tile and block,
//! the 16 rows' codes interleaved four bytes a row, so that one `vpdpbusd` multiplies four codes
//! of all 16 rows by four broadcast activation bytes, then the rows' 16 f16 scales (and Q4_1's
//! mins) as one vector. A block's products for 16 rows then cost what one row's did in place.
//! The tiles hold the same bytes as the blocks (plus padding to whole cache lines).

use super::{GgmlType, Q8In};

/// Rows a tile holds.
pub(super) const TILE: usize = 16;

/// The block types kept as tiles.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl Kind {
    fn of(ty: GgmlType) -> Option<Kind> {
        match ty {
            GgmlType::Q4_0 => Some(Kind::Q4_0),
            GgmlType::Q4_1 => Some(Kind::Q4_1),
            GgmlType::Q8_0 => Some(Kind::Q8_0),
            _ => None,
        }
    }
    /// Bytes of a stored block, and where its codes start.
    fn block(self) -> (usize, usize) {
        match self {
            Kind::Q4_0 => (18, 2),
            Kind::Q4_1 => (20, 4),
            Kind::Q8_0 => (34, 2),
        }
    }
    /// Bytes of a tile's codes of one block (16 rows × 32 codes, nibbles packed as stored).
    fn code_bytes(self) -> usize {
        match self {
            Kind::Q8_0 => 512,
            _ => 256,
        }
    }
    /// 64-byte lines of one (tile, block) record: codes, 16 f16 scales, 16 f16 mins (Q4_1).
    fn lines(self) -> usize {
        match self {
            Kind::Q4_0 => 5,
            Kind::Q4_1 => 5,
            Kind::Q8_0 => 9,
        }
    }
    /// What the tiles' unsigned codes exceed the true codes by: `Σ q·x = Σ u·x − B·Σ x`.
    fn bias(self) -> i32 {
        match self {
            Kind::Q4_0 => 8,
            Kind::Q4_1 => 0,
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
    lines: Vec<Line>,
}

impl Tiles {
    /// `bytes` (`rows` rows of `blocks` blocks of `ty`) repacked, or `None` for another type.
    pub(super) fn new(ty: GgmlType, bytes: &[u8], rows: usize, blocks: usize) -> Option<Tiles> {
        let kind = Kind::of(ty)?;
        let (ts, at) = kind.block();
        assert_eq!(bytes.len(), rows * blocks * ts, "ggml tile source size");
        let per = kind.lines();
        let tiles = rows.div_ceil(TILE);
        let mut lines = vec![Line([0; 64]); tiles * blocks * per];
        let cb = kind.code_bytes();
        for (i, rec) in lines.chunks_exact_mut(per).enumerate() {
            let (t, b) = (i / blocks, i % blocks);
            // SAFETY: `Line` is 64 plain bytes; the record is `per` whole lines.
            let rec: &mut [u8] =
                unsafe { std::slice::from_raw_parts_mut(rec.as_mut_ptr() as *mut u8, per * 64) };
            for j in 0..TILE.min(rows - t * TILE) {
                let blk = &bytes[((t * TILE + j) * blocks + b) * ts..][..ts];
                let codes = &blk[at..];
                // Load g holds, at lane j, codes 4g..4g+4 of row j: stored nibble pairs (code k
                // and k + 16) for the 4-bit types, `q + 128` for Q8_0.
                match kind {
                    Kind::Q8_0 => {
                        for g in 0..8 {
                            for i in 0..4 {
                                rec[64 * g + 4 * j + i] = codes[4 * g + i] ^ 0x80;
                            }
                        }
                    }
                    _ => {
                        for g in 0..4 {
                            rec[64 * g + 4 * j..][..4].copy_from_slice(&codes[4 * g..][..4]);
                        }
                    }
                }
                rec[cb + 2 * j..][..2].copy_from_slice(&blk[..2]);
                if kind == Kind::Q4_1 {
                    rec[cb + 32 + 2 * j..][..2].copy_from_slice(&blk[2..4]);
                }
            }
        }
        Some(Tiles {
            kind,
            rows,
            blocks,
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
        assert!(x
            .iter()
            .all(|x| x.q.len() >= 32 * b && x.d.len() >= b && x.qsum.len() >= b));
        assert!(self.kind != Kind::Q4_1 || (xsum.len() == n && xsum.iter().all(|s| s.len() >= b)));
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
                let sums = match k {
                    1 => self.tile::<1>(tile, xs, ms).to_vec(),
                    2 => self.tile::<2>(tile, xs, ms).to_vec(),
                    3 => self.tile::<3>(tile, xs, ms).to_vec(),
                    _ => self.tile::<4>(tile, xs, ms).to_vec(),
                };
                for (v, s) in sums.iter().enumerate() {
                    for j in 0..here {
                        o[j * n + v0 + v] = s[j];
                    }
                }
                v0 += k;
            }
        }
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
        let kind = self.kind;
        let per = kind.lines();
        let cb = kind.code_bytes();
        let (m4, bias) = (_mm512_set1_epi8(0x0F), kind.bias());
        let mut acc = [_mm512_setzero_ps(); N];
        let mut accm = [_mm512_setzero_ps(); N];
        let base = self.lines.as_ptr().add(t * self.blocks * per) as *const u8;
        #[allow(clippy::needless_range_loop)] // `b` indexes the records and four inputs
        for b in 0..self.blocks {
            let rec = base.add(b * per * 64);
            // Sixteen records ahead (some 5 KiB, as the in-place kernels' distance).
            _mm_prefetch::<_MM_HINT_T0>(rec.wrapping_add(16 * per * 64) as *const i8);
            let mut s = [[_mm512_setzero_si512(); 2]; N];
            let bx = |v: usize, k: usize| {
                // SAFETY: k + 4 ≤ 32, and x[v] holds 32·blocks codes (checked by the caller).
                _mm512_set1_epi32(std::ptr::read_unaligned(
                    x[v].q.as_ptr().add(32 * b + k) as *const i32
                ))
            };
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
            let d = _mm512_cvtph_ps(_mm256_load_si256(rec.add(cb) as *const __m256i));
            let m = match kind {
                Kind::Q4_1 => {
                    _mm512_cvtph_ps(_mm256_load_si256(rec.add(cb + 32) as *const __m256i))
                }
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
        let mut r = [[0f32; TILE]; N];
        for v in 0..N {
            _mm512_storeu_ps(r[v].as_mut_ptr(), _mm512_add_ps(acc[v], accm[v]));
        }
        r
    }
}
