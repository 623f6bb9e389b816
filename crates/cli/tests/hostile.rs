//! The hostile-input suite: generated damage to containers, safetensors checkpoints and GGUF
//! files — truncation at every structural boundary, byte flips in headers, coded and plain data,
//! manifest edits (shapes, offsets, dims of 2^40 and 2^64, names with `../`, absolute paths,
//! links, FIFOs, /dev/zero). Each case is a clean error naming the file or tensor (exit 1, never a
//! panic, abort or hang) or a correct result, and nothing is left behind.

mod common;

use entrollm_model::load::{open_weights_with, LoadOptions};
use entrollm_model::Engine;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn tmp(name: &str) -> common::Scratch {
    common::Scratch::new("hostile", name)
}

/// Runs the binary with a deadline: (exit code, stderr). A hang is a failure.
fn entrollm(args: &[&str]) -> (Option<i32>, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_entrollm"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while c.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(60) {
            let _ = c.kill();
            panic!("entrollm {args:?} hangs");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = c.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn ok(args: &[&str]) {
    let (code, err) = entrollm(args);
    assert_eq!(code, Some(0), "entrollm {args:?}: {err}");
}

/// Fails cleanly (exit 1, no panic) with a message containing one of `names`.
fn refused(args: &[&str], names: &[&str]) -> String {
    let (code, err) = entrollm(args);
    assert_eq!(
        code,
        Some(1),
        "entrollm {args:?} should fail cleanly: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        names.iter().any(|n| err.contains(n)),
        "entrollm {args:?}: {err} names none of {names:?}"
    );
    err
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Nothing but `keep` in `dir` (no staging directory, no partial output).
fn only(dir: &Path, keep: &[&str]) {
    let mut left: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !keep.contains(&n.as_str()))
        .collect();
    left.sort();
    assert!(
        left.is_empty(),
        "left behind in {}: {left:?}",
        dir.display()
    );
}

/// A safetensors file's structural boundaries: the length field, the header's middle and end,
/// and each tensor's first and last byte.
fn safetensors_boundaries(bytes: &[u8]) -> (Vec<usize>, Vec<(String, usize, usize)>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut cuts = vec![0, 4, 7, 8, 8 + n / 2, 8 + n - 1, 8 + n];
    let mut tensors = Vec::new();
    for (name, t) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        let o = t["data_offsets"].as_array().unwrap();
        let (a, b) = (
            o[0].as_u64().unwrap() as usize,
            o[1].as_u64().unwrap() as usize,
        );
        if b > a {
            cuts.extend([8 + n + a + 1, 8 + n + (a + b) / 2, 8 + n + b - 1]);
            tensors.push((name.clone(), 8 + n + a, 8 + n + b));
        }
    }
    cuts.sort_unstable();
    cuts.dedup();
    cuts.retain(|&c| c < bytes.len());
    (cuts, tensors)
}

/// A synthetic checkpoint and its container, made once per test.
struct Fixture {
    dir: common::Scratch,
    src: PathBuf,
    container: PathBuf,
}

fn fixture(name: &str) -> Fixture {
    let dir = tmp(name);
    let (src, container) = (dir.join("src"), dir.join("c"));
    ok(&[
        "synth",
        "--shape",
        "tiny",
        "--seed",
        "4",
        "-o",
        src.to_str().unwrap(),
    ]);
    ok(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        container.to_str().unwrap(),
        // dtANS throughout: the manifest edits are of its fields.
        "--coder",
        "dtans",
    ]);
    Fixture {
        dir,
        src,
        container,
    }
}

fn shard(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap()
}

