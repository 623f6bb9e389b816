//! dtANS-LLM coded matrices (model form `dtans`): batch-1 products by the fused decode-matvec
//! (`kernels/dtans_mvm.cu`), prefill by dequantising into the shared workspace and the GEMM. A
//! launch's coded parts that share payload, coding and columns run as one multi-matrix launch.
//! [`HELD`] serves matrices a container holds coded; [`AT_LOAD`] codes BF16 matrices at load
//! ([`Policy::code`](super::Policy)), on the device or the host.

use super::{GpuForm, Upload};
use crate::coded::{check_supported as check_coding, GpuDtans};
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::forms::report::{Encoder, LoadReport};
use crate::gemm::Gemm;
use crate::linear::{
    dtans_config_for, launch_names, pick_launch, DtansScratch, GpuLinear, GpuMatrix, SharedScratch,
};
use crate::ops::dtans::{
    launch_dequant, launch_dequant_at, launch_mvm, launch_mvm_stacked, DtansConfig, DtansKind,
    DtansOut, MAX_SHARED_BYTES,
};
use crate::ops::forward::GemvFusion;
use crate::plan::{LaunchForm, LinearDesc, MatvecLaunch, MEMSET};
use cudarc::driver::CudaSlice;
use entrollm_codec::dtans::{choose_coding_and_width, Coding, DtansTensor, EncodePlan};
use entrollm_codec::matvec::Dequant;
use entrollm_codec::Payload;
use entrollm_model::forms::dtans::CodedLinear;
use entrollm_model::weights::Linear;
use rayon::prelude::*;
use std::sync::Arc;

const OP: &str = "code at load";

/// Matrices held coded, served as they are.
pub struct Held;
pub static HELD: Held = Held;

/// BF16 matrices coded at load.
pub struct AtLoad;
pub static AT_LOAD: AtLoad = AtLoad;

impl GpuForm for Held {
    fn name(&self) -> &'static str {
        "dtans"
    }

    fn upload(
        &self,
        up: &Upload<'_>,
        parts: &[&dyn Linear],
        halves: bool,
        report: &mut LoadReport,
    ) -> Result<Option<GpuLinear>> {
        let l = held(up.dev, parts, halves, up.scratch)?;
        if l.is_some() {
            report.took(self.name());
        }
        Ok(l)
    }
}

impl GpuForm for AtLoad {
    fn name(&self) -> &'static str {
        "dtans (coded at load)"
    }

    fn upload(
        &self,
        up: &Upload<'_>,
        parts: &[&dyn Linear],
        halves: bool,
        report: &mut LoadReport,
    ) -> Result<Option<GpuLinear>> {
        let Some((coding, encoder)) = up.policy.code else {
            return Ok(None);
        };
        let l = code_at_load(up, parts, halves, coding, encoder, report)?;
        match &l {
            Some(_) => report.took(self.name()),
            None => report.dense_notes.push(format!(
                "{}: not BF16, served dense (BF16-rounded)",
                up.what
            )),
        }
        Ok(l)
    }
}

