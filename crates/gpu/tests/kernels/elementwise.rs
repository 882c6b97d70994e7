use snug_gpu::kernels::elementwise::{binary, scale, BinaryKind};

use crate::common::{assert_close, f64s, gpu, uniform, Init, Tensors};

fn apply(kind: BinaryKind, x: f64, y: f64) -> f64 {
    match kind {
        BinaryKind::Add => x + y,
        BinaryKind::Sub => x - y,
        BinaryKind::Mul => x * y,
        BinaryKind::Div => x / y,
    }
}

/// Index of output element `i` in an operand of `shape`, broadcast NumPy-style to `out`.
fn source_index(i: usize, shape: &[usize], out: &[usize]) -> usize {
    let lead = out.len() - shape.len();
    let (mut rest, mut idx, mut step) = (i, 0, 1);
    for axis in (0..out.len()).rev() {
        let coord = rest % out[axis];
        rest /= out[axis];
        if axis >= lead {
            let size = shape[axis - lead];
            if size != 1 {
                idx += coord * step;
            }
            step *= size;
        }
    }
    idx
}

#[test]
fn every_kind_with_and_without_broadcasting() {
    let Some(device) = gpu() else { return };
    let cases: [(&[usize], &[usize], &[usize]); 4] = [
        (&[3, 17, 5], &[3, 17, 5], &[3, 17, 5]),
        (&[300], &[300], &[300]),
        (&[4, 65], &[65], &[4, 65]),
        (&[2, 1, 7], &[3, 1], &[2, 3, 7]),
    ];
    for (ci, (sa, sb, sc)) in cases.into_iter().enumerate() {
        for kind in [
            BinaryKind::Add,
            BinaryKind::Sub,
            BinaryKind::Mul,
            BinaryKind::Div,
        ] {
            let na: usize = sa.iter().product();
            let nb: usize = sb.iter().product();
            let nc: usize = sc.iter().product();
            let a = uniform(ci as u64, na, -2.0, 2.0);
            // Divisors kept away from zero.
            let b = uniform(ci as u64 + 9, nb, 0.5, 2.0);
            let t = Tensors::new(
                device,
                &[Init::F32(a.clone()), Init::F32(b.clone()), Init::Out(nc)],
            );
            t.run(|e, t| {
                binary(
                    device,
                    e,
                    kind,
                    (t.get(0), sa),
                    (t.get(1), sb),
                    (t.get(2), sc),
                )
            });
            let want: Vec<f64> = (0..nc)
                .map(|i| {
                    let x = f64::from(a[source_index(i, sa, sc)]);
                    let y = f64::from(b[source_index(i, sb, sc)]);
                    apply(kind, x, y)
                })
                .collect();
            // One rounding: within f32's half-ulp of the result; sums relative to their terms.
            let mag: Vec<f64> = (0..nc)
                .map(|i| {
                    f64::from(a[source_index(i, sa, sc)]).abs()
                        + f64::from(b[source_index(i, sb, sc)]).abs()
                })
                .collect();
            assert_close(
                &format!("{kind:?} {sa:?} {sb:?}"),
                &t.read(2),
                &want,
                1e-6,
                &mag,
            );
        }
    }
}

#[test]
fn in_place_over_the_first_operand() {
    let Some(device) = gpu() else { return };
    let a = uniform(1, 130, -1.0, 1.0);
    let b = uniform(2, 130, -1.0, 1.0);
    let t = Tensors::new(device, &[Init::F32(a.clone()), Init::F32(b.clone())]);
    t.run(|e, t| {
        binary(
            device,
            e,
            BinaryKind::Mul,
            (t.get(0), &[130]),
            (t.get(1), &[130]),
            (t.get(0), &[130]),
        )
    });
    let want: Vec<f64> = a.iter().zip(&b).map(|(&x, &y)| f64::from(x * y)).collect();
    assert_close("a *= b", &t.read(0), &want, 0.0, &[]);
}

#[test]
fn scale_multiplies_every_element() {
    let Some(device) = gpu() else { return };
    let x = uniform(3, 1000, -3.0, 3.0);
    let t = Tensors::new(device, &[Init::F32(x.clone()), Init::Out(1000)]);
    t.run(|e, t| scale(device, e, -0.37, 1000, t.get(0), t.get(1)));
    let want: Vec<f64> = f64s(&x).iter().map(|v| v * f64::from(-0.37f32)).collect();
    assert_close("scale", &t.read(1), &want, 1e-6, &[]);
}

#[test]
fn shapes_that_do_not_broadcast_are_refused() {
    let Some(device) = gpu() else { return };
    let t = Tensors::new(device, &[Init::Out(6), Init::Out(2), Init::Out(6)]);
    let mut e = device.encoder("refused");
    let err = binary(
        device,
        &mut e,
        BinaryKind::Add,
        (t.get(0), &[2, 3]),
        (t.get(1), &[2]),
        (t.get(2), &[2, 3]),
    )
    .unwrap_err();
    assert!(
        matches!(err, snug_gpu::GpuError::Unsupported { .. }),
        "{err}"
    );
}
