//! Tokenizers: a wrapper around Hugging Face `tokenizers` built either from `tokenizer.json`
//! (+ `tokenizer_config.json`) or from GGUF metadata (formats.md §1.6), reproducing llama.cpp's
//! tokenization of GGUF vocabularies:
//!
//! * `gpt2` (byte-level BPE): the file's tokens and merges, split first by the regexes llama.cpp
//!   uses for the file's `tokenizer.ggml.pre`, then mapped to GPT-2's byte alphabet.
//! * `llama` (SentencePiece BPE): merges recovered from the token scores (a merge ranks by the
//!   score of the token it produces), `▁` for spaces, a `▁` prefix after the start and after every
//!   special token (`add_space_prefix`), unknown characters as `<0xNN>` byte tokens.
//!
//! Control and user-defined tokens are always matched whole in the input text.

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

/// GGUF `tokenizer.ggml.token_type` values.
mod token_type {
    pub const NORMAL: i64 = 1;
    pub const UNKNOWN: i64 = 2;
    pub const CONTROL: i64 = 3;
    pub const USER_DEFINED: i64 = 4;
}

/// A special token: its id and its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecialToken {
    pub id: u32,
    pub text: String,
}

/// A text tokenizer with the model's special tokens and chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// One past the largest token id (cached: `tokenizers` rebuilds the whole vocabulary map to
    /// count it).
    vocab_size: usize,
    bos: Option<SpecialToken>,
    eos: Option<SpecialToken>,
    /// Ids that end generation: EOS plus, for GGUF, the end-of-turn / end-of-message tokens.
    eos_ids: Vec<u32>,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eos_ids", &self.eos_ids)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

fn tok_err(context: impl std::fmt::Display, e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(format!("{context}: {e}"))
}

impl Tokenizer {
    /// Loads `tokenizer.json` and, if given, `tokenizer_config.json` (for the BOS/EOS tokens and
    /// the chat template).
    pub fn from_files(tokenizer_json: &Path, tokenizer_config: Option<&Path>) -> Result<Self> {
        let read = |path: &Path| {
            entrollm_format::input::read_limited(path, entrollm_format::input::JSON_LIMIT).map_err(
                |error| ModelError::Io {
                    path: path.into(),
                    error,
                },
            )
        };
        let config = match tokenizer_config {
            Some(p) => Some((read(p)?, p)),
            None => None,
        };
        Self::from_bytes(
            &read(tokenizer_json)?,
            tokenizer_json,
            config.as_ref().map(|(b, p)| (b.as_slice(), *p)),
        )
    }

