//! Examples for fine-tuning: JSONL lines of three shapes, each tokenized into ids and a loss
//! mask, and packed into one token stream with their boundaries kept.
//!
//! | line | ids | counts (mask 1) |
//! | --- | --- | --- |
//! | `{"text": T}` | `T` (with the tokenizer's own special tokens, Llama's BOS) then EOS | every token after the first, EOS included |
//! | `{"prompt": P, "completion": C}` | `P` (with special tokens), `C` (without), EOS | `C`'s tokens and EOS |
//! | `{"messages": [...]}` | the chat template's rendering, then EOS unless it already ends with it | each assistant turn as the template renders it, from after its generation prompt to the start of the next message (its end-of-turn token included) |
//!
//! A chat's messages need a string `role` and `content`; a list of text parts is joined (see
//! [`check_messages`]). Other keys on a line are ignored. P is tokenized alone, so the prompt
//! ends on a token boundary and its last token predicts the completion's first; C's ids are
//! those `P + C` gives after P's where P's are their start, else C's own without the prefix a
//! tokenizer adds at the start of a text (see [`crate::HfTokenizer::encode_continuation`]).
//!
//! **The mask belongs to targets.** `mask[j]` says whether token `j`, predicted from the tokens
//! before it, counts in the loss. A window of inputs `ids[s..s + n]` has targets
//! `ids[s + 1..s + n + 1]` and weights `mask[s + 1..s + n + 1]`: the loss at input position `t`
//! is weighted by `mask[s + t + 1]`. An example's first token is always 0: in a packed stream
//! it would be predicted from the previous example's EOS, across the boundary. The EOS that
//! ends a text or a completion counts (the model learns to stop); one appended after a chat
//! rendering does not (the template's end-of-turn already taught that).

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use crate::{Tokenizer, TrainError};

/// One line of a JSONL data file.
#[derive(Debug, Clone, PartialEq)]
pub enum Example {
    Text(String),
    PromptCompletion {
        prompt: String,
        completion: String,
    },
    /// Objects with a string `role` and a string `content` (see [`check_messages`]); the rest
    /// (`tool_calls`, …) is the template's.
    Messages(Vec<Json>),
}

impl Example {
    /// The example a JSONL line holds, or what is wrong with it.
    pub fn from_json_line(line: &str) -> Result<Example, String> {
        let value: Json = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        let Json::Object(mut obj) = value else {
            return Err(format!("{} is not a JSON object", json_kind(&value)));
        };
        let has = |k: &str| obj.contains_key(k);
        let shapes = [
            has("text"),
            has("prompt") || has("completion"),
            has("messages"),
        ];
        match shapes.iter().filter(|&&s| s).count() {
            0 => return Err("has none of `text`, `prompt` + `completion`, `messages`".into()),
            1 => {}
            _ => {
                return Err(
                    "mixes the shapes `text`, `prompt` + `completion` and `messages`; give one"
                        .into(),
                )
            }
        }
        let mut string = |key: &str| match obj.remove(key) {
            Some(Json::String(s)) => Ok(s),
            Some(other) => Err(format!("`{key}` is {}, not a string", json_kind(&other))),
            None => Err(format!("`{key}` is missing")),
        };
        if shapes[0] {
            return Ok(Example::Text(string("text")?));
        }
        if shapes[1] {
            let prompt = string("prompt")?;
            let completion = string("completion")?;
            return Ok(Example::PromptCompletion { prompt, completion });
        }
        let mut messages = match obj.remove("messages") {
            Some(Json::Array(m)) if !m.is_empty() => m,
            Some(Json::Array(_)) => return Err("`messages` is empty".into()),
            Some(other) => return Err(format!("`messages` is {}, not a list", json_kind(&other))),
            None => unreachable!("the shape test found `messages`"),
        };
        check_messages(&mut messages)?;
        Ok(Example::Messages(messages))
    }
}

