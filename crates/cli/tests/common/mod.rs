//! Shared by the CLI's integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// A fresh directory under the system temp dir, removed when dropped — whether the test passes or
/// panics — so runs of the suite do not pile models up in /tmp.
pub struct Scratch(PathBuf);

impl Scratch {
    /// `entrollm-{suite}-{pid}-{name}`, emptied first.
    pub fn new(suite: &str, name: &str) -> Self {
        let d =
            std::env::temp_dir().join(format!("entrollm-{suite}-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
