//! The CPU reference engine: the forward pass of every family ([`crate::arch`]) over
//! [`ModelWeights`], with an f32 KV cache. Prompts run as batches (one matmul per weight per chunk, causal attention);
//! decoding runs one token at a time. Work is spread over rayon's global pool, through the crew
//! ([`crate::crew`]) while a forward runs on a pool thread.

use crate::config::{ModelConfig, RopeScaling, RopeStyle, Routing};
use crate::error::{ModelError, Result};
use crate::weights::{ExpertBiases, Experts, GatedMlp, LayerWeights, Mlp, ModelWeights};
use std::sync::Arc;

/// Tokens per forward chunk: bounds activation memory on long prompts (each weight is read once
/// per chunk).
const PREFILL_CHUNK: usize = 256;
/// Positions whose logits are computed in one LM-head matmul (bounds the logits buffer).
const LOGITS_CHUNK: usize = 32;
/// Elements per task in element-wise work, so small vectors stay on one thread.
const ELEMENTWISE_TASK: usize = 1 << 14;

/// Runs a model on the CPU, holding the KV cache of one sequence.
pub struct Engine {
    weights: Arc<ModelWeights>,
    max_seq_len: usize,
    /// RoPE inverse frequencies (radians per position) of each rotated pair, scaling applied.
    inv_freq: Vec<f64>,
    /// cos and sin are multiplied by this (YaRN's attention factor; 1 otherwise).
    rope_scale: f32,
    /// Those of the sliding layers where they rotate with a base of their own (Gemma 3).
    local_inv_freq: Option<Vec<f64>>,
    /// Per layer: keys of positions `0..pos`, `[pos, kv_dim]`, RoPE applied.
    keys: Vec<Vec<f32>>,
    /// Per layer: values of positions `0..pos`, `[pos, kv_dim]`.
    values: Vec<Vec<f32>>,
    pos: usize,
    /// q/k/v (and gate/up) multiplied in one parallel region; off, one after another.
    concurrent_launches: bool,
    /// Each routed token's margin, while [`Engine::record_route_margins`] is on.
    route_margins: Option<Vec<RouteMargin>>,
}

/// How far one token's routing in one layer of experts is from a tie: the gap between the
/// `top_k`-th and the next expert's routing score (probability, or logit where the top-k comes
/// first), divided by the largest score's magnitude. Another engine whose router input differs
/// by more than about this (relatively) may pick another expert.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouteMargin {
    /// The token's position.
    pub pos: usize,
    pub layer: usize,
    pub margin: f32,
}

/// Bytes an engine for `max_seq_len` tokens allocates beside the weights: its KV cache and the
/// buffers of a prefill chunk and its logits.
pub fn state_bytes(c: &ModelConfig, max_seq_len: usize) -> u64 {
    let kv = 2 * c.num_layers * max_seq_len * c.kv_dim();
    let n = PREFILL_CHUNK.min(max_seq_len);
    let layer = n * (3 * c.hidden_size + 2 * c.q_dim() + 2 * c.kv_dim() + 2 * c.intermediate_size);
    let logits = LOGITS_CHUNK * (c.hidden_size + c.vocab_size) + c.vocab_size;
    4 * (kv + layer + logits) as u64
}

impl Engine {
    /// An engine for sequences of up to `max_seq_len` tokens (at most the model's
    /// `max_position_embeddings`). Checks every weight's shape against the config.
    pub fn new(weights: impl Into<Arc<ModelWeights>>, max_seq_len: usize) -> Result<Self> {
        let weights = weights.into();
        weights.validate()?;
        let c = &weights.config;
        if max_seq_len == 0 || max_seq_len > c.max_position_embeddings {
            return Err(ModelError::Config(format!(
                "max_seq_len: {max_seq_len} is out of range (1..={} = max_position_embeddings)",
                c.max_position_embeddings
            )));
        }
        // The whole context's cache reserved (not touched) now: it never grows past it by
        // doubling, and a context the machine cannot hold is an error here, not an abort later.
        let per_layer = max_seq_len * c.kv_dim();
        let mut caches = Vec::with_capacity(2 * c.num_layers);
        for _ in 0..2 * c.num_layers {
            let mut cache = Vec::new();
            cache.try_reserve_exact(per_layer).map_err(|_| {
                ModelError::Config(format!(
                    "the KV cache of a {max_seq_len}-token context ({:.2} GB) cannot be \
                     allocated: lower the context (-c)",
                    state_bytes(c, max_seq_len) as f64 / 1e9
                ))
            })?;
            caches.push(cache);
        }
        let values = caches.split_off(c.num_layers);
        Ok(Engine {
            inv_freq: rope_inv_freq(c),
            rope_scale: rope_attention_factor(c),
            local_inv_freq: c.block.local_rope_theta.map(|theta| {
                let local = ModelConfig {
                    rope_theta: theta,
                    rope_scaling: RopeScaling::None,
                    ..c.clone()
                };
                rope_inv_freq(&local)
            }),
            max_seq_len,
            keys: caches,
            values,
            pos: 0,
            weights,
            concurrent_launches: true,
            route_margins: None,
        })
    }

