//! The kernels of the collectives: packing buckets and padded shards, around the transport
//! that moves them between ranks ([`Transport`], MPI in `snug-mpi`). Without a transport the
//! world is this one process, rank 0 of 1, and every collective is a copy.

use std::sync::OnceLock;

use snug_graph::ops::{
    shard_len, AllGather, AllReduce, Bucketed, CollectiveStart, CollectiveWait, ReduceScatter,
    ShardedAdamW,
};

use crate::kernel::{CpuKernel, Kernel};

/// Moves f32 buffers between the ranks of a run. Every rank calls the same collectives in the
/// same order (they are nodes of one step graph, run in one schedule).
pub trait Transport: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Every rank's `buf` summed, in place.
    fn all_reduce_sum(&self, buf: &mut [f32]);
    /// `send` holds `size` equal blocks; `recv` gets the sum of every rank's block `rank`.
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]);
    /// `recv` gets every rank's `send`, in rank order.
    fn all_gather(&self, send: &[f32], recv: &mut [f32]);

    /// Starts summing every rank's `send` into `recv` and returns without waiting;
    /// [`Transport::wait`] with `recv`'s address completes it. Blocking unless overridden.
    ///
    /// # Safety
    /// Neither buffer may be freed, read or written until that wait returns.
    unsafe fn start_all_reduce_sum(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(send);
        self.all_reduce_sum(recv);
    }

    /// [`Transport::reduce_scatter_sum`], started as [`Transport::start_all_reduce_sum`] is.
    ///
    /// # Safety
    /// As for [`Transport::start_all_reduce_sum`].
    unsafe fn start_reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) {
        self.reduce_scatter_sum(send, recv);
    }

    /// Completes the collective started with its receive buffer at address `recv`.
    fn wait(&self, _recv: usize) {}

    /// Lets started collectives advance: MPI moves their bytes only inside its own calls,
    /// so the step calls this between nodes.
    fn progress(&self) {}
}

/// Advances the collectives in flight, if any (between two nodes of a step).
pub fn progress() {
    if let Some(t) = TRANSPORT.get() {
        t.progress();
    }
}

static TRANSPORT: OnceLock<Box<dyn Transport>> = OnceLock::new();

/// Installs the transport every collective kernel of this process runs over; the first one
/// installed stays (a process belongs to one run). Returns whether `t` was installed.
pub fn set_transport(t: Box<dyn Transport>) -> bool {
    TRANSPORT.set(t).is_ok()
}

/// This process's rank and the number of ranks: `(0, 1)` without a transport.
pub fn world() -> (usize, usize) {
    TRANSPORT.get().map_or((0, 1), |t| (t.rank(), t.size()))
}

/// The installed transport, for collectives outside the step graph (the step's loss over every
/// rank, start-up checks); `None` in a world of one.
pub fn installed() -> Option<&'static dyn Transport> {
    TRANSPORT.get().map(|t| t.as_ref())
}

/// The transport for a collective compiled for `ranks` ranks. A step compiled for another
/// world than the one running it is refused when its session loads (`CpuBackend::check`), so
/// a mismatch here is a bug.
fn transport(ranks: usize) -> Option<&'static dyn Transport> {
    let (_, size) = world();
    assert_eq!(
        size, ranks,
        "a step compiled for {ranks} ranks runs in a world of {size}"
    );
    TRANSPORT.get().map(|t| t.as_ref())
}

impl CpuKernel for AllReduce {
    fn run(&self, k: &Kernel<'_>) {
        if self.once_per_step && !k.ctx.is_last_micro() {
            return;
        }
        let t = transport(self.ranks);
        let n = k.in_count();
        let scale = if self.mean {
            1.0 / self.ranks as f32
        } else {
            1.0
        };
        let finish = |buf: &mut [f32]| {
            if let Some(t) = t {
                t.all_reduce_sum(buf);
            }
            if scale != 1.0 {
                buf.iter_mut().for_each(|x| *x *= scale);
            }
        };
        if n == 1 {
            let out = k.out_f32(0);
            out.copy_from_slice(k.in_f32(0));
            finish(out);
            return;
        }
        let ws = k.workspace();
        let mut at = 0;
        for i in 0..n {
            let x = k.in_f32(i);
            ws[at..at + x.len()].copy_from_slice(x);
            at += x.len();
        }
        finish(&mut ws[..at]);
        at = 0;
        for i in 0..n {
            let out = k.out_f32(i);
            out.copy_from_slice(&ws[at..at + out.len()]);
            at += out.len();
        }
    }
}

