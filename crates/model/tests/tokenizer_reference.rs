//! Tokenizers built from GGUF metadata and from tokenizer.json, against reference ids recorded
//! by tools/gen_tokenizer_testdata.py with independent implementations.

mod common;

use entrollm_model::gguf::{GgufFile, GgufWriter, MetaValue};
use entrollm_model::tokenizer::Tokenizer;
use serde_json::Value;
use std::path::PathBuf;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(data(name)).unwrap()).unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Checks encodings of every {text, ids} record; returns how many were checked.
fn check_records(tok: &Tokenizer, records: &Value, add_special: bool, label: &str) -> usize {
    let records = records.as_array().unwrap();
    for r in records {
        let text = r["text"].as_str().unwrap();
        let want = ids_of(&r["ids"]);
        let got = tok.encode(text, add_special).unwrap();
        assert_eq!(got, want, "{label}: {text:?}");
    }
    records.len()
}

/// Streams `ids` through the incremental decoder and checks the pieces add up to `full`.
fn check_streaming(tok: &Tokenizer, ids: &[u32], full: &str) {
    let mut stream = tok.stream_decoder();
    let mut text = String::new();
    for &id in ids {
        if let Some(piece) = stream.push(id).unwrap() {
            assert!(
                !piece.contains('\u{FFFD}') || full.contains('\u{FFFD}'),
                "incomplete UTF-8 emitted: {piece:?}"
            );
            text.push_str(&piece);
        }
    }
    if let Some(rest) = stream.flush().unwrap() {
        text.push_str(&rest);
    }
    assert_eq!(text, full, "streamed text of {ids:?}");
}

/// A copy of `file` with one metadata value replaced (tensors are not copied).
fn with_meta(file: &GgufFile, key: &str, value: MetaValue) -> GgufFile {
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        w.meta(k, if k == key { value.clone() } else { v.clone() });
    }
    GgufFile::from_bytes(
        format!("{} ({key} = {value:?})", file.path().display()),
        w.to_bytes(),
    )
    .unwrap()
}

#[test]
fn tiny_byte_level_bpe_matches_reference_for_each_pre_tokenizer() {
    let file = GgufFile::open(data("tok_gpt2_tiny.gguf")).unwrap();
    let refs = json("tok_gpt2_tiny_ref.json");
    let by_pre = refs["by_pre"].as_object().unwrap();
    assert_eq!(by_pre.len(), 4);
    for (pre, records) in by_pre {
        let variant = with_meta(&file, "tokenizer.ggml.pre", MetaValue::String(pre.clone()));
        let tok = Tokenizer::from_gguf(&variant).unwrap();
        let n = check_records(&tok, records, false, pre);
        assert!(n >= 20);
    }
    // The file itself says llama-bpe and add_bos_token: BOS is added on request.
    let tok = Tokenizer::from_gguf(&file).unwrap();
    check_records(&tok, &refs["with_bos"], true, "with_bos");
    assert_eq!(tok.bos().unwrap().text, "<|begin_of_text|>");
    assert_eq!(tok.eos().unwrap().text, "<|end_of_text|>");
    assert_eq!(tok.eos_ids().len(), 2, "EOS and EOT");
    for r in refs["with_bos"].as_array().unwrap() {
        let ids = ids_of(&r["ids"]);
        assert_eq!(tok.decode(&ids[1..]).unwrap(), r["text"].as_str().unwrap());
        check_streaming(&tok, &ids[1..], r["text"].as_str().unwrap());
    }
}

#[test]
fn tokenizer_json_and_config_match_the_gguf_tokenizer() {
    let refs = json("tok_gpt2_tiny_ref.json");
    let tok = Tokenizer::from_dir(&data("tok_gpt2_tiny")).unwrap();
    check_records(&tok, &refs["with_bos"], true, "tokenizer.json");
    assert_eq!(tok.bos().unwrap().text, "<|begin_of_text|>");
    assert_eq!(tok.eos().unwrap().text, "<|eot_id|>");
    assert_eq!(tok.eos_ids(), &[tok.eos_id().unwrap()]);
    assert!(tok.chat_template().unwrap().contains("eot_id"));
    let gguf = Tokenizer::from_gguf(&GgufFile::open(data("tok_gpt2_tiny.gguf")).unwrap()).unwrap();
    assert_eq!(tok.vocab_size(), gguf.vocab_size());
    assert_eq!(tok.chat_template(), gguf.chat_template());
}

#[test]
fn tiny_sentencepiece_matches_sentencepiece() {
    let file = GgufFile::open(data("tok_spm_tiny.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let refs = json("tok_spm_tiny_ref.json");
    let n = check_records(&tok, &refs["texts"], false, "spm");
    assert!(n >= 15);
    // Special and user-defined tokens inside the text, as llama.cpp tokenizes them.
    let n = check_records(&tok, &refs["special_texts_llama_cpp"], false, "spm special");
    assert!(
        n >= 3,
        "reference recorded without llama.cpp: regenerate with llama-cpp-python installed"
    );
    assert_eq!(tok.bos_id(), Some(1));
    // SentencePiece vocabularies add BOS by default.
    let first = &refs["texts"][0];
    let mut with_bos = vec![1];
    with_bos.extend(ids_of(&first["ids"]));
    assert_eq!(
        tok.encode(first["text"].as_str().unwrap(), true).unwrap(),
        with_bos
    );
    for r in refs["texts"].as_array().unwrap() {
        let text = r["text"].as_str().unwrap();
        let ids = ids_of(&r["ids"]);
        assert_eq!(tok.decode(&ids).unwrap(), text, "decode {ids:?}");
        check_streaming(&tok, &ids, text);
    }
}

/// SmolLM2-135M-Instruct's vocabulary (needs scripts/fetch-smollm2; skipped otherwise).
#[test]
fn smollm2_matches_reference() {
    let path = common::smollm2_gguf();
    let file = GgufFile::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let refs = json("tok_smollm2_ref.json");
    let n = check_records(&tok, &refs["texts"], false, "smollm2");
    assert!(n >= 24);
    // add_bos_token is false for SmolLM2: add_special changes nothing.
    check_records(&tok, &refs["texts"], true, "smollm2 add_special");
    for r in refs["texts"].as_array().unwrap() {
        let ids = ids_of(&r["ids"]);
        let decoded = r["decoded"].as_str().unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), decoded);
        check_streaming(&tok, &ids, decoded);
    }
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), &[2]);
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert!(tok.chat_template().unwrap().contains("<|im_start|>"));
}
