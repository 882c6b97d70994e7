//! Matrix multiply with transposed operands read in place (strides, never a materialised
//! transpose), an optional fused bias, and either a shared 2-D right operand (weights) or a
//! batch of right operands.

use super::{expect_arity, float_dtype, shape_err, OpRule, OutSpec, Reshape, SumTo};
use crate::autodiff::GradCtx;
use crate::tensor::TensorMeta;
use crate::Result;

/// `op(a) · op(b) (+ bias)`, where `op` transposes the last two axes when its flag is set.
///
/// With a 2-D `b`, every leading axis of `a` is folded into the rows (a linear layer).
/// With a batched `b`, `a` and `b` share their leading axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MatMul {
    pub ta: bool,
    pub tb: bool,
    pub bias: bool,
}

/// Sizes of one matmul as `batch` independent `[m,k]·[k,n]` products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatMulDims {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    /// `b` is one matrix shared by the whole batch.
    pub shared_b: bool,
}

impl MatMul {
    pub const NAME: &'static str = "matmul";

    pub fn dims(&self, a: &[usize], b: &[usize]) -> Result<MatMulDims> {
        let op = Self::NAME;
        if a.len() < 2 || b.len() < 2 {
            return Err(shape_err(
                op,
                format!("operands must be at least 2-D, got {a:?} and {b:?}"),
            ));
        }
        let (ar, ac) = (a[a.len() - 2], a[a.len() - 1]);
        let (br, bc) = (b[b.len() - 2], b[b.len() - 1]);
        let (mut m, ka) = if self.ta { (ac, ar) } else { (ar, ac) };
        let (kb, n) = if self.tb { (bc, br) } else { (br, bc) };
        if ka != kb {
            return Err(shape_err(
                op,
                format!(
                    "inner dimensions differ: {a:?}{} · {b:?}{}",
                    t(self.ta),
                    t(self.tb)
                ),
            ));
        }
        let a_batch: usize = a[..a.len() - 2].iter().product();
        let (batch, shared_b) = if b.len() == 2 {
            if self.ta && a.len() > 2 {
                return Err(shape_err(
                    op,
                    "a transposed, batched left operand needs a batched right operand",
                ));
            }
            m *= a_batch;
            (1, true)
        } else {
            if a[..a.len() - 2] != b[..b.len() - 2] {
                return Err(shape_err(
                    op,
                    format!("batch dimensions differ: {a:?} vs {b:?}"),
                ));
            }
            (a_batch, false)
        };
        Ok(MatMulDims {
            batch,
            m,
            k: ka,
            n,
            shared_b,
        })
    }
}

fn t(flag: bool) -> &'static str {
    if flag {
        "ᵀ"
    } else {
        ""
    }
}

impl OpRule for MatMul {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<OutSpec>> {
        expect_arity(Self::NAME, inputs, 2 + self.bias as usize)?;
        let dtype = float_dtype(Self::NAME, inputs)?;
        let (a, b) = (&inputs[0].shape, &inputs[1].shape);
        let d = self.dims(a, b)?;
        if self.bias && inputs[2].shape != [d.n] {
            return Err(shape_err(
                Self::NAME,
                format!("bias has shape {:?}, expected [{}]", inputs[2].shape, d.n),
            ));
        }
        let mut shape = a[..a.len() - 2].to_vec();
        shape.push(if self.ta {
            a[a.len() - 1]
        } else {
            a[a.len() - 2]
        });
        shape.push(d.n);
        let mut spec = OutSpec::f32(shape);
        spec.dtype = dtype;
        Ok(vec![spec])
    }

