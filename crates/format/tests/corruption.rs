//! Every kind of damage to a container gives an error naming the file and, where one is
//! involved, the tensor — at open, at checksum verification, or at restore.

mod common;

use common::*;
use entrollm_format::container::{restore_sources, MANIFEST_FILE};
use entrollm_format::{ContainerReader, FormatError, SafetensorsFile};
use serde_json::Value;
use std::borrow::Cow;
use std::path::{Path, PathBuf};

/// A fresh valid container (of the synthetic checkpoint) to damage.
struct Fixture {
    scratch: Scratch,
    ct: PathBuf,
}

impl Fixture {
    fn new(tag: &str) -> Self {
        let scratch = Scratch::new(tag);
        let src = scratch.path().join("src");
        std::fs::create_dir(&src).unwrap();
        synthetic_checkpoint(&src);
        let ct = scratch.path().join("ct");
        build_container(&src, &ct, 1500);
        Fixture { scratch, ct }
    }
    fn manifest(&self) -> Value {
        serde_json::from_slice(&std::fs::read(self.ct.join(MANIFEST_FILE)).unwrap()).unwrap()
    }
    fn set_manifest(&self, v: &Value) {
        std::fs::write(
            self.ct.join(MANIFEST_FILE),
            serde_json::to_string_pretty(v).unwrap(),
        )
        .unwrap();
    }
    fn edit_manifest(&self, f: impl FnOnce(&mut Value)) {
        let mut v = self.manifest();
        f(&mut v);
        self.set_manifest(&v);
    }
    /// The shard holding `key`.
    fn shard_of(&self, key: &str) -> PathBuf {
        for e in std::fs::read_dir(&self.ct).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "safetensors")
                && SafetensorsFile::open(&p).unwrap().get(key).is_some()
            {
                return p;
            }
        }
        panic!("no shard holds {key}");
    }
    fn open_err(&self) -> String {
        ContainerReader::open(&self.ct).unwrap_err().to_string()
    }
    fn restore_err(&self) -> FormatError {
        let r = ContainerReader::open(&self.ct).unwrap();
        restore_sources(
            &r,
            &self.scratch.path().join("restored"),
            false,
            xor_decode,
            None,
        )
        .unwrap_err()
    }
}

fn file_name(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().into_owned()
}

fn assert_names(e: &str, file: &str, tensor: Option<&str>) {
    assert!(e.contains(file), "error should name file {file}: {e}");
    if let Some(t) = tensor {
        assert!(
            e.contains(&format!("tensor '{t}'")),
            "error should name tensor {t}: {e}"
        );
    }
}

fn replace_once(path: &Path, from: &[u8], to: &[u8]) {
    assert_eq!(from.len(), to.len(), "keep the file size");
    let mut bytes = std::fs::read(path).unwrap();
    let at = bytes
        .windows(from.len())
        .position(|w| w == from)
        .expect("pattern present");
    bytes[at..at + from.len()].copy_from_slice(to);
    std::fs::write(path, bytes).unwrap();
}

const PLAIN: &str = "model.norm.weight";
const CODED: &str = "model.layers.0.mlp.up_proj.weight";

#[test]
fn truncated_shard() {
    let fx = Fixture::new("trunc");
    let shard = fx.shard_of(PLAIN);
    let f = SafetensorsFile::open(&shard).unwrap();
    let last = f.tensors().last().unwrap().name.to_string();
    let len = f.file_len();
    drop(f);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap();
    file.set_len(len - 3).unwrap();
    assert_names(&fx.open_err(), &file_name(&shard), Some(&last));
    // Cut inside the header: still a clear error naming the shard.
    file.set_len(20).unwrap();
    let e = fx.open_err();
    assert_names(&e, &file_name(&shard), None);
    assert!(e.contains("truncated"), "{e}");
    file.set_len(0).unwrap();
    assert!(fx.open_err().contains("too short"));
}

