//! `snug` on a GPU (the first adapter; lavapipe in CI): `devices`, `train --device gpu`
//! against the CPU, resume on the GPU, a wrong `gpu:N`, `plan` and `bench` for a GPU, and
//! `sample --device gpu` against the CPU. Tests that need an adapter print a skip without one (a failure
//! under `SNUG_REQUIRE_ALL_TESTS`).

use std::process::{Command, Output};

fn snug(args: &[&str]) -> Output {
    let cwd = tempfile::tempdir().expect("a scratch directory");
    Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(args)
        .current_dir(cwd.path())
        .output()
        .expect("the snug binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn devices() -> serde_json::Value {
    let o = snug(&["devices", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_slice(&o.stdout).expect("devices --json is one JSON object")
}

fn have_gpu() -> bool {
    if devices()["gpus"].as_array().is_none_or(Vec::is_empty) {
        snug_testkit::skip_or_fail("no GPU adapter");
        return false;
    }
    true
}

fn json_lines(o: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn step_losses(o: &Output) -> Vec<(u64, f64)> {
    json_lines(o)
        .iter()
        .filter(|l| l["kind"] == "step")
        .map(|l| (l["step"].as_u64().unwrap(), l["loss"].as_f64().unwrap()))
        .collect()
}

const TINY: [&str; 14] = [
    "--preset",
    "tiny",
    "--batch",
    "8",
    "--block",
    "32",
    "--threads",
    "1",
    "--eval-every",
    "0",
    "--seed",
    "5",
    "--json",
    "--no-save",
];

#[test]
fn devices_lists_the_cpu_and_every_adapter() {
    let v = devices();
    assert_eq!(v["cpu"]["device"], "cpu");
    assert!(v["cpu"]["physical_cores"].as_u64() >= Some(1));
    let gpus = v["gpus"].as_array().expect("a list of adapters");
    for (i, g) in gpus.iter().enumerate() {
        assert_eq!(g["device"], format!("gpu:{i}"));
        assert!(!g["name"].as_str().unwrap_or("").is_empty(), "{g}");
        assert!(g["max_binding_bytes"].as_u64() > Some(0), "{g}");
        assert!(g["offset_alignment"].as_u64() > Some(0), "{g}");
    }
    // Exactly one adapter is `--device gpu`'s where there is any.
    let defaults = gpus.iter().filter(|g| g["default"] == true).count();
    assert_eq!(defaults, usize::from(!gpus.is_empty()));
    let text = snug(&["devices"]);
    assert!(text.status.success());
    assert!(String::from_utf8_lossy(&text.stdout).starts_with("cpu "));
}

/// 12 steps of `tiny` on the GPU and the CPU: the first losses within 1e-5 relative, every
/// later one within 1 %, the loss falling, the GPU's measured peak equal to its plan.
#[test]
fn train_on_the_gpu_matches_the_cpu() {
    if !have_gpu() {
        return;
    }
    let run = |device: &str| {
        let mut args = vec!["train", "--steps", "12", "--device", device];
        args.extend(TINY);
        let o = snug(&args);
        assert!(o.status.success(), "{device}: {}", stderr(&o));
        o
    };
    let (cpu, gpu) = (run("cpu"), run("gpu"));
    let (lc, lg) = (step_losses(&cpu), step_losses(&gpu));
    assert_eq!(lc.len(), 12);
    assert_eq!(lg.len(), 12);
    let rel = |a: f64, b: f64| (a - b).abs() / a.abs();
    assert!(rel(lc[0].1, lg[0].1) < 1e-5, "{lc:?} vs {lg:?}");
    for (c, g) in lc.iter().zip(&lg) {
        assert!(
            rel(c.1, g.1) < 0.01,
            "step {}: cpu {} gpu {}",
            c.0,
            c.1,
            g.1
        );
    }
    assert!(lg[11].1 < lg[0].1 - 0.2, "{lg:?}");
    let summary = json_lines(&gpu).pop().unwrap();
    assert_eq!(summary["kind"], "summary");
    assert_eq!(
        summary["predicted_peak_bytes"],
        summary["measured_peak_bytes"]
    );
    assert_ne!(summary["device"], "cpu");
}

/// A GPU run saved at step 4 and resumed (the device comes back from the checkpoint's
/// configuration) repeats an uninterrupted GPU run's steps 5..8 exactly.
#[test]
fn resume_on_the_gpu_continues_exactly() {
    if !have_gpu() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let out_s = out.to_str().unwrap();
    let common = &TINY[..TINY.len() - 1];
    let mut straight = vec!["train", "--steps", "8", "--device", "gpu"];
    straight.extend(TINY);
    let straight = snug(&straight);
    assert!(straight.status.success(), "{}", stderr(&straight));
    let mut first = vec!["train", "--steps", "4", "--device", "gpu", "--out", out_s];
    first.extend(common);
    let first = snug(&first);
    assert!(first.status.success(), "{}", stderr(&first));
    let mut resume = vec!["train", "--resume", out_s, "--steps", "8"];
    resume.extend(common);
    let resumed = snug(&resume);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let tail = step_losses(&resumed);
    assert_eq!(tail.first().map(|s| s.0), Some(5));
    assert_eq!(&step_losses(&straight)[4..], &tail[..]);
    assert_ne!(json_lines(&resumed).pop().unwrap()["device"], "cpu");
}

/// `--device gpu:N` past the last adapter names every adapter found, for train, plan and
/// sample; `plan --device gpu` plans at the adapter's alignment.
#[test]
fn device_flags_are_checked_and_planned_for() {
    if !have_gpu() {
        return;
    }
    let v = devices();
    let gpus = v["gpus"].as_array().unwrap();
    let missing = format!("gpu:{}", gpus.len());
    let train = snug(&[
        "train",
        "--preset",
        "tiny",
        "--device",
        &missing,
        "--no-save",
    ]);
    let plan = snug(&["plan", "--preset", "tiny", "--device", &missing]);
    // A run to sample from, saved on the CPU.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let out_s = out.to_str().unwrap();
    let mut saved = vec!["train", "--steps", "1", "--out", out_s];
    saved.extend(&TINY[..TINY.len() - 1]);
    let saved = snug(&saved);
    assert!(saved.status.success(), "{}", stderr(&saved));
    let sample = snug(&["sample", "--checkpoint", out_s, "--device", &missing]);
    for (cmd, o) in [("train", train), ("plan", plan), ("sample", sample)] {
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{cmd}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        for g in gpus {
            assert!(err.contains(g["name"].as_str().unwrap()), "{cmd}: {err}");
        }
    }
    let o = snug(&["plan", "--preset", "tiny", "--device", "gpu", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let default = gpus.iter().find(|g| g["default"] == true).unwrap();
    assert_eq!(
        plan["memory_layout"]["alignment"],
        default["offset_alignment"]
    );
    assert_eq!(plan["device"], "gpu");
    let cpu = snug(&["plan", "--preset", "tiny", "--json"]);
    let cpu: serde_json::Value = serde_json::from_slice(&cpu.stdout).unwrap();
    assert!(cpu.get("device").is_none() && cpu.get("memory_layout").is_none());
}

/// `bench --device gpu --json`: the step timed on the GPU, its measured peak equal to the
/// plan and covered by the device allocator's own report, MFU against the device's probed
/// GEMM rate, and the input staging ring's host bytes (two buffers of the step's inputs).
#[test]
fn bench_times_the_step_on_the_gpu() {
    if !have_gpu() {
        return;
    }
    let o = snug(&[
        "bench", "--device", "gpu", "--cases", "tiny", "--steps", "2", "--warmup", "1", "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = json_lines(&o);
    assert_eq!(lines.len(), 1, "one case line and no probe: {lines:?}");
    let case = &lines[0];
    assert_eq!(case["kind"], "case");
    assert_ne!(case["device"], "cpu");
    assert!(case["median_step_ms"].as_f64() > Some(0.0));
    assert!(case["tokens_per_s"].as_f64() > Some(0.0));
    assert_eq!(case["predicted_peak_bytes"], case["measured_peak_bytes"]);
    let probe = case["probe_after_gflop_per_s"]
        .as_f64()
        .expect("a GEMM probe");
    let mfu = case["mfu"].as_f64().expect("an MFU");
    let flops = case["model_flops_per_s"].as_f64().expect("model FLOP/s");
    assert!(probe > 0.0, "{case}");
    assert!(
        (mfu - flops / (probe * 1e9)).abs() <= 1e-9 * mfu.max(1.0),
        "{case}"
    );
    // tiny's case is 16 × 64 tokens: i32 tokens and targets.
    assert_eq!(case["staging_ring_bytes"], 2 * 2 * 16 * 64 * 4, "{case}");
    match case["device_allocator_report_bytes"].as_u64() {
        Some(bytes) => assert!(
            bytes >= case["predicted_peak_bytes"].as_u64().unwrap_or(u64::MAX),
            "{case}"
        ),
        None => println!(
            "skipped the allocator cross-check: {} gives no report",
            case["device"]
        ),
    }
}

/// `--memory auto` on a GPU takes the device's memory less 10%: `--device-memory` where
/// given (fit and train alike), else what the adapter reports (a CPU driver: system memory),
/// and `snug devices` says which. `fit --device gpu` ranks by the GPU's probed timings.
#[test]
fn memory_auto_on_a_gpu_takes_the_devices_memory() {
    if !have_gpu() {
        return;
    }
    let given: u64 = 256 << 20;
    let budget = given - given / 10;
    let common = [
        "--device",
        "gpu",
        "--memory",
        "auto",
        "--device-memory",
        "256MiB",
    ];
    let tiny = [
        "--preset",
        "tiny",
        "--threads",
        "1",
        "--batch",
        "4",
        "--block",
        "32",
    ];
    let o = snug(&[&["fit"][..], &common[..], &tiny[..], &["--json"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let fit: serde_json::Value = serde_json::from_slice(&o.stdout).expect("fit --json");
    assert_eq!(fit["budget"], budget, "{fit}");
    assert!(fit["candidates"].as_array().is_some_and(|c| !c.is_empty()));

    let mut train = vec!["train"];
    train.extend(common);
    train.extend(tiny);
    train.extend(["--steps", "1", "--no-save", "--json"]);
    let o = snug(&train);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = json_lines(&o);
    let summary = lines.last().expect("a summary");
    let limit = summary["memory_limit_bytes"]
        .as_u64()
        .expect("a strict limit");
    assert_eq!(limit, budget, "{summary}");

    let v = devices();
    for g in v["gpus"].as_array().into_iter().flatten() {
        match g["memory_from"].as_str() {
            Some(_) => assert!(g["memory_bytes"].as_u64() > Some(0), "{g}"),
            None => assert!(g["memory_bytes"].is_null(), "{g}"),
        }
        if g["device_type"] == "CPU" {
            assert_eq!(g["memory_from"], "system memory (a CPU driver)", "{g}");
        }
    }
    let o = snug(&["devices", "--json", "--device-memory", "12GiB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("devices --json");
    for g in v["gpus"].as_array().into_iter().flatten() {
        assert!(g["memory_bytes"].as_u64() > Some(0), "{g}");
    }
    let o = snug(&[
        "fit",
        "--device",
        "gpu",
        "--memory",
        "auto",
        "--device-memory",
        "lots",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("--device-memory lots"),
        "{}",
        stderr(&o)
    );
}

/// `sample --device gpu` on a trained run: the same greedy tokens as on the CPU, with the
/// cache (through a slide) and over the whole window, each phase's measured peak on the
/// device equal to its plan, and `plan --inference --kv-cache --device gpu` equal to the
/// decode step's.
#[test]
fn sample_on_the_gpu_matches_the_cpu() {
    if !have_gpu() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let out_s = out.to_str().unwrap();
    let mut train = vec!["train", "--steps", "30", "--out", out_s];
    train.extend(&TINY[..TINY.len() - 1]);
    let trained = snug(&train);
    assert!(trained.status.success(), "{}", stderr(&trained));
    let sample = |device: &str, extra: &[&str]| {
        let mut args = vec![
            "sample",
            "--checkpoint",
            out_s,
            "--prompt",
            "12+34=",
            "--temperature",
            "0",
            "--tokens",
            "70",
            "--threads",
            "1",
            "--json",
            "--device",
            device,
        ];
        args.extend(extra);
        let o = snug(&args);
        assert!(o.status.success(), "{device} {extra:?}: {}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let cpu = sample("cpu", &[]);
    let gpu = sample("gpu", &[]);
    assert_eq!(cpu["device"], "cpu");
    assert_ne!(gpu["device"], "cpu");
    assert_eq!(gpu["ids"], cpu["ids"]);
    // Past the run's 64-position window: the cache slides.
    assert_eq!(gpu["tokens"], 70);
    let kv = &gpu["kv_cache"];
    assert!(kv["slides"].as_u64().unwrap() >= 1, "{kv}");
    for phase in ["prefill", "decode"] {
        assert!(kv[phase]["runs"].as_u64().unwrap() > 0, "{kv}");
        assert_eq!(
            kv[phase]["planned_peak_bytes"], kv[phase]["measured_peak_bytes"],
            "{phase}: {kv}"
        );
    }
    // Past the window the whole-window path keeps the last 64 tokens, not the cache's half.
    // `plan --inference --kv-cache --device gpu` predicts the decode step's plan exactly.
    let plan = snug(&[
        "plan",
        "--preset",
        "tiny",
        "--batch",
        "8",
        "--block",
        "32",
        "--threads",
        "1",
        "--inference",
        "--kv-cache",
        "--device",
        "gpu",
        "--json",
    ]);
    assert!(plan.status.success(), "{}", stderr(&plan));
    let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
    assert_eq!(plan["peak_bytes"], kv["decode"]["planned_peak_bytes"]);
    let full = sample("gpu", &["--full-window"]);
    assert_eq!(full["ids"], sample("cpu", &["--full-window"])["ids"]);
    assert_eq!(full["mode"], "full_window");
    assert_eq!(full["planned_peak_bytes"], full["measured_peak_bytes"]);
}

/// The levers on the GPU from the command line: `train --optimizer adamw8bit` and QLoRA
/// (`--lora 4 --quantize-base nf4`) with `--device gpu` against the same runs on the CPU (the
/// first loss within 1e-5 relative, every later one within 0.1 %), the GPU's measured peak
/// equal to its plan; and `sample --device gpu --quantize nf4|int8|bf16` giving the CPU's greedy
/// tokens, each phase planned == measured.
#[test]
fn levers_run_on_the_gpu_from_the_command_line() {
    if !have_gpu() {
        return;
    }
    for lever in [
        &["--optimizer", "adamw8bit"][..],
        &[
            "--lora",
            "4",
            "--lora-targets",
            "all-linear",
            "--quantize-base",
            "nf4",
        ][..],
    ] {
        let run = |device: &str| {
            let mut args = vec!["train", "--steps", "4", "--device", device];
            args.extend(TINY);
            args.extend(lever);
            let o = snug(&args);
            assert!(o.status.success(), "{device} {lever:?}: {}", stderr(&o));
            o
        };
        let (cpu, gpu) = (run("cpu"), run("gpu"));
        let (lc, lg) = (step_losses(&cpu), step_losses(&gpu));
        assert_eq!((lc.len(), lg.len()), (4, 4), "{lever:?}");
        let rel = |a: f64, b: f64| (a - b).abs() / a.abs();
        assert!(rel(lc[0].1, lg[0].1) < 1e-5, "{lever:?}: {lc:?} vs {lg:?}");
        for (c, g) in lc.iter().zip(&lg) {
            assert!(
                rel(c.1, g.1) < 1e-3,
                "{lever:?} step {}: {} vs {}",
                c.0,
                c.1,
                g.1
            );
        }
        let summary = json_lines(&gpu).pop().unwrap();
        assert_eq!(summary["kind"], "summary");
        assert_ne!(summary["device"], "cpu");
        assert_eq!(
            summary["predicted_peak_bytes"], summary["measured_peak_bytes"],
            "{lever:?}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let out_s = out.to_str().unwrap();
    let mut train = vec!["train", "--steps", "10", "--out", out_s];
    train.extend(&TINY[..TINY.len() - 1]);
    let trained = snug(&train);
    assert!(trained.status.success(), "{}", stderr(&trained));
    for quantize in ["nf4", "int8", "bf16"] {
        let sample = |device: &str| {
            let o = snug(&[
                "sample",
                "--checkpoint",
                out_s,
                "--prompt",
                "12+34=",
                "--temperature",
                "0",
                "--tokens",
                "12",
                "--threads",
                "1",
                "--json",
                "--quantize",
                quantize,
                "--device",
                device,
            ]);
            assert!(o.status.success(), "{device} {quantize}: {}", stderr(&o));
            serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
        };
        let (cpu, gpu) = (sample("cpu"), sample("gpu"));
        assert_ne!(gpu["device"], "cpu");
        assert_eq!(gpu["ids"], cpu["ids"], "{quantize}");
        let kv = &gpu["kv_cache"];
        for phase in ["prefill", "decode"] {
            assert_eq!(
                kv[phase]["planned_peak_bytes"], kv[phase]["measured_peak_bytes"],
                "{quantize} {phase}: {kv}"
            );
        }
    }
}
