//! `entrollm._native.Matrix`: one matrix in a weight form (`entrollm_model::forms`), for the
//! PyTorch modules (`python/entrollm/torch.py`). Encoding, decoding and the products are the
//! forms' own CPU code; this file only moves bytes between Python and them.
//!
//! Tensors cross as (address, length) pairs that `entrollm.torch` takes from contiguous CPU
//! tensors it keeps alive for the call: the abi3 build has no buffer protocol below Python 3.11,
//! and a copy through `bytes` would double every product's input. These methods are private to
//! that module, which checks dtype, device, contiguity and sizes before it calls them.

use crate::EntrollmError;
use entrollm_model::forms::{self, ggml::BlockBytes, Source, Values};
use entrollm_model::gguf::GgmlType;
use entrollm_model::Linear;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::Arc;

/// A matrix in one weight form. Made by `encode` / `lossy` (or read from a container); its
/// product and decode are the form's CPU kernels.
#[pyclass(frozen, weakref, module = "entrollm._native")]
pub struct Matrix {
    pub(crate) m: Arc<dyn Linear>,
}

fn err(e: impl std::fmt::Display) -> PyErr {
    EntrollmError::new_err(e.to_string())
}

/// A tensor address the Rust side may read or write `f32`s at: a tensor without storage (on the
/// meta device: address 0) or misaligned is a Python error, never undefined behaviour.
fn f32_address(addr: usize, what: &str) -> PyResult<()> {
    if addr == 0 || !addr.is_multiple_of(std::mem::align_of::<f32>()) {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{what}: not the data of a CPU f32 tensor (address {addr:#x}; a meta tensor?)"
        )));
    }
    Ok(())
}

/// `len` bytes at `addr`, which the caller keeps alive and unaliased for the call.
///
/// # Safety
/// `addr` must point to `len` readable bytes (a contiguous CPU tensor's data).
unsafe fn bytes_at<'a>(addr: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    std::slice::from_raw_parts(addr as *const u8, len)
}

fn ggml_type(name: &str) -> PyResult<GgmlType> {
    GgmlType::ALL
        .iter()
        .copied()
        .find(|t| t.name().eq_ignore_ascii_case(name))
        .ok_or_else(|| PyValueError::new_err(format!("unknown ggml type '{name}'")))
}

