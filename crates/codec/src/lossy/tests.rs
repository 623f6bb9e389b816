use super::*;
use crate::rng::SplitMix64 as Rng;

fn gaussian(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| (r.normal() * 0.02) as f32).collect()
}

/// ‖a − b‖ / ‖a‖; a reference of zeros gives 0 where `b` is zeros too.
pub(super) fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let e: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    let s: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum();
    (e / s.max(f64::MIN_POSITIVE)).sqrt()
}

const QUANTIZERS: [Quantizer; 3] = [
    Quantizer::E8,
    Quantizer::Tcq { log2_states: 2 },
    Quantizer::Tcq { log2_states: 5 },
];

/// The points the quantiser itself chooses at `step`, found without the coder: E8 nearest points of
/// each block; TCQ's Viterbi path of each lane.
fn points(
    q: Quantizer,
    w: &[f32],
    rows: usize,
    cols: usize,
    step: f64,
    t: &LossyTensor,
) -> Vec<f32> {
    let (xn, _) = normalise(w, cols);
    let mut p = vec![0f32; w.len()];
    match q {
        Quantizer::E8 => {
            for (o, v) in p.chunks_exact_mut(8).zip(xn.chunks_exact(8)) {
                let x: [f32; 8] = std::array::from_fn(|i| v[i] / step as f32);
                o.copy_from_slice(&nearest_points(&x));
            }
        }
        Quantizer::Tcq { log2_states } => {
            // A rate-aware search depends on the sampled model; these tests use the nearest-point one.
            let tcq = tcq::Tcq::new(log2_states);
            let tile = t.tile_rows * cols;
            for (xt, pt) in xn.chunks(tile).zip(p.chunks_mut(tile)) {
                let mut code = TileCode::default();
                tcq.quantize_tile(xt, cols, step as f32, None, None, &mut code);
                // Re-derive points from the symbols by walking the trellis (independent of rANS).
                let mut state = [0usize; LANES];
                for (i, s) in code.syms.iter().enumerate() {
                    let l = i % LANES;
                    assert_eq!(s.lane as usize, l);
                    let z0 = state[l] & 1;
                    assert_eq!(s.table as usize, z0);
                    pt[i] = (2 * s.value + z0 as i32) as f32;
                    state[l] = tcq.next_state(state[l], (s.value & 1) as usize);
                }
            }
        }
    }
    let _ = rows;
    for (r, row) in p.chunks_exact_mut(cols).enumerate() {
        for v in row {
            *v *= t.scales[r];
        }
    }
    p
}

fn nearest_points(x: &[f32; 8]) -> [f32; 8] {
    e8::nearest(x).map(|v| v as f32 / 2.0)
}

#[test]
fn decode_gives_the_quantisers_points_bit_exact_on_ragged_shapes() {
    let mut seed = 11;
    for q in QUANTIZERS {
        for (rows, cols) in [
            (1, 8),
            (3, 40),
            (37, 96),
            (5, 8192),
            (130, 264),
            (300, 1000),
        ] {
            if cols % 8 != 0 && q == Quantizer::E8 {
                continue;
            }
            seed += 1;
            let w = gaussian(rows * cols, seed);
            for bits in [2.0, 4.5] {
                let mut o = Options::new(bits, q);
                o.rate_weight = 0.0;
                let (t, rep) = LossyTensor::encode(&w, rows, cols, &o).unwrap();
                let d = t.decode().unwrap();
                let p = points(q, &w, rows, cols, rep.step, &t);
                assert!(
                    d.iter().zip(&p).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{q} {rows}x{cols} at {bits}"
                );
                let back = LossyTensor::from_bytes(&t.to_bytes()).unwrap();
                assert_eq!(back, t);
                assert_eq!(t.to_bytes().len(), t.stored_bytes());
            }
        }
    }
}

