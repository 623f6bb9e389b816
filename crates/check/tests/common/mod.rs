//! Helpers shared by the GPU test binaries (each uses a subset).
#![allow(dead_code)]

use entrollm_cuda::GpuDevice;

/// The first CUDA device, its description printed.
pub fn open() -> GpuDevice {
    let dev = GpuDevice::open(0).expect("a CUDA device");
    println!("device: {:?}", dev.info());
    dev
}

/// The comma-separated numbers of environment variable `name`, else `default`.
pub fn env_list(name: &str, default: &[u32]) -> Vec<u32> {
    std::env::var(name)
        .ok()
        .map(|s| s.split(',').filter_map(|v| v.trim().parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

/// Whether launch shape `name` is selected by DTANS_SHAPES (comma-separated names; unset: all).
pub fn shape_selected(name: &str) -> bool {
    std::env::var("DTANS_SHAPES").map_or(true, |s| s.split(',').any(|v| v.trim() == name))
}

/// Compiles `variants` into the kernel cache (`ENTROLLM_CACHE`), reporting where; panics with the
/// compiler's messages when one fails.
pub fn precompile(variants: &[entrollm_cuda::jit::KernelVariant]) {
    match entrollm_cuda::jit::precompile(variants) {
        Ok(dir) => println!("{} variants cached in {}", variants.len(), dir.display()),
        Err(failed) => panic!("{failed}"),
    }
}