    /// Records every routed token's [`RouteMargin`] from now on (for comparisons with another
    /// engine: the GPU selftest reports the steps whose routing is within its rounding).
    pub fn record_route_margins(&mut self) {
        self.route_margins.get_or_insert_with(Vec::new);
    }

    /// The margins recorded since the last call.
    pub fn take_route_margins(&mut self) -> Vec<RouteMargin> {
        self.route_margins
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Every launch's products one after another (the tuner times each launch inside decode
    /// steps, and a step's time is then the sum of its launches' and the rest).
    pub fn one_launch_at_a_time(&mut self) {
        self.concurrent_launches = false;
    }

    /// Whether q/k/v (and gate/up) go to rayon as one region: not while the crew runs the
    /// products (each is already spread over every thread, cheaply).
    fn concurrent(&self) -> bool {
        self.concurrent_launches && !crate::crew::leading()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.weights.config
    }

    pub fn weights(&self) -> &Arc<ModelWeights> {
        &self.weights
    }

    /// Tokens in the KV cache (the position the next token gets).
    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// Forgets the sequence (keeps the cache's memory).
    pub fn reset(&mut self) {
        self.truncate(0);
    }

    /// Keeps only the first `len` tokens of the sequence (no-op if it is not longer), so a shared
    /// prefix need not be recomputed.
    pub fn truncate(&mut self, len: usize) {
        if len < self.pos {
            let kv_dim = self.config().kv_dim();
            for cache in self.keys.iter_mut().chain(self.values.iter_mut()) {
                cache.truncate(len * kv_dim);
            }
            self.pos = len;
        }
    }

    /// Appends `tokens` to the sequence, processed as a batch, and returns the logits after the
    /// last one.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut last = Vec::new();
        self.forward(tokens, tokens.len().saturating_sub(1), |_, logits| {
            last = logits.to_vec()
        })?;
        Ok(last)
    }

