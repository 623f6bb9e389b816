//! The OpenAI API's request bodies, read into what the engine runs, and its error shape. Pure
//! functions of the bytes a client sent: every field users rely on is read and checked here, each
//! bad one a 400 naming it; fields this server does not read are ignored, ones it cannot honour
//! (`n > 1`, tools) refused by name.

use serde_json::{json, Map, Value};

/// An error as OpenAI's API sends it: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 about the request's `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
        }
    }

    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

/// A chat message's role, as the chat template names it (`developer` is OpenAI's newer name for
/// `system`).
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// What the model is given: chat messages (rendered with its chat template) or a raw prompt.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Chat(Vec<Message>),
    Text(String),
    Tokens(Vec<u32>),
}

/// One request, read and checked; `None` fields take the server's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub prompt: Prompt,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the token counts.
    pub include_usage: bool,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    /// Strings that end the answer (not included in it), matched across token boundaries.
    pub stop: Vec<String>,
    /// Log-probabilities of the chosen tokens, with this many alternatives each.
    pub logprobs: Option<usize>,
}

/// The most `stop` strings a request may give, and top log-probabilities a token may ask for.
pub const MAX_STOPS: usize = 16;
pub const MAX_TOP_LOGPROBS: usize = 20;
/// The most messages a chat request may hold.
pub const MAX_MESSAGES: usize = 4096;

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A request body's fields, read one at a time; absent and `null` fields are the same.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::invalid(
                name,
                format!("`{name}` must be a boolean, not {}", type_name(v)),
            )),
        }
    }

    /// A number in `range` (inclusive).
    fn number(&self, name: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN);
                if !(lo..=hi).contains(&x) {
                    return Err(ApiError::invalid(
                        name,
                        format!("`{name}` is {n}: it must be between {lo} and {hi}"),
                    ));
                }
                Ok(Some(x as f32))
            }
            Some(v) => Err(ApiError::invalid(
                name,
                format!("`{name}` must be a number, not {}", type_name(v)),
            )),
        }
    }

    /// A whole number in `lo..=hi`.
    fn integer(&self, name: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_i64() {
                Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
                _ => Err(ApiError::invalid(
                    name,
                    format!("`{name}` is {n}: it must be a whole number from {lo} to {hi}"),
                )),
            },
            Some(v) => Err(ApiError::invalid(
                name,
                format!("`{name}` must be an integer, not {}", type_name(v)),
            )),
        }
    }

    /// Refuses a field this server cannot honour unless it has its neutral value.
    fn refuse_unless(
        &self,
        name: &str,
        neutral: impl Fn(&Value) -> bool,
        why: &str,
    ) -> Result<(), ApiError> {
        match self.get(name) {
            Some(v) if !neutral(v) => Err(ApiError::invalid(
                name,
                format!("`{name}` is not supported by this server: {why}"),
            )),
            _ => Ok(()),
        }
    }
}

fn empty(v: &Value) -> bool {
    match v {
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty() || s == "none",
        _ => false,
    }
}

fn zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}

fn one(v: &Value) -> bool {
    v.as_f64() == Some(1.0)
}

/// The body as a JSON object.
fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            400,
            "invalid_request_error",
            format!("the request body is not valid JSON: {e}"),
        )
    })?;
    match v {
        Value::Object(m) => Ok(m),
        v => Err(ApiError::new(
            400,
            "invalid_request_error",
            format!(
                "the request body must be a JSON object, not {}",
                type_name(&v)
            ),
        )),
    }
}

