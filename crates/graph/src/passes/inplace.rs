//! In-place rewriting: an op whose input dies at that op writes its output over the input
//! (elementwise ops, and fused backwards such as `gelu_linear_backward` or
//! `layer_norm_linear_backward` that read each element or row before writing it), so the two
//! share one allocation instead of overlapping for the op's duration.
//!
//! "Dies at that op" must hold in every schedule the planner may pick, so every other reader of
//! the input's storage must be an ancestor of this node, no view may look into it, and it must
//! not outlive the step (no parameter, optimizer state, batch input or graph output). An input
//! that is itself a view (the LM head reads the final norm's output through a reshape)
//! qualifies when it spans its whole storage and every reader of every tensor sharing that
//! storage is an ancestor. The kernels compute the same value from the same operands, so the
//! step's numbers are bitwise unchanged.
//!
//! The pass runs last: it marks nodes of the final graph, and a later rewrite drops the marks.

use crate::{Graph, NodeId, Result};

/// `graph` with every eligible elementwise node marked in place, and how many were marked.
pub fn write_in_place(graph: &Graph) -> Result<(Graph, usize)> {
    let mut g = graph.clone();
    let n = g.tensors().len();
    // The nodes reading each tensor itself, once per read (a node reading it twice is listed
    // twice).
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, node) in g.nodes().iter().enumerate() {
        for &t in &node.inputs {
            readers[t.index()].push(i);
        }
    }
    let mut is_output = vec![false; n];
    for &o in g.outputs() {
        is_output[o.index()] = true;
        is_output[g.storage_root(o).index()] = true;
    }
    // Tensors a view op looks into: writing over one would change what its view shows.
    let mut viewed = vec![false; n];
    for t in g.tensors() {
        if let Some(v) = t.view_of {
            viewed[v.base.index()] = true;
        }
    }
    let mut marked = 0;
    for i in 0..g.nodes().len() {
        let node = &g.nodes()[i];
        let Some(&out) = node.outputs.first() else {
            continue;
        };
        let o = g.tensor(out);
        let choice = node.op.inplace_inputs().iter().copied().find(|&k| {
            let Some(&x) = node.inputs.get(k) else {
                return false;
            };
            let m = g.tensor(x);
            let Some(producer) = g.producer(x) else {
                return false;
            };
            // A chain of in-place ops shares one storage.
            let own_storage = m.view_of.is_none() || g.node(producer).inplace.is_some();
            let root_id = g.storage_root(x);
            let root = g.tensor(root_id);
            let dies = if own_storage {
                !is_output[x.index()] && !viewed[x.index()] && dies_at(&g, i, &readers[x.index()])
            } else {
                // A view (a reshape, say) of a whole storage qualifies when nothing else reads
                // that storage, through any tensor sharing it, after this node.
                root.numel() == m.numel()
                    && root.dtype == m.dtype
                    && whole_storage_dies_at(&g, i, root_id, &readers, &is_output)
            };
            dies && !root.role.is_persistent()
                && root.role != crate::Role::Input
                && m.shape == o.shape
                && m.dtype == o.dtype
                && o.view_of.is_none()
        });
        if let Some(k) = choice {
            g.set_inplace(NodeId(i as u32), k);
            marked += 1;
        }
    }
    Ok((g, marked))
}

/// Whether the storage rooted at `root` (every tensor viewing it at offset zero, none a graph
/// output) is read by `node` once and last in every schedule.
fn whole_storage_dies_at(
    g: &Graph,
    node: usize,
    root: crate::TensorId,
    readers: &[Vec<usize>],
    is_output: &[bool],
) -> bool {
    let mut all = Vec::new();
    for (t, meta) in g.tensors().iter().enumerate() {
        let id = crate::TensorId(t as u32);
        if g.storage_root(id) != root {
            continue;
        }
        if is_output[t] || meta.view_of.is_some_and(|v| v.offset_elems != 0) {
            return false;
        }
        all.extend_from_slice(&readers[t]);
    }
    dies_at(g, node, &all)
}

