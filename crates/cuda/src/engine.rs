//! The GPU forward pass: [`GpuModel`] (weights in device memory: BF16 matrices as [`GpuLinear`]s,
//! f32 norm weights) and [`GpuEngine`] (BF16 KV cache, prefill, decode steps captured once into
//! CUDA graphs, logits to the host or greedy argmax on the device).
//!
//! The math is the CPU engine's (`entrollm_model::engine`): RMSNorm → fused q/k/v → RoPE (both
//! conventions, llama3 frequency scaling from `rope_inv_freq`) → GQA attention → o + residual →
//! RMSNorm → fused gate/up → SwiGLU → down + residual, final norm, LM head. Differences, all
//! rounding: the KV cache is BF16 (the CPU keeps f32); prefill feeds BF16 activations to the
//! cuBLASLt GEMMs and BF16 probabilities to the tensor-core attention (decode keeps f32 activations
//! and attention); sums run in another order.
//!
//! Decode: the token, its position and the KV length live in device memory, so one captured graph
//! replays for every token: embedding → per layer 8 kernels (RMSNorm; q/k/v GEMV; RoPE + KV
//! append; split-sequence attention partial and combine; o GEMV adding into the residual; RMSNorm;
//! gate/up GEMV with SwiGLU in its epilogue; down GEMV adding into the residual) → LM head GEMV with
//! the final RMSNorm fused in → argmax → a counter update that records the token and advances
//! position and length. [`DecodeOptions`] can also fuse the layers' norms into their GEMVs and
//! merge attention in one launch (both measured slower or even on the H200).
//!
//! Prefill (chunks of up to [`PREFILL_CHUNK`] tokens, [`CODED_PREFILL_CHUNK`] for coded models
//! where memory allows): embedding → per layer RMSNorm (BF16 out) →
//! q/k/v GEMM → RoPE + KV append → causal flash attention (tensor cores) → o GEMM accumulating into
//! the residual → RMSNorm → gate/up GEMM → SwiGLU (BF16 out) → down GEMM accumulating; then the last
//! token's final norm and LM head as in decode.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream};

use entrollm_model::config::RopeStyle;
use entrollm_model::engine::rope_inv_freq;
use entrollm_model::weights::{Linear, ModelWeights};
use entrollm_model::{DenseBf16 as CpuDenseBf16, ModelConfig};

use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::forms::bf16::host_bf16;
use crate::gemm::Gemm;
use crate::linear::{swiglu_config, GpuLinear, SharedScratch};
use crate::ops::argmax::{launch_argmax, ArgmaxScratch};
use crate::ops::attention::{
    launch_attention_decode, launch_attention_decode_fused, AttnConfig, AttnScratch, KvShape,
};
use crate::ops::elementwise::{launch_embedding, launch_swiglu_halves_bf16};
use crate::ops::families::{
    group_by_expert, launch_add_rmsnorm, launch_bias_residual, launch_geglu, launch_moe_combine,
    launch_moe_gather_rows, launch_moe_glu, launch_moe_topk, launch_rope_heads, launch_scale,
    launch_softcap, route, ActOut, ExpertBias, Glu, GroupedRoutes, HeadOps, NextOut, RouteSpec,
};
use crate::ops::forward::*;
use crate::ops::rope::RopeLayout;
pub use crate::plan::DecodeOptions;
use crate::plan::{
    check_nodes, decode_plan, layer_mask, local_rope, programmatic_into, Buf, DecodePlan,
    LayerDesc, Mat, ModelDesc, Norm, Step, MEMSET, PLAIN, SWIGLU,
};

/// Most prompt tokens one prefill pass processes; longer prompts run in chunks (each attends to
/// the cache written by the earlier ones). Bounds the activation workspace.
pub const PREFILL_CHUNK: usize = 2048;

/// Prefill chunk of a model with coded matrices: every chunk dequantises each coded matrix again,
/// so prompts up to this length dequantise once; used when its buffers fit in free device memory
/// beside [`PREFILL_RESERVE`] (else [`PREFILL_CHUNK`]).
pub const CODED_PREFILL_CHUNK: usize = 8192;

/// Device memory a longer coded prefill chunk must leave free (graphs, cuBLASLt, the allocator).
pub const PREFILL_RESERVE: usize = 1 << 30;

/// Bytes per prompt token of the prefill buffers (`PrefillBufs`).
fn prefill_bytes_per_token(c: &ModelConfig) -> usize {
    let (h, qd, inter) = (c.hidden_size, c.q_dim(), c.intermediate_size);
    let width = qd + 2 * c.kv_dim();
    4 + 4 * (h + width + 2 * inter) + 2 * (h + 2 * qd + inter) + moe_prefill_bytes_per_token(c)
}

/// A mixture of experts' routing: (experts, experts per token, rows of an expert's gate).
fn moe_dims(c: &ModelConfig) -> Option<(usize, usize, usize)> {
    c.block
        .moe
        .as_ref()
        .map(|m| (m.experts, m.top_k, m.intermediate_size))
}

/// Bytes per prompt token of a mixture of experts' prefill buffers (`MoePrefill`).
fn moe_prefill_bytes_per_token(c: &ModelConfig) -> usize {
    moe_dims(c).map_or(0, |(e, k, ie)| {
        let h = c.hidden_size;
        4 * (h + e) + 20 * k + k * (2 * h + 4 * 2 * ie + 2 * ie + 4 * h)
    })
}