/// The fields both endpoints share.
fn common(f: &Fields, prompt: Prompt) -> Result<Request, ApiError> {
    f.refuse_unless("n", one, "it generates one choice a request (`n`: 1)")?;
    f.refuse_unless("best_of", one, "it generates one choice a request")?;
    f.refuse_unless(
        "presence_penalty",
        zero,
        "use `repetition_penalty` (HF's, divides the logits of tokens already seen)",
    )?;
    f.refuse_unless(
        "frequency_penalty",
        zero,
        "use `repetition_penalty` (HF's, divides the logits of tokens already seen)",
    )?;
    f.refuse_unless("logit_bias", empty, "no logit bias")?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => Fields(o).bool("include_usage")?.unwrap_or(false),
        Some(v) => {
            return Err(ApiError::invalid(
                "stream_options",
                format!("`stream_options` must be an object, not {}", type_name(v)),
            ))
        }
    };
    let max_tokens = match f.integer("max_completion_tokens", 1, u32::MAX as i64)? {
        Some(n) => Some(n),
        None => f.integer("max_tokens", 1, u32::MAX as i64)?,
    };
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            if a.len() > MAX_STOPS {
                return Err(ApiError::invalid(
                    "stop",
                    format!("`stop` holds {} strings: at most {MAX_STOPS}", a.len()),
                ));
            }
            a.iter()
                .map(|s| match s {
                    Value::String(s) => Ok(s.clone()),
                    v => Err(ApiError::invalid(
                        "stop",
                        format!("`stop` must hold strings, not {}", type_name(v)),
                    )),
                })
                .collect::<Result<_, _>>()?
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "`stop` must be a string or an array of strings, not {}",
                    type_name(v)
                ),
            ))
        }
    };
    Ok(Request {
        prompt,
        stream,
        include_usage,
        max_tokens: max_tokens.map(|n| n as usize),
        temperature: f.number("temperature", 0.0, 100.0)?,
        top_p: match f.number("top_p", 0.0, 1.0)? {
            Some(p) if p <= 0.0 => {
                return Err(ApiError::invalid(
                    "top_p",
                    "`top_p` must be above 0 (1: all tokens)",
                ))
            }
            p => p,
        },
        top_k: f
            .integer("top_k", -1, u32::MAX as i64)?
            .map(|k| k.max(0) as usize),
        min_p: f.number("min_p", 0.0, 1.0)?,
        repetition_penalty: match f.number("repetition_penalty", 0.0, 100.0)? {
            Some(p) if p <= 0.0 => {
                return Err(ApiError::invalid(
                    "repetition_penalty",
                    "`repetition_penalty` must be above 0 (1: off)",
                ))
            }
            p => p,
        },
        seed: f.integer("seed", i64::MIN, i64::MAX)?.map(|s| s as u64),
        stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
        logprobs: None,
    })
}

/// A message's content: a string, or text parts (`[{"type": "text", "text": …}]`) joined.
fn content(i: usize, v: Option<&Value>) -> Result<String, ApiError> {
    let param = || format!("messages[{i}].content");
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str);
                match (kind, p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    (Some("text"), _) => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}].text"),
                            "a text part needs a `text` string",
                        ))
                    }
                    (Some(k), _) => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}].type"),
                            format!("content parts of type `{k}` are not supported: text only"),
                        ))
                    }
                    (None, _) => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}]"),
                            "a content part needs a `type`",
                        ))
                    }
                }
            }
            Ok(text)
        }
        Some(v) => Err(ApiError::invalid(
            param(),
            format!(
                "a message's content must be a string or an array of parts, not {}",
                type_name(v)
            ),
        )),
    }
}

