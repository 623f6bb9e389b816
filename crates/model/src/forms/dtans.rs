//! `dtans`: the dtANS-LLM coder (codec `dtans`, docs/dtans.md) over the codes of BF16, FP16, FP8
//! and integer matrices; the product is the codec's fused decode-matvec (the matrix is never
//! materialised), with GGUF group scales applied per group. Variants are codings
//! `MODE:LOG2M:SC:T` (`pair:8:256:16`).

use super::{Candidate, DeviceKind, Form, Source, StoredMatrix, Values};
use crate::error::{ModelError, Result};
use crate::weights::Linear;
use entrollm_codec::dtans::{
    default_slice_width, predict_many, Coding, CpuProduct, DtansTensor, Mode, TupleHistograms,
    SLICE_WIDTHS, TABLE_LOG2,
};
use entrollm_codec::matvec::Dequant;
use entrollm_codec::Payload;
use entrollm_format::coded::{Coded, GgmlCoded, ScalarCoded};
use entrollm_format::Dtype;
use std::sync::Arc;

/// Per-group dequantisation of an integer-coded matrix (GGUF blocks): see [`Dequant::Groups`].
#[derive(Clone, Debug, PartialEq)]
pub struct GroupScales {
    pub group: usize,
    pub scales: Vec<f32>,
    pub mins: Option<Vec<f32>>,
    pub offset: f32,
    pub signed: bool,
}

impl GroupScales {
    pub fn dequant(&self) -> Dequant<'_> {
        Dequant::Groups {
            group: self.group,
            scales: &self.scales,
            mins: self.mins.as_deref(),
            offset: self.offset,
            signed: self.signed,
        }
    }

    pub fn bytes(&self) -> usize {
        4 * (self.scales.len() + self.mins.as_ref().map_or(0, Vec::len))
    }
}

/// A dtANS-coded matrix used as it is stored: every product goes through the codec's fused
/// decode-matvec (the matrix is never materialised), with GGUF block scales applied per group:
/// codes without raw bytes (integer, FP8, FP4) through the fast CPU product, BF16/FP16 through
/// the reference.
pub struct CodedLinear {
    t: DtansTensor,
    groups: Option<GroupScales>,
    fast: Option<CpuProduct>,
}

impl CodedLinear {
    pub fn new(t: DtansTensor, groups: Option<GroupScales>) -> Result<Self> {
        let fast = CpuProduct::new(&t).map_err(|e| ModelError::Unsupported(e.to_string()))?;
        let l = CodedLinear { t, groups, fast };
        l.dequant()
            .check(l.t.rows, l.t.cols)
            .map_err(|e| ModelError::Unsupported(e.to_string()))?;
        Ok(l)
    }

    /// The matrix of a GGUF tensor of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks.
    pub fn from_ggml(g: GgmlCoded) -> Result<Self> {
        let (scales, mins) = g.scales_f32();
        let l = g.block.int_codes().ok_or_else(|| {
            ModelError::Unsupported(format!("{} codes are not integers", g.block))
        })?;
        let groups = GroupScales {
            group: entrollm_format::ggml_blocks::QK,
            scales,
            mins,
            offset: l.offset as f32,
            signed: l.signed,
        };
        Self::new(g.codes, Some(groups))
    }

    /// A matrix `compress --quantizer int|fp8` coded, served as it is stored: integer codes
    /// through this form's group-scale epilogue; FP8 codes with their row scales outside them, as
    /// an FP8 checkpoint's are (so palette FP8 can take the codes). `name` is for errors.
    pub fn from_scalar(
        name: &str,
        t: entrollm_codec::lossy::scalar::ScalarTensor,
    ) -> Result<Arc<dyn Linear>> {
        let bad = |e: entrollm_codec::CodecError| ModelError::tensor(name, e.to_string());
        t.check_shape().map_err(bad)?;
        let scales: Vec<f32> = t
            .scales
            .decode()
            .map_err(bad)?
            .iter()
            .map(|&s| half::f16::from_bits(s).to_f32())
            .collect();
        if let Some(i) = scales.iter().position(|s| !s.is_finite()) {
            return Err(ModelError::tensor(name, format!("scale {i} is not finite")));
        }
        Ok(match t.codes.payload {
            Payload::Int(_) => {
                let groups = GroupScales {
                    group: t.group,
                    scales,
                    mins: None,
                    offset: 0.0,
                    signed: true,
                };
                Arc::new(Self::new(t.codes, Some(groups))?)
            }
            _ => Arc::new(crate::weights::RowScaled::new(
                name,
                Arc::new(Self::new(t.codes, None)?),
                scales,
            )?),
        })
    }

