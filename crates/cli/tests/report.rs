//! `snug report` end to end: a page made from `snug plan --json`, `snug fit --json` and a run
//! directory shows their numbers, renders in a real browser, and refuses a plan of another
//! version; `snug profile --trace` writes a trace-event file.
#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use snug_testkit::bounded::{self, Ended, Limits};

fn snug(args: &[&str], dir: &Path) -> Ended {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_snug"));
    // An empty cache: nothing is calibrated, fit's predictions are nominal.
    cmd.args(args).env("SNUG_CACHE_DIR", dir).current_dir(dir);
    bounded::run(
        cmd,
        Limits {
            timeout: Duration::from_secs(120),
            kill_above_rss: 2 << 30,
        },
    )
}

fn ok(e: Ended) -> Ended {
    assert_eq!(e.code, Some(0), "{}", e.stderr);
    e
}

const SHAPE: [&str; 6] = ["--threads", "1", "--batch", "4", "--block", "16"];

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).expect("JSON")
}

/// A plan, a fit table and a run directory whose metrics end in a truncated line.
fn inputs(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let plan = ok(snug(&[&["plan", "--json"][..], &SHAPE].concat(), dir));
    let plan_path = dir.join("plan.json");
    std::fs::write(&plan_path, &plan.stdout).unwrap();
    let fit = ok(snug(
        &[
            "fit",
            "--json",
            "--threads",
            "1",
            "--memory",
            "6MiB",
            "--batch",
            "32",
        ],
        dir,
    ));
    let fit_path = dir.join("fit.json");
    std::fs::write(&fit_path, &fit.stdout).unwrap();
    let run = dir.join("run");
    ok(snug(
        &[
            &[
                "train",
                "--steps",
                "12",
                "--eval-every",
                "4",
                "--out",
                "run",
            ][..],
            &SHAPE,
        ]
        .concat(),
        dir,
    ));
    let metrics = run.join("metrics.jsonl");
    let mut text = std::fs::read_to_string(&metrics).unwrap();
    text.push_str("{\"kind\":\"step\",\"step\":13,\"loss\":");
    std::fs::write(&metrics, text).unwrap();
    (plan_path, fit_path, run)
}

#[test]
fn the_page_shows_the_plans_fits_and_runs_numbers_and_renders_in_a_browser() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (plan_path, fit_path, run) = inputs(dir);
    let page = dir.join("report.html");
    let e = ok(snug(
        &[
            "report",
            "--plan-json",
            plan_path.to_str().unwrap(),
            "--fit-json",
            fit_path.to_str().unwrap(),
            "--run",
            run.to_str().unwrap(),
            "--device-memory",
            "12MiB",
            "-o",
            page.to_str().unwrap(),
            "--json",
        ],
        dir,
    ));
    let figures = json(&e.stdout);
    let plan = json(&std::fs::read_to_string(&plan_path).unwrap());
    let fit = json(&std::fs::read_to_string(&fit_path).unwrap());
    for field in [
        "peak_bytes",
        "persistent_bytes",
        "arena_bytes",
        "lower_bound_bytes",
        "breakdown",
        "peak",
        "timeline",
        "timeline_detail",
        "passes",
    ] {
        assert_eq!(figures["plan"][field], plan[field], "{field}");
    }
    assert_eq!(
        figures["fit"]["candidates"].as_array().unwrap().len(),
        fit["candidates"].as_array().unwrap().len()
    );
    assert_eq!(figures["fit"]["chosen"], fit["chosen"]);
    // The run: twelve complete steps, three evaluations, the cut line named.
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let last_step = metrics
        .lines()
        .rfind(|l| l.contains("\"kind\":\"step\"") && l.ends_with('}'))
        .map(json)
        .unwrap();
    let steps = figures["run"]["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 12);
    assert_eq!(figures["run"]["evals"].as_array().unwrap().len(), 3);
    for field in [
        "step",
        "loss",
        "lr",
        "active_bytes",
        "peak_bytes",
        "rss_bytes",
        "tokens_per_s",
    ] {
        assert_eq!(steps[11][field], last_step[field], "{field}");
    }
    assert_eq!(figures["run"]["skipped"][0]["line"], 16);
    // The device table: the plan's peak out of 12 MiB.
    let peak = plan["peak_bytes"].as_i64().unwrap();
    assert_eq!(figures["device"]["peak_bytes"].as_i64(), Some(peak));
    assert_eq!(
        figures["device"]["left_bytes"].as_i64(),
        Some((12 << 20) - peak)
    );

    // The page itself: the same figures embedded, nothing from outside.
    let html = std::fs::read_to_string(&page).unwrap();
    for outside in ["http:", "https:", "src=", "href=", "url("] {
        assert!(!html.contains(outside), "the page contains `{outside}`");
    }
    let open = "<script type=\"application/json\" id=\"snug-figures\">";
    let start = html.find(open).unwrap() + open.len();
    let end = start + html[start..].find("</script>").unwrap();
    assert_eq!(json(&html[start..end]), figures);
    assert!(html.contains("metrics.jsonl line 16 skipped"));

    screenshot(&page, dir);
}

