//! Writer → reader → restore_sources on a synthetic multi-shard checkpoint, and the writer's
//! all-or-nothing behaviour.

mod common;

use common::*;
use entrollm_format::container::{restore_sources, MANIFEST_FILE};
use entrollm_format::{
    ArrayDtype, Checkpoint, ContainerReader, ContainerWriter, Dtype, FormatError, SafetensorsFile,
    StoredData, WriterOptions,
};

#[test]
fn round_trip_restores_every_file_bit_for_bit() {
    let s = Scratch::new("roundtrip");
    let src = s.path().join("src");
    std::fs::create_dir(&src).unwrap();
    synthetic_checkpoint(&src);
    let limit = 1500;
    let manifest = build_container(&src, &s.path().join("ct"), limit);
    assert!(
        manifest.shards.len() >= 3,
        "small limit must give several shards: {}",
        manifest.shards.len()
    );

    let ct = s.path().join("ct");
    let r = ContainerReader::open(&ct).unwrap();
    let ckpt = Checkpoint::open(&src).unwrap();
    assert_eq!(r.len(), ckpt.len());
    assert_eq!(r.manifest().metadata["source"]["kind"], "safetensors");
    // Every tensor reads back: plain bytes directly, coded ones through the toy decoder.
    for (t, orig) in r.tensors().zip(ckpt.tensors()) {
        assert_eq!(t.name, orig.name, "manifest keeps insertion order");
        assert_eq!((t.dtype, t.shape), (orig.dtype, orig.shape));
        let decoded = match &t.data {
            StoredData::Plain(b) => {
                assert!(!is_coded(t.name));
                b.to_vec()
            }
            StoredData::Coded(c) => {
                assert!(is_coded(t.name));
                assert_eq!(c.arrays["data"].0, ArrayDtype::U8);
                assert_eq!(c.arrays["len"].0, ArrayDtype::U32);
                xor_decode(&t).unwrap().into_owned()
            }
        };
        assert_eq!(decoded, orig.bytes, "{}", t.name);
        r.verify_checksum(t.name, &decoded).unwrap();
    }
    r.verify_files(None).unwrap();

    // Shards: data within the limit unless one tensor alone exceeds it; every array aligned to
    // its element size; names as documented.
    for (i, entry) in r.manifest().shards.iter().enumerate() {
        assert_eq!(
            entry.name,
            format!(
                "entrollm-{:05}-of-{:05}.safetensors",
                i + 1,
                r.manifest().shards.len()
            )
        );
        let f = SafetensorsFile::open(&ct.join(&entry.name)).unwrap();
        let data: usize = f.tensors().map(|t| t.bytes.len()).sum();
        let largest = f.tensors().map(|t| t.bytes.len()).max().unwrap_or(0);
        assert!(
            data as u64 <= limit || f.len() <= 2 || largest as u64 > limit / 2,
            "shard {i}: {data} bytes"
        );
        for t in f.tensors() {
            assert_eq!(
                f.data_offset(t.name).unwrap() % t.dtype.alignment() as u64,
                0,
                "{} misaligned",
                t.name
            );
        }
        assert_eq!(f.metadata().unwrap()["format"], "entrollm");
    }
    let mut listing_ct = listing(&ct);
    listing_ct.retain(|n| !n.starts_with("entrollm-"));
    assert_eq!(
        listing_ct,
        [
            "config.json",
            MANIFEST_FILE,
            "model.safetensors.index.json",
            "original",
            "tokenizer.json"
        ]
    );

    // Restore: every source file and side file, byte-identical, and nothing else.
    let dst = s.path().join("restored");
    let mut calls = Vec::new();
    let mut progress = |done: u64, total: u64| calls.push((done, total));
    restore_sources(&r, &dst, false, xor_decode, Some(&mut progress)).unwrap();
    let mut want = tree(&src);
    want.remove("consolidated.safetensors");
    let got = tree(&dst);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    assert!(got == want, "restored files differ from the source");
    let total = want.values().map(|v| v.len() as u64).sum::<u64>();
    assert!(
        calls.windows(2).all(|w| w[0].0 <= w[1].0),
        "progress is monotone"
    );
    assert_eq!(calls.last(), Some(&(total, total)));
    assert_eq!(
        listing(s.path()),
        ["ct", "restored", "src"],
        "no staging directories left"
    );

    // A second restore into the now non-empty destination is refused; with overwrite it works.
    let e = restore_sources(&r, &dst, false, xor_decode, None).unwrap_err();
    assert!(matches!(e, FormatError::DestinationExists { .. }), "{e}");
    restore_sources(&r, &dst, true, xor_decode, None).unwrap();
    assert!(tree(&dst) == want);
    // Restoring over the container itself, into it or over its parent is refused.
    for out in [ct.clone(), ct.join("inside"), s.path().to_path_buf()] {
        let e = restore_sources(&r, &out, true, xor_decode, None).unwrap_err();
        assert!(e.to_string().contains("the input"), "{e}");
    }
    assert!(ct.join("entrollm.json").is_file());
}

