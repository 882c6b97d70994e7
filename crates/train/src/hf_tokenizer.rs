//! Hugging Face tokenizers: `tokenizer.json` through the `tokenizers` crate, the special tokens
//! and the chat template of `tokenizer_config.json` (or `chat_template.jinja`), the template
//! rendered by `minijinja` set up as transformers sets up Jinja.
//!
//! The files are kept verbatim ([`HfTokenizerFiles`]): a token file or checkpoint stores them,
//! so a run resumes on a machine that never had the model directory, and `snug export` can
//! write them back byte for byte.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::TrainError;

/// The tokenizer itself: model, pre-tokenizer, added tokens.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// Special tokens and the chat template, as transformers saves them.
pub const CONFIG_FILE: &str = "tokenizer_config.json";
/// Where transformers 4.47 and later save the chat template; it wins over the config's.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
/// The most snug reads of one tokenizer file (Llama 3's `tokenizer.json` is about 9 MB).
const MAX_TOKENIZER_BYTES: u64 = 256 << 20;
/// The template's name in the environment, shown in minijinja's error locations.
const TEMPLATE_NAME: &str = "chat_template";

/// The files a Hugging Face tokenizer is built from, as read: what token files and checkpoints
/// store to rebuild it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HfTokenizerFiles {
    pub tokenizer_json: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_config_json: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_jinja: Option<String>,
}

/// A special token of `tokenizer_config.json` and its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialToken {
    pub text: String,
    pub id: u32,
}

/// The special tokens `tokenizer_config.json` names (each may be absent).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<SpecialToken>,
    pub eos: Option<SpecialToken>,
    pub pad: Option<SpecialToken>,
    pub unk: Option<SpecialToken>,
}

/// A Hugging Face tokenizer with its special tokens and chat template. Cheap to clone.
#[derive(Clone)]
pub struct HfTokenizer(Arc<Inner>);

/// Byte ranges of tokens in the text they were encoded from.
pub type Offsets = Vec<(usize, usize)>;

/// Behind one pointer, so a [`crate::Tokenizer`] (held by every token file) stays small.
struct Inner {
    files: HfTokenizerFiles,
    /// Where the files came from, for error messages (empty when rebuilt from a spec).
    dir: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    vocab_size: usize,
    special: SpecialTokens,
    /// The compiled template and the file it came from.
    chat: Option<(Environment<'static>, PathBuf)>,
}

impl PartialEq for HfTokenizer {
    fn eq(&self, other: &Self) -> bool {
        self.0.files == other.0.files
    }
}

impl Eq for HfTokenizer {}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("dir", &self.0.dir)
            .field("vocab_size", &self.0.vocab_size)
            .field("special", &self.0.special)
            .field("chat_template", &self.0.chat.is_some())
            .finish()
    }
}

fn file_error(path: &Path, field: Option<&str>, detail: impl Into<String>) -> TrainError {
    TrainError::HfTokenizerFile {
        path: path.to_path_buf(),
        field: field.map(str::to_string),
        detail: detail.into(),
    }
}

/// The file at `path` if it exists, as text; any other failure is an error naming it.
fn read_optional(path: &Path) -> Result<Option<String>, TrainError> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        _ => crate::user_file::read_text(path, MAX_TOKENIZER_BYTES, "a tokenizer file").map(Some),
    }
}

impl HfTokenizer {
    /// `dir/tokenizer.json` (required) with `tokenizer_config.json` and `chat_template.jinja`
    /// beside it where they exist.
    pub fn from_dir(dir: &Path) -> Result<HfTokenizer, TrainError> {
        HfTokenizer::from_file(&dir.join(TOKENIZER_FILE))
    }

    /// The `tokenizer.json` at `path`, with `tokenizer_config.json` and `chat_template.jinja`
    /// from the same directory where they exist (without them: no special tokens beyond the
    /// tokenizer's own, no chat template).
    pub fn from_file(path: &Path) -> Result<HfTokenizer, TrainError> {
        let tokenizer_json = crate::user_file::read_text(path, MAX_TOKENIZER_BYTES, "a tokenizer")?;
        let dir = match path.parent() {
            Some(d) => d.to_path_buf(),
            None => PathBuf::new(),
        };
        let files = HfTokenizerFiles {
            tokenizer_json,
            tokenizer_config_json: read_optional(&dir.join(CONFIG_FILE))?,
            chat_template_jinja: read_optional(&dir.join(CHAT_TEMPLATE_FILE))?,
        };
        // Errors name the file given, which need not be called tokenizer.json.
        HfTokenizer::from_files_named(files, path, &dir)
    }

    /// The tokenizer `files` describe; `dir` only names the files in errors.
    pub fn from_files(files: HfTokenizerFiles, dir: &Path) -> Result<HfTokenizer, TrainError> {
        HfTokenizer::from_files_named(files, &dir.join(TOKENIZER_FILE), dir)
    }

