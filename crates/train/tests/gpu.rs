//! The trainer on a GPU (the first adapter; lavapipe in CI): its losses against the CPU's,
//! planned == measured on the device, resume through a checkpoint file bit-exact against an
//! uninterrupted GPU run, the memory limit (strict refusal, out-of-memory recovery), and the
//! `device` key. Without an adapter the tests that need one print a skip (a failure under
//! `SNUG_REQUIRE_ALL_TESTS`).

use snug_gpu::Selector;
use snug_runtime::Allocator;
use snug_train::checkpoint::Checkpoint;
use snug_train::{
    DataSource, DeviceSpec, ModelSection, TokenDataset, TrainConfig, TrainError, TrainSection,
    Trainer,
};

fn have_gpu() -> bool {
    if snug_gpu::adapters_once().is_empty() {
        snug_testkit::skip_or_fail("no GPU adapter");
        return false;
    }
    true
}

/// `tiny` on the built-in addition data, small enough for lavapipe.
fn config(device: &str, steps: u64) -> TrainConfig {
    let model = ModelSection {
        preset: Some("tiny".into()),
        vocab_size: Some(13),
        ..Default::default()
    };
    let train = TrainSection {
        steps: Some(steps),
        batch: Some(8),
        block: Some(32),
        threads: Some(1),
        warmup_steps: Some(2),
        lr: Some(3e-3),
        eval_every: Some(0),
        device: Some(device.into()),
        ..Default::default()
    };
    TrainConfig::resolve(None, &model, &train).unwrap()
}

fn trainer(cfg: &TrainConfig) -> Trainer {
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    Trainer::with_allocator(cfg.clone(), data, Allocator::default()).unwrap()
}

