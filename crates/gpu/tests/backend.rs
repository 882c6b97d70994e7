//! Whole training steps through the runtime's session on the GPU backend, against the CPU
//! backend on the same model built for the CPU's target (which fuses LayerNorm and GELU into
//! the linear layers: values are compared by parameter name), on the first adapter.

#[path = "common/mod.rs"]
mod common;

use std::collections::HashMap;

use snug_compile::{compile_step, CompiledStep, OptimizerKind, Pass, StepConfig, StepShape};
use snug_cpu::CpuBackend;
use snug_gpu::{GpuBackend, GpuSession};
use snug_graph::Target;
use snug_nn::ModelConfig;
use snug_plan::{plan, MemoryPlan, PlanError, PlanOptions};
use snug_runtime::{Allocator, Backend, Device, ExecCtx, RuntimeError, Session};

use common::{both_paths, gpu, ids};

/// Tokens of `batch` sequences of `seq`, and their next-token targets, in `0..vocab`.
fn batch(seed: u64, batch: usize, seq: usize, vocab: usize) -> (Vec<i32>, Vec<i32>) {
    let stream = ids(seed, batch * seq + 1, vocab as i32);
    (
        stream[..batch * seq].to_vec(),
        stream[1..=batch * seq].to_vec(),
    )
}

/// The step of `model` for `target`; with `read_grads`, every gradient (and the loss) is
/// kept to the end of the step so it can be read back.
fn compile(
    model: &ModelConfig,
    shape: StepShape,
    target: Target,
    config: &StepConfig,
    read_grads: bool,
) -> (CompiledStep, MemoryPlan) {
    let mut c = compile_step(model, shape, target, config).expect("the step compiles");
    if read_grads {
        for p in c.step.params.clone() {
            c.step.graph.mark_output(p.grad);
        }
    }
    let p = plan(&c.step.graph, &PlanOptions::default()).expect("the step plans");
    (c, p)
}

/// A session of either backend, fed the same parameters and batches.
struct Run<B: Backend> {
    session: Session<B>,
    step: CompiledStep,
}

impl<B: Backend> Run<B> {
    fn new(session: Session<B>, step: CompiledStep, model: &ModelConfig) -> Run<B> {
        let mut run = Run { session, step };
        let by_name: HashMap<String, _> = run
            .step
            .step
            .params
            .iter()
            .map(|p| (p.name.clone(), p.param))
            .collect();
        for (name, values) in model.init_parameters(7) {
            run.session
                .write_f32(by_name[&name], &values)
                .expect("write a parameter");
        }
        run
    }

    /// One step on `(tokens, targets)`, returning the loss.
    fn step(
        &mut self,
        (tokens, targets): &(Vec<i32>, Vec<i32>),
        vocab: usize,
        ctx: ExecCtx,
    ) -> f32 {
        self.session
            .write_i32(self.step.tokens, tokens, vocab)
            .expect("write tokens");
        self.session
            .write_i32(self.step.targets, targets, vocab)
            .expect("write targets");
        self.session.run(ctx).expect("the step runs");
        self.session
            .read_f32(self.step.step.loss)
            .expect("read the loss")[0]
    }

    /// Each parameter's gradient (or, with `params`, the parameter itself), by name.
    fn values(&self, params: bool) -> HashMap<String, Vec<f32>> {
        self.step
            .step
            .params
            .iter()
            .map(|p| {
                let id = if params { p.param } else { p.grad };
                let v = self.session.read_f32(id).expect("read a tensor");
                (p.name.clone(), v.into_owned())
            })
            .collect()
    }
}

fn gpu_run(
    device: &snug_gpu::GpuDevice,
    model: &ModelConfig,
    shape: StepShape,
    config: &StepConfig,
    read_grads: bool,
) -> Run<GpuBackend> {
    let backend = GpuBackend::new(device.clone());
    let (step, p) = compile(model, shape, backend.target(), config, read_grads);
    let session = GpuSession::new(step.step.graph.clone(), p, backend).expect("a GPU session");
    Run::new(session, step, model)
}

