//! GPU selftest: every kernel on fresh random inputs over many shapes (ragged ones included),
//! compared with its CPU reference by relative L2 error, ‖gpu − ref‖ / ‖ref‖.
//!
//! Outputs are poisoned with NaN before each launch, so an element the kernel fails to write makes
//! the error NaN, which never passes. Tolerances: exact (0) for gathers, casts and argmax;
//! 1e-5 for f32 arithmetic (RMSNorm, SwiGLU, RoPE, GEMV: f32 accumulation against an f64
//! reference over the same BF16 inputs); 1e-4 for attention (exp2f and the split-softmax merge).

use std::fmt;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaSlice;
use entrollm_codec::palette::{Palette4, PaletteBf16};
use entrollm_codec::rng::SplitMix64;

use entrollm_cuda::device::GpuDevice;
use entrollm_cuda::error::{DriverContext, GpuError, Result};
use entrollm_cuda::forms::fp8::{launch_fp8_rows_to_bf16, launch_gemv_fp8, Fp8Codes};
use entrollm_cuda::mem::{download, upload};
use entrollm_cuda::ops::argmax::{argmax_ref, launch_argmax, ArgmaxScratch};
use entrollm_cuda::ops::attention::{
    attention_ref, launch_attention_decode, launch_kv_append, AttnConfig, AttnScratch, KvShape,
};
use entrollm_cuda::ops::elementwise::*;
use entrollm_cuda::ops::f32_to_bf16;
use entrollm_cuda::ops::forward::{rmsnorm_f32w_ref, swiglu_interleaved_ref, GemvFusion};
use entrollm_cuda::ops::gemv::{gemv_ref, launch_gemv, GemvConfig};
use entrollm_cuda::ops::gemv_fp8::{
    fp8_rows_to_bf16_ref, gemv_fp8_ref, launch_gemv_pal_bf16, launch_pal_bf16_rows_to_bf16,
    pal_bf16_config_for, GpuPal4, GpuPalBf16, PAL_BF16_CANDIDATES,
};
use entrollm_cuda::ops::rope::{launch_rope, rope_ref, RopeLayout, RopeShape};

/// The codec's SplitMix64 stream, with the GPU tests' inputs (f32 normals, BF16, FP8 codes).
#[derive(Clone, Debug)]
pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(SplitMix64::new(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        self.0.unit()
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }
    /// Standard normal.
    pub fn normal(&mut self) -> f32 {
        self.0.normal() as f32
    }
    pub fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }
    pub fn bf16s(&mut self, n: usize, scale: f32) -> Vec<u16> {
        (0..n).map(|_| f32_to_bf16(self.normal() * scale)).collect()
    }
    /// Uniformly random FP8 E4M3 codes: every value of the format (subnormals, ±0, ±448), the
    /// two NaN codes (0x7F, 0xFF) replaced by ±448.
    pub fn fp8s(&mut self, n: usize) -> Vec<u8> {
        let mut v: Vec<u8> = (0..n.div_ceil(8))
            .flat_map(|_| self.next_u64().to_le_bytes())
            .take(n)
            .collect();
        for b in &mut v {
            if *b & 0x7F == 0x7F {
                *b -= 1;
            }
        }
        v
    }

    /// FP8 codes as a low-entropy checkpoint's (values near zero: 0, ±1..±7 subnormals and a few
    /// small normals) with `escape_pct` % drawn from all codes (palette escapes), NaNs excluded.
    pub fn fp8s_low_entropy(&mut self, n: usize, escape_pct: u64) -> Vec<u8> {
        (0..n)
            .map(|_| {
                let u = self.next_u64();
                let c = if u % 100 < escape_pct {
                    (u >> 8) as u8
                } else {
                    // Geometric over 0..=9: small magnitudes most likely.
                    ((u >> 16) as u32 | 1 << 31).trailing_zeros().min(9) as u8
                };
                let c = c ^ if (u >> 40) & 1 == 1 { 0x80 } else { 0 };
                if c & 0x7F == 0x7F {
                    c - 1
                } else {
                    c
                }
            })
            .collect()
    }
}

/// Which FP8 GEMV a check or timing runs: on the codes as stored, or palette-packed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvForm {
    Dense,
    Palette,
}

impl GemvForm {
    pub const ALL: [GemvForm; 2] = [GemvForm::Dense, GemvForm::Palette];

    /// The kernel of this form's GEMV.
    pub fn name(self) -> &'static str {
        match self {
            GemvForm::Dense => "gemv_fp8",
            GemvForm::Palette => "gemv_pal4",
        }
    }

    /// Relative L2 error allowed against the f32 reference: the dense GEMV sums exact products in
    /// f32; the palette GEMV's x enters the tensor cores as two BF16 halves, exact to 2^-18 of
    /// each |x|, which a short or cancelling sum can magnify past 1e-5 (measured: 1.7e-5 on one
    /// output of 64 terms; 2.5e-6 on the Llama shapes).
    pub fn tolerance(self) -> f64 {
        match self {
            GemvForm::Dense => 1e-5,
            GemvForm::Palette => 5e-5,
        }
    }

    /// The launch configurations of this form's GEMV (sweeps, selftests).
    pub fn configs(self) -> &'static [GemvConfig] {
        match self {
            GemvForm::Dense => &GemvConfig::CANDIDATES,
            GemvForm::Palette => &entrollm_cuda::ops::gemv_fp8::PAL4_CANDIDATES,
        }
    }

    /// The launch configuration the engine gives an [n, k] matrix in this form on a GPU of `sms`
    /// SMs, with or without the SwiGLU epilogue.
    pub fn engine_config(self, n: usize, k: usize, sms: u32, swiglu: bool) -> GemvConfig {
        entrollm_cuda::linear::fp8_gemv_config(self == GemvForm::Palette, n, k, sms, swiglu)
    }
}