fn bits(t: &Trainer) -> Vec<(String, Vec<u32>)> {
    t.parameters()
        .unwrap()
        .into_iter()
        .map(|(n, v)| (n, v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

/// The same 20 steps on the CPU and the GPU from the same initial weights and batches: the
/// first loss (before any update) within 1e-5 relative, every later one within 1 % (the GPU
/// reduces in another order, and the two runs' rounding compounds through AdamW), the loss
/// falling on both; on the GPU the allocator's peak and the device's own count both equal
/// the plan's peak, byte for byte.
#[test]
fn gpu_training_matches_the_cpu_and_its_plan() {
    if !have_gpu() {
        return;
    }
    let steps = 20;
    let mut cpu = trainer(&config("cpu", steps));
    let mut gpu = trainer(&config("gpu", steps));
    assert!(gpu.plan().peak_bytes() > 0);
    let (mut lc, mut lg) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        lc.push(cpu.train_step().unwrap().loss);
        let s = gpu.train_step().unwrap();
        assert_eq!(s.peak_bytes, gpu.plan().peak_bytes(), "step {}", s.step);
        lg.push(s.loss);
    }
    let rel = |a: f32, b: f32| (a - b).abs() / a.abs().max(1e-6);
    assert!(
        rel(lc[0], lg[0]) < 1e-5,
        "first loss {} vs {}",
        lc[0],
        lg[0]
    );
    for (i, (c, g)) in lc.iter().zip(&lg).enumerate() {
        assert!(rel(*c, *g) < 0.01, "step {}: cpu {c} gpu {g}", i + 1);
    }
    for l in [&lc, &lg] {
        assert!(l[steps as usize - 1] < l[0] - 0.3, "loss {l:?}");
    }
    let session = gpu.session();
    assert_eq!(session.allocator().peak_bytes(), gpu.plan().peak_bytes());
    assert_eq!(session.device_peak_bytes(), gpu.plan().peak_bytes());
    assert_eq!(session.target(), gpu.config().target());
    assert!(session.target().is_gpu());
}

/// Saved after 3 steps to a checkpoint file and resumed on the GPU, steps 4..6 repeat the
/// uninterrupted GPU run's losses and weights bit for bit.
#[test]
fn resume_on_the_gpu_continues_exactly() {
    if !have_gpu() {
        return;
    }
    let cfg = config("gpu", 6);
    let mut straight = trainer(&cfg);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    let mut losses = Vec::new();
    for step in 1..=6 {
        losses.push(straight.train_step().unwrap().loss.to_bits());
        if step == 3 {
            straight.checkpoint().unwrap().save(&path).unwrap();
        }
    }
    let ckpt = Checkpoint::load(&path).unwrap();
    assert_eq!(ckpt.config.device, DeviceSpec::Gpu(Selector::FirstGpu));
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    let mut resumed = Trainer::resume(ckpt.config.clone(), data, Allocator::default(), &ckpt)
        .expect("resume on the GPU");
    assert!(resumed.session().target().is_gpu());
    let tail: Vec<u32> = (4..=6)
        .map(|_| resumed.train_step().unwrap().loss.to_bits())
        .collect();
    assert_eq!(tail, losses[3..]);
    assert!(bits(&resumed) == bits(&straight), "weights differ");
}

/// A strict limit one byte under the plan refuses the GPU run before training, naming both
/// figures; exactly the plan trains. Lowered mid-run, the next step runs out of device memory
/// and is redone with a configuration that fits, no step lost.
#[test]
fn memory_limits_hold_on_the_gpu() {
    if !have_gpu() {
        return;
    }
    let mut cfg = config("gpu", 6);
    let needed = trainer(&cfg).plan().peak_bytes();
    cfg.memory_limit = Some(needed - 1);
    cfg.strict_memory_limit = true;
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    match Trainer::with_allocator(cfg.clone(), data.clone(), Allocator::default()) {
        Err(TrainError::DoesNotFit { needed: n, limit }) => {
            assert_eq!((n, limit), (needed, Some(needed - 1)))
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("{needed} bytes ran under a strict limit of {}", needed - 1),
    }
    cfg.memory_limit = Some(needed);
    let mut t = Trainer::with_allocator(cfg, data, Allocator::default()).unwrap();
    t.set_machine_profile(snug_fit::MachineProfile::nominal(1));
    for _ in 0..2 {
        t.train_step().unwrap();
    }
    let allocator = t.session().allocator().clone();
    assert_eq!(allocator.stats().limit_overruns, 0);
    let limit = needed * 95 / 100;
    allocator.set_memory_limit(limit, false);
    allocator.reset_peak();
    let steps: Vec<u64> = (3..=6).map(|_| t.train_step().unwrap().step).collect();
    assert_eq!(steps, vec![3, 4, 5, 6]);
    let recoveries = t.take_recoveries();
    assert_eq!(recoveries.len(), 1, "{recoveries:?}");
    assert_eq!((recoveries[0].step, recoveries[0].micro), (3, 0));
    assert!(recoveries[0].to_peak_bytes <= limit);
    assert_eq!(t.plan().peak_bytes(), recoveries[0].to_peak_bytes);
    assert!(allocator.peak_bytes() <= limit);
}

/// `gpu:N` past the machine's adapters is refused when the configuration resolves, naming
/// every adapter found.
#[test]
fn a_missing_adapter_is_named() {
    if !have_gpu() {
        return;
    }
    let found = snug_gpu::adapters_once();
    let n = found.len().to_string();
    let train = TrainSection {
        device: Some(format!("gpu:{n}")),
        ..Default::default()
    };
    let err = TrainConfig::resolve(None, &ModelSection::default(), &train).unwrap_err();
    let TrainError::Config { field, detail } = &err else {
        panic!("unexpected error {err}");
    };
    assert_eq!(*field, "device");
    for a in found {
        assert!(detail.contains(&a.name), "{detail}");
    }
}

/// The `device` key in a TOML file, and a bad one refused by name. Needs no adapter: a
/// target for a GPU this machine lacks takes snug-gpu's documented default layout.
#[test]
fn the_device_key_parses_from_toml() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("run.toml");
    std::fs::write(&file, "[train]\ndevice = \"gpu\"\n").unwrap();
    let cfg =
        TrainConfig::resolve(Some(&file), &ModelSection::default(), &Default::default()).unwrap();
    assert_eq!(cfg.device, DeviceSpec::Gpu(Selector::FirstGpu));
    let target = cfg.target();
    assert!(target.is_gpu());
    let expected = match snug_gpu::adapter::find(Selector::FirstGpu).unwrap() {
        Some(a) => a.layout(),
        None => snug_gpu::DEFAULT_LAYOUT,
    };
    assert_eq!(target.memory, expected);
    std::fs::write(&file, "[train]\ndevice = \"tpu\"\n").unwrap();
    match TrainConfig::resolve(Some(&file), &ModelSection::default(), &Default::default()) {
        Err(TrainError::Config { field, detail }) => {
            assert_eq!(field, "device");
            assert!(detail.contains("cpu, gpu, gpu:N"), "{detail}");
        }
        other => panic!("expected a config error, got {other:?}"),
    }
    let default =
        TrainConfig::resolve(None, &ModelSection::default(), &Default::default()).unwrap();
    assert_eq!(default.device, DeviceSpec::Cpu);
    assert!(!default.target().is_gpu());
}

fn hf_fixture(name: &str) -> snug_nn::HfCheckpoint {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../nn/tests/fixtures/hf")
        .join(name);
    snug_nn::HfCheckpoint::open(&dir).unwrap()
}

/// Sampling with the key/value cache on the GPU, for a GPT-2 (packed attention, learned
/// positions), a Llama (grouped-query attention, RoPE at the run-time position) and a Qwen2
/// (q/k/v biases): every step's logits within 1e-4 of the CPU's largest logit, the same
/// greedy tokens past the window (so the cache slides and re-prefills), each phase holding
/// exactly its plan, and the device's own count of buffers never above the largest plan.
#[test]
fn sampling_on_the_gpu_matches_the_cpu() {
    use snug_train::{Placement, SampleMode, SampleOptions, Sampler};
    if !have_gpu() {
        return;
    }
    let gpu = DeviceSpec::Gpu(Selector::FirstGpu);
    for name in ["gpt2", "llama", "qwen2"] {
        let ckpt = hf_fixture(name);
        let model = ckpt.config().clone();
        let load = |device| {
            Sampler::from_hf_placed(
                &model,
                &ckpt,
                SampleMode::KvCache,
                Placement {
                    device,
                    quantize: None,
                    context: None,
                },
                1,
                Allocator::default(),
            )
            .unwrap()
        };
        let (mut cpu, mut dev) = (load(DeviceSpec::Cpu), load(gpu));
        assert!(dev.session().target().is_gpu(), "{name}");
        // A prefill, then decode steps, each compared logit by logit.
        let mut context = vec![17u32, 42, 99, 5, 230, 7];
        for step in 0..6 {
            let want = cpu.next_token_logits(&context).unwrap().to_vec();
            let got = dev.next_token_logits(&context).unwrap().to_vec();
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-4 * scale,
                    "{name} step {step} logit {i}: gpu {g}, cpu {w}"
                );
            }
            let next = (want.iter().enumerate())
                .fold(0, |best, (i, v)| if *v > want[best] { i } else { best });
            context.push(next as u32);
        }
        let greedy = SampleOptions {
            temperature: 0.0,
            top_k: None,
            seed: 0,
        };
        let prompt = [3u32, 1, 4, 1, 5];
        let n = dev.window() + 8 - prompt.len();
        let (a, b) = (
            cpu.generate(&prompt, n, greedy).unwrap(),
            dev.generate(&prompt, n, greedy).unwrap(),
        );
        assert_eq!(a, b, "{name}: greedy tokens");
        let stats = dev.kv_stats().unwrap();
        assert!(stats.slides >= 1, "{name}: the cache slid");
        for phase in [stats.prefill, stats.decode] {
            assert!(phase.runs > 0, "{name}");
            assert_eq!(
                phase.planned_peak_bytes, phase.measured_peak_bytes,
                "{name}: planned == measured"
            );
        }
        let largest = stats
            .prefill
            .planned_peak_bytes
            .max(stats.decode.planned_peak_bytes);
        assert!(
            dev.session().device_peak_bytes() <= largest,
            "{name}: device peak {} over the largest plan {largest}",
            dev.session().device_peak_bytes()
        );
    }
}