/// The device memory [`GpuEngine`] needs beside the weights and the KV cache for a context of
/// `max_seq` tokens, with the default decode options: decode buffers and attention partials, the
/// prefill buffers of a [`PREFILL_CHUNK`] (a coded model takes the longer chunk only where free
/// memory allows), the coded matrices' scratch (a BF16 copy of the largest launch, for prefill),
/// the cuBLASLt workspace and the RoPE table. What a memory budget reserves before weights
/// (`tune::reserved_bytes`).
pub fn workspace_bound(c: &ModelConfig, max_seq: usize) -> usize {
    let (h, qd, kvd, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let width = qd + 2 * kvd;
    let chunk = crate::plan::decode_attention(c, &DecodeOptions::default())
        .map_or(1, |a| a.chunk.max(1) as usize);
    let decode = (2 * h + width + 2 * qd + inter + c.vocab_size) * 4
        + (max_seq + 4) * 4
        + 1024 * 8
        + 2 * c.num_layers * 8
        + c.num_heads * max_seq.div_ceil(chunk) * (c.head_dim + 2) * 4;
    let prefill = prefill_bytes_per_token(c) * PREFILL_CHUNK.min(max_seq);
    let max_rows = [width, h, 2 * inter, c.vocab_size]
        .into_iter()
        .max()
        .unwrap_or(1);
    let max_weights = [width * h, h * qd, 2 * inter * h, h * inter]
        .into_iter()
        .max()
        .unwrap_or(1);
    let (max_rows, max_weights) = match moe_dims(c) {
        Some((e, k, ie)) => (
            max_rows.max(k * 2 * ie).max(e),
            max_weights.max(2 * ie * h).max(e * h),
        ),
        None => (max_rows, max_weights),
    };
    let scratch = (max_rows + h.max(qd).max(inter) + 1) * 4 + max_weights * 2;
    // A mixture of experts' decode buffers: router logits, the slots' experts, weights, outputs,
    // activations and (before an activation kernel of their own: `GpuMoe::glu`) gate/up products.
    let decode = decode
        + moe_dims(c).map_or(0, |(e, k, ie)| {
            4 * (e + 2 * k + k * h + k * ie.max(inter) + 2 * k * ie)
        });
    let rope = max_seq * (c.head_dim / 2) * 2 * 4;
    // The families' buffers: gate/up before GeGLU, a projection before its post norm, the
    // sliding layers' RoPE table.
    let family = c.arch.family();
    let geglu = c.block.activation != entrollm_model::config::Activation::Silu;
    let post = family.has(entrollm_model::arch::Role::PostAttnNorm);
    let families = usize::from(geglu) * 2 * inter * 4
        + usize::from(post) * h * 4
        + usize::from(c.block.local_rope_theta.is_some()) * rope;
    decode + prefill + scratch + crate::gemm::WORKSPACE_BYTES + rope + families
}

/// One decoder layer on the device.
pub struct GpuLayer {
    pub attn_norm: CudaSlice<f32>,
    /// q, k and v projections stacked: [q_dim + 2 kv_dim, hidden].
    pub qkv: GpuLinear,
    pub qkv_bias: Option<CudaSlice<f32>>,
    pub o: GpuLinear,
    pub mlp_norm: CudaSlice<f32>,
    /// gate and up projections stacked row-interleaved (gate 0, up 0, gate 1, ...): [2 inter, hidden].
    pub gate_up: GpuLinear,
    pub down: GpuLinear,
    /// The norms only some families have.
    pub norms: GpuNorms,
    /// A mixture of experts in place of the MLP: `gate_up` and `down` are then the stacks of
    /// every expert's (`GpuMatrix::gathered`).
    pub moe: Option<GpuMoe>,
}

/// A layer's mixture of experts on the device: the router and the routing's parameters (the
/// experts are the layer's `gate_up` and `down` stacks).
pub struct GpuMoe {
    pub router: GpuLinear,
    pub experts: usize,
    pub top_k: usize,
    pub norm_topk: bool,
    /// Rows of each expert's gate (and up).
    pub inter: usize,
    /// Softmax then top-k, or top-k then softmax (gpt-oss).
    pub routing: entrollm_model::config::Routing,
    /// The router's bias (`[experts]`; gpt-oss).
    pub router_bias: Option<CudaSlice<f32>>,
    /// The experts' biases (gpt-oss).
    pub biases: Option<GpuExpertBiases>,
    /// The activation as its own kernel (`moe_glu`) after a plain gathered gate/up product: the
    /// experts have biases, or an activation other than SwiGLU (gpt-oss's clamped one). None:
    /// SwiGLU in the gathered product's epilogue.
    pub glu: Option<Glu>,
}

/// Every expert's gate, up and down biases, stacked expert after expert (`[experts, inter]`,
/// `[experts, inter]`, `[experts, hidden]`).
pub struct GpuExpertBiases {
    pub gate: CudaSlice<f32>,
    pub up: CudaSlice<f32>,
    pub down: CudaSlice<f32>,
}

impl GpuMoe {
    /// The device copy of a layer's experts' routing (`ex`, configured by `moe`) around its router
    /// (the expert matrices are the layer's stacks).
    pub fn upload(
        dev: &GpuDevice,
        c: &ModelConfig,
        moe: &entrollm_model::config::Moe,
        ex: &entrollm_model::weights::Experts,
        router: GpuLinear,
    ) -> Result<Self> {
        let biases = if ex.biases.is_empty() {
            None
        } else {
            let cat = |f: &dyn Fn(&entrollm_model::weights::ExpertBiases) -> &Vec<f32>| {
                ex.biases
                    .iter()
                    .flat_map(|b| f(b).iter().copied())
                    .collect::<Vec<f32>>()
            };
            let (gate, up, down) = (cat(&|b| &b.gate), cat(&|b| &b.up), cat(&|b| &b.down));
            let (e, ie, h) = (ex.experts.len(), moe.intermediate_size, c.hidden_size);
            if ex.biases.len() != e
                || gate.len() != e * ie
                || up.len() != e * ie
                || down.len() != e * h
            {
                return Err(GpuError::invalid(
                    "gpu model",
                    "the experts' biases do not match their experts",
                ));
            }
            Some(GpuExpertBiases {
                gate: upload_f32(dev, &gate)?,
                up: upload_f32(dev, &up)?,
                down: upload_f32(dev, &down)?,
            })
        };
        let glu = Glu::of(&c.block);
        Ok(GpuMoe {
            router,
            experts: ex.experts.len(),
            top_k: moe.top_k,
            norm_topk: moe.norm_topk,
            inter: moe.intermediate_size,
            routing: moe.routing,
            router_bias: ex
                .router_bias
                .as_deref()
                .map(|b| upload_f32(dev, b))
                .transpose()?,
            glu: (biases.is_some() || glu != Glu::Silu).then_some(glu),
            biases,
        })
    }

    /// How the router picks and weighs the experts.
    pub fn spec(&self) -> RouteSpec {
        RouteSpec {
            top_k: self.top_k,
            norm_topk: self.norm_topk,
            routing: self.routing,
        }
    }
}

/// RMSNorm weights (f32) of the norms only some families have ([`entrollm_model::weights::ExtraNorms`]).
#[derive(Default)]
pub struct GpuNorms {
    /// Of each q and each k head (`[head_dim]`), before RoPE.
    pub qk: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// Of the attention's output before its residual add (`[hidden]`).
    pub post_attn: Option<CudaSlice<f32>>,
    /// Of the MLP's output before its residual add (`[hidden]`).
    pub post_mlp: Option<CudaSlice<f32>>,
    /// The attention output projection's bias (`[hidden]`; gpt-oss).
    pub o_bias: Option<CudaSlice<f32>>,
    /// A logit per query head joined to the attention's softmax (`[heads]`; gpt-oss).
    pub sinks: Option<CudaSlice<f32>>,
}

impl GpuNorms {
    /// Uploads `n` (a q norm without a k norm is refused before: `crate::families`).
    pub fn upload(dev: &GpuDevice, n: &entrollm_model::weights::ExtraNorms) -> Result<Self> {
        let up = |v: &Option<Vec<f32>>| v.as_deref().map(|v| upload_f32(dev, v)).transpose();
        let qk = match (up(&n.q)?, up(&n.k)?) {
            (Some(q), Some(k)) => Some((q, k)),
            (None, None) => None,
            _ => {
                return Err(GpuError::invalid(
                    "gpu model",
                    "a q norm without a k norm (or the reverse)",
                ))
            }
        };
        Ok(GpuNorms {
            qk,
            post_attn: up(&n.post_attn)?,
            post_mlp: up(&n.post_mlp)?,
            o_bias: up(&n.o_bias)?,
            sinks: up(&n.sinks)?,
        })
    }

    fn bytes(&self) -> usize {
        let len = |v: &Option<CudaSlice<f32>>| v.as_ref().map_or(0, |v| v.len() * 4);
        self.qk.as_ref().map_or(0, |(q, k)| (q.len() + k.len()) * 4)
            + len(&self.post_attn)
            + len(&self.post_mlp)
            + len(&self.o_bias)
            + len(&self.sinks)
    }
}

/// A model's weights in device memory.
pub struct GpuModel {
    pub config: ModelConfig,
    pub embed: GpuLinear,
    /// None when tied to the embedding.
    pub lm_head: Option<GpuLinear>,
    pub layers: Vec<GpuLayer>,
    pub final_norm: CudaSlice<f32>,
    /// Scratch of the coded matrices (`engine_coded`), None when every matrix is dense.
    pub coded_scratch: Option<SharedScratch>,
}

pub fn check_supported(c: &ModelConfig) -> Result<()> {
    c.validate()
        .map_err(|e| GpuError::invalid("gpu model", e.to_string()))?;
    if c.head_dim % 32 != 0 || c.head_dim > 256 {
        return Err(GpuError::invalid(
            "gpu model",
            format!(
                "head_dim {} is not supported on the GPU (a multiple of 32 up to 256)",
                c.head_dim
            ),
        ));
    }
    let moe_inter = c.block.moe.as_ref().map_or(8, |m| m.intermediate_size);
    if c.hidden_size % 8 != 0
        || c.intermediate_size % 8 != 0
        || c.q_dim() % 8 != 0
        || moe_inter % 8 != 0
    {
        return Err(GpuError::invalid(
            "gpu model",
            "hidden, intermediate (the experts' too) and q sizes must be multiples of 8",
        ));
    }
    AttnConfig::for_heads(c.head_dim, c.num_heads, c.num_kv_heads)?;
    Ok(())
}

/// `parts` row-stacked (`halves`: gate and up rows interleaved, g0, u0, g1, u1, ..., so the decode
/// GEMV computes a pair in one warp and applies SwiGLU in its epilogue, and prefill GEMM rows hold
/// (gate, up) pairs) as one dense BF16 matrix, rounded where the values are not BF16.
pub(crate) fn rounded_bf16(
    dev: &GpuDevice,
    parts: &[&dyn Linear],
    halves: bool,
) -> Result<GpuLinear> {
    let (rows, cols, bits) = crate::forms::stack(parts, halves, |p| Some(host_bf16(p).into()))
        .ok_or_else(|| {
            GpuError::invalid(
                "dense upload",
                "the parts of a launch must share their columns (and gate/up their rows)",
            )
        })?;
    GpuLinear::dense_from_host(dev, rows, cols, &bits)
}

pub(crate) fn upload_f32(dev: &GpuDevice, v: &[f32]) -> Result<CudaSlice<f32>> {
    dev.stream()
        .clone_htod(v)
        .while_(|| format!("uploading {} floats", v.len()))
}

impl GpuModel {
    /// Uploads a model with every matrix as dense BF16 (decoded; lossless for BF16 values,
    /// rounded otherwise), q/k/v and gate/up stacked into one matrix each, norms and biases f32:
    /// [`GpuModel::upload_served`] with [`Serving::DECODED`](crate::linear::Serving::DECODED).
    pub fn upload(dev: &GpuDevice, w: &ModelWeights) -> Result<Self> {
        Ok(Self::upload_served(dev, w, crate::linear::Serving::DECODED)?.0)
    }

    pub fn lm_head(&self) -> &GpuLinear {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// What the decode step is made from (every launch's form, shape and configuration) on a
    /// device of `sms` SMs: the input of [`crate::plan::decode_plan`].
    pub fn desc(&self, sms: u32) -> ModelDesc {
        ModelDesc {
            config: self.config.clone(),
            sms,
            embed: self.embed.desc(),
            lm_head: self.lm_head.as_ref().map(GpuLinear::desc),
            layers: self
                .layers
                .iter()
                .map(|l| LayerDesc {
                    qkv: l.qkv.desc(),
                    qkv_bias: l.qkv_bias.is_some(),
                    qk_norm: l.norms.qk.is_some(),
                    post_attn_norm: l.norms.post_attn.is_some(),
                    post_mlp_norm: l.norms.post_mlp.is_some(),
                    o_bias: l.norms.o_bias.is_some(),
                    o: l.o.desc(),
                    gate_up: l.gate_up.desc(),
                    down: l.down.desc(),
                    moe: l.moe.as_ref().map(|m| crate::plan::MoeDesc {
                        router: m.router.desc(),
                        experts: m.experts,
                        top_k: m.top_k,
                        norm_topk: m.norm_topk,
                        topk_first: m.spec().topk_first(),
                        router_bias: m.router_bias.is_some(),
                        expert_biases: m.biases.is_some(),
                        glu: m.glu,
                    }),
                })
                .collect(),
        }
    }

    /// Device bytes of all weights (the embedding counted once when tied).
    pub fn weight_bytes(&self) -> usize {
        let norms = (2 * self.layers.len() + 1) * self.config.hidden_size * 4;
        let biases: usize = self
            .layers
            .iter()
            .map(|l| l.qkv_bias.as_ref().map_or(0, |b| b.len() * 4) + l.norms.bytes())
            .sum();
        self.embed.stored_bytes()
            + self.lm_head.as_ref().map_or(0, |l| l.stored_bytes())
            + self.layer_matrix_bytes()
            + norms
            + biases
    }

    fn layer_matrix_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                l.qkv.stored_bytes()
                    + l.o.stored_bytes()
                    + l.gate_up.stored_bytes()
                    + l.down.stored_bytes()
                    + l.moe.as_ref().map_or(0, |m| m.router.stored_bytes())
            })
            .sum()
    }

    /// Weight bytes a decode step reads: every layer matrix (of a mixture of experts the router
    /// and the routed experts only), the LM head and the norms (the embedding contributes one
    /// row).
    pub fn bytes_per_token(&self) -> usize {
        let h = self.config.hidden_size;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let mlp = l.gate_up.stored_bytes() + l.down.stored_bytes();
                l.qkv.stored_bytes()
                    + l.o.stored_bytes()
                    + match &l.moe {
                        Some(m) => m.router.stored_bytes() + mlp / m.experts * m.top_k,
                        None => mlp,
                    }
            })
            .sum();
        layers + self.lm_head().stored_bytes() + (2 * self.layers.len() + 1) * h * 4 + h * 2
    }
}

