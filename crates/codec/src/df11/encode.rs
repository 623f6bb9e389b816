//! The encoder: output identical to `dfloat11_utils.encode` for one tensor, computed in parallel.
//!
//! The reference walks the weights one by one. Here chunks of weights first sum their code lengths,
//! a prefix sum gives each chunk its first bit, and the chunks then write their codes, gaps and
//! block output positions independently; the pieces are joined in order.

use rayon::prelude::*;

use super::code::CodeTable;
use super::lut::build_luts;
use super::{Df11Tensor, BLOCK_BYTES, GAP_BYTES_PER_BLOCK, THREADS_PER_BLOCK};
use crate::histogram::byte_histogram;
use crate::payload::Payload;
use crate::{CodecError, Result};

/// Weights per parallel work item.
const CHUNK: usize = 1 << 16;
/// log2 of the bits in a thread window (8 bytes).
const WINDOW_SHIFT: u32 = 6;
/// log2 of thread windows per block.
const WINDOWS_PER_BLOCK_SHIFT: u32 = THREADS_PER_BLOCK.trailing_zeros();

/// What one chunk of weights contributes.
struct ChunkCode {
    /// Code bits `[first_bit, end)` laid into bytes from byte `first_bit / 8`, MSB first.
    bytes: Vec<u8>,
    /// Gaps of the thread windows whose first code starts in this chunk, in order.
    gaps: Vec<u8>,
    /// Output positions of the blocks whose first code starts in this chunk, in order.
    output_positions: Vec<u32>,
}

pub(super) fn encode(bf16: &[u16]) -> Result<Df11Tensor> {
    let n = bf16.len();
    if n > u32::MAX as usize {
        return Err(CodecError::Shape(format!(
            "{n} elements do not fit DFloat11's 32-bit output positions"
        )));
    }
    if n == 0 {
        // DFloat11 cannot code an empty tensor (dahuffman needs a symbol); ours has one empty row.
        return Ok(Df11Tensor {
            luts: vec![0; 2 * 256],
            encoded_exponent: Vec::new(),
            sign_mantissa: Vec::new(),
            output_positions: vec![0],
            gaps: Vec::new(),
            n_elements: 0,
        });
    }
    let mut exponents = vec![0u8; n];
    let mut sign_mantissa = vec![0u8; n];
    exponents
        .par_chunks_mut(CHUNK)
        .zip(sign_mantissa.par_chunks_mut(CHUNK))
        .zip(bf16.par_chunks(CHUNK))
        .for_each(|((e, s), w)| {
            for ((e, s), &w) in e.iter_mut().zip(s.iter_mut()).zip(w) {
                (*e, *s) = Payload::Bf16.split16(w);
            }
        });

    let table = CodeTable::from_histogram(&byte_histogram(&exponents))?;
    let luts = build_luts(&table)?;
    let (lens, values) = table.exponent_codes();

    let chunk_bits: Vec<u64> = exponents
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&e| lens[e as usize] as u64).sum())
        .collect();
    let mut first_bits = Vec::with_capacity(chunk_bits.len());
    let mut total_bits = 0u64;
    for &b in &chunk_bits {
        first_bits.push(total_bits);
        total_bits += b;
    }
    let n_bytes = total_bits.div_ceil(8) as usize;
    if n_bytes > i32::MAX as usize {
        return Err(CodecError::Shape(format!(
            "{n} weights code to {n_bytes} bytes, beyond DFloat11's 31-bit byte offsets"
        )));
    }

    let chunks: Vec<ChunkCode> = exponents
        .par_chunks(CHUNK)
        .zip(first_bits.par_iter().zip(chunk_bits.par_iter()))
        .enumerate()
        .map(|(i, (chunk, (&first_bit, &bits)))| {
            // The window of the previous weight's code start decides whether ours opens a window.
            let previous_window = (i > 0).then(|| {
                let last = exponents[i * CHUNK - 1];
                (first_bit - lens[last as usize] as u64) >> WINDOW_SHIFT
            });
            let capacity = (first_bit % 8 + bits).div_ceil(8) as usize + 4;
            encode_chunk(
                chunk,
                i * CHUNK,
                first_bit,
                previous_window,
                &lens,
                &values,
                capacity,
            )
        })
        .collect();

    let mut encoded = vec![0u8; n_bytes];
    let mut gaps = Vec::with_capacity(n_bytes.div_ceil(8) + 1);
    let mut output_positions = Vec::with_capacity(n_bytes.div_ceil(BLOCK_BYTES) + 1);
    for (c, &first_bit) in chunks.iter().zip(&first_bits) {
        let at = (first_bit / 8) as usize;
        // The first byte may hold the previous chunk's last bits.
        encoded[at] |= c.bytes[0];
        encoded[at + 1..at + c.bytes.len()].copy_from_slice(&c.bytes[1..]);
        gaps.extend_from_slice(&c.gaps);
        output_positions.extend_from_slice(&c.output_positions);
    }

    // The reference pads a partial last byte with the EOF code, and counts the EOF as a code start.
    let tail_bits = (total_bits % 8) as u32;
    if tail_bits != 0 {
        if (total_bits >> WINDOW_SHIFT) as usize >= gaps.len() {
            gaps.push((total_bits % 64) as u8);
        }
        if (total_bits >> (WINDOW_SHIFT + WINDOWS_PER_BLOCK_SHIFT)) as usize
            >= output_positions.len()
        {
            output_positions.push(n as u32);
        }
        let eof = table.eof();
        let room = 8 - tail_bits;
        let pad = if eof.bits >= room {
            eof.value >> (eof.bits - room)
        } else {
            eof.value << (room - eof.bits)
        };
        encoded[n_bytes - 1] |= pad as u8;
    }
    output_positions.push(n as u32);

    let blocks = n_bytes.div_ceil(BLOCK_BYTES);
    gaps.resize(blocks * THREADS_PER_BLOCK, 0);
    Ok(Df11Tensor {
        luts,
        encoded_exponent: encoded,
        sign_mantissa,
        output_positions,
        gaps: pack_gaps(&gaps, blocks),
        n_elements: n,
    })
}

