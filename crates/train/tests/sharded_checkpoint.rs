//! Sharded checkpoints without MPI: a checkpoint cut by hand into the files three ranks would
//! write (AdamW's moments sharded with padding, parameters whole in rank 0's file) and its
//! manifest consolidates back to the whole checkpoint bit for bit, and one process resumes from
//! it as from the whole file; a missing, damaged or truncated shard, or a shard file given
//! alone, is an error naming the file; a whole save of the same step replaces the sharded
//! checkpoint, and retention removes shard files with their manifest.
//! (`mpirun` runs: crates/cli/tests/mpi_checkpoint.rs.)

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use snug_train::checkpoint::{Checkpoint, CheckpointDir, CheckpointRef, ShardOf};
use snug_train::shards::{self, owned_range, DType, Layout, Manifest, ShardEntry, TensorEntry};
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

fn is_moment(name: &str) -> bool {
    name.ends_with(".adam_m") || name.ends_with(".adam_v")
}

/// `whole` cut into the files `ranks` ranks at ZeRO stage 1 write, and their manifest; returns
/// the manifest's path and the shard files'.
fn write_sharded(dir: &Path, whole: &Checkpoint, ranks: usize) -> (PathBuf, Vec<PathBuf>) {
    let layout: Vec<TensorEntry> = whole
        .tensors
        .iter()
        .map(|t| TensorEntry {
            name: t.name.clone(),
            shape: t.shape.clone(),
            dtype: DType::F32,
            layout: if is_moment(&t.name) {
                Layout::Sharded
            } else {
                Layout::Whole
            },
        })
        .collect();
    let mut shards = Vec::new();
    let mut files = Vec::new();
    for rank in 0..ranks {
        let parts: Vec<(&str, Vec<usize>, &[f32])> = whole
            .tensors
            .iter()
            .filter_map(|t| {
                if is_moment(&t.name) {
                    let own = owned_range(t.data.len(), rank, ranks);
                    Some((t.name.as_str(), vec![own.len()], &t.data[own]))
                } else {
                    (rank == 0).then_some((t.name.as_str(), t.shape.clone(), &t.data[..]))
                }
            })
            .collect();
        let file = format!(
            "ckpt-{:08}.0000abcd.shard-{rank}-of-{ranks}.safetensors",
            whole.step
        );
        let path = dir.join(&file);
        CheckpointRef {
            step: whole.step,
            tokens_seen: whole.tokens_seen,
            config: &whole.config,
            tokenizer: whole.tokenizer.clone(),
            tensors: parts
                .iter()
                .map(|(n, s, d)| (*n, s.as_slice(), Cow::Borrowed(*d)))
                .collect(),
            quantized: Vec::new(),
            loss_scale: whole.loss_scale,
            shard: Some(ShardOf { rank, ranks }),
        }
        .save(&path)
        .unwrap();
        let bytes = std::fs::read(&path).unwrap();
        shards.push(ShardEntry {
            rank,
            file,
            bytes: bytes.len() as u64,
            crc32: crc32fast::hash(&bytes),
        });
        files.push(path);
    }
    let manifest = Manifest {
        format: shards::FORMAT.into(),
        version: shards::VERSION,
        step: whole.step,
        tokens_seen: whole.tokens_seen,
        ranks,
        stage: 1,
        tensors: layout,
        shards,
    };
    let path = shards::manifest_path(dir, whole.step);
    std::fs::write(&path, serde_json::to_string(&manifest).unwrap()).unwrap();
    (path, files)
}

fn bits(c: &Checkpoint) -> Vec<(String, Vec<usize>, Vec<u32>)> {
    let mut v: Vec<_> = c
        .tensors
        .iter()
        .map(|t| {
            let b = t.data.iter().map(|x| x.to_bits()).collect();
            (t.name.clone(), t.shape.clone(), b)
        })
        .collect();
    v.sort();
    v
}

fn named_error(path: &Path, expected: &Path, needle: &str) {
    match Checkpoint::load(path) {
        Err(TrainError::Checkpoint { path: p, detail }) => {
            assert_eq!(p, expected, "{detail}");
            assert!(detail.contains(needle), "`{needle}` missing from: {detail}");
        }
        other => panic!(
            "expected an error naming {}, got {other:?}",
            expected.display()
        ),
    }
}