/// The model with every matrix rounded to BF16 exactly as [`GpuModel::upload`] rounds it (norms
/// and biases kept f32, as on the GPU): the CPU reference for GPU-vs-CPU comparisons.
pub fn bf16_rounded(w: &ModelWeights) -> Result<ModelWeights> {
    let conv = |name: &str, m: &Arc<dyn Linear>| -> Result<Arc<dyn Linear>> {
        let d = CpuDenseBf16::new(name, m.rows(), m.cols(), host_bf16(&**m))
            .map_err(|e| GpuError::invalid("bf16_rounded", e.to_string()))?;
        Ok(Arc::new(d))
    };
    let embed = conv("embed", &w.embed)?;
    let lm_head = if Arc::ptr_eq(&w.embed, &w.lm_head) {
        Arc::clone(&embed)
    } else {
        conv("lm_head", &w.lm_head)?
    };
    let layers = w
        .layers
        .iter()
        .map(|l| l.map_matrices(|launch, _, m| conv(launch, m)))
        .collect::<Result<Vec<_>>>()?;
    Ok(ModelWeights {
        config: w.config.clone(),
        embed,
        layers,
        final_norm: w.final_norm.clone(),
        lm_head,
    })
}

/// Device memory the engine holds, by purpose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryUse {
    pub weights: usize,
    pub kv_cache: usize,
    /// Activations, attention and argmax scratch, prefill buffers, cuBLASLt workspace.
    pub workspace: usize,
}

/// A captured decode step. With programmatic dependent launch, every kernel-to-kernel edge into a
/// [`crate::plan::PDL_KERNELS`] kernel is turned into a programmatic one (what a capture of launches with
/// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` records) and the graph instantiated
/// again: a kernel is launched once every block of its predecessor has passed `pdl_trigger()`, so
/// its launch and its first weight loads overlap the predecessor's tail.
struct DecodeGraph {
    graph: CudaGraph,
    /// The instance with programmatic edges (None: `graph`'s own instance, plain edges).
    pdl_exec: Option<sys::CUgraphExec>,
    stream: Arc<CudaStream>,
    programmatic_edges: usize,
}

impl DecodeGraph {
    fn new(graph: CudaGraph, stream: &Arc<CudaStream>, opts: DecodeOptions) -> Result<Self> {
        let mut g = DecodeGraph {
            graph,
            pdl_exec: None,
            stream: Arc::clone(stream),
            programmatic_edges: 0,
        };
        if opts.pdl {
            let cu_graph = g.graph.cu_graph();
            // SAFETY: the graph is owned by `g.graph`, alive, and used by this thread alone.
            g.programmatic_edges = unsafe { make_edges_programmatic(cu_graph, &opts) }?;
            let mut exec: sys::CUgraphExec = std::ptr::null_mut();
            // SAFETY: as above; `exec` receives a new instance that Drop destroys.
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, cu_graph, 0) }
                .result()
                .while_(|| "instantiating the decode graph with programmatic edges".into())?;
            g.pdl_exec = Some(exec);
        }
        Ok(g)
    }

    fn upload(&self) -> Result<()> {
        match self.pdl_exec {
            None => self.graph.upload(),
            Some(exec) => {
                self.stream.context().bind_to_thread().and_then(|()| {
                    // SAFETY: a live instance and stream.
                    unsafe { sys::cuGraphUpload(exec, self.stream.cu_stream()) }.result()
                })
            }
        }
        .while_(|| "uploading the decode graph".into())
    }

    fn launch(&self) -> Result<()> {
        match self.pdl_exec {
            None => self.graph.launch(),
            Some(exec) => {
                self.stream.context().bind_to_thread().and_then(|()| {
                    // SAFETY: a live instance and stream.
                    unsafe { sys::cuGraphLaunch(exec, self.stream.cu_stream()) }.result()
                })
            }
        }
        .while_(|| "replaying the decode step".into())
    }
}

impl Drop for DecodeGraph {
    fn drop(&mut self) {
        if let Some(exec) = self.pdl_exec.take() {
            // SAFETY: created in `new`, destroyed once; errors at teardown have no one to go to.
            let _ = unsafe { sys::cuGraphExecDestroy(exec) };
        }
    }
}

/// The kernel a graph node launches, if it is a kernel node.
unsafe fn kernel_name(node: sys::CUgraphNode) -> Result<Option<String>> {
    let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    sys::cuGraphNodeGetType(node, &mut ty)
        .result()
        .while_(|| "reading a graph node's type".into())?;
    if ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
        return Ok(None);
    }
    let mut params: sys::CUDA_KERNEL_NODE_PARAMS_v2 = std::mem::zeroed();
    sys::cuGraphKernelNodeGetParams_v2(node, &mut params)
        .result()
        .while_(|| "reading a kernel node".into())?;
    let mut name: *const std::ffi::c_char = std::ptr::null();
    sys::cuFuncGetName(&mut name, params.func)
        .result()
        .while_(|| "reading a kernel's name".into())?;
    if name.is_null() {
        return Ok(None);
    }
    Ok(Some(
        std::ffi::CStr::from_ptr(name)
            .to_string_lossy()
            .into_owned(),
    ))
}

/// The nodes of a captured decode step in order: kernel names, `memset` for memsets, other node
/// types by their type; an error unless the graph is one chain (what a capture on one stream is).
unsafe fn graph_chain(graph: sys::CUgraph) -> Result<Vec<String>> {
    let what = || "reading the decode graph's nodes".to_string();
    let null = std::ptr::null_mut();
    let mut n = 0usize;
    sys::cuGraphGetNodes(graph, null, &mut n)
        .result()
        .while_(what)?;
    let mut nodes = vec![std::ptr::null_mut(); n];
    sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n)
        .result()
        .while_(what)?;
    let mut e = 0usize;
    sys::cuGraphGetEdges_v2(graph, null, null, std::ptr::null_mut(), &mut e)
        .result()
        .while_(what)?;
    let mut from = vec![std::ptr::null_mut(); e];
    let mut to = vec![std::ptr::null_mut(); e];
    let mut data: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); e];
    sys::cuGraphGetEdges_v2(
        graph,
        from.as_mut_ptr(),
        to.as_mut_ptr(),
        data.as_mut_ptr(),
        &mut e,
    )
    .result()
    .while_(what)?;
    let not_chain = || GpuError::invalid("decode", "the captured decode step is not one chain");
    let mut next = std::collections::HashMap::new();
    let mut has_pred = std::collections::HashSet::new();
    for (&a, &b) in from.iter().zip(&to) {
        if next.insert(a, b).is_some() || !has_pred.insert(b) {
            return Err(not_chain());
        }
    }
    let mut roots = nodes.iter().filter(|v| !has_pred.contains(*v));
    let (Some(&root), None) = (roots.next(), roots.next()) else {
        return Err(not_chain());
    };
    let mut out = Vec::with_capacity(n);
    let mut node = Some(root);
    while let Some(v) = node {
        if out.len() == n {
            return Err(not_chain());
        }
        let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        sys::cuGraphNodeGetType(v, &mut ty)
            .result()
            .while_(|| "reading a graph node's type".into())?;
        out.push(match ty {
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET => MEMSET.to_string(),
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => {
                kernel_name(v)?.unwrap_or_else(|| "(unnamed kernel)".into())
            }
            other => format!("{other:?}"),
        });
        node = next.get(&v).copied();
    }
    if out.len() != n {
        return Err(not_chain());
    }
    Ok(out)
}

