//! The placement pass on hand-written intervals: no two coexisting intervals share a byte, every
//! interval fits in the arena, and the lower bound is the true maximum of live bytes.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use snug_plan::placement::{find_overlap, max_live};
use snug_plan::{
    place, place_best, place_best_in_chunks, place_in_chunks, place_with, Interval, Placement,
    Strategy,
};

fn iv(size: usize, first: usize, last: usize) -> Interval {
    Interval { size, first, last }
}

/// Bytes live at `pos`, straight from the definition.
fn live_at(intervals: &[Interval], pos: usize) -> usize {
    intervals
        .iter()
        .filter(|iv| iv.first <= pos && pos <= iv.last)
        .map(|iv| iv.size)
        .sum()
}

/// The most bytes live at any position, by trying every position.
fn brute_force_peak(intervals: &[Interval]) -> usize {
    let end = intervals.iter().map(|iv| iv.last).max().unwrap_or(0);
    (0..=end).map(|p| live_at(intervals, p)).max().unwrap_or(0)
}

/// Every property a placement must have, checked without trusting the planner's own checker.
fn assert_valid(intervals: &[Interval], p: &Placement, case: &str) {
    assert_eq!(p.offsets.len(), intervals.len(), "{case}: one offset each");
    for (i, (a, &oa)) in intervals.iter().zip(&p.offsets).enumerate() {
        assert!(
            oa + a.size <= p.arena_bytes,
            "{case}: interval {i} ({a:?} at {oa}) ends past the arena ({})",
            p.arena_bytes
        );
        for (j, (b, &ob)) in intervals.iter().zip(&p.offsets).enumerate().skip(i + 1) {
            let in_time = a.first <= b.last && b.first <= a.last;
            let in_bytes = oa < ob + b.size && ob < oa + a.size;
            assert!(
                !(in_time && in_bytes),
                "{case}: intervals {i} ({a:?} at {oa}) and {j} ({b:?} at {ob}) overlap"
            );
        }
    }
    // The arena is no bigger than its highest interval needs.
    let top = intervals
        .iter()
        .zip(&p.offsets)
        .map(|(iv, &o)| o + iv.size)
        .max()
        .unwrap_or(0);
    assert_eq!(p.arena_bytes, top, "{case}: arena is not tight");
    assert_eq!(
        find_overlap(intervals, p),
        None,
        "{case}: find_overlap disagrees"
    );

    let peak = brute_force_peak(intervals);
    assert_eq!(p.lower_bound_bytes, peak, "{case}: lower bound");
    assert_eq!(
        max_live(intervals),
        (p.lower_bound_bytes, p.peak_position),
        "{case}: max_live"
    );
    assert_eq!(
        live_at(intervals, p.peak_position),
        peak,
        "{case}: peak_position {} is not where the peak is",
        p.peak_position
    );
    assert!(
        p.arena_bytes >= p.lower_bound_bytes,
        "{case}: arena below bound"
    );
}

fn random_intervals(rng: &mut ChaCha8Rng) -> Vec<Interval> {
    let n = rng.random_range(1..=40);
    let horizon = rng.random_range(1..=60);
    let aligned = rng.random::<bool>();
    (0..n)
        .map(|_| {
            // Half the cases use 64-byte multiples, as `plan` produces; the rest any size.
            let size = if aligned {
                64 * rng.random_range(1..=64)
            } else {
                rng.random_range(1..=5000)
            };
            let first = rng.random_range(0..horizon);
            let last = first + rng.random_range(0..=horizon / 2);
            iv(size, first, last)
        })
        .collect()
}

#[test]
fn random_interval_sets_place_validly() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0001);
    for case in 0..200 {
        let intervals = random_intervals(&mut rng);
        let p = place(&intervals);
        assert_valid(&intervals, &p, &format!("case {case}"));
        assert_eq!(
            place(&intervals),
            p,
            "case {case}: placement is not deterministic"
        );
    }
}

#[test]
fn many_equal_sizes_and_shared_positions() {
    // Ties everywhere: equal sizes, intervals starting and ending at the same positions.
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0002);
    for case in 0..200 {
        let n = rng.random_range(1..=30);
        let intervals: Vec<Interval> = (0..n)
            .map(|_| {
                let first = rng.random_range(0..4);
                iv(
                    64 * rng.random_range(1..=2),
                    first,
                    first + rng.random_range(0..3),
                )
            })
            .collect();
        let p = place(&intervals);
        assert_valid(&intervals, &p, &format!("tie case {case}"));
    }
}

