//! Damaged checkpoints: a flipped bit in a tensor's data is caught by its checksum and names
//! the tensor, the newest good checkpoint loads instead, and version 1 files (no checksums)
//! still load.

use std::collections::HashMap;
use std::path::Path;

use snug_train::checkpoint::{Checkpoint, CheckpointDir, Keep};
use snug_train::TrainError;
use snug_train::{DataSource, ModelSection, TokenDataset, TrainConfig, TrainSection, Trainer};

fn trainer() -> Trainer {
    let model = ModelSection {
        preset: Some("tiny".into()),
        ..Default::default()
    };
    let train = TrainSection {
        steps: Some(4),
        batch: Some(2),
        block: Some(16),
        threads: Some(1),
        ..Default::default()
    };
    let cfg = TrainConfig::resolve(None, &model, &train).unwrap();
    Trainer::new(cfg, TokenDataset::load(&DataSource::Addition).unwrap()).unwrap()
}

/// The byte range of `name`'s data in the file at `path`.
fn data_range(path: &Path, name: &str) -> std::ops::Range<usize> {
    let bytes = std::fs::read(path).unwrap();
    let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let (start, end) = meta.info(name).unwrap().data_offsets;
    8 + n + start..8 + n + end
}

/// Rewrites the file at `path` with its metadata changed by `edit` (tensors unchanged).
fn rewrite_metadata(path: &Path, edit: impl FnOnce(&mut HashMap<String, String>)) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap();
    edit(&mut meta);
    safetensors::serialize_to_file(st.tensors(), Some(meta), path).unwrap();
}

