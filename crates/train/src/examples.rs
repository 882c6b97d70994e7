//! Examples for fine-tuning: JSONL lines of three shapes, each tokenized into ids and a loss
//! mask, and packed into one token stream with their boundaries kept.
//!
//! | line | ids | counts (mask 1) |
//! | --- | --- | --- |
//! | `{"text": T}` | `T` (with the tokenizer's own special tokens, Llama's BOS) then EOS | every token after the first, EOS included |
//! | `{"prompt": P, "completion": C}` | `P` (with special tokens), `C` (without), EOS | `C`'s tokens and EOS |
//! | `{"messages": [...]}` | the chat template's rendering, then EOS unless it already ends with it (whitespace after it allowed) | each assistant turn as the template renders it, from after its generation prompt to the start of the next message (its end-of-turn token included; see [`assistant_turns`]) |
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
//! rendering does not (the template's end-of-turn already taught that). A chat rendering that
//! ends with EOS and whitespace (ChatML's `<|im_end|>\n`) gets none: the template has ended
//! the conversation, and the next example starts with its own start token.

use std::ops::Range;
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
            ex = chat_example(hf, messages, eos, Locate::PrefixesFirst)?;
        }
    }
    if let Some(first) = ex.mask.first_mut() {
        *first = false;
    }
    Ok(ex)
}

/// How [`assistant_turns`] finds the turns: by prefixes where they hold (what snug has always
/// done), or (for tests) by the fallback alone.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Locate {
    PrefixesFirst,
    #[cfg(test)]
    FallbackOnly,
}

/// A conversation's ids and mask (its first token not yet masked out): the rendering, then EOS
/// unless the rendering ends with it already, whitespace after it allowed (ChatML's
/// `<|im_end|>\n` with `<|im_end|>` as EOS: another would put `<|im_end|>\n<|im_end|>` in the
/// training context, which neither transformers' rendering nor TRL has).
fn chat_example(
    hf: &crate::HfTokenizer,
    messages: &[Json],
    eos: u32,
    locate: Locate,
) -> Result<TokenizedExample, TrainError> {
    let full = hf.render_chat(messages, false)?;
    let turns = assistant_turns(hf, messages, &full, locate)?;
    let (ids, offsets) = hf.encode_with_offsets(&full, false)?;
    let mut mask: Vec<bool> = offsets
        .iter()
        .map(|&o| turns.iter().any(|t| t.counts(o)))
        .collect();
    let blank = |&(s, e): &(usize, usize)| full.get(s..e).is_some_and(|t| t.trim().is_empty());
    let last_text = offsets
        .iter()
        .zip(&ids)
        .rev()
        .find(|(o, _)| !blank(o))
        .map(|(_, &id)| id);
    let mut ids = ids;
    if last_text != Some(eos) {
        ids.push(eos);
        mask.push(false);
    }
    Ok(TokenizedExample { ids, mask })
}

/// Where an assistant message lies in the whole rendering: tokens that start in `turn` count,
/// and where the fallback found it, tokens that overlap its `content` too (a SentencePiece
/// `▁word` starts at the space the template puts before the content).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Turn {
    turn: Range<usize>,
    content: Option<Range<usize>>,
}

impl Turn {
    fn counts(&self, (start, end): (usize, usize)) -> bool {
        self.turn.contains(&start)
            || self
                .content
                .as_ref()
                .is_some_and(|c| start < c.end && end > c.start)
    }
}

fn role(m: &Json) -> Option<&str> {
    m.get("role").and_then(Json::as_str)
}

