//! Batch-1 dense FP8 E4M3 GEMV with per-row scales (`gemv_fp8` in `kernels/gemv.cu`):
//! `y[r] = s[r] · Σ_c fp8(W[r, c]) x[c]`, W row-major [n, k] bytes (k % 16 == 0), s f32 [n], x and
//! y f32; the epilogues of the BF16 GEMV (residual add, interleaved SwiGLU, RMSNorm of x on the
//! fly). The kernels share the BF16 GEMV's compiled modules ([`gemv_fused_variant`]). CPU
//! reference: the model crate's `RowScaled(DenseFp8)` matvec ([`gemv_fp8_ref`]). Also the FP8 → BF16
//! materialisation of a matrix for prefill GEMMs (`fp8_rows_to_bf16`, [`fp8_rows_to_bf16_ref`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, PushKernelArg};
use entrollm_codec::payload::fp8_e4m3_to_f32;
use entrollm_model::weights::{DenseFp8, RowScaled};
use entrollm_model::Linear;

use super::forward::{check_fusion, gemv_fused_variant, GemvFusion};
use super::gemv::GemvConfig;
use super::{as_i32, check_len};
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};

/// Checks a dense FP8 GEMV shape: k a multiple of 16 (16-byte aligned rows of one-byte weights).
pub fn check_gemv_fp8_shape(n: usize, k: usize) -> Result<()> {
    if n == 0 || k == 0 || k % 16 != 0 {
        return Err(GpuError::invalid(
            "gemv_fp8",
            format!("shape [{n}, {k}]: n and k must be > 0 and k a multiple of 16"),
        ));
    }
    as_i32("gemv_fp8", "n", n)?;
    as_i32("gemv_fp8", "k", k)?;
    Ok(())
}

/// The launch configuration for an FP8 shape. A 16-byte chunk holds 16 weights (8 for BF16), so
/// rows have half the chunks of BF16 ones: more rows per warp keep as many bytes in flight, except
/// on matrices too short to give every SM several warps. Rows per warp stay even (SwiGLU pairs).
pub fn gemv_fp8_config_for(rows: usize, cols: usize) -> GemvConfig {
    let (r, unroll) = if cols >= 8192 || rows < 4096 {
        (2, 4)
    } else {
        (4, 2)
    };
    GemvConfig {
        warps: 4,
        rows: r,
        unroll,
    }
}

/// `y = diag(s) · W · rmsnorm(x; g, eps)` (when `norm` is given, else `diag(s) · W x`) with
/// `fusion`'s epilogue; W FP8 E4M3 bytes [n, k], s f32 [n], x f32 [k], y f32 [n] (n/2 with
/// swiglu).
#[allow(clippy::too_many_arguments)]
pub fn launch_gemv_fp8(
    dev: &GpuDevice,
    cfg: GemvConfig,
    fusion: GemvFusion,
    w: &CudaSlice<u8>,
    scales: &CudaSlice<f32>,
    x: &CudaSlice<f32>,
    norm: Option<(&CudaSlice<f32>, f32)>,
    y: &mut CudaSlice<f32>,
    n: usize,
    k: usize,
) -> Result<()> {
    const OP: &str = "gemv_fp8";
    check_gemv_fp8_shape(n, k)?;
    check_len(OP, "w", w, n * k)?;
    check_len(OP, "scales", scales, n)?;
    check_len(OP, "x", x, k)?;
    check_len(OP, "y", y, if fusion.swiglu { n / 2 } else { n })?;
    check_fusion(OP, cfg, fusion, n)?;
    let variant = gemv_fused_variant(cfg, fusion);
    let launch = cfg.launch(n);
    let (n_i, k_i) = (n as i32, k as i32);
    let what = || format!("launching {OP} {cfg} {fusion:?} [{n}, {k}]");
    match norm {
        Some((g, eps)) => {
            check_len(OP, "norm weight", g, k)?;
            let f = dev.function(&variant, "gemv_fp8_norm")?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(w)
                .arg(scales)
                .arg(x)
                .arg(g)
                .arg(y)
                .arg(&n_i)
                .arg(&k_i)
                .arg(&eps);
            // SAFETY: argument types and counts match the kernel; sizes were checked above.
            unsafe { b.launch(launch) }.while_(what)?;
        }
        None => {
            let f = dev.function(&variant, "gemv_fp8")?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(w).arg(scales).arg(x).arg(y).arg(&n_i).arg(&k_i);
            // SAFETY: as above.
            unsafe { b.launch(launch) }.while_(what)?;
        }
    }
    Ok(())
}

