//! Hugging Face model directories in and out, for every architecture snug builds: `config.json`
//! beside one `model.safetensors` or shards listed by `model.safetensors.index.json`, with F32,
//! F16 or BF16 (or F64) tensors.
//!
//! [`HfCheckpoint::open`] reads the configuration, maps every shard and checks every tensor
//! against the model (name, shape, dtype, which shard the index says holds it) before a single
//! weight is decoded, so a bad checkpoint is refused before anything is allocated or written.
//! Weights are then decoded one parameter at a time, straight from the mapped file into the
//! caller's buffer, a tile of rows at a time (transposing `nn.Linear`'s `[out, in]` into snug's
//! `[in, out]` on the way): no copy of the file is ever read into memory, and at most one
//! tile beside the destination exists at a time.
//!
//! [`save_hf_model`] writes the same layout back (F32, one file) from any source of parameter
//! values, one tensor at a time.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use safetensors::{Dtype, View};
use serde_json::Value;

use crate::hf_weights::{decode_into, element_bytes, write_atomically};
use crate::{ModelConfig, NnError};

/// The model's configuration in a Hugging Face model directory.
pub const CONFIG_FILE: &str = "config.json";
/// The weights of an unsharded checkpoint.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// Which shard holds each tensor of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The most an index file may hold (a 405B model's is about 100 KB).
const MAX_INDEX_BYTES: u64 = 64 << 20;
/// Elements decoded at a time: a tile of a few tens of kilobytes stays in cache.
const TILE_ELEMS: usize = 1 << 14;

/// Whether `path` is a Hugging Face model directory (a directory holding `config.json`), as
/// opposed to a snug run directory or a file.
pub fn is_hf_dir(path: &Path) -> bool {
    path.is_dir() && path.join(CONFIG_FILE).exists()
}

/// Why `path` cannot be read as a model directory when it holds a model's weights but no
/// `config.json` beside them (a copy that left it behind); `None` otherwise.
pub fn config_missing_beside_weights(path: &Path) -> Option<String> {
    let weights = [WEIGHTS_FILE, INDEX_FILE]
        .iter()
        .any(|f| path.join(f).exists());
    (path.is_dir() && weights && !path.join(CONFIG_FILE).exists()).then(|| {
        format!(
            "{}: holds a model's weights but no {CONFIG_FILE} beside them, which a Hugging Face \
             model directory needs (copy the model's {CONFIG_FILE} there)",
            path.display()
        )
    })
}

/// One parameter as a Hugging Face checkpoint stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfTensor {
    /// snug's name, which is the Hugging Face name (GPT-2 files may add `transformer.`).
    pub name: String,
    /// snug's shape.
    pub shape: Vec<usize>,
    /// The shape in the file: `shape` reversed for a transposed linear weight.
    pub hf_shape: Vec<usize>,
    /// Stored `[out, in]` (`nn.Linear`), the transpose of snug's `[in, out]`.
    pub transposed: bool,
}

/// Every parameter of `cfg` as a Hugging Face checkpoint stores it, in snug's graph order.
/// GPT-2's `Conv1D` weights are stored `[in, out]` as snug stores them; Llama-family
/// `nn.Linear` weights (and an untied LM head) are stored transposed.
pub fn hf_tensors(cfg: &ModelConfig) -> Vec<HfTensor> {
    cfg.parameter_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let transposed = matches!(cfg, ModelConfig::Llama(_))
                && shape.len() == 2
                && name != "model.embed_tokens.weight";
            let hf_shape = if transposed {
                vec![shape[1], shape[0]]
            } else {
                shape.clone()
            };
            HfTensor {
                name,
                shape,
                hf_shape,
                transposed,
            }
        })
        .collect()
}

/// A shard, memory-mapped.
struct Shard {
    path: PathBuf,
    map: memmap2::Mmap,
}

/// Where a tensor's bytes lie.
#[derive(Debug, Clone)]
struct Location {
    shard: usize,
    /// The key in the file (GPT-2's may carry `transformer.`).
    key: String,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A Hugging Face model directory, opened and checked: its configuration and, for every
/// parameter, where its bytes lie in which mapped shard.
pub struct HfCheckpoint {
    dir: PathBuf,
    config: ModelConfig,
    shards: Vec<Shard>,
    /// By snug name, with the parameter's layout.
    params: Vec<(HfTensor, Location)>,
}

impl std::fmt::Debug for HfCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfCheckpoint")
            .field("dir", &self.dir)
            .field("config", &self.config)
            .field(
                "shards",
                &self.shards.iter().map(|s| &s.path).collect::<Vec<_>>(),
            )
            .finish()
    }
}

