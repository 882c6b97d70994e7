//! Sampling with a key/value cache on the Hugging Face fixtures (GPT-2, Llama untied and tied,
//! Llama 3 rope scaling, Mistral, Qwen2 with q/k/v biases, bf16 and sharded files): greedy
//! tokens equal the whole window's, token for token, and each phase holds exactly its plan.

use std::path::{Path, PathBuf};

use snug_nn::HfCheckpoint;
use snug_runtime::Allocator;
use snug_train::{SampleMode, SampleOptions, Sampler};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../nn/tests/fixtures/hf")
        .join(name)
}

const FIXTURES: [&str; 8] = [
    "gpt2",
    "llama",
    "llama3_rope_scaling",
    "llama_tied",
    "mistral",
    "qwen2",
    "llama_bf16",
    "llama_sharded",
];

#[test]
fn hf_fixtures_sample_the_same_tokens_with_and_without_the_cache() {
    let greedy = SampleOptions {
        temperature: 0.0,
        top_k: None,
        seed: 0,
    };
    for name in FIXTURES {
        let ckpt = HfCheckpoint::open(&fixture(name)).unwrap();
        let model = ckpt.config().clone();
        let load = |mode| Sampler::from_hf(&model, &ckpt, mode, 1, Allocator::default());
        let mut kv = load(SampleMode::KvCache).unwrap();
        let mut full = load(SampleMode::FullWindow).unwrap();
        // Up to a short window's end; a long window's first 96 positions.
        let prompt = [17u32, 42, 99, 5, 230, 7];
        let n = kv.window().min(96) - prompt.len();
        let a = kv.generate(&prompt, n, greedy).unwrap();
        let b = full.generate(&prompt, n, greedy).unwrap();
        assert_eq!(a, b, "{name}");
        let stats = kv.kv_stats().unwrap();
        assert_eq!(
            (stats.prefill.runs, stats.decode.runs),
            (1, n - 1),
            "{name}"
        );
        for phase in [stats.prefill, stats.decode] {
            assert_eq!(
                phase.planned_peak_bytes, phase.measured_peak_bytes,
                "{name}"
            );
        }
        // A sampled (not greedy) run agrees too: the same logits, the same draws.
        let warm = SampleOptions {
            temperature: 0.9,
            top_k: Some(20),
            seed: 3,
        };
        assert_eq!(
            kv.generate(&prompt, 24, warm).unwrap(),
            full.generate(&prompt, 24, warm).unwrap(),
            "{name}"
        );
    }
}
