//! Chat templates rendered by minijinja against transformers' renderings
//! (tools/gen_tokenizer_testdata.py, and tools/gen_chat_template_refs.py for the model families'
//! real templates in tests/data/chat_templates/).

mod common;

use entrollm_model::chat::{strftime, ChatMessage, ChatTemplate};
use entrollm_model::gguf::GgufFile;
use entrollm_model::tokenizer::Tokenizer;
use entrollm_model::ModelError;
use serde_json::Value;
use std::collections::BTreeSet;
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

/// The families the CPU engine runs (docs/families.md); each must have its real template checked.
const FAMILIES: [&str; 9] = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen3_moe",
];

/// Every family's real chat template (tests/data/chat_templates/, built with the model's own
/// bos/eos strings) renders every recorded chat exactly as transformers' `apply_chat_template`
/// does, and refuses (with transformers' message, as an error, not a panic) the chats
/// transformers refuses. transformers' `strftime_now` was pinned to `fixed_now`; the date this
/// renders today is mapped onto it.
#[test]
fn every_family_template_renders_like_transformers() {
    let refs = refs("chat_template_refs.json");
    let fixed_now = refs["fixed_now"].as_i64().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let mut covered = BTreeSet::new();
    let mut failures = Vec::new();
    for t in refs["templates"].as_array().unwrap() {
        let file = t["file"].as_str().unwrap();
        let source = std::fs::read_to_string(data("chat_templates").join(file)).unwrap();
        let template =
            ChatTemplate::new(&source, t["bos_token"].as_str(), t["eos_token"].as_str()).unwrap();
        let dates: Vec<(String, String)> = t["strftime_formats"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                let f = f.as_str().unwrap();
                (strftime(f, now).unwrap(), strftime(f, fixed_now).unwrap())
            })
            .collect();
        let chats = t["chats"].as_array().unwrap();
        assert!(chats.len() >= 18, "{file}");
        let mut rendered = 0;
        for c in chats {
            let messages: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
            let gen = c["add_generation_prompt"].as_bool().unwrap();
            let got = template.render(&messages, gen);
            match (&got, c["rendered"].as_str(), c["error"].as_str()) {
                (Ok(out), Some(want), _) => {
                    let mut out = out.clone();
                    for (today, fixed) in &dates {
                        out = out.replace(today.as_str(), fixed);
                    }
                    if out == want {
                        rendered += 1;
                    } else {
                        failures.push(format!(
                            "{file} gen={gen} {messages:?}:\n  want {want:?}\n  got  {out:?}"
                        ));
                    }
                }
                (Err(ModelError::Template(m)), None, Some(want)) if m.contains(want) => {}
                _ => failures.push(format!(
                    "{file} gen={gen} {messages:?}: got {got:?}, transformers {} {:?}",
                    if c["rendered"].is_string() {
                        "renders"
                    } else {
                        "raises"
                    },
                    c["rendered"].as_str().or(c["error"].as_str()).unwrap()
                )),
            }
        }
        // Every template renders the plain chats (Gemma refuses the system role, some templates
        // tool results without tool calls).
        assert!(rendered >= 12, "{file}: {rendered} chats rendered");
        for f in t["families"].as_array().unwrap() {
            covered.insert(f.as_str().unwrap().to_string());
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    for f in FAMILIES {
        assert!(covered.contains(f), "no real chat template checked for {f}");
    }
}

/// Gemma's template refuses a system message (transformers raises "System role not supported"):
/// rendering returns that as a `ModelError::Template`, never a panic or a silently dropped turn.
#[test]
fn gemma_refuses_the_system_role_with_transformers_message() {
    let source =
        std::fs::read_to_string(data("chat_templates/google-gemma-2-2b-it.jinja")).unwrap();
    let template = ChatTemplate::new(&source, Some("<bos>"), Some("<eos>")).unwrap();
    let err = template
        .render(&[ChatMessage::system("S"), ChatMessage::user("U")], true)
        .unwrap_err();
    assert!(
        matches!(&err, ModelError::Template(m) if m.contains("System role not supported")),
        "{err}"
    );
    let err = template
        .render(&[ChatMessage::user("U"), ChatMessage::user("U")], true)
        .unwrap_err();
    assert!(
        matches!(&err, ModelError::Template(m) if m.contains("roles must alternate")),
        "{err}"
    );
}

/// What every template sees, as transformers sets it up: `tools`/`documents` defined as none,
/// Python printing of values, transformers' `tojson` (`json.dumps`: no HTML escaping, Python's
/// separators, insertion order), Python string methods, loop controls, `namespace`.
#[test]
fn template_environment_matches_transformers() {
    let refs = refs("chat_template_refs.json");
    let messages: Vec<ChatMessage> =
        serde_json::from_value(refs["probe_messages"].clone()).unwrap();
    let mut failures = Vec::new();
    for p in refs["probes"].as_array().unwrap() {
        let source = p["template"].as_str().unwrap();
        let want = p["rendered"].as_str().unwrap();
        let got = ChatTemplate::new(source, Some("<s>"), Some("</s>"))
            .and_then(|t| t.render(&messages, false));
        if got.as_deref().ok() != Some(want) {
            failures.push(format!("{source}\n  want {want:?}\n  got  {got:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
