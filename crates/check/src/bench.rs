//! Cold-cache GEMV timing (`entrollm_cuda::timing`, the protocol of DESIGN.md "How we measure")
//! of the dense and palette GEMVs; cuBLAS (`cublasGemmEx`, BF16 in/out, f32 compute) is timed the
//! same way as the peer.

use std::sync::Arc;

use cudarc::cublas::{sys as cublas_sys, CudaBlas};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use crate::selftest::{rel_l2, Rng};
use entrollm_codec::rng::GAMMA;
use entrollm_cuda::device::GpuDevice;
use entrollm_cuda::error::{DriverContext, GpuError, Result};
use entrollm_cuda::mem::upload;
use entrollm_cuda::ops::gemv::{check_gemv_shape, gemv_ref, launch_gemv, GemvConfig};
use entrollm_cuda::timing::{copies_for, time_cold};

/// Llama-3.1-8B batch-1 launch shapes (name, n, k).
pub const LLAMA8B_GEMV_SHAPES: [(&str, usize, usize); 5] = [
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28_672, 4096),
    ("down", 4096, 14_336),
    ("lm_head", 128_256, 4096),
];

/// The same launches of Llama-3.3-70B (hidden 8192, 8 KV heads, FFN 28672).
pub const LLAMA70B_GEMV_SHAPES: [(&str, usize, usize); 5] = [
    ("qkv", 10_240, 8192),
    ("o", 8192, 8192),
    ("gate_up", 57_344, 8192),
    ("down", 8192, 28_672),
    ("lm_head", 128_256, 8192),
];

/// What was timed and how.
#[derive(Clone, Debug)]
pub struct GemvTiming {
    /// "entrollm w4r2u4" or "cublas".
    pub kernel: String,
    pub n: usize,
    pub k: usize,
    pub copies: usize,
    pub launches_per_burst: usize,
    pub median_us: f64,
    /// Weight bytes read per second at the median.
    pub weight_tb_per_s: f64,
}

/// Random BF16 weights for timing, made fast (a GB for lm_head): random sign and mantissa,
/// exponents spanning 2^-8..2^-1, no zeros.
fn random_weight_bits(len: usize, seed: u64) -> Vec<u16> {
    use rayon::prelude::*;
    let mut out = vec![0u16; len];
    out.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut rng = Rng::new(seed ^ (i as u64).wrapping_mul(GAMMA));
            for quad in chunk.chunks_mut(4) {
                let r = rng.next_u64();
                for (j, v) in quad.iter_mut().enumerate() {
                    let b = (r >> (16 * j)) as u16;
                    *v = (b & 0x807F) | (0x3B80 + ((b >> 4) & 0x0380));
                }
            }
        });
    out
}

/// One GEMV shape set up for cold-cache timing: weight copies covering > 2× L2 and inputs.
pub struct GemvBench<'a> {
    dev: &'a GpuDevice,
    n: usize,
    k: usize,
    seed: u64,
    weights: Vec<CudaSlice<u16>>,
    x_f32: CudaSlice<f32>,
    x_bf16: CudaSlice<u16>,
    y_f32: CudaSlice<f32>,
    y_bf16: CudaSlice<u16>,
}

impl<'a> GemvBench<'a> {
    pub fn new(dev: &'a GpuDevice, n: usize, k: usize, seed: u64) -> Result<Self> {
        check_gemv_shape(n, k)?;
        let copies = copies_for(n * k * 2, dev.info().l2_bytes);
        let first = upload(dev, &random_weight_bits(n * k, seed))?;
        let mut weights = vec![first];
        for _ in 1..copies {
            let mut c = dev
                .stream()
                .alloc_zeros::<u16>(n * k)
                .while_(|| "allocating a weight copy".into())?;
            dev.stream()
                .memcpy_dtod(&weights[0], &mut c)
                .while_(|| "copying weights".into())?;
            weights.push(c);
        }
        let mut rng = Rng::new(seed.wrapping_add(1));
        let x = rng.normals(k, 1.0);
        let x_bits: Vec<u16> = x
            .iter()
            .map(|&v| entrollm_cuda::ops::f32_to_bf16(v))
            .collect();
        Ok(GemvBench {
            dev,
            n,
            k,
            seed,
            x_f32: upload(dev, &x)?,
            x_bf16: upload(dev, &x_bits)?,
            y_f32: dev
                .stream()
                .alloc_zeros(n)
                .while_(|| "allocating y".into())?,
            y_bf16: dev
                .stream()
                .alloc_zeros(n)
                .while_(|| "allocating y".into())?,
            weights,
        })
    }

    fn timing(&self, kernel: String, (us, launches): (f64, usize)) -> GemvTiming {
        let bytes = self.n * self.k * 2;
        GemvTiming {
            kernel,
            n: self.n,
            k: self.k,
            copies: self.weights.len(),
            launches_per_burst: launches,
            median_us: us,
            weight_tb_per_s: bytes as f64 / (us * 1e-6) / 1e12,
        }
    }

    /// Our GEMV with `cfg`.
    pub fn time_ours(&mut self, cfg: GemvConfig) -> Result<GemvTiming> {
        let (dev, n, k) = (self.dev, self.n, self.k);
        let (ws, x, y) = (&self.weights, &self.x_f32, &mut self.y_f32);
        let t = time_cold(dev, ws.len(), n * k * 2, |c| {
            launch_gemv(dev, cfg, &ws[c], x, y, n, k)
        })?;
        Ok(self.timing(format!("entrollm {cfg}"), t))
    }

