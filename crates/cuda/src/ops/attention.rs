//! Decode attention over a BF16 KV cache with grouped-query attention (`kernels/attention.cu`).
//!
//! Per layer the cache is K and V, each [max_seq, n_kv_heads, head_dim] BF16. The current length
//! lives in device memory (`seq_len[0]`), so one captured CUDA graph serves every position:
//! [`launch_kv_append`] writes the new token at `seq_len - 1`, then [`launch_attention_decode`]
//! attends over `0..seq_len`, split along the sequence into chunks of `chunk` positions (one block
//! per chunk and KV head) and merged by a combine kernel.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{as_i32, bf16_to_f32, check_len};
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::jit::{KernelVariant, ATTENTION};

/// Compile-time shape and tuning of the attention kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnConfig {
    /// Head dimension, a multiple of 32 up to 256.
    pub head_dim: u32,
    /// Query heads per KV head (n_q_heads / n_kv_heads).
    pub group: u32,
    /// Positions per block of the partial kernel.
    pub chunk: u32,
    /// Warps per block of the partial kernel.
    pub warps: u32,
}

impl AttnConfig {
    /// Default tuning for a model's head shape.
    pub fn for_heads(head_dim: usize, n_q_heads: usize, n_kv_heads: usize) -> Result<Self> {
        if n_kv_heads == 0 || n_q_heads % n_kv_heads != 0 {
            return Err(GpuError::invalid(
                "attention",
                format!("{n_q_heads} query heads are not a multiple of {n_kv_heads} KV heads"),
            ));
        }
        let c = AttnConfig {
            head_dim: head_dim as u32,
            group: (n_q_heads / n_kv_heads) as u32,
            chunk: 256,
            warps: 4,
        };
        c.validate()?;
        Ok(c)
    }

    /// Head shapes of the models we target (SmolLM2: 64/3; Llama-3 8B: 128/4; 70B: 128/8;
    /// Phi-3-mini: 96/1) and MHA.
    pub fn builtin() -> Vec<AttnConfig> {
        [(64, 1), (64, 3), (96, 1), (128, 1), (128, 4), (128, 8)]
            .iter()
            .map(|&(head_dim, group)| AttnConfig {
                head_dim,
                group,
                chunk: 256,
                warps: 4,
            })
            .collect()
    }

    pub fn validate(&self) -> Result<()> {
        let ok = self.head_dim % 32 == 0
            && (32..=256).contains(&self.head_dim)
            && (1..=16).contains(&self.group)
            && self.chunk > 0
            && (1..=16).contains(&self.warps);
        if !ok {
            return Err(GpuError::invalid(
                "attention",
                format!("unsupported config {self:?}"),
            ));
        }
        Ok(())
    }

    pub fn variant(&self) -> KernelVariant {
        let mut defines = vec![
            ("HEAD_DIM", self.head_dim as i64),
            ("ATTN_GROUP", self.group as i64),
            ("ATTN_CHUNK", self.chunk as i64),
            ("ATTN_WARPS", self.warps as i64),
        ];
        // Short chunks: each warp loads all its K/V rows before the first score.
        if self.chunk % self.warps == 0 && self.chunk / self.warps <= 8 {
            defines.push(("ATTN_PRELOAD", 1));
        }
        KernelVariant::new(&ATTENTION, defines)
    }

    /// [`AttnConfig::variant`] with the switches `mask` needs (the plain variant when it has none).
    pub fn masked_variant(&self, mask: AttnMask) -> KernelVariant {
        let mut v = self.variant();
        if mask.window.is_some() {
            v.defines.push(("ATTN_WINDOW", 1));
        }
        if mask.softcap.is_some() {
            v.defines.push(("ATTN_SOFTCAP", 1));
        }
        if mask.sinks {
            v.defines.push(("ATTN_SINKS", 1));
        }
        v
    }

    fn max_chunks(&self, max_seq: usize) -> usize {
        max_seq.div_ceil(self.chunk as usize).max(1)
    }
}

