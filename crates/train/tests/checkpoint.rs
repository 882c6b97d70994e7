//! Checkpoints: bit-exact resume, atomic writes that survive a crash, pruning, evaluation that
//! leaves training untouched, and named errors for bad files.

use std::sync::atomic::AtomicBool;

use snug_runtime::Allocator;
use snug_train::checkpoint::{Checkpoint, CheckpointDir};
use snug_train::{
    DataSource, ModelSection, TokenDataset, TrainConfig, TrainError, TrainSection, Trainer,
};

fn config(steps: u64, accumulation: usize) -> TrainConfig {
    let model = ModelSection {
        preset: Some("tiny".into()),
        ..Default::default()
    };
    let train = TrainSection {
        steps: Some(steps),
        batch: Some(4),
        block: Some(16),
        threads: Some(1),
        warmup_steps: Some(2),
        accumulation: Some(accumulation),
        eval_batches: Some(2),
        ..Default::default()
    };
    TrainConfig::resolve(None, &model, &train).unwrap()
}

fn trainer(cfg: &TrainConfig) -> Trainer {
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    Trainer::new(cfg.clone(), data).unwrap()
}

fn losses(t: &mut Trainer, n: usize) -> Vec<f32> {
    (0..n).map(|_| t.train_step().unwrap().loss).collect()
}

/// Train 2N steps straight, or N, save, load in a fresh trainer, and N more: the same losses,
/// bit for bit (with and without gradient accumulation).
#[test]
fn resume_continues_bit_exactly() {
    for accumulation in [1, 2] {
        let cfg = config(8, accumulation);
        let straight = losses(&mut trainer(&cfg), 8);

        let dir = tempfile::tempdir().unwrap();
        let ckpt_dir = CheckpointDir::create(dir.path()).unwrap();
        let mut first = trainer(&cfg);
        let mut resumed_losses = losses(&mut first, 4);
        ckpt_dir.save(&first.checkpoint().unwrap(), 3).unwrap();
        drop(first);

        let (_, ckpt) = ckpt_dir.load_latest().unwrap();
        assert_eq!(ckpt.step, 4);
        let data = TokenDataset::load(&DataSource::Addition).unwrap();
        let mut second =
            Trainer::resume(ckpt.config.clone(), data, Allocator::default(), &ckpt).unwrap();
        assert_eq!(second.steps_done(), 4);
        resumed_losses.extend(losses(&mut second, 4));
        assert_eq!(straight, resumed_losses, "accumulation {accumulation}");
    }
}

/// A crash after the temporary file is written but before the rename leaves the previous
/// checkpoint as the one that loads; so does a damaged file under a checkpoint's name.
#[test]
fn interrupted_write_leaves_the_previous_checkpoint_loadable() {
    let cfg = config(6, 1);
    let dir = tempfile::tempdir().unwrap();
    let ckpt_dir = CheckpointDir::create(dir.path()).unwrap();
    let mut t = trainer(&cfg);
    losses(&mut t, 2);
    let saved = t.checkpoint().unwrap();
    ckpt_dir.save(&saved, 3).unwrap();

    losses(&mut t, 2);
    let pending = t
        .checkpoint()
        .unwrap()
        .write_pending(&ckpt_dir.path_for(4))
        .unwrap();
    assert!(pending.temp_path().exists());
    drop(pending); // the process "dies" here: no rename

    let (path, loaded) = ckpt_dir.load_latest().unwrap();
    assert_eq!(path, ckpt_dir.path_for(2));
    assert_eq!(loaded.step, 2);
    for t in &saved.tensors {
        assert_eq!(loaded.tensor(&t.name).unwrap(), t, "{}", t.name);
    }

    // A truncated newer file is skipped in favour of the last good one.
    let good = std::fs::read(ckpt_dir.path_for(2)).unwrap();
    std::fs::write(ckpt_dir.path_for(5), &good[..good.len() / 2]).unwrap();
    assert_eq!(ckpt_dir.load_latest().unwrap().1.step, 2);
    assert!(matches!(
        Checkpoint::load(&ckpt_dir.path_for(5)),
        Err(TrainError::Checkpoint { path, .. }) if path == ckpt_dir.path_for(5)
    ));

    // The next save clears the stale temporary file, and no other file that merely looks
    // like one: a user's `.ckpt-notes.tmp` is not a save's.
    let users = dir.path().join(".ckpt-notes.tmp");
    std::fs::write(&users, b"mine").unwrap();
    ckpt_dir.save(&t.checkpoint().unwrap(), 3).unwrap();
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .map(|e| e.path())
        .collect();
    assert_eq!(leftovers, [users]);
}

#[test]
fn only_the_newest_checkpoints_are_kept() {
    let cfg = config(10, 1);
    let dir = tempfile::tempdir().unwrap();
    let ckpt_dir = CheckpointDir::create(dir.path()).unwrap();
    let mut t = trainer(&cfg);
    for _ in 0..4 {
        t.train_step().unwrap();
        ckpt_dir.save(&t.checkpoint().unwrap(), 2).unwrap();
    }
    let steps: Vec<u64> = ckpt_dir
        .list()
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, vec![3, 4]);
}