/// Turns every plain kernel → kernel edge of `graph` that [`programmatic_into`] allows under `opts`
/// programmatic; returns how many.
unsafe fn make_edges_programmatic(graph: sys::CUgraph, opts: &DecodeOptions) -> Result<usize> {
    let what = || "reading the decode graph's edges".to_string();
    let mut n = 0usize;
    let null = std::ptr::null_mut();
    sys::cuGraphGetEdges_v2(graph, null, null, std::ptr::null_mut(), &mut n)
        .result()
        .while_(what)?;
    let mut from = vec![std::ptr::null_mut(); n];
    let mut to = vec![std::ptr::null_mut(); n];
    let mut data: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); n];
    sys::cuGraphGetEdges_v2(
        graph,
        from.as_mut_ptr(),
        to.as_mut_ptr(),
        data.as_mut_ptr(),
        &mut n,
    )
    .result()
    .while_(what)?;
    let plain = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8;
    let mut changed = 0;
    for i in 0..n {
        if data[i].type_ != plain || kernel_name(from[i])?.is_none() {
            continue;
        }
        match kernel_name(to[i])? {
            Some(name) if programmatic_into(&name, opts) => {}
            _ => continue,
        }
        let mut e = data[i];
        e.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
        e.type_ = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
        sys::cuGraphRemoveDependencies_v2(graph, &from[i], &to[i], &data[i], 1)
            .result()
            .while_(|| "removing a decode graph edge".into())?;
        sys::cuGraphAddDependencies_v2(graph, &from[i], &to[i], &e, 1)
            .result()
            .while_(|| "adding a programmatic edge".into())?;
        changed += 1;
    }
    Ok(changed)
}

/// The q/k/v row layout of `c` for the RoPE kernels.
fn qkv_shape(c: &ModelConfig) -> QkvShape {
    QkvShape {
        n_q_heads: c.num_heads,
        n_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        layout: match c.rope_style {
            RopeStyle::Neox => RopeLayout::Neox,
            RopeStyle::Interleaved => RopeLayout::Interleaved,
        },
    }
}

/// The attention scores' scale: the family's (Gemma: `query_pre_attn_scalar^-½`), else
/// 1/√head_dim.
fn attn_scale(c: &ModelConfig) -> f32 {
    c.block
        .attn_scale
        .unwrap_or_else(|| 1.0 / (c.head_dim as f32).sqrt())
}

/// The RoPE table of the sliding layers that rotate with a base of their own (Gemma 3), unscaled.
fn local_rope_table(c: &ModelConfig, max_seq: usize) -> Option<Vec<f32>> {
    c.block.local_rope_theta.map(|theta| {
        let local = ModelConfig {
            rope_theta: theta,
            rope_scaling: entrollm_model::config::RopeScaling::None,
            ..c.clone()
        };
        rope_table(&rope_inv_freq(&local), max_seq)
    })
}

/// What the q/k/v heads get beyond RoPE in layer `l` (the per-head kernel).
fn head_ops<'a>(c: &ModelConfig, layer: &'a GpuLayer) -> HeadOps<'a> {
    HeadOps {
        qk_norm: layer.norms.qk.as_ref().map(|(q, k)| (q, k)),
        eps: c.rms_norm_eps,
        rotary: c.block.rotary_dim(c.head_dim),
    }
}

/// Buffers of one decode step (batch 1).
struct DecodeBufs {
    x: CudaSlice<f32>,
    /// Normed activations (a separate RMSNorm kernel), or an RMSNorm's input times its weight
    /// with Σx² in `norm_acc` (left by an accumulating GEMV: `launch_gemv_accum_norm`).
    h: CudaSlice<f32>,
    /// Σx² of the chained norms, one slot per residual GEMV of the step (2 per layer), cleared by
    /// the step's last kernel.
    norm_acc: CudaSlice<u64>,
    qkv: CudaSlice<f32>,
    q: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    act: CudaSlice<f32>,
    /// gate/up products before GeGLU ([2 inter]; one element for SwiGLU models).
    gate_up: CudaSlice<f32>,
    /// A projection's output before its post norm ([hidden]; one element without post norms).
    y: CudaSlice<f32>,
    /// A mixture of experts' router logits ([experts]), the slots' experts and weights
    /// ([top_k], from `moe_topk`) and outputs ([top_k, hidden]); one element each without.
    router: CudaSlice<f32>,
    slot_experts: CudaSlice<i32>,
    slot_w: CudaSlice<f32>,
    ys: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    tok: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    len: CudaSlice<i32>,
    history: CudaSlice<i32>,
    argmax: ArgmaxScratch,
    attn_scratch: AttnScratch,
}

/// Buffers of one prefill chunk of up to `cap` tokens.
struct PrefillBufs {
    cap: usize,
    tokens: CudaSlice<i32>,
    x: CudaSlice<f32>,
    hb: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    qb: CudaSlice<u16>,
    attn: CudaSlice<u16>,
    gate_up: CudaSlice<f32>,
    act: CudaSlice<u16>,
    moe: Option<MoePrefill>,
}

impl PrefillBufs {
    fn bytes(&self) -> usize {
        self.tokens.len() * 4
            + (self.x.len() + self.qkv.len() + self.gate_up.len()) * 4
            + (self.hb.len() + self.qb.len() + self.attn.len() + self.act.len()) * 2
            + self.moe.as_ref().map_or(0, MoePrefill::bytes)
    }
}

/// A mixture of experts' prefill buffers for a chunk of `cap` tokens: the MLP norm's output in
/// f32 (the router's input), the router logits, the routing (rows in expert order, each slot's
/// row and weight), the tokens' rows grouped by expert (BF16), their gate/up products,
/// activations and outputs.
struct MoePrefill {
    xf: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    order: CudaSlice<i32>,
    rows: CudaSlice<i32>,
    w: CudaSlice<f32>,
    /// The expert of each slot and of each grouped row (for the experts' biases).
    slot_e: CudaSlice<i32>,
    row_e: CudaSlice<i32>,
    xg: CudaSlice<u16>,
    gu: CudaSlice<f32>,
    act: CudaSlice<u16>,
    yd: CudaSlice<f32>,
}

impl MoePrefill {
    fn bytes(&self) -> usize {
        (self.xf.len() + self.logits.len() + self.order.len() + self.rows.len() + self.w.len()) * 4
            + (self.slot_e.len() + self.row_e.len()) * 4
            + (self.gu.len() + self.yd.len()) * 4
            + (self.xg.len() + self.act.len()) * 2
    }
}

struct Kv {
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
}

/// A mixture of experts over a prefill chunk of `n` tokens (hb: the MLP norm's output, BF16):
/// the router over the norm's output in f32 (its GEMV batched over the tokens where the router is
/// dense BF16, as decode computes it, else its GEMM over hb), the routing on the host
/// ([`route`], the CPU engine's: one sync per layer and chunk), the tokens' rows grouped by
/// expert, each routed expert's gate/up and down as one GEMM over its tokens, then each token's
/// weighted sum added to x.
fn prefill_experts(
    dev: &GpuDevice,
    gemm: &Gemm,
    layer: &GpuLayer,
    moe: &GpuMoe,
    p: &mut PrefillBufs,
    n: usize,
    eps: f32,
) -> Result<()> {
    let h = p.x.len() / p.cap;
    let (e, k, ie) = (moe.experts, moe.top_k, moe.inter);
    let b = p
        .moe
        .as_mut()
        .ok_or_else(|| GpuError::invalid("prefill", "no buffers for a mixture of experts"))?;
    match moe.router.as_dense() {
        Some(r) => {
            launch_rmsnorm_f32w(
                dev,
                &p.x,
                &layer.mlp_norm,
                NormOut::F32(&mut b.xf),
                n,
                h,
                eps,
            )?;
            let g = Gather {
                experts: None,
                n_experts: 1,
                slots: n,
                x_group: 1,
            };
            launch_gemv_experts(dev, r.gemv, false, &r.w, g, &b.xf, &mut b.logits, e, h)?;
        }
        None => moe
            .router
            .matmul(dev, gemm, &p.hb, &mut b.logits, n, false)?,
    }
    let mut logits = dev
        .stream()
        .clone_dtoh(&b.logits.slice(0..n * e))
        .while_(|| "downloading router logits".into())?;
    if let Some(bias) = &moe.router_bias {
        // The router's bias, added on the host as the CPU engine adds it (f32).
        let bias = dev
            .stream()
            .clone_dtoh(bias)
            .while_(|| "downloading the router's bias".into())?;
        for row in logits.chunks_mut(e) {
            row.iter_mut().zip(&bias).for_each(|(l, b)| *l += b);
        }
    }
    let spec = moe.spec();
    let routes: Vec<Vec<(usize, f32)>> = logits.chunks(e).map(|l| route(l, spec)).collect();
    let GroupedRoutes {
        order,
        rows,
        w,
        start,
    } = group_by_expert(&routes, e, k);
    let s = dev.stream();
    let what = || "uploading the routing".to_string();
    s.memcpy_htod(&order, &mut b.order.slice_mut(0..n * k))
        .while_(what)?;
    s.memcpy_htod(&rows, &mut b.rows.slice_mut(0..n * k))
        .while_(what)?;
    s.memcpy_htod(&w, &mut b.w.slice_mut(0..n * k))
        .while_(what)?;
    if moe.biases.is_some() {
        let slot_e: Vec<i32> = routes.iter().flatten().map(|r| r.0 as i32).collect();
        let row_e: Vec<i32> = (0..e)
            .flat_map(|x| std::iter::repeat_n(x as i32, start[x + 1] - start[x]))
            .collect();
        s.memcpy_htod(&slot_e, &mut b.slot_e.slice_mut(0..n * k))
            .while_(what)?;
        s.memcpy_htod(&row_e, &mut b.row_e.slice_mut(0..n * k))
            .while_(what)?;
    }
    launch_moe_gather_rows(dev, &p.hb, &b.order, n * k, h, &mut b.xg)?;
    for x in 0..e {
        let (a, c) = (start[x], start[x + 1] - start[x]);
        if c == 0 {
            continue;
        }
        let xg = b.xg.slice(a * h..(a + c) * h);
        let mut gu = b.gu.slice_mut(a * 2 * ie..(a + c) * 2 * ie);
        layer
            .gate_up
            .expert_matmul(dev, gemm, e, x, &xg, &mut gu, c)?;
    }
    let halves = layer.gate_up.gate_up_halves();
    match moe.glu {
        Some(glu) => {
            let bias = moe.biases.as_ref().map(|x| (&b.row_e, &x.gate, &x.up));
            launch_moe_glu(
                dev,
                &b.gu,
                ActOut::Bf16(&mut b.act),
                n * k,
                ie,
                halves,
                bias,
                glu,
            )?
        }
        None if halves => launch_swiglu_halves_bf16(dev, &b.gu, &mut b.act, n * k, ie)?,
        None => launch_swiglu_bf16(dev, &b.gu, &mut b.act, n * k, ie)?,
    }
    for x in 0..e {
        let (a, c) = (start[x], start[x + 1] - start[x]);
        if c == 0 {
            continue;
        }
        let act = b.act.slice(a * ie..(a + c) * ie);
        let mut yd = b.yd.slice_mut(a * h..(a + c) * h);
        layer
            .down
            .expert_matmul(dev, gemm, e, x, &act, &mut yd, c)?;
    }
    let down_bias = moe.biases.as_ref().map(|x| ExpertBias {
        experts: &b.slot_e,
        bias: &x.down,
    });
    launch_moe_combine(
        dev,
        &b.yd,
        Some(&b.rows),
        &b.w,
        k,
        h,
        n,
        &mut p.x,
        true,
        down_bias,
    )
}

