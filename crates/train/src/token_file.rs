//! Token files: a tokenized corpus on disk, written once by `snug prepare` and memory-mapped
//! read-only for training, so a corpus larger than RAM costs only the pages a batch touches.
//!
//! Layout (all integers little-endian):
//!
//! | bytes | field |
//! | --- | --- |
//! | 8 | magic `SNUGTOK\0` |
//! | 4 | version, u32: 1 (tokens) or 2 (tokens and a loss mask) |
//! | 1 | dtype: bytes per token, 2 (u16, when the vocabulary has at most 65,536 ids) or 4 (u32) |
//! | 8 | token count, u64 |
//! | 4 | tokenizer spec length in bytes, u32 |
//! | n | tokenizer spec, JSON ([`TokenizerSpec`]); `snug prepare` adds a `"prepared"` key, the same in both splits |
//! | count × dtype | tokens |
//! | ⌈count / 8⌉ | version 2 only: the loss mask, one bit per token (token `i` is bit `i % 8` of byte `i / 8`; unused bits 0) |
//!
//! Bit `i` of the mask says whether token `i` counts as a target (see [`crate::examples`]).
//! Version 1 files have no mask: every token counts. Files without a mask are still written
//! as version 1, byte for byte as before masks existed.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::{Tokenizer, TokenizerSpec, TrainError};

pub const MAGIC: [u8; 8] = *b"SNUGTOK\0";
/// The newest version: 2 added the loss mask.
pub const VERSION: u32 = 2;
/// Version of files without a mask.
const VERSION_NO_MASK: u32 = 1;
/// Magic, version, dtype, count and the spec's length: everything before the spec.
const FIXED_HEADER: usize = 8 + 4 + 1 + 8 + 4;
/// Byte offsets of the fixed fields.
const VERSION_AT: usize = 8;
const DTYPE_AT: usize = 12;
const COUNT_AT: usize = 13;
const SPEC_LEN_AT: usize = 21;

/// Why a file is not a valid token file; each message starts with the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileProblem {
    #[error("magic: expected {:?}, found {:?} (not a snug token file)", String::from_utf8_lossy(&MAGIC), String::from_utf8_lossy(found))]
    BadMagic { found: Vec<u8> },
    #[error("version: {found} is not supported (this build reads versions {VERSION_NO_MASK} and {VERSION})")]
    Version { found: u32 },
    #[error("dtype: unknown code {code} (expected 2 for u16 tokens or 4 for u32)")]
    Dtype { code: u8 },
    #[error("{field}: the file is {len} bytes, too short to hold it ({needed} bytes needed)")]
    Truncated {
        field: &'static str,
        len: u64,
        needed: u64,
    },
    #[error("count: the header says {count} tokens ({expected} bytes after the header) but the file holds {actual} bytes after it")]
    Count {
        count: u64,
        expected: u128,
        actual: u64,
    },
    #[error("tokenizer: {detail}")]
    Spec { detail: String },
    #[error("mask: {detail}")]
    Mask { detail: String },
    #[error(
        "tokens: token {token} at index {index} is outside the tokenizer's vocabulary of {vocab}"
    )]
    TokenOutOfRange {
        index: u64,
        token: u32,
        vocab: usize,
    },
}

impl TokenFileProblem {
    /// The header field (or `"tokens"`) the problem is in.
    pub fn field(&self) -> &'static str {
        match self {
            TokenFileProblem::BadMagic { .. } => "magic",
            TokenFileProblem::Version { .. } => "version",
            TokenFileProblem::Dtype { .. } => "dtype",
            TokenFileProblem::Truncated { field, .. } => field,
            TokenFileProblem::Count { .. } => "count",
            TokenFileProblem::Spec { .. } => "tokenizer",
            TokenFileProblem::Mask { .. } => "mask",
            TokenFileProblem::TokenOutOfRange { .. } => "tokens",
        }
    }
}

/// Storage type of the tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenDtype {
    U16,
    U32,
}

impl TokenDtype {
    /// The narrowest type that holds every id of a `vocab`-token vocabulary.
    pub fn for_vocab(vocab: usize) -> TokenDtype {
        if vocab <= 1 << 16 {
            TokenDtype::U16
        } else {
            TokenDtype::U32
        }
    }

    pub fn bytes(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }

    fn from_code(code: u8) -> Option<TokenDtype> {
        match code {
            2 => Some(TokenDtype::U16),
            4 => Some(TokenDtype::U32),
            _ => None,
        }
    }
}

/// An open, validated token file.
#[derive(Clone)]
pub struct TokenFile {
    path: PathBuf,
    map: Arc<Mmap>,
    /// Byte offset of the first token.
    offset: usize,
    len: usize,
    dtype: TokenDtype,
    tokenizer: Tokenizer,
    /// Byte offset of the loss mask (version 2); `None`: every token counts.
    mask_offset: Option<usize>,
    /// The `snug prepare` that wrote the file (its spec's `"prepared"` key), shared by the
    /// splits it wrote together.
    prepared: Option<String>,
}

