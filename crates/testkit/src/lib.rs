//! Helpers shared by snug's tests.
//!
//! A test that needs something from outside the repository (the tinyshakespeare corpus, a GPU,
//! MPI) calls [`skip_or_fail`] when it is absent and returns. On a developer's machine that is a
//! skip with a printed reason, so `cargo test` passes on a fresh clone; CI sets
//! `SNUG_REQUIRE_ALL_TESTS=1`, which makes the same call a failure, so nothing CI has is ever
//! skipped silently.

#[cfg(unix)]
pub mod bounded;
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub mod emulate;
pub mod fuzz;

use std::io::Write;
use std::path::PathBuf;

/// Set to `1` to make every skip a failure (CI does).
pub const REQUIRE_ALL_TESTS: &str = "SNUG_REQUIRE_ALL_TESTS";
/// Overrides where the tinyshakespeare corpus is looked for.
pub const CORPUS_VAR: &str = "SNUG_CORPUS";

/// The largest `|a[i] − b[i]|`, a NaN counted as infinitely far: a fold over `f64::max` skips
/// NaNs, so a kernel that wrote one would pass a bound checked that way. Panics if the lengths
/// differ.
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(
        a.len(),
        b.len(),
        "comparing {} values with {}",
        a.len(),
        b.len()
    );
    worst(a.iter().zip(b).map(|(x, y)| (x - y).abs()))
}

/// The largest of `errors` (0 for none), a NaN counted as infinite, for the same reason as
/// [`max_abs_diff`].
pub fn worst<E: Into<f64>>(errors: impl IntoIterator<Item = E>) -> f64 {
    errors
        .into_iter()
        .map(Into::into)
        .map(|e: f64| if e.is_nan() { f64::INFINITY } else { e })
        .fold(0.0, f64::max)
}

/// Deterministic test values in [-0.5, 0.5): a multiplicative hash of each index and the
/// seed, so no pattern a blocking or tiling bug could hide behind.
pub fn hashed_values(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let x = (i.wrapping_add(seed).wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 40;
            x as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// [`hashed_values`] doubled into [-1, 1), every 97th eight times larger again, so a
/// quantizer's blocks and channels differ in scale.
pub fn heavy_tailed_values(n: usize, seed: u64) -> Vec<f32> {
    hashed_values(n, seed)
        .into_iter()
        .enumerate()
        .map(|(i, v)| if i % 97 == 0 { 16.0 * v } else { 2.0 * v })
        .collect()
}

/// Whether the value of [`REQUIRE_ALL_TESTS`] asks for every test to run: set and neither
/// empty nor `0`.
pub fn requires_all(value: Option<&str>) -> bool {
    value.is_some_and(|v| !v.is_empty() && v != "0")
}

/// The line a skipped test prints.
pub fn skip_line(test: &str, reason: &str) -> String {
    format!("skipped: {test}: {reason}")
}

/// Reports that the current test cannot run, for `reason`. Panics (the test fails) when
/// `SNUG_REQUIRE_ALL_TESTS` is set; otherwise prints `skipped: <test>: <reason>` and returns,
/// and the caller returns too.
///
/// The line goes straight to the process's stderr: libtest captures only the `print!` family of
/// macros, so a skip shows in `cargo test`'s output even when the test passes.
pub fn skip_or_fail(reason: &str) {
    // libtest names each test's thread after the test.
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("<unnamed test>");
    let required = std::env::var(REQUIRE_ALL_TESTS).ok();
    if requires_all(required.as_deref()) {
        panic!("{test} cannot run and {REQUIRE_ALL_TESTS} is set: {reason}");
    }
    // Nothing useful to do if stderr is gone.
    let _ = writeln!(std::io::stderr().lock(), "{}", skip_line(test, reason));
}

/// The tinyshakespeare corpus (nanoGPT's `input.txt`): `$SNUG_CORPUS` if set, else
/// `../shared/data/tinyshakespeare.txt` beside the repository. `Err` says where it was looked
/// for, as a reason for [`skip_or_fail`].
pub fn tinyshakespeare() -> Result<PathBuf, String> {
    let path = match std::env::var_os(CORPUS_VAR) {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/data/tinyshakespeare.txt"),
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "needs the tinyshakespeare corpus, not found at {} (set {CORPUS_VAR} to its path)",
            path.display()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_values_are_deterministic_and_in_range() {
        let (a, b) = (hashed_values(1000, 7), hashed_values(1000, 7));
        assert_eq!(a, b);
        assert_ne!(a, hashed_values(1000, 8));
        assert!(a.iter().all(|v| (-0.5..0.5).contains(v)));
        let heavy = heavy_tailed_values(1000, 7);
        for (i, (&h, &v)) in heavy.iter().zip(&a).enumerate() {
            let want = if i % 97 == 0 { 16.0 * v } else { 2.0 * v };
            assert_eq!(h, want, "value {i}");
        }
        assert!(heavy.iter().any(|v| v.abs() > 1.0));
    }

    #[test]
    fn the_largest_difference_counts_a_nan_as_infinitely_far() {
        assert_eq!(max_abs_diff(&[1.0, -2.0, 3.0], &[1.5, 1.0, 3.0]), 3.0);
        assert_eq!(max_abs_diff(&[], &[]), 0.0);
        assert_eq!(max_abs_diff(&[f64::NAN, 0.0], &[0.0, 0.0]), f64::INFINITY);
        assert_eq!(max_abs_diff(&[0.0, 0.0], &[0.0, f64::NAN]), f64::INFINITY);
        assert_eq!(worst([0.5f32, 2.0, 1.0]), 2.0);
        assert_eq!(worst([0.5f32, f32::NAN]), f64::INFINITY);
        assert_eq!(worst(Vec::<f32>::new()), 0.0);
    }

    #[test]
    fn only_a_set_non_zero_value_requires_all() {
        assert!(!requires_all(None));
        assert!(!requires_all(Some("")));
        assert!(!requires_all(Some("0")));
        assert!(requires_all(Some("1")));
        assert!(requires_all(Some("true")));
    }

    #[test]
    fn the_skip_line_names_the_test_and_the_reason() {
        assert_eq!(
            skip_line("a::b", "no GPU"),
            "skipped: a::b: no GPU".to_string()
        );
    }
}
