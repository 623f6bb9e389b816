//! The CPU decoder: the steps of DFloat11 0.5.0's `decode` kernel (read from its PTX), one rayon
//! task per thread block, with every read checked.
//!
//! Kernel semantics kept here: thread `g` loads bytes `8g..8g+12` (zero past the stream), shifts
//! its 64-bit window left by its gap, decodes while the bit position is below 32, then merges the
//! next 4 bytes in and decodes while it is below 64; a code's value is found by [`lut_lookup`]
//! and its length by the last LUT row. Phase 2's positions are the exclusive prefix sum of
//! the counts from `output_positions[block]`, writes are clamped to `n`, and a block's output is
//! the range up to the next block's output position.
//!
//! One deliberate difference: threads stop at element `n`. The kernel goes on decoding the EOF
//! code and the zero padding after it and discards the result (its writes are clamped to `n`).
//! For rare codes, a padding thread that starts inside the last code decodes a zero-length LUT
//! path there and the kernel spins forever; stopping changes no output and avoids that.

use rayon::prelude::*;

use super::lut::lut_lookup;
use super::{Df11Tensor, BYTES_PER_THREAD, THREADS_PER_BLOCK};
use crate::payload::Payload;
use crate::{CodecError, Result};

/// Most codes one thread can decode (64 window bits, codes of at least 1 bit).
const MAX_CODES_PER_THREAD: usize = 64;

/// Borrowed arrays of a validated tensor.
struct Stream<'a> {
    /// Decode rows (all LUT rows but the last).
    rows: &'a [u8],
    /// Code length of each exponent (the last LUT row).
    lens: &'a [u8],
    bytes: &'a [u8],
    gaps: &'a [u8],
    sign_mantissa: &'a [u8],
    n: usize,
}

/// Decoding state of one thread.
struct Thread {
    g: usize,
    /// Not yet consumed bits, left-aligned.
    reg: u64,
    /// Bits consumed from the start of the thread's window.
    pos: u32,
    /// Stream bits from the start of the thread's window (negative past the end).
    bits_left: i64,
    /// Output position of the thread's next code.
    position: usize,
}