fn checkpoint_error(path: &Path) -> String {
    match Checkpoint::load(path) {
        Err(TrainError::Checkpoint { path: p, detail }) => {
            assert_eq!(p, path);
            detail
        }
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

#[test]
fn a_flipped_bit_in_tensor_data_names_the_tensor_and_the_previous_checkpoint_loads() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt_dir = CheckpointDir::create(dir.path()).unwrap();
    let mut t = trainer();
    t.train_step().unwrap();
    ckpt_dir.save(&t.checkpoint().unwrap(), 3).unwrap();
    t.train_step().unwrap();
    let newest = ckpt_dir.save(&t.checkpoint().unwrap(), 3).unwrap();
    assert_eq!(Checkpoint::load(&newest).unwrap().step, 2);

    // The lowest mantissa bit of one weight: the value stays finite and plausible.
    let name = "h.1.attn.c_attn.weight";
    let range = data_range(&newest, name);
    let mut bytes = std::fs::read(&newest).unwrap();
    bytes[range.start + 4 * 37] ^= 1;
    std::fs::write(&newest, &bytes).unwrap();

    let detail = checkpoint_error(&newest);
    assert!(
        detail.contains(name) && detail.contains("CRC-32"),
        "{detail}"
    );
    let (path, loaded) = ckpt_dir.load_latest().unwrap();
    assert_eq!((path, loaded.step), (ckpt_dir.path_for(1), 1));

    // A checksum is checked against its own tensor: two tensors' data swapped is damage too.
    let ckpt = t.checkpoint().unwrap();
    ckpt.save(&newest).unwrap();
    let (a, b) = (
        data_range(&newest, "h.0.ln_1.bias"),
        data_range(&newest, "h.0.ln_2.bias"),
    );
    let mut bytes = std::fs::read(&newest).unwrap();
    let first = bytes[a.clone()].to_vec();
    bytes.copy_within(b.clone(), a.start);
    bytes[b].copy_from_slice(&first);
    std::fs::write(&newest, &bytes).unwrap();
    let detail = checkpoint_error(&newest);
    assert!(detail.contains("h.0.ln_1.bias"), "{detail}");
}

/// What `sample` and `export` read of a run: the weights alone, bit for bit those a whole
/// load holds, no optimizer state; and a damaged optimizer tensor still refuses the file. The
/// checkpoint is over a mebibyte, so it is mapped rather than read (and each tensor's pages
/// let go once read), as a real one is.
#[test]
fn a_load_of_the_weights_alone_holds_no_optimizer_state_and_still_checks_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt-00000001.safetensors");
    let mut t = trainer();
    t.train_step().unwrap();
    t.checkpoint().unwrap().save(&path).unwrap();
    assert!(std::fs::metadata(&path).unwrap().len() > 1 << 20, "mapped");
    let all = Checkpoint::load(&path).unwrap();
    let weights = Checkpoint::load_keeping(&path, Keep::Weights).unwrap();
    let optimizer = |name: &str| name.ends_with(".adam_m") || name.ends_with(".adam_v");
    assert!(all.tensors.iter().any(|t| optimizer(&t.name)));
    assert!(!weights.tensors.iter().any(|t| optimizer(&t.name)));
    let kept: Vec<_> = all.tensors.iter().filter(|t| !optimizer(&t.name)).collect();
    assert_eq!(kept, weights.tensors.iter().collect::<Vec<_>>());
    assert_eq!(all.parameters(), weights.parameters());
    assert_eq!((all.step, &all.config), (weights.step, &weights.config));

    let name = "h.1.attn.c_attn.weight.adam_v";
    let range = data_range(&path, name);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[range.start + 4 * 11] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    match Checkpoint::load_keeping(&path, Keep::Weights) {
        Err(TrainError::Checkpoint { detail, .. }) => {
            assert!(
                detail.contains(name) && detail.contains("CRC-32"),
                "{detail}"
            )
        }
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

#[test]
fn checksums_are_required_from_version_2_and_version_1_files_still_load() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt-00000001.safetensors");
    let mut t = trainer();
    t.train_step().unwrap();
    let ckpt = t.checkpoint().unwrap();
    ckpt.save(&path).unwrap();
    let (_, header) =
        safetensors::SafeTensors::read_metadata(&std::fs::read(&path).unwrap()).unwrap();
    let meta = header.metadata().clone().unwrap();
    assert_eq!(meta["version"], "2");
    let sums: HashMap<String, u32> = serde_json::from_str(&meta["crc32"]).unwrap();
    assert_eq!(sums.len(), ckpt.tensors.len());

    // A version 2 file without its checksums, or missing one, is refused.
    rewrite_metadata(&path, |m| {
        m.remove("crc32");
    });
    assert!(checkpoint_error(&path).contains("crc32"));
    ckpt.save(&path).unwrap();
    rewrite_metadata(&path, |m| {
        let mut sums: HashMap<String, u32> = serde_json::from_str(&m["crc32"]).unwrap();
        sums.remove("wpe.weight");
        m.insert("crc32".into(), serde_json::to_string(&sums).unwrap());
    });
    assert!(checkpoint_error(&path).contains("`wpe.weight` has no checksum"));

    // Version 1 (written before checksums) loads as it was.
    ckpt.save(&path).unwrap();
    rewrite_metadata(&path, |m| {
        m.remove("crc32");
        m.insert("version".into(), "1".into());
    });
    let loaded = Checkpoint::load(&path).unwrap();
    assert_eq!(loaded.step, ckpt.step);
    assert_eq!(loaded.tensors.len(), ckpt.tensors.len());
    for t in &ckpt.tensors {
        // Not `assert_eq!` on the tensors: a failure would print every weight.
        assert!(loaded.tensor(&t.name) == Some(t), "{} differs", t.name);
    }

    // A version from the future is refused with both numbers, as a newer snug's, not damage.
    let newest = snug_train::checkpoint::VERSION;
    rewrite_metadata(&path, |m| {
        m.insert("version".into(), (newest + 1).to_string());
    });
    match Checkpoint::load(&path) {
        Err(
            e @ TrainError::CheckpointTooNew {
                version, newest: n, ..
            },
        ) if version == newest + 1 && n == newest => {
            assert!(e.to_string().contains("newer snug"), "{e}")
        }
        other => panic!("expected a newer snug's checkpoint, got {other:?}"),
    }
}

/// A header the safetensors crate refuses without naming a tensor ("invalid shape, data type,
/// or offset") is an error naming the tensor and what is wrong with it.
#[test]
fn a_malformed_header_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt-00000001.safetensors");
    let mut t = trainer();
    t.train_step().unwrap();
    t.checkpoint().unwrap().save(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header["h.0.ln_1.weight"]["shape"] = serde_json::json!([129]);
    let text = header.to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
    let detail = checkpoint_error(&path);
    assert!(
        detail.contains("tensor `h.0.ln_1.weight`: shape [129] of F32 is 516 bytes"),
        "{detail}"
    );
}

/// A NaN or infinity in a checkpoint (here one whose checksums agree: saved from a diverged
/// state) is refused at load, naming the tensor and the index, instead of surfacing steps
/// later as a NaN loss; the directory falls back to the previous checkpoint.
#[test]
fn non_finite_values_are_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt_dir = CheckpointDir::create(dir.path()).unwrap();
    let mut t = trainer();
    t.train_step().unwrap();
    ckpt_dir.save(&t.checkpoint().unwrap(), 3).unwrap();
    t.train_step().unwrap();
    for (name, bad) in [
        ("wpe.weight", f32::NAN),
        ("h.1.mlp.c_fc.bias.adam_v", f32::INFINITY),
    ] {
        let mut ckpt = t.checkpoint().unwrap();
        let tensor = ckpt.tensors.iter_mut().find(|t| t.name == name).unwrap();
        tensor.data[11] = bad;
        let path = ckpt_dir.save(&ckpt, 3).unwrap();
        match Checkpoint::load(&path) {
            Err(TrainError::NonFiniteCheckpoint {
                path: p,
                name: n,
                index,
                value,
            }) => {
                assert_eq!((p, n.as_str(), index), (path, name, 11));
                assert_eq!(value.to_bits(), bad.to_bits());
            }
            other => panic!("{name}: {:?}", other.map(|c| c.step)),
        }
        assert_eq!(ckpt_dir.load_latest().unwrap().1.step, 1);
    }
}

/// A negative second moment (finite, checksums agreeing) is refused at load naming the tensor
/// and the index, instead of stopping the run steps later as a NaN loss naming nothing.
#[test]
fn a_negative_second_moment_is_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt_dir = CheckpointDir::create(dir.path()).unwrap();
    let mut t = trainer();
    t.train_step().unwrap();
    let mut ckpt = t.checkpoint().unwrap();
    let name = "h.0.attn.c_proj.weight.adam_v";
    let tensor = ckpt.tensors.iter_mut().find(|t| t.name == name).unwrap();
    tensor.data[5] = -0.25;
    let path = ckpt_dir.save(&ckpt, 3).unwrap();
    let detail = checkpoint_error(&path);
    assert!(detail.contains(name), "{detail}");
    assert!(detail.contains("-0.25 at index 5"), "{detail}");
}