/// Checks a conversation before a chat template sees it, and puts each `content` in the form
/// templates expect. Templates render whatever they are given: a missing content as an empty
/// turn, a null one as "None", a list of parts as its Python text. So each message must be an
/// object with a string `role` and a string `content` (`""` is an empty turn), except a
/// tool-call turn (a non-empty `tool_calls` list), whose content may be missing or null as
/// OpenAI writes it. A list of text parts (`[{"type": "text", "text": T}, ...]`, the
/// OpenAI / Hugging Face multimodal form) becomes the concatenation of its texts, as templates
/// that accept parts render them; any other part is refused, since a text-only model cannot
/// take it. The error names the message and field, as `messages[1].content`.
pub fn check_messages(messages: &mut [Json]) -> Result<(), String> {
    for (i, m) in messages.iter_mut().enumerate() {
        let Json::Object(m) = m else {
            return Err(format!(
                "`messages[{i}]` is {}, not an object",
                json_kind(m)
            ));
        };
        match m.get("role") {
            Some(Json::String(_)) => {}
            Some(other) => {
                return Err(format!(
                    "`messages[{i}].role` is {}, not a string",
                    json_kind(other)
                ))
            }
            None => return Err(format!("`messages[{i}].role` is missing")),
        }
        let calls_tools = matches!(m.get("tool_calls"), Some(Json::Array(c)) if !c.is_empty());
        let text = match m.get("content") {
            Some(Json::String(_)) => continue,
            None | Some(Json::Null) if calls_tools => continue,
            None => {
                return Err(format!(
                    "`messages[{i}].content` is missing (give a string; \"\" for an empty turn)"
                ))
            }
            Some(Json::Array(parts)) => text_parts(i, parts)?,
            Some(other) => {
                return Err(format!(
                    "`messages[{i}].content` is {}, not a string",
                    json_kind(other)
                ))
            }
        };
        m.insert("content".into(), Json::String(text));
    }
    Ok(())
}

/// The concatenated texts of message `i`'s content `parts`, all of which must be text parts.
fn text_parts(i: usize, parts: &[Json]) -> Result<String, String> {
    const TEXT_PART: &str = r#"{"type": "text", "text": ...}"#;
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let at = format!("messages[{i}].content[{j}]");
        match part.get("type") {
            Some(Json::String(t)) if t == "text" => match part.get("text") {
                Some(Json::String(s)) => text.push_str(s),
                Some(other) => {
                    return Err(format!("`{at}.text` is {}, not a string", json_kind(other)))
                }
                None => return Err(format!("`{at}.text` is missing")),
            },
            Some(Json::String(t)) => {
                return Err(format!(
                    "`{at}` is a part of type \"{t}\": only text parts ({TEXT_PART}) are accepted"
                ))
            }
            _ => return Err(format!("`{at}` is not a text part ({TEXT_PART})")),
        }
    }
    Ok(text)
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "a list",
        Json::Object(_) => "an object",
    }
}

/// Every example of a JSONL text with its line number (from 1); blank lines are skipped.
pub fn parse_jsonl(path: &Path, text: &str) -> Result<Vec<(usize, Example)>, TrainError> {
    let mut out = Vec::new();
    // A byte-order mark (Windows editors write one) is no part of the first line's JSON.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let ex = Example::from_json_line(line).map_err(|detail| TrainError::JsonlLine {
            path: path.to_path_buf(),
            line: i + 1,
            detail,
        })?;
        out.push((i + 1, ex));
    }
    Ok(out)
}

/// An example's ids and, for each, whether it counts as a target (see the module's notes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizedExample {
    pub ids: Vec<u32>,
    pub mask: Vec<bool>,
}

fn eos_of(tokenizer: &Tokenizer) -> Result<u32, TrainError> {
    tokenizer.eos_id().ok_or_else(|| match tokenizer {
        Tokenizer::Hf(t) => TrainError::HfTokenizerFile {
            path: PathBuf::from(crate::hf_tokenizer::CONFIG_FILE),
            field: Some("eos_token".into()),
            detail: format!(
                "is missing: examples end with an end-of-sequence token (vocabulary of {})",
                t.vocab_size()
            ),
        },
        other => TrainError::Tokenizer(format!(
            "the {} tokenizer has no end-of-sequence token to end examples with",
            other.name()
        )),
    })
}

/// `text`'s ids; `first` adds the tokenizer's own special tokens (a Hugging Face
/// post-processor's BOS), as transformers does for a document or a prompt.
fn encode_piece(tokenizer: &Tokenizer, text: &str, first: bool) -> Result<Vec<u32>, TrainError> {
    match tokenizer {
        Tokenizer::Hf(t) => t.encode(text, first),
        other => other.encode(text),
    }
}

