//! End-to-end tests of the `entrollm` binary: synth → compress → decompress is bit-exact for every
//! coder and dtype, and damaged containers fail with a message naming the tensor (never a panic).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn entrollm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_entrollm"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn ok(args: &[&str]) -> Output {
    let out = entrollm(args);
    assert!(
        out.status.success(),
        "entrollm {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Fails with exit code 1 (not a panic's 101) and returns stderr.
fn fails(args: &[&str]) -> String {
    let out = entrollm(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(1),
        "entrollm {args:?} should fail cleanly: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn tmp(name: &str) -> common::Scratch {
    common::Scratch::new("cli", name)
}

/// Copies the files of directory `from` into `to` (created).
fn copy_files(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn assert_same_dirs(a: &Path, b: &Path) {
    let mut names: Vec<_> = std::fs::read_dir(a)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    let mut other: Vec<_> = std::fs::read_dir(b)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    other.sort();
    assert_eq!(names, other);
    for n in names {
        assert!(
            std::fs::read(a.join(&n)).unwrap() == std::fs::read(b.join(&n)).unwrap(),
            "{n:?} differs"
        );
    }
}

/// compress SRC → C (with `extra` options), decompress C → BACK, check BACK equals SRC file for
/// file, and return `inspect C --json`.
fn round_trip(src: &Path, c: &Path, back: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["compress", src.to_str().unwrap(), "-o", c.to_str().unwrap()];
    args.extend_from_slice(extra);
    ok(&args);
    ok(&[
        "decompress",
        c.to_str().unwrap(),
        "-o",
        back.to_str().unwrap(),
    ]);
    assert_same_dirs(src, back);
    serde_json::from_slice(&ok(&["inspect", c.to_str().unwrap(), "--json"]).stdout).unwrap()
}

#[test]
fn synth_compress_decompress_is_bit_exact() {
    let d = tmp("roundtrip");
    for (dtype, coder, coding) in [
        ("bf16", "dtans", "auto"),
        ("fp16", "dtans", "auto"),
        ("bf16", "df11", "auto"),
        ("bf16", "dtans", "pair:10:64:16"),
    ] {
        let src = d.join(format!("src-{dtype}"));
        if !src.exists() {
            ok(&[
                "synth",
                "--shape",
                "tiny",
                "--dtype",
                dtype,
                "--seed",
                "3",
                "-o",
                src.to_str().unwrap(),
                "--shard-size",
                "1000000",
            ]);
        }
        let c = d.join(format!("c-{dtype}-{coder}-{}", coding.replace(':', "_")));
        let back = d.join(format!("back-{dtype}-{coder}-{}", coding.replace(':', "_")));
        let v = round_trip(&src, &c, &back, &["--coder", coder, "--coding", coding]);
        assert!(v["totals"]["coded_tensors"].as_u64().unwrap() >= 16, "{v}");
        let bpw = v["totals"]["coded_bits_per_weight"].as_f64().unwrap();
        assert!(
            bpw < if dtype == "bf16" { 13.0 } else { 15.0 },
            "{coder} {dtype}: {bpw} bits/weight"
        );
    }
}

/// Coding in parallel does not change the container: one and two threads write the same bytes.
#[test]
fn compress_output_does_not_depend_on_the_thread_count() {
    let d = tmp("threads");
    let src = d.join("src");
    ok(&[
        "synth",
        "--shape",
        "tiny",
        "--seed",
        "6",
        "-o",
        src.to_str().unwrap(),
        "--shard-size",
        "1000000",
    ]);
    for threads in ["1", "2"] {
        let c = d.join(format!("c{threads}"));
        ok(&[
            "--threads",
            threads,
            "compress",
            src.to_str().unwrap(),
            "-o",
            c.to_str().unwrap(),
            "--shard-size",
            "3000000",
        ]);
    }
    assert!(std::fs::read_dir(d.join("c1")).unwrap().count() > 3);
    assert_same_dirs(&d.join("c1"), &d.join("c2"));
}

#[test]
fn damaged_containers_fail_naming_the_tensor() {
    let d = tmp("damage");
    let src = d.join("src");
    ok(&[
        "synth",
        "--shape",
        "tiny",
        "--seed",
        "4",
        "-o",
        src.to_str().unwrap(),
    ]);
    let good = d.join("good");
    ok(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        good.to_str().unwrap(),
        "--coder",
        "dtans",
    ]);
    let copy = |name: &str| {
        let p = d.join(name);
        copy_files(&good, &p);
        p
    };
    let shard = |p: &Path| {
        std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .unwrap()
    };
    let manifest = |p: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p.join("entrollm.json")).unwrap()).unwrap()
    };

    // Truncated shard.
    let p = copy("truncated");
    let s = shard(&p);
    let bytes = std::fs::read(&s).unwrap();
    std::fs::write(&s, &bytes[..bytes.len() - 1000]).unwrap();
    let err = fails(&[
        "decompress",
        p.to_str().unwrap(),
        "-o",
        d.join("out1").to_str().unwrap(),
    ]);
    assert!(err.contains("safetensors"), "{err}");
    assert!(!d.join("out1").exists(), "no partial output");

    // Flipped bytes inside a coded tensor's stream: a decode error or checksum mismatch naming it.
    let p = copy("flipped");
    let m = manifest(&p);
    let t = m["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["storage"]["coder"] == "dtans" || t.get("coder").is_some())
        .cloned();
    let s = shard(&p);
    let mut bytes = std::fs::read(&s).unwrap();
    let n = bytes.len();
    for i in (n / 2..n / 2 + 64).step_by(7) {
        bytes[i] ^= 0x5A;
    }
    std::fs::write(&s, &bytes).unwrap();
    let err = fails(&[
        "decompress",
        p.to_str().unwrap(),
        "-o",
        d.join("out2").to_str().unwrap(),
    ]);
    assert!(
        err.contains("tensor") || err.contains("model."),
        "{err} (a coded tensor: {t:?})"
    );
    assert!(!d.join("out2").exists());

    // Edited metadata: a coded tensor's slice width changed.
    let p = copy("edited");
    let text = std::fs::read_to_string(p.join("entrollm.json")).unwrap();
    let edited =
        text.replacen("\"sc\": 64", "\"sc\": 128", 1)
            .replacen("\"sc\":64", "\"sc\":128", 1);
    assert_ne!(text, edited, "the manifest has a dtans sc field");
    std::fs::write(p.join("entrollm.json"), edited).unwrap();
    let err = fails(&[
        "decompress",
        p.to_str().unwrap(),
        "-o",
        d.join("out3").to_str().unwrap(),
    ]);
    assert!(err.contains("model."), "{err}");

    // Wrong checksum of a coded tensor.
    let p = copy("checksum");
    let text = std::fs::read_to_string(p.join("entrollm.json")).unwrap();
    let mut m: serde_json::Value = serde_json::from_str(&text).unwrap();
    let tensors = m["tensors"].as_array_mut().unwrap();
    let coded = tensors
        .iter_mut()
        .find(|t| t.to_string().contains("dtans"))
        .unwrap();
    let name = coded["name"].as_str().unwrap().to_string();
    let key = if coded.get("xxh3").is_some() {
        "xxh3"
    } else {
        "checksum"
    };
    coded[key] = serde_json::json!("0123456789abcdef");
    std::fs::write(
        p.join("entrollm.json"),
        serde_json::to_string_pretty(&m).unwrap(),
    )
    .unwrap();
    let err = fails(&[
        "decompress",
        p.to_str().unwrap(),
        "-o",
        d.join("out4").to_str().unwrap(),
    ]);
    assert!(err.contains(&name), "{err} should name {name}");

    // Bad arguments.
    fails(&[
        "synth",
        "--shape",
        "gpt-5",
        "-o",
        d.join("x").to_str().unwrap(),
    ]);
    fails(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        d.join("y").to_str().unwrap(),
        "--coding",
        "pair:11:64",
    ]);
    fails(&[
        "compress",
        d.join("missing").to_str().unwrap(),
        "-o",
        d.join("z").to_str().unwrap(),
    ]);
    fails(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        good.to_str().unwrap(),
    ]);
}

#[test]
fn fp8_and_mixed_dtype_checkpoint_round_trips() {
    use entrollm_format::safetensors::write_safetensors;
    use entrollm_format::{Dtype, TensorView};
    let d = tmp("fp8");
    let src = d.join("src");
    std::fs::create_dir_all(&src).unwrap();
    // FP8 E4M3 codes with a skewed distribution, E5M2, a per-row F32 scale and an I32 tensor.
    let mut r = entrollm_codec::rng::SplitMix64::new(7);
    let mut next = || (r.next_u64() >> 33) as u32;
    let e4m3: Vec<u8> = (0..300 * 257)
        .map(|_| ((next() % 9) * (next() % 7) + 0x20) as u8 | (next() as u8 & 0x80))
        .collect();
    let e5m2: Vec<u8> = (0..64 * 512).map(|_| (next() % 40 + 0x30) as u8).collect();
    let scale: Vec<u8> = (0..300)
        .flat_map(|i| (1.0f32 + i as f32 / 300.0).to_le_bytes())
        .collect();
    let ids: Vec<u8> = (0..10i32).flat_map(|i| i.to_le_bytes()).collect();
    write_safetensors(
        &src.join("model.safetensors"),
        &[
            TensorView {
                name: "w.weight",
                dtype: Dtype::F8E4M3,
                shape: &[300, 257],
                bytes: &e4m3,
            },
            TensorView {
                name: "w.weight_scale",
                dtype: Dtype::F32,
                shape: &[300, 1],
                bytes: &scale,
            },
            TensorView {
                name: "v.weight",
                dtype: Dtype::F8E5M2,
                shape: &[64, 512],
                bytes: &e5m2,
            },
            TensorView {
                name: "ids",
                dtype: Dtype::I32,
                shape: &[10],
                bytes: &ids,
            },
        ],
        None,
    )
    .unwrap();
    std::fs::write(src.join("config.json"), "{}").unwrap();
    let c = d.join("c");
    let back = d.join("back");
    let v = round_trip(&src, &c, &back, &[]);
    assert_eq!(v["totals"]["coded_tensors"], 2, "{v}");
    // df11 refuses a checkpoint without BF16 tensors, clearly.
    let err = fails(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        d.join("x").to_str().unwrap(),
        "--coder",
        "df11",
    ]);
    assert!(err.contains("BF16"), "{err}");
}

