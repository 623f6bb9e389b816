//! Quantised HF checkpoints: compressed-tensors `pack-quantized`, `int-quantized`,
//! `nvfp4-pack-quantized` and `mxfp4-pack-quantized`, GPTQ, AWQ GEMM, and OpenAI's MXFP4
//! (`quant_method: mxfp4`, gpt-oss's experts).
//!
//! Each integer matrix is read into its integer codes and group scales and served by the `int`
//! form as they are; FP4 matrices are repacked (bits moved, nothing rounded) into ggml's MXFP4 and
//! NVFP4 blocks and served by the `ggml` form, NVFP4's per-tensor global scale applied to the
//! product's output (as llama.cpp's converter keeps it beside the blocks). None is dequantised to
//! a float copy. Every layout is read as its reference
//! packer writes it (docs/formats.md says which and where); a layout or tensor this does not
//! read exactly is an error naming the tensor and the field.

use crate::error::{ModelError, Result};
use crate::forms::{Form, GroupScales, Source, Values};
use crate::weights::{HostTensor, Linear, Wrap, Wrapped};
use entrollm_codec::Payload;
use entrollm_format::{Dtype, TensorView};
use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::Arc;

/// The tensors of a checkpoint, by name.
pub trait Tensors {
    fn get(&self, name: &str) -> Option<TensorView<'_>>;
}

impl Tensors for entrollm_format::Checkpoint {
    fn get(&self, name: &str) -> Option<TensorView<'_>> {
        entrollm_format::Checkpoint::get(self, name)
    }
}

/// Tensors held in memory by name (dtype, shape, bytes): a container's decoded ones.
#[derive(Default)]
pub struct OwnedTensors(pub std::collections::BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>);

impl Tensors for OwnedTensors {
    fn get(&self, name: &str) -> Option<TensorView<'_>> {
        self.0
            .get_key_value(name)
            .map(|(n, (dtype, shape, bytes))| TensorView {
                name: n,
                dtype: *dtype,
                shape,
                bytes,
            })
    }
}

impl Tensors for entrollm_format::SafetensorsFile {
    fn get(&self, name: &str) -> Option<TensorView<'_>> {
        entrollm_format::SafetensorsFile::get(self, name)
    }
}

/// compressed-tensors' weight arguments of one config group.
#[derive(Clone, Debug, PartialEq)]
pub enum WeightArgs {
    /// Integer codes: `packed` (`pack-quantized`: bit fields in int32 words) or one a byte
    /// (`int-quantized`: int8 values).
    Int { args: IntArgs, packed: bool },
    /// FP4 E2M1 codes two a byte: `nvfp4-pack-quantized` (FP8 E4M3 scales per 16 and a global
    /// scale) or `mxfp4-pack-quantized` (E8M0 scales per 32).
    Fp4 { nv: bool },
}

/// Integer weight arguments.
#[derive(Clone, Debug, PartialEq)]
pub struct IntArgs {
    bits: u32,
    symmetric: bool,
    /// Columns per group; `None`: one group per row (strategy `channel`).
    group: Option<usize>,
}

/// How a checkpoint's integer matrices are packed, from `quantization_config`.
#[derive(Clone, Debug, PartialEq)]
pub enum Scheme {
    /// compressed-tensors: weight arguments by target.
    Compressed {
        groups: Vec<(Vec<String>, WeightArgs)>,
    },
    /// GPTQ; `v1`: qzeros stored minus one (`checkpoint_format: "gptq"`).
    Gptq {
        bits: u32,
        group: Option<usize>,
        v1: bool,
    },
    /// AWQ GEMM (4-bit).
    Awq { group: usize },
    /// OpenAI's MXFP4 (gpt-oss): a tensor `X` stored as `X_blocks` and `X_scales`
    /// ([`read_openai_mxfp4`]); the modules it leaves out are plain tensors.
    Mxfp4,
}

fn cfg_err(field: &str, msg: impl std::fmt::Display) -> ModelError {
    ModelError::Unsupported(format!("config quantization_config.{field}: {msg}"))
}

fn get_usize(o: &serde_json::Map<String, serde_json::Value>, field: &str) -> Result<Option<i64>> {
    match o.get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| cfg_err(field, format!("{v} is not an integer"))),
    }
}

fn get_bool(o: &serde_json::Map<String, serde_json::Value>, field: &str) -> Result<Option<bool>> {
    match o.get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| cfg_err(field, format!("{v} is not true or false"))),
    }
}

fn get_str<'a>(
    o: &'a serde_json::Map<String, serde_json::Value>,
    field: &str,
) -> Result<Option<&'a str>> {
    match o.get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_str()
            .map(Some)
            .ok_or_else(|| cfg_err(field, format!("{v} is not a string"))),
    }
}

/// A group size: positive, or −1 (one group per row: `None`).
fn group_size(field: &str, v: Option<i64>) -> Result<Option<usize>> {
    match v {
        None | Some(-1) => Ok(None),
        Some(g) if g > 0 => Ok(Some(g as usize)),
        Some(g) => Err(cfg_err(field, format!("{g} is not a group size"))),
    }
}

