//! DFloat11-layout Huffman coder: bit-compatible with DFloat11 0.5.0 (`dfloat11_utils` + its
//! `decode` CUDA kernel), so tensors move between DFloat11 checkpoints and ours unchanged.
//!
//! # Layout of one coded BF16 tensor of `n` weights
//!
//! A weight `w` splits into its 8-bit exponent `(w >> 7) & 0xFF`, which is Huffman coded, and its
//! sign + mantissa byte `((w >> 8) & 0x80) | (w & 0x7F)`, stored raw. The Huffman code is
//! dahuffman's tree over the exponent histogram plus an end-of-file symbol (frequency 1), limited to
//! 32-bit codes ([`CodeTable`]). Let `T` be the total code bits, `B = ceil(T / 8)` and
//! `G = ceil(B / 4096)` the number of decode blocks (512 threads × 8 bytes each).
//!
//! | array | element | length | content |
//! |---|---|---|---|
//! | `luts` | u8 | `(R + 1) · 256` | `R ≤ 17` decode rows, one per 8-bit-aligned code prefix (row 0: the empty prefix): an entry is an exponent, or `256 − r` (240..=255) meaning "continue in row `r` with the next byte"; the last row maps exponent → code length |
//! | `encoded_exponent` | u8 | `B` | the codes in weight order, MSB first; when `T % 8 ≠ 0` the last byte is filled with the leading bits of the EOF code |
//! | `sign_mantissa` | u8 | `n` | raw bytes in weight order |
//! | `output_positions` | u32 | `G + 1` | entry `b`: index of the first weight whose code starts in block `b` (bits `[32768·b, 32768·(b+1))`); last entry `n`. DFloat11 writes only `G` entries when no code starts in the last block; both forms are accepted |
//! | `gaps` | u8 | `320 · G` | `512 · G` 5-bit fields packed MSB first (numpy `packbits`): field `g` is the bit offset of the first code starting in thread `g`'s 8-byte window; 0 past the last window holding a code start |
//!
//! Decoding (the kernel, [`Df11Tensor::decode_into`]): thread `g` starts at bit `gaps[g]` of bytes
//! `8g..8g+8` and decodes every code that starts inside those 64 bits (reading up to 4 more bytes),
//! one LUT byte per level, advancing by the code-length row. Phase 1 counts them; phase 2 turns the
//! counts into positions by a prefix sum within the block starting at `output_positions[block]`,
//! and the thread writes `sign_mantissa`-joined BF16 values there, clamped to `n` (codes decoded
//! past the real end, such as EOF and zero padding, fall beyond `n`; the CPU decoder stops there).
//!
//! Two DFloat11 behaviours to know: `get_luts` fails (`UnboundLocalError`) when the EOF code is
//! all zeros, common on small tensors, where [`build_luts`] still builds a table; and when the
//! stream's last window holds no code start, the padding thread of that window starts inside the
//! last code, and for rare codes the kernel then spins forever on a zero-length LUT path (see the
//! decoder); the CPU decoder stops at `n` instead, which changes no output.

mod code;
mod decode;
mod encode;
mod lut;

pub use code::{CodeEntry, CodeTable, Symbol, FIRST_POINTER, MAX_CODE_BITS};
pub use lut::{build_luts, lut_lookup, MAX_PREFIX_ROWS};

use crate::{CodecError, Result};

/// Bytes of coded exponents per decoding thread (DFloat11's `bytes_per_thread`).
pub const BYTES_PER_THREAD: usize = 8;
/// Threads per decoding block (DFloat11's `threads_per_block`).
pub const THREADS_PER_BLOCK: usize = 512;
/// Coded bytes per decoding block.
pub const BLOCK_BYTES: usize = BYTES_PER_THREAD * THREADS_PER_BLOCK;
/// Bytes of packed 5-bit gaps per block.
pub const GAP_BYTES_PER_BLOCK: usize = THREADS_PER_BLOCK * 5 / 8;

