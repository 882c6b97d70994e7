//! snug's runtime: where planned graphs meet real memory.
//!
//! - [`allocator`]: the caching device allocator with its counters (active, peak, cache) and
//!   limits (memory, cache, wired); every byte snug holds goes through it.
//! - [`cpu`]: [`CpuSession`] runs a planned step graph inside one arena.

pub mod allocator;
pub mod backend;
pub mod cpu;
mod error;
pub mod process;
mod session;

pub use allocator::{
    Allocator, Block, Buffer, Device, HostMemory, Leak, MemoryReport, MemorySource, MemoryStats,
    OutOfMemory, WiredLimitError,
};
pub use backend::{Backend, Binding, NodeArgs, Slice};
pub use cpu::{physical_cores, CpuSession};
pub use error::RuntimeError;
pub use session::Session;
pub use snug_graph::ops::ExecCtx;
pub use snug_plan::{parse_bytes, SizeError};
