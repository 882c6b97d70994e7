//! Attention's head kernels (`small_gemm` and `transpose`, each tile's), checked the same way
//! for every instruction set: where the CPU has it natively, else on an emulated Tiger Lake
//! core (`snug_testkit::emulate`; it has AVX2 and AVX-512F). Each test's cases are made first,
//! run in one call that allocates nothing, then checked.

use snug_testkit::emulate::Model;

use super::avx2::{self, Avx2};
use super::avx512::{self, Avx512};
use super::blocked::Tile;
use super::test_support::{assert_product, run_on, values, EmuJob};
use super::{SmallGemm, Transpose};

/// One `small_gemm` call's operands and result.
struct SmallCase {
    dims: (usize, usize, usize),
    a: (Vec<f32>, usize, usize),
    /// In strips of 64 columns, each `k` rows of 64.
    b: Vec<f32>,
    scale_acc: (f32, bool),
    start: Vec<f32>,
    c: Vec<f32>,
}

struct SmallJob {
    kernel: SmallGemm,
    cases: Vec<SmallCase>,
}

impl EmuJob for SmallJob {
    unsafe fn run(&mut self) {
        for case in self.cases.iter_mut() {
            let (m, n, k) = case.dims;
            let (a, a_rs, a_cs) = &case.a;
            // SAFETY: the (emulated) CPU has the kernel's instructions; the strides stay inside
            // the vectors.
            unsafe {
                (self.kernel)(
                    (m, n, k),
                    (case.c.as_mut_ptr(), n),
                    (a.as_ptr(), *a_rs, *a_cs),
                    (case.b.as_ptr(), 64, 64 * k),
                    case.scale_acc.0,
                    case.scale_acc.1,
                )
            };
        }
    }
}

/// Attention's unpacked products, against a triple loop in f64: `a` plain and transposed, `b`
/// in strips of 64 (the last one partial, and a partial vector inside it), row counts that
/// leave every remainder of the 6-row tiles, scaled and accumulated.
#[test]
fn small_gemm_matches_a_triple_loop_at_every_edge() {
    let kernels: [(&str, SmallGemm, bool); 2] = [
        ("avx512", avx512::small_gemm, Avx512::available()),
        ("avx2", avx2::small_gemm, Avx2::available()),
    ];
    for (name, kernel, native) in kernels {
        let mut cases = Vec::new();
        for (m, n, k) in [
            (64usize, 256usize, 64usize),
            (13, 71, 9),
            (7, 76, 5),
            (5, 150, 64),
            (1, 3, 2),
            (12, 64, 17),
            (11, 130, 33),
        ] {
            for ta in [false, true] {
                for scale_acc in [(0.125f32, false), (1.0, true)] {
                    let (a_rs, a_cs) = if ta { (1, m) } else { (k, 1) };
                    let start = values(m * n, 3);
                    cases.push(SmallCase {
                        dims: (m, n, k),
                        a: (values(m * k, 1), a_rs, a_cs),
                        b: values(n.div_ceil(64) * 64 * k, 2),
                        scale_acc,
                        c: start.clone(),
                        start,
                    });
                }
            }
        }
        let mut job = SmallJob { kernel, cases };
        // SAFETY: the cases' operands are made; the kernel runs where its instructions are.
        if !unsafe { run_on(native, Model::TigerLake, &mut job) } {
            return;
        }
        for case in &job.cases {
            let (m, n, k) = case.dims;
            let (a, a_rs, a_cs) = &case.a;
            let b_at = |p: usize, j: usize| (j / 64) * 64 * k + p * 64 + j % 64;
            assert_product(
                (m, n, k),
                (|i, p| a[i * a_rs + p * a_cs], |p, j| case.b[b_at(p, j)]),
                case.scale_acc,
                (&case.start, &case.c),
                1e-5,
                &format!("{name} small_gemm {m}×{k}×{n} strides {a_rs},{a_cs}"),
            );
        }
    }
}

/// One `transpose` call's input and output.
struct TransposeCase {
    dims: (usize, usize),
    x: (Vec<f32>, usize),
    out: (Vec<f32>, usize),
}

struct TransposeJob {
    kernel: Transpose,
    cases: Vec<TransposeCase>,
}

impl EmuJob for TransposeJob {
    unsafe fn run(&mut self) {
        for case in self.cases.iter_mut() {
            let ((x, x_rs), (out, out_rs)) = (&case.x, &mut case.out);
            // SAFETY: the (emulated) CPU has the kernel's instructions; both extents fit their
            // vectors.
            unsafe { (self.kernel)((x.as_ptr(), *x_rs), case.dims, (out.as_mut_ptr(), *out_rs)) };
        }
    }
}

