//! GGUF reader: golden files written by gguf-py (tools/gen_gguf_testdata.py) and malformed inputs.

use entrollm_model::gguf::{pack_codes, GgmlType, GgufFile, GgufWriter, MetaArray, MetaValue};
use entrollm_model::ModelError;
use std::path::PathBuf;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

#[test]
fn dequantisation_matches_gguf_py_for_every_supported_type() {
    let file = GgufFile::open(data("gguf_dequant.gguf")).unwrap();
    let mut checked = Vec::new();
    for info in file
        .tensors()
        .iter()
        .filter(|t| !t.name.ends_with(".expected"))
    {
        assert_eq!(
            info.name,
            info.ggml_type.name(),
            "tensors are named after their type"
        );
        assert_eq!(info.dims, vec![256, 2]);
        assert_eq!(info.hf_shape(), vec![2, 256]);
        let ours = file.tensor_f32(&info.name).unwrap();
        let expected = file.tensor_f32(&format!("{}.expected", info.name)).unwrap();
        assert_eq!(ours.len(), 512);
        for (i, (a, b)) in ours.iter().zip(&expected).enumerate() {
            assert!(a.is_finite(), "{} element {i} is {a}", info.name);
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{} element {i}: ours {a}, gguf-py {b}",
                info.name
            );
        }
        checked.push(info.ggml_type);
    }
    let mut expected_types = entrollm_model::gguf::DEQUANTIZABLE.to_vec();
    expected_types.sort_by_key(|t| t.id());
    checked.sort_by_key(|t| t.id());
    assert_eq!(checked, expected_types);
}

#[test]
fn raw_codes_repack_to_the_file_bytes() {
    let file = GgufFile::open(data("gguf_dequant.gguf")).unwrap();
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
    ] {
        let info = file.tensor_info(ty.name()).unwrap();
        let codes = file.tensor_codes(ty.name()).unwrap();
        assert_eq!(codes.codes.len(), 512);
        assert_eq!(pack_codes(&codes).unwrap(), file.tensor_data(info), "{ty}");
    }
    assert!(matches!(
        file.tensor_codes("Q4_K"),
        Err(ModelError::Unsupported(_))
    ));
    assert!(matches!(
        file.tensor_codes("nope"),
        Err(ModelError::Tensor { .. })
    ));
}

