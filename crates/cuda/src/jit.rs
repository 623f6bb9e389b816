//! NVRTC compilation of the embedded kernel sources, with a disk cache of cubins.
//!
//! Every kernel source in `kernels/*.cu` is embedded with `include_str!`, prefixed with
//! `kernels/common.cuh`, and compiled for the running GPU's architecture (`sm_XY`) with its tuning
//! parameters as `-D` defines. Cubins are cached under `${ENTROLLM_CACHE:-~/.cache/entrollm}/kernels/`
//! keyed by a hash of (source, options, arch); a corrupt or unreadable cache entry is recompiled.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys};

use crate::error::{GpuError, Result};

const COMMON: &str = include_str!("../kernels/common.cuh");

/// One embedded `.cu` file.
#[derive(Debug)]
pub struct KernelSource {
    /// File name, used in diagnostics and cache file names.
    pub name: &'static str,
    pub source: &'static str,
}

pub const ELEMENTWISE: KernelSource = KernelSource {
    name: "elementwise.cu",
    source: include_str!("../kernels/elementwise.cu"),
};
pub const ROPE: KernelSource = KernelSource {
    name: "rope.cu",
    source: include_str!("../kernels/rope.cu"),
};
pub const ARGMAX: KernelSource = KernelSource {
    name: "argmax.cu",
    source: include_str!("../kernels/argmax.cu"),
};
pub const GEMV: KernelSource = KernelSource {
    name: "gemv.cu",
    source: include_str!("../kernels/gemv.cu"),
};
pub const ATTENTION: KernelSource = KernelSource {
    name: "attention.cu",
    source: include_str!("../kernels/attention.cu"),
};

pub const ENGINE: KernelSource = KernelSource {
    name: "engine.cu",
    source: include_str!("../kernels/engine.cu"),
};
pub const FAMILIES: KernelSource = KernelSource {
    name: "families.cu",
    source: include_str!("../kernels/families.cu"),
};
pub const PREFILL: KernelSource = KernelSource {
    name: "prefill.cu",
    source: include_str!("../kernels/prefill.cu"),
};

/// A kernel source with its tuning defines: one compiled module.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelVariant {
    pub source: &'static KernelSource,
    pub defines: Vec<(&'static str, i64)>,
}

impl std::hash::Hash for KernelSource {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name.hash(state);
    }
}
impl PartialEq for KernelSource {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && self.source == other.source
    }
}
impl Eq for KernelSource {}

impl KernelVariant {
    pub fn new(source: &'static KernelSource, defines: Vec<(&'static str, i64)>) -> Self {
        KernelVariant { source, defines }
    }

    /// The full program text handed to NVRTC.
    pub fn program_text(&self) -> String {
        format!(
            "{COMMON}\n#line 1 \"{}\"\n{}",
            self.source.name, self.source.source
        )
    }

    /// NVRTC options for `arch` (e.g. `sm_90`).
    pub fn options(&self, arch: &str) -> Vec<String> {
        let mut opts = vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".to_string(),
        ];
        opts.extend(self.defines.iter().map(|(k, v)| format!("-D{k}={v}")));
        opts
    }

    /// Cache key: hash of (program text, options, arch), readable prefix for humans.
    pub fn cache_file_name(&self, arch: &str) -> String {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(self.program_text().as_bytes());
        for o in self.options(arch) {
            h.update(b"\0");
            h.update(o.as_bytes());
        }
        let stem = self.source.name.trim_end_matches(".cu");
        format!("{stem}-{arch}-{:016x}.cubin", h.digest())
    }
}

/// Whether libnvrtc can be loaded, and its version. Checked before any NVRTC call because cudarc
/// panics when the library is missing.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    // SAFETY: only tries to dlopen the library by its usual names.
    if !unsafe { nvrtc_sys::is_culib_present() } {
        return Err(GpuError::NoNvrtc(
            "libnvrtc.so not found on the library path (install the CUDA toolkit or the PyPI \
             package nvidia-cuda-nvrtc and add its lib directory to LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; both pointers are valid.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| GpuError::NoNvrtc(format!("nvrtcVersion failed: {e:?}")))?;
    Ok((major, minor))
}

/// Compiles `variant` for `arch` to a cubin (machine code; no PTX JIT at load time).
pub fn compile_cubin(variant: &KernelVariant, arch: &str) -> Result<Vec<u8>> {
    compile_with_log(variant, arch, &[]).map(|(cubin, _)| cubin)
}

/// [`compile_cubin`] with extra NVRTC options (e.g. `--ptxas-options=-v` for the resource
/// report); returns the cubin and the compiler log.
pub fn compile_with_log(
    variant: &KernelVariant,
    arch: &str,
    extra_options: &[&str],
) -> Result<(Vec<u8>, String)> {
    nvrtc_version()?;
    let mut options = variant.options(arch);
    options.extend(extra_options.iter().map(|o| o.to_string()));
    let compile_err = |message: String, log: String| GpuError::Compile {
        kernel: variant.source.name.to_string(),
        options: options.join(" "),
        message,
        log,
    };
    let text = CString::new(variant.program_text())
        .map_err(|_| compile_err("source contains a NUL byte".into(), String::new()))?;
    let name = CString::new(variant.source.name).expect("kernel names have no NUL");
    let prog = nvrtc_result::create_program(&text, Some(&name))
        .map_err(|e| compile_err(format!("nvrtcCreateProgram: {e:?}"), String::new()))?;
    // SAFETY: `prog` is a live program until destroy_program below; `text` outlives it.
    let outcome = unsafe {
        let compiled = nvrtc_result::compile_program(prog, &options);
        let log = nvrtc_result::get_program_log(prog)
            .map(|raw| {
                let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
                CStr::from_bytes_until_nul(&bytes)
                    .map(|c| c.to_string_lossy().into_owned())
                    .unwrap_or_default()
            })
            .unwrap_or_default();
        match compiled {
            Err(e) => Err(compile_err(format!("{e:?}"), log)),
            Ok(()) => match get_cubin(prog) {
                Ok(cubin) => Ok((cubin, log)),
                Err(e) => Err(compile_err(format!("nvrtcGetCUBIN: {e:?}"), log)),
            },
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { nvrtc_result::destroy_program(prog) };
    outcome
}

unsafe fn get_cubin(prog: nvrtc_sys::nvrtcProgram) -> Result<Vec<u8>, nvrtc_sys::nvrtcResult> {
    let mut size = 0usize;
    let r = nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size);
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(r);
    }
    let mut buf = vec![0u8; size];
    let r = nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast());
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(r);
    }
    Ok(buf)
}

