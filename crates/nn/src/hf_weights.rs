//! GPT-2 weights to and from Hugging Face's safetensors format, and the `config.json` beside
//! them. snug's GPT parameters already carry HF's `GPT2Model` names and layouts (`Conv1D` weights
//! stored `[in, out]`), so conversion is a matter of names, dtypes and checks: no transposes.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use safetensors::{Dtype, View};

use crate::{GptConfig, NnError};

/// Prefix of `GPT2LMHeadModel` state-dict keys; `GPT2Model` files (the `gpt2` repository's
/// `model.safetensors`) have none.
const PREFIX: &str = "transformer.";

fn path_str(path: &Path) -> String {
    path.display().to_string()
}

fn file_error(path: &Path, detail: impl std::fmt::Display) -> NnError {
    NnError::WeightsFile {
        path: path_str(path),
        detail: detail.to_string(),
    }
}

/// One f32 parameter as the safetensors writer sees it.
struct F32View<'a> {
    shape: &'a [usize],
    values: &'a [f32],
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        // safetensors is little-endian: on such hosts the values are written without a copy.
        if cfg!(target_endian = "little") {
            Cow::Borrowed(bytemuck::cast_slice(self.values))
        } else {
            Cow::Owned(self.values.iter().flat_map(|v| v.to_le_bytes()).collect())
        }
    }

    fn data_len(&self) -> usize {
        self.values.len() * 4
    }
}

/// Writes `params` (snug's GPT parameters, by Hugging Face name) as an F32 safetensors file
/// with `GPT2Model`'s key names (`wte.weight`, `h.0.attn.c_attn.weight`, ...) and
/// `__metadata__ = {"format": "pt"}`, as in the `gpt2` repository's `model.safetensors`.
///
/// Every parameter of `cfg` must be present once with its number of elements, and nothing
/// else. The file is replaced atomically: a reader sees the old file or the whole new one.
pub fn save_gpt2_safetensors(
    path: &Path,
    cfg: &GptConfig,
    params: &[(String, Vec<f32>)],
) -> Result<(), NnError> {
    cfg.validate()?;
    let shapes = cfg.parameter_shapes();
    let mut by_name: HashMap<&str, &[f32]> = HashMap::with_capacity(params.len());
    for (name, values) in params {
        if by_name.insert(name, values).is_some() {
            return Err(NnError::DuplicateTensor {
                path: path_str(path),
                name: name.clone(),
            });
        }
    }
    let mut views = Vec::with_capacity(shapes.len());
    for (name, shape) in &shapes {
        let values = by_name
            .remove(name.as_str())
            .ok_or_else(|| NnError::MissingTensor {
                path: path_str(path),
                name: name.clone(),
            })?;
        if values.len() != shape.iter().product::<usize>() {
            return Err(NnError::TensorShape {
                path: path_str(path),
                name: name.clone(),
                expected: shape.clone(),
                found: vec![values.len()],
            });
        }
        views.push((name.as_str(), F32View { shape, values }));
    }
    if let Some(name) = params
        .iter()
        .map(|(n, _)| n)
        .find(|n| by_name.contains_key(n.as_str()))
    {
        return Err(NnError::UnexpectedTensor {
            path: path_str(path),
            name: name.clone(),
        });
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_atomically(path, |tmp| {
        safetensors::serialize_to_file(views, Some(metadata), tmp).map_err(|e| e.to_string())
    })
}

/// The text of a Hugging Face `config.json` for `cfg`: a `GPT2LMHeadModel` with snug's choices
/// (tanh GELU = `gelu_new`, LayerNorm ε 1e-5, tied head, no dropout, as snug trains).
pub fn hf_config_json(cfg: &GptConfig) -> String {
    // GPT-2's BPE vocabulary has `<|endoftext|>` at 50256; other vocabularies (snug's character
    // tokenizer) have no such token.
    let special = if cfg.vocab_size == 50257 {
        serde_json::json!(50256)
    } else {
        serde_json::Value::Null
    };
    let v = serde_json::json!({
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_embd": cfg.n_embd,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_inner": null,
        "vocab_size": cfg.vocab_size,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        "reorder_and_upcast_attn": false,
        "tie_word_embeddings": true,
        "use_cache": true,
        "bos_token_id": special,
        "eos_token_id": special,
        "torch_dtype": "float32",
    });
    // Serialising a `Value` cannot fail.
    let mut text = serde_json::to_string_pretty(&v).unwrap_or_else(|_| unreachable!());
    text.push('\n');
    text
}

/// Writes [`hf_config_json`] to `path` (atomically, like the weights).
pub fn write_hf_config_json(path: &Path, cfg: &GptConfig) -> Result<(), NnError> {
    cfg.validate()?;
    let text = hf_config_json(cfg);
    write_atomically(path, |tmp| {
        std::fs::write(tmp, text.as_bytes()).map_err(|e| e.to_string())
    })
}

/// Writes through `write` to a temporary file beside `path`, syncs it, renames it over `path`
/// and syncs the directory, so a crash leaves either the old file or the complete new one.
pub(crate) fn write_atomically(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<(), NnError> {
    let tmp = temporary_beside(path).ok_or_else(|| file_error(path, "not a file path"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let result = write(&tmp)
        .and_then(|()| {
            File::open(&tmp)
                .and_then(|f| f.sync_all())
                .map_err(|e| e.to_string())
        })
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| e.to_string()));
    if let Err(e) = result {
        // Best effort: the temporary file may not exist if the write failed early.
        let _ = std::fs::remove_file(&tmp);
        return Err(file_error(path, e));
    }
    // The rename is durable only once the directory entry is on disk.
    #[cfg(unix)]
    File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| file_error(path, format!("syncing directory {}: {e}", dir.display())))?;
    Ok(())
}

/// A fresh temporary path beside `path` (`.NAME.PID.N.tmp`, in its directory) for a file to
/// be written and then renamed over it, once what killed writers of `NAME` left there is
/// removed ([`remove_stale_temporaries`]). `None` where `path` names no file.
pub fn temporary_beside(path: &Path) -> Option<PathBuf> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path.file_name()?.to_string_lossy().into_owned();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let prefix = format!(".{name}.");
    remove_stale_temporaries(dir, &prefix, ".tmp");
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    Some(dir.join(format!("{prefix}{}.{n}.tmp", std::process::id())))
}

