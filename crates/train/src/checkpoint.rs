//! Checkpoints: one safetensors file per saved step, holding the parameters, the optimizer
//! state and, in the header's metadata, everything else a bit-exact resume needs (step,
//! tokens seen, the full configuration, the tokenizer).
//!
//! There is no random-number state to save: the batch of step `s` is drawn from a generator
//! seeded by `(seed, s)` (see [`crate::data::batch_starts`]), so the step count is the data
//! position.
//!
//! Each tensor's CRC-32 is stored in the metadata (`crc32`, a JSON map from tensor name to
//! checksum) and checked on load, so a flipped bit in the data is an error naming the tensor
//! rather than a silently different model. Version 1 files, which have no checksums, still load.
//!
//! Files are written atomically (temporary file in the same directory, fsync, rename, fsync of
//! the directory), so a crash or a full disk during a save leaves every earlier checkpoint as
//! it was.
//!
//! A run sharded over several ranks (ZeRO stages 1–3) saves a sharded checkpoint instead: one
//! file per rank and a manifest, `ckpt-<step>.manifest.json`, which stands for the checkpoint
//! here (see [`crate::shards`]); loading it consolidates the shards into whole tensors.

use std::collections::HashMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};

use std::borrow::Cow;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::tokenizer::TokenizerSpec;
use crate::{LossScaler, TrainConfig, TrainError};

/// The `format` metadata value of a snug checkpoint.
pub const FORMAT: &str = "snug-checkpoint";
/// Bumped when the layout changes: 2 added the per-tensor checksums, 3 a double-quantized
/// base's stored codes and statistics (`<weight>.codes`, `<weight>.absmax`) beside its values.
pub const VERSION: u32 = 3;
/// The version of a file without what version 3 added, which a snug that reads version 2
/// reads whole.
const VERSION_WITHOUT_STORED_BASE: u32 = 2;
/// The oldest version this snug reads (version 1: no checksums).
const OLDEST_VERSION: u32 = 1;
/// Metadata key of the per-tensor checksums.
const CHECKSUMS: &str = "crc32";

pub(crate) const PREFIX: &str = "ckpt-";
pub(crate) const SUFFIX: &str = ".safetensors";

/// A saved training state.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// Optimizer steps completed.
    pub step: u64,
    pub tokens_seen: u64,
    pub config: TrainConfig,
    pub tokenizer: TokenizerSpec,
    /// Parameters (Hugging Face names) and optimizer state (`<param>.adam_m`, `.adam_v`), in
    /// graph order, with their shapes.
    pub tensors: Vec<SavedTensor>,
    /// 8-bit AdamW's moment codes (`<param>.adam8_m`, `.adam8_v`), stored as u8; their
    /// per-block absmaxes are f32 and sit in `tensors`. Also a double-quantized base's codes
    /// (`<weight>.codes`, see [`crate::quantized::STORED_CODES_SUFFIX`]), whose statistics sit
    /// in `tensors` as `<weight>.absmax`: its values alone do not give them back.
    pub quantized: Vec<SavedBytes>,
    /// The dynamic loss scale's state (f16 training).
    pub loss_scale: Option<LossScaler>,
    /// State each rank of a sharded run held for itself, which has no whole form (8-bit
    /// AdamW's per-shard blocks, a rank's own gradient norm): only a run on as many ranks
    /// restores it. `None` for a checkpoint of one process or of stage 0.
    pub per_rank: Option<PerRankState>,
}

/// The per-rank state of a sharded checkpoint, by rank, under the names the step graph gives it.
#[derive(Debug, Clone, PartialEq)]
pub struct PerRankState {
    pub ranks: usize,
    /// ZeRO stage of the run that saved it.
    pub stage: u8,
    pub tensors: Vec<Vec<SavedTensor>>,
    pub quantized: Vec<Vec<SavedBytes>>,
}

/// Which rank of how many wrote a shard file of a sharded checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardOf {
    pub rank: usize,
    pub ranks: usize,
}

/// Metadata key of a shard file's [`ShardOf`].
const SHARD_KEY: &str = "shard";

#[derive(Debug, Clone, PartialEq)]
pub struct SavedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// A u8 tensor of a checkpoint (quantized optimizer state).
#[derive(Debug, Clone, PartialEq)]
pub struct SavedBytes {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// Optimizer state is named after its parameter with one of these suffixes (or, for the
/// previous step's gradient norm, is named by it).
const OPTIMIZER_SUFFIXES: [&str; 7] = [
    ".adam_m",
    ".adam_v",
    ".adam8_m",
    ".adam8_v",
    ".adam8_m_absmax",
    ".adam8_v_absmax",
    snug_graph::PREVIOUS_SUM_SQUARES,
];

impl Checkpoint {
    pub fn tensor(&self, name: &str) -> Option<&SavedTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Whether f32 tensor `name` is the statistics of a quantized weight whose stored codes
    /// the checkpoint holds (`<weight>.absmax` beside `<weight>.codes`).
    fn is_stored_statistics(&self, name: &str) -> bool {
        let suffix = crate::quantized::STORED_CODES_SUFFIX;
        name.strip_suffix(".absmax").is_some_and(|weight| {
            self.quantized
                .iter()
                .any(|q| q.name.strip_suffix(suffix) == Some(weight))
        })
    }

