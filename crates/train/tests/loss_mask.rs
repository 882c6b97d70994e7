//! Loss masks through the trainer: token files with a mask train only on the targets it
//! counts; with gradient accumulation the loss and the gradients average over every counted
//! target of the step, not per micro-batch; a step that counts nothing is a loss of 0 with no
//! update; and `Trainer::step_on` runs a step on a caller's batch, refusing bad ones by kind.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use snug_train::data::{Batch, TRAIN_FILE, VAL_FILE};
use snug_train::{
    CharTokenizer, ModelSection, TokenDataset, TokenFile, Tokenizer, TrainConfig, TrainError,
    TrainSection, Trainer,
};

/// Each example: five random digits and `=` (the prompt), then `e` or `o` as the last digit
/// is even or odd and a newline (the completion). Only the completion counts.
const SYMBOLS: &str = "0123456789=eo\n";

fn examples(count: usize, seed: u64) -> (String, Vec<bool>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (mut text, mut mask) = (String::new(), Vec::new());
    for _ in 0..count {
        let digits: Vec<u32> = (0..5).map(|_| rng.random_range(0..10)).collect();
        for d in &digits {
            text.push(char::from_digit(*d, 10).unwrap_or('0'));
        }
        text.push('=');
        text.push(if digits[4].is_multiple_of(2) {
            'e'
        } else {
            'o'
        });
        text.push('\n');
        mask.extend([false; 6].into_iter().chain([true; 2]));
    }
    (text, mask)
}

/// A token directory of prompt/completion examples with their loss mask.
fn masked_dir(dir: &std::path::Path) {
    let tokenizer = Tokenizer::Char(CharTokenizer::from_text(SYMBOLS));
    for (file, count, seed) in [(TRAIN_FILE, 4000, 1), (VAL_FILE, 500, 2)] {
        let (text, mask) = examples(count, seed);
        let ids = tokenizer.encode(&text).unwrap();
        TokenFile::write_masked(&dir.join(file), &tokenizer, &ids, &mask).unwrap();
    }
}

const BLOCK: usize = 32;

fn config(dir: &std::path::Path, batch: usize, accumulation: usize, sgd: bool) -> TrainConfig {
    let model = ModelSection {
        preset: Some("llama-tiny".into()),
        ..Default::default()
    };
    let mut train = TrainSection {
        data: Some(dir.to_path_buf()),
        steps: Some(80),
        batch: Some(batch),
        block: Some(BLOCK),
        threads: Some(2),
        accumulation: Some(accumulation),
        eval_batches: Some(4),
        ..Default::default()
    };
    if sgd {
        // Plain SGD at a learning rate of 1 with no decay or clipping: an update is minus the
        // gradient, so two steps' gradients compare through their parameters.
        train.optimizer = Some("sgd".into());
        train.lr = Some(1.0);
        train.min_lr = Some(1.0);
        train.warmup_steps = Some(0);
        train.weight_decay = Some(0.0);
        train.grad_clip = Some(0.0);
    }
    TrainConfig::resolve(None, &model, &train).unwrap()
}

fn trainer(cfg: &TrainConfig) -> Trainer {
    let mut cfg = cfg.clone();
    let (data, _) = cfg.load_data_and_model().unwrap();
    assert!(cfg.loss_mask, "token files with a mask make a masked step");
    let t = Trainer::new(cfg, data).unwrap();
    assert!(t.loss_mask().is_some());
    t
}

fn flat_parameters(t: &Trainer) -> Vec<f32> {
    t.parameters()
        .unwrap()
        .into_iter()
        .flat_map(|(_, v)| v)
        .collect()
}

/// The gradient the SGD step on `batch` took from the state `t` is in, and its loss.
fn gradient_of(t: &mut Trainer, batch: &Batch) -> (Vec<f32>, f32) {
    let before = flat_parameters(t);
    let stats = t.step_on(batch).unwrap();
    let after = flat_parameters(t);
    let grad = before.iter().zip(&after).map(|(b, a)| b - a).collect();
    (grad, stats.loss)
}