/// Compiles `variants` with NVRTC alone, in parallel, into the cubin cache
/// ([`default_cache_dir`]) for `DTANS_PRECOMPILE_ARCH` (default sm_90), so that a GPU run with the
/// same `ENTROLLM_CACHE` skips the JIT. Returns the cache directory; every failure is an error.
pub fn precompile(variants: &[KernelVariant]) -> std::result::Result<PathBuf, String> {
    use rayon::prelude::*;
    let arch = std::env::var("DTANS_PRECOMPILE_ARCH").unwrap_or_else(|_| "sm_90".into());
    let dir = default_cache_dir().ok_or("no cache directory: set ENTROLLM_CACHE or HOME")?;
    let failed: Vec<String> = variants
        .par_iter()
        .filter_map(|v| {
            cached_cubin(v, &arch, Some(&dir))
                .err()
                .map(|e| e.to_string())
        })
        .collect();
    if failed.is_empty() {
        Ok(dir)
    } else {
        Err(failed.join("\n"))
    }
}

/// `${ENTROLLM_CACHE:-~/.cache/entrollm}/kernels`, or None when neither variable gives a place.
pub fn default_cache_dir() -> Option<PathBuf> {
    Some(entrollm_model::load::cache_root()?.join("kernels"))
}

fn is_elf(bytes: &[u8]) -> bool {
    bytes.len() > 64 && bytes.starts_with(b"\x7fELF")
}

/// The cubin of `variant` for `arch`: from `cache_dir` when present and well-formed, else compiled
/// and stored there (written to a temporary file and renamed, so concurrent processes never read a
/// partial file). Cache write failures are reported, not ignored: a read-only cache is a setup error.
pub fn cached_cubin(
    variant: &KernelVariant,
    arch: &str,
    cache_dir: Option<&Path>,
) -> Result<Vec<u8>> {
    let Some(dir) = cache_dir else {
        return compile_cubin(variant, arch);
    };
    let path = dir.join(variant.cache_file_name(arch));
    if let Ok(bytes) = std::fs::read(&path) {
        if is_elf(&bytes) {
            return Ok(bytes);
        }
    }
    let cubin = compile_cubin(variant, arch)?;
    let cache_err = |source| GpuError::Cache {
        path: path.clone(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(cache_err)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        variant.cache_file_name(arch),
        std::process::id()
    ));
    std::fs::write(&tmp, &cubin).map_err(cache_err)?;
    std::fs::rename(&tmp, &path).map_err(cache_err)?;
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_depends_on_source_options_and_arch() {
        let a = KernelVariant::new(&GEMV, vec![("GEMV_ROWS", 2)]);
        let b = KernelVariant::new(&GEMV, vec![("GEMV_ROWS", 4)]);
        let c = KernelVariant::new(&ATTENTION, vec![("GEMV_ROWS", 2)]);
        assert_ne!(a.cache_file_name("sm_90"), b.cache_file_name("sm_90"));
        assert_ne!(a.cache_file_name("sm_90"), a.cache_file_name("sm_89"));
        assert_ne!(a.cache_file_name("sm_90"), c.cache_file_name("sm_90"));
        assert_eq!(
            a.cache_file_name("sm_90"),
            a.clone().cache_file_name("sm_90")
        );
        assert!(a.cache_file_name("sm_90").starts_with("gemv-sm_90-"));
    }

    #[test]
    fn options_carry_arch_and_defines() {
        let a = KernelVariant::new(&GEMV, vec![("GEMV_WARPS", 8)]);
        let opts = a.options("sm_90");
        assert!(opts.contains(&"--gpu-architecture=sm_90".to_string()));
        assert!(opts.contains(&"-DGEMV_WARPS=8".to_string()));
    }

    #[test]
    fn cache_dir_follows_entrollm_cache() {
        // Read-only check of the path rule; the variable is not modified (tests run in parallel).
        if let Some(dir) = std::env::var_os("ENTROLLM_CACHE").filter(|d| !d.is_empty()) {
            assert_eq!(
                default_cache_dir().unwrap(),
                PathBuf::from(dir).join("kernels")
            );
        } else if let Some(home) = std::env::var_os("HOME") {
            assert_eq!(
                default_cache_dir().unwrap(),
                PathBuf::from(home).join(".cache/entrollm/kernels")
            );
        }
    }

    #[test]
    fn corrupt_cache_entry_is_not_trusted() {
        assert!(!is_elf(b"\x7fELF"));
        assert!(!is_elf(&[0u8; 100]));
        let mut good = b"\x7fELF".to_vec();
        good.resize(100, 0);
        assert!(is_elf(&good));
    }
}
