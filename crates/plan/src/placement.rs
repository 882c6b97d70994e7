//! Offset assignment inside one arena: greedy by size with best fit, as in TFLite's arena
//! planner and XLA's heap simulator. A pure function of sizes and lifetimes, so it is tested
//! with hand-written intervals.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A block of `size` bytes live over schedule positions `first..=last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval {
    pub size: usize,
    pub first: usize,
    pub last: usize,
}

impl Interval {
    pub fn overlaps_in_time(&self, other: &Interval) -> bool {
        self.first <= other.last && other.first <= self.last
    }
}

/// Offsets for a set of intervals, with the arena size they need and the lower bound any
/// placement needs (the most bytes live at one position).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub offsets: Vec<usize>,
    pub arena_bytes: usize,
    pub lower_bound_bytes: usize,
    /// A schedule position where the lower bound is reached.
    pub peak_position: usize,
}

/// Rounds `n` up to a multiple of `align` (a power of two).
pub fn align_up(n: usize, align: usize) -> usize {
    n.div_ceil(align) * align
}

/// Most bytes live at once, and where.
pub fn max_live(intervals: &[Interval]) -> (usize, usize) {
    let mut events: Vec<(usize, bool, usize)> = Vec::with_capacity(2 * intervals.len());
    for iv in intervals {
        events.push((iv.first, true, iv.size));
        events.push((iv.last + 1, false, iv.size));
    }
    // Frees at a position happen before allocations at it.
    events.sort_unstable_by_key(|&(pos, alloc, _)| (pos, alloc));
    let (mut live, mut best, mut at) = (0usize, 0usize, 0usize);
    for (pos, alloc, size) in events {
        if alloc {
            live += size;
            if live > best {
                best = live;
                at = pos;
            }
        } else {
            live -= size;
        }
    }
    (best, at)
}

/// A placement strategy: the order in which intervals are given their offsets. Each places
/// an interval into the smallest gap that fits among the already placed intervals it coexists
/// with, or on top of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Largest first (TFLite's and XLA's greedy by size).
    GreedyBySize,
    /// In order of first use, as a best-fit heap allocator would see them at run time.
    BestFitByFirstUse,
    /// Largest size × lifetime first: long-lived large tensors claim the bottom of the arena.
    GreedyByArea,
}

impl Strategy {
    pub const ALL: [Strategy; 3] = [
        Strategy::GreedyBySize,
        Strategy::BestFitByFirstUse,
        Strategy::GreedyByArea,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::GreedyBySize => "greedy_by_size",
            Strategy::BestFitByFirstUse => "best_fit_by_first_use",
            Strategy::GreedyByArea => "greedy_by_area",
        }
    }
}

/// Runs every strategy (in parallel) and keeps the smallest arena; ties go to the earlier
/// strategy in [`Strategy::ALL`]. Also returns each strategy's arena size.
pub fn place_best(intervals: &[Interval]) -> (Placement, Strategy, Vec<(Strategy, usize)>) {
    place_best_in_chunks(intervals, usize::MAX)
}

