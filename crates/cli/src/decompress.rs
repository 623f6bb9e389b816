//! `entrollm decompress`: the original checkpoint back from a container, bit for bit.

use crate::progress;
use anyhow::{bail, Context, Result};
use entrollm_format::coded::Coded;
use entrollm_format::{restore_sources, ContainerReader, StoredData};
use std::borrow::Cow;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    /// An entrollm container directory.
    src: PathBuf,
    /// Output directory (must not exist or be empty, unless --overwrite); or, for a container of
    /// one file (a GGUF, one .safetensors file), that file's path when it ends as the file does
    /// (`-o model.gguf`).
    #[arg(short, long)]
    output: PathBuf,
    /// Replace what the output path holds (never the container itself).
    #[arg(long)]
    overwrite: bool,
}

/// The file name `output` gives the container's only source file, when the container holds one
/// file and `output` ends with that file's extension.
fn single_file(reader: &ContainerReader, output: &Path) -> Option<String> {
    let m = reader.manifest();
    let [source] = &m.sources[..] else {
        return None;
    };
    if !m.verbatim.is_empty() || output.is_dir() {
        return None;
    }
    let ext = Path::new(&source.name).extension()?;
    (output.extension() == Some(ext)).then(|| source.name.clone())
}

pub fn run(a: Args) -> Result<()> {
    let reader = ContainerReader::open(&a.src)?;
    crate::generate::lossy_note(&a.src);
    let single = single_file(&reader, &a.output);
    if single.is_some() && a.output.exists() && !a.overwrite {
        bail!(
            "{}: exists; add --overwrite to replace it",
            a.output.display()
        );
    }
    // A single file is restored into a directory beside it, then moved into place.
    let dir = match &single {
        Some(_) => {
            let name = a.output.file_name().unwrap_or_default().to_string_lossy();
            a.output
                .with_file_name(format!(".{name}.restore-{}", std::process::id()))
        }
        None => a.output.clone(),
    };
    let total: u64 = reader.manifest().sources.iter().map(|s| s.size).sum();
    let bar = progress::bytes(total, "decompress");
    let mut progress = |done: u64, _total: u64| bar.set_position(done);
    restore_sources(
        &reader,
        &dir,
        a.overwrite || single.is_some(),
        |t| -> Result<Cow<[u8]>, anyhow::Error> {
            match &t.data {
                StoredData::Plain(b) => Ok(Cow::Borrowed(*b)),
                StoredData::Coded(c) => {
                    // restore_sources names the tensor in its error.
                    let coded = Coded::from_stored(t.dtype, t.shape, c)?;
                    Ok(Cow::Owned(coded.decode()?))
                }
            }
        },
        Some(&mut progress),
    )
    .map_err(crate::compress::name_overwrite)?;
    if let Some(name) = &single {
        let moved = std::fs::rename(dir.join(name), &a.output)
            .with_context(|| format!("moving the restored file to {}", a.output.display()));
        let _ = std::fs::remove_dir_all(&dir);
        moved?;
    }
    bar.finish_and_clear();
    eprintln!("restored {} to {}", a.src.display(), a.output.display());
    Ok(())
}
