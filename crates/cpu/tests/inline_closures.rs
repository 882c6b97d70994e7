//! The kernels' closures run at the CPU's vector level only where they are inlined into
//! [`snug_cpu::isa`]'s per-level wrappers; an uninlined closure is compiled for the baseline
//! (SSE2), and nothing but a benchmark would notice. So every closure handed to `vectorized`,
//! to the `par` helpers that call it, or to a staged output's `with` must carry
//! `#[inline(always)]`: this test reads the crate's sources and names each one that does not.

use std::path::{Path, PathBuf};

/// Calls whose closure argument runs inside a vectorised wrapper.
const CALLEES: [&str; 9] = [
    "vectorized(",
    "rows_mut(",
    "rows_mut2(",
    "elems_mut(",
    "for_each_item(",
    "for_each_head(",
    "staged_runs(",
    ".with(",
    "par::map(",
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        panic!("cannot list {}", dir.display())
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The closure among a call's arguments (`args`: the text after its `(`): the position of its
/// opening `|`, if it has one.
fn closure_start(args: &str) -> Option<usize> {
    let mut depth = 0i32;
    for (i, ch) in args.char_indices() {
        match ch {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => {
                if depth == 0 {
                    return None;
                }
                depth -= 1;
            }
            // A closure's opening bar at the call's own level (not `||` inside an argument's
            // expression, which sits deeper or follows an operand).
            '|' if depth == 0 => {
                let before = args[..i].trim_end();
                if before.is_empty() || before.ends_with(',') || before.ends_with(']') {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

#[test]
fn every_vectorised_closure_is_inlined_always() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    assert!(files.len() > 20, "found only {} sources", files.len());
    let (mut calls, mut missing) = (0, Vec::new());
    for file in &files {
        let Ok(text) = std::fs::read_to_string(file) else {
            panic!("cannot read {}", file.display())
        };
        for callee in CALLEES {
            for (at, _) in text.match_indices(callee) {
                let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
                let line = &text[line_start..];
                // Definitions and comments name the callee without calling it.
                let head = line.trim_start();
                if head.starts_with("//")
                    || head.starts_with("fn ")
                    || line[..at - line_start].contains("fn ")
                {
                    continue;
                }
                let args = &text[at + callee.len()..];
                let Some(bar) = closure_start(args) else {
                    continue;
                };
                // A thread-local's `with(|x| …)` runs no kernel loop; a staged output's
                // `with(run, buffer, |x| …)` does.
                if callee == ".with(" && args[..bar].trim().is_empty() {
                    continue;
                }
                calls += 1;
                if !args[..bar].trim_end().ends_with("#[inline(always)]") {
                    let line_no = text[..at].matches('\n').count() + 1;
                    missing.push(format!("{}:{line_no}: {callee}", file.display()));
                }
            }
        }
    }
    assert!(
        calls > 40,
        "found only {calls} closure calls: is the scan still finding them?"
    );
    assert!(
        missing.is_empty(),
        "closures without #[inline(always)], compiled for the baseline:\n{}",
        missing.join("\n")
    );
}
