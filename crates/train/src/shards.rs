//! Sharded checkpoints, for runs over several ranks under ZeRO stages 1–3, where each rank
//! holds a shard of the optimizer state (and at stage 3 of the parameters).
//!
//! Each rank writes its own file, `ckpt-<step>.<save>.shard-<rank>-of-<ranks>.safetensors`, a
//! snug checkpoint file holding what that rank alone holds; rank 0's also holds what every
//! rank holds whole. `<save>` is a number rank 0 draws for each save, so no save writes over a
//! file an earlier one left. Once every rank has said its file is written (an all-gather), rank 0
//! writes `ckpt-<step>.manifest.json` last, atomically: the world size, the ZeRO stage, the
//! step, every tensor's whole shape and how the ranks hold it, and every shard file with its
//! length and CRC-32. The manifest is the checkpoint: without one (a rank died mid-save)
//! the shard files are not listed and never loaded, and the directory's earlier checkpoints
//! are as they were.
//!
//! Loading a manifest checks every shard against it, then consolidates: a sharded tensor's
//! shards are concatenated in rank order (each file holds its rank's elements without the zero
//! padding that equal blocks add in memory), so the result is the [`Checkpoint`] one process
//! would have saved. A run on any number of ranks restores from that (see
//! [`crate::Trainer::restore`]), taking its own shard of each tensor.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use snug_cpu::kernels::collective::installed;

use crate::checkpoint::{
    self, Checkpoint, CheckpointDir, CheckpointRef, PerRankState, SavedBytes, SavedTensor, ShardOf,
    PREFIX, SUFFIX,
};
use crate::tokenizer::TokenizerSpec;
use crate::{LossScaler, TrainConfig, TrainError};

/// How a sharded checkpoint's manifest is named after its step: `ckpt-<step>.manifest.json`.
pub const MANIFEST_SUFFIX: &str = ".manifest.json";
/// The manifest's `format`.
pub const FORMAT: &str = "snug-sharded-checkpoint";
pub const VERSION: u32 = 1;
/// A manifest lists one line per tensor: far below this for any model.
const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// How the ranks of a run hold a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// Every rank holds all of it; rank 0's file has it.
    Whole,
    /// Rank `r` of `N` holds elements `r·s .. (r+1)·s` of the flattened tensor (`s = ⌈n/N⌉`,
    /// see [`owned_range`]); each rank's file has its elements, without padding.
    Sharded,
    /// Each rank holds its own, under the step graph's name: only a run on as many ranks
    /// restores it.
    PerRank,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DType {
    F32,
    U8,
}

/// One tensor of a sharded checkpoint: its whole name and shape (per-rank state: the step
/// graph's name and one rank's shape).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub layout: Layout,
}

/// One rank's file, as rank 0 recorded it once the rank had written it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub rank: usize,
    /// File name, in the manifest's directory.
    pub file: String,
    pub bytes: u64,
    pub crc32: u32,
}

/// `ckpt-<step>.manifest.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub step: u64,
    pub tokens_seen: u64,
    /// World size of the run that saved it.
    pub ranks: usize,
    /// ZeRO stage of the run that saved it.
    pub stage: u8,
    pub tensors: Vec<TensorEntry>,
    /// One per rank, in rank order.
    pub shards: Vec<ShardEntry>,
}

/// Whether `path` names a sharded checkpoint's manifest.
pub fn is_manifest(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with(PREFIX) && n.ends_with(MANIFEST_SUFFIX))
}

/// The manifest of step `step`'s checkpoint in `dir`.
pub fn manifest_path(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("{PREFIX}{step:08}{MANIFEST_SUFFIX}"))
}

/// The elements of a tensor of `numel` elements rank `rank` of `ranks` holds: its equal block,
/// less the padding past the end (empty where the block is all padding).
pub fn owned_range(numel: usize, rank: usize, ranks: usize) -> Range<usize> {
    let s = snug_graph::ops::shard_len(numel, ranks);
    (rank * s).min(numel)..((rank + 1) * s).min(numel)
}

