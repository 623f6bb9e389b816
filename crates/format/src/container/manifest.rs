//! `entrollm.json`: the manifest's schema and its parsing with errors that name the entry.

use crate::checksum::hex64;
use crate::dtype::Dtype;
use crate::error::{FormatError, Result};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

pub const MANIFEST_FILE: &str = "entrollm.json";
pub const FORMAT_NAME: &str = "entrollm";
/// Readers reject other major versions; a newer minor version only adds optional fields.
pub const FORMAT_MAJOR: u32 = 1;
/// 1.1: a tensor entry may record the weight form it is served in (`form`).
/// 1.2: files the writer generates for other loaders (`generated`: transformers' `config.json`).
pub const FORMAT_MINOR: u32 = 2;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always `"entrollm"`.
    pub format: String,
    /// `"<major>.<minor>"`.
    pub version: String,
    /// The program that wrote the container, e.g. `"entrollm 0.1.0"`.
    pub tool: String,
    /// Free-form information for other components (e.g. a GGUF source's tensor types); stored
    /// without interpretation.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub metadata: Map<String, Value>,
    pub shards: Vec<FileEntry>,
    /// In the order they were written.
    pub tensors: Vec<TensorEntry>,
    /// The source files this container rebuilds (absent for containers that cannot).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<SourceEntry>,
    /// Files copied unchanged into the container (config.json, tokenizer files, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub verbatim: Vec<FileEntry>,
    /// Files the writer made for other loaders (transformers' `config.json`, a shard index):
    /// checked like verbatim files, never restored.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub generated: Vec<FileEntry>,
}

/// A file by name relative to its directory, with its size and checksum.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub size: u64,
    #[serde(with = "hex64")]
    pub xxh3: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    /// The dtype of the decoded tensor.
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Checksum of the decoded bytes.
    #[serde(with = "hex64")]
    pub xxh3: u64,
    #[serde(flatten)]
    pub storage: Storage,
    /// The weight form a loader serves the matrix in (`compress --plan`), whatever the storage;
    /// absent (containers before 1.1, or without a plan): as stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub form: Option<FormEntry>,
}

/// A weight form by name and variant (docs/forms.md), as a plan chose it for a tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FormEntry {
    pub form: String,
    /// The form's tuned parameters as text (`pair:8:256:16`, `f32`); empty for none.
    #[serde(default)]
    pub variant: String,
}

impl FormEntry {
    /// Why a form entry cannot be right (names a non-identifier form or an odd variant).
    pub fn check(&self) -> std::result::Result<(), String> {
        let ident = |s: &str| {
            !s.is_empty()
                && s.len() <= 64
                && s.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        };
        if !ident(&self.form) {
            return Err(format!(
                "form '{}' is not a form name (lowercase letters, digits, '-', '_')",
                self.form
            ));
        }
        if self.variant.len() > 256 || self.variant.bytes().any(|b| !(b' '..=b'~').contains(&b)) {
            return Err(format!(
                "variant '{}' of form '{}' is not printable ASCII of at most 256 bytes",
                self.variant.escape_debug(),
                self.form
            ));
        }
        Ok(())
    }
}

/// How a tensor is stored: a JSON key `"plain"` or `"coded"` inside the tensor entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Storage {
    Plain(ArrayRef),
    Coded(CodedEntry),
}

/// Where an array lives: a key in a shard.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrayRef {
    pub shard: String,
    pub key: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CodedEntry {
    pub coder: String,
    /// Coder-specific; this crate stores it without interpreting it.
    pub params: Value,
    pub arrays: BTreeMap<String, ArrayRef>,
}

/// A source file to rebuild: `prefix` at offset 0, each segment's tensor at its offset, zero
/// bytes in the gaps and up to `size`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceEntry {
    pub name: String,
    pub size: u64,
    #[serde(with = "hex64")]
    pub xxh3: u64,
    pub prefix: ArrayRef,
    /// Sorted by offset.
    pub segments: Vec<SourceSegment>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceSegment {
    pub tensor: String,
    /// Absolute byte offset in the source file.
    pub offset: u64,
}

impl Manifest {
    /// An empty manifest of the current version.
    pub fn new(tool: &str) -> Self {
        Manifest {
            format: FORMAT_NAME.to_string(),
            version: format!("{FORMAT_MAJOR}.{FORMAT_MINOR}"),
            tool: tool.to_string(),
            metadata: Map::new(),
            shards: Vec::new(),
            tensors: Vec::new(),
            sources: Vec::new(),
            verbatim: Vec::new(),
            generated: Vec::new(),
        }
    }

