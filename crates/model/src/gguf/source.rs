//! [`GgufSource`]: a GGUF file seen as a [`TensorSource`] with Hugging Face names and layouts
//! (formats.md §1.5, §1.7, §1.8).

use super::file::{GgufFile, GgufTensorInfo};
use super::types::GgmlType;
use crate::arch::{Family, Role, Sliding};
use crate::config::{Block, ModelConfig, RopeScaling, RopeStyle};
use crate::error::{ModelError, Result};
use crate::weights::{HostTensor, Linear, TensorSource, Wrap, Wrapped};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// The GGUF tensor that holds llama3-style per-frequency RoPE divisors.
pub const ROPE_FREQS_TENSOR: &str = "rope_freqs.weight";
/// Original context length assumed for llama3 RoPE scaling when the file does not state it
/// (Llama 3.1's value). Any value gives the same frequencies once the bands are fitted to it.
const DEFAULT_LLAMA3_ORIGINAL_CONTEXT: usize = 8192;

/// A GGUF checkpoint of a family the engine runs ([`crate::arch`]) that hands out tensors by HF
/// name, in HF layout: shapes in PyTorch order, llama Q/K rows un-permuted (so RoPE is
/// [`RopeStyle::Neox`]), F32/F16/BF16 tensors in their own precision and quantized ones served
/// from their blocks. The config follows llama.cpp's reading of the metadata.
pub struct GgufSource {
    file: GgufFile,
    family: &'static Family,
    /// `general.architecture`, the prefix of the model's metadata keys.
    arch_key: String,
    /// Matrices served as given instead of from the file's bytes, by GGUF name (coded ones).
    linears: HashMap<String, Arc<dyn Linear>>,
    /// The ggml form's variant the file's quantised matrices are served in.
    ggml_variant: &'static str,
}

impl std::fmt::Debug for GgufSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufSource")
            .field("file", &self.file)
            .field("family", &self.family.name)
            .field("linears", &self.linears.len())
            .finish()
    }
}

