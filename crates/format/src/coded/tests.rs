use super::ggml_scales::scale_bytes;
use super::*;
use crate::ggml_blocks::{has_m, QK};
use crate::kquants::{FieldKind, Split};
use crate::qtype::GgmlType;

use crate::ggml_blocks::unpack_codes;
use entrollm_codec::dtans::{Coding, Mode};
use serde_json::json;
use std::collections::BTreeMap;

/// A Q4_1 tensor of `rows × cols` weights with skewed codes and arbitrary scales.
fn q4_1_blocks(rows: usize, cols: usize) -> Vec<u8> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut out = Vec::new();
    for _ in 0..rows * cols / QK {
        out.extend_from_slice(&(next() as u16 & 0x3bff).to_le_bytes());
        out.extend_from_slice(&(next() as u16 | 0x8000).to_le_bytes());
        // Two nibbles per byte, biased towards the middle codes.
        out.extend((0..16).map(|_| {
            let n = |r: u64| (6 + (r % 5) as u8) & 0x0f;
            let r = next();
            n(r) | (n(r >> 8) << 4)
        }));
    }
    out
}

fn stored<'a>(
    coded: &'a Coded,
    arrays: &'a [(String, ArrayDtype, Cow<'a, [u8]>)],
    params: &'a Value,
) -> CodedTensor<'a> {
    CodedTensor {
        coder: coded.coder(),
        params,
        arrays: arrays
            .iter()
            .map(|(n, d, b)| (n.as_str(), (*d, &b[..])))
            .collect::<BTreeMap<_, _>>(),
    }
}

/// A scalar-quantised matrix through the container's arrays and params and back (scales raw
/// and dtANS-coded); params or arrays that disagree with the tensor are errors, not panics.
#[test]
fn scalar_codes_round_trip_and_hostile_params_are_errors() {
    use entrollm_codec::lossy::scalar::{encode, Scalar};
    let mut s = 0x1234_5678u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    };
    for (rows, cols, q) in [
        (64, 256, Scalar::Fp8),
        (
            256,
            512,
            Scalar::Int {
                group: 32,
                dead_zone: 0.0,
            },
        ),
    ] {
        let w: Vec<f32> = (0..rows * cols).map(|_| next() + next() + next()).collect();
        let (tensor, _) = encode(&w, rows, cols, q, 3.0, None).unwrap();
        let coded = Coded::new(ScalarCoded {
            dtype: Dtype::BF16,
            tensor,
        });
        let want = coded.decode().unwrap();
        let arrays = coded.arrays();
        let params = coded.params(json!({}));
        let back = Coded::from_stored(
            Dtype::BF16,
            &[rows, cols],
            &stored(&coded, &arrays, &params),
        )
        .unwrap();
        assert_eq!(back.decode().unwrap(), want);
        assert_eq!(back.stored_bytes(), coded.stored_bytes());
        let fails = |dtype: Dtype, shape: &[usize], params: &Value| {
            Coded::from_stored(dtype, shape, &stored(&coded, &arrays, params)).is_err()
        };
        assert!(fails(Dtype::U8, &[rows, cols], &params));
        assert!(fails(Dtype::BF16, &[rows, cols + 1], &params));
        for (key, bad) in [
            ("group", json!(7)),
            ("group", json!(0)),
            ("group", json!("x")),
            ("quantizer", json!("e8")),
            (
                "scales",
                json!({"n": 1usize << 40, "stream": params["codes"].clone()}),
            ),
        ] {
            let mut p = params.clone();
            p[key] = bad;
            assert!(fails(Dtype::BF16, &[rows, cols], &p), "{key}");
        }
        // A quantiser that disagrees with the codes' payload.
        let mut p = params.clone();
        p["quantizer"] = json!(if q == Scalar::Fp8 { "int-g32" } else { "fp8" });
        assert!(fails(Dtype::BF16, &[rows, cols], &p));
    }
}

/// Blocks of every type with few distinct scales (as a quantiser's are: a narrow range of
/// magnitudes), random code bytes; rows × cols weights.
fn blocks(block: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut out = Vec::new();
    for _ in 0..rows * cols / QK {
        // f16 scales in [2^-8, 2^-6): exponent 7..8, the mantissa's top bits varying.
        let mut scale = || 0x1c00u16 + (next() % 0x600) as u16;
        out.extend_from_slice(&scale().to_le_bytes());
        if has_m(block) {
            out.extend_from_slice(&(scale() | 0x8000).to_le_bytes());
        }
        out.extend((0..block.type_size() - scale_bytes(block)).map(|_| next() as u8));
    }
    out
}

