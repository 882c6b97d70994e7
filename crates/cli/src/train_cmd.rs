//! `snug train`: compile, plan and run the training loop, reporting loss, speed and memory.

use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;
use snug_plan::memory_plan::human_bytes;
use snug_runtime::process::resident_set;
use snug_runtime::Allocator;
use snug_train::{DataSource, TokenDataset, TrainConfig, Trainer};

use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct TrainArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Optimizer steps to run.
    #[arg(long)]
    steps: Option<u64>,
    /// Peak learning rate (AdamW).
    #[arg(long, allow_negative_numbers = true)]
    lr: Option<f32>,
    /// Seed for initialisation and batch sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Print a line every this many steps.
    #[arg(long)]
    log_every: Option<u64>,
    /// Cap on the memory snug holds, e.g. 1.5GiB or 800MB (relaxed: exceeded only when
    /// freeing cached buffers cannot make room, and reported).
    #[arg(long, value_name = "SIZE")]
    memory_limit: Option<String>,
    /// Make --memory-limit strict: an allocation over it fails with an out-of-memory error.
    #[arg(long, requires = "memory_limit")]
    strict: bool,
    /// One JSON object per step, then a summary object.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Summary {
    steps: u64,
    first_loss: f32,
    final_loss: f32,
    median_step_ms: f64,
    min_step_ms: f64,
    max_step_ms: f64,
    tokens_per_step: usize,
    tokens_per_s: f64,
    model_flops_per_s: f64,
    predicted_peak_bytes: usize,
    measured_peak_bytes: usize,
    lower_bound_bytes: usize,
    arena_bytes: usize,
    peak_rss_bytes: Option<usize>,
    cache_bytes: usize,
    memory_limit_bytes: Option<usize>,
    limit_overruns: u64,
    parameters: usize,
}

pub fn run(args: TrainArgs) -> Result<()> {
    let (model, mut train) = args.model.sections();
    train.steps = args.steps;
    train.lr = args.lr;
    train.seed = args.seed;
    train.log_every = args.log_every;
    train.memory_limit = args.memory_limit.clone();
    if args.strict {
        train.strict_memory_limit = Some(true);
    }
    let cfg = TrainConfig::resolve(args.model.config.as_deref(), &model, &train)?;
    let data = TokenDataset::load(&DataSource::from(&cfg.data))?;
    let json = args.json;
    if !json {
        println!("config: {}", serde_json::to_string(&cfg)?);
        println!(
            "data: {} ({} train / {} val tokens, vocab {})",
            data.name,
            data.train.len(),
            data.val.len(),
            data.tokenizer.vocab_size()
        );
    }
    let allocator = Allocator::cpu();
    let mut trainer = Trainer::with_allocator(cfg.clone(), data, allocator.clone())
        .context("setting up training")?;
    let plan = trainer.plan().clone();
    let params = trainer.step_graph().parameter_count();
    let tokens_per_step = cfg.batch * cfg.block;
    let flops_per_step = trainer.model().flops_per_token(cfg.block) as f64 * tokens_per_step as f64;
    if !json {
        println!(
            "model: {} parameters; step of {} tokens; predicted peak {} (persistent {}, arena {}, lower bound {})",
            params,
            tokens_per_step,
            human_bytes(plan.peak_bytes()),
            human_bytes(plan.persistent_bytes),
            human_bytes(plan.arena_bytes),
            human_bytes(plan.lower_bound_bytes)
        );
    }
    let mut times = Vec::with_capacity(cfg.steps as usize);
    let (mut first_loss, mut last_loss) = (f32::NAN, f32::NAN);
    for _ in 0..cfg.steps {
        let s = trainer.train_step()?;
        if s.step == 1 {
            first_loss = s.loss;
        }
        last_loss = s.loss;
        times.push(s.ms);
        if json {
            println!("{}", serde_json::to_string(&s)?);
        } else if s.step % cfg.log_every == 0 || s.step == 1 || s.step == cfg.steps {
            println!(
                "step {:>5}/{} | loss {:.4} | lr {:.2e} | {:>8.0} tok/s | {:>7.1} ms | mem {} / peak {} / cache {}",
                s.step,
                cfg.steps,
                s.loss,
                s.lr,
                s.tokens_per_s,
                s.ms,
                human_bytes(s.active_bytes),
                human_bytes(s.peak_bytes),
                human_bytes(s.cache_bytes)
            );
        }
    }
    // The first step pays for page faults and thread start-up: leave it out when there are more.
    let steady: Vec<f64> = if times.len() > 1 {
        times[1..].to_vec()
    } else {
        times.clone()
    };
    let (median, min, max) = stats(&steady);
    let summary = Summary {
        steps: cfg.steps,
        first_loss,
        final_loss: last_loss,
        median_step_ms: median,
        min_step_ms: min,
        max_step_ms: max,
        tokens_per_step,
        tokens_per_s: tokens_per_step as f64 / (median / 1e3),
        model_flops_per_s: flops_per_step / (median / 1e3),
        predicted_peak_bytes: plan.peak_bytes(),
        measured_peak_bytes: allocator.peak_bytes(),
        lower_bound_bytes: plan.lower_bound_bytes,
        arena_bytes: plan.arena_bytes,
        peak_rss_bytes: resident_set().map(|(_, peak)| peak),
        cache_bytes: allocator.cache_bytes(),
        memory_limit_bytes: cfg.memory_limit,
        limit_overruns: allocator.stats().limit_overruns,
        parameters: params,
    };
    if json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        println!(
            "done: loss {:.4} -> {:.4}; median step {:.1} ms (min {:.1}, max {:.1}), {:.0} tok/s, {:.1} model GFLOP/s",
            summary.first_loss,
            summary.final_loss,
            median,
            min,
            max,
            summary.tokens_per_s,
            summary.model_flops_per_s / 1e9
        );
        println!(
            "memory: predicted peak {} B, measured peak {} B ({}), peak RSS {}",
            summary.predicted_peak_bytes,
            summary.measured_peak_bytes,
            if summary.predicted_peak_bytes == summary.measured_peak_bytes {
                "exact"
            } else {
                "MISMATCH"
            },
            summary.peak_rss_bytes.map_or("n/a".into(), human_bytes)
        );
        if summary.limit_overruns > 0 {
            println!(
                "warning: {} allocation(s) exceeded the relaxed memory limit of {} B",
                summary.limit_overruns,
                cfg.memory_limit.unwrap_or(usize::MAX)
            );
        }
    }
    Ok(())
}

fn stats(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let median = if s.is_empty() {
        0.0
    } else if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    };
    (
        median,
        s.first().copied().unwrap_or(0.0),
        s.last().copied().unwrap_or(0.0),
    )
}
