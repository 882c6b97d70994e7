//! An opened adapter: its device and queue, the compiled pipelines, and the errors wgpu reports
//! asynchronously (device loss, validation), turned into [`GpuError`]s at the next check.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use snug_graph::{MemoryLayout, Target};

use crate::adapter::{self, AdapterInfo, Selector};
use crate::error::{GpuError, Result};

/// A pipeline is one entry point of one WGSL file, specialised by constants prepended to it,
/// with its storage bindings' numbers.
type PipelineKey = (&'static str, &'static str, String, Vec<u32>);

/// The optional features [`GpuDevice::open`] asks for where the adapter has them.
const FAST_PATHS: wgpu::Features = wgpu::Features::SHADER_F16.union(wgpu::Features::SUBGROUP);

/// A compiled kernel and the layout its bind groups follow.
pub(crate) struct Pipeline {
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
}

/// What wgpu reported outside any error scope, kept until the next [`GpuDevice::check`].
#[derive(Default)]
struct Reported {
    lost: Option<String>,
    errors: Vec<String>,
}

struct Inner {
    info: AdapterInfo,
    /// The optional features the device was opened with (those the fast paths use).
    features: wgpu::Features,
    device: wgpu::Device,
    queue: wgpu::Queue,
    pipelines: Mutex<HashMap<PipelineKey, Arc<Pipeline>>>,
    reported: Arc<Mutex<Reported>>,
    /// Command buffers submitted so far.
    submits: AtomicU64,
    /// Something was submitted after the last [`GpuDevice::wait`].
    unwaited: std::sync::atomic::AtomicBool,
}

/// An opened GPU. Cheap to clone: clones share the device, its queue and its pipelines.
#[derive(Clone)]
pub struct GpuDevice {
    inner: Arc<Inner>,
    /// The adapter's limits, or tighter ones ([`GpuDevice::with_max_buffer_size`]).
    limits: Arc<wgpu::Limits>,
}

impl std::fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDevice")
            .field("adapter", &self.inner.info.label())
            .finish()
    }
}

impl GpuDevice {
    /// Opens the adapter `selector` names, with the adapter's own limits (not WebGPU's
    /// defaults: the arena wants the largest buffers the device allows) and whichever of the
    /// features the kernels' fast paths use it has (`SHADER_F16`, `SUBGROUP`).
    /// `SNUG_GPU_SUBGROUPS=0` leaves `SUBGROUP` out (see [`adapter::subgroups_allowed`]).
    pub fn open(selector: Selector) -> Result<GpuDevice> {
        let wanted = if adapter::subgroups_allowed() {
            FAST_PATHS
        } else {
            FAST_PATHS.difference(wgpu::Features::SUBGROUP)
        };
        Self::open_with(selector, wanted)
    }

    /// [`GpuDevice::open`] without `SUBGROUP`: the reductions take the workgroup-memory tree
    /// (the tests compare it with the subgroup path).
    pub fn open_without_subgroups(selector: Selector) -> Result<GpuDevice> {
        Self::open_with(selector, FAST_PATHS.difference(wgpu::Features::SUBGROUP))
    }

    /// [`GpuDevice::open`] without the optional features: every kernel takes its plain path
    /// (what an adapter without them runs; the tests compare the two).
    pub fn open_plain(selector: Selector) -> Result<GpuDevice> {
        Self::open_with(selector, wgpu::Features::empty())
    }