impl std::fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenFile")
            .field("path", &self.path)
            .field("len", &self.len)
            .field("dtype", &self.dtype)
            .field("tokenizer", &self.tokenizer.name())
            .field("mask", &self.mask_offset.is_some())
            .finish()
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn problem(path: &Path, problem: TokenFileProblem) -> TrainError {
    TrainError::TokenFile {
        path: path.to_path_buf(),
        problem,
    }
}

/// Index and value of the first id in `tokens` that is not below `vocab`.
fn first_out_of_range(tokens: &[u32], vocab: usize) -> Option<(usize, u32)> {
    tokens
        .iter()
        .position(|&t| t as usize >= vocab)
        .map(|i| (i, tokens[i]))
}

/// A token file written and synced under a temporary name beside its path
/// ([`TokenFile::stage`]), not yet in place.
#[derive(Debug)]
pub struct StagedTokenFile {
    tmp: Option<PathBuf>,
    path: PathBuf,
    size: u64,
}

impl StagedTokenFile {
    /// Renames the file over its path (an open mapping of the old file stays intact) and
    /// syncs the directory. Returns the file's size.
    pub fn commit(self) -> Result<u64, TrainError> {
        Ok(Self::commit_together(vec![self])?[0])
    }

    /// Renames each file over its path, one rename after another with nothing written or
    /// synced between them (files written together, such as a corpus's two splits, are
    /// replaced as nearly at once as the file system allows), then syncs their directories.
    /// Returns the files' sizes.
    pub fn commit_together(mut files: Vec<StagedTokenFile>) -> Result<Vec<u64>, TrainError> {
        let mut dirs = Vec::new();
        for f in &mut files {
            let Some(tmp) = f.tmp.take() else {
                unreachable!("a stage is committed once, by value")
            };
            if let Err(source) = std::fs::rename(&tmp, &f.path) {
                let _ = std::fs::remove_file(&tmp);
                return Err(TrainError::Io {
                    path: f.path.clone(),
                    source,
                });
            }
            dirs.extend(tmp.parent().map(Path::to_path_buf));
        }
        dirs.dedup();
        // Make the renames durable. Not every file system can sync a directory; the data is
        // already synced, so a failure here loses nothing but the names.
        #[cfg(unix)]
        for dir in dirs {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(files.iter().map(|f| f.size).collect())
    }
}

impl Drop for StagedTokenFile {
    fn drop(&mut self) {
        if let Some(tmp) = self.tmp.take() {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// The mark [`TokenFile::stage`] gives the splits of one corpus: a CRC-32 of every split's
/// tokens and mask, so the same corpus prepared again writes the same bytes, and splits of
/// two corpora are told apart.
pub fn prepare_mark(splits: &[(&[u32], Option<&[bool]>)]) -> String {
    let mut h = crc32fast::Hasher::new();
    for (tokens, mask) in splits {
        h.update(&(tokens.len() as u64).to_le_bytes());
        for t in *tokens {
            h.update(&t.to_le_bytes());
        }
        if let Some(mask) = mask {
            h.update(&pack_bits(mask));
        }
    }
    format!("{:08x}", h.finalize())
}

impl TokenFile {
    /// Writes `tokens` and `tokenizer`'s spec to `path` atomically: a temporary file in the same
    /// directory is written, synced and renamed over `path`, so a reader (or a crash) never sees
    /// a partial file and an open mapping of the old file stays intact. Returns the file's size.
    /// The file is version 1: every token counts.
    pub fn write(path: &Path, tokenizer: &Tokenizer, tokens: &[u32]) -> Result<u64, TrainError> {
        Self::stage(path, tokenizer, tokens, None, None)?.commit()
    }

    /// As [`TokenFile::write`], with the loss mask `mask` (one per token; `true`: the token
    /// counts as a target), as version 2.
    pub fn write_masked(
        path: &Path,
        tokenizer: &Tokenizer,
        tokens: &[u32],
        mask: &[bool],
    ) -> Result<u64, TrainError> {
        Self::stage(path, tokenizer, tokens, Some(mask), None)?.commit()
    }

    /// Writes what [`TokenFile::write`] (no `mask`) or [`TokenFile::write_masked`] would into a
    /// synced temporary file beside `path`, which [`StagedTokenFile::commit`] renames over it:
    /// files that belong together (a corpus's splits) are all written before any replaces
    /// its predecessor. The temporary file is removed if the stage is dropped uncommitted.
    /// `prepared` marks files written together (see [`TokenFile::prepared`]).
    pub fn stage(
        path: &Path,
        tokenizer: &Tokenizer,
        tokens: &[u32],
        mask: Option<&[bool]>,
        prepared: Option<&str>,
    ) -> Result<StagedTokenFile, TrainError> {
        if let Some(mask) = mask.filter(|m| m.len() != tokens.len()) {
            return Err(problem(
                path,
                TokenFileProblem::Mask {
                    detail: format!("{} entries for {} tokens", mask.len(), tokens.len()),
                },
            ));
        }
        let vocab = tokenizer.vocab_size();
        if let Some((index, token)) = first_out_of_range(tokens, vocab) {
            return Err(problem(
                path,
                TokenFileProblem::TokenOutOfRange {
                    index: index as u64,
                    token,
                    vocab,
                },
            ));
        }
        let mut spec = serde_json::to_vec(&tokenizer.to_spec()).map_err(|e| {
            problem(
                path,
                TokenFileProblem::Spec {
                    detail: e.to_string(),
                },
            )
        })?;
        // An extra key of the spec's object, which its readers (older ones too) pass over;
        // unmarked files keep their bytes.
        if let (Some(mark), Some(b'}')) = (prepared, spec.last()) {
            spec.pop();
            spec.extend_from_slice(
                format!(",\"prepared\":{}}}", serde_json::json!(mark)).as_bytes(),
            );
        }
        let spec_len = u32::try_from(spec.len()).map_err(|_| {
            problem(
                path,
                TokenFileProblem::Spec {
                    detail: format!("{} bytes of JSON is too long", spec.len()),
                },
            )
        })?;
        let dtype = TokenDtype::for_vocab(vocab);
        // What a killed writer left (as large as the file) goes once no process holds it.
        let tmp = snug_nn::temporary_beside(path).ok_or_else(|| TrainError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"),
        })?;
        let result = (|| -> std::io::Result<u64> {
            let file = File::create(&tmp)?;
            let mut w = BufWriter::with_capacity(1 << 20, file);
            w.write_all(&MAGIC)?;
            let version = if mask.is_some() {
                VERSION
            } else {
                VERSION_NO_MASK
            };
            w.write_all(&version.to_le_bytes())?;
            w.write_all(&[dtype.bytes() as u8])?;
            w.write_all(&(tokens.len() as u64).to_le_bytes())?;
            w.write_all(&spec_len.to_le_bytes())?;
            w.write_all(&spec)?;
            let mut buf = Vec::with_capacity(64 * 1024 * dtype.bytes());
            for block in tokens.chunks(64 * 1024) {
                buf.clear();
                match dtype {
                    // Every id is below a vocabulary of at most 65,536 (checked above).
                    TokenDtype::U16 => {
                        for &t in block {
                            buf.extend_from_slice(&(t as u16).to_le_bytes());
                        }
                    }
                    TokenDtype::U32 => {
                        for &t in block {
                            buf.extend_from_slice(&t.to_le_bytes());
                        }
                    }
                }
                w.write_all(&buf)?;
            }
            if let Some(mask) = mask {
                w.write_all(&pack_bits(mask))?;
            }
            let file = w.into_inner().map_err(|e| e.into_error())?;
            file.sync_all()?;
            Ok(file.metadata()?.len())
        })();
        match result {
            Ok(size) => Ok(StagedTokenFile {
                tmp: Some(tmp),
                path: path.to_path_buf(),
                size,
            }),
            Err(source) => {
                // Best effort: the temporary file may not exist if creating it failed.
                let _ = std::fs::remove_file(&tmp);
                Err(TrainError::Io {
                    path: path.to_path_buf(),
                    source,
                })
            }
        }
    }

    /// Opens `path`, checks its header, length and every token id against its tokenizer's
    /// vocabulary, and maps it read-only.
    pub fn open(path: &Path) -> Result<TokenFile, TrainError> {
        // Before opening: opening a FIFO waits for a writer, and a device has no fixed length.
        crate::user_file::check_regular(path)?;
        let mut file = File::open(path).map_err(io_err(path))?;
        let file_len = file.metadata().map_err(io_err(path))?.len();
        let truncated = |field, needed: usize| {
            problem(
                path,
                TokenFileProblem::Truncated {
                    field,
                    len: file_len,
                    needed: needed as u64,
                },
            )
        };
        if file_len < FIXED_HEADER as u64 {
            return Err(truncated("header", FIXED_HEADER));
        }
        // SAFETY: the map is read-only and snug replaces token files only by rename, never in
        // place; another process truncating the file while it is mapped would fault on access,
        // as with any memory-mapped reader.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
        let h = &map[..FIXED_HEADER];
        if h[..8] != MAGIC {
            return Err(problem(
                path,
                TokenFileProblem::BadMagic {
                    found: h[..8].to_vec(),
                },
            ));
        }
        let u32_at = |at: usize| u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]);
        let version = u32_at(VERSION_AT);
        if version != VERSION && version != VERSION_NO_MASK {
            return Err(problem(path, TokenFileProblem::Version { found: version }));
        }
        let code = h[DTYPE_AT];
        let dtype = TokenDtype::from_code(code)
            .ok_or_else(|| problem(path, TokenFileProblem::Dtype { code }))?;
        let mut count = [0u8; 8];
        count.copy_from_slice(&h[COUNT_AT..COUNT_AT + 8]);
        let count = u64::from_le_bytes(count);
        let spec_len = u32_at(SPEC_LEN_AT) as usize;
        let offset = FIXED_HEADER + spec_len;
        if (offset as u64) > file_len {
            return Err(truncated("tokenizer", offset));
        }
        let spec_problem = |e: serde_json::Error| {
            problem(
                path,
                TokenFileProblem::Spec {
                    detail: e.to_string(),
                },
            )
        };
        let spec_json: serde_json::Value =
            serde_json::from_slice(&map[FIXED_HEADER..offset]).map_err(spec_problem)?;
        let prepared = spec_json
            .get("prepared")
            .and_then(|m| m.as_str())
            .map(str::to_string);
        let spec: TokenizerSpec = serde_json::from_value(spec_json).map_err(spec_problem)?;
        let tokenizer = Tokenizer::from_spec(&spec).map_err(|e| {
            problem(
                path,
                TokenFileProblem::Spec {
                    detail: e.to_string(),
                },
            )
        })?;
        let actual = file_len - offset as u64;
        let expected = count as u128 * dtype.bytes() as u128;
        let mask_bytes = if version == VERSION {
            (count as u128).div_ceil(8)
        } else {
            0
        };
        // The tokens are whole but the mask after them is cut short.
        if mask_bytes > 0
            && (actual as u128) >= expected
            && (actual as u128) < expected + mask_bytes
        {
            return Err(truncated("mask", offset + (expected + mask_bytes) as usize));
        }
        let expected = expected + mask_bytes;
        if expected != actual as u128 {
            return Err(problem(
                path,
                TokenFileProblem::Count {
                    count,
                    expected,
                    actual,
                },
            ));
        }
        // `actual` bytes are mapped, so the count fits in usize.
        let len = count as usize;
        let mask_offset = (version == VERSION).then(|| offset + len * dtype.bytes());
        if let Some(at) = mask_offset {
            // Bits past the last token must be 0, so each mask has one encoding.
            if !len.is_multiple_of(8) && map[map.len() - 1] >> (len % 8) != 0 {
                return Err(problem(
                    path,
                    TokenFileProblem::Mask {
                        detail: format!(
                            "bits past the last of {len} tokens are set in byte {}",
                            map.len() - 1 - at
                        ),
                    },
                ));
            }
        }
        // Check ids with ordinary reads rather than through the map, so validating a large
        // corpus leaves the page cache warm without adding the whole file to our resident set.
        file.seek(SeekFrom::Start(offset as u64))
            .map_err(io_err(path))?;
        check_ids(&mut file, dtype, len, tokenizer.vocab_size())
            .map_err(io_err(path))?
            .map_or(Ok(()), |(index, token)| {
                Err(problem(
                    path,
                    TokenFileProblem::TokenOutOfRange {
                        index,
                        token,
                        vocab: tokenizer.vocab_size(),
                    },
                ))
            })?;
        Ok(TokenFile {
            path: path.to_path_buf(),
            map: Arc::new(map),
            offset,
            len,
            dtype,
            tokenizer,
            mask_offset,
            prepared,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Which `snug prepare` wrote the file: the splits of one corpus share it, so a pair that
    /// does not (a prepare stopped between replacing its two files) is told apart. `None` for
    /// files written otherwise, or by an older snug.
    pub fn prepared(&self) -> Option<&str> {
        self.prepared.as_deref()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    fn bytes(&self, start: usize, n: usize) -> &[u8] {
        assert!(
            start.checked_add(n).is_some_and(|end| end <= self.len),
            "window {start}..{start}+{n} is outside {} tokens of {}",
            self.len,
            self.path.display()
        );
        let w = self.dtype.bytes();
        &self.map[self.offset + start * w..self.offset + (start + n) * w]
    }

    /// Drops this process's mapping of the file's pages, so the pages a reader touched stop
    /// counting in its resident set: the page cache keeps them (they are clean, and the next
    /// read maps them again without going to disk), but a long run's random batches, or one
    /// pass over the whole file (the run's CRC, the mask's count), would otherwise leave every
    /// page it read resident in the process, the whole corpus at worst, outside the memory
    /// plan and any `--memory` budget. Readers call it after each batch or window; a failure
    /// (an advice the kernel does not take) leaves the pages mapped, which costs memory only.
    pub fn release_pages(&self) {
        // SAFETY: `MADV_DONTNEED` on a read-only shared file mapping drops page-table entries
        // only: the next access faults the same bytes back in from the page cache (or the
        // file). Nothing written through the map could be lost, as nothing is.
        let _ = unsafe {
            self.map
                .unchecked_advise(memmap2::UncheckedAdvice::DontNeed)
        };
    }

    /// Copies tokens `start..start + out.len()` into `out`. Panics past the end.
    pub fn copy_window(&self, start: usize, out: &mut [i32]) {
        let bytes = self.bytes(start, out.len());
        // Ids were checked against the vocabulary, which is far below i32::MAX.
        match self.dtype {
            TokenDtype::U16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = u16::from_le_bytes([b[0], b[1]]) as i32;
                }
            }
            TokenDtype::U32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i32;
                }
            }
        }
    }

