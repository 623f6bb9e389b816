//! dtANS-LLM: the tabled ANS variant of MINE (§4.1) that a GPU warp decodes inside the matrix-vector
//! product. `docs/format.md` ("Coded tensors: dtANS-LLM") specifies the layout; in brief:
//!
//! A tensor W [rows × cols] is cut into tiles of 32 rows × `sc` columns; one warp decodes a tile,
//! lane l the tile's row l. Each lane decodes its row's symbols four at a time (a *quartet*). A symbol
//! (k = 1/2/4 codes for Single/Pair/Quad) is found at table index `byte_i(b) | companion_i << 8`, where
//! `b` is the lane's 32-bit state word and `companion_i` are `log2 M − 8` raw bits from the companion
//! stream. The entry gives the symbol's slot count r and this slot's digit d; the digits go into a
//! mixed-radix accumulator `x ← x·(r0 r1 r2 r3) + ((d0 r1 + d1) r2 + d2) r3 + d3`. The next state word
//! comes from the accumulator when it holds 32 bits or more (`x ≥ 2^32`: b = low word, x >>= 32),
//! otherwise from the compressed stream. The encoder runs backwards and decides per quartet whether the
//! following state word is folded into the accumulator (when `1 ≤ x < r0 r1 r2 r3`) or emitted, which
//! keeps `x < 2^32` before every step, so decoding is deterministic. A symbol with r slots costs
//! log2(M / r) bits, never less than log2 M − 8.
//!
//! Per tile the stream holds a prologue (each lane's initial accumulator and first state word), then
//! the words lanes read, in the order the warp reads them, through 1 KiB chunks whose first word says at
//! which read step the chunk runs out; escape records (weights whose code is not in the table: coded as
//! the zero code, fixed afterwards) follow the ANS reads in the same chunk stream. Companion bits and
//! raw sign/mantissa bytes are consumed at fixed rates and live in their own lane-interleaved arrays.

mod choose;
mod decode;
mod encode;
mod fast;
mod table;

pub use choose::{
    choose_coding, choose_coding_and_width, default_slice_width, predict_bytes, predict_many,
    TupleHistograms,
};
pub use encode::EncodePlan;
pub use fast::{avx512, CpuProduct};
pub use table::{SymbolTable, MAX_SLOTS};

use crate::{CodecError, Payload, Result};
use serde::{Deserialize, Serialize};

/// Lanes of a warp, rows of a tile.
pub const LANES: usize = 32;
/// Words in one shared-memory chunk (1 KiB), header included.
pub const CHUNK_WORDS: usize = 256;
/// Prologue words of a tile: 32 initial accumulators, then 32 initial state words.
pub const PROLOGUE_WORDS: usize = 2 * LANES;
/// Chunk header of the last chunk of a tile: it never runs out.
pub const NO_DUE: u32 = u32::MAX;
/// Raw bytes are lane-interleaved in units of this many bytes (one 16-byte load per lane).
pub const RAW_UNIT: usize = 16;
/// Each tile's stream starts at a multiple of this many words (16 bytes, for cp.async).
pub const STREAM_ALIGN: usize = 4;
/// Table sizes (log2 M) the decoder supports: 0, 1, 2 or 4 companion bits per symbol.
pub const TABLE_LOG2: [u8; 4] = [8, 9, 10, 12];
/// Slice widths (columns per tile).
pub const SLICE_WIDTHS: [u32; 6] = [64, 128, 256, 512, 1024, 2048];

/// Escape record: value (bits 0..16), column in the slice (16..27), last-of-row flag (27), and four
/// bits that must be zero (the records are processed after the main loop, so no pause is needed).
pub(crate) const REC_COL_SHIFT: u32 = 16;
pub(crate) const REC_LAST: u32 = 1 << 27;
pub(crate) const REC_RESERVED: u32 = 0xF << 28;

/// Values per symbol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Single,
    Pair,
    Quad,
}

impl Mode {
    pub fn values_per_symbol(self) -> usize {
        match self {
            Mode::Single => 1,
            Mode::Pair => 2,
            Mode::Quad => 4,
        }
    }
}

impl std::fmt::Display for Coding {
    /// The form [`Coding::parse`] reads: `pair:12:512:64`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = match self.mode {
            Mode::Single => "single",
            Mode::Pair => "pair",
            Mode::Quad => "quad",
        };
        write!(f, "{mode}:{}:{}", self.log2_m, self.sc)?;
        if let Some(t) = self.t {
            write!(f, ":{t}")?;
        }
        Ok(())
    }
}

/// The parameters of one dtANS-LLM coding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Coding {
    pub mode: Mode,
    /// log2 of the table size M.
    pub log2_m: u8,
    /// Columns per tile.
    pub sc: u32,
    /// Codes kept in the table; the others are escaped. `None` keeps every code.
    pub t: Option<u16>,
}

