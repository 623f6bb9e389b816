//! The decode step as data. [`decode_plan`] is a pure function from a [`ModelDesc`] (what each
//! launch's matrix is: its form, shape and launch configuration — plain data, no device) and the
//! [`DecodeOptions`] to a [`DecodePlan`]: the steps `GpuEngine::decode_body` executes, each
//! expanded into the kernel launches it makes, with a stable text form (one line a launch) that CPU
//! tests compare against golden files (`tests/plans/*.txt`). The engine checks every captured
//! decode graph against its plan (kernel names in order, memsets, programmatic edges), so the text
//! is what runs.
//!
//! Which kernels run: the embedding gather; per layer the attention norm (its own kernel, chained
//! through the previous residual GEMV, or fused into the q/k/v GEMV), the q/k/v GEMV (dense BF16:
//! RoPE and the KV append in its epilogue; else RoPE as its own kernel), attention (one launch or
//! partial + combine), the o GEMV adding into the residual (leaving the MLP norm's input when
//! gate/up can take it), the MLP norm, the gate/up GEMV with SwiGLU, the down GEMV (leaving the
//! next norm's input for a dense consumer); the LM head with the final norm; argmax (greedy); the
//! counter update.

use std::fmt::Write as _;

use std::sync::Arc;

use entrollm_model::config::Activation;
use entrollm_model::ModelConfig;

use crate::error::{GpuError, Result};
use crate::linear::swiglu_config;
use crate::ops::attention::{AttnConfig, AttnMask};
use crate::ops::families::Glu;
use crate::ops::forward::{decode_attn_config, gemv_rope_variant, GemvFusion};
use crate::ops::gemv::GemvConfig;

/// How the decode step is put together. The default is the fastest measured on the H200
/// (bench/RESULTS.md: the RMSNorm chained through the GEMVs, RoPE in the q/k/v GEMV's epilogue,
/// attention as partial + combine, programmatic dependent launch on); the other forms stay
/// selectable for comparison runs (`entrollm bench --decode-norm split` and the like, parsed by
/// [`DecodeOptions::set`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Attention in one launch (last block merges) instead of partial + combine.
    pub fused_attention: bool,
    /// RMSNorm inside the following GEMV instead of its own kernel (palette-packed matrices always
    /// do so unless `split_norm`: [`LinearDesc::norm_in_gemv`]).
    pub fused_norm: bool,
    /// Programmatic dependent launch: each kernel of the graph is launched while the previous one
    /// finishes (edges into [`PDL_KERNELS`]). With every read of a predecessor's output coherent,
    /// the selftest's PDL-vs-plain decode is bit-identical.
    pub pdl: bool,
    /// Programmatic edges into the dense FP8 GEMVs too (a comparison run: see
    /// `forms::fp8::PDL_DENSE_KERNELS`).
    pub pdl_dense_fp8: bool,
    /// RoPE and the KV append as their own kernel instead of the q/k/v GEMV's epilogue (dense
    /// BF16 q/k/v only).
    pub split_rope: bool,
    /// RMSNorm as its own kernel instead of chained through the GEMVs (the residual GEMV leaves
    /// x ∘ g and Σx², the next dense GEMV scales by the norm).
    pub split_norm: bool,
    /// Attention chunking (positions per block, warps per block) instead of
    /// [`decode_attn_config`]'s.
    pub attn_chunk: Option<(u32, u32)>,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions {
            fused_attention: false,
            fused_norm: false,
            pdl: true,
            pdl_dense_fp8: false,
            split_rope: false,
            split_norm: false,
            attn_chunk: None,
        }
    }
}

impl DecodeOptions {
    /// The knobs [`DecodeOptions::set`] takes and their values, for help texts and errors.
    pub const KNOBS: [(&'static str, &'static str); 5] = [
        ("attention", "split|fused"),
        ("norm", "chained|split|fused"),
        ("rope", "fused|split"),
        ("pdl", "on|off|all"),
        ("chunk", "POSITIONSxWARPS"),
    ];

    /// Sets one knob from its command-line spelling: `attention` split|fused, `norm`
    /// chained|split|fused, `rope` fused|split, `pdl` on|off|all (all: the dense FP8 GEMVs too),
    /// `chunk` POSITIONSxWARPS (attention chunking, e.g. 32x4).
    pub fn set(&mut self, knob: &str, value: &str) -> std::result::Result<(), String> {
        let bad = || {
            let want = Self::KNOBS
                .iter()
                .find(|k| k.0 == knob)
                .map_or("?", |k| k.1);
            format!("decode {knob} `{value}`: expected {want}")
        };
        match (knob, value) {
            ("attention", "split") => self.fused_attention = false,
            ("attention", "fused") => self.fused_attention = true,
            ("norm", "chained") => (self.fused_norm, self.split_norm) = (false, false),
            ("norm", "split") => (self.fused_norm, self.split_norm) = (false, true),
            ("norm", "fused") => (self.fused_norm, self.split_norm) = (true, false),
            ("rope", "fused") => self.split_rope = false,
            ("rope", "split") => self.split_rope = true,
            ("pdl", "on") => (self.pdl, self.pdl_dense_fp8) = (true, false),
            ("pdl", "off") => (self.pdl, self.pdl_dense_fp8) = (false, false),
            ("pdl", "all") => (self.pdl, self.pdl_dense_fp8) = (true, true),
            ("chunk", v) => {
                let (a, b) = v.split_once('x').ok_or_else(bad)?;
                let chunk: u32 = a.parse().map_err(|_| bad())?;
                let warps: u32 = b.parse().map_err(|_| bad())?;
                self.attn_chunk = Some((chunk, warps));
            }
            ("attention" | "norm" | "rope" | "pdl", _) => return Err(bad()),
            _ => return Err(format!("unknown decode option `{knob}`")),
        }
        Ok(())
    }
}

impl std::fmt::Display for DecodeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let w = |b: bool| if b { "fused" } else { "split" };
        write!(
            f,
            "attention {}, rmsnorm {}, rope {}, pdl {}",
            w(self.fused_attention),
            if self.fused_norm {
                "fused"
            } else if self.split_norm {
                "split"
            } else {
                "chained"
            },
            w(!self.split_rope),
            match (self.pdl, self.pdl_dense_fp8) {
                (false, _) => "off",
                (true, false) => "on",
                (true, true) => "on, dense FP8 GEMVs too",
            }
        )
    }
}