/// Runs a [`GpuModel`] on one sequence.
pub struct GpuEngine {
    dev: Arc<GpuDevice>,
    model: GpuModel,
    gemm: Gemm,
    max_seq: usize,
    /// RoPE (cos, sin) of every position, [max_seq, rotary / 2, 2].
    cos_sin: CudaSlice<f32>,
    /// The sliding layers' own table where they have one (Gemma 3).
    cos_sin_local: Option<CudaSlice<f32>>,
    attn_cfg: AttnConfig,
    kv: Kv,
    d: DecodeBufs,
    prefill: PrefillBufs,
    /// The decode steps: [greedy (argmax on device), logits only].
    plans: [DecodePlan; 2],
    /// Captured decode steps, as `plans`.
    graphs: [Option<DecodeGraph>; 2],
    opts: DecodeOptions,
    /// Kernel-to-kernel edges of the decode graph made programmatic (0: PDL off).
    pdl_edges: usize,
    /// Tokens in the cache (the position of the next token).
    pos: usize,
}

impl GpuEngine {
    /// An engine for sequences of up to `max_seq` tokens: allocates the BF16 KV cache and all
    /// buffers, then captures the decode step into two CUDA graphs (greedy and logits).
    pub fn new(dev: Arc<GpuDevice>, model: GpuModel, max_seq: usize) -> Result<Self> {
        Self::with_options(dev, model, max_seq, DecodeOptions::default())
    }

