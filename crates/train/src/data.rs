//! Training data: a built-in generated data set (so `snug train` works on a fresh clone), text
//! files, the train/validation split, and seeded batch sampling.

use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{CharTokenizer, TrainError};

/// Where training text comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// Generated multi-digit additions, `"482+39=521\n"`: a language with exact rules, so a
    /// falling loss means the model is learning arithmetic, not memorising text.
    Addition,
    File(PathBuf),
}

/// Generates `lines` additions of numbers below 1000, deterministically from `seed`.
pub fn addition_text(lines: usize, seed: u64) -> String {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut s = String::with_capacity(lines * 12);
    for _ in 0..lines {
        let a: u32 = rng.random_range(0..1000);
        let b: u32 = rng.random_range(0..1000);
        s += &format!("{a}+{b}={}\n", a + b);
    }
    s
}

/// A tokenized corpus split 90/10 into training and validation ids.
#[derive(Debug, Clone)]
pub struct TokenDataset {
    pub tokenizer: CharTokenizer,
    pub train: Vec<u32>,
    pub val: Vec<u32>,
    pub name: String,
}

impl TokenDataset {
    pub fn load(source: &DataSource) -> Result<TokenDataset, TrainError> {
        match source {
            DataSource::Addition => Ok(Self::from_text(
                "built-in addition data",
                &addition_text(50_000, 1234),
            )),
            DataSource::File(path) => Self::from_file(path),
        }
    }

    pub fn from_file(path: &Path) -> Result<TokenDataset, TrainError> {
        let text = std::fs::read_to_string(path).map_err(|source| TrainError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if text.is_empty() {
            return Err(TrainError::EmptyData {
                path: path.to_path_buf(),
            });
        }
        Ok(Self::from_text(&path.display().to_string(), &text))
    }

    pub fn from_text(name: &str, text: &str) -> TokenDataset {
        let tokenizer = CharTokenizer::from_text(text);
        // Every character is in the vocabulary it was built from.
        let ids = tokenizer.encode(text).unwrap_or_default();
        let split = ids.len() * 9 / 10;
        TokenDataset {
            tokenizer,
            train: ids[..split].to_vec(),
            val: ids[split..].to_vec(),
            name: name.to_string(),
        }
    }

    /// Fails unless both splits hold at least one sequence of `block` tokens plus its target.
    pub fn check_block(&self, block: usize) -> Result<(), TrainError> {
        let needed = block + 1;
        if self.train.len() < needed || self.val.len() < needed {
            return Err(TrainError::DataTooSmall {
                what: self.name.clone(),
                tokens: self.train.len() + self.val.len(),
                needed,
            });
        }
        Ok(())
    }
}

/// Draws `batch` random window starts for sequences of `block` tokens plus one target.
pub fn sample_starts(
    rng: &mut ChaCha8Rng,
    len: usize,
    batch: usize,
    block: usize,
    starts: &mut Vec<usize>,
) {
    starts.clear();
    let max_start = len - block - 1;
    starts.extend((0..batch).map(|_| rng.random_range(0..=max_start)));
}

/// Writes the windows `ids[s + shift .. s + shift + block]` for each start `s` into `out`
/// (`shift` 0 gives the inputs, 1 the next-token targets).
pub fn fill_windows(ids: &[u32], starts: &[usize], block: usize, shift: usize, out: &mut [i32]) {
    for (row, &s) in out.chunks_exact_mut(block).zip(starts) {
        for (o, &t) in row.iter_mut().zip(&ids[s + shift..s + shift + block]) {
            *o = t as i32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addition_lines_are_correct_sums() {
        let text = addition_text(200, 7);
        for line in text.lines() {
            let (lhs, sum) = line.split_once('=').unwrap();
            let (a, b) = lhs.split_once('+').unwrap();
            assert_eq!(
                a.parse::<u32>().unwrap() + b.parse::<u32>().unwrap(),
                sum.parse::<u32>().unwrap()
            );
        }
        assert_eq!(
            text,
            addition_text(200, 7),
            "seeded generation is deterministic"
        );
    }

    #[test]
    fn batches_are_shifted_windows() {
        let ids: Vec<u32> = (0..100).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let mut starts = Vec::new();
        sample_starts(&mut rng, ids.len(), 3, 8, &mut starts);
        let (mut x, mut y) = (vec![0; 24], vec![0; 24]);
        fill_windows(&ids, &starts, 8, 0, &mut x);
        fill_windows(&ids, &starts, 8, 1, &mut y);
        assert_eq!(
            x[..8],
            (starts[0] as i32..starts[0] as i32 + 8).collect::<Vec<_>>()[..]
        );
        for (a, b) in x.iter().zip(&y) {
            assert_eq!(a + 1, *b);
        }
    }

    #[test]
    fn empty_and_missing_files_are_named_errors() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.txt");
        std::fs::write(&empty, "").unwrap();
        assert!(
            matches!(TokenDataset::from_file(&empty), Err(TrainError::EmptyData { path }) if path == empty)
        );
        let missing = dir.path().join("missing.txt");
        let err = TokenDataset::from_file(&missing).unwrap_err();
        assert!(err.to_string().contains("missing.txt"));
        let small = TokenDataset::from_text("tiny", "abcdefghij");
        assert!(matches!(
            small.check_block(8),
            Err(TrainError::DataTooSmall { .. })
        ));
    }
}