#[test]
fn the_stored_rate_lands_within_a_percent_of_the_target() {
    let (rows, cols) = (256, 4096);
    let w = gaussian(rows * cols, 5);
    for q in [Quantizer::E8, Quantizer::Tcq { log2_states: 3 }] {
        for bits in [2.0, 3.0, 4.0, 6.0] {
            let (t, _) = LossyTensor::encode(&w, rows, cols, &Options::new(bits, q)).unwrap();
            let r = t.bits_per_weight();
            assert!((r / bits - 1.0).abs() < 0.01, "{q} at {bits}: {r}");
            let e = rel_l2(&w, &t.decode().unwrap());
            // Within 0.35 bit of the Gaussian bound 2^-R (EntroPack: 0.2 bit at 4 bpp).
            assert!(e < (-r + 0.35).exp2(), "{q} at {bits}: {e}");
        }
    }
}

#[test]
fn zero_and_constant_rows_code_and_decode() {
    let (rows, cols) = (64, 512);
    let mut w = gaussian(rows * cols, 8);
    w[..cols].fill(0.0);
    for v in &mut w[cols..2 * cols] {
        *v = 0.25;
    }
    for q in QUANTIZERS {
        let (t, _) = LossyTensor::encode(&w, rows, cols, &Options::new(3.0, q)).unwrap();
        let d = t.decode().unwrap();
        assert!(d[..cols].iter().all(|&v| v == 0.0));
        assert!(rel_l2(&w[cols..2 * cols], &d[cols..2 * cols]) < 0.05);
    }
}

#[test]
fn bad_inputs_are_errors() {
    let w = gaussian(64, 1);
    let o = Options::new(3.0, Quantizer::E8);
    assert!(LossyTensor::encode(&w, 4, 16, &o).is_ok());
    assert!(LossyTensor::encode(&w, 8, 9, &o).is_err(), "cols % 8");
    assert!(LossyTensor::encode(&w, 5, 16, &o).is_err(), "length");
    let mut n = w.clone();
    n[7] = f32::NAN;
    let e = LossyTensor::encode(&n, 4, 16, &o).unwrap_err().to_string();
    assert!(e.contains("row 0, column 7"), "{e}");
    assert!(LossyTensor::encode(&w, 4, 16, &Options::new(40.0, Quantizer::E8)).is_err());
    assert!("tcq6".parse::<Quantizer>().is_err());
    assert_eq!(
        "tcq64".parse::<Quantizer>(),
        Ok(Quantizer::Tcq { log2_states: 6 })
    );
}

/// Damaged stored forms: every truncation and many byte flips are errors or decode to something,
/// never a panic; flips in the payload or states are caught (the decoder must end every tile exactly).
#[test]
fn damaged_stored_forms_are_clean_errors() {
    let w = gaussian(40 * 96, 3);
    for q in QUANTIZERS {
        let (t, _) = LossyTensor::encode(&w, 40, 96, &Options::new(3.0, q)).unwrap();
        let b = t.to_bytes();
        for n in (0..b.len()).step_by(7) {
            assert!(
                LossyTensor::from_bytes(&b[..n]).is_err(),
                "truncated at {n}"
            );
        }
        let payload_start = b.len() - 2 * t.payload.len();
        let states_start = payload_start - 4 * (t.offsets.len() + t.states.len());
        let mut r = Rng::new(9);
        let mut caught = 0;
        let trials = 300;
        for _ in 0..trials {
            let mut d = b.clone();
            let i = states_start + (r.next_u64() as usize % (b.len() - states_start));
            d[i] ^= 1 << (r.next_u64() % 8);
            if let Ok(t2) = LossyTensor::from_bytes(&d) {
                match t2.decode() {
                    Err(_) => caught += 1,
                    Ok(v) => assert_ne!(v, t.decode().unwrap(), "a flip at {i} went unnoticed"),
                }
            } else {
                caught += 1;
            }
        }
        // rANS has no redundancy: a flip can decode to other values without tripping the end check,
        // which is why served bytes are also hashed. Most flips are caught here all the same.
        assert!(caught * 2 > trials, "{q}: {caught} of {trials}");
        // Header and tables: anything goes, nothing panics.
        for i in 0..states_start {
            for bit in [0, 7] {
                let mut d = b.clone();
                d[i] ^= 1 << bit;
                if let Ok(t2) = LossyTensor::from_bytes(&d) {
                    let _ = t2.decode();
                }
            }
        }
    }
}