impl GgufSource {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::new(GgufFile::open(path)?)
    }

    /// Wraps a parsed file; fails with [`ModelError::Unsupported`] for an architecture the
    /// engine does not run.
    pub fn new(file: GgufFile) -> Result<Self> {
        let family = family_of(&file)?;
        let arch_key = family_key(&file)?;
        Ok(GgufSource {
            file,
            family,
            arch_key,
            linears: HashMap::new(),
            ggml_variant: "",
        })
    }

    /// The file's quantised matrices multiply 8-bit activations (the ggml form's `q8` variant,
    /// llama.cpp's precision) where `q8`, f32 ones otherwise.
    pub fn with_q8_activations(mut self, q8: bool) -> Self {
        self.ggml_variant = if q8 { crate::forms::ggml::Q8 } else { "" };
        self
    }

    /// Serves these matrices (by GGUF name, in GGUF row order) instead of the file's bytes for
    /// them; llama Q/K rows are un-permuted around them like the file's own tensors.
    pub fn with_linears(mut self, linears: HashMap<String, Arc<dyn Linear>>) -> Self {
        self.linears = linears;
        self
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    pub fn into_file(self) -> GgufFile {
        self.file
    }

    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch_key)
    }

    fn required_usize(&self, suffix: &str) -> Result<usize> {
        let key = self.key(suffix);
        self.file.get_usize(&key)?.ok_or_else(|| {
            ModelError::Config(format!(
                "{}: metadata key `{key}` is missing",
                self.file.path().display()
            ))
        })
    }

    /// (n_head, n_head_kv, head_dim) from metadata.
    fn attention_shape(&self) -> Result<(usize, usize, usize)> {
        let hidden = self.required_usize("embedding_length")?;
        let n_head = self.required_usize("attention.head_count")?;
        if n_head == 0 {
            return Err(ModelError::Config(format!(
                "`{}` is 0",
                self.key("attention.head_count")
            )));
        }
        let n_head_kv = self
            .file
            .get_usize(&self.key("attention.head_count_kv"))?
            .unwrap_or(n_head);
        if n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(ModelError::Config(format!(
                "`{}` is {n_head_kv}, which does not divide the {n_head} query heads",
                self.key("attention.head_count_kv")
            )));
        }
        let head_dim = match self.file.get_usize(&self.key("attention.key_length"))? {
            Some(d) => d,
            None if hidden.is_multiple_of(n_head) => hidden / n_head,
            None => {
                return Err(ModelError::Config(format!(
                    "embedding_length {hidden} is not a multiple of head_count {n_head} and `{}` is missing",
                    self.key("attention.key_length")
                )))
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(ModelError::Config(format!(
                "head dimension {head_dim} is not a positive even number"
            )));
        }
        Ok((n_head, n_head_kv, head_dim))
    }

    fn rope_scaling(&self, head_dim: usize, rope_theta: f32) -> Result<RopeScaling> {
        let kind = self
            .file
            .get_str(&self.key("rope.scaling.type"))?
            .unwrap_or("none");
        let factor = self.file.get_f32(&self.key("rope.scaling.factor"))?;
        let original = self
            .file
            .get_usize(&self.key("rope.scaling.original_context_length"))?;
        match kind {
            "none" => {}
            "linear" => {
                let factor = factor.ok_or_else(|| {
                    ModelError::Config(format!(
                        "linear RoPE scaling without `{}`",
                        self.key("rope.scaling.factor")
                    ))
                })?;
                return Ok(RopeScaling::Linear { factor });
            }
            "llama3" if self.file.tensor_info(ROPE_FREQS_TENSOR).is_none() => {
                let missing = |k: &str| {
                    ModelError::Config(format!("llama3 RoPE scaling without `{}`", self.key(k)))
                };
                return Ok(RopeScaling::Llama3 {
                    factor: factor.ok_or_else(|| missing("rope.scaling.factor"))?,
                    low_freq_factor: self
                        .file
                        .get_f32(&self.key("rope.scaling.low_freq_factor"))?
                        .unwrap_or(1.0),
                    high_freq_factor: self
                        .file
                        .get_f32(&self.key("rope.scaling.high_freq_factor"))?
                        .unwrap_or(4.0),
                    original_max_position_embeddings: original
                        .ok_or_else(|| missing("rope.scaling.original_context_length"))?,
                });
            }
            "llama3" => {}
            "yarn" => {
                // As llama.cpp computes it (llama_context, ggml's rope_yarn): the correction range
                // floored/ceiled, β 32 and 1 (its defaults; gpt-oss's loader reads no β key), the
                // attention factor 0.1·ln(factor) + 1 times `rope.scaling.attn_factor`.
                let factor = factor.ok_or_else(|| {
                    ModelError::Config(format!(
                        "YaRN RoPE scaling without `{}`",
                        self.key("rope.scaling.factor")
                    ))
                })?;
                let original = match original {
                    Some(o) => o,
                    None => self.required_usize("context_length")?,
                };
                let attn = self
                    .file
                    .get_f32(&self.key("rope.scaling.attn_factor"))?
                    .unwrap_or(1.0);
                return Ok(RopeScaling::Yarn {
                    factor,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    original_max_position_embeddings: original,
                    truncate: true,
                    attention_factor: (crate::config::yarn_mscale(factor as f64, 1.0) * attn as f64)
                        as f32,
                });
            }
            other => {
                return Err(ModelError::Unsupported(format!(
                    "{}: RoPE scaling type `{other}` (`{}`)",
                    self.file.path().display(),
                    self.key("rope.scaling.type")
                )))
            }
        }
        // llama.cpp stores llama3 scaling only as the per-frequency divisors of `rope_freqs.weight`.
        let Some(info) = self.file.tensor_info(ROPE_FREQS_TENSOR) else {
            return Ok(RopeScaling::None);
        };
        if info.n_elements() != (head_dim / 2) as u64 {
            return Err(ModelError::tensor(
                ROPE_FREQS_TENSOR,
                format!(
                    "has {} elements; expected head_dim/2 = {}",
                    info.n_elements(),
                    head_dim / 2
                ),
            ));
        }
        let divisors = self.file.dequantize(info)?;
        fit_llama3_scaling(
            &divisors,
            rope_theta,
            original.unwrap_or(DEFAULT_LLAMA3_ORIGINAL_CONTEXT),
        )
    }

    fn tensor_by_gguf_name(
        &self,
        info: &GgufTensorInfo,
        unpermute_heads: Option<usize>,
    ) -> Result<HostTensor> {
        let shape = info.hf_shape();
        let rows = if shape.len() <= 1 {
            info.n_elements() as usize
        } else {
            shape[0]
        };
        let permute = |data_len: usize| -> Result<Option<(usize, usize)>> {
            let Some(heads) = unpermute_heads else {
                return Ok(None);
            };
            if shape.len() > 2 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
                return Err(ModelError::tensor(
                    &info.name,
                    format!(
                        "shape {shape:?} cannot be split into {heads} heads of an even dimension"
                    ),
                ));
            }
            Ok(Some((heads, data_len / rows.max(1))))
        };
        Ok(match info.ggml_type {
            GgmlType::F16 | GgmlType::BF16 => {
                let raw = self.file.tensor_data(info);
                let mut data: Vec<u16> = raw
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect();
                if let Some((heads, row_len)) = permute(data.len())? {
                    data = unpermute_rows(&data, heads, row_len);
                }
                if info.ggml_type == GgmlType::F16 {
                    HostTensor::F16 { shape, data }
                } else {
                    HostTensor::Bf16 { shape, data }
                }
            }
            ty if served_from_blocks(info) => {
                // Served from the file's own blocks: no f32 copy of the model.
                crate::gguf::check_dequantizable(&info.name, ty)?;
                let src = crate::forms::Source::new(
                    shape[0],
                    shape[1],
                    crate::forms::Values::Ggml {
                        ty,
                        bytes: self.file.tensor_block_bytes(info),
                    },
                )
                .map_err(|e| ModelError::tensor(&info.name, e.to_string()))?;
                let m =
                    crate::forms::Form::encode(&crate::forms::ggml::GGML, &src, self.ggml_variant)
                        .map_err(|e| ModelError::tensor(&info.name, e.to_string()))?;
                HostTensor::Linear(match unpermute_heads {
                    Some(heads) => Arc::new(RowPermuted::new(&info.name, m, heads)?),
                    None => m,
                })
            }
            _ => {
                let mut data = self.file.dequantize(info)?;
                if let Some((heads, row_len)) = permute(data.len())? {
                    data = unpermute_rows(&data, heads, row_len);
                }
                HostTensor::F32 { shape, data }
            }
        })
    }
}

