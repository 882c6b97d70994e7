//! The GPU as the runtime's [`Backend`]: device buffers through the runtime's allocator
//! ([`GpuMemory`]), each scheduled node bound to (buffer, offset, length) ranges once, and a
//! step recorded node after node into one command encoder and submitted once: no round trip
//! to the host between ops. [`GpuSession`] is the runtime's session over it.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use snug_graph::ops::Op;
use snug_graph::{Graph, Node, Target};
use snug_runtime::{
    Allocator, Backend, Binding, Block, Device, ExecCtx, NodeArgs, RuntimeError, Session, Slice,
};

use crate::adapter::Selector;
use crate::device::GpuDevice;
use crate::error::GpuError;
use crate::memory::{DeviceBuffer, DeviceSlice, MemorySource};
use crate::transfer::StagingRing;
use crate::{launch, transfer};

/// The runtime's session over the GPU backend.
pub type GpuSession = Session<GpuBackend>;

/// The device's memory as the runtime's allocator draws on it: each block is one device
/// buffer from the counting [`MemorySource`], found again by its handle (a number, not an
/// address).
#[derive(Debug)]
pub struct GpuMemory {
    source: MemorySource,
    device: Device,
    next: AtomicUsize,
    blocks: Mutex<HashMap<usize, DeviceBuffer>>,
}

impl GpuMemory {
    fn new(device: &GpuDevice) -> GpuMemory {
        GpuMemory {
            source: MemorySource::new(device),
            device: Device::Gpu(u32::try_from(device.info().index).unwrap_or(u32::MAX)),
            next: AtomicUsize::new(1),
            blocks: Mutex::new(HashMap::new()),
        }
    }

    fn blocks(&self) -> MutexGuard<'_, HashMap<usize, DeviceBuffer>> {
        // Every update is a single map operation: a panic cannot leave it half done.
        self.blocks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The device buffer behind a block's handle.
    fn buffer(&self, handle: usize) -> Option<wgpu::Buffer> {
        self.blocks().get(&handle).map(|b| b.buffer().clone())
    }

    /// Bytes of device buffers allocated and not released (the allocator's cache included).
    pub fn device_active_bytes(&self) -> u64 {
        self.source.active_bytes()
    }

    /// The most bytes of device buffers out at once.
    pub fn device_peak_bytes(&self) -> u64 {
        self.source.peak_bytes()
    }
}

impl snug_runtime::MemorySource for GpuMemory {
    fn device(&self) -> Device {
        self.device
    }

    /// wgpu zeroes new buffers; a device that refuses (out of memory, larger than its largest
    /// buffer, lost) gives `None`, which the allocator reports as out of memory on this device.
    fn allocate(&self, capacity: usize) -> Option<Block> {
        let buffer = self.source.allocate(capacity as u64).ok()?;
        let handle = self.next.fetch_add(1, Ordering::Relaxed);
        self.blocks().insert(handle, buffer);
        Some(Block {
            handle: NonZeroUsize::new(handle)?,
            capacity,
        })
    }

    fn release(&self, block: Block) {
        if let Some(buffer) = self.blocks().remove(&block.handle.get()) {
            self.source.release(buffer);
        }
    }

    fn zero(&self, block: &Block, bytes: usize) {
        let Some(buffer) = self.buffer(block.handle.get()) else {
            return;
        };
        let device = self.source.device();
        let len = (bytes as u64)
            .next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT)
            .min(buffer.size());
        let mut encoder = device.encoder("snug zero");
        encoder.clear_buffer(&buffer, 0, Some(len));
        // A failure here is the device's loss, reported at the next synchronisation.
        let _ = device.submit(encoder);
    }
}

/// One tensor as a node binds it: a range of a device buffer, and its shape.
pub(crate) struct Arg {
    buffer: wgpu::Buffer,
    offset: u64,
    bytes: u64,
    /// Where the kernel binds a view that starts off the device's binding alignment (a row
    /// slice at an odd row): a buffer of its own, filled before the node and copied back after.
    staged: Option<wgpu::Buffer>,
    /// Bytes from the binding's start to the tensor's first byte: u8 codes are bound from
    /// the aligned offset at or below their own, and their kernels read from there.
    byte_offset: u64,
    pub shape: Vec<usize>,
    pub dtype: snug_graph::DType,
}

