//! Every kernel against a plain reference written here (loops in f64), on shapes that cross
//! the kernels' tile edges, on the first adapter (lavapipe in CI).

#[path = "../common/mod.rs"]
mod common;

mod matmul;
