//! safetensors against Hugging Face's own writer (golden file from
//! tools/format_golden_safetensors.py), and checkpoint discovery with its index checks.

mod common;

use common::*;
use entrollm_format::safetensors::write_safetensors;
use entrollm_format::{checksum, checksum_hex, Checkpoint, Dtype, SafetensorsFile, TensorView};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

fn data(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

#[test]
fn reads_and_rewrites_an_hf_written_file_byte_for_byte() {
    let path = data("hf_written.safetensors");
    let want: Value =
        serde_json::from_slice(&std::fs::read(data("hf_written.json")).unwrap()).unwrap();
    let f = SafetensorsFile::open(&path).unwrap();
    assert_eq!(checksum_hex(checksum(f.file_bytes())), want["file_xxh3"]);
    assert_eq!(
        f.header_bytes().len() as u64,
        want["header_len"].as_u64().unwrap()
    );
    assert_eq!(f.prefix_bytes().len(), 8 + f.header_bytes().len());
    let meta = f.metadata().unwrap();
    assert_eq!(serde_json::to_value(meta).unwrap(), want["metadata"]);
    let records = want["tensors"].as_array().unwrap();
    assert_eq!(f.len(), records.len());
    for (t, r) in f.tensors().zip(records) {
        assert_eq!(t.name, r["name"], "offset order");
        assert_eq!(t.dtype.name(), r["dtype"]);
        assert_eq!(serde_json::to_value(t.shape).unwrap(), r["shape"]);
        assert_eq!(
            f.data_offset(t.name).unwrap(),
            r["offset"].as_u64().unwrap()
        );
        assert_eq!(checksum_hex(checksum(t.bytes)), r["xxh3"], "{}", t.name);
    }
    assert_eq!(f.tensor("scalar").unwrap().shape, &[] as &[usize]);
    assert_eq!(f.tensor("empty").unwrap().bytes.len(), 0);
    assert_eq!(f.get("mask").unwrap().dtype, Dtype::Bool);
    let e = f.tensor("nope").unwrap_err().to_string();
    assert!(
        e.contains("hf_written.safetensors") && e.contains("tensor 'nope'"),
        "{e}"
    );

    // Our writer, given the same tensors in the same order, writes the same bytes.
    let s = Scratch::new("golden");
    let out = s.path().join("rewritten.safetensors");
    let views: Vec<TensorView> = f.tensors().collect();
    write_safetensors(&out, &views, Some(meta)).unwrap();
    assert!(
        std::fs::read(&out).unwrap() == f.file_bytes(),
        "rewritten file differs from HF's"
    );
}

#[test]
fn index_checks() {
    let s = Scratch::new("index");
    let dir = s.path();
    synthetic_checkpoint(dir);
    let ck = Checkpoint::open(dir).unwrap();
    assert_eq!(
        ck.files().len(),
        3,
        "the stray consolidated.safetensors is ignored"
    );
    assert_eq!(ck.len(), 10);
    assert_eq!(
        ck.index_path(),
        Some(dir.join("model.safetensors.index.json").as_path())
    );
    assert_eq!(ck.tensor("lm_head.weight").unwrap().shape, &[32, 16]);
    let e = ck.tensor("ghost").unwrap_err().to_string();
    assert!(e.contains("tensor 'ghost'"), "{e}");
    let names: Vec<&str> = ck.files().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors"
        ]
    );

    let index_path = dir.join("model.safetensors.index.json");
    let good: Value = serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    let with_index = |edit: &dyn Fn(&mut Value)| {
        let mut v = good.clone();
        edit(&mut v);
        std::fs::write(&index_path, v.to_string()).unwrap();
        Checkpoint::open(dir).map(|_| ()).unwrap_err().to_string()
    };
    // A tensor mapped to a shard that does not hold it.
    let e = with_index(&|v| {
        v["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors".into()
    });
    assert!(
        e.contains("model-00001-of-00003.safetensors") && e.contains("tensor 'lm_head.weight'"),
        "{e}"
    );
    // A missing shard.
    let e = with_index(&|v| {
        v["weight_map"]["lm_head.weight"] = "model-00009-of-00009.safetensors".into()
    });
    assert!(
        e.contains("model.safetensors.index.json")
            && e.contains("model-00009-of-00009.safetensors")
            && e.contains("missing"),
        "{e}"
    );
    // Path traversal in the index.
    let e = with_index(&|v| {
        v["weight_map"]["lm_head.weight"] = "../model-00003-of-00003.safetensors".into()
    });
    assert!(e.contains("not a plain relative path"), "{e}");
    // Not an index.
    let e = with_index(&|v| *v = serde_json::json!({"metadata": {}}));
    assert!(e.contains("weight_map"), "{e}");
    std::fs::write(&index_path, "{").unwrap();
    let e = Checkpoint::open(dir).unwrap_err().to_string();
    assert!(
        e.contains("model.safetensors.index.json") && e.contains("invalid JSON"),
        "{e}"
    );
}

#[test]
fn duplicate_tensor_across_files_and_empty_directories() {
    let s = Scratch::new("dup");
    let t = [TensorView {
        name: "w",
        dtype: Dtype::U8,
        shape: &[2],
        bytes: &[1, 2],
    }];
    let meta = BTreeMap::new();
    write_safetensors(&s.path().join("a.safetensors"), &t, Some(&meta)).unwrap();
    write_safetensors(&s.path().join("b.safetensors"), &t, None).unwrap();
    let e = Checkpoint::open(s.path()).unwrap_err().to_string();
    assert!(
        e.contains("b.safetensors") && e.contains("tensor 'w'") && e.contains("a.safetensors"),
        "{e}"
    );

    let empty = Scratch::new("nofiles");
    let e = Checkpoint::open(empty.path()).unwrap_err().to_string();
    assert!(e.contains("no *.safetensors files"), "{e}");
    let e = Checkpoint::open(&empty.path().join("absent"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("absent"), "{e}");
}