fn distance(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum::<f64>()
        .sqrt()
}

fn norm(a: &[f32]) -> f64 {
    distance(a, &vec![0.0; a.len()])
}

/// Four random sequences: the first two (the first micro-batch under accumulation 2) count
/// 60 of their 64 targets, the last two count 4.
fn uneven_batch(vocab: usize) -> Batch {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let n = 4 * BLOCK;
    let ids = |rng: &mut ChaCha8Rng| -> Vec<i32> {
        (0..n).map(|_| rng.random_range(0..vocab as i32)).collect()
    };
    let (x, y) = (ids(&mut rng), ids(&mut rng));
    let mask = (0..n)
        .map(|i| {
            if i < 2 * BLOCK {
                i % 16 != 3
            } else {
                i % 20 == 7
            }
        })
        .collect();
    Batch::new(x, y, Some(mask))
}

/// `mask` kept only at `keep`'s positions.
fn only(batch: &Batch, keep: impl Fn(usize) -> bool) -> Batch {
    let mask = batch.mask.as_ref().map(|m| {
        m.iter()
            .enumerate()
            .map(|(i, &c)| c && keep(i))
            .collect::<Vec<_>>()
    });
    Batch::new(batch.x.clone(), batch.y.clone(), mask)
}

#[test]
fn accumulation_averages_over_every_counted_target_of_the_step() {
    let dir = tempfile::tempdir().unwrap();
    masked_dir(dir.path());
    let mut one = trainer(&config(dir.path(), 4, 1, true));
    let mut two = trainer(&config(dir.path(), 4, 2, true));
    assert_eq!(flat_parameters(&one), flat_parameters(&two));
    let vocab = one.model().vocab_size();
    let batch = uneven_batch(vocab);
    let counts = (60, 4);
    let first_half = |i: usize| i < 2 * BLOCK;
    let count = |b: &Batch| b.mask.as_ref().unwrap().iter().filter(|&&c| c).count();
    assert_eq!(count(&only(&batch, first_half)), counts.0);
    assert_eq!(count(&only(&batch, |i| !first_half(i))), counts.1);

    let start = one.checkpoint().unwrap();
    let (g_one, loss_one) = gradient_of(&mut one, &batch);
    let (g_two, loss_two) = gradient_of(&mut two, &batch);
    // Two micro-batches of 60 and 4 counted targets are the one batch of 64.
    assert!(
        (loss_one - loss_two).abs() <= 1e-5 * loss_one,
        "{loss_one} vs {loss_two}"
    );
    let scale = norm(&g_one);
    assert!(scale > 0.0);
    assert!(
        distance(&g_one, &g_two) <= 1e-4 * scale,
        "the accumulated gradient differs: {} of {scale}",
        distance(&g_one, &g_two)
    );
    // Each half alone (the mean over its own counted targets), from the same state.
    one.restore(&start).unwrap();
    let (g_a, loss_a) = gradient_of(&mut one, &only(&batch, first_half));
    one.restore(&start).unwrap();
    let (g_b, loss_b) = gradient_of(&mut one, &only(&batch, |i| !first_half(i)));
    let (ca, cb) = (counts.0 as f32, counts.1 as f32);
    let weighted = (ca * loss_a + cb * loss_b) / (ca + cb);
    assert!((weighted - loss_two).abs() <= 1e-5 * weighted);
    let whole: Vec<f32> = g_a
        .iter()
        .zip(&g_b)
        .map(|(a, b)| (ca * a + cb * b) / (ca + cb))
        .collect();
    assert!(distance(&whole, &g_two) <= 1e-4 * scale);
    // Averaging each micro-batch's own mean (the per-micro-batch normaliser) weighs the 4
    // targets of the second as much as the 60 of the first: a different gradient.
    let per_micro: Vec<f32> = g_a.iter().zip(&g_b).map(|(a, b)| (a + b) / 2.0).collect();
    assert!(
        distance(&per_micro, &g_two) > 0.1 * scale,
        "the test cannot tell the normalisers apart"
    );
}

