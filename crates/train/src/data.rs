//! Training data: a built-in generated data set (so `snug train` works on a fresh clone), text
//! files, prepared token directories (`snug prepare`), the train/validation split, deterministic
//! per-step batches, and a thread that prepares batches ahead of the training step.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::token_file::{TokenFile, TokenFileProblem};
use crate::user_file::MAX_TEXT_BYTES;
use crate::{CharTokenizer, Tokenizer, TrainError};

/// The training split's file in a prepared token directory.
pub const TRAIN_FILE: &str = "train.bin";
/// The validation split's file in a prepared token directory.
pub const VAL_FILE: &str = "val.bin";

/// Where training data comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// Generated two-digit additions, `"48+39=87\n"`: a language with exact rules, so a
    /// falling loss means the model is learning arithmetic, not memorising text.
    Addition,
    /// A text file, tokenized by characters and split 90/10.
    File(PathBuf),
    /// A directory holding `train.bin` and `val.bin` token files.
    Tokens(PathBuf),
}

impl DataSource {
    /// A directory is a prepared token directory; anything else is read as a text file.
    pub fn from_path(path: &Path) -> DataSource {
        if path.is_dir() {
            DataSource::Tokens(path.to_path_buf())
        } else {
            DataSource::File(path.to_path_buf())
        }
    }
}

pub use crate::addition::addition_text;

/// A split's token ids: in memory, or memory-mapped from a token file.
#[derive(Debug, Clone)]
pub enum Tokens {
    Owned(Vec<u32>),
    /// Ids of a vocabulary of at most 65,536 entries, in half the memory.
    Owned16(Vec<u16>),
    Mapped(TokenFile),
}

impl Tokens {
    /// `ids` in memory, two bytes each where every id fits.
    pub fn owned(ids: &[u32]) -> Tokens {
        if ids.iter().all(|&t| t <= u16::MAX as u32) {
            Tokens::Owned16(ids.iter().map(|&t| t as u16).collect())
        } else {
            Tokens::Owned(ids.to_vec())
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Tokens::Owned(v) => v.len(),
            Tokens::Owned16(v) => v.len(),
            Tokens::Mapped(f) => f.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `out.len()` tokens starting at `start` into `out`. Panics past the end.
    pub fn window(&self, start: usize, out: &mut [i32]) {
        match self {
            Tokens::Owned(v) => widen(&v[start..start + out.len()], out),
            Tokens::Owned16(v) => widen(&v[start..start + out.len()], out),
            Tokens::Mapped(f) => f.copy_window(start, out),
        }
    }

    /// Stops the pages of a memory-mapped split that reads touched from counting in the
    /// process's resident set ([`TokenFile::release_pages`]); nothing for tokens in memory.
    pub fn release_pages(&self) {
        if let Tokens::Mapped(f) = self {
            f.release_pages();
        }
    }

    /// Whether the tokens carry a loss mask (a token file written with one); without one
    /// every target counts.
    pub fn has_mask(&self) -> bool {
        matches!(self, Tokens::Mapped(f) if f.has_mask())
    }

    /// Copies the loss mask of tokens `start..start + out.len()` into `out` (all `true`
    /// without a mask). Panics past the end.
    pub fn mask_window(&self, start: usize, out: &mut [bool]) {
        match self {
            Tokens::Mapped(f) => f.copy_mask_window(start, out),
            _ => {
                assert!(start + out.len() <= self.len(), "mask window past the end");
                out.fill(true);
            }
        }
    }

    /// Feeds every token (as little-endian u32) and, where the tokens carry one, the loss mask
    /// into `hasher`, a window at a time: the same for the same ids however they are stored.
    fn hash_into(&self, hasher: &mut crc32fast::Hasher) {
        const WINDOW: usize = 1 << 20;
        let mut ids = vec![0i32; WINDOW.min(self.len())];
        let mut mask = vec![false; if self.has_mask() { ids.len() } else { 0 }];
        let mut bytes = Vec::with_capacity(4 * ids.len());
        let mut start = 0;
        while start < self.len() {
            let n = WINDOW.min(self.len() - start);
            self.window(start, &mut ids[..n]);
            bytes.clear();
            bytes.extend(ids[..n].iter().flat_map(|id| id.to_le_bytes()));
            hasher.update(&bytes);
            if !mask.is_empty() {
                self.mask_window(start, &mut mask[..n]);
                bytes.clear();
                bytes.extend(mask[..n].iter().map(|&m| u8::from(m)));
                hasher.update(&bytes);
            }
            // One pass over a mapped corpus would otherwise leave all of it resident.
            self.release_pages();
            start += n;
        }
    }

    /// Every token, in memory.
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            Tokens::Owned(v) => v.clone(),
            Tokens::Owned16(v) => v.iter().map(|&t| u32::from(t)).collect(),
            Tokens::Mapped(f) => f.to_vec(),
        }
    }
}