/// Kernels outside the weight forms that call `pdl_wait()` before touching anything an earlier
/// kernel wrote or reads (kernels/common.cuh): an edge into one of them may be programmatic. The
/// forms' product kernels that do are the forms' own ([`crate::forms::pdl_kernel`]).
pub const PDL_KERNELS: &[&str] = &[
    "embedding_gather",
    "rmsnorm_f32w",
    "rmsnorm_f32w_bf16out",
    "rope_append_f32q",
    "rope_append_bf16q",
    // The families' kernels (kernels/families.cu).
    "rope_heads_f32q",
    "add_rmsnorm",
    "geglu_f32",
    "scale_f32",
    "softcap_f32",
    // A mixture of experts' (each reads the expert indices after pdl_wait).
    "moe_topk",
    "moe_combine",
    "moe_glu_f32",
    "bias_residual",
    "attn_decode_partial",
    "attn_decode_fused",
    "attn_decode_combine",
    "argmax_partial",
    "argmax_final",
    "finish_step",
];

/// Whether a plain kernel → `kernel` edge of the decode graph is made programmatic under `opts`.
pub fn programmatic_into(kernel: &str, opts: &DecodeOptions) -> bool {
    opts.pdl
        && (PDL_KERNELS.contains(&kernel) || crate::forms::pdl_kernel(kernel, opts.pdl_dense_fp8))
}

/// One launch's form as the decode step sees it: which fused kernels around the products take it,
/// and the launches of its batch-1 product. Each GPU form's module implements it
/// (`crate::forms`); the plan asks, and names no form.
pub trait LaunchForm: std::fmt::Debug + Send + Sync {
    /// The form's name in plans and reports.
    fn name(&self) -> &'static str;
    /// Dense BF16 (`GpuLinear::as_dense`): the q/k/v GEMV with RoPE in its epilogue takes it.
    fn dense_bf16(&self) -> bool {
        false
    }
    /// The chained-norm GEMVs that take it (`GpuLinear::chainable`), if any.
    fn chained(&self) -> Option<ChainedKernels> {
        None
    }
    /// Whether the decode step normalises x inside this matrix's GEMV rather than in a kernel of
    /// its own (`GpuLinear::norm_in_gemv`).
    fn norm_in_gemv(&self) -> bool {
        false
    }
    /// The GEMV configuration of the batch-1 product (None: not a GEMV).
    fn gemv(&self) -> Option<GemvConfig> {
        None
    }
    /// The launches of `out (+)= W · [rmsnorm](input)` with its epilogue, as
    /// `GpuLinear::matvec_fused` makes them.
    fn matvec(&self, m: &MatvecLaunch<'_>, push: &mut dyn FnMut(&'static str, String));
    /// The launches of the gathered product over a stack of experts (`GpuMatrix::gathered`), as
    /// its launcher makes them; false when the form has none.
    fn gathered(&self, _m: &GatherLaunch<'_>, _push: &mut dyn FnMut(&'static str, String)) -> bool {
        false
    }
}

/// One gathered product over a mixture of experts' stack, for [`LaunchForm::gathered`].
pub struct GatherLaunch<'a> {
    /// `mat form EXPERTSxRxC`.
    pub label: &'a str,
    pub experts: usize,
    /// The router's top-k: the slots of one launch.
    pub slots: usize,
    pub input: Buf,
    pub swiglu: bool,
    pub out: Buf,
}

impl GatherLaunch<'_> {
    /// The line of a launch that does the whole product: `label cfg input->out slots=K [epi]`.
    pub fn line(&self, cfg: &str) -> String {
        format!(
            "{} {cfg} {}->{} slots={}{}",
            self.label,
            self.input,
            self.out,
            self.slots,
            if self.swiglu { " epi=swiglu" } else { "" }
        )
    }
}

/// The kernels of a form's chained-norm GEMVs: the one that scales by the previous residual
/// GEMV's Σx² (`launch_gemv_prenorm`), and the residual GEMV that leaves the next norm's input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainedKernels {
    pub prenorm: &'static str,
    pub accum_norm: &'static str,
}

/// One batch-1 product of the step, for [`LaunchForm::matvec`].
pub struct MatvecLaunch<'a> {
    /// `mat form RxC`.
    pub label: &'a str,
    pub rows: usize,
    pub cols: usize,
    pub input: Buf,
    pub norm: Option<Norm>,
    pub fusion: GemvFusion,
    pub out: Buf,
}

impl MatvecLaunch<'_> {
    /// The line of a GEMV launch that does the whole product: `label cfg input->out [norm] [epi]`.
    pub fn gemv_line(&self, cfg: GemvConfig) -> String {
        let nf = match self.norm {
            Some(n) => format!(" norm=fused:{n}"),
            None => String::new(),
        };
        format!(
            "{} {cfg} {}->{}{nf}{}",
            self.label,
            self.input,
            self.out,
            epilogue(self.fusion)
        )
    }
}

/// One launch's matrix as the decode step sees it.
#[derive(Clone, Debug)]
pub struct LinearDesc {
    pub form: Arc<dyn LaunchForm>,
    pub rows: usize,
    pub cols: usize,
}

impl PartialEq for LinearDesc {
    fn eq(&self, o: &Self) -> bool {
        (self.rows, self.cols) == (o.rows, o.cols)
            && format!("{:?}", self.form) == format!("{:?}", o.form)
    }
}

impl LinearDesc {
    pub fn new(form: impl LaunchForm + 'static, rows: usize, cols: usize) -> Self {
        LinearDesc {
            form: Arc::new(form),
            rows,
            cols,
        }
    }

    /// The form's name in plans and reports.
    pub fn form_name(&self) -> &'static str {
        self.form.name()
    }

    /// [`LaunchForm::dense_bf16`].
    pub fn dense_bf16_weights(&self) -> bool {
        self.form.dense_bf16()
    }

    /// Whether the chained-norm GEMVs take it ([`LaunchForm::chained`]).
    pub fn chainable(&self) -> bool {
        self.form.chained().is_some()
    }

    /// [`LaunchForm::norm_in_gemv`].
    pub fn norm_in_gemv(&self) -> bool {
        self.form.norm_in_gemv()
    }

    /// The GEMV configuration of the batch-1 product (None for a coded matrix).
    pub fn gemv(&self) -> Option<GemvConfig> {
        self.form.gemv()
    }

    /// `mat form RxC`, the common start of a launch line.
    fn label(&self, mat: Mat) -> String {
        format!("{mat} {} {}x{}", self.form_name(), self.rows, self.cols)
    }
}

/// One decoder layer's launches.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerDesc {
    pub qkv: LinearDesc,
    /// q/k/v biases (added in the RoPE epilogue or kernel).
    pub qkv_bias: bool,
    /// RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// RMSNorm of the attention's output before its residual add (Gemma).
    pub post_attn_norm: bool,
    /// RMSNorm of the MLP's output before its residual add (Gemma).
    pub post_mlp_norm: bool,
    /// A bias on the attention's output projection (gpt-oss): o into y, then `bias_residual`.
    pub o_bias: bool,
    pub o: LinearDesc,
    /// A mixture of experts' layer: the stacks of every expert's gate/up and down.
    pub gate_up: LinearDesc,
    pub down: LinearDesc,
    /// A mixture of experts in place of the MLP (`gate_up` and `down` are its experts' stacks).
    pub moe: Option<MoeDesc>,
}

