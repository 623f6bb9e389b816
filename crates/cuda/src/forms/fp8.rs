//! FP8 E4M3 with per-row scales (model forms `dense:fp8` and `pal-fp8`, inside the row scales an
//! FP8 checkpoint's `weight_scale` wraps them in): batch-1 products by the FP8 GEMV (`gemv_fp8`,
//! codes as stored) or `gemv_pal4` (palette-packed: 4-bit indices into 16 codes plus escapes),
//! prefill through a BF16 copy in the shared workspace. A launch's parts are packed as one matrix
//! (one palette for the stacked rows). Codes held dense are packed at load as
//! [`Policy::fp8`](super::Policy) says.

use super::report::LoadReport;
use super::{GpuForm, Upload};
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::gemm::Gemm;
use crate::linear::{
    fp8_gemv_config, launch_names, pick_launch, swiglu_config, ChainLinear, Fp8Serving, GpuLinear,
    GpuMatrix, SharedScratch, PALETTE_MAX_RATIO,
};
use crate::ops::check_len;
use crate::ops::forward::{check_fusion, check_swiglu_rows, gemv_fused_variant};
use crate::ops::forward::{DenseWeights, GemvFusion};
use crate::ops::gemv::GemvConfig;
use crate::ops::gemv_fp8::{
    bf16_copy_launch, check_gemv_fp8_shape, check_gemv_pal4_shape, pal4_index_bytes, pal4_launch,
    push_norm_y, GpuPal4, PAL4_CANDIDATES,
};
use crate::plan::{ChainedKernels, LaunchForm, LinearDesc, MatvecLaunch};
use cudarc::driver::CudaSlice;
use cudarc::driver::PushKernelArg;
use entrollm_codec::palette::Palette4;
use entrollm_model::forms::palette::PalLinear;
use entrollm_model::weights::{DenseFp8, Linear, RowScaled};
use std::borrow::Cow;
use std::sync::Arc;

/// This form's palette GEMVs, which call `pdl_wait()` first ([`super::pdl_kernel`]). Not the
/// dense FP8 GEMVs ([`PDL_DENSE_KERNELS`]): they measured slower launched early (bench/RESULTS.md).
pub const PDL_KERNELS: &[&str] = &["gemv_pal4", "gemv_pal4_norm"];

/// The dense FP8 GEMVs: they call `pdl_wait()` as the BF16 ones do, but are launched early only
/// with `DecodeOptions::pdl_dense_fp8`.
pub const PDL_DENSE_KERNELS: &[&str] = &[
    "gemv_fp8",
    "gemv_fp8_norm",
    "gemv_fp8_prenorm",
    "gemv_fp8_accum_norm",
];

pub struct Fp8Form;
pub static FP8: Fp8Form = Fp8Form;

/// A part's codes (row-major), its row scales (None: 1) and whether it is held palette-packed.
type Fp8View<'a> = (Cow<'a, [u8]>, Option<&'a [f32]>, bool);

/// The matrix inside `p`'s row scales, and the scales (None: `p` has none).
fn unscaled(p: &dyn Linear) -> (&dyn Linear, Option<&[f32]>) {
    match p.as_any().downcast_ref::<RowScaled>() {
        Some(rs) => {
            let (inner, scales) = rs.parts();
            (&**inner, Some(scales))
        }
        None => (p, None),
    }
}

/// `p`'s palette-packed FP8 codes and row scales, when it is held so.
fn held_palette(p: &dyn Linear) -> Option<(&Palette4, Option<&[f32]>)> {
    let (inner, scales) = unscaled(p);
    let pal = inner.as_any().downcast_ref::<PalLinear>()?.fp8()?;
    Some((pal, scales))
}

/// [`Fp8View`] of `p`; None when it is not FP8.
fn codes_of(p: &dyn Linear) -> Option<Fp8View<'_>> {
    let (inner, scales) = unscaled(p);
    if let Some(d) = inner.as_any().downcast_ref::<DenseFp8>() {
        return Some((d.data().into(), scales, false));
    }
    let (pal, _) = held_palette(p)?;
    Some((pal.decode().into(), scales, true))
}