/// The register transposes (8 × 16 on AVX-512, 8 × 8 on AVX2), and the scalar edges, move
/// every element exactly.
#[test]
fn transpose_moves_every_element() {
    let kernels: [(&str, Transpose, bool); 2] = [
        ("avx512", avx512::transpose, Avx512::available()),
        ("avx2", avx2::transpose, Avx2::available()),
    ];
    for (name, kernel, native) in kernels {
        let cases = [
            (64, 64, 70, 64),
            (19, 13, 13, 20),
            (8, 16, 16, 8),
            (8, 8, 8, 8),
            (17, 35, 40, 17),
            (3, 5, 5, 3),
        ]
        .into_iter()
        .map(|(rows, cols, x_rs, out_rs)| TransposeCase {
            dims: (rows, cols),
            x: (values(rows * x_rs, 4), x_rs),
            out: (vec![f32::NAN; cols * out_rs], out_rs),
        })
        .collect();
        let mut job = TransposeJob { kernel, cases };
        // SAFETY: as in `small_gemm_matches_a_triple_loop_at_every_edge`.
        if !unsafe { run_on(native, Model::TigerLake, &mut job) } {
            return;
        }
        for case in &job.cases {
            let ((rows, cols), (x, x_rs), (out, out_rs)) = (case.dims, &case.x, &case.out);
            for i in 0..rows {
                for p in 0..cols {
                    assert_eq!(
                        out[p * out_rs + i].to_bits(),
                        x[i * x_rs + p].to_bits(),
                        "{name} {rows}×{cols}: ({i}, {p})"
                    );
                }
            }
        }
    }
}

/// One causal product and the whole one it stands for, on the same operands.
struct CausalCase {
    dims: (usize, usize, usize),
    a: (Vec<f32>, usize, usize),
    b: Vec<f32>,
    scale_acc: (f32, bool),
    causal: super::Causal,
    /// `[causal, whole]` results, from the same start.
    c: [Vec<f32>; 2],
}

struct CausalJob {
    kernel: SmallGemm,
    cases: Vec<CausalCase>,
}

impl EmuJob for CausalJob {
    unsafe fn run(&mut self) {
        for case in self.cases.iter_mut() {
            let (m, n, k) = case.dims;
            let (a, a_rs, a_cs) = &case.a;
            for (c, causal) in case.c.iter_mut().zip([case.causal, super::Causal::Whole]) {
                // SAFETY: as in `SmallJob`'s cases.
                unsafe {
                    super::causal_small_gemm(
                        self.kernel,
                        (m, n, k),
                        (c.as_mut_ptr(), n),
                        (a.as_ptr(), *a_rs, *a_cs),
                        (case.b.as_ptr(), 64, 64 * k),
                        case.scale_acc,
                        causal,
                    )
                };
            }
        }
    }
}

/// A causal block's products left out where they may be give bitwise what the whole products
/// do where it is read: scores (`Columns`) on and before the diagonal, and (`Depth`,
/// `DepthFrom`) every output, `a` being zero past (before) the diagonal as probabilities and
/// their gradients (transposed) are; blocks at the start and further down, partial row tiles.
#[test]
fn causal_small_products_match_the_whole_ones() {
    use super::Causal;
    let kernels: [(&str, SmallGemm, bool); 2] = [
        ("avx512", avx512::small_gemm, Avx512::available()),
        ("avx2", avx2::small_gemm, Avx2::available()),
    ];
    for (name, kernel, native) in kernels {
        let mut cases = Vec::new();
        for (r0, m, d) in [
            (0usize, 37usize, 24usize),
            (37, 37, 80),
            (64, 64, 64),
            (5, 13, 16),
        ] {
            let r1 = r0 + m;
            for scale_acc in [(0.125f32, false), (1.0, true)] {
                let start = |len: usize| values(len, 3);
                let strips = |n: usize, k: usize, seed| values(n.div_ceil(64) * 64 * k, seed);
                // Scores: `[m, r1]` from `[m, d]` queries and the keys across.
                let a = values(m * d, 1);
                cases.push(CausalCase {
                    dims: (m, r1, d),
                    a: (a, d, 1),
                    b: strips(r1, d, 2),
                    scale_acc,
                    causal: Causal::Columns(r0),
                    c: [start(m * r1), start(m * r1)],
                });
                // Outputs from probabilities: `[m, r1]`, zero past each row's diagonal.
                let mut p = values(m * r1, 4);
                for i in 0..m {
                    p[i * r1 + r0 + i + 1..(i + 1) * r1].fill(0.0);
                }
                cases.push(CausalCase {
                    dims: (m, d, r1),
                    a: (p.clone(), r1, 1),
                    b: strips(d, r1, 5),
                    scale_acc,
                    causal: Causal::Depth(r0),
                    c: [start(m * d), start(m * d)],
                });
                // Keys' gradients from the probabilities transposed: `[r1, m]`.
                cases.push(CausalCase {
                    dims: (r1, d, m),
                    a: (p, 1, r1),
                    b: strips(d, m, 6),
                    scale_acc,
                    causal: Causal::DepthFrom(r0),
                    c: [start(r1 * d), start(r1 * d)],
                });
            }
        }
        let mut job = CausalJob { kernel, cases };
        // SAFETY: as in `small_gemm_matches_a_triple_loop_at_every_edge`.
        if !unsafe { run_on(native, Model::TigerLake, &mut job) } {
            return;
        }
        for case in &job.cases {
            let (m, n, _) = case.dims;
            let [causal, whole] = &case.c;
            for i in 0..m {
                let read = match case.causal {
                    Causal::Columns(r0) => r0 + i + 1,
                    _ => n,
                };
                for j in 0..read {
                    assert_eq!(
                        causal[i * n + j].to_bits(),
                        whole[i * n + j].to_bits(),
                        "{name} {:?} {:?}: ({i}, {j})",
                        case.causal,
                        case.dims
                    );
                }
            }
        }
    }
}