#[test]
fn disjoint_lifetimes_share_one_offset() {
    // Nothing coexists: everything goes at 0 and the arena is the largest interval.
    let intervals = [iv(100, 0, 1), iv(300, 2, 2), iv(200, 3, 7)];
    let p = place(&intervals);
    assert_valid(&intervals, &p, "disjoint");
    assert_eq!(p.offsets, [0, 0, 0]);
    assert_eq!((p.arena_bytes, p.lower_bound_bytes), (300, 300));
    assert_eq!(p.peak_position, 2);
}

#[test]
fn three_intervals_hand_computed() {
    // A [0,2] 100 B, B [1,3] 50 B, C [3,4] 80 B. Largest first: A at 0; C does not meet A in
    // time, so it also goes at 0; B meets both (A at 1..2, C at 3), whose bytes cover 0..100,
    // so B goes on top at 100. Live bytes by position: 100, 150, 150, 130, 80.
    let intervals = [iv(100, 0, 2), iv(50, 1, 3), iv(80, 3, 4)];
    let p = place(&intervals);
    assert_valid(&intervals, &p, "three");
    assert_eq!(
        p,
        Placement {
            offsets: vec![0, 100, 0],
            arena_bytes: 150,
            lower_bound_bytes: 150,
            peak_position: 1,
        }
    );
}

#[test]
fn best_fit_takes_the_smallest_gap_that_fits() {
    // At position 0 five blocks stack up in size order: 0..128, 128..224, 224..304, 304..368,
    // 368..416. At position 1 the second and fourth have died, leaving gaps of 96 B at 128 and
    // 64 B at 304. A 32 B block live at 1 goes into the 64 B gap (best fit), not the first one.
    let intervals = [
        iv(128, 0, 1),
        iv(96, 0, 0),
        iv(80, 0, 1),
        iv(64, 0, 0),
        iv(48, 0, 1),
        iv(32, 1, 1),
    ];
    let p = place(&intervals);
    assert_valid(&intervals, &p, "best fit");
    assert_eq!(p.offsets, [0, 128, 224, 304, 368, 304]);
    assert_eq!((p.arena_bytes, p.lower_bound_bytes), (416, 416));
    assert_eq!(p.peak_position, 0);
    // Live at 1: 128 + 80 + 48 + 32.
    assert_eq!(live_at(&intervals, 1), 288);
}

#[test]
fn a_gap_too_small_is_skipped() {
    // A (100 B, 0..=1) at 0; B (90 B, 1..=2) meets A, so it goes to 100..190; C (80 B, 2..=3)
    // meets only B, so the 100 B hole under B takes it at 0; D (30 B, 2..=2) meets B and C and
    // the 20 B hole at 80..100 is too small, so D goes on top at 190.
    let intervals = [iv(100, 0, 1), iv(90, 1, 2), iv(80, 2, 3), iv(30, 2, 2)];
    let p = place(&intervals);
    assert_valid(&intervals, &p, "too small");
    assert_eq!(p.offsets, [0, 100, 0, 190]);
    assert_eq!(p.arena_bytes, 220);
    // Live bytes by position: 100, 190, 200, 80. The hole costs 20 B over the bound.
    assert_eq!((p.lower_bound_bytes, p.peak_position), (200, 2));
}

#[test]
fn empty_and_single() {
    let p = place(&[]);
    assert_eq!((p.arena_bytes, p.lower_bound_bytes), (0, 0));
    assert!(p.offsets.is_empty());

    let one = [iv(64, 5, 9)];
    let p = place(&one);
    assert_valid(&one, &p, "single");
    assert_eq!((p.offsets[0], p.arena_bytes, p.peak_position), (0, 64, 5));
}

