//! Reading a quantized weight from its codes ([`QuantizedRead`]) against reading a Dequantize's
//! (or, for bf16, a Cast's) f32 copy: bf16, int8, NF4 and NF4 with double quantization; products in every layout the step
//! uses (the weight as `b`, transposed or not, `a` transposed or not, with and without a
//! bias) on shapes that leave partial register tiles, cross depth blocks and NF4 blocks inside
//! rows, on one and two threads, both where our blocked kernel packs from the codes and where
//! the gemm crate reads decoded panels; the fused LM head and its backward over several tiles
//! of tokens and vocabulary, the head tied and untied; the embedding's gather. Bit for bit,
//! except the gemm crate's products deeper than one panel, which are held to the f32
//! summation bound.

use snug_cpu::CpuSession;
use snug_graph::ops::quantized_read::{own_gemm_runs, PANEL};
use snug_graph::ops::{
    Cast, Dequantize, Embedding, LmHeadLoss, LmHeadLossBackward, MatMul, Narrow, Op, QuantizeBase,
    QuantizedRead,
};
use snug_graph::{CpuGemm, DType, Graph, Role, Target, TensorId};
use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, ExecCtx};

const BASES: [QuantizeBase; 4] = [
    QuantizeBase::Bf16,
    QuantizeBase::Int8,
    QuantizeBase::Nf4,
    QuantizeBase::Nf4Dq,
];

use snug_testkit::heavy_tailed_values as values;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A weight of `shape` stored as `base` says, in a graph: its stored leaves and their bytes.
struct Stored {
    leaves: Vec<TensorId>,
    codes: Vec<u8>,
    absmax: Vec<f32>,
}

fn store(g: &mut Graph, base: QuantizeBase, shape: &[usize], w: &[f32]) -> Stored {
    let (dtype, codes_shape, absmax_shape) = base.storage(shape);
    let mut leaves = vec![g
        .add_leaf("w", &codes_shape, dtype, Role::Parameter)
        .unwrap()];
    if let Some(a) = absmax_shape {
        leaves.push(
            g.add_leaf("w.absmax", &a, DType::F32, Role::Parameter)
                .unwrap(),
        );
    }
    let (codes, absmax) = base.quantize(w, shape);
    Stored {
        leaves,
        codes,
        absmax,
    }
}

fn write(s: &mut CpuSession, stored: &Stored) {
    s.write_bytes(stored.leaves[0], &stored.codes).unwrap();
    if let Some(&a) = stored.leaves.get(1) {
        s.write_f32(a, &stored.absmax).unwrap();
    }
}

/// The f32 copy today's graph reads.
fn dequantized(g: &mut Graph, base: QuantizeBase, shape: &[usize], stored: &Stored) -> TensorId {
    match base.scheme() {
        Some(scheme) => g
            .apply1(
                Dequantize {
                    scheme,
                    shape: shape.to_vec(),
                },
                &stored.leaves,
            )
            .unwrap(),
        None => g.apply1(Cast { to: DType::F32 }, &stored.leaves).unwrap(),
    }
}

