//! Greedy sampling: argmax over f32 logits (`kernels/argmax.cu`), two passes.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{as_i32, check_len};
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::jit::{KernelVariant, ARGMAX};

pub fn variant() -> KernelVariant {
    KernelVariant::new(&ARGMAX, vec![])
}

const BLOCK: u32 = 512;

/// Scratch of the first pass: one (value, index) candidate per block.
pub struct ArgmaxScratch {
    values: CudaSlice<f32>,
    indices: CudaSlice<i32>,
}

impl ArgmaxScratch {
    /// Scratch for `n_blocks` first-pass blocks (a few per SM is plenty).
    pub fn new(dev: &GpuDevice, n_blocks: usize) -> Result<Self> {
        if n_blocks == 0 || n_blocks > 65_535 {
            return Err(GpuError::invalid("argmax", format!("{n_blocks} blocks")));
        }
        let s = dev.stream();
        Ok(ArgmaxScratch {
            values: s
                .alloc_zeros(n_blocks)
                .while_(|| "allocating argmax scratch".into())?,
            indices: s
                .alloc_zeros(n_blocks)
                .while_(|| "allocating argmax scratch".into())?,
        })
    }
}

/// `out[0]` = index of the largest of `x[..n]`; ties go to the smallest index, NaN is never
/// chosen, and -1 means every value was NaN (or n = 0).
pub fn launch_argmax(
    dev: &GpuDevice,
    x: &CudaSlice<f32>,
    n: usize,
    scratch: &mut ArgmaxScratch,
    out: &mut CudaSlice<i32>,
) -> Result<()> {
    const OP: &str = "argmax";
    check_len(OP, "x", x, n)?;
    check_len(OP, "out", out, 1)?;
    let n_i = as_i32(OP, "n", n)?;
    let blocks = (n.div_ceil(BLOCK as usize * 8)).clamp(1, scratch.values.len());
    let blocks_i = blocks as i32;
    let partial = dev.function(&variant(), "argmax_partial")?;
    let fin = dev.function(&variant(), "argmax_final")?;
    let mut b = dev.stream().launch_builder(&partial);
    b.arg(x)
        .arg(&n_i)
        .arg(&mut scratch.values)
        .arg(&mut scratch.indices);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument types and counts match the kernel; sizes were checked above.
    unsafe { b.launch(cfg) }.while_(|| "launching argmax_partial".into())?;
    let mut b = dev.stream().launch_builder(&fin);
    b.arg(&scratch.values)
        .arg(&scratch.indices)
        .arg(&blocks_i)
        .arg(out);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as above.
    unsafe { b.launch(cfg) }.while_(|| "launching argmax_final".into())?;
    Ok(())
}

/// CPU reference with the kernel's tie and NaN rules.
pub fn argmax_ref(x: &[f32]) -> i32 {
    let mut best: Option<(f32, usize)> = None;
    for (i, &v) in x.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        match best {
            Some((bv, _)) if v <= bv => {}
            _ => best = Some((v, i)),
        }
    }
    best.map_or(-1, |(_, i)| i as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_go_to_the_first_and_nan_is_skipped() {
        assert_eq!(argmax_ref(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax_ref(&[f32::NAN, -1.0, f32::NAN]), 1);
        assert_eq!(argmax_ref(&[f32::NAN]), -1);
        assert_eq!(argmax_ref(&[]), -1);
        assert_eq!(argmax_ref(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    }
}
