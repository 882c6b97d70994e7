//! snug's runtime: where planned graphs meet real memory, shared by every backend.
//!
//! - [`allocator`]: the caching device allocator with its counters (active, peak, cache) and
//!   limits (memory, cache, wired); every byte snug holds goes through it.
//! - [`exec`]: [`ExecCtx`], the per-run values (learning rate, step, micro-batch) kernels read.
//! - [`process`]: the process's own resources (resident set, CPU time, the C heap).
//!
//! The backends (the CPU's is `snug-cpu`) run planned graphs with these.

pub mod allocator;
pub mod backend;
mod error;
pub mod exec;
pub mod process;
mod session;

pub use allocator::{
    Allocator, Block, Buffer, Device, HostMemory, Leak, MemoryReport, MemorySource, MemoryStats,
    OutOfMemory, WiredLimitError,
};
pub use backend::{Backend, Binding, NodeArgs, Slice};
pub use error::RuntimeError;
pub use exec::ExecCtx;
pub use session::Session;
pub use snug_plan::{parse_bytes, SizeError};