/// Blocks of `ty` as a quantiser writes them: codes peaked at the middle of their range,
/// super-scales of a narrow range, sub-block scales skewed; `rows × cols` weights.
fn kblocks(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let n = rows * cols / ty.block_size();
    let bits = ty.code_bits();
    let mid = 1u64 << (bits - 1);
    let codes: Vec<u8> = (0..rows * cols)
        .map(|_| {
            // A sum of three uniforms: peaked at the middle code.
            let r = next();
            let spread = 1u64 << bits.saturating_sub(2);
            let v = mid + (r % spread) + ((r >> 16) % spread) + ((r >> 32) % spread);
            (v - (3 * spread / 2).min(v)).min((1 << bits) - 1) as u8
        })
        .collect();
    let fields = ty
        .fields()
        .iter()
        .map(|f| {
            (0..n * f.per_block)
                .map(|_| match f.kind {
                    FieldKind::Half => 0x1c00u16 + (next() % 0x300) as u16,
                    FieldKind::Bits(b) => {
                        let top = (1u64 << b) - 1;
                        (top / 2 + next() % (top / 4 + 1)).min(top) as u16
                    }
                })
                .collect()
        })
        .collect();
    crate::kquants::join(&Split { ty, codes, fields }).unwrap()
}

#[test]
fn split_blocks_round_trip_through_the_container_for_every_type() {
    for (i, ty) in GgmlType::ALL.into_iter().filter(|t| t.splits()).enumerate() {
        let w = ty.block_size();
        for (rows, cols) in [(1, w), (3, 3 * w), (37, 2 * w), (256, 1024)] {
            for noise in [false, true] {
                let bytes = match noise {
                    false => kblocks(ty, rows, cols, 11 + i as u64),
                    // Uniform bytes: nothing codes smaller, everything is stored packed.
                    true => kblocks(ty, 1, w, 1)
                        .iter()
                        .cycle()
                        .zip(0u64..)
                        .map(|(_, k)| (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
                        .take(rows * cols / w * ty.type_size())
                        .collect(),
                };
                let what = format!("{ty:?} {rows}x{cols} noise {noise}");
                let (b, _) = BlocksCoded::encode(ty, rows, cols, &bytes, None).unwrap();
                let coded = Coded::new(b);
                assert_eq!(coded.decode().unwrap(), bytes, "{what}");
                let params = coded.params(json!({}));
                let arrays = coded.arrays();
                let shape = BlocksCoded::stored_shape(ty, rows, cols);
                let back = Coded::from_stored(Dtype::U8, &shape, &stored(&coded, &arrays, &params))
                    .unwrap();
                assert_eq!(back.decode().unwrap(), bytes, "{what} stored");
                let actual = coded.stored_bytes() as f64;
                // Packed streams never cost more than the blocks.
                assert!(actual <= bytes.len() as f64 + 8.0, "{what}: {actual}");
                let (predicted, h) = BlocksCoded::predict(ty, rows, cols, &bytes).unwrap();
                assert!(
                    (predicted - actual).abs() <= 0.05 * actual + 1024.0,
                    "{what}: predicted {predicted}, stored {actual}"
                );
                if rows * cols >= 256 * 1024 && !noise {
                    assert!(actual < 0.9 * bytes.len() as f64, "{what}: {actual}");
                    let bpw = actual * 8.0 / (rows * cols) as f64;
                    assert!(bpw >= h.bound_bpw() - 0.01, "{what}: {bpw} below the bound");
                }
            }
        }
    }
}

#[test]
fn damaged_split_blocks_are_errors() {
    let (ty, rows, cols) = (GgmlType::Q4_K, 64, 1024);
    let bytes = kblocks(ty, rows, cols, 5);
    let coded = Coded::new(BlocksCoded::encode(ty, rows, cols, &bytes, None).unwrap().0);
    let params = coded.params(json!({}));
    let arrays = coded.arrays();
    let shape = BlocksCoded::stored_shape(ty, rows, cols);
    let err = |p: &Value, a: &[(String, ArrayDtype, Cow<'_, [u8]>)], shape: &[usize]| {
        match Coded::from_stored(Dtype::U8, shape, &stored(&coded, a, p)) {
            Err(e) => e.to_string(),
            Ok(c) => match c.decode() {
                Err(e) => e.to_string(),
                Ok(b) => panic!("accepted; decodes {} bytes", b.len()),
            },
        }
    };
    assert!(err(&params, &arrays, &[rows, 1]).contains("stored as U8"));
    let mut p = params.clone();
    p["type"] = json!("Q9_K");
    assert!(err(&p, &arrays, &shape).contains("block type"));
    let mut p = params.clone();
    p["rows"] = json!(rows + 32);
    assert!(err(&p, &arrays, &shape).contains("stored as U8"));
    each_array_is_needed(&arrays, |a| err(&params, a, &shape));
    assert!(
        params["codes"].get("packed").is_none(),
        "skewed codes code smaller"
    );
    let mut p = params.clone();
    p["codes"] = json!({ "packed": true });
    assert!(err(&p, &arrays, &shape).contains("'codes'"));
    let mut p = params.clone();
    p["fields"]["sc"] = json!({ "dtans": true });
    assert!(err(&p, &arrays, &shape).contains("'sc'"));
}

type ArraySlice<'a> = [(String, ArrayDtype, Cow<'a, [u8]>)];

/// Every array of a coded tensor is needed (reading without it is an error naming it), and
/// one cut short is an error; `err` reads a tensor of these arrays.
fn each_array_is_needed(arrays: &ArraySlice<'_>, err: impl Fn(&ArraySlice<'_>) -> String) {
    for (name, ..) in arrays {
        let without: Vec<_> = arrays.iter().filter(|(n, ..)| n != name).cloned().collect();
        assert!(err(&without).contains(name.as_str()), "{name}");
        let cut: Vec<_> = arrays
            .iter()
            .map(|(n, d, b)| match n == name {
                true => (n.clone(), *d, Cow::Owned(b[..b.len() / 2 / 4 * 4].to_vec())),
                false => (n.clone(), *d, b.clone()),
            })
            .collect();
        assert!(!err(&cut).is_empty(), "{name} cut");
    }
}