#[test]
fn a_step_that_counts_nothing_is_a_zero_loss_and_no_update() {
    let dir = tempfile::tempdir().unwrap();
    masked_dir(dir.path());
    for accumulation in [1, 2] {
        let mut t = trainer(&config(dir.path(), 4, accumulation, true));
        let batch = only(&uneven_batch(t.model().vocab_size()), |_| false);
        let before = flat_parameters(&t);
        let stats = t.step_on(&batch).unwrap();
        assert_eq!((stats.loss, stats.loss_tokens), (0.0, 0));
        assert_eq!(stats.grad_norm, Some(0.0));
        assert_eq!(flat_parameters(&t), before, "accumulation {accumulation}");
    }
    // AdamW (with weight decay and clipping) stays finite too.
    let mut t = trainer(&config(dir.path(), 4, 2, false));
    let batch = only(&uneven_batch(t.model().vocab_size()), |_| false);
    let stats = t.step_on(&batch).unwrap();
    assert_eq!(stats.loss, 0.0);
    assert!(flat_parameters(&t).iter().all(|v| v.is_finite()));
}

#[test]
fn step_on_refuses_batches_that_do_not_fit_the_step() {
    let dir = tempfile::tempdir().unwrap();
    masked_dir(dir.path());
    let mut t = trainer(&config(dir.path(), 4, 1, true));
    let vocab = t.model().vocab_size();
    let good = uneven_batch(vocab);
    let n = good.x.len();
    let short = Batch::new(good.x[1..].to_vec(), good.y.clone(), None);
    assert!(matches!(
        t.step_on(&short),
        Err(TrainError::BatchLength { field: "tokens", expected, found, .. }) if expected == n && found == n - 1
    ));
    let mut mask = good.mask.clone().unwrap();
    mask.push(true);
    let long_mask = Batch::new(good.x.clone(), good.y.clone(), Some(mask));
    assert!(matches!(
        t.step_on(&long_mask),
        Err(TrainError::BatchLength { field: "mask", .. })
    ));
    let mut y = good.y.clone();
    y[5] = vocab as i32;
    let bad = Batch::new(good.x.clone(), y, None);
    assert!(matches!(
        t.step_on(&bad),
        Err(TrainError::BatchToken {
            field: "targets",
            index: 5,
            ..
        })
    ));
    let mut x = good.x.clone();
    x[0] = -1;
    assert!(matches!(
        t.step_on(&Batch::new(x, good.y.clone(), None)),
        Err(TrainError::BatchToken {
            field: "tokens",
            index: 0,
            value: -1,
            ..
        })
    ));
    assert_eq!(t.steps_done(), 0, "a refused batch runs nothing");
    // Without a mask, a masked step counts every target.
    let all = Batch::new(good.x.clone(), good.y.clone(), None);
    assert_eq!(t.step_on(&all).unwrap().loss_tokens, n as u64);
    // A mask for a step compiled without one is refused.
    let data = TokenDataset::from_text("text", &"abcdefgh".repeat(200));
    let model = ModelSection {
        preset: Some("llama-tiny".into()),
        ..Default::default()
    };
    let train = TrainSection {
        batch: Some(2),
        block: Some(8),
        threads: Some(1),
        ..Default::default()
    };
    let cfg = TrainConfig::resolve(None, &model, &train).unwrap();
    let mut plain = Trainer::new(cfg, data).unwrap();
    assert!(plain.loss_mask().is_none());
    let masked = Batch::new(vec![0; 16], vec![1; 16], Some(vec![true; 16]));
    assert!(matches!(plain.step_on(&masked), Err(TrainError::BatchMask)));
    let stats = plain
        .step_on(&Batch::new(vec![0; 16], vec![1; 16], None))
        .unwrap();
    assert_eq!((stats.step, stats.loss_tokens), (1, 16));
    // The trainer's own batches carry on after a caller's.
    assert_eq!(plain.train_step().unwrap().step, 2);
}

