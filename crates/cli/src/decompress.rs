//! `entrollm decompress`: the original checkpoint back from a container, bit for bit.

use crate::progress;
use anyhow::Result;
use entrollm_format::coded::Coded;
use entrollm_format::{restore_sources, ContainerReader, StoredData};
use std::borrow::Cow;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// An entrollm container directory.
    src: PathBuf,
    /// Output directory (must not exist or be empty, unless --overwrite).
    #[arg(short, long)]
    output: PathBuf,
    #[arg(long)]
    overwrite: bool,
}

pub fn run(a: Args) -> Result<()> {
    let reader = ContainerReader::open(&a.src)?;
    let total: u64 = reader.manifest().sources.iter().map(|s| s.size).sum();
    let bar = progress::bytes(total, "decompress");
    let mut progress = |done: u64, _total: u64| bar.set_position(done);
    restore_sources(
        &reader,
        &a.output,
        a.overwrite,
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
    )?;
    bar.finish_and_clear();
    eprintln!("restored {} to {}", a.src.display(), a.output.display());
    Ok(())
}