    /// [`Tokenizer::from_files`] on the files' contents (`path`s for messages).
    pub fn from_bytes(
        tokenizer_json: &[u8],
        path: &Path,
        tokenizer_config: Option<(&[u8], &Path)>,
    ) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(tokenizer_json)
            .map_err(|e| tok_err(path.display(), e))?;
        let mut tok = Tokenizer::new(inner, None, None, Vec::new(), None);
        if let Some((bytes, path)) = tokenizer_config {
            let config: Value =
                serde_json::from_slice(bytes).map_err(|e| tok_err(path.display(), e))?;
            tok.apply_tokenizer_config(&config, path)?;
        }
        Ok(tok)
    }

    /// The tokenizer of an entrollm container, its files checked against the manifest's
    /// checksums first.
    pub fn from_container(reader: &entrollm_format::ContainerReader) -> Result<Self> {
        let dir = reader.dir();
        let read = |name: &str| {
            reader
                .read_verbatim(name, entrollm_format::input::JSON_LIMIT)
                .map_err(|e| ModelError::format(dir, e.to_string()))
        };
        let config = match reader.has_verbatim("tokenizer_config.json") {
            true => Some(read("tokenizer_config.json")?),
            false => None,
        };
        if !reader.has_verbatim("tokenizer.json") {
            return Err(no_tokenizer(dir));
        }
        let config_path = dir.join("tokenizer_config.json");
        Self::from_bytes(
            &read("tokenizer.json")?,
            &dir.join("tokenizer.json"),
            config.as_deref().map(|b| (b, config_path.as_path())),
        )
    }

    /// Loads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        if !dir.join("tokenizer.json").exists() {
            return Err(no_tokenizer(dir));
        }
        let config = dir.join("tokenizer_config.json");
        Self::from_files(
            &dir.join("tokenizer.json"),
            config.exists().then_some(config.as_path()),
        )
    }

    fn apply_tokenizer_config(&mut self, config: &Value, path: &Path) -> Result<()> {
        // A special token is either a string or an AddedToken object with "content".
        let special = |key: &str| -> Result<Option<SpecialToken>> {
            let text = match config.get(key) {
                None | Some(Value::Null) => return Ok(None),
                Some(Value::String(s)) => s.clone(),
                Some(v) => match v.get("content").and_then(Value::as_str) {
                    Some(s) => s.to_string(),
                    None => {
                        return Err(tok_err(
                            path.display(),
                            format!("`{key}` is neither a string nor a token"),
                        ))
                    }
                },
            };
            let id = self.inner.token_to_id(&text).ok_or_else(|| {
                tok_err(
                    path.display(),
                    format!("`{key}` is `{text}`, which is not in the vocabulary"),
                )
            })?;
            Ok(Some(SpecialToken { id, text }))
        };
        self.bos = special("bos_token")?;
        self.eos = special("eos_token")?;
        self.eos_ids = self.eos.iter().map(|t| t.id).collect();
        self.chat_template = match config.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            // Several named templates: [{"name": "default", "template": "..."}, ...].
            Some(Value::Array(list)) => {
                let named = |name: &str| {
                    list.iter()
                        .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
                };
                named("default")
                    .or(list.first())
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_string)
            }
            Some(_) => {
                return Err(tok_err(
                    path.display(),
                    "`chat_template` is neither a string nor a list",
                ))
            }
        };
        Ok(())
    }

    /// Builds the tokenizer a GGUF file describes (`tokenizer.ggml.*` metadata).
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let ctx = file.path().display().to_string();
        let model = file
            .get_str("tokenizer.ggml.model")?
            .ok_or_else(|| tok_err(&ctx, "metadata key `tokenizer.ggml.model` is missing"))?;
        let tokens = file
            .get_str_array("tokenizer.ggml.tokens")?
            .ok_or_else(|| tok_err(&ctx, "metadata key `tokenizer.ggml.tokens` is missing"))?;
        let n = tokens.len();
        let types = match file.get_i64_array("tokenizer.ggml.token_type")? {
            Some(t) if t.len() != n => {
                return Err(tok_err(
                    &ctx,
                    format!("{} token types for {n} tokens", t.len()),
                ));
            }
            Some(t) => t,
            None => vec![token_type::NORMAL; n],
        };
        let id_key = |k: &str| -> Result<Option<u32>> {
            let key = format!("tokenizer.ggml.{k}");
            match file.get_u32(&key)? {
                Some(id) if id as usize >= n => Err(tok_err(
                    &ctx,
                    format!("`{key}` is {id}, outside the vocabulary of {n} tokens"),
                )),
                id => Ok(id),
            }
        };
        let (bos_id, eos_id) = (id_key("bos_token_id")?, id_key("eos_token_id")?);
        let mut eos_ids: Vec<u32> = eos_id.into_iter().collect();
        for k in ["eot_token_id", "eom_token_id"] {
            if let Some(id) = id_key(k)? {
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }

        let vocab = vocab_map(tokens, &ctx)?;
        let parts = match model {
            "gpt2" => byte_level_bpe(file, vocab, &ctx)?,
            "llama" => {
                let unk = id_key("unknown_token_id")?.map(|id| tokens[id as usize].clone());
                sentencepiece_bpe(file, vocab, tokens, &types, unk, &ctx)?
            }
            other => {
                return Err(ModelError::Unsupported(format!(
                "{ctx}: tokenizer model `{other}` (tokenizer.ggml.model); supported: gpt2, llama"
            )))
            }
        };

        let add_bos = file
            .get_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(parts.default_add_bos);
        let add_eos = file
            .get_bool("tokenizer.ggml.add_eos_token")?
            .unwrap_or(false);
        let special = |id: Option<u32>| {
            id.map(|id| SpecialToken {
                id,
                text: tokens[id as usize].clone(),
            })
        };
        let (bos, eos) = (special(bos_id), special(eos_id));
        let post_processor = template_processing(
            required_special(add_bos, bos.as_ref(), "bos", &ctx)?,
            required_special(add_eos, eos.as_ref(), "eos", &ctx)?,
        );

        let added_tokens: Vec<Value> = types
            .iter()
            .enumerate()
            .filter(|(_, &t)| matches!(t, token_type::CONTROL | token_type::UNKNOWN | token_type::USER_DEFINED))
            .map(|(id, &t)| {
                json!({
                    "id": id, "content": tokens[id], "single_word": false, "lstrip": false, "rstrip": false,
                    "normalized": false, "special": t != token_type::USER_DEFINED,
                })
            })
            .collect();
        let spec = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added_tokens,
            "normalizer": parts.normalizer, "pre_tokenizer": parts.pre_tokenizer,
            "post_processor": post_processor, "decoder": parts.decoder, "model": parts.model,
        });
        let inner: tokenizers::Tokenizer = spec
            .to_string()
            .parse()
            .map_err(|e| tok_err(format!("{ctx}: building the {model} tokenizer"), e))?;
        let chat_template = file.get_str("tokenizer.chat_template")?.map(str::to_string);
        Ok(Tokenizer::new(inner, bos, eos, eos_ids, chat_template))
    }

    fn new(
        inner: tokenizers::Tokenizer,
        bos: Option<SpecialToken>,
        eos: Option<SpecialToken>,
        eos_ids: Vec<u32>,
        chat_template: Option<String>,
    ) -> Self {
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        Tokenizer {
            inner,
            vocab_size,
            bos,
            eos,
            eos_ids,
            chat_template,
        }
    }

    /// Token ids of `text`. Special and user-defined tokens written in the text are always
    /// matched whole; `add_special` adds what the model adds around a sequence (e.g. BOS).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special)
            .map_err(|e| tok_err("encode", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let vocab = self.vocab_size();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(ModelError::Tokenizer(format!(
                "token id {bad} is outside the vocabulary of {vocab} tokens"
            )));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| tok_err("decode", e))
    }

    /// A decoder that turns tokens into text one at a time, for streaming.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder {
            tokenizer: self,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Vocabulary size (one past the largest id), added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn bos(&self) -> Option<&SpecialToken> {
        self.bos.as_ref()
    }

    pub fn eos(&self) -> Option<&SpecialToken> {
        self.eos.as_ref()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos.as_ref().map(|t| t.id)
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos.as_ref().map(|t| t.id)
    }

    /// Every id that ends generation.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The chat template (Jinja source) that came with the tokenizer, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The underlying Hugging Face tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The model-specific pieces of a `tokenizer.json` built from GGUF metadata.
