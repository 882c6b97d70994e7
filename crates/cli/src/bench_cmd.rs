//! `snug bench`: named training-step benchmarks, each timed over N steps after warm-up in a
//! process of its own (so peak RSS is that case's alone), with MFU against a GEMM probe run
//! on this machine first.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use snug_plan::memory_plan::human_bytes;
use snug_runtime::process::CpuTicks;
use snug_runtime::Allocator;
use snug_train::{
    DataSource, DeviceSpec, ModelSection, TokenDataset, TrainConfig, TrainSection, Trainer,
};

use crate::train_cmd::{print_json, stats};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Cases, comma-separated: tiny, char-small, char-small-bf16, gpt2, gpt2-bf16 (the models
    /// and batches of the PyTorch and JAX peers: char-small is 16 × 256 at vocabulary 65,
    /// gpt2 is 4 × 1024 at 50304).
    #[arg(long, default_value = "char-small,char-small-bf16")]
    cases: String,
    /// Timed steps per case.
    #[arg(long, default_value_t = 10)]
    steps: u64,
    /// Untimed steps first (page faults, thread start-up, caches).
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// Worker threads (default: physical cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Device to time the step on: cpu (default), gpu or gpu:N. On a GPU, MFU is against the
    /// device's own f32 GEMM rate, probed in each case's process after its timed steps.
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    device: DeviceSpec,
    /// Text file or `snug prepare` directory to draw batches from (default: built-in data;
    /// token values do not change the time).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Graph passes and options for every case, as `snug train --passes` takes them (e.g.
    /// `fused-ce,inplace`); default: the trainer's.
    #[arg(long, value_name = "LIST")]
    passes: Option<String>,
    /// Machine-readable output: one JSON line for the probe and one per case.
    #[arg(long)]
    json: bool,
    /// Run the cases in this process instead of one child process each (RSS then
    /// accumulates across cases).
    #[arg(long, hide = true)]
    in_process: bool,
}

/// A named benchmark: model, batch and precision.
struct Case {
    name: &'static str,
    preset: &'static str,
    batch: usize,
    block: usize,
    /// 0: the data's vocabulary.
    vocab: usize,
    precision: &'static str,
}

const CASES: [Case; 5] = [
    Case {
        name: "tiny",
        preset: "tiny",
        batch: 16,
        block: 64,
        vocab: 0,
        precision: "f32",
    },
    Case {
        name: "char-small",
        preset: "char-small",
        batch: 16,
        block: 256,
        vocab: 65,
        precision: "f32",
    },
    Case {
        name: "char-small-bf16",
        preset: "char-small",
        batch: 16,
        block: 256,
        vocab: 65,
        precision: "bf16",
    },
    Case {
        name: "gpt2",
        preset: "gpt2",
        batch: 4,
        block: 1024,
        vocab: 50304,
        precision: "f32",
    },
    Case {
        name: "gpt2-bf16",
        preset: "gpt2",
        batch: 4,
        block: 1024,
        vocab: 50304,
        precision: "bf16",
    },
];

#[derive(Debug, Serialize, Deserialize)]
struct Probe {
    /// How the peak was measured.
    method: String,
    threads: usize,
    gflop_per_s: f64,
    /// As [`CaseResult::steal`], over the probe's runs.
    steal: Option<f64>,
}