/// Ids as the step's i32 token inputs (vocabularies are far below 2^31).
fn widen<T: Copy + Into<u32>>(src: &[T], out: &mut [i32]) {
    for (o, &t) in out.iter_mut().zip(src) {
        *o = t.into() as i32;
    }
}

/// A tokenized corpus split into training and validation ids.
#[derive(Debug, Clone)]
pub struct TokenDataset {
    pub tokenizer: Tokenizer,
    pub train: Tokens,
    pub val: Tokens,
    pub name: String,
}

impl TokenDataset {
    /// CRC-32 of the training then the validation tokens (and their loss masks): a run records
    /// it, and a resume on data that changed since is refused (see `TrainConfig::data_crc32`).
    pub fn fingerprint(&self) -> u32 {
        let mut hasher = crc32fast::Hasher::new();
        self.train.hash_into(&mut hasher);
        self.val.hash_into(&mut hasher);
        hasher.finalize()
    }

    pub fn load(source: &DataSource) -> Result<TokenDataset, TrainError> {
        match source {
            DataSource::Addition => Ok(Self::from_text(
                "built-in addition data",
                &addition_text(50_000, 1234),
            )),
            DataSource::File(path) => Self::from_file(path),
            DataSource::Tokens(dir) => Self::from_dir(dir),
        }
    }

    /// A text file, character-tokenized, split 90/10. Only a regular file of at most
    /// [`MAX_TEXT_BYTES`] is read.
    pub fn from_file(path: &Path) -> Result<TokenDataset, TrainError> {
        let text = crate::user_file::read_text(path, MAX_TEXT_BYTES, "text data")?;
        if text.is_empty() {
            return Err(TrainError::EmptyData {
                path: path.to_path_buf(),
            });
        }
        Ok(Self::from_text(&path.display().to_string(), &text))
    }

    /// A text file encoded with `tokenizer` (a pretrained model's own, so the ids mean what
    /// its weights learned), split 90/10.
    pub fn from_file_with(path: &Path, tokenizer: Tokenizer) -> Result<TokenDataset, TrainError> {
        let text = crate::user_file::read_text(path, MAX_TEXT_BYTES, "text data")?;
        if text.is_empty() {
            return Err(TrainError::EmptyData {
                path: path.to_path_buf(),
            });
        }
        let ids = tokenizer
            .encode(&text)
            .map_err(|e| TrainError::DataEncoding {
                path: path.to_path_buf(),
                tokenizer: tokenizer.name().to_string(),
                detail: tokenizer
                    .unencodable_char(&text)
                    .unwrap_or_else(|| e.to_string()),
            })?;
        let split = ids.len() * 9 / 10;
        let (train, val) = ids.split_at(split);
        Ok(TokenDataset {
            tokenizer,
            train: Tokens::owned(train),
            val: Tokens::owned(val),
            name: path.display().to_string(),
        })
    }