    fn backward(&self, ctx: &mut GradCtx<'_>) -> Result<()> {
        let Some(dc) = ctx.grad_out(0) else {
            return Ok(());
        };
        let (a, b) = (ctx.input(0), ctx.input(1));
        let (ta, tb) = (self.ta, self.tb);
        if ctx.wants(0) {
            let da = if !ta {
                // dA = dC · op(B)ᵀ
                ctx.apply1(
                    MatMul {
                        ta: false,
                        tb: !tb,
                        bias: false,
                    },
                    &[dc, b],
                )?
            } else {
                // A is stored transposed: dAᵀ = op(B) · dCᵀ
                ctx.apply1(
                    MatMul {
                        ta: tb,
                        tb: true,
                        bias: false,
                    },
                    &[b, dc],
                )?
            };
            ctx.set_grad(0, da);
        }
        if ctx.wants(1) {
            let b_rank = ctx.input_shape(1).len();
            let (a2, dc2) = if b_rank == 2 {
                // A shared weight sums over every row of the batch: fold leading axes (views).
                let a_shape = ctx.input_shape(0);
                let dc_shape = ctx.graph().tensor(dc).shape.clone();
                (flatten2(ctx, a, &a_shape)?, flatten2(ctx, dc, &dc_shape)?)
            } else {
                (a, dc)
            };
            let db = if !tb {
                // dB = op(A)ᵀ · dC
                ctx.apply1(
                    MatMul {
                        ta: !ta,
                        tb: false,
                        bias: false,
                    },
                    &[a2, dc2],
                )?
            } else {
                // B is stored transposed: dBᵀ = dCᵀ · op(A)
                ctx.apply1(
                    MatMul {
                        ta: true,
                        tb: ta,
                        bias: false,
                    },
                    &[dc2, a2],
                )?
            };
            ctx.set_grad(1, db);
        }
        if self.bias && ctx.wants(2) {
            let n = ctx.input_shape(2);
            let dbias = ctx.apply1(SumTo { shape: n }, &[dc])?;
            ctx.set_grad(2, dbias);
        }
        Ok(())
    }

    fn flops(&self, inputs: &[&TensorMeta], _outputs: &[&TensorMeta]) -> u64 {
        match self.dims(&inputs[0].shape, &inputs[1].shape) {
            Ok(d) => 2 * (d.batch * d.m * d.n * d.k) as u64,
            Err(_) => 0,
        }
    }

    #[cfg(feature = "cpu")]
    fn cpu(&self, k: &super::Kernel<'_>) {
        let Ok(d) = self.dims(k.in_shape(0), k.in_shape(1)) else {
            unreachable!("shape rule checked at build time")
        };
        let (a, b, c) = (k.in_f32(0), k.in_f32(1), k.out_f32(0));
        let threads = rayon::current_num_threads();
        if self.bias && d.batch == 1 {
            let fused = Fused {
                prologue: Prologue::None,
                bias: Some(k.in_f32(2)),
            };
            let par = par_for(d.m, d.n, d.k, threads);
            // SAFETY: the shape rule sized `a`, `b`, `c` and the bias for these dimensions.
            let dims = (d.m, d.n, d.k);
            if unsafe { gemm_fused((self.ta, self.tb), dims, a, b, c, par, fused) } {
                return;
            }
        }
        if self.bias {
            let bias = k.in_f32(2);
            super::par::rows_mut(c, d.n, |_, rows| {
                for row in rows.chunks_exact_mut(d.n) {
                    row.copy_from_slice(bias);
                }
            });
        }
        let a_stride = d.m * d.k;
        let b_stride = if d.shared_b { 0 } else { d.k * d.n };
        let c_stride = d.m * d.n;
        let run = |i: usize, c: &mut [f32], par: gemm::Parallelism| {
            let (a, b) = (&a[i * a_stride..], &b[i * b_stride..]);
            // SAFETY: the slices hold `m·k`, `k·n` and `m·n` elements at the strides below.
            unsafe { gemm_strided(self.ta, self.tb, d.m, d.n, d.k, a, b, c, self.bias, par) }
        };
        if d.batch >= threads && threads > 1 {
            use rayon::prelude::*;
            c.par_chunks_mut(c_stride)
                .enumerate()
                .for_each(|(i, c)| run(i, c, gemm::Parallelism::None));
        } else {
            for (i, c) in c.chunks_mut(c_stride).enumerate() {
                run(i, c, par_for(d.m, d.n, d.k, threads));
            }
        }
    }
}

fn flatten2(ctx: &mut GradCtx<'_>, x: crate::TensorId, shape: &[usize]) -> Result<crate::TensorId> {
    if shape.len() == 2 {
        return Ok(x);
    }
    let cols = shape[shape.len() - 1];
    let rows: usize = shape[..shape.len() - 1].iter().product();
    ctx.apply1(
        Reshape {
            shape: vec![rows, cols],
        },
        &[x],
    )
}

/// Threads for one GEMM: small products run single-threaded (rayon overhead dominates).
#[cfg(feature = "cpu")]
pub(crate) fn par_for(m: usize, n: usize, k: usize, threads: usize) -> gemm::Parallelism {
    if threads <= 1 || m * n * k < 64 * 64 * 64 {
        gemm::Parallelism::None
    } else {
        gemm::Parallelism::Rayon(threads)
    }
}