/// Whether `p` holds FP8 codes (dense or palette-packed, with or without row scales).
pub fn is_fp8(p: &dyn Linear) -> bool {
    unscaled(p).0.as_any().is::<DenseFp8>() || held_palette(p).is_some()
}

/// The palette form `form` keeps an FP8 matrix's row-major `codes` in, or None (as stored): never
/// for `Dense` or columns not a multiple of 32; for `Auto` when the packed form is at most
/// [`PALETTE_MAX_RATIO`] of the codes' bytes.
pub fn fp8_palette(
    codes: &[u8],
    rows: usize,
    cols: usize,
    form: Fp8Serving,
) -> Result<Option<Palette4>> {
    if form == Fp8Serving::Dense || check_gemv_pal4_shape(rows, cols).is_err() {
        return Ok(None);
    }
    let p = Palette4::encode(codes, rows, cols, 0)
        .map_err(|e| GpuError::invalid("fp8 linear", format!("palette packing: {e}")))?;
    let small = p.stored_bytes() as f64 <= PALETTE_MAX_RATIO * codes.len() as f64;
    Ok((form == Fp8Serving::Palette || small).then_some(p))
}

impl GpuForm for Fp8Form {
    fn name(&self) -> &'static str {
        "fp8"
    }

    /// Every part FP8 (row scales, or 1) with the same columns, a multiple of 16.
    fn upload(
        &self,
        up: &Upload<'_>,
        parts: &[&dyn Linear],
        halves: bool,
        report: &mut LoadReport,
    ) -> Result<Option<GpuLinear>> {
        // One part held packed: its packing as it is.
        if let [p] = parts {
            if let Some((pal, scales)) = held_palette(*p) {
                let scales = scales.map_or_else(|| vec![1.0; p.rows()], <[f32]>::to_vec);
                report.took(self.name());
                return GpuLinear::fp8_packed(up.dev, pal, &scales, Arc::clone(up.scratch))
                    .map(Some);
            }
        }
        let cols = parts[0].cols();
        let mut views = Vec::with_capacity(parts.len());
        for p in parts {
            match codes_of(*p) {
                Some((codes, scales, pal)) if p.cols() == cols && cols % 16 == 0 => {
                    let scales = scales.map_or_else(|| vec![1.0; p.rows()], <[f32]>::to_vec);
                    views.push((codes, scales, p.rows(), pal));
                }
                _ => return Ok(None),
            }
        }
        let rows: usize = views.iter().map(|v| v.2).sum();
        let mut codes = Vec::with_capacity(rows * cols);
        let mut scales = Vec::with_capacity(rows);
        match &views[..] {
            [g, u] if halves => {
                if g.2 != u.2 {
                    return Ok(None);
                }
                for r in 0..g.2 {
                    codes.extend_from_slice(&g.0[r * cols..(r + 1) * cols]);
                    codes.extend_from_slice(&u.0[r * cols..(r + 1) * cols]);
                    scales.extend([g.1[r], u.1[r]]);
                }
            }
            _ => {
                for (c, s, _, _) in &views {
                    codes.extend_from_slice(c);
                    scales.extend_from_slice(s);
                }
            }
        }
        // Held palette-packed: packed on the device too, whatever the policy.
        let form = match views.iter().any(|v| v.3) {
            true => Fp8Serving::Palette,
            false => up.policy.fp8,
        };
        report.took(self.name());
        if up.policy.code.is_some() {
            report.dense_notes.push(format!(
                "{}: FP8, served as FP8 (code at load codes BF16)",
                up.what
            ));
        }
        GpuLinear::fp8_from_host(
            up.dev,
            rows,
            cols,
            &codes,
            &scales,
            form,
            Arc::clone(up.scratch),
        )
        .map(Some)
    }
}

/// An FP8 matrix's codes on the device.
pub enum Fp8Codes {
    /// Row-major codes as stored.
    Dense(CudaSlice<u8>),
    /// Palette-packed (see [`GpuPal4`]).
    Palette(GpuPal4),
}

impl Fp8Codes {
    /// A device copy.
    pub fn duplicate(&self, dev: &GpuDevice) -> Result<Self> {
        Ok(match self {
            Fp8Codes::Dense(w) => Fp8Codes::Dense(
                dev.stream()
                    .clone_dtod(w)
                    .while_(|| "copying FP8 codes".into())?,
            ),
            Fp8Codes::Palette(p) => Fp8Codes::Palette(p.duplicate(dev)?),
        })
    }

