//! `entrollm tune`, `entrollm plan` and `--budget` end to end on the CPU: a tune file with fronts,
//! resumed without measuring again; plans under budgets that are never exceeded, an infeasible
//! budget naming the smallest size; the real test model run under three budgets gives the
//! source's greedy tokens (every form is lossless).

mod common;

use serde_json::Value;
use std::path::PathBuf;
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
    common::Scratch::new("tune", name)
}

fn json(path: &std::path::Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// Per launch, (smallest, largest) bytes of its points.
fn extremes(tune: &Value) -> (u64, u64) {
    let launches = tune["launches"].as_array().unwrap();
    let mut small = 0;
    let mut large = 0;
    for l in launches {
        let bytes: Vec<u64> = l["points"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["bytes"].as_u64().unwrap())
            .collect();
        small += bytes.iter().min().unwrap();
        large += bytes.iter().max().unwrap();
    }
    (small, large)
}

#[test]
fn tune_resume_and_plans_on_a_synthetic_model() {
    let d = tmp("synth");
    let model = d.join("tiny");
    let m = model.to_str().unwrap();
    ok(&["synth", "--shape", "tiny", "--seed", "3", "-o", m]);
    let t = d.join("tune.json");
    let ts = t.to_str().unwrap();
    ok(&["tune", m, "--device", "cpu", "-o", ts]);
    let tune = json(&t);
    assert_eq!(tune["format"], "entrollm-tune");
    assert_eq!(tune["device"]["kind"], "cpu");
    let launches = tune["launches"].as_array().unwrap();
    // embed, 2 layers × 4 launches, lm_head
    assert_eq!(launches.len(), 10);
    for l in launches {
        let points = l["points"].as_array().unwrap();
        let forms: std::collections::BTreeSet<&str> =
            points.iter().map(|p| p["form"].as_str().unwrap()).collect();
        if l["launch"] != "embed" {
            assert!(forms.contains("dense") && forms.contains("dtans"), "{l}");
        }
        assert!(points.iter().any(|p| p["pareto"] == true));
    }
    // Launches of one shape share their timings: each point is timed in one of them (the CPU
    // times candidates inside decode steps, each in the launches that hold it) and the other
    // says which, with its own sizes.
    let down = |i: usize| {
        launches
            .iter()
            .find(|l| l["id"] == format!("layers.{i}.down"))
            .unwrap()["points"]
            .as_array()
            .unwrap()
            .clone()
    };
    let (l0, l1) = (down(0), down(1));
    assert_eq!(l0.len(), l1.len());
    for (a, b) in l0.iter().zip(&l1) {
        assert_eq!((&a["form"], &a["variant"]), (&b["form"], &b["variant"]));
        assert_eq!(a["latency_us"], b["latency_us"]);
        let timed: Vec<&Value> = [&a["timed_as"], &b["timed_as"]]
            .into_iter()
            .filter(|t| !t.is_null())
            .collect();
        assert_eq!(timed.len(), 1, "{a} {b}");
        assert!(
            (a["timed_as"].is_null() && b["timed_as"] == "layers.0.down")
                || (b["timed_as"].is_null() && a["timed_as"] == "layers.1.down"),
            "{a} {b}"
        );
    }

    // Resumed: nothing is timed again, the launches are the same.
    let again = ok(&["tune", m, "--device", "cpu", "-o", ts]);
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(err.contains("resuming"), "{err}");
    assert_eq!(json(&t)["launches"], tune["launches"]);

    let (small, large) = extremes(&tune);
    for budget in [small, (small + large) / 2, large] {
        let p = d.join(format!("plan-{budget}.json"));
        let out = ok(&[
            "plan",
            ts,
            "--budget",
            &budget.to_string(),
            "-o",
            p.to_str().unwrap(),
        ]);
        assert!(String::from_utf8_lossy(&out.stdout).contains("predicted"));
        let plan = json(&p);
        assert!(plan["total_bytes"].as_u64().unwrap() <= budget);
        assert!(plan["certificate"]["gap"].as_f64().unwrap() >= 0.0);
    }
    let out = entrollm(&["plan", ts, "--budget", &(small - 1).to_string()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("--budget {small}")), "{err}");

    let svg = d.join("fronts.svg");
    ok(&["plan", ts, "--plot", svg.to_str().unwrap()]);
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));

    // A tune file of another model is refused.
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
        other.to_str().unwrap(),
    ]);
    let out = entrollm(&["tune", other.to_str().unwrap(), "--device", "cpu", "-o", ts]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("another model"));
}

fn smollm2() -> Option<PathBuf> {
    let p = entrollm_model::load::smollm2_gguf_path();
    p.exists().then_some(p)
}

/// The plan table's rows (launch, form, variant, count) from stderr.
fn plan_rows(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .skip_while(|l| !l.starts_with("launch "))
        .skip(1)
        .take_while(|l| !l.starts_with("plan: "))
        .map(|l| l.split_whitespace().take(4).collect::<Vec<_>>().join(" "))
        .collect()
}

#[test]
fn smollm2_under_three_budgets_keeps_its_greedy_tokens_and_is_no_slower() {
    let Some(gguf) = smollm2() else {
        eprintln!("skipped: SmolLM2 not fetched (scripts/fetch-smollm2)");
        return;
    };
    let g = gguf.to_str().unwrap();
    let base = [
        "run",
        g,
        "--device",
        "cpu",
        "-p",
        "The capital of France is",
        "--max-tokens",
        "6",
        "--context",
        "256",
    ];
    let out = ok(&base);
    let want = String::from_utf8_lossy(&out.stdout).into_owned();
    let predicted = |err: &str| -> f64 {
        let line = err.lines().find(|l| l.starts_with("plan: ")).expect(err);
        let at = line.find("predicted ").expect(line) + "predicted ".len();
        line[at..].split(' ').next().unwrap().parse().expect(line)
    };
    let default = predicted(&String::from_utf8_lossy(&out.stderr));
    for budget in ["450MB", "300MB", "150MB"] {
        let mut args = base.to_vec();
        args.extend(["--budget", budget]);
        let out = ok(&args);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            want,
            "--budget {budget}"
        );
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(err.contains("latencies from"), "{err}");
        assert!(!plan_rows(&err).is_empty(), "{err}");
        // Every one of these budgets holds the default plan: none is predicted slower.
        assert!(predicted(&err) >= default * (1.0 - 1e-9), "{budget}: {err}");
    }
    let mut args = base.to_vec();
    args.extend(["--budget", "20MB"]);
    let out = entrollm(&args);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--budget") && !err.contains("panicked"),
        "{err}"
    );
}