    /// Whether the file holds a loss mask (version 2); without one every token counts.
    pub fn has_mask(&self) -> bool {
        self.mask_offset.is_some()
    }

    /// Copies the loss mask of tokens `start..start + out.len()` into `out` (all `true` without
    /// a mask). Panics past the end.
    pub fn copy_mask_window(&self, start: usize, out: &mut [bool]) {
        assert!(
            start
                .checked_add(out.len())
                .is_some_and(|end| end <= self.len),
            "mask window {start}..{start}+{} is outside {} tokens of {}",
            out.len(),
            self.len,
            self.path.display()
        );
        let Some(at) = self.mask_offset else {
            out.fill(true);
            return;
        };
        let bits = &self.map[at..];
        for (i, o) in out.iter_mut().enumerate() {
            let j = start + i;
            *o = bits[j / 8] >> (j % 8) & 1 == 1;
        }
    }

    /// Targets that count in the loss: tokens after the first (a first token is never a
    /// target) that the mask keeps, all of them without one.
    pub fn counted_targets(&self) -> usize {
        let Some(at) = self.mask_offset else {
            return self.len.saturating_sub(1);
        };
        let bits = &self.map[at..at + self.len.div_ceil(8)];
        let mut set = 0usize;
        for chunk in bits.chunks(1 << 20) {
            set += chunk.iter().map(|b| b.count_ones() as usize).sum::<usize>();
            self.release_pages();
        }
        // Bits past the last token are zero as written, but a file is not trusted to be.
        let past = match self.len % 8 {
            0 => 0,
            r => (bits[bits.len() - 1] >> r).count_ones() as usize,
        };
        let first = bits.first().map_or(0, |b| usize::from(b & 1));
        set - past - first
    }

