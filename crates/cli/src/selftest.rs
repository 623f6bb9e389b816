//! `entrollm selftest --gpu`: every GPU kernel against its CPU reference on fresh random inputs,
//! then the forward pass end to end (a small synthetic model and SmolLM2-135M, GPU vs CPU), the
//! dtANS-LLM kernels (`dtans_selftest::selftest`: decode/dequant bit-exact, mvm against the CPU), and
//! the coded forward pass against the dense one on the same weights (`coded_e2e_selftest`, code at
//! load included), and
//! the GPU encoder byte for byte against the CPU encoder (`dtans_selftest::encode_selftest`).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};
use entrollm_check::engine_selftest::run_engine_selftest;
use entrollm_check::selftest::{run_selftest, SelftestReport};
use entrollm_cuda::GpuDevice;

#[derive(clap::Args)]
pub struct Args {
    /// Test the GPU runtime (the only selftest there is).
    #[arg(long)]
    gpu: bool,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0x5EED)]
    seed: u64,
    /// SmolLM2-135M GGUF for the end-to-end checks (default: where scripts/fetch-smollm2 puts it).
    #[arg(long)]
    smollm2: Option<PathBuf>,
    /// Quantised GGUF files the `ggml` part serves as their blocks against the CPU engine (logits
    /// and greedy tokens; repeat for several; default: the SmolLM2 GGUF where present).
    #[arg(long)]
    gguf: Vec<PathBuf>,
    /// HF checkpoint directories of integer matrices (GPTQ, AWQ, compressed-tensors) the `int`
    /// part serves as their codes against the CPU engine (logits; repeat for several; default:
    /// the test checkpoints under crates/model/tests/data/hfq where present).
    #[arg(long)]
    hf: Vec<PathBuf>,
    /// Run only these parts (repeat or comma-separate; default: all, in this order): `kernels`
    /// (every kernel against its CPU reference), `engine` (the forward pass, GPU vs CPU),
    /// `families` (the families beyond Llama: their kernels, mixtures of experts' included, and
    /// each family's synthetic model, GPU vs CPU), `coded` (the coded forward pass against the dense one), `dtans` (the dtANS-LLM kernels),
    /// `encoder` (the GPU encoder against the CPU's), `lossy` (the lossy-matrix kernels), `ggml` (the
    /// GGUF-block kernels, every ggml type), `int` (the integer-code kernels: GPTQ, AWQ,
    /// compressed-tensors).
    #[arg(long, value_delimiter = ',', value_parser = PARTS.to_vec())]
    part: Vec<String>,
}

const PARTS: [&str; 9] = [
    "kernels", "engine", "families", "coded", "dtans", "encoder", "lossy", "ggml", "int",
];

pub fn run(a: Args) -> Result<()> {
    if !a.gpu {
        bail!("nothing to test: pass --gpu");
    }
    let dev = Arc::new(GpuDevice::open(0)?);
    let t0 = std::time::Instant::now();
    let runs = |p: &str| {
        let on = a.part.is_empty() || a.part.iter().any(|q| q == p);
        if on {
            println!("== {p} (at {:.1} s)", t0.elapsed().as_secs_f64());
        }
        on
    };
    let mut failed = false;
    if runs("kernels") {
        match run_selftest(&dev, a.seed) {
            Ok(r) => println!("{r}"),
            Err(e) => {
                println!("{e}");
                failed = true;
            }
        }
    }
    let gguf = a
        .smollm2
        .unwrap_or_else(entrollm_model::load::smollm2_gguf_path);
    let gguf = gguf.is_file().then_some(gguf);
    if runs("engine") {
        match run_engine_selftest(&dev, a.seed, gguf.as_deref()) {
            Ok((r, notes)) => {
                println!("{r}");
                for n in notes {
                    println!("  {n}");
                }
            }
            Err(e) => {
                println!("{e}");
                failed = true;
            }
        }
    }
    if runs("families") {
        match entrollm_check::families_selftest::selftest(&dev, a.seed) {
            Ok(r) => println!("{r}"),
            Err(e) => {
                println!("{e}");
                failed = true;
            }
        }
    }
    if runs("coded") {
        match entrollm_check::engine_selftest::coded_e2e_selftest(&dev, a.seed) {
            Ok(r) => println!("{r}"),
            Err(e) => {
                println!("{e}");
                failed = true;
            }
        }
    }
    if runs("dtans") {
        failed |= summarise(
            "dtANS kernels",
            entrollm_check::dtans_selftest::selftest(&dev, a.seed),
        );
    }
    if runs("encoder") {
        match entrollm_check::dtans_selftest::encode_selftest(&dev, a.seed) {
            Ok(r) => println!(
                "dtANS GPU encoder: {} cases byte-identical to the CPU encoder",
                r.cases.len()
            ),
            Err(e) => {
                println!("{e}");
                failed = true;
            }
        }
    }
    if runs("lossy") {
        failed |= summarise(
            "lossy kernels",
            entrollm_check::lossy_selftest::selftest(&dev, a.seed),
        );
    }
    if runs("ggml") {
        failed |= summarise(
            "ggml kernels",
            entrollm_check::ggml_selftest::selftest(&dev, a.seed),
        );
        let files = match a.gguf.is_empty() {
            true => gguf.iter().cloned().collect(),
            false => a.gguf.clone(),
        };
        for path in files {
            let (mut cases, mut notes) = (Vec::new(), Vec::new());
            let r = entrollm_check::engine_selftest::gguf_served(
                &dev, &path, 24, &mut cases, &mut notes,
            )
            .map(|()| SelftestReport {
                device: dev.info().name.clone(),
                cases,
            });
            for n in notes {
                println!("  {n}");
            }
            failed |= summarise(&format!("{} served as its blocks", path.display()), r);
        }
    }
    if runs("int") {
        failed |= summarise(
            "int kernels",
            entrollm_check::int_selftest::selftest(&dev, a.seed),
        );
        let dirs: Vec<PathBuf> = match a.hf.is_empty() {
            true => ["ct", "gptq", "awq"]
                .iter()
                .map(|f| PathBuf::from("crates/model/tests/data/hfq").join(f))
                .filter(|d| d.join("config.json").is_file())
                .collect(),
            false => a.hf.clone(),
        };
        for dir in dirs {
            let (mut cases, mut notes) = (Vec::new(), Vec::new());
            let r =
                entrollm_check::engine_selftest::hf_int_served(&dev, &dir, &mut cases, &mut notes)
                    .map(|()| SelftestReport {
                        device: dev.info().name.clone(),
                        cases,
                    });
            for n in notes {
                println!("  {n}");
            }
            failed |= summarise(&format!("{} served as its codes", dir.display()), r);
        }
    }
    if failed {
        bail!("GPU selftest failed");
    }
    println!("GPU selftest passed in {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}

/// Prints a kernel selftest's failures (the first 20) and its count of cases; true when any failed
/// or it could not run.
fn summarise(what: &str, r: entrollm_cuda::Result<SelftestReport>) -> bool {
    match r {
        Ok(r) => {
            let failed = r.failures().count();
            for f in r.failures().take(20) {
                println!("  FAIL {f:?}");
            }
            println!(
                "{what}: {} cases, {} passed, {failed} failed",
                r.cases.len(),
                r.cases.len() - failed
            );
            failed > 0
        }
        Err(e) => {
            println!("{e}");
            true
        }
    }
}
