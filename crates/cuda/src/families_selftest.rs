//! Selftest of the families beyond Llama on the GPU (run by `entrollm selftest --gpu` through
//! [`crate::engine_selftest::run_engine_selftest`]): every kernel of `kernels/families.cu` against
//! its CPU reference on fresh random inputs of several shapes (ragged ones included), then, per
//! family (Qwen3, Phi-3, Gemma 2, Gemma 3), the GPU engine against the CPU engine end to end on a
//! synthetic model of the family's block with random weights: the logits after a prompt and after
//! each decode step, and the greedy tokens.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use entrollm_model::config::{Activation, Arch, Block, RopeScaling, RopeStyle};
use entrollm_model::weights::{ExtraNorms, GatedMlp, Linear, Mlp, ModelWeights};
use entrollm_model::{DenseBf16 as CpuDenseBf16, Engine, LayerWeights, ModelConfig};

use crate::device::GpuDevice;
use crate::engine::{GpuEngine, GpuModel};
use crate::error::{GpuError, Result};
use crate::mem::{download, upload};
use crate::ops::attention::{
    attention_masked_ref, launch_attention_decode, launch_attention_decode_fused, AttnConfig,
    AttnMask, AttnScratch, KvShape,
};
use crate::ops::families::*;
use crate::ops::forward::{rope_table, QOut, QkvShape};
use crate::ops::rope::RopeLayout;
use crate::ops::{bf16_to_f32, f32_to_bf16};
use crate::selftest::{rel_l2, CaseResult, Rng};

fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16_to_f32(f32_to_bf16(x))).collect()
}

fn widen(v: &[u16]) -> Vec<f32> {
    v.iter().map(|&b| bf16_to_f32(b)).collect()
}

/// A buffer of NaNs (BF16 0x7FC1), so that an element the kernel does not write fails the check.
fn poisoned16(dev: &GpuDevice, n: usize) -> Result<CudaSlice<u16>> {
    upload(dev, &vec![0x7FC1u16; n])
}

fn poisoned32(dev: &GpuDevice, n: usize) -> Result<CudaSlice<f32>> {
    upload(dev, &vec![f32::NAN; n])
}

