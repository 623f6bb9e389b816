//! The workspace's layering, read from the sources of every crate (crates/*/src, every module):
//!
//! - the crates depend on each other only as [`CRATE_DEPS`] lists, and no serving crate
//!   ([`SERVING`]) on the checks (entrollm-check: the selftests and kernel benchmarks), by name or
//!   by path; a serving crate has no selftest or benchmark module and includes no file from
//!   outside its own folder (bench/ data included);
//! - inside each crate, modules sit in the layers of [`LAYERS`] (lowest first; a module is placed by
//!   its longest listed prefix, and every module must be placed) and import from their own layer
//!   or below; an import upward is one of [`UPWARD`], each with its reason;
//! - the import cycles between modules of one crate are those of [`CYCLES`], each with its reason:
//!   a new cycle, or a cycle grown by a module, fails.
//!
//! An import is a path that starts with `crate::`, `super::` or `self::` (in `use` or in code,
//! brace groups expanded), in code outside `#[cfg(test)] mod` blocks and comments; it names the
//! module of its longest prefix that is a module. A module's use of a child by its bare name
//! (`child::item`, not a `pub use` re-export) is an import too; a child's use of its parents is the
//! module tree's, not an edge. (This counts the 12-module cuda and 15-module model cycles.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates a served model runs through (the server, the engines and what they load).
const SERVING: &[&str] = &["codec", "format", "model", "tune", "cuda", "server"];

/// The entrollm crates each crate may name in any dependency table (`entrollm` is the cli's).
const CRATE_DEPS: &[(&str, &[&str])] = &[
    ("codec", &[]),
    ("format", &["codec"]),
    ("model", &["codec", "format"]),
    ("tune", &["codec", "format", "model"]),
    ("cuda", &["codec", "format", "model", "tune"]),
    ("server", &["codec", "model"]),
    ("check", &["codec", "model", "cuda"]),
    (
        "cli",
        &[
            "codec", "format", "model", "cuda", "check", "tune", "server",
        ],
    ),
    ("py", &["cli", "model", "format"]),
];

/// Each crate's module layers, lowest first. The crate root (lib.rs, main.rs) declares and
/// re-exports and is in none.
const LAYERS: &[(&str, &[&[&str]])] = &[
    (
        "codec",
        &[
            &["rng", "payload", "histogram", "matvec", "rans"],
            &["dtans", "df11", "palette", "lossy"],
        ],
    ),
    (
        "format",
        &[
            &[
                "error",
                "dtype",
                "checksum",
                "input",
                "staging",
                "ggml_blocks",
                "kquants",
                "qtype",
            ],
            &["safetensors", "container"],
            &["coded"],
        ],
    ),
    (
        "model",
        &[
            &[
                "error",
                "arch",
                "crew",
                "config",
                "coding_plan",
                "rates",
                "chat",
                "tokenizer",
                "gguf",
                "gguf::types",
                "gguf::blocks",
                "gguf::dequant",
            ],
            &["weights", "forms", "gguf::file", "gguf::write"],
            &[
                "hf_quant",
                "load",
                "calib",
                "synth",
                "gguf::source",
                "gguf::container",
            ],
            &["compress", "engine", "eval", "sampler"],
        ],
    ),
    (
        "tune",
        &[
            &["error", "budget", "front", "knapsack"],
            &["file", "costs"],
            &["tuner"],
            &["planner", "lossy", "plot"],
        ],
    ),
    (
        "cuda",
        &[
            &["error", "jit", "device", "mem", "timing"],
            &["ops", "coded", "tuned", "gemm", "families"],
            &["linear", "plan", "forms"],
            &["engine", "engine_coded"],
            &["tune"],
        ],
    ),
    ("server", &[&["api", "metrics", "text"], &["worker"]]),
    (
        "check",
        &[
            &["selftest"],
            &[
                "dtans_selftest",
                "engine_selftest",
                "families_selftest",
                "ggml_selftest",
                "int_selftest",
                "lossy_selftest",
            ],
            &[
                "bench",
                "bench_coded",
                "bench_fp8",
                "bench_ggml",
                "bench_int",
                "bench_lossy",
                "variants",
            ],
        ],
    ),
    (
        "cli",
        &[
            &["progress", "budget", "generate"],
            &["bench", "compress", "inspect", "serve", "selftest"],
            &["decompress", "synth", "tune"],
        ],
    ),
    ("py", &[&["forms"], &["container", "engine"]]),
];