/// Prompts are random digits, which no model can predict better than ln 10 each; completions
/// follow from the prompt. Trained on the completions alone, the reported loss (over them
/// alone) falls far below what any loss counting the prompt's digits could reach.
#[test]
fn a_prompt_completion_run_trains_and_reports_only_the_completions() {
    let dir = tempfile::tempdir().unwrap();
    masked_dir(dir.path());
    let cfg = config(dir.path(), 8, 2, false);
    let mut t = trainer(&cfg);
    let symbols: Vec<u32> = t.data().tokenizer.encode("eo\n").unwrap();
    let mut losses = Vec::new();
    for step in 1..=cfg.steps {
        let stats = t.train_step().unwrap();
        // Any 32 consecutive targets hold four examples' positions: 8 completion targets.
        assert_eq!(stats.loss_tokens, (cfg.batch * BLOCK / 4) as u64);
        if step == 1 {
            // The counted targets are exactly the completions' characters.
            let batch = Batch::compute(t.data(), cfg.seed, 1, cfg.batch, BLOCK);
            let completions = batch
                .y
                .iter()
                .filter(|&&y| symbols.contains(&(y as u32)))
                .count();
            assert_eq!(completions as u64, stats.loss_tokens);
            assert_eq!(batch.counted(), completions);
        }
        losses.push(stats.loss);
    }
    // 5 of every 8 targets are uniform random digits.
    let prompt_floor = 5.0 / 8.0 * 10f32.ln();
    let last: f32 = losses[losses.len() - 5..].iter().sum::<f32>() / 5.0;
    assert!(losses[0] > 2.0, "{losses:?}");
    assert!(
        last < 0.1 * prompt_floor,
        "the completions' loss {last} did not fall well below {prompt_floor}: {losses:?}"
    );
    let eval = t.evaluate().unwrap();
    let eval_targets = (cfg.eval_batches * cfg.batch * BLOCK) as u64;
    assert_eq!(eval.val_loss_tokens, eval_targets / 4);
    assert_eq!(eval.train_loss_tokens, eval_targets / 4);
    assert!(eval.val_loss < 0.2 * prompt_floor, "{eval:?}");
}

/// A mask that counts every target trains exactly as no mask: the same losses, gradients
/// and evaluation, bit for bit, through accumulation and the fused LM-head loss.
#[test]
fn a_mask_counting_everything_trains_as_no_mask_bit_for_bit() {
    let (plain_dir, ones_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let tokenizer = Tokenizer::Char(CharTokenizer::from_text(SYMBOLS));
    for (file, count, seed) in [(TRAIN_FILE, 400, 1), (VAL_FILE, 100, 2)] {
        let ids = tokenizer.encode(&examples(count, seed).0).unwrap();
        TokenFile::write(&plain_dir.path().join(file), &tokenizer, &ids).unwrap();
        let all = vec![true; ids.len()];
        TokenFile::write_masked(&ones_dir.path().join(file), &tokenizer, &ids, &all).unwrap();
    }
    let run = |dir: &std::path::Path| {
        let mut cfg = config(dir, 4, 2, false);
        let (data, _) = cfg.load_data_and_model().unwrap();
        let mut t = Trainer::new(cfg, data).unwrap();
        let losses: Vec<(u32, Option<u32>)> = (0..3)
            .map(|_| {
                let s = t.train_step().unwrap();
                (s.loss.to_bits(), s.grad_norm.map(f32::to_bits))
            })
            .collect();
        let eval = t.evaluate().unwrap();
        let bits: Vec<u32> = flat_parameters(&t).iter().map(|v| v.to_bits()).collect();
        (
            t.loss_mask().is_some(),
            losses,
            eval.val_loss.to_bits(),
            bits,
        )
    };
    let (plain_masked, plain_losses, plain_eval, plain_params) = run(plain_dir.path());
    let (ones_masked, ones_losses, ones_eval, ones_params) = run(ones_dir.path());
    assert!(!plain_masked && ones_masked);
    assert_eq!(plain_losses, ones_losses);
    assert_eq!(plain_eval, ones_eval);
    assert!(plain_params == ones_params, "the parameters differ");
}
