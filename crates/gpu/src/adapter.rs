//! The adapters wgpu finds, and what each offers that a planner or a kernel cares about.

use std::sync::OnceLock;

use snug_graph::{MemoryLayout, Target};

use crate::error::{GpuError, Result};

/// The layout a plan for a GPU assumes where this machine has no adapter to ask: the largest
/// storage offset alignment WebGPU lets an adapter require (256 bytes), buffers up to 4 GiB
/// and bindings up to 2 GiB. A plan made with it is valid on any adapter at least that
/// generous; planned where the adapter is present, the adapter's own limits are used.
pub const DEFAULT_LAYOUT: MemoryLayout = MemoryLayout {
    alignment: 256,
    max_buffer_bytes: 1 << 32,
    max_binding_bytes: 1 << 31,
};

/// One adapter: its identity and the limits and features that matter for training.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterInfo {
    /// Position in [`adapters`]' list: `gpu:N` names it.
    pub index: usize,
    pub name: String,
    /// Vulkan, Metal or DX12.
    pub backend: String,
    /// Discrete, integrated, virtual, CPU or other.
    pub device_type: String,
    /// The driver's name and version, where it says.
    pub driver: String,
    /// The largest single buffer: the arena is split into chunks no larger.
    pub max_buffer_size: u64,
    /// The largest range one kernel may bind.
    pub max_storage_buffer_binding_size: u64,
    /// Every bound range starts at a multiple of this.
    pub min_storage_buffer_offset_alignment: u32,
    pub max_storage_buffers_per_shader_stage: u32,
    /// `[x, y, z]`.
    pub max_compute_workgroup_size: [u32; 3],
    pub max_compute_invocations_per_workgroup: u32,
    pub max_compute_workgroup_storage_size: u32,
    pub max_compute_workgroups_per_dimension: u32,
    /// Subgroup sizes the adapter may run (`[min, max]`); meaningful where `subgroup` is set.
    pub subgroup_sizes: [u32; 2],
    /// `SHADER_F16`: f16 arithmetic and storage in shaders.
    pub shader_f16: bool,
    /// `SUBGROUP`: subgroup operations in compute shaders.
    pub subgroup: bool,
    /// Device memory in bytes, where it can be known: a CPU driver (lavapipe) allocates from
    /// the system's memory, so there it is the machine's (`MemTotal`). wgpu reports no heap
    /// sizes, so for every other adapter this is `None` and callers take the user's
    /// `--device-memory`.
    pub memory_bytes: Option<u64>,
}

impl AdapterInfo {
    pub(crate) fn from_adapter(index: usize, adapter: &wgpu::Adapter) -> AdapterInfo {
        let info = adapter.get_info();
        let limits = adapter.limits();
        let features = adapter.features();
        let driver = [info.driver.as_str(), info.driver_info.as_str()]
            .iter()
            .filter(|s| !s.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join(" ");
        AdapterInfo {
            index,
            name: info.name.clone(),
            backend: format!("{:?}", info.backend),
            device_type: match info.device_type {
                wgpu::DeviceType::DiscreteGpu => "discrete GPU",
                wgpu::DeviceType::IntegratedGpu => "integrated GPU",
                wgpu::DeviceType::VirtualGpu => "virtual GPU",
                wgpu::DeviceType::Cpu => "CPU",
                wgpu::DeviceType::Other => "other",
            }
            .to_string(),
            driver,
            max_buffer_size: limits.max_buffer_size,
            max_storage_buffer_binding_size: limits.max_storage_buffer_binding_size,
            min_storage_buffer_offset_alignment: limits.min_storage_buffer_offset_alignment,
            max_storage_buffers_per_shader_stage: limits.max_storage_buffers_per_shader_stage,
            max_compute_workgroup_size: [
                limits.max_compute_workgroup_size_x,
                limits.max_compute_workgroup_size_y,
                limits.max_compute_workgroup_size_z,
            ],
            max_compute_invocations_per_workgroup: limits.max_compute_invocations_per_workgroup,
            max_compute_workgroup_storage_size: limits.max_compute_workgroup_storage_size,
            max_compute_workgroups_per_dimension: limits.max_compute_workgroups_per_dimension,
            subgroup_sizes: [info.subgroup_min_size, info.subgroup_max_size],
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            subgroup: features.contains(wgpu::Features::SUBGROUP),
            memory_bytes: match info.device_type {
                wgpu::DeviceType::Cpu => snug_runtime::process::total_memory().map(|b| b as u64),
                _ => None,
            },
        }
    }

    /// Where [`AdapterInfo::memory_bytes`] comes from, where it is known.
    pub fn memory_source(&self) -> Option<&'static str> {
        self.memory_bytes.map(|_| "system memory (a CPU driver)")
    }

    /// What plans for this adapter assume (as [`crate::GpuDevice::target`] once it is open).
    pub fn layout(&self) -> MemoryLayout {
        let bytes = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        MemoryLayout {
            alignment: (self.min_storage_buffer_offset_alignment as usize).max(1),
            max_buffer_bytes: bytes(self.max_buffer_size),
            max_binding_bytes: bytes(self.max_storage_buffer_binding_size),
        }
    }