/// [`place_best`] in an arena cut into chunks of `chunk` bytes (see [`place_in_chunks`]).
pub fn place_best_in_chunks(
    intervals: &[Interval],
    chunk: usize,
) -> (Placement, Strategy, Vec<(Strategy, usize)>) {
    let results: Vec<(Strategy, Placement)> = std::thread::scope(|s| {
        let handles: Vec<_> = Strategy::ALL
            .iter()
            .map(|&st| s.spawn(move || (st, place_in_chunks(st, intervals, chunk))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    let sizes = results.iter().map(|(s, p)| (*s, p.arena_bytes)).collect();
    let (strategy, placement) = results
        .into_iter()
        .min_by_key(|(s, p)| (p.arena_bytes, Strategy::ALL.iter().position(|x| x == s)))
        .unwrap_or((
            Strategy::GreedyBySize,
            place_in_chunks(Strategy::GreedyBySize, intervals, chunk),
        ));
    (placement, strategy, sizes)
}

/// Greedy by size (see [`Strategy::GreedyBySize`]).
pub fn place(intervals: &[Interval]) -> Placement {
    place_with(Strategy::GreedyBySize, intervals)
}

/// Places every interval (sizes already aligned by the caller) so that no two that are live at
/// the same time overlap in bytes, in the order `strategy` gives.
pub fn place_with(strategy: Strategy, intervals: &[Interval]) -> Placement {
    place_in_chunks(strategy, intervals, usize::MAX)
}

/// The first offset at or after `at` where `size` bytes lie inside one chunk of `chunk` bytes
/// (chunk `i` is bytes `i·chunk..(i+1)·chunk`): `at` itself, or the next chunk's start.
fn fit_in_chunk(at: usize, size: usize, chunk: usize) -> usize {
    if size == 0 || at / chunk == (at + size - 1) / chunk {
        at
    } else {
        (at / chunk + 1) * chunk
    }
}

/// [`place_with`] in an arena a device holds as buffers of at most `chunk` bytes: no interval
/// straddles a multiple of `chunk` (the caller checks none is larger). With `usize::MAX` (no
/// limit), or wherever the plain placement already avoids every boundary, the offsets are the
/// plain placement's.
pub fn place_in_chunks(strategy: Strategy, intervals: &[Interval], chunk: usize) -> Placement {
    let chunk = chunk.max(1);
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
    // Placed blocks kept sorted by (start, end), so the blocks an interval coexists with are
    // met in offset order by one scan with no sort per interval. The scan is over every placed
    // block, so their lifetimes are kept apart from their bytes and tested a run of 64 at a
    // time: the test reads 8 bytes a block and vectorises. The runs split when full, so an
    // insert moves at most a run's blocks, not every block after it (one sorted vector's
    // inserts made the placement quadratic in its moves alone).
    let mut runs: Vec<Run> = vec![Run::empty()];
    // In order of first use, a block that died before this interval's first use is dead for
    // every later interval as well, so it leaves the scan for good: what is scanned is the
    // blocks still live, as a heap allocator's free list sees them.
    let retire = strategy == Strategy::BestFitByFirstUse;
    let mut deaths: BinaryHeap<Reverse<Death>> = BinaryHeap::new();
    let mut arena = 0usize;
    for &i in &order {
        let iv = intervals[i];
        let (first, last) = (position(iv.first), position(iv.last));
        while let Some(&Reverse((died, block, born))) = deaths.peek() {
            if died >= first {
                break;
            }
            deaths.pop();
            remove(&mut runs, block, (born, died));
        }
        let mut fit = BestFit::new(iv.size, chunk);
        'scan: for run in &runs {
            if run.len == 0 || run.max_last < first || run.min_first > last {
                continue; // coexists with none of them
            }
            if run.max_first <= last && run.min_last >= first && run.widest_gap < iv.size {
                // Coexists with all of them, and no gap between them could hold it: for this
                // interval the run is one block.
                if fit.block(run.bytes[0].0, run.top) {
                    break 'scan;
                }
                continue;
            }
            let mut live = [0u8; RUN];
            for ((h, &f), &l) in live
                .iter_mut()
                .zip(&run.firsts[..run.len])
                .zip(&run.lasts[..run.len])
            {
                *h = u8::from(f <= last) & u8::from(first <= l);
            }
            for (w, word) in live.chunks_exact(8).enumerate() {
                // One byte a block, 0 or 1: clearing the lowest set bit clears a block.
                let mut word = u64::from_le_bytes([
                    word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7],
                ]);
                while word != 0 {
                    let (start, stop) = run.bytes[8 * w + word.trailing_zeros() as usize / 8];
                    word &= word - 1;
                    if fit.block(start, stop) {
                        break 'scan;
                    }
                }
            }
        }
        let offset = fit.offset();
        offsets[i] = offset;
        arena = arena.max(offset + iv.size);
        let block = (offset, offset + iv.size);
        insert(&mut runs, block, (first, last));
        if retire {
            deaths.push(Reverse((last, block, first)));
        }
    }
    let (lower_bound_bytes, peak_position) = max_live(intervals);
    Placement {
        offsets,
        arena_bytes: arena,
        lower_bound_bytes,
        peak_position,
    }
}

/// A placed block by its last position: (last, its bytes, first).
type Death = (u32, (usize, usize), u32);

/// The smallest gap that holds `size` bytes (inside one chunk) among blocks met in offset
/// order, or the offset above them all.
struct BestFit {
    size: usize,
    chunk: usize,
    /// The highest end met so far: free space starts there.
    cursor: usize,
    /// (gap size, offset) of the best gap so far.
    best: Option<(usize, usize)>,
}

impl BestFit {
    fn new(size: usize, chunk: usize) -> BestFit {
        BestFit {
            size,
            chunk,
            cursor: 0,
            best: None,
        }
    }

    /// Meets the next block in offset order; true once a gap of exactly `size` is found, which
    /// no later gap can beat.
    fn block(&mut self, start: usize, stop: usize) -> bool {
        if start > self.cursor {
            let gap = start - self.cursor;
            let at = fit_in_chunk(self.cursor, self.size, self.chunk);
            if at.saturating_add(self.size) <= start && self.best.is_none_or(|(g, _)| gap < g) {
                self.best = Some((gap, at));
                if gap == self.size {
                    return true;
                }
            }
        }
        self.cursor = self.cursor.max(stop);
        false
    }

    fn offset(&self) -> usize {
        self.best.map_or_else(
            || fit_in_chunk(self.cursor, self.size, self.chunk),
            |(_, at)| at,
        )
    }
}

/// Blocks in a run of placed ones.
const RUN: usize = 64;

/// Up to [`RUN`] placed blocks, consecutive in (start, end) order: their byte ranges, and
/// apart from them their lifetimes, which the scan reads for every block. A summary lets the
/// scan pass over a run whole: one that coexists with none of its blocks, or with all of them
/// where none of their gaps could hold the interval (blocks of one size stacked by the greedy
/// orders, and the live blocks left in order of first use, mostly are).
#[derive(Clone)]
struct Run {
    len: usize,
    /// Bounds of the blocks' first and last positions.
    min_first: u32,
    max_first: u32,
    min_last: u32,
    max_last: u32,
    /// The widest gap between the blocks, and the highest end among them.
    widest_gap: usize,
    top: usize,
    firsts: [u32; RUN],
    lasts: [u32; RUN],
    bytes: [(usize, usize); RUN],
}

impl Run {
    fn empty() -> Run {
        Run {
            len: 0,
            min_first: 0,
            max_first: 0,
            min_last: 0,
            max_last: 0,
            widest_gap: 0,
            top: 0,
            firsts: [0; RUN],
            lasts: [0; RUN],
            bytes: [(0, 0); RUN],
        }
    }

    /// Puts a block at `at`, moving the ones after it along (the run has room).
    fn insert(&mut self, at: usize, block: (usize, usize), (first, last): (u32, u32)) {
        let n = self.len;
        self.bytes.copy_within(at..n, at + 1);
        self.firsts.copy_within(at..n, at + 1);
        self.lasts.copy_within(at..n, at + 1);
        (self.bytes[at], self.firsts[at], self.lasts[at]) = (block, first, last);
        self.len += 1;
        self.summarise();
    }

    /// Takes out the block at `at`.
    fn remove(&mut self, at: usize) {
        let n = self.len;
        self.bytes.copy_within(at + 1..n, at);
        self.firsts.copy_within(at + 1..n, at);
        self.lasts.copy_within(at + 1..n, at);
        self.len -= 1;
        self.summarise();
    }

    fn summarise(&mut self) {
        let n = self.len;
        let (firsts, lasts) = (&self.firsts[..n], &self.lasts[..n]);
        self.min_first = firsts.iter().copied().min().unwrap_or(0);
        self.max_first = firsts.iter().copied().max().unwrap_or(0);
        self.min_last = lasts.iter().copied().min().unwrap_or(0);
        self.max_last = lasts.iter().copied().max().unwrap_or(0);
        let (mut gap, mut top) = (0usize, 0usize);
        for (k, &(start, stop)) in self.bytes[..n].iter().enumerate() {
            if k > 0 {
                gap = gap.max(start.saturating_sub(top));
            }
            top = top.max(stop);
        }
        (self.widest_gap, self.top) = (gap, top);
    }

    /// Moves the second half of the blocks into a new run.
    fn split(&mut self) -> Run {
        let (half, n) = (self.len / 2, self.len);
        let mut upper = Run::empty();
        upper.len = n - half;
        upper.bytes[..n - half].copy_from_slice(&self.bytes[half..n]);
        upper.firsts[..n - half].copy_from_slice(&self.firsts[half..n]);
        upper.lasts[..n - half].copy_from_slice(&self.lasts[half..n]);
        self.len = half;
        self.summarise();
        upper.summarise();
        upper
    }
}

/// Inserts a placed block after every block that sorts at or before it: where one sorted
/// vector of all of them would put it.
fn insert(runs: &mut Vec<Run>, block: (usize, usize), lifetime: (u32, u32)) {
    // The first run with a block after this one; the last run if none has. (Only a lone run
    // is ever empty: before the first insert, or once every block has been removed.)
    let r = runs
        .partition_point(|run| run.bytes[..run.len].last().is_some_and(|&p| p <= block))
        .min(runs.len() - 1);
    let r = if runs[r].len == RUN {
        let upper = runs[r].split();
        runs.insert(r + 1, upper);
        // The lower half keeps the block unless it sorts after the lower half's last.
        if runs[r].bytes[runs[r].len - 1] <= block {
            r + 1
        } else {
            r
        }
    } else {
        r
    };
    let run = &mut runs[r];
    let at = run.bytes[..run.len].partition_point(|&p| p <= block);
    run.insert(at, block, lifetime);
}

/// Takes a placed block out of the runs (one of the same bytes and lifetime), dropping its run
/// if that leaves it empty and others remain.
fn remove(runs: &mut Vec<Run>, block: (usize, usize), (first, last): (u32, u32)) {
    let mut r = runs.partition_point(|run| run.bytes[..run.len].last().is_some_and(|&p| p < block));
    while r < runs.len() {
        let run = &mut runs[r];
        let mut at = run.bytes[..run.len].partition_point(|&p| p < block);
        while at < run.len && run.bytes[at] == block {
            if (run.firsts[at], run.lasts[at]) == (first, last) {
                run.remove(at);
                if run.len == 0 && runs.len() > 1 {
                    runs.remove(r);
                }
                return;
            }
            at += 1;
        }
        if at < run.len {
            return;
        }
        r += 1;
    }
}

/// A schedule position as the placement stores it: positions index the step's nodes, whose ids
/// are u32, so they fit.
fn position(p: usize) -> u32 {
    u32::try_from(p).unwrap_or(u32::MAX)
}

/// Checks a placement: every interval inside the arena, no two coexisting ones overlapping.
/// Returns the first offending pair.
pub fn find_overlap(intervals: &[Interval], p: &Placement) -> Option<(usize, usize)> {
    for i in 0..intervals.len() {
        let (a, oa) = (&intervals[i], p.offsets[i]);
        if oa + a.size > p.arena_bytes {
            return Some((i, i));
        }
        for (j, b) in intervals.iter().enumerate().skip(i + 1) {
            let ob = p.offsets[j];
            if a.overlaps_in_time(b) && oa < ob + b.size && ob < oa + a.size {
                return Some((i, j));
            }
        }
    }
    None
}