struct Checker<'a> {
    dev: &'a GpuDevice,
    rng: Rng,
    cases: &'a mut Vec<CaseResult>,
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

    /// `rope_heads_*` against [`rope_heads_ref`]: q, and the cache rows written.
    #[allow(clippy::too_many_arguments)]
    fn rope_heads(
        &mut self,
        n: usize,
        (nq, nkv, hd): (usize, usize, usize),
        layout: RopeLayout,
        bias: bool,
        qk_norm: bool,
        rotary: usize,
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
        let norms = qk_norm.then(|| {
            let mut g = |_: ()| {
                (0..hd)
                    .map(|_| 1.0 + 0.3 * self.rng.normal())
                    .collect::<Vec<f32>>()
            };
            (g(()), g(()))
        });
        let inv_freq: Vec<f64> = (0..rotary / 2)
            .map(|i| 10000f64.powf(-(2.0 * i as f64) / rotary as f64))
            .collect();
        let eps = 1e-6;
        let (want_q, want_k, want_v) = rope_heads_ref(
            s,
            &qkv,
            b.as_deref(),
            norms.as_ref().map(|(q, k)| (q.as_slice(), k.as_slice())),
            eps,
            rotary,
            start,
            &inv_freq,
        );
        let qkv_d = upload(self.dev, &qkv)?;
        let b_d = b.as_ref().map(|b| upload(self.dev, b)).transpose()?;
        let norms_d = match &norms {
            Some((q, k)) => Some((upload(self.dev, q)?, upload(self.dev, k)?)),
            None => None,
        };
        let table = upload(self.dev, &rope_table(&inv_freq, max_seq))?;
        let pos = upload(self.dev, &[start as i32])?;
        let mut kc = poisoned16(self.dev, max_seq * s.kv_dim())?;
        let mut vc = poisoned16(self.dev, max_seq * s.kv_dim())?;
        let ops = HeadOps {
            qk_norm: norms_d.as_ref().map(|(q, k)| (q, k)),
            eps,
            rotary,
        };
        let got_q = if bf16_q {
            let mut q = poisoned16(self.dev, n * s.q_dim())?;
            launch_rope_heads(
                self.dev,
                s,
                ops,
                &qkv_d,
                b_d.as_ref(),
                QOut::Bf16(&mut q),
                &mut kc,
                &mut vc,
                &pos,
                &table,
                n,
                max_seq,
            )?;
            widen(&download(self.dev, &q)?)
        } else {
            let mut q = poisoned32(self.dev, n * s.q_dim())?;
            launch_rope_heads(
                self.dev,
                s,
                ops,
                &qkv_d,
                b_d.as_ref(),
                QOut::F32(&mut q),
                &mut kc,
                &mut vc,
                &pos,
                &table,
                n,
                max_seq,
            )?;
            download(self.dev, &q)?
        };
        let desc = format!(
            "n {n} h {nq}/{nkv}x{hd} rotary {rotary} {layout:?} bias {bias} qk_norm {qk_norm} \
             start {start}{}",
            if bf16_q { " bf16q" } else { "" }
        );
        let (want_q, tol_q) = if bf16_q {
            (round_bf16(&want_q), 1e-4)
        } else {
            (want_q, 1e-5)
        };
        self.record("rope_heads_q", desc.clone(), &got_q, &want_q, tol_q);
        let rows = start * s.kv_dim()..(start + n) * s.kv_dim();
        let got_k = widen(&download(self.dev, &kc)?[rows.clone()]);
        let got_v = widen(&download(self.dev, &vc)?[rows]);
        // BF16 caches: an f32 value within rounding error of a tie may round the other way.
        self.record(
            "rope_heads_k",
            desc.clone(),
            &got_k,
            &round_bf16(&want_k),
            2e-3,
        );
        self.record("rope_heads_v", desc, &got_v, &round_bf16(&want_v), 2e-3);
        Ok(())
    }

    /// `add_rmsnorm*` against [`add_rmsnorm_ref`]: the new x and the next norm's output.
    fn add_rmsnorm(&mut self, rows: usize, dim: usize, next: Option<bool>) -> Result<()> {
        let y = self.rng.normals(rows * dim, 3.0);
        let x = self.rng.normals(rows * dim, 1.0);
        let w: Vec<f32> = (0..dim).map(|_| 1.0 + 0.2 * self.rng.normal()).collect();
        let g: Vec<f32> = (0..dim).map(|_| 1.0 + 0.2 * self.rng.normal()).collect();
        let eps = 1e-6;
        let (want_x, want_h) = add_rmsnorm_ref(&y, &w, &x, next.map(|_| g.as_slice()), eps);
        let (y_d, w_d, g_d) = (
            upload(self.dev, &y)?,
            upload(self.dev, &w)?,
            upload(self.dev, &g)?,
        );
        let mut x_d = upload(self.dev, &x)?;
        let desc = format!("rows {rows} dim {dim} next {next:?}");
        let got_h = match next {
            None => {
                launch_add_rmsnorm(self.dev, &y_d, &w_d, &mut x_d, None, rows, dim, eps)?;
                None
            }
            Some(false) => {
                let mut h = poisoned32(self.dev, rows * dim)?;
                let next = Some((&g_d, NextOut::F32(&mut h)));
                launch_add_rmsnorm(self.dev, &y_d, &w_d, &mut x_d, next, rows, dim, eps)?;
                Some(download(self.dev, &h)?)
            }
            Some(true) => {
                let mut h = poisoned16(self.dev, rows * dim)?;
                let next = Some((&g_d, NextOut::Bf16(&mut h)));
                launch_add_rmsnorm(self.dev, &y_d, &w_d, &mut x_d, next, rows, dim, eps)?;
                Some(widen(&download(self.dev, &h)?))
            }
        };
        let got_x = download(self.dev, &x_d)?;
        self.record("add_rmsnorm_x", desc.clone(), &got_x, &want_x, 1e-5);
        if let (Some(got), Some(want)) = (got_h, want_h) {
            let (want, tol) = match next {
                Some(true) => (round_bf16(&want), 1e-2),
                _ => (want, 1e-5),
            };
            self.record("add_rmsnorm_next", desc, &got, &want, tol);
        }
        Ok(())
    }

    fn geglu(&mut self, n: usize, inter: usize, halves: bool, bf16: bool) -> Result<()> {
        let gu = self.rng.normals(n * 2 * inter, 2.0);
        let want = geglu_ref(&gu, inter, halves);
        let gu_d = upload(self.dev, &gu)?;
        let got = if bf16 {
            let mut o = poisoned16(self.dev, n * inter)?;
            launch_geglu(self.dev, &gu_d, ActOut::Bf16(&mut o), n, inter, halves)?;
            widen(&download(self.dev, &o)?)
        } else {
            let mut o = poisoned32(self.dev, n * inter)?;
            launch_geglu(self.dev, &gu_d, ActOut::F32(&mut o), n, inter, halves)?;
            download(self.dev, &o)?
        };
        let (want, tol) = if bf16 {
            (round_bf16(&want), 1e-2)
        } else {
            (want, 1e-5)
        };
        let desc = format!("n {n} inter {inter} halves {halves} bf16 {bf16}");
        self.record("geglu", desc, &got, &want, tol);
        Ok(())
    }

    /// Masked decode attention in the long-chunk configuration (no preload: the online softmax
    /// loop), split and fused, against [`attention_masked_ref`].
    fn attn_long_chunks(&mut self, max_seq: usize, len: usize, mask: AttnMask) -> Result<()> {
        let (hd, nq, nkv) = (128, 32, 8);
        let cfg = AttnConfig::for_heads(hd, nq, nkv)?;
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
        let scale = 1.0 / (hd as f32).sqrt();
        let want = attention_masked_ref(&q, &kc, &vc, len, (nq, nkv, hd), scale, mask);
        for fused in [false, true] {
            let mut out = poisoned32(self.dev, nq * hd)?;
            let attend = if fused {
                launch_attention_decode_fused
            } else {
                launch_attention_decode
            };
            attend(
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
            )?;
            let got = download(self.dev, &out)?;
            let desc = format!("chunk 256 len {len}/{max_seq} fused {fused}{mask}");
            self.record("attention_decode_c256", desc, &got, &want, 1e-4);
        }
        Ok(())
    }

    fn scale_and_softcap(&mut self, n: usize) -> Result<()> {
        let x = self.rng.normals(n, 10.0);
        let mut x_d = upload(self.dev, &x)?;
        launch_scale(self.dev, &mut x_d, n, 0.37)?;
        let want: Vec<f32> = x.iter().map(|v| v * 0.37).collect();
        self.record(
            "scale_f32",
            format!("n {n}"),
            &download(self.dev, &x_d)?,
            &want,
            1e-6,
        );
        launch_softcap(self.dev, &mut x_d, n, 3.0)?;
        let want = softcap_ref(&want, 3.0);
        self.record(
            "softcap_f32",
            format!("n {n} cap 3"),
            &download(self.dev, &x_d)?,
            &want,
            1e-5,
        );
        Ok(())
    }
}