    fn open_with(selector: Selector, wanted: wgpu::Features) -> Result<GpuDevice> {
        let instance = adapter::instance();
        let (adapter, info) = adapter::select(adapter::enumerate(&instance), selector)?;
        let limits = adapter.limits();
        let features = adapter.features() & wanted;
        let desc = wgpu::DeviceDescriptor {
            label: Some("snug"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&desc)).map_err(|e| {
            GpuError::RequestDevice {
                device: info.name.clone(),
                reason: e.to_string(),
            }
        })?;
        let reported = Arc::new(Mutex::new(Reported::default()));
        let sink = Arc::clone(&reported);
        device.set_device_lost_callback(move |reason, message| {
            if let Ok(mut r) = sink.lock() {
                r.lost = Some(format!("{reason:?}: {message}"));
            }
        });
        // wgpu panics on an uncaptured error by default; a library reports it instead.
        let sink = Arc::clone(&reported);
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut r) = sink.lock() {
                r.errors.push(e.to_string());
            }
        }));
        Ok(GpuDevice {
            inner: Arc::new(Inner {
                info,
                features,
                device,
                queue,
                pipelines: Mutex::new(HashMap::new()),
                reported,
                submits: AtomicU64::new(0),
                unwaited: std::sync::atomic::AtomicBool::new(false),
            }),
            limits: Arc::new(limits),
        })
    }

    /// This device with buffers (and so the plan's arena chunks) no larger than `bytes`, where
    /// that is below the adapter's own limit: for drivers whose large allocations fail, and to
    /// exercise an arena over several chunks on any device. Bindings stay within the new
    /// largest buffer. Shares the device, queue and pipelines with `self`.
    pub fn with_max_buffer_size(&self, bytes: u64) -> GpuDevice {
        let mut limits = wgpu::Limits::clone(&self.limits);
        limits.max_buffer_size = limits.max_buffer_size.min(bytes);
        limits.max_storage_buffer_binding_size = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size);
        GpuDevice {
            inner: Arc::clone(&self.inner),
            limits: Arc::new(limits),
        }
    }

    pub fn info(&self) -> &AdapterInfo {
        &self.inner.info
    }

    /// The adapter's name, as errors name the device.
    pub fn name(&self) -> &str {
        &self.inner.info.name
    }

    pub fn limits(&self) -> &wgpu::Limits {
        &self.limits
    }

    /// Whether kernels may use f16 in shaders (`SHADER_F16`, requested where the adapter has
    /// it).
    pub fn has_f16(&self) -> bool {
        self.inner.features.contains(wgpu::Features::SHADER_F16)
    }

    /// Whether kernels may use subgroup operations (`SUBGROUP`, requested where the adapter
    /// has it). No subgroup size is assumed.
    pub fn has_subgroups(&self) -> bool {
        self.inner.features.contains(wgpu::Features::SUBGROUP)
    }

    /// What plans for this device assume: tensors at multiples of its storage offset
    /// alignment, the arena within its largest buffer, each tensor within its largest storage
    /// binding, and no fusions (its kernels take plain ops).
    pub fn target(&self) -> Target {
        let l = &self.limits;
        let bytes = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        Target::gpu(MemoryLayout {
            alignment: (l.min_storage_buffer_offset_alignment as usize).max(1),
            max_buffer_bytes: bytes(l.max_buffer_size),
            max_binding_bytes: bytes(l.max_storage_buffer_binding_size),
        })
    }

    pub fn wgpu_device(&self) -> &wgpu::Device {
        &self.inner.device
    }

    pub fn queue(&self) -> &wgpu::Queue {
        &self.inner.queue
    }

    /// A fresh encoder to record a step (or part of one) into.
    pub fn encoder(&self, label: &str) -> wgpu::CommandEncoder {
        self.inner
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) })
    }

    /// Submits what `encoder` recorded, without waiting for it.
    pub fn submit(&self, encoder: wgpu::CommandEncoder) -> Result<wgpu::SubmissionIndex> {
        self.check()?;
        let index = self.inner.queue.submit([encoder.finish()]);
        self.inner.submits.fetch_add(1, Ordering::Relaxed);
        self.inner.unwaited.store(true, Ordering::Relaxed);
        self.check()?;
        Ok(index)
    }

    /// Command buffers submitted to this device so far (a step is one).
    pub fn submissions(&self) -> u64 {
        self.inner.submits.load(Ordering::Relaxed)
    }

    /// Whether work was submitted since the last [`GpuDevice::wait`]: the host has not yet
    /// waited for (or read anything back from) the last launch.
    pub fn has_unwaited_work(&self) -> bool {
        self.inner.unwaited.load(Ordering::Relaxed)
    }

    /// Blocks until everything submitted so far has run, then reports any error since.
    pub fn wait(&self) -> Result<()> {
        let polled = self.inner.device.poll(wgpu::PollType::wait_indefinitely());
        self.inner.unwaited.store(false, Ordering::Relaxed);
        self.check()?;
        polled.map(|_| ()).map_err(|e| GpuError::DeviceLost {
            device: self.name().to_string(),
            reason: e.to_string(),
        })
    }

    /// Runs the callbacks of work the device has finished, without blocking, then reports any
    /// error since.
    pub fn poll(&self) -> Result<()> {
        let polled = self.inner.device.poll(wgpu::PollType::Poll);
        self.check()?;
        polled.map(|_| ()).map_err(|e| GpuError::DeviceLost {
            device: self.name().to_string(),
            reason: e.to_string(),
        })
    }

    /// The device's loss, or the first error wgpu reported outside a scope since the last
    /// check (taking it).
    pub fn check(&self) -> Result<()> {
        let device = self.name().to_string();
        let Ok(mut r) = self.inner.reported.lock() else {
            return Err(GpuError::Backend {
                device,
                detail: "the error sink was poisoned".into(),
            });
        };
        if let Some(reason) = &r.lost {
            return Err(GpuError::DeviceLost {
                device,
                reason: reason.clone(),
            });
        }
        if r.errors.is_empty() {
            return Ok(());
        }
        let errors = std::mem::take(&mut r.errors);
        let detail = errors.join("; ");
        // A device lost mid-run surfaces as errors naming it before the callback runs.
        if detail.contains("Device is lost") || detail.contains("device lost") {
            return Err(GpuError::DeviceLost {
                device,
                reason: detail,
            });
        }
        Err(GpuError::Backend { device, detail })
    }

    /// Runs `f` inside an error scope for `filter` and returns wgpu's error, if any.
    pub(crate) fn scoped<T>(
        &self,
        filter: wgpu::ErrorFilter,
        f: impl FnOnce() -> T,
    ) -> (T, Option<wgpu::Error>) {
        let scope = self.inner.device.push_error_scope(filter);
        let out = f();
        (out, pollster::block_on(scope.pop()))
    }

    /// The compiled pipeline for `entry` of `source` with `constants` (WGSL `const`
    /// declarations) prepended to the shared prelude and the file. Its layout is explicit:
    /// binding 0 the uniform arguments, `storage` the tensors (all `read_write`), so a
    /// specialisation that leaves a binding unused still takes the same bind group.
    pub(crate) fn pipeline(
        &self,
        file: &'static str,
        source: &'static str,
        entry: &'static str,
        constants: String,
        storage: Vec<u32>,
    ) -> Result<Arc<Pipeline>> {
        let key = (file, entry, constants, storage);
        let cached = self
            .inner
            .pipelines
            .lock()
            .ok()
            .and_then(|p| p.get(&key).cloned());
        if let Some(p) = cached {
            return Ok(p);
        }
        let prelude = crate::kernels::prelude(self.has_subgroups());
        let code = format!("{}\n{}\n{}", key.2, prelude, source);
        let device = &self.inner.device;
        let entry_of = |binding: u32, ty: wgpu::BufferBindingType| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty,
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let mut entries = vec![entry_of(0, wgpu::BufferBindingType::Uniform)];
        entries.extend(
            key.3
                .iter()
                .map(|&b| entry_of(b, wgpu::BufferBindingType::Storage { read_only: false })),
        );
        let (built, error) = self.scoped(wgpu::ErrorFilter::Validation, || {
            let desc = wgpu::ShaderModuleDescriptor {
                label: Some(file),
                source: wgpu::ShaderSource::Wgsl(code.into()),
            };
            // wgpu's default checks, less two that cost an H200 half of every training
            // step's time (121 → 64 ms at char-small, 968 → 454 ms at GPT-2 124M): a counter
            // that bounds every loop, and guards on every integer division. Bounds checks
            // stay (free where the driver clamps accesses itself, as Vulkan's
            // robustBufferAccess2 does).
            let mut checks = wgpu::ShaderRuntimeChecks::checked();
            checks.force_loop_bounding = false;
            checks.int_div_checks = false;
            // SAFETY: these are our own kernels, not user shaders, and neither removed check
            // guards memory. Every loop in them ends: each counts by a step that is never
            // 0 towards a bound that a binding's size (under 4 GiB) keeps far from wrapping,
            // or shrinks a count of bits. An integer division by zero would give an undefined value, not
            // an access: every divisor is a count of a non-empty tensor's axis (heads, columns,
            // rows), and `Dispatch::record` launches nothing for an empty tensor.
            let module = unsafe { device.create_shader_module_trusted(desc, checks) };
            let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(entry),
                entries: &entries,
            });
            let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(entry),
                bind_group_layouts: &[Some(&layout)],
                immediate_size: 0,
            });
            let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(&pipeline_layout),
                module: &module,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            });
            Pipeline { pipeline, layout }
        });
        if let Some(e) = error {
            return Err(GpuError::Backend {
                device: self.name().to_string(),
                detail: format!("compiling {file}:{entry}: {e}"),
            });
        }
        let built = Arc::new(built);
        if let Ok(mut p) = self.inner.pipelines.lock() {
            p.insert(key, Arc::clone(&built));
        }
        Ok(built)
    }
}
