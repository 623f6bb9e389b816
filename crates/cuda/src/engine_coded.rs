//! The model builder ([`GpuModel::upload_served`], [`GpuModel::upload_coded`]): each launch of a
//! host model to the device in the form the GPU forms give it (`forms::upload`), coded at load
//! when asked; a layer whose host matrices an earlier layer shares (a synthetic model built with
//! `model::synth::shared_layer_weights`: layer 0's weights in every layer) gets device copies of
//! that layer's launches, so every layer owns its arrays and the decode step reads each. Also
//! the coder's entry points for BF16 matrices and the synthetic weights of the selftests.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use entrollm_codec::dtans::{choose_coding_and_width, Coding, DtansTensor, EncodePlan};
use entrollm_codec::Payload;
use entrollm_model::arch::Role;
use entrollm_model::coding_plan::{CodingPlan, Launch};
use entrollm_model::synth::{bf16_bits, tensor_name, tensors, SynthTensor};
use entrollm_model::weights::{GatedMlp, Mlp};
use entrollm_model::ModelConfig;

use crate::coded::{check_supported as check_coding, GpuDtans};
use crate::device::GpuDevice;
use crate::engine::{GpuLayer, GpuModel};
use crate::error::{DriverContext, GpuError, Result};
pub use crate::forms::report::{Encoder, LoadReport};
use crate::forms::{self, check_kernels, exact_bf16, Policy, Upload};
use crate::linear::{DtansScratch, Fp8Serving, GpuLinear, Serving, SharedScratch};
use crate::tuned::bf16_coding_for;
use cudarc::driver::CudaSlice;

const OP: &str = "synthetic model";

/// The plan of the tuned BF16 codings: per launch the coding `tuned::bf16_coding_for` gives
/// its stacked shape (the measured fastest for the Llama-3.1-8B shapes).
pub fn tuned_plan(c: &ModelConfig) -> CodingPlan {
    let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let mut plan = CodingPlan::uniform(None);
    for (l, rows, cols) in [
        (Launch::Qkv, q + 2 * kv, h),
        (Launch::O, h, q),
        (Launch::GateUp, 2 * inter, h),
        (Launch::Down, h, inter),
        (Launch::LmHead, c.vocab_size, h),
    ] {
        plan.launches.insert(l, Some(bf16_coding_for(rows, cols).0));
    }
    plan
}

/// Codes a BF16 matrix losslessly with `coding` (None: the coder's choice of coding and width),
/// on the host or (`gpu`) on that device.
pub fn code_bf16(
    bits: &[u16],
    rows: usize,
    cols: usize,
    coding: Option<Coding>,
    gpu: Option<&GpuDevice>,
) -> Result<DtansTensor> {
    let codec = |e: entrollm_codec::CodecError| GpuError::invalid(OP, e.to_string());
    let codes = crate::ops::dtans_encode::bf16_codes(bits);
    let coding = match coding {
        Some(c) => c,
        None => {
            choose_coding_and_width(Payload::Bf16, rows, cols, &codes)
                .map_err(codec)?
                .0
        }
    };
    check_coding(Payload::Bf16, &coding)?;
    let plan = EncodePlan::new(Payload::Bf16, rows, cols, &codes, coding).map_err(codec)?;
    match gpu {
        Some(dev) => {
            drop(codes);
            let w = dev
                .stream()
                .clone_htod(bits)
                .while_(|| format!("uploading a {rows}×{cols} matrix to code"))?;
            Ok(crate::ops::dtans_encode::encode_bf16(dev, &w, &plan)?.0)
        }
        None => {
            let raw: Vec<u8> = bits
                .par_iter()
                .map(|&b| Payload::Bf16.split16(b).1)
                .collect();
            DtansTensor::encode_planned(&plan, &codes, &raw).map_err(codec)
        }
    }
}

/// One matrix of [`time_layer_encode`].
#[derive(Clone, Debug)]
pub struct EncodeTiming {
    pub name: &'static str,
    pub rows: usize,
    pub cols: usize,
    pub coding: Coding,
    /// Host: codes, histograms and table.
    pub plan_s: f64,
    /// GPU: upload of the BF16 matrix, then the kernels' passes and the download.
    pub upload_s: f64,
    pub gpu: crate::ops::dtans_encode::EncodeTimes,
    /// The host encoder after the same plan, if run.
    pub cpu_s: Option<f64>,
    /// Whether the GPU's tensor equals the host encoder's (if run), array for array.
    pub identical: Option<bool>,
    pub bits_per_weight: f64,
}

