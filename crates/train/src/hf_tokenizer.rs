//! Hugging Face tokenizers: `tokenizer.json` through the `tokenizers` crate, the special tokens
//! of `tokenizer_config.json` (and of `special_tokens_map.json` where transformers reads it),
//! the chat template of `tokenizer_config.json` (or `chat_template.jinja`), the template
//! rendered by `minijinja` set up as transformers sets up Jinja.
//!
//! The files are kept verbatim ([`HfTokenizerFiles`]): a token file or checkpoint stores them,
//! so a run resumes on a machine that never had the model directory, and `snug export` can
//! write them back byte for byte.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

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
/// The special tokens as older transformers saved them. transformers 5.24 (as 4.x) reads it
/// only where `tokenizer_config.json` has no `added_tokens_decoder` (or is missing), and then
/// its `bos_token`, `eos_token`, `pad_token` and `unk_token` replace the config's.
pub const SPECIAL_TOKENS_MAP_FILE: &str = "special_tokens_map.json";
/// The most snug reads of one tokenizer file (Llama 3's `tokenizer.json` is about 9 MB).
const MAX_TOKENIZER_BYTES: u64 = 256 << 20;
/// The template's name in the environment, shown in minijinja's error locations.
const TEMPLATE_NAME: &str = "chat_template";
/// Target size of the pieces a long text is encoded in: one `tokenizers` call keeps an
/// `Encoding` (ids, tokens, offsets, masks) and the normalized text with its alignments, about
/// 150 bytes per byte of text, so a whole corpus in one call needs 150 times its size.
const PIECE_BYTES: usize = 256 * 1024;
/// The most pieces encoded at once, each on its own thread with its own working set.
const MAX_PIECE_THREADS: usize = 8;

/// The files a Hugging Face tokenizer is built from, as read: what token files and checkpoints
/// store to rebuild it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HfTokenizerFiles {
    pub tokenizer_json: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_config_json: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_jinja: Option<String>,
    /// `special_tokens_map.json`, kept only where transformers reads it (the config has no
    /// `added_tokens_decoder`): elsewhere it changes nothing, and leaving it out keeps the
    /// files (and a token file's or checkpoint's spec) as they were before snug read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub special_tokens_map_json: Option<String>,
}

/// A special token of `tokenizer_config.json` (or `special_tokens_map.json`) and its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialToken {
    pub text: String,
    pub id: u32,
}