/// The whole-window path runs on the GPU too, and gives the cached path's greedy tokens.
#[test]
fn full_window_sampling_on_the_gpu_agrees_with_the_cache() {
    use snug_train::{Placement, SampleMode, SampleOptions, Sampler};
    if !have_gpu() {
        return;
    }
    let ckpt = hf_fixture("llama");
    let model = ckpt.config().clone();
    let load = |mode| {
        Sampler::from_hf_placed(
            &model,
            &ckpt,
            mode,
            Placement {
                device: DeviceSpec::Gpu(Selector::FirstGpu),
                quantize: None,
                context: None,
            },
            1,
            Allocator::default(),
        )
        .unwrap()
    };
    let greedy = SampleOptions {
        temperature: 0.0,
        top_k: None,
        seed: 0,
    };
    let prompt = [9u32, 8, 7];
    let a = load(SampleMode::KvCache)
        .generate(&prompt, 12, greedy)
        .unwrap();
    let b = load(SampleMode::FullWindow)
        .generate(&prompt, 12, greedy)
        .unwrap();
    assert_eq!(a, b);
}

/// `--precision f16` on the GPU: activations stored as f16 (written with the CPU's rounding,
/// read natively where the device has `SHADER_F16`), the loss scaled dynamically. The first
/// loss within 1e-4 relative of the CPU's f16 run, every later one within 1 %, the loss
/// falling, and the device holding exactly the plan on every step.
#[test]
fn f16_training_on_the_gpu_matches_the_cpu() {
    if !have_gpu() {
        return;
    }
    let steps = 12;
    let f16 = |device: &str| {
        let mut cfg = config(device, steps);
        cfg.precision = snug_graph::DType::F16;
        cfg.precision_pinned = true;
        cfg
    };
    let mut cpu = trainer(&f16("cpu"));
    let mut gpu = trainer(&f16("gpu"));
    let (mut lc, mut lg) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        lc.push(cpu.train_step().unwrap().loss);
        let s = gpu.train_step().unwrap();
        assert_eq!(s.peak_bytes, gpu.plan().peak_bytes(), "step {}", s.step);
        lg.push(s.loss);
    }
    let rel = |a: f32, b: f32| (a - b).abs() / a.abs().max(1e-6);
    assert!(
        rel(lc[0], lg[0]) < 1e-4,
        "first loss {} vs {}",
        lc[0],
        lg[0]
    );
    for (i, (c, g)) in lc.iter().zip(&lg).enumerate() {
        assert!(rel(*c, *g) < 0.01, "step {}: cpu {c} gpu {g}", i + 1);
    }
    assert!(lg[steps as usize - 1] < lg[0] - 0.3, "loss {lg:?}");
    assert_eq!(gpu.session().device_peak_bytes(), gpu.plan().peak_bytes());
}