#[test]
fn three_shards_consolidate_to_the_whole_checkpoint_and_resume_as_it_does() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = trainer();
    t.train_step().unwrap();
    t.train_step().unwrap();
    let whole = t.checkpoint().unwrap();
    // Some moment does not divide over three ranks: its last shard is padded in memory and
    // shorter in its file.
    assert!(whole
        .tensors
        .iter()
        .any(|t| is_moment(&t.name) && t.data.len() % 3 != 0));
    let (manifest, files) = write_sharded(dir.path(), &whole, 3);
    let loaded = Checkpoint::load(&manifest).unwrap();
    assert_eq!(bits(&loaded), bits(&whole));
    assert_eq!(
        (loaded.step, loaded.tokens_seen, &loaded.config),
        (whole.step, whole.tokens_seen, &whole.config)
    );
    assert!(loaded.per_rank.is_none());

    // The directory lists the sharded checkpoint by its manifest, and loads it.
    let ckpt_dir = CheckpointDir::open(dir.path()).unwrap();
    assert_eq!(ckpt_dir.list().unwrap(), [(2, manifest.clone())]);
    assert_eq!(ckpt_dir.load_latest().unwrap().0, manifest);

    // One process resumes from the consolidated tensors as from the whole checkpoint.
    let data = || TokenDataset::load(&DataSource::Addition).unwrap();
    let alloc = snug_runtime::Allocator::default;
    let mut a = Trainer::resume(whole.config.clone(), data(), alloc(), &whole).unwrap();
    let mut b = Trainer::resume(whole.config.clone(), data(), alloc(), &loaded).unwrap();
    let (sa, sb) = (a.train_step().unwrap(), b.train_step().unwrap());
    assert_eq!((sa.step, sa.loss.to_bits()), (sb.step, sb.loss.to_bits()));

    // A shard file alone is no checkpoint.
    named_error(&files[1], &files[1], "manifest");
}

#[test]
fn a_missing_damaged_or_truncated_shard_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = trainer();
    t.train_step().unwrap();
    let whole = t.checkpoint().unwrap();
    let (manifest, files) = write_sharded(dir.path(), &whole, 2);
    let original = std::fs::read(&files[1]).unwrap();

    let mut flipped = original.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    std::fs::write(&files[1], &flipped).unwrap();
    named_error(&manifest, &files[1], "damaged");

    std::fs::write(&files[1], &original[..original.len() - 4]).unwrap();
    named_error(&manifest, &files[1], "truncated");

    std::fs::remove_file(&files[1]).unwrap();
    named_error(&manifest, &files[1], "missing");

    // Rank 0's file listed as rank 1's: a manifest that does not match its files.
    std::fs::write(&files[1], &original).unwrap();
    let mut m: Manifest = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    m.shards[1].file = m.shards[0].file.clone();
    m.shards[1].bytes = m.shards[0].bytes;
    m.shards[1].crc32 = m.shards[0].crc32;
    std::fs::write(&manifest, serde_json::to_string(&m).unwrap()).unwrap();
    named_error(&manifest, &files[0], "rank 1");

    // A manifest naming a tensor its shards do not hold (another model's).
    let (manifest, files) = write_sharded(dir.path(), &whole, 2);
    let mut m: Manifest = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    m.tensors[0].name = "another.weight".into();
    std::fs::write(&manifest, serde_json::to_string(&m).unwrap()).unwrap();
    named_error(&manifest, &files[0], "another.weight");
}

#[test]
fn a_whole_save_of_the_same_step_replaces_a_sharded_one_and_retention_takes_its_shards() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt_dir = CheckpointDir::create(dir.path()).unwrap();
    let mut t = trainer();
    t.train_step().unwrap();
    let (manifest, files) = write_sharded(dir.path(), &t.checkpoint().unwrap(), 2);
    // An unfinished save of a later step: shard files and no manifest.
    let orphan = dir
        .path()
        .join("ckpt-00000009.00001234.shard-0-of-2.safetensors");
    std::fs::write(&orphan, b"half").unwrap();
    assert_eq!(ckpt_dir.list().unwrap().len(), 1, "shards are not listed");

    // Step 1 saved whole (one process resumed it): the sharded copy and the orphan go.
    let saved = ckpt_dir.save(&t.checkpoint().unwrap(), 3).unwrap();
    assert_eq!(ckpt_dir.list().unwrap(), [(1, saved)]);
    assert!(!manifest.exists() && !orphan.exists());
    assert!(files.iter().all(|f| !f.exists()));

    // A sharded step 2, then whole steps 3 and 4 keeping two: step 2's shards go with it.
    t.train_step().unwrap();
    let (manifest, files) = write_sharded(dir.path(), &t.checkpoint().unwrap(), 2);
    for _ in 0..2 {
        t.train_step().unwrap();
        ckpt_dir.save(&t.checkpoint().unwrap(), 2).unwrap();
    }
    let steps: Vec<u64> = ckpt_dir.list().unwrap().iter().map(|e| e.0).collect();
    assert_eq!(steps, [3, 4]);
    assert!(!manifest.exists());
    assert!(files.iter().all(|f| !f.exists()));
}