/// A coded matrix made of `parts` (row-stacked; `halves`: gate/up), or None when any part is not
/// held coded or the parts cannot share a launch.
fn held(
    dev: &GpuDevice,
    parts: &[&dyn Linear],
    halves: bool,
    scratch: &SharedScratch,
) -> Result<Option<GpuLinear>> {
    let mut coded = Vec::with_capacity(parts.len());
    for p in parts {
        match p.as_any().downcast_ref::<CodedLinear>() {
            Some(c) => coded.push(c.coded()),
            None => return Ok(None),
        }
    }
    let (t0, _) = coded[0];
    if coded.iter().any(|(t, _)| {
        t.payload != t0.payload
            || t.coding != t0.coding
            || t.cols != t0.cols
            || check_coding(t.payload, &t.coding).is_err()
    }) {
        return Ok(None);
    }
    let mut up = Vec::with_capacity(coded.len());
    for (t, dq) in &coded {
        match GpuDtans::upload(dev, t, dq) {
            Ok(g) => up.push(g),
            // A payload, coding or group layout the kernels do not take.
            Err(GpuError::InvalidArgument { .. }) => return Ok(None),
            Err(e) => return Err(e),
        }
    }
    match GpuLinear::coded_parts(up, halves, Arc::clone(scratch)) {
        Ok(l) => Ok(Some(l)),
        // Parts whose groups differ, or a coding without a launch that fits.
        Err(GpuError::InvalidArgument { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Checks that the GPU kernels run `coding` on a [rows × cols] BF16 matrix (decode-matvec and
/// prefill dequantisation); the error names `what` and the coding.
pub fn check_kernels(what: &str, coding: &Coding, rows: usize, cols: usize) -> Result<()> {
    use crate::linear::dtans_config_for;
    use crate::ops::dtans::DtansOut;
    let bad = |e: GpuError| {
        GpuError::invalid(
            "code at load",
            format!("{what}: coding {coding} has no GPU kernel for {rows}×{cols} BF16: {e}"),
        )
    };
    check_coding(Payload::Bf16, coding).map_err(bad)?;
    for out in [DtansOut::Mvm, DtansOut::Dequant] {
        dtans_config_for(Payload::Bf16, coding, rows, cols, None, out).map_err(bad)?;
    }
    Ok(())
}

/// The BF16 bits of `parts` row-stacked (`halves`: gate and up rows interleaved, as the engine
/// serves them), or None when some value is not a BF16 number (an F16, F32 or quantised matrix:
/// coding its BF16 rounding would not be lossless).
pub(crate) fn exact_bf16(parts: &[&dyn Linear], halves: bool) -> Option<Vec<u16>> {
    let cols = parts.first()?.cols();
    if parts.iter().any(|p| p.cols() != cols)
        || (halves && (parts.len() != 2 || parts[0].rows() != parts[1].rows()))
    {
        return None;
    }
    // (part, row) of each output row.
    let src: Vec<(usize, usize)> = if halves {
        (0..parts[0].rows())
            .flat_map(|r| [(0, r), (1, r)])
            .collect()
    } else {
        parts
            .iter()
            .enumerate()
            .flat_map(|(i, p)| (0..p.rows()).map(move |r| (i, r)))
            .collect()
    };
    let mut out = vec![0u16; src.len() * cols];
    out.par_chunks_mut(cols)
        .zip(src.par_iter())
        .try_for_each_init(
            || vec![0f32; cols],
            |buf, (row, &(i, r))| {
                parts[i].row(r, buf);
                for (o, &v) in row.iter_mut().zip(buf.iter()) {
                    let b = v.to_bits();
                    if b & 0xFFFF != 0 {
                        return Err(());
                    }
                    *o = (b >> 16) as u16;
                }
                Ok(())
            },
        )
        .ok()?;
    Some(out)
}

/// Codes one launch's matrix at load: the host plans from the BF16 bits it already holds, the
/// matrix goes up and is coded on the device (the coded arrays never come down), or with
/// [`Encoder::Cpu`] it is coded on the host and its arrays uploaded as a container's are. None
/// when the matrix is not BF16.
fn code_at_load(
    up: &Upload<'_>,
    parts: &[&dyn Linear],
    halves: bool,
    coding: Option<Coding>,
    encoder: Encoder,
    r: &mut LoadReport,
) -> Result<Option<GpuLinear>> {
    let (dev, what, scratch) = (up.dev, up.what, up.scratch);
    use std::time::Instant;
    let codec = |e: entrollm_codec::CodecError| GpuError::invalid(OP, format!("{what}: {e}"));
    let t0 = Instant::now();
    let Some(bits) = exact_bf16(parts, halves) else {
        return Ok(None);
    };
    let cols = parts[0].cols();
    let rows = bits.len() / cols;
    let codes = crate::ops::dtans_encode::bf16_codes(&bits);
    let coding = match coding {
        Some(c) => c,
        None => {
            let c = choose_coding_and_width(Payload::Bf16, rows, cols, &codes)
                .map_err(codec)?
                .0;
            check_kernels(&format!("{what} (the coder's choice)"), &c, rows, cols)?;
            c
        }
    };
    let plan = EncodePlan::new(Payload::Bf16, rows, cols, &codes, coding).map_err(codec)?;
    r.plan_s += t0.elapsed().as_secs_f64();
    let g = match encoder {
        Encoder::Gpu => {
            drop(codes);
            let t1 = Instant::now();
            let w = dev
                .stream()
                .clone_htod(&bits)
                .while_(|| format!("uploading {what} ({rows}×{cols}) to code"))?;
            drop(bits);
            dev.synchronize()?;
            r.upload_s += t1.elapsed().as_secs_f64();
            let t2 = Instant::now();
            let (g, _) = crate::ops::dtans_encode::encode_bf16_device(dev, &w, &plan)?;
            drop(w);
            r.encode_s += t2.elapsed().as_secs_f64();
            g
        }
        Encoder::Cpu => {
            let t2 = Instant::now();
            let raw: Vec<u8> = bits
                .par_iter()
                .map(|&b| Payload::Bf16.split16(b).1)
                .collect();
            let t = DtansTensor::encode_planned(&plan, &codes, &raw).map_err(codec)?;
            let g = GpuDtans::upload(dev, &t, &Dequant::None)?;
            dev.synchronize()?;
            r.encode_s += t2.elapsed().as_secs_f64();
            g
        }
    };
    Ok(Some(GpuLinear::coded(g, Arc::clone(scratch))?))
}

/// A dtANS-LLM coded matrix (one tensor, or row-stacked parts that share a coding: q/k/v, gate and
/// up of a container, run as one multi-matrix launch) and its launch configurations. Batch 1 runs
/// the fused decode-matvec; the decode step's fusions are small kernels around it on buffers of the
/// model's shared [`DtansScratch`] (RMSNorm into a scratch input, the product into a scratch output,
/// then residual add or SwiGLU into the caller's buffer), so the step still captures into one CUDA
/// graph with no allocation. Prefill dequantises the matrix into the scratch's BF16 workspace and
/// runs the dense path's GEMM.
pub struct DtansLinear {
    /// The row blocks of the matrix, in order (one for a tensor coded whole).
    pub parts: Vec<GpuDtans>,
    /// (gate, up) stored as halves [gate; up] instead of interleaved rows (SwiGLU epilogue and
    /// prefill read them so).
    pub halves: bool,
    /// Launch of the batch-1 decode-matvec.
    pub mvm: DtansConfig,
    /// Launch of the dequantisation (prefill).
    pub dequant: DtansConfig,
    scratch: SharedScratch,
}

impl GpuLinear {
    /// Wraps an uploaded coded matrix with launch configurations for its shape and coding; the
    /// products use `scratch` (which must hold its rows, columns and, for prefill, its weights).
    pub fn coded(t: GpuDtans, scratch: SharedScratch) -> Result<Self> {
        Self::coded_parts(vec![t], false, scratch)
    }

    /// A matrix of row-stacked coded parts (q/k/v; gate and up with `halves`) that share payload,
    /// coding, columns and groups, so that one launch serves them all.
    pub fn coded_parts(parts: Vec<GpuDtans>, halves: bool, scratch: SharedScratch) -> Result<Self> {
        let t = parts
            .first()
            .ok_or_else(|| GpuError::invalid("dtans linear", "no parts"))?;
        let group = t.groups().map(|g| g.group);
        let (p, c, k) = (t.payload, t.coding, t.cols);
        let r: usize = parts.iter().map(|t| t.rows).sum();
        for u in &parts[1..] {
            if u.payload != p
                || u.coding != c
                || u.cols != k
                || u.groups().map(|g| g.group) != group
            {
                return Err(GpuError::invalid(
                    "dtans linear",
                    format!(
                        "stacked parts must share payload, coding, columns and groups: {p:?} {c} \
                         ×{k} vs {:?} {} ×{}",
                        u.payload, u.coding, u.cols
                    ),
                ));
            }
        }
        if parts.len() > crate::ops::dtans::MAX_MATS || (halves && parts.len() != 2) {
            return Err(GpuError::invalid(
                "dtans linear",
                format!("{} stacked parts (halves: {halves})", parts.len()),
            ));
        }
        let mvm = dtans_config_for(p, &c, r, k, group, DtansOut::Mvm)?;
        let dequant = dtans_config_for(p, &c, r, k, group, DtansOut::Dequant)?;
        {
            let s = scratch.lock().unwrap_or_else(|e| e.into_inner());
            if s.y.len() < r || s.xn.len() < k {
                return Err(GpuError::invalid(
                    "dtans linear",
                    format!(
                        "scratch of {} outputs / {} inputs is too small for {r}×{k}",
                        s.y.len(),
                        s.xn.len()
                    ),
                ));
            }
        }
        Ok(GpuLinear::new(DtansLinear {
            parts,
            halves,
            mvm,
            dequant,
            scratch,
        }))
    }
}

impl DtansLinear {
    /// The decode-matvec launches of this matrix's coding ([`launch_candidates`]).
    fn candidates(&self) -> Vec<DtansConfig> {
        let t = &self.parts[0];
        let kind = DtansKind::of(t.payload, &t.coding, t.cols, t.groups().map(|g| g.group));
        grouped_launch_candidates(&kind, self.mvm, t.groups().is_some())
    }

    pub fn rows(&self) -> usize {
        self.parts.iter().map(|t| t.rows).sum()
    }

    pub fn cols(&self) -> usize {
        self.parts[0].cols
    }

    /// Other coded parts of the same shapes and coding with these launches and scratch.
    pub fn with_parts(&self, parts: Vec<GpuDtans>) -> DtansLinear {
        DtansLinear {
            parts,
            halves: self.halves,
            mvm: self.mvm,
            dequant: self.dequant,
            scratch: Arc::clone(&self.scratch),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, DtansScratch> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mvm_into(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        err: &mut CudaSlice<u32>,
    ) -> Result<()> {
        if let [t] = &self.parts[..] {
            launch_mvm(dev, self.mvm, &[t], x, &mut [y], Some(err))
        } else {
            let mats: Vec<&GpuDtans> = self.parts.iter().collect();
            launch_mvm_stacked(dev, self.mvm, &mats, x, y, Some(err))
        }
    }

    /// The batch-1 product with the engine's fusions (see [`GpuMatrix::matvec_fused`]).
    fn fused(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        fusion: GemvFusion,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let shape = (self.rows(), self.cols());
        let mut guard = self.lock();
        super::fused_product(
            dev,
            "dtans matvec",
            &mut guard,
            shape,
            self.halves,
            x,
            norm,
            fusion,
            y,
            |input, out, err| self.mvm_into(dev, input, out, err),
        )
    }
}

impl GpuMatrix for DtansLinear {
    fn entropy_coded(&self) -> bool {
        true
    }
    fn desc(&self) -> LinearDesc {
        LinearDesc::new(
            DtansLaunch {
                payload: self.parts[0].payload,
                coding: self.parts[0].coding,
                mvm: self.mvm,
                parts: self.parts.len(),
                halves: self.halves,
            },
            self.rows(),
            self.cols(),
        )
    }

    fn stored_bytes(&self) -> usize {
        self.parts.iter().map(|t| t.stored_bytes).sum()
    }

    fn device_bytes(&self) -> usize {
        self.parts.iter().map(|t| t.device_bytes()).sum()
    }

    fn matvec_fused(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        fusion: GemvFusion,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.fused(dev, x, norm, fusion, y)
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
        let mut s = self.lock();
        let s = &mut *s;
        let (rows, cols) = (self.rows(), self.cols());
        if s.w.len() < rows * cols {
            return Err(GpuError::invalid(
                "dtans matmul",
                format!(
                    "the dequantisation workspace holds {} weights, a {rows}×{cols} matrix \
                     needs {}",
                    s.w.len(),
                    rows * cols
                ),
            ));
        }
        if let [t] = &self.parts[..] {
            launch_dequant(dev, self.dequant, t, &mut s.w, Some(&mut s.err))?;
        } else {
            let mut off = 0;
            for t in &self.parts {
                launch_dequant_at(dev, self.dequant, t, &mut s.w, off, Some(&mut s.err))?;
                off += t.rows * t.cols;
            }
        }
        gemm.matmul(&s.w, x, y, m, rows, cols, accumulate)
    }

    fn gate_up_halves(&self) -> bool {
        self.halves
    }

    fn launch_configs(&self) -> Vec<String> {
        launch_names(self.mvm, self.candidates())
    }

    fn set_launch_config(&mut self, config: &str) -> Result<()> {
        self.mvm = pick_launch("dtans", config, &self.candidates())?;
        Ok(())
    }

    fn duplicate(&self, dev: &GpuDevice) -> Result<GpuLinear> {
        let parts = self
            .parts
            .iter()
            .map(|t| t.duplicate(dev))
            .collect::<Result<Vec<_>>>()?;
        Ok(GpuLinear::new(self.with_parts(parts)))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// [`launch_candidates`] of a matrix with group scales (`groups`) or without: those whose unroll
/// applies them.
pub fn grouped_launch_candidates(
    kind: &DtansKind,
    current: DtansConfig,
    groups: bool,
) -> Vec<DtansConfig> {
    launch_candidates(kind, current)
        .into_iter()
        .filter(|c| c.fits_groups(groups))
        .collect()
}

/// The decode-matvec launches the tuner tries for a coding's kernel `kind`, `current` first: 8,
/// 16 or 32 warps (one 32-row band each) per block with the default or 16-byte table entries and
/// the fast addressing, each at the widest unroll that fits without spilling; 16 warps with two
/// blocks resident per SM (registers capped); and the tuned table's launches of the same kernel.
/// Each compiles for the kind as the selftest's do (JIT, cached).
pub fn launch_candidates(kind: &DtansKind, current: DtansConfig) -> Vec<DtansConfig> {
    let fits =
        |c: &DtansConfig| c.fits(kind) && kind.shared_bytes(*c, DtansOut::Mvm) <= MAX_SHARED_BYTES;
    // Under a 64-register cap (1024 threads a block, or two 512-thread blocks an SM) 16-byte
    // entries spill at an unroll of 8 or 4 (tools/nvrtc-check): such launches unroll by 2.
    let widest = |c: DtansConfig| {
        let capped = c.warps.max(c.min_warps) >= 32 && c.entry_bytes(kind) == 16;
        let unrolls: &[u32] = if capped { &[2] } else { &[0, 4, 2] };
        unrolls
            .iter()
            .map(|&unroll| DtansConfig { unroll, ..c })
            .find(fits)
    };
    let fast = |w| DtansConfig {
        fast: true,
        entry: 16,
        ..DtansConfig::warps(w)
    };
    let shapes = [8, 16, 32]
        .into_iter()
        .flat_map(|w| [DtansConfig::warps(w), fast(w)])
        .chain([DtansConfig {
            min_warps: 32,
            ..DtansConfig::warps(16)
        }]);
    let tuned = crate::tuned::tuned_launches()
        .into_iter()
        .filter(|l| DtansKind::of(Payload::Bf16, &l.3, l.2, None) == *kind)
        .map(|l| l.4);
    let mut v = vec![current];
    for c in shapes.filter_map(widest).chain(tuned.filter(fits)) {
        if !v.contains(&c) {
            v.push(c);
        }
    }
    v
}

/// A dtANS-coded matrix in the decode step (`dtans_kernel`): row-stacked `parts` sharing payload
/// and coding, gate/up as `halves` [gate; up] or interleaved rows.
#[derive(Debug)]
pub struct DtansLaunch {
    pub payload: Payload,
    pub coding: Coding,
    pub mvm: DtansConfig,
    pub parts: usize,
    pub halves: bool,
}

/// A dtANS-coded matrix of `parts` row-stacked tensors (no dequantisation groups) with the launch
/// [`GpuLinear::coded_parts`] gives it.
pub fn desc(
    payload: Payload,
    coding: Coding,
    rows: usize,
    cols: usize,
    parts: usize,
    halves: bool,
) -> Result<LinearDesc> {
    let mvm = dtans_config_for(payload, &coding, rows, cols, None, DtansOut::Mvm)?;
    Ok(LinearDesc::new(
        DtansLaunch {
            payload,
            coding,
            mvm,
            parts,
            halves,
        },
        rows,
        cols,
    ))
}

impl LaunchForm for DtansLaunch {
    fn name(&self) -> &'static str {
        "dtans"
    }
    fn matvec(&self, m: &MatvecLaunch<'_>, push: &mut dyn FnMut(&'static str, String)) {
        // DtansLinear::matvec_fused: the product inside the fusions; more than one slice adds its
        // slices' sums into zeroed outputs.
        let slices = m.cols.div_ceil(self.coding.sc.max(1) as usize);
        super::fused_product_launches(m, self.halves, push, |x, y, push| {
            if slices > 1 {
                push(MEMSET, format!("{y}[{}]", m.rows));
            }
            let payload = format!("{:?}", self.payload).to_lowercase();
            push(
                "dtans_kernel",
                format!(
                    "{} {payload} {} {} parts={}{} {x}->{y}",
                    m.label,
                    self.coding,
                    self.mvm,
                    self.parts,
                    if self.halves { " halves" } else { "" }
                ),
            );
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::{launch_names, pick_launch};

    /// Integer codes with group scales (GPTQ's int4 in groups of 128, a tuner's Pair coding of
    /// them): every candidate launches, the current one first.
    #[test]
    fn grouped_candidates_apply_their_groups() {
        use entrollm_codec::dtans::{Coding, Mode};
        for (bits, mode, log2_m, sc, t, group) in [
            (4, Mode::Pair, 12, 2048, Some(16), 128),
            (4, Mode::Single, 8, 256, None, 32),
            (2, Mode::Quad, 10, 1024, None, 4096),
        ] {
            let coding = Coding {
                mode,
                log2_m,
                sc,
                t,
            };
            let (p, cols) = (Payload::Int(bits), 4096);
            let kind = DtansKind::of(p, &coding, cols, Some(group));
            let current =
                dtans_config_for(p, &coding, 4096, cols, Some(group), DtansOut::Mvm).unwrap();
            let v = grouped_launch_candidates(&kind, current, true);
            assert_eq!(v[0], current, "{coding}");
            assert!(v.len() > 1, "{coding}: {v:?}");
            for c in &v {
                assert!(c.fits(&kind) && c.fits_groups(true), "{coding}: {c}");
            }
        }
    }

    #[test]
    fn launch_candidates_fit_their_kernel_and_start_with_the_current() {
        for (name, rows, cols, coding, _, _) in crate::tuned::tuned_launches() {
            let kind = DtansKind::of(Payload::Bf16, &coding, cols, None);
            let current =
                dtans_config_for(Payload::Bf16, &coding, rows, cols, None, DtansOut::Mvm).unwrap();
            let v = launch_candidates(&kind, current);
            assert_eq!(v[0], current, "{name}");
            assert!(v.len() >= 5, "{name} {coding}: {v:?}");
            for (i, c) in v.iter().enumerate() {
                assert!(c.fits(&kind), "{name} {coding}: {c}");
                assert!(kind.shared_bytes(*c, DtansOut::Mvm) <= MAX_SHARED_BYTES);
                assert!(!v[..i].contains(c), "{name}: {c} twice");
            }
            for w in [8, 16, 32] {
                assert!(
                    v.iter().any(|c| c.warps == w),
                    "{name} {coding}: no {w} warps"
                );
            }
            assert!(v.iter().any(|c| c.min_warps > 0), "{name}: no register cap");
            // Names pick back their configuration; another name is an error naming them.
            let names = launch_names(current, v.iter().copied());
            assert_eq!(names.len(), v.len());
            for (n, c) in names.iter().zip(&v) {
                assert_eq!(pick_launch("dtans", n, &v).unwrap(), *c);
            }
            let e = pick_launch("dtans", "w3", &v).unwrap_err().to_string();
            assert!(e.contains("w3") && e.contains(&names[0]), "{e}");
        }
    }
}
