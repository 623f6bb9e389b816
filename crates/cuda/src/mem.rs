//! Host ↔ device copies of whole buffers, with errors that say what was copied.

use cudarc::driver::{CudaSlice, DeviceRepr};

use crate::device::GpuDevice;
use crate::error::{DriverContext, Result};

/// A device copy of `data`.
pub fn upload<T: DeviceRepr + Clone>(dev: &GpuDevice, data: &[T]) -> Result<CudaSlice<T>> {
    dev.stream()
        .clone_htod(data)
        .while_(|| format!("uploading {} elements", data.len()))
}

/// A host copy of `buf`.
pub fn download<T: DeviceRepr + Clone + Default>(
    dev: &GpuDevice,
    buf: &CudaSlice<T>,
) -> Result<Vec<T>> {
    dev.stream()
        .clone_dtoh(buf)
        .while_(|| format!("downloading {} elements", buf.len()))
}