/// One kernel on one shape.
#[derive(Clone, Debug)]
pub struct CaseResult {
    pub kernel: String,
    pub shape: String,
    pub rel_l2: f64,
    pub tolerance: f64,
}

impl CaseResult {
    pub fn passed(&self) -> bool {
        self.rel_l2 <= self.tolerance // NaN compares false
    }
}

#[derive(Clone, Debug)]
pub struct SelftestReport {
    pub device: String,
    pub cases: Vec<CaseResult>,
}

impl SelftestReport {
    pub fn failures(&self) -> impl Iterator<Item = &CaseResult> {
        self.cases.iter().filter(|c| !c.passed())
    }
}

impl fmt::Display for SelftestReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "GPU selftest on {}: {} cases",
            self.device,
            self.cases.len()
        )?;
        for c in &self.cases {
            writeln!(
                f,
                "  {:<5} {:<22} {:<44} rel_l2 {:.3e} (tol {:.0e})",
                if c.passed() { "ok" } else { "FAIL" },
                c.kernel,
                c.shape,
                c.rel_l2,
                c.tolerance
            )?;
        }
        let failed = self.failures().count();
        write!(f, "{} passed, {} failed", self.cases.len() - failed, failed)
    }
}

/// ‖got − want‖ / ‖want‖ in f64 (absolute norm when the reference is all zeros); NaN or length
/// mismatch in `got` gives infinity.
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        if w.is_nan() {
            if !g.is_nan() {
                return f64::INFINITY;
            }
            continue;
        }
        let d = g as f64 - w as f64;
        num += d * d;
        den += w as f64 * w as f64;
    }
    if num.is_nan() {
        return f64::INFINITY;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

fn poisoned(dev: &GpuDevice, n: usize) -> Result<CudaSlice<f32>> {
    upload(dev, &vec![f32::NAN; n.max(1)])
}

struct Checker<'a> {
    dev: &'a GpuDevice,
    rng: Rng,
    cases: Vec<CaseResult>,
}