    /// [`GpuEngine::new`] with the decode step put together as `opts` says.
    pub fn with_options(
        dev: Arc<GpuDevice>,
        model: GpuModel,
        max_seq: usize,
        opts: DecodeOptions,
    ) -> Result<Self> {
        let c = model.config.clone();
        check_supported(&c)?;
        // A projection's output kept apart before its post norm, or before its bias.
        let post_norms = model.layers.iter().any(|l| {
            l.norms.post_attn.is_some() || l.norms.post_mlp.is_some() || l.norms.o_bias.is_some()
        });
        if post_norms && 2 * c.intermediate_size < c.hidden_size {
            // Prefill keeps a projection's output before its post norm in the gate/up buffer.
            return Err(GpuError::invalid(
                "gpu engine",
                "post norms and an o bias need an intermediate size of at least half the hidden size",
            ));
        }
        if max_seq == 0 || max_seq > c.max_position_embeddings {
            return Err(GpuError::invalid(
                "gpu engine",
                format!(
                    "max_seq {max_seq} is out of range (1..={})",
                    c.max_position_embeddings
                ),
            ));
        }
        let s = Arc::clone(dev.stream());
        let a32 = |n: usize| {
            s.alloc_zeros::<f32>(n.max(1))
                .while_(|| "allocating engine buffers".into())
        };
        let a16 = |n: usize| {
            s.alloc_zeros::<u16>(n.max(1))
                .while_(|| "allocating engine buffers".into())
        };
        let ai = |n: usize| {
            s.alloc_zeros::<i32>(n.max(1))
                .while_(|| "allocating engine buffers".into())
        };
        let (h, qd, kvd, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let width = qd + 2 * kvd;
        let geglu = c.block.activation != entrollm_model::config::Activation::Silu;
        let moe = moe_dims(&c);
        // The experts' gate/up products before their activation kernel (`GpuMoe::glu`).
        let moe_glu = model
            .layers
            .iter()
            .any(|l| l.moe.as_ref().is_some_and(|m| m.glu.is_some()));
        let gate_up_len = match moe {
            Some((_, k, ie)) if moe_glu => (2 * k * ie).max(if geglu { 2 * inter } else { 1 }),
            _ if geglu => 2 * inter,
            _ => 1,
        };
        let desc = model.desc(dev.info().sm_count);
        let plans = [
            decode_plan(&desc, &opts, true)?,
            decode_plan(&desc, &opts, false)?,
        ];
        let attn_cfg = plans[0].attn;
        let mut kv = Kv {
            k: Vec::new(),
            v: Vec::new(),
        };
        for _ in 0..c.num_layers {
            kv.k.push(a16(max_seq * kvd)?);
            kv.v.push(a16(max_seq * kvd)?);
        }
        let d = DecodeBufs {
            x: a32(h)?,
            h: a32(h)?,
            norm_acc: s
                .alloc_zeros::<u64>(2 * c.num_layers)
                .while_(|| "allocating engine buffers".into())?,
            qkv: a32(width)?,
            q: a32(qd)?,
            attn: a32(qd)?,
            act: a32(moe.map_or(inter, |m| inter.max(m.1 * m.2)))?,
            gate_up: a32(gate_up_len)?,
            y: a32(if post_norms { h } else { 1 })?,
            router: a32(moe.map_or(1, |m| m.0))?,
            slot_experts: ai(moe.map_or(1, |m| m.1))?,
            slot_w: a32(moe.map_or(1, |m| m.1))?,
            ys: a32(moe.map_or(1, |m| m.1 * h))?,
            logits: a32(c.vocab_size)?,
            tok: ai(1)?,
            pos: ai(1)?,
            len: ai(1)?,
            history: ai(max_seq + 1)?,
            argmax: ArgmaxScratch::new(&dev, 1024)?,
            attn_scratch: AttnScratch::new(&dev, attn_cfg, c.num_heads, max_seq)?,
        };
        let per_token = prefill_bytes_per_token(&c);
        let mut cap = PREFILL_CHUNK.min(max_seq);
        if model.coded_scratch.is_some() && max_seq > cap {
            let (free, _) = crate::engine_coded::free_memory(&dev)?;
            let want = CODED_PREFILL_CHUNK.min(max_seq);
            if per_token * want + PREFILL_RESERVE <= free {
                cap = want;
            }
        }
        let prefill = PrefillBufs {
            cap,
            tokens: ai(cap)?,
            x: a32(cap * h)?,
            hb: a16(cap * h)?,
            qkv: a32(cap * width)?,
            qb: a16(cap * qd)?,
            attn: a16(cap * qd)?,
            gate_up: a32(cap * 2 * inter)?,
            act: a16(cap * inter)?,
            moe: match moe {
                Some((e, k, ie)) => Some(MoePrefill {
                    xf: a32(cap * h)?,
                    logits: a32(cap * e)?,
                    order: ai(cap * k)?,
                    rows: ai(cap * k)?,
                    w: a32(cap * k)?,
                    slot_e: ai(cap * k)?,
                    row_e: ai(cap * k)?,
                    xg: a16(cap * k * h)?,
                    gu: a32(cap * k * 2 * ie)?,
                    act: a16(cap * k * ie)?,
                    yd: a32(cap * k * h)?,
                }),
                None => None,
            },
        };
        // YaRN's attention factor scales cos and sin, as the CPU engine's table.
        let factor = entrollm_model::engine::rope_attention_factor(&c);
        let cos_sin = s
            .clone_htod(&rope_table_scaled(&rope_inv_freq(&c), max_seq, factor))
            .while_(|| "uploading the RoPE table".into())?;
        let cos_sin_local = match local_rope_table(&c, max_seq) {
            Some(t) => Some(
                s.clone_htod(&t)
                    .while_(|| "uploading the local RoPE table".into())?,
            ),
            None => None,
        };
        let gemm = Gemm::new(&dev)?;
        let mut e = GpuEngine {
            dev,
            model,
            gemm,
            max_seq,
            cos_sin,
            cos_sin_local,
            attn_cfg,
            kv,
            d,
            prefill,
            plans,
            graphs: [None, None],
            opts,
            pdl_edges: 0,
            pos: 0,
        };
        e.capture_graphs()?;
        Ok(e)
    }

    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.dev
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    pub fn model(&self) -> &GpuModel {
        &self.model
    }

    /// How the captured decode step is put together.
    pub fn decode_options(&self) -> DecodeOptions {
        self.opts
    }

    /// The decode step (`greedy`: argmax on the device) as it was captured.
    pub fn decode_plan(&self, greedy: bool) -> &DecodePlan {
        &self.plans[usize::from(!greedy)]
    }

    /// The decode step's layout in words (options and attention chunking).
    pub fn decode_layout(&self) -> String {
        format!(
            "{}, attention chunks of {} positions over {} warps, {} programmatic edges",
            self.opts, self.attn_cfg.chunk, self.attn_cfg.warps, self.pdl_edges
        )
    }

    /// Tokens in the KV cache (the position the next token gets).
    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn max_seq_len(&self) -> usize {
        self.max_seq
    }

    /// Forgets the sequence (the cache is overwritten by the next one).
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    pub fn memory(&self) -> MemoryUse {
        let c = &self.model.config;
        let kv_cache = 2 * c.num_layers * self.max_seq * c.kv_dim() * 2;
        let d = &self.d;
        let decode = (d.x.len()
            + d.h.len()
            + d.qkv.len()
            + d.q.len()
            + d.attn.len()
            + d.act.len()
            + d.gate_up.len()
            + d.y.len()
            + d.router.len()
            + d.slot_w.len()
            + d.slot_experts.len()
            + d.ys.len()
            + d.logits.len())
            * 4
            + (d.history.len() + 3) * 4
            + (1024 * 8)
            + c.num_heads
                * self.max_seq.div_ceil(self.attn_cfg.chunk as usize)
                * (c.head_dim + 2)
                * 4;
        MemoryUse {
            weights: self.model.weight_bytes(),
            kv_cache,
            workspace: decode
                + self.model.scratch_bytes()
                + self.prefill.bytes()
                + self.gemm.workspace_bytes()
                + (self.cos_sin.len() + self.cos_sin_local.as_ref().map_or(0, |t| t.len())) * 4,
        }
    }

    /// Enqueues one decode step (the token in `tok`, at position `pos`, cache length `len`): the
    /// steps of its plan ([`crate::plan::decode_plan`]), each with the launcher it names.
    fn decode_body(&mut self, greedy: bool) -> Result<()> {
        let GpuEngine {
            dev,
            model,
            max_seq,
            cos_sin,
            cos_sin_local,
            kv,
            d,
            plans,
            ..
        } = self;
        let dev = &**dev;
        let max_seq = *max_seq;
        let plan = &plans[usize::from(!greedy)];
        let c = &model.config;
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let shape = qkv_shape(c);
        let scale = attn_scale(c);
        let kv_shape = KvShape {
            n_q_heads: c.num_heads,
            n_kv_heads: c.num_kv_heads,
            max_seq,
        };
        let eps = c.rms_norm_eps;
        let table = model
            .embed
            .dense_weights()
            .ok_or_else(|| GpuError::invalid("decode", "the embedding must be dense BF16"))?;
        let layers = &model.layers;
        let mat = |m: Mat| -> &GpuLinear {
            match m {
                Mat::Qkv(l) => &layers[l].qkv,
                Mat::O(l) => &layers[l].o,
                Mat::GateUp(l) => &layers[l].gate_up,
                Mat::Down(l) => &layers[l].down,
                Mat::Router(l) => layers[l]
                    .moe
                    .as_ref()
                    .map_or(&layers[l].gate_up, |m| &m.router),
                Mat::LmHead => model.lm_head(),
            }
        };
        // A step the model's matrix cannot take: the plan was made for another model.
        let mismatch = |s: &Step| {
            GpuError::invalid(
                "decode",
                format!("plan step {s:?} does not fit the model's matrices"),
            )
        };
        let moe_of = |l: usize, s: &Step| layers[l].moe.as_ref().ok_or_else(|| mismatch(s));
        let norm_w = |n: Norm| -> Option<&CudaSlice<f32>> {
            match n {
                Norm::Attn(l) => Some(&layers[l].attn_norm),
                Norm::Mlp(l) => Some(&layers[l].mlp_norm),
                Norm::PostAttn(l) => layers[l].norms.post_attn.as_ref(),
                Norm::PostMlp(l) => layers[l].norms.post_mlp.as_ref(),
                Norm::Final => Some(&model.final_norm),
            }
        };
        // The RoPE table of layer l.
        let (cos_sin, cos_sin_local) = (&*cos_sin, cos_sin_local.as_ref());
        let table_of = |l: usize| match cos_sin_local {
            Some(t) if local_rope(c, l) => t,
            _ => cos_sin,
        };
        let chain_of = |m: Mat, s: &Step| mat(m).chainable().ok_or_else(|| mismatch(s));
        for s in &plan.steps {
            let norm_w = |n: Norm| norm_w(n).ok_or_else(|| mismatch(s));
            match *s {
                Step::Embedding => launch_embedding(dev, table, &d.tok, &mut d.x, 1, vocab, h)?,
                Step::EmbedScale => {
                    launch_scale(dev, &mut d.x, h, c.block.embed_scale.unwrap_or(1.0))?
                }
                Step::RmsNorm { norm } => launch_rmsnorm_f32w(
                    dev,
                    &d.x,
                    norm_w(norm)?,
                    NormOut::F32(&mut d.h),
                    1,
                    h,
                    eps,
                )?,
                Step::PostNorm { norm, next } => {
                    let next = match next {
                        Some(n) => Some((norm_w(n)?, NextOut::F32(&mut d.h))),
                        None => None,
                    };
                    launch_add_rmsnorm(dev, &d.y, norm_w(norm)?, &mut d.x, next, 1, h, eps)?
                }
                Step::Geglu { layer } => launch_geglu(
                    dev,
                    &d.gate_up,
                    ActOut::F32(&mut d.act),
                    1,
                    c.intermediate_size,
                    layers[layer].gate_up.gate_up_halves(),
                )?,
                Step::Softcap => launch_softcap(
                    dev,
                    &mut d.logits,
                    vocab,
                    c.block.final_softcap.unwrap_or(1.0),
                )?,
                Step::GemvRope { layer, prenorm, .. } => {
                    let w = layers[layer].qkv.as_dense().ok_or_else(|| mismatch(s))?;
                    let prenorm = prenorm.map(|slot| ChainedNorm {
                        acc: &d.norm_acc,
                        slot,
                        eps,
                    });
                    let t = RopeTargets {
                        q: &mut d.q,
                        k_cache: &mut kv.k[layer],
                        v_cache: &mut kv.v[layer],
                        pos: &d.pos,
                        cos_sin: table_of(layer),
                        max_seq,
                    };
                    let bias = layers[layer].qkv_bias.as_ref();
                    launch_gemv_rope(dev, w.gemv, &w.w, &d.h, w.cols, prenorm, shape, bias, t)?;
                }
                Step::RopeAppend {
                    layer,
                    heads: false,
                    ..
                } => launch_rope_append(
                    dev,
                    shape,
                    &d.qkv,
                    layers[layer].qkv_bias.as_ref(),
                    QOut::F32(&mut d.q),
                    &mut kv.k[layer],
                    &mut kv.v[layer],
                    &d.pos,
                    table_of(layer),
                    1,
                    max_seq,
                )?,
                Step::RopeAppend {
                    layer, heads: true, ..
                } => launch_rope_heads(
                    dev,
                    shape,
                    head_ops(c, &layers[layer]),
                    &d.qkv,
                    layers[layer].qkv_bias.as_ref(),
                    QOut::F32(&mut d.q),
                    &mut kv.k[layer],
                    &mut kv.v[layer],
                    &d.pos,
                    table_of(layer),
                    1,
                    max_seq,
                )?,
                Step::Prenorm {
                    mat: m,
                    swiglu,
                    slot,
                    out,
                } => {
                    let w = chain_of(m, s)?;
                    let (cfg, fusion) = if swiglu {
                        (swiglu_config(w.gemv), SWIGLU)
                    } else {
                        (w.gemv, PLAIN)
                    };
                    let ss = ChainedNorm {
                        acc: &d.norm_acc,
                        slot,
                        eps,
                    };
                    let y = match out {
                        Buf::Qkv => &mut d.qkv,
                        Buf::Act => &mut d.act,
                        Buf::Logits => &mut d.logits,
                        _ => return Err(mismatch(s)),
                    };
                    launch_gemv_prenorm(dev, cfg, fusion, w.w, &d.h, ss, y, w.rows, w.cols)?;
                }
                Step::AccumNorm {
                    mat: m,
                    input,
                    next,
                    slot,
                } => {
                    let w = chain_of(m, s)?;
                    let x = match input {
                        Buf::Attn => &d.attn,
                        Buf::Act => &d.act,
                        _ => return Err(mismatch(s)),
                    };
                    let next = NextNorm {
                        g: norm_w(next)?,
                        h: &mut d.h,
                        acc: &mut d.norm_acc,
                        slot,
                    };
                    launch_gemv_accum_norm(dev, w.gemv, w.w, x, &mut d.x, w.rows, w.cols, next)?;
                }
                Step::Matvec {
                    mat: m,
                    input,
                    norm,
                    fusion,
                    out,
                } => {
                    let (x, y) = match (input, out) {
                        (Buf::X, Buf::Qkv) => (&d.x, &mut d.qkv),
                        (Buf::H, Buf::Qkv) => (&d.h, &mut d.qkv),
                        (Buf::Attn, Buf::X) => (&d.attn, &mut d.x),
                        (Buf::X, Buf::Act) => (&d.x, &mut d.act),
                        (Buf::H, Buf::Act) => (&d.h, &mut d.act),
                        (Buf::Act, Buf::X) => (&d.act, &mut d.x),
                        (Buf::X, Buf::Logits) => (&d.x, &mut d.logits),
                        (Buf::Attn, Buf::Y) => (&d.attn, &mut d.y),
                        (Buf::Act, Buf::Y) => (&d.act, &mut d.y),
                        (Buf::X, Buf::GateUp) => (&d.x, &mut d.gate_up),
                        (Buf::H, Buf::GateUp) => (&d.h, &mut d.gate_up),
                        (Buf::H, Buf::Router) => (&d.h, &mut d.router),
                        _ => return Err(mismatch(s)),
                    };
                    let norm = match norm {
                        Some(n) => Some((norm_w(n)?, eps)),
                        None => None,
                    };
                    mat(m).matvec_fused(dev, x, norm, fusion, y)?;
                }
                Step::MoeTopk { layer } => {
                    let m = moe_of(layer, s)?;
                    launch_moe_topk(
                        dev,
                        &d.router,
                        m.router_bias.as_ref(),
                        1,
                        m.experts,
                        m.spec(),
                        &mut d.slot_experts,
                        &mut d.slot_w,
                    )?;
                }
                Step::Experts { mat: w, input, out } => {
                    let (l, swiglu) = match w {
                        Mat::GateUp(l) => (l, out == Buf::Act),
                        Mat::Down(l) => (l, false),
                        _ => return Err(mismatch(s)),
                    };
                    let m = moe_of(l, s)?;
                    let (x, y, x_group) = match (input, out) {
                        (Buf::H, Buf::Act) => (&d.h, &mut d.act, m.top_k),
                        (Buf::H, Buf::GateUp) => (&d.h, &mut d.gate_up, m.top_k),
                        (Buf::Act, Buf::Experts) => (&d.act, &mut d.ys, 1),
                        _ => return Err(mismatch(s)),
                    };
                    let g = Gather {
                        experts: Some(&d.slot_experts),
                        n_experts: m.experts,
                        slots: m.top_k,
                        x_group,
                    };
                    mat(w).gathered(dev, g, x, swiglu, y)?;
                }
                Step::MoeGlu { layer } => {
                    let m = moe_of(layer, s)?;
                    let glu = m.glu.ok_or_else(|| mismatch(s))?;
                    let bias = m.biases.as_ref().map(|b| (&d.slot_experts, &b.gate, &b.up));
                    let halves = layers[layer].gate_up.gate_up_halves();
                    launch_moe_glu(
                        dev,
                        &d.gate_up,
                        ActOut::F32(&mut d.act),
                        m.top_k,
                        m.inter,
                        halves,
                        bias,
                        glu,
                    )?;
                }
                Step::MoeCombine { layer } => {
                    let m = moe_of(layer, s)?;
                    let down_bias = m.biases.as_ref().map(|b| ExpertBias {
                        experts: &d.slot_experts,
                        bias: &b.down,
                    });
                    launch_moe_combine(
                        dev, &d.ys, None, &d.slot_w, m.top_k, h, 1, &mut d.x, true, down_bias,
                    )?;
                }
                Step::BiasResidual { layer } => {
                    let b = layers[layer]
                        .norms
                        .o_bias
                        .as_ref()
                        .ok_or_else(|| mismatch(s))?;
                    launch_bias_residual(dev, &d.y, b, &mut d.x, h, 1)?;
                }
                Step::Attention { layer, fused } => {
                    let attend = if fused {
                        launch_attention_decode_fused
                    } else {
                        launch_attention_decode
                    };
                    attend(
                        dev,
                        plan.attn,
                        kv_shape,
                        &d.q,
                        &kv.k[layer],
                        &kv.v[layer],
                        &d.len,
                        &mut d.attn_scratch,
                        &mut d.attn,
                        scale,
                        layer_mask(c, layer),
                        layers[layer].norms.sinks.as_ref(),
                    )?;
                }
                Step::Argmax => launch_argmax(dev, &d.logits, vocab, &mut d.argmax, &mut d.tok)?,
                Step::Finish { greedy } => launch_finish_step(
                    dev,
                    &d.tok,
                    &mut d.history,
                    greedy,
                    &mut d.pos,
                    &mut d.len,
                    &mut d.norm_acc,
                )?,
            }
        }
        Ok(())
    }

    fn set_counters(&mut self, pos: usize) -> Result<()> {
        let s = self.dev.stream();
        s.memcpy_htod(&[pos as i32], &mut self.d.pos)
            .while_(|| "uploading the position".into())?;
        s.memcpy_htod(&[pos as i32 + 1], &mut self.d.len)
            .while_(|| "uploading the cache length".into())
    }

    fn capture_graphs(&mut self) -> Result<()> {
        // One eager step loads every kernel module (no module loads inside a capture); it writes
        // cache row 0, which any sequence overwrites first.
        self.set_counters(0)?;
        self.dev
            .stream()
            .memcpy_htod(&[0i32], &mut self.d.tok)
            .while_(|| "uploading a token".into())?;
        self.decode_body(true)?;
        self.dev.synchronize()?;
        for (i, greedy) in [true, false].into_iter().enumerate() {
            let stream = Arc::clone(self.dev.stream());
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .while_(|| "beginning the decode-step capture".into())?;
            let body = self.decode_body(greedy);
            let graph = stream
                .end_capture(CUgraphInstantiate_flags(0))
                .while_(|| "ending the decode-step capture".into())?;
            body?;
            let graph =
                graph.ok_or_else(|| GpuError::invalid("decode", "the captured graph is empty"))?;
            // What was captured is what the plan says, node for node.
            // SAFETY: the graph is alive and used by this thread alone.
            let nodes = unsafe { graph_chain(graph.cu_graph()) }?;
            let plan = &self.plans[i];
            check_nodes(plan, &nodes)?;
            let graph = DecodeGraph::new(graph, &stream, self.opts)?;
            if graph.programmatic_edges != plan.programmatic_edges() {
                return Err(GpuError::invalid(
                    "decode",
                    format!(
                        "{} edges of the decode graph became programmatic, its plan has {}",
                        graph.programmatic_edges,
                        plan.programmatic_edges()
                    ),
                ));
            }
            graph.upload()?;
            self.pdl_edges = graph.programmatic_edges;
            self.graphs[i] = Some(graph);
        }
        self.set_counters(0)
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        if tokens.is_empty() {
            return Err(GpuError::invalid("gpu engine", "no tokens"));
        }
        if self.pos + tokens.len() > self.max_seq {
            return Err(GpuError::invalid(
                "gpu engine",
                format!(
                    "context full: {} tokens in the cache + {} new exceed max_seq {}",
                    self.pos,
                    tokens.len(),
                    self.max_seq
                ),
            ));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(GpuError::invalid(
                "gpu engine",
                format!("token id {bad} is outside the vocabulary ({vocab})"),
            ));
        }
        Ok(())
    }

    /// Runs `tokens` through the model in chunks (cuBLASLt GEMMs, flash-attention prefill) and
    /// leaves the logits after the last one in the decode logits buffer.
    fn prefill_inner(&mut self, tokens: &[u32]) -> Result<()> {
        self.check_tokens(tokens)?;
        let dev = Arc::clone(&self.dev);
        let dev = &*dev;
        let c = self.model.config.clone();
        let (h, inter, vocab) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let shape = qkv_shape(&self.model.config);
        let scale = attn_scale(&self.model.config);
        let eps = c.rms_norm_eps;
        let mut last_n = 0;
        for chunk in tokens.chunks(self.prefill.cap) {
            let n = chunk.len();
            let start = self.pos;
            let ids: Vec<i32> = chunk.iter().map(|&t| t as i32).collect();
            let p = &mut self.prefill;
            dev.stream()
                .memcpy_htod(&ids, &mut p.tokens.slice_mut(0..n))
                .while_(|| "uploading prompt tokens".into())?;
            dev.stream()
                .memcpy_htod(&[start as i32], &mut self.d.pos)
                .while_(|| "uploading the position".into())?;
            let table =
                self.model.embed.dense_weights().ok_or_else(|| {
                    GpuError::invalid("prefill", "the embedding must be dense BF16")
                })?;
            launch_embedding(dev, table, &p.tokens, &mut p.x, n, vocab, h)?;
            if let Some(scale) = c.block.embed_scale {
                launch_scale(dev, &mut p.x, n * h, scale)?;
            }
            // hb holds the attention norm's output of the layer (a post norm's add left it).
            let mut h_ready = false;
            for (l, layer) in self.model.layers.iter().enumerate() {
                if !h_ready {
                    launch_rmsnorm_f32w(
                        dev,
                        &p.x,
                        &layer.attn_norm,
                        NormOut::Bf16(&mut p.hb),
                        n,
                        h,
                        eps,
                    )?;
                }
                layer
                    .qkv
                    .matmul(dev, &self.gemm, &p.hb, &mut p.qkv, n, false)?;
                let table = match &self.cos_sin_local {
                    Some(t) if local_rope(&c, l) => t,
                    _ => &self.cos_sin,
                };
                let heads = layer.norms.qk.is_some() || c.block.rotary_dim(c.head_dim) < c.head_dim;
                if heads {
                    launch_rope_heads(
                        dev,
                        shape,
                        head_ops(&c, layer),
                        &p.qkv,
                        layer.qkv_bias.as_ref(),
                        QOut::Bf16(&mut p.qb),
                        &mut self.kv.k[l],
                        &mut self.kv.v[l],
                        &self.d.pos,
                        table,
                        n,
                        self.max_seq,
                    )?;
                } else {
                    launch_rope_append(
                        dev,
                        shape,
                        &p.qkv,
                        layer.qkv_bias.as_ref(),
                        QOut::Bf16(&mut p.qb),
                        &mut self.kv.k[l],
                        &mut self.kv.v[l],
                        &self.d.pos,
                        table,
                        n,
                        self.max_seq,
                    )?;
                }
                launch_flash_prefill(
                    dev,
                    PrefillShape {
                        n_tokens: n,
                        start,
                        n_q_heads: c.num_heads,
                        n_kv_heads: c.num_kv_heads,
                        head_dim: c.head_dim,
                        max_seq: self.max_seq,
                    },
                    &p.qb,
                    &self.kv.k[l],
                    &self.kv.v[l],
                    &mut p.attn,
                    scale,
                    layer_mask(&c, l),
                    layer.norms.sinks.as_ref(),
                )?;
                // With a post norm, the projection goes to the (free) gate/up buffer and the
                // norm's residual add leaves the next norm's output in hb.
                match (&layer.norms.post_attn, &layer.norms.o_bias) {
                    (Some(post), _) => {
                        layer
                            .o
                            .matmul(dev, &self.gemm, &p.attn, &mut p.gate_up, n, false)?;
                        let next = Some((&layer.mlp_norm, NextOut::Bf16(&mut p.hb)));
                        launch_add_rmsnorm(dev, &p.gate_up, post, &mut p.x, next, n, h, eps)?;
                    }
                    (None, o_bias) => {
                        match o_bias {
                            // o into the (free) gate/up buffer, then its bias and the residual
                            // add in the CPU engine's order.
                            Some(b) => {
                                layer.o.matmul(
                                    dev,
                                    &self.gemm,
                                    &p.attn,
                                    &mut p.gate_up,
                                    n,
                                    false,
                                )?;
                                launch_bias_residual(dev, &p.gate_up, b, &mut p.x, h, n)?;
                            }
                            None => layer
                                .o
                                .matmul(dev, &self.gemm, &p.attn, &mut p.x, n, true)?,
                        }
                        launch_rmsnorm_f32w(
                            dev,
                            &p.x,
                            &layer.mlp_norm,
                            NormOut::Bf16(&mut p.hb),
                            n,
                            h,
                            eps,
                        )?;
                    }
                }
                if let Some(moe) = &layer.moe {
                    prefill_experts(dev, &self.gemm, layer, moe, p, n, eps)?;
                    h_ready = false;
                    continue;
                }
                layer
                    .gate_up
                    .matmul(dev, &self.gemm, &p.hb, &mut p.gate_up, n, false)?;
                let halves = layer.gate_up.gate_up_halves();
                if c.block.activation != entrollm_model::config::Activation::Silu {
                    launch_geglu(dev, &p.gate_up, ActOut::Bf16(&mut p.act), n, inter, halves)?;
                } else if halves {
                    launch_swiglu_halves_bf16(dev, &p.gate_up, &mut p.act, n, inter)?;
                } else {
                    launch_swiglu_bf16(dev, &p.gate_up, &mut p.act, n, inter)?;
                }
                h_ready = false;
                match &layer.norms.post_mlp {
                    Some(post) => {
                        layer
                            .down
                            .matmul(dev, &self.gemm, &p.act, &mut p.gate_up, n, false)?;
                        let next = self
                            .model
                            .layers
                            .get(l + 1)
                            .map(|nl| (&nl.attn_norm, NextOut::Bf16(&mut p.hb)));
                        h_ready = next.is_some();
                        launch_add_rmsnorm(dev, &p.gate_up, post, &mut p.x, next, n, h, eps)?;
                    }
                    None => layer
                        .down
                        .matmul(dev, &self.gemm, &p.act, &mut p.x, n, true)?,
                }
            }
            self.pos += n;
            last_n = n;
        }
        // Logits after the last token: its hidden state through the final norm and LM head.
        let p = &self.prefill;
        dev.stream()
            .memcpy_dtod(&p.x.slice((last_n - 1) * h..last_n * h), &mut self.d.x)
            .while_(|| "copying the last hidden state".into())?;
        self.model.lm_head().matvec_fused(
            dev,
            &self.d.x,
            Some((&self.model.final_norm, eps)),
            GemvFusion::default(),
            &mut self.d.logits,
        )?;
        if let Some(cap) = c.block.final_softcap {
            launch_softcap(dev, &mut self.d.logits, c.vocab_size, cap)?;
        }
        self.set_counters(self.pos)
    }

    fn download_logits(&self) -> Result<Vec<f32>> {
        self.dev
            .stream()
            .clone_dtoh(&self.d.logits)
            .while_(|| "downloading logits".into())
    }

    /// Appends `tokens` (processed as a batch) and returns the logits after the last one.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.prefill_inner(tokens)?;
        self.download_logits()
    }