/// A layer's mixture of experts in the decode step.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeDesc {
    pub router: LinearDesc,
    pub experts: usize,
    pub top_k: usize,
    pub norm_topk: bool,
    /// Top-k of the logits, then their softmax (gpt-oss).
    pub topk_first: bool,
    /// A bias on the router (gpt-oss).
    pub router_bias: bool,
    /// Biases on the experts' gate, up and down (gpt-oss).
    pub expert_biases: bool,
    /// The activation as its own kernel after a plain gathered gate/up product
    /// (`GpuMoe::glu`); None: SwiGLU in the product's epilogue.
    pub glu: Option<Glu>,
}

/// What the decode step of a model is made from: plain data that `GpuModel::desc` gives and tests
/// build by hand.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelDesc {
    pub config: ModelConfig,
    /// SMs of the device (the FP8 SwiGLU GEMV's launch depends on it).
    pub sms: u32,
    pub embed: LinearDesc,
    /// None when tied to the embedding.
    pub lm_head: Option<LinearDesc>,
    pub layers: Vec<LayerDesc>,
}

impl ModelDesc {
    /// Every launch of `config` as `form(launch, rows, cols)` says (the embedding dense BF16, the
    /// LM head tied when the config ties it), no biases; q/k and post norms where the family has
    /// them.
    pub fn build(
        config: &ModelConfig,
        sms: u32,
        mut form: impl FnMut(&'static str, usize, usize) -> Result<LinearDesc>,
    ) -> Result<Self> {
        let c = config;
        let (h, q, kv, inter, vocab) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.intermediate_size,
            c.vocab_size,
        );
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(form("lm_head", vocab, h)?)
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        let family = c.arch.family();
        use entrollm_model::arch::Role;
        for l in 0..c.num_layers {
            // A mixture of experts: the router, and each of gate/up and down as one stack.
            let moe = c
                .block
                .moe
                .as_ref()
                .filter(|m| m.layers.get(l) != Some(&false));
            // (A stack's form is made for one expert's shape, as the engine's upload makes it.)
            let stack = |mut d: LinearDesc, experts: usize| {
                d.rows *= experts;
                d
            };
            let (gate_up, down, moe) = match moe {
                Some(m) => (
                    stack(form("gate_up", 2 * m.intermediate_size, h)?, m.experts),
                    stack(form("down", h, m.intermediate_size)?, m.experts),
                    Some({
                        let biases = family.moe.as_ref().is_some_and(|s| s.biases);
                        let glu = Glu::of(&c.block);
                        MoeDesc {
                            router: form("router", m.experts, h)?,
                            experts: m.experts,
                            top_k: m.top_k,
                            norm_topk: m.norm_topk,
                            topk_first: m.routing == entrollm_model::config::Routing::TopKSoftmax,
                            router_bias: biases,
                            expert_biases: biases,
                            glu: (biases || glu != Glu::Silu).then_some(glu),
                        }
                    }),
                ),
                None => (
                    form("gate_up", 2 * inter, h)?,
                    form("down", h, inter)?,
                    None,
                ),
            };
            layers.push(LayerDesc {
                qkv: form("qkv", q + 2 * kv, h)?,
                qkv_bias: false,
                qk_norm: family.has(Role::QNorm),
                post_attn_norm: family.has(Role::PostAttnNorm),
                post_mlp_norm: family.has(Role::PostMlpNorm),
                // (Biases are the weights' to have: q/k/v's and o's are left out here, as a
                // description built from the config alone cannot tell.)
                o_bias: false,
                o: form("o", h, q)?,
                gate_up,
                down,
                moe,
            });
        }
        Ok(ModelDesc {
            config: c.clone(),
            sms,
            embed: crate::forms::bf16::desc(vocab, h),
            lm_head,
            layers,
        })
    }

    pub fn lm_head(&self) -> &LinearDesc {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    fn mat(&self, m: Mat) -> &LinearDesc {
        match m {
            Mat::Qkv(l) => &self.layers[l].qkv,
            Mat::O(l) => &self.layers[l].o,
            Mat::GateUp(l) => &self.layers[l].gate_up,
            Mat::Down(l) => &self.layers[l].down,
            Mat::Router(l) => match &self.layers[l].moe {
                Some(m) => &m.router,
                None => &self.layers[l].gate_up,
            },
            Mat::LmHead => self.lm_head(),
        }
    }
}

/// A matrix of the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mat {
    Qkv(usize),
    O(usize),
    GateUp(usize),
    Down(usize),
    /// A mixture of experts' router.
    Router(usize),
    LmHead,
}

impl std::fmt::Display for Mat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mat::Qkv(_) => "qkv",
            Mat::O(_) => "o",
            Mat::GateUp(_) => "gate_up",
            Mat::Down(_) => "down",
            Mat::Router(_) => "router",
            Mat::LmHead => "lm_head",
        })
    }
}

/// An RMSNorm weight of the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    Attn(usize),
    Mlp(usize),
    PostAttn(usize),
    PostMlp(usize),
    Final,
}

impl std::fmt::Display for Norm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Norm::Attn(l) => write!(f, "L{l}.attn_norm"),
            Norm::Mlp(l) => write!(f, "L{l}.mlp_norm"),
            Norm::PostAttn(l) => write!(f, "L{l}.post_attn_norm"),
            Norm::PostMlp(l) => write!(f, "L{l}.post_mlp_norm"),
            Norm::Final => f.write_str("final_norm"),
        }
    }
}

/// An activation buffer of the step (f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buf {
    /// The residual stream.
    X,
    /// A normalised activation, or a chained norm's input times its weight.
    H,
    Qkv,
    /// Attention output.
    Attn,
    /// SwiGLU output.
    Act,
    Logits,
    /// gate/up products before the activation (GeGLU: the activation is its own kernel).
    GateUp,
    /// A projection's output before its post norm (Gemma).
    Y,
    /// A mixture of experts' router logits.
    Router,
    /// The routed experts' outputs, one row a slot of the top-k.
    Experts,
}

impl std::fmt::Display for Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Buf::X => "x",
            Buf::H => "h",
            Buf::Qkv => "qkv",
            Buf::Attn => "attn",
            Buf::Act => "act",
            Buf::Logits => "logits",
            Buf::GateUp => "gate_up",
            Buf::Y => "y",
            Buf::Router => "router",
            Buf::Experts => "slots",
        })
    }
}

