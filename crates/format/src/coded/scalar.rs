//! `dtans-scalar`: a float matrix coded lossily by a scalar quantiser (`compress --quantizer
//! int|fp8`): its codes dtANS-coded as the fused products serve them, with group scales; it
//! decodes to its reconstruction, as `lossy` does.

use super::lossy::{reconstruction_bytes, LossyCoded};
use super::{dtans_arrays, dtans_from_arrays, dtans_params, to_u16, u16_bytes, Arrays};
use super::{Coded, Coder, CoderKind, Stored};
use crate::container::ArrayDtype;
use crate::{Dtype, FormatError, Result};
use entrollm_codec::lossy::scalar::{Scalar, ScaleStore};
use serde_json::{json, Value};

pub const DTANS_SCALAR: &str = "dtans-scalar";

pub(super) const KIND: CoderKind = CoderKind {
    name: DTANS_SCALAR,
    load,
};

/// A scalar-quantised matrix and the float dtype it decodes to.
#[derive(Clone, Debug)]
pub struct ScalarCoded {
    pub dtype: Dtype,
    pub tensor: entrollm_codec::lossy::scalar::ScalarTensor,
}

impl ScalarCoded {
    /// The reconstruction as bytes of `dtype` (rounded to nearest, halves saturated).
    pub fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        reconstruction_bytes(self.dtype, &self.tensor.decode()?)
    }
}

impl Coder for ScalarCoded {
    fn name(&self) -> &'static str {
        DTANS_SCALAR
    }
    fn params(&self) -> Value {
        let t = &self.tensor;
        let mut v = json!({
            "quantizer": t.quantizer.to_string(),
            "group": t.group,
            "codes": t.codes.params(),
            "bits_per_weight": t.bits_per_weight(),
        });
        match &t.scales {
            ScaleStore::Raw(_) => v["scales"] = json!("raw"),
            ScaleStore::Coded { n, stream } => {
                v["scales"] = json!({ "n": n, "stream": stream.params() })
            }
        }
        v
    }
    fn arrays(&self) -> Arrays<'_> {
        let mut v: Vec<_> = dtans_arrays(&self.tensor.codes)
            .into_iter()
            .map(|(n, d, b)| (format!("codes_{n}"), d, b))
            .collect();
        match &self.tensor.scales {
            ScaleStore::Raw(r) => v.push(("scales".to_string(), ArrayDtype::U8, u16_bytes(r))),
            ScaleStore::Coded { stream, .. } => v.extend(
                dtans_arrays(stream)
                    .into_iter()
                    .map(|(n, d, b)| (format!("scales_{n}"), d, b)),
            ),
        }
        v
    }
    fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        ScalarCoded::decode(self)
    }
    fn stored_bytes(&self) -> usize {
        self.tensor.stored_bytes()
    }
    fn reconstructs(&self) -> bool {
        true
    }
}

fn load(s: &Stored<'_, '_>) -> Result<Coded> {
    let err = FormatError::Usage;
    let (dtype, shape, params) = (s.dtype, s.shape, s.params());
    if !LossyCoded::decodes_to(dtype) {
        return Err(err(format!(
            "a lossy matrix decodes to F32, BF16 or F16, not {dtype:?}"
        )));
    }
    let quantizer = match params["quantizer"].as_str() {
        Some("fp8") => Scalar::Fp8,
        Some(q) if q.starts_with("int") => Scalar::Int {
            group: 1,
            dead_zone: 0.0,
        },
        q => return Err(err(format!("unknown scalar quantiser {q:?}"))),
    };
    let group = params["group"]
        .as_u64()
        .and_then(|g| usize::try_from(g).ok())
        .filter(|&g| g > 0)
        .ok_or_else(|| err("dtans-scalar params lack a 'group' of columns".into()))?;
    let quantizer = match quantizer {
        Scalar::Int { .. } => Scalar::Int {
            group,
            dead_zone: 0.0,
        },
        q => q,
    };
    let p = dtans_params(&params["codes"])?;
    if shape != [p.rows, p.cols] {
        return Err(err(format!(
            "coded as {}×{} but its shape is {shape:?}",
            p.rows, p.cols
        )));
    }
    let codes = dtans_from_arrays(&p, |a, d| s.array(&format!("codes_{a}"), d))?;
    let scales = match &params["scales"] {
        Value::String(r) if r == "raw" => {
            let b = s.array("scales", ArrayDtype::U8)?;
            if b.len() % 2 != 0 {
                return Err(err("array 'scales' is not whole f16 values".into()));
            }
            ScaleStore::Raw(to_u16(b))
        }
        v => {
            let n = v["n"]
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| err("dtans-scalar scales lack 'n'".into()))?;
            let p = dtans_params(&v["stream"])?;
            let stream = dtans_from_arrays(&p, |a, d| s.array(&format!("scales_{a}"), d))?;
            ScaleStore::Coded { n, stream }
        }
    };
    let tensor = entrollm_codec::lossy::scalar::ScalarTensor {
        quantizer,
        group,
        codes,
        scales,
    };
    // The shape of codes and scales, checked before anything is decoded.
    tensor.check_shape().map_err(|e| err(e.to_string()))?;
    Ok(ScalarCoded { dtype, tensor }.into())
}