/// Tiles decoded one at a time (as a fused product decodes them) are the decoded matrix's rows;
/// a buffer of the wrong size or a tile past the end is refused.
#[test]
fn tiles_decoded_one_at_a_time_are_the_decoded_matrix() {
    for q in QUANTIZERS {
        for (rows, cols) in [(1, 8), (70, 96), (300, 1000), (9, 4104)] {
            if cols % 8 != 0 && q == Quantizer::E8 {
                continue;
            }
            let w = gaussian(rows * cols, rows as u64 * 7 + cols as u64);
            let opts = Options {
                tile_weights: MIN_TILE_WEIGHTS,
                ..Options::new(3.5, q)
            };
            let (t, _) = LossyTensor::encode(&w, rows, cols, &opts).unwrap();
            let d = t.decode().unwrap();
            let dec = t.decoder().unwrap();
            let mut covered = 0;
            for tile in 0..t.tiles() {
                let r = t.tile_row_range(tile);
                assert_eq!(r.start, covered);
                covered = r.end;
                let mut out = vec![f32::NAN; r.len() * cols];
                t.decode_tile(&dec, tile, &mut out).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&out),
                    bits(&d[r.start * cols..r.end * cols]),
                    "{q} {rows}x{cols}"
                );
                assert!(t.decode_tile(&dec, tile, &mut out[1..]).is_err());
            }
            assert_eq!(covered, rows);
            assert!(t.decode_tile(&dec, t.tiles(), &mut []).is_err());
        }
    }
}

/// Smaller tiles (more for a GPU to decode at once) round-trip through the stored form, hit the
/// rate asked (their extra states counted), and cost about their 132 bytes a tile in error; sizes
/// out of range are refused.
#[test]
fn smaller_tiles_round_trip_at_the_rate_asked() {
    let (rows, cols) = (256usize, 512usize);
    let w = gaussian(rows * cols, 41);
    for q in QUANTIZERS {
        let mut errs = vec![];
        for tw in [TILE_WEIGHTS, 4096, MIN_TILE_WEIGHTS] {
            let opts = Options {
                tile_weights: tw,
                ..Options::new(4.0, q)
            };
            let (t, _) = LossyTensor::encode(&w, rows, cols, &opts).unwrap();
            assert_eq!(t.tile_rows, tw.div_ceil(cols));
            assert!(
                (t.bits_per_weight() - 4.0).abs() < 0.04,
                "{q} {tw}: {}",
                t.bits_per_weight()
            );
            let back = LossyTensor::from_bytes(&t.to_bytes()).unwrap();
            assert_eq!(back, t);
            errs.push(rel_l2(&w, &back.decode().unwrap()));
        }
        assert!(errs[0] < errs[1] && errs[1] < errs[2], "{q}: {errs:?}");
    }
    for tw in [MIN_TILE_WEIGHTS - 1, TILE_WEIGHTS + 1] {
        let opts = Options {
            tile_weights: tw,
            ..Options::new(4.0, Quantizer::E8)
        };
        assert!(LossyTensor::encode(&w, rows, cols, &opts).is_err(), "{tw}");
    }
}

/// Rows of one distribution at log-normal scales (σ = 0.3), the heavy-tailed source's
/// row structure.
fn scaled_rows(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    let mut w = vec![0f32; rows * cols];
    for row in w.chunks_mut(cols) {
        let s = (0.3 * r.normal()).exp() * 0.015;
        for v in row {
            *v = (r.normal() * s) as f32;
        }
    }
    w
}

fn weighted_rel(a: &[f32], b: &[f32], cols: usize, h: &[f32]) -> f64 {
    let (mut e, mut s) = (0f64, 0f64);
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        let h = h[i % cols] as f64;
        e += h * (x as f64 - y as f64).powi(2);
        s += h * (x as f64).powi(2);
    }
    e / s
}

