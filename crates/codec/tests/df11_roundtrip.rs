//! Round trips, sizes, refusals, the fused matvec and corruption handling of the DFloat11 coder.

mod df11_support;

use df11_support::{from_histogram, geometric, heavy_tailed_bf16, normal_bf16};
use entrollm_codec::df11::{lut_lookup, Df11Tensor, FIRST_POINTER, MAX_CODE_BITS};
use entrollm_codec::CodecError;
use proptest::prelude::*;

fn round_trip(w: &[u16]) -> Df11Tensor {
    let t = Df11Tensor::encode(w).unwrap();
    t.validate().unwrap();
    assert_eq!(t.decode().unwrap(), w, "round trip of {} weights", w.len());
    t
}

fn lut_rows(t: &Df11Tensor) -> usize {
    t.luts.len() / 256 - 1
}

/// Longest code length in the tensor's length row.
fn longest_code(t: &Df11Tensor) -> u8 {
    *t.luts[t.luts.len() - 256..].iter().max().unwrap()
}

#[test]
fn sizes_round_trip() {
    for n in [
        1,
        2,
        7,
        8,
        9,
        63,
        64,
        65,
        1000,
        4095,
        4096,
        4097,
        12_345,
        100_003,
        (1 << 20) + 3,
    ] {
        let t = round_trip(&normal_bf16(n as u64, n, 0.02));
        assert_eq!(t.sign_mantissa.len(), n);
        assert_eq!(*t.output_positions.last().unwrap() as usize, n);
    }
}

#[test]
fn empty_tensor_round_trips() {
    let t = round_trip(&[]);
    assert!(t.encoded_exponent.is_empty() && t.gaps.is_empty());
    assert_eq!(t.output_positions, vec![0]);
    assert!(t.bits_per_weight().is_infinite());
    let mut y = vec![1.0f32; 3];
    t.matvec(3, 0, &[], &mut y).unwrap();
    assert_eq!(y, vec![0.0; 3]);
}

#[test]
fn heavy_tails_round_trip() {
    let w = heavy_tailed_bf16(3, 200_000, 0.01);
    let t = round_trip(&w);
    assert!(longest_code(&t) > 16, "heavy tails should give long codes");
}

#[test]
fn single_repeated_value_round_trips() {
    // One exponent: dahuffman gives it and EOF one bit each (DFloat11's get_luts fails here).
    for n in [1, 5, 8, 100_001] {
        let t = round_trip(&vec![0x3C21u16; n]);
        assert_eq!(lut_rows(&t), 1);
        assert_eq!(t.encoded_exponent.len(), n.div_ceil(8));
    }
}

#[test]
fn every_codable_exponent_round_trips() {
    // All 240 exponents below the pointer range, nearly evenly: 7- and 8-bit codes, plus the rare
    // EOF whose sibling needs one sub-table.
    let counts: Vec<(u8, usize)> = (0..240u8).map(|e| (e, 50 + e as usize % 3)).collect();
    let t = round_trip(&from_histogram(9, &counts, &[]));
    assert!(lut_rows(&t) <= 2, "{} rows", lut_rows(&t));
}

#[test]
fn reserved_exponents_are_refused() {
    let base = normal_bf16(1, 1000, 0.02);
    for (bad, exponent) in [
        (0x7F80u16, 255),
        (0xFFC1, 255),
        (0x7800, 240),
        (0x7A00, 244),
    ] {
        let mut w = base.clone();
        w[500] = bad;
        match Df11Tensor::encode(&w) {
            Err(CodecError::Unsupported(m)) => {
                assert!(m.contains(&format!("exponent {exponent} ")), "{m}")
            }
            other => panic!(
                "{bad:#x}: expected Unsupported, got {:?}",
                other.map(|t| lut_rows(&t))
            ),
        }
    }
}

#[test]
fn too_many_lut_subtables_are_refused() {
    // 240 exponents with counts 1..=13: codes of 6 to 11 bits under many different first bytes.
    let counts: Vec<(u8, usize)> = (0..240u8)
        .map(|e| (e, 1 + (e as usize * 7919) % 13))
        .collect();
    match Df11Tensor::encode(&from_histogram(2, &counts, &[])) {
        Err(CodecError::Unsupported(m)) => assert!(m.contains("sub-tables"), "{m}"),
        other => panic!(
            "expected Unsupported, got {:?}",
            other.map(|t| lut_rows(&t))
        ),
    }
}