/// `config` with `edit` applied to its training section.
fn config_with(
    preset: &str,
    device: &str,
    steps: u64,
    edit: impl Fn(&mut TrainSection),
) -> TrainConfig {
    let model = ModelSection {
        preset: Some(preset.into()),
        vocab_size: Some(13),
        ..Default::default()
    };
    let mut train = TrainSection {
        steps: Some(steps),
        batch: Some(4),
        block: Some(32),
        threads: Some(1),
        warmup_steps: Some(2),
        lr: Some(1e-2),
        eval_every: Some(0),
        device: Some(device.into()),
        ..Default::default()
    };
    edit(&mut train);
    TrainConfig::resolve(None, &model, &train).unwrap()
}

/// How far run `b`'s updates (its parameters less `init`) are from run `a`'s: the L2 norm of
/// the difference over the L2 norm of `a`'s updates, over every parameter.
fn update_distance(init: &[(String, Vec<f32>)], a: &Trainer, b: &Trainer) -> f64 {
    let (pa, pb) = (a.parameters().unwrap(), b.parameters().unwrap());
    assert_eq!(pa.len(), pb.len());
    let (mut diff, mut norm) = (0f64, 0f64);
    for (((ni, vi), (na, va)), (nb, vb)) in init.iter().zip(&pa).zip(&pb) {
        assert!(ni == na && na == nb, "{ni} {na} {nb}");
        for ((x0, x), y) in vi.iter().zip(va.iter()).zip(vb.iter()) {
            let (ua, ub) = (f64::from(x - x0), f64::from(y - x0));
            diff += (ua - ub) * (ua - ub);
            norm += ua * ua;
        }
    }
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// The same steps of `cfg` on the CPU and the GPU from the same weights and batches: the first
/// loss (no update yet) within 1e-5 relative, each later one within `later` relative, and the
/// GPU's updates (trained parameters less their initial values) within `updates` of the CPU's
/// in L2 norm; on the GPU every step's measured device peak equals the plan's. Adam divides
/// by each gradient's own scale, so a tiny gradient reduced in another order can move its
/// weight by up to the learning rate either way: updates are compared as a whole.
fn matches_the_cpu(what: &str, cfg: impl Fn(&str) -> TrainConfig, later: f32, updates: f64) {
    let steps = cfg("cpu").steps;
    let mut cpu = trainer(&cfg("cpu"));
    let mut gpu = trainer(&cfg("gpu"));
    assert!(gpu.session().target().is_gpu());
    let init = cpu.parameters().unwrap();
    let (mut lc, mut lg) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        lc.push(cpu.train_step().unwrap().loss);
        let s = gpu.train_step().unwrap();
        assert_eq!(
            s.peak_bytes,
            gpu.plan().peak_bytes(),
            "{what}: step {}",
            s.step
        );
        lg.push(s.loss);
    }
    let rel = |a: f32, b: f32| (a - b).abs() / a.abs().max(1e-6);
    eprintln!(
        "{what}: losses cpu {lc:?} gpu {lg:?}, update distance {:e}",
        update_distance(&init, &cpu, &gpu)
    );
    assert!(
        rel(lc[0], lg[0]) < 1e-5,
        "{what}: first loss {} vs {}",
        lc[0],
        lg[0]
    );
    for (i, (c, g)) in lc.iter().zip(&lg).enumerate() {
        assert!(
            rel(*c, *g) < later,
            "{what}: step {}: cpu {c} gpu {g}",
            i + 1
        );
    }
    let d = update_distance(&init, &cpu, &gpu);
    assert!(
        d <= updates,
        "{what}: updates differ by {d:e} of their norm"
    );
    assert_eq!(
        gpu.session().device_peak_bytes(),
        gpu.plan().peak_bytes(),
        "{what}"
    );
}