struct TokenizerParts {
    model: Value,
    normalizer: Value,
    pre_tokenizer: Value,
    decoder: Value,
    /// Whether llama.cpp adds BOS when the file does not say (`add_bos_token`).
    default_add_bos: bool,
}

/// `gpt2`: byte-level BPE with the file's merges, split by the regexes of `tokenizer.ggml.pre`.
fn byte_level_bpe(
    file: &GgufFile,
    vocab: serde_json::Map<String, Value>,
    ctx: &str,
) -> Result<TokenizerParts> {
    let pre = file.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let (regexes, ignore_merges, default_add_bos) = bpe_pre_tokenizer(pre).ok_or_else(|| {
        ModelError::Unsupported(format!(
            "{ctx}: BPE pre-tokenizer `{pre}` (tokenizer.ggml.pre)"
        ))
    })?;
    let merges = file
        .get_str_array("tokenizer.ggml.merges")?
        .ok_or_else(|| tok_err(ctx, "a gpt2 vocabulary needs `tokenizer.ggml.merges`"))?;
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            // llama.cpp splits at the first space after the first byte.
            let pos = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1);
            pos.map(|p| json!([&m[..p], &m[p + 1..]])).ok_or_else(|| {
                tok_err(
                    ctx,
                    format!("merge {i} `{m}` is not two tokens separated by a space"),
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    let mut steps: Vec<Value> = regexes
        .iter()
        .map(|r| json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false}))
        .collect();
    steps.push(byte_level.clone());
    Ok(TokenizerParts {
        model: json!({
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges,
        }),
        normalizer: Value::Null,
        pre_tokenizer: json!({"type": "Sequence", "pretokenizers": steps}),
        decoder: byte_level,
        default_add_bos,
    })
}

