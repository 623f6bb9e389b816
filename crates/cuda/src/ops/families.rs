//! Launchers of `kernels/families.cu`, the parts of a block only some families have
//! ([`crate::families`]), each with a CPU reference: q/k RMSNorm per head and partial rotary fused
//! with the KV append, the residual add of a normed output with the next norm (post-attention and
//! post-MLP norms), GeGLU, the embedding scale and logit soft-capping.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::forward::{QOut, QkvShape};
use super::rope::RopeLayout;
use super::{as_i32, check_len, grid_for};
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::jit::{KernelVariant, FAMILIES};
use entrollm_model::config::{Activation, ClampedSwiglu, Routing};

/// The one module of `kernels/families.cu` (no tuning defines).
pub fn variant() -> KernelVariant {
    KernelVariant::new(&FAMILIES, vec![])
}

macro_rules! launch {
    ($dev:expr, $name:expr, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        let f = $dev.function(&variant(), $name)?;
        let mut b = $dev.stream().launch_builder(&f);
        $( b.arg($arg); )*
        // SAFETY: the argument list matches the kernel's signature; sizes were checked above.
        unsafe { b.launch($cfg) }.while_(|| format!("launching {}", $name))?;
        Ok(())
    }};
}

fn elementwise_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid_for(n, 256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// What [`launch_rope_heads`] does to q and k heads beyond RoPE.
#[derive(Clone, Copy)]
pub struct HeadOps<'a> {
    /// RMSNorm weights of each q and each k head (`[head_dim]`), both or neither.
    pub qk_norm: Option<(&'a CudaSlice<f32>, &'a CudaSlice<f32>)>,
    pub eps: f32,
    /// Leading dimensions of a head that RoPE rotates (even, at most head_dim).
    pub rotary: usize,
}