#[test]
fn codes_longer_than_32_bits_are_limited_and_decode() {
    // EOF + Fibonacci counts 1, 2, 3, 5, ... (33 of them): a chain-shaped tree 33 bits deep.
    let mut fib = vec![1usize, 2];
    while fib.len() < 33 {
        fib.push(fib[fib.len() - 1] + fib[fib.len() - 2]);
    }
    let counts: Vec<(u8, usize)> = fib
        .iter()
        .rev()
        .enumerate()
        .map(|(i, &c)| (90 + i as u8, c))
        .collect();
    let t = round_trip(&from_histogram(5, &counts, &[]));
    assert_eq!(longest_code(&t) as u32, MAX_CODE_BITS);
    assert_eq!(lut_rows(&t), 4); // one prefix per level in a chain-shaped tree
}

#[test]
fn padding_thread_the_kernel_would_spin_on_is_not_decoded() {
    // Exponent 132 gets the all-ones 9-bit code (EOF: 111111110). These counts make the stream
    // 1160 = 18 * 64 + 8 bits, ending with a 132 whose last 8 bits are alone in window 18: no EOF,
    // and thread 18 (gap 0, padding) starts at 11111111 + zeros. Row 0's 0xFF points to the 0xFF
    // row, whose entries for EOF's range repeat row 0's last value, that same pointer; after four
    // levels the kernel holds a pointer with code length 0 and never advances. Nothing of thread
    // 18 is written (all 1160 bits belong to earlier threads), so stopping at n loses nothing.
    let counts = [
        (100, 72),
        (101, 39),
        (104, 12),
        (109, 30),
        (110, 94),
        (113, 9),
        (118, 14),
        (122, 47),
        (124, 27),
        (127, 8),
        (128, 4),
        (132, 1),
        (133, 8),
        (136, 2),
    ];
    let t = round_trip(&from_histogram(1, &counts, &[132]));
    assert_eq!(t.encoded_exponent.len() * 8, 1160);
    assert_eq!(t.encoded_exponent.last(), Some(&0xFF));
    let (rows, lens) = t.luts.split_at(t.luts.len() - 256);
    let v = lut_lookup(rows, 0xFF << 56).unwrap();
    assert!(v >= FIRST_POINTER && lens[v as usize] == 0, "value {v}");
}

#[test]
fn normal_weights_cost_about_entropy_plus_eight_bits() {
    let n = 1 << 20;
    let w = normal_bf16(11, n, 0.02);
    let t = round_trip(&w);
    let mut h = [0u64; 256];
    for &x in &w {
        h[(x >> 7 & 0xFF) as usize] += 1;
    }
    let entropy = entrollm_codec::histogram::entropy_bits(&h);
    let bpw = t.bits_per_weight();
    // Huffman's redundancy (~0.1 bit) plus 5 gap bits per 64 stream bits (~0.2 bit).
    assert!(
        bpw > 8.0 + entropy && bpw < 8.0 + entropy + 0.35,
        "{bpw} vs {entropy}"
    );
    let (lens, _) = entrollm_codec::df11::CodeTable::from_histogram(&h)
        .unwrap()
        .exponent_codes();
    let code_bits: u64 = h.iter().zip(lens).map(|(&c, l)| c * l as u64).sum();
    let blocks = (code_bits.div_ceil(8) as usize).div_ceil(4096);
    let expected =
        t.luts.len() + code_bits.div_ceil(8) as usize + n + 4 * (blocks + 1) + 320 * blocks;
    assert_eq!(t.stored_bytes(), expected);
}

#[test]
fn matvec_matches_a_dense_product() {
    let (rows, cols) = (37, 1531); // rows straddle block boundaries
    let w = normal_bf16(4, rows * cols, 0.05);
    let t = round_trip(&w);
    assert!(t.blocks() > 3);
    let x: Vec<f32> = normal_bf16(5, cols, 1.0)
        .iter()
        .map(|&b| half::bf16::from_bits(b).to_f32())
        .collect();
    let mut y = vec![f32::NAN; rows];
    t.matvec(rows, cols, &x, &mut y).unwrap();
    for r in 0..rows {
        let (mut exact, mut magnitude) = (0f64, 0f64);
        for c in 0..cols {
            let p = half::bf16::from_bits(w[r * cols + c]).to_f64() * x[c] as f64;
            exact += p;
            magnitude += p.abs();
        }
        let err = (y[r] as f64 - exact).abs();
        assert!(
            err <= 1e-6 * magnitude + 1e-30,
            "row {r}: {} vs {exact}",
            y[r]
        );
    }
}

