//! The kernels of causal self-attention: per head, strided GEMMs over the packed `qkv` in
//! place (keys and values laid across once per head), scores in a per-thread workspace, a
//! row's log-sum-exp saved for the backward, which recomputes the probabilities from it.
//! The head functions are shared with [`GqaAttention`](snug_graph::ops::GqaAttention)'s kernels.

use snug_graph::ops::{
    attention::{across_len, backward_scratch, dims, forward_scratch, row_blocks},
    CausalAttention, CausalAttentionBackward, OpRule,
};

use super::half_io::Elem;
use crate::gemm::{Causal, HeadBf16};
use crate::kernel::{CpuKernel, Kernel};

#[cfg(target_arch = "x86_64")]
pub(super) mod paired;

impl CpuKernel for CausalAttention {
    fn run(&self, k: &Kernel<'_>) {
        let Ok((b, t, c, d)) = dims(self.name(), k.in_shape(0), self.n_head) else {
            unreachable!("shape rule checked at build time")
        };
        let qkv = SendPtr(k.in_f32(0).as_ptr() as *mut f32);
        let y = SendPtr(k.out_f32(0).as_mut_ptr());
        let lse = SendPtr(k.out_f32(1).as_mut_ptr());
        let h = self.n_head;
        let scale = 1.0 / (d as f32).sqrt();
        for_each_head(
            k.workspace(),
            forward_scratch(t, d),
            b * h,
            #[inline(always)]
            |item, s| {
                let (bi, hi) = (item / h, item % h);
                // SAFETY: every pointer below stays inside its tensor; each (b, h) writes only its
                // own columns of y and its own row of lse.
                unsafe {
                    let q = qkv.get().add(bi * t * 3 * c + hi * d);
                    let rows = |ptr, stride| Rows { ptr, stride };
                    let lse_row = std::slice::from_raw_parts_mut(lse.get().add(item * t), t);
                    head_forward(
                        (t, d, scale),
                        [
                            rows(q, 3 * c),
                            rows(q.add(c), 3 * c),
                            rows(q.add(2 * c), 3 * c),
                        ],
                        rows(y.get().add(bi * t * c + hi * d), c),
                        s,
                        lse_row,
                        None,
                    );
                }
            },
        );
    }
}

impl CpuKernel for CausalAttentionBackward {
    fn run(&self, k: &Kernel<'_>) {
        let Ok((b, t, c, d)) = dims(self.name(), k.in_shape(0), self.n_head) else {
            unreachable!("shape rule checked at build time")
        };
        let qkv = SendPtr(k.in_f32(0).as_ptr() as *mut f32);
        let y = SendPtr(k.in_f32(1).as_ptr() as *mut f32);
        let lse = k.in_f32(2);
        let dy = SendPtr(k.in_f32(3).as_ptr() as *mut f32);
        let dqkv = SendPtr(k.out_f32(0).as_mut_ptr());
        let h = self.n_head;
        let scale = 1.0 / (d as f32).sqrt();
        for_each_head(
            k.workspace(),
            backward_scratch(t, d),
            b * h,
            #[inline(always)]
            |item, ws| {
                let (bi, hi) = (item / h, item % h);
                // SAFETY: as in the forward; each (b, h) writes only its own columns of dqkv.
                unsafe {
                    let q = qkv.get().add(bi * t * 3 * c + hi * d);
                    let dq = dqkv.get().add(bi * t * 3 * c + hi * d);
                    let (yb, dyb) = (
                        y.get().add(bi * t * c + hi * d),
                        dy.get().add(bi * t * c + hi * d),
                    );
                    let r3 = |ptr| Rows { ptr, stride: 3 * c };
                    let rc = |ptr| Rows { ptr, stride: c };
                    let head = HeadGrads {
                        q: r3(q),
                        k: r3(q.add(c)),
                        v: r3(q.add(2 * c)),
                        y: rc(yb),
                        dy: rc(dyb),
                        dq: r3(dq),
                        dk: r3(dq.add(c)),
                        dv: r3(dq.add(2 * c)),
                    };
                    head_backward(
                        (t, d, scale),
                        &head,
                        &lse[item * t..(item + 1) * t],
                        ws,
                        false,
                        None,
                    );
                }
            },
        );
    }
}

