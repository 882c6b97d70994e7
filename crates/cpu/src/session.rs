//! The CPU executor: one arena per plan, one buffer per persistent tensor, and a precomputed
//! binding per node, so a step allocates nothing.
//!
//! The arena holds nothing between steps, so a trainer gives it back to the allocator's cache
//! after each micro-batch ([`CpuSession::release_arena`]) and the next run takes it again: a
//! cache hit, no system call, no zeroing. That makes a lowered memory limit bite at the next
//! micro-batch, as a typed out-of-memory error before any kernel runs, and lets a session be
//! re-planned ([`CpuSession::replan`]) keeping its parameters and optimizer state in place.

use snug_graph::{DType, Graph, Role, TensorId};
use snug_plan::MemoryPlan;
use snug_runtime::{Allocator, Buffer, ExecCtx, RuntimeError};

use crate::kernel::{Kernel, TensorArg};

/// Physical cores of this machine (hyper-threads share FPUs, so GEMM gains nothing from them).
pub fn physical_cores() -> usize {
    num_cpus::get_physical().max(1)
}

/// 16-bit floats are storage only: casts convert them and views look into them; every other
/// kernel reads and writes f32 (or i32 token ids).
fn check_dtypes(graph: &Graph) -> Result<(), RuntimeError> {
    for node in graph.nodes() {
        let casts_or_views = matches!(node.op, snug_graph::ops::Op::Cast(_)) || graph.is_view(node);
        for &t in node.inputs.iter().chain(&node.outputs) {
            let m = graph.tensor(t);
            if !matches!(m.dtype, DType::F32 | DType::I32) && !casts_or_views {
                return Err(RuntimeError::UnsupportedDType {
                    name: m.name.clone(),
                    dtype: m.dtype,
                });
            }
        }
    }
    for t in graph.tensors() {
        if t.role.is_persistent() && t.view_of.is_none() && t.dtype != DType::F32 {
            return Err(RuntimeError::UnsupportedDType {
                name: t.name.clone(),
                dtype: t.dtype,
            });
        }
    }
    Ok(())
}

struct NodeBinding {
    node: usize,
    inputs: Vec<TensorArg>,
    outputs: Vec<TensorArg>,
    workspace: Option<TensorArg>,
}

/// A planned graph, loaded into memory and ready to run step after step.
pub struct CpuSession {
    graph: Graph,
    plan: MemoryPlan,
    allocator: Allocator,
    /// `None` between steps once released.
    arena: Option<Buffer>,
    /// The arena address `bindings` were computed for.
    bound_to: usize,
    /// Indexed by tensor id; `Some` for persistent storage roots.
    persistent: Vec<Option<Buffer>>,
    bindings: Vec<NodeBinding>,
    pool: rayon::ThreadPool,
}