/// Whether a tensor read by `readers` is read by `node` once and last in every schedule: each
/// other reader is an ancestor of `node` (a backward reading what its forward read, say).
fn dies_at(g: &Graph, node: usize, readers: &[usize]) -> bool {
    if readers.iter().filter(|&&r| r == node).count() != 1 {
        return false;
    }
    let mut others: Vec<usize> = readers.iter().copied().filter(|&r| r != node).collect();
    others.sort_unstable();
    others.dedup();
    let (Some(&first), Some(&last)) = (others.first(), others.last()) else {
        return true;
    };
    if last > node {
        return false;
    }
    // Walk up from `node`; nodes come in a topological order, so no ancestor sits below
    // `first` that could lead back to a reader.
    let mut seen = vec![false; node + 1 - first];
    let mut stack = vec![node];
    let mut found = 0;
    while let Some(v) = stack.pop() {
        let n = g.node(NodeId(v as u32));
        for &t in n.inputs.iter().chain(&n.control) {
            let Some(p) = g.producer(t) else { continue };
            let p = p.index();
            if p < first || seen[p - first] {
                continue;
            }
            seen[p - first] = true;
            if others.binary_search(&p).is_ok() {
                found += 1;
            }
            stack.push(p);
        }
    }
    found == others.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{Binary, Gelu, Scale};
    use crate::{DType, Role};

    #[test]
    fn marks_only_inputs_that_die_at_the_op() {
        let mut g = Graph::new();
        let x = g.add_leaf("x", &[4, 8], DType::F32, Role::Input).unwrap();
        let a = g.apply1(Scale { factor: 2.0 }, &[x]).unwrap(); // x is an input: not in place
        let b = g.apply1(Gelu::default(), &[a]).unwrap(); // a is read again below: not in place
        let c = g.apply1(Binary::add(), &[b, b]).unwrap(); // b read twice: not in place
        let e = g.apply1(Binary::add(), &[c, a]).unwrap(); // c dies here: in place over c
        let d = g.apply1(Scale { factor: 0.5 }, &[e]).unwrap(); // e dies here: in place
        g.mark_output(d);
        let (h, marked) = write_in_place(&g).unwrap();
        let flags: Vec<Option<usize>> = h.nodes().iter().map(|n| n.inplace).collect();
        assert_eq!(flags, vec![None, None, None, Some(0), Some(0)]);
        assert_eq!(marked, 2);
        // d lives in c's storage, through e.
        assert_eq!(h.storage_root(d), c);
        assert_eq!(h.storage_root(e), c);
    }

    #[test]
    fn an_input_dies_where_its_last_reader_runs_after_every_other() {
        let mut g = Graph::new();
        let x = g.add_leaf("x", &[4, 8], DType::F32, Role::Input).unwrap();
        let a = g.apply1(Scale { factor: 2.0 }, &[x]).unwrap();
        let b = g.apply1(Gelu::default(), &[a]).unwrap(); // a read by a descendant too
        let s = g.apply1(Scale { factor: 3.0 }, &[a]).unwrap(); // a read by an unrelated node
        let c = g.apply1(Binary::add(), &[b, a]).unwrap(); // s may run after: not over a
        let d = g.apply1(Binary::add(), &[s, c]).unwrap();
        let e = g.apply1(Binary::mul(), &[b, d]).unwrap(); // d dies; b read by c before: over b
        g.mark_output(e);
        let (h, _) = write_in_place(&g).unwrap();
        let flags: Vec<Option<usize>> = h.nodes().iter().map(|n| n.inplace).collect();
        assert_eq!(
            flags[3], None,
            "c must not write over a: s may read it later"
        );
        assert_eq!(
            flags[5],
            Some(0),
            "b dies at e: gelu and c, its other readers, come first"
        );
    }
}