impl Arg {
    pub fn slice(&self) -> DeviceSlice<'_> {
        match &self.staged {
            Some(s) => DeviceSlice::of(s, 0, self.bytes),
            None => DeviceSlice::of(&self.buffer, self.offset, self.bytes),
        }
    }

    /// Records the copy of a staged tensor into its binding (before the node), or back (after).
    pub fn stage(&self, encoder: &mut wgpu::CommandEncoder, back: bool) {
        if let Some(s) = &self.staged {
            if back {
                encoder.copy_buffer_to_buffer(s, 0, &self.buffer, self.offset, self.bytes);
            } else {
                encoder.copy_buffer_to_buffer(&self.buffer, self.offset, s, 0, self.bytes);
            }
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The binding of a u8 tensor and where its bytes start in it.
    pub fn bytes_slice(&self) -> crate::kernels::ByteSlice<'_> {
        crate::kernels::ByteSlice {
            words: self.slice(),
            offset: self.byte_offset,
        }
    }
}

/// One node bound to device memory.
pub struct GpuNode {
    pub(crate) op: Op,
    pub(crate) inputs: Vec<Arg>,
    pub(crate) outputs: Vec<Arg>,
    pub(crate) workspace: Option<Arg>,
    /// Views (reshape, row slices) run nothing.
    pub(crate) view: bool,
}

/// An opened GPU behind the runtime's [`Backend`] interface.
pub struct GpuBackend {
    device: GpuDevice,
    memory: Arc<GpuMemory>,
    allocator: Allocator,
    target: Target,
    /// A step's inputs on their way to the device (see [`StagingRing`]).
    ring: Mutex<StagingRing>,
    /// Inputs staged while a launch was submitted and not yet waited for.
    staged_while_running: AtomicUsize,
}

impl GpuBackend {
    /// The backend of an opened device, with an allocator of its own over the device's memory.
    pub fn new(device: GpuDevice) -> GpuBackend {
        let memory = Arc::new(GpuMemory::new(&device));
        let allocator = Allocator::with_source(Arc::clone(&memory) as _);
        let target = device.target();
        GpuBackend {
            device,
            memory,
            allocator,
            target,
            ring: Mutex::new(StagingRing::default()),
            staged_while_running: AtomicUsize::new(0),
        }
    }

    fn ring(&self) -> MutexGuard<'_, StagingRing> {
        // Every ring update leaves it consistent between calls: a panic cannot half-do one.
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Staging buffers made for inputs so far: [`transfer::RING_DEPTH`] once a step has been
    /// checked, and no more while its inputs do not grow.
    pub fn staging_buffers_created(&self) -> u64 {
        self.ring().buffers_created()
    }

    /// Inputs written into the staging ring while the launch before was still submitted and
    /// not waited for (its results not yet read): uploads that overlapped a running step.
    pub fn inputs_staged_while_running(&self) -> usize {
        self.staged_while_running.load(Ordering::Relaxed)
    }

    /// Host-visible bytes of the input staging ring: [`transfer::RING_DEPTH`] × the step's
    /// input bytes (each input rounded up to [`wgpu::MAP_ALIGNMENT`], 8 bytes). Not device memory: the plan's
    /// device peak leaves them out.
    pub fn staging_bytes(&self) -> u64 {
        self.ring().bytes()
    }

    /// Records the staged inputs' copies into `encoder` (its first commands), submits it, and
    /// maps the staging buffer again behind it.
    fn submit_after_inputs(
        &self,
        ring: &mut StagingRing,
        mut encoder: wgpu::CommandEncoder,
        record: impl FnOnce(&mut wgpu::CommandEncoder) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        let slot = ring.record(&mut encoder);
        let recorded = record(&mut encoder);
        // The copies are recorded: submit them even when recording the rest failed.
        let submitted = self.device.submit(encoder);
        if let Some(slot) = slot {
            ring.submitted(slot);
        }
        recorded?;
        submitted?;
        Ok(())
    }

    /// Opens the adapter `selector` names.
    pub fn open(selector: Selector) -> Result<GpuBackend, GpuError> {
        GpuDevice::open(selector).map(GpuBackend::new)
    }

    pub fn gpu(&self) -> &GpuDevice {
        &self.device
    }

    /// The device buffers behind the allocator, counted as the device sees them.
    pub fn memory(&self) -> &GpuMemory {
        &self.memory
    }

    fn unsupported(&self, op: &'static str, detail: String) -> RuntimeError {
        RuntimeError::UnsupportedOp {
            device: self.device.info().label(),
            op,
            detail,
        }
    }