    /// Appends `tokens` and returns the greedy next token (argmax on the device).
    pub fn prefill_greedy(&mut self, tokens: &[u32]) -> Result<u32> {
        self.prefill_inner(tokens)?;
        launch_argmax(
            &self.dev,
            &self.d.logits,
            self.model.config.vocab_size,
            &mut self.d.argmax,
            &mut self.d.tok,
        )?;
        self.read_tok()
    }

    fn read_tok(&self) -> Result<u32> {
        let t = self
            .dev
            .stream()
            .clone_dtoh(&self.d.tok)
            .while_(|| "downloading the token".into())?[0];
        u32::try_from(t).map_err(|_| GpuError::invalid("argmax", "every logit was NaN"))
    }

    fn replay(&mut self, token: Option<u32>, greedy: bool) -> Result<()> {
        if let Some(t) = token {
            self.check_tokens(&[t])?;
            self.dev
                .stream()
                .memcpy_htod(&[t as i32], &mut self.d.tok)
                .while_(|| "uploading the token".into())?;
        } else if self.pos >= self.max_seq {
            return Err(GpuError::invalid("gpu engine", "context full"));
        }
        let g = self.graphs[usize::from(!greedy)]
            .as_ref()
            .ok_or_else(|| GpuError::invalid("decode", "no captured graph"))?;
        g.launch()?;
        self.pos += 1;
        Ok(())
    }