    /// The same weights palette-packed losslessly (`gemv_pal4_bf16`, the configuration
    /// `pal_bf16_config_for` gives): checked against the CPU reference of the dense weights, then
    /// timed cold (its own copies over twice the L2). Returns the timing (bandwidth: dense-BF16
    /// bytes, as the dense rows) and the error.
    pub fn time_pal_bf16(&mut self) -> Result<(GemvTiming, f64)> {
        use entrollm_cuda::ops::forward::GemvFusion;
        use entrollm_cuda::ops::gemv_fp8::{launch_gemv_pal_bf16, pal_bf16_config_for, GpuPalBf16};
        let (dev, n, k) = (self.dev, self.n, self.k);
        let bits = random_weight_bits(n * k, self.seed);
        let p = entrollm_codec::palette::PaletteBf16::encode(&bits, n, k)
            .map_err(|e| GpuError::invalid("palette bench", e.to_string()))?;
        let copies = copies_for(p.stored_bytes(), dev.info().l2_bytes);
        let ws = (0..copies)
            .map(|_| GpuPalBf16::upload(dev, &p))
            .collect::<Result<Vec<_>>>()?;
        let cfg = pal_bf16_config_for(n, dev.info().sm_count);
        let (x, y) = (&self.x_f32, &mut self.y_f32);
        launch_gemv_pal_bf16(dev, cfg, GemvFusion::default(), &ws[0], x, None, y)?;
        let s = dev.stream();
        let got = s.clone_dtoh(&*y).while_(|| "downloading y".into())?;
        let xh = s.clone_dtoh(x).while_(|| "downloading x".into())?;
        let rel = rel_l2(&got, &gemv_ref(&bits, &xh, n, k));
        let t = time_cold(dev, copies, p.stored_bytes(), |c| {
            launch_gemv_pal_bf16(dev, cfg, GemvFusion::default(), &ws[c], x, None, y)
        })?;
        let mut timing = self.timing(
            format!("palette bf16 {cfg} ({:.2} b/w)", p.bits_per_weight()),
            t,
        );
        timing.copies = copies;
        Ok((timing, rel))
    }

    /// Relative L2 error of our GEMV with `cfg` on the timed weights against the CPU reference
    /// (the timing loop itself does not look at its outputs).
    pub fn check_ours(&mut self, cfg: GemvConfig) -> Result<f64> {
        let (n, k) = (self.n, self.k);
        launch_gemv(
            self.dev,
            cfg,
            &self.weights[0],
            &self.x_f32,
            &mut self.y_f32,
            n,
            k,
        )?;
        let got = self
            .dev
            .stream()
            .clone_dtoh(&self.y_f32)
            .while_(|| "downloading y".into())?;
        let x = self
            .dev
            .stream()
            .clone_dtoh(&self.x_f32)
            .while_(|| "downloading x".into())?;
        let want = gemv_ref(&random_weight_bits(n * k, self.seed), &x, n, k);
        Ok(rel_l2(&got, &want))
    }

    /// cuBLAS BF16 GEMV (`cublasGemmEx`, m = n, n = 1, BF16 x and y, f32 compute): the peer.
    pub fn time_cublas(&mut self) -> Result<GemvTiming> {
        // SAFETY: only tries to dlopen libcublas.
        if !unsafe { cublas_sys::is_culib_present() } {
            return Err(GpuError::Cublas {
                context: "loading libcublas".into(),
                status: "libcublas.so not found on the library path".into(),
            });
        }
        let dev = self.dev;
        let blas = CudaBlas::new(Arc::clone(dev.stream())).map_err(|e| GpuError::Cublas {
            context: "creating a handle".into(),
            status: format!("{e:?}"),
        })?;
        let (n, k) = (self.n, self.k);
        let (ws, x, y) = (&self.weights, &self.x_bf16, &mut self.y_bf16);
        let (alpha, beta) = (1.0f32, 0.0f32);
        let stream = dev.stream();
        let t = time_cold(dev, ws.len(), n * k * 2, |c| {
            let (w_ptr, _w) = ws[c].device_ptr(stream);
            let (x_ptr, _x) = x.device_ptr(stream);
            let (y_ptr, _y) = y.device_ptr_mut(stream);
            // Row-major W [n, k] is column-major [k, n]: y = op_T(W) x with lda = k.
            // SAFETY: pointers are live device buffers of the sizes passed.
            let status = unsafe {
                cublas_sys::cublasGemmEx(
                    *blas.handle(),
                    cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                    cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                    n as i32,
                    1,
                    k as i32,
                    (&alpha as *const f32).cast(),
                    w_ptr as *const _,
                    cublas_sys::cudaDataType::CUDA_R_16BF,
                    k as i32,
                    x_ptr as *const _,
                    cublas_sys::cudaDataType::CUDA_R_16BF,
                    k as i32,
                    (&beta as *const f32).cast(),
                    y_ptr as *mut _,
                    cublas_sys::cudaDataType::CUDA_R_16BF,
                    n as i32,
                    cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            };
            if status != cublas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(GpuError::Cublas {
                    context: format!("cublasGemmEx [{n}, {k}]"),
                    status: format!("{status:?}"),
                });
            }
            Ok(())
        })?;
        Ok(self.timing("cublas".into(), t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_weights_are_finite_nonzero_and_varied() {
        let w = random_weight_bits(100_003, 5);
        assert!(w.iter().all(|&b| {
            let v = entrollm_cuda::ops::bf16_to_f32(b);
            v.is_finite() && v != 0.0 && v.abs() <= 1.0
        }));
        let distinct: std::collections::HashSet<_> = w.iter().collect();
        assert!(distinct.len() > 1000);
        assert!(w.iter().any(|&b| b & 0x8000 != 0) && w.iter().any(|&b| b & 0x8000 == 0));
    }
}
