//! The GEMM entry points every kernel calls: `c (+)= f(op(a)) · op(b) (+ bias)` on our blocked
//! kernel ([`blocked`], with the AVX-512 and AVX2 register tiles in [`avx512`] and [`avx2`],
//! and for products reading a bf16 operand the AVX512-BF16 one in [`avx512bf16`]) where the CPU
//! and the product suit it, else on the gemm crate. [`Fused`] says what a product
//! takes in as it packs (a LayerNorm or GELU [`Prologue`], a bias; [`fused`]).

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512bf16;
#[cfg(target_arch = "x86_64")]
mod bf16_model;
#[cfg(target_arch = "x86_64")]
pub(crate) mod blocked;
mod fused;
mod half;
#[cfg(all(test, target_arch = "x86_64", target_os = "linux"))]
mod head_tests;
mod quantized;

pub(crate) use fused::{Fused, Prologue};
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) use half::round_to_bf16;
pub(crate) use half::{gemm_fused_half, gemm_half, widen, Operand};
pub(crate) use quantized::{gemm_quantized, QuantB};

/// The arithmetic a product computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arith {
    /// f32, a bf16 operand widened exactly: every product of an f32 run.
    F32,
    /// A bf16 run's: both operands rounded to bf16 as they are packed and the exact products
    /// summed in f32, where a bf16 tile runs the product ([`bf16_tile`]), whether an operand
    /// is stored in bf16 or is an f32 weight or normalised activation. Autocast casts both
    /// operands of every linear layer so; elsewhere, as [`Arith::F32`].
    Bf16,
}

/// Threads for one GEMM: small products run single-threaded (rayon overhead dominates).
pub(crate) fn par_for(m: usize, n: usize, k: usize, threads: usize) -> ::gemm::Parallelism {
    if threads <= 1 || m * n * k < 64 * 64 * 64 {
        ::gemm::Parallelism::None
    } else {
        ::gemm::Parallelism::Rayon(threads)
    }
}

/// `y = t · w + bias` for `m` rows: `t [m, k]`, `w [k, n]`, `y [m, n]`. The row step of the
/// fused ops that make a linear layer's input a tile at a time.
pub(crate) fn linear_rows(
    t: &[f32],
    w: &[f32],
    bias: &[f32],
    y: &mut [f32],
    (m, k, n): (usize, usize, usize),
    arith: Arith,
) {
    assert!(t.len() >= m * k && w.len() >= k * n && y.len() >= m * n && bias.len() >= n);
    let par = par_for(m, n, k, rayon::current_num_threads());
    let fused = Fused {
        bias: Some(bias),
        arith,
        ..Fused::NONE
    };
    // SAFETY: the lengths were checked just above.
    if unsafe { gemm_fused(Layout::new((false, false), (m, n, k)), t, w, y, par, fused) } {
        return;
    }
    for row in y[..m * n].chunks_exact_mut(n) {
        row.copy_from_slice(bias);
    }
    // SAFETY: the lengths were checked just above.
    unsafe {
        gemm_strided(
            Layout::new((false, false), (m, n, k)),
            t,
            w,
            y,
            true,
            par,
            arith,
        )
    };
}

/// Which of our register tiles ([`blocked`]) a product runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OwnTile {
    /// AMX's tiles (`TDPBF16PS`), for products in bf16 arithmetic.
    #[cfg(target_arch = "x86_64")]
    Amx,
    /// AMX's tile on the modelled tile registers, for testing it on CPUs without AMX.
    #[cfg(all(test, target_arch = "x86_64"))]
    AmxModel,
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16,
    /// AVX-512F's tile with its panels rounded to bf16 (`SNUG_BF16_MATH=model`).
    #[cfg(target_arch = "x86_64")]
    Avx512Model,
    /// AVX2's tile with its panels rounded to bf16 (`SNUG_BF16_MATH=model`).
    #[cfg(target_arch = "x86_64")]
    Avx2Model,
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