/// Times coding layer 0 of the synthetic model `c` (qkv, o, gate_up, down as served) with the
/// codings of `plan`: the host's plan, the GPU encode and, with `cpu`, the host encoder on the
/// same plan, checked byte for byte against the GPU's.
pub fn time_layer_encode(
    dev: &GpuDevice,
    c: &ModelConfig,
    seed: u64,
    plan: &CodingPlan,
    cpu: bool,
) -> Result<Vec<EncodeTiming>> {
    use std::time::Instant;
    let codec = |e: entrollm_codec::CodecError| GpuError::invalid(OP, e.to_string());
    let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let hl = host_layer(&tensors(c), seed)?;
    // Each launch's coding is the plan's for its first tensor.
    let mats: [(Launch, Role, &[u16], usize, usize); 4] = [
        (Launch::Qkv, Role::Q, &hl.qkv, q + 2 * kv, h),
        (Launch::O, Role::O, &hl.o, h, q),
        (Launch::GateUp, Role::Gate, &hl.gate_up, 2 * inter, h),
        (Launch::Down, Role::Down, &hl.down, h, inter),
    ];
    let mut out = Vec::new();
    for (launch, role, bits, rows, cols) in mats {
        let name = launch.name();
        let coding = plan
            .coding_for(&tensor_name(role, 0))
            .ok_or_else(|| GpuError::invalid(OP, format!("the plan gives {name} no coding")))?;
        check_coding(Payload::Bf16, &coding)?;
        let t0 = Instant::now();
        let codes = crate::ops::dtans_encode::bf16_codes(bits);
        let p = EncodePlan::new(Payload::Bf16, rows, cols, &codes, coding).map_err(codec)?;
        let plan_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let w = dev
            .stream()
            .clone_htod(bits)
            .while_(|| format!("uploading {name}"))?;
        dev.synchronize()?;
        let upload_s = t1.elapsed().as_secs_f64();
        let (gt, times) = crate::ops::dtans_encode::encode_bf16(dev, &w, &p)?;
        drop(w);
        let (cpu_s, identical) = if cpu {
            let raw: Vec<u8> = bits
                .par_iter()
                .map(|&b| Payload::Bf16.split16(b).1)
                .collect();
            let t2 = Instant::now();
            let ct = DtansTensor::encode_planned(&p, &codes, &raw).map_err(codec)?;
            (Some(t2.elapsed().as_secs_f64()), Some(ct == gt))
        } else {
            (None, None)
        };
        out.push(EncodeTiming {
            name,
            rows,
            cols,
            coding,
            plan_s,
            upload_s,
            gpu: times,
            cpu_s,
            identical,
            bits_per_weight: gt.bits_per_weight(),
        });
    }
    Ok(out)
}

/// Free and total device memory.
pub fn free_memory(dev: &GpuDevice) -> Result<(usize, usize)> {
    dev.context()
        .mem_get_info()
        .while_(|| "querying free device memory".into())
}

impl GpuDtans {
    /// A copy of the coded arrays in new device memory (device-to-device).
    pub fn duplicate(&self, dev: &GpuDevice) -> Result<GpuDtans> {
        if self.groups.is_some() {
            return Err(GpuError::invalid(
                "dtans duplicate",
                "tensors with group scales are not duplicated",
            ));
        }
        let s = dev.stream();
        let what = || format!("copying a coded {}×{} matrix", self.rows, self.cols);
        Ok(GpuDtans {
            payload: self.payload,
            coding: self.coding,
            rows: self.rows,
            cols: self.cols,
            entries: s.clone_dtod(&self.entries).while_(what)?,
            lut: s.clone_dtod(&self.lut).while_(what)?,
            tiles: s.clone_dtod(&self.tiles).while_(what)?,
            stream: s.clone_dtod(&self.stream).while_(what)?,
            stream_len: self.stream_len,
            companion: s.clone_dtod(&self.companion).while_(what)?,
            raw: s.clone_dtod(&self.raw).while_(what)?,
            groups: None,
            stored_bytes: self.stored_bytes,
        })
    }

    /// Device bytes of the arrays (with the kernels' padding of empty ones).
    pub fn device_bytes(&self) -> usize {
        (self.entries.len() + self.lut.len() + self.tiles.len() + self.stream.len()) * 4
            + self.companion.len() * 4
            + self.raw.len()
    }
}

/// Summary of a model's coded matrices.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CodedSummary {
    /// Coded matrices and their weights.
    pub matrices: usize,
    pub weights: usize,
    /// Bytes of their coded arrays.
    pub bytes: usize,
    /// Dense matrices (BF16, or FP8 with row scales), their weights and bytes.
    pub dense_matrices: usize,
    pub dense_weights: usize,
    pub dense_bytes: usize,
}

impl CodedSummary {
    pub fn bits_per_weight(&self) -> f64 {
        if self.weights == 0 {
            0.0
        } else {
            self.bytes as f64 * 8.0 / self.weights as f64
        }
    }
}

impl GpuModel {
    /// How many layer and head matrices each GPU form serves, by the form's name in the decode plan
    /// ([`LinearDesc::form_name`](crate::plan::LinearDesc::form_name): `bf16`, `fp8`,
    /// `fp8-palette`, `bf16-palette`, `dtans`, …).
    pub fn matrices_by_form(&self) -> BTreeMap<&'static str, usize> {
        let mut by = BTreeMap::new();
        let mut mats: Vec<&GpuLinear> = self.lm_head.iter().collect();
        for l in &self.layers {
            mats.extend([&l.qkv, &l.o, &l.gate_up, &l.down]);
        }
        for m in mats {
            *by.entry(m.desc().form_name()).or_default() += 1;
        }
        by
    }

    /// The GPU form the LM head is served in; None where it is tied to the embedding.
    pub fn lm_head_form(&self) -> Option<&'static str> {
        self.lm_head.as_ref().map(|m| m.desc().form_name())
    }

    /// The coded and dense matrices of the model (the embedding counted once when tied).
    pub fn coded_summary(&self) -> CodedSummary {
        let mut s = CodedSummary::default();
        let mut add = |m: &GpuLinear| match m.entropy_coded() {
            true => {
                s.matrices += 1;
                s.weights += m.rows() * m.cols();
                s.bytes += m.stored_bytes();
            }
            false => {
                s.dense_matrices += 1;
                s.dense_weights += m.rows() * m.cols();
                s.dense_bytes += m.stored_bytes();
            }
        };
        add(&self.embed);
        if let Some(l) = &self.lm_head {
            add(l);
        }
        for l in &self.layers {
            for m in [&l.qkv, &l.o, &l.gate_up, &l.down] {
                add(m);
            }
        }
        s
    }

    /// Device bytes of the coded matrices' shared scratch (0 for a dense model).
    pub fn scratch_bytes(&self) -> usize {
        self.coded_scratch
            .as_ref()
            .map_or(0, |s| s.lock().unwrap_or_else(|e| e.into_inner()).bytes())
    }

    /// Whether a coded kernel has flagged an inconsistent stream since the model was built.
    pub fn coded_error(&self, dev: &GpuDevice) -> Result<bool> {
        match &self.coded_scratch {
            None => Ok(false),
            Some(s) => {
                let s = s.lock().unwrap_or_else(|e| e.into_inner());
                let e = dev
                    .stream()
                    .clone_dtoh(&s.err)
                    .while_(|| "reading the coded kernels' error word".into())?;
                Ok(e[0] != 0)
            }
        }
    }
}