#[test]
fn row_rdo_lowers_the_error_of_rows_at_different_scales_at_the_same_rate() {
    let (rows, cols) = (256, 512);
    let w = scaled_rows(rows, cols, 11);
    for q in [Quantizer::E8, Quantizer::Tcq { log2_states: 5 }] {
        for bits in [2.0, 4.0] {
            let plain = Options::new(bits, q);
            let rdo = Options {
                rdo: 8,
                ..plain.clone()
            };
            let (a, _) = LossyTensor::encode(&w, rows, cols, &plain).unwrap();
            let (b, _) = LossyTensor::encode(&w, rows, cols, &rdo).unwrap();
            for t in [&a, &b] {
                let off = t.bits_per_weight() / bits - 1.0;
                assert!(
                    off.abs() < 0.01,
                    "{q} at {bits}: rate {}",
                    t.bits_per_weight()
                );
            }
            let (ea, eb) = (
                rel_l2(&w, &a.decode().unwrap()),
                rel_l2(&w, &b.decode().unwrap()),
            );
            // Equal absolute steps instead of equal relative ones: about 0.13 bit at σ = 0.3.
            assert!(eb < ea * 0.97, "{q} at {bits}: RDO {eb:.4} against {ea:.4}");
            // A multiplier per row, within the range, folded into the row scales: decoding is as
            // without RDO.
            let back = LossyTensor::from_bytes(&b.to_bytes()).unwrap();
            assert_eq!(back.decode().unwrap(), b.decode().unwrap());
        }
    }
}

#[test]
fn column_weights_lower_the_weighted_error_and_all_equal_ones_change_nothing() {
    let (rows, cols) = (96, 256);
    let w = gaussian(rows * cols, 5);
    let mut r = Rng::new(9);
    // Activation energies spread over two orders of magnitude, as real layers' are.
    let h: Vec<f32> = (0..cols).map(|_| (1.5 * r.normal()).exp() as f32).collect();
    for q in QUANTIZERS {
        let plain = Options::new(3.0, q);
        let (a, _) = LossyTensor::encode(&w, rows, cols, &plain).unwrap();
        let ones = Options {
            col_weights: Some(vec![2.5; cols]),
            ..plain.clone()
        };
        let (b, _) = LossyTensor::encode(&w, rows, cols, &ones).unwrap();
        assert_eq!(
            a.to_bytes(),
            b.to_bytes(),
            "{q}: equal weights are no weights"
        );
        let weighted = Options {
            col_weights: Some(h.clone()),
            ..plain.clone()
        };
        let (c, _) = LossyTensor::encode(&w, rows, cols, &weighted).unwrap();
        assert!((c.bits_per_weight() / 3.0 - 1.0).abs() < 0.01);
        let (ea, ec) = (
            weighted_rel(&w, &a.decode().unwrap(), cols, &h),
            weighted_rel(&w, &c.decode().unwrap(), cols, &h),
        );
        assert!(ec < ea, "{q}: weighted error {ec:.5} against {ea:.5}");
    }
    let bad = Options {
        col_weights: Some(vec![1.0; cols - 1]),
        ..Options::new(3.0, Quantizer::E8)
    };
    assert!(LossyTensor::encode(&w, rows, cols, &bad).is_err());
    let neg = Options {
        col_weights: Some(vec![-1.0; cols]),
        ..Options::new(3.0, Quantizer::E8)
    };
    assert!(LossyTensor::encode(&w, rows, cols, &neg).is_err());
}

