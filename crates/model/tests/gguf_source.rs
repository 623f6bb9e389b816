//! GgufSource: configs and HF-layout tensors from GGUF files written by gguf-py
//! (tools/gen_gguf_testdata.py), and from SmolLM2-135M-Instruct when it is in the cache
//! (scripts/fetch-smollm2).

mod common;

use entrollm_model::config::{Arch, RopeScaling, RopeStyle};
use entrollm_model::gguf::{GgufFile, GgufSource, GgufWriter, MetaValue};
use entrollm_model::{HostTensor, ModelError, TensorSource};
use std::path::PathBuf;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn f32_tensor(t: HostTensor) -> (Vec<usize>, Vec<f32>) {
    match t {
        HostTensor::F32 { shape, data } => (shape, data),
        HostTensor::F16 { shape, data } => (
            shape,
            data.iter()
                .map(|&h| half::f16::from_bits(h).to_f32())
                .collect(),
        ),
        HostTensor::Bf16 { shape, data } => (
            shape,
            data.iter()
                .map(|&h| half::bf16::from_bits(h).to_f32())
                .collect(),
        ),
        // Quantised matrices are served from their blocks; their rows are ggml's dequantisation.
        HostTensor::Linear(m) => {
            let mut data = vec![0f32; m.rows() * m.cols()];
            for (r, row) in data.chunks_exact_mut(m.cols()).enumerate() {
                m.row(r, row);
            }
            (vec![m.rows(), m.cols()], data)
        }
    }
}

#[test]
fn tiny_llama_config() {
    let src = GgufSource::open(data("gguf_tiny_llama.gguf")).unwrap();
    let c = src.config().unwrap();
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(
        (
            c.vocab_size,
            c.hidden_size,
            c.intermediate_size,
            c.num_layers
        ),
        (96, 64, 128, 2)
    );
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (4, 2, 16));
    assert_eq!(c.max_position_embeddings, 512);
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert_eq!(c.rope_theta, 10000.0);
    assert_eq!(
        c.rope_style,
        RopeStyle::Neox,
        "Q/K are un-permuted to HF layout"
    );
    assert!(!c.tie_word_embeddings);
    assert!(!c.attention_bias);
    assert_eq!(c.bos_token_id, Some(1));
    assert_eq!(
        c.eos_token_ids,
        vec![2, 3],
        "EOS and EOT both end generation"
    );
    // rope_freqs.weight was written from factor 4, low 1, high 32, original 4096.
    let RopeScaling::Llama3 {
        factor,
        low_freq_factor,
        high_freq_factor,
        original_max_position_embeddings,
    } = c.rope_scaling
    else {
        panic!("expected llama3 scaling, got {:?}", c.rope_scaling)
    };
    assert_eq!(factor, 4.0);
    assert_eq!(original_max_position_embeddings, 4096);
    assert!((low_freq_factor - 1.0).abs() < 1e-3, "{low_freq_factor}");
    assert!((high_freq_factor - 32.0).abs() < 1e-2, "{high_freq_factor}");
}

#[test]
fn tiny_llama_tensors_come_out_in_hf_layout() {
    let src = GgufSource::open(data("gguf_tiny_llama.gguf")).unwrap();
    let expected = GgufFile::open(data("gguf_tiny_llama.expected.gguf")).unwrap();
    assert!(expected.tensors().len() >= 7);
    for info in expected.tensors() {
        let (shape, values) = f32_tensor(
            src.tensor(&info.name)
                .unwrap()
                .unwrap_or_else(|| panic!("{} missing", info.name)),
        );
        assert_eq!(shape, info.hf_shape(), "{}", info.name);
        let want = expected.tensor_f32(&info.name).unwrap();
        assert_eq!(values.len(), want.len());
        for (i, (a, b)) in values.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{} element {i}", info.name);
        }
    }
    // Precision is kept for F16/BF16 tensors, quantized ones stay in their blocks.
    assert!(matches!(
        src.tensor("model.layers.0.self_attn.q_proj.weight")
            .unwrap(),
        Some(HostTensor::F16 { .. })
    ));
    assert!(matches!(
        src.tensor("model.layers.0.self_attn.k_proj.weight")
            .unwrap(),
        Some(HostTensor::Bf16 { .. })
    ));
    assert!(matches!(
        src.tensor("model.layers.1.self_attn.q_proj.weight")
            .unwrap(),
        Some(HostTensor::Linear(m)) if m.form().form == "ggml"
    ));
    let (shape, norm) = f32_tensor(src.tensor("model.norm.weight").unwrap().unwrap());
    assert_eq!(shape, vec![64]);
    assert_eq!(norm, src.file().tensor_f32("output_norm.weight").unwrap());
    assert!(src
        .tensor("model.layers.0.self_attn.q_proj.bias")
        .unwrap()
        .is_none());
    assert!(src
        .tensor("model.layers.7.mlp.up_proj.weight")
        .unwrap()
        .is_none());
    assert!(src.tensor("not.a.tensor").unwrap().is_none());
}