#[derive(Debug, Serialize, Deserialize)]
struct CaseResult {
    case: String,
    /// Where the steps ran: `cpu`, or the GPU adapter's label.
    #[serde(default)]
    device: String,
    preset: String,
    batch: usize,
    block: usize,
    vocab: usize,
    precision: String,
    threads: usize,
    warmup: u64,
    steps: u64,
    median_step_ms: f64,
    min_step_ms: f64,
    max_step_ms: f64,
    tokens_per_s: f64,
    model_flops_per_step: f64,
    model_flops_per_s: f64,
    /// The probe's GEMM rate run again in this case's process right after its timed steps
    /// (after its peak RSS was read), in GFLOP/s: on a shared host the machine's speed drifts
    /// between the first probe and a case. On a GPU, the device's own f32 GEMM rate (snug's
    /// matmul kernel on the probe's shape, best of 3), the only probe there.
    probe_after_gflop_per_s: Option<f64>,
    /// Model FLOP/s over the faster of the two probes' GEMM rates.
    mfu: Option<f64>,
    predicted_peak_bytes: usize,
    measured_peak_bytes: usize,
    peak_rss_bytes: Option<usize>,
    /// On a GPU whose backend reports its allocations (wgpu's `generate_allocator_report`:
    /// Vulkan, DX12), the bytes the device's allocator holds for snug's buffers after the
    /// last step (persistent buffers and the cached arena chunks, rounded up by the driver):
    /// at least `predicted_peak_bytes`. None on the CPU or without a report.
    #[serde(default)]
    device_allocator_report_bytes: Option<u64>,
    /// Host-visible bytes of the GPU's input staging ring (outside the device peak); None
    /// on the CPU.
    #[serde(default)]
    staging_ring_bytes: Option<u64>,
    /// On a GPU, whether its workgroup reductions used subgroup operations (the adapter has
    /// them and `SNUG_GPU_SUBGROUPS=0` did not turn them off); None on the CPU.
    #[serde(default)]
    gpu_subgroups: Option<bool>,
    /// A bf16 case on the CPU: what its products computed, as `snug devices` says
    /// (`amx`, `vdpbf16ps`, `model` or `widen`). None for f32 cases and on a GPU.
    #[serde(default)]
    bf16_products: Option<String>,
    final_loss: f32,
    /// Share of the machine's CPU time that a hypervisor gave to other guests during the timed
    /// steps (Linux's steal time): on a shared host, figures taken while it is high are slow
    /// for reasons outside the program.
    steal: Option<f64>,
}

/// The GEMM shape PyTorch's peer probe uses for its peak (`../shared/peers/matmul_probe.py`).
const PROBE: (usize, usize, usize) = (4096, 384, 1536);

/// Best rate of snug's f32 matmul kernel on [`PROBE`] over 10 runs after a warm-up.
fn gemm_probe(threads: usize) -> Result<Probe> {
    let (m, k, n) = PROBE;
    let before = CpuTicks::now();
    let gflop_per_s = snug_train::calibration::gemm_rate(threads, PROBE, 10)? / 1e9;
    Ok(Probe {
        method: format!(
            "f32 matmul [{m}, {k}] x [{k}, {n}] through snug's GEMM (its own kernel on CPUs with AVX-512F or AVX2 + FMA, else the gemm crate), best of 10 after a warm-up; each case runs it again after its timed steps, and its MFU takes the faster of the two"
        ),
        threads,
        gflop_per_s,
        steal: steal_since(before),
    })
}

/// The steal share since `before` (see [`CaseResult::steal`]), where the OS reports it.
fn steal_since(before: Option<CpuTicks>) -> Option<f64> {
    CpuTicks::now()?.steal_since(&before?)
}

fn find(name: &str) -> Result<&'static Case> {
    CASES.iter().find(|c| c.name == name).with_context(|| {
        format!(
            "`{name}` is not a bench case (known: {})",
            CASES.map(|c| c.name).join(", ")
        )
    })
}