/// SmolLM2-135M-Instruct (fetched by scripts/fetch-smollm2; the test fails with how to get it).
fn smollm2() -> PathBuf {
    let path = entrollm_model::load::smollm2_gguf_path();
    assert!(
        path.exists(),
        "{} not found: run scripts/fetch-smollm2",
        path.display()
    );
    path
}

#[test]
fn chat_with_smollm2_answers_a_factual_question() {
    let gguf = smollm2();
    let mut child = Command::new(env!("CARGO_BIN_EXE_entrollm"))
        .args(["chat", gguf.to_str().unwrap(), "--max-tokens", "16"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"What is the capital of France?\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("Paris"), "{text}");
    let err = fails(&["run", gguf.to_str().unwrap(), "-p", "x", "--device", "tpu"]);
    assert!(err.contains("--device"), "{err}");
}

#[test]
fn perplexity_of_an_english_text_is_sane() {
    let gguf = smollm2();
    let text = "/usr/share/common-licenses/GPL-3";
    let out = ok(&[
        "eval",
        "ppl",
        gguf.to_str().unwrap(),
        "--file",
        text,
        "--window",
        "128",
        "--stride",
        "64",
        "--max-tokens",
        "256",
    ]);
    let line = String::from_utf8_lossy(&out.stdout).into_owned();
    let ppl: f64 = line
        .split("perplexity ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!((2.0..200.0).contains(&ppl), "{line}");
    assert!(line.contains("over 255 tokens"), "{line}");
    fails(&[
        "eval",
        "ppl",
        gguf.to_str().unwrap(),
        "--file",
        "/nonexistent.txt",
    ]);
}

#[test]
fn eval_against_a_reference_scores_the_same_windows() {
    let gguf = smollm2();
    let g = gguf.to_str().unwrap();
    let args = [
        "--file",
        "/usr/share/common-licenses/GPL-3",
        "--window",
        "96",
        "--stride",
        "40",
        "--max-tokens",
        "200",
        "--device",
        "cpu",
        "-q",
    ];
    let alone = ok(&[&["eval", "ppl", g][..], &args].concat());
    let alone = String::from_utf8_lossy(&alone.stdout).into_owned();
    let both = ok(&[&["eval", "ppl", g, "--reference", g][..], &args].concat());
    let both = String::from_utf8_lossy(&both.stdout).into_owned();
    let ppl = |line: &str| line.split("perplexity ").nth(1).unwrap()[..7].to_string();
    // The same windows as without a reference; a model against itself differs in nothing.
    assert_eq!(ppl(&alone), ppl(&both), "{alone}{both}");
    assert!(
        both.contains(&format!("(reference {}", ppl(&alone))),
        "{both}"
    );
    assert!(both.contains("mean 0.000000, max 0.000000 nats"), "{both}");
    assert!(both.contains("same top token 100.00 %"), "{both}");
    assert!(both.contains("largest logit difference 0.000e0"), "{both}");
    assert!(both.contains("(199 tokens"), "{both}");
    // 8-bit activations change the logits a little, never the windows.
    let q8 = ok(&[
        &["eval", "ppl", g, "--reference", g, "--activations", "q8"][..],
        &args,
    ]
    .concat());
    let q8 = String::from_utf8_lossy(&q8.stdout).into_owned();
    assert!(q8.contains(&format!("(reference {}", ppl(&alone))), "{q8}");
    assert!(!q8.contains("mean 0.000000,"), "{q8}");
    let same: f64 = q8.split("same top token ").nth(1).unwrap()[..5]
        .trim()
        .parse()
        .unwrap();
    assert!(same > 80.0, "{q8}");
}

#[test]
fn container_runs_through_the_fused_decode_matvec_like_the_original() {
    use entrollm_model::load::{ContainerSource, SafetensorsSource};
    use entrollm_model::{build_model, Engine};
    let d = tmp("fused");
    for (tag, dtype) in [
        ("bf16", &["--dtype", "bf16"][..]),
        ("fp8", &["--dtype", "fp8-e4m3", "--entropy", "2.1"][..]),
    ] {
        let src = d.join(format!("src-{tag}"));
        let c = d.join(format!("c-{tag}"));
        let mut args = vec![
            "synth",
            "--shape",
            "tiny",
            "--seed",
            "5",
            "-o",
            src.to_str().unwrap(),
        ];
        args.extend_from_slice(dtype);
        ok(&args);
        // Every matrix dtANS: what the fused decode-matvec serves.
        let (s, cs) = (src.to_str().unwrap(), c.to_str().unwrap());
        ok(&["compress", s, "-o", cs, "--coder", "dtans"]);
        let dense = build_model(&SafetensorsSource::open(&src).unwrap()).unwrap();
        let fused = build_model(&ContainerSource::open(&c, true).unwrap()).unwrap();
        let decoded = build_model(&ContainerSource::open(&c, false).unwrap()).unwrap();
        assert!(
            fused.layers[0].q.stored_bytes() < dense.layers[0].q.stored_bytes(),
            "{tag}: the container's matrices stay coded"
        );
        let prompt: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 1000).collect();
        let mut engines: Vec<Engine> = [dense, fused, decoded]
            .into_iter()
            .map(|w| Engine::new(w, 64).unwrap())
            .collect();
        let mut logits: Vec<Vec<f32>> = engines
            .iter_mut()
            .map(|e| e.prefill(&prompt).unwrap())
            .collect();
        let argmax = |l: &[f32]| {
            l.iter()
                .enumerate()
                .max_by(|x, y| x.1.total_cmp(y.1))
                .unwrap()
                .0 as u32
        };
        for _ in 0..8 {
            let scale = logits[0].iter().map(|x| x.abs()).fold(0f32, f32::max);
            for other in &logits[1..] {
                let diff = logits[0]
                    .iter()
                    .zip(other)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(
                    diff <= 1e-4 * scale.max(1.0),
                    "{tag}: logits differ by {diff}"
                );
                assert_eq!(argmax(&logits[0]), argmax(other), "{tag}");
            }
            let t = argmax(&logits[0]);
            logits = engines.iter_mut().map(|e| e.step(t).unwrap()).collect();
        }
    }
}

/// The issue's acceptance check for GGUF sources: SmolLM2's Q4_1 GGUF → container → the same GGUF
/// bit for bit; the container runs with the GGUF's greedy tokens (fused and decoded at load) and
/// perplexity, and `inspect` compares its bits per weight with the GGUF's.
#[test]
fn smollm2_gguf_container_is_lossless_and_runs_like_the_gguf() {
    let gguf = smollm2();
    let d = tmp("gguf");
    let (c, back) = (d.join("c"), d.join("back"));
    let (gs, cs) = (gguf.to_str().unwrap(), c.to_str().unwrap());
    ok(&["compress", gs, "-o", cs]);
    ok(&["decompress", cs, "-o", back.to_str().unwrap()]);
    let restored = back.join(gguf.file_name().unwrap());
    assert!(
        std::fs::read(&restored).unwrap() == std::fs::read(&gguf).unwrap(),
        "the restored GGUF differs"
    );

    let info: serde_json::Value =
        serde_json::from_slice(&ok(&["inspect", cs, "--json"]).stdout).unwrap();
    let totals = &info["totals"];
    // Q4_1 matrices (5 bits a weight) and the Q8_0 embedding (8.5).
    let source = totals["coded_source_bits_per_weight"].as_f64().unwrap();
    assert!(source > 5.0 && source < 8.5, "{totals}");
    let coded = totals["coded_bits_per_weight"].as_f64().unwrap();
    // Smaller than the GGUF by at least half the headroom its entropy leaves (codes and scales).
    let bound = totals["coded_entropy_bound_bpw"].as_f64().unwrap();
    assert!(coded < source - (source - bound) / 2.0, "{totals}");
    assert!(totals["stored_bytes"].as_f64() < totals["source_bytes"].as_f64());
    let embd = &info["tensors"][0];
    assert_eq!(embd["name"], "token_embd.weight");
    assert_eq!(embd["dtype"], "Q8_0");
    assert_eq!(embd["shape"], serde_json::json!([49152, 576]));
    // 576 columns are too narrow for dtANS's tiles to pay: codes and scales rANS-coded instead,
    // within a hundredth of a bit of the codes' entropy.
    assert_eq!(embd["coder"], "dtans-blocks", "{embd}");
    let streams = &embd["coding"]["stats"]["streams"];
    assert_eq!(streams[0]["coding"], "rans", "{embd}");
    let codes_bpw = streams[0]["bits_per_weight"].as_f64().unwrap();
    assert!(
        codes_bpw < embd["entropy_bits"].as_f64().unwrap() + 0.01,
        "{embd}"
    );

    for prompt in [
        "The capital of France is",
        "def fibonacci(n):",
        "Water boils at",
    ] {
        let run = |m: &str, extra: &[&str]| {
            let mut args = vec!["run", m, "-p", prompt, "--max-tokens", "24"];
            args.extend_from_slice(extra);
            String::from_utf8(ok(&args).stdout).unwrap()
        };
        let reference = run(gs, &[]);
        assert!(!reference.trim().is_empty(), "{prompt}: no tokens");
        assert_eq!(
            run(cs, &[]),
            reference,
            "{prompt}: container, decoded at load"
        );
        assert_eq!(
            run(cs, &["--keep-coded"]),
            reference,
            "{prompt}: container through the fused decode-matvec"
        );
    }

    let ppl = |m: &str| {
        let out = ok(&[
            "eval",
            "ppl",
            m,
            "--file",
            "/usr/share/common-licenses/GPL-3",
            "--window",
            "128",
            "--stride",
            "64",
            "--max-tokens",
            "512",
        ]);
        String::from_utf8(out.stdout).unwrap()
    };
    let (pg, pc) = (ppl(gs), ppl(cs));
    assert!(pg.contains("perplexity"), "{pg}");
    assert_eq!(pc.replace(cs, gs), pg, "perplexity GGUF vs container");
}

/// What a llama.cpp user types works, and what they see: the short flags and aliases, a system
/// prompt, negative values parsed as values, the timing line (and `-q`), a full context's stop
/// and its shift, errors that name the flag that fixes them; `inspect` of the GGUF predicts what
/// `compress` then does; `decompress -o FILE.gguf` writes that file.
#[test]
fn llama_cpp_flags_stops_and_the_first_ten_minutes() {
    let gguf = smollm2();
    let gs = gguf.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["run", gs, "-t", "2"];
        args.extend_from_slice(extra);
        let out = ok(&args);
        (
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };
    let (text, err) = run(&[
        "-p",
        "The capital of France is",
        "-n",
        "8",
        "--temp",
        "0",
        "-s",
        "3",
        "-c",
        "64",
        "--min-p",
        "0.05",
        "--repeat-penalty",
        "1.0",
        "--top-k",
        "40",
    ]);
    assert!(text.contains("Paris"), "{text}");
    assert!(
        err.contains("[ prompt ") && err.contains("tok/s") && err.contains("bits/weight"),
        "{err}"
    );
    let (_, quiet) = run(&["-p", "The capital of France is", "-n", "4", "-q"]);
    assert!(!quiet.contains("[ prompt "), "{quiet}");
    // A full context says so and names the options; the shift goes on past it.
    let (short, err) = run(&["-p", "Once upon a time", "-n", "64", "-c", "24"]);
    assert!(
        err.contains("context of 24 tokens is full") && err.contains("--context-shift"),
        "{err}"
    );
    let (long, err) = run(&[
        "-p",
        "Once upon a time",
        "-n",
        "40",
        "-c",
        "24",
        "--context-shift",
    ]);
    assert!(!err.contains("is full"), "{err}");
    assert!(long.len() > short.len(), "{short:?} vs {long:?}");
    let long_prompt = "word ".repeat(40);
    let e = fails(&["run", gs, "-p", &long_prompt, "-c", "16"]);
    assert!(e.contains("raise --context (-c)"), "{e}");
    let e = fails(&["run", gs, "-p", "x", "--temperature", "-1"]);
    assert!(e.contains("-1") && e.contains("--temperature"), "{e}");
    let e = fails(&["run", gs, "-p", "x", "--min-p", "2"]);
    assert!(e.contains("min_p") && e.contains("--min-p"), "{e}");
    // A system prompt, llama.cpp's spelling: it replaces the template's default one.
    let chat = |extra: &[&str]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_entrollm"))
            .args(["chat", gs, "-n", "16"])
            .args(extra)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        let q = b"What is the capital of France?\n";
        child.stdin.take().unwrap().write_all(q).unwrap();
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        let prompt = err
            .split("[ prompt ")
            .nth(1)
            .and_then(|r| r.split(' ').next());
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            prompt.map(str::to_string),
        )
    };
    let (answer, with) = chat(&["-sys", "You are a helpful assistant. Answer briefly."]);
    assert!(answer.contains("Paris"), "{answer}");
    let (_, without) = chat(&[]);
    assert!(with.is_some() && with != without, "{with:?} {without:?}");

    // inspect before compressing predicts what compress stores.
    let info: serde_json::Value =
        serde_json::from_slice(&ok(&["inspect", gs, "--json"]).stdout).unwrap();
    let predicted: f64 = info["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["predicted_bytes"].as_f64())
        .sum();
    assert!(predicted > 0.0, "{}", info["totals"]);
    let table = String::from_utf8(ok(&["inspect", gs]).stdout).unwrap();
    assert!(table.contains("compress would code"), "{table}");
    let d = tmp("first-ten");
    let c = d.join("c");
    let cs = c.to_str().unwrap();
    ok(&["compress", gs, "-o", cs]);
    let coded: serde_json::Value =
        serde_json::from_slice(&ok(&["inspect", cs, "--json"]).stdout).unwrap();
    let stored: f64 = coded["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["coder"].is_string())
        .filter_map(|t| t["stored_bytes"].as_f64())
        .sum();
    assert!(
        (stored - predicted).abs() < 0.01 * predicted,
        "{stored} vs {predicted}"
    );
    assert!(coded["totals"]["stored_bytes"].as_f64() < coded["totals"]["source_bytes"].as_f64());
    // Again without --overwrite: the error names it. Into a file: the GGUF itself.
    let e = fails(&["compress", gs, "-o", cs]);
    assert!(e.contains("--overwrite"), "{e}");
    let file = d.join("back.gguf");
    ok(&["decompress", cs, "-o", file.to_str().unwrap()]);
    assert!(std::fs::read(&file).unwrap() == std::fs::read(&gguf).unwrap());
    let e = fails(&["decompress", cs, "-o", file.to_str().unwrap()]);
    assert!(e.contains("--overwrite"), "{e}");
    ok(&[
        "decompress",
        cs,
        "-o",
        file.to_str().unwrap(),
        "--overwrite",
    ]);
    let names: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "nothing left beside the outputs: {names:?}");
}

/// A GGUF with a zero tail longer than a container restores is refused before any work, with the
/// command that trims it; nothing is left behind (it used to be coded, then fail its own read-back
/// naming a deleted staging directory).
#[test]
fn gguf_with_a_long_zero_tail_is_refused_before_any_work() {
    let golden =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/gguf_dequant.gguf");
    let d = tmp("zero-tail");
    let src = d.join("m.gguf");
    let mut bytes = std::fs::read(&golden).unwrap();
    let len = bytes.len();
    bytes.resize(len + (2 << 20), 0);
    std::fs::write(&src, &bytes).unwrap();
    let out = d.join("c");
    let e = fails(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(
        e.contains("zero bytes") && e.contains(&format!("truncate -s {len}")),
        "{e}"
    );
    let names: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, [std::ffi::OsString::from("m.gguf")], "{names:?}");
    // Trimmed as told, it compresses and comes back.
    bytes.truncate(len);
    std::fs::write(&src, &bytes).unwrap();
    ok(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--min-elements",
        "256",
    ]);
}