impl Scheme {
    /// The integer scheme of config.json `text`; `None` without one (no `quantization_config`,
    /// or compressed-tensors `float-quantized`/`dense`, whose tensors are read by their dtype).
    pub fn from_config_json(text: &str) -> Result<Option<Scheme>> {
        let json: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| ModelError::Config(format!("config.json is not valid JSON: {e}")))?;
        let Some(q) = json.get("quantization_config") else {
            return Ok(None);
        };
        let q = q
            .as_object()
            .ok_or_else(|| cfg_err("", "not a JSON object"))?;
        match get_str(q, "quant_method")? {
            Some("compressed-tensors") => compressed(q),
            Some("gptq") => gptq(q).map(Some),
            Some("awq") => awq(q).map(Some),
            Some("fp8") => Ok(None),
            Some("mxfp4") => Ok(Some(Scheme::Mxfp4)),
            Some(m) => Err(cfg_err(
                "quant_method",
                format!("'{m}' is not read (read: compressed-tensors, gptq, awq, mxfp4)"),
            )),
            None => Err(cfg_err("quant_method", "missing")),
        }
    }

    /// The tensors beside `name` (or `name` itself) a checkpoint packed by this scheme holds it
    /// in, where they are not under `{name without .weight}.`: OpenAI MXFP4's `_blocks` and
    /// `_scales`.
    pub fn parts_beside(&self, name: &str) -> Vec<String> {
        match self {
            Scheme::Mxfp4 => vec![format!("{name}_blocks"), format!("{name}_scales")],
            _ => Vec::new(),
        }
    }

    /// The matrix `name` (an HF `….weight`; OpenAI MXFP4: any tensor name) where the checkpoint
    /// holds it packed by this scheme; `None` where it holds no packed tensors for it.
    pub fn matrix(&self, t: &dyn Tensors, name: &str) -> Result<Option<HostTensor>> {
        if let Scheme::Mxfp4 = self {
            if t.get(&format!("{name}_blocks")).is_none() {
                return Ok(None);
            }
            return read_openai_mxfp4(t, name).map(|m| Some(HostTensor::Linear(m)));
        }
        let Some(prefix) = name.strip_suffix(".weight") else {
            return Ok(None);
        };
        let m = match self {
            Scheme::Compressed { groups } => {
                let packed = t.get(&format!("{prefix}.weight_packed")).is_some();
                let int8 = t
                    .get(name)
                    .is_some_and(|v| v.dtype == Dtype::I8 && v.shape.len() == 2);
                if !packed && !int8 {
                    return Ok(None);
                }
                match (compressed_args(groups, prefix)?, packed) {
                    (WeightArgs::Int { args, packed: true }, true) => {
                        read_compressed(t, prefix, args)?
                    }
                    (
                        WeightArgs::Int {
                            args,
                            packed: false,
                        },
                        false,
                    ) => read_int_quantized(t, prefix, args)?,
                    (WeightArgs::Fp4 { nv }, true) => read_fp4(t, prefix, *nv)?,
                    (_, true) => {
                        return Err(ModelError::tensor(
                            format!("{prefix}.weight_packed"),
                            "packed, but the config's format for this module is int-quantized",
                        ))
                    }
                    (_, false) => {
                        return Err(ModelError::tensor(
                            name,
                            "int8 values, but the config's format for this module is packed",
                        ))
                    }
                }
            }
            Scheme::Gptq { bits, group, v1 } => {
                if t.get(&format!("{prefix}.qweight")).is_none() {
                    return Ok(None);
                }
                read_gptq(t, prefix, *bits, *group, *v1)?
            }
            Scheme::Awq { group } => {
                if t.get(&format!("{prefix}.qweight")).is_none() {
                    return Ok(None);
                }
                read_awq(t, prefix, *group)?
            }
            Scheme::Mxfp4 => unreachable!("read above"),
        };
        Ok(Some(HostTensor::Linear(m)))
    }
}

fn compressed(q: &serde_json::Map<String, serde_json::Value>) -> Result<Option<Scheme>> {
    let top = get_str(q, "format")?;
    let groups = match q.get("config_groups") {
        Some(serde_json::Value::Object(g)) => g,
        _ => return Err(cfg_err("config_groups", "missing or not an object")),
    };
    if let Some(ig) = q.get("ignore") {
        let names = ig.as_array().filter(|a| a.iter().all(|v| v.is_string()));
        if names.is_none() {
            return Err(cfg_err("ignore", "not a list of names"));
        }
    }
    let mut out = Vec::new();
    let mut floats = 0;
    for (gname, g) in groups {
        let field = |f: &str| format!("config_groups.{gname}.{f}");
        let g = g
            .as_object()
            .ok_or_else(|| cfg_err(&field(""), "not an object"))?;
        let format = get_str(g, "format")?.or(top);
        let Some(w) = g.get("weights").and_then(|w| w.as_object()) else {
            return Err(cfg_err(&field("weights"), "missing or not an object"));
        };
        let ty = get_str(w, "type")?.unwrap_or("int");
        let wf = |f: &str| field(&format!("weights.{f}"));
        let fp4 = match (format, ty) {
            (Some("nvfp4-pack-quantized"), "float") => Some((true, 16)),
            (Some("mxfp4-pack-quantized"), "float") => Some((false, 32)),
            _ => None,
        };
        if let Some((nv, group)) = fp4 {
            if get_usize(w, "num_bits")? != Some(4) {
                return Err(cfg_err(&wf("num_bits"), "FP4 formats have 4 bits"));
            }
            if get_usize(w, "group_size")? != Some(group) {
                return Err(cfg_err(
                    &wf("group_size"),
                    format!("{} has groups of {group}", format.unwrap_or("")),
                ));
            }
            if !get_bool(w, "symmetric")?.unwrap_or(true) {
                return Err(cfg_err(&wf("symmetric"), "asymmetric FP4 is not read"));
            }
            out.push((targets(g, &field)?, WeightArgs::Fp4 { nv }));
            continue;
        }
        let packed = match (format, ty) {
            (Some("float-quantized") | Some("dense") | Some("naive-quantized"), _)
            | (None, "float") => {
                floats += 1;
                continue;
            }
            (Some("pack-quantized"), "int") => true,
            (Some("int-quantized"), "int") => false,
            (Some(f), _) => {
                let at = match g.contains_key("format") {
                    true => field("format"),
                    false => "format".to_string(),
                };
                return Err(cfg_err(
                    &at,
                    format!(
                        "'{f}' is not read (read: pack-quantized, int-quantized, \
                         nvfp4-pack-quantized, mxfp4-pack-quantized; float-quantized FP8)"
                    ),
                ));
            }
            (None, _) => return Err(cfg_err("format", "missing")),
        };
        let bits = match get_usize(w, "num_bits")? {
            Some(b @ 2..=8) => b as u32,
            Some(b) => {
                return Err(cfg_err(
                    &wf("num_bits"),
                    format!("{b} bits are not read (2 to 8)"),
                ))
            }
            None => return Err(cfg_err(&wf("num_bits"), "missing")),
        };
        let symmetric = get_bool(w, "symmetric")?.unwrap_or(true);
        let group = match get_str(w, "strategy")? {
            Some("group") => match group_size(&wf("group_size"), get_usize(w, "group_size")?)? {
                Some(g) => Some(g),
                None => {
                    return Err(cfg_err(
                        &wf("group_size"),
                        "strategy group needs a group size",
                    ))
                }
            },
            Some("channel") => None,
            Some(s) => {
                return Err(cfg_err(
                    &wf("strategy"),
                    format!("'{s}' is not read (read: group, channel)"),
                ))
            }
            None => return Err(cfg_err(&wf("strategy"), "missing")),
        };
        if get_bool(w, "dynamic")?.unwrap_or(false) {
            return Err(cfg_err(
                &wf("dynamic"),
                "dynamic weight quantisation is not read",
            ));
        }
        out.push((
            targets(g, &field)?,
            WeightArgs::Int {
                args: IntArgs {
                    bits,
                    symmetric,
                    group,
                },
                packed,
            },
        ));
    }
    if out.is_empty() && floats > 0 {
        return Ok(None);
    }
    Ok(Some(Scheme::Compressed { groups: out }))
}