/// Whether a tensor is served from the file's own blocks (the ggml form, read from the mapping)
/// rather than copied: quantised matrices. F16/BF16 tensors are copied as they are, the rest
/// widened to f32.
fn served_from_blocks(info: &GgufTensorInfo) -> bool {
    info.hf_shape().len() == 2
        && !matches!(
            info.ggml_type,
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16
        )
}

impl GgufSource {
    /// What serving this file on the CPU holds: the bytes of the tensors served from the file's
    /// blocks (pages of the mapping, read as they are used) and the bytes copied out of it.
    pub fn memory(&self) -> crate::load::MemoryNeed {
        let mut need = crate::load::MemoryNeed::default();
        for info in self.file.tensors() {
            if served_from_blocks(info) {
                need.mapped += self.file.tensor_data(info).len() as u64;
            } else {
                let width = match info.ggml_type {
                    GgmlType::F16 | GgmlType::BF16 => 2,
                    _ => 4,
                };
                need.allocated += info.n_elements() * width;
            }
        }
        need
    }
}

/// `general.architecture`, the prefix of the model's metadata keys.
fn family_key(file: &GgufFile) -> Result<String> {
    Ok(file
        .get_str("general.architecture")?
        .ok_or_else(|| {
            ModelError::format(
                file.path(),
                "metadata key `general.architecture` is missing",
            )
        })?
        .to_string())
}

/// The family of a GGUF file (its `general.architecture`).
pub fn family_of(file: &GgufFile) -> Result<&'static Family> {
    let key = family_key(file)?;
    let experts = file.get_usize(&format!("{key}.expert_count"))?.unwrap_or(0) > 0;
    Family::from_gguf_arch(&key, experts).ok_or_else(|| {
        ModelError::Unsupported(format!(
            "{}: GGUF architecture `{key}` (general.architecture); supported: {}",
            file.path().display(),
            Family::gguf_arch_names()
        ))
    })
}

/// Undoes llama.cpp's Q/K permutation of rows (formats.md §1.8): HF row `h·D + j·D/2 + i` is GGUF
/// row `h·D + 2i + j`, for `heads` heads of D rows each; `row_len` elements per row.
pub fn unpermute_rows<T: Copy>(data: &[T], heads: usize, row_len: usize) -> Vec<T> {
    let rows = data.len() / row_len.max(1);
    let d = rows / heads;
    let mut out = Vec::with_capacity(data.len());
    for hf_row in 0..rows {
        let (h, r) = (hf_row / d, hf_row % d);
        let (j, i) = (r / (d / 2), r % (d / 2));
        let src = h * d + 2 * i + j;
        out.extend_from_slice(&data[src * row_len..(src + 1) * row_len]);
    }
    out
}