/// The small Llama-architecture model of the coded end-to-end check: head_dim 64, GQA 4/2, two
/// layers, ragged intermediate and vocabulary sizes.
pub fn e2e_config() -> ModelConfig {
    let mut c = entrollm_model::synth::SynthShape::Tiny.config();
    c.hidden_size = 256;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 64;
    c.intermediate_size = 520;
    c.vocab_size = 1003;
    c.max_position_embeddings = 4096;
    c
}

/// The synthetic model of `c` as a container opened fused would give it: every layer matrix and
/// the LM head a [`CodedLinear`](entrollm_model::load::CodedLinear) coded by `plan` (q, k, v, gate
/// and up separate tensors), the embedding dense BF16, norms as stored.
pub fn served_weights(
    c: &ModelConfig,
    seed: u64,
    plan: &CodingPlan,
) -> Result<entrollm_model::weights::ModelWeights> {
    synth_weights(c, seed, Some(plan))
}

/// The synthetic model of `c` as a BF16 checkpoint gives it: every matrix dense BF16 (the weights
/// of [`served_weights`] before coding).
pub fn dense_weights(c: &ModelConfig, seed: u64) -> Result<entrollm_model::weights::ModelWeights> {
    synth_weights(c, seed, None)
}

/// A norm weight vector as the synth stores it (BF16-rounded), in f32.
fn host_norm(t: &SynthTensor, seed: u64) -> Vec<f32> {
    bf16_bits(t, seed)
        .into_iter()
        .map(|b| half::bf16::from_bits(b).to_f32())
        .collect()
}

fn find<'a>(ts: &'a [SynthTensor], name: &str) -> Result<&'a SynthTensor> {
    ts.iter()
        .find(|t| t.name == name)
        .ok_or_else(|| GpuError::invalid(OP, format!("the synthetic model has no {name}")))
}

/// The host matrices of one layer, stacked as the engine stacks them.
struct HostLayer {
    qkv: Vec<u16>,
    o: Vec<u16>,
    gate_up: Vec<u16>,
    down: Vec<u16>,
}

fn host_layer(ts: &[SynthTensor], seed: u64) -> Result<HostLayer> {
    let m =
        |role: Role| -> Result<Vec<u16>> { Ok(bf16_bits(find(ts, &tensor_name(role, 0))?, seed)) };
    let mut qkv = m(Role::Q)?;
    qkv.extend(m(Role::K)?);
    qkv.extend(m(Role::V)?);
    let (gate, up) = (m(Role::Gate)?, m(Role::Up)?);
    let cols = find(ts, &tensor_name(Role::Gate, 0))?.shape[1];
    let mut gate_up = Vec::with_capacity(gate.len() * 2);
    for (g, u) in gate.chunks(cols).zip(up.chunks(cols)) {
        gate_up.extend_from_slice(g);
        gate_up.extend_from_slice(u);
    }
    drop((gate, up));
    Ok(HostLayer {
        qkv,
        o: m(Role::O)?,
        gate_up,
        down: m(Role::Down)?,
    })
}

fn synth_weights(
    c: &ModelConfig,
    seed: u64,
    plan: Option<&CodingPlan>,
) -> Result<entrollm_model::weights::ModelWeights> {
    use entrollm_model::load::CodedLinear;
    use entrollm_model::weights::{LayerWeights, Linear, ModelWeights};
    let ts = tensors(c);
    let bad = |e: entrollm_model::ModelError| GpuError::invalid(OP, e.to_string());
    let mat = |name: &str| -> Result<Arc<dyn Linear>> {
        let t = find(&ts, name)?;
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let bits = bf16_bits(t, seed);
        let plan = match plan {
            Some(p) if name != tensor_name(Role::Embed, 0) => p,
            _ => {
                let d = entrollm_model::DenseBf16::new(name, rows, cols, bits).map_err(bad)?;
                return Ok(Arc::new(d));
            }
        };
        let t = code_bf16(&bits, rows, cols, plan.coding_for(name), None)?;
        Ok(Arc::new(CodedLinear::new(t, None).map_err(bad)?))
    };
    let norm = |name: &str| -> Result<Vec<f32>> { Ok(host_norm(find(&ts, name)?, seed)) };
    let mut layers = Vec::with_capacity(c.num_layers);
    for l in 0..c.num_layers {
        let p = |role: Role| tensor_name(role, l);
        layers.push(LayerWeights {
            attn_norm: norm(&p(Role::AttnNorm))?,
            q: mat(&p(Role::Q))?,
            k: mat(&p(Role::K))?,
            v: mat(&p(Role::V))?,
            o: mat(&p(Role::O))?,
            q_bias: None,
            k_bias: None,
            v_bias: None,
            mlp_norm: norm(&p(Role::MlpNorm))?,
            mlp: Mlp::Gated(GatedMlp {
                gate: mat(&p(Role::Gate))?,
                up: mat(&p(Role::Up))?,
                down: mat(&p(Role::Down))?,
            }),
            norms: Default::default(),
        });
    }
    let embed = mat(&tensor_name(Role::Embed, 0))?;
    let lm_head = if c.tie_word_embeddings {
        Arc::clone(&embed)
    } else {
        mat(&tensor_name(Role::LmHead, 0))?
    };
    Ok(ModelWeights {
        config: c.clone(),
        embed,
        layers,
        final_norm: norm(&tensor_name(Role::FinalNorm, 0))?,
        lm_head,
    })
}