/// Codes of `exponents` (weights `first_index..`) starting at stream bit `first_bit`.
fn encode_chunk(
    exponents: &[u8],
    first_index: usize,
    first_bit: u64,
    previous_window: Option<u64>,
    lens: &[u8; 256],
    values: &[u32; 256],
    capacity: usize,
) -> ChunkCode {
    let mut bytes = Vec::with_capacity(capacity);
    let mut gaps = Vec::with_capacity(exponents.len() / 2 + 1);
    let mut output_positions = Vec::new();
    // Sentinel u64::MAX: no previous code, so the first one opens window and block 0.
    let mut window = previous_window.unwrap_or(u64::MAX);
    let mut bit = first_bit;
    // Pending bits are the low `pending` bits of `acc`; the stream is MSB first.
    let mut acc = 0u64;
    let mut pending = (first_bit % 8) as u32;
    for (k, &e) in exponents.iter().enumerate() {
        let w = bit >> WINDOW_SHIFT;
        if w != window {
            gaps.push((bit % 64) as u8);
            if window == u64::MAX
                || (w >> WINDOWS_PER_BLOCK_SHIFT) != (window >> WINDOWS_PER_BLOCK_SHIFT)
            {
                output_positions.push((first_index + k) as u32);
            }
            window = w;
        }
        let len = lens[e as usize] as u32;
        acc = (acc << len) | values[e as usize] as u64;
        pending += len;
        bit += len as u64;
        if pending >= 32 {
            pending -= 32;
            bytes.extend_from_slice(&((acc >> pending) as u32).to_be_bytes());
        }
    }
    if pending > 0 {
        let rest = (acc << (64 - pending)).to_be_bytes();
        bytes.extend_from_slice(&rest[..pending.div_ceil(8) as usize]);
    }
    ChunkCode {
        bytes,
        gaps,
        output_positions,
    }
}