/// Recovers llama3 RoPE scaling parameters from llama.cpp's per-frequency divisors
/// (`rope_freqs.weight`, written by `LlamaModel.generate_extra_tensors`):
/// divisor 1 for wavelengths below `L/high`, `factor` above `L/low`, and in between
/// `1 / ((1 − s)/factor + s)` with `s = (L/λ − low) / (high − low)`. The band edges depend only
/// on `L/(high − low)` and `low/(high − low)`, which two in-band points determine, so any `L`
/// (`original_context`) reproduces the divisors. The fit is checked against every divisor.
pub fn fit_llama3_scaling(
    divisors: &[f32],
    rope_theta: f32,
    original_context: usize,
) -> Result<RopeScaling> {
    let err = |msg: String| ModelError::tensor(ROPE_FREQS_TENSOR, msg);
    if divisors.is_empty() || divisors.iter().any(|d| !d.is_finite() || *d <= 0.0) {
        return Err(err("divisors must be finite and positive".into()));
    }
    let n = divisors.len();
    let rot_dim = 2 * n;
    let inv_wavelen = |i: usize| {
        1.0 / (2.0
            * std::f64::consts::PI
            * (rope_theta as f64).powf(2.0 * i as f64 / rot_dim as f64))
    };
    let factor = divisors.iter().copied().fold(0.0f32, f32::max) as f64;
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * b.abs().max(1.0);
    if close(factor, 1.0) {
        return Ok(RopeScaling::None);
    }
    let l = original_context as f64;
    let band: Vec<usize> = (0..n)
        .filter(|&i| !close(divisors[i] as f64, 1.0) && !close(divisors[i] as f64, factor))
        .collect();
    // smooth(i) = a·(1/λ_i) − b.
    let (a, b) = match band.as_slice() {
        [first, .., last] => {
            let smooth =
                |i: usize| (1.0 / divisors[i] as f64 - 1.0 / factor) / (1.0 - 1.0 / factor);
            let (x0, y0, x1, y1) = (
                inv_wavelen(*first),
                smooth(*first),
                inv_wavelen(*last),
                smooth(*last),
            );
            let a = (y1 - y0) / (x1 - x0);
            (a, a * x0 - y0)
        }
        [] => {
            // No frequency inside the band: place both edges in the gap between the last
            // unscaled and the first fully scaled frequency.
            let last_one = (0..n).rev().find(|&i| close(divisors[i] as f64, 1.0));
            let first_full = (0..n).find(|&i| close(divisors[i] as f64, factor));
            let (Some(lo), Some(hi)) = (last_one, first_full) else {
                return Err(err(
                    "divisors are not llama3 scaling: no unscaled or no fully scaled frequency"
                        .into(),
                ));
            };
            if lo >= hi {
                return Err(err(
                    "divisors are not llama3 scaling: they do not grow with wavelength".into(),
                ));
            }
            // 1/λ at the high edge (s = 1) and low edge (s = 0), one and two thirds of the way.
            let (x_hi, x_lo) = (inv_wavelen(lo), inv_wavelen(hi));
            let (e1, e0) = (x_hi + (x_lo - x_hi) / 3.0, x_hi + 2.0 * (x_lo - x_hi) / 3.0);
            let a = 1.0 / (e1 - e0);
            (a, a * e0)
        }
        [_] => {
            return Err(err(
                "only one frequency lies in the llama3 transition band; cannot fit it".into(),
            ))
        }
    };
    if !(a.is_finite() && a > 0.0 && b.is_finite()) {
        return Err(err(format!(
            "divisors are not llama3 scaling (fitted slope {a}, offset {b})"
        )));
    }
    let low_freq_factor = (b * l / a) as f32;
    let high_freq_factor = ((1.0 + b) * l / a) as f32;
    let scaling = RopeScaling::Llama3 {
        factor: factor as f32,
        low_freq_factor,
        high_freq_factor,
        original_max_position_embeddings: original_context,
    };
    for (i, &div) in divisors.iter().enumerate() {
        let expected = llama3_divisor(
            inv_wavelen(i),
            factor,
            low_freq_factor as f64,
            high_freq_factor as f64,
            l,
        );
        if (expected - div as f64).abs() > 1e-3 * expected {
            return Err(err(format!(
                "divisor {i} is {div}, but the fitted llama3 scaling (factor {factor}, low {low_freq_factor}, \
                 high {high_freq_factor}) gives {expected}"
            )));
        }
    }
    Ok(scaling)
}