/// The families' kernels and end-to-end models; results go to `cases`.
pub fn run(dev: &Arc<GpuDevice>, seed: u64, cases: &mut Vec<CaseResult>) -> Result<()> {
    let mut c = Checker {
        dev,
        rng: Rng::new(seed ^ 0xFA41),
        cases,
    };
    for layout in [RopeLayout::Neox, RopeLayout::Interleaved] {
        for &(n, heads, bias, qk, rotary, start) in &[
            (1, (4, 2, 64), false, true, 64, 0),
            (7, (9, 3, 128), true, true, 64, 17),
            (5, (8, 4, 256), false, true, 256, 1000),
            (37, (4, 2, 64), true, false, 32, 3),
            (3, (6, 2, 96), false, false, 48, 5),
            (130, (16, 8, 128), false, true, 128, 2),
        ] {
            for bf16_q in [false, true] {
                c.rope_heads(n, heads, layout, bias, qk, rotary, start, bf16_q)?;
            }
        }
    }
    for &(rows, dim) in &[(1, 256), (3, 1000), (17, 4096), (2, 2304), (5, 9)] {
        for next in [None, Some(false), Some(true)] {
            c.add_rmsnorm(rows, dim, next)?;
        }
    }
    for &(n, inter) in &[(1, 8), (3, 520), (7, 1536), (2, 9216)] {
        for (halves, bf16) in [(false, false), (true, false), (false, true), (true, true)] {
            c.geglu(n, inter, halves, bf16)?;
        }
    }
    for n in [1, 1003, 262_144] {
        c.scale_and_softcap(n)?;
    }
    for &(max_seq, len, window, softcap) in &[
        (1000, 1, Some(3), None),
        (1000, 700, Some(300), Some(20.0)),
        (1000, 513, Some(1), None),
        (1000, 999, None, Some(2.0)),
    ] {
        c.attn_long_chunks(max_seq, len, AttnMask { window, softcap })?;
    }
    let mut rng = Rng::new(seed ^ 0xFA42);
    for arch in [Arch::Qwen3, Arch::Phi3, Arch::Gemma2, Arch::Gemma3] {
        let w = family_model(arch, &mut rng)?;
        let label = format!("synthetic {}", arch.family().name);
        let vocab = w.config.vocab_size as u64;
        let prompt: Vec<u32> = (0..300).map(|_| rng.below(vocab) as u32).collect();
        e2e(dev, &label, w, &prompt, 8, 3e-2, cases)?;
    }
    Ok(())
}

