//! Kernels of the GPU forward pass beyond the single-op files (`kernels/engine.cu`,
//! `kernels/prefill.cu`): RMSNorm with f32 weights (f32 or BF16 out), SwiGLU to BF16, RoPE fused with
//! the KV-cache append, the end-of-step counter update of captured decode graphs, the synthetic
//! weight generator, causal flash-attention prefill, and the accumulating GEMV (`y += W x`). Each has
//! a CPU reference here or in the module it extends.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::attention::{AttnConfig, AttnMask};
use super::gemv::{check_gemv_shape, gemv_ref, GemvConfig};
use super::rope::{rope_ref, RopeLayout};
use super::{as_i32, bf16_to_f32, check_len, grid_for};
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::jit::{KernelVariant, ENGINE, PREFILL};

pub fn engine_variant() -> KernelVariant {
    KernelVariant::new(&ENGINE, vec![])
}

/// The flash-attention prefill kernel for one head dimension (a multiple of 32, at most 256).
pub fn prefill_variant(head_dim: usize) -> Result<KernelVariant> {
    if head_dim == 0 || head_dim % 32 != 0 || head_dim > 256 {
        return Err(GpuError::invalid(
            "flash_prefill",
            format!("head_dim {head_dim} must be a multiple of 32, at most 256"),
        ));
    }
    Ok(KernelVariant::new(
        &PREFILL,
        vec![("HEAD_DIM", head_dim as i64)],
    ))
}

/// [`prefill_variant`] with the switches `mask` needs (the plain variant when it has none).
pub fn prefill_masked_variant(head_dim: usize, mask: AttnMask) -> Result<KernelVariant> {
    let mut v = prefill_variant(head_dim)?;
    if mask.window.is_some() {
        v.defines.push(("FA_WINDOW", 1));
    }
    if mask.softcap.is_some() {
        v.defines.push(("FA_SOFTCAP", 1));
    }
    if mask.sinks {
        v.defines.push(("FA_SINKS", 1));
    }
    Ok(v)
}

/// The GEMV variant that adds into y (`y += W x`).
pub fn gemv_accum_variant(cfg: GemvConfig) -> KernelVariant {
    let mut v = cfg.variant();
    v.defines.push(("GEMV_ACCUM", 1));
    v
}

/// Decode attention tuned for single-token steps: 64 positions per block of 8 warps, so a
/// 512–4096 token context spreads over 8–64 blocks per KV head instead of 2–16, and each warp loads
/// its 8 positions' K/V rows at once (`ATTN_PRELOAD`).
pub fn decode_attn_config(
    head_dim: usize,
    n_q_heads: usize,
    n_kv_heads: usize,
) -> Result<AttnConfig> {
    let mut c = AttnConfig::for_heads(head_dim, n_q_heads, n_kv_heads)?;
    c.chunk = 64;
    c.warps = 8;
    c.validate()?;
    Ok(c)
}

/// Every variant the forward pass launches for the head shapes we target (CI compiles them).
pub fn all_variants() -> Vec<KernelVariant> {
    let mut v = vec![engine_variant()];
    v.extend(
        [32, 64, 96, 128, 160, 256]
            .iter()
            .map(|&d| prefill_variant(d).expect("valid")),
    );
    // The families' attention (sliding windows, soft-capping) at the head sizes they have
    // (Phi-3-mini: 96).
    for &d in &[64, 96, 128, 256] {
        for mask in family_masks() {
            v.push(prefill_masked_variant(d, mask).expect("valid"));
        }
    }
    v.extend(
        GemvConfig::CANDIDATES
            .iter()
            .map(|&c| gemv_accum_variant(c)),
    );
    v.extend(
        GemvConfig::CANDIDATES
            .iter()
            .filter(|c| c.rows % 2 == 0)
            .map(|&c| {
                gemv_fused_variant(
                    c,
                    GemvFusion {
                        accumulate: false,
                        swiglu: true,
                    },
                )
            }),
    );
    // The palette GEMV's configurations, with the epilogues the FP8 forward pass uses.
    for c in crate::ops::gemv_fp8::PAL4_CANDIDATES {
        for (accumulate, swiglu) in [(false, false), (true, false), (false, true)] {
            let f = gemv_fused_variant(c, GemvFusion { accumulate, swiglu });
            if !v.contains(&f) && !GemvConfig::CANDIDATES.iter().any(|&d| d.variant() == f) {
                v.push(f);
            }
        }
    }
    // The BF16 palette GEMV (an FP8 checkpoint's LM head; a BF16 checkpoint's matrices with
    // `--bf16 palette`), with the epilogues of the forward pass.
    for c in crate::ops::gemv_fp8::PAL_BF16_CANDIDATES {
        for fusion in pal_bf16_fusions() {
            v.push(crate::ops::gemv_fp8::pal_bf16_variant(c, fusion));
        }
    }
    for c in GemvConfig::CANDIDATES {
        let r = gemv_rope_variant(c).1;
        if !v.contains(&r) {
            v.push(r);
        }
    }
    v.extend(
        [
            (64, 9, 3),
            (64, 4, 4),
            (128, 32, 8),
            (128, 64, 8),
            (128, 32, 32),
            (96, 32, 32),
            (32, 8, 4),
            (160, 8, 2),
        ]
        .iter()
        .map(|&(d, q, kv)| decode_attn_config(d, q, kv).expect("valid").variant()),
    );
    // Decode attention of the families' shapes (Gemma 2 and 3, Qwen3, Phi-3-mini's 96, gpt-oss's
    // 64 query heads of 64 over 8 and the selftest's) with their masks.
    for &(d, q, kv) in &[
        (64, 64, 8),
        (96, 32, 32),
        (96, 4, 2),
        (64, 4, 2),
        (128, 16, 8),
        (128, 32, 8),
        (128, 40, 8),
        (256, 8, 4),
        (256, 4, 1),
    ] {
        let cfg = decode_attn_config(d, q, kv).expect("valid");
        for mask in family_masks() {
            v.push(cfg.masked_variant(mask));
        }
    }
    // The long-chunk (no preload) attention with the masks (`--decode-chunk` picks it).
    let long = AttnConfig::for_heads(128, 32, 8).expect("valid");
    for mask in family_masks() {
        v.push(long.masked_variant(mask));
    }
    v
}

