//! Shared helpers of the integration tests: scratch directories, a synthetic sharded checkpoint,
//! a toy coder, and a container built from them.
#![allow(dead_code)]

use entrollm_format::{
    ArrayDtype, Checkpoint, ContainerWriter, Dtype, SourceFile, StoredTensor, TensorView,
    WriterOptions,
};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A directory under the system temp dir, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p =
            std::env::temp_dir().join(format!("entrollm-format-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Names in `dir`, sorted, hidden ones included.
pub fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// All files under `dir` (relative paths) with their contents.
pub fn tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                let rel = p
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .replace('\\', "/");
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

fn pseudo_random(seed: u64, len: usize) -> Vec<u8> {
    let mut r = entrollm_codec::rng::SplitMix64::new(seed);
    (0..len).map(|_| (r.next_u64() >> 56) as u8).collect()
}

/// Writes a 3-shard checkpoint with an index (plus a stray file the index does not name) and
/// small side files into `dir`. Tensors have several dtypes, a scalar and an empty one.
pub fn synthetic_checkpoint(dir: &Path) {
    let specs: [&[(&str, Dtype, &[usize])]; 3] = [
        &[
            ("model.embed_tokens.weight", Dtype::BF16, &[32, 16]),
            ("model.layers.0.input_layernorm.weight", Dtype::F32, &[16]),
            (
                "model.layers.0.self_attn.q_proj.weight",
                Dtype::BF16,
                &[16, 16],
            ),
        ],
        &[
            ("model.layers.0.mlp.up_proj.weight", Dtype::BF16, &[24, 16]),
            (
                "model.layers.0.mlp.down_proj.weight",
                Dtype::F8E4M3,
                &[16, 24],
            ),
            ("model.layers.0.mlp.down_proj.weight_scale", Dtype::F32, &[]),
            ("model.layers.0.self_attn.q_proj.bias", Dtype::F16, &[0]),
        ],
        &[
            ("lm_head.weight", Dtype::BF16, &[32, 16]),
            ("model.norm.weight", Dtype::F32, &[16]),
            ("odd.bytes", Dtype::U8, &[7]),
        ],
    ];
    let mut weight_map = serde_json::Map::new();
    for (i, spec) in specs.iter().enumerate() {
        let shard = format!("model-{:05}-of-00003.safetensors", i + 1);
        let data: Vec<Vec<u8>> = spec
            .iter()
            .enumerate()
            .map(|(j, (_, d, s))| {
                pseudo_random(
                    (i * 10 + j) as u64 + 1,
                    entrollm_format::tensor_byte_len(*d, s).unwrap(),
                )
            })
            .collect();
        let views: Vec<TensorView> = spec
            .iter()
            .zip(&data)
            .map(|((n, d, s), b)| TensorView {
                name: n,
                dtype: *d,
                shape: s,
                bytes: b,
            })
            .collect();
        let meta: BTreeMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        entrollm_format::safetensors::write_safetensors(&dir.join(&shard), &views, Some(&meta))
            .unwrap();
        for (n, _, _) in spec.iter() {
            weight_map.insert(n.to_string(), shard.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.join("config.json"),
        br#"{"model_type": "llama", "hidden_size": 16}"#,
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("original")).unwrap();
    std::fs::write(dir.join("original/params.json"), b"{}\n").unwrap();
    std::fs::write(dir.join("tokenizer.json"), pseudo_random(99, 3000)).unwrap();
    // Not in the index: must be ignored by Checkpoint::open.
    entrollm_format::safetensors::write_safetensors(
        &dir.join("consolidated.safetensors"),
        &[],
        None,
    )
    .unwrap();
}

pub const SIDE_FILES: [&str; 4] = [
    "config.json",
    "model.safetensors.index.json",
    "original/params.json",
    "tokenizer.json",
];

/// A toy lossless coder: bytes XOR 0x5a in a U8 array, the length in a U32 array.
pub fn xor_encode(bytes: &[u8]) -> (Vec<u8>, Vec<u8>) {
    (
        bytes.iter().map(|b| b ^ 0x5a).collect(),
        (bytes.len() as u32).to_le_bytes().to_vec(),
    )
}

pub fn xor_decode<'r>(t: &StoredTensor<'r>) -> Result<Cow<'r, [u8]>, String> {
    let entrollm_format::StoredData::Coded(c) = &t.data else {
        return Err("not coded".into());
    };
    if c.coder != "xor" || c.params["key"] != 0x5a {
        return Err(format!("unknown coder {}", c.coder));
    }
    let (_, data) = c.arrays.get("data").ok_or("no data array")?;
    let (_, len) = c.arrays.get("len").ok_or("no len array")?;
    let len = u32::from_le_bytes((*len).try_into().map_err(|_| "bad len array")?) as usize;
    if len != data.len() {
        return Err("length mismatch".into());
    }
    Ok(Cow::Owned(data.iter().map(|b| b ^ 0x5a).collect()))
}

/// Whether the container codes this tensor (the rest stay plain).
pub fn is_coded(name: &str) -> bool {
    name.ends_with("proj.weight") || name == "lm_head.weight"
}

/// Builds a lossless container of `ckpt_dir` at `dst`, with small shards.
pub fn build_container(
    ckpt_dir: &Path,
    dst: &Path,
    shard_size_limit: u64,
) -> entrollm_format::Manifest {
    let ckpt = Checkpoint::open(ckpt_dir).unwrap();
    let mut w = ContainerWriter::create(
        dst,
        WriterOptions {
            shard_size_limit,
            ..Default::default()
        },
    )
    .unwrap();
    for (name, file) in ckpt.files() {
        w.add_source_file(SourceFile::from_safetensors(name, file))
            .unwrap();
    }
    for t in ckpt.tensors() {
        if is_coded(t.name) {
            let (data, len) = xor_encode(t.bytes);
            let arrays = vec![
                ("data".to_string(), ArrayDtype::U8, &data[..]),
                ("len".to_string(), ArrayDtype::U32, &len[..]),
            ];
            w.add_coded(
                t.name,
                t.dtype,
                t.shape,
                "xor",
                serde_json::json!({"key": 0x5a}),
                arrays,
                entrollm_format::checksum(t.bytes),
            )
            .unwrap();
        } else {
            w.add_plain(t.name, t.dtype, t.shape, t.bytes).unwrap();
        }
    }
    for f in SIDE_FILES {
        w.copy_file(&ckpt_dir.join(f), f).unwrap();
    }
    w.set_metadata("source", serde_json::json!({"kind": "safetensors"}));
    w.finish().unwrap()
}
