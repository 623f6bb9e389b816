//! Chat templates: renders a model's Jinja chat template (from `tokenizer_config.json` or the GGUF
//! key `tokenizer.chat_template`) with minijinja, configured like Hugging Face transformers'
//! `apply_chat_template` (trim_blocks, lstrip_blocks, `raise_exception`, `strftime_now`, Python
//! string methods, transformers' `tojson`, insertion-ordered maps, `tools` and `documents`
//! defined as `none`). Models without a template get a built-in ChatML template, and
//! [`ChatTemplate::is_fallback`] says so.
//!
//! The real templates of the families the engine runs render exactly as transformers renders them
//! (tests/chat_templates.rs against tools/gen_chat_template_refs.py's recordings); a chat a
//! template refuses (`raise_exception`, e.g. Gemma's "System role not supported") is a
//! [`ModelError::Template`] carrying the template's message.

use crate::error::{ModelError, Result};
use crate::tokenizer::Tokenizer;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

/// ChatML, used when a model ships no template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A compiled chat template with the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    fallback: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("fallback", &self.fallback)
            .field("source", &self.source)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the texts the template sees (empty if the
    /// model has none).
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self> {
        Self::build(source, bos_token, eos_token, false)
    }

    /// The built-in ChatML template.
    pub fn chatml(bos_token: Option<&str>, eos_token: Option<&str>) -> Self {
        Self::build(CHATML_TEMPLATE, bos_token, eos_token, true)
            .expect("the built-in ChatML template compiles")
    }

    /// The tokenizer's template, or ChatML if it has none.
    pub fn for_tokenizer(tokenizer: &Tokenizer) -> Result<Self> {
        let bos = tokenizer.bos().map(|t| t.text.as_str());
        let eos = tokenizer.eos().map(|t| t.text.as_str());
        match tokenizer.chat_template() {
            Some(source) => Self::new(source, bos, eos),
            None => Ok(Self::chatml(bos, eos)),
        }
    }

    fn build(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
        fallback: bool,
    ) -> Result<Self> {
        let mut env = Environment::new();
        // transformers compiles templates with trim_blocks and lstrip_blocks.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ModelError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, Error> {
                Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("template raised an exception: {msg}"),
                ))
            },
        );
        // transformers replaces Jinja's `tojson` (which escapes HTML characters) with `json.dumps`.
        env.add_filter("tojson", py_tojson);
        env.add_function(
            "strftime_now",
            |format: String| -> std::result::Result<String, Error> {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
                strftime(&format, now.as_secs() as i64)
                    .map_err(|m| Error::new(ErrorKind::InvalidOperation, m))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| template_error("compiling", &e))?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos_token: bos_token.unwrap_or_default().to_string(),
            eos_token: eos_token.unwrap_or_default().to_string(),
            fallback,
        })
    }

    /// Whether this is the built-in ChatML template standing in for a model without one.
    pub fn is_fallback(&self) -> bool {
        self.fallback
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation; `add_generation_prompt` appends the start of the assistant turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_error("loading", &e))?;
        template
            .render(context! {
                messages => minijinja::value::Serde(messages),
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
                // transformers passes these (None without tools or documents) to every template.
                tools => (),
                documents => (),
            })
            .map_err(|e| template_error("rendering", &e))
    }
}

fn template_error(stage: &str, e: &Error) -> ModelError {
    // The alternate form includes the template line and the cause chain.
    let mut msg = format!("{stage}: {e}");
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    ModelError::Template(msg)
}