/// Imports from a lower layer into a higher one: (crate, from, to, why); `from` and `to` match a
/// module and its children.
const UPWARD: &[(&str, &str, &str, &str)] = &[
    // None left: the forms no longer reach the pipeline (`compress::Coder`), `LoadReport` or
    // `host_bf16` above them.
];

/// The import cycles inside a crate: (crate, modules, why).
const CYCLES: &[(&str, &[&str], &str)] = &[
    (
        "model",
        &[
            "forms",
            "forms::dense",
            "forms::df11",
            "forms::dtans",
            "forms::ggml",
            "forms::int",
            "forms::lossy",
            "forms::palette",
            "weights",
        ],
        "the forms implement `weights::Linear` and build its dense matrices, and a `Linear` \
         names its form and exact values (`forms::FormId`, `forms::Source`)",
    ),
    (
        "cuda",
        &[
            "forms",
            "forms::bf16",
            "forms::dtans",
            "forms::fp8",
            "forms::ggml",
            "forms::int",
            "forms::lossy",
            "forms::pal_bf16",
            "forms::stacked",
            "linear",
            "plan",
        ],
        "the forms implement `linear::GpuMatrix` and `plan::LaunchForm`, while `GpuMatrix` \
         returns the dense form's type (`as_dense`) and the plan builds the embedding from \
         `forms::bf16::desc`",
    ),
    (
        "format",
        &["kquants", "qtype"],
        "the quant-type table's rows name the k-quants' field layouts, and the k-quants' split \
         and join key on the table's type",
    ),
    (
        "cuda",
        &["engine", "engine_coded"],
        "the engine builds a coded model through engine_coded, which serves its launches with \
         the engine's step",
    ),
    (
        "cuda",
        &["ops::forward", "ops::gemv_fp8"],
        "the palette GEMVs take their fused epilogues from `ops::forward`, whose variant list \
         names the palette GEMVs' launch candidates",
    ),
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every crate of crates/: name and folder.
fn crates() -> Vec<(String, PathBuf)> {
    let mut v: Vec<_> = std::fs::read_dir(workspace().join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("Cargo.toml").is_file())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), p))
        .collect();
    v.sort();
    v
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a source file under `src` ("" for the crate roots).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts.join("::")
}