#[test]
fn mmap_and_byte_buffer_parse_alike() {
    let path = data("gguf_tiny_llama.gguf");
    let mapped = GgufFile::open(&path).unwrap();
    let owned = GgufFile::from_bytes("mem", std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(mapped.version(), 3);
    assert_eq!(mapped.alignment(), 32);
    assert_eq!(mapped.tensors(), owned.tensors());
    assert_eq!(mapped.metadata().count(), owned.metadata().count());
    assert_eq!(
        mapped.tensor_f32("blk.1.ffn_down.weight").unwrap(),
        owned.tensor_f32("blk.1.ffn_down.weight").unwrap()
    );
    // Typed metadata: counts are written as u32 and widen; floats; strings.
    assert_eq!(mapped.get_u32("llama.block_count").unwrap(), Some(2));
    assert_eq!(mapped.get_u64("llama.block_count").unwrap(), Some(2));
    assert_eq!(
        mapped.get_f32("llama.rope.freq_base").unwrap(),
        Some(10000.0)
    );
    assert_eq!(
        mapped.get_str("general.architecture").unwrap(),
        Some("llama")
    );
    assert_eq!(mapped.get_str("no.such.key").unwrap(), None);
    let err = mapped.get_u32("general.architecture").unwrap_err();
    assert!(
        err.to_string().contains("general.architecture") && err.to_string().contains("string"),
        "{err}"
    );
    assert!(mapped.get_str("llama.block_count").is_err());
    let missing = GgufFile::open(data("no-such-file.gguf")).unwrap_err();
    assert!(
        matches!(missing, ModelError::Io { .. })
            && missing.to_string().contains("no-such-file.gguf")
    );
}

#[test]
fn typed_array_access() {
    let mut w = GgufWriter::new();
    w.meta("a.ints", MetaValue::Array(MetaArray::I32(vec![-1, 2, 3])))
        .meta("a.u8", MetaValue::Array(MetaArray::U8(vec![1, 2])))
        .meta(
            "a.floats",
            MetaValue::Array(MetaArray::F32(vec![0.5, -1.0])),
        )
        .meta(
            "a.strs",
            MetaValue::Array(MetaArray::String(vec!["x".into(), "".into(), "ü".into()])),
        )
        .meta(
            "a.bools",
            MetaValue::Array(MetaArray::Bool(vec![true, false])),
        )
        .meta("s.i8", MetaValue::I8(-3))
        .meta("s.u64", MetaValue::U64(1 << 40))
        .meta("s.f64", MetaValue::F64(2.5))
        .meta("s.bool", MetaValue::Bool(true));
    let f = GgufFile::from_bytes("arrays", w.to_bytes()).unwrap();
    assert_eq!(f.get_i64_array("a.ints").unwrap(), Some(vec![-1, 2, 3]));
    assert_eq!(f.get_i64_array("a.u8").unwrap(), Some(vec![1, 2]));
    assert_eq!(f.get_f32_array("a.floats").unwrap(), Some(vec![0.5, -1.0]));
    assert_eq!(
        f.get_f32_array("a.ints").unwrap(),
        Some(vec![-1.0, 2.0, 3.0])
    );
    assert_eq!(f.get_str_array("a.strs").unwrap().unwrap(), &["x", "", "ü"]);
    assert!(f.get_str_array("a.ints").is_err());
    assert!(f.get_i64_array("a.strs").is_err());
    assert!(f.get_f32_array("a.bools").is_err());
    assert!(
        f.get_u64("s.i8").is_err(),
        "negative values do not widen to unsigned"
    );
    assert_eq!(f.get_u64("s.u64").unwrap(), Some(1 << 40));
    assert!(f.get_u32("s.u64").is_err(), "2^40 does not fit in u32");
    assert_eq!(f.get_f32("s.f64").unwrap(), Some(2.5));
    assert_eq!(f.get_bool("s.bool").unwrap(), Some(true));
    assert_eq!(f.get("s.bool"), Some(&MetaValue::Bool(true)));
}

// ---- malformed inputs ---------------------------------------------------------------------

/// Raw little-endian GGUF pieces, for files no well-behaved writer produces.
#[derive(Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &[u8]) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s);
        self
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key.as_bytes()).u32(4).u32(v)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name.as_bytes()).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    fn pad_and_data(&mut self, align: usize, data_len: usize) -> Vec<u8> {
        let mut v = self.0.clone();
        v.resize(v.len().div_ceil(align) * align + data_len, 0);
        v
    }
}

fn parse_err(bytes: Vec<u8>) -> String {
    match GgufFile::from_bytes("bad.gguf", bytes) {
        Ok(_) => panic!("malformed file was accepted"),
        Err(e @ ModelError::Format { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.starts_with("bad.gguf: "),
                "error does not name the file: {msg}"
            );
            msg
        }
        Err(e) => panic!("expected a format error, got {e:?}"),
    }
}

fn assert_err_contains(bytes: Vec<u8>, needles: &[&str]) {
    let msg = parse_err(bytes);
    for n in needles {
        assert!(msg.contains(n), "`{msg}` does not mention `{n}`");
    }
}

#[test]
fn a_minimal_raw_file_parses() {
    let mut r = Raw::header(3, 1, 1);
    r.kv_u32("general.alignment", 64).tensor("t", &[4, 2], 0, 0);
    let f = GgufFile::from_bytes("ok.gguf", r.pad_and_data(64, 64)).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.tensor_f32("t").unwrap(), vec![0.0; 8]);
    // v2 has the same layout.
    let f = GgufFile::from_bytes("v2.gguf", Raw::header(2, 0, 0).0).unwrap();
    assert_eq!(f.version(), 2);
}

