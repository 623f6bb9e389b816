//! GGUF quantised blocks (model form `ggml`: a quantised GGUF's matrices as the file stores them)
//! served as they are: batch-1 products by `ggml_mv` (`kernels/ggml.cu`) over the blocks, prefill
//! by dequantising them into the shared BF16 workspace (`ggml_dequant`) for the dense path's
//! GEMM. A launch's parts (q/k/v; gate and up as halves [gate; up]) may be of different types (a
//! Q4_K_M file's q and v): consecutive parts of one type are one device matrix, each multiplied by
//! its type's kernel into its rows of the output. The decode step's fusions are small kernels
//! around the products on the model's shared scratch (`forms::fused_product`).

use super::stacked::Stacked;
use super::{GpuForm, Upload};
use crate::device::GpuDevice;
use crate::error::{GpuError, Result};
use crate::forms::report::LoadReport;
use crate::gemm::Gemm;
use crate::linear::{GpuLinear, GpuMatrix, SharedScratch};
use crate::ops::elementwise::launch_swiglu;
use crate::ops::forward::{Gather, GemvFusion};
use crate::ops::ggml::{
    launch_dequant, launch_dequant_rows, launch_mv, launch_mv_experts, launch_mv_q8, launch_q8x,
    q8_types, types, GpuGgml, Q8Acts,
};
use crate::plan::{GatherLaunch, LaunchForm, LinearDesc, MatvecLaunch};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use entrollm_model::forms::ggml::GgmlLinear;
use entrollm_model::gguf::GgmlType;
use entrollm_model::weights::Linear;
use std::sync::Arc;

/// This form's kernels that call `pdl_wait()` first ([`super::pdl_kernel`]).
pub const PDL_KERNELS: &[&str] = &["ggml_mv_experts"];

/// Matrices held as ggml blocks, served as they are.
pub struct Held;
pub static HELD: Held = Held;