/// Every ggml type of the reader's golden file (F32, F16, the Q4/Q5/Q8 block types, k-quants),
/// coded where it can be or kept as it is, comes back byte for byte.
#[test]
fn gguf_of_every_block_type_round_trips() {
    let gguf = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/data/gguf_dequant.gguf")
        .canonicalize()
        .unwrap();
    let d = tmp("gguf-types");
    let (c, back) = (d.join("c"), d.join("back"));
    let cs = c.to_str().unwrap();
    ok(&[
        "compress",
        gguf.to_str().unwrap(),
        "-o",
        cs,
        "--min-elements",
        "256",
    ]);
    ok(&["decompress", cs, "-o", back.to_str().unwrap()]);
    assert!(
        std::fs::read(back.join("gguf_dequant.gguf")).unwrap() == std::fs::read(&gguf).unwrap(),
        "the restored GGUF differs"
    );
    let info: serde_json::Value =
        serde_json::from_slice(&ok(&["inspect", cs, "--json"]).stdout).unwrap();
    let tensors = info["tensors"].as_array().unwrap();
    let row = |name: &str| tensors.iter().find(|t| t["name"] == name).unwrap();
    for ty in ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "F16"] {
        let r = row(ty);
        assert_eq!(r["dtype"], ty, "{r}");
        assert_eq!(r["shape"], serde_json::json!([2, 256]), "{r}");
    }
    // Whatever coding would not shrink stays plain.
    assert!(
        tensors.iter().all(
            |t| t["coder"].is_null() || t["stored_bytes"].as_f64() < t["source_bytes"].as_f64()
        ),
        "a coded tensor is smaller than its source"
    );
}

/// A model quantised by llama.cpp's own `llama-quantize`, one type a matrix (Q2_K … Q6_K, IQ4_NL,
/// IQ4_XS, Q8_0; tools/gen_kquant_testdata.sh): the container restores the GGUF byte for byte,
/// codes the k-quant matrices where that pays (`dtans-blocks`: codes and side fields), reports
/// each one's entropy bound, and runs with the GGUF's tokens, decoded at load and kept coded.
#[test]
fn llama_quantize_k_quants_round_trip_and_run_like_the_gguf() {
    let gguf = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/data/gguf_kquants.gguf")
        .canonicalize()
        .unwrap();
    let gs = gguf.to_str().unwrap();
    let d = tmp("gguf-kquants");
    let (c, back) = (d.join("c"), d.join("back"));
    let cs = c.to_str().unwrap();
    ok(&["compress", gs, "-o", cs]);
    ok(&["decompress", cs, "-o", back.to_str().unwrap()]);
    assert!(
        std::fs::read(back.join("gguf_kquants.gguf")).unwrap() == std::fs::read(&gguf).unwrap(),
        "the restored GGUF differs"
    );
    let info: serde_json::Value =
        serde_json::from_slice(&ok(&["inspect", cs, "--json"]).stdout).unwrap();
    let tensors = info["tensors"].as_array().unwrap();
    let row = |name: &str| tensors.iter().find(|t| t["name"] == name).unwrap();
    let mut coded = 0;
    for (name, ty) in [
        ("blk.0.attn_q.weight", "Q2_K"),
        ("blk.0.attn_k.weight", "Q3_K"),
        ("blk.0.attn_v.weight", "Q4_K"),
        ("blk.0.attn_output.weight", "Q5_K"),
        ("blk.0.ffn_gate.weight", "Q6_K"),
        ("blk.0.ffn_up.weight", "IQ4_NL"),
        ("blk.0.ffn_down.weight", "IQ4_XS"),
    ] {
        let r = row(name);
        assert_eq!(r["dtype"], ty, "{r}");
        if r["coder"] == "dtans-blocks" {
            coded += 1;
            assert!(
                r["stored_bytes"].as_f64() < r["source_bytes"].as_f64(),
                "{r}"
            );
            let (bound, bpw) = (
                r["entropy_bound_bpw"].as_f64().unwrap(),
                r["bits_per_weight"].as_f64().unwrap(),
            );
            assert!(bound > 1.0 && bound <= bpw, "{r}");
            assert!(r["detail"].as_str().unwrap().contains("codes"), "{r}");
        } else {
            assert!(r["coder"].is_null(), "{r}");
        }
    }
    assert!(coded >= 3, "{coded} of the k-quant matrices coded smaller");
    assert!(info["totals"]["stored_bytes"].as_f64() < info["totals"]["source_bytes"].as_f64());
    for prompt in ["hello world", "the cat"] {
        let run = |m: &str, extra: &[&str]| {
            let mut args = vec![
                "run",
                m,
                "-p",
                prompt,
                "--max-tokens",
                "12",
                "--device",
                "cpu",
            ];
            args.extend_from_slice(extra);
            String::from_utf8(ok(&args).stdout).unwrap()
        };
        let reference = run(gs, &[]);
        assert_eq!(run(cs, &[]), reference, "{prompt}: decoded at load");
        assert_eq!(
            run(cs, &["--keep-coded"]),
            reference,
            "{prompt}: kept coded"
        );
    }
}

