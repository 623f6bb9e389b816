//! `ContainerSource::open_tensors`: a container of tensors that are no model the engine runs
//! (a bare .safetensors file, no config.json) served tensor by tensor, coded matrices kept coded
//! (a DFloat11 one too) and holding the source's values exactly.

mod common;

use entrollm_model::compress::{compress, Coder, CompressOptions, NoProgress};
use entrollm_model::load::{ContainerSource, SafetensorsSource};
use entrollm_model::{HostTensor, TensorSource};
use std::path::PathBuf;

fn qwen3_safetensors() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/families/qwen3-bf16")
}

#[test]
fn a_container_without_a_model_serves_its_matrices_coded_and_exact() {
    let scratch = common::Scratch::new("open-tensors");
    let file = scratch.0.join("tensors.safetensors");
    std::fs::copy(qwen3_safetensors().join("model.safetensors"), &file).unwrap();
    let source = SafetensorsSource::open(&qwen3_safetensors()).unwrap();
    let name = "model.layers.0.mlp.down_proj.weight";
    let want = match source.tensor(name).unwrap().unwrap() {
        HostTensor::Bf16 { data, .. } => data,
        _ => panic!("a bf16 matrix"),
    };
    for (coder, form) in [(Coder::Dtans, "dtans"), (Coder::Df11, "df11")] {
        let out = scratch.0.join(form);
        let opts = CompressOptions {
            coder,
            dtans_only: coder == Coder::Dtans,
            min_elements: 0,
            ..CompressOptions::default()
        };
        compress(&file, &out, &opts, &mut NoProgress).unwrap();
        let c = ContainerSource::open_tensors(&out).unwrap();
        let err = c.config().unwrap_err().to_string();
        assert!(err.contains("config.json"), "{err}");
        let m = c.matrix(name).unwrap().unwrap();
        assert_eq!(m.form().form, form);
        match m.source().unwrap().values {
            entrollm_model::forms::Values::Bf16(v) => assert!(v == want, "{form}: values differ"),
            v => panic!("{form}: {}", v.kind()),
        }
        assert!(c.matrix("no.such.weight").unwrap().is_none());
        // A 1-D tensor is no matrix: an error naming it.
        let norm = "model.layers.0.input_layernorm.weight";
        let e = c.matrix(norm).err().expect("a vector").to_string();
        assert!(e.contains(norm), "{e}");
    }
}
