//! `snug plan`: the memory plan of one training step, or with `--inference` of sampling, from
//! shapes alone.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use serde::Serialize;
use snug_graph::DType;
use snug_nn::ModelConfig;
use snug_plan::memory_plan::human_bytes;
use snug_plan::{plan, Breakdown, PeakInfo, PlanOptions, ScheduleKind, Strategy};
use snug_train::{RunFlags, TrainConfig};

use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Also print the allocation table (offset, size, lifetime of every arena tensor).
    #[arg(long)]
    table: bool,
    /// Plan for this CPU's GEMM instead of this machine's: avx512, avx2 or portable (it sizes
    /// some fused ops' tiles, hence their scratch). CPU only.
    #[arg(long, value_name = "GEMM")]
    target_cpu: Option<snug_graph::CpuGemm>,
    /// Plan sampling instead of a training step: the graph `snug sample` runs on a checkpoint
    /// trained with these flags (batch 1 over the model's context, f32, no gradients or
    /// optimizer state; the training flags --batch, --block, --precision, --remat, --passes
    /// and --optimizer do not apply).
    #[arg(long)]
    inference: bool,
    /// With --inference: plan what `snug sample` holds with its key/value cache (its default):
    /// one decode step against caches of the whole window, with the prefill of a whole window
    /// (the largest prompt) beside it. Without it: the whole-window graph of
    /// `snug sample --full-window`.
    #[arg(long, requires = "inference")]
    kv_cache: bool,
    /// With --inference: the positions `snug sample --context N` holds (default: the model's
    /// whole context, the most any request holds).
    #[arg(long, value_name = "N", requires = "inference")]
    context: Option<usize>,
    /// Plan one rank of a data-parallel run over this many devices: each rank's batch is
    /// --batch / N (N must divide it), and the report adds the bytes each rank sends and
    /// receives per step.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=snug_train::config::MAX_DEVICES as u64))]
    devices: u64,
    /// ZeRO stage: 0 replicates everything, 1 shards optimizer state, 2 also gradients, 3 also
    /// parameters (gathered per weight before its forward and its backward).
    #[arg(long, value_name = "STAGE", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    shard: u8,
    /// Link bandwidth per rank in GB/s (each way): predicts the step's communication time.
    #[arg(long, value_name = "GB/s")]
    link: Option<f64>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// What one rank of a data-parallel run holds and exchanges.
#[derive(Serialize)]
struct DistributedReport {
    devices: usize,
    /// ZeRO stage (0 to 3).
    shard: u8,
    /// Sequences each rank draws per step (--batch / devices).
    per_rank_batch: usize,
    /// Every rank's planned peak (all ranks plan alike: shards are padded to equal sizes).
    per_rank_peak_bytes: usize,
    comm: snug_graph::CommVolume,
    link_gb_per_s: Option<f64>,
    /// Communication time per step over the link, nothing overlapped.
    predicted_comm_ms: Option<f64>,
    /// Where each bucketed gradient collective starts and is waited for in the schedule, and
    /// where the backward ends: the bytes of those starting before it travel while it runs.
    overlap: snug_plan::Overlap,
}

/// A memory plan's figures, as both reports give them.
#[derive(Serialize)]
struct PlanFigures {
    /// The layout of this document, which `snug report --plan-json` checks.
    format_version: u32,
    peak_bytes: usize,
    persistent_bytes: usize,
    arena_bytes: usize,
    lower_bound_bytes: usize,
    arena_over_lower_bound: f64,
    breakdown: Breakdown,
    schedule: ScheduleKind,
    program_order_peak_bytes: usize,
    strategy: Strategy,
    strategy_arenas: Vec<(Strategy, usize)>,
    /// The arena's chunks in bytes, one device buffer each, where it needs more than one
    /// (a GPU whose largest buffer is smaller than the arena); absent otherwise.
    #[serde(skip_serializing_if = "one_chunk")]
    arena_chunks: Vec<usize>,
    peak: PeakInfo,
    /// Bytes held while each op of the schedule runs.
    timeline: Vec<usize>,
    /// Each position's op and phase, and the bytes each role holds there.
    timeline_detail: snug_report::TimelineDetail,
}