impl Checker<'_> {
    fn record(&mut self, kernel: &str, shape: String, got: &[f32], want: &[f32], tolerance: f64) {
        self.cases.push(CaseResult {
            kernel: kernel.to_string(),
            shape,
            rel_l2: rel_l2(got, want),
            tolerance,
        });
    }

    fn embedding(&mut self, vocab: usize, dim: usize, n_tokens: usize) -> Result<()> {
        let table = self.rng.bf16s(vocab * dim, 1.0);
        let tokens: Vec<i32> = (0..n_tokens)
            .map(|_| self.rng.below(vocab as u64) as i32)
            .collect();
        let (t_d, k_d) = (upload(self.dev, &table)?, upload(self.dev, &tokens)?);
        let mut out = poisoned(self.dev, n_tokens * dim)?;
        launch_embedding(self.dev, &t_d, &k_d, &mut out, n_tokens, vocab, dim)?;
        let got = download(self.dev, &out)?;
        let want = embedding_ref(&table, &tokens, dim);
        self.record(
            "embedding",
            format!("vocab {vocab} dim {dim} tokens {n_tokens}"),
            &got[..want.len()],
            &want,
            0.0,
        );
        Ok(())
    }

    fn rmsnorm(&mut self, rows: usize, dim: usize) -> Result<()> {
        let x = self.rng.normals(rows * dim, 3.0);
        let w = self.rng.bf16s(dim, 1.0);
        let (x_d, w_d) = (upload(self.dev, &x)?, upload(self.dev, &w)?);
        let mut out = poisoned(self.dev, rows * dim)?;
        launch_rmsnorm(self.dev, &x_d, &w_d, &mut out, rows, dim, 1e-5)?;
        let got = download(self.dev, &out)?;
        let want = rmsnorm_ref(&x, &w, dim, 1e-5);
        self.record(
            "rmsnorm",
            format!("rows {rows} dim {dim}"),
            &got[..want.len()],
            &want,
            1e-5,
        );
        Ok(())
    }

    fn swiglu(&mut self, n_tokens: usize, inter: usize) -> Result<()> {
        let gu = self.rng.normals(2 * n_tokens * inter, 4.0);
        let gu_d = upload(self.dev, &gu)?;
        let mut out = poisoned(self.dev, n_tokens * inter)?;
        launch_swiglu(self.dev, &gu_d, &mut out, n_tokens, inter)?;
        let got = download(self.dev, &out)?;
        let want = swiglu_ref(&gu, inter);
        self.record(
            "swiglu",
            format!("tokens {n_tokens} inter {inter}"),
            &got[..want.len()],
            &want,
            1e-5,
        );
        Ok(())
    }

    fn residual(&mut self, n: usize) -> Result<()> {
        let (x, y) = (self.rng.normals(n, 1.0), self.rng.normals(n, 1.0));
        let (mut x_d, y_d) = (upload(self.dev, &x)?, upload(self.dev, &y)?);
        launch_residual_add(self.dev, &mut x_d, &y_d, n)?;
        let got = download(self.dev, &x_d)?;
        self.record(
            "residual_add",
            format!("n {n}"),
            &got,
            &residual_add_ref(&x, &y),
            0.0,
        );
        Ok(())
    }

    fn rope(&mut self, s: RopeShape) -> Result<()> {
        let hd = s.head_dim;
        let q = self.rng.normals(s.n_tokens * s.n_q_heads * hd, 1.0);
        let k = self.rng.normals(s.n_tokens * s.n_kv_heads * hd, 1.0);
        let positions: Vec<i32> = (0..s.n_tokens)
            .map(|_| self.rng.below(131_072) as i32)
            .collect();
        // θ^(−2i/d) with θ = 5e5, each frequency perturbed: the kernel must use every entry as given.
        let inv_freq: Vec<f64> = (0..hd / 2)
            .map(|i| 500_000f64.powf(-(2.0 * i as f64) / hd as f64) * (0.5 + self.rng.unit()))
            .collect();
        let (mut q_d, mut k_d) = (upload(self.dev, &q)?, upload(self.dev, &k)?);
        let (p_d, f_d) = (upload(self.dev, &positions)?, upload(self.dev, &inv_freq)?);
        launch_rope(self.dev, &mut q_d, &mut k_d, &p_d, &f_d, s)?;
        let mut got = download(self.dev, &q_d)?;
        got.extend(download(self.dev, &k_d)?);
        let (mut qr, mut kr) = (q, k);
        rope_ref(&mut qr, &positions, &inv_freq, hd, s.layout);
        rope_ref(&mut kr, &positions, &inv_freq, hd, s.layout);
        qr.extend(kr);
        let shape = format!(
            "{:?} t{} q{} kv{} hd{}",
            s.layout, s.n_tokens, s.n_q_heads, s.n_kv_heads, hd
        );
        self.record("rope", shape, &got, &qr, 1e-5);
        Ok(())
    }

    fn argmax(&mut self, n: usize, scratch: &mut ArgmaxScratch, nans: bool) -> Result<()> {
        let mut x = self.rng.normals(n, 5.0);
        if nans {
            for _ in 0..n.div_ceil(10) {
                x[self.rng.below(n as u64) as usize] = f32::NAN;
            }
            // A tie at the maximum: the first index must win.
            let m = x
                .iter()
                .cloned()
                .filter(|v| !v.is_nan())
                .fold(f32::MIN, f32::max)
                + 1.0;
            let (a, b) = (
                self.rng.below(n as u64) as usize,
                self.rng.below(n as u64) as usize,
            );
            x[a] = m;
            x[b] = m;
        }
        let x_d = upload(self.dev, &x)?;
        let mut out = upload(self.dev, &[i32::MIN])?;
        launch_argmax(self.dev, &x_d, n, scratch, &mut out)?;
        let got = download(self.dev, &out)?[0];
        let want = argmax_ref(&x);
        let err = if got == want { 0.0 } else { f64::INFINITY };
        self.cases.push(CaseResult {
            kernel: "argmax".into(),
            shape: format!(
                "n {n}{} (gpu {got}, cpu {want})",
                if nans { " nan+tie" } else { "" }
            ),
            rel_l2: err,
            tolerance: 0.0,
        });
        Ok(())
    }

    fn gemv(&mut self, cfg: GemvConfig, n: usize, k: usize) -> Result<()> {
        let w = self.rng.bf16s(n * k, 0.02);
        let x = self.rng.normals(k, 1.0);
        let (w_d, x_d) = (upload(self.dev, &w)?, upload(self.dev, &x)?);
        let mut y = poisoned(self.dev, n)?;
        launch_gemv(self.dev, cfg, &w_d, &x_d, &mut y, n, k)?;
        let got = download(self.dev, &y)?;
        let want = gemv_ref(&w, &x, n, k);
        self.record("gemv", format!("{cfg} [{n}, {k}]"), &got[..n], &want, 1e-5);
        Ok(())
    }

    /// FP8 codes of an [n, k] matrix for `form` (palette-packed: low-entropy with 2 % escapes) and
    /// the form on the device.
    fn fp8_codes(&mut self, form: Fp8Form, n: usize, k: usize) -> Result<(Vec<u8>, Fp8Codes)> {
        Ok(match form {
            Fp8Form::Dense => {
                let w = self.rng.fp8s(n * k);
                let d = upload(self.dev, &w)?;
                (w, Fp8Codes::Dense(d))
            }
            Fp8Form::Palette { escape_pct } => {
                let w = self.rng.fp8s_low_entropy(n * k, escape_pct);
                let p = Palette4::encode(&w, n, k, 0)
                    .map_err(|e| GpuError::invalid("palette selftest", e.to_string()))?;
                let d = GpuPal4::upload(self.dev, &p)?;
                (w, Fp8Codes::Palette(d))
            }
        })
    }

    /// FP8 GEMV with row scales (codes dense or palette-packed), optionally with RMSNorm of x and
    /// an epilogue, against the model crate's `RowScaled(DenseFp8)` matvec of the same codes.
    fn gemv_fp8(
        &mut self,
        form: Fp8Form,
        cfg: GemvConfig,
        fusion: GemvFusion,
        norm: bool,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let (w, w_d) = self.fp8_codes(form, n, k)?;
        let scales: Vec<f32> = (0..n)
            .map(|_| 1e-2 * (0.5 + self.rng.unit() as f32))
            .collect();
        let x = self.rng.normals(k, 1.0);
        let g: Vec<f32> = (0..k).map(|_| 1.0 + 0.1 * self.rng.normal()).collect();
        let y0 = self.rng.normals(n, 1.0);
        let (s_d, x_d, g_d) = (
            upload(self.dev, &scales)?,
            upload(self.dev, &x)?,
            upload(self.dev, &g)?,
        );
        let out_len = if fusion.swiglu { n / 2 } else { n };
        let mut y = if fusion.accumulate {
            upload(self.dev, &y0)?
        } else {
            poisoned(self.dev, out_len)?
        };
        let eps = 1e-5;
        let norm_arg = norm.then_some((&g_d, eps));
        launch_gemv_fp8(
            self.dev, cfg, fusion, &w_d, &s_d, &x_d, norm_arg, &mut y, n, k,
        )?;
        let got = download(self.dev, &y)?;
        let xin = if norm {
            rmsnorm_f32w_ref(&x, &g, eps)
        } else {
            x
        };
        let mut want = gemv_fp8_ref(&w, &scales, &xin, n, k)?;
        if fusion.accumulate {
            want.iter_mut().zip(&y0).for_each(|(w, a)| *w += a);
        }
        if fusion.swiglu {
            want = swiglu_interleaved_ref(&want);
        }
        let label = format!(
            "{cfg} [{n}, {k}]{}{}{}",
            if norm { " norm" } else { "" },
            if fusion.accumulate { " +=" } else { "" },
            if fusion.swiglu { " swiglu" } else { "" }
        );
        let tolerance = form.gemv().tolerance();
        self.record(form.kernel(), label, &got[..out_len], &want, tolerance);
        Ok(())
    }

    /// A random BF16 matrix packed losslessly ([`PaletteBf16`]) on the host and the device:
    /// N(0, 0.02) weights, or (`spread`) high bytes over 128 values, most weights escaping.
    fn pal_bf16_matrix(
        &mut self,
        n: usize,
        k: usize,
        spread: bool,
    ) -> Result<(Vec<u16>, PaletteBf16, GpuPalBf16)> {
        let w: Vec<u16> = if spread {
            (0..n * k)
                .map(|_| self.rng.next_u64() as u16 & 0xBFFF)
                .collect()
        } else {
            self.rng.bf16s(n * k, 0.02)
        };
        let p = PaletteBf16::encode(&w, n, k)
            .map_err(|e| GpuError::invalid("palette selftest", e.to_string()))?;
        let w_d = GpuPalBf16::upload(self.dev, &p)?;
        Ok((w, p, w_d))
    }

    /// The BF16 palette GEMV ([`Self::pal_bf16_matrix`]), optionally with RMSNorm of x, with
    /// `fusion`'s epilogue, against the dense BF16 product of the same values.
    fn gemv_pal_bf16(
        &mut self,
        cfg: GemvConfig,
        fusion: GemvFusion,
        n: usize,
        k: usize,
        norm: bool,
        spread: bool,
    ) -> Result<()> {
        let (w, p, w_d) = self.pal_bf16_matrix(n, k, spread)?;
        let x = self.rng.normals(k, 1.0);
        let g: Vec<f32> = (0..k).map(|_| 1.0 + 0.1 * self.rng.normal()).collect();
        let y0 = self.rng.normals(n, 1.0);
        let (x_d, g_d) = (upload(self.dev, &x)?, upload(self.dev, &g)?);
        let out_n = if fusion.swiglu { n / 2 } else { n };
        let mut y = if fusion.accumulate {
            upload(self.dev, &y0)?
        } else {
            poisoned(self.dev, out_n)?
        };
        let eps = 1e-5;
        let norm_arg = norm.then_some((&g_d, eps));
        launch_gemv_pal_bf16(self.dev, cfg, fusion, &w_d, &x_d, norm_arg, &mut y)?;
        let got = download(self.dev, &y)?;
        let xin = if norm {
            rmsnorm_f32w_ref(&x, &g, eps)
        } else {
            x
        };
        let mut want = gemv_ref(&w, &xin, n, k);
        if fusion.accumulate {
            want.iter_mut().zip(&y0).for_each(|(w, a)| *w += a);
        }
        if fusion.swiglu {
            want = swiglu_interleaved_ref(&want);
        }
        let label = format!(
            "{cfg} [{n}, {k}]{}{}{}{} ({} escapes)",
            if norm { " norm" } else { "" },
            if fusion.accumulate { " +=" } else { "" },
            if fusion.swiglu { " swiglu" } else { "" },
            if spread { " spread" } else { "" },
            p.escapes().len()
        );
        self.record(
            "gemv_pal4_bf16",
            label,
            &got[..out_n],
            &want,
            GemvForm::Palette.tolerance(),
        );
        Ok(())
    }

    /// The BF16 palette form materialised for prefill, bit for bit against the values packed.
    fn pal_bf16_rows_to_bf16(&mut self, rows: usize, cols: usize, spread: bool) -> Result<()> {
        let (w, p, w_d) = self.pal_bf16_matrix(rows, cols, spread)?;
        let mut out = upload(self.dev, &vec![0x7fc0u16; rows * cols])?;
        launch_pal_bf16_rows_to_bf16(self.dev, &w_d, &mut out)?;
        let got = download(self.dev, &out)?;
        let differ = got.iter().zip(&w).filter(|(g, w)| g != w).count();
        self.cases.push(CaseResult {
            kernel: "pal4_bf16_rows_to_bf16".into(),
            shape: format!(
                "[{rows}, {cols}]{} ({} escapes): {differ} elements differ",
                if spread { " spread" } else { "" },
                p.escapes().len()
            ),
            rel_l2: if differ == 0 { 0.0 } else { f64::INFINITY },
            tolerance: 0.0,
        });
        Ok(())
    }

    /// FP8 → BF16 materialisation with row scales (codes dense or palette-packed), bit for bit
    /// against the CPU reference on the codes.
    fn fp8_rows_to_bf16(&mut self, form: Fp8Form, rows: usize, cols: usize) -> Result<()> {
        let (w, w_d) = self.fp8_codes(form, rows, cols)?;
        let scales: Vec<f32> = (0..rows)
            .map(|_| 1e-2 * (0.5 + self.rng.unit() as f32))
            .collect();
        let s_d = upload(self.dev, &scales)?;
        let mut out = self
            .dev
            .stream()
            .alloc_zeros::<u16>(rows * cols)
            .while_(|| "allocating the BF16 output".into())?;
        launch_fp8_rows_to_bf16(self.dev, &w_d, &s_d, &mut out, rows, cols)?;
        let got = download(self.dev, &out)?;
        let want = fp8_rows_to_bf16_ref(&w, &scales, cols);
        let differ = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        self.cases.push(CaseResult {
            kernel: match form {
                Fp8Form::Dense => "fp8_rows_to_bf16",
                Fp8Form::Palette { .. } => "pal4_rows_to_bf16",
            }
            .into(),
            shape: format!("[{rows}, {cols}]{}: {differ} elements differ", form.label()),
            rel_l2: if differ == 0 { 0.0 } else { f64::INFINITY },
            tolerance: 0.0,
        });
        Ok(())
    }

    fn attention(
        &mut self,
        cfg: AttnConfig,
        n_kv_heads: usize,
        max_seq: usize,
        seq_len: usize,
        q_scale: f32,
    ) -> Result<()> {
        let hd = cfg.head_dim as usize;
        let shape = KvShape {
            n_q_heads: n_kv_heads * cfg.group as usize,
            n_kv_heads,
            max_seq,
        };
        let row = n_kv_heads * hd;
        let mut kc = self.rng.bf16s(max_seq * row, 1.0);
        let mut vc = self.rng.bf16s(max_seq * row, 1.0);
        let (k_new, v_new) = (self.rng.normals(row, 1.0), self.rng.normals(row, 1.0));
        let q = self.rng.normals(shape.n_q_heads * hd, q_scale);
        let (mut kc_d, mut vc_d) = (upload(self.dev, &kc)?, upload(self.dev, &vc)?);
        let (kn_d, vn_d, q_d) = (
            upload(self.dev, &k_new)?,
            upload(self.dev, &v_new)?,
            upload(self.dev, &q)?,
        );
        let len_d = upload(self.dev, &[seq_len as i32])?;
        let mut scratch = AttnScratch::new(self.dev, cfg, shape.n_q_heads, max_seq)?;
        let mut out = poisoned(self.dev, shape.n_q_heads * hd)?;
        launch_kv_append(
            self.dev, cfg, shape, &kn_d, &vn_d, &mut kc_d, &mut vc_d, &len_d,
        )?;
        let scale = 1.0 / (hd as f32).sqrt();
        launch_attention_decode(
            self.dev,
            cfg,
            shape,
            &q_d,
            &kc_d,
            &vc_d,
            &len_d,
            &mut scratch,
            &mut out,
            scale,
            entrollm_cuda::ops::attention::AttnMask::NONE,
            None,
        )?;
        let got_out = download(self.dev, &out)?;
        let (got_k, got_v) = (download(self.dev, &kc_d)?, download(self.dev, &vc_d)?);
        let pos = seq_len - 1;
        for i in 0..row {
            kc[pos * row + i] = f32_to_bf16(k_new[i]);
            vc[pos * row + i] = f32_to_bf16(v_new[i]);
        }
        let as_f32 = |v: &[u16]| {
            v.iter()
                .map(|&b| entrollm_cuda::ops::bf16_to_f32(b))
                .collect::<Vec<f32>>()
        };
        let desc = format!(
            "hd{} g{} kv{} len {seq_len}/{max_seq} q×{q_scale}",
            hd, cfg.group, n_kv_heads
        );
        let mut got_cache = as_f32(&got_k);
        got_cache.extend(as_f32(&got_v));
        let mut want_cache = as_f32(&kc);
        want_cache.extend(as_f32(&vc));
        self.record("kv_append", desc.clone(), &got_cache, &want_cache, 0.0);
        let want = attention_ref(
            &q,
            &kc,
            &vc,
            seq_len,
            shape.n_q_heads,
            n_kv_heads,
            hd,
            scale,
        );
        self.record("attention_decode", desc, &got_out, &want, 1e-4);
        Ok(())
    }

    /// kv_append → attention → advance_counters captured once as a CUDA graph and replayed
    /// `replays` times: the device-held length must advance and each replay must append at the
    /// new position and attend over it.
    fn graph_decode(
        &mut self,
        cfg: AttnConfig,
        n_kv_heads: usize,
        max_seq: usize,
        start_len: usize,
        replays: usize,
    ) -> Result<()> {
        let hd = cfg.head_dim as usize;
        let shape = KvShape {
            n_q_heads: n_kv_heads * cfg.group as usize,
            n_kv_heads,
            max_seq,
        };
        let row = n_kv_heads * hd;
        let mut kc = self.rng.bf16s(max_seq * row, 1.0);
        let mut vc = self.rng.bf16s(max_seq * row, 1.0);
        let (k_new, v_new) = (self.rng.normals(row, 1.0), self.rng.normals(row, 1.0));
        let q = self.rng.normals(shape.n_q_heads * hd, 1.0);
        let (mut kc_d, mut vc_d) = (upload(self.dev, &kc)?, upload(self.dev, &vc)?);
        let (kn_d, vn_d, q_d) = (
            upload(self.dev, &k_new)?,
            upload(self.dev, &v_new)?,
            upload(self.dev, &q)?,
        );
        let mut len_d = upload(self.dev, &[start_len as i32])?;
        let mut scratch = AttnScratch::new(self.dev, cfg, shape.n_q_heads, max_seq)?;
        let mut out = poisoned(self.dev, shape.n_q_heads * hd)?;
        let scale = 1.0 / (hd as f32).sqrt();
        // Load every module before capture: module loading is not allowed while capturing.
        self.dev.function(&cfg.variant(), "kv_append")?;
        self.dev.function(&cfg.variant(), "attn_decode_partial")?;
        self.dev.function(&cfg.variant(), "attn_decode_combine")?;
        self.dev.function(&variant(), "advance_counters")?;
        self.dev.synchronize()?;
        let stream = self.dev.stream();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .while_(|| "beginning graph capture".into())?;
        let captured = (|| {
            launch_kv_append(
                self.dev, cfg, shape, &kn_d, &vn_d, &mut kc_d, &mut vc_d, &len_d,
            )?;
            launch_attention_decode(
                self.dev,
                cfg,
                shape,
                &q_d,
                &kc_d,
                &vc_d,
                &len_d,
                &mut scratch,
                &mut out,
                scale,
                entrollm_cuda::ops::attention::AttnMask::NONE,
                None,
            )?;
            launch_advance_counters(self.dev, &mut len_d, 1)
        })();
        let graph = stream
            .end_capture(CUgraphInstantiate_flags(0))
            .while_(|| "ending graph capture".into())?;
        captured?;
        let graph =
            graph.ok_or_else(|| GpuError::Selftest("captured decode graph is empty".into()))?;
        for _ in 0..replays {
            graph
                .launch()
                .while_(|| "replaying the decode graph".into())?;
        }
        let got_out = download(self.dev, &out)?;
        let got_len = download(self.dev, &len_d)?[0];
        let final_len = start_len + replays - 1; // attention of the last replay ran before its advance
        for pos in start_len - 1..final_len {
            for i in 0..row {
                kc[pos * row + i] = f32_to_bf16(k_new[i]);
                vc[pos * row + i] = f32_to_bf16(v_new[i]);
            }
        }
        let desc = format!(
            "hd{hd} g{} kv{n_kv_heads} len {start_len}+{replays}/{max_seq}",
            cfg.group
        );
        let want = attention_ref(
            &q,
            &kc,
            &vc,
            final_len,
            shape.n_q_heads,
            n_kv_heads,
            hd,
            scale,
        );
        self.record("graph_decode", desc.clone(), &got_out, &want, 1e-4);
        let len_ok = got_len == (start_len + replays) as i32;
        self.cases.push(CaseResult {
            kernel: "graph_decode_len".into(),
            shape: format!("{desc} (gpu {got_len})"),
            rel_l2: if len_ok { 0.0 } else { f64::INFINITY },
            tolerance: 0.0,
        });
        Ok(())
    }
}

