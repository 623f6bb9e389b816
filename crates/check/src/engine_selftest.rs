//! Selftest of the GPU forward pass (part of `entrollm selftest --gpu`, after
//! [`crate::selftest::run_selftest`]): the forward-pass kernels against their CPU references on
//! fresh random inputs over many (also ragged) shapes, then whole models: a small synthetic model with q/k/v biases and interleaved RoPE (prefill over
//! two chunks, decode steps) and SmolLM2-135M, GPU vs the CPU engine on the same BF16-rounded
//! weights (logits and greedy tokens).
//!
//! Tolerances (relative L2 unless said): f32 kernels 1e-5 (GEMV and its fused RMSNorm / residual /
//! SwiGLU forms, RMSNorm, RoPE); kernels with a
//! BF16 output against the reference rounded to BF16 1e-4 (a rounding flip of a few elements);
//! cuBLASLt GEMM 1e-4; flash prefill 1e-2 (BF16 probabilities and output). Whole models: logits 3e-2 for the
//! synthetic model, 5e-2 for SmolLM2 (BF16 KV cache and BF16 prefill activations, against an f32
//! CPU engine, through 30 layers); greedy tokens must match, a divergence passes only as a
//! near-tie: where the CPU's top-two logits are within 0.5 of each other (documented per prompt).

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::CudaSlice;

use entrollm_model::arch::Role;
use entrollm_model::config::{Arch, RopeStyle};
use entrollm_model::synth::{
    fill_row, shared_layer_weights, tensor_name, tensors, SynthKind, SynthShape,
};
use entrollm_model::weights::{GatedMlp, Linear, Mlp, ModelWeights};
use entrollm_model::{DenseBf16 as CpuDenseBf16, Engine, LayerWeights};

use crate::selftest::{rel_l2, CaseResult, Rng, SelftestReport};
use entrollm_cuda::device::GpuDevice;
use entrollm_cuda::engine::{bf16_rounded, DecodeOptions, GpuEngine, GpuModel};
use entrollm_cuda::error::{GpuError, Result};
use entrollm_cuda::gemm::{gemm_ref, Gemm};
use entrollm_cuda::linear::{Fp8Serving, Serving};
use entrollm_cuda::mem::{download, upload};
use entrollm_cuda::ops::attention::{
    attention_masked_ref, launch_attention_decode, launch_attention_decode_fused, AttnMask,
    AttnScratch, KvShape,
};
use entrollm_cuda::ops::forward::*;
use entrollm_cuda::ops::gemv::{gemv_ref, GemvConfig};
use entrollm_cuda::ops::gemv_fp8::gemv_fp8_ref;
use entrollm_cuda::ops::rope::RopeLayout;
use entrollm_cuda::ops::{bf16_to_f32, f32_to_bf16};

struct Checker<'a> {
    dev: &'a GpuDevice,
    rng: Rng,
    cases: Vec<CaseResult>,
}

fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16_to_f32(f32_to_bf16(x))).collect()
}

fn widen(v: &[u16]) -> Vec<f32> {
    v.iter().map(|&b| bf16_to_f32(b)).collect()
}

fn poisoned16(dev: &GpuDevice, n: usize) -> Result<CudaSlice<u16>> {
    upload(dev, &vec![0x7fc0u16; n.max(1)])
}

fn poisoned32(dev: &GpuDevice, n: usize) -> Result<CudaSlice<f32>> {
    upload(dev, &vec![f32::NAN; n.max(1)])
}

/// A chained-norm case's matrix on the host: BF16, or FP8 codes with row scales.
enum HostDense {
    Bf16(Vec<u16>),
    Fp8(Vec<u8>, Vec<f32>),
}

impl HostDense {
    /// The CPU reference `W x` for [n, k].
    fn matvec(&self, x: &[f32], n: usize, k: usize) -> Result<Vec<f32>> {
        match self {
            HostDense::Bf16(w) => Ok(gemv_ref(w, x, n, k)),
            HostDense::Fp8(codes, scales) => gemv_fp8_ref(codes, scales, x, n, k),
        }
    }
}

/// The same matrix on the device.
enum DevDense {
    Bf16(CudaSlice<u16>),
    Fp8(CudaSlice<u8>, CudaSlice<f32>),
}