    /// Bytes the codes occupy (and a batch-1 product reads): device memory, and the palette's 16
    /// codes.
    pub fn stored_bytes(&self) -> usize {
        match self {
            Fp8Codes::Dense(w) => w.len(),
            Fp8Codes::Palette(p) => p.idx.len() + 16 + 4 * (p.esc_ptr.len() + p.escapes),
        }
    }

    /// Checks the codes against a [rows, cols] shape.
    fn check(&self, op: &'static str, rows: usize, cols: usize) -> Result<()> {
        match self {
            Fp8Codes::Dense(w) => {
                check_gemv_fp8_shape(rows, cols)?;
                check_len(op, "w", w, rows * cols)
            }
            Fp8Codes::Palette(p) => {
                check_gemv_pal4_shape(rows, cols)?;
                check_len(op, "indices", &p.idx, pal4_index_bytes(rows, cols))?;
                check_len(op, "escape offsets", &p.esc_ptr, rows + 1)?;
                check_len(op, "escapes", &p.esc, p.escapes.max(1))
            }
        }
    }
}

/// `y = diag(s) · W · rmsnorm(x; g, eps)` (when `norm` is given, else `diag(s) · W x`) with
/// `fusion`'s epilogue; W FP8 E4M3 [n, k] (k % 16 == 0; palette-packed: k % 64 == 0), s f32 [n],
/// x f32 [k], y f32 [n] (n/2 with swiglu).
#[allow(clippy::too_many_arguments)]
pub fn launch_gemv_fp8(
    dev: &GpuDevice,
    cfg: GemvConfig,
    fusion: GemvFusion,
    w: &Fp8Codes,
    scales: &CudaSlice<f32>,
    x: &CudaSlice<f32>,
    norm: Option<(&CudaSlice<f32>, f32)>,
    y: &mut CudaSlice<f32>,
    n: usize,
    k: usize,
) -> Result<()> {
    const OP: &str = "gemv_fp8";
    w.check(OP, n, k)?;
    check_len(OP, "scales", scales, n)?;
    check_len(OP, "x", x, k)?;
    check_len(OP, "y", y, if fusion.swiglu { n / 2 } else { n })?;
    match w {
        Fp8Codes::Dense(_) => check_fusion(OP, cfg, fusion, n)?,
        Fp8Codes::Palette(_) => check_swiglu_rows(OP, fusion, n)?,
    }
    if matches!(w, Fp8Codes::Palette(_)) && (cfg.rows > 15 || cfg.warps % cfg.rows != 0) {
        return Err(GpuError::invalid(
            OP,
            format!("{cfg}: the palette GEMV needs warps a multiple of its groups (rows, ≤ 15)"),
        ));
    }
    let variant = gemv_fused_variant(cfg, fusion);
    let mut launch = cfg.launch(n);
    let (n_i, k_i) = (n as i32, k as i32);
    let kernel = match (w, norm.is_some()) {
        (Fp8Codes::Dense(_), false) => "gemv_fp8",
        (Fp8Codes::Dense(_), true) => "gemv_fp8_norm",
        (Fp8Codes::Palette(_), false) => "gemv_pal4",
        (Fp8Codes::Palette(_), true) => "gemv_pal4_norm",
    };
    let what = || format!("launching {kernel} {cfg} {fusion:?} [{n}, {k}]");
    let f = dev.function(&variant, kernel)?;
    if let Fp8Codes::Palette(_) = w {
        launch = pal4_launch(dev, &f, kernel, cfg, n, k)?;
    }
    let mut b = dev.stream().launch_builder(&f);
    match w {
        Fp8Codes::Dense(w) => b.arg(w),
        Fp8Codes::Palette(p) => b.arg(&p.idx).arg(&p.codes).arg(&p.esc_ptr).arg(&p.esc),
    };
    b.arg(scales).arg(x);
    push_norm_y(OP, &mut b, &norm, y, &n_i, &k_i)?;
    // SAFETY: argument types and counts match the kernel chosen above; sizes were checked.
    unsafe { b.launch(launch) }.while_(what)?;
    Ok(())
}

