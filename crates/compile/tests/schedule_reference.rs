//! The memory-aware schedule keeps its ready nodes in an ordered set, re-keying only the nodes
//! whose freed bytes changed; it must choose exactly the order of the first version, which
//! rescanned every ready node at each pick (kept here as the reference), collectives' starts
//! and waits included.

use std::collections::{BTreeSet, VecDeque};

use snug_compile::{compile_sharded, Remat, StepConfig, StepShape};
use snug_graph::ops::Op;
use snug_graph::zero::Sharding;
use snug_graph::{DType, Graph, NodeId, Role, Target, TensorId};
use snug_nn::ModelConfig;
use snug_plan::schedule::MAX_IN_FLIGHT_BYTES;
use snug_plan::{schedule, ScheduleKind};

/// Storage that is never freed inside the step: persistent tensors, inputs, graph outputs.
fn pinned(graph: &Graph) -> Vec<bool> {
    let mut pinned: Vec<bool> = graph
        .tensors()
        .iter()
        .map(|t| t.role.is_persistent() || t.role == Role::Input)
        .collect();
    for &o in graph.outputs() {
        pinned[graph.storage_root(o).index()] = true;
    }
    pinned
}

/// A topological order chosen greedily to keep live bytes low.
fn reference_order(graph: &Graph) -> Vec<NodeId> {
    let nodes = graph.nodes();
    let n_tensors = graph.tensors().len();
    let root: Vec<TensorId> = (0..n_tensors as u32)
        .map(|t| graph.storage_root(TensorId(t)))
        .collect();
    let pinned = pinned(graph);

    // Uses of each storage root still to run, and the consumers of each tensor.
    let mut uses = vec![0usize; n_tensors];
    let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); n_tensors];
    let mut waiting = vec![0usize; nodes.len()];
    for (i, node) in nodes.iter().enumerate() {
        for &t in &node.inputs {
            uses[root[t.index()].index()] += 1;
            consumers[t.index()].push(i);
            if graph.producer(t).is_some() {
                waiting[i] += 1;
            }
        }
        for &t in &node.control {
            if graph.producer(t).is_some() {
                consumers[t.index()].push(i);
                waiting[i] += 1;
            }
        }
    }

    // An in-place update (an optimizer step) must wait for every other reader of the storage
    // it writes: the backward still reads a weight after its gradient is complete.
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); n_tensors];
    for (i, node) in nodes.iter().enumerate() {
        for &t in &node.inputs {
            readers[root[t.index()].index()].push(i);
        }
    }
    let mut release_after: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for (m, node) in nodes.iter().enumerate() {
        for &k in node.op.mutates_inputs() {
            let r = root[node.inputs[k].index()];
            for &c in &readers[r.index()] {
                if c != m {
                    waiting[m] += 1;
                    release_after[c].push(m);
                }
            }
        }
    }

    let size = |t: TensorId| graph.tensor(t).size_bytes() as i64;
    // Bytes a node would add to the live set (new storage) minus bytes it would release.
    let delta = |i: usize, uses: &[usize]| -> i64 {
        let node = &nodes[i];
        let mut d: i64 = node
            .outputs
            .iter()
            .filter(|&&o| {
                graph.tensor(o).view_of.is_none() && !graph.tensor(o).role.is_persistent()
            })
            .map(|&o| size(o))
            .sum();
        let mut seen: Vec<TensorId> = Vec::new();
        for &t in &node.inputs {
            let r = root[t.index()];
            if pinned[r.index()] || seen.contains(&r) {
                continue;
            }
            seen.push(r);
            let here = node
                .inputs
                .iter()
                .filter(|&&u| root[u.index()] == r)
                .count();
            if uses[r.index()] == here {
                d -= size(r);
            }
        }
        d
    };

    let mut ready: BTreeSet<usize> = (0..nodes.len()).filter(|&i| waiting[i] == 0).collect();
    let mut order = Vec::with_capacity(nodes.len());
    // Split collectives: a start runs as soon as it can, its wait as late as its readers and
    // the bound on buckets in flight allow (oldest first), so the backward overlaps them.
    let is_wait = |i: usize| matches!(nodes[i].op, Op::CollectiveWait(_));
    // Waits of started collectives, oldest first, with their buffers' bytes.
    let mut in_flight: VecDeque<(usize, usize)> = VecDeque::new();
    let next = |ready: &BTreeSet<usize>, in_flight: &VecDeque<(usize, usize)>, uses: &[usize]| {
        let oldest = in_flight
            .front()
            .map(|&(w, _)| w)
            .filter(|w| ready.contains(w));
        let bytes: usize = in_flight.iter().map(|&(_, b)| b).sum();
        if in_flight.len() > 1 && bytes > MAX_IN_FLIGHT_BYTES {
            if let Some(w) = oldest {
                return Some(w);
            }
        }
        if let Some(&s) = ready
            .iter()
            .find(|&&i| matches!(nodes[i].op, Op::CollectiveStart(_)))
        {
            return Some(s);
        }
        ready
            .iter()
            .copied()
            .filter(|&i| !is_wait(i))
            .min_by_key(|&i| (delta(i, uses), i))
            .or(oldest)
            .or_else(|| ready.iter().copied().next())
    };
    while let Some(best) = next(&ready, &in_flight, &uses) {
        ready.remove(&best);
        if matches!(nodes[best].op, Op::CollectiveStart(_)) {
            for &o in &nodes[best].outputs {
                let bytes = graph.tensor(o).size_bytes();
                in_flight.extend(
                    consumers[o.index()]
                        .iter()
                        .filter(|&&c| is_wait(c))
                        .map(|&c| (c, bytes)),
                );
            }
        }
        in_flight.retain(|&(w, _)| w != best);
        order.push(NodeId(best as u32));
        for &t in &nodes[best].inputs {
            uses[root[t.index()].index()] -= 1;
        }
        let unblocked = nodes[best]
            .outputs
            .iter()
            .flat_map(|o| consumers[o.index()].iter())
            .chain(&release_after[best]);
        for &c in unblocked {
            waiting[c] -= 1;
            if waiting[c] == 0 {
                ready.insert(c);
            }
        }
    }
    debug_assert_eq!(order.len(), nodes.len(), "the builder's graphs are acyclic");
    order
}

