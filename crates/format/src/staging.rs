//! Atomic creation of an output directory: everything is written into a hidden sibling
//! directory, which `commit` renames to the destination. Dropping an uncommitted staging
//! directory deletes it, so an error (or an unwinding Ctrl-C handler) leaves no partial output.

use crate::error::{FormatError, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// Staging directories not yet committed or dropped: what [`remove_live`] deletes when the
/// process is told to stop.
static LIVE: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

fn live() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Deletes every staging directory this process has not committed (a SIGINT/SIGTERM handler
/// calls it before exiting, so an interrupted command leaves nothing); returns how many. Writers
/// may still be running: each directory is removed until it is gone.
pub fn remove_live() -> usize {
    let dirs = std::mem::take(&mut *live());
    for d in &dirs {
        for _ in 0..8 {
            match std::fs::remove_dir_all(d) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => continue,
                _ => break,
            }
        }
    }
    dirs.len()
}

/// Whether process `pid` still runs (a staging directory's owner).
fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes what dead processes left beside `dst`: staging directories (`.NAME.partial-PID-N`) and,
/// when `dst` exists, moved-aside old destinations (`.NAME.old-PID-N`) whose PID no longer runs
/// (killed with SIGKILL, or the machine stopped). Returns the paths removed.
fn remove_stale(dst: &Path) -> Vec<PathBuf> {
    let (Some(name), parent) = (dst.file_name(), dst.parent()) else {
        return Vec::new();
    };
    let parent = parent
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let file = e.file_name();
        let Some(rest) = file
            .to_str()
            .and_then(|f| f.strip_prefix('.'))
            .and_then(|f| f.strip_prefix(name.to_str()?))
        else {
            continue;
        };
        // An old destination moved aside is only removed once its replacement is in place.
        let Some(tail) = rest
            .strip_prefix(".partial-")
            .or_else(|| rest.strip_prefix(".old-").filter(|_| dst.exists()))
        else {
            continue;
        };
        let Some(pid) = tail.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !alive(pid) {
            let path = e.path();
            if std::fs::remove_dir_all(&path).is_ok() || std::fs::remove_file(&path).is_ok() {
                removed.push(path);
            }
        }
    }
    removed
}

#[derive(Debug)]
pub struct StagingDir {
    tmp: PathBuf,
    dst: PathBuf,
    overwrite: bool,
    committed: bool,
}

