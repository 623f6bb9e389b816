//! Dense BF16 (model form `dense:bf16`): the values as stored, q/k/v stacked and gate/up
//! interleaved; the products are our GEMV (decode) and cuBLASLt (prefill).

use super::{stack, GpuForm, Upload};
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::forms::report::LoadReport;
use crate::gemm::Gemm;
use crate::linear::{
    gemv_config_for, launch_names, pick_launch, swiglu_config, ChainLinear, GpuLinear, GpuMatrix,
};
use crate::ops::forward::{
    launch_gemv_accum, launch_gemv_experts, launch_gemv_fused, DenseWeights, Gather, GemvFusion,
};
use crate::ops::gemv::{check_gemv_shape, launch_gemv, GemvConfig};
use crate::plan::{ChainedKernels, GatherLaunch, LaunchForm, LinearDesc, MatvecLaunch};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use entrollm_model::weights::{Bf16, Dense, Linear};
use rayon::prelude::*;
use std::borrow::Cow;

/// This form's GEMVs that call `pdl_wait()` first ([`super::pdl_kernel`]).
pub const PDL_KERNELS: &[&str] = &[
    "gemv_bf16",
    "gemv_bf16_norm",
    "gemv_bf16_rope",
    "gemv_bf16_prenorm",
    "gemv_bf16_accum_norm",
    "gemv_bf16_experts",
];

pub struct Bf16Form;
pub static BF16: Bf16Form = Bf16Form;

impl GpuForm for Bf16Form {
    fn name(&self) -> &'static str {
        "bf16"
    }

    fn upload(
        &self,
        up: &Upload<'_>,
        parts: &[&dyn Linear],
        halves: bool,
        _report: &mut LoadReport,
    ) -> Result<Option<GpuLinear>> {
        fn held(p: &dyn Linear) -> Option<Cow<'_, [u16]>> {
            let d = p.as_any().downcast_ref::<Dense<Bf16>>()?;
            Some(d.data().into())
        }
        let Some((rows, cols, bits)) = stack(parts, halves, held) else {
            return Ok(None);
        };
        GpuLinear::dense_from_host(up.dev, rows, cols, &bits).map(Some)
    }
}

/// A mixture of experts' stack as dense BF16 (each expert's parts row-stacked, gate/up
/// interleaved with `halves` as the SwiGLU epilogue reads them; values rounded to BF16 where they
/// are not), with the GEMV configuration of one expert's shape.
pub fn experts_rounded(
    dev: &GpuDevice,
    experts: &[Vec<&dyn Linear>],
    halves: bool,
) -> Result<GpuLinear> {
    let bad = || GpuError::invalid("experts upload", "the experts' matrices differ in shape");
    let mut bits = Vec::new();
    let mut shape = None;
    for parts in experts {
        let (rows, cols, b) =
            stack(parts, halves, |p| Some(host_bf16(p).into())).ok_or_else(bad)?;
        if *shape.get_or_insert((rows, cols)) != (rows, cols) {
            return Err(bad());
        }
        bits.extend_from_slice(&b);
    }
    let (rows, cols) = shape.ok_or_else(bad)?;
    let l = DenseBf16 {
        rows: rows * experts.len(),
        cols,
        w: dev
            .stream()
            .clone_htod(&bits)
            .while_(|| format!("uploading {} experts of [{rows}, {cols}]", experts.len()))?,
        gemv: gemv_config_for(rows, cols),
    };
    check_gemv_shape(l.rows, cols)?;
    Ok(GpuLinear::new(l))
}

/// A row-major BF16 matrix [rows, cols] in device memory and the GEMV configuration of its shape.
pub struct DenseBf16 {
    pub rows: usize,
    pub cols: usize,
    pub w: CudaSlice<u16>,
    pub gemv: GemvConfig,
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
        GpuLinear::new(DenseBf16 {
            rows,
            cols,
            w,
            gemv: gemv_config_for(rows, cols),
        })
    }
}

impl GpuMatrix for DenseBf16 {
    fn desc(&self) -> LinearDesc {
        LinearDesc::new(Bf16Launch { gemv: self.gemv }, self.rows, self.cols)
    }

    fn stored_bytes(&self) -> usize {
        self.rows * self.cols * 2
    }

    fn matvec(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        let (gemv, rows, cols) = (self.gemv, self.rows, self.cols);
        match accumulate {
            true => launch_gemv_accum(dev, gemv, &self.w, x, y, rows, cols),
            false => launch_gemv(dev, gemv, &self.w, x, y, rows, cols),
        }
    }

    fn matvec_fused(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        fusion: GemvFusion,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let cfg = match fusion.swiglu {
            true => swiglu_config(self.gemv),
            false => self.gemv,
        };
        launch_gemv_fused(dev, cfg, fusion, &self.w, x, norm, y, self.rows, self.cols)
    }

    fn matmul(
        &self,
        _dev: &GpuDevice,
        gemm: &Gemm,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        m: usize,
        accumulate: bool,
    ) -> Result<()> {
        gemm.matmul(&self.w, x, y, m, self.rows, self.cols, accumulate)
    }