/// How the FP8 cases' codes travel.
#[derive(Clone, Copy, Debug)]
enum Fp8Form {
    Dense,
    /// Palette-packed low-entropy codes, `escape_pct` % of them outside the palette's reach.
    Palette {
        escape_pct: u64,
    },
}

impl Fp8Form {
    fn kernel(self) -> &'static str {
        self.gemv().name()
    }

    fn label(self) -> String {
        match self {
            Fp8Form::Dense => String::new(),
            Fp8Form::Palette { escape_pct } => format!(" ({escape_pct} % escapes)"),
        }
    }

    fn gemv(self) -> GemvForm {
        match self {
            Fp8Form::Dense => GemvForm::Dense,
            Fp8Form::Palette { .. } => GemvForm::Palette,
        }
    }

    fn configs(self) -> &'static [GemvConfig] {
        self.gemv().configs()
    }

    fn engine_config(self, n: usize, k: usize, sms: u32, swiglu: bool) -> GemvConfig {
        self.gemv().engine_config(n, k, sms, swiglu)
    }

    /// Columns of a case: the palette form needs multiples of 64.
    fn cols(self, k: usize) -> usize {
        match self {
            Fp8Form::Dense => k,
            Fp8Form::Palette { .. } => k.next_multiple_of(64),
        }
    }
}