#[test]
fn the_rd_curve_falls_with_rate_and_predicts_what_encode_gives() {
    let (rows, cols) = (300, 512);
    let w = scaled_rows(rows, cols, 3);
    for q in QUANTIZERS {
        let opts = Options::new(3.0, q);
        let curve = LossyTensor::rd_curve(&w, rows, cols, &opts, (2.0, 5.0)).unwrap();
        assert!(
            curve.first().unwrap().0 <= 2.0 && curve.last().unwrap().0 >= 5.0,
            "{q}: {curve:?}"
        );
        for p in curve.windows(2) {
            assert!(p[1].0 > p[0].0 && p[1].1 < p[0].1, "{q}: {curve:?}");
        }
        // Interpolated in log error at 3 bits against a real encode's squared relative error.
        let i = curve.iter().position(|p| p.0 >= 3.0).unwrap();
        let (a, b) = (curve[i - 1], curve[i]);
        let t = (3.0 - a.0) / (b.0 - a.0);
        let predicted = (a.1.ln() * (1.0 - t) + b.1.ln() * t).exp();
        let (c, _) = LossyTensor::encode(&w, rows, cols, &opts).unwrap();
        let got = rel_l2(&w, &c.decode().unwrap()).powi(2);
        assert!(
            (got / predicted - 1.0).abs() < 0.15,
            "{q}: {got} against {predicted}"
        );
    }
}

/// Every tile of `t` by the scalar and the AVX2 decoder: the same points bit for bit, or both a
/// `Corrupt` error. Returns the tiles that failed.
#[cfg(target_arch = "x86_64")]
fn both_paths_agree(t: &LossyTensor, what: &str) -> usize {
    let Ok(dec) = t.decoder() else {
        return t.tiles();
    };
    assert!(dec.simd.is_some(), "{what}: no vector tables");
    let mut failed = 0;
    for tile in 0..t.tiles() {
        let n = t.tile_rows.min(t.rows - tile * t.tile_rows) * t.cols;
        let (mut a, mut b) = (vec![0f32; n], vec![f32::NAN; n]);
        let ra = t.decode_points_with(&dec, tile, &mut a, DecodePath::Scalar);
        let rb = t.decode_points_with(&dec, tile, &mut b, DecodePath::Vector);
        match (ra, rb) {
            (Ok(()), Ok(())) => {
                if let Some(i) = (0..n).find(|&i| a[i].to_bits() != b[i].to_bits()) {
                    panic!(
                        "{what} tile {tile} point {i}: scalar {} vector {}",
                        a[i], b[i]
                    );
                }
            }
            (Err(CodecError::Corrupt(_)), Err(CodecError::Corrupt(_))) => failed += 1,
            (ra, rb) => panic!("{what} tile {tile}: scalar {ra:?}, vector {rb:?}"),
        }
    }
    failed
}

/// Damaged copies of `t`: words flipped, a tile's words cut short or lengthened, states replaced,
/// E8 coset tables holding values other than 0 and 1. Both decoders must agree on each.
#[cfg(target_arch = "x86_64")]
fn damaged_copies_agree(t: &LossyTensor, what: &str, r: &mut Rng) {
    let words = t.payload.len();
    for k in 0..6 {
        let mut d = t.clone();
        if words > 0 {
            for _ in 0..1 + k {
                let i = r.next_u64() as usize % words;
                d.payload[i] ^= 1 << (r.next_u64() % 16);
            }
        }
        both_paths_agree(&d, &format!("{what}: flipped words"));
    }
    let tile = r.next_u64() as usize % t.tiles();
    let (a, b) = (t.offsets[tile] as usize, t.offsets[tile + 1] as usize);
    for cut in [1usize, 2, 7, 31, 32, 33, 100, usize::MAX] {
        // Cut from the tile's end and from its middle: later tiles' offsets move down with it.
        for at in [b, a + (b - a) / 2] {
            let cut = cut.min(at - a);
            let mut d = t.clone();
            d.payload.drain(at - cut..at);
            for o in &mut d.offsets[tile + 1..] {
                *o -= cut as u32;
            }
            let failed = both_paths_agree(&d, &format!("{what}: tile {tile} cut by {cut}"));
            assert!(
                cut == 0 || failed > 0,
                "{what}: a cut of {cut} went unnoticed"
            );
        }
    }
    let mut d = t.clone();
    d.payload.splice(b..b, [0x1234u16; 40]);
    for o in &mut d.offsets[tile + 1..] {
        *o += 40;
    }
    assert!(both_paths_agree(&d, &format!("{what}: tile {tile} lengthened")) > 0);
    let mut d = t.clone();
    for s in &mut d.states[tile * LANES..(tile + 1) * LANES] {
        *s = r.next_u64() as u32 >> (r.next_u64() % 20);
    }
    both_paths_agree(&d, &format!("{what}: random states"));
    if t.quantizer == Quantizer::E8 {
        for min in [-1, 1, 2] {
            let mut d = t.clone();
            d.tables[0].min = min;
            both_paths_agree(&d, &format!("{what}: coset table from {min}"));
        }
    }
}

