//! `entrollm._native.Container`: a container's tensors one by one, for `entrollm.torch.load_into`
//! and the transformers integration: matrices as [`Matrix`] in the forms the container records
//! (coded ones kept coded), other tensors as their exact bytes; everything checked against the
//! manifest's checksums (`ContainerSource::open_tensors`).

use crate::forms::Matrix;
use crate::EntrollmError;
use entrollm_model::load::ContainerSource;
use entrollm_model::{HostTensor, TensorSource};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::path::PathBuf;

fn err(e: impl std::fmt::Display) -> PyErr {
    EntrollmError::new_err(e.to_string())
}

/// A tensor's `(kind, shape, bytes)`.
type Tensor<'py> = (String, Vec<usize>, Bound<'py, PyBytes>);

#[pyclass(frozen, module = "entrollm._native")]
pub struct Container {
    src: ContainerSource,
    path: PathBuf,
}

impl Container {
    /// `e` naming the container where the message does not already.
    fn err(&self, e: impl std::fmt::Display) -> PyErr {
        let (msg, dir) = (e.to_string(), self.path.display().to_string());
        match msg.contains(&dir) {
            true => err(msg),
            false => err(format!("{dir}: {msg}")),
        }
    }
}

#[pymethods]
impl Container {
    #[new]
    fn new(path: PathBuf) -> PyResult<Container> {
        Ok(Container {
            src: ContainerSource::open_tensors(&path).map_err(err)?,
            path,
        })
    }

    /// The tensors' names, in the order they were written.
    fn names(&self) -> Vec<String> {
        self.src.reader().names().map(str::to_string).collect()
    }

    /// `(dtype, shape)` of tensor `name` as the manifest records it, or `None`.
    fn info(&self, name: &str) -> Option<(String, Vec<usize>)> {
        let t = self
            .src
            .reader()
            .manifest()
            .tensors
            .iter()
            .find(|t| t.name == name)?;
        Some((format!("{:?}", t.dtype).to_lowercase(), t.shape.clone()))
    }

    /// The coder of tensor `name` where it is coded, `None` where it is stored plain (under its
    /// own name in a shard, where transformers reads it) or there is no such tensor.
    fn coder(&self, name: &str) -> Option<String> {
        let r = self.src.reader();
        let t = r.manifest().tensors.iter().find(|t| t.name == name)?;
        match &t.storage {
            entrollm_format::container::Storage::Coded(c) => Some(c.coder.clone()),
            entrollm_format::container::Storage::Plain(_) => None,
        }
    }

    /// The form the container records for tensor `name` (`compress --plan`/`--budget`), as
    /// `(form, variant)`, or `None`.
    fn form(&self, name: &str) -> Option<(String, String)> {
        self.src
            .reader()
            .form(name)
            .map(|f| (f.form.clone(), f.variant.clone()))
    }

    /// Matrix `name` in the form `run` serves it in, or `None` where there is no such tensor.
    fn matrix(&self, py: Python<'_>, name: &str) -> PyResult<Option<Matrix>> {
        crate::pool(None)?;
        let m = py
            .detach(|| self.src.matrix(name))
            .map_err(|e| self.err(e))?;
        Ok(m.map(|m| Matrix { m }))
    }

    /// Tensor `name` decoded: `(kind, shape, bytes)` with kind bf16, f16 or f32 (the values as
    /// the source stored them), or `None` where there is no such tensor.
    fn tensor<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Option<Tensor<'py>>> {
        crate::pool(None)?;
        let Some(t) = py
            .detach(|| self.src.tensor(name))
            .map_err(|e| self.err(e))?
        else {
            return Ok(None);
        };
        let le16 = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let (kind, shape, bytes) = match t {
            HostTensor::F32 { shape, data } => (
                "f32",
                shape,
                data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            HostTensor::Bf16 { shape, data } => ("bf16", shape, le16(&data)),
            HostTensor::F16 { shape, data } => ("f16", shape, le16(&data)),
            HostTensor::Linear(m) => {
                // A coded matrix: its exact values (a quantised one's as f32).
                let shape = vec![m.rows(), m.cols()];
                let matrix = Matrix { m };
                match matrix.exact(py)? {
                    Some((kind, bytes)) if kind != "fp8" && !kind.starts_with("ggml") => {
                        return Ok(Some((kind, shape, bytes)))
                    }
                    _ => ("f32", shape, matrix.decoded(py)?),
                }
            }
        };
        Ok(Some((kind.to_string(), shape, PyBytes::new(py, &bytes))))
    }

    /// The verbatim file `name` the container keeps (config.json, tokenizer files), checked.
    fn file<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
        let b = self
            .src
            .reader()
            .read_verbatim(name, 1 << 30)
            .map_err(|e| self.err(e))?;
        Ok(PyBytes::new(py, &b))
    }

    /// The names of the files the container keeps for its source (verbatim copies, and the
    /// source's config.json where the container's own is generated for transformers).
    fn files(&self) -> Vec<String> {
        let r = self.src.reader();
        r.verbatim_names().into_iter().map(String::from).collect()
    }

    /// The names of the files the container generated for transformers (`config.json`, …).
    fn generated(&self) -> Vec<String> {
        let m = self.src.reader().manifest();
        m.generated.iter().map(|f| f.name.clone()).collect()
    }
}