/// The FP8 GEMV cases, codes dense and palette-packed: every candidate configuration over ragged
/// and Llama-8B shapes, then the fused forms (RMSNorm, residual add, SwiGLU) the decode step
/// launches; then the FP8 → BF16 materialisation for prefill.
fn fp8_cases(c: &mut Checker) -> Result<()> {
    let plain = GemvFusion::default();
    let accum = GemvFusion {
        accumulate: true,
        swiglu: false,
    };
    let swiglu = GemvFusion {
        accumulate: false,
        swiglu: true,
    };
    for form in [Fp8Form::Dense, Fp8Form::Palette { escape_pct: 2 }] {
        for &cfg in form.configs() {
            for &(n, k) in &[(1, 16), (3, 32), (37, 528), (129, 4112), (1000, 2048)] {
                c.gemv_fp8(form, cfg, plain, false, n, form.cols(k))?;
            }
        }
        // The Llama-8B launches with the configurations and fusions the decode step would use.
        for &(n, k, norm, fusion) in &[
            (4096, 4096, false, plain),
            (4096, 4096, true, plain),
            (4096, 4096, false, accum),
            (4096, 4096, true, swiglu),
            (6144, 4096, true, plain),
            (4096, 14_336, false, accum),
            (28_672, 4096, true, swiglu),
        ] {
            let sms = c.dev.info().sm_count;
            let cfg = form.engine_config(n, k, sms, fusion.swiglu);
            c.gemv_fp8(form, cfg, fusion, norm, n, k)?;
        }
        for &cfg in form.configs() {
            c.gemv_fp8(form, cfg, accum, false, 77, form.cols(1040))?;
            if cfg.rows % 2 == 0 || matches!(form, Fp8Form::Palette { .. }) {
                c.gemv_fp8(form, cfg, swiglu, true, 258, form.cols(1040))?;
            }
            c.gemv_fp8(form, cfg, plain, true, 33, form.cols(272))?;
        }
        for &(rows, cols) in &[(1, 16), (37, 528), (1000, 2048), (4096, 4096)] {
            c.fp8_rows_to_bf16(form, rows, form.cols(cols))?;
        }
    }
    // No escapes, and most weights escaping (uniform codes).
    for escape_pct in [0, 100] {
        let form = Fp8Form::Palette { escape_pct };
        c.gemv_fp8(form, GemvConfig::DEFAULT, plain, true, 37, 576)?;
        c.fp8_rows_to_bf16(form, 37, 576)?;
    }
    // Palette form, x's low half past the lookup table (k > 14 800 with 16 warps), as the engine
    // launches it: Llama-70B's down projection and a ragged one.
    let form = Fp8Form::Palette { escape_pct: 2 };
    for &(n, k) in &[(40, 28_672), (33, 16_000)] {
        let cfg = form.engine_config(n, k, c.dev.info().sm_count, false);
        c.gemv_fp8(form, cfg, accum, false, n, k)?;
        c.gemv_fp8(form, cfg, plain, true, n, k)?;
    }
    // The BF16 palette GEMV (an FP8 checkpoint's LM head): every configuration on ragged shapes,
    // with and without the norm, one with most weights escaping, and the Llama-8B LM head as the
    // engine launches it.
    // (A BF16 checkpoint served with `--bf16 palette` adds the residual-add and SwiGLU epilogues.)
    let swiglu = GemvFusion {
        accumulate: false,
        swiglu: true,
    };
    for cfg in PAL_BF16_CANDIDATES {
        for &(n, k) in &[(1, 64), (37, 576), (129, 4160), (1000, 2048)] {
            c.gemv_pal_bf16(cfg, plain, n, k, false, false)?;
        }
        c.gemv_pal_bf16(cfg, plain, 33, 1024, true, false)?;
        c.gemv_pal_bf16(cfg, accum, 37, 576, false, false)?;
        c.gemv_pal_bf16(cfg, swiglu, 130, 1024, true, false)?;
    }
    c.gemv_pal_bf16(PAL_BF16_CANDIDATES[0], plain, 37, 576, true, true)?;
    c.gemv_pal_bf16(PAL_BF16_CANDIDATES[1], accum, 38, 576, false, true)?;
    for &(rows, cols, spread) in &[
        (1, 64, false),
        (37, 576, false),
        (300, 4160, false),
        (37, 576, true),
        (4096, 4096, false),
    ] {
        c.pal_bf16_rows_to_bf16(rows, cols, spread)?;
    }
    let (n, k) = (128_256, 4096);
    c.gemv_pal_bf16(
        pal_bf16_config_for(n, c.dev.info().sm_count),
        plain,
        n,
        k,
        true,
        false,
    )?;
    Ok(())
}