fn cpu_run(
    model: &ModelConfig,
    shape: StepShape,
    config: &StepConfig,
    read_grads: bool,
) -> Run<CpuBackend> {
    let backend = CpuBackend::new(Allocator::new(Device::Cpu), 2).expect("CPU workers");
    let (step, p) = compile(model, shape, backend.target(), config, read_grads);
    let session = Session::new(step.step.graph.clone(), p, backend).expect("a CPU session");
    Run::new(session, step, model)
}

/// AdamW with clipping, and the LM head and its loss unfused (in place where ops may).
fn config() -> StepConfig {
    StepConfig {
        passes: vec![Pass::InPlace],
        ..StepConfig::default()
    }
}

/// The largest difference between `got` and `want`, relative to `want`'s largest element.
fn max_rel_error(got: &[f32], want: &[f32]) -> f64 {
    let scale = want
        .iter()
        .fold(0f64, |m, &w| m.max(f64::from(w).abs()))
        .max(f64::MIN_POSITIVE);
    snug_testkit::worst(
        got.iter()
            .zip(want)
            .map(|(&g, &w)| (f64::from(g) - f64::from(w)).abs() / scale),
    )
}

/// One step on the GPU against the CPU: the loss and every gradient within 1e-4. Run on both
/// reduction paths (subgroup operations where the adapter has them, and without), which must
/// agree bit for bit in the loss, every gradient and every updated parameter.
fn one_step_matches_the_cpu(preset: &str, shape: StepShape, passes: Vec<Pass>) {
    let model = ModelConfig::preset(preset).expect("a preset");
    let vocab = model.vocab_size();
    // Gradients are read after the step, so none may be written over (no in-place pass).
    let config = StepConfig { passes, ..config() };
    let mut c = cpu_run(&model, shape, &config, true);
    let data = batch(3, shape.micro_batch, shape.block, vocab);
    let ctx = ExecCtx::step(1e-3, 1);
    let cl = c.step(&data, vocab, ctx);
    let cg = c.values(false);
    // The first path's loss, gradients and updated parameters.
    type Values = HashMap<String, Vec<f32>>;
    let mut first: Option<(f32, Values, Values)> = None;
    for device in both_paths() {
        let mut g = gpu_run(device, &model, shape, &config, true);
        let gl = g.step(&data, vocab, ctx);
        assert!(
            (f64::from(gl) - f64::from(cl)).abs() <= 1e-4 * f64::from(cl).abs(),
            "{preset}: loss {gl} on the GPU, {cl} on the CPU"
        );
        let gg = g.values(false);
        assert_eq!(gg.len(), cg.len());
        for (name, want) in &cg {
            let err = max_rel_error(&gg[name], want);
            assert!(
                err <= 1e-4,
                "{preset}: gradient of {name} differs by {err:e} of its largest element"
            );
            assert!(
                want.iter().any(|&v| v != 0.0),
                "{preset}: {name} has a gradient"
            );
        }
        let params = g.values(true);
        let bits = |m: &HashMap<String, Vec<f32>>, name: &str| -> Vec<u32> {
            m[name].iter().map(|v| v.to_bits()).collect()
        };
        match &first {
            None => first = Some((gl, gg, params)),
            Some((l0, g0, p0)) => {
                assert_eq!(
                    gl.to_bits(),
                    l0.to_bits(),
                    "{preset}: loss across the paths"
                );
                for name in cg.keys() {
                    assert!(
                        bits(&gg, name) == bits(g0, name),
                        "{preset}: gradient of {name} across the paths"
                    );
                    assert!(
                        bits(&params, name) == bits(p0, name),
                        "{preset}: {name} after the update across the paths"
                    );
                }
            }
        }
    }
}

