//! Fuzzing snug's checkpoint files: byte flips (weighted towards the header), truncations,
//! and random JSON in header and metadata fields. Every input must load as the checkpoint it
//! was or give a typed error naming the file, never panic: thanks to the per-tensor checksums,
//! damaged tensor data never loads.
//!
//! 64 cases per target by default, so the suite stays fast; `PROPTEST_CASES=N` runs more.

use std::path::Path;
use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::Value;
use snug_testkit::fuzz::{any_json, runner, safetensors_header_len};
use snug_train::checkpoint::Checkpoint;
use snug_train::{
    DataSource, ModelSection, TokenDataset, TrainConfig, TrainError, TrainSection, Trainer,
};

/// A valid checkpoint (a two-layer model after one step) and its file's bytes, made once.
fn valid() -> &'static (Checkpoint, Vec<u8>) {
    static CKPT: OnceLock<(Checkpoint, Vec<u8>)> = OnceLock::new();
    CKPT.get_or_init(|| {
        let model = ModelSection {
            preset: Some("tiny".into()),
            n_embd: Some(16),
            ..Default::default()
        };
        let train = TrainSection {
            steps: Some(2),
            batch: Some(2),
            block: Some(8),
            threads: Some(1),
            ..Default::default()
        };
        let cfg = TrainConfig::resolve(None, &model, &train).unwrap();
        let data = TokenDataset::load(&DataSource::Addition).unwrap();
        let mut t = Trainer::new(cfg, data).unwrap();
        t.train_step().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt-00000001.safetensors");
        let ckpt = t.checkpoint().unwrap();
        ckpt.save(&path).unwrap();
        // As loading returns it (tensors by name).
        let loaded = Checkpoint::load(&path).unwrap();
        (loaded, std::fs::read(&path).unwrap())
    })
}

/// Loads `bytes` from a checkpoint file: a typed error naming the file, or tensors bit-equal
/// to the saved ones (header damage may change what the metadata says, never a value).
fn check(dir: &Path, bytes: &[u8]) -> Result<(), TestCaseError> {
    let path = dir.join("ckpt-00000001.safetensors");
    std::fs::write(&path, bytes).unwrap();
    match Checkpoint::load(&path) {
        Ok(c) => {
            let want = &valid().0;
            prop_assert_eq!(c.tensors.len(), want.tensors.len());
            for (a, b) in c.tensors.iter().zip(&want.tensors) {
                prop_assert_eq!(&a.name, &b.name);
                // The checksums cover the data, not the header: an edit may reshape a tensor
                // (resuming then names the mismatch against the model), never change a value.
                prop_assert_eq!(
                    a.shape.iter().product::<usize>(),
                    b.shape.iter().product::<usize>()
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                prop_assert!(bits(&a.data) == bits(&b.data), "{} changed", a.name);
            }
            // The saved configuration resolves to a model or to a named error.
            let _ = c.model();
        }
        Err(TrainError::Checkpoint { path: p, .. })
        | Err(TrainError::NonFiniteCheckpoint { path: p, .. }) => prop_assert_eq!(p, path),
        // A version edited upwards reads as a newer snug's file, which is left for that snug.
        Err(TrainError::CheckpointTooNew {
            path: p,
            version,
            newest,
        }) => {
            prop_assert_eq!(p, path);
            prop_assert!(version > newest, "{version} > {newest}");
        }
        Err(other) => prop_assert!(false, "unexpected error kind: {other:?}"),
    }
    Ok(())
}

#[test]
fn checkpoints_with_flipped_bytes_or_truncated_never_panic_nor_load_damaged_data() {
    let bytes = &valid().1;
    let (len, header) = (bytes.len(), safetensors_header_len(bytes));
    let dir = tempfile::tempdir().unwrap();
    let flips = prop::collection::vec(
        (prop_oneof![0..header, 0..len, header..len], 1u8..=255),
        1..8,
    );
    runner()
        .run(&(flips, 0..=len + 16), |(flips, cut)| {
            let mut b = bytes.clone();
            for (i, x) in flips {
                b[i] ^= x;
            }
            check(dir.path(), &b)?;
            let mut t = bytes.clone();
            t.resize(cut, 0);
            check(dir.path(), &t)
        })
        .unwrap();
}

/// Random JSON in place of tensor entries' fields and of the metadata's values (the metadata
/// holds strings; some of those are JSON themselves: the config, tokenizer and checksums).
#[test]
fn checkpoint_headers_with_random_fields_never_panic() {
    let bytes = &valid().1;
    let n = safetensors_header_len(bytes);
    let header: Value = serde_json::from_slice(&bytes[8..n]).unwrap();
    let tensors: Vec<String> = header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    let meta_keys: Vec<String> = header["__metadata__"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let tensor_edit = (
        prop::sample::select(tensors),
        prop::sample::select(vec!["dtype", "shape", "data_offsets"]),
        any_json(),
    );
    // A metadata value replaced by a string (as the format has them) or by any JSON.
    let meta_edit = (
        prop::sample::select(meta_keys),
        prop_oneof![
            any_json().prop_map(|v| Value::String(v.to_string())),
            any_json()
        ],
    );
    // Values inside the saved configuration (`config`, a JSON string), its model's included.
    let config: Value =
        serde_json::from_str(header["__metadata__"]["config"].as_str().unwrap()).unwrap();
    let mut config_keys: Vec<String> = config.as_object().unwrap().keys().cloned().collect();
    config_keys.extend(
        [
            "preset",
            "n_layer",
            "n_head",
            "n_embd",
            "block_size",
            "vocab_size",
        ]
        .map(|k| format!("model.{k}")),
    );
    let config_edit = (
        prop::sample::select(config_keys),
        prop_oneof![
            any_json(),
            prop::sample::select(vec![0u64, 1, 2, 3, 4, 16, 1 << 20, 1_000_000_000])
                .prop_map(Value::from)
        ],
    );
    let edits = (
        prop::collection::vec(tensor_edit, 0..3),
        prop::collection::vec(meta_edit, 0..3),
        prop::collection::vec(config_edit, 0..4),
    );
    runner()
        .run(&edits, |(tensor_edits, meta_edits, config_edits)| {
            let mut h = header.clone();
            for (name, field, value) in tensor_edits {
                if let Some(obj) = h[&name].as_object_mut() {
                    obj.insert(field.to_string(), value);
                }
            }
            let mut c = config.clone();
            for (key, value) in config_edits {
                match key.split_once('.') {
                    // Skipped when an earlier edit replaced the section itself.
                    Some((section, k)) => {
                        if let Some(obj) = c[section].as_object_mut() {
                            obj.insert(k.to_string(), value);
                        }
                    }
                    None => c[&key] = value,
                }
            }
            h["__metadata__"]["config"] = Value::String(c.to_string());
            for (key, value) in meta_edits {
                h["__metadata__"][&key] = value;
            }
            let text = h.to_string();
            let mut b = (text.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(text.as_bytes());
            b.extend_from_slice(&bytes[n..]);
            check(dir.path(), &b)
        })
        .unwrap();
}
