//! The built-in addition language (`48+39=87`: operands below 100), its held-out problems, and how well a model
//! solves them.
//!
//! The problem space (pairs of operands below [`OPERAND_LIMIT`]) is split once and for all:
//! about one pair in [`HELD_OUT_ONE_IN`] is held out and never written into the training
//! text, whatever its seed, so accuracy on held-out problems measures addition learned, not
//! lines remembered. `a+b` and `b+a` fall on the same side.

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::{Sampler, Tokenizer, TrainError};

/// Operands are below this.
pub const OPERAND_LIMIT: u32 = 100;
/// One pair in this many is held out of the training text.
pub const HELD_OUT_ONE_IN: u64 = 16;
/// The seed of the held-out problems `snug train` scores (any seed draws held-out pairs).
pub const HELD_OUT_SEED: u64 = 0xE7A1;
/// Problems `snug train` scores at the end of a run on the built-in data.
pub const DEFAULT_PROBLEMS: usize = 200;
/// Most characters of an answer: three digits (99 + 99).
const MAX_ANSWER_CHARS: usize = 3;

/// The most tokens scoring one problem puts in the context: `"\n99+99="` and at most
/// `MAX_ANSWER_CHARS + 1` generated tokens (the language is ASCII, so no token is shorter than
/// a character). A sampler of this context holds all of it, however long the model's window.
pub const SCORING_CONTEXT: usize = 7 + MAX_ANSWER_CHARS + 1;

/// One addition, `a + b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Problem {
    pub a: u32,
    pub b: u32,
}

impl Problem {
    /// Whether this pair is held out of every training text.
    pub fn is_held_out(self) -> bool {
        let (lo, hi) = (self.a.min(self.b), self.a.max(self.b));
        mix(u64::from(lo) * u64::from(OPERAND_LIMIT) + u64::from(hi))
            .is_multiple_of(HELD_OUT_ONE_IN)
    }

    /// `"48+39="`: what the model is given.
    pub fn question(self) -> String {
        format!("{}+{}=", self.a, self.b)
    }

    /// `"87"`: the digits the model should write after the question.
    pub fn answer(self) -> String {
        (self.a + self.b).to_string()
    }

    /// `"48+39=87\n"`: one line of the language.
    pub fn line(self) -> String {
        format!("{}{}\n", self.question(), self.answer())
    }
}

/// SplitMix64's finalizer: spreads neighbouring pairs over both sides of the split.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn random_problem(rng: &mut ChaCha8Rng) -> Problem {
    Problem {
        a: rng.random_range(0..OPERAND_LIMIT),
        b: rng.random_range(0..OPERAND_LIMIT),
    }
}

/// `lines` additions drawn from `seed`, none of them held out: the training text.
pub fn addition_text(lines: usize, seed: u64) -> String {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut s = String::with_capacity(lines * 12);
    let mut written = 0;
    while written < lines {
        let p = random_problem(&mut rng);
        if !p.is_held_out() {
            s += &p.line();
            written += 1;
        }
    }
    s
}

/// `count` distinct held-out problems drawn from `seed`.
pub fn held_out_problems(count: usize, seed: u64) -> Vec<Problem> {
    // At most half the held-out pairs (about 625), so distinct draws end quickly.
    let count = count.min(held_out_pair_count() / 2);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut seen = std::collections::HashSet::with_capacity(count);
    let mut problems = Vec::with_capacity(count);
    while problems.len() < count {
        let p = random_problem(&mut rng);
        if p.is_held_out() && seen.insert(p) {
            problems.push(p);
        }
    }
    problems
}

fn held_out_pair_count() -> usize {
    let n = OPERAND_LIMIT as usize;
    n * n / HELD_OUT_ONE_IN as usize
}

/// Whether `generated` (what the model wrote after the question) is exactly `answer` followed
/// by the end of the line.
pub fn is_exact(generated: &str, answer: &str) -> bool {
    generated.strip_prefix(answer) == Some("\n")
}

/// How a model did on held-out problems.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AdditionScore {
    pub problems: usize,
    pub correct: usize,
    /// Time to score them all.
    pub ms: f64,
    /// Up to three problems answered wrongly, as `"48+39=86"`.
    pub wrong: Vec<String>,
}

impl AdditionScore {
    /// Correct answers as a fraction of problems (0 with no problems).
    pub fn accuracy(&self) -> f64 {
        if self.problems == 0 {
            0.0
        } else {
            self.correct as f64 / self.problems as f64
        }
    }
}

