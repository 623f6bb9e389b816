//! The CPU dtANS-LLM decoder. It takes the GPU decoder's steps one by one (per-lane state, quartets,
//! companion bits, the warp's chunked reads, escape rounds) so that it is the reference the GPU
//! kernels are checked against, and it checks every read, so corrupt input is an error, not a panic.

use super::*;
use crate::matvec::Dequant;
use rayon::prelude::*;

/// Decodes tiles of one tensor.
pub(crate) struct TileDecoder<'a> {
    t: &'a DtansTensor,
    g: Geometry,
    entries: Vec<u32>,
}

/// One decoded tile: codes of its 32 lanes × sc columns (lane-major) and its escapes.
pub(crate) struct Tile {
    pub codes: Vec<u8>,
    /// Chunks and trailing alignment words of the tile's stream.
    pub chunks: usize,
    pub padding_words: usize,
    /// (lane, column in slice, element value).
    pub escapes: Vec<(usize, usize, u16)>,
}

/// Reads a warp's words through its 1 KiB chunks, as the kernel's shared-memory buffer does.
pub(super) struct ChunkReader<'a> {
    s: &'a [u32],
    chunk: usize,
    pos: usize,
    due: u32,
}

impl<'a> ChunkReader<'a> {
    pub(super) fn new(s: &'a [u32]) -> Result<Self> {
        let due = *s
            .first()
            .ok_or_else(|| corrupt("the stream has no first chunk"))?;
        Ok(ChunkReader {
            s,
            chunk: 0,
            pos: 1,
            due,
        })
    }

    fn take(&mut self, n: usize, out: &mut Vec<u32>) -> Result<()> {
        let start = self.chunk + self.pos;
        let end = start + n;
        if end > self.s.len() || self.pos + n > CHUNK_WORDS {
            return Err(corrupt("a read runs past the end of the stream"));
        }
        out.extend_from_slice(&self.s[start..end]);
        self.pos += n;
        Ok(())
    }

    /// The `n` words of read step `step` where they lie in one piece in the current chunk (the
    /// common case, which a SIMD decoder loads in place); `None` where [`Self::read`] must copy.
    #[inline]
    pub(super) fn contiguous(&mut self, step: u32, n: usize) -> Option<&'a [u32]> {
        let start = self.chunk + self.pos;
        if step < self.due && self.pos + n <= CHUNK_WORDS && start + n <= self.s.len() {
            self.pos += n;
            Some(&self.s[start..start + n])
        } else {
            None
        }
    }

    /// The `n` words of read step `step`, in lane order.
    pub(super) fn read(&mut self, step: u32, n: usize, out: &mut Vec<u32>) -> Result<()> {
        out.clear();
        if self.due < step {
            return Err(corrupt(&format!(
                "chunk due at step {} was never used",
                self.due
            )));
        }
        if step < self.due {
            return self.take(n, out);
        }
        let avail = CHUNK_WORDS - self.pos;
        if avail >= n {
            return Err(corrupt(&format!(
                "chunk header says step {step} runs out, but it fits"
            )));
        }
        self.take(avail, out)?;
        self.chunk += CHUNK_WORDS;
        let due = *self
            .s
            .get(self.chunk)
            .ok_or_else(|| corrupt("a needed chunk is missing"))?;
        if due <= step {
            return Err(corrupt(&format!(
                "chunk header {due} is not after step {step}"
            )));
        }
        self.due = due;
        self.pos = 1;
        self.take(n - avail, out)
    }

    /// All words were read: the last chunk never runs out and only alignment padding follows.
    /// Returns the number of chunks and of padding words.
    pub(super) fn finish(&self) -> Result<(usize, usize)> {
        if self.due != NO_DUE {
            return Err(corrupt("the last chunk claims a further chunk"));
        }
        let rest = &self.s[(self.chunk + self.pos).min(self.s.len())..];
        if rest.len() >= STREAM_ALIGN || rest.iter().any(|&w| w != 0) {
            return Err(corrupt(&format!(
                "{} unread words follow the tile's stream",
                rest.len()
            )));
        }
        Ok((self.chunk / CHUNK_WORDS + 1, rest.len()))
    }
}

pub(super) fn corrupt(msg: &str) -> CodecError {
    CodecError::Corrupt(msg.to_string())
}

impl<'a> TileDecoder<'a> {
    pub fn new(t: &'a DtansTensor) -> Result<Self> {
        t.validate()?;
        Ok(TileDecoder {
            t,
            g: t.geometry()?,
            entries: t.table.decoder_entries(),
        })
    }

    pub fn geometry(&self) -> &Geometry {
        &self.g
    }

