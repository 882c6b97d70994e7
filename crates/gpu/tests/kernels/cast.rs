//! Casts to and from f16 storage against the `half` crate (what the CPU backend uses), on
//! the device's own f16 where it has `SHADER_F16` and on the plain integer path.

use half::f16;
use snug_gpu::kernels::cast::{from_half, to_half, Half};
use snug_gpu::GpuDevice;

use crate::common::{gpu, gpu_plain, uniform, Init, Tensors};

/// Values crossing every edge of f16: normals, ties of rounding, subnormals, the largest
/// finite value and just past it, overflow, zeros, infinities and NaN; an odd count, so the
/// last word's upper half is padding.
fn edge_values() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.5,
        // Ties between two f16 (1 + 2^-11 sits halfway between 1 and 1 + 2^-10).
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        65504.0,
        65519.0,
        65520.0,
        -70000.0,
        1e30,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        // Subnormal f16, smallest subnormal, and half of it (a tie to zero), and below.
        3e-6,
        -2f32.powi(-24),
        2f32.powi(-25),
        2f32.powi(-25) * 1.5,
        1e-9,
        6.1e-5,
    ];
    v.extend(uniform(7, 301, -300.0, 300.0));
    v.extend(uniform(8, 100, -1e-3, 1e-3));
    v
}

fn to_f16_bits(device: &'static GpuDevice, x: &[f32]) -> Vec<u16> {
    let n = x.len();
    let t = Tensors::new(device, &[Init::F32(x.to_vec()), Init::Out(n.div_ceil(2))]);
    t.run(|e, t| to_half(device, e, Half::F16, n, t.get(0), t.get(1)));
    let words = t.read(1);
    (0..n)
        .map(|i| (words[i / 2].to_bits() >> (16 * (i % 2))) as u16)
        .collect()
}

fn from_f16_bits(device: &'static GpuDevice, bits: &[u16]) -> Vec<f32> {
    let n = bits.len();
    let words: Vec<i32> = bits
        .chunks(2)
        .map(|c| (u32::from(c[0]) | (u32::from(*c.get(1).unwrap_or(&0)) << 16)) as i32)
        .collect();
    let t = Tensors::new(device, &[Init::I32(words), Init::Out(n)]);
    t.run(|e, t| from_half(device, e, Half::F16, n, t.get(0), t.get(1)));
    t.read(1)
}

#[test]
fn the_plain_path_gives_the_cpus_f16_bits_exactly() {
    let Some(device) = gpu_plain() else { return };
    assert!(!device.has_f16());
    let x = edge_values();
    let got = to_f16_bits(device, &x);
    for (i, (&g, &v)) in got.iter().zip(&x).enumerate() {
        assert_eq!(g, f16::from_f32(v).to_bits(), "to_f16 of {v} (element {i})");
    }
    // Every f16 bit pattern back to f32, NaNs included.
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let back = from_f16_bits(device, &all);
    for (&h, &g) in all.iter().zip(&back) {
        let want = f16::from_bits(h).to_f32();
        assert_eq!(g.to_bits(), want.to_bits(), "from_f16 of {h:#06x}");
    }
}

/// With `SHADER_F16` f16 is read natively: exact for every normal value, infinity and zero,
/// NaN kept NaN, a subnormal exact or flushed to zero (Vulkan lets a device flush f16
/// denormals); writing takes the integer path on either device, so its bits are the CPU's.
#[test]
fn the_native_path_reads_f16_exactly() {
    let Some(device) = gpu() else { return };
    if !device.has_f16() {
        snug_testkit::skip_or_fail("the adapter has no SHADER_F16");
        return;
    }
    let x = edge_values();
    for (&g, &v) in to_f16_bits(device, &x).iter().zip(&x) {
        assert_eq!(g, f16::from_f32(v).to_bits(), "to_f16 of {v}");
    }
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let back = from_f16_bits(device, &all);
    for (&h, &g) in all.iter().zip(&back) {
        let want = f16::from_bits(h);
        if want.is_nan() {
            assert!(g.is_nan(), "from_f16 of {h:#06x}");
        } else if !want.is_normal() && want.to_f32() != 0.0 && want.is_finite() {
            assert!(g == want.to_f32() || g == 0.0, "from_f16 of {h:#06x}: {g}");
        } else {
            assert_eq!(g, want.to_f32(), "from_f16 of {h:#06x}");
        }
    }
}