/// Bytes of `n` 4-bit codes skewed around 8 (a quantiser's), packed two a byte.
fn skewed_nibbles(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut code = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        // A sum of three uniforms: near-Gaussian codes in 0..=15.
        let v = (s & 7) + (s >> 8 & 7) + (s >> 16 & 3);
        v as u8
    };
    (0..n / 2).map(|_| code() | code() << 4).collect()
}

#[test]
fn fields_round_trip_at_every_width_through_the_container() {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut rand = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect()
    };
    let cases: Vec<(Dtype, Vec<usize>, Vec<u8>)> = vec![
        (Dtype::I32, vec![64, 96], skewed_nibbles(64 * 96 * 8, 1)),
        (Dtype::I32, vec![3, 5], rand(60)),
        (Dtype::U8, vec![1], rand(1)),
        (Dtype::F16, vec![7, 9], rand(126)),
        (Dtype::I32, vec![0, 4], Vec::new()),
        (Dtype::I64, vec![33], vec![0; 264]),
    ];
    for (dtype, shape, bytes) in &cases {
        for bits in FIELD_WIDTHS {
            if (bytes.len() * 8) % bits as usize != 0 {
                assert!(FieldsCoded::encode(bytes, bits).is_err());
                continue;
            }
            let f = FieldsCoded::encode(bytes, bits).unwrap();
            let (predicted, _) = FieldsCoded::predict(bytes, bits).unwrap();
            assert!(
                (predicted - f.stored_bytes() as f64).abs() <= 64.0 + 0.01 * bytes.len() as f64,
                "{dtype:?} {bits}: predicted {predicted}, stored {}",
                f.stored_bytes()
            );
            let coded = Coded::new(f);
            let params = coded.params(json!({}));
            let arrays = coded.arrays();
            let back =
                Coded::from_stored(*dtype, shape, &stored(&coded, &arrays, &params)).unwrap();
            assert_eq!(&back.decode().unwrap(), bytes, "{dtype:?} {shape:?} {bits}");
        }
    }
    // Packed 4-bit codes code near their entropy at their width, and smaller than at others.
    let bytes = &cases[0].2;
    let (best, h) = FIELD_WIDTHS[..4]
        .iter()
        .map(|&b| (b, FieldsCoded::encode(bytes, b).unwrap().stored_bytes()))
        .min_by_key(|&(_, n)| n)
        .map(|(b, _)| (b, FieldsCoded::predict(bytes, b).unwrap().1))
        .unwrap();
    assert_eq!(best, 4);
    let f = FieldsCoded::encode(bytes, 4).unwrap();
    let per_code = f.stored_bytes() as f64 * 8.0 / (bytes.len() * 2) as f64;
    assert!(per_code < h + 0.01, "{per_code} bits a code, entropy {h}");
}