    pub fn decode_tile(&self, tile: usize) -> Result<Tile> {
        let (row0, col0) = self.g.tile_origin(tile);
        self.decode_tile_inner(tile, row0, col0)
            .map_err(|e| match e {
                CodecError::Corrupt(m) => CodecError::Corrupt(format!(
                    "tile {tile} (rows {row0}.., columns {col0}..): {m}"
                )),
                e => e,
            })
    }

    fn decode_tile_inner(&self, tile: usize, row0: usize, col0: usize) -> Result<Tile> {
        let (g, t) = (&self.g, self.t);
        let start = t.tiles[2 * tile] as usize;
        let end = t
            .tiles
            .get(2 * tile + 2)
            .map_or(t.stream.len(), |&o| o as usize);
        let s = &t.stream[start..end];
        let mut x: [u64; LANES] = std::array::from_fn(|l| s[l] as u64);
        let mut b: [u32; LANES] = std::array::from_fn(|l| s[LANES + l]);
        let mut reader = ChunkReader::new(&s[PROLOGUE_WORDS..])?;

        let cb = t.payload.code_bits();
        let code_mask = (1u32 << cb) - 1;
        let cbits = g.companion_bits_per_symbol;
        let comp = &t.companion[tile * LANES * g.companion_words..][..LANES * g.companion_words];
        let mut codes = vec![0u8; LANES * g.sc];
        let mut words = Vec::with_capacity(LANES);
        for q in 0..g.quartets {
            let bit = q * 4 * cbits as usize;
            for lane in 0..LANES {
                let cw = companion_word(comp, bit, lane, cbits);
                let (mut big_r, mut d) = (1u64, 0u64);
                for i in 0..4 {
                    let hi = if cbits > 0 {
                        (cw >> (i as u32 * cbits)) & ((1 << cbits) - 1)
                    } else {
                        0
                    };
                    let e = self.entries[(((b[lane] >> (8 * i)) & 0xFF) | hi << 8) as usize];
                    let r = (e & 0xFF) as u64;
                    big_r *= r;
                    d = d * r + ((e >> 8) & 0xFF) as u64;
                    let payload = e >> 16;
                    let base = lane * g.sc + (4 * q + i) * g.k;
                    for j in 0..g.k {
                        codes[base + j] = ((payload >> (j as u32 * cb)) & code_mask) as u8;
                    }
                }
                x[lane] = x[lane] * big_r + d;
            }
            if q + 1 < g.quartets {
                let mut need = 0u32;
                for lane in 0..LANES {
                    if x[lane] >> 32 != 0 {
                        b[lane] = x[lane] as u32;
                        x[lane] >>= 32;
                    } else {
                        need |= 1 << lane;
                    }
                }
                reader.read(q as u32, need.count_ones() as usize, &mut words)?;
                for (lane, &w) in lanes(need).zip(&words) {
                    b[lane] = w;
                }
            }
        }

        let mut escapes = Vec::new();
        read_escapes(
            g,
            t.tiles[2 * tile + 1],
            (row0, col0),
            &mut reader,
            &mut words,
            |lane, col, rec| escapes.push((lane, col, rec)),
        )?;
        let (chunks, padding_words) = reader.finish()?;
        Ok(Tile {
            codes,
            chunks,
            padding_words,
            escapes,
        })
    }
}

/// A tile's escape records, after its main symbols: each lane set in `active` has records in
/// column order, the last one flagged. Each is checked (reserved bits clear, inside the matrix,
/// columns increasing) and handed to `f` as (lane, column in the tile, record's low 16 bits).
pub(super) fn read_escapes(
    g: &Geometry,
    mut active: u32,
    (row0, col0): (usize, usize),
    reader: &mut ChunkReader,
    words: &mut Vec<u32>,
    mut f: impl FnMut(usize, usize, u16),
) -> Result<()> {
    let mut last_col = [None::<usize>; LANES];
    let valid_cols = g.sc.min(g.cols - col0);
    let mut round = 0u32;
    while active != 0 {
        if round as usize >= g.sc {
            return Err(corrupt("more escape rounds than columns"));
        }
        reader.read(
            (g.quartets - 1) as u32 + round,
            active.count_ones() as usize,
            words,
        )?;
        for (lane, &rec) in lanes(active).zip(words.iter()) {
            let col = ((rec >> REC_COL_SHIFT) & 0x7FF) as usize;
            if rec & REC_RESERVED != 0 {
                return Err(corrupt(&format!(
                    "escape record {rec:#010x} has reserved bits set"
                )));
            }
            if row0 + lane >= g.rows || col >= valid_cols {
                return Err(corrupt(&format!(
                    "escape at lane {lane}, column {col} is outside the matrix"
                )));
            }
            if last_col[lane].is_some_and(|c| c >= col) {
                return Err(corrupt(&format!(
                    "escapes of lane {lane} are not in column order"
                )));
            }
            last_col[lane] = Some(col);
            f(lane, col, rec as u16);
            if rec & REC_LAST != 0 {
                active &= !(1 << lane);
            }
        }
        round += 1;
    }
    Ok(())
}

