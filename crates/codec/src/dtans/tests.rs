use super::*;
use crate::histogram::{byte_histogram, entropy_bits};
use crate::matvec::Dequant;
use crate::rng::SplitMix64 as Rng;
use proptest::prelude::*;

fn gaussian_bf16(n: usize, sigma: f64, seed: u64) -> Vec<u8> {
    let mut r = Rng::new(seed);
    (0..n)
        .flat_map(|_| {
            half::bf16::from_f64(r.normal() * sigma)
                .to_bits()
                .to_le_bytes()
        })
        .collect()
}

const PAYLOADS: [Payload; 9] = [
    Payload::Bf16,
    Payload::Fp16,
    Payload::Fp8E4m3,
    Payload::Fp8E5m2,
    Payload::Fp4E2m1,
    Payload::Int(2),
    Payload::Int(3),
    Payload::Int(4),
    Payload::Int(8),
];

/// Element bytes of a random tensor whose codes follow `kind`.
fn elements(payload: Payload, n: usize, kind: u8, seed: u64) -> Vec<u8> {
    let mut r = Rng::new(seed);
    let a = payload.alphabet() as u64;
    let code = |r: &mut Rng| -> u8 {
        match kind {
            0 => 3.min(a - 1) as u8,                                 // one symbol only
            1 => (r.next_u64() % a) as u8,                           // uniform over the alphabet
            2 => ((r.normal().abs() * 2.0) as u64).min(a - 1) as u8, // skewed, geometric-like
            _ => {
                // a single symbol with one rare outlier per ~5000
                if r.next_u64().is_multiple_of(5000) {
                    (a - 1) as u8
                } else {
                    1
                }
            }
        }
    };
    if payload.has_raw() {
        (0..n)
            .flat_map(|_| {
                let c = code(&mut r);
                payload.join16(c, r.next_u64() as u8).to_le_bytes()
            })
            .collect()
    } else {
        (0..n).map(|_| code(&mut r)).collect()
    }
}

fn roundtrip(
    payload: Payload,
    rows: usize,
    cols: usize,
    bytes: &[u8],
    coding: Coding,
) -> Result<DtansTensor> {
    let (codes, raw) = payload.symbolize(bytes).unwrap();
    let t = DtansTensor::encode(payload, rows, cols, &codes, &raw, coding)?;
    let back = t.decode().expect("a tensor we encoded must decode");
    assert_eq!(
        back, bytes,
        "{payload:?} {coding:?} {rows}×{cols} is not bit-exact"
    );
    Ok(t)
}

/// Whether an encoder refusal is one of the documented limits.
fn legit_refusal(e: &CodecError) -> bool {
    matches!(e, CodecError::Unsupported(m) if m.contains("distinct symbols") || m.contains("too few tuples"))
}