/// Our tile for a product on a CPU with `cpu`'s features, if one runs it: for row-major
/// outputs at least 16 columns wide, and products big enough that packing both operands pays
/// (attention's blocks, at most 64 × 256 × 64, run an unpacked `small_gemm` instead: through
/// the packed one they measured 15 % slower). AVX-512F's tile, else AVX2 + FMA's. A product
/// in bf16 arithmetic (`bf16_operand`) computes as `math` says: in bf16 arithmetic where the
/// CPU has AVX512-BF16 (`Native`), with its panels rounded to bf16 on the f32 tile (`Model`),
/// on a row-major output of any size; or widened (`Widen`, and `Native` elsewhere), as f32.
fn choose_tile(
    cpu: crate::isa::CpuFeatures,
    math: crate::isa::Bf16Math,
    (m, n, k): (usize, usize, usize),
    c_cs: isize,
    bf16_operand: bool,
) -> Option<OwnTile> {
    #[cfg(target_arch = "x86_64")]
    {
        if c_cs != 1 {
            None
        } else if let Some(tile) = bf16_operand.then(|| bf16_tile(cpu, math)).flatten() {
            // At any size: which arithmetic a bf16 run's product computes in must not depend
            // on its size or how an op blocks it.
            Some(tile)
        } else if n < 16 || m * n * k < 1 << 22 {
            None
        } else if cpu.avx512f {
            Some(OwnTile::Avx512)
        } else if cpu.avx2 && cpu.fma {
            Some(OwnTile::Avx2)
        } else {
            None
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (cpu, math, (m, n, k), c_cs, bf16_operand);
        None
    }
}

/// The tile that computes a product in bf16 arithmetic as `math` says, if any: AMX's or else
/// AVX512-BF16's (`Native`, on a CPU with them) or an f32 tile with its panels rounded
/// (`Model`). `None`: bf16 operands are widened and the product is f32's.
fn bf16_tile(cpu: crate::isa::CpuFeatures, math: crate::isa::Bf16Math) -> Option<OwnTile> {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::isa::Bf16Math;
        match math {
            Bf16Math::Native if cpu.amx && cpu.bf16_arithmetic() => Some(OwnTile::Amx),
            Bf16Math::Native if cpu.vdpbf16ps_by_default() => Some(OwnTile::Avx512Bf16),
            Bf16Math::Vdpbf16ps if cpu.bf16_arithmetic() => Some(OwnTile::Avx512Bf16),
            Bf16Math::Model if cpu.avx512f => Some(OwnTile::Avx512Model),
            Bf16Math::Model if cpu.avx2 && cpu.fma => Some(OwnTile::Avx2Model),
            _ => None,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (cpu, math);
        None
    }
}

/// [`bf16_tile`] for attention's head products: the same tile. On an AMX CPU the heads once
/// stayed on `VDPBF16PS` (for its paired layout, [`avx512bf16::paired`]), but on Emerald
/// Rapids that made bf16 attention slower than f32's; AMX's tiles made it faster (see
/// docs/benchmarks.md, the twenty-fifth session).
fn head_tile(cpu: crate::isa::CpuFeatures, math: crate::isa::Bf16Math) -> Option<HeadBf16> {
    bf16_tile(cpu, math).map(HeadBf16)
}

/// Where attention's head products on bf16 inputs run in bf16 arithmetic: the tile for them
/// on this CPU under the [`Bf16Math`](crate::isa::Bf16Math) in force, at any size (the
/// numbers must not depend on the sequence length). `None`: they run in f32 on the widened
/// heads, as everywhere without bf16 instructions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HeadBf16(OwnTile);

impl HeadBf16 {
    pub(crate) fn host() -> Option<HeadBf16> {
        let math = crate::isa::Bf16Math::current();
        head_tile(crate::isa::CpuFeatures::host(), math)
    }

    /// Whether this is AVX512-BF16's own tile (`VDPBF16PS`), not a model of it.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn native(self) -> bool {
        self.0 == OwnTile::Avx512Bf16
    }

    /// The tile under `math` on a CPU with `cpu`'s features, for a test to run where the CPU
    /// (or an emulated one) has them.
    #[cfg(all(test, target_arch = "x86_64"))]
    pub(crate) fn on(cpu: crate::isa::CpuFeatures, math: crate::isa::Bf16Math) -> Option<HeadBf16> {
        head_tile(cpu, math)
    }

    /// AMX's tile, modelled or (where [`amx::usable`] holds) the instructions themselves.
    #[cfg(all(test, target_arch = "x86_64"))]
    pub(crate) fn amx(hardware: bool) -> HeadBf16 {
        HeadBf16(if hardware {
            OwnTile::Amx
        } else {
            OwnTile::AmxModel
        })
    }

    /// Grows this thread's packing space for the tile now (see `blocked::reserve_pack`).
    #[cfg(all(test, target_arch = "x86_64"))]
    pub(crate) fn reserve(self) {
        use blocked::reserve_pack;
        match self.0 {
            OwnTile::Amx => reserve_pack::<amx::Amx<amx::Hardware>>(),
            OwnTile::AmxModel => reserve_pack::<amx::Amx<amx::Modelled>>(),
            OwnTile::Avx512Bf16 => reserve_pack::<avx512bf16::Avx512Bf16>(),
            OwnTile::Avx512Model => reserve_pack::<bf16_model::Rounded<avx512::Avx512>>(),
            OwnTile::Avx2Model => reserve_pack::<bf16_model::Rounded<avx2::Avx2>>(),
            OwnTile::Avx512 => reserve_pack::<avx512::Avx512>(),
            OwnTile::Avx2 => reserve_pack::<avx2::Avx2>(),
        }
    }

    /// `c (+)= scale · a · b` on the tile, one thread; `c`'s columns contiguous. Returns
    /// `false`, doing nothing, where the thread's packing space is in use.
    ///
    /// # Safety
    /// The CPU must have the tile's instructions (a tile from [`HeadBf16::host`] is this
    /// CPU's); every pointer must be valid for the elements its strides reach; `c` must not
    /// overlap `a` or `b`.
    #[cfg(target_arch = "x86_64")]
    pub(crate) unsafe fn gemm(
        self,
        dims: (usize, usize, usize),
        c: (*mut f32, isize),
        a: (*const f32, isize, isize),
        b: (*const f32, isize, isize),
        scale: f32,
        accumulate: bool,
    ) -> bool {
        let product = Product {
            dims,
            c: (c.0, c.1, 1),
            a,
            b,
            scale,
            accumulate,
        };
        // SAFETY: as the caller vouched.
        unsafe { own_gemm(self.0, product, ::gemm::Parallelism::None, Fused::NONE) }
    }
}