impl GpuForm for Held {
    fn name(&self) -> &'static str {
        "ggml"
    }

    fn upload(
        &self,
        up: &Upload<'_>,
        parts: &[&dyn Linear],
        halves: bool,
        report: &mut LoadReport,
    ) -> Result<Option<GpuLinear>> {
        let mut held = Vec::with_capacity(parts.len());
        for p in parts {
            match p.as_any().downcast_ref::<GgmlLinear>() {
                Some(g) if types().contains(&g.ty()) => held.push(g),
                _ => return Ok(None),
            }
        }
        let cols = held[0].cols();
        if held.iter().any(|g| g.cols() != cols)
            || (halves && (held.len() != 2 || held[0].rows() != held[1].rows()))
        {
            return Ok(None);
        }
        let q8 = held.iter().all(|g| g.q8());
        // Consecutive parts of one type: one device matrix.
        let mut segs: Vec<(GgmlType, usize, Vec<&[u8]>)> = Vec::new();
        for g in held {
            match segs.last_mut() {
                Some((ty, rows, bytes)) if *ty == g.ty() => {
                    *rows += g.rows();
                    bytes.push(g.blocks());
                }
                _ => segs.push((g.ty(), g.rows(), vec![g.blocks()])),
            }
        }
        let segs = segs
            .iter()
            .map(|(ty, rows, bytes)| GpuGgml::upload(up.dev, *ty, *rows, cols, bytes))
            .collect::<Result<Vec<_>>>()?;
        let mut l = GgmlGpuLinear::new(segs, halves, Arc::clone(up.scratch), 1)?;
        if q8 {
            l = l.with_q8(up.dev)?;
        }
        report.took(self.name());
        Ok(Some(GpuLinear::new(l)))
    }

    /// Each of the parts' types (gate, up: halves [gate; up] an expert) as one stack over the
    /// experts, where every expert holds that part in the same type: one gathered launch a type
    /// (a gate and up of two types, two), each into its rows of an expert's output.
    fn upload_experts(
        &self,
        up: &Upload<'_>,
        experts: &[Vec<&dyn Linear>],
        halves: bool,
        report: &mut LoadReport,
    ) -> Result<Option<GpuLinear>> {
        let Some(first) = experts.first() else {
            return Ok(None);
        };
        let mut held: Vec<Vec<&GgmlLinear>> = Vec::with_capacity(experts.len());
        for parts in experts {
            let mut e = Vec::with_capacity(parts.len());
            for p in parts {
                match p.as_any().downcast_ref::<GgmlLinear>() {
                    Some(g) if types().contains(&g.ty()) => e.push(g),
                    _ => return Ok(None),
                }
            }
            held.push(e);
        }
        let same = |a: &GgmlLinear, b: &GgmlLinear| {
            (a.ty(), a.rows(), a.cols()) == (b.ty(), b.rows(), b.cols())
        };
        let cols = held[0][0].cols();
        if held
            .iter()
            .any(|e| e.len() != first.len() || e.iter().zip(&held[0]).any(|(a, b)| !same(a, b)))
            || held[0].iter().any(|g| g.cols() != cols)
            || (halves && (first.len() != 2 || held[0][0].rows() != held[0][1].rows()))
        {
            return Ok(None);
        }
        // Runs of consecutive parts of one type: each one stack, expert after expert.
        let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
        for (i, g) in held[0].iter().enumerate() {
            match runs.last_mut() {
                Some(r) if held[0][r.start].ty() == g.ty() => r.end = i + 1,
                _ => runs.push(i..i + 1),
            }
        }
        let segs = runs
            .iter()
            .map(|r| {
                let rows: usize = held[0][r.clone()].iter().map(|g| g.rows()).sum();
                let bytes: Vec<&[u8]> = held
                    .iter()
                    .flat_map(|e| e[r.clone()].iter().map(|g| g.blocks()))
                    .collect();
                GpuGgml::upload(
                    up.dev,
                    held[0][r.start].ty(),
                    rows * experts.len(),
                    cols,
                    &bytes,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let l = GgmlGpuLinear::new(segs, halves, Arc::clone(up.scratch), experts.len())?;
        report.took(self.name());
        Ok(Some(GpuLinear::new(l)))
    }
}

/// A launch's parts as ggml blocks on the device: row-stacked matrices of one type each.
pub struct GgmlGpuLinear {
    st: Stacked<GpuGgml>,
    /// The activations as 8-bit codes, where the parts multiply them so (`--activations q8`) and
    /// a part's type has a q8 product, with the type whose module quantises them (the first such
    /// part's); the other parts take them as f32.
    q8: Option<(GgmlType, std::sync::Mutex<Q8Acts>)>,
}

super::stacked::part!(GpuGgml);

impl GgmlGpuLinear {
    /// `experts`: the segments are stacks of this many experts, whose products (and prefill's
    /// dequantisation) are an expert's at a time: the scratch needs one expert's shape.
    fn new(
        segs: Vec<GpuGgml>,
        halves: bool,
        scratch: SharedScratch,
        experts: usize,
    ) -> Result<Self> {
        Ok(GgmlGpuLinear {
            st: Stacked::new("ggml linear", segs, halves, scratch, experts)?,
            q8: None,
        })
    }

    /// Products with q8 activations where a part's type has them (`ggml_mv_q8`).
    fn with_q8(mut self, dev: &GpuDevice) -> Result<Self> {
        let ty = self
            .st
            .parts
            .iter()
            .map(|s| s.ty)
            .find(|t| q8_types().contains(t));
        if let Some(ty) = ty {
            let acts = Q8Acts::new(dev, self.st.cols())?;
            self.q8 = Some((ty, std::sync::Mutex::new(acts)));
        }
        Ok(self)
    }

    /// Each part's product into its rows of `y` (q8 activations quantised once for them all).
    fn mv_into(&self, dev: &GpuDevice, x: &CudaSlice<f32>, y: &mut CudaSlice<f32>) -> Result<()> {
        let mut acts = match &self.q8 {
            Some((ty, a)) => {
                let mut a = a.lock().unwrap_or_else(|e| e.into_inner());
                launch_q8x(dev, *ty, x, &mut a)?;
                Some(a)
            }
            None => None,
        };
        self.st.each_at_row(|s, at| match acts.as_deref_mut() {
            Some(a) if q8_types().contains(&s.ty) => launch_mv_q8(dev, s, a, y, at),
            _ => launch_mv(dev, s, x, y, at),
        })
    }
}

impl GpuMatrix for GgmlGpuLinear {
    fn desc(&self) -> LinearDesc {
        LinearDesc::new(
            GgmlLaunch {
                types: self.st.parts.iter().map(|s| (s.ty, s.rows)).collect(),
                halves: self.st.halves,
                q8: self.q8.is_some(),
            },
            self.st.rows(),
            self.st.cols(),
        )
    }

    fn stored_bytes(&self) -> usize {
        self.st.stored_bytes()
    }

    fn device_bytes(&self) -> usize {
        self.st.device_bytes()
    }

    fn matvec_fused(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        fusion: GemvFusion,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.st.fused(
            dev,
            "ggml matvec",
            x,
            norm,
            fusion,
            y,
            |input, out, _err| self.mv_into(dev, input, out),
        )
    }

    fn matmul(
        &self,
        dev: &GpuDevice,
        gemm: &Gemm,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        m: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.st
            .matmul("ggml matmul", gemm, x, y, m, accumulate, |seg, s, at| {
                launch_dequant(dev, seg, &mut s.w, at)
            })
    }

    fn gathered(
        &self,
        dev: &GpuDevice,
        g: Gather<'_>,
        x: &CudaSlice<f32>,
        swiglu: bool,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let rows = super::bf16::expert_rows(self.st.rows(), g.n_experts)?;
        // Each stack's launch into its rows of an expert's output: [gate; up] before SwiGLU.
        let products = |y: &mut CudaSlice<f32>| -> Result<()> {
            let mut at = 0;
            for s in &self.st.parts {
                launch_mv_experts(dev, s, g, x, y, at, rows)?;
                at += s.rows / g.n_experts;
            }
            Ok(())
        };
        if !swiglu {
            return products(y);
        }
        if !self.st.halves || rows % 2 != 0 {
            return Err(GpuError::invalid(
                "ggml experts",
                "SwiGLU needs each expert's gate and up as halves",
            ));
        }
        let mut guard = self.st.lock();
        if guard.y.len() < g.slots * rows {
            return Err(GpuError::invalid(
                "ggml experts",
                format!(
                    "scratch of {} outputs for {} slots of {rows}",
                    guard.y.len(),
                    g.slots
                ),
            ));
        }
        products(&mut guard.y)?;
        launch_swiglu(dev, &guard.y, y, g.slots, rows / 2)
    }

    fn expert_matmul(
        &self,
        dev: &GpuDevice,
        gemm: &Gemm,
        n_experts: usize,
        e: usize,
        x: &CudaView<'_, u16>,
        y: &mut CudaViewMut<'_, f32>,
        m: usize,
    ) -> Result<()> {
        let rows = super::bf16::expert_rows(self.st.rows(), n_experts)?;
        if e >= n_experts {
            return Err(GpuError::invalid(
                "experts",
                format!("expert {e} of {n_experts}"),
            ));
        }
        super::workspace_matmul(
            "ggml experts matmul",
            &self.st.scratch,
            (rows, self.st.cols()),
            gemm,
            x,
            y,
            m,
            false,
            |s| {
                let mut at = 0;
                for seg in &self.st.parts {
                    let r = seg.rows / n_experts;
                    launch_dequant_rows(dev, seg, e * r..(e + 1) * r, &mut s.w, at)?;
                    at += r * seg.cols;
                }
                Ok(())
            },
        )
    }

    fn gate_up_halves(&self) -> bool {
        self.st.halves
    }

    fn duplicate(&self, dev: &GpuDevice) -> Result<GpuLinear> {
        let copy = GgmlGpuLinear {
            st: self.st.duplicate(dev)?,
            q8: None,
        };
        Ok(GpuLinear::new(match self.q8 {
            Some(_) => copy.with_q8(dev)?,
            None => copy,
        }))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A launch of ggml blocks in the decode step: one `ggml_mv` per run of parts of one type (its
/// type and rows), gate/up as `halves`.
#[derive(Debug)]
pub struct GgmlLaunch {
    pub types: Vec<(GgmlType, usize)>,
    pub halves: bool,
    /// Activations as 8-bit codes for the types with a q8 product.
    pub q8: bool,
}

impl LaunchForm for GgmlLaunch {
    fn name(&self) -> &'static str {
        "ggml"
    }
    fn matvec(&self, m: &MatvecLaunch<'_>, push: &mut dyn FnMut(&'static str, String)) {
        // GgmlGpuLinear::matvec_fused: each run's product into its rows, inside the fusions.
        super::fused_product_launches(m, self.halves, push, |x, y, push| {
            if self.q8 {
                push("ggml_q8x", format!("{} {x}->xq", m.label));
            }
            let mut at = 0;
            for &(ty, rows) in &self.types {
                let (op, input) = match self.q8 && q8_types().contains(&ty) {
                    true => ("ggml_mv_q8", "xq"),
                    false => ("ggml_mv", x),
                };
                push(
                    op,
                    format!("{} {ty} rows {at}..{} {input}->{y}", m.label, at + rows),
                );
                at += rows;
            }
        });
    }
    fn gathered(&self, m: &GatherLaunch<'_>, push: &mut dyn FnMut(&'static str, String)) -> bool {
        // GgmlGpuLinear::gathered: a launch a stack into its rows of each slot's output, then
        // SwiGLU over the slots' [gate; up] halves.
        let y = if m.swiglu {
            "ys".into()
        } else {
            m.out.to_string()
        };
        let mut at = 0;
        for &(ty, rows) in &self.types {
            let r = rows / m.experts.max(1);
            push(
                "ggml_mv_experts",
                format!(
                    "{} {ty} rows {at}..{} {}->{y} slots={}",
                    m.label,
                    at + r,
                    m.input,
                    m.slots
                ),
            );
            at += r;
        }
        if m.swiglu {
            push("swiglu", format!("ys->{}", m.out));
        }
        true
    }
}