#[test]
fn tiny_qwen2_is_not_permuted_and_ties_embeddings() {
    let src = GgufSource::open(data("gguf_tiny_qwen2.gguf")).unwrap();
    let c = src.config().unwrap();
    assert_eq!(c.arch, Arch::Qwen2);
    assert!(c.tie_word_embeddings);
    assert!(c.attention_bias);
    assert_eq!(c.rope_scaling, RopeScaling::None);
    assert_eq!(
        (
            c.vocab_size,
            c.num_layers,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim
        ),
        (80, 1, 4, 2, 16)
    );
    assert_eq!(c.bos_token_id, None);
    assert_eq!(c.eos_token_ids, vec![5]);
    assert!(
        src.tensor("lm_head.weight").unwrap().is_none(),
        "tied: no separate lm_head"
    );
    for (hf, gguf) in [
        (
            "model.layers.0.self_attn.q_proj.weight",
            "blk.0.attn_q.weight",
        ),
        ("model.layers.0.self_attn.q_proj.bias", "blk.0.attn_q.bias"),
        ("model.layers.0.self_attn.k_proj.bias", "blk.0.attn_k.bias"),
    ] {
        let (shape, values) = f32_tensor(src.tensor(hf).unwrap().unwrap());
        assert_eq!(shape, src.file().tensor_info(gguf).unwrap().hf_shape());
        assert_eq!(values, src.file().tensor_f32(gguf).unwrap(), "{hf}");
    }
    let (shape, _) = f32_tensor(
        src.tensor("model.layers.0.self_attn.k_proj.weight")
            .unwrap()
            .unwrap(),
    );
    assert_eq!(shape, vec![32, 64]);
}

/// A llama file with Q/K biases: biases are un-permuted like the weight rows.
#[test]
fn llama_biases_are_unpermuted() {
    let mut w = GgufWriter::new();
    w.meta_str("general.architecture", "llama")
        .meta_u32("llama.embedding_length", 8)
        .meta_u32("llama.attention.head_count", 2)
        .meta_u32("llama.attention.head_count_kv", 1)
        .meta_u32("llama.block_count", 1)
        .meta_u32("llama.feed_forward_length", 8)
        .meta_u32("llama.context_length", 16)
        .meta_u32("llama.vocab_size", 10)
        .meta_f32("llama.attention.layer_norm_rms_epsilon", 1e-6)
        .tensor_f32(
            "blk.0.attn_q.bias",
            &[8],
            &[0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0],
        )
        .tensor_f32("blk.0.attn_k.bias", &[4], &[0.0, 2.0, 1.0, 3.0]);
    let src = GgufSource::new(GgufFile::from_bytes("bias.gguf", w.to_bytes()).unwrap()).unwrap();
    let (_, q) = f32_tensor(
        src.tensor("model.layers.0.self_attn.q_proj.bias")
            .unwrap()
            .unwrap(),
    );
    assert_eq!(q, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    let (_, k) = f32_tensor(
        src.tensor("model.layers.0.self_attn.k_proj.bias")
            .unwrap()
            .unwrap(),
    );
    assert_eq!(k, vec![0.0, 1.0, 2.0, 3.0]);
    assert!(src.config().unwrap().attention_bias);
    assert!(src.config().unwrap().tie_word_embeddings);
}

#[test]
fn unsupported_and_incomplete_files_are_clear_errors() {
    let mut w = GgufWriter::new();
    w.meta_str("general.architecture", "mamba");
    let err = GgufSource::new(GgufFile::from_bytes("g.gguf", w.to_bytes()).unwrap()).unwrap_err();
    assert!(
        matches!(&err, ModelError::Unsupported(m) if m.contains("`mamba`") && m.contains("g.gguf")
            && m.contains("gemma3")),
        "{err}"
    );

    let err =
        GgufSource::new(GgufFile::from_bytes("n.gguf", GgufWriter::new().to_bytes()).unwrap())
            .unwrap_err();
    assert!(err.to_string().contains("general.architecture"), "{err}");

    let mut w = GgufWriter::new();
    w.meta_str("general.architecture", "llama")
        .meta_u32("llama.embedding_length", 8);
    let src = GgufSource::new(GgufFile::from_bytes("m.gguf", w.to_bytes()).unwrap()).unwrap();
    let err = src.config().unwrap_err();
    assert!(
        matches!(&err, ModelError::Config(m) if m.contains("llama.attention.head_count")),
        "{err}"
    );

    let mut w = GgufWriter::new();
    w.meta_str("general.architecture", "qwen2")
        .meta_u32("qwen2.embedding_length", 8)
        .meta_u32("qwen2.attention.head_count", 2)
        .meta_u32("qwen2.block_count", 1)
        .meta_u32("qwen2.feed_forward_length", 8)
        .meta_u32("qwen2.context_length", 16)
        .meta_f32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
        .meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(entrollm_model::gguf::MetaArray::String(vec!["a".into()])),
        );
    let with_rope = |kind: &str| {
        let mut w = w.clone();
        w.meta_str("qwen2.rope.scaling.type", kind);
        GgufSource::new(GgufFile::from_bytes("y.gguf", w.to_bytes()).unwrap()).unwrap()
    };
    let src = with_rope("longrope");
    assert!(matches!(src.config(), Err(ModelError::Unsupported(m)) if m.contains("longrope")));
    let src = with_rope("yarn");
    assert!(
        matches!(src.config(), Err(ModelError::Config(m)) if m.contains("qwen2.rope.scaling.factor"))
    );
}

