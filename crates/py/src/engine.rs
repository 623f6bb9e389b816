//! `entrollm._native.engine_model`: a model as entrollm's engine loads it (a GGUF file, a
//! container of one, or any model of the Llama family the engine runs), in Hugging Face names and
//! layouts, for the transformers integration: its matrices as [`Matrix`] in the forms the engine
//! serves them in (GGUF blocks as stored, a container's recorded forms), its vectors as f32, and
//! the transformers config of the Llama architecture. Only the Llama family: its HF modules are
//! exactly the engine's weights (other families open through their containers' own config.json).

use crate::forms::Matrix;
use crate::EntrollmError;
use entrollm_model::load::{open_model_with, LoadOptions};
use entrollm_model::weights::Mlp;
use entrollm_model::Linear;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::path::PathBuf;
use std::sync::Arc;

fn err(e: impl std::fmt::Display) -> PyErr {
    EntrollmError::new_err(e.to_string())
}

type Vectors<'py> = Vec<(String, Bound<'py, PyBytes>)>;

/// What [`engine_model`] returns.
type EngineModel<'py> = (String, Vec<(String, Matrix)>, Vectors<'py>, Tokenizer);

/// `(config_json, matrices, vectors, tokenizer)`: the HF config, `[(name, Matrix)]` and
/// `[(name, f32 bytes)]` of the model at `path` (a tied LM head is left out: the config ties it),
/// and its tokenizer.
#[pyfunction]
pub fn engine_model<'py>(py: Python<'py>, path: PathBuf) -> PyResult<EngineModel<'py>> {
    crate::pool(None)?;
    let (w, tokenizer) = py
        .detach(|| open_model_with(&path, LoadOptions::default()))
        .map_err(err)?;
    let c = &w.config;
    let Some(json) = entrollm_model::synth::transformers_config_json(c) else {
        return Err(err(format!(
            "{}: a {:?} model; the engine's models open in transformers for the Llama family, \
             others through a container of their checkpoint (with its config.json)",
            path.display(),
            c.arch
        )));
    };
    let mut matrices = Vec::new();
    let mut vectors = Vec::new();
    let f32s = |v: &[f32]| {
        PyBytes::new(
            py,
            &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
        )
    };
    let mut matrix = |name: String, m: &Arc<dyn Linear>| {
        matrices.push((name, Matrix { m: Arc::clone(m) }));
    };
    matrix("model.embed_tokens.weight".into(), &w.embed);
    if !(c.tie_word_embeddings && Arc::ptr_eq(&w.embed, &w.lm_head)) {
        matrix("lm_head.weight".into(), &w.lm_head);
    }
    vectors.push(("model.norm.weight".to_string(), f32s(&w.final_norm)));
    for (i, l) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let Mlp::Gated(mlp) = &l.mlp else {
            return Err(err(format!(
                "{}: layer {i} is not a gated MLP",
                path.display()
            )));
        };
        for (n, m) in [("q", &l.q), ("k", &l.k), ("v", &l.v), ("o", &l.o)] {
            matrix(format!("{p}.self_attn.{n}_proj.weight"), m);
        }
        for (n, m) in [("gate", &mlp.gate), ("up", &mlp.up), ("down", &mlp.down)] {
            matrix(format!("{p}.mlp.{n}_proj.weight"), m);
        }
        vectors.push((format!("{p}.input_layernorm.weight"), f32s(&l.attn_norm)));
        vectors.push((
            format!("{p}.post_attention_layernorm.weight"),
            f32s(&l.mlp_norm),
        ));
    }
    Ok((json, matrices, vectors, Tokenizer(tokenizer)))
}

/// The engine's tokenizer of a model (`entrollm run` encodes a prompt with `encode(text)`).
#[pyclass(frozen, module = "entrollm._native")]
pub struct Tokenizer(entrollm_model::tokenizer::Tokenizer);

#[pymethods]
impl Tokenizer {
    #[pyo3(signature = (text, add_special=true))]
    fn encode(&self, text: &str, add_special: bool) -> PyResult<Vec<u32>> {
        self.0.encode(text, add_special).map_err(err)
    }
    fn decode(&self, ids: Vec<u32>) -> PyResult<String> {
        self.0.decode(&ids).map_err(err)
    }
}