/// QLoRA (LoRA r 4 on every linear layer over an NF4 base) and LoRA over int8 and bf16 bases,
/// for GPT and Llama: the frozen weights dequantized on the device, each step's loss within
/// 1e-5 relative of the CPU's and the adapters' updates within 0.1 % in L2 norm (measured:
/// losses within 2e-7, updates within 6e-5), the device holding exactly the plan.
#[test]
fn quantized_base_steps_on_the_gpu_match_the_cpu() {
    if !have_gpu() {
        return;
    }
    for preset in ["tiny", "llama-tiny"] {
        for base in ["nf4", "int8", "bf16"] {
            let cfg = |device: &str| {
                config_with(preset, device, 4, |t| {
                    t.lora = Some(4);
                    t.lora_targets = Some("all-linear".into());
                    t.quantize_base = Some(base.into());
                })
            };
            matches_the_cpu(&format!("{preset} {base}"), cfg, 1e-5, 1e-3);
        }
    }
}

/// 8-bit AdamW on the GPU: the quantized moments updated on the device, losses within 1e-5
/// relative of the CPU's and the updates within 1 % in L2 norm (measured: losses within 4e-7,
/// updates within 1.6e-3; the kernel alone is bit-exact, `snug-gpu`'s kernel tests).
#[test]
fn an_8bit_adamw_run_on_the_gpu_matches_the_cpu() {
    if !have_gpu() {
        return;
    }
    for preset in ["tiny", "llama-tiny"] {
        let cfg = |device: &str| {
            config_with(preset, device, 4, |t| {
                t.optimizer = Some("adamw8bit".into())
            })
        };
        matches_the_cpu(&format!("{preset} adamw8bit"), cfg, 1e-5, 1e-2);
    }
}