/// The masks that change the attention kernels (one of each switch, window and cap together,
/// sinks with a window: gpt-oss's sliding layers).
pub fn family_masks() -> [AttnMask; 5] {
    let m = |window: Option<usize>, softcap: Option<f32>, sinks: bool| AttnMask {
        window,
        softcap,
        sinks,
    };
    [
        m(Some(1), None, false),
        m(None, Some(1.0), false),
        m(Some(1), Some(1.0), false),
        m(None, None, true),
        m(Some(1), None, true),
    ]
}

/// Pushes the arguments and launches; every caller has checked its sizes first.
macro_rules! launch_kernel {
    ($dev:expr, $f:expr, $cfg:expr, $what:expr, [$($arg:expr),* $(,)?]) => {{
        let mut b = $dev.stream().launch_builder(&$f);
        $( b.arg($arg); )*
        // SAFETY: the argument list matches the kernel's signature; sizes were checked above.
        unsafe { b.launch($cfg) }.while_(|| format!("launching {}", $what))?;
        Ok(())
    }};
}

/// Where a normalised row goes.
pub enum NormOut<'a> {
    F32(&'a mut CudaSlice<f32>),
    Bf16(&'a mut CudaSlice<u16>),
}

/// `out[r, :] = x[r, :] / sqrt(mean(x[r, :]²) + eps) · weight` with f32 weights, for `rows` rows.
pub fn launch_rmsnorm_f32w(
    dev: &GpuDevice,
    x: &CudaSlice<f32>,
    weight: &CudaSlice<f32>,
    out: NormOut<'_>,
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "rmsnorm_f32w";
    check_len(OP, "x", x, rows * dim)?;
    check_len(OP, "weight", weight, dim)?;
    match &out {
        NormOut::F32(o) => check_len(OP, "out", o, rows * dim)?,
        NormOut::Bf16(o) => check_len(OP, "out", o, rows * dim)?,
    }
    if dim == 0 || !(eps.is_finite() && eps >= 0.0) {
        return Err(GpuError::invalid(OP, format!("dim {dim} / eps {eps}")));
    }
    let dim_i = as_i32(OP, "dim", dim)?;
    if rows == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (as_i32(OP, "rows", rows)? as u32, 1, 1),
        block_dim: (if dim >= 2048 { 1024 } else { 256 }, 1, 1),
        shared_mem_bytes: 0,
    };
    match out {
        NormOut::F32(o) => {
            let f = dev.function(&engine_variant(), "rmsnorm_f32w")?;
            launch_kernel!(dev, f, cfg, OP, [x, weight, o, &dim_i, &eps])
        }
        NormOut::Bf16(o) => {
            let f = dev.function(&engine_variant(), "rmsnorm_f32w_bf16out")?;
            launch_kernel!(dev, f, cfg, OP, [x, weight, o, &dim_i, &eps])
        }
    }
}

/// CPU reference (f64) of [`launch_rmsnorm_f32w`].
pub fn rmsnorm_f32w_ref(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let dim = weight.len();
    x.chunks(dim)
        .flat_map(|row| {
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            row.iter()
                .zip(weight)
                .map(move |(&v, &w)| (v as f64 * inv * w as f64) as f32)
        })
        .collect()
}

