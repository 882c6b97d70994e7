//! The executor, written once for every device: one arena per plan (one buffer per chunk of
//! it, one chunk where the device's buffers are large enough), one buffer per persistent
//! tensor, and each scheduled node bound once to its bytes, so a step allocates nothing.
//!
//! The arena holds nothing between steps, so a trainer gives it back to the allocator's cache
//! after each micro-batch ([`Session::release_arena`]) and the next run takes it again: a cache
//! hit, no system call, no zeroing. That makes a lowered memory limit bite at the next
//! micro-batch, as a typed out-of-memory error before any kernel runs, and lets a session be
//! re-planned ([`Session::replan`]) keeping its parameters and optimizer state in place.

use std::borrow::Cow;
use std::collections::HashMap;

use snug_graph::{DType, Graph, Role, TensorId, TensorMeta};
use snug_plan::MemoryPlan;

use crate::backend::{Backend, Binding, NodeArgs, Slice};
use crate::{Buffer, ExecCtx, RuntimeError};

/// A planned graph, loaded into a device's memory and ready to run step after step.
pub struct Session<B: Backend> {
    // Bindings point into the buffers below, so they are declared (and dropped) first.
    bound: Vec<B::Bound>,
    /// The arena chunks `bound` was made for (their handles), empty when unbound.
    bound_to: Vec<usize>,
    /// One buffer per chunk of the plan's arena; `None` between steps once released.
    arena: Option<Vec<Buffer>>,
    /// Indexed by tensor id; `Some` for persistent storage roots.
    persistent: Vec<Option<Buffer>>,
    graph: Graph,
    plan: MemoryPlan,
    backend: B,
}

impl<B: Backend> Session<B> {
    /// Allocates the arena and every persistent buffer through the backend's allocator.
    pub fn new(graph: Graph, plan: MemoryPlan, backend: B) -> Result<Self, RuntimeError> {
        backend.check(&graph)?;
        let allocator = backend.allocator();
        let mut persistent: Vec<Option<Buffer>> =
            (0..graph.tensors().len()).map(|_| None).collect();
        for p in &plan.persistent {
            persistent[p.tensor.index()] = Some(allocator.alloc(p.size)?);
        }
        let arena = plan
            .chunks()
            .iter()
            .map(|&c| allocator.alloc(c))
            .collect::<Result<Vec<_>, _>>()?;
        let mut session = Session {
            bound: Vec::new(),
            bound_to: Vec::new(),
            arena: Some(arena),
            persistent,
            graph,
            plan,
            backend,
        };
        session.acquire_arena()?;
        Ok(session)
    }

