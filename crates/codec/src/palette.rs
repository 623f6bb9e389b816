//! Palette packing: a matrix of one-byte codes (an FP8 checkpoint's weights) as 4-bit indices into
//! a palette of at most 16 codes, with the codes outside the palette in a per-row escape list.
//!
//! Not an entropy coder — 4 bits a weight plus 32 an escape, against the ≈ 2.1 bits of entropy of a
//! low-entropy FP8 checkpoint that dtANS reaches — but its decode is one table lookup per pair of
//! weights with no dependency between them, which is what lets a batch-1 product read half the
//! dense FP8 bytes without spending more instructions than it saves (the GPU's `gemv_pal4`). It is
//! a serving form, built at load from the codes (dense or decoded from a container).
//!
//! Layout: row-major, `cols / 2` bytes a row (cols a multiple of 32), two indices a byte (low nibble
//! first), in *lane order* ([`column_of`]): the GPU reads a row in 16-byte chunks of 32 indices, 32
//! lanes side by side, and lane `l`'s chunk holds eight groups of four consecutive columns spaced
//! so that each group's x values, read by all lanes at once, are one contiguous run (a coalesced
//! load, where plain order would have each lane read 128 bytes of its own). An escaped weight is
//! stored as the palette slot of the zero code, so a product over the indices skips it; the
//! escape list then adds its true value. Escapes of row `r` are `escapes[row_ptr[r]..row_ptr[r +
//! 1]]`, each `col | code << 24`, columns ascending.

use rayon::prelude::*;

use crate::histogram::byte_histogram;
use crate::{CodecError, Result};

/// Palette slots (4-bit indices).
pub const SLOTS: usize = 16;

/// Escape entries hold the column in 24 bits.
pub const MAX_COLS: usize = 1 << 24;

/// Indices a GPU lane reads at once (16 bytes), and lanes of a warp.
const CHUNK: usize = 32;
const LANES: usize = 32;

