//! Data-parallel helpers for kernels: split work into chunks large enough to amortise rayon.
//! Each runs its closure under [`vectorized`], which compiles it for the CPU's level only where
//! it is inlined: callers pass `#[inline(always)] |…|` closures ([`crate::isa`]'s notes).

use rayon::prelude::*;

use crate::isa::vectorized;

pub use snug_graph::ops::MIN_PAR_ELEMS;

/// Runs `f(start_index, chunk)` over `out` in parallel chunks of whole rows of `row` elements.
pub fn rows_mut<F>(out: &mut [f32], row: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync + Send,
{
    let row = row.max(1);
    let rows_per_chunk = (MIN_PAR_ELEMS / row).max(1);
    let chunk = rows_per_chunk * row;
    if out.len() <= chunk {
        vectorized(
            #[inline(always)]
            || f(0, out),
        );
        return;
    }
    out.par_chunks_mut(chunk).enumerate().for_each(|(c, part)| {
        vectorized(
            #[inline(always)]
            || f(c * rows_per_chunk, part),
        )
    });
}

/// Like [`rows_mut`] for two outputs with the same row structure (`a_row`, `b_row` per row).
pub fn rows_mut2<F>(a: &mut [f32], a_row: usize, b: &mut [f32], b_row: usize, f: F)
where
    F: Fn(usize, &mut [f32], &mut [f32]) + Sync + Send,
{
    let rows_per_chunk = (MIN_PAR_ELEMS / a_row.max(1)).max(1);
    if a.len() <= rows_per_chunk * a_row {
        vectorized(
            #[inline(always)]
            || f(0, a, b),
        );
        return;
    }
    a.par_chunks_mut(rows_per_chunk * a_row)
        .zip(b.par_chunks_mut(rows_per_chunk * b_row))
        .enumerate()
        .for_each(|(c, (pa, pb))| {
            vectorized(
                #[inline(always)]
                || f(c * rows_per_chunk, pa, pb),
            )
        });
}

/// Elementwise map over a flat output: `f(start, chunk)` with `start` the first element's index.
pub fn elems_mut<F>(out: &mut [f32], f: F)
where
    F: Fn(usize, &mut [f32]) + Sync + Send,
{
    if out.len() <= MIN_PAR_ELEMS {
        vectorized(
            #[inline(always)]
            || f(0, out),
        );
        return;
    }
    let chunk = MIN_PAR_ELEMS;
    out.par_chunks_mut(chunk).enumerate().for_each(|(c, part)| {
        vectorized(
            #[inline(always)]
            || f(c * chunk, part),
        )
    });
}

/// A raw pointer that worker threads may share, for kernels whose work items write disjoint,
/// non-contiguous regions of one buffer (attention heads, rows of one position).
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub(crate) *mut f32);
// SAFETY: used only to hand disjoint regions of one buffer to worker threads.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    // A method, so closures capture the whole (Send) wrapper rather than its raw field.
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// Runs `f(item, scratch)` for every item in `0..items`, one `per_slot` slice of the workspace
/// per worker (`ws.len() / per_slot` slots). Each slot takes the next item when it finishes
/// one, so a core that other tenants slow down takes fewer: on the shared host one core often
/// runs at 0.6× while the other does not, and a fixed deal waits for the slow one.
pub(crate) fn for_each_item<F>(ws: &mut [f32], per_slot: usize, items: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync + Send,
{
    use std::sync::atomic::{AtomicUsize, Ordering};
    if items == 0 {
        return;
    }
    if per_slot == 0 {
        (0..items).into_par_iter().for_each(|item| {
            vectorized(
                #[inline(always)]
                || f(item, &mut []),
            )
        });
        return;
    }
    let slots = (ws.len() / per_slot).max(1).min(items);
    let next = AtomicUsize::new(0);
    ws.par_chunks_mut(per_slot)
        .take(slots)
        .for_each(|scratch| loop {
            let item = next.fetch_add(1, Ordering::Relaxed);
            if item >= items {
                break;
            }
            vectorized(
                #[inline(always)]
                || f(item, scratch),
            );
        });
}

/// `y[i] = f(x[i])` in parallel chunks; one closure per call site so each loop vectorises.
pub fn map(x: &[f32], y: &mut [f32], f: impl Fn(f32) -> f32 + Sync + Send) {
    elems_mut(
        y,
        #[inline(always)]
        |start, out| {
            let n = out.len();
            for (o, &v) in out.iter_mut().zip(&x[start..start + n]) {
                *o = f(v);
            }
        },
    );
}

/// A one-input elementwise kernel `y = f(x)`, run over `x`'s bytes when the node is in place.
pub fn unary(k: &crate::kernel::Kernel<'_>, f: impl Fn(f32) -> f32 + Sync + Send) {
    if k.inplace().is_some() {
        elems_mut(
            k.out_f32(0),
            #[inline(always)]
            |_, out| {
                for o in out {
                    *o = f(*o);
                }
            },
        );
    } else {
        map(k.in_f32(0), k.out_f32(0), f);
    }
}

/// A two-input elementwise kernel `y = f(a, b)` over same-shape inputs, run over the bytes of
/// whichever input the node writes in place.
pub fn binary(k: &crate::kernel::Kernel<'_>, f: impl Fn(f32, f32) -> f32 + Sync + Send) {
    match k.inplace() {
        Some(0) => update(k.in_f32(1), k.out_f32(0), |b, a| f(a, b)),
        Some(_) => update(k.in_f32(0), k.out_f32(0), f),
        None => map2(k.in_f32(0), k.in_f32(1), k.out_f32(0), f),
    }
}

/// `y[i] = f(x[i], y[i])`: `y` holds the other operand on entry.
fn update(x: &[f32], y: &mut [f32], f: impl Fn(f32, f32) -> f32 + Sync + Send) {
    elems_mut(
        y,
        #[inline(always)]
        |start, out| {
            let n = out.len();
            for (o, &v) in out.iter_mut().zip(&x[start..start + n]) {
                *o = f(v, *o);
            }
        },
    );
}

/// `y[i] = f(a[i], b[i])` in parallel chunks.
pub fn map2(a: &[f32], b: &[f32], y: &mut [f32], f: impl Fn(f32, f32) -> f32 + Sync + Send) {
    elems_mut(
        y,
        #[inline(always)]
        |start, out| {
            let n = out.len();
            for ((o, &u), &v) in out
                .iter_mut()
                .zip(&a[start..start + n])
                .zip(&b[start..start + n])
            {
                *o = f(u, v);
            }
        },
    );
}

/// While alive, keeps the current pool's other workers polling for work instead of sleeping:
/// a launch's kernels open hundreds of parallel regions a step with short serial stretches
/// between them, and a rayon worker that finds no work for a few microseconds sleeps, to be
/// woken (a futex, under a hypervisor an inter-processor interrupt) at the next region. On
/// 2 vCPUs of an Emerald Rapids host that was ~600 sleeps a step; OpenMP's workers (PyTorch's)
/// spin instead. Ours spin too, yielding their CPU every [`YIELD_EVERY`] polls, so another
/// process on the machine still gets its share. Made on a worker thread, inside the pool it keeps; it is not made where the
/// workers outnumber the CPUs this process may use, since a spinner would then take a CPU a
/// working thread needs.
pub(crate) struct KeepAwake {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// Polls a poller spins between yields of its CPU.
const YIELD_EVERY: u32 = 64;

impl KeepAwake {
    /// Spawns one poller for each other worker of the current pool; `None` where there are
    /// none, or more workers than CPUs (see above), or outside a pool.
    pub(crate) fn start(cpus: usize) -> Option<KeepAwake> {
        use std::sync::atomic::{AtomicBool, Ordering};
        let me = rayon::current_thread_index()?;
        let workers = rayon::current_num_threads();
        if workers < 2 || workers > cpus {
            return None;
        }
        let done = std::sync::Arc::new(AtomicBool::new(false));
        for _ in 1..workers {
            let flag = done.clone();
            rayon::spawn(move || {
                // Taken by the launching thread itself (waiting in a join), it must not stay:
                // the launch could not go on to end it. (Spawned into every worker's own queue
                // instead, a worker busy with a stolen half of the launch's join took its copy
                // while waiting inside that half, and never returned it: the launch hung.)
                if rayon::current_thread_index() == Some(me) {
                    return;
                }
                let mut polls = 0u32;
                while !flag.load(Ordering::Acquire) {
                    // Runs pending work (stolen halves of the launch's joins) as it appears.
                    // Else it spins, yielding its CPU every `YIELD_EVERY` polls: where nothing
                    // else is runnable there the yield returns at once, and where another
                    // process is, it gets the CPU. Beside one busy process char-small's step
                    // took 2.7–2.8 s in f32 and 1.4–1.6 s in bf16 so, 3.1–3.2 and 2.1 s
                    // spinning alone; yielding at every poll, as fast there, cost a tenth of
                    // the bf16 step on an idle host.
                    if rayon::yield_now() != Some(rayon::Yield::Executed) {
                        polls = polls.wrapping_add(1);
                        if polls.is_multiple_of(YIELD_EVERY) {
                            std::thread::yield_now();
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                }
            });
        }
        Some(KeepAwake { done })
    }
}

impl Drop for KeepAwake {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::KeepAwake;
    use std::sync::Barrier;
    use std::time::{Duration, Instant};

    /// Each worker's voluntary context switches so far (Linux's count for its thread), by
    /// worker index.
    #[cfg(target_os = "linux")]
    fn voluntary_switches(pool: &rayon::ThreadPool) -> Vec<u64> {
        pool.broadcast(|_| {
            let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
            status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap()
        })
    }

    /// A launch's pattern: serial stretches (here 300 µs) between small parallel regions.
    fn stretches_and_regions() -> u64 {
        let mut total = 0u64;
        for i in 0..200u64 {
            let until = Instant::now() + Duration::from_micros(300);
            while Instant::now() < until {
                std::hint::spin_loop();
            }
            let (a, b) = rayon::join(
                || std::hint::black_box(i * 3),
                || std::hint::black_box(i * 5),
            );
            total += a + b;
        }
        total
    }

    /// Kept awake, the other worker takes each region's work without sleeping between them;
    /// left alone it sleeps in (nearly) every stretch, which is what the poller is for. Only
    /// the other worker's sleeps count: the launching one may sleep in a join whose stolen half
    /// waits on a busy machine, which is not the poller's to prevent.
    #[cfg(target_os = "linux")]
    #[test]
    fn other_workers_poll_between_regions_while_kept_awake() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let run = |keep: bool| {
            let before = voluntary_switches(&pool);
            let (total, me) = pool.install(|| {
                let _awake = keep.then(|| KeepAwake::start(2).expect("a poller"));
                (
                    stretches_and_regions(),
                    rayon::current_thread_index().unwrap(),
                )
            });
            assert_eq!(total, (0..200u64).map(|i| 8 * i).sum::<u64>());
            let other = 1 - me;
            voluntary_switches(&pool)[other] - before[other]
        };
        let (kept, left) = (run(true), run(false));
        eprintln!("voluntary context switches over 200 regions: {kept} kept awake, {left} not");
        assert!(kept < 40, "{kept} sleeps over 200 regions while kept awake");
    }

    /// After a launch, pollers let go of their workers: a job that needs every worker at once
    /// runs, and nested parallel work under a poller finishes with the right result.
    #[test]
    fn pollers_release_their_workers() {
        for threads in [2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let sum: u64 = pool.install(|| {
                let _awake = KeepAwake::start(threads).expect("a poller");
                use rayon::prelude::*;
                (0..10_000u64).into_par_iter().map(|i| i % 7).sum()
            });
            assert_eq!(sum, (0..10_000u64).map(|i| i % 7).sum::<u64>());
            let all = Barrier::new(threads);
            pool.broadcast(|_| {
                all.wait();
            });
        }
    }

    #[test]
    fn no_poller_where_workers_outnumber_the_cpus_or_outside_a_pool() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        assert!(pool.install(|| KeepAwake::start(2)).is_none());
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        assert!(one.install(|| KeepAwake::start(8)).is_none());
        assert!(KeepAwake::start(8).is_none(), "outside any pool");
    }
}
