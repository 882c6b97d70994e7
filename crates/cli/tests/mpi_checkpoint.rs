//! Sharded checkpoints of `mpirun -np 2 snug train --shard S`: each rank writes its shard and
//! rank 0 the manifest; resuming on two ranks is bit-exact at every stage; one process continues
//! a sharded run and two ranks a single process's, from the consolidated tensors, bit for bit
//! (the micro-batch kept, the accumulation scaled); `snug export`
//! consolidates; 8-bit AdamW's per-shard state resumes on as many ranks, and elsewhere is a
//! named error; a damaged or missing shard is an error naming its file; and a rank killed
//! mid-run leaves the last complete checkpoint to resume from.
//!
//! Skipped, with the reason printed, when snug was built without the `mpi` feature or `mpirun`
//! is missing (a failure under `SNUG_REQUIRE_ALL_TESTS=1`, as in CI).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use snug_train::checkpoint;
use snug_train::TrainError;

#[cfg(target_os = "linux")]
use common::mpi::ranks_of;
use common::mpi::{self, lines, mpirun, refused, text, two_ranks};

/// The tiny model on the built-in data, 5 steps of a batch of 4, one thread.
const RUN: [&str; 16] = mpi::run("0");

fn losses(o: &Output) -> Vec<f64> {
    lines(o, "step")
        .iter()
        .map(|l| l["loss"].as_f64().expect("a loss"))
        .collect()
}

fn manifest_of(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("ckpt-{step:08}.manifest.json"))
}

fn manifest(dir: &Path, step: u64) -> serde_json::Value {
    let text = std::fs::read_to_string(manifest_of(dir, step)).expect("the manifest");
    serde_json::from_str(&text).expect("a JSON manifest")
}

/// The shard files the manifest of `step` names.
fn shard_files(dir: &Path, step: u64) -> Vec<PathBuf> {
    manifest(dir, step)["shards"]
        .as_array()
        .expect("shards")
        .iter()
        .map(|s| dir.join(s["file"].as_str().expect("a file name")))
        .collect()
}

/// Copies the sharded checkpoint of `step` (manifest and shards) into `to`, a new directory.
fn copy_sharded(from: &Path, to: &Path, step: u64) {
    std::fs::create_dir_all(to).unwrap();
    for f in shard_files(from, step)
        .into_iter()
        .chain([manifest_of(from, step)])
    {
        std::fs::copy(&f, to.join(f.file_name().unwrap())).expect("a checkpoint file");
    }
}

/// Every tensor of the checkpoint at `path` (parameters and optimizer state), as bits.
fn state(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<u32>)> {
    let (_, c) = checkpoint::load(path).expect("a checkpoint that loads");
    assert!(
        c.per_rank.is_none(),
        "AdamW's state is all whole or sharded"
    );
    c.tensors
        .into_iter()
        .map(|t| {
            (
                t.name,
                (t.shape, t.data.iter().map(|v| v.to_bits()).collect()),
            )
        })
        .collect()
}