/// `out[t, i] = bf16(silu(g) · u)` with (g, u) = `gate_up[t, 2i..2i + 2]` (gate and up rows
/// interleaved, as the engine stacks them); reference: [`swiglu_interleaved_ref`] rounded to BF16.
pub fn launch_swiglu_bf16(
    dev: &GpuDevice,
    gate_up: &CudaSlice<f32>,
    out: &mut CudaSlice<u16>,
    n_tokens: usize,
    inter: usize,
) -> Result<()> {
    const OP: &str = "swiglu_bf16out";
    check_len(OP, "gate_up", gate_up, 2 * n_tokens * inter)?;
    check_len(OP, "out", out, n_tokens * inter)?;
    as_i32(OP, "2 * n_tokens * inter", 2 * n_tokens * inter)?;
    let (inter_i, n_i) = (inter as i32, n_tokens as i32);
    if n_tokens * inter == 0 {
        return Ok(());
    }
    let f = dev.function(&engine_variant(), "swiglu_bf16out")?;
    let cfg = LaunchConfig {
        grid_dim: (grid_for(n_tokens * inter, 256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch_kernel!(dev, f, cfg, OP, [gate_up, out, &inter_i, &n_i])
}

/// CPU reference of the interleaved SwiGLU: `out[t, i] = silu(gu[t, 2i]) · gu[t, 2i + 1]`.
pub fn swiglu_interleaved_ref(gate_up: &[f32]) -> Vec<f32> {
    gate_up
        .chunks(2)
        .map(|p| {
            let g = p[0] as f64;
            (g / (1.0 + (-g).exp()) * p[1] as f64) as f32
        })
        .collect()
}

/// Head layout of a fused q/k/v row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QkvShape {
    pub n_q_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub layout: RopeLayout,
}

impl QkvShape {
    pub fn q_dim(&self) -> usize {
        self.n_q_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    pub fn width(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }
}

/// Where the rotated queries go: f32 for decode attention, BF16 for the prefill kernel.
pub enum QOut<'a> {
    F32(&'a mut CudaSlice<f32>),
    Bf16(&'a mut CudaSlice<u16>),
}

/// RoPE fused with the KV append: for token t of `qkv` ([n_tokens, q | k | v] f32, plus `bias`),
/// at position `pos[0] + t`, writes the rotated q to `q_out` and the rotated k and the v as BF16
/// into row `pos[0] + t` of the caches ([max_seq, kv_dim]); rows past `max_seq` are skipped.
/// `cos_sin`: [`rope_table`] for `max_seq` positions.
#[allow(clippy::too_many_arguments)]
pub fn launch_rope_append(
    dev: &GpuDevice,
    s: QkvShape,
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
    const OP: &str = "rope_append";
    if s.head_dim == 0 || s.head_dim % 2 != 0 || s.n_kv_heads == 0 {
        return Err(GpuError::invalid(OP, format!("shape {s:?}")));
    }
    check_len(OP, "qkv", qkv, n_tokens * s.width())?;
    if let Some(b) = bias {
        check_len(OP, "bias", b, s.width())?;
    }
    match &q_out {
        QOut::F32(q) => check_len(OP, "q_out", q, n_tokens * s.q_dim())?,
        QOut::Bf16(q) => check_len(OP, "q_out", q, n_tokens * s.q_dim())?,
    }
    check_len(OP, "k_cache", k_cache, max_seq * s.kv_dim())?;
    check_len(OP, "v_cache", v_cache, max_seq * s.kv_dim())?;
    check_len(OP, "pos", pos, 1)?;
    check_len(OP, "cos_sin", cos_sin, max_seq * s.head_dim)?;
    as_i32(OP, "cache elements", max_seq * s.kv_dim())?;
    as_i32(OP, "qkv elements", n_tokens * s.width())?;
    if n_tokens == 0 {
        return Ok(());
    }
    // One token (decode) spreads over 8 blocks; prompts have a block per token.
    let splits = if n_tokens == 1 { 8 } else { 1 };
    let cfg = LaunchConfig {
        grid_dim: (as_i32(OP, "n_tokens", n_tokens)? as u32, splits, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let has_bias = i32::from(bias.is_some());
    let bias = bias.unwrap_or(qkv); // not read when has_bias = 0
    let (nq, nkv, hd) = (s.n_q_heads as i32, s.n_kv_heads as i32, s.head_dim as i32);
    let inter = i32::from(s.layout == RopeLayout::Interleaved);
    let max_i = max_seq as i32;
    match q_out {
        QOut::F32(q) => {
            let f = dev.function(&engine_variant(), "rope_append_f32q")?;
            launch_kernel!(
                dev,
                f,
                cfg,
                OP,
                [
                    qkv, bias, &has_bias, q, k_cache, v_cache, pos, cos_sin, &nq, &nkv, &hd,
                    &inter, &max_i
                ]
            )
        }
        QOut::Bf16(q) => {
            let f = dev.function(&engine_variant(), "rope_append_bf16q")?;
            launch_kernel!(
                dev,
                f,
                cfg,
                OP,
                [
                    qkv, bias, &has_bias, q, k_cache, v_cache, pos, cos_sin, &nq, &nkv, &hd,
                    &inter, &max_i
                ]
            )
        }
    }
}

/// (cos, sin) f32 pairs of every position's angles, [max_seq, head_dim / 2, 2], computed in f64 and
/// rounded as the CPU engine rounds them.
pub fn rope_table(inv_freq: &[f64], max_seq: usize) -> Vec<f32> {
    rope_table_scaled(inv_freq, max_seq, 1.0)
}

/// [`rope_table`] with cos and sin multiplied by `scale` (YaRN's attention factor), as the CPU
/// engine's angles (rounded to f32, then scaled in f32).
pub fn rope_table_scaled(inv_freq: &[f64], max_seq: usize, scale: f32) -> Vec<f32> {
    let mut t = Vec::with_capacity(max_seq * inv_freq.len() * 2);
    for pos in 0..max_seq {
        for &f in inv_freq {
            let (s, c) = (pos as f64 * f).sin_cos();
            t.push(c as f32 * scale);
            t.push(s as f32 * scale);
        }
    }
    t
}

/// CPU reference of [`launch_rope_append`]: (rotated q [n, q_dim] f32, k rows [n, kv_dim] f32,
/// v rows [n, kv_dim] f32), before any BF16 rounding.
pub fn rope_append_ref(
    s: QkvShape,
    qkv: &[f32],
    bias: Option<&[f32]>,
    start: i32,
    inv_freq: &[f64],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (qd, kd) = (s.q_dim(), s.kv_dim());
    let n = qkv.len() / s.width();
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for row in qkv.chunks(s.width()) {
        let row: Vec<f32> = match bias {
            Some(b) => row.iter().zip(b).map(|(x, y)| x + y).collect(),
            None => row.to_vec(),
        };
        q.extend_from_slice(&row[..qd]);
        k.extend_from_slice(&row[qd..qd + kd]);
        v.extend_from_slice(&row[qd + kd..]);
    }
    let positions: Vec<i32> = (0..n as i32).map(|t| start + t).collect();
    rope_ref(&mut q, &positions, inv_freq, s.head_dim, s.layout);
    rope_ref(&mut k, &positions, inv_freq, s.head_dim, s.layout);
    (q, k, v)
}

/// End of a captured decode step: `history[len] = tok` (if `record`), then `pos += 1`, `len += 1`.
pub fn launch_finish_step(
    dev: &GpuDevice,
    tok: &CudaSlice<i32>,
    history: &mut CudaSlice<i32>,
    record: bool,
    pos: &mut CudaSlice<i32>,
    len: &mut CudaSlice<i32>,
    zero: &mut CudaSlice<u64>,
) -> Result<()> {
    const OP: &str = "finish_step";
    check_len(OP, "tok", tok, 1)?;
    check_len(OP, "pos", pos, 1)?;
    check_len(OP, "len", len, 1)?;
    let hist_len = as_i32(OP, "history", history.len())?;
    let rec = i32::from(record);
    let f = dev.function(&engine_variant(), "finish_step")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let n_zero = as_i32(OP, "zero", zero.len())?;
    launch_kernel!(
        dev,
        f,
        cfg,
        OP,
        [tok, history, &rec, &hist_len, pos, len, zero, &n_zero]
    )
}

/// Shape of one causal prefill attention launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillShape {
    pub n_tokens: usize,
    pub start: usize,
    pub n_q_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub max_seq: usize,
}

/// Causal flash attention of `n_tokens` queries (`q` BF16 [n, n_q_heads, head_dim], positions
/// `start..start + n`) over cache positions `0..start + n`; `out` BF16 [n, n_q_heads, head_dim].
#[allow(clippy::too_many_arguments)]
pub fn launch_flash_prefill(
    dev: &GpuDevice,
    s: PrefillShape,
    q: &CudaSlice<u16>,
    k_cache: &CudaSlice<u16>,
    v_cache: &CudaSlice<u16>,
    out: &mut CudaSlice<u16>,
    scale: f32,
    mask: AttnMask,
    sinks: Option<&CudaSlice<f32>>,
) -> Result<()> {
    const OP: &str = "flash_prefill";
    let variant = prefill_masked_variant(s.head_dim, mask)?;
    let (window, cap) = mask.args(OP)?;
    let sinks = mask.sink_values(OP, sinks, s.n_q_heads)?;
    if s.n_kv_heads == 0 || s.n_q_heads % s.n_kv_heads != 0 {
        return Err(GpuError::invalid(OP, format!("heads {s:?}")));
    }
    if s.start + s.n_tokens > s.max_seq {
        return Err(GpuError::invalid(
            OP,
            format!(
                "{} + {} tokens exceed the cache ({})",
                s.start, s.n_tokens, s.max_seq
            ),
        ));
    }
    let qd = s.n_q_heads * s.head_dim;
    check_len(OP, "q", q, s.n_tokens * qd)?;
    check_len(OP, "out", out, s.n_tokens * qd)?;
    check_len(
        OP,
        "k_cache",
        k_cache,
        s.max_seq * s.n_kv_heads * s.head_dim,
    )?;
    check_len(
        OP,
        "v_cache",
        v_cache,
        s.max_seq * s.n_kv_heads * s.head_dim,
    )?;
    as_i32(OP, "cache elements", s.max_seq * s.n_kv_heads * s.head_dim)?;
    as_i32(OP, "q elements", s.n_tokens * qd)?;
    if !scale.is_finite() {
        return Err(GpuError::invalid(OP, format!("scale {scale}")));
    }
    if s.n_tokens == 0 {
        return Ok(());
    }
    let f = dev.function(&variant, "flash_prefill")?;
    let cfg = LaunchConfig {
        grid_dim: (s.n_tokens.div_ceil(64) as u32, s.n_q_heads as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n_i, start_i, nq, nkv) = (
        s.n_tokens as i32,
        s.start as i32,
        s.n_q_heads as i32,
        s.n_kv_heads as i32,
    );
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(q).arg(k_cache).arg(v_cache).arg(out);
    b.arg(&n_i)
        .arg(&start_i)
        .arg(&nq)
        .arg(&nkv)
        .arg(&scale_log2);
    if mask.ext() {
        b.arg(&window).arg(&cap);
    }
    if let Some(s) = sinks {
        b.arg(s);
    }
    // SAFETY: the argument list matches the variant's signature; sizes were checked above.
    unsafe { b.launch(cfg) }.while_(|| format!("launching {OP}"))?;
    Ok(())
}

/// CPU reference (f64) of [`launch_flash_prefill`] over the same BF16 inputs; f32 [n, q_dim].
pub fn prefill_attention_ref(
    s: PrefillShape,
    q: &[u16],
    k_cache: &[u16],
    v_cache: &[u16],
    scale: f32,
    mask: AttnMask,
) -> Vec<f32> {
    prefill_sinks_ref(s, q, k_cache, v_cache, scale, mask, None)
}

/// [`prefill_attention_ref`] with each query head's sink logit joined to its softmax's maximum and
/// denominator.
pub fn prefill_sinks_ref(
    s: PrefillShape,
    q: &[u16],
    k_cache: &[u16],
    v_cache: &[u16],
    scale: f32,
    mask: AttnMask,
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    let (hd, nq) = (s.head_dim, s.n_q_heads);
    let group = nq / s.n_kv_heads;
    let row = s.n_kv_heads * hd;
    let mut out = vec![0f32; s.n_tokens * nq * hd];
    for t in 0..s.n_tokens {
        let len = s.start + t + 1;
        for h in 0..nq {
            let kvh = h / group;
            let qh = &q[(t * nq + h) * hd..][..hd];
            let scores: Vec<f64> = (0..len)
                .map(|p| {
                    if !mask.sees(p, len - 1) {
                        return f64::NEG_INFINITY;
                    }
                    let kr = &k_cache[p * row + kvh * hd..][..hd];
                    mask.cap(
                        qh.iter()
                            .zip(kr)
                            .map(|(&a, &b)| bf16_to_f32(a) as f64 * bf16_to_f32(b) as f64)
                            .sum::<f64>()
                            * scale as f64,
                    )
                })
                .collect();
            let sink = sinks.map(|s| s[h] as f64);
            let mx = scores
                .iter()
                .cloned()
                .fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
            let w: Vec<f64> = scores.iter().map(|x| (x - mx).exp()).collect();
            let total: f64 = w.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - mx).exp());
            for d in 0..hd {
                let acc: f64 = (0..len)
                    .map(|p| w[p] * bf16_to_f32(v_cache[p * row + kvh * hd + d]) as f64)
                    .sum();
                out[(t * nq + h) * hd + d] = (acc / total) as f32;
            }
        }
    }
    out
}

/// The epilogues the BF16 palette GEMV is compiled with: plain, residual add, SwiGLU.
pub(crate) fn pal_bf16_fusions() -> [GemvFusion; 3] {
    [(false, false), (true, false), (false, true)]
        .map(|(accumulate, swiglu)| GemvFusion { accumulate, swiglu })
}

/// What a fused GEMV does besides `y = W x`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GemvFusion {
    /// `y += W x` (residual add).
    pub accumulate: bool,
    /// Rows are (gate, up) pairs; `y[i] = silu(W_2i x) · W_2i+1 x` (n/2 outputs).
    pub swiglu: bool,
}

/// The GEMV variant with the given fusions (RMSNorm is a separate entry point of every variant).
pub fn gemv_fused_variant(cfg: GemvConfig, f: GemvFusion) -> KernelVariant {
    let mut v = cfg.variant();
    if f.accumulate {
        v.defines.push(("GEMV_ACCUM", 1));
    }
    if f.swiglu {
        v.defines.push(("GEMV_SWIGLU", 1));
    }
    v
}

/// SwiGLU pairs need an even row count, whole pairs per warp and no accumulate.
pub fn check_fusion(op: &'static str, cfg: GemvConfig, fusion: GemvFusion, n: usize) -> Result<()> {
    if fusion.swiglu && cfg.rows % 2 != 0 {
        return Err(GpuError::invalid(
            op,
            format!("swiglu needs an even number of rows per warp ({cfg})"),
        ));
    }
    check_swiglu_rows(op, fusion, n)
}

/// The checks of [`check_fusion`] that do not depend on how warps hold rows (the palette GEMV's
/// warps work on tile pairs, whose rows pair up in any configuration).
pub fn check_swiglu_rows(op: &'static str, fusion: GemvFusion, n: usize) -> Result<()> {
    if fusion.swiglu && (n % 2 != 0 || fusion.accumulate) {
        return Err(GpuError::invalid(
            op,
            format!("swiglu needs an even row count and no accumulate (n {n})"),
        ));
    }
    Ok(())
}

/// `y = W · rmsnorm(x; g, eps)` (when `norm` is given, else `W x`), with `fusion`'s epilogue;
/// x f32 [k], y f32 [n] (n/2 with swiglu). References: `gemv_ref` over
/// `rmsnorm_f32w_ref(x)`, plus y / [`swiglu_interleaved_ref`].
#[allow(clippy::too_many_arguments)]
pub fn launch_gemv_fused(
    dev: &GpuDevice,
    cfg: GemvConfig,
    fusion: GemvFusion,
    w: &CudaSlice<u16>,
    x: &CudaSlice<f32>,
    norm: Option<(&CudaSlice<f32>, f32)>,
    y: &mut CudaSlice<f32>,
    n: usize,
    k: usize,
) -> Result<()> {
    const OP: &str = "gemv_fused";
    check_gemv_shape(n, k)?;
    check_len(OP, "w", w, n * k)?;
    check_len(OP, "x", x, k)?;
    check_len(OP, "y", y, if fusion.swiglu { n / 2 } else { n })?;
    check_fusion(OP, cfg, fusion, n)?;
    let variant = gemv_fused_variant(cfg, fusion);
    let launch_cfg = cfg.launch(n);
    let (n_i, k_i) = (n as i32, k as i32);
    match norm {
        Some((g, eps)) => {
            check_len(OP, "norm weight", g, k)?;
            let f = dev.function(&variant, "gemv_bf16_norm")?;
            launch_kernel!(dev, f, launch_cfg, OP, [w, x, g, y, &n_i, &k_i, &eps])
        }
        None => {
            let f = dev.function(&variant, "gemv_bf16")?;
            launch_kernel!(dev, f, launch_cfg, OP, [w, x, y, &n_i, &k_i])
        }
    }
}

/// The slots of a gathered product over a stack of `n_experts` equal matrices: slot s multiplies
/// expert `experts[s]` (device memory, written by the router's top-k; None: expert 0 for every
/// slot) by input row `s / x_group`.
#[derive(Clone, Copy)]
pub struct Gather<'a> {
    pub experts: Option<&'a CudaSlice<i32>>,
    pub n_experts: usize,
    pub slots: usize,
    pub x_group: usize,
}

impl Gather<'_> {
    /// Checks the slots against the buffers: `x` holds the input rows of `cols`, `y` every
    /// slot's `out_stride` outputs.
    pub(crate) fn check<T, U>(
        &self,
        op: &'static str,
        x: &CudaSlice<T>,
        cols: usize,
        y: &CudaSlice<U>,
        out_stride: usize,
    ) -> Result<()> {
        if self.n_experts == 0 || self.slots == 0 || self.x_group == 0 {
            return Err(GpuError::invalid(
                op,
                format!(
                    "{} slots over {} experts, {} slots an input row",
                    self.slots, self.n_experts, self.x_group
                ),
            ));
        }
        if let Some(e) = self.experts {
            check_len(op, "experts", e, self.slots)?;
        }
        check_len(op, "x", x, self.slots.div_ceil(self.x_group) * cols)?;
        as_i32(op, "x elements", self.slots.div_ceil(self.x_group) * cols)?;
        check_len(op, "y", y, self.slots * out_stride)?;
        as_i32(op, "slots", self.slots)?;
        as_i32(op, "y elements", self.slots * out_stride)?;
        Ok(())
    }
}

/// The gathered GEMV (`gemv_bf16_experts`) over w `[n_experts · n, k]` (expert e's rows from
/// e · n): slot s of `g` writes its expert's product with input row s / x_group to
/// `y[s · out .. (s + 1) · out]`, out = n, or n / 2 with `swiglu` ((gate, up) rows interleaved).
/// One launch for every slot. Reference: [`gemv_experts_ref`].
#[allow(clippy::too_many_arguments)]
pub fn launch_gemv_experts(
    dev: &GpuDevice,
    cfg: GemvConfig,
    swiglu: bool,
    w: &CudaSlice<u16>,
    g: Gather<'_>,
    x: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    n: usize,
    k: usize,
) -> Result<()> {
    const OP: &str = "gemv_experts";
    check_gemv_shape(n, k)?;
    let fusion = GemvFusion {
        accumulate: false,
        swiglu,
    };
    check_fusion(OP, cfg, fusion, n)?;
    check_len(OP, "w", w, g.n_experts * n * k)?;
    let out = if swiglu { n / 2 } else { n };
    g.check(OP, x, k, y, out)?;
    let f = dev.function(&gemv_fused_variant(cfg, fusion), "gemv_bf16_experts")?;
    let mut lc = cfg.launch(n);
    lc.grid_dim.1 = g.slots as u32;
    let null = 0u64;
    let (e_i, xg_i, out_i, n_i, k_i) = (
        as_i32(OP, "n_experts", g.n_experts)?,
        as_i32(OP, "x_group", g.x_group)?,
        out as i32,
        n as i32,
        k as i32,
    );
    match g.experts {
        Some(e) => launch_kernel!(
            dev,
            f,
            lc,
            OP,
            [w, e, &e_i, x, &xg_i, y, &out_i, &n_i, &k_i]
        ),
        None => launch_kernel!(
            dev,
            f,
            lc,
            OP,
            [w, &null, &e_i, x, &xg_i, y, &out_i, &n_i, &k_i]
        ),
    }
}

/// CPU reference of [`launch_gemv_experts`]: per slot, [`gemv_ref`] of its expert's rows over its
/// input row, then [`swiglu_interleaved_ref`] with `swiglu`.
#[allow(clippy::too_many_arguments)]
pub fn gemv_experts_ref(
    w: &[u16],
    experts: Option<&[i32]>,
    x: &[f32],
    x_group: usize,
    slots: usize,
    swiglu: bool,
    n: usize,
    k: usize,
) -> Vec<f32> {
    (0..slots)
        .flat_map(|s| {
            let e = experts.map_or(0, |e| e[s] as usize);
            let xr = &x[s / x_group * k..][..k];
            let y = gemv_ref(&w[e * n * k..(e + 1) * n * k], xr, n, k);
            if swiglu {
                swiglu_interleaved_ref(&y)
            } else {
                y
            }
        })
        .collect()
}

/// The q/k/v GEMV with RoPE and the KV append in its epilogue, for a dense q/k/v matrix whose
/// plain GEMV runs with `cfg`: a warp needs whole rotation pairs, so an odd row count per warp
/// becomes two rows at half the unroll (the same bytes in flight).
pub fn gemv_rope_variant(cfg: GemvConfig) -> (GemvConfig, KernelVariant) {
    let cfg = if cfg.rows % 2 == 0 {
        cfg
    } else {
        GemvConfig {
            rows: cfg.rows * 2,
            unroll: (cfg.unroll / 2).max(1),
            ..cfg
        }
    };
    let mut v = cfg.variant();
    v.defines.push(("GEMV_ROPE", 1));
    (cfg, v)
}

/// Where [`launch_gemv_rope`] writes: the rotated q (f32 [q_dim]) and row `pos[0]` of the caches.
pub struct RopeTargets<'a> {
    pub q: &'a mut CudaSlice<f32>,
    pub k_cache: &'a mut CudaSlice<u16>,
    pub v_cache: &'a mut CudaSlice<u16>,
    pub pos: &'a CudaSlice<i32>,
    pub cos_sin: &'a CudaSlice<f32>,
    pub max_seq: usize,
}

