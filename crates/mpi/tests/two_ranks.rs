//! Two ranks under `mpirun` train what one process does with accumulation 2, in every ZeRO
//! stage, each rank at its planned peak. The test launches this same test binary under
//! `mpirun -np 2`, running only [`rank_worker`] (ignored otherwise); each rank writes what it
//! trained to a file the launching test compares with a run of its own.
//!
//! Skipped, with the reason printed, when snug-mpi was built without its `mpi` feature or
//! `mpirun` is missing (a failure under `SNUG_REQUIRE_ALL_TESTS=1`, as in CI).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use snug_train::{DataSource, ModelSection, TokenDataset, TrainConfig, TrainSection, Trainer};

const STEPS: u64 = 5;
/// Where a worker rank writes its results (set by the launching test).
const OUT_VAR: &str = "SNUG_MPI_TEST_OUT";

fn config(devices: usize, shard: u8, accumulation: usize) -> TrainConfig {
    let model = ModelSection {
        preset: Some("tiny".into()),
        // Six blocks: 76 parameters, so a collective over every one (the squared norms under
        // stages 1-3) has more outputs than a kernel's bitmask of 64 buffers.
        n_layer: Some(6),
        ..Default::default()
    };
    let train = TrainSection {
        steps: Some(STEPS),
        batch: Some(4),
        block: Some(16),
        threads: Some(1),
        warmup_steps: Some(2),
        accumulation: Some(accumulation),
        eval_batches: Some(2),
        devices: Some(devices),
        shard: Some(shard),
        ..Default::default()
    };
    TrainConfig::resolve(None, &model, &train).expect("a valid configuration")
}

/// What a run trained: its losses, its weights by name, and its measured and planned peaks.
fn train(cfg: TrainConfig) -> serde_json::Value {
    let data = TokenDataset::load(&DataSource::Addition).expect("the built-in data");
    let mut t = Trainer::new(cfg, data).expect("a trainer");
    let mut losses = Vec::new();
    let mut measured = 0;
    for _ in 0..STEPS {
        let s = t.train_step().expect("a step");
        losses.push(s.loss);
        measured = measured.max(s.peak_bytes);
    }
    let weights: BTreeMap<String, Vec<f32>> =
        t.parameters().expect("the weights").into_iter().collect();
    serde_json::json!({
        "losses": losses,
        "weights": weights,
        "measured_peak": measured,
        "planned_peak": t.plan().peak_bytes(),
    })
}

/// One rank of the launched job: every stage in turn, results written per rank.
#[test]
#[ignore = "run by `mpirun` from two_ranks_train_what_one_process_does"]
fn rank_worker() {
    let Some(out) = std::env::var_os(OUT_VAR) else {
        return;
    };
    let _mpi = snug_mpi::init().expect("MPI starts");
    let (rank, ranks) = snug_cpu_world();
    assert_eq!(ranks, 2, "launched as two ranks");
    for stage in 0..=3u8 {
        let result = train(config(2, stage, 1));
        let path = Path::new(&out).join(format!("stage{stage}-rank{rank}.json"));
        std::fs::write(&path, result.to_string()).expect("the result file is written");
    }
}

fn snug_cpu_world() -> (usize, usize) {
    snug_mpi::world()
}

/// `mpirun`'s command for `np` ranks, or the reason this test cannot run.
pub fn mpirun(np: usize) -> Result<Command, String> {
    if !cfg!(feature = "mpi") {
        return Err(
            "snug-mpi was built without its `mpi` feature (cargo test --features mpi)".into(),
        );
    }
    let found = Command::new("mpirun").arg("--version").output();
    if !found.is_ok_and(|o| o.status.success()) {
        return Err(
            "`mpirun` is not on PATH (Debian: apt-get install openmpi-bin libopenmpi-dev)".into(),
        );
    }
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "-np",
        &np.to_string(),
        "--bind-to",
        "none",
        "--oversubscribe",
    ])
    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    Ok(cmd)
}