    /// `text` with a character tokenizer built from it, split 90/10.
    pub fn from_text(name: &str, text: &str) -> TokenDataset {
        let tokenizer = CharTokenizer::from_text(text);
        // Every character is in the vocabulary it was built from.
        let ids = tokenizer.encode(text).unwrap_or_default();
        let split = ids.len() * 9 / 10;
        let (train, val) = ids.split_at(split);
        TokenDataset {
            tokenizer: Tokenizer::Char(tokenizer),
            train: Tokens::owned(train),
            val: Tokens::owned(val),
            name: name.to_string(),
        }
    }

    /// A directory prepared by `snug prepare`: `train.bin` and `val.bin`, memory-mapped. Both
    /// must carry the same tokenizer.
    pub fn from_dir(dir: &Path) -> Result<TokenDataset, TrainError> {
        let train = TokenFile::open(&dir.join(TRAIN_FILE))?;
        let val_path = dir.join(VAL_FILE);
        let val = TokenFile::open(&val_path)?;
        if train.tokenizer() != val.tokenizer() {
            return Err(TrainError::TokenFile {
                path: val_path,
                problem: TokenFileProblem::Spec {
                    detail: format!(
                        "its {} tokenizer differs from the {} tokenizer of {TRAIN_FILE} beside it",
                        val.tokenizer().name(),
                        train.tokenizer().name()
                    ),
                },
            });
        }
        if let (Some(t), Some(v)) = (train.prepared(), val.prepared()) {
            if t != v {
                return Err(TrainError::TokenFile {
                    path: val_path,
                    problem: TokenFileProblem::Spec {
                        detail: format!(
                            "it was written by another `snug prepare` than {TRAIN_FILE} beside \
                             it (one stopped between replacing the two?): prepare the corpus \
                             again"
                        ),
                    },
                });
            }
        }
        // A step would average over no target: a loss and gradients of 0, every step; an
        // evaluation would report a validation loss of 0.
        for (file, split, tokens, what) in [
            (
                TRAIN_FILE,
                "training",
                &train,
                "training would learn nothing",
            ),
            (
                VAL_FILE,
                "validation",
                &val,
                "every validation loss would read 0",
            ),
        ] {
            if tokens.has_mask() && tokens.counted_targets() == 0 {
                return Err(TrainError::TokenFile {
                    path: dir.join(file),
                    problem: TokenFileProblem::Mask {
                        detail: format!(
                            "it keeps no target: no token of the {split} split counts in the \
                             loss (its examples' completions are empty?), so {what}"
                        ),
                    },
                });
            }
        }
        Ok(TokenDataset {
            tokenizer: train.tokenizer().clone(),
            train: Tokens::Mapped(train),
            val: Tokens::Mapped(val),
            name: dir.display().to_string(),
        })
    }

    /// Bytes the splits hold in memory, outside the plan (a text file's ids); 0 for
    /// memory-mapped token files, whose pages are the page cache's.
    pub fn resident_bytes(&self) -> u64 {
        [&self.train, &self.val]
            .iter()
            .map(|t| match t {
                Tokens::Owned(v) => 4 * v.len() as u64,
                Tokens::Owned16(v) => 2 * v.len() as u64,
                Tokens::Mapped(_) => 0,
            })
            .sum()
    }

    /// Whether either split carries a loss mask: a trainer on this data then counts only the
    /// targets the mask keeps.
    pub fn has_loss_mask(&self) -> bool {
        self.train.has_mask() || self.val.has_mask()
    }

    /// Fails unless both splits hold at least one sequence of `block` tokens plus its target.
    pub fn check_block(&self, block: usize) -> Result<(), TrainError> {
        let needed = block.saturating_add(1);
        for (split, tokens) in [("training", &self.train), ("validation", &self.val)] {
            if tokens.len() < needed {
                return Err(TrainError::DataTooSmall {
                    what: self.name.clone(),
                    split,
                    tokens: tokens.len(),
                    needed,
                });
            }
        }
        Ok(())
    }
}

/// The most memory a text `--data` file of `text_bytes` bytes takes while it loads: the text,
/// a u32 id per character while it is encoded, and the splits' copies at 2 bytes a character
/// (4 where an id does not fit in 2); a character is at least a byte. Seven times its size.
pub fn text_load_bytes(text_bytes: u64) -> u64 {
    text_bytes.saturating_mul(7)
}