/// One decode token's q/k/v projection `W x` (+ `bias`; W BF16 [q_dim + 2 kv_dim, k]) with RoPE
/// and the KV append fused: the same bits as [`launch_gemv_fused`] into a q/k/v row followed by
/// [`launch_rope_append`]. With `prenorm`, x is an RMSNorm's input times its weight and the
/// accumulator the sum of its unweighted squares, as [`launch_gemv_accum_norm`] leaves them.
#[allow(clippy::too_many_arguments)]
pub fn launch_gemv_rope(
    dev: &GpuDevice,
    cfg: GemvConfig,
    w: &CudaSlice<u16>,
    x: &CudaSlice<f32>,
    k: usize,
    prenorm: Option<ChainedNorm<'_>>,
    s: QkvShape,
    bias: Option<&CudaSlice<f32>>,
    t: RopeTargets<'_>,
) -> Result<()> {
    const OP: &str = "gemv_rope";
    if s.head_dim == 0 || s.head_dim % 2 != 0 || s.n_kv_heads == 0 {
        return Err(GpuError::invalid(OP, format!("shape {s:?}")));
    }
    let n = s.width();
    check_gemv_shape(n, k)?;
    check_len(OP, "w", w, n * k)?;
    check_len(OP, "x", x, k)?;
    let prenorm = prenorm.map(|p| p.view(OP)).transpose()?;
    if let Some(b) = bias {
        check_len(OP, "bias", b, n)?;
    }
    check_len(OP, "q", t.q, s.q_dim())?;
    check_len(OP, "k_cache", t.k_cache, t.max_seq * s.kv_dim())?;
    check_len(OP, "v_cache", t.v_cache, t.max_seq * s.kv_dim())?;
    check_len(OP, "pos", t.pos, 1)?;
    check_len(OP, "cos_sin", t.cos_sin, t.max_seq * s.head_dim)?;
    as_i32(OP, "cache elements", t.max_seq * s.kv_dim())?;
    let (cfg, variant) = gemv_rope_variant(cfg);
    let f = dev.function(&variant, "gemv_bf16_rope")?;
    let launch_cfg = cfg.launch(n);
    let null = 0u64; // no bias: a null pointer
    let (n_i, k_i) = (n as i32, k as i32);
    let (nq, nkv, hd) = (s.n_q_heads as i32, s.n_kv_heads as i32, s.head_dim as i32);
    let inter = i32::from(s.layout == RopeLayout::Interleaved);
    let max_i = t.max_seq as i32;
    let eps = prenorm.as_ref().map_or(0.0f32, |p| p.1);
    let mut b = dev.stream().launch_builder(&f);
    b.arg(w).arg(x).arg(&n_i).arg(&k_i);
    match &prenorm {
        Some((ss, _)) => b.arg(ss),
        None => b.arg(&null),
    };
    b.arg(&eps);
    match bias {
        Some(bias) => b.arg(bias),
        None => b.arg(&null),
    };
    b.arg(t.q)
        .arg(t.k_cache)
        .arg(t.v_cache)
        .arg(t.pos)
        .arg(t.cos_sin);
    b.arg(&nq).arg(&nkv).arg(&hd).arg(&inter).arg(&max_i);
    // SAFETY: the argument list matches gemv_bf16_rope's signature; sizes were checked above.
    unsafe { b.launch(launch_cfg) }.while_(|| format!("launching {OP} {cfg} [{n}, {k}]"))?;
    Ok(())
}