/// `y = t · w + bias` for `m` rows: `t [m, k]`, `w [k, n]`, `y [m, n]`. The row step of the
/// fused ops that make a linear layer's input a tile at a time.
#[cfg(feature = "cpu")]
pub(crate) fn linear_rows(
    t: &[f32],
    w: &[f32],
    bias: &[f32],
    y: &mut [f32],
    (m, k, n): (usize, usize, usize),
) {
    assert!(t.len() >= m * k && w.len() >= k * n && y.len() >= m * n && bias.len() >= n);
    let par = par_for(m, n, k, rayon::current_num_threads());
    let fused = Fused {
        prologue: Prologue::None,
        bias: Some(bias),
    };
    // SAFETY: the lengths were checked just above.
    if unsafe { gemm_fused((false, false), (m, n, k), t, w, y, par, fused) } {
        return;
    }
    for row in y[..m * n].chunks_exact_mut(n) {
        row.copy_from_slice(bias);
    }
    // SAFETY: the lengths were checked just above.
    unsafe { gemm_strided(false, false, m, n, k, t, w, y, true, par) };
}

/// Which of our register tiles (`gemm_blocked`) a product runs on.
#[cfg(feature = "cpu")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OwnTile {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

/// Our tile for a product, if `gemm_raw` runs one: on a CPU with AVX-512F or AVX2 + FMA, for
/// row-major outputs at least 16 columns wide, and products big enough that packing both
/// operands pays. (Attention's blocks, at most 64 × 256 × 64, run an unpacked
/// `small_gemm` instead: through the packed one they measured 15 % slower.)
#[cfg(feature = "cpu")]
fn own_kernel((m, n, k): (usize, usize, usize), c_cs: isize) -> Option<OwnTile> {
    #[cfg(target_arch = "x86_64")]
    {
        use super::gemm_blocked::Tile;
        if c_cs != 1 || n < 16 || m * n * k < 1 << 22 {
            None
        } else if super::gemm_avx512::Avx512::available() {
            Some(OwnTile::Avx512)
        } else if super::gemm_avx2::Avx2::available() {
            Some(OwnTile::Avx2)
        } else {
            None
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ((m, n, k), c_cs);
        None
    }
}

/// `g = dy · wᵀ` for `m` rows: `dy [m, n]`, `w [k, n]`, `g [m, k]`. The row step of the fused
/// backwards that turn a linear layer's output gradient into its input's a tile at a time.
#[cfg(feature = "cpu")]
pub(crate) fn input_grad_rows(
    dy: &[f32],
    w: &[f32],
    g: &mut [f32],
    (m, k, n): (usize, usize, usize),
) {
    assert!(dy.len() >= m * n && w.len() >= k * n && g.len() >= m * k);
    let par = par_for(m, k, n, rayon::current_num_threads());
    // SAFETY: the lengths were checked just above.
    unsafe { gemm_strided(false, true, m, k, n, dy, w, g, false, par) };
}

/// `c (+)= op(a) · op(b)` over row-major storage; `accumulate` keeps what `c` holds.
///
/// # Safety
/// `a`, `b` and `c` must hold at least `m·k`, `k·n` and `m·n` elements.
#[cfg(feature = "cpu")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_strided(
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    accumulate: bool,
    par: gemm::Parallelism,
) {
    debug_assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    let ((a_rs, a_cs), (b_rs, b_cs)) = strides((ta, tb), (m, n, k));
    gemm_raw(
        (m, n, k),
        (c.as_mut_ptr(), n as isize, 1),
        (a.as_ptr(), a_rs, a_cs),
        (b.as_ptr(), b_rs, b_cs),
        1.0,
        accumulate,
        par,
    );
}

/// A transform of `a`'s elements made as they are packed, so that the elementwise op feeding a
/// GEMM never writes its output to memory: each element is transformed once per product (every
/// blocking packs each element of `a` once), by the thread that packs it.
#[cfg(feature = "cpu")]
#[derive(Debug, Clone, Copy)]
pub(crate) enum Prologue<'a> {
    None,
    /// LayerNorm from saved statistics, `(v - mean[t]) · rstd[t] · w[f] + b[f]` in the order
    /// the LayerNorm kernels round it, so the values are bitwise theirs. Element `(i, p)` of `a`
    /// is token `i`, feature `p` when `tokens_down`, else token `p`, feature `i` (`a` is the
    /// transposed activation of a weight gradient).
    LayerNorm {
        mean: &'a [f32],
        rstd: &'a [f32],
        w: &'a [f32],
        b: &'a [f32],
        tokens_down: bool,
    },
    /// GELU of every element, the scalar function vectorised, so bitwise its values.
    Gelu(super::gelu::GeluApprox),
}