/// Our tile for a product of f32 operands in `arith` on this CPU, if `gemm_raw` runs one
/// ([`choose_tile`]).
fn own_kernel(dims: (usize, usize, usize), c_cs: isize, arith: Arith) -> Option<OwnTile> {
    let math = crate::isa::Bf16Math::current();
    let cpu = crate::isa::CpuFeatures::host();
    choose_tile(cpu, math, dims, c_cs, arith == Arith::Bf16)
}

/// What a product of one causal row block may leave out, where row `i` of the block is row
/// `r0 + i` of the sequence. Leaving out only terms that are zero (or outputs never read),
/// a product gives bitwise what the whole one does on finite inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
// Only our x86-64 head kernels take a causal extent; elsewhere the heads run whole products.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) enum Causal {
    /// Nothing.
    Whole,
    /// `c`'s columns past the diagonal (`Columns(r0)`: scores, whose masked columns are never
    /// read).
    Columns(usize),
    /// The depth past the diagonal (`Depth(r0)`: `a` is the block's probabilities or their
    /// gradients, zero past it).
    Depth(usize),
    /// The depth before the diagonal (`DepthFrom(r0)`: `a` is those transposed, so row `j`
    /// of `c`, a key's, takes terms only from the block's rows at or after `j`).
    DepthFrom(usize),
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl Causal {
    /// For the product's rows `i0..i0 + rows`: the columns it needs (of `n`) and the depth
    /// range (of `k`) where its `a` may be non-zero.
    pub(crate) fn extent(
        self,
        (i0, rows): (usize, usize),
        (n, k): (usize, usize),
    ) -> (usize, std::ops::Range<usize>) {
        let last = |r0: usize| r0 + i0 + rows - 1;
        match self {
            Causal::Whole => (n, 0..k),
            Causal::Columns(r0) => (n.min(last(r0) + 1), 0..k),
            Causal::Depth(r0) => (n, 0..k.min(last(r0) + 1)),
            Causal::DepthFrom(r0) => (n, i0.saturating_sub(r0).min(k)..k),
        }
    }
}

/// Attention's unpacked per-head product (`small_gemm` in `avx512` and `avx2`):
/// `(m, n, k)`, `(c, c_rs)`, `(a, a_rs, a_cs)`, `(b, b_rs, b_strip)`, `scale`, `accumulate`.
#[cfg(target_arch = "x86_64")]
pub(crate) type SmallGemm = unsafe fn(
    (usize, usize, usize),
    (*mut f32, usize),
    (*const f32, usize, usize),
    (*const f32, usize, usize),
    f32,
    bool,
);

/// Rows of both `small_gemm` register tiles: the rows a causal product is trimmed by.
#[cfg(target_arch = "x86_64")]
pub(crate) const HEAD_TILE_ROWS: usize = 6;