/// Refuses, before it is read, a text `--data` file whose loading ([`text_load_bytes`]) would
/// not leave room in a `budget` of bytes (`--memory SIZE`): the text and its ids live outside
/// the plan. A file that is not there passes, for the read to name.
pub fn check_text_data_budget(path: &Path, budget: u64) -> Result<(), TrainError> {
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(());
    };
    if !meta.is_file() {
        return Ok(());
    }
    let load_bytes = text_load_bytes(meta.len());
    if load_bytes >= budget {
        return Err(TrainError::TextDataOverBudget {
            path: path.to_path_buf(),
            text_bytes: meta.len(),
            load_bytes,
            budget,
        });
    }
    Ok(())
}

/// Keeps batch sampling's random stream apart from parameter initialisation, which seeds
/// ChaCha8 with the bare seed.
const DATA_SEED_SALT: u64 = 0x5EED_DA7A;

/// Writes into `out` the `count` window starts of step `step`'s batch, each uniform in
/// `0..=len - block - 1` (room for `block` inputs and the shifted target).
///
/// The starts depend only on `(seed, step)`: a ChaCha8 stream per step, so no random state is
/// carried between steps. A resumed run draws the same batches as an uninterrupted one, and a
/// batch split into micro-batches is the same batch. Needs `len ≥ block + 1`
/// ([`TokenDataset::check_block`]); shorter data yields starts of 0.
pub fn batch_starts(
    seed: u64,
    step: u64,
    len: usize,
    count: usize,
    block: usize,
    out: &mut Vec<usize>,
) {
    out.clear();
    let max_start = len.saturating_sub(block + 1);
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ DATA_SEED_SALT);
    rng.set_stream(step);
    out.extend((0..count).map(|_| rng.random_range(0..=max_start)));
}

/// Fills `x` with the windows `tokens[s..s + block]` and `y` with their next-token targets
/// `tokens[s + 1..s + block + 1]`, one row of `block` per start. Panics if a window runs past
/// the end of `tokens`.
pub fn fill_batch(tokens: &Tokens, starts: &[usize], block: usize, x: &mut [i32], y: &mut [i32]) {
    debug_assert_eq!(x.len(), starts.len() * block);
    debug_assert_eq!(y.len(), starts.len() * block);
    for ((xr, yr), &s) in x
        .chunks_exact_mut(block)
        .zip(y.chunks_exact_mut(block))
        .zip(starts)
    {
        tokens.window(s, xr);
        tokens.window(s + 1, yr);
    }
    // A long run's random windows would otherwise leave the corpus's pages they touched
    // resident in the process, the whole of it in time.
    tokens.release_pages();
}

/// Fills `mask` with the loss mask of the targets [`fill_batch`] writes for the same starts:
/// `tokens`' mask of `s + 1..s + block + 1` for each start `s` (the mask belongs to targets).
pub fn fill_mask(tokens: &Tokens, starts: &[usize], block: usize, mask: &mut [bool]) {
    debug_assert_eq!(mask.len(), starts.len() * block);
    for (m, &s) in mask.chunks_exact_mut(block).zip(starts) {
        tokens.mask_window(s + 1, m);
    }
    tokens.release_pages();
}

/// One step's batch: `batch × block` inputs (`x`) and targets (`y`), row-major, and which
/// targets count in the loss (`mask`; `None`: all of them).
///
/// The trainer draws its own batches ([`Batch::compute`]), which record the step and the
/// window starts they were drawn for; a batch a caller gives [`crate::Trainer::step_on`]
/// ([`Batch::new`]) needs neither.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub step: u64,
    pub starts: Vec<usize>,
    pub x: Vec<i32>,
    pub y: Vec<i32>,
    pub mask: Option<Vec<bool>>,
}

