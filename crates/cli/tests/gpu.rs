//! `snug` on a GPU (the first adapter; lavapipe in CI): `devices`, `train --device gpu`
//! against the CPU, resume on the GPU, a wrong `gpu:N`, `plan` and `bench` for a GPU, and
//! `sample --device gpu` against the CPU. Tests that need an adapter print a skip without one (a failure
//! under `SNUG_REQUIRE_ALL_TESTS`).

use std::process::{Command, Output};

fn snug(args: &[&str]) -> Output {
    snug_env(args, &[])
}

/// `snug` with environment variables set (its own, the test's otherwise).
fn snug_env(args: &[&str], vars: &[(&str, &str)]) -> Output {
    let cwd = tempfile::tempdir().expect("a scratch directory");
    Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(args)
        .envs(vars.iter().copied())
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

/// On a machine without a display, listing the GPUs prints nothing on standard error: Mesa's
/// device-select layer (installed with its Vulkan drivers) would print an "error:" line per
/// enumeration when it looks for one.
#[test]
fn devices_without_a_display_print_no_driver_errors() {
    let o = Command::new(env!("CARGO_BIN_EXE_snug"))
        .arg("devices")
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("WAYLAND_DISPLAY")
        .env_remove("DISPLAY")
        .env_remove("NODEVICE_SELECT")
        .output()
        .expect("the snug binary runs");
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o), "");
}