/// A config group's `targets`.
fn targets(
    g: &serde_json::Map<String, serde_json::Value>,
    field: &dyn Fn(&str) -> String,
) -> Result<Vec<String>> {
    match g.get("targets") {
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| cfg_err(&field("targets"), "not a list of names")),
        _ => Err(cfg_err(&field("targets"), "missing or not a list")),
    }
}

/// Whether compressed-tensors target `t` names module `m`: `Linear` (every linear layer), the
/// module's name, or `re:` a pattern, read only where it is `.*` and literal text (a suffix).
fn target_matches(t: &str, m: &str) -> Result<bool> {
    if t == "Linear" || t == m {
        return Ok(true);
    }
    let Some(re) = t.strip_prefix("re:") else {
        return Ok(false);
    };
    let lit = re.strip_prefix(".*").unwrap_or(re).trim_end_matches('$');
    if lit.chars().any(|c| "\\^$.|?*+()[]{}".contains(c)) {
        return Err(cfg_err(
            "config_groups.targets",
            format!("pattern '{t}' is not read (read: Linear, module names, re:.*suffix)"),
        ));
    }
    Ok(match re.starts_with(".*") {
        true => m.ends_with(lit),
        false => m == lit,
    })
}

/// The weight arguments that apply to module `prefix`: the one scheme where every group has
/// the same, else the group whose targets match it.
fn compressed_args<'a>(
    groups: &'a [(Vec<String>, WeightArgs)],
    prefix: &str,
) -> Result<&'a WeightArgs> {
    if let Some((_, first)) = groups.first() {
        if groups.iter().all(|(_, a)| a == first) {
            return Ok(first);
        }
    }
    for (targets, args) in groups {
        for t in targets {
            if target_matches(t, prefix)? {
                return Ok(args);
            }
        }
    }
    Err(ModelError::tensor(
        format!("{prefix}.weight_packed"),
        "no quantization_config.config_groups entry targets this module",
    ))
}

/// An int32 tensor's words, checked to be of `shape`.
fn words(t: &dyn Tensors, name: &str, shape: &[usize]) -> Result<Vec<u32>> {
    let v = need(t, name)?;
    if v.dtype != Dtype::I32 {
        return Err(ModelError::tensor(
            name,
            format!("dtype {} (read: I32)", v.dtype.name()),
        ));
    }
    check_shape(name, v.shape, shape)?;
    Ok(v.bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

fn need<'a>(t: &'a dyn Tensors, name: &str) -> Result<TensorView<'a>> {
    t.get(name)
        .ok_or_else(|| ModelError::tensor(name, "missing: the packed matrix needs it"))
}

fn check_shape(name: &str, got: &[usize], want: &[usize]) -> Result<()> {
    match got == want {
        true => Ok(()),
        false => Err(ModelError::tensor(
            name,
            format!("shape {got:?}, expected {want:?}"),
        )),
    }
}