impl Batch {
    /// A batch of token ids `x`, their next-token targets `y` and optionally the targets that
    /// count, for [`crate::Trainer::step_on`], which checks them against its step.
    pub fn new(x: Vec<i32>, y: Vec<i32>, mask: Option<Vec<bool>>) -> Batch {
        Batch {
            step: 0,
            starts: Vec::new(),
            x,
            y,
            mask,
        }
    }

    /// Step `step`'s batch of the training split, computed here and now; with the split's loss
    /// mask when it has one.
    pub fn compute(data: &TokenDataset, seed: u64, step: u64, count: usize, block: usize) -> Batch {
        let mut starts = Vec::with_capacity(count);
        batch_starts(seed, step, data.train.len(), count, block, &mut starts);
        let (mut x, mut y) = (vec![0; count * block], vec![0; count * block]);
        fill_batch(&data.train, &starts, block, &mut x, &mut y);
        let mask = data.train.has_mask().then(|| {
            let mut m = vec![true; count * block];
            fill_mask(&data.train, &starts, block, &mut m);
            m
        });
        Batch {
            step,
            starts,
            x,
            y,
            mask,
        }
    }

    /// The targets that count: those the mask keeps, or all of them.
    pub fn counted(&self) -> usize {
        self.mask
            .as_ref()
            .map_or(self.y.len(), |m| m.iter().filter(|&&c| c).count())
    }
}

/// Prepares the training split's batches for steps `first_step, first_step + 1, …` on a
/// background thread, at most two ahead, so a step never waits for data (a memory-mapped
/// corpus may fault pages in). The batches live outside the allocator: at most four (two
/// queued, one being built, one being consumed) of `count × block × 8` bytes each (9 with a
/// loss mask).
///
/// Dropping it stops the thread: the queue closes, the thread's next send fails, and it exits.
pub struct Prefetcher {
    rx: Option<Receiver<Batch>>,
    handle: Option<JoinHandle<()>>,
    /// Why no thread runs, found at construction and reported by the first [`Prefetcher::next`].
    startup_error: Option<TrainError>,
}

impl Prefetcher {
    /// Starts producing `count` sequences of `block` tokens per step. Never fails itself: data
    /// too small for `block`, or a thread that cannot start, is the first `next`'s error, so a
    /// caller can hold a prefetcher before it knows it will train.
    pub fn new(
        data: Arc<TokenDataset>,
        seed: u64,
        count: usize,
        block: usize,
        first_step: u64,
    ) -> Prefetcher {
        let stopped = |e| Prefetcher {
            rx: None,
            handle: None,
            startup_error: Some(e),
        };
        if let Err(e) = data.check_block(block) {
            return stopped(e);
        }
        // The batches live outside the plan: one the machine could not hold is refused here,
        // not left to abort the process when its buffer is allocated.
        let bytes = count.checked_mul(block).and_then(|t| t.checked_mul(4 * 9));
        let available = snug_runtime::process::available_memory();
        if bytes.is_none_or(|b| available.is_some_and(|a| b > a)) {
            return stopped(TrainError::BatchTooLarge {
                count,
                block,
                bytes,
                available,
            });
        }
        let (tx, rx) = sync_channel(2);
        let spawned = std::thread::Builder::new()
            .name("snug-prefetch".into())
            .spawn(move || {
                let mut step = first_step;
                // A failed send means the receiver is gone: stop.
                while tx
                    .send(Batch::compute(&data, seed, step, count, block))
                    .is_ok()
                {
                    step += 1;
                }
            });
        match spawned {
            Ok(handle) => Prefetcher {
                rx: Some(rx),
                handle: Some(handle),
                startup_error: None,
            },
            Err(e) => stopped(TrainError::Prefetch(format!(
                "could not start the thread: {e}"
            ))),
        }
    }

