//! The order nodes execute in. The order changes the peak: a gradient whose optimizer update
//! runs as soon as it is complete dies at once, instead of waiting with every other gradient
//! for an update phase at the end.

use std::collections::{BTreeSet, VecDeque};

use snug_graph::ops::Op;
use snug_graph::{Graph, NodeId, Role, TensorId};

/// Bytes of in-flight buffers that collectives may hold at once before the oldest is waited
/// for (one more may always start): two all-reduces of 25 MiB buckets, each holding what it
/// sends and what it receives. The bound keeps ZeRO-2 from holding every whole gradient until
/// the backward ends.
pub const MAX_IN_FLIGHT_BYTES: usize = 100 << 20;

/// How to order the nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// The order the graph was built in (forward, backward, then every optimizer update).
    Program,
    /// A list schedule that runs, among the nodes whose inputs are ready, the one that frees
    /// the most bytes (or allocates the fewest), ties broken by program order; a split
    /// collective's start as soon as it is ready, its wait as late as allowed.
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

    // Asked for every candidate at every pick: computed once, not from the shape each time.
    let sizes: Vec<i64> = graph
        .tensors()
        .iter()
        .map(|t| t.size_bytes() as i64)
        .collect();
    let size = |t: TensorId| sizes[t.index()];
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

    // Split collectives: a start runs as soon as it can, its wait as late as its readers and
    // the bound on buckets in flight allow (oldest first), so the backward overlaps them.
    let is_wait = |i: usize| matches!(nodes[i].op, Op::CollectiveWait(_));
    let is_start = |i: usize| matches!(nodes[i].op, Op::CollectiveStart(_));
    // Other ready nodes are keyed by (delta, index). A node's delta changes only when a use of
    // one of its unpinned inputs runs, so only those readers are re-keyed: picking the best
    // ready node no longer scans every ready node, which made scheduling quadratic.
    // The most uses of each root one node holds. A reader's delta counts root `r` only once
    // the reader holds every use left, so while more uses are left than any one reader holds,
    // no reader's delta changed. The bound is per root: a global one (the most inputs of any
    // node, such as a global norm reading every gradient) re-keyed all of a shared input's
    // readers at each of their runs, which made the optimizer's updates quadratic.
    let mut most_in_one = vec![0usize; n_tensors];
    let mut node_roots: Vec<TensorId> = Vec::new();
    for node in nodes {
        node_roots.clear();
        node_roots.extend(node.inputs.iter().map(|t| root[t.index()]));
        node_roots.sort_unstable();
        for run in node_roots.chunk_by(|a, b| a == b) {
            let r = run[0].index();
            most_in_one[r] = most_in_one[r].max(run.len());
        }
    }
    let mut key: Vec<i64> = vec![0; nodes.len()];
    let mut is_ready = vec![false; nodes.len()];
    let mut keyed: BTreeSet<(i64, usize)> = BTreeSet::new();
    let mut starts: BTreeSet<usize> = BTreeSet::new();
    let mut waits: BTreeSet<usize> = BTreeSet::new();
    let mut ready_now: Vec<usize> = (0..nodes.len()).filter(|&i| waiting[i] == 0).collect();
    // Waits of started collectives, oldest first, with their buffers' bytes.
    let mut in_flight: VecDeque<(usize, usize)> = VecDeque::new();
    let mut in_flight_bytes = 0usize;
    let mut order = Vec::with_capacity(nodes.len());
    let mut touched: Vec<TensorId> = Vec::new();
    loop {
        for c in ready_now.drain(..) {
            is_ready[c] = true;
            if is_start(c) {
                starts.insert(c);
            } else if is_wait(c) {
                waits.insert(c);
            } else {
                key[c] = delta(c, &uses);
                keyed.insert((key[c], c));
            }
        }
        let oldest = in_flight.front().map(|&(w, _)| w).filter(|&w| is_ready[w]);
        let best =
            if in_flight.len() > 1 && in_flight_bytes > MAX_IN_FLIGHT_BYTES && oldest.is_some() {
                oldest
            } else {
                starts
                    .first()
                    .copied()
                    .or_else(|| keyed.first().map(|&(_, i)| i))
                    .or(oldest)
                    .or_else(|| waits.first().copied())
            };
        let Some(best) = best else { break };
        is_ready[best] = false;
        if !(starts.remove(&best) || waits.remove(&best)) {
            keyed.remove(&(key[best], best));
        }
        if is_start(best) {
            for &o in &nodes[best].outputs {
                let bytes = graph.tensor(o).size_bytes();
                for &c in consumers[o.index()].iter().filter(|&&c| is_wait(c)) {
                    in_flight.push_back((c, bytes));
                    in_flight_bytes += bytes;
                }
            }
        }
        in_flight.retain(|&(w, b)| {
            if w == best {
                in_flight_bytes -= b;
            }
            w != best
        });
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
            if uses[r.index()] > most_in_one[r.index()] {
                continue;
            }
            for &c in &readers[r.index()] {
                if is_ready[c] && !is_start(c) && !is_wait(c) {
                    let d = delta(c, &uses);
                    if d != key[c] {
                        keyed.remove(&(key[c], c));
                        key[c] = d;
                        keyed.insert((d, c));
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
                ready_now.push(c);
            }
        }
    }
    debug_assert_eq!(order.len(), nodes.len(), "the builder's graphs are acyclic");
    order
}

