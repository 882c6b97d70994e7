//! Mixed precision: casts round as IEEE says, the bf16 step stays close to the f32 one at a
//! lower planned peak, bf16 training follows f32 training, and f16 training survives an
//! overflow by skipping the step and lowering the loss scale.

use snug_cpu::CpuSession;
use snug_graph::ops::Cast;
use snug_graph::passes::{mixed_precision, recast_saved};
use snug_graph::{DType, Graph, OptimizerSpec, Role, StepGraph};
use snug_nn::GptConfig;
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};
use snug_train::checkpoint::Checkpoint;
use snug_train::{DataSource, ModelSection, TokenDataset, TrainConfig, TrainSection, Trainer};

/// `x` through a cast to `low` and back.
fn round_trip(x: &[f32], low: DType) -> Vec<f32> {
    let mut g = Graph::new();
    let input = g
        .add_leaf("x", &[x.len()], DType::F32, Role::Input)
        .unwrap();
    let l = g.apply1(Cast { to: low }, &[input]).unwrap();
    let back = g.apply1(Cast { to: DType::F32 }, &[l]).unwrap();
    g.mark_output(back);
    let p = plan(&g, &PlanOptions::default()).unwrap();
    let mut s = CpuSession::new(g, p, Allocator::default(), 1).unwrap();
    s.write_f32(input, x).unwrap();
    s.run(ExecCtx::default()).unwrap();
    s.read_f32(back).unwrap().to_vec()
}

#[test]
fn casts_round_to_nearest_even_and_overflow_to_infinity() {
    // bf16 keeps 7 fraction bits: at 1.0 the spacing is 2^-7.
    let ulp = 2f32.powi(-7);
    let x = [
        1.0 + ulp / 2.0,
        1.0 + 1.5 * ulp,
        1.0 + 0.75 * ulp,
        -3.0,
        1e38,
        3.4e38,
    ];
    let y = round_trip(&x, DType::BF16);
    assert_eq!(y[0], 1.0, "a tie rounds to the even neighbour (1.0)");
    assert_eq!(
        y[1],
        1.0 + 2.0 * ulp,
        "a tie rounds to the even neighbour (1 + 2 ulp)"
    );
    assert_eq!(y[2], 1.0 + ulp, "above the midpoint rounds up");
    assert_eq!(y[3], -3.0);
    assert!(
        (y[4] - 1e38).abs() / 1e38 < 2f32.powi(-8),
        "bf16 has f32's range"
    );
    assert_eq!(y[5], f32::INFINITY, "past bf16's largest finite value");
    // f16 keeps 10 fraction bits and tops out at 65504.
    let y = round_trip(&[1.0 + 2f32.powi(-11), 65504.0, 65520.0, 1e-8], DType::F16);
    assert_eq!(y[0], 1.0);
    assert_eq!(y[1], 65504.0);
    assert_eq!(y[2], f32::INFINITY, "65520 rounds past the largest f16");
    assert_eq!(y[3], 0.0, "below f16's smallest subnormal (6e-8)");
}

/// Loss and gradients of one step of a small GPT, and the planned (= measured) peak.
fn loss_grads_peak(low: Option<DType>) -> (f32, Vec<Vec<f32>>, usize) {
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: 32,
        vocab_size: 40,
    };
    let (batch, seq) = (4, 32);
    let mut g = cfg.build(batch, seq, 2).unwrap();
    if let Some(low) = low {
        let (r, rounded) = mixed_precision(&g.graph, low).unwrap();
        // Seven per block (two fused norm-linears, attention, its projection, the fused
        // GELU-linear and two residual adds), and the embeddings and final norm.
        assert!(rounded > 7 * cfg.n_layer, "{rounded} activations rounded");
        g = g.rewritten(r).unwrap();
    }
    let mut step = StepGraph::build(g.graph, g.loss, OptimizerSpec::None).unwrap();
    if low.is_some() {
        let (r, made) = recast_saved(&step).unwrap();
        assert!(made > 0);
        step = step.rewritten(r, step.forward_nodes).unwrap();
    }
    let p = plan(&step, &PlanOptions::default()).unwrap();
    let peak = p.peak_bytes();
    let alloc = Allocator::default();
    let mut s = CpuSession::new(step.graph.clone(), p, alloc.clone(), 2).unwrap();
    for (slot, (_, v)) in step.params.iter().zip(cfg.init_parameters(4)) {
        s.write_f32(slot.param, &v).unwrap();
    }
    let ids = |a: usize, b: usize| {
        (0..batch * seq)
            .map(|i| ((i * a + b) % 40) as i32)
            .collect::<Vec<_>>()
    };
    s.write_i32(step.inputs[0], &ids(31, 7), 40).unwrap();
    s.write_i32(step.inputs[1], &ids(17, 3), 40).unwrap();
    s.run(ExecCtx::default()).unwrap();
    assert_eq!(alloc.peak_bytes(), peak, "measured peak equals the plan's");
    let loss = s.read_f32(step.loss).unwrap()[0];
    let grads = step
        .params
        .iter()
        .map(|p| s.read_f32(p.grad).unwrap().to_vec())
        .collect();
    (loss, grads, peak)
}

