//! Scalar lossy quantisers whose codes the dtANS forms serve as they are (no lossy tile decoder):
//!
//! - [`Scalar::Int`]: a uniform integer grid with one scale per group of columns (signed codes in
//!   two's complement, the `int` payload the fused product dequantises per group);
//! - [`Scalar::Fp8`]: FP8 E4M3 codes with one scale per row (the FP8 payload of the dtANS and
//!   palette-FP8 forms).
//!
//! The rate is what the codes cost *entropy-coded*, every byte counted: a 5-bit grid whose codes
//! carry 3.2 bits costs 3.2 bits. One knob per matrix sets it — the grid step (int) or how far the
//! row scale pushes the values into FP8's subnormals (fp8), both in units of each group's RMS — and
//! it is searched on code histograms (see [`encode`]), entropy-coding only to check the rate.
//! After rounding, each scale is refitted by (weighted) least squares to its codes; integer codes
//! rounded with GPTQ error feedback ([`encode_with_feedback`]) keep the step as their scale.

use super::gptq::Feedback;
use crate::dtans::{choose_coding_and_width, Coding, DtansTensor};
use crate::histogram::entropy_bits;
use crate::payload::fp8_e4m3_to_f32;
use crate::{CodecError, Payload, Result};
use rayon::prelude::*;

/// Columns a group of [`Scalar::Int`] holds by default.
pub const INT_GROUP: usize = 128;
/// The largest group (whole rows up to this width are one group).
pub const MAX_GROUP: usize = 1 << 16;
/// Weights of sampled rows the step search quantises per candidate.
const SAMPLE_WEIGHTS: usize = 1 << 18;
/// Relative tolerance of the stored size before another pass.
const STORED_TOL: f64 = 0.006;

/// Which scalar quantiser.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    /// Uniform integer grid, one scale per `group` columns; weights whose magnitude is under
    /// (½ + `dead_zone`) steps become 0 (a dead zone buys rate at low bits).
    Int { group: usize, dead_zone: f32 },
    /// FP8 E4M3 codes, one scale per row.
    Fp8,
}

impl std::fmt::Display for Scalar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scalar::Int { group, dead_zone } if *dead_zone > 0.0 => {
                write!(f, "int-g{group}-dz{dead_zone}")
            }
            Scalar::Int { group, .. } => write!(f, "int-g{group}"),
            Scalar::Fp8 => write!(f, "fp8"),
        }
    }
}

impl Scalar {
    /// Columns a scale covers in a row of `cols`: for int, the largest divisor of the row not
    /// above the group asked for (576 columns in groups of 128: 96), so every row is whole groups.
    pub fn group(self, cols: usize) -> usize {
        match self {
            Scalar::Int { group, .. } => (1..=group.min(cols).max(1))
                .rev()
                .find(|g| cols.is_multiple_of(*g))
                .unwrap_or(1),
            Scalar::Fp8 => cols,
        }
    }

    pub fn check(self) -> Result<()> {
        match self {
            Scalar::Int { group, dead_zone } => {
                if group == 0 || group > MAX_GROUP {
                    return Err(CodecError::Unsupported(format!(
                        "int groups of {group} columns: give 1 to {MAX_GROUP}"
                    )));
                }
                if !(0.0..0.5).contains(&dead_zone) {
                    return Err(CodecError::Unsupported(format!(
                        "dead zone {dead_zone}: give 0 to 0.5 (exclusive) steps"
                    )));
                }
                Ok(())
            }
            Scalar::Fp8 => Ok(()),
        }
    }

    /// The knob's search range (log2) for `w`: the rate falls as the knob grows. A group's step
    /// never goes below the one at which its largest weight just fits the codes (±127, or FP8's
    /// 448: clipping would *lower* the rate again), so below the range's start, where every group
    /// is at that limit, nothing changes.
    fn knob_range(self, w: &[f32], cols: usize) -> (f64, f64) {
        let group = self.group(cols);
        let crest = w
            .par_chunks(group)
            .map(|g| {
                let rms =
                    (g.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / g.len() as f64).sqrt();
                let max = g.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                if rms > 0.0 {
                    max / rms
                } else {
                    0.0
                }
            })
            .filter(|&c| c > 0.0)
            .reduce(|| f64::INFINITY, f64::min)
            .clamp(1.0, 1e6);
        let top = match self {
            Scalar::Int { .. } => 126.5,
            Scalar::Fp8 => 448.0,
        };
        // Step (int) or row scale (fp8) in units of the group RMS; 2^4 steps of the RMS code
        // nearly every weight as 0, and FP8 flushes them from 2^16 on.
        let end = match self {
            Scalar::Int { .. } => 4.0,
            Scalar::Fp8 => 16.0,
        };
        ((crest / top).log2(), end)
    }
}

/// Nearest FP8 E4M3 code to `v` (round to nearest, ties to even; saturates at ±448): the
/// arithmetic form of [`crate::payload::f32_to_fp8_e4m3`], which it matches on every finite f32.
#[inline]
pub fn fp8_round(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs();
    if a.is_nan() {
        return 0x7F;
    }
    if a >= 464.0 {
        // Halfway to the next binade step (512) and beyond: saturate.
        return sign | 0x7E;
    }
    if a < 2f32.powi(-6) {
        // Subnormals: multiples of 2^-9, ties to even (the code 8 is the smallest normal).
        let m = (a * 512.0).round_ties_even() as u8;
        return if m == 0 { sign } else { sign | m };
    }
    let bits = a.to_bits();
    // Round the 23-bit mantissa to 3 bits, ties to even.
    let lsb = (bits >> 20) & 1;
    let r = (bits + 0x7FFFF + lsb) & !0xFFFFF;
    let e = ((r >> 23) as i32) - 127 + 7;
    let m = (r >> 20) & 7;
    let code = ((e as u32) << 3 | m).min(0x7E) as u8;
    sign | code
}

/// A matrix's codes and scales, before the codes are entropy-coded.
#[derive(Clone, Debug, PartialEq)]
pub struct ScalarCodes {
    pub rows: usize,
    pub cols: usize,
    /// `Int(b)` (signed, two's complement of b bits) or `Fp8E4m3`.
    pub payload: Payload,
    /// Columns a scale covers (a row holds `cols / group` groups).
    pub group: usize,
    pub codes: Vec<u8>,
    /// One per group, row-major, as f16 bits: weight = scale · value(code).
    pub scales: Vec<u16>,
}

impl ScalarCodes {
    /// A code's value before its scale.
    #[inline]
    pub fn value(payload: Payload, c: u8) -> f32 {
        match payload {
            Payload::Int(b) => {
                let v = c as i32;
                (if v >= 1 << (b - 1) { v - (1 << b) } else { v }) as f32
            }
            _ => fp8_e4m3_to_f32(c),
        }
    }