#[test]
fn bf16_palette_conflicts_are_clear_errors() {
    // Checked before any GPU or checkpoint work, so these fail the same on any machine.
    let err = fails(&["bench", "--synth", "tiny", "--coded", "--bf16", "palette"]);
    assert!(
        err.contains("--coded codes the BF16 matrices; --bf16 palette packs them"),
        "{err}"
    );
    let err = fails(&["bench", "--synth", "tiny", "--coded", "--budget", "1GB"]);
    assert!(
        err.contains("--budget/--plan/--tune choose every launch's form"),
        "{err}"
    );
    let err = fails(&[
        "bench",
        "no-such-model",
        "--bf16",
        "palette",
        "--code-at-load",
        "auto",
    ]);
    assert!(err.contains("--bf16 palette and --code-at-load"), "{err}");
    let err = fails(&[
        "run",
        "no-such-model",
        "-p",
        "hi",
        "--bf16",
        "palette",
        "--code-at-load",
        "auto",
    ]);
    assert!(err.contains("--bf16 palette and --code-at-load"), "{err}");
    // A value that is neither form is clap's usage error (exit code 2), naming the choices.
    let out = entrollm(&["bench", "--synth", "tiny", "--bf16", "packed"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected dense or palette"));
}

/// The GPU decode options are parsed before any work, from the flags or (the benchmark scripts)
/// the environment; a bad value names where it came from and the values it takes.
#[test]
fn bad_decode_options_name_the_flag_or_variable() {
    let err = fails(&["bench", "--synth", "tiny", "--decode-norm", "merged"]);
    assert!(
        err.contains("--decode-norm: decode norm `merged`: expected chained|split|fused"),
        "{err}"
    );
    let err = fails(&["run", "nowhere.gguf", "-p", "hi", "--decode-chunk", "64"]);
    assert!(
        err.contains("--decode-chunk: decode chunk `64`: expected POSITIONSxWARPS"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_entrollm"))
        .args(["bench", "--synth", "tiny"])
        .env("ENTROLLM_DECODE_PDL", "maybe")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("ENTROLLM_DECODE_PDL: decode pdl `maybe`: expected on|off|all"),
        "{err}"
    );
}

/// An output equal to its input, inside it or containing it (through a symlink too) is refused
/// before any work, even with --overwrite, and the source is left as it was.
#[test]
fn outputs_overlapping_their_input_are_refused_and_the_source_kept() {
    let d = tmp("apart");
    let src = d.join("d/S");
    ok(&[
        "synth",
        "--shape",
        "tiny",
        "--seed",
        "1",
        "-o",
        src.to_str().unwrap(),
    ]);
    std::fs::write(d.join("d/keep.txt"), b"mine").unwrap();
    std::os::unix::fs::symlink(&src, d.join("link")).unwrap();
    let before = d.join("before");
    copy_files(&src, &before);
    let s = src.to_str().unwrap();
    let parent = d.join("d");
    let inner = src.join("inner");
    let link = d.join("link");
    for (input, out, rel) in [
        (s, s, "is"),
        (s, parent.to_str().unwrap(), "contains"),
        (s, inner.to_str().unwrap(), "is inside"),
        (link.to_str().unwrap(), s, "is"),
    ] {
        let err = fails(&["compress", input, "-o", out, "--overwrite"]);
        assert!(
            err.contains(&format!("{rel} the input")),
            "{input} -> {out}: {err}"
        );
    }
    assert_same_dirs(&before, &src);
    assert_eq!(std::fs::read(d.join("d/keep.txt")).unwrap(), b"mine");
    // The same for decompress and its container.
    let c = d.join("c");
    ok(&["compress", s, "-o", c.to_str().unwrap()]);
    let inside = c.join("restored");
    for out in [c.to_str().unwrap(), inside.to_str().unwrap()] {
        let err = fails(&["decompress", c.to_str().unwrap(), "-o", out, "--overwrite"]);
        assert!(err.contains("the input"), "{out}: {err}");
    }
    assert!(c.join("entrollm.json").is_file() && !inside.exists());
}

/// A thread count past any machine's is a clean error (exit 1) at once, not a stalled machine.
#[test]
fn thread_counts_are_capped_with_a_clear_error() {
    for n in ["0", "5000", "100000"] {
        let t = std::time::Instant::now();
        let err = fails(&["--threads", n, "inspect", "no-such-path"]);
        assert!(
            err.contains(&format!("--threads {n}: expected 1 to 1024")),
            "{err}"
        );
        assert!(
            t.elapsed().as_secs() < 10,
            "--threads {n} took {:?}",
            t.elapsed()
        );
    }
}

/// Every file of a source directory is kept: subdirectories, hidden files, links by their content
/// (as a Hugging Face cache snapshot holds every file), restored under the same names; a file that
/// cannot be kept exactly is an error naming it, with nothing written.
#[test]
fn compress_keeps_every_file_or_names_the_one_it_cannot() {
    let d = tmp("keep-all");
    let src = d.join("snap");
    ok(&[
        "synth",
        "--shape",
        "tiny",
        "--seed",
        "2",
        "-o",
        src.to_str().unwrap(),
    ]);
    // The snapshot's config.json a link to a blob outside it, as in ~/.cache/huggingface.
    let blobs = d.join("blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::rename(src.join("config.json"), blobs.join("c0ffee")).unwrap();
    std::os::unix::fs::symlink(blobs.join("c0ffee"), src.join("config.json")).unwrap();
    std::fs::create_dir_all(src.join("original/sub")).unwrap();
    std::fs::write(src.join("original/params.json"), b"{\"dim\": 192}").unwrap();
    std::fs::write(src.join("original/sub/notes.txt"), b"deep").unwrap();
    std::fs::write(src.join(".gitattributes"), b"*.safetensors filter=lfs").unwrap();
    std::os::unix::fs::symlink("original/params.json", src.join("params-link.json")).unwrap();
    let c = d.join("c");
    let out = ok(&["compress", src.to_str().unwrap(), "-o", c.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("config.json links outside the checkpoint directory"),
        "{err}"
    );
    let back = d.join("back");
    ok(&[
        "decompress",
        c.to_str().unwrap(),
        "-o",
        back.to_str().unwrap(),
    ]);
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "original/params.json",
        "original/sub/notes.txt",
        ".gitattributes",
        "params-link.json",
    ] {
        assert_eq!(
            std::fs::read(back.join(name)).unwrap(),
            std::fs::read(src.join(name)).unwrap(),
            "{name}"
        );
    }
    // A FIFO, and a name that is not UTF-8: refused by name, nothing left behind.
    for (bad, what) in [("pipe", "not a regular file"), ("latin-1", "not UTF-8")] {
        let p = match bad {
            "pipe" => {
                let p = src.join("pipe");
                let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
                p
            }
            _ => {
                use std::os::unix::ffi::OsStrExt;
                let p = src.join(std::ffi::OsStr::from_bytes(b"caf\xe9.txt"));
                std::fs::write(&p, b"latin-1").unwrap();
                p
            }
        };
        let out = d.join("refused");
        let err = fails(&[
            "compress",
            src.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ]);
        assert!(
            err.contains("cannot keep this file") && err.contains(what),
            "{err}"
        );
        assert!(!out.exists());
        let leftovers: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains("partial"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        std::fs::remove_file(&p).unwrap();
    }
}

/// A safetensors file of one `rows × cols` BF16 matrix with Gaussian-like values (enough work
/// for compress to be caught mid-way).
fn big_safetensors(path: &Path, rows: usize, cols: usize) {
    let n = rows * cols;
    let header = format!(
        "{{\"w\":{{\"dtype\":\"BF16\",\"shape\":[{rows},{cols}],\"data_offsets\":[0,{}]}}}}",
        2 * n
    );
    let mut header = header.into_bytes();
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + header.len() + 2 * n);
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(&header);
    let mut r = entrollm_codec::rng::SplitMix64::new(1);
    for _ in 0..n {
        let mut u = 0.0f32;
        for _ in 0..4 {
            u += (r.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        }
        let v = (u - 2.0) * 0.02;
        out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
    }
    std::fs::write(path, out).unwrap();
}

/// Ctrl-C and SIGTERM in the middle of compress remove the partial output and exit as the signal
/// would; what a SIGKILL leaves is removed by the next run beside the same output.
#[test]
fn interrupted_compress_leaves_nothing() {
    use std::time::{Duration, Instant};
    let d = tmp("interrupt");
    let src = d.join("big.safetensors");
    big_safetensors(&src, 8192, 8192);
    let partials = || -> Vec<String> {
        std::fs::read_dir(&d)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".partial-") || n.contains(".old-"))
            .collect()
    };
    let out = d.join("c");
    for (sig, code) in [
        (libc::SIGINT, 130),
        (libc::SIGTERM, 143),
        (libc::SIGKILL, -1),
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_entrollm"))
            .args(["--threads", "1", "compress"])
            .arg(&src)
            .arg("-o")
            .arg(&out)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while partials().is_empty() && t.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!partials().is_empty(), "no staging directory appeared");
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
        let status = child.wait().unwrap();
        assert!(
            !out.exists(),
            "signal {sig}: partial output at the destination"
        );
        if sig == libc::SIGKILL {
            assert!(
                !partials().is_empty(),
                "SIGKILL leaves its staging directory"
            );
        } else {
            assert_eq!(status.code(), Some(code), "signal {sig}");
            assert!(partials().is_empty(), "signal {sig}: {:?}", partials());
        }
    }
    // The next run beside the same output removes the dead process's staging directory.
    ok(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(partials().is_empty(), "{:?}", partials());
    assert!(out.join("entrollm.json").is_file());
}

/// Runs the binary, failing the test if it runs past `secs` (a hang); returns (exit code, stderr).
fn within(secs: u64, args: &[&str]) -> (Option<i32>, String) {
    use std::io::Read;
    let mut child = Command::new(env!("CARGO_BIN_EXE_entrollm"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (status.code(), err);
        }
        if t.elapsed().as_secs() >= secs {
            let _ = child.kill();
            panic!("entrollm {args:?} still running after {secs} s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Inputs that are not regular files — a FIFO as a shard or manifest, JSON side files linked to
/// /dev/zero — are refused at once, naming the file, instead of blocking or reading forever.
#[test]
fn fifos_and_devices_as_inputs_are_refused_not_read() {
    let d = tmp("not-regular");
    let src = d.join("src");
    ok(&[
        "synth",
        "--shape",
        "tiny",
        "--seed",
        "4",
        "-o",
        src.to_str().unwrap(),
    ]);
    let c = d.join("c");
    ok(&["compress", src.to_str().unwrap(), "-o", c.to_str().unwrap()]);
    let fifo = |p: &Path| {
        std::fs::remove_file(p).unwrap();
        let cs = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(cs.as_ptr(), 0o644) }, 0);
    };
    let zero = |p: &Path| {
        std::fs::remove_file(p).unwrap();
        std::os::unix::fs::symlink("/dev/zero", p).unwrap();
    };
    let check = |args: &[&str], file: &Path, what: &str| {
        let (code, err) = within(20, args);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(
            err.contains(file.to_str().unwrap()) && err.contains(what),
            "{args:?}: {err}"
        );
    };
    // A container whose manifest, then whose shard, is a FIFO.
    let c1 = d.join("c1");
    ok(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        c1.to_str().unwrap(),
    ]);
    let manifest = c1.join("entrollm.json");
    fifo(&manifest);
    check(&["inspect", c1.to_str().unwrap()], &manifest, "a FIFO");
    let shard = c.join("entrollm-00001-of-00001.safetensors");
    fifo(&shard);
    let back = d.join("back");
    check(
        &[
            "decompress",
            c.to_str().unwrap(),
            "-o",
            back.to_str().unwrap(),
        ],
        &shard,
        "a FIFO",
    );
    // A checkpoint whose config.json is /dev/zero; one whose shard is a FIFO.
    let config = src.join("config.json");
    let kept = std::fs::read(&config).unwrap();
    zero(&config);
    let tune = d.join("tune.json");
    check(
        &["tune", src.to_str().unwrap(), "-o", tune.to_str().unwrap()],
        &config,
        "a device",
    );
    std::fs::remove_file(&config).unwrap();
    std::fs::write(&config, kept).unwrap();
    let st = src.join("model.safetensors");
    fifo(&st);
    let out = d.join("c2");
    check(
        &[
            "compress",
            src.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ],
        &st,
        "a FIFO",
    );
    assert!(!back.exists() && !out.exists());
}

/// The byte range of tensor `key` in a safetensors file.
fn tensor_range(shard: &Path, key: &str) -> std::ops::Range<usize> {
    let bytes = std::fs::read(shard).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let offs = &header[key]["data_offsets"];
    let (a, b) = (offs[0].as_u64().unwrap(), offs[1].as_u64().unwrap());
    8 + n + a as usize..8 + n + b as usize
}

/// A model built from a container serves no byte the manifest's checksums do not vouch for: a
/// zeroed norm weight (plain tensor), an edited config.json and a flipped byte of a GGUF
/// container's stored header are each an error naming what is damaged, not garbage output.
#[test]
fn loading_a_container_checks_plain_tensors_files_and_the_gguf_header() {
    let d = tmp("integrity");
    let src = d.join("src");
    ok(&[
        "synth",
        "--shape",
        "tiny",
        "--seed",
        "6",
        "-o",
        src.to_str().unwrap(),
    ]);
    let good = d.join("good");
    ok(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        good.to_str().unwrap(),
    ]);
    let copy = |name: &str| {
        let p = d.join(name);
        copy_files(&good, &p);
        p
    };
    let shard = |p: &Path| p.join("entrollm-00001-of-00001.safetensors");
    let load = |p: &Path| {
        let tune = d.join("t.json");
        let _ = std::fs::remove_file(&tune);
        fails(&[
            "tune",
            p.to_str().unwrap(),
            "--seconds",
            "0",
            "-o",
            tune.to_str().unwrap(),
        ])
    };
    let norm = "model.layers.1.post_attention_layernorm.weight";
    let p = copy("zeroed-norm");
    let r = tensor_range(&shard(&p), norm);
    let mut bytes = std::fs::read(shard(&p)).unwrap();
    bytes[r].fill(0);
    std::fs::write(shard(&p), bytes).unwrap();
    let err = load(&p);
    assert!(err.contains(norm) && err.contains("checksum"), "{err}");

    // The source's config.json, which the engine reads, is stored whole in the shard (the
    // container's own config.json is generated for transformers).
    let p = copy("edited-config");
    let r = tensor_range(&shard(&p), "__entrollm__.prefix.config.json");
    let mut bytes = std::fs::read(shard(&p)).unwrap();
    let at = r.start + bytes[r].iter().position(|&b| b == b'"').unwrap();
    bytes[at] = b'\'';
    std::fs::write(shard(&p), bytes).unwrap();
    let err = load(&p);
    assert!(err.contains("config.json"), "{err}");

    // A GGUF container (SmolLM2) whose stored header has one byte flipped.
    let gguf = std::path::PathBuf::from(std::env::var("HOME").unwrap())
        .join(".cache/entrollm/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    if gguf.is_file() {
        let c = d.join("gguf-c");
        ok(&[
            "compress",
            gguf.to_str().unwrap(),
            "-o",
            c.to_str().unwrap(),
        ]);
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(c.join("entrollm.json")).unwrap()).unwrap();
        let key = m["sources"][0]["prefix"]["key"]
            .as_str()
            .unwrap()
            .to_string();
        let s = shard(&c);
        let r = tensor_range(&s, &key);
        let mut bytes = std::fs::read(&s).unwrap();
        bytes[r.start + 200] ^= 0x20;
        std::fs::write(&s, bytes).unwrap();
        let err = fails(&[
            "run",
            c.to_str().unwrap(),
            "-p",
            "hi",
            "--device",
            "cpu",
            "--max-tokens",
            "1",
        ]);
        assert!(err.contains("stored header"), "{err}");
    }
}

/// A checkpoint of more tensors than a container's manifest can hold is refused before any work,
/// naming the source, instead of failing at the end naming a staging directory already gone.
#[test]
fn too_many_tensors_are_refused_before_any_work() {
    let d = tmp("many");
    let n = 1_250_000usize;
    let mut header = String::with_capacity(n * 72);
    header.push('{');
    for i in 0..n {
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            "\"t{i:07}\":{{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[{i},{}]}}",
            i + 1
        ));
    }
    header.push('}');
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + n, 7);
    let src = d.join("many.safetensors");
    std::fs::write(&src, bytes).unwrap();
    let out = d.join("c");
    let (code, err) = within(
        120,
        &[
            "compress",
            src.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("1250000 tensors need a manifest") && err.contains("many.safetensors"),
        "{err}"
    );
    assert!(!out.exists());
}