    /// The manifest as written to disk (pretty JSON with a final newline).
    pub fn to_json(&self) -> String {
        let mut s = serde_json::to_string_pretty(self).expect("manifest serializes");
        s.push('\n');
        s
    }

    /// Parses a manifest read from `path`. The format name and major version are checked before
    /// the rest, so a container from a future major version is reported as such and not as a
    /// schema error. Schema errors name the entry (tensor, shard, source or file).
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Manifest> {
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| FormatError::file(path, format!("invalid JSON: {e}")))?;
        let Value::Object(mut top) = value else {
            return Err(FormatError::file(path, "the manifest is not a JSON object"));
        };
        let field = |top: &mut Map<String, Value>, key: &str| {
            top.remove(key)
                .ok_or_else(|| FormatError::file(path, format!("missing field \"{key}\"")))
        };
        let string = |v: Value, key: &str| match v {
            Value::String(s) => Ok(s),
            _ => Err(FormatError::file(
                path,
                format!("field \"{key}\" is not a string"),
            )),
        };
        let format = string(field(&mut top, "format")?, "format")?;
        if format != FORMAT_NAME {
            return Err(FormatError::file(
                path,
                format!("format is '{format}', not '{FORMAT_NAME}'"),
            ));
        }
        let version = string(field(&mut top, "version")?, "version")?;
        let major = version
            .split_once('.')
            .and_then(|(ma, mi)| mi.parse::<u32>().ok().and(ma.parse::<u32>().ok()))
            .ok_or_else(|| {
                FormatError::file(path, format!("version '{version}' is not <major>.<minor>"))
            })?;
        if major != FORMAT_MAJOR {
            return Err(FormatError::Unsupported {
                path: path.to_path_buf(),
                msg: format!(
                    "container format version {version}; this build reads {FORMAT_MAJOR}.x"
                ),
            });
        }
        let tool = string(field(&mut top, "tool")?, "tool")?;
        let metadata = match top.remove("metadata") {
            None => Map::new(),
            Some(Value::Object(m)) => m,
            Some(_) => {
                return Err(FormatError::file(
                    path,
                    "field \"metadata\" is not an object",
                ))
            }
        };
        let shards = entries(path, "shards", field(&mut top, "shards")?, |_, m| {
            FormatError::file(path, m)
        })?;
        let tensors = entries(
            path,
            "tensors",
            field(&mut top, "tensors")?,
            |name, m| match name {
                Some(n) => FormatError::tensor(path, n, m),
                None => FormatError::file(path, m),
            },
        )?;
        let optional = |top: &mut Map<String, Value>, key: &str| {
            top.remove(key).unwrap_or(Value::Array(Vec::new()))
        };
        let sources = entries(path, "sources", optional(&mut top, "sources"), |_, m| {
            FormatError::file(path, m)
        })?;
        let verbatim = entries(path, "verbatim", optional(&mut top, "verbatim"), |_, m| {
            FormatError::file(path, m)
        })?;
        let generated = entries(
            path,
            "generated",
            optional(&mut top, "generated"),
            |_, m| FormatError::file(path, m),
        )?;
        // Unknown top-level fields are ignored: newer minor versions may add optional ones.
        Ok(Manifest {
            format,
            version,
            tool,
            metadata,
            shards,
            tensors,
            sources,
            verbatim,
            generated,
        })
    }
}

