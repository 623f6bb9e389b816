//! Cold-cache timing of FP8 E4M3 matrices with per-row scales (FP8 checkpoints' per-channel
//! `weight_scale`): the dense FP8 GEMV (`ops::gemv_fp8`), the same GEMV on the codes
//! palette-packed (`gemv_pal4`) and the dtANS-LLM `mvm` on the same codes entropy-coded, under the protocol of `bench.rs` (copies covering more than 2× L2, a CUDA
//! graph of ≥ 400 µs of launches, median of 5 replays).
//!
//! The codes are the synthetic FP8 checkpoint's (`entrollm_model::synth::fp8_row`): model-like rows
//! quantised with a scale multiplier fitted so that the codes carry a target entropy (2.1 bits for
//! the EntQuant-like checkpoint). As in `bench_coded`, `BASE_ROWS` rows are generated and coded
//! for real and larger matrices repeat their 32-row bands (dense: the same rows repeated), so
//! traffic and decoding work are those of the full matrix. The measured entropy of the codes is
//! reported beside the target.

use std::sync::Mutex;

use cudarc::driver::CudaSlice;
use entrollm_codec::dtans::{choose_coding_and_width, Coding, DtansTensor};
use entrollm_codec::matvec::Dequant;
use entrollm_codec::palette::Palette4;
use entrollm_codec::Payload;
use entrollm_model::synth::{fill_tensor_fp8, fit_fp8_multiplier, SynthKind, SynthTensor};

use crate::bench_coded::{repeat_bands, BASE_ROWS};
use crate::selftest::{rel_l2, GemvForm, Rng};
use entrollm_cuda::coded::GpuDtans;
use entrollm_cuda::device::GpuDevice;
use entrollm_cuda::error::{DriverContext, GpuError, Result};
use entrollm_cuda::forms::fp8::{launch_gemv_fp8, Fp8Codes};
use entrollm_cuda::jit::KernelVariant;
use entrollm_cuda::mem::{download, upload};
use entrollm_cuda::ops::dtans::{launch_mvm, DtansConfig, DtansKind, DtansOut, MAX_SHARED_BYTES};
use entrollm_cuda::ops::forward::GemvFusion;
use entrollm_cuda::ops::gemv::GemvConfig;
use entrollm_cuda::ops::gemv_fp8::{gemv_fp8_ref, GpuPal4};
use entrollm_cuda::timing::{copies_for, time_cold};

fn codec_err(e: entrollm_codec::CodecError) -> GpuError {
    GpuError::invalid("fp8 bench", e.to_string())
}

/// The scale multiplier giving `bits` of code entropy to synthetic rows of `k` columns. The rows'
/// statistics do not depend on the tensor or the seed, only on `k` (through the row maximum), so
/// one fit per (k, bits) serves every shape: the fit is most of the set-up time.
fn fitted_multiplier(k: usize, bits: f64) -> f32 {
    static FITS: Mutex<Vec<(usize, u64, f32)>> = Mutex::new(Vec::new());
    let mut fits = FITS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(f) = fits.iter().find(|f| f.0 == k && f.1 == bits.to_bits()) {
        return f.2;
    }
    let t = SynthTensor {
        name: format!("fp8_bench.fit.{k}"),
        shape: vec![BASE_ROWS, k],
        kind: SynthKind::Matrix { sigma: 0.02 },
    };
    let m = fit_fp8_multiplier(&t, 0, bits);
    fits.push((k, bits.to_bits(), m));
    m
}

/// Synthetic FP8 codes of an `n × k` matrix (row-major, `n` rows from `min(n, BASE_ROWS)`
/// generated ones repeated) and their row scales, at `bits` of code entropy.
pub struct Fp8Matrix {
    pub rows: usize,
    pub cols: usize,
    /// Generated rows (a multiple of 32 when fewer than `rows`).
    pub base_rows: usize,
    /// Codes of the generated rows.
    pub base_codes: Vec<u8>,
    /// Scales of all `rows` rows.
    pub scales: Vec<f32>,
    /// The fitted scale multiplier (see `synth::fp8_row`).
    pub multiplier: f32,
}