impl DevDense {
    fn weights(&self) -> DenseWeights<'_> {
        match self {
            DevDense::Bf16(w) => DenseWeights::Bf16(w),
            DevDense::Fp8(codes, scales) => DenseWeights::Fp8 { codes, scales },
        }
    }
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

    fn rmsnorm(&mut self, rows: usize, dim: usize) -> Result<()> {
        let x = self.rng.normals(rows * dim, 2.0);
        let w: Vec<f32> = (0..dim).map(|_| 1.0 + 0.1 * self.rng.normal()).collect();
        let (x_d, w_d) = (upload(self.dev, &x)?, upload(self.dev, &w)?);
        let want = rmsnorm_f32w_ref(&x, &w, 1e-5);
        let mut o32 = poisoned32(self.dev, rows * dim)?;
        launch_rmsnorm_f32w(
            self.dev,
            &x_d,
            &w_d,
            NormOut::F32(&mut o32),
            rows,
            dim,
            1e-5,
        )?;
        let got = download(self.dev, &o32)?;
        self.record(
            "rmsnorm_f32w",
            format!("{rows} x {dim}"),
            &got[..want.len()],
            &want,
            1e-5,
        );
        let mut o16 = poisoned16(self.dev, rows * dim)?;
        launch_rmsnorm_f32w(
            self.dev,
            &x_d,
            &w_d,
            NormOut::Bf16(&mut o16),
            rows,
            dim,
            1e-5,
        )?;
        let got = widen(&download(self.dev, &o16)?);
        self.record(
            "rmsnorm_f32w_bf16out",
            format!("{rows} x {dim}"),
            &got[..want.len()],
            &round_bf16(&want),
            1e-4,
        );
        Ok(())
    }

    fn swiglu(&mut self, n: usize, inter: usize) -> Result<()> {
        let gu = self.rng.normals(2 * n * inter, 2.0);
        let gu_d = upload(self.dev, &gu)?;
        let mut out = poisoned16(self.dev, n * inter)?;
        launch_swiglu_bf16(self.dev, &gu_d, &mut out, n, inter)?;
        let got = widen(&download(self.dev, &out)?);
        let want = round_bf16(&swiglu_interleaved_ref(&gu));
        self.record(
            "swiglu_bf16out",
            format!("{n} x {inter}"),
            &got[..want.len()],
            &want,
            1e-4,
        );
        Ok(())
    }

    fn gemv_accum(&mut self, cfg: GemvConfig, n: usize, k: usize) -> Result<()> {
        let w = self.rng.bf16s(n * k, 0.02);
        let x = self.rng.normals(k, 1.0);
        let y0 = self.rng.normals(n, 1.0);
        let (w_d, x_d) = (upload(self.dev, &w)?, upload(self.dev, &x)?);
        let mut y = upload(self.dev, &y0)?;
        launch_gemv_accum(self.dev, cfg, &w_d, &x_d, &mut y, n, k)?;
        let got = download(self.dev, &y)?;
        let want: Vec<f32> = gemv_ref(&w, &x, n, k)
            .iter()
            .zip(&y0)
            .map(|(a, b)| a + b)
            .collect();
        self.record("gemv_accum", format!("{cfg} [{n}, {k}]"), &got, &want, 1e-5);
        Ok(())
    }

    /// The decode step's fused GEMVs: RMSNorm in (optional), plain / accumulate / SwiGLU out.
    fn gemv_fused(
        &mut self,
        cfg: GemvConfig,
        n: usize,
        k: usize,
        norm: bool,
        fusion: GemvFusion,
    ) -> Result<()> {
        let w = self.rng.bf16s(n * k, 0.02);
        let x = self.rng.normals(k, 3.0);
        let g: Vec<f32> = (0..k).map(|_| 1.0 + 0.1 * self.rng.normal()).collect();
        let out_n = if fusion.swiglu { n / 2 } else { n };
        let y0 = if fusion.accumulate {
            self.rng.normals(out_n, 1.0)
        } else {
            vec![f32::NAN; out_n]
        };
        let (w_d, x_d, g_d) = (
            upload(self.dev, &w)?,
            upload(self.dev, &x)?,
            upload(self.dev, &g)?,
        );
        let mut y = upload(self.dev, &y0)?;
        let eps = 1e-5;
        launch_gemv_fused(
            self.dev,
            cfg,
            fusion,
            &w_d,
            &x_d,
            norm.then_some((&g_d, eps)),
            &mut y,
            n,
            k,
        )?;
        let got = download(self.dev, &y)?;
        let xin = if norm {
            rmsnorm_f32w_ref(&x, &g, eps)
        } else {
            x
        };
        let mut want = gemv_ref(&w, &xin, n, k);
        if fusion.swiglu {
            want = swiglu_interleaved_ref(&want);
        }
        if fusion.accumulate {
            want.iter_mut().zip(&y0).for_each(|(a, b)| *a += b);
        }
        self.record(
            "gemv_fused",
            format!("{cfg} [{n}, {k}] norm {norm} {fusion:?}"),
            &got,
            &want,
            1e-5,
        );
        Ok(())
    }

    /// A random [n, k] matrix for the chained-norm cases — BF16, or FP8 codes with row scales —
    /// on the host and the device.
    fn dense_matrix(&mut self, fp8: bool, n: usize, k: usize) -> Result<(HostDense, DevDense)> {
        Ok(if fp8 {
            let codes = self.rng.fp8s(n * k);
            let scales: Vec<f32> = (0..n)
                .map(|_| 1e-3 * (0.5 + self.rng.unit() as f32))
                .collect();
            let dev = DevDense::Fp8(upload(self.dev, &codes)?, upload(self.dev, &scales)?);
            (HostDense::Fp8(codes, scales), dev)
        } else {
            let w = self.rng.bf16s(n * k, 0.02);
            let dev = DevDense::Bf16(upload(self.dev, &w)?);
            (HostDense::Bf16(w), dev)
        })
    }

    /// The RMSNorm chained through the GEMVs: an accumulating GEMV leaves the next norm's input
    /// (h = y ∘ g, Σy²; launched twice: the last-block counter must come back to zero), and the
    /// consuming GEMV (plain or SwiGLU) scales by the norm; against the CPU references. `fp8`:
    /// both matrices FP8 codes as stored (`gemv_fp8_accum_norm`, `gemv_fp8_prenorm`).
    fn gemv_norm_chain(&mut self, cfg: GemvConfig, n: usize, k: usize, fp8: bool) -> Result<()> {
        let eps = 1e-5;
        // Producer: y [k] += W1 [k, n] a, then h = y ∘ g.
        let (w1, w1_d) = self.dense_matrix(fp8, k, n)?;
        let a = self.rng.normals(n, 3.0);
        let y0 = self.rng.normals(k, 1.0);
        let g: Vec<f32> = (0..k).map(|_| 1.0 + 0.1 * self.rng.normal()).collect();
        let (a_d, g_d) = (upload(self.dev, &a)?, upload(self.dev, &g)?);
        let mut y = upload(self.dev, &y0)?;
        let mut h = poisoned32(self.dev, k)?;
        let mut acc = upload(self.dev, &[u64::MAX, 0, u64::MAX])?; // slot 1, neighbours untouched
        let mut ss_runs = Vec::new();
        for run in 0..2 {
            if run == 1 {
                y = upload(self.dev, &y0)?;
                acc = upload(self.dev, &[u64::MAX, 0, u64::MAX])?;
            }
            let next = NextNorm {
                g: &g_d,
                h: &mut h,
                acc: &mut acc,
                slot: 1,
            };
            launch_gemv_accum_norm(self.dev, cfg, w1_d.weights(), &a_d, &mut y, k, n, next)?;
            ss_runs.push(download(self.dev, &acc)?);
        }
        let mut want_y = w1.matvec(&a, k, n)?;
        want_y.iter_mut().zip(&y0).for_each(|(v, b)| *v += b);
        let want_h: Vec<f32> = want_y.iter().zip(&g).map(|(v, g)| v * g).collect();
        let want_ss = want_y.iter().map(|&v| v as f64 * v as f64).sum::<f64>() as f32;
        let desc = format!("{cfg} [{k}, {n}]{}", if fp8 { " fp8" } else { "" });
        let got_y = download(self.dev, &y)?;
        let got_h = download(self.dev, &h)?;
        self.record("gemv_accum_norm_y", desc.clone(), &got_y, &want_y, 1e-5);
        self.record("gemv_accum_norm_h", desc.clone(), &got_h, &want_h, 1e-5);
        let got_ss: Vec<f32> = ss_runs
            .iter()
            .map(|a| (a[1] as f64 / SS_ONE) as f32)
            .collect();
        self.record(
            "gemv_accum_norm_ss",
            desc.clone(),
            &got_ss,
            &[want_ss; 2],
            1e-5,
        );
        // Deterministic (integer sums), and only the given slot written.
        let same =
            ss_runs[0] == ss_runs[1] && ss_runs[0][0] == u64::MAX && ss_runs[0][2] == u64::MAX;
        let c = if same { 0.0 } else { 1.0 };
        self.record("gemv_accum_norm_deterministic", desc, &[c], &[0.0], 0.0);
        // Consumers of (h, ss): W2 [m, k] · rmsnorm(y; g), plain and SwiGLU pairs.
        let m = 2 * n;
        let (w2, w2_d) = self.dense_matrix(fp8, m, k)?;
        let want = w2.matvec(&rmsnorm_f32w_ref(&want_y, &g, eps), m, k)?;
        for fusion in [
            GemvFusion::default(),
            GemvFusion {
                accumulate: false,
                swiglu: true,
            },
        ] {
            let cfg = if fusion.swiglu {
                entrollm_cuda::linear::swiglu_config(cfg)
            } else {
                cfg
            };
            let out_n = if fusion.swiglu { m / 2 } else { m };
            let mut out = poisoned32(self.dev, out_n)?;
            let norm = ChainedNorm {
                acc: &acc,
                slot: 1,
                eps,
            };
            let w = w2_d.weights();
            launch_gemv_prenorm(self.dev, cfg, fusion, w, &h, norm, &mut out, m, k)?;
            let want = if fusion.swiglu {
                swiglu_interleaved_ref(&want)
            } else {
                want.clone()
            };
            let got = download(self.dev, &out)?;
            let fp8 = if fp8 { " fp8" } else { "" };
            let desc = format!("{cfg} [{m}, {k}] {fusion:?}{fp8}");
            self.record("gemv_prenorm", desc, &got, &want, 1e-5);
        }
        Ok(())
    }

    fn gemm(&mut self, gemm: &Gemm, m: usize, n: usize, k: usize, acc: bool) -> Result<()> {
        let w = self.rng.bf16s(n * k, 0.05);
        let x = self.rng.bf16s(m * k, 1.0);
        let y0 = if acc {
            self.rng.normals(m * n, 1.0)
        } else {
            vec![f32::NAN; m * n]
        };
        let (w_d, x_d) = (upload(self.dev, &w)?, upload(self.dev, &x)?);
        let mut y = upload(self.dev, &y0)?;
        gemm.matmul(&w_d, &x_d, &mut y, m, n, k, acc)?;
        let got = download(self.dev, &y)?;
        let want = gemm_ref(&w, &x, acc.then_some(&y0[..]), m, n, k);
        let kind = if acc { "gemm_lt_accumulate" } else { "gemm_lt" };
        self.record(kind, format!("m {m} n {n} k {k}"), &got, &want, 1e-4);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn rope_append(
        &mut self,
        n: usize,
        nq: usize,
        nkv: usize,
        hd: usize,
        layout: RopeLayout,
        bias: bool,
        start: usize,
        bf16_q: bool,
    ) -> Result<()> {
        let s = QkvShape {
            n_q_heads: nq,
            n_kv_heads: nkv,
            head_dim: hd,
            layout,
        };
        let max_seq = start + n + 3;
        let qkv = self.rng.normals(n * s.width(), 1.0);
        let b = bias.then(|| self.rng.normals(s.width(), 0.5));
        let inv_freq: Vec<f64> = (0..hd / 2)
            .map(|i| 10000f64.powf(-(2.0 * i as f64) / hd as f64))
            .collect();
        let qkv_d = upload(self.dev, &qkv)?;
        let b_d = match &b {
            Some(b) => Some(upload(self.dev, b)?),
            None => None,
        };
        let f_d = upload(self.dev, &rope_table(&inv_freq, max_seq))?;
        let pos_d = upload(self.dev, &[start as i32])?;
        let mut kc = poisoned16(self.dev, max_seq * s.kv_dim())?;
        let mut vc = poisoned16(self.dev, max_seq * s.kv_dim())?;
        let (want_q, want_k, want_v) =
            rope_append_ref(s, &qkv, b.as_deref(), start as i32, &inv_freq);
        let got_q = if bf16_q {
            let mut q = poisoned16(self.dev, n * s.q_dim())?;
            launch_rope_append(
                self.dev,
                s,
                &qkv_d,
                b_d.as_ref(),
                QOut::Bf16(&mut q),
                &mut kc,
                &mut vc,
                &pos_d,
                &f_d,
                n,
                max_seq,
            )?;
            widen(&download(self.dev, &q)?)
        } else {
            let mut q = poisoned32(self.dev, n * s.q_dim())?;
            launch_rope_append(
                self.dev,
                s,
                &qkv_d,
                b_d.as_ref(),
                QOut::F32(&mut q),
                &mut kc,
                &mut vc,
                &pos_d,
                &f_d,
                n,
                max_seq,
            )?;
            download(self.dev, &q)?
        };
        let desc = format!(
            "n {n} h {nq}/{nkv}x{hd} {layout:?} bias {bias} start {start}{}",
            if bf16_q { " bf16q" } else { "" }
        );
        let (want_q, tol) = if bf16_q {
            (round_bf16(&want_q), 1e-4)
        } else {
            (want_q, 1e-5)
        };
        self.record(
            "rope_append_q",
            desc.clone(),
            &got_q[..want_q.len()],
            &want_q,
            tol,
        );
        let kd = s.kv_dim();
        let rows = start * kd..(start + n) * kd;
        let got_k = widen(&download(self.dev, &kc)?[rows.clone()]);
        let got_v = widen(&download(self.dev, &vc)?[rows]);
        self.record(
            "rope_append_k",
            desc.clone(),
            &got_k,
            &round_bf16(&want_k),
            1e-4,
        );
        self.record("rope_append_v", desc, &got_v, &round_bf16(&want_v), 1e-4);
        Ok(())
    }

    /// The q/k/v GEMV with RoPE and the KV append in its epilogue: the same bits as the plain GEMV
    /// followed by `rope_append` (both on the GPU), and within 1e-5 of the CPU references.
    #[allow(clippy::too_many_arguments)]
    fn gemv_rope(
        &mut self,
        cfg: GemvConfig,
        nq: usize,
        nkv: usize,
        hd: usize,
        k: usize,
        layout: RopeLayout,
        bias: bool,
        start: usize,
    ) -> Result<()> {
        let s = QkvShape {
            n_q_heads: nq,
            n_kv_heads: nkv,
            head_dim: hd,
            layout,
        };
        let (n, max_seq) = (s.width(), start + 4);
        let w = self.rng.bf16s(n * k, 0.02);
        let x = self.rng.normals(k, 3.0);
        let b = bias.then(|| self.rng.normals(n, 0.5));
        let inv_freq: Vec<f64> = (0..hd / 2)
            .map(|i| 500000f64.powf(-(2.0 * i as f64) / hd as f64))
            .collect();
        let (w_d, x_d) = (upload(self.dev, &w)?, upload(self.dev, &x)?);
        let b_d = match &b {
            Some(b) => Some(upload(self.dev, b)?),
            None => None,
        };
        let f_d = upload(self.dev, &rope_table(&inv_freq, max_seq))?;
        let pos_d = upload(self.dev, &[start as i32])?;
        let kd = s.kv_dim();
        let mut out = Vec::new(); // (q, k row, v row) of the fused and the split path
        for fused in [true, false] {
            let mut q = poisoned32(self.dev, s.q_dim())?;
            let mut kc = poisoned16(self.dev, max_seq * kd)?;
            let mut vc = poisoned16(self.dev, max_seq * kd)?;
            if fused {
                let t = RopeTargets {
                    q: &mut q,
                    k_cache: &mut kc,
                    v_cache: &mut vc,
                    pos: &pos_d,
                    cos_sin: &f_d,
                    max_seq,
                };
                launch_gemv_rope(self.dev, cfg, &w_d, &x_d, k, None, s, b_d.as_ref(), t)?;
            } else {
                let mut qkv = poisoned32(self.dev, n)?;
                launch_gemv_fused(
                    self.dev,
                    cfg,
                    GemvFusion::default(),
                    &w_d,
                    &x_d,
                    None,
                    &mut qkv,
                    n,
                    k,
                )?;
                launch_rope_append(
                    self.dev,
                    s,
                    &qkv,
                    b_d.as_ref(),
                    QOut::F32(&mut q),
                    &mut kc,
                    &mut vc,
                    &pos_d,
                    &f_d,
                    1,
                    max_seq,
                )?;
            }
            let row = start * kd..(start + 1) * kd;
            out.push((
                download(self.dev, &q)?,
                widen(&download(self.dev, &kc)?[row.clone()]),
                widen(&download(self.dev, &vc)?[row]),
            ));
        }
        let qkv_ref = gemv_ref(&w, &x, n, k);
        let (want_q, want_k, want_v) =
            rope_append_ref(s, &qkv_ref, b.as_deref(), start as i32, &inv_freq);
        let desc = format!("{cfg} h {nq}/{nkv}x{hd} k {k} {layout:?} bias {bias} pos {start}");
        let (f, p) = (&out[0], &out[1]);
        let same = |a: &[f32], b: &[f32]| {
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()) && a.len() == b.len()
        };
        let bits_equal = same(&f.0, &p.0) && same(&f.1, &p.1) && same(&f.2, &p.2);
        let flag = [if bits_equal { 0.0 } else { 1.0 }];
        self.record("gemv_rope_vs_split_bits", desc.clone(), &flag, &[0.0], 0.0);
        self.record("gemv_rope_q", desc.clone(), &f.0, &want_q, 1e-5);
        // The caches hold BF16: a product within f32 error of a rounding tie rounds to the other
        // neighbour than the f64 reference's, one element off by an ulp (2^-8..2^-7 of it), up to
        // ≈ 1e-3 of the row's norm for a large element (a k row of 1024 measured 2.6e-4 once).
        // A wrong rotation or row is off by far more.
        let tol = 2e-3;
        self.record("gemv_rope_k", desc.clone(), &f.1, &round_bf16(&want_k), tol);
        self.record("gemv_rope_v", desc, &f.2, &round_bf16(&want_v), tol);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn flash(
        &mut self,
        n: usize,
        start: usize,
        nq: usize,
        nkv: usize,
        hd: usize,
        q_scale: f32,
        mask: AttnMask,
    ) -> Result<()> {
        let s = PrefillShape {
            n_tokens: n,
            start,
            n_q_heads: nq,
            n_kv_heads: nkv,
            head_dim: hd,
            max_seq: start + n + 5,
        };
        let row = nkv * hd;
        let q = self.rng.bf16s(n * nq * hd, q_scale);
        let kc = self.rng.bf16s(s.max_seq * row, 1.0);
        let vc = self.rng.bf16s(s.max_seq * row, 1.0);
        let (q_d, k_d, v_d) = (
            upload(self.dev, &q)?,
            upload(self.dev, &kc)?,
            upload(self.dev, &vc)?,
        );
        let mut out = poisoned16(self.dev, n * nq * hd)?;
        let scale = 1.0 / (hd as f32).sqrt();
        launch_flash_prefill(self.dev, s, &q_d, &k_d, &v_d, &mut out, scale, mask, None)?;
        let got = widen(&download(self.dev, &out)?);
        let want = prefill_attention_ref(s, &q, &kc, &vc, scale, mask);
        self.record(
            "flash_prefill",
            format!("n {n} start {start} h {nq}/{nkv}x{hd} qscale {q_scale}{mask}"),
            &got[..want.len()],
            &want,
            1e-2,
        );
        Ok(())
    }

    /// Decode attention with the engine's short-chunk, preloading configuration.
    fn attn_decode(
        &mut self,
        hd: usize,
        nq: usize,
        nkv: usize,
        max_seq: usize,
        len: usize,
        mask: AttnMask,
    ) -> Result<()> {
        let cfg = decode_attn_config(hd, nq, nkv)?;
        let shape = KvShape {
            n_q_heads: nq,
            n_kv_heads: nkv,
            max_seq,
        };
        let kc = self.rng.bf16s(max_seq * nkv * hd, 1.0);
        let vc = self.rng.bf16s(max_seq * nkv * hd, 1.0);
        let q = self.rng.normals(nq * hd, 1.0);
        let (k_d, v_d, q_d) = (
            upload(self.dev, &kc)?,
            upload(self.dev, &vc)?,
            upload(self.dev, &q)?,
        );
        let len_d = upload(self.dev, &[len as i32])?;
        let mut scratch = AttnScratch::new(self.dev, cfg, nq, max_seq)?;
        let mut out = poisoned32(self.dev, nq * hd)?;
        let scale = 1.0 / (hd as f32).sqrt();
        launch_attention_decode(
            self.dev,
            cfg,
            shape,
            &q_d,
            &k_d,
            &v_d,
            &len_d,
            &mut scratch,
            &mut out,
            scale,
            mask,
            None,
        )?;
        let got = download(self.dev, &out)?;
        let want = attention_masked_ref(&q, &kc, &vc, len, (nq, nkv, hd), scale, mask);
        self.record(
            "attention_decode_c64",
            format!("h {nq}/{nkv}x{hd} len {len}/{max_seq}{mask}"),
            &got,
            &want,
            1e-4,
        );
        // The fused form twice in a row (its counters must be left at zero by the first launch).
        for rep in 0..2 {
            let mut out = poisoned32(self.dev, nq * hd)?;
            launch_attention_decode_fused(
                self.dev,
                cfg,
                shape,
                &q_d,
                &k_d,
                &v_d,
                &len_d,
                &mut scratch,
                &mut out,
                scale,
                mask,
                None,
            )?;
            let got = download(self.dev, &out)?;
            self.record(
                "attention_decode_fused",
                format!("h {nq}/{nkv}x{hd} len {len}/{max_seq} launch {rep}{mask}"),
                &got,
                &want,
                1e-4,
            );
        }
        Ok(())
    }

    fn finish_step(&mut self) -> Result<()> {
        let tok = upload(self.dev, &[42i32])?;
        let mut hist = upload(self.dev, &[-1i32; 8])?;
        let mut pos = upload(self.dev, &[4i32])?;
        let mut len = upload(self.dev, &[5i32])?;
        let mut acc = upload(self.dev, &[7u64; 70])?;
        launch_finish_step(
            self.dev, &tok, &mut hist, true, &mut pos, &mut len, &mut acc,
        )?;
        launch_finish_step(
            self.dev, &tok, &mut hist, false, &mut pos, &mut len, &mut acc,
        )?;
        let h = download(self.dev, &hist)?;
        let ok = h[5] == 42
            && h[6] == -1
            && download(self.dev, &pos)?[0] == 6
            && download(self.dev, &len)?[0] == 7
            && download(self.dev, &acc)?.iter().all(|&a| a == 0);
        self.cases.push(CaseResult {
            kernel: "finish_step".into(),
            shape: "record + advance + clear".into(),
            rel_l2: if ok { 0.0 } else { f64::INFINITY },
            tolerance: 0.0,
        });
        Ok(())
    }
}