/// One tensor of a rank's file: name, shape and values.
pub type ShardTensor<'a, T> = (String, Vec<usize>, Cow<'a, [T]>);

/// One rank's part of a sharded checkpoint.
#[derive(Debug, Clone)]
pub struct ShardRef<'a> {
    pub rank: usize,
    pub ranks: usize,
    pub stage: u8,
    pub step: u64,
    pub tokens_seen: u64,
    pub config: &'a TrainConfig,
    pub tokenizer: TokenizerSpec,
    pub loss_scale: Option<LossScaler>,
    /// Every tensor of the checkpoint: the same list on every rank.
    pub layout: Vec<TensorEntry>,
    /// This rank's file: the whole tensors (rank 0 only), its elements of the sharded ones
    /// (under their whole names) and its per-rank state.
    pub tensors: Vec<ShardTensor<'a, f32>>,
    pub quantized: Vec<ShardTensor<'a, u8>>,
}

fn shard_file_name(step: u64, save: u32, rank: usize, ranks: usize) -> String {
    format!("{PREFIX}{step:08}.{save:08x}.shard-{rank}-of-{ranks}{SUFFIX}")
}

/// `(step, save)` of a shard file's name.
fn parse_shard_name(name: &str) -> Option<(u64, u32)> {
    let rest = name.strip_prefix(PREFIX)?.strip_suffix(SUFFIX)?;
    let (step, rest) = rest.split_once('.')?;
    let (save, rest) = rest.split_once('.')?;
    let (rank, ranks) = rest.strip_prefix("shard-")?.split_once("-of-")?;
    rank.parse::<usize>().ok()?;
    ranks.parse::<usize>().ok()?;
    Some((step.parse().ok()?, u32::from_str_radix(save, 16).ok()?))
}

/// Every rank's `mine` (of one length on every rank), in rank order; `mine` alone without a
/// transport. Every rank must call it at the same point.
fn gather(mine: &[f32]) -> Vec<f32> {
    match installed() {
        Some(t) => {
            let mut all = vec![0.0; mine.len() * t.size()];
            t.all_gather(mine, &mut all);
            all
        }
        None => mine.to_vec(),
    }
}

/// `v` in 16-bit pieces, which f32 holds exactly, low first.
fn pieces(v: u64, n: usize) -> impl Iterator<Item = f32> {
    (0..n).map(move |i| ((v >> (16 * i)) & 0xffff) as f32)
}

fn from_pieces(p: &[f32]) -> u64 {
    p.iter()
        .enumerate()
        .fold(0, |acc, (i, &x)| acc | ((x as u64) << (16 * i)))
}

/// Rank 0's run directory, made known to every rank (the others claim none of their own);
/// `None` when rank 0 saves nothing. Every rank calls it at the same point.
pub fn agree_dir(mine: Option<&Path>) -> Option<PathBuf> {
    let rank = installed().map_or(0, |t| t.rank());
    // Absolute, so a rank started in another directory writes beside rank 0's files.
    let path = mine
        .filter(|_| rank == 0)
        .map(|p| fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf()));
    let bytes: Vec<u8> = path.as_deref().map(path_bytes).unwrap_or_default();
    // The length (plus one, zero for none) in pieces, then the bytes, one per element.
    let len = path.as_ref().map_or(0, |_| bytes.len() as u64 + 1);
    let lens = gather(&pieces(len, 4).collect::<Vec<_>>());
    let len = from_pieces(&lens[..4]);
    let n = len.checked_sub(1)? as usize;
    let send: Vec<f32> = if rank == 0 {
        bytes.iter().map(|&b| f32::from(b)).collect()
    } else {
        vec![0.0; n]
    };
    let all = gather(&send);
    Some(path_from(all[..n].iter().map(|&b| b as u8).collect()))
}

#[cfg(unix)]
fn path_bytes(p: &Path) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    p.as_os_str().as_bytes().to_vec()
}

#[cfg(unix)]
fn path_from(bytes: Vec<u8>) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    PathBuf::from(std::ffi::OsString::from_vec(bytes))
}

