//! `int`: integer codes with their group scales, uncoded (GGUF's Q4_0/Q4_1/Q5_x/Q8_0 codes as
//! the blocks hold them; 4-bit codes two to a byte). The product dequantises a group at a time:
//! `Σ s·(q − o)·x + m·Σx` over each group.

use super::{Candidate, DeviceKind, Form, GroupScales, Source, Values};
use crate::error::{ModelError, Result};
use crate::weights::Linear;
use entrollm_codec::Payload;
use rayon::prelude::*;
use std::sync::Arc;

pub struct IntForm;
pub static INT: IntForm = IntForm;

/// The integer values of a GGUF tensor of legacy blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): codes and
/// the blocks' scales as they are.
pub fn from_blocks(
    rows: usize,
    cols: usize,
    q: &entrollm_format::ggml_blocks::QuantCodes,
) -> Result<Source> {
    let f = |v: &[u16]| -> Vec<f32> {
        v.iter()
            .map(|&b| half::f16::from_bits(b).to_f32())
            .collect()
    };
    let l = q
        .block
        .int_codes()
        .ok_or_else(|| ModelError::Unsupported(format!("{} codes are not integers", q.block)))?;
    let groups = GroupScales {
        group: entrollm_format::ggml_blocks::QK,
        scales: f(&q.d),
        mins: q.m.as_deref().map(f),
        offset: l.offset as f32,
        signed: l.signed,
    };
    Source::new(
        rows,
        cols,
        Values::Int {
            payload: Payload::Int(q.block.code_bits() as u8),
            codes: q.codes.clone(),
            groups,
        },
    )
}

/// An integer matrix with group scales, codes packed two to a byte when they have ≤ 4 bits.
pub struct IntLinear {
    rows: usize,
    cols: usize,
    payload: Payload,
    packed: Vec<u8>,
    groups: GroupScales,
}

impl IntLinear {
    /// Bits a code.
    pub fn bits(&self) -> u8 {
        self.payload.code_bits() as u8
    }

    /// The group scales, mins and offset the codes are dequantised with.
    pub fn groups(&self) -> &GroupScales {
        &self.groups
    }

    /// The codes, one a byte, row-major, as the source holds them (signed ones in two's
    /// complement of [`Self::bits`] bits).
    pub fn codes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.rows * self.cols];
        out.par_chunks_mut(1 << 16)
            .enumerate()
            .for_each(|(k, chunk)| {
                let base = k << 16;
                for (i, o) in chunk.iter_mut().enumerate() {
                    *o = self.code(base + i);
                }
            });
        out
    }

    fn nibbles(&self) -> bool {
        self.payload.code_bits() <= 4
    }

    fn code(&self, i: usize) -> u8 {
        match self.nibbles() {
            true => (self.packed[i / 2] >> (4 * (i % 2))) & 0xF,
            false => self.packed[i],
        }
    }

    /// Row `r`'s codes as f32 (unsigned) into `out`.
    fn unpack_row(&self, r: usize, out: &mut [f32]) {
        let base = r * self.cols;
        match self.nibbles() {
            true => {
                for (c, o) in out.iter_mut().enumerate() {
                    let i = base + c;
                    *o = ((self.packed[i / 2] >> (4 * (i % 2))) & 0xF) as f32;
                }
            }
            false => {
                for (o, &b) in out.iter_mut().zip(&self.packed[base..base + self.cols]) {
                    *o = b as f32;
                }
            }
        }
    }

    /// Row `r` dequantised into `out`.
    fn row_values(&self, r: usize, out: &mut [f32]) {
        let d = self.groups.dequant();
        for (c, o) in out.iter_mut().enumerate() {
            let q = self.code(r * self.cols + c) as f32;
            *o = d.apply(self.payload, r, c, self.cols, q);
        }
    }
}

