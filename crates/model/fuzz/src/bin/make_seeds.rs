//! Writes seed GGUF files for the `gguf_reader` fuzz target into the directory given as the first
//! argument: small valid files of every dequantisable type, a tiny llama with a tokenizer, and the
//! repository's GGUF test files.

use entrollm_model::gguf::{GgmlType, GgufWriter, MetaArray, MetaValue, DEQUANTIZABLE};
use std::path::{Path, PathBuf};

fn strings(v: &[&str]) -> MetaValue {
    MetaValue::Array(MetaArray::String(v.iter().map(|s| s.to_string()).collect()))
}

fn main() {
    let out = PathBuf::from(
        std::env::args()
            .nth(1)
            .expect("usage: make_seeds <corpus dir>"),
    );
    std::fs::create_dir_all(&out).unwrap();
    let write = |name: &str, bytes: Vec<u8>| std::fs::write(out.join(name), bytes).unwrap();

    for ty in DEQUANTIZABLE {
        let (block, size) = ty.block_layout();
        let data: Vec<u8> = (0..size * 2).map(|i| (i * 37 % 251) as u8).collect();
        let mut w = GgufWriter::new();
        w.meta_u32("general.alignment", 32)
            .tensor(ty.name(), ty, &[block as u64, 2], data);
        write(&format!("type_{}.gguf", ty.name()), w.to_bytes());
    }

    let mut w = GgufWriter::new();
    w.meta_str("general.architecture", "llama")
        .meta_u32("llama.embedding_length", 32)
        .meta_u32("llama.attention.head_count", 2)
        .meta_u32("llama.attention.head_count_kv", 1)
        .meta_u32("llama.block_count", 1)
        .meta_u32("llama.feed_forward_length", 32)
        .meta_u32("llama.context_length", 64)
        .meta_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .meta_str("tokenizer.ggml.model", "gpt2")
        .meta_str("tokenizer.ggml.pre", "llama-bpe")
        .meta(
            "tokenizer.ggml.tokens",
            strings(&["<s>", "H", "e", "l", "o", "He", "ll", "Hell", "Hello"]),
        )
        .meta(
            "tokenizer.ggml.token_type",
            MetaValue::Array(MetaArray::I32(vec![3, 1, 1, 1, 1, 1, 1, 1, 1])),
        )
        .meta(
            "tokenizer.ggml.merges",
            strings(&["H e", "l l", "He ll", "Hell o"]),
        )
        .meta_u32("tokenizer.ggml.bos_token_id", 0)
        .tensor(
            "token_embd.weight",
            GgmlType::Q8_0,
            &[32, 9],
            vec![1; 34 * 9],
        )
        .tensor_f32("blk.0.attn_norm.weight", &[32], &[1.0; 32])
        .tensor(
            "blk.0.attn_q.weight",
            GgmlType::Q4_0,
            &[32, 32],
            vec![0x5A; 18 * 32],
        )
        .tensor(
            "blk.0.attn_k.weight",
            GgmlType::F16,
            &[32, 16],
            vec![0x3C; 2 * 32 * 16],
        );
    write("tiny_llama.gguf", w.to_bytes());

    let mut w = GgufWriter::new();
    w.meta_str("tokenizer.ggml.model", "llama")
        .meta(
            "tokenizer.ggml.tokens",
            strings(&[
                "<unk>",
                "<s>",
                "</s>",
                "\u{2581}",
                "a",
                "\u{2581}a",
                "<0x41>",
            ]),
        )
        .meta(
            "tokenizer.ggml.scores",
            MetaValue::Array(MetaArray::F32(vec![0.0, 0.0, 0.0, -1.0, -2.0, -3.0, 0.0])),
        )
        .meta(
            "tokenizer.ggml.token_type",
            MetaValue::Array(MetaArray::I32(vec![2, 3, 3, 1, 1, 1, 6])),
        )
        .meta_u32("tokenizer.ggml.unknown_token_id", 0);
    write("tiny_spm_vocab.gguf", w.to_bytes());

    // The repository's small GGUF test files.
    let data_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data");
    for entry in std::fs::read_dir(&data_dir).unwrap() {
        let path = entry.unwrap().path();
        let small = std::fs::metadata(&path)
            .map(|m| m.len() <= 64 * 1024)
            .unwrap_or(false);
        if path.extension().is_some_and(|e| e == "gguf") && small {
            std::fs::copy(&path, out.join(path.file_name().unwrap())).unwrap();
        }
    }
    println!("seeds written to {}", out.display());
}
