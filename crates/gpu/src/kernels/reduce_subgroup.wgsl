// The workgroup reductions with subgroup shuffles, for adapters with `SUBGROUP`. They give the
// plain tree's bits exactly, whatever the subgroup size and however invocations map to
// subgroups: each round a subgroup folds the tree's next log2(size) levels by XOR butterflies
// (lane bit j standing for the tree's level j of the round, the lower index first on both
// sides of a pair), so only the operands' grouping and order matter, and those are the tree's.
// No size is assumed: it is read at run time, and a workgroup that is not whole subgroups of
// a power of two from 4 to 128 takes the plain tree. Lanes that share `subgroup_id` must be one
// subgroup: native on Vulkan and Metal; on DX12 naga derives the id as
// local_invocation_index / size, which holds where waves are laid out in index order.

struct Lanes {
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) size: u32,
    @builtin(subgroup_id) id: u32,
    @builtin(num_subgroups) count: u32,
}

// Two halves of 64 (the most a round can leave: 256 / 4), rounds alternating between them.
var<workgroup> sg_part: array<f32, 128>;

fn reduce_subgroups(v: f32, lanes: Lanes, is_max: bool) -> f32 {
    scratch[lanes.li] = v;
    workgroupBarrier();
    let size = lanes.size;
    // Uniform across the workgroup: one size a dispatch, one count a workgroup.
    if (size < 4u || size > 128u || (size & (size - 1u)) != 0u || lanes.count * size != 256u) {
        return fold_scratch(lanes.li, is_max);
    }
    let k = countTrailingZeros(size);
    // Values left, as log2: this round folds the top `kk` bits of their index.
    var bits = 8u;
    var round = 0u;
    loop {
        let kk = min(k, bits);
        let m = bits - kk;
        let g = lanes.id;
        var x = 0.0;
        if (g < (1u << m)) {
            // Lane bit j is index bit bits-1-j; the subgroup's id, the index's low m bits.
            let t = ((reverseBits(lanes.lane) >> (32u - kk)) << m) | g;
            if (round == 0u) {
                x = scratch[t];
            } else {
                x = sg_part[((round + 1u) & 1u) * 64u + t];
            }
        }
        for (var mask = 1u; mask < (1u << kk); mask <<= 1u) {
            let other = subgroupShuffleXor(x, mask);
            let upper = (lanes.lane & mask) != 0u;
            x = combine(select(x, other, upper), select(other, x, upper), is_max);
        }
        if (g < (1u << m) && lanes.lane == 0u) {
            sg_part[(round & 1u) * 64u + g] = x;
        }
        workgroupBarrier();
        round += 1u;
        bits = m;
        if (bits == 0u) {
            break;
        }
    }
    // Written in the last round, after which every thread passed a barrier; the next call
    // writes this half only after its first barrier.
    return sg_part[((round + 1u) & 1u) * 64u];
}

fn reduce_sum(v: f32, lanes: Lanes) -> f32 {
    return reduce_subgroups(v, lanes, false);
}

fn reduce_max(v: f32, lanes: Lanes) -> f32 {
    return reduce_subgroups(v, lanes, true);
}
