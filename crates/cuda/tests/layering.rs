//! Serving code names no selftest or benchmark module: the engine, the linears, the coded
//! tensors, the kernel launchers, the JIT and the device take what they need from serving modules
//! (`mem`, `tuned`, `plan`), and the selftests and benchmarks import from them.

use std::path::Path;

/// Modules of the serving path (relative to src/); every file of ops/ too.
const SERVING: &[&str] = &[
    "coded.rs",
    "device.rs",
    "engine.rs",
    "engine_coded.rs",
    "error.rs",
    "families.rs",
    "gemm.rs",
    "jit.rs",
    "linear.rs",
    "mem.rs",
    "plan.rs",
    "tuned.rs",
];

/// Paths of the test and benchmark modules.
const FORBIDDEN: &[&str] = &[
    "selftest::",
    "bench::",
    "bench_coded::",
    "bench_fp8::",
    "dtans_selftest::",
    "engine_selftest::",
    "families_selftest::",
    "lossy_selftest::",
    "bench_lossy::",
];

#[test]
fn serving_code_imports_no_selftest_or_bench_module() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files: Vec<_> = SERVING.iter().map(|f| src.join(f)).collect();
    for e in std::fs::read_dir(src.join("ops")).unwrap() {
        files.push(e.unwrap().path());
    }
    let mut bad = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if FORBIDDEN.iter().any(|m| code.contains(m)) {
                bad.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "serving code names a selftest or bench module:\n{}",
        bad.join("\n")
    );
    assert!(files.len() > SERVING.len() + 5, "ops/ was not read");
}
