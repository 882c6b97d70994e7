//! A bf16 run's fused LM head (`LmHeadLoss { bf16: true }`, as the precision pass sets it)
//! computes its products in bf16 arithmetic where a bf16 tile runs them: the logits from `x`
//! and the head rounded to bf16, and in the backward the logit gradients rounded too, the
//! products summed in f32, as autocast computes the head. Checked against two f64 references,
//! one rounding those operands and one not, tied and untied heads, over several tiles of
//! tokens and vocabulary; with `bf16: false` the head stays f32 arithmetic.
//!
//! Natively where the CPU has AVX512-BF16, else on the f32 tiles with bf16 arithmetic's
//! rounding (`Bf16Math::Model`): this file's process runs with that setting.

use snug_cpu::isa::{Bf16Math, CpuFeatures};
use snug_cpu::CpuSession;
use snug_graph::ops::{LmHeadLoss, LmHeadLossBackward};
use snug_graph::{CpuGemm, DType, Graph, Role, Target};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

/// Deterministic values in [-1, 1), uncorrelated between seeds (xorshift).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// `x` rounded to bf16 (nearest even), in f64.
fn bf16(x: f32) -> f64 {
    let b = x.to_bits();
    f64::from(f32::from_bits(
        (b.wrapping_add(0x7fff + ((b >> 16) & 1))) & 0xffff_0000,
    ))
}

/// The head's outputs: each row's log-sum-exp, `dx`, and the head's gradient in its layout.
type Outputs = [Vec<f64>; 3];

struct Problem {
    n: usize,
    c: usize,
    v: usize,
    tb: bool,
    x: Vec<f32>,
    w: Vec<f32>,
    targets: Vec<usize>,
}

impl Problem {
    fn new((n, c, v): (usize, usize, usize), tb: bool) -> Problem {
        Problem {
            n,
            c,
            v,
            tb,
            // Logits of a few units, as a model's are.
            x: values(n * c, 3).iter().map(|v| 0.5 * v).collect(),
            w: values(c * v, 5).iter().map(|v| 0.5 * v).collect(),
            targets: (0..n).map(|i| (i * 37 + 11) % v).collect(),
        }
    }

    /// Head element `(p, j)` of the head read as `[C, V]`.
    fn head(&self, p: usize, j: usize) -> f32 {
        if self.tb {
            self.w[j * self.c + p]
        } else {
            self.w[p * self.v + j]
        }
    }

    /// The step in f64, each product's operands rounded to bf16 where `round`; the gradients
    /// from `lse_in`, the kernel's log-sum-exps (as the backward is given them).
    fn reference(&self, round: bool, lse_in: &[f64]) -> Outputs {
        let (n, c, v) = (self.n, self.c, self.v);
        let r = |x: f32| if round { bf16(x) } else { f64::from(x) };
        let mut lse = vec![0.0; n];
        let mut dx = vec![0.0; n * c];
        let mut dw = vec![0.0; c * v];
        for i in 0..n {
            let logits: Vec<f64> = (0..v)
                .map(|j| {
                    (0..c)
                        .map(|p| r(self.x[i * c + p]) * r(self.head(p, j)))
                        .sum()
                })
                .collect();
            let max = logits.iter().copied().fold(f64::MIN, f64::max);
            let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
            lse[i] = max + sum.ln();
            for (j, l) in logits.iter().enumerate() {
                // The mean loss: each row's gradient is scaled by 1 / n. The kernel makes it
                // in f32, and a bf16 product rounds it as it packs it.
                let onehot = if j == self.targets[i] { 1.0 } else { 0.0 };
                let g = (((l - lse_in[i]).exp() - onehot) / n as f64) as f32;
                let g = r(g);
                for p in 0..c {
                    dx[i * c + p] += g * r(self.head(p, j));
                    let at = if self.tb { j * c + p } else { p * v + j };
                    dw[at] += g * r(self.x[i * c + p]);
                }
            }
        }
        [lse, dx, dw]
    }

