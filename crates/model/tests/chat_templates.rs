//! Chat templates rendered by minijinja against transformers' renderings
//! (tools/gen_tokenizer_testdata.py).

mod common;

use entrollm_model::chat::{ChatMessage, ChatTemplate};
use entrollm_model::gguf::GgufFile;
use entrollm_model::tokenizer::Tokenizer;
use serde_json::Value;
use std::path::PathBuf;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn check_chats(template: &ChatTemplate, refs: &Value) {
    let chats = refs["chats"].as_array().unwrap();
    assert!(chats.len() >= 3);
    for c in chats {
        let messages: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
        let gen = c["add_generation_prompt"].as_bool().unwrap();
        assert_eq!(
            template.render(&messages, gen).unwrap(),
            c["rendered"].as_str().unwrap(),
            "{messages:?}"
        );
    }
}

fn refs(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(data(name)).unwrap()).unwrap()
}

#[test]
fn template_from_tokenizer_config_and_from_gguf_render_like_transformers() {
    let refs = refs("tok_gpt2_tiny_ref.json");
    let from_json = Tokenizer::from_dir(&data("tok_gpt2_tiny")).unwrap();
    let template = ChatTemplate::for_tokenizer(&from_json).unwrap();
    assert!(!template.is_fallback());
    check_chats(&template, &refs);
    // The GGUF copy of the same template; its EOS differs but the template does not use it.
    let from_gguf =
        Tokenizer::from_gguf(&GgufFile::open(data("tok_gpt2_tiny.gguf")).unwrap()).unwrap();
    check_chats(&ChatTemplate::for_tokenizer(&from_gguf).unwrap(), &refs);
}

#[test]
fn a_tokenizer_without_template_falls_back_to_chatml() {
    let tok = Tokenizer::from_gguf(&GgufFile::open(data("tok_spm_tiny.gguf")).unwrap()).unwrap();
    assert!(tok.chat_template().is_none());
    let template = ChatTemplate::for_tokenizer(&tok).unwrap();
    assert!(template.is_fallback());
    let out = template.render(&[ChatMessage::user("hi")], true).unwrap();
    assert_eq!(
        out,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

/// SmolLM2's template from its GGUF (needs scripts/fetch-smollm2; skipped otherwise).
#[test]
fn smollm2_template_renders_like_transformers() {
    let path = common::smollm2_gguf();
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let template = ChatTemplate::for_tokenizer(&tok).unwrap();
    assert!(!template.is_fallback());
    check_chats(&template, &refs("tok_smollm2_ref.json"));
    // The rendered prompt tokenizes with the chat markers as single tokens.
    let prompt = template
        .render(&[ChatMessage::system("S"), ChatMessage::user("U")], true)
        .unwrap();
    let ids = tok.encode(&prompt, false).unwrap();
    assert_eq!(ids[0], tok.token_to_id("<|im_start|>").unwrap());
    assert_eq!(
        ids.iter().filter(|&&id| id == 2).count(),
        2,
        "two <|im_end|> tokens"
    );
}