/// Deserializes the array `value` of section `section` element by element, so an error says
/// which element (by its `name` when it has one) is wrong.
fn entries<T: DeserializeOwned>(
    path: &Path,
    section: &str,
    value: Value,
    err: impl Fn(Option<&str>, String) -> FormatError,
) -> Result<Vec<T>> {
    let Value::Array(items) = value else {
        return Err(FormatError::file(
            path,
            format!("field \"{section}\" is not a list"),
        ));
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            let name = item.get("name").and_then(Value::as_str).map(str::to_string);
            serde_json::from_value(item).map_err(|e| {
                let at = match &name {
                    Some(n) => format!("{section}[{i}] ('{n}')"),
                    None => format!("{section}[{i}]"),
                };
                err(name.as_deref(), format!("{at}: {e}"))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        let mut m = Manifest::new("test 1");
        m.shards.push(FileEntry {
            name: "entrollm-00001-of-00001.safetensors".into(),
            size: 10,
            xxh3: 7,
        });
        m.tensors.push(TensorEntry {
            name: "a".into(),
            dtype: Dtype::BF16,
            shape: vec![2, 3],
            xxh3: 0xabc,
            storage: Storage::Plain(ArrayRef {
                shard: "s.safetensors".into(),
                key: "a".into(),
            }),
            form: None,
        });
        m.tensors.push(TensorEntry {
            name: "b".into(),
            dtype: Dtype::F32,
            shape: vec![],
            xxh3: u64::MAX,
            storage: Storage::Coded(CodedEntry {
                coder: "dtans".into(),
                params: serde_json::json!({"m": 10, "t": [1, 2]}),
                arrays: [(
                    "words".to_string(),
                    ArrayRef {
                        shard: "s.safetensors".into(),
                        key: "b.dtans.words".into(),
                    },
                )]
                .into_iter()
                .collect(),
            }),
            form: Some(FormEntry {
                form: "dense".into(),
                variant: "f32".into(),
            }),
        });
        m
    }

    #[test]
    fn json_round_trip_and_shape_of_the_schema() {
        let m = sample();
        let text = m.to_json();
        let back = Manifest::parse(Path::new("m.json"), text.as_bytes()).unwrap();
        assert_eq!(back, m);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["version"], "1.2");
        assert!(v["tensors"][0].get("form").is_none());
        assert_eq!(v["tensors"][1]["form"]["variant"], "f32");
        assert_eq!(v["tensors"][0]["plain"]["key"], "a");
        assert_eq!(v["tensors"][0]["xxh3"], "0000000000000abc");
        assert_eq!(
            v["tensors"][1]["coded"]["arrays"]["words"]["key"],
            "b.dtans.words"
        );
        assert!(v.get("sources").is_none() && v.get("metadata").is_none());
    }

    fn parse_err(v: Value) -> String {
        Manifest::parse(Path::new("dir/entrollm.json"), v.to_string().as_bytes())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn errors_name_the_problem() {
        let good: Value = serde_json::from_str(&sample().to_json()).unwrap();

        let mut v = good.clone();
        v["version"] = "2.0".into();
        let e = parse_err(v);
        assert!(e.contains("unsupported") && e.contains("2.0"), "{e}");

        // A future minor version with unknown fields is read.
        let mut v = good.clone();
        v["version"] = "1.7".into();
        v["future_field"] = 1.into();
        v["tensors"][0]["future_field"] = 1.into();
        assert!(Manifest::parse(Path::new("m"), v.to_string().as_bytes()).is_ok());

        // A 1.0 manifest (no forms) is read.
        let mut v = good.clone();
        v["version"] = "1.0".into();
        v["tensors"][1].as_object_mut().unwrap().remove("form");
        let m = Manifest::parse(Path::new("m"), v.to_string().as_bytes()).unwrap();
        assert!(m.tensors.iter().all(|t| t.form.is_none()));

        let mut v = good.clone();
        v["version"] = "one".into();
        assert!(parse_err(v).contains("not <major>.<minor>"));

        let mut v = good.clone();
        v["format"] = "other".into();
        assert!(parse_err(v).contains("format is 'other'"));

        let mut v = good.clone();
        v["tensors"][1]["shape"] = serde_json::json!([-1]);
        let e = parse_err(v);
        assert!(e.contains("tensor 'b'") && e.contains("tensors[1]"), "{e}");

        let mut v = good.clone();
        v["tensors"][0]["dtype"] = "Q4_K".into();
        let e = parse_err(v);
        assert!(
            e.contains("tensor 'a'") && e.contains("unknown dtype 'Q4_K'"),
            "{e}"
        );

        let mut v = good.clone();
        v["tensors"][0]["xxh3"] = "123".into();
        assert!(parse_err(v).contains("not 16 hex digits"));

        let mut v = good.clone();
        v["tensors"][0].as_object_mut().unwrap().remove("plain");
        let e = parse_err(v);
        assert!(e.contains("tensor 'a'"), "{e}");

        let mut v = good.clone();
        v["tensors"][1]["coded"]
            .as_object_mut()
            .unwrap()
            .remove("coder");
        let e = parse_err(v);
        assert!(e.contains("tensor 'b'") && e.contains("coder"), "{e}");

        let mut v = good.clone();
        v.as_object_mut().unwrap().remove("shards");
        assert!(parse_err(v).contains("missing field \"shards\""));

        let e = Manifest::parse(Path::new("dir/entrollm.json"), b"{\"format\": ")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("dir/entrollm.json") && e.contains("invalid JSON"),
            "{e}"
        );
    }
}
