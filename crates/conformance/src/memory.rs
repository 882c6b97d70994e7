//! Planned == measured: the backend's allocator, while a session of a whole training step is
//! made and runs, peaks at exactly the plan's `persistent_bytes + arena_bytes` (each buffer is
//! its planned size, which the plan has already rounded to the alignment), and the step itself
//! allocates nothing.

use snug_compile::{compile_exactly, Remat, StepConfig, StepShape};
use snug_graph::DType;
use snug_nn::{GptConfig, LlamaConfig, ModelConfig};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Backend, ExecCtx, Session};

use crate::{runnable, Harness};

pub(crate) fn tiny_gpt() -> ModelConfig {
    ModelConfig::Gpt(GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        block_size: 8,
        vocab_size: 11,
    })
}

pub(crate) fn tiny_llama() -> ModelConfig {
    ModelConfig::Llama(LlamaConfig {
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        hidden: 16,
        intermediate: 24,
        vocab_size: 11,
        max_seq: 8,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        ..LlamaConfig::preset("llama-tiny").expect("a built-in preset")
    })
}

pub fn gpt_step_measured_peak_equals_planned_peak<H: Harness>(harness: &H) {
    measured_peak_equals_planned_peak(harness, &tiny_gpt());
}

pub fn llama_step_measured_peak_equals_planned_peak<H: Harness>(harness: &H) {
    measured_peak_equals_planned_peak(harness, &tiny_llama());
}

/// AdamW steps (the default passes: fused LM head, in place) in f32 and bf16, plain, with a
/// checkpoint per block and with selective recomputation.
fn measured_peak_equals_planned_peak<H: Harness>(harness: &H, model: &ModelConfig) {
    let shape = StepShape {
        micro_batch: 2,
        block: 8,
    };
    let threads = 2;
    let vocab = model.vocab_size();
    let values = model.init_parameters(3);
    for precision in [DType::F32, DType::BF16] {
        for remat in [Remat::None, Remat::Blocks { blocks: 1 }, Remat::Selective] {
            let label = format!("{} {precision} remat {remat}", harness.name());
            let config = StepConfig {
                precision,
                remat,
                ..StepConfig::default()
            };
            let compiled = compile_exactly(model, shape, harness.target(threads), &config)
                .unwrap_or_else(|e| panic!("{label}: {e}"));
            let step = compiled.step;
            if !runnable(harness, &step.graph) {
                continue;
            }
            let memory = plan(&step.graph, &PlanOptions::default()).expect("the step plans");
            let (persistent, peak) = (memory.persistent_bytes, memory.peak_bytes());

            let backend = harness.backend(threads);
            let allocator = backend.allocator().clone();
            // A fresh backend's allocator holds nothing; count from here whatever it holds.
            let before = allocator.active_bytes();
            allocator.reset_peak();
            let mut s = Session::new(step.graph.clone(), memory, backend)
                .unwrap_or_else(|e| panic!("{label}: {e}"));
            for slot in &step.params {
                let (_, v) = values
                    .iter()
                    .find(|(name, _)| *name == slot.name)
                    .unwrap_or_else(|| panic!("{label}: no initial value for {}", slot.name));
                s.write_f32(slot.param, v).unwrap();
            }
            let tokens = shape.micro_batch * shape.block;
            let ids = |a: usize, b: usize| -> Vec<i32> {
                (0..tokens).map(|i| ((i * a + b) % vocab) as i32).collect()
            };
            s.write_i32(compiled.tokens, &ids(7, 3), vocab).unwrap();
            s.write_i32(compiled.targets, &ids(5, 1), vocab).unwrap();
            s.run(ExecCtx::step(1e-3, 1)).unwrap();
            let loss = s.read_f32(step.loss).unwrap()[0];
            assert!(loss.is_finite(), "{label}: loss {loss}");
            let allocations = allocator.allocation_count();
            s.write_i32(compiled.tokens, &ids(3, 2), vocab).unwrap();
            s.write_i32(compiled.targets, &ids(7, 5), vocab).unwrap();
            s.run(ExecCtx::step(1e-3, 2)).unwrap();

            assert_eq!(
                allocator.peak_bytes() - before,
                peak,
                "{label}: measured peak against the plan's"
            );
            assert_eq!(
                allocator.active_bytes() - before,
                peak,
                "{label}: held with the arena"
            );
            assert_eq!(
                allocator.allocation_count(),
                allocations,
                "{label}: a step allocated"
            );
            s.release_arena().unwrap();
            assert_eq!(
                allocator.active_bytes() - before,
                persistent,
                "{label}: held between steps"
            );
        }
    }
}