    /// Appends one token and returns the logits after it.
    pub fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        self.prefill(&[token])
    }

    /// Appends `tokens` and returns the logits after each of them (`tokens.len() × vocab`).
    pub fn logits_for_all(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        let mut all = Vec::with_capacity(tokens.len());
        self.forward(tokens, 0, |_, logits| all.push(logits.to_vec()))?;
        Ok(all)
    }

    /// Appends `tokens` to the sequence and calls `on_logits(i, logits)` with the logits after
    /// `tokens[i]` for every `i ≥ logits_from`, in order. Checks the token ids and the free
    /// context before touching the cache, so on error the sequence is unchanged.
    pub fn forward(
        &mut self,
        tokens: &[u32],
        logits_from: usize,
        mut on_logits: impl FnMut(usize, &[f32]),
    ) -> Result<()> {
        if tokens.is_empty() {
            return Err(ModelError::Config("engine input: no tokens".into()));
        }
        if self.pos + tokens.len() > self.max_seq_len {
            return Err(ModelError::Config(format!(
                "context full: {} tokens in the cache + {} new exceed max_seq_len {}",
                self.pos,
                tokens.len(),
                self.max_seq_len
            )));
        }
        let vocab = self.config().vocab_size;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::tensor(
                "model.embed_tokens.weight",
                format!("token id {bad} is outside the vocabulary ({vocab})"),
            ));
        }
        let _awake = crate::crew::Awake::new();
        for (chunk_index, chunk) in tokens.chunks(PREFILL_CHUNK).enumerate() {
            let offset = chunk_index * PREFILL_CHUNK;
            let hidden = self.forward_layers(chunk);
            let first = logits_from.saturating_sub(offset);
            if first < chunk.len() {
                self.logits(&hidden[first * self.config().hidden_size..], |i, logits| {
                    on_logits(offset + first + i, logits)
                });
            }
        }
        Ok(())
    }

    /// Runs `tokens` (already checked) through every layer at positions `pos..`, appends their
    /// keys and values to the cache, and returns the final hidden states `[n, hidden]` (before
    /// the final norm).
    fn forward_layers(&mut self, tokens: &[u32]) -> Vec<f32> {
        let weights = Arc::clone(&self.weights);
        let c = &weights.config;
        let (n, hidden) = (tokens.len(), c.hidden_size);
        let mut x = vec![0f32; n * hidden];
        for (row, &t) in x.chunks_mut(hidden).zip(tokens) {
            weights.embed.row(t as usize, row);
            if let Some(scale) = c.block.embed_scale {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
        let rope = RopeAngles::new(&self.inv_freq, self.rope_scale, self.pos, n);
        let local_rope = self
            .local_inv_freq
            .as_ref()
            .map(|f| RopeAngles::new(f, 1.0, self.pos, n));
        let mut buffers = LayerBuffers::new(c, n);
        for (layer_index, layer) in weights.layers.iter().enumerate() {
            let rope = match (&local_rope, c.block.window(layer_index)) {
                (Some(local), Some(_)) => local,
                _ => &rope,
            };
            self.attention_block(layer_index, layer, rope, &mut x, &mut buffers);
            let concurrent = self.concurrent();
            let margins = self
                .route_margins
                .as_mut()
                .map(|m| (m, layer_index, self.pos));
            mlp_block(c, layer, &mut x, &mut buffers, concurrent, margins);
        }
        self.pos += n;
        x
    }

    /// `x += o_proj(attention(rope(q), rope(k), v))` over the normed `x`; appends the chunk's keys
    /// and values to this layer's cache.
    fn attention_block(
        &mut self,
        layer_index: usize,
        layer: &LayerWeights,
        rope: &RopeAngles,
        x: &mut [f32],
        b: &mut LayerBuffers,
    ) {
        let c = &self.weights.config;
        let n = x.len() / c.hidden_size;
        rms_norm(x, &layer.attn_norm, c.rms_norm_eps, &mut b.normed);
        let normed = &b.normed;
        let project = |proj: &Arc<dyn crate::weights::Linear>,
                       bias: &Option<Vec<f32>>,
                       out: &mut Vec<f32>| {
            proj.matmul(normed, n, out);
            if let Some(bias) = bias {
                for row in out.chunks_mut(bias.len()) {
                    add_assign(row, bias);
                }
            }
        };
        if self.concurrent() {
            // One parallel region for the three (a thread done with its share of q goes on to k).
            rayon::join(
                || project(&layer.q, &layer.q_bias, &mut b.q),
                || {
                    rayon::join(
                        || project(&layer.k, &layer.k_bias, &mut b.k),
                        || project(&layer.v, &layer.v_bias, &mut b.v),
                    )
                },
            );
        } else {
            project(&layer.q, &layer.q_bias, &mut b.q);
            project(&layer.k, &layer.k_bias, &mut b.k);
            project(&layer.v, &layer.v_bias, &mut b.v);
        }
        if let Some(w) = &layer.norms.q {
            rms_norm_in_place(&mut b.q, w, c.rms_norm_eps);
        }
        if let Some(w) = &layer.norms.k {
            rms_norm_in_place(&mut b.k, w, c.rms_norm_eps);
        }
        let rotary = c.block.rotary_dim(c.head_dim);
        rope.apply(&mut b.q, c.head_dim, rotary, c.rope_style);
        rope.apply(&mut b.k, c.head_dim, rotary, c.rope_style);
        self.keys[layer_index].extend_from_slice(&b.k);
        self.values[layer_index].extend_from_slice(&b.v);
        attention(
            c,
            c.block.window(layer_index),
            layer.norms.sinks.as_deref(),
            &b.q,
            &self.keys[layer_index],
            &self.values[layer_index],
            self.pos,
            &mut b.attended,
        );
        layer.o.matmul(&b.attended, n, &mut b.normed);
        if let Some(bias) = &layer.norms.o_bias {
            for row in b.normed.chunks_mut(bias.len()) {
                add_assign(row, bias);
            }
        }
        if let Some(w) = &layer.norms.post_attn {
            rms_norm_in_place(&mut b.normed, w, c.rms_norm_eps);
        }
        add_assign(x, &b.normed);
    }

    /// Final norm and LM head over the hidden states `hidden` (`[m, hidden_size]`), calling
    /// `on_logits(i, logits)` for each row.
    fn logits(&self, hidden: &[f32], mut on_logits: impl FnMut(usize, &[f32])) {
        let w = &self.weights;
        let (h, vocab) = (w.config.hidden_size, w.config.vocab_size);
        let mut normed = vec![0f32; LOGITS_CHUNK.min(hidden.len() / h) * h];
        let mut logits = vec![0f32; normed.len() / h * vocab];
        for (chunk_index, chunk) in hidden.chunks(LOGITS_CHUNK * h).enumerate() {
            let m = chunk.len() / h;
            rms_norm(
                chunk,
                &w.final_norm,
                w.config.rms_norm_eps,
                &mut normed[..m * h],
            );
            w.lm_head
                .matmul(&normed[..m * h], m, &mut logits[..m * vocab]);
            if let Some(cap) = w.config.block.final_softcap {
                logits[..m * vocab]
                    .iter_mut()
                    .for_each(|l| *l = softcap(*l, cap));
            }
            for (i, row) in logits[..m * vocab].chunks(vocab).enumerate() {
                on_logits(chunk_index * LOGITS_CHUNK + i, row);
            }
        }
    }
}

/// Activations of one chunk of `n` tokens, reused across layers.
struct LayerBuffers {
    /// `[n, hidden]`: normed input of a block, then its output before the residual add.
    normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// `[n, q_dim]`: attention output per head.
    attended: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// `[n, hidden]`: the MLP's output.
    mlp_out: Vec<f32>,
}

impl LayerBuffers {
    fn new(c: &ModelConfig, n: usize) -> Self {
        LayerBuffers {
            normed: vec![0.0; n * c.hidden_size],
            q: vec![0.0; n * c.q_dim()],
            k: vec![0.0; n * c.kv_dim()],
            v: vec![0.0; n * c.kv_dim()],
            attended: vec![0.0; n * c.q_dim()],
            gate: vec![0.0; n * c.intermediate_size],
            up: vec![0.0; n * c.intermediate_size],
            mlp_out: vec![0.0; n * c.hidden_size],
        }
    }
}

/// `x += mlp(h)` with `h` the normed `x` (the output normed again where the family has a
/// post-MLP norm): the gated MLP, or the routed experts' outputs weighted by the router.
fn mlp_block(
    c: &ModelConfig,
    layer: &LayerWeights,
    x: &mut [f32],
    b: &mut LayerBuffers,
    concurrent: bool,
    margins: Option<(&mut Vec<RouteMargin>, usize, usize)>,
) {
    let n = x.len() / c.hidden_size;
    rms_norm(x, &layer.mlp_norm, c.rms_norm_eps, &mut b.normed);
    match &layer.mlp {
        Mlp::Gated(g) => gated(
            c,
            g,
            None,
            &b.normed,
            n,
            &mut b.gate,
            &mut b.up,
            &mut b.mlp_out,
            concurrent,
        ),
        Mlp::Experts(e) => experts(c, e, &b.normed, n, &mut b.mlp_out, margins),
    }
    if let Some(w) = &layer.norms.post_mlp {
        rms_norm_in_place(&mut b.mlp_out, w, c.rms_norm_eps);
    }
    add_assign(x, &b.mlp_out);
}

/// `out = down(act(gate(h)) · up(h))` for the `n` rows of `h` (each product plus its bias where
/// the expert has them; `act(gate, up)` gpt-oss's clamped SwiGLU where the block says); `gate`
/// and `up` are scratch of at least `n × rows` of the gate.
#[allow(clippy::too_many_arguments)]
fn gated(
    c: &ModelConfig,
    m: &GatedMlp,
    bias: Option<&ExpertBiases>,
    h: &[f32],
    n: usize,
    gate: &mut Vec<f32>,
    up: &mut Vec<f32>,
    out: &mut Vec<f32>,
    concurrent: bool,
) {
    let inter = m.gate.rows();
    gate.resize(n * inter, 0.0);
    up.resize(n * inter, 0.0);
    out.resize(n * m.down.rows(), 0.0);
    let (gate, up) = (&mut gate[..n * inter], &mut up[..n * inter]);
    if concurrent {
        rayon::join(|| m.gate.matmul(h, n, gate), || m.up.matmul(h, n, up));
    } else {
        m.gate.matmul(h, n, gate);
        m.up.matmul(h, n, up);
    }
    if let Some(b) = bias {
        for (g, u) in gate.chunks_mut(inter).zip(up.chunks_mut(inter)) {
            add_assign(g, &b.gate);
            add_assign(u, &b.up);
        }
    }
    let up = &*up;
    let act = c.block.activation;
    let clamped = c.block.clamped_swiglu;
    crate::crew::chunks_mut(gate, ELEMENTWISE_TASK, |i, g| {
        let u = &up[i * ELEMENTWISE_TASK..][..g.len()];
        match clamped {
            Some(s) => {
                for (g, &u) in g.iter_mut().zip(u) {
                    *g = s.apply(*g, u);
                }
            }
            None => {
                for (g, &u) in g.iter_mut().zip(u) {
                    *g = act.apply(*g) * u;
                }
            }
        }
    });
    let out = &mut out[..n * m.down.rows()];
    m.down.matmul(gate, n, out);
    if let Some(b) = bias {
        for row in out.chunks_mut(b.down.len()) {
            add_assign(row, &b.down);
        }
    }
}

/// A mixture of experts over the `n` rows of `h` into `out`: per token the router's logits (plus
/// its bias), then [`Routing`]: their softmax (in f32), its `top_k` most probable experts (ties to
/// the lower index), their probabilities renormalised where the config says; or the `top_k`
/// largest logits weighted by their own softmax. Then expert by expert, in index order, its
/// tokens' rows through it as one batch and added to those tokens' outputs, weighted
/// (transformers' order).
/// `margins`: where each token's [`RouteMargin`] goes, with the layer's index and the chunk's
/// first position.
fn experts(
    c: &ModelConfig,
    e: &Experts,
    h: &[f32],
    n: usize,
    out: &mut Vec<f32>,
    mut margins: Option<(&mut Vec<RouteMargin>, usize, usize)>,
) {
    let moe = c
        .block
        .moe
        .as_ref()
        .expect("a layer of experts has a config for them");
    let (hidden, count) = (c.hidden_size, e.experts.len());
    let mut logits = vec![0f32; n * count];
    e.router.matmul(h, n, &mut logits);
    if let Some(bias) = &e.router_bias {
        for row in logits.chunks_mut(count) {
            add_assign(row, bias);
        }
    }
    // Per expert: (token, weight) in token order.
    let mut routes: Vec<Vec<(usize, f32)>> = vec![Vec::new(); count];
    let mut order: Vec<usize> = Vec::with_capacity(count);
    for (t, row) in logits.chunks_mut(count).enumerate() {
        if moe.routing == Routing::SoftmaxTopK {
            let sum = exp_shifted(row);
            row.iter_mut().for_each(|p| *p /= sum);
        }
        order.clear();
        order.extend(0..count);
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        if let Some((m, layer, start)) = margins.as_mut() {
            if let Some(&next) = order.get(moe.top_k) {
                let scale = row.iter().fold(0f32, |a, v| a.max(v.abs()));
                m.push(RouteMargin {
                    pos: *start + t,
                    layer: *layer,
                    margin: (row[order[moe.top_k - 1]] - row[next]) / scale.max(f32::MIN_POSITIVE),
                });
            }
        }
        let picked = &order[..moe.top_k];
        let mut top: Vec<f32> = picked.iter().map(|&x| row[x]).collect();
        match moe.routing {
            Routing::SoftmaxTopK => {
                let total: f32 = top.iter().sum();
                if moe.norm_topk {
                    top.iter_mut().for_each(|p| *p /= total);
                }
            }
            Routing::TopKSoftmax => {
                let sum = exp_shifted(&mut top);
                top.iter_mut().for_each(|p| *p /= sum);
            }
        }
        for (&x, &w) in picked.iter().zip(&top) {
            routes[x].push((t, w));
        }
    }
    out.clear();
    out.resize(n * hidden, 0.0);
    let (mut gate, mut up, mut y, mut rows) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (x, route) in routes.iter().enumerate() {
        if route.is_empty() {
            continue;
        }
        rows.clear();
        for &(t, _) in route {
            rows.extend_from_slice(&h[t * hidden..(t + 1) * hidden]);
        }
        gated(
            c,
            &e.experts[x],
            e.biases.get(x),
            &rows,
            route.len(),
            &mut gate,
            &mut up,
            &mut y,
            false,
        );
        for (j, &(t, w)) in route.iter().enumerate() {
            let (o, y) = (
                &mut out[t * hidden..(t + 1) * hidden],
                &y[j * hidden..(j + 1) * hidden],
            );
            for (o, &y) in o.iter_mut().zip(y) {
                *o += y * w;
            }
        }
    }
}

/// Causal grouped-query attention of the chunk's queries (`q`: `[n, heads·head_dim]`, at
/// positions `start..start + n`) over the cached keys and values of positions `0..start + n`, or
/// of the last `window` of them; each head's sink logit (`sinks`) joins its softmax's
/// denominator. One task per (token, head).
#[allow(clippy::too_many_arguments)]
fn attention(
    c: &ModelConfig,
    window: Option<usize>,
    sinks: Option<&[f32]>,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    start: usize,
    out: &mut [f32],
) {
    let (d, heads, kv_dim) = (c.head_dim, c.num_heads, c.kv_dim());
    let group = heads / c.num_kv_heads;
    let scale = c.block.attn_scale.unwrap_or(1.0 / (d as f32).sqrt());
    let cap = c.block.attn_softcap;
    crate::crew::chunks_mut(out, d, |index, out| {
        let q = &q[index * d..][..d];
        let (token, head) = (index / heads, index % heads);
        let sink = sinks.map(|s| s[head]);
        let end = start + token + 1;
        let first = window.map_or(0, |w| end.saturating_sub(w));
        let kv = KvHead {
            keys: &keys[first * kv_dim..],
            values: &values[first * kv_dim..],
            stride: kv_dim,
            offset: (head / group) * d,
            len: end - first,
        };
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present.
            return unsafe { attend_avx2(q, &kv, scale, cap, sink, out) };
        }
        attend(q, &kv, scale, cap, sink, out)
    });
}