/// Runs `reader` on `inputs` (f32 values, by position; `weight` the quantized one, of
/// `shape`) both ways; returns every output of each, and each graph's planned peak.
#[allow(clippy::type_complexity)]
fn both_ways(
    base: QuantizeBase,
    reader: Op,
    (weight, shape, w): (usize, &[usize], &[f32]),
    inputs: &[(Vec<usize>, DType, Vec<f32>)],
    threads: usize,
) -> [(Vec<Vec<f32>>, usize); 2] {
    [false, true].map(|fused| {
        let target = Target::cpu(threads, CpuGemm::host());
        let mut g = Graph::new().with_target(target);
        let mut ids = Vec::new();
        let mut stored = None;
        let mut args = Vec::new();
        for (i, (s, dtype, _)) in inputs.iter().enumerate() {
            if i == weight {
                let st = store(&mut g, base, shape, w);
                if fused {
                    args.extend(st.leaves.iter().copied());
                } else {
                    args.push(dequantized(&mut g, base, shape, &st));
                }
                stored = Some(st);
                ids.push(None);
                continue;
            }
            let t = g
                .add_leaf(format!("in{i}"), s, *dtype, Role::Input)
                .unwrap();
            args.push(t);
            ids.push(Some(t));
        }
        let op = if fused {
            Op::QuantizedRead(QuantizedRead {
                base,
                shape: shape.to_vec(),
                weight,
                reader: Box::new(reader.clone()),
            })
        } else {
            reader.clone()
        };
        let outs = g.apply(op, &args).unwrap();
        // The frozen head's gradient is not compared: the fused op does not make it.
        let outs = match reader {
            Op::LmHeadLossBackward(_) => outs[..1].to_vec(),
            _ => outs,
        };
        for &o in &outs {
            g.mark_output(o);
        }
        let memory = plan(&g, &PlanOptions::default()).unwrap();
        let peak = memory.peak_bytes();
        let mut s = CpuSession::new(g, memory, Allocator::default(), threads).unwrap();
        write(&mut s, stored.as_ref().unwrap());
        for (id, (_, dtype, v)) in ids.iter().zip(inputs) {
            let Some(id) = *id else { continue };
            match dtype {
                DType::I32 => {
                    let ints: Vec<i32> = v.iter().map(|&x| x as i32).collect();
                    s.write_i32(id, &ints, i32::MAX as usize).unwrap()
                }
                _ => s.write_f32(id, v).unwrap(),
            }
        }
        s.run(ExecCtx::default()).unwrap();
        let got = outs
            .iter()
            .map(|&o| s.read_f32(o).unwrap().to_vec())
            .collect();
        (got, peak)
    })
}

#[test]
fn products_read_from_codes_are_bitwise_the_dequantized_weights() {
    // (m, n, k): our kernel's tiles with partial edges, k past its depth block, NF4 blocks
    // across rows (n of 70 or 250 is not a multiple of 64); the gemm crate's (too small, too
    // narrow) within one panel and over three.
    let shapes = [
        (300, 70, 200),
        (129, 250, 130),
        (40, 33, 3300),
        (7, 20, 50),
        (5, 9, 600),
    ];
    let mut checked = 0;
    for (m, n, k) in shapes {
        let own = own_gemm_runs(CpuGemm::host(), (m, n, k));
        for base in BASES {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                for bias in [false, true] {
                    let threads = 1 + (checked % 2);
                    checked += 1;
                    let a_shape = if ta { vec![k, m] } else { vec![m, k] };
                    let w_shape = if tb { vec![n, k] } else { vec![k, n] };
                    let w = values(k * n, 3 + checked as u64);
                    let mut inputs = vec![
                        (a_shape, DType::F32, values(m * k, 11)),
                        (w_shape.clone(), DType::F32, Vec::new()),
                    ];
                    if bias {
                        inputs.push((vec![n], DType::F32, values(n, 5)));
                    }
                    let mm = Op::MatMul(MatMul { ta, tb, bias });
                    let [(want, peak_copy), (got, peak_fused)] =
                        both_ways(base, mm, (1, &w_shape, &w), &inputs, threads);
                    let label = format!("{base} {m}×{k}×{n} ta={ta} tb={tb} bias={bias}");
                    if own || k <= PANEL {
                        assert_eq!(bits(&got[0]), bits(&want[0]), "{label}");
                    } else {
                        // Panel by panel: each output within the f32 summation bound of the
                        // whole-depth product.
                        let (codes, absmax) = base.quantize(&w, &w_shape);
                        let wd = base.dequantize(&codes, &absmax, &w_shape);
                        let a = &inputs[0].2;
                        for i in 0..m {
                            for j in 0..n {
                                let mut sum_abs = 0f64;
                                for p in 0..k {
                                    let av = if ta { a[p * m + i] } else { a[i * k + p] };
                                    let bv = if tb { wd[j * k + p] } else { wd[p * n + j] };
                                    sum_abs += (av as f64 * bv as f64).abs();
                                }
                                let bound = 2.0 * k as f64 * f32::EPSILON as f64 * sum_abs;
                                let (x, y) = (got[0][i * n + j] as f64, want[0][i * n + j] as f64);
                                assert!(
                                    (x - y).abs() <= bound,
                                    "{label} at ({i}, {j}): {x} vs {y}"
                                );
                            }
                        }
                    }
                    // The whole f32 copy is gone; the gemm crate's products plan one panel.
                    let copy = 4 * k * n;
                    let panel = if own { 0 } else { 4 * k.min(PANEL) * n };
                    assert!(
                        peak_fused + copy <= peak_copy + panel + 64,
                        "{label}: {peak_fused} bytes against {peak_copy} with a {copy}-byte \
                         copy (panel {panel})"
                    );
                }
            }
        }
    }
}

