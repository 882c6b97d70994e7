//! The kernels of binary arithmetic with broadcasting, and of scaling by a constant.

use snug_graph::ops::{Binary, BinaryKind, Scale};

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
        crate::par::elems_mut(k.out_f32(0), |start, out| match (&m, i) {
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
        });
        return;
    }
    let (a, b, c) = (k.in_f32(0), k.in_f32(1), k.out_f32(0));
    crate::par::elems_mut(c, |start, out| match (&ma, &mb) {
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
    });
}

impl CpuKernel for Scale {
    fn run(&self, k: &Kernel<'_>) {
        let s = self.factor;
        crate::par::unary(k, |v| v * s);
    }
}