/// A float tensor (F16, BF16, F32) of `shape` as f32.
fn floats(t: &dyn Tensors, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let v = need(t, name)?;
    check_shape(name, v.shape, shape)?;
    let u16s = || {
        v.bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    let out: Vec<f32> = match v.dtype {
        Dtype::F16 => u16s().map(|b| half::f16::from_bits(b).to_f32()).collect(),
        Dtype::BF16 => u16s().map(|b| half::bf16::from_bits(b).to_f32()).collect(),
        Dtype::F32 => v
            .bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        d => {
            return Err(ModelError::tensor(
                name,
                format!("dtype {} (read: F16, BF16, F32)", d.name()),
            ))
        }
    };
    if let Some(i) = out.iter().position(|s| !s.is_finite()) {
        return Err(ModelError::tensor(
            name,
            format!("element {i} is not finite"),
        ));
    }
    Ok(out)
}

/// The `bits`-bit field `i` of a little-endian stream of 32-bit words (`word(k)`): field `i`
/// starts at bit `i·bits`, and a field may straddle two words (3 bits), as every packer here
/// writes them.
fn field(word: impl Fn(usize) -> u32, i: usize, bits: u32) -> u8 {
    let bit = i * bits as usize;
    let (w, sh) = (bit / 32, (bit % 32) as u32);
    let mut v = word(w) >> sh;
    if sh + bits > 32 {
        v |= word(w + 1) << (32 - sh);
    }
    (v & ((1 << bits) - 1)) as u8
}

/// A `rows × cols` integer matrix whose weight (r, c) is `s·(q − z)` for its group's scale `s`
/// and zero `z` (in code units), `perm` the original column of each stored column, if any.
struct Unpacked {
    rows: usize,
    cols: usize,
    bits: u32,
    codes: Vec<u8>,
    /// Columns per group (`cols`: one per row).
    group: usize,
    /// Row-major, `rows × cols.div_ceil(group)`.
    scales: Vec<f32>,
    zeros: Vec<i32>,
    perm: Option<Vec<u32>>,
}

impl Unpacked {
    /// The `int` matrix: zeros alike for the whole matrix become the form's offset (exact as
    /// `s·(q − z)` is); otherwise mins `−s·z`, whose sum with `s·q` is that same value exactly
    /// where `s` has at most 16 significant bits (F16 and BF16 scales).
    fn into_linear(self, name: &str) -> Result<Arc<dyn Linear>> {
        let uniform = self.zeros.iter().all(|&z| z == self.zeros[0]);
        let (offset, mins) = match uniform {
            true => (self.zeros[0] as f32, None),
            false => (
                0.0,
                Some(
                    self.scales
                        .iter()
                        .zip(&self.zeros)
                        .map(|(&s, &z)| -(s * z as f32))
                        .collect(),
                ),
            ),
        };
        let groups = GroupScales {
            group: self.group,
            scales: self.scales,
            mins,
            offset,
            signed: false,
        };
        let values = Values::Int {
            payload: Payload::Int(self.bits as u8),
            codes: self.codes,
            groups,
        };
        let src = Source::new(self.rows, self.cols, values)
            .map_err(|e| ModelError::tensor(name, e.to_string()))?;
        let m = crate::forms::int::INT
            .encode(&src, "")
            .map_err(|e| ModelError::tensor(name, e.to_string()))?;
        Ok(match self.perm {
            Some(perm) => Arc::new(ColumnOrdered::new(name, m, perm)?),
            None => m,
        })
    }
}

/// A compressed-tensors matrix's zero points in code units, `n` of them: `2^(bits−1)` each where
/// its weights are symmetric (and it has none), else `read` of `….weight_zero_point`.
fn zero_points(
    t: &dyn Tensors,
    prefix: &str,
    args: &IntArgs,
    n: usize,
    read: impl FnOnce(&str) -> Result<Vec<i32>>,
) -> Result<Vec<i32>> {
    let zp_name = format!("{prefix}.weight_zero_point");
    match (args.symmetric, t.get(&zp_name).is_some()) {
        (true, false) => Ok(vec![1i32 << (args.bits - 1); n]),
        (true, true) => Err(ModelError::tensor(
            &zp_name,
            "present, but the config's weights are symmetric",
        )),
        (false, false) => Err(ModelError::tensor(
            &zp_name,
            "missing: asymmetric weights need their zero points",
        )),
        (false, true) => read(&zp_name),
    }
}

/// compressed-tensors `pack-quantized` (compressors/pack_quantized): `weight_packed` int32
/// `[out, ⌈in·bits/32⌉]`, codes along each row stored `q + 2^(bits−1)`; `weight_scale`
/// `[out, groups]`; `weight_zero_point` (asymmetric) int32 `[⌈out·bits/32⌉, groups]` packed the
/// same way down the columns; `weight_shape` `[out, in]`. Dequantised as `(q − z)·s`.
fn read_compressed(t: &dyn Tensors, prefix: &str, args: &IntArgs) -> Result<Arc<dyn Linear>> {
    let bits = args.bits;
    let shape_name = format!("{prefix}.weight_shape");
    let sv = need(t, &shape_name)?;
    let dims: Vec<i64> = match sv.dtype {
        Dtype::I64 => sv
            .bytes
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        Dtype::I32 => sv
            .bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64)
            .collect(),
        d => {
            return Err(ModelError::tensor(
                &shape_name,
                format!("dtype {} (read: I64, I32)", d.name()),
            ))
        }
    };
    let (rows, cols) = match dims[..] {
        [r, c] if r > 0 && c > 0 => (r as usize, c as usize),
        _ => {
            return Err(ModelError::tensor(
                &shape_name,
                format!("{dims:?} is not the shape of a matrix"),
            ))
        }
    };
    if t.get(&format!("{prefix}.weight_g_idx")).is_some() {
        return Err(ModelError::tensor(
            format!("{prefix}.weight_g_idx"),
            "activation-ordered groups of compressed-tensors are not read",
        ));
    }
    let packed_name = format!("{prefix}.weight_packed");
    let per_row = (cols * bits as usize).div_ceil(32);
    let packed = words(t, &packed_name, &[rows, per_row])?;
    let mut codes = vec![0u8; rows * cols];
    for (r, row) in codes.chunks_exact_mut(cols).enumerate() {
        let w = &packed[r * per_row..(r + 1) * per_row];
        for (c, q) in row.iter_mut().enumerate() {
            *q = field(|k| w[k], c, bits);
        }
    }
    let codes = Codes {
        name: &packed_name,
        rows,
        cols,
        codes,
    };
    codes.grouped(t, prefix, args, |zp_name, n_groups| {
        let zp = words(t, zp_name, &[(rows * bits as usize).div_ceil(32), n_groups])?;
        let mut z = vec![0i32; rows * n_groups];
        for g in 0..n_groups {
            for (r, z) in z.iter_mut().skip(g).step_by(n_groups).enumerate() {
                // Stored `z + 2^(bits−1)` like the codes: the sum is the zero in code units.
                *z = field(|k| zp[k * n_groups + g], r, bits) as i32;
            }
        }
        Ok(z)
    })
}

/// A compressed-tensors matrix's codes (`name` names it in errors), before its groups are read.
struct Codes<'a> {
    name: &'a str,
    rows: usize,
    cols: usize,
    codes: Vec<u8>,
}