/// The special tokens `tokenizer_config.json` and `special_tokens_map.json` name (each may be
/// absent).
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
    /// How long texts are encoded piece by piece, or why they cannot be; worked out on the
    /// first long text, since it clones the model.
    pieces: OnceLock<Result<PiecePlan, String>>,
    /// The tokenizer without the prefix it adds at the start of a call (None: it adds none),
    /// for a text that continues another; worked out on first use, as `pieces`.
    continuation: OnceLock<Result<Option<tokenizers::Tokenizer>, String>>,
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
    /// `dir/tokenizer.json` (required) with `tokenizer_config.json`, `chat_template.jinja` and
    /// `special_tokens_map.json` beside it where they exist.
    pub fn from_dir(dir: &Path) -> Result<HfTokenizer, TrainError> {
        HfTokenizer::from_file(&dir.join(TOKENIZER_FILE))
    }

    /// The `tokenizer.json` at `path`, with `tokenizer_config.json`, `chat_template.jinja` and
    /// `special_tokens_map.json` from the same directory where they exist (without them: no
    /// special tokens beyond the tokenizer's own, no chat template).
    pub fn from_file(path: &Path) -> Result<HfTokenizer, TrainError> {
        let tokenizer_json = crate::user_file::read_text(path, MAX_TOKENIZER_BYTES, "a tokenizer")?;
        let dir = match path.parent() {
            Some(d) => d.to_path_buf(),
            None => PathBuf::new(),
        };
        let tokenizer_config_json = read_optional(&dir.join(CONFIG_FILE))?;
        // Kept only where transformers reads it: a config that is not a JSON object is
        // refused below, whatever is kept.
        let map_read = match tokenizer_config_json.as_deref().map(serde_json::from_str) {
            Some(Ok(Json::Object(config))) => !config.contains_key("added_tokens_decoder"),
            _ => true,
        };
        let special_tokens_map_json = match map_read {
            true => read_optional(&dir.join(SPECIAL_TOKENS_MAP_FILE))?,
            false => None,
        };
        let files = HfTokenizerFiles {
            tokenizer_json,
            tokenizer_config_json,
            chat_template_jinja: read_optional(&dir.join(CHAT_TEMPLATE_FILE))?,
            special_tokens_map_json,
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
        // transformers reads special_tokens_map.json only where the config has no
        // `added_tokens_decoder` (files saved before 4.34), and then each token it names
        // replaces the config's, a null one included.
        let map_path = dir.join(SPECIAL_TOKENS_MAP_FILE);
        let map_read = config
            .as_ref()
            .is_none_or(|c| !c.contains_key("added_tokens_decoder"));
        let map: Option<serde_json::Map<String, Json>> =
            match (&files.special_tokens_map_json, map_read) {
                (Some(text), true) => match serde_json::from_str(text) {
                    Ok(Json::Object(map)) => Some(map),
                    Ok(_) => return Err(file_error(&map_path, None, "is not a JSON object")),
                    Err(e) => return Err(file_error(&map_path, None, format!("not JSON: {e}"))),
                },
                _ => None,
            };
        let special_token = |field: &str| -> Result<Option<SpecialToken>, TrainError> {
            let from_map = map.as_ref().and_then(|m| m.get(field));
            let (value, path) = match from_map {
                Some(v) => (Some(v), &map_path),
                None => (config.as_ref().and_then(|c| c.get(field)), &config_path),
            };
            let Some(value) = value else {
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
                            path,
                            Some(field),
                            "is an object without a string `content`",
                        ))
                    }
                },
                other => {
                    return Err(file_error(
                        path,
                        Some(field),
                        format!("is {other}, not a token"),
                    ))
                }
            };
            let id = inner.token_to_id(&text).ok_or_else(|| {
                file_error(
                    path,
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
            pieces: OnceLock::new(),
            continuation: OnceLock::new(),
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
    /// `<|begin_of_text|>`). A long text without special tokens added is encoded in pieces cut
    /// at line ends where that gives the ids of one call (see [`PiecePlan`]), so memory follows
    /// the ids rather than the text.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TrainError> {
        if !add_special_tokens && text.len() > 2 * PIECE_BYTES {
            if let Some(ids) = self.encode_in_pieces(text, PIECE_BYTES)? {
                return Ok(ids);
            }
        }
        let enc = self
            .0
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| encode_error(text, e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Ids of `text` where it follows `before` in one text: the ids `encode(before + text)`
    /// gives after `encode(before)`'s where those are its start (the boundary is a token
    /// boundary, as transformers' trainers assume of a prompt and its completion); else `text`
    /// encoded alone without the prefix a call adds at its start (SentencePiece's `▁`), which
    /// is not in the data. Without special tokens added.
    pub fn encode_continuation(&self, before: &str, text: &str) -> Result<Vec<u32>, TrainError> {
        let head = self.encode(before, false)?;
        let whole = self.encode(&format!("{before}{text}"), false)?;
        if let Some(tail) = whole.strip_prefix(head.as_slice()) {
            return Ok(tail.to_vec());
        }
        let plain = self
            .0
            .continuation
            .get_or_init(|| continuation_tokenizer(&self.0.tokenizer))
            .as_ref()
            .map_err(|why| {
                TrainError::Tokenizer(format!(
                    "{text:?} does not start on a token boundary after {before:?}, and it cannot \
                     be encoded apart without the tokenizer's start-of-text prefix: {why}"
                ))
            })?;
        let tokenizer = plain.as_ref().unwrap_or(&self.0.tokenizer);
        let enc = tokenizer
            .encode_fast(text, false)
            .map_err(|e| encode_error(text, e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Why a long text is encoded in one call rather than in pieces, if it is (a text may still
    /// be encoded whole when it has no place to cut, or holds an added token where the
    /// tokenizer restarts its prefix after each).
    pub fn whole_text_reason(&self) -> Option<&str> {
        self.piece_plan().err()
    }

    fn piece_plan(&self) -> Result<&PiecePlan, &str> {
        self.0
            .pieces
            .get_or_init(|| PiecePlan::new(&self.0.tokenizer))
            .as_ref()
            .map_err(String::as_str)
    }

    /// `text`'s ids from pieces of about `target` bytes encoded apart, or None when this
    /// tokenizer or this text must be encoded whole.
    fn encode_in_pieces(&self, text: &str, target: usize) -> Result<Option<Vec<u32>>, TrainError> {
        let Ok(plan) = self.piece_plan() else {
            return Ok(None);
        };
        if plan.prefix_per_segment && plan.added.iter().any(|a| text.contains(a.as_str())) {
            return Ok(None);
        }
        let pieces = line_pieces(text, target);
        if pieces.len() < 2 {
            return Ok(None);
        }
        let rest = plan.rest.as_ref().unwrap_or(&self.0.tokenizer);
        let encode = |first: bool, piece: &str| -> Result<Vec<u32>, TrainError> {
            let tokenizer = if first { &self.0.tokenizer } else { rest };
            let enc = tokenizer
                .encode_fast(piece, false)
                .map_err(|e| encode_error(piece, e))?;
            Ok(enc.get_ids().to_vec())
        };
        // Rounds of one piece per thread, appended in order to one vector, sized after the
        // first round from its ids per byte so it does not double past the ids it holds.
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, MAX_PIECE_THREADS);
        let mut ids: Vec<u32> = Vec::new();
        let mut done_bytes = 0;
        for (round, batch) in pieces.chunks(threads).enumerate() {
            let parts: Vec<Result<Vec<u32>, TrainError>> = std::thread::scope(|s| {
                let handles: Vec<_> = batch
                    .iter()
                    .enumerate()
                    .map(|(k, &piece)| s.spawn(move || encode(round + k == 0, piece)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(TrainError::Tokenizer("an encoding thread panicked".into()))
                        })
                    })
                    .collect()
            });
            for part in parts {
                ids.extend(part?);
            }
            done_bytes += batch.iter().map(|p| p.len()).sum::<usize>();
            if round == 0 {
                let estimate = ids.len() as f64 / done_bytes as f64 * text.len() as f64 * 1.05;
                ids.reserve((estimate as usize).saturating_sub(ids.len()));
            }
        }
        Ok(Some(ids))
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
            .map_err(|e| encode_error(text, e))?;
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
        // transformers 5 leaves a message's null fields out (an assistant turn of `tool_calls`
        // has `"content": null`): a template sees them undefined, not as `None` to print.
        let messages = messages
            .iter()
            .map(|m| match m {
                Json::Object(fields) => Json::Object(
                    fields
                        .iter()
                        .filter(|(_, v)| !v.is_null())
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect(),
                ),
                other => other.clone(),
            })
            .collect();
        let mut ctx = serde_json::Map::new();
        ctx.insert("messages".into(), Json::Array(messages));
        // transformers passes both, None without tools or documents: defined, and none.
        ctx.insert("tools".into(), Json::Null);
        ctx.insert("documents".into(), Json::Null);
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

fn encode_error(text: &str, e: tokenizers::Error) -> TrainError {
    TrainError::Tokenizer(format!("encoding {} bytes: {e}", text.len()))
}

/// Cuts `text` into pieces of at least `target` bytes (except the last), each cut right after a
/// line break that has a printable ASCII character on either side (`b"x\ny"`). Such a line
/// break is one pre-token of its own under the regexes [`PiecePlan`] accepts, and a symbol no
/// merge joins under the models it accepts otherwise; the ASCII neighbours stay outside
/// whitespace under the normalizers it accepts. ASCII bytes never occur inside a multi-byte
/// character, so every cut is a character boundary.
fn line_pieces(text: &str, target: usize) -> Vec<&str> {
    let b = text.as_bytes();
    let mut pieces = Vec::new();
    let mut start = 0;
    for i in 1..b.len().saturating_sub(1) {
        if b[i] == b'\n'
            && i + 1 - start >= target
            && b[i - 1].is_ascii_graphic()
            && b[i + 1].is_ascii_graphic()
        {
            pieces.push(&text[start..=i]);
            start = i + 1;
        }
    }
    pieces.push(&text[start..]);
    pieces
}

/// Pre-tokenizer regexes under which a line break between printable characters is a pre-token
/// of its own in the left piece as in the whole text, and the right piece starts a match:
/// GPT-2's (ByteLevel's own), Llama 3's, and Qwen2's. In GPT-2's, `\s+(?!\S)` at the end of
/// the left piece and `\s+` in the whole both match just the `\n`; in the others,
/// `\s*[\r\n]+` or the `[\r\n]*` after punctuation ends the match at the `\n` either way. None
/// looks behind, so matching after the cut starts afresh as it does in the whole text.
const LINE_SAFE_REGEXES: [&str; 3] = [
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// Where a tokenizer adds a prefix (`▁` or a space) that one call adds once.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Prefix {
    None,
    /// Only at the start of the text (Metaspace's `prepend_scheme: first`).
    First,
    /// At the start of every stretch between added tokens (a `Prepend` normalizer, Metaspace's
    /// `always`, ByteLevel's `add_prefix_space`).
    PerSegment,
}

/// `tokenizer`'s normalizers and pre-tokenizers, each list flattened, with the prefix a call
/// adds at its start taken out (a `Prepend` normalizer dropped, ByteLevel's
/// `add_prefix_space` and Metaspace's `prepend_scheme` off), and where the prefix was added.
/// An error where the prefix cannot be taken out alone.
fn prefix_free_stages(
    tokenizer: &tokenizers::Tokenizer,
) -> Result<(Prefix, Vec<Json>, Vec<Json>), String> {
    fn to_json<T: Serialize>(v: Option<&T>) -> Result<Json, String> {
        v.map_or(Ok(Json::Null), |v| {
            serde_json::to_value(v).map_err(|e| e.to_string())
        })
    }
    let mut prefix = Prefix::None;
    let mut normalizers = Vec::new();
    flatten(
        &to_json(tokenizer.get_normalizer())?,
        "normalizers",
        &mut normalizers,
    );
    normalizers.retain(|n| {
        let prepends = n["type"] == "Prepend";
        if prepends {
            prefix = prefix.max(Prefix::PerSegment);
        }
        !n.is_null() && !prepends
    });
    let mut pre = Vec::new();
    flatten(
        &to_json(tokenizer.get_pre_tokenizer())?,
        "pretokenizers",
        &mut pre,
    );
    pre.retain(|p| !p.is_null());
    for (i, p) in pre.iter_mut().enumerate() {
        match p["type"].as_str().unwrap_or("") {
            "ByteLevel" if p["add_prefix_space"] == Json::Bool(true) => {
                if i != 0 {
                    return Err(
                        "its ByteLevel pre-tokenizer adds a space to every pre-token".into(),
                    );
                }
                prefix = prefix.max(Prefix::PerSegment);
                p["add_prefix_space"] = Json::Bool(false);
            }
            "Metaspace" => {
                let scheme = p["prepend_scheme"].as_str().unwrap_or("").to_string();
                match scheme.as_str() {
                    "never" => {}
                    "first" => prefix = prefix.max(Prefix::First),
                    "always" if i == 0 => prefix = prefix.max(Prefix::PerSegment),
                    _ => return Err(format!("its Metaspace pre-tokenizer prepends {scheme:?} after other pre-tokenizers")),
                }
                p["prepend_scheme"] = "never".into();
            }
            _ => {}
        }
    }
    Ok((prefix, normalizers, pre))
}

/// `tokenizer` with `normalizers` and `pre_tokenizers` (flattened lists) as its stages.
fn with_stages(
    tokenizer: &tokenizers::Tokenizer,
    normalizers: Vec<Json>,
    pre_tokenizers: Vec<Json>,
) -> Result<tokenizers::Tokenizer, String> {
    let normalizer: Option<tokenizers::NormalizerWrapper> =
        serde_json::from_value(sequence("normalizers", normalizers)).map_err(|e| e.to_string())?;
    let pre_tokenizer: Option<tokenizers::PreTokenizerWrapper> =
        serde_json::from_value(sequence("pretokenizers", pre_tokenizers))
            .map_err(|e| e.to_string())?;
    let mut out = tokenizer.clone();
    out.with_normalizer(normalizer).map_err(|e| e.to_string())?;
    out.with_pre_tokenizer(pre_tokenizer);
    Ok(out)
}

/// The tokenizer that encodes a text as it is encoded after other text in one call: without
/// the prefix added at the start of a call (None where there is none).
fn continuation_tokenizer(
    tokenizer: &tokenizers::Tokenizer,
) -> Result<Option<tokenizers::Tokenizer>, String> {
    match prefix_free_stages(tokenizer)? {
        (Prefix::None, ..) => Ok(None),
        (_, normalizers, pre) => with_stages(tokenizer, normalizers, pre).map(Some),
    }
}

/// How a tokenizer encodes a text in pieces cut by [`line_pieces`] to exactly the ids of one
/// call, found from its configuration; a tokenizer outside what is checked here is encoded
/// whole. Every stage must treat the cut alike:
/// - added tokens: none holds a line break (so none spans a cut) or strips whitespace to its
///   left (it would eat the line break before a cut);
/// - normalizer: character by character, keeping a line break and not turning printable ASCII
///   into whitespace (Unicode normal forms, lowercase, accent stripping, plain replacements,
///   `Prepend`);
/// - pre-tokenizer: splits at the line break (a [`LINE_SAFE_REGEXES`] regex, whitespace
///   splitting), or does not split there and the model is a BPE whose line break symbol no
///   merge joins (SentencePiece's Llama and Mistral: no pre-tokenizer or Metaspace);
/// - the prefix added at the start of a call: pieces after the first are encoded by a copy of
///   the tokenizer that adds none;
/// - truncation and padding would apply to each piece, so none may be set.
struct PiecePlan {
    /// Encodes every piece after the first: the tokenizer without its start-of-text prefix
    /// (None: it adds none, so the tokenizer itself).
    rest: Option<tokenizers::Tokenizer>,
    /// The prefix also follows every added token, which `rest` would leave out: a text that
    /// holds one is encoded whole.
    prefix_per_segment: bool,
    /// The added tokens' contents, to look for when `prefix_per_segment`.
    added: Vec<String>,
}

/// The parts of a `Sequence` (normalizers or pre-tokenizers), flattened; a lone part is itself.
fn flatten(v: &Json, list_key: &str, out: &mut Vec<Json>) {
    match (v["type"].as_str(), v[list_key].as_array()) {
        (Some("Sequence"), Some(parts)) => parts.iter().for_each(|p| flatten(p, list_key, out)),
        _ => out.push(v.clone()),
    }
}

fn sequence(type_key: &str, parts: Vec<Json>) -> Json {
    match parts.len() {
        0 => Json::Null,
        _ => serde_json::json!({ "type": "Sequence", type_key: parts }),
    }
}

impl PiecePlan {
    /// The plan for `tokenizer`, or why it must encode texts whole. Works on the serialized
    /// stages, where every default is spelled out.
    fn new(tokenizer: &tokenizers::Tokenizer) -> Result<PiecePlan, String> {
        if tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some() {
            return Err("it truncates or pads what it encodes".into());
        }
        let mut added = Vec::new();
        let mut normalized_added = false;
        for t in tokenizer.get_added_tokens_decoder().values() {
            if t.lstrip {
                return Err(format!(
                    "its added token {:?} strips the whitespace before it",
                    t.content
                ));
            }
            if t.content.contains('\n') {
                return Err(format!(
                    "its added token {:?} holds a line break",
                    t.content
                ));
            }
            normalized_added |= t.normalized;
            added.push(t.content.clone());
        }
        // Pieces after the first are encoded without the prefix a call adds at its start.
        let (prefix, normalizers, mut pre) = prefix_free_stages(tokenizer)?;
        for n in &normalizers {
            match n["type"].as_str().unwrap_or("") {
                "NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase" | "StripAccents" => {}
                "Replace" => {
                    let (Some(pattern), Some(content)) =
                        (n["pattern"]["String"].as_str(), n["content"].as_str())
                    else {
                        return Err("its Replace normalizer has a regex".into());
                    };
                    // No match spans a line break; whitespace appears only for whitespace; and
                    // no printable character vanishes (one before a cut would leave the line
                    // break beside whatever preceded it).
                    let blank = |s: &str| s.chars().all(char::is_whitespace);
                    if pattern.is_empty()
                        || pattern.contains('\n')
                        || content.contains('\n')
                        || (!blank(pattern) && content.chars().any(char::is_whitespace))
                        || (!blank(pattern) && content.is_empty())
                    {
                        return Err(format!("its Replace normalizer of {pattern:?} by {content:?} may act across a line break"));
                    }
                }
                other => {
                    return Err(format!(
                        "its {other} normalizer is not one checked for cutting at line ends"
                    ))
                }
            }
        }

        // Whether every cut is a pre-token boundary, and the line break as the model sees it.
        let (mut splits, mut newline) = (false, '\n');
        let count = pre.len();
        for (i, p) in pre.iter_mut().enumerate() {
            let kind = p["type"].as_str().unwrap_or("").to_string();
            // ByteLevel and Metaspace change characters, which the stages after them would see.
            let maps_chars = matches!(kind.as_str(), "ByteLevel" | "Metaspace");
            if maps_chars && i + 1 != count {
                return Err(format!("its {kind} pre-tokenizer is followed by others"));
            }
            match kind.as_str() {
                "Whitespace" | "WhitespaceSplit" | "BertPreTokenizer" => splits = true,
                "Split" => {
                    if p["invert"] != Json::Bool(false) {
                        return Err("its Split pre-tokenizer is inverted".into());
                    }
                    match (&p["pattern"]["Regex"], &p["pattern"]["String"]) {
                        (Json::String(re), _)
                            if LINE_SAFE_REGEXES.contains(&re.as_str())
                                && p["behavior"] == "Isolated" =>
                        {
                            splits = true
                        }
                        // A plain string without a line break neither spans nor makes a cut.
                        (_, Json::String(s)) if !s.is_empty() && !s.contains('\n') => {}
                        _ => return Err("its Split pre-tokenizer's pattern is not one checked for cutting at line ends".into()),
                    }
                }
                "ByteLevel" => {
                    splits |= p["use_regex"] == Json::Bool(true);
                    newline = 'Ċ';
                }
                "Metaspace" => {}
                other => {
                    return Err(format!(
                        "its {other} pre-tokenizer is not one checked for cutting at line ends"
                    ))
                }
            }
        }

        match tokenizer.get_model() {
            tokenizers::models::ModelWrapper::BPE(bpe) => Self::check_bpe(bpe, splits, newline)?,
            // Other models see one pre-token at a time and are deterministic.
            _ if splits => {}
            _ => return Err("nothing splits at line ends and its model is not a BPE".into()),
        }
        PiecePlan::finish(tokenizer, prefix, normalizers, pre, added, normalized_added)
    }

    /// Whether a BPE's ids for a text cut after line breaks are those of the whole text:
    /// deterministic, and where no pre-tokenizer splits there, a line break stays a symbol of
    /// its own (`newline` as the model sees it).
    fn check_bpe(
        bpe: &tokenizers::models::bpe::BPE,
        splits: bool,
        newline: char,
    ) -> Result<(), String> {
        if bpe.dropout.is_some_and(|d| d > 0.0) {
            return Err("its BPE dropout makes the ids random".into());
        }
        if !splits {
            let set = |s: &Option<String>| s.as_deref().is_some_and(|s| !s.is_empty());
            if set(&bpe.continuing_subword_prefix) || set(&bpe.end_of_word_suffix) {
                return Err(
                    "nothing splits at line ends and its BPE marks where words start or end".into(),
                );
            }
            if bpe.ignore_merges {
                return Err("nothing splits at line ends and its BPE looks whole words up".into());
            }
            // The line break must stay a symbol of its own: merges only build vocabulary
            // tokens, so no token may hold it with anything else.
            let vocab = tokenizers::Model::get_vocab(bpe);
            let nl = newline.to_string();
            if vocab.keys().any(|k| k.contains(newline) && *k != nl) {
                return Err("nothing splits at line ends and its vocabulary joins line breaks to other text".into());
            }
            let known =
                vocab.contains_key(&nl) || (bpe.byte_fallback && vocab.contains_key("<0x0A>"));
            if bpe.fuse_unk && !known {
                return Err(
                    "its line break is an unknown token, fused with unknown neighbours".into(),
                );
            }
        }
        Ok(())
    }

    /// The plan, with `rest` built from the stages as edited to add no prefix.
    fn finish(
        tokenizer: &tokenizers::Tokenizer,
        prefix: Prefix,
        normalizers: Vec<Json>,
        pre_tokenizers: Vec<Json>,
        added: Vec<String>,
        normalized_added: bool,
    ) -> Result<PiecePlan, String> {
        if prefix == Prefix::PerSegment && normalized_added {
            return Err(
                "its prefix follows every added token, some matched only after normalizing".into(),
            );
        }
        let rest = match prefix {
            Prefix::None => None,
            Prefix::First | Prefix::PerSegment => {
                Some(with_stages(tokenizer, normalizers, pre_tokenizers)?)
            }
        };
        Ok(PiecePlan {
            rest,
            prefix_per_segment: prefix == Prefix::PerSegment,
            added,
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
/// `.startswith()`, `.rsplit()`), and a `tojson` that writes what Python's `json.dumps` writes
/// (`indent`, `separators`, `sort_keys`, `ensure_ascii`). Left out on purpose: `strftime_now`
/// (templates then use their fixed date, so prepared data does not depend on the day it was
/// prepared). Not available: Python's `'%s' % x` (minijinja's `%` is numbers' only; the
/// `format` filter and `.format()` are there).
fn chat_environment(source: String) -> Result<Environment<'static>, minijinja::Error> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_unknown_method_callback(
        |state, value, method, args| match (value.as_str(), method) {
            (Some(s), "rsplit") => python_rsplit(s, args),
            _ => minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args),
        },
    );
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
    env.add_template_owned(TEMPLATE_NAME, generation_blocks_as_ifs(&source))?;
    Ok(env)
}

/// transformers' `{% generation %}…{% endgeneration %}` (it marks the assistant's tokens for
/// `return_assistant_tokens_mask`, and renders its body as it is) as `{% if true %}…{% endif %}`,
/// whitespace control kept: snug finds the assistant's tokens by rendering prefixes, so the
/// marks add nothing, and minijinja does not know the statement.
fn generation_blocks_as_ifs(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        let Some(len) = rest[open..].find("%}") else {
            break;
        };
        let tag = &rest[open..open + len + 2];
        let inner = &tag[2..tag.len() - 2];
        let core = inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let replacement = match core {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        out.push_str(&rest[..open]);
        match replacement {
            Some(r) => out.push_str(&tag.replacen(core, r, 1)),
            None => out.push_str(tag),
        }
        rest = &rest[open + len + 2..];
    }
    out.push_str(rest);
    out
}

/// Jinja's `tojson` as transformers defines it: `json.dumps(value, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`, its arguments those of `json.dumps`: so
/// `", "` and `": "` separators without indent (`","` with one), and no HTML escaping.
fn python_tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators.as_deref() {
        None => (if indent.is_some() { "," } else { ", " }, ": "),
        Some([item, key]) => (item.as_str(), key.as_str()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be an (item separator, key separator) pair",
            ))
        }
    };
    let json = serde_json::to_value(value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// How Python's `json.dumps` is asked to write.
struct JsonStyle<'a> {
    indent: Option<usize>,
    item_sep: &'a str,
    key_sep: &'a str,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonStyle<'_> {
    fn write(&self, v: &Json, depth: usize, out: &mut String) {
        let newline = |out: &mut String, depth: usize| {
            if let Some(n) = self.indent {
                out.push('\n');
                out.push_str(&" ".repeat(n * depth));
            }
        };
        match v {
            Json::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    newline(out, depth + 1);
                    self.write(item, depth + 1, out);
                }
                newline(out, depth);
                out.push(']');
            }
            Json::Object(map) if !map.is_empty() => {
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    newline(out, depth + 1);
                    self.scalar(&Json::String(k.clone()), out);
                    out.push_str(self.key_sep);
                    self.write(item, depth + 1, out);
                }
                newline(out, depth);
                out.push('}');
            }
            other => self.scalar(other, out),
        }
    }

    /// Scalars and empty containers, which serde_json writes as Python does; with
    /// `ensure_ascii`, other characters than ASCII as `\uXXXX` (UTF-16, lowercase hex).
    fn scalar(&self, v: &Json, out: &mut String) {
        let text = v.to_string();
        if !self.ensure_ascii || text.is_ascii() {
            out.push_str(&text);
            return;
        }
        for c in text.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{:04x}", u));
                }
            }
        }
    }
}

