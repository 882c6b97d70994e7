//! LoRA end to end on the CPU: adapter gradients against finite differences, a frozen base
//! that no step touches, the planned peak equal to the measured one and below full
//! fine-tuning's, the loss falling, the PEFT export read back bit for bit, and a resume that
//! would change a lever refused by name.

use snug_compile::{compile_step, StepConfig, StepShape};
use snug_cpu::CpuSession;
use snug_graph::{OptimizerSpec, Role, StepGraph, Target};
use snug_nn::lora::{init_adapters, load_peft_adapter, peft_key, save_peft_adapter};
use snug_nn::{LlamaConfig, LoraConfig, LoraTargets, ModelConfig};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};
use snug_train::{
    DataSource, ModelSection, TokenDataset, TrainConfig, TrainError, TrainSection, Trainer,
};

fn llama() -> ModelConfig {
    let mut c = LlamaConfig::preset("llama-tiny").unwrap();
    c.n_layer = 1;
    c.hidden = 16;
    c.n_head = 2;
    c.n_kv_head = 1;
    c.intermediate = 24;
    c.vocab_size = 40;
    c.max_seq = 8;
    ModelConfig::Llama(c)
}

fn all_linear(rank: usize) -> LoraConfig {
    LoraConfig {
        rank,
        alpha: 3.0,
        targets: LoraTargets::AllLinear,
    }
}

use snug_testkit::hashed_values as values;

/// A session of the step with every parameter written (adapters' B nonzero, so A has a
/// gradient) and a fixed batch fed.
fn session(model: &ModelConfig, step: &StepGraph, batch: usize, seq: usize) -> CpuSession {
    let p = plan(step, &PlanOptions::default()).unwrap();
    let mut s = CpuSession::new(step.graph.clone(), p, Allocator::default(), 1).unwrap();
    let names: Vec<(String, snug_graph::TensorId)> = step
        .params
        .iter()
        .map(|p| (p.name.clone(), p.param))
        .chain(step.frozen.iter().map(|f| (f.name.clone(), f.param)))
        .collect();
    let init: std::collections::HashMap<String, Vec<f32>> =
        model.init_parameters(5).into_iter().collect();
    for (k, (name, t)) in names.iter().enumerate() {
        let n = step.graph.tensor(*t).numel();
        let v = init
            .get(name)
            .cloned()
            // Adapters as large as a trained one's, not more: finite differences stay in the
            // region where the loss is near linear.
            .unwrap_or_else(|| values(n, k as u64 * 7919).iter().map(|v| v * 0.2).collect());
        s.write_f32(*t, &v).unwrap();
    }
    let v = model.vocab_size();
    let ids = |a: usize, b: usize| {
        (0..batch * seq)
            .map(|i| ((i * a + b) % v) as i32)
            .collect::<Vec<_>>()
    };
    s.write_i32(step.inputs[0], &ids(13, 5), v).unwrap();
    s.write_i32(step.inputs[1], &ids(7, 2), v).unwrap();
    s
}