impl Coding {
    pub fn validate(&self, payload: Payload) -> Result<()> {
        payload.validate()?;
        if !TABLE_LOG2.contains(&self.log2_m) {
            return Err(CodecError::Unsupported(format!(
                "table size M = 2^{} (supported: 2^8, 2^9, 2^10, 2^12)",
                self.log2_m
            )));
        }
        if !SLICE_WIDTHS.contains(&self.sc) {
            return Err(CodecError::Unsupported(format!(
                "slice width sc = {} (supported: {SLICE_WIDTHS:?})",
                self.sc
            )));
        }
        let k = self.mode.values_per_symbol() as u32;
        if k * payload.code_bits() > 16 {
            return Err(CodecError::Unsupported(format!(
                "{:?} mode packs {k} codes of {} bits, more than a 16-bit table payload",
                self.mode,
                payload.code_bits()
            )));
        }
        if let Some(t) = self.t {
            if t == 0 || t as usize > payload.alphabet() {
                return Err(CodecError::Unsupported(format!(
                    "t = {t} values kept (1..={} for {payload:?})",
                    payload.alphabet()
                )));
            }
        }
        Ok(())
    }

    /// Parses `auto` (None: let the coder choose) or `MODE:LOG2M:SC[:T]`, e.g. `pair:12:512:64`
    /// (mode single|pair|quad, table 2^LOG2M, slice width SC, T values kept). Checks only the
    /// syntax; [`validate`](Self::validate) checks a coding against a payload.
    pub fn parse(s: &str) -> std::result::Result<Option<Coding>, String> {
        if s == "auto" {
            return Ok(None);
        }
        let p: Vec<&str> = s.split(':').collect();
        if !(3..=4).contains(&p.len()) {
            return Err(format!("coding '{s}': expected auto or MODE:LOG2M:SC[:T]"));
        }
        let mode = match p[0] {
            "single" => Mode::Single,
            "pair" => Mode::Pair,
            "quad" => Mode::Quad,
            m => {
                return Err(format!(
                    "coding '{s}': unknown mode '{m}' (single, pair, quad)"
                ))
            }
        };
        let num = |x: &str, what: &str| {
            x.parse::<u32>()
                .map_err(|_| format!("coding '{s}': {what} '{x}' is not a number"))
        };
        let log2_m = num(p[1], "LOG2M")?;
        let t = p.get(3).map(|t| num(t, "T")).transpose()?;
        Ok(Some(Coding {
            mode,
            log2_m: u8::try_from(log2_m)
                .map_err(|_| format!("coding '{s}': LOG2M {log2_m} is too large"))?,
            sc: num(p[2], "SC")?,
            t: t.map(|t| u16::try_from(t).map_err(|_| format!("coding '{s}': T {t} is too large")))
                .transpose()?,
        }))
    }

    /// Bits of a packed symbol (key): k codes.
    pub fn key_bits(&self, payload: Payload) -> u32 {
        self.mode.values_per_symbol() as u32 * payload.code_bits()
    }
}

/// Tile geometry of a coded tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub rows: usize,
    pub cols: usize,
    pub k: usize,
    pub sc: usize,
    pub bands: usize,
    pub slices: usize,
    /// Quartets per lane per tile.
    pub quartets: usize,
    pub companion_bits_per_symbol: u32,
    /// Companion words per lane per tile.
    pub companion_words: usize,
    pub has_raw: bool,
}

impl Geometry {
    /// That a decode-matvec of this matrix can take `x` and write `y`, with `dequant`'s groups.
    pub fn check_matvec(
        &self,
        x: &[f32],
        y: &[f32],
        dequant: &crate::matvec::Dequant,
    ) -> Result<()> {
        if x.len() != self.cols || y.len() != self.rows {
            return Err(CodecError::Shape(format!(
                "matvec of a {}×{} matrix with x of {} and y of {}",
                self.rows,
                self.cols,
                x.len(),
                y.len()
            )));
        }
        dequant.check(self.rows, self.cols)
    }

    pub fn new(payload: Payload, coding: &Coding, rows: usize, cols: usize) -> Result<Self> {
        coding.validate(payload)?;
        if rows == 0 || cols == 0 {
            return Err(CodecError::Shape(format!(
                "cannot code an empty {rows}×{cols} matrix"
            )));
        }
        rows.checked_mul(cols)
            .filter(|&n| n <= 1usize << 40)
            .ok_or_else(|| CodecError::Shape(format!("{rows}×{cols} is too large")))?;
        let k = coding.mode.values_per_symbol();
        let sc = coding.sc as usize;
        let quartets = sc / k / 4;
        let companion_bits_per_symbol = coding.log2_m as u32 - 8;
        let companion_words = (quartets * 4 * companion_bits_per_symbol as usize).div_ceil(32);
        Ok(Geometry {
            rows,
            cols,
            k,
            sc,
            bands: rows.div_ceil(LANES),
            slices: cols.div_ceil(sc),
            quartets,
            companion_bits_per_symbol,
            companion_words,
            has_raw: payload.has_raw(),
        })
    }

    pub fn tiles(&self) -> usize {
        self.bands * self.slices
    }

    /// Tiles are ordered slice-major: consecutive tiles share a column slice (and so the activation
    /// slice a block loads once).
    pub fn tile_origin(&self, tile: usize) -> (usize, usize) {
        let slice = tile / self.bands;
        let band = tile % self.bands;
        (band * LANES, slice * self.sc)
    }

