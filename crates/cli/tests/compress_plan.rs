//! `compress --plan` and `compress --budget` end to end: the container holds the forms the plan
//! chose (inspect --json shows them per launch, dtANS tensors with the planned coding), serves
//! them with the source's greedy tokens, decompresses to the source bit for bit; a plan of
//! another model is refused naming both; a tight budget stores smaller forms than a loose one.

mod common;

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn entrollm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_entrollm"))
        .args(args)
        .args(["--threads", "2"])
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

fn tmp(name: &str) -> common::Scratch {
    common::Scratch::new("cplan", name)
}

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The coding string (`MODE:LOG2M:SC[:T]`) of a dtANS tensor's parameters as inspect prints them.
fn coding_of(params: &Value) -> String {
    let mut c = format!(
        "{}:{}:{}",
        params["mode"].as_str().unwrap(),
        params["log2_m"],
        params["sc"]
    );
    if let Some(t) = params["t"].as_u64() {
        c += &format!(":{t}");
    }
    c
}

/// Checks `inspect --json` of `container` against `plan`: every tensor of every launch records
/// the launch's form, is stored as that form says where the container can (dtANS with the
/// planned coding, DFloat11, dense as stored: plain), and the plan is recorded. `to_stored` maps
/// a plan's (HF) tensor name to the container's.
fn check_inspect(container: &Path, plan: &Value, to_stored: &dyn Fn(&str) -> Option<String>) {
    let out = ok(&["inspect", s(container), "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let tensors: BTreeMap<&str, &Value> = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["name"].as_str().unwrap(), t))
        .collect();
    assert_eq!(v["plan"]["model"], plan["model"]);
    assert_eq!(v["plan"]["choices"], plan["choices"]);
    let mut checked = 0;
    for c in plan["choices"].as_array().unwrap() {
        let (form, variant) = (c["form"].as_str().unwrap(), c["variant"].as_str().unwrap());
        let mut found = 0;
        for name in c["tensors"].as_array().unwrap() {
            let Some(t) = to_stored(name.as_str().unwrap()).and_then(|n| tensors.get(n.as_str()))
            else {
                continue;
            };
            found += 1;
            assert_eq!(t["form"]["form"], form, "{}: {t}", c["id"]);
            assert_eq!(t["form"]["variant"], variant, "{}: {t}", c["id"]);
            match form {
                "dtans" => {
                    assert!(t["coder"].as_str().unwrap().starts_with("dtans"), "{t}");
                    assert_eq!(coding_of(&t["coding"]), variant, "{t}");
                }
                "df11" => assert_eq!(t["coder"], "df11", "{t}"),
                "dense" if variant == "bf16" || variant == "f16" => {
                    assert_eq!(
                        t["detail"].as_str().unwrap().rsplit("; ").next(),
                        Some("plain")
                    )
                }
                // Forms the container cannot hold as such are stored as compress would.
                _ => {}
            }
        }
        assert!(
            found > 0,
            "no tensor of launch {} in the container",
            c["id"]
        );
        checked += found;
    }
    assert!(checked > 0);
}

/// The first `n` greedy tokens of the model at `path` (as `run` loads it) after a fixed prompt.
fn greedy_ids(path: &Path, n: usize) -> Vec<u32> {
    use entrollm_model::load::{open_weights_with, LoadOptions};
    let w = open_weights_with(path, LoadOptions::default()).unwrap();
    let mut e = entrollm_model::Engine::new(w, 64).unwrap();
    let prompt: Vec<u32> = (0..10).map(|i| (i * 37 + 5) % 1000).collect();
    let mut logits = e.prefill(&prompt).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = entrollm_model::sampler::argmax(&logits).unwrap();
        out.push(t);
        logits = e.step(t).unwrap();
    }
    out
}

/// The forms the loader serves, per launch id (`form:variant`).
fn served_forms(path: &Path) -> BTreeMap<String, String> {
    use entrollm_model::load::{open_weights_with, LoadOptions};
    let w = open_weights_with(path, LoadOptions::default()).unwrap();
    entrollm_model::forms::layout::launches(&w)
        .into_iter()
        .map(|l| {
            let forms: Vec<String> = l.matrices.iter().map(|m| m.form().to_string()).collect();
            assert!(
                forms.windows(2).all(|f| f[0] == f[1]),
                "{}: {forms:?}",
                l.id
            );
            (l.id, forms[0].clone())
        })
        .collect()
}

fn plan_forms(plan: &Value) -> BTreeMap<String, String> {
    plan["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let (f, v) = (c["form"].as_str().unwrap(), c["variant"].as_str().unwrap());
            let id = c["id"].as_str().unwrap().to_string();
            match v.is_empty() {
                true => (id, f.to_string()),
                false => (id, format!("{f}:{v}")),
            }
        })
        .collect()
}