/// One call of the decode step's executor (`GpuEngine::decode_body`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// `x = embed[tok]`.
    Embedding,
    /// `x *= embed_scale` (Gemma).
    EmbedScale,
    /// `h = rmsnorm(x; norm)`, its own kernel.
    RmsNorm { norm: Norm },
    /// The dense BF16 q/k/v GEMV over h with RoPE and the KV append in its epilogue; `prenorm`:
    /// the chained norm's Σx² slot (h is then x ∘ g).
    GemvRope {
        layer: usize,
        prenorm: Option<usize>,
        bias: bool,
    },
    /// RoPE and the KV append over the qkv buffer; `heads`: per head, with the q/k norms and
    /// partial rotary (`rope_heads`).
    RopeAppend {
        layer: usize,
        bias: bool,
        heads: bool,
    },
    /// `x += rmsnorm(y; norm)`, then `h = rmsnorm(x; next)` (post norms: `add_rmsnorm`).
    PostNorm { norm: Norm, next: Option<Norm> },
    /// `act = gelu_tanh(gate) · up` over the gate/up buffer.
    Geglu { layer: usize },
    /// `logits = cap · tanh(logits / cap)`.
    Softcap,
    /// A chained-norm GEMV (`launch_gemv_prenorm`) over h with slot `slot`'s Σx² into `out`.
    Prenorm {
        mat: Mat,
        swiglu: bool,
        slot: usize,
        out: Buf,
    },
    /// `x += W input`, leaving `next`'s input in h and Σx² in slot `slot`
    /// (`launch_gemv_accum_norm`).
    AccumNorm {
        mat: Mat,
        input: Buf,
        next: Norm,
        slot: usize,
    },
    /// `GpuLinear::matvec_fused`: `out (+)= W · [rmsnorm](input)` with `fusion`'s epilogue.
    Matvec {
        mat: Mat,
        input: Buf,
        norm: Option<Norm>,
        fusion: GemvFusion,
        out: Buf,
    },
    /// A mixture of experts' routing: the router logits' softmax and top-k into the slots'
    /// experts and weights (`moe_topk`).
    MoeTopk { layer: usize },
    /// A gathered product over the routed experts of `mat` (gate/up with SwiGLU into act, or
    /// plain into gate_up; down into the slots' outputs).
    Experts { mat: Mat, input: Buf, out: Buf },
    /// The experts' activation (and gate/up biases) over the slots' gate/up products into act
    /// (`moe_glu_f32`).
    MoeGlu { layer: usize },
    /// `x += Σ weight · (ys + down bias)` over the slots (`moe_combine`).
    MoeCombine { layer: usize },
    /// `x += y + b` (the o projection's bias, then the residual add: `bias_residual`).
    BiasResidual { layer: usize },
    /// Attention of layer `layer` (one launch when `fused`).
    Attention { layer: usize, fused: bool },
    /// Greedy argmax of the logits into the token.
    Argmax,
    /// Records the token (greedy), advances position and length, clears the norm slots.
    Finish { greedy: bool },
}

/// One node of the captured graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// `embed`, `L<layer>`, `head` or `step`.
    pub scope: String,
    /// The kernel's name (what the graph's node launches), or `memset`.
    pub kernel: &'static str,
    /// Matrix, form, shape, configuration, buffers, fusions.
    pub detail: String,
    /// Whether the edge into it is made programmatic.
    pub pdl: bool,
}

impl Launch {
    pub fn is_kernel(&self) -> bool {
        self.kernel != MEMSET
    }
}

/// The name of a memset node in a plan.
pub const MEMSET: &str = "memset";

/// The decode step of one model under one set of options.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodePlan {
    pub opts: DecodeOptions,
    pub greedy: bool,
    /// The attention launch configuration.
    pub attn: AttnConfig,
    pub steps: Vec<Step>,
    /// Every node of the step in order.
    pub launches: Vec<Launch>,
}

impl DecodePlan {
    /// How many edges of the graph become programmatic.
    pub fn programmatic_edges(&self) -> usize {
        self.launches.iter().filter(|l| l.pdl).count()
    }

    /// The graph's nodes in order: kernel names, `memset` for memsets.
    pub fn nodes(&self) -> Vec<&'static str> {
        self.launches.iter().map(|l| l.kernel).collect()
    }
}

impl std::fmt::Display for DecodePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "# decode step ({}): {}; attention chunks of {} positions over {} warps",
            if self.greedy { "greedy" } else { "logits" },
            self.opts,
            self.attn.chunk,
            self.attn.warps
        )?;
        for l in &self.launches {
            let mut line = format!("{:<5} {:<20} {}", l.scope, l.kernel, l.detail);
            if l.pdl {
                line.push_str(" pdl");
            }
            writeln!(f, "{}", line.trim_end())?;
        }
        write!(
            f,
            "# {} launches, {} programmatic edges",
            self.launches.len(),
            self.programmatic_edges()
        )
    }
}

/// The attention launch of the decode step: [`decode_attn_config`], with the chunking of
/// `opts.attn_chunk` when given.
pub fn decode_attention(c: &ModelConfig, opts: &DecodeOptions) -> Result<AttnConfig> {
    let mut a = decode_attn_config(c.head_dim, c.num_heads, c.num_kv_heads)?;
    if let Some((chunk, warps)) = opts.attn_chunk {
        a.chunk = chunk;
        a.warps = warps;
        a.validate().map_err(|_| {
            GpuError::invalid(
                "decode",
                format!(
                    "attention chunks of {chunk} positions over {warps} warps: positions must \
                     be positive, warps 1 to 16"
                ),
            )
        })?;
    }
    Ok(a)
}

/// The decode step of `m` under `opts` (`greedy`: argmax on the device).
pub fn decode_plan(m: &ModelDesc, opts: &DecodeOptions, greedy: bool) -> Result<DecodePlan> {
    let attn = decode_attention(&m.config, opts)?;
    for (l, layer) in m.layers.iter().enumerate() {
        if layer.moe.is_none() {
            continue;
        }
        for d in [&layer.gate_up, &layer.down] {
            let probe = GatherLaunch {
                label: "",
                experts: 1,
                slots: 1,
                input: Buf::H,
                swiglu: false,
                out: Buf::Act,
            };
            if !d.form.gathered(&probe, &mut |_, _| {}) {
                return Err(GpuError::invalid(
                    "decode",
                    format!(
                        "layer {l}: the experts' {} form has no gathered product",
                        d.form_name()
                    ),
                ));
            }
        }
    }
    let steps = decode_steps(m, opts, greedy);
    let mut launches = Vec::new();
    for s in &steps {
        expand(m, attn, s, &mut launches);
    }
    let mut prev_kernel = false;
    for l in &mut launches {
        l.pdl = prev_kernel && l.is_kernel() && programmatic_into(l.kernel, opts);
        prev_kernel = l.is_kernel();
    }
    Ok(DecodePlan {
        opts: *opts,
        greedy,
        attn,
        steps,
        launches,
    })
}