    /// The coded tensor and its dequantisation, for an engine that uploads the coded arrays (the
    /// GPU's decode-matvec) instead of decoding them.
    pub fn coded(&self) -> (&DtansTensor, Dequant<'_>) {
        (&self.t, self.dequant())
    }

    fn dequant(&self) -> Dequant<'_> {
        self.groups
            .as_ref()
            .map_or(Dequant::None, GroupScales::dequant)
    }
}

impl Linear for CodedLinear {
    fn rows(&self) -> usize {
        self.t.rows
    }
    fn cols(&self) -> usize {
        self.t.cols
    }
    fn matvec(&self, x: &[f32], y: &mut [f32]) {
        // The tensor decoded to its checksum when it was loaded (or was encoded here) and
        // decoding is deterministic, so it cannot fail here.
        match &self.fast {
            Some(f) => f.matvec(&self.t, x, y, &self.dequant(), true),
            None => self.t.matvec(x, y, &self.dequant()),
        }
        .expect("a coded matrix verified at load decodes");
    }
    fn row(&self, r: usize, out: &mut [f32]) {
        self.t
            .row_f32(r, out)
            .expect("a coded matrix verified at load decodes");
        let (d, p, cols) = (self.dequant(), self.t.payload, self.t.cols);
        for (c, v) in out.iter_mut().enumerate() {
            *v = d.apply(p, r, c, cols, *v);
        }
    }
    fn stored_bytes(&self) -> usize {
        self.t.stored_bytes() + self.groups.as_ref().map_or(0, GroupScales::bytes)
    }
    fn form(&self) -> super::FormId {
        super::FormId {
            form: "dtans",
            variant: self.t.coding.to_string(),
        }
    }
    fn source(&self) -> Result<Source> {
        let bytes = self
            .t
            .decode()
            .map_err(|e| ModelError::Unsupported(format!("dtans decode: {e}")))?;
        let u16s = || {
            bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect()
        };
        let values = match (self.t.payload, &self.groups) {
            (Payload::Bf16, None) => Values::Bf16(u16s()),
            (Payload::Fp16, None) => Values::F16(u16s()),
            (Payload::Fp8E4m3, None) => Values::Fp8(bytes),
            (Payload::Int(_) | Payload::Fp4E2m1, Some(g)) => Values::Int {
                payload: self.t.payload,
                codes: bytes,
                groups: g.clone(),
            },
            (p, _) => {
                return Err(ModelError::Unsupported(format!(
                    "a dtans {p:?} matrix has no exact values form yet"
                )))
            }
        };
        Source::new(self.t.rows, self.t.cols, values)
    }
    fn values_kind(&self) -> &'static str {
        match self.t.payload {
            Payload::Bf16 => "bf16",
            Payload::Fp16 => "f16",
            Payload::Fp8E4m3 => "fp8",
            _ => "int",
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

pub struct DtansForm;
pub static DTANS: DtansForm = DtansForm;

/// `src` as the values this coder codes: as it is, or a GGUF tensor's blocks as their codes and
/// group scales ([`super::ggml::coded_values`]).
fn coded_source(src: &Source) -> Option<std::borrow::Cow<'_, Source>> {
    match &src.values {
        Values::Ggml { ty, bytes } => Some(std::borrow::Cow::Owned(Source {
            rows: src.rows,
            cols: src.cols,
            values: super::ggml::coded_values(*ty, bytes.bytes())?,
        })),
        _ => Some(std::borrow::Cow::Borrowed(src)),
    }
}

/// The payload, symbols and raw bytes of a source this coder accepts.
fn symbols(src: &Source) -> Option<(Payload, Vec<u8>, Vec<u8>)> {
    let src = coded_source(src)?;
    let le = |v: &[u16]| -> Vec<u8> { v.iter().flat_map(|w| w.to_le_bytes()).collect() };
    let (payload, bytes) = match &src.values {
        Values::Bf16(v) => (Payload::Bf16, le(v)),
        Values::F16(v) => (Payload::Fp16, le(v)),
        Values::Fp8(v) => (Payload::Fp8E4m3, v.clone()),
        Values::Int { payload, codes, .. } => (*payload, codes.clone()),
        Values::F32(_) | Values::Ggml { .. } => return None,
    };
    let (codes, raw) = payload.symbolize(&bytes).ok()?;
    Some((payload, codes, raw))
}

/// Bytes of `src` as it is stored uncoded (the size a coding must beat).
fn plain_bytes(src: &Source) -> f64 {
    match &src.values {
        Values::Int {
            payload, groups, ..
        } => (src.weights() as f64 * payload.code_bits() as f64 / 8.0) + groups.bytes() as f64,
        Values::Bf16(_) | Values::F16(_) => 2.0 * src.weights() as f64,
        Values::Fp8(_) => src.weights() as f64,
        Values::F32(_) => 4.0 * src.weights() as f64,
        Values::Ggml { bytes, .. } => bytes.bytes().len() as f64,
    }
}

fn side_bytes(src: &Source) -> f64 {
    match coded_source(src).as_deref().map(|s| &s.values) {
        Some(Values::Int { groups, .. }) => groups.bytes() as f64,
        _ => 0.0,
    }
}

/// Kept-value counts tried for a table of 2^log2_m slots in `mode`, ascending.
fn t_ladder(payload: Payload, mode: Mode, log2_m: u8) -> Vec<Option<u16>> {
    let k = mode.values_per_symbol();
    if k == 1 {
        return vec![None];
    }
    let cap = ((1u64 << log2_m) as f64).powf(1.0 / k as f64).floor() as usize;
    let cap = cap.min(payload.alphabet());
    let mut ts: Vec<usize> = [cap / 4, cap / 2, cap * 3 / 4, cap]
        .into_iter()
        .filter(|&t| t >= 2)
        .collect();
    ts.dedup();
    ts.into_iter().map(|t| Some(t as u16)).collect()
}

impl Form for DtansForm {
    fn name(&self) -> &'static str {
        "dtans"
    }
    fn describe(&self) -> &'static str {
        "dtANS-LLM entropy coding of the codes (BF16/FP16 exponents, FP8, integers), fused decode-matvec"
    }
    fn runs_on(&self, _device: DeviceKind) -> bool {
        true
    }
    fn accepts(&self, src: &Source) -> bool {
        !matches!(src.values, Values::F32(_))
    }
    /// MINE's pruning (§4.2): per mode and slice width, table sizes in order until the bound stops
    /// improving by more than 1 %; kept values raised while the escapes they save outweigh the
    /// bigger table; codings predicted no smaller than the plain matrix dropped.
    fn variants(&self, src: &Source) -> Result<Vec<Candidate>> {
        // A GGUF tensor's blocks taken apart once, for its symbols and its scales.
        let plain = plain_bytes(src);
        let Some(src) = coded_source(src) else {
            return Ok(Vec::new());
        };
        let src = &*src;
        let Some((payload, codes, _)) = symbols(src) else {
            return Ok(Vec::new());
        };
        let (rows, cols) = (src.rows, src.cols);
        let narrowest = default_slice_width(cols);
        let widths: Vec<u32> = SLICE_WIDTHS
            .into_iter()
            .filter(|&sc| sc >= narrowest && (sc as usize) < 2 * cols.max(32) || sc == narrowest)
            .take(3)
            .collect();
        // The histograms every coding is predicted from, made once.
        let hists = TupleHistograms::new(payload, cols, &codes);
        let predict = |c: &[Coding]| {
            hists
                .predict(payload, rows, cols, c)
                .map_err(|e| ModelError::Unsupported(format!("dtans: {e}")))
        };
        let side = side_bytes(src);
        let mut out = Vec::new();
        for mode in [Mode::Single, Mode::Pair, Mode::Quad] {
            if mode.values_per_symbol() as u32 * payload.code_bits() > 16 {
                continue;
            }
            for &sc in &widths {
                let mut last: Option<f64> = None;
                for log2_m in TABLE_LOG2 {
                    let ladder: Vec<Coding> = t_ladder(payload, mode, log2_m)
                        .into_iter()
                        .map(|t| Coding {
                            mode,
                            log2_m,
                            sc,
                            t,
                        })
                        .collect();
                    // Raise t while it pays.
                    let mut best: Option<(Coding, f64)> = None;
                    for (c, bytes) in predict(&ladder)? {
                        match best {
                            Some((_, b)) if bytes >= b => break,
                            _ => best = Some((c, bytes)),
                        }
                    }
                    let Some((c, bytes)) = best else { continue };
                    let bytes = bytes + side;
                    if last.is_some_and(|l| bytes > l * 0.99) {
                        break;
                    }
                    last = Some(bytes);
                    if bytes < plain {
                        out.push(Candidate {
                            variant: c.to_string(),
                            predicted_bytes: bytes,
                        });
                    }
                }
            }
        }
        Ok(out)
    }
    /// The smallest pruned coding, else (no coding beats the plain matrix) the codec's own
    /// choice of coding and slice width.
    fn default_variant(&self, src: &Source) -> Result<Option<String>> {
        let smallest = self
            .variants(src)?
            .into_iter()
            .min_by(|a, b| a.predicted_bytes.total_cmp(&b.predicted_bytes));
        if let Some(c) = smallest {
            return Ok(Some(c.variant));
        }
        let Some((payload, codes, _)) = symbols(src) else {
            return Ok(None);
        };
        let (c, _) =
            entrollm_codec::dtans::choose_coding_and_width(payload, src.rows, src.cols, &codes)
                .map_err(|e| ModelError::Unsupported(format!("dtans: {e}")))?;
        Ok(Some(c.to_string()))
    }
    fn predict(&self, src: &Source, variant: &str) -> Result<f64> {
        let coding = parse(variant)?;
        // A GGUF tensor's blocks taken apart once, for its symbols and its scales.
        let src = &*coded_source(src).ok_or_else(|| not_accepted(src))?;
        let (payload, codes, _) = symbols(src).ok_or_else(|| not_accepted(src))?;
        let p = predict_many(payload, src.rows, src.cols, &codes, &[coding])
            .map_err(|e| ModelError::Unsupported(format!("dtans {variant}: {e}")))?;
        p.first()
            .map(|p| p.1 + side_bytes(src))
            .ok_or_else(|| ModelError::Unsupported(format!("dtans {variant}: no table fits")))
    }
    fn encode(&self, src: &Source, variant: &str) -> Result<Arc<dyn Linear>> {
        let coding = parse(variant)?;
        let src = &*coded_source(src).ok_or_else(|| not_accepted(src))?;
        let (payload, codes, raw) = symbols(src).ok_or_else(|| not_accepted(src))?;
        let t = DtansTensor::encode(payload, src.rows, src.cols, &codes, &raw, coding)
            .map_err(|e| ModelError::Unsupported(format!("dtans {variant}: {e}")))?;
        let groups = match &src.values {
            Values::Int { groups, .. } => Some(groups.clone()),
            _ => None,
        };
        Ok(Arc::new(CodedLinear::new(t, groups)?))
    }
    /// Its own coder's float matrices (FP8 codes of any shape, whose row scales the loader puts
    /// outside), a GGUF container's legacy blocks (`dtans-ggml`) and scalar-quantised matrices
    /// (`dtans-scalar`): each multiplied as stored.
    fn loads(&self, coded: &Coded, t: &StoredMatrix<'_>) -> bool {
        match coded.downcast_ref::<DtansTensor>() {
            Some(_) => !t.in_gguf && (t.dtype == Dtype::F8E4M3 || t.shape.len() == 2),
            None => {
                t.in_gguf && coded.downcast_ref::<GgmlCoded>().is_some()
                    || coded.downcast_ref::<ScalarCoded>().is_some()
            }
        }
    }
    fn load(&self, coded: Coded, t: &StoredMatrix<'_>) -> Result<Arc<dyn Linear>> {
        let coded = match coded.downcast::<DtansTensor>() {
            Ok(d) => return Ok(Arc::new(CodedLinear::new(d, None)?)),
            Err(c) => c,
        };
        let coded = match coded.downcast::<GgmlCoded>() {
            Ok(g) => return Ok(Arc::new(CodedLinear::from_ggml(g)?)),
            Err(c) => c,
        };
        match coded.downcast::<ScalarCoded>() {
            Ok(q) => CodedLinear::from_scalar(t.name, q.tensor),
            Err(c) => Err(ModelError::tensor(
                t.name,
                format!("the dtans form does not serve {} tensors", c.coder()),
            )),
        }
    }
    fn stored(&self, variant: &str, values: &str) -> Result<Option<super::Stored>> {
        let coding = parse(variant)?;
        // A GGUF tensor's blocks are stored as the container stores them (their exact bytes) and
        // coded from them at load.
        Ok(
            (values != "f32" && values != "ggml").then_some(super::Stored::Coded {
                coder: entrollm_format::coded::DTANS,
                coding: Some(coding),
            }),
        )
    }
    fn default_cost_us(&self, device: DeviceKind, weights: usize, bytes: f64) -> f64 {
        super::stream_cost_us(device, bytes)
            + weights as f64
                * match device {
                    DeviceKind::Cpu => 6.0e-3,
                    DeviceKind::Cuda => 1.0e-7,
                }
    }
}

