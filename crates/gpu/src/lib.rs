//! snug's GPU backend on wgpu (Vulkan, Metal, DX12): everything that runs a planned step on a
//! GPU.
//!
//! - [`adapter`]: the adapters wgpu finds ([`adapters`]) and what each offers ([`AdapterInfo`]).
//! - [`device`]: an opened adapter ([`GpuDevice::open`]), its pipelines, submission and errors.
//! - [`memory`]: device buffers from a counting [`MemorySource`], the arena as chunks
//!   ([`Arena`]), and tensors bound as (chunk, offset, length) ([`Slot`] → [`DeviceSlice`]).
//! - [`transfer`]: uploads through staging buffers and downloads that map and wait.
//! - [`kernels`]: one WGSL kernel and its launcher per op, named as the op's file in
//!   `snug-graph`. Launchers record into a caller's command encoder and never read back, so a
//!   whole step is recorded and submitted once.
//! - [`backend`]: [`GpuBackend`], the GPU behind the runtime's `Backend` interface (its
//!   allocator over device buffers, [`GpuMemory`]), and [`GpuSession`], the runtime's session
//!   over it. `launch` maps each op to its kernel's launcher.
//! - [`error`]: what can go wrong, as [`GpuError`].

pub mod adapter;
pub mod backend;
pub mod device;
pub mod error;
pub mod kernels;
mod launch;
pub mod memory;
pub mod transfer;

pub use adapter::{
    adapters, adapters_once, planning_target, subgroups_allowed, AdapterInfo, Selector,
    DEFAULT_LAYOUT,
};
pub use backend::{copy_rate, gemm_rate, GpuBackend, GpuMemory, GpuNode, GpuSession};
pub use device::GpuDevice;
pub use error::{GpuError, Result};
pub use launch::check_graph;
pub use memory::{
    allocator_report, AllocatorReport, Arena, DeviceBuffer, DeviceSlice, MemorySource, Slot,
    BUFFER_LABEL,
};