    /// Takes the arena (from the allocator's cache, as a rule) if it was released, and binds
    /// the nodes to it. Fails, changing nothing, if the memory limit refuses it.
    pub fn acquire_arena(&mut self) -> Result<(), RuntimeError> {
        if self.arena.is_none() {
            // The schedule writes every arena tensor before reading it, so old bytes are fine.
            // Chunks taken before a refusal drop back to the allocator's cache.
            let allocator = self.backend.allocator();
            self.arena = Some(
                self.plan
                    .chunks()
                    .iter()
                    .map(|&c| allocator.alloc_uninit(c))
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        let handles: Vec<usize> = self.arena.iter().flatten().map(Buffer::handle).collect();
        if handles != self.bound_to {
            self.bound.clear();
            self.bound = self.bind_all()?;
            self.bound_to = handles;
        }
        Ok(())
    }

    /// Gives the arena back to the allocator (its cache) until the next run or write. Values
    /// that lived in it, the loss included, are unreadable afterwards.
    pub fn release_arena(&mut self) -> Result<(), RuntimeError> {
        if self.arena.is_some() {
            self.backend.synchronize()?;
        }
        self.arena = None;
        Ok(())
    }

    pub fn holds_arena(&self) -> bool {
        self.arena.is_some()
    }

    /// The handles of the arena chunks the nodes were last bound to (kept after
    /// [`Session::release_arena`]): an input staged for the next launch lands where that
    /// launch reads it only while these are unchanged.
    pub fn bound_arena(&self) -> &[usize] {
        &self.bound_to
    }

    /// Drops the inputs staged for the next launch and not yet copied (see
    /// [`Backend::discard_staged_inputs`]).
    pub fn discard_staged_inputs(&self) {
        self.backend.discard_staged_inputs()
    }

    /// Fills the arena with `byte` (for tests that prove no kernel reads arena bytes it did not
    /// write first: 0xFF makes every such f32 a NaN).
    #[cfg(feature = "test-hooks")]
    pub fn fill_arena(&mut self, byte: u8) -> Result<(), RuntimeError> {
        self.acquire_arena()?;
        self.backend.synchronize()?;
        for a in self.arena.iter().flatten() {
            let slice = Slice {
                buffer: a,
                offset: 0,
                len: a.len_bytes(),
            };
            self.backend.upload(slice, &vec![byte; a.len_bytes()])?;
        }
        Ok(())
    }

    /// Switches to another graph and plan of the same model (another micro-batch, remat or
    /// passes), keeping every persistent buffer whose tensor has the same name and size (the
    /// parameters and optimizer state, so training continues from them untouched) and
    /// allocating the rest. The arena is released first and taken at the next run. On an
    /// allocation failure the session keeps its old graph and plan and every buffer it had.
    pub fn replan(&mut self, graph: Graph, plan: MemoryPlan) -> Result<(), RuntimeError> {
        self.backend.check(&graph)?;
        self.backend.synchronize()?;
        self.bound.clear();
        self.bound_to.clear();
        self.arena = None;
        let mut old: HashMap<String, (usize, Buffer)> = HashMap::new();
        for (i, slot) in self.persistent.iter_mut().enumerate() {
            if let Some(buf) = slot.take() {
                old.insert(self.graph.tensors()[i].name.clone(), (i, buf));
            }
        }
        let mut persistent: Vec<Option<Buffer>> =
            (0..graph.tensors().len()).map(|_| None).collect();
        let mut moved = Vec::new();
        let mut failure = None;
        for p in &plan.persistent {
            let name = &graph.tensor(p.tensor).name;
            match old.remove(name) {
                Some((i, buf)) if buf.len_bytes() == p.size => {
                    moved.push((p.tensor, i));
                    persistent[p.tensor.index()] = Some(buf);
                }
                other => {
                    if let Some((i, buf)) = other {
                        old.insert(name.clone(), (i, buf));
                    }
                    match self.backend.allocator().alloc(p.size) {
                        Ok(buf) => persistent[p.tensor.index()] = Some(buf),
                        Err(e) => {
                            failure = Some(e);
                            break;
                        }
                    }
                }
            }
        }
        if let Some(e) = failure {
            // Put every kept buffer back where the old graph had it.
            for (new, i) in moved {
                self.persistent[i] = persistent[new.index()].take();
            }
            for (_, (i, buf)) in old {
                self.persistent[i] = Some(buf);
            }
            return Err(e.into());
        }
        drop(old);
        self.graph = graph;
        self.plan = plan;
        self.persistent = persistent;
        Ok(())
    }

    /// Where a tensor's bytes are: its storage root's buffer or arena slot, plus the view
    /// offset. `None` for an arena tensor while the arena is released.
    fn slice(&self, id: TensorId) -> Option<Slice<'_>> {
        let mut elem_offset = 0;
        let mut t = id;
        while let Some(v) = self.graph.tensor(t).view_of {
            elem_offset += v.offset_elems;
            t = v.base;
        }
        let meta = self.graph.tensor(id);
        let view = elem_offset * meta.dtype.size_bytes();
        let (buffer, base) = match (&self.persistent[t.index()], self.plan.arena_slot(t)) {
            (Some(buf), _) => (buf, 0),
            (None, Some((chunk, off))) => (self.arena.as_ref()?.get(chunk)?, off),
            // Every storage the schedule uses is planned (`MemoryPlan` checks it).
            (None, None) => return None,
        };
        Some(Slice {
            buffer,
            offset: base + view,
            len: meta.size_bytes(),
        })
    }

    fn binding(&self, id: TensorId) -> Result<Binding<'_>, RuntimeError> {
        let meta = self.graph.tensor(id);
        let slice = self.slice(id).ok_or_else(|| RuntimeError::Released {
            name: meta.name.clone(),
        })?;
        Ok(Binding { slice, meta })
    }