fn path_str(path: &Path) -> String {
    path.display().to_string()
}

fn file_error(path: &Path, detail: impl std::fmt::Display) -> NnError {
    NnError::WeightsFile {
        path: path_str(path),
        detail: detail.to_string(),
    }
}

/// Maps the regular file `path` (checked before opening: a FIFO would block `open`).
fn map_file(path: &Path) -> Result<memmap2::Mmap, NnError> {
    crate::model::regular_file_len(path).map_err(|e| file_error(path, e))?;
    let file = std::fs::File::open(path).map_err(|e| file_error(path, e))?;
    // SAFETY: the mapping is read-only; as with any file reader, another process truncating
    // the file while it is mapped is outside what snug guards against.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| file_error(path, e))
}

/// The tensors of one shard file by key, with their locations in `map`.
fn shard_tensors(
    path: &Path,
    map: &[u8],
    shard: usize,
) -> Result<BTreeMap<String, Location>, NnError> {
    let st = crate::safetensors_file::deserialize(map)
        .map_err(|e| file_error(path, format!("not a valid safetensors file: {e}")))?;
    let mut out = BTreeMap::new();
    for (key, view) in st.tensors() {
        let data = view.data();
        // The data lies inside `map` (the parser checked its offsets).
        let start = data.as_ptr() as usize - map.as_ptr() as usize;
        out.insert(
            key.clone(),
            Location {
                shard,
                key,
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                start,
                end: start + data.len(),
            },
        );
    }
    Ok(out)
}

/// The shard files the index of `dir` lists, and which holds each tensor.
fn read_index(dir: &Path) -> Result<(Vec<String>, BTreeMap<String, String>), NnError> {
    let path = dir.join(INDEX_FILE);
    let bad = |detail: String| file_error(&path, detail);
    let len = crate::model::regular_file_len(&path).map_err(&bad)?;
    if len > MAX_INDEX_BYTES {
        return Err(bad(format!(
            "{len} bytes is more than an index of shards holds ({MAX_INDEX_BYTES} at most)"
        )));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("`weight_map` is missing or not an object".into()))?;
    let mut weight_map = BTreeMap::new();
    let mut files = BTreeSet::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("`weight_map.{name}` is {file}, not a file name")))?;
        // A shard is a file beside the index, never a path out of the directory.
        let plain = Path::new(file).file_name().is_some_and(|f| f == file) && file != "..";
        if !plain {
            return Err(bad(format!(
                "`weight_map.{name}` names `{file}`, which is not a file name in {}",
                dir.display()
            )));
        }
        files.insert(file.to_string());
        weight_map.insert(name.clone(), file.to_string());
    }
    Ok((files.into_iter().collect(), weight_map))
}

/// `h.N.attn.bias` / `h.N.attn.masked_bias` (GPT-2's causal-mask buffers) and
/// `model.layers.N.self_attn.rotary_emb.inv_freq` (Llama's rotary table): buffers that older
/// `transformers` versions saved with the weights. snug computes both.
fn is_buffer(name: &str) -> bool {
    let layer_tail = |prefix: &str| {
        let rest = name.strip_prefix(prefix)?;
        let (layer, tail) = rest.split_once('.')?;
        (!layer.is_empty() && layer.bytes().all(|b| b.is_ascii_digit())).then_some(tail)
    };
    matches!(layer_tail("h."), Some("attn.bias" | "attn.masked_bias"))
        || layer_tail("model.layers.") == Some("self_attn.rotary_emb.inv_freq")
}