/// One BF16 tensor in DFloat11's layout (see the module documentation for the arrays).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Df11Tensor {
    pub luts: Vec<u8>,
    pub encoded_exponent: Vec<u8>,
    pub sign_mantissa: Vec<u8>,
    pub output_positions: Vec<u32>,
    pub gaps: Vec<u8>,
    pub n_elements: usize,
}

impl Df11Tensor {
    /// Code BF16 weights (given as bit patterns) exactly as DFloat11 0.5.0's `get_codec`,
    /// `get_32bit_codec`, `get_luts` and `encode_weights` code a single tensor. Exponents 240..=255
    /// (|w| ≥ 2^113, inf, NaN) are refused, as DFloat11 uses them as LUT pointers.
    pub fn encode(bf16: &[u16]) -> Result<Df11Tensor> {
        encode::encode(bf16)
    }

    /// Stored bytes of `n` weights whose exponents have histogram `exponents`, without coding
    /// them: the code lengths give the coded bits, and every other array follows from those
    /// (exact but for one output position: a last block that no code starts in has none, so
    /// this may be 4 bytes over). Refused as [`Df11Tensor::encode`] refuses.
    pub fn predict_bytes(exponents: &[u64; 256], n: usize) -> Result<usize> {
        if n == 0 {
            return Ok(Df11Tensor::encode(&[])?.stored_bytes());
        }
        let table = CodeTable::from_histogram(exponents)?;
        let luts = build_luts(&table)?.len();
        let (lens, _) = table.exponent_codes();
        let bits: u64 = exponents.iter().zip(lens).map(|(&c, l)| c * l as u64).sum();
        let bytes = bits.div_ceil(8) as usize;
        let blocks = bytes.div_ceil(BLOCK_BYTES);
        Ok(luts + bytes + n + 4 * (blocks + 1) + GAP_BYTES_PER_BLOCK * blocks)
    }

    /// Decode all weights.
    pub fn decode(&self) -> Result<Vec<u16>> {
        let mut out = vec![0u16; self.n_elements];
        self.decode_into(&mut out)?;
        Ok(out)
    }

    /// Decode all weights into `out` (`n_elements` long) the way DFloat11's kernel does, blocks in
    /// parallel. Corrupt input gives [`CodecError::Corrupt`]; damage that leaves a consistent
    /// stream decodes to wrong values without writing outside `out`.
    pub fn decode_into(&self, out: &mut [u16]) -> Result<()> {
        decode::decode_into(self, out)
    }

    /// `y = W·x` for `W` = this tensor as a row-major `[rows, cols]` matrix, decoding block by block
    /// (the matrix is never materialised). Products are summed in f32 in weight order within a
    /// block; the per-block partial sums of a row are then added in block order.
    pub fn matvec(&self, rows: usize, cols: usize, x: &[f32], y: &mut [f32]) -> Result<()> {
        decode::matvec(self, rows, cols, x, y)
    }

    /// Bytes of all arrays.
    pub fn stored_bytes(&self) -> usize {
        self.luts.len()
            + self.encoded_exponent.len()
            + self.sign_mantissa.len()
            + 4 * self.output_positions.len()
            + self.gaps.len()
    }

    /// Stored bits per weight (infinite for an empty tensor, which still stores its LUT).
    pub fn bits_per_weight(&self) -> f64 {
        self.stored_bytes() as f64 * 8.0 / self.n_elements as f64
    }

    /// Number of decode blocks.
    pub fn blocks(&self) -> usize {
        self.encoded_exponent.len().div_ceil(BLOCK_BYTES)
    }

