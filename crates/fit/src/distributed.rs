//! Many devices: [`suggest_config`] picks the ZeRO stage, micro-batch, rematerialization and
//! precision one rank of a data-parallel run needs to fit each device's memory, from plans
//! alone (nothing allocated, nothing timed).

use serde::Serialize;
use snug_compile::{compile_sharded, Remat, StepConfig, StepShape};
use snug_graph::{CommVolume, DType, Sharding, Target};
use snug_nn::{LlamaConfig, ModelConfig};

use crate::levers::{ladder, LeverCost, Levers};
use crate::FitError;

/// The configuration [`suggest_config`] chose for each rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceConfig {
    pub devices: usize,
    /// ZeRO stage, 0 to 3.
    pub shard: u8,
    /// Sequences per rank per forward pass.
    pub micro_batch: usize,
    pub block: usize,
    #[serde(serialize_with = "display")]
    pub remat: Remat,
    pub precision: DType,
    /// Planned peak of one rank.
    pub per_device_peak_bytes: usize,
    /// What one rank sends and receives per step.
    pub comm: CommVolume,
    /// The levers it needs (none unless nothing fits without them), and what each costs.
    pub levers: Levers,
    pub lever_costs: Vec<LeverCost>,
}

fn display<S: serde::Serializer, T: std::fmt::Display>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// Largest micro-batch tried when growing the batch of a configuration that fits.
const MAX_MICRO_BATCH: usize = 64;

/// The first configuration, in order of least communication and least change to the math,
/// whose planned per-rank peak fits `memory_per_device`: ZeRO stage 0 to 3 (each stage adds
/// communication), then within a stage f32 before bf16 and no remat before per-block remat;
/// its micro-batch is then the largest power of two (up to 64) that still fits. Where nothing
/// does, the same again with each rung of the levers `allowed` permits, cheapest first
/// ([`crate::levers::ladder`]). Sequences are the model's context or 1,024 tokens, whichever
/// is shorter; AdamW as [`StepConfig`]'s default.
pub fn suggest_config(
    model: &ModelConfig,
    devices: usize,
    memory_per_device: usize,
    allowed: &Levers,
) -> Result<DeviceConfig, FitError> {
    let mut smallest = usize::MAX;
    for levers in std::iter::once(Levers::none()).chain(ladder(allowed)) {
        let step = levers.apply(&StepConfig::default());
        let stages: Vec<u8> = (0..=3)
            .filter(|&s| levers.runs_sharded(devices, s))
            .collect();
        let found = first_fitting(
            model,
            devices,
            memory_per_device,
            &step,
            &stages,
            &mut smallest,
        )?;
        if let Some(c) = found {
            return Ok(DeviceConfig {
                lever_costs: levers.costs(),
                levers,
                ..c
            });
        }
    }
    Err(FitError::NothingFitsDevices {
        devices,
        budget: memory_per_device,
        smallest,
    })
}

/// [`suggest_config`]'s search for one step configuration; `smallest` keeps the lowest peak
/// seen.
fn first_fitting(
    model: &ModelConfig,
    devices: usize,
    memory_per_device: usize,
    base: &StepConfig,
    stages: &[u8],
    smallest: &mut usize,
) -> Result<Option<DeviceConfig>, FitError> {
    let block = model.max_seq().min(1024);
    let target = Target::cpu(1, snug_graph::CpuGemm::Portable);
    let peak = |stage: u8, micro_batch: usize, remat: Remat, precision: DType| {
        let sharding = Sharding::new(devices, stage).map_err(snug_compile::CompileError::from)?;
        let step = StepConfig {
            remat,
            precision,
            ..base.clone()
        };
        let shape = StepShape { micro_batch, block };
        let mut c = compile_sharded(model, shape, target, &step, &sharding)?;
        // A remat mode was planned while compiling (to drop it where it saves nothing).
        let p = c.take_plan().map_err(snug_compile::CompileError::from)?;
        Ok::<_, FitError>((
            p.peak_bytes(),
            snug_graph::zero::comm_per_rank(&c.step.graph, 1),
        ))
    };
    for &stage in stages {
        for remat in [Remat::None, Remat::Blocks { blocks: 1 }] {
            for precision in [DType::F32, DType::BF16] {
                let (mut bytes, mut comm) = peak(stage, 1, remat, precision)?;
                *smallest = (*smallest).min(bytes);
                if bytes > memory_per_device {
                    continue;
                }
                let mut micro_batch = 1;
                while micro_batch < MAX_MICRO_BATCH {
                    let (b, c) = peak(stage, micro_batch * 2, remat, precision)?;
                    if b > memory_per_device {
                        break;
                    }
                    (micro_batch, bytes, comm) = (micro_batch * 2, b, c);
                }
                return Ok(Some(DeviceConfig {
                    devices,
                    shard: stage,
                    micro_batch,
                    block,
                    remat,
                    precision,
                    per_device_peak_bytes: bytes,
                    comm,
                    levers: Levers::none(),
                    lever_costs: Vec::new(),
                }));
            }
        }
    }
    Ok(None)
}

/// A Llama-shaped model of about `parameters` parameters: Llama-2's proportions (heads of 128,
/// width 128 per layer, a SwiGLU MLP 8/3 as wide rounded up to 256, a 32,000-token
/// vocabulary), with the layer count whose parameter count is nearest.
pub fn llama_of_size(parameters: usize) -> Result<ModelConfig, FitError> {
    let base = LlamaConfig::preset("llama-7b").ok_or(FitError::NoLlamaShape { parameters })?;
    if parameters == 0 {
        return Err(FitError::NoLlamaShape { parameters });
    }
    let shaped = |n_layer: usize| {
        let hidden = 128 * n_layer;
        LlamaConfig {
            n_layer,
            n_head: n_layer,
            n_kv_head: n_layer,
            hidden,
            intermediate: (8 * hidden / 3).div_ceil(256) * 256,
            ..base.clone()
        }
    };
    let best = (1..=256)
        .map(shaped)
        .min_by_key(|c| c.parameter_count().abs_diff(parameters))
        .ok_or(FitError::NoLlamaShape { parameters })?;
    Ok(ModelConfig::Llama(best))
}