impl HfCheckpoint {
    /// Opens the Hugging Face model directory `dir`: reads `config.json`, maps the weights and
    /// checks that they are exactly the model's parameters. Every mismatch is an error naming
    /// the file and the tensor: a tensor missing, unexpected or given twice, a shape or dtype
    /// the model cannot take, a truncated shard, a tensor the index does not list or places in
    /// another shard, an LM head that differs from the embedding it is tied to, and one file
    /// of a PEFT adapter beside the model without the other
    /// ([`crate::lora::check_adapter_files`]).
    pub fn open(dir: &Path) -> Result<HfCheckpoint, NnError> {
        let config = ModelConfig::from_hf_file(&dir.join(CONFIG_FILE))?;
        // Every reader of the directory (sample, train --init-from, export) opens it here, so
        // none reads a half-copied adapter as no adapter.
        crate::lora::check_adapter_files(dir)?;
        let index_path = dir.join(INDEX_FILE);
        let single = dir.join(WEIGHTS_FILE);
        let (files, weight_map) = if index_path.exists() {
            let (files, map) = read_index(dir)?;
            (files, Some(map))
        } else if single.exists() {
            (vec![WEIGHTS_FILE.to_string()], None)
        } else {
            return Err(file_error(
                dir,
                format!(
                    "holds neither {WEIGHTS_FILE} nor {INDEX_FILE} (snug reads safetensors \
                     weights only; pytorch_model.bin must be converted first)"
                ),
            ));
        };
        // Every shard is opened before any is read, so a missing one is named first.
        let shards = files
            .iter()
            .map(|file| {
                let path = dir.join(file);
                map_file(&path).map(|map| Shard { path, map })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut found: BTreeMap<String, Location> = BTreeMap::new();
        for (i, (file, shard)) in files.iter().zip(&shards).enumerate() {
            let path = &shard.path;
            for (key, loc) in shard_tensors(path, &shard.map, i)? {
                if let Some(map) = &weight_map {
                    match map.get(&key) {
                        Some(listed) if listed == file => {}
                        listed => {
                            return Err(NnError::IndexEntry {
                                path: path_str(&index_path),
                                name: key,
                                detail: match listed {
                                    None => format!("is in {file} but has no entry"),
                                    Some(other) => {
                                        format!("is in {file} but its entry names {other}")
                                    }
                                },
                            })
                        }
                    }
                }
                if found.insert(key.clone(), loc).is_some() {
                    return Err(NnError::DuplicateTensor {
                        path: path_str(path),
                        name: key,
                    });
                }
            }
        }
        if let Some(map) = &weight_map {
            if let Some((name, file)) = map.iter().find(|(name, _)| !found.contains_key(*name)) {
                return Err(NnError::IndexEntry {
                    path: path_str(&index_path),
                    name: name.clone(),
                    detail: format!("is listed in {file}, which does not hold it"),
                });
            }
        }
        let mut ckpt = HfCheckpoint {
            dir: dir.to_path_buf(),
            config,
            shards,
            params: Vec::new(),
        };
        ckpt.params = ckpt.match_parameters(found)?;
        Ok(ckpt)
    }

    /// The file's tensors matched to the model's parameters, in the model's order.
    fn match_parameters(
        &self,
        found: BTreeMap<String, Location>,
    ) -> Result<Vec<(HfTensor, Location)>, NnError> {
        let wanted = hf_tensors(&self.config);
        let by_name: HashMap<&str, &HfTensor> =
            wanted.iter().map(|t| (t.name.as_str(), t)).collect();
        let (embed, tied) = match &self.config {
            ModelConfig::Gpt(_) => ("wte.weight", true),
            ModelConfig::Llama(c) => ("model.embed_tokens.weight", c.tie_word_embeddings),
        };
        let mut params: HashMap<String, Location> = HashMap::with_capacity(wanted.len());
        let mut tied_head = None;
        for (key, loc) in found {
            let name = match &self.config {
                ModelConfig::Gpt(_) => key.strip_prefix("transformer.").unwrap_or(&key),
                ModelConfig::Llama(_) => key.as_str(),
            };
            if is_buffer(name) {
                continue;
            }
            let shard = &self.shards[loc.shard].path;
            let want_shape = if tied && name == "lm_head.weight" {
                // Saved beside the embedding it is tied to (or in its place).
                let embed = &by_name[embed];
                embed.hf_shape.clone()
            } else {
                by_name
                    .get(name)
                    .ok_or_else(|| NnError::UnexpectedTensor {
                        path: path_str(shard),
                        name: key.clone(),
                    })?
                    .hf_shape
                    .clone()
            };
            if loc.shape != want_shape {
                return Err(NnError::TensorShape {
                    path: path_str(shard),
                    name: key.clone(),
                    expected: want_shape,
                    found: loc.shape.clone(),
                });
            }
            if element_bytes(loc.dtype).is_none() {
                return Err(NnError::TensorDType {
                    path: path_str(shard),
                    name: key.clone(),
                    dtype: format!("{:?}", loc.dtype),
                });
            }
            let name = name.to_string();
            let duplicate = if tied && name == "lm_head.weight" {
                tied_head.replace(loc).is_some()
            } else {
                params.insert(name.clone(), loc).is_some()
            };
            if duplicate {
                return Err(NnError::DuplicateTensor {
                    path: path_str(shard),
                    name,
                });
            }
        }
        // A tied pair saved once, under the head's name.
        if !params.contains_key(embed) {
            if let Some(head) = tied_head.take() {
                params.insert(embed.to_string(), head);
            }
        }
        let mut out = Vec::with_capacity(wanted.len());
        for t in wanted {
            let loc = params
                .remove(&t.name)
                .ok_or_else(|| NnError::MissingTensor {
                    path: self.weights_description(),
                    name: t.name.clone(),
                })?;
            out.push((t, loc));
        }
        if let Some(head) = tied_head {
            let embed_loc = &out
                .iter()
                .find(|(t, _)| t.name == embed)
                .map(|(_, l)| l.clone());
            let same = embed_loc
                .as_ref()
                .is_some_and(|e| self.same_values(e, &head));
            if !same {
                return Err(NnError::HeadNotTied {
                    path: path_str(&self.shards[head.shard].path),
                    head: head.key,
                    embedding: embed.to_string(),
                });
            }
        }
        Ok(out)
    }

    /// The weights file, or the index of a sharded checkpoint, for errors about the set of
    /// tensors as a whole.
    fn weights_description(&self) -> String {
        match &self.shards[..] {
            [one] => path_str(&one.path),
            _ => path_str(&self.dir.join(INDEX_FILE)),
        }
    }

    fn bytes(&self, loc: &Location) -> &[u8] {
        &self.shards[loc.shard].map[loc.start..loc.end]
    }

    /// Whether two tensors of the same shape hold the same values (bit for bit, once decoded).
    fn same_values(&self, a: &Location, b: &Location) -> bool {
        let (wa, wb) = match (element_bytes(a.dtype), element_bytes(b.dtype)) {
            (Some(wa), Some(wb)) => (wa, wb),
            _ => return false,
        };
        let (mut ta, mut tb) = (vec![0f32; TILE_ELEMS], vec![0f32; TILE_ELEMS]);
        let (ba, bb) = (self.bytes(a), self.bytes(b));
        ba.len() / wa == bb.len() / wb
            && ba
                .chunks(TILE_ELEMS * wa)
                .zip(bb.chunks(TILE_ELEMS * wb))
                .all(|(ca, cb)| {
                    let n = ca.len() / wa;
                    decode_into(a.dtype, ca, &mut ta[..n]);
                    decode_into(b.dtype, cb, &mut tb[..n]);
                    ta[..n]
                        .iter()
                        .zip(&tb[..n])
                        .all(|(x, y)| x.to_bits() == y.to_bits())
                })
    }

    /// The model the checkpoint holds.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The shard files, in the order they were read.
    pub fn files(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }

    /// Every parameter's name and snug shape, in graph order.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.params
            .iter()
            .map(|(t, _)| (t.name.clone(), t.shape.clone()))
            .collect()
    }

    /// Checks that `model` (what will be trained or sampled) has exactly this checkpoint's
    /// parameters, by name and shape; each difference is an error naming the tensor.
    pub fn check_model(&self, model: &ModelConfig) -> Result<(), NnError> {
        let ours: HashMap<&str, (&HfTensor, &Location)> = self
            .params
            .iter()
            .map(|(t, l)| (t.name.as_str(), (t, l)))
            .collect();
        let wanted = model.parameter_shapes();
        for (name, shape) in &wanted {
            let (t, loc) = ours
                .get(name.as_str())
                .ok_or_else(|| NnError::MissingTensor {
                    path: self.weights_description(),
                    name: name.clone(),
                })?;
            if &t.shape != shape {
                return Err(NnError::TensorShape {
                    path: path_str(&self.shards[loc.shard].path),
                    name: name.clone(),
                    expected: shape.clone(),
                    found: t.shape.clone(),
                });
            }
        }
        let names: BTreeSet<&str> = wanted.iter().map(|(n, _)| n.as_str()).collect();
        if let Some((t, loc)) = self
            .params
            .iter()
            .find(|(t, _)| !names.contains(t.name.as_str()))
        {
            return Err(NnError::UnexpectedTensor {
                path: path_str(&self.shards[loc.shard].path),
                name: t.name.clone(),
            });
        }
        Ok(())
    }

    /// Decodes parameter `name` into `out` (snug's layout, exactly its number of elements), a
    /// tile at a time from the mapped file. A NaN or infinite weight is an error naming the
    /// tensor and its index in the file's layout.
    pub fn read_into(&self, name: &str, out: &mut [f32]) -> Result<(), NnError> {
        let (t, loc) = self
            .params
            .iter()
            .find(|(t, _)| t.name == name)
            .ok_or_else(|| NnError::MissingTensor {
                path: self.weights_description(),
                name: name.to_string(),
            })?;
        let numel: usize = t.shape.iter().product();
        if out.len() != numel {
            return Err(NnError::TensorShape {
                path: path_str(&self.shards[loc.shard].path),
                name: name.to_string(),
                expected: vec![out.len()],
                found: t.shape.clone(),
            });
        }
        let width = element_bytes(loc.dtype).unwrap_or(1);
        let bytes = self.bytes(loc);
        let non_finite = |tile: &[f32], first: usize| {
            crate::safetensors_file::first_non_finite(tile).map(|(i, value)| {
                NnError::NonFiniteWeight {
                    path: path_str(&self.shards[loc.shard].path),
                    name: loc.key.clone(),
                    index: first + i,
                    value,
                }
            })
        };
        if !t.transposed {
            for (i, (o, b)) in out
                .chunks_mut(TILE_ELEMS)
                .zip(bytes.chunks(TILE_ELEMS * width))
                .enumerate()
            {
                decode_into(loc.dtype, b, o);
                if let Some(e) = non_finite(o, i * TILE_ELEMS) {
                    return Err(e);
                }
            }
            return Ok(());
        }
        // The file holds `[rows, cols]`; snug's layout is `[cols, rows]`. A tile of whole file
        // rows is decoded, then each of its columns written as a contiguous run of `out`.
        let (rows, cols) = (t.hf_shape[0], t.hf_shape[1]);
        let tile_rows = (TILE_ELEMS / cols.max(1)).clamp(1, rows.max(1));
        let mut tile = vec![0f32; tile_rows * cols];
        for r0 in (0..rows).step_by(tile_rows) {
            let n = tile_rows.min(rows - r0);
            let tile = &mut tile[..n * cols];
            decode_into(
                loc.dtype,
                &bytes[r0 * cols * width..(r0 + n) * cols * width],
                tile,
            );
            if let Some(e) = non_finite(tile, r0 * cols) {
                return Err(e);
            }
            for c in 0..cols {
                let run = &mut out[c * rows + r0..c * rows + r0 + n];
                for (r, o) in run.iter_mut().enumerate() {
                    *o = tile[r * cols + c];
                }
            }
        }
        Ok(())
    }

    /// Parameter `name` decoded into a new vector (see [`HfCheckpoint::read_into`]).
    pub fn read(&self, name: &str) -> Result<Vec<f32>, NnError> {
        let numel = self
            .params
            .iter()
            .find(|(t, _)| t.name == name)
            .map_or(0, |(t, _)| t.shape.iter().product());
        let mut out = vec![0f32; numel];
        self.read_into(name, &mut out)?;
        Ok(out)
    }
}

/// Fills parameter `name` (snug's layout) into the buffer: where [`save_hf_model`] reads
/// the values it writes.
pub type ReadParameter<'a> = dyn Fn(&str, &mut [f32]) -> Result<(), NnError> + 'a;

/// What [`save_hf_model`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfExport {
    pub config: PathBuf,
    pub weights: PathBuf,
    pub parameters: usize,
    pub bytes: u64,
}

