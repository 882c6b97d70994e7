//! bf16 arithmetic's numbers on the f32 register tiles (`SNUG_BF16_MATH=model`): an f32 tile
//! whose packed panels are rounded to bf16 in place before its kernel reads them. Products of
//! bf16 values are exact in f32, so this computes what `VDPBF16PS` computes
//! ([`super::avx512bf16`]) up to the order of the f32 sum and its flushing of subnormals, on
//! any CPU our tiles run on: a run's sensitivity to bf16 arithmetic can be seen without the
//! instructions.

use std::marker::PhantomData;

use super::blocked::Tile;
use super::fused::Prologue;
use super::half::round_to_bf16;

/// Tile `T` with its panels rounded to bf16.
pub(crate) struct Rounded<T>(PhantomData<T>);

/// Rounds `len` packed floats at `panel` to bf16, in place.
///
/// # Safety
/// `panel` must hold `len` floats.
#[inline(always)]
unsafe fn round_panel(panel: *mut f32, len: usize) {
    // SAFETY: as the caller vouched.
    let panel = unsafe { std::slice::from_raw_parts_mut(panel, len) };
    for v in panel {
        *v = round_to_bf16(*v);
    }
}

impl<T: Tile> Tile for Rounded<T> {
    const MR: usize = T::MR;
    const NR: usize = T::NR;
    const KC: usize = T::KC;
    const MC: usize = T::MC;
    const NC: usize = T::NC;

    fn available() -> bool {
        T::available()
    }

    unsafe fn pack_a(
        kc: usize,
        mr: usize,
        a: *const f32,
        strides: (isize, isize),
        panel: (*mut f32, usize, usize),
        prologue: Prologue<'_>,
    ) {
        // SAFETY: as the caller vouched.
        unsafe { T::pack_a(kc, mr, a, strides, panel, prologue) }
    }

    unsafe fn pack_b(kc: usize, nc: usize, b: *const f32, strides: (isize, isize), out: *mut f32) {
        // SAFETY: as the caller vouched; the panels hold `kc · nc.next_multiple_of(NR)`.
        unsafe {
            T::pack_b(kc, nc, b, strides, out);
            round_panel(out, kc * nc.next_multiple_of(T::NR));
        }
    }

    unsafe fn pack_a_half(
        half: &super::half::HalfA<'_>,
        dims: (usize, usize),
        panel: (*mut f32, usize, usize),
        prologue: Prologue<'_>,
    ) {
        // SAFETY: as the caller vouched.
        unsafe { T::pack_a_half(half, dims, panel, prologue) }
    }

    unsafe fn finish_a(kc: usize, panel: *mut f32) {
        // SAFETY: the panel holds `MR · kc` floats, as the caller vouched.
        unsafe {
            T::finish_a(kc, panel);
            round_panel(panel, T::MR * kc);
        }
    }

    unsafe fn finish_b(kc: usize, nc: usize, out: *mut f32) {
        // SAFETY: the panels hold `kc · nc.next_multiple_of(NR)` floats, as the caller vouched.
        unsafe {
            T::finish_b(kc, nc, out);
            round_panel(out, kc * nc.next_multiple_of(T::NR));
        }
    }

    unsafe fn done() {
        // SAFETY: as the caller vouched.
        unsafe { T::done() }
    }

    unsafe fn kernel(
        kc: usize,
        panels: (*const f32, *const f32),
        c: (*mut f32, isize),
        tile: (usize, usize),
        scale_bias: (f32, *const f32),
        accumulate: bool,
    ) {
        // SAFETY: as the caller vouched.
        unsafe { T::kernel(kc, panels, c, tile, scale_bias, accumulate) }
    }
}