/// `out = bf16(fp8(W) · s[row])`, W FP8 E4M3 bytes [rows, cols] (cols % 16 == 0), s f32 [rows], out
/// BF16 bits [rows, cols]: an FP8 matrix materialised for the prefill GEMM.
pub fn launch_fp8_rows_to_bf16(
    dev: &GpuDevice,
    w: &CudaSlice<u8>,
    scales: &CudaSlice<f32>,
    out: &mut CudaSlice<u16>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const OP: &str = "fp8_rows_to_bf16";
    check_gemv_fp8_shape(rows, cols)?;
    check_len(OP, "w", w, rows * cols)?;
    check_len(OP, "scales", scales, rows)?;
    if out.len() < rows * cols {
        return Err(GpuError::invalid(
            OP,
            format!("output holds {} elements, needs {}", out.len(), rows * cols),
        ));
    }
    let variant = gemv_fused_variant(GemvConfig::CANDIDATES[0], GemvFusion::default());
    let f = dev.function(&variant, OP)?;
    let n4 = (rows * cols / 4) as i64;
    let cols4 = (cols / 4) as i32;
    let blocks = (n4 as usize).div_ceil(256).min(132 * 16) as u32;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(w).arg(scales).arg(out).arg(&n4).arg(&cols4);
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument types and counts match the kernel; sizes were checked above.
    unsafe { b.launch(cfg) }.while_(|| format!("launching {OP} [{rows}, {cols}]"))?;
    Ok(())
}

/// CPU reference of [`launch_fp8_rows_to_bf16`]: each weight's f32 value times its row's scale,
/// rounded to BF16 (nearest even).
pub fn fp8_rows_to_bf16_ref(w: &[u8], scales: &[f32], cols: usize) -> Vec<u16> {
    w.chunks(cols)
        .zip(scales)
        .flat_map(|(row, &s)| {
            row.iter()
                .map(move |&c| half::bf16::from_f32(fp8_e4m3_to_f32(c) * s).to_bits())
        })
        .collect()
}

/// CPU reference: the model crate's row-scaled dense FP8 matrix, `y = diag(s) · W x`.
pub fn gemv_fp8_ref(w: &[u8], scales: &[f32], x: &[f32], n: usize, k: usize) -> Result<Vec<f32>> {
    if x.len() != k {
        return Err(GpuError::invalid(
            "gemv_fp8_ref",
            format!("x has {} elements, the matrix {k} columns", x.len()),
        ));
    }
    let dense = DenseFp8::new("gemv_fp8_ref", n, k, w.to_vec())
        .map_err(|e| GpuError::invalid("gemv_fp8_ref", e.to_string()))?;
    let m = RowScaled::new("gemv_fp8_ref", Arc::new(dense), scales.to_vec())
        .map_err(|e| GpuError::invalid("gemv_fp8_ref", e.to_string()))?;
    let mut y = vec![0f32; n];
    m.matvec(x, &mut y);
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_shapes_are_checked() {
        assert!(check_gemv_fp8_shape(4096, 4096).is_ok());
        assert!(check_gemv_fp8_shape(4096, 4104).is_err());
        assert!(check_gemv_fp8_shape(0, 16).is_err());
        assert!(check_gemv_fp8_shape(1 << 31, 16).is_err());
    }

    #[test]
    fn fp8_ref_applies_row_scales() {
        // 0x38 = 1.0, 0x40 = 2.0, 0xC0 = -2.0 in E4M3.
        let w = [0x38u8, 0x40, 0xC0, 0x38].repeat(4);
        let x = vec![1.0f32; 8];
        let y = gemv_fp8_ref(&w, &[0.5, 2.0], &x, 2, 8).unwrap();
        assert!(gemv_fp8_ref(&w, &[0.5, 2.0], &x[..7], 2, 8).is_err());
        assert_eq!(y, vec![0.5 * 4.0, 2.0 * 4.0]);
    }

    #[test]
    fn fp8_configs_fit_swiglu() {
        for (n, k) in [(28_672, 4096), (6144, 4096), (4096, 14_336), (64, 4096)] {
            assert_eq!(gemv_fp8_config_for(n, k).rows % 2, 0);
        }
    }
}
