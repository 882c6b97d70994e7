//! `snug-graph`'s `Binary` (add, sub, mul, div with NumPy broadcasting) and `Scale`.
//! The output may be the same range as an operand of its shape (in place).

use super::{grid_items, need, u32_of, unsupported, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "elementwise.wgsl",
    code: include_str!("elementwise.wgsl"),
};

/// Axes the broadcasting kernel indexes.
const MAX_RANK: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryKind {
    Add,
    Sub,
    Mul,
    Div,
}

/// Row-major strides of `shape` read as `out` (NumPy broadcasting: right-aligned, 0 where an
/// axis is 1 or missing), or `None` where it does not broadcast to `out`.
pub(crate) fn broadcast_strides(shape: &[usize], out: &[usize]) -> Option<Vec<usize>> {
    if shape.len() > out.len() {
        return None;
    }
    let lead = out.len() - shape.len();
    let mut strides = vec![0; out.len()];
    let mut step = 1;
    for (axis, &size) in shape.iter().enumerate().rev() {
        let o = out[lead + axis];
        if size == o {
            strides[lead + axis] = step;
        } else if size != 1 {
            return None;
        }
        step *= size;
    }
    Some(strides)
}

fn vec8(device: &GpuDevice, v: &[usize]) -> Result<Vec<u32>> {
    let mut w = v
        .iter()
        .map(|&x| u32_of(device, "elementwise", x))
        .collect::<Result<Vec<u32>>>()?;
    w.resize(MAX_RANK, 1);
    Ok(w)
}

/// Records `c = a ∘ b`, `a` and `b` broadcasting to `c`'s shape.
pub fn binary(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    kind: BinaryKind,
    (a, a_shape): (DeviceSlice<'_>, &[usize]),
    (b, b_shape): (DeviceSlice<'_>, &[usize]),
    (c, c_shape): (DeviceSlice<'_>, &[usize]),
) -> Result<()> {
    let kernel = "elementwise";
    let n: usize = c_shape.iter().product();
    let (Some(sa), Some(sb)) = (
        broadcast_strides(a_shape, c_shape),
        broadcast_strides(b_shape, c_shape),
    ) else {
        return Err(unsupported(
            device,
            kernel,
            format!("{a_shape:?} and {b_shape:?} do not broadcast to {c_shape:?}"),
        ));
    };
    if c_shape.len() > MAX_RANK {
        return Err(unsupported(
            device,
            kernel,
            format!("{} axes (at most {MAX_RANK})", c_shape.len()),
        ));
    }
    need(device, "binary a", &a, a_shape.iter().product())?;
    need(device, "binary b", &b, b_shape.iter().product())?;
    need(device, "binary c", &c, n)?;
    let same = a_shape == c_shape && b_shape == c_shape;
    let op = match kind {
        BinaryKind::Add => 0,
        BinaryKind::Sub => 1,
        BinaryKind::Mul => 2,
        BinaryKind::Div => 3,
    };
    let mut params = Params::new()
        .u(u32_of(device, kernel, n)?)
        .u(c_shape.len() as u32)
        .f(0.0)
        .u(0);
    for v in [
        vec8(device, c_shape)?,
        vec8(device, &sa)?,
        vec8(device, &sb)?,
    ] {
        params = v.into_iter().fold(params, Params::u);
    }
    Dispatch {
        source: SOURCE,
        entry: "binary",
        constants: format!("const OP: u32 = {op}u;\nconst SAME: bool = {same};"),
        params,
        tensors: vec![(1, a), (2, b), (3, c)],
        grid: grid_items(device, n),
    }
    .record(device, encoder)
}

/// Records `y = x · factor` over `n` elements.
pub fn scale(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    factor: f32,
    n: usize,
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    need(device, "scale x", &x, n)?;
    need(device, "scale y", &y, n)?;
    Dispatch {
        source: SOURCE,
        entry: "scale",
        constants: "const OP: u32 = 0u;\nconst SAME: bool = true;".into(),
        params: Params::new()
            .u(u32_of(device, "elementwise", n)?)
            .u(0)
            .f(factor),
        tensors: vec![(1, x), (3, y)],
        grid: grid_items(device, n),
    }
    .record(device, encoder)
}

#[cfg(test)]
mod tests {
    use super::broadcast_strides;

    #[test]
    fn strides_follow_numpy_broadcasting() {
        assert_eq!(broadcast_strides(&[2, 3], &[2, 3]), Some(vec![3, 1]));
        assert_eq!(broadcast_strides(&[3], &[2, 3]), Some(vec![0, 1]));
        assert_eq!(
            broadcast_strides(&[2, 1, 4], &[2, 3, 4]),
            Some(vec![4, 0, 1])
        );
        assert_eq!(broadcast_strides(&[1], &[5, 7]), Some(vec![0, 0]));
        assert_eq!(broadcast_strides(&[2], &[2, 3]), None);
    }
}
