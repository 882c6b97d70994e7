//! Quantized frozen weights through the binary: `plan --quantize-base` shows the storage and
//! what it saves, `train --lora --quantize-base nf4` (QLoRA) trains at its planned peak and
//! its checkpoint says which quantization it used, `sample --quantize int8` samples it at its
//! planned peak, and quantizing a trained base is refused by name. Also 16-bit activations read
//! as stored: `plan --precision bf16` counts the products reading bf16 themselves.

mod common;

use common::{fails_with, ok};
use std::process::Output;

fn lines(o: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn plan(dir: &std::path::Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "plan",
        "--preset",
        "llama-tiny",
        "--lora",
        "4",
        "--lora-targets",
        "all-linear",
        "--json",
    ];
    args.extend(extra);
    serde_json::from_slice(&ok(dir, &args).stdout).unwrap()
}

#[test]
fn plan_shows_each_base_storage_and_its_saving() {
    let dir = tempfile::tempdir().unwrap();
    let f32_plan = plan(dir.path(), &[]);
    assert!(f32_plan.get("quantize_base").is_none());
    // `f32`, the default the help names, is the base as it is; anything else unknown is
    // refused by its field.
    let mut same = plan(dir.path(), &["--quantize-base", "f32"]);
    same["plan_ms"] = f32_plan["plan_ms"].clone();
    assert_eq!(same, f32_plan);
    let args = [
        "plan",
        "--preset",
        "llama-tiny",
        "--lora",
        "4",
        "--quantize-base",
        "fp8",
    ];
    fails_with(
        dir.path(),
        &args,
        &["quantize_base", "`fp8`", "or f32 for none"],
    );
    let mut last = f32_plan["peak_bytes"].as_u64().unwrap();
    for q in ["bf16", "int8", "nf4"] {
        let p = plan(dir.path(), &["--quantize-base", q]);
        assert_eq!(p["quantize_base"], q);
        // The frozen base counts its values, not its bytes.
        assert_eq!(p["frozen_parameters"], f32_plan["frozen_parameters"]);
        let pass = p["passes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["pass"] == format!("quantize-base={q}"))
            .unwrap_or_else(|| panic!("{q}: {}", p["passes"]));
        assert!(pass["saved_bytes"].as_i64().unwrap() > 0, "{pass}");
        let peak = p["peak_bytes"].as_u64().unwrap();
        assert!(peak < last, "{q}: {peak} vs {last}");
        last = peak;
    }
    // Double quantization stores NF4's block scales in 8 bits: fewer persistent bytes, and
    // the pass table shows what reading the base from its codes saves.
    let nf4 = plan(dir.path(), &["--quantize-base", "nf4"]);
    let dq = plan(dir.path(), &["--quantize-base", "nf4", "--double-quant"]);
    assert_eq!(dq["quantize_base"], "nf4-dq");
    assert!(
        dq["persistent_bytes"].as_u64() < nf4["persistent_bytes"].as_u64(),
        "{} vs {}",
        dq["persistent_bytes"],
        nf4["persistent_bytes"]
    );
    for p in [&nf4, &dq] {
        let passes = p["passes"].as_array().unwrap();
        let names: Vec<&str> = passes.iter().filter_map(|s| s["pass"].as_str()).collect();
        let at = names.iter().position(|&n| n == "quantized-reads");
        assert!(
            at.is_some_and(|i| i > 0 && names[i - 1].starts_with("quantize-base=")),
            "{names:?}"
        );
    }
    fails_with(
        dir.path(),
        &[
            "plan",
            "--preset",
            "llama-tiny",
            "--lora",
            "4",
            "--quantize-base",
            "int8",
            "--double-quant",
        ],
        &["double_quant", "needs --quantize-base nf4", "int8"],
    );
    fails_with(
        dir.path(),
        &["plan", "--preset", "llama-tiny", "--quantize-base", "nf4"],
        &["quantize_base", "without LoRA every weight trains"],
    );
    fails_with(
        dir.path(),
        &[
            "plan",
            "--preset",
            "llama-tiny",
            "--lora",
            "4",
            "--quantize-base",
            "int4",
        ],
        &["quantize_base", "bf16, int8 or nf4"],
    );
}

/// With bf16 on a CPU with our GEMM, the plan counts the products reading bf16 as stored;
/// elsewhere, and in f32, there are none.
#[test]
fn plan_counts_products_reading_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let plan = |precision: &str| -> serde_json::Value {
        let args = [
            "plan",
            "--preset",
            "llama-tiny",
            "--batch",
            "8",
            "--block",
            "128",
            "--precision",
            precision,
            "--json",
        ];
        serde_json::from_slice(&ok(dir.path(), &args).stdout).unwrap()
    };
    let (f32_plan, bf16) = (plan("f32"), plan("bf16"));
    assert!(f32_plan.get("bf16_products").is_none(), "{f32_plan}");
    assert!(f32_plan.get("bf16_kernels").is_none(), "{f32_plan}");
    if bf16["target_cpu"] == "portable" {
        assert!(bf16.get("bf16_products").is_none(), "{bf16}");
    } else {
        // Forward q, k, v, o, gate, up and down in each of 2 layers, and backward products.
        let n = bf16["bf16_products"].as_u64().unwrap_or(0);
        assert!(n >= 14, "{bf16}");
        assert!(bf16["bf16_kernels"].as_u64().unwrap_or(0) >= n, "{bf16}");
    }
}

#[test]
fn qlora_trains_at_its_planned_peak_and_samples_quantized() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let trained = lines(&ok(
        dir.path(),
        &[
            "train",
            "--steps",
            "30",
            "--json",
            "--out",
            run.to_str().unwrap(),
            "--lora",
            "4",
            "--lora-targets",
            "all-linear",
            "--quantize-base",
            "nf4",
            "--threads",
            "1",
            "--eval-every",
            "0",
            "--batch",
            "8",
            "--lr",
            "0.01",
        ],
    ));
    let summary = trained.last().unwrap();
    assert_eq!(
        summary["predicted_peak_bytes"],
        summary["measured_peak_bytes"]
    );
    let (first, last) = (
        summary["first_loss"].as_f64().unwrap(),
        summary["final_loss"].as_f64().unwrap(),
    );
    assert!(last < first - 0.1, "loss {first} -> {last}");
    let sampled = ok(
        dir.path(),
        &[
            "sample",
            "--checkpoint",
            run.to_str().unwrap(),
            "--quantize",
            "int8",
            "--tokens",
            "8",
            "--threads",
            "1",
            "--json",
        ],
    );
    let report: serde_json::Value = serde_json::from_slice(&sampled.stdout).unwrap();
    assert_eq!(report["quantize"], "int8");
    assert_eq!(report["planned_peak_bytes"], report["measured_peak_bytes"]);
    assert_eq!(report["tokens"], 8);
    fails_with(
        dir.path(),
        &[
            "sample",
            "--checkpoint",
            run.to_str().unwrap(),
            "--quantize",
            "fp8",
        ],
        &["--quantize", "bf16, int8 or nf4"],
    );
}