    /// The fused head forward and backward on this CPU, its products as `bf16` says.
    fn run(&self, bf16: bool, (rows, cols): (usize, usize)) -> Outputs {
        let (n, c, v, tb) = (self.n, self.c, self.v, self.tb);
        let mut g = Graph::new().with_target(Target::cpu(2, CpuGemm::host()));
        let x = g.add_leaf("x", &[n, c], DType::F32, Role::Input).unwrap();
        let head_shape = if tb { [v, c] } else { [c, v] };
        let w = g
            .add_leaf("w", &head_shape, DType::F32, Role::Parameter)
            .unwrap();
        let t = g.add_leaf("t", &[n], DType::I32, Role::Input).unwrap();
        let dloss = g.add_leaf("dloss", &[], DType::F32, Role::Input).unwrap();
        let head = LmHeadLoss {
            tb,
            rows,
            cols,
            bf16,
        };
        let lse = g.apply(head, &[x, w, t]).unwrap()[1];
        let back = LmHeadLossBackward {
            tb,
            rows,
            cols,
            bf16,
        };
        let grads = g.apply(back, &[x, w, t, lse, dloss]).unwrap();
        let outs = [lse, grads[0], grads[1]];
        for &o in &outs {
            g.mark_output(o);
        }
        let memory = plan(&g, &PlanOptions::default()).unwrap();
        let mut s = CpuSession::new(g, memory, Allocator::default(), 2).unwrap();
        s.write_f32(x, &self.x).unwrap();
        s.write_f32(w, &self.w).unwrap();
        let ids: Vec<i32> = self.targets.iter().map(|&i| i as i32).collect();
        s.write_i32(t, &ids, v).unwrap();
        s.write_f32(dloss, &[1.0]).unwrap();
        s.run(ExecCtx::default()).unwrap();
        outs.map(|o| {
            let got = s.read_f32(o).unwrap();
            got.iter().map(|&x| f64::from(x)).collect()
        })
    }
}

#[test]
fn a_bf16_runs_head_rounds_its_operands_as_bf16_arithmetic_does() {
    let cpu = CpuFeatures::host();
    if cpu.bf16_arithmetic() {
        Bf16Math::Native.set();
    } else if cpu.isa() == snug_cpu::isa::Isa::Baseline {
        // No tile of ours runs here (aarch64, or x86-64 without AVX2): every product is f32.
        eprintln!("skipped: no bf16 tile on this CPU (the products are f32 arithmetic)");
        return;
    } else {
        Bf16Math::Model.set();
    }
    // Partial register tiles, several tiles of tokens and vocabulary (the last ones small:
    // bf16 arithmetic at every size), and depth past one block.
    let (n, c, v) = (200, 400, 330);
    for tb in [true, false] {
        let p = Problem::new((n, c, v), tb);
        for bf16 in [true, false] {
            let got = p.run(bf16, (96, 128));
            let (rounded, plain) = (p.reference(true, &got[0]), p.reference(false, &got[0]));
            for (k, name) in ["lse", "dx", "dw"].iter().enumerate() {
                let apart = snug_testkit::max_abs_diff(&rounded[k], &plain[k]);
                let (near, far) = if bf16 {
                    (
                        snug_testkit::max_abs_diff(&got[k], &rounded[k]),
                        snug_testkit::max_abs_diff(&got[k], &plain[k]),
                    )
                } else {
                    (
                        snug_testkit::max_abs_diff(&got[k], &plain[k]),
                        snug_testkit::max_abs_diff(&got[k], &rounded[k]),
                    )
                };
                let label = format!("tb {tb}, bf16 {bf16}, {name}");
                eprintln!("{label}: {near:.2e} from its reference, {apart:.2e} between them");
                // f32 summation lands far closer to its own reference than the rounding
                // moves the other: a rounding missing, or one too many, fails.
                assert!(near * 100.0 < apart, "{label}: {near:e} vs {apart:e}");
                assert!(far > apart / 2.0, "{label}: {far:e} vs {apart:e}");
            }
        }
    }
}
