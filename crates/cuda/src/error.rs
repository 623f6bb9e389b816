//! Errors of the GPU runtime. Every failure names what failed (library, kernel, argument) so callers
//! can report it or fall back to the CPU engine.

use std::path::PathBuf;

use cudarc::driver::DriverError;

pub type Result<T, E = GpuError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No usable GPU: driver library missing, `cuInit` failing, or no device with that ordinal.
    /// Callers fall back to the CPU on this variant.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// libnvrtc could not be loaded, so kernels cannot be compiled.
    #[error("NVRTC unavailable: {0}")]
    NoNvrtc(String),
    #[error("CUDA driver call failed while {context}: {source}")]
    Driver {
        context: String,
        #[source]
        source: DriverError,
    },
    #[error("cuBLAS call failed while {context}: {status}")]
    Cublas { context: String, status: String },
    #[error("NVRTC could not compile kernel `{kernel}` with [{options}]: {message}\n{log}")]
    Compile {
        kernel: String,
        options: String,
        message: String,
        log: String,
    },
    #[error("kernel cache {}: {source}", path.display())]
    Cache {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{op}: {message}")]
    InvalidArgument { op: &'static str, message: String },
    #[error("GPU selftest failed:\n{0}")]
    Selftest(String),
}

impl GpuError {
    pub fn invalid(op: &'static str, message: impl Into<String>) -> Self {
        GpuError::InvalidArgument {
            op,
            message: message.into(),
        }
    }
}

/// Attaches what the runtime was doing to a driver error.
pub trait DriverContext<T> {
    fn while_(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> DriverContext<T> for std::result::Result<T, DriverError> {
    fn while_(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| GpuError::Driver {
            context: context(),
            source,
        })
    }
}