/// `out = bf16(fp8(W) · s[row])`, W FP8 E4M3 [rows, cols] in either form, s f32 [rows], out BF16
/// bits [rows, cols]: an FP8 matrix materialised for the prefill GEMM.
pub fn launch_fp8_rows_to_bf16(
    dev: &GpuDevice,
    w: &Fp8Codes,
    scales: &CudaSlice<f32>,
    out: &mut CudaSlice<u16>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const OP: &str = "fp8_rows_to_bf16";
    w.check(OP, rows, cols)?;
    check_len(OP, "scales", scales, rows)?;
    let (variant, grid) = bf16_copy_launch(OP, out, rows, cols)?;
    let what = |k: &str| format!("launching {k} [{rows}, {cols}]");
    match w {
        Fp8Codes::Dense(w) => {
            let f = dev.function(&variant, OP)?;
            let (n4, cols4) = ((rows * cols / 4) as i64, (cols / 4) as i32);
            let mut b = dev.stream().launch_builder(&f);
            b.arg(w).arg(scales).arg(&mut *out).arg(&n4).arg(&cols4);
            // SAFETY: argument types and counts match the kernel; sizes were checked above.
            unsafe { b.launch(grid(n4 as usize)) }.while_(|| what(OP))?;
        }
        Fp8Codes::Palette(p) => {
            let f = dev.function(&variant, "pal4_rows_to_bf16")?;
            let words = (pal4_index_bytes(rows, cols) / 4) as i64;
            let (r_i, c_i) = (rows as i32, cols as i32);
            let mut b = dev.stream().launch_builder(&f);
            b.arg(&p.idx)
                .arg(&p.codes)
                .arg(scales)
                .arg(&mut *out)
                .arg(&words)
                .arg(&r_i)
                .arg(&c_i);
            // SAFETY: as above.
            unsafe { b.launch(grid(words as usize)) }.while_(|| what("pal4_rows_to_bf16"))?;
            if p.escapes > 0 {
                let f = dev.function(&variant, "pal4_escapes_to_bf16")?;
                let mut b = dev.stream().launch_builder(&f);
                b.arg(&p.esc_ptr)
                    .arg(&p.esc)
                    .arg(scales)
                    .arg(&mut *out)
                    .arg(&r_i)
                    .arg(&c_i);
                // SAFETY: as above.
                unsafe { b.launch(grid(rows)) }.while_(|| what("pal4_escapes_to_bf16"))?;
            }
        }
    }
    Ok(())
}

/// An FP8 E4M3 matrix with per-row scales (an FP8 checkpoint's weights), its codes as stored or
/// palette-packed: batch-1 products by the FP8 GEMV, prefill through a BF16 copy in the shared
/// workspace and the GEMM.
pub struct Fp8Linear {
    pub rows: usize,
    pub cols: usize,
    pub codes: Fp8Codes,
    pub scales: CudaSlice<f32>,
    pub gemv: GemvConfig,
    /// The configuration with the SwiGLU epilogue (gate/up).
    pub swiglu: GemvConfig,
    scratch: SharedScratch,
}

impl Fp8Linear {
    fn palette(&self) -> bool {
        matches!(self.codes, Fp8Codes::Palette(_))
    }

    /// The launches of the codes' GEMV (every palette one fits: `check_gemv_pal4_shape`).
    fn candidates(&self) -> &'static [GemvConfig] {
        match self.palette() {
            true => &PAL4_CANDIDATES,
            false => &GemvConfig::CANDIDATES,
        }
    }
}

impl GpuLinear {
    /// Uploads an FP8 E4M3 matrix (row-major codes) with its per-row scales, kept as `form` says;
    /// `scratch` must hold its rows, columns and, for prefill, its weights as BF16.
    pub fn fp8_from_host(
        dev: &GpuDevice,
        rows: usize,
        cols: usize,
        codes: &[u8],
        scales: &[f32],
        form: Fp8Serving,
        scratch: SharedScratch,
    ) -> Result<Self> {
        check_gemv_fp8_shape(rows, cols)?;
        if codes.len() != rows * cols || scales.len() != rows {
            return Err(GpuError::invalid(
                "fp8 linear",
                format!(
                    "[{rows}, {cols}] needs {} codes and {rows} scales, got {} and {}",
                    rows * cols,
                    codes.len(),
                    scales.len()
                ),
            ));
        }
        let s = dev.stream();
        let what = || format!("uploading a [{rows}, {cols}] FP8 matrix");
        let packed = fp8_palette(codes, rows, cols, form)?;
        let codes = match packed {
            Some(p) => return Self::fp8_packed(dev, &p, scales, scratch),
            None => Fp8Codes::Dense(s.clone_htod(codes).while_(what)?),
        };
        Self::fp8_codes(dev, rows, cols, codes, scales, scratch)
    }

