//! GPU runtime of entrollm: device discovery, NVRTC-compiled kernels with a cubin cache, the
//! decode kernels with their CPU references, and the GPU forms. The selftests and benchmarks that
//! check them live in the entrollm-check crate, which no serving crate depends on.
//!
//! Nothing here needs CUDA at build time: libcuda, libnvrtc and libcublas are loaded at run time,
//! and [`device::device_count`] / [`GpuDevice::open`] return [`GpuError::NoDevice`] (never panic)
//! on machines without a driver or GPU so callers can fall back to the CPU engine.

pub mod coded;
pub mod device;
pub mod engine;
pub mod engine_coded;
pub mod error;
pub mod families;
pub mod forms;
pub mod gemm;
pub mod jit;
pub mod linear;
pub mod mem;
pub mod ops;
pub mod plan;
pub mod timing;
pub mod tune;
pub mod tuned;

pub use device::{DeviceInfo, GpuDevice};
pub use engine::{DecodeOptions, GpuEngine, GpuModel, MemoryUse};
pub use error::{GpuError, Result};
pub use linear::GpuLinear;
