//! In-place rewriting: an elementwise op whose input dies at that op writes its output over
//! the input, so the two share one allocation instead of overlapping for the op's duration.
//!
//! "Dies at that op" must hold in every schedule the planner may pick, so the input's storage
//! must have this node as its only reader (through any view), and must not outlive the step
//! (no parameter, optimizer state, batch input or graph output). The kernels compute the same
//! value from the same operands, so the step's numbers are bitwise unchanged.
//!
//! The pass runs last: it marks nodes of the final graph, and a later rewrite drops the marks.

use crate::{Graph, NodeId, Result};

/// `graph` with every eligible elementwise node marked in place, and how many were marked.
pub fn write_in_place(graph: &Graph) -> Result<(Graph, usize)> {
    let mut g = graph.clone();
    let n = g.tensors().len();
    // Reads of each tensor itself (a node reading it twice counts twice).
    let mut readers = vec![0usize; n];
    for node in g.nodes() {
        for &t in &node.inputs {
            readers[t.index()] += 1;
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
            // A chain of in-place ops shares one storage; a view op's output never qualifies.
            let own_storage = m.view_of.is_none() || g.node(producer).inplace.is_some();
            let root = g.tensor(g.storage_root(x)).role;
            own_storage
                && !root.is_persistent()
                && root != crate::Role::Input
                && !is_output[x.index()]
                && !viewed[x.index()]
                && readers[x.index()] == 1
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
        let c = g.apply1(Binary::add(), &[a, b]).unwrap(); // b dies here: in place over b
        let d = g.apply1(Scale { factor: 0.5 }, &[c]).unwrap(); // c dies here: in place
        g.mark_output(d);
        let (h, marked) = write_in_place(&g).unwrap();
        let flags: Vec<Option<usize>> = h.nodes().iter().map(|n| n.inplace).collect();
        assert_eq!(flags, vec![None, None, Some(1), Some(0)]);
        assert_eq!(marked, 2);
        // d lives in b's storage, through c.
        assert_eq!(h.storage_root(d), b);
        assert_eq!(h.storage_root(c), b);
    }
}