    /// [`Self::from_files`], naming the tokenizer file `tok_path` and the others in `dir`.
    fn from_files_named(
        files: HfTokenizerFiles,
        tok_path: &Path,
        dir: &Path,
    ) -> Result<HfTokenizer, TrainError> {
        let tok_path = tok_path.to_path_buf();
        let inner: tokenizers::Tokenizer = files
            .tokenizer_json
            .parse()
            .map_err(|e| file_error(&tok_path, None, format!("not a tokenizer: {e}")))?;
        // Ids may have gaps: the size that holds every id is the largest plus one.
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        if vocab_size == 0 {
            return Err(file_error(&tok_path, Some("model.vocab"), "is empty"));
        }
        let config_path = dir.join(CONFIG_FILE);
        let config: Option<serde_json::Map<String, Json>> = match &files.tokenizer_config_json {
            None => None,
            Some(text) => match serde_json::from_str(text) {
                Ok(Json::Object(map)) => Some(map),
                Ok(_) => return Err(file_error(&config_path, None, "is not a JSON object")),
                Err(e) => return Err(file_error(&config_path, None, format!("not JSON: {e}"))),
            },
        };
        let special_token = |field: &str| -> Result<Option<SpecialToken>, TrainError> {
            let Some(value) = config.as_ref().and_then(|c| c.get(field)) else {
                return Ok(None);
            };
            // A string, or (older files) an AddedToken object with its `content`.
            let text = match value {
                Json::Null => return Ok(None),
                Json::String(s) => s.clone(),
                Json::Object(o) => match o.get("content") {
                    Some(Json::String(s)) => s.clone(),
                    _ => {
                        return Err(file_error(
                            &config_path,
                            Some(field),
                            "is an object without a string `content`",
                        ))
                    }
                },
                other => {
                    return Err(file_error(
                        &config_path,
                        Some(field),
                        format!("is {other}, not a token"),
                    ))
                }
            };
            let id = inner.token_to_id(&text).ok_or_else(|| {
                file_error(
                    &config_path,
                    Some(field),
                    format!(
                        "{text:?} is not in the vocabulary of {}",
                        tok_path.display()
                    ),
                )
            })?;
            Ok(Some(SpecialToken { text, id }))
        };
        let special = SpecialTokens {
            bos: special_token("bos_token")?,
            eos: special_token("eos_token")?,
            pad: special_token("pad_token")?,
            unk: special_token("unk_token")?,
        };
        let template: Option<(String, PathBuf)> = match &files.chat_template_jinja {
            Some(t) => Some((t.clone(), dir.join(CHAT_TEMPLATE_FILE))),
            None => match config.as_ref().and_then(|c| c.get("chat_template")) {
                None | Some(Json::Null) => None,
                Some(Json::String(t)) => Some((t.clone(), config_path.clone())),
                Some(Json::Array(list)) => {
                    let default = list.iter().find_map(|entry| {
                        (entry.get("name")?.as_str()? == "default")
                            .then(|| entry.get("template")?.as_str())
                            .flatten()
                    });
                    match default {
                        Some(t) => Some((t.to_string(), config_path.clone())),
                        None => {
                            return Err(file_error(
                                &config_path,
                                Some("chat_template"),
                                "is a list of named templates without one named \"default\"",
                            ))
                        }
                    }
                }
                Some(other) => {
                    return Err(file_error(
                        &config_path,
                        Some("chat_template"),
                        format!("is {other}, not a template or a list of named templates"),
                    ))
                }
            },
        };
        let chat = match template {
            None => None,
            Some((source, path)) => {
                let env = chat_environment(source).map_err(|e| {
                    file_error(
                        &path,
                        Some("chat_template"),
                        format!("does not compile: {}", template_message(&e)),
                    )
                })?;
                Some((env, path))
            }
        };
        Ok(HfTokenizer(Arc::new(Inner {
            files,
            dir: dir.to_path_buf(),
            tokenizer: inner,
            vocab_size,
            special,
            chat,
        })))
    }

    /// The files this tokenizer was built from, verbatim.
    pub fn files(&self) -> &HfTokenizerFiles {
        &self.0.files
    }

