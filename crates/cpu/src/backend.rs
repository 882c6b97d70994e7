//! The CPU as a [`Backend`]: host memory, a pool of worker threads, and every op's kernel
//! from [`crate::kernels`], run in schedule order as they are launched (so a launch has
//! finished when it returns). [`CpuSession`] is the runtime's session over it.

use std::ops::{Deref, DerefMut};

use snug_graph::ops::Op;
use snug_graph::{DType, Graph, Node, Role, Target};
use snug_plan::MemoryPlan;
use snug_runtime::{
    Allocator, Backend, Binding, Device, ExecCtx, NodeArgs, RuntimeError, Session, Slice,
};

use crate::kernel::{Kernel, TensorArg};

/// Physical cores this process may run on (hyper-threads share FPUs, so GEMM gains nothing
/// from them): the machine's cores among the CPUs its affinity allows (`taskset`, a Slurm job's
/// or a container's cpuset), and no more than the CPUs its quota grants (a container's
/// `--cpus`), which [`std::thread::available_parallelism`] reports. The default worker count.
pub fn physical_cores() -> usize {
    let usable = std::thread::available_parallelism().map_or(1, |n| n.get());
    let physical = allowed_physical_cores().unwrap_or_else(num_cpus::get_physical);
    physical.min(usable).max(1)
}

/// How many ranks of this machine's job, this one included, run on this process's CPUs:
/// the ranks started on the machine (`OMPI_COMM_WORLD_LOCAL_SIZE`, or MPICH's
/// `MPI_LOCALNRANKS`; 1 outside mpirun) that [`ranks_sharing`] judges to share them.
pub fn ranks_sharing_cpus() -> usize {
    let local = ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]
        .iter()
        .find_map(|key| std::env::var(key).ok()?.trim().parse::<usize>().ok())
        .unwrap_or(1);
    let (allowed, pool) = cpu_counts().unwrap_or((1, 1));
    ranks_sharing(local, allowed, pool)
}

/// Of `local` ranks on one machine, each allowed `allowed` of a `pool` of CPUs, how many run
/// on this rank's CPUs, judged from its share of the pool: all of it (`mpirun --bind-to
/// none`), every rank; a part (ranks bound to a package each, or to a core), as many ranks as
/// such parts fit in the pool: `allowed / (pool / local)`, rounded, 1 to `local`.
pub fn ranks_sharing(local: usize, allowed: usize, pool: usize) -> usize {
    let local = local.max(1);
    (allowed * local + pool / 2)
        .checked_div(pool)
        .unwrap_or(1)
        .clamp(1, local)
}

/// CPUs this process's affinity allows, and the pool they are drawn from: the CPUs of its
/// container's cpuset where that can be read (cgroup v2 `cpuset.cpus.effective`, v1
/// `cpuset.effective_cpus`), else the machine's online CPUs. Equal where nothing (`taskset`,
/// an mpirun binding) holds the process to part of what it could run on. None where the
/// affinity cannot be read.
pub fn cpu_counts() -> Option<(usize, usize)> {
    #[cfg(target_os = "linux")]
    {
        let set = affinity()?;
        // SAFETY: `CPU_COUNT` reads a set `sched_getaffinity` filled.
        let allowed = usize::try_from(unsafe { libc::CPU_COUNT(&set) }).ok()?;
        let pool = [
            "/sys/fs/cgroup/cpuset.cpus.effective",
            "/sys/fs/cgroup/cpuset/cpuset.effective_cpus",
            "/sys/devices/system/cpu/online",
        ]
        .iter()
        .find_map(|path| cpu_list_len(&std::fs::read_to_string(path).ok()?))?;
        Some((allowed, pool.max(allowed)))
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// CPUs in a kernel CPU list (`0-3,8,10-11`); None if it is not one or is empty.
pub fn cpu_list_len(list: &str) -> Option<usize> {
    let mut n = 0usize;
    for part in list.trim().split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
        n += b.checked_sub(a)? + 1;
    }
    (n > 0).then_some(n)
}

/// The CPUs this process's affinity allows; None where it cannot be read.
#[cfg(target_os = "linux")]
fn affinity() -> Option<libc::cpu_set_t> {
    // SAFETY: a zeroed `cpu_set_t` is a valid empty set, and `sched_getaffinity` writes at
    // most its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        (libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0)
            .then_some(set)
    }
}