pub(crate) const PLAIN: GemvFusion = GemvFusion {
    accumulate: false,
    swiglu: false,
};
pub(crate) const RESIDUAL: GemvFusion = GemvFusion {
    accumulate: true,
    swiglu: false,
};
pub(crate) const SWIGLU: GemvFusion = GemvFusion {
    accumulate: false,
    swiglu: true,
};

/// The executor's calls, decided from each launch's form and the options.
fn decode_steps(m: &ModelDesc, opts: &DecodeOptions, greedy: bool) -> Vec<Step> {
    let c = &m.config;
    let mut steps = vec![Step::Embedding];
    if c.block.embed_scale.is_some() {
        steps.push(Step::EmbedScale);
    }
    // SwiGLU in the gate/up GEMV's epilogue; GeGLU as its own kernel after a plain product.
    let silu = c.block.activation == Activation::Silu;
    let partial_rotary = c.block.rotary_dim(c.head_dim) < c.head_dim;
    // RoPE and the KV append run in the dense BF16 q/k/v GEMV's epilogue (or as their own kernel).
    let rope_fused = !opts.split_rope && !opts.fused_norm;
    // A dense accumulating GEMV (BF16, or FP8 codes as stored) leaves the next RMSNorm's input
    // (x ∘ g and Σx²) for a dense consumer, so that norm needs no kernel of its own; `chained`:
    // h and the norm slot hold it.
    let chain = !opts.split_norm && !opts.fused_norm;
    let norm_fused = |d: &LinearDesc| opts.fused_norm || (d.norm_in_gemv() && !opts.split_norm);
    let mut chained = false;
    // h holds the next norm's output (a post norm's add left it).
    let mut h_ready = false;
    let n_layers = m.layers.len();
    for (l, layer) in m.layers.iter().enumerate() {
        // Norm slots: 2l (o, for the MLP norm), 2l + 1 (down, for the next norm).
        let prenorm = chained.then_some((2 * l).saturating_sub(1));
        let bias = layer.qkv_bias;
        // q/k norms and partial rotary: RoPE per head, its own kernel.
        let heads = layer.qk_norm || partial_rotary;
        if layer.qkv.dense_bf16_weights() && rope_fused && !heads {
            if !chained && !h_ready {
                steps.push(Step::RmsNorm {
                    norm: Norm::Attn(l),
                });
            }
            steps.push(Step::GemvRope {
                layer: l,
                prenorm,
                bias,
            });
        } else {
            // RMSNorm chained, inside the q/k/v GEMV or as its own kernel, then RoPE + KV append.
            match prenorm {
                Some(slot) if layer.qkv.chainable() => steps.push(Step::Prenorm {
                    mat: Mat::Qkv(l),
                    swiglu: false,
                    slot,
                    out: Buf::Qkv,
                }),
                _ if h_ready => steps.push(Step::Matvec {
                    mat: Mat::Qkv(l),
                    input: Buf::H,
                    norm: None,
                    fusion: PLAIN,
                    out: Buf::Qkv,
                }),
                _ if norm_fused(&layer.qkv) => steps.push(Step::Matvec {
                    mat: Mat::Qkv(l),
                    input: Buf::X,
                    norm: Some(Norm::Attn(l)),
                    fusion: PLAIN,
                    out: Buf::Qkv,
                }),
                _ => {
                    steps.push(Step::RmsNorm {
                        norm: Norm::Attn(l),
                    });
                    steps.push(Step::Matvec {
                        mat: Mat::Qkv(l),
                        input: Buf::H,
                        norm: None,
                        fusion: PLAIN,
                        out: Buf::Qkv,
                    });
                }
            }
            steps.push(Step::RopeAppend {
                layer: l,
                bias,
                heads,
            });
        }
        steps.push(Step::Attention {
            layer: l,
            fused: opts.fused_attention,
        });
        // o (+ residual), leaving the MLP norm's input when gate/up can take it; with a post norm,
        // o into y, then the norm's residual add leaves the MLP norm's output in h.
        h_ready = layer.post_attn_norm;
        chained = chain
            && !h_ready
            && silu
            && !layer.o_bias
            && layer.moe.is_none()
            && layer.o.chainable()
            && layer.gate_up.chainable();
        // o's bias: o into y, then its bias and the residual add (a post norm after it is refused
        // at upload: crate::families).
        steps.push(if h_ready || layer.o_bias {
            Step::Matvec {
                mat: Mat::O(l),
                input: Buf::Attn,
                norm: None,
                fusion: PLAIN,
                out: Buf::Y,
            }
        } else if chained {
            Step::AccumNorm {
                mat: Mat::O(l),
                input: Buf::Attn,
                next: Norm::Mlp(l),
                slot: 2 * l,
            }
        } else {
            Step::Matvec {
                mat: Mat::O(l),
                input: Buf::Attn,
                norm: None,
                fusion: RESIDUAL,
                out: Buf::X,
            }
        });
        if h_ready {
            steps.push(Step::PostNorm {
                norm: Norm::PostAttn(l),
                next: Some(Norm::Mlp(l)),
            });
        } else if layer.o_bias {
            steps.push(Step::BiasResidual { layer: l });
        }
        // A mixture of experts: the MLP norm, the router's GEMV, its top-k on the device, the
        // routed experts' gate/up (SwiGLU) and down as one gathered launch each, their weighted
        // sum added to the residual.
        if let Some(moe) = &layer.moe {
            if !h_ready {
                steps.push(Step::RmsNorm { norm: Norm::Mlp(l) });
            }
            steps.push(Step::Matvec {
                mat: Mat::Router(l),
                input: Buf::H,
                norm: None,
                fusion: PLAIN,
                out: Buf::Router,
            });
            steps.push(Step::MoeTopk { layer: l });
            steps.push(Step::Experts {
                mat: Mat::GateUp(l),
                input: Buf::H,
                out: if moe.glu.is_some() {
                    Buf::GateUp
                } else {
                    Buf::Act
                },
            });
            if moe.glu.is_some() {
                steps.push(Step::MoeGlu { layer: l });
            }
            steps.push(Step::Experts {
                mat: Mat::Down(l),
                input: Buf::Act,
                out: Buf::Experts,
            });
            // (A post-MLP norm after experts is refused at upload: crate::families.)
            steps.push(Step::MoeCombine { layer: l });
            chained = false;
            h_ready = false;
            continue;
        }
        // RMSNorm and SwiGLU inside the gate/up GEMV (or the norm as its own kernel); GeGLU after
        // a plain product.
        let (fusion, act_out) = if silu {
            (SWIGLU, Buf::Act)
        } else {
            (PLAIN, Buf::GateUp)
        };
        if layer.gate_up.chainable() && chained {
            steps.push(Step::Prenorm {
                mat: Mat::GateUp(l),
                swiglu: true,
                slot: 2 * l,
                out: Buf::Act,
            });
        } else if h_ready {
            steps.push(Step::Matvec {
                mat: Mat::GateUp(l),
                input: Buf::H,
                norm: None,
                fusion,
                out: act_out,
            });
        } else if norm_fused(&layer.gate_up) {
            steps.push(Step::Matvec {
                mat: Mat::GateUp(l),
                input: Buf::X,
                norm: Some(Norm::Mlp(l)),
                fusion,
                out: act_out,
            });
        } else {
            steps.push(Step::RmsNorm { norm: Norm::Mlp(l) });
            steps.push(Step::Matvec {
                mat: Mat::GateUp(l),
                input: Buf::H,
                norm: None,
                fusion,
                out: act_out,
            });
        }
        if !silu {
            steps.push(Step::Geglu { layer: l });
        }
        // down (+ residual), leaving the next layer's attention norm input (or the final norm's)
        // when its consumer is dense.
        let (next, consumer) = match m.layers.get(l + 1) {
            Some(n) => (Norm::Attn(l + 1), &n.qkv),
            None => (Norm::Final, m.lm_head()),
        };
        if layer.post_mlp_norm {
            steps.push(Step::Matvec {
                mat: Mat::Down(l),
                input: Buf::Act,
                norm: None,
                fusion: PLAIN,
                out: Buf::Y,
            });
            // The next layer's attention norm with the add (the final norm stays in the LM head).
            let next = (l + 1 < n_layers).then_some(next);
            steps.push(Step::PostNorm {
                norm: Norm::PostMlp(l),
                next,
            });
            chained = false;
            h_ready = next.is_some();
            continue;
        }
        h_ready = false;
        chained = layer.down.chainable() && chain && consumer.chainable();
        steps.push(if chained {
            Step::AccumNorm {
                mat: Mat::Down(l),
                input: Buf::Act,
                next,
                slot: 2 * l + 1,
            }
        } else {
            Step::Matvec {
                mat: Mat::Down(l),
                input: Buf::Act,
                norm: None,
                fusion: RESIDUAL,
                out: Buf::X,
            }
        });
    }
    steps.push(if m.lm_head().chainable() && chained {
        Step::Prenorm {
            mat: Mat::LmHead,
            swiglu: false,
            slot: 2 * n_layers - 1,
            out: Buf::Logits,
        }
    } else {
        Step::Matvec {
            mat: Mat::LmHead,
            input: Buf::X,
            norm: Some(Norm::Final),
            fusion: PLAIN,
            out: Buf::Logits,
        }
    });
    if c.block.final_softcap.is_some() {
        steps.push(Step::Softcap);
    }
    if greedy {
        steps.push(Step::Argmax);
    }
    steps.push(Step::Finish { greedy });
    steps
}

