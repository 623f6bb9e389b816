//! `lossy`: a matrix as `compress --bits` codes it (codec `lossy`: E8 or TCQ points, tiled rANS,
//! row scales). The product decodes one tile at a time into a buffer of its own and multiplies it
//! with the dense f32 kernels, so the matrix is never held decoded and sums exactly as `dense f32`
//! of its reconstruction does.
//!
//! What it holds is a reconstruction of the source, so it accepts no source: no planner can make
//! one from values. A container stores it; loaded kept coded (`--keep-coded`, `--budget`, a plan),
//! it is a launch's current form, which the tuner times beside the lossless forms of its
//! reconstruction (`source()`: `dense` is decoding at load) and a plan may keep. `compress
//! --budget --allow-lossy` plans it for the matrices `--bits` would code.

use super::{Candidate, DeviceKind, Form, FormId, Source, StoredMatrix, Values};
use crate::error::{ModelError, Result};
use crate::weights::Linear;
use entrollm_codec::lossy::Decoder;
use entrollm_format::coded::{Coded, LossyCoded};
use entrollm_format::Dtype;
use rayon::prelude::*;
use std::sync::Arc;

pub struct LossyForm;
pub static LOSSY: LossyForm = LossyForm;

pub struct LossyLinear {
    m: LossyCoded,
    /// Built once: every product decodes through it.
    dec: Decoder,
}

impl LossyLinear {
    pub fn new(m: LossyCoded) -> Result<LossyLinear> {
        let dec = m
            .tensor
            .decoder()
            .map_err(|e| ModelError::Unsupported(format!("lossy tables: {e}")))?;
        Ok(LossyLinear { m, dec })
    }

    /// The coded matrix (what a GPU form uploads).
    pub fn coded(&self) -> &LossyCoded {
        &self.m
    }

    /// Tile `t`'s rows as served (rounded to the container's dtype), into `buf`.
    fn tile(&self, t: usize, buf: &mut Vec<f32>) {
        let rows = self.m.tensor.tile_row_range(t);
        buf.resize(rows.len() * self.cols(), 0.0);
        // Verified at load (decoded and checked against the manifest); decoding is deterministic.
        self.m
            .tensor
            .decode_tile(&self.dec, t, buf)
            .expect("a lossy matrix verified at load decodes");
        self.m.serve_all(buf);
    }

    fn values(&self) -> Result<Vec<f32>> {
        let mut v = self
            .m
            .tensor
            .decode()
            .map_err(|e| ModelError::Unsupported(format!("lossy decode: {e}")))?;
        self.m.serve_all(&mut v);
        Ok(v)
    }
}