    fn arg(&self, b: &Binding<'_>) -> Result<Arg, RuntimeError> {
        let name = &b.meta.name;
        let buffer =
            self.memory
                .buffer(b.slice.buffer.handle())
                .ok_or_else(|| RuntimeError::Device {
                    device: self.device.name().to_string(),
                    lost: false,
                    detail: format!("tensor `{name}` is not in this device's memory"),
                })?;
        let limits = self.device.limits();
        let align = u64::from(limits.min_storage_buffer_offset_alignment);
        let offset = b.slice.offset as u64;
        // u8 codes are bound from the aligned offset at or below theirs, whatever byte they
        // start at; 16-bit tensors as whole words (the plan's slots are aligned past both).
        let byte_offset = if b.meta.dtype == snug_graph::DType::U8 {
            offset % align
        } else {
            0
        };
        let (offset, bytes) = (
            offset - byte_offset,
            (byte_offset + b.slice.len as u64).next_multiple_of(4),
        );
        let fault = if !offset.is_multiple_of(4) {
            Some(format!("at byte {offset}, not a whole 4-byte word"))
        } else if bytes > limits.max_storage_buffer_binding_size {
            Some(format!(
                "{bytes} bytes, over the largest binding of {}",
                limits.max_storage_buffer_binding_size
            ))
        } else {
            None
        };
        if let Some(detail) = fault {
            return Err(RuntimeError::Device {
                device: self.device.name().to_string(),
                lost: false,
                detail: format!("tensor `{name}` cannot be bound: {detail}"),
            });
        }
        let staged = (!offset.is_multiple_of(align)).then(|| {
            self.device
                .wgpu_device()
                .create_buffer(&wgpu::BufferDescriptor {
                    label: Some("snug staged view"),
                    size: bytes.max(4),
                    usage: crate::memory::USAGE,
                    mapped_at_creation: false,
                })
        });
        Ok(Arg {
            buffer,
            offset,
            bytes,
            staged,
            byte_offset,
            shape: b.meta.shape.clone(),
            dtype: b.meta.dtype,
        })
    }

    /// A tensor's range for a copy, in whole words: a u8 or 16-bit tensor's last word runs
    /// into its slot's padding (slots are aligned, and persistent tensors start them).
    fn slice<'a>(&self, s: &Slice<'_>, buffer: &'a wgpu::Buffer) -> DeviceSlice<'a> {
        let len = (s.len as u64).next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT);
        DeviceSlice::of(
            buffer,
            s.offset as u64,
            len.min(buffer.size() - s.offset as u64),
        )
    }

    fn buffer_of(&self, s: &Slice<'_>) -> Result<wgpu::Buffer, RuntimeError> {
        self.memory
            .buffer(s.buffer.handle())
            .ok_or_else(|| RuntimeError::Device {
                device: self.device.name().to_string(),
                lost: false,
                detail: "a copy names a buffer that is not in this device's memory".into(),
            })
    }
}

impl Backend for GpuBackend {
    type Bound = GpuNode;

    fn device(&self) -> Device {
        self.memory.device
    }

    fn target(&self) -> Target {
        self.target
    }

    fn allocator(&self) -> &Allocator {
        &self.allocator
    }

    fn check(&self, graph: &Graph) -> Result<(), RuntimeError> {
        launch::check_graph(graph).map_err(|(op, d)| self.unsupported(op, d))?;
        // Every input of one step fits one staging buffer of the ring.
        let inputs: u64 = graph
            .tensors()
            .iter()
            .filter(|t| t.role == snug_graph::Role::Input && t.view_of.is_none())
            .map(|t| (t.size_bytes() as u64).next_multiple_of(wgpu::MAP_ALIGNMENT))
            .sum();
        self.ring().reserve(&self.device, inputs);
        Ok(())
    }

    fn bind(
        &self,
        graph: &Graph,
        node: &Node,
        args: NodeArgs<'_>,
    ) -> Result<GpuNode, RuntimeError> {
        let args_of = |bs: &[Binding<'_>]| -> Result<Vec<Arg>, RuntimeError> {
            bs.iter().map(|b| self.arg(b)).collect()
        };
        Ok(GpuNode {
            op: node.op.clone(),
            inputs: args_of(&args.inputs)?,
            outputs: args_of(&args.outputs)?,
            workspace: args.workspace.as_ref().map(|b| self.arg(b)).transpose()?,
            view: graph.is_view(node),
        })
    }