    /// `name (backend, type)`, as error messages list adapters.
    pub fn label(&self) -> String {
        format!("{} ({}, {})", self.name, self.backend, self.device_type)
    }

    /// Preference for "the first GPU": real GPUs before virtual ones before CPU drivers.
    fn rank(&self) -> u8 {
        match self.device_type.as_str() {
            "discrete GPU" => 0,
            "integrated GPU" => 1,
            "virtual GPU" => 2,
            "other" => 3,
            _ => 4,
        }
    }
}

/// Whether [`crate::GpuDevice::open`] may use subgroup operations where the adapter has
/// them: yes unless the environment sets `SNUG_GPU_SUBGROUPS` to `0`, `false` or `off`, which
/// forces the plain reductions (a workaround for a driver whose subgroups misbehave, and a way
/// to compare the two paths).
pub fn subgroups_allowed() -> bool {
    std::env::var("SNUG_GPU_SUBGROUPS").map_or(true, |v| {
        !matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "false" | "off"
        )
    })
}

/// Which adapter to open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Selector {
    /// The first adapter in [`adapters`]' list, preferring discrete, then integrated, then
    /// virtual GPUs, then CPU drivers (lavapipe).
    #[default]
    FirstGpu,
    /// `gpu:N`: the adapter at position `N` of [`adapters`]' list.
    Index(usize),
}

impl std::str::FromStr for Selector {
    type Err = String;

    /// `gpu` or `gpu:N`.
    fn from_str(s: &str) -> Result<Selector, String> {
        match s.trim() {
            "gpu" => Ok(Selector::FirstGpu),
            other => other
                .strip_prefix("gpu:")
                .and_then(|n| n.parse().ok())
                .map(Selector::Index)
                .ok_or_else(|| format!("`{s}` is not `gpu` or `gpu:N`")),
        }
    }
}

pub(crate) fn instance() -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env())
}

/// Every adapter wgpu finds, in enumeration order.
pub(crate) fn enumerate(instance: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()))
}

/// The adapters on this machine, in the order `gpu:N` counts them. Empty where no driver is
/// installed.
pub fn adapters() -> Vec<AdapterInfo> {
    enumerate(&instance())
        .iter()
        .enumerate()
        .map(|(i, a)| AdapterInfo::from_adapter(i, a))
        .collect()
}

/// [`adapters`], enumerated once per process: planning asks for the target repeatedly, and
/// enumeration starts every driver.
pub fn adapters_once() -> &'static [AdapterInfo] {
    static FOUND: OnceLock<Vec<AdapterInfo>> = OnceLock::new();
    FOUND.get_or_init(adapters)
}

/// The adapter `selector` names on this machine: `Ok(None)` where it has none, an
/// [`GpuError::AdapterIndex`] listing them where `gpu:N` is past the last.
pub fn find(selector: Selector) -> Result<Option<AdapterInfo>> {
    let found = adapters_once();
    if found.is_empty() {
        return Ok(None);
    }
    let index = match selector {
        Selector::FirstGpu => found.iter().min_by_key(|a| a.rank()).map_or(0, |a| a.index),
        Selector::Index(i) if i < found.len() => i,
        Selector::Index(index) => {
            return Err(GpuError::AdapterIndex {
                index,
                found: found.iter().map(AdapterInfo::label).collect(),
            })
        }
    };
    Ok(found.get(index).cloned())
}

/// The target to plan a step for the adapter `selector` names: its own limits where this
/// machine has it, [`DEFAULT_LAYOUT`] where it has no adapter at all.
pub fn planning_target(selector: Selector) -> Result<Target> {
    let layout = find(selector)?.map_or(DEFAULT_LAYOUT, |a| a.layout());
    Ok(Target::gpu(layout))
}

/// The adapter `selector` names among `found`.
pub(crate) fn select(
    found: Vec<wgpu::Adapter>,
    selector: Selector,
) -> Result<(wgpu::Adapter, AdapterInfo)> {
    let infos: Vec<AdapterInfo> = found
        .iter()
        .enumerate()
        .map(|(i, a)| AdapterInfo::from_adapter(i, a))
        .collect();
    if infos.is_empty() {
        return Err(GpuError::NoAdapter);
    }
    let index = match selector {
        // `min_by_key` keeps the first of equals: enumeration order breaks ties.
        Selector::FirstGpu => infos.iter().min_by_key(|a| a.rank()).map_or(0, |a| a.index),
        Selector::Index(i) if i < infos.len() => i,
        Selector::Index(index) => {
            return Err(GpuError::AdapterIndex {
                index,
                found: infos.iter().map(AdapterInfo::label).collect(),
            })
        }
    };
    let info = infos[index].clone();
    let adapter = found.into_iter().nth(index).ok_or(GpuError::NoAdapter)?;
    Ok((adapter, info))
}

#[cfg(test)]
mod tests {
    use super::Selector;

    #[test]
    fn selectors_parse_from_the_device_flag() {
        assert_eq!("gpu".parse(), Ok(Selector::FirstGpu));
        assert_eq!("gpu:3".parse(), Ok(Selector::Index(3)));
        assert!("gpu:x".parse::<Selector>().is_err());
        assert!("cpu".parse::<Selector>().is_err());
    }
}