/// [`launch_rope_append`](super::forward::launch_rope_append) per head, with each q and k head
/// RMS-normed first (when `ops.qk_norm`) and only its first `ops.rotary` dimensions rotated:
/// `cos_sin` is [`rope_table`](super::forward::rope_table) of the rotated pairs
/// (`[max_seq, rotary / 2]`). Head dims a multiple of 32 up to 256.
#[allow(clippy::too_many_arguments)]
pub fn launch_rope_heads(
    dev: &GpuDevice,
    s: QkvShape,
    ops: HeadOps<'_>,
    qkv: &CudaSlice<f32>,
    bias: Option<&CudaSlice<f32>>,
    q_out: QOut<'_>,
    k_cache: &mut CudaSlice<u16>,
    v_cache: &mut CudaSlice<u16>,
    pos: &CudaSlice<i32>,
    cos_sin: &CudaSlice<f32>,
    n_tokens: usize,
    max_seq: usize,
) -> Result<()> {
    const OP: &str = "rope_heads";
    if s.head_dim == 0 || s.head_dim % 32 != 0 || s.head_dim > 256 || s.n_kv_heads == 0 {
        return Err(GpuError::invalid(OP, format!("shape {s:?}")));
    }
    if ops.rotary == 0 || ops.rotary % 2 != 0 || ops.rotary > s.head_dim {
        return Err(GpuError::invalid(
            OP,
            format!("rotary dimensions {} of {}", ops.rotary, s.head_dim),
        ));
    }
    if !(ops.eps.is_finite() && ops.eps >= 0.0) {
        return Err(GpuError::invalid(OP, format!("eps {}", ops.eps)));
    }
    check_len(OP, "qkv", qkv, n_tokens * s.width())?;
    if let Some(b) = bias {
        check_len(OP, "bias", b, s.width())?;
    }
    if let Some((qn, kn)) = ops.qk_norm {
        check_len(OP, "q_norm", qn, s.head_dim)?;
        check_len(OP, "k_norm", kn, s.head_dim)?;
    }
    match &q_out {
        QOut::F32(q) => check_len(OP, "q_out", q, n_tokens * s.q_dim())?,
        QOut::Bf16(q) => check_len(OP, "q_out", q, n_tokens * s.q_dim())?,
    }
    check_len(OP, "k_cache", k_cache, max_seq * s.kv_dim())?;
    check_len(OP, "v_cache", v_cache, max_seq * s.kv_dim())?;
    check_len(OP, "pos", pos, 1)?;
    check_len(OP, "cos_sin", cos_sin, max_seq * ops.rotary)?;
    as_i32(OP, "cache elements", max_seq * s.kv_dim())?;
    as_i32(OP, "qkv elements", n_tokens * s.width())?;
    if n_tokens == 0 {
        return Ok(());
    }
    let heads = s.n_q_heads + 2 * s.n_kv_heads;
    let cfg = LaunchConfig {
        grid_dim: (
            as_i32(OP, "n_tokens", n_tokens)? as u32,
            heads.div_ceil(4) as u32,
            1,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let null = 0u64;
    let has_bias = i32::from(bias.is_some());
    let (nq, nkv, hd) = (s.n_q_heads as i32, s.n_kv_heads as i32, s.head_dim as i32);
    let rot_half = (ops.rotary / 2) as i32;
    let inter = i32::from(s.layout == RopeLayout::Interleaved);
    let max_i = max_seq as i32;
    let name = match q_out {
        QOut::F32(_) => "rope_heads_f32q",
        QOut::Bf16(_) => "rope_heads_bf16q",
    };
    let f = dev.function(&variant(), name)?;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(qkv);
    match bias {
        Some(bias) => b.arg(bias),
        None => b.arg(&null),
    };
    b.arg(&has_bias);
    match ops.qk_norm {
        Some((qn, kn)) => b.arg(qn).arg(kn),
        None => b.arg(&null).arg(&null),
    };
    b.arg(&ops.eps);
    match q_out {
        QOut::F32(q) => b.arg(q),
        QOut::Bf16(q) => b.arg(q),
    };
    b.arg(k_cache).arg(v_cache).arg(pos).arg(cos_sin);
    b.arg(&nq)
        .arg(&nkv)
        .arg(&hd)
        .arg(&rot_half)
        .arg(&inter)
        .arg(&max_i);
    // SAFETY: the argument list matches rope_heads_*'s signature; sizes were checked above.
    unsafe { b.launch(cfg) }.while_(|| format!("launching {name}"))?;
    Ok(())
}

/// CPU reference of [`launch_rope_heads`] (norm in f64, rotation as the CPU engine's): rotated q
/// `[n, q_dim]`, k and v rows `[n, kv_dim]`, before any BF16 rounding. `inv_freq`: the rotated
/// pairs' frequencies (`rotary / 2` of them).
#[allow(clippy::too_many_arguments)]
pub fn rope_heads_ref(
    s: QkvShape,
    qkv: &[f32],
    bias: Option<&[f32]>,
    qk_norm: Option<(&[f32], &[f32])>,
    eps: f32,
    rotary: usize,
    start: usize,
    inv_freq: &[f64],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (qd, kd, hd) = (s.q_dim(), s.kv_dim(), s.head_dim);
    let half = rotary / 2;
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for (t, row) in qkv.chunks(s.width()).enumerate() {
        let mut row: Vec<f32> = match bias {
            Some(b) => row.iter().zip(b).map(|(x, y)| x + y).collect(),
            None => row.to_vec(),
        };
        for (hi, head) in row[..qd + kd].chunks_mut(hd).enumerate() {
            if let Some((qn, kn)) = qk_norm {
                let g = if hi < s.n_q_heads { qn } else { kn };
                let ms = head.iter().map(|&x| x as f64 * x as f64).sum::<f64>() / hd as f64;
                let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
                for (x, &w) in head.iter_mut().zip(g) {
                    *x = *x * inv * w;
                }
            }
            let pos = (start + t) as f64;
            for (i, &f) in inv_freq.iter().enumerate().take(half) {
                let (sn, cs) = (pos * f).sin_cos();
                let (cs, sn) = (cs as f32, sn as f32);
                let (a, b) = match s.layout {
                    RopeLayout::Neox => (i, i + half),
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cs - x1 * sn;
                head[b] = x0 * sn + x1 * cs;
            }
        }
        q.extend_from_slice(&row[..qd]);
        k.extend_from_slice(&row[qd..qd + kd]);
        v.extend_from_slice(&row[qd + kd..]);
    }
    (q, k, v)
}

/// Where [`launch_add_rmsnorm`] leaves the next norm's output.
pub enum NextOut<'a> {
    F32(&'a mut CudaSlice<f32>),
    Bf16(&'a mut CudaSlice<u16>),
}

/// Per row of `rows`: `x += rmsnorm(y; w)`, then, with `next = Some((g, out))`,
/// `out = rmsnorm(x; g)`.
#[allow(clippy::too_many_arguments)]
pub fn launch_add_rmsnorm(
    dev: &GpuDevice,
    y: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    x: &mut CudaSlice<f32>,
    next: Option<(&CudaSlice<f32>, NextOut<'_>)>,
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "add_rmsnorm";
    check_len(OP, "w", w, dim)?;
    check_len(OP, "x", x, rows * dim)?;
    if dim == 0 || !(eps.is_finite() && eps >= 0.0) {
        return Err(GpuError::invalid(OP, format!("dim {dim} / eps {eps}")));
    }
    let dim_i = as_i32(OP, "dim", dim)?;
    as_i32(OP, "elements", rows * dim)?;
    check_len(OP, "y", y, rows * dim)?;
    if let Some((g, out)) = &next {
        check_len(OP, "g", g, dim)?;
        match out {
            NextOut::F32(o) => check_len(OP, "out", o, rows * dim)?,
            NextOut::Bf16(o) => check_len(OP, "out", o, rows * dim)?,
        }
    }
    if rows == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (as_i32(OP, "rows", rows)? as u32, 1, 1),
        block_dim: (if dim >= 2048 { 1024 } else { 256 }, 1, 1),
        shared_mem_bytes: 0,
    };
    let null = 0u64;
    match next {
        None => launch!(
            dev,
            "add_rmsnorm",
            cfg,
            [y, w, x, &null, &null, &dim_i, &eps]
        ),
        Some((g, NextOut::F32(o))) => {
            launch!(dev, "add_rmsnorm", cfg, [y, w, x, g, o, &dim_i, &eps])
        }
        Some((g, NextOut::Bf16(o))) => {
            launch!(
                dev,
                "add_rmsnorm_bf16out",
                cfg,
                [y, w, x, g, o, &dim_i, &eps]
            )
        }
    }
}

/// CPU reference (f64 norms) of [`launch_add_rmsnorm`]: the new x, and the next norm's output.
pub fn add_rmsnorm_ref(
    y: &[f32],
    w: &[f32],
    x: &[f32],
    g: Option<&[f32]>,
    eps: f32,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let normed = super::forward::rmsnorm_f32w_ref(y, w, eps);
    let x: Vec<f32> = x.iter().zip(&normed).map(|(a, b)| a + b).collect();
    let h = g.map(|g| super::forward::rmsnorm_f32w_ref(&x, g, eps));
    (x, h)
}

/// Where [`launch_geglu`] writes.
pub enum ActOut<'a> {
    F32(&'a mut CudaSlice<f32>),
    Bf16(&'a mut CudaSlice<u16>),
}

/// `out[t, i] = gelu_tanh(gate) · up` over `gate_up` `[n_tokens, 2 inter]` of (gate, up) pairs
/// interleaved, or as halves (`halves`: gate row then up row).
pub fn launch_geglu(
    dev: &GpuDevice,
    gate_up: &CudaSlice<f32>,
    out: ActOut<'_>,
    n_tokens: usize,
    inter: usize,
    halves: bool,
) -> Result<()> {
    const OP: &str = "geglu";
    check_len(OP, "gate_up", gate_up, 2 * n_tokens * inter)?;
    match &out {
        ActOut::F32(o) => check_len(OP, "out", o, n_tokens * inter)?,
        ActOut::Bf16(o) => check_len(OP, "out", o, n_tokens * inter)?,
    }
    as_i32(OP, "2 * n_tokens * inter", 2 * n_tokens * inter)?;
    if n_tokens * inter == 0 {
        return Ok(());
    }
    let (inter_i, n_i, h_i) = (inter as i32, n_tokens as i32, i32::from(halves));
    let cfg = elementwise_cfg(n_tokens * inter);
    match out {
        ActOut::F32(o) => launch!(dev, "geglu_f32", cfg, [gate_up, o, &inter_i, &n_i, &h_i]),
        ActOut::Bf16(o) => launch!(
            dev,
            "geglu_bf16out",
            cfg,
            [gate_up, o, &inter_i, &n_i, &h_i]
        ),
    }
}

/// CPU reference of [`launch_geglu`], as the CPU engine computes it.
pub fn geglu_ref(gate_up: &[f32], inter: usize, halves: bool) -> Vec<f32> {
    let act = entrollm_model::config::Activation::GeluTanh;
    gate_up
        .chunks(2 * inter)
        .flat_map(|row| {
            (0..inter).map(move |i| {
                let (g, u) = if halves {
                    (row[i], row[inter + i])
                } else {
                    (row[2 * i], row[2 * i + 1])
                };
                act.apply(g) * u
            })
        })
        .collect()
}

/// `x[..n] *= s` (the embedding scale).
pub fn launch_scale(dev: &GpuDevice, x: &mut CudaSlice<f32>, n: usize, s: f32) -> Result<()> {
    const OP: &str = "scale_f32";
    check_len(OP, "x", x, n)?;
    let n_i = as_i32(OP, "n", n)?;
    if n == 0 {
        return Ok(());
    }
    launch!(dev, "scale_f32", elementwise_cfg(n), [x, &n_i, &s])
}

/// `x[..n] = cap · tanh(x / cap)` (soft-capping of logits).
pub fn launch_softcap(dev: &GpuDevice, x: &mut CudaSlice<f32>, n: usize, cap: f32) -> Result<()> {
    const OP: &str = "softcap_f32";
    check_len(OP, "x", x, n)?;
    let n_i = as_i32(OP, "n", n)?;
    if !(cap.is_finite() && cap > 0.0) {
        return Err(GpuError::invalid(OP, format!("cap {cap}")));
    }
    if n == 0 {
        return Ok(());
    }
    launch!(dev, "softcap_f32", elementwise_cfg(n), [x, &n_i, &cap])
}

/// CPU reference of [`launch_softcap`] (the CPU engine's).
pub fn softcap_ref(x: &[f32], cap: f32) -> Vec<f32> {
    x.iter().map(|&v| cap * (v / cap).tanh()).collect()
}

/// Most experts and experts per token [`launch_moe_topk`] takes (`MOE_MAX_EXPERTS`, `MOE_MAX_K`).
pub const MOE_MAX_EXPERTS: usize = 4096;
pub const MOE_MAX_K: usize = 64;

/// How a mixture of experts' router picks and weighs experts: the model's [`Routing`], its top-k
/// and whether the picked probabilities are renormalised (softmax first only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteSpec {
    pub top_k: usize,
    pub norm_topk: bool,
    pub routing: Routing,
}

impl RouteSpec {
    /// The routing of `m` (the model's description).
    pub fn of(m: &entrollm_model::config::Moe) -> Self {
        RouteSpec {
            top_k: m.top_k,
            norm_topk: m.norm_topk,
            routing: m.routing,
        }
    }

    /// Whether the top-k is taken of the logits before their softmax (gpt-oss).
    pub fn topk_first(&self) -> bool {
        self.routing == Routing::TopKSoftmax
    }
}

/// Per token of `logits` `[n_tokens, n_experts]` (plus `bias` `[n_experts]`): its `spec.top_k`
/// experts and their weights ([`RouteSpec`]) into `experts` and `weights` `[n_tokens, top_k]`, in
/// ascending expert order. Reference: [`route`].
#[allow(clippy::too_many_arguments)]
pub fn launch_moe_topk(
    dev: &GpuDevice,
    logits: &CudaSlice<f32>,
    bias: Option<&CudaSlice<f32>>,
    n_tokens: usize,
    n_experts: usize,
    spec: RouteSpec,
    experts: &mut CudaSlice<i32>,
    weights: &mut CudaSlice<f32>,
) -> Result<()> {
    const OP: &str = "moe_topk";
    let top_k = spec.top_k;
    if n_experts == 0
        || n_experts > MOE_MAX_EXPERTS
        || top_k == 0
        || top_k > n_experts.min(MOE_MAX_K)
    {
        return Err(GpuError::invalid(
            OP,
            format!(
                "top {top_k} of {n_experts} experts (at most {MOE_MAX_K} of {MOE_MAX_EXPERTS})"
            ),
        ));
    }
    check_len(OP, "logits", logits, n_tokens * n_experts)?;
    check_len(OP, "experts", experts, n_tokens * top_k)?;
    check_len(OP, "weights", weights, n_tokens * top_k)?;
    if let Some(b) = bias {
        check_len(OP, "bias", b, n_experts)?;
    }
    let grid = as_i32(OP, "n_tokens", n_tokens)? as u32;
    if n_tokens == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (e_i, k_i, norm, first) = (
        n_experts as i32,
        top_k as i32,
        i32::from(spec.norm_topk),
        i32::from(spec.topk_first()),
    );
    let null = 0u64;
    match bias {
        Some(b) => launch!(
            dev,
            "moe_topk",
            cfg,
            [logits, b, &e_i, &k_i, &norm, &first, experts, weights]
        ),
        None => launch!(
            dev,
            "moe_topk",
            cfg,
            [logits, &null, &e_i, &k_i, &norm, &first, experts, weights]
        ),
    }
}

/// The CPU engine's routing of one token (`entrollm_model::engine`'s mixture of experts) from its
/// router `logits` (its bias already added): softmax first — the softmax (f32), the `top_k` most
/// probable experts (ties to the lower index), their probabilities divided by their sum (in the
/// order picked) with `norm_topk` — or top-k first: the `top_k` largest logits weighted by their
/// own softmax. As (expert, weight) in ascending expert order, the order the CPU adds their
/// outputs in. GPU prefill routes its tokens with it; [`launch_moe_topk`] is checked against it.
pub fn route(logits: &[f32], spec: RouteSpec) -> Vec<(usize, f32)> {
    let p: Vec<f32> = if spec.topk_first() {
        logits.to_vec()
    } else {
        softmax(logits)
    };
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    let picked = &order[..spec.top_k.min(p.len())];
    let top: Vec<f32> = picked.iter().map(|&x| p[x]).collect();
    let w = if spec.topk_first() {
        softmax(&top)
    } else if spec.norm_topk {
        let total: f32 = top.iter().sum();
        top.iter().map(|v| v / total).collect()
    } else {
        top
    };
    let mut out: Vec<(usize, f32)> = picked.iter().copied().zip(w).collect();
    out.sort_by_key(|r| r.0);
    out
}

/// `exp(l − max) / Σ` in f32, summed in order (the CPU engine's `exp_shifted`).
fn softmax(l: &[f32]) -> Vec<f32> {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = l.iter().map(|&v| (v - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.iter().map(|v| v / sum).collect()
}

/// A prefill chunk's routing grouped by expert ([`group_by_expert`]).
#[derive(Debug, PartialEq)]
pub struct GroupedRoutes {
    /// The token of each grouped row: expert 0's tokens in order, then expert 1's, ...
    pub order: Vec<i32>,
    /// The grouped row of each slot `t · top_k + j` (token t's j-th expert in its route's order).
    pub rows: Vec<i32>,
    /// Each slot's weight.
    pub w: Vec<f32>,
    /// Expert e's rows: `start[e]..start[e + 1]`.
    pub start: Vec<usize>,
}

/// Groups the tokens' routes ([`route`], `top_k` (expert, weight) each) by expert, for prefill:
/// each expert's rows are one product over its tokens, and [`launch_moe_combine`] finds each
/// token's slots through `rows`.
pub fn group_by_expert(
    routes: &[Vec<(usize, f32)>],
    n_experts: usize,
    top_k: usize,
) -> GroupedRoutes {
    let mut start = vec![0usize; n_experts + 1];
    for &(x, _) in routes.iter().flatten() {
        start[x + 1] += 1;
    }
    for x in 0..n_experts {
        start[x + 1] += start[x];
    }
    let mut next = start.clone();
    let slots = routes.len() * top_k;
    let (mut order, mut rows, mut w) = (vec![0i32; slots], vec![0i32; slots], vec![0f32; slots]);
    for (t, r) in routes.iter().enumerate() {
        for (j, &(x, wt)) in r.iter().enumerate() {
            order[next[x]] = t as i32;
            rows[t * top_k + j] = next[x] as i32;
            w[t * top_k + j] = wt;
            next[x] += 1;
        }
    }
    GroupedRoutes {
        order,
        rows,
        w,
        start,
    }
}

/// `out[t] = (accumulate ? out[t] : 0) + Σ_j w[t, j] · ys[row(t, j)]` over `n_tokens` rows of
/// `hidden` (the weighted sum of a token's experts, in slot order, then added); `rows` maps slot
/// `t · top_k + j` to its row of `ys` (None: the slot itself). Reference: [`moe_combine_ref`].
#[allow(clippy::too_many_arguments)]
pub fn launch_moe_combine(
    dev: &GpuDevice,
    ys: &CudaSlice<f32>,
    rows: Option<&CudaSlice<i32>>,
    w: &CudaSlice<f32>,
    top_k: usize,
    hidden: usize,
    n_tokens: usize,
    out: &mut CudaSlice<f32>,
    accumulate: bool,
    down_bias: Option<ExpertBias<'_>>,
) -> Result<()> {
    const OP: &str = "moe_combine";
    let slots = n_tokens * top_k;
    check_len(OP, "w", w, slots)?;
    check_len(OP, "out", out, n_tokens * hidden)?;
    match rows {
        Some(r) => check_len(OP, "rows", r, slots)?,
        None => check_len(OP, "ys", ys, slots * hidden)?,
    }
    as_i32(OP, "ys elements", ys.len())?;
    as_i32(OP, "out elements", n_tokens * hidden)?;
    if n_tokens * hidden == 0 {
        return Ok(());
    }
    let null = 0u64;
    let (k_i, h_i, n_i, acc) = (
        top_k as i32,
        hidden as i32,
        n_tokens as i32,
        i32::from(accumulate),
    );
    if let Some(b) = &down_bias {
        check_len(OP, "slot experts", b.experts, slots)?;
        if b.bias.len() % hidden.max(1) != 0 || b.bias.is_empty() {
            return Err(GpuError::invalid(
                OP,
                format!("a down bias of {} for rows of {hidden}", b.bias.len()),
            ));
        }
    }
    let cfg = elementwise_cfg(n_tokens * hidden);
    let f = dev.function(&variant(), "moe_combine")?;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(ys);
    match rows {
        Some(r) => b.arg(r),
        None => b.arg(&null),
    };
    b.arg(w).arg(&k_i).arg(&h_i).arg(&n_i).arg(out).arg(&acc);
    match &down_bias {
        Some(d) => b.arg(d.experts).arg(d.bias),
        None => b.arg(&null).arg(&null),
    };
    // SAFETY: the argument list matches the kernel's signature; sizes were checked above.
    unsafe { b.launch(cfg) }.while_(|| "launching moe_combine".to_string())?;
    Ok(())
}

/// A bias per expert (`bias` `[n_experts, width]`) and the expert of each row it is added to
/// (`experts`, one a row: a slot's, or a grouped row's in prefill).
#[derive(Clone, Copy)]
pub struct ExpertBias<'a> {
    pub experts: &'a CudaSlice<i32>,
    pub bias: &'a CudaSlice<f32>,
}

/// CPU reference of [`launch_moe_combine`] (the CPU engine's sums: f32, in slot order; each
/// output plus its expert's down bias first, `down_bias`: (slot experts, `[n_experts, hidden]`)).
#[allow(clippy::too_many_arguments)]
pub fn moe_combine_ref(
    ys: &[f32],
    rows: Option<&[i32]>,
    w: &[f32],
    top_k: usize,
    out0: Option<&[f32]>,
    hidden: usize,
    n_tokens: usize,
    down_bias: Option<(&[i32], &[f32])>,
) -> Vec<f32> {
    let mut out = vec![0f32; n_tokens * hidden];
    for t in 0..n_tokens {
        for i in 0..hidden {
            let mut s = 0f32;
            for j in 0..top_k {
                let slot = t * top_k + j;
                let r = rows.map_or(slot, |r| r[slot] as usize);
                let mut y = ys[r * hidden + i];
                if let Some((e, b)) = down_bias {
                    y += b[e[slot] as usize * hidden + i];
                }
                s += w[slot] * y;
            }
            out[t * hidden + i] = out0.map_or(s, |o| o[t * hidden + i] + s);
        }
    }
    out
}

/// The activation a mixture of experts' gate/up products get in [`launch_moe_glu`]: the block's
/// ([`entrollm_model::config::Block`]: SiLU, GELU tanh, or gpt-oss's clamped SwiGLU).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Glu {
    Silu,
    GeluTanh,
    Clamped(ClampedSwiglu),
}

impl Glu {
    /// The gated MLP's activation of `b`.
    pub fn of(b: &entrollm_model::config::Block) -> Self {
        match (b.clamped_swiglu, b.activation) {
            (Some(c), _) => Glu::Clamped(c),
            (None, Activation::Silu) => Glu::Silu,
            (None, Activation::GeluTanh) => Glu::GeluTanh,
        }
    }

    /// The kernel's (act, alpha, limit) arguments.
    fn args(self) -> (i32, f32, f32) {
        match self {
            Glu::Silu => (0, 0.0, 0.0),
            Glu::GeluTanh => (1, 0.0, 0.0),
            Glu::Clamped(c) => (2, c.alpha, c.limit),
        }
    }

    /// The block's word for it (plan lines).
    pub fn name(self) -> String {
        match self {
            Glu::Silu => "silu".into(),
            Glu::GeluTanh => "gelu_tanh".into(),
            Glu::Clamped(c) => format!("clamped_swiglu alpha={} limit={}", c.alpha, c.limit),
        }
    }

    /// `act(gate, up)` as the CPU engine computes it.
    pub fn apply(self, g: f32, u: f32) -> f32 {
        match self {
            Glu::Silu => Activation::Silu.apply(g) * u,
            Glu::GeluTanh => Activation::GeluTanh.apply(g) * u,
            Glu::Clamped(c) => c.apply(g, u),
        }
    }
}

/// `out[r, i] = act(gate + gate_b[e], up + up_b[e])` over `n_rows` rows of `gate_up`
/// `[n_rows, 2 inter]` ((gate, up) pairs interleaved, or halves), `e` the row's expert (`bias`:
/// the experts' gate and up biases `[n_experts, inter]` each, and each row's expert; None: no
/// biases). Reference: [`moe_glu_ref`].
#[allow(clippy::too_many_arguments)]
pub fn launch_moe_glu(
    dev: &GpuDevice,
    gate_up: &CudaSlice<f32>,
    out: ActOut<'_>,
    n_rows: usize,
    inter: usize,
    halves: bool,
    bias: Option<(&CudaSlice<i32>, &CudaSlice<f32>, &CudaSlice<f32>)>,
    glu: Glu,
) -> Result<()> {
    const OP: &str = "moe_glu";
    check_len(OP, "gate_up", gate_up, 2 * n_rows * inter)?;
    match &out {
        ActOut::F32(o) => check_len(OP, "out", o, n_rows * inter)?,
        ActOut::Bf16(o) => check_len(OP, "out", o, n_rows * inter)?,
    }
    as_i32(OP, "2 * n_rows * inter", 2 * n_rows * inter)?;
    if let Some((e, g, u)) = &bias {
        check_len(OP, "row experts", e, n_rows)?;
        if g.len() != u.len() || g.len() % inter.max(1) != 0 || g.is_empty() {
            return Err(GpuError::invalid(
                OP,
                format!(
                    "gate/up biases of {}/{} for rows of {inter}",
                    g.len(),
                    u.len()
                ),
            ));
        }
    }
    if n_rows * inter == 0 {
        return Ok(());
    }
    let (act, alpha, limit) = glu.args();
    let (inter_i, n_i, h_i) = (inter as i32, n_rows as i32, i32::from(halves));
    let cfg = elementwise_cfg(n_rows * inter);
    let name = match out {
        ActOut::F32(_) => "moe_glu_f32",
        ActOut::Bf16(_) => "moe_glu_bf16out",
    };
    let f = dev.function(&variant(), name)?;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(gate_up);
    match out {
        ActOut::F32(o) => b.arg(o),
        ActOut::Bf16(o) => b.arg(o),
    };
    b.arg(&inter_i).arg(&n_i).arg(&h_i);
    let null = 0u64;
    match &bias {
        Some((e, g, u)) => b.arg(*e).arg(*g).arg(*u),
        None => b.arg(&null).arg(&null).arg(&null),
    };
    b.arg(&act).arg(&alpha).arg(&limit);
    // SAFETY: the argument list matches the kernel's signature; sizes were checked above.
    unsafe { b.launch(cfg) }.while_(|| format!("launching {name}"))?;
    Ok(())
}

/// CPU reference of [`launch_moe_glu`], as the CPU engine computes it (biases added in f32, then
/// the activation); `bias`: (row experts, gate biases, up biases).
pub fn moe_glu_ref(
    gate_up: &[f32],
    inter: usize,
    halves: bool,
    bias: Option<(&[i32], &[f32], &[f32])>,
    glu: Glu,
) -> Vec<f32> {
    gate_up
        .chunks(2 * inter)
        .enumerate()
        .flat_map(|(r, row)| {
            (0..inter).map(move |i| {
                let (mut g, mut u) = if halves {
                    (row[i], row[inter + i])
                } else {
                    (row[2 * i], row[2 * i + 1])
                };
                if let Some((e, gb, ub)) = bias {
                    let at = e[r] as usize * inter + i;
                    g += gb[at];
                    u += ub[at];
                }
                glu.apply(g, u)
            })
        })
        .collect()
}

/// `x[r] = x[r] + (y[r] + b)` over `n_rows` rows of `dim` (a projection's output plus its bias,
/// then the residual add: the CPU engine's order). Reference: [`bias_residual_ref`].
pub fn launch_bias_residual(
    dev: &GpuDevice,
    y: &CudaSlice<f32>,
    b: &CudaSlice<f32>,
    x: &mut CudaSlice<f32>,
    dim: usize,
    n_rows: usize,
) -> Result<()> {
    const OP: &str = "bias_residual";
    check_len(OP, "y", y, n_rows * dim)?;
    check_len(OP, "x", x, n_rows * dim)?;
    check_len(OP, "b", b, dim)?;
    let (d_i, n_i) = (as_i32(OP, "dim", dim)?, as_i32(OP, "n_rows", n_rows)?);
    as_i32(OP, "elements", n_rows * dim)?;
    if n_rows * dim == 0 {
        return Ok(());
    }
    launch!(
        dev,
        "bias_residual",
        elementwise_cfg(n_rows * dim),
        [y, b, x, &d_i, &n_i]
    )
}

/// CPU reference of [`launch_bias_residual`].
pub fn bias_residual_ref(y: &[f32], b: &[f32], x: &[f32]) -> Vec<f32> {
    x.iter()
        .zip(y)
        .enumerate()
        .map(|(j, (&x, &y))| x + (y + b[j % b.len()]))
        .collect()
}

/// `out[r] = input[idx[r]]` for `n_rows` rows of `dim` BF16 values (prefill's grouping of tokens by
/// expert).
pub fn launch_moe_gather_rows(
    dev: &GpuDevice,
    input: &CudaSlice<u16>,
    idx: &CudaSlice<i32>,
    n_rows: usize,
    dim: usize,
    out: &mut CudaSlice<u16>,
) -> Result<()> {
    const OP: &str = "moe_gather_rows";
    check_len(OP, "idx", idx, n_rows)?;
    check_len(OP, "out", out, n_rows * dim)?;
    let (n_i, d_i) = (as_i32(OP, "n_rows", n_rows)?, as_i32(OP, "dim", dim)?);
    as_i32(OP, "input elements", input.len())?;
    as_i32(OP, "out elements", n_rows * dim)?;
    if n_rows * dim == 0 {
        return Ok(());
    }
    launch!(
        dev,
        "moe_gather_rows",
        elementwise_cfg(n_rows * dim),
        [input, idx, &n_i, &d_i, out]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_heads_ref_without_norm_or_partial_is_rope_append_ref() {
        for layout in [RopeLayout::Neox, RopeLayout::Interleaved] {
            let s = QkvShape {
                n_q_heads: 2,
                n_kv_heads: 1,
                head_dim: 8,
                layout,
            };
            let qkv: Vec<f32> = (0..3 * s.width())
                .map(|i| (i as f32 * 0.37).sin())
                .collect();
            let inv: Vec<f64> = (0..4)
                .map(|i| 10000f64.powf(-(2.0 * i as f64) / 8.0))
                .collect();
            let want = super::super::forward::rope_append_ref(s, &qkv, None, 5, &inv);
            let got = rope_heads_ref(s, &qkv, None, None, 1e-6, 8, 5, &inv);
            // (rope_ref rotates in f64, the CPU engine and this reference in f32.)
            for (g, w) in [(&got.0, &want.0), (&got.1, &want.1), (&got.2, &want.2)] {
                assert_eq!(g.len(), w.len());
                assert!(
                    g.iter().zip(w).all(|(a, b)| (a - b).abs() < 1e-6),
                    "{layout:?}"
                );
            }
        }
    }

    #[test]
    fn partial_rotary_keeps_the_tail_and_norms_scale_heads() {
        let s = QkvShape {
            n_q_heads: 1,
            n_kv_heads: 1,
            head_dim: 4,
            layout: RopeLayout::Neox,
        };
        let qkv = [
            1.0f32, 2.0, 3.0, 4.0, 2.0, 2.0, 2.0, 2.0, 9.0, 8.0, 7.0, 6.0,
        ];
        let (q, k, v) = rope_heads_ref(s, &qkv, None, None, 0.0, 2, 1, &[1.0]);
        assert_eq!(&q[2..], &[3.0, 4.0]);
        assert_eq!(&k[2..], &[2.0, 2.0]);
        assert_eq!(v, vec![9.0, 8.0, 7.0, 6.0]);
        let (c, sn) = (1f64.cos() as f32, 1f64.sin() as f32);
        assert_eq!(q[0], 1.0 * c - 2.0 * sn);
        // k = [2, 2, 2, 2] has RMS 2: normed with weight 1 it is all ones (before rotation).
        let ones = [1.0f32; 4];
        let (_, k, _) = rope_heads_ref(s, &qkv, None, Some((&ones, &ones)), 0.0, 2, 0, &[1.0]);
        assert_eq!(k, vec![1.0; 4]);
    }

    #[test]
    fn geglu_ref_reads_both_layouts() {
        let inter = 3;
        let interleaved = [0.5f32, 2.0, -1.0, 3.0, 2.0, -1.0];
        let halves = [0.5f32, -1.0, 2.0, 2.0, 3.0, -1.0];
        assert_eq!(
            geglu_ref(&interleaved, inter, false),
            geglu_ref(&halves, inter, true)
        );
        let g = entrollm_model::config::Activation::GeluTanh.apply(0.5);
        assert_eq!(geglu_ref(&interleaved, inter, false)[0], g * 2.0);
    }

    #[test]
    fn add_rmsnorm_ref_adds_the_normed_output() {
        let (x, h) = add_rmsnorm_ref(
            &[3.0, 4.0],
            &[1.0, 2.0],
            &[1.0, 1.0],
            Some(&[1.0, 1.0]),
            0.0,
        );
        // rms(3, 4) = √12.5: normed (0.8485, 2.2627); x = (1.8485, 3.2627).
        assert!((x[0] - (1.0 + 3.0 / 12.5f32.sqrt())).abs() < 1e-6);
        assert!((x[1] - (1.0 + 8.0 / 12.5f32.sqrt())).abs() < 1e-6);
        let h = h.unwrap();
        let rms = ((x[0] * x[0] + x[1] * x[1]) / 2.0).sqrt();
        assert!((h[0] - x[0] / rms).abs() < 1e-6);
        assert_eq!(softcap_ref(&[0.0, 1e9], 3.0), vec![0.0, 3.0]);
    }
}

#[cfg(test)]
mod moe_tests {
    use super::*;

    #[test]
    fn route_is_the_cpu_engines_softmax_top_k() {
        // Probabilities of [2, 0, 1, 2]: experts 0 and 3 tie, the lower index first when picking.
        let spec = |top_k, norm_topk| RouteSpec {
            top_k,
            norm_topk,
            routing: Routing::SoftmaxTopK,
        };
        let got = route(&[2.0, 0.0, 1.0, 2.0], spec(3, false));
        let e: Vec<f32> = [2.0f32, 0.0, 1.0, 2.0]
            .iter()
            .map(|&l| (l - 2.0f32).exp())
            .collect();
        let sum: f32 = e.iter().sum();
        assert_eq!(got.iter().map(|r| r.0).collect::<Vec<_>>(), vec![0, 2, 3]);
        assert_eq!(got[0].1, e[0] / sum);
        let two = route(&[2.0, 0.0, 1.0, 2.0], spec(2, true));
        assert_eq!(two, vec![(0, 0.5), (3, 0.5)]);
        let w = moe_combine_ref(
            &[1.0, 2.0, 10.0, 20.0],
            None,
            &[0.5, 0.25],
            2,
            Some(&[1.0, 1.0]),
            2,
            1,
            None,
        );
        assert_eq!(w, vec![1.0 + 0.5 + 2.5, 1.0 + 1.0 + 5.0]);
        // With each slot's expert's down bias added to its output first.
        let b = moe_combine_ref(
            &[1.0, 2.0, 10.0, 20.0],
            None,
            &[0.5, 0.25],
            2,
            None,
            2,
            1,
            Some((&[1, 0], &[100.0, 200.0, 3.0, 4.0])),
        );
        assert_eq!(b, vec![0.5 * 4.0 + 0.25 * 110.0, 0.5 * 6.0 + 0.25 * 220.0]);
    }

    /// gpt-oss's routing: the largest logits (not the probabilities, which order alike, but the
    /// weights differ), weighted by the softmax of the picked ones alone.
    #[test]
    fn top_k_first_weighs_by_the_softmax_of_the_picked_logits() {
        let spec = RouteSpec {
            top_k: 2,
            norm_topk: false,
            routing: Routing::TopKSoftmax,
        };
        let got = route(&[0.5, 3.0, -1.0, 2.0], spec);
        let (a, b) = (1f32, (2.0f32 - 3.0).exp());
        assert_eq!(got, vec![(1, a / (a + b)), (3, b / (a + b))]);
    }

    #[test]
    fn glu_ref_adds_each_rows_experts_biases_before_the_activation() {
        let c = ClampedSwiglu {
            alpha: 1.702,
            limit: 7.0,
        };
        // Two rows (experts 1 and 0), inter 2, pairs interleaved.
        let gu = [1.0f32, 2.0, 9.0, -9.0, 0.5, 0.25, -1.0, 1.0];
        let (gb, ub) = ([0.0f32, 0.0, 0.5, -0.5], [0.0f32, 0.0, 1.0, 1.0]);
        let got = moe_glu_ref(&gu, 2, false, Some((&[1, 0], &gb, &ub)), Glu::Clamped(c));
        assert_eq!(got[0], c.apply(1.5, 3.0));
        // Clamped: gate 9 − 0.5 → limit 7, up −9 + 1 → −7.
        assert_eq!(got[1], c.apply(8.5, -8.0));
        let clamped = (-7.0 + 1.0) * 7.0 / (1.0 + (-7.0f32 * 1.702).exp());
        assert!((got[1] - clamped).abs() < 1e-5, "{} vs {clamped}", got[1]);
        assert_eq!(got[2], c.apply(0.5, 0.25));
        let halves = [1.0f32, 9.0, 2.0, -9.0];
        assert_eq!(
            moe_glu_ref(&halves, 2, true, None, Glu::Silu),
            moe_glu_ref(&gu[..4], 2, false, None, Glu::Silu)
        );
        assert_eq!(
            bias_residual_ref(&[1.0, 2.0, 3.0, 4.0], &[10.0, 20.0], &[0.5; 4]),
            vec![11.5, 22.5, 13.5, 24.5]
        );
    }

    /// Prefill's grouping, through the combine's row map, gives each token the weighted sum of
    /// its experts' outputs: with expert e's output for token t taken as (e + 1) · 10 + t, the
    /// grouped rows' outputs combined per token equal the sum over the token's route directly.
    #[test]
    fn grouped_rows_combine_to_each_tokens_experts() {
        let (e, k, n) = (5, 2, 7);
        let routes: Vec<Vec<(usize, f32)>> = (0..n)
            .map(|t| {
                let l: Vec<f32> = (0..e).map(|x| ((t * 7 + x * 3) % 5) as f32).collect();
                route(
                    &l,
                    RouteSpec {
                        top_k: k,
                        norm_topk: true,
                        routing: Routing::SoftmaxTopK,
                    },
                )
            })
            .collect();
        let g = group_by_expert(&routes, e, k);
        assert_eq!(g.start[e], n * k);
        // Each expert's rows hold its tokens in order.
        for x in 0..e {
            let toks: Vec<i32> = g.order[g.start[x]..g.start[x + 1]].to_vec();
            let want: Vec<i32> = (0..n)
                .filter(|&t| routes[t].iter().any(|r| r.0 == x))
                .map(|t| t as i32)
                .collect();
            assert_eq!(toks, want, "expert {x}");
        }
        let expert_of_row = |r: usize| (0..e).find(|&x| g.start[x] <= r && r < g.start[x + 1]);
        let ys: Vec<f32> = (0..n * k)
            .map(|r| {
                let x = expert_of_row(r).unwrap();
                ((x + 1) * 10) as f32 + g.order[r] as f32
            })
            .collect();
        let got = moe_combine_ref(&ys, Some(&g.rows), &g.w, k, None, 1, n, None);
        for (t, r) in routes.iter().enumerate() {
            let want: f32 = r
                .iter()
                .map(|&(x, w)| w * (((x + 1) * 10) as f32 + t as f32))
                .sum();
            assert!(
                (got[t] - want).abs() < 1e-4,
                "token {t}: {} vs {want}",
                got[t]
            );
        }
    }
}