/// The AVX2 decode against the scalar reference on fresh matrices of many shapes, ragged ones
/// included (rows that are not a multiple of anything, tiles ending mid-step), for each quantiser,
/// rate, table precision and tile size, and on damaged payloads.
#[test]
fn the_vector_decode_is_the_scalar_decode() {
    #[cfg(target_arch = "x86_64")]
    {
        if !simd::available() {
            eprintln!("note: this CPU has no AVX2; the vector decode is not tested");
            return;
        }
        let mut r = Rng::new(77);
        let mut cases = vec![
            (1usize, 8usize),
            (3, 40),
            (11, 14336),
            (130, 1536),
            (129, 8),
        ];
        for _ in 0..10 {
            cases.push((
                1 + r.next_u64() as usize % 130,
                8 * (1 + r.next_u64() as usize % 192),
            ));
        }
        let quantizers = [
            Quantizer::Tcq { log2_states: 2 },
            Quantizer::Tcq { log2_states: 5 },
            Quantizer::Tcq { log2_states: 8 },
            Quantizer::E8,
        ];
        for (ci, &(rows, cols)) in cases.iter().enumerate() {
            let w = gaussian(rows * cols, 1000 + ci as u64);
            for (qi, &q) in quantizers.iter().enumerate() {
                for (bi, bits) in [2.0, 3.0, 4.4, 6.0].into_iter().enumerate() {
                    let k = ci + qi + bi;
                    let o = Options {
                        tile_weights: [TILE_WEIGHTS, MIN_TILE_WEIGHTS, 4096][k % 3],
                        prob_bits: [None, Some(9), Some(15), None][k % 4],
                        search_steps: 4,
                        ..Options::new(bits, q)
                    };
                    let Ok((t, _)) = LossyTensor::encode(&w, rows, cols, &o) else {
                        continue;
                    };
                    let what = format!("{q} {rows}x{cols} at {bits}, {} rows a tile", t.tile_rows);
                    assert_eq!(both_paths_agree(&t, &what), 0, "{what}");
                    if k % 4 == 0 {
                        damaged_copies_agree(&t, &what, &mut r);
                    }
                }
            }
        }
    }
}

/// A small stored form can hold a matrix too large to decode (rows of zeros cost no payload): the
/// stored form reads back, and decoding it is an error, not an allocation abort.
#[test]
fn a_matrix_too_large_to_decode_is_an_error_not_an_abort() {
    let cols = 1 << 20;
    let (t, _) = LossyTensor::encode(
        &vec![0f32; cols],
        1,
        cols,
        &Options::new(2.0, Quantizer::E8),
    )
    .unwrap();
    assert!(t.payload.is_empty(), "a zero row costs no payload");
    let rows = 1 << 17;
    let big = LossyTensor {
        rows,
        tile_rows: 1,
        scales: vec![t.scales[0]; rows],
        states: t.states.repeat(rows),
        offsets: vec![0; rows + 1],
        ..t
    };
    let bytes = big.to_bytes();
    assert!(
        bytes.len() < 20 << 20,
        "{} bytes for 2^37 weights",
        bytes.len()
    );
    let back = LossyTensor::from_bytes(&bytes).unwrap();
    let e = back.decode().unwrap_err().to_string();
    assert!(e.contains("more memory than can be had"), "{e}");
}