/// `compress --bits`: matrices coded lossily at the rate asked, the embedding and norms exact;
/// every command says the container is lossy; `decompress` writes the reconstruction and checks it.
#[test]
fn lossy_containers_code_at_the_rate_asked_and_restore_their_reconstruction() {
    use entrollm_format::Checkpoint;
    let d = tmp("lossy");
    let src = d.join("src");
    ok(&[
        "synth",
        "--shape",
        "tiny",
        "--dtype",
        "bf16",
        "--seed",
        "5",
        "-o",
        src.to_str().unwrap(),
    ]);
    // Tile quantisers (served by their tile decoder) and scalar ones (served by the dtANS form's
    // fused product of their codes).
    for q in ["tcq8", "e8", "int", "fp8"] {
        let scalar = matches!(q, "int" | "fp8");
        let c = d.join(format!("c-{q}"));
        let back = d.join(format!("back-{q}"));
        let out = ok(&[
            "compress",
            src.to_str().unwrap(),
            "-o",
            c.to_str().unwrap(),
            "--bits",
            "4",
            "--allocate",
            "uniform",
            "--quantizer",
            q,
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        let named = if q == "int" { "int-g128" } else { q };
        assert!(
            err.contains(&format!("coded with {named} at 4 bits")),
            "{err}"
        );
        let out = ok(&["inspect", c.to_str().unwrap(), "--json"]);
        assert!(String::from_utf8_lossy(&out.stderr).contains("lossy container"));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let mut lossy = 0;
        for t in v["tensors"].as_array().unwrap() {
            let name = t["name"].as_str().unwrap();
            if t["coder"] == "lossy" || t["coder"] == "dtans-scalar" {
                assert_eq!(t["coder"] == "dtans-scalar", scalar, "{name}");
                lossy += 1;
                let bpw = t["bits_per_weight"].as_f64().unwrap();
                assert!((bpw / 4.0 - 1.0).abs() < 0.01, "{name}: {bpw}");
                assert!(!name.contains("embed"), "{name}");
            }
        }
        assert!(lossy >= 7, "{v}");
        let out = ok(&[
            "decompress",
            c.to_str().unwrap(),
            "-o",
            back.to_str().unwrap(),
        ]);
        assert!(String::from_utf8_lossy(&out.stderr).contains("lossy container"));
        let (a, b) = (
            Checkpoint::open(&src).unwrap(),
            Checkpoint::open(&back).unwrap(),
        );
        let f = |b: &[u8]| -> Vec<f64> {
            b.chunks_exact(2)
                .map(|h| half::bf16::from_bits(u16::from_le_bytes([h[0], h[1]])).to_f64())
                .collect()
        };
        for t in a.tensors() {
            let r = b.tensor(t.name).unwrap();
            assert_eq!(r.shape, t.shape);
            if t.shape.len() == 2 && !t.name.contains("embed") && !t.name.contains("lm_head") {
                let (x, y) = (f(t.bytes), f(r.bytes));
                let e: f64 = x.iter().zip(&y).map(|(p, q)| (p - q).powi(2)).sum();
                let s: f64 = x.iter().map(|p| p * p).sum();
                let rel = (e / s).sqrt();
                // 4 bits: about 2^-4 (6.25 %), plus the quantiser's gap, BF16 rounding and the
                // metadata of matrices this small (row scales, tables: ~0.3 bit a weight; the
                // dtANS lanes' states and padding of 192-column rows cost scalar codes ~0.8 bit).
                let most = if scalar { 0.17 } else { 0.12 };
                assert!(rel > 0.03 && rel < most, "{q} {}: {rel}", t.name);
            } else {
                assert!(t.bytes == r.bytes, "{} is not exact", t.name);
            }
        }
        // Served kept coded (one tile decoded at a time), decoded at load, and as the restored
        // checkpoint: the same values, so the same logits.
        {
            use entrollm_model::load::{ContainerSource, SafetensorsSource};
            use entrollm_model::{build_model, Engine};
            let models = [
                build_model(&ContainerSource::open(&c, true).unwrap()).unwrap(),
                build_model(&ContainerSource::open(&c, false).unwrap()).unwrap(),
                build_model(&SafetensorsSource::open(&back).unwrap()).unwrap(),
            ];
            let form = if scalar { "dtans" } else { "lossy" };
            assert_eq!(models[0].layers[0].q.form().form, form);
            let prompt: Vec<u32> = (0..10).map(|i| (i * 37 + 5) % 1000).collect();
            let logits: Vec<Vec<f32>> = models
                .into_iter()
                .map(|w| Engine::new(w, 32).unwrap().prefill(&prompt).unwrap())
                .collect();
            let scale = logits[0].iter().map(|x| x.abs()).fold(0f32, f32::max);
            // Scalar codes are multiplied as scale × code, exactly; the reconstruction the
            // container decodes to is that rounded to BF16 (2^-9 of a weight at most).
            let tol = if scalar { 2e-2 } else { 1e-4 };
            for (i, l) in logits.iter().enumerate().skip(1) {
                let diff = l
                    .iter()
                    .zip(&logits[0])
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(diff <= tol * scale.max(1.0), "{q}: logits differ by {diff}");
                // Decoded at load and restored: the same values, the same logits.
                if i == 2 {
                    let d = l
                        .iter()
                        .zip(&logits[1])
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(d <= 1e-4 * scale.max(1.0), "{q}: {d}");
                }
            }
        }
        // The restored checkpoint is a checkpoint like any other.
        ok(&[
            "compress",
            back.to_str().unwrap(),
            "-o",
            d.join(format!("again-{q}")).to_str().unwrap(),
        ]);
        // Damaged lossy payloads: a decode error or a checksum mismatch naming the tensor, and no
        // output.
        let bad = d.join(format!("bad-{q}"));
        copy_files(&c, &bad);
        let shard = std::fs::read_dir(&bad)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .unwrap();
        let mut bytes = std::fs::read(&shard).unwrap();
        let n = bytes.len();
        for i in (n / 2..n / 2 + 64).step_by(7) {
            bytes[i] ^= 0x5A;
        }
        std::fs::write(&shard, &bytes).unwrap();
        let out = d.join(format!("out-{q}"));
        let err = fails(&[
            "decompress",
            bad.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ]);
        // (Where the middle of the shard falls depends on the quantiser's sizes.)
        assert!(err.contains("tensor 'model."), "{err}");
        assert!(!out.exists(), "no partial output");
    }
    let e = fails(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        d.join("x").to_str().unwrap(),
        "--bits",
        "4",
        "--coder",
        "df11",
    ]);
    assert!(e.contains("--bits"), "{e}");
    let e = fails(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        d.join("y").to_str().unwrap(),
        "--bits",
        "4",
        "--quantizer",
        "tcq7",
    ]);
    assert!(e.contains("--quantizer"), "{e}");
}