#[test]
fn every_payload_mode_table_and_slice_width_round_trips() {
    let (rows, cols) = (37, 2100); // not a multiple of 32 rows nor of any slice width
    for (pi, &payload) in PAYLOADS.iter().enumerate() {
        for kind in 0..4u8 {
            let bytes = elements(payload, rows * cols, kind, 7 + pi as u64 * 13 + kind as u64);
            for mode in [Mode::Single, Mode::Pair, Mode::Quad] {
                for log2_m in TABLE_LOG2 {
                    for sc in SLICE_WIDTHS {
                        let k = mode.values_per_symbol() as u32;
                        if k * payload.code_bits() > 16 {
                            continue;
                        }
                        // Keep as many values as the table can pair up.
                        let t = match mode {
                            Mode::Single => None,
                            Mode::Pair => Some(((1u32 << log2_m) as f64).sqrt() as u16),
                            Mode::Quad => Some(((1u32 << log2_m) as f64).powf(0.25) as u16),
                        };
                        let t = t.map(|t| t.min(payload.alphabet() as u16));
                        let coding = Coding {
                            mode,
                            log2_m,
                            sc,
                            t,
                        };
                        match roundtrip(payload, rows, cols, &bytes, coding) {
                            Ok(_) => {}
                            Err(e) => assert!(legit_refusal(&e), "{payload:?} {coding:?}: {e}"),
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn every_value_escaped() {
    // t = 1 keeps only the zero code; data without zero codes escapes every weight.
    for payload in [Payload::Bf16, Payload::Fp8E4m3, Payload::Int(8)] {
        let mut r = Rng::new(5);
        let n = 70 * 130;
        let bytes: Vec<u8> = if payload.has_raw() {
            (0..n)
                .flat_map(|_| {
                    payload
                        .join16(1 + (r.next_u64() % 200) as u8, r.next_u64() as u8)
                        .to_le_bytes()
                })
                .collect()
        } else {
            (0..n).map(|_| 1 + (r.next_u64() % 200) as u8).collect()
        };
        for sc in [64, 256] {
            let t = roundtrip(
                payload,
                70,
                130,
                &bytes,
                Coding {
                    mode: Mode::Single,
                    log2_m: 8,
                    sc,
                    t: Some(1),
                },
            )
            .unwrap();
            assert!(t.tiles.chunks(2).any(|w| w[1] != 0));
        }
    }
}

#[test]
fn tiny_and_single_row_shapes() {
    for (rows, cols) in [(1, 1), (1, 63), (33, 1), (2, 4097), (64, 64)] {
        let bytes = gaussian_bf16(rows * cols, 0.02, rows as u64 * 31 + cols as u64);
        for coding in [
            Coding {
                mode: Mode::Single,
                log2_m: 8,
                sc: 64,
                t: None,
            },
            Coding {
                mode: Mode::Pair,
                log2_m: 12,
                sc: 2048,
                t: Some(64),
            },
        ] {
            roundtrip(Payload::Bf16, rows, cols, &bytes, coding).unwrap();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]
    #[test]
    fn random_shapes_codings_and_data(
        rows in 1usize..80,
        cols in 1usize..700,
        pi in 0usize..PAYLOADS.len(),
        kind in 0u8..4,
        mode_i in 0usize..3,
        mi in 0usize..4,
        si in 0usize..4,
        t in proptest::option::of(1u16..40),
        seed in any::<u64>(),
    ) {
        let payload = PAYLOADS[pi];
        let mode = [Mode::Single, Mode::Pair, Mode::Quad][mode_i];
        prop_assume!(mode.values_per_symbol() as u32 * payload.code_bits() <= 16);
        let coding = Coding { mode, log2_m: TABLE_LOG2[mi], sc: SLICE_WIDTHS[si], t: t.map(|t| t.min(payload.alphabet() as u16)) };
        let bytes = elements(payload, rows * cols, kind, seed);
        if let Err(e) = roundtrip(payload, rows, cols, &bytes, coding) {
            prop_assert!(legit_refusal(&e), "{}", e);
        }
    }
}

#[test]
fn corrupt_streams_are_errors_or_wrong_values_never_panics() {
    let (rows, cols) = (64, 512);
    let bytes = gaussian_bf16(rows * cols, 0.02, 99);
    let (codes, raw) = Payload::Bf16.symbolize(&bytes).unwrap();
    let coding = Coding {
        mode: Mode::Pair,
        log2_m: 10,
        sc: 256,
        t: Some(8),
    };
    let t = DtansTensor::encode(Payload::Bf16, rows, cols, &codes, &raw, coding).unwrap();
    let mut r = Rng::new(3);
    let mut errors = 0;
    for _ in 0..400 {
        let mut bad = t.clone();
        match r.next_u64() % 4 {
            0 => {
                let i = (r.next_u64() as usize) % bad.stream.len();
                bad.stream[i] ^= 1 << (r.next_u64() % 32);
            }
            1 => {
                let i = (r.next_u64() as usize) % bad.tiles.len();
                bad.tiles[i] ^= 1 << (r.next_u64() % 32);
            }
            2 => {
                let n = (r.next_u64() as usize) % bad.stream.len();
                bad.stream.truncate(n);
            }
            _ => {
                let i = (r.next_u64() as usize) % bad.table.counts.len();
                bad.table.counts[i] = bad.table.counts[i].wrapping_add(1);
            }
        }
        match bad.decode() {
            Err(CodecError::Corrupt(_)) => errors += 1,
            Err(e) => panic!("unexpected error kind: {e}"),
            Ok(_) => {}
        }
    }
    assert!(
        errors > 100,
        "only {errors} of 400 corruptions were detected"
    );
}

#[test]
fn matvec_matches_dense_reference() {
    let (rows, cols) = (70, 1000);
    for payload in [
        Payload::Bf16,
        Payload::Fp16,
        Payload::Fp8E4m3,
        Payload::Int(4),
        Payload::Int(8),
    ] {
        let bytes = elements(payload, rows * cols, 2, 11);
        let (codes, raw) = payload.symbolize(&bytes).unwrap();
        let coding = Coding {
            mode: Mode::Single,
            log2_m: 10,
            sc: 128,
            t: Some(3),
        };
        let t = DtansTensor::encode(payload, rows, cols, &codes, &raw, coding).unwrap();
        let mut r = Rng::new(1);
        let x: Vec<f32> = (0..cols).map(|_| r.normal() as f32).collect();
        let group = 32;
        let scales: Vec<f32> = (0..rows * cols.div_ceil(group))
            .map(|_| r.unit() as f32)
            .collect();
        let mins: Vec<f32> = (0..scales.len()).map(|_| r.normal() as f32).collect();
        let dq = match payload {
            Payload::Int(bits) => Dequant::Groups {
                group,
                scales: &scales,
                mins: Some(&mins),
                offset: 1.0,
                signed: bits == 8,
            },
            _ => Dequant::None,
        };
        let mut y = vec![0f32; rows];
        t.matvec(&x, &mut y, &dq).unwrap();
        let mut row = vec![0f32; cols];
        for r in [0, 31, 32, rows - 1] {
            t.row_f32(r, &mut row).unwrap();
            for (c, &v) in row.iter().enumerate() {
                let i = r * cols + c;
                let (code, rb) = if payload.has_raw() {
                    payload.split16(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]))
                } else {
                    (bytes[i], 0)
                };
                assert_eq!(
                    v.to_bits(),
                    payload.to_f32(code, rb).to_bits(),
                    "{payload:?} row {r} col {c}"
                );
            }
        }
        assert!(t.row_f32(rows, &mut row).is_err());
        for (row, &got) in y.iter().enumerate() {
            let mut want = 0f64;
            for (c, &xc) in x.iter().enumerate() {
                let i = row * cols + c;
                let (code, rb) = if payload.has_raw() {
                    payload.split16(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]))
                } else {
                    (bytes[i], 0)
                };
                want +=
                    dq.apply(payload, row, c, cols, payload.to_f32(code, rb)) as f64 * xc as f64;
            }
            assert!(
                (got as f64 - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{payload:?} row {row}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn gaussian_bf16_rate_is_near_the_exponent_entropy() {
    let (rows, cols) = (512, 4096);
    let bytes = gaussian_bf16(rows * cols, 0.02, 42);
    let (codes, raw) = Payload::Bf16.symbolize(&bytes).unwrap();
    let h = entropy_bits(&byte_histogram(&codes));
    for (coding, slack) in [
        (
            Coding {
                mode: Mode::Pair,
                log2_m: 12,
                sc: 2048,
                t: Some(64),
            },
            0.15,
        ),
        (
            Coding {
                mode: Mode::Single,
                log2_m: 8,
                sc: 2048,
                t: None,
            },
            0.15,
        ),
        (
            Coding {
                mode: Mode::Pair,
                log2_m: 10,
                sc: 512,
                t: Some(32),
            },
            0.30,
        ),
    ] {
        let t = DtansTensor::encode(Payload::Bf16, rows, cols, &codes, &raw, coding).unwrap();
        let bpw = t.bits_per_weight();
        assert!(
            bpw < h + 8.0 + slack,
            "{coding:?}: {bpw} bpw vs entropy {h} + 8"
        );
        assert!(
            bpw > h + 8.0,
            "{coding:?}: {bpw} below the entropy bound {h} + 8"
        );
    }
}

#[test]
fn size_predictor_is_within_one_percent() {
    let (rows, cols) = (256, 2048);
    let cases: Vec<(Payload, Vec<u8>, Coding)> = vec![
        (
            Payload::Bf16,
            gaussian_bf16(rows * cols, 0.02, 1),
            Coding {
                mode: Mode::Pair,
                log2_m: 12,
                sc: 512,
                t: Some(64),
            },
        ),
        (
            Payload::Bf16,
            gaussian_bf16(rows * cols, 0.02, 2),
            Coding {
                mode: Mode::Single,
                log2_m: 9,
                sc: 2048,
                t: None,
            },
        ),
        (
            Payload::Bf16,
            gaussian_bf16(rows * cols, 0.02, 3),
            Coding {
                mode: Mode::Pair,
                log2_m: 8,
                sc: 256,
                t: Some(12),
            },
        ),
        (
            Payload::Fp8E4m3,
            elements(Payload::Fp8E4m3, rows * cols, 2, 4),
            Coding {
                mode: Mode::Pair,
                log2_m: 10,
                sc: 1024,
                t: Some(16),
            },
        ),
        (
            Payload::Int(4),
            elements(Payload::Int(4), rows * cols, 1, 5),
            Coding {
                mode: Mode::Pair,
                log2_m: 8,
                sc: 512,
                t: None,
            },
        ),
        (
            Payload::Int(2),
            elements(Payload::Int(2), rows * cols, 2, 6),
            Coding {
                mode: Mode::Quad,
                log2_m: 8,
                sc: 256,
                t: None,
            },
        ),
    ];
    for (payload, bytes, coding) in cases {
        let (codes, raw) = payload.symbolize(&bytes).unwrap();
        let t = DtansTensor::encode(payload, rows, cols, &codes, &raw, coding).unwrap();
        let predicted = DtansTensor::predict_bytes(payload, rows, cols, &codes, coding).unwrap();
        let actual = t.stored_bytes() as f64;
        let b = t.size_breakdown().unwrap();
        assert_eq!(b.total(), t.stored_bytes());
        eprintln!(
            "{payload:?} {coding:?}: predicted/actual − 1 = {:+.4}%",
            100.0 * (predicted / actual - 1.0)
        );
        assert!(
            (predicted - actual).abs() / actual < 0.01,
            "{payload:?} {coding:?}: predicted {predicted}, actual {actual}, {b:?}"
        );
    }
}

#[test]
fn chosen_coding_is_the_smallest_of_its_candidates_and_round_trips() {
    let (rows, cols) = (128, 1024);
    let bytes = gaussian_bf16(rows * cols, 0.02, 8);
    let (codes, raw) = Payload::Bf16.symbolize(&bytes).unwrap();
    let (coding, predicted) = choose_coding(Payload::Bf16, rows, cols, &codes, 1024).unwrap();
    let t = roundtrip(Payload::Bf16, rows, cols, &bytes, coding).unwrap();
    assert!((predicted - t.stored_bytes() as f64).abs() / (t.stored_bytes() as f64) < 0.01);
    for other in [
        Coding {
            mode: Mode::Single,
            log2_m: 12,
            sc: 1024,
            t: None,
        },
        Coding {
            mode: Mode::Pair,
            log2_m: 8,
            sc: 1024,
            t: Some(16),
        },
    ] {
        let o = DtansTensor::encode(Payload::Bf16, rows, cols, &codes, &raw, other).unwrap();
        assert!(
            o.stored_bytes() >= t.stored_bytes(),
            "{other:?} is smaller than the chosen {coding:?}"
        );
    }
    assert_eq!(default_slice_width(4096), 2048);
    assert_eq!(default_slice_width(14336), 2048);
    assert_eq!(default_slice_width(576), 64);
    assert_eq!(default_slice_width(100), 128);
}

#[test]
fn plan_key_slots_follow_the_table() {
    let bytes = gaussian_bf16(100 * 300, 0.02, 11);
    let (codes, raw) = Payload::Bf16.symbolize(&bytes).unwrap();
    for (mode, t) in [(Mode::Single, None), (Mode::Pair, Some(12))] {
        let coding = Coding {
            mode,
            log2_m: 10,
            sc: 128,
            t,
        };
        let plan = EncodePlan::new(Payload::Bf16, 100, 300, &codes, coding).unwrap();
        let ks = plan.key_slots();
        assert_eq!(ks.len(), 1 << coding.key_bits(Payload::Bf16));
        let mut start = 0u32;
        for (&s, &r) in plan.table.symbols.iter().zip(&plan.table.counts) {
            assert_eq!(ks[s as usize], start | (r as u32) << 16);
            start += r as u32;
        }
        // Every symbol owns a slot, so only keys without a symbol read 0.
        assert_eq!(
            ks.iter().filter(|&&k| k != 0).count(),
            plan.table.symbols.len()
        );
        // The planned path is the encoder's.
        assert_eq!(
            DtansTensor::encode_planned(&plan, &codes, &raw).unwrap(),
            DtansTensor::encode(Payload::Bf16, 100, 300, &codes, &raw, coding).unwrap()
        );
        assert!(DtansTensor::encode_planned(&plan, &codes[1..], &raw).is_err());
        assert!(DtansTensor::encode_planned(&plan, &codes, &raw[1..]).is_err());
    }
    assert!(EncodePlan::new(
        Payload::Bf16,
        100,
        301,
        &codes,
        Coding {
            mode: Mode::Single,
            log2_m: 8,
            sc: 64,
            t: None
        }
    )
    .is_err());
}

/// The tuple histogram (blocked, with a fast path for whole tuples) equals a plain count over the
/// padded grid, padding included, on ragged shapes of every tuple width.
#[test]
fn tuple_histogram_counts_every_padded_tuple() {
    use super::encode::{choose_values, tuple_histogram};
    let mut r = Rng::new(11);
    for (rows, cols) in [
        (1, 3),
        (5, 70),
        (33, 129),
        (64, 4096),
        (40, 1000),
        (2100, 2048),
    ] {
        for payload in [Payload::Bf16, Payload::Fp8E4m3, Payload::Int(4)] {
            let alphabet = payload.alphabet() as u64;
            let codes: Vec<u8> = (0..rows * cols)
                .map(|_| (r.next_u64() % alphabet.min(40)) as u8)
                .collect();
            for mode in [Mode::Pair, Mode::Quad] {
                let k = mode.values_per_symbol();
                if k as u32 * payload.code_bits() > 16 {
                    continue;
                }
                let coding = Coding {
                    mode,
                    log2_m: 10,
                    sc: default_slice_width(cols),
                    t: Some(6),
                };
                let g = Geometry::new(payload, &coding, rows, cols).unwrap();
                let hist = byte_histogram(&codes);
                let (coded_as, _, pad) = choose_values(payload, &hist, coding.t);
                let key_bits = coding.key_bits(payload);
                let got = tuple_histogram(&g, payload, &codes, &hist, &coded_as, pad, key_bits);
                let cb = payload.code_bits();
                let mut want = vec![0u64; 1 << key_bits];
                let padded = g.slices * g.sc;
                for row in 0..g.bands * LANES {
                    for p in 0..padded / k {
                        let key = (0..k).fold(0usize, |key, j| {
                            let col = p * k + j;
                            let c = match row < rows && col < cols {
                                true => coded_as[codes[row * cols + col] as usize],
                                false => pad,
                            };
                            key | (c as usize) << (j as u32 * cb)
                        });
                        want[key] += 1;
                    }
                }
                assert!(got == want, "{rows}×{cols} {payload:?} {mode:?}");
            }
        }
    }
}

/// One pass gives the decode and the size breakdown that two passes give.
#[test]
fn decode_with_breakdown_is_decode_and_size_breakdown() {
    for (rows, cols, coding) in [
        (40, 300, "pair:10:128:32"),
        (7, 4096, "single:8:512"),
        (70, 640, "pair:12:128:64"),
    ] {
        let bytes = gaussian_bf16(rows * cols, 0.02, rows as u64);
        let (codes, raw) = Payload::Bf16.symbolize(&bytes).unwrap();
        let c = Coding::parse(coding).unwrap().unwrap();
        let t = match DtansTensor::encode(Payload::Bf16, rows, cols, &codes, &raw, c) {
            Ok(t) => t,
            Err(e) if legit_refusal(&e) => continue,
            Err(e) => panic!("{coding}: {e}"),
        };
        let (decoded, b) = t.decode_with_breakdown().unwrap();
        assert_eq!(decoded, bytes);
        assert_eq!(b, t.size_breakdown().unwrap());
    }
}

/// The fast CPU product (portable and AVX-512) against the reference decode-matvec, on fresh
/// random tensors of every payload without raw bytes, every mode a payload allows, table sizes,
/// slice widths, escapes, ragged shapes, and group scales (signed and unsigned, with mins and
/// offsets, group sizes that do and do not fall on symbol boundaries) or none.
#[test]
fn fast_product_matches_the_reference() {
    let mut r = Rng::new(0x5eed_f457);
    let payloads = [
        Payload::Fp8E4m3,
        Payload::Fp8E5m2,
        Payload::Fp4E2m1,
        Payload::Int(2),
        Payload::Int(3),
        Payload::Int(4),
        Payload::Int(5),
        Payload::Int(8),
    ];
    let shapes = [
        (1, 1),
        (32, 64),
        (33, 70),
        (45, 200),
        (70, 576),
        (5, 1030),
        (64, 256),
    ];
    let mut cases = 0;
    for (pi, &payload) in payloads.iter().enumerate() {
        for (si, &(rows, cols)) in shapes.iter().enumerate() {
            let seed = r.next_u64();
            let kind = (pi + si) as u8 % 4;
            let bytes = elements(payload, rows * cols, kind.max(1), seed);
            let (codes, raw) = payload.symbolize(&bytes).unwrap();
            let modes: Vec<Mode> = [Mode::Single, Mode::Pair, Mode::Quad]
                .into_iter()
                .filter(|m| m.values_per_symbol() as u32 * payload.code_bits() <= 16)
                .collect();
            let mode = modes[(r.next_u64() % modes.len() as u64) as usize];
            let log2_m = TABLE_LOG2[(r.next_u64() % 4) as usize];
            let sc = [64, 128, 256, 512][(r.next_u64() % 4) as usize];
            // Few kept values: escapes.
            let t = match r.next_u64() % 3 {
                0 => None,
                _ => Some((2 + r.next_u64() % 6).min(payload.alphabet() as u64) as u16),
            };
            let coding = Coding {
                mode,
                log2_m,
                sc,
                t,
            };
            let Ok(tensor) = DtansTensor::encode(payload, rows, cols, &codes, &raw, coding) else {
                // A table of kept tuples that cannot fit M (the coder says so); not this test's.
                continue;
            };
            let fast = CpuProduct::new(&tensor).unwrap().expect("no raw bytes");
            let x: Vec<f32> = (0..cols).map(|_| r.normal() as f32).collect();
            for group in [cols, 32, 96, 3, 1] {
                let n = rows * cols.div_ceil(group);
                let scales: Vec<f32> = (0..n).map(|_| r.unit() as f32 + 0.1).collect();
                let mins: Vec<f32> = (0..n).map(|_| r.normal() as f32).collect();
                let with_mins = r.next_u64().is_multiple_of(2);
                let dqs = [
                    Dequant::None,
                    Dequant::Groups {
                        group,
                        scales: &scales,
                        mins: with_mins.then_some(&mins[..]),
                        offset: if with_mins { 0.0 } else { 2.0 },
                        signed: matches!(payload, Payload::Int(_))
                            && !r.next_u64().is_multiple_of(4),
                    },
                ];
                for dq in &dqs {
                    let mut want = vec![0f32; rows];
                    tensor.matvec(&x, &mut want, dq).unwrap();
                    // The sum of |w·x|, what f32 rounding is relative to.
                    let mut scale = vec![0f64; rows];
                    let mut wrow = vec![0f32; cols];
                    for (row, s) in scale.iter_mut().enumerate() {
                        tensor.row_f32(row, &mut wrow).unwrap();
                        *s = wrow
                            .iter()
                            .enumerate()
                            .map(|(c, &v)| {
                                (dq.apply(payload, row, c, cols, v) as f64 * x[c] as f64).abs()
                            })
                            .sum::<f64>();
                    }
                    for simd in [false, true] {
                        let mut got = vec![f32::NAN; rows];
                        fast.matvec(&tensor, &x, &mut got, dq, simd).unwrap();
                        for row in 0..rows {
                            let (g, w) = (got[row] as f64, want[row] as f64);
                            assert!(
                                (g - w).abs() <= 1e-5 * scale[row] + 1e-30
                                    || g.to_bits() == w.to_bits(),
                                "{payload:?} {rows}x{cols} {coding} group {group} simd {simd} \
                                 row {row}: {g} vs {w} (scale {})",
                                scale[row]
                            );
                        }
                    }
                    cases += 1;
                }
            }
        }
    }
    assert!(cases > 300, "only {cases} cases ran");
}

/// The fast product reports a corrupt stream as the reference does, as an error.
#[test]
fn fast_product_errors_on_corrupt_streams() {
    let payload = Payload::Int(4);
    let (rows, cols) = (45, 300);
    let bytes = elements(payload, rows * cols, 2, 77);
    let (codes, raw) = payload.symbolize(&bytes).unwrap();
    let coding = Coding {
        mode: Mode::Pair,
        log2_m: 10,
        sc: 128,
        t: Some(6),
    };
    let good = DtansTensor::encode(payload, rows, cols, &codes, &raw, coding).unwrap();
    let x = vec![1f32; cols];
    let mut r = Rng::new(5);
    let mut errors = 0;
    for _ in 0..300 {
        let mut t = good.clone();
        let i = (r.next_u64() % t.stream.len() as u64) as usize;
        t.stream[i] ^= 1 << (r.next_u64() % 32);
        let Ok(Some(fast)) = CpuProduct::new(&t) else {
            continue;
        };
        let mut y = vec![0f32; rows];
        for simd in [false, true] {
            let want = t.matvec(&x, &mut y, &Dequant::None).is_err();
            let got = fast.matvec(&t, &x, &mut y, &Dequant::None, simd).is_err();
            assert_eq!(got, want, "flip at word {i}: simd {simd}");
            errors += got as usize;
        }
    }
    assert!(errors > 0, "no corruption was detected");
}