/// Renders the page in headless Chromium and checks the picture: the window's size, and most
/// of it drawn on.
fn screenshot(page: &Path, dir: &Path) {
    let chromium = Path::new("/usr/bin/chromium");
    if !chromium.exists() {
        snug_testkit::skip_or_fail(
            "needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)",
        );
        return;
    }
    let png = dir.join("report.png");
    let profile = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(chromium);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,2000",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .arg(format!("--screenshot={}", png.display()))
    .arg(format!("file://{}", page.display()));
    let e = bounded::run(
        cmd,
        Limits {
            timeout: Duration::from_secs(120),
            kill_above_rss: 8 << 30,
        },
    );
    assert!(png.is_file(), "no screenshot: {}", e.stderr);
    if let Ok(keep) = std::env::var("SNUG_REPORT_PNG") {
        std::fs::copy(&png, keep).unwrap();
    }
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (1280, 2000));
    let channels = info.color_type.samples();
    let pixels = &buf[..info.buffer_size()];
    let total = pixels.len() / channels;
    let white = pixels
        .chunks(channels)
        .filter(|p| p[..3].iter().all(|&c| c >= 245))
        .count();
    let drawn = 1.0 - white as f64 / total as f64;
    // Charts (the timeline's bands fill much of the first screen) and tables, not a blank page.
    assert!(
        drawn > 0.10,
        "only {:.1}% of the page is drawn on",
        100.0 * drawn
    );
    let colors: std::collections::HashSet<&[u8]> = pixels.chunks(channels).collect();
    assert!(colors.len() > 50, "{} colors", colors.len());
}

/// `train --report` writes the page of the run into its directory: the peak it shows is the
/// peak the run planned and measured, and its curves are the run's steps.
#[test]
fn train_report_writes_the_runs_page_into_its_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let e = ok(snug(
        &[
            &[
                "train", "--steps", "4", "--out", "run", "--report", "--json",
            ][..],
            &SHAPE,
        ]
        .concat(),
        dir,
    ));
    let summary = e
        .stdout
        .lines()
        .map(json)
        .find(|v| v["kind"] == "summary" || v.get("predicted_peak_bytes").is_some())
        .expect("a summary line");
    let page = dir.join("run/report.html");
    assert_eq!(
        summary["report"],
        page.strip_prefix(dir).unwrap().to_str().unwrap()
    );
    let html = std::fs::read_to_string(&page).unwrap();
    let open = "<script type=\"application/json\" id=\"snug-figures\">";
    let start = html.find(open).unwrap() + open.len();
    let end = start + html[start..].find("</script>").unwrap();
    let figures = json(&html[start..end]);
    assert_eq!(
        figures["plan"]["peak_bytes"],
        summary["predicted_peak_bytes"]
    );
    assert_eq!(
        summary["predicted_peak_bytes"],
        summary["measured_peak_bytes"]
    );
    assert_eq!(figures["run"]["steps"].as_array().unwrap().len(), 4);
    for outside in ["http:", "https:", "src=", "href=", "url("] {
        assert!(!html.contains(outside), "the page contains `{outside}`");
    }
}

