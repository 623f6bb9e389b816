//! A container transformers opens: the writer's generated `config.json` (the source's plus
//! `quantization_config` and `transformers_weights`) and shard index, the source's `config.json`
//! kept whole in a shard and restored bit for bit, and the reader's checks of both.

mod common;

use common::*;
use entrollm_format::container::{restore_sources, TRANSFORMERS_INDEX};
use entrollm_format::{
    ArrayDtype, Checkpoint, ContainerReader, ContainerWriter, SourceFile, WriterOptions,
};
use serde_json::Value;
use std::path::Path;

/// [`build_container`] with the source's `config.json` stored whole and the container's own
/// generated for transformers.
fn build(src: &Path, dst: &Path, limit: u64) -> entrollm_format::Manifest {
    let ckpt = Checkpoint::open(src).unwrap();
    let opts = WriterOptions {
        shard_size_limit: limit,
        ..Default::default()
    };
    let mut w = ContainerWriter::create(dst, opts).unwrap();
    for (name, file) in ckpt.files() {
        w.add_source_file(SourceFile::from_safetensors(name, file))
            .unwrap();
    }
    for t in ckpt.tensors() {
        if is_coded(t.name) {
            let (data, len) = xor_encode(t.bytes);
            let arrays = vec![
                ("data".to_string(), ArrayDtype::U8, &data[..]),
                ("len".to_string(), ArrayDtype::U32, &len[..]),
            ];
            let params = serde_json::json!({"key": 0x5a});
            let sum = entrollm_format::checksum(t.bytes);
            w.add_coded(t.name, t.dtype, t.shape, "xor", params, arrays, sum)
                .unwrap();
        } else {
            w.add_plain(t.name, t.dtype, t.shape, t.bytes).unwrap();
        }
    }
    let config = std::fs::read(src.join("config.json")).unwrap();
    w.set_transformers_config(&config).unwrap();
    w.add_source_file(SourceFile {
        name: "config.json".into(),
        size: config.len() as u64,
        xxh3: entrollm_format::checksum(&config),
        prefix: &config,
        segments: Vec::new(),
    })
    .unwrap();
    for f in SIDE_FILES.iter().filter(|f| **f != "config.json") {
        w.copy_file(&src.join(f), f).unwrap();
    }
    w.finish().unwrap()
}

/// Every key of every shard, with its shard's name.
fn shard_keys(dir: &Path, m: &entrollm_format::Manifest) -> serde_json::Map<String, Value> {
    let mut out = serde_json::Map::new();
    for s in &m.shards {
        let bytes = std::fs::read(dir.join(&s.name)).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Map<String, Value> =
            serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        for k in header.keys().filter(|k| *k != "__metadata__") {
            out.insert(k.clone(), Value::String(s.name.clone()));
        }
    }
    out
}

#[test]
fn the_generated_config_names_the_quantizer_and_every_shard() {
    let s = Scratch::new("transformers");
    let src = s.path().join("src");
    std::fs::create_dir(&src).unwrap();
    synthetic_checkpoint(&src);
    // Tamper-proof sample of the source's config: fields of its own, kept in the generated one.
    let original = br#"{"model_type": "llama", "hidden_size": 16, "torch_dtype": "bfloat16"}"#;
    std::fs::write(src.join("config.json"), original).unwrap();
    for (limit, several) in [(1500, true), (1 << 30, false)] {
        let ct = s.path().join(format!("ct-{limit}"));
        let m = build(&src, &ct, limit);
        assert_eq!(m.shards.len() > 1, several);
        let r = ContainerReader::open(&ct).unwrap();
        r.verify_files(None).unwrap();
        let names: Vec<&str> = m.generated.iter().map(|f| f.name.as_str()).collect();
        let cfg: Value =
            serde_json::from_slice(&r.read_generated("config.json", 1 << 20).unwrap()).unwrap();
        let want: Value = serde_json::from_slice(original).unwrap();
        for (k, v) in want.as_object().unwrap() {
            assert_eq!(&cfg[k], v, "{k}");
        }
        assert_eq!(cfg["quantization_config"]["quant_method"], "entrollm");
        let weights = cfg["transformers_weights"].as_str().unwrap();
        if several {
            assert_eq!(names, [TRANSFORMERS_INDEX, "config.json"]);
            assert_eq!(weights, TRANSFORMERS_INDEX);
            let index: Value =
                serde_json::from_slice(&r.read_generated(weights, 1 << 20).unwrap()).unwrap();
            assert_eq!(
                index["weight_map"].as_object().unwrap(),
                &shard_keys(&ct, &m)
            );
        } else {
            assert_eq!(names, ["config.json"]);
            assert_eq!(weights, m.shards[0].name);
        }
        // What the engine reads is the source's config.json, and a restore gives it back.
        assert_eq!(r.read_verbatim("config.json", 1 << 20).unwrap(), original);
        assert!(r.has_verbatim("config.json"));
        assert!(r.verbatim_names().contains(&"config.json"));
        let back = s.path().join(format!("back-{limit}"));
        restore_sources(&r, &back, false, xor_decode, None).unwrap();
        let mut want = tree(&src);
        want.remove("consolidated.safetensors");
        assert!(tree(&back) == want, "restored files differ from the source");
    }
}