    /// One more than the largest id, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.0.vocab_size
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.0.special
    }

    pub fn has_chat_template(&self) -> bool {
        self.0.chat.is_some()
    }

    /// The vocabulary's string for `id` (byte-level tokens spell a space `Ġ`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.0.tokenizer.id_to_token(id)
    }

    /// Ids of `text`. Added tokens written in the text (`"<|im_end|>"`) become their ids, as in
    /// transformers; `add_special_tokens` runs the tokenizer's post-processor (Llama's adds
    /// `<|begin_of_text|>`).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TrainError> {
        Ok(self.encode_with_offsets(text, add_special_tokens)?.0)
    }

    /// Ids of `text` and each token's byte range in it.
    pub fn encode_with_offsets(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<(Vec<u32>, Offsets), TrainError> {
        let enc = self
            .0
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| TrainError::Tokenizer(format!("encoding {} bytes: {e}", text.len())))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// Text of `ids`. Ids outside the vocabulary become U+FFFD (the `tokenizers` crate would
    /// drop them silently), as do bytes that are not UTF-8.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        let known = |id: u32| {
            (id as usize) < self.0.vocab_size && self.0.tokenizer.id_to_token(id).is_some()
        };
        let mut out = String::new();
        for (i, run) in ids.split(|&id| !known(id)).enumerate() {
            if i > 0 {
                out.push('\u{FFFD}');
            }
            if !run.is_empty() {
                match self.0.tokenizer.decode(run, skip_special_tokens) {
                    Ok(s) => out.push_str(&s),
                    Err(_) => out.push('\u{FFFD}'),
                }
            }
        }
        out
    }

    /// `messages` (objects with a `role` and usually a `content`) rendered by the chat template,
    /// with the generation prompt appended when `add_generation_prompt`. A template that raises
    /// (`raise_exception`) or fails is an error carrying its message.
    pub fn render_chat(
        &self,
        messages: &[Json],
        add_generation_prompt: bool,
    ) -> Result<String, TrainError> {
        let (env, path) = self.0.chat.as_ref().ok_or_else(|| {
            file_error(
                &self.0.dir.join(CONFIG_FILE),
                Some("chat_template"),
                "is missing: this tokenizer has no chat template",
            )
        })?;
        let mut ctx = serde_json::Map::new();
        ctx.insert("messages".into(), Json::Array(messages.to_vec()));
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        for (name, token) in [
            ("bos_token", &self.0.special.bos),
            ("eos_token", &self.0.special.eos),
            ("pad_token", &self.0.special.pad),
            ("unk_token", &self.0.special.unk),
        ] {
            if let Some(t) = token {
                ctx.insert(name.into(), Json::String(t.text.clone()));
            }
        }
        let render = || -> Result<String, minijinja::Error> {
            env.get_template(TEMPLATE_NAME)?
                .render(Value::from(Serde(Json::Object(ctx))))
        };
        render().map_err(|e| TrainError::ChatTemplate {
            path: path.clone(),
            message: template_message(&e),
        })
    }
}

/// The template's own message (`raise_exception`'s argument) where it raised, else minijinja's
/// description with its location.
fn template_message(e: &minijinja::Error) -> String {
    match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(detail)) if detail.starts_with(RAISED) => {
            detail[RAISED.len()..].to_string()
        }
        _ => e.to_string(),
    }
}

/// Marks errors raised by the template itself, to tell them from minijinja's own.
const RAISED: &str = "raise_exception: ";

/// minijinja set up as transformers sets up Jinja for chat templates: `trim_blocks` and
/// `lstrip_blocks`, loop controls, `raise_exception`, Python's string methods (`.strip()`,
/// `.startswith()`), and a `tojson` that writes what Python's `json.dumps` writes. Left out on
/// purpose: `strftime_now` (templates then use their fixed date, so prepared data does not
/// depend on the day it was prepared).
fn chat_environment(source: String) -> Result<Environment<'static>, minijinja::Error> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("{RAISED}{message}"),
            ))
        },
    );
    env.add_filter("tojson", python_tojson);
    env.add_template_owned(TEMPLATE_NAME, source)?;
    Ok(env)
}

/// Jinja's `tojson` as transformers defines it: `json.dumps(value, ensure_ascii=False,
/// indent=indent)`, so `", "` and `": "` separators without indent, and no HTML escaping.
fn python_tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_python_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_python_json(v: &Json, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&Json::String(k.clone()).to_string());
                out.push_str(": ");
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        // Scalars and empty containers: serde_json writes them as Python does.
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tojson(template: &str, ctx: Json) -> String {
        let env = chat_environment(template.to_string()).unwrap();
        env.get_template(TEMPLATE_NAME)
            .unwrap()
            .render(Value::from(Serde(ctx)))
            .unwrap()
    }

    /// Python: `json.dumps({"a": [1, "x<y>&'"], "b": {}, "c": None, "d": "é"}, ensure_ascii=False)`
    /// and the same with `indent=2`.
    #[test]
    fn tojson_writes_what_python_writes() {
        let ctx = serde_json::json!({"v": {"a": [1, "x<y>&'"], "b": {}, "c": null, "d": "é"}});
        assert_eq!(
            tojson("{{ v | tojson }}", ctx.clone()),
            r#"{"a": [1, "x<y>&'"], "b": {}, "c": null, "d": "é"}"#
        );
        assert_eq!(
            tojson("{{ v | tojson(indent=2) }}", ctx),
            "{\n  \"a\": [\n    1,\n    \"x<y>&'\"\n  ],\n  \"b\": {},\n  \"c\": null,\n  \"d\": \"é\"\n}"
        );
    }

    #[test]
    fn python_string_methods_and_loop_controls_work() {
        let out = tojson(
            "{% for m in ms %}{% if m.startswith('skip') %}{% continue %}{% endif %}{{ m.strip() }}|{% endfor %}",
            serde_json::json!({"ms": [" a ", "skip me", "b"]}),
        );
        assert_eq!(out, "a|b|");
    }
}