fn run_case(case: &Case, args: &BenchArgs) -> Result<CaseResult> {
    let model = ModelSection {
        preset: Some(case.preset.into()),
        vocab_size: (case.vocab > 0).then_some(case.vocab),
        ..Default::default()
    };
    let train = TrainSection {
        data: args.data.clone(),
        batch: Some(case.batch),
        block: Some(case.block),
        threads: args.threads,
        device: Some(args.device.to_string()),
        precision: Some(case.precision.into()),
        steps: Some(total_steps(args)?),
        eval_every: Some(0),
        passes: args.passes.clone(),
        ..Default::default()
    };
    let cfg = TrainConfig::resolve(None, &model, &train)?;
    let data = TokenDataset::load(&DataSource::from(&cfg.data))?;
    let mut trainer = Trainer::with_allocator(cfg.clone(), data, Allocator::cpu())?;
    let mut times = Vec::new();
    let mut loss = f32::NAN;
    let mut timed_from = None;
    for i in 0..total_steps(args)? {
        if i == args.warmup {
            timed_from = CpuTicks::now();
        }
        let s = trainer.train_step()?;
        loss = s.loss;
        if i >= args.warmup {
            times.push(s.ms);
        }
    }
    let steal = steal_since(timed_from);
    let peak_rss_bytes = snug_runtime::process::resident_set().map(|(_, peak)| peak);
    let predicted_peak_bytes = trainer.plan().peak_bytes();
    // The device's allocator: the trainer's own on a GPU.
    let measured_peak_bytes = trainer.session().allocator().peak_bytes();
    let device = trainer.session().device_name();
    let device_allocator_report_bytes = trainer.session().allocator_report().map(|r| r.snug_bytes);
    let staging_ring_bytes = trainer.session().staging_bytes();
    let gpu = trainer.session().gpu().cloned();
    let tokens = (case.batch * case.block) as f64;
    let flops = trainer.model().flops_per_token(case.block) as f64 * tokens;
    let vocab = trainer.model().vocab_size();
    // The trainer's arena goes back before the probe allocates its own.
    drop(trainer);
    let probe_after = match &gpu {
        Some(gpu) => Some(snug_gpu::gemm_rate(gpu, PROBE, 3)? / 1e9),
        None => Some(snug_train::calibration::gemm_rate(cfg.threads, PROBE, 10)? / 1e9),
    };
    let (median, min, max) = stats(&times);
    Ok(CaseResult {
        case: case.name.into(),
        device,
        preset: case.preset.into(),
        batch: case.batch,
        block: case.block,
        vocab,
        precision: case.precision.into(),
        threads: cfg.threads,
        warmup: args.warmup,
        steps: args.steps,
        median_step_ms: median,
        min_step_ms: min,
        max_step_ms: max,
        tokens_per_s: tokens / (median / 1e3),
        model_flops_per_step: flops,
        model_flops_per_s: flops / (median / 1e3),
        probe_after_gflop_per_s: probe_after,
        mfu: None,
        predicted_peak_bytes,
        measured_peak_bytes,
        peak_rss_bytes,
        device_allocator_report_bytes,
        staging_ring_bytes,
        gpu_subgroups: gpu.as_ref().map(snug_gpu::GpuDevice::has_subgroups),
        bf16_products: (gpu.is_none() && case.precision == "bf16")
            .then(|| crate::devices_cmd::bf16_products().to_string()),
        final_loss: loss,
        steal,
    })
}

/// Runs `case` in a child process of this binary and reads its JSON line back.
fn run_child(case: &Case, args: &BenchArgs) -> Result<CaseResult> {
    let exe = std::env::current_exe().context("locating the snug binary")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["bench", "--in-process", "--json", "--cases", case.name]);
    cmd.args(["--steps", &args.steps.to_string()]);
    cmd.args(["--warmup", &args.warmup.to_string()]);
    if let Some(t) = args.threads {
        cmd.args(["--threads", &t.to_string()]);
    }
    cmd.args(["--device", &args.device.to_string()]);
    if let Some(d) = &args.data {
        cmd.arg("--data").arg(d);
    }
    if let Some(p) = &args.passes {
        cmd.args(["--passes", p]);
    }
    end_with_parent(&mut cmd);
    let out = cmd.output().context("running a bench case")?;
    if !out.status.success() {
        bail!(
            "bench case `{}` failed: {}",
            case.name,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.contains("\"kind\":\"case\""))
        .with_context(|| format!("bench case `{}` printed no result", case.name))?;
    Ok(serde_json::from_str(line)?)
}

