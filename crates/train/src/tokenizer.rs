//! Tokenizers: character level (one id per distinct character, in sorted order, as nanoGPT's
//! shakespeare-char, which gives tinyshakespeare's 65 symbols) and GPT-2's byte-level BPE
//! (`r50k_base`, 50,257 tokens, through `tiktoken-rs`, whose ranks ship inside the crate), and
//! Hugging Face's `tokenizer.json` ([`HfTokenizer`]).
//!
//! [`Tokenizer`] is any of them; [`TokenizerSpec`] is its serializable description, stored in
//! token files and checkpoints so the exact tokenizer can be rebuilt.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};
use tiktoken_rs::CoreBPE;

use crate::hf_tokenizer::{HfTokenizer, HfTokenizerFiles};
use crate::TrainError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CharTokenizer {
    chars: Vec<char>,
    ids: HashMap<char, u32>,
}

impl CharTokenizer {
    /// The vocabulary of `text`.
    pub fn from_text(text: &str) -> CharTokenizer {
        // A set rather than every character sorted: the tokenizer lives as long as the run.
        let chars: BTreeSet<char> = text.chars().collect();
        CharTokenizer::from_chars(chars.into_iter().collect())
    }

    /// A tokenizer whose id `i` is `chars[i]`. With a repeated character the later id wins
    /// when encoding; [`Tokenizer::from_spec`] rejects such lists.
    pub fn from_chars(chars: Vec<char>) -> CharTokenizer {
        let ids = chars
            .iter()
            .enumerate()
            .map(|(i, &c)| (c, i as u32))
            .collect();
        CharTokenizer { chars, ids }
    }

    pub fn vocab_size(&self) -> usize {
        self.chars.len()
    }

    pub fn chars(&self) -> &[char] {
        &self.chars
    }

    /// Ids of `text`, or the first character outside the vocabulary.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, char> {
        text.chars()
            .map(|c| self.ids.get(&c).copied().ok_or(c))
            .collect()
    }

    /// Text of `ids`; ids outside the vocabulary become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&i| self.chars.get(i as usize).copied().unwrap_or('\u{FFFD}'))
            .collect()
    }
}

/// GPT-2's tokenizer: tiktoken's `r50k_base` (50,256 byte-level BPE tokens plus
/// `<|endoftext|>` = 50256).
///
/// Its ranks are built on first use and shared by the process: training from prepared token
/// files only needs the vocabulary size, so it never pays for them.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct Gpt2Tokenizer {
    _private: (),
}

/// GPT-2's vocabulary: 50,256 BPE tokens and `<|endoftext|>`.
pub const GPT2_VOCAB_SIZE: usize = 50257;
/// GPT-2's `<|endoftext|>` id.
pub const GPT2_EOT: u32 = 50256;

/// Target size of the pieces a large text is cut into for parallel encoding.
const GPT2_CHUNK_BYTES: usize = 256 * 1024;
/// Whitespace runs longer than this get a cut of their own: GPT-2's pre-tokenizer pattern
/// (`\s+(?!\S)`) backtracks through a whole run followed by text, and fancy-regex gives up
/// (tiktoken-rs then panics) on runs of about a million characters.
const GPT2_LONG_WHITESPACE: usize = 1024;

impl Gpt2Tokenizer {
    pub const fn new() -> Gpt2Tokenizer {
        Gpt2Tokenizer { _private: () }
    }