/// [`CausalAttention`]'s kernel under [`snug_graph::ops::HalfIo`]: with `half_qkv`, each
/// head's queries, keys and values are widened from bf16 into its scratch, `[t, 3d]`, first;
/// with `half_y`, its output is made there, `[t, d]`, and rounded into `y` after.
pub(super) fn forward_io(op: &CausalAttention, k: &Kernel<'_>, (half_qkv, half_y): (bool, bool)) {
    if !half_qkv && !half_y {
        return op.run(k);
    }
    let Ok((b, t, c, d)) = dims(op.name(), k.in_shape(0), op.n_head) else {
        unreachable!("shape rule checked at build time")
    };
    let (qkv, qkv16) = if half_qkv {
        (SendPtr(std::ptr::null_mut()), k.in_u16(0))
    } else {
        (SendPtr(k.in_f32(0).as_ptr() as *mut f32), &[][..])
    };
    // `y` as f32, or (its pointer carried as an f32 one) as bf16 bits.
    let y = if half_y {
        SendPtr(k.out_u16(0).as_mut_ptr() as *mut f32)
    } else {
        SendPtr(k.out_f32(0).as_mut_ptr())
    };
    let lse = SendPtr(k.out_f32(1).as_mut_ptr());
    let h = op.n_head;
    let scale = 1.0 / (d as f32).sqrt();
    let own = forward_scratch(t, d);
    let staging = (3 * usize::from(half_qkv) + usize::from(half_y)) * t * d;
    // Products on bf16 inputs compute in bf16 arithmetic where the CPU has it.
    let bf16 = half_qkv.then(HeadBf16::host).flatten();
    // On AVX512-BF16, from the bits, each head's keys and values paired once.
    #[cfg(target_arch = "x86_64")]
    let paired = bf16.is_some_and(HeadBf16::native)
        && paired::pairable(d, 3 * c, qkv16.as_ptr())
        && paired::forward_len(t, d) <= own + 3 * t * d;
    for_each_head(
        k.workspace(),
        own + staging,
        b * h,
        #[inline(always)]
        |item, s| {
            let (bi, hi) = (item / h, item % h);
            let (at3, at1) = (bi * t * 3 * c + hi * d, bi * t * c + hi * d);
            #[cfg(target_arch = "x86_64")]
            if paired {
                let (work, s_y) = s.split_at_mut(own + 3 * t * d);
                let bits = |p: usize| paired::Bits {
                    ptr: qkv16[at3 + p * c..].as_ptr(),
                    stride: 3 * c,
                };
                let out = Rows::staged_or(s_y, (y.get().wrapping_add(at1), c), d);
                // SAFETY: the rows lie inside `qkv` (pairable, checked above) and `y` or the
                // staged output; each (b, h) writes only its own columns of y and row of lse;
                // the CPU has AVX512-BF16 (a native tile).
                unsafe {
                    let lse_row = std::slice::from_raw_parts_mut(lse.get().add(item * t), t);
                    let qkv = [bits(0), bits(1), bits(2)];
                    let done = paired::head_forward((t, d, scale), qkv, out, work, lse_row);
                    debug_assert!(done, "the scratch was sized for it");
                    if half_y {
                        let y16 = (y.get() as *mut u16).add(at1);
                        unstage_head(s_y, y16, (c, (0, 1)), d);
                    }
                }
                return;
            }
            let (s, rest) = s.split_at_mut(own);
            let (s_qkv, s_y) = rest.split_at_mut(if half_qkv { 3 * t * d } else { 0 });
            if half_qkv {
                stage_head(qkv16, (at3, 3 * c), (c, 3), d, s_qkv);
            }
            let (base, stride, part) = if half_qkv {
                (s_qkv.as_mut_ptr(), 3 * d, d)
            } else {
                (qkv.get().wrapping_add(at3), 3 * c, c)
            };
            let at = |p: usize| Rows {
                ptr: base.wrapping_add(p * part),
                stride,
            };
            let out = Rows::staged_or(s_y, (y.get().wrapping_add(at1), c), d);
            // SAFETY: the rows lie inside `qkv` or the staged copy; each (b, h) writes only its own
            // columns of y (or its own staged output) and its own row of lse.
            unsafe {
                let lse_row = std::slice::from_raw_parts_mut(lse.get().add(item * t), t);
                head_forward((t, d, scale), [at(0), at(1), at(2)], out, s, lse_row, bf16);
                if half_y {
                    let y16 = (y.get() as *mut u16).add(at1);
                    unstage_head(s_y, y16, (c, (0, 1)), d);
                }
            }
        },
    );
}

/// [`CausalAttentionBackward`]'s kernel under [`snug_graph::ops::HalfIo`]: the bf16 inputs
/// (`[qkv, y, dy]` as `halves` flags) widened into each head's scratch first, and with
/// `half_dqkv` the head's gradients made there and rounded into `dqkv` after.
pub(super) fn backward_io(
    op: &CausalAttentionBackward,
    k: &Kernel<'_>,
    halves: [bool; 3],
    half_dqkv: bool,
) {
    if halves == [false; 3] && !half_dqkv {
        return op.run(k);
    }
    let Ok((b, t, c, d)) = dims(op.name(), k.in_shape(0), op.n_head) else {
        unreachable!("shape rule checked at build time")
    };
    // Each input as f32 (a pointer) or bf16 bits.
    let src = |i: usize, half: bool| {
        if half {
            (SendPtr(std::ptr::null_mut()), k.in_u16(i))
        } else {
            (SendPtr(k.in_f32(i).as_ptr() as *mut f32), &[][..])
        }
    };
    let [half_qkv, half_y, half_dy] = halves;
    let (qkv, qkv16) = src(0, half_qkv);
    let (y, y16) = src(1, half_y);
    let lse = k.in_f32(2);
    let (dy, dy16) = src(3, half_dy);
    // `dqkv` as f32, or (its pointer carried as an f32 one) as bf16 bits.
    let (dqkv, dqkv16) = if half_dqkv {
        let bits = k.out_u16(0).as_mut_ptr() as *mut f32;
        (SendPtr(std::ptr::null_mut()), SendPtr(bits))
    } else {
        (
            SendPtr(k.out_f32(0).as_mut_ptr()),
            SendPtr(std::ptr::null_mut()),
        )
    };
    let h = op.n_head;
    let scale = 1.0 / (d as f32).sqrt();
    let own = backward_scratch(t, d);
    let wide = |half: bool, width: usize| if half { width * t * d } else { 0 };
    let staging = wide(half_qkv, 3) + wide(half_y, 1) + wide(half_dy, 1) + wide(half_dqkv, 3);
    let bf16 = half_qkv.then(HeadBf16::host).flatten();
    // On AVX512-BF16, from the bits (every input bf16), each head's keys and values paired
    // once; the scratch in front of the staged gradients is the pairing's.
    #[cfg(target_arch = "x86_64")]
    let work = own + wide(half_qkv, 3) + wide(half_y, 1) + wide(half_dy, 1);
    #[cfg(target_arch = "x86_64")]
    let paired = bf16.is_some_and(HeadBf16::native)
        && halves == [true; 3]
        && paired::pairable(d, 3 * c, qkv16.as_ptr())
        && paired::pairable(d, c, y16.as_ptr())
        && paired::pairable(d, c, dy16.as_ptr())
        && paired::backward_len(t, d) <= work;
    for_each_head(
        k.workspace(),
        own + staging,
        b * h,
        #[inline(always)]
        |item, ws| {
            let (bi, hi) = (item / h, item % h);
            #[cfg(target_arch = "x86_64")]
            if paired {
                let (at3, at1) = (bi * t * 3 * c + hi * d, bi * t * c + hi * d);
                let (work, s_d) = ws.split_at_mut(work);
                let bits = |x: &[u16], at: usize, stride: usize| paired::Bits {
                    ptr: x[at..].as_ptr(),
                    stride,
                };
                let head = paired::HeadBits {
                    q: bits(qkv16, at3, 3 * c),
                    k: bits(qkv16, at3 + c, 3 * c),
                    v: bits(qkv16, at3 + 2 * c, 3 * c),
                    y: bits(y16, at1, c),
                    dy: bits(dy16, at1, c),
                };
                // SAFETY: the rows lie inside their tensors (pairable, checked above) or the
                // staged gradients; each (b, h) writes only its own columns of dqkv; the CPU
                // has AVX512-BF16 (a native tile).
                unsafe {
                    let dq = Rows::staged_or(s_d, (dqkv.get().wrapping_add(at3), 3 * c), 3 * d);
                    let part = |p: usize| Rows {
                        ptr: dq.ptr.add(p * if half_dqkv { d } else { c }),
                        stride: dq.stride,
                    };
                    let lse = &lse[item * t..(item + 1) * t];
                    let grads = [part(0), part(1), part(2)];
                    let done = paired::head_backward((t, d, scale), &head, grads, lse, work, false);
                    debug_assert!(done, "the scratch was sized for it");
                    if half_dqkv {
                        let dqkv16 = (dqkv16.get() as *mut u16).add(at3);
                        unstage_head(s_d, dqkv16, (3 * c, (c, 3)), d);
                    }
                }
                return;
            }
            let (ws, rest) = ws.split_at_mut(own);
            let (s_qkv, rest) = rest.split_at_mut(wide(half_qkv, 3));
            let (s_y, rest) = rest.split_at_mut(wide(half_y, 1));
            let (s_dy, s_d) = rest.split_at_mut(wide(half_dy, 1));
            let (at3, at1) = (bi * t * 3 * c + hi * d, bi * t * c + hi * d);
            let rows = |staged: &mut [f32], f32_at: *mut f32, stride: usize, width: usize| {
                Rows::staged_or(staged, (f32_at, stride), width * d)
            };
            if half_qkv {
                stage_head(qkv16, (at3, 3 * c), (c, 3), d, s_qkv);
            }
            if half_y {
                stage_head(y16, (at1, c), (0, 1), d, s_y);
            }
            if half_dy {
                stage_head(dy16, (at1, c), (0, 1), d, s_dy);
            }
            // SAFETY: every pointer stays inside its tensor or its staged copy; each (b, h) writes
            // only its own columns of dqkv (or of its own staged gradients).
            unsafe {
                let q = rows(s_qkv, qkv.get().wrapping_add(at3), 3 * c, 3);
                let dq = rows(s_d, dqkv.get().wrapping_add(at3), 3 * c, 3);
                let part = |r: Rows, staged: bool, p: usize| Rows {
                    ptr: r.ptr.add(p * if staged { d } else { c }),
                    stride: r.stride,
                };
                let head = HeadGrads {
                    q,
                    k: part(q, half_qkv, 1),
                    v: part(q, half_qkv, 2),
                    y: rows(s_y, y.get().wrapping_add(at1), c, 1),
                    dy: rows(s_dy, dy.get().wrapping_add(at1), c, 1),
                    dq,
                    dk: part(dq, half_dqkv, 1),
                    dv: part(dq, half_dqkv, 2),
                };
                head_backward(
                    (t, d, scale),
                    &head,
                    &lse[item * t..(item + 1) * t],
                    ws,
                    false,
                    bf16,
                );
                if half_dqkv {
                    let dqkv16 = (dqkv16.get() as *mut u16).add(at3);
                    unstage_head(s_d, dqkv16, (3 * c, (c, 3)), d);
                }
            }
        },
    );
}