/// Has the case's process end when this one does: a bench stopped (SIGTERM, a timeout) would
/// otherwise leave its case training on the cores, skewing whatever is timed next.
fn end_with_parent(cmd: &mut std::process::Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: `prctl` and `getppid` are async-signal-safe, as `pre_exec` requires.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have ended before the request above took effect.
                if libc::getppid() != parent {
                    return Err(std::io::Error::other(
                        "snug bench ended before its case started",
                    ));
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// Warm-up and timed steps together. Refused where they overflow: the sum wrapped to 1 and
/// the case timed no step at all.
fn total_steps(args: &BenchArgs) -> Result<u64> {
    args.warmup.checked_add(args.steps).with_context(|| {
        format!(
            "--warmup {} and --steps {} add up to more than {} steps, the most a case counts",
            args.warmup,
            args.steps,
            u64::MAX
        )
    })
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    total_steps(&args)?;
    let cases: Vec<&Case> = args
        .cases
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(find)
        .collect::<Result<_>>()?;
    if cases.is_empty() {
        bail!("--cases names no case");
    }
    crate::check_threads_flag(args.threads)?;
    if args.in_process {
        for case in cases {
            print_json("case", &run_case(case, &args)?)?;
        }
        return Ok(());
    }
    let threads = args.threads.unwrap_or_else(snug_cpu::physical_cores).max(1);
    // The probe times the CPU's GEMM; a GPU's is probed in each case's process.
    let probe = if args.device.is_gpu() {
        None
    } else {
        Some(gemm_probe(threads)?)
    };
    if let (Some(probe), true) = (&probe, args.json) {
        print_json("probe", probe)?;
    } else if let Some(probe) = &probe {
        println!(
            "peak: {:.1} GFLOP/s ({}, {} threads){}",
            probe.gflop_per_s,
            probe.method,
            probe.threads,
            probe.steal.map_or(String::new(), |s| format!(
                "; {:.0}% of CPU time stolen by the hypervisor meanwhile",
                s * 100.0
            ))
        );
        println!(
            "{:<16} {:>28} {:>8} {:>8} {:>6} {:>13} {:>13} {:>11} {:>6}",
            "case",
            "step ms: median (min-max)",
            "tok/s",
            "GFLOP/s",
            "MFU",
            "planned peak",
            "measured",
            "peak RSS",
            "steal"
        );
    } else if !args.json {
        println!(
            "device: {} (MFU against its own f32 GEMM rate on [{}, {}] x [{}, {}], probed after each case's steps)",
            args.device, PROBE.0, PROBE.1, PROBE.1, PROBE.2
        );
        println!(
            "{:<16} {:>28} {:>8} {:>8} {:>6} {:>13} {:>13} {:>11} {:>6}",
            "case",
            "step ms: median (min-max)",
            "tok/s",
            "GFLOP/s",
            "MFU",
            "planned peak",
            "measured",
            "peak RSS",
            "steal"
        );
    }
    for case in cases {
        let mut r = run_child(case, &args)?;
        let peak = probe
            .as_ref()
            .map_or(0.0, |p| p.gflop_per_s)
            .max(r.probe_after_gflop_per_s.unwrap_or(0.0));
        if peak > 0.0 {
            r.mfu = Some(r.model_flops_per_s / (peak * 1e9));
        }
        if args.json {
            print_json("case", &r)?;
        } else {
            println!(
                "{:<16} {:>28} {:>8.0} {:>8.1} {:>6} {:>13} {:>13} {:>11} {:>6}",
                r.case,
                format!(
                    "{:.1} ({:.1}-{:.1})",
                    r.median_step_ms, r.min_step_ms, r.max_step_ms
                ),
                r.tokens_per_s,
                r.model_flops_per_s / 1e9,
                r.mfu.map_or("-".into(), |m| format!("{:.0}%", m * 100.0)),
                human_bytes(r.predicted_peak_bytes),
                human_bytes(r.measured_peak_bytes),
                r.peak_rss_bytes.map_or("-".into(), human_bytes),
                r.steal.map_or("-".into(), |s| format!("{:.0}%", s * 100.0)),
            );
        }
    }
    Ok(())
}