    fn bind_all(&self) -> Result<Vec<B::Bound>, RuntimeError> {
        let mut bound = Vec::with_capacity(self.plan.schedule.len());
        for &nid in &self.plan.schedule {
            let node = self.graph.node(nid);
            let args = NodeArgs {
                inputs: node
                    .inputs
                    .iter()
                    .map(|&t| self.binding(t))
                    .collect::<Result<_, _>>()?,
                outputs: node
                    .outputs
                    .iter()
                    .map(|&t| self.binding(t))
                    .collect::<Result<_, _>>()?,
                workspace: node.workspace.map(|t| self.binding(t)).transpose()?,
            };
            bound.push(self.backend.bind(&self.graph, node, args)?);
        }
        Ok(bound)
    }

    /// Runs every node of the schedule once (taking the arena first if it was released).
    pub fn run(&mut self, ctx: ExecCtx) -> Result<(), RuntimeError> {
        self.acquire_arena()?;
        self.backend.launch(&self.bound, None, ctx, None)
    }

    /// The nodes that `targets` depend on, as a mask in schedule order, for
    /// [`Session::run_only`]. For a step graph and its loss, that is the forward pass.
    pub fn nodes_for(&self, targets: &[TensorId]) -> Vec<bool> {
        let mut needed = vec![false; self.graph.nodes().len()];
        let mut stack: Vec<TensorId> = targets.to_vec();
        let mut seen = vec![false; self.graph.tensors().len()];
        while let Some(t) = stack.pop() {
            if std::mem::replace(&mut seen[t.index()], true) {
                continue;
            }
            if let Some(n) = self.graph.producer(t) {
                if !std::mem::replace(&mut needed[n.index()], true) {
                    stack.extend(self.graph.node(n).inputs.iter().copied());
                }
            }
        }
        self.plan
            .schedule
            .iter()
            .map(|n| needed[n.index()])
            .collect()
    }

    /// Runs the nodes of the schedule that `mask` (from [`Session::nodes_for`]) selects, in
    /// schedule order. The plan stays valid: each skipped node only shortens lifetimes. Values
    /// of the targets are readable afterwards, as after a full run; in-place updates outside the
    /// mask do not happen, so evaluating a loss this way leaves the training state untouched.
    pub fn run_only(&mut self, ctx: ExecCtx, mask: &[bool]) -> Result<(), RuntimeError> {
        self.acquire_arena()?;
        self.backend.launch(&self.bound, Some(mask), ctx, None)
    }