/// A small model with q/k/v biases and interleaved RoPE (Qwen2-like), built on the host from the
/// synth distribution: head_dim 64, GQA 4/2, two layers.
fn small_model(seed: u64) -> Result<ModelWeights> {
    let mut c = SynthShape::Tiny.config();
    c.arch = Arch::Qwen2;
    c.hidden_size = 256;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 64;
    c.intermediate_size = 520;
    c.vocab_size = 1003;
    c.max_position_embeddings = 4096;
    c.rope_style = RopeStyle::Interleaved;
    c.attention_bias = true;
    let mut mats = std::collections::HashMap::new();
    let mut vecs = std::collections::HashMap::new();
    for t in tensors(&c) {
        let cols = *t.shape.last().unwrap_or(&1);
        let rows = if t.shape.len() == 1 { 1 } else { t.shape[0] };
        let mut data = vec![0f32; rows * cols];
        for (r, row) in data.chunks_mut(cols).enumerate() {
            fill_row(&t, seed, r, row);
        }
        match t.kind {
            SynthKind::Norm => {
                vecs.insert(t.name.clone(), data);
            }
            SynthKind::Matrix { .. } => {
                // Larger weights than the synth's σ so activations do not vanish in two layers.
                let bits = data.iter().map(|&v| f32_to_bf16(v * 4.0)).collect();
                let m = CpuDenseBf16::new(&t.name, rows, cols, bits)
                    .map_err(|e| GpuError::invalid("selftest", e.to_string()))?;
                mats.insert(t.name.clone(), Arc::new(m) as Arc<dyn Linear>);
            }
        }
    }
    let mut rng = Rng::new(seed ^ 0xB1A5);
    let m = |n: &str| Arc::clone(&mats[n]);
    let layers = (0..c.num_layers)
        .map(|l| {
            let p = |role: Role| tensor_name(role, l);
            LayerWeights {
                attn_norm: vecs[&p(Role::AttnNorm)].clone(),
                q: m(&p(Role::Q)),
                k: m(&p(Role::K)),
                v: m(&p(Role::V)),
                o: m(&p(Role::O)),
                q_bias: Some(rng.normals(c.q_dim(), 0.3)),
                k_bias: Some(rng.normals(c.kv_dim(), 0.3)),
                v_bias: Some(rng.normals(c.kv_dim(), 0.3)),
                mlp_norm: vecs[&p(Role::MlpNorm)].clone(),
                mlp: Mlp::Gated(GatedMlp {
                    gate: m(&p(Role::Gate)),
                    up: m(&p(Role::Up)),
                    down: m(&p(Role::Down)),
                }),
                norms: Default::default(),
            }
        })
        .collect();
    let w = ModelWeights {
        embed: m(&tensor_name(Role::Embed, 0)),
        lm_head: m(&tensor_name(Role::LmHead, 0)),
        final_norm: vecs[&tensor_name(Role::FinalNorm, 0)].clone(),
        layers,
        config: c,
    };
    w.validate()
        .map_err(|e| GpuError::invalid("selftest", e.to_string()))?;
    Ok(w)
}