impl CpuKernel for ReduceScatter {
    fn run(&self, k: &Kernel<'_>) {
        if self.once_per_step && !k.ctx.is_last_micro() {
            return;
        }
        let t = transport(self.ranks);
        let (rank, ranks) = (t.map_or(0, |t| t.rank()), self.ranks);
        let n = k.in_count();
        let shards: Vec<usize> = (0..n).map(|i| k.out_shape(i).iter().product()).collect();
        let total: usize = shards.iter().sum();
        let scale = 1.0 / ranks as f32;
        // One tensor that splits evenly is sent as it is, into its output.
        if n == 1 && k.in_f32(0).len() == total * ranks {
            let out = k.out_f32(0);
            match t {
                Some(t) => t.reduce_scatter_sum(k.in_f32(0), out),
                None => out.copy_from_slice(&k.in_f32(0)[rank * total..(rank + 1) * total]),
            }
            out.iter_mut().for_each(|x| *x *= scale);
            return;
        }
        // Rank-major blocks: block r holds every tensor's shard r, zero-padded.
        let ws = k.workspace();
        let (send, recv) = ws.split_at_mut(total * ranks);
        let mut at = 0;
        for r in 0..ranks {
            for (i, &s) in shards.iter().enumerate() {
                let x = k.in_f32(i);
                let (lo, hi) = ((r * s).min(x.len()), ((r + 1) * s).min(x.len()));
                send[at..at + hi - lo].copy_from_slice(&x[lo..hi]);
                send[at + hi - lo..at + s].fill(0.0);
                at += s;
            }
        }
        let recv: &mut [f32] = if n == 1 {
            k.out_f32(0)
        } else {
            &mut recv[..total]
        };
        match t {
            Some(t) => t.reduce_scatter_sum(send, recv),
            None => recv.copy_from_slice(&send[rank * total..(rank + 1) * total]),
        }
        recv.iter_mut().for_each(|x| *x *= scale);
        if n > 1 {
            let mut at = 0;
            for (i, &s) in shards.iter().enumerate() {
                k.out_f32(i).copy_from_slice(&recv[at..at + s]);
                at += s;
            }
        }
    }
}

impl CpuKernel for AllGather {
    fn run(&self, k: &Kernel<'_>) {
        if self.once_per_step && !k.ctx.is_last_micro() {
            return;
        }
        let t = transport(self.ranks);
        let rank = t.map_or(0, |t| t.rank());
        let shard = k.in_f32(0);
        let dest = if self.into {
            k.in_mut_f32(1)
        } else {
            k.out_f32(0)
        };
        let padded = shard.len() * self.ranks;
        let gather = |recv: &mut [f32]| match t {
            Some(t) => t.all_gather(shard, recv),
            None => recv[rank * shard.len()..(rank + 1) * shard.len()].copy_from_slice(shard),
        };
        if dest.len() == padded {
            gather(dest);
        } else {
            let ws = &mut k.workspace()[..padded];
            gather(ws);
            dest.copy_from_slice(&ws[..dest.len()]);
        }
    }
}