impl Codes<'_> {
    /// The matrix with its `….weight_scale` `[rows, groups]` and zero points
    /// ([`zero_points`]; `read(name, groups)` reads the stored ones), as both compressed-tensors
    /// integer readers dequantise it: `(q − z)·s`.
    fn grouped(
        self,
        t: &dyn Tensors,
        prefix: &str,
        args: &IntArgs,
        read: impl FnOnce(&str, usize) -> Result<Vec<i32>>,
    ) -> Result<Arc<dyn Linear>> {
        let (rows, cols) = (self.rows, self.cols);
        let group = args.group.unwrap_or(cols);
        let n_groups = cols.div_ceil(group);
        let scales = floats(t, &format!("{prefix}.weight_scale"), &[rows, n_groups])?;
        let zeros = zero_points(t, prefix, args, rows * n_groups, |zp| read(zp, n_groups))?;
        Unpacked {
            rows,
            cols,
            bits: args.bits,
            codes: self.codes,
            group,
            scales,
            zeros,
            perm: None,
        }
        .into_linear(self.name)
    }
}

/// compressed-tensors `int-quantized` (compressors/naive_quantized): `weight` int8 `[out, in]`,
/// each value `q` in `[−2^(bits−1), 2^(bits−1))`; `weight_scale` `[out, groups]`;
/// `weight_zero_point` (asymmetric) int8 `[out, groups]`. Dequantised as `(q − z)·s`.
fn read_int_quantized(t: &dyn Tensors, prefix: &str, args: &IntArgs) -> Result<Arc<dyn Linear>> {
    let bits = args.bits;
    let name = format!("{prefix}.weight");
    let v = need(t, &name)?;
    let (rows, cols) = match v.shape[..] {
        [r, c] if r > 0 && c > 0 => (r, c),
        _ => {
            return Err(ModelError::tensor(
                &name,
                format!("shape {:?} is not a matrix", v.shape),
            ))
        }
    };
    let half = 1i32 << (bits - 1);
    let in_range = |what: &str, i: usize, q: i32| -> Result<u8> {
        match (-half..half).contains(&q) {
            true => Ok((q + half) as u8),
            false => Err(ModelError::tensor(
                what,
                format!(
                    "element {i} is {q}, outside the {bits}-bit range [{}, {}]",
                    -half,
                    half - 1
                ),
            )),
        }
    };
    let codes = v
        .bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| in_range(&name, i, b as i8 as i32))
        .collect::<Result<Vec<u8>>>()?;
    let codes = Codes {
        name: &name,
        rows,
        cols,
        codes,
    };
    codes.grouped(t, prefix, args, |zp_name, n_groups| {
        let z = need(t, zp_name)?;
        if z.dtype != Dtype::I8 {
            return Err(ModelError::tensor(
                zp_name,
                format!("dtype {} (read: I8)", z.dtype.name()),
            ));
        }
        check_shape(zp_name, z.shape, &[rows, n_groups])?;
        z.bytes
            .iter()
            .enumerate()
            .map(|(i, &b)| in_range(zp_name, i, b as i8 as i32).map(i32::from))
            .collect()
    })
}

/// compressed-tensors `nvfp4-pack-quantized` and `mxfp4-pack-quantized` (compressors/nvfp4,
/// mxfp4): `weight_packed` uint8 `[out, in/2]`, element 2i in the low nibble of byte i and 2i+1
/// in the high one, each an E2M1 code (bit 3 the sign, bits 0–2 the magnitude's index: the order
/// of ggml's `kvalues_mxfp4`). NVFP4: `weight_scale` FP8 E4M3 `[out, in/16]` and
/// `weight_global_scale` F32 `[1]`, dequantised as `fp4·(s/global)`; MXFP4: `weight_scale` uint8
/// E8M0 `[out, in/32]`, dequantised as `fp4·2^(e−127)`. Repacked into ggml's blocks as llama.cpp's
/// converter repacks them (`repack_mxfp4_blocks`, `_nvfp4_pack`); NVFP4's `1/global` scales the
/// product's rows.
fn read_fp4(t: &dyn Tensors, prefix: &str, nv: bool) -> Result<Arc<dyn Linear>> {
    use crate::forms::ggml::{BlockBytes, GGML};
    use crate::gguf::GgmlType;
    let pname = format!("{prefix}.weight_packed");
    let p = need(t, &pname)?;
    if p.dtype != Dtype::U8 {
        return Err(ModelError::tensor(
            &pname,
            format!("dtype {} (read: U8)", p.dtype.name()),
        ));
    }
    let (rows, half_cols) = match p.shape[..] {
        [r, h] if r > 0 && h > 0 => (r, h),
        _ => {
            return Err(ModelError::tensor(
                &pname,
                format!("shape {:?} is not a matrix", p.shape),
            ))
        }
    };
    let cols = 2 * half_cols;
    let (ty, block, group) = match nv {
        true => (GgmlType::NVFP4, 64, 16),
        false => (GgmlType::MXFP4, 32, 32),
    };
    if !cols.is_multiple_of(block) {
        return Err(ModelError::tensor(
            &pname,
            format!("{cols} columns: ggml's {ty} blocks hold {block} (not read otherwise)"),
        ));
    }
    if let Some(shape) = t.get(&format!("{prefix}.weight_shape")) {
        let dims: Vec<i64> = match shape.dtype {
            Dtype::I64 => shape
                .bytes
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            _ => shape
                .bytes
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64)
                .collect(),
        };
        if dims != [rows as i64, cols as i64] {
            return Err(ModelError::tensor(
                format!("{prefix}.weight_shape"),
                format!("{dims:?}, but the packed codes are [{rows}, {cols}]"),
            ));
        }
    }
    let sname = format!("{prefix}.weight_scale");
    let sv = need(t, &sname)?;
    let want = if nv { Dtype::F8E4M3 } else { Dtype::U8 };
    if sv.dtype != want {
        return Err(ModelError::tensor(
            &sname,
            format!("dtype {} (read: {})", sv.dtype.name(), want.name()),
        ));
    }
    check_shape(&sname, sv.shape, &[rows, cols / group])?;
    // ggml reads NVFP4's scales unsigned and E8M0's 255 (NaN) as a number: refuse both.
    let bad = |b: u8| match nv {
        true => b & 0x80 != 0 || b == 0x7F,
        false => b == 0xFF,
    };
    if let Some(i) = sv.bytes.iter().position(|&b| bad(b)) {
        return Err(ModelError::tensor(
            &sname,
            format!(
                "element {i} (0x{:02x}) is {}",
                sv.bytes[i],
                if nv { "negative or NaN" } else { "NaN" }
            ),
        ));
    }
    let code = |r: usize, c: usize| {
        let b = p.bytes[r * half_cols + c / 2];
        if c.is_multiple_of(2) {
            b & 15
        } else {
            b >> 4
        }
    };
    let per_row = cols / group;
    let mut out = Vec::with_capacity(rows * cols / block * ty.block_layout().1);
    for r in 0..rows {
        for c0 in (0..cols).step_by(block) {
            match nv {
                true => {
                    out.extend_from_slice(&sv.bytes[r * per_row + c0 / 16..][..4]);
                    for c in (c0..c0 + 64).step_by(16) {
                        out.extend((0..8).map(|j| code(r, c + j) | code(r, c + j + 8) << 4));
                    }
                }
                false => {
                    out.push(sv.bytes[r * per_row + c0 / 32]);
                    out.extend((0..16).map(|j| code(r, c0 + j) | code(r, c0 + j + 16) << 4));
                }
            }
        }
    }
    let src = Source::new(
        rows,
        cols,
        Values::Ggml {
            ty,
            bytes: BlockBytes::from_vec(out),
        },
    )
    .map_err(|e| ModelError::tensor(&pname, e.to_string()))?;
    let m = GGML
        .encode(&src, "")
        .map_err(|e| ModelError::tensor(&pname, e.to_string()))?;
    if !nv {
        return Ok(m);
    }
    let gname = format!("{prefix}.weight_global_scale");
    let g = need(t, &gname)?;
    if g.dtype != Dtype::F32 || g.bytes.len() != 4 {
        return Err(ModelError::tensor(
            &gname,
            format!(
                "dtype {} shape {:?} (read: one F32)",
                g.dtype.name(),
                g.shape
            ),
        ));
    }
    let global = f32::from_le_bytes(g.bytes.try_into().unwrap());
    if !(global.is_finite() && global > 0.0) {
        return Err(ModelError::tensor(
            &gname,
            format!("{global} is not a positive number"),
        ));
    }
    Ok(Arc::new(crate::weights::RowScaled::new(
        &gname,
        m,
        vec![1.0 / global; rows],
    )?))
}