/// Distinct (package, core) pairs among the CPUs this process's affinity allows, from sysfs's
/// topology; None where either cannot be read.
#[cfg(target_os = "linux")]
fn allowed_physical_cores() -> Option<usize> {
    let set = affinity()?;
    // SAFETY: `CPU_ISSET` reads the set at an index below `CPU_SETSIZE`.
    let allowed =
        (0..libc::CPU_SETSIZE as usize).filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) });
    count_cores(allowed, |cpu| {
        let read = |name: &str| {
            std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu{cpu}/topology/{name}"))
                .ok()?
                .trim()
                .parse::<i64>()
                .ok()
        };
        Some((read("physical_package_id")?, read("core_id")?))
    })
}

#[cfg(not(target_os = "linux"))]
fn allowed_physical_cores() -> Option<usize> {
    None
}

/// The distinct cores of `cpus`, given each one's (package, core); None if any is unknown.
#[cfg(any(target_os = "linux", test))]
fn count_cores(
    cpus: impl Iterator<Item = usize>,
    core_of: impl Fn(usize) -> Option<(i64, i64)>,
) -> Option<usize> {
    let mut cores = std::collections::BTreeSet::new();
    for cpu in cpus {
        cores.insert(core_of(cpu)?);
    }
    (!cores.is_empty()).then_some(cores.len())
}

/// Host memory, `threads` workers, and the GEMM this CPU runs.
pub struct CpuBackend {
    allocator: Allocator,
    pool: rayon::ThreadPool,
    target: Target,
    /// This process's part of the CPUs it may use, where other ranks of its job run on them
    /// too, when the backend was made: its workers poll between regions only within it.
    cpus: usize,
}

impl CpuBackend {
    /// `threads` workers drawing memory from `allocator` (host memory).
    pub fn new(allocator: Allocator, threads: usize) -> Result<Self, RuntimeError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("snug-cpu-{i}"))
            .build()
            .map_err(|e| RuntimeError::Threads {
                threads,
                reason: e.to_string(),
            })?;
        Ok(CpuBackend {
            allocator,
            pool,
            target: Target::host(threads),
            cpus: {
                let usable = std::thread::available_parallelism().map_or(1, |n| n.get());
                (usable / ranks_sharing_cpus()).max(1)
            },
        })
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }
}

/// One node bound to host memory.
pub struct CpuNode {
    op: Op,
    inputs: Vec<TensorArg>,
    outputs: Vec<TensorArg>,
    workspace: Option<TensorArg>,
    inplace: Option<usize>,
}

fn arg(b: &Binding<'_>) -> TensorArg {
    // SAFETY: the session keeps the buffer alive and unmoved for as long as this binding
    // (its contract), and the slice lies inside it, aligned by the plan.
    unsafe {
        TensorArg::new(
            b.slice.buffer.as_ptr().add(b.slice.offset),
            b.meta.numel(),
            b.meta.shape.clone(),
            b.meta.dtype,
        )
    }
}

impl Backend for CpuBackend {
    type Bound = CpuNode;

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn target(&self) -> Target {
        self.target
    }

    fn allocator(&self) -> &Allocator {
        &self.allocator
    }

    fn check(&self, graph: &Graph) -> Result<(), RuntimeError> {
        check_dtypes(graph)?;
        check_world(graph)
    }