impl CpuKernel for ShardedAdamW {
    fn run(&self, k: &Kernel<'_>) {
        if !k.ctx.is_last_micro() {
            return;
        }
        let rank = transport(self.ranks).map_or(0, |t| t.rank());
        let scale = super::grad_scale(k, 4);
        let (p, g, m, v, out) = (
            k.in_f32(0),
            k.in_f32(1),
            k.in_mut_f32(2),
            k.in_mut_f32(3),
            k.out_f32(0),
        );
        let s = shard_len(p.len(), self.ranks);
        let (lo, hi) = ((rank * s).min(p.len()), ((rank + 1) * s).min(p.len()));
        out[..hi - lo].copy_from_slice(&p[lo..hi]);
        // Padding stays zero: its gradient is zero and zero decays to zero.
        out[hi - lo..].fill(0.0);
        if scale.is_some_and(|s| !s.is_finite()) {
            return; // an overflow under loss scaling: the shard goes back unchanged
        }
        super::adamw::update(&self.adamw, &k.ctx, scale, out, g, m, v);
    }
}

impl CpuKernel for CollectiveStart {
    fn run(&self, k: &Kernel<'_>) {
        if self.op.once_per_step() && !k.ctx.is_last_micro() {
            return;
        }
        let t = transport(self.op.ranks());
        let buf = k.out_f32(0);
        let n = k.in_count();
        match self.op {
            Bucketed::AllReduce(_) => {
                let (send, recv) = buf.split_at_mut(buf.len() / 2);
                let mut at = 0;
                for i in 0..n {
                    let x = k.in_f32(i);
                    send[at..at + x.len()].copy_from_slice(x);
                    at += x.len();
                }
                match t {
                    // SAFETY: the in-flight buffer is planned live until the wait, and no
                    // other node touches it in between.
                    Some(t) => unsafe { t.start_all_reduce_sum(send, recv) },
                    None => recv.copy_from_slice(send),
                }
            }
            Bucketed::ReduceScatter(c) => {
                let (rank, ranks) = (t.map_or(0, |t| t.rank()), c.ranks);
                let shards: Vec<usize> = (0..n)
                    .map(|i| shard_len(k.in_f32(i).len(), ranks))
                    .collect();
                let total: usize = shards.iter().sum();
                let (send, recv) = buf.split_at_mut(total * ranks);
                // Rank-major blocks: block r holds every tensor's shard r, zero-padded.
                let mut at = 0;
                for r in 0..ranks {
                    for (i, &s) in shards.iter().enumerate() {
                        let x = k.in_f32(i);
                        let (lo, hi) = ((r * s).min(x.len()), ((r + 1) * s).min(x.len()));
                        send[at..at + hi - lo].copy_from_slice(&x[lo..hi]);
                        send[at + hi - lo..at + s].fill(0.0);
                        at += s;
                    }
                }
                match t {
                    // SAFETY: as for the all-reduce.
                    Some(t) => unsafe { t.start_reduce_scatter_sum(send, recv) },
                    None => recv.copy_from_slice(&send[rank * total..(rank + 1) * total]),
                }
            }
        }
    }
}

impl CpuKernel for CollectiveWait {
    fn run(&self, k: &Kernel<'_>) {
        if self.op.once_per_step() && !k.ctx.is_last_micro() {
            return;
        }
        let t = transport(self.op.ranks());
        let (sent, scale) = match self.op {
            Bucketed::AllReduce(c) => {
                let total: usize = self.numels().iter().sum();
                (total, if c.mean { 1.0 / c.ranks as f32 } else { 1.0 })
            }
            Bucketed::ReduceScatter(c) => {
                let total: usize = self.numels().iter().map(|&n| shard_len(n, c.ranks)).sum();
                (total * c.ranks, 1.0 / c.ranks as f32)
            }
        };
        if let Some(t) = t {
            t.wait(k.in_f32(0)[sent..].as_ptr() as usize);
        }
        let recv = &k.in_f32(0)[sent..];
        let mut at = 0;
        for i in 0..self.shapes.len() {
            let out = k.out_f32(i);
            let src = &recv[at..at + out.len()];
            if scale == 1.0 {
                out.copy_from_slice(src);
            } else {
                out.iter_mut().zip(src).for_each(|(o, &x)| *o = x * scale);
            }
            at += out.len();
        }
    }
}
