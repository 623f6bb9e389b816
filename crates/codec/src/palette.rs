//! Palette packing: a matrix of one-byte codes (an FP8 checkpoint's weights) as 4-bit indices into
//! a palette of at most 16 codes, with the codes outside the palette in a per-row escape list; and
//! ([`PaletteBf16`]) a BF16 matrix, losslessly, as its high bytes so packed beside its low bytes.
//!
//! Not an entropy coder — 4 bits a weight plus 32 an escape, against the ≈ 2.1 bits of entropy of a
//! low-entropy FP8 checkpoint that dtANS reaches — but its decode is one table lookup per pair of
//! weights with no dependency between them, which is what lets a batch-1 product read half the
//! dense FP8 bytes without spending more instructions than it saves (the GPU's `gemv_pal4`). It is
//! a serving form, built at load from the codes (dense or decoded from a container).
//!
//! Layout: tiles of 16 rows (the last one padded with zero-slot indices), each stored as blocks of
//! 64 columns, tile after tile and block after block: 512 bytes, two indices a byte (low nibble
//! first: the even column), in the order of the GPU's tensor-core fragments ([`pair_at`]): thread
//! `t` of a warp reads bytes `16 t .. 16 t + 16` of a block, and its byte `4 s + i` is register `i`
//! of the A fragment of an `m16n8k16` product over the block's columns `16 s ..16 s + 16` — one
//! 16-byte load a thread for four products, each byte one pair of weights. An escaped weight is
//! stored as the palette slot of the zero code, so a product over the indices skips it; the escape
//! list then adds its true value. Escapes of row `r` are `escapes[row_ptr[r]..row_ptr[r + 1]]`,
//! each `col | code << 24`, columns ascending.

use rayon::prelude::*;

use crate::histogram::byte_histogram;
use crate::{CodecError, Result};

/// Palette slots (4-bit indices).
pub const SLOTS: usize = 16;

/// Escape entries hold the column in 24 bits.
pub const MAX_COLS: usize = 1 << 24;

/// Rows of a tile (the M of the GPU's `m16n8k16` product).
pub const TILE_ROWS: usize = 16;

/// Columns of a tile's block (four K steps of 16).
pub const BLOCK_COLS: usize = 64;

/// Bytes of a block: 16 rows × 64 columns at 4 bits.
pub const BLOCK_BYTES: usize = TILE_ROWS * BLOCK_COLS / 2;

/// The (row in the tile, column in the block) of the pair of weights at byte `j` (< 512) of a
/// block; the pair is that column (low nibble) and the next. Byte `j` belongs to thread
/// `t = j / 16`, K step `s = j % 16 / 4` and A-fragment register `i = j % 4` of an `m16n8k16`
/// BF16 product: rows `t / 4` (+ 8 for odd `i`), columns `16 s + 2 (t % 4)` (+ 8 for `i ≥ 2`).
pub fn pair_at(j: usize) -> (usize, usize) {
    let (t, b) = (j / 16, j % 16);
    let (s, i) = (b / 4, b % 4);
    (t / 4 + 8 * (i & 1), 16 * s + 8 * (i >> 1) + 2 * (t % 4))
}

/// `zero` and the 15 most frequent other codes of `hist` (ties to the smaller code); unused slots
/// repeat `zero`.
fn palette_of(hist: &[u64; 256], zero: u8) -> [u8; SLOTS] {
    let mut order: Vec<u8> = (0..=255u8)
        .filter(|&c| c != zero && hist[c as usize] > 0)
        .collect();
    order.sort_by_key(|&c| (std::cmp::Reverse(hist[c as usize]), c));
    let mut palette = [zero; SLOTS];
    for (slot, &c) in palette[1..].iter_mut().zip(&order) {
        *slot = c;
    }
    palette
}

/// The escapes of codes with histogram `hist` in their palette form: the codes outside it.
fn escapes_of(hist: &[u64; 256], zero: u8) -> u64 {
    let palette = palette_of(hist, zero);
    (0..256)
        .filter(|&c| !palette.contains(&(c as u8)))
        .map(|c| hist[c])
        .sum()
}

/// A matrix of one-byte codes in palette form (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Palette4 {
    rows: usize,
    cols: usize,
    palette: [u8; SLOTS],
    zero_slot: u8,
    indices: Vec<u8>,
    row_ptr: Vec<u32>,
    escapes: Vec<u32>,
}