/// OpenAI's MXFP4 (transformers' integrations/mxfp4.py): `{name}_blocks` uint8
/// `[..., rows, cols/32, 16]`, element 2j of a 32-element block in the low nibble of byte j and
/// 2j+1 in the high one, each an E2M1 code (the order of ggml's `kvalues_mxfp4`), and
/// `{name}_scales` uint8 E8M0 `[..., rows, cols/32]` (value `fp4·2^(e−127)`); the leading axes
/// (gpt-oss's experts) stacked into rows, which are the output features. Repacked (bits moved,
/// nothing rounded) into ggml's MXFP4 blocks as llama.cpp's converter repacks them
/// (`GptOssModel.repack_mxfp4`), one matrix `[Π leading · rows, cols]` served by the `ggml` form.
fn read_openai_mxfp4(t: &dyn Tensors, name: &str) -> Result<Arc<dyn Linear>> {
    use crate::forms::ggml::{BlockBytes, GGML};
    use crate::gguf::GgmlType;
    let bname = format!("{name}_blocks");
    let sname = format!("{name}_scales");
    let b = need(t, &bname)?;
    let sv = need(t, &sname)?;
    for (n, v) in [(&bname, &b), (&sname, &sv)] {
        if v.dtype != Dtype::U8 {
            return Err(ModelError::tensor(
                n,
                format!("dtype {} (read: U8)", v.dtype.name()),
            ));
        }
    }
    let (lead, groups) = match b.shape[..] {
        [.., g, 16] if b.shape.len() >= 3 && g > 0 => (&b.shape[..b.shape.len() - 2], g),
        _ => {
            return Err(ModelError::tensor(
                &bname,
                format!("shape {:?} is not [..., rows, blocks, 16]", b.shape),
            ))
        }
    };
    let rows: usize = lead.iter().product();
    if rows == 0 {
        return Err(ModelError::tensor(&bname, "no rows"));
    }
    check_shape(&sname, sv.shape, &[lead, &[groups]].concat())?;
    if let Some(i) = sv.bytes.iter().position(|&e| e == 0xFF) {
        return Err(ModelError::tensor(
            &sname,
            format!("element {i} (0xff) is NaN"),
        ));
    }
    let mut out = Vec::with_capacity(rows * groups * 17);
    for (block, &scale) in b.bytes.chunks_exact(16).zip(sv.bytes) {
        let code = |k: usize| match k % 2 {
            0 => block[k / 2] & 15,
            _ => block[k / 2] >> 4,
        };
        out.push(scale);
        out.extend((0..16).map(|j| code(j) | code(j + 16) << 4));
    }
    let src = Source::new(
        rows,
        groups * 32,
        Values::Ggml {
            ty: GgmlType::MXFP4,
            bytes: BlockBytes::from_vec(out),
        },
    )
    .map_err(|e| ModelError::tensor(&bname, e.to_string()))?;
    GGML.encode(&src, "")
        .map_err(|e| ModelError::tensor(&bname, e.to_string()))
}