#[test]
fn the_lm_head_read_from_codes_is_bitwise_the_dequantized_head() {
    // (tokens, width, vocabulary, tile rows, tile columns): several partial tiles each way on
    // the gemm crate, and tiles our kernel runs.
    for (n, c, v, rows, cols) in [(37, 70, 130, 16, 48), (300, 128, 300, 256, 128)] {
        for base in BASES {
            for tb in [false, true] {
                let shape = if tb { vec![v, c] } else { vec![c, v] };
                let w = values(c * v, 17);
                let x = values(n * c, 19);
                let targets: Vec<f32> = (0..n).map(|i| ((i * 7 + 3) % v) as f32).collect();
                let bf16 = false;
                let fwd = LmHeadLoss {
                    tb,
                    rows,
                    cols,
                    bf16,
                };
                let inputs = vec![
                    (vec![n, c], DType::F32, x.clone()),
                    (shape.clone(), DType::F32, Vec::new()),
                    (vec![n], DType::I32, targets.clone()),
                ];
                let [(want, _), (got, _)] =
                    both_ways(base, fwd.into(), (1, &shape, &w), &inputs, 2);
                let label = format!("{base} {n}×{c}×{v} tb={tb}");
                assert_eq!(bits(&got[0]), bits(&want[0]), "{label}: loss");
                assert_eq!(bits(&got[1]), bits(&want[1]), "{label}: lse");
                let back = LmHeadLossBackward {
                    tb,
                    rows,
                    cols,
                    bf16,
                };
                let inputs = vec![
                    (vec![n, c], DType::F32, x),
                    (shape.clone(), DType::F32, Vec::new()),
                    (vec![n], DType::I32, targets),
                    (vec![n], DType::F32, want[1].clone()),
                    (vec![], DType::F32, vec![1.0]),
                ];
                let [(want, peak_copy), (got, peak_fused)] =
                    both_ways(base, back.into(), (1, &shape, &w), &inputs, 2);
                assert_eq!(bits(&got[0]), bits(&want[0]), "{label}: dx");
                // Neither the head's copy nor its unwanted gradient is held.
                let panel = 4 * (c.min(PANEL) * cols).max(cols.min(PANEL) * c);
                assert!(
                    peak_fused + 2 * 4 * c * v <= peak_copy + panel + 64,
                    "{label}: {peak_fused} vs {peak_copy}"
                );
            }
        }
    }
}

#[test]
fn the_embedding_decodes_the_rows_it_gathers_bitwise() {
    let (v, c, n) = (90, 70, 33);
    for base in BASES {
        let w = values(v * c, 23);
        let ids: Vec<f32> = (0..n).map(|i| ((i * 13 + 1) % v) as f32).collect();
        let inputs = vec![
            (vec![v, c], DType::F32, Vec::new()),
            (vec![n], DType::I32, ids),
        ];
        let [(want, _), (got, _)] = both_ways(base, Embedding.into(), (0, &[v, c], &w), &inputs, 2);
        assert_eq!(bits(&got[0]), bits(&want[0]), "{base}");
        // A slice of rows (GPT's positions), from a row inside an NF4 block.
        let rows = Narrow { start: 3, len: 20 };
        let inputs = vec![(vec![v, c], DType::F32, Vec::new())];
        let [(want, _), (got, _)] = both_ways(base, rows.into(), (0, &[v, c], &w), &inputs, 1);
        assert_eq!(got[0].len(), 20 * c);
        assert_eq!(bits(&got[0]), bits(&want[0]), "{base}: rows");
    }
}
