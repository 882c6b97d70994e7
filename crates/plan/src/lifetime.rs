//! Tensor lifetimes over a schedule: each arena storage is live from the step that writes it to
//! the last step that reads it (or any view of it).

use snug_graph::{Graph, NodeId, TensorId};

/// The schedule positions (inclusive) during which a storage must hold its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifetime {
    pub tensor: TensorId,
    pub size_bytes: usize,
    pub first: usize,
    pub last: usize,
}

/// Lifetimes of every non-persistent storage root used by `schedule`, in tensor order.
///
/// Inputs are live over the whole schedule (written before it runs, and left intact so a step
/// can be re-run on the same batch); graph outputs stay live to the last position; a tensor
/// nobody reads lives only at the step that writes it.
pub fn lifetimes(graph: &Graph, schedule: &[NodeId]) -> Vec<Lifetime> {
    let n = graph.tensors().len();
    let end = schedule.len().saturating_sub(1);
    let mut first = vec![usize::MAX; n];
    let mut last = vec![0usize; n];
    let mut touch = |root: TensorId, pos: usize, first: &mut Vec<usize>| {
        let r = root.index();
        first[r] = first[r].min(pos);
        last[r] = last[r].max(pos);
    };
    for (i, t) in graph.tensors().iter().enumerate() {
        if t.role == snug_graph::Role::Input && t.view_of.is_none() {
            touch(TensorId(i as u32), 0, &mut first);
            touch(TensorId(i as u32), end, &mut first);
        }
    }
    for (pos, &node_id) in schedule.iter().enumerate() {
        let node = graph.node(node_id);
        let touched = node
            .inputs
            .iter()
            .chain(&node.outputs)
            .chain(node.workspace.iter());
        for &t in touched {
            touch(graph.storage_root(t), pos, &mut first);
        }
    }
    for &o in graph.outputs() {
        touch(graph.storage_root(o), end, &mut first);
    }
    graph
        .tensors()
        .iter()
        .enumerate()
        .filter(|(i, t)| t.view_of.is_none() && !t.role.is_persistent() && first[*i] != usize::MAX)
        .map(|(i, t)| Lifetime {
            tensor: TensorId(i as u32),
            size_bytes: t.size_bytes(),
            first: first[i],
            last: last[i],
        })
        .collect()
}