/// One tensor as the safetensors writer sees it: its values are read (and transposed to the
/// file's layout) only when the writer reaches it, and dropped after.
struct LazyTensor<'a> {
    tensor: &'a HfTensor,
    read: &'a ReadParameter<'a>,
}

impl LazyTensor<'_> {
    fn values(&self) -> Result<Vec<f32>, NnError> {
        let t = self.tensor;
        let mut snug = vec![0f32; t.shape.iter().product()];
        (self.read)(&t.name, &mut snug)?;
        if !t.transposed {
            return Ok(snug);
        }
        let (rows, cols) = (t.hf_shape[0], t.hf_shape[1]);
        let mut hf = vec![0f32; snug.len()];
        for (c, column) in snug.chunks_exact(rows.max(1)).enumerate() {
            for (r, &v) in column.iter().enumerate() {
                hf[r * cols + c] = v;
            }
        }
        Ok(hf)
    }
}

// The view's shape is the file's, not snug's.
#[allow(clippy::misnamed_getters)]
impl View for LazyTensor<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.tensor.hf_shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        // Every tensor was read once without error before writing began; the source is a
        // mapped file or memory, so reading it again gives the same values.
        let values = self.values().unwrap_or_default();
        Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    fn data_len(&self) -> usize {
        self.tensor.shape.iter().product::<usize>() * 4
    }
}