/// `small_gemm`'s product leaving out what `causal` says, a register tile's rows at a time;
/// arguments as [`SmallGemm`]'s.
///
/// # Safety
/// As the kernel's, for the whole product.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn causal_small_gemm(
    kernel: SmallGemm,
    (m, n, k): (usize, usize, usize),
    (c, c_rs): (*mut f32, usize),
    (a, a_rs, a_cs): (*const f32, usize, usize),
    (b, b_rs, b_strip): (*const f32, usize, usize),
    (scale, accumulate): (f32, bool),
    causal: Causal,
) {
    // A whole product is one call.
    let group = if causal == Causal::Whole {
        m.max(1)
    } else {
        HEAD_TILE_ROWS
    };
    for i0 in (0..m).step_by(group) {
        let rows = group.min(m - i0);
        let (cols, depth) = causal.extent((i0, rows), (n, k));
        // SAFETY: rows `i0..i0 + rows` of `c` and `a`, the depth range of `a` and `b`: inside
        // the product the caller vouched for.
        unsafe {
            kernel(
                (rows, cols, depth.len()),
                (c.add(i0 * c_rs), c_rs),
                (a.add(i0 * a_rs + depth.start * a_cs), a_rs, a_cs),
                (b.add(depth.start * b_rs), b_rs, b_strip),
                scale,
                accumulate,
            )
        };
    }
}

/// A register transpose (`transpose` in `avx512` and `avx2`): `(x, x_rs)`,
/// `(rows, cols)`, `(out, out_rs)`.
#[cfg(target_arch = "x86_64")]
pub(crate) type Transpose = unsafe fn((*const f32, usize), (usize, usize), (*mut f32, usize));

/// Attention's head kernels for this CPU: AVX-512F's, else AVX2 + FMA's, else none (the
/// caller then uses the gemm crate and scalar loops).
#[cfg(target_arch = "x86_64")]
pub(crate) fn head_kernels() -> Option<(SmallGemm, Transpose)> {
    use blocked::Tile;
    if avx512::Avx512::available() {
        Some((avx512::small_gemm, avx512::transpose))
    } else if avx2::Avx2::available() {
        Some((avx2::small_gemm, avx2::transpose))
    } else {
        None
    }
}

/// `g = dy · wᵀ` for `m` rows: `dy [m, n]`, `w [k, n]`, `g [m, k]`. The row step of the fused
/// backwards that turn a linear layer's output gradient into its input's a tile at a time.
pub(crate) fn input_grad_rows(
    dy: &[f32],
    w: &[f32],
    g: &mut [f32],
    (m, k, n): (usize, usize, usize),
    arith: Arith,
) {
    assert!(dy.len() >= m * n && w.len() >= k * n && g.len() >= m * k);
    let par = par_for(m, k, n, rayon::current_num_threads());
    let layout = Layout::new((false, true), (m, k, n));
    // SAFETY: the lengths were checked just above.
    unsafe { gemm_strided(layout, dy, w, g, false, par, arith) };
}

/// The shape of a product of row-major matrices, `op(a) [m, k] · op(b) [k, n]`, where `op`
/// transposes the stored matrix when its flag is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub ta: bool,
    pub tb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl Layout {
    pub(crate) fn new((ta, tb): (bool, bool), (m, n, k): (usize, usize, usize)) -> Layout {
        Layout { ta, tb, m, n, k }
    }

    /// Row and column strides of `op(a)` and `op(b)` stored row-major: element (i, j) of op(x)
    /// sits at i·rs + j·cs.
    fn strides(self) -> ((isize, isize), (isize, isize)) {
        let Layout { ta, tb, m, n, k } = self;
        let a = if ta { (1, m as isize) } else { (k as isize, 1) };
        let b = if tb { (1, k as isize) } else { (n as isize, 1) };
        (a, b)
    }
}

/// `c (+)= op(a) · op(b)` over row-major storage in `arith`; `accumulate` keeps what `c`
/// holds.
///
/// # Safety
/// `a`, `b` and `c` must hold at least `m·k`, `k·n` and `m·n` elements.
pub(crate) unsafe fn gemm_strided(
    layout: Layout,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    accumulate: bool,
    par: ::gemm::Parallelism,
    arith: Arith,
) {
    let Layout { m, n, k, .. } = layout;
    debug_assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    let ((a_rs, a_cs), (b_rs, b_cs)) = layout.strides();
    gemm_raw(
        (m, n, k),
        (c.as_mut_ptr(), n as isize, 1),
        (a.as_ptr(), a_rs, a_cs),
        (b.as_ptr(), b_rs, b_cs),
        1.0,
        accumulate,
        par,
        arith,
    );
}