/// llama.cpp's llama3 RoPE divisor of a frequency with inverse wavelength `inv_wavelen`.
fn llama3_divisor(
    inv_wavelen: f64,
    factor: f64,
    low: f64,
    high: f64,
    original_context: f64,
) -> f64 {
    let wavelen = 1.0 / inv_wavelen;
    if wavelen < original_context / high {
        1.0
    } else if wavelen > original_context / low {
        factor
    } else {
        let smooth = (original_context / wavelen - low) / (high - low);
        1.0 / ((1.0 - smooth) / factor + smooth)
    }
}

impl GgufSource {
    /// The family's block as llama.cpp reads it from the metadata (`src/models/<arch>.cpp`):
    /// Gemma's sliding windows (pattern 2 or 6 unless `attention.sliding_window_pattern` says
    /// otherwise; Gemma 2 always slides, 4096 by default), soft-caps, the local RoPE base
    /// (`rope.freq_base_swa`), the 27B's query scale; the family's activation and embedding scale.
    fn block(
        &self,
        hidden: usize,
        heads: usize,
        layers: usize,
        rotary_dim: Option<usize>,
    ) -> Result<Block> {
        let f = &self.file;
        let family = self.family;
        let mut block = Block {
            activation: family.act_default,
            embed_scale: family.embed_scale.then(|| (hidden as f32).sqrt()),
            rotary_dim,
            ..Block::default()
        };
        if let Some(spec) = &family.moe {
            // llama.cpp renormalises the picked experts' weights for Mixtral and Qwen3-MoE; a
            // layer has experts where it has a router.
            let with_router: Vec<bool> = (0..layers)
                .map(|i| {
                    f.tensor_info(&format!("blk.{i}.{}.weight", spec.router.1))
                        .is_some()
                })
                .collect();
            block.moe = Some(crate::config::Moe {
                experts: self.required_usize("expert_count")?,
                top_k: self.required_usize("expert_used_count")?,
                intermediate_size: match f.get_usize(&self.key("expert_feed_forward_length"))? {
                    Some(n) => n,
                    None => self.required_usize("feed_forward_length")?,
                },
                norm_topk: f
                    .get_bool(&self.key("expert_weights_norm"))?
                    .unwrap_or(true),
                layers: match with_router.iter().all(|&r| r) {
                    true => Vec::new(),
                    false => with_router,
                },
                routing: spec.routing,
            });
        }
        // llama.cpp's LLM_FFN_SWIGLU_OAI_MOE: gpt-oss's constants, fixed.
        if family.clamped_swiglu {
            block.clamped_swiglu = Some(crate::config::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0,
            });
        }
        if family.softcap {
            let cap = |k: &str| -> Result<Option<f32>> {
                Ok(f.get_f32(&self.key(k))?.filter(|&c| c != 0.0))
            };
            block.attn_softcap = cap("attn_logit_softcapping")?;
            block.final_softcap = cap("final_logit_softcapping")?;
        }
        if let Sliding::Pattern(default_pattern) = family.sliding {
            let window = f.get_usize(&self.key("attention.sliding_window"))?;
            // llama.cpp: Gemma 2 always slides (4096 unless stated), Gemma 3 where stated.
            let window = match (family.arch, window) {
                (crate::arch::Arch::Gemma2, None) => Some(4096),
                (_, w) => w.filter(|&w| w > 0),
            };
            if let Some(window) = window {
                let pattern_key = self.key("attention.sliding_window_pattern");
                let layers = match f.get_bool_array(&pattern_key)? {
                    Some(flags) if flags.len() == layers => flags,
                    Some(flags) => {
                        return Err(ModelError::Config(format!(
                            "`{pattern_key}` has {} flags for {layers} layers",
                            flags.len()
                        )))
                    }
                    None => crate::arch::sliding_pattern(
                        f.get_usize(&pattern_key)?.unwrap_or(default_pattern),
                        layers,
                    ),
                };
                block.sliding_window = Some(window);
                block.sliding_layers = layers;
                block.local_rope_theta = match family.local_rope_base {
                    Some(default) => Some(
                        f.get_f32(&self.key("rope.freq_base_swa"))?
                            .unwrap_or(default as f32),
                    ),
                    None => f.get_f32(&self.key("rope.freq_base_swa"))?,
                };
            }
        }
        if family.query_pre_attn_scalar {
            // llama.cpp: 1/sqrt(head_dim), but 1/sqrt(hidden/heads) for the 27B models (Gemma 2
            // of 46 layers, Gemma 3 of 62), whose query_pre_attn_scalar is that.
            let big = matches!(
                (family.arch, layers),
                (crate::arch::Arch::Gemma2, 46) | (crate::arch::Arch::Gemma3, 62)
            );
            if big {
                block.attn_scale = Some(1.0 / ((hidden / heads) as f32).sqrt());
            }
        }
        Ok(block)
    }
}