    /// Runs the schedule once, timing every node (seconds, in schedule order).
    pub fn run_profiled(&mut self, ctx: ExecCtx) -> Result<Vec<f64>, RuntimeError> {
        self.acquire_arena()?;
        let mut times = Vec::with_capacity(self.bound.len());
        self.backend
            .launch(&self.bound, None, ctx, Some(&mut times))?;
        Ok(times)
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn allocator(&self) -> &crate::Allocator {
        self.backend.allocator()
    }

    fn check(&self, id: TensorId, dtype: DType, len: usize) -> Result<(), RuntimeError> {
        let meta = self.graph.try_tensor(id)?;
        if meta.dtype != dtype {
            return Err(RuntimeError::WrongDType {
                name: meta.name.clone(),
                expected: meta.dtype,
                found: dtype,
            });
        }
        if meta.numel() != len {
            return Err(RuntimeError::SizeMismatch {
                name: meta.name.clone(),
                expected: meta.numel(),
                got: len,
            });
        }
        Ok(())
    }

    /// Checks `id` may be written, taking the arena if it lives there, and waits for the
    /// device (a launched node may still read the bytes about to change) unless `id` is an
    /// input the backend stages for the next launch. Returns whether it is staged.
    fn writable(&mut self, id: TensorId) -> Result<bool, RuntimeError> {
        let meta = self.graph.tensor(id);
        if !(meta.role == Role::Input || meta.role.is_persistent()) {
            return Err(RuntimeError::NotWritable {
                name: meta.name.clone(),
            });
        }
        let staged = meta.role == Role::Input && self.backend.stages_inputs();
        if self.persistent[self.graph.storage_root(id).index()].is_none() {
            self.acquire_arena()?;
        }
        if !staged {
            self.backend.synchronize()?;
        }
        Ok(staged)
    }

    fn upload(&self, id: TensorId, staged: bool, bytes: &[u8]) -> Result<(), RuntimeError> {
        let slice = self.binding(id)?.slice;
        if staged {
            self.backend.upload_input(slice, bytes)
        } else {
            self.backend.upload(slice, bytes)
        }
    }

    /// Writes a parameter, optimizer state or input (before [`Session::run`]).
    pub fn write_f32(&mut self, id: TensorId, data: &[f32]) -> Result<(), RuntimeError> {
        self.check(id, DType::F32, data.len())?;
        let staged = self.writable(id)?;
        self.upload(id, staged, bytemuck::cast_slice(data))
    }

    /// Writes a u8 persistent tensor (8-bit optimizer state) from a checkpoint.
    pub fn write_u8(&mut self, id: TensorId, data: &[u8]) -> Result<(), RuntimeError> {
        self.check(id, DType::U8, data.len())?;
        self.write_bytes(id, data)
    }

    /// Writes a tensor of any dtype from its bytes (a frozen weight stored quantized).
    pub fn write_bytes(&mut self, id: TensorId, data: &[u8]) -> Result<(), RuntimeError> {
        let meta = self.graph.try_tensor(id)?;
        if meta.size_bytes() != data.len() {
            return Err(RuntimeError::SizeMismatch {
                name: meta.name.clone(),
                expected: meta.size_bytes(),
                got: data.len(),
            });
        }
        self.writable(id)?;
        let slice = self.binding(id)?.slice;
        self.backend.upload(slice, data)
    }

    /// Reads a u8 persistent tensor (8-bit optimizer state), as [`Session::read_f32`].
    pub fn read_u8(&self, id: TensorId) -> Result<Cow<'_, [u8]>, RuntimeError> {
        let meta = self.readable(id)?;
        self.check(id, DType::U8, meta.numel())?;
        let slice = self.binding(id)?.slice;
        self.backend.synchronize()?;
        if self.backend.allocator().is_host() {
            // SAFETY: as `read_f32`: `numel` bytes, nothing running, borrowed with `self`.
            return Ok(Cow::Borrowed(unsafe {
                std::slice::from_raw_parts(slice.buffer.as_ptr().add(slice.offset), meta.numel())
            }));
        }
        let mut out = vec![0u8; meta.numel()];
        self.backend.download(slice, &mut out)?;
        Ok(Cow::Owned(out))
    }

    /// A persistent tensor's bytes, whatever its dtype (after [`Session::run`]).
    pub fn read_bytes(&self, id: TensorId) -> Result<Vec<u8>, RuntimeError> {
        let meta = self.readable(id)?;
        let slice = self.binding(id)?.slice;
        self.backend.synchronize()?;
        let mut out = vec![0u8; meta.size_bytes()];
        self.backend.download(slice, &mut out)?;
        Ok(out)
    }