    /// The whole loss mask (all `true` without one).
    pub fn mask_to_vec(&self) -> Vec<bool> {
        let mut out = vec![true; self.len];
        self.copy_mask_window(0, &mut out);
        out
    }

    /// Every token, decoded into memory.
    pub fn to_vec(&self) -> Vec<u32> {
        let bytes = self.bytes(0, self.len);
        match self.dtype {
            TokenDtype::U16 => bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]) as u32)
                .collect(),
            TokenDtype::U32 => bytes
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        }
    }
}

/// `mask` as bits, least significant first.
fn pack_bits(mask: &[bool]) -> Vec<u8> {
    let mut bytes = vec![0u8; mask.len().div_ceil(8)];
    for (i, _) in mask.iter().enumerate().filter(|(_, &m)| m) {
        bytes[i / 8] |= 1 << (i % 8);
    }
    bytes
}

/// Reads `len` tokens from `r` and returns the index and value of the first not below `vocab`.
fn check_ids(
    r: &mut impl Read,
    dtype: TokenDtype,
    len: usize,
    vocab: usize,
) -> std::io::Result<Option<(u64, u32)>> {
    let w = dtype.bytes();
    let mut buf = vec![0u8; (1 << 20) / w * w];
    let mut ids = Vec::with_capacity(buf.len() / w);
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(buf.len() / w);
        r.read_exact(&mut buf[..n * w])?;
        ids.clear();
        match dtype {
            TokenDtype::U16 => ids.extend(
                buf[..n * w]
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]) as u32),
            ),
            TokenDtype::U32 => ids.extend(
                buf[..n * w]
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
        }
        if let Some((i, t)) = first_out_of_range(&ids, vocab) {
            return Ok(Some(((done + i) as u64, t)));
        }
        done += n;
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CharTokenizer;

    #[test]
    fn a_staged_file_replaces_its_path_only_when_committed() {
        let dir = tempfile::tempdir().unwrap();
        let tok = Tokenizer::Char(CharTokenizer::from_text("abc"));
        let path = dir.path().join("train.bin");
        TokenFile::write(&path, &tok, &[0, 1]).unwrap();
        let old = std::fs::read(&path).unwrap();
        let names = || {
            let mut n: Vec<_> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            n.sort();
            n
        };
        // Dropped uncommitted (a later file of the pair failed): the old file, and nothing else.
        let staged = TokenFile::stage(&path, &tok, &[2, 2, 2], None, None).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), old);
        drop(staged);
        assert_eq!(std::fs::read(&path).unwrap(), old);
        assert_eq!(names(), vec![std::ffi::OsString::from("train.bin")]);
        // Committed: the new tokens, at the size it reports.
        let staged = TokenFile::stage(&path, &tok, &[2, 2, 2], Some(&[true, false, true]), None);
        let size = staged.unwrap().commit().unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), size);
        let file = TokenFile::open(&path).unwrap();
        assert_eq!(file.len(), 3);
        assert_eq!(names(), vec![std::ffi::OsString::from("train.bin")]);
        // A mask of another length is refused before anything is written.
        assert!(TokenFile::stage(&path, &tok, &[1], Some(&[true, true]), None).is_err());
        assert_eq!(names(), vec![std::ffi::OsString::from("train.bin")]);
    }

    #[test]
    fn counted_targets_leave_out_the_first_token_and_count_the_mask() {
        let dir = tempfile::tempdir().unwrap();
        let tok = Tokenizer::Char(CharTokenizer::from_text("abc"));
        let path = dir.path().join("t.bin");
        let ids: Vec<u32> = (0..11).map(|i| i % 3).collect();
        TokenFile::write(&path, &tok, &ids).unwrap();
        assert_eq!(TokenFile::open(&path).unwrap().counted_targets(), 10);
        // Tokens 0, 3, 9 and 10 kept: token 0 is no target, so three count.
        let mask: Vec<bool> = (0..11).map(|i| [0, 3, 9, 10].contains(&i)).collect();
        TokenFile::write_masked(&path, &tok, &ids, &mask).unwrap();
        assert_eq!(TokenFile::open(&path).unwrap().counted_targets(), 3);
        TokenFile::write_masked(&path, &tok, &ids, &[false; 11]).unwrap();
        assert_eq!(TokenFile::open(&path).unwrap().counted_targets(), 0);
        // A prepared directory whose training split keeps no target is refused by file.
        TokenFile::write(&dir.path().join(crate::data::VAL_FILE), &tok, &ids).unwrap();
        std::fs::rename(&path, dir.path().join(crate::data::TRAIN_FILE)).unwrap();
        match crate::TokenDataset::from_dir(dir.path()) {
            Err(TrainError::TokenFile {
                path,
                problem: TokenFileProblem::Mask { detail },
            }) => {
                assert!(path.ends_with(crate::data::TRAIN_FILE));
                assert!(detail.contains("no target"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
        // So is one whose validation split does (every validation loss would read 0).
        let train = dir.path().join(crate::data::TRAIN_FILE);
        TokenFile::write(&train, &tok, &ids).unwrap();
        let val = dir.path().join(crate::data::VAL_FILE);
        TokenFile::write_masked(&val, &tok, &ids, &[false; 11]).unwrap();
        match crate::TokenDataset::from_dir(dir.path()) {
            Err(TrainError::TokenFile { path, .. }) => assert_eq!(path, val),
            other => panic!("{other:?}"),
        }
    }

    fn header(version: u32, dtype: u8, count: u64, spec: &[u8]) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&version.to_le_bytes());
        b.push(dtype);
        b.extend_from_slice(&count.to_le_bytes());
        b.extend_from_slice(&(spec.len() as u32).to_le_bytes());
        b.extend_from_slice(spec);
        b
    }

    const ABC: &[u8] = br#"{"kind":"char","chars":"abc"}"#;

    /// Writes `bytes` to a file, opens it, and returns the problem, checking that the message
    /// names the file and the field.
    fn problem_of(bytes: &[u8]) -> TokenFileProblem {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.bin");
        std::fs::write(&path, bytes).unwrap();
        let err = TokenFile::open(&path).unwrap_err();
        let msg = err.to_string();
        match err {
            TrainError::TokenFile { path: p, problem } => {
                assert_eq!(p, path);
                assert!(msg.contains("bad.bin"), "{msg}");
                assert!(msg.contains(&format!("{}: ", problem.field())), "{msg}");
                problem
            }
            other => panic!("expected a token file problem, got {other:?}"),
        }
    }

    #[test]
    fn char_tokens_round_trip_as_u16() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.bin");
        let tok = Tokenizer::Char(CharTokenizer::from_text("hello world"));
        let ids = tok.encode("hello world hello").unwrap();
        let size = TokenFile::write(&path, &tok, &ids).unwrap();
        let spec_len = serde_json::to_vec(&tok.to_spec()).unwrap().len();
        assert_eq!(size as usize, FIXED_HEADER + spec_len + 2 * ids.len());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), size);
        let f = TokenFile::open(&path).unwrap();
        assert_eq!(f.dtype(), TokenDtype::U16);
        assert_eq!((f.len(), f.is_empty()), (ids.len(), false));
        assert_eq!(f.tokenizer(), &tok);
        assert_eq!(f.to_vec(), ids);
        let mut w = vec![0i32; 5];
        f.copy_window(6, &mut w);
        assert_eq!(
            tok.decode(&w.iter().map(|&i| i as u32).collect::<Vec<_>>()),
            "world"
        );
        // No temporary file is left beside it.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn large_vocabularies_round_trip_as_u32() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wide.bin");
        // 70,000 distinct characters: ids above u16.
        let chars: String = (0x4E00u32..0x4E00 + 70_000)
            .filter_map(char::from_u32)
            .collect();
        let tok = Tokenizer::Char(CharTokenizer::from_chars(chars.chars().collect()));
        assert!(tok.vocab_size() > 1 << 16);
        let ids: Vec<u32> = vec![0, 65_535, 65_536, tok.vocab_size() as u32 - 1, 7];
        TokenFile::write(&path, &tok, &ids).unwrap();
        let f = TokenFile::open(&path).unwrap();
        assert_eq!(f.dtype(), TokenDtype::U32);
        assert_eq!(f.to_vec(), ids);
        let mut w = [0i32; 3];
        f.copy_window(1, &mut w);
        assert_eq!(w, [65_535, 65_536, tok.vocab_size() as i32 - 1]);
    }

    #[test]
    fn gpt2_tokens_round_trip_and_empty_files_are_valid() {
        let dir = tempfile::tempdir().unwrap();
        let tok = Tokenizer::gpt2();
        let ids = tok.encode("Hello world").unwrap();
        let path = dir.path().join("g.bin");
        TokenFile::write(&path, &tok, &ids).unwrap();
        let f = TokenFile::open(&path).unwrap();
        assert_eq!((f.dtype(), f.to_vec()), (TokenDtype::U16, vec![15496, 995]));
        assert_eq!(f.tokenizer().name(), "gpt2");
        let empty = dir.path().join("empty.bin");
        TokenFile::write(&empty, &tok, &[]).unwrap();
        assert!(TokenFile::open(&empty).unwrap().is_empty());
    }

    #[test]
    fn writing_replaces_atomically_and_rejects_out_of_range_ids() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.bin");
        let tok = Tokenizer::Char(CharTokenizer::from_text("abc"));
        TokenFile::write(&path, &tok, &[0, 1, 2]).unwrap();
        let old = TokenFile::open(&path).unwrap();
        TokenFile::write(&path, &tok, &[2, 2]).unwrap();
        // The old mapping still reads the old file; a fresh open reads the new one.
        assert_eq!(old.to_vec(), [0, 1, 2]);
        assert_eq!(TokenFile::open(&path).unwrap().to_vec(), [2, 2]);
        match TokenFile::write(&path, &tok, &[0, 3]) {
            Err(TrainError::TokenFile {
                problem:
                    TokenFileProblem::TokenOutOfRange {
                        index: 1,
                        token: 3,
                        vocab: 3,
                    },
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        let missing_dir = dir.path().join("no/such/dir/t.bin");
        let err = TokenFile::write(&missing_dir, &tok, &[0]).unwrap_err();
        assert!(
            matches!(&err, TrainError::Io { path, .. } if *path == missing_dir),
            "{err}"
        );
    }

    #[test]
    fn a_missing_file_is_an_io_error_naming_it() {
        let err = TokenFile::open(Path::new("/no/such/train.bin")).unwrap_err();
        assert!(matches!(err, TrainError::Io { .. }));
        assert!(err.to_string().contains("/no/such/train.bin"));
    }

    #[test]
    fn bad_magic() {
        let mut b = header(1, 2, 0, ABC);
        b[..8].copy_from_slice(b"NOTSNUG!");
        let p = problem_of(&b);
        assert!(matches!(p, TokenFileProblem::BadMagic { ref found } if found == b"NOTSNUG!"));
    }

    #[test]
    fn unknown_version() {
        let p = problem_of(&header(3, 2, 0, ABC));
        assert!(matches!(p, TokenFileProblem::Version { found: 3 }));
    }

    /// 11 tokens: the mask spans two bytes, the second partly used.
    #[test]
    fn masked_tokens_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.bin");
        let tok = Tokenizer::Char(CharTokenizer::from_text("abc"));
        let ids = [0u32, 1, 2, 2, 1, 0, 0, 1, 2, 1, 0];
        let mask = [
            false, true, true, false, false, true, true, true, true, false, true,
        ];
        let size = TokenFile::write_masked(&path, &tok, &ids, &mask).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len() as u64, size);
        assert_eq!(bytes[VERSION_AT..VERSION_AT + 4], 2u32.to_le_bytes());
        // Bits 1, 2, 5, 6, 7 of the first byte; 0 and 2 of the second.
        assert_eq!(bytes[bytes.len() - 2..], [0b1110_0110, 0b0000_0101]);
        assert_eq!(bytes.len(), FIXED_HEADER + ABC.len() + 2 * ids.len() + 2);
        let f = TokenFile::open(&path).unwrap();
        assert!(f.has_mask());
        assert_eq!(f.to_vec(), ids);
        assert_eq!(f.mask_to_vec(), mask);
        let mut w = [false; 4];
        f.copy_mask_window(6, &mut w);
        assert_eq!(w, mask[6..10]);
    }

    /// A file written without a mask is version 1, as before masks, and every token counts.
    #[test]
    fn unmasked_files_stay_version_1_and_count_every_token() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v1.bin");
        let tok = Tokenizer::Char(CharTokenizer::from_text("abc"));
        TokenFile::write(&path, &tok, &[2, 0, 1]).unwrap();
        let mut expected = header(1, 2, 3, ABC);
        for t in [2u16, 0, 1] {
            expected.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(std::fs::read(&path).unwrap(), expected);
        let f = TokenFile::open(&path).unwrap();
        assert!(!f.has_mask());
        assert_eq!(f.mask_to_vec(), [true; 3]);
    }

    #[test]
    fn truncated_or_malformed_masks() {
        let mut b = header(2, 2, 9, ABC);
        b.extend_from_slice(&[0; 18]);
        // Nine tokens need two mask bytes; one is there.
        b.push(0xff);
        let p = problem_of(&b);
        assert!(matches!(
            p,
            TokenFileProblem::Truncated { field: "mask", needed, .. } if needed == b.len() as u64 + 1
        ));
        // A bit set past the ninth token.
        b.push(0b10);
        let p = problem_of(&b);
        assert!(matches!(p, TokenFileProblem::Mask { .. }), "{p}");
        // Token bytes cut short are still a count error.
        let mut b = header(2, 2, 9, ABC);
        b.extend_from_slice(&[0; 17]);
        assert!(matches!(problem_of(&b), TokenFileProblem::Count { .. }));
        let dir = tempfile::tempdir().unwrap();
        let tok = Tokenizer::Char(CharTokenizer::from_text("abc"));
        let err = TokenFile::write_masked(&dir.path().join("x.bin"), &tok, &[0, 1], &[true]);
        assert!(matches!(
            err,
            Err(TrainError::TokenFile {
                problem: TokenFileProblem::Mask { .. },
                ..
            })
        ));
    }

    #[test]
    fn unknown_dtype() {
        let mut b = header(1, 3, 1, ABC);
        b.extend_from_slice(&[0, 0, 0]);
        let p = problem_of(&b);
        assert!(matches!(p, TokenFileProblem::Dtype { code: 3 }));
    }

    #[test]
    fn truncated_header() {
        let b = header(1, 2, 0, ABC);
        let p = problem_of(&b[..10]);
        assert!(matches!(
            p,
            TokenFileProblem::Truncated {
                field: "header",
                len: 10,
                needed: 25
            }
        ));
        let p = problem_of(&b[..b.len() - 1]);
        assert!(matches!(
            p,
            TokenFileProblem::Truncated {
                field: "tokenizer",
                ..
            }
        ));
    }

    #[test]
    fn count_disagreeing_with_the_length() {
        // Three u16 tokens promised, two and a half present (truncated).
        let mut b = header(1, 2, 3, ABC);
        b.extend_from_slice(&[0, 0, 1, 0, 2]);
        let p = problem_of(&b);
        assert!(matches!(
            p,
            TokenFileProblem::Count {
                count: 3,
                expected: 6,
                actual: 5
            }
        ));
        // Trailing bytes past the promised tokens.
        let mut b = header(1, 4, 1, ABC);
        b.extend_from_slice(&[0; 8]);
        let p = problem_of(&b);
        assert!(matches!(p, TokenFileProblem::Count { count: 1, .. }));
        // A count whose byte size overflows u64 is still a count error, not a panic.
        let p = problem_of(&header(1, 4, u64::MAX, ABC));
        assert!(matches!(p, TokenFileProblem::Count { .. }));
    }

    #[test]
    fn bad_tokenizer_spec() {
        let p = problem_of(&header(1, 2, 0, b"{not json"));
        assert!(matches!(p, TokenFileProblem::Spec { .. }));
        let p = problem_of(&header(1, 2, 0, br#"{"kind":"char","chars":"aa"}"#));
        assert!(
            matches!(p, TokenFileProblem::Spec { ref detail } if detail.contains("more than once"))
        );
    }

    #[test]
    fn token_id_outside_the_vocabulary() {
        let mut b = header(1, 2, 4, ABC);
        for t in [0u16, 2, 3, 1] {
            b.extend_from_slice(&t.to_le_bytes());
        }
        let p = problem_of(&b);
        assert!(matches!(
            p,
            TokenFileProblem::TokenOutOfRange {
                index: 2,
                token: 3,
                vocab: 3
            }
        ));
    }
}