fn assert_same_file(a: &Path, b: &Path) {
    let (x, y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert!(x == y, "{} and {} differ", a.display(), b.display());
}

#[test]
fn compress_plan_on_a_synthetic_model() {
    let d = tmp("synth");
    let model = d.join("tiny");
    ok(&["synth", "--shape", "tiny", "--seed", "3", "-o", s(&model)]);
    let tune = d.join("tune.json");
    ok(&["tune", s(&model), "--device", "cpu", "-o", s(&tune)]);
    // A budget halfway between the smallest plan and the checkpoint as stored: a mix of forms.
    let t = json(&tune);
    let (mut small, mut large) = (0u64, 0u64);
    for l in t["launches"].as_array().unwrap() {
        let points = l["points"].as_array().unwrap();
        let bytes = |p: &Value| p["bytes"].as_u64().unwrap();
        small += points.iter().map(bytes).min().unwrap();
        large += points
            .iter()
            .filter(|p| p["form"] == "dense" && p["variant"] == "bf16")
            .map(bytes)
            .next()
            .unwrap();
    }
    let plan_path = d.join("plan.json");
    let budget = ((small + large) / 2).to_string();
    ok(&["plan", s(&tune), "--budget", &budget, "-o", s(&plan_path)]);
    let plan = json(&plan_path);
    let forms: std::collections::BTreeSet<&str> = plan["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["form"].as_str().unwrap())
        .collect();
    assert!(forms.len() >= 2, "the plan mixes forms: {forms:?}");

    let c = d.join("c");
    let out = ok(&["compress", s(&model), "-o", s(&c), "--plan", s(&plan_path)]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("in the forms of the plan"));
    check_inspect(&c, &plan, &|n| Some(n.to_string()));
    assert_eq!(served_forms(&c), plan_forms(&plan));
    assert_eq!(greedy_ids(&c, 12), greedy_ids(&model, 12));
    let back = d.join("back");
    ok(&["decompress", s(&c), "-o", s(&back)]);
    assert_same_file(
        &back.join("model.safetensors"),
        &model.join("model.safetensors"),
    );

    // The plan of another model (same shapes, FP16 values) is refused, naming both.
    let other = d.join("other");
    ok(&[
        "synth",
        "--shape",
        "tiny",
        "--dtype",
        "fp16",
        "--seed",
        "3",
        "-o",
        s(&other),
    ]);
    let out = entrollm(&[
        "compress",
        s(&other),
        "-o",
        s(&d.join("x")),
        "--plan",
        s(&plan_path),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let fp = plan["model"]["fingerprint"].as_str().unwrap();
    assert!(
        err.contains(fp) && err.contains(s(&other)) && err.contains("another model"),
        "{err}"
    );
    assert!(!d.join("x").exists());

    // --budget plans as run does: a tight budget stores smaller forms than a loose one.
    // (A short context, so that the KV cache fits and the launches do not.)
    let ctx = ["--context", "16"];
    let out = entrollm(&[
        "compress",
        s(&model),
        "-o",
        s(&d.join("x")),
        "--budget",
        "100kB",
        ctx[0],
        ctx[1],
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let least: u64 = err
        .split("pass --budget ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{err}"));
    let mut planned = Vec::new();
    for (tag, budget) in [("tight", least), ("loose", least * 4)] {
        let c = d.join(tag);
        let b = budget.to_string();
        let out = ok(&[
            "compress",
            s(&model),
            "-o",
            s(&c),
            "--budget",
            &b,
            "--tune",
            s(&tune),
            ctx[0],
            ctx[1],
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("measured cost model"), "{err}");
        let p = json(&c.join("entrollm.json"))["metadata"]["plan"].clone();
        assert!(
            p["total_bytes"].as_u64().unwrap() + p["reserved_bytes"].as_u64().unwrap() <= budget
        );
        check_inspect(&c, &p, &|n| Some(n.to_string()));
        planned.push(p);
    }
    let bytes = |p: &Value| -> BTreeMap<String, u64> {
        p["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["id"].as_str().unwrap().into(),
                    c["bytes"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let (tight, loose) = (bytes(&planned[0]), bytes(&planned[1]));
    assert!(
        tight.iter().all(|(id, b)| *b <= loose[id]),
        "{tight:?} {loose:?}"
    );
    assert!(tight.values().sum::<u64>() < loose.values().sum::<u64>());
    // Without a tune file: the tune data shipped for this device, else the forms' cost model,
    // and it says which.
    let out = ok(&[
        "compress",
        s(&model),
        "-o",
        s(&d.join("default")),
        "--budget",
        &(least * 2).to_string(),
        ctx[0],
        ctx[1],
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("latencies from the tune data shipped for")
            || err.contains("latencies from the forms' cost model"),
        "{err}"
    );
    // A GPU plan needs the GPU's tune file.
    let out = entrollm(&[
        "compress",
        s(&model),
        "-o",
        s(&d.join("x")),
        "--budget",
        "1GB",
        "--device",
        "cuda",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tune"));
    let out = entrollm(&[
        "compress",
        s(&model),
        "-o",
        s(&d.join("x")),
        "--budget",
        "1GB",
        "--device",
        "cuda",
        "--tune",
        s(&tune),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("a tune file of a cpu device"));
}

fn smollm2() -> Option<PathBuf> {
    let p = entrollm_model::load::smollm2_gguf_path();
    p.exists().then_some(p)
}

/// SmolLM2's GGUF tuned on the CPU, planned between its smallest and dense sizes, compressed by
/// the plan: the container's inspect shows the plan's forms per launch, `run` on it gives the
/// GGUF's greedy tokens, `decompress` gives back the GGUF; tuning the container gives the same
/// fingerprint and fronts with several points.
#[test]
fn compress_plan_on_smollm2() {
    let Some(gguf) = smollm2() else {
        eprintln!("skipped: SmolLM2 not fetched (scripts/fetch-smollm2)");
        return;
    };
    let d = tmp("smol");
    let tune = d.join("tune.json");
    ok(&["tune", s(&gguf), "--device", "cpu", "-o", s(&tune)]);
    let plan_path = d.join("plan.json");
    ok(&["plan", s(&tune), "--budget", "250MB", "-o", s(&plan_path)]);
    let plan = json(&plan_path);
    let c = d.join("c");
    ok(&["compress", s(&gguf), "-o", s(&c), "--plan", s(&plan_path)]);
    let llama = entrollm_model::config::Arch::Llama.family();
    check_inspect(&c, &plan, &|n| llama.gguf_name(n));
    assert_eq!(served_forms(&c), plan_forms(&plan));
    let run = |m: &Path| {
        let out = ok(&[
            "run",
            s(m),
            "--device",
            "cpu",
            "-p",
            "The capital of France is",
            "--max-tokens",
            "8",
            "--context",
            "128",
        ]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(run(&c), run(&gguf));
    let back = d.join("back");
    ok(&["decompress", s(&c), "-o", s(&back)]);
    assert_same_file(&back.join(gguf.file_name().unwrap()), &gguf);

    // Tuning the container: the GGUF's fingerprint, several forms timed a launch.
    let tc = d.join("tune-c.json");
    ok(&["tune", s(&c), "--device", "cpu", "-o", s(&tc)]);
    let tcv = json(&tc);
    assert_eq!(
        tcv["model"]["fingerprint"],
        json(&tune)["model"]["fingerprint"]
    );
    assert!(tcv["step_overhead_us"].as_f64().unwrap() > 0.0);
    // Several forms timed a launch; which of them are on its front is the machine's to say (the
    // blocks' own kernel may be both the smallest and the fastest).
    for l in tcv["launches"].as_array().unwrap() {
        let points = l["points"].as_array().unwrap();
        let forms: std::collections::BTreeSet<&str> =
            points.iter().map(|p| p["form"].as_str().unwrap()).collect();
        let front = points.iter().filter(|p| p["pareto"] == true).count();
        assert!(
            forms.len() >= 2 && front >= 1,
            "{}: forms {forms:?}, {front} points on the front",
            l["id"]
        );
    }
}