    /// The next step's batch, waiting only if the thread has fallen behind.
    #[allow(clippy::should_implement_trait)] // fallible, so not an `Iterator`
    pub fn next(&mut self) -> Result<Batch, TrainError> {
        if let Some(e) = self.startup_error.take() {
            return Err(e);
        }
        if let Some(batch) = self.rx.as_ref().and_then(|rx| rx.recv().ok()) {
            return Ok(batch);
        }
        // The sender is gone, so the thread has ended: by a panic, whose message we report.
        let detail = match self.handle.take().map(JoinHandle::join) {
            Some(Err(payload)) => payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "it panicked".into()),
            _ => "it is not running".into(),
        };
        Err(TrainError::Prefetch(detail))
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        // Close the queue first so a thread blocked on a full queue wakes up and exits.
        drop(self.rx.take());
        if let Some(h) = self.handle.take() {
            // A panic in the thread was either reported by `next_batch` or is moot now.
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ids that fit in two bytes are kept in two, one that does not keeps all four; either
    /// way windows and copies give the ids back.
    #[test]
    fn owned_tokens_narrow_only_when_every_id_fits() {
        let small: Vec<u32> = vec![0, 7, 65_535, 3];
        let wide: Vec<u32> = vec![0, 7, 65_536, 3];
        assert!(matches!(Tokens::owned(&small), Tokens::Owned16(_)));
        assert!(matches!(Tokens::owned(&wide), Tokens::Owned(_)));
        for ids in [small, wide] {
            let t = Tokens::owned(&ids);
            assert_eq!(t.to_vec(), ids);
            let mut out = [0i32; 2];
            t.window(1, &mut out);
            assert_eq!(out, [ids[1] as i32, ids[2] as i32]);
        }
        let text = addition_text(100, 3);
        let d = TokenDataset::from_text("sums", &text);
        assert!(matches!(d.train, Tokens::Owned16(_)));
        assert_eq!(d.train.len() + d.val.len(), text.chars().count());
    }

    #[test]
    fn batches_are_shifted_windows() {
        let tokens = Tokens::Owned((0..100).collect());
        let mut starts = Vec::new();
        batch_starts(0, 1, tokens.len(), 3, 8, &mut starts);
        assert_eq!(starts.len(), 3);
        let (mut x, mut y) = (vec![0; 24], vec![0; 24]);
        fill_batch(&tokens, &starts, 8, &mut x, &mut y);
        for (row, &s) in x.chunks(8).zip(&starts) {
            assert_eq!(row, (s as i32..s as i32 + 8).collect::<Vec<_>>());
        }
        for (a, b) in x.iter().zip(&y) {
            assert_eq!(a + 1, *b);
        }
    }

    #[test]
    fn batch_starts_depend_only_on_seed_and_step_and_cover_the_range() {
        let (len, block) = (50, 9);
        let draw = |seed, step| {
            let mut v = vec![123; 7]; // stale contents are replaced
            batch_starts(seed, step, len, 40, block, &mut v);
            v
        };
        // Same (seed, step): same starts, whatever was drawn before.
        let a = draw(1, 5);
        let _ = draw(1, 4);
        assert_eq!(draw(1, 5), a);
        assert_eq!(a.len(), 40);
        assert_ne!(draw(1, 6), a, "steps differ");
        assert_ne!(draw(2, 5), a, "seeds differ");
        // Uniform over 0..=len - block - 1: both ends are reached, nothing beyond.
        let mut seen = vec![false; len - block];
        for step in 0..200 {
            for s in draw(3, step) {
                assert!(s < len - block, "start {s}");
                seen[s] = true;
            }
        }
        assert!(seen.iter().all(|&b| b), "{seen:?}");
        // Micro-batches: the first k starts of a batch of n are the batch of k.
        let mut big = Vec::new();
        let mut small = Vec::new();
        batch_starts(9, 3, 1000, 16, 8, &mut big);
        batch_starts(9, 3, 1000, 4, 8, &mut small);
        assert_eq!(big[..4], small[..]);
    }

    #[test]
    fn mapped_and_owned_tokens_give_the_same_batches() {
        let dir = tempfile::tempdir().unwrap();
        let data = TokenDataset::from_text("t", &addition_text(300, 3));
        crate::TokenFile::write(
            &dir.path().join(TRAIN_FILE),
            &data.tokenizer,
            &data.train.to_vec(),
        )
        .unwrap();
        crate::TokenFile::write(
            &dir.path().join(VAL_FILE),
            &data.tokenizer,
            &data.val.to_vec(),
        )
        .unwrap();
        let mapped = TokenDataset::load(&DataSource::from_path(dir.path())).unwrap();
        assert!(matches!(mapped.train, Tokens::Mapped(_)));
        assert_eq!(mapped.tokenizer, data.tokenizer);
        assert_eq!(
            (mapped.train.len(), mapped.val.len()),
            (data.train.len(), data.val.len())
        );
        for step in 1..5 {
            assert_eq!(
                Batch::compute(&mapped, 7, step, 4, 32),
                Batch::compute(&data, 7, step, 4, 32)
            );
        }
    }

    /// Resident bytes of this process's mappings of `path` (`Rss` in `/proc/self/smaps`).
    #[cfg(target_os = "linux")]
    fn mapped_rss(path: &Path) -> u64 {
        let path = path.canonicalize().unwrap();
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        let mut kib = 0;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if first.contains('-') && !first.ends_with(':') {
                inside = line.ends_with(&*path.to_string_lossy());
            } else if inside && first == "Rss:" {
                kib += line
                    .split_whitespace()
                    .nth(1)
                    .unwrap()
                    .parse::<u64>()
                    .unwrap();
            }
        }
        kib << 10
    }