    /// The process's shared ranks, built on the first call.
    fn bpe(&self) -> Result<&'static CoreBPE, TrainError> {
        static BPE: OnceLock<Result<CoreBPE, String>> = OnceLock::new();
        BPE.get_or_init(|| tiktoken_rs::r50k_base().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| TrainError::Tokenizer(format!("building GPT-2's r50k_base: {e}")))
    }

    /// Ids of `text` with special tokens read as plain text (`"<|endoftext|>"` in a corpus is
    /// seven ordinary tokens, as in nanoGPT's `encode_ordinary`). Large texts are encoded in
    /// parallel pieces, cut only where the result is provably the same as one call.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TrainError> {
        let bpe = self.bpe()?;
        let chunks = gpt2_chunks(text, GPT2_CHUNK_BYTES);
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(chunks.len());
        if threads <= 1 {
            let mut ids = Vec::with_capacity(text.len() / 3);
            for c in &chunks {
                ids.extend(encode_piece(bpe, c)?);
            }
            return Ok(ids);
        }
        // Contiguous groups of chunks of about equal bytes, one per thread, joined in order.
        let per_thread = text.len().div_ceil(threads);
        let mut groups: Vec<&[&str]> = Vec::with_capacity(threads);
        let (mut start, mut bytes) = (0, 0);
        for (i, c) in chunks.iter().enumerate() {
            bytes += c.len();
            if bytes >= per_thread || i + 1 == chunks.len() {
                groups.push(&chunks[start..=i]);
                (start, bytes) = (i + 1, 0);
            }
        }
        let parts: Vec<Result<Vec<u32>, TrainError>> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .iter()
                .map(|group| {
                    s.spawn(move || {
                        let mut ids = Vec::new();
                        for c in *group {
                            ids.extend(encode_piece(bpe, c)?);
                        }
                        Ok(ids)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(TrainError::Tokenizer(
                            "a GPT-2 encoding thread panicked".into(),
                        ))
                    })
                })
                .collect()
        });
        let mut ids = Vec::with_capacity(text.len() / 3);
        for p in parts {
            ids.extend(p?);
        }
        Ok(ids)
    }

    /// Text of `ids`: bytes that are not UTF-8 and ids outside the vocabulary become U+FFFD
    /// (every id does, should the ranks fail to build).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bpe = self.bpe().ok();
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            match bpe.map(|b| b.decode_bytes(&[id])) {
                Some(Ok(b)) => bytes.extend_from_slice(&b),
                _ => bytes.extend_from_slice("\u{FFFD}".as_bytes()),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// One call into tiktoken. Its regex errors are `unwrap`ped inside the crate; the cuts make
/// them unreachable for whitespace runs, and any other one becomes an error, not an abort.
fn encode_piece(bpe: &CoreBPE, piece: &str) -> Result<Vec<u32>, TrainError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| bpe.encode_ordinary(piece))).map_err(
        |_| {
            TrainError::Tokenizer(format!(
                "GPT-2's pre-tokenizer failed on a {}-byte piece of text starting {:?}",
                piece.len(),
                piece.chars().take(32).collect::<String>()
            ))
        },
    )
}

impl std::fmt::Debug for Gpt2Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gpt2Tokenizer(r50k_base)")
    }
}

/// Cuts `text` into pieces of at least `target` bytes (except the last) that GPT-2's
/// pre-tokenizer splits exactly as it splits the whole, so encoding the pieces one by one gives
/// the same ids. A cut goes right before the last character of a whitespace run that is followed
/// by a non-whitespace character. Every alternative of the pattern
/// `'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s` then ends
/// its match at the cut in the whole text too: a run of n ≥ 2 whitespace characters followed by
/// text matches as its first n−1 (`\s+(?!\S)`), which at the end of the left piece match as one
/// (`\s++$`); a run of one is its own match or the optional leading space of the next, which
/// starts the right piece; no alternative ending in non-whitespace reaches past whitespace.
fn gpt2_chunks(text: &str, target: usize) -> Vec<&str> {
    let mut chunks = Vec::new();
    let mut start = 0;
    let mut run = 0usize;
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if !c.is_whitespace() {
            run = 0;
            continue;
        }
        run += 1;
        let before_text = matches!(chars.peek(), Some(&(_, next)) if !next.is_whitespace());
        if before_text && i > start && (i - start >= target || run > GPT2_LONG_WHITESPACE) {
            chunks.push(&text[start..i]);
            start = i;
        }
    }
    chunks.push(&text[start..]);
    chunks
}

/// A tokenizer snug can train with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tokenizer {
    Char(CharTokenizer),
    Gpt2(Gpt2Tokenizer),
    Hf(HfTokenizer),
}

/// What a token file or checkpoint stores to rebuild its [`Tokenizer`]: a character vocabulary
/// in id order, GPT-2 (whose ranks are built in), or a Hugging Face tokenizer's files.
///
/// The Hugging Face files are stored whole rather than as a path and a hash: a run must resume
/// on a machine that has the token files or the checkpoint but not the model directory, and
/// export writes the files back unchanged. They are a few MB at most (Llama 3's is the largest
/// common one, about 9 MB), small beside the checkpoint's weights.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum TokenizerSpec {
    Char { chars: String },
    Gpt2,
    Hf(HfTokenizerFiles),
}

impl Tokenizer {
    pub const fn gpt2() -> Tokenizer {
        Tokenizer::Gpt2(Gpt2Tokenizer::new())
    }