#[test]
fn matvec_checks_shapes() {
    let t = round_trip(&normal_bf16(6, 600, 0.02));
    let mut y = [0f32; 20];
    for (rows, cols, xl, yl) in [(20, 31, 31, 20), (20, 30, 29, 20), (20, 30, 30, 19)] {
        let x = vec![0f32; xl];
        let r = t.matvec(rows, cols, &x, &mut y[..yl]);
        assert!(
            matches!(r, Err(CodecError::Shape(_))),
            "{rows}x{cols}: {r:?}"
        );
    }
    let r = t.decode_into(&mut vec![0u16; 599]);
    assert!(matches!(r, Err(CodecError::Shape(_))), "{r:?}");
}

fn corrupt_message(t: &Df11Tensor) -> String {
    match t.decode() {
        Err(CodecError::Corrupt(m)) => m,
        other => panic!("expected Corrupt, got {:?}", other.map(|v| v.len())),
    }
}

#[test]
fn structural_damage_is_named() {
    let good = round_trip(&normal_bf16(8, 30_000, 0.02));
    assert!(good.blocks() >= 3);

    let mut t = good.clone();
    t.output_positions[2] = t.output_positions[1] - 1;
    assert!(corrupt_message(&t).contains("output position of block 2 decreases"));

    let mut t = good.clone();
    t.output_positions[1] += 1;
    assert!(corrupt_message(&t).contains("block 0 decodes"));

    let mut t = good.clone();
    t.gaps.pop();
    assert!(corrupt_message(&t).contains("gaps has"));

    let mut t = good.clone();
    t.sign_mantissa.pop();
    assert!(corrupt_message(&t).contains("sign_mantissa"));

    let mut t = good.clone();
    t.luts[3] = 0xF0; // points to row 16 of a 3-row table
    assert!(corrupt_message(&t).contains("points to row 16"));

    let mut t = good.clone();
    let lens_row = t.luts.len() - 256;
    t.luts[lens_row + 120] = 33;
    assert!(corrupt_message(&t).contains("33 bits"));

    let mut t = good.clone();
    t.encoded_exponent.pop();
    let m = corrupt_message(&t);
    assert!(m.contains("past the end of the exponent stream"), "{m}");

    let mut t = good.clone();
    t.n_elements += 1;
    assert!(t.decode().is_err());
}

/// Every damaged copy must decode to an error or to `n` values, never panic.
fn decode_survives(t: &Df11Tensor) -> bool {
    match t.decode() {
        Ok(v) => {
            assert_eq!(v.len(), t.n_elements);
            false
        }
        Err(CodecError::Corrupt(_)) | Err(CodecError::Shape(_)) => true,
        Err(e) => panic!("unexpected error kind: {e}"),
    }
}

#[test]
fn flipped_bytes_never_panic() {
    let good = round_trip(&geometric(12, 30_000, 126, 30));
    let (mut tried, mut caught) = (0, 0);
    for pos in (0..good.luts.len()).step_by(3) {
        for flip in [0x01u8, 0x80, 0xFF] {
            let mut t = good.clone();
            t.luts[pos] ^= flip;
            tried += 1;
            caught += decode_survives(&t) as usize;
        }
    }
    for pos in (0..good.encoded_exponent.len()).step_by(5) {
        let mut t = good.clone();
        t.encoded_exponent[pos] ^= 0x10;
        tried += 1;
        caught += decode_survives(&t) as usize;
    }
    for pos in 0..good.gaps.len() {
        let mut t = good.clone();
        t.gaps[pos] ^= 0x21;
        tried += 1;
        caught += decode_survives(&t) as usize;
    }
    for pos in (0..good.sign_mantissa.len()).step_by(97) {
        let mut t = good.clone();
        t.sign_mantissa[pos] ^= 0x55;
        tried += 1;
        // Raw bytes carry no redundancy: the damage is undetectable and stays local.
        assert!(!decode_survives(&t));
        let d = t.decode().unwrap();
        assert_eq!(
            d.iter()
                .zip(&good.decode().unwrap())
                .filter(|(a, b)| a != b)
                .count(),
            1
        );
    }
    for pos in 0..good.output_positions.len() {
        for delta in [1u32, 1000, u32::MAX] {
            let mut t = good.clone();
            t.output_positions[pos] = t.output_positions[pos].wrapping_add(delta);
            tried += 1;
            caught += decode_survives(&t) as usize;
        }
    }
    // Most damage to the coded arrays is caught by counts and positions.
    assert!(caught * 2 > tried, "caught {caught} of {tried}");
}