    /// The model's weights alone (no optimizer state, no stored form of a quantized base),
    /// by Hugging Face name; a LoRA run's with its adapters folded into the base weights, as
    /// inference and a merged export read them. (Adapters that do not fold, in a damaged
    /// checkpoint, are left as they are, for the reader to refuse by name.)
    pub fn parameters(&self) -> Vec<(String, Vec<f32>)> {
        let params: Vec<(String, Vec<f32>)> = self
            .tensors
            .iter()
            .filter(|t| !is_optimizer_state(&t.name))
            .filter(|t| !self.is_stored_statistics(&t.name))
            .map(|t| (t.name.clone(), t.data.clone()))
            .collect();
        let (Some(lora), Ok(model)) = (self.config.lora_config(), self.model()) else {
            return params;
        };
        let mut merged = params.clone();
        match snug_nn::lora::merge_adapters(&model, &lora, &mut merged) {
            Ok(()) => merged,
            Err(_) => params,
        }
    }

    /// The trained model's configuration (its vocabulary is the tokenizer's unless the
    /// configuration fixed one).
    pub fn model(&self) -> Result<snug_nn::ModelConfig, TrainError> {
        let tokenizer = crate::Tokenizer::from_spec(&self.tokenizer)?;
        self.config.model_for_vocab(tokenizer.vocab_size())
    }

    /// Writes the checkpoint to `path` atomically.
    pub fn save(&self, path: &Path) -> Result<(), TrainError> {
        self.write_pending(path)?.commit()
    }

    /// See [`CheckpointRef::write_pending`].
    pub fn write_pending(&self, path: &Path) -> Result<PendingWrite, TrainError> {
        self.as_ref().write_pending(path)
    }

    /// A borrowed view, for writing.
    pub fn as_ref(&self) -> CheckpointRef<'_> {
        CheckpointRef {
            step: self.step,
            tokens_seen: self.tokens_seen,
            config: &self.config,
            tokenizer: self.tokenizer.clone(),
            tensors: self
                .tensors
                .iter()
                .map(|t| {
                    (
                        t.name.as_str(),
                        t.shape.as_slice(),
                        Cow::Borrowed(t.data.as_slice()),
                    )
                })
                .collect(),
            quantized: self
                .quantized
                .iter()
                .map(|t| {
                    (
                        Cow::Borrowed(t.name.as_str()),
                        t.shape.as_slice(),
                        Cow::Borrowed(t.data.as_slice()),
                    )
                })
                .collect(),
            loss_scale: self.loss_scale,
            shard: None,
        }
    }

    /// Reads and validates a checkpoint file, or the manifest of a sharded checkpoint (whose
    /// shards are then read, checked against it and consolidated).
    pub fn load(path: &Path) -> Result<Checkpoint, TrainError> {
        Self::load_keeping(path, Keep::All)
    }

    /// [`Checkpoint::load`], keeping what `keep` says. A whole file is mapped rather than
    /// read, and each tensor's pages leave the process's resident set once its values are
    /// copied out, so a load holds the values it keeps and one tensor's bytes: reading the
    /// file whole held it twice (gpt2-medium's 4.26 GB checkpoint: 8.3 GB to sample it).
    pub fn load_keeping(path: &Path, keep: Keep) -> Result<Checkpoint, TrainError> {
        if crate::shards::is_manifest(path) {
            return crate::shards::load(path);
        }
        let bytes = FileBytes::of(path)?;
        let release = |part: &[u8]| bytes.release(part);
        match Self::parse_keeping(path, bytes.as_slice(), keep, &release)? {
            (ckpt, None) => {
                check_step_matches_name(path, ckpt.step)?;
                Ok(ckpt)
            }
            (_, Some(of)) => Err(TrainError::Checkpoint {
                path: path.to_path_buf(),
                detail: format!(
                    "is rank {}'s shard of a checkpoint over {} ranks, not a whole checkpoint: \
                     give its manifest (`ckpt-<step>{}`) or the run directory",
                    of.rank,
                    of.ranks,
                    crate::shards::MANIFEST_SUFFIX
                ),
            }),
        }
    }

    /// A checkpoint file's contents from its bytes, and which rank's shard it is if it is one.
    pub(crate) fn parse(
        path: &Path,
        bytes: &[u8],
    ) -> Result<(Checkpoint, Option<ShardOf>), TrainError> {
        Self::parse_keeping(path, bytes, Keep::All, &|_| {})
    }