/// `w` with every matrix but the embedding stored as an FP8 checkpoint holds it: E4M3 codes with
/// per-row scales, the row's largest magnitude mapped to `top` (448: the format's range; small
/// values push most codes to the few near zero, as in a low-entropy checkpoint).
/// `w` with its layer matrices (and, with `head`, its LM head) as FP8 E4M3 with row scales whose
/// row maxima map to `top`.
fn fp8_weights(w: ModelWeights, top: f32, head: bool) -> Result<ModelWeights> {
    use entrollm_codec::payload::f32_to_fp8_e4m3;
    use entrollm_model::weights::{DenseFp8, RowScaled};
    let fp8 = |m: &Arc<dyn Linear>| -> Result<Arc<dyn Linear>> {
        let (rows, cols) = (m.rows(), m.cols());
        let mut codes = Vec::with_capacity(rows * cols);
        let mut scales = Vec::with_capacity(rows);
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            m.row(r, &mut row);
            let max = row.iter().fold(0f32, |a, &v| a.max(v.abs()));
            let s = if max > 0.0 { max / top } else { 1.0 };
            scales.push(s);
            codes.extend(row.iter().map(|&v| f32_to_fp8_e4m3(v / s)));
        }
        let d = DenseFp8::new("fp8", rows, cols, codes).map_err(model_err)?;
        Ok(Arc::new(
            RowScaled::new("fp8", Arc::new(d), scales).map_err(model_err)?,
        ))
    };
    let layers = w
        .layers
        .iter()
        .map(|l| l.map_matrices(|_, _, m| fp8(m)))
        .collect::<Result<Vec<_>>>()?;
    Ok(ModelWeights {
        lm_head: if head { fp8(&w.lm_head)? } else { w.lm_head },
        embed: w.embed,
        final_norm: w.final_norm,
        layers,
        config: w.config,
    })
}

fn model_err(e: entrollm_model::ModelError) -> GpuError {
    GpuError::invalid("cpu engine", e.to_string())
}

/// An FP8 checkpoint served as `form` (`Dense`: in FP8 where the columns are a multiple of 16;
/// `Palette`: palette-packed where they are a multiple of 64): its decode graph with and without
/// programmatic edges ([`compare_pdl`], the prompt's first 300 tokens, 16 steps), then against the
/// CPU engine: how many layer/head matrices the upload kept so, and the logits
/// ([`compare_logits`], tolerance 5e-2).
fn fp8_served_case(
    dev: &Arc<GpuDevice>,
    label: &str,
    w: ModelWeights,
    form: Fp8Serving,
    prompt: &[u32],
    cases: &mut Vec<CaseResult>,
) -> Result<()> {
    compare_pdl(
        dev,
        label,
        || Ok(GpuModel::upload_served(dev, &w, form.into())?.0),
        &prompt[..300],
        16,
        cases,
    )?;
    let served = GpuModel::upload_served(dev, &w, form.into())?.0;
    // A BF16 head beside palette-packed layers is palette-packed too (its columns allowing).
    let head_bf16 = !entrollm_cuda::forms::is_fp8(&*w.lm_head);
    if head_bf16 && form == Fp8Serving::Palette {
        let packed = served.lm_head_form() == Some("bf16-palette");
        cases.push(CaseResult {
            kernel: "lm_head_palette_bf16".into(),
            shape: format!("{label}: BF16 LM head palette-packed: {packed}"),
            rel_l2: if packed { 0.0 } else { f64::INFINITY },
            tolerance: 0.0,
        });
    }
    let by = served.matrices_by_form();
    let n = |f: &str| by.get(f).copied().unwrap_or(0);
    let (kernel, got, multiple) = match form {
        Fp8Serving::Palette => (
            "fp8_palette_matrices",
            n("fp8-palette"),
            entrollm_codec::palette::BLOCK_COLS,
        ),
        _ => ("fp8_served_matrices", n("fp8") + n("fp8-palette"), 16),
    };
    drop(served);
    let fits = |m: &Arc<dyn Linear>| usize::from(m.cols() % multiple == 0);
    let expected = if head_bf16 { 0 } else { fits(&w.lm_head) }
        + w.layers
            .iter()
            .map(|l| {
                let g = l.gated().expect("the selftest's models are dense");
                fits(&l.q) + fits(&l.o) + fits(&g.gate) + fits(&g.down)
            })
            .sum::<usize>();
    cases.push(CaseResult {
        kernel: kernel.into(),
        shape: format!("{got} layer/head matrices kept {form:?}, {expected} expected"),
        rel_l2: if got == expected && expected > 0 {
            0.0
        } else {
            f64::INFINITY
        },
        tolerance: 0.0,
    });
    compare_logits(dev, label, w, Some(form.into()), prompt, 4, 5e-2, cases)
}

/// Every launch configuration a tune file may choose, in the engine: the model of `weights()`
/// served as `serving` says, then once per k with every launch in its k-th configuration
/// ([`Serving::launches`]; k up to the most any launch's form has, a launch with fewer cycling
/// through its own), each against the CPU engine ([`compare_logits`]): the decode step's fused
/// variants (norm, RoPE, SwiGLU, residual) and prefill in every configuration.
fn launch_configs_case(
    dev: &Arc<GpuDevice>,
    label: &str,
    weights: impl Fn() -> Result<ModelWeights>,
    serving: Serving,
    prompt: &[u32],
    tol: f64,
    cases: &mut Vec<CaseResult>,
) -> Result<()> {
    let m = GpuModel::upload_served(dev, &weights()?, serving.clone())?.0;
    let mut launches: Vec<(String, Vec<String>)> = Vec::new();
    for (i, l) in m.layers.iter().enumerate() {
        for (s, g) in [
            ("qkv", &l.qkv),
            ("o", &l.o),
            ("gate_up", &l.gate_up),
            ("down", &l.down),
        ] {
            launches.push((format!("layers.{i}.{s}"), g.launch_configs()));
        }
    }
    if let Some(h) = &m.lm_head {
        launches.push(("lm_head".into(), h.launch_configs()));
    }
    drop(m);
    let most = launches.iter().map(|(_, c)| c.len()).max().unwrap_or(0);
    for k in 0..most {
        let choices: entrollm_cuda::linear::LaunchChoices = launches
            .iter()
            .filter(|(_, c)| !c.is_empty())
            .map(|(id, c)| (id.clone(), c[k % c.len()].clone()))
            .collect();
        let first = choices.get("layers.0.qkv").unwrap_or("-").to_string();
        let served = Serving {
            launches: choices,
            ..serving.clone()
        };
        let label = format!("{label}, launch configs #{k} (qkv {first})");
        compare_logits(dev, &label, weights()?, Some(served), prompt, 3, tol, cases)?;
    }
    cases.push(CaseResult {
        kernel: "launch_configs".into(),
        shape: format!("{label}: {most} configurations of the most-configurable launch"),
        rel_l2: if most > 1 { 0.0 } else { f64::INFINITY },
        tolerance: 0.0,
    });
    Ok(())
}

