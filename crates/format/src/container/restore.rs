//! Rebuilding the source checkpoint from a container, bit for bit.

use super::reader::{ContainerReader, StoredData, StoredTensor};
use crate::checksum::{checksum, copy_hashed, CopyError, StreamingChecksum};
use crate::error::{FormatError, Result};
use crate::staging::StagingDir;
use std::borrow::Cow;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

/// Rebuilds every source file recorded in the container into the directory `dst`, and copies the
/// verbatim files back. Plain tensors are read from the shards; `decode` is called for each coded
/// tensor and must return its decoded bytes. Every tensor is checked against its checksum and
/// every rebuilt file against its size and checksum. Like [`ContainerWriter`](crate::ContainerWriter),
/// the output is staged next to `dst` and appears only if everything succeeded; `dst` must not
/// exist or be an empty directory unless `overwrite`. `progress` gets (bytes written, total).
pub fn restore_sources<'r, D, E>(
    reader: &'r ContainerReader,
    dst: &Path,
    overwrite: bool,
    mut decode: D,
    mut progress: Option<&mut dyn FnMut(u64, u64)>,
) -> Result<()>
where
    D: FnMut(&StoredTensor<'r>) -> std::result::Result<Cow<'r, [u8]>, E>,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let manifest = reader.manifest();
    if manifest.sources.is_empty() {
        return Err(FormatError::file(
            reader.dir(),
            "the container records no source files to restore",
        ));
    }
    crate::staging::check_apart(reader.dir(), dst)?;
    let staging = StagingDir::create(dst, overwrite)?;
    let total: u64 = manifest
        .sources
        .iter()
        .map(|s| s.size)
        .chain(manifest.verbatim.iter().map(|f| f.size))
        .sum();
    let mut done = 0u64;
    let mut report = |n: u64| {
        done += n;
        if let Some(p) = progress.as_mut() {
            p(done, total);
        }
    };

    for (i, src) in manifest.sources.iter().enumerate() {
        let path = staging.path().join(&src.name);
        let shown = dst.join(&src.name);
        let mut out = Output::create(&path)?;
        let prefix = reader.source_prefix(i);
        out.write(prefix)?;
        report(prefix.len() as u64);
        for seg in &src.segments {
            let gap = seg.offset - out.sum.len();
            out.zeros(gap)?;
            let t = reader
                .tensor_index(&seg.tensor)
                .map(|ti| (ti, reader.stored(ti)));
            let (ti, tensor) = t.ok_or_else(|| {
                FormatError::tensor(&shown, &seg.tensor, "segment names an unknown tensor")
            })?;
            let bytes: Cow<'r, [u8]> = match &tensor.data {
                StoredData::Plain(b) => Cow::Borrowed(*b),
                StoredData::Coded(_) => decode(&tensor).map_err(|e| FormatError::Decode {
                    tensor: seg.tensor.clone(),
                    cause: e.into(),
                })?,
            };
            if bytes.len() != tensor.byte_len() {
                return Err(FormatError::tensor(
                    reader.tensor_file(ti),
                    &seg.tensor,
                    format!(
                        "decoder returned {} bytes, the tensor has {}",
                        bytes.len(),
                        tensor.byte_len()
                    ),
                ));
            }
            let actual = checksum(&bytes);
            if actual != tensor.checksum {
                return Err(FormatError::Checksum {
                    path: reader.tensor_file(ti).to_path_buf(),
                    tensor: Some(seg.tensor.clone()),
                    expected: tensor.checksum,
                    actual,
                });
            }
            out.write(&bytes)?;
            report(gap + bytes.len() as u64);
        }
        let tail = src.size - out.sum.len();
        out.zeros(tail)?;
        report(tail);
        let sum = out.finish()?;
        if sum.len() != src.size || sum.digest() != src.xxh3 {
            return Err(FormatError::Checksum {
                path: shown,
                tensor: None,
                expected: src.xxh3,
                actual: sum.digest(),
            });
        }
    }

    for f in &manifest.verbatim {
        let from_path = reader.dir().join(&f.name);
        let to_path = staging.path().join(&f.name);
        let mut out = Output::create(&to_path)?;
        let from =
            crate::input::open_regular(&from_path).map_err(|e| FormatError::io(&from_path, e))?;
        copy_hashed(from, Some(&mut out.file), &mut out.sum).map_err(|e| match e {
            CopyError::Read(e) => FormatError::io(&from_path, e),
            CopyError::Write(e) => FormatError::io(&to_path, e),
        })?;
        let sum = out.finish()?;
        if sum.len() != f.size || sum.digest() != f.xxh3 {
            return Err(FormatError::Checksum {
                path: from_path,
                tensor: None,
                expected: f.xxh3,
                actual: sum.digest(),
            });
        }
        report(f.size);
    }
    staging.commit()
}

/// A file being rebuilt, hashed as it is written.
struct Output<'p> {
    path: &'p Path,
    file: BufWriter<File>,
    sum: StreamingChecksum,
}

impl<'p> Output<'p> {
    fn create(path: &'p Path) -> Result<Self> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| FormatError::io(parent, e))?;
        }
        let file = File::create(path).map_err(|e| FormatError::io(path, e))?;
        Ok(Output {
            path,
            file: BufWriter::with_capacity(1 << 22, file),
            sum: StreamingChecksum::new(),
        })
    }
    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.file
            .write_all(bytes)
            .map_err(|e| FormatError::io(self.path, e))?;
        self.sum.update(bytes);
        Ok(())
    }
    fn zeros(&mut self, mut n: u64) -> Result<()> {
        const ZEROS: [u8; 4096] = [0; 4096];
        while n > 0 {
            let k = n.min(ZEROS.len() as u64) as usize;
            self.write(&ZEROS[..k])?;
            n -= k as u64;
        }
        Ok(())
    }
    fn finish(mut self) -> Result<StreamingChecksum> {
        self.file
            .flush()
            .map_err(|e| FormatError::io(self.path, e))?;
        Ok(self.sum)
    }
}
