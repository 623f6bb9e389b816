//! The fuzz harness of the container reader: turns fuzz input into a container directory, opens
//! it and exercises everything a consumer would touch. Shared by the `container_reader` target
//! and `make_seeds`.
//!
//! Input format (first byte = mode):
//! - even mode, "raw": `[mode][u16 LE manifest length L][L bytes of entrollm.json][shard bytes]`;
//!   the shard is written as `entrollm-00001-of-00001.safetensors`.
//! - odd mode, "mutate": a valid base container (two shards, plain and coded tensors, a source
//!   file, a verbatim file) damaged by 7-byte ops `[file][kind][u32 LE position][value]`:
//!   kind 0 xors the byte with value, kind 1 truncates there, kind 2 sets the byte.

use entrollm_format::container::{restore_sources, MANIFEST_FILE};
use entrollm_format::safetensors::write_safetensors;
use entrollm_format::{
    ArrayDtype, ContainerReader, ContainerWriter, Dtype, SafetensorsFile, SourceFile, StoredData,
    StoredTensor, TensorView, WriterOptions,
};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub const SHARD_NAME: &str = "entrollm-00001-of-00001.safetensors";
/// Restores whose output would exceed this are skipped to keep executions fast.
const MAX_RESTORE_BYTES: u64 = 16 << 20;

/// A per-process scratch directory (in /dev/shm when there is one).
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        // libFuzzer exits without running destructors: clear what dead earlier runs left.
        let has_proc = Path::new("/proc/self").exists();
        if let Ok(entries) = std::fs::read_dir(&base).map(|e| e.filter(|_| has_proc)) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let pid = name
                    .strip_prefix("entrollm-fuzz-")
                    .and_then(|p| p.parse::<u32>().ok());
                if pid.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let d = base.join(format!("entrollm-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("scratch dir");
        d
    })
}

/// The files (relative name, bytes) of the mutate mode's base container: two shards and a
/// verbatim file; built once.
pub fn base_container() -> &'static Vec<(String, Vec<u8>)> {
    static BASE: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    BASE.get_or_init(|| build_container(64, true))
}

/// A valid container's files, manifest first: a safetensors source with a coded tensor (coder
/// "copy": the bytes as they are) and two plain ones, optionally a verbatim `config.json`.
pub fn build_container(shard_size_limit: u64, verbatim: bool) -> Vec<(String, Vec<u8>)> {
    {
        let root = scratch().join("base");
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let src = root.join("model.safetensors");
        let w: Vec<u8> = (0..48u8).collect();
        let norm: Vec<u8> = (0..16u8).map(|i| i * 3).collect();
        let odd = [9u8, 8, 7];
        let tensors = [
            TensorView {
                name: "w",
                dtype: Dtype::BF16,
                shape: &[4, 6],
                bytes: &w,
            },
            TensorView {
                name: "norm",
                dtype: Dtype::F32,
                shape: &[4],
                bytes: &norm,
            },
            TensorView {
                name: "odd",
                dtype: Dtype::U8,
                shape: &[3],
                bytes: &odd,
            },
        ];
        write_safetensors(&src, &tensors, None).unwrap();
        std::fs::write(root.join("config.json"), b"{\"model_type\":\"llama\"}").unwrap();
        let file = SafetensorsFile::open(&src).unwrap();
        let ct = root.join("ct");
        let opts = WriterOptions {
            shard_size_limit,
            ..Default::default()
        };
        let mut cw = ContainerWriter::create(&ct, opts).unwrap();
        cw.add_source_file(SourceFile::from_safetensors("model.safetensors", &file))
            .unwrap();
        for t in file.tensors() {
            if t.name == "w" {
                let len = (t.bytes.len() as u32).to_le_bytes();
                let arrays = vec![
                    ("data".to_string(), ArrayDtype::U8, t.bytes),
                    ("len".to_string(), ArrayDtype::U32, &len[..]),
                ];
                cw.add_coded(
                    t.name,
                    t.dtype,
                    t.shape,
                    "copy",
                    serde_json::json!({"v": 1}),
                    arrays,
                    entrollm_format::checksum(t.bytes),
                )
                .unwrap();
            } else {
                cw.add_plain(t.name, t.dtype, t.shape, t.bytes).unwrap();
            }
        }
        if verbatim {
            cw.copy_file(&root.join("config.json"), "config.json")
                .unwrap();
        }
        let manifest = cw.finish().unwrap();
        let mut files = vec![(
            MANIFEST_FILE.to_string(),
            std::fs::read(ct.join(MANIFEST_FILE)).unwrap(),
        )];
        for f in manifest.shards.iter().chain(&manifest.verbatim) {
            files.push((f.name.clone(), std::fs::read(ct.join(&f.name)).unwrap()));
        }
        std::fs::remove_dir_all(&root).unwrap();
        files
    }
}

