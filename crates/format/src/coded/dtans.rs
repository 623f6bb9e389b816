//! `dtans`: a float matrix (BF16, F16, FP8) dtANS-coded as the fused products decode it.

use super::{dtans_arrays, dtans_from_arrays, dtans_params, payload_of, Arrays, Coded, CoderKind};
use super::{Coder, Stored};
use crate::{FormatError, Result};
use entrollm_codec::dtans::DtansTensor;
use serde_json::Value;

pub const DTANS: &str = "dtans";

pub(super) const KIND: CoderKind = CoderKind { name: DTANS, load };

impl Coder for DtansTensor {
    fn name(&self) -> &'static str {
        DTANS
    }
    fn params(&self) -> Value {
        serde_json::to_value(DtansTensor::params(self)).expect("params serialise")
    }
    fn arrays(&self) -> Arrays<'_> {
        dtans_arrays(self)
    }
    fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        DtansTensor::decode(self)
    }
    fn decode_with_breakdown(
        &self,
    ) -> entrollm_codec::Result<(Vec<u8>, Option<entrollm_codec::dtans::SizeBreakdown>)> {
        DtansTensor::decode_with_breakdown(self).map(|(d, b)| (d, Some(b)))
    }
    fn stored_bytes(&self) -> usize {
        DtansTensor::stored_bytes(self)
    }
}

fn load(s: &Stored<'_, '_>) -> Result<Coded> {
    let err = FormatError::Usage;
    let (dtype, shape) = (s.dtype, s.shape);
    let p = dtans_params(s.params())?;
    if payload_of(dtype) != Some(p.payload) {
        return Err(err(format!(
            "a {dtype:?} tensor cannot hold a {:?} payload",
            p.payload
        )));
    }
    if p.rows.checked_mul(p.cols) != Some(s.numel()) || shape.first().is_some_and(|&r| r != p.rows)
    {
        return Err(err(format!(
            "coded as {}×{} but its shape is {shape:?}",
            p.rows, p.cols
        )));
    }
    Ok(dtans_from_arrays(&p, |n, d| s.array(n, d))?.into())
}