/// A hidden path next to `dst` that no other process or call uses.
fn sibling(dst: &Path, tag: &str) -> Result<PathBuf> {
    let name = dst
        .file_name()
        .ok_or_else(|| FormatError::file(dst, "destination has no final path component"))?;
    let parent = dst
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    Ok(parent.join(format!(
        ".{}.{tag}-{}-{id}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// Whether `dst` holds something that only `overwrite` allows replacing.
fn occupied(dst: &Path) -> Result<bool> {
    match std::fs::symlink_metadata(dst) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(FormatError::io(dst, e)),
        Ok(m) if m.is_dir() => {
            let mut entries = std::fs::read_dir(dst).map_err(|e| FormatError::io(dst, e))?;
            Ok(entries.next().is_some())
        }
        Ok(_) => Ok(true),
    }
}

/// `p` with symlinks resolved, for a path that may not exist yet: its longest existing ancestor
/// canonicalised, the rest appended.
fn resolved(p: &Path) -> Result<PathBuf> {
    let abs = match p.is_absolute() {
        true => p.to_path_buf(),
        false => std::env::current_dir()
            .map_err(|e| FormatError::io(Path::new("."), e))?
            .join(p),
    };
    let mut rest = Vec::new();
    let mut cur = abs.as_path();
    loop {
        match cur.canonicalize() {
            Ok(c) => {
                let mut out = c;
                for part in rest.iter().rev() {
                    match part {
                        std::path::Component::ParentDir => {
                            out.pop();
                        }
                        std::path::Component::Normal(n) => out.push(n),
                        _ => {}
                    }
                }
                return Ok(out);
            }
            Err(_) => match (cur.parent(), cur.components().next_back()) {
                (Some(parent), Some(last)) => {
                    rest.push(last);
                    cur = parent;
                }
                _ => return Ok(abs),
            },
        }
    }
}

/// Refuses an output that would destroy or swallow its input: `dst` equal to `input`, inside it,
/// or containing it (symlinks resolved), so that `--overwrite` can never replace or delete a
/// source.
pub fn check_apart(input: &Path, dst: &Path) -> Result<()> {
    let (i, d) = (resolved(input)?, resolved(dst)?);
    let relation = if i == d {
        "is"
    } else if i.starts_with(&d) {
        "contains"
    } else if d.starts_with(&i) {
        "is inside"
    } else {
        return Ok(());
    };
    Err(FormatError::Usage(format!(
        "the output {} {relation} the input {}: nothing would be left of it; choose an -o outside \
         the input that does not contain it",
        dst.display(),
        input.display()
    )))
}

impl StagingDir {
    /// Creates the staging directory for `dst` (and `dst`'s parent if needed). Fails if `dst`
    /// exists and is not an empty directory, unless `overwrite`.
    pub fn create(dst: &Path, overwrite: bool) -> Result<Self> {
        if !overwrite && occupied(dst)? {
            return Err(FormatError::DestinationExists {
                path: dst.to_path_buf(),
            });
        }
        let tmp = sibling(dst, "partial")?;
        if let Some(parent) = tmp.parent() {
            std::fs::create_dir_all(parent).map_err(|e| FormatError::io(parent, e))?;
        }
        remove_stale(dst);
        std::fs::create_dir(&tmp).map_err(|e| FormatError::io(&tmp, e))?;
        live().push(tmp.clone());
        Ok(StagingDir {
            tmp,
            dst: dst.to_path_buf(),
            overwrite,
            committed: false,
        })
    }

    /// Where to write.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// Where the output goes once committed.
    pub fn destination(&self) -> &Path {
        &self.dst
    }

    /// Moves the staged directory to the destination, replacing what is there if allowed.
    pub fn commit(mut self) -> Result<()> {
        let dst = self.dst.clone();
        match std::fs::symlink_metadata(&dst) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(FormatError::io(&dst, e)),
            Ok(m) => {
                // Checked again: something may have appeared since `create`.
                if !self.overwrite && occupied(&dst)? {
                    return Err(FormatError::DestinationExists { path: dst });
                }
                // Move the old entry aside first so the destination is never half-replaced.
                let old = sibling(&dst, "old")?;
                std::fs::rename(&dst, &old).map_err(|e| FormatError::io(&dst, e))?;
                std::fs::rename(&self.tmp, &dst).map_err(|e| FormatError::io(&dst, e))?;
                self.committed = true;
                let removed = if m.is_dir() {
                    std::fs::remove_dir_all(&old)
                } else {
                    std::fs::remove_file(&old)
                };
                return removed.map_err(|e| FormatError::io(&old, e));
            }
        }
        std::fs::rename(&self.tmp, &dst).map_err(|e| FormatError::io(&dst, e))?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for StagingDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
        live().retain(|p| p != &self.tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("entrollm-staging-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn outputs_that_overlap_their_input_are_refused() {
        let root = scratch("apart");
        let src = root.join("d/S");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("model.safetensors"), b"x").unwrap();
        std::os::unix::fs::symlink(&src, root.join("link")).unwrap();
        let refused = |dst: PathBuf, input: PathBuf, rel: &str| {
            let e = check_apart(&input, &dst).unwrap_err().to_string();
            assert!(
                e.contains(&format!(" {rel} the input")),
                "{dst:?} {input:?}: {e}"
            );
        };
        refused(src.clone(), src.clone(), "is");
        refused(root.join("d"), src.clone(), "contains");
        refused(root.join("d/S/inner/deeper"), src.clone(), "is inside");
        refused(src.clone(), root.join("link"), "is");
        refused(root.join("link/x"), src.clone(), "is inside");
        refused(root.join("d/S/../S"), src.clone(), "is");
        refused(
            src.join("model.safetensors"),
            src.join("model.safetensors"),
            "is",
        );
        check_apart(&src, &root.join("d/S2")).unwrap();
        check_apart(&src, &root.join("out/new/c")).unwrap();
        check_apart(&src.join("model.safetensors"), &root.join("d/S.entrollm")).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn stale_staging_of_dead_processes_is_removed_next_time() {
        // (`remove_live`, process-wide, is tested through the binary: crates/cli/tests.)
        let root = scratch("stale");
        let dst = root.join("out");
        std::fs::create_dir(&dst).unwrap();
        // A dead process's leftovers beside the same destination (no process has PID 2^31 - 2),
        // another destination's, and a live process's (this one's) are told apart.
        let dead = root.join(".out.partial-2147483646-0");
        let old = root.join(".out.old-2147483646-3");
        let other = root.join(".other.partial-2147483646-0");
        let mine = root.join(format!(".out.partial-{}-99", std::process::id()));
        for d in [&dead, &old, &other, &mine] {
            std::fs::create_dir(d).unwrap();
        }
        let s = StagingDir::create(&dst, false).unwrap();
        assert!(!dead.exists() && !old.exists());
        assert!(other.exists() && mine.exists());
        drop(s);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn commit_renames_and_drop_cleans_up() {
        let root = scratch("commit");
        let dst = root.join("out");
        let s = StagingDir::create(&dst, false).unwrap();
        std::fs::write(s.path().join("a"), b"1").unwrap();
        drop(s);
        assert!(entries(&root).is_empty(), "dropped staging dir must vanish");

        let s = StagingDir::create(&dst, false).unwrap();
        std::fs::write(s.path().join("a"), b"1").unwrap();
        s.commit().unwrap();
        assert_eq!(entries(&root), ["out"]);
        assert_eq!(std::fs::read(dst.join("a")).unwrap(), b"1");

        // Occupied: refused without overwrite, replaced with it.
        let e = StagingDir::create(&dst, false).unwrap_err();
        assert!(matches!(e, FormatError::DestinationExists { .. }), "{e}");
        let s = StagingDir::create(&dst, true).unwrap();
        std::fs::write(s.path().join("b"), b"2").unwrap();
        s.commit().unwrap();
        assert_eq!(entries(&dst), ["b"]);
        assert_eq!(entries(&root), ["out"]);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn empty_destination_directory_is_accepted() {
        let root = scratch("empty");
        let dst = root.join("out");
        std::fs::create_dir(&dst).unwrap();
        let s = StagingDir::create(&dst, false).unwrap();
        std::fs::write(s.path().join("x"), b"").unwrap();
        s.commit().unwrap();
        assert_eq!(entries(&dst), ["x"]);
        // A destination that appeared after `create` is not clobbered.
        let dst2 = root.join("late");
        let s = StagingDir::create(&dst2, false).unwrap();
        std::fs::create_dir(&dst2).unwrap();
        std::fs::write(dst2.join("keep"), b"k").unwrap();
        assert!(matches!(
            s.commit().unwrap_err(),
            FormatError::DestinationExists { .. }
        ));
        assert_eq!(entries(&dst2), ["keep"]);
        assert_eq!(entries(&root), ["late", "out"]);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