    /// `"char"`, `"gpt2"` or `"hf"`.
    pub fn name(&self) -> &'static str {
        match self {
            Tokenizer::Char(_) => "char",
            Tokenizer::Gpt2(_) => "gpt2",
            Tokenizer::Hf(_) => "hf",
        }
    }

    /// One more than the largest id.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Char(t) => t.vocab_size(),
            Tokenizer::Gpt2(_) => GPT2_VOCAB_SIZE,
            Tokenizer::Hf(t) => t.vocab_size(),
        }
    }

    /// The id that ends a document or an example: GPT-2's `<|endoftext|>`, a Hugging Face
    /// tokenizer's `eos_token`; a character vocabulary has none.
    pub fn eos_id(&self) -> Option<u32> {
        match self {
            Tokenizer::Char(_) => None,
            Tokenizer::Gpt2(_) => Some(GPT2_EOT),
            Tokenizer::Hf(t) => t.special_tokens().eos.as_ref().map(|t| t.id),
        }
    }

    /// Fails unless every id of this tokenizer is an id of a model with `model_vocab` entries.
    /// A larger model vocabulary is fine (checkpoints pad it to a multiple of 64 or 128).
    pub fn check_model_vocab(&self, model_vocab: usize) -> Result<(), TrainError> {
        if self.vocab_size() > model_vocab {
            return Err(TrainError::VocabMismatch {
                tokenizer: self.vocab_size(),
                model: model_vocab,
            });
        }
        Ok(())
    }

    /// The first character of `text` this tokenizer cannot encode on its own, in words (its
    /// code point and byte offset): what a failed encoding is about, which a tokenizer
    /// library's message does not say ("Missing [UNK] token from the vocabulary"). None where
    /// every character encodes alone.
    pub fn unencodable_char(&self, text: &str) -> Option<String> {
        let mut tried = std::collections::HashSet::new();
        let (at, c) = text
            .char_indices()
            .find(|&(_, c)| tried.insert(c) && self.encode(c.encode_utf8(&mut [0; 4])).is_err())?;
        Some(format!(
            "its character {c:?} (U+{:04X}, at byte {at}) is outside the tokenizer's vocabulary, \
             which has no unknown token to stand for it",
            c as u32
        ))
    }

    /// Ids of `text`, with no special tokens added; for the character tokenizer a character
    /// outside the vocabulary is an error naming it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TrainError> {
        match self {
            Tokenizer::Char(t) => t.encode(text).map_err(|ch| TrainError::UnknownChar {
                ch,
                vocab: t.vocab_size(),
            }),
            Tokenizer::Gpt2(t) => t.encode(text),
            Tokenizer::Hf(t) => t.encode(text, false),
        }
    }

    /// Text of `ids`, never failing: invalid ids and invalid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Tokenizer::Char(t) => t.decode(ids),
            Tokenizer::Gpt2(t) => t.decode(ids),
            Tokenizer::Hf(t) => t.decode(ids, false),
        }
    }

    /// Whether text gets the same ids from `self` and `other`: the same spec, the same
    /// Hugging Face tokenizer.json, or the same vocabulary, every id decoding alike, with
    /// probe texts encoded alike (GPT-2's built-in tokenizer and a GPT-2 model's
    /// tokenizer.json; not one whose ids of two tokens were swapped).
    pub fn same_ids(&self, other: &Tokenizer) -> bool {
        const PROBES: [&str; 4] = [
            "The quick brown fox jumps over the lazy dog.",
            "  Hello,\nworld!\t0123456789 (x + y) = z; \"quoted\" it's",
            "ROMEO:\nBut, soft! what light through yonder window breaks?\n\n",
            "naïve café – 東京 🙂",
        ];
        if let (Tokenizer::Hf(a), Tokenizer::Hf(b)) = (self, other) {
            if a.files().tokenizer_json == b.files().tokenizer_json {
                return true;
            }
        }
        if let (Tokenizer::Char(c), o) | (o, Tokenizer::Char(c)) = (self, other) {
            // A character vocabulary (and the tokenizer.json `snug export` writes for one):
            // the probes hold characters it lacks, so its own characters are the probe, in
            // order and, for a vocabulary of up to 256, every pair of them side by side (a
            // normalizer composing `e` and U+0301 acts on a pair).
            let n = c.chars().len() as u32;
            let chars = c.chars();
            let mut probe: Vec<char> = chars.to_vec();
            if chars.len() <= 256 {
                for &a in chars {
                    for &b in chars {
                        probe.extend([a, b]);
                    }
                }
            }
            let text: String = probe.iter().collect();
            return o.vocab_size() == n as usize
                && matches!((o.encode(&text), c.encode(&text)), (Ok(a), Ok(b)) if a == b)
                && (0..n).all(|id| self.decode(&[id]) == other.decode(&[id]));
        }
        self.to_spec() == other.to_spec()
            || (self.vocab_size() == other.vocab_size()
                && PROBES
                    .iter()
                    .all(|p| matches!((self.encode(p), other.encode(p)), (Ok(a), Ok(b)) if a == b))
                && (0..self.vocab_size() as u32)
                    .all(|id| self.decode(&[id]) == other.decode(&[id])))
    }

    pub fn to_spec(&self) -> TokenizerSpec {
        match self {
            Tokenizer::Char(t) => TokenizerSpec::Char {
                chars: t.chars().iter().collect(),
            },
            Tokenizer::Gpt2(_) => TokenizerSpec::Gpt2,
            Tokenizer::Hf(t) => TokenizerSpec::Hf(t.files().clone()),
        }
    }

    /// The tokenizer `spec` describes; an empty or repeating character list, or Hugging Face
    /// files that do not build a tokenizer, is an error.
    pub fn from_spec(spec: &TokenizerSpec) -> Result<Tokenizer, TrainError> {
        match spec {
            TokenizerSpec::Char { chars } => {
                let list: Vec<char> = chars.chars().collect();
                if list.is_empty() {
                    return Err(TrainError::Tokenizer(
                        "a character tokenizer needs at least one character".into(),
                    ));
                }
                let t = CharTokenizer::from_chars(list);
                if t.ids.len() != t.chars.len() {
                    let mut seen = std::collections::HashSet::new();
                    let dup = t.chars.iter().find(|c| !seen.insert(**c));
                    return Err(TrainError::Tokenizer(format!(
                        "character {:?} appears more than once in the vocabulary",
                        dup.copied().unwrap_or_default()
                    )));
                }
                Ok(Tokenizer::Char(t))
            }
            TokenizerSpec::Gpt2 => Ok(Tokenizer::gpt2()),
            TokenizerSpec::Hf(files) => Ok(Tokenizer::Hf(HfTokenizer::from_files(
                files.clone(),
                Path::new(""),
            )?)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn same_ids_tells_tokenizers_apart_by_what_they_encode() {
        let chars = |t: &str| Tokenizer::Char(CharTokenizer::from_text(t));
        let all: String = (' '..='~').chain(['\n', '\t']).collect();
        assert!(chars("abc").same_ids(&chars("cab")), "the same set, sorted");
        assert!(!chars("abc").same_ids(&chars("abd")));
        // Same size, other ids: the probes tell them apart.
        let reversed: String = all.chars().rev().collect();
        assert!(
            !chars(&all).same_ids(&Tokenizer::Char(CharTokenizer::from_chars(
                reversed.chars().collect()
            )))
        );
        assert!(Tokenizer::gpt2().same_ids(&Tokenizer::gpt2()));
        // Two ids swapped: the probes encode alike, but those ids decode otherwise.
        let mut sorted: Vec<char> = all.chars().collect();
        sorted.sort_unstable();
        let mut other = sorted.clone();
        let n = other.len();
        other.swap(n - 1, n - 2); // `}` and `~`, in no probe
        assert!(!Tokenizer::Char(CharTokenizer::from_chars(sorted))
            .same_ids(&Tokenizer::Char(CharTokenizer::from_chars(other))));
        assert!(!Tokenizer::gpt2().same_ids(&chars(&all)));
    }

    /// A character vocabulary against a tokenizer.json of the same characters (as `snug
    /// export` writes one): the same ids, unless a normalizer composes a pair of them.
    #[test]
    fn a_character_vocabulary_matches_its_tokenizer_json_unless_pairs_change() {
        let vocab = "ae\u{301}\u{e9}\n ";
        let char_tok = Tokenizer::Char(CharTokenizer::from_text(vocab));
        let json = |normalizer: serde_json::Value| {
            let Tokenizer::Char(c) = &char_tok else {
                unreachable!()
            };
            let ids: serde_json::Map<String, serde_json::Value> = c
                .chars()
                .iter()
                .enumerate()
                .map(|(i, ch)| (ch.to_string(), i.into()))
                .collect();
            let text = serde_json::json!({
                "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
                "normalizer": normalizer,
                "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"},
                    "behavior": "Isolated", "invert": false},
                "post_processor": null, "decoder": {"type": "Fuse"},
                "model": {"type": "WordLevel", "vocab": ids, "unk_token": "<unk>"}
            });
            let files = crate::HfTokenizerFiles {
                tokenizer_json: text.to_string(),
                tokenizer_config_json: None,
                chat_template_jinja: None,
                special_tokens_map_json: None,
            };
            Tokenizer::Hf(crate::HfTokenizer::from_files(files, std::path::Path::new("")).unwrap())
        };
        assert!(char_tok.same_ids(&json(serde_json::Value::Null)));
        // NFC makes `e` + U+0301 one `é`: alone, each character encodes as before.
        assert!(!char_tok.same_ids(&json(serde_json::json!({"type": "NFC"}))));
    }

    /// About `bytes` of English-like text: words, punctuation, line breaks and blank lines, as
    /// in a play, generated from `seed`.
    fn generated_text(bytes: usize, seed: u64) -> String {
        let words = [
            "the", "lord", "And", "thou", "shalt", "not", "KING", "HENRY", "V:", "my", "good",
            "sir,", "what", "say'st", "you?", "I'll", "we've", "come", "hither", "--", "O,", "42",
            "1599", "night;", "day.", "'tis", "so!",
        ];
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut s = String::with_capacity(bytes + 16);
        while s.len() < bytes {
            s += words[rng.random_range(0..words.len())];
            s += match rng.random_range(0..20) {
                0 => "\n",
                1 => "\n\n",
                2 => "  ",
                _ => " ",
            };
        }
        s
    }

    #[test]
    fn round_trips_and_sorts_the_vocabulary() {
        let t = CharTokenizer::from_text("hello, world");
        assert_eq!(t.chars(), &[' ', ',', 'd', 'e', 'h', 'l', 'o', 'r', 'w']);
        let ids = t.encode("hello").unwrap();
        assert_eq!(ids, vec![4, 3, 5, 5, 6]);
        assert_eq!(t.decode(&ids), "hello");
        assert_eq!(t.encode("hex"), Err('x'));
    }

    #[test]
    fn char_tokenizer_names_an_unknown_character_and_decodes_lossily() {
        let t = Tokenizer::Char(CharTokenizer::from_text("abc"));
        assert_eq!(t.name(), "char");
        assert_eq!(t.vocab_size(), 3);
        match t.encode("abz") {
            Err(TrainError::UnknownChar { ch: 'z', vocab: 3 }) => {}
            other => panic!("expected UnknownChar('z'), got {other:?}"),
        }
        let err = t.encode("a\u{e9}").unwrap_err().to_string();
        assert!(err.contains('\u{e9}'), "{err}");
        assert_eq!(t.decode(&[0, 2, 99, u32::MAX]), "ac\u{FFFD}\u{FFFD}");
    }

    /// Ids checked against tiktoken's own tests (`tests/test_simple_public.py`: gpt2 "hello
    /// world" = [31373, 995]) and GPT-2's vocabulary ("Hello" 15496, " world" 995, " the" 262,
    /// "\n" 198, "<|endoftext|>" 50256).
    #[test]
    fn gpt2_ids_match_known_token_ids() {
        let t = Tokenizer::gpt2();
        assert_eq!((t.name(), t.vocab_size()), ("gpt2", 50257));
        assert_eq!(t.encode("Hello world").unwrap(), [15496, 995]);
        assert_eq!(t.encode(" the").unwrap(), [262]);
        assert_eq!(t.encode("hello world").unwrap(), [31373, 995]);
        assert_eq!(t.encode("\n").unwrap(), [198]);
        assert_eq!(t.encode("").unwrap(), Vec::<u32>::new());
        assert_eq!(t.decode(&[31373, 995]), "hello world");
        assert_eq!(t.decode(&[GPT2_EOT]), "<|endoftext|>");
        // Special tokens in a corpus are text, not control tokens.
        assert!(!t.encode("<|endoftext|>").unwrap().contains(&GPT2_EOT));
    }

    #[test]
    fn gpt2_round_trips_unicode_and_decodes_bad_ids_lossily() {
        let t = Tokenizer::gpt2();
        let text = "Ünïcödé — 日本語, emoji 🦀, tabs\tand\r\nlines  \u{a0}end ";
        let ids = t.encode(text).unwrap();
        assert!(ids.iter().all(|&i| (i as usize) < t.vocab_size()));
        assert_eq!(t.decode(&ids), text);
        // An id past the vocabulary, and half of a multi-byte character (🦀 is split into
        // byte-level tokens), both decode to replacement characters instead of panicking.
        let crab = t.encode("🦀").unwrap();
        assert!(crab.len() > 1, "{crab:?}");
        assert_eq!(t.decode(&[15496, 60000]), "Hello\u{FFFD}");
        assert!(t.decode(&crab[..1]).contains('\u{FFFD}'));
    }

    /// nanoGPT's `data/shakespeare/prepare.py` encodes the first 90% of tinyshakespeare's
    /// characters and the rest with tiktoken's gpt2 and reports 301,966 and 36,059 tokens.
    #[test]
    fn gpt2_on_tinyshakespeare_matches_nanogpt_counts() {
        // The only test that needs the corpus: these counts are its own.
        let text = match snug_testkit::tinyshakespeare() {
            Ok(path) => std::fs::read_to_string(path).unwrap(),
            Err(reason) => return snug_testkit::skip_or_fail(&reason),
        };
        assert!(text.is_ascii());
        let split = text.len() * 9 / 10;
        let t = Tokenizer::gpt2();
        assert_eq!(t.encode(&text[..split]).unwrap().len(), 301_966);
        assert_eq!(t.encode(&text[split..]).unwrap().len(), 36_059);
        let all = t.encode(&text).unwrap();
        assert_eq!(t.decode(&all), text);
    }

    /// Cutting at every allowed place gives exactly the ids of one whole call, on text dense
    /// in the whitespace patterns the pre-tokenizer treats specially.
    #[test]
    fn gpt2_chunked_encoding_equals_whole_encoding() {
        let gpt2 = Gpt2Tokenizer::new();
        let bpe = gpt2.bpe().unwrap();
        let alphabet = [
            " ", " ", "  ", "\n", "\n\n", "\t", "\r\n", "\u{a0}", "\u{3000}", "a", "the", "Zq",
            "7", "42", "!", "?!", "'s", "'ll", "'", "日本", "é", "🦀", "-", " \n ",
        ];
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for _ in 0..40 {
            let n = rng.random_range(1..400);
            let text: String = (0..n)
                .map(|_| alphabet[rng.random_range(0..alphabet.len())])
                .collect();
            let whole = bpe.encode_ordinary(&text);
            for target in [1, 3, 17] {
                let chunks = gpt2_chunks(&text, target);
                assert_eq!(chunks.concat(), text);
                let pieces: Vec<u32> = chunks.iter().flat_map(|c| bpe.encode_ordinary(c)).collect();
                assert_eq!(pieces, whole, "{text:?} cut at target {target}: {chunks:?}");
            }
        }
        // Large text takes the parallel path and still matches.
        let text = generated_text(4 * GPT2_CHUNK_BYTES, 6);
        assert!(gpt2_chunks(&text, GPT2_CHUNK_BYTES).len() >= 4);
        assert_eq!(gpt2.encode(&text).unwrap(), bpe.encode_ordinary(&text));
    }

    /// tiktoken-rs panics on a million spaces followed by a letter; the cuts avoid it.
    #[test]
    fn gpt2_encodes_huge_whitespace_runs() {
        let t = Tokenizer::gpt2();
        for ws in [" ", "\n", "\t "] {
            let text = format!("a{}b", ws.repeat(1_000_000));
            let ids = t.encode(&text).unwrap();
            assert_eq!(t.decode(&ids), text);
        }
    }

    #[test]
    fn specs_round_trip_through_json() {
        let char_tok = Tokenizer::Char(CharTokenizer::from_text("hello, world\n"));
        for t in [char_tok, Tokenizer::gpt2()] {
            let json = serde_json::to_string(&t.to_spec()).unwrap();
            let back: TokenizerSpec = serde_json::from_str(&json).unwrap();
            let rebuilt = Tokenizer::from_spec(&back).unwrap();
            assert_eq!(rebuilt, t);
            assert_eq!(rebuilt.encode("hello").unwrap(), t.encode("hello").unwrap());
        }
        assert_eq!(
            serde_json::to_string(&TokenizerSpec::Gpt2).unwrap(),
            r#"{"kind":"gpt2"}"#
        );
        for bad in ["", "abca"] {
            let spec = TokenizerSpec::Char { chars: bad.into() };
            assert!(matches!(
                Tokenizer::from_spec(&spec),
                Err(TrainError::Tokenizer(_))
            ));
        }
    }
}