#[test]
fn a_damaged_generated_file_or_stored_config_is_named() {
    let s = Scratch::new("transformers-damaged");
    let src = s.path().join("src");
    std::fs::create_dir(&src).unwrap();
    synthetic_checkpoint(&src);
    let ct = s.path().join("ct");
    let m = build(&src, &ct, 1500);
    let copy = |tag: &str| {
        let p = s.path().join(tag);
        std::process::Command::new("cp")
            .args(["-r", ct.to_str().unwrap(), p.to_str().unwrap()])
            .status()
            .unwrap();
        p
    };
    // Same size, another byte: the checksum says so.
    let p = copy("edited");
    let mut b = std::fs::read(p.join("config.json")).unwrap();
    b[0] = b' ';
    std::fs::write(p.join("config.json"), &b).unwrap();
    let r = ContainerReader::open(&p).unwrap();
    let e = r.verify_files(None).unwrap_err().to_string();
    assert!(e.contains("config.json"), "{e}");
    let e = r
        .read_generated("config.json", 1 << 20)
        .unwrap_err()
        .to_string();
    assert!(e.contains("config.json"), "{e}");
    // Another size, or gone: the reader refuses the container.
    let p = copy("short");
    std::fs::write(p.join(TRANSFORMERS_INDEX), b"{}").unwrap();
    let e = ContainerReader::open(&p).unwrap_err().to_string();
    assert!(e.contains(TRANSFORMERS_INDEX), "{e}");
    let p = copy("gone");
    std::fs::remove_file(p.join("config.json")).unwrap();
    let e = ContainerReader::open(&p).unwrap_err().to_string();
    assert!(e.contains("config.json"), "{e}");
    // The source's config.json kept in a shard: a flipped byte fails its checksum.
    let p = copy("stored");
    let stored = m.sources.iter().find(|f| f.name == "config.json").unwrap();
    let shard = p.join(&stored.prefix.shard);
    let mut b = std::fs::read(&shard).unwrap();
    let orig = std::fs::read(src.join("config.json")).unwrap();
    let at = b.windows(orig.len()).position(|w| w == orig).unwrap();
    b[at + 1] ^= 1;
    std::fs::write(&shard, &b).unwrap();
    let r = ContainerReader::open(&p).unwrap();
    let e = r
        .read_verbatim("config.json", 1 << 20)
        .unwrap_err()
        .to_string();
    assert!(e.contains("config.json") && e.contains("checksum"), "{e}");
}

#[test]
fn the_writer_refuses_what_transformers_could_not_load() {
    let s = Scratch::new("transformers-misuse");
    let mut w = ContainerWriter::create(&s.path().join("a"), WriterOptions::default()).unwrap();
    for bad in [&b"[1]"[..], b"not json", br#"{"quantization_config": {}}"#] {
        assert!(w.set_transformers_config(bad).is_err());
    }
    // A verbatim config.json beside the generated one.
    let f = s.path().join("config.json");
    std::fs::write(&f, b"{}").unwrap();
    w.copy_file(&f, "config.json").unwrap();
    w.set_transformers_config(b"{}").unwrap();
    let e = w.finish().unwrap_err().to_string();
    assert!(e.contains("collides"), "{e}");
    assert!(!s.path().join("a").exists());
}