impl Fp8Matrix {
    pub fn synth(n: usize, k: usize, bits: f64, seed: u64) -> Result<Self> {
        let base = n.min(BASE_ROWS);
        if base < n && base % 32 != 0 {
            return Err(GpuError::invalid(
                "fp8 bench",
                "BASE_ROWS must be a multiple of 32",
            ));
        }
        let t = SynthTensor {
            name: format!("fp8_bench.{n}x{k}"),
            shape: vec![base, k],
            kind: SynthKind::Matrix { sigma: 0.02 },
        };
        let multiplier = fitted_multiplier(k, bits);
        let mut base_codes = vec![0u8; base * k];
        let mut base_scales = vec![0f32; base];
        fill_tensor_fp8(&t, seed, multiplier, &mut base_codes, &mut base_scales);
        let scales = (0..n).map(|r| base_scales[r % base]).collect();
        Ok(Fp8Matrix {
            rows: n,
            cols: k,
            base_rows: base,
            base_codes,
            scales,
            multiplier,
        })
    }

    /// All `rows · cols` codes (the generated rows repeated).
    pub fn codes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.rows * self.cols);
        while v.len() < self.rows * self.cols {
            let take = (self.rows * self.cols - v.len()).min(self.base_codes.len());
            v.extend_from_slice(&self.base_codes[..take]);
        }
        v
    }

    /// Entropy in bits of the generated codes' byte histogram.
    pub fn entropy_bits(&self) -> f64 {
        let mut h = [0u64; 256];
        for &c in &self.base_codes {
            h[c as usize] += 1;
        }
        let n = self.base_codes.len() as f64;
        h.iter()
            .filter(|&&c| c > 0)
            .map(|&c| {
                let p = c as f64 / n;
                -p * p.log2()
            })
            .sum()
    }

    /// The codes dtANS-coded with `coding`, or (None) with the coding and slice width
    /// `choose_coding_and_width` picks on the generated rows (bands repeated up to `rows`).
    pub fn coded(&self, coding: Option<Coding>) -> Result<DtansTensor> {
        let p = Payload::Fp8E4m3;
        let coding = match coding {
            Some(c) => c,
            None => {
                choose_coding_and_width(p, self.base_rows, self.cols, &self.base_codes)
                    .map_err(codec_err)?
                    .0
            }
        };
        let t = DtansTensor::encode(p, self.base_rows, self.cols, &self.base_codes, &[], coding)
            .map_err(codec_err)?;
        if self.base_rows == self.rows {
            Ok(t)
        } else {
            repeat_bands(&t, self.rows)
        }
    }

    /// The per-row dequantisation of the coded form (one group per row, no offset).
    pub fn dequant(&self) -> Dequant<'_> {
        Dequant::Groups {
            group: self.cols,
            scales: &self.scales,
            mins: None,
            offset: 0.0,
            signed: false,
        }
    }
}

/// The mvm launches the timing tries for an FP8 coding with row scales: 4, 8 and 16 warps (group
/// dequantisation needs the default unroll), those that compile for the kind and fit in shared
/// memory.
pub fn fp8_mvm_configs(t: &DtansTensor) -> Vec<DtansConfig> {
    let kind = DtansKind::of(t.payload, &t.coding, t.cols, Some(t.cols));
    [4, 8, 16]
        .map(DtansConfig::warps)
        .into_iter()
        .filter(|c| c.fits(&kind) && kind.shared_bytes(*c, DtansOut::Mvm) <= MAX_SHARED_BYTES)
        .collect()
}

/// The kernel variants of [`fp8_mvm_configs`] (for a precompiled cubin cache).
pub fn fp8_mvm_variants(t: &DtansTensor) -> Vec<KernelVariant> {
    let kind = DtansKind::of(t.payload, &t.coding, t.cols, Some(t.cols));
    fp8_mvm_configs(t)
        .into_iter()
        .map(|c| kind.variant(c, DtansOut::Mvm))
        .collect()
}

/// A timed launch.
#[derive(Clone, Debug)]
pub struct Fp8Timing {
    pub kernel: String,
    pub median_us: f64,
    /// Bytes read per weight ×8 (codes, scales; coded: stream, companion, tables, offsets).
    pub bits_per_weight: f64,
    /// Weights per second (×1e-12).
    pub tweights_per_s: f64,
    pub copies: usize,
}