/// A dense matrix as the chained-norm GEMVs read it: BF16, or FP8 E4M3 codes as stored with
/// per-row scales (the same kernel body, `WFMT_FP8`).
#[derive(Clone, Copy)]
pub enum DenseWeights<'a> {
    Bf16(&'a CudaSlice<u16>),
    Fp8 {
        codes: &'a CudaSlice<u8>,
        scales: &'a CudaSlice<f32>,
    },
}

impl DenseWeights<'_> {
    /// Checks an [n, k] product over these weights.
    fn check(&self, op: &'static str, n: usize, k: usize) -> Result<()> {
        match self {
            DenseWeights::Bf16(w) => {
                check_gemv_shape(n, k)?;
                check_len(op, "w", w, n * k)
            }
            DenseWeights::Fp8 { codes, scales } => {
                super::gemv::check_chunked_shape(op, n, k, 16)?;
                check_len(op, "w", codes, n * k)?;
                check_len(op, "scales", scales, n)
            }
        }
    }

    /// The kernel `gemv_{bf16,fp8}_{suffix}`.
    fn kernel(&self, suffix: &str) -> String {
        match self {
            DenseWeights::Bf16(_) => format!("gemv_bf16_{suffix}"),
            DenseWeights::Fp8 { .. } => format!("gemv_fp8_{suffix}"),
        }
    }

    /// Pushes the weights' kernel arguments (codes and scales for FP8).
    fn push<'b>(&'b self, b: &mut cudarc::driver::LaunchArgs<'b>) {
        match self {
            DenseWeights::Bf16(w) => b.arg(*w),
            DenseWeights::Fp8 { codes, scales } => b.arg(*codes).arg(*scales),
        };
    }
}

