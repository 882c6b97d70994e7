//! Gradient accumulation, clipping and the gradient norm, checked against a plain step's
//! gradients computed by hand.

use snug_cpu::CpuSession;
use snug_graph::ops::{AdamW, Sgd};
use snug_graph::{ClipMode, OptimizerSpec, StepGraph, StepOptions, TensorId, PREVIOUS_SUM_SQUARES};
use snug_nn::GptConfig;
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

const LR: f32 = 0.1;
const WD: f32 = 0.5;

fn tiny() -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        block_size: 8,
        vocab_size: 13,
    }
}

fn ids(n: usize, salt: usize) -> Vec<i32> {
    (0..n)
        .map(|i| ((i * 7 + salt * 3 + 1) % 13) as i32)
        .collect()
}

struct Built {
    step: StepGraph,
    session: CpuSession,
    tokens: TensorId,
    targets: TensorId,
}

fn build(cfg: &GptConfig, batch: usize, opts: &StepOptions) -> Built {
    let g = cfg.build(batch, 8, 2).unwrap();
    let (tokens, targets) = (g.tokens, g.targets);
    let step = StepGraph::build_with(g.graph, g.loss, opts).unwrap();
    let p = plan(&step, &PlanOptions::default()).unwrap();
    let mut session = CpuSession::new(step.graph.clone(), p, Allocator::default(), 2).unwrap();
    for (slot, (_, v)) in step.params.iter().zip(cfg.init_parameters(3)) {
        session.write_f32(slot.param, &v).unwrap();
    }
    Built {
        step,
        session,
        tokens,
        targets,
    }
}

/// Gradients of the whole 4-sequence batch, from a step without an update.
fn full_batch_grads(cfg: &GptConfig) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut b = build(cfg, 4, &StepOptions::new(OptimizerSpec::None));
    b.session.write_i32(b.tokens, &ids(32, 0), 13).unwrap();
    b.session.write_i32(b.targets, &ids(32, 1), 13).unwrap();
    b.session.run(ExecCtx::step(LR, 1)).unwrap();
    let params = b
        .step
        .params
        .iter()
        .map(|s| b.session.read_f32(s.param).unwrap().to_vec())
        .collect();
    let grads = b
        .step
        .params
        .iter()
        .map(|s| b.session.read_f32(s.grad).unwrap().to_vec())
        .collect();
    (params, grads)
}

fn global_norm(grads: &[Vec<f32>]) -> f32 {
    grads
        .iter()
        .flatten()
        .map(|&g| (g as f64) * (g as f64))
        .sum::<f64>()
        .sqrt() as f32
}

/// Runs one step of `opts` on the same 4 sequences, split into `micro_steps` micro-batches.
fn step_with(cfg: &GptConfig, opts: &StepOptions) -> (Vec<Vec<f32>>, Option<f32>) {
    let k = opts.micro_steps;
    let mut b = build(cfg, 4 / k, opts);
    let (x, y) = (ids(32, 0), ids(32, 1));
    let chunk = 32 / k;
    for micro in 0..k {
        let r = micro * chunk..(micro + 1) * chunk;
        b.session.write_i32(b.tokens, &x[r.clone()], 13).unwrap();
        b.session.write_i32(b.targets, &y[r], 13).unwrap();
        b.session
            .run(ExecCtx {
                lr: LR,
                step: 1,
                micro: micro as u32,
                micro_steps: k as u32,
            })
            .unwrap();
    }
    let params = b
        .step
        .params
        .iter()
        .map(|s| b.session.read_f32(s.param).unwrap().to_vec())
        .collect();
    let norm = b.step.grad_norm.map(|t| b.session.read_f32(t).unwrap()[0]);
    (params, norm)
}

fn assert_sgd_update(
    cfg: &GptConfig,
    after: &[Vec<f32>],
    before: &[Vec<f32>],
    grads: &[Vec<f32>],
    coef: f32,
) {
    let step = build(cfg, 4, &StepOptions::new(OptimizerSpec::None)).step;
    for (k, slot) in step.params.iter().enumerate() {
        let wd = if step.graph.tensor(slot.param).rank() >= 2 {
            WD
        } else {
            0.0
        };
        for ((&p1, &p0), &g) in after[k].iter().zip(&before[k]).zip(&grads[k]) {
            let expect = p0 * (1.0 - LR * wd) - LR * coef * g;
            assert!(
                (p1 - expect).abs() <= 2e-6 * (1.0 + expect.abs()),
                "{}: {p1} vs {expect}",
                slot.name
            );
        }
    }
}