#[test]
fn adapter_gradients_equal_finite_differences_and_the_base_has_none() {
    let model = llama();
    let lora = all_linear(2);
    let (batch, seq) = (2, 8);
    let g = model
        .build_loss_lora(
            batch,
            seq,
            Target::default(),
            snug_graph::DType::F32,
            false,
            Some(&lora),
        )
        .unwrap();
    assert_eq!(g.lora.len(), 7, "every linear layer of the one block");
    let adapters: Vec<String> = g
        .lora
        .iter()
        .flat_map(|l| [l.lora_a.clone(), l.lora_b.clone()])
        .collect();
    let step = StepGraph::build_frozen(
        g.graph,
        g.loss,
        &snug_graph::StepOptions::new(OptimizerSpec::None),
        &|n| !adapters.iter().any(|a| a == n),
    )
    .unwrap();
    let trained: Vec<&str> = step.params.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        trained,
        adapters.iter().map(String::as_str).collect::<Vec<_>>()
    );
    assert!(step
        .frozen
        .iter()
        .any(|f| f.name == "model.layers.0.self_attn.q_proj.weight"));
    // No gradient tensor for a frozen weight anywhere in the step.
    for f in &step.frozen {
        let grad = format!("{}.grad", f.name);
        assert!(
            step.graph.tensors().iter().all(|t| t.name != grad),
            "{grad}"
        );
    }
    let mut s = session(&model, &step, batch, seq);
    s.run(ExecCtx::step(0.0, 1)).unwrap();
    let loss = |s: &mut CpuSession| {
        s.run(ExecCtx::step(0.0, 1)).unwrap();
        s.read_f32(step.loss).unwrap()[0] as f64
    };
    let mut checked = 0;
    for slot in &step.params {
        let grad = s.read_f32(slot.grad).unwrap().to_vec();
        let base = s.read_f32(slot.param).unwrap().to_vec();
        for i in [0, base.len() / 2, base.len() - 1] {
            let h = 4e-3f32;
            let mut v = base.clone();
            v[i] = base[i] + h;
            s.write_f32(slot.param, &v).unwrap();
            let up = loss(&mut s);
            v[i] = base[i] - h;
            s.write_f32(slot.param, &v).unwrap();
            let down = loss(&mut s);
            s.write_f32(slot.param, &base).unwrap();
            let fd = (up - down) / (2.0 * h as f64);
            let g = grad[i] as f64;
            assert!(
                (fd - g).abs() <= 2e-3 + 2e-2 * g.abs(),
                "{}[{i}]: autodiff {g}, finite differences {fd}",
                slot.name
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 3 * 14);
}

#[test]
fn lora_plan_equals_measured_and_is_below_full_fine_tuning() {
    let model = llama();
    let shape = StepShape {
        micro_batch: 2,
        block: 8,
    };
    for accumulation in [1, 2] {
        let full = StepConfig {
            accumulation,
            ..StepConfig::default()
        };
        let lora = StepConfig {
            lora: Some(all_linear(4)),
            ..full.clone()
        };
        let c = compile_step(
            &model,
            shape,
            Target::cpu(1, snug_graph::CpuGemm::host()),
            &lora,
        )
        .unwrap();
        let step = &c.step;
        // Optimizer state and accumulators exist for the adapters alone.
        for t in step.graph.tensors() {
            if matches!(t.role, Role::OptimizerState | Role::GradAccumulator) {
                assert!(t.name.contains(".lora_"), "{} is the base's", t.name);
            }
        }
        let p = plan(step, &PlanOptions::default()).unwrap();
        let alloc = Allocator::default();
        let mut s = CpuSession::new(step.graph.clone(), p.clone(), alloc.clone(), 1).unwrap();
        let mut k = 0;
        for t in (0..step.graph.tensors().len() as u32).map(snug_graph::TensorId) {
            let m = step.graph.tensor(t);
            if m.role.is_persistent() && m.view_of.is_none() {
                s.write_f32(t, &values(m.numel(), k)).unwrap();
                k += 1;
            }
        }
        let ids: Vec<i32> = (0..16).map(|i| i * 3 % 40).collect();
        s.write_i32(c.tokens, &ids, 40).unwrap();
        s.write_i32(c.targets, &ids, 40).unwrap();
        for micro in 0..accumulation as u32 {
            s.run(ExecCtx {
                micro,
                micro_steps: accumulation as u32,
                ..ExecCtx::step(1e-3, 1)
            })
            .unwrap();
        }
        assert_eq!(
            alloc.peak_bytes(),
            p.peak_bytes(),
            "measured peak equals the plan's"
        );
        let full_step = compile_step(
            &model,
            shape,
            Target::cpu(1, snug_graph::CpuGemm::host()),
            &full,
        )
        .unwrap()
        .step;
        let full_peak = plan(&full_step, &PlanOptions::default())
            .unwrap()
            .peak_bytes();
        assert!(
            p.peak_bytes() < full_peak,
            "{} vs {full_peak}",
            p.peak_bytes()
        );
    }
}

fn train_config(
    dir: &std::path::Path,
    steps: u64,
    init_from: Option<&std::path::Path>,
) -> TrainConfig {
    let model = ModelSection {
        preset: Some("llama-tiny".into()),
        ..Default::default()
    };
    let train = TrainSection {
        steps: Some(steps),
        batch: Some(8),
        block: Some(32),
        threads: Some(1),
        warmup_steps: Some(2),
        lr: Some(1e-2),
        lora: Some(4),
        lora_targets: Some("all-linear".into()),
        out: Some(dir.to_path_buf()),
        init_from: init_from.map(|p| p.to_path_buf()),
        ..Default::default()
    };
    TrainConfig::resolve(None, &model, &train).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn lora_run_trains_the_adapters_only_and_exports_a_peft_adapter_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = train_config(dir.path(), 40, None);
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    let mut t = Trainer::new(cfg.clone(), data).unwrap();
    let before = t.parameters().unwrap();
    let mut losses = Vec::new();
    for _ in 0..40 {
        let s = t.train_step().unwrap();
        assert_eq!(s.peak_bytes, t.plan().peak_bytes(), "step {}", s.step);
        losses.push(s.loss);
    }
    let after = t.parameters().unwrap();
    let mut adapters = 0;
    for ((name, a), (name2, b)) in before.iter().zip(&after) {
        assert_eq!(name, name2);
        if name.contains(".lora_") {
            adapters += 1;
            assert_ne!(bits(a), bits(b), "{name} trained");
        } else {
            assert_eq!(
                bits(a),
                bits(b),
                "{name} is frozen: bit-identical after 40 steps"
            );
        }
    }
    assert_eq!(
        adapters,
        2 * 7 * 2,
        "two layers of seven adapted linears, A and B each"
    );
    let head: f32 = losses[..5].iter().sum::<f32>() / 5.0;
    let tail: f32 = losses[35..].iter().sum::<f32>() / 5.0;
    assert!(tail < head - 0.15, "loss fell from {head} to {tail}");

    // The PEFT adapter reads back bit for bit, under PEFT's key names.
    let model = cfg.base_model().unwrap();
    let lora = cfg.lora_config().unwrap();
    let by_name: std::collections::HashMap<String, Vec<f32>> = after.iter().cloned().collect();
    let out = dir.path().join("adapter");
    let w = save_peft_adapter(&out, &model, &lora, None, &|n| by_name.get(n).cloned()).unwrap();
    assert_eq!(w.tensors, adapters);
    let bytes = std::fs::read(&w.weights).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert!(st
        .names()
        .contains(&"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
    assert_eq!(
        peft_key(&model, "model.layers.1.mlp.down_proj.lora_B.weight"),
        "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    );
    let back = load_peft_adapter(&out, &model).unwrap();
    // all-linear is written as the module names it resolves to, PEFT's way.
    assert_eq!((back.lora.rank, back.lora.alpha), (lora.rank, lora.alpha));
    assert_eq!(
        back.lora.layers(&model).unwrap(),
        lora.layers(&model).unwrap()
    );
    assert_eq!(back.tensors.len(), adapters);
    for (name, v) in &back.tensors {
        assert_eq!(bits(v), bits(&by_name[name]), "{name}");
    }
}

#[test]
fn adapters_start_as_peft_initialises_them() {
    let model = llama();
    let layers = all_linear(2).layers(&model).unwrap();
    let init = init_adapters(&layers, 2, 1);
    for (l, pair) in layers.iter().zip(init.chunks(2)) {
        let bound = 1.0 / (l.in_features as f32).sqrt();
        assert_eq!(pair[0].0, l.lora_a);
        assert_eq!(pair[0].1.len(), 2 * l.in_features);
        assert!(pair[0].1.iter().all(|v| v.abs() <= bound));
        assert!(pair[0].1.iter().any(|v| v.abs() > bound / 4.0));
        assert_eq!(pair[1].1, vec![0.0; l.out_features * 2], "B starts at zero");
    }
}

#[test]
fn bad_lora_settings_are_named_errors_before_anything_runs() {
    let resolve = |lora: Option<usize>, targets: Option<&str>, preset: &str| {
        let model = ModelSection {
            preset: Some(preset.into()),
            ..Default::default()
        };
        let train = TrainSection {
            lora,
            lora_targets: targets.map(str::to_string),
            ..Default::default()
        };
        TrainConfig::resolve(None, &model, &train)
            .unwrap_err()
            .to_string()
    };
    let e = resolve(Some(0), None, "llama-tiny");
    assert!(e.contains("lora") && e.contains("at least 1"), "{e}");
    let e = resolve(Some(4), Some("c_attn"), "llama-tiny");
    assert!(e.contains("`c_attn` names no linear layer"), "{e}");
    let e = resolve(Some(4), Some("q_proj"), "tiny");
    assert!(
        e.contains("`q_proj` names no linear layer") && e.contains("c_attn"),
        "{e}"
    );
    let e = resolve(Some(100_000), None, "llama-tiny");
    assert!(e.contains("rank 100000") && e.contains("at most"), "{e}");
    let e = resolve(None, Some("q_proj"), "llama-tiny");
    assert!(e.contains("need a LoRA rank"), "{e}");
    let e = resolve(Some(4), Some("q proj"), "llama-tiny");
    assert!(e.contains("lora_targets"), "{e}");
}

/// A resume never changes what the saved weights compute: flags that would change a lever of
/// the checkpoint's run (LoRA's rank, alpha or layers, how the base is stored, the optimizer,
/// the previous step's norm the state keeps) are refused by the configuration a resume
/// resolves and by the library's resume alike, naming the field and both values, and the
/// checkpoint is left as it was. (They were taken: `--lora-alpha 800` trained on silently
/// with another model, `--quantize-base int8` quantized an NF4 base again, `--double-quant`
/// rounded its block scales anew, a plain LoRA run turned QLoRA; a rank or layers changed, or
/// clipping by the previous norm added, stopped on a tensor missing or misshapen.)
#[test]
fn a_resume_that_would_change_a_lever_is_refused_by_name_and_leaves_the_checkpoint() {
    // The saved runs: QLoRA (rank 4, the default alpha 8 and layers q_proj,v_proj, an NF4
    // base), plain LoRA, and full fine-tuning.
    let qlora = || TrainSection {
        lora: Some(4),
        quantize_base: Some("nf4".into()),
        ..Default::default()
    };
    let lora = || TrainSection {
        lora: Some(4),
        ..Default::default()
    };
    let full = TrainSection::default;
    let with = |mut s: TrainSection, change: &dyn Fn(&mut TrainSection)| {
        change(&mut s);
        s
    };
    let resolve = |s: &TrainSection| {
        let model = ModelSection {
            preset: Some("llama-tiny".into()),
            ..Default::default()
        };
        let s = TrainSection {
            steps: Some(4),
            batch: Some(4),
            block: Some(16),
            threads: Some(1),
            warmup_steps: Some(1),
            ..s.clone()
        };
        TrainConfig::resolve(None, &model, &s).unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let mut saved = Vec::new();
    for (name, section) in [("qlora", qlora()), ("lora", lora()), ("full", full())] {
        let data = TokenDataset::load(&DataSource::Addition).unwrap();
        let mut t = Trainer::new(resolve(&section), data).unwrap();
        t.train_step().unwrap();
        let run = snug_train::checkpoint::CheckpointDir::create(&dir.path().join(name)).unwrap();
        let path = run.save(&t.checkpoint().unwrap(), 1).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        saved.push((name, section, path, bytes));
    }
    type Change = fn(&mut TrainSection);
    let cases: [(&str, Change, &str, [&str; 2]); 11] = [
        (
            "qlora",
            |s| s.lora_alpha = Some(800.0),
            "lora_alpha",
            ["alpha 8 ", "alpha 800"],
        ),
        ("qlora", |s| s.lora = Some(8), "lora", ["rank 4", "rank 8"]),
        (
            "qlora",
            |s| s.lora_targets = Some("all-linear".into()),
            "lora_targets",
            ["q_proj,v_proj", "all-linear"],
        ),
        (
            "qlora",
            |s| s.lora_targets = Some("q_proj".into()),
            "lora_targets",
            ["q_proj,v_proj", "`q_proj`"],
        ),
        (
            "qlora",
            |s| s.quantize_base = Some("int8".into()),
            "quantize_base",
            ["as nf4 ", "int8"],
        ),
        (
            "qlora",
            |s| s.quantize_base = Some("bf16".into()),
            "quantize_base",
            ["as nf4 ", "bf16"],
        ),
        (
            "qlora",
            |s| s.double_quant = Some(true),
            "double_quant",
            ["nf4 with f32 block scales", "double-quantize"],
        ),
        (
            "lora",
            |s| s.quantize_base = Some("nf4".into()),
            "quantize_base",
            ["as f32", "nf4"],
        ),
        (
            "full",
            |s| s.lora = Some(4),
            "lora",
            ["trains every weight", "rank 4"],
        ),
        (
            "qlora",
            |s| s.optimizer = Some("adamw8bit".into()),
            "optimizer",
            ["adamw's", "adamw8bit"],
        ),
        (
            "qlora",
            |s| {
                s.fused_update = Some(true);
                s.clip_mode = Some("previous".into());
            },
            "clip_mode",
            ["global norm", "previous step's gradient norm"],
        ),
    ];
    for (run, change, field, [was, now]) in cases {
        let (_, section, path, _) = saved.iter().find(|s| s.0 == run).unwrap();
        let ckpt = snug_train::checkpoint::Checkpoint::load(path).unwrap();
        let given = with(TrainSection::default(), &change);
        let check = |e: TrainError, how: &str| match e {
            TrainError::Config { field: f, detail } => {
                assert_eq!(f, field, "{run} {how}: {detail}");
                assert!(
                    detail.contains(was) && detail.contains(now),
                    "{run} {how}: `{field}` names both values: {detail}"
                );
            }
            e => panic!("{run} {how}: `{field}` refused as {e:?}"),
        };
        // As `snug train --resume` resolves its flags over the checkpoint's configuration.
        let model = ModelSection::default();
        let resumed = TrainConfig::resolve_resumed(ckpt.config.clone(), None, &model, &given);
        check(resumed.expect_err("refused"), "flags over the checkpoint");
        // As a library caller resumes with a configuration of its own.
        let data = TokenDataset::load(&DataSource::Addition).unwrap();
        let own = resolve(&with(section.clone(), &change));
        let resumed = Trainer::resume(own, data, Allocator::default(), &ckpt);
        check(resumed.err().expect("refused"), "Trainer::resume");
    }
    // The same levers named again, as saved, resume.
    let (_, _, path, _) = &saved[0];
    let ckpt = snug_train::checkpoint::Checkpoint::load(path).unwrap();
    let again = TrainSection {
        lora: Some(4),
        lora_alpha: Some(8.0),
        lora_targets: Some("v_proj,q_proj".into()),
        quantize_base: Some("nf4".into()),
        clip_mode: Some("tensor".into()),
        steps: Some(5),
        ..Default::default()
    };
    let cfg =
        TrainConfig::resolve_resumed(ckpt.config.clone(), None, &ModelSection::default(), &again)
            .unwrap();
    let data = TokenDataset::load(&DataSource::Addition).unwrap();
    let mut t = Trainer::resume(cfg, data, Allocator::default(), &ckpt).unwrap();
    t.train_step().unwrap();
    // Every refusal left each checkpoint as it was, alone in its directory.
    for (name, _, path, bytes) in &saved {
        assert_eq!(&std::fs::read(path).unwrap(), bytes, "{name}");
        let files = std::fs::read_dir(path.parent().unwrap()).unwrap().count();
        assert_eq!(files, 1, "{name}");
    }
}