    /// Reading a mapped corpus (the run's CRC over all of it, the mask's count, the batches)
    /// leaves none of its pages in the process's resident set: before, the CRC alone left
    /// the whole file there (a 2.2 GB train.bin made a `--memory 200MiB` run's RSS 2.49 GB).
    #[cfg(target_os = "linux")]
    #[test]
    fn reading_mapped_tokens_leaves_no_pages_resident() {
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = Tokenizer::Char(CharTokenizer::from_text("abcdefgh"));
        let n = 4 << 20; // 8 MiB of u16 tokens
        let ids: Vec<u32> = (0..n as u32).map(|i| i % 8).collect();
        let mask: Vec<bool> = (0..n).map(|i| i % 3 != 0).collect();
        let train = dir.path().join(TRAIN_FILE);
        crate::TokenFile::write_masked(&train, &tokenizer, &ids, &mask).unwrap();
        crate::TokenFile::write_masked(&dir.path().join(VAL_FILE), &tokenizer, &ids, &mask)
            .unwrap();
        let data = TokenDataset::from_dir(dir.path()).unwrap();
        let limit = 1 << 20;
        assert!(
            mapped_rss(&train) < limit,
            "{} after opening",
            mapped_rss(&train)
        );
        let crc = data.fingerprint();
        assert!(
            mapped_rss(&train) < limit,
            "{} after the CRC",
            mapped_rss(&train)
        );
        for step in 0..20 {
            let b = Batch::compute(&data, 1, step, 64, 1024);
            assert_eq!(b.mask.as_ref().map(Vec::len), Some(64 * 1024));
        }
        assert!(
            mapped_rss(&train) < limit,
            "{} after batches",
            mapped_rss(&train)
        );
        // The pages read again give the same tokens.
        assert_eq!(data.fingerprint(), crc);
        let mut w = [0i32; 5];
        data.train.window(8, &mut w);
        assert_eq!(w, [0, 1, 2, 3, 4]);
    }