    /// Cheap structural checks: array sizes consistent with each other, output positions ordered,
    /// LUT pointers inside the table, code lengths in 1..=32 wherever a LUT entry leads.
    pub fn validate(&self) -> Result<()> {
        let n = self.n_elements;
        let corrupt = |m: String| Err(CodecError::Corrupt(m));
        if n > u32::MAX as usize {
            return Err(CodecError::Shape(format!(
                "{n} elements do not fit DFloat11's 32-bit output positions"
            )));
        }
        if self.sign_mantissa.len() != n {
            return corrupt(format!(
                "sign_mantissa has {} bytes for {n} elements",
                self.sign_mantissa.len()
            ));
        }
        let n_bytes = self.encoded_exponent.len();
        if n_bytes > i32::MAX as usize {
            return corrupt(format!(
                "encoded_exponent has {n_bytes} bytes, beyond the kernel's 31-bit byte offsets"
            ));
        }
        if (n == 0) != (n_bytes == 0) {
            return corrupt(format!("{n} elements but {n_bytes} encoded_exponent bytes"));
        }
        let blocks = self.blocks();
        if self.gaps.len() != blocks * GAP_BYTES_PER_BLOCK {
            return corrupt(format!(
                "gaps has {} bytes; {blocks} blocks need {}",
                self.gaps.len(),
                blocks * GAP_BYTES_PER_BLOCK
            ));
        }
        let op = &self.output_positions;
        let op_len_ok = op.len() == blocks + 1 || (blocks > 0 && op.len() == blocks);
        if !op_len_ok {
            return corrupt(format!(
                "output_positions has {} entries for {blocks} blocks (need {} or {})",
                op.len(),
                blocks,
                blocks + 1
            ));
        }
        if op[0] != 0 {
            return corrupt(format!("output position of block 0 is {}, not 0", op[0]));
        }
        for (b, w) in op.windows(2).enumerate() {
            if w[1] < w[0] {
                return corrupt(format!(
                    "output position of block {} decreases ({} after {})",
                    b + 1,
                    w[1],
                    w[0]
                ));
            }
        }
        let last = op[op.len() - 1] as usize;
        if last > n || (op.len() == blocks + 1 && last != n) {
            return corrupt(format!(
                "last output position is {last}, element count is {n}"
            ));
        }
        self.validate_luts()
    }

    fn validate_luts(&self) -> Result<()> {
        let corrupt = |m: String| Err(CodecError::Corrupt(m));
        if !self.luts.len().is_multiple_of(256) || self.luts.len() < 2 * 256 {
            return corrupt(format!(
                "luts has {} bytes, not a whole number (>= 2) of 256-byte rows",
                self.luts.len()
            ));
        }
        let rows = self.luts.len() / 256 - 1;
        if rows > MAX_PREFIX_ROWS {
            return corrupt(format!(
                "luts has {rows} decode rows; pointers address at most {MAX_PREFIX_ROWS}"
            ));
        }
        let lens = &self.luts[rows * 256..];
        if let Some((e, &l)) = lens
            .iter()
            .enumerate()
            .find(|&(_, &l)| l as u32 > MAX_CODE_BITS)
        {
            return corrupt(format!("code length of exponent {e} is {l} bits (max 32)"));
        }
        if let Some(e) = (FIRST_POINTER as usize..256).find(|&e| lens[e] != 0) {
            return corrupt(format!(
                "reserved exponent {e} has a code length; values >= {FIRST_POINTER} are pointers"
            ));
        }
        if self.encoded_exponent.is_empty() {
            return Ok(()); // nothing is ever looked up
        }
        for (i, &v) in self.luts[..rows * 256].iter().enumerate() {
            let (row, col) = (i / 256, i % 256);
            if v >= FIRST_POINTER {
                let target = 256 - v as usize;
                if target >= rows {
                    return corrupt(format!(
                        "LUT row {row} entry {col} points to row {target}; there are {rows} rows"
                    ));
                }
            } else if lens[v as usize] == 0 {
                return corrupt(format!(
                    "LUT row {row} entry {col} decodes exponent {v}, which has no code length"
                ));
            }
        }
        Ok(())
    }
}