/// Every file in `dir` with its bytes, to show a refused save changed nothing.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    files.sort();
    files
}

fn refused_naming(result: Result<PathBuf, TrainError>, expected: &Path) {
    match result {
        Err(TrainError::Checkpoint { path, detail }) => {
            assert_eq!(path, expected, "{detail}");
            assert!(detail.contains("another run"), "{detail}");
        }
        other => panic!(
            "expected a refusal naming {}, got {other:?}",
            expected.display()
        ),
    }
}

#[test]
fn no_save_replaces_another_runs_sharded_checkpoint_of_its_step() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt_dir = CheckpointDir::create(dir.path()).unwrap();
    // Another run's sharded checkpoint of step 1, copied in.
    let mut other = trainer();
    other.train_step().unwrap();
    let (manifest, _) = write_sharded(dir.path(), &other.checkpoint().unwrap(), 2);
    let before = snapshot(dir.path());

    let mut t = trainer();
    t.train_step().unwrap();
    // Sharded (as one rank of one) and whole: both refused, naming the manifest, and no file
    // written, replaced or removed.
    let sharded = shards::save(dir.path(), &t.shard_ref().unwrap(), Some((&ckpt_dir, 3)));
    refused_naming(sharded, &manifest);
    refused_naming(ckpt_dir.save(&t.checkpoint().unwrap(), 3), &manifest);
    assert_eq!(snapshot(dir.path()), before);

    // The next step saves, sharded, and retention by run keeps the other run's checkpoint
    // however few of its own it keeps.
    for _ in 0..3 {
        t.train_step().unwrap();
        shards::save(dir.path(), &t.shard_ref().unwrap(), Some((&ckpt_dir, 1))).unwrap();
    }
    let listed = ckpt_dir.list().unwrap();
    assert_eq!(
        listed,
        [
            (1, manifest.clone()),
            (4, shards::manifest_path(dir.path(), 4))
        ]
    );
    // The other run's files are as they were: its manifest and both its shards.
    let now = snapshot(dir.path());
    for file in &before {
        assert!(now.contains(file), "{} changed or went", file.0.display());
    }
    // One shard file of ours beside them: step 4's; steps 2 and 3 went with their manifests.
    assert_eq!(now.len(), before.len() + 2, "{now:?}");
    assert_eq!(
        Checkpoint::load(&shards::manifest_path(dir.path(), 4))
            .unwrap()
            .step,
        4
    );
}

#[test]
fn a_sharded_save_replaces_the_runs_own_checkpoint_of_its_step() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt_dir = CheckpointDir::create(dir.path()).unwrap();
    let mut t = trainer();
    t.train_step().unwrap();
    let whole = ckpt_dir.save(&t.checkpoint().unwrap(), 3).unwrap();
    // Resumed from step 1 and saved again, sharded: the run's own whole file gives way.
    let first = shards::save(dir.path(), &t.shard_ref().unwrap(), Some((&ckpt_dir, 3))).unwrap();
    assert!(!whole.exists());
    // And again: the earlier save's shard goes, one manifest and one shard stay.
    let again = shards::save(dir.path(), &t.shard_ref().unwrap(), Some((&ckpt_dir, 3))).unwrap();
    assert_eq!(first, again);
    assert_eq!(snapshot(dir.path()).len(), 2);
    assert_eq!(
        bits(&Checkpoint::load(&again).unwrap()),
        bits(&t.checkpoint().unwrap())
    );
}

/// A manifest that cannot be written (here its temporary name is taken by a directory) leaves
/// no shard file of that save behind: no manifest would ever name them.
#[test]
fn a_save_whose_manifest_cannot_be_written_leaves_no_shards() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt_dir = CheckpointDir::create(dir.path()).unwrap();
    let mut t = trainer();
    t.train_step().unwrap();
    let blocker = dir.path().join(".ckpt-00000001.manifest.json.tmp");
    std::fs::create_dir(&blocker).unwrap();
    std::fs::write(blocker.join("inside"), b"x").unwrap();
    let saved = shards::save(dir.path(), &t.shard_ref().unwrap(), Some((&ckpt_dir, 3)));
    assert!(saved.is_err(), "{saved:?}");
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