/// A compact plan for the synthetic distribution (`crates/cuda/data/single-m8.json`): Single mode,
/// M = 2^8, slices of 512–2048 columns; predicted 10.76–10.83 bits/weight on the Llama-3.3-70B
/// layer matrices (the tuned Pair M = 2^8 t = 16 codings spend 11.7–11.9 there: the synthetic
/// exponents spread wider than t = 16 keeps, and escapes cost).
pub const COMPACT_PLAN_JSON: &str = include_str!("../data/single-m8.json");

/// Kernel variants the coded synthetic models use with the tuned plan and the compact plan (mvm and dequant of every
/// stacked shape of the e2e model, Llama-3.1-8B and Llama-3.3-70B), for precompiling cubins.
pub fn serve_variants() -> Vec<crate::jit::KernelVariant> {
    use crate::linear::dtans_config_for;
    use crate::ops::dtans::{DtansKind, DtansOut};
    use entrollm_model::synth::SynthShape;
    let mut v = Vec::new();
    for c in [
        e2e_config(),
        SynthShape::Llama31_8B.config(),
        SynthShape::Llama33_70B.config(),
    ] {
        let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        for (rows, cols) in [
            (q + 2 * kv, h),
            (h, q),
            (2 * inter, h),
            (h, inter),
            (c.vocab_size, h),
        ] {
            let compact = CodingPlan::from_json(COMPACT_PLAN_JSON, None).expect("a valid plan");
            let mut codings = vec![bf16_coding_for(rows, cols).0];
            codings.extend(compact.launches.values().flatten().copied());
            for coding in codings {
                let kind = DtansKind::of(Payload::Bf16, &coding, cols, None);
                for out in [DtansOut::Mvm, DtansOut::Dequant] {
                    if let Ok(cfg) = dtans_config_for(Payload::Bf16, &coding, rows, cols, None, out)
                    {
                        let var = kind.variant(cfg, out);
                        if !v.contains(&var) {
                            v.push(var);
                        }
                    }
                }
            }
        }
    }
    v
}