/// bf16 and f16 keep the loss to 0.5 % and every gradient to 5 % (relative L2 error): the
/// rounding error of 8 and 11 significant bits, not a wrong derivative (a sign or a missed
/// term would be off by order one). The planned peak is lower.
#[test]
fn mixed_precision_step_stays_close_to_f32_at_a_lower_peak() {
    let (l32, g32, p32) = loss_grads_peak(None);
    for low in [DType::BF16, DType::F16] {
        let (l, g, p) = loss_grads_peak(Some(low));
        assert!(
            (l - l32).abs() <= 5e-3 * l32.abs(),
            "{low}: loss {l} vs {l32}"
        );
        for (a, b) in g.iter().zip(&g32) {
            let err: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
            let norm: f32 = b.iter().map(|y| y * y).sum();
            assert!(
                err.sqrt() <= 0.05 * norm.sqrt(),
                "{low}: gradient off by {err} of {norm}"
            );
        }
        assert!(p < p32, "{low}: peak {p} vs f32 {p32}");
    }
}

fn config(precision: &str, steps: u64, loss_scale: Option<f32>) -> TrainConfig {
    let model = ModelSection {
        preset: Some("tiny".into()),
        ..Default::default()
    };
    let train = TrainSection {
        steps: Some(steps),
        batch: Some(8),
        block: Some(32),
        threads: Some(1),
        warmup_steps: Some(5),
        precision: Some(precision.into()),
        loss_scale,
        ..Default::default()
    };
    TrainConfig::resolve(None, &model, &train).unwrap()
}

fn trainer(cfg: &TrainConfig) -> Trainer {
    Trainer::new(
        cfg.clone(),
        TokenDataset::load(&DataSource::Addition).unwrap(),
    )
    .unwrap()
}

/// Steps to the final loss: to the plateau the cosine schedule ends on. The built-in data's
/// loss falls in steps (one near step 150, others up to step 400) whose timing shifts with
/// any difference in the updates: another GEMM tile's summation order moved bf16's loss at
/// step 150 by 13 % against f32's, while after 600 steps every precision and bf16 arithmetic
/// lands near f32.
const STEPS: u64 = 600;

/// Seeds the final loss is averaged over. One seed's plateau moves with the summation order:
/// f32's alone lands 1.538–1.582 over seeds 1–3, and a depth block of 512 rather than 384 put
/// seed 1337's bf16 2.1 % above its f32 (0.5 % before); over three seeds bf16 and f16 are
/// 0.7 % from f32.
const SEEDS: [u64; 3] = [1, 2, 3];

/// Mean loss of the last 50 of [`STEPS`] steps, averaged over [`SEEDS`].
fn final_loss(precision: &str) -> f32 {
    let per_seed = SEEDS.map(|seed| {
        let mut cfg = config(precision, STEPS, None);
        cfg.seed = seed;
        let mut t = trainer(&cfg);
        let losses: Vec<f32> = (0..STEPS).map(|_| t.train_step().unwrap().loss).collect();
        losses[losses.len() - 50..].iter().sum::<f32>() / 50.0
    });
    per_seed.iter().sum::<f32>() / SEEDS.len() as f32
}

#[test]
fn bf16_and_f16_training_follow_f32_within_two_percent() {
    let f32_loss = final_loss("f32");
    let first = trainer(&config("f32", STEPS, None))
        .train_step()
        .unwrap()
        .loss;
    assert!(
        f32_loss < 0.8 * first,
        "training learns: {first} -> {f32_loss}"
    );
    for p in ["bf16", "f16"] {
        let l = final_loss(p);
        println!("{p}: {l} vs f32 {f32_loss}");
        assert!(
            (l - f32_loss).abs() <= 0.02 * f32_loss,
            "{p}: {l} vs f32 {f32_loss}"
        );
    }
}

fn parameter_bits(t: &Trainer) -> Vec<Vec<u32>> {
    t.parameters()
        .unwrap()
        .into_iter()
        .map(|(_, v)| v.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// A loss scale of 2^40 makes the f16 gradients overflow: each such step leaves the weights
/// as they were and halves the scale, until the scale is small enough to train; the scaler's
/// state survives a checkpoint.
#[test]
fn f16_overflow_skips_the_step_and_lowers_the_scale() {
    let start = 2f32.powi(40);
    let mut t = trainer(&config("f16", 60, Some(start)));
    let mut expected = start;
    let mut skipped = 0;
    loop {
        let before = parameter_bits(&t);
        let s = t.train_step().unwrap();
        assert!(s.loss.is_finite(), "the forward pass is unaffected");
        assert_eq!(s.loss_scale, Some(expected));
        if !s.skipped {
            assert!(s.grad_norm.is_some_and(f32::is_finite));
            assert_ne!(
                parameter_bits(&t),
                before,
                "a good step updates the weights"
            );
            break;
        }
        assert!(!s.grad_norm.is_some_and(f32::is_finite));
        assert_eq!(
            parameter_bits(&t),
            before,
            "a skipped step changes no weight"
        );
        expected /= 2.0;
        skipped += 1;
        assert!(skipped < 40, "the scale never came down far enough");
    }
    assert!(skipped >= 1, "2^40 must overflow f16 gradients");

    let ckpt = t.checkpoint().unwrap();
    let state = ckpt
        .loss_scale
        .expect("an f16 checkpoint holds the loss scale");
    assert_eq!((state.scale, state.skipped), (expected, skipped));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    ckpt.save(&path).unwrap();
    let loaded = Checkpoint::load(&path).unwrap();
    assert_eq!(loaded.loss_scale, Some(state));
    let mut resumed = Trainer::resume(
        config("f16", 60, Some(start)),
        TokenDataset::load(&DataSource::Addition).unwrap(),
        Allocator::default(),
        &loaded,
    )
    .unwrap();
    let next_a = t.train_step().unwrap();
    let next_b = resumed.train_step().unwrap();
    assert_eq!(next_b.loss_scale, Some(expected));
    assert_eq!(next_a.loss.to_bits(), next_b.loss.to_bits());
    assert_eq!(
        parameter_bits(&t),
        parameter_bits(&resumed),
        "bit-exact resume"
    );
}
