//! The demo's promise: a short run on the built-in data learns addition it never saw.

use snug_runtime::Allocator;
use snug_train::addition::{self, HELD_OUT_SEED};
use snug_train::{ModelSection, Sampler, TokenDataset, TrainConfig, TrainSection, Trainer};

/// Guessing a sum uniformly among the 199 possible (0..=198) is right 0.5 % of the time. After
/// 600 steps of 1,024 tokens (about 6 s in release on two cores) the demo model is mid-way
/// through learning to carry, where float rounding moves the score a lot: 46 % of held-out
/// problems with fused multiply-adds in `exp`, 9 % with the portable build's plain ones. 5 %
/// (10 of 200) is ten times chance, and an untrained model scores 0.
const LEARNED_ACCURACY: f64 = 0.05;

#[test]
fn a_short_run_answers_held_out_additions() {
    let train = TrainSection {
        steps: Some(600),
        batch: Some(16),
        block: Some(64),
        eval_every: Some(0),
        ..Default::default()
    };
    let cfg = TrainConfig::resolve(None, &ModelSection::default(), &train).unwrap();
    let data = TokenDataset::load(&(&cfg.data).into()).unwrap();
    let mut t = Trainer::new(cfg, data).unwrap();
    let mut before = sampler(&t);
    let tokenizer = t.data().tokenizer.clone();
    let untrained = addition::held_out_accuracy(&mut before, &tokenizer, 200).unwrap();
    for _ in 0..600 {
        t.train_step().unwrap();
    }
    let mut after = sampler(&t);
    let score = addition::held_out_accuracy(&mut after, &tokenizer, 200).unwrap();
    println!(
        "held-out accuracy {:.1} % -> {:.1} % ({:.0} ms to score); wrong: {:?}",
        untrained.accuracy() * 100.0,
        score.accuracy() * 100.0,
        score.ms,
        score.wrong
    );
    assert_eq!(untrained.correct, 0, "{untrained:?}");
    assert_eq!(score.problems, 200);
    assert!(score.accuracy() >= LEARNED_ACCURACY, "{score:?}");
    // The problems scored were never trained on.
    assert!(addition::held_out_problems(200, HELD_OUT_SEED)
        .iter()
        .all(|p| p.is_held_out()));
}

fn sampler(t: &Trainer) -> Sampler {
    Sampler::new(
        t.model(),
        &t.parameters().unwrap(),
        t.config().threads,
        Allocator::default(),
    )
    .unwrap()
}