/// The values of a `kind` matrix ("bf16", "f16", "f32", "fp8" or "ggml:TYPE") from its bytes.
fn values(kind: &str, b: &[u8]) -> PyResult<Values> {
    let halves = || -> Vec<u16> {
        b.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect()
    };
    let width = match kind {
        "bf16" | "f16" => 2,
        "f32" => 4,
        _ => 1,
    };
    if !b.len().is_multiple_of(width) {
        return Err(PyValueError::new_err(format!(
            "{} bytes are not whole {kind} values",
            b.len()
        )));
    }
    Ok(match kind {
        "bf16" => Values::Bf16(halves()),
        "f16" => Values::F16(halves()),
        "f32" => Values::F32(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        "fp8" => Values::Fp8(b.to_vec()),
        _ => match kind.strip_prefix("ggml:") {
            Some(ty) => {
                let ty = ggml_type(ty)?;
                entrollm_model::gguf::check_dequantizable("weight", ty).map_err(err)?;
                Values::Ggml {
                    ty,
                    bytes: BlockBytes::from_vec(b.to_vec()),
                }
            }
            None => {
                return Err(PyValueError::new_err(format!(
                    "values of kind '{kind}': expected bf16, f16, f32, fp8 or ggml:TYPE"
                )))
            }
        },
    })
}

/// The variant of `form` a matrix gets where none is named ([`forms::Form::default_variant`]).
fn default_variant(form: &dyn forms::Form, src: &Source) -> PyResult<String> {
    form.default_variant(src).map_err(err)?.ok_or_else(|| {
        err(format!(
            "form {} cannot hold a {}×{} {} matrix",
            form.name(),
            src.rows,
            src.cols,
            src.values.kind()
        ))
    })
}

#[pymethods]
impl Matrix {
    /// The `rows × cols` matrix of `kind` values (bytes at `addr`, `nbytes` long) in `form`,
    /// `variant` (None: the form's default, the smallest it offers), exactly.
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (form, variant, rows, cols, kind, addr, nbytes))]
    fn encode(
        py: Python<'_>,
        form: &str,
        variant: Option<&str>,
        rows: usize,
        cols: usize,
        kind: &str,
        addr: usize,
        nbytes: usize,
    ) -> PyResult<Matrix> {
        crate::pool(None)?;
        // SAFETY: `entrollm.torch` passes a live contiguous tensor's data and size.
        let b = unsafe { bytes_at(addr, nbytes) };
        let src = Source::new(rows, cols, values(kind, b)?).map_err(err)?;
        let form = forms::by_name(form).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let variant = match variant {
            Some(v) => v.to_string(),
            None => default_variant(form, &src)?,
        };
        let m = py
            .detach(|| forms::encode_checked(form, &src, &variant))
            .map_err(err)?;
        Ok(Matrix { m })
    }

    /// A `rows × cols` float matrix (`kind` bf16, f16 or f32) coded lossily at `bits` a weight
    /// with `quantizer` (`tcq32`, `e8`, …), as `compress --bits` codes it.
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (rows, cols, kind, addr, nbytes, bits, quantizer))]
    fn lossy(
        py: Python<'_>,
        rows: usize,
        cols: usize,
        kind: &str,
        addr: usize,
        nbytes: usize,
        bits: f64,
        quantizer: &str,
    ) -> PyResult<Matrix> {
        use entrollm_format::Dtype;
        use entrollm_model::compress::{code_lossy, LossyOptions};
        crate::pool(None)?;
        let (dtype, width) = match kind {
            "bf16" => (Dtype::BF16, 2),
            "f16" => (Dtype::F16, 2),
            "f32" => (Dtype::F32, 4),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "lossy coding takes bf16, f16 or f32 values, not {kind}"
                )))
            }
        };
        // The lossy tiles' quantisers (the scalar ones, int and fp8, are containers' codings of
        // the dtans form: `compress_module(bits=..., quantizer=...)`).
        let q =
            entrollm_model::compress::LossyQuantizer::Tiles(quantizer.parse().map_err(
                |e: String| PyValueError::new_err(format!("quantizer {quantizer}: {e}")),
            )?);
        if rows.checked_mul(cols).and_then(|n| n.checked_mul(width)) != Some(nbytes) || rows == 0 {
            return Err(PyValueError::new_err(format!(
                "a {rows}×{cols} {kind} matrix is not {nbytes} bytes"
            )));
        }
        // SAFETY: as in `encode`.
        let b = unsafe { bytes_at(addr, nbytes) };
        let opts = LossyOptions::new(bits, q);
        let coded = py.detach(|| code_lossy("weight", dtype, rows, cols, b, &opts));
        // Served as stored, by the form whose coder coded it.
        let stored = forms::StoredMatrix {
            name: "weight",
            dtype,
            shape: &[rows, cols],
            in_gguf: false,
        };
        let m = forms::Form::load(&forms::lossy::LOSSY, coded.map_err(err)?.0, &stored);
        Ok(Matrix { m: m.map_err(err)? })
    }

    #[getter]
    fn rows(&self) -> usize {
        self.m.rows()
    }
    #[getter]
    fn cols(&self) -> usize {
        self.m.cols()
    }
    /// The form's name.
    #[getter]
    fn form(&self) -> &'static str {
        self.m.form().form
    }
    #[getter]
    fn variant(&self) -> String {
        self.m.form().variant
    }
    /// Bytes the matrix occupies in memory.
    #[getter]
    fn stored_bytes(&self) -> usize {
        self.m.stored_bytes()
    }
    /// The kind of the values it holds: bf16, f16, f32, fp8, int or ggml.
    #[getter]
    fn values_kind(&self) -> &'static str {
        self.m.values_kind()
    }

    /// Y = X·Wᵀ for `n` f32 vectors at `x` into `y` (n·rows f32): for one vector the form's fused
    /// decode-matvec, for more its batched product.
    fn matmul(&self, py: Python<'_>, x: usize, n: usize, y: usize) -> PyResult<()> {
        crate::pool(None)?;
        let (r, c) = (self.m.rows(), self.m.cols());
        if n == 0 {
            return Ok(());
        }
        f32_address(x, "matmul input")?;
        f32_address(y, "matmul output")?;
        // SAFETY: `entrollm.torch` passes live contiguous f32 tensors of n·cols and n·rows
        // values, `y` freshly allocated (not aliasing `x`).
        let (x, y) = unsafe {
            (
                std::slice::from_raw_parts(x as *const f32, n * c),
                std::slice::from_raw_parts_mut(y as *mut f32, n * r),
            )
        };
        let m = &self.m;
        py.detach(|| match n {
            1 => m.matvec(x, y),
            _ => m.matmul(x, n, y),
        });
        Ok(())
    }

    /// The matrix decoded to f32 (rows·cols values) at `out`: the weights every product of the
    /// form multiplies (a lossy matrix's reconstruction, a ggml tensor's dequantised blocks).
    fn decode_into(&self, py: Python<'_>, out: usize) -> PyResult<()> {
        use rayon::prelude::*;
        crate::pool(None)?;
        let c = self.m.cols();
        if self.m.rows() * c == 0 {
            return Ok(());
        }
        f32_address(out, "decode_into output")?;
        // SAFETY: `entrollm.torch` passes a live contiguous f32 tensor of rows·cols values.
        let out = unsafe { std::slice::from_raw_parts_mut(out as *mut f32, self.m.rows() * c) };
        let m = &self.m;
        py.detach(|| {
            out.par_chunks_mut(c)
                .enumerate()
                .for_each(|(r, row)| m.row(r, row))
        });
        Ok(())
    }

    /// The exact values it holds, as `(kind, bytes)`: kind bf16, f16, f32 or fp8 (the bytes of
    /// the values), `ggml:TYPE` (the blocks), or `None` for integer codes with group scales
    /// (`decode_into` gives their values).
    fn values<'py>(&self, py: Python<'py>) -> PyResult<Option<(String, Bound<'py, PyBytes>)>> {
        self.exact(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "Matrix({}×{}, {}, {} bytes)",
            self.m.rows(),
            self.m.cols(),
            self.m.form(),
            self.m.stored_bytes()
        )
    }
}