/// The assistant turns of `full` (the whole conversation rendered), in order.
///
/// First by prefixes: for assistant message `i`, from the end of the rendering of messages
/// `..i` with the generation prompt to the end of the rendering of messages `..=i`, where both
/// are prefixes of `full` (ChatML, Llama 2 and 3, Mistral without a system message, Qwen2.5).
///
/// Where they are not (a template that renders a turn by what follows it: Mistral v0.3 puts
/// the system message into the last user turn; `loop.last`, `messages[-1]`; a conversation
/// that starts with an assistant turn, before which there is no conversation to render), the
/// conversation is rendered once more with each assistant content replaced by a marker, which
/// shows where each content lands in `full` (as written, or trimmed as templates trim it).
/// The turn then runs from the text the template puts between the generation prompt and the
/// content (rendering messages `..i` with the prompt and `..=i` with the marker, or else a
/// one-question conversation, shows it) through the text it puts after the content when the
/// message is the last (its end-of-turn: rendering `..=i` with the marker shows it), so it
/// counts what the prefixes count where they hold. A turn whose content is not rendered once
/// as written, or whose end-of-turn here shares nothing with the one it gets as the last
/// message, is refused with the reason.
fn assistant_turns(
    hf: &crate::HfTokenizer,
    messages: &[Json],
    full: &str,
    locate: Locate,
) -> Result<Vec<Turn>, TrainError> {
    let mut turns = Vec::new();
    let mut fallback: Option<Result<Fallback, String>> = None;
    for (i, m) in messages.iter().enumerate() {
        if role(m) != Some("assistant") {
            continue;
        }
        let by_prefix = match locate {
            Locate::PrefixesFirst => prefix_turn(hf, messages, i, full),
            #[cfg(test)]
            Locate::FallbackOnly => Err("the test skips prefixes".into()),
        };
        let not_prefix = match by_prefix {
            Ok(turn) => {
                turns.push(Turn {
                    turn,
                    content: None,
                });
                continue;
            }
            Err(why) => why,
        };
        let located = fallback
            .get_or_insert_with(|| Fallback::new(hf, messages, full))
            .as_ref()
            .map_err(String::clone)
            .and_then(|f| f.turn(hf, messages, i, full));
        turns.push(located.map_err(|why| {
            TrainError::Tokenizer(format!(
                "the tokens of assistant message {i} cannot be located: {not_prefix}; and {why}"
            ))
        })?);
    }
    Ok(turns)
}

/// Assistant message `i`'s turn by prefixes, or why the prefixes do not give it.
fn prefix_turn(
    hf: &crate::HfTokenizer,
    messages: &[Json],
    i: usize,
    full: &str,
) -> Result<Range<usize>, String> {
    let not_prefix = |what: &str| {
        format!("the chat template does not render {what} as a prefix of the whole conversation")
    };
    // Nothing before a first message: a template may refuse an empty conversation.
    let before = hf.render_chat(&messages[..i], true).map_err(|e| match i {
        0 => format!("the chat template does not render an empty conversation (nothing comes before an assistant turn that starts it): {e}"),
        _ => format!("the chat template does not render messages 0..{i} with the generation prompt: {e}"),
    })?;
    let through = hf
        .render_chat(&messages[..=i], false)
        .map_err(|e| format!("the chat template does not render messages 0..={i}: {e}"))?;
    if !through.starts_with(&before) {
        return Err(not_prefix(&format!(
            "messages 0..{i} with the generation prompt"
        )));
    }
    if !full.starts_with(&through) {
        return Err(not_prefix(&format!("messages 0..={i}")));
    }
    Ok(before.len()..through.len())
}

/// Markers that stand for assistant contents in a rendering: `open`, the message's index,
/// `close`, with characters found in no message and not in the rendering.
#[derive(Clone, Copy)]
struct Markers {
    open: char,
    close: char,
}

impl Markers {
    /// Private-use characters none of `texts` holds.
    fn new(texts: &[&str]) -> Option<Markers> {
        [
            ('\u{E000}', '\u{E001}'),
            ('\u{F8F0}', '\u{F8F1}'),
            ('\u{10FFF0}', '\u{10FFF1}'),
        ]
        .into_iter()
        .find(|&(o, c)| texts.iter().all(|t| !t.contains(o) && !t.contains(c)))
        .map(|(open, close)| Markers { open, close })
    }

    fn mark(&self, i: usize) -> String {
        format!("{}{i}{}", self.open, self.close)
    }

    /// Replaces message `i`'s content by its marker, where it has a string content (a
    /// tool-call turn may have none).
    fn replace(&self, messages: &mut [Json], i: usize) {
        if let Some(c @ Json::String(_)) = messages[i].get_mut("content") {
            *c = Json::String(self.mark(i));
        }
    }