/// `y = rsqrt(Σx² / k + eps) · W h` (`fusion`: plain or SwiGLU pairs), where h = x ∘ g is an
/// RMSNorm's input times its weight and `norm` holds Σx², as [`launch_gemv_accum_norm`] leaves
/// them: the RMSNorm without a kernel of its own. References: the GEMV's over `rmsnorm_f32w_ref`.
#[allow(clippy::too_many_arguments)]
pub fn launch_gemv_prenorm(
    dev: &GpuDevice,
    cfg: GemvConfig,
    fusion: GemvFusion,
    w: DenseWeights<'_>,
    h: &CudaSlice<f32>,
    norm: ChainedNorm<'_>,
    y: &mut CudaSlice<f32>,
    n: usize,
    k: usize,
) -> Result<()> {
    const OP: &str = "gemv_prenorm";
    w.check(OP, n, k)?;
    check_len(OP, "h", h, k)?;
    let (ss, eps) = norm.view(OP)?;
    check_len(OP, "y", y, if fusion.swiglu { n / 2 } else { n })?;
    if fusion.accumulate {
        return Err(GpuError::invalid(
            OP,
            "no accumulate: the input is an RMSNorm's",
        ));
    }
    check_fusion(OP, cfg, fusion, n)?;
    let kernel = w.kernel("prenorm");
    let f = dev.function(&gemv_fused_variant(cfg, fusion), &kernel)?;
    let (n_i, k_i) = (n as i32, k as i32);
    let mut b = dev.stream().launch_builder(&f);
    w.push(&mut b);
    b.arg(h).arg(&ss).arg(y).arg(&n_i).arg(&k_i).arg(&eps);
    // SAFETY: the argument list matches gemv_{bf16,fp8}_prenorm; sizes were checked above.
    unsafe { b.launch(cfg.launch(n)) }.while_(|| format!("launching {kernel} {cfg} [{n}, {k}]"))?;
    Ok(())
}