    /// [`Checkpoint::parse`], keeping what `keep` says (every tensor is checked all the same),
    /// and handing each tensor's bytes to `done` once they are read.
    fn parse_keeping(
        path: &Path,
        bytes: &[u8],
        keep: Keep,
        done: &dyn Fn(&[u8]),
    ) -> Result<(Checkpoint, Option<ShardOf>), TrainError> {
        let bad = |detail: String| TrainError::Checkpoint {
            path: path.to_path_buf(),
            detail,
        };
        // A newer snug's file may hold what this one cannot parse (a new dtype, a new field):
        // its version, read first, says so before anything else can call it damaged.
        if let Some(version) = raw_version(bytes) {
            if version > VERSION {
                return Err(TrainError::CheckpointTooNew {
                    path: path.to_path_buf(),
                    version,
                    newest: VERSION,
                });
            }
        }
        let st = snug_nn::safetensors_file::deserialize(bytes)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        // The header parsed above; read again for its metadata, which `SafeTensors` keeps private.
        let (_, header) = SafeTensors::read_metadata(bytes)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let meta = header
            .metadata()
            .clone()
            .ok_or_else(|| bad("no metadata: not a snug checkpoint".into()))?;
        let field = |key: &str| {
            meta.get(key)
                .ok_or_else(|| bad(format!("metadata field `{key}` is missing")))
        };
        if field("format")? != FORMAT {
            return Err(bad(format!(
                "metadata `format` is `{}`, expected `{FORMAT}`",
                field("format")?
            )));
        }
        let version: u32 = field("version")?
            .parse()
            .map_err(|_| bad("metadata `version` is not a number".into()))?;
        if version > VERSION {
            return Err(TrainError::CheckpointTooNew {
                path: path.to_path_buf(),
                version,
                newest: VERSION,
            });
        }
        if !(OLDEST_VERSION..=VERSION).contains(&version) {
            return Err(bad(format!(
                "checkpoint version {version}; this snug reads versions {OLDEST_VERSION} to {VERSION}"
            )));
        }
        let mut checksums: Option<HashMap<String, u32>> = if version >= 2 {
            Some(
                serde_json::from_str(field(CHECKSUMS)?)
                    .map_err(|e| bad(format!("metadata `{CHECKSUMS}`: {e}")))?,
            )
        } else {
            None
        };
        let number = |key: &str| -> Result<u64, TrainError> {
            field(key)?
                .parse()
                .map_err(|_| bad(format!("metadata `{key}` is not a number")))
        };
        let config: TrainConfig = serde_json::from_str(field("config")?)
            .map_err(|e| bad(format!("metadata `config`: {e}")))?;
        let tokenizer: TokenizerSpec = serde_json::from_str(field("tokenizer")?)
            .map_err(|e| bad(format!("metadata `tokenizer`: {e}")))?;
        // By name, so the first damaged tensor reported does not depend on hash order;
        // callers look tensors up by name.
        let mut views = st.tensors();
        views.sort_by(|a, b| a.0.cmp(&b.0));
        let mut tensors = Vec::with_capacity(views.len());
        let mut quantized = Vec::new();
        for (name, view) in views {
            if !matches!(view.dtype(), Dtype::F32 | Dtype::U8) {
                return Err(bad(format!(
                    "tensor `{name}` is {:?}; checkpoints hold F32 (and U8 8-bit optimizer state)",
                    view.dtype()
                )));
            }
            if let Some(sums) = checksums.as_mut() {
                let stored = sums
                    .remove(&name)
                    .ok_or_else(|| bad(format!("tensor `{name}` has no checksum")))?;
                let actual = crc32fast::hash(view.data());
                if actual != stored {
                    return Err(bad(format!(
                        "tensor `{name}` is damaged: its data's CRC-32 is {actual:08x}, the file recorded {stored:08x}"
                    )));
                }
            }
            // A value the step computes, which earlier builds saved as a parameter
            // (`embed.narrow#1`, a GPT's position rows read from a quantized `wpe`): only
            // computed values' names hold `#`, and the model computes it again.
            if name.contains('#') {
                continue;
            }
            // Checked above; not copied where only the weights are kept.
            if keep == Keep::Weights && is_optimizer_state(&name) {
                done(view.data());
                continue;
            }
            if view.dtype() == Dtype::U8 {
                quantized.push(SavedBytes {
                    name,
                    shape: view.shape().to_vec(),
                    data: view.data().to_vec(),
                });
                done(view.data());
                continue;
            }
            let data: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            done(view.data());
            if let Some((index, value)) = snug_nn::safetensors_file::first_non_finite(&data) {
                return Err(TrainError::NonFiniteCheckpoint {
                    path: path.to_path_buf(),
                    name,
                    index,
                    value,
                });
            }
            // AdamW's second moment and an 8-bit block's absmax are never negative: resumed,
            // one would surface steps later as a NaN loss naming nothing.
            let absmax = name.ends_with(".adam8_m_absmax") || name.ends_with(".adam8_v_absmax");
            if name.ends_with(".adam_v") || absmax {
                if let Some((index, value)) = data.iter().enumerate().find(|(_, v)| **v < 0.0) {
                    return Err(bad(format!(
                        "tensor `{name}` holds {value} at index {index}: {} is never negative",
                        if absmax {
                            "an 8-bit block's absmax"
                        } else {
                            "AdamW's second moment"
                        }
                    )));
                }
            }
            tensors.push(SavedTensor {
                name,
                shape: view.shape().to_vec(),
                data,
            });
        }
        // A checksum left over names a tensor the file lost.
        if let Some(name) = checksums.and_then(|s| s.into_keys().min()) {
            return Err(bad(format!(
                "tensor `{name}` has a checksum but is not in the file"
            )));
        }
        let loss_scale = match meta.get("loss_scale") {
            Some(s) => Some(
                serde_json::from_str(s).map_err(|e| bad(format!("metadata `loss_scale`: {e}")))?,
            ),
            None => None,
        };
        let shard = match meta.get(SHARD_KEY) {
            Some(s) => Some(
                serde_json::from_str::<ShardOf>(s)
                    .map_err(|e| bad(format!("metadata `{SHARD_KEY}`: {e}")))?,
            ),
            None => None,
        };
        let ckpt = Checkpoint {
            step: number("step")?,
            tokens_seen: number("tokens_seen")?,
            config,
            tokenizer,
            tensors,
            quantized,
            loss_scale,
            per_rank: None,
        };
        Ok((ckpt, shard))
    }
}

/// What a load keeps of a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Every tensor: what a resume restores.
    All,
    /// The model's weights (and adapters), no optimizer state: what `sample` and `export`
    /// read. The optimizer's tensors are checked all the same.
    Weights,
}

/// Whether checkpoint tensor `name` is optimizer state (AdamW's moments, 8-bit AdamW's codes
/// and their absmaxes, the previous step's gradient norm).
fn is_optimizer_state(name: &str) -> bool {
    OPTIMIZER_SUFFIXES.iter().any(|s| name.ends_with(s))
}

