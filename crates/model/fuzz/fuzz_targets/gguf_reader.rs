//! Fuzzes the GGUF reader: parsing arbitrary bytes must give a `ModelError`, never a panic, an
//! out-of-bounds access or a huge allocation; a file that parses must survive dequantisation of
//! every tensor, raw-code round trips, typed metadata access, `GgufSource` and the tokenizer.
//!
//! Run on the stable toolchain from the repository root (seeds first):
//!   cargo run --manifest-path crates/model/fuzz/Cargo.toml --bin make_seeds -- crates/model/fuzz/corpus/gguf_reader
//!   RUSTC_BOOTSTRAP=1 cargo fuzz run --fuzz-dir crates/model/fuzz gguf_reader -- -max_total_time=600
#![no_main]

use entrollm_model::gguf::{pack_codes, GgufFile, GgufSource};
use entrollm_model::tokenizer::Tokenizer;
use entrollm_model::TensorSource;
use libfuzzer_sys::fuzz_target;

const HF_NAMES: [&str; 12] = [
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.q_proj.bias",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.k_proj.bias",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
];

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    for info in file.tensors() {
        if let Ok(values) = file.dequantize(info) {
            assert_eq!(values.len() as u64, info.n_elements());
        }
        if let Ok(codes) = file.tensor_codes(&info.name) {
            assert_eq!(
                pack_codes(&codes).unwrap(),
                file.tensor_data(info),
                "{}",
                info.name
            );
        }
    }
    let keys: Vec<String> = file.metadata().map(|(k, _)| k.to_string()).collect();
    for k in &keys {
        let _ = file.get_u64(k);
        let _ = file.get_u32(k);
        let _ = file.get_f32(k);
        let _ = file.get_bool(k);
        let _ = file.get_str(k);
        let _ = file.get_str_array(k);
        let _ = file.get_f32_array(k);
        let _ = file.get_i64_array(k);
    }
    if let Ok(tok) = Tokenizer::from_gguf(&file) {
        if let Ok(ids) = tok.encode("Hello world 123 <s> é😀", true) {
            let _ = tok.decode(&ids);
            let mut stream = tok.stream_decoder();
            for id in ids {
                let _ = stream.push(id);
            }
            let _ = stream.flush();
        }
    }
    if let Ok(source) = GgufSource::new(file) {
        let _ = source.config();
        for name in HF_NAMES {
            let _ = source.tensor(name);
        }
    }
});