/// SmolLM2-135M-Instruct (Q4_1), from `scripts/fetch-smollm2`. Skipped with a message when the
/// model is not in the cache.

#[test]
fn smollm2_loads_with_hf_names() {
    let path = common::smollm2_gguf();
    let src = GgufSource::open(&path).unwrap();
    let c = src.config().unwrap();
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(
        (
            c.vocab_size,
            c.hidden_size,
            c.intermediate_size,
            c.num_layers
        ),
        (49152, 576, 1536, 30)
    );
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (9, 3, 64));
    assert_eq!(c.max_position_embeddings, 8192);
    assert_eq!(c.rope_theta, 100000.0);
    assert_eq!(c.rope_scaling, RopeScaling::None);
    assert!(c.tie_word_embeddings);
    assert_eq!(c.bos_token_id, Some(1));
    assert_eq!(c.eos_token_ids, vec![2]);
    let file = src.file();
    assert_eq!(
        file.tensor_info("blk.0.ffn_up.weight").unwrap().ggml_type,
        entrollm_model::gguf::GgmlType::Q4_1
    );
    let (shape, q) = f32_tensor(
        src.tensor("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .unwrap(),
    );
    assert_eq!(shape, vec![576, 576]);
    // Un-permuted: HF row h·64 + j·32 + i is GGUF row h·64 + 2i + j.
    let raw = file.tensor_f32("blk.0.attn_q.weight").unwrap();
    for (h, i, j) in [(0, 0, 1), (3, 17, 0), (8, 31, 1)] {
        let (hf, gg) = (h * 64 + j * 32 + i, h * 64 + 2 * i + j);
        assert_eq!(&q[hf * 576..(hf + 1) * 576], &raw[gg * 576..(gg + 1) * 576]);
    }
    let (shape, _) = f32_tensor(src.tensor("model.embed_tokens.weight").unwrap().unwrap());
    assert_eq!(shape, vec![49152, 576]);
    let (shape, _) = f32_tensor(
        src.tensor("model.layers.29.mlp.down_proj.weight")
            .unwrap()
            .unwrap(),
    );
    assert_eq!(shape, vec![576, 1536]);
    // Raw Q4_1 codes re-pack to the file's bytes.
    let codes = file.tensor_codes("blk.5.ffn_gate.weight").unwrap();
    let info = file.tensor_info("blk.5.ffn_gate.weight").unwrap();
    assert_eq!(
        entrollm_model::gguf::pack_codes(&codes).unwrap(),
        file.tensor_data(info)
    );
}