/// `compress --bits --quantizer int|fp8` of a GGUF's float matrices: a GGUF container whose lossy
/// matrices load kept coded in the dtans form (and decoded at load), giving the same logits within
/// the reconstruction's rounding, and restoring to a GGUF.
#[test]
fn scalar_lossy_gguf_containers_serve_their_codes_kept_coded() {
    use entrollm_model::load::open_weights;
    use entrollm_model::Engine;
    let gguf =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/gguf_tiny_llama.gguf");
    let d = tmp("scalar-gguf");
    for q in ["int", "fp8"] {
        let c = d.join(format!("c-{q}"));
        let flags = ["--bits", "5", "--quantizer", q, "--group", "32"];
        let mut args = vec![
            "compress",
            gguf.to_str().unwrap(),
            "-o",
            c.to_str().unwrap(),
            "--min-elements",
            "1024",
            "--allocate",
            "uniform",
        ];
        args.extend_from_slice(&flags);
        ok(&args);
        let v: serde_json::Value =
            serde_json::from_slice(&ok(&["inspect", c.to_str().unwrap(), "--json"]).stdout)
                .unwrap();
        let scalar: Vec<&str> = v["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["coder"] == "dtans-scalar")
            .map(|t| t["name"].as_str().unwrap())
            .collect();
        assert!(scalar.contains(&"blk.0.ffn_up.weight"), "{q}: {scalar:?}");
        let (coded, decoded) = (
            open_weights(&c, true).unwrap(),
            open_weights(&c, false).unwrap(),
        );
        assert_eq!(
            coded.layers[0].mlp.gated().unwrap().up.form().form,
            "dtans",
            "{q}"
        );
        assert_ne!(
            decoded.layers[0].mlp.gated().unwrap().up.form().form,
            "dtans",
            "{q}"
        );
        let prompt: Vec<u32> = (0..6).map(|i| (i * 13 + 3) % 90).collect();
        let logits: Vec<Vec<f32>> = [coded, decoded]
            .into_iter()
            .map(|w| Engine::new(w, 16).unwrap().prefill(&prompt).unwrap())
            .collect();
        let scale = logits[0].iter().map(|x| x.abs()).fold(1f32, f32::max);
        let diff = logits[0]
            .iter()
            .zip(&logits[1])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        // F32 matrices: the reconstruction is exactly scale × code; F16 ones round it.
        assert!(diff <= 1e-2 * scale, "{q}: logits differ by {diff}");
        let back = d.join(format!("back-{q}"));
        ok(&[
            "decompress",
            c.to_str().unwrap(),
            "-o",
            back.to_str().unwrap(),
        ]);
    }
}

/// `--tile-weights` sets the lossy tile size: smaller tiles are stored (and still hit the rate),
/// and a size out of range is refused with the range before anything is written.
#[test]
fn lossy_tile_weights_set_the_tile_size_and_refuse_what_is_out_of_range() {
    let d = tmp("lossy-tiles");
    let src = d.join("src");
    ok(&["synth", "--shape", "tiny", "-o", src.to_str().unwrap()]);
    let c = d.join("c");
    ok(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        c.to_str().unwrap(),
        "--bits",
        "4",
        "--allocate",
        "uniform",
        "--tile-weights",
        "2048",
    ]);
    let w =
        entrollm_model::load::open_weights_with(&c, entrollm_model::load::LoadOptions::default())
            .unwrap();
    let l = w.layers[0].q.as_any();
    let t = &l
        .downcast_ref::<entrollm_model::forms::lossy::LossyLinear>()
        .expect("held lossy")
        .coded()
        .tensor;
    assert_eq!(t.tile_rows, 2048usize.div_ceil(t.cols));
    assert!(
        (t.bits_per_weight() / 4.0 - 1.0).abs() < 0.02,
        "{}",
        t.bits_per_weight()
    );
    for n in ["512", "40000"] {
        let e = fails(&[
            "compress",
            src.to_str().unwrap(),
            "-o",
            d.join(format!("bad{n}")).to_str().unwrap(),
            "--bits",
            "4",
            "--tile-weights",
            n,
        ]);
        assert!(
            e.contains("--tile-weights") && e.contains("1024 to 32768"),
            "{e}"
        );
        assert!(!d.join(format!("bad{n}")).exists());
    }
}

/// SmolLM2's first `layers` decoder layers, its embedding and norms, dequantised to F32 (the
/// engine's dequantisation) in a GGUF with its tokenizer: a small real float model to code lossily.
fn smollm2_f32_layers(dir: &Path, layers: u32) -> PathBuf {
    use entrollm_model::gguf::{dequantize, GgufFile, GgufWriter, MetaValue};
    let file = GgufFile::open(smollm2()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        let v = match k {
            "llama.block_count" => MetaValue::U32(layers),
            "general.file_type" => MetaValue::U32(0),
            _ => v.clone(),
        };
        w.meta(k, v);
    }
    for info in file.tensors() {
        let keep = match info.name.strip_prefix("blk.") {
            Some(rest) => rest.split('.').next().unwrap().parse::<u32>().unwrap() < layers,
            None => true,
        };
        if keep {
            let mut out = vec![0f32; info.n_elements() as usize];
            dequantize(&info.name, info.ggml_type, file.tensor_data(info), &mut out).unwrap();
            w.tensor_f32(&info.name, &info.dims, &out);
        }
    }
    let path = dir.join("smol-f32.gguf");
    std::fs::write(&path, w.to_bytes()).unwrap();
    path
}