#[test]
fn single_shard_container_and_checkpoint_kinds() {
    let s = Scratch::new("kinds");
    let src = s.path().join("src");
    std::fs::create_dir(&src).unwrap();
    synthetic_checkpoint(&src);
    let m = build_container(&src, &s.path().join("one"), u64::MAX);
    assert_eq!(m.shards.len(), 1);
    // Deterministic: the same calls give the same bytes.
    build_container(&src, &s.path().join("two"), u64::MAX);
    assert!(tree(&s.path().join("one")) == tree(&s.path().join("two")));
    assert_eq!(m.shards[0].name, "entrollm-00001-of-00001.safetensors");

    // A single file and a directory without index are checkpoints too.
    let single = Checkpoint::open(&src.join("model-00003-of-00003.safetensors")).unwrap();
    assert_eq!(single.len(), 3);
    assert_eq!(
        single.files().next().unwrap().0,
        "model-00003-of-00003.safetensors"
    );
    std::fs::remove_file(src.join("model.safetensors.index.json")).unwrap();
    let all = Checkpoint::open(&src).unwrap();
    assert_eq!(
        all.files().len(),
        4,
        "without an index every *.safetensors file counts"
    );
    assert!(all.index_path().is_none());
}

#[test]
fn unfinished_or_failed_writer_leaves_nothing() {
    let s = Scratch::new("unfinished");
    let dst = s.path().join("out");
    {
        let mut w = ContainerWriter::create(
            &dst,
            WriterOptions {
                shard_size_limit: 64,
                ..Default::default()
            },
        )
        .unwrap();
        for i in 0..10 {
            w.add_plain(&format!("t{i}"), Dtype::F32, &[10], &[7u8; 40])
                .unwrap();
        }
        std::fs::write(s.path().join("cfg"), b"x").unwrap();
        w.copy_file(&s.path().join("cfg"), "config.json").unwrap();
        assert!(
            listing(s.path()).iter().any(|n| n.starts_with(".out.")),
            "staging dir exists while writing"
        );
    }
    assert_eq!(
        listing(s.path()),
        ["cfg"],
        "dropped writer must leave nothing"
    );

    // An error inside `finish` (a segment naming a tensor that was never added) leaves nothing.
    let mut w = ContainerWriter::create(&dst, WriterOptions::default()).unwrap();
    w.add_plain("a", Dtype::U8, &[3], b"abc").unwrap();
    let prefix = [0u8; 8];
    let src = entrollm_format::SourceFile {
        name: "x.safetensors".into(),
        size: 11,
        xxh3: 0,
        prefix: &prefix,
        segments: vec![entrollm_format::SourceSegment {
            tensor: "missing".into(),
            offset: 8,
        }],
    };
    w.add_source_file(src).unwrap();
    let e = w.finish().unwrap_err().to_string();
    assert!(
        e.contains("tensor 'missing'") && e.contains("x.safetensors"),
        "{e}"
    );
    assert_eq!(listing(s.path()), ["cfg"]);
}

#[test]
fn writer_rejects_misuse_with_clear_errors() {
    let s = Scratch::new("misuse");
    let mut w = ContainerWriter::create(&s.path().join("out"), WriterOptions::default()).unwrap();
    let err = |r: entrollm_format::Result<()>| r.unwrap_err().to_string();
    w.add_plain("a", Dtype::BF16, &[2], &[1, 2, 3, 4]).unwrap();
    assert!(err(w.add_plain("a", Dtype::BF16, &[2], &[1, 2, 3, 4]))
        .contains("tensor 'a' is added twice"));
    assert!(err(w.add_plain("b", Dtype::BF16, &[2], &[1, 2, 3]))
        .contains("3 bytes given but BF16 × [2] needs 4"));
    assert!(err(w.add_plain("__x", Dtype::U8, &[0], &[])).contains("reserved"));
    let coded = |w: &mut ContainerWriter,
                 name: &str,
                 coder: &str,
                 arrays: Vec<(String, ArrayDtype, &[u8])>| {
        w.add_coded(
            name,
            Dtype::BF16,
            &[4],
            coder,
            serde_json::json!({}),
            arrays,
            0,
        )
    };
    assert!(err(coded(&mut w, "c", "bad.coder", vec![])).contains("coder name 'bad.coder'"));
    assert!(err(coded(
        &mut w,
        "c",
        "x",
        vec![("w".into(), ArrayDtype::U32, &[0; 5])]
    ))
    .contains("not a whole number of U32"));
    assert!(err(coded(
        &mut w,
        "c",
        "x",
        vec![
            ("w".into(), ArrayDtype::U8, &[0]),
            ("w".into(), ArrayDtype::U8, &[0])
        ]
    ))
    .contains("already used"));
    // A plain tensor named like another tensor's array key collides.
    w.add_plain("d.x.w", Dtype::U8, &[1], &[0]).unwrap();
    assert!(err(coded(
        &mut w,
        "d",
        "x",
        vec![("w".into(), ArrayDtype::U8, &[0])]
    ))
    .contains("shard key 'd.x.w' is already used"));
    let e = w.add_coded(
        "e",
        Dtype::BF16,
        &[usize::MAX, 4],
        "x",
        serde_json::json!({}),
        vec![],
        0,
    );
    assert!(err(e).contains("overflows"));
    let e = w.add_coded(
        "e",
        Dtype::BF16,
        &[4],
        "x",
        serde_json::json!([1]),
        vec![],
        0,
    );
    assert!(err(e).contains("params must be a JSON object"));
    std::fs::write(s.path().join("f"), b"").unwrap();
    assert!(err(w.copy_file(&s.path().join("f"), "../f")).contains("not a plain relative path"));
    assert!(err(w.copy_file(&s.path().join("f"), "entrollm.json")).contains("reserved"));
    assert!(err(w.copy_file(&s.path().join("missing"), "g")).contains("missing"));
    // The container still finishes with what was accepted.
    let m = w.finish().unwrap();
    assert_eq!(
        m.tensors
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>(),
        ["a", "d.x.w"]
    );
}