impl Linear for LossyLinear {
    fn rows(&self) -> usize {
        self.m.tensor.rows
    }
    fn cols(&self) -> usize {
        self.m.tensor.cols
    }
    fn matvec(&self, x: &[f32], y: &mut [f32]) {
        self.matmul(x, 1, y)
    }
    fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        let (rows, cols) = (self.rows(), self.cols());
        assert_eq!(x.len(), n * cols, "matmul input length");
        assert_eq!(y.len(), n * rows, "matmul output length");
        let tile = self.m.tensor.tile_rows * n;
        // Each tile's rows times every vector, [rows, n] as the kernels write (for one vector,
        // `y` itself), decoded into a buffer per worker.
        let products = |out: &mut [f32]| {
            out.par_chunks_mut(tile)
                .enumerate()
                .for_each_init(Vec::new, |buf, (i, out)| {
                    self.tile(i, buf);
                    crate::weights::f32_rows_times_vectors(buf, cols, x, n, out);
                })
        };
        if n == 1 {
            return products(y);
        }
        let mut y_t = vec![0f32; rows * n];
        products(&mut y_t);
        crate::weights::untranspose(&y_t, n, y);
    }
    fn row(&self, r: usize, out: &mut [f32]) {
        let t = r / self.m.tensor.tile_rows;
        let mut buf = Vec::new();
        self.tile(t, &mut buf);
        let at = (r - self.m.tensor.tile_row_range(t).start) * self.cols();
        out.copy_from_slice(&buf[at..at + self.cols()]);
    }
    fn stored_bytes(&self) -> usize {
        self.m.tensor.stored_bytes()
    }
    fn form(&self) -> FormId {
        FormId {
            form: "lossy",
            variant: self.m.tensor.quantizer.to_string(),
        }
    }
    /// The served values (the reconstruction in the container's dtype): what every lossless form
    /// of this matrix holds.
    fn source(&self) -> Result<Source> {
        let v = self.values()?;
        let values = match self.m.dtype {
            Dtype::BF16 => Values::Bf16(
                v.iter()
                    .map(|&x| half::bf16::from_f32(x).to_bits())
                    .collect(),
            ),
            // Served values are halves already (saturated): the conversion is exact.
            Dtype::F16 => Values::F16(
                v.iter()
                    .map(|&x| half::f16::from_f32(x).to_bits())
                    .collect(),
            ),
            _ => Values::F32(v),
        };
        Source::new(self.rows(), self.cols(), values)
    }
    fn values_kind(&self) -> &'static str {
        match self.m.dtype {
            Dtype::BF16 => "bf16",
            Dtype::F16 => "f16",
            _ => "f32",
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn made_by_compress() -> ModelError {
    ModelError::Unsupported(
        "a lossy matrix is coded from the source weights by `entrollm compress --bits R` (or \
         `--budget SIZE --allow-lossy`), not from values a model holds"
            .into(),
    )
}

impl Form for LossyForm {
    fn name(&self) -> &'static str {
        "lossy"
    }
    fn describe(&self) -> &'static str {
        "lossy-coded tiles (compress --bits): E8 or TCQ points, tiled rANS, row scales"
    }
    /// None: it holds a reconstruction, not the values it was made from.
    fn accepts(&self, _src: &Source) -> bool {
        false
    }
    fn runs_on(&self, _device: DeviceKind) -> bool {
        true
    }
    fn variants(&self, _src: &Source) -> Result<Vec<Candidate>> {
        Ok(Vec::new())
    }
    fn predict(&self, _src: &Source, _variant: &str) -> Result<f64> {
        Err(made_by_compress())
    }
    fn encode(&self, _src: &Source, _variant: &str) -> Result<Arc<dyn Linear>> {
        Err(made_by_compress())
    }
    /// Per weight: one rANS symbol (TCQ; 9 per 8 weights for E8), its point and the row scale.
    fn default_cost_us(&self, device: DeviceKind, weights: usize, bytes: f64) -> f64 {
        super::stream_cost_us(device, bytes)
            + weights as f64
                * match device {
                    DeviceKind::Cpu => 7.0e-4,
                    DeviceKind::Cuda => 7.5e-6,
                }
    }
    fn loads(&self, coded: &Coded, _t: &StoredMatrix<'_>) -> bool {
        coded.downcast_ref::<LossyCoded>().is_some()
    }
    fn load(&self, coded: Coded, t: &StoredMatrix<'_>) -> Result<Arc<dyn Linear>> {
        let m = coded.downcast::<LossyCoded>().map_err(|c| {
            ModelError::tensor(
                t.name,
                format!("the lossy form does not serve {}", c.coder()),
            )
        })?;
        let m = LossyLinear::new(m).map_err(|e| ModelError::tensor(t.name, e.to_string()))?;
        Ok(Arc::new(m))
    }
    fn stored(&self, _variant: &str, _values: &str) -> Result<Option<super::Stored>> {
        Err(made_by_compress())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forms::testing::{reference_matvec, Rng};
    use entrollm_codec::lossy::{LossyTensor, Options, Quantizer, MIN_TILE_WEIGHTS};

    fn coded(rows: usize, cols: usize, dtype: Dtype, rng: &mut Rng) -> LossyLinear {
        let w: Vec<f32> = (0..rows * cols).map(|_| 0.02 * rng.normal()).collect();
        let opts = Options {
            tile_weights: MIN_TILE_WEIGHTS,
            ..Options::new(4.0, Quantizer::Tcq { log2_states: 5 })
        };
        let (tensor, _) = LossyTensor::encode(&w, rows, cols, &opts).unwrap();
        LossyLinear::new(LossyCoded { dtype, tensor }).unwrap()
    }

    /// The fused product is `dense f32` of the reconstruction bit for bit (same kernels, same
    /// order), for batches and ragged shapes; the reconstruction is what `source()` gives and
    /// every lossless form holds; `row` is its row.
    #[test]
    fn the_product_is_dense_f32_of_the_reconstruction_bit_for_bit() {
        let mut rng = Rng::new(5);
        for (rows, cols, dtype) in [
            (1, 8, Dtype::BF16),
            (37, 96, Dtype::F16),
            (130, 1536, Dtype::BF16),
            (11, 4104, Dtype::F32),
        ] {
            let m = coded(rows, cols, dtype, &mut rng);
            let src = m.source().unwrap();
            assert_eq!(src.values.kind(), m.values_kind());
            let dense =
                super::super::encode_checked(&super::super::dense::DENSE, &src, "f32").unwrap();
            for n in [1, 3] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
                let (mut y, mut z) = (vec![f32::NAN; n * rows], vec![f32::NAN; n * rows]);
                m.matmul(&x, n, &mut y);
                dense.matmul(&x, n, &mut z);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&y), bits(&z), "{rows}x{cols} n={n}");
            }
            let want = reference_matvec(&*dense, &vec![1.0; cols]);
            let mut row = vec![0f32; cols];
            for r in [0, rows / 2, rows - 1] {
                m.row(r, &mut row);
                let sum: f64 = row.iter().map(|&v| v as f64).sum();
                assert!((sum - want[r]).abs() <= 1e-9 + 1e-6 * want[r].abs());
            }
            // Every lossless form takes the reconstruction; none makes a lossy matrix.
            assert!(!LOSSY.accepts(&src) && LOSSY.encode(&src, "tcq32").is_err());
            assert!(
                super::super::reform(&(Arc::new(m) as Arc<dyn Linear>), &LOSSY, "tcq32").is_ok()
            );
        }
    }
}