/// A checkpoint file's bytes: read whole where it is small (or says it is: a `/proc` file
/// holds more than its size, which reading finds), mapped read-only where it is not.
enum FileBytes {
    Read(Vec<u8>),
    Mapped(memmap2::Mmap),
}

/// Files under this are read whole: mapping them saves nothing.
const MAP_FROM_BYTES: u64 = 1 << 20;

impl FileBytes {
    /// The bytes of checkpoint file `path`, after the checks [`read_whole`] makes of its kind
    /// and size. snug replaces a checkpoint by renaming a new file over it and never writes
    /// into one, so a mapping's bytes stay the file's.
    fn of(path: &Path) -> Result<FileBytes, TrainError> {
        let io = |source| TrainError::Io {
            path: path.to_path_buf(),
            source,
        };
        let size = crate::user_file::check_regular(path)?;
        if size < MAP_FROM_BYTES {
            return read_whole(path).map(FileBytes::Read);
        }
        let file = File::open(path).map_err(io)?;
        if file.metadata().map_err(io)?.len() != size {
            return Err(TrainError::Checkpoint {
                path: path.to_path_buf(),
                detail: format!("changed while it was opened: {size} bytes at first"),
            });
        }
        let len = usize::try_from(size).map_err(|_| TrainError::Checkpoint {
            path: path.to_path_buf(),
            detail: format!("{size} bytes do not fit in memory"),
        })?;
        // SAFETY: a read-only map of a regular file; see above for why its bytes stay put.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map(&file) }.map_err(io)?;
        Ok(FileBytes::Mapped(map))
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            FileBytes::Read(v) => v,
            FileBytes::Mapped(m) => m,
        }
    }

    /// Drops the whole pages of `part` (a slice of a mapping) from the process's resident
    /// set; a later read faults them in again from the page cache.
    fn release(&self, part: &[u8]) {
        const PAGE: usize = 4096;
        let FileBytes::Mapped(map) = self else {
            return;
        };
        let start = part.as_ptr() as usize - map.as_ptr() as usize;
        let (first, end) = (start.next_multiple_of(PAGE), start + part.len());
        let last = end - end % PAGE;
        if last > first {
            // SAFETY: `MADV_DONTNEED` on a read-only file mapping drops page-table entries
            // only; nothing was written through it, and the values read were copied out.
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, first, last - first)
            };
        }
    }
}

/// The bytes of the checkpoint file `path`. Only a regular file is opened (a FIFO would block
/// `open` and a device never ends), and no more is read than its size in the metadata: a
/// checkpoint is as large as it is, but a file that grows while read is not a checkpoint.
pub(crate) fn read_whole(path: &Path) -> Result<Vec<u8>, TrainError> {
    use std::io::Read;
    let io = |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    };
    let size = crate::user_file::check_regular(path)?;
    let file = File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    // An allocation that cannot succeed is an error naming the file, not an abort.
    usize::try_from(size)
        .ok()
        .and_then(|n| bytes.try_reserve_exact(n).ok())
        .ok_or_else(|| TrainError::Checkpoint {
            path: path.to_path_buf(),
            detail: format!("{size} bytes do not fit in memory"),
        })?;
    // One byte past the size tells a file that grew from one that is whole.
    file.take(size.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 != size {
        return Err(TrainError::Checkpoint {
            path: path.to_path_buf(),
            detail: format!(
                "changed while it was read: {size} bytes when opened, {} read",
                if bytes.len() as u64 > size {
                    "more".to_string()
                } else {
                    bytes.len().to_string()
                }
            ),
        });
    }
    Ok(bytes)
}

/// One tensor of a [`CheckpointRef`]: name, shape, and values (borrowed from host memory, or
/// copied back from a device).
pub type TensorRef<'a> = (&'a str, &'a [usize], Cow<'a, [f32]>);

/// One u8 tensor of a [`CheckpointRef`] (quantized optimizer state, a double-quantized base's
/// codes, whose name is made for the checkpoint).
pub type BytesRef<'a> = (Cow<'a, str>, &'a [usize], Cow<'a, [u8]>);

/// A checkpoint whose tensors are borrowed (from a live session), so saving a host session
/// copies nothing.
#[derive(Debug, Clone)]
pub struct CheckpointRef<'a> {
    pub step: u64,
    pub tokens_seen: u64,
    pub config: &'a TrainConfig,
    pub tokenizer: TokenizerSpec,
    /// Name, shape and values of each tensor.
    pub tensors: Vec<TensorRef<'a>>,
    /// Name, shape and codes of each quantized optimizer state (and of a double-quantized
    /// base's stored codes).
    pub quantized: Vec<BytesRef<'a>>,
    pub loss_scale: Option<LossScaler>,
    /// Set on one rank's shard of a sharded checkpoint (see [`crate::shards`]).
    pub shard: Option<ShardOf>,
}

