//! What the GPU tests share: one device per test binary, tensors packed into one arena chunk
//! at the device's alignment (so every launch binds ranges at offsets, as a plan does), seeded
//! data, and comparisons against f64 references.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::OnceLock;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use snug_gpu::{transfer, Arena, DeviceSlice, GpuDevice, MemorySource, Selector, Slot};

/// The first adapter, opened once for the whole binary; `None` (after a skip, or a failure
/// under `SNUG_REQUIRE_ALL_TESTS`) where the machine has none.
pub fn gpu() -> Option<&'static GpuDevice> {
    static DEVICE: OnceLock<Option<GpuDevice>> = OnceLock::new();
    let device = DEVICE.get_or_init(|| {
        if snug_gpu::adapters().is_empty() {
            return None;
        }
        Some(GpuDevice::open(Selector::FirstGpu).expect("the first adapter opens"))
    });
    if device.is_none() {
        snug_testkit::skip_or_fail("no GPU adapter");
    }
    device.as_ref()
}

/// The first adapter opened without its optional features (`SHADER_F16`, `SUBGROUP`), so
/// every kernel takes its plain path; `None` as [`gpu`].
pub fn gpu_plain() -> Option<&'static GpuDevice> {
    static DEVICE: OnceLock<Option<GpuDevice>> = OnceLock::new();
    gpu()?;
    DEVICE
        .get_or_init(|| Some(GpuDevice::open_plain(Selector::FirstGpu).expect("it opens")))
        .as_ref()
}

/// The first adapter opened without `SUBGROUP` (its reductions take the workgroup-memory
/// tree); `None` as [`gpu`].
pub fn gpu_no_subgroups() -> Option<&'static GpuDevice> {
    static DEVICE: OnceLock<Option<GpuDevice>> = OnceLock::new();
    gpu()?;
    DEVICE
        .get_or_init(|| {
            Some(GpuDevice::open_without_subgroups(Selector::FirstGpu).expect("it opens"))
        })
        .as_ref()
}

/// Both reduction paths: [`gpu`] (with subgroup operations where the adapter has them) and
/// [`gpu_no_subgroups`]; empty as [`gpu`] is `None`.
pub fn both_paths() -> Vec<&'static GpuDevice> {
    gpu().into_iter().chain(gpu_no_subgroups()).collect()
}

/// A tensor's initial contents.
pub enum Init {
    F32(Vec<f32>),
    I32(Vec<i32>),
    /// `n` floats the kernel is expected to write: filled with NaN so a missed element shows.
    Out(usize),
    /// Bytes (u8 codes, or anything a test lays out by hand), zero-padded to a whole word.
    U8(Vec<u8>),
}

impl Init {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Init::F32(v) => bytemuck::cast_slice(v).to_vec(),
            Init::I32(v) => bytemuck::cast_slice(v).to_vec(),
            Init::Out(n) => bytemuck::cast_slice(&vec![f32::NAN; *n]).to_vec(),
            Init::U8(v) => {
                let mut v = v.clone();
                v.resize(v.len().next_multiple_of(4), 0);
                v
            }
        }
    }
}

/// Tensors packed into one arena chunk, each at an aligned offset.
pub struct Tensors {
    device: &'static GpuDevice,
    source: MemorySource,
    arena: Option<Arena>,
    slots: Vec<Slot>,
}

impl Tensors {
    pub fn new(device: &'static GpuDevice, inits: &[Init]) -> Tensors {
        let align = u64::from(device.limits().min_storage_buffer_offset_alignment);
        let datas: Vec<Vec<u8>> = inits.iter().map(Init::bytes).collect();
        let mut slots = Vec::new();
        let mut end = 0u64;
        for d in &datas {
            let bytes = (d.len() as u64).max(4);
            slots.push(Slot::new(0, end, bytes));
            end = (end + bytes).next_multiple_of(align);
        }
        let source = MemorySource::new(device);
        let arena = Arena::allocate(&source, &[end.max(4)]).expect("the arena fits");
        for (slot, d) in slots.iter().zip(&datas) {
            if !d.is_empty() {
                let dst = arena.slice(*slot).expect("a valid slot");
                transfer::upload(device, &dst, d).expect("upload");
            }
        }
        Tensors {
            device,
            source,
            arena: Some(arena),
            slots,
        }
    }

    pub fn get(&self, i: usize) -> DeviceSlice<'_> {
        self.arena
            .as_ref()
            .expect("the arena is live")
            .slice(self.slots[i])
            .expect("a valid slot")
    }

    pub fn read(&self, i: usize) -> Vec<f32> {
        transfer::download_f32(self.device, &self.get(i)).expect("download")
    }

    /// Tensor `i`'s bytes (its whole words).
    pub fn read_bytes(&self, i: usize) -> Vec<u8> {
        transfer::download(self.device, &self.get(i)).expect("download")
    }

    /// Records with `f` into a fresh encoder, submits and waits.
    pub fn run(&self, f: impl FnOnce(&mut wgpu::CommandEncoder, &Tensors) -> snug_gpu::Result<()>) {
        let mut encoder = self.device.encoder("test");
        f(&mut encoder, self).expect("the launch records");
        self.device.submit(encoder).expect("submit");
        self.device.wait().expect("the step runs");
    }
}

impl Drop for Tensors {
    fn drop(&mut self) {
        if let Some(arena) = self.arena.take() {
            arena.release(&self.source);
        }
    }
}

/// `n` values uniform in `[lo, hi)`, seeded.
pub fn uniform(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// `n` ids in `[0, hi)`, seeded.
pub fn ids(seed: u64, n: usize, hi: i32) -> Vec<i32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..hi)).collect()
}

pub fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// Asserts `|got − want| ≤ rtol · max(|want|, scale)` element by element, where `scale` is
/// the magnitude an element's rounding error is relative to (for a sum, the sum of its
/// terms' magnitudes; 0 for a plain relative check).
pub fn assert_close(what: &str, got: &[f32], want: &[f64], rtol: f64, scale: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let s = scale.get(i).copied().unwrap_or(0.0);
        let tol = rtol * w.abs().max(s);
        let err = (f64::from(g) - w).abs();
        assert!(
            err <= tol,
            "{what}[{i}]: got {g}, want {w} (error {err:e} > {tol:e})"
        );
    }
}

/// [`assert_close`] across the reduction paths of [`both_paths`]: each output is checked
/// against its reference, and every path after the first must give the first's bits (the
/// subgroup reductions fold in the plain tree's order).
#[derive(Default)]
pub struct SameBits(HashMap<String, Vec<u32>>);

impl SameBits {
    pub fn assert_close(
        &mut self,
        what: &str,
        got: &[f32],
        want: &[f64],
        rtol: f64,
        scale: &[f64],
    ) {
        assert_close(what, got, want, rtol, scale);
        let bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
        match self.0.get(what) {
            None => {
                self.0.insert(what.to_string(), bits);
            }
            Some(first) => {
                let differ = first.iter().zip(&bits).filter(|(a, b)| a != b).count();
                assert!(
                    differ == 0 && first.len() == bits.len(),
                    "{what}: {differ} of {} elements differ in their bits between the subgroup and plain reductions",
                    bits.len()
                );
            }
        }
    }
}