#[test]
fn sharded_checkpoints_resume_bit_exact_on_two_ranks_at_every_stage() {
    if let Err(reason) = mpirun() {
        return snug_testkit::skip_or_fail(&reason);
    }
    let dir = tempfile::tempdir().expect("a scratch directory");
    // One process's checkpoint names every tensor with its whole shape.
    let one = dir.path().join("one");
    common::ok(
        dir.path(),
        &[&RUN[..], &["--out", one.to_str().unwrap()]].concat(),
    );
    let whole_shapes: BTreeMap<String, Vec<usize>> =
        state(&one).into_iter().map(|(n, (s, _))| (n, s)).collect();
    let mut finals = Vec::new();
    for stage in ["1", "2", "3"] {
        let straight = dir.path().join(format!("straight-{stage}"));
        let resumed = dir.path().join(format!("resumed-{stage}"));
        let all = two_ranks(
            dir.path(),
            &[
                &RUN[..],
                &[
                    "--shard",
                    stage,
                    "--out",
                    straight.to_str().unwrap(),
                    "--checkpoint-every",
                    "3",
                ],
            ]
            .concat(),
        );
        // The manifest: world, stage, step, whole shapes, and each rank's file as written.
        let m = manifest(&straight, 3);
        assert_eq!(m["format"], "snug-sharded-checkpoint");
        assert_eq!(
            (m["ranks"].as_u64(), m["step"].as_u64()),
            (Some(2), Some(3))
        );
        assert_eq!(m["stage"].to_string(), stage);
        let listed: BTreeMap<String, Vec<usize>> = m["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                let shape = t["shape"].as_array().unwrap();
                let shape = shape.iter().map(|d| d.as_u64().unwrap() as usize);
                (t["name"].as_str().unwrap().to_string(), shape.collect())
            })
            .collect();
        assert_eq!(listed, whole_shapes, "stage {stage}: the whole shapes");
        for (rank, s) in m["shards"].as_array().unwrap().iter().enumerate() {
            let file = straight.join(s["file"].as_str().unwrap());
            assert_eq!(s["rank"].as_u64(), Some(rank as u64));
            assert_eq!(
                Some(std::fs::metadata(&file).unwrap().len()),
                s["bytes"].as_u64()
            );
        }
        // The third step's checkpoint alone in a run directory, resumed to the end.
        copy_sharded(&straight, &resumed, 3);
        let rest = two_ranks(
            dir.path(),
            &["train", "--resume", resumed.to_str().unwrap(), "--json"],
        );
        assert_eq!(
            losses(&all)[3..],
            losses(&rest)[..],
            "stage {stage}: steps 4, 5"
        );
        let end = state(&straight);
        assert_eq!(
            end,
            state(&resumed),
            "stage {stage}: the state after step 5"
        );
        finals.push(end);
    }
    // Stages 1–3 train the same weights and moments: stage 3's consolidated parameter shards
    // are stage 1's whole parameters, bit for bit.
    assert_eq!(finals[0], finals[1], "stages 1 and 2");
    assert_eq!(finals[0], finals[2], "stages 1 and 3");
}