/// What a layer's attention does beyond softmax over every earlier position (families beyond
/// Llama): a sliding window (the last `window` positions, the query's own included) and
/// soft-capping of the scores (`cap · tanh(score / cap)`, after the scale), and sinks (a learned
/// logit per query head joined to the softmax's maximum and denominator: gpt-oss; the launchers
/// take their values).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttnMask {
    pub window: Option<usize>,
    pub softcap: Option<f32>,
    pub sinks: bool,
}

impl AttnMask {
    /// Llama's attention.
    pub const NONE: AttnMask = AttnMask {
        window: None,
        softcap: None,
        sinks: false,
    };

    /// The sinks' values the kernels take: `sinks` (`[n_q_heads]`), present exactly when the
    /// mask says so.
    pub(crate) fn sink_values<'a>(
        &self,
        op: &'static str,
        sinks: Option<&'a CudaSlice<f32>>,
        n_q_heads: usize,
    ) -> Result<Option<&'a CudaSlice<f32>>> {
        match (self.sinks, sinks) {
            (true, Some(s)) => {
                check_len(op, "sinks", s, n_q_heads)?;
                Ok(Some(s))
            }
            (false, None) => Ok(None),
            (want, _) => Err(GpuError::invalid(
                op,
                format!(
                    "the mask {} sinks, the launch {}",
                    if want { "has" } else { "has no" },
                    if want { "gives none" } else { "gives them" }
                ),
            )),
        }
    }

    /// Whether the kernels take the (window, softcap) arguments.
    pub fn ext(&self) -> bool {
        self.window.is_some() || self.softcap.is_some()
    }

    /// The kernels' (window, softcap) arguments; checks them.
    pub(crate) fn args(&self, op: &'static str) -> Result<(i32, f32)> {
        let window = match self.window {
            Some(0) => return Err(GpuError::invalid(op, "a window of 0 positions")),
            Some(w) => as_i32(op, "window", w)?,
            None => 0,
        };
        let cap = match self.softcap {
            Some(c) if !(c.is_finite() && c > 0.0) => {
                return Err(GpuError::invalid(op, format!("soft-cap {c}")))
            }
            Some(c) => c,
            None => 0.0,
        };
        Ok((window, cap))
    }

    /// Whether a query at `pos` sees the key at `key` (`key <= pos` assumed).
    pub fn sees(&self, key: usize, pos: usize) -> bool {
        self.window.is_none_or(|w| key + w > pos)
    }

    /// A scaled score as the kernels soft-cap it.
    pub fn cap(&self, score: f64) -> f64 {
        match self.softcap {
            Some(c) => c as f64 * (score / c as f64).tanh(),
            None => score,
        }
    }
}

impl std::fmt::Display for AttnMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(w) = self.window {
            write!(f, " window={w}")?;
        }
        if let Some(c) = self.softcap {
            write!(f, " softcap={c}")?;
        }
        if self.sinks {
            write!(f, " sinks")?;
        }
        Ok(())
    }
}

/// Per-chunk partial results of one attention launch, sized for `max_seq`.
pub struct AttnScratch {
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    /// Per KV head: chunks finished in the running fused launch (zero between launches).
    counters: CudaSlice<i32>,
    max_chunks: usize,
    n_q_heads: usize,
}

impl AttnScratch {
    pub fn new(dev: &GpuDevice, cfg: AttnConfig, n_q_heads: usize, max_seq: usize) -> Result<Self> {
        cfg.validate()?;
        let max_chunks = cfg.max_chunks(max_seq);
        let s = dev.stream();
        let acc_len = n_q_heads * max_chunks * cfg.head_dim as usize;
        Ok(AttnScratch {
            part_acc: s
                .alloc_zeros(acc_len)
                .while_(|| "allocating attention scratch".into())?,
            part_ml: s
                .alloc_zeros(n_q_heads * max_chunks * 2)
                .while_(|| "allocating attention scratch".into())?,
            counters: s
                .alloc_zeros(n_q_heads.max(1))
                .while_(|| "allocating attention scratch".into())?,
            max_chunks,
            n_q_heads,
        })
    }
}

/// Shape of one layer's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub n_q_heads: usize,
    pub n_kv_heads: usize,
    pub max_seq: usize,
}

