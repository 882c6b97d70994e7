//! `snug export`: a checkpoint as a Hugging Face model directory (`config.json`,
//! `model.safetensors` in Hugging Face's names and layouts, and the tokenizer's files when the
//! run has a Hugging Face tokenizer), which transformers' `AutoModelForCausalLM.from_pretrained`
//! loads. GPT-2 and the Llama family (Llama, Mistral, Qwen2); the checkpoint may be a snug run or
//! itself a Hugging Face directory (converted to one f32 file).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;
use snug_train::hf_tokenizer::{CHAT_TEMPLATE_FILE, CONFIG_FILE, TOKENIZER_FILE};
use snug_train::{HfTokenizerFiles, Tokenizer};

use crate::sample_cmd::Source;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A run directory (its newest checkpoint), a checkpoint file, or a Hugging Face model
    /// directory.
    #[arg(long, value_name = "PATH")]
    checkpoint: PathBuf,
    /// Directory to write config.json, model.safetensors and the tokenizer's files into.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct ExportReport {
    checkpoint: PathBuf,
    step: u64,
    weights: PathBuf,
    config: PathBuf,
    /// tokenizer.json and what came with it, when the run has a Hugging Face tokenizer.
    tokenizer_files: Vec<PathBuf>,
    parameters: usize,
    bytes: u64,
}

/// The tokenizer's files to write beside the weights, by name.
fn tokenizer_files(files: &HfTokenizerFiles) -> Vec<(&'static str, &str)> {
    let mut out = vec![(TOKENIZER_FILE, files.tokenizer_json.as_str())];
    if let Some(t) = &files.tokenizer_config_json {
        out.push((CONFIG_FILE, t.as_str()));
    }
    if let Some(t) = &files.chat_template_jinja {
        out.push((CHAT_TEMPLATE_FILE, t.as_str()));
    }
    out
}

pub fn run(args: ExportArgs) -> Result<()> {
    let source = Source::open(&args.checkpoint)?;
    let model = source.model()?;
    // Everything is read and checked before anything is written.
    let tokenizer = match &source {
        Source::Run(..) => Some(source.tokenizer()?),
        Source::Hf(c) => c
            .dir()
            .join(TOKENIZER_FILE)
            .exists()
            .then(|| source.tokenizer())
            .transpose()?,
    };
    if let Some(t) = &tokenizer {
        t.check_model_vocab(model.vocab_size())?;
    }
    let hf_files = match &tokenizer {
        Some(Tokenizer::Hf(t)) => Some(t.files().clone()),
        _ => None,
    };
    let written = match &source {
        Source::Run(_, ckpt) => {
            // Straight from the loaded checkpoint: no second copy of its weights.
            let read = |name: &str, out: &mut [f32]| -> Result<(), snug_nn::NnError> {
                let t = ckpt.tensor(name).filter(|t| t.data.len() == out.len());
                let t = t.ok_or_else(|| snug_nn::NnError::MissingTensor {
                    path: args.checkpoint.display().to_string(),
                    name: name.to_string(),
                })?;
                out.copy_from_slice(&t.data);
                Ok(())
            };
            snug_nn::save_hf_model(&args.out, &model, &read)?
        }
        Source::Hf(ckpt) => {
            let read = |name: &str, out: &mut [f32]| ckpt.read_into(name, out);
            snug_nn::save_hf_model(&args.out, &model, &read)?
        }
    };
    let mut tokenizer_paths = Vec::new();
    if let Some(files) = &hf_files {
        for (name, text) in tokenizer_files(files) {
            let path = args.out.join(name);
            snug_nn::hf_checkpoint::write_file_atomically(&path, text.as_bytes())
                .with_context(|| format!("writing {}", path.display()))?;
            tokenizer_paths.push(path);
        }
    }
    let report = ExportReport {
        checkpoint: source.path(),
        step: source.step(),
        weights: written.weights,
        config: written.config,
        tokenizer_files: tokenizer_paths,
        parameters: written.parameters,
        bytes: written.bytes,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let extra = match report.tokenizer_files.len() {
            0 => String::new(),
            n => format!(" and {n} tokenizer file(s)"),
        };
        println!(
            "wrote {} ({} parameters, {} bytes), {}{extra} from {} (step {})",
            report.weights.display(),
            report.parameters,
            report.bytes,
            report.config.display(),
            report.checkpoint.display(),
            report.step
        );
    }
    Ok(())
}
