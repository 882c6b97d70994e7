//! Updates fused into the backward through the trainer: without clipping they train the
//! unfused step's weights bit for bit (the unfused step here clips globally at a bound the
//! norm never reaches, so its coefficient is exactly 1 and every update waits for every
//! gradient), at a lower planned peak that the run measures; clipping by the previous step's
//! norm resumes bit-exactly from its checkpoint; what needs every gradient at once is refused.

use snug_graph::PREVIOUS_SUM_SQUARES;
use snug_runtime::Allocator;
use snug_train::{
    DataSource, ModelSection, TokenDataset, TrainConfig, TrainError, TrainSection, Trainer,
};

fn section(steps: u64) -> TrainSection {
    // One short sequence: the weights' gradients outweigh the activations.
    TrainSection {
        steps: Some(steps),
        batch: Some(1),
        block: Some(8),
        threads: Some(1),
        warmup_steps: Some(2),
        lr: Some(3e-3),
        ..Default::default()
    }
}

fn resolve(train: TrainSection) -> Result<TrainConfig, TrainError> {
    let model = ModelSection {
        preset: Some("tiny".into()),
        ..Default::default()
    };
    TrainConfig::resolve(None, &model, &train)
}

fn trainer(cfg: &TrainConfig) -> Trainer {
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    Trainer::new(cfg.clone(), data).unwrap()
}

/// Runs `steps` steps, checking planned == measured at each; returns the weights' bits.
fn run(cfg: &TrainConfig, steps: usize) -> (Vec<Vec<u32>>, usize) {
    let mut t = trainer(cfg);
    for _ in 0..steps {
        let s = t.train_step().unwrap();
        assert_eq!(s.peak_bytes, t.plan().peak_bytes(), "step {}", s.step);
    }
    let bits = t
        .parameters()
        .unwrap()
        .iter()
        .map(|(_, v)| v.iter().map(|x| x.to_bits()).collect())
        .collect();
    (bits, t.plan().peak_bytes())
}

#[test]
fn fused_updates_train_the_unfused_weights_bit_for_bit_at_a_lower_peak() {
    // bf16 also ties each backward up-cast to its reader (an order, not a value, changes).
    for (optimizer, precision) in [
        ("adamw", "f32"),
        ("adamw8bit", "f32"),
        ("sgd", "f32"),
        ("adamw", "bf16"),
        ("adamw8bit", "bf16"),
    ] {
        let unfused = resolve(TrainSection {
            grad_clip: Some(1e30),
            optimizer: Some(optimizer.into()),
            precision: Some(precision.into()),
            ..section(5)
        })
        .unwrap();
        let fused = resolve(TrainSection {
            grad_clip: Some(0.0),
            fused_update: Some(true),
            optimizer: Some(optimizer.into()),
            precision: Some(precision.into()),
            ..section(5)
        })
        .unwrap();
        let (a, unfused_peak) = run(&unfused, 5);
        let (b, fused_peak) = run(&fused, 5);
        assert_eq!(a, b, "{optimizer} {precision}: the same weights");
        assert!(
            (fused_peak as f64) < 0.9 * unfused_peak as f64,
            "{optimizer} {precision}: fused {fused_peak} vs unfused {unfused_peak}"
        );
    }
}

#[test]
fn per_tensor_and_previous_norm_clipping_plan_what_they_measure() {
    for mode in ["tensor", "previous"] {
        let cfg = resolve(TrainSection {
            grad_clip: Some(0.05),
            clip_mode: Some(mode.into()),
            fused_update: Some(true),
            ..section(4)
        })
        .unwrap();
        let (bits, _) = run(&cfg, 4);
        let unclipped = resolve(TrainSection {
            grad_clip: Some(0.0),
            fused_update: Some(true),
            ..section(4)
        })
        .unwrap();
        // A bound this low clips: the weights differ from the unclipped run's.
        assert_ne!(bits, run(&unclipped, 4).0, "{mode}");
    }
}

#[test]
fn previous_norm_clipping_resumes_bit_exactly() {
    let cfg = resolve(TrainSection {
        grad_clip: Some(0.05),
        clip_mode: Some("previous".into()),
        fused_update: Some(true),
        ..section(6)
    })
    .unwrap();
    let straight = {
        let mut t = trainer(&cfg);
        (0..6)
            .map(|_| t.train_step().unwrap().loss)
            .collect::<Vec<_>>()
    };
    let mut first = trainer(&cfg);
    let mut resumed: Vec<f32> = (0..3).map(|_| first.train_step().unwrap().loss).collect();
    let ckpt = first.checkpoint().unwrap();
    let saved = ckpt
        .tensor(PREVIOUS_SUM_SQUARES)
        .expect("the norm is saved");
    assert!(saved.data[0] > 0.0);
    assert!(ckpt
        .parameters()
        .iter()
        .all(|(n, _)| n != PREVIOUS_SUM_SQUARES));
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    let mut second = Trainer::resume(cfg.clone(), data, Allocator::default(), &ckpt).unwrap();
    resumed.extend((0..3).map(|_| second.train_step().unwrap().loss));
    assert_eq!(straight, resumed);
}

#[test]
fn what_needs_every_gradient_is_a_named_error() {
    let fused = |train: TrainSection| {
        resolve(TrainSection {
            fused_update: Some(true),
            ..train
        })
    };
    let cases = [
        (section(1), "global-norm clipping"),
        (
            TrainSection {
                grad_clip: Some(0.0),
                batch: Some(2),
                accumulation: Some(2),
                ..section(1)
            },
            "accumulation",
        ),
        (
            TrainSection {
                grad_clip: Some(0.0),
                precision: Some("f16".into()),
                ..section(1)
            },
            "loss scaling",
        ),
    ];
    for (train, why) in cases {
        match fused(train) {
            Err(TrainError::Config { field, detail }) => {
                assert_eq!(field, "fused_update");
                assert!(detail.contains(why), "{detail}");
            }
            other => panic!("{why}: {other:?}"),
        }
    }
    match resolve(TrainSection {
        clip_mode: Some("sideways".into()),
        ..section(1)
    }) {
        Err(TrainError::Config { field, .. }) => assert_eq!(field, "clip_mode"),
        other => panic!("{other:?}"),
    }
}