#[cfg(not(unix))]
fn path_bytes(p: &Path) -> Vec<u8> {
    p.to_string_lossy().into_owned().into_bytes()
}

#[cfg(not(unix))]
fn path_from(bytes: Vec<u8>) -> PathBuf {
    PathBuf::from(String::from_utf8_lossy(&bytes).into_owned())
}

/// The number rank 0 draws for a save, which names its files.
fn agree_save_number(rank: usize, refuse: bool) -> (u32, bool) {
    let mine = if rank == 0 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut h = crc32fast::Hasher::new();
        h.update(&nanos.to_le_bytes());
        h.update(&std::process::id().to_le_bytes());
        h.finalize()
    } else {
        0
    };
    let piece: Vec<f32> = pieces(u64::from(mine), 2)
        .chain([f32::from(u8::from(refuse))])
        .collect();
    let all = gather(&piece);
    (from_pieces(&all[..2]) as u32, all[2] != 0.0)
}

/// Length and CRC-32 of the file `path`, read in pieces.
fn file_digest(path: &Path) -> Result<(u64, u32), TrainError> {
    let io = |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        len += n as u64;
    }
    Ok((len, h.finalize()))
}

/// Saves `shard` as this rank's part of the checkpoint of its step in `dir`; every rank calls it
/// at the same point. Each rank writes its file atomically; once every rank has said it wrote
/// its own, rank 0 writes the manifest, atomically, then (given `retire`: its run directory and
/// how many checkpoints to keep) removes what the new checkpoint replaces. Until the manifest
/// is in place the directory's checkpoints are those it held before. Returns the manifest's
/// path.
pub fn save(
    dir: &Path,
    shard: &ShardRef<'_>,
    retire: Option<(&CheckpointDir, usize)>,
) -> Result<PathBuf, TrainError> {
    // Rank 0 alone looks for another run's checkpoint of this step (the directory is shared
    // or the same on every rank) and every rank learns its verdict before writing anything.
    let refused = (shard.rank == 0)
        .then(|| checkpoint::check_step_is_ours(dir, shard.step, shard.config).err())
        .flatten();
    let (save, anyone_refused) = agree_save_number(shard.rank, refused.is_some());
    if let Some(e) = refused {
        return Err(e);
    }
    if anyone_refused {
        return Err(TrainError::Checkpoint {
            path: manifest_path(dir, shard.step),
            detail: format!(
                "rank 0 found another run's checkpoint of step {} in its run directory, which \
                 this run never replaces",
                shard.step
            ),
        });
    }
    let file = shard_file_name(shard.step, save, shard.rank, shard.ranks);
    let written = write_shard(&dir.join(&file), shard);
    let mine: Vec<f32> = match &written {
        Ok((bytes, crc)) => std::iter::once(1.0)
            .chain(pieces(*bytes, 4))
            .chain(pieces(u64::from(*crc), 2))
            .collect(),
        Err(_) => vec![0.0; 7],
    };
    // Every rank learns whether every shard is written, its own failure included, so none waits.
    let all = gather(&mine);
    written?;
    let manifest = manifest_path(dir, shard.step);
    let failed: Vec<String> = all
        .chunks_exact(7)
        .enumerate()
        .filter(|(_, s)| s[0] != 1.0)
        .map(|(r, _)| r.to_string())
        .collect();
    if !failed.is_empty() {
        // No manifest will name this rank's shard: it goes now rather than at the next save,
        // since a full disk is the likely cause.
        if let Err(e) = fs::remove_file(dir.join(&file)) {
            tracing::warn!("could not remove the unused shard {file}: {e}");
        }
        return Err(TrainError::Checkpoint {
            path: manifest,
            detail: format!(
                "rank {} could not write its shard of step {}: this checkpoint was not made, and \
                 the directory's earlier ones are as they were",
                failed.join(", "),
                shard.step
            ),
        });
    }
    if shard.rank != 0 {
        return Ok(manifest);
    }
    let m = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        step: shard.step,
        tokens_seen: shard.tokens_seen,
        ranks: shard.ranks,
        stage: shard.stage,
        tensors: shard.layout.clone(),
        shards: all
            .chunks_exact(7)
            .enumerate()
            .map(|(rank, s)| ShardEntry {
                rank,
                file: shard_file_name(shard.step, save, rank, shard.ranks),
                bytes: from_pieces(&s[1..5]),
                crc32: from_pieces(&s[5..7]) as u32,
            })
            .collect(),
    };
    if let Err(e) = write_manifest(&manifest, &m) {
        // No manifest names these shards: they go now, as a full disk is the likely cause.
        for s in &m.shards {
            let _ = fs::remove_file(dir.join(&s.file));
        }
        return Err(e);
    }
    if let Some((ckpt_dir, keep)) = retire {
        // An earlier save of this step (resumed from it, saved again) had other files.
        remove_shards(dir, shard.step, Some(save));
        ckpt_dir.retire(keep, shard.step, &manifest, shard.config)?;
    }
    Ok(manifest)
}

