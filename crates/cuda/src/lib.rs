//! GPU runtime of entrollm: device discovery, NVRTC-compiled kernels with a cubin cache, and the
//! dense BF16 decode kernels with CPU references and a selftest.
//!
//! Nothing here needs CUDA at build time: libcuda, libnvrtc and libcublas are loaded at run time,
//! and [`device::device_count`] / [`GpuDevice::open`] return [`GpuError::NoDevice`] (never panic)
//! on machines without a driver or GPU so callers can fall back to the CPU engine.

pub mod bench;
pub mod bench_coded;
pub mod bench_fp8;
pub mod bench_ggml;
pub mod bench_int;
pub mod bench_lossy;
pub mod coded;
pub mod device;
pub mod dtans_selftest;
pub mod engine;
pub mod engine_coded;
pub mod engine_selftest;
pub mod error;
pub mod families;
pub mod families_selftest;
pub mod forms;
pub mod gemm;
pub mod ggml_selftest;
pub mod int_selftest;
pub mod jit;
pub mod linear;
pub mod lossy_selftest;
pub mod mem;
pub mod ops;
pub mod plan;
pub mod selftest;
pub mod tune;
pub mod tuned;

pub use device::{DeviceInfo, GpuDevice};
pub use engine::{DecodeOptions, GpuEngine, GpuModel, MemoryUse};
pub use error::{GpuError, Result};
pub use linear::GpuLinear;