/// `cap · tanh(x / cap)`: Gemma's soft-capping of attention and final logits.
#[inline(always)]
fn softcap(x: f32, cap: f32) -> f32 {
    cap * (x / cap).tanh()
}

/// One key/value head's cached positions `0..len`: position t's vectors at `t·stride + offset`.
struct KvHead<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    stride: usize,
    offset: usize,
    len: usize,
}

/// [`attend`] on AVX2, the same operations in the same order (the same sums, bit for bit): the
/// query and the output held in registers, four keys' dot products at once (their chains of
/// additions overlap). Heads of 32, 64, 96 or 128 elements; others: [`attend`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attend_avx2(
    q: &[f32],
    kv: &KvHead,
    scale: f32,
    cap: Option<f32>,
    sink: Option<f32>,
    out: &mut [f32],
) {
    match q.len() {
        32 => attend_avx2_w::<4>(q, kv, scale, cap, sink, out),
        64 => attend_avx2_w::<8>(q, kv, scale, cap, sink, out),
        96 => attend_avx2_w::<12>(q, kv, scale, cap, sink, out),
        128 => attend_avx2_w::<16>(q, kv, scale, cap, sink, out),
        _ => attend(q, kv, scale, cap, sink, out),
    }
}

/// [`attend_avx2`] for heads of `8·W` elements.
/// Safety: AVX2 present.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn attend_avx2_w<const W: usize>(
    q: &[f32],
    kv: &KvHead,
    scale: f32,
    cap: Option<f32>,
    sink: Option<f32>,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let d = 8 * W;
    assert!(q.len() == d && out.len() == d && kv.len > 0);
    assert!((kv.len - 1) * kv.stride + kv.offset + d <= kv.keys.len().min(kv.values.len()));
    let qv: [__m256; W] = std::array::from_fn(|i| _mm256_loadu_ps(q.as_ptr().add(8 * i)));
    // `dot`'s lanes summed in its order (its empty tail added).
    let total = |acc: __m256| {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        lanes.iter().sum::<f32>() + 0.0
    };
    let at = |base: &[f32], t: usize| base.as_ptr().add(t * kv.stride + kv.offset);
    let mut scores = vec![0f32; kv.len];
    let mut t = 0;
    while t + 4 <= kv.len {
        let k = [
            at(kv.keys, t),
            at(kv.keys, t + 1),
            at(kv.keys, t + 2),
            at(kv.keys, t + 3),
        ];
        let mut acc = [_mm256_setzero_ps(); 4];
        for (i, &qi) in qv.iter().enumerate() {
            for j in 0..4 {
                let p = _mm256_mul_ps(qi, _mm256_loadu_ps(k[j].add(8 * i)));
                acc[j] = _mm256_add_ps(acc[j], p);
            }
        }
        for j in 0..4 {
            scores[t + j] = total(acc[j]) * scale;
        }
        t += 4;
    }
    for (t, s) in scores.iter_mut().enumerate().skip(t) {
        let k = at(kv.keys, t);
        let mut acc = _mm256_setzero_ps();
        for (i, &qi) in qv.iter().enumerate() {
            acc = _mm256_add_ps(acc, _mm256_mul_ps(qi, _mm256_loadu_ps(k.add(8 * i))));
        }
        *s = total(acc) * scale;
    }
    cap_scores(&mut scores, cap);
    let sum = exp_shifted_sink(&mut scores, sink);
    let mut o = [_mm256_setzero_ps(); W];
    for (t, &s) in scores.iter().enumerate() {
        let weight = _mm256_set1_ps(s / sum);
        let v = at(kv.values, t);
        for (i, o) in o.iter_mut().enumerate() {
            *o = _mm256_add_ps(*o, _mm256_mul_ps(weight, _mm256_loadu_ps(v.add(8 * i))));
        }
    }
    for (i, o) in o.iter().enumerate() {
        _mm256_storeu_ps(out.as_mut_ptr().add(8 * i), *o);
    }
}