/// Removes what earlier writers in `dir` left when they were killed mid-write: entries named
/// `PREFIX PID.N SUFFIX` ([`write_atomically`]'s `.NAME.PID.N.tmp`, as large as the model for
/// the weights, or a staging directory of files written together). One of a process still
/// running, or written to within the hour, is another writer's, and stays. Linux only, where
/// `/proc` tells a running process.
pub fn remove_stale_temporaries(dir: &Path, prefix: &str, suffix: &str) {
    #[cfg(target_os = "linux")]
    {
        const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        let idle = |meta: std::io::Result<std::fs::Metadata>| {
            meta.and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age >= STALE_AFTER)
        };
        for entry in entries.flatten() {
            let file = entry.file_name();
            let file = file.to_string_lossy();
            let Some(rest) = file
                .strip_prefix(prefix)
                .and_then(|r| r.strip_suffix(suffix))
            else {
                continue;
            };
            let Some((pid, n)) = rest.split_once('.') else {
                continue;
            };
            let (Ok(pid), Ok(_)) = (pid.parse::<u32>(), n.parse::<u64>()) else {
                continue;
            };
            let running =
                pid == std::process::id() || Path::new("/proc").join(pid.to_string()).exists();
            // A writer elsewhere (another container sharing the directory, a hidden /proc) is
            // not seen: its files grow all the while, so only what was left alone for an hour
            // is taken for dead.
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if running || !idle(entry.metadata()) {
                continue;
            }
            if kind.is_dir() {
                let inner = std::fs::read_dir(entry.path());
                let all_idle = inner
                    .map(|es| es.flatten().all(|e| idle(e.metadata())))
                    .unwrap_or(false);
                if all_idle {
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            } else {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (dir, prefix, suffix);
}

/// `h.N.attn.bias` / `h.N.attn.masked_bias`: the causal mask buffers older `transformers`
/// versions saved with the weights. snug's attention is causal by construction.
fn is_attention_buffer(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("h.") else {
        return false;
    };
    let Some((layer, tail)) = rest.split_once('.') else {
        return false;
    };
    !layer.is_empty()
        && layer.bytes().all(|b| b.is_ascii_digit())
        && (tail == "attn.bias" || tail == "attn.masked_bias")
}

/// Decodes little-endian `bytes` of `dtype` into `out` (`bytes` holds exactly `out.len()`
/// elements; checked by the caller).
pub(crate) fn decode_into(dtype: Dtype, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        Dtype::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Dtype::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        Dtype::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        Dtype::F64 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                let mut a = [0u8; 8];
                a.copy_from_slice(b);
                *o = f64::from_le_bytes(a) as f32;
            }
        }
        // Rejected by `element_bytes` before any decoding.
        _ => unreachable!("decode_into called with unsupported dtype {dtype:?}"),
    }
}