/// `llama`: SentencePiece BPE with merges recovered from the scores, `▁` for spaces and byte
/// fallback.
fn sentencepiece_bpe(
    file: &GgufFile,
    vocab: serde_json::Map<String, Value>,
    tokens: &[String],
    types: &[i64],
    unk_token: Option<String>,
    ctx: &str,
) -> Result<TokenizerParts> {
    let scores = file
        .get_f32_array("tokenizer.ggml.scores")?
        .ok_or_else(|| {
            tok_err(
                ctx,
                "a llama (SentencePiece) vocabulary needs `tokenizer.ggml.scores`",
            )
        })?;
    if scores.len() != tokens.len() {
        return Err(tok_err(
            ctx,
            format!("{} scores for {} tokens", scores.len(), tokens.len()),
        ));
    }
    let add_space_prefix = file
        .get_bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    let mut normalizers = Vec::new();
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space_prefix {
        normalizers.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}));
    Ok(TokenizerParts {
        model: json!({
            "type": "BPE", "dropout": null, "unk_token": unk_token, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
            "ignore_merges": false, "vocab": vocab, "merges": merges_from_scores(tokens, types, &scores),
        }),
        normalizer: json!({"type": "Sequence", "normalizers": normalizers}),
        pre_tokenizer: Value::Null,
        decoder: json!({"type": "Sequence", "decoders": decoders}),
        default_add_bos: true,
    })
}

/// token → id, rejecting duplicates (llama.cpp refuses such vocabularies too). Empty tokens get
/// llama.cpp's placeholder name `[EMPTY_<id>]`.
fn vocab_map(tokens: &[String], ctx: &str) -> Result<serde_json::Map<String, Value>> {
    let mut map = serde_json::Map::with_capacity(tokens.len());
    let mut first_id: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        let key = if t.is_empty() {
            format!("[EMPTY_{id}]")
        } else {
            t.clone()
        };
        if let Some(prev) = first_id.insert(t.as_str(), id) {
            if !t.is_empty() {
                return Err(tok_err(
                    ctx,
                    format!("token `{t}` appears twice, as ids {prev} and {id}"),
                ));
            }
        }
        map.insert(key, json!(id));
    }
    Ok(map)
}

/// `token` if the file asks for it to be added (`add_{what}_token`), which needs it to exist.
fn required_special<'a>(
    add: bool,
    token: Option<&'a SpecialToken>,
    what: &str,
    ctx: &str,
) -> Result<Option<&'a SpecialToken>> {
    match (add, token) {
        (false, _) => Ok(None),
        (true, Some(t)) => Ok(Some(t)),
        (true, None) => Err(tok_err(
            ctx,
            format!("add_{what}_token is set but there is no {what}_token_id"),
        )),
    }
}

