//! Compiles every kernel variant with NVRTC alone (no GPU needed). Ignored by default because it
//! needs libnvrtc on the library path; `tools/nvrtc-check` provides one and runs them.

use entrollm_check::variants::all_variants;
use entrollm_cuda::jit::KernelVariant;
use entrollm_cuda::jit::{cached_cubin, compile_with_log, nvrtc_version, ATTENTION, GEMV};

fn arch() -> String {
    std::env::var("NVRTC_CHECK_ARCH").unwrap_or_else(|_| "sm_90".into())
}

/// Every variant compiles to an ELF cubin, and ptxas reports no spills (register arrays indexed
/// only by unrolled constants must stay in registers).
#[test]
#[ignore = "needs libnvrtc; run tools/nvrtc-check"]
fn nvrtc_compiles_every_kernel_variant() {
    let arch = arch();
    let (major, minor) = nvrtc_version().expect("libnvrtc must be loadable");
    println!("NVRTC {major}.{minor}, target {arch}");
    let mut failures = Vec::new();
    let variants = all_variants();
    // Compiled on every core (NVRTC compiles separate programs concurrently), reported in order.
    use rayon::prelude::*;
    let compiled: Vec<_> = variants
        .par_iter()
        .map(|v| compile_with_log(v, &arch, &["--ptxas-options=-v"]))
        .collect();
    for (v, result) in variants.iter().zip(compiled) {
        let label = format!("{} {:?}", v.source.name, v.defines);
        match result {
            Ok((cubin, log)) => {
                let spills: Vec<&str> = log
                    .lines()
                    .filter(|l| {
                        l.contains("spill")
                            && !l.contains(" 0 bytes spill stores, 0 bytes spill loads")
                    })
                    .collect();
                let regs: Vec<&str> = log
                    .lines()
                    .filter_map(|l| l.split("Used ").nth(1))
                    .filter_map(|r| r.split(',').next())
                    .collect();
                println!(
                    "{}   {label}: {} bytes, {regs:?}",
                    if spills.is_empty() { "ok" } else { "SPILL" },
                    cubin.len()
                );
                if !cubin.starts_with(b"\x7fELF") {
                    failures.push(format!("{label}: not an ELF cubin"));
                }
                if !spills.is_empty() {
                    failures.push(format!("{label}: {spills:?}"));
                }
            }
            Err(e) => {
                println!("FAIL {label}: {e}");
                failures.push(label);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} variants failed: {failures:#?}",
        failures.len(),
        variants.len()
    );
}

/// The disk cache stores a cubin under its key, serves it back, and replaces a corrupt entry.
#[test]
#[ignore = "needs libnvrtc; run tools/nvrtc-check"]
fn cubin_cache_round_trip_and_corruption() {
    let arch = arch();
    let dir = std::env::temp_dir().join(format!("entrollm-kcache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let v = KernelVariant::new(
        &GEMV,
        vec![("GEMV_WARPS", 4), ("GEMV_ROWS", 2), ("GEMV_UNROLL", 4)],
    );
    let first = cached_cubin(&v, &arch, Some(&dir)).expect("compile into the cache");
    let path = dir.join(v.cache_file_name(&arch));
    assert_eq!(std::fs::read(&path).unwrap(), first);
    assert_eq!(cached_cubin(&v, &arch, Some(&dir)).unwrap(), first);
    std::fs::write(&path, b"garbage").unwrap();
    assert_eq!(
        cached_cubin(&v, &arch, Some(&dir)).unwrap(),
        first,
        "corrupt entry recompiled"
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        first,
        "corrupt entry replaced"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A variant the kernel rejects fails with a compile error naming the kernel and the reason.
#[test]
#[ignore = "needs libnvrtc; run tools/nvrtc-check"]
fn bad_defines_are_a_clear_compile_error() {
    let v = KernelVariant::new(
        &ATTENTION,
        vec![
            ("HEAD_DIM", 80),
            ("ATTN_GROUP", 4),
            ("ATTN_CHUNK", 256),
            ("ATTN_WARPS", 4),
        ],
    );
    let e = entrollm_cuda::jit::compile_cubin(&v, &arch())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("attention.cu") && e.contains("HEAD_DIM must be a multiple of 32"),
        "{e}"
    );
}