impl<'a> Stream<'a> {
    fn new(t: &'a Df11Tensor) -> Stream<'a> {
        let split = t.luts.len() - 256;
        Stream {
            rows: &t.luts[..split],
            lens: &t.luts[split..],
            bytes: &t.encoded_exponent,
            gaps: &t.gaps,
            sign_mantissa: &t.sign_mantissa,
            n: t.n_elements,
        }
    }

    /// Output range of every block: from its output position to the next block's (or `n`).
    fn block_ranges(t: &Df11Tensor) -> Vec<(usize, usize)> {
        let blocks = t.blocks();
        (0..blocks)
            .map(|b| {
                let start = t.output_positions[b] as usize;
                let end = if b + 1 < blocks {
                    t.output_positions[b + 1] as usize
                } else {
                    t.n_elements
                };
                (start, end)
            })
            .collect()
    }

    /// The thread's 8-byte window and the 4 bytes after it, big-endian, zero past the stream.
    fn window(&self, g: usize) -> (u64, u32) {
        let mut b = [0u8; 12];
        let from = (g * BYTES_PER_THREAD).min(self.bytes.len());
        let to = (from + 12).min(self.bytes.len());
        b[..to - from].copy_from_slice(&self.bytes[from..to]);
        let (w, x) = b.split_at(8);
        (
            u64::from_be_bytes(w.try_into().unwrap_or([0; 8])),
            u32::from_be_bytes(x.try_into().unwrap_or([0; 4])),
        )
    }

    /// 5-bit field `g` of the packed gaps (validated to cover every thread).
    fn gap(&self, g: usize) -> u32 {
        let bit = g * 5;
        let hi = self.gaps[bit / 8] as u32;
        // The kernel always loads the next byte too; it only matters when the field spans it.
        let lo = self.gaps.get(bit / 8 + 1).copied().unwrap_or(0) as u32;
        (((hi << 8) | lo) >> (11 - bit % 8)) & 31
    }

    /// Decode the code at `t.reg` into `exps`.
    fn next_code(&self, t: &mut Thread, exps: &mut Vec<u8>) -> Result<()> {
        let v = lut_lookup(self.rows, t.reg).ok_or_else(|| {
            CodecError::Corrupt(format!("thread {}: a LUT pointer leaves the table", t.g))
        })?;
        let len = self.lens[v as usize] as u32; // validated: <= 32
        if len == 0 {
            return Err(CodecError::Corrupt(format!(
                "thread {} decodes a code with no length (LUT value {v}) at bit {} of its window",
                t.g, t.pos
            )));
        }
        if (t.pos + len) as i64 > t.bits_left {
            return Err(CodecError::Corrupt(format!(
                "thread {} decodes element {} past the end of the exponent stream",
                t.g, t.position
            )));
        }
        exps.push(v);
        t.reg <<= len;
        t.pos += len;
        t.position += 1;
        Ok(())
    }

    /// Phase 1 of thread `g`, whose first code goes to output `position`: decode the codes that
    /// start in its window, up to element `n`, appending the exponents.
    fn decode_thread(&self, g: usize, position: usize, exps: &mut Vec<u8>) -> Result<()> {
        let (window, next4) = self.window(g);
        let gap = self.gap(g);
        let mut t = Thread {
            g,
            reg: window << gap,
            pos: gap,
            bits_left: self.bytes.len() as i64 * 8 - (g * BYTES_PER_THREAD * 8) as i64,
            position,
        };
        loop {
            if t.position >= self.n {
                return Ok(());
            }
            self.next_code(&mut t, exps)?;
            if t.pos >= 32 {
                break;
            }
        }
        // pos < 64 here (a code starting below 32 is at most 32 bits): bits 64..96 go right after.
        t.reg |= (next4 as u64) << (t.pos - 32);
        while t.pos < 64 && t.position < self.n {
            self.next_code(&mut t, exps)?;
        }
        Ok(())
    }

    /// Decode block `b`, whose output range starts at `start`, into `dst` (its whole range).
    fn decode_block(
        &self,
        b: usize,
        start: usize,
        dst: &mut [u16],
        exps: &mut Vec<u8>,
    ) -> Result<()> {
        exps.clear();
        // Phase 1 appends each thread's codes in thread order, so `exps` is in output order and
        // phase 2's prefix sum of the counts is `start + exps.len()`.
        for t in 0..THREADS_PER_BLOCK {
            self.decode_thread(b * THREADS_PER_BLOCK + t, start + exps.len(), exps)?;
        }
        let decoded = exps.len();
        let expected = dst.len();
        if decoded != expected {
            return Err(CodecError::Corrupt(format!(
                "block {b} decodes {decoded} elements, but its output positions span {expected}"
            )));
        }
        let sign_mantissa = &self.sign_mantissa[start..start + expected];
        for ((d, &e), &s) in dst.iter_mut().zip(exps.iter()).zip(sign_mantissa) {
            *d = Payload::Bf16.join16(e, s);
        }
        Ok(())
    }
}

fn new_scratch() -> Vec<u8> {
    Vec::with_capacity(THREADS_PER_BLOCK * MAX_CODES_PER_THREAD)
}

pub(super) fn decode_into(t: &Df11Tensor, out: &mut [u16]) -> Result<()> {
    if out.len() != t.n_elements {
        return Err(CodecError::Shape(format!(
            "output has {} elements, the tensor {}",
            out.len(),
            t.n_elements
        )));
    }
    t.validate()?;
    let stream = Stream::new(t);
    let ranges = Stream::block_ranges(t);
    // Validated output positions are ordered from 0 to n, so the ranges tile `out`.
    let mut parts = Vec::with_capacity(ranges.len());
    let mut rest = out;
    for &(start, end) in &ranges {
        let (part, tail) = std::mem::take(&mut rest).split_at_mut(end - start);
        parts.push((start, part));
        rest = tail;
    }
    parts
        .into_par_iter()
        .enumerate()
        .try_for_each_init(new_scratch, |exps, (b, (start, dst))| {
            stream.decode_block(b, start, dst, exps)
        })
}

pub(super) fn matvec(
    t: &Df11Tensor,
    rows: usize,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
) -> Result<()> {
    if rows.checked_mul(cols) != Some(t.n_elements) {
        return Err(CodecError::Shape(format!(
            "a {rows}x{cols} matrix does not have the tensor's {} elements",
            t.n_elements
        )));
    }
    if x.len() != cols || y.len() != rows {
        return Err(CodecError::Shape(format!(
            "matvec of a {rows}x{cols} matrix got x of {} and y of {} elements",
            x.len(),
            y.len()
        )));
    }
    t.validate()?;
    let stream = Stream::new(t);
    let ranges = Stream::block_ranges(t);
    // Per block: the first row it touches and its partial sums of the rows it touches.
    let partials: Vec<(usize, Vec<f32>)> = ranges
        .par_iter()
        .enumerate()
        .map_init(
            || (new_scratch(), Vec::new()),
            |(exps, w), (b, &(start, end))| {
                w.clear();
                w.resize(end - start, 0u16);
                stream.decode_block(b, start, w, exps)?;
                if start == end {
                    return Ok((0, Vec::new()));
                }
                let first_row = start / cols;
                let mut sums = vec![0f32; (end - 1) / cols - first_row + 1];
                let (mut r, mut c) = (0, start % cols);
                for &v in w.iter() {
                    sums[r] += half::bf16::from_bits(v).to_f32() * x[c];
                    c += 1;
                    if c == cols {
                        c = 0;
                        r += 1;
                    }
                }
                Ok((first_row, sums))
            },
        )
        .collect::<Result<_>>()?;
    y.fill(0.0);
    for (first_row, sums) in partials {
        for (yr, s) in y[first_row..].iter_mut().zip(sums) {
            *yr += s;
        }
    }
    Ok(())
}
