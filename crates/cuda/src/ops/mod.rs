//! Kernels of the dense decode path. Each module holds the safe `launch_*` wrappers (validating
//! every size against the buffers before launching) and a plain-Rust CPU reference of the same
//! function, which the selftest compares against.
//!
//! Conventions: activations are f32 device buffers; BF16 weights, tables and KV caches are `u16`
//! device buffers holding BF16 bit patterns; positions, token ids and lengths are `i32`.

pub mod argmax;
pub mod attention;
pub mod dtans;
pub mod dtans_encode;
pub mod elementwise;
pub mod families;
pub mod forward;
pub mod gemv;
pub mod gemv_fp8;
pub mod ggml;
pub mod int;
pub mod lossy;
pub mod rope;

use cudarc::driver::CudaSlice;

use crate::error::{GpuError, Result};

/// Errors unless `buf` holds at least `need` elements.
pub(crate) fn check_len<T>(
    op: &'static str,
    name: &str,
    buf: &CudaSlice<T>,
    need: usize,
) -> Result<()> {
    if buf.len() < need {
        return Err(GpuError::invalid(
            op,
            format!(
                "buffer `{name}` holds {} elements, {need} needed",
                buf.len()
            ),
        ));
    }
    Ok(())
}

/// A size as the kernels' `int`, or an error naming it.
pub(crate) fn as_i32(op: &'static str, name: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| GpuError::invalid(op, format!("{name} = {v} exceeds i32")))
}

/// Grid size for a grid-stride loop over `n` elements with `block` threads.
pub(crate) fn grid_for(n: usize, block: u32) -> u32 {
    n.div_ceil(block as usize).clamp(1, 65_535) as u32
}

/// BF16 bits as f32 (exact).
pub fn bf16_to_f32(bits: u16) -> f32 {
    half::bf16::from_bits(bits).to_f32()
}

/// f32 rounded to BF16 bits (nearest even).
pub fn f32_to_bf16(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}