/// Only the dense FP8 GEMV cases (`fp8_cases`), with inputs drawn from `seed`.
pub fn run_fp8_selftest(dev: &GpuDevice, seed: u64) -> Result<SelftestReport> {
    let mut c = Checker {
        dev,
        rng: Rng::new(seed),
        cases: Vec::new(),
    };
    fp8_cases(&mut c)?;
    let report = SelftestReport {
        device: format!("{} ({})", dev.info().name, dev.info().arch()),
        cases: c.cases,
    };
    if report.failures().next().is_some() {
        return Err(GpuError::Selftest(report.to_string()));
    }
    Ok(report)
}

/// Runs every kernel over its shape list with inputs drawn from `seed`. Returns the report when
/// every case passes, [`GpuError::Selftest`] with the full report otherwise.
pub fn run_selftest(dev: &GpuDevice, seed: u64) -> Result<SelftestReport> {
    let mut c = Checker {
        dev,
        rng: Rng::new(seed),
        cases: Vec::new(),
    };
    for &(vocab, dim, nt) in &[
        (17, 8, 1),
        (1000, 300, 5),
        (49_152, 576, 3),
        (8_000, 4096, 2),
    ] {
        c.embedding(vocab, dim, nt)?;
    }
    for &(rows, dim) in &[(1, 7), (1, 64), (3, 576), (1, 4096), (2, 5000), (1, 8192)] {
        c.rmsnorm(rows, dim)?;
    }
    for &(nt, inter) in &[(1, 1), (1, 100), (2, 1536), (1, 14_336)] {
        c.swiglu(nt, inter)?;
    }
    for &n in &[1, 1000, 4096] {
        c.residual(n)?;
    }
    for layout in [RopeLayout::Neox, RopeLayout::Interleaved] {
        for &(n_tokens, n_q_heads, n_kv_heads, head_dim) in
            &[(1, 1, 1, 2), (1, 9, 3, 64), (3, 32, 8, 128), (1, 5, 1, 6)]
        {
            c.rope(RopeShape {
                n_tokens,
                n_q_heads,
                n_kv_heads,
                head_dim,
                layout,
            })?;
        }
    }
    let mut scratch = ArgmaxScratch::new(dev, 1024)?;
    for &n in &[1, 7, 1000, 49_152, 128_256, 151_936] {
        c.argmax(n, &mut scratch, false)?;
        c.argmax(n, &mut scratch, true)?;
    }
    for cfg in GemvConfig::CANDIDATES {
        for &(n, k) in &[
            (1, 8),
            (3, 24),
            (37, 520),
            (129, 4104),
            (1000, 2048),
            (4096, 4096),
        ] {
            c.gemv(cfg, n, k)?;
        }
    }
    c.gemv(GemvConfig::DEFAULT, 6144, 4096)?;
    c.gemv(GemvConfig::DEFAULT, 4096, 14_336)?;
    fp8_cases(&mut c)?;
    for cfg in AttnConfig::builtin() {
        let n_kv = if cfg.group == 1 {
            4
        } else {
            8 / cfg.group.min(8) as usize + 1
        };
        for &(max_seq, len) in &[
            (640, 1),
            (640, 7),
            (640, 256),
            (640, 257),
            (640, 600),
            (1000, 1000),
        ] {
            c.attention(cfg, n_kv, max_seq, len, 1.0)?;
        }
        c.attention(cfg, n_kv, 640, 500, 8.0)?; // peaked softmax
    }
    c.graph_decode(AttnConfig::for_heads(128, 32, 8)?, 8, 300, 250, 10)?;
    c.graph_decode(AttnConfig::for_heads(64, 9, 3)?, 3, 64, 1, 5)?;
    let report = SelftestReport {
        device: format!("{} ({})", dev.info().name, dev.info().arch()),
        cases: c.cases,
    };
    if report.failures().next().is_some() {
        return Err(GpuError::Selftest(report.to_string()));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_l2_catches_nan_and_length() {
        assert_eq!(rel_l2(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!(rel_l2(&[f32::NAN, 2.0], &[1.0, 2.0]).is_infinite());
        assert!(rel_l2(&[1.0], &[1.0, 2.0]).is_infinite());
        assert!((rel_l2(&[1.1, 0.0], &[1.0, 0.0]) - 0.1).abs() < 1e-6);
        // NaN expected (bad token id) must be matched by NaN.
        assert_eq!(rel_l2(&[f32::NAN], &[f32::NAN]), 0.0);
        assert!(rel_l2(&[0.0], &[f32::NAN]).is_infinite());
        let failing = CaseResult {
            kernel: "x".into(),
            shape: String::new(),
            rel_l2: f64::NAN,
            tolerance: 1.0,
        };
        assert!(!failing.passed());
    }

    #[test]
    fn rng_normals_look_standard() {
        let mut r = Rng::new(7);
        let v = r.normals(100_000, 1.0);
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(
            mean.abs() < 0.02 && (var - 1.0).abs() < 0.03,
            "{mean} {var}"
        );
    }
}