fn write_shard(path: &Path, shard: &ShardRef<'_>) -> Result<(u64, u32), TrainError> {
    CheckpointRef {
        step: shard.step,
        tokens_seen: shard.tokens_seen,
        config: shard.config,
        tokenizer: shard.tokenizer.clone(),
        tensors: shard
            .tensors
            .iter()
            .map(|(n, s, d)| (n.as_str(), s.as_slice(), Cow::Borrowed(&**d)))
            .collect(),
        quantized: shard
            .quantized
            .iter()
            .map(|(n, s, d)| (Cow::Borrowed(n.as_str()), s.as_slice(), Cow::Borrowed(&**d)))
            .collect(),
        loss_scale: shard.loss_scale,
        shard: Some(ShardOf {
            rank: shard.rank,
            ranks: shard.ranks,
        }),
    }
    .save(path)?;
    file_digest(path).inspect_err(|_| {
        let _ = fs::remove_file(path);
    })
}

/// Writes the manifest to a temporary file, syncs it, renames it into place and syncs the
/// directory.
fn write_manifest(path: &Path, m: &Manifest) -> Result<(), TrainError> {
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| TrainError::Io { path: p, source }
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{}.tmp", name.unwrap_or_default()));
    let text = serde_json::to_string_pretty(m).map_err(|e| TrainError::Checkpoint {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })?;
    let written = File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(text.as_bytes())?;
            f.sync_all()
        })
        .map_err(io(&tmp));
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    fs::rename(&tmp, path).map_err(io(path))?;
    checkpoint::sync_dir(&dir).map_err(io(&dir))
}