#[test]
fn damaged_fields_are_errors() {
    let bytes = skewed_nibbles(20_000, 3);
    let coded = Coded::new(FieldsCoded::encode(&bytes, 4).unwrap());
    let params = coded.params(json!({}));
    let arrays = coded.arrays();
    let shape = [bytes.len() / 4];
    let err = |p: &Value, a: &[(String, ArrayDtype, Cow<'_, [u8]>)], shape: &[usize]| {
        match Coded::from_stored(Dtype::I32, shape, &stored(&coded, a, p)) {
            Err(e) => e.to_string(),
            Ok(c) => match c.decode() {
                Err(e) => e.to_string(),
                Ok(b) => panic!("accepted; decodes {} bytes", b.len()),
            },
        }
    };
    each_array_is_needed(&arrays, |a| err(&params, a, &shape));
    let e = err(&params, &arrays, &[shape[0] + 1]);
    assert!(e.contains("fields"), "{e}");
    for bad in [json!(3), json!(32), json!("4"), Value::Null] {
        let mut p = params.clone();
        p["bits"] = bad;
        assert!(err(&p, &arrays, &shape).contains("bits"));
    }
    let mut p = params.clone();
    p["stream"] = json!({ "dtans": true });
    assert!(err(&p, &arrays, &shape).contains("neither"));
}

/// BF16/F16 bytes of `n` weights ~ N(0, 0.02²), with every special value planted (zeros of
/// both signs, infinities, NaNs, subnormals) so the codes' split is checked at the edges.
fn float_bytes(payload: Payload, n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut unif = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut v: Vec<u16> = (0..n)
        .map(|_| {
            let (a, b) = (unif().max(1e-300), unif());
            let x = (0.02 * (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32;
            match payload {
                Payload::Bf16 => half::bf16::from_f32(x).to_bits(),
                _ => half::f16::from_f32(x).to_bits(),
            }
        })
        .collect();
    let specials = [
        0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x8001, 0x7C00, 0xFFFF,
    ];
    for (i, &x) in specials.iter().enumerate().take(n) {
        v[i * 7 % n] = x;
    }
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Narrow float matrices: rANS over the codes beside the raw bytes decodes bit for bit through
/// the container, within 0.02 bit a weight of the bound at 384 × 384, its size as predicted.
#[test]
fn floats_round_trip_through_the_container_at_their_bound() {
    for (payload, dtype) in [(Payload::Bf16, Dtype::BF16), (Payload::Fp16, Dtype::F16)] {
        for (rows, cols) in [(384, 384), (3, 5), (1, 1)] {
            let bytes = float_bytes(payload, rows * cols, rows as u64);
            let f = FloatsCoded::encode(payload, &bytes).unwrap();
            let (codes, _) = payload.symbolize(&bytes).unwrap();
            let predicted = FloatsCoded::predict(payload, &codes).unwrap();
            assert!(
                (predicted - f.stored_bytes() as f64).abs() <= 64.0 + 0.001 * bytes.len() as f64,
                "{dtype:?}: predicted {predicted}, stored {}",
                f.stored_bytes()
            );
            if rows * cols > 1000 {
                use entrollm_codec::histogram::{byte_histogram, entropy_bits};
                let n = (rows * cols) as f64;
                let bound = entropy_bits(&byte_histogram(&codes)) + 8.0;
                let bpw = f.stored_bytes() as f64 * 8.0 / n;
                assert!(
                    bpw < bound + 0.02,
                    "{dtype:?}: {bpw} bits a weight, bound {bound}"
                );
                assert_eq!(f.coding(), "rans");
            }
            let coded = Coded::new(f);
            let params = coded.params(json!({}));
            let arrays = coded.arrays();
            let shape = [rows, cols];
            let back = Coded::from_stored(dtype, &shape, &stored(&coded, &arrays, &params));
            assert_eq!(
                back.unwrap().decode().unwrap(),
                bytes,
                "{dtype:?} {rows}x{cols}"
            );
        }
    }
    assert!(FloatsCoded::encode(Payload::Fp8E4m3, &[1, 2]).is_err());
}

#[test]
fn damaged_floats_are_errors() {
    let bytes = float_bytes(Payload::Bf16, 384 * 64, 9);
    let coded = Coded::new(FloatsCoded::encode(Payload::Bf16, &bytes).unwrap());
    let params = coded.params(json!({}));
    let arrays = coded.arrays();
    let shape = [384, 64];
    let err =
        |p: &Value, a: &ArraySlice<'_>, shape: &[usize], dtype: Dtype| match Coded::from_stored(
            dtype,
            shape,
            &stored(&coded, a, p),
        ) {
            Err(e) => e.to_string(),
            Ok(c) => match c.decode() {
                Err(e) => e.to_string(),
                Ok(b) => panic!("accepted; decodes {} bytes", b.len()),
            },
        };
    each_array_is_needed(&arrays, |a| err(&params, a, &shape, Dtype::BF16));
    assert!(err(&params, &arrays, &[384, 65], Dtype::BF16).contains("raw"));
    assert!(err(&params, &arrays, &shape, Dtype::F32).contains("BF16 and F16"));
    let mut p = params.clone();
    p["stream"] = json!({ "dtans": true });
    assert!(err(&p, &arrays, &shape, Dtype::BF16).contains("neither"));
}

#[test]
fn scales_alone_round_trip_for_every_block_type() {
    for (i, block) in GgmlType::ALL
        .into_iter()
        .filter(|&t| crate::ggml_blocks::handles(t))
        .enumerate()
    {
        for (rows, cols) in [(1, 32), (3, 96), (70, 576), (257, 1024)] {
            let bytes = blocks(block, rows, cols, 7 + i as u64);
            let g = GgmlScales::encode(block, rows, cols, &bytes).unwrap();
            let coded = Coded::new(g);
            assert_eq!(coded.decode().unwrap(), bytes, "{block:?} {rows}x{cols}");
            let params = coded.params(json!({}));
            let arrays = coded.arrays();
            let shape = GgmlCoded::stored_shape(block, rows, cols);
            let back =
                Coded::from_stored(Dtype::U8, &shape, &stored(&coded, &arrays, &params)).unwrap();
            assert_eq!(
                back.decode().unwrap(),
                bytes,
                "{block:?} {rows}x{cols} stored"
            );
            let predicted = GgmlScales::predict_bytes(block, &bytes).unwrap();
            let actual = coded.stored_bytes() as f64;
            assert!(
                (predicted - actual).abs() <= 0.05 * actual + 256.0,
                "{block:?} {rows}x{cols}: predicted {predicted}, stored {actual}"
            );
            // Thousands of scales of a narrow range code smaller than they are.
            if rows * cols >= 257 * 1024 {
                assert!(actual < bytes.len() as f64, "{block:?} {rows}x{cols}");
            }
        }
    }
}

#[test]
fn damaged_scale_streams_are_errors() {
    let (block, rows, cols) = (GgmlType::Q4_1, 70, 576);
    let bytes = blocks(block, rows, cols, 3);
    let coded = Coded::new(GgmlScales::encode(block, rows, cols, &bytes).unwrap());
    let params = coded.params(json!({}));
    let arrays = coded.arrays();
    let shape = GgmlCoded::stored_shape(block, rows, cols);
    let err = |p: &Value, a: &[(String, ArrayDtype, Cow<'_, [u8]>)]| match Coded::from_stored(
        Dtype::U8,
        &shape,
        &stored(&coded, a, p),
    ) {
        Err(e) => e.to_string(),
        Ok(c) => match c.decode() {
            Err(e) => e.to_string(),
            Ok(b) => panic!("accepted; decodes {} bytes", b.len()),
        },
    };
    let without =
        |name: &str| -> Vec<_> { arrays.iter().filter(|a| a.0 != name).cloned().collect() };
    assert!(err(&params, &without("rest")).contains("'rest'"));
    assert!(err(&params, &without("m_stream")).contains("m_stream"));
    let mut short = arrays.clone();
    let r = short.iter_mut().find(|a| a.0 == "rest").unwrap();
    r.2 = Cow::Owned(r.2[1..].to_vec());
    assert!(err(&params, &short).contains("'rest'"));
    let mut p = params.clone();
    p["rows"] = json!(rows + 1);
    assert!(err(&p, &arrays).contains("stored as U8"));
    let mut p = params.clone();
    p["d"]["rows"] = json!(1);
    assert!(err(&p, &arrays).contains("scale stream 'd'"));
    let mut p = params.clone();
    p.as_object_mut().unwrap().remove("m");
    assert!(err(&p, &arrays).contains("bad dtans params"));
    // A flipped byte in a coded stream: an error or different scales, never a panic (the
    // container's checksum of the decoded tensor then names it).
    let mut flipped = arrays.clone();
    let st = flipped.iter_mut().find(|a| a.0 == "d_stream").unwrap();
    let mut b = st.2.to_vec();
    b[5] ^= 0x40;
    st.2 = Cow::Owned(b);
    if let Ok(c) = Coded::from_stored(Dtype::U8, &shape, &stored(&coded, &flipped, &params)) {
        assert!(c.decode().map_or(true, |d| d != bytes));
    }
}

#[test]
fn ggml_blocks_round_trip_through_the_container_arrays() {
    let (rows, cols) = (40, 96);
    let bytes = q4_1_blocks(rows, cols);
    let q = unpack_codes(GgmlType::Q4_1, &bytes).unwrap();
    let coding = Coding {
        mode: Mode::Pair,
        log2_m: 10,
        sc: 64,
        t: None,
    };
    let codes = DtansTensor::encode(Payload::Int(4), rows, cols, &q.codes, &[], coding).unwrap();
    let coded = Coded::new(GgmlCoded {
        block: GgmlType::Q4_1,
        codes,
        d: q.d,
        m: q.m,
    });
    assert_eq!(coded.decode().unwrap(), bytes);
    let params = coded.params(json!({}));
    assert_eq!(params["block"], "Q4_1");
    let arrays = coded.arrays();
    let shape = GgmlCoded::stored_shape(GgmlType::Q4_1, rows, cols);
    assert_eq!(shape, [rows, cols / 32 * 20]);
    let c = stored(&coded, &arrays, &params);
    let back = Coded::from_stored(Dtype::U8, &shape, &c).unwrap();
    assert_eq!(back.decode().unwrap(), bytes);

    // Wrong shape, dtype, block type or scale count: clear errors, no panics.
    let err = |dtype, shape: &[usize], c: &CodedTensor| {
        Coded::from_stored(dtype, shape, c)
            .expect_err("rejected")
            .to_string()
    };
    assert!(err(Dtype::U8, &[rows, 61], &c).contains("stored as U8"));
    assert!(err(Dtype::F16, &shape, &c).contains("F16"));
    let mut p = params.clone();
    p["block"] = json!("Q8_0");
    assert!(err(Dtype::U8, &shape, &stored(&coded, &arrays, &p)).contains("8-bit"));
    p["block"] = json!("Q9_9");
    assert!(err(Dtype::U8, &shape, &stored(&coded, &arrays, &p)).contains("block type"));
    let mut short = arrays.clone();
    let m = short.iter_mut().find(|a| a.0 == "m").unwrap();
    m.2 = Cow::Owned(m.2[2..].to_vec());
    assert!(err(Dtype::U8, &shape, &stored(&coded, &short, &params)).contains("'m'"));
    let no_m: Vec<_> = arrays.iter().filter(|a| a.0 != "m").cloned().collect();
    assert!(err(Dtype::U8, &shape, &stored(&coded, &no_m, &params)).contains("no 'm'"));
}

/// A coded tensor is found again as its coder's type, and as no other.
#[test]
fn coded_tensors_downcast_to_their_coders_type_only() {
    let bytes = q4_1_blocks(4, 64);
    let f = FieldsCoded::encode(&bytes, 4).unwrap();
    let n = f.stored_bytes();
    let coded = Coded::new(f);
    assert_eq!(coded.coder(), RANS_FIELDS);
    assert_eq!(
        coded.downcast_ref::<FieldsCoded>().unwrap().stored_bytes(),
        n
    );
    assert!(coded.downcast_ref::<FloatsCoded>().is_none());
    let coded = coded.downcast::<LossyCoded>().unwrap_err();
    assert_eq!(coded.downcast::<FieldsCoded>().unwrap().stored_bytes(), n);
}
