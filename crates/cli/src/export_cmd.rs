//! `snug export`: a checkpoint's GPT-2 weights as a Hugging Face model directory
//! (`model.safetensors` in GPT2Model names and Conv1D layout, and `config.json`), which
//! `transformers.GPT2LMHeadModel.from_pretrained` loads.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use snug_nn::ModelConfig;
use snug_train::checkpoint;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A run directory (its newest checkpoint) or a checkpoint file.
    #[arg(long, value_name = "PATH")]
    checkpoint: PathBuf,
    /// Directory to write model.safetensors and config.json into.
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
    parameters: usize,
    bytes: u64,
}

pub fn run(args: ExportArgs) -> Result<()> {
    let (path, ckpt) = checkpoint::load(&args.checkpoint)?;
    let ModelConfig::Gpt(gpt) = ckpt.model()? else {
        bail!(
            "{}: Hugging Face export supports GPT-2 models; this checkpoint holds a Llama",
            path.display()
        );
    };
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let weights = args.out.join("model.safetensors");
    let config = args.out.join("config.json");
    let params = ckpt.parameters();
    snug_nn::save_gpt2_safetensors(&weights, &gpt, &params)?;
    snug_nn::write_hf_config_json(&config, &gpt)?;
    let report = ExportReport {
        checkpoint: path,
        step: ckpt.step,
        bytes: std::fs::metadata(&weights).map(|m| m.len()).unwrap_or(0),
        weights,
        config,
        parameters: params.iter().map(|(_, v)| v.len()).sum(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "wrote {} ({} parameters, {} bytes) and {} from {} (step {})",
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