/// `POST /v1/chat/completions`.
pub fn chat_request(body: &[u8]) -> Result<Request, ApiError> {
    let o = object(body)?;
    let f = Fields(&o);
    f.refuse_unless("tools", empty, "no tool calls")?;
    f.refuse_unless("tool_choice", empty, "no tool calls")?;
    f.refuse_unless("functions", empty, "no function calls")?;
    f.refuse_unless("function_call", empty, "no function calls")?;
    f.refuse_unless(
        "response_format",
        |v| v.get("type").and_then(Value::as_str) == Some("text"),
        "text answers only (`{\"type\": \"text\"}`)",
    )?;
    f.refuse_unless("audio", empty, "text only")?;
    f.refuse_unless(
        "modalities",
        |v| v.as_array().is_some_and(|a| a.iter().all(|m| m == "text")),
        "text only",
    )?;
    let messages = match f.get("messages") {
        Some(Value::Array(m)) if m.is_empty() => {
            return Err(ApiError::invalid("messages", "`messages` is empty"))
        }
        Some(Value::Array(m)) if m.len() > MAX_MESSAGES => {
            return Err(ApiError::invalid(
                "messages",
                format!("`messages` holds {}: at most {MAX_MESSAGES}", m.len()),
            ))
        }
        Some(Value::Array(m)) => m,
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
        Some(v) => {
            return Err(ApiError::invalid(
                "messages",
                format!("`messages` must be an array, not {}", type_name(v)),
            ))
        }
    };
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(ApiError::invalid(
                format!("messages[{i}]"),
                format!("a message must be an object, not {}", type_name(m)),
            ));
        };
        let role = match m.get("role") {
            Some(Value::String(r)) => r.as_str(),
            Some(v) => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!("`role` must be a string, not {}", type_name(v)),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    "a message needs a `role`",
                ))
            }
        };
        let role = match role {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            r => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!("role `{r}` is not supported: system, developer, user or assistant"),
                ))
            }
        };
        if m.get("tool_calls")
            .is_some_and(|v| !v.is_null() && !empty(v))
        {
            return Err(ApiError::invalid(
                format!("messages[{i}].tool_calls"),
                "tool calls are not supported",
            ));
        }
        out.push(Message {
            role: role.to_string(),
            content: content(i, m.get("content"))?,
        });
    }
    let mut r = common(&f, Prompt::Chat(out))?;
    let top = f.integer("top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?;
    r.logprobs = match f.bool("logprobs")? {
        Some(true) => Some(top.unwrap_or(0) as usize),
        _ if top.is_some_and(|t| t > 0) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs`: true",
            ))
        }
        _ => None,
    };
    Ok(r)
}

/// `POST /v1/completions`.
pub fn completion_request(body: &[u8]) -> Result<Request, ApiError> {
    let o = object(body)?;
    let f = Fields(&o);
    f.refuse_unless("echo", |v| v == &Value::Bool(false), "the answer only")?;
    f.refuse_unless("suffix", empty, "no insertion")?;
    let many = || {
        ApiError::invalid(
            "prompt",
            "one prompt a request: `prompt` as a string, an array of one string, or token ids",
        )
    };
    let tokens = |a: &[Value]| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .map(|t| {
                t.as_u64()
                    .filter(|&t| t <= u32::MAX as u64)
                    .map(|t| t as u32)
                    .ok_or_else(|| {
                        ApiError::invalid("prompt", "token ids must be whole numbers ≥ 0")
                    })
            })
            .collect()
    };
    let prompt = match f.get("prompt") {
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) => match a.as_slice() {
            [Value::String(s)] => Prompt::Text(s.clone()),
            [Value::Array(t)] => Prompt::Tokens(tokens(t)?),
            a if !a.is_empty() && a.iter().all(Value::is_number) => Prompt::Tokens(tokens(a)?),
            _ => return Err(many()),
        },
        Some(v) => {
            return Err(ApiError::invalid(
                "prompt",
                format!(
                    "`prompt` must be a string or an array, not {}",
                    type_name(v)
                ),
            ))
        }
    };
    let mut r = common(&f, prompt)?;
    r.logprobs = f
        .integer("logprobs", 0, MAX_TOP_LOGPROBS as i64)?
        .map(|n| n as usize);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<Request, ApiError> {
        chat_request(body.as_bytes())
    }

    #[test]
    fn a_chat_request_reads_the_fields_users_send() {
        let r = chat(
            r#"{"model": "x", "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": null}],
              "max_completion_tokens": 7, "max_tokens": 3, "temperature": 0, "top_p": 0.5,
              "top_k": 4, "seed": -1, "stop": ["a", "", "b"], "stream": true,
              "stream_options": {"include_usage": true}, "logprobs": true, "top_logprobs": 3,
              "n": 1, "presence_penalty": 0, "tools": [], "unknown": {"x": 1}}"#,
        )
        .unwrap();
        assert_eq!(
            r.prompt,
            Prompt::Chat(vec![
                Message {
                    role: "system".into(),
                    content: "be brief".into()
                },
                Message {
                    role: "user".into(),
                    content: "hi there".into()
                },
                Message {
                    role: "assistant".into(),
                    content: "".into()
                },
            ])
        );
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!(
            (r.temperature, r.top_p, r.top_k),
            (Some(0.0), Some(0.5), Some(4))
        );
        assert_eq!(r.seed, Some(u64::MAX));
        assert_eq!(r.stop, ["a", "b"]);
        assert!(r.stream && r.include_usage);
        assert_eq!(r.logprobs, Some(3));
    }

    #[test]
    fn bad_fields_are_400s_naming_them() {
        for (body, param) in [
            (r#"{"messages": "hi"}"#, "messages"),
            (r#"{"messages": []}"#, "messages"),
            (r#"{}"#, "messages"),
            (r#"{"messages": [{"content": "x"}]}"#, "messages[0].role"),
            (
                r#"{"messages": [{"role": "tool", "content": "x"}]}"#,
                "messages[0].role",
            ),
            (
                r#"{"messages": [{"role": "user", "content": 5}]}"#,
                "messages[0].content",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
                "messages[0].content[0].type",
            ),
            (r#"{"messages": [{"role": "user"}], "n": 2}"#, "n"),
            (
                r#"{"messages": [{"role": "user"}], "tools": [{"type": "function"}]}"#,
                "tools",
            ),
            (
                r#"{"messages": [{"role": "user"}], "temperature": "hot"}"#,
                "temperature",
            ),
            (
                r#"{"messages": [{"role": "user"}], "temperature": -1}"#,
                "temperature",
            ),
            (r#"{"messages": [{"role": "user"}], "top_p": 0}"#, "top_p"),
            (
                r#"{"messages": [{"role": "user"}], "max_tokens": 0}"#,
                "max_tokens",
            ),
            (
                r#"{"messages": [{"role": "user"}], "max_tokens": 1.5}"#,
                "max_tokens",
            ),
            (r#"{"messages": [{"role": "user"}], "stop": [1]}"#, "stop"),
            (
                r#"{"messages": [{"role": "user"}], "stream": "yes"}"#,
                "stream",
            ),
            (
                r#"{"messages": [{"role": "user"}], "top_logprobs": 2}"#,
                "top_logprobs",
            ),
            (
                r#"{"messages": [{"role": "user"}], "logprobs": true, "top_logprobs": 99}"#,
                "top_logprobs",
            ),
            (
                r#"{"messages": [{"role": "user"}], "presence_penalty": 0.5}"#,
                "presence_penalty",
            ),
            (
                r#"{"messages": [{"role": "user"}], "response_format": {"type": "json_object"}}"#,
                "response_format",
            ),
        ] {
            let e = chat(body).unwrap_err();
            assert_eq!(
                (e.status, e.param.as_deref()),
                (400, Some(param)),
                "{body}: {e:?}"
            );
        }
        for body in ["", "{", "[1]", "null", "\"x\""] {
            let e = chat(body).unwrap_err();
            assert_eq!((e.status, e.param), (400, None), "{body}");
        }
    }

    #[test]
    fn completion_prompts_are_one_text_or_token_ids() {
        let p = |b: &str| completion_request(b.as_bytes()).map(|r| r.prompt);
        assert_eq!(p(r#"{"prompt": "hi"}"#), Ok(Prompt::Text("hi".into())));
        assert_eq!(p(r#"{"prompt": ["hi"]}"#), Ok(Prompt::Text("hi".into())));
        assert_eq!(p(r#"{"prompt": [1, 2]}"#), Ok(Prompt::Tokens(vec![1, 2])));
        assert_eq!(p(r#"{"prompt": [[3]]}"#), Ok(Prompt::Tokens(vec![3])));
        for b in [
            r#"{"prompt": ["a", "b"]}"#,
            r#"{"prompt": []}"#,
            r#"{"prompt": [-1]}"#,
            r#"{}"#,
        ] {
            assert_eq!(p(b).unwrap_err().param.as_deref(), Some("prompt"), "{b}");
        }
        let r = completion_request(br#"{"prompt": "x", "logprobs": 2, "echo": false}"#).unwrap();
        assert_eq!(r.logprobs, Some(2));
        let e = completion_request(br#"{"prompt": "x", "echo": true}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("echo"));
    }

    #[test]
    fn errors_have_openais_shape() {
        let e = ApiError::invalid("n", "no").with_code("bad");
        assert_eq!(
            e.body(),
            json!({"error": {"message": "no", "type": "invalid_request_error", "param": "n", "code": "bad"}})
        );
    }
}