impl CpuSession {
    /// Allocates the arena and every persistent buffer through `allocator`.
    pub fn new(
        graph: Graph,
        plan: MemoryPlan,
        allocator: Allocator,
        threads: usize,
    ) -> Result<Self, RuntimeError> {
        check_dtypes(&graph)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("snug-cpu-{i}"))
            .build()
            .map_err(|e| RuntimeError::Threads {
                threads,
                reason: e.to_string(),
            })?;
        let mut persistent: Vec<Option<Buffer>> =
            (0..graph.tensors().len()).map(|_| None).collect();
        for p in &plan.persistent {
            persistent[p.tensor.index()] = Some(allocator.alloc(p.size)?);
        }
        let arena = allocator.alloc(plan.arena_bytes)?;
        let mut session = CpuSession {
            graph,
            plan,
            allocator,
            arena: Some(arena),
            bound_to: 0,
            persistent,
            bindings: Vec::new(),
            pool,
        };
        session.acquire_arena()?;
        Ok(session)
    }

    /// Takes the arena (from the allocator's cache, as a rule) if it was released, and points
    /// the node bindings at it. Fails, changing nothing, if the memory limit refuses it.
    pub fn acquire_arena(&mut self) -> Result<(), RuntimeError> {
        if self.arena.is_none() {
            // The schedule writes every arena tensor before reading it, so old bytes are fine.
            self.arena = Some(self.allocator.alloc_uninit(self.plan.arena_bytes)?);
        }
        let ptr = self.arena.as_ref().map_or(0, |a| a.as_ptr() as usize);
        if ptr != self.bound_to {
            self.bindings = self.bind_all();
            self.bound_to = ptr;
        }
        Ok(())
    }

    /// Gives the arena back to the allocator (its cache) until the next run or write. Values
    /// that lived in it, the loss included, are unreadable afterwards.
    pub fn release_arena(&mut self) {
        self.arena = None;
    }

    pub fn holds_arena(&self) -> bool {
        self.arena.is_some()
    }

    /// Fills the arena with `byte` (for tests that prove no kernel reads arena bytes it did not
    /// write first: 0xFF makes every such f32 a NaN).
    #[doc(hidden)]
    pub fn fill_arena(&mut self, byte: u8) -> Result<(), RuntimeError> {
        self.acquire_arena()?;
        if let Some(a) = &self.arena {
            // SAFETY: the arena owns `len_bytes` bytes and no kernel is running.
            unsafe { std::ptr::write_bytes(a.as_ptr(), byte, a.len_bytes()) };
        }
        Ok(())
    }

    /// Switches to another graph and plan of the same model (another micro-batch, remat or
    /// passes), keeping every persistent buffer whose tensor has the same name and size (the
    /// parameters and optimizer state, so training continues from them untouched) and
    /// allocating the rest. The arena is released first and taken at the next run. On an
    /// allocation failure the session keeps its old graph and plan and every buffer it had.
    pub fn replan(&mut self, graph: Graph, plan: MemoryPlan) -> Result<(), RuntimeError> {
        check_dtypes(&graph)?;
        self.arena = None;
        let mut old: std::collections::HashMap<String, (usize, Buffer)> = Default::default();
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
                    match self.allocator.alloc(p.size) {
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
        self.bound_to = 0;
        self.bindings.clear();
        Ok(())
    }

    fn arg(&self, id: TensorId) -> TensorArg {
        let meta = self.graph.tensor(id);
        let ptr = self.data_ptr(id);
        // SAFETY: `data_ptr` points inside a buffer this session owns for its whole life, with
        // room for the tensor (the plan sized it).
        unsafe { TensorArg::new(ptr, meta.numel(), meta.shape.clone(), meta.dtype) }
    }

    /// Start of a tensor's bytes: its storage root's buffer or arena slot, plus the view offset.
    fn data_ptr(&self, id: TensorId) -> *mut u8 {
        let mut elem_offset = 0;
        let mut t = id;
        while let Some(v) = self.graph.tensor(t).view_of {
            elem_offset += v.offset_elems;
            t = v.base;
        }
        let base = match (
            &self.persistent[t.index()],
            self.plan.arena_offset(t),
            &self.arena,
        ) {
            (Some(buf), _, _) => buf.as_ptr(),
            // SAFETY: the plan placed this storage inside the arena.
            (None, Some(off), Some(arena)) => unsafe { arena.as_ptr().add(off) },
            // Callers acquire the arena first (or, for reads, check it is held).
            (None, Some(_), None) => unreachable!("arena tensor used while the arena is released"),
            (None, None, _) => unreachable!("every storage used by the schedule is planned"),
        };
        let width = self.graph.tensor(id).dtype.size_bytes();
        // SAFETY: views stay inside their base (checked by their shape rules).
        unsafe { base.add(elem_offset * width) }
    }

    fn bind_all(&self) -> Vec<NodeBinding> {
        self.plan
            .schedule
            .iter()
            .map(|&nid| {
                let node = self.graph.node(nid);
                NodeBinding {
                    node: nid.index(),
                    inputs: node.inputs.iter().map(|&t| self.arg(t)).collect(),
                    outputs: node.outputs.iter().map(|&t| self.arg(t)).collect(),
                    workspace: node.workspace.map(|t| self.arg(t)),
                }
            })
            .collect()
    }

    /// Runs every node of the schedule once (taking the arena first if it was released).
    pub fn run(&mut self, ctx: ExecCtx) -> Result<(), RuntimeError> {
        self.acquire_arena()?;
        self.execute(ctx, None, None);
        Ok(())
    }

    /// The nodes that `targets` depend on, as a mask in schedule order, for
    /// [`CpuSession::run_only`]. For a step graph and its loss, that is the forward pass.
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

    /// Runs the nodes of the schedule that `mask` (from [`CpuSession::nodes_for`]) selects, in
    /// schedule order. The plan stays valid: each skipped node only shortens lifetimes. Values
    /// of the targets are readable afterwards, as after a full run; in-place updates outside the
    /// mask do not happen, so evaluating a loss this way leaves the training state untouched.
    pub fn run_only(&mut self, ctx: ExecCtx, mask: &[bool]) -> Result<(), RuntimeError> {
        self.acquire_arena()?;
        self.execute(ctx, None, Some(mask));
        Ok(())
    }

    /// Runs the schedule once, timing every node (seconds, in schedule order).
    pub fn run_profiled(&mut self, ctx: ExecCtx) -> Result<Vec<f64>, RuntimeError> {
        self.acquire_arena()?;
        let mut times = Vec::with_capacity(self.bindings.len());
        self.execute(ctx, Some(&mut times), None);
        Ok(times)
    }

    fn execute(&self, ctx: ExecCtx, mut times: Option<&mut Vec<f64>>, mask: Option<&[bool]>) {
        let graph = &self.graph;
        self.pool.install(|| {
            for (i, b) in self.bindings.iter().enumerate() {
                if mask.is_some_and(|m| !m.get(i).copied().unwrap_or(false)) {
                    continue;
                }
                let node = &graph.nodes()[b.node];
                let start = times.is_some().then(std::time::Instant::now);
                // SAFETY: the plan gives coexisting tensors disjoint bytes; views (whose output
                // aliases the input) have kernels that touch nothing; an in-place node's output
                // is its input's storage, which the kernel reads only through the output.
                let kernel = unsafe {
                    Kernel::new(
                        &b.inputs,
                        &b.outputs,
                        b.workspace.as_ref(),
                        node.op.mutates_inputs(),
                        node.inplace,
                        ctx,
                    )
                };
                crate::kernels::run(&node.op, &kernel);
                if let (Some(times), Some(start)) = (times.as_deref_mut(), start) {
                    times.push(start.elapsed().as_secs_f64());
                }
            }
        });
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    pub fn allocator(&self) -> &Allocator {
        &self.allocator
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
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

    /// Checks `id` may be written, taking the arena if it lives there.
    fn writable(&mut self, id: TensorId) -> Result<(), RuntimeError> {
        let meta = self.graph.tensor(id);
        if !(meta.role == Role::Input || meta.role.is_persistent()) {
            return Err(RuntimeError::NotWritable {
                name: meta.name.clone(),
            });
        }
        if self.persistent[self.graph.storage_root(id).index()].is_none() {
            self.acquire_arena()?;
        }
        Ok(())
    }

    /// Writes a parameter, optimizer state or input (before [`CpuSession::run`]).
    pub fn write_f32(&mut self, id: TensorId, data: &[f32]) -> Result<(), RuntimeError> {
        self.check(id, DType::F32, data.len())?;
        self.writable(id)?;
        // SAFETY: the tensor's storage holds `data.len()` f32s and nothing runs concurrently.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.data_ptr(id) as *mut f32, data.len())
        };
        Ok(())
    }

    /// Writes token ids, checking each is below `bound` (an embedding's vocabulary).
    pub fn write_i32(
        &mut self,
        id: TensorId,
        data: &[i32],
        bound: usize,
    ) -> Result<(), RuntimeError> {
        self.check(id, DType::I32, data.len())?;
        self.writable(id)?;
        self.check_range(id, data, bound)?;
        // SAFETY: as in `write_f32`.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.data_ptr(id) as *mut i32, data.len())
        };
        Ok(())
    }

    /// Fills an i32 input in place with `fill` (no staging buffer), then checks every value is
    /// below `bound`.
    pub fn fill_i32(
        &mut self,
        id: TensorId,
        bound: usize,
        fill: impl FnOnce(&mut [i32]),
    ) -> Result<(), RuntimeError> {
        let meta = self.graph.try_tensor(id)?;
        let n = meta.numel();
        self.check(id, DType::I32, n)?;
        self.writable(id)?;
        // SAFETY: the storage holds `n` i32s and nothing runs concurrently.
        let slot = unsafe { std::slice::from_raw_parts_mut(self.data_ptr(id) as *mut i32, n) };
        fill(slot);
        self.check_range(id, slot, bound)
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

    /// Reads a persistent tensor or a graph output (after [`CpuSession::run`]).
    pub fn read_f32(&self, id: TensorId) -> Result<&[f32], RuntimeError> {
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
        if self.persistent[root.index()].is_none() && self.arena.is_none() {
            return Err(RuntimeError::Released {
                name: meta.name.clone(),
            });
        }
        self.check(id, DType::F32, meta.numel())?;
        // SAFETY: the storage holds `numel` f32s and stays untouched until the next run.
        Ok(unsafe { std::slice::from_raw_parts(self.data_ptr(id) as *const f32, meta.numel()) })
    }
}