/// A post-processor that adds BOS before and/or EOS after every sequence, or null.
fn template_processing(bos: Option<&SpecialToken>, eos: Option<&SpecialToken>) -> Value {
    if bos.is_none() && eos.is_none() {
        return Value::Null;
    }
    let special = |t: &SpecialToken| json!({"SpecialToken": {"id": t.text, "type_id": 0}});
    let seq = |s: &str, type_id: u32| json!({"Sequence": {"id": s, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    if let Some(b) = bos {
        single.push(special(b));
        pair.push(special(b));
    }
    single.push(seq("A", 0));
    pair.push(seq("A", 0));
    if let Some(e) = eos {
        single.push(special(e));
        pair.push(special(e));
    }
    if let Some(b) = bos {
        pair.push(special(b));
    }
    pair.push(seq("B", 1));
    if let Some(e) = eos {
        pair.push(special(e));
    }
    let specials: serde_json::Map<String, Value> = bos
        .into_iter()
        .chain(eos)
        .map(|t| {
            (
                t.text.clone(),
                json!({"id": t.text, "ids": [t.id], "tokens": [t.text]}),
            )
        })
        .collect();
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
}

/// (split regexes, ignore_merges, adds BOS by default) of a llama.cpp BPE pre-tokenizer name,
/// from `llama-vocab.cpp` (`llm_tokenizer_bpe` and the `tokenizer_pre` table).
fn bpe_pre_tokenizer(pre: &str) -> Option<(&'static [&'static str], bool, bool)> {
    const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
    const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const DEFAULT: &[&str] = &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"];
    Some(match pre {
        "default" => (DEFAULT, false, false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" => (&[LLAMA3], true, true),
        "dbrx" | "smaug-bpe" => (&[LLAMA3], false, false),
        "glm4" | "chatglm-bpe" => (&[LLAMA3], false, false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "megrez" | "stablelm2" | "hunyuan" => {
            (&[QWEN2], false, false)
        }
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            (&[r"\p{N}", GPT2], false, false)
        }
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "mpt" | "olmo" | "jais" | "exaone4" | "trillion"
        | "granite-docling" => (&[GPT2], false, false),
        "falcon" => (
            &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
            false,
            false,
        ),
        _ => return None,
    })
}

/// Longest token (in bytes) that [`merges_from_scores`] splits into merges.
const MAX_MERGE_TOKEN_BYTES: usize = 1024;

/// BPE merges of a SentencePiece vocabulary, recovered from its scores as Hugging Face's
/// `generate_merges` does: every split of a normal token into two vocabulary tokens is a merge,
/// ranked by the merged token's score (best first), then by longer left part, longer right part,
/// token id, and the parts' ids.
///
/// Tokens longer than [`MAX_MERGE_TOKEN_BYTES`] are not split (checking every split is quadratic
/// in the length, and no real vocabulary has merge results that long).
fn merges_from_scores(tokens: &[String], types: &[i64], scores: &[f32]) -> Vec<Value> {
    let ids: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    // (score, left chars, right chars, token id, left id, right id)
    let mut merges: Vec<(f32, usize, usize, usize, usize, usize)> = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        if types[id] != token_type::NORMAL && types[id] != token_type::USER_DEFINED
            || token.len() > MAX_MERGE_TOKEN_BYTES
        {
            continue;
        }
        for (split, _) in token.char_indices().skip(1) {
            let (l, r) = token.split_at(split);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                merges.push((scores[id], l.chars().count(), r.chars().count(), id, li, ri));
            }
        }
    }
    merges.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(b.1.cmp(&a.1))
            .then(b.2.cmp(&a.2))
            .then(a.3.cmp(&b.3))
            .then((a.4, a.5).cmp(&(b.4, b.5)))
    });
    merges
        .into_iter()
        .map(|(.., l, r)| json!([tokens[l], tokens[r]]))
        .collect()
}

/// Turns a stream of token ids into text pieces, emitting text as soon as it is complete UTF-8
/// (byte-fallback and byte-level tokens can end mid-character). Decodes a short window of the
/// previous tokens with each new one, so decoders that treat the first token specially (a
/// stripped leading space) stay correct mid-stream.
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    /// Start of the window decoded to find the new text.
    prefix_offset: usize,
    /// End of the text already emitted.
    read_offset: usize,
}