/// What a product fuses: a [`Prologue`] on `a`, and a bias (one per column of `c`) added where
/// the first block of the inner dimension is stored, instead of `c` being filled with it first.
#[cfg(feature = "cpu")]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fused<'a> {
    pub prologue: Prologue<'a>,
    pub bias: Option<&'a [f32]>,
}

#[cfg(feature = "cpu")]
impl Fused<'_> {
    pub(crate) const NONE: Fused<'static> = Fused {
        prologue: Prologue::None,
        bias: None,
    };

    /// The bias from column `j` on, or null.
    pub(crate) fn bias_at(&self, j: usize) -> *const f32 {
        self.bias.map_or(std::ptr::null(), |b| b[j..].as_ptr())
    }
}

/// Row and column strides of `op(a)` and `op(b)` stored row-major: element (i, j) of op(x)
/// sits at i·rs + j·cs.
#[cfg(feature = "cpu")]
fn strides(
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
) -> ((isize, isize), (isize, isize)) {
    let a = if ta { (1, m as isize) } else { (k as isize, 1) };
    let b = if tb { (1, k as isize) } else { (n as isize, 1) };
    (a, b)
}

/// Runs a product through our kernel on `tile`, its threads dealt the work by demand where
/// `par` asks for them. Returns `false`, doing nothing, where the kernel's packing space is in
/// use.
///
/// # Safety
/// As [`gemm_blocked::sgemm`](super::gemm_blocked::sgemm), on a CPU [`own_kernel`] accepted.
#[cfg(all(feature = "cpu", target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn own_gemm(
    tile: OwnTile,
    (m, n, k): (usize, usize, usize),
    c: (*mut f32, isize),
    a: (*const f32, isize, isize),
    b: (*const f32, isize, isize),
    scale: f32,
    accumulate: bool,
    par: gemm::Parallelism,
    fused: Fused<'_>,
) -> bool {
    use super::gemm_blocked::{sgemm, sgemm_threaded};
    use super::{gemm_avx2::Avx2, gemm_avx512::Avx512};
    let threaded = matches!(par, gemm::Parallelism::Rayon(_)) && m.max(n) >= 32;
    let run = match (tile, threaded) {
        (OwnTile::Avx512, false) => sgemm::<Avx512>,
        (OwnTile::Avx512, true) => sgemm_threaded::<Avx512>,
        (OwnTile::Avx2, false) => sgemm::<Avx2>,
        (OwnTile::Avx2, true) => sgemm_threaded::<Avx2>,
    };
    // SAFETY: as the caller vouched.
    unsafe { run((m, n, k), c, a, b, scale, accumulate, fused) }
}

/// `c = f(op(a)) · op(b) (+ bias)` through our kernel, with `f` (made as `a` is packed)
/// and the bias (added as `c` is first stored) as `fused` says: the op feeding the product
/// never writes its output, and `c` is never filled with the bias first. Returns `false`, doing
/// nothing, where our kernel does not run this product (another CPU, a small product, its
/// packing space in use); the caller then materialises `f(op(a))` and runs [`gemm_strided`].
///
/// # Safety
/// As [`gemm_strided`]; a prologue's statistics must cover every token and its weights every
/// feature of `op(a)`, and a bias must hold `n` values.
#[cfg(feature = "cpu")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_fused(
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    par: gemm::Parallelism,
    fused: Fused<'_>,
) -> bool {
    debug_assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    debug_assert!(fused.bias.is_none_or(|bias| bias.len() >= n));
    #[cfg(target_arch = "x86_64")]
    if let Some(tile) = own_kernel((m, n, k), 1) {
        let ((a_rs, a_cs), (b_rs, b_cs)) = strides((ta, tb), (m, n, k));
        // SAFETY: `own_kernel` checked the CPU; the caller vouches for the operands.
        return unsafe {
            own_gemm(
                tile,
                (m, n, k),
                (c.as_mut_ptr(), n as isize),
                (a.as_ptr(), a_rs, a_cs),
                (b.as_ptr(), b_rs, b_cs),
                1.0,
                false,
                par,
                fused,
            )
        };
    }
    let _ = (ta, tb, m, n, k, a, b, c, par, fused);
    false
}