/// The text without comments and without `#[cfg(test)]` modules.
fn code(text: &str) -> String {
    let mut lines = Vec::new();
    for line in text.lines() {
        // Cut at a `//` outside a string literal.
        let (mut in_str, mut esc, mut cut) = (false, false, line.len());
        let b = line.as_bytes();
        for i in 0..b.len() {
            match b[i] {
                b'\\' if in_str => {
                    esc = !esc;
                    continue;
                }
                b'"' if !esc => in_str = !in_str,
                b'/' if !in_str && b.get(i + 1) == Some(&b'/') => {
                    cut = i;
                    break;
                }
                _ => {}
            }
            esc = false;
        }
        lines.push(&line[..cut]);
    }
    let mut out = String::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() == "#[cfg(test)]" {
            let mut j = i + 1;
            while j < lines.len() && lines[j].trim_start().starts_with("#[") {
                j += 1;
            }
            let l = lines.get(j).map_or("", |l| l.trim());
            let is_mod = ["mod ", "pub mod ", "pub(crate) mod "]
                .iter()
                .any(|p| l.starts_with(p));
            if is_mod && l.ends_with('{') {
                let mut depth = 0i64;
                let mut k = j;
                while k < lines.len() {
                    depth += lines[k].matches('{').count() as i64;
                    depth -= lines[k].matches('}').count() as i64;
                    if depth == 0 {
                        break;
                    }
                    k += 1;
                }
                i = k + 1;
                continue;
            }
        }
        out.push_str(lines[i]);
        out.push('\n');
        i += 1;
    }
    out
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Splits a brace group's inside at its top-level commas.
fn split_top(s: &str) -> Vec<&str> {
    let (mut depth, mut start, mut parts) = (0, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

/// The paths of `item` (`a::b`, `a::{b, c::{d}}`, `a as x`), each from `prefix`.
fn expand(prefix: &[String], item: &str, out: &mut Vec<Vec<String>>) {
    let item = item.trim();
    if item.is_empty() {
        return;
    }
    if let Some(open) = item.find('{') {
        let head: Vec<String> = item[..open]
            .split("::")
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        let close = item.rfind('}').unwrap_or(item.len());
        let mut p = prefix.to_vec();
        p.extend(head);
        for part in split_top(&item[open + 1..close]) {
            expand(&p, part, out);
        }
        return;
    }
    let item = item.split(" as ").next().unwrap().trim();
    let mut p = prefix.to_vec();
    p.extend(
        item.split("::")
            .map(str::trim)
            .filter(|s| !s.is_empty() && *s != "self")
            .map(String::from),
    );
    out.push(p);
}

/// Every path from `crate::`, `super::` or `self::` in `code`, resolved from module `module` to
/// absolute segments.
fn imports(code: &str, module: &str) -> Vec<Vec<String>> {
    let base: Vec<String> = module
        .split("::")
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    let b = code.as_bytes();
    let mut paths = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let start = ["crate::", "super::", "self::"]
            .iter()
            .find(|k| b[i..].starts_with(k.as_bytes()))
            .filter(|_| i == 0 || !is_ident(b[i - 1]) && b[i - 1] != b':');
        if start.is_none() {
            i += 1;
            continue;
        }
        // The path: identifiers, `::`, `*`, and one brace group (nested), as written.
        let mut j = i;
        let mut depth = 0;
        while j < b.len() {
            let c = b[j];
            if c == b'{' {
                depth += 1;
            } else if c == b'}' {
                if depth == 0 {
                    break;
                }
                depth -= 1;
                if depth == 0 {
                    j += 1;
                    break;
                }
            } else if depth == 0 && !(is_ident(c) || c == b':' || c == b'*') {
                break;
            }
            j += 1;
        }
        let text = &code[i..j];
        let mut resolved = Vec::new();
        expand(&[], text, &mut resolved);
        for p in resolved {
            let mut abs = base.clone();
            let mut rest = p.as_slice();
            match rest.first().map(String::as_str) {
                Some("crate") => {
                    abs.clear();
                    rest = &rest[1..];
                }
                Some("self") => rest = &rest[1..],
                _ => {}
            }
            while rest.first().is_some_and(|s| s == "super") {
                abs.pop();
                rest = &rest[1..];
            }
            abs.extend(rest.iter().filter(|s| *s != "*").cloned());
            paths.push(abs);
        }
        i = j.max(i + 1);
    }
    paths
}

/// One crate's modules and the edges between them (from → to).
struct Graph {
    files: BTreeMap<String, PathBuf>,
    edges: BTreeMap<String, BTreeSet<String>>,
}

fn graph(dir: &Path) -> Graph {
    let src = dir.join("src");
    let mut paths = Vec::new();
    rs_files(&src, &mut paths);
    let mut files = BTreeMap::new();
    for f in paths {
        // src/bin/* and the crate roots are binaries' and the crate's roots, not modules.
        let m = module_of(&src, &f);
        if !m.is_empty() && !f.starts_with(src.join("bin")) {
            files.insert(m, f);
        }
    }
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, f) in &files {
        let text = code(&std::fs::read_to_string(f).unwrap());
        for p in imports(&text, m) {
            let target = (1..=p.len())
                .rev()
                .map(|n| p[..n].join("::"))
                .find(|t| files.contains_key(t));
            let Some(t) = target else { continue };
            if t != *m && !within(m, &t) {
                edges.entry(m.clone()).or_default().insert(t);
            }
        }
        // A module's own use of a child (`child::item`); its `pub use` re-exports are a facade.
        let body: String = text
            .lines()
            .filter(|l| {
                !["pub use ", "pub(crate) use "]
                    .iter()
                    .any(|p| l.trim_start().starts_with(p))
            })
            .collect::<Vec<_>>()
            .join("\n");
        for child in files.keys() {
            let Some(name) = child.strip_prefix(&format!("{m}::")) else {
                continue;
            };
            if name.contains("::") {
                continue;
            }
            let pat = format!("{name}::");
            let used = body.match_indices(&pat).any(|(at, _)| {
                at == 0 || {
                    let c = body.as_bytes()[at - 1];
                    !is_ident(c) && c != b':'
                }
            });
            if used {
                edges.entry(m.clone()).or_default().insert(child.clone());
            }
        }
    }
    Graph { files, edges }
}