    fn bind(
        &self,
        _graph: &Graph,
        node: &Node,
        args: NodeArgs<'_>,
    ) -> Result<CpuNode, RuntimeError> {
        Ok(CpuNode {
            op: node.op.clone(),
            inputs: args.inputs.iter().map(arg).collect(),
            outputs: args.outputs.iter().map(arg).collect(),
            workspace: args.workspace.as_ref().map(arg),
            inplace: node.inplace,
        })
    }

    fn launch(
        &self,
        nodes: &[CpuNode],
        selected: Option<&[bool]>,
        ctx: ExecCtx,
        mut times: Option<&mut Vec<f64>>,
    ) -> Result<(), RuntimeError> {
        self.pool.install(|| {
            let _awake = crate::par::KeepAwake::start(self.cpus);
            for (i, n) in nodes.iter().enumerate() {
                if selected.is_some_and(|m| !m.get(i).copied().unwrap_or(false)) {
                    continue;
                }
                let start = times.is_some().then(std::time::Instant::now);
                // SAFETY: the plan gives coexisting tensors disjoint bytes; views (whose output
                // aliases the input) have kernels that touch nothing; an in-place node's output
                // is its input's storage, which the kernel reads only through the output.
                let kernel = unsafe {
                    Kernel::new(
                        &n.inputs,
                        &n.outputs,
                        n.workspace.as_ref(),
                        n.op.mutates_inputs(),
                        n.inplace,
                        ctx,
                    )
                };
                crate::kernels::run(&n.op, &kernel);
                crate::kernels::collective::progress();
                if let (Some(times), Some(start)) = (times.as_deref_mut(), start) {
                    times.push(start.elapsed().as_secs_f64());
                }
            }
        });
        Ok(())
    }

    /// Kernels have finished when `launch` returns.
    fn synchronize(&self) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn upload(&self, dst: Slice<'_>, bytes: &[u8]) -> Result<(), RuntimeError> {
        let n = dst.len.min(bytes.len());
        // SAFETY: the slice lies inside a live host buffer and nothing runs (launch returned).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.buffer.as_ptr().add(dst.offset), n)
        };
        Ok(())
    }

    fn download(&self, src: Slice<'_>, out: &mut [u8]) -> Result<(), RuntimeError> {
        let n = src.len.min(out.len());
        // SAFETY: as in `upload`.
        unsafe {
            std::ptr::copy_nonoverlapping(src.buffer.as_ptr().add(src.offset), out.as_mut_ptr(), n)
        };
        Ok(())
    }
}

/// 16-bit floats are storage only: casts convert them and views look into them; every other
/// kernel reads and writes f32 (or i32 token ids).
/// A step's collectives were compiled for a number of ranks; this process's world must be that
/// size, or the step is refused at load rather than failing inside a kernel.
fn check_world(graph: &Graph) -> Result<(), RuntimeError> {
    let (_, size) = crate::kernels::collective::world();
    for node in graph.nodes() {
        let ranks = match &node.op {
            Op::AllReduce(op) => op.ranks,
            Op::ReduceScatter(op) => op.ranks,
            Op::AllGather(op) => op.ranks,
            Op::ShardedAdamW(op) => op.ranks,
            Op::CollectiveStart(op) => op.op.ranks(),
            Op::CollectiveWait(op) => op.op.ranks(),
            _ => continue,
        };
        if ranks != size {
            return Err(RuntimeError::UnsupportedOp {
                device: "cpu".into(),
                op: node.op.name(),
                detail: format!(
                    "the step was compiled for {ranks} ranks and this process's world has {size}"
                ),
            });
        }
    }
    Ok(())
}