/// One product `c (+)= scale · a · b` of strided matrices, each given as (pointer, row stride,
/// column stride): element (i, j) sits at i·rs + j·cs.
#[derive(Debug, Clone, Copy)]
struct Product {
    /// `(m, n, k)`: `a` is `m × k`, `b` is `k × n`.
    dims: (usize, usize, usize),
    c: (*mut f32, isize, isize),
    a: (*const f32, isize, isize),
    b: (*const f32, isize, isize),
    scale: f32,
    /// Add to what `c` holds rather than overwrite it.
    accumulate: bool,
}

/// Runs a product through our kernel on `tile`, its threads dealt the work by demand where
/// `par` asks for them. Returns `false`, doing nothing, where the kernel's packing space is in
/// use.
///
/// # Safety
/// As [`blocked::sgemm`] (`c`'s column stride is 1), on a CPU [`own_kernel`] accepted.
#[cfg(target_arch = "x86_64")]
unsafe fn own_gemm(
    tile: OwnTile,
    product: Product,
    par: ::gemm::Parallelism,
    fused: Fused<'_>,
) -> bool {
    let Product {
        dims: (m, n, k),
        c: (c, c_rs, _),
        a,
        b,
        scale,
        accumulate,
    } = product;
    use amx::Amx;
    use avx2::Avx2;
    use avx512::Avx512;
    use avx512bf16::Avx512Bf16;
    use bf16_model::Rounded;
    use blocked::{sgemm, sgemm_threaded};
    let threaded = matches!(par, ::gemm::Parallelism::Rayon(_)) && m.max(n) >= 32;
    let run = match (tile, threaded) {
        (OwnTile::Amx, false) => sgemm::<Amx<amx::Hardware>>,
        (OwnTile::Amx, true) => sgemm_threaded::<Amx<amx::Hardware>>,
        #[cfg(test)]
        (OwnTile::AmxModel, false) => sgemm::<Amx<amx::Modelled>>,
        #[cfg(test)]
        (OwnTile::AmxModel, true) => sgemm_threaded::<Amx<amx::Modelled>>,
        (OwnTile::Avx512Bf16, false) => sgemm::<Avx512Bf16>,
        (OwnTile::Avx512Bf16, true) => sgemm_threaded::<Avx512Bf16>,
        (OwnTile::Avx512Model, false) => sgemm::<Rounded<Avx512>>,
        (OwnTile::Avx512Model, true) => sgemm_threaded::<Rounded<Avx512>>,
        (OwnTile::Avx2Model, false) => sgemm::<Rounded<Avx2>>,
        (OwnTile::Avx2Model, true) => sgemm_threaded::<Rounded<Avx2>>,
        (OwnTile::Avx512, false) => sgemm::<Avx512>,
        (OwnTile::Avx512, true) => sgemm_threaded::<Avx512>,
        (OwnTile::Avx2, false) => sgemm::<Avx2>,
        (OwnTile::Avx2, true) => sgemm_threaded::<Avx2>,
    };
    // SAFETY: as the caller vouched.
    unsafe { run((m, n, k), (c, c_rs), a, b, scale, accumulate, fused) }
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
pub(crate) unsafe fn gemm_fused(
    layout: Layout,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    par: ::gemm::Parallelism,
    fused: Fused<'_>,
) -> bool {
    let Layout { m, n, k, .. } = layout;
    debug_assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    debug_assert!(fused.bias.is_none_or(|bias| bias.len() >= n));
    #[cfg(target_arch = "x86_64")]
    if let Some(tile) = own_kernel((m, n, k), 1, fused.arith) {
        let ((a_rs, a_cs), (b_rs, b_cs)) = layout.strides();
        let product = Product {
            dims: (m, n, k),
            c: (c.as_mut_ptr(), n as isize, 1),
            a: (a.as_ptr(), a_rs, a_cs),
            b: (b.as_ptr(), b_rs, b_cs),
            scale: 1.0,
            accumulate: false,
        };
        // SAFETY: `own_kernel` checked the CPU; the caller vouches for the operands.
        return unsafe { own_gemm(tile, product, par, fused) };
    }
    let _ = (a, b, c, par, fused);
    false
}

/// `c (+)= scale · a · b` in `arith` for strided matrices given as (pointer, row stride,
/// column stride).
///
/// # Safety
/// Every pointer must be valid for the elements its strides reach.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_raw(
    (m, n, k): (usize, usize, usize),
    (c, c_rs, c_cs): (*mut f32, isize, isize),
    (a, a_rs, a_cs): (*const f32, isize, isize),
    (b, b_rs, b_cs): (*const f32, isize, isize),
    scale: f32,
    accumulate: bool,
    par: ::gemm::Parallelism,
    arith: Arith,
) {
    let ours = own_kernel((m, n, k), c_cs, arith);
    let product = Product {
        dims: (m, n, k),
        c: (c, c_rs, c_cs),
        a: (a, a_rs, a_cs),
        b: (b, b_rs, b_cs),
        scale,
        accumulate,
    };
    // SAFETY: as the caller vouched.
    unsafe { gemm_with(product, par, ours) }
}