#[test]
fn existing_destination_is_refused() {
    let s = Scratch::new("exists");
    let dst = s.path().join("out");
    std::fs::create_dir(&dst).unwrap();
    std::fs::write(dst.join("keep.txt"), b"mine").unwrap();
    let e = ContainerWriter::create(&dst, WriterOptions::default()).unwrap_err();
    assert!(matches!(e, FormatError::DestinationExists { .. }));
    assert!(
        e.to_string().contains("out") && e.to_string().contains("not empty"),
        "{e}"
    );
    assert_eq!(std::fs::read(dst.join("keep.txt")).unwrap(), b"mine");
    // A plain file in the way is refused too.
    let file_dst = s.path().join("file");
    std::fs::write(&file_dst, b"x").unwrap();
    assert!(ContainerWriter::create(&file_dst, WriterOptions::default()).is_err());
    // An empty directory is fine, and overwrite replaces a non-empty one.
    let empty = s.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    ContainerWriter::create(&empty, WriterOptions::default())
        .unwrap()
        .finish()
        .unwrap();
    let mut w = ContainerWriter::create(
        &dst,
        WriterOptions {
            overwrite: true,
            ..Default::default()
        },
    )
    .unwrap();
    w.add_plain("t", Dtype::U8, &[1], &[9]).unwrap();
    w.finish().unwrap();
    assert!(!dst.join("keep.txt").exists());
    assert_eq!(ContainerReader::open(&dst).unwrap().len(), 1);
    assert_eq!(listing(s.path()), ["empty", "file", "out"]);
}

/// A tensor's serving form (format 1.1) is written, read back, validated by the reader, and
/// absent from tensors that record none (as in 1.0 containers).
#[test]
fn serving_forms_are_recorded_and_validated() {
    use entrollm_format::FormEntry;
    let s = Scratch::new("forms");
    let out = s.path().join("out");
    let mut w = ContainerWriter::create(&out, WriterOptions::default()).unwrap();
    w.add_plain("m", Dtype::BF16, &[2, 2], &[0; 8]).unwrap();
    w.add_plain("n", Dtype::BF16, &[2], &[0; 4]).unwrap();
    let form = |f: &str, v: &str| FormEntry {
        form: f.into(),
        variant: v.into(),
    };
    w.set_form("m", form("dtans", "pair:8:64:16")).unwrap();
    let e = w.set_form("missing", form("dense", "f32")).unwrap_err();
    assert!(e.to_string().contains("'missing' was not added"), "{e}");
    let e = w.set_form("n", form("Dense!", "")).unwrap_err();
    assert!(e.to_string().contains("not a form name"), "{e}");
    let e = w.set_form("n", form("dense", "f\n32")).unwrap_err();
    assert!(e.to_string().contains("printable ASCII"), "{e}");
    let m = w.finish().unwrap();
    assert_eq!(m.version, "1.2");
    let r = ContainerReader::open(&out).unwrap();
    assert_eq!(r.form("m"), Some(&form("dtans", "pair:8:64:16")));
    assert_eq!(r.form("n"), None);

    // A manifest whose form is not a form name is refused, naming the tensor.
    let path = out.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("\"dtans\"", "\"no such/form\"")).unwrap();
    let e = ContainerReader::open(&out).unwrap_err().to_string();
    assert!(
        e.contains("tensor 'm'") && e.contains("not a form name"),
        "{e}"
    );
}