/// Bytes per element of the dtypes snug reads as f32 weights.
pub(crate) fn element_bytes(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::F32 => Some(4),
        Dtype::F16 | Dtype::BF16 => Some(2),
        Dtype::F64 => Some(8),
        _ => None,
    }
}

/// A tensor of the file whose shape and dtype have been checked.
struct Tensor<'a> {
    dtype: Dtype,
    bytes: &'a [u8],
}

impl Tensor<'_> {
    fn len(&self) -> usize {
        // `element_bytes` was checked when the tensor was accepted.
        self.bytes.len() / element_bytes(self.dtype).unwrap_or(1)
    }

    /// Decodes `len()` values, in chunks, comparing them with `values` (bit-exact).
    fn equals(&self, values: &[f32]) -> bool {
        if self.len() != values.len() {
            return false;
        }
        let width = element_bytes(self.dtype).unwrap_or(1);
        let mut buf = [0f32; 4096];
        self.bytes
            .chunks(buf.len() * width)
            .zip(values.chunks(buf.len()))
            .all(|(bytes, want)| {
                let got = &mut buf[..want.len()];
                decode_into(self.dtype, bytes, got);
                got.iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            })
    }

    fn to_vec(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.len()];
        decode_into(self.dtype, self.bytes, &mut out);
        out
    }
}

/// Reads a GPT-2 safetensors file into snug's parameters for `cfg`, in
/// [`GptConfig::parameter_shapes`] order, converting F32, F16, BF16 (and F64) to f32.
///
/// Keys may carry `GPT2LMHeadModel`'s `transformer.` prefix or not. The attention-mask buffers
/// `h.N.attn.bias` / `h.N.attn.masked_bias` are skipped. `lm_head.weight` is accepted only when
/// it equals `wte.weight` (snug ties them); when the file holds `lm_head.weight` but no
/// `wte.weight` (a tied pair saved once under the head's name), the head is the embedding.
/// Every other mismatch, and a NaN or infinite weight, is an error naming the file and the
/// tensor.
pub fn load_gpt2_safetensors(
    path: &Path,
    cfg: &GptConfig,
) -> Result<Vec<(String, Vec<f32>)>, NnError> {
    with_gpt2_tensors(path, cfg, |shapes, mut found, lm_head| {
        let mut params = Vec::with_capacity(shapes.len());
        for (name, _) in shapes {
            let tensor = found
                .remove(name.as_str())
                .ok_or_else(|| NnError::MissingTensor {
                    path: path_str(path),
                    name: name.clone(),
                })?;
            let values = tensor.to_vec();
            // Decoded values, so an f64 too large for f32 is caught as the infinity it became.
            if let Some((index, value)) = crate::safetensors_file::first_non_finite(&values) {
                return Err(NnError::NonFiniteWeight {
                    path: path_str(path),
                    name: name.clone(),
                    index,
                    value,
                });
            }
            params.push((name.clone(), values));
        }
        if let Some(head) = lm_head {
            let tied = params
                .iter()
                .find(|(n, _)| n == "wte.weight")
                .is_some_and(|(_, wte)| head.equals(wte));
            if !tied {
                return Err(NnError::UntiedHead {
                    path: path_str(path),
                });
            }
        }
        Ok(params)
    })
}

/// [`load_gpt2_safetensors`]'s checks of the file's header alone: every tensor named, shaped
/// and typed as `cfg` needs, none missing, none left over. No weight is decoded, so planning a
/// run that starts from a multi-gigabyte file costs its header.
pub fn check_gpt2_safetensors(path: &Path, cfg: &GptConfig) -> Result<(), NnError> {
    with_gpt2_tensors(path, cfg, |_, _, _| Ok(()))
}