impl KvShape {
    fn check(&self, op: &'static str, cfg: &AttnConfig) -> Result<()> {
        cfg.validate()?;
        if self.n_kv_heads == 0 || self.n_q_heads != self.n_kv_heads * cfg.group as usize {
            return Err(GpuError::invalid(
                op,
                format!(
                    "{} query heads / {} KV heads do not match group {}",
                    self.n_q_heads, self.n_kv_heads, cfg.group
                ),
            ));
        }
        as_i32(
            op,
            "cache elements",
            self.max_seq * self.n_kv_heads * cfg.head_dim as usize,
        )?;
        Ok(())
    }
}

/// Writes the current token's k and v (f32 [n_kv_heads · head_dim]) as BF16 at position
/// `seq_len[0] - 1` of the cache; positions outside `0..max_seq` are not written.
#[allow(clippy::too_many_arguments)]
pub fn launch_kv_append(
    dev: &GpuDevice,
    cfg: AttnConfig,
    shape: KvShape,
    k_new: &CudaSlice<f32>,
    v_new: &CudaSlice<f32>,
    k_cache: &mut CudaSlice<u16>,
    v_cache: &mut CudaSlice<u16>,
    seq_len: &CudaSlice<i32>,
) -> Result<()> {
    const OP: &str = "kv_append";
    shape.check(OP, &cfg)?;
    let row = shape.n_kv_heads * cfg.head_dim as usize;
    check_len(OP, "k_new", k_new, row)?;
    check_len(OP, "v_new", v_new, row)?;
    check_len(OP, "k_cache", k_cache, shape.max_seq * row)?;
    check_len(OP, "v_cache", v_cache, shape.max_seq * row)?;
    check_len(OP, "seq_len", seq_len, 1)?;
    let f = dev.function(&cfg.variant(), "kv_append")?;
    let (row_i, max_i) = (row as i32, shape.max_seq as i32);
    let mut b = dev.stream().launch_builder(&f);
    b.arg(k_new)
        .arg(v_new)
        .arg(k_cache)
        .arg(v_cache)
        .arg(seq_len)
        .arg(&row_i)
        .arg(&max_i);
    let launch = LaunchConfig {
        grid_dim: (row.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument types and counts match the kernel; sizes were checked above.
    unsafe { b.launch(launch) }.while_(|| "launching kv_append".into())?;
    Ok(())
}

/// `out[h, :] = softmax(scale · q[h]·K[0..seq_len, h / group]) · V[..]` for every query head h;
/// q and out are f32 [n_q_heads, head_dim].
#[allow(clippy::too_many_arguments)]
pub fn launch_attention_decode(
    dev: &GpuDevice,
    cfg: AttnConfig,
    shape: KvShape,
    q: &CudaSlice<f32>,
    k_cache: &CudaSlice<u16>,
    v_cache: &CudaSlice<u16>,
    seq_len: &CudaSlice<i32>,
    scratch: &mut AttnScratch,
    out: &mut CudaSlice<f32>,
    scale: f32,
    mask: AttnMask,
    sinks: Option<&CudaSlice<f32>>,
) -> Result<()> {
    const OP: &str = "attention_decode";
    let (window, cap) = mask.args(OP)?;
    let sinks = mask.sink_values(OP, sinks, shape.n_q_heads)?;
    shape.check(OP, &cfg)?;
    let hd = cfg.head_dim as usize;
    let row = shape.n_kv_heads * hd;
    check_len(OP, "q", q, shape.n_q_heads * hd)?;
    check_len(OP, "k_cache", k_cache, shape.max_seq * row)?;
    check_len(OP, "v_cache", v_cache, shape.max_seq * row)?;
    check_len(OP, "seq_len", seq_len, 1)?;
    check_len(OP, "out", out, shape.n_q_heads * hd)?;
    if scratch.max_chunks < cfg.max_chunks(shape.max_seq) || scratch.n_q_heads < shape.n_q_heads {
        return Err(GpuError::invalid(
            OP,
            "scratch was sized for a smaller cache or fewer heads",
        ));
    }
    if !scale.is_finite() {
        return Err(GpuError::invalid(OP, format!("scale {scale}")));
    }
    let variant = cfg.masked_variant(mask);
    let partial = dev.function(&variant, "attn_decode_partial")?;
    let combine = dev.function(&variant, "attn_decode_combine")?;
    let chunks = cfg.max_chunks(shape.max_seq);
    let (nkv, chunks_i, max_i) = (
        shape.n_kv_heads as i32,
        scratch.max_chunks as i32,
        shape.max_seq as i32,
    );
    let mut b = dev.stream().launch_builder(&partial);
    b.arg(q).arg(k_cache).arg(v_cache).arg(seq_len);
    b.arg(&mut scratch.part_acc).arg(&mut scratch.part_ml);
    b.arg(&nkv).arg(&chunks_i).arg(&max_i).arg(&scale);
    if mask.ext() {
        b.arg(&window).arg(&cap);
    }
    let launch = LaunchConfig {
        grid_dim: (chunks as u32, shape.n_kv_heads as u32, 1),
        block_dim: (cfg.warps * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument types and counts match the kernel; sizes were checked above.
    unsafe { b.launch(launch) }.while_(|| "launching attn_decode_partial".into())?;
    let mut b = dev.stream().launch_builder(&combine);
    b.arg(&scratch.part_acc)
        .arg(&scratch.part_ml)
        .arg(seq_len)
        .arg(out)
        .arg(&chunks_i)
        .arg(&max_i);
    if let Some(s) = sinks {
        b.arg(s);
    }
    let launch = LaunchConfig {
        grid_dim: (shape.n_q_heads as u32, 1, 1),
        block_dim: (cfg.head_dim, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as above.
    unsafe { b.launch(launch) }.while_(|| "launching attn_decode_combine".into())?;
    Ok(())
}

/// [`launch_attention_decode`] in one launch: the last block of each KV head to finish merges the
/// chunks of its query heads (counters in the scratch, left zero after every launch). Needs
/// `seq_len[0] >= 1`.
#[allow(clippy::too_many_arguments)]
pub fn launch_attention_decode_fused(
    dev: &GpuDevice,
    cfg: AttnConfig,
    shape: KvShape,
    q: &CudaSlice<f32>,
    k_cache: &CudaSlice<u16>,
    v_cache: &CudaSlice<u16>,
    seq_len: &CudaSlice<i32>,
    scratch: &mut AttnScratch,
    out: &mut CudaSlice<f32>,
    scale: f32,
    mask: AttnMask,
    sinks: Option<&CudaSlice<f32>>,
) -> Result<()> {
    const OP: &str = "attention_decode_fused";
    let (window, cap) = mask.args(OP)?;
    let sinks = mask.sink_values(OP, sinks, shape.n_q_heads)?;
    shape.check(OP, &cfg)?;
    let hd = cfg.head_dim as usize;
    let row = shape.n_kv_heads * hd;
    check_len(OP, "q", q, shape.n_q_heads * hd)?;
    check_len(OP, "k_cache", k_cache, shape.max_seq * row)?;
    check_len(OP, "v_cache", v_cache, shape.max_seq * row)?;
    check_len(OP, "seq_len", seq_len, 1)?;
    check_len(OP, "out", out, shape.n_q_heads * hd)?;
    if scratch.max_chunks < cfg.max_chunks(shape.max_seq)
        || scratch.n_q_heads < shape.n_q_heads
        || scratch.counters.len() < shape.n_kv_heads
    {
        return Err(GpuError::invalid(
            OP,
            "scratch was sized for a smaller cache or fewer heads",
        ));
    }
    if !scale.is_finite() {
        return Err(GpuError::invalid(OP, format!("scale {scale}")));
    }
    let f = dev.function(&cfg.masked_variant(mask), "attn_decode_fused")?;
    let chunks = cfg.max_chunks(shape.max_seq);
    let (nkv, chunks_i, max_i) = (
        shape.n_kv_heads as i32,
        scratch.max_chunks as i32,
        shape.max_seq as i32,
    );
    let mut b = dev.stream().launch_builder(&f);
    b.arg(q).arg(k_cache).arg(v_cache).arg(seq_len);
    b.arg(&mut scratch.part_acc).arg(&mut scratch.part_ml);
    b.arg(&nkv).arg(&chunks_i).arg(&max_i).arg(&scale);
    b.arg(out).arg(&mut scratch.counters);
    if mask.ext() {
        b.arg(&window).arg(&cap);
    }
    if let Some(s) = sinks {
        b.arg(s);
    }
    let launch = LaunchConfig {
        grid_dim: (chunks as u32, shape.n_kv_heads as u32, 1),
        block_dim: (cfg.warps * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument types and counts match the kernel; sizes were checked above.
    unsafe { b.launch(launch) }.while_(|| "launching attn_decode_fused".into())?;
    Ok(())
}

/// CPU reference in f64 over the same BF16 cache.
#[allow(clippy::too_many_arguments)]
pub fn attention_ref(
    q: &[f32],
    k_cache: &[u16],
    v_cache: &[u16],
    seq_len: usize,
    n_q_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
) -> Vec<f32> {
    attention_masked_ref(
        q,
        k_cache,
        v_cache,
        seq_len,
        (n_q_heads, n_kv_heads, head_dim),
        scale,
        AttnMask::NONE,
    )
}

/// [`attention_ref`] under `mask` (`heads`: query heads, KV heads, head dim).
pub fn attention_masked_ref(
    q: &[f32],
    k_cache: &[u16],
    v_cache: &[u16],
    seq_len: usize,
    heads: (usize, usize, usize),
    scale: f32,
    mask: AttnMask,
) -> Vec<f32> {
    attention_sinks_ref(q, k_cache, v_cache, seq_len, heads, scale, mask, None)
}

/// [`attention_masked_ref`] with each query head's sink logit (`sinks`) joined to its softmax's
/// maximum and denominator (the CPU engine's `exp_shifted_sink`), in f64.
#[allow(clippy::too_many_arguments)]
pub fn attention_sinks_ref(
    q: &[f32],
    k_cache: &[u16],
    v_cache: &[u16],
    seq_len: usize,
    heads: (usize, usize, usize),
    scale: f32,
    mask: AttnMask,
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    let (n_q_heads, n_kv_heads, head_dim) = heads;
    let first = (0..seq_len)
        .find(|&t| mask.sees(t, seq_len - 1))
        .unwrap_or(0);
    let group = n_q_heads / n_kv_heads;
    let row = n_kv_heads * head_dim;
    let mut out = vec![0f32; n_q_heads * head_dim];
    for h in 0..n_q_heads {
        let kvh = h / group;
        let qh = &q[h * head_dim..(h + 1) * head_dim];
        let scores: Vec<f64> = (0..seq_len)
            .map(|t| {
                if t < first {
                    return f64::NEG_INFINITY;
                }
                let kr = &k_cache[t * row + kvh * head_dim..][..head_dim];
                mask.cap(
                    qh.iter()
                        .zip(kr)
                        .map(|(&a, &b)| a as f64 * bf16_to_f32(b) as f64)
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
        let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
        let total: f64 = w.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - mx).exp());
        for d in 0..head_dim {
            let acc: f64 = (0..seq_len)
                .map(|t| w[t] * bf16_to_f32(v_cache[t * row + kvh * head_dim + d]) as f64)
                .sum();
            out[h * head_dim + d] = (acc / total) as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::f32_to_bf16;

    #[test]
    fn single_position_returns_its_value_row() {
        // One cached position: softmax weight 1, output = V row of the head's KV head.
        let (nq, nkv, hd) = (4, 2, 2);
        let k: Vec<u16> = [1.0f32, 0.0, 0.0, 1.0]
            .iter()
            .map(|&v| f32_to_bf16(v))
            .collect();
        let v: Vec<u16> = [5.0f32, 6.0, 7.0, 8.0]
            .iter()
            .map(|&v| f32_to_bf16(v))
            .collect();
        let out = attention_ref(&[0.3; 8], &k, &v, 1, nq, nkv, hd, 0.5);
        assert_eq!(out, vec![5.0, 6.0, 5.0, 6.0, 7.0, 8.0, 7.0, 8.0]);
    }

    #[test]
    fn equal_scores_average_values() {
        let k = vec![f32_to_bf16(0.0); 4];
        let v: Vec<u16> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .map(|&v| f32_to_bf16(v))
            .collect();
        let out = attention_ref(&[1.0, 1.0], &k, &v, 2, 1, 1, 2, 1.0);
        assert_eq!(out, vec![2.0, 3.0]);
    }

    #[test]
    fn configs_are_validated() {
        assert!(AttnConfig::for_heads(128, 32, 8).is_ok());
        // Head dims: multiples of 32 up to 256 (Phi-3-mini's 96).
        assert!(AttnConfig::for_heads(96, 32, 8).is_ok());
        assert!(AttnConfig::for_heads(32, 4, 4).is_ok());
        assert!(AttnConfig::for_heads(80, 32, 8).is_err());
        assert!(AttnConfig::for_heads(288, 32, 8).is_err());
        assert!(AttnConfig::for_heads(128, 30, 8).is_err());
        assert_eq!(AttnConfig::for_heads(64, 9, 3).unwrap().group, 3);
    }
}

#[cfg(test)]
mod mask_tests {
    use super::*;
    use crate::ops::f32_to_bf16;

    /// A sink joins the denominator only: a sink of −∞ changes nothing, a sink equal to every
    /// score (all scores equal here) takes 1/(n + 1) of the weight from the values.
    #[test]
    fn a_sink_takes_its_share_of_the_softmax_and_no_value() {
        let b = |v: &[f32]| v.iter().map(|&x| f32_to_bf16(x)).collect::<Vec<_>>();
        let (k, v) = (b(&[0.0; 6]), b(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
        let mask = AttnMask {
            sinks: true,
            ..AttnMask::NONE
        };
        let plain = attention_masked_ref(&[0.3, 0.7], &k, &v, 3, (1, 1, 2), 1.0, AttnMask::NONE);
        assert_eq!(plain, vec![3.0, 4.0]);
        let none =
            attention_sinks_ref(&[0.3, 0.7], &k, &v, 3, (1, 1, 2), 1.0, mask, Some(&[-1e30]));
        assert_eq!(none, plain);
        let equal = attention_sinks_ref(&[0.3, 0.7], &k, &v, 3, (1, 1, 2), 1.0, mask, Some(&[0.0]));
        assert!((equal[0] - 3.0 * 0.75).abs() < 1e-6 && (equal[1] - 4.0 * 0.75).abs() < 1e-6);
        assert_eq!(format!("{mask}"), " sinks");
        assert_ne!(
            AttnConfig::for_heads(64, 4, 2)
                .unwrap()
                .masked_variant(mask),
            AttnConfig::for_heads(64, 4, 2).unwrap().variant()
        );
    }

    #[test]
    fn a_window_of_one_returns_the_last_value_and_caps_bound_scores() {
        let b = |v: &[f32]| v.iter().map(|&x| f32_to_bf16(x)).collect::<Vec<_>>();
        let k = b(&[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        let v = b(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let mask = AttnMask {
            window: Some(1),
            ..AttnMask::NONE
        };
        let out = attention_masked_ref(&[0.3, 0.7], &k, &v, 3, (1, 1, 2), 1.0, mask);
        assert_eq!(out, vec![5.0, 6.0]);
        assert!(mask.sees(2, 2) && !mask.sees(1, 2));
        let capped = AttnMask {
            softcap: Some(2.0),
            ..AttnMask::NONE
        };
        assert!((capped.cap(1e6) - 2.0).abs() < 1e-12);
        assert_eq!(capped.cap(0.0), 0.0);
        assert_eq!(format!("{capped}"), " softcap=2");
        assert!(mask.args("t").is_ok());
        let zero = AttnMask {
            window: Some(0),
            ..AttnMask::NONE
        };
        assert!(zero.args("t").is_err());
        assert_eq!(
            AttnConfig::for_heads(64, 4, 2)
                .unwrap()
                .masked_variant(AttnMask::NONE),
            AttnConfig::for_heads(64, 4, 2).unwrap().variant()
        );
    }
}
