//! Every kernel variant the runtime and the selftests launch with their built-in configurations,
//! for precompiling cubins and for CI's NVRTC-only compile (`tools/nvrtc-check`).

use entrollm_cuda::jit::KernelVariant;

use crate::dtans_selftest::builtin_variants;

/// Every kernel variant the runtime and the selftests launch with their built-in configurations;
/// CI compiles all of them with NVRTC alone (`tools/nvrtc-check`).
pub fn all_variants() -> Vec<KernelVariant> {
    let mut v = vec![
        entrollm_cuda::ops::elementwise::variant(),
        entrollm_cuda::ops::rope::variant(),
        entrollm_cuda::ops::argmax::variant(),
        entrollm_cuda::ops::families::variant(),
    ];
    v.extend(
        entrollm_cuda::ops::gemv::GemvConfig::CANDIDATES
            .iter()
            .map(|c| c.variant()),
    );
    v.extend(
        entrollm_cuda::ops::attention::AttnConfig::builtin()
            .iter()
            .map(|c| c.variant()),
    );
    v.extend(entrollm_cuda::ops::forward::all_variants());
    v.extend(builtin_variants());
    v.push(entrollm_cuda::ops::dtans_encode::variant());
    v.extend(entrollm_cuda::ops::lossy::all_variants());
    v.extend(entrollm_cuda::ops::ggml::all_variants());
    v.extend(entrollm_cuda::ops::int::all_variants());
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_include_no_headers() {
        for v in all_variants() {
            let text = v.program_text();
            assert!(
                !text.contains("#include"),
                "{} includes a header",
                v.source.name
            );
        }
    }
}