/// `example`'s ids and mask.
pub fn tokenize_example(
    tokenizer: &Tokenizer,
    example: &Example,
) -> Result<TokenizedExample, TrainError> {
    let eos = eos_of(tokenizer)?;
    let mut ex = TokenizedExample::default();
    match example {
        Example::Text(text) => {
            ex.ids = encode_piece(tokenizer, text, true)?;
            ex.ids.push(eos);
            ex.mask = vec![true; ex.ids.len()];
        }
        Example::PromptCompletion { prompt, completion } => {
            ex.ids = encode_piece(tokenizer, prompt, true)?;
            ex.mask = vec![false; ex.ids.len()];
            let c = match tokenizer {
                // As the completion is encoded after the prompt in one text (no SentencePiece
                // `▁` of its own at its start, which the data does not have).
                Tokenizer::Hf(t) => t.encode_continuation(prompt, completion)?,
                other => other.encode(completion)?,
            };
            ex.mask.resize(ex.ids.len() + c.len() + 1, true);
            ex.ids.extend(c);
            ex.ids.push(eos);
        }
        Example::Messages(messages) => {
            let Tokenizer::Hf(hf) = tokenizer else {
                return Err(TrainError::Tokenizer(format!(
                    "chat examples need a Hugging Face tokenizer with a chat template, not {}",
                    tokenizer.name()
                )));
            };
            let full = hf.render_chat(messages, false)?;
            let spans = assistant_spans(hf, messages, &full)?;
            let (ids, offsets) = hf.encode_with_offsets(&full, false)?;
            ex.mask = offsets
                .iter()
                .map(|&(start, _)| spans.iter().any(|s| s.contains(&start)))
                .collect();
            ex.ids = ids;
            if ex.ids.last() != Some(&eos) {
                ex.ids.push(eos);
                ex.mask.push(false);
            }
        }
    }
    if let Some(first) = ex.mask.first_mut() {
        *first = false;
    }
    Ok(ex)
}

/// Byte ranges of `full` (the whole conversation rendered) that are assistant turns: for the
/// assistant message `i`, from the end of the rendering of messages `..i` with the generation
/// prompt to the end of the rendering of messages `..=i`. Both must be prefixes of `full`
/// (true of ChatML, Llama, Mistral and Qwen2.5 templates; not of templates that rewrite earlier
/// turns, such as ones dropping earlier reasoning), else the turns cannot be located.
fn assistant_spans(
    hf: &crate::HfTokenizer,
    messages: &[Json],
    full: &str,
) -> Result<Vec<std::ops::Range<usize>>, TrainError> {
    let mut spans = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m.get("role").and_then(Json::as_str) != Some("assistant") {
            continue;
        }
        let not_prefix = |what: &str| {
            TrainError::Tokenizer(format!(
            "the chat template does not render {what} as a prefix of the whole conversation, so the tokens of assistant message {i} cannot be located"
        ))
        };
        let before = if i == 0 {
            // Nothing before: a template may refuse an empty conversation.
            hf.render_chat(&[], true)
                .map_err(|_| not_prefix("an empty conversation"))?
        } else {
            hf.render_chat(&messages[..i], true)?
        };
        let through = hf.render_chat(&messages[..=i], false)?;
        if !through.starts_with(&before) {
            return Err(not_prefix(&format!(
                "messages 0..{i} with the generation prompt"
            )));
        }
        if !full.starts_with(&through) {
            return Err(not_prefix(&format!("messages 0..={i}")));
        }
        spans.push(before.len()..through.len());
    }
    Ok(spans)
}

/// Examples packed into one stream: ids, masks, and where each example starts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PackedExamples {
    pub ids: Vec<u32>,
    pub mask: Vec<bool>,
    /// Index in `ids` of each example's first token, ascending.
    pub starts: Vec<usize>,
}