#[test]
fn accumulated_micro_batches_update_like_the_whole_batch() {
    let cfg = tiny();
    let (before, grads) = full_batch_grads(&cfg);
    let sgd = OptimizerSpec::Sgd(Sgd { weight_decay: WD });
    for k in [2, 4] {
        let opts = StepOptions {
            micro_steps: k,
            ..StepOptions::new(sgd)
        };
        let (after, norm) = step_with(&cfg, &opts);
        assert_sgd_update(&cfg, &after, &before, &grads, 1.0);
        let norm = norm.expect("accumulation computes the norm");
        let want = global_norm(&grads);
        assert!((norm - want).abs() < 1e-4 * want, "k={k}: {norm} vs {want}");
    }
}

#[test]
fn clipping_scales_the_update_to_the_max_norm() {
    let cfg = tiny();
    let (before, grads) = full_batch_grads(&cfg);
    let norm = global_norm(&grads);
    let max_norm = 0.25 * norm;
    let sgd = OptimizerSpec::Sgd(Sgd { weight_decay: WD });
    for k in [1, 2] {
        let opts = StepOptions {
            micro_steps: k,
            clip_grad_norm: Some(max_norm),
            ..StepOptions::new(sgd)
        };
        let (after, reported) = step_with(&cfg, &opts);
        let coef = max_norm / (norm + 1e-6);
        assert_sgd_update(&cfg, &after, &before, &grads, coef);
        let reported = reported.expect("clipping computes the norm");
        assert!((reported - norm).abs() < 1e-4 * norm, "pre-clip norm");
    }
    // A max norm above the gradient's leaves the update as it was.
    let opts = StepOptions {
        clip_grad_norm: Some(10.0 * norm),
        ..StepOptions::new(sgd)
    };
    let (after, _) = step_with(&cfg, &opts);
    assert_sgd_update(&cfg, &after, &before, &grads, 1.0);
}

/// Asking for the norm changes nothing else, bit for bit.
#[test]
fn reporting_the_norm_leaves_the_update_bitwise_unchanged() {
    let cfg = tiny();
    let adamw = OptimizerSpec::AdamW(AdamW::default());
    let (plain, none) = step_with(&cfg, &StepOptions::new(adamw));
    assert_eq!(none, None);
    let (with_norm, norm) = step_with(
        &cfg,
        &StepOptions {
            grad_norm: true,
            ..StepOptions::new(adamw)
        },
    );
    assert!(norm.is_some_and(|n| n > 0.0));
    assert_eq!(plain, with_norm);
}

#[test]
fn accumulators_are_planned_as_persistent_state() {
    let cfg = tiny();
    let adamw = OptimizerSpec::AdamW(AdamW::default());
    let one = build(&cfg, 2, &StepOptions::new(adamw));
    let two = build(
        &cfg,
        2,
        &StepOptions {
            micro_steps: 2,
            ..StepOptions::new(adamw)
        },
    );
    let params = 4 * cfg.parameter_count();
    assert_eq!(
        two.session.plan().persistent_bytes - one.session.plan().persistent_bytes,
        params,
        "one f32 accumulator per parameter"
    );
    assert_eq!(two.session.plan().breakdown.grad_accumulators, params);
    assert!(StepGraph::build_with(
        cfg.build(1, 8, 1).unwrap().graph,
        TensorId(0),
        &StepOptions {
            micro_steps: 0,
            ..StepOptions::new(adamw)
        }
    )
    .is_err());
}

