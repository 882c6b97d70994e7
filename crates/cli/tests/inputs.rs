//! Inputs a user should not give, given to the `snug` binary: absurd counts, data that is a
//! device, a FIFO or enormous. Each must end quickly with a named error (exit 1): no panic
//! (exit 101), no abort (a signal), no hang, and little memory (the child's peak RSS, from the
//! kernel's accounting of it).
#![cfg(unix)]

use std::process::Command;
use std::time::Duration;

use snug_testkit::bounded::{self, mkfifo, Ended};

/// Longest any of these runs may take; the child is killed (and the test fails) after it.
const TIMEOUT: Duration = Duration::from_secs(20);
/// Far above what refusing an input costs (a few MB), far below what obeying it would.
const RSS_BOUND: u64 = 100 << 20;

/// Runs `snug args` within [`TIMEOUT`]; the test fails if it had to be killed.
fn run(args: &[&str]) -> Ended {
    // A `train` without --out saves under ./runs: keep it out of the source tree.
    let cwd = tempfile::tempdir().expect("a scratch directory");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_snug"));
    cmd.args(args).current_dir(cwd.path());
    bounded::run_to_end(cmd, TIMEOUT, &format!("snug {args:?}"))
}

/// `snug args` fails with exit 1, quickly and in little memory, and its error holds `needles`.
fn refused(args: &[&str], needles: &[&str]) -> Ended {
    let e = run(args);
    bounded::assert_refused(&e, &format!("snug {args:?}"), needles, RSS_BOUND);
    e
}

/// `--tokens` beyond what one run generates is refused before any work: today's largest
/// values overflowed a reservation (a panic) or asked for terabytes (an abort). An ordinary
/// count from the same checkpoint still works.
#[test]
fn sample_refuses_absurd_token_counts() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let run_s = run_dir.to_str().unwrap();
    let trained = run(&[
        "train",
        "--steps",
        "1",
        "--batch",
        "2",
        "--threads",
        "1",
        "--eval-every",
        "0",
        "--out",
        run_s,
        "--json",
    ]);
    assert_eq!(trained.code, Some(0), "{}", trained.stderr);

    for tokens in ["18446744073709551615", "1000000000000", "1000001"] {
        refused(
            &[
                "sample",
                "--checkpoint",
                run_s,
                "--tokens",
                tokens,
                "--threads",
                "1",
            ],
            &["--tokens", tokens, "1000000"],
        );
    }
    let ok = run(&[
        "sample",
        "--checkpoint",
        run_s,
        "--tokens",
        "5",
        "--threads",
        "1",
        "--json",
    ]);
    assert_eq!(ok.code, Some(0), "{}", ok.stderr);
    let report: serde_json::Value = serde_json::from_str(&ok.stdout).unwrap();
    assert_eq!(report["tokens"], 5);
}

/// A character device and a FIFO with no writer, given as text data, as a prepared token file,
/// to `prepare`, as a TOML configuration and as a Hugging Face `config.json`: each is refused by its type, naming it, before a byte is
/// read (today /dev/zero is read for gigabytes and the FIFO blocks forever).
#[test]
fn data_that_is_not_a_regular_file_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("corpus.fifo");
    mkfifo(&fifo);
    let fifo_s = fifo.to_str().unwrap();
    for (path, kind) in [("/dev/zero", "character device"), (fifo_s, "FIFO")] {
        refused(&["train", "--data", path, "--steps", "1"], &[path, kind]);
        refused(&["plan", "--data", path], &[path, kind]);
        let out = dir.path().join("prepared");
        refused(
            &[
                "prepare",
                "--input",
                path,
                "--tokenizer",
                "char",
                "--out",
                out.to_str().unwrap(),
            ],
            &[path, kind],
        );
        refused(&["train", "--config", path], &[path, kind]);
        refused(&["plan", "--hf-config", path], &[path, kind]);
    }

    // A token directory whose train.bin is a FIFO.
    let tokens = dir.path().join("tokens");
    std::fs::create_dir(&tokens).unwrap();
    mkfifo(&tokens.join("train.bin"));
    mkfifo(&tokens.join("val.bin"));
    refused(
        &["train", "--data", tokens.to_str().unwrap(), "--steps", "1"],
        &["train.bin", "FIFO"],
    );
}

/// A regular text file larger than snug reads into memory is refused from its size, without
/// reading it (a sparse file: it takes no disk).
#[test]
fn text_data_beyond_the_cap_is_refused_from_its_size() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.txt");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(snug_train::user_file::MAX_TEXT_BYTES + 1)
        .unwrap();
    drop(f);
    let e = refused(
        &["train", "--data", big.to_str().unwrap(), "--steps", "1"],
        &["big.txt", "4.00 GiB", "text data"],
    );
    assert!(e.seconds < 10.0, "{} s", e.seconds);
}
