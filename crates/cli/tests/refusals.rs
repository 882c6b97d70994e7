//! Sizes and values that cannot be planned are refused before anything is built: the command
//! exits non-zero at once, naming the field and its value, and its peak memory stays small
//! (measured through the child's resource usage, as the kernel counts it).

#![cfg(target_os = "linux")]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use snug_testkit::bounded::{self, Limits};

/// What a refused command must stay under.
const MAX_RSS_BYTES: u64 = 100 << 20;
const MAX_SECONDS: u64 = 30;

/// `snug args`, run in `dir`, exits 1 quickly and small, and its error names each of `needles`.
/// A child that outgrows the bounds (the runaway graph building this guards against) is
/// killed rather than left to exhaust memory.
fn refused(dir: &Path, args: &[&str], needles: &[&str]) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_snug"));
    cmd.args(args).current_dir(dir);
    let ended = bounded::run(
        cmd,
        Limits {
            timeout: Duration::from_secs(MAX_SECONDS),
            kill_above_rss: 4 * MAX_RSS_BYTES,
        },
    );
    bounded::assert_refused(&ended, &format!("{args:?}"), needles, MAX_RSS_BYTES);
}

fn llama_json(layers: &str, extra: &str) -> String {
    format!(
        r#"{{"model_type": "llama", "hidden_size": 64, "intermediate_size": 172,
        "num_hidden_layers": {layers}, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 65, "max_position_embeddings": 128{extra}}}"#
    )
}

#[test]
fn a_billion_layers_in_toml_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let toml = dir.path().join("huge.toml");
    std::fs::write(
        &toml,
        "[model]\npreset = \"tiny\"\nn_layer = 1000000000\n[train]\nthreads = 1\n",
    )
    .unwrap();
    let config = toml.to_str().unwrap();
    for args in [
        &["plan", "--config", config][..],
        &["fit", "--config", config, "--memory", "1GiB"],
        &["train", "--config", config],
    ] {
        refused(dir.path(), args, &["n_layer", "1000000000 layers"]);
    }
}

#[test]
fn a_hundred_thousand_hf_layers_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("config.json");
    std::fs::write(&json, llama_json("100000", "")).unwrap();
    refused(
        dir.path(),
        &["plan", "--hf-config", json.to_str().unwrap()],
        &["num_hidden_layers", "100000 layers", "config.json"],
    );
}

#[test]
fn huge_widths_vocabularies_and_heads_are_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("n_embd = 1099511627776", "n_embd"),
        ("n_embd = 131072\nn_layer = 800", "n_embd"),
        ("vocab_size = 2147483647\nn_embd = 65536", "vocab_size"),
        ("block_size = 1125899906842624", "block_size"),
    ];
    for (model, field) in cases {
        let toml = dir.path().join("huge.toml");
        std::fs::write(&toml, format!("[model]\npreset = \"tiny\"\n{model}\n")).unwrap();
        refused(
            dir.path(),
            &["plan", "--config", toml.to_str().unwrap()],
            &[field, "parameters"],
        );
    }
}

#[test]
fn nonsense_epsilons_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("config.json");
    for (extra, field) in [
        (r#", "rms_norm_eps": -1e-5"#, "rms_norm_eps"),
        (r#", "rope_theta": 0"#, "rope_theta"),
    ] {
        std::fs::write(&json, llama_json("2", extra)).unwrap();
        refused(
            dir.path(),
            &["plan", "--hf-config", json.to_str().unwrap()],
            &[field, "must be a positive finite number"],
        );
    }
}

/// The deepest and widest published shapes are still planned (the bounds refuse only what
/// could not be).
#[test]
fn llama_405b_shape_still_plans() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("config.json");
    std::fs::write(
        &json,
        r#"{"model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248,
        "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0}"#,
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_snug"))
        .args([
            "plan",
            "--hf-config",
            json.to_str().unwrap(),
            "--batch",
            "1",
            "--block",
            "8",
        ])
        .args(["--vocab", "128256", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["parameters"].as_u64().unwrap() > 400_000_000_000, "{v}");
}