/// The raw-mode encoding of a manifest and one shard.
pub fn encode_raw(manifest: &[u8], shard: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8];
    out.extend_from_slice(&(manifest.len() as u16).to_le_bytes());
    out.extend_from_slice(manifest);
    out.extend_from_slice(shard);
    out
}

/// The container files an input describes.
fn files_of(data: &[u8]) -> Vec<(String, Vec<u8>)> {
    let Some((&mode, rest)) = data.split_first() else {
        return Vec::new();
    };
    if mode % 2 == 0 {
        if rest.len() < 2 {
            return Vec::new();
        }
        let len = (u16::from_le_bytes([rest[0], rest[1]]) as usize).min(rest.len() - 2);
        let (manifest, shard) = rest[2..].split_at(len);
        return vec![
            (MANIFEST_FILE.to_string(), manifest.to_vec()),
            (SHARD_NAME.to_string(), shard.to_vec()),
        ];
    }
    let mut files = base_container().clone();
    for op in rest.chunks_exact(7) {
        let n = files.len();
        let file = &mut files[op[0] as usize % n].1;
        let pos = u32::from_le_bytes([op[2], op[3], op[4], op[5]]) as usize;
        match op[1] % 3 {
            0 if !file.is_empty() => {
                let at = pos % file.len();
                file[at] ^= op[6];
            }
            1 => file.truncate(pos % (file.len() + 1)),
            2 if !file.is_empty() => {
                let at = pos % file.len();
                file[at] = op[6];
            }
            _ => {}
        }
    }
    files
}

/// The decoder of the base container's "copy" coder; refuses anything else.
fn decode_copy<'r>(t: &StoredTensor<'r>) -> Result<Cow<'r, [u8]>, String> {
    let StoredData::Coded(c) = &t.data else {
        return Err("not coded".into());
    };
    match c.arrays.get("data") {
        Some((ArrayDtype::U8, data)) if c.coder == "copy" => Ok(Cow::Borrowed(*data)),
        _ => Err("not a copy-coded tensor".into()),
    }
}

/// One fuzz execution: must never panic, whatever `data` is.
pub fn run(data: &[u8]) {
    let files = files_of(data);
    if files.is_empty() {
        return;
    }
    let dir = scratch().join("ct");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (name, bytes) in &files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    let Ok(reader) = ContainerReader::open(&dir) else {
        return;
    };
    let mut touched = 0u64;
    for t in reader.tensors() {
        let by_name = reader.tensor(t.name).expect("listed tensor is found");
        assert_eq!(by_name.byte_len(), t.byte_len());
        match &t.data {
            StoredData::Plain(b) => {
                assert_eq!(
                    b.len(),
                    t.byte_len(),
                    "plain data length is validated at open"
                );
                touched += b.iter().map(|&x| x as u64).sum::<u64>();
                let _ = reader.verify_checksum(t.name, b);
            }
            StoredData::Coded(c) => {
                for (dt, bytes) in c.arrays.values() {
                    assert_eq!(
                        bytes.len() % dt.size(),
                        0,
                        "array length is a whole number of elements"
                    );
                    touched += bytes.iter().map(|&x| x as u64).sum::<u64>();
                }
                if let Ok(d) = decode_copy(&t) {
                    let _ = reader.verify_checksum(t.name, &d);
                }
            }
        }
    }
    std::hint::black_box(touched);
    let _ = reader.verify_files(None);
    let m = reader.manifest();
    let out: u64 = m
        .sources
        .iter()
        .map(|s| s.size)
        .chain(m.verbatim.iter().map(|f| f.size))
        .sum();
    if out <= MAX_RESTORE_BYTES {
        let _ = restore_sources(
            &reader,
            &scratch().join("restored"),
            true,
            decode_copy,
            None,
        );
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn valid_inputs_restore() {
        let restored = super::scratch().join("restored");
        super::run(&[1]);
        assert!(
            restored.join("config.json").is_file(),
            "the undamaged base container restores"
        );
        let one = super::build_container(u64::MAX, false);
        assert_eq!(one.len(), 2);
        assert_eq!(one[1].0, super::SHARD_NAME);
        std::fs::remove_dir_all(&restored).unwrap();
        super::run(&super::encode_raw(&one[0].1, &one[1].1));
        assert!(
            restored.join("model.safetensors").is_file(),
            "the raw seed restores"
        );
    }
}
