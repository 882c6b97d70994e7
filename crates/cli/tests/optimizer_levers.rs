//! 8-bit AdamW and fused updates through the binary: `plan` shows what each saves in its pass
//! table, `train` runs them with the planned peak measured, and what they cannot combine with
//! is refused by name.

mod common;

use common::{fails_with, ok};

fn plan_json(dir: &std::path::Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["plan", "--preset", "tiny", "--json"];
    args.extend(extra);
    serde_json::from_slice(&ok(dir, &args).stdout).unwrap()
}

#[test]
fn plan_shows_the_optimizer_state_at_a_quarter_and_the_fused_saving() {
    let dir = tempfile::tempdir().unwrap();
    let adamw = plan_json(dir.path(), &[]);
    let eight = plan_json(dir.path(), &["--optimizer", "adamw8bit"]);
    let state = |p: &serde_json::Value| p["breakdown"]["optimizer_state"].as_u64().unwrap();
    let params = adamw["parameters"].as_u64().unwrap();
    assert_eq!(state(&adamw), 8 * params);
    // A quarter, plus two f32 absmaxes per block of 2048 of each tensor, and f32 moments for
    // the biases and gains (under 4,096 elements).
    let ratio = state(&eight) as f64 / state(&adamw) as f64;
    assert!(
        state(&eight) > 2 * params && (0.25..0.27).contains(&ratio),
        "{ratio}"
    );
    assert_eq!(eight["optimizer"], "adamw8bit");
    assert!(adamw.get("optimizer").is_none());
    let row = &eight["passes"][0];
    assert_eq!(row["pass"], "adamw8bit");
    assert_eq!(
        row["saved_bytes"].as_u64().unwrap(),
        adamw["peak_bytes"].as_u64().unwrap() - eight["peak_bytes"].as_u64().unwrap()
    );

    let fused = plan_json(
        dir.path(),
        &["--fused-update", "--clip-mode", "tensor", "--batch", "1"],
    );
    let unfused = plan_json(dir.path(), &["--batch", "1"]);
    assert_eq!(fused["fused_update"], "tensor");
    let row = &fused["passes"][0];
    assert_eq!(row["pass"], "fused-update clip=tensor");
    assert!(row["saved_bytes"].as_i64().unwrap() > 0, "{row}");
    assert!(fused["peak_bytes"].as_u64() < unfused["peak_bytes"].as_u64());

    fails_with(
        dir.path(),
        &["plan", "--preset", "tiny", "--fused-update"],
        &["fused_update", "global-norm clipping", "--clip-mode tensor"],
    );
    fails_with(
        dir.path(),
        &[
            "plan",
            "--preset",
            "tiny",
            "--fused-update",
            "--grad-clip",
            "0",
            "--accumulation",
            "2",
        ],
        &["fused_update", "accumulation"],
    );
    fails_with(
        dir.path(),
        &["plan", "--preset", "tiny", "--optimizer", "adam4bit"],
        &["optimizer", "adamw8bit"],
    );
}

#[test]
fn train_with_8bit_adamw_and_fused_updates_measures_its_plan() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let o = ok(
        dir.path(),
        &[
            "train",
            "--steps",
            "20",
            "--optimizer",
            "adamw8bit",
            "--fused-update",
            "--clip-mode",
            "previous",
            "--batch",
            "8",
            "--lr",
            "0.01",
            "--threads",
            "1",
            "--eval-every",
            "0",
            "--json",
            "--out",
            run.to_str().unwrap(),
        ],
    );
    let summary: serde_json::Value = String::from_utf8_lossy(&o.stdout)
        .lines()
        .next_back()
        .map(|l| serde_json::from_str(l).unwrap())
        .unwrap();
    assert_eq!(
        summary["predicted_peak_bytes"],
        summary["measured_peak_bytes"]
    );
    let (first, last) = (
        summary["first_loss"].as_f64().unwrap(),
        summary["final_loss"].as_f64().unwrap(),
    );
    assert!(last < first - 0.1, "loss {first} -> {last}");
    // Resuming it with the other AdamW is refused by name.
    fails_with(
        dir.path(),
        &[
            "train",
            "--resume",
            run.to_str().unwrap(),
            "--optimizer",
            "adamw",
            "--steps",
            "25",
        ],
        &["optimizer", "adamw8bit", "--optimizer adamw8bit"],
    );
}
