//! The kernels that move or sum elements without arithmetic of their own: fill, pad,
//! transpose, sum-to, and gradient accumulation across micro-batches.

use snug_gpu::kernels::accumulate::{accumulate, Accumulate};
use snug_gpu::kernels::fill::fill;
use snug_gpu::kernels::reduce::sum_to;
use snug_gpu::kernels::view::{pad, transpose};

use crate::common::{assert_close, f64s, gpu, uniform, Init, Tensors};

#[test]
fn fill_writes_every_element() {
    let Some(device) = gpu() else { return };
    let n = 1000;
    let t = Tensors::new(device, &[Init::Out(n)]);
    t.run(|e, t| fill(device, e, 1.5, n, t.get(0)));
    assert_eq!(t.read(0), vec![1.5; n]);
}

#[test]
fn pad_places_rows_among_zeros() {
    let Some(device) = gpu() else { return };
    let (rows, total, row, start) = (5, 9, 7, 3);
    let x = uniform(1, rows * row, -1.0, 1.0);
    let t = Tensors::new(device, &[Init::F32(x.clone()), Init::Out(total * row)]);
    t.run(|e, t| pad(device, e, (start, rows, total, row), t.get(0), t.get(1)));
    let mut want = vec![0.0; total * row];
    want[start * row..(start + rows) * row].copy_from_slice(&x);
    assert_eq!(t.read(1), want);
}

#[test]
fn transpose_swaps_any_two_axes() {
    let Some(device) = gpu() else { return };
    let shape = [3, 4, 5, 2];
    let n: usize = shape.iter().product();
    let x = uniform(2, n, -1.0, 1.0);
    for (d0, d1) in [(0, 1), (1, 3), (0, 3), (2, 2)] {
        let t = Tensors::new(device, &[Init::F32(x.clone()), Init::Out(n)]);
        t.run(|e, t| transpose(device, e, &shape, (d0, d1), t.get(0), t.get(1)));
        let mut out_shape = shape;
        out_shape.swap(d0, d1);
        let mut want = vec![0.0; n];
        for (i, w) in want.iter_mut().enumerate() {
            // Output coordinates, then the input element they name.
            let mut rest = i;
            let mut coord = [0usize; 4];
            for d in (0..4).rev() {
                coord[d] = rest % out_shape[d];
                rest /= out_shape[d];
            }
            coord.swap(d0, d1);
            let src =
                ((coord[0] * shape[1] + coord[1]) * shape[2] + coord[2]) * shape[3] + coord[3];
            *w = x[src];
        }
        assert_eq!(t.read(1), want, "axes {d0} and {d1}");
    }
}

#[test]
fn sum_to_leading_or_trailing_axes() {
    let Some(device) = gpu() else { return };
    let input = [6, 5, 70];
    let n: usize = input.iter().product();
    let x = uniform(3, n, -1.0, 1.0);
    let at = |a: usize, b: usize, c: usize| f64::from(x[(a * 5 + b) * 70 + c]);
    type Sum = fn(&dyn Fn(usize, usize, usize) -> f64, usize) -> f64;
    // Each case: the kept shape, and output element o's sum.
    let cases: [(&[usize], Sum); 4] = [
        (&[70], |f, o| {
            (0..6)
                .flat_map(|a| (0..5).map(move |b| (a, b)))
                .map(|(a, b)| f(a, b, o))
                .sum()
        }),
        (&[5, 70], |f, o| (0..6).map(|a| f(a, o / 70, o % 70)).sum()),
        (&[6, 1, 1], |f, o| {
            (0..5)
                .flat_map(|b| (0..70).map(move |c| (b, c)))
                .map(|(b, c)| f(o, b, c))
                .sum()
        }),
        (&[6, 5, 70], |f, o| f(o / 350, o / 70 % 5, o % 70)),
    ];
    for (out, sum) in cases {
        let m: usize = out.iter().product();
        let t = Tensors::new(device, &[Init::F32(x.clone()), Init::Out(m)]);
        t.run(|e, t| sum_to(device, e, (&input, out), t.get(0), t.get(1)));
        let want: Vec<f64> = (0..m).map(|o| sum(&at, o)).collect();
        // Each sum's rounding is relative to the magnitudes it adds (at most 210 terms below 1).
        let scale = vec![f64::from(n as u32 / m as u32); m];
        assert_close(&format!("sum to {out:?}"), &t.read(1), &want, 1e-6, &scale);
    }
}

#[test]
fn accumulation_starts_adds_and_finishes_without_touching_the_sum() {
    let Some(device) = gpu() else { return };
    let n = 700;
    let grads: Vec<Vec<f32>> = (0..3).map(|k| uniform(10 + k, n, -1.0, 1.0)).collect();
    let t = Tensors::new(
        device,
        &[
            Init::F32(vec![f32::NAN; n]),
            Init::F32(grads[0].clone()),
            Init::F32(grads[1].clone()),
            Init::F32(grads[2].clone()),
            Init::Out(n),
        ],
    );
    t.run(|e, t| {
        let out = t.get(4);
        accumulate(
            device,
            e,
            Accumulate::of(0, 3),
            n,
            [t.get(0), t.get(1), out],
        )?;
        accumulate(
            device,
            e,
            Accumulate::of(1, 3),
            n,
            [t.get(0), t.get(2), out],
        )?;
        accumulate(
            device,
            e,
            Accumulate::of(2, 3),
            n,
            [t.get(0), t.get(3), out],
        )
    });
    let (g0, g1, g2) = (f64s(&grads[0]), f64s(&grads[1]), f64s(&grads[2]));
    let partial: Vec<f64> = (0..n).map(|i| g0[i] + g1[i]).collect();
    let total: Vec<f64> = (0..n).map(|i| partial[i] + g2[i]).collect();
    assert_close("accumulator", &t.read(0), &partial, 1e-6, &[]);
    let scale = vec![3.0; n];
    assert_close("sum", &t.read(4), &total, 1e-6, &scale);
    assert_eq!(Accumulate::of(0, 1), Accumulate::Finish);
}