    /// `id`'s metadata, where it is a persistent tensor (the only kind kept between runs).
    fn readable(&self, id: TensorId) -> Result<&TensorMeta, RuntimeError> {
        let meta = self.graph.try_tensor(id)?;
        if !meta.role.is_persistent() {
            return Err(RuntimeError::NotReadable {
                name: meta.name.clone(),
            });
        }
        Ok(meta)
    }

    /// Writes token ids, checking each is below `bound` (an embedding's vocabulary).
    pub fn write_i32(
        &mut self,
        id: TensorId,
        data: &[i32],
        bound: usize,
    ) -> Result<(), RuntimeError> {
        self.check(id, DType::I32, data.len())?;
        self.check_range(id, data, bound)?;
        let staged = self.writable(id)?;
        self.upload(id, staged, bytemuck::cast_slice(data))
    }

    /// Fills an i32 input with `fill`, then checks every value is below `bound`. On host
    /// memory it fills the tensor in place (no staging buffer).
    pub fn fill_i32(
        &mut self,
        id: TensorId,
        bound: usize,
        fill: impl FnOnce(&mut [i32]),
    ) -> Result<(), RuntimeError> {
        let n = self.graph.try_tensor(id)?.numel();
        self.check(id, DType::I32, n)?;
        let staged = self.writable(id)?;
        let slice = self.binding(id)?.slice;
        if self.backend.allocator().is_host() && !staged {
            // SAFETY: host memory the session owns holds the tensor's `n` i32s at this offset,
            // aligned (the plan aligns every tensor), and the device is idle (synchronized).
            let slot = unsafe {
                std::slice::from_raw_parts_mut(
                    slice.buffer.as_ptr().add(slice.offset) as *mut i32,
                    n,
                )
            };
            fill(slot);
            return self.check_range(id, slot, bound);
        }
        let mut values = vec![0i32; n];
        fill(&mut values);
        self.check_range(id, &values, bound)?;
        self.upload(id, staged, bytemuck::cast_slice(&values))
    }

    /// Token ids must index an embedding of `bound` rows.
    fn check_range(&self, id: TensorId, data: &[i32], bound: usize) -> Result<(), RuntimeError> {
        match data.iter().position(|&v| v < 0 || v as usize >= bound) {
            None => Ok(()),
            Some(index) => Err(RuntimeError::OutOfRange {
                name: self.graph.tensor(id).name.clone(),
                index,
                value: data[index],
                bound,
            }),
        }
    }

    /// Reads a persistent tensor or a graph output (after [`Session::run`]): borrowed where
    /// the device's memory is the host's, copied back otherwise.
    pub fn read_f32(&self, id: TensorId) -> Result<Cow<'_, [f32]>, RuntimeError> {
        let meta = self.graph.try_tensor(id)?;
        let root = self.graph.storage_root(id);
        let readable = meta.role.is_persistent()
            || self
                .graph
                .outputs()
                .iter()
                .any(|&o| self.graph.storage_root(o) == root);
        if !readable {
            return Err(RuntimeError::NotReadable {
                name: meta.name.clone(),
            });
        }
        self.check(id, DType::F32, meta.numel())?;
        let slice = self.binding(id)?.slice;
        self.backend.synchronize()?;
        if self.backend.allocator().is_host() {
            // SAFETY: the storage holds `numel` aligned f32s and nothing runs (synchronized);
            // the borrow of `self` keeps every writer away until it ends.
            return Ok(Cow::Borrowed(unsafe {
                std::slice::from_raw_parts(
                    slice.buffer.as_ptr().add(slice.offset) as *const f32,
                    meta.numel(),
                )
            }));
        }
        let mut out = vec![0f32; meta.numel()];
        self.backend
            .download(slice, bytemuck::cast_slice_mut(&mut out))?;
        Ok(Cow::Owned(out))
    }
}
