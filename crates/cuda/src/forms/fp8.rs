//! FP8 E4M3 with per-row scales (model forms `dense:fp8` and `pal-fp8`, inside the row scales an
//! FP8 checkpoint's `weight_scale` wraps them in): batch-1 products by the FP8 GEMV (`gemv_fp8`,
//! codes as stored) or `gemv_pal4` (palette-packed: 4-bit indices into 16 codes plus escapes),
//! prefill through a BF16 copy in the shared workspace. A launch's parts are packed as one matrix
//! (one palette for the stacked rows). Codes held dense are packed at load as
//! [`Policy::fp8`](super::Policy) says.

use super::{GpuForm, Upload};
use crate::engine_coded::LoadReport;
use crate::error::{GpuError, Result};
use crate::linear::{Fp8Serving, GpuLinear, PALETTE_MAX_RATIO};
use crate::ops::gemv_fp8::check_gemv_pal4_shape;
use entrollm_codec::palette::Palette4;
use entrollm_model::forms::palette::PalLinear;
use entrollm_model::weights::{DenseFp8, Linear, RowScaled};
use std::borrow::Cow;
use std::sync::Arc;

pub struct Fp8Form;
pub static FP8: Fp8Form = Fp8Form;

/// A part's codes (row-major), its row scales (None: 1) and whether it is held palette-packed.
type Fp8View<'a> = (Cow<'a, [u8]>, Option<&'a [f32]>, bool);

/// The matrix inside `p`'s row scales, and the scales (None: `p` has none).
fn unscaled(p: &dyn Linear) -> (&dyn Linear, Option<&[f32]>) {
    match p.as_any().downcast_ref::<RowScaled>() {
        Some(rs) => {
            let (inner, scales) = rs.parts();
            (&**inner, Some(scales))
        }
        None => (p, None),
    }
}

/// `p`'s palette-packed FP8 codes and row scales, when it is held so.
fn held_palette(p: &dyn Linear) -> Option<(&Palette4, Option<&[f32]>)> {
    let (inner, scales) = unscaled(p);
    let pal = inner.as_any().downcast_ref::<PalLinear>()?.fp8()?;
    Some((pal, scales))
}

/// [`Fp8View`] of `p`; None when it is not FP8.
fn codes_of(p: &dyn Linear) -> Option<Fp8View<'_>> {
    let (inner, scales) = unscaled(p);
    if let Some(d) = inner.as_any().downcast_ref::<DenseFp8>() {
        return Some((d.data().into(), scales, false));
    }
    let (pal, _) = held_palette(p)?;
    Some((pal.decode().into(), scales, true))
}

/// Whether `p` holds FP8 codes (dense or palette-packed, with or without row scales).
pub fn is_fp8(p: &dyn Linear) -> bool {
    unscaled(p).0.as_any().is::<DenseFp8>() || held_palette(p).is_some()
}

/// The palette form `form` keeps an FP8 matrix's row-major `codes` in, or None (as stored): never
/// for `Dense` or columns not a multiple of 32; for `Auto` when the packed form is at most
/// [`PALETTE_MAX_RATIO`] of the codes' bytes.
pub fn fp8_palette(
    codes: &[u8],
    rows: usize,
    cols: usize,
    form: Fp8Serving,
) -> Result<Option<Palette4>> {
    if form == Fp8Serving::Dense || check_gemv_pal4_shape(rows, cols).is_err() {
        return Ok(None);
    }
    let p = Palette4::encode(codes, rows, cols, 0)
        .map_err(|e| GpuError::invalid("fp8 linear", format!("palette packing: {e}")))?;
    let small = p.stored_bytes() as f64 <= PALETTE_MAX_RATIO * codes.len() as f64;
    Ok((form == Fp8Serving::Palette || small).then_some(p))
}