#[test]
fn find_overlap_reports_a_bad_placement() {
    // The checker itself must catch what it is meant to catch.
    let intervals = [iv(100, 0, 2), iv(50, 1, 3)];
    let overlapping = Placement {
        offsets: vec![0, 60],
        arena_bytes: 110,
        lower_bound_bytes: 150,
        peak_position: 1,
    };
    assert_eq!(find_overlap(&intervals, &overlapping), Some((0, 1)));
    let outside = Placement {
        offsets: vec![0, 100],
        arena_bytes: 120,
        lower_bound_bytes: 150,
        peak_position: 1,
    };
    assert_eq!(find_overlap(&intervals, &outside), Some((1, 1)));
    // Same bytes at different times is fine.
    let later = [iv(100, 0, 2), iv(50, 3, 3)];
    let shared = Placement {
        offsets: vec![0, 0],
        arena_bytes: 100,
        lower_bound_bytes: 100,
        peak_position: 0,
    };
    assert_eq!(find_overlap(&later, &shared), None);
}

/// The placement as first written: for each interval in the strategy's order, collect the
/// placed blocks it coexists with, sort them by offset, and take the smallest gap that fits
/// (inside one chunk of `chunk` bytes). `place_in_chunks` scans runs of placed blocks kept in
/// offset order instead, which split as they fill; it must choose the very same offsets.
fn reference_place(strategy: Strategy, intervals: &[Interval], chunk: usize) -> Vec<usize> {
    let fit = |at: usize, size: usize| {
        if size == 0 || at / chunk == (at + size - 1) / chunk {
            at
        } else {
            (at / chunk + 1) * chunk
        }
    };
    let mut order: Vec<usize> = (0..intervals.len()).collect();
    let area = |iv: &Interval| iv.size as u128 * (iv.last - iv.first + 1) as u128;
    order.sort_by(|&a, &b| {
        let (x, y) = (&intervals[a], &intervals[b]);
        let key = match strategy {
            Strategy::GreedyBySize => y.size.cmp(&x.size).then(x.first.cmp(&y.first)),
            Strategy::BestFitByFirstUse => x.first.cmp(&y.first).then(y.size.cmp(&x.size)),
            Strategy::GreedyByArea => area(y).cmp(&area(x)).then(y.size.cmp(&x.size)),
        };
        key.then(a.cmp(&b))
    });
    let mut offsets = vec![0usize; intervals.len()];
    let mut placed: Vec<usize> = Vec::new();
    for &i in &order {
        let iv = intervals[i];
        let mut neighbours: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&j| intervals[j].overlaps_in_time(&iv))
            .map(|&j| (offsets[j], offsets[j] + intervals[j].size))
            .collect();
        neighbours.sort_unstable();
        let mut best: Option<(usize, usize)> = None;
        let mut cursor = 0usize;
        for (start, end) in neighbours {
            if start > cursor {
                let gap = start - cursor;
                let at = fit(cursor, iv.size);
                if at + iv.size <= start && best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, at));
                }
            }
            cursor = cursor.max(end);
        }
        offsets[i] = best.map_or_else(|| fit(cursor, iv.size), |(_, off)| off);
        placed.push(i);
    }
    offsets
}

#[test]
fn placement_chooses_the_reference_offsets() {
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for case in 0..300 {
        // A tenth of the cases place enough blocks to fill and split many runs of 64.
        let n = if case % 10 == 0 {
            rng.random_range(300..700)
        } else {
            rng.random_range(1..120)
        };
        let horizon = rng.random_range(1..60);
        // Few distinct sizes, so ties between equal blocks are common; some empty, which
        // split the gap they are placed in.
        let intervals: Vec<Interval> = (0..n)
            .map(|_| {
                let first = rng.random_range(0..horizon);
                Interval {
                    size: 64 * rng.random_range(0..6),
                    first,
                    last: rng.random_range(first..horizon),
                }
            })
            .collect();
        for strategy in Strategy::ALL {
            let p = place_with(strategy, &intervals);
            assert_eq!(
                p.offsets,
                reference_place(strategy, &intervals, usize::MAX),
                "case {case}, {strategy:?}"
            );
            assert_eq!(find_overlap(&intervals, &p), None, "case {case}");
            let chunk = 64 * rng.random_range(5..12);
            let p = place_in_chunks(strategy, &intervals, chunk);
            assert_eq!(
                p.offsets,
                reference_place(strategy, &intervals, chunk),
                "case {case}, {strategy:?}, chunk {chunk}"
            );
        }
    }
}

