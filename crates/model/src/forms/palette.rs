//! `pal-fp8` and `pal-bf16`: palette packing (codec `palette`), lossless. FP8 codes as 4-bit
//! indices into 16 codes plus escapes; BF16 values as their high byte so packed beside the low
//! byte (12 bits a weight). Not entropy coders: their decode is one lookup per pair of weights,
//! which is what lets the GPU's `gemv_pal4` read fewer bytes than the dense GEMV without spending
//! the saving on decoding. The CPU product decodes a 16-row tile at a time. Sizes are predicted
//! exactly from the byte histogram (the palette is the 15 most frequent codes and zero; every
//! other code escapes).

use super::{Candidate, DeviceKind, Form, FormId, Source, Values};
use crate::error::{ModelError, Result};
use crate::weights::{Linear, FP8_E4M3_TO_F32};
use entrollm_codec::histogram::byte_histogram;
use entrollm_codec::palette::{
    Palette4, PaletteBf16, BF16_MAX_COLS, BLOCK_COLS, MAX_COLS, TILE_ROWS,
};
use rayon::prelude::*;
use std::sync::Arc;

/// Which values a palette form packs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Fp8,
    Bf16,
}

pub struct PaletteForm(Kind);
/// FP8 E4M3 codes, 4 bits a weight plus escapes.
pub static PAL_FP8: PaletteForm = PaletteForm(Kind::Fp8);
/// BF16 values, 12 bits a weight plus escapes.
pub static PAL_BF16: PaletteForm = PaletteForm(Kind::Bf16);

enum Packed {
    Fp8(Palette4),
    Bf16(PaletteBf16),
}

/// A palette-packed matrix.
pub struct PalLinear {
    packed: Packed,
}

impl PalLinear {
    /// The packed FP8 codes, for an engine that uploads them (the GPU's `gemv_pal4`).
    pub fn fp8(&self) -> Option<&Palette4> {
        match &self.packed {
            Packed::Fp8(p) => Some(p),
            Packed::Bf16(_) => None,
        }
    }

    /// The packed BF16 values, for an engine that uploads them.
    pub fn bf16(&self) -> Option<&PaletteBf16> {
        match &self.packed {
            Packed::Bf16(p) => Some(p),
            Packed::Fp8(_) => None,
        }
    }

    fn kind(&self) -> Kind {
        match self.packed {
            Packed::Fp8(_) => Kind::Fp8,
            Packed::Bf16(_) => Kind::Bf16,
        }
    }

    /// Rows `rows` as f32, row-major.
    fn rows_f32(&self, rows: std::ops::Range<usize>) -> Vec<f32> {
        match &self.packed {
            Packed::Fp8(p) => p
                .decode_rows(rows)
                .iter()
                .map(|&b| FP8_E4M3_TO_F32[b as usize])
                .collect(),
            Packed::Bf16(p) => p
                .decode_rows(rows)
                .iter()
                .map(|&b| f32::from_bits((b as u32) << 16))
                .collect(),
        }
    }
}