impl GpuForm for Fp8Form {
    fn name(&self) -> &'static str {
        "fp8"
    }

    /// Every part FP8 (row scales, or 1) with the same columns, a multiple of 16.
    fn upload(
        &self,
        up: &Upload<'_>,
        parts: &[&dyn Linear],
        halves: bool,
        report: &mut LoadReport,
    ) -> Result<Option<GpuLinear>> {
        // One part held packed: its packing as it is.
        if let [p] = parts {
            if let Some((pal, scales)) = held_palette(*p) {
                let scales = scales.map_or_else(|| vec![1.0; p.rows()], <[f32]>::to_vec);
                report.fp8 += 1;
                return GpuLinear::fp8_packed(up.dev, pal, &scales, Arc::clone(up.scratch))
                    .map(Some);
            }
        }
        let cols = parts[0].cols();
        let mut views = Vec::with_capacity(parts.len());
        for p in parts {
            match codes_of(*p) {
                Some((codes, scales, pal)) if p.cols() == cols && cols % 16 == 0 => {
                    let scales = scales.map_or_else(|| vec![1.0; p.rows()], <[f32]>::to_vec);
                    views.push((codes, scales, p.rows(), pal));
                }
                _ => return Ok(None),
            }
        }
        let rows: usize = views.iter().map(|v| v.2).sum();
        let mut codes = Vec::with_capacity(rows * cols);
        let mut scales = Vec::with_capacity(rows);
        match &views[..] {
            [g, u] if halves => {
                if g.2 != u.2 {
                    return Ok(None);
                }
                for r in 0..g.2 {
                    codes.extend_from_slice(&g.0[r * cols..(r + 1) * cols]);
                    codes.extend_from_slice(&u.0[r * cols..(r + 1) * cols]);
                    scales.extend([g.1[r], u.1[r]]);
                }
            }
            _ => {
                for (c, s, _, _) in &views {
                    codes.extend_from_slice(c);
                    scales.extend_from_slice(s);
                }
            }
        }
        // Held palette-packed: packed on the device too, whatever the policy.
        let form = match views.iter().any(|v| v.3) {
            true => Fp8Serving::Palette,
            false => up.policy.fp8,
        };
        report.fp8 += 1;
        if up.policy.code.is_some() {
            report.dense_notes.push(format!(
                "{}: FP8, served as FP8 (code at load codes BF16)",
                up.what
            ));
        }
        GpuLinear::fp8_from_host(
            up.dev,
            rows,
            cols,
            &codes,
            &scales,
            form,
            Arc::clone(up.scratch),
        )
        .map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_serving_packs_what_it_says() {
        assert_eq!("auto".parse(), Ok(Fp8Serving::Auto));
        assert_eq!("palette".parse(), Ok(Fp8Serving::Palette));
        assert!("fp4"
            .parse::<Fp8Serving>()
            .unwrap_err()
            .contains("auto, dense or palette"));
        // Few codes: packed under auto and palette; every code: only when asked.
        let few: Vec<u8> = (0..64 * 256)
            .map(|i| [0u8, 0x01, 0x81, 0x02][i % 4])
            .collect();
        let all: Vec<u8> = (0..64 * 256).map(|i| (i * 7 % 256) as u8).collect();
        let packs = |c: &[u8], cols, f| fp8_palette(c, c.len() / cols, cols, f).unwrap().is_some();
        assert!(packs(&few, 256, Fp8Serving::Auto));
        assert!(packs(&few, 256, Fp8Serving::Palette));
        assert!(!packs(&few, 256, Fp8Serving::Dense));
        assert!(!packs(&all, 256, Fp8Serving::Auto));
        assert!(packs(&all, 256, Fp8Serving::Palette));
        // Columns not a multiple of 32 stay as stored, whatever is asked.
        assert!(!packs(&few[..48 * 272], 272, Fp8Serving::Palette));
        assert!(!packs(&few[..48 * 272], 272, Fp8Serving::Auto));
    }
}