    /// Uploads palette-packed FP8 codes with their per-row scales (see [`Self::fp8_from_host`]).
    pub fn fp8_packed(
        dev: &GpuDevice,
        p: &Palette4,
        scales: &[f32],
        scratch: SharedScratch,
    ) -> Result<Self> {
        check_gemv_pal4_shape(p.rows(), p.cols())?;
        let codes = Fp8Codes::Palette(GpuPal4::upload(dev, p)?);
        Self::fp8_codes(dev, p.rows(), p.cols(), codes, scales, scratch)
    }

    fn fp8_codes(
        dev: &GpuDevice,
        rows: usize,
        cols: usize,
        codes: Fp8Codes,
        scales: &[f32],
        scratch: SharedScratch,
    ) -> Result<Self> {
        if scales.len() != rows {
            return Err(GpuError::invalid(
                "fp8 linear",
                format!("[{rows}, {cols}] needs {rows} scales, got {}", scales.len()),
            ));
        }
        let s = dev.stream();
        let what = || format!("uploading a [{rows}, {cols}] FP8 matrix's scales");
        let palette = matches!(codes, Fp8Codes::Palette(_));
        let sms = dev.info().sm_count;
        let gemv = fp8_gemv_config(palette, rows, cols, sms, false);
        Ok(GpuLinear::new(Fp8Linear {
            rows,
            cols,
            codes,
            gemv,
            swiglu: fp8_gemv_config(palette, rows, cols, sms, true),
            scales: s.clone_htod(scales).while_(what)?,
            scratch,
        }))
    }
}

impl GpuMatrix for Fp8Linear {
    fn desc(&self) -> LinearDesc {
        LinearDesc::new(
            Fp8Launch {
                palette: self.palette(),
                gemv: self.gemv,
                swiglu: self.swiglu,
            },
            self.rows,
            self.cols,
        )
    }

    fn stored_bytes(&self) -> usize {
        self.codes.stored_bytes() + 4 * self.rows
    }

    fn duplicate(&self, dev: &GpuDevice) -> Result<GpuLinear> {
        Ok(GpuLinear::new(Fp8Linear {
            rows: self.rows,
            cols: self.cols,
            codes: self.codes.duplicate(dev)?,
            scales: dev
                .stream()
                .clone_dtod(&self.scales)
                .while_(|| "copying an FP8 matrix's scales".into())?,
            gemv: self.gemv,
            swiglu: self.swiglu,
            scratch: Arc::clone(&self.scratch),
        }))
    }