/// GPT with its head and loss unfused.
#[test]
fn a_gpt_step_matches_the_cpu_in_loss_and_every_gradient() {
    one_step_matches_the_cpu(
        "tiny",
        StepShape {
            micro_batch: 2,
            block: 48,
        },
        vec![],
    );
}

/// Llama with the fused LM head + loss (untied head).
#[test]
fn a_llama_step_matches_the_cpu_in_loss_and_every_gradient() {
    one_step_matches_the_cpu(
        "llama-tiny",
        StepShape {
            micro_batch: 2,
            block: 40,
        },
        vec![Pass::FusedCrossEntropy],
    );
}

/// 50 steps of `tiny` as training runs them (the default passes: the fused head, in place) on
/// one batch (the loss falls steadily): the GPU's last loss within 1 % of the CPU's. The
/// device allocator's measured peak is the plan's, byte for byte.
#[test]
fn fifty_steps_of_tiny_end_where_the_cpu_does_and_peak_as_planned() {
    let Some(device) = gpu() else { return };
    let model = ModelConfig::preset("tiny").expect("tiny");
    let vocab = model.vocab_size();
    let shape = StepShape {
        micro_batch: 4,
        block: 32,
    };
    let config = StepConfig::default();
    let mut g = gpu_run(device, &model, shape, &config, false);
    let mut c = cpu_run(&model, shape, &config, false);
    let data = batch(11, shape.micro_batch, shape.block, vocab);
    let (mut gl, mut cl) = (0.0, 0.0);
    let mut first = None;
    for step in 1..=50 {
        let ctx = ExecCtx::step(3e-3, step);
        gl = g.step(&data, vocab, ctx);
        cl = c.step(&data, vocab, ctx);
        first.get_or_insert(gl);
    }
    assert!(
        (gl - cl).abs() <= 0.01 * cl.abs(),
        "after 50 steps: loss {gl} on the GPU, {cl} on the CPU"
    );
    let first = first.unwrap_or(gl);
    assert!(gl < 0.5 * first, "the loss fell from {first} to {gl}");

    let planned = g.session.plan().peak_bytes();
    let allocator = g.session.allocator();
    assert_eq!(allocator.peak_bytes(), planned, "allocator peak vs plan");
    let memory = g.session.backend().memory();
    assert_eq!(
        memory.device_peak_bytes(),
        planned as u64,
        "device buffers vs plan"
    );
    assert_eq!(allocator.device(), g.session.backend().device());
}

/// Micro-batches accumulate on the device as on the CPU: two steps of two micro-batches each,
/// SGD (so each update is linear in the gradient), the parameters compared after.
#[test]
fn accumulated_micro_batches_update_as_on_the_cpu() {
    let Some(device) = gpu() else { return };
    let model = ModelConfig::preset("llama-tiny").expect("llama-tiny");
    let vocab = model.vocab_size();
    let shape = StepShape {
        micro_batch: 2,
        block: 16,
    };
    let config = StepConfig {
        optimizer: OptimizerKind::Sgd,
        accumulation: 2,
        ..config()
    };
    let mut g = gpu_run(device, &model, shape, &config, false);
    let mut c = cpu_run(&model, shape, &config, false);
    for step in 1..=2u64 {
        for micro in 0..2u32 {
            let data = batch(
                100 + u64::from(micro),
                shape.micro_batch,
                shape.block,
                vocab,
            );
            let ctx = ExecCtx {
                lr: 0.5,
                step,
                micro,
                micro_steps: 2,
            };
            let (gl, cl) = (g.step(&data, vocab, ctx), c.step(&data, vocab, ctx));
            assert!((gl - cl).abs() <= 1e-4 * cl.abs(), "loss {gl} vs {cl}");
        }
    }
    let init: HashMap<String, Vec<f32>> = model.init_parameters(7).into_iter().collect();
    let (gp, cp) = (g.values(true), c.values(true));
    for (name, want) in &cp {
        // Compare the updates, which are what the gradients decide.
        let delta =
            |v: &[f32]| -> Vec<f32> { v.iter().zip(&init[name]).map(|(a, b)| a - b).collect() };
        let (gd, cd) = (delta(&gp[name]), delta(want));
        let err = max_rel_error(&gd, &cd);
        assert!(
            err <= 1e-3,
            "update of {name} differs by {err:e} of its largest element"
        );
    }
}