/// The block of `arch` with small windows and caps that matter within a few hundred positions.
pub fn family_config(arch: Arch) -> ModelConfig {
    let mut c = entrollm_model::synth::SynthShape::Tiny.config();
    c.arch = arch;
    c.hidden_size = 256;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 64;
    c.intermediate_size = 520;
    c.vocab_size = 1003;
    c.max_position_embeddings = 4096;
    c.num_layers = 3;
    let h = c.hidden_size as f32;
    c.block = match arch {
        Arch::Qwen3 => {
            c.rope_theta = 1_000_000.0;
            Block::default()
        }
        Arch::Phi3 => Block {
            rotary_dim: Some(32),
            sliding_window: Some(37),
            sliding_layers: vec![true; 3],
            ..Block::default()
        },
        Arch::Gemma2 => {
            c.tie_word_embeddings = true;
            Block {
                activation: Activation::GeluTanh,
                embed_scale: Some(h.sqrt()),
                attn_scale: Some(1.0 / 48f32.sqrt()),
                attn_softcap: Some(2.0),
                final_softcap: Some(3.0),
                sliding_window: Some(23),
                sliding_layers: vec![true, false, true],
                ..Block::default()
            }
        }
        Arch::Gemma3 => {
            c.tie_word_embeddings = true;
            c.head_dim = 128; // ≠ hidden / heads, as Gemma's
            c.rope_theta = 1_000_000.0;
            c.rope_scaling = RopeScaling::Linear { factor: 8.0 };
            Block {
                activation: Activation::GeluTanh,
                embed_scale: Some(h.sqrt()),
                attn_scale: Some(1.0 / 100f32.sqrt()),
                sliding_window: Some(29),
                sliding_layers: vec![true, true, false],
                local_rope_theta: Some(10_000.0),
                ..Block::default()
            }
        }
        _ => Block::default(),
    };
    if arch == Arch::Phi3 {
        c.rope_style = RopeStyle::Neox;
    }
    c
}

/// A synthetic model of `arch`'s block: [`family_config`], BF16 matrices and f32 norms (q/k
/// norms and post norms as the family has them) with random values.
pub fn family_model(arch: Arch, rng: &mut Rng) -> Result<ModelWeights> {
    use entrollm_model::arch::Role;
    let c = family_config(arch);
    let family = arch.family();
    let (h, q, kv, inter, hd) = (
        c.hidden_size,
        c.q_dim(),
        c.kv_dim(),
        c.intermediate_size,
        c.head_dim,
    );
    let mut mat = |name: &str, rows: usize, cols: usize| -> Result<Arc<dyn Linear>> {
        let sigma = 2.0 / (cols as f32).sqrt();
        let bits = rng.bf16s(rows * cols, sigma);
        let m = CpuDenseBf16::new(name, rows, cols, bits)
            .map_err(|e| GpuError::invalid("selftest", e.to_string()))?;
        Ok(Arc::new(m))
    };
    let embed = mat("embed", c.vocab_size, h)?;
    let lm_head = if c.tie_word_embeddings {
        Arc::clone(&embed)
    } else {
        mat("lm_head", c.vocab_size, h)?
    };
    let mut layers = Vec::new();
    for _ in 0..c.num_layers {
        layers.push(LayerWeights {
            attn_norm: Vec::new(),
            q: mat("q", q, h)?,
            k: mat("k", kv, h)?,
            v: mat("v", kv, h)?,
            o: mat("o", h, q)?,
            q_bias: None,
            k_bias: None,
            v_bias: None,
            mlp_norm: Vec::new(),
            mlp: Mlp::Gated(GatedMlp {
                gate: mat("gate", inter, h)?,
                up: mat("up", inter, h)?,
                down: mat("down", h, inter)?,
            }),
            norms: ExtraNorms::default(),
        });
    }
    let mut norm = |n: usize| -> Vec<f32> { (0..n).map(|_| 1.0 + 0.2 * rng.normal()).collect() };
    for l in &mut layers {
        l.attn_norm = norm(h);
        l.mlp_norm = norm(h);
        if family.has(Role::QNorm) {
            l.norms.q = Some(norm(hd));
            l.norms.k = Some(norm(hd));
        }
        if family.has(Role::PostAttnNorm) {
            l.norms.post_attn = Some(norm(h));
        }
        if family.has(Role::PostMlpNorm) {
            l.norms.post_mlp = Some(norm(h));
        }
    }
    let w = ModelWeights {
        embed,
        lm_head,
        final_norm: norm(h),
        layers,
        config: c,
    };
    w.validate()
        .map_err(|e| GpuError::invalid("selftest", e.to_string()))?;
    Ok(w)
}

