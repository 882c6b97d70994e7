//! snug's trainer: from text to a trained model.
//!
//! - [`tokenizer`]: character-level and GPT-2 BPE tokenizers, and any of them by one name.
//! - [`hf_tokenizer`]: Hugging Face `tokenizer.json` and chat templates.
//! - [`examples`]: JSONL examples (text, prompt/completion, chat) into ids and loss masks,
//!   packed into one stream.
//! - [`token_file`]: prepared token files (`snug prepare`), memory-mapped for training.
//! - [`addition`]: the built-in addition language, its held-out problems, accuracy on them.
//! - [`data`]: the built-in generated data set, text files, token directories, deterministic
//!   per-step batches and a prefetching thread.
//! - [`config`]: the training configuration (TOML file, then command-line overrides).
//! - [`device`]: where the step runs (the CPU or a GPU), and the session over either.
//! - [`trainer`]: compiles the step, plans it, and runs it step by step.
//! - [`sample`]: text generation from a model's weights, on the planned inference graph.
//! - [`calibration`]: kernel timings of this machine for fit's cost model, cached.
//! - [`checkpoint`]: atomic safetensors checkpoints and resume.
//! - [`shards`]: sharded checkpoints of runs over several ranks: a file per rank, a manifest.
//! - [`ranks`]: the ranks of a run over MPI agreeing on their settings at start-up.
//! - [`run`]: the loop: evaluation, checkpoints, metrics file, clean stop on Ctrl-C.
//! - [`user_file`]: reading the files a user names: regular files only, with a size bound.
//! - [`output`]: writing where a user says: nothing replaced unless forced, and never a run
//!   directory or a checkpoint.

pub mod addition;
pub mod calibration;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod device;
mod error;
pub mod examples;
pub mod hf_tokenizer;
pub mod loss_scale;
pub mod output;
pub mod quantized;
pub mod ranks;
pub mod run;
pub mod run_dir;
pub mod sample;
pub mod shards;
pub mod token_file;
pub mod tokenizer;
pub mod trainer;
pub mod user_file;

pub use config::{ModelSection, OptimizerKind, Pass, Remat, TrainConfig, TrainSection};
#[cfg(feature = "clap")]
pub use config::{RunFlags, StepFlags};
pub use data::{Batch, DataSource, Prefetcher, TokenDataset, Tokens};
pub use device::{DeviceSpec, StepSession};
pub use error::TrainError;
pub use examples::{Example, PackedExamples, TokenizedExample};
pub use hf_tokenizer::{HfTokenizer, HfTokenizerFiles};
pub use loss_scale::LossScaler;
pub use run::{run, Event, RunSummary};
pub use run_dir::{Claim, RunDir};
pub use sample::{
    chat_prompt, ChatPrompt, KvStats, PhaseMemory, Placement, SampleMode, SampleOptions, Sampler,
};
pub use token_file::{StagedTokenFile, TokenFile, TokenFileProblem};
pub use tokenizer::{CharTokenizer, Gpt2Tokenizer, Tokenizer, TokenizerSpec};
pub use trainer::{EvalStats, LrSchedule, Recovery, StepStats, Trainer};