impl StreamDecoder<'_> {
    /// Primes the decoder with tokens that precede the stream (e.g. the prompt), so the first
    /// generated token is decoded in context; their text is not emitted.
    pub fn with_context(mut self, ids: &[u32]) -> Self {
        let keep = ids.len().saturating_sub(6);
        self.ids.extend_from_slice(&ids[keep..]);
        self.prefix_offset = 0;
        self.read_offset = self.ids.len();
        self
    }

    /// Adds one token; returns the text it completes, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let prefix = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let text = self.tokenizer.decode(&self.ids[self.prefix_offset..])?;
        if text.len() > prefix.len()
            && !text.ends_with('\u{FFFD}')
            && text.is_char_boundary(prefix.len())
        {
            let new = text[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            // Keep the window short: drop tokens that are no longer needed.
            if self.prefix_offset > 0 {
                self.ids.drain(..self.prefix_offset);
                self.read_offset -= self.prefix_offset;
                self.prefix_offset = 0;
            }
            Ok(Some(new))
        } else {
            Ok(None)
        }
    }

    /// Text still held back at the end of the stream (an incomplete character decodes as U+FFFD).
    pub fn flush(&mut self) -> Result<Option<String>> {
        let prefix = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let text = self.tokenizer.decode(&self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(match text.get(prefix.len()..) {
            Some(rest) if !rest.is_empty() && text.starts_with(&prefix) => Some(rest.to_string()),
            _ => None,
        })
    }
}