impl CheckpointRef<'_> {
    /// Writes the checkpoint to `path` atomically.
    pub fn save(&self, path: &Path) -> Result<(), TrainError> {
        self.write_pending(path)?.commit()
    }

    /// Writes everything to a temporary file beside `path`; [`PendingWrite::commit`] makes it
    /// the checkpoint. Until then a crash leaves only the temporary file, which loading ignores.
    pub fn write_pending(&self, path: &Path) -> Result<PendingWrite, TrainError> {
        let io = |source| TrainError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file_name = path.file_name().ok_or_else(|| TrainError::Config {
            field: "checkpoint",
            detail: format!("`{}` is not a file path", path.display()),
        })?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let tmp = dir.join(format!(".{}.tmp", file_name.to_string_lossy()));
        let bytes: Vec<_> = self.tensors.iter().map(|t| le_bytes(&t.2)).collect();
        let mut views = Vec::with_capacity(bytes.len());
        for (&(name, shape, _), b) in self.tensors.iter().zip(&bytes) {
            let view = TensorView::new(Dtype::F32, shape.to_vec(), b).map_err(|e| {
                TrainError::Checkpoint {
                    path: path.to_path_buf(),
                    detail: format!("tensor `{name}`: {e}"),
                }
            })?;
            views.push((name, view));
        }
        for (name, shape, b) in &self.quantized {
            let view = TensorView::new(Dtype::U8, shape.to_vec(), b).map_err(|e| {
                TrainError::Checkpoint {
                    path: path.to_path_buf(),
                    detail: format!("tensor `{name}`: {e}"),
                }
            })?;
            views.push((name.as_ref(), view));
        }
        // Checksums of the borrowed bytes: one more read of the weights, no copy. Sorted, so
        // the same state always writes the same header.
        let checksums: std::collections::BTreeMap<&str, u32> = self
            .tensors
            .iter()
            .zip(&bytes)
            .map(|(&(name, _, _), b)| (name, crc32fast::hash(b)))
            .chain(
                self.quantized
                    .iter()
                    .map(|(name, _, b)| (name.as_ref(), crc32fast::hash(b))),
            )
            .collect();
        let mut metadata = self.metadata()?;
        metadata.insert(
            CHECKSUMS.to_string(),
            serde_json::to_string(&checksums).map_err(|e| TrainError::Checkpoint {
                path: path.to_path_buf(),
                detail: e.to_string(),
            })?,
        );
        let written = safetensors::serialize_to_file(views, Some(metadata), &tmp)
            .map_err(|e| TrainError::Checkpoint {
                path: tmp.clone(),
                detail: e.to_string(),
            })
            .and_then(|()| File::open(&tmp).and_then(|f| f.sync_all()).map_err(io));
        // `SNUG_FULL_DISK=1` (tests only): every checkpoint write fails as on a full disk, once
        // its bytes are written, so the temporary file has to be cleaned up.
        #[cfg(feature = "test-hooks")]
        let written = written.and_then(|()| match std::env::var("SNUG_FULL_DISK").as_deref() {
            Ok("1") => Err(TrainError::Io {
                path: tmp.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::StorageFull,
                    "no space left on device (SNUG_FULL_DISK)",
                ),
            }),
            _ => Ok(()),
        });
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        Ok(PendingWrite {
            tmp,
            path: path.to_path_buf(),
            dir,
        })
    }

    fn metadata(&self) -> Result<HashMap<String, String>, TrainError> {
        let json = |v: serde_json::Result<String>| {
            v.map_err(|e| TrainError::Checkpoint {
                path: PathBuf::new(),
                detail: e.to_string(),
            })
        };
        // The lowest version that reads the file whole: one without a stored base stays
        // readable by a snug from before version 3.
        let stored = crate::quantized::STORED_CODES_SUFFIX;
        let version = if self.quantized.iter().any(|q| q.0.ends_with(stored)) {
            VERSION
        } else {
            VERSION_WITHOUT_STORED_BASE
        };
        let mut meta = HashMap::from([
            ("format".to_string(), FORMAT.to_string()),
            ("version".to_string(), version.to_string()),
            ("step".to_string(), self.step.to_string()),
            ("tokens_seen".to_string(), self.tokens_seen.to_string()),
            (
                "config".to_string(),
                json(serde_json::to_string(self.config))?,
            ),
            (
                "tokenizer".to_string(),
                json(serde_json::to_string(&self.tokenizer))?,
            ),
        ]);
        if let Some(s) = &self.loss_scale {
            meta.insert("loss_scale".into(), json(serde_json::to_string(s))?);
        }
        if let Some(s) = &self.shard {
            meta.insert(SHARD_KEY.into(), json(serde_json::to_string(s))?);
        }
        Ok(meta)
    }
}