/// An 8-bit AdamW run saved after 3 steps and resumed on the GPU repeats the uninterrupted
/// GPU run's losses and weights bit for bit (the moments' codes and absmaxes travel in the
/// checkpoint).
#[test]
fn resume_of_an_8bit_adamw_run_on_the_gpu_continues_exactly() {
    if !have_gpu() {
        return;
    }
    let cfg = config_with("tiny", "gpu", 6, |t| t.optimizer = Some("adamw8bit".into()));
    let mut straight = trainer(&cfg);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    let mut losses = Vec::new();
    for step in 1..=6 {
        losses.push(straight.train_step().unwrap().loss.to_bits());
        if step == 3 {
            straight.checkpoint().unwrap().save(&path).unwrap();
        }
    }
    let ckpt = Checkpoint::load(&path).unwrap();
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    let mut resumed = Trainer::resume(ckpt.config.clone(), data, Allocator::default(), &ckpt)
        .expect("resume on the GPU");
    assert!(resumed.session().target().is_gpu());
    let tail: Vec<u32> = (4..=6)
        .map(|_| resumed.train_step().unwrap().loss.to_bits())
        .collect();
    assert_eq!(tail, losses[3..]);
    assert!(bits(&resumed) == bits(&straight), "weights differ");
}

/// Sampling on NF4 and int8 weights on the GPU: the logits of a prefill and decode steps
/// within 1e-4 of the CPU's largest logit on the same quantized weights, the same greedy
/// tokens, and each phase holding exactly its plan.
#[test]
fn quantized_sampling_on_the_gpu_matches_the_cpu() {
    use snug_graph::ops::QuantizeBase;
    use snug_train::{Placement, SampleMode, SampleOptions, Sampler};
    if !have_gpu() {
        return;
    }
    let ckpt = hf_fixture("llama");
    let model = ckpt.config().clone();
    for quantize in [QuantizeBase::Nf4, QuantizeBase::Int8, QuantizeBase::Bf16] {
        let load = |device| {
            Sampler::from_hf_placed(
                &model,
                &ckpt,
                SampleMode::KvCache,
                Placement {
                    device,
                    quantize: Some(quantize),
                    context: None,
                },
                1,
                Allocator::default(),
            )
            .unwrap()
        };
        let mut cpu = load(DeviceSpec::Cpu);
        let mut dev = load(DeviceSpec::Gpu(Selector::FirstGpu));
        let mut context = vec![17u32, 42, 99, 5];
        for step in 0..4 {
            let want = cpu.next_token_logits(&context).unwrap().to_vec();
            let got = dev.next_token_logits(&context).unwrap().to_vec();
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-4 * scale,
                    "{quantize} step {step} logit {i}: gpu {g}, cpu {w}"
                );
            }
            let next = (want.iter().enumerate())
                .fold(0, |best, (i, v)| if *v > want[best] { i } else { best });
            context.push(next as u32);
        }
        let greedy = SampleOptions {
            temperature: 0.0,
            top_k: None,
            seed: 0,
        };
        let prompt = [3u32, 1, 4];
        assert_eq!(
            cpu.generate(&prompt, 8, greedy).unwrap(),
            dev.generate(&prompt, 8, greedy).unwrap(),
            "{quantize}: greedy tokens"
        );
        let stats = dev.kv_stats().unwrap();
        for phase in [stats.prefill, stats.decode] {
            assert_eq!(
                phase.planned_peak_bytes, phase.measured_peak_bytes,
                "{quantize}: planned == measured"
            );
        }
    }
}

