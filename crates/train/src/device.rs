//! Where a run's step runs: this machine's CPU, or a GPU through `snug-gpu` (the `device`
//! key: `cpu`, `gpu` for the first GPU, `gpu:N` for the adapter `snug devices` lists at N).
//! [`StepSession`] is the runtime's session over either backend; the trainer is written once
//! against it.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use snug_cpu::CpuSession;
use snug_gpu::{GpuBackend, GpuSession, Selector};
use snug_graph::{Graph, Target, TensorId};
use snug_plan::MemoryPlan;
use snug_runtime::{Allocator, Backend, ExecCtx, RuntimeError, Session};

use crate::TrainError;

/// The device a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    Gpu(Selector),
}

impl DeviceSpec {
    pub fn is_gpu(&self) -> bool {
        matches!(self, DeviceSpec::Gpu(_))
    }

    /// The target a step for this device is compiled and planned for: the CPU with `threads`,
    /// or the named adapter's limits (see [`snug_gpu::planning_target`]: a documented default
    /// where this machine has no adapter). A `gpu:N` past this machine's adapters is an error
    /// listing them.
    pub fn target(&self, threads: usize) -> Result<Target, TrainError> {
        match self {
            DeviceSpec::Cpu => Ok(Target::host(threads)),
            DeviceSpec::Gpu(sel) => {
                snug_gpu::planning_target(*sel).map_err(|e| TrainError::Config {
                    field: "device",
                    detail: e.to_string(),
                })
            }
        }
    }

    /// What fit must check of each candidate for this device: the GPU backend's kernels
    /// (None on the CPU, which runs every op).
    pub fn runnable(&self) -> Option<snug_fit::Runnable> {
        match self {
            DeviceSpec::Cpu => None,
            DeviceSpec::Gpu(_) => Some(runs_on_gpu),
        }
    }
}

/// Why the GPU backend cannot run `graph`, naming the op, or `Ok`.
fn runs_on_gpu(graph: &snug_graph::Graph) -> Result<(), String> {
    snug_gpu::check_graph(graph).map_err(|(op, detail)| format!("cannot run `{op}`: {detail}"))
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<DeviceSpec, String> {
        match s.trim() {
            "cpu" => Ok(DeviceSpec::Cpu),
            other => other
                .parse::<Selector>()
                .map(DeviceSpec::Gpu)
                .map_err(|_| format!("`{s}` is not one of cpu, gpu, gpu:N")),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Gpu(Selector::FirstGpu) => f.write_str("gpu"),
            DeviceSpec::Gpu(Selector::Index(i)) => write!(f, "gpu:{i}"),
        }
    }
}

// Saved in a checkpoint's configuration as the flag spells it.
impl Serialize for DeviceSpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<DeviceSpec, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A planned step loaded on its device.
pub enum StepSession {
    Cpu(CpuSession),
    Gpu(GpuSession),
}

/// Runs `$body` with `$s` bound to the session of either backend.
macro_rules! each {
    ($self:expr, $s:ident => $body:expr) => {
        match $self {
            StepSession::Cpu($s) => $body,
            StepSession::Gpu($s) => $body,
        }
    };
}

impl StepSession {
    /// Loads `graph` and `plan` on `device`. On the CPU every byte comes from `allocator`; a
    /// GPU has an allocator of its own over device memory, which takes `allocator`'s memory
    /// limit.
    pub fn new(
        device: DeviceSpec,
        graph: Graph,
        plan: MemoryPlan,
        allocator: Allocator,
        threads: usize,
    ) -> Result<StepSession, TrainError> {
        match device {
            DeviceSpec::Cpu => Ok(StepSession::Cpu(CpuSession::new(
                graph, plan, allocator, threads,
            )?)),
            DeviceSpec::Gpu(sel) => {
                let backend = GpuBackend::open(sel)?;
                let (limit, relaxed) = allocator.memory_limit();
                if limit != usize::MAX {
                    backend.allocator().set_memory_limit(limit, relaxed);
                }
                Ok(StepSession::Gpu(Session::new(graph, plan, backend)?))
            }
        }
    }

    /// The target plans for this session's device assume (the device's own limits).
    pub fn target(&self) -> Target {
        match self {
            StepSession::Cpu(s) => s.backend().target(),
            StepSession::Gpu(s) => s.backend().target(),
        }
    }

    /// The device's name as errors and reports give it: `cpu`, or the adapter's label.
    pub fn device_name(&self) -> String {
        match self {
            StepSession::Cpu(_) => "cpu".into(),
            StepSession::Gpu(s) => s.backend().gpu().info().label(),
        }
    }

    /// The most bytes of device buffers out at once, as the device counts them (its
    /// allocator's cache included); the allocator's own peak on the CPU.
    pub fn device_peak_bytes(&self) -> usize {
        match self {
            StepSession::Cpu(s) => s.allocator().peak_bytes(),
            StepSession::Gpu(s) => {
                usize::try_from(s.backend().memory().device_peak_bytes()).unwrap_or(usize::MAX)
            }
        }
    }

    pub fn allocator(&self) -> &Allocator {
        each!(self, s => s.allocator())
    }