/// The little-endian bytes of `data`: a view of it on little-endian machines (no copy of the
/// weights while saving), a converted copy elsewhere.
fn le_bytes(data: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(data))
    } else {
        std::borrow::Cow::Owned(data.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// A checkpoint written to its temporary file but not yet in place.
#[derive(Debug)]
pub struct PendingWrite {
    tmp: PathBuf,
    path: PathBuf,
    dir: PathBuf,
}

impl PendingWrite {
    /// Renames the temporary file over the final name, then syncs the directory so the rename
    /// itself survives a power cut.
    pub fn commit(self) -> Result<(), TrainError> {
        fs::rename(&self.tmp, &self.path).map_err(|source| TrainError::Io {
            path: self.path.clone(),
            source,
        })?;
        sync_dir(&self.dir).map_err(|source| TrainError::Io {
            path: self.dir.clone(),
            source,
        })
    }

    pub fn temp_path(&self) -> &Path {
        &self.tmp
    }
}

#[cfg(unix)]
pub(crate) fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(not(unix))]
pub(crate) fn sync_dir(_dir: &Path) -> std::io::Result<()> {
    Ok(())
}

/// The step a checkpoint's name gives (`ckpt-<step>.safetensors`, or a sharded checkpoint's
/// manifest); `None` for any other name.
fn step_in_name(path: &Path) -> Option<u64> {
    let rest = path.file_name()?.to_str()?.strip_prefix(PREFIX)?;
    rest.strip_suffix(SUFFIX)
        .or_else(|| rest.strip_suffix(crate::shards::MANIFEST_SUFFIX))?
        .parse()
        .ok()
}

/// Refuses a checkpoint whose name gives another step than its contents: a renamed or copied
/// file would otherwise be listed as the newest and resume from an older state.
pub(crate) fn check_step_matches_name(path: &Path, step: u64) -> Result<(), TrainError> {
    match step_in_name(path) {
        Some(named) if named != step => Err(TrainError::Checkpoint {
            path: path.to_path_buf(),
            detail: format!(
                "holds the state after step {step}, but its name says step {named}: a renamed \
                 or copied checkpoint (rename it {PREFIX}{step:08}{SUFFIX}, or load it by a \
                 name of another form)"
            ),
        }),
        _ => Ok(()),
    }
}

/// Whether `dir` lists any checkpoint file, loadable or not.
pub fn holds_checkpoints(dir: &Path) -> bool {
    CheckpointDir::open(dir)
        .and_then(|d| d.list())
        .is_ok_and(|l| !l.is_empty())
}

/// A directory of checkpoints `ckpt-<step>.safetensors` (and sharded ones, each standing as its
/// manifest `ckpt-<step>.manifest.json`), newest kept.
#[derive(Debug, Clone)]
pub struct CheckpointDir {
    dir: PathBuf,
}

impl CheckpointDir {
    /// Opens (creating if needed) a checkpoint directory.
    pub fn create(dir: &Path) -> Result<CheckpointDir, TrainError> {
        // A file (or a link to one, or a dangling link) where the directory belongs is named
        // as such, not as the OS's "File exists".
        if fs::symlink_metadata(dir).is_ok() && !dir.is_dir() {
            return Err(TrainError::RunDirTaken {
                dir: dir.to_path_buf(),
                detail: "it is not a directory (a file, or a link to something else): give a \
                         directory for the run"
                    .into(),
            });
        }
        fs::create_dir_all(dir).map_err(|source| TrainError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        Ok(CheckpointDir {
            dir: dir.to_path_buf(),
        })
    }

    /// Opens an existing checkpoint directory.
    pub fn open(dir: &Path) -> Result<CheckpointDir, TrainError> {
        if !dir.is_dir() {
            return Err(TrainError::NoCheckpoint {
                dir: dir.to_path_buf(),
                detail: "no such directory".into(),
            });
        }
        Ok(CheckpointDir {
            dir: dir.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    pub fn path_for(&self, step: u64) -> PathBuf {
        whole_path(&self.dir, step)
    }

    /// Checkpoints by step, oldest first: whole files and sharded checkpoints' manifests
    /// (temporary files, and shard files, which a manifest stands for, are not listed).
    pub fn list(&self) -> Result<Vec<(u64, PathBuf)>, TrainError> {
        let entries = fs::read_dir(&self.dir).map_err(|source| TrainError::Io {
            path: self.dir.clone(),
            source,
        })?;
        let mut found: Vec<(u64, PathBuf)> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let path = e.path();
                Some((step_in_name(&path)?, path))
            })
            .collect();
        found.sort();
        Ok(found)
    }

    /// Saves `ckpt`, then deletes all but the newest `keep` checkpoints (and temporary files
    /// that an interrupted save left behind).
    pub fn save(&self, ckpt: &Checkpoint, keep: usize) -> Result<PathBuf, TrainError> {
        self.save_ref(&ckpt.as_ref(), keep)
    }

    /// As [`CheckpointDir::save`], for a borrowed checkpoint.
    pub fn save_ref(&self, ckpt: &CheckpointRef<'_>, keep: usize) -> Result<PathBuf, TrainError> {
        let path = self.path_for(ckpt.step);
        check_step_is_ours(&self.dir, ckpt.step, ckpt.config)?;
        ckpt.save(&path)?;
        self.retire(keep, ckpt.step, &path, ckpt.config)?;
        Ok(path)
    }

    /// After the save of `saved` (step `step`) by the run `ours` configures: deletes the other
    /// checkpoint of that step, if any (a sharded one where a whole one was just saved, or the
    /// reverse: the same state, resumed and saved again), all but the newest `keep` of the
    /// run's checkpoints, temporary files an interrupted save left behind, and shard files no
    /// manifest names. Another run's checkpoints, and files it cannot tell the run of, stay.
    pub(crate) fn retire(
        &self,
        keep: usize,
        step: u64,
        saved: &Path,
        ours: &TrainConfig,
    ) -> Result<(), TrainError> {
        let (mine, others): (Vec<_>, Vec<_>) = self
            .list()?
            .into_iter()
            .partition(|(_, p)| p.file_name() == saved.file_name() || is_of_run(p, ours));
        for (_, p) in &others {
            tracing::debug!("kept {}: not this run's checkpoint", p.display());
        }
        let (replaced, all): (Vec<_>, Vec<_>) = mine
            .into_iter()
            .partition(|(s, p)| *s == step && p.file_name() != saved.file_name());
        let retired = all.len().saturating_sub(keep.max(1));
        for (step, old) in replaced.iter().chain(&all[..retired]) {
            // A manifest goes first: without it its shards are no checkpoint.
            if let Err(e) = fs::remove_file(old) {
                tracing::warn!("could not remove old checkpoint {}: {e}", old.display());
            } else if crate::shards::is_manifest(old) {
                crate::shards::remove_shards(&self.dir, *step, None);
            }
        }
        crate::shards::remove_orphans(&self.dir);
        if let Ok(entries) = fs::read_dir(&self.dir) {
            for e in entries.filter_map(|e| e.ok()) {
                let name = e.file_name().to_string_lossy().into_owned();
                // Only a save's own temporary names (`.` + a checkpoint's, shard's or
                // manifest's name + `.tmp`): a user's `.ckpt-notes.tmp` is not ours.
                let saved_name = name
                    .strip_prefix('.')
                    .and_then(|n| n.strip_suffix(".tmp"))
                    .is_some_and(|n| {
                        step_in_name(Path::new(n)).is_some() || crate::shards::is_shard_name(n)
                    });
                if saved_name {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        Ok(())
    }

    /// Moves the checkpoint `path` (of `step`) aside, renamed `….damaged` (`….damaged.2`, … where
    /// an earlier one holds that name): kept, never deleted, and no longer listed. A sharded
    /// checkpoint's shard files go with its manifest.
    pub fn move_aside(&self, step: u64, path: &Path) -> Result<PathBuf, TrainError> {
        let aside = aside_path(path);
        fs::rename(path, &aside).map_err(|source| TrainError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if crate::shards::is_manifest(path) {
            crate::shards::move_shards_aside(&self.dir, step)?;
        }
        Ok(aside)
    }

    /// The newest checkpoint that loads; a newer file that does not (damaged, or not a regular
    /// file) is skipped with a warning. One written by a newer snug is an error: resuming an
    /// older one would fork the run.
    pub fn load_latest(&self) -> Result<(PathBuf, Checkpoint), TrainError> {
        self.load_latest_keeping(Keep::All)
    }

    /// [`CheckpointDir::load_latest`], keeping what `keep` says.
    pub fn load_latest_keeping(&self, keep: Keep) -> Result<(PathBuf, Checkpoint), TrainError> {
        let mut errors = Vec::new();
        for (_, path) in self.list()?.into_iter().rev() {
            match Checkpoint::load_keeping(&path, keep) {
                Ok(c) => {
                    for e in &errors {
                        tracing::warn!("skipped a checkpoint that does not load: {e}");
                    }
                    return Ok((path, c));
                }
                Err(e @ TrainError::CheckpointTooNew { .. }) => return Err(e),
                Err(e) => errors.push(e.to_string()),
            }
        }
        Err(TrainError::NoCheckpoint {
            dir: self.dir.clone(),
            detail: if errors.is_empty() {
                match crate::run::last_recorded_step(&self.dir) {
                    // Not a run that stopped: one in progress, whose files must not be removed.
                    Some(step) if crate::run_dir::held_by_a_run(&self.dir) => format!(
                        "no {PREFIX}<step>{SUFFIX} files yet: a run is training there now (it \
                         holds the directory's lock; its {} records {step} step(s)) and has not \
                         saved its first checkpoint; wait for one (`--checkpoint-every`) or for \
                         the run to end",
                        crate::run::METRICS_FILE
                    ),
                    Some(step) => format!(
                        "no {PREFIX}<step>{SUFFIX} files: the run there stopped before its first \
                         checkpoint (its {} records {step} step(s), lost with it); start it \
                         again with a new `--out` directory, or remove that file and start it there",
                        crate::run::METRICS_FILE
                    ),
                    None => format!("no {PREFIX}<step>{SUFFIX} files"),
                }
            } else {
                format!("none loads: {}", errors.join("; "))
            },
        })
    }
}

/// The most header a safetensors file may have (the `safetensors` crate's own bound).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Whether `path` is a snug checkpoint, a sharded one's manifest or one of its shards: by its
/// name (`ckpt-…`) or, whatever its name, by the `format` in its safetensors header (only the
/// header is read). Commands that write where a user says never write over one.
pub fn is_checkpoint_file(path: &Path) -> bool {
    let named = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
        n.starts_with(PREFIX)
            && (n.ends_with(SUFFIX) || n.ends_with(crate::shards::MANIFEST_SUFFIX))
    });
    named || header_format(path).as_deref() == Some(FORMAT)
}

/// The `version` in a snug checkpoint's safetensors header, read as plain JSON (nothing else of
/// the header need parse), if the bytes hold one.
fn raw_version(bytes: &[u8]) -> Option<u32> {
    let len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    if len > MAX_HEADER_BYTES {
        return None;
    }
    let end = 8usize.checked_add(usize::try_from(len).ok()?)?;
    let meta = metadata_in(bytes.get(8..end)?)?;
    if meta.get("format")?.as_str()? != FORMAT {
        return None;
    }
    meta.get("version")?.as_str()?.parse().ok()
}

/// The `__metadata__` object of a safetensors header's JSON, parsed as plain JSON.
fn metadata_in(header: &[u8]) -> Option<serde_json::Map<String, serde_json::Value>> {
    let header: serde_json::Value = serde_json::from_slice(header).ok()?;
    header.get("__metadata__")?.as_object().cloned()
}

/// `path`, renamed `….damaged`, or `….damaged.N` for the first N from 2 that no file holds: an
/// earlier damaged file moved aside is never replaced. (The run directory's lock keeps other
/// snug processes out between the check and the rename.)
pub(crate) fn aside_path(path: &Path) -> PathBuf {
    let named = |suffix: String| {
        let mut aside = path.as_os_str().to_owned();
        aside.push(suffix);
        PathBuf::from(aside)
    };
    std::iter::once(".damaged".to_string())
        .chain((2u64..).map(|n| format!(".damaged.{n}")))
        .map(named)
        .find(|p| fs::symlink_metadata(p).is_err())
        .unwrap_or_else(|| named(".damaged".into()))
}

/// The whole (unsharded) checkpoint file of `step` in `dir`: `ckpt-<step>.safetensors`.
fn whole_path(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("{PREFIX}{step:08}{SUFFIX}"))
}

/// Refuses a save of `step` by the run `ours` configures where the directory holds another
/// run's checkpoint of that step, whole or sharded (or one whose header does not read): a
/// save never replaces it, and the directory would otherwise hold two checkpoints of the
/// step from different runs, either of which a resume could take.
pub(crate) fn check_step_is_ours(
    dir: &Path,
    step: u64,
    ours: &TrainConfig,
) -> Result<(), TrainError> {
    let paths = [
        whole_path(dir, step),
        crate::shards::manifest_path(dir, step),
    ];
    match paths
        .into_iter()
        .find(|p| fs::symlink_metadata(p).is_ok() && !is_of_run(p, ours))
    {
        Some(path) => Err(TrainError::Checkpoint {
            path,
            detail: format!(
                "it holds another run's checkpoint of step {step} (or one whose header does \
                 not read), which this run never replaces: move it away, or continue into \
                 another `--out` directory"
            ),
        }),
        None => Ok(()),
    }
}

/// Whether the checkpoint at `path` (a manifest: its first shard's) was saved by the run
/// `ours` configures, from its header alone: by the run id, or, where it was saved before runs
/// had ids, by its model being `ours`'s. A file whose header does not read is not.
fn is_of_run(path: &Path, ours: &TrainConfig) -> bool {
    let Some(config) = header_config(path) else {
        return false;
    };
    match config.get("run_id") {
        Some(id) => id.as_str().is_some() && id.as_str() == ours.run_id.as_deref(),
        None => serde_json::to_value(&ours.model).ok().as_ref() == config.get("model"),
    }
}

/// The configuration in the header of the checkpoint at `path` (a manifest: its first
/// shard's), as JSON, where the header reads.
fn header_config(path: &Path) -> Option<serde_json::Value> {
    let header = if crate::shards::is_manifest(path) {
        crate::shards::first_shard(path).and_then(|p| header_metadata(&p))
    } else {
        header_metadata(path)
    };
    serde_json::from_str(header.as_ref()?.get("config")?.as_str()?).ok()
}

/// The id of the run that saved the checkpoint at `path`, from its header alone (None for a
/// checkpoint saved before runs had ids, or a header that does not read).
pub(crate) fn run_id_in(path: &Path) -> Option<String> {
    Some(header_config(path)?.get("run_id")?.as_str()?.to_string())
}

/// The `format` metadata of the safetensors header of the regular file `path`, if it has one.
fn header_format(path: &Path) -> Option<String> {
    let meta = header_metadata(path)?;
    Some(meta.get("format")?.as_str()?.to_string())
}

/// Whether the regular file `path` holds tensors: named `….safetensors`, or opening with a
/// safetensors header (any model's weights, a snug checkpoint's or a Hugging Face one's).
/// Commands that write a page or a trace never write over one, even with `--force`.
pub fn is_weights_file(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "safetensors")
        || header_bytes(path).is_some_and(|h| {
            serde_json::from_slice::<serde_json::Value>(&h).is_ok_and(|h| h.is_object())
        })
}

/// The `__metadata__` of the safetensors header of the regular file `path`, if it has one.
fn header_metadata(path: &Path) -> Option<serde_json::Map<String, serde_json::Value>> {
    metadata_in(&header_bytes(path)?)
}

/// The safetensors header's JSON bytes of the regular file `path`, where its length prefix
/// fits the file and [`MAX_HEADER_BYTES`].
fn header_bytes(path: &Path) -> Option<Vec<u8>> {
    use std::io::Read;
    let size = crate::user_file::check_regular(path).ok()?;
    let mut file = File::open(path).ok()?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).ok()?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER_BYTES || len.saturating_add(8) > size {
        return None;
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).ok()?;
    Some(header)
}

/// Loads `path`: a checkpoint file, or the newest checkpoint in a directory.
pub fn load(path: &Path) -> Result<(PathBuf, Checkpoint), TrainError> {
    load_keeping(path, Keep::All)
}

/// [`load`], keeping what `keep` says.
pub fn load_keeping(path: &Path, keep: Keep) -> Result<(PathBuf, Checkpoint), TrainError> {
    if path.is_dir() {
        CheckpointDir::open(path)?.load_latest_keeping(keep)
    } else {
        Ok((path.to_path_buf(), Checkpoint::load_keeping(path, keep)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO or device is refused by its type before it is opened (opening a FIFO would wait
    /// for a writer), and a file whose metadata understates its size is read no further than
    /// that size.
    #[cfg(target_os = "linux")]
    #[test]
    fn only_regular_files_are_read_and_no_more_than_their_size() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("ckpt-00000001.safetensors");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for path in [fifo.as_path(), Path::new("/dev/zero")] {
            let err = Checkpoint::load(path).unwrap_err();
            assert!(
                matches!(&err, TrainError::NotAFile { path: p, .. } if p == path),
                "{err:?}"
            );
        }
        // The directory's only checkpoint is the FIFO: nothing loads, and it says why.
        let err = load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("FIFO"), "{err}");

        // `/proc` files say 0 bytes and hold more.
        let maps = Path::new("/proc/self/maps");
        let err = Checkpoint::load(maps).unwrap_err();
        assert!(
            matches!(&err, TrainError::Checkpoint { detail, .. } if detail.contains("changed while it was read")),
            "{err:?}"
        );
    }
}