fn gptq(q: &serde_json::Map<String, serde_json::Value>) -> Result<Scheme> {
    let bits = match get_usize(q, "bits")? {
        Some(b @ (2 | 3 | 4 | 8)) => b as u32,
        Some(b) => {
            return Err(cfg_err(
                "bits",
                format!("{b} bits are not read (2, 3, 4, 8)"),
            ))
        }
        None => return Err(cfg_err("bits", "missing")),
    };
    let group = group_size("group_size", get_usize(q, "group_size")?)?;
    // `desc_act` and `sym` need nothing of their own: g_idx and qzeros say what they did.
    get_bool(q, "desc_act")?;
    get_bool(q, "sym")?;
    if let Some(p) = get_str(q, "pack_dtype")? {
        if p != "int32" {
            return Err(cfg_err(
                "pack_dtype",
                format!("'{p}' is not read (read: int32)"),
            ));
        }
    }
    let (field, format) = match get_str(q, "checkpoint_format")? {
        Some(f) => ("checkpoint_format", Some(f)),
        None => ("format", get_str(q, "format")?),
    };
    let v1 = match format {
        None | Some("gptq") => true,
        Some("gptq_v2") => false,
        Some(f) => {
            return Err(cfg_err(
                field,
                format!("'{f}' is not read (read: gptq, gptq_v2)"),
            ))
        }
    };
    Ok(Scheme::Gptq { bits, group, v1 })
}

/// The v2 qzeros word of a v1 one, for 2, 4 and 8 bits: gptqmodel writes v1 by subtracting
/// one from every field of the word at once (`qzeros -= 0b…0001_0001`, borrows included) and
/// reads it back by the same word-wide addition, which this is. Three-bit fields straddle words,
/// so gptqmodel shifts those one field at a time instead (`field_v1_to_v2`).
fn word_v1_to_v2(w: u32, bits: u32) -> u32 {
    let ones = match bits {
        2 => 0x5555_5555,
        4 => 0x1111_1111,
        8 => 0x0101_0101,
        _ => 0,
    };
    w.wrapping_add(ones)
}

fn field_v1_to_v2(z: u8, bits: u32) -> u8 {
    match bits {
        3 => (z + 1) & 7,
        _ => z,
    }
}

/// GPTQ (gptqmodel's `pack_original`, AutoGPTQ's layout): `qweight` int32 `[⌈in·bits/32⌉, out]`,
/// column `o`'s codes for inputs 0, 1, … in one little-endian bit stream down the rows;
/// `qzeros` int32 `[groups, ⌈out·bits/32⌉]` the same along each row; `scales` `[groups, out]`;
/// `g_idx` int32 `[in]`, each input's group. Dequantised as `s[g_idx[i]]·(q − z[g_idx[i]])`.
fn read_gptq(
    t: &dyn Tensors,
    prefix: &str,
    bits: u32,
    group: Option<usize>,
    v1: bool,
) -> Result<Arc<dyn Linear>> {
    let qw_name = format!("{prefix}.qweight");
    let qw = need(t, &qw_name)?;
    let [packed_rows, rows] = qw.shape[..] else {
        return Err(ModelError::tensor(
            &qw_name,
            format!("shape {:?} is not a matrix", qw.shape),
        ));
    };
    let gi_name = format!("{prefix}.g_idx");
    let g_idx = match t.get(&gi_name) {
        Some(v) if v.dtype == Dtype::I32 && v.shape.len() == 1 => Some(
            v.bytes
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
                .collect::<Vec<_>>(),
        ),
        Some(v) => {
            return Err(ModelError::tensor(
                &gi_name,
                format!(
                    "dtype {} shape {:?} (read: I32 [in])",
                    v.dtype.name(),
                    v.shape
                ),
            ))
        }
        None => None,
    };
    let cols = match &g_idx {
        Some(g) => g.len(),
        None => packed_rows * 32 / bits as usize,
    };
    if cols == 0 || rows == 0 || packed_rows != (cols * bits as usize).div_ceil(32) {
        return Err(ModelError::tensor(
            &qw_name,
            format!(
                "shape {:?}: {cols} inputs of {bits} bits need {} rows",
                qw.shape,
                (cols * bits as usize).div_ceil(32)
            ),
        ));
    }
    let qweight = words(t, &qw_name, &[packed_rows, rows])?;
    let group = group.unwrap_or(cols);
    let n_groups = cols.div_ceil(group);
    let sc = floats(t, &format!("{prefix}.scales"), &[n_groups, rows])?;
    let qz_name = format!("{prefix}.qzeros");
    let zw = (rows * bits as usize).div_ceil(32);
    let mut qz = words(t, &qz_name, &[n_groups, zw])?;
    if v1 {
        qz.iter_mut().for_each(|w| *w = word_v1_to_v2(*w, bits));
    }
    // Stored column order: inputs sorted by group (stable), so that each group is a run of
    // consecutive columns, as the int form's groups are. Permuting the inputs once is exact: the
    // product sums the same terms, only in another order, as any f32 product may.
    let perm = match &g_idx {
        Some(g)
            if g.iter()
                .enumerate()
                .any(|(i, &g)| g as i64 != (i / group) as i64) =>
        {
            let mut p: Vec<u32> = (0..cols as u32).collect();
            p.sort_by_key(|&i| g[i as usize]);
            if let Some(k) = (0..cols).find(|&k| g[p[k] as usize] as i64 != (k / group) as i64) {
                return Err(ModelError::tensor(
                    &gi_name,
                    format!(
                        "input {} is in group {}: groups are not {n_groups} of {group} inputs",
                        p[k], g[p[k] as usize]
                    ),
                ));
            }
            Some(p)
        }
        _ => None,
    };
    let src_col = |k: usize| perm.as_ref().map_or(k, |p| p[k] as usize);
    // Blocks of outputs in parallel, each input's words of a block read together (adjacent).
    const BLOCK: usize = 32;
    let mut codes = vec![0u8; rows * cols];
    codes
        .par_chunks_mut(BLOCK * cols)
        .enumerate()
        .for_each(|(b, block)| {
            let o0 = b * BLOCK;
            let n = block.len() / cols;
            for k in 0..cols {
                let src = src_col(k);
                for i in 0..n {
                    block[i * cols + k] = field(|w| qweight[w * rows + o0 + i], src, bits);
                }
            }
        });
    let mut scales = vec![0f32; rows * n_groups];
    let mut zeros = vec![0i32; rows * n_groups];
    for g in 0..n_groups {
        let zrow = &qz[g * zw..(g + 1) * zw];
        for o in 0..rows {
            scales[o * n_groups + g] = sc[g * rows + o];
            let z = field(|w| zrow[w], o, bits);
            zeros[o * n_groups + g] = match v1 {
                true => field_v1_to_v2(z, bits),
                false => z,
            } as i32;
        }
    }
    Unpacked {
        rows,
        cols,
        bits,
        codes,
        group,
        scales,
        zeros,
        perm,
    }
    .into_linear(&qw_name)
}