/// `compress --bits --quantizer int --calib` on a real model: every lossy matrix is rounded with
/// GPTQ feedback from its launch's Hessian, meets its rate within 1 %, and the container runs.
#[test]
fn int_codes_with_a_calibration_run_are_rounded_with_feedback() {
    let d = tmp("lossy-int-feedback");
    let src = smollm2_f32_layers(&d, 2);
    let text = d.join("calib.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Rome \
         is the capital of Italy. Water boils at one hundred degrees. "
            .repeat(20),
    )
    .unwrap();
    let c = d.join("c");
    ok(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        c.to_str().unwrap(),
        "--bits",
        "4",
        "--quantizer",
        "int",
        "--calib",
        text.to_str().unwrap(),
    ]);
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(c.join("entrollm.json")).unwrap()).unwrap();
    let mut seen = 0;
    for t in manifest["tensors"].as_array().unwrap() {
        let p = &t["coded"]["params"]["stats"];
        if p["rate_from"].is_null() {
            continue;
        }
        seen += 1;
        let name = t["name"].as_str().unwrap();
        assert_eq!(p["feedback"], true, "{name}");
        let (got, want) = (
            p["bits_per_weight"].as_f64().unwrap(),
            p["target_bits"].as_f64().unwrap(),
        );
        assert!((got / want - 1.0).abs() <= 0.01, "{name}: {got} for {want}");
    }
    assert_eq!(seen, 14, "2 layers of 7 matrices");
    ok(&[
        "run",
        c.to_str().unwrap(),
        "-p",
        "The capital of France is",
        "--max-tokens",
        "4",
    ]);
}

/// `compress --bits` with a calibration text, a bits file and the row RDO on a real model: the
/// bits file's rates are kept, the others allocated to the average, every matrix's record says
/// where its rate came from, and the container runs.
#[test]
fn lossy_rates_come_from_the_bits_file_the_allocation_and_a_calibration_run() {
    let d = tmp("lossy-rates");
    let src = smollm2_f32_layers(&d, 2);
    let text = d.join("calib.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Rome \
         is the capital of Italy. Water boils at one hundred degrees. "
            .repeat(20),
    )
    .unwrap();
    let bits = d.join("bits.json");
    std::fs::write(&bits, r#"{"down": 6, "blk.0.attn_v.weight": 5}"#).unwrap();
    let c = d.join("c");
    let out = ok(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        c.to_str().unwrap(),
        "--bits",
        "3",
        "--quantizer",
        "e8",
        "--calib",
        text.to_str().unwrap(),
        "--bits-file",
        bits.to_str().unwrap(),
        "--rdo",
        "4",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("calibration:") && err.contains("allocated"),
        "{err}"
    );
    let j: serde_json::Value =
        serde_json::from_slice(&ok(&["inspect", c.to_str().unwrap(), "--json"]).stdout).unwrap();
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(c.join("entrollm.json")).unwrap()).unwrap();
    let lossy = &manifest["metadata"]["lossy"];
    assert_eq!(lossy["calibrated"], true, "{lossy}");
    assert_eq!(lossy["rdo"], 4, "{lossy}");
    let (mut bits_sum, mut weights) = (0f64, 0f64);
    let mut seen = 0;
    for t in manifest["tensors"].as_array().unwrap() {
        let p = &t["coded"]["params"]["stats"];
        if p["rate_from"].is_null() {
            continue;
        }
        seen += 1;
        let name = t["name"].as_str().unwrap();
        let rate = p["bits_per_weight"].as_f64().unwrap();
        assert_eq!(p["calibrated"], true, "{name}");
        let want = if name.contains("ffn_down") {
            Some(6.0)
        } else if name == "blk.0.attn_v.weight" {
            Some(5.0)
        } else {
            assert_eq!(p["rate_from"], "allocated", "{name}");
            let n: f64 = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .product();
            bits_sum += p["target_bits"].as_f64().unwrap() * n;
            weights += n;
            None
        };
        if let Some(want) = want {
            assert_eq!(p["rate_from"], "bits-file", "{name}");
            assert!((rate / want - 1.0).abs() < 0.01, "{name}: {rate}");
        }
    }
    assert_eq!(seen, 14, "2 layers of 7 matrices: {j}");
    assert!(
        (bits_sum / weights / 3.0 - 1.0).abs() < 0.01,
        "{}",
        bits_sum / weights
    );
    ok(&[
        "run",
        c.to_str().unwrap(),
        "-p",
        "The capital of France is",
        "--max-tokens",
        "4",
    ]);
    // A bits file naming a tensor the container does not code lossily is refused before writing.
    std::fs::write(&bits, r#"{"token_embd.weight": 5}"#).unwrap();
    let e = fails(&[
        "compress",
        src.to_str().unwrap(),
        "-o",
        d.join("bad").to_str().unwrap(),
        "--bits",
        "3",
        "--bits-file",
        bits.to_str().unwrap(),
    ]);
    assert!(
        e.contains("token_embd.weight") && e.contains("lossless"),
        "{e}"
    );
    assert!(!d.join("bad").exists());
}

/// A lossy container tuned on the CPU: each lossy launch has its coded form (`lossy`, smaller)
/// and the lossless forms of its reconstruction (`dense`: decoding at load) as points; a budget
/// between the two serves a mix; coded and decoded give the same logits (the product is `dense
/// f32`'s of the reconstruction, bit for bit).
#[test]
fn a_lossy_container_is_tuned_coded_against_decoded() {
    use entrollm_model::load::{open_weights_with, LoadOptions};
    let d = tmp("lossy-tune");
    let src = smollm2_f32_layers(&d, 2);
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let c = d.join("c");
    ok(&[
        "compress",
        &s(&src),
        "-o",
        &s(&c),
        "--bits",
        "4",
        "--quantizer",
        "e8",
        "--allocate",
        "uniform",
    ]);
    let t = d.join("t.json");
    ok(&[
        "tune",
        &s(&c),
        "--device",
        "cpu",
        "-o",
        &s(&t),
        "--seconds",
        "0.2",
    ]);
    let tune: serde_json::Value = serde_json::from_slice(&std::fs::read(&t).unwrap()).unwrap();
    let (mut coded, mut decoded) = (0u64, 0u64);
    for l in tune["launches"].as_array().unwrap() {
        if !l["id"].as_str().unwrap().starts_with("layers.") {
            continue;
        }
        let points = l["points"].as_array().unwrap();
        let bytes = |form: &str| {
            points
                .iter()
                .filter(|p| p["form"] == form)
                .map(|p| p["bytes"].as_u64().unwrap())
                .min()
                .unwrap_or_else(|| panic!("{}: no {form} point: {l}", l["id"]))
        };
        assert!(bytes("lossy") * 4 < bytes("dense"), "{l}");
        coded += bytes("lossy");
        decoded += bytes("dense");
    }
    // A budget between all coded and all decoded: a mix of both, within it.
    let (small, large) = (tune_total(&tune, "lossy"), tune_total(&tune, "dense"));
    assert!(small < large);
    let budget = small + (decoded - coded) / 2;
    let plan = d.join("p.json");
    ok(&[
        "plan",
        &s(&t),
        "--budget",
        &budget.to_string(),
        "-o",
        &s(&plan),
    ]);
    let p: serde_json::Value = serde_json::from_slice(&std::fs::read(&plan).unwrap()).unwrap();
    let forms: std::collections::BTreeSet<&str> = p["choices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["id"].as_str().unwrap().starts_with("layers."))
        .map(|c| c["form"].as_str().unwrap())
        .collect();
    assert!(
        forms.contains("lossy") && forms.contains("dense"),
        "{forms:?}"
    );

    let logits = |fused: bool| {
        let opts = LoadOptions {
            fused,
            ..LoadOptions::default()
        };
        let w = open_weights_with(&c, opts).unwrap();
        let lossy = entrollm_model::forms::layout::launches(&w)
            .iter()
            .filter(|l| l.matrices[0].form().form == "lossy")
            .count();
        assert_eq!(lossy > 0, fused);
        let mut e = entrollm_model::Engine::new(w, 32).unwrap();
        let prompt: Vec<u32> = (0..8).map(|i| (i * 37 + 5) % 1000).collect();
        let mut out = e.prefill(&prompt).unwrap();
        out.extend(e.step(17).unwrap());
        out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
    };
    assert!(
        logits(true) == logits(false),
        "coded and decoded logits differ"
    );
}

/// The smallest size of a tune file's launches when each takes its smallest point of `form`
/// (others: their smallest point).
fn tune_total(tune: &serde_json::Value, form: &str) -> u64 {
    tune["launches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            let points = l["points"].as_array().unwrap();
            let of = |f: Option<&str>| {
                points
                    .iter()
                    .filter(|p| f.is_none_or(|f| p["form"] == f))
                    .map(|p| p["bytes"].as_u64().unwrap())
                    .min()
            };
            of(Some(form)).or(of(None)).unwrap()
        })
        .sum()
}

/// `compress --budget SIZE --allow-lossy`: a budget lossless forms meet stays lossless; one they
/// cannot is met by coding the layers' matrices lossily at the highest rate that fits, the
/// embedding kept lossless, every lossy tensor recorded in form `lossy`, the served model within
/// the plan, and `run` serving it so. A budget too small at the lowest rate names the least that
/// fits; `--bits` beside `--budget` names `--allow-lossy`.
#[test]
fn allow_lossy_meets_a_budget_lossless_forms_cannot() {
    use entrollm_model::load::{open_weights_with, LoadOptions};
    let d = tmp("allow-lossy");
    let src = smollm2_f32_layers(&d, 2);
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let ctx = ["--context", "16"];
    let least_of = |err: &str| -> u64 {
        err.split("pass --budget ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{err}"))
    };
    let x = s(&d.join("x"));
    let lossless = least_of(&fails(&[
        "compress",
        &s(&src),
        "-o",
        &x,
        "--budget",
        "2MB",
        ctx[0],
        ctx[1],
    ]));
    let lossy_least = least_of(&fails(&[
        "compress",
        &s(&src),
        "-o",
        &x,
        "--budget",
        "2MB",
        "--allow-lossy",
        ctx[0],
        ctx[1],
    ]));
    assert!(lossy_least < lossless, "{lossy_least} vs {lossless}");
    assert!(!d.join("x").exists());

    let budget = (lossy_least + lossless) / 2;
    let c = d.join("c");
    let out = ok(&[
        "compress",
        &s(&src),
        "-o",
        &s(&c),
        "--budget",
        &budget.to_string(),
        "--allow-lossy",
        "--quantizer",
        "e8",
        ctx[0],
        ctx[1],
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("coded lossily") && err.contains("lossy:"),
        "{err}"
    );
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(c.join("entrollm.json")).unwrap()).unwrap();
    let plan = &manifest["metadata"]["plan"];
    let rate = manifest["metadata"]["lossy"]["bits"].as_f64().unwrap();
    assert!((1.5..=8.0).contains(&rate), "{rate}");
    let planned = plan["total_bytes"].as_u64().unwrap();
    assert!(planned + plan["reserved_bytes"].as_u64().unwrap() <= budget);
    let mut lossy = 0;
    for t in manifest["tensors"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let matrix = t["shape"].as_array().unwrap().len() == 2 && name.starts_with("blk.");
        assert_eq!(t["coded"]["coder"] == "lossy", matrix, "{name}");
        if matrix {
            assert_eq!(t["form"]["form"], "lossy", "{name}");
            lossy += 1;
        }
    }
    assert_eq!(lossy, 14, "2 layers of 7 matrices");
    // As served: the launches take no more than the plan gave them.
    let w = open_weights_with(&c, LoadOptions::default()).unwrap();
    let served: usize = entrollm_model::forms::layout::launches(&w)
        .iter()
        .map(|l| l.stored_bytes())
        .sum();
    assert!(served as u64 <= planned, "{served} > {planned}");
    let out = ok(&[
        "run",
        &s(&c),
        "-p",
        "The capital of France is",
        "--max-tokens",
        "3",
        "--device",
        "cpu",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("forms its plan recorded"), "{err}");

    // Where lossless forms fit, nothing is lossy.
    let l = d.join("l");
    let out = ok(&[
        "compress",
        &s(&src),
        "-o",
        &s(&l),
        "--budget",
        &lossless.to_string(),
        "--allow-lossy",
        ctx[0],
        ctx[1],
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("met losslessly"));
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(l.join("entrollm.json")).unwrap()).unwrap();
    assert!(manifest["metadata"]["lossy"].is_null());

    let e = fails(&[
        "compress",
        &s(&src),
        "-o",
        &x,
        "--budget",
        "1GB",
        "--bits",
        "4",
    ]);
    assert!(e.contains("--allow-lossy"), "{e}");
    assert!(!d.join("x").exists());
    // Serving commands point to compress, which codes once what they serve.
    let e = fails(&[
        "run",
        &s(&src),
        "-p",
        "Hi",
        "--budget",
        "1GB",
        "--allow-lossy",
    ]);
    assert!(
        e.contains("entrollm compress") && e.contains("--allow-lossy"),
        "{e}"
    );
}

/// A GPTQ checkpoint through the CLI: compressed with its packed codes as fields, inspected,
/// decompressed to the same files; `--budget` (forms per stored tensor) refused with the fix.
#[test]
fn gptq_checkpoint_compresses_inspects_and_restores() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/hfq/gptq");
    let d = tmp("gptq");
    let c = d.join("c");
    let (s, cs) = (src.to_str().unwrap(), c.to_str().unwrap());
    let err = fails(&[
        "compress", s, "-o", cs, "--budget", "1GB", "--device", "cpu",
    ]);
    assert!(
        err.contains("packed integer codes") && err.contains("--budget"),
        "{err}"
    );
    assert!(!c.exists(), "a refused compress leaves nothing");
    ok(&["compress", s, "-o", cs, "--min-elements", "1024"]);
    let out = ok(&["inspect", cs]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("rans-fields of 4 bits"), "{table}");
    let back = d.join("back");
    ok(&["decompress", cs, "-o", back.to_str().unwrap()]);
    for f in ["model.safetensors", "config.json"] {
        assert!(
            std::fs::read(back.join(f)).unwrap() == std::fs::read(src.join(f)).unwrap(),
            "{f} differs"
        );
    }
}

