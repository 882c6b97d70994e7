//! The order nodes execute in. The order changes the peak: a gradient whose optimizer update
//! runs as soon as it is complete dies at once, instead of waiting with every other gradient
//! for an update phase at the end.

use std::collections::BTreeSet;

use snug_graph::{Graph, NodeId, Role, TensorId};

/// How to order the nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// The order the graph was built in (forward, backward, then every optimizer update).
    Program,
    /// A list schedule that runs, among the nodes whose inputs are ready, the one that frees
    /// the most bytes (or allocates the fewest), ties broken by program order.
    MemoryAware,
}

/// Nodes in the order they were built, which the builder guarantees is topological.
pub fn program_order(graph: &Graph) -> Vec<NodeId> {
    (0..graph.nodes().len() as u32).map(NodeId).collect()
}

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
pub fn memory_aware_order(graph: &Graph) -> Vec<NodeId> {
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

    // Ready nodes keyed by (delta, index). A node's delta changes only when a use of one of
    // its unpinned inputs runs, so only those readers are re-keyed: picking the best ready
    // node no longer scans every ready node, which made scheduling quadratic.
    let mut key: Vec<i64> = vec![0; nodes.len()];
    let max_inputs = nodes.iter().map(|n| n.inputs.len()).max().unwrap_or(0);
    let mut is_ready = vec![false; nodes.len()];
    let mut ready: BTreeSet<(i64, usize)> = BTreeSet::new();
    for i in (0..nodes.len()).filter(|&i| waiting[i] == 0) {
        key[i] = delta(i, &uses);
        is_ready[i] = true;
        ready.insert((key[i], i));
    }
    let mut order = Vec::with_capacity(nodes.len());
    let mut touched: Vec<TensorId> = Vec::new();
    while let Some((_, best)) = ready.pop_first() {
        is_ready[best] = false;
        order.push(NodeId(best as u32));
        touched.clear();
        for &t in &nodes[best].inputs {
            let r = root[t.index()];
            uses[r.index()] -= 1;
            if !pinned[r.index()] && !touched.contains(&r) {
                touched.push(r);
            }
        }
        for r in &touched {
            // A reader's delta counts `r` only once the reader holds every use left; with more
            // uses left than any node has inputs, no reader's delta changed.
            if uses[r.index()] > max_inputs {
                continue;
            }
            for &c in &readers[r.index()] {
                if is_ready[c] {
                    let d = delta(c, &uses);
                    if d != key[c] {
                        ready.remove(&(key[c], c));
                        key[c] = d;
                        ready.insert((d, c));
                    }
                }
            }
        }
        let unblocked = nodes[best]
            .outputs
            .iter()
            .flat_map(|o| consumers[o.index()].iter())
            .chain(&release_after[best]);
        for &c in unblocked {
            waiting[c] -= 1;
            if waiting[c] == 0 {
                key[c] = delta(c, &uses);
                is_ready[c] = true;
                ready.insert((key[c], c));
            }
        }
    }
    debug_assert_eq!(order.len(), nodes.len(), "the builder's graphs are acyclic");
    order
}

/// The order for `kind`.
pub fn schedule(graph: &Graph, kind: ScheduleKind) -> Vec<NodeId> {
    match kind {
        ScheduleKind::Program => program_order(graph),
        ScheduleKind::MemoryAware => memory_aware_order(graph),
    }
}