/// A graph the GPU cannot run (compiled for the CPU, whose fused LayerNorm + GEMM no GPU
/// kernel takes) is refused before anything is allocated, naming the device and the op.
#[test]
fn a_step_the_gpu_cannot_run_is_refused_before_allocating() {
    let Some(device) = gpu() else { return };
    let model = ModelConfig::preset("tiny").expect("tiny");
    let backend = GpuBackend::new(device.clone());
    let allocator = backend.allocator().clone();
    let shape = StepShape {
        micro_batch: 1,
        block: 16,
    };
    let cpu = Target::cpu(1, snug_graph::CpuGemm::Portable);
    let (step, p) = compile(&model, shape, cpu, &config(), false);
    match GpuSession::new(step.step.graph, p, backend) {
        Err(RuntimeError::UnsupportedOp {
            device: d, detail, ..
        }) => {
            assert!(d.contains(device.name()), "{d}");
            assert!(detail.contains("CPU fusion"), "{detail}");
        }
        Err(e) => panic!("expected an unsupported op, got {e}"),
        Ok(_) => panic!("the GPU runs no CPU fusion"),
    }
    assert_eq!(allocator.peak_bytes(), 0, "nothing was allocated");
}

/// 8-bit AdamW's u8 moment codes live on the device: three steps of `tiny` against the CPU
/// backend, the losses within 1e-5 relative and the weights' updates within 1 % of the CPU's
/// in L2 norm (Adam divides each gradient by its own scale, and a moment an ULP off a
/// midpoint between two code-book entries takes the other, so a tiny gradient reduced in
/// another order can move its weight differently); the device holds exactly the plan.
#[test]
fn an_8bit_adamw_step_runs_on_the_gpu_as_on_the_cpu() {
    let Some(device) = gpu() else { return };
    let model = ModelConfig::preset("tiny").expect("tiny");
    let vocab = model.vocab_size();
    let shape = StepShape {
        micro_batch: 2,
        block: 16,
    };
    let eight = StepConfig {
        optimizer: OptimizerKind::AdamW8bit,
        ..config()
    };
    let mut g = gpu_run(device, &model, shape, &eight, false);
    let mut c = cpu_run(&model, shape, &eight, false);
    for step in 1..=3u64 {
        let data = batch(40 + step, shape.micro_batch, shape.block, vocab);
        let ctx = ExecCtx::step(1e-2, step);
        let (gl, cl) = (g.step(&data, vocab, ctx), c.step(&data, vocab, ctx));
        assert!(
            (gl - cl).abs() <= 1e-5 * cl.abs(),
            "step {step}: loss {gl} vs {cl}"
        );
    }
    let init: HashMap<String, Vec<f32>> = model.init_parameters(7).into_iter().collect();
    let (gp, cp) = (g.values(true), c.values(true));
    let (mut diff, mut norm) = (0f64, 0f64);
    for (name, want) in &cp {
        for ((w, g), i) in want.iter().zip(&gp[name]).zip(&init[name]) {
            let (uc, ug) = (f64::from(w - i), f64::from(g - i));
            diff += (uc - ug) * (uc - ug);
            norm += uc * uc;
        }
    }
    assert!(norm > 0.0, "the weights moved");
    let d = (diff / norm).sqrt();
    assert!(d <= 1e-2, "updates differ by {d:e} of their norm");
    let planned = g.session.plan().peak_bytes();
    assert_eq!(g.session.allocator().peak_bytes(), planned);
    assert_eq!(
        g.session.backend().memory().device_peak_bytes(),
        planned as u64
    );
}