/// A BF16 checkpoint served with its matrices palette-packed losslessly (`Serving::bf16_palette`:
/// every layer/head matrix whose columns are a multiple of 64, q/k/v stacked and gate/up
/// interleaved as packed; the residual-add and SwiGLU epilogues, prefill's copy to BF16): PDL vs
/// plain ([`compare_pdl`]), how many matrices are packed, and against the CPU engine (as the dense
/// BF16 case: the form is lossless).
fn bf16_palette_case(
    dev: &Arc<GpuDevice>,
    label: &str,
    w: ModelWeights,
    prompt: &[u32],
    tol: f64,
    cases: &mut Vec<CaseResult>,
) -> Result<()> {
    let serving = Serving {
        fp8: Fp8Serving::Auto,
        bf16_palette: true,
        ..Serving::default()
    };
    compare_pdl(
        dev,
        label,
        || Ok(GpuModel::upload_served(dev, &w, serving.clone())?.0),
        &prompt[..300],
        16,
        cases,
    )?;
    let got = GpuModel::upload_served(dev, &w, serving.clone())?
        .0
        .matrices_by_form()
        .get("bf16-palette")
        .copied()
        .unwrap_or(0);
    let fits =
        |m: &Arc<dyn Linear>| usize::from(m.cols() % entrollm_codec::palette::BLOCK_COLS == 0);
    let tied = Arc::ptr_eq(&w.embed, &w.lm_head);
    let expected = if tied { 0 } else { fits(&w.lm_head) }
        + w.layers
            .iter()
            .map(|l| {
                let g = l.gated().expect("the selftest's models are dense");
                fits(&l.q) + fits(&l.o) + fits(&g.gate) + fits(&g.down)
            })
            .sum::<usize>();
    cases.push(CaseResult {
        kernel: "bf16_palette_matrices".into(),
        shape: format!("{label}: {got} layer/head matrices packed, {expected} expected"),
        rel_l2: if got == expected && expected > 0 {
            0.0
        } else {
            f64::INFINITY
        },
        tolerance: 0.0,
    });
    compare_logits(dev, label, w, Some(serving), prompt, 4, tol, cases)
}

/// GPU vs CPU on one model: prefill logits of `prompt`, then logits after each of `steps` decode
/// tokens (greedy from the CPU), relative L2 each, worst reported. `served`: uploaded as a
/// checkpoint is served (`upload_served`: FP8 matrices stay FP8, kept so), else (None) every matrix
/// as BF16.
#[allow(clippy::too_many_arguments)]
fn compare_logits(
    dev: &Arc<GpuDevice>,
    label: &str,
    w: ModelWeights,
    served: Option<Serving>,
    prompt: &[u32],
    steps: usize,
    tol: f64,
    cases: &mut Vec<CaseResult>,
) -> Result<()> {
    let max_seq = prompt.len() + steps + 1;
    let gm = match served {
        Some(serving) => GpuModel::upload_served(dev, &w, serving)?.0,
        None => GpuModel::upload(dev, &w)?,
    };
    let mut ge = GpuEngine::new(Arc::clone(dev), gm, max_seq)?;
    let mut ce = Engine::new(w, max_seq).map_err(model_err)?;
    let want = ce.prefill(prompt).map_err(model_err)?;
    let got = ge.prefill(prompt)?;
    cases.push(CaseResult {
        kernel: "e2e_prefill_logits".into(),
        shape: format!("{label}: {} tokens", prompt.len()),
        rel_l2: rel_l2(&got, &want),
        tolerance: tol,
    });
    let mut worst = 0f64;
    let mut next = entrollm_model::sampler::argmax(&want).unwrap_or(0);
    for _ in 0..steps {
        let want = ce.step(next).map_err(model_err)?;
        let got = ge.step(next)?;
        let e = rel_l2(&got, &want);
        worst = if e.is_nan() {
            f64::INFINITY
        } else {
            worst.max(e)
        };
        next = entrollm_model::sampler::argmax(&want).unwrap_or(0);
    }
    cases.push(CaseResult {
        kernel: "e2e_decode_logits".into(),
        shape: format!("{label}: worst of {steps} graph steps"),
        rel_l2: worst,
        tolerance: tol,
    });
    Ok(())
}

/// The decode graph with programmatic dependent launch against the same graph with plain edges:
/// PDL changes only when kernels start, so the logits of every step must be bit-identical
/// (reported as relative L2, tolerance 0). Also fails when no edge became programmatic.
fn compare_pdl(
    dev: &Arc<GpuDevice>,
    label: &str,
    model: impl Fn() -> Result<GpuModel>,
    prompt: &[u32],
    steps: usize,
    cases: &mut Vec<CaseResult>,
) -> Result<()> {
    let max_seq = prompt.len() + steps + 1;
    let base = DecodeOptions::default();
    let mut engines = Vec::new();
    for pdl in [true, false] {
        let gm = model()?;
        let opts = DecodeOptions { pdl, ..base };
        engines.push(GpuEngine::with_options(Arc::clone(dev), gm, max_seq, opts)?);
    }
    if !engines[0]
        .decode_layout()
        .contains(", 0 programmatic edges")
    {
        let (a, b) = engines.split_at_mut(1);
        let (pdl, plain) = (&mut a[0], &mut b[0]);
        let mut next = entrollm_model::sampler::argmax(&plain.prefill(prompt)?).unwrap_or(0);
        pdl.prefill(prompt)?;
        let mut worst = 0f64;
        for _ in 0..steps {
            let want = plain.step(next)?;
            let got = pdl.step(next)?;
            let same = got.len() == want.len()
                && got
                    .iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits());
            worst = worst.max(if same {
                0.0
            } else {
                let e = rel_l2(&got, &want);
                if e.is_nan() || e == 0.0 {
                    f64::INFINITY
                } else {
                    e
                }
            });
            next = entrollm_model::sampler::argmax(&want).unwrap_or(0);
        }
        cases.push(CaseResult {
            kernel: "e2e_decode_pdl_vs_plain".into(),
            shape: format!(
                "{label}: {steps} graph steps ({})",
                engines[0].decode_layout()
            ),
            rel_l2: worst,
            tolerance: 0.0,
        });
    } else {
        cases.push(CaseResult {
            kernel: "e2e_decode_pdl_vs_plain".into(),
            shape: format!("{label}: no edge became programmatic"),
            rel_l2: f64::INFINITY,
            tolerance: 0.0,
        });
    }
    Ok(())
}

/// The prompts of the greedy-token comparison on SmolLM2.
pub const SMOLLM2_PROMPTS: [&str; 5] = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
    "The three primary colors are",
];

/// Greedy tokens of SmolLM2 on the GPU vs the CPU engine on the same BF16 weights. One line per
/// prompt goes to `notes`.
pub fn smollm2_greedy(
    dev: &Arc<GpuDevice>,
    path: &Path,
    n_new: usize,
    cases: &mut Vec<CaseResult>,
    notes: &mut Vec<String>,
) -> Result<()> {
    let (w, tok) = entrollm_model::load::open_model(path, false).map_err(model_err)?;
    let w = bf16_rounded(&w)?;
    let gm = GpuModel::upload(dev, &w)?;
    greedy_against_cpu(dev, "smollm2_greedy", w, gm, &tok, n_new, cases, notes)
}

/// A quantised GGUF served as its blocks (form `ggml`: `ggml_mv` for the steps, prefill through
/// their BF16 dequantisation) against the CPU engine on the same blocks: the logits of a prefill
/// and of 8 graph steps, then greedy tokens from each of [`SMOLLM2_PROMPTS`] as
/// [`smollm2_greedy`] judges them. Part `ggml` of `selftest --gpu`, for each `--gguf`.
pub fn gguf_served(
    dev: &Arc<GpuDevice>,
    path: &Path,
    n_new: usize,
    cases: &mut Vec<CaseResult>,
    notes: &mut Vec<String>,
) -> Result<()> {
    let (w, tok) = entrollm_model::load::open_model(path, false).map_err(model_err)?;
    let label = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let ids = tok
        .encode(
            "The quick brown fox jumps over the lazy dog. In 1905, Einstein",
            true,
        )
        .map_err(model_err)?;
    let served = Some(Serving::default());
    compare_logits(dev, &label, w.clone_shallow(), served, &ids, 8, 5e-2, cases)?;
    let (gm, r) = GpuModel::upload_served(dev, &w, Serving::default())?;
    notes.push(format!("{label}: launches served as held: {}", r.summary()));
    greedy_against_cpu(dev, "gguf_greedy", w, gm, &tok, n_new, cases, notes)
}

/// An HF checkpoint of integer matrices (GPTQ, AWQ, compressed-tensors pack-quantized) served as
/// their codes (form `int`: `int_mv` for the steps, prefill through their BF16 dequantisation)
/// against the CPU engine on the same codes: the logits of a prefill and of 8 graph steps from
/// fixed token ids (the checkpoint needs no tokenizer), and that some launch was served as codes.
/// Part `int` of `selftest --gpu`, for each `--hf`.
pub fn hf_int_served(
    dev: &Arc<GpuDevice>,
    dir: &Path,
    cases: &mut Vec<CaseResult>,
    notes: &mut Vec<String>,
) -> Result<()> {
    let w = entrollm_model::load::open_weights(dir, false).map_err(model_err)?;
    let label = dir.display().to_string();
    let vocab = w.config.vocab_size as u32;
    let ids: Vec<u32> = [1u32, 17, 42, 99, 5, 200, 77, 3, 128, 64]
        .iter()
        .map(|&t| t % vocab)
        .collect();
    let (gm, r) = GpuModel::upload_served(dev, &w, Serving::default())?;
    let n = r.taken();
    let ints = gm
        .desc(dev.info().sm_count)
        .layers
        .iter()
        .flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down])
        .filter(|d| d.form_name() == "int")
        .count();
    drop(gm);
    notes.push(format!(
        "{label}: {n} launches served as held, {ints} of them as integer codes"
    ));
    cases.push(CaseResult {
        kernel: "int_served".into(),
        shape: format!("{label}: {ints} launches as integer codes"),
        rel_l2: if ints > 0 { 0.0 } else { f64::INFINITY },
        tolerance: 0.0,
    });
    compare_logits(
        dev,
        &label,
        w,
        Some(Serving::default()),
        &ids,
        8,
        5e-2,
        cases,
    )
}