/// One query's softmax-weighted sum of its head's cached values.
#[inline(always)]
fn attend(
    q: &[f32],
    kv: &KvHead,
    scale: f32,
    cap: Option<f32>,
    sink: Option<f32>,
    out: &mut [f32],
) {
    let d = q.len();
    // A plain loop: iterator adapters would be compiled apart, without the caller's features.
    let mut scores = vec![0f32; kv.len];
    for (t, s) in scores.iter_mut().enumerate() {
        *s = dot(q, &kv.keys[t * kv.stride + kv.offset..][..d]) * scale;
    }
    cap_scores(&mut scores, cap);
    let sum = exp_shifted_sink(&mut scores, sink);
    out.fill(0.0);
    for (t, &s) in scores.iter().enumerate() {
        let weight = s / sum;
        let v = &kv.values[t * kv.stride + kv.offset..][..d];
        for (o, &v) in out.iter_mut().zip(v) {
            *o += weight * v;
        }
    }
}

/// Soft-capped attention logits, where the family caps them.
#[inline(always)]
fn cap_scores(scores: &mut [f32], cap: Option<f32>) {
    if let Some(cap) = cap {
        scores.iter_mut().for_each(|s| *s = softcap(*s, cap));
    }
}

/// `scores` replaced by `exp(s − max)`; returns their sum (the softmax's denominator).
#[inline(always)]
fn exp_shifted(scores: &mut [f32]) -> f32 {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for s in scores {
        *s = (*s - max).exp();
        sum += *s;
    }
    sum
}