/// Scores `problems` on `sampler`: each question, after a newline (a line's start, as in
/// training), is answered greedily (temperature 0) and must match its answer and end the line.
/// Decoding stops at the first wrong character, which cannot turn into a right answer.
pub fn score(
    sampler: &mut Sampler,
    tokenizer: &Tokenizer,
    problems: &[Problem],
) -> Result<AdditionScore, TrainError> {
    let start = Instant::now();
    let mut correct = 0;
    let mut wrong = Vec::new();
    for &p in problems {
        let mut context = tokenizer.encode(&format!("\n{}", p.question()))?;
        let want = format!("{}\n", p.answer());
        let mut got = String::new();
        while got.len() <= MAX_ANSWER_CHARS && want.starts_with(&got) && !got.ends_with('\n') {
            let next = argmax(&sampler.next_token_logits(&context)?);
            context.push(next);
            got += &tokenizer.decode(&[next]);
        }
        if is_exact(&got, &p.answer()) {
            correct += 1;
        } else if wrong.len() < 3 {
            // For the examples shown, the whole wrong answer.
            while got.len() <= MAX_ANSWER_CHARS && !got.ends_with('\n') {
                let next = argmax(&sampler.next_token_logits(&context)?);
                context.push(next);
                got += &tokenizer.decode(&[next]);
            }
            wrong.push(format!("{}{}", p.question(), got.trim_end()));
        }
    }
    Ok(AdditionScore {
        problems: problems.len(),
        correct,
        ms: start.elapsed().as_secs_f64() * 1e3,
        wrong,
    })
}

/// Accuracy of `sampler` on `count` held-out problems from [`HELD_OUT_SEED`].
pub fn held_out_accuracy(
    sampler: &mut Sampler,
    tokenizer: &Tokenizer,
    count: usize,
) -> Result<AdditionScore, TrainError> {
    score(sampler, tokenizer, &held_out_problems(count, HELD_OUT_SEED))
}

/// The id of the largest logit, the lowest on ties (as greedy sampling picks).
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_correct_sums_and_never_held_out() {
        let text = addition_text(2000, 7);
        for line in text.lines() {
            let (lhs, sum) = line.split_once('=').unwrap();
            let (a, b) = lhs.split_once('+').unwrap();
            let (a, b): (u32, u32) = (a.parse().unwrap(), b.parse().unwrap());
            assert_eq!(a + b, sum.parse::<u32>().unwrap());
            assert!(!Problem { a, b }.is_held_out(), "{line}");
        }
        assert_eq!(text, addition_text(2000, 7), "seeded generation");
    }

    /// About one pair in 16 is held out, symmetrically, and held-out draws are distinct.
    #[test]
    fn the_split_holds_out_a_sixteenth_symmetrically() {
        let mut held = 0;
        for a in 0..OPERAND_LIMIT {
            for b in 0..OPERAND_LIMIT {
                let p = Problem { a, b };
                held += usize::from(p.is_held_out());
                assert_eq!(p.is_held_out(), Problem { a: b, b: a }.is_held_out());
            }
        }
        let expected = held_out_pair_count();
        assert!(held.abs_diff(expected) < expected / 5, "{held} held out");
        let problems = held_out_problems(300, 3);
        assert_eq!(problems.len(), 300);
        let distinct: std::collections::HashSet<_> = problems.iter().collect();
        assert_eq!(distinct.len(), 300);
        assert!(problems.iter().all(|p| p.is_held_out()));
    }

    /// No held-out problem is in the built-in data's training or validation text.
    #[test]
    fn held_out_problems_are_not_in_the_built_in_data() {
        let data = crate::TokenDataset::load(&crate::DataSource::Addition).unwrap();
        let text = String::from("\n")
            + &data.tokenizer.decode(&data.train.to_vec())
            + &data.tokenizer.decode(&data.val.to_vec());
        for p in held_out_problems(DEFAULT_PROBLEMS, HELD_OUT_SEED) {
            // With the newline before it: `2+3=5` is inside `12+3=15`.
            assert!(!text.contains(&format!("\n{}", p.line())), "{p:?}");
        }
    }

    #[test]
    fn only_the_answer_then_the_line_end_is_exact() {
        let p = Problem { a: 48, b: 39 };
        assert_eq!((p.question(), p.answer()), ("48+39=".into(), "87".into()));
        assert_eq!(p.line(), "48+39=87\n");
        assert!(is_exact("87\n", "87"));
        for wrong in ["87", "870\n", "8\n", "78\n", "", "87 \n", "\n", "87\n\n"] {
            assert!(!is_exact(wrong, "87"), "{wrong:?}");
        }
    }
}