#[test]
fn eight_bit_adamw_state_is_held_per_rank_and_resumes_on_as_many_ranks() {
    if let Err(reason) = mpirun() {
        return snug_testkit::skip_or_fail(&reason);
    }
    let dir = tempfile::tempdir().expect("a scratch directory");
    let (straight, resumed, one) = (
        dir.path().join("straight"),
        dir.path().join("resumed"),
        dir.path().join("one"),
    );
    let all = two_ranks(
        dir.path(),
        &[
            &RUN[..],
            &[
                "--shard",
                "3",
                "--optimizer",
                "adamw8bit",
                "--checkpoint-every",
                "3",
            ],
            &["--out", straight.to_str().unwrap()],
        ]
        .concat(),
    );
    // Its codes and block scales are quantized per shard: each rank's own.
    let m = manifest(&straight, 3);
    let per_rank = |dtype: &str| {
        m["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["layout"] == "per_rank" && t["dtype"] == dtype)
    };
    assert!(per_rank("U8") && per_rank("F32"));
    copy_sharded(&straight, &resumed, 3);
    let rest = two_ranks(
        dir.path(),
        &["train", "--resume", resumed.to_str().unwrap(), "--json"],
    );
    assert_eq!(losses(&all)[3..], losses(&rest)[..], "steps 4, 5");
    let (_, a) = checkpoint::load(&straight).unwrap();
    let (_, b) = checkpoint::load(&resumed).unwrap();
    assert_eq!(a.step, 5);
    assert_eq!((&a.tensors, &a.per_rank), (&b.tensors, &b.per_rank));
    // One process cannot divide them otherwise: a named error, saying how to resume.
    copy_sharded(&straight, &one, 3);
    common::fails_with(
        dir.path(),
        &["train", "--resume", one.to_str().unwrap()],
        &["adam8_m", "per rank", "resume on 2 ranks with --shard 3"],
    );
}

#[test]
fn one_process_continues_a_sharded_run_and_exports_it_as_stage_0() {
    if let Err(reason) = mpirun() {
        return snug_testkit::skip_or_fail(&reason);
    }
    let dir = tempfile::tempdir().expect("a scratch directory");
    let (two, one, whole) = (
        dir.path().join("two"),
        dir.path().join("one"),
        dir.path().join("whole"),
    );
    let all = two_ranks(
        dir.path(),
        &[
            &RUN[..],
            &[
                "--shard",
                "3",
                "--out",
                two.to_str().unwrap(),
                "--checkpoint-every",
                "3",
            ],
        ]
        .concat(),
    );
    // Step 3 in one process (unsharded), in its own directory: nothing left to train, so
    // nothing is written there. Into another directory it is saved at once, whole: its
    // state is the consolidated shards', bit for bit.
    copy_sharded(&two, &one, 3);
    let whole3 = dir.path().join("whole3");
    common::ok(
        dir.path(),
        &["train", "--resume", one.to_str().unwrap(), "--steps", "3"],
    );
    assert!(manifest_of(&one, 3).is_file());
    assert!(!one.join("ckpt-00000003.safetensors").exists());
    common::ok(
        dir.path(),
        &[
            "train",
            "--resume",
            one.to_str().unwrap(),
            "--steps",
            "3",
            "--out",
            whole3.to_str().unwrap(),
        ],
    );
    assert!(whole3.join("ckpt-00000003.safetensors").is_file());
    assert_eq!(state(&whole3), state(&manifest_of(&two, 3)));
    // Steps 4 and 5 in one process, which kept the ranks' micro-batch by accumulating two:
    // the same micro-batches summed in the same order, so bit for bit.
    let rest = common::ok(
        dir.path(),
        &[
            "train",
            "--resume",
            one.to_str().unwrap(),
            "--steps",
            "5",
            "--json",
        ],
    );
    let said = text(&rest.stderr);
    assert!(said.contains("accumulating 2 a step"), "{said}");
    assert_eq!(&losses(&all)[3..], &losses(&rest)[..]);

    // The sharded step 5 exported, and the same weights as one process's whole checkpoint
    // exported: the same files.
    common::ok(
        dir.path(),
        &[
            "train",
            "--resume",
            manifest_of(&two, 5).to_str().unwrap(),
            "--out",
            whole.to_str().unwrap(),
        ],
    );
    let (ea, eb) = (dir.path().join("export-a"), dir.path().join("export-b"));
    let exported = common::ok(
        dir.path(),
        &[
            "export",
            "--checkpoint",
            two.to_str().unwrap(),
            "--out",
            ea.to_str().unwrap(),
            "--json",
        ],
    );
    assert!(text(&exported.stdout).contains("\"step\":5"));
    common::ok(
        dir.path(),
        &[
            "export",
            "--checkpoint",
            whole.to_str().unwrap(),
            "--out",
            eb.to_str().unwrap(),
        ],
    );
    for f in ["model.safetensors", "config.json"] {
        let (a, b) = (std::fs::read(ea.join(f)), std::fs::read(eb.join(f)));
        assert_eq!(a.expect("exported"), b.expect("exported"), "{f}");
    }
}

#[test]
fn two_ranks_continue_a_single_process_run_sharded() {
    if let Err(reason) = mpirun() {
        return snug_testkit::skip_or_fail(&reason);
    }
    let dir = tempfile::tempdir().expect("a scratch directory");
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    let single = common::ok(
        dir.path(),
        &[
            &RUN[..],
            &[
                "--accumulation",
                "2",
                "--out",
                one.to_str().unwrap(),
                "--checkpoint-every",
                "3",
            ],
        ]
        .concat(),
    );
    let name = "ckpt-00000003.safetensors";
    // On two ranks at stage 3, saved at once into another directory (a resume at its last
    // step writes nothing into its own): each rank's shards of the whole tensors, which
    // consolidate to them bit for bit; the whole file is left as it was.
    let before = std::fs::read(one.join(name)).expect("the step-3 checkpoint");
    two_ranks(
        dir.path(),
        &[
            "train",
            "--resume",
            one.join(name).to_str().unwrap(),
            "--out",
            two.to_str().unwrap(),
            "--shard",
            "3",
            "--steps",
            "3",
        ],
    );
    assert!(manifest_of(&two, 3).is_file());
    assert_eq!(std::fs::read(one.join(name)).unwrap(), before);
    assert_eq!(state(&two), state(&one.join(name)));
    // Steps 4 and 5 on the two ranks (stage 3, kept from the checkpoint), each a micro-batch
    // of the single process's two: bit for bit.
    let rest = two_ranks(
        dir.path(),
        &[
            "train",
            "--resume",
            two.to_str().unwrap(),
            "--steps",
            "5",
            "--json",
        ],
    );
    assert_eq!(&losses(&single)[3..], &losses(&rest)[..]);
    assert_eq!(manifest(&two, 5)["stage"], 3);
}

#[test]
fn a_damaged_or_missing_shard_is_named_and_the_previous_checkpoint_loads() {
    if let Err(reason) = mpirun() {
        return snug_testkit::skip_or_fail(&reason);
    }
    let dir = tempfile::tempdir().expect("a scratch directory");
    let run = dir.path().join("run");
    two_ranks(
        dir.path(),
        &[
            &RUN[..],
            &[
                "--shard",
                "2",
                "--steps",
                "4",
                "--out",
                run.to_str().unwrap(),
                "--checkpoint-every",
                "2",
            ],
        ]
        .concat(),
    );
    let (m2, m4) = (manifest_of(&run, 2), manifest_of(&run, 4));
    let shards = shard_files(&run, 4);
    assert_eq!(shards.len(), 2);
    // A shard file alone is no checkpoint: the error says to load its manifest.
    let err = checkpoint::load(&shards[0]).unwrap_err();
    assert!(
        matches!(&err, TrainError::Checkpoint { path, detail } if path == &shards[0] && detail.contains("manifest")),
        "{err:?}"
    );
    // One flipped bit in rank 1's shard: the error names that file.
    let mut bytes = std::fs::read(&shards[1]).unwrap();
    let original = bytes.clone();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x10;
    std::fs::write(&shards[1], &bytes).unwrap();
    let err = checkpoint::load(&m4).unwrap_err();
    assert!(
        matches!(&err, TrainError::Checkpoint { path, detail } if path == &shards[1] && detail.contains("damaged")),
        "{err:?}"
    );
    // The run directory's newest loadable checkpoint is step 2's.
    let (path, ckpt) = checkpoint::load(&run).expect("step 2 loads");
    assert_eq!((path, ckpt.step), (m2.clone(), 2));
    // `snug export` of the damaged checkpoint names the file, and writes nothing.
    let out = dir.path().join("export");
    let file_name = shards[1].file_name().unwrap().to_str().unwrap();
    common::fails_with(
        dir.path(),
        &[
            "export",
            "--checkpoint",
            m4.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        &[file_name, "damaged"],
    );
    assert!(!out.exists());
    // Truncated, then missing: named too.
    std::fs::write(&shards[1], &original[..original.len() / 2]).unwrap();
    let err = checkpoint::load(&m4).unwrap_err();
    assert!(
        matches!(&err, TrainError::Checkpoint { path, detail } if path == &shards[1] && detail.contains("truncated")),
        "{err:?}"
    );
    std::fs::write(&shards[1], &original).unwrap();
    assert_eq!(checkpoint::load(&m4).expect("whole again").1.step, 4);
    std::fs::remove_file(&shards[0]).unwrap();
    let err = checkpoint::load(&m4).unwrap_err();
    assert!(
        matches!(&err, TrainError::Checkpoint { path, detail } if path == &shards[0] && detail.contains("missing")),
        "{err:?}"
    );
    // Resumed in its own directory, the run continues from step 2; step 4's manifest and its
    // remaining shard are moved aside, kept, not deleted.
    let rest = two_ranks(
        dir.path(),
        &[
            "train",
            "--resume",
            run.to_str().unwrap(),
            "--steps",
            "3",
            "--json",
        ],
    );
    assert_eq!(lines(&rest, "summary")[0]["start_step"], 2);
    assert!(run.join("ckpt-00000004.manifest.json.damaged").is_file());
    let mut aside = shards[1].as_os_str().to_owned();
    aside.push(".damaged");
    assert_eq!(std::fs::read(PathBuf::from(aside)).unwrap(), original);
    assert_eq!(checkpoint::load(&run).expect("step 3").1.step, 3);
}

#[cfg(target_os = "linux")]
#[test]
fn a_rank_killed_mid_run_leaves_the_last_complete_checkpoint_to_resume() {
    let mut cmd = match mpirun() {
        Ok(c) => c,
        Err(reason) => return snug_testkit::skip_or_fail(&reason),
    };
    let dir = tempfile::tempdir().expect("a scratch directory");
    let run = dir.path().join("run");
    // A checkpoint every step, so rank 1 dies during a save as likely as not. Output goes to
    // files: a full pipe nobody reads would stall mpirun.
    let log = dir.path().join("stderr.txt");
    let mut child = cmd
        .args(["-np", "2", env!("CARGO_BIN_EXE_snug")])
        .args(RUN)
        .args([
            "--steps",
            "100000",
            "--shard",
            "1",
            "--checkpoint-every",
            "1",
        ])
        .args(["--keep-checkpoints", "2", "--out", run.to_str().unwrap()])
        .current_dir(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("a log file"))
        .spawn()
        .expect("mpirun starts");
    let start = Instant::now();
    let victim = loop {
        let ranks = ranks_of(child.id());
        let saved = checkpoint::CheckpointDir::open(&run)
            .and_then(|d| d.list())
            .map_or(0, |l| l.len());
        if ranks.len() == 2 && saved >= 2 {
            break ranks.into_iter().find(|&(_, r)| r == 1).map(|(pid, _)| pid);
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("no two checkpoints in 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let victim = victim.expect("rank 1's process");
    // SAFETY: signalling a process this test started (a child of its mpirun).
    unsafe {
        libc::kill(victim as i32, libc::SIGKILL);
    }
    let killed = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("mpirun's status") {
            break s;
        }
        if killed.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("the job still runs 30 s after rank 1 was killed");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success());
    // The newest complete checkpoint loads; an unfinished save's shards are no checkpoint.
    let (_, ckpt) = checkpoint::load(&run).expect("the last complete checkpoint");
    let k = ckpt.step;
    assert!(k >= 1);
    let orphan = run.join(format!(
        "ckpt-{:08}.0000abcd.shard-1-of-2.safetensors",
        k + 1
    ));
    std::fs::write(&orphan, b"half a shard").unwrap();
    assert_eq!(checkpoint::load(&run).unwrap().1.step, k);
    // Two ranks continue from it; their first save clears what the dead run left unfinished.
    let steps = (k + 2).to_string();
    let rest = two_ranks(
        dir.path(),
        &[
            "train",
            "--resume",
            run.to_str().unwrap(),
            "--steps",
            &steps,
            "--json",
        ],
    );
    assert_eq!(lines(&rest, "summary")[0]["start_step"], k);
    assert_eq!(lines(&rest, "step").len(), 2);
    assert!(!orphan.exists());
    assert_eq!(checkpoint::load(&run).unwrap().1.step, k + 2);
}

/// Ranks stopped together by an out-of-memory they cannot recover from (no smaller
/// configuration fits the lowered limit; an evaluation, which over ranks does not switch
/// configurations) save their shards together, as one process saves its whole state: no
/// completed step is lost, and two ranks resume from it.
#[test]
fn ranks_stopped_together_by_memory_save_their_shards() {
    if let Err(reason) = mpirun() {
        return snug_testkit::skip_or_fail(&reason);
    }
    let dir = tempfile::tempdir().expect("a scratch directory");
    // A step of some activations, so that the limits below stop step 3 or the evaluation
    // after step 2 but not what ran before.
    let shape = [
        "--batch", "16", "--block", "64", "--steps", "4", "--shard", "2",
    ];
    let cases = [
        (
            "step",
            vec!["--lower-memory-at", "3:4MB", "--eval-every", "0"],
        ),
        (
            "evaluation",
            vec!["--lower-memory-at", "3:9377994B", "--eval-every", "2"],
        ),
    ];
    for (case, extra) in cases {
        let out = dir.path().join(case);
        let mut cmd = mpirun().expect("checked above");
        let o = cmd
            .args(["-np", "2", env!("CARGO_BIN_EXE_snug")])
            .args(RUN)
            .args(shape)
            .args(&extra)
            .args(["--out", out.to_str().unwrap()])
            .current_dir(dir.path())
            .output()
            .expect("mpirun runs");
        let err = text(&o.stderr);
        assert!(!o.status.success(), "{case}: the run did not stop");
        let why = match case {
            "step" => "no smaller configuration fits",
            _ => "out of memory in the evaluation after step 2",
        };
        assert!(err.contains(why), "{case}: {err}");
        assert!(
            err.contains("is saved") && err.contains("--resume"),
            "{case}: {err}"
        );
        assert_eq!(losses(&o).len(), 2, "{case}: {}", text(&o.stdout));
        assert_eq!(manifest(&out, 2)["step"].as_u64(), Some(2), "{case}");
        assert_eq!(shard_files(&out, 2).len(), 2, "{case}");
    }
    // The saved state resumes on two ranks to the end of the run.
    let resumed = two_ranks(
        dir.path(),
        &[
            "train",
            "--resume",
            dir.path().join("step").to_str().unwrap(),
            "--json",
        ],
    );
    assert_eq!(
        lines(&resumed, "step")
            .iter()
            .map(|l| l["step"].as_u64().expect("a step"))
            .collect::<Vec<_>>(),
        [3, 4]
    );
}

/// A rank whose shard cannot be written (its disk full) stops every rank at that save, named;
/// no manifest is written, and the shard the other rank wrote goes with it rather than filling
/// the disk until the next save.
#[test]
fn a_shard_one_rank_cannot_write_stops_every_rank_and_leaves_no_files() {
    let mut cmd = match mpirun() {
        Ok(c) => c,
        Err(reason) => return snug_testkit::skip_or_fail(&reason),
    };
    let dir = tempfile::tempdir().expect("a scratch directory");
    let run = dir.path().join("run");
    let exe = env!("CARGO_BIN_EXE_snug");
    let sharded = [
        "--shard",
        "1",
        "--checkpoint-every",
        "2",
        "--out",
        run.to_str().unwrap(),
    ];
    let start = Instant::now();
    let o = cmd
        .args(["-np", "1", exe])
        .args(RUN)
        .args(sharded)
        .args([":", "-np", "1", "env", "SNUG_FULL_DISK=1", exe])
        .args(RUN)
        .args(sharded)
        .current_dir(dir.path())
        .output()
        .expect("mpirun runs");
    refused(&o, "rank 1 could not write its shard of step 2");
    assert!(start.elapsed() < Duration::from_secs(60), "no rank hung");
    let left: Vec<String> = std::fs::read_dir(&run)
        .expect("the run directory rank 0 made")
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("ckpt-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