/// Planning for the adapter: a tensor larger than its largest storage binding is a named
/// planning error (the activations of a batch too large for one binding).
#[test]
fn a_tensor_over_the_binding_limit_fails_at_plan_time() {
    let Some(device) = gpu() else { return };
    let target = device.target();
    assert!(target.is_gpu());
    assert_eq!(
        target.memory.alignment,
        device.limits().min_storage_buffer_offset_alignment as usize
    );
    let model = ModelConfig::preset("tiny").expect("tiny");
    let seq = 64;
    let limit = target.memory.max_binding_bytes;
    // The MLP's hidden activations, 512 floats a token, outgrow the binding first.
    let micro_batch = limit / (seq * 512 * 4) + 1;
    let c = compile_step(
        &model,
        StepShape {
            micro_batch,
            block: seq,
        },
        target,
        &config(),
    )
    .expect("the step compiles");
    match plan(&c.step.graph, &PlanOptions::default()) {
        Err(PlanError::LargerThanBinding {
            name,
            bytes,
            limit: l,
        }) => {
            assert_eq!(l, limit);
            assert!(bytes > limit, "{name}: {bytes} bytes");
        }
        other => panic!("expected LargerThanBinding, got {other:?}"),
    }
}

/// The forward alone (an evaluation: `run_only` on the loss's nodes) reads the loss and leaves
/// the parameters as they were; a profiled run times every node of the schedule and updates
/// them as a plain run does.
#[test]
fn evaluation_leaves_parameters_and_profiling_times_every_node() {
    let Some(device) = gpu() else { return };
    let model = ModelConfig::preset("tiny").expect("tiny");
    let vocab = model.vocab_size();
    let shape = StepShape {
        micro_batch: 2,
        block: 16,
    };
    let mut g = gpu_run(device, &model, shape, &StepConfig::default(), false);
    let data = batch(5, shape.micro_batch, shape.block, vocab);
    let before = g.values(true);
    let loss = g.step.step.loss;
    let mask = g.session.nodes_for(&[loss]);
    g.session
        .write_i32(g.step.tokens, &data.0, vocab)
        .expect("tokens");
    g.session
        .write_i32(g.step.targets, &data.1, vocab)
        .expect("targets");
    g.session
        .run_only(ExecCtx::step(1e-2, 1), &mask)
        .expect("the forward runs");
    let eval = g.session.read_f32(loss).expect("the loss")[0];
    assert_eq!(g.values(true), before, "evaluation updated a parameter");

    let times = g
        .session
        .run_profiled(ExecCtx::step(1e-2, 1))
        .expect("a profiled step");
    assert_eq!(times.len(), g.session.plan().schedule.len());
    assert!(times.iter().all(|t| t.is_finite() && *t >= 0.0));
    let trained = g.session.read_f32(loss).expect("the loss")[0];
    assert_eq!(trained, eval, "the step's forward is the evaluation's");
    assert_ne!(
        g.values(true),
        before,
        "the profiled step updated the parameters"
    );
}