    pub fn companion_len(&self) -> usize {
        self.tiles() * LANES * self.companion_words
    }

    pub fn raw_len(&self) -> usize {
        if self.has_raw {
            self.tiles() * LANES * self.sc
        } else {
            0
        }
    }

    /// Position in a tile's raw block of the byte for (lane, column in slice).
    #[inline(always)]
    pub fn raw_index(lane: usize, col: usize) -> usize {
        ((col / RAW_UNIT) * LANES + lane) * RAW_UNIT + col % RAW_UNIT
    }
}

/// A tensor coded with dtANS-LLM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DtansTensor {
    pub payload: Payload,
    pub coding: Coding,
    pub rows: usize,
    pub cols: usize,
    pub table: SymbolTable,
    /// Two words per tile: the offset of its stream (in words), and the mask of lanes with escapes.
    pub tiles: Vec<u32>,
    pub stream: Vec<u32>,
    pub companion: Vec<u32>,
    pub raw: Vec<u8>,
}

/// Where the bytes of a coded tensor go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct SizeBreakdown {
    /// ANS words read by lanes (prologue included), without chunk headers or padding.
    pub ans_bytes: usize,
    pub chunk_header_bytes: usize,
    pub escape_bytes: usize,
    pub padding_bytes: usize,
    pub companion_bytes: usize,
    pub raw_bytes: usize,
    pub tile_index_bytes: usize,
    pub table_bytes: usize,
    pub escapes: usize,
}

impl SizeBreakdown {
    pub fn total(&self) -> usize {
        self.ans_bytes
            + self.chunk_header_bytes
            + self.escape_bytes
            + self.padding_bytes
            + self.companion_bytes
            + self.raw_bytes
            + self.tile_index_bytes
            + self.table_bytes
    }
}

/// The JSON parameters the container stores beside a dtANS tensor's arrays.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DtansParams {
    pub payload: Payload,
    pub mode: Mode,
    pub log2_m: u8,
    pub sc: u32,
    pub t: Option<u16>,
    pub rows: usize,
    pub cols: usize,
}

impl DtansTensor {
    pub fn geometry(&self) -> Result<Geometry> {
        Geometry::new(self.payload, &self.coding, self.rows, self.cols)
    }

    pub fn params(&self) -> DtansParams {
        DtansParams {
            payload: self.payload,
            mode: self.coding.mode,
            log2_m: self.coding.log2_m,
            sc: self.coding.sc,
            t: self.coding.t,
            rows: self.rows,
            cols: self.cols,
        }
    }

    /// Rebuilds a tensor from stored parts and checks its structure (sizes, table, tile offsets).
    pub fn from_parts(
        p: &DtansParams,
        symbols: Vec<u16>,
        counts: Vec<u8>,
        tiles: Vec<u32>,
        stream: Vec<u32>,
        companion: Vec<u32>,
        raw: Vec<u8>,
    ) -> Result<Self> {
        let t = DtansTensor {
            payload: p.payload,
            coding: Coding {
                mode: p.mode,
                log2_m: p.log2_m,
                sc: p.sc,
                t: p.t,
            },
            rows: p.rows,
            cols: p.cols,
            table: SymbolTable { symbols, counts },
            tiles,
            stream,
            companion,
            raw,
        };
        t.validate()?;
        Ok(t)
    }

    /// Structural checks that make decoding safe to attempt; the decoder checks the rest as it goes.
    pub fn validate(&self) -> Result<()> {
        let g = self.geometry()?;
        self.table
            .validate(self.coding.key_bits(self.payload), self.coding.log2_m)?;
        let expect = |what: &str, got: usize, want: usize| {
            if got == want {
                Ok(())
            } else {
                Err(CodecError::Corrupt(format!(
                    "{what} has {got} elements, expected {want}"
                )))
            }
        };
        expect("tile index", self.tiles.len(), 2 * g.tiles())?;
        expect("companion stream", self.companion.len(), g.companion_len())?;
        expect("raw bytes", self.raw.len(), g.raw_len())?;
        let mut prev = 0usize;
        for t in 0..g.tiles() {
            let off = self.tiles[2 * t] as usize;
            if off < prev
                || !off.is_multiple_of(STREAM_ALIGN)
                || off + PROLOGUE_WORDS + 1 > self.stream.len()
            {
                return Err(CodecError::Corrupt(format!(
                    "tile {t} starts at word {off}, outside the stream or before tile {}",
                    t.saturating_sub(1)
                )));
            }
            prev = off + PROLOGUE_WORDS + 1;
        }
        Ok(())
    }

    /// Bytes stored for this tensor, all arrays included.
    pub fn stored_bytes(&self) -> usize {
        4 * (self.tiles.len() + self.stream.len() + self.companion.len())
            + self.raw.len()
            + 5 * self.table.symbols.len()
    }

    pub fn bits_per_weight(&self) -> f64 {
        self.stored_bytes() as f64 * 8.0 / (self.rows * self.cols) as f64
    }
}

#[cfg(test)]
mod tests;