/// [`exp_shifted`] with a sink: a logit that joins the maximum and the denominator (gpt-oss,
/// transformers' `eager_attention_forward`), not the values.
#[inline(always)]
fn exp_shifted_sink(scores: &mut [f32], sink: Option<f32>) -> f32 {
    let Some(sink) = sink else {
        return exp_shifted(scores);
    };
    let max = scores.iter().copied().fold(sink, f32::max);
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    sum + (sink - max).exp()
}

/// Dot product with eight partial sums, so it vectorises.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a_body, a_tail) = a.split_at(a.len() - a.len() % 8);
    let (b_body, b_tail) = b.split_at(a_body.len());
    for (a, b) in a_body.chunks_exact(8).zip(b_body.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += a[l] * b[l];
        }
    }
    let tail: f32 = a_tail.iter().zip(b_tail).map(|(a, b)| a * b).sum();
    acc.iter().sum::<f32>() + tail
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    for (x, &y) in x.iter_mut().zip(y) {
        *x += y;
    }
}

/// [`rms_norm`] of `x` into itself (q/k norms per head, post norms).
fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    crate::crew::chunks_mut(x, weight.len(), |_, row| {
        let inv = inv_rms(row, eps);
        for (v, &w) in row.iter_mut().zip(weight) {
            *v = *v * inv * w;
        }
    });
}

