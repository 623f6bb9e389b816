//! Opening inputs safely: only regular files (a FIFO would block forever, `/dev/zero` never end, a
//! directory is not a file), and small files read with their size limit enforced while reading,
//! not trusted from `stat`.

use std::fs::File;
use std::io::{Error, ErrorKind, Read};
use std::path::Path;

/// A relative path inside a directory: `/`-separated, no empty, `.` or `..` components, no
/// backslashes, colons or NUL bytes — so it can never leave the directory on any OS.
pub(crate) fn check_relative_path(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("empty file name".into());
    }
    if name.contains(['\\', '\0', ':']) {
        return Err(format!(
            "file name '{}' contains '\\', ':' or a NUL byte",
            name.escape_debug()
        ));
    }
    if name
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(format!(
            "file name '{}' is not a plain relative path (absolute, or with an empty, '.' or '..' component)",
            name.escape_debug()
        ));
    }
    Ok(())
}

/// The most a JSON side file (config, tokenizer, index, plan, tune file) may hold.
pub const JSON_LIMIT: u64 = 256 << 20;

/// Opens `path` for reading if it is a regular file (links followed); otherwise an error saying
/// what it is.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let kind = std::fs::metadata(path)?.file_type();
    if !kind.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let what = if kind.is_dir() {
            "a directory"
        } else if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("{what}, not a regular file"),
        ));
    }
    File::open(path)
}

/// The contents of the regular file `path`, refused past `limit` bytes (counted while reading).
pub fn read_limited(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    open_regular(path)?.take(limit + 1).read_to_end(&mut out)?;
    if out.len() as u64 > limit {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("larger than the {limit}-byte limit for this kind of file"),
        ));
    }
    Ok(out)
}

/// [`read_limited`] as UTF-8 text.
pub fn read_text_limited(path: &Path, limit: u64) -> std::io::Result<String> {
    String::from_utf8(read_limited(path, limit)?)
        .map_err(|_| Error::new(ErrorKind::InvalidData, "not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_are_read_and_limits_hold() {
        let d = std::env::temp_dir().join(format!("entrollm-input-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let f = d.join("a.json");
        std::fs::write(&f, b"{\"x\": 1}").unwrap();
        assert_eq!(read_limited(&f, 8).unwrap(), b"{\"x\": 1}");
        let e = read_limited(&f, 7).unwrap_err().to_string();
        assert!(e.contains("7-byte limit"), "{e}");
        let fifo = d.join("pipe");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let e = open_regular(&fifo).unwrap_err().to_string();
        assert!(e.contains("a FIFO"), "{e}");
        let zero = d.join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let e = read_limited(&zero, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("a device"), "{e}");
        assert!(open_regular(&d)
            .unwrap_err()
            .to_string()
            .contains("a directory"));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