/// The column of the index at position `pos` of a packed row of `cols` columns (lane order): chunk
/// `c = pos / 32` belongs to lane `l = c % 32` of the 1024-column block `s = c / 32`, which spans
/// `m = min(32, chunks left)` chunks; its group `g` (of four) covers columns
/// `1024 s + 4 (g m + l) ..+ 4`.
pub fn column_of(cols: usize, pos: usize) -> usize {
    let (c, w) = (pos / CHUNK, pos % CHUNK);
    let (s, l) = (c / LANES, c % LANES);
    let m = (cols / CHUNK - s * LANES).min(LANES);
    s * LANES * CHUNK + 4 * ((w / 4) * m + l) + w % 4
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
    /// Packs `codes` (row-major [rows, cols], cols a multiple of 32 below 2^24) whose code `zero` has the value
    /// zero (0x00 for FP8 E4M3). The palette holds `zero` and the 15 most frequent other codes (all
    /// of them when there are fewer; ties to the smaller code, so the result is deterministic).
    pub fn encode(codes: &[u8], rows: usize, cols: usize, zero: u8) -> Result<Self> {
        if rows == 0 || cols == 0 || !cols.is_multiple_of(CHUNK) || cols >= MAX_COLS {
            return Err(CodecError::Shape(format!(
                "palette packing needs rows > 0 and a multiple of 32 columns below 2^24, got \
                 [{rows}, {cols}]"
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
        let mut order: Vec<u8> = (0..=255u8)
            .filter(|&c| c != zero && hist[c as usize] > 0)
            .collect();
        order.sort_by_key(|&c| (std::cmp::Reverse(hist[c as usize]), c));
        let mut palette = [zero; SLOTS];
        for (slot, &c) in palette[1..].iter_mut().zip(&order) {
            *slot = c;
        }
        let zero_slot = 0u8;
        // Code → slot; codes outside the palette escape.
        let mut slot_of = [None; 256];
        for (s, &c) in palette.iter().enumerate().rev() {
            slot_of[c as usize] = Some(s as u8);
        }
        let half = cols / 2;
        let lane_cols: Vec<u32> = (0..cols).map(|p| column_of(cols, p) as u32).collect();
        let mut indices = vec![0u8; rows * half];
        let row_escapes: Vec<Vec<u32>> = indices
            .par_chunks_mut(half)
            .zip(codes.par_chunks(cols))
            .map(|(out, row)| {
                let mut esc = Vec::new();
                for (o, at) in out.iter_mut().zip(lane_cols.chunks_exact(2)) {
                    let mut nib = [0u8; 2];
                    for (n, &col) in nib.iter_mut().zip(at) {
                        let c = row[col as usize];
                        *n = slot_of[c as usize].unwrap_or_else(|| {
                            esc.push(col | (c as u32) << 24);
                            zero_slot
                        });
                    }
                    *o = nib[0] | nib[1] << 4;
                }
                esc.sort_unstable_by_key(|e| e & 0xFF_FFFF);
                esc
            })
            .collect();
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

    /// Row-major packed indices, `cols / 2` bytes a row in lane order ([`column_of`]), low nibble
    /// first.
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

    /// Bits a weight of the packed form.
    pub fn bits_per_weight(&self) -> f64 {
        8.0 * self.stored_bytes() as f64 / (self.rows * self.cols) as f64
    }

    /// The codes of rows `rows` (row-major), bit for bit the ones packed.
    pub fn decode_rows(&self, rows: std::ops::Range<usize>) -> Vec<u8> {
        let (half, cols) = (self.cols / 2, self.cols);
        let lane_cols: Vec<usize> = (0..cols).map(|p| column_of(cols, p)).collect();
        let mut out = vec![0u8; rows.len() * cols];
        for (r, row) in rows.zip(out.chunks_mut(cols)) {
            for (at, &b) in lane_cols
                .chunks_exact(2)
                .zip(&self.indices[r * half..(r + 1) * half])
            {
                row[at[0]] = self.palette[(b & 15) as usize];
                row[at[1]] = self.palette[(b >> 4) as usize];
            }
            for &e in &self.escapes[self.row_ptr[r] as usize..self.row_ptr[r + 1] as usize] {
                row[(e & 0xFF_FFFF) as usize] = (e >> 24) as u8;
            }
        }
        out
    }

    /// All codes, row-major.
    pub fn decode(&self) -> Vec<u8> {
        self.decode_rows(0..self.rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic codes drawn from a skewed distribution over `distinct` values (the first
    /// twelve carry almost all the mass, as a low-entropy FP8 matrix's), zero included.
    fn skewed(n: usize, distinct: u32, seed: u64) -> Vec<u8> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 11) as u32;
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
            (1, 32, 3, 1),
            (3, 96, 4, 2),
            (17, 64, 16, 3),
            (33, 1056, 40, 4),
            (64, 512, 200, 5),
            (5, 4096, 256, 6),
        ] {
            let codes = skewed(rows * cols, distinct, seed);
            let p = Palette4::encode(&codes, rows, cols, 0).unwrap();
            assert_eq!(p.decode(), codes, "[{rows}, {cols}] distinct {distinct}");
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
                    let pos = (0..cols).find(|&q| column_of(cols, q) == c).unwrap();
                    let b = p.indices()[r * cols / 2 + pos / 2];
                    let nib = if pos.is_multiple_of(2) {
                        b & 15
                    } else {
                        b >> 4
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
        let p = Palette4::encode(&codes[..96], 2, 48, 0)
            .map(|_| ())
            .unwrap_err();
        assert!(p.to_string().contains("multiple of 32"), "{p}");
        let p = Palette4::encode(&codes, 1, 128, 0).unwrap();
        assert_eq!(&p.palette()[..4], &[0x00, 0x38, 0xB8, 0x30]);
        assert!(p.escapes().is_empty());
        assert_eq!(p.stored_bytes(), 64 + 16 + 8);
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(Palette4::encode(&[], 0, 32, 0).is_err());
        assert!(Palette4::encode(&[1; 31], 1, 32, 0).is_err());
        assert!(Palette4::encode(&[1; 48], 1, 48, 0).is_err());
        let codes: Vec<u8> = (0..64).collect();
        let e = Palette4::encode(&codes, 2, 32, 0).unwrap();
        assert_eq!(e.decode(), codes);
    }

    #[test]
    fn lane_order_is_a_permutation_with_coalesced_groups() {
        for cols in [32, 96, 1024, 1056, 4096, 14_336] {
            let mut seen = vec![false; cols];
            for p in 0..cols {
                let c = column_of(cols, p);
                assert!(!seen[c], "cols {cols}: column {c} twice");
                seen[c] = true;
            }
            // Group 3 of the first block's lanes: consecutive runs of four, lane after lane.
            let m = (cols / 32).min(32);
            for l in 0..m {
                assert_eq!(column_of(cols, 32 * l + 4 * 3), 4 * (3 * m + l));
            }
        }
        // Plain order inside a group of four.
        let first: Vec<usize> = (0..4).map(|p| column_of(1024, p)).collect();
        assert_eq!(first, [0, 1, 2, 3]);
    }
}
