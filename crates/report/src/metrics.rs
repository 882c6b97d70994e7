//! A run's `metrics.jsonl` (written by `snug train`): one JSON object per line, tagged by
//! `kind` (`step`, `eval`, `recovery`). A run killed mid-write leaves a last line without its
//! newline; that line is skipped and said so. A bad line anywhere else is an error: the file
//! was damaged some other way.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::ReportError;

/// One training step's figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepLine {
    pub step: u64,
    pub loss: f32,
    pub lr: f32,
    #[serde(default)]
    pub skipped: bool,
    pub ms: f64,
    pub tokens_per_s: f64,
    pub active_bytes: usize,
    pub peak_bytes: usize,
    #[serde(default)]
    pub rss_bytes: Option<usize>,
}

/// One evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalLine {
    pub step: u64,
    pub train_loss: f32,
    pub val_loss: f32,
}

/// A step redone with a smaller configuration after running out of memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecoveryLine {
    pub step: u64,
    pub from_peak_bytes: usize,
    pub to_peak_bytes: usize,
}

/// A line left out, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedLine {
    /// 1-based.
    pub line: usize,
    pub reason: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunMetrics {
    pub steps: Vec<StepLine>,
    pub evals: Vec<EvalLine>,
    pub recoveries: Vec<RecoveryLine>,
    pub skipped: Vec<SkippedLine>,
}

#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Line {
    Step(StepLine),
    Eval(EvalLine),
    Recovery(RecoveryLine),
}

impl RunMetrics {
    pub fn read(path: &Path) -> Result<RunMetrics, ReportError> {
        let bytes = std::fs::read(path).map_err(|source| ReportError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let text = String::from_utf8(bytes).map_err(|e| {
            let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
            ReportError::MetricsLine {
                path: path.to_path_buf(),
                line: valid.iter().filter(|&&b| b == b'\n').count() + 1,
                detail: "not UTF-8 text".into(),
            }
        })?;
        RunMetrics::parse(&text, path)
    }

    /// Parses the file's text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<RunMetrics, ReportError> {
        let mut metrics = RunMetrics::default();
        let lines: Vec<&str> = text.split_inclusive('\n').collect();
        for (i, raw) in lines.iter().enumerate() {
            let line = raw.trim_end_matches(['\n', '\r']);
            if line.trim().is_empty() {
                continue;
            }
            let complete = raw.ends_with('\n');
            // A kind this version does not draw (a later snug's) is not an error.
            let value: serde_json::Value = match serde_json::from_str(line) {
                Ok(v) => v,
                Err(_) if !complete && i + 1 == lines.len() => {
                    metrics.skipped.push(SkippedLine {
                        line: i + 1,
                        reason: "truncated: the last line has no end (the run stopped while \
                                 writing it)"
                            .into(),
                    });
                    continue;
                }
                Err(e) => {
                    return Err(ReportError::MetricsLine {
                        path: path.to_path_buf(),
                        line: i + 1,
                        detail: e.to_string(),
                    })
                }
            };
            let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or("");
            if !matches!(kind, "step" | "eval" | "recovery") {
                metrics.skipped.push(SkippedLine {
                    line: i + 1,
                    reason: format!("unknown kind `{kind}`"),
                });
                continue;
            }
            match serde_json::from_value::<Line>(value) {
                Ok(Line::Step(s)) => metrics.steps.push(s),
                Ok(Line::Eval(e)) => metrics.evals.push(e),
                Ok(Line::Recovery(r)) => metrics.recoveries.push(r),
                Err(e) => {
                    return Err(ReportError::MetricsLine {
                        path: path.to_path_buf(),
                        line: i + 1,
                        detail: e.to_string(),
                    })
                }
            }
        }
        Ok(metrics)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STEP1: &str = r#"{"kind":"step","step":1,"loss":2.5,"lr":0.001,"grad_norm":1.0,"loss_scale":null,"skipped":false,"ms":10.0,"tokens_per_s":1000.0,"tokens_seen":64,"active_bytes":100,"peak_bytes":200,"cache_bytes":0,"rss_bytes":300}"#;

    #[test]
    fn a_truncated_last_line_is_skipped_and_named() {
        let text = format!("{STEP1}\n{}", &STEP1[..40]);
        let m = RunMetrics::parse(&text, Path::new("m.jsonl")).unwrap();
        assert_eq!(m.steps.len(), 1);
        assert_eq!(m.steps[0].peak_bytes, 200);
        assert_eq!(m.steps[0].rss_bytes, Some(300));
        assert_eq!(m.skipped.len(), 1);
        assert_eq!(m.skipped[0].line, 2);
    }

    #[test]
    fn a_bad_line_before_the_end_is_an_error_naming_it() {
        let text = format!("{}\n{STEP1}\n", &STEP1[..40]);
        match RunMetrics::parse(&text, Path::new("m.jsonl")) {
            Err(ReportError::MetricsLine { line: 1, .. }) => {}
            other => panic!("expected a line-1 error, got {other:?}"),
        }
    }

    #[test]
    fn bytes_that_are_not_text_are_named_by_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut bytes = format!("{STEP1}\n{STEP1}\n").into_bytes();
        bytes.extend(b"{\"kind\": \"st\xffep\"}\n");
        std::fs::write(&path, bytes).unwrap();
        match RunMetrics::read(&path) {
            Err(ReportError::MetricsLine {
                line: 3, detail, ..
            }) => {
                assert_eq!(detail, "not UTF-8 text")
            }
            other => panic!("expected a line-3 error, got {other:?}"),
        }
    }

    #[test]
    fn evals_and_recoveries_are_read() {
        let text = format!(
            "{STEP1}\n{}\n{}\n",
            r#"{"kind":"eval","step":1,"train_loss":2.0,"val_loss":2.25,"ms":3.0}"#,
            r#"{"kind":"recovery","step":1,"micro":0,"failure":{},"from":{},"to":{},"from_peak_bytes":900,"to_peak_bytes":500}"#
        );
        let m = RunMetrics::parse(&text, Path::new("m.jsonl")).unwrap();
        assert_eq!(m.evals[0].val_loss, 2.25);
        assert_eq!(m.recoveries[0].to_peak_bytes, 500);
        assert!(m.skipped.is_empty());
    }
}
