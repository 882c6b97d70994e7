//! snug's CPU backend: every op's kernel, the GEMM and threading they run on, and the session
//! that runs a planned step graph on this machine.
//!
//! - [`kernels`]: each op's CPU kernel, in a file named as the op's file in `snug_graph::ops`,
//!   and [`run`], the dispatch generated from the op list (an op without a kernel here does
//!   not compile).
//! - [`gemm`]: the products every kernel calls: our blocked GEMM with its AVX-512 and AVX2
//!   register tiles, a LayerNorm or GELU taken in as it packs, and the gemm crate elsewhere.
//! - [`isa`]: the vector instructions the kernels run with, chosen at run time.
//! - [`par`]: splitting a kernel's work over the rayon pool.
//! - [`math`]: vectorisable `exp`, `tanh`, lane sums, and GELU's scalar function.
//! - [`kernel`]: [`Kernel`], a kernel's checked view of one node's tensors ([`TensorArg`]),
//!   and the [`CpuKernel`] trait every op implements.
//! - [`backend`]: [`CpuBackend`], the CPU behind the runtime's `Backend` interface, and
//!   [`CpuSession`], the runtime's session over it.

pub mod backend;
pub mod gemm;
pub mod isa;
pub mod kernel;
pub mod kernels;
pub mod math;
pub mod par;

pub use backend::{
    cpu_counts, physical_cores, ranks_sharing, ranks_sharing_cpus, CpuBackend, CpuNode, CpuSession,
};
pub use kernel::{CpuKernel, Kernel, TensorArg};
pub use kernels::run;