    /// The opened GPU, where the session runs on one.
    pub fn gpu(&self) -> Option<&snug_gpu::GpuDevice> {
        match self {
            StepSession::Cpu(_) => None,
            StepSession::Gpu(s) => Some(s.backend().gpu()),
        }
    }

    /// What the GPU's own allocator reports (wgpu's `generate_allocator_report`): `None` on
    /// the CPU and where the GPU's backend gives no report.
    pub fn allocator_report(&self) -> Option<snug_gpu::AllocatorReport> {
        self.gpu().and_then(snug_gpu::allocator_report)
    }

    /// Host-visible bytes of the GPU's input staging ring (`None` on the CPU, which writes
    /// inputs in place): outside the device peak the plan predicts.
    pub fn staging_bytes(&self) -> Option<u64> {
        match self {
            StepSession::Cpu(_) => None,
            StepSession::Gpu(s) => Some(s.backend().staging_bytes()),
        }
    }

    pub fn graph(&self) -> &Graph {
        each!(self, s => s.graph())
    }

    pub fn plan(&self) -> &MemoryPlan {
        each!(self, s => s.plan())
    }

    pub fn nodes_for(&self, targets: &[TensorId]) -> Vec<bool> {
        each!(self, s => s.nodes_for(targets))
    }

    pub fn replan(&mut self, graph: Graph, plan: MemoryPlan) -> Result<(), RuntimeError> {
        each!(self, s => s.replan(graph, plan))
    }

    pub fn release_arena(&mut self) -> Result<(), RuntimeError> {
        each!(self, s => s.release_arena())
    }

    /// Takes the arena (if released) and binds the nodes to it, as a run would first.
    pub fn acquire_arena(&mut self) -> Result<(), RuntimeError> {
        each!(self, s => s.acquire_arena())
    }

    /// The arena chunks the nodes were last bound to (see `Session::bound_arena`).
    pub fn bound_arena(&self) -> Vec<usize> {
        each!(self, s => s.bound_arena().to_vec())
    }

    /// Whether inputs written now are staged for the next launch while the last one may still
    /// run (a GPU): the trainer then writes the next micro-batch before reading this one's loss.
    pub fn stages_inputs(&self) -> bool {
        matches!(self, StepSession::Gpu(_))
    }

    /// Drops inputs staged for the next launch and not yet copied to the device.
    pub fn discard_staged_inputs(&self) {
        each!(self, s => s.discard_staged_inputs())
    }

    /// Inputs the GPU staged while the launch before had not been waited for: uploads that
    /// overlapped a running step (`None` on the CPU).
    pub fn inputs_staged_while_running(&self) -> Option<usize> {
        match self {
            StepSession::Cpu(_) => None,
            StepSession::Gpu(s) => Some(s.backend().inputs_staged_while_running()),
        }
    }

    pub fn run(&mut self, ctx: ExecCtx) -> Result<(), RuntimeError> {
        each!(self, s => s.run(ctx))
    }

    pub fn run_only(&mut self, ctx: ExecCtx, mask: &[bool]) -> Result<(), RuntimeError> {
        each!(self, s => s.run_only(ctx, mask))
    }

    pub fn run_profiled(&mut self, ctx: ExecCtx) -> Result<Vec<f64>, RuntimeError> {
        each!(self, s => s.run_profiled(ctx))
    }

    pub fn write_f32(&mut self, id: TensorId, data: &[f32]) -> Result<(), RuntimeError> {
        each!(self, s => s.write_f32(id, data))
    }

    pub fn write_i32(
        &mut self,
        id: TensorId,
        data: &[i32],
        bound: usize,
    ) -> Result<(), RuntimeError> {
        each!(self, s => s.write_i32(id, data, bound))
    }

    pub fn fill_i32(
        &mut self,
        id: TensorId,
        bound: usize,
        fill: impl FnOnce(&mut [i32]),
    ) -> Result<(), RuntimeError> {
        each!(self, s => s.fill_i32(id, bound, fill))
    }

    pub fn read_f32(&self, id: TensorId) -> Result<Cow<'_, [f32]>, RuntimeError> {
        each!(self, s => s.read_f32(id))
    }

    /// 8-bit optimizer state.
    pub fn write_u8(&mut self, id: TensorId, data: &[u8]) -> Result<(), RuntimeError> {
        each!(self, s => s.write_u8(id, data))
    }

    /// 8-bit optimizer state.
    pub fn read_u8(&self, id: TensorId) -> Result<Cow<'_, [u8]>, RuntimeError> {
        each!(self, s => s.read_u8(id))
    }

    pub fn write_bytes(&mut self, id: TensorId, data: &[u8]) -> Result<(), RuntimeError> {
        each!(self, s => s.write_bytes(id, data))
    }

    pub fn read_bytes(&self, id: TensorId) -> Result<Vec<u8>, RuntimeError> {
        each!(self, s => s.read_bytes(id))
    }

    #[cfg(feature = "test-hooks")]
    pub fn fill_arena(&mut self, byte: u8) -> Result<(), RuntimeError> {
        each!(self, s => s.fill_arena(byte))
    }
}