/// The state of [`program_order_overlapped`] as it lays out the order.
struct Overlapped<'g> {
    graph: &'g Graph,
    /// The starts that follow each node.
    after: Vec<Vec<usize>>,
    wait_of: Vec<Option<usize>>,
    /// Waits of the collectives in flight, oldest first, with their buffers' bytes.
    deferred: VecDeque<(usize, usize)>,
    /// The bytes of those buffers together.
    held: usize,
    /// Tensors a put-off wait makes.
    pending: Vec<bool>,
    order: Vec<NodeId>,
}

impl Overlapped<'_> {
    /// Puts off start `s`'s wait, first running the oldest waits while what is in flight
    /// would pass the bound (one collective may always be in flight).
    fn defer_wait_of(&mut self, s: usize) {
        let Some(w) = self.wait_of[s] else {
            return;
        };
        let graph = self.graph;
        let bytes: usize = graph.nodes()[s]
            .outputs
            .iter()
            .map(|&t| graph.tensor(t).size_bytes())
            .sum();
        while !self.deferred.is_empty() && self.held + bytes > MAX_IN_FLIGHT_BYTES {
            self.emit_oldest_wait();
        }
        self.deferred.push_back((w, bytes));
        self.held += bytes;
        for &t in &graph.nodes()[w].outputs {
            self.pending[t.index()] = true;
        }
    }

    /// Runs the oldest put-off wait; `false` where none is.
    fn emit_oldest_wait(&mut self) -> bool {
        let Some((w, bytes)) = self.deferred.pop_front() else {
            return false;
        };
        self.held -= bytes;
        self.emit(w);
        true
    }

    /// Runs node `n` (after the put-off waits whose outputs it reads, and every older one),
    /// then the starts that follow it.
    fn emit(&mut self, n: usize) {
        let node = &self.graph.nodes()[n];
        while node
            .inputs
            .iter()
            .chain(&node.control)
            .any(|t| self.pending[t.index()])
        {
            if !self.emit_oldest_wait() {
                break;
            }
        }
        if matches!(node.op, Op::CollectiveStart(_)) {
            self.defer_wait_of(n);
        }
        self.order.push(NodeId(n as u32));
        for &t in &node.outputs {
            self.pending[t.index()] = false;
        }
        for s in std::mem::take(&mut self.after[n]) {
            self.emit(s);
        }
    }
}

/// Whether `graph` has collectives split into a start and a wait (overlapped with the backward
/// by both orders).
pub fn has_split_collectives(graph: &Graph) -> bool {
    graph
        .nodes()
        .iter()
        .any(|n| matches!(n.op, Op::CollectiveStart(_)))
}

/// How the split collectives of a step overlap its backward pass in `schedule`: where each
/// starts and is waited for, and where the backward ends. `forward_nodes` is the step's count
/// of forward nodes (they come first in program order).
pub fn overlap(graph: &Graph, schedule: &[NodeId], forward_nodes: usize) -> Overlap {
    let mut position = vec![0usize; graph.nodes().len()];
    for (p, n) in schedule.iter().enumerate() {
        position[n.index()] = p;
    }
    // The backward: what the collectives' inputs are computed from, past the forward.
    let mut backward = vec![false; graph.nodes().len()];
    let mut stack: Vec<TensorId> = graph
        .nodes()
        .iter()
        .filter(|n| matches!(n.op, Op::CollectiveStart(_)))
        .flat_map(|n| n.inputs.iter().copied())
        .collect();
    let mut seen = vec![false; graph.tensors().len()];
    while let Some(t) = stack.pop() {
        if std::mem::replace(&mut seen[t.index()], true) {
            continue;
        }
        let Some(p) = graph.producer(t) else {
            continue;
        };
        let node = graph.node(p);
        let collective = matches!(node.op, Op::CollectiveStart(_) | Op::CollectiveWait(_));
        if p.index() >= forward_nodes && !collective {
            backward[p.index()] = true;
        }
        stack.extend(node.inputs.iter().copied());
    }
    let backward_end = schedule.iter().rposition(|n| backward[n.index()]);
    let mut collectives = Vec::new();
    for &n in schedule {
        let node = graph.node(n);
        let Op::CollectiveStart(start) = &node.op else {
            continue;
        };
        let wait = node
            .outputs
            .first()
            .and_then(|&o| {
                graph
                    .nodes()
                    .iter()
                    .position(|m| matches!(m.op, Op::CollectiveWait(_)) && m.inputs == [o])
            })
            .map(|w| position[w]);
        let ready_at = node
            .inputs
            .iter()
            .filter_map(|&t| graph.producer(t))
            .map(|p| position[p.index()])
            .max();
        collectives.push(CollectiveSpan {
            op: node.op.name(),
            tensors: node.inputs.len(),
            bytes: node
                .inputs
                .iter()
                .map(|&t| graph.tensor(t).size_bytes())
                .sum(),
            once_per_step: start.op.once_per_step(),
            in_flight_bytes: node
                .outputs
                .iter()
                .map(|&t| graph.tensor(t).size_bytes())
                .sum(),
            ready_at,
            start: position[n.index()],
            wait,
        });
    }
    Overlap {
        backward_end,
        collectives,
    }
}