/// Reads the manifest `path`, checks every shard file it names (present, its length and CRC-32
/// as recorded, rank and step as the manifest says) and consolidates them into whole tensors.
pub fn load(path: &Path) -> Result<Checkpoint, TrainError> {
    let bad = |p: &Path, detail: String| TrainError::Checkpoint {
        path: p.to_path_buf(),
        detail,
    };
    let text = crate::user_file::read_text(path, MAX_MANIFEST_BYTES, "a checkpoint manifest")?;
    // A newer snug's manifest may not parse here at all: its version, read first, says so.
    let raw: Option<serde_json::Value> = serde_json::from_str(&text).ok();
    let version = raw
        .as_ref()
        .filter(|v| v.get("format").and_then(|f| f.as_str()) == Some(FORMAT))
        .and_then(|v| v.get("version")?.as_u64());
    if let Some(version) = version.filter(|&v| v > u64::from(VERSION)) {
        return Err(TrainError::CheckpointTooNew {
            path: path.to_path_buf(),
            version: u32::try_from(version).unwrap_or(u32::MAX),
            newest: VERSION,
        });
    }
    let m: Manifest = serde_json::from_str(&text)
        .map_err(|e| bad(path, format!("not a snug checkpoint manifest: {e}")))?;
    if m.format != FORMAT {
        return Err(bad(
            path,
            format!("`format` is `{}`, expected `{FORMAT}`", m.format),
        ));
    }
    if m.version > VERSION {
        return Err(TrainError::CheckpointTooNew {
            path: path.to_path_buf(),
            version: m.version,
            newest: VERSION,
        });
    }
    if m.version != VERSION {
        return Err(bad(
            path,
            format!(
                "manifest version {}; this snug reads version {VERSION}",
                m.version
            ),
        ));
    }
    crate::checkpoint::check_step_matches_name(path, m.step)?;
    if m.ranks == 0
        || m.shards.len() != m.ranks
        || m.shards.iter().enumerate().any(|(r, s)| s.rank != r)
    {
        return Err(bad(
            path,
            format!(
                "lists {} shard files for {} ranks: one per rank, in rank order",
                m.shards.len(),
                m.ranks
            ),
        ));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut files = Vec::with_capacity(m.ranks);
    for s in &m.shards {
        if parse_shard_name(&s.file).is_none() || s.file.contains(['/', '\\']) {
            return Err(bad(
                path,
                format!("shard file `{}` is not a shard's name", s.file),
            ));
        }
        let file = dir.join(&s.file);
        if fs::symlink_metadata(&file).is_err() {
            return Err(bad(
                &file,
                format!(
                    "is missing: the manifest {} lists it as rank {}'s shard",
                    path.display(),
                    s.rank
                ),
            ));
        }
        let bytes = checkpoint::read_whole(&file)?;
        if bytes.len() as u64 != s.bytes {
            return Err(bad(
                &file,
                format!(
                    "is {} bytes, and the manifest {} recorded {}: truncated or replaced",
                    bytes.len(),
                    path.display(),
                    s.bytes
                ),
            ));
        }
        let crc = crc32fast::hash(&bytes);
        if crc != s.crc32 {
            return Err(bad(
                &file,
                format!(
                    "is damaged: its CRC-32 is {crc:08x}, and the manifest {} recorded {:08x}",
                    path.display(),
                    s.crc32
                ),
            ));
        }
        let (ckpt, of) = Checkpoint::parse(&file, &bytes)?;
        drop(bytes);
        let expected = ShardOf {
            rank: s.rank,
            ranks: m.ranks,
        };
        if of != Some(expected) {
            return Err(bad(
                &file,
                format!(
                    "is not rank {} of {}'s shard, as the manifest {} says",
                    s.rank,
                    m.ranks,
                    path.display()
                ),
            ));
        }
        if ckpt.step != m.step {
            return Err(bad(
                &file,
                format!(
                    "holds step {}, and the manifest {} step {}",
                    ckpt.step,
                    path.display(),
                    m.step
                ),
            ));
        }
        files.push((file, ckpt));
    }
    consolidate(path, &m, files)
}

/// One rank's file, its tensors by name, taken as they are used.
struct RankFile {
    path: PathBuf,
    tensors: HashMap<String, SavedTensor>,
    quantized: HashMap<String, SavedBytes>,
}

fn consolidate(
    manifest: &Path,
    m: &Manifest,
    files: Vec<(PathBuf, Checkpoint)>,
) -> Result<Checkpoint, TrainError> {
    let bad = |p: &Path, detail: String| TrainError::Checkpoint {
        path: p.to_path_buf(),
        detail,
    };
    let mut head = None;
    let mut ranks: Vec<RankFile> = Vec::with_capacity(files.len());
    for (path, mut ckpt) in files {
        let tensors = std::mem::take(&mut ckpt.tensors)
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
        let quantized = std::mem::take(&mut ckpt.quantized)
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
        head.get_or_insert(ckpt);
        ranks.push(RankFile {
            path,
            tensors,
            quantized,
        });
    }
    let Some(head) = head else {
        return Err(bad(manifest, "lists no shard files".into()));
    };
    let missing = |f: &RankFile, name: &str| {
        bad(
            &f.path,
            format!(
                "tensor `{name}` is missing: the manifest {} lists it",
                manifest.display()
            ),
        )
    };
    let wrong_shape = |f: &RankFile, name: &str, shape: &[usize], want: &[usize]| {
        bad(
            &f.path,
            format!(
                "tensor `{name}` has shape {shape:?}, and the manifest {} says {want:?}",
                manifest.display()
            ),
        )
    };
    let mut tensors = Vec::new();
    let mut quantized = Vec::new();
    let mut per_rank = PerRankState {
        ranks: m.ranks,
        stage: m.stage,
        tensors: vec![Vec::new(); m.ranks],
        quantized: vec![Vec::new(); m.ranks],
    };
    for e in &m.tensors {
        match (e.layout, e.dtype) {
            (Layout::Whole, DType::F32) => {
                let f = &mut ranks[0];
                let t = f
                    .tensors
                    .remove(&e.name)
                    .ok_or_else(|| missing(f, &e.name))?;
                if t.shape != e.shape {
                    return Err(wrong_shape(f, &e.name, &t.shape, &e.shape));
                }
                tensors.push(t);
            }
            (Layout::Whole, DType::U8) => {
                let f = &mut ranks[0];
                let t = f
                    .quantized
                    .remove(&e.name)
                    .ok_or_else(|| missing(f, &e.name))?;
                if t.shape != e.shape {
                    return Err(wrong_shape(f, &e.name, &t.shape, &e.shape));
                }
                quantized.push(t);
            }
            (Layout::Sharded, DType::F32) => {
                let numel: usize = e.shape.iter().product();
                let mut data = Vec::with_capacity(numel);
                for (r, f) in ranks.iter_mut().enumerate() {
                    let t = f
                        .tensors
                        .remove(&e.name)
                        .ok_or_else(|| missing(f, &e.name))?;
                    let want = [owned_range(numel, r, m.ranks).len()];
                    if t.shape != want {
                        return Err(wrong_shape(f, &e.name, &t.shape, &want));
                    }
                    data.extend_from_slice(&t.data);
                }
                tensors.push(SavedTensor {
                    name: e.name.clone(),
                    shape: e.shape.clone(),
                    data,
                });
            }
            (Layout::Sharded, DType::U8) => {
                return Err(bad(
                    manifest,
                    format!(
                        "tensor `{}`: u8 state is held per rank, never sharded by element",
                        e.name
                    ),
                ))
            }
            (Layout::PerRank, dtype) => {
                for (r, f) in ranks.iter_mut().enumerate() {
                    let shape = match dtype {
                        DType::F32 => {
                            let t = f
                                .tensors
                                .remove(&e.name)
                                .ok_or_else(|| missing(f, &e.name))?;
                            let shape = t.shape.clone();
                            per_rank.tensors[r].push(t);
                            shape
                        }
                        DType::U8 => {
                            let t = f
                                .quantized
                                .remove(&e.name)
                                .ok_or_else(|| missing(f, &e.name))?;
                            let shape = t.shape.clone();
                            per_rank.quantized[r].push(t);
                            shape
                        }
                    };
                    if shape != e.shape {
                        return Err(wrong_shape(f, &e.name, &shape, &e.shape));
                    }
                }
            }
        }
    }
    for f in &ranks {
        if let Some(name) = f.tensors.keys().chain(f.quantized.keys()).min() {
            return Err(bad(
                &f.path,
                format!(
                    "tensor `{name}` is not in the manifest {}",
                    manifest.display()
                ),
            ));
        }
    }
    let any_per_rank = per_rank.tensors.iter().any(|t| !t.is_empty())
        || per_rank.quantized.iter().any(|t| !t.is_empty());
    Ok(Checkpoint {
        step: m.step,
        tokens_seen: m.tokens_seen,
        tensors,
        quantized,
        per_rank: any_per_rank.then_some(per_rank),
        ..head
    })
}

/// A shard file in `dir` that no manifest names, if there is one: the unfinished save of some
/// run, which only that run's resume may clear away.
pub(crate) fn unnamed_shard(dir: &Path) -> Option<String> {
    shard_files(dir)
        .into_iter()
        .find(|(_, _, step, _)| fs::symlink_metadata(manifest_path(dir, *step)).is_err())
        .map(|(_, name, _, _)| name)
}

/// Whether `name` is a shard file's name (the temporary files of a save are named after it).
pub(crate) fn is_shard_name(name: &str) -> bool {
    parse_shard_name(name).is_some()
}

/// Shard files in `dir`: path, name, step and save number.
fn shard_files(dir: &Path) -> Vec<(PathBuf, String, u64, u32)> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let (step, save) = parse_shard_name(&name)?;
            Some((e.path(), name, step, save))
        })
        .collect()
}