/// Writes `cfg` into the directory `dir` as a Hugging Face model: `config.json` and one F32
/// `model.safetensors` with Hugging Face's names and layouts, which transformers'
/// `AutoModelForCausalLM.from_pretrained` loads. `read(name, out)` fills parameter `name`
/// (snug's layout) into `out`.
///
/// Every parameter is read and checked (length, finite) before anything is written, one at a
/// time; then each is read again as the writer reaches it. Each file is replaced atomically.
/// A directory holding a sharded checkpoint is refused (its index would shadow the new file).
pub fn save_hf_model(
    dir: &Path,
    cfg: &ModelConfig,
    read: &ReadParameter<'_>,
) -> Result<HfExport, NnError> {
    cfg.validate()?;
    if dir.join(INDEX_FILE).exists() {
        return Err(file_error(
            dir,
            format!("holds a sharded checkpoint ({INDEX_FILE}); export into another directory"),
        ));
    }
    let tensors = hf_tensors(cfg);
    let mut parameters = 0;
    for t in &tensors {
        let numel: usize = t.shape.iter().product();
        let mut values = vec![0f32; numel];
        read(&t.name, &mut values)?;
        if let Some((index, value)) = crate::safetensors_file::first_non_finite(&values) {
            return Err(NnError::NonFiniteWeight {
                path: path_str(dir),
                name: t.name.clone(),
                index,
                value,
            });
        }
        parameters += numel;
    }
    std::fs::create_dir_all(dir).map_err(|e| file_error(dir, e))?;
    let weights = dir.join(WEIGHTS_FILE);
    let config = dir.join(CONFIG_FILE);
    let views: Vec<(&str, LazyTensor)> = tensors
        .iter()
        .map(|t| (t.name.as_str(), LazyTensor { tensor: t, read }))
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_atomically(&weights, |tmp| {
        safetensors::serialize_to_file(views, Some(metadata), tmp).map_err(|e| e.to_string())
    })?;
    let text = cfg.to_hf_json();
    write_atomically(&config, |tmp| {
        std::fs::write(tmp, text.as_bytes()).map_err(|e| e.to_string())
    })?;
    let bytes = std::fs::metadata(&weights).map_or(0, |m| m.len());
    Ok(HfExport {
        config,
        weights,
        parameters,
        bytes,
    })
}