/// The attention mask of layer `l` of `c`: its window, the attention soft-cap, the family's sinks.
pub fn layer_mask(c: &ModelConfig, l: usize) -> AttnMask {
    AttnMask {
        window: c.block.window(l),
        softcap: c.block.attn_softcap,
        sinks: c.arch.family().has(entrollm_model::arch::Role::Sinks),
    }
}

/// Whether layer `l` of `c` rotates with the sliding layers' own RoPE table.
pub fn local_rope(c: &ModelConfig, l: usize) -> bool {
    c.block.local_rope_theta.is_some() && c.block.window(l).is_some()
}

fn scope_of(s: &Step) -> String {
    let layer = match *s {
        Step::Embedding | Step::EmbedScale => return "embed".into(),
        Step::Argmax | Step::Finish { .. } => return "step".into(),
        Step::Softcap => None,
        Step::RmsNorm { norm } | Step::PostNorm { norm, .. } => match norm {
            Norm::Attn(l) | Norm::Mlp(l) | Norm::PostAttn(l) | Norm::PostMlp(l) => Some(l),
            Norm::Final => None,
        },
        Step::GemvRope { layer, .. }
        | Step::RopeAppend { layer, .. }
        | Step::Geglu { layer }
        | Step::MoeTopk { layer }
        | Step::MoeGlu { layer }
        | Step::BiasResidual { layer }
        | Step::MoeCombine { layer }
        | Step::Attention { layer, .. } => Some(layer),
        Step::Prenorm { mat, .. }
        | Step::AccumNorm { mat, .. }
        | Step::Matvec { mat, .. }
        | Step::Experts { mat, .. } => match mat {
            Mat::Qkv(l) | Mat::O(l) | Mat::GateUp(l) | Mat::Down(l) | Mat::Router(l) => Some(l),
            Mat::LmHead => None,
        },
    };
    layer.map_or_else(|| "head".into(), |l| format!("L{l}"))
}

pub(crate) fn epilogue(f: GemvFusion) -> &'static str {
    match (f.accumulate, f.swiglu) {
        (false, false) => "",
        (true, false) => " epi=residual",
        (false, true) => " epi=swiglu",
        (true, true) => " epi=residual+swiglu",
    }
}

