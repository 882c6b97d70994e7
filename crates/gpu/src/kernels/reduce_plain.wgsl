// The workgroup reductions without subgroup operations: the tree in workgroup memory.

// The builtins a reducing entry point takes (`lanes: Lanes`).
struct Lanes {
    @builtin(local_invocation_index) li: u32,
}

fn reduce_tree(v: f32, lanes: Lanes, is_max: bool) -> f32 {
    scratch[lanes.li] = v;
    workgroupBarrier();
    return fold_scratch(lanes.li, is_max);
}

fn reduce_sum(v: f32, lanes: Lanes) -> f32 {
    return reduce_tree(v, lanes, false);
}

fn reduce_max(v: f32, lanes: Lanes) -> f32 {
    return reduce_tree(v, lanes, true);
}