/// Removes the shard files of `step` not from save `keep` (all of them without one).
pub(crate) fn remove_shards(dir: &Path, step: u64, keep: Option<u32>) {
    for (path, _, s, save) in shard_files(dir) {
        if s == step && Some(save) != keep {
            if let Err(e) = fs::remove_file(&path) {
                tracing::warn!("could not remove old shard {}: {e}", path.display());
            }
        }
    }
}

/// The path of the first shard file the manifest at `path` names, if it reads.
pub(crate) fn first_shard(path: &Path) -> Option<PathBuf> {
    let text =
        crate::user_file::read_text(path, MAX_MANIFEST_BYTES, "a checkpoint manifest").ok()?;
    let m: Manifest = serde_json::from_str(&text).ok()?;
    Some(path.parent()?.join(&m.shards.first()?.file))
}

/// Removes shard files no manifest names: a save that did not finish (a rank died), or one a
/// later save of the same step replaced. Files whose manifest cannot be read are kept.
pub(crate) fn remove_orphans(dir: &Path) {
    let mut manifests: HashMap<u64, Option<Manifest>> = HashMap::new();
    for (path, name, step, _) in shard_files(dir) {
        let m = manifests.entry(step).or_insert_with(|| {
            let mp = manifest_path(dir, step);
            let text =
                crate::user_file::read_text(&mp, MAX_MANIFEST_BYTES, "a checkpoint manifest");
            serde_json::from_str::<Manifest>(&text.ok()?).ok()
        });
        let named = match m {
            Some(m) => m.shards.iter().any(|s| s.file == name),
            // No manifest at all: an unfinished save. One that does not parse: kept.
            None => fs::symlink_metadata(manifest_path(dir, step)).is_ok(),
        };
        if !named {
            if let Err(e) = fs::remove_file(&path) {
                tracing::warn!("could not remove unused shard {}: {e}", path.display());
            }
        }
    }
}