impl Palette4 {
    /// Packs `codes` (row-major [rows, cols], cols a multiple of 64 below 2^24) whose code `zero`
    /// has the value zero (0x00 for FP8 E4M3). The palette holds `zero` and the 15 most frequent
    /// other codes (all of them when there are fewer; ties to the smaller code, so the result is
    /// deterministic).
    pub fn encode(codes: &[u8], rows: usize, cols: usize, zero: u8) -> Result<Self> {
        if rows == 0 || cols == 0 || !cols.is_multiple_of(BLOCK_COLS) || cols >= MAX_COLS {
            return Err(CodecError::Shape(format!(
                "palette packing needs rows > 0 and a multiple of {BLOCK_COLS} columns below \
                 2^24, got [{rows}, {cols}]"
            )));
        }
        if codes.len() != rows * cols {
            return Err(CodecError::Shape(format!(
                "[{rows}, {cols}] needs {} codes, got {}",
                rows * cols,
                codes.len()
            )));
        }
        let hist = byte_histogram(codes);
        let palette = palette_of(&hist, zero);
        let zero_slot = 0u8;
        // Code → slot; codes outside the palette escape.
        let mut slot_of = [None; 256];
        for (s, &c) in palette.iter().enumerate().rev() {
            slot_of[c as usize] = Some(s as u8);
        }
        let pairs: Vec<(usize, usize)> = (0..BLOCK_BYTES).map(pair_at).collect();
        let tile_bytes = TILE_ROWS * cols / 2;
        let mut indices = vec![0u8; rows.div_ceil(TILE_ROWS) * tile_bytes];
        // Escapes of each tile's rows.
        let tile_escapes: Vec<Vec<Vec<u32>>> = indices
            .par_chunks_mut(tile_bytes)
            .enumerate()
            .map(|(t, out)| {
                let mut esc = vec![Vec::new(); TILE_ROWS];
                for (b, block) in out.chunks_exact_mut(BLOCK_BYTES).enumerate() {
                    for (o, &(r, c)) in block.iter_mut().zip(&pairs) {
                        let row = t * TILE_ROWS + r;
                        if row >= rows {
                            *o = zero_slot | zero_slot << 4;
                            continue;
                        }
                        let mut nib = [0u8; 2];
                        for (i, n) in nib.iter_mut().enumerate() {
                            let col = b * BLOCK_COLS + c + i;
                            let code = codes[row * cols + col];
                            *n = slot_of[code as usize].unwrap_or_else(|| {
                                esc[r].push(col as u32 | (code as u32) << 24);
                                zero_slot
                            });
                        }
                        *o = nib[0] | nib[1] << 4;
                    }
                }
                for e in &mut esc {
                    e.sort_unstable_by_key(|e| e & 0xFF_FFFF);
                }
                esc
            })
            .collect();
        let row_escapes: Vec<Vec<u32>> = tile_escapes.into_iter().flatten().take(rows).collect();
        let mut row_ptr = Vec::with_capacity(rows + 1);
        row_ptr.push(0u32);
        let mut total = 0usize;
        for e in &row_escapes {
            total += e.len();
            row_ptr
                .push(u32::try_from(total).map_err(|_| {
                    CodecError::Unsupported(format!("{total} escapes exceed 2^32"))
                })?);
        }
        Ok(Palette4 {
            rows,
            cols,
            palette,
            zero_slot,
            indices,
            row_ptr,
            escapes: row_escapes.concat(),
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The 16 palette codes (unused slots repeat the zero code).
    pub fn palette(&self) -> &[u8; SLOTS] {
        &self.palette
    }

    /// The slot escaped weights are stored as (it holds the zero code).
    pub fn zero_slot(&self) -> u8 {
        self.zero_slot
    }

    /// Packed indices in tile order (module documentation, [`pair_at`]): `rows` rounded up to a
    /// multiple of 16, times `cols / 2` bytes.
    pub fn indices(&self) -> &[u8] {
        &self.indices
    }

    /// `rows + 1` offsets into [`Self::escapes`].
    pub fn row_ptr(&self) -> &[u32] {
        &self.row_ptr
    }

    /// Escape entries, `col | code << 24`, by row, columns ascending.
    pub fn escapes(&self) -> &[u32] {
        &self.escapes
    }

    /// Fraction of the weights that escape.
    pub fn escape_fraction(&self) -> f64 {
        self.escapes.len() as f64 / (self.rows * self.cols) as f64
    }

    /// Bytes of the packed form: indices, palette, row offsets and escapes.
    pub fn stored_bytes(&self) -> usize {
        self.indices.len() + SLOTS + 4 * self.row_ptr.len() + 4 * self.escapes.len()
    }

    /// [`Self::stored_bytes`] of `rows × cols` codes whose byte histogram is `hist`, exactly,
    /// without packing them.
    pub fn predict_bytes(hist: &[u64; 256], rows: usize, cols: usize, zero: u8) -> usize {
        rows.div_ceil(TILE_ROWS) * TILE_ROWS * cols / 2
            + SLOTS
            + 4 * (rows + 1)
            + 4 * escapes_of(hist, zero) as usize
    }

    /// Bits a weight of the packed form.
    pub fn bits_per_weight(&self) -> f64 {
        8.0 * self.stored_bytes() as f64 / (self.rows * self.cols) as f64
    }

    /// The codes of rows `rows` (row-major), bit for bit the ones packed.
    pub fn decode_rows(&self, rows: std::ops::Range<usize>) -> Vec<u8> {
        let cols = self.cols;
        let mut out = vec![0u8; rows.len() * cols];
        for_tile_pairs(cols, rows.clone(), |r, at, j| {
            let byte = self.indices[r / TILE_ROWS * TILE_ROWS * cols / 2 + j];
            let o = (r - rows.start) * cols + at;
            out[o] = self.palette[(byte & 15) as usize];
            out[o + 1] = self.palette[(byte >> 4) as usize];
        });
        for r in rows.clone() {
            let row = &mut out[(r - rows.start) * cols..][..cols];
            for &e in &self.escapes[self.row_ptr[r] as usize..self.row_ptr[r + 1] as usize] {
                row[(e & 0xFF_FFFF) as usize] = (e >> 24) as u8;
            }
        }
        out
    }

    /// All codes, row-major (tiles decoded in parallel).
    pub fn decode(&self) -> Vec<u8> {
        let (rows, cols) = (self.rows, self.cols);
        let mut out = vec![0u8; rows * cols];
        out.par_chunks_mut(TILE_ROWS * cols)
            .enumerate()
            .for_each(|(t, o)| {
                let r0 = t * TILE_ROWS;
                o.copy_from_slice(&self.decode_rows(r0..r0 + o.len() / cols));
            });
        out
    }
}

/// Calls `f(row, col, j)` for each pair of weights of rows `rows` in a palette layout of `cols`
/// columns: `col` the pair's even column, `j` its byte in the tile's blocks (block `col / 64`
/// starts at byte `col / 64 · 512` of the tile). One pass over each tile the rows touch.
fn for_tile_pairs(
    cols: usize,
    rows: std::ops::Range<usize>,
    mut f: impl FnMut(usize, usize, usize),
) {
    let pairs: Vec<(usize, usize)> = (0..BLOCK_BYTES).map(pair_at).collect();
    for t in rows.start / TILE_ROWS..rows.end.div_ceil(TILE_ROWS) {
        for b in 0..cols / BLOCK_COLS {
            for (j, &(tr, c)) in pairs.iter().enumerate() {
                let r = t * TILE_ROWS + tr;
                if rows.contains(&r) {
                    f(r, b * BLOCK_COLS + c, b * BLOCK_BYTES + j);
                }
            }
        }
    }
}

/// Escape entries of [`PaletteBf16`] hold the column in 16 bits.
pub const BF16_MAX_COLS: usize = 1 << 16;

/// A BF16 matrix, losslessly, in the palette layout: each value's high byte (the sign and seven
/// exponent bits) as a 4-bit index into 0x00 and its 15 most frequent high bytes ([`Palette4`] of
/// the high bytes) and its low byte (the last exponent bit and the mantissa) as stored, in
/// the same fragment order — 12 bits a weight where a trained matrix's high bytes fit 16 values
/// (they carry about 2.7 bits: the exponents of a bell-shaped distribution, and the sign). A
/// weight whose high byte escapes is stored as index zero-slot with low byte 0 (a product over the
/// stored form sees +0) and listed with its whole value.
///
/// Low bytes: per block, thread `t`'s 32 bytes at `32 t`; byte `2 j` and `2 j + 1` are the low
/// bytes of the pair at index byte `j` of the thread ([`pair_at`]`(16 t + j)`, even column first):
/// one 16-byte load a K-step pair of the GPU's `gemv_pal4` (PAL4_BF16). Escapes of row `r` are
/// `escapes[row_ptr[r]..row_ptr[r + 1]]`, each `col | bits << 16`, columns ascending.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaletteBf16 {
    high: Palette4,
    low: Vec<u8>,
    escapes: Vec<u32>,
}

impl PaletteBf16 {
    /// Packs `values` (BF16 bit patterns, row-major [rows, cols]; cols a multiple of 64 below
    /// 2^16).
    pub fn encode(values: &[u16], rows: usize, cols: usize) -> Result<Self> {
        if cols >= BF16_MAX_COLS {
            return Err(CodecError::Shape(format!(
                "BF16 palette packing needs fewer than {BF16_MAX_COLS} columns, got {cols}"
            )));
        }
        if values.len() != rows * cols {
            return Err(CodecError::Shape(format!(
                "[{rows}, {cols}] needs {} values, got {}",
                rows * cols,
                values.len()
            )));
        }
        let high_bytes: Vec<u8> = values.par_iter().map(|&v| (v >> 8) as u8).collect();
        let high = Palette4::encode(&high_bytes, rows, cols, 0)?;
        let pairs: Vec<(usize, usize)> = (0..BLOCK_BYTES).map(pair_at).collect();
        // The byte of each (row in the tile, even column / 2) of a block: pair_at inverted.
        let mut byte_of = [[0usize; BLOCK_COLS / 2]; TILE_ROWS];
        for (j, &(r, c)) in pairs.iter().enumerate() {
            byte_of[r][c / 2] = j;
        }
        let tile_low = TILE_ROWS * cols;
        let mut low = vec![0u8; rows.div_ceil(TILE_ROWS) * tile_low];
        low.par_chunks_mut(tile_low)
            .enumerate()
            .for_each(|(t, out)| {
                for (b, block) in out.chunks_exact_mut(2 * BLOCK_BYTES).enumerate() {
                    for (j, &(r, c)) in pairs.iter().enumerate() {
                        let row = t * TILE_ROWS + r;
                        if row >= rows {
                            continue;
                        }
                        let at = row * cols + b * BLOCK_COLS + c;
                        block[2 * j] = values[at] as u8;
                        block[2 * j + 1] = values[at + 1] as u8;
                    }
                }
            });
        // Escaped weights: low byte 0 in the stored form, the whole value in the list.
        let mut escapes = Vec::with_capacity(high.escapes().len());
        for r in 0..rows {
            for &e in &high.escapes()[high.row_ptr()[r] as usize..high.row_ptr()[r + 1] as usize] {
                let col = (e & 0xFF_FFFF) as usize;
                let (t, b, c) = (r / TILE_ROWS, col / BLOCK_COLS, col % BLOCK_COLS);
                let j = byte_of[r % TILE_ROWS][c / 2];
                low[t * tile_low + b * 2 * BLOCK_BYTES + 2 * j + (c & 1)] = 0;
                escapes.push(col as u32 | (values[r * cols + col] as u32) << 16);
            }
        }
        Ok(PaletteBf16 { high, low, escapes })
    }

    pub fn rows(&self) -> usize {
        self.high.rows()
    }

    pub fn cols(&self) -> usize {
        self.high.cols()
    }

    /// The 16 high bytes (slot 0: 0x00, the zero slot escapes are stored as).
    pub fn palette(&self) -> &[u8; SLOTS] {
        self.high.palette()
    }

    /// High-byte indices, as [`Palette4::indices`].
    pub fn indices(&self) -> &[u8] {
        self.high.indices()
    }

    /// Low bytes in fragment order (type documentation): rows rounded up to 16, times cols.
    pub fn low(&self) -> &[u8] {
        &self.low
    }

    /// `rows + 1` offsets into [`Self::escapes`].
    pub fn row_ptr(&self) -> &[u32] {
        self.high.row_ptr()
    }

    /// Escape entries, `col | bits << 16`, by row, columns ascending.
    pub fn escapes(&self) -> &[u32] {
        &self.escapes
    }

    /// Bytes of the packed form: indices, low bytes, palette, row offsets and escapes.
    pub fn stored_bytes(&self) -> usize {
        self.high.stored_bytes() + self.low.len()
    }

    /// Bits a weight of the packed form.
    pub fn bits_per_weight(&self) -> f64 {
        8.0 * self.stored_bytes() as f64 / (self.rows() * self.cols()) as f64
    }

    /// [`Self::stored_bytes`] of a `rows × cols` BF16 matrix whose high bytes have histogram
    /// `high`, exactly, without packing it.
    pub fn predict_bytes(high: &[u64; 256], rows: usize, cols: usize) -> usize {
        Palette4::predict_bytes(high, rows, cols, 0) + rows.div_ceil(TILE_ROWS) * TILE_ROWS * cols
    }

    /// All values, row-major, bit for bit the ones packed (tiles decoded in parallel).
    pub fn decode(&self) -> Vec<u16> {
        let cols = self.cols();
        let mut out = vec![0u16; self.rows() * cols];
        out.par_chunks_mut(TILE_ROWS * cols)
            .enumerate()
            .for_each(|(t, o)| {
                let r0 = t * TILE_ROWS;
                o.copy_from_slice(&self.decode_rows(r0..r0 + o.len() / cols));
            });
        out
    }

    /// The values of rows `rows` (row-major), bit for bit the ones packed.
    pub fn decode_rows(&self, rows: std::ops::Range<usize>) -> Vec<u16> {
        let cols = self.cols();
        let high = self.high.decode_rows(rows.clone());
        let mut out: Vec<u16> = high.iter().map(|&h| (h as u16) << 8).collect();
        // Low bytes: two a pair, the tile's blocks twice the index bytes.
        for_tile_pairs(cols, rows.clone(), |r, at, j| {
            let low = &self.low[r / TILE_ROWS * TILE_ROWS * cols + 2 * j..];
            let o = (r - rows.start) * cols + at;
            out[o] |= low[0] as u16;
            out[o + 1] |= low[1] as u16;
        });
        for r in rows.clone() {
            for &e in &self.escapes[self.row_ptr()[r] as usize..self.row_ptr()[r + 1] as usize] {
                out[(r - rows.start) * cols + (e & 0xFFFF) as usize] = (e >> 16) as u16;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic codes drawn from a skewed distribution over `distinct` values (the first
    /// twelve carry almost all the mass, as a low-entropy FP8 matrix's), zero included.
    fn skewed(n: usize, distinct: u32, seed: u64) -> Vec<u8> {
        let mut r = crate::rng::SplitMix64::new(seed);
        (0..n)
            .map(|_| {
                let u = (r.next_u64() >> 11) as u32;
                // Geometric-ish: value v with probability ~2^-(v+1), capped at `distinct`.
                let v = (u | 1 << 31).trailing_zeros().min(distinct - 1);
                let v = if (u >> 20).is_multiple_of(97) {
                    (u >> 8) % distinct
                } else {
                    v
                };
                // Spread the values over the byte range, signs included.
                (v * 37 % 256) as u8 ^ if u & 1 == 1 { 0x80 } else { 0 }
            })
            .collect()
    }

    #[test]
    fn round_trips_bit_exact_with_and_without_escapes() {
        for (rows, cols, distinct, seed) in [
            (1, 64, 3, 1),
            (3, 192, 4, 2),
            (17, 64, 16, 3),
            (33, 1088, 40, 4),
            (64, 512, 200, 5),
            (5, 4096, 256, 6),
        ] {
            let codes = skewed(rows * cols, distinct, seed);
            let p = Palette4::encode(&codes, rows, cols, 0).unwrap();
            assert_eq!(p.decode(), codes, "[{rows}, {cols}] distinct {distinct}");
            let hist = byte_histogram(&codes);
            assert_eq!(
                Palette4::predict_bytes(&hist, rows, cols, 0),
                p.stored_bytes()
            );
            assert_eq!(
                p.decode_rows(1.min(rows - 1)..rows),
                codes[1.min(rows - 1) * cols..]
            );
            assert_eq!(p.row_ptr().len(), rows + 1);
            assert_eq!(p.palette()[p.zero_slot() as usize], 0);
            // Escapes point at the zero slot and are sorted by column within a row.
            for r in 0..rows {
                let e = &p.escapes()[p.row_ptr()[r] as usize..p.row_ptr()[r + 1] as usize];
                assert!(e
                    .windows(2)
                    .all(|w| (w[0] & 0xFF_FFFF) < (w[1] & 0xFF_FFFF)));
                for &v in e {
                    let c = (v & 0xFF_FFFF) as usize;
                    let (t, b) = (r / TILE_ROWS, c / BLOCK_COLS);
                    let j = (0..BLOCK_BYTES)
                        .find(|&j| pair_at(j) == (r % TILE_ROWS, (c % BLOCK_COLS) & !1))
                        .unwrap();
                    let byte = p.indices()[(t * cols / BLOCK_COLS + b) * BLOCK_BYTES + j];
                    let nib = if c.is_multiple_of(2) {
                        byte & 15
                    } else {
                        byte >> 4
                    };
                    assert_eq!(nib, p.zero_slot());
                    assert!(!p.palette().contains(&((v >> 24) as u8)));
                }
            }
        }
    }

    #[test]
    fn few_codes_need_no_escapes_and_many_do() {
        // Sixteen distinct codes, zero among them: the palette holds them all.
        let codes: Vec<u8> = skewed(64 * 256, 200, 9).iter().map(|&c| c % 16).collect();
        let p = Palette4::encode(&codes, 64, 256, 0).unwrap();
        assert!(p.escapes().is_empty());
        assert_eq!(p.decode(), codes);
        // Sixteen without zero: zero takes a slot, the rarest of them escapes.
        let codes: Vec<u8> = codes.iter().map(|&c| c + 1).collect();
        let p = Palette4::encode(&codes, 64, 256, 0).unwrap();
        let rarest = (1..=16u8)
            .min_by_key(|&c| {
                (
                    codes.iter().filter(|&&x| x == c).count(),
                    std::cmp::Reverse(c),
                )
            })
            .unwrap();
        assert!(p.escapes().iter().all(|&e| (e >> 24) as u8 == rarest));
        assert!(!p.escapes().is_empty());
        assert_eq!(p.decode(), codes);
        let all: Vec<u8> = (0..=255u8).cycle().take(256 * 8).collect();
        let p = Palette4::encode(&all, 8, 256, 0).unwrap();
        assert_eq!(p.escapes().len(), 256 * 8 - 16 * 8);
        assert_eq!(p.decode(), all);
        assert!(p.bits_per_weight() > 4.0);
    }

    #[test]
    fn palette_takes_the_most_frequent_codes() {
        // 0x38 most frequent, then 0xB8, then 0x30; zero always slot 0.
        let mut codes = vec![0x38u8; 60];
        codes.extend([0xB8u8; 30]);
        codes.extend([0x30u8; 10]);
        codes.extend([0x00u8; 2]);
        codes.resize(128, 0x38);
        let p = Palette4::encode(&codes[..64], 2, 32, 0)
            .map(|_| ())
            .unwrap_err();
        assert!(p.to_string().contains("multiple of 64"), "{p}");
        let p = Palette4::encode(&codes, 1, 128, 0).unwrap();
        assert_eq!(&p.palette()[..4], &[0x00, 0x38, 0xB8, 0x30]);
        assert!(p.escapes().is_empty());
        // One row, padded to a tile of 16.
        assert_eq!(p.stored_bytes(), 16 * 64 + 16 + 8);
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(Palette4::encode(&[], 0, 64, 0).is_err());
        assert!(Palette4::encode(&[1; 63], 1, 64, 0).is_err());
        assert!(Palette4::encode(&[1; 32], 1, 32, 0).is_err());
        let codes: Vec<u8> = (0..128).collect();
        let e = Palette4::encode(&codes, 2, 64, 0).unwrap();
        assert_eq!(e.decode(), codes);
        // Two rows fill a 16-row tile: the other rows are zero-slot padding.
        assert_eq!(e.indices().len(), TILE_ROWS * 64 / 2);
    }

    /// BF16 bit patterns of a bell-shaped matrix with a spread of row scales: high bytes over
    /// about 16 values, a few beyond.
    fn bell_bf16(rows: usize, cols: usize, seed: u64) -> Vec<u16> {
        let mut r = crate::rng::SplitMix64::new(seed);
        (0..rows * cols)
            .map(|i| {
                let row_scale = 0.02 * (1.0 + (i / cols % 7) as f64 * 0.1);
                // Box–Muller: one normal a value.
                let z = r.normal();
                let v = (row_scale * z) as f32;
                (v.to_bits() >> 16) as u16
            })
            .collect()
    }

    #[test]
    fn bf16_round_trips_bit_exact() {
        for (rows, cols, seed) in [
            (1, 64, 1),
            (17, 128, 2),
            (40, 1088, 3),
            (3, 4096, 4),
            (64, 2048, 5),
        ] {
            let v = bell_bf16(rows, cols, seed);
            let p = PaletteBf16::encode(&v, rows, cols).unwrap();
            assert_eq!(p.decode(), v, "[{rows}, {cols}]");
            let from = rows / 3;
            assert_eq!(p.decode_rows(from..rows), v[from * cols..]);
            let high: Vec<u8> = v.iter().map(|&x| (x >> 8) as u8).collect();
            assert_eq!(
                PaletteBf16::predict_bytes(&byte_histogram(&high), rows, cols),
                p.stored_bytes()
            );
            assert_eq!(p.low().len(), rows.div_ceil(TILE_ROWS) * TILE_ROWS * cols);
            if rows % TILE_ROWS == 0 {
                // Whole tiles: 12 bits and the few escapes.
                assert!(p.bits_per_weight() < 12.1, "{}", p.bits_per_weight());
            }
        }
        // Every high byte different: most weights escape, still exact.
        let all: Vec<u16> = (0..64 * 64u32).map(|i| (i * 0x9E37) as u16).collect();
        let p = PaletteBf16::encode(&all, 64, 64).unwrap();
        assert!(p.escapes().len() > 64 * 64 / 2);
        assert_eq!(p.decode(), all);
        assert_eq!(p.decode_rows(17..40), all[17 * 64..40 * 64]);
        let high: Vec<u8> = all.iter().map(|&x| (x >> 8) as u8).collect();
        assert_eq!(
            PaletteBf16::predict_bytes(&byte_histogram(&high), 64, 64),
            p.stored_bytes()
        );
        // The stored form of an escaped weight is +0: index zero-slot (high byte 0), low byte 0.
        for r in 0..64 {
            for &e in &p.escapes()[p.row_ptr()[r] as usize..p.row_ptr()[r + 1] as usize] {
                let c = (e & 0xFFFF) as usize;
                let j = (0..BLOCK_BYTES)
                    .find(|&j| pair_at(j) == (r % TILE_ROWS, (c % BLOCK_COLS) & !1))
                    .unwrap();
                let at =
                    (r / TILE_ROWS * 64 / BLOCK_COLS + c / BLOCK_COLS) * 2 * BLOCK_BYTES + 2 * j;
                assert_eq!(p.low()[at + (c & 1)], 0);
            }
        }
    }

    #[test]
    fn bf16_bad_shapes_are_errors() {
        assert!(PaletteBf16::encode(&[0; 64], 1, 32).is_err());
        assert!(PaletteBf16::encode(&[0; 63], 1, 64).is_err());
        let e = PaletteBf16::encode(&vec![0; 1 << 16], 1, 1 << 16).unwrap_err();
        assert!(e.to_string().contains("columns"), "{e}");
    }

    #[test]
    fn tile_order_is_the_mma_fragment_order() {
        // Every (row, even column) of a 16 × 64 block exactly once.
        let mut seen = [[false; BLOCK_COLS / 2]; TILE_ROWS];
        for j in 0..BLOCK_BYTES {
            let (r, c) = pair_at(j);
            assert!(
                c.is_multiple_of(2) && !seen[r][c / 2],
                "byte {j}: ({r}, {c}) twice"
            );
            seen[r][c / 2] = true;
        }
        // Thread 5 (group 1, quad position 1): K step 2's registers are rows 1, 9, 1, 9 at
        // columns 32 + 2, 32 + 2, 32 + 10, 32 + 10 (PTX ISA, m16n8k16 A fragment).
        let regs: Vec<_> = (0..4).map(|i| pair_at(16 * 5 + 4 * 2 + i)).collect();
        assert_eq!(regs, [(1, 34), (9, 34), (1, 42), (9, 42)]);
    }
}
