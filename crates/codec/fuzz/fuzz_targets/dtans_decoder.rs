//! Fuzzes the dtANS-LLM decoder: a valid tensor (payload, mode, table size, slice width and shape
//! picked by the input) is encoded, then damaged by the rest of the input (bit flips, truncations,
//! edits of the table and tile index), and decoded. Decoding must return Ok or an error, never panic.
//!
//! Run: RUSTC_BOOTSTRAP=1 cargo fuzz run --fuzz-dir crates/codec/fuzz dtans_decoder -- -max_total_time=600
#![no_main]

use entrollm_codec::dtans::{Coding, DtansTensor, Mode, SLICE_WIDTHS, TABLE_LOG2};
use entrollm_codec::matvec::Dequant;
use entrollm_codec::Payload;
use libfuzzer_sys::fuzz_target;

const PAYLOADS: [Payload; 6] =
    [Payload::Bf16, Payload::Fp16, Payload::Fp8E4m3, Payload::Fp4E2m1, Payload::Int(2), Payload::Int(8)];

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let payload = PAYLOADS[data[0] as usize % PAYLOADS.len()];
    let mode = [Mode::Single, Mode::Pair, Mode::Quad][data[1] as usize % 3];
    if mode.values_per_symbol() as u32 * payload.code_bits() > 16 {
        return;
    }
    let log2_m = TABLE_LOG2[data[2] as usize % 4];
    let sc = SLICE_WIDTHS[data[3] as usize % 3];
    let rows = 1 + data[4] as usize % 70;
    let cols = 1 + (data[5] as usize * 7) % 300;
    let t = match data[6] % 4 {
        0 => None,
        n => Some((n as u16 * 3).min(payload.alphabet() as u16)),
    };
    let seed = data[7] as u64;
    // Skewed codes so the table has structure.
    let mut r = entrollm_codec::rng::SplitMix64::new(seed);
    let mut next = || (r.next_u64() >> 33) as u32;
    let n = rows * cols;
    let a = payload.alphabet() as u32;
    let codes: Vec<u8> = (0..n).map(|_| ((next() % 7) * (next() % 5) % a) as u8).collect();
    let raw: Vec<u8> = if payload.has_raw() { (0..n).map(|_| next() as u8).collect() } else { Vec::new() };
    let Ok(mut t) = DtansTensor::encode(payload, rows, cols, &codes, &raw, Coding { mode, log2_m, sc, t }) else {
        return;
    };
    for edit in data[8..].chunks(6) {
        if edit.len() < 6 {
            break;
        }
        let at = u32::from_le_bytes([edit[1], edit[2], edit[3], edit[4]]) as usize;
        let v = edit[5];
        match edit[0] % 7 {
            0 if !t.stream.is_empty() => {
                let i = at % t.stream.len();
                t.stream[i] ^= 1 << (v % 32);
            }
            1 if !t.tiles.is_empty() => {
                let i = at % t.tiles.len();
                t.tiles[i] = t.tiles[i].wrapping_add(v as u32);
            }
            2 => t.stream.truncate(at % (t.stream.len() + 1)),
            3 if !t.table.counts.is_empty() => {
                let i = at % t.table.counts.len();
                t.table.counts[i] = v;
            }
            4 if !t.companion.is_empty() => {
                let i = at % t.companion.len();
                t.companion[i] ^= 1 << (v % 32);
            }
            5 if !t.table.symbols.is_empty() => {
                let i = at % t.table.symbols.len();
                t.table.symbols[i] ^= 1 << (v % 16);
            }
            6 => t.raw.truncate(at % (t.raw.len() + 1)),
            _ => {}
        }
    }
    let _ = t.decode();
    let _ = t.size_breakdown();
    let x = vec![1.0f32; cols];
    let mut y = vec![0.0f32; rows];
    let _ = t.matvec(&x, &mut y, &Dequant::None);
});