/// `SNUG_GPU_SUBGROUPS=0` turns the subgroup reductions off: `devices` says so, and training
/// gives the same losses bit for bit (both paths fold in one order).
#[test]
fn the_subgroup_switch_is_reported_and_keeps_the_losses() {
    if !have_gpu() {
        return;
    }
    let off = [("SNUG_GPU_SUBGROUPS", "0")];
    let on = [("SNUG_GPU_SUBGROUPS", "1")];
    let listed = |vars: &[(&str, &str)]| -> serde_json::Value {
        let o = snug_env(&["devices", "--json"], vars);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice(&o.stdout).expect("devices --json")
    };
    let (v_on, v_off) = (listed(&on), listed(&off));
    let gpus_on = v_on["gpus"].as_array().expect("adapters");
    let gpus_off = v_off["gpus"].as_array().expect("adapters");
    for (a, b) in gpus_on.iter().zip(gpus_off) {
        assert_eq!(a["subgroups_used"], a["subgroup"], "{a}");
        assert_eq!(b["subgroups_used"], false, "{b}");
        let [min, max] = [0, 1].map(|i| a["subgroup_sizes"][i].as_u64().unwrap_or(0));
        if a["subgroup"] == true {
            assert!(min >= 1 && min <= max && max <= 128, "{a}");
        }
    }
    let text = snug_env(&["devices"], &off);
    let has = gpus_on.iter().any(|g| g["subgroup"] == true);
    assert_eq!(
        String::from_utf8_lossy(&text.stdout).contains("off: SNUG_GPU_SUBGROUPS=0"),
        has
    );
    let run = |vars: &[(&str, &str)]| {
        let mut args = vec!["train", "--steps", "3", "--device", "gpu"];
        args.extend(TINY);
        let o = snug_env(&args, vars);
        assert!(o.status.success(), "{}", stderr(&o));
        step_losses(&o)
    };
    let (l_on, l_off) = (run(&on), run(&off));
    assert_eq!(l_on.len(), 3);
    assert_eq!(l_on, l_off);
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
    // The run's page, here and on a machine without the adapter (no Vulkan driver found),
    // which plans with the default layout and says so. Its device table is of the GPU's
    // memory (lavapipe's: the machine's total), not of what the host has free; with no
    // adapter to read it from there is no table, and a note says why.
    let figures = |vars: &[(&str, &str)]| {
        let page = dir.path().join(format!("page-{}.html", vars.len()));
        let page = page.to_str().unwrap();
        let o = snug_env(&["report", "--run", out_s, "-o", page, "--json"], vars);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let here = figures(&[]);
    assert!(!here["notes"].to_string().contains("does not have"));
    assert!(!here["notes"]
        .to_string()
        .contains("planned with its layout"));
    let adapter = devices()["gpus"]
        .as_array()
        .and_then(|g| g.iter().find(|a| a["default"] == true))
        .cloned()
        .unwrap_or_default();
    if adapter["memory_from"] == "system memory (a CPU driver)" {
        assert_eq!(
            here["device"]["device_bytes"], adapter["memory_bytes"],
            "{here}"
        );
        let label = here["device"]["device"].as_str().unwrap_or_default();
        assert!(label.contains("--device gpu"), "{here}");
    }
    let none = "/nonexistent.json";
    // The checkpoint names the adapter it trained on; where this machine's adapter of that
    // index is another (the saved name changed by a byte here), the page says whose layout
    // it planned with.
    let label = adapter["name"].as_str().unwrap_or_default().to_string();
    let mut ckpts: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    ckpts.sort();
    let ckpt = ckpts.pop().expect("the run's newest checkpoint");
    let mut bytes = std::fs::read(&ckpt).unwrap();
    let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let at = bytes[..header_end]
        .windows(label.len())
        .position(|w| w == label.as_bytes())
        .expect("the adapter's name in the checkpoint's header");
    bytes[at] = if bytes[at] == b'X' { b'Y' } else { b'X' };
    std::fs::write(&ckpt, &bytes).unwrap();
    let other = figures(&[("SNUG_TEST", "another adapter")]);
    let notes = other["notes"].to_string();
    assert!(
        notes.contains("the run trained on") && notes.contains("planned with its layout"),
        "{notes}"
    );
    let elsewhere = figures(&[("VK_ICD_FILENAMES", none), ("VK_DRIVER_FILES", none)]);
    let notes = elsewhere["notes"].to_string();
    assert!(
        notes.contains("which this machine does not have: planned with the default GPU"),
        "{notes}"
    );
    assert!(elsewhere["device"].is_null(), "{elsewhere}");
    assert!(notes.contains("no device table"), "{notes}");
    // Given to the run, the device memory is the table's.
    let given = dir.path().join("given");
    let given_s = given.to_str().unwrap();
    let mut small = vec![
        "train",
        "--steps",
        "1",
        "--device",
        "gpu",
        "--device-memory",
    ];
    small.extend(["64MiB", "--out", given_s]);
    small.extend(common);
    let small = snug(&small);
    assert!(small.status.success(), "{}", stderr(&small));
    let page = dir.path().join("given.html");
    let o = snug(&[
        "report",
        "--run",
        given_s,
        "-o",
        page.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["device"]["device_bytes"], 64 << 20, "{v}");
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

/// With no adapter at all (wgpu told to try no backend), every command that opens a GPU stops
/// with exit code 1 saying none was found and how to install a driver; `devices` says the same
/// and lists none. Needs no adapter.
#[test]
fn no_adapter_says_how_to_install_a_driver() {
    let none = [("WGPU_BACKEND", "none")];
    for args in [
        &[
            "train",
            "--preset",
            "tiny",
            "--device",
            "gpu",
            "--steps",
            "1",
            "--no-save",
        ][..],
        &[
            "train",
            "--preset",
            "tiny",
            "--device",
            "gpu:1",
            "--steps",
            "1",
            "--no-save",
        ],
        &["profile", "--preset", "tiny", "--device", "gpu"],
        &[
            "fit", "--preset", "tiny", "--device", "gpu", "--memory", "1GiB",
        ],
        &[
            "bench", "--device", "gpu", "--cases", "tiny", "--steps", "1", "--warmup", "0",
        ],
    ] {
        let o = snug_env(args, &none);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(
            err.contains("no GPU adapter found") && err.contains("apt install mesa-vulkan-drivers"),
            "{args:?}: {err}"
        );
    }
    let text = snug_env(&["devices"], &none);
    assert!(text.status.success(), "{}", stderr(&text));
    assert!(String::from_utf8_lossy(&text.stdout).contains("no GPU adapter found: install"));
    let json = snug_env(&["devices", "--json"], &none);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).expect("devices --json");
    assert_eq!(v["gpus"], serde_json::json!([]));
}

/// Out of device memory mid-run (the limit lowered to 1 KiB before step 3, so nothing fits):
/// a typed error naming the device, the checkpoint of step 2 intact, and `--resume` on the
/// GPU carries on with the uninterrupted run's losses.
#[test]
fn out_of_memory_mid_run_keeps_the_checkpoint_and_resumes() {
    if !have_gpu() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let out_s = out.to_str().unwrap();
    let tiny = &TINY[..TINY.len() - 1];
    let mut args = vec!["train", "--steps", "4", "--device", "gpu", "--out", out_s];
    args.extend(tiny);
    args.extend([
        "--memory-limit",
        "1GiB",
        "--strict",
        "--lower-memory-at",
        "3:1KiB",
    ]);
    let o = snug(&args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("out of memory on gpu:") && err.contains("the state after step 2 is saved"),
        "{err}"
    );
    let saved: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("ckpt-"))
        .collect();
    assert_eq!(saved, vec!["ckpt-00000002.safetensors".to_string()]);
    let resumed = snug(&["train", "--steps", "3", "--resume", out_s, "--json"]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let mut straight = vec!["train", "--steps", "3", "--device", "gpu"];
    straight.extend(TINY);
    let straight = snug(&straight);
    assert!(straight.status.success(), "{}", stderr(&straight));
    let tail = step_losses(&resumed);
    assert_eq!(tail, step_losses(&straight)[2..].to_vec());
    assert_ne!(json_lines(&resumed).pop().unwrap()["device"], "cpu");
}

/// A tensor over the adapter's largest storage binding stops `plan --device gpu` by name.
#[test]
fn a_tensor_over_the_binding_limit_is_a_named_planning_error() {
    if !have_gpu() {
        return;
    }
    let gpus = devices()["gpus"].as_array().cloned().unwrap_or_default();
    let default = gpus
        .iter()
        .find(|g| g["default"] == true)
        .expect("a default");
    let limit = default["max_binding_bytes"]
        .as_u64()
        .expect("a binding limit");
    // tiny's fused QKV activations are batch × 64 × 384 floats.
    let batch = (limit / (64 * 384 * 4) + 1).to_string();
    let o = snug(&[
        "plan", "--preset", "tiny", "--block", "64", "--batch", &batch, "--device", "gpu",
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("tensor `")
            && err.contains(&format!("more than the {limit} bytes one kernel may bind")),
        "{err}"
    );
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
    let default = devices()["gpus"]
        .as_array()
        .and_then(|g| g.iter().find(|g| g["default"] == true).cloned())
        .expect("the default adapter");
    assert_eq!(case["gpu_subgroups"], default["subgroups_used"], "{case}");
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
    // A budget, or a --device-memory, beyond an adapter whose memory is known (a CPU
    // driver's: the machine's) is refused before anything is planned, as on the CPU; fit
    // plans for other machines and takes it.
    // The adapter `--device gpu` takes.
    let chosen = v["gpus"]
        .as_array()
        .and_then(|g| g.iter().find(|a| a["default"] == true))
        .cloned()
        .unwrap_or_default();
    let known = chosen["memory_bytes"]
        .as_u64()
        .filter(|_| chosen["memory_from"] == "system memory (a CPU driver)");
    if let Some(has) = known {
        let over = format!("{}KiB", (has >> 10) * 2);
        let run = ["--steps", "1", "--no-save"];
        for (flag, value, needle) in [
            (
                "--memory",
                over.as_str(),
                "is more than the adapter's memory, ",
            ),
            (
                "--device-memory",
                over.as_str(),
                "is more than --device gpu's memory",
            ),
        ] {
            let mut args = vec!["train", "--device", "gpu", flag, value];
            if flag == "--device-memory" {
                args.extend(["--memory", "1MiB"]);
            }
            args.extend(tiny);
            args.extend(run);
            let o = snug(&args);
            assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
            assert!(stderr(&o).contains(needle), "{}", stderr(&o));
            assert!(
                stderr(&o).contains(" of system memory (a CPU driver)"),
                "{}",
                stderr(&o)
            );
        }
        let mut args = vec!["fit", "--device", "gpu", "--memory", over.as_str()];
        args.extend(tiny);
        let o = snug(&args);
        assert!(o.status.success(), "{}", stderr(&o));
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

/// What the GPU cannot run (clipping by the previous step's norm, double-quantized NF4, a run
/// over ranks) `plan --device gpu` refuses as `train --device gpu` does, naming the op: a plan
/// of a step that cannot run there is no prediction.
#[test]
fn plan_refuses_what_the_gpu_cannot_run_as_train_does() {
    if !have_gpu() {
        return;
    }
    let shape = [
        "--preset",
        "llama-tiny",
        "--batch",
        "4",
        "--block",
        "16",
        "--threads",
        "1",
    ];
    for (flags, op) in [
        (
            &["--optimizer", "sgd", "--clip-mode", "previous"][..],
            "store_sum_squares",
        ),
        (
            &["--lora", "4", "--quantize-base", "nf4", "--double-quant"][..],
            "double-quant",
        ),
        (&["--devices", "2"][..], "collectives"),
    ] {
        let mut plan = vec!["plan", "--device", "gpu"];
        plan.extend(shape);
        plan.extend(flags);
        let o = snug(&plan);
        assert_eq!(o.status.code(), Some(1), "{flags:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(op), "{flags:?}: {}", stderr(&o));
        // One process cannot train over two ranks; what it refuses is the rank count.
        if flags[0] == "--devices" {
            continue;
        }
        let mut train = vec!["train", "--steps", "1", "--no-save", "--device", "gpu"];
        train.extend(shape);
        train.extend(flags);
        let o = snug(&train);
        assert_eq!(o.status.code(), Some(1), "{flags:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(op), "{flags:?}: {}", stderr(&o));
    }
    // Fit refuses the same candidates: under a budget where fused updates (which clip by the
    // previous norm) would be the fastest fit, it chooses a lever the GPU runs, and the run
    // then trains at that plan.
    let mut train = vec![
        "train",
        "--steps",
        "2",
        "--no-save",
        "--device",
        "gpu",
        "--json",
    ];
    train.extend(shape);
    train.extend([
        "--device-memory",
        "1MiB",
        "--memory",
        "1MiB",
        "--allow",
        "all",
    ]);
    let o = snug(&train);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = json_lines(&o);
    let fit = lines
        .iter()
        .find(|l| l["kind"] == "fit")
        .expect("a fit line");
    let candidates = fit["candidates"].as_array().unwrap();
    let refused = |c: &&serde_json::Value| {
        c["reason"]
            .as_str()
            .is_some_and(|r| r.contains("store_sum_squares"))
    };
    assert!(candidates.iter().any(|c| refused(&c)), "{fit}");
    let chosen = candidates
        .iter()
        .find(|c| c["verdict"] == "chosen")
        .unwrap();
    assert!(!refused(&chosen));
    let summary = lines.last().unwrap();
    assert_eq!(summary["predicted_peak_bytes"], chosen["peak_bytes"]);
    assert_eq!(summary["measured_peak_bytes"], chosen["peak_bytes"]);
}