/// Writes `bytes` to `path` atomically (a temporary file beside it, synced, renamed over it):
/// what [`save_hf_model`] does for its files, for the files written beside them (a
/// tokenizer's).
pub fn write_file_atomically(path: &Path, bytes: &[u8]) -> Result<(), NnError> {
    write_atomically(path, |tmp| {
        std::fs::write(tmp, bytes).map_err(|e| e.to_string())
    })
}

/// [`save_hf_model`] from parameters held in memory (a snug checkpoint's), by name; every
/// parameter of `cfg` must be there once with its number of elements, and nothing else.
pub fn save_hf_model_from(
    dir: &Path,
    cfg: &ModelConfig,
    params: &[(String, Vec<f32>)],
) -> Result<HfExport, NnError> {
    let shapes = cfg.parameter_shapes();
    let mut by_name: HashMap<&str, &[f32]> = HashMap::with_capacity(params.len());
    for (name, values) in params {
        if by_name.insert(name, values).is_some() {
            return Err(NnError::DuplicateTensor {
                path: path_str(dir),
                name: name.clone(),
            });
        }
    }
    let known: BTreeSet<&str> = shapes.iter().map(|(n, _)| n.as_str()).collect();
    if let Some((name, _)) = params.iter().find(|(n, _)| !known.contains(n.as_str())) {
        return Err(NnError::UnexpectedTensor {
            path: path_str(dir),
            name: name.clone(),
        });
    }
    let read = |name: &str, out: &mut [f32]| -> Result<(), NnError> {
        let values = by_name.get(name).ok_or_else(|| NnError::MissingTensor {
            path: path_str(dir),
            name: name.to_string(),
        })?;
        if values.len() != out.len() {
            let shape = shapes
                .iter()
                .find(|(n, _)| n == name)
                .map_or_else(|| vec![out.len()], |(_, s)| s.clone());
            return Err(NnError::TensorShape {
                path: path_str(dir),
                name: name.to_string(),
                expected: shape,
                found: vec![values.len()],
            });
        }
        out.copy_from_slice(values);
        Ok(())
    };
    save_hf_model(dir, cfg, &read)
}