/// Widens one head's `parts` strips of `d` bf16 values per row (`part_stride` apart, rows
/// `row_stride` apart from `at`) into `staged` as `[t, parts · d]`, compiled for the CPU's
/// vector level.
pub(super) fn stage_head(
    bits: &[u16],
    (at, row_stride): (usize, usize),
    (part_stride, parts): (usize, usize),
    d: usize,
    staged: &mut [f32],
) {
    struct Stage<'a> {
        bits: &'a [u16],
        strides: (usize, usize, usize),
        d: usize,
        staged: &'a mut [f32],
    }
    impl crate::isa::Loop for Stage<'_> {
        #[inline(always)]
        fn run(self) {
            let (row_stride, part_stride, parts) = self.strides;
            let d = self.d;
            for (r, row) in self.staged.chunks_exact_mut(parts * d).enumerate() {
                for (p, strip) in row.chunks_exact_mut(d).enumerate() {
                    let from = &self.bits[r * row_stride + p * part_stride..][..d];
                    for (o, &v) in strip.iter_mut().zip(from) {
                        *o = v.get();
                    }
                }
            }
        }
    }
    crate::isa::vectorized_loop(Stage {
        bits: &bits[at..],
        strides: (row_stride, part_stride, parts),
        d,
        staged,
    });
}

/// Rounds a head's staged `[t, parts · d]` into its bf16 strips (rows `row_stride` apart from
/// `out`, parts `part_stride` apart): [`stage_head`]'s inverse, compiled likewise.
///
/// # Safety
/// Every strip must lie inside the bf16 tensor `out` points into, and no other thread may
/// write them.
pub(super) unsafe fn unstage_head(
    staged: &[f32],
    out: *mut u16,
    (row_stride, (part_stride, parts)): (usize, (usize, usize)),
    d: usize,
) {
    struct Unstage<'a> {
        staged: &'a [f32],
        out: *mut u16,
        strides: (usize, usize, usize),
        d: usize,
    }
    impl crate::isa::Loop for Unstage<'_> {
        #[inline(always)]
        fn run(self) {
            let (row_stride, part_stride, parts) = self.strides;
            let d = self.d;
            for (r, row) in self.staged.chunks_exact(parts * d).enumerate() {
                for (p, strip) in row.chunks_exact(d).enumerate() {
                    // SAFETY: the strip lies inside the tensor and is this thread's alone, as
                    // `unstage_head`'s caller vouched.
                    let to = unsafe {
                        std::slice::from_raw_parts_mut(
                            self.out.add(r * row_stride + p * part_stride),
                            d,
                        )
                    };
                    for (o, &v) in to.iter_mut().zip(strip) {
                        *o = <u16 as Elem>::put(v);
                    }
                }
            }
        }
    }
    crate::isa::vectorized_loop(Unstage {
        staged,
        out,
        strides: (row_stride, part_stride, parts),
        d,
    });
}

use crate::par::{for_each_item as for_each_head, SendPtr};

/// One head's rows inside a strided tensor: the first element and the distance between rows.
#[derive(Clone, Copy)]
pub(super) struct Rows {
    pub ptr: *mut f32,
    pub stride: usize,
}

