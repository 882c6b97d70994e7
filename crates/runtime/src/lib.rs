//! snug's runtime: where planned graphs meet real memory.
//!
//! - [`allocator`]: the device allocator with its counters (active, peak) and limit; every
//!   byte snug holds goes through it.
//! - [`cpu`]: [`CpuSession`] runs a planned step graph inside one arena.

pub mod allocator;
pub mod cpu;
mod error;
pub mod process;

pub use allocator::{Allocator, Buffer, Device, OutOfMemory};
pub use cpu::{physical_cores, CpuSession};
pub use error::RuntimeError;
pub use snug_graph::ops::ExecCtx;
