//! Integer codes with group scales (model form `int`: GGUF legacy codes, GPTQ, AWQ,
//! compressed-tensors pack-quantized) served as their codes: batch-1 products by `int_mv`
//! (`kernels/int.cu`), prefill by dequantising them into the shared BF16 workspace
//! (`int_dequant`) for the dense path's GEMM. A launch's consecutive parts of one code width,
//! group and dequantisation are one device matrix; parts that differ are segments, each
//! multiplied into its rows of the output. A part whose columns are stored in another order
//! (GPTQ's activation order) is a segment of its own, its input gathered into that order first. Matrices the kernels do not take (groups not a power
//! of two, columns not a multiple of 4) are left to the next form. The decode step's fusions are
//! small kernels around the products on the model's shared scratch (`forms::fused_product`).

use super::stacked::Stacked;
use super::{GpuForm, Upload};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::forms::report::LoadReport;
use crate::gemm::Gemm;
use crate::linear::{GpuLinear, GpuMatrix, SharedScratch};
use crate::ops::forward::GemvFusion;
use crate::ops::int::{launch_dequant, launch_mv, GpuInt, IntPacked};
use crate::plan::{LaunchForm, LinearDesc, MatvecLaunch};
use cudarc::driver::CudaSlice;
use entrollm_model::forms::int::IntLinear;
use entrollm_model::forms::GroupScales;
use entrollm_model::hf_quant::ColumnOrdered;
use entrollm_model::weights::Linear;
use std::sync::Arc;

/// Matrices held as integer codes, served as they are.
pub struct Held;
pub static HELD: Held = Held;

/// An `int` matrix, and the original column of each stored column where they differ (GPTQ's
/// activation order).
fn int_parts(l: &dyn Linear) -> Option<(&IntLinear, Option<&[u32]>)> {
    if let Some(m) = l.as_any().downcast_ref::<IntLinear>() {
        return Some((m, None));
    }
    let c = l.as_any().downcast_ref::<ColumnOrdered>()?;
    let m = c.inner().as_any().downcast_ref::<IntLinear>()?;
    Some((m, Some(c.perm())))
}

/// Whether two parts' codes dequantise alike (one device matrix can hold both).
fn alike(a: &IntLinear, b: &IntLinear) -> bool {
    let (ga, gb) = (a.groups(), b.groups());
    a.bits() == b.bits()
        && ga.group == gb.group
        && ga.offset == gb.offset
        && ga.signed == gb.signed
        && ga.mins.is_some() == gb.mins.is_some()
}

/// Parts of one kind row-stacked into one host matrix for the kernels (None: not taken).
fn stacked(parts: &[&IntLinear]) -> Option<IntPacked> {
    let first = parts[0];
    let cols = first.cols();
    let rows = parts.iter().map(|p| p.rows()).sum();
    let mut codes = Vec::with_capacity(rows * cols);
    let g0 = first.groups();
    let mut groups = GroupScales {
        group: g0.group,
        scales: Vec::new(),
        mins: g0.mins.as_ref().map(|_| Vec::new()),
        offset: g0.offset,
        signed: g0.signed,
    };
    for p in parts {
        codes.extend(p.codes());
        groups.scales.extend_from_slice(&p.groups().scales);
        if let (Some(all), Some(m)) = (groups.mins.as_mut(), p.groups().mins.as_ref()) {
            all.extend_from_slice(m);
        }
    }
    IntPacked::new(first.bits(), rows, cols, &codes, &groups).ok()
}

impl GpuForm for Held {
    fn name(&self) -> &'static str {
        "int"
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
            match int_parts(*p) {
                Some(m) => held.push(m),
                None => return Ok(None),
            }
        }
        let cols = held[0].0.cols();
        if held.iter().any(|(m, _)| m.cols() != cols)
            || (halves && (held.len() != 2 || held[0].0.rows() != held[1].0.rows()))
        {
            return Ok(None);
        }
        // Runs of parts in stored column order that dequantise alike; a part with its own column
        // order is a run of its own.
        let mut runs: Vec<(Vec<&IntLinear>, Option<&[u32]>)> = Vec::new();
        for (m, perm) in held {
            match runs.last_mut() {
                Some((run, None)) if perm.is_none() && alike(run[0], m) => run.push(m),
                _ => runs.push((vec![m], perm)),
            }
        }
        let Some(packed) = runs
            .iter()
            .map(|(r, perm)| stacked(r).map(|p| (p, *perm)))
            .collect::<Option<Vec<_>>>()
        else {
            return Ok(None);
        };
        let segs = packed
            .iter()
            .map(|(p, perm)| GpuInt::upload(up.dev, p, *perm))
            .collect::<Result<Vec<_>>>()?;
        let l = IntGpuLinear::new(segs, halves, Arc::clone(up.scratch))?;
        report.took(self.name());
        Ok(Some(GpuLinear::new(l)))
    }
}

/// A launch's parts as integer codes on the device: row-stacked matrices of one kind each.
pub struct IntGpuLinear {
    st: Stacked<GpuInt>,
}

super::stacked::part!(GpuInt);

impl IntGpuLinear {
    pub fn new(segs: Vec<GpuInt>, halves: bool, scratch: SharedScratch) -> Result<Self> {
        Ok(IntGpuLinear {
            st: Stacked::new("int linear", segs, halves, scratch, 1)?,
        })
    }
}

impl GpuMatrix for IntGpuLinear {
    fn desc(&self) -> LinearDesc {
        LinearDesc::new(
            IntLaunch {
                segments: self
                    .st
                    .parts
                    .iter()
                    .map(|s| (s.bits, s.rows, s.gathers()))
                    .collect(),
                halves: self.st.halves,
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
        self.st
            .fused(dev, "int matvec", x, norm, fusion, y, |input, out, _err| {
                self.st
                    .each_at_row(|s, at| launch_mv(dev, s, input, out, at))
            })
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
            .matmul("int matmul", gemm, x, y, m, accumulate, |seg, s, at| {
                launch_dequant(dev, seg, &mut s.w, at)
            })
    }

    fn gate_up_halves(&self) -> bool {
        self.st.halves
    }

    fn duplicate(&self, dev: &GpuDevice) -> Result<GpuLinear> {
        Ok(GpuLinear::new(IntGpuLinear {
            st: self.st.duplicate(dev)?,
        }))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A launch of integer codes in the decode step: one `int_mv` per segment (its code width, rows,
/// and whether its input is gathered into its column order first), gate/up as `halves`.
#[derive(Debug)]
pub struct IntLaunch {
    pub segments: Vec<(u8, usize, bool)>,
    pub halves: bool,
}

impl LaunchForm for IntLaunch {
    fn name(&self) -> &'static str {
        "int"
    }
    fn matvec(&self, m: &MatvecLaunch<'_>, push: &mut dyn FnMut(&'static str, String)) {
        // IntGpuLinear::matvec_fused: each segment's product into its rows, inside the fusions.
        super::fused_product_launches(m, self.halves, push, |x, y, push| {
            let mut at = 0;
            for &(bits, rows, gathers) in &self.segments {
                if gathers {
                    push("int_gather", format!("{} {x}->xg", m.label));
                }
                push(
                    "int_mv",
                    format!("{} int{bits} rows {at}..{} {x}->{y}", m.label, at + rows),
                );
                at += rows;
            }
        });
    }
}