impl PlanFigures {
    fn of(
        p: &snug_plan::MemoryPlan,
        graph: &snug_graph::Graph,
        forward_nodes: usize,
    ) -> PlanFigures {
        PlanFigures {
            format_version: snug_report::PLAN_FORMAT_VERSION,
            peak_bytes: p.peak_bytes(),
            persistent_bytes: p.persistent_bytes,
            arena_bytes: p.arena_bytes,
            lower_bound_bytes: p.lower_bound_bytes,
            arena_over_lower_bound: 1.0 + p.fragmentation(),
            breakdown: p.breakdown.clone(),
            schedule: p.schedule_kind,
            program_order_peak_bytes: p.program_order_peak_bytes,
            strategy: p.strategy,
            strategy_arenas: p.strategy_arenas.clone(),
            arena_chunks: p.chunks().to_vec(),
            peak: p.peak.clone(),
            timeline: p.timeline.clone(),
            timeline_detail: snug_report::TimelineDetail::of(p, graph, forward_nodes),
        }
    }
}

fn one_chunk(chunks: &[usize]) -> bool {
    chunks.len() <= 1
}

#[derive(Serialize)]
struct PlanReport {
    preset: String,
    model: ModelConfig,
    precision: DType,
    batch: usize,
    /// Micro-batches per step: each forward/backward pass sees batch / accumulation.
    accumulation: usize,
    /// 0: no clipping.
    grad_clip: f32,
    block: usize,
    threads: usize,
    /// The CPU GEMM planned for (`portable` on a GPU, where no CPU GEMM runs).
    target_cpu: snug_graph::CpuGemm,
    /// The GPU planned for (`--device gpu`): the device flag, and the adapter's memory layout
    /// (its own limits, or snug-gpu's documented default where this machine has none).
    #[serde(skip_serializing_if = "Option::is_none")]
    device: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    memory_layout: Option<snug_graph::MemoryLayout>,
    /// Parameters the step trains (with LoRA, the adapters').
    parameters: usize,
    /// Parameters read but not trained (LoRA's frozen base).
    #[serde(skip_serializing_if = "is_zero")]
    frozen_parameters: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    lora: Option<snug_nn::LoraConfig>,
    /// The optimizer, when it is 8-bit AdamW.
    #[serde(skip_serializing_if = "Option::is_none")]
    optimizer: Option<&'static str>,
    /// With --fused-update: the norm clipping bounds (`tensor`, `previous`, or `none`).
    #[serde(skip_serializing_if = "Option::is_none")]
    fused_update: Option<&'static str>,
    /// How the frozen base is stored (bf16, int8, nf4), when not in f32.
    #[serde(skip_serializing_if = "Option::is_none")]
    quantize_base: Option<snug_graph::ops::QuantizeBase>,
    /// Kernels that read or write bf16 activations or gradients as stored (bf16 on a CPU),
    /// where casts made f32 copies for them otherwise.
    #[serde(skip_serializing_if = "is_zero")]
    bf16_kernels: usize,
    /// Of those, products (on a CPU with our GEMM), widening as they pack.
    #[serde(skip_serializing_if = "is_zero")]
    bf16_products: usize,
    nodes: usize,
    tensors: usize,
    flops_per_step: u64,
    /// fit's cost model on this machine's cached calibration (`snug fit` makes one).
    predicted_step_ms: Option<f64>,
    #[serde(flatten)]
    figures: PlanFigures,
    plan_ms: f64,
    /// What each pass saved at the planned peak.
    passes: Vec<PassSaving>,
    /// Activation checkpointing mode (`none`, `block`, `block:K`, `selective`, `budget:BYTES`).
    remat: String,
    /// The remat mode asked for, left out because it would not lower the peak.
    remat_dropped: Option<snug_compile::RematDropped>,
    /// With --devices or --shard: the rank's share of the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    distributed: Option<DistributedReport>,
}

#[derive(Serialize)]
struct PassSaving {
    pass: String,
    peak_before_bytes: usize,
    peak_after_bytes: usize,
    saved_bytes: i64,
}