    /// `rendered` cut at its markers: the texts between them, and each marker's message.
    fn split<'a>(&self, rendered: &'a str) -> (Vec<&'a str>, Vec<usize>) {
        let (mut texts, mut marked) = (Vec::new(), Vec::new());
        let mut rest = rendered;
        let mut from = 0;
        while let Some(at) = rest[from..].find(self.open).map(|a| a + from) {
            let after = &rest[at + self.open.len_utf8()..];
            let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            let index = after[..digits].parse::<usize>().ok();
            match index.filter(|_| after[digits..].starts_with(self.close)) {
                Some(i) => {
                    texts.push(&rest[..at]);
                    marked.push(i);
                    rest = &after[digits + self.close.len_utf8()..];
                    from = 0;
                }
                None => from = at + self.open.len_utf8(),
            }
        }
        texts.push(rest);
        (texts, marked)
    }
}

/// The fallback's findings for one conversation: where each assistant content lies in the
/// whole rendering, and what a one-question conversation shows of an assistant turn.
struct Fallback {
    markers: Markers,
    /// By message index: the byte ranges of `full` its content was found at.
    contents: Vec<Vec<Range<usize>>>,
    /// The text between the generation prompt and the content, and after the content, in the
    /// conversation `[user "x", assistant]` (None where the template does not render it so).
    lone: Option<(Option<String>, String)>,
}

impl Fallback {
    fn new(hf: &crate::HfTokenizer, messages: &[Json], full: &str) -> Result<Fallback, String> {
        let texts = serde_json::to_string(messages).unwrap_or_default();
        let markers = Markers::new(&[&texts, full])
            .ok_or("the conversation holds every marker character the fallback could use")?;
        let mut marked = messages.to_vec();
        for (i, m) in messages.iter().enumerate() {
            if role(m) == Some("assistant") {
                markers.replace(&mut marked, i);
            }
        }
        let rendered = hf.render_chat(&marked, false).map_err(|e| {
            format!("the conversation with its assistant contents replaced does not render: {e}")
        })?;
        let (texts, order) = markers.split(&rendered);
        let found = match_contents(messages, full, &texts, &order).ok_or_else(|| {
            "with markers in place of the assistant contents, the template renders other \
             text around them than around the contents themselves (it renders something by \
             what a content holds)"
                .to_string()
        })?;
        let mut contents = vec![Vec::new(); messages.len()];
        for (i, range) in order.into_iter().zip(found) {
            if let Some(c) = contents.get_mut(i) {
                c.push(range);
            }
        }
        let lone = {
            let user = serde_json::json!({"role": "user", "content": "x"});
            let answer = serde_json::json!({"role": "assistant", "content": markers.mark(1)});
            let before = hf.render_chat(std::slice::from_ref(&user), true).ok();
            let through = hf.render_chat(&[user, answer], false).ok();
            through.and_then(|t| edges(&t, &markers.mark(1), before.as_deref()))
        };
        Ok(Fallback {
            markers,
            contents,
            lone,
        })
    }

    /// Assistant message `i`'s turn, or why it cannot be told.
    fn turn(
        &self,
        hf: &crate::HfTokenizer,
        messages: &[Json],
        i: usize,
        full: &str,
    ) -> Result<Turn, String> {
        let content = match self.contents[i].as_slice() {
            [one] => one.clone(),
            [] if !matches!(messages[i].get("content"), Some(Json::String(_))) => {
                return Err("it has no text content to find (a tool-call turn)".into())
            }
            [] => return Err("the template does not render its content".into()),
            many => {
                return Err(format!(
                    "the template renders its content {} times",
                    many.len()
                ))
            }
        };
        // What the template puts around the content, with the message the last one.
        let mut marked = messages[..=i].to_vec();
        self.markers.replace(&mut marked, i);
        let own = hf.render_chat(&marked, false).ok().and_then(|through| {
            let before = hf.render_chat(&messages[..i], true).ok();
            edges(&through, &self.markers.mark(i), before.as_deref())
        });
        let candidates = [own, self.lone.clone()];
        let head = candidates
            .iter()
            .flatten()
            .filter_map(|(h, _)| h.as_deref())
            .find(|h| full[..content.start].ends_with(h))
            .unwrap_or("");
        let mut tails = candidates.iter().flatten().map(|(_, t)| t.as_str());
        let after = &full[content.end..];
        let tail = match tails.clone().find(|t| after.starts_with(t)) {
            Some(t) => t.len(),
            None => {
                let Some(t) = tails.next() else {
                    return Err("the template renders no conversation that ends with it, so its end-of-turn is unknown".into());
                };
                // Where more follows, the end-of-turn's start (a template may add text at
                // the end of a conversation that ends with the assistant).
                let common: usize = t
                    .chars()
                    .zip(after.chars())
                    .take_while(|(a, b)| a == b)
                    .map(|(a, _)| a.len_utf8())
                    .sum();
                if common == 0 {
                    return Err(format!(
                        "the template ends it with {t:?} where it is the last message, but with \
                         {:?} here, so its end-of-turn is unknown",
                        after
                            .chars()
                            .take(t.chars().count().max(1))
                            .collect::<String>()
                    ));
                }
                common
            }
        };
        Ok(Turn {
            turn: content.start - head.len()..content.end + tail,
            content: Some(content),
        })
    }
}