/// transformers' `tojson` filter: Python's `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, each of those a keyword argument, maps in insertion order.
fn py_tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => " ".repeat(usize::try_from(v.as_i64().unwrap_or(0).max(0)).unwrap_or(0)),
        }),
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v.try_iter()?.map(|p| p.to_string()).collect();
            match <[String; 2]>::try_from(parts) {
                Ok([item, key]) => (item, key),
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be (item_separator, key_separator)",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let opts = JsonOpts {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    write_py_json(value, &opts, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn write_py_json(
    value: &Value,
    opts: &JsonOpts,
    level: usize,
    out: &mut String,
) -> std::result::Result<(), Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &opts.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => match f64::try_from(value.clone()) {
            Ok(f) if f.is_nan() => out.push_str("NaN"),
            Ok(f) if f.is_infinite() => {
                out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" })
            }
            _ => out.push_str(&value.to_string()),
        },
        ValueKind::String => write_py_json_str(value.as_str().unwrap_or_default(), opts, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, level + 1);
                write_py_json(item, opts, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                // json.dumps turns None, bool and number keys into strings.
                let name = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                    ValueKind::None | ValueKind::Bool | ValueKind::Number => {
                        let mut s = String::new();
                        write_py_json(&key, opts, 0, &mut s)?;
                        s
                    }
                    kind => {
                        return Err(Error::new(
                            ErrorKind::InvalidOperation,
                            format!("tojson: keys must be strings or numbers, not {kind}"),
                        ))
                    }
                };
                entries.push((name, value.get_item(&key)?));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (name, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, level + 1);
                write_py_json_str(name, opts, out);
                out.push_str(&opts.key_sep);
                write_py_json(item, opts, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of type {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// A JSON string as Python's `json` module writes it.
fn write_py_json_str(s: &str, opts: &JsonOpts, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (opts.ensure_ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `strftime` in UTC for the codes chat templates use (%Y %m %d %e %H %I %M %S %p %y %b %B %a
/// %A %j %%); `secs` is seconds since the Unix epoch.
pub fn strftime(format: &str, secs: i64) -> std::result::Result<String, String> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (hour, minute, second) = (tod / 3600, tod % 3600 / 60, tod % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let day_of_year = cumulative[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let month_name = MONTHS[(month - 1) as usize];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!(
                "{:02}",
                if hour % 12 == 0 { 12 } else { hour % 12 }
            )),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('%') => out.push('%'),
            Some(other) => return Err(format!("strftime_now: unsupported format code %{other}")),
            None => return Err("strftime_now: format ends with a lone %".to_string()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_fallback_renders_and_says_so() {
        let t = ChatTemplate::chatml(None, None);
        assert!(t.is_fallback());
        let s = t
            .render(
                &[ChatMessage::system("Be brief."), ChatMessage::user("Hi")],
                true,
            )
            .unwrap();
        assert_eq!(s, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
        let s = t.render(&[ChatMessage::user("Hi")], false).unwrap();
        assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n");
    }

    #[test]
    fn hf_features_are_available() {
        // lstrip/trim blocks, bos_token, Python string methods, raise_exception.
        let src = "{{ bos_token }}\n  {% for m in messages %}\n{{ m.role.upper() }}: {{ m.content.strip() }}|\n  {% endfor %}\n{% if messages|length > 2 %}{{ raise_exception('too many') }}{% endif %}";
        let t = ChatTemplate::new(src, Some("<s>"), Some("</s>")).unwrap();
        assert!(!t.is_fallback());
        let out = t
            .render(
                &[ChatMessage::user("  a "), ChatMessage::assistant("b")],
                false,
            )
            .unwrap();
        assert_eq!(out, "<s>\nUSER: a|\nASSISTANT: b|\n");
        let err = t
            .render(
                &[
                    ChatMessage::user("1"),
                    ChatMessage::user("2"),
                    ChatMessage::user("3"),
                ],
                false,
            )
            .unwrap_err();
        assert!(
            matches!(&err, ModelError::Template(m) if m.contains("too many")),
            "{err}"
        );
        assert!(ChatTemplate::new("{% for %}", None, None).is_err());
    }

    #[test]
    fn tojson_is_pythons_json_dumps_and_fails_cleanly() {
        let render = |src: &str| {
            ChatTemplate::new(src, None, None)
                .unwrap()
                .render(&[ChatMessage::user("<a&'b>")], false)
        };
        assert_eq!(
            render("{{ messages|tojson }}|{{ {'z': 1, 'y': [none, true]}|tojson(indent=1) }}")
                .unwrap(),
            "[{\"role\": \"user\", \"content\": \"<a&'b>\"}]|{\n \"z\": 1,\n \"y\": [\n  null,\n  true\n ]\n}"
        );
        // json.dumps raises on these; so does rendering, as an error.
        for src in [
            "{{ nope|tojson }}",
            "{{ 1|tojson(separators=(',',)) }}",
            "{{ 1|tojson(bogus=1) }}",
        ] {
            assert!(matches!(render(src), Err(ModelError::Template(_))), "{src}");
        }
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 13:05:09 UTC, a Friday; day 208 of a leap year.
        let t = 1_722_000_000 + 309;
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %e %H:%M:%S %j %y %I%p %%", t).unwrap(),
            "Friday July 26 13:25:09 208 24 01PM %"
        );
        assert_eq!(strftime("%Y-%m-%d %a", 0).unwrap(), "1970-01-01 Thu");
        assert_eq!(strftime("%Y-%m-%d", 951_782_400).unwrap(), "2000-02-29");
        assert!(strftime("%Q", 0).is_err());
        assert!(
            ChatTemplate::new("{{ strftime_now('%d %b %Y') }}", None, None)
                .unwrap()
                .render(&[], false)
                .unwrap()
                .len()
                >= 10
        );
    }
}
