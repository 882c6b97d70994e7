//! A run directory's history is never lost to the run itself: retention deletes only the run's
//! own checkpoints, a damaged file moved aside never replaces an earlier one, a checkpoint from
//! a newer snug stops a resume rather than being passed over, a resumed run keeps every line of
//! its metrics it does not own, and a run's data path means the same file from any directory.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use snug_runtime::Allocator;
use snug_train::checkpoint::{Checkpoint, CheckpointDir};
use snug_train::config::DataSourceConfig;
use snug_train::run_dir::{Claim, RunDir};
use snug_train::{
    DataSource, ModelSection, TokenDataset, TrainConfig, TrainError, TrainSection, Trainer,
};

fn config(preset: &str, steps: u64) -> TrainConfig {
    let model = ModelSection {
        preset: Some(preset.into()),
        ..Default::default()
    };
    let train = TrainSection {
        steps: Some(steps),
        batch: Some(2),
        block: Some(8),
        threads: Some(1),
        warmup_steps: Some(1),
        eval_every: Some(0),
        ..Default::default()
    };
    TrainConfig::resolve(None, &model, &train).unwrap()
}

fn trainer(cfg: &TrainConfig) -> Trainer {
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    Trainer::new(cfg.clone(), data).unwrap()
}

fn steps_in(dir: &Path) -> Vec<u64> {
    let listed = CheckpointDir::open(dir).unwrap().list().unwrap();
    listed.into_iter().map(|(s, _)| s).collect()
}

/// Another run's checkpoint in the directory (copied in, or left there) is never retention's:
/// the run keeps its newest one and the other run's file is as it was. A file saved before
/// runs had ids is the run's own only where it is of the same model.
#[test]
fn retention_deletes_only_the_runs_own_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let ckpts = CheckpointDir::create(dir.path()).unwrap();
    let mut other = trainer(&config("tiny", 4));
    other.train_step().unwrap();
    let foreign = other.checkpoint().unwrap();
    // A run of another model, saved before runs had ids.
    let mut legacy_other_model = trainer(&config("char-small", 4)).checkpoint().unwrap();
    legacy_other_model.config.run_id = None;
    legacy_other_model.step = 2;
    ckpts.save(&foreign, 10).unwrap();
    ckpts.save(&legacy_other_model, 10).unwrap();
    let foreign_bytes = std::fs::read(ckpts.path_for(1)).unwrap();

    let mut ours = trainer(&config("tiny", 8));
    assert!(ours.config().run_id.is_some());
    assert_ne!(
        ours.config().run_id,
        foreign.config.run_id,
        "each run mints its own id"
    );
    // This run's own checkpoint saved before runs had ids: same model, so retention's.
    for _ in 0..3 {
        ours.train_step().unwrap();
    }
    let mut legacy_ours = ours.checkpoint().unwrap();
    legacy_ours.config.run_id = None;
    ckpts.save(&legacy_ours, 10).unwrap();
    for _ in 0..3 {
        ours.train_step().unwrap();
        ckpts.save(&ours.checkpoint().unwrap(), 1).unwrap();
    }
    assert_eq!(steps_in(dir.path()), vec![1, 2, 6]);
    assert_eq!(std::fs::read(ckpts.path_for(1)).unwrap(), foreign_bytes);
    assert_eq!(
        Checkpoint::load(&ckpts.path_for(2))
            .unwrap()
            .config
            .model
            .preset
            .as_deref(),
        Some("char-small")
    );
}

/// A resumed run keeps its id, so its own older checkpoints stay retention's.
#[test]
fn a_resumed_run_keeps_its_id() {
    let dir = tempfile::tempdir().unwrap();
    let ckpts = CheckpointDir::create(dir.path()).unwrap();
    let cfg = config("tiny", 8);
    let mut first = trainer(&cfg);
    first.train_step().unwrap();
    ckpts.save(&first.checkpoint().unwrap(), 5).unwrap();
    let (_, ckpt) = ckpts.load_latest().unwrap();
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    let mut resumed =
        Trainer::resume(ckpt.config.clone(), data, Allocator::default(), &ckpt).unwrap();
    assert_eq!(resumed.config().run_id, first.config().run_id);
    // A configuration a library caller built has no id: the running trainer keeps its own.
    let mut built = config("tiny", 8);
    built.run_id = None;
    built.data_crc32 = None;
    resumed.reconfigure(built).unwrap();
    assert_eq!(resumed.config().run_id, first.config().run_id);
    assert!(resumed.config().data_crc32.is_some());
    resumed.train_step().unwrap();
    ckpts.save(&resumed.checkpoint().unwrap(), 1).unwrap();
    assert_eq!(steps_in(dir.path()), vec![2]);
}