impl GgufSource {
    /// Expert `expert`'s matrix of a tensor that stacks every expert's (`[experts, rows, cols]`,
    /// each expert's rows contiguous): its own bytes, as a matrix of the file's type.
    fn expert(&self, stack: &str, expert: usize) -> Result<Option<HostTensor>> {
        let Some(info) = self.file.tensor_info(stack) else {
            return Ok(None);
        };
        let ne = info.ne();
        // Biases stack as `[rows, experts]`: expert e's row, widened to f32.
        if stack.ends_with(".bias") {
            if info.dims.len() != 2 || expert as u64 >= ne[1] {
                return Err(ModelError::tensor(
                    stack,
                    format!(
                        "expert {expert} of a bias of dimensions {:?} (expected [rows, experts])",
                        info.dims
                    ),
                ));
            }
            let rows = ne[0] as usize;
            let all = self.file.dequantize(info)?;
            return Ok(Some(HostTensor::F32 {
                shape: vec![rows],
                data: all[expert * rows..(expert + 1) * rows].to_vec(),
            }));
        }
        if info.dims.len() != 3 || expert as u64 >= ne[2] {
            return Err(ModelError::tensor(
                stack,
                format!(
                    "expert {expert} of a tensor of dimensions {:?} (expected [cols, rows, experts])",
                    info.dims
                ),
            ));
        }
        let (cols, rows, experts) = (ne[0] as usize, ne[1] as usize, ne[2] as usize);
        let bytes = self.file.tensor_block_bytes(info);
        let per = bytes.bytes().len() / experts;
        let part = bytes.sub(expert * per..(expert + 1) * per);
        let shape = vec![rows, cols];
        let half = |raw: &[u8]| -> Vec<u16> {
            raw.chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect()
        };
        Ok(Some(match info.ggml_type {
            GgmlType::F32 => HostTensor::F32 {
                shape,
                data: part
                    .bytes()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            },
            GgmlType::F16 => HostTensor::F16 {
                shape,
                data: half(part.bytes()),
            },
            GgmlType::BF16 => HostTensor::Bf16 {
                shape,
                data: half(part.bytes()),
            },
            ty => {
                crate::gguf::check_dequantizable(stack, ty)?;
                let src = crate::forms::Source::new(
                    rows,
                    cols,
                    crate::forms::Values::Ggml { ty, bytes: part },
                )
                .map_err(|e| ModelError::tensor(stack, e.to_string()))?;
                HostTensor::Linear(
                    crate::forms::Form::encode(&crate::forms::ggml::GGML, &src, self.ggml_variant)
                        .map_err(|e| ModelError::tensor(stack, e.to_string()))?,
                )
            }
        }))
    }
}

