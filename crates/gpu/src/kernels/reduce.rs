//! `snug-graph`'s `SumTo` where the kept axes are leading or trailing (a bias gradient sums
//! rows, a `[.., 1]` column sums within rows); other broadcasts have no kernel yet.

use super::{grid_items, need, u32_of, unsupported, Dispatch, Params, Source};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::DeviceSlice;

const SOURCE: Source = Source {
    file: "reduce.wgsl",
    code: include_str!("reduce.wgsl"),
};

/// How the input elements summed into output element `o` lie: `count` of them, from
/// `o · o_step`, `stride` apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SumLayout {
    pub outputs: usize,
    pub count: usize,
    pub o_step: usize,
    pub stride: usize,
}

/// The layout of summing `input` down to `out` (which broadcasts to it), or `None` where the
/// kept axes are neither a trailing nor a leading block.
pub fn sum_layout(input: &[usize], out: &[usize]) -> Option<SumLayout> {
    let n_in: usize = input.iter().product();
    let n_out: usize = out.iter().product();
    if n_out == 0 || !n_in.is_multiple_of(n_out) || out.len() > input.len() {
        return None;
    }
    let count = n_in / n_out;
    if count == 1 {
        return Some(SumLayout {
            outputs: n_out,
            count: 1,
            o_step: 1,
            stride: 1,
        });
    }
    let rank = input.len();
    let padded: Vec<usize> = std::iter::repeat_n(1, rank - out.len())
        .chain(out.iter().copied())
        .collect();
    // Kept axes trailing (ones before them): rows of `n_out` summed.
    let first = padded.iter().position(|&d| d != 1).unwrap_or(rank);
    if padded[first..] == input[first..] {
        return Some(SumLayout {
            outputs: n_out,
            count,
            o_step: 1,
            stride: n_out,
        });
    }
    // Kept axes leading (ones after them): runs of `count` summed.
    let last = padded.iter().rposition(|&d| d != 1).map_or(0, |p| p + 1);
    if padded[..last] == input[..last] {
        return Some(SumLayout {
            outputs: n_out,
            count,
            o_step: count,
            stride: 1,
        });
    }
    None
}

/// Records `y = x` summed from shape `input` down to shape `out`.
pub fn sum_to(
    device: &GpuDevice,
    encoder: &mut wgpu::CommandEncoder,
    (input, out): (&[usize], &[usize]),
    x: DeviceSlice<'_>,
    y: DeviceSlice<'_>,
) -> Result<()> {
    let Some(l) = sum_layout(input, out) else {
        return Err(unsupported(
            device,
            "sum_to",
            format!("{input:?} to {out:?} (kept axes neither leading nor trailing)"),
        ));
    };
    need(device, "sum_to x", &x, l.outputs * l.count)?;
    need(device, "sum_to y", &y, l.outputs)?;
    let u = |v| u32_of(device, "sum_to", v);
    Dispatch {
        source: SOURCE,
        entry: "sum_to",
        constants: String::new(),
        params: Params::new()
            .u(u(l.outputs)?)
            .u(u(l.count)?)
            .u(u(l.o_step)?)
            .u(u(l.stride)?),
        tensors: vec![(1, x), (2, y)],
        grid: grid_items(device, l.outputs),
    }
    .record(device, encoder)
}

#[cfg(test)]
mod tests {
    use super::{sum_layout, SumLayout};

    #[test]
    fn bias_gradients_sum_rows_and_columns_sum_within_rows() {
        let l = |outputs, count, o_step, stride| {
            Some(SumLayout {
                outputs,
                count,
                o_step,
                stride,
            })
        };
        assert_eq!(sum_layout(&[4, 3, 5], &[5]), l(5, 12, 1, 5));
        assert_eq!(sum_layout(&[4, 3, 5], &[1, 3, 5]), l(15, 4, 1, 15));
        assert_eq!(sum_layout(&[4, 3, 5], &[4, 3, 1]), l(12, 5, 5, 1));
        assert_eq!(sum_layout(&[4, 3], &[4, 3]), l(12, 1, 1, 1));
        assert_eq!(sum_layout(&[4, 3, 5], &[4, 1, 5]), None);
    }
}