/// Intervals shaped like a training step's: each layer's forward saves stacks of equal-sized
/// activations kept until its backward (nested lifetimes), beside short temporaries of a few
/// sizes and small long-lived blocks, over a schedule far longer than the random cases'. Here
/// the runs of placed blocks fill, split and (in order of first use, where dead blocks leave
/// the scan) empty; whole runs are passed over; the offsets must still be the reference's.
#[test]
fn step_shaped_placements_choose_the_reference_offsets() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x57e9);
    for case in 0..6 {
        let layers = rng.random_range(20..50);
        let per_layer = 12;
        let end = 2 * layers * per_layer + 4;
        let backward = |l: usize| end - 2 - (l + 1) * per_layer;
        let mut intervals = Vec::new();
        for l in 0..layers {
            let at = 2 + l * per_layer;
            for k in 0..3 {
                let size = 64 << (4 + 2 * k);
                intervals.push(iv(size, at + k, backward(l) + k));
            }
            intervals.push(iv(64, at, backward(l) + rng.random_range(0..per_layer)));
            for t in 0..per_layer {
                let size = 64 * [1, 16, 4096, 16][rng.random_range(0..4)];
                let (first, back) = (at + t, backward(l) + t);
                intervals.push(iv(size, first, first + rng.random_range(0..3)));
                intervals.push(iv(size, back, (back + rng.random_range(0..3)).min(end)));
            }
        }
        // Parameters' gradients, live from their layer's backward to the end.
        for l in 0..layers {
            intervals.push(iv(64 * 512, backward(l), end));
        }
        for strategy in Strategy::ALL {
            for chunk in [usize::MAX, 64 * rng.random_range(5000..20000)] {
                let p = place_in_chunks(strategy, &intervals, chunk);
                assert_eq!(
                    p.offsets,
                    reference_place(strategy, &intervals, chunk),
                    "case {case}, {strategy:?}, chunk {chunk}"
                );
                assert_eq!(find_overlap(&intervals, &p), None, "case {case}");
            }
        }
    }
}

/// An arena cut into chunks: every placement stays valid, no interval straddles a multiple of
/// the chunk size, and where the plain placement already fits one chunk the offsets are its.
#[test]
fn chunked_placements_never_straddle_a_chunk_boundary() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0c4c);
    let mut split = 0;
    for case in 0..200 {
        let intervals = random_intervals(&mut rng);
        let largest = intervals.iter().map(|iv| iv.size).max().unwrap_or(1);
        let chunk = largest + rng.random_range(0..=largest);
        for strategy in Strategy::ALL {
            let plain = place_with(strategy, &intervals);
            let p = place_in_chunks(strategy, &intervals, chunk);
            let case = format!("case {case}, {strategy:?}, chunks of {chunk}");
            assert_valid(&intervals, &p, &case);
            for (iv, &o) in intervals.iter().zip(&p.offsets) {
                assert_eq!(
                    o / chunk,
                    (o + iv.size - 1) / chunk,
                    "{case}: {iv:?} at {o}"
                );
            }
            if plain.arena_bytes <= chunk {
                assert_eq!(p, plain, "{case}: one chunk places as without chunks");
            } else {
                split += 1;
            }
            assert_eq!(place_in_chunks(strategy, &intervals, usize::MAX), plain);
        }
        let (best, ..) = place_best_in_chunks(&intervals, usize::MAX);
        assert_eq!(best, place_best(&intervals).0);
    }
    assert!(split > 100, "only {split} cases needed more than one chunk");
}

/// Three tensors of 60 bytes live together in chunks of 100: one per chunk, each at its
/// chunk's start; the last chunk ends at the last tensor.
#[test]
fn chunks_hand_computed() {
    let intervals = [iv(60, 0, 2), iv(60, 1, 2), iv(60, 2, 2)];
    let p = place_in_chunks(Strategy::GreedyBySize, &intervals, 100);
    assert_eq!(p.offsets, vec![0, 100, 200]);
    assert_eq!((p.arena_bytes, p.lower_bound_bytes), (260, 180));
    // 40-byte tensors fill the gaps a chunk leaves before its boundary.
    let with_small = [iv(60, 0, 2), iv(60, 1, 2), iv(40, 1, 2)];
    let p = place_in_chunks(Strategy::GreedyBySize, &with_small, 100);
    assert_eq!(p.offsets, vec![0, 100, 60]);
    assert_eq!(p.arena_bytes, 160);
}
