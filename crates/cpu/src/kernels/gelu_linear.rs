//! The kernels of `gelu(h) · w + b` and its gradient: GELU taken in by the GEMM as it packs
//! `h` where our kernel runs the product, else made a tile of rows at a time in the
//! workspace; the backward remakes it tile by tile in the pass that forms `dh`.

use snug_graph::ops::{
    gelu_linear::TILE_ELEMS, linear_dims, tile_rows, GeluApprox, GeluLinear, GeluLinearBackward,
};

use super::half_io::{as_bits, as_f32, input, output, Elem};
use crate::gemm::Arith;
use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for GeluLinear {
    fn run(&self, kern: &Kernel<'_>) {
        match self.approx {
            GeluApprox::Tanh => forward::<true>(kern),
            GeluApprox::Exact => forward::<false>(kern),
        }
    }
}

impl CpuKernel for GeluLinearBackward {
    fn run(&self, kern: &Kernel<'_>) {
        match self.approx {
            GeluApprox::Tanh => backward::<true>(kern),
            GeluApprox::Exact => backward::<false>(kern),
        }
    }
}

#[inline(always)]
fn approx_of(tanh: bool) -> GeluApprox {
    if tanh {
        GeluApprox::Tanh
    } else {
        GeluApprox::Exact
    }
}

fn forward<const TANH: bool>(kern: &Kernel<'_>) {
    forward_with::<TANH, f32>(kern, kern.in_f32(0), false, Arith::F32);
}

/// [`GeluLinear`]'s kernel under [`snug_graph::ops::HalfIo`], the product in bf16
/// arithmetic: `h` read in bf16 where `half_h`, `y` written in bf16 (a tile of rows at a
/// time) where `half_y`.
pub(super) fn forward_io(approx: GeluApprox, kern: &Kernel<'_>, (half_h, half_y): (bool, bool)) {
    let bf16 = Arith::Bf16;
    match (approx, half_h) {
        (GeluApprox::Tanh, true) => forward_with::<true, u16>(kern, kern.in_u16(0), half_y, bf16),
        (GeluApprox::Exact, true) => forward_with::<false, u16>(kern, kern.in_u16(0), half_y, bf16),
        (GeluApprox::Tanh, false) => forward_with::<true, f32>(kern, kern.in_f32(0), half_y, bf16),
        (GeluApprox::Exact, false) => {
            forward_with::<false, f32>(kern, kern.in_f32(0), half_y, bf16)
        }
    }
}

/// The forward with `h` stored as `H` (f32, or bf16 bits widened as it is read), `y` written
/// in bf16 where `half_y`, the product in `arith`.
fn forward_with<const TANH: bool, H: Elem>(kern: &Kernel<'_>, h: &[H], half_y: bool, arith: Arith) {
    let Ok((rows, _, n)) = linear_dims("gelu_linear", kern.in_shape(0), kern.in_shape(1)) else {
        unreachable!("shape rule checked at build time")
    };
    if half_y {
        super::half_io::write_rows(kern, (rows, n), kern.workspace(), |r, ws, y| {
            forward_rows::<TANH, H>(kern, h, ws, (r, y), arith)
        });
    } else {
        let y = (0..rows, kern.out_f32(0));
        forward_rows::<TANH, H>(kern, h, kern.workspace(), y, arith);
    }
}

/// Rows `rows` of `y` into `y` (those rows only).
fn forward_rows<const TANH: bool, H: Elem>(
    kern: &Kernel<'_>,
    h: &[H],
    ws: &mut [f32],
    (rows, y): (std::ops::Range<usize>, &mut [f32]),
    arith: Arith,
) {
    use crate::gemm::{
        gemm_fused, gemm_fused_half, linear_rows, par_for, Fused, Layout, Operand, Prologue,
    };
    let (w, bias) = (kern.in_f32(1), kern.in_f32(2));
    let Ok((all_rows, k, n)) = linear_dims("gelu_linear", kern.in_shape(0), kern.in_shape(1))
    else {
        unreachable!("shape rule checked at build time")
    };
    let m = rows.len();
    let h = &h[rows.start * k..rows.end * k];
    // Where our GEMM kernel runs the product, it takes GELU of `h` as it packs it.
    let fused = Fused {
        prologue: Prologue::Gelu(approx_of(TANH)),
        bias: Some(bias),
        arith,
        ..Fused::NONE
    };
    let par = par_for(m, n, k, rayon::current_num_threads());
    let layout = Layout::new((false, false), (m, n, k));
    // SAFETY: `h` holds m·k, `w` k·n and `y` m·n elements.
    let done = unsafe {
        match as_bits(h) {
            Some(bits) => gemm_fused_half(
                layout,
                (Operand::Bf16(bits), Operand::F32(w)),
                y,
                par,
                fused,
            ),
            None => gemm_fused(layout, as_f32(h), w, y, par, fused),
        }
    };
    if done {
        return;
    }
    // The workspace holds a tile of the whole op's rows.
    let tile = tile_rows(all_rows, k, TILE_ELEMS);
    for r0 in (0..m).step_by(tile) {
        let r1 = (r0 + tile).min(m);
        let g = &mut ws[..(r1 - r0) * k];
        map_in(&h[r0 * k..r1 * k], g, |v| {
            crate::math::gelu(approx_of(TANH), v)
        });
        linear_rows(g, w, bias, &mut y[r0 * n..r1 * n], (r1 - r0, k, n), arith);
    }
}

