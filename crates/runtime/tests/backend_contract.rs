//! The executor's side of the backend contract (see `snug_runtime::backend`), checked with a
//! backend that runs no kernel: it records every call, keeps its "device memory" in its own
//! slab (handles, not addresses), and fails the test on any call out of order.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use snug_graph::ops::{AdamW, MatMul, Reduce, ReduceKind};
use snug_graph::{DType, Graph, Node, OptimizerSpec, StepGraph, Target};
use snug_plan::{plan, MemoryPlan, PlanOptions};
use snug_runtime::{
    Allocator, Backend, Block, Device, ExecCtx, MemorySource, NodeArgs, RuntimeError, Session,
    Slice,
};

/// Device memory as a map from handle to bytes.
#[derive(Debug, Default)]
struct Slab {
    blocks: Mutex<HashMap<usize, Vec<u8>>>,
    next: Mutex<usize>,
}

impl MemorySource for Slab {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn allocate(&self, capacity: usize) -> Option<Block> {
        let mut next = self.next.lock().unwrap();
        *next += 1;
        self.blocks.lock().unwrap().insert(*next, vec![0; capacity]);
        Some(Block {
            handle: NonZeroUsize::new(*next)?,
            capacity,
        })
    }
    fn release(&self, block: Block) {
        self.blocks.lock().unwrap().remove(&block.handle.get());
    }
    fn zero(&self, block: &Block, bytes: usize) {
        let mut blocks = self.blocks.lock().unwrap();
        blocks.get_mut(&block.handle.get()).unwrap()[..bytes].fill(0);
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Call {
    /// Node position in the schedule, and each tensor's (handle, offset, len).
    Bind {
        op: &'static str,
        tensors: Vec<(usize, usize, usize)>,
    },
    Launch {
        nodes: usize,
        selected: Option<usize>,
    },
    Synchronize,
    Upload {
        handle: usize,
        offset: usize,
        len: usize,
    },
    Download {
        handle: usize,
        offset: usize,
        len: usize,
    },
}

struct Recorder {
    slab: Arc<Slab>,
    allocator: Allocator,
    calls: Mutex<Vec<Call>>,
    /// Launched work not yet waited for.
    pending: Mutex<bool>,
}

impl Recorder {
    fn new() -> Self {
        let slab = Arc::new(Slab::default());
        Recorder {
            allocator: Allocator::with_source(slab.clone()),
            slab,
            calls: Mutex::new(Vec::new()),
            pending: Mutex::new(false),
        }
    }

    fn record(&self, call: Call) {
        self.calls.lock().unwrap().push(call);
    }

    /// A slice must lie inside one live block of the device.
    fn check_slice(&self, s: Slice<'_>) {
        let blocks = self.slab.blocks.lock().unwrap();
        let block = blocks
            .get(&s.buffer.handle())
            .expect("a slice of a buffer the device does not hold");
        assert!(s.offset + s.len <= block.len(), "slice past its buffer");
        assert!(
            s.offset + s.len <= s.buffer.len_bytes(),
            "slice past its request"
        );
    }

    fn idle(&self, what: &str) {
        assert!(
            !*self.pending.lock().unwrap(),
            "{what} while launched work may still run (no synchronize)"
        );
    }
}

impl Backend for Recorder {
    type Bound = usize;

    fn device(&self) -> Device {
        Device::Cpu
    }
    fn target(&self) -> Target {
        Target::default()
    }
    fn allocator(&self) -> &Allocator {
        &self.allocator
    }
    fn check(&self, _graph: &Graph) -> Result<(), RuntimeError> {
        Ok(())
    }
    fn bind(&self, _graph: &Graph, node: &Node, args: NodeArgs<'_>) -> Result<usize, RuntimeError> {
        self.idle("bind");
        let all: Vec<_> = args
            .inputs
            .iter()
            .chain(&args.outputs)
            .chain(&args.workspace)
            .collect();
        for b in &all {
            self.check_slice(b.slice);
            assert_eq!(b.slice.len, b.meta.size_bytes(), "{}", b.meta.name);
        }
        let mut calls = self.calls.lock().unwrap();
        let index = calls
            .iter()
            .filter(|c| matches!(c, Call::Bind { .. }))
            .count();
        calls.push(Call::Bind {
            op: node.op.name(),
            tensors: all
                .iter()
                .map(|b| (b.slice.buffer.handle(), b.slice.offset, b.slice.len))
                .collect(),
        });
        Ok(index)
    }
    fn launch(
        &self,
        nodes: &[usize],
        selected: Option<&[bool]>,
        _ctx: ExecCtx,
        times: Option<&mut Vec<f64>>,
    ) -> Result<(), RuntimeError> {
        assert!(
            nodes.windows(2).all(|w| w[1] == w[0] + 1),
            "bound nodes launched out of schedule order"
        );
        if let Some(mask) = selected {
            assert_eq!(mask.len(), nodes.len(), "a mask covers the schedule");
        }
        let run = selected.map_or(nodes.len(), |m| m.iter().filter(|&&x| x).count());
        if let Some(times) = times {
            times.extend(std::iter::repeat_n(0.0, run));
        }
        *self.pending.lock().unwrap() = true;
        self.record(Call::Launch {
            nodes: nodes.len(),
            selected: selected.map(|_| run),
        });
        Ok(())
    }
    fn synchronize(&self) -> Result<(), RuntimeError> {
        *self.pending.lock().unwrap() = false;
        self.record(Call::Synchronize);
        Ok(())
    }
    fn upload(&self, dst: Slice<'_>, bytes: &[u8]) -> Result<(), RuntimeError> {
        self.idle("upload");
        self.check_slice(dst);
        assert_eq!(bytes.len(), dst.len);
        let mut blocks = self.slab.blocks.lock().unwrap();
        let block = blocks.get_mut(&dst.buffer.handle()).unwrap();
        block[dst.offset..dst.offset + dst.len].copy_from_slice(bytes);
        drop(blocks);
        self.record(Call::Upload {
            handle: dst.buffer.handle(),
            offset: dst.offset,
            len: dst.len,
        });
        Ok(())
    }
    fn download(&self, src: Slice<'_>, out: &mut [u8]) -> Result<(), RuntimeError> {
        self.idle("download");
        self.check_slice(src);
        let blocks = self.slab.blocks.lock().unwrap();
        out.copy_from_slice(&blocks[&src.buffer.handle()][src.offset..src.offset + src.len]);
        drop(blocks);
        self.record(Call::Download {
            handle: src.buffer.handle(),
            offset: src.offset,
            len: src.len,
        });
        Ok(())
    }
}

/// A linear layer's training step: forward, backward and AdamW, with a workspace-free
/// schedule of a dozen nodes.
fn step() -> (StepGraph, MemoryPlan) {
    let mut g = Graph::new();
    let x = g.input("x", &[4, 8], DType::F32).unwrap();
    let w = g.parameter("w", &[8, 3]).unwrap();
    let y = g.apply1(MatMul::default(), &[x, w]).unwrap();
    let rows = g
        .apply1(
            Reduce {
                kind: ReduceKind::Sum,
                axis: 1,
                keepdim: false,
            },
            &[y],
        )
        .unwrap();
    let loss = g
        .apply1(
            Reduce {
                kind: ReduceKind::Mean,
                axis: 0,
                keepdim: false,
            },
            &[rows],
        )
        .unwrap();
    let step = StepGraph::build(g, loss, OptimizerSpec::AdamW(AdamW::default())).unwrap();
    let memory = plan(&step, &PlanOptions::default()).unwrap();
    (step, memory)
}

fn calls(s: &Session<Recorder>) -> Vec<Call> {
    std::mem::take(&mut *s.backend().calls.lock().unwrap())
}

#[test]
fn nodes_are_bound_once_in_schedule_order_at_their_planned_bytes() {
    let (step, memory) = step();
    let schedule: Vec<_> = memory.schedule.clone();
    let s = Session::new(step.graph.clone(), memory.clone(), Recorder::new()).unwrap();
    let binds = calls(&s);
    assert_eq!(binds.len(), schedule.len(), "one bind per scheduled node");
    let arena = memory.arena_bytes;
    for (call, &nid) in binds.iter().zip(&schedule) {
        let node = step.graph.node(nid);
        let Call::Bind { op, tensors } = call else {
            panic!("{call:?} before the first run")
        };
        assert_eq!(*op, node.op.name());
        let ids: Vec<_> = node
            .inputs
            .iter()
            .chain(&node.outputs)
            .chain(&node.workspace)
            .collect();
        for (&&t, &(_, offset, len)) in ids.iter().zip(tensors) {
            let root = step.graph.storage_root(t);
            match memory.arena_offset(root) {
                // Arena tensors sit at the plan's offsets inside the arena.
                Some(off) => assert!(offset >= off && offset + len <= arena),
                // Persistent ones start their own buffer (no views of them here).
                None => assert_eq!(offset, 0, "{}", step.graph.tensor(t).name),
            }
        }
    }
}

#[test]
fn results_are_read_back_only_after_the_device_is_idle() {
    let (step, memory) = step();
    let x = step.inputs[0];
    let mut s = Session::new(step.graph.clone(), memory, Recorder::new()).unwrap();
    calls(&s);
    s.write_f32(x, &[1.0; 32]).unwrap();
    s.run(ExecCtx::default()).unwrap();
    let w = step.params[0].param;
    let read = s.read_f32(w).unwrap().to_vec();
    assert_eq!(
        read,
        vec![0.0; 24],
        "no kernel ran: the weights are as allocated"
    );
    let log = calls(&s);
    let kinds: Vec<_> = log
        .iter()
        .map(|c| match c {
            Call::Upload { .. } => "upload",
            Call::Launch { .. } => "launch",
            Call::Synchronize => "sync",
            Call::Download { .. } => "download",
            Call::Bind { .. } => "bind",
        })
        .collect();
    assert_eq!(kinds, ["sync", "upload", "launch", "sync", "download"]);
    // The download is exactly the parameter's bytes, from its own buffer.
    assert!(matches!(
        log[4],
        Call::Download {
            offset: 0,
            len: 96,
            ..
        }
    ));
}

#[test]
fn a_released_arena_is_rebound_only_when_it_comes_back_elsewhere() {
    let (step, memory) = step();
    let mut s = Session::new(step.graph.clone(), memory, Recorder::new()).unwrap();
    calls(&s);
    s.run(ExecCtx::default()).unwrap();
    s.release_arena().unwrap();
    // The arena comes back from the allocator's cache: the same block, no rebinding.
    s.run(ExecCtx::default()).unwrap();
    let log = calls(&s);
    assert_eq!(
        log.iter()
            .filter(|c| matches!(c, Call::Bind { .. }))
            .count(),
        0,
        "{log:?}"
    );
    assert_eq!(
        log[1],
        Call::Synchronize,
        "the arena is released only when idle"
    );
    // With the cache emptied, the arena is a new block and every node is bound again.
    s.release_arena().unwrap();
    s.allocator().clear_cache();
    s.run(ExecCtx::default()).unwrap();
    let binds = calls(&s)
        .iter()
        .filter(|c| matches!(c, Call::Bind { .. }))
        .count();
    assert_eq!(binds, s.plan().schedule.len());
}

#[test]
fn a_masked_run_launches_the_whole_schedule_with_its_selection() {
    let (step, memory) = step();
    let mut s = Session::new(step.graph.clone(), memory, Recorder::new()).unwrap();
    calls(&s);
    let mask = s.nodes_for(&[step.loss]);
    let forward = mask.iter().filter(|&&m| m).count();
    assert!(forward > 0 && forward < mask.len());
    s.run_only(ExecCtx::default(), &mask).unwrap();
    let times = s.run_profiled(ExecCtx::default()).unwrap();
    assert_eq!(times.len(), s.plan().schedule.len());
    let launches: Vec<_> = calls(&s)
        .into_iter()
        .filter(|c| matches!(c, Call::Launch { .. }))
        .collect();
    let n = s.plan().schedule.len();
    assert_eq!(
        launches,
        [
            Call::Launch {
                nodes: n,
                selected: Some(forward)
            },
            Call::Launch {
                nodes: n,
                selected: None
            }
        ]
    );
}

#[test]
fn replanning_keeps_the_parameters_buffers_and_their_bytes() {
    let (step, memory) = step();
    let w = step.params[0].param;
    let mut s = Session::new(step.graph.clone(), memory.clone(), Recorder::new()).unwrap();
    let weights: Vec<f32> = (0..24).map(|i| i as f32).collect();
    s.write_f32(w, &weights).unwrap();
    let handle_of = |s: &Session<Recorder>| {
        calls(s);
        let _ = s.read_f32(w).unwrap();
        match calls(s).pop() {
            Some(Call::Download { handle, .. }) => handle,
            other => panic!("{other:?}"),
        }
    };
    let before = handle_of(&s);
    s.replan(step.graph.clone(), memory).unwrap();
    assert_eq!(handle_of(&s), before);
    assert_eq!(&*s.read_f32(w).unwrap(), &weights[..]);
}

#[test]
fn an_arena_tensor_is_not_readable_once_released() {
    let (step, memory) = step();
    let mut s = Session::new(step.graph.clone(), memory, Recorder::new()).unwrap();
    s.run(ExecCtx::default()).unwrap();
    s.release_arena().unwrap();
    assert!(matches!(
        s.read_f32(step.loss),
        Err(RuntimeError::Released { .. })
    ));
}
