//! fit's candidate table as `snug fit --json` writes it.

use serde::{Deserialize, Serialize};

use crate::ReportError;

/// The knobs of one candidate, as text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FitKnobs {
    pub micro_batch: usize,
    pub accumulation: usize,
    pub remat: String,
    #[serde(default)]
    pub passes: Vec<String>,
    pub precision: String,
}

impl FitKnobs {
    pub fn label(&self) -> String {
        let passes = if self.passes.is_empty() {
            "-".to_string()
        } else {
            self.passes.join(",")
        };
        format!(
            "{}×{} remat {} {} {}",
            self.micro_batch, self.accumulation, self.remat, passes, self.precision
        )
    }
}

/// One configuration fit considered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FitCandidate {
    pub config: FitKnobs,
    pub peak_bytes: Option<usize>,
    pub predicted_seconds: Option<f64>,
    /// `chosen`, `over_budget`, `over_lower_bound` (not planned), `slower` or `failed`.
    pub verdict: String,
    #[serde(default)]
    pub ratio: Option<f64>,
    /// With `over_lower_bound`: the parameters and optimizer state that alone exceed the
    /// budget.
    #[serde(default)]
    pub lower_bound_bytes: Option<usize>,
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FitDocument {
    pub budget: usize,
    pub effective_batch: usize,
    pub block: usize,
    pub calibrated: bool,
    pub candidates: Vec<FitCandidate>,
    /// Index into `candidates`.
    pub chosen: Option<usize>,
}

impl FitDocument {
    pub fn from_json(text: &str) -> Result<FitDocument, ReportError> {
        let doc: FitDocument = serde_json::from_str(text).map_err(ReportError::FitJson)?;
        if let Some(i) = doc.chosen {
            if i >= doc.candidates.len() {
                return Err(ReportError::FitJson(serde::de::Error::custom(format!(
                    "`chosen` is {i} but there are {} candidates",
                    doc.candidates.len()
                ))));
            }
        }
        Ok(doc)
    }

    pub fn chosen(&self) -> Option<&FitCandidate> {
        self.chosen.and_then(|i| self.candidates.get(i))
    }
}