/// `y[i] = f(x[i])` in parallel chunks, `x` stored as `H`.
fn map_in<H: Elem>(x: &[H], y: &mut [f32], f: impl Fn(f32) -> f32 + Sync + Send) {
    use rayon::prelude::*;
    let chunk = crate::par::MIN_PAR_ELEMS;
    y.par_chunks_mut(chunk)
        .zip(x.par_chunks(chunk))
        .for_each(|(y, x)| {
            crate::isa::vectorized(
                #[inline(always)]
                || {
                    for (o, &v) in y.iter_mut().zip(x) {
                        *o = f(v.get());
                    }
                },
            )
        });
}

fn backward<const TANH: bool>(kern: &Kernel<'_>) {
    backward_with::<TANH, f32, f32>(kern, Arith::F32);
}

/// [`GeluLinearBackward`]'s kernel under [`snug_graph::ops::HalfIo`], its products in bf16
/// arithmetic: `h` read, and `dh` written, in bf16 as flagged.
pub(super) fn backward_io(approx: GeluApprox, kern: &Kernel<'_>, halves: (bool, bool)) {
    let bf16 = Arith::Bf16;
    match (approx == GeluApprox::Tanh, halves) {
        (true, (false, false)) => backward_with::<true, f32, f32>(kern, bf16),
        (true, (true, false)) => backward_with::<true, u16, f32>(kern, bf16),
        (true, (false, true)) => backward_with::<true, f32, u16>(kern, bf16),
        (true, (true, true)) => backward_with::<true, u16, u16>(kern, bf16),
        (false, (false, false)) => backward_with::<false, f32, f32>(kern, bf16),
        (false, (true, false)) => backward_with::<false, u16, f32>(kern, bf16),
        (false, (false, true)) => backward_with::<false, f32, u16>(kern, bf16),
        (false, (true, true)) => backward_with::<false, u16, u16>(kern, bf16),
    }
}

/// The backward with `h` stored as `H` and `dh` as `D` (f32, or bf16 bits), its products in
/// `arith`.
fn backward_with<const TANH: bool, H: Elem, D: Elem>(kern: &Kernel<'_>, arith: Arith) {
    use crate::gemm::{gemm_strided, input_grad_rows, par_for, Layout};
    use rayon::prelude::*;
    // Run in place, `h` is read through `dh` (then `H` is `D`): each element is read before it
    // is written.
    let h: Option<&[H]> = (kern.inplace() != Some(0)).then(|| input::<H>(kern, 0));
    let (w, dy) = (kern.in_f32(1), kern.in_f32(2));
    let Ok((rows, k, n)) = linear_dims("gelu_linear_backward", kern.in_shape(0), kern.in_shape(1))
    else {
        unreachable!("shape rule checked at build time")
    };
    let (dh, dw, ws) = (output::<D>(kern, 0), kern.out_f32(1), kern.workspace());
    let threads = rayon::current_num_threads();
    // The tile the plan sized the workspace for (on its target, not necessarily this CPU).
    let tile = (ws.len() / k.max(1)).clamp(1, rows.max(1));
    for r0 in (0..rows).step_by(tile) {
        let r1 = (r0 + tile).min(rows);
        let (t, dyt) = (&mut ws[..(r1 - r0) * k], &dy[r0 * n..r1 * n]);
        // dg = dy · wᵀ for this tile's rows.
        input_grad_rows(dyt, w, t, (r1 - r0, k, n), arith);
        // One pass: dh = dg ⊙ gelu'(h), and the tile's dg is replaced by g = gelu(h).
        let dht = &mut dh[r0 * k..r1 * k];
        let chunk = crate::par::MIN_PAR_ELEMS;
        match h {
            Some(h) => t
                .par_chunks_mut(chunk)
                .zip(dht.par_chunks_mut(chunk))
                .zip(h[r0 * k..r1 * k].par_chunks(chunk))
                .for_each(|((t, d), x)| {
                    crate::isa::vectorized_loop(GeluGrad::<TANH, H, D> { t, d, x: Some(x) })
                }),
            None => t
                .par_chunks_mut(chunk)
                .zip(dht.par_chunks_mut(chunk))
                .for_each(|(t, d)| {
                    crate::isa::vectorized_loop(GeluGrad::<TANH, D, D> { t, d, x: None })
                }),
        }
        // dw (+)= gᵀ · dy over this tile's rows.
        // SAFETY: `t` holds (r1-r0)·k, `dyt` (r1-r0)·n and `dw` k·n elements.
        unsafe {
            gemm_strided(
                Layout::new((true, false), (k, n, r1 - r0)),
                t,
                dyt,
                dw,
                r0 > 0,
                par_for(k, n, r1 - r0, threads),
                arith,
            )
        };
    }
}

/// `d = t ⊙ gelu'(h)` and `t = gelu(h)` over one chunk, `h` read from `x` or (run in place)
/// from `d` itself before it is written.
struct GeluGrad<'a, const TANH: bool, H, D> {
    t: &'a mut [f32],
    d: &'a mut [D],
    x: Option<&'a [H]>,
}

impl<const TANH: bool, H: Elem, D: Elem> crate::isa::Loop for GeluGrad<'_, TANH, H, D> {
    #[inline(always)]
    fn run(self) {
        let step = |t: &mut f32, d: &mut D, v: f32| {
            let (value, slope) = crate::math::gelu_and_grad(approx_of(TANH), v);
            *d = D::put(*t * slope);
            *t = value;
        };
        match self.x {
            Some(x) => {
                for ((t, d), &v) in self.t.iter_mut().zip(self.d.iter_mut()).zip(x) {
                    step(t, d, v.get());
                }
            }
            None => {
                for (t, d) in self.t.iter_mut().zip(self.d.iter_mut()) {
                    let v = d.get();
                    step(t, d, v);
                }
            }
        }
    }
}