    /// The scales as f32.
    pub fn scales_f32(&self) -> Vec<f32> {
        self.scales
            .iter()
            .map(|&s| half::f16::from_bits(s).to_f32())
            .collect()
    }

    /// The reconstruction, row-major: scale · value, in f32.
    pub fn decode(&self) -> Vec<f32> {
        let scales = self.scales_f32();
        let per_row = self.cols / self.group;
        let mut out = vec![0f32; self.rows * self.cols];
        out.par_chunks_mut(self.cols)
            .zip(self.codes.par_chunks(self.cols))
            .enumerate()
            .for_each(|(r, (o, c))| {
                for (g, (o, c)) in o
                    .chunks_mut(self.group)
                    .zip(c.chunks(self.group))
                    .enumerate()
                {
                    let s = scales[r * per_row + g];
                    for (o, &c) in o.iter_mut().zip(c) {
                        *o = s * Self::value(self.payload, c);
                    }
                }
            });
        out
    }

    /// Structural checks of codes that did not come from [`quantize`] (a container's).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(CodecError::Corrupt(m));
        match self.payload {
            Payload::Int(b) if (2..=8).contains(&b) => {}
            Payload::Fp8E4m3 => {}
            p => return bad(format!("scalar codes of payload {p:?}")),
        }
        if self.rows == 0
            || self.cols == 0
            || self.group == 0
            || !self.cols.is_multiple_of(self.group)
        {
            return bad(format!(
                "{}×{} in groups of {}: not whole groups",
                self.rows, self.cols, self.group
            ));
        }
        let groups = self.rows.checked_mul(self.cols / self.group);
        if self.rows.checked_mul(self.cols) != Some(self.codes.len())
            || groups != Some(self.scales.len())
        {
            return bad(format!(
                "{}×{} in groups of {} with {} codes and {} scales",
                self.rows,
                self.cols,
                self.group,
                self.codes.len(),
                self.scales.len()
            ));
        }
        if let Some(i) = self
            .scales
            .iter()
            .position(|&s| !half::f16::from_bits(s).is_finite())
        {
            return bad(format!("scale {i} is not finite"));
        }
        match self.payload {
            Payload::Int(b) if b < 8 => {
                if let Some(i) = self.codes.iter().position(|&c| c >> b != 0) {
                    return bad(format!("code {i} has more than {b} bits"));
                }
            }
            Payload::Fp8E4m3 => {
                if let Some(i) = self.codes.iter().position(|&c| c & 0x7F == 0x7F) {
                    return bad(format!("code {i} is an FP8 NaN"));
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// How the scales are stored: f16 bits as they are, or dtANS-coded as an FP16 matrix padded with
/// its last value (whichever is smaller).
#[derive(Clone, Debug, PartialEq)]
pub enum ScaleStore {
    Raw(Vec<u16>),
    Coded { n: usize, stream: DtansTensor },
}

impl ScaleStore {
    pub fn stored_bytes(&self) -> usize {
        match self {
            ScaleStore::Raw(v) => 2 * v.len(),
            ScaleStore::Coded { stream, .. } => stream.stored_bytes(),
        }
    }

    pub fn decode(&self) -> Result<Vec<u16>> {
        match self {
            ScaleStore::Raw(v) => Ok(v.clone()),
            ScaleStore::Coded { n, stream } => {
                if stream.payload != Payload::Fp16 || stream.rows * stream.cols < *n {
                    return Err(CodecError::Corrupt(format!(
                        "a scale stream of {:?} {}×{} cannot hold {n} scales",
                        stream.payload, stream.rows, stream.cols
                    )));
                }
                let b = stream.decode()?;
                Ok(b[..2 * n]
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect())
            }
        }
    }

    /// The smaller of the two for `scales`, and its (exact) stored bytes.
    fn encode(scales: &[u16]) -> Result<ScaleStore> {
        let raw = ScaleStore::Raw(scales.to_vec());
        // A coded stream has at least a 32 × 64 matrix and its tables: not worth it below that.
        if scales.len() < 2048 {
            return Ok(raw);
        }
        let (r, c, bytes) = scale_matrix(scales);
        let (codes, rawb) = Payload::Fp16.symbolize(&bytes)?;
        let (coding, predicted) = choose_coding_and_width(Payload::Fp16, r, c, &codes)?;
        if predicted >= raw.stored_bytes() as f64 {
            return Ok(raw);
        }
        let stream = DtansTensor::encode(Payload::Fp16, r, c, &codes, &rawb, coding)?;
        Ok(match stream.stored_bytes() < raw.stored_bytes() {
            true => ScaleStore::Coded {
                n: scales.len(),
                stream,
            },
            false => raw,
        })
    }

    /// Predicted stored bytes of [`Self::encode`].
    fn predict(scales: &[u16]) -> Result<f64> {
        let raw = 2.0 * scales.len() as f64;
        if scales.len() < 2048 {
            return Ok(raw);
        }
        let (r, c, bytes) = scale_matrix(scales);
        let (codes, _) = Payload::Fp16.symbolize(&bytes)?;
        Ok(choose_coding_and_width(Payload::Fp16, r, c, &codes)?
            .1
            .min(raw))
    }
}

/// The [rows × cols] matrix `n` FP16 scales are coded as: whole bands of 32 rows (the dtANS
/// coder's tiles) and columns a multiple of 64 (its narrowest slice), the least padding of up to
/// 16 bands.
pub fn scale_matrix_shape(n: usize) -> (usize, usize) {
    (1..=16)
        .map(|k| (32 * k, n.div_ceil(32 * k).next_multiple_of(64).max(64)))
        .min_by_key(|&(r, c)| r * c)
        .expect("sixteen candidates")
}

/// `v` as the FP16 matrix of [`scale_matrix_shape`], row-major, padded with its last value.
pub fn scale_matrix(v: &[u16]) -> (usize, usize, Vec<u8>) {
    let (rows, cols) = scale_matrix_shape(v.len());
    let last = v.last().copied().unwrap_or(0);
    let bytes = v
        .iter()
        .copied()
        .chain(std::iter::repeat(last))
        .take(rows * cols)
        .flat_map(u16::to_le_bytes)
        .collect();
    (rows, cols, bytes)
}

/// A scalar-quantised matrix as stored: its codes dtANS-coded, its scales beside them.
#[derive(Clone, Debug, PartialEq)]
pub struct ScalarTensor {
    pub quantizer: Scalar,
    pub group: usize,
    pub codes: DtansTensor,
    pub scales: ScaleStore,
}

impl ScalarTensor {
    pub fn rows(&self) -> usize {
        self.codes.rows
    }
    pub fn cols(&self) -> usize {
        self.codes.cols
    }
    pub fn stored_bytes(&self) -> usize {
        self.codes.stored_bytes() + self.scales.stored_bytes()
    }
    pub fn bits_per_weight(&self) -> f64 {
        8.0 * self.stored_bytes() as f64 / (self.rows() * self.cols()) as f64
    }

    /// Shapes checked without decoding: the codes' payload is the quantiser's, groups are whole
    /// and the scales cover them (a container's tensor, before it is served).
    pub fn check_shape(&self) -> Result<()> {
        self.codes.validate()?;
        let (rows, cols) = (self.rows(), self.cols());
        let payload_ok = match self.quantizer {
            Scalar::Int { .. } => matches!(self.codes.payload, Payload::Int(_)),
            Scalar::Fp8 => self.codes.payload == Payload::Fp8E4m3 && self.group == cols,
        };
        let groups = match self.group > 0 && cols.is_multiple_of(self.group) {
            true => rows.checked_mul(cols / self.group),
            false => None,
        };
        let n = match &self.scales {
            ScaleStore::Raw(v) => Some(v.len()),
            ScaleStore::Coded { n, stream } => (stream.payload == Payload::Fp16
                && stream
                    .rows
                    .checked_mul(stream.cols)
                    .is_some_and(|m| m >= *n))
            .then_some(*n),
        };
        if !payload_ok || groups.is_none() || n != groups {
            return Err(CodecError::Corrupt(format!(
                "{} codes of {:?} for a {rows}×{cols} matrix in groups of {} with {n:?} scales",
                self.quantizer, self.codes.payload, self.group
            )));
        }
        Ok(())
    }

    /// The codes and scales, checked: a hostile stream is an error, never a panic.
    pub fn to_codes(&self) -> Result<ScalarCodes> {
        self.check_shape()?;
        let c = ScalarCodes {
            rows: self.rows(),
            cols: self.cols(),
            payload: self.codes.payload,
            group: self.group,
            codes: self.codes.decode()?,
            scales: self.scales.decode()?,
        };
        c.validate()?;
        let want = match self.quantizer {
            Scalar::Int { .. } => matches!(c.payload, Payload::Int(_)),
            Scalar::Fp8 => c.payload == Payload::Fp8E4m3 && c.group == c.cols,
        };
        if !want {
            return Err(CodecError::Corrupt(format!(
                "{} codes stored as {:?} in groups of {}",
                self.quantizer, c.payload, c.group
            )));
        }
        Ok(c)
    }

    /// The reconstruction.
    pub fn decode(&self) -> Result<Vec<f32>> {
        Ok(self.to_codes()?.decode())
    }

    /// Codes `c` (dtANS, the coding predicted smallest; the scales as [`ScaleStore`] chooses).
    pub fn from_codes(quantizer: Scalar, c: &ScalarCodes) -> Result<ScalarTensor> {
        let (coding, _) = choose_coding_and_width(c.payload, c.rows, c.cols, &c.codes)?;
        Self::coded_as(quantizer, c, coding)
    }

    fn coded_as(quantizer: Scalar, c: &ScalarCodes, coding: Coding) -> Result<ScalarTensor> {
        Ok(ScalarTensor {
            quantizer,
            group: c.group,
            codes: DtansTensor::encode(c.payload, c.rows, c.cols, &c.codes, &[], coding)?,
            scales: ScaleStore::encode(&c.scales)?,
        })
    }
}

/// Predicted stored bytes of [`ScalarTensor::from_codes`], from histograms.
pub fn predict_bytes(c: &ScalarCodes) -> Result<f64> {
    let (_, codes) = choose_coding_and_width(c.payload, c.rows, c.cols, &c.codes)?;
    Ok(codes + ScaleStore::predict(&c.scales)?)
}

/// What [`encode`] measured.
#[derive(Clone, Debug)]
pub struct ScalarReport {
    /// log2 of the knob (step or row scale in units of the group RMS).
    pub log2_knob: f64,
    /// The codes' empirical entropy, bits a weight.
    pub code_entropy: f64,
    /// The scales' stored bits a weight.
    pub scale_bits: f64,
    /// Size predictions made (histograms only) and codings done.
    pub predictions: u32,
    pub passes: u32,
}

/// Quantises `w` (`rows × cols`, row-major) with knob `2^log2_knob`, each group's scale refitted
/// to its codes by least squares weighted by `col_weights` (per column; `None`: alike).
pub fn quantize(
    w: &[f32],
    rows: usize,
    cols: usize,
    q: Scalar,
    log2_knob: f64,
    col_weights: Option<&[f32]>,
) -> ScalarCodes {
    quantize_in(w, rows, cols, q, log2_knob, col_weights, None, None)
}

/// [`quantize`], integer codes clipped to `int_bits` bits and stored in that payload where given
/// (so that one dtANS coding fits every knob of a search); with `feedback`, integer codes are
/// rounded with GPTQ error feedback on the same grid, each scale the step itself (a refit would
/// undo the feedback's compensation).
#[allow(clippy::too_many_arguments)]
fn quantize_in(
    w: &[f32],
    rows: usize,
    cols: usize,
    q: Scalar,
    log2_knob: f64,
    col_weights: Option<&[f32]>,
    int_bits: Option<u8>,
    feedback: Option<&Feedback>,
) -> ScalarCodes {
    let (lo, hi) = int_bits.map_or((-128, 127), |b| (-(1 << (b - 1)), (1 << (b - 1)) - 1));
    let group = q.group(cols);
    let knob = 2f64.powf(log2_knob) as f32;
    let per_row = cols / group;
    let mut scales = vec![0u16; rows * per_row];
    // Codes (ints as i32, sized later) and refitted scales.
    let fit = |x: &[f32], h: Option<&[f32]>, vals: &[f32]| -> f32 {
        let (mut num, mut den) = (0f64, 0f64);
        for (i, (&x, &v)) in x.iter().zip(vals).enumerate() {
            let h = h.map_or(1.0, |h| h[i] as f64);
            num += h * x as f64 * v as f64;
            den += h * v as f64 * v as f64;
        }
        if den > 0.0 {
            (num / den) as f32
        } else {
            0.0
        }
    };
    match q {
        Scalar::Int { dead_zone, .. } if feedback.is_some() => {
            let f = feedback.expect("matched");
            // The step plain rounding takes (below), as stored: an f16.
            scales
                .par_chunks_mut(per_row)
                .zip(w.par_chunks(cols))
                .for_each(|(sr, wr)| {
                    for (s, wg) in sr.iter_mut().zip(wr.chunks(group)) {
                        let rms = (wg.iter().map(|&v| v as f64 * v as f64).sum::<f64>()
                            / group as f64)
                            .sqrt() as f32;
                        let max = wg.iter().fold(0f32, |m, v| m.max(v.abs()));
                        let step = (knob * rms).max(max / (hi as f32 + 0.49));
                        *s = match step > 0.0 && step.is_finite() {
                            true => half::f16::from_f32(step).to_bits(),
                            false => 0,
                        };
                    }
                });
            let steps: Vec<f32> = scales
                .iter()
                .map(|&s| half::f16::from_bits(s).to_f32())
                .collect();
            let qv = f.round(w, rows, group, &steps, (lo, hi), dead_zone);
            int_codes(rows, cols, group, &qv, scales, int_bits)
        }
        Scalar::Int { dead_zone, .. } => {
            let mut qv = vec![0i32; rows * cols];
            qv.par_chunks_mut(cols)
                .zip(scales.par_chunks_mut(per_row))
                .zip(w.par_chunks(cols))
                .for_each(|((qr, sr), wr)| {
                    let mut vals = vec![0f32; group];
                    for (gi, ((qg, s), wg)) in qr
                        .chunks_mut(group)
                        .zip(sr.iter_mut())
                        .zip(wr.chunks(group))
                        .enumerate()
                    {
                        let rms = (wg.iter().map(|&v| v as f64 * v as f64).sum::<f64>()
                            / group as f64)
                            .sqrt() as f32;
                        // Never so fine that the group's largest weight would clip.
                        let max = wg.iter().fold(0f32, |m, v| m.max(v.abs()));
                        let step = (knob * rms).max(max / (hi as f32 + 0.49));
                        if !(step > 0.0 && step.is_finite()) {
                            qg.fill(0);
                            *s = 0;
                            continue;
                        }
                        for ((o, &x), v) in qg.iter_mut().zip(wg).zip(vals.iter_mut()) {
                            let t = x / step;
                            let k = if t.abs() < 0.5 + dead_zone {
                                0
                            } else {
                                (t.round() as i32).clamp(lo, hi)
                            };
                            *o = k;
                            *v = k as f32;
                        }
                        let h = col_weights.map(|h| &h[gi * group..(gi + 1) * group]);
                        *s = half::f16::from_f32(fit(wg, h, &vals)).to_bits();
                    }
                });
            int_codes(rows, cols, group, &qv, scales, int_bits)
        }
        Scalar::Fp8 => {
            let mut codes = vec![0u8; rows * cols];
            codes
                .par_chunks_mut(cols)
                .zip(scales.par_chunks_mut(1))
                .zip(w.par_chunks(cols))
                .for_each(|((cr, s), wr)| {
                    let rms = (wr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cols as f64)
                        .sqrt() as f32;
                    let max = wr.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let scale = (knob * rms).max(max / 448.0);
                    if !(scale > 0.0 && scale.is_finite()) {
                        cr.fill(0);
                        s[0] = 0;
                        return;
                    }
                    let vals: Vec<f32> = cr
                        .iter_mut()
                        .zip(wr)
                        .map(|(c, &x)| {
                            // −0 as +0: one code for zero, not two (a bit a weight at low rates).
                            *c = match fp8_round(x / scale) {
                                0x80 => 0,
                                c => c,
                            };
                            fp8_e4m3_to_f32(*c)
                        })
                        .collect();
                    s[0] = half::f16::from_f32(fit(wr, col_weights, &vals)).to_bits();
                });
            ScalarCodes {
                rows,
                cols,
                payload: Payload::Fp8E4m3,
                group,
                codes,
                scales,
            }
        }
    }
}

/// Integer codes `qv` in the payload of `int_bits` bits, or of the fewest that hold them.
fn int_codes(
    rows: usize,
    cols: usize,
    group: usize,
    qv: &[i32],
    scales: Vec<u16>,
    int_bits: Option<u8>,
) -> ScalarCodes {
    let max = qv.iter().map(|v| v.unsigned_abs()).max().unwrap_or(0);
    // Signed codes of b bits hold -2^(b-1) ..= 2^(b-1) - 1.
    let b = int_bits.unwrap_or_else(|| {
        (2..=8u8)
            .find(|&b| (max as i64) < (1i64 << (b - 1)))
            .unwrap_or(8)
    });
    let mask = (1u32 << b) - 1;
    ScalarCodes {
        rows,
        cols,
        payload: Payload::Int(b),
        group,
        codes: qv.par_iter().map(|&v| (v as u32 & mask) as u8).collect(),
        scales,
    }
}

/// Bits a weight of `c`'s codes at their empirical entropy.
fn code_entropy(c: &ScalarCodes) -> f64 {
    entropy_bits(&crate::histogram::byte_histogram(&c.codes))
}

/// Rows of the step search: evenly spaced whole rows, about [`SAMPLE_WEIGHTS`] weights.
fn sample(w: &[f32], rows: usize, cols: usize) -> (Vec<f32>, usize) {
    let take = SAMPLE_WEIGHTS.div_ceil(cols).clamp(1, rows);
    if take == rows {
        return (w.to_vec(), rows);
    }
    let mut out = Vec::with_capacity(take * cols);
    for i in 0..take {
        let r = i * rows / take;
        out.extend_from_slice(&w[r * cols..(r + 1) * cols]);
    }
    (out, take)
}

/// The knob (log2) at which `bits(knob)` = `target`, by bisection: `bits` falls as the knob grows.
fn solve(range: (f64, f64), target: f64, bits: impl Fn(f64) -> f64) -> f64 {
    let (mut lo, mut hi) = range;
    for _ in 0..40 {
        let mid = 0.5 * (lo + hi);
        if bits(mid) > target {
            lo = mid;
        } else {
            hi = mid;
        }
        if hi - lo < 1e-5 {
            break;
        }
    }
    0.5 * (lo + hi)
}

/// A coded knob and its stored bits a weight.
type Seen = (f64, f64);

/// Codes `w` with `q` at `bits` stored bits a weight (codes and scales, every byte counted).
/// The knob is solved on code histograms: on sampled rows' entropy plus the dtANS size
/// predictor's excess measured on the whole matrix, then on the whole matrix's entropy plus the
/// excess its coding showed; once a coding has landed on both sides of the rate, by interpolating
/// the two. Most matrices are coded once or twice (small ones, whose overheads the predictor
/// misses by more, up to ten times). An unreachable rate is an error naming the range.
pub fn encode(
    w: &[f32],
    rows: usize,
    cols: usize,
    q: Scalar,
    bits: f64,
    col_weights: Option<&[f32]>,
) -> Result<(ScalarTensor, ScalarReport)> {
    encode_with_feedback(w, rows, cols, q, bits, col_weights, None)
}

/// [`encode`], integer codes rounded with GPTQ error feedback where `feedback` is given (its
/// Hessian's columns are `cols`). The knob is searched as for plain rounding, whose code entropy
/// stands in for the feedback codes' (smooth and cheap) with the difference in the offset that
/// each coding measures; a feedback pass is made only for each coding.
pub fn encode_with_feedback(
    w: &[f32],
    rows: usize,
    cols: usize,
    q: Scalar,
    bits: f64,
    col_weights: Option<&[f32]>,
    feedback: Option<&Feedback>,
) -> Result<(ScalarTensor, ScalarReport)> {
    q.check()?;
    if let Some(f) = feedback {
        if f.cols() != cols || !matches!(q, Scalar::Int { .. }) {
            return Err(CodecError::Shape(format!(
                "error feedback of {} columns for {q} codes of a {rows}×{cols} matrix (integer \
                 codes only)",
                f.cols()
            )));
        }
    }
    if rows == 0 || cols == 0 || w.len() != rows * cols {
        return Err(CodecError::Shape(format!(
            "{} values for a {rows} × {cols} matrix",
            w.len()
        )));
    }
    if !cols.is_multiple_of(q.group(cols)) {
        return Err(CodecError::Shape(format!(
            "{q} codes whole groups of {} columns; this row has {cols}",
            q.group(cols)
        )));
    }
    if let Some(i) = w.iter().position(|v| !v.is_finite()) {
        return Err(CodecError::Unsupported(format!(
            "weight {i} is {}: lossy coding takes finite weights",
            w[i]
        )));
    }
    if col_weights.is_some_and(|h| h.len() != cols || h.iter().any(|v| v.is_nan() || *v < 0.0)) {
        return Err(CodecError::Shape(format!(
            "column weights must be {cols} non-negative numbers"
        )));
    }
    if !(bits > 0.0 && bits <= 16.0) {
        return Err(CodecError::Unsupported(format!(
            "{bits} bits a weight: give more than 0 and at most 16"
        )));
    }
    let n = (rows * cols) as f64;
    let (sw, srows) = sample(w, rows, cols);
    let sample_bits = |k: f64| code_entropy(&quantize(&sw, srows, cols, q, k, col_weights));
    let range = q.knob_range(w, cols);
    // Offset in bits a weight: start from f16 scales uncoded.
    let mut offset = 16.0 / q.group(cols) as f64;
    let mut predictions = 0;
    let mut k = 0.0;
    let mut c = None;
    // Near the target on the sample's entropy, with the whole matrix's predicted excess.
    for _ in 0..2 {
        k = solve(range, bits, |k| sample_bits(k) + offset);
        let full = quantize(w, rows, cols, q, k, col_weights);
        let pred = 8.0 * predict_bytes(&full)? / n;
        predictions += 1;
        offset = pred - sample_bits(k);
        c = Some(full);
    }
    // Then on the whole matrix's predicted size in one coding (its size is then continuous in the
    // knob, where the choice of coding would jump), the integer payload fixed with it.
    let first = c.expect("two rounds");
    // Integer codes get the bits they need half an octave finer than the estimate, so that the
    // search below is not capped by them.
    let int_bits = match quantize(w, rows, cols, q, k - 0.5, col_weights).payload {
        Payload::Int(b) => Some(b.max(match first.payload {
            Payload::Int(f) => f,
            _ => 2,
        })),
        _ => None,
    };
    let first = quantize_in(w, rows, cols, q, k, col_weights, int_bits, feedback);
    let (chosen, _) = choose_coding_and_width(first.payload, rows, cols, &first.codes)?;
    let at = |k: f64| quantize_in(w, rows, cols, q, k, col_weights, int_bits, feedback);
    // The whole matrix's code entropy is smooth and monotone in the knob; the coder's excess over
    // it (and the scales) changes slowly, so it is an offset: first the predictor's, then what the
    // stored size shows (the predictor misses small matrices by several percent). With feedback,
    // plain rounding's entropy, the feedback codes' excess over it in the offset.
    let entropy = |k: f64| {
        code_entropy(&quantize_in(
            w,
            rows,
            cols,
            q,
            k,
            col_weights,
            int_bits,
            None,
        ))
    };
    let offset0 = 8.0 * predict_bytes(&first)? / n - entropy(k);
    let k0 = k;
    let mut passes = 0;
    let mut best: Option<(f64, ScalarTensor, ScalarCodes)> = None;
    // The chosen coding first. Where its size jumps over the rate (the values a Pair/Quad table
    // keeps, and so what escapes, change with the knob), codings that keep every value and
    // escape nothing, whose size is smooth in the knob.
    let smooth = |log2_m| Coding {
        mode: crate::dtans::Mode::Single,
        log2_m,
        t: None,
        ..chosen
    };
    let mut tried = Vec::new();
    for i in 0..5 {
        if best.as_ref().is_some_and(|b| b.0 <= 0.01 * bits) {
            break;
        }
        let coding = match i {
            0 => chosen,
            // The coding predicted smallest where the first one missed (the first was chosen at
            // an estimate of the knob; a table with a floor of bits a symbol can be stuck there).
            1 => match &best {
                Some((_, _, c)) => choose_coding_and_width(c.payload, rows, cols, &c.codes)?.0,
                None => continue,
            },
            2 => smooth(chosen.log2_m),
            3 => smooth(10),
            _ => smooth(9),
        };
        if tried.contains(&coding) {
            continue;
        }
        tried.push(coding);
        let (mut k, mut offset, mut tries) = (k0, offset0, 0);
        // Stored sizes seen below the knob that overshoots and above the one that undershoots.
        let (mut over, mut under): (Option<Seen>, Option<Seen>) = (None, None);
        loop {
            k = match (over, under) {
                // Bracketed: interpolate the stored size (a fixed coding's size is smooth in the
                // knob), every third pass halving the bracket instead, so that a bend in the size
                // cannot stall the interpolation at one end.
                (Some((ka, sa)), Some((kb, sb))) if tries % 3 != 2 => {
                    ka + (kb - ka) * (sa - bits) / (sa - sb)
                }
                (Some((ka, _)), Some((kb, _))) => 0.5 * (ka + kb),
                _ => {
                    // Bisection on the entropy within a bracket about the estimate, widened as
                    // needed.
                    let target = bits - offset;
                    let (mut lo, mut hi) = ((k - 0.25).max(range.0), (k + 0.25).min(range.1));
                    while lo > range.0 && entropy(lo) < target {
                        lo = (lo - 0.5).max(range.0);
                        predictions += 1;
                    }
                    while hi < range.1 && entropy(hi) > target {
                        hi = (hi + 0.5).min(range.1);
                        predictions += 1;
                    }
                    for _ in 0..16 {
                        let mid = 0.5 * (lo + hi);
                        predictions += 1;
                        if entropy(mid) > target {
                            lo = mid;
                        } else {
                            hi = mid;
                        }
                    }
                    0.5 * (lo + hi)
                }
            };
            let codes = at(k);
            let t = ScalarTensor::coded_as(q, &codes, coding)?;
            passes += 1;
            tries += 1;
            let stored = t.bits_per_weight();
            offset = match feedback {
                Some(_) => stored - entropy(k),
                None => stored - code_entropy(&codes),
            };
            match stored > bits {
                true => over = Some((k, stored)),
                false => under = Some((k, stored)),
            }
            let miss = (stored - bits).abs();
            if best.as_ref().is_none_or(|b| miss < b.0) {
                best = Some((miss, t, codes));
            }
            if tries == 10 || miss <= STORED_TOL * bits {
                break;
            }
        }
    }
    let (_, t, c) = best.expect("coded once");
    let got = t.bits_per_weight();
    if (got - bits).abs() > 0.01 * bits {
        let lo = 8.0 * predict_bytes(&quantize(w, rows, cols, q, range.1, col_weights))? / n;
        let hi = 8.0 * predict_bytes(&quantize(w, rows, cols, q, range.0, col_weights))? / n;
        return Err(CodecError::Unsupported(format!(
            "{q} cannot code this {rows}×{cols} matrix at {bits} bits a weight (it stores \
             {got:.3}; its codes reach {lo:.2} to {hi:.2})"
        )));
    }
    Ok((
        t,
        ScalarReport {
            log2_knob: k,
            code_entropy: code_entropy(&c),
            scale_bits: 8.0 * ScaleStore::predict(&c.scales)? / n,
            predictions,
            passes,
        },
    ))
}

/// Points of this matrix's rate–distortion curve at knobs a quarter octave apart, from the code
/// histograms and the reconstruction of sampled rows (no coding): (bits a weight, with the
/// predictor's offset measured once at the middle; weighted squared error over weighted energy).
/// Spans at least `bits.0..=bits.1` where the quantiser reaches it. What an allocation of rates
/// across matrices prices a matrix by.
pub fn rd_curve(
    w: &[f32],
    rows: usize,
    cols: usize,
    q: Scalar,
    col_weights: Option<&[f32]>,
    bits: (f64, f64),
) -> Result<Vec<(f64, f64)>> {
    q.check()?;
    let (sw, srows) = sample(w, rows, cols);
    let group = q.group(cols);
    let mid = 0.5 * (bits.0 + bits.1);
    let range = q.knob_range(w, cols);
    let sample_bits = |k: f64| code_entropy(&quantize(&sw, srows, cols, q, k, col_weights));
    let k_mid = solve(range, mid, |k| sample_bits(k) + 16.0 / group as f64);
    let c = quantize(&sw, srows, cols, q, k_mid, col_weights);
    let offset = 8.0 * predict_bytes(&c)? / (srows * cols) as f64 - code_entropy(&c);
    let h = |j: usize| col_weights.map_or(1.0, |h| h[j % cols] as f64);
    let energy: f64 = sw
        .iter()
        .enumerate()
        .map(|(j, &x)| h(j) * x as f64 * x as f64)
        .sum::<f64>()
        .max(1e-300);
    let mut points = vec![];
    let mut k = solve(range, bits.1 + 0.5, |k| sample_bits(k) + offset);
    loop {
        let c = quantize(&sw, srows, cols, q, k, col_weights);
        let r = code_entropy(&c) + offset;
        let back = c.decode();
        let err: f64 = sw
            .iter()
            .zip(&back)
            .enumerate()
            .map(|(j, (&a, &b))| h(j) * (a as f64 - b as f64).powi(2))
            .sum();
        points.push((r, (err / energy).max(1e-30)));
        if r < bits.0 - 0.25 || k >= range.1 {
            break;
        }
        k += 0.25;
    }
    points.reverse();
    Ok(points)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::f32_to_fp8_e4m3;
    use crate::rng::SplitMix64 as Rng;

    fn gaussian(rng: &mut Rng, n: usize, sigma: f32) -> Vec<f32> {
        (0..n).map(|_| rng.normal() as f32 * sigma).collect()
    }

    fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
        let e: f64 = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
            .sum();
        let s: f64 = a.iter().map(|&x| x as f64 * x as f64).sum();
        (e / s).sqrt()
    }

    #[test]
    fn fp8_round_matches_the_search_on_every_binade() {
        let mut rng = Rng::new(3);
        let mut vals: Vec<f32> = (0..200_000)
            .map(|_| {
                let e = (rng.next_u64() % 40) as i32 - 20;
                (rng.normal() as f32) * 2f32.powi(e)
            })
            .collect();
        // Every code, its neighbours' midpoints and the saturation edge.
        for c in 0u8..0x7F {
            let v = fp8_e4m3_to_f32(c);
            let next = fp8_e4m3_to_f32(c + 1);
            vals.extend([v, -v, 0.5 * (v + next), -0.5 * (v + next)]);
        }
        vals.extend([448.0, 463.9, 464.0, 500.0, 1e30, -1e30, 0.0, -0.0, 1e-30]);
        for v in vals {
            assert_eq!(fp8_round(v), f32_to_fp8_e4m3(v), "{v}");
        }
    }

    /// Rate within 1 % of the target, every byte counted, and the error where a uniform
    /// quantiser with entropy coding puts it (within 0.4 bit of the Shannon bound 2^-R on
    /// Gaussian weights at 3–6 bits).
    #[test]
    fn int_meets_the_rate_and_the_error_bound() {
        let mut rng = Rng::new(7);
        let (rows, cols) = (256, 1024);
        let w = gaussian(&mut rng, rows * cols, 0.02);
        for bits in [2.0, 3.0, 4.0, 5.0, 6.0] {
            let q = Scalar::Int {
                group: 128,
                dead_zone: 0.0,
            };
            let (t, _) = encode(&w, rows, cols, q, bits, None).unwrap();
            let got = t.bits_per_weight();
            assert!((got - bits).abs() <= 0.01 * bits, "{bits}: {got}");
            let e = rel_l2(&w, &t.decode().unwrap());
            let bound = 2f64.powf(-bits);
            assert!(
                e < bound * 2f64.powf(0.45),
                "{bits}: rel L2 {e}, bound {bound}"
            );
        }
    }

    /// Small and narrow matrices (the coder's overheads loom largest there) at 2–6 bits, both
    /// quantisers: the rate within 1 %.
    /// Weights on a coarse grid (Q4_1's: 16 levels a block of 32, as SmolLM2's F32 weights are),
    /// with calibration column weights, at rates where a Pair table's kept values change with the
    /// step (where a SmolLM2 matrix once missed its rate: bench/RESULTS.md): every rate is met
    /// within 1 %, falling back to codings that escape nothing where the chosen one jumps.
    #[test]
    fn gridded_weights_meet_the_rate_with_calibration() {
        let mut rng = Rng::new(45);
        let (rows, cols) = (192, 576);
        let w: Vec<f32> = gaussian(&mut rng, rows * cols, 0.05)
            .chunks(32)
            .flat_map(|b| {
                let (lo, hi) = b
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
                let d = (hi - lo) / 15.0;
                b.iter()
                    .map(move |&v| lo + ((v - lo) / d).round() * d)
                    .collect::<Vec<_>>()
            })
            .collect();
        let h: Vec<f32> = (0..cols)
            .map(|_| (rng.normal().abs() + 0.05) as f32)
            .collect();
        let q = Scalar::Int {
            group: 128,
            dead_zone: 0.0,
        };
        for i in 0..12 {
            let bits = 4.9 + 0.05 * i as f64;
            let (t, _) = encode(&w, rows, cols, q, bits, Some(&h))
                .unwrap_or_else(|e| panic!("{bits} bits: {e}"));
            let got = t.bits_per_weight();
            assert!((got - bits).abs() <= 0.01 * bits, "{bits}: {got}");
        }
    }

    #[test]
    fn small_matrices_meet_the_rate_too() {
        let mut rng = Rng::new(19);
        for (rows, cols) in [(192, 192), (64, 576), (1536, 96)] {
            let w = gaussian(&mut rng, rows * cols, 0.05);
            for q in [
                Scalar::Fp8,
                Scalar::Int {
                    group: 128,
                    dead_zone: 0.0,
                },
                Scalar::Int {
                    group: 32,
                    dead_zone: 0.15,
                },
            ] {
                for bits in [2.0, 3.0, 4.0, 5.0, 6.0] {
                    let (t, _) = encode(&w, rows, cols, q, bits, None)
                        .unwrap_or_else(|e| panic!("{q} {rows}x{cols} {bits}: {e}"));
                    let got = t.bits_per_weight();
                    assert!((got - bits).abs() <= 0.01 * bits, "{q} {bits}: {got}");
                }
            }
        }
    }

    /// One outlier group (as real matrices have) neither caps the rate nor clips: its step stops
    /// where its largest weight fits while the others' go finer.
    #[test]
    fn an_outlier_does_not_cap_the_rate() {
        let mut rng = Rng::new(23);
        let (rows, cols) = (384, 1536);
        let mut w = gaussian(&mut rng, rows * cols, 0.02);
        w[777] = 3.0;
        for q in [
            Scalar::Fp8,
            Scalar::Int {
                group: 128,
                dead_zone: 0.0,
            },
        ] {
            // FP8 codes of Gaussian rows carry at most about 6.6 bits.
            let top = if q == Scalar::Fp8 { 6.0 } else { 7.0 };
            for bits in [2.0, 6.0, top] {
                let (t, _) = encode(&w, rows, cols, q, bits, None).unwrap();
                let got = t.bits_per_weight();
                assert!((got - bits).abs() <= 0.01 * bits, "{q} {bits}: {got}");
                let back = t.decode().unwrap();
                assert!((back[777] - 3.0).abs() < 0.05, "{q} {bits}: {}", back[777]);
            }
        }
    }

    #[test]
    fn fp8_meets_the_rate_and_beats_plain_fp8_error_at_its_rate() {
        let mut rng = Rng::new(9);
        let (rows, cols) = (192, 768);
        let w = gaussian(&mut rng, rows * cols, 0.03);
        for bits in [2.0, 3.0, 4.0, 5.0] {
            let (t, _) = encode(&w, rows, cols, Scalar::Fp8, bits, None).unwrap();
            let got = t.bits_per_weight();
            assert!((got - bits).abs() <= 0.01 * bits, "{bits}: {got}");
            let c = t.to_codes().unwrap();
            assert_eq!((c.payload, c.group), (Payload::Fp8E4m3, cols));
            let e = rel_l2(&w, &t.decode().unwrap());
            // Within a bit of the bound: FP8's grid is not uniform, but at these rates most
            // weights sit on its uniform subnormal part.
            assert!(e < 2f64.powf(-bits + 1.0), "{bits}: rel L2 {e}");
        }
    }

    /// Ragged shapes, a dead zone, zero rows and groups, column weights: the round trip through
    /// the stored form is the quantised codes exactly, and each weight is within half a step of
    /// its source (the dead zone's width where it is zeroed), plus the scale refit's change.
    #[test]
    fn round_trips_exactly_and_errors_stay_within_the_step() {
        let mut rng = Rng::new(11);
        for (rows, cols, group, dz) in [(1, 64, 64, 0.0), (33, 96, 32, 0.2), (70, 200, 8, 0.1)] {
            let mut w = gaussian(&mut rng, rows * cols, 1.0);
            // A zero row and a zero group.
            w[..cols].fill(0.0);
            if rows > 2 {
                w[cols + group..cols + 2 * group].fill(0.0);
            }
            let h: Vec<f32> = (0..cols).map(|j| 0.5 + (j % 7) as f32).collect();
            let q = Scalar::Int {
                group,
                dead_zone: dz,
            };
            let c = quantize(&w, rows, cols, q, -2.0, Some(&h));
            c.validate().unwrap();
            let t = ScalarTensor::from_codes(q, &c).unwrap();
            assert_eq!(t.to_codes().unwrap(), c);
            let back = c.decode();
            assert!(back[..cols].iter().all(|&v| v == 0.0));
            let scales = c.scales_f32();
            for (i, (&a, &b)) in w.iter().zip(&back).enumerate() {
                let (r, g) = (i / cols, (i % cols) / group);
                let wg = &w[r * cols + g * group..r * cols + (g + 1) * group];
                let rms = (wg.iter().map(|v| v * v).sum::<f32>() / group as f32).sqrt();
                let step = 0.25 * rms;
                // The refit moves a weight by at most |q|·|s − step|.
                let k = ScalarCodes::value(c.payload, c.codes[i]).abs();
                let slack = (0.5 + dz) * step + k * (scales[r * (cols / group) + g] - step).abs();
                assert!((a - b).abs() <= slack * 1.001 + 1e-6, "{rows}x{cols} #{i}");
            }
        }
    }

    #[test]
    fn hostile_stored_forms_are_errors() {
        let mut rng = Rng::new(13);
        let (rows, cols) = (64, 256);
        let w = gaussian(&mut rng, rows * cols, 1.0);
        let q = Scalar::Int {
            group: 64,
            dead_zone: 0.0,
        };
        let (t, _) = encode(&w, rows, cols, q, 3.0, None).unwrap();
        // Groups that do not divide the row, scales missing, a non-finite scale, FP8 claimed.
        let mut bad = t.clone();
        bad.group = 100;
        assert!(bad.decode().is_err());
        let mut bad = t.clone();
        bad.scales = ScaleStore::Raw(vec![0; 3]);
        assert!(bad.decode().is_err());
        let mut bad = t.clone();
        let mut s = t.scales.decode().unwrap();
        s[5] = half::f16::INFINITY.to_bits();
        bad.scales = ScaleStore::Raw(s);
        assert!(bad.decode().is_err());
        let mut bad = t.clone();
        bad.quantizer = Scalar::Fp8;
        assert!(bad.decode().is_err());
        // Corrupt stream words decode to an error or to codes the checks accept, never a panic.
        for i in 0..64 {
            let mut bad = t.clone();
            let j = (i * 7919) % bad.codes.stream.len();
            bad.codes.stream[j] ^= 0xDEAD_BEEF;
            let _ = bad.decode();
        }
        // FP8 NaN codes are refused.
        let c = ScalarCodes {
            rows: 1,
            cols: 4,
            payload: Payload::Fp8E4m3,
            group: 4,
            codes: vec![0, 0x7F, 1, 2],
            scales: vec![half::f16::ONE.to_bits()],
        };
        assert!(c.validate().is_err());
        // Unreachable rates and bad options are errors.
        assert!(encode(&w, rows, cols, Scalar::Fp8, 12.0, None).is_err());
        assert!(encode(
            &w,
            rows,
            cols,
            Scalar::Int {
                group: 0,
                dead_zone: 0.0
            },
            3.0,
            None
        )
        .is_err());
        assert!(encode(&w, rows, 200, q, 3.0, None).is_err());
    }

    /// Inputs whose channels are correlated (each a mix of its neighbours) and unequal in scale,
    /// `n` of them, row-major.
    fn correlated_inputs(rng: &mut Rng, n: usize, cols: usize, scale: &[f64]) -> Vec<f64> {
        let z: Vec<f64> = (0..n * cols).map(|_| rng.normal()).collect();
        let mix = [1.0, 0.9, 0.7, 0.5, 0.3];
        let mut x = vec![0f64; n * cols];
        for t in 0..n {
            for j in 0..cols {
                let v: f64 = mix
                    .iter()
                    .enumerate()
                    .map(|(d, a)| a * z[t * cols + (j + d) % cols])
                    .sum();
                x[t * cols + j] = v * scale[j];
            }
        }
        x
    }

    /// Σ xxᵀ of `x` (`n × cols`).
    fn gram(x: &[f64], cols: usize) -> Vec<f64> {
        let mut h = vec![0f64; cols * cols];
        for v in x.chunks(cols) {
            for a in 0..cols {
                for b in 0..cols {
                    h[a * cols + b] += v[a] * v[b];
                }
            }
        }
        h
    }

    /// GPTQ feedback from the calibration inputs' Hessian lowers the layer's output error
    /// ‖X·(W − Ŵ)ᵀ‖ on fresh inputs of the same kind, against plain rounding weighted by the
    /// same inputs' channel energies, at the same stored rate (each within 1 %).
    #[test]
    fn feedback_lowers_the_output_error_at_the_same_rate() {
        let mut rng = Rng::new(31);
        let (rows, cols, n) = (96, 256, 1024);
        let w = gaussian(&mut rng, rows * cols, 0.02);
        let scale: Vec<f64> = (0..cols).map(|_| (0.5 * rng.normal()).exp()).collect();
        let h = gram(&correlated_inputs(&mut rng, n, cols, &scale), cols);
        let test = gram(&correlated_inputs(&mut rng, n, cols, &scale), cols);
        let diag: Vec<f32> = (0..cols)
            .map(|j| (h[j * cols + j] / n as f64) as f32)
            .collect();
        let f = Feedback::new(&h, cols).unwrap();
        // Σ over rows of dᵀ·H·d, d = W − Ŵ.
        let out_err = |back: &[f32]| -> f64 {
            w.chunks(cols)
                .zip(back.chunks(cols))
                .map(|(a, b)| {
                    let d: Vec<f64> = a.iter().zip(b).map(|(&a, &b)| (a - b) as f64).collect();
                    (0..cols)
                        .map(|i| d[i] * (0..cols).map(|k| test[i * cols + k] * d[k]).sum::<f64>())
                        .sum::<f64>()
                })
                .sum()
        };
        for (group, bits) in [(128, 3.0), (64, 4.0), (256, 2.5)] {
            let q = Scalar::Int {
                group,
                dead_zone: 0.0,
            };
            let (plain, _) = encode(&w, rows, cols, q, bits, Some(&diag)).unwrap();
            let (fb, _) =
                encode_with_feedback(&w, rows, cols, q, bits, Some(&diag), Some(&f)).unwrap();
            for t in [&plain, &fb] {
                let got = t.bits_per_weight();
                assert!((got - bits).abs() <= 0.01 * bits, "{bits}: {got}");
            }
            let (e0, e1) = (
                out_err(&plain.decode().unwrap()),
                out_err(&fb.decode().unwrap()),
            );
            assert!(e1 < 0.8 * e0, "g{group} {bits} bits: {e1} against {e0}");
        }
        // Feedback takes integer codes of the Hessian's width only.
        assert!(encode_with_feedback(&w, rows, cols, Scalar::Fp8, 4.0, None, Some(&f)).is_err());
        let g = Feedback::new(&vec![0.0; 64 * 64], 64).unwrap();
        let q = Scalar::Int {
            group: 128,
            dead_zone: 0.0,
        };
        assert!(encode_with_feedback(&w, rows, cols, q, 4.0, None, Some(&g)).is_err());
    }

    #[test]
    fn the_rd_curve_brackets_what_encode_gives() {
        let mut rng = Rng::new(17);
        let (rows, cols) = (128, 512);
        let w = gaussian(&mut rng, rows * cols, 1.0);
        let q = Scalar::Int {
            group: 128,
            dead_zone: 0.0,
        };
        let pts = rd_curve(&w, rows, cols, q, None, (3.0, 5.0)).unwrap();
        assert!(
            pts.first().unwrap().0 < 3.0 && pts.last().unwrap().0 > 5.0,
            "{pts:?}"
        );
        assert!(pts.windows(2).all(|p| p[0].0 < p[1].0 && p[0].1 > p[1].1));
        let (t, _) = encode(&w, rows, cols, q, 4.0, None).unwrap();
        let e = rel_l2(&w, &t.decode().unwrap()).powi(2);
        let i = pts.iter().position(|p| p.0 >= 4.0).unwrap();
        let (a, b) = (pts[i - 1], pts[i]);
        let interp = a.1.ln() + (b.1.ln() - a.1.ln()) * (4.0 - a.0) / (b.0 - a.0);
        assert!((e.ln() - interp).abs() < 0.15, "{e} vs {}", interp.exp());
    }
}
