//! The planner takes the device's memory layout from the graph's target: its alignment, the
//! largest tensor a kernel may bind, the largest buffer.

use snug_graph::ops::{Binary, Scale};
use snug_graph::{CpuGemm, DType, Graph, MemoryLayout, Target};
use snug_plan::{plan, PlanError, PlanOptions};

fn device(memory: MemoryLayout) -> Target {
    Target {
        memory,
        ..Target::cpu(1, CpuGemm::Portable)
    }
}

/// `x: [n]` (an input), `y = 2x`, `z = y + x`: three arena tensors of `4n` bytes.
fn chain(target: Target, n: usize) -> Graph {
    let mut g = Graph::new().with_target(target);
    let x = g.input("x", &[n], DType::F32).unwrap();
    let y = g.apply1(Scale { factor: 2.0 }, &[x]).unwrap();
    let z = g.apply1(Binary::add(), &[y, x]).unwrap();
    g.mark_output(z);
    g
}

#[test]
fn offsets_follow_the_targets_alignment() {
    let layout = MemoryLayout {
        alignment: 256,
        ..MemoryLayout::CPU
    };
    // 10 floats: 40 bytes, each tensor rounded to 256 (64 on the host's layout).
    let p = plan(&chain(device(layout), 10), &PlanOptions::default()).unwrap();
    assert_eq!(p.alignment, 256);
    assert!(p
        .allocations
        .iter()
        .all(|a| a.offset % 256 == 0 && a.size == 256));
    let host = plan(&chain(Target::default(), 10), &PlanOptions::default()).unwrap();
    assert!(host.allocations.iter().all(|a| a.size == 64));
}

#[test]
fn a_tensor_over_the_binding_limit_is_a_named_planning_error() {
    let layout = MemoryLayout {
        max_binding_bytes: 1024,
        ..MemoryLayout::CPU
    };
    assert!(plan(&chain(device(layout), 256), &PlanOptions::default()).is_ok());
    let err = plan(&chain(device(layout), 257), &PlanOptions::default()).unwrap_err();
    assert_eq!(
        err,
        PlanError::LargerThanBinding {
            name: "x".into(),
            bytes: 1028,
            limit: 1024
        }
    );
    assert!(err.to_string().contains("`x` is 1028 bytes"), "{err}");
}

/// An arena over the largest buffer is cut into chunks no tensor straddles; a single tensor
/// over the largest buffer is a named planning error.
#[test]
fn an_arena_over_the_largest_buffer_is_split_into_chunks() {
    // x, y and z are all live when z is made: 3 × 4n bytes.
    let layout = MemoryLayout {
        max_buffer_bytes: 12288,
        ..MemoryLayout::CPU
    };
    let fits = plan(&chain(device(layout), 1024), &PlanOptions::default()).unwrap();
    assert_eq!(fits.arena_bytes, 12288);
    assert_eq!(fits.chunks(), &[12288]);
    let host = plan(
        &chain(device(MemoryLayout::CPU), 1024),
        &PlanOptions::default(),
    )
    .unwrap();
    assert_eq!(fits.allocations, host.allocations);

    // 8 KiB each: two never share a 12 KiB chunk, so each takes one.
    let g = chain(device(layout), 2048);
    let split = plan(&g, &PlanOptions::default()).unwrap();
    assert_eq!(split.chunks(), &[12288, 12288, 8192]);
    assert_eq!(split.arena_bytes, 32768);
    assert_eq!(split.peak_bytes(), 32768);
    let mut slots: Vec<(usize, usize)> = split
        .allocations
        .iter()
        .map(|a| split.arena_slot(a.tensor).unwrap())
        .collect();
    slots.sort_unstable();
    assert_eq!(slots, vec![(0, 0), (1, 0), (2, 0)]);
    let json = serde_json::to_value(&split).unwrap();
    assert_eq!(
        json["arena_chunks"],
        serde_json::json!([12288, 12288, 8192])
    );
    assert!(serde_json::to_value(&fits)
        .unwrap()
        .get("arena_chunks")
        .is_none());

    let err = plan(&chain(device(layout), 4096), &PlanOptions::default()).unwrap_err();
    assert_eq!(
        err,
        PlanError::LargerThanBuffer {
            what: "tensor `x`".into(),
            bytes: 16384,
            limit: 12288
        }
    );
    assert!(
        err.to_string().contains("tensor `x` needs 16384 bytes"),
        "{err}"
    );
}