/// `snug plan --inference --json`: the plan `snug sample` holds, in exact bytes.
#[derive(Serialize)]
struct InferenceReport {
    preset: String,
    model: ModelConfig,
    /// Always 1: the sampler generates one sequence.
    batch: usize,
    /// Positions each token's forward pass runs over, or with the key/value cache the rows of
    /// each cache: the model's context, or `--context`.
    window: usize,
    threads: usize,
    /// The plan is of a decode step with key/value caches (else of the whole window).
    kv_cache: bool,
    /// With the key/value cache: the peak of a prefill of the whole window, the largest the
    /// sampler holds (the figures below are the decode step's).
    #[serde(skip_serializing_if = "Option::is_none")]
    prefill_window_peak_bytes: Option<usize>,
    /// The most `snug sample` holds at once: with the key/value cache the larger of the
    /// decode step's peak and a whole-window prefill's (the prefill's, as a rule); else the
    /// full-window forward's peak.
    sample_peak_bytes: usize,
    parameters: usize,
    nodes: usize,
    tensors: usize,
    /// One forward pass over the window, which each generated token costs.
    flops_per_token: u64,
    #[serde(flatten)]
    figures: PlanFigures,
    plan_ms: f64,
}

/// What a remat mode left out would have done to the peak: it is left out where it does not
/// lower it, which includes leaving it as it was. Exact bytes where the rounded figures agree.
/// A step's floating-point operations in GFLOP, or, where the count saturated (an absurd
/// batch, planned only to be refused), what it is at least.
fn gflop(flops: u64) -> String {
    match flops {
        u64::MAX => format!(
            "over {:.3e} GFLOP (more than 64 bits count)",
            u64::MAX as f64 / 1e9
        ),
        f => format!("{:.1} GFLOP", f as f64 / 1e9),
    }
}

fn remat_effect(without: usize, with: usize) -> String {
    let (a, b) = (human_bytes(without), human_bytes(with));
    match with.cmp(&without) {
        std::cmp::Ordering::Greater if a == b => {
            format!("it would raise the peak from {without} to {with} bytes ({a})")
        }
        std::cmp::Ordering::Greater => format!("it would raise the peak from {a} to {b}"),
        _ => format!("it would not lower the peak of {a}"),
    }
}