/// Greedy tokens of the CPU engine on `w` and of the GPU on `gm` (the same model) from each of
/// [`SMOLLM2_PROMPTS`]: a divergence passes only where the CPU's logits of the two tokens are
/// within 0.5 (a near-tie rounding decides).
#[allow(clippy::too_many_arguments)]
fn greedy_against_cpu(
    dev: &Arc<GpuDevice>,
    kernel: &str,
    w: ModelWeights,
    gm: GpuModel,
    tok: &entrollm_model::tokenizer::Tokenizer,
    n_new: usize,
    cases: &mut Vec<CaseResult>,
    notes: &mut Vec<String>,
) -> Result<()> {
    let max_seq = 256;
    let mut ce = Engine::new(w, max_seq).map_err(model_err)?;
    let mut ge = GpuEngine::new(Arc::clone(dev), gm, max_seq)?;
    for (i, prompt) in SMOLLM2_PROMPTS.iter().enumerate() {
        let ids = tok.encode(prompt, true).map_err(model_err)?;
        ce.reset();
        ge.reset();
        // CPU greedy with its logits kept, to judge a divergence.
        let mut cpu = Vec::new();
        let mut logits = ce.prefill(&ids).map_err(model_err)?;
        let mut cpu_logits = Vec::new();
        for _ in 0..n_new {
            let t = entrollm_model::sampler::argmax(&logits).unwrap_or(0);
            cpu.push(t);
            cpu_logits.push(logits.clone());
            logits = ce.step(t).map_err(model_err)?;
        }
        let gpu = ge.generate_greedy(&ids, n_new)?;
        let first_diff = cpu.iter().zip(&gpu).position(|(a, b)| a != b);
        let (ok, what) = match first_diff {
            None => (true, "identical".to_string()),
            Some(j) => {
                let l = &cpu_logits[j];
                let gap = l[cpu[j] as usize] - l[gpu[j] as usize];
                (
                    gap.abs() < 0.5,
                    format!(
                        "diverge at token {j}: cpu {} vs gpu {}, cpu logit gap {gap:.3} ({})",
                        cpu[j],
                        gpu[j],
                        if gap.abs() < 0.5 {
                            "near-tie"
                        } else {
                            "MISMATCH"
                        }
                    ),
                )
            }
        };
        notes.push(format!(
            "prompt {i} {prompt:?}: {what}; gpu text {:?}",
            tok.decode(&gpu).unwrap_or_default()
        ));
        cases.push(CaseResult {
            kernel: kernel.into(),
            shape: format!("prompt {i}, {n_new} tokens: {what}"),
            rel_l2: if ok { 0.0 } else { f64::INFINITY },
            tolerance: 0.0,
        });
    }
    Ok(())
}

trait CloneShallow {
    fn clone_shallow(&self) -> ModelWeights;
}

impl CloneShallow for ModelWeights {
    /// Another `ModelWeights` sharing every matrix (Arc clones).
    fn clone_shallow(&self) -> ModelWeights {
        ModelWeights {
            config: self.config.clone(),
            embed: Arc::clone(&self.embed),
            layers: self.layers.to_vec(),
            final_norm: self.final_norm.clone(),
            lm_head: Arc::clone(&self.lm_head),
        }
    }
}