/// In `through` (a conversation rendered through an assistant turn whose content is `mark`),
/// the text after the content, and where `before` (the conversation before the turn, with the
/// generation prompt) is a prefix of the text up to the content, the text between them.
fn edges(through: &str, mark: &str, before: Option<&str>) -> Option<(Option<String>, String)> {
    let at = through.find(mark)?;
    let after = &through[at + mark.len()..];
    if after.contains(mark) {
        return None;
    }
    let head = before
        .and_then(|b| through[..at].strip_prefix(b))
        .map(str::to_string);
    Some((head, after.to_string()))
}

/// Where in `full` each marked content lies, given the rendering with markers cut into
/// `texts` around the markers of the messages `order`: `full` must be `texts[0]`, a content,
/// `texts[1]`, … with each content as written or trimmed as templates trim it (`|trim`,
/// `.strip()`), or else (a content the template changed) whatever lies before the next text.
/// Where several readings fit, the first found (contents as written before trimmed ones);
/// None where none does.
fn match_contents(
    messages: &[Json],
    full: &str,
    texts: &[&str],
    order: &[usize],
) -> Option<Vec<Range<usize>>> {
    use std::collections::BTreeMap;
    /// The most readings followed at once (each differs in whitespace at a content's edges).
    const MAX_READINGS: usize = 16;
    let first = texts.first()?;
    if !full.starts_with(first) {
        return None;
    }
    // After each marker, the positions in `full` reached, each with the position it came from
    // and the content's range.
    let mut reached: Vec<BTreeMap<usize, (usize, Range<usize>)>> = Vec::new();
    let mut at: Vec<usize> = vec![first.len()];
    for (j, &i) in order.iter().enumerate() {
        let next = texts[j + 1];
        let last = j + 1 == order.len();
        let content = messages
            .get(i)
            .and_then(|m| m.get("content"))
            .and_then(Json::as_str)
            .unwrap_or("");
        let mut variants = vec![
            content,
            content.trim(),
            content.trim_start(),
            content.trim_end(),
        ];
        variants.dedup();
        let mut step = BTreeMap::new();
        for &pos in &at {
            let rest = &full[pos..];
            let fits = |end: usize| match last {
                true => &rest[end..] == next,
                false => rest[end..].starts_with(next),
            };
            let mut ends: Vec<usize> = variants
                .iter()
                .filter(|v| rest.starts_with(*v) && fits(v.len()))
                .map(|v| v.len())
                .collect();
            if ends.is_empty() {
                // Content the template changed: what lies before the next text.
                let end = match last {
                    true => rest.strip_suffix(next).map(str::len),
                    false if !next.is_empty() => rest.find(next),
                    false => None,
                };
                ends.extend(end);
            }
            for end in ends {
                if step.len() < MAX_READINGS {
                    step.entry(pos + end + next.len())
                        .or_insert((pos, pos..pos + end));
                }
            }
        }
        if step.is_empty() {
            return None;
        }
        at = step.keys().copied().collect();
        reached.push(step);
    }
    if order.is_empty() {
        return (full == *first).then(Vec::new);
    }
    // Back from the end of `full`.
    let mut pos = full.len();
    let mut ranges = Vec::with_capacity(order.len());
    for step in reached.iter().rev() {
        let (from, range) = step.get(&pos)?.clone();
        ranges.push(range);
        pos = from;
    }
    ranges.reverse();
    Some(ranges)
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
    /// `examples` one after the other. Each already ends with EOS (see [`tokenize_example`]; a
    /// chat may have whitespace after it), which sits between it and the next; each one's first
    /// token gets mask 0, since predicting it would cross the boundary.
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

    /// Mistral-7B-Instruct-v0.3's chat template without its tool branches: the system message
    /// goes into the last user turn.
    const MISTRAL_V03: &str = include_str!("../../nn/tests/fixtures/hf/mistral_v03.jinja");

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

    /// The fixture tokenizer (byte-level, ChatML's markers, `<|im_end|>` its EOS) with
    /// `template` as its chat template.
    fn fixture_with(template: &str) -> crate::HfTokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../nn/tests/fixtures/hf/tokenizer");
        let mut files = crate::HfTokenizer::from_dir(&dir).unwrap().files().clone();
        let mut config: Json =
            serde_json::from_str(files.tokenizer_config_json.as_deref().unwrap()).unwrap();
        config["chat_template"] = template.into();
        files.tokenizer_config_json = Some(config.to_string());
        crate::HfTokenizer::from_files(files, Path::new("fixture")).unwrap()
    }

    fn conversation(turns: &[(&str, &str)]) -> Vec<Json> {
        turns
            .iter()
            .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
            .collect()
    }

    /// Where prefixes hold, the fallback (content markers, the end-of-turn of the message as
    /// the last) finds the same turns, token for token: ChatML, Llama 2, Mistral v0.3 without a
    /// system message, Llama 3 (which trims the content), Zephyr.
    #[test]
    fn the_fallback_counts_what_prefixes_count() {
        let templates = [
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "{% for m in messages %}{% if m.role == 'user' %}{{ bos_token + '[INST] ' + m.content.strip() + ' [/INST]' }}{% elif m.role == 'assistant' %}{{ ' ' + m.content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}",
            MISTRAL_V03,
            "{{- bos_token }}{% for m in messages %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
            "{% for m in messages %}{{ '<|' + m.role + '|>\n' + m.content + eos_token + '\n' }}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
        ];
        let conversations = [
            conversation(&[("user", "Hello, world!"), ("assistant", "Hi.")]),
            conversation(&[
                ("user", "2 + 2?"),
                ("assistant", " 4 "),
                ("user", "and 3 + 3?"),
                ("assistant", "6.\n"),
                ("user", "bye"),
            ]),
            conversation(&[("user", "x"), ("assistant", "")]),
            conversation(&[
                ("user", "say <|im_end|>"),
                ("assistant", "ok <|im_end|> done"),
            ]),
        ];
        for template in templates {
            let hf = fixture_with(template);
            for messages in &conversations {
                let by_prefix = chat_example(&hf, messages, 2, Locate::PrefixesFirst).unwrap();
                let fallback = chat_example(&hf, messages, 2, Locate::FallbackOnly).unwrap();
                assert_eq!(fallback, by_prefix, "{template}: {messages:?}");
                assert!(by_prefix.mask.contains(&true), "{template}: {messages:?}");
            }
        }
    }

    /// Contents as the template renders them: trimmed, or changed (`upper`), found between the
    /// texts around them.
    #[test]
    fn contents_are_found_as_written_trimmed_or_changed() {
        let found = |range: Range<usize>| Some(vec![range]);
        let messages = conversation(&[("user", " a "), ("assistant", " b "), ("user", "c")]);
        let texts = ["<u>a</u><a>", "</a><u>c</u>"];
        assert_eq!(
            match_contents(&messages, "<u>a</u><a>b</a><u>c</u>", &texts, &[1]),
            found(11..12)
        );
        assert_eq!(
            match_contents(&messages, "<u>a</u><a> b </a><u>c</u>", &texts, &[1]),
            found(11..14)
        );
        assert_eq!(
            match_contents(&messages, "<u>a</u><a> B </a><u>c</u>", &texts, &[1]),
            found(11..14)
        );
        // The text around it is not the marked rendering's.
        assert_eq!(
            match_contents(&messages, "<u>A</u><a>b</a><u>c</u>", &texts, &[1]),
            None
        );
        let markers = Markers::new(&["plain"]).unwrap();
        let rendered = format!("a{}b{}c\u{E000}x", markers.mark(1), markers.mark(23));
        let (texts, order) = markers.split(&rendered);
        assert_eq!(texts, ["a", "b", "c\u{E000}x"]);
        assert_eq!(order, [1, 23]);
        assert_eq!(
            Markers::new(&["\u{E000}"]).map(|m| m.open),
            Some('\u{F8F0}')
        );
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