/// Damage that moves a checkpoint aside twice keeps both damaged files, each as it was.
#[test]
fn a_second_damaged_checkpoint_does_not_replace_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let ckpts = CheckpointDir::create(dir.path()).unwrap();
    let path = ckpts.path_for(4);
    let mut asides = Vec::new();
    for content in [&b"first damaged file"[..], b"second damaged file"] {
        std::fs::write(&path, content).unwrap();
        asides.push(ckpts.move_aside(4, &path).unwrap());
    }
    assert_ne!(asides[0], asides[1]);
    assert!(asides[0].to_string_lossy().ends_with(".damaged"));
    assert!(asides[1].to_string_lossy().ends_with(".damaged.2"));
    assert_eq!(std::fs::read(&asides[0]).unwrap(), b"first damaged file");
    assert_eq!(std::fs::read(&asides[1]).unwrap(), b"second damaged file");
}

/// The checkpoint at `path` as a newer snug would write it (a format version past this one's).
fn from_a_newer_snug(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    let (old, new) = (&b"\"version\":\"2\""[..], &b"\"version\":\"9\""[..]);
    let at = bytes
        .windows(old.len())
        .position(|w| w == old)
        .expect("the header names its version");
    let mut out = bytes.clone();
    out[at..at + old.len()].copy_from_slice(new);
    // And a dtype this snug does not know, so nothing past the version parses here.
    let (f32_, unknown) = (&b"\"F32\""[..], &b"\"X32\""[..]);
    let at = out
        .windows(f32_.len())
        .position(|w| w == f32_)
        .expect("an f32 tensor");
    out[at..at + f32_.len()].copy_from_slice(unknown);
    std::fs::write(path, out).unwrap();
}

/// A newer snug's checkpoint is not damage: loading the directory's newest and claiming it to
/// resume an older step both stop with that error, and the file stays where it is.
#[test]
fn a_checkpoint_from_a_newer_snug_stops_a_resume() {
    let dir = tempfile::tempdir().unwrap();
    let ckpts = CheckpointDir::create(dir.path()).unwrap();
    let mut t = trainer(&config("tiny", 8));
    for _ in 0..2 {
        t.train_step().unwrap();
        ckpts.save(&t.checkpoint().unwrap(), 5).unwrap();
    }
    let newest = ckpts.path_for(2);
    from_a_newer_snug(&newest);
    let bytes = std::fs::read(&newest).unwrap();
    match ckpts.load_latest() {
        Err(TrainError::CheckpointTooNew { version: 9, .. }) => {}
        other => panic!("expected a newer snug's checkpoint to stop the load, got {other:?}"),
    }
    let claim = Claim::Resume {
        from: dir.path().to_path_buf(),
        step: 1,
    };
    match RunDir::claim(dir.path(), &claim) {
        Err(TrainError::CheckpointTooNew { path, .. }) => assert_eq!(path, newest),
        other => panic!("expected the claim to stop, got {other:?}"),
    }
    assert_eq!(std::fs::read(&newest).unwrap(), bytes, "left as it is");
    assert_eq!(steps_in(dir.path()), vec![1, 2]);
}

/// A newer snug's sharded manifest, whatever else it holds, is a newer snug's, not damage.
#[test]
fn a_manifest_from_a_newer_snug_is_named_so() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt-00000003.manifest.json");
    let text = format!(
        "{{\"format\":\"{}\",\"version\":{},\"layout\":\"new\"}}",
        snug_train::shards::FORMAT,
        snug_train::shards::VERSION + 1
    );
    std::fs::write(&path, text).unwrap();
    match snug_train::shards::load(&path) {
        Err(TrainError::CheckpointTooNew { version, .. }) => {
            assert_eq!(version, snug_train::shards::VERSION + 1)
        }
        other => panic!(
            "expected a newer snug's manifest, got {:?}",
            other.map(|c| c.step)
        ),
    }
}