/// The launches of step `s`, as its launcher makes them.
fn expand(m: &ModelDesc, attn: AttnConfig, s: &Step, out: &mut Vec<Launch>) {
    let scope = scope_of(s);
    let mut push = |kernel: &'static str, detail: String| {
        out.push(Launch {
            scope: scope.clone(),
            kernel,
            detail,
            pdl: false,
        })
    };
    let bias = |b: bool| if b { " bias" } else { "" };
    let c = &m.config;
    let local = |l: usize| if local_rope(c, l) { " rope=local" } else { "" };
    match *s {
        Step::Embedding => push("embedding_gather", "tok->x".into()),
        Step::EmbedScale => push(
            "scale_f32",
            format!("x*={}", c.block.embed_scale.unwrap_or(1.0)),
        ),
        Step::PostNorm { norm, next } => push(
            "add_rmsnorm",
            match next {
                Some(n) => format!("{norm} y->x+ {n} x->h"),
                None => format!("{norm} y->x+"),
            },
        ),
        Step::Geglu { .. } => push("geglu_f32", "gate_up->act".into()),
        Step::Softcap => push(
            "softcap_f32",
            format!("logits cap={}", c.block.final_softcap.unwrap_or(0.0)),
        ),
        Step::RmsNorm { norm } => push("rmsnorm_f32w", format!("{norm} x->h")),
        Step::GemvRope {
            layer,
            prenorm,
            bias: b,
        } => {
            let d = &m.layers[layer].qkv;
            let gemv = d.gemv().unwrap_or(GemvConfig::DEFAULT);
            // The launcher's configuration: whole rotation pairs a warp.
            let cfg = gemv_rope_variant(gemv).0;
            let norm = match prenorm {
                Some(slot) => format!(" norm=chained:{slot}"),
                None => String::new(),
            };
            push(
                "gemv_bf16_rope",
                format!(
                    "{} {cfg} h->q,kv{norm} epi=rope+kv{}{}",
                    d.label(Mat::Qkv(layer)),
                    bias(b),
                    local(layer)
                ),
            );
        }
        Step::RopeAppend {
            layer,
            bias: b,
            heads: false,
        } => push(
            "rope_append_f32q",
            format!("qkv->q,kv{}{}", bias(b), local(layer)),
        ),
        Step::RopeAppend {
            layer,
            bias: b,
            heads: true,
        } => {
            let qk = if m.layers[layer].qk_norm {
                " qk_norm"
            } else {
                ""
            };
            push(
                "rope_heads_f32q",
                format!(
                    "qkv->q,kv{}{qk} rotary={}/{}{}",
                    bias(b),
                    c.block.rotary_dim(c.head_dim),
                    c.head_dim,
                    local(layer)
                ),
            )
        }
        Step::Prenorm {
            mat,
            swiglu,
            slot,
            out: o,
        } => {
            let d = m.mat(mat);
            let gemv = d.gemv().unwrap_or(GemvConfig::DEFAULT);
            let (cfg, fusion) = if swiglu {
                (swiglu_config(gemv), SWIGLU)
            } else {
                (gemv, PLAIN)
            };
            let kernel = d.form.chained().map_or("gemv_bf16_prenorm", |k| k.prenorm);
            push(
                kernel,
                format!(
                    "{} {cfg} h->{o} norm=chained:{slot}{}",
                    d.label(mat),
                    epilogue(fusion)
                ),
            );
        }
        Step::AccumNorm {
            mat,
            input,
            next,
            slot,
        } => {
            let d = m.mat(mat);
            let cfg = d.gemv().unwrap_or(GemvConfig::DEFAULT);
            let kernel = d
                .form
                .chained()
                .map_or("gemv_bf16_accum_norm", |k| k.accum_norm);
            push(
                kernel,
                format!(
                    "{} {cfg} {input}->x epi=residual next={next}:{slot}",
                    d.label(mat)
                ),
            );
        }
        Step::Matvec {
            mat,
            input,
            norm,
            fusion,
            out,
        } => {
            let d = m.mat(mat);
            let launch = MatvecLaunch {
                label: &d.label(mat),
                rows: d.rows,
                cols: d.cols,
                input,
                norm,
                fusion,
                out,
            };
            d.form.matvec(&launch, &mut push);
        }
        Step::MoeTopk { layer } => {
            let moe = m.layers[layer].moe.as_ref();
            push(
                "moe_topk",
                format!(
                    "router->experts top={}/{}{}{}{}",
                    moe.map_or(0, |x| x.top_k),
                    moe.map_or(0, |x| x.experts),
                    if moe.is_some_and(|x| x.topk_first) {
                        " topk-softmax"
                    } else {
                        ""
                    },
                    if moe.is_some_and(|x| x.norm_topk && !x.topk_first) {
                        " renorm"
                    } else {
                        ""
                    },
                    bias(moe.is_some_and(|x| x.router_bias)),
                ),
            )
        }
        Step::Experts { mat, input, out } => {
            let d = m.mat(mat);
            let (l, swiglu) = match mat {
                Mat::GateUp(l) => (l, out == Buf::Act),
                Mat::Down(l) | Mat::Router(l) | Mat::Qkv(l) | Mat::O(l) => (l, false),
                Mat::LmHead => (0, false),
            };
            let moe = m.layers[l].moe.as_ref();
            let experts = moe.map_or(1, |x| x.experts);
            let rows = d.rows / experts.max(1);
            let g = GatherLaunch {
                label: &format!("{mat} {} {experts}x{rows}x{}", d.form_name(), d.cols),
                experts,
                slots: moe.map_or(1, |x| x.top_k),
                input,
                swiglu,
                out,
            };
            // (decode_plan refused a form without a gathered product.)
            d.form.gathered(&g, &mut push);
        }
        Step::MoeCombine { layer } => {
            let moe = m.layers[layer].moe.as_ref();
            push(
                "moe_combine",
                format!(
                    "slots->x+ top={}{}",
                    moe.map_or(0, |x| x.top_k),
                    bias(moe.is_some_and(|x| x.expert_biases))
                ),
            )
        }
        Step::MoeGlu { layer } => {
            let moe = m.layers[layer].moe.as_ref();
            push(
                "moe_glu_f32",
                format!(
                    "gate_up->act {}{}",
                    moe.and_then(|x| x.glu).unwrap_or(Glu::Silu).name(),
                    bias(moe.is_some_and(|x| x.expert_biases))
                ),
            )
        }
        Step::BiasResidual { .. } => push("bias_residual", "y->x+ o.bias".into()),
        Step::Attention { fused: true, layer } => push(
            "attn_decode_fused",
            format!(
                "q->attn chunk={} warps={}{}",
                attn.chunk,
                attn.warps,
                layer_mask(c, layer)
            ),
        ),
        Step::Attention {
            fused: false,
            layer,
        } => {
            push(
                "attn_decode_partial",
                format!(
                    "q->partials chunk={} warps={}{}",
                    attn.chunk,
                    attn.warps,
                    layer_mask(c, layer)
                ),
            );
            push("attn_decode_combine", "partials->attn".into());
        }
        Step::Argmax => {
            push("argmax_partial", "logits->partials".into());
            push("argmax_final", "partials->tok".into());
        }
        Step::Finish { greedy } => push(
            "finish_step",
            if greedy {
                "tok->history pos+1 len+1 norm_slots=0".into()
            } else {
                "pos+1 len+1 norm_slots=0".into()
            },
        ),
    }
}

/// Checks the nodes of a captured decode step (kernel names in order, `memset` for memsets)
/// against its plan; the error names the first node that differs.
pub fn check_nodes(plan: &DecodePlan, nodes: &[String]) -> Result<()> {
    let want = plan.nodes();
    let first = want
        .iter()
        .zip(nodes)
        .position(|(w, g)| w != g)
        .or((want.len() != nodes.len()).then(|| want.len().min(nodes.len())));
    match first {
        None => Ok(()),
        Some(i) => Err(GpuError::invalid(
            "decode",
            format!(
                "the captured decode step ({} nodes) differs from its plan ({} launches) at node \
                 {i}: captured `{}`, planned `{}`",
                nodes.len(),
                want.len(),
                nodes.get(i).map_or("(none)", |s| s.as_str()),
                plan.launches.get(i).map_or("(none)".into(), |l| format!(
                    "{} {} {}",
                    l.scope, l.kernel, l.detail
                )),
            ),
        )),
    }
}

