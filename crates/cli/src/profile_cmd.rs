//! `snug profile`: where a training step's time goes, op by op.

use std::collections::BTreeMap;

use anyhow::Result;
use clap::Args;
use serde::Serialize;
use snug_graph::ops::Op;
use snug_train::{RunFlags, Trainer};

use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Profiled steps (after one warm-up step), 1 to 1,000,000; times are averaged over them.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    steps: u64,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// Also write the profiled steps as a Chrome trace (JSON for Perfetto or
    /// chrome://tracing): a slice per op, and the planned bytes held as a counter track. An
    /// existing file is refused unless --force; a checkpoint or a run's own file always.
    #[arg(long, value_name = "FILE")]
    trace: Option<std::path::PathBuf>,
    /// Replace the --trace file if it exists (atomically). Never a checkpoint or a run's own
    /// file.
    #[arg(long, requires = "trace")]
    force: bool,
}

#[derive(Serialize)]
struct OpRow {
    op: String,
    calls: usize,
    ms: f64,
    /// What fit's cost model predicts for these calls (with a cached calibration).
    predicted_ms: Option<f64>,
    share: f64,
    gflop_per_s: f64,
}

pub fn run(args: ProfileArgs) -> Result<()> {
    if args.model.batch_auto() {
        anyhow::bail!("--batch auto needs a memory budget: use it with `snug fit --memory SIZE` or `snug train --memory SIZE`");
    }
    // Before the steps run: a refused path wastes none of them.
    if let Some(path) = &args.trace {
        snug_train::output::check_document_file(path, args.force)?;
    }
    let (model, mut train) = args.model.sections(RunFlags::default());
    train.steps = Some(args.steps + 1);
    let mut cfg = args.model.resolve(&model, &train)?;
    // As train loads it: a pretrained model's tokenizer encodes text, and token files of
    // another are refused.
    let (data, _) = cfg.load_data_and_model()?;
    let mut trainer = Trainer::new(cfg, data)?;
    trainer.train_step()?;
    let graph = trainer.session().graph().clone();
    let schedule = trainer.plan().schedule.clone();
    // Rescaled to the machine's speed now, as fit predicts; the calibration times this
    // machine's CPU kernels, so a GPU's ops get no prediction.
    let machine = if trainer.config().device.is_gpu() {
        None
    } else {
        snug_train::calibration::cached_now(trainer.config().threads)?
    };
    let micro = trainer.config().accumulation;
    let mut rows: BTreeMap<String, (usize, f64, u64, f64)> = BTreeMap::new();
    let steps = args.steps;
    let mut traced = Vec::new();
    for _ in 0..steps {
        let (_, times) = trainer.train_step_profiled()?;
        if args.trace.is_some() {
            traced.push(times.clone());
        }
        for (&nid, t) in schedule.iter().zip(times) {
            let node = graph.node(nid);
            let ins: Vec<_> = node.inputs.iter().map(|&i| graph.tensor(i)).collect();
            let outs: Vec<_> = node.outputs.iter().map(|&i| graph.tensor(i)).collect();
            // A product reading or writing bf16 as stored says which.
            let product = match &node.op {
                Op::MatMul(m) => Some((m, "")),
                Op::HalfIo(h) => h.product().map(|m| {
                    let which = match (h.reads & 0b11, h.writes(0)) {
                        (0b01, false) => " (bf16 a)",
                        (0b10, false) => " (bf16 b)",
                        (0b11, false) => " (bf16 a, b)",
                        (0b01, true) => " (bf16 a, out)",
                        (0b10, true) => " (bf16 b, out)",
                        (0b11, true) => " (bf16 a, b, out)",
                        _ => " (bf16 out)",
                    };
                    (m, which)
                }),
                _ => None,
            };
            let key = match product {
                Some((m, which)) => format!(
                    "matmul{which}{}{} {:?}·{:?}",
                    if m.ta { " aᵀ" } else { "" },
                    if m.tb { " bᵀ" } else { "" },
                    ins[0].shape,
                    ins[1].shape
                ),
                None => node.op.name().to_string(),
            };
            let e = rows.entry(key).or_default();
            e.0 += 1;
            e.1 += t;
            e.2 += node.op.flops(&ins, &outs);
            if let Some(m) = &machine {
                e.3 += m.node_step_seconds(&graph, nid, micro);
            }
        }
    }
    if let Some(path) = &args.trace {
        let detail = snug_report::TimelineDetail::of(
            trainer.plan(),
            &graph,
            trainer.step_graph().forward_nodes,
        );
        let trace = snug_report::Trace::of_profile(&detail, &traced).to_json()?;
        snug_nn::hf_checkpoint::write_file_atomically(path, trace.as_bytes())?;
    }
    let total: f64 = rows.values().map(|r| r.1).sum();
    let mut table: Vec<OpRow> = rows
        .into_iter()
        .map(|(op, (calls, secs, flops, predicted))| OpRow {
            op,
            calls: calls / steps as usize,
            ms: secs * 1e3 / steps as f64,
            predicted_ms: machine.as_ref().map(|_| predicted * 1e3 / steps as f64),
            share: secs / total,
            gflop_per_s: flops as f64 / secs / 1e9,
        })
        .collect();
    table.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&table)?);
        return Ok(());
    }
    println!(
        "step time {:.1} ms (mean of {steps} profiled steps)",
        total * 1e3 / steps as f64
    );
    if machine.is_some() {
        let predicted: f64 = table.iter().filter_map(|r| r.predicted_ms).sum();
        println!("predicted by fit's cost model {predicted:.1} ms (calibrated kernel timings)");
    }
    println!(
        "{:>10} {:>10} {:>6} {:>6} {:>9}  op",
        "ms", "predicted", "share", "calls", "GFLOP/s"
    );
    for r in &table {
        println!(
            "{:>10.2} {:>10} {:>5.1}% {:>6} {:>9.1}  {}",
            r.ms,
            r.predicted_ms.map_or("-".into(), |p| format!("{p:.2}")),
            100.0 * r.share,
            r.calls,
            r.gflop_per_s,
            r.op
        );
    }
    Ok(())
}