/// `train --report` replaces only a page of its own run (an earlier `--report`, before a
/// resume), and refuses anything else at its path before the run starts: nothing trained,
/// nothing saved, the file as it was.
#[test]
fn train_report_replaces_only_its_own_runs_page() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let train = |extra: &[&str]| snug(&[&["train", "--json"][..], extra, &SHAPE].concat(), dir);
    ok(train(&["--steps", "2", "--out", "run", "--report"]));
    let page = dir.join("run/report.html");
    let first = std::fs::read_to_string(&page).unwrap();
    // Resumed with --report: the run's own page, replaced by one of four steps.
    ok(train(&["--steps", "4", "--resume", "run", "--report"]));
    let second = std::fs::read_to_string(&page).unwrap();
    assert_ne!(first, second);
    assert!(second.contains("\"step\":4"), "the page of steps 1 to 4");
    let checkpoints = || {
        let mut names: Vec<String> = std::fs::read_dir(dir.join("run"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("ckpt-"))
            .collect();
        names.sort();
        names
    };
    let saved = checkpoints();
    // A file of yours at that path, on a resume and on a fresh run into a directory.
    std::fs::write(&page, "my notes").unwrap();
    let e = train(&["--steps", "6", "--resume", "run", "--report"]);
    assert_eq!(e.code, Some(1), "{}", e.stderr);
    assert!(
        e.stderr
            .contains("report.html exists and is not a page of this run"),
        "{}",
        e.stderr
    );
    assert_eq!(std::fs::read_to_string(&page).unwrap(), "my notes");
    assert_eq!(checkpoints(), saved, "nothing trained or saved");
    std::fs::create_dir(dir.join("fresh")).unwrap();
    std::fs::write(dir.join("fresh/report.html"), "mine").unwrap();
    let e = train(&["--steps", "2", "--out", "fresh", "--report"]);
    assert_eq!(e.code, Some(1), "{}", e.stderr);
    assert!(
        e.stderr.contains("is not a page of this run"),
        "{}",
        e.stderr
    );
    let left: Vec<_> = std::fs::read_dir(dir.join("fresh")).unwrap().collect();
    assert_eq!(left.len(), 1, "the directory as it was");
    // A directory there would fail the write after training: refused before it.
    std::fs::remove_file(&page).unwrap();
    std::fs::create_dir(&page).unwrap();
    let e = train(&["--steps", "6", "--resume", "run", "--report"]);
    assert_eq!(e.code, Some(1), "{}", e.stderr);
    assert!(e.stderr.contains("is a directory"), "{}", e.stderr);
    assert_eq!(checkpoints(), saved);
}

/// A page written into the run directory while the run trains (`snug report -o
/// run/report.html`) is someone's: the run, ending, leaves it and says so, and does not fail.
#[test]
fn train_report_keeps_a_page_written_while_it_ran() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let child = Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(
            [
                &["train", "--steps", "1000000", "--out", "run", "--report"][..],
                &SHAPE,
            ]
            .concat(),
        )
        .env("SNUG_CACHE_DIR", dir)
        .current_dir(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = dir.join("run/metrics.jsonl");
    let start = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(true, |m| m.is_empty()) {
        assert!(start.elapsed() < Duration::from_secs(60), "no step logged");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::write(dir.join("run/report.html"), "mine").unwrap();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        o.status.code(),
        Some(130),
        "stopped by the signal, saved: {err}"
    );
    assert!(err.contains("is not a page of this run"), "{err}");
    assert!(err.contains("no page written"), "{err}");
    assert_eq!(
        std::fs::read_to_string(dir.join("run/report.html")).unwrap(),
        "mine"
    );
}

/// `--force` replaces an old page, never the file the page is made from.
#[test]
fn report_never_writes_over_its_input() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let plan = ok(snug(&[&["plan", "--json"][..], &SHAPE].concat(), dir));
    std::fs::write(dir.join("plan.json"), &plan.stdout).unwrap();
    std::fs::hard_link(dir.join("plan.json"), dir.join("hard.json")).unwrap();
    for out in ["plan.json", "./plan.json", "hard.json"] {
        let e = snug(
            &["report", "--plan-json", "plan.json", "-o", out, "--force"],
            dir,
        );
        assert_eq!(e.code, Some(1), "{out}: {}", e.stderr);
        assert!(
            e.stderr.contains("is the file --plan-json reads"),
            "{}",
            e.stderr
        );
    }
    assert_eq!(
        std::fs::read(dir.join("plan.json")).unwrap(),
        plan.stdout.as_bytes()
    );
}