/// The bits of every logit along the greedy path after a fixed prompt (the tokens and every
/// value the model computed on the way), or the load's error.
fn greedy(path: &Path, fused: bool) -> Result<Vec<u32>, String> {
    let w = open_weights_with(
        path,
        LoadOptions {
            fused,
            ..LoadOptions::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let mut e = Engine::new(w, 32).map_err(|e| e.to_string())?;
    let mut logits = e.prefill(&[1, 17, 300, 42]).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for _ in 0..6 {
        out.extend(logits.iter().map(|l| l.to_bits()));
        let t = entrollm_model::sampler::argmax(&logits).unwrap();
        out.push(t);
        logits = e.step(t).map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// The tensor a container's shard key belongs to (coded arrays are `TENSOR.codes` etc.).
fn tensor_of<'a>(key: &'a str, tensors: &'a [Value]) -> &'a str {
    tensors
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .filter(|n| key.starts_with(n))
        .max_by_key(|n| n.len())
        .unwrap_or(key)
}

#[test]
fn a_flipped_byte_in_any_tensor_is_refused_naming_it_or_changes_nothing() {
    let f = fixture("flip");
    // The undamaged container's logits, decoded at load and kept coded (products in another order).
    let want = [
        greedy(&f.container, false).unwrap(),
        greedy(&f.container, true).unwrap(),
    ];
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(f.container.join("entrollm.json")).unwrap()).unwrap();
    let tensors = manifest["tensors"].as_array().unwrap().clone();
    let s = shard(&f.container);
    let good = std::fs::read(&s).unwrap();
    let (_, spans) = safetensors_boundaries(&good);
    let (mut refused, mut same) = (0, 0);
    let damaged = f.dir.join("damaged");
    copy_dir(&f.container, &damaged);
    let ds = damaged.join(s.file_name().unwrap());
    for (key, a, b) in &spans {
        for at in [*a, (a + b) / 2, b - 1] {
            for bit in [0x01u8, 0x80] {
                let mut bytes = good.clone();
                bytes[at] ^= bit;
                std::fs::write(&ds, &bytes).unwrap();
                let name = tensor_of(key, &tensors);
                for fused in [false, true] {
                    match greedy(&damaged, fused) {
                        Ok(t) => {
                            assert!(
                                t == want[fused as usize],
                                "{key} byte {at} ^ {bit:#x}: served other logits"
                            );
                            same += 1;
                        }
                        Err(e) => {
                            assert!(
                                e.contains(name),
                                "{key} byte {at} ^ {bit:#x} (fused {fused}): {e} does not name {name}"
                            );
                            refused += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(refused > 0, "{same} unchanged, none refused");
    eprintln!(
        "{} tensors: {refused} refused naming the tensor, {same} served unchanged",
        spans.len()
    );
}

#[test]
fn truncated_and_header_damaged_containers_fail_cleanly_leaving_nothing() {
    let f = fixture("trunc");
    let s = shard(&f.container);
    let good = std::fs::read(&s).unwrap();
    let shard_name = s.file_name().unwrap().to_str().unwrap().to_string();
    let (cuts, _) = safetensors_boundaries(&good);
    let damaged = f.dir.join("damaged");
    let out = f.dir.join("out");
    let names = [shard_name.as_str(), "entrollm.json", "safetensors"];
    let mut cases = 0;
    let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    // Every structural cut, then header bytes flipped (every 13th, and the length field).
    let mut variants: Vec<Vec<u8>> = cuts.iter().map(|&c| good[..c].to_vec()).collect();
    for at in (0..8 + n).step_by(13).chain(0..8) {
        let mut b = good.clone();
        b[at] ^= 0x20;
        variants.push(b);
    }
    for bytes in variants {
        copy_dir(&f.container, &damaged);
        std::fs::write(damaged.join(&shard_name), &bytes).unwrap();
        let (code, err) = entrollm(&[
            "decompress",
            damaged.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ]);
        assert!(!err.contains("panicked"), "{err}");
        if code == Some(0) {
            // A flip the format does not read (JSON whitespace): the restored checkpoint is exact.
            for e in std::fs::read_dir(&f.src).unwrap() {
                let e = e.unwrap();
                assert_eq!(
                    std::fs::read(e.path()).unwrap(),
                    std::fs::read(out.join(e.file_name())).unwrap()
                );
            }
            std::fs::remove_dir_all(&out).unwrap();
        } else {
            assert_eq!(code, Some(1), "{err}");
            assert!(names.iter().any(|n| err.contains(n)), "{err}");
            assert!(!out.exists(), "partial output left: {err}");
        }
        only(&f.dir, &["src", "c", "damaged"]);
        cases += 1;
    }
    // The manifest truncated at every 1/16 of its length.
    let m = std::fs::read(f.container.join("entrollm.json")).unwrap();
    for k in 0..16 {
        copy_dir(&f.container, &damaged);
        std::fs::write(damaged.join("entrollm.json"), &m[..m.len() * k / 16]).unwrap();
        refused(
            &[
                "decompress",
                damaged.to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
            ],
            &["entrollm.json"],
        );
        refused(&["inspect", damaged.to_str().unwrap()], &["entrollm.json"]);
        assert!(!out.exists());
        cases += 1;
    }
    eprintln!("{cases} damaged containers");
}

#[test]
fn edited_manifests_links_fifos_and_devices_fail_cleanly_leaving_nothing() {
    let f = fixture("manifest");
    let good: Value =
        serde_json::from_slice(&std::fs::read(f.container.join("entrollm.json")).unwrap()).unwrap();
    let damaged = f.dir.join("damaged");
    let out = f.dir.join("out");
    type Edit = Box<dyn Fn(&mut Value)>;
    let edits: Vec<(&str, Edit)> = vec![
        (
            "a shape",
            Box::new(|m| m["tensors"][1]["shape"] = serde_json::json!([7, 3])),
        ),
        (
            "a dim of 2^40",
            Box::new(|m| m["tensors"][2]["shape"] = serde_json::json!([1u64 << 40, 192])),
        ),
        (
            "a dim of 2^64",
            Box::new(|m| {
                m["tensors"][2]["shape"] =
                    serde_json::from_str("[18446744073709551616, 1]").unwrap()
            }),
        ),
        (
            "a negative dim",
            Box::new(|m| m["tensors"][2]["shape"] = serde_json::json!([-1, 192])),
        ),
        (
            "a checksum",
            Box::new(|m| m["tensors"][3]["xxh3"] = "0000000000000000".into()),
        ),
        (
            "a tensor name",
            Box::new(|m| m["tensors"][3]["name"] = "../../escape".into()),
        ),
        (
            "a shard name with ../",
            Box::new(|m| m["shards"][0]["name"] = "../c/x.safetensors".into()),
        ),
        (
            "an absolute shard path",
            Box::new(|m| m["shards"][0]["name"] = "/etc/passwd".into()),
        ),
        (
            "a shard size",
            Box::new(|m| m["shards"][0]["size"] = (1u64 << 62).into()),
        ),
        (
            "a source name with ../",
            Box::new(|m| m["sources"][0]["name"] = "../../evil.safetensors".into()),
        ),
        (
            "an absolute source name",
            Box::new(|m| m["sources"][0]["name"] = "/tmp/evil.safetensors".into()),
        ),
        (
            "a source size of 2^40",
            Box::new(|m| m["sources"][0]["size"] = (1u64 << 40).into()),
        ),
        (
            "a segment offset",
            Box::new(|m| m["sources"][0]["segments"][1]["offset"] = (1u64 << 50).into()),
        ),
        (
            "a coded slice width",
            Box::new(|m| m["tensors"][0]["coded"]["params"]["sc"] = 3.into()),
        ),
        (
            "a coded row count",
            Box::new(|m| m["tensors"][0]["coded"]["params"]["rows"] = (1u64 << 40).into()),
        ),
        (
            "a verbatim name",
            Box::new(|m| m["verbatim"][0]["name"] = "../outside.json".into()),
        ),
        ("the format", Box::new(|m| m["format"] = "other".into())),
        ("the version", Box::new(|m| m["version"] = "99.0".into())),
        (
            "the tensors' type",
            Box::new(|m| m["tensors"] = "all".into()),
        ),
    ];
    for (what, edit) in &edits {
        copy_dir(&f.container, &damaged);
        let mut m = good.clone();
        edit(&mut m);
        std::fs::write(damaged.join("entrollm.json"), m.to_string()).unwrap();
        for args in [
            vec![
                "decompress",
                damaged.to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
            ],
            vec!["inspect", damaged.to_str().unwrap()],
        ] {
            let (code, err) = entrollm(&args);
            assert!(!err.contains("panicked"), "{what}: {err}");
            if code == Some(0) && args[0] == "decompress" {
                panic!("{what}: decompress accepted an edited manifest");
            }
            if code != Some(0) {
                assert_eq!(code, Some(1), "{what}: {err}");
                assert!(!err.trim().is_empty());
            }
            assert!(!out.exists(), "{what}: output left");
        }
        if let Err(e) = greedy(&damaged, false) {
            assert!(!e.is_empty(), "{what}");
        } else {
            panic!("{what}: the engine loaded an edited manifest");
        }
        // Nothing was written outside the test directory either.
        assert!(!f.dir.parent().unwrap().join("evil.safetensors").exists());
        only(&f.dir, &["src", "c", "damaged"]);
    }
    // Links, FIFOs and devices in place of the manifest and the shard.
    let shard_name = shard(&f.container).file_name().unwrap().to_owned();
    for (file, what) in [
        ("entrollm.json", "manifest"),
        (shard_name.to_str().unwrap(), "shard"),
    ] {
        for target in ["/dev/zero", "fifo", "/nonexistent"] {
            copy_dir(&f.container, &damaged);
            let p = damaged.join(file);
            std::fs::remove_file(&p).unwrap();
            if target == "fifo" {
                let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
            } else {
                std::os::unix::fs::symlink(target, &p).unwrap();
            }
            for args in [
                vec![
                    "decompress",
                    damaged.to_str().unwrap(),
                    "-o",
                    out.to_str().unwrap(),
                ],
                vec!["inspect", damaged.to_str().unwrap()],
            ] {
                refused(&args, &[file]);
                assert!(!out.exists(), "{what} as {target}: output left");
            }
        }
    }
}

#[test]
fn damaged_safetensors_sources_are_refused_before_any_output() {
    let f = fixture("source");
    let st = f.src.join("model.safetensors");
    let good = std::fs::read(&st).unwrap();
    let (cuts, _) = safetensors_boundaries(&good);
    let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&good[8..8 + n]).unwrap();
    let key = header
        .as_object()
        .unwrap()
        .keys()
        .find(|k| *k != "__metadata__")
        .unwrap()
        .clone();
    let with_header = |edit: &dyn Fn(&mut Value)| {
        let mut h = header.clone();
        edit(&mut h);
        let text = h.to_string();
        let mut b = (text.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(text.as_bytes());
        b.extend_from_slice(&good[8 + n..]);
        b
    };
    let mut variants: Vec<(String, Vec<u8>)> = cuts
        .iter()
        .filter(|&&c| c < good.len())
        .map(|&c| (format!("cut at {c}"), good[..c].to_vec()))
        .collect();
    for (what, v) in [
        ("dims of 2^40", serde_json::json!([1u64 << 40, 1u64 << 40])),
        (
            "a dim of 2^64",
            serde_json::from_str("[18446744073709551616]").unwrap(),
        ),
        ("an empty shape with data", serde_json::json!([])),
    ] {
        variants.push((
            what.to_string(),
            with_header(&|h| h[&key]["shape"] = v.clone()),
        ));
    }
    variants.push((
        "offsets past the end".into(),
        with_header(&|h| h[&key]["data_offsets"] = serde_json::json!([0u64, 1u64 << 40])),
    ));
    variants.push((
        "overlapping offsets".into(),
        with_header(&|h| h[&key]["data_offsets"] = serde_json::json!([0, 4])),
    ));
    variants.push((
        "an unknown dtype".into(),
        with_header(&|h| h[&key]["dtype"] = "Q9".into()),
    ));
    variants.push((
        "a header length past the file".into(),
        [&(u64::MAX / 2).to_le_bytes()[..], &good[8..]].concat(),
    ));
    let damaged = f.dir.join("damaged");
    let out = f.dir.join("out");
    for (what, bytes) in &variants {
        copy_dir(&f.src, &damaged);
        std::fs::write(damaged.join("model.safetensors"), bytes).unwrap();
        refused(
            &[
                "compress",
                damaged.to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
            ],
            &["model.safetensors"],
        );
        assert!(!out.exists(), "{what}: output left");
        refused(
            &["inspect", damaged.to_str().unwrap()],
            &["model.safetensors"],
        );
        only(&f.dir, &["src", "c", "damaged"]);
    }
    eprintln!("{} damaged safetensors sources", variants.len());
}

#[test]
fn truncated_and_damaged_gguf_sources_are_refused_before_any_output() {
    let path = entrollm_model::load::smollm2_gguf_path();
    assert!(
        path.exists(),
        "{} not found: run scripts/fetch-smollm2",
        path.display()
    );
    let gguf = entrollm_model::gguf::GgufFile::open(&path).unwrap();
    let data = gguf.data_offset() as usize;
    let t0 = &gguf.tensors()[0];
    let last = gguf.tensors().last().unwrap();
    let bytes = gguf.bytes();
    let dir = tmp("gguf");
    let out = dir.join("out.entrollm");
    let mut cases: Vec<(String, Vec<u8>)> = [0, 3, 4, 8, 16, 24, 25, data / 2, data - 1, data]
        .iter()
        .map(|&c| (format!("cut at {c}"), bytes[..c].to_vec()))
        .collect();
    let end0 = data + t0.offset as usize + t0.n_bytes as usize;
    let mid = data + last.offset as usize + last.n_bytes as usize / 2;
    cases.push((
        "cut inside the first tensor".into(),
        bytes[..end0 - 1].to_vec(),
    ));
    cases.push(("cut inside the last tensor".into(), bytes[..mid].to_vec()));
    let mut v = bytes.to_vec();
    v[4] = 99; // version
    cases.push(("an unknown version".into(), v));
    let mut v = bytes.to_vec();
    v[16..24].copy_from_slice(&u64::MAX.to_le_bytes()); // metadata count
    cases.push(("a metadata count of 2^64 - 1".into(), v));
    let mut v = bytes.to_vec();
    v[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes()); // tensor count
    cases.push(("a tensor count of 2^40".into(), v));
    for (what, b) in &cases {
        let src = dir.join("damaged.gguf");
        std::fs::write(&src, b).unwrap();
        refused(
            &[
                "compress",
                src.to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
            ],
            &["damaged.gguf"],
        );
        assert!(!out.exists(), "{what}: output left");
        refused(&["inspect", src.to_str().unwrap()], &["damaged.gguf"]);
        only(&dir, &["damaged.gguf"]);
    }
    eprintln!("{} damaged GGUF files", cases.len());
}

/// stdout of `entrollm ARGS`, or its exit code and stderr.
fn output(args: &[&str]) -> Result<String, (Option<i32>, String)> {
    let out = Command::new(env!("CARGO_BIN_EXE_entrollm"))
        .args(args)
        .output()
        .unwrap();
    match out.status.success() {
        true => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        false => Err((
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )),
    }
}

#[test]
fn run_on_smollm2s_container_with_a_flipped_byte_gives_the_same_text_or_names_the_tensor() {
    let gguf = entrollm_model::load::smollm2_gguf_path();
    assert!(
        gguf.exists(),
        "{} not found: run scripts/fetch-smollm2",
        gguf.display()
    );
    let dir = tmp("run-flip");
    let c = dir.join("c");
    ok(&[
        "compress",
        gguf.to_str().unwrap(),
        "-o",
        c.to_str().unwrap(),
    ]);
    let run = |m: &Path| {
        output(&[
            "run",
            m.to_str().unwrap(),
            "-p",
            "The capital of France is",
            "-n",
            "4",
            "-q",
            "--device",
            "cpu",
        ])
    };
    let want = run(&c).unwrap();
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(c.join("entrollm.json")).unwrap()).unwrap();
    let tensors = manifest["tensors"].as_array().unwrap().clone();
    let s = shard(&c);
    let good = std::fs::read(&s).unwrap();
    let (_, spans) = safetensors_boundaries(&good);
    let damaged = dir.join("damaged");
    copy_dir(&c, &damaged);
    let ds = damaged.join(s.file_name().unwrap());
    let (mut refused, mut same) = (0, 0);
    // Every 48th array, and the stored GGUF header (tokenizer, chat template, metadata).
    for (key, a, b) in spans
        .iter()
        .enumerate()
        .filter(|(i, (k, ..))| i % 48 == 0 || k.starts_with("__entrollm__"))
        .map(|(_, t)| t)
    {
        let mut bytes = good.clone();
        bytes[(a + b) / 2] ^= 0x10;
        std::fs::write(&ds, &bytes).unwrap();
        match run(&damaged) {
            Ok(text) => {
                assert_eq!(text, want, "{key}: other text");
                same += 1;
            }
            Err((code, err)) => {
                assert_eq!(code, Some(1), "{key}: {err}");
                let name = tensor_of(key, &tensors);
                let name = name.strip_prefix("__entrollm__.prefix.").unwrap_or(name);
                assert!(
                    err.contains(name),
                    "{key}: {err} names neither it nor its file"
                );
                refused += 1;
            }
        }
    }
    assert!(refused > 40, "{refused} refused, {same} the same");
    eprintln!("run: {refused} refused naming the tensor, {same} the same text");
}
