//! The checks of entrollm's GPU runtime (entrollm-cuda): the selftests of `entrollm selftest --gpu`
//! (every kernel against its CPU reference on fresh random inputs, the forward pass and whole
//! models against the CPU engine) and the cold-cache kernel benchmarks beside cuBLAS.
//!
//! No serving crate depends on this one (crates/cuda/tests/layering.rs): the runtime takes the
//! timing protocol from `entrollm_cuda::timing` and its data from its own modules, and the checks
//! import from it.

pub mod bench;
pub mod bench_coded;
pub mod bench_fp8;
pub mod bench_ggml;
pub mod bench_int;
pub mod bench_lossy;
pub mod dtans_selftest;
pub mod engine_selftest;
pub mod families_selftest;
pub mod ggml_selftest;
pub mod int_selftest;
pub mod lossy_selftest;
pub mod selftest;
pub mod variants;