impl Rows {
    /// A head operand's rows: staged from bf16 (`staged_stride` apart) where `staged` is not
    /// empty, else in the f32 tensor at `f32_at`, `stride` apart.
    pub(super) fn staged_or(
        staged: &mut [f32],
        (f32_at, stride): (*mut f32, usize),
        staged_stride: usize,
    ) -> Rows {
        if staged.is_empty() {
            Rows {
                ptr: f32_at,
                stride,
            }
        } else {
            Rows {
                ptr: staged.as_mut_ptr(),
                stride: staged_stride,
            }
        }
    }
}

/// A head's forward inputs and outputs and their gradients, for [`head_backward`].
pub(super) struct HeadGrads {
    pub q: Rows,
    pub k: Rows,
    pub v: Rows,
    pub y: Rows,
    pub dy: Rows,
    pub dq: Rows,
    pub dk: Rows,
    pub dv: Rows,
}

/// A product's right operand as [`head_gemm`] reads it: strips of 64 columns `strip` floats
/// apart, each strip's rows `rs` apart and contiguous.
#[derive(Clone, Copy)]
struct Right {
    ptr: *const f32,
    rs: usize,
    strip: usize,
}

impl Right {
    /// A head's rows read in place (copying them contiguous first measured no faster).
    fn rows(x: Rows) -> Right {
        Right {
            ptr: x.ptr,
            rs: x.stride,
            strip: 64,
        }
    }

    /// The same operand from row `r` on.
    unsafe fn down(self, r: usize) -> Right {
        Right {
            ptr: unsafe { self.ptr.add(r * self.rs) },
            ..self
        }
    }
}

/// `c (+)= scale · op(a) · b` (adding with `acc`) on one head's matrices, `op` transposing
/// with `ta`, leaving out what `causal` says where the product runs on `small_gemm` (elsewhere
/// computing the whole, which gives the same); in bf16 arithmetic on `bf16`'s tile where
/// given (each operand rounded to bf16 as it is packed: the probabilities and score
/// gradients, which are made in f32, included), else in f32.
///
/// # Safety
/// Every pointer must be valid for the rows its shape and stride reach; `bf16`'s tile must be
/// one this CPU runs ([`HeadBf16::host`]'s).
unsafe fn head_gemm(
    (m, n, k): (usize, usize, usize),
    c: Rows,
    (a, ta): (Rows, bool),
    b: Right,
    (scale, acc): (f32, bool),
    causal: Causal,
    bf16: Option<HeadBf16>,
) {
    let (a_rs, a_cs) = if ta { (1, a.stride) } else { (a.stride, 1) };
    #[cfg(target_arch = "x86_64")]
    if let (None, Some((small_gemm, _))) = (bf16, crate::gemm::head_kernels()) {
        // SAFETY: the CPU was checked; the caller vouches for the operands.
        unsafe {
            crate::gemm::causal_small_gemm(
                small_gemm,
                (m, n, k),
                (c.ptr, c.stride),
                (a.ptr, a_rs, a_cs),
                (b.ptr, b.rs, b.strip),
                (scale, acc),
                causal,
            )
        };
        return;
    }
    // The whole product below: what `causal` leaves out is zero or never read.
    let _ = causal;
    // On the bf16 tile, a `b` whose columns are contiguous (rows read in place) is one
    // product, so `a` is packed once rather than once a strip.
    let strip = if bf16.is_some() && b.strip == 64 {
        n.max(1)
    } else {
        64
    };
    for j0 in (0..n).step_by(strip) {
        let w = (n - j0).min(strip);
        let (c_at, b_at) = (
            c.ptr.wrapping_add(j0),
            b.ptr.wrapping_add(j0 / 64 * b.strip),
        );
        #[cfg(target_arch = "x86_64")]
        if let Some(tile) = bf16 {
            // SAFETY: strip `j0 / 64` of `b` and columns `j0..` of `c`, and a tile this CPU
            // runs, as the caller vouched.
            let done = unsafe {
                tile.gemm(
                    (m, w, k),
                    (c_at, c.stride as isize),
                    (a.ptr, a_rs as isize, a_cs as isize),
                    (b_at, b.rs as isize, 1),
                    scale,
                    acc,
                )
            };
            if done {
                continue;
            }
        }
        // SAFETY: as above.
        unsafe {
            crate::gemm::gemm_raw(
                (m, w, k),
                (c_at, c.stride as isize, 1),
                (a.ptr, a_rs as isize, a_cs as isize),
                (b_at, b.rs as isize, 1),
                scale,
                acc,
                gemm::Parallelism::None,
                crate::gemm::Arith::F32,
            )
        };
    }
}

/// `x`'s `t` rows of `d` transposed (`[d, t]`), in strips of 64 of them ([`across_len`] floats),
/// for products whose columns are `x`'s rows (scores against keys).
///
/// # Safety
/// `x` must be valid for `t` rows of `d` elements at its stride.
unsafe fn rows_across(x: Rows, (t, d): (usize, usize), out: &mut [f32]) -> Right {
    let out = &mut out[..across_len(t, d)];
    for (strip, o) in out.chunks_exact_mut(64 * d).enumerate() {
        let (r0, rows) = (strip * 64, (t - strip * 64).min(64));
        // SAFETY: rows `r0..r0 + rows` of `x`, as the caller vouched.
        let x = unsafe { x.down(r0) };
        #[cfg(target_arch = "x86_64")]
        if let Some((_, transpose)) = crate::gemm::head_kernels() {
            // SAFETY: the CPU was checked; `o` holds d rows of 64.
            unsafe { transpose((x.ptr, x.stride), (rows, d), (o.as_mut_ptr(), 64)) };
            continue;
        }
        for r in 0..rows {
            // SAFETY: as above.
            let row = unsafe { std::slice::from_raw_parts(x.ptr.add(r * x.stride), d) };
            for (p, &v) in row.iter().enumerate() {
                o[p * 64 + r] = v;
            }
        }
    }
    Right {
        ptr: out.as_ptr(),
        rs: 64,
        strip: 64 * d,
    }
}

impl Rows {
    /// The same rows starting `r` rows further down.
    unsafe fn down(self, r: usize) -> Rows {
        Rows {
            ptr: self.ptr.add(r * self.stride),
            stride: self.stride,
        }
    }
}