/// An arena over several device buffers: the same GPT step on a device whose largest buffer
/// is cut to about a quarter of the arena plans it in at least three chunks, none straddled,
/// and trains exactly as over one buffer (two steps, bit for bit: loss, every gradient, every
/// parameter), with the device's measured peak the plan's.
#[test]
fn an_arena_over_several_chunks_trains_as_over_one() {
    let Some(device) = gpu() else { return };
    let model = ModelConfig::preset("tiny").expect("tiny");
    let vocab = model.vocab_size();
    let shape = StepShape {
        micro_batch: 2,
        block: 16,
    };
    let config = config();
    let mut one = gpu_run(device, &model, shape, &config, true);
    let whole = one.session.plan().clone();
    assert_eq!(whole.chunks().len(), 1);
    let largest = whole
        .allocations
        .iter()
        .map(|a| a.size)
        .chain(whole.persistent.iter().map(|p| p.size))
        .max()
        .expect("tensors");
    let chunk = largest
        .max(whole.arena_bytes / 4)
        .next_multiple_of(whole.alignment);
    let small = device.with_max_buffer_size(chunk as u64);
    assert_eq!(small.target().memory.max_buffer_bytes, chunk);
    let mut split = gpu_run(&small, &model, shape, &config, true);
    let p = split.session.plan().clone();
    assert!(p.chunks().len() >= 3, "chunks {:?}", p.chunks());
    assert!(p.chunks().iter().all(|&c| c <= chunk), "{:?}", p.chunks());
    assert_eq!(p.chunks().iter().sum::<usize>(), p.arena_bytes);
    for a in &p.allocations {
        let (c, off) = p.arena_slot(a.tensor).expect("an arena tensor");
        assert!(
            off + a.size <= p.chunks()[c],
            "{} straddles chunk {c}",
            a.name
        );
    }
    for step in 1..=2 {
        let data = batch(step, shape.micro_batch, shape.block, vocab);
        let ctx = ExecCtx::step(1e-3, step);
        let (a, b) = (one.step(&data, vocab, ctx), split.step(&data, vocab, ctx));
        assert_eq!(a.to_bits(), b.to_bits(), "step {step}: loss {a} vs {b}");
        assert_eq!(
            one.values(false),
            split.values(false),
            "step {step}: gradients"
        );
        assert_eq!(
            one.values(true),
            split.values(true),
            "step {step}: parameters"
        );
    }
    let planned = p.peak_bytes();
    assert_eq!(split.session.allocator().peak_bytes(), planned);
    assert_eq!(
        split.session.backend().memory().device_peak_bytes(),
        planned as u64
    );
    // The arena goes back to the allocator's cache and comes again, chunk by chunk.
    split.session.release_arena().expect("release");
    assert_eq!(split.session.allocator().cache_bytes(), p.arena_bytes);
    let data = batch(3, shape.micro_batch, shape.block, vocab);
    let ctx = ExecCtx::step(1e-3, 3);
    let (a, b) = (one.step(&data, vocab, ctx), split.step(&data, vocab, ctx));
    assert_eq!(a.to_bits(), b.to_bits(), "after release: loss {a} vs {b}");
    assert_eq!(split.session.allocator().peak_bytes(), planned);
}

/// A tensor larger than the device's largest buffer cannot go in any chunk: a named planning
/// error.
#[test]
fn a_tensor_over_the_largest_buffer_fails_at_plan_time() {
    let Some(device) = gpu() else { return };
    let model = ModelConfig::preset("tiny").expect("tiny");
    let shape = StepShape {
        micro_batch: 2,
        block: 16,
    };
    let small = device.with_max_buffer_size(4096);
    let c = compile_step(&model, shape, small.target(), &config()).expect("the step compiles");
    match plan(&c.step.graph, &PlanOptions::default()) {
        Err(e @ PlanError::LargerThanBinding { .. }) => {
            // Bindings are cut with the buffers: the binding check names the tensor first.
            assert!(e.to_string().contains("4096 bytes"), "{e}");
        }
        other => panic!("expected a named planning error, got {other:?}"),
    }
}