/// Python's `str.rsplit(sep=None, maxsplit=-1)`, which minijinja's Python methods lack: from
/// the right, at most `maxsplit` cuts; without `sep`, at runs of whitespace, ignoring it at
/// the ends.
fn python_rsplit(s: &str, args: &[Value]) -> Result<Value, minijinja::Error> {
    let (sep, maxsplit, kwargs): (Option<Value>, Option<i64>, Kwargs) =
        minijinja::value::from_args(args)?;
    let sep = match kwargs.get::<Option<Value>>("sep")? {
        Some(v) => Some(v),
        None => sep,
    };
    let maxsplit = kwargs.get::<Option<i64>>("maxsplit")?.or(maxsplit);
    kwargs.assert_all_used()?;
    let max = maxsplit.and_then(|m| usize::try_from(m).ok());
    let sep: Option<String> = match sep {
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => Some(
            v.as_str()
                .ok_or_else(|| {
                    minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "rsplit: sep must be a string",
                    )
                })?
                .to_string(),
        ),
        None => None,
    };
    let mut parts: Vec<&str> = match sep.as_deref() {
        Some("") => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "rsplit: empty separator",
            ))
        }
        Some(sep) => match max {
            Some(m) => s.rsplitn(m + 1, sep).collect(),
            None => s.rsplit(sep).collect(),
        },
        None => {
            let mut parts = Vec::new();
            let mut rest = s.trim_end();
            while !rest.is_empty() {
                if max == Some(parts.len()) {
                    parts.push(rest);
                    break;
                }
                match rest.char_indices().rev().find(|(_, c)| c.is_whitespace()) {
                    Some((at, c)) => {
                        parts.push(&rest[at + c.len_utf8()..]);
                        rest = rest[..at].trim_end();
                    }
                    None => {
                        parts.push(rest);
                        break;
                    }
                }
            }
            parts
        }
    };
    parts.reverse();
    Ok(Value::from(
        parts.into_iter().map(Value::from).collect::<Vec<_>>(),
    ))
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

    /// The byte-level fixture (GPT-2's pre-tokenizer) with merges that join line breaks to
    /// each other and to a space, so cutting a run of them apart would change the ids.
    fn byte_level_json() -> Json {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../nn/tests/fixtures/hf/tokenizer")
            .join(TOKENIZER_FILE);
        let mut json: Json = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let vocab = json["model"]["vocab"].as_object_mut().unwrap();
        let next = vocab.len() as u64 + 3;
        vocab.insert("ĊĊ".into(), next.into());
        vocab.insert("ĠĊ".into(), (next + 1).into());
        let merges = json["model"]["merges"].as_array_mut().unwrap();
        merges.insert(0, serde_json::json!(["Ċ", "Ċ"]));
        merges.insert(0, serde_json::json!(["Ġ", "Ċ"]));
        json
    }

    /// A SentencePiece BPE as Llama 2's `tokenizer.json` writes it: `▁` prepended and standing
    /// for spaces, no pre-tokenizer, byte fallback for the line break.
    fn sentencepiece_json() -> Json {
        let mut vocab = serde_json::Map::new();
        for t in ["<unk>", "<s>", "</s>"] {
            vocab.insert(t.into(), vocab.len().into());
        }
        for b in 0..=255u8 {
            vocab.insert(format!("<0x{b:02X}>"), vocab.len().into());
        }
        let merges = [
            "▁ t",
            "h e",
            "▁t he",
            "▁ a",
            "a n",
            "▁a n",
            "▁an d",
            "i n",
            "▁ ▁",
            "▁▁ ▁",
            "▁ T",
            "▁T he",
            "e r",
            "o u",
            "▁ y",
            "▁y ou",
            "' s",
            "1 2",
        ];
        for c in "▁abcdefghijklmnopqrstuvwxyzTHE.,'!?12é".chars() {
            vocab.insert(c.to_string(), vocab.len().into());
        }
        for m in merges {
            vocab.insert(m.replace(' ', ""), vocab.len().into());
        }
        let added: Vec<Json> = ["<unk>", "<s>", "</s>"]
            .iter()
            .enumerate()
            .map(|(id, t)| {
                serde_json::json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
            "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
                "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": merges}
        })
    }

    fn build(json: &Json) -> HfTokenizer {
        let files = HfTokenizerFiles {
            tokenizer_json: json.to_string(),
            tokenizer_config_json: None,
            chat_template_jinja: None,
            special_tokens_map_json: None,
        };
        HfTokenizer::from_files(files, Path::new("")).unwrap()
    }

    /// Tokenizers of every shape the plan accepts: GPT-2's, Llama 3's, Llama 2's and Mistral's
    /// SentencePiece (a `Prepend` normalizer, or Metaspace first or always), and a byte-level
    /// one that prepends a space.
    fn piecewise_tokenizers() -> Vec<(&'static str, HfTokenizer)> {
        let gpt2 = byte_level_json();
        let mut llama3 = gpt2.clone();
        llama3["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LINE_SAFE_REGEXES[1]}, "behavior": "Isolated",
                "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                "use_regex": false}]});
        llama3["model"]["ignore_merges"] = true.into();
        let mut spaced = gpt2.clone();
        spaced["pre_tokenizer"]["add_prefix_space"] = true.into();
        let llama2 = sentencepiece_json();
        let metaspace = |scheme: &str, split: bool| {
            let mut j = llama2.clone();
            j["normalizer"] = Json::Null;
            j["pre_tokenizer"] = serde_json::json!({"type": "Metaspace", "replacement": "▁",
                "prepend_scheme": scheme, "split": split});
            j
        };
        vec![
            ("gpt2", build(&gpt2)),
            ("llama3", build(&llama3)),
            ("byte-level with a prefix space", build(&spaced)),
            ("llama2", build(&llama2)),
            ("metaspace first", build(&metaspace("first", false))),
            ("metaspace always, split", build(&metaspace("always", true))),
        ]
    }

    /// Random text dense in line breaks with and without whitespace around them, and added
    /// tokens now and then.
    fn lines(rng: &mut rand_chacha::ChaCha8Rng, n: usize, with_added: bool) -> String {
        use rand::Rng;
        let alphabet = [
            "the", "The", "and", "you", "a", " ", " ", "  ", "\n", "\n", "\n", "\n\n", " \n",
            "\n ", "\r\n", "\t", ".", ",", "'s", "12", "12345", "é", "日本", "!", "?", "x\ny", "T",
        ];
        let added = ["<s>", "</s>", "<|im_end|>", "<|endoftext|>"];
        (0..n)
            .map(|_| {
                if with_added && rng.random_range(0..40) == 0 {
                    added[rng.random_range(0..added.len())]
                } else {
                    alphabet[rng.random_range(0..alphabet.len())]
                }
            })
            .collect()
    }

    /// Encoding in pieces gives exactly the ids of one call, for every tokenizer shape and cut
    /// density; texts with added tokens are encoded whole where the prefix follows them.
    #[test]
    fn pieces_encode_to_the_ids_of_the_whole_text() {
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for (name, t) in piecewise_tokenizers() {
            assert_eq!(t.whole_text_reason(), None, "{name}");
            let mut cut = 0;
            for round in 0..30 {
                let text = lines(&mut rng, 300, round % 3 == 0);
                let whole = t.encode_with_offsets(&text, false).unwrap().0;
                for target in [1, 5, 40] {
                    if let Some(ids) = t.encode_in_pieces(&text, target).unwrap() {
                        assert_eq!(ids, whole, "{name}, pieces of {target}: {text:?}");
                        cut += 1;
                    }
                }
            }
            assert!(cut > 40, "{name}: only {cut} texts were cut");
        }
    }

    /// A completion's ids are those it has after its prompt in one text: no SentencePiece `▁`
    /// or byte-level space of its own at its start (a completion "ou" after "and y" is "ou",
    /// not "▁ou"), and where the prompt ends on a token boundary, exactly the joint text's.
    #[test]
    fn a_continuation_is_encoded_as_it_is_after_its_prompt() {
        let tokens = |t: &HfTokenizer, ids: &[u32]| -> Vec<String> {
            ids.iter().map(|&i| t.id_to_token(i).unwrap()).collect()
        };
        for (name, t) in piecewise_tokenizers() {
            for (prompt, completion) in [
                ("and you", " the"),
                ("and you", "the"),
                ("the\n", "The end."),
                ("", "the"),
                ("12", "345"),
            ] {
                let head = t.encode(prompt, false).unwrap();
                let whole = t.encode(&format!("{prompt}{completion}"), false).unwrap();
                let tail = t.encode_continuation(prompt, completion).unwrap();
                if whole.starts_with(&head) {
                    assert_eq!(
                        [head, tail].concat(),
                        whole,
                        "{name}: {prompt:?} + {completion:?}"
                    );
                }
            }
        }
        // Where the prompt's end merges with the completion's start, the completion alone,
        // with no prefix of its own: with Llama 2's `Prepend` the old encoding was `▁` `ou`.
        let llama2 = build(&sentencepiece_json());
        let tail = llama2.encode_continuation("and y", "ou").unwrap();
        assert_eq!(tokens(&llama2, &tail), ["ou"]);
        let tail = llama2.encode_continuation("and you", " the").unwrap();
        assert_eq!(tokens(&llama2, &tail), ["▁the"]);
        assert_eq!(
            tokens(&llama2, &llama2.encode(" the", false).unwrap()),
            ["▁", "▁the"]
        );
    }

    /// A prompt/completion example with Llama 2's tokenizer: the completion's tokens are the
    /// ones the joint text has (`▁the`, not `▁` `▁the`), or where the prompt's end merges
    /// with it, its own without a `▁` of its own (`ou`), and those are what count.
    #[test]
    fn a_completion_example_counts_the_tokens_the_data_has() {
        let files = HfTokenizerFiles {
            tokenizer_json: sentencepiece_json().to_string(),
            tokenizer_config_json: Some(r#"{"eos_token": "</s>"}"#.into()),
            chat_template_jinja: None,
            special_tokens_map_json: None,
        };
        let t = HfTokenizer::from_files(files, Path::new("")).unwrap();
        let tokenizer = crate::Tokenizer::Hf(t.clone());
        for (prompt, completion, counted) in [
            ("and you", " the", vec!["▁the", "</s>"]),
            ("and y", "ou", vec!["ou", "</s>"]),
        ] {
            let ex = crate::examples::tokenize_example(
                &tokenizer,
                &crate::Example::PromptCompletion {
                    prompt: prompt.into(),
                    completion: completion.into(),
                },
            )
            .unwrap();
            let kept: Vec<String> = ex
                .ids
                .iter()
                .zip(&ex.mask)
                .filter(|(_, &m)| m)
                .map(|(&id, _)| t.id_to_token(id).unwrap())
                .collect();
            assert_eq!(kept, counted, "{prompt:?} + {completion:?}");
        }
    }

    /// A long text goes through the pieces by itself.
    #[test]
    fn long_texts_are_encoded_in_pieces() {
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(12);
        let text = lines(&mut rng, 2 * PIECE_BYTES, false);
        assert!(text.len() > 2 * PIECE_BYTES && line_pieces(&text, PIECE_BYTES).len() > 2);
        for (name, t) in piecewise_tokenizers().into_iter().step_by(3) {
            let whole = t.encode_with_offsets(&text, false).unwrap().0;
            assert_eq!(t.encode(&text, false).unwrap(), whole, "{name}");
        }
    }

    #[test]
    fn cuts_fall_after_a_line_break_between_printable_characters() {
        assert_eq!(
            line_pieces("ab\ncd\n\nef \ngh\nij", 1),
            ["ab\n", "cd\n\nef \ngh\n", "ij"]
        );
        assert_eq!(line_pieces("ab\ncd\nef", 4), ["ab\ncd\n", "ef"]);
        assert_eq!(line_pieces("\nab\n", 1), ["\nab\n"]);
        assert_eq!(line_pieces("", 1), [""]);
    }

    /// Stages that could act across a line break, or prefixes the pieces could not reproduce,
    /// keep the tokenizer to whole texts.
    #[test]
    fn unchecked_stages_encode_whole() {
        let refused = |edit: &dyn Fn(&mut Json), why: &str| {
            let mut json = byte_level_json();
            edit(&mut json);
            let reason = build(&json).whole_text_reason().map(str::to_string);
            assert!(
                reason.as_deref().is_some_and(|r| r.contains(why)),
                "{reason:?} lacks {why:?}"
            );
        };
        refused(
            &|j| {
                j["normalizer"] =
                    serde_json::json!({"type": "Strip", "strip_left": true, "strip_right": true})
            },
            "Strip",
        );
        refused(&|j| j["added_tokens"][0]["lstrip"] = true.into(), "strips");
        refused(
            &|j| j["added_tokens"][0]["content"] = "\n\n".into(),
            "line break",
        );
        refused(
            &|j| j["pre_tokenizer"]["use_regex"] = false.into(),
            "joins line breaks",
        );
        refused(
            &|j| {
                j["truncation"] = serde_json::json!({"direction": "Right", "max_length": 8,
            "strategy": "LongestFirst", "stride": 0})
            },
            "truncates",
        );
        // Deleting a printable character can leave a cut's line break beside a space.
        refused(
            &|j| {
                j["normalizer"] = serde_json::json!({"type": "Replace", "pattern": {"String": "`"}, "content": ""})
            },
            "Replace",
        );
        let mut sp = sentencepiece_json();
        sp["model"]["vocab"]["a\nb"] = 999.into();
        assert!(build(&sp).whole_text_reason().is_some());
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