    fn gathered(
        &self,
        dev: &GpuDevice,
        g: Gather<'_>,
        x: &CudaSlice<f32>,
        swiglu: bool,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let rows = expert_rows(self.rows, g.n_experts)?;
        let cfg = match swiglu {
            true => swiglu_config(self.gemv),
            false => self.gemv,
        };
        launch_gemv_experts(dev, cfg, swiglu, &self.w, g, x, y, rows, self.cols)
    }

    fn expert_matmul(
        &self,
        _dev: &GpuDevice,
        gemm: &Gemm,
        n_experts: usize,
        e: usize,
        x: &CudaView<'_, u16>,
        y: &mut CudaViewMut<'_, f32>,
        m: usize,
    ) -> Result<()> {
        let rows = expert_rows(self.rows, n_experts)?;
        let size = rows * self.cols;
        if e >= n_experts {
            return Err(GpuError::invalid(
                "experts",
                format!("expert {e} of {n_experts}"),
            ));
        }
        let w = self.w.slice(e * size..(e + 1) * size);
        gemm.matmul(&w, x, y, m, rows, self.cols, false)
    }

    fn as_dense(&self) -> Option<&DenseBf16> {
        Some(self)
    }

    fn chainable(&self) -> Option<ChainLinear<'_>> {
        Some(ChainLinear {
            w: DenseWeights::Bf16(&self.w),
            gemv: self.gemv,
            rows: self.rows,
            cols: self.cols,
        })
    }

    fn duplicate(&self, dev: &GpuDevice) -> Result<GpuLinear> {
        let w = dev
            .stream()
            .clone_dtod(&self.w)
            .while_(|| format!("copying a [{}, {}] BF16 matrix", self.rows, self.cols))?;
        Ok(GpuLinear::new(DenseBf16 { w, ..*self }))
    }

    fn launch_configs(&self) -> Vec<String> {
        launch_names(self.gemv, GemvConfig::CANDIDATES)
    }

    fn set_launch_config(&mut self, config: &str) -> Result<()> {
        self.gemv = pick_launch("bf16", config, &GemvConfig::CANDIDATES)?;
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Dense BF16 in the decode step (`gemv_bf16*`): RoPE in the q/k/v GEMV's epilogue, the chained
/// norms.
#[derive(Debug)]
pub struct Bf16Launch {
    pub gemv: GemvConfig,
}

/// A dense BF16 matrix with the GEMV configuration of its shape ([`GpuLinear::dense`]).
pub fn desc(rows: usize, cols: usize) -> LinearDesc {
    LinearDesc::new(
        Bf16Launch {
            gemv: gemv_config_for(rows, cols),
        },
        rows,
        cols,
    )
}

/// Rows of one expert of a stack of `rows` over `n_experts`.
pub(crate) fn expert_rows(rows: usize, n_experts: usize) -> Result<usize> {
    if n_experts == 0 || rows % n_experts != 0 {
        return Err(GpuError::invalid(
            "experts",
            format!("{rows} rows are not a stack of {n_experts} experts"),
        ));
    }
    Ok(rows / n_experts)
}

impl LaunchForm for Bf16Launch {
    fn name(&self) -> &'static str {
        "bf16"
    }
    fn dense_bf16(&self) -> bool {
        true
    }
    fn chained(&self) -> Option<ChainedKernels> {
        Some(ChainedKernels {
            prenorm: "gemv_bf16_prenorm",
            accum_norm: "gemv_bf16_accum_norm",
        })
    }
    fn gemv(&self) -> Option<GemvConfig> {
        Some(self.gemv)
    }
    fn matvec(&self, m: &MatvecLaunch<'_>, push: &mut dyn FnMut(&'static str, String)) {
        let cfg = match m.fusion.swiglu {
            true => swiglu_config(self.gemv),
            false => self.gemv,
        };
        let kernel = match m.norm {
            Some(_) => "gemv_bf16_norm",
            None => "gemv_bf16",
        };
        push(kernel, m.gemv_line(cfg));
    }
    fn gathered(&self, m: &GatherLaunch<'_>, push: &mut dyn FnMut(&'static str, String)) -> bool {
        let cfg = match m.swiglu {
            true => swiglu_config(self.gemv),
            false => self.gemv,
        };
        push("gemv_bf16_experts", m.line(&format!("{cfg}")));
        true
    }
}

/// A matrix's rows as BF16 bits (lossless for BF16 matrices; other formats are rounded).
pub fn host_bf16(m: &dyn Linear) -> Vec<u16> {
    let cols = m.cols();
    let mut out = vec![0u16; m.rows() * cols];
    out.par_chunks_mut(cols).enumerate().for_each_init(
        || vec![0f32; cols],
        |buf, (r, row)| {
            m.row(r, buf);
            for (o, &v) in row.iter_mut().zip(buf.iter()) {
                *o = half::bf16::from_f32(v).to_bits();
            }
        },
    );
    out
}