#[test]
fn two_ranks_train_what_one_process_does() {
    let mut cmd = match mpirun(2) {
        Ok(c) => c,
        Err(reason) => return snug_testkit::skip_or_fail(&reason),
    };
    let dir = tempfile::tempdir().expect("a scratch directory");
    let exe = std::env::current_exe().expect("this test binary");
    let out = cmd
        .arg(exe)
        .args(["--exact", "rank_worker", "--ignored", "--test-threads", "1"])
        .env(OUT_VAR, dir.path())
        .output()
        .expect("mpirun runs");
    assert!(
        out.status.success(),
        "mpirun: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let read = |stage: u8, rank: usize| -> serde_json::Value {
        let path = dir.path().join(format!("stage{stage}-rank{rank}.json"));
        let text = std::fs::read_to_string(&path).expect("a rank's result");
        serde_json::from_str(&text).expect("a rank's JSON")
    };
    // One process, the same batch of 4 in 2 micro-batches of 2.
    let single = train(config(1, 0, 2));
    let weights = |v: &serde_json::Value| -> BTreeMap<String, Vec<f32>> {
        serde_json::from_value(v["weights"].clone()).expect("weights by name")
    };
    let single_weights = weights(&single);
    let stage1 = weights(&read(1, 0));
    for stage in 0..=3u8 {
        for rank in 0..2 {
            let r = read(stage, rank);
            assert_eq!(
                r["measured_peak"], r["planned_peak"],
                "stage {stage}, rank {rank}: measured peak == planned"
            );
            // The step's loss is the mean of the micro-batch losses, summed in one process's
            // order; the weights they ran on differ in their last bits (below), so within
            // 1e-6 relative.
            let losses: Vec<f32> = serde_json::from_value(r["losses"].clone()).unwrap();
            let single_losses: Vec<f32> = serde_json::from_value(single["losses"].clone()).unwrap();
            for (a, b) in losses.iter().zip(&single_losses) {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs(),
                    "stage {stage}, rank {rank}: losses {losses:?} against {single_losses:?}"
                );
            }
            let w = weights(&r);

            assert_eq!(
                w.len(),
                single_weights.len(),
                "stage {stage}: parameter count"
            );
            for (name, s) in &single_weights {
                let worst = |other: &[f32]| {
                    w[name]
                        .iter()
                        .zip(other)
                        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
                };
                if stage == 0 {
                    // One process adds the second micro-batch's gradient into the first's
                    // inside the backward's matrix products; two ranks add whole gradients:
                    // the sums round differently, so within 1e-6 of the tensor's largest value.
                    let scale = s.iter().fold(0f32, |m, x| m.max(x.abs()));
                    assert!(
                        worst(s) <= 1e-6 * scale,
                        "stage 0, rank {rank}: `{name}` differs by {} (largest value {scale})",
                        worst(s)
                    );
                } else {
                    // Stages 1-3 sum the gradient norm's squares shard by shard, then over the
                    // ranks: the clipping factor can differ in its last bit. Adam turns that
                    // into differences of up to lr·|g|/eps where a gradient is rounding noise
                    // around zero (the attention's key bias, whose true gradient is 0), so
                    // every element within 1e-6 absolutely (about 3e-4 of the learning rate).
                    assert!(
                        worst(s) <= 1e-6,
                        "stage {stage}, rank {rank}: `{name}` differs by {}",
                        worst(s)
                    );
                    // Stages 1-3 compute the same step: the same weights exactly.
                    assert_eq!(
                        &w[name], &stage1[name],
                        "stage {stage}, rank {rank}: `{name}` vs stage 1"
                    );
                }
            }
        }
    }
    // Sharding lowers each rank's peak, stage by stage (the tiny model has no accumulation
    // here, so stages 1 and 2 hold the same).
    let peak = |stage| read(stage, 0)["planned_peak"].as_u64().unwrap();
    assert!(peak(1) < peak(0), "stage 1 below stage 0");
    assert!(peak(2) <= peak(1), "stage 2 not above stage 1");
    assert!(peak(3) < peak(2), "stage 3 below stage 2");
}