/// One (batch, head) of causal attention: `y = softmax(scale·QKᵀ, causal) · V`, recording each
/// row's log-sum-exp; `s` is [`forward_scratch`] floats.
///
/// # Safety
/// The pointers must be valid for `t` rows of `d` elements at their strides; `bf16`'s tile
/// must be one this CPU runs ([`HeadBf16::host`]'s).
pub(super) unsafe fn head_forward(
    (t, d, scale): (usize, usize, f32),
    [q, k, v]: [Rows; 3],
    y: Rows,
    s: &mut [f32],
    lse: &mut [f32],
    bf16: Option<HeadBf16>,
) {
    // Not inlined into its caller's vectorised chunk: compiled for the level here.
    // SAFETY: as the caller vouched.
    crate::isa::vectorized(
        #[inline(always)]
        || unsafe { head_forward_body((t, d, scale), [q, k, v], y, s, lse, bf16) },
    )
}

/// [`head_forward`]'s body.
///
/// # Safety
/// As [`head_forward`].
#[inline(always)]
unsafe fn head_forward_body(
    (t, d, scale): (usize, usize, f32),
    [q, k, v]: [Rows; 3],
    y: Rows,
    s: &mut [f32],
    lse: &mut [f32],
    bf16: Option<HeadBf16>,
) {
    // SAFETY: as the caller vouched.
    unsafe {
        let (s, kt) = s.split_at_mut(t * t);
        let (kt, v) = (rows_across(k, (t, d), kt), Right::rows(v));
        let gemm = |dims, c, a, ta, b, scale_acc, causal| {
            head_gemm(dims, c, (a, ta), b, scale_acc, causal, bf16)
        };
        let s_rows = Rows {
            ptr: s.as_mut_ptr(),
            stride: t,
        };
        for (r0, r1) in row_blocks(t) {
            let (m, s_blk, q_rows) = (r1 - r0, s_rows.down(r0), q.down(r0));
            let (cols, deep) = (Causal::Columns(r0), Causal::Depth(r0));
            gemm((m, r1, d), s_blk, q_rows, false, kt, (scale, false), cols);
            for i in r0..r1 {
                softmax_causal_row(i, &mut s[i * t..i * t + r1], &mut lse[i]);
            }
            gemm((m, d, r1), y.down(r0), s_blk, false, v, (1.0, false), deep);
        }
    }
}

/// Gradients of one (batch, head), recomputing the probabilities from `lse`; `ws` is
/// [`backward_scratch`] floats. With `accumulate_kv`, `dk` and `dv` are added to (several query heads sharing a
/// key/value head) instead of overwritten.
///
/// # Safety
/// The pointers must be valid for `t` rows of `d` elements at their strides; `bf16`'s tile
/// must be one this CPU runs ([`HeadBf16::host`]'s).
pub(super) unsafe fn head_backward(
    (t, d, scale): (usize, usize, f32),
    h: &HeadGrads,
    lse: &[f32],
    ws: &mut [f32],
    accumulate_kv: bool,
    bf16: Option<HeadBf16>,
) {
    // Not inlined into its caller's vectorised chunk: compiled for the level here.
    // SAFETY: as the caller vouched.
    crate::isa::vectorized(
        #[inline(always)]
        || unsafe { head_backward_body((t, d, scale), h, lse, ws, accumulate_kv, bf16) },
    )
}

/// [`head_backward`]'s body.
///
/// # Safety
/// As [`head_backward`].
#[inline(always)]
unsafe fn head_backward_body(
    (t, d, scale): (usize, usize, f32),
    h: &HeadGrads,
    lse: &[f32],
    ws: &mut [f32],
    accumulate_kv: bool,
    bf16: Option<HeadBf16>,
) {
    // SAFETY: as the caller vouched.
    unsafe {
        let (p, rest) = ws.split_at_mut(t * t);
        let (dp, rest) = rest.split_at_mut(t * t);
        let (kt, vt) = rest.split_at_mut(across_len(t, d));
        let (kt, vt) = (rows_across(h.k, (t, d), kt), rows_across(h.v, (t, d), vt));
        let (k, q, dy) = (Right::rows(h.k), Right::rows(h.q), Right::rows(h.dy));
        let gemm = |dims, c, a, ta, b, scale_acc, causal| {
            head_gemm(dims, c, (a, ta), b, scale_acc, causal, bf16)
        };
        let (p_rows, dp_rows) = (
            Rows {
                ptr: p.as_mut_ptr(),
                stride: t,
            },
            Rows {
                ptr: dp.as_mut_ptr(),
                stride: t,
            },
        );
        // Every row block adds into dK and dV rows 0..r1: the last block, which reaches every row,
        // goes first and writes them, so they need no zeroing.
        for (r0, r1) in row_blocks(t).rev() {
            let kv_acc = accumulate_kv || r1 < t;
            let m = r1 - r0;
            let (p_blk, dp_blk) = (p_rows.down(r0), dp_rows.down(r0));
            let (cols, deep, from) = (
                Causal::Columns(r0),
                Causal::Depth(r0),
                Causal::DepthFrom(r0),
            );
            // The block's rows as `a` operands, and as `b` ones.
            let (q_rows, dy_rows, dq_rows) = (h.q.down(r0), h.dy.down(r0), h.dq.down(r0));
            let (q_blk, dy_blk) = (q.down(r0), dy.down(r0));
            // P = exp(scale·QKᵀ − lse), zero above the diagonal.
            gemm((m, r1, d), p_blk, q_rows, false, kt, (scale, false), cols);
            for i in r0..r1 {
                let (live, masked) = p[i * t..i * t + r1].split_at_mut(i + 1);
                let l = lse[i];
                for x in live.iter_mut() {
                    *x = crate::math::exp(*x - l);
                }
                masked.fill(0.0);
            }
            // dV[0..r1] += Pᵀ · dY ;  dP = dY · Vᵀ
            gemm((r1, d, m), h.dv, p_blk, true, dy_blk, (1.0, kv_acc), from);
            gemm((m, r1, d), dp_blk, dy_rows, false, vt, (1.0, false), cols);
            // dS = P ⊙ (dP − rowsum(dY ⊙ Y)); dP past the diagonal may be left out, and dS is
            // zero there.
            for i in r0..r1 {
                let dy_row = std::slice::from_raw_parts(h.dy.ptr.add(i * h.dy.stride), d);
                let y_row = std::slice::from_raw_parts(h.y.ptr.add(i * h.y.stride), d);
                let di = crate::math::dot(dy_row, y_row);
                let (pr, dpr) = (&p[i * t..i * t + r1], &mut dp[i * t..i * t + r1]);
                let (live, masked) = dpr.split_at_mut(i + 1);
                for (g, &pv) in live.iter_mut().zip(pr) {
                    *g = pv * (*g - di);
                }
                masked.fill(0.0);
            }
            // dQ = scale · dS · K ;  dK[0..r1] += scale · dSᵀ · Q
            gemm((m, d, r1), dq_rows, dp_blk, false, k, (scale, false), deep);
            gemm((r1, d, m), h.dk, dp_blk, true, q_blk, (scale, kv_acc), from);
        }
    }
}