/// The companion bits of `lane` from bit `bit` of its interleaved companion words (`comp`, one
/// word a lane in turn), in the low bits; none when a symbol has no companion bits.
pub(super) fn companion_word(comp: &[u32], bit: usize, lane: usize, cbits: u32) -> u32 {
    if cbits > 0 {
        comp[(bit / 32) * LANES + lane] >> (bit % 32)
    } else {
        0
    }
}

/// The set lanes of a mask, in order.
pub(super) fn lanes(mask: u32) -> impl Iterator<Item = usize> {
    (0..LANES).filter(move |&l| mask >> l & 1 != 0)
}

impl DtansTensor {
    /// Decodes into the source element bytes (little-endian u16 for 16-bit floats, one byte per code
    /// otherwise), row-major.
    pub fn decode_into(&self, out: &mut [u8]) -> Result<()> {
        self.decode_counting(out).map(|_| ())
    }

    /// [`Self::decode_into`], counting the stream's chunk headers, padding and escapes on the way
    /// (what [`Self::size_breakdown`] decodes every tile for).
    fn decode_counting(&self, out: &mut [u8]) -> Result<(usize, usize, usize)> {
        let dec = TileDecoder::new(self)?;
        let g = *dec.geometry();
        let eb = self.payload.element_bytes();
        if out.len() != g.rows * g.cols * eb {
            return Err(CodecError::Shape(format!(
                "output has {} bytes, the tensor decodes to {}",
                out.len(),
                g.rows * g.cols * eb
            )));
        }
        out.par_chunks_mut(LANES * g.cols * eb)
            .enumerate()
            .map(|(band, rows)| {
                let mut counts = (0, 0, 0);
                for slice in 0..g.slices {
                    let tile = dec.decode_tile(slice * g.bands + band)?;
                    counts.0 += tile.chunks;
                    counts.1 += tile.padding_words;
                    counts.2 += tile.escapes.len();
                    let raw = &self.raw[if g.has_raw {
                        (slice * g.bands + band) * LANES * g.sc
                    } else {
                        0
                    }..];
                    let col0 = slice * g.sc;
                    let ncols = g.sc.min(g.cols - col0);
                    for (lane, row) in rows.chunks_mut(g.cols * eb).enumerate() {
                        let codes = &tile.codes[lane * g.sc..];
                        if g.has_raw {
                            let out = &mut row[col0 * 2..(col0 + ncols) * 2];
                            for (u, (out, codes)) in out
                                .chunks_mut(2 * RAW_UNIT)
                                .zip(codes.chunks(RAW_UNIT))
                                .enumerate()
                            {
                                let raw =
                                    &raw[Geometry::raw_index(lane, u * RAW_UNIT)..][..RAW_UNIT];
                                for ((o, &c), &r) in out.chunks_exact_mut(2).zip(codes).zip(raw) {
                                    o.copy_from_slice(&self.payload.join16(c, r).to_le_bytes());
                                }
                            }
                        } else {
                            row[col0..col0 + ncols].copy_from_slice(&codes[..ncols]);
                        }
                    }
                    for &(lane, c, v) in &tile.escapes {
                        let at = (lane * g.cols + col0 + c) * eb;
                        rows[at..at + eb].copy_from_slice(&v.to_le_bytes()[..eb]);
                    }
                }
                Ok(counts)
            })
            .try_reduce(|| (0, 0, 0), |a, b| Ok((a.0 + b.0, a.1 + b.1, a.2 + b.2)))
    }

    /// The decoded bytes ([`Self::decode`]) and where the stored bytes go
    /// ([`Self::size_breakdown`]), from one pass over the tiles.
    pub fn decode_with_breakdown(&self) -> Result<(Vec<u8>, SizeBreakdown)> {
        let mut out = vec![0u8; self.rows * self.cols * self.payload.element_bytes()];
        let (chunks, padding, escapes) = self.decode_counting(&mut out)?;
        Ok((out, self.breakdown(chunks, padding, escapes)))
    }