/// Fixed-point unit of the chained sums of squares (`SS_ONE` of kernels/gemv.cu): Σx² is added as
/// integers of 2^-24, so the sum does not depend on the order of the warps' additions.
pub const SS_ONE: f64 = 16_777_216.0;

/// An RMSNorm chained through the GEMVs: `acc[slot]` holds Σx² in units of 1/[`SS_ONE`] (added by
/// [`launch_gemv_accum_norm`], zero before it), and `eps`.
#[derive(Clone, Copy)]
pub struct ChainedNorm<'a> {
    pub acc: &'a CudaSlice<u64>,
    pub slot: usize,
    pub eps: f32,
}

impl<'a> ChainedNorm<'a> {
    fn view(self, op: &'static str) -> Result<(cudarc::driver::CudaView<'a, u64>, f32)> {
        check_len(op, "ss accumulators", self.acc, self.slot + 1)?;
        Ok((self.acc.slice(self.slot..self.slot + 1), self.eps))
    }
}

/// The next RMSNorm's input as [`launch_gemv_accum_norm`] writes it.
pub struct NextNorm<'a> {
    /// The norm's weight, f32 [n].
    pub g: &'a CudaSlice<f32>,
    /// y ∘ g, f32 [n].
    pub h: &'a mut CudaSlice<f32>,
    /// Accumulators of Σ y² (units of 1/[`SS_ONE`]); `acc[slot]` must be zero before the launch.
    pub acc: &'a mut CudaSlice<u64>,
    pub slot: usize,
}

/// `y[..n] += W x`, then the next RMSNorm's input (h = y ∘ g, Σ y² added to `acc[slot]` in fixed
/// point: deterministic) for [`launch_gemv_prenorm`] / [`launch_gemv_rope`].
#[allow(clippy::too_many_arguments)]
pub fn launch_gemv_accum_norm(
    dev: &GpuDevice,
    cfg: GemvConfig,
    w: DenseWeights<'_>,
    x: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    n: usize,
    k: usize,
    next: NextNorm<'_>,
) -> Result<()> {
    const OP: &str = "gemv_accum_norm";
    w.check(OP, n, k)?;
    check_len(OP, "x", x, k)?;
    check_len(OP, "y", y, n)?;
    check_len(OP, "g", next.g, n)?;
    check_len(OP, "h", next.h, n)?;
    check_len(OP, "ss accumulators", next.acc, next.slot + 1)?;
    let mut ss = next.acc.slice_mut(next.slot..next.slot + 1);
    let kernel = w.kernel("accum_norm");
    let f = dev.function(&gemv_accum_variant(cfg), &kernel)?;
    let (n_i, k_i) = (n as i32, k as i32);
    let mut b = dev.stream().launch_builder(&f);
    w.push(&mut b);
    b.arg(x).arg(y).arg(&n_i).arg(&k_i);
    b.arg(next.g).arg(next.h).arg(&mut ss);
    // SAFETY: the argument list matches gemv_{bf16,fp8}_accum_norm; sizes were checked above.
    unsafe { b.launch(cfg.launch(n)) }.while_(|| format!("launching {kernel} {cfg} [{n}, {k}]"))?;
    Ok(())
}

