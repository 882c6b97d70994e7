use std::path::PathBuf;

/// Why a report could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error(
        "plan JSON of format version {}, but this snug reads version {expected}: write it \
         again with this snug's `snug plan --json`",
        found.map_or_else(|| "none (no `format_version` field)".to_string(), |v| v.to_string())
    )]
    PlanVersion { found: Option<u64>, expected: u32 },
    #[error("plan JSON: {0}")]
    PlanJson(serde_json::Error),
    #[error("plan JSON: {0}")]
    PlanInconsistent(String),
    #[error("fit JSON: {0}")]
    FitJson(serde_json::Error),
    #[error("{path}: line {line}: {detail}")]
    MetricsLine {
        path: PathBuf,
        line: usize,
        detail: String,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("drawing the {chart} chart: {detail}")]
    Chart { chart: &'static str, detail: String },
    #[error("encoding JSON: {0}")]
    Encode(serde_json::Error),
}