/// 5-bit fields packed MSB first, as `np.packbits` packs the reference's bit list.
fn pack_gaps(gaps: &[u8], blocks: usize) -> Vec<u8> {
    let mut packed = Vec::with_capacity(blocks * GAP_BYTES_PER_BLOCK);
    let mut acc = 0u64;
    let mut pending = 0u32;
    for &g in gaps {
        acc = (acc << 5) | g as u64;
        pending += 5;
        if pending >= 8 {
            pending -= 8;
            packed.push((acc >> pending) as u8);
        }
    }
    if pending > 0 {
        packed.push((acc << (8 - pending)) as u8);
    }
    packed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_pack_msb_first_like_packbits() {
        // 5-bit fields 1, 31, 0, 17, then zeros: 00001 11111 00000 10001 ...
        let packed = pack_gaps(&[1, 31, 0, 17, 0, 0, 0, 0], 0);
        assert_eq!(packed, vec![0b0000_1111, 0b1100_0001, 0b0001_0000, 0, 0]);
    }

    /// `dfloat11_utils.encode` ported line by line (one weight at a time, bit list for the gaps).
    fn reference_encode(exps: &[u8], table: &CodeTable) -> (Vec<u8>, Vec<u8>, Vec<u32>) {
        let (lens, values) = table.exponent_codes();
        let (window_bits, block_bits) = (64u64, 64 * THREADS_PER_BLOCK as u64);
        let (mut encoded, mut gaps, mut positions) = (Vec::new(), Vec::new(), Vec::new());
        let (mut buffer, mut size, mut total, mut count) = (0u64, 0u64, 0u64, 0u32);
        let starts = |total: u64, count: u32, gaps: &mut Vec<u64>, positions: &mut Vec<u32>| {
            if total / window_bits + 1 > gaps.len() as u64 {
                gaps.push(total - total / window_bits * window_bits);
            }
            if total / block_bits + 1 > positions.len() as u64 {
                positions.push(count);
            }
        };
        for &e in exps {
            starts(total, count, &mut gaps, &mut positions);
            let (b, v) = (lens[e as usize] as u64, values[e as usize] as u64);
            buffer = (buffer << b) + v;
            size += b;
            total += b;
            count += 1;
            while size >= 8 {
                let byte = buffer >> (size - 8);
                encoded.push(byte as u8);
                buffer -= byte << (size - 8);
                size -= 8;
            }
        }
        if size > 0 {
            starts(total, count, &mut gaps, &mut positions);
            let eof = table.eof();
            buffer = (buffer << eof.bits) + eof.value as u64;
            size += eof.bits as u64;
            let byte = if size >= 8 {
                buffer >> (size - 8)
            } else {
                buffer << (8 - size)
            };
            encoded.push(byte as u8);
        }
        positions.push(exps.len() as u32);
        let blocks = encoded.len().div_ceil(BLOCK_BYTES);
        gaps.resize(blocks * THREADS_PER_BLOCK, 0);
        let bits: Vec<u8> = gaps
            .iter()
            .flat_map(|&g| (0..5).rev().map(move |i| (g >> i) as u8 & 1))
            .collect();
        let packed = bits
            .chunks(8)
            .map(|c| {
                c.iter()
                    .enumerate()
                    .fold(0u8, |a, (i, &b)| a | b << (7 - i))
            })
            .collect();
        (encoded, packed, positions)
    }

    #[test]
    fn parallel_chunks_equal_the_one_at_a_time_reference() {
        // Sizes around the chunk size, with exponents spread over codes of 1 to ~20 bits.
        for n in [1, 2, 9, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 77] {
            let w: Vec<u16> = (0..n as u32)
                .map(|i| {
                    let h = i.wrapping_mul(2_654_435_761) ^ (i >> 7);
                    let e = 110 + h.trailing_zeros().min(20);
                    ((h & 0x807F) | (e << 7)) as u16
                })
                .collect();
            let t = encode(&w).unwrap();
            let exps: Vec<u8> = w.iter().map(|&x| Payload::Bf16.split16(x).0).collect();
            let table = CodeTable::from_histogram(&byte_histogram(&exps)).unwrap();
            let (encoded, gaps, positions) = reference_encode(&exps, &table);
            assert_eq!(t.encoded_exponent, encoded, "n = {n}");
            assert_eq!(t.gaps, gaps, "n = {n}");
            assert_eq!(t.output_positions, positions, "n = {n}");
            assert_eq!(t.luts, build_luts(&table).unwrap());
        }
    }

    /// The size predicted from the exponent histogram is the coded size, or 4 bytes over it (a
    /// last block without a code start), on tensors of every length around the block sizes and
    /// exponent spreads from one value to codes of ~20 bits.
    #[test]
    fn predicted_bytes_are_the_coded_bytes() {
        let mut r = crate::rng::SplitMix64::new(1);
        let mut next = || r.next_u64() as u32;
        for n in [
            0,
            1,
            2,
            7,
            4095,
            4096,
            4097,
            CHUNK + 3,
            40_000,
            2 * CHUNK + 1,
        ] {
            for spread in [0u32, 1, 3, 20] {
                let w: Vec<u16> = (0..n)
                    .map(|_| {
                        let h = next();
                        let e = 120 + (h >> 8).trailing_zeros().min(spread);
                        ((h & 0x807F) | (e << 7)) as u16
                    })
                    .collect();
                let exps: Vec<u8> = w.iter().map(|&x| Payload::Bf16.split16(x).0).collect();
                let coded = encode(&w).unwrap().stored_bytes();
                let predicted = Df11Tensor::predict_bytes(&byte_histogram(&exps), n).unwrap();
                assert!(
                    predicted == coded || predicted == coded + 4,
                    "n = {n}, spread {spread}: predicted {predicted}, coded {coded}"
                );
            }
        }
        let mut hist = [0u64; 256];
        hist[250] = 3;
        assert!(Df11Tensor::predict_bytes(&hist, 3).is_err());
    }
}