/// `y[..n] += W x` (W BF16 [n, k] row-major); reference: `y + gemv_ref(W, x)`.
pub fn launch_gemv_accum(
    dev: &GpuDevice,
    cfg: GemvConfig,
    w: &CudaSlice<u16>,
    x: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    n: usize,
    k: usize,
) -> Result<()> {
    const OP: &str = "gemv_accum";
    check_gemv_shape(n, k)?;
    check_len(OP, "w", w, n * k)?;
    check_len(OP, "x", x, k)?;
    check_len(OP, "y", y, n)?;
    let f = dev.function(&gemv_accum_variant(cfg), "gemv_bf16")?;
    let launch_cfg = cfg.launch(n);
    let (n_i, k_i) = (n as i32, k as i32);
    launch_kernel!(dev, f, launch_cfg, OP, [w, x, y, &n_i, &k_i])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::f32_to_bf16;

    #[test]
    fn prefill_ref_first_token_sees_only_itself() {
        let s = PrefillShape {
            n_tokens: 2,
            start: 0,
            n_q_heads: 2,
            n_kv_heads: 1,
            head_dim: 2,
            max_seq: 4,
        };
        let b = |v: &[f32]| v.iter().map(|&x| f32_to_bf16(x)).collect::<Vec<_>>();
        let q = b(&[1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
        let k = b(&[1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
        let v = b(&[3.0, 4.0, 5.0, 6.0, 0.0, 0.0, 0.0, 0.0]);
        let out = prefill_attention_ref(s, &q, &k, &v, 1.0, AttnMask::NONE);
        assert_eq!(&out[..4], &[3.0, 4.0, 3.0, 4.0]);
        // Token 1 sees both keys with equal scores (q = [1, 1]): the mean of the two values.
        assert_eq!(&out[4..], &[4.0, 5.0, 4.0, 5.0]);
    }

    #[test]
    fn rope_append_ref_splits_and_biases() {
        let s = QkvShape {
            n_q_heads: 1,
            n_kv_heads: 1,
            head_dim: 2,
            layout: RopeLayout::Neox,
        };
        let qkv = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let bias = [0.5f32; 6];
        // Position 0: no rotation.
        let (q, k, v) = rope_append_ref(s, &qkv, Some(&bias), 0, &[1.0]);
        assert_eq!((q, k, v), (vec![1.5, 2.5], vec![3.5, 4.5], vec![5.5, 6.5]));
    }

    #[test]
    fn rope_table_holds_the_cpu_engines_angles() {
        let f = [1.0, 0.25];
        let t = rope_table(&f, 3);
        assert_eq!(t.len(), 3 * 2 * 2);
        assert_eq!(&t[..4], &[1.0, 0.0, 1.0, 0.0]);
        let (s, c) = (2.0f64 * 0.25).sin_cos();
        assert_eq!((t[10], t[11]), (c as f32, s as f32));
    }

    #[test]
    fn swiglu_interleaved_pairs() {
        let out = swiglu_interleaved_ref(&[0.0, 5.0, 20.0, 0.5]);
        assert_eq!(out[0], 0.0);
        assert!((out[1] - 10.0).abs() < 1e-5);
    }

    #[test]
    fn variants_are_valid() {
        assert!(prefill_variant(96).is_ok());
        assert!(prefill_variant(100).is_err() && prefill_variant(48).is_err());
        let even = GemvConfig::CANDIDATES
            .iter()
            .filter(|c| c.rows % 2 == 0)
            .count();
        let rope: std::collections::HashSet<_> = GemvConfig::CANDIDATES
            .iter()
            .map(|&c| gemv_rope_variant(c).0)
            .collect();
        let all = all_variants();
        // The palette GEMV's configurations add the variants the BF16 candidates do not have.
        let palette: Vec<_> = crate::ops::gemv_fp8::PAL4_CANDIDATES
            .iter()
            .flat_map(|&c| {
                let fused =
                    |accumulate, swiglu| gemv_fused_variant(c, GemvFusion { accumulate, swiglu });
                vec![fused(false, false), fused(true, false), fused(false, true)]
            })
            .collect();
        assert!(palette.iter().all(|v| all.contains(v)));
        let distinct: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(distinct.len(), all.len(), "no variant twice");
        let extra = palette
            .iter()
            .collect::<std::collections::HashSet<_>>()
            .into_iter()
            .filter(|v| !GemvConfig::CANDIDATES.iter().any(|c| c.variant() == **v))
            .filter(|v| {
                !GemvConfig::CANDIDATES.iter().any(|&c| {
                    gemv_accum_variant(c) == **v
                        || (c.rows % 2 == 0
                            && gemv_fused_variant(
                                c,
                                GemvFusion {
                                    accumulate: false,
                                    swiglu: true,
                                },
                            ) == **v)
                })
            })
            .count();
        // The BF16 palette GEMV: a module a configuration and epilogue.
        let pal_bf16 = crate::ops::gemv_fp8::PAL_BF16_CANDIDATES
            .iter()
            .flat_map(|&c| pal_bf16_fusions().map(|f| crate::ops::gemv_fp8::pal_bf16_variant(c, f)))
            .collect::<std::collections::HashSet<_>>();
        assert!(pal_bf16.iter().all(|v| all.contains(v)));
        assert_eq!(
            all.len(),
            // The engine module; prefill of 6 head dims, 4 of them with 5 masks; the GEMVs;
            // decode attention of 8 head shapes, 9 more with 5 masks, the long chunks' 5.
            1 + 6
                + 20
                + GemvConfig::CANDIDATES.len()
                + even
                + rope.len()
                + 8
                + 45
                + 5
                + extra
                + pal_bf16.len()
        );
        assert_eq!(decode_attn_config(128, 32, 8).unwrap().chunk, 64);
    }
}
