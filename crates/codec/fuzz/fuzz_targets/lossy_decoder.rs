//! Fuzzes the lossy (E8 / TCQ, tiled rANS) stored form: a valid tensor made from the input's first
//! bytes is damaged by the rest (bit flips, byte writes, truncations, appended bytes) and read and
//! decoded. Never a panic, an abort or a hang.
//!
//! Run: RUSTC_BOOTSTRAP=1 cargo fuzz run --fuzz-dir crates/codec/fuzz lossy_decoder -- -max_total_time=600
#![no_main]

use entrollm_codec::lossy::{LossyTensor, Options, Quantizer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let q = match data[0] % 3 {
        0 => Quantizer::E8,
        1 => Quantizer::Tcq { log2_states: 2 },
        _ => Quantizer::Tcq { log2_states: 5 },
    };
    let rows = 1 + data[1] as usize % 40;
    let cols = 8 * (1 + data[2] as usize % 24);
    let mut r = entrollm_codec::rng::SplitMix64::new(data[3] as u64);
    let w: Vec<f32> = (0..rows * cols)
        .map(|_| {
            let s = r.next_u64();
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * if s >> 63 == 1 { 0.1 } else { 0.02 }
        })
        .collect();
    let mut o = Options::new(1.0 + (data[3] % 7) as f64, q);
    o.sample_weights = 4096;
    let Ok((t, _)) = LossyTensor::encode(&w, rows, cols, &o) else { return };
    let mut b = t.to_bytes();
    for edit in data[4..].chunks(6) {
        if edit.len() < 6 {
            break;
        }
        let at = u32::from_le_bytes([edit[1], edit[2], edit[3], edit[4]]) as usize;
        let v = edit[5];
        let n = b.len();
        match edit[0] % 4 {
            0 if n > 0 => b[at % n] ^= 1 << (v % 8),
            1 if n > 0 => b[at % n] = v,
            2 => b.truncate(at % (n + 1)),
            3 => b.push(v),
            _ => {}
        }
    }
    if let Ok(t) = LossyTensor::from_bytes(&b) {
        // A damaged header may claim a matrix of billions of weights, which is a legitimate (if
        // large) allocation, not a decoder fault; the engines check memory before loading.
        if t.rows * t.cols <= 1 << 24 {
            let _ = t.decode();
        }
    }
});