#[test]
fn flipped_bytes_in_a_shard_header() {
    // A dtype changed to one of another size.
    let fx = Fixture::new("hdr-dtype");
    let key = format!("{CODED}.xor.len");
    let shard = fx.shard_of(&key);
    replace_once(
        &shard,
        format!("\"{key}\":{{\"dtype\":\"U32\"").as_bytes(),
        format!("\"{key}\":{{\"dtype\":\"U64\"").as_bytes(),
    );
    assert_names(&fx.open_err(), &file_name(&shard), Some(&key));

    // A dtype changed to an unknown one.
    let fx = Fixture::new("hdr-unknown");
    let shard = fx.shard_of(PLAIN);
    replace_once(&shard, br#""dtype":"F32""#, br#""dtype":"F3X""#);
    let e = fx.open_err();
    assert_names(&e, &file_name(&shard), None);
    assert!(e.contains("unknown dtype 'F3X'"), "{e}");

    // An offset digit flipped.
    let fx = Fixture::new("hdr-offset");
    let shard = fx.shard_of(PLAIN);
    replace_once(&shard, b"\"data_offsets\":[0,", b"\"data_offsets\":[1,");
    assert_names(&fx.open_err(), &file_name(&shard), None);

    // A name changed: the manifest's key is then missing from the shard.
    let fx = Fixture::new("hdr-name");
    let shard = fx.shard_of(PLAIN);
    replace_once(&shard, PLAIN.as_bytes(), b"model.norm.weighX");
    let e = fx.open_err();
    assert_names(&e, &file_name(&shard), Some(PLAIN));
    assert!(e.contains("missing from the shard"), "{e}");

    // A U32 array relabelled as F32 (same size): arrays must be U8 or U32.
    let fx = Fixture::new("hdr-arraydtype");
    let shard = fx.shard_of(&key);
    let text = std::fs::read(&shard).unwrap();
    let needle = format!("\"{key}\":{{\"dtype\":\"U32\"");
    assert!(text.windows(needle.len()).any(|w| w == needle.as_bytes()));
    replace_once(
        &shard,
        needle.as_bytes(),
        format!("\"{key}\":{{\"dtype\":\"F32\"").as_bytes(),
    );
    let e = fx.open_err();
    assert_names(&e, &file_name(&shard), Some(CODED));
    assert!(e.contains("U8 or U32"), "{e}");

    // The opening brace destroyed.
    let fx = Fixture::new("hdr-brace");
    let shard = fx.shard_of(PLAIN);
    replace_once(&shard, b"{\"__metadata__\"", b"[\"__metadata__\"");
    assert_names(&fx.open_err(), &file_name(&shard), None);
}

#[test]
fn flipped_bytes_in_shard_data_fail_checksums() {
    for (tensor, key) in [
        (PLAIN, PLAIN.to_string()),
        (CODED, format!("{CODED}.xor.data")),
    ] {
        let fx = Fixture::new("data");
        let shard = fx.shard_of(&key);
        let off = SafetensorsFile::open(&shard)
            .unwrap()
            .data_offset(&key)
            .unwrap() as usize;
        let mut bytes = std::fs::read(&shard).unwrap();
        bytes[off + 1] ^= 0x10;
        std::fs::write(&shard, bytes).unwrap();
        let r = ContainerReader::open(&fx.ct).unwrap();
        // Verifying the decoded tensor names it and its shard.
        let t = r.tensor(tensor).unwrap();
        let decoded = match &t.data {
            entrollm_format::StoredData::Plain(b) => b.to_vec(),
            entrollm_format::StoredData::Coded(_) => xor_decode(&t).unwrap().into_owned(),
        };
        let e = r.verify_checksum(tensor, &decoded).unwrap_err();
        assert!(matches!(e, FormatError::Checksum { .. }));
        assert_names(&e.to_string(), &file_name(&shard), Some(tensor));
        // So does a restore, which leaves nothing behind.
        let e = fx.restore_err();
        assert_names(&e.to_string(), &file_name(&shard), Some(tensor));
        assert_eq!(listing(fx.scratch.path()), ["ct", "src"]);
        // And the whole-file check names the shard.
        let e = r.verify_files(None).unwrap_err().to_string();
        assert_names(&e, &file_name(&shard), None);
    }
}

#[test]
fn edited_manifest() {
    let fx = Fixture::new("manifest");
    let good = fx.manifest();
    let index_of = |v: &Value, name: &str| {
        v["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .position(|t| t["name"] == name)
            .unwrap()
    };
    let p = index_of(&good, PLAIN);
    let c = index_of(&good, CODED);
    let check = |edit: &dyn Fn(&mut Value), file: &str, tensor: Option<&str>, words: &str| {
        let mut v = good.clone();
        edit(&mut v);
        fx.set_manifest(&v);
        let e = fx.open_err();
        assert_names(&e, file, tensor);
        assert!(e.contains(words), "expected '{words}' in: {e}");
    };
    let m = MANIFEST_FILE;
    check(
        &|v| v["version"] = "2.0".into(),
        m,
        None,
        "unsupported: container format version 2.0",
    );
    check(
        &|v| v["tensors"][p]["plain"]["key"] = "nope".into(),
        "entrollm-",
        Some(PLAIN),
        "key 'nope' is missing",
    );
    check(
        &|v| v["tensors"][p]["shape"] = serde_json::json!([4, 4]),
        "entrollm-",
        Some(PLAIN),
        "but the manifest says F32 [4, 4]",
    );
    check(
        &|v| v["tensors"][p]["dtype"] = "I32".into(),
        "entrollm-",
        Some(PLAIN),
        "shard holds F32",
    );
    check(
        &|v| v["tensors"][p]["dtype"] = "Q4_K".into(),
        m,
        Some(PLAIN),
        "unknown dtype 'Q4_K'",
    );
    check(
        &|v| v["tensors"][p]["shape"] = serde_json::json!([1u64 << 40, 1u64 << 40]),
        m,
        Some(PLAIN),
        "overflows",
    );
    check(
        &|v| v["tensors"][p]["xxh3"] = "xyz".into(),
        m,
        Some(PLAIN),
        "not 16 hex digits",
    );
    // A coded tensor whose shape no longer fits the source layout.
    check(
        &|v| v["tensors"][c]["shape"] = serde_json::json!([240, 16]),
        m,
        Some(CODED),
        "source file 'model-00002-of-00003.safetensors'",
    );
    check(
        &|v| v["tensors"][c]["coded"]["arrays"]["data"]["key"] = PLAIN.into(),
        "entrollm-",
        Some(CODED),
        "",
    );
    check(
        &|v| {
            v["tensors"].as_array_mut().unwrap().remove(p);
        },
        m,
        Some(PLAIN),
        "segment names a tensor the container does not hold",
    );
    // Dropping the tensor and its segment leaves its key in the shard unreferenced.
    let drop_entry = |v: &mut Value| {
        v["tensors"].as_array_mut().unwrap().remove(p);
        for s in v["sources"].as_array_mut().unwrap() {
            s["segments"]
                .as_array_mut()
                .unwrap()
                .retain(|g| g["tensor"] != PLAIN);
        }
    };
    check(
        &drop_entry,
        "entrollm-",
        Some(PLAIN),
        "shard key is not referenced by the manifest",
    );
    check(
        &|v| {
            v["sources"].as_array_mut().unwrap().remove(2);
        },
        "entrollm-00001",
        Some("__entrollm__.prefix.model-00003-of-00003.safetensors"),
        "not referenced",
    );
    check(
        &|v| {
            let t = v["tensors"][p].clone();
            v["tensors"].as_array_mut().unwrap().push(t);
        },
        m,
        Some(PLAIN),
        "listed twice",
    );
    check(
        &|v| {
            v["sources"][0]["segments"][1]["offset"] = 100.into();
        },
        m,
        Some("model.layers.0.input_layernorm.weight"),
        "overlaps",
    );
    check(
        &|v| {
            v["sources"][0]["size"] = 1u64.into();
        },
        m,
        None,
        "longer than the file",
    );
    check(
        &|v| {
            v["sources"][0]["size"] = (1u64 << 40).into();
        },
        m,
        None,
        "zero bytes after the last segment",
    );
    check(
        &|v| {
            v["sources"][0]["segments"][0]["tensor"] = "ghost".into();
        },
        m,
        Some("ghost"),
        "does not hold",
    );
    check(
        &|v| {
            v["shards"][0]["size"] = 5.into();
        },
        "entrollm-00001",
        None,
        "manifest records 5",
    );
    check(
        &|v| {
            v["verbatim"][0]["size"] = 5.into();
        },
        "config.json",
        None,
        "manifest records 5",
    );
    check(
        &|v| {
            v.as_object_mut().unwrap().remove("tensors");
        },
        m,
        None,
        "missing field \"tensors\"",
    );

    // Bad JSON.
    let text = serde_json::to_string_pretty(&good).unwrap();
    std::fs::write(fx.ct.join(m), &text[..text.len() / 2]).unwrap();
    let e = fx.open_err();
    assert_names(&e, m, None);
    assert!(e.contains("invalid JSON"), "{e}");
    // No manifest at all.
    std::fs::remove_file(fx.ct.join(m)).unwrap();
    assert!(fx.open_err().contains("not an entrollm container"));
}

#[test]
fn wrong_checksum_in_manifest() {
    let fx = Fixture::new("checksum");
    for name in [PLAIN, CODED] {
        fx.edit_manifest(|v| {
            for t in v["tensors"].as_array_mut().unwrap() {
                if t["name"] == name {
                    t["xxh3"] = "0123456789abcdef".into();
                }
            }
        });
        let r = ContainerReader::open(&fx.ct).unwrap();
        let t = r.tensor(name).unwrap();
        assert_eq!(t.checksum, 0x0123456789abcdef);
        let e = fx.restore_err();
        assert!(matches!(e, FormatError::Checksum { .. }), "{e}");
        assert_names(&e.to_string(), "entrollm-", Some(name));
        assert!(e.to_string().contains("0123456789abcdef"));
    }
}

#[test]
fn missing_shard() {
    let fx = Fixture::new("missing");
    let shard = fx.shard_of(PLAIN);
    std::fs::remove_file(&shard).unwrap();
    let e = fx.open_err();
    assert_names(&e, &file_name(&shard), None);
    assert!(e.contains("missing"), "{e}");
}

#[test]
fn path_traversal_is_refused() {
    let fx = Fixture::new("traversal");
    let good = fx.manifest();
    // A real safetensors file outside the container, so only the name check can stop it.
    let outside = fx.scratch.path().join("evil.safetensors");
    std::fs::copy(fx.shard_of(PLAIN), &outside).unwrap();
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|v| v["shards"][0]["name"] = "../evil.safetensors".into()),
            "not a plain relative path",
        ),
        (
            Box::new(|v| v["shards"][0]["name"] = "/tmp/evil.safetensors".into()),
            "not a plain relative path",
        ),
        (
            Box::new(|v| v["shards"][0]["name"] = "sub/evil.safetensors".into()),
            "not a plain *.safetensors file name",
        ),
        (
            Box::new(|v| v["tensors"][0]["plain"]["shard"] = "../evil.safetensors".into()),
            "does not list",
        ),
        (
            Box::new(|v| v["sources"][0]["name"] = "../../etc/x".into()),
            "not a plain relative path",
        ),
        (
            Box::new(|v| v["verbatim"][0]["name"] = "/etc/passwd".into()),
            "not a plain relative path",
        ),
        (
            Box::new(|v| v["verbatim"][0]["name"] = "a/../../b".into()),
            "not a plain relative path",
        ),
    ];
    for (edit, words) in cases {
        let mut v = good.clone();
        edit(&mut v);
        fx.set_manifest(&v);
        let e = fx.open_err();
        assert!(e.contains(words), "expected '{words}': {e}");
    }
}

#[test]
fn decoder_failures_name_the_tensor() {
    let fx = Fixture::new("decoder");
    let r = ContainerReader::open(&fx.ct).unwrap();
    let dst = fx.scratch.path().join("restored");
    let e = restore_sources(
        &r,
        &dst,
        false,
        |t| Err::<Cow<[u8]>, _>(format!("cannot decode {}", t.name)),
        None,
    )
    .unwrap_err();
    assert!(matches!(e, FormatError::Decode { .. }));
    assert!(
        e.to_string().contains("tensor '") && e.to_string().contains("cannot decode"),
        "{e}"
    );
    let e = restore_sources(
        &r,
        &dst,
        false,
        |_| Ok::<_, String>(Cow::Owned(vec![0u8; 3])),
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("decoder returned 3 bytes"), "{e}");
    // A lossy decoder whose output matches neither the tensor checksum nor the file.
    let e = restore_sources(
        &r,
        &dst,
        false,
        |t| Ok::<_, String>(Cow::Owned(vec![0u8; t.byte_len()])),
        None,
    )
    .unwrap_err();
    assert!(matches!(e, FormatError::Checksum { .. }), "{e}");
    assert_eq!(listing(fx.scratch.path()), ["ct", "src"]);
}