/// Maps the GPT-2 safetensors file at `path`, checks its header against `cfg`, and hands
/// `then` the parameter shapes, each parameter's tensor by snug name, and the untied
/// `lm_head.weight` if the file holds one beside `wte.weight`.
fn with_gpt2_tensors<T>(
    path: &Path,
    cfg: &GptConfig,
    then: impl FnOnce(
        &[(String, Vec<usize>)],
        HashMap<&str, Tensor<'_>>,
        Option<Tensor<'_>>,
    ) -> Result<T, NnError>,
) -> Result<T, NnError> {
    cfg.validate()?;
    // Before opening: a FIFO would block `open`, and a device's length is no bound.
    crate::model::regular_file_len(path).map_err(|e| file_error(path, e))?;
    let file = File::open(path).map_err(|e| file_error(path, e))?;
    let len = file.metadata().map_err(|e| file_error(path, e))?.len();
    // Mapping avoids holding a second copy of a multi-gigabyte file while it is converted.
    let map;
    let bytes: &[u8] = if len == 0 {
        &[]
    } else {
        // SAFETY: the mapping is read-only and dropped before returning; as with any file
        // reader, another process truncating the file meanwhile is outside what snug guards.
        map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| file_error(path, e))?;
        &map
    };
    let st = crate::safetensors_file::deserialize(bytes)
        .map_err(|e| file_error(path, format!("not a valid safetensors file: {e}")))?;

    let shapes = cfg.parameter_shapes();
    let expected: HashMap<&str, &[usize]> = shapes
        .iter()
        .map(|(n, s)| (n.as_str(), s.as_slice()))
        .collect();
    let mut keys = st.names();
    // Sorted, so that the first error reported does not depend on hash order.
    keys.sort_unstable();
    let mut found: HashMap<&str, Tensor> = HashMap::with_capacity(keys.len());
    let mut lm_head: Option<Tensor> = None;
    for key in keys {
        let name = key.strip_prefix(PREFIX).unwrap_or(key);
        if is_attention_buffer(name) {
            continue;
        }
        let view = st.tensor(key).map_err(|e| file_error(path, e))?;
        let want: &[usize] = if name == "lm_head.weight" {
            &[cfg.vocab_size, cfg.n_embd]
        } else {
            expected
                .get(name)
                .copied()
                .ok_or_else(|| NnError::UnexpectedTensor {
                    path: path_str(path),
                    name: key.to_string(),
                })?
        };
        if view.shape() != want {
            return Err(NnError::TensorShape {
                path: path_str(path),
                name: key.to_string(),
                expected: want.to_vec(),
                found: view.shape().to_vec(),
            });
        }
        if element_bytes(view.dtype()).is_none() {
            return Err(NnError::TensorDType {
                path: path_str(path),
                name: key.to_string(),
                dtype: format!("{:?}", view.dtype()),
            });
        }
        let tensor = Tensor {
            dtype: view.dtype(),
            bytes: view.data(),
        };
        let duplicate = if name == "lm_head.weight" {
            lm_head.replace(tensor).is_some()
        } else {
            found.insert(name, tensor).is_some()
        };
        if duplicate {
            return Err(NnError::DuplicateTensor {
                path: path_str(path),
                name: name.to_string(),
            });
        }
    }
    if !found.contains_key("wte.weight") {
        if let Some(head) = lm_head.take() {
            found.insert("wte.weight", head);
        }
    }
    if let Some((name, _)) = shapes.iter().find(|(n, _)| !found.contains_key(n.as_str())) {
        return Err(NnError::MissingTensor {
            path: path_str(path),
            name: name.clone(),
        });
    }
    then(&shapes, found, lm_head)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelConfig;
    use rand::{Rng, SeedableRng};
    use safetensors::SafeTensors;

    fn tiny() -> GptConfig {
        GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            block_size: 16,
            vocab_size: 11,
        }
    }

    /// Every parameter random (biases and gains too), so a swapped or dropped tensor shows.
    fn random_params(cfg: &GptConfig, seed: u64) -> Vec<(String, Vec<f32>)> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        cfg.parameter_shapes()
            .into_iter()
            .map(|(name, shape)| {
                let n = shape.iter().product();
                (name, (0..n).map(|_| rng.random_range(-1.0..1.0)).collect())
            })
            .collect()
    }

    /// A tensor of any dtype, for writing files snug itself would not.
    struct Raw {
        dtype: Dtype,
        shape: Vec<usize>,
        data: Vec<u8>,
    }

    impl View for Raw {
        fn dtype(&self) -> Dtype {
            self.dtype
        }
        fn shape(&self) -> &[usize] {
            &self.shape
        }
        fn data(&self) -> Cow<'_, [u8]> {
            Cow::Borrowed(&self.data)
        }
        fn data_len(&self) -> usize {
            self.data.len()
        }
    }

    fn f32_raw(shape: &[usize], values: &[f32]) -> Raw {
        Raw {
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// The parameters as raw F32 tensors, keyed `prefix + name`.
    fn raw_tensors(
        cfg: &GptConfig,
        params: &[(String, Vec<f32>)],
        prefix: &str,
    ) -> Vec<(String, Raw)> {
        cfg.parameter_shapes()
            .iter()
            .zip(params)
            .map(|((name, shape), (_, values))| (format!("{prefix}{name}"), f32_raw(shape, values)))
            .collect()
    }

    fn write_raw(path: &Path, tensors: Vec<(String, Raw)>) {
        let bytes = safetensors::serialize(tensors, None).unwrap();
        std::fs::write(path, bytes).unwrap();
    }

    fn load_err(path: &Path, cfg: &GptConfig) -> NnError {
        load_gpt2_safetensors(path, cfg).unwrap_err()
    }

    #[test]
    fn export_then_import_is_bit_exact_with_hf_key_names() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let cfg = tiny();
        let mut params = random_params(&cfg, 1);
        // Values a lossy path would change: subnormal, negative zero, extremes.
        params[0].1[..4].copy_from_slice(&[f32::MIN_POSITIVE / 3.0, -0.0, f32::MAX, f32::MIN]);
        save_gpt2_safetensors(&path, &cfg, &params).unwrap();
        let back = load_gpt2_safetensors(&path, &cfg).unwrap();
        assert_eq!(back.len(), params.len());
        for ((n1, v1), (n2, v2)) in params.iter().zip(&back) {
            assert_eq!(n1, n2);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(v1), bits(v2), "{n1}");
        }

        // The file itself: GPT2Model's keys (no prefix), F32, HF's shapes, format "pt".
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut keys: Vec<&str> = st.names();
        keys.sort_unstable();
        let mut want: Vec<(String, Vec<usize>)> = cfg.parameter_shapes();
        want.sort();
        assert_eq!(
            keys,
            want.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()
        );
        for (name, shape) in &want {
            let t = st.tensor(name).unwrap();
            assert_eq!(t.dtype(), Dtype::F32);
            assert_eq!(t.shape(), shape.as_slice());
        }
        assert!(keys.contains(&"h.1.attn.c_attn.weight"));
        assert_eq!(
            st.tensor("h.0.attn.c_attn.weight").unwrap().shape(),
            &[8, 24]
        );
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let format = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("format").cloned());
        assert_eq!(format.as_deref(), Some("pt"));

        // Saving again replaces the file atomically and leaves no temporary file behind.
        let params2 = random_params(&cfg, 2);
        save_gpt2_safetensors(&path, &cfg, &params2).unwrap();
        assert_eq!(load_gpt2_safetensors(&path, &cfg).unwrap(), params2);
        let entries: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(entries.len(), 1, "{entries:?}");
    }

    #[test]
    fn loads_lm_head_model_files_with_prefix_buffers_and_half_precision() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let cfg = tiny();
        let params = random_params(&cfg, 3);
        let mut tensors = raw_tensors(&cfg, &params, "transformer.");
        for i in 0..cfg.n_layer {
            // Older transformers saved the causal mask (bool or u8) and a scalar with the weights.
            tensors.push((
                format!("transformer.h.{i}.attn.bias"),
                Raw {
                    dtype: Dtype::U8,
                    shape: vec![1, 1, 16, 16],
                    data: vec![1; 256],
                },
            ));
            tensors.push((format!("h.{i}.attn.masked_bias"), f32_raw(&[], &[-1e4])));
        }
        // GPT2LMHeadModel's tied head, stored beside the embedding.
        tensors.push(("lm_head.weight".into(), f32_raw(&[11, 8], &params[0].1)));
        write_raw(&path, tensors);
        assert_eq!(load_gpt2_safetensors(&path, &cfg).unwrap(), params);

        // F16 and BF16 files convert to f32 (exactly, for values that fit).
        for dtype in [Dtype::F16, Dtype::BF16] {
            let encode = |v: f32| -> [u8; 2] {
                match dtype {
                    Dtype::F16 => half::f16::from_f32(v).to_le_bytes(),
                    _ => half::bf16::from_f32(v).to_le_bytes(),
                }
            };
            let decode = |v: f32| -> f32 {
                match dtype {
                    Dtype::F16 => half::f16::from_f32(v).to_f32(),
                    _ => half::bf16::from_f32(v).to_f32(),
                }
            };
            let tensors = cfg
                .parameter_shapes()
                .iter()
                .zip(&params)
                .map(|((name, shape), (_, values))| {
                    let data = values.iter().flat_map(|&v| encode(v)).collect();
                    let raw = Raw {
                        dtype,
                        shape: shape.clone(),
                        data,
                    };
                    (name.clone(), raw)
                })
                .collect();
            write_raw(&path, tensors);
            let back = load_gpt2_safetensors(&path, &cfg).unwrap();
            for ((name, want), (_, got)) in params.iter().zip(&back) {
                let want: Vec<f32> = want.iter().map(|&v| decode(v)).collect();
                assert_eq!(&want, got, "{name} as {dtype:?}");
            }
        }
    }

    #[test]
    fn a_head_saved_in_place_of_the_embedding_is_the_embedding() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let cfg = tiny();
        let params = random_params(&cfg, 4);
        let mut tensors = raw_tensors(&cfg, &params, "transformer.");
        let (_, wte) = tensors.remove(0);
        tensors.push(("lm_head.weight".into(), wte));
        write_raw(&path, tensors);
        assert_eq!(load_gpt2_safetensors(&path, &cfg).unwrap(), params);
    }

    #[test]
    fn mismatched_files_name_the_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.safetensors");
        let p = path.display().to_string();
        let cfg = tiny();
        let params = random_params(&cfg, 5);

        // Wrong shape.
        let mut tensors = raw_tensors(&cfg, &params, "");
        tensors[2] = ("h.0.ln_1.weight".into(), f32_raw(&[4, 2], &params[2].1));
        write_raw(&path, tensors);
        assert_eq!(
            load_err(&path, &cfg),
            NnError::TensorShape {
                path: p.clone(),
                name: "h.0.ln_1.weight".into(),
                expected: vec![8],
                found: vec![4, 2],
            }
        );

        // Missing.
        let mut tensors = raw_tensors(&cfg, &params, "");
        tensors.retain(|(n, _)| n != "h.1.mlp.c_fc.bias");
        write_raw(&path, tensors);
        assert_eq!(
            load_err(&path, &cfg),
            NnError::MissingTensor {
                path: p.clone(),
                name: "h.1.mlp.c_fc.bias".into()
            }
        );

        // Unexpected: a third layer in a two-layer config.
        let mut tensors = raw_tensors(&cfg, &params, "transformer.");
        tensors.push((
            "transformer.h.2.ln_1.weight".into(),
            f32_raw(&[8], &[1.0; 8]),
        ));
        write_raw(&path, tensors);
        assert_eq!(
            load_err(&path, &cfg),
            NnError::UnexpectedTensor {
                path: p.clone(),
                name: "transformer.h.2.ln_1.weight".into()
            }
        );

        // Unsupported dtype.
        let mut tensors = raw_tensors(&cfg, &params, "");
        tensors[1].1.dtype = Dtype::I32;
        write_raw(&path, tensors);
        assert_eq!(
            load_err(&path, &cfg),
            NnError::TensorDType {
                path: p.clone(),
                name: "wpe.weight".into(),
                dtype: "I32".into()
            }
        );

        // The same parameter with and without the prefix.
        let mut tensors = raw_tensors(&cfg, &params, "");
        tensors.push((
            "transformer.wpe.weight".into(),
            f32_raw(&[16, 8], &params[1].1),
        ));
        write_raw(&path, tensors);
        assert_eq!(
            load_err(&path, &cfg),
            NnError::DuplicateTensor {
                path: p.clone(),
                name: "wpe.weight".into()
            }
        );

        // An LM head that is not the embedding.
        let mut tensors = raw_tensors(&cfg, &params, "transformer.");
        let mut head = params[0].1.clone();
        head[17] += 1.0;
        tensors.push(("lm_head.weight".into(), f32_raw(&[11, 8], &head)));
        write_raw(&path, tensors);
        assert_eq!(
            load_err(&path, &cfg),
            NnError::UntiedHead { path: p.clone() }
        );
    }

    #[test]
    fn files_that_are_not_safetensors_are_named_errors() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = tiny();
        let good = dir.path().join("good.safetensors");
        save_gpt2_safetensors(&good, &cfg, &random_params(&cfg, 6)).unwrap();
        let bytes = std::fs::read(&good).unwrap();

        let cases: [(&str, &[u8]); 4] = [
            ("truncated", &bytes[..bytes.len() - 5]),
            ("header-only", &bytes[..bytes.len() / 2]),
            (
                "garbage",
                b"this is not a safetensors file at all, just text",
            ),
            ("empty", b""),
        ];
        for (name, contents) in cases {
            let path = dir.path().join(name);
            std::fs::write(&path, contents).unwrap();
            match load_err(&path, &cfg) {
                NnError::WeightsFile { path: p, detail } => {
                    assert_eq!(p, path.display().to_string(), "{name}");
                    assert!(
                        detail.contains("not a valid safetensors file"),
                        "{name}: {detail}"
                    );
                }
                other => panic!("{name}: {other:?}"),
            }
        }
        let missing = dir.path().join("nope.safetensors");
        assert!(matches!(
            load_err(&missing, &cfg),
            NnError::WeightsFile { .. }
        ));
    }

    #[test]
    fn non_finite_weights_name_the_tensor_and_index() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = tiny();
        let path = dir.path().join("model.safetensors");
        for (bad, dtype) in [
            (f32::NAN, Dtype::F32),
            (f32::NEG_INFINITY, Dtype::F32),
            (f32::INFINITY, Dtype::BF16),
        ] {
            let mut params = random_params(&cfg, 9);
            params[7].1[5] = bad;
            let mut tensors = raw_tensors(&cfg, &params, "");
            if dtype == Dtype::BF16 {
                for (_, raw) in &mut tensors {
                    let values: Vec<f32> = raw
                        .data
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                        .collect();
                    raw.dtype = dtype;
                    raw.data = values
                        .iter()
                        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                        .collect();
                }
            }
            write_raw(&path, tensors);
            match load_err(&path, &cfg) {
                NnError::NonFiniteWeight {
                    path: p,
                    name,
                    index,
                    value,
                } => {
                    assert_eq!(p, path.display().to_string());
                    assert_eq!((name.as_str(), index), (params[7].0.as_str(), 5));
                    assert_eq!(value.to_bits(), bad.to_bits(), "{dtype:?}");
                }
                other => panic!("{bad} as {dtype:?}: {other:?}"),
            }
        }
        // An f64 weight beyond f32's range would become infinite: refused too.
        let params = random_params(&cfg, 10);
        let mut tensors = raw_tensors(&cfg, &params, "");
        let (name, raw) = &mut tensors[0];
        let mut values: Vec<f64> = params[0].1.iter().map(|&v| v as f64).collect();
        values[3] = 1e300;
        raw.dtype = Dtype::F64;
        raw.data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let name = name.clone();
        write_raw(&path, tensors);
        assert!(matches!(
            load_err(&path, &cfg),
            NnError::NonFiniteWeight { name: n, index: 3, value, .. } if n == name && value == f32::INFINITY
        ));
    }

    /// The file at `path` with its header JSON rewritten by `edit` (the data unchanged).
    fn edit_header(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
        let bytes = std::fs::read(path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        edit(&mut header);
        let text = header.to_string();
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(text.as_bytes());
        out.extend_from_slice(&bytes[8 + n..]);
        std::fs::write(path, out).unwrap();
    }

    /// Headers the safetensors crate refuses with a message naming no tensor ("invalid shape,
    /// data type, or offset") are errors naming the tensor and what is wrong with it.
    #[test]
    fn malformed_headers_name_the_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = tiny();
        let path = dir.path().join("model.safetensors");
        let p = path.display().to_string();
        let params = random_params(&cfg, 8);
        type Edit = fn(&mut serde_json::Value);
        let cases: [(&str, Edit, &str); 3] = [
            (
                "shape",
                |h| h["h.1.ln_2.bias"]["shape"] = serde_json::json!([9]),
                "tensor `h.1.ln_2.bias`: shape [9] of F32 is 36 bytes, but its data_offsets",
            ),
            (
                "dtype",
                |h| h["wpe.weight"]["dtype"] = serde_json::json!("F16"),
                "tensor `wpe.weight`: shape [16, 8] of F16 is 256 bytes",
            ),
            (
                "offsets",
                |h| {
                    let o = h["ln_f.bias"]["data_offsets"][1].as_u64().unwrap();
                    h["ln_f.bias"]["data_offsets"][1] = serde_json::json!(o + 4);
                },
                "tensor `ln_f.bias`",
            ),
        ];
        for (what, edit, want) in cases {
            save_gpt2_safetensors(&path, &cfg, &params).unwrap();
            edit_header(&path, edit);
            match load_err(&path, &cfg) {
                NnError::WeightsFile { path: got, detail } => {
                    assert_eq!(got, p);
                    assert!(detail.contains(want), "{what}: {detail}");
                }
                other => panic!("{what}: {other:?}"),
            }
        }
    }

    #[test]
    fn save_checks_the_parameters_against_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let p = path.display().to_string();
        let cfg = tiny();
        let params = random_params(&cfg, 7);

        let mut short = params.clone();
        short[3].1.pop();
        assert_eq!(
            save_gpt2_safetensors(&path, &cfg, &short).unwrap_err(),
            NnError::TensorShape {
                path: p.clone(),
                name: "h.0.ln_1.bias".into(),
                expected: vec![8],
                found: vec![7],
            }
        );
        let mut missing = params.clone();
        missing.remove(5);
        assert!(matches!(
            save_gpt2_safetensors(&path, &cfg, &missing).unwrap_err(),
            NnError::MissingTensor { name, .. } if name == "h.0.attn.c_attn.bias"
        ));
        let mut extra = params.clone();
        extra.push(("lm_head.weight".into(), params[0].1.clone()));
        assert!(matches!(
            save_gpt2_safetensors(&path, &cfg, &extra).unwrap_err(),
            NnError::UnexpectedTensor { name, .. } if name == "lm_head.weight"
        ));
        let mut twice = params.clone();
        twice.push(params[1].clone());
        assert!(matches!(
            save_gpt2_safetensors(&path, &cfg, &twice).unwrap_err(),
            NnError::DuplicateTensor { name, .. } if name == "wpe.weight"
        ));
        // Nothing was written by the failed saves.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn config_json_round_trips_through_the_hf_reader() {
        for cfg in [
            tiny(),
            GptConfig::preset("gpt2").unwrap(),
            GptConfig::preset("char-small").unwrap(),
        ] {
            let text = hf_config_json(&cfg);
            assert_eq!(
                ModelConfig::from_hf_json(&text).unwrap(),
                ModelConfig::Gpt(cfg.clone())
            );
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["architectures"][0], "GPT2LMHeadModel");
            assert_eq!(v["activation_function"], "gelu_new");
            assert_eq!(v["tie_word_embeddings"], true);
            assert_eq!(v["layer_norm_epsilon"], 1e-5);
        }
        let gpt2: serde_json::Value =
            serde_json::from_str(&hf_config_json(&GptConfig::preset("gpt2").unwrap())).unwrap();
        assert_eq!(gpt2["eos_token_id"], 50256);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        write_hf_config_json(&path, &tiny()).unwrap();
        assert_eq!(
            ModelConfig::from_hf_file(&path).unwrap(),
            ModelConfig::Gpt(tiny())
        );
    }

    #[test]
    fn attention_buffers_are_recognised_exactly() {
        assert!(is_attention_buffer("h.0.attn.bias"));
        assert!(is_attention_buffer("h.11.attn.masked_bias"));
        assert!(!is_attention_buffer("h.0.attn.c_attn.bias"));
        assert!(!is_attention_buffer("h.0.attn.c_proj.bias"));
        assert!(!is_attention_buffer("h.x.attn.bias"));
        assert!(!is_attention_buffer("h..attn.bias"));
        assert!(!is_attention_buffer("wte.attn.bias"));
    }
}
