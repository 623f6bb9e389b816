//! Weight matrices on the GPU. Every linear of the forward pass is a [`GpuLinear`]: batch-1
//! products (decode) run a GEMV, batched products (prefill) a cuBLASLt GEMM. Variants are the
//! storage formats; the dense BF16 one is here, entropy-coded variants add their own arm (their
//! decode-matvec kernel for `matvec`, decode-then-GEMM for `matmul`).

use cudarc::driver::CudaSlice;

use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::gemm::Gemm;
use crate::ops::forward::{launch_gemv_accum, launch_gemv_fused, GemvFusion};
use crate::ops::gemv::{check_gemv_shape, launch_gemv, GemvConfig};

/// A row-major BF16 matrix [rows, cols] in device memory and the GEMV configuration of its shape.
pub struct DenseBf16 {
    pub rows: usize,
    pub cols: usize,
    pub w: CudaSlice<u16>,
    pub gemv: GemvConfig,
}

/// One weight matrix W [rows (outputs), cols (inputs)] of the GPU forward pass.
pub enum GpuLinear {
    Dense(DenseBf16),
}

/// The GEMV configuration for a shape: the fastest of the measured candidates on the H200 for the
/// Llama-8B launches (bench/RESULTS.md: qkv and down w4r1u8, o and lm_head w4r2u2, gate_up w4r2u4),
/// extended by size to other shapes.
pub fn gemv_config_for(rows: usize, cols: usize) -> GemvConfig {
    let pick = |warps, r, unroll| GemvConfig {
        warps,
        rows: r,
        unroll,
    };
    if cols >= 8192 {
        pick(4, 1, 8) // long rows (down)
    } else if rows >= 65_536 {
        pick(4, 2, 2) // vocabulary-sized (lm_head)
    } else if rows >= 16_384 {
        pick(4, 2, 4) // gate_up
    } else if rows > cols {
        pick(4, 1, 8) // qkv
    } else {
        pick(4, 2, 2) // o and other square-ish shapes
    }
}

impl GpuLinear {
    /// Uploads a row-major BF16 matrix.
    pub fn dense_from_host(
        dev: &GpuDevice,
        rows: usize,
        cols: usize,
        bits: &[u16],
    ) -> Result<Self> {
        check_gemv_shape(rows, cols)?;
        if bits.len() != rows * cols {
            return Err(GpuError::invalid(
                "linear",
                format!(
                    "[{rows}, {cols}] needs {} elements, got {}",
                    rows * cols,
                    bits.len()
                ),
            ));
        }
        let w = dev
            .stream()
            .clone_htod(bits)
            .while_(|| format!("uploading a [{rows}, {cols}] BF16 matrix"))?;
        Ok(Self::dense(w, rows, cols))
    }

    /// Wraps a device buffer holding a row-major BF16 matrix.
    pub fn dense(w: CudaSlice<u16>, rows: usize, cols: usize) -> Self {
        GpuLinear::Dense(DenseBf16 {
            rows,
            cols,
            w,
            gemv: gemv_config_for(rows, cols),
        })
    }

    pub fn rows(&self) -> usize {
        match self {
            GpuLinear::Dense(d) => d.rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            GpuLinear::Dense(d) => d.cols,
        }
    }

    /// Bytes of device memory the matrix occupies (and reads per batch-1 product).
    pub fn stored_bytes(&self) -> usize {
        match self {
            GpuLinear::Dense(d) => d.rows * d.cols * 2,
        }
    }

    /// `y = W x` (or `y += W x` with `accumulate`); x f32 [cols], y f32 [rows].
    pub fn matvec(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        match self {
            GpuLinear::Dense(d) if accumulate => {
                launch_gemv_accum(dev, d.gemv, &d.w, x, y, d.rows, d.cols)
            }
            GpuLinear::Dense(d) => launch_gemv(dev, d.gemv, &d.w, x, y, d.rows, d.cols),
        }
    }

    /// Batch-1 product with the decode step's fusions: `norm` = (weight, eps) normalises x on the
    /// fly (RMSNorm), `accumulate` adds into y (residual), `swiglu` treats the rows as interleaved
    /// (gate, up) pairs and writes silu(gate)·up (rows / 2 outputs).
    pub fn matvec_fused(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        fusion: GemvFusion,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        match self {
            GpuLinear::Dense(d) => {
                let mut cfg = d.gemv;
                if fusion.swiglu && cfg.rows % 2 != 0 {
                    cfg = GemvConfig {
                        warps: 4,
                        rows: 2,
                        unroll: 4,
                    };
                }
                launch_gemv_fused(dev, cfg, fusion, &d.w, x, norm, y, d.rows, d.cols)
            }
        }
    }

    /// `Y = X Wᵀ` (or `Y += X Wᵀ`) for `m` BF16 input rows; Y f32 [m, rows].
    pub fn matmul(
        &self,
        gemm: &Gemm,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        m: usize,
        accumulate: bool,
    ) -> Result<()> {
        match self {
            GpuLinear::Dense(d) => gemm.matmul(&d.w, x, y, m, d.rows, d.cols, accumulate),
        }
    }

    /// The dense BF16 weights, when the matrix is stored that way (embedding lookups).
    pub fn dense_weights(&self) -> Option<&CudaSlice<u16>> {
        match self {
            GpuLinear::Dense(d) => Some(&d.w),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama8b_shapes_get_their_measured_configs() {
        let s = |r, c| gemv_config_for(r, c).to_string();
        assert_eq!(s(6144, 4096), "w4r1u8");
        assert_eq!(s(4096, 4096), "w4r2u2");
        assert_eq!(s(28_672, 4096), "w4r2u4");
        assert_eq!(s(4096, 14_336), "w4r1u8");
        assert_eq!(s(128_256, 4096), "w4r2u2");
    }
}