/// Renames every shard file of `step` to `….damaged`, beside its manifest moved aside.
pub(crate) fn move_shards_aside(dir: &Path, step: u64) -> Result<(), TrainError> {
    for (path, _, s, _) in shard_files(dir) {
        if s == step {
            let aside = crate::checkpoint::aside_path(&path);
            fs::rename(&path, &aside).map_err(|source| TrainError::Io {
                path: path.clone(),
                source,
            })?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_round_trip_and_ranges_cover_the_tensor_once() {
        let name = shard_file_name(12, 0xdead_beef, 1, 3);
        assert_eq!(name, "ckpt-00000012.deadbeef.shard-1-of-3.safetensors");
        assert_eq!(parse_shard_name(&name), Some((12, 0xdead_beef)));
        assert_eq!(parse_shard_name("ckpt-00000012.safetensors"), None);
        assert_eq!(parse_shard_name("ckpt-00000012.manifest.json"), None);
        // 10 elements over 4 ranks: blocks of 3, the last holding 1 (2 of padding).
        let ranges: Vec<_> = (0..4).map(|r| owned_range(10, r, 4)).collect();
        assert_eq!(ranges, [0..3, 3..6, 6..9, 9..10]);
        // 1 element over 2 ranks: rank 1's block is all padding.
        assert_eq!(owned_range(1, 1, 2), 1..1);
        for v in [
            0u64,
            1,
            0xffff,
            0x1_0000,
            123_456_789_012,
            u64::from(u32::MAX),
        ] {
            assert_eq!(from_pieces(&pieces(v, 4).collect::<Vec<_>>()), v);
        }
    }
}