    /// A text file too large to load within `--memory` is refused before it is read, naming
    /// it; one that fits passes, and the ids it holds are counted. Before, a 1.23 GB file
    /// was read under `--memory 200MiB` and the run's peak RSS was 8.6 GB.
    #[test]
    fn text_data_is_checked_against_the_budget_before_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("corpus.txt");
        std::fs::write(&path, "abcdefghij".repeat(100)).unwrap();
        match check_text_data_budget(&path, 7000) {
            Err(TrainError::TextDataOverBudget {
                path: p,
                text_bytes: 1000,
                load_bytes: 7000,
                budget: 7000,
            }) => assert_eq!(p, path),
            other => panic!("{other:?}"),
        }
        let err = check_text_data_budget(&path, 7000).unwrap_err().to_string();
        assert!(
            err.contains("corpus.txt") && err.contains("snug prepare"),
            "{err}"
        );
        assert!(check_text_data_budget(&path, 7001).is_ok());
        assert!(check_text_data_budget(&dir.path().join("missing.txt"), 1).is_ok());
        let data = TokenDataset::from_file(&path).unwrap();
        assert_eq!(data.resident_bytes(), 2 * 1000);
        assert!(data.resident_bytes() <= text_load_bytes(1000));
    }

    #[test]
    fn token_directories_must_be_complete_and_agree() {
        let dir = tempfile::tempdir().unwrap();
        let abc = Tokenizer::Char(CharTokenizer::from_text("abc"));
        let abd = Tokenizer::Char(CharTokenizer::from_text("abd"));
        crate::TokenFile::write(&dir.path().join(TRAIN_FILE), &abc, &[0, 1, 2]).unwrap();
        let err = TokenDataset::from_dir(dir.path()).unwrap_err();
        assert!(
            matches!(&err, TrainError::Io { path, .. } if path.ends_with(VAL_FILE)),
            "{err}"
        );
        crate::TokenFile::write(&dir.path().join(VAL_FILE), &abd, &[0, 1, 2]).unwrap();
        match TokenDataset::from_dir(dir.path()) {
            Err(TrainError::TokenFile {
                path,
                problem: TokenFileProblem::Spec { .. },
            }) => assert!(path.ends_with(VAL_FILE)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn data_source_follows_the_path_kind() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            DataSource::from_path(dir.path()),
            DataSource::Tokens(dir.path().to_path_buf())
        );
        let file = dir.path().join("a.txt");
        assert_eq!(DataSource::from_path(&file), DataSource::File(file.clone()));
    }

    #[test]
    fn prefetched_batches_equal_computed_ones() {
        let data = Arc::new(TokenDataset::from_text("t", &addition_text(500, 1)));
        let mut p = Prefetcher::new(data.clone(), 42, 3, 16, 10);
        for step in 10..20 {
            let b = p.next().unwrap();
            assert_eq!(b, Batch::compute(&data, 42, step, 3, 16));
            assert_eq!((b.step, b.x.len(), b.starts.len()), (step, 48, 3));
        }
        // Dropping it with a full queue (the thread blocked on send) stops the thread, which
        // releases its handle on the data.
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(p);
        assert_eq!(Arc::strong_count(&data), 1, "the thread released the data");
        // Data too small for the block: no thread, and the first batch is the typed error.
        let mut p = Prefetcher::new(data, 0, 2, 1 << 20, 1);
        assert!(matches!(p.next(), Err(TrainError::DataTooSmall { .. })));
        assert!(matches!(p.next(), Err(TrainError::Prefetch(_))));
    }

    /// The error names the split that is short and gives that split's own count, not the sum
    /// of both.
    #[test]
    fn too_few_tokens_names_the_split_and_its_own_count() {
        let data = |train: usize, val: usize| TokenDataset {
            tokenizer: Tokenizer::Char(CharTokenizer::from_text("ab")),
            train: Tokens::owned(&vec![0; train]),
            val: Tokens::owned(&vec![1; val]),
            name: "corpus".into(),
        };
        let err = data(100, 5).check_block(8).unwrap_err();
        assert!(
            matches!(
                err,
                TrainError::DataTooSmall {
                    split: "validation",
                    tokens: 5,
                    needed: 9,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "corpus: the validation split holds 5 tokens, too few for one sequence of block + 1 = 9 tokens"
        );
        let err = data(4, 100).check_block(8).unwrap_err();
        assert!(
            matches!(
                err,
                TrainError::DataTooSmall {
                    split: "training",
                    tokens: 4,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("training split holds 4 tokens"));
        assert!(data(9, 9).check_block(8).is_ok());
        // A block at the top of usize is too large, not an overflow.
        assert!(data(9, 9).check_block(usize::MAX).is_err());
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