impl Linear for PalLinear {
    fn rows(&self) -> usize {
        match &self.packed {
            Packed::Fp8(p) => p.rows(),
            Packed::Bf16(p) => p.rows(),
        }
    }
    fn cols(&self) -> usize {
        match &self.packed {
            Packed::Fp8(p) => p.cols(),
            Packed::Bf16(p) => p.cols(),
        }
    }
    fn matvec(&self, x: &[f32], y: &mut [f32]) {
        let (rows, cols) = (self.rows(), self.cols());
        assert_eq!((x.len(), y.len()), (cols, rows), "matvec lengths");
        y.par_chunks_mut(TILE_ROWS).enumerate().for_each(|(t, y)| {
            let r0 = t * TILE_ROWS;
            let w = self.rows_f32(r0..r0 + y.len());
            for (y, w) in y.iter_mut().zip(w.chunks_exact(cols)) {
                *y = w.iter().zip(x).map(|(w, x)| w * x).sum();
            }
        });
    }
    fn row(&self, r: usize, out: &mut [f32]) {
        out.copy_from_slice(&self.rows_f32(r..r + 1));
    }
    fn stored_bytes(&self) -> usize {
        match &self.packed {
            Packed::Fp8(p) => p.stored_bytes(),
            Packed::Bf16(p) => p.stored_bytes(),
        }
    }
    fn form(&self) -> FormId {
        FormId {
            form: PaletteForm(self.kind()).name(),
            variant: String::new(),
        }
    }
    fn source(&self) -> Result<Source> {
        let values = match &self.packed {
            Packed::Fp8(p) => Values::Fp8(p.decode()),
            Packed::Bf16(p) => Values::Bf16(p.decode()),
        };
        Source::new(self.rows(), self.cols(), values)
    }
    fn values_kind(&self) -> &'static str {
        match self.kind() {
            Kind::Fp8 => "fp8",
            Kind::Bf16 => "bf16",
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl PaletteForm {
    /// The bytes that are palette-packed (FP8 codes, or BF16 high bytes) and the source's bytes.
    fn packed_bytes<'a>(&self, src: &'a Source) -> Option<(std::borrow::Cow<'a, [u8]>, usize)> {
        match (&src.values, self.0) {
            (Values::Fp8(v), Kind::Fp8) => Some((v.as_slice().into(), v.len())),
            (Values::Bf16(v), Kind::Bf16) => Some((
                v.par_iter()
                    .map(|&b| (b >> 8) as u8)
                    .collect::<Vec<_>>()
                    .into(),
                2 * v.len(),
            )),
            _ => None,
        }
    }

    fn exact_bytes(&self, src: &Source) -> Result<(usize, usize)> {
        let (bytes, source) = self.packed_bytes(src).ok_or_else(|| self.refuse(src))?;
        let hist = byte_histogram(&bytes);
        let packed = match self.0 {
            Kind::Fp8 => Palette4::predict_bytes(&hist, src.rows, src.cols, 0),
            Kind::Bf16 => PaletteBf16::predict_bytes(&hist, src.rows, src.cols),
        };
        Ok((packed, source))
    }

    fn refuse(&self, src: &Source) -> ModelError {
        ModelError::Unsupported(format!(
            "{} packs {} matrices with a multiple of {BLOCK_COLS} columns (below {}), not a {}×{} \
             {} one",
            self.name(),
            match self.0 {
                Kind::Fp8 => "FP8",
                Kind::Bf16 => "BF16",
            },
            self.max_cols(),
            src.rows,
            src.cols,
            src.values.kind()
        ))
    }

    fn max_cols(&self) -> usize {
        match self.0 {
            Kind::Fp8 => MAX_COLS,
            Kind::Bf16 => BF16_MAX_COLS,
        }
    }
}

impl Form for PaletteForm {
    fn name(&self) -> &'static str {
        match self.0 {
            Kind::Fp8 => "pal-fp8",
            Kind::Bf16 => "pal-bf16",
        }
    }
    fn describe(&self) -> &'static str {
        match self.0 {
            Kind::Fp8 => "FP8 codes palette-packed: 4-bit indices into 16 codes, plus escapes",
            Kind::Bf16 => "BF16 palette-packed: high byte as a 4-bit index, low byte as stored",
        }
    }
    fn runs_on(&self, _device: DeviceKind) -> bool {
        true
    }
    fn accepts(&self, src: &Source) -> bool {
        let kind = match self.0 {
            Kind::Fp8 => matches!(src.values, Values::Fp8(_)),
            Kind::Bf16 => matches!(src.values, Values::Bf16(_)),
        };
        kind && src.cols.is_multiple_of(BLOCK_COLS) && src.cols < self.max_cols()
    }
    fn variants(&self, src: &Source) -> Result<Vec<Candidate>> {
        if !self.accepts(src) {
            return Ok(Vec::new());
        }
        let (packed, source) = self.exact_bytes(src)?;
        Ok((packed < source)
            .then(|| Candidate {
                variant: String::new(),
                predicted_bytes: packed as f64,
            })
            .into_iter()
            .collect())
    }
    fn predict(&self, src: &Source, variant: &str) -> Result<f64> {
        super::no_variants(self.name(), variant)?;
        Ok(self.exact_bytes(src)?.0 as f64)
    }
    fn encode(&self, src: &Source, variant: &str) -> Result<Arc<dyn Linear>> {
        super::no_variants(self.name(), variant)?;
        let codec = |e: entrollm_codec::CodecError| {
            ModelError::Unsupported(format!("{}: {e}", self.name()))
        };
        let packed = match (&src.values, self.0) {
            (Values::Fp8(v), Kind::Fp8) if self.accepts(src) => {
                Packed::Fp8(Palette4::encode(v, src.rows, src.cols, 0).map_err(codec)?)
            }
            (Values::Bf16(v), Kind::Bf16) if self.accepts(src) => {
                Packed::Bf16(PaletteBf16::encode(v, src.rows, src.cols).map_err(codec)?)
            }
            _ => return Err(self.refuse(src)),
        };
        Ok(Arc::new(PalLinear { packed }))
    }
    fn default_cost_us(&self, device: DeviceKind, weights: usize, bytes: f64) -> f64 {
        super::stream_cost_us(device, bytes)
            + weights as f64
                * match device {
                    DeviceKind::Cpu => 4.0e-3,
                    DeviceKind::Cuda => 0.0,
                }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::*;
    use super::*;

    /// FP8 codes over `distinct` values, most of them few (a low-entropy checkpoint's).
    fn fp8_source(rng: &mut Rng, rows: usize, cols: usize, distinct: u64) -> Source {
        let codes = (0..rows * cols)
            .map(|_| {
                let v = (rng.next() >> 40) % distinct;
                let v = if rng.next().is_multiple_of(4) {
                    v
                } else {
                    v % 6
                };
                (v * 37 % 126) as u8 | ((rng.next() & 1) as u8) << 7
            })
            .collect();
        Source::new(rows, cols, Values::Fp8(codes)).unwrap()
    }

    #[test]
    fn round_trip_multiply_and_predict_exactly() {
        let mut rng = Rng::new(21);
        for (rows, cols) in [(1, 64), (17, 128), (40, 192), (5, 1024)] {
            for distinct in [4, 16, 60] {
                let src = fp8_source(&mut rng, rows, cols, distinct);
                let exact = check_variant(&PAL_FP8, &src, "", &mut rng);
                assert_eq!(PAL_FP8.predict(&src, "").unwrap(), exact);
                check_all_forms(&src, &mut rng);
            }
            let src = bf16_source(&mut rng, rows, cols, 0.03);
            let exact = check_variant(&PAL_BF16, &src, "", &mut rng);
            assert_eq!(PAL_BF16.predict(&src, "").unwrap(), exact);
            check_all_forms(&src, &mut rng);
        }
    }

    #[test]
    fn ragged_or_foreign_sources_are_refused_by_name() {
        let mut rng = Rng::new(3);
        let ragged = bf16_source(&mut rng, 3, 70, 0.03);
        assert!(!PAL_BF16.accepts(&ragged));
        assert!(PAL_BF16.variants(&ragged).unwrap().is_empty());
        let e = PAL_BF16.encode(&ragged, "").err().unwrap().to_string();
        assert!(e.contains("pal-bf16") && e.contains("3×70"), "{e}");
        let bf16 = bf16_source(&mut rng, 2, 64, 0.03);
        assert!(!PAL_FP8.accepts(&bf16));
        assert!(PAL_FP8.encode(&bf16, "").is_err());
        assert!(PAL_BF16.encode(&bf16, "x").is_err());
    }

    #[test]
    fn no_variant_when_packing_does_not_shrink() {
        // Every code but the NaNs equally often: most escape, larger than the codes.
        let codes: Vec<u8> = (0..64 * 256)
            .map(|i| (i * 7 % 256) as u8)
            .map(|b| if b & 0x7F == 0x7F { 1 } else { b })
            .collect();
        let src = Source::new(64, 256, Values::Fp8(codes)).unwrap();
        assert!(PAL_FP8.variants(&src).unwrap().is_empty());
        let mut rng = Rng::new(5);
        check_variant(&PAL_FP8, &src, "", &mut rng);
    }
}