impl Linear for IntLinear {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    /// Per group: `s·(Σ q·x − o·Σx) + m·Σx`, with each group's `Σx` computed once for all rows,
    /// so a weight costs one multiply-add (eight independent sums, which vectorise).
    fn matvec(&self, x: &[f32], y: &mut [f32]) {
        assert_eq!((x.len(), y.len()), (self.cols, self.rows), "matvec shapes");
        let g = &self.groups;
        let per_row = self.cols.div_ceil(g.group);
        let xsum: Vec<f32> = x.chunks(g.group).map(|c| c.iter().sum()).collect();
        let bits = self.payload.code_bits();
        let (wrap, half) = ((1u32 << bits) as f32, (1u32 << (bits - 1)) as f32);
        let rows_per_task = ((1 << 15) / self.cols).max(1);
        y.par_chunks_mut(rows_per_task)
            .enumerate()
            .for_each(|(chunk, ys)| {
                let mut q = vec![0f32; self.cols];
                for (i, y) in ys.iter_mut().enumerate() {
                    let r = chunk * rows_per_task + i;
                    self.unpack_row(r, &mut q);
                    if g.signed {
                        q.iter_mut()
                            .for_each(|v| *v -= if *v >= half { wrap } else { 0.0 });
                    }
                    let mut acc = 0f32;
                    for (gi, &xs) in xsum.iter().enumerate() {
                        let c0 = gi * g.group;
                        let n = g.group.min(self.cols - c0);
                        let dot = super::dot(&q[c0..c0 + n], &x[c0..c0 + n]);
                        let k = r * per_row + gi;
                        acc += g.scales[k] * (dot - g.offset * xs)
                            + g.mins.as_ref().map_or(0.0, |m| m[k] * xs);
                    }
                    *y = acc;
                }
            });
    }
    fn row(&self, r: usize, out: &mut [f32]) {
        self.row_values(r, out);
    }
    fn stored_bytes(&self) -> usize {
        self.packed.len() + self.groups.bytes()
    }
    fn form(&self) -> super::FormId {
        super::FormId {
            form: "int",
            variant: String::new(),
        }
    }
    fn source(&self) -> Result<Source> {
        let codes = self.codes();
        Source::new(
            self.rows,
            self.cols,
            Values::Int {
                payload: self.payload,
                codes,
                groups: self.groups.clone(),
            },
        )
    }
    fn values_kind(&self) -> &'static str {
        "int"
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn packed_bytes(src: &Source, code_bits: u32) -> usize {
    match code_bits <= 4 {
        true => src.weights().div_ceil(2),
        false => src.weights(),
    }
}

impl Form for IntForm {
    fn name(&self) -> &'static str {
        "int"
    }
    fn describe(&self) -> &'static str {
        "integer codes with group scales, uncoded (GGUF legacy blocks; GPTQ, AWQ, compressed-tensors)"
    }
    fn runs_on(&self, _device: DeviceKind) -> bool {
        true
    }
    /// Integer codes, and GGUF blocks of the types whose weights are codes times group scales
    /// ([`super::ggml::int_values`]).
    fn accepts(&self, src: &Source) -> bool {
        match &src.values {
            // Integer codes only (FP4 codes are values, not integers).
            Values::Int { payload, .. } => matches!(payload, Payload::Int(_)),
            Values::Ggml { ty, .. } => ty.int_codes().is_some(),
            _ => false,
        }
    }
    fn variants(&self, src: &Source) -> Result<Vec<Candidate>> {
        let bytes = match &src.values {
            Values::Int {
                payload, groups, ..
            } => packed_bytes(src, payload.code_bits()) + groups.bytes(),
            // GGUF blocks: sized from their layout, not converted.
            Values::Ggml { ty, .. } => match ty.int_codes() {
                Some(l) => {
                    let groups = src.rows * src.cols.div_ceil(l.group);
                    packed_bytes(src, ty.code_bits()) + 4 * groups * (1 + usize::from(l.mins))
                }
                None => return Ok(Vec::new()),
            },
            _ => return Ok(Vec::new()),
        };
        if !self.accepts(src) {
            return Ok(Vec::new());
        }
        Ok(vec![Candidate {
            variant: String::new(),
            predicted_bytes: bytes as f64,
        }])
    }
    fn predict(&self, src: &Source, variant: &str) -> Result<f64> {
        check_variant(variant)?;
        self.variants(src)?
            .first()
            .map(|c| c.predicted_bytes)
            .ok_or_else(|| ModelError::Unsupported("int holds integer matrices only".into()))
    }
    fn encode(&self, src: &Source, variant: &str) -> Result<Arc<dyn Linear>> {
        check_variant(variant)?;
        let int = as_int(src);
        let src = int.as_deref().unwrap_or(src);
        let Values::Int {
            payload,
            codes,
            groups,
        } = &src.values
        else {
            return Err(ModelError::Unsupported(format!(
                "int holds integer matrices only, not {}",
                src.values.kind()
            )));
        };
        if !matches!(payload, Payload::Int(_)) {
            return Err(ModelError::Unsupported(
                "int holds integer codes only, not FP4 values".into(),
            ));
        }
        groups
            .dequant()
            .check(src.rows, src.cols)
            .map_err(|e| ModelError::Unsupported(e.to_string()))?;
        let packed = match payload.code_bits() <= 4 {
            true => codes
                .chunks(2)
                .map(|p| p[0] | p.get(1).map_or(0, |h| h << 4))
                .collect(),
            false => codes.clone(),
        };
        Ok(Arc::new(IntLinear {
            rows: src.rows,
            cols: src.cols,
            payload: *payload,
            packed,
            groups: groups.clone(),
        }))
    }
    fn default_cost_us(&self, device: DeviceKind, weights: usize, bytes: f64) -> f64 {
        super::stream_cost_us(device, bytes)
            + match device {
                DeviceKind::Cpu => weights as f64 * 2.0e-3,
                DeviceKind::Cuda => 0.0,
            }
    }
}

fn check_variant(variant: &str) -> Result<()> {
    super::no_variants("int", variant)
}

/// `src` as integer codes: as it is, or its GGUF blocks converted; `None` where neither.
fn as_int(src: &Source) -> Option<std::borrow::Cow<'_, Source>> {
    match &src.values {
        Values::Int { .. } => Some(std::borrow::Cow::Borrowed(src)),
        Values::Ggml { ty, bytes } => Some(std::borrow::Cow::Owned(Source {
            rows: src.rows,
            cols: src.cols,
            values: super::ggml::int_values(*ty, bytes.bytes())?,
        })),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::*;

    #[test]
    fn odd_shapes_round_trip_and_multiply() {
        let mut rng = Rng::new(11);
        for (bits, rows, cols, signed) in [
            (4u8, 3usize, 33usize, false),
            (5, 17, 64, true),
            (8, 5, 40, true),
        ] {
            let groups_per_row = cols.div_ceil(32);
            let codes: Vec<u8> = (0..rows * cols)
                .map(|_| (rng.next() % (1u64 << bits)) as u8)
                .collect();
            let groups = GroupScales {
                group: 32,
                scales: (0..rows * groups_per_row)
                    .map(|_| rng.normal() * 0.01)
                    .collect(),
                mins: (!signed).then(|| (0..rows * groups_per_row).map(|_| rng.normal()).collect()),
                offset: if signed { 0.0 } else { 8.0 },
                signed,
            };
            let values = Values::Int {
                payload: Payload::Int(bits),
                codes,
                groups,
            };
            check_all_forms(&Source::new(rows, cols, values).unwrap(), &mut rng);
        }
    }
}