impl Matrix {
    /// See `values`.
    pub(crate) fn exact<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<(String, Bound<'py, PyBytes>)>> {
        let src = py.detach(|| self.m.source()).map_err(err)?;
        let kind = src.values.kind();
        let (kind, bytes): (String, Vec<u8>) = match src.values {
            Values::Bf16(v) | Values::F16(v) => (
                kind.into(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            Values::F32(v) => (
                "f32".into(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            Values::Fp8(v) => ("fp8".into(), v),
            Values::Ggml { ty, bytes } => (format!("ggml:{}", ty.name()), bytes.bytes().to_vec()),
            Values::Int { .. } => return Ok(None),
        };
        Ok(Some((kind, PyBytes::new(py, &bytes))))
    }

    /// The matrix decoded to f32 (as `decode_into`), as little-endian bytes.
    pub(crate) fn decoded(&self, py: Python<'_>) -> PyResult<Vec<u8>> {
        let mut v = vec![0f32; self.m.rows() * self.m.cols()];
        self.decode_into(py, v.as_mut_ptr() as usize)?;
        Ok(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// The variants `form` offers for a `kind` matrix, `[(variant, predicted bytes)]`, smallest
/// first; empty where it cannot hold it.
#[pyfunction]
#[pyo3(signature = (form, rows, cols, kind, addr, nbytes))]
pub fn variants(
    py: Python<'_>,
    form: &str,
    rows: usize,
    cols: usize,
    kind: &str,
    addr: usize,
    nbytes: usize,
) -> PyResult<Vec<(String, f64)>> {
    // SAFETY: as in `Matrix::encode`.
    let b = unsafe { bytes_at(addr, nbytes) };
    let src = Source::new(rows, cols, values(kind, b)?).map_err(err)?;
    let form = forms::by_name(form).map_err(|e| PyValueError::new_err(e.to_string()))?;
    if !form.accepts(&src) {
        return Ok(Vec::new());
    }
    let mut c = py.detach(|| form.variants(&src)).map_err(err)?;
    c.sort_by(|a, b| a.predicted_bytes.total_cmp(&b.predicted_bytes));
    Ok(c.into_iter()
        .map(|c| (c.variant, c.predicted_bytes))
        .collect())
}

/// Every form's name.
#[pyfunction]
pub fn form_names() -> Vec<&'static str> {
    forms::all().iter().map(|f| f.name()).collect()
}