/// `c (+)= scale · a · b` for strided matrices given as (pointer, row stride, column stride).
///
/// # Safety
/// Every pointer must be valid for the elements its strides reach.
#[cfg(feature = "cpu")]
pub(crate) unsafe fn gemm_raw(
    (m, n, k): (usize, usize, usize),
    (c, c_rs, c_cs): (*mut f32, isize, isize),
    (a, a_rs, a_cs): (*const f32, isize, isize),
    (b, b_rs, b_cs): (*const f32, isize, isize),
    scale: f32,
    accumulate: bool,
    par: gemm::Parallelism,
) {
    let ours = own_kernel((m, n, k), c_cs);
    // SAFETY: as the caller vouched.
    unsafe {
        gemm_with(
            (m, n, k),
            (c, c_rs, c_cs),
            (a, a_rs, a_cs),
            (b, b_rs, b_cs),
            scale,
            accumulate,
            par,
            ours,
        )
    }
}

/// [`gemm_raw`] with the kernel chosen once for the whole product, so that every slab runs the
/// kernel its split was chosen for.
///
/// # Safety
/// As [`gemm_raw`]; `ours` only what [`own_kernel`] chose.
#[cfg(feature = "cpu")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_with(
    (m, n, k): (usize, usize, usize),
    (c, c_rs, c_cs): (*mut f32, isize, isize),
    (a, a_rs, a_cs): (*const f32, isize, isize),
    (b, b_rs, b_cs): (*const f32, isize, isize),
    scale: f32,
    accumulate: bool,
    par: gemm::Parallelism,
    ours: Option<OwnTile>,
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(tile) = ours {
        // Where the dealt kernel cannot run (its packing space in use), the slabs below each
        // run `sgemm`.
        // SAFETY: `own_kernel` checked the CPU and the unit column stride of `c` (a slab keeps
        // both); the caller vouches for the pointers.
        let done = unsafe {
            own_gemm(
                tile,
                (m, n, k),
                (c, c_rs),
                (a, a_rs, a_cs),
                (b, b_rs, b_cs),
                scale,
                accumulate,
                par,
                Fused::NONE,
            )
        };
        if done {
            return;
        }
    }
    if let gemm::Parallelism::Rayon(threads) = par {
        // Each worker runs its own single-threaded GEMM on a slab of the output: measured here
        // (2 threads, 4096×384×1536 and its transposes) 10–20 % faster than the gemm crate's
        // own threading, and the char-small step 8 % faster. Each slab packs all of the
        // operand it shares, so our kernel splits the longer side; the gemm crate measured
        // faster on slabs of columns, except when A is read transposed (a weight gradient).
        let by_rows = if ours.is_some() { m >= n } else { a_cs != 1 };
        let (len, align) = if by_rows { (m, 8) } else { (n, 16) };
        let parts = threads.min(len / (2 * align));
        if parts >= 2 {
            let each = len.div_ceil(parts).next_multiple_of(align);
            use super::par::SendPtr;
            let (c, a, b) = (SendPtr(c), SendPtr(a as *mut f32), SendPtr(b as *mut f32));
            use rayon::prelude::*;
            (0..len.div_ceil(each)).into_par_iter().for_each(|p| {
                let (start, end) = (p * each, ((p + 1) * each).min(len));
                let s = start as isize;
                // A slab of rows starts `s` rows into `c` and `a`; one of columns `s` columns
                // into `c` and `b`.
                let (dims, c_at, a_at, b_at) = if by_rows {
                    ((end - start, n, k), s * c_rs, s * a_rs, 0)
                } else {
                    ((m, end - start, k), s * c_cs, 0, s * b_cs)
                };
                // SAFETY: each part writes its own rows or columns of `c` and reads inside
                // `a` and `b` as the whole product would.
                unsafe {
                    gemm_with(
                        dims,
                        (c.get().offset(c_at), c_rs, c_cs),
                        (a.get().offset(a_at), a_rs, a_cs),
                        (b.get().offset(b_at), b_rs, b_cs),
                        scale,
                        accumulate,
                        gemm::Parallelism::None,
                        ours,
                    )
                }
            });
            return;
        }
    }
    // gemm computes dst = alpha·dst + beta·lhs·rhs, strides given column-first.
    gemm::gemm(
        m,
        n,
        k,
        c,
        c_cs,
        c_rs,
        accumulate,
        a,
        a_cs,
        a_rs,
        b,
        b_cs,
        b_rs,
        if accumulate { 1.0 } else { 0.0 },
        scale,
        false,
        false,
        false,
        par,
    );
}