impl TensorSource for GgufSource {
    fn config(&self) -> Result<ModelConfig> {
        let f = &self.file;
        let (num_heads, num_kv_heads, head_dim) = self.attention_shape()?;
        let rotary_dim = match f.get_usize(&self.key("rope.dimension_count"))? {
            Some(rot) if rot != head_dim && self.family.partial_rotary => Some(rot),
            Some(rot) if rot != head_dim => {
                return Err(ModelError::Unsupported(format!(
                    "{}: partial rotary embeddings (`{}` = {rot}, head_dim = {head_dim}) in a {} \
                     model",
                    f.path().display(),
                    self.key("rope.dimension_count"),
                    self.family.name
                )));
            }
            _ => None,
        };
        let vocab_size = match f.tensor_info("token_embd.weight") {
            Some(t) => t.ne()[1] as usize,
            None => match f.get_usize(&self.key("vocab_size"))? {
                Some(v) => v,
                None => f
                    .get_str_array("tokenizer.ggml.tokens")?
                    .map(|t| t.len())
                    .ok_or_else(|| {
                        ModelError::Config(format!(
                            "{}: no vocabulary size (no token_embd.weight, `{}` or tokenizer.ggml.tokens)",
                            f.path().display(),
                            self.key("vocab_size")
                        ))
                    })?,
            },
        };
        let rms_key = self.key("attention.layer_norm_rms_epsilon");
        let rms_norm_eps = f.get_f32(&rms_key)?.ok_or_else(|| {
            ModelError::Config(format!(
                "{}: metadata key `{rms_key}` is missing",
                f.path().display()
            ))
        })?;
        let rope_theta = f.get_f32(&self.key("rope.freq_base"))?.unwrap_or(10_000.0);
        let token_id = |k: &str| f.get_u32(&format!("tokenizer.ggml.{k}"));
        let mut eos_token_ids = Vec::new();
        for k in ["eos_token_id", "eot_token_id", "eom_token_id"] {
            if let Some(id) = token_id(k)? {
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        let hidden_size = self.required_usize("embedding_length")?;
        let num_layers = self.required_usize("block_count")?;
        let block = self.block(hidden_size, num_heads, num_layers, rotary_dim)?;
        Ok(ModelConfig {
            arch: self.family.arch,
            vocab_size,
            hidden_size,
            intermediate_size: self.required_usize("feed_forward_length")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            max_position_embeddings: self.required_usize("context_length")?,
            rms_norm_eps,
            rope_theta,
            rope_scaling: self.rope_scaling(head_dim, rope_theta)?,
            rope_style: RopeStyle::Neox,
            tie_word_embeddings: f.tensor_info("output.weight").is_none(),
            attention_bias: self
                .family
                .hf_name(Role::Q, 0, "bias")
                .and_then(|n| self.family.gguf_name(&n))
                .is_some_and(|n| f.tensor_info(&n).is_some()),
            bos_token_id: token_id("bos_token_id")?,
            eos_token_ids,
            block,
        })
    }

    fn norms_hold_the_one(&self) -> bool {
        true
    }

    fn tensor(&self, hf_name: &str) -> Result<Option<HostTensor>> {
        if let Some((stack, expert)) = self.family.gguf_expert(hf_name) {
            return self.expert(&stack, expert);
        }
        let Some(name) = self.family.gguf_name(hf_name) else {
            return Ok(None);
        };
        let Some(info) = self.file.tensor_info(&name) else {
            return Ok(None);
        };
        // llama.cpp permuted the rows of q and k (their biases too) for its interleaved RoPE.
        let heads = match self.family.role_of(hf_name) {
            _ if !self.family.gguf_qk_permuted => None,
            Some(Role::Q) => Some(self.attention_shape()?.0),
            Some(Role::K) => Some(self.attention_shape()?.1),
            _ => None,
        };
        if let Some(m) = self.linears.get(&name) {
            let m = match heads {
                Some(heads) => Arc::new(RowPermuted::new(&name, m.clone(), heads)?),
                None => m.clone(),
            };
            return Ok(Some(HostTensor::Linear(m)));
        }
        self.tensor_by_gguf_name(info, heads).map(Some)
    }
}

/// llama.cpp's Q/K row permutation: `0[hf_row]` = the stored row.
#[derive(Clone)]
struct RowOrder(Vec<usize>);

impl Wrap for RowOrder {
    /// Products are computed in stored order and their outputs reordered.
    fn output(&self, y: &mut [f32], rows: usize) {
        let mut stored = vec![0f32; rows];
        for y in y.chunks_exact_mut(rows) {
            stored.copy_from_slice(y);
            for (y, &s) in y.iter_mut().zip(&self.0) {
                *y = stored[s];
            }
        }
    }
    fn row(&self, inner: &dyn Linear, r: usize, out: &mut [f32]) {
        inner.row(self.0[r], out)
    }
    fn bytes(&self) -> usize {
        self.0.len() * std::mem::size_of::<usize>()
    }
}

/// A matrix stored with llama.cpp's Q/K row permutation, seen in HF row order (see
/// [`unpermute_rows`]).
type RowPermuted = Wrapped<RowOrder>;

impl RowPermuted {
    fn new(name: &str, inner: Arc<dyn Linear>, heads: usize) -> Result<Self> {
        let rows = inner.rows();
        if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
            return Err(ModelError::tensor(
                name,
                format!("{rows} rows cannot be split into {heads} heads of an even dimension"),
            ));
        }
        let ids: Vec<usize> = (0..rows).collect();
        Ok(Wrapped::with(
            inner,
            RowOrder(unpermute_rows(&ids, heads, 1)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_names_map_to_gguf_names() {
        let cases = [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
            (
                "model.layers.0.input_layernorm.weight",
                "blk.0.attn_norm.weight",
            ),
            (
                "model.layers.12.self_attn.q_proj.weight",
                "blk.12.attn_q.weight",
            ),
            ("model.layers.3.self_attn.k_proj.bias", "blk.3.attn_k.bias"),
            (
                "model.layers.3.self_attn.v_proj.weight",
                "blk.3.attn_v.weight",
            ),
            (
                "model.layers.3.self_attn.o_proj.weight",
                "blk.3.attn_output.weight",
            ),
            (
                "model.layers.3.post_attention_layernorm.weight",
                "blk.3.ffn_norm.weight",
            ),
            (
                "model.layers.3.mlp.gate_proj.weight",
                "blk.3.ffn_gate.weight",
            ),
            ("model.layers.3.mlp.up_proj.weight", "blk.3.ffn_up.weight"),
            (
                "model.layers.3.mlp.down_proj.weight",
                "blk.3.ffn_down.weight",
            ),
        ];
        let llama = crate::arch::Arch::Llama.family();
        for (hf, gguf) in cases {
            assert_eq!(llama.gguf_name(hf).as_deref(), Some(gguf), "{hf}");
        }
        for bad in [
            "model.layers.x.mlp.up_proj.weight",
            "model.layers.1.mlp.up_proj.scale",
            "foo",
            "model.layers.",
        ] {
            assert_eq!(llama.gguf_name(bad), None, "{bad}");
        }
    }

    /// Applies llama.cpp's `permute` (conversion/llama.py) to rows: GGUF row h·D + 2i + j holds
    /// HF row h·D + j·D/2 + i.
    fn llama_cpp_permute(rows: &[u32], heads: usize) -> Vec<u32> {
        let d = rows.len() / heads;
        let mut out = vec![0; rows.len()];
        for h in 0..heads {
            for i in 0..d / 2 {
                for j in 0..2 {
                    out[h * d + 2 * i + j] = rows[h * d + j * d / 2 + i];
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        let hf: Vec<u32> = (0..24).collect();
        let gguf = llama_cpp_permute(&hf, 3);
        // Head 0 of D = 8: GGUF rows interleave the two halves.
        assert_eq!(&gguf[..8], &[0, 4, 1, 5, 2, 6, 3, 7]);
        assert_eq!(unpermute_rows(&gguf, 3, 1), hf);
        // Rows of several elements move whole.
        let wide: Vec<u32> = gguf.iter().flat_map(|&r| [r * 10, r * 10 + 1]).collect();
        let expected: Vec<u32> = hf.iter().flat_map(|&r| [r * 10, r * 10 + 1]).collect();
        assert_eq!(unpermute_rows(&wide, 3, 2), expected);
    }

    fn llama3_divisors(n: usize, theta: f64, factor: f64, low: f64, high: f64, l: f64) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let freq = 1.0 / theta.powf(2.0 * i as f64 / (2 * n) as f64);
                llama3_divisor(freq / (2.0 * std::f64::consts::PI), factor, low, high, l) as f32
            })
            .collect()
    }

    #[test]
    fn llama3_scaling_is_recovered_from_rope_freqs() {
        // Llama 3.1 8B: theta 500000, head_dim 128, factor 8, low 1, high 4, original 8192.
        let div = llama3_divisors(64, 500_000.0, 8.0, 1.0, 4.0, 8192.0);
        let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } = fit_llama3_scaling(&div, 500_000.0, 8192).unwrap()
        else {
            panic!("expected llama3 scaling")
        };
        assert_eq!(factor, 8.0);
        assert_eq!(original_max_position_embeddings, 8192);
        assert!((low_freq_factor - 1.0).abs() < 1e-3, "{low_freq_factor}");
        assert!((high_freq_factor - 4.0).abs() < 1e-3, "{high_freq_factor}");
        // Llama 3.2: factor 32.
        let div = llama3_divisors(32, 500_000.0, 32.0, 1.0, 4.0, 8192.0);
        assert!(
            matches!(fit_llama3_scaling(&div, 500_000.0, 8192).unwrap(), RopeScaling::Llama3 { factor, .. } if factor == 32.0)
        );
    }

    #[test]
    fn rope_freqs_that_are_not_llama3_are_rejected() {
        assert_eq!(
            fit_llama3_scaling(&[1.0; 8], 10_000.0, 8192).unwrap(),
            RopeScaling::None
        );
        let mut div = llama3_divisors(64, 500_000.0, 8.0, 1.0, 4.0, 8192.0);
        div[40] = 3.0;
        assert!(fit_llama3_scaling(&div, 500_000.0, 8192).is_err());
        assert!(fit_llama3_scaling(&[2.0, 1.0, 2.0, 1.0], 10_000.0, 8192).is_err());
        assert!(fit_llama3_scaling(&[f32::NAN, 1.0], 10_000.0, 8192).is_err());
    }
}