/// The strongly connected components of more than one module (Tarjan).
fn cycles(g: &Graph) -> Vec<BTreeSet<String>> {
    struct T<'a> {
        g: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        if let Some(ws) = t.g.edges.get(v) {
            for w in ws {
                let w = w.as_str();
                if !t.index.contains_key(w) {
                    visit(t, w);
                    let l = t.low[v].min(t.low[w]);
                    t.low.insert(v, l);
                } else if t.on.contains(w) {
                    let l = t.low[v].min(t.index[w]);
                    t.low.insert(v, l);
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut scc = BTreeSet::new();
            loop {
                let w = t.stack.pop().unwrap();
                t.on.remove(w);
                scc.insert(w.to_string());
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                t.out.push(scc);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.files.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

fn within(m: &str, prefix: &str) -> bool {
    m == prefix || m.starts_with(&format!("{prefix}::"))
}

/// The layer of `m`: that of its longest listed prefix.
fn layer(layers: &[&[&str]], m: &str) -> Option<usize> {
    layers
        .iter()
        .enumerate()
        .flat_map(|(i, l)| l.iter().map(move |p| (i, *p)))
        .filter(|(_, p)| within(m, p))
        .max_by_key(|(_, p)| p.len())
        .map(|(i, _)| i)
}

#[test]
fn crates_depend_as_listed_and_serving_crates_not_on_the_checks() {
    let mut bad = Vec::new();
    for (name, dir) in crates() {
        let allowed = CRATE_DEPS
            .iter()
            .find(|(c, _)| *c == name)
            .unwrap_or_else(|| panic!("crate {name} is not in CRATE_DEPS"))
            .1;
        let toml = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        for line in toml.lines() {
            let dep = line.split(['=', '.', ' ']).next().unwrap_or("");
            let dep = match dep {
                "entrollm" => "cli",
                d => match d.strip_prefix("entrollm-") {
                    Some(d) => d,
                    None => continue,
                },
            };
            if !allowed.contains(&dep) {
                bad.push(format!("{name} depends on {dep}"));
            }
        }
    }
    for s in SERVING {
        let deps = CRATE_DEPS.iter().find(|(c, _)| c == s).unwrap().1;
        assert!(
            !deps.contains(&"check"),
            "CRATE_DEPS lets {s} use the checks"
        );
        assert!(!deps.contains(&"cli"), "CRATE_DEPS lets {s} use the cli");
    }
    assert!(
        bad.is_empty(),
        "dependencies not in CRATE_DEPS:\n{}",
        bad.join("\n")
    );
}

#[test]
fn serving_crates_name_no_check_and_include_only_their_own_files() {
    let mut bad = Vec::new();
    let mut read = 0;
    for (name, dir) in crates() {
        if !SERVING.contains(&name.as_str()) {
            continue;
        }
        let dir = dir.canonicalize().unwrap();
        let mut files = Vec::new();
        for sub in ["src", "tests", "benches", "examples"] {
            rs_files(&dir.join(sub), &mut files);
        }
        for f in &files {
            read += 1;
            let stem = f.file_stem().unwrap().to_string_lossy();
            if f.starts_with(dir.join("src"))
                && (stem.contains("selftest") || stem.starts_with("bench"))
            {
                bad.push(format!(
                    "{}: a check module in a serving crate",
                    f.display()
                ));
            }
            let text = std::fs::read_to_string(f).unwrap();
            let text = code(&text);
            for (i, line) in text.lines().enumerate() {
                if line.contains(concat!("entrollm", "_check")) {
                    bad.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
                }
                for mac in ["include_str!(\"", "include_bytes!(\""] {
                    let Some(at) = line.find(mac) else { continue };
                    let rest = &line[at + mac.len()..];
                    let rel = &rest[..rest.find('"').unwrap_or(rest.len())];
                    let target = f.parent().unwrap().join(rel);
                    let inside = target.canonicalize().is_ok_and(|t| t.starts_with(&dir));
                    if !inside {
                        bad.push(format!(
                            "{}:{}: includes {rel}, outside {}",
                            f.display(),
                            i + 1,
                            dir.display()
                        ));
                    }
                }
            }
        }
    }
    assert!(read > 100, "only {read} files read");
    assert!(
        bad.is_empty(),
        "serving crates reach the checks or outside themselves:\n{}",
        bad.join("\n")
    );
}

#[test]
fn modules_import_downward_and_cycles_are_the_listed_ones() {
    let mut bad = Vec::new();
    let mut notes = Vec::new();
    for (name, dir) in crates() {
        let g = graph(&dir);
        let layers = LAYERS
            .iter()
            .find(|(c, _)| *c == name)
            .unwrap_or_else(|| panic!("crate {name} has no LAYERS"))
            .1;
        for m in g.files.keys() {
            if layer(layers, m).is_none() {
                bad.push(format!("{name}: module {m} is in no layer of LAYERS"));
            }
        }
        let mut upward = 0;
        for (from, tos) in &g.edges {
            for to in tos {
                // A module using its own child is the module tree, not a layering.
                let (Some(lf), Some(lt)) = (layer(layers, from), layer(layers, to)) else {
                    continue;
                };
                if within(to, from) {
                    continue;
                }
                if lt <= lf {
                    continue;
                }
                upward += 1;
                let listed = UPWARD
                    .iter()
                    .any(|(c, f, t, _)| *c == name && within(from, f) && within(to, t));
                if !listed {
                    bad.push(format!(
                        "{name}: {from} (layer {lf}) imports {to} (layer {lt}), upward and not in UPWARD"
                    ));
                }
            }
        }
        let found = cycles(&g);
        for scc in &found {
            let listed = CYCLES
                .iter()
                .any(|(c, ms, _)| *c == name && scc.iter().all(|m| ms.contains(&m.as_str())));
            if !listed {
                bad.push(format!("{name}: a new import cycle: {scc:?}"));
            }
        }
        for (c, ms, _) in CYCLES.iter().filter(|(c, _, _)| *c == name) {
            let still = found
                .iter()
                .map(|s| s.iter().filter(|m| ms.contains(&m.as_str())).count())
                .max()
                .unwrap_or(0);
            if still < ms.len() {
                notes.push(format!(
                    "{c}: the listed cycle of {} modules now spans {still}: shrink CYCLES",
                    ms.len()
                ));
            }
        }
        let n_edges: usize = g.edges.values().map(BTreeSet::len).sum();
        println!(
            "{name}: {} modules, {n_edges} imports, {upward} upward, cycles: {:?}",
            g.files.len(),
            found.iter().map(BTreeSet::len).collect::<Vec<_>>()
        );
    }
    for n in &notes {
        println!("note: {n}");
    }
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

/// The reader itself: comments, test modules, brace groups, `super` and `self`.
#[test]
fn imports_are_read_as_written() {
    let text = "use crate::{a::{b, c as d}, e};\n// crate::commented\nfn f() { super::g::h(); }\n\
                #[cfg(test)]\nmod tests {\n    use crate::t;\n}\nuse self::k::*;\n";
    let got = imports(&code(text), "x::y");
    let want: Vec<Vec<String>> = [
        &["a", "b"][..],
        &["a", "c"],
        &["e"],
        &["x", "g", "h"],
        &["x", "y", "k"],
    ]
    .iter()
    .map(|p| p.iter().map(|s| s.to_string()).collect())
    .collect();
    assert_eq!(got, want);
    assert_eq!(module_of(Path::new("s"), Path::new("s/a/mod.rs")), "a");
    assert_eq!(module_of(Path::new("s"), Path::new("s/a/b.rs")), "a::b");
}