/// Every family's tiny model (crates/model/tests/data/families, checked against transformers
/// there): its safetensors checkpoint and llama.cpp's GGUFs of it compress, restore bit for bit
/// and run from the container as from the source.
#[test]
fn every_family_round_trips_and_runs_like_its_source() {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/families");
    let d = tmp("families");
    let run = |m: &Path| {
        let args = [
            "run",
            m.to_str().unwrap(),
            "-p",
            "hello there",
            "--max-tokens",
            "8",
        ];
        String::from_utf8(ok(&args).stdout).unwrap()
    };
    for family in [
        "qwen3",
        "gemma2",
        "gemma3",
        "phi3",
        "mistral",
        "mixtral",
        "qwen3_moe",
        "gpt_oss",
        "gpt_oss-mxfp4",
        "qwen3-bf16",
    ] {
        let src = d.join(family).join("hf");
        std::fs::create_dir_all(&src).unwrap();
        for f in std::fs::read_dir(data.join(family)).unwrap() {
            let f = f.unwrap().path();
            let name = f.file_name().unwrap().to_str().unwrap().to_string();
            if !(name.ends_with(".gguf") || name.starts_with("golden")) {
                std::fs::copy(&f, src.join(&name)).unwrap();
            }
        }
        let (c, back) = (d.join(family).join("c"), d.join(family).join("back"));
        round_trip(&src, &c, &back, &[]);
        let reference = run(&src);
        assert!(!reference.is_empty(), "{family}: no tokens");
        assert_eq!(
            run(&c),
            reference,
            "{family}: the container runs differently"
        );
        // The BF16 checkpoints have no GGUF of their own (their F32 twins do); the MXFP4 one has
        // llama.cpp's with MXFP4 experts.
        let ggufs: &[&str] = match family {
            f if f.ends_with("-bf16") => &[],
            "gpt_oss-mxfp4" => &["model.mxfp4.gguf"],
            _ => &["model.f32.gguf", "model.q8_0.gguf"],
        };
        for &gguf in ggufs {
            let g = data.join(family).join(gguf);
            let (c, back) = (
                d.join(family).join(gguf),
                d.join(family).join(format!("{gguf}.back")),
            );
            ok(&["compress", g.to_str().unwrap(), "-o", c.to_str().unwrap()]);
            ok(&[
                "decompress",
                c.to_str().unwrap(),
                "-o",
                back.to_str().unwrap(),
            ]);
            assert!(
                std::fs::read(back.join(gguf)).unwrap() == std::fs::read(&g).unwrap(),
                "{family} {gguf}: the restored GGUF differs"
            );
            assert_eq!(
                run(&c),
                run(&g),
                "{family} {gguf}: the container runs differently"
            );
        }
    }
}

/// A checkpoint without a tokenizer (`synth` writes none) is a plain error for the commands that
/// turn text into tokens (`run`, `chat`, `serve`, `eval ppl --file`), and runs where none is
/// needed: `bench` and `eval ppl --tokens` feed token ids.
#[test]
fn a_model_without_a_tokenizer_says_so() {
    let d = tmp("no-tokenizer");
    let m = d.join("m");
    ok(&["synth", "--shape", "tiny", "-o", m.to_str().unwrap()]);
    let c = d.join("c");
    ok(&["compress", m.to_str().unwrap(), "-o", c.to_str().unwrap()]);
    let text = d.join("text.txt");
    std::fs::write(&text, "some words to score").unwrap();
    let ids = d.join("ids.txt");
    std::fs::write(&ids, "1 17 300 5\n9 12 44 2 8 31 77 3").unwrap();
    for model in [&m, &c] {
        let model = model.to_str().unwrap();
        for args in [
            vec!["run", model, "--device", "cpu", "-p", "hi"],
            vec!["chat", model, "--device", "cpu"],
            vec!["serve", model, "--device", "cpu", "--port", "0"],
            vec![
                "eval",
                "ppl",
                model,
                "--device",
                "cpu",
                "--file",
                text.to_str().unwrap(),
            ],
        ] {
            let err = fails(&args);
            assert!(
                err.contains("has no tokenizer (tokenizer.json)"),
                "{args:?}: {err}"
            );
        }
        let out = ok(&[
            "eval",
            "ppl",
            model,
            "--device",
            "cpu",
            "--window",
            "8",
            "--stride",
            "4",
            "--tokens",
            ids.to_str().unwrap(),
        ]);
        let line = String::from_utf8_lossy(&out.stdout);
        assert!(
            line.contains("perplexity") && line.contains("over"),
            "{line}"
        );
        let out = ok(&[
            "bench",
            model,
            "--device",
            "cpu",
            "--prompt-len",
            "8",
            "--repeats",
            "1",
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("tokenizer"), "{err}");
    }
    // Ids outside the vocabulary, or not ids, are refused naming the file.
    std::fs::write(&ids, "1 2 99999999").unwrap();
    let err = fails(&[
        "eval",
        "ppl",
        m.to_str().unwrap(),
        "--device",
        "cpu",
        "--tokens",
        ids.to_str().unwrap(),
    ]);
    assert!(err.contains("ids.txt") && err.contains("token 3"), "{err}");
}