/// [`gemm_raw`] with the kernel chosen once for the whole product, so that every slab runs the
/// kernel its split was chosen for.
///
/// # Safety
/// As [`gemm_raw`]; `ours` only what [`own_kernel`] chose.
unsafe fn gemm_with(product: Product, par: ::gemm::Parallelism, ours: Option<OwnTile>) {
    let Product {
        dims: (m, n, k),
        c: (c, c_rs, c_cs),
        a: (a, a_rs, a_cs),
        b: (b, b_rs, b_cs),
        scale,
        accumulate,
    } = product;
    #[cfg(target_arch = "x86_64")]
    if let Some(tile) = ours {
        // Where the dealt kernel cannot run (its packing space in use), the slabs below each
        // run `sgemm`.
        // SAFETY: `own_kernel` checked the CPU and the unit column stride of `c` (a slab keeps
        // both); the caller vouches for the pointers.
        let done = unsafe { own_gemm(tile, product, par, Fused::NONE) };
        if done {
            return;
        }
    }
    if let ::gemm::Parallelism::Rayon(threads) = par {
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
            use crate::par::SendPtr;
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
                    let slab = Product {
                        dims,
                        c: (c.get().offset(c_at), c_rs, c_cs),
                        a: (a.get().offset(a_at), a_rs, a_cs),
                        b: (b.get().offset(b_at), b_rs, b_cs),
                        scale,
                        accumulate,
                    };
                    gemm_with(slab, ::gemm::Parallelism::None, ours)
                }
            });
            return;
        }
    }
    // gemm computes dst = alpha·dst + beta·lhs·rhs, strides given column-first.
    ::gemm::gemm(
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

/// What the GEMM tests of every module share.
#[cfg(test)]
pub(crate) mod test_support {
    /// Asserts `c[i·n + j] = base + scale · Σ_p a(i, p) · b(p, j)`, summed in f64, to within
    /// `tol`; the base is `start`'s element when accumulating, else zero.
    pub(crate) fn assert_product(
        (m, n, k): (usize, usize, usize),
        (a, b): (impl Fn(usize, usize) -> f32, impl Fn(usize, usize) -> f32),
        (scale, accumulate): (f32, bool),
        (start, c): (&[f32], &[f32]),
        tol: f64,
        label: &str,
    ) {
        for i in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k)
                    .map(|p| f64::from(a(i, p)) * f64::from(b(p, j)))
                    .sum();
                let base = if accumulate {
                    f64::from(start[i * n + j])
                } else {
                    0.0
                };
                let want = base + f64::from(scale) * dot;
                let got = f64::from(c[i * n + j]);
                assert!(
                    (got - want).abs() <= tol,
                    "{label} at ({i}, {j}): {got} vs {want}"
                );
            }
        }
    }

    /// A test's work, run in one call that allocates nothing and asks nothing of the OS, so it
    /// can run on an emulated core (where no kernel answers system calls) as well as natively.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    pub(crate) trait EmuJob {
        /// # Safety
        /// The CPU, real or emulated, must have the instructions the job's kernels use.
        unsafe fn run(&mut self);
    }

    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    unsafe extern "C" fn run_job<J: EmuJob>(job: *mut std::ffi::c_void) {
        // SAFETY: `run_on` passes its job, and runs it on a core with its instructions.
        unsafe { (*(job as *mut J)).run() };
    }

    /// Runs `job` on this CPU where `native` (it has the instructions), else on an emulated
    /// `model` core (`snug_testkit::emulate`). Returns `false` where the emulator is not
    /// installed, after a skip (a failure in CI): the test then returns.
    ///
    /// # Safety
    /// [`EmuJob::run`] must allocate nothing; where `native`, the CPU must have its
    /// instructions, and elsewhere the emulated `model` must.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    pub(crate) unsafe fn run_on<J: EmuJob>(
        native: bool,
        model: snug_testkit::emulate::Model,
        job: &mut J,
    ) -> bool {
        use snug_testkit::emulate::{call, EmuError};
        if native {
            // SAFETY: as the caller vouched.
            unsafe { job.run() };
            return true;
        }
        let arg = job as *mut J as *mut std::ffi::c_void;
        // SAFETY: as the caller vouched; `arg` is the job `run_job::<J>` expects.
        match unsafe { call(model, run_job::<J>, arg) } {
            Ok(()) => true,
            Err(EmuError::Unavailable(why)) => {
                snug_testkit::skip_or_fail(&why);
                false
            }
            Err(e) => panic!("{model:?} (emulated): {e}"),
        }
    }

    /// Deterministic values in [-0.5, 0.5) with no pattern a blocking bug could hide behind.
    pub(crate) fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use snug_graph::CpuGemm;

    use super::own_kernel;
    #[cfg(target_arch = "x86_64")]
    use super::OwnTile;

    /// The GEMM a large product runs on here, as the planner names it.
    fn dispatched() -> CpuGemm {
        match own_kernel((1024, 1024, 1024), 1, super::Arith::F32) {
            // The bf16 tiles keep their f32 tile's blocking, so the plan is the same.
            #[cfg(target_arch = "x86_64")]
            Some(
                OwnTile::Avx512
                | OwnTile::Avx512Bf16
                | OwnTile::Avx512Model
                | OwnTile::Amx
                | OwnTile::AmxModel,
            ) => CpuGemm::Avx512,
            #[cfg(target_arch = "x86_64")]
            Some(OwnTile::Avx2 | OwnTile::Avx2Model) => CpuGemm::Avx2,
            None => CpuGemm::Portable,
        }
    }

    /// The target `Target::host` plans for is the kernel the products run on: the planned
    /// scratch of a GEMM-tiled op is the one its kernel uses.
    #[test]
    fn host_gemm_is_the_dispatched_kernel() {
        assert_eq!(dispatched(), CpuGemm::host());
    }

    /// The planner sizes a quantized product's decode panel by whether our kernel runs it:
    /// its rule is the dispatch's.
    #[test]
    fn the_planners_rule_for_our_kernel_is_the_dispatch() {
        use snug_graph::ops::quantized_read::own_gemm_runs;
        for dims in [
            (1024, 1024, 1024),
            (64, 64, 1023),
            (64, 64, 1024),
            (300, 15, 4096),
        ] {
            for (m, n, k) in [dims, (dims.2, dims.0, dims.1), (dims.1, dims.2, dims.0)] {
                assert_eq!(
                    own_kernel((m, n, k), 1, super::Arith::F32).is_some(),
                    own_gemm_runs(CpuGemm::host(), (m, n, k)),
                    "{m}×{k}×{n}"
                );
            }
        }
    }

    /// Dispatch for each feature set and `SNUG_BF16_MATH`: bf16 arithmetic only for a product
    /// with a bf16 operand, natively on a CPU with AVX512-BF16 (and AVX-512F) or modelled on
    /// the f32 tile; AVX-512F's tile before AVX2 + FMA's; none for small or column-strided
    /// products, or without the instructions.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_tile_is_chosen_from_the_features_and_the_operands() {
        use super::choose_tile;
        use crate::isa::CpuFeatures;
        let none = CpuFeatures::default();
        let (avx2, avx512) = (CpuFeatures::AVX2, CpuFeatures::AVX512);
        let bf16 = CpuFeatures::AVX512_BF16;
        let intel = CpuFeatures::INTEL_BF16;
        let amx = CpuFeatures::AMX;
        let big = (512, 512, 512);
        use crate::isa::Bf16Math::{Model, Native, Vdpbf16ps, Widen};
        let cases = [
            (none, Native, false, None),
            (none, Native, true, None),
            (none, Model, true, None),
            (CpuFeatures { fma: false, ..avx2 }, Native, true, None),
            (avx2, Native, false, Some(OwnTile::Avx2)),
            (avx2, Native, true, Some(OwnTile::Avx2)),
            (avx2, Widen, true, Some(OwnTile::Avx2)),
            (avx2, Model, false, Some(OwnTile::Avx2)),
            (avx2, Model, true, Some(OwnTile::Avx2Model)),
            (avx512, Native, false, Some(OwnTile::Avx512)),
            (avx512, Native, true, Some(OwnTile::Avx512)),
            (avx512, Model, true, Some(OwnTile::Avx512Model)),
            (bf16, Native, false, Some(OwnTile::Avx512)),
            (bf16, Native, true, Some(OwnTile::Avx512Bf16)),
            (bf16, Widen, true, Some(OwnTile::Avx512)),
            (bf16, Model, true, Some(OwnTile::Avx512Model)),
            (bf16, Model, false, Some(OwnTile::Avx512)),
            // Intel's VDPBF16PS, half its FMAs' rate: widened unless asked for.
            (intel, Native, true, Some(OwnTile::Avx512)),
            (intel, Vdpbf16ps, true, Some(OwnTile::Avx512Bf16)),
            (intel, Model, true, Some(OwnTile::Avx512Model)),
            (amx, Native, true, Some(OwnTile::Amx)),
            (amx, Native, false, Some(OwnTile::Avx512)),
            (amx, Widen, true, Some(OwnTile::Avx512)),
            (amx, Vdpbf16ps, true, Some(OwnTile::Avx512Bf16)),
            (bf16, Vdpbf16ps, true, Some(OwnTile::Avx512Bf16)),
            (avx512, Vdpbf16ps, true, Some(OwnTile::Avx512)),
            (amx, Model, true, Some(OwnTile::Avx512Model)),
            // AMX's tiles without the AVX512-BF16 their packing uses: none of theirs.
            (
                CpuFeatures {
                    avx512bf16: false,
                    ..amx
                },
                Native,
                true,
                Some(OwnTile::Avx512),
            ),
        ];
        for (cpu, math, half, want) in cases {
            let got = choose_tile(cpu, math, big, 1, half);
            assert_eq!(got, want, "{cpu:?}, {math:?}, bf16 operand {half}");
        }
        // The bf16 tile alone (attention's head products ask for it at any size).
        let no_fma = CpuFeatures { fma: false, ..avx2 };
        let heads = [
            (none, Native, None),
            (none, Model, None),
            (no_fma, Model, None),
            (avx2, Native, None),
            (avx2, Widen, None),
            (avx2, Model, Some(OwnTile::Avx2Model)),
            (avx512, Native, None),
            (avx512, Model, Some(OwnTile::Avx512Model)),
            (bf16, Native, Some(OwnTile::Avx512Bf16)),
            (intel, Native, None),
            (intel, Vdpbf16ps, Some(OwnTile::Avx512Bf16)),
            (bf16, Widen, None),
            (bf16, Model, Some(OwnTile::Avx512Model)),
            (amx, Native, Some(OwnTile::Amx)),
            (amx, Widen, None),
        ];
        for (cpu, math, want) in heads {
            assert_eq!(super::bf16_tile(cpu, math), want, "{cpu:?}, {math:?}");
        }
        // Attention's heads run on the products' tile.
        let head = |cpu, math| super::head_tile(cpu, math).map(|h| h.0);
        assert_eq!(head(amx, Native), Some(OwnTile::Amx));
        assert_eq!(head(amx, Vdpbf16ps), Some(OwnTile::Avx512Bf16));
        assert_eq!(head(bf16, Native), Some(OwnTile::Avx512Bf16));
        assert_eq!(head(amx, Model), Some(OwnTile::Avx512Model));
        // Too small to pack, too narrow, or a strided output: the gemm crate, on every CPU;
        // except that bf16 arithmetic runs on its tile at any size, row-major.
        for (dims, c_cs) in [((8, 64, 64), 1), ((1024, 8, 1024), 1), (big, 2)] {
            for (cpu, math, half) in [
                (bf16, Native, false),
                (bf16, Widen, true),
                (avx2, Native, true),
            ] {
                let got = choose_tile(cpu, math, dims, c_cs, half);
                assert_eq!(got, None, "{dims:?} {c_cs} {cpu:?} {math:?}");
            }
            let bf16_arithmetic = [
                (bf16, Native, OwnTile::Avx512Bf16),
                (amx, Native, OwnTile::Amx),
                (avx2, Model, OwnTile::Avx2Model),
            ];
            for (cpu, math, tile) in bf16_arithmetic {
                let want = (c_cs == 1).then_some(tile);
                let got = choose_tile(cpu, math, dims, c_cs, true);
                assert_eq!(got, want, "{dims:?} {c_cs} {cpu:?} {math:?}");
            }
        }
    }

    /// The planner's depth blocks are the register tiles' own.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn depth_blocks_match_the_kernels() {
        use super::blocked::Tile;
        assert_eq!(CpuGemm::Avx512.depth_block(), super::avx512::Avx512::KC);
        assert_eq!(CpuGemm::Avx2.depth_block(), super::avx2::Avx2::KC);
    }
}