fn parse(variant: &str) -> Result<Coding> {
    Coding::parse(variant)
        .map_err(|e| ModelError::Config(format!("dtans variant '{variant}': {e}")))?
        .ok_or_else(|| {
            ModelError::Config("dtans needs a coding MODE:LOG2M:SC[:T], not 'auto'".into())
        })
}

fn not_accepted(src: &Source) -> ModelError {
    ModelError::Unsupported(format!("dtans cannot code a {} matrix", src.values.kind()))
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::*;
    use super::DTANS;

    #[test]
    fn codings_round_trip_and_prune() {
        let mut rng = Rng::new(3);
        for (rows, cols) in [(64, 256), (96, 576)] {
            let src = bf16_source(&mut rng, rows, cols, 0.02);
            let v = DTANS.variants(&src).unwrap();
            assert!(
                !v.is_empty(),
                "{rows}x{cols}: a BF16 Gaussian codes smaller"
            );
            assert!(v
                .iter()
                .all(|c| c.predicted_bytes < 2.0 * src.weights() as f64));
            check_all_forms(&src, &mut rng);
        }
        // Ragged shapes (padded rows and slices), whether or not coding pays there.
        for (rows, cols) in [(1, 1), (45, 200), (33, 70)] {
            let src = bf16_source(&mut rng, rows, cols, 0.02);
            for v in ["pair:8:64:16", "single:10:256", "pair:12:128:64"] {
                check_variant(&DTANS, &src, v, &mut rng);
            }
        }
    }

    #[test]
    fn integer_codes_with_groups_round_trip() {
        let mut rng = Rng::new(5);
        let (rows, cols) = (40, 96);
        let codes: Vec<u8> = (0..rows * cols)
            .map(|_| ((rng.normal() * 2.5 + 8.0).clamp(0.0, 15.0)) as u8)
            .collect();
        let groups = GroupScales {
            group: 32,
            scales: (0..rows * 3)
                .map(|_| 0.01 + rng.normal().abs() * 0.01)
                .collect(),
            mins: Some((0..rows * 3).map(|_| rng.normal() * 0.05).collect()),
            offset: 0.0,
            signed: false,
        };
        let src = Source::new(
            rows,
            cols,
            Values::Int {
                payload: Payload::Int(4),
                codes,
                groups,
            },
        )
        .unwrap();
        check_all_forms(&src, &mut rng);
        assert!(DTANS.encode(&src, "auto").is_err());
    }

    /// A GGUF tensor's blocks coded as their codes with group scales (integer codes of the legacy
    /// and k-quant types, MXFP4's and NVFP4's E2M1 codes): the same weights as ggml's
    /// dequantisation (but for the sign of zeros), the product within f32 rounding, on ragged
    /// row counts; IQ4's table-indexed codes are not taken. Stored by a container as blocks.
    #[test]
    fn gguf_blocks_code_as_their_codes_and_scales() {
        use crate::gguf::GgmlType;
        let mut rng = Rng::new(9);
        let coded = entrollm_format::qtype::CPU
            .into_iter()
            .filter(|t| !matches!(t, GgmlType::IQ4_NL | GgmlType::IQ4_XS));
        for ty in coded {
            for (rows, blocks) in [(1, 1), (5, 3), (17, 2)] {
                let bs = ty.block_size();
                let bytes = crate::forms::ggml::synth_blocks(ty, rows * blocks, rng.next());
                let src = Source::new(
                    rows,
                    blocks * bs,
                    Values::Ggml {
                        ty,
                        bytes: crate::forms::ggml::BlockBytes::from_vec(bytes),
                    },
                )
                .unwrap();
                // Pairs of wider codes keep their 16 most frequent values (the rest escape).
                let pair = match ty {
                    GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_0 | GgmlType::Q4_1 => {
                        "pair:10:128"
                    }
                    GgmlType::Q4_K | GgmlType::MXFP4 | GgmlType::NVFP4 => "pair:10:128",
                    _ => "pair:10:128:16",
                };
                for v in ["single:8:64", pair] {
                    check_variant(&DTANS, &src, v, &mut rng);
                }
            }
        }
        let iq4 =
            Source::new(
                1,
                32,
                Values::Ggml {
                    ty: GgmlType::IQ4_NL,
                    bytes: crate::forms::ggml::BlockBytes::from_vec(
                        crate::forms::ggml::synth_blocks(GgmlType::IQ4_NL, 1, 1),
                    ),
                },
            )
            .unwrap();
        assert!(DTANS.encode(&iq4, "single:10:64").is_err());
        assert!(DTANS.variants(&iq4).unwrap().is_empty());
        assert!(DTANS.stored("single:10:64", "ggml").unwrap().is_none());
    }
}