    fn matvec_fused(
        &self,
        dev: &GpuDevice,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        fusion: GemvFusion,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (rows, cols) = (self.rows, self.cols);
        let cfg = match fusion.swiglu {
            true => self.swiglu,
            false => self.gemv,
        };
        launch_gemv_fp8(
            dev,
            cfg,
            fusion,
            &self.codes,
            &self.scales,
            x,
            norm,
            y,
            rows,
            cols,
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
        let (rows, cols) = (self.rows, self.cols);
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        launch_fp8_rows_to_bf16(dev, &self.codes, &self.scales, &mut s.w, rows, cols)?;
        gemm.matmul(&s.w, x, y, m, rows, cols, accumulate)
    }

    /// The current launch is the plain product's; with the SwiGLU epilogue (gate/up, as the
    /// tuner times it) the same configuration runs, paired rows where the epilogue needs them.
    fn launch_configs(&self) -> Vec<String> {
        launch_names(self.gemv, self.candidates().iter().copied())
    }

    fn set_launch_config(&mut self, config: &str) -> Result<()> {
        let form = if self.palette() { "pal-fp8" } else { "fp8" };
        let c = pick_launch(form, config, self.candidates())?;
        self.gemv = c;
        self.swiglu = match self.palette() {
            true => c,
            false => swiglu_config(c),
        };
        Ok(())
    }

    /// Codes as stored: the chained-norm FP8 GEMVs take them.
    fn chainable(&self) -> Option<ChainLinear<'_>> {
        match &self.codes {
            Fp8Codes::Dense(codes) => Some(ChainLinear {
                w: DenseWeights::Fp8 {
                    codes,
                    scales: &self.scales,
                },
                gemv: self.gemv,
                rows: self.rows,
                cols: self.cols,
            }),
            Fp8Codes::Palette(_) => None,
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_serving_packs_what_it_says() {
        assert_eq!("auto".parse(), Ok(Fp8Serving::Auto));
        assert_eq!("palette".parse(), Ok(Fp8Serving::Palette));
        assert!("fp4"
            .parse::<Fp8Serving>()
            .unwrap_err()
            .contains("auto, dense or palette"));
        // Few codes: packed under auto and palette; every code: only when asked.
        let few: Vec<u8> = (0..64 * 256)
            .map(|i| [0u8, 0x01, 0x81, 0x02][i % 4])
            .collect();
        let all: Vec<u8> = (0..64 * 256).map(|i| (i * 7 % 256) as u8).collect();
        let packs = |c: &[u8], cols, f| fp8_palette(c, c.len() / cols, cols, f).unwrap().is_some();
        assert!(packs(&few, 256, Fp8Serving::Auto));
        assert!(packs(&few, 256, Fp8Serving::Palette));
        assert!(!packs(&few, 256, Fp8Serving::Dense));
        assert!(!packs(&all, 256, Fp8Serving::Auto));
        assert!(packs(&all, 256, Fp8Serving::Palette));
        // Columns not a multiple of 32 stay as stored, whatever is asked.
        assert!(!packs(&few[..48 * 272], 272, Fp8Serving::Palette));
        assert!(!packs(&few[..48 * 272], 272, Fp8Serving::Auto));
    }
}

/// FP8 E4M3 codes with row scales in the decode step: as stored (`gemv_fp8*`, the chained norms)
/// or palette-packed (`gemv_pal4*`, the norm inside the GEMV, whose blocks stage x in shared
/// memory anyway; the dense FP8 GEMV, whose warps would each re-read x, is slower so:
/// bench/RESULTS.md).
#[derive(Debug)]
pub struct Fp8Launch {
    pub palette: bool,
    pub gemv: GemvConfig,
    /// The configuration of the gate/up GEMV with the SwiGLU epilogue.
    pub swiglu: GemvConfig,
}

/// An FP8 matrix with row scales, codes as stored or `palette`-packed, on a GPU of `sms` SMs
/// ([`GpuLinear::fp8_from_host`]).
pub fn desc(rows: usize, cols: usize, palette: bool, sms: u32) -> LinearDesc {
    LinearDesc::new(
        Fp8Launch {
            palette,
            gemv: fp8_gemv_config(palette, rows, cols, sms, false),
            swiglu: fp8_gemv_config(palette, rows, cols, sms, true),
        },
        rows,
        cols,
    )
}

impl LaunchForm for Fp8Launch {
    fn name(&self) -> &'static str {
        match self.palette {
            true => "fp8-palette",
            false => "fp8",
        }
    }
    fn chained(&self) -> Option<ChainedKernels> {
        (!self.palette).then_some(ChainedKernels {
            prenorm: "gemv_fp8_prenorm",
            accum_norm: "gemv_fp8_accum_norm",
        })
    }
    fn norm_in_gemv(&self) -> bool {
        self.palette
    }
    fn gemv(&self) -> Option<GemvConfig> {
        Some(self.gemv)
    }
    fn matvec(&self, m: &MatvecLaunch<'_>, push: &mut dyn FnMut(&'static str, String)) {
        let cfg = match m.fusion.swiglu {
            true => self.swiglu,
            false => self.gemv,
        };
        let kernel = match (self.palette, m.norm.is_some()) {
            (false, false) => "gemv_fp8",
            (false, true) => "gemv_fp8_norm",
            (true, false) => "gemv_pal4",
            (true, true) => "gemv_pal4_norm",
        };
        push(kernel, m.gemv_line(cfg));
    }
}
