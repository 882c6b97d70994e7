//! Out-of-memory recovery: a strict limit lowered mid-run makes the next step fail to take its
//! arena; the trainer switches to a configuration that fits and redoes the step. No step is
//! lost, the effective batch stays, and the losses equal those of a run that used the recovery
//! configuration from that step on.

use snug_fit::MachineProfile;
use snug_runtime::{Allocator, Device};
use snug_train::{
    DataSource, ModelSection, TokenDataset, TrainConfig, TrainError, TrainSection, Trainer,
};

fn config(accumulation: usize) -> TrainConfig {
    let model = ModelSection {
        preset: Some("tiny".into()),
        ..Default::default()
    };
    let train = TrainSection {
        steps: Some(8),
        batch: Some(8),
        block: Some(32),
        threads: Some(1),
        warmup_steps: Some(2),
        accumulation: Some(accumulation),
        ..Default::default()
    };
    TrainConfig::resolve(None, &model, &train).unwrap()
}

fn trainer(cfg: &TrainConfig, allocator: &Allocator) -> Trainer {
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    let mut t = Trainer::with_allocator(cfg.clone(), data, allocator.clone()).unwrap();
    // Recovery choices must not depend on the machine the test runs on.
    t.set_machine_profile(MachineProfile::nominal(1));
    t
}