    /// Appends one token and returns the logits after it (one graph replay).
    pub fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        self.replay(Some(token), false)?;
        self.download_logits()
    }

    /// Appends one token and returns the greedy next token (argmax on the device).
    pub fn step_greedy(&mut self, token: u32) -> Result<u32> {
        self.replay(Some(token), true)?;
        self.read_tok()
    }

    /// Greedy generation of `n_new` tokens after `prompt` with no host round trip between steps:
    /// prefill + device argmax, then `n_new − 1` graph replays each feeding the previous argmax;
    /// the tokens are read back once at the end. EOS is not checked (the benchmark protocol).
    pub fn generate_greedy(&mut self, prompt: &[u32], n_new: usize) -> Result<Vec<u32>> {
        if n_new == 0 {
            return Ok(Vec::new());
        }
        if self.pos + prompt.len() + n_new - 1 > self.max_seq {
            return Err(GpuError::invalid(
                "gpu engine",
                format!(
                    "{} + {} prompt + {} new tokens exceed max_seq {}",
                    self.pos,
                    prompt.len(),
                    n_new,
                    self.max_seq
                ),
            ));
        }
        self.prefill_inner(prompt)?;
        let first = self.pos;
        launch_argmax(
            &self.dev,
            &self.d.logits,
            self.model.config.vocab_size,
            &mut self.d.argmax,
            &mut self.d.tok,
        )?;
        self.dev
            .stream()
            .memcpy_dtod(&self.d.tok, &mut self.d.history.slice_mut(first..first + 1))
            .while_(|| "recording the first token".into())?;
        for _ in 1..n_new {
            self.replay(None, true)?;
        }
        let hist = self
            .dev
            .stream()
            .clone_dtoh(&self.d.history.slice(first..first + n_new))
            .while_(|| "downloading generated tokens".into())?;
        hist.into_iter()
            .map(|t| {
                u32::try_from(t).map_err(|_| GpuError::invalid("argmax", "every logit was NaN"))
            })
            .collect()
    }

    /// Appends `tokens` one at a time and returns the logits after each (for perplexity).
    pub fn logits_for_all(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(tokens.len());
        for (i, &t) in tokens.iter().enumerate() {
            out.push(if i == 0 && self.pos == 0 {
                self.prefill(&[t])?
            } else {
                self.step(t)?
            });
        }
        Ok(out)
    }
}
