//! End to end on SmolLM2-135M-Instruct (Q4_1 GGUF, from scripts/fetch-smollm2; skipped when absent):
//! GGUF tokenizer + chat template + GgufSource + the CPU engine answer a factual question.

mod common;

use entrollm_model::chat::{ChatMessage, ChatTemplate};
use entrollm_model::gguf::{GgufFile, GgufSource};
use entrollm_model::tokenizer::Tokenizer;
use entrollm_model::{build_model, generate, Engine, Sampler, SamplingParams};
use std::ops::ControlFlow;

#[test]
fn smollm2_answers_greedily() {
    let path = common::smollm2_gguf();
    let source = GgufSource::new(GgufFile::open(&path).unwrap()).unwrap();
    let tok = Tokenizer::from_gguf(source.file()).unwrap();
    let template = ChatTemplate::for_tokenizer(&tok).unwrap();
    let prompt = template
        .render(&[ChatMessage::user("What is the capital of France?")], true)
        .unwrap();
    let ids = tok.encode(&prompt, true).unwrap();

    let weights = build_model(&source).unwrap();
    let mut engine = Engine::new(weights, 256).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy()).unwrap();
    let mut stream = tok.stream_decoder().with_context(&ids);
    let mut text = String::new();
    let generation = generate(
        &mut engine,
        &mut sampler,
        &ids,
        &opts(24, tok.eos_ids()),
        |id, _| {
            if let Some(piece) = stream.push(id).unwrap() {
                text.push_str(&piece);
            }
            ControlFlow::Continue(())
        },
    )
    .unwrap();
    text.push_str(&stream.flush().unwrap().unwrap_or_default());
    assert_eq!(text, tok.decode(&generation.tokens).unwrap());
    eprintln!("SmolLM2 answer: {text:?}");
    assert!(text.contains("Paris"), "answer: {text:?}");
}

fn opts(max_new_tokens: usize, stop_tokens: &[u32]) -> entrollm_model::GenerateOptions<'_> {
    entrollm_model::GenerateOptions {
        max_new_tokens,
        stop_tokens,
        ..Default::default()
    }
}
