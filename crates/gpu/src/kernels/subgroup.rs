//! The subgroups the reductions run as on a device, read on the device: the size wgpu's
//! adapter info gives is only a range.

use super::{Dispatch, Params, Source, WG};
use crate::device::GpuDevice;
use crate::error::Result;
use crate::memory::MemorySource;
use crate::transfer;

const SOURCE: Source = Source {
    file: "subgroup.wgsl",
    code: include_str!("subgroup.wgsl"),
};

/// How a workgroup of the reductions' [`WG`] threads runs on a device that uses subgroup
/// operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubgroupLayout {
    /// Invocations a subgroup.
    pub size: u32,
    /// Subgroups in the workgroup.
    pub count: u32,
}

impl SubgroupLayout {
    /// Whether the reductions take their subgroup path (whole subgroups of a power of two
    /// from 4 to 128) rather than the workgroup-memory tree.
    pub fn shuffles(&self) -> bool {
        (4..=128).contains(&self.size)
            && self.size.is_power_of_two()
            && self.size.checked_mul(self.count) == Some(WG)
    }
}

/// The subgroup layout of a reducing workgroup, where `device` uses subgroup operations
/// (`None` elsewhere). Submits and waits.
pub fn subgroup_layout(device: &GpuDevice) -> Result<Option<SubgroupLayout>> {
    if !device.has_subgroups() {
        return Ok(None);
    }
    let source = MemorySource::new(device);
    let out = source.allocate(8)?;
    let mut encoder = device.encoder("subgroup layout");
    let recorded = Dispatch {
        source: SOURCE,
        entry: "subgroup_layout",
        constants: String::new(),
        params: Params::new(),
        tensors: vec![(1, out.whole())],
        grid: [1, 1, 1],
    }
    .record(device, &mut encoder)
    .and_then(|()| device.submit(encoder))
    .and_then(|_| transfer::download_f32(device, &out.whole()));
    source.release(out);
    let words = recorded?;
    Ok(Some(SubgroupLayout {
        size: words.first().map_or(0, |w| w.to_bits()),
        count: words.get(1).map_or(0, |w| w.to_bits()),
    }))
}

#[cfg(test)]
mod tests {
    /// The plain tree of `prelude.wgsl`: at stride 128 down to 1, `s[i] = s[i] ∘ s[i + stride]`.
    fn tree(v: &[f32], op: fn(f32, f32) -> f32) -> f32 {
        let mut s = v.to_vec();
        let mut stride = 128;
        while stride > 0 {
            for i in 0..stride {
                s[i] = op(s[i], s[i + stride]);
            }
            stride >>= 1;
        }
        s[0]
    }

    /// `reduce_subgroup.wgsl`'s rounds for subgroups of `size`, each subgroup's lanes run in
    /// lock step: every lane's value after the butterflies, which must agree, is returned per
    /// subgroup.
    fn rounds(v: &[f32], size: u32, op: fn(f32, f32) -> f32) -> f32 {
        let k = size.trailing_zeros();
        let mut vals = v.to_vec();
        let mut bits = 8u32;
        while bits > 0 {
            let kk = k.min(bits);
            let m = bits - kk;
            let mut next = vec![0.0; 1 << m];
            for (g, out) in next.iter_mut().enumerate() {
                let g = g as u32;
                let mut x: Vec<f32> = (0..size)
                    .map(|lane| vals[(((lane.reverse_bits() >> (32 - kk)) << m) | g) as usize])
                    .collect();
                let mut mask = 1;
                while mask < (1 << kk) {
                    let before = x.clone();
                    for (lane, xl) in x.iter_mut().enumerate() {
                        let other = before[lane ^ mask as usize];
                        let own = before[lane];
                        let upper = lane as u32 & mask != 0;
                        *xl = if upper {
                            op(other, own)
                        } else {
                            op(own, other)
                        };
                    }
                    mask <<= 1;
                }
                assert!(
                    x.iter().all(|v| v.to_bits() == x[0].to_bits()),
                    "size {size}"
                );
                *out = x[0];
            }
            vals = next;
            bits = m;
        }
        vals[0]
    }

    /// For every subgroup size the shader accepts, the rounds give the tree's bits, for sums
    /// whose value depends on the order of their terms (checked: adjacent pairs first differ)
    /// and for maxima.
    #[test]
    fn the_subgroup_rounds_fold_in_the_trees_order_at_every_size() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let v: Vec<f32> = (0..256)
            .map(|i| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                unit * 2f32.powi(i % 29 - 14)
            })
            .collect();
        let add = |a: f32, b: f32| a + b;
        let want = tree(&v, add);
        // Adjacent pairs first, as a butterfly over lanes in index order folds.
        let mut adjacent = v.clone();
        let mut width = 1;
        while width < 256 {
            for i in (0..256).step_by(2 * width) {
                adjacent[i] += adjacent[i + width];
            }
            width *= 2;
        }
        assert_ne!(
            want.to_bits(),
            adjacent[0].to_bits(),
            "the data must make the order visible"
        );
        for size in [4, 8, 16, 32, 64, 128] {
            assert_eq!(
                rounds(&v, size, add).to_bits(),
                want.to_bits(),
                "sum, size {size}"
            );
            assert_eq!(
                rounds(&v, size, f32::max).to_bits(),
                tree(&v, f32::max).to_bits(),
                "max, size {size}"
            );
        }
    }
}