pub fn run(args: PlanArgs) -> Result<()> {
    let start = Instant::now();
    if args.model.batch_auto() {
        anyhow::bail!("--batch auto needs a memory budget: use it with `snug fit --memory SIZE` or `snug train --memory SIZE`");
    }
    let (model, train) = args.model.sections(RunFlags::default());
    let mut cfg = args.model.resolve(&model, &train)?;
    // The same data, hence the same vocabulary, that `snug train` would load (for sampling,
    // only its vocabulary: a long context need not fit in its splits), and the weights
    // `--init-from` names, checked as `snug train` checks them.
    let (_, gpt) = if args.inference {
        cfg.load_data_and_model_for_sampling()?
    } else {
        cfg.load_data_and_model()?
    };
    let gpu = cfg.device.is_gpu();
    if gpu && args.target_cpu.is_some() {
        bail!(
            "--target-cpu plans for a CPU; --device {} plans for a GPU",
            cfg.device
        );
    }
    if args.inference {
        return run_inference(&args, &cfg, &gpt, start);
    }
    let target = if gpu {
        cfg.target()
    } else {
        snug_graph::Target::cpu(
            cfg.threads,
            args.target_cpu.unwrap_or_else(snug_graph::CpuGemm::host),
        )
    };
    if let Some(l) = args.link {
        if !(l.is_finite() && l > 0.0) {
            bail!("--link {l}: a bandwidth in GB/s must be a positive number");
        }
    }
    let devices = usize::try_from(args.devices)?;
    if devices == 1 && (args.shard > 0 || args.link.is_some()) {
        bail!("--shard and --link describe a run over several devices: add --devices N (N > 1)");
    }
    let sharding = snug_graph::Sharding::new(devices, args.shard)?;
    let shape = if sharding.is_distributed() {
        snug_compile::StepShape::per_rank(cfg.batch, cfg.block, devices, cfg.accumulation)?
    } else {
        cfg.step_shape()
    };
    // The pass table plans the quantized base with every reader given a whole f32 copy, then
    // with the target's reads from the codes, so each shows its saving.
    let copying = {
        let mut t = target;
        t.fusions.quantized_reads = false;
        t
    };
    let compile_for = |c: &snug_train::TrainConfig, target: snug_graph::Target| {
        snug_compile::compile_sharded(&gpt, shape, target, &c.step_config(), &sharding)
    };
    let compile = |c: &snug_train::TrainConfig| compile_for(c, target);
    let compiled = compile(&cfg)?;
    let remat_dropped = compiled.remat_dropped;
    let step = compiled.step;
    check_runs_on_device(&step.graph, &cfg)?;
    let memory_plan = plan(&step.graph, &PlanOptions::default())?;
    let plan_ms = start.elapsed().as_secs_f64() * 1e3;
    // Each pass's saving, measured by planning the step without it and with it, cumulatively:
    // the passes in the order given, then the precision, then rematerialization (last, since
    // its budget mode adapts to the rest).
    let mut stages: Vec<(String, snug_train::TrainConfig, snug_graph::Target)> = Vec::new();
    let mut c = cfg.clone();
    c.passes.clear();
    c.precision = snug_graph::DType::F32;
    c.remat = snug_train::Remat::None;
    // LoRA first: what freezing the base saves against training every parameter.
    c.lora = 0;
    c.lora_alpha = None;
    c.lora_targets = None;
    // 8-bit moments next: what they save against f32 AdamW's.
    let adam8 = cfg.optimizer == snug_train::OptimizerKind::AdamW8bit;
    if adam8 {
        c.optimizer = snug_train::OptimizerKind::AdamW;
    }
    // Fused updates against the default: global-norm clipping, every gradient held.
    if cfg.fused_update {
        c.fused_update = false;
        c.clip_mode = snug_graph::ClipMode::Global;
        c.grad_clip = if cfg.grad_clip > 0.0 {
            cfg.grad_clip
        } else {
            1.0
        };
    }
    c.quantize_base = None;
    let base = c.clone();
    if let Some(lora) = cfg.lora_config() {
        c.lora = cfg.lora;
        c.lora_alpha = cfg.lora_alpha;
        c.lora_targets = cfg.lora_targets.clone();
        let name = format!("lora r={} {}", lora.rank, lora.targets);
        stages.push((name, c.clone(), copying));
    }
    if adam8 {
        c.optimizer = cfg.optimizer;
        stages.push(("adamw8bit".to_string(), c.clone(), copying));
    }
    if cfg.fused_update {
        c.fused_update = true;
        c.clip_mode = cfg.clip_mode;
        c.grad_clip = cfg.grad_clip;
        let clip = if cfg.grad_clip > 0.0 {
            cfg.clip_mode.name()
        } else {
            "none"
        };
        stages.push((format!("fused-update clip={clip}"), c.clone(), copying));
    }
    if let Some(q) = cfg.quantize_base {
        c.quantize_base = Some(q);
        stages.push((format!("quantize-base={q}"), c.clone(), copying));
        if target.fusions.quantized_reads {
            stages.push(("quantized-reads".to_string(), c.clone(), target));
        }
    }
    for (k, pass) in cfg.passes.iter().enumerate() {
        c.passes = cfg.passes[..=k].to_vec();
        stages.push((pass.name().to_string(), c.clone(), target));
    }
    if cfg.precision != snug_graph::DType::F32 {
        c.precision = cfg.precision;
        stages.push((format!("precision={}", cfg.precision), c.clone(), target));
    }
    if cfg.remat != snug_train::Remat::None {
        c.remat = cfg.remat;
        stages.push((format!("remat={}", cfg.remat), c.clone(), target));
    }
    let peak_of = |c: &snug_train::TrainConfig, target| -> Result<usize> {
        let step = compile_for(c, target)?.step;
        Ok(plan(&step.graph, &PlanOptions::default())?.peak_bytes())
    };
    let mut pass_savings = Vec::new();
    if !stages.is_empty() {
        let last = stages.len() - 1;
        // The base and every stage but the last (the whole configuration, planned above) are
        // planned side by side: each is a whole compile and plan, and they share nothing.
        let peaks: Vec<Result<usize>> = std::thread::scope(|s| {
            let runs: Vec<_> = std::iter::once((&base, target))
                .chain(stages[..last].iter().map(|(_, c, t)| (c, *t)))
                .map(|(c, t)| s.spawn(move || peak_of(c, t)))
                .collect();
            runs.into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        });
        let mut peaks = peaks.into_iter();
        let mut next = || peaks.next().unwrap_or_else(|| Ok(memory_plan.peak_bytes()));
        let mut before = next()?;
        for (i, (name, _, _)) in stages.iter().enumerate() {
            let after = if i == last {
                memory_plan.peak_bytes()
            } else {
                next()?
            };
            pass_savings.push(PassSaving {
                pass: name.clone(),
                peak_before_bytes: before,
                peak_after_bytes: after,
                saved_bytes: before as i64 - after as i64,
            });
            before = after;
        }
    }
    let report = PlanReport {
        preset: cfg.model.preset.clone().unwrap_or_default(),
        model: gpt.clone(),
        precision: cfg.precision,
        batch: cfg.batch,
        accumulation: cfg.accumulation,
        grad_clip: cfg.grad_clip,
        block: cfg.block,
        threads: cfg.threads,
        target_cpu: target.cpu_gemm().unwrap_or(snug_graph::CpuGemm::Portable),
        device: gpu.then(|| cfg.device.to_string()),
        memory_layout: gpu.then_some(target.memory),
        parameters: step.parameter_count(),
        frozen_parameters: step
            .frozen
            .iter()
            .map(|f| {
                snug_train::quantized::value_shape(&step.graph, f.param)
                    .iter()
                    .product::<usize>()
            })
            .sum(),
        lora: cfg.lora_config(),
        optimizer: adam8.then(|| cfg.optimizer.name()),
        fused_update: cfg.fused_update.then(|| {
            if cfg.grad_clip > 0.0 {
                cfg.clip_mode.name()
            } else {
                "none"
            }
        }),
        quantize_base: cfg.quantize_base,
        bf16_kernels: step
            .graph
            .nodes()
            .iter()
            .filter(|n| matches!(n.op, snug_graph::ops::Op::HalfIo(_)))
            .count(),
        bf16_products: step
            .graph
            .nodes()
            .iter()
            .filter(|n| matches!(&n.op, snug_graph::ops::Op::HalfIo(h) if h.product().is_some()))
            .count(),
        nodes: step.graph.nodes().len(),
        tensors: step.graph.tensors().len(),
        flops_per_step: step.graph.flops(),
        // The calibration times this machine's CPU kernels.
        predicted_step_ms: snug_train::calibration::cached(cfg.threads)
            .filter(|_| !gpu)
            .map(|m| m.step_seconds(&step, &memory_plan.schedule) * 1e3),
        figures: PlanFigures::of(&memory_plan, &step.graph, step.forward_nodes),
        plan_ms,
        passes: pass_savings,
        remat: cfg.remat.to_string(),
        remat_dropped,
        distributed: sharding.is_distributed().then(|| {
            let comm = snug_graph::zero::comm_per_rank(&step.graph, cfg.accumulation);
            DistributedReport {
                devices,
                shard: args.shard,
                per_rank_batch: cfg.batch / devices,
                per_rank_peak_bytes: memory_plan.peak_bytes(),
                comm,
                link_gb_per_s: args.link,
                predicted_comm_ms: args.link.map(|l| comm.seconds(l) * 1e3),
                overlap: snug_plan::overlap(&step.graph, &memory_plan.schedule, step.forward_nodes),
            }
        }),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    // Under ZeRO-3 the step holds this rank's shards of the parameters, not the model's count.
    let sharded = report.distributed.as_ref().is_some_and(|d| d.shard == 3);
    let shown = if sharded {
        gpt.parameter_count()
    } else {
        report.parameters
    };
    println!(
        "model {} ({}): {} parameters ({} at f32){}",
        report.preset,
        gpt.summary(),
        shown,
        human_bytes(shown * 4),
        if sharded {
            format!(
                "; this rank holds {} of them in shards ({} at f32)",
                report.parameters,
                human_bytes(report.parameters * 4)
            )
        } else {
            String::new()
        }
    );
    if let Some(lora) = &report.lora {
        println!(
            "LoRA rank {} alpha {} on {}: {} parameters train, {} frozen (no gradient, no optimizer state)",
            lora.rank, lora.alpha, lora.targets, report.parameters, report.frozen_parameters
        );
    }
    if let Some(q) = report.quantize_base {
        let how = if target.fusions.quantized_reads {
            "decoded tile by tile as each op reads them"
        } else {
            "dequantized as each op reads them"
        };
        println!("frozen base weights (2-D) stored as {q}, {how}");
    }
    if report.bf16_kernels > 0 {
        println!(
            "{} kernels read or write bf16 as stored, with no cast between ({} of them products, \
             widening as the GEMM packs)",
            report.bf16_kernels, report.bf16_products
        );
    }
    println!(
        "training step: batch {} x block {} = {} tokens, {:?}, {}, {} threads, remat {}; {} nodes, {}",
        cfg.batch,
        cfg.block,
        cfg.batch.saturating_mul(cfg.block),
        cfg.optimizer,
        cfg.precision,
        cfg.threads,
        report.remat,
        report.nodes,
        gflop(report.flops_per_step)
    );
    if let Some(d) = &report.distributed {
        println!(
            "one rank of {} (ZeRO stage {}): {} sequences per rank per step, planned below",
            d.devices, d.shard, d.per_rank_batch
        );
    }
    if let Some(layout) = report.memory_layout {
        println!(
            "device {}: tensors aligned to {} bytes, arena in buffers of at most {}, each tensor within a binding of {}",
            cfg.device,
            layout.alignment,
            human_bytes(layout.max_buffer_bytes),
            human_bytes(layout.max_binding_bytes)
        );
    }
    print!("{memory_plan}");
    if memory_plan.chunks().len() > 1 {
        println!(
            "arena held as {} device buffers (chunks, no tensor across two): {}",
            memory_plan.chunks().len(),
            memory_plan
                .chunks()
                .iter()
                .map(|&c| human_bytes(c))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if let Some(d) = &report.distributed {
        println!(
            "communication per rank per step: sent {}, received {} in {} collectives{}",
            human_bytes(d.comm.sent_bytes as usize),
            human_bytes(d.comm.received_bytes as usize),
            d.comm.collectives,
            match (d.link_gb_per_s, d.predicted_comm_ms) {
                (Some(l), Some(ms)) => format!("; {ms:.1} ms over a {l} GB/s link"),
                _ => String::new(),
            }
        );
        let o = &d.overlap;
        if !o.collectives.is_empty() {
            println!(
                "gradient buckets: {} collectives, {} started before the backward ends (at op {})",
                o.collectives.len(),
                o.overlapped(),
                o.backward_end.map_or(0, |e| e + 1)
            );
        }
    }
    for s in &report.passes {
        println!(
            "pass {:<20} peak {} -> {} (saved {})",
            s.pass,
            human_bytes(s.peak_before_bytes),
            human_bytes(s.peak_after_bytes),
            if s.saved_bytes >= 0 {
                human_bytes(s.saved_bytes as usize)
            } else {
                format!("-{}", human_bytes(s.saved_bytes.unsigned_abs() as usize))
            }
        );
    }
    if let Some(d) = &report.remat_dropped {
        println!(
            "remat {} left out: {}, so the step keeps every activation",
            d.remat,
            remat_effect(d.peak_without_bytes, d.peak_with_bytes)
        );
    }
    if let Some(ms) = report.predicted_step_ms {
        println!("predicted step time {ms:.1} ms (fit's cost model, this machine's calibration)");
    }
    println!("planned in {plan_ms:.1} ms, no tensor allocated");
    if args.table {
        print!("{}", memory_plan.table());
    }
    Ok(())
}

/// Refuses, as the device's session would, a step with an op its backend cannot run (a GPU's
/// missing kernels): a plan of a step that cannot run there is no prediction.
fn check_runs_on_device(graph: &snug_graph::Graph, cfg: &TrainConfig) -> Result<()> {
    match cfg.device.runnable() {
        Some(check) => {
            check(graph).map_err(|why| anyhow::anyhow!("--device {}: {why}", cfg.device))
        }
        None => Ok(()),
    }
}

/// Plans what `snug sample` would hold for the model of `cfg`: the sampler's own planning
/// function, on the model a run trained with these flags saves.
fn run_inference(
    args: &PlanArgs,
    cfg: &TrainConfig,
    model: &ModelConfig,
    start: Instant,
) -> Result<()> {
    use snug_train::sample::{plan_inference_on, plan_kv_on};
    // `snug sample --device` plans for the same target: the CPU's with these threads, or the
    // GPU's limits.
    let target = if cfg.device.is_gpu() {
        cfg.target()
    } else {
        snug_graph::Target::host(cfg.threads.max(1))
    };
    let max_seq = model.max_seq();
    let window = crate::sample_cmd::context_flag(args.context, max_seq, max_seq)?;
    let (graph, memory_plan, prefill) = if args.kv_cache {
        let (g, p) = plan_kv_on(model, 1, window, target, None)?;
        let (_, prefill) = plan_kv_on(model, window, window, target, None)?;
        (g.graph, p, Some(prefill.peak_bytes()))
    } else {
        let (g, p) = plan_inference_on(model, window, target, None)?;
        (g.graph, p, None)
    };
    check_runs_on_device(&graph, cfg)?;
    let plan_ms = start.elapsed().as_secs_f64() * 1e3;
    let report = InferenceReport {
        preset: cfg.model.preset.clone().unwrap_or_default(),
        model: model.clone(),
        batch: 1,
        window,
        threads: cfg.threads,
        kv_cache: args.kv_cache,
        prefill_window_peak_bytes: prefill,
        sample_peak_bytes: prefill.map_or(memory_plan.peak_bytes(), |p| {
            p.max(memory_plan.peak_bytes())
        }),
        parameters: model.parameter_count(),
        nodes: graph.nodes().len(),
        tensors: graph.tensors().len(),
        flops_per_token: graph.flops(),
        figures: PlanFigures::of(&memory_plan, &graph, graph.nodes().len()),
        plan_ms,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "model {} ({}): {} parameters ({} at f32)",
        report.preset,
        model.summary(),
        report.parameters,
        human_bytes(report.parameters * 4),
    );
    match report.prefill_window_peak_bytes {
        Some(prefill) => println!(
            "inference (snug sample): holds at most {} ({} B); a prefill of the whole window \
             peaks at {}; below, one decode step against key/value caches of {} positions, f32, \
             {} threads; {} nodes, at most {:.3} GFLOP per token",
            human_bytes(report.sample_peak_bytes),
            report.sample_peak_bytes,
            human_bytes(prefill),
            report.window,
            report.threads,
            report.nodes,
            report.flops_per_token as f64 / 1e9,
        ),
        None => println!(
            "inference (snug sample --full-window): batch 1 x window {} positions, f32, {} \
             threads, no KV cache (each token runs the whole window); {} nodes, {:.3} GFLOP per \
             token",
            report.window,
            report.threads,
            report.nodes,
            report.flops_per_token as f64 / 1e9
        ),
    }
    print!("{memory_plan}");
    println!("planned in {plan_ms:.1} ms, no tensor allocated");
    if args.table {
        print!("{}", memory_plan.table());
    }
    Ok(())
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::{gflop, remat_effect};

    #[test]
    fn a_saturated_flop_count_is_not_printed_as_a_figure() {
        assert_eq!(gflop(12_345_600_000), "12.3 GFLOP");
        assert_eq!(
            gflop(u64::MAX),
            "over 1.845e10 GFLOP (more than 64 bits count)"
        );
    }

    #[test]
    fn a_remat_left_out_is_described_truly() {
        assert_eq!(
            remat_effect(11_849_000, 11_849_000),
            "it would not lower the peak of 11.30 MiB"
        );
        // Apart by less than the figures round to: the bytes say it.
        assert_eq!(
            remat_effect(11_849_000, 11_849_512),
            "it would raise the peak from 11849000 to 11849512 bytes (11.30 MiB)"
        );
        assert_eq!(
            remat_effect(10 << 20, 12 << 20),
            "it would raise the peak from 10.00 MiB to 12.00 MiB"
        );
    }
}