/// The cross-step prefetch: while a micro-batch runs on the GPU, the next one's inputs (the
/// next micro-batch of the step, or the first of the next step's batch) are written into the
/// staging ring, before the running one's loss is read. The device counts inputs staged while
/// a launch was submitted and not yet waited for; the trainer counts micro-batches that ran on
/// them. The same run without the prefetch trains on the same batches: every loss and weight
/// bit for bit the same, an evaluation and a caller's own batch in between included.
#[test]
fn inputs_are_prefetched_while_the_step_runs_and_train_the_same_batches() {
    use snug_train::Batch;
    if !have_gpu() {
        return;
    }
    for accumulation in [1usize, 2] {
        let steps = 5u64;
        let cfg = config_with("tiny", "gpu", steps, |t| {
            t.accumulation = Some(accumulation);
        });
        let run = |prefetch: bool| {
            let mut t = trainer(&cfg);
            t.set_input_prefetch(prefetch);
            let mut losses = Vec::new();
            for step in 1..=steps {
                if step == 3 {
                    // Evaluation writes its own inputs over the staged ones.
                    t.evaluate().unwrap();
                }
                if step == 4 {
                    // A caller's batch (step 4's, drawn by hand) in place of the staged one.
                    let data = TokenDataset::load(&DataSource::Addition).unwrap();
                    let b = Batch::compute(&data, cfg.seed + 1, 4, cfg.batch, cfg.block);
                    losses.push(t.step_on(&b).unwrap().loss.to_bits());
                    continue;
                }
                losses.push(t.train_step().unwrap().loss.to_bits());
            }
            let staged = t.session().inputs_staged_while_running().unwrap();
            (losses, bits(&t), t.prefetched_micro_batches(), staged)
        };
        let (with, with_weights, prefetched, staged) = run(true);
        let (without, without_weights, none, unstaged) = run(false);
        assert_eq!(with, without, "accumulation {accumulation}: losses");
        assert!(
            with_weights == without_weights,
            "accumulation {accumulation}: weights"
        );
        assert_eq!(
            (none, unstaged),
            (0, 0),
            "no prefetch, nothing staged early"
        );
        // Every micro-batch but the first of the run, of the step after the evaluation, of the
        // caller's batch, and of the step after it (a caller's batch stages only its own).
        let k = accumulation as u64;
        assert_eq!(prefetched, steps * k - 4, "accumulation {accumulation}");
        // Tokens and targets of each of them at least, all written before the loss was read.
        assert!(
            staged as u64 >= 2 * prefetched,
            "{staged} inputs staged early"
        );
    }
    // The CPU runs a step to its end before returning: nothing to overlap, nothing staged.
    let mut cpu = trainer(&config_with("tiny", "cpu", 2, |_| {}));
    cpu.train_step().unwrap();
    cpu.train_step().unwrap();
    assert_eq!(cpu.prefetched_micro_batches(), 0);
    assert_eq!(cpu.session().inputs_staged_while_running(), None);
}
