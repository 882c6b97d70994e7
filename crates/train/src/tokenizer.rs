//! Character-level tokenizer: one id per distinct character, in sorted order (as nanoGPT's
//! shakespeare-char, which gives tinyshakespeare's 65 symbols).

use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CharTokenizer {
    chars: Vec<char>,
    ids: HashMap<char, u32>,
}

impl CharTokenizer {
    /// The vocabulary of `text`.
    pub fn from_text(text: &str) -> CharTokenizer {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        CharTokenizer::from_chars(chars)
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_sorts_the_vocabulary() {
        let t = CharTokenizer::from_text("hello, world");
        assert_eq!(t.chars(), &[' ', ',', 'd', 'e', 'h', 'l', 'o', 'r', 'w']);
        let ids = t.encode("hello").unwrap();
        assert_eq!(ids, vec![4, 3, 5, 5, 6]);
        assert_eq!(t.decode(&ids), "hello");
        assert_eq!(t.encode("hex"), Err('x'));
    }
}