#[test]
fn truncated_and_extended_arrays_never_panic() {
    let good = round_trip(&normal_bf16(13, 20_000, 0.02));
    for keep in [0usize, 1, 100, 255, 256, 511, 512] {
        let mut t = good.clone();
        t.luts.truncate(keep.min(t.luts.len() - 1));
        assert!(decode_survives(&t), "luts cut to {keep}");
    }
    for cut in [1usize, 2, 100, 4096, good.encoded_exponent.len()] {
        let mut t = good.clone();
        t.encoded_exponent.truncate(t.encoded_exponent.len() - cut);
        assert!(decode_survives(&t), "encoded_exponent cut by {cut}");
    }
    for cut in [1usize, 320, good.gaps.len()] {
        let mut t = good.clone();
        t.gaps.truncate(t.gaps.len() - cut);
        assert!(decode_survives(&t), "gaps cut by {cut}");
    }
    for cut in [2usize, good.output_positions.len()] {
        let mut t = good.clone();
        t.output_positions.truncate(t.output_positions.len() - cut);
        assert!(decode_survives(&t), "output_positions cut by {cut}");
    }
    // DFloat11 omits the final output position when no code starts in the last block.
    let mut t = good.clone();
    t.output_positions.pop();
    assert_eq!(t.decode().unwrap(), good.decode().unwrap());
    let mut t = good.clone();
    t.encoded_exponent.extend_from_slice(&[0xAB; 5000]);
    assert!(decode_survives(&t));
    let mut t = good.clone();
    t.sign_mantissa.push(0);
    assert!(decode_survives(&t));
}

/// BF16 bit patterns with exponents below 240 (DFloat11's pointer range).
fn codable(w: u16) -> u16 {
    if (w >> 7) & 0xFF >= 240 {
        w & !0x4000
    } else {
        w
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn arbitrary_codable_weights_round_trip(w in prop::collection::vec(any::<u16>(), 0..6000)) {
        // Near-uniform exponents often need more than 16 LUT sub-tables, which DFloat11 refuses.
        let w: Vec<u16> = w.into_iter().map(codable).collect();
        match Df11Tensor::encode(&w) {
            Ok(t) => prop_assert_eq!(t.decode().unwrap(), w),
            Err(CodecError::Unsupported(m)) => prop_assert!(m.contains("sub-tables"), "{}", m),
            Err(e) => prop_assert!(false, "{}", e),
        }
    }

    #[test]
    fn arbitrary_weights_in_an_exponent_window_round_trip(w in prop::collection::vec(any::<u16>(), 0..6000), low in 0u16..200) {
        // Exponents low..low+40: random bits land in at most 40 values, mostly unevenly.
        let w: Vec<u16> = w.into_iter().map(|x| (x & 0x807F) | ((low + ((x >> 7) & 0xFF) % 40) << 7)).collect();
        let t = Df11Tensor::encode(&w).unwrap();
        prop_assert_eq!(t.decode().unwrap(), w);
    }

    #[test]
    fn skewed_weights_round_trip(seed in any::<u64>(), n in 1usize..40_000, base in 100u32..140, cap in 1u32..60) {
        let w = geometric(seed, n, base, cap);
        let t = Df11Tensor::encode(&w).unwrap();
        prop_assert_eq!(t.decode().unwrap(), w);
    }

    #[test]
    fn random_histograms_round_trip(seed in any::<u64>(), counts in prop::collection::vec((0u8..240, 1usize..3000), 1..60)) {
        let w = from_histogram(seed, &counts, &[]);
        let t = Df11Tensor::encode(&w).unwrap();
        prop_assert_eq!(t.decode().unwrap(), w);
    }
}