#[test]
fn truncation_at_every_cut_point_is_an_error() {
    let mut w = GgufWriter::new();
    w.meta_str("general.architecture", "llama")
        .meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(MetaArray::String(vec!["a".into(), "bc".into()])),
        )
        .meta("x.f", MetaValue::Array(MetaArray::F32(vec![1.0, 2.0])))
        .tensor_f32("a", &[3], &[1.0, 2.0, 3.0])
        .tensor("b", GgmlType::Q4_0, &[32, 2], vec![7; 36]);
    let bytes = w.to_bytes();
    assert!(GgufFile::from_bytes("full", bytes.clone()).is_ok());
    for cut in 0..bytes.len() {
        let msg = parse_err(bytes[..cut].to_vec());
        assert!(
            msg.contains("truncated") || msg.contains("not a GGUF") || msg.contains("bytes left"),
            "cut {cut}: {msg}"
        );
    }
    // A larger real file, at sampled cut points.
    let big = std::fs::read(data("gguf_tiny_llama.gguf")).unwrap();
    for cut in (0..big.len()).step_by(97).chain([big.len() - 1]) {
        parse_err(big[..cut].to_vec());
    }
}

#[test]
fn bad_magic_and_versions() {
    assert_err_contains(b"GGML\x03\0\0\0".to_vec(), &["not a GGUF file"]);
    assert_err_contains(Raw::header(1, 0, 0).0, &["version 1"]);
    assert_err_contains(Raw::header(4, 0, 0).0, &["version 4"]);
    assert_err_contains(Raw::header(0, 0, 0).0, &["version 0"]);
    assert_err_contains(Raw::header(3u32.swap_bytes(), 0, 0).0, &["byte-swapped"]);
}

#[test]
fn lying_counts_are_errors_not_allocations() {
    for n in [u64::MAX, 1 << 62, 1 << 40, 2] {
        assert_err_contains(Raw::header(3, n, 0).0, &["tensor count"]);
        assert_err_contains(Raw::header(3, 0, n).0, &["key/value count"]);
    }
    // An array that claims 2^60 strings.
    let mut r = Raw::header(3, 0, 1);
    r.str(b"tokenizer.ggml.tokens").u32(9).u32(8).u64(1 << 60);
    assert_err_contains(r.0, &["element count of array `tokenizer.ggml.tokens`"]);
    // A string that claims 2^63 bytes.
    let mut r = Raw::header(3, 0, 1);
    r.str(b"k").u32(8).u64(1 << 63);
    assert_err_contains(r.0, &["value of `k`", "truncated"]);
    // A key length past the end.
    let mut r = Raw::header(3, 0, 1);
    r.u64(u64::MAX).u64(0).u64(0);
    assert_err_contains(r.0, &["key of metadata entry 0"]);
}

#[test]
fn bad_metadata_is_rejected() {
    let mut r = Raw::header(3, 0, 2);
    r.kv_u32("a", 1).kv_u32("a", 2);
    assert_err_contains(r.0, &["duplicate metadata key `a`"]);
    let mut r = Raw::header(3, 0, 1);
    r.kv_u32("", 1);
    assert_err_contains(r.0, &["empty key"]);
    let mut r = Raw::header(3, 0, 1);
    r.str(b"k").u32(13).u32(0);
    assert_err_contains(r.0, &["`k`", "invalid value type 13"]);
    let mut r = Raw::header(3, 0, 1);
    r.str(b"nested").u32(9).u32(9).u64(1).u32(4).u64(0);
    assert_err_contains(r.0, &["`nested`", "nested arrays"]);
    let mut r = Raw::header(3, 0, 1);
    r.str(b"arr").u32(9).u32(77).u64(0);
    assert_err_contains(r.0, &["`arr`", "element type 77"]);
    let mut r = Raw::header(3, 0, 1);
    r.str(b"flag").u32(7);
    r.0.push(2);
    assert_err_contains(r.0, &["`flag`", "bool"]);
    let mut r = Raw::header(3, 0, 1);
    r.str(b"\xff\xfe").u32(4).u32(0);
    assert_err_contains(r.0, &["UTF-8"]);
}