/// A step's inputs go through a ring of staging buffers made once: every step writes its
/// tokens and targets with no wait and no new buffer, and the step (copies included) is one
/// submit. Losses stay the CPU's. The ring is host-visible memory, `RING_DEPTH` × the
/// inputs' bytes, outside the device peak, which stays the plan's.
#[test]
fn inputs_go_through_a_reused_staging_ring_in_the_steps_one_submit() {
    if gpu().is_none() {
        return;
    }
    // A device of its own: submits are counted per device, and tests beside it submit too.
    let device = &snug_gpu::GpuDevice::open(snug_gpu::Selector::FirstGpu).expect("a device");
    let model = ModelConfig::preset("tiny").expect("tiny");
    let vocab = model.vocab_size();
    let shape = StepShape {
        micro_batch: 2,
        block: 16,
    };
    let config = config();
    let mut g = gpu_run(device, &model, shape, &config, false);
    let mut c = cpu_run(&model, shape, &config, false);
    let backend = g.session.backend();
    assert_eq!(
        backend.staging_buffers_created(),
        snug_gpu::transfer::RING_DEPTH as u64
    );
    // Tokens and targets, 4 bytes each: the only inputs of this step.
    let inputs = 2 * shape.micro_batch * shape.block * 4;
    assert_eq!(
        backend.staging_bytes(),
        (snug_gpu::transfer::RING_DEPTH * inputs) as u64
    );
    for step in 1..=5 {
        let data = batch(step, shape.micro_batch, shape.block, vocab);
        let ctx = ExecCtx::step(1e-3, step);
        let before = device.submissions();
        g.session
            .write_i32(g.step.tokens, &data.0, vocab)
            .expect("tokens");
        g.session
            .write_i32(g.step.targets, &data.1, vocab)
            .expect("targets");
        assert_eq!(
            device.submissions(),
            before,
            "step {step}: inputs wait for the step"
        );
        g.session.run(ctx).expect("the step runs");
        assert_eq!(device.submissions(), before + 1, "step {step}: one submit");
        let gl = g.session.read_f32(g.step.step.loss).expect("loss")[0];
        let cl = c.step(&data, vocab, ctx);
        assert!(
            (f64::from(gl) - f64::from(cl)).abs() <= 1e-4 * f64::from(cl).abs(),
            "step {step}: loss {gl} on the GPU, {cl} on the CPU"
        );
    }
    let backend = g.session.backend();
    assert_eq!(
        backend.staging_buffers_created(),
        snug_gpu::transfer::RING_DEPTH as u64,
        "no staging buffer made per step"
    );
    let planned = g.session.plan().peak_bytes() as u64;
    assert_eq!(backend.memory().device_peak_bytes(), planned);
}

/// The device's own allocator agrees with the plan: after a step, the bytes it reports for
/// snug's buffers cover the planned peak (the driver rounds allocations up, never down), one
/// allocation per buffer the memory source has out.
#[test]
fn the_devices_allocator_report_covers_the_planned_peak() {
    if gpu().is_none() {
        return;
    }
    // A device of its own: the tests beside it allocate on the shared one meanwhile.
    let device = &snug_gpu::GpuDevice::open(snug_gpu::Selector::FirstGpu).expect("a device");
    let model = ModelConfig::preset("tiny").expect("tiny");
    let vocab = model.vocab_size();
    let shape = StepShape {
        micro_batch: 2,
        block: 16,
    };
    let mut g = gpu_run(device, &model, shape, &config(), false);
    let data = batch(5, shape.micro_batch, shape.block, vocab);
    g.step(&data, vocab, ExecCtx::step(1e-3, 1));
    let Some(report) = snug_gpu::allocator_report(device) else {
        println!(
            "skipped: the {} backend of {} gives no allocator report",
            device.info().backend,
            device.name()
        );
        return;
    };
    let p = g.session.plan();
    let memory = g.session.backend().memory();
    assert_eq!(memory.device_active_bytes(), p.peak_bytes() as u64);
    assert!(
        report.snug_bytes >= p.peak_bytes() as u64,
        "{report:?} below the plan's {} bytes",
        p.peak_bytes()
    );
    assert_eq!(
        report.snug_buffers,
        p.persistent.len() + p.chunks().len(),
        "{report:?}"
    );
    assert!(report.allocated_bytes >= report.snug_bytes, "{report:?}");
    assert!(
        report.reserved_bytes >= report.allocated_bytes,
        "{report:?}"
    );
}