    fn launch(
        &self,
        nodes: &[GpuNode],
        selected: Option<&[bool]>,
        ctx: ExecCtx,
        times: Option<&mut Vec<f64>>,
    ) -> Result<(), RuntimeError> {
        let runs = |i: usize| selected.is_none_or(|m| m.get(i).copied().unwrap_or(false));
        let device = &self.device;
        let mut ring = self.ring();
        match times {
            None => {
                let encoder = device.encoder("snug step");
                self.submit_after_inputs(&mut ring, encoder, |encoder| {
                    for (i, n) in nodes.iter().enumerate() {
                        if runs(i) && !n.view {
                            launch::record(device, encoder, n, ctx)?;
                        }
                    }
                    Ok(())
                })?;
            }
            // Timed: the inputs first, then each node submitted and waited for alone.
            Some(times) => {
                if ring.pending() {
                    let encoder = device.encoder("snug inputs");
                    self.submit_after_inputs(&mut ring, encoder, |_| Ok(()))?;
                }
                for (i, n) in nodes.iter().enumerate() {
                    if !runs(i) {
                        continue;
                    }
                    let start = std::time::Instant::now();
                    if !n.view {
                        let mut encoder = device.encoder("snug node");
                        launch::record(device, &mut encoder, n, ctx)?;
                        device.submit(encoder)?;
                        device.wait()?;
                    }
                    times.push(start.elapsed().as_secs_f64());
                }
            }
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<(), RuntimeError> {
        Ok(self.device.wait()?)
    }

    /// Copies now, after any staged input (which was written first).
    fn upload(&self, dst: Slice<'_>, bytes: &[u8]) -> Result<(), RuntimeError> {
        let buffer = self.buffer_of(&dst)?;
        let n = dst.len.min(bytes.len());
        let slice = self.slice(&dst, &buffer);
        // Copies move whole words: a ragged tail is padded with zeros.
        let mut padded;
        let mut data = &bytes[..n];
        if !n.is_multiple_of(4) {
            padded = data.to_vec();
            padded.resize(n.next_multiple_of(4), 0);
            data = &padded;
        }
        let encoder = self.device.encoder("snug upload");
        self.submit_after_inputs(&mut self.ring(), encoder, |encoder| {
            Ok(transfer::upload_in(&self.device, encoder, &slice, data)?)
        })
    }

    fn stages_inputs(&self) -> bool {
        true
    }

    /// Through the staging ring where the input fits what is left of its buffer; copied now
    /// (behind what is staged) where it does not.
    fn upload_input(&self, dst: Slice<'_>, bytes: &[u8]) -> Result<(), RuntimeError> {
        let buffer = self.buffer_of(&dst)?;
        let n = dst.len.min(bytes.len());
        let slice = self.slice(&dst, &buffer);
        let running = self.device.has_unwaited_work();
        if self.ring().stage(&self.device, &slice, &bytes[..n])? {
            if running {
                self.staged_while_running.fetch_add(1, Ordering::Relaxed);
            }
            return Ok(());
        }
        // Copied now: queued behind the step launched last, which still reads the old input.
        self.upload(dst, bytes)
    }

    fn discard_staged_inputs(&self) {
        self.ring().discard();
    }

    fn download(&self, src: Slice<'_>, out: &mut [u8]) -> Result<(), RuntimeError> {
        let buffer = self.buffer_of(&src)?;
        let bytes = transfer::download(&self.device, &self.slice(&src, &buffer))?;
        let n = out.len().min(bytes.len());
        out[..n].copy_from_slice(&bytes[..n]);
        Ok(())
    }
}

impl From<GpuError> for RuntimeError {
    fn from(e: GpuError) -> RuntimeError {
        let device = |d: String, detail: String| RuntimeError::Device {
            device: d,
            lost: false,
            detail,
        };
        match e {
            GpuError::DeviceLost { device, reason } => RuntimeError::Device {
                device,
                lost: true,
                detail: format!("device lost: {reason}"),
            },
            GpuError::Unsupported {
                device,
                kernel,
                detail,
            } => RuntimeError::UnsupportedOp {
                device,
                op: kernel,
                detail,
            },
            GpuError::NoAdapter | GpuError::AdapterIndex { .. } => {
                device("gpu".into(), e.to_string())
            }
            GpuError::RequestDevice { device: d, reason } => {
                device(d, format!("could not open a device: {reason}"))
            }
            GpuError::OutOfMemory { device: d, bytes } => {
                device(d, format!("out of device memory allocating {bytes} bytes"))
            }
            GpuError::BufferTooLarge {
                device: d,
                bytes,
                max,
            } => device(
                d,
                format!("a buffer of {bytes} bytes exceeds the largest buffer, {max} bytes"),
            ),
            GpuError::Binding {
                device: d,
                what,
                detail,
            } => device(d, format!("cannot bind {what}: {detail}")),
            GpuError::Backend { device: d, detail } => device(d, detail),
            GpuError::Map { device: d, detail } => {
                device(d, format!("mapping a host-visible buffer failed: {detail}"))
            }
        }
    }
}

/// The device's f32 GEMM rate in FLOP/s: `[m, k]·[k, n]` through snug's matmul kernel, the
/// best of `runs` timed submits (each waited for) after one untimed run that compiles the
/// kernel. The operands are the device's zeroed buffers: a GPU's GEMM time does not depend on
/// the values. A shared `(device, shape)` is measured once per process.
pub fn gemm_rate(
    device: &GpuDevice,
    (m, k, n): (usize, usize, usize),
    runs: usize,
) -> Result<f64, GpuError> {
    type Key = (usize, String, (usize, usize, usize));
    static CACHE: std::sync::OnceLock<Mutex<HashMap<Key, f64>>> = std::sync::OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let key = (device.info().index, device.name().to_string(), (m, k, n));
    if let Some(&rate) = cache
        .lock()
        .ok()
        .and_then(|c| c.get(&key).copied())
        .as_ref()
    {
        return Ok(rate);
    }
    let source = MemorySource::new(device);
    let bytes = |r: usize, c: usize| (r * c * 4) as u64;
    let arena = crate::memory::Arena::allocate(&source, &[bytes(m, k), bytes(k, n), bytes(m, n)])?;
    let g = crate::kernels::matmul::Gemm {
        batch: 1,
        m,
        n,
        k,
        ta: false,
        tb: false,
        shared_b: false,
    };
    let once = || -> Result<f64, GpuError> {
        let [a, b, c] = [0, 1, 2].map(|i| arena.chunks()[i].whole());
        let start = std::time::Instant::now();
        let mut encoder = device.encoder("snug GEMM probe");
        crate::kernels::matmul::matmul(device, &mut encoder, g, a, b, None, c, None)?;
        device.submit(encoder)?;
        device.wait()?;
        Ok(start.elapsed().as_secs_f64())
    };
    let timed = once()
        .and_then(|_| (0..runs.max(1)).try_fold(f64::INFINITY, |best, _| Ok(best.min(once()?))));
    arena.release(&source);
    let rate = 2.0 * (m * n * k) as f64 / timed?.max(f64::MIN_POSITIVE);
    if let Ok(mut c) = cache.lock() {
        c.insert(key, rate);
    }
    Ok(rate)
}

/// The device's copy rate in bytes per second (read + write counted): `bytes` copied from one
/// device buffer to another, the best of `runs` timed submits after an untimed one. Measured
/// once per process for a `(device, bytes)`.
pub fn copy_rate(device: &GpuDevice, bytes: u64, runs: usize) -> Result<f64, GpuError> {
    type Key = (usize, String, u64);
    static CACHE: std::sync::OnceLock<Mutex<HashMap<Key, f64>>> = std::sync::OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let key = (device.info().index, device.name().to_string(), bytes);
    if let Some(rate) = cache.lock().ok().and_then(|c| c.get(&key).copied()) {
        return Ok(rate);
    }
    let bytes = bytes.max(4).next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT);
    let source = MemorySource::new(device);
    let arena = crate::memory::Arena::allocate(&source, &[bytes, bytes])?;
    let once = || -> Result<f64, GpuError> {
        let [a, b] = [0, 1].map(|i| arena.chunks()[i].buffer());
        let start = std::time::Instant::now();
        let mut encoder = device.encoder("snug copy probe");
        encoder.copy_buffer_to_buffer(a, 0, b, 0, bytes);
        device.submit(encoder)?;
        device.wait()?;
        Ok(start.elapsed().as_secs_f64())
    };
    let timed = once()
        .and_then(|_| (0..runs.max(1)).try_fold(f64::INFINITY, |best, _| Ok(best.min(once()?))));
    arena.release(&source);
    let rate = 2.0 * bytes as f64 / timed?.max(f64::MIN_POSITIVE);
    if let Ok(mut c) = cache.lock() {
        c.insert(key, rate);
    }
    Ok(rate)
}
