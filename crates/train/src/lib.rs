//! snug's trainer: from text to a trained model.
//!
//! - [`tokenizer`]: character-level tokenizer.
//! - [`data`]: the built-in generated data set, text files, and batch sampling.
//! - [`config`]: the training configuration (TOML file, then command-line overrides).
//! - [`trainer`]: compiles the step, plans it, and runs the loop.

pub mod config;
pub mod data;
mod error;
pub mod tokenizer;
pub mod trainer;

pub use config::{ModelSection, OptimizerKind, TrainConfig, TrainSection};
pub use data::{DataSource, TokenDataset};
pub use error::TrainError;
pub use tokenizer::CharTokenizer;
pub use trainer::{LrSchedule, StepStats, Trainer};
