//! Every kernel against a plain reference written here (loops in f64), on shapes that cross
//! the kernels' tile edges, on the first adapter (lavapipe in CI). One binary, so the device
//! is opened once.

#[path = "../common/mod.rs"]
mod common;

mod activations;
mod attention;
mod cast;
mod elementwise;
mod kv_attention;
mod losses;
mod matmul;
mod norms;
mod optimizers;
mod quantized;
mod reshaping;
mod rope;
mod subgroups;