#[test]
fn bad_alignment_is_rejected() {
    for a in [0u32, 3, 48] {
        let mut r = Raw::header(3, 0, 1);
        r.kv_u32("general.alignment", a);
        assert_err_contains(r.0, &["general.alignment", "power of two"]);
    }
    let mut r = Raw::header(3, 0, 1);
    r.str(b"general.alignment").u32(10).u64(32);
    assert_err_contains(r.0, &["general.alignment", "uint32"]);
    // Offsets must be aligned and contiguous.
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[4], 0, 0).tensor("b", &[4], 0, 16);
    assert_err_contains(
        r.pad_and_data(32, 64),
        &["`b`", "offset 16", "multiple of the alignment 32"],
    );
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[4], 0, 0).tensor("b", &[4], 0, 64);
    assert_err_contains(r.pad_and_data(32, 128), &["`b`", "contiguously"]);
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[4], 0, 32).tensor("b", &[4], 0, 0);
    assert_err_contains(r.pad_and_data(32, 64), &["`a`", "offset 32"]);
}

#[test]
fn bad_tensor_infos_are_rejected() {
    let cases: Vec<(Vec<u8>, Vec<&str>)> = vec![
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[1, 1, 1, 1, 1], 0, 0);
                r.pad_and_data(32, 32)
            },
            vec!["`t`", "5 dimensions"],
        ),
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[1 << 62, 1 << 62], 0, 0);
                r.pad_and_data(32, 32)
            },
            vec!["`t`", "overflow"],
        ),
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[1 << 40, 1 << 40], 2, 0);
                r.pad_and_data(32, 32)
            },
            vec!["`t`", "overflow"],
        ),
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[u64::MAX], 0, 0);
                r.pad_and_data(32, 32)
            },
            vec!["`t`", "negative"],
        ),
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[1 << 30, 1 << 20], 0, 0);
                r.pad_and_data(32, 32)
            },
            vec!["truncated", "tensor data"],
        ),
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[33], 2, 0);
                r.pad_and_data(32, 64)
            },
            vec!["`t`", "block size 32"],
        ),
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[4], 4, 0);
                r.pad_and_data(32, 32)
            },
            vec!["`t`", "ggml type 4"],
        ),
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("t", &[4], 99, 0);
                r.pad_and_data(32, 32)
            },
            vec!["`t`", "ggml type 99"],
        ),
        (
            {
                let mut r = Raw::header(3, 2, 0);
                r.tensor("t", &[4], 0, 0).tensor("t", &[4], 0, 32);
                r.pad_and_data(32, 64)
            },
            vec!["duplicate tensor name `t`"],
        ),
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor(&"x".repeat(64), &[4], 0, 0);
                r.pad_and_data(32, 32)
            },
            vec!["64 bytes", "at most 63"],
        ),
    ];
    for (bytes, needles) in cases {
        assert_err_contains(bytes, &needles);
    }
    // 63 bytes is fine, and so is an empty tensor.
    let mut r = Raw::header(3, 2, 0);
    r.tensor(&"x".repeat(63), &[4], 0, 0)
        .tensor("empty", &[0, 5], 0, 32);
    let f = GgufFile::from_bytes("ok", r.pad_and_data(32, 32)).unwrap();
    assert_eq!(f.tensor_f32("empty").unwrap(), Vec::<f32>::new());
}

#[test]
fn unsupported_tensor_types_fail_at_dequantisation_naming_the_tensor() {
    let mut w = GgufWriter::new();
    w.tensor(
        "blk.0.ffn_up.weight",
        GgmlType::IQ2_XXS,
        &[256],
        vec![0; 66],
    );
    let f = GgufFile::from_bytes("iq.gguf", w.to_bytes()).unwrap();
    let err = f.tensor_f32("blk.0.ffn_up.weight").unwrap_err();
    assert!(
        matches!(&err, ModelError::Unsupported(m) if m.contains("blk.0.ffn_up.weight") && m.contains("IQ2_XXS")),
        "{err}"
    );
    assert!(
        matches!(f.tensor_f32("missing"), Err(ModelError::Tensor { name, .. }) if name == "missing")
    );
}