/// One FP8 shape on the device, dense, palette-packed and coded, for checking and cold-cache
/// timing.
pub struct Fp8Bench<'a> {
    dev: &'a GpuDevice,
    pub m: Fp8Matrix,
    /// The dtANS-coded codes (None: not coded, the GEMVs only).
    pub tensor: Option<DtansTensor>,
    pub packed: Palette4,
    dense: Vec<Fp8Codes>,
    palette: Vec<Fp8Codes>,
    scales: CudaSlice<f32>,
    coded: Vec<GpuDtans>,
    x: Vec<f32>,
    x_d: CudaSlice<f32>,
    y: CudaSlice<f32>,
    reference: Vec<f32>,
}

impl<'a> Fp8Bench<'a> {
    /// Generates, codes (with `coding`: Some(None) the coder's choice, None not at all),
    /// palette-packs and uploads an `n × k` FP8 matrix at `bits` of entropy; the reference product
    /// is the model crate's dense FP8 matvec with row scales.
    pub fn new(
        dev: &'a GpuDevice,
        n: usize,
        k: usize,
        bits: f64,
        seed: u64,
        coding: Option<Option<Coding>>,
    ) -> Result<Self> {
        let m = Fp8Matrix::synth(n, k, bits, seed)?;
        let tensor = coding.map(|c| m.coded(c)).transpose()?;
        let codes = m.codes();
        let l2 = dev.info().l2_bytes;
        let dense = (0..copies_for(codes.len(), l2))
            .map(|_| upload(dev, &codes).map(Fp8Codes::Dense))
            .collect::<Result<Vec<_>>>()?;
        let packed = Palette4::encode(&codes, n, k, 0).map_err(codec_err)?;
        let palette = (0..copies_for(packed.stored_bytes(), l2))
            .map(|_| GpuPal4::upload(dev, &packed).map(Fp8Codes::Palette))
            .collect::<Result<Vec<_>>>()?;
        let coded = match &tensor {
            Some(t) => (0..copies_for(t.stored_bytes(), l2))
                .map(|_| GpuDtans::upload(dev, t, &m.dequant()))
                .collect::<Result<Vec<_>>>()?,
            None => Vec::new(),
        };
        let x = Rng::new(seed + 1).normals(k, 1.0);
        let reference = gemv_fp8_ref(&codes, &m.scales, &x, n, k)?;
        Ok(Fp8Bench {
            dev,
            scales: upload(dev, &m.scales)?,
            x_d: upload(dev, &x)?,
            x,
            y: dev
                .stream()
                .alloc_zeros(n)
                .while_(|| "allocating y".into())?,
            m,
            tensor,
            packed,
            dense,
            palette,
            coded,
            reference,
        })
    }

    fn coded_tensor(&self) -> Result<&DtansTensor> {
        self.tensor
            .as_ref()
            .ok_or_else(|| GpuError::invalid("fp8 bench", "the matrix was not dtANS-coded"))
    }

    /// Relative L2 error of the FP8 GEMV `form` (last copy) against the reference.
    pub fn check_gemv(&mut self, cfg: GemvConfig, form: GemvForm) -> Result<f64> {
        let (n, k) = (self.m.rows, self.m.cols);
        self.y = upload(self.dev, &vec![f32::NAN; n])?;
        let w = if form == GemvForm::Dense {
            &self.dense
        } else {
            &self.palette
        };
        let w = w.last().expect("at least one copy");
        launch_gemv_fp8(
            self.dev,
            cfg,
            GemvFusion::default(),
            w,
            &self.scales,
            &self.x_d,
            None,
            &mut self.y,
            n,
            k,
        )?;
        Ok(rel_l2(&download(self.dev, &self.y)?, &self.reference))
    }

    /// Relative L2 error of the coded mvm (last copy) against the same reference (the codes are
    /// lossless, so only f32 summation order differs), the CPU decoder's matvec of the coded
    /// tensor as a second reference, and the kernels' error word.
    pub fn check_coded(&mut self, cfg: DtansConfig) -> Result<(f64, f64, u32)> {
        let n = self.m.rows;
        self.y = upload(self.dev, &vec![f32::NAN; n])?;
        let mut err = upload(self.dev, &[0u32])?;
        let t = self.coded.last().expect("at least one copy");
        launch_mvm(
            self.dev,
            cfg,
            &[t],
            &self.x_d,
            &mut [&mut self.y],
            Some(&mut err),
        )?;
        let got = download(self.dev, &self.y)?;
        let mut cpu = vec![0f32; n];
        self.coded_tensor()?
            .matvec(&self.x, &mut cpu, &self.m.dequant())
            .map_err(codec_err)?;
        Ok((
            rel_l2(&got, &self.reference),
            rel_l2(&cpu, &self.reference),
            download(self.dev, &err)?[0],
        ))
    }