/// Row `i` of scores (only its first `r1 ≥ i + 1` columns are read later) becomes causal
/// probabilities in place; records the row's log-sum-exp.
#[inline(always)]
fn softmax_causal_row(i: usize, row: &mut [f32], lse: &mut f32) {
    let (live, masked) = row.split_at_mut(i + 1);
    let max = crate::math::max(live);
    // Exponentials first, then their sum: one loop doing both stays scalar.
    for x in live.iter_mut() {
        *x = crate::math::exp(*x - max);
    }
    let sum = crate::math::sum(live);
    let inv = 1.0 / sum;
    live.iter_mut().for_each(|x| *x *= inv);
    masked.fill(0.0);
    *lse = max + sum.ln();
}

// The bf16 tiles are x86-64's.
#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::gemm::round_to_bf16;
    use crate::isa::{Bf16Math, CpuFeatures};

    /// One head's outputs: `y`, `dq`, `dk`, `dv`, each `[t, d]`.
    type Outputs = [Vec<f64>; 4];

    /// One head of attention in f64, forward then backward, with each product's operands
    /// rounded to bf16 where `round` says, as bf16 arithmetic packs them: the probabilities
    /// in `P·V` and `Pᵀ·dY`, the score gradients in `dS·K` and `dSᵀ·Q` (the inputs are bf16
    /// values already). `y` for the backward is `y_in`, as the kernel is given it.
    fn reference(
        (t, d): (usize, usize),
        [q, k, v, dy]: [&[f32]; 4],
        y_in: &[f32],
        round: bool,
    ) -> Outputs {
        let r = |x: f64| {
            if round {
                f64::from(round_to_bf16(x as f32))
            } else {
                x
            }
        };
        let at = |x: &[f32], i: usize, p: usize| f64::from(x[i * d + p]);
        let scale = 1.0 / (d as f64).sqrt();
        let mut p = vec![0.0f64; t * t];
        for i in 0..t {
            let s: Vec<f64> = (0..=i)
                .map(|j| scale * (0..d).map(|c| at(q, i, c) * at(k, j, c)).sum::<f64>())
                .collect();
            let max = s.iter().copied().fold(f64::MIN, f64::max);
            let sum: f64 = s.iter().map(|x| (x - max).exp()).sum();
            for (j, x) in s.iter().enumerate() {
                p[i * t + j] = (x - max).exp() / sum;
            }
        }
        let (mut y, mut dq, mut dk, mut dv) = (
            vec![0.0; t * d],
            vec![0.0; t * d],
            vec![0.0; t * d],
            vec![0.0; t * d],
        );
        for i in 0..t {
            let di: f64 = (0..d).map(|c| at(dy, i, c) * at(y_in, i, c)).sum();
            for j in 0..=i {
                let pij = p[i * t + j];
                let dp: f64 = (0..d).map(|c| at(dy, i, c) * at(v, j, c)).sum();
                let ds = r(pij * (dp - di));
                for c in 0..d {
                    y[i * d + c] += r(pij) * at(v, j, c);
                    dv[j * d + c] += r(pij) * at(dy, i, c);
                    dq[i * d + c] += scale * ds * at(k, j, c);
                    dk[j * d + c] += scale * ds * at(q, i, c);
                }
            }
        }
        [y, dq, dk, dv]
    }

    /// One head's outputs and scratch, made before a run so that the run allocates nothing
    /// (under emulation it must not).
    struct Head {
        y: Vec<f32>,
        lse: Vec<f32>,
        s: Vec<f32>,
        grads: [Vec<f32>; 3],
        ws: Vec<f32>,
    }

    impl Head {
        fn new((t, d): (usize, usize)) -> Head {
            Head {
                y: vec![0.0; t * d],
                lse: vec![0.0; t],
                // Scratch as unwritten as a reused workspace: a product that leaves out a
                // part something later reads shows as NaN.
                s: vec![f32::NAN; forward_scratch(t, d)],
                grads: [0, 1, 2].map(|_| vec![0.0; t * d]),
                ws: vec![f32::NAN; backward_scratch(t, d)],
            }
        }

        fn outputs(&self) -> Outputs {
            let wide = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect();
            let [dq, dk, dv] = &self.grads;
            [wide(&self.y), wide(dq), wide(dk), wide(dv)]
        }
    }

    /// One head through [`head_forward`] and [`head_backward`] on `bf16`'s tile (or in f32)
    /// into `out`.
    fn run_head(
        (t, d): (usize, usize),
        [q, k, v, dy]: [&[f32]; 4],
        y_in: &[f32],
        bf16: Option<HeadBf16>,
        out: &mut Head,
    ) {
        let rows = |x: &[f32]| Rows {
            ptr: x.as_ptr() as *mut f32,
            stride: d,
        };
        let scale = 1.0 / (d as f32).sqrt();
        let [dq, dk, dv] = &mut out.grads;
        // SAFETY: every operand holds `t` rows of `d` at stride `d`; the outputs are distinct.
        unsafe {
            head_forward(
                (t, d, scale),
                [rows(q), rows(k), rows(v)],
                rows(&out.y),
                &mut out.s,
                &mut out.lse,
                bf16,
            );
            let head = HeadGrads {
                q: rows(q),
                k: rows(k),
                v: rows(v),
                y: rows(y_in),
                dy: rows(dy),
                dq: rows(dq),
                dk: rows(dk),
                dv: rows(dv),
            };
            head_backward((t, d, scale), &head, &out.lse, &mut out.ws, false, bf16);
        }
    }

    /// A head of `d` over a sequence of `t` (100 and 24: a partial row block, strip and
    /// register tile): bf16 inputs with spread scores, so the probabilities are far from
    /// uniform, and `y` as a bf16 forward would have stored it.
    struct Case {
        dims: (usize, usize),
        inputs: [Vec<f32>; 4],
        y_in: Vec<f32>,
    }

    impl Case {
        fn new((t, d): (usize, usize)) -> Case {
            let values = |seed: u64, spread: f32| -> Vec<f32> {
                crate::gemm::test_support::values(t * d, seed)
                    .into_iter()
                    .map(|x| round_to_bf16(x * spread))
                    .collect()
            };
            let inputs = [
                values(1, 4.0),
                values(2, 4.0),
                values(3, 1.0),
                values(4, 1.0),
            ];
            let refs = [0, 1, 2, 3].map(|i| &inputs[i][..]);
            let y = reference((t, d), refs, &inputs[2], false)[0].clone();
            let y_in = y.iter().map(|&x| round_to_bf16(x as f32)).collect();
            Case {
                dims: (t, d),
                inputs,
                y_in,
            }
        }

        fn inputs(&self) -> [&[f32]; 4] {
            [0, 1, 2, 3].map(|i| &self.inputs[i][..])
        }

        /// Asserts that `bf16` (a run in bf16 arithmetic) matches the reference that rounds a
        /// hundred times more closely than the two references match each other, and `f32` (a
        /// run in f32, if given) likewise the one that does not.
        fn check(&self, label: &str, bf16: &Outputs, f32_run: Option<&Outputs>) {
            let rounded = reference(self.dims, self.inputs(), &self.y_in, true);
            let exact = reference(self.dims, self.inputs(), &self.y_in, false);
            for (o, name) in ["y", "dq", "dk", "dv"].iter().enumerate() {
                let apart = snug_testkit::max_abs_diff(&rounded[o], &exact[o]);
                assert!(apart > 1e-4, "{name}: rounding moved it only {apart:e}");
                let b = snug_testkit::max_abs_diff(&bf16[o], &rounded[o]);
                assert!(
                    b < 0.01 * apart,
                    "{label} {name}: {b:e} from its reference, {apart:e} apart"
                );
                if let Some(f) = f32_run.map(|f| snug_testkit::max_abs_diff(&f[o], &exact[o])) {
                    assert!(f < 0.01 * apart, "f32 {name}: {f:e} from its reference");
                }
            }
        }
    }

    /// On bf16 inputs, the head's products computed in bf16 arithmetic (here on the modelled
    /// tile, the numbers `VDPBF16PS` gives up to the order of the sum) match an f64 reference
    /// that rounds the same operands a hundred times more closely than one that does not, and
    /// the f32 path the reverse: the rounding is where it should be, and only there (measured:
    /// 1e-7 from its own reference against 2e-4 to 1e-3 between the two).
    #[test]
    fn bf16_head_products_round_their_operands_as_bf16_arithmetic_does() {
        let Some(tile) = HeadBf16::on(CpuFeatures::host(), Bf16Math::Model) else {
            snug_testkit::skip_or_fail("the modelled bf16 tile needs AVX2 + FMA");
            return;
        };
        // And a head of 80: products whose columns are a head's run as one, not by strips.
        for dims in [(100, 24), (70, 80)] {
            let case = Case::new(dims);
            let mut runs = [Some(tile), None].map(|bf16| {
                let mut out = Head::new(case.dims);
                run_head(case.dims, case.inputs(), &case.y_in, bf16, &mut out);
                out.outputs()
            });
            let [modelled, f32_run] = [0, 1].map(|i| std::mem::take(&mut runs[i]));
            case.check("model", &modelled, Some(&f32_run));
        }
    }

    struct Job<'a> {
        case: &'a Case,
        tile: HeadBf16,
        out: Head,
    }

    impl crate::gemm::test_support::EmuJob for Job<'_> {
        unsafe fn run(&mut self) {
            let (case, tile) = (self.case, self.tile);
            run_head(
                case.dims,
                case.inputs(),
                &case.y_in,
                Some(tile),
                &mut self.out,
            );
        }
    }

    /// The same head on AVX512-BF16's tile (`VDPBF16PS`): natively where the CPU has it, else
    /// on an emulated Sapphire Rapids core.
    #[cfg(target_os = "linux")]
    #[test]
    fn vdpbf16ps_head_products_round_their_operands_as_bf16_arithmetic_does() {
        let features = CpuFeatures::AVX512_BF16;
        let Some(tile) = HeadBf16::on(features, Bf16Math::Native) else {
            panic!("AVX512-BF16's features chose no bf16 tile");
        };
        check_head_on_sapphire_rapids(tile, "vdpbf16ps");
    }

    /// A (100, 24) head on `tile`, natively where this CPU has AVX512-BF16 (which the bf16
    /// tiles' packing uses), else on an emulated Sapphire Rapids core, checked against the
    /// reference that rounds the same operands.
    #[cfg(target_os = "linux")]
    fn check_head_on_sapphire_rapids(tile: HeadBf16, label: &str) {
        use snug_testkit::emulate::Model;
        let case = Case::new((100, 24));
        let mut job = Job {
            case: &case,
            tile,
            out: Head::new(case.dims),
        };
        // Nothing the run reaches may allocate or ask the OS: its packing space, the vector
        // level and the head kernels are settled here first.
        tile.reserve();
        let _ = (crate::isa::current(), crate::gemm::head_kernels());
        let native = CpuFeatures::host().bf16_arithmetic();
        // SAFETY: the tile runs where its instructions are, natively or emulated; the job
        // allocates nothing and touches only itself.
        let ran =
            unsafe { crate::gemm::test_support::run_on(native, Model::SapphireRapids, &mut job) };
        if ran {
            case.check(label, &job.out.outputs(), None);
        }
    }

    /// The same head on AMX's tile, which the heads take on a CPU with AMX: its model
    /// (natively where the CPU has AVX512-BF16, whose packing it uses, else on an emulated
    /// Sapphire Rapids core), and the tile instructions themselves where this CPU has them.
    #[cfg(target_os = "linux")]
    #[test]
    fn amx_head_products_round_their_operands_as_bf16_arithmetic_does() {
        check_head_on_sapphire_rapids(HeadBf16::amx(false), "modelled amx");
        if crate::gemm::amx::usable() {
            for dims in [(100, 24), (70, 80)] {
                let case = Case::new(dims);
                let mut out = Head::new(case.dims);
                let tile = HeadBf16::amx(true);
                run_head(case.dims, case.inputs(), &case.y_in, Some(tile), &mut out);
                case.check("amx", &out.outputs(), None);
            }
        } else {
            eprintln!("the AMX tiles themselves: not on this CPU (the modelled ones ran)");
        }
    }

    /// A head's bf16 inputs as the paired kernels read them: `q`, `k`, `v` side by side in
    /// rows of `3d` (as in `qkv`), `y` and `dy` in rows of `d`; scratch filled with NaN, so a
    /// value read from a piece the kernels did not write shows in the outputs.
    struct PairedJob<'a> {
        case: &'a Case,
        qkv: Vec<u16>,
        y: Vec<u16>,
        dy: Vec<u16>,
        out: Head,
        ws: Vec<f32>,
        done: [bool; 2],
    }

    impl PairedJob<'_> {
        fn new(case: &Case) -> PairedJob<'_> {
            let (t, d) = case.dims;
            // Exact: the inputs are bf16 values.
            let bits = |x: &[f32]| x.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            let [q, k, v, dy] = case.inputs();
            let qkv = (0..t)
                .flat_map(|i| [q, k, v].map(|x| &x[i * d..(i + 1) * d]).concat())
                .map(|v: f32| (v.to_bits() >> 16) as u16)
                .collect();
            let ws = paired::forward_len(t, d).max(paired::backward_len(t, d));
            PairedJob {
                case,
                qkv,
                y: bits(&case.y_in),
                dy: bits(dy),
                out: Head::new(case.dims),
                ws: vec![f32::NAN; ws],
                done: [false; 2],
            }
        }
    }

    impl crate::gemm::test_support::EmuJob for PairedJob<'_> {
        unsafe fn run(&mut self) {
            let (t, d) = self.case.dims;
            let scale = 1.0 / (d as f32).sqrt();
            let bits = |x: &[u16], at: usize, stride: usize| paired::Bits {
                ptr: x[at..].as_ptr(),
                stride,
            };
            let rows = |x: &mut [f32]| Rows {
                ptr: x.as_mut_ptr(),
                stride: d,
            };
            let qkv = [0, 1, 2].map(|p| bits(&self.qkv, p * d, 3 * d));
            let [dq, dk, dv] = &mut self.out.grads;
            // SAFETY: every operand holds `t` rows at its stride (pairable: `d` even, the
            // vectors' bits word-aligned); the outputs and scratch are distinct; the CPU (or
            // the emulated one) has AVX512-BF16.
            unsafe {
                self.done[0] = paired::head_forward(
                    (t, d, scale),
                    qkv,
                    rows(&mut self.out.y),
                    &mut self.ws,
                    &mut self.out.lse,
                );
                // The backward's scratch as unwritten as the forward's was.
                self.ws.fill(f32::NAN);
                let head = paired::HeadBits {
                    q: qkv[0],
                    k: qkv[1],
                    v: qkv[2],
                    y: bits(&self.y, 0, d),
                    dy: bits(&self.dy, 0, d),
                };
                let grads = [rows(dq), rows(dk), rows(dv)];
                self.done[1] = paired::head_backward(
                    (t, d, scale),
                    &head,
                    grads,
                    &self.out.lse,
                    &mut self.ws,
                    false,
                );
            }
        }
    }

    /// The heads paired from their bf16 bits (keys and values once a head) compute what
    /// bf16 arithmetic does, as the tile's own packing does: a partial row block and
    /// register tile (100, 24), a head two `b` panels wide (70, 80), and an odd sequence,
    /// whose last block is an odd depth (33, 16). Natively where the CPU has AVX512-BF16,
    /// else on an emulated Sapphire Rapids core.
    #[cfg(target_os = "linux")]
    #[test]
    fn paired_head_products_round_their_operands_as_bf16_arithmetic_does() {
        use snug_testkit::emulate::Model;
        let native = CpuFeatures::host().bf16_arithmetic();
        let _ = crate::isa::current();
        for dims in [(100, 24), (70, 80), (33, 16)] {
            let case = Case::new(dims);
            let mut job = PairedJob::new(&case);
            assert!(
                paired::pairable(dims.1, 3 * dims.1, job.qkv.as_ptr()),
                "the test's rows are not word-aligned"
            );
            // SAFETY: the kernels run where their instructions are, natively or emulated; the
            // job allocates nothing and touches only itself.
            let ran = unsafe {
                crate::gemm::test_support::run_on(native, Model::SapphireRapids, &mut job)
            };
            if !ran {
                return;
            }
            assert_eq!(job.done, [true; 2], "{dims:?}: the scratch was too small");
            case.check(&format!("paired {dims:?}"), &job.out.outputs(), None);
        }
    }

    /// The paired heads fit in the scratch the graph plans for a bf16 head (its own and its
    /// staged `q`, `k`, `v`, and for the backward also `y` and `dy`), at the presets' head
    /// sizes and sequence lengths from one token up: otherwise they would fall back to the
    /// tile's packing, correct but slower. (Heads narrower than 32 may fall back: a `b` panel
    /// of values is 48 wide whatever the head's width.)
    #[test]
    fn the_paired_heads_fit_the_scratch_planned_for_a_bf16_head() {
        use snug_graph::ops::attention::{backward_scratch, forward_scratch};
        for d in [32, 64, 80, 96, 128, 256] {
            for t in [1, 2, 7, 33, 64, 100, 256, 1024, 2048, 4096] {
                let forward = forward_scratch(t, d) + 3 * t * d;
                let backward = backward_scratch(t, d) + 5 * t * d;
                assert!(paired::forward_len(t, d) <= forward, "forward ({t}, {d})");
                assert!(
                    paired::backward_len(t, d) <= backward,
                    "backward ({t}, {d})"
                );
            }
        }
    }
}