/// `1 / sqrt(mean(x²) + eps)` of one row, summed in f64.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mean_square = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
    (1.0 / (mean_square + eps as f64).sqrt()) as f32
}

/// RMSNorm of each `weight.len()`-wide row of `x` into `out`: `x / sqrt(mean(x²) + eps) · weight`.
fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    crate::crew::chunks_mut(out, width, |i, out| {
        let x = &x[i * width..][..width];
        let inv = inv_rms(x, eps);
        for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
            *o = v * inv * w;
        }
    });
}

/// The factor cos and sin are multiplied by: YaRN's attention factor, else 1.
pub fn rope_attention_factor(c: &ModelConfig) -> f32 {
    match c.rope_scaling {
        RopeScaling::Yarn {
            attention_factor, ..
        } => attention_factor,
        _ => 1.0,
    }
}

/// RoPE inverse frequencies of the `d / 2` rotated pairs (`d`: the rotated dimensions of a head),
/// `θ^(−2i/d)`, with the config's
/// frequency scaling (transformers' `_compute_linear_scaling_rope_parameters`,
/// `_compute_llama3_parameters` and `_compute_yarn_parameters`; YaRN's attention factor is
/// [`rope_attention_factor`]).
pub fn rope_inv_freq(c: &ModelConfig) -> Vec<f64> {
    let d = c.block.rotary_dim(c.head_dim);
    let base = c.rope_theta as f64;
    (0..d / 2)
        .map(|i| {
            let freq = base.powf(-((2 * i) as f64) / d as f64);
            match c.rope_scaling {
                RopeScaling::None => freq,
                RopeScaling::Yarn {
                    factor,
                    beta_fast,
                    beta_slow,
                    original_max_position_embeddings,
                    truncate,
                    attention_factor: _,
                } => {
                    // The dimension at which a frequency turns `rotations` times over the
                    // original context.
                    let dim = |rotations: f64| {
                        d as f64
                            * (original_max_position_embeddings as f64
                                / (rotations * 2.0 * std::f64::consts::PI))
                                .ln()
                            / (2.0 * base.ln())
                    };
                    let (mut low, mut high) = (dim(beta_fast as f64), dim(beta_slow as f64));
                    if truncate {
                        (low, high) = (low.floor(), high.ceil());
                    }
                    let (low, mut high) = (low.max(0.0), high.min(d as f64 - 1.0));
                    if low == high {
                        high += 0.001; // transformers' guard against a zero-width ramp
                    }
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    freq / factor as f64 * (1.0 - extrapolation) + freq * extrapolation
                }
                RopeScaling::Linear { factor } => freq / factor as f64,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                } => {
                    let (factor, low, high) = (
                        factor as f64,
                        low_freq_factor as f64,
                        high_freq_factor as f64,
                    );
                    let original = original_max_position_embeddings as f64;
                    let wavelen = 2.0 * std::f64::consts::PI / freq;
                    if wavelen < original / high {
                        freq
                    } else if wavelen > original / low {
                        freq / factor
                    } else {
                        let smooth = (original / wavelen - low) / (high - low);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    }
                }
            }
        })
        .collect()
}

