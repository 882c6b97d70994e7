//! The kernels of binary arithmetic with broadcasting, and of scaling by a constant.

use snug_graph::ops::{Binary, BinaryKind, Scale};

use snug_graph::DType;

use super::half_io::{input, output, Elem};
use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for Binary {
    fn run(&self, k: &Kernel<'_>) {
        // One monomorphic loop per kind: through a function pointer the loops stay scalar.
        match self.kind {
            BinaryKind::Add => binary_kernel(k, |x, y| x + y),
            BinaryKind::Sub => binary_kernel(k, |x, y| x - y),
            BinaryKind::Mul => binary_kernel(k, |x, y| x * y),
            BinaryKind::Div => binary_kernel(k, |x, y| x / y),
        }
    }
}

fn binary_kernel<F>(k: &Kernel<'_>, f: F)
where
    F: Fn(f32, f32) -> f32 + Copy + Send + Sync,
{
    use super::broadcast::Mapping;
    let out_shape = k.out_shape(0);
    let ma = Mapping::new(k.in_shape(0), out_shape);
    let mb = Mapping::new(k.in_shape(1), out_shape);
    if let Some(i) = k.inplace() {
        // The output holds input `i` (same shape as the output); the other may broadcast.
        let (other, m) = if i == 0 {
            (k.in_f32(1), mb)
        } else {
            (k.in_f32(0), ma)
        };
        crate::par::elems_mut(
            k.out_f32(0),
            #[inline(always)]
            |start, out| match (&m, i) {
                (Mapping::Same, 0) => {
                    let n = out.len();
                    for (o, &v) in out.iter_mut().zip(&other[start..start + n]) {
                        *o = f(*o, v);
                    }
                }
                (Mapping::Same, _) => {
                    let n = out.len();
                    for (o, &v) in out.iter_mut().zip(&other[start..start + n]) {
                        *o = f(v, *o);
                    }
                }
                _ => {
                    for (j, o) in out.iter_mut().enumerate() {
                        let v = other[m.index(start + j)];
                        *o = if i == 0 { f(*o, v) } else { f(v, *o) };
                    }
                }
            },
        );
        return;
    }
    let (a, b, c) = (k.in_f32(0), k.in_f32(1), k.out_f32(0));
    crate::par::elems_mut(
        c,
        #[inline(always)]
        |start, out| match (&ma, &mb) {
            (Mapping::Same, Mapping::Same) => {
                let (a, b) = (&a[start..start + out.len()], &b[start..start + out.len()]);
                for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                    *o = f(x, y);
                }
            }
            (Mapping::Same, Mapping::Cycle(n)) => {
                let a = &a[start..start + out.len()];
                for (j, (o, &x)) in out.iter_mut().zip(a).enumerate() {
                    *o = f(x, b[(start + j) % n]);
                }
            }
            _ => {
                for (j, o) in out.iter_mut().enumerate() {
                    let i = start + j;
                    *o = f(a[ma.index(i)], b[mb.index(i)]);
                }
            }
        },
    );
}

impl CpuKernel for Scale {
    fn run(&self, k: &Kernel<'_>) {
        let s = self.factor;
        crate::par::unary(k, |v| v * s);
    }
}

/// An add under [`snug_graph::ops::HalfIo`]: either operand read, and the sum written, in bf16
/// as their dtypes say (equal shapes: the shape rule refuses a broadcast).
pub(super) fn add_io(k: &Kernel<'_>) {
    let half = |d: DType| d == DType::BF16;
    match (
        half(k.in_dtype(0)),
        half(k.in_dtype(1)),
        half(k.out_dtype(0)),
    ) {
        (false, false, false) => add_with::<f32, f32, f32>(k),
        (true, false, false) => add_with::<u16, f32, f32>(k),
        (false, true, false) => add_with::<f32, u16, f32>(k),
        (true, true, false) => add_with::<u16, u16, f32>(k),
        (false, false, true) => add_with::<f32, f32, u16>(k),
        (true, false, true) => add_with::<u16, f32, u16>(k),
        (false, true, true) => add_with::<f32, u16, u16>(k),
        (true, true, true) => add_with::<u16, u16, u16>(k),
    }
}

/// `c = a + b` element by element, each stored as its type says; run in place, the output
/// holds that input (then of the output's type) and is read before it is written.
fn add_with<A: Elem, B: Elem, C: Elem>(k: &Kernel<'_>) {
    use rayon::prelude::*;
    const CHUNK: usize = crate::par::MIN_PAR_ELEMS;
    let c = output::<C>(k, 0);
    match k.inplace() {
        Some(i) => {
            // The sum is commutative bit for bit, so the held operand goes first either way.
            if i == 0 {
                in_place::<B, C>(c, input::<B>(k, 1));
            } else {
                in_place::<A, C>(c, input::<A>(k, 0));
            }
        }
        None => {
            let (a, b) = (input::<A>(k, 0), input::<B>(k, 1));
            c.par_chunks_mut(CHUNK)
                .zip(a.par_chunks(CHUNK))
                .zip(b.par_chunks(CHUNK))
                .for_each(|((c, a), b)| {
                    crate::isa::vectorized(
                        #[inline(always)]
                        || {
                            for ((o, &x), &y) in c.iter_mut().zip(a).zip(b) {
                                *o = C::put(x.get() + y.get());
                            }
                        },
                    )
                });
        }
    }
}

/// `c += x` element by element, `c` holding one operand of an add in place.
fn in_place<X: Elem, C: Elem>(c: &mut [C], x: &[X]) {
    use rayon::prelude::*;
    const CHUNK: usize = crate::par::MIN_PAR_ELEMS;
    c.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(c, x)| {
            crate::isa::vectorized(
                #[inline(always)]
                || {
                    for (o, &v) in c.iter_mut().zip(x) {
                        *o = C::put(o.get() + v.get());
                    }
                },
            )
        });
}