fn check_dtypes(graph: &Graph) -> Result<(), RuntimeError> {
    for node in graph.nodes() {
        // A quantized frozen weight is read only through its dequantization.
        let casts_or_views = matches!(
            node.op,
            Op::Cast(_) | Op::Dequantize(_) | Op::QuantizedRead(_) | Op::HalfIo(_)
        ) || graph.is_view(node);
        // 8-bit AdamW reads and writes its quantized moments itself.
        let quantized_state = matches!(node.op, Op::AdamW8bit(_));
        for &t in node.inputs.iter().chain(&node.outputs) {
            let m = graph.tensor(t);
            let u8_state = quantized_state && m.dtype == DType::U8;
            if !matches!(m.dtype, DType::F32 | DType::I32) && !casts_or_views && !u8_state {
                return Err(RuntimeError::UnsupportedDType {
                    name: m.name.clone(),
                    dtype: m.dtype,
                });
            }
        }
    }
    for t in graph.tensors() {
        // Frozen weights may be stored in bf16 or as u8 codes, 8-bit AdamW's moments as u8
        // codes; everything else persistent is f32.
        let stored = t.dtype == DType::F32
            || (t.role == Role::Parameter && matches!(t.dtype, DType::BF16 | DType::U8))
            || (t.role == Role::OptimizerState && t.dtype == DType::U8);
        if t.role.is_persistent() && t.view_of.is_none() && !stored {
            return Err(RuntimeError::UnsupportedDType {
                name: t.name.clone(),
                dtype: t.dtype,
            });
        }
    }
    Ok(())
}

/// A planned graph loaded on this CPU: the runtime's [`Session`] over [`CpuBackend`], which
/// it dereferences to.
pub struct CpuSession(Session<CpuBackend>);

impl CpuSession {
    /// Allocates the arena and every persistent buffer through `allocator` and starts
    /// `threads` workers.
    pub fn new(
        graph: Graph,
        plan: MemoryPlan,
        allocator: Allocator,
        threads: usize,
    ) -> Result<Self, RuntimeError> {
        let backend = CpuBackend::new(allocator, threads)?;
        Ok(CpuSession(Session::new(graph, plan, backend)?))
    }

    pub fn threads(&self) -> usize {
        self.0.backend().threads()
    }
}

impl Deref for CpuSession {
    type Target = Session<CpuBackend>;

    fn deref(&self) -> &Session<CpuBackend> {
        &self.0
    }
}

impl DerefMut for CpuSession {
    fn deref_mut(&mut self) -> &mut Session<CpuBackend> {
        &mut self.0
    }
}

#[cfg(test)]
mod core_count_tests {
    use super::*;

    #[test]
    fn cores_are_counted_once_per_package_and_core_among_the_allowed_cpus() {
        // Two packages of two cores, each core two hyper-threads: CPU n is core (n / 2) % 2 of
        // package n / 4.
        let topology = |cpu: usize| (cpu < 8).then_some(((cpu / 4) as i64, ((cpu / 2) % 2) as i64));
        assert_eq!(count_cores(0..8, topology), Some(4));
        // A job allowed both threads of one core, and one thread of a core in each package.
        assert_eq!(count_cores([2, 3].into_iter(), topology), Some(1));
        assert_eq!(count_cores([0, 4].into_iter(), topology), Some(2));
        // One unknown CPU: no count, so the caller falls back.
        assert_eq!(count_cores([0, 9].into_iter(), topology), None);
        assert_eq!(count_cores(std::iter::empty(), topology), None);
    }

    #[test]
    fn kernel_cpu_lists_are_counted() {
        assert_eq!(cpu_list_len("0-1\n"), Some(2));
        assert_eq!(cpu_list_len("0-3,8,10-11"), Some(7));
        assert_eq!(cpu_list_len("5"), Some(1));
        assert_eq!(cpu_list_len(""), None);
        assert_eq!(cpu_list_len("3-1"), None);
        assert_eq!(cpu_list_len("x"), None);
    }

    #[test]
    fn the_default_worker_count_stays_within_what_the_process_may_use() {
        let usable = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cores = physical_cores();
        assert!((1..=usable).contains(&cores), "{cores} of {usable}");
    }
}