/// The forward-pass selftest; `smollm2`: the GGUF for the end-to-end checks (skipped when None,
/// and said so in the notes). Returns the report and notes; Err([`GpuError::Selftest`]) on any
/// failure.
pub fn run_engine_selftest(
    dev: &Arc<GpuDevice>,
    seed: u64,
    smollm2: Option<&Path>,
) -> Result<(SelftestReport, Vec<String>)> {
    let mut c = Checker {
        dev,
        rng: Rng::new(seed ^ 0xE61E),
        cases: Vec::new(),
    };
    let mut notes = Vec::new();
    for &(rows, dim) in &[
        (1, 8),
        (1, 576),
        (3, 1000),
        (1, 4096),
        (17, 4096),
        (2, 5000),
    ] {
        c.rmsnorm(rows, dim)?;
    }
    for &(n, inter) in &[(1, 8), (3, 520), (7, 1536), (2, 14_336)] {
        c.swiglu(n, inter)?;
    }
    for cfg in GemvConfig::CANDIDATES {
        for &(n, k) in &[(1, 8), (37, 520), (129, 4104), (4096, 4096)] {
            c.gemv_accum(cfg, n, k)?;
        }
    }
    for cfg in GemvConfig::CANDIDATES {
        for &(n, k) in &[(2, 8), (38, 520), (130, 4104), (2048, 4096)] {
            c.gemv_fused(cfg, n, k, true, GemvFusion::default())?;
            c.gemv_fused(
                cfg,
                n,
                k,
                false,
                GemvFusion {
                    accumulate: true,
                    swiglu: false,
                },
            )?;
            if cfg.rows % 2 == 0 {
                c.gemv_fused(
                    cfg,
                    n,
                    k,
                    true,
                    GemvFusion {
                        accumulate: false,
                        swiglu: true,
                    },
                )?;
            }
        }
    }
    let gemm = Gemm::new(dev)?;
    for &(m, n, k) in &[
        (1, 8, 8),
        (37, 520, 192),
        (130, 960, 576),
        (300, 1000, 2048),
        (512, 6144, 4096),
    ] {
        c.gemm(&gemm, m, n, k, false)?;
        c.gemm(&gemm, m, n, k, true)?;
    }
    for layout in [RopeLayout::Neox, RopeLayout::Interleaved] {
        for &(n, nq, nkv, hd, bias, start) in &[
            (1, 1, 1, 2, false, 0),
            (1, 9, 3, 64, true, 17),
            (5, 32, 8, 128, false, 1000),
            (37, 4, 2, 64, true, 3),
        ] {
            c.rope_append(n, nq, nkv, hd, layout, bias, start, false)?;
            c.rope_append(n, nq, nkv, hd, layout, bias, start, true)?;
        }
    }
    for (i, &cfg) in GemvConfig::CANDIDATES.iter().enumerate() {
        let (n, k) = [(8, 16), (576, 1536), (4096, 14336), (520, 264)][i % 4];
        c.gemv_norm_chain(cfg, n, k, false)?;
        // FP8 rows are 16-byte chunks of 16 weights: both matrices need k and n multiples of 16.
        let (n, k) = [(16, 32), (576, 1536), (4096, 14336), (528, 272)][i % 4];
        c.gemv_norm_chain(cfg, n, k, true)?;
    }
    for layout in [RopeLayout::Neox, RopeLayout::Interleaved] {
        for (i, &cfg) in GemvConfig::CANDIDATES.iter().enumerate() {
            let (nq, nkv, hd, k, bias, start) = [
                (1, 1, 2, 8, false, 0),
                (9, 3, 64, 576, true, 17),
                (4, 2, 64, 264, true, 3),
                (32, 8, 128, 4096, false, 1000),
                // Phi-3-mini's heads of 96 (a warp's rotation pairs straddle heads).
                (4, 4, 96, 384, false, 5),
            ][i % 5];
            c.gemv_rope(cfg, nq, nkv, hd, k, layout, bias, start)?;
        }
    }
    for &(n, start, nq, nkv, hd, qs) in &[
        (1, 0, 1, 1, 64, 1.0),
        (7, 0, 9, 3, 64, 1.0),
        (64, 0, 4, 2, 64, 1.0),
        (130, 0, 9, 3, 64, 1.0),
        (37, 50, 4, 4, 64, 1.0),
        (1, 300, 8, 2, 128, 1.0),
        (200, 70, 8, 2, 128, 1.0),
        (129, 0, 4, 1, 128, 4.0),
        (300, 0, 32, 8, 128, 1.0),
        // Heads that are multiples of 32 but not of 64 (Phi-3-mini's 96), and 32 and 160.
        (130, 0, 4, 4, 96, 1.0),
        (37, 200, 32, 32, 96, 1.0),
        (65, 3, 8, 4, 32, 1.0),
        (100, 10, 8, 2, 160, 1.0),
    ] {
        c.flash(n, start, nq, nkv, hd, qs, AttnMask::NONE)?;
    }
    // The families' prefill attention: windows (ragged against the 64-key tiles), soft-caps, both,
    // head dims of Gemma (256).
    for &(n, start, nq, nkv, hd, window, cap) in &[
        (37, 0, 4, 2, 64, Some(5), None),
        (130, 20, 4, 2, 64, Some(64), None),
        (200, 70, 8, 4, 256, Some(100), Some(50.0)),
        (65, 0, 4, 4, 128, None, Some(3.0)),
        (129, 300, 8, 4, 256, Some(1), Some(30.0)),
        (300, 0, 16, 8, 128, Some(257), None),
        (150, 10, 4, 4, 96, Some(37), None),
    ] {
        let mask = AttnMask {
            window,
            softcap: cap,
            sinks: false,
        };
        c.flash(n, start, nq, nkv, hd, 2.0, mask)?;
    }
    for &(hd, nq, nkv) in &[
        (64, 9, 3),
        (128, 32, 8),
        (128, 8, 8),
        (96, 32, 32),
        (32, 8, 4),
        (160, 8, 2),
    ] {
        for &(max_seq, len) in &[
            (640, 1),
            (640, 63),
            (640, 64),
            (640, 65),
            (640, 600),
            (4100, 4100),
        ] {
            c.attn_decode(hd, nq, nkv, max_seq, len, AttnMask::NONE)?;
        }
    }
    // The families' decode attention: windows shorter, longer and across chunk edges, soft-caps,
    // both, Gemma's head dim.
    for &(hd, nq, nkv) in &[(64, 4, 2), (256, 8, 4), (96, 4, 2)] {
        for &(max_seq, len, window, cap) in &[
            (640, 1, Some(4), None),
            (640, 63, Some(1), Some(2.0)),
            (640, 65, Some(64), None),
            (640, 600, Some(100), Some(50.0)),
            (640, 600, None, Some(3.0)),
            (4100, 4100, Some(4096), Some(30.0)),
            (4100, 3000, Some(129), None),
        ] {
            let mask = AttnMask {
                window,
                softcap: cap,
                sinks: false,
            };
            c.attn_decode(hd, nq, nkv, max_seq, len, mask)?;
        }
    }
    c.finish_step()?;
    let mut cases = c.cases;
    // (The families beyond Llama are part `families`: crate::families_selftest::selftest.)
    // A small biased, interleaved-RoPE model: prefill over two chunks (2100 tokens), 4 steps.
    let w = small_model(seed)?;
    let vocab = w.config.vocab_size as u64;
    let mut rng = Rng::new(seed ^ 0x5A11);
    let prompt: Vec<u32> = (0..2100).map(|_| rng.below(vocab) as u32).collect();
    compare_pdl(
        dev,
        "small qwen2-like (bias, interleaved)",
        || GpuModel::upload(dev, &w),
        &prompt[..300],
        48,
        &mut cases,
    )?;
    // The 8B shape (multi-wave GEMVs, 4096-wide residual): two synthetic models on the device.
    if dev.info().total_memory_bytes >= 48 << 30 {
        let c = SynthShape::Llama31_8B.config();
        let ids: Vec<u32> = (0..200)
            .map(|_| rng.below(c.vocab_size as u64) as u32)
            .collect();
        let w =
            shared_layer_weights(&c, 0).map_err(|e| GpuError::invalid("synth", e.to_string()))?;
        compare_pdl(
            dev,
            "synthetic llama-3.1-8b",
            || GpuModel::upload(dev, &w),
            &ids,
            32,
            &mut cases,
        )?;
    } else {
        notes.push("under 48 GiB of device memory: the 8B PDL comparison skipped".into());
    }
    compare_logits(
        dev,
        "small qwen2-like (bias, interleaved)",
        w,
        None,
        &prompt,
        4,
        3e-2,
        &mut cases,
    )?;
    // Every launch configuration of the dense BF16, palette BF16, FP8 and palette FP8 GEMVs
    // (the dtANS launches: `coded_e2e_selftest`).
    let bf16_palette = Serving {
        bf16_palette: true,
        ..Serving::default()
    };
    for (what, top, serving) in [
        ("BF16", None, Serving::default()),
        ("BF16 palette-packed", None, bf16_palette),
        ("FP8", Some(448.0), Fp8Serving::Dense.into()),
        (
            "low-entropy FP8 palette-packed",
            Some(1.0 / 32.0),
            Fp8Serving::Palette.into(),
        ),
    ] {
        let weights = || match top {
            None => small_model(seed),
            Some(top) => fp8_weights(small_model(seed ^ 0xF9)?, top, true),
        };
        let label = format!("small qwen2-like, {what}");
        launch_configs_case(dev, &label, weights, serving, &prompt, 5e-2, &mut cases)?;
    }
    // The same model with its BF16 matrices palette-packed losslessly (`--bf16 palette`).
    bf16_palette_case(
        dev,
        "small qwen2-like, BF16 palette-packed",
        small_model(seed)?,
        &prompt,
        3e-2,
        &mut cases,
    )?;
    // The same architecture as an FP8 checkpoint, served with its matrices in FP8 (the FP8 GEMV
    // for decode, a BF16 copy and the GEMM for prefill) against the CPU engine on the same codes.
    // (Its down projection has 520 columns, not a multiple of 16: that one is served as BF16.)
    // Tolerance as for SmolLM2: besides the BF16 activations, prefill multiplies by each scaled
    // weight rounded to BF16, the CPU engine by the exact FP8 value times its scale (measured on
    // the H200: 2.9e-2 prefill, 2.5e-2 decode).
    let w8 = fp8_weights(small_model(seed ^ 0xF8)?, 448.0, true)?;
    fp8_served_case(
        dev,
        "small qwen2-like, FP8 E4M3 + row scales",
        w8,
        Fp8Serving::Dense,
        &prompt,
        &mut cases,
    )?;
    // The same architecture as a low-entropy FP8 checkpoint (row maxima at 2^-5: most codes are
    // zero and the subnormals), served palette-packed (every FP8 matrix whose columns are a
    // multiple of 64; escapes included).
    let wp = fp8_weights(small_model(seed ^ 0xF9)?, 1.0 / 32.0, true)?;
    fp8_served_case(
        dev,
        "small qwen2-like, low-entropy FP8, palette-packed",
        wp,
        Fp8Serving::Palette,
        &prompt,
        &mut cases,
    )?;
    // The same model with its LM head kept BF16, as FP8 checkpoints keep it: the head is served
    // palette-packed losslessly (`gemv_pal4_bf16`, the norm fused) beside the palette layers.
    let wh = fp8_weights(small_model(seed ^ 0xF9)?, 1.0 / 32.0, false)?;
    fp8_served_case(
        dev,
        "small qwen2-like, low-entropy FP8 + BF16 head, palette-packed",
        wh,
        Fp8Serving::Palette,
        &prompt,
        &mut cases,
    )?;
    match smollm2 {
        Some(path) => {
            let (w, tok) = entrollm_model::load::open_model(path, false).map_err(model_err)?;
            let w = bf16_rounded(&w)?;
            let ids = tok
                .encode(
                    "The quick brown fox jumps over the lazy dog. In 1905, Einstein",
                    true,
                )
                .map_err(model_err)?;
            compare_logits(dev, "SmolLM2-135M", w, None, &ids, 8, 5e-2, &mut cases)?;
            smollm2_greedy(dev, path, 24, &mut cases, &mut notes)?;
        }
        None => notes.push("SmolLM2 GGUF not found: end-to-end SmolLM2 checks skipped".into()),
    }
    let report = SelftestReport {
        device: format!("{} ({})", dev.info().name, dev.info().arch()),
        cases,
    };
    if report.failures().next().is_some() {
        return Err(GpuError::Selftest(format!(
            "{report}\n{}",
            notes.join("\n")
        )));
    }
    Ok((report, notes))
}

/// Tolerances of [`coded_e2e_selftest`] (relative L2 of the logits, coded vs dense, same weights).
/// Prefill dequantises bit-exactly and runs the same GEMMs; only the LM head (a batch-1 product
/// for the last token) runs the coded mvm instead of the GEMV: f32 sums in another order.
pub const E2E_PREFILL_TOL: f64 = 1e-5;
/// Decode steps replace the dense GEMV by the coded mvm: the same products in f32 summed in
/// another order (per-slice partial sums added with atomics), through two layers.
pub const E2E_STEP_TOL: f64 = 1e-4;

