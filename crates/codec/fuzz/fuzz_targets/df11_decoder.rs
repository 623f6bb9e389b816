//! Fuzzes the DFloat11-layout decoder: a valid tensor made from the input's first bytes is damaged by
//! the rest (bit flips and truncations of every array) and decoded. Never a panic.
//!
//! Run: RUSTC_BOOTSTRAP=1 cargo fuzz run --fuzz-dir crates/codec/fuzz df11_decoder -- -max_total_time=600
#![no_main]

use entrollm_codec::df11::Df11Tensor;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let n = 1 + (u16::from_le_bytes([data[0], data[1]]) as usize % 20000);
    let mut r = entrollm_codec::rng::SplitMix64::new(data[2] as u64);
    let weights: Vec<u16> = (0..n)
        .map(|_| {
            let s = r.next_u64();
            let e = 110 + ((s >> 40) % 20) as u16 * ((s >> 50) % 2) as u16;
            (e << 7) | ((s >> 20) as u16 & 0x807F)
        })
        .collect();
    let Ok(mut t) = Df11Tensor::encode(&weights) else { return };
    for edit in data[3..].chunks(6) {
        if edit.len() < 6 {
            break;
        }
        let at = u32::from_le_bytes([edit[1], edit[2], edit[3], edit[4]]) as usize;
        let v = edit[5];
        fn flip(a: &mut [u8], at: usize, v: u8) {
            if !a.is_empty() {
                let i = at % a.len();
                a[i] ^= 1 << (v % 8);
            }
        }
        match edit[0] % 9 {
            0 => flip(&mut t.luts, at, v),
            1 => flip(&mut t.encoded_exponent, at, v),
            2 => flip(&mut t.sign_mantissa, at, v),
            3 => flip(&mut t.gaps, at, v),
            4 if !t.output_positions.is_empty() => {
                let i = at % t.output_positions.len();
                t.output_positions[i] ^= 1 << (v % 32);
            }
            5 => t.encoded_exponent.truncate(at % (t.encoded_exponent.len() + 1)),
            6 => t.gaps.truncate(at % (t.gaps.len() + 1)),
            7 => t.output_positions.truncate(at % (t.output_positions.len() + 1)),
            8 => t.n_elements = t.n_elements.wrapping_add(v as usize) % (1 << 24),
            _ => {}
        }
    }
    let _ = t.validate();
    let _ = t.decode();
});