/// See [`overlap`]; positions are in the schedule.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Overlap {
    /// The backward's last node (`None` without split collectives).
    pub backward_end: Option<usize>,
    /// In the order they start.
    pub collectives: Vec<CollectiveSpan>,
}

impl Overlap {
    /// Collectives that start before the backward's last node: their bytes travel while
    /// the backward runs.
    pub fn overlapped(&self) -> usize {
        self.collectives
            .iter()
            .filter(|c| self.backward_end.is_some_and(|end| c.start < end))
            .count()
    }
}

/// One split collective in a schedule.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CollectiveSpan {
    /// `all_reduce_start` or `reduce_scatter_start`.
    pub op: &'static str,
    /// Gradients in its bucket, and their bytes.
    pub tensors: usize,
    pub bytes: usize,
    /// Runs on the last micro-batch only (it reads summed gradients).
    pub once_per_step: bool,
    /// Bytes of its in-flight buffer (what it sends and what it receives), held from start to
    /// wait.
    pub in_flight_bytes: usize,
    /// Where the last of its gradients is made.
    pub ready_at: Option<usize>,
    /// Where it starts and where it is waited for.
    pub start: usize,
    pub wait: Option<usize>,
}

/// The order for `kind`.
pub fn schedule(graph: &Graph, kind: ScheduleKind) -> Vec<NodeId> {
    match kind {
        ScheduleKind::Program => program_order_overlapped(graph),
        ScheduleKind::MemoryAware => memory_aware_order(graph),
    }
}

/// Program order, with each split collective's start moved up to just after the last node
/// that writes what it reads, and its wait moved down to just before the first node that reads
/// what it makes (or sooner, oldest first, where the buffers in flight pass
/// [`MAX_IN_FLIGHT_BYTES`]), so the backward overlaps the collectives as in the memory-aware
/// order while every other node keeps the builder's order. The greedy memory-aware order can
/// do much worse than the builder's where many allocations are ready at once (ZeRO-3's
/// gathered weights: it gathers the small ones first, and every weight before the largest),
/// so the planner compares the two. Without split collectives this is program order.
pub fn program_order_overlapped(graph: &Graph) -> Vec<NodeId> {
    let nodes = graph.nodes();
    if !has_split_collectives(graph) {
        return program_order(graph);
    }
    let root = |t: TensorId| graph.storage_root(t).index();
    // Where each start goes: after the last earlier node writing one of its inputs' storage
    // (producing it, updating it in place, or writing its output over it); `None`: first.
    let mut last_writer: Vec<Option<usize>> = vec![None; graph.tensors().len()];
    let mut after: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    let mut first = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        if matches!(node.op, Op::CollectiveStart(_)) {
            let at = node
                .inputs
                .iter()
                .chain(&node.control)
                .filter_map(|&t| last_writer[root(t)])
                .max();
            match at {
                Some(w) => after[w].push(i),
                None => first.push(i),
            }
        }
        for &o in &node.outputs {
            last_writer[root(o)] = Some(i);
        }
        let written = node.op.mutates_inputs().iter().copied().chain(node.inplace);
        for k in written {
            if let Some(&t) = node.inputs.get(k) {
                last_writer[root(t)] = Some(i);
            }
        }
    }
    // Each start's wait (its in-flight buffer's one reader).
    let mut wait_of: Vec<Option<usize>> = vec![None; nodes.len()];
    for (i, node) in nodes.iter().enumerate() {
        if matches!(node.op, Op::CollectiveWait(_)) {
            if let Some(p) = node.inputs.first().and_then(|&t| graph.producer(t)) {
                wait_of[p.index()] = Some(i);
            }
        }
    }
    let mut o = Overlapped {
        graph,
        after,
        wait_of,
        deferred: VecDeque::new(),
        held: 0,
        pending: vec![false; graph.tensors().len()],
        order: Vec::with_capacity(nodes.len()),
    };
    for s in first {
        o.emit(s);
    }
    for (i, node) in nodes.iter().enumerate() {
        // Starts run where `after` puts them, and waits when they must.
        if !matches!(node.op, Op::CollectiveStart(_) | Op::CollectiveWait(_)) {
            o.emit(i);
        }
    }
    while o.emit_oldest_wait() {}
    let order = o.order;
    debug_assert_eq!(order.len(), nodes.len());
    order
}