/// A run resumed from step 2 drops the metrics of the steps after it (lost with their state)
/// and keeps every other line: a user's note, and lines that are not JSON.
#[test]
fn a_resume_keeps_the_metrics_lines_it_does_not_own() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config("tiny", 4);
    cfg.out = Some(dir.path().to_path_buf());
    cfg.checkpoint_every = 2;
    let mut t = trainer(&cfg);
    snug_train::run(&mut t, None, &AtomicBool::new(false), |_| {}).unwrap();
    drop(t);
    let metrics = dir.path().join("metrics.jsonl");
    let mut text = std::fs::read_to_string(&metrics).unwrap();
    text.push_str("{\"kind\":\"note\",\"text\":\"my annotation\"}\nnot json at all\n");
    // A write a crash cut short: no newline, not JSON.
    text.push_str("{\"kind\":\"step\",\"st");
    std::fs::write(&metrics, &text).unwrap();
    // Resume from step 2, as after a crash that lost step 4's checkpoint.
    std::fs::remove_file(CheckpointDir::open(dir.path()).unwrap().path_for(4)).unwrap();
    let (_, ckpt) = CheckpointDir::open(dir.path())
        .unwrap()
        .load_latest()
        .unwrap();
    assert_eq!(ckpt.step, 2);
    let mut cfg = ckpt.config.clone();
    cfg.steps = 3;
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    let mut t = Trainer::resume(cfg, data, Allocator::default(), &ckpt).unwrap();
    snug_train::run(&mut t, None, &AtomicBool::new(false), |_| {}).unwrap();
    let after = std::fs::read_to_string(&metrics).unwrap();
    assert!(after.contains("my annotation"), "{after}");
    assert!(after.lines().any(|l| l == "not json at all"), "{after}");
    let steps: Vec<u64> = after
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "step")
        .filter_map(|v| v["step"].as_u64())
        .collect();
    assert_eq!(
        steps,
        vec![1, 2, 3],
        "step 3 and 4's first lines dropped, step 3 again"
    );
    assert!(!after.contains("\"st\n"), "the torn line is gone: {after}");
    assert!(after.ends_with('\n'));
    let names: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(
        !names.iter().any(|p| p.to_string_lossy().ends_with(".tmp")),
        "{names:?}"
    );
}

/// A data path given relative to where a run starts is saved absolute: a resume elsewhere
/// reads that file, not one of the same name there.
#[test]
fn a_relative_data_path_is_saved_absolute() {
    let model = ModelSection {
        preset: Some("tiny".into()),
        ..Default::default()
    };
    let train = TrainSection {
        data: Some(PathBuf::from("corpus.txt")),
        ..Default::default()
    };
    let cfg = TrainConfig::resolve(None, &model, &train).unwrap();
    let want = std::env::current_dir().unwrap().join("corpus.txt");
    assert_eq!(cfg.data, DataSourceConfig::File(want.clone()));
    // A resumed configuration keeps the path it was saved with; a new `--data` is made
    // absolute too.
    let kept = TrainConfig::resolve_resumed(
        cfg.clone(),
        None,
        &ModelSection::default(),
        &TrainSection::default(),
    )
    .unwrap();
    assert_eq!(kept.data, DataSourceConfig::File(want.clone()));
    // A checkpoint saved before paths were made absolute, resumed with `--data` naming the same
    // relative path: saved absolute from then on.
    let mut old = cfg;
    old.data = DataSourceConfig::File(PathBuf::from("corpus.txt"));
    let again = TrainSection {
        data: Some(PathBuf::from("corpus.txt")),
        ..Default::default()
    };
    let resumed =
        TrainConfig::resolve_resumed(old, None, &ModelSection::default(), &again).unwrap();
    assert_eq!(resumed.data, DataSourceConfig::File(want));
}

/// A checkpoint of another run at the step this run saves is never replaced: the save is a
/// named error and the file stays as it was.
#[test]
fn a_save_never_replaces_another_runs_checkpoint_of_that_step() {
    let dir = tempfile::tempdir().unwrap();
    let ckpts = CheckpointDir::create(dir.path()).unwrap();
    let mut other = trainer(&config("tiny", 4));
    other.train_step().unwrap();
    ckpts.save(&other.checkpoint().unwrap(), 3).unwrap();
    let before = std::fs::read(ckpts.path_for(1)).unwrap();
    let mut ours = trainer(&config("tiny", 4));
    ours.train_step().unwrap();
    match ckpts.save(&ours.checkpoint().unwrap(), 3) {
        Err(e @ TrainError::Checkpoint { .. }) => {
            assert!(
                e.to_string().contains("another run's checkpoint of step 1"),
                "{e}"
            )
        }
        other => panic!("expected the save refused, got {other:?}"),
    }
    assert_eq!(std::fs::read(ckpts.path_for(1)).unwrap(), before);
    // The run's own checkpoint of a step is saved again (a resume that saves at once).
    ckpts.save(&other.checkpoint().unwrap(), 3).unwrap();
}