/// A model directory without `tokenizer.json` (a `synth` checkpoint, or one copied without it).
fn no_tokenizer(dir: &Path) -> ModelError {
    ModelError::format(
        dir,
        "the model has no tokenizer (tokenizer.json), which turning text into tokens needs: put \
         the checkpoint's tokenizer.json beside it (before compressing, for a container); `bench`, \
         `tune`, `compress` and `eval ppl --tokens` need none",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufWriter, MetaArray, MetaValue};

    fn strings(v: &[&str]) -> MetaValue {
        MetaValue::Array(MetaArray::String(v.iter().map(|s| s.to_string()).collect()))
    }

    /// A tiny SentencePiece-style vocabulary: merges must follow the scores, not the file order.
    fn spm_file(scores: &[f32]) -> GgufFile {
        let tokens = [
            "<unk>",
            "<s>",
            "</s>",
            "\u{2581}",
            "a",
            "b",
            "c",
            "ab",
            "bc",
            "\u{2581}a",
            "<0x41>",
            "<0xC3>",
            "<0xA9>",
        ];
        let types = [2, 3, 3, 1, 1, 1, 1, 1, 1, 1, 6, 6, 6];
        let mut w = GgufWriter::new();
        w.meta_str("tokenizer.ggml.model", "llama")
            .meta("tokenizer.ggml.tokens", strings(&tokens))
            .meta(
                "tokenizer.ggml.scores",
                MetaValue::Array(MetaArray::F32(scores.to_vec())),
            )
            .meta(
                "tokenizer.ggml.token_type",
                MetaValue::Array(MetaArray::I32(types.to_vec())),
            )
            .meta_u32("tokenizer.ggml.bos_token_id", 1)
            .meta_u32("tokenizer.ggml.eos_token_id", 2)
            .meta_u32("tokenizer.ggml.unknown_token_id", 0);
        GgufFile::from_bytes("spm.gguf", w.to_bytes()).unwrap()
    }

    #[test]
    fn spm_merges_follow_scores() {
        // "ab" scores above "bc": "abc" → ab, c.
        let mut scores = vec![
            0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -2.0, -3.0, -4.0, -5.0, 0.0, 0.0, 0.0,
        ];
        let tok = Tokenizer::from_gguf(&spm_file(&scores)).unwrap();
        // BOS is added by default for SentencePiece; "▁a" is a token, then "bc"? No: "▁abc" →
        // candidates ▁a (-5), ab (-3), bc (-4): ab wins, then ▁ + ab and c stay.
        assert_eq!(tok.encode("abc", true).unwrap(), vec![1, 3, 7, 6]);
        scores[8] = -1.5; // now "bc" beats "ab"
        let tok = Tokenizer::from_gguf(&spm_file(&scores)).unwrap();
        assert_eq!(tok.encode("abc", false).unwrap(), vec![9, 8]);
        assert_eq!(tok.decode(&[9, 8]).unwrap(), "abc");
    }

    #[test]
    fn spm_byte_fallback_and_special_tokens() {
        let scores = vec![
            0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -2.0, -3.0, -4.0, -5.0, 0.0, 0.0, 0.0,
        ];
        let tok = Tokenizer::from_gguf(&spm_file(&scores)).unwrap();
        // "é" is not in the vocabulary: UTF-8 bytes C3 A9 as byte tokens.
        assert_eq!(tok.encode("é", false).unwrap(), vec![3, 11, 12]);
        assert_eq!(tok.decode(&[11, 12]).unwrap(), "é");
        // Special tokens in the text are matched whole, and a ▁ prefix follows them.
        assert_eq!(tok.encode("a</s>a", false).unwrap(), vec![9, 2, 9]);
        assert_eq!(tok.bos_id(), Some(1));
        assert_eq!(tok.eos_ids(), &[2]);
        assert!(tok.decode(&[13]).is_err());
    }

    #[test]
    fn stream_decoder_waits_for_complete_characters() {
        let scores = vec![
            0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -2.0, -3.0, -4.0, -5.0, 0.0, 0.0, 0.0,
        ];
        let tok = Tokenizer::from_gguf(&spm_file(&scores)).unwrap();
        let mut s = tok.stream_decoder();
        assert_eq!(s.push(9).unwrap().as_deref(), Some("a"));
        assert_eq!(s.push(11).unwrap(), None); // first byte of "é"
        assert_eq!(s.push(12).unwrap().as_deref(), Some("é"));
        assert_eq!(s.push(9).unwrap().as_deref(), Some(" a"));
        assert_eq!(s.push(11).unwrap(), None);
        assert_eq!(s.flush().unwrap().as_deref(), Some("\u{FFFD}"));
        // Primed with context, the first token keeps its leading space.
        let mut s = tok.stream_decoder().with_context(&[9]);
        assert_eq!(s.push(9).unwrap().as_deref(), Some(" a"));
    }

    #[test]
    fn bad_gguf_vocabularies_are_errors() {
        let mut w = GgufWriter::new();
        w.meta_str("tokenizer.ggml.model", "bert")
            .meta("tokenizer.ggml.tokens", strings(&["a"]));
        let f = GgufFile::from_bytes("x.gguf", w.to_bytes()).unwrap();
        assert!(
            matches!(Tokenizer::from_gguf(&f), Err(ModelError::Unsupported(m)) if m.contains("bert"))
        );

        let mut w = GgufWriter::new();
        w.meta_str("tokenizer.ggml.model", "gpt2")
            .meta_str("tokenizer.ggml.pre", "no-such-pre")
            .meta("tokenizer.ggml.tokens", strings(&["a"]))
            .meta("tokenizer.ggml.merges", strings(&[]));
        let f = GgufFile::from_bytes("x.gguf", w.to_bytes()).unwrap();
        assert!(
            matches!(Tokenizer::from_gguf(&f), Err(ModelError::Unsupported(m)) if m.contains("no-such-pre"))
        );

        let mut w = GgufWriter::new();
        w.meta_str("tokenizer.ggml.model", "gpt2")
            .meta("tokenizer.ggml.tokens", strings(&["a", "b", "a"]))
            .meta("tokenizer.ggml.merges", strings(&[]));
        let f = GgufFile::from_bytes("x.gguf", w.to_bytes()).unwrap();
        assert!(Tokenizer::from_gguf(&f)
            .unwrap_err()
            .to_string()
            .contains("appears twice"));

        let mut w = GgufWriter::new();
        w.meta_str("tokenizer.ggml.model", "gpt2")
            .meta("tokenizer.ggml.tokens", strings(&["a", "b"]))
            .meta("tokenizer.ggml.merges", strings(&["ab"]));
        let f = GgufFile::from_bytes("x.gguf", w.to_bytes()).unwrap();
        assert!(Tokenizer::from_gguf(&f)
            .unwrap_err()
            .to_string()
            .contains("merge 0"));

        let mut w = GgufWriter::new();
        w.meta_str("tokenizer.ggml.model", "gpt2")
            .meta("tokenizer.ggml.tokens", strings(&["a", "b"]))
            .meta("tokenizer.ggml.merges", strings(&["a b"]))
            .meta_u32("tokenizer.ggml.eos_token_id", 2);
        let f = GgufFile::from_bytes("x.gguf", w.to_bytes()).unwrap();
        assert!(Tokenizer::from_gguf(&f)
            .unwrap_err()
            .to_string()
            .contains("eos_token_id"));
    }
}