/// The kernel variants [`GpuModel::upload_coded`] launches for `w` coded by `plan` (the coder's
/// choices computed as at load), for precompiling cubins; matrices that are not BF16 have none.
pub fn load_variants(
    w: &entrollm_model::weights::ModelWeights,
    plan: &CodingPlan,
) -> Result<Vec<crate::jit::KernelVariant>> {
    use crate::linear::dtans_config_for;
    use crate::ops::dtans::{DtansKind, DtansOut};
    use entrollm_model::weights::Linear;
    let mut launches: Vec<(Vec<&dyn Linear>, bool, Launch)> = Vec::new();
    if !Arc::ptr_eq(&w.embed, &w.lm_head) {
        launches.push((vec![&*w.lm_head], false, Launch::LmHead));
    }
    for l in &w.layers {
        launches.push((vec![&*l.q, &*l.k, &*l.v], false, Launch::Qkv));
        launches.push((vec![&*l.o], false, Launch::O));
        if let Some(g) = l.mlp.gated() {
            launches.push((vec![&*g.gate, &*g.up], true, Launch::GateUp));
            launches.push((vec![&*g.down], false, Launch::Down));
        }
    }
    let mut v = Vec::new();
    for (parts, halves, launch) in launches {
        let Some(bits) = exact_bf16(&parts, halves) else {
            continue;
        };
        let cols = parts[0].cols();
        let rows = bits.len() / cols;
        let coding = match launch_coding(plan, launch) {
            Some(c) => c,
            None => {
                let codes = crate::ops::dtans_encode::bf16_codes(&bits);
                choose_coding_and_width(Payload::Bf16, rows, cols, &codes)
                    .map_err(|e| GpuError::invalid(OP, e.to_string()))?
                    .0
            }
        };
        let kind = DtansKind::of(Payload::Bf16, &coding, cols, None);
        for out in [DtansOut::Mvm, DtansOut::Dequant] {
            let var = kind.variant(
                dtans_config_for(Payload::Bf16, &coding, rows, cols, None, out)?,
                out,
            );
            if !v.contains(&var) {
                v.push(var);
            }
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::dtans_config_for;
    use crate::ops::dtans::DtansOut;
    use entrollm_model::synth::SynthShape;

    /// The coded tensor and its dequantisation when `m` is held dtANS-coded.
    fn coded(
        m: &dyn entrollm_model::weights::Linear,
    ) -> Option<(&DtansTensor, entrollm_codec::matvec::Dequant<'_>)> {
        m.as_any()
            .downcast_ref::<entrollm_model::forms::dtans::CodedLinear>()
            .map(|c| c.coded())
    }

    #[test]
    fn tuned_plans_have_kernels_for_every_shape() {
        let compact = CodingPlan::from_json(COMPACT_PLAN_JSON, None).unwrap();
        for (c, plan) in [
            e2e_config(),
            SynthShape::Llama31_8B.config(),
            SynthShape::Llama33_70B.config(),
        ]
        .into_iter()
        .flat_map(|c| [(c.clone(), tuned_plan(&c)), (c, compact.clone())])
        {
            let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
            for (name, rows, cols) in [
                ("model.layers.0.self_attn.q_proj.weight", q + 2 * kv, h),
                ("model.layers.0.self_attn.o_proj.weight", h, q),
                ("model.layers.0.mlp.gate_proj.weight", 2 * inter, h),
                ("model.layers.0.mlp.down_proj.weight", h, inter),
                ("lm_head.weight", c.vocab_size, h),
            ] {
                let coding = plan
                    .coding_for(name)
                    .expect("tuned plans name every launch");
                check_coding(Payload::Bf16, &coding).unwrap();
                for out in [DtansOut::Mvm, DtansOut::Dequant] {
                    dtans_config_for(Payload::Bf16, &coding, rows, cols, None, out)
                        .unwrap_or_else(|e| panic!("{name} {rows}×{cols} {coding}: {e}"));
                }
            }
        }
        assert!(serve_variants().len() >= 10);
    }

    #[test]
    fn exact_bf16_stacks_interleaves_and_rejects_other_precisions() {
        use entrollm_model::weights::Linear;
        use entrollm_model::{DenseBf16, DenseF16, DenseF32};
        let bits = |n: usize, base: u16| -> Vec<u16> { (0..n as u16).map(|i| base + i).collect() };
        let a = DenseBf16::new("a", 2, 3, bits(6, 0x3F00)).unwrap();
        let b = DenseBf16::new("b", 2, 3, bits(6, 0x4000)).unwrap();
        let c = DenseBf16::new("c", 1, 3, bits(3, 0xBC00)).unwrap();
        let parts: [&dyn Linear; 3] = [&a, &b, &c];
        let mut want = bits(6, 0x3F00);
        want.extend(bits(6, 0x4000));
        want.extend(bits(3, 0xBC00));
        assert_eq!(exact_bf16(&parts, false).unwrap(), want);
        // gate/up interleaved: gate row 0, up row 0, gate row 1, up row 1.
        let want: Vec<u16> = [0x3F00, 0x3F01, 0x3F02, 0x4000, 0x4001, 0x4002]
            .into_iter()
            .chain([0x3F03, 0x3F04, 0x3F05, 0x4003, 0x4004, 0x4005])
            .collect();
        assert_eq!(exact_bf16(&[&a, &b], true).unwrap(), want);
        // Parts that cannot be interleaved or stacked.
        assert!(exact_bf16(&[&a, &c], true).is_none());
        let wide = DenseBf16::new("w", 1, 4, bits(4, 0x3F00)).unwrap();
        assert!(exact_bf16(&[&a, &wide], false).is_none());
        // F32 and F16 values BF16 cannot hold: not coded. Values it can hold are (lossless).
        let f32m = DenseF32::new("f", 1, 2, vec![1.0, 1.0 + 1.0 / 1024.0]).unwrap();
        assert!(exact_bf16(&[&f32m], false).is_none());
        let f16m = DenseF16::new("h", 1, 2, vec![0x3C01, 0x3C00]).unwrap();
        assert!(exact_bf16(&[&f16m], false).is_none());
        let exact = DenseF32::new("e", 1, 2, vec![1.0, -0.5]).unwrap();
        assert_eq!(exact_bf16(&[&exact], false).unwrap(), [0x3F80, 0xBF00]);
    }

    #[test]
    fn load_plans_are_checked_before_any_work() {
        let c = e2e_config();
        check_load_plan(&c, &tuned_plan(&c)).unwrap();
        check_load_plan(&c, &CodingPlan::uniform(None)).unwrap();
        check_load_plan(&c, &CodingPlan::from_json(COMPACT_PLAN_JSON, None).unwrap()).unwrap();
        let mut plan = tuned_plan(&c);
        plan.launches
            .insert(Launch::Down, Coding::parse("quad:10:1024").unwrap());
        let e = check_load_plan(&c, &plan).unwrap_err().to_string();
        assert!(e.contains("down") && e.contains("quad"), "{e}");
        let plan = CodingPlan::uniform(Coding::parse("single:16:1024").unwrap());
        let e = check_load_plan(&c, &plan).unwrap_err().to_string();
        assert!(e.contains("qkv") && e.contains("single"), "{e}");
    }

    #[test]
    fn load_variants_cover_the_tuned_launches() {
        let c = e2e_config();
        let w = dense_weights(&c, 2).unwrap();
        let tuned = load_variants(&w, &tuned_plan(&c)).unwrap();
        let serve = serve_variants();
        assert!(!tuned.is_empty() && tuned.iter().all(|v| serve.contains(v)));
        assert!(!load_variants(&w, &CodingPlan::uniform(None))
            .unwrap()
            .is_empty());
    }

    #[test]
    fn dense_weights_are_the_served_weights_decoded() {
        let c = e2e_config();
        let (d, s) = (
            dense_weights(&c, 5).unwrap(),
            served_weights(&c, 5, &tuned_plan(&c)).unwrap(),
        );
        let row = |m: &dyn entrollm_model::weights::Linear, r: usize| {
            let mut v = vec![0f32; m.cols()];
            m.row(r, &mut v);
            v
        };
        for (a, b) in [
            (&d.layers[1].q, &s.layers[1].q),
            (
                &d.layers[0].gated().unwrap().up,
                &s.layers[0].gated().unwrap().up,
            ),
        ] {
            assert!(coded(a.as_ref()).is_none() && coded(b.as_ref()).is_some());
            for r in [0, a.rows() - 1] {
                assert_eq!(row(&**a, r), row(&**b, r));
            }
        }
    }

    #[test]
    fn served_weights_keep_every_matrix_coded() {
        let c = e2e_config();
        let w = served_weights(&c, 3, &tuned_plan(&c)).unwrap();
        assert!(coded(w.embed.as_ref()).is_none());
        assert!(coded(w.lm_head.as_ref()).is_some());
        for l in &w.layers {
            let qkv: Vec<_> = [&l.q, &l.k, &l.v]
                .iter()
                .map(|m| coded(m.as_ref()).expect("coded").0.coding)
                .collect();
            assert!(
                qkv.iter().all(|c| *c == qkv[0]),
                "one launch needs one coding"
            );
            let mlp = l.gated().unwrap();
            let (g, u) = (
                coded(mlp.gate.as_ref()).unwrap().0,
                coded(mlp.up.as_ref()).unwrap().0,
            );
            assert_eq!(g.coding, u.coding);
            assert!(coded(l.o.as_ref()).is_some() && coded(mlp.down.as_ref()).is_some());
        }
    }

    #[test]
    fn one_coded_layer_decodes_to_its_weights() {
        let c = e2e_config();
        let ts = tensors(&c);
        let hl = host_layer(&ts, 7).unwrap();
        let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        // gate/up interleaved: row 2i is gate row i, row 2i + 1 up row i.
        let gate = bf16_bits(find(&ts, "model.layers.0.mlp.gate_proj.weight").unwrap(), 7);
        let up = bf16_bits(find(&ts, "model.layers.0.mlp.up_proj.weight").unwrap(), 7);
        assert_eq!(&hl.gate_up[..h], &gate[..h]);
        assert_eq!(&hl.gate_up[h..2 * h], &up[..h]);
        assert_eq!(&hl.gate_up[2 * h..3 * h], &gate[h..2 * h]);
        let plan = tuned_plan(&c);
        for (bits, rows, cols, coding) in [
            (&hl.qkv, q + 2 * kv, h, plan.launches[&Launch::Qkv]),
            (&hl.down, h, inter, plan.launches[&Launch::Down]),
            (&hl.gate_up, 2 * inter, h, None),
            (&hl.qkv, q + 2 * kv, h, None),
            (&hl.o, h, q, None),
            (&hl.down, h, inter, None),
        ] {
            let t = code_bf16(bits, rows, cols, coding, None).unwrap();
            for out in [DtansOut::Mvm, DtansOut::Dequant] {
                dtans_config_for(Payload::Bf16, &t.coding, rows, cols, None, out).unwrap();
            }
            let dec = t.decode().unwrap();
            let got: Vec<u16> = dec
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            assert_eq!(&got, bits, "{rows}×{cols} {:?}", t.coding);
        }
    }
}

#[cfg(test)]
mod coding_sizes {
    use super::*;
    use entrollm_model::synth::{fill_row, SynthShape};

    /// Predicted bits/weight of candidate codings on the synthetic distribution (512-row samples of
    /// each Llama-3.3-70B layer matrix): `cargo test --release -p entrollm-cuda --lib
    /// coding_sizes -- --ignored --nocapture`.
    #[test]
    #[ignore = "prints a table; seconds of CPU"]
    fn predicted_bits_per_weight() {
        let c = SynthShape::Llama33_70B.config();
        for t in tensors(&c)
            .iter()
            .filter(|t| t.name.starts_with("model.layers.0.") && t.shape.len() == 2)
        {
            let cols = t.shape[1];
            let rows = 512;
            let mut bytes = Vec::with_capacity(rows * cols * 2);
            let mut buf = vec![0f32; cols];
            for r in 0..rows {
                fill_row(t, 0, r, &mut buf);
                for &v in &buf {
                    bytes.extend(half::bf16::from_f32(v).to_bits().to_le_bytes());
                }
            }
            let (codes, _) = Payload::Bf16.symbolize(&bytes).unwrap();
            let auto = choose_coding_and_width(Payload::Bf16, rows, cols, &codes).unwrap();
            let mut line = format!(
                "{:<32} auto {} {:.3}",
                t.name,
                auto.0,
                auto.1 * 8.0 / (rows * cols) as f64
            );
            for s in [
                "pair:8:1024:16",
                "pair:9:1024:22",
                "pair:10:1024:32",
                "single:8:1024",
                "pair:9:256:22",
                "pair:10:256:32",
                "single:8:512",
                "single:8:2048",
            ] {
                let coding = Coding::parse(s).unwrap().unwrap();
                let b =
                    DtansTensor::predict_bytes(Payload::Bf16, rows, cols, &codes, coding).unwrap();
                line += &format!(" | {s} {:.3}", b * 8.0 / (rows * cols) as f64);
            }
            println!("{line}");
        }
    }
}

/// The coding `plan` gives a launch (None: the coder's choice).
fn launch_coding(plan: &CodingPlan, l: Launch) -> Option<Coding> {
    plan.launches.get(&l).copied().unwrap_or(plan.default)
}

/// Checks every coding `plan` names for the launches of `c` at their stacked shapes, before any
/// work: a coding the kernels do not run fails here, naming the launch and the coding.
pub fn check_load_plan(c: &ModelConfig, plan: &CodingPlan) -> Result<()> {
    let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    for (l, rows, cols) in [
        (Launch::Qkv, q + 2 * kv, h),
        (Launch::O, h, q),
        (Launch::GateUp, 2 * inter, h),
        (Launch::Down, h, inter),
        (Launch::LmHead, c.vocab_size, h),
    ] {
        if let Some(coding) = launch_coding(plan, l) {
            check_kernels(&format!("the {} launch", l.name()), &coding, rows, cols)?;
        }
    }
    Ok(())
}

impl GpuModel {
    /// Uploads a model serving its dtANS-coded matrices as stored (a container opened with
    /// `fused`: the coded arrays go to the device, nothing is decoded to BF16; the loader has
    /// already checked each tensor's checksum on its host decode). q/k/v run as one stacked
    /// launch and gate/up as one launch over [gate; up] when their parts share a coding; matrices
    /// that are not coded (or whose parts cannot share a launch) are uploaded dense as
    /// [`GpuModel::upload`] does, and so is the embedding (a lookup reads one row). Returns the
    /// model and the launches each form took.
    /// FP8 checkpoints' matrices stay FP8, kept as `serving.fp8` says; BF16 ones are palette-packed
    /// with `serving.bf16_palette`.
    pub fn upload_served(
        dev: &GpuDevice,
        w: &entrollm_model::weights::ModelWeights,
        serving: Serving,
    ) -> Result<(Self, LoadReport)> {
        serve(dev, w, None, serving, &mut |_, _| {})
    }

    /// [`GpuModel::upload_served`], and every layer/head launch the container does not hold coded
    /// (all of them for a BF16 checkpoint) is coded at load with the coding `plan` gives its launch
    /// (None: the coder's choice for the stacked matrix): q/k/v stacked and gate/up interleaved as
    /// the engine serves them, coded by `encoder` (on the GPU: from device memory, the coded arrays
    /// stay there) and served by the fused kernels. Matrices that are not BF16 are served dense,
    /// with a note in the report; a tied LM head is the dense embedding. The plan's codings are
    /// checked against the kernels before any work. `progress(done, total)` follows the layers.
    pub fn upload_coded(
        dev: &GpuDevice,
        w: &entrollm_model::weights::ModelWeights,
        plan: &CodingPlan,
        encoder: Encoder,
        fp8: Fp8Serving,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(Self, LoadReport)> {
        crate::engine::check_supported(&w.config)?;
        check_load_plan(&w.config, plan)?;
        serve(dev, w, Some((plan, encoder)), fp8.into(), progress)
    }
}

/// A layer's q/k/v biases as one vector (zeros for a part without), None without any.
fn upload_qkv_bias(
    dev: &GpuDevice,
    l: &entrollm_model::LayerWeights,
    q: usize,
    kv: usize,
) -> Result<Option<CudaSlice<f32>>> {
    Ok(match (&l.q_bias, &l.k_bias, &l.v_bias) {
        (None, None, None) => None,
        (qb, kb, vb) => {
            let mut b = qb.clone().unwrap_or_else(|| vec![0.0; q]);
            b.extend(kb.clone().unwrap_or_else(|| vec![0.0; kv]));
            b.extend(vb.clone().unwrap_or_else(|| vec![0.0; kv]));
            Some(crate::engine::upload_f32(dev, &b)?)
        }
    })
}

/// [`GpuModel::upload_served`] and, with a plan, [`GpuModel::upload_coded`].
fn serve(
    dev: &GpuDevice,
    w: &entrollm_model::weights::ModelWeights,
    code: Option<(&CodingPlan, Encoder)>,
    serving: Serving,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(GpuModel, LoadReport)> {
    use crate::engine::{rounded_bf16, upload_f32};
    use entrollm_model::weights::Linear;
    let c = &w.config;
    crate::engine::check_supported(c)?;
    let beyond = crate::families::unsupported(w);
    if !beyond.is_empty() {
        return Err(GpuError::invalid(
            "gpu model",
            format!(
                "the GPU engine does not run {} models yet ({}); run it on the CPU (--device cpu)",
                c.arch.family().name,
                beyond.join(", ")
            ),
        ));
    }
    let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    // A mixture of experts: the router, the slots' gate/up products (the ggml gathered product
    // before SwiGLU), one expert's gate/up dequantised for prefill.
    let (moe_rows, moe_weights) = c.block.moe.as_ref().map_or((0, 0), |m| {
        let ie = m.intermediate_size;
        (
            m.experts.max(m.top_k * 2 * ie),
            (m.experts * h).max(2 * ie * h),
        )
    });
    let max_rows = [q + 2 * kv, h, 2 * inter, c.vocab_size, moe_rows]
        .into_iter()
        .max()
        .unwrap_or(1);
    let max_weights = [
        (q + 2 * kv) * h,
        h * q,
        2 * inter * h,
        h * inter,
        moe_weights,
    ]
    .into_iter()
    .max()
    .unwrap_or(1);
    let scratch: SharedScratch = Arc::new(Mutex::new(DtansScratch::new(
        dev,
        max_rows,
        [h, q, inter].into_iter().max().unwrap_or(1),
        // Served decoded, no form uses the scratch.
        if serving.decoded { 0 } else { max_weights },
    )?));
    let mut r = LoadReport::default();
    let policy = Policy {
        fp8: serving.fp8,
        // (Coding at load codes BF16 matrices; packing them as well is refused by the CLI.)
        bf16_palette: serving.bf16_palette && code.is_none(),
        code: None,
    };
    // A plan's launch configuration for launch `id`, applied to `l` (an error names the launch).
    let configure = |mut l: GpuLinear, id: &str| -> Result<GpuLinear> {
        if let Some(c) = serving.launches.get(id) {
            l.set_launch_config(c)
                .map_err(|e| GpuError::invalid("plan", format!("launch {id}: {e}")))?;
        }
        Ok(l)
    };
    let serve = |parts: &[&dyn Linear],
                 halves: bool,
                 launch: Launch,
                 what: &str,
                 policy,
                 r: &mut LoadReport| {
        let policy = Policy {
            code: code.map(|(plan, encoder)| (launch_coding(plan, launch), encoder)),
            ..policy
        };
        let up = Upload {
            dev,
            scratch: &scratch,
            policy,
            what,
        };
        if !serving.decoded {
            if let Some(l) = forms::upload(&up, parts, halves, r)? {
                return Ok(l);
            }
        }
        rounded_bf16(dev, parts, halves)
    };
    let embed = rounded_bf16(dev, &[&*w.embed], false)?;
    let lm_head = if Arc::ptr_eq(&w.embed, &w.lm_head) {
        None
    } else {
        // An FP8 checkpoint's BF16 head is palette-packed beside its packed matrices (MINE codes
        // the LM head as well, in BF16).
        let fp8_checkpoint = w.layers.iter().any(|l| forms::is_fp8(&*l.q));
        let head = Policy {
            bf16_palette: policy.bf16_palette
                || (code.is_none() && fp8_checkpoint && serving.fp8 != Fp8Serving::Dense),
            ..policy
        };
        let l = serve(
            &[&*w.lm_head],
            false,
            Launch::LmHead,
            "lm_head",
            head,
            &mut r,
        )?;
        Some(configure(l, "lm_head")?)
    };
    let mut layers: Vec<GpuLayer> = Vec::with_capacity(w.layers.len());
    // A layer whose matrices are an earlier layer's (the same host matrices: a synthetic model's
    // layers) gets device copies of that layer's launches, with nothing stacked, packed or coded
    // again; the report counts it as that layer was counted.
    let mut seen: HashMap<[usize; 7], (usize, BTreeMap<&'static str, usize>)> = HashMap::new();
    for (i, l) in w.layers.iter().enumerate() {
        if let Mlp::Experts(ex) = &l.mlp {
            let moe = c.block.moe.as_ref().ok_or_else(|| {
                GpuError::invalid("gpu model", format!("layer {i}: experts without a config"))
            })?;
            let what = |s: &str| format!("layer {i} {s}");
            let id = |s: &str| format!("layers.{i}.{s}");
            let qkv = serve(
                &[&*l.q, &*l.k, &*l.v],
                false,
                Launch::Qkv,
                &what("qkv"),
                policy,
                &mut r,
            )?;
            let o = serve(&[&*l.o], false, Launch::O, &what("o"), policy, &mut r)?;
            let router = serve(
                &[&*ex.router],
                false,
                Launch::Router,
                &what("router"),
                policy,
                &mut r,
            )?;
            // Each of gate/up and down as one stack over the experts, in a form with a gathered
            // product (forms::upload_experts).
            let gate_up: Vec<Vec<&dyn Linear>> = ex
                .experts
                .iter()
                .map(|x| vec![&*x.gate as &dyn Linear, &*x.up])
                .collect();
            let down: Vec<Vec<&dyn Linear>> = ex
                .experts
                .iter()
                .map(|x| vec![&*x.down as &dyn Linear])
                .collect();
            let up = Upload {
                dev,
                scratch: &scratch,
                policy,
                what: &what("experts"),
            };
            let (gate_up, down) = if serving.decoded {
                (
                    forms::bf16::experts_rounded(dev, &gate_up, true)?,
                    forms::bf16::experts_rounded(dev, &down, false)?,
                )
            } else {
                (
                    forms::upload_experts(&up, &gate_up, true, &mut r)?,
                    forms::upload_experts(&up, &down, false, &mut r)?,
                )
            };
            layers.push(GpuLayer {
                attn_norm: upload_f32(dev, &l.attn_norm)?,
                qkv: configure(qkv, &id("qkv"))?,
                qkv_bias: upload_qkv_bias(dev, l, q, kv)?,
                o: configure(o, &id("o"))?,
                mlp_norm: upload_f32(dev, &l.mlp_norm)?,
                gate_up,
                down,
                norms: crate::engine::GpuNorms::upload(dev, &l.norms)?,
                moe: Some(crate::engine::GpuMoe::upload(
                    dev,
                    c,
                    moe,
                    ex,
                    configure(router, &id("router"))?,
                )?),
            });
            progress(i + 1, w.layers.len());
            continue;
        }
        let g = l
            .gated()
            .map_err(|e| GpuError::invalid("gpu model", format!("layer {i}: {e}")))?;
        let key = [&l.q, &l.k, &l.v, &l.o, &g.gate, &g.up, &g.down]
            .map(|m| Arc::as_ptr(m) as *const () as usize);
        let before = r.launches.clone();
        let copy = seen.get(&key).cloned();
        let qkv_bias = upload_qkv_bias(dev, l, q, kv)?;
        let what = |s: &str| format!("layer {i} {s}");
        let id = |s: &str| format!("layers.{i}.{s}");
        if let Some((j, d)) = copy {
            let src = &layers[j];
            let layer = GpuLayer {
                attn_norm: upload_f32(dev, &l.attn_norm)?,
                qkv: configure(src.qkv.duplicate(dev)?, &id("qkv"))?,
                qkv_bias,
                o: configure(src.o.duplicate(dev)?, &id("o"))?,
                mlp_norm: upload_f32(dev, &l.mlp_norm)?,
                gate_up: configure(src.gate_up.duplicate(dev)?, &id("gate_up"))?,
                down: configure(src.down.duplicate(dev)?, &id("down"))?,
                norms: crate::engine::GpuNorms::upload(dev, &l.norms)?,
                moe: None,
            };
            layers.push(layer);
            r.add(&d);
            progress(i + 1, w.layers.len());
            continue;
        }
        let qkv = serve(
            &[&*l.q, &*l.k, &*l.v],
            false,
            Launch::Qkv,
            &what("qkv"),
            policy,
            &mut r,
        )?;
        let o = serve(&[&*l.o], false, Launch::O, &what("o"), policy, &mut r)?;
        let gate_up = serve(
            &[&*g.gate, &*g.up],
            true,
            Launch::GateUp,
            &what("gate_up"),
            policy,
            &mut r,
        )?;
        let down = serve(
            &[&*g.down],
            false,
            Launch::Down,
            &what("down"),
            policy,
            &mut r,
        )?;
        layers.push(GpuLayer {
            attn_norm: upload_f32(dev, &l.attn_norm)?,
            qkv: configure(qkv, &id("qkv"))?,
            qkv_bias,
            o: configure(o, &id("o"))?,
            mlp_norm: upload_f32(dev, &l.mlp_norm)?,
            gate_up: configure(gate_up, &id("gate_up"))?,
            down: configure(down, &id("down"))?,
            norms: crate::engine::GpuNorms::upload(dev, &l.norms)?,
            moe: None,
        });
        seen.insert(key, (i, r.since(&before)));
        progress(i + 1, w.layers.len());
    }
    if code.is_some() && lm_head.is_none() {
        r.dense_notes
            .push("lm_head: tied to the embedding, served dense with it".into());
    }
    // (The shared workspace serves prefill's copies to BF16: coded models prefill in longer chunks.)
    let any_coded = r.taken() > 0;
    let m = GpuModel {
        config: c.clone(),
        embed,
        lm_head,
        layers,
        final_norm: upload_f32(dev, &w.final_norm)?,
        coded_scratch: any_coded.then_some(scratch),
    };
    dev.synchronize()?;
    Ok((m, r))
}
