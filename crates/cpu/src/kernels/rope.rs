//! The kernel of [`Rope`]: each position's cosines and sines made in a per-thread workspace
//! (angle in f64, rounded to f32), then every head of that position rotated; under
//! [`snug_graph::ops::HalfIo`], each row read and written in bf16 as the dtypes say, staged
//! in f32.

use snug_graph::ops::{rope::dims, Rope};

use super::half_io::{Dst, Src};
use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for Rope {
    fn run(&self, k: &Kernel<'_>) {
        rotate(self, k, 0);
    }
}

/// Rotates input 0 into output 0, row `t` as position `first + t`. A position's angles do not
/// depend on the row it sits in, so one token rotated at its position (a decode step) matches
/// the same position of a whole window bit for bit.
pub(super) fn rotate(op: &Rope, k: &Kernel<'_>, first: usize) {
    let Ok((b, t, c)) = dims(op, k.in_shape(0)) else {
        unreachable!("shape rule checked at build time")
    };
    let (x, y) = (Src::input(k, 0), Dst::output(k, 0));
    let (hd, half) = (op.head_dim, op.head_dim / 2);
    let sign = if op.inverse { -1.0 } else { 1.0 };
    // A bf16 row is staged in f32 in the slot, after the angles (the plan holds it).
    let staged = |half: bool| if half { c } else { 0 };
    let (sx, sy) = (staged(matches!(x, Src::Bf16(_))), staged(y.is_half()));
    // One position per item: its angles are computed once and used for every batch row.
    crate::par::for_each_item(
        k.workspace(),
        hd + sx + sy,
        t,
        #[inline(always)]
        |pos, scratch| {
            let (angles, rest) = scratch.split_at_mut(hd);
            let (bx, by) = rest.split_at_mut(sx);
            let (cos, sin) = angles.split_at_mut(half);
            let at = (first + pos) as f64;
            for i in 0..half {
                let (s, co) = (at * op.inv_freq(i)).sin_cos();
                cos[i] = co as f32;
                sin[i] = (sign * s) as f32;
            }
            for bi in 0..b {
                let off = (bi * t + pos) * c;
                let xr = x.get((off, c), bx);
                // SAFETY: row (bi, pos) of y is written by this item only.
                unsafe {
                    y.with(
                        (off, c),
                        by,
                        #[inline(always)]
                        |yr| {
                            for (xh, yh) in xr.chunks_exact(hd).zip(yr.chunks_exact_mut(hd)) {
                                let (x1, x2) = xh.split_at(half);
                                let (y1, y2) = yh.split_at_mut(half);
                                for i in 0..half {
                                    y1[i] = x1[i] * cos[i] - x2[i] * sin[i];
                                    y2[i] = x2[i] * cos[i] + x1[i] * sin[i];
                                }
                            }
                        },
                    )
                };
            }
        },
    );
}