#[test]
fn the_schedule_is_the_reference_order_on_real_steps() {
    let target = Target::cpu(1, snug_graph::CpuGemm::Portable);
    let cases: [(&str, usize, u8, Remat, DType, usize); 6] = [
        ("tiny", 1, 0, Remat::None, DType::F32, 1),
        ("tiny", 1, 0, Remat::Blocks { blocks: 1 }, DType::BF16, 2),
        ("llama-tiny", 1, 0, Remat::Selective, DType::F32, 1),
        ("llama-tiny", 1, 0, Remat::None, DType::F16, 2),
        ("tiny", 2, 2, Remat::None, DType::F32, 2),
        (
            "llama-tiny",
            2,
            3,
            Remat::Blocks { blocks: 1 },
            DType::F32,
            1,
        ),
    ];
    for (preset, ranks, stage, remat, precision, accumulation) in cases {
        let model = ModelConfig::preset(preset).expect("a preset");
        let config = StepConfig {
            remat,
            precision,
            accumulation,
            ..StepConfig::default()
        };
        let sharding = Sharding::new(ranks, stage).expect("a valid sharding");
        let shape = StepShape::per_rank(4 * ranks, 16, ranks, accumulation).expect("divides");
        let c = compile_sharded(&model, shape, target, &config, &sharding)
            .unwrap_or_else(|e| panic!("{preset}: {e}"));
        let graph = &c.step.graph;
        assert_eq!(
            schedule(graph, ScheduleKind::MemoryAware),
            reference_order(graph),
            "{preset}, {ranks} ranks, stage {stage}, {remat:?}, {precision:?}"
        );
    }
}