fn model_err(e: entrollm_model::ModelError) -> GpuError {
    GpuError::invalid("cpu engine", e.to_string())
}

/// GPU against CPU on `w` (matrices BF16 on both): the logits after `prompt` and after each of
/// `steps` decode tokens (greedy from the CPU), relative L2 each (worst reported), then greedy
/// generation: the GPU's tokens against the CPU's.
fn e2e(
    dev: &Arc<GpuDevice>,
    label: &str,
    w: ModelWeights,
    prompt: &[u32],
    steps: usize,
    tol: f64,
    cases: &mut Vec<CaseResult>,
) -> Result<()> {
    let max_seq = prompt.len() + steps + 1;
    let w = Arc::new(w);
    let gm = GpuModel::upload(dev, &w)?;
    let mut ge = GpuEngine::new(Arc::clone(dev), gm, max_seq)?;
    let mut ce = Engine::new(Arc::clone(&w), max_seq).map_err(model_err)?;
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
    // The CPU's greedy tokens, and whether each is clear (its top two logits further apart than
    // the tolerance allows the GPU's to move).
    let clear = |l: &[f32]| {
        let mut v = l.to_vec();
        v.sort_by(|a, b| b.total_cmp(a));
        let scale = l.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
        v.len() < 2 || (v[0] - v[1]) as f64 > 2.0 * tol * scale
    };
    let mut cpu_tokens = vec![(next, clear(&want))];
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
        cpu_tokens.push((next, clear(&want)));
    }
    cases.push(CaseResult {
        kernel: "e2e_decode_logits".into(),
        shape: format!("{label}: worst of {steps} graph steps"),
        rel_l2: worst,
        tolerance: tol,
    });
    // Greedy on the device (argmax in the graph) against the CPU's greedy tokens, up to the first
    // token the CPU's logits do not make clear (after a different token the sequences part):
    // reported as the fraction of those tokens that differ, tolerance 0.
    ge.reset();
    let gpu_tokens = ge.generate_greedy(prompt, steps + 1)?;
    let differ = gpu_tokens
        .iter()
        .zip(&cpu_tokens)
        .take_while(|(_, (_, clear))| *clear)
        .filter(|(a, (b, _))| *a != b)
        .count();
    cases.push(CaseResult {
        kernel: "e2e_greedy_tokens".into(),
        shape: format!("{label}: {} tokens differing of {}", differ, steps + 1),
        rel_l2: differ as f64 / (steps + 1) as f64,
        tolerance: 0.0,
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_model_is_valid_and_has_its_features() {
        let mut rng = Rng::new(1);
        for arch in [Arch::Qwen3, Arch::Phi3, Arch::Gemma2, Arch::Gemma3] {
            let w = family_model(arch, &mut rng).unwrap();
            assert!(crate::families::unsupported(&w).is_empty(), "{arch:?}");
            crate::engine::check_supported(&w.config).unwrap();
            let f = arch.family();
            assert_eq!(w.layers[0].norms.q.is_some(), f.qk_norm, "{arch:?}");
        }
        assert_eq!(family_config(Arch::Phi3).block.rotary_dim, Some(32));
    }
}
