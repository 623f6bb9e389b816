//! Coded tensors in the container: each coder is one module here that says how its tensors map to
//! a container's arrays and JSON parameters, and back (the [`Coder`] trait); a loader finds the
//! coder a manifest names in [`coders`] and never matches over coders. `docs/dtans.md` and
//! `docs/format.md` describe the arrays. Adding a coder is one module plus its line in [`coders`].

mod blocks;
mod df11;
mod dtans;
mod fields;
mod floats;
mod ggml;
mod ggml_scales;
mod lossy;
mod scalar;
mod stream;
#[cfg(test)]
mod tests;

pub use blocks::{BlocksCoded, BlocksEntropy, DTANS_BLOCKS};
pub use df11::DF11;
pub use dtans::DTANS;
pub use fields::{FieldsCoded, FIELD_WIDTHS, RANS_FIELDS};
pub use floats::{FloatsCoded, RANS_FLOATS};
pub use ggml::{GgmlCoded, DTANS_GGML};
pub use ggml_scales::{GgmlScales, GGML_SCALES};
pub use lossy::{LossyCoded, LOSSY};
pub use scalar::{ScalarCoded, DTANS_SCALAR};
pub use stream::{BlockStream, RANS_MARGIN_BITS};

use crate::container::{ArrayDtype, CodedTensor};
use crate::{Dtype, FormatError, Result};
use entrollm_codec::dtans::{DtansParams, DtansTensor};
/// The FP16 matrix shape block scales (and scalar codes' scales) are coded in.
pub use entrollm_codec::lossy::scalar::scale_matrix_shape;
use entrollm_codec::Payload;
use serde_json::Value;
use std::any::Any;
use std::borrow::Cow;

/// A container's named arrays of one coded tensor, as a coder stores them.
pub type Arrays<'t> = Vec<(String, ArrayDtype, Cow<'t, [u8]>)>;

/// One coder's tensors: what the container stores of them and how they decode. Each coder module
/// implements it for its coded type and lists a [`CoderKind`] in [`coders`].
pub trait Coder: AsAny + Send + Sync {
    /// The coder's name, as the manifest records it.
    fn name(&self) -> &'static str;
    /// The parameters the manifest stores.
    fn params(&self) -> Value;
    /// The arrays to store, by name.
    fn arrays(&self) -> Arrays<'_>;
    /// The decoded tensor's bytes, as the source stored them.
    fn decode(&self) -> entrollm_codec::Result<Vec<u8>>;
    /// [`Self::decode`] and, for the dtANS coders, where the stored bytes go, from one pass over
    /// the coded tiles.
    fn decode_with_breakdown(
        &self,
    ) -> entrollm_codec::Result<(Vec<u8>, Option<entrollm_codec::dtans::SizeBreakdown>)> {
        Ok((self.decode()?, None))
    }
    fn stored_bytes(&self) -> usize;
    /// Whether it decodes to a lossy reconstruction rather than to the source's bytes (a restored
    /// file holds the reconstruction).
    fn reconstructs(&self) -> bool {
        false
    }
}

/// For [`Coded::downcast`]: every coder is its own type.
pub trait AsAny: Any {
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
    fn as_any(&self) -> &dyn Any;
}

impl<T: Any> AsAny for T {
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A coded tensor as the container's reader rebuilt it: its dtype, shape and coded arrays.
pub struct Stored<'s, 'a> {
    pub dtype: Dtype,
    pub shape: &'s [usize],
    pub tensor: &'s CodedTensor<'a>,
}

impl<'a> Stored<'_, 'a> {
    /// The array `n`, which must be of `want`.
    fn array(&self, n: &str, want: ArrayDtype) -> Result<&'a [u8]> {
        match self.tensor.arrays.get(n) {
            Some(&(d, b)) if d == want => Ok(b),
            Some(&(d, _)) => Err(FormatError::Usage(format!(
                "array '{n}' is {d:?}, expected {want:?}"
            ))),
            None => Err(FormatError::Usage(format!(
                "{} tensor has no '{n}' array",
                self.tensor.coder
            ))),
        }
    }

    fn params(&self) -> &'a Value {
        self.tensor.params
    }

    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A coder as loaders find it: its name and how its tensors are read back from the container,
/// checked against the tensor's dtype and shape and for a sound structure.
pub struct CoderKind {
    pub name: &'static str,
    pub load: fn(&Stored<'_, '_>) -> Result<Coded>,
}

/// Every coder the container knows.
pub fn coders() -> &'static [CoderKind] {
    static ALL: [CoderKind; 9] = [
        dtans::KIND,
        ggml::KIND,
        ggml_scales::KIND,
        blocks::KIND,
        fields::KIND,
        floats::KIND,
        df11::KIND,
        lossy::KIND,
        scalar::KIND,
    ];
    &ALL
}

/// A tensor in one of the container's coded forms.
pub struct Coded(Box<dyn Coder>);

impl std::fmt::Debug for Coded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Coded({}, {} bytes)", self.coder(), self.stored_bytes())
    }
}

impl<T: Coder> From<T> for Coded {
    fn from(t: T) -> Coded {
        Coded(Box::new(t))
    }
}

impl Coded {
    pub fn new(t: impl Coder) -> Coded {
        Coded(Box::new(t))
    }

