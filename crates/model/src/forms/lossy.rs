//! `lossy`: a matrix as `compress --bits` codes it (codec `lossy`: E8 or TCQ points, tiled rANS,
//! row scales), multiplied by decoding one tile at a time (codec `LossyTensor::matmul`), so the
//! matrix is never held decoded. What it holds is a reconstruction of the source, so no exact
//! planner offers it: it is served where a container stores it, kept coded with `--keep-coded`
//! (decoded at load otherwise, the faster form on the CPU).

use super::{FormId, Source, Values};
use crate::error::{ModelError, Result};
use crate::weights::Linear;
use entrollm_codec::lossy::Decoder;
use entrollm_format::coded::LossyCoded;

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
}

impl LossyLinear {
    /// The coded matrix (what a GPU form uploads).
    pub fn coded(&self) -> &LossyCoded {
        &self.m
    }

    fn values(&self) -> Result<Vec<f32>> {
        let v = self
            .m
            .tensor
            .decode()
            .map_err(|e| ModelError::Unsupported(format!("lossy decode: {e}")))?;
        Ok(v.into_iter().map(|x| self.m.served(x)).collect())
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
        // Verified at load (decoded and checked against the manifest); decoding is deterministic.
        self.m
            .tensor
            .matmul(&self.dec, x, n, y, &|v| self.m.served(v))
            .expect("a lossy matrix verified at load decodes");
    }
    fn row(&self, r: usize, out: &mut [f32]) {
        let all = self
            .values()
            .expect("a lossy matrix verified at load decodes");
        let c = self.cols();
        out.copy_from_slice(&all[r * c..(r + 1) * c]);
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
    /// The served values (the reconstruction in the container's dtype), as f32.
    fn source(&self) -> Result<Source> {
        Source::new(self.rows(), self.cols(), Values::F32(self.values()?))
    }
    fn values_kind(&self) -> &'static str {
        "f32"
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