/// Per-tensor clipping scales each parameter's update by its own gradient's coefficient,
/// min(1, max / (‖g‖ + 1e-6)); with a bound between the norms, some are clipped and some not.
#[test]
fn per_tensor_clipping_scales_each_update_by_its_own_norm() {
    let cfg = tiny();
    let (before, grads) = full_batch_grads(&cfg);
    let norms: Vec<f32> = grads
        .iter()
        .map(|g| global_norm(std::slice::from_ref(g)))
        .collect();
    let mut sorted = norms.clone();
    sorted.sort_by(f32::total_cmp);
    let max_norm = sorted[sorted.len() / 2];
    let sgd = OptimizerSpec::Sgd(Sgd { weight_decay: WD });
    for fused_update in [false, true] {
        let opts = StepOptions {
            clip_grad_norm: Some(max_norm),
            clip_mode: ClipMode::Tensor,
            fused_update,
            ..StepOptions::new(sgd)
        };
        let (after, reported) = step_with(&cfg, &opts);
        let norm = global_norm(&grads);
        assert!(
            (reported.unwrap() - norm).abs() < 1e-4 * norm,
            "the global norm is reported"
        );
        let step = build(&cfg, 4, &StepOptions::new(OptimizerSpec::None)).step;
        let mut clipped = 0;
        for (k, slot) in step.params.iter().enumerate() {
            let coef = (max_norm / (norms[k] + 1e-6)).min(1.0);
            clipped += usize::from(coef < 1.0);
            let wd = if step.graph.tensor(slot.param).rank() >= 2 {
                WD
            } else {
                0.0
            };
            for ((&p1, &p0), &g) in after[k].iter().zip(&before[k]).zip(&grads[k]) {
                let expect = p0 * (1.0 - LR * wd) - LR * coef * g;
                assert!(
                    (p1 - expect).abs() <= 2e-6 * (1.0 + expect.abs()),
                    "{}: {p1} vs {expect}",
                    slot.name
                );
            }
        }
        assert!(
            clipped > 0 && clipped < norms.len(),
            "{clipped} of {}",
            norms.len()
        );
    }
}

/// Clipping by the previous step's norm reads the persistent sum of squares the step before
/// left (here written by hand), and leaves this step's in it.
#[test]
fn previous_norm_clipping_reads_and_keeps_the_sum_of_squares() {
    let cfg = tiny();
    let (before, grads) = full_batch_grads(&cfg);
    let norm = global_norm(&grads);
    let sgd = OptimizerSpec::Sgd(Sgd { weight_decay: WD });
    let opts = StepOptions {
        clip_grad_norm: Some(0.5),
        clip_mode: ClipMode::Previous,
        fused_update: true,
        ..StepOptions::new(sgd)
    };
    for previous in [0.0f32, 4.0] {
        let mut b = build(&cfg, 4, &opts);
        let state = (0..b.step.graph.tensors().len() as u32)
            .map(TensorId)
            .find(|&t| b.step.graph.tensor(t).name == PREVIOUS_SUM_SQUARES)
            .expect("the state is in the graph");
        b.session.write_f32(state, &[previous]).unwrap();
        b.session.write_i32(b.tokens, &ids(32, 0), 13).unwrap();
        b.session.write_i32(b.targets, &ids(32, 1), 13).unwrap();
        b.session.run(ExecCtx::step(LR, 1)).unwrap();
        let after: Vec<Vec<f32>> = b
            .step
            .params
            .iter()
            .map(|s| b.session.read_f32(s.param).unwrap().to_vec())
            .collect();
        // No previous step (0): no clipping. A previous norm of 2: coefficient 0.5 / 2.
        let coef = (0.5 / (previous.sqrt() + 1e-6)).min(1.0);
        assert_sgd_update(&cfg, &after, &before, &grads, coef);
        let kept = b.session.read_f32(state).unwrap()[0];
        assert!(
            (kept.sqrt() - norm).abs() < 1e-4 * norm,
            "{kept} vs {norm}²"
        );
    }
}

#[test]
fn fused_updates_refuse_what_needs_every_gradient() {
    let cfg = tiny();
    let adamw = OptimizerSpec::AdamW(AdamW::default());
    for (opts, why) in [
        (
            StepOptions {
                clip_grad_norm: Some(1.0),
                ..StepOptions::new(adamw)
            },
            "global-norm clipping",
        ),
        (
            StepOptions {
                micro_steps: 2,
                ..StepOptions::new(adamw)
            },
            "accumulation",
        ),
        (
            StepOptions {
                loss_scale: true,
                ..StepOptions::new(adamw)
            },
            "loss scaling",
        ),
    ] {
        let g = cfg.build(2, 8, 1).unwrap();
        let opts = StepOptions {
            fused_update: true,
            ..opts
        };
        match StepGraph::build_with(g.graph, g.loss, &opts) {
            Err(snug_graph::GraphError::Invalid { op, detail }) => {
                assert_eq!(op, "fused_update");
                assert!(detail.contains(why), "{detail}");
            }
            other => panic!("{why}: {other:?}"),
        }
    }
}