/// cos and sin of every rotated pair's angle at `n` consecutive positions.
struct RopeAngles {
    /// `[n, head_dim / 2]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeAngles {
    /// `scale` multiplies cos and sin (YaRN's attention factor).
    fn new(inv_freq: &[f64], scale: f32, start: usize, n: usize) -> Self {
        let (mut cos, mut sin) = (Vec::with_capacity(n * inv_freq.len()), Vec::new());
        sin.reserve(n * inv_freq.len());
        for pos in start..start + n {
            for &f in inv_freq {
                let (s, c) = (pos as f64 * f).sin_cos();
                cos.push(c as f32 * scale);
                sin.push(s as f32 * scale);
            }
        }
        RopeAngles { cos, sin }
    }

    /// Rotates the first `rotary` dimensions of every head of `x` (`[n, heads·head_dim]`) by its
    /// token's angles.
    fn apply(&self, x: &mut [f32], head_dim: usize, rotary: usize, style: RopeStyle) {
        let half = rotary / 2;
        let heads_per_token = x.len() / (self.cos.len() / half) / head_dim;
        for (index, v) in x.chunks_mut(head_dim).enumerate() {
            let token = index / heads_per_token;
            let cos = &self.cos[token * half..][..half];
            let sin = &self.sin[token * half..][..half];
            for i in 0..half {
                let (a, b) = match style {
                    RopeStyle::Neox => (i, i + half),
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x0, x1) = (v[a], v[b]);
                v[a] = x0 * cos[i] - x1 * sin[i];
                v[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 attention against the portable one, bit for bit, on fresh random heads of every
    /// width it takes and some it leaves to the portable code, ragged lengths included.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn attention_on_avx2_is_the_portable_attention_bit_for_bit() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let mut r = entrollm_codec::rng::SplitMix64::new(1);
        let mut next = move || (r.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
        for d in [32, 64, 96, 128, 8, 40, 72, 12, 136] {
            for len in [1, 2, 3, 4, 5, 7, 8, 9, 31] {
                let (heads, stride) = (3, 3 * d + 5);
                let keys: Vec<f32> = (0..len * stride).map(|_| 3.0 * next()).collect();
                let values: Vec<f32> = (0..len * stride).map(|_| next()).collect();
                let q: Vec<f32> = (0..d).map(|_| next()).collect();
                for head in 0..heads {
                    let kv = KvHead {
                        keys: &keys,
                        values: &values,
                        stride,
                        offset: head * d,
                        len,
                    };
                    let (mut a, mut b) = (vec![0f32; d], vec![1f32; d]);
                    let cap = (head % 2 == 1).then_some(0.7);
                    let sink = (head == 2).then_some(0.3);
                    attend(&q, &kv, 0.125, cap, sink, &mut a);
                    // SAFETY: AVX2 is present (checked above).
                    unsafe { attend_avx2(&q, &kv, 0.125, cap, sink, &mut b) };
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&a),
                        bits(&b),
                        "head dim {d}, {len} positions, head {head}"
                    );
                }
            }
        }
    }

    #[test]
    fn dot_matches_naive_sum_for_all_tails() {
        for len in 0..40 {
            let a: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..len).map(|i| (i as f32 * 0.11).cos()).collect();
            let naive: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!((dot(&a, &b) as f64 - naive).abs() < 1e-5, "len {len}");
        }
    }

    #[test]
    fn rms_norm_of_a_constant_row_is_the_weight() {
        let x = [3.0f32; 8];
        let w: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let mut out = [0f32; 8];
        rms_norm(&x, &w, 1e-6, &mut out);
        for (o, w) in out.iter().zip(&w) {
            assert!((o - w).abs() < 1e-5);
        }
    }

    #[test]
    fn rope_rotation_preserves_norm_and_position_zero_is_identity() {
        let inv_freq = [1.0, 0.1, 0.01];
        let original: Vec<f32> = (0..12).map(|i| i as f32 - 5.0).collect();
        for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
            let mut x = original.clone(); // 2 tokens × 1 head × 6 dims
            RopeAngles::new(&inv_freq, 1.0, 0, 2).apply(&mut x, 6, 6, style);
            assert_eq!(&x[..6], &original[..6], "position 0 must not rotate");
            let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
            assert!((norm(&x[6..]) - norm(&original[6..])).abs() < 1e-3);
            assert_ne!(&x[6..], &original[6..]);
        }
    }
}