fn awq(q: &serde_json::Map<String, serde_json::Value>) -> Result<Scheme> {
    match get_str(q, "version")?
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        None | Some("gemm") => {}
        Some(v) => {
            return Err(cfg_err(
                "version",
                format!("'{v}' is not read (read: gemm)"),
            ))
        }
    }
    let (bf, bits) = match get_usize(q, "bits")? {
        Some(b) => ("bits", Some(b)),
        None => ("w_bit", get_usize(q, "w_bit")?),
    };
    if bits != Some(4) {
        return Err(cfg_err(bf, format!("{bits:?} (read: 4)")));
    }
    let (gf, g) = match get_usize(q, "group_size")? {
        Some(g) => ("group_size", Some(g)),
        None => ("q_group_size", get_usize(q, "q_group_size")?),
    };
    match group_size(gf, g)? {
        Some(group) => Ok(Scheme::Awq { group }),
        None => Err(cfg_err(gf, "missing")),
    }
}

/// Where AWQ GEMM puts output `8·k + j` of a word: nibble `AWQ_NIBBLE[j]` (autoawq packs
/// outputs in the order [0, 2, 4, 6, 1, 3, 5, 7]).
const AWQ_NIBBLE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// AWQ GEMM (autoawq's `WQLinear_GEMM.from_linear`): `qweight` int32 `[in, out/8]`, `qzeros`
/// int32 `[groups, out/8]`, eight outputs a word in AWQ's nibble order; `scales` `[groups, out]`.
/// Dequantised as `(q − z)·s`.
fn read_awq(t: &dyn Tensors, prefix: &str, group: usize) -> Result<Arc<dyn Linear>> {
    let qw_name = format!("{prefix}.qweight");
    let qw = need(t, &qw_name)?;
    let [cols, packed] = qw.shape[..] else {
        return Err(ModelError::tensor(
            &qw_name,
            format!("shape {:?} is not a matrix", qw.shape),
        ));
    };
    let rows = packed * 8;
    if cols == 0 || rows == 0 {
        return Err(ModelError::tensor(&qw_name, "an empty matrix"));
    }
    let qweight = words(t, &qw_name, &[cols, packed])?;
    let n_groups = cols.div_ceil(group);
    let sc = floats(t, &format!("{prefix}.scales"), &[n_groups, rows])?;
    let qz = words(t, &format!("{prefix}.qzeros"), &[n_groups, packed])?;
    let nib = |w: u32, o: usize| ((w >> (4 * AWQ_NIBBLE[o % 8])) & 0xF) as u8;
    let mut codes = vec![0u8; rows * cols];
    for (o, row) in codes.chunks_exact_mut(cols).enumerate() {
        for (i, q) in row.iter_mut().enumerate() {
            *q = nib(qweight[i * packed + o / 8], o);
        }
    }
    let mut scales = vec![0f32; rows * n_groups];
    let mut zeros = vec![0i32; rows * n_groups];
    for g in 0..n_groups {
        for o in 0..rows {
            scales[o * n_groups + g] = sc[g * rows + o];
            zeros[o * n_groups + g] = nib(qz[g * packed + o / 8], o) as i32;
        }
    }
    Unpacked {
        rows,
        cols,
        bits: 4,
        codes,
        group,
        scales,
        zeros,
        perm: None,
    }
    .into_linear(&qw_name)
}

/// Stored column `k` is column `perm[k]`.
#[derive(Clone)]
pub struct ColumnOrder(Vec<u32>);

impl Wrap for ColumnOrder {
    /// Gathers each input vector once.
    fn input<'a>(&self, x: &'a [f32], cols: usize) -> Cow<'a, [f32]> {
        let mut xp = vec![0f32; x.len()];
        for (o, x) in xp.chunks_exact_mut(cols).zip(x.chunks_exact(cols)) {
            for (o, &p) in o.iter_mut().zip(&self.0) {
                *o = x[p as usize];
            }
        }
        Cow::Owned(xp)
    }
    fn row(&self, inner: &dyn Linear, r: usize, out: &mut [f32]) {
        let mut stored = vec![0f32; inner.cols()];
        inner.row(r, &mut stored);
        for (&v, &p) in stored.iter().zip(&self.0) {
            out[p as usize] = v;
        }
    }
    fn bytes(&self) -> usize {
        4 * self.0.len()
    }
}

/// A matrix whose columns are stored in another order: stored column `k` is column `perm[k]`
/// (GPTQ's activation-ordered groups, made contiguous). Products gather the input once.
pub type ColumnOrdered = Wrapped<ColumnOrder>;

impl ColumnOrdered {
    pub fn new(name: &str, inner: Arc<dyn Linear>, perm: Vec<u32>) -> Result<Self> {
        let mut seen = vec![false; perm.len()];
        let ok = perm.len() == inner.cols()
            && perm.iter().all(|&p| {
                (p as usize) < seen.len() && !std::mem::replace(&mut seen[p as usize], true)
            });
        match ok {
            true => Ok(Wrapped::with(inner, ColumnOrder(perm))),
            false => Err(ModelError::tensor(
                name,
                "the column order is not a permutation of the matrix's columns",
            )),
        }
    }

    /// The original column of each stored column.
    pub fn perm(&self) -> &[u32] {
        &self.wrap().0
    }
}