fn parameters(t: &Trainer) -> Vec<(String, Vec<u32>)> {
    t.parameters()
        .unwrap()
        .into_iter()
        .map(|(n, v)| (n, v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

#[test]
fn out_of_memory_mid_run_redoes_the_step_with_a_smaller_plan() {
    let cfg = config(1);
    let allocator = Allocator::new(Device::Cpu);
    let mut a = trainer(&cfg, &allocator);
    let mut losses_a: Vec<u32> = Vec::new();
    for _ in 0..3 {
        losses_a.push(a.train_step().unwrap().loss.to_bits());
    }
    let full_peak = a.plan().peak_bytes();
    // 95% of the plan: the arena no longer fits beside the parameters and optimizer state.
    // (The tiny model's norms and GELU are fused into its GEMMs, so little is left for
    // checkpointing to drop: every block checkpointed reaches about 94%.)
    let limit = full_peak * 95 / 100;
    allocator.set_memory_limit(limit, false);
    allocator.reset_peak();
    let mut steps = Vec::new();
    for _ in 3..8 {
        let s = a.train_step().unwrap();
        steps.push(s.step);
        losses_a.push(s.loss.to_bits());
    }
    // No step lost or repeated.
    assert_eq!(steps, vec![4, 5, 6, 7, 8]);
    let recoveries = a.take_recoveries();
    assert_eq!(recoveries.len(), 1, "{recoveries:?}");
    let r = &recoveries[0];
    assert_eq!((r.step, r.micro), (4, 0));
    assert_eq!(r.failure.limit, limit);
    assert!(r.to_peak_bytes <= limit && r.from_peak_bytes == full_peak);
    // Same effective batch; a different configuration (here the micro-batches cannot be split
    // further without gradient accumulators that cost more than they save, so remat it is).
    assert_eq!(r.to.micro_batch * r.to.accumulation, cfg.batch);
    assert_ne!(r.to, r.from);
    assert_eq!(a.config().accumulation, r.to.accumulation);
    // The new plan is what ran, and the limit held.
    assert_eq!(a.plan().peak_bytes(), r.to_peak_bytes);
    assert!(allocator.peak_bytes() <= limit);

    // The same run, switched to the recovery configuration by hand at step 3 (through a
    // checkpoint into a fresh trainer): the same losses and weights, bit for bit.
    let b_alloc = Allocator::new(Device::Cpu);
    let mut b = trainer(&cfg, &b_alloc);
    let mut losses_b: Vec<u32> = Vec::new();
    for _ in 0..3 {
        losses_b.push(b.train_step().unwrap().loss.to_bits());
    }
    let ckpt = b.checkpoint().unwrap();
    let mut recovered_cfg = cfg.clone();
    recovered_cfg.apply_fit(&r.to);
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    let mut c = Trainer::resume(recovered_cfg, data, Allocator::new(Device::Cpu), &ckpt).unwrap();
    for _ in 3..8 {
        losses_b.push(c.train_step().unwrap().loss.to_bits());
    }
    assert_eq!(losses_a, losses_b);
    assert_eq!(parameters(&a), parameters(&c));
}

/// With accumulation already on, recovery splits further; `reconfigure` on a live trainer is
/// the same as a fresh trainer restored from a checkpoint.
#[test]
fn reconfigure_keeps_the_state_and_matches_a_fresh_trainer() {
    let cfg = config(2);
    let mut a = trainer(&cfg, &Allocator::new(Device::Cpu));
    let mut b = trainer(&cfg, &Allocator::new(Device::Cpu));
    for _ in 0..2 {
        assert_eq!(
            a.train_step().unwrap().loss.to_bits(),
            b.train_step().unwrap().loss.to_bits()
        );
    }
    let mut smaller = cfg.clone();
    smaller.accumulation = 4;
    smaller.remat = snug_train::Remat::Blocks { blocks: 1 };
    a.reconfigure(smaller.clone()).unwrap();
    assert!(a.plan().peak_bytes() < b.plan().peak_bytes());
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    let mut c = Trainer::resume(
        smaller,
        data,
        Allocator::new(Device::Cpu),
        &b.checkpoint().unwrap(),
    )
    .unwrap();
    for _ in 0..3 {
        assert_eq!(
            a.train_step().unwrap().loss.to_bits(),
            c.train_step().unwrap().loss.to_bits()
        );
    }
    assert_eq!(parameters(&a), parameters(&c));
    // The batch is the run's: reconfiguring to another is refused.
    let mut other = cfg.clone();
    other.batch = 4;
    assert!(matches!(
        a.reconfigure(other),
        Err(TrainError::Config { field: "batch", .. })
    ));
}

#[test]
fn when_nothing_fits_the_error_says_so_and_the_state_is_untouched() {
    let cfg = config(1);
    let allocator = Allocator::new(Device::Cpu);
    let mut t = trainer(&cfg, &allocator);
    t.train_step().unwrap();
    let before = parameters(&t);
    // Below the parameters and optimizer state alone: no configuration can fit.
    allocator.set_memory_limit(1 << 20, false);
    match t.train_step() {
        Err(TrainError::Unrecoverable { step, detail, .. }) => {
            assert_eq!(step, 2);
            assert!(detail.contains("smallest"), "{detail}");
        }
        other => panic!("expected Unrecoverable, got {other:?}"),
    }
    assert_eq!(t.steps_done(), 1);
    assert_eq!(parameters(&t), before);
    // Memory back: the run continues from where it was, on step 2's own batch.
    allocator.set_memory_limit(usize::MAX, true);
    let retried = t.train_step().unwrap();
    assert_eq!(retried.step, 2);
    let mut reference = trainer(&cfg, &Allocator::new(Device::Cpu));
    reference.train_step().unwrap();
    assert_eq!(
        retried.loss.to_bits(),
        reference.train_step().unwrap().loss.to_bits()
    );
    assert_eq!(parameters(&t), parameters(&reference));
}

/// The arena is re-taken from the cache every micro-batch without zeroing: that is sound only
/// if no kernel reads arena bytes it did not write first. Filling the arena with NaN bytes
/// before a step changes nothing.
#[test]
fn no_kernel_reads_arena_bytes_it_did_not_write() {
    for accumulation in [1, 2] {
        let cfg = config(accumulation);
        let mut clean = trainer(&cfg, &Allocator::new(Device::Cpu));
        let mut poisoned = trainer(&cfg, &Allocator::new(Device::Cpu));
        for _ in 0..3 {
            poisoned.poison_arena_for_test(0xFF).unwrap();
            assert_eq!(
                clean.train_step().unwrap().loss.to_bits(),
                poisoned.train_step().unwrap().loss.to_bits()
            );
        }
        assert_eq!(parameters(&clean), parameters(&poisoned));
    }
}

/// An evaluation covers the same windows however the step runs: the batch's windows, in
/// micro-batches of eight, four or two sequences, and after running out of memory during the
/// evaluation itself (the trainer switches to micro-batches of two and evaluates again).
#[test]
fn an_evaluation_covers_the_same_windows_however_the_step_runs() {
    let evaluate = |accumulation: usize, limit: Option<f64>| {
        let mut cfg = config(accumulation);
        cfg.block = 64;
        let allocator = Allocator::new(Device::Cpu);
        let mut t = trainer(&cfg, &allocator);
        if let Some(share) = limit {
            allocator.set_memory_limit((t.plan().peak_bytes() as f64 * share) as usize, false);
        }
        let e = t.evaluate().unwrap();
        (e, t.take_recoveries().len(), t.config().micro_batch())
    };
    let (whole, none, mb) = evaluate(1, None);
    assert_eq!((none, mb), (0, 8));
    let tokens = (config(1).eval_batches * 8 * 64) as u64;
    assert_eq!(
        (whole.train_loss_tokens, whole.val_loss_tokens),
        (tokens, tokens)
    );
    for (accumulation, limit) in [(2, None), (4, None), (1, Some(0.8))] {
        let (e, recoveries, mb) = evaluate(accumulation, limit);
        assert_eq!(recoveries, usize::from(limit.is_some()));
        assert!(mb < 8, "micro-batch {mb}");
        assert_eq!((e.train_loss_tokens, e.val_loss_tokens), (tokens, tokens));
        // The same windows, summed in other groupings: within f32 rounding of the whole.
        for (a, b) in [
            (e.train_loss, whole.train_loss),
            (e.val_loss, whole.val_loss),
        ] {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{a} against {b} ({accumulation}, {limit:?})"
            );
        }
    }
}