    pub fn coder(&self) -> &'static str {
        self.0.name()
    }

    /// The parameters the manifest stores, with `stats` (shown by `inspect`) added.
    pub fn params(&self, stats: Value) -> Value {
        let mut v = self.0.params();
        v["stats"] = stats;
        v
    }

    /// The arrays to store, by name.
    pub fn arrays(&self) -> Arrays<'_> {
        self.0.arrays()
    }

    /// Rebuilds a coded tensor from the container by its coder ([`coders`]), checking that it
    /// matches the tensor's dtype and shape and that its structure is sound. Callers add the
    /// tensor's name to errors.
    pub fn from_stored(dtype: Dtype, shape: &[usize], c: &CodedTensor<'_>) -> Result<Coded> {
        match coders().iter().find(|k| k.name == c.coder) {
            Some(k) => (k.load)(&Stored {
                dtype,
                shape,
                tensor: c,
            }),
            None => {
                let names: Vec<&str> = coders().iter().map(|k| k.name).collect();
                Err(FormatError::Usage(format!(
                    "unknown coder '{}' (this entrollm knows {})",
                    c.coder,
                    names.join(", ")
                )))
            }
        }
    }

    /// The decoded tensor's bytes, as the source stored them.
    pub fn decode(&self) -> entrollm_codec::Result<Vec<u8>> {
        self.0.decode()
    }

    /// See [`Coder::decode_with_breakdown`].
    pub fn decode_with_breakdown(
        &self,
    ) -> entrollm_codec::Result<(Vec<u8>, Option<entrollm_codec::dtans::SizeBreakdown>)> {
        self.0.decode_with_breakdown()
    }

    pub fn stored_bytes(&self) -> usize {
        self.0.stored_bytes()
    }

    /// See [`Coder::reconstructs`].
    pub fn reconstructs(&self) -> bool {
        self.0.reconstructs()
    }

    /// The coded tensor as `T`, where it is one (a form that serves its coder's tensors takes
    /// them so); itself otherwise.
    pub fn downcast<T: Coder>(self) -> std::result::Result<T, Coded> {
        // Through the coder's own vtable (`self.0.as_any()` would take the box itself as `Any`).
        match AsAny::as_any(&*self.0).is::<T>() {
            true => Ok(*AsAny::into_any(self.0).downcast::<T>().expect("checked")),
            false => Err(self),
        }
    }

    /// The coded tensor as `T`, where it is one.
    pub fn downcast_ref<T: Coder>(&self) -> Option<&T> {
        AsAny::as_any(&*self.0).downcast_ref::<T>()
    }
}

fn u16_bytes(v: &[u16]) -> Cow<'_, [u8]> {
    Cow::Owned(v.iter().flat_map(|w| w.to_le_bytes()).collect())
}

fn to_u16(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

/// The payload that codes a tensor stored as `dtype`, if any.
pub fn payload_of(dtype: Dtype) -> Option<Payload> {
    match dtype {
        Dtype::BF16 => Some(Payload::Bf16),
        Dtype::F16 => Some(Payload::Fp16),
        Dtype::F8E4M3 => Some(Payload::Fp8E4m3),
        Dtype::F8E5M2 => Some(Payload::Fp8E5m2),
        _ => None,
    }
}

fn u32_bytes(v: &[u32]) -> Cow<'_, [u8]> {
    Cow::Owned(v.iter().flat_map(|w| w.to_le_bytes()).collect())
}

fn to_u32(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn dtans_params(params: &Value) -> Result<DtansParams> {
    serde_json::from_value(params.clone())
        .map_err(|e| FormatError::Usage(format!("bad dtans params: {e}")))
}

/// The arrays of a dtANS tensor (`docs/dtans.md`).
fn dtans_arrays(t: &DtansTensor) -> Vec<(String, ArrayDtype, Cow<'_, [u8]>)> {
    let a = |n: &str, d, b| (n.to_string(), d, b);
    let symbols: Vec<u32> = t.table.symbols.iter().map(|&s| s as u32).collect();
    vec![
        a(
            "symbols",
            ArrayDtype::U32,
            Cow::Owned(u32_bytes(&symbols).into_owned()),
        ),
        a("counts", ArrayDtype::U8, Cow::Borrowed(&t.table.counts[..])),
        a("tiles", ArrayDtype::U32, u32_bytes(&t.tiles)),
        a("stream", ArrayDtype::U32, u32_bytes(&t.stream)),
        a("companion", ArrayDtype::U32, u32_bytes(&t.companion)),
        a("raw", ArrayDtype::U8, Cow::Borrowed(&t.raw[..])),
    ]
}

/// A dtANS tensor from its stored arrays; `array(name, dtype)` fetches one.
fn dtans_from_arrays<'a>(
    p: &DtansParams,
    array: impl Fn(&str, ArrayDtype) -> Result<&'a [u8]>,
) -> Result<DtansTensor> {
    let err = FormatError::Usage;
    let symbols = to_u32(array("symbols", ArrayDtype::U32)?)
        .iter()
        .map(|&s| u16::try_from(s).map_err(|_| err(format!("table symbol {s} exceeds 16 bits"))))
        .collect::<Result<Vec<u16>>>()?;
    DtansTensor::from_parts(
        p,
        symbols,
        array("counts", ArrayDtype::U8)?.to_vec(),
        to_u32(array("tiles", ArrayDtype::U32)?),
        to_u32(array("stream", ArrayDtype::U32)?),
        to_u32(array("companion", ArrayDtype::U32)?),
        array("raw", ArrayDtype::U8)?.to_vec(),
    )
    .map_err(|e| err(e.to_string()))
}