/// Evaluating between steps runs the forward pass only: training continues bit-identically,
/// and evaluation itself is repeatable.
#[test]
fn evaluation_leaves_training_untouched() {
    let cfg = config(4, 1);
    let plain = losses(&mut trainer(&cfg), 4);
    let mut t = trainer(&cfg);
    let mut with_eval = Vec::new();
    for _ in 0..4 {
        with_eval.push(t.train_step().unwrap().loss);
        let a = t.evaluate().unwrap();
        let b = t.evaluate().unwrap();
        assert_eq!((a.train_loss, a.val_loss), (b.train_loss, b.val_loss));
        assert!(a.val_loss.is_finite() && a.val_loss > 0.0);
    }
    assert_eq!(plain, with_eval);
}

/// The loop saves on request to stop, after finishing the step in flight.
#[test]
fn a_stop_request_saves_and_returns() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(50, 1);
    cfg.out = Some(dir.path().to_path_buf());
    cfg.eval_every = 0;
    let mut t = trainer(&cfg);
    let stop = AtomicBool::new(false);
    let summary = snug_train::run(&mut t, None, &stop, |e| {
        if let snug_train::Event::Step(s) = e {
            if s.step == 3 {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
    })
    .unwrap();
    assert!(summary.interrupted);
    assert_eq!(summary.end_step, 3);
    let (_, ckpt) = CheckpointDir::open(dir.path())
        .unwrap()
        .load_latest()
        .unwrap();
    assert_eq!(ckpt.step, 3);
    let lines = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 3);
}

#[test]
fn bad_checkpoints_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("ckpt-00000001.safetensors");
    std::fs::write(&garbage, b"not a checkpoint at all").unwrap();
    let err = Checkpoint::load(&garbage).unwrap_err();
    assert!(
        matches!(&err, TrainError::Checkpoint { path, .. } if *path == garbage),
        "{err}"
    );

    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(
        CheckpointDir::open(empty.path()).unwrap().load_latest(),
        Err(TrainError::NoCheckpoint { .. })
    ));
    assert!(matches!(
        CheckpointDir::open(&empty.path().join("missing")),
        Err(TrainError::NoCheckpoint { .. })
    ));

    // A checkpoint of another model does not load into this one: the tensor is named.
    let cfg = config(2, 1);
    let mut ckpt = trainer(&cfg).checkpoint().unwrap();
    let wte = ckpt
        .tensors
        .iter_mut()
        .find(|t| t.name == "wte.weight")
        .unwrap();
    wte.shape[0] += 1;
    wte.data.extend(vec![0.0; wte.shape[1]]);
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    let err = Trainer::resume(cfg.clone(), data, Allocator::default(), &ckpt)
        .err()
        .unwrap();
    assert!(err.to_string().contains("wte.weight"), "{err}");
    // Of a checkpoint read whole, it says what is wrong and leaves the file to the caller.
    assert!(
        matches!(&err, TrainError::CheckpointMismatch { .. }),
        "{err:?}"
    );
    assert!(!err.to_string().contains('<'), "{err}");

    // A checkpoint renamed to another step is refused by both steps, and a run directory
    // resumes from the newest that is what its name says.
    let saved = tempfile::tempdir().unwrap();
    let ckpt_dir = CheckpointDir::create(saved.path()).unwrap();
    let mut t = trainer(&cfg);
    t.train_step().unwrap();
    let one = ckpt_dir.save(&t.checkpoint().unwrap(), 5).unwrap();
    let renamed = ckpt_dir.path_for(9);
    std::fs::copy(&one, &renamed).unwrap();
    let err = Checkpoint::load(&renamed).unwrap_err();
    assert!(
        matches!(&err, TrainError::Checkpoint { path, detail }
            if *path == renamed && detail.contains("step 1") && detail.contains("step 9")),
        "{err}"
    );
    let (path, latest) = ckpt_dir.load_latest().unwrap();
    assert_eq!((path, latest.step), (one.clone(), 1));
    // Under a name of another form, the contents alone say the step.
    let plain = saved.path().join("weights.safetensors");
    std::fs::copy(&one, &plain).unwrap();
    assert_eq!(Checkpoint::load(&plain).unwrap().step, 1);

    // Optimizer state for another optimizer is refused, not silently dropped.
    let mut ckpt = trainer(&cfg).checkpoint().unwrap();
    ckpt.tensors.retain(|t| !t.name.ends_with(".adam_v"));
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    let err = Trainer::resume(cfg, data, Allocator::default(), &ckpt)
        .err()
        .unwrap();
    assert!(err.to_string().contains("adam_v"), "{err}");
}

/// A checkpoint whose saved configuration predates newer keys still loads: they take their
/// defaults.
#[test]
fn checkpoints_from_before_newer_config_keys_load() {
    let cfg = config(2, 1);
    let ckpt = trainer(&cfg).checkpoint().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt-00000000.safetensors");
    ckpt.save(&path).unwrap();
    // Rewrite the file with `passes` and `remat` removed from the saved configuration.
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&meta["config"]).unwrap();
    let obj = config.as_object_mut().unwrap();
    assert!(obj.remove("passes").is_some() && obj.remove("remat").is_some());
    meta.insert("config".into(), config.to_string());
    let tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = st.tensors();
    safetensors::serialize_to_file(tensors, Some(meta), &path).unwrap();
    let loaded = Checkpoint::load(&path).unwrap();
    assert_eq!(loaded.config, ckpt.config);
}