/// Resumed with the configuration file it started from, which names its data, the run still
/// checks its data: only `--data`, or a file naming other data, asks to train on it as it is.
#[test]
fn a_config_file_naming_the_same_data_keeps_the_check() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    let file = dir.path().join("run.toml");
    let text = format!("[train]\ndata = {:?}\n", corpus.display().to_string());
    std::fs::write(&file, text).unwrap();
    let mut cfg = config("tiny", 4);
    cfg.data = DataSourceConfig::File(corpus);
    cfg.data_crc32 = Some(7);
    let resumed = TrainConfig::resolve_resumed(
        cfg,
        Some(&file),
        &ModelSection::default(),
        &TrainSection::default(),
    )
    .unwrap();
    assert_eq!(resumed.data_crc32, Some(7));
}

/// A claim refused because the directory holds another run leaves no lock behind: the
/// directory is as it was.
#[test]
fn a_refused_claim_removes_the_lock_it_made() {
    let dir = tempfile::tempdir().unwrap();
    let ckpts = CheckpointDir::create(dir.path()).unwrap();
    ckpts
        .save(&trainer(&config("tiny", 4)).checkpoint().unwrap(), 3)
        .unwrap();
    let before: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    match RunDir::claim(dir.path(), &Claim::Fresh) {
        Err(TrainError::RunDirTaken { .. }) => {}
        other => panic!("expected the directory refused, got {other:?}"),
    }
    let after: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(before, after);
    // A lock that was there before the claim stays.
    std::fs::write(dir.path().join(".snug.lock"), b"").unwrap();
    assert!(RunDir::claim(dir.path(), &Claim::Fresh).is_err());
    assert!(dir.path().join(".snug.lock").exists());
}

/// Text the run's tokenizer cannot encode is an error naming the file, the tokenizer and the
/// first character at fault.
#[test]
fn data_the_tokenizer_cannot_encode_names_the_file_and_the_character() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("text.txt");
    std::fs::write(&path, "12+3=15\n7+1=8\nhello").unwrap();
    let addition = TokenDataset::load(&DataSource::Addition).unwrap().tokenizer;
    match TokenDataset::from_file_with(&path, addition) {
        Err(e @ TrainError::DataEncoding { .. }) => {
            let text = e.to_string();
            assert!(text.contains(&path.display().to_string()), "{text}");
            assert!(text.contains("'h' (U+0068, at byte 14)"), "{text}");
        }
        other => panic!("expected a named encoding error, got {other:?}"),
    }
}

/// A resume on data that changed since the run saved (the corpus rewritten in place, same
/// characters) is refused, naming it; named again (`--data`), it trains on the data as it is.
#[test]
fn a_resume_on_changed_data_is_refused_unless_the_data_is_named_again() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(
        &corpus,
        "to be or not to be, that is the question\n".repeat(40),
    )
    .unwrap();
    let model = ModelSection {
        preset: Some("tiny".into()),
        ..Default::default()
    };
    let train = TrainSection {
        data: Some(corpus.clone()),
        steps: Some(4),
        batch: Some(2),
        block: Some(8),
        threads: Some(1),
        warmup_steps: Some(1),
        ..Default::default()
    };
    let mut cfg = TrainConfig::resolve(None, &model, &train).unwrap();
    let (data, _) = cfg.load_data_and_model().unwrap();
    let mut t = Trainer::new(cfg, data).unwrap();
    t.train_step().unwrap();
    let mut ckpt = t.checkpoint().unwrap();
    assert!(ckpt.config.data_crc32.is_some());
    // Unchanged, it resumes.
    let (data, _) = ckpt.config.load_data_and_model().unwrap();
    Trainer::resume(ckpt.config.clone(), data, Allocator::default(), &ckpt).unwrap();
    // Rewritten with the same characters in another order.
    std::fs::write(
        &corpus,
        "that is the question, to be or not to be\n".repeat(40),
    )
    .unwrap();
    let (data, _) = ckpt.config.load_data_and_model().unwrap();
    match Trainer::resume(ckpt.config.clone(), data, Allocator::default(), &ckpt) {
        Err(e @ TrainError::DataChanged { .. }) => {
            assert!(e.to_string().contains("corpus.txt"), "{e}")
        }
        other => panic!(
            "expected the changed data refused, got {:?}",
            other.map(|_| ())
        ),
    }
    let again = TrainSection {
        data: Some(corpus),
        ..Default::default()
    };
    let mut cfg =
        TrainConfig::resolve_resumed(ckpt.config.clone(), None, &ModelSection::default(), &again)
            .unwrap();
    let (data, _) = cfg.load_data_and_model().unwrap();
    let mut t = Trainer::resume(cfg, data, Allocator::default(), &ckpt).unwrap();
    assert_eq!(t.train_step().unwrap().step, 2);
}