impl PackedExamples {
    /// `examples` one after the other. Each already ends with EOS (see [`tokenize_example`]),
    /// which sits between it and the next; each one's first token gets mask 0, since predicting
    /// it would cross the boundary.
    pub fn pack(examples: impl IntoIterator<Item = TokenizedExample>) -> PackedExamples {
        let mut p = PackedExamples::default();
        for ex in examples {
            debug_assert_eq!(ex.ids.len(), ex.mask.len());
            if ex.ids.is_empty() {
                continue;
            }
            p.starts.push(p.ids.len());
            p.ids.extend_from_slice(&ex.ids);
            p.mask.push(false);
            p.mask.extend_from_slice(&ex.mask[1..]);
        }
        p
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// How many tokens count in the loss.
    pub fn loss_tokens(&self) -> usize {
        self.mask.iter().filter(|&&m| m).count()
    }

    /// Splits at the example boundary nearest to leaving `val_fraction` of the tokens in the
    /// second part, with at least one example in each; `None` with fewer than two examples.
    pub fn split(mut self, val_fraction: f64) -> Option<(PackedExamples, PackedExamples)> {
        if self.starts.len() < 2 {
            return None;
        }
        let target = self.len() as f64 * (1.0 - val_fraction);
        let k = (1..self.starts.len())
            .min_by(|&a, &b| {
                let da = (self.starts[a] as f64 - target).abs();
                let db = (self.starts[b] as f64 - target).abs();
                da.total_cmp(&db)
            })
            .unwrap_or(1);
        let at = self.starts[k];
        let val = PackedExamples {
            ids: self.ids.split_off(at),
            mask: self.mask.split_off(at),
            starts: self.starts.split_off(k).iter().map(|s| s - at).collect(),
        };
        Some((self, val))
    }
}

/// A JSONL text's examples tokenized (in parallel) and packed. Errors name `path` and the line.
pub fn tokenize_jsonl(
    path: &Path,
    text: &str,
    tokenizer: &Tokenizer,
) -> Result<PackedExamples, TrainError> {
    let examples = parse_jsonl(path, text)?;
    eos_of(tokenizer)?;
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(examples.len().div_ceil(64))
        .max(1);
    let per_thread = examples.len().div_ceil(threads).max(1);
    let tokenize = |group: &[(usize, Example)]| -> Result<Vec<TokenizedExample>, TrainError> {
        group
            .iter()
            .map(|(line, ex)| {
                tokenize_example(tokenizer, ex).map_err(|problem| TrainError::JsonlExample {
                    path: path.to_path_buf(),
                    line: *line,
                    problem: Box::new(problem),
                })
            })
            .collect()
    };
    let parts: Vec<Result<Vec<TokenizedExample>, TrainError>> = std::thread::scope(|s| {
        let handles: Vec<_> = examples
            .chunks(per_thread)
            .map(|group| s.spawn(move || tokenize(group)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(TrainError::Tokenizer("a tokenizing thread panicked".into()))
                })
            })
            .collect()
    });
    let mut tokenized = Vec::with_capacity(examples.len());
    for p in parts {
        tokenized.extend(p?);
    }
    Ok(PackedExamples::pack(tokenized))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(messages: &str) -> Result<Example, String> {
        Example::from_json_line(&format!(r#"{{"messages": {messages}}}"#))
    }

    #[test]
    fn content_must_be_text() {
        let user_then = |content: &str| {
            chat(&format!(
                r#"[{{"role": "user", "content": "hi"}}, {{"role": "assistant"{content}}}]"#
            ))
        };
        for (content, err) in [
            (
                "",
                "`messages[1].content` is missing (give a string; \"\" for an empty turn)",
            ),
            (
                r#", "content": null"#,
                "`messages[1].content` is null, not a string",
            ),
            (
                r#", "content": 4"#,
                "`messages[1].content` is a number, not a string",
            ),
            (
                r#", "content": {"text": "4"}"#,
                "`messages[1].content` is an object, not a string",
            ),
        ] {
            assert_eq!(user_then(content), Err(err.to_string()), "{content}");
        }
        // An empty turn is a turn.
        assert!(user_then(r#", "content": """#).is_ok());
        // A tool-call turn has no text of its own.
        assert!(user_then(r#", "content": null, "tool_calls": [{"type": "function"}]"#).is_ok());
        assert!(user_then(r#", "content": null, "tool_calls": []"#).is_err());
    }

    #[test]
    fn text_parts_are_joined_and_other_parts_refused() {
        let parts = r#"[{"type": "text", "text": "2 + "}, {"type": "text", "text": "2?"}]"#;
        let ex = chat(&format!(r#"[{{"role": "user", "content": {parts}}}]"#)).unwrap();
        let Example::Messages(m) = ex else {
            panic!("a chat: {ex:?}")
        };
        assert_eq!(m[0]["content"], "2 + 2?");
        assert_eq!(m[0]["role"], "user");
        for (content, err) in [
            (
                r#"[{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]"#,
                r#"`messages[0].content[1]` is a part of type "image_url": only text parts ({"type": "text", "text": ...}) are accepted"#,
            ),
            (
                r#"[{"type": "text", "text": null}]"#,
                "`messages[0].content[0].text` is null, not a string",
            ),
            (
                r#"[{"type": "text"}]"#,
                "`messages[0].content[0].text` is missing",
            ),
            (
                r#"["hi"]"#,
                r#"`messages[0].content[0]` is not a text part ({"type": "text", "text": ...})"#,
            ),
        ] {
            let line = format!(r#"[{{"role": "user", "content": {content}}}]"#);
            assert_eq!(chat(&line), Err(err.to_string()), "{content}");
        }
    }

    #[test]
    fn role_must_be_a_string() {
        for (role, err) in [
            ("", "`messages[0].role` is missing"),
            (
                r#""role": null, "#,
                "`messages[0].role` is null, not a string",
            ),
            (
                r#""role": ["user"], "#,
                "`messages[0].role` is a list, not a string",
            ),
        ] {
            let line = format!(r#"[{{{role}"content": "hi"}}]"#);
            assert_eq!(chat(&line), Err(err.to_string()), "{role}");
        }
    }
}
