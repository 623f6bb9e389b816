//! Batch-1 BF16 GEMV `y = W·x` (`kernels/gemv.cu`): W row-major [n, k] BF16, x and y f32.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use rayon::prelude::*;

use super::{as_i32, bf16_to_f32, check_len};
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::jit::{KernelVariant, GEMV};

/// Tuning parameters, compiled in as `-D` defines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemvConfig {
    /// Warps per block.
    pub warps: u32,
    /// Consecutive rows per warp (each x chunk is reused across them).
    pub rows: u32,
    /// 16-byte chunks per row in flight per lane before the first FMA.
    pub unroll: u32,
}

impl GemvConfig {
    pub const DEFAULT: GemvConfig = GemvConfig {
        warps: 4,
        rows: 2,
        unroll: 4,
    };

    /// The configurations the timing sweep and the selftest cover.
    pub const CANDIDATES: [GemvConfig; 8] = [
        GemvConfig::DEFAULT,
        GemvConfig {
            warps: 4,
            rows: 1,
            unroll: 8,
        },
        GemvConfig {
            warps: 4,
            rows: 2,
            unroll: 2,
        },
        GemvConfig {
            warps: 4,
            rows: 4,
            unroll: 2,
        },
        GemvConfig {
            warps: 8,
            rows: 2,
            unroll: 4,
        },
        GemvConfig {
            warps: 2,
            rows: 4,
            unroll: 4,
        },
        GemvConfig {
            warps: 8,
            rows: 1,
            unroll: 4,
        },
        GemvConfig {
            warps: 16,
            rows: 1,
            unroll: 4,
        },
    ];

    pub fn variant(&self) -> KernelVariant {
        KernelVariant::new(
            &GEMV,
            vec![
                ("GEMV_WARPS", self.warps as i64),
                ("GEMV_ROWS", self.rows as i64),
                ("GEMV_UNROLL", self.unroll as i64),
            ],
        )
    }

    /// The launch over `n` rows: `rows` per warp, `warps` per block.
    pub fn launch(&self, n: usize) -> LaunchConfig {
        let rows_per_block = (self.warps * self.rows) as usize;
        LaunchConfig {
            grid_dim: (n.div_ceil(rows_per_block) as u32, 1, 1),
            block_dim: (self.warps * 32, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

impl std::fmt::Display for GemvConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "w{}r{}u{}", self.warps, self.rows, self.unroll)
    }
}

/// Checks a GEMV shape: k must be a multiple of 8 (16-byte aligned rows) and sizes fit the kernel.
pub fn check_gemv_shape(n: usize, k: usize) -> Result<()> {
    check_chunked_shape("gemv", n, k, 8)
}

/// Checks the shape of a GEMV that reads rows in 16-byte chunks of `per_chunk` weights: n and k
/// positive, k a multiple of `per_chunk`, both within the kernels' `int`.
pub(crate) fn check_chunked_shape(
    op: &'static str,
    n: usize,
    k: usize,
    per_chunk: usize,
) -> Result<()> {
    if n == 0 || k == 0 || k % per_chunk != 0 {
        return Err(GpuError::invalid(
            op,
            format!("shape [{n}, {k}]: n and k must be > 0 and k a multiple of {per_chunk}"),
        ));
    }
    as_i32(op, "n", n)?;
    as_i32(op, "k", k)?;
    Ok(())
}

/// `y[..n] = W x` with W the first n·k elements of `w`.
pub fn launch_gemv(
    dev: &GpuDevice,
    cfg: GemvConfig,
    w: &CudaSlice<u16>,
    x: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    n: usize,
    k: usize,
) -> Result<()> {
    const OP: &str = "gemv";
    check_gemv_shape(n, k)?;
    check_len(OP, "w", w, n * k)?;
    check_len(OP, "x", x, k)?;
    check_len(OP, "y", y, n)?;
    let f = dev.function(&cfg.variant(), "gemv_bf16")?;
    let launch = cfg.launch(n);
    let (n_i, k_i) = (n as i32, k as i32);
    let mut b = dev.stream().launch_builder(&f);
    b.arg(w).arg(x).arg(y).arg(&n_i).arg(&k_i);
    // SAFETY: argument types and counts match the kernel; sizes were checked above.
    unsafe { b.launch(launch) }.while_(|| format!("launching gemv_bf16 {cfg} [{n}, {k}]"))?;
    Ok(())
}

/// CPU reference in f64 over the same BF16 weights.
pub fn gemv_ref(w: &[u16], x: &[f32], n: usize, k: usize) -> Vec<f32> {
    (0..n)
        .into_par_iter()
        .map(|r| {
            w[r * k..(r + 1) * k]
                .iter()
                .zip(x)
                .map(|(&wv, &xv)| bf16_to_f32(wv) as f64 * xv as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::f32_to_bf16;

    #[test]
    fn gemv_ref_small() {
        let w: Vec<u16> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]
            .iter()
            .map(|&v| f32_to_bf16(v))
            .collect();
        assert_eq!(gemv_ref(&w, &[1.0, 0.5, -1.0], 2, 3), vec![-1.0, 0.5]);
    }

    #[test]
    fn shapes_are_checked() {
        assert!(check_gemv_shape(4096, 4096).is_ok());
        assert!(check_gemv_shape(4096, 4100).is_err());
        assert!(check_gemv_shape(0, 8).is_err());
        assert!(check_gemv_shape(1 << 31, 8).is_err());
    }

    #[test]
    fn candidate_variants_are_distinct() {
        let names: std::collections::HashSet<_> = GemvConfig::CANDIDATES
            .iter()
            .map(|c| c.variant().cache_file_name("sm_90"))
            .collect();
        assert_eq!(names.len(), GemvConfig::CANDIDATES.len());
    }
}