#[test]
fn a_plan_of_another_version_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let plan = ok(snug(&[&["plan", "--json"][..], &SHAPE].concat(), dir));
    let mut doc = json(&plan.stdout);
    assert_eq!(doc["format_version"], 1);
    doc["format_version"] = serde_json::json!(99);
    std::fs::write(dir.join("plan.json"), doc.to_string()).unwrap();
    let e = snug(&["report", "--plan-json", "plan.json", "-o", "r.html"], dir);
    assert_eq!(e.code, Some(1));
    assert!(
        e.stderr
            .contains("plan JSON of format version 99, but this snug reads version 1"),
        "{}",
        e.stderr
    );
    assert!(!dir.join("r.html").exists());
}

/// A run directory with nothing in it yet gives a page that says so, and the terminal says
/// why too (it said only where the page went).
#[test]
fn an_empty_run_directory_says_what_the_page_lacks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir(dir.join("run")).unwrap();
    let e = ok(snug(&["report", "--run", "run", "-o", "page.html"], dir));
    assert!(
        e.stdout.contains("note: no plan: run holds no checkpoint"),
        "{}",
        e.stdout
    );
    assert!(e.stdout.contains("note: no run curves"), "{}", e.stdout);
    let page = std::fs::read_to_string(dir.join("page.html")).unwrap();
    assert!(page.contains("holds no checkpoint"));
}

/// A run directory whose checkpoints are all damaged is an error naming one, not a page
/// without a plan.
#[test]
fn a_run_whose_checkpoints_do_not_load_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let run = dir.join("run");
    std::fs::create_dir(&run).unwrap();
    std::fs::write(run.join("ckpt-00000004.safetensors"), b"garbage").unwrap();
    let e = snug(&["report", "--run", "run", "-o", "r.html"], dir);
    assert_eq!(e.code, Some(1), "{}", e.stderr);
    assert!(
        e.stderr.contains("ckpt-00000004.safetensors"),
        "{}",
        e.stderr
    );
    assert!(!dir.join("r.html").exists());
    // With no checkpoint at all, the page says there is no plan.
    std::fs::remove_file(run.join("ckpt-00000004.safetensors")).unwrap();
    ok(snug(&["report", "--run", "run", "-o", "r.html"], dir));
}

#[test]
fn profile_writes_a_trace_with_a_slice_per_op_and_a_counter_of_bytes_held() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    ok(snug(
        &[
            &["profile", "--steps", "2", "--trace", "trace.json"][..],
            &SHAPE,
        ]
        .concat(),
        dir,
    ));
    let plan = json(&ok(snug(&[&["plan", "--json"][..], &SHAPE].concat(), dir)).stdout);
    let trace = json(&std::fs::read_to_string(dir.join("trace.json")).unwrap());
    let events = trace["traceEvents"].as_array().unwrap();
    for e in events {
        for field in ["name", "ph", "ts", "pid", "tid"] {
            assert!(e.get(field).is_some(), "event without `{field}`: {e}");
        }
    }
    let ops = plan["timeline"].as_array().unwrap().len();
    let slices: Vec<_> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] != "step")
        .collect();
    assert_eq!(slices.len(), 2 * ops);
    assert!(slices.iter().all(|e| e["dur"].as_f64().unwrap() >= 0.0));
    let names: Vec<&serde_json::Value> = slices[..ops].iter().map(|e| &e["name"]).collect();
    let planned: Vec<&serde_json::Value> = plan["timeline_detail"]["ops"]
        .as_array()
        .unwrap()
        .iter()
        .collect();
    assert_eq!(names, planned);
    let counters: Vec<u64> = events
        .iter()
        .filter(|e| e["ph"] == "C")
        .map(|e| {
            e["args"]
                .as_object()
                .unwrap()
                .values()
                .map(|v| v.as_u64().unwrap())
                .sum()
        })
        .collect();
    let timeline: Vec<u64> = plan["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(counters[..ops], timeline[..]);
}

/// Something other than a file where a run's metrics belong is named, not drawn as a run
/// without curves.
#[test]
fn metrics_that_are_not_a_file_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir_all(dir.join("run/metrics.jsonl")).unwrap();
    let e = snug(&["report", "--run", "run", "-o", "r.html"], dir);
    assert_eq!(e.code, Some(1), "{}", e.stderr);
    assert!(
        e.stderr.contains("metrics.jsonl: not a file"),
        "{}",
        e.stderr
    );
    assert!(!dir.join("r.html").exists());
}