    fn timing(&self, kernel: String, us: f64, bytes: usize, copies: usize) -> Fp8Timing {
        let w = (self.m.rows * self.m.cols) as f64;
        Fp8Timing {
            kernel,
            median_us: us,
            bits_per_weight: bytes as f64 * 8.0 / w,
            tweights_per_s: w / (us * 1e-6) / 1e12,
            copies,
        }
    }

    /// Cold-cache time of the FP8 GEMV `form`.
    pub fn time_gemv(&mut self, cfg: GemvConfig, form: GemvForm) -> Result<Fp8Timing> {
        let (dev, n, k) = (self.dev, self.m.rows, self.m.cols);
        let w = if form == GemvForm::Dense {
            &self.dense
        } else {
            &self.palette
        };
        let (copies, bytes) = (w.len(), w[0].stored_bytes() + 4 * n);
        let (s, x, y) = (&self.scales, &self.x_d, &mut self.y);
        let (us, _) = time_cold(dev, copies, bytes, |c| {
            launch_gemv_fp8(dev, cfg, GemvFusion::default(), &w[c], s, x, None, y, n, k)
        })?;
        Ok(self.timing(format!("{} {cfg}", form.name()), us, bytes, copies))
    }

    pub fn time_coded(&mut self, cfg: DtansConfig) -> Result<Fp8Timing> {
        let dev = self.dev;
        let bytes = self.coded_tensor()?.stored_bytes() + 4 * self.m.rows;
        let (coded, x, y) = (&self.coded, &self.x_d, &mut self.y);
        let (us, _) = time_cold(dev, coded.len(), bytes, |c| {
            launch_mvm(dev, cfg, &[&coded[c]], x, &mut [&mut *y], None)
        })?;
        let c = &self.coded_tensor()?.coding;
        Ok(self.timing(
            format!(
                "dtans {:?} M2^{} sc{} t{:?} {cfg}",
                c.mode, c.log2_m, c.sc, c.t
            ),
            us,
            bytes,
            coded.len(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_fp8_hits_the_entropy_and_codes_losslessly() {
        let m = Fp8Matrix::synth(64, 512, 2.1, 3).unwrap();
        let h = m.entropy_bits();
        // The multiplier is fitted on other rows of the same statistics: near, not at, the target.
        assert!((h - 2.1).abs() < 0.25, "entropy {h}");
        let t = m.coded(None).unwrap();
        assert_eq!(t.decode().unwrap(), m.codes());
        assert!(t.bits_per_weight() < 3.0, "{} b/w", t.bits_per_weight());
        assert!(!fp8_mvm_configs(&t).is_empty());
    }

    #[test]
    fn repeated_rows_repeat_scales() {
        let m = Fp8Matrix::synth(BASE_ROWS + 64, 32, 3.0, 1).unwrap();
        assert_eq!(m.scales[BASE_ROWS + 5], m.scales[5]);
        assert_eq!(m.codes()[BASE_ROWS * 32..], m.codes()[..64 * 32]);
        assert_eq!(m.coded(None).unwrap().rows, BASE_ROWS + 64);
    }

    #[test]
    fn engine_configs_allow_their_fusions() {
        use entrollm_cuda::ops::forward::{check_fusion, check_swiglu_rows, GemvFusion};
        for form in GemvForm::ALL {
            for n in [64, 4096, 6144, 28_672, 128_256] {
                for swiglu in [false, true] {
                    let cfg = form.engine_config(n, 4096, 132, swiglu);
                    let fusion = GemvFusion {
                        accumulate: false,
                        swiglu,
                    };
                    let ok = match form {
                        GemvForm::Dense => check_fusion("test", cfg, fusion, n),
                        GemvForm::Palette => check_swiglu_rows("test", fusion, n),
                    };
                    assert!(ok.is_ok(), "{form:?} {cfg}");
                    assert!(form.configs().contains(&cfg) || form == GemvForm::Dense);
                }
            }
        }
    }
}