    /// Row `row` as f32 values (decodes the tiles of its 32-row band; for embedding lookups).
    pub fn row_f32(&self, row: usize, out: &mut [f32]) -> Result<()> {
        let dec = TileDecoder::new(self)?;
        let g = *dec.geometry();
        if row >= g.rows || out.len() != g.cols {
            return Err(CodecError::Shape(format!(
                "row {row} of a {}×{} matrix into {} values",
                g.rows,
                g.cols,
                out.len()
            )));
        }
        let (band, lane) = (row / LANES, row % LANES);
        for slice in 0..g.slices {
            let t = slice * g.bands + band;
            let tile = dec.decode_tile(t)?;
            let raw = &self.raw[if g.has_raw { t * LANES * g.sc } else { 0 }..];
            let col0 = slice * g.sc;
            for c in 0..g.sc.min(g.cols - col0) {
                let r = if g.has_raw {
                    raw[Geometry::raw_index(lane, c)]
                } else {
                    0
                };
                out[col0 + c] = self.payload.to_f32(tile.codes[lane * g.sc + c], r);
            }
            for &(_, c, v) in tile.escapes.iter().filter(|e| e.0 == lane) {
                let (code, r) = self.payload.split_element(v);
                out[col0 + c] = self.payload.to_f32(code, r);
            }
        }
        Ok(())
    }

    /// Where the stored bytes go; decodes every tile to count chunks, escapes and padding.
    pub fn size_breakdown(&self) -> Result<SizeBreakdown> {
        let dec = TileDecoder::new(self)?;
        let g = *dec.geometry();
        let per_tile: Vec<(usize, usize, usize)> = (0..g.tiles())
            .into_par_iter()
            .map(|t| {
                dec.decode_tile(t)
                    .map(|tile| (tile.chunks, tile.padding_words, tile.escapes.len()))
            })
            .collect::<Result<_>>()?;
        let (chunks, padding, escapes) = per_tile
            .iter()
            .fold((0, 0, 0), |a, b| (a.0 + b.0, a.1 + b.1, a.2 + b.2));
        Ok(self.breakdown(chunks, padding, escapes))
    }

    fn breakdown(&self, chunks: usize, padding: usize, escapes: usize) -> SizeBreakdown {
        let b = SizeBreakdown {
            ans_bytes: 4 * (self.stream.len() - chunks - padding - escapes),
            chunk_header_bytes: 4 * chunks,
            escape_bytes: 4 * escapes,
            padding_bytes: 4 * padding,
            companion_bytes: 4 * self.companion.len(),
            raw_bytes: self.raw.len(),
            tile_index_bytes: 4 * self.tiles.len(),
            table_bytes: 5 * self.table.symbols.len(),
            escapes,
        };
        debug_assert_eq!(b.total(), self.stored_bytes());
        b
    }

    pub fn decode(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.rows * self.cols * self.payload.element_bytes()];
        self.decode_into(&mut out)?;
        Ok(out)
    }

    /// The CPU reference of the fused decode-matvec: y = W·x, decoding one tile at a time (the matrix
    /// is never materialised), with `dequant` applied per group as the kernel's epilogue does.
    pub fn matvec(&self, x: &[f32], y: &mut [f32], dequant: &Dequant) -> Result<()> {
        let dec = TileDecoder::new(self)?;
        let g = *dec.geometry();
        g.check_matvec(x, y, dequant)?;
        y.par_chunks_mut(LANES)
            .enumerate()
            .try_for_each(|(band, ys)| {
                let mut acc = [0f64; LANES];
                let mut w = vec![0f32; g.sc];
                for slice in 0..g.slices {
                    let t = slice * g.bands + band;
                    let tile = dec.decode_tile(t)?;
                    let raw = &self.raw[if g.has_raw { t * LANES * g.sc } else { 0 }..];
                    let col0 = slice * g.sc;
                    let ncols = g.sc.min(g.cols - col0);
                    for (lane, acc) in acc.iter_mut().enumerate().take(ys.len()) {
                        let row = band * LANES + lane;
                        for c in 0..ncols {
                            let r = if g.has_raw {
                                raw[Geometry::raw_index(lane, c)]
                            } else {
                                0
                            };
                            w[c] = self.payload.to_f32(tile.codes[lane * g.sc + c], r);
                        }
                        for &(l, c, v) in tile.escapes.iter().filter(|e| e.0 == lane) {
                            let (code, r) = self.payload.split_element(v);
                            debug_assert_eq!(l, lane);
                            w[c] = self.payload.to_f32(code, r);
                        }
                        for c in 0..ncols {
                            *acc += dequant.apply(self.payload, row, col0 + c, g.cols, w[c]) as f64
                                * x[col0 + c] as f64;
                        }
                    }
                }
                for (y, a) in ys.iter_mut().zip(acc) {
                    *y = a as f32;
                }
                Ok(())
            })
    }
}
