//! The order nodes execute in.

use snug_graph::{Graph, NodeId};

/// Nodes in the order they were built, which the builder guarantees is topological.
pub fn program_order(graph: &Graph) -> Vec<NodeId> {
    (0..graph.nodes().len() as u32).map(NodeId).collect()
}