/// Where two plan texts differ, line by line (`-` expected, `+` got), or None when they are equal.
pub fn text_diff(want: &str, got: &str) -> Option<String> {
    if want == got {
        return None;
    }
    let (a, b): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    // Longest common subsequence of lines, so that one inserted launch shows as one line.
    let (n, k) = (a.len(), b.len());
    let mut lcs = vec![vec![0u32; k + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..k).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let mut out = String::new();
    let (mut i, mut j) = (0, 0);
    while i < n || j < k {
        if i < n && j < k && a[i] == b[j] {
            i += 1;
            j += 1;
        } else if j < k && (i == n || lcs[i][j + 1] >= lcs[i + 1][j]) {
            let _ = writeln!(out, "+{:>4}: {}", j + 1, b[j]);
            j += 1;
        } else {
            let _ = writeln!(out, "-{:>4}: {}", i + 1, a[i]);
            i += 1;
        }
    }
    if out.is_empty() {
        out.push_str("(the texts differ in line endings only)\n");
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::gemv_config_for;
    use crate::ops::gemv_fp8::pal_bf16_config_for;
    use entrollm_codec::dtans::{Coding, Mode};
    use entrollm_codec::Payload;

    #[test]
    fn options_parse_every_knob_and_name_the_values() {
        let mut o = DecodeOptions::default();
        assert!(o.pdl && !o.pdl_dense_fp8 && !o.fused_norm && !o.split_norm);
        o.set("norm", "split").unwrap();
        assert!(o.split_norm && !o.fused_norm);
        o.set("norm", "fused").unwrap();
        assert!(o.fused_norm && !o.split_norm);
        o.set("norm", "chained").unwrap();
        assert!(!o.fused_norm && !o.split_norm);
        o.set("pdl", "all").unwrap();
        assert!(o.pdl && o.pdl_dense_fp8);
        o.set("pdl", "off").unwrap();
        assert!(!o.pdl && !o.pdl_dense_fp8);
        o.set("attention", "fused").unwrap();
        assert!(o.fused_attention);
        o.set("rope", "split").unwrap();
        assert!(o.split_rope);
        o.set("chunk", "32x4").unwrap();
        assert_eq!(o.attn_chunk, Some((32, 4)));
        let e = o.set("norm", "merged").unwrap_err();
        assert!(e.contains("chained|split|fused"), "{e}");
        assert!(o
            .set("chunk", "32")
            .unwrap_err()
            .contains("POSITIONSxWARPS"));
        assert!(o.set("colour", "red").unwrap_err().contains("unknown"));
    }

    #[test]
    fn forms_answer_the_capability_questions_as_the_linears_did() {
        let coding = Coding {
            mode: Mode::Pair,
            log2_m: 8,
            sc: 256,
            t: Some(16),
        };
        // (desc, dense BF16, chainable, norm in GEMV): GpuLinear::as_dense, ::chainable and
        // ::norm_in_gemv of each variant before the plan existed.
        let cases = [
            (crate::forms::bf16::desc(512, 256), true, true, false),
            (
                crate::forms::fp8::desc(512, 256, false, 132),
                false,
                true,
                false,
            ),
            (
                crate::forms::fp8::desc(512, 256, true, 132),
                false,
                false,
                true,
            ),
            (
                crate::forms::pal_bf16::desc(512, 256, 132),
                false,
                false,
                true,
            ),
            (
                crate::forms::dtans::desc(Payload::Bf16, coding, 512, 256, 1, false).unwrap(),
                false,
                false,
                false,
            ),
        ];
        for (d, dense, chain, norm) in cases {
            assert_eq!(d.dense_bf16_weights(), dense, "{d:?}");
            assert_eq!(d.chainable(), chain, "{d:?}");
            assert_eq!(d.norm_in_gemv(), norm, "{d:?}");
        }
    }

    #[test]
    fn form_constructors_take_the_linears_configurations() {
        use crate::ops::gemv_fp8::{gemv_fp8_config_for, pal4_config_for};
        assert_eq!(
            crate::forms::bf16::desc(6144, 4096).gemv(),
            Some(gemv_config_for(6144, 4096))
        );
        assert_eq!(
            crate::forms::fp8::desc(6144, 4096, false, 132).gemv(),
            Some(gemv_fp8_config_for(6144, 4096))
        );
        assert_eq!(
            crate::forms::fp8::desc(6144, 4096, true, 132).gemv(),
            Some(pal4_config_for(6144, 132, false))
        );
        assert_eq!(
            crate::forms::pal_bf16::desc(128_256, 4096, 132).gemv(),
            Some(pal_bf16_config_for(128_256, 132))
        );
    }

    #[test]
    fn diff_shows_the_inserted_line_only() {
        let d = text_diff("a\nb\nc\n", "a\nb\nx\nc\n").unwrap();
        assert_eq!(d, "+   3: x\n");
        let d = text_diff("a\nb\n", "a\nc\n").unwrap();
        assert!(d.contains("-   2: b") && d.contains("+   2: c"), "{d}");
        assert!(text_diff("a", "a").is_none());
    }

    #[test]
    fn captured_nodes_are_checked_against_the_plan() {
        let mut c = entrollm_model::synth::SynthShape::Tiny.config();
        c.hidden_size = 256;
        c.num_heads = 4;
        c.head_dim = 64;
        let m = ModelDesc::build(&c, 132, |_, r, k| Ok(crate::forms::bf16::desc(r, k))).unwrap();
        let plan = decode_plan(&m, &DecodeOptions::default(), true).unwrap();
        let nodes: Vec<String> = plan.nodes().iter().map(|s| s.to_string()).collect();
        check_nodes(&plan, &nodes).unwrap();
        let mut swapped = nodes.clone();
        swapped[2] = "gemv_bf16".into();
        let e = check_nodes(&plan, &swapped).unwrap_err().to_string();
        assert!(
            e.contains("at node 2: captured `gemv_bf16`, planned `L0 gemv_bf16_rope"),
            "{e}"
        );
        let e = check_nodes(&plan, &nodes[..nodes.len() - 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("planned `step finish_step"), "{e}");
        let mut longer = nodes.clone();
        longer.push(MEMSET.into());
        let e = check_nodes(&plan, &longer).unwrap_err().to_string();
        assert!(e.contains("captured `memset`, planned `(none)`"), "{e}");
    }

    #[test]
    fn a_bad_attention_chunk_is_an_error_naming_it() {
        let mut c = entrollm_model::synth::SynthShape::Tiny.config();
        c.head_dim = 64;
        let mut o = DecodeOptions::default();
        o.set("chunk", "32x40").unwrap();
        let e = decode_attention(&c, &o).unwrap_err().to_string();
        assert!(e.contains("32 positions over 40 warps"), "{e}");
    }
}
