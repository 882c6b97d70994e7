//! `skip_or_fail` as `cargo test` shows it: this test binary runs its own ignored child tests
//! in a new process, captured as libtest captures any test, with and without
//! `SNUG_REQUIRE_ALL_TESTS`.

use std::process::{Command, Output};

use snug_testkit::{skip_or_fail, tinyshakespeare, CORPUS_VAR, REQUIRE_ALL_TESTS};

/// Runs the ignored test `name` of this binary alone, output captured by libtest.
fn child(name: &str, env: &[(&str, &str)]) -> Output {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", name, "--ignored", "--test-threads", "2"])
        .env_remove(REQUIRE_ALL_TESTS)
        .env_remove(CORPUS_VAR);
    cmd.envs(env.iter().copied());
    cmd.output().expect("the test binary runs")
}

#[test]
#[ignore = "run by skips_print_outside_capture_and_fail_when_all_are_required"]
fn child_skips() {
    skip_or_fail("no such thing here");
}

#[test]
#[ignore = "run by a_missing_corpus_is_a_skip_naming_its_path"]
fn child_needs_the_corpus() {
    if let Err(reason) = tinyshakespeare() {
        skip_or_fail(&reason);
    }
}

#[test]
fn skips_print_outside_capture_and_fail_when_all_are_required() {
    let o = child("child_skips", &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("skipped: child_skips: no such thing here"),
        "stderr: {err}"
    );

    for value in ["1", "true"] {
        let o = child("child_skips", &[(REQUIRE_ALL_TESTS, value)]);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(!o.status.success(), "{REQUIRE_ALL_TESTS}={value} passed");
        assert!(out.contains("no such thing here"), "stdout: {out}");
        assert!(out.contains(REQUIRE_ALL_TESTS), "stdout: {out}");
    }
    // `0` is the same as unset.
    let o = child("child_skips", &[(REQUIRE_ALL_TESTS, "0")]);
    assert!(o.status.success());
}

#[test]
fn a_missing_corpus_is_a_skip_naming_its_path() {
    let o = child(
        "child_needs_the_corpus",
        &[(CORPUS_VAR, "/nonexistent/corpus.txt")],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("skipped: child_needs_the_corpus: needs the tinyshakespeare corpus, not found at /nonexistent/corpus.txt"),
        "stderr: {err}"
    );
    let o = child(
        "child_needs_the_corpus",
        &[
            (CORPUS_VAR, "/nonexistent/corpus.txt"),
            (REQUIRE_ALL_TESTS, "1"),
        ],
    );
    assert!(!o.status.success());
    // A corpus that is there runs the test: this file stands in for it.
    let here = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/skip.rs");
    let o = child(
        "child_needs_the_corpus",
        &[(CORPUS_VAR, here), (REQUIRE_ALL_TESTS, "1")],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("skipped"), "{err}");
}