/// End to end, coded against dense: the model of [`e2e_config`] (layer 0 in both layers) coded at
/// load by [`GpuModel::upload_coded`] (the tuned plan, then the coder's choice; layer 1 a device
/// copy of layer 0's launches) and uploaded dense. Logits after a prefill and after decode
/// steps within [`E2E_PREFILL_TOL`] / [`E2E_STEP_TOL`], identical greedy tokens (32 after an
/// 8-token prompt), no stream error flagged. Then a container's layout ([`served_weights`]: q/k/v
/// and gate/up as separate coded tensors) served by [`GpuModel::upload_served`] (stacked q/k/v
/// launch, gate/up as halves) against [`GpuModel::upload`] of the same weights, same tolerances.
/// Then code at load ([`GpuModel::upload_coded`], tuned plan and auto) of the same weights dense:
/// GPU-coded against host-coded (identical arrays, bit-identical logits and tokens) and against the
/// dense model (same tolerances and tokens).
pub fn coded_e2e_selftest(dev: &Arc<GpuDevice>, seed: u64) -> Result<SelftestReport> {
    use entrollm_cuda::engine_coded::{
        dense_weights, e2e_config, served_weights, tuned_plan, Encoder,
    };
    use entrollm_model::coding_plan::CodingPlan;
    let c = e2e_config();
    let mut rng = Rng::new(seed ^ 0xC0DE);
    let prompt: Vec<u32> = (0..8)
        .map(|_| rng.below(c.vocab_size as u64) as u32)
        .collect();
    let steps: Vec<u32> = (0..4)
        .map(|_| rng.below(c.vocab_size as u64) as u32)
        .collect();
    // (prefill logits, logits of each step, greedy tokens, stream error flagged)
    type Run = (Vec<f32>, Vec<Vec<f32>>, Vec<u32>, bool);
    let run = |m: GpuModel| -> Result<Run> {
        let mut e = GpuEngine::new(Arc::clone(dev), m, 256)?;
        let pre = e.prefill(&prompt)?;
        let mut st = Vec::new();
        for &t in &steps {
            st.push(e.step(t)?);
        }
        e.reset();
        let toks = e.generate_greedy(&prompt, 32)?;
        let err = e.model().coded_error(dev)?;
        Ok((pre, st, toks, err))
    };
    // The three end-to-end cases of a run against its reference: prefill logits, decode-step
    // logits, and the greedy tokens (equal, no stream error flagged, and `extra`).
    let compare = |kind: &str, label: &str, shape: &str, got: &Run, want: &Run, extra: bool| {
        let same = got.2 == want.2 && !got.3 && extra;
        [
            CaseResult {
                kernel: format!("{kind} e2e prefill"),
                shape: shape.to_string(),
                rel_l2: rel_l2(&got.0, &want.0),
                tolerance: E2E_PREFILL_TOL,
            },
            CaseResult {
                kernel: format!("{kind} e2e decode"),
                shape: shape.to_string(),
                rel_l2: rel_l2(&got.1.concat(), &want.1.concat()),
                tolerance: E2E_STEP_TOL,
            },
            CaseResult {
                kernel: format!("{kind} e2e greedy"),
                shape: format!(
                    "{label}: 32 tokens {}{}",
                    if got.2 == want.2 { "equal" } else { "DIFFER" },
                    if got.3 { ", stream error flagged" } else { "" }
                ),
                rel_l2: if same { 0.0 } else { f64::INFINITY },
                tolerance: 0.0,
            },
        ]
    };
    // Layer 0's weights in every layer: the builder copies layer 0's launches on the device.
    let shared =
        shared_layer_weights(&c, seed).map_err(|e| GpuError::invalid("synth", e.to_string()))?;
    let dense = run(GpuModel::upload(dev, &shared)?)?;
    let mut cases = Vec::new();
    for (label, plan) in [
        ("tuned", tuned_plan(&c)),
        ("auto", CodingPlan::uniform(None)),
    ] {
        let auto = Fp8Serving::Auto;
        let (model, _) =
            GpuModel::upload_coded(dev, &shared, &plan, Encoder::Gpu, auto, &mut |_, _| {})?;
        let s = model.coded_summary();
        let shape = format!(
            "{label}: {} coded matrices, {:.3} bits/weight",
            s.matrices,
            s.bits_per_weight()
        );
        cases.extend(compare("coded", label, &shape, &run(model)?, &dense, true));
    }
    // A container's layout: separate coded q/k/v (one stacked launch) and gate/up (halves), served
    // by `upload_served`, against the same weights uploaded dense (decoded on the host).
    let w = served_weights(&c, seed, &tuned_plan(&c))?;
    let dense_w = run(GpuModel::upload(dev, &w)?)?;
    let (served, r) = GpuModel::upload_served(dev, &w, Serving::default())?;
    let n = r.taken();
    let s = served.coded_summary();
    let shape = format!(
        "served: {n} coded launches, {:.3} bits/weight",
        s.bits_per_weight()
    );
    let all_launches = n == 4 * c.num_layers + 1;
    cases.extend(compare(
        "served",
        "served",
        &shape,
        &run(served)?,
        &dense_w,
        all_launches,
    ));
    // Every dtANS launch configuration of the served container's launches, against the CPU
    // engine on the same coded matrices (its fused decode-matvec).
    launch_configs_case(
        dev,
        "served container",
        || served_weights(&c, seed, &tuned_plan(&c)),
        Serving::default(),
        &prompt,
        5e-2,
        &mut cases,
    )?;
    // Code at load: the same weights as a BF16 checkpoint gives them, coded on the GPU at load
    // (`upload_coded`), against the host encoder's arrays of the same matrices uploaded as a
    // container's are: identical arrays, hence identical logits; and against the dense model.
    let bf16 = dense_weights(&c, seed)?;
    let launches = 4 * c.num_layers + usize::from(!c.tie_word_embeddings);
    let at_load = entrollm_cuda::forms::GpuForm::name(&entrollm_cuda::forms::dtans::AT_LOAD);
    for (label, plan) in [
        ("tuned", tuned_plan(&c)),
        ("auto", CodingPlan::uniform(None)),
    ] {
        let auto = Fp8Serving::Auto;
        let (gm, gr) =
            GpuModel::upload_coded(dev, &bf16, &plan, Encoder::Gpu, auto, &mut |_, _| {})?;
        let (cm, cr) =
            GpuModel::upload_coded(dev, &bf16, &plan, Encoder::Cpu, auto, &mut |_, _| {})?;
        let diff = coded_arrays_differ(dev, &gm, &cm)?;
        let s = gm.coded_summary();
        let shape = format!(
            "code at load {label}: {} of {launches} launches coded, {:.3} bits/weight",
            gr.by(at_load),
            s.bits_per_weight()
        );
        let complete = gr.by(at_load) == launches && cr.by(at_load) == launches;
        cases.push(CaseResult {
            kernel: "code-at-load arrays".into(),
            shape: format!(
                "{shape}; GPU vs host encoder: {}",
                diff.as_deref().unwrap_or("identical")
            ),
            rel_l2: if diff.is_none() && complete {
                0.0
            } else {
                f64::INFINITY
            },
            tolerance: 0.0,
        });
        // Same arrays, so the same products up to the order of the mvm's f32 atomic adds across
        // column slices (not deterministic): logits within f32 rounding, the same tokens.
        let (g, h) = (run(gm)?, run(cm)?);
        let same_tokens = g.2 == h.2 && !g.3 && !h.3;
        let rel = rel_l2(&g.0, &h.0).max(rel_l2(&g.1.concat(), &h.1.concat()));
        cases.push(CaseResult {
            kernel: "code-at-load logits".into(),
            shape: format!(
                "{label}: GPU- vs host-coded prefill and steps; 32 tokens {}",
                if same_tokens { "equal" } else { "DIFFER" }
            ),
            rel_l2: if same_tokens { rel } else { f64::INFINITY },
            tolerance: 1e-6,
        });
        cases.extend(compare("code-at-load", label, &shape, &g, &dense_w, true));
    }
    let report = SelftestReport {
        device: format!("{} ({})", dev.info().name, dev.info().arch()),
        cases,
    };
    if report.failures().next().is_some() {
        return Err(GpuError::Selftest(report.to_string()));
    }
    Ok(report)
}

/// Where two models' coded matrices differ (coding, shape or any device array within its coded
/// length), or None when every launch holds the same arrays.
fn coded_arrays_differ(dev: &GpuDevice, a: &GpuModel, b: &GpuModel) -> Result<Option<String>> {
    use cudarc::driver::CudaSlice;
    use entrollm_codec::dtans::Geometry;
    use entrollm_cuda::linear::GpuLinear;
    fn mats(m: &GpuModel) -> Vec<&GpuLinear> {
        let mut v: Vec<&GpuLinear> = m.lm_head.iter().collect();
        for l in &m.layers {
            v.extend([&l.qkv, &l.o, &l.gate_up, &l.down]);
        }
        v
    }
    let (ma, mb) = (mats(a), mats(b));
    if ma.len() != mb.len() {
        return Ok(Some("different launch counts".into()));
    }
    for (i, (x, y)) in ma.into_iter().zip(mb).enumerate() {
        use entrollm_cuda::linear::DtansLinear;
        let (x, y) = match (x.downcast::<DtansLinear>(), y.downcast::<DtansLinear>()) {
            (Some(x), Some(y)) => (x, y),
            (None, None) => continue,
            _ => return Ok(Some(format!("launch {i}: coded in one model only"))),
        };
        if x.parts.len() != y.parts.len() {
            return Ok(Some(format!("launch {i}: part counts")));
        }
        for (p, q) in x.parts.iter().zip(&y.parts) {
            if (p.coding, p.rows, p.cols, p.stream_len, p.stored_bytes)
                != (q.coding, q.rows, q.cols, q.stream_len, q.stored_bytes)
            {
                return Ok(Some(format!(
                    "launch {i}: {} {}×{} {} words vs {} {}×{} {} words",
                    p.coding, p.rows, p.cols, p.stream_len, q.coding, q.rows, q.cols, q.stream_len
                )));
            }
            let g = Geometry::new(p.payload, &p.coding, p.rows, p.cols)
                .map_err(|e| GpuError::invalid("coded selftest", e.to_string()))?;
            let same_u32 = |u: &CudaSlice<u32>, v: &CudaSlice<u32>, n: usize| -> Result<bool> {
                let (u, v) = (download(dev, u)?, download(dev, v)?);
                Ok(u.len() >= n && v.len() >= n && u[..n] == v[..n])
            };
            let (ru, rv) = (download(dev, &p.raw)?, download(dev, &q.raw)?);
            let n = g.raw_len();
            for (name, same) in [
                (
                    "entries",
                    same_u32(&p.entries, &q.entries, p.entries.len())?,
                ),
                ("tiles", same_u32(&p.tiles, &q.tiles, 2 * g.tiles())?),
                ("stream", same_u32(&p.stream, &q.stream, p.stream_len)?),
                (
                    "companion",
                    same_u32(&p.companion, &q.companion, g.companion_len())?,
                ),
                ("raw", ru.len() >= n && rv.len() >= n && ru[..n] == rv[..n]),
            ] {
                if !same {
                    return Ok(Some(format!("launch {i}: {name} differ")));
                }
            }
        }
    }
    Ok(None)
}
