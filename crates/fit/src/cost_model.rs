//! Predicted step time from kernel timings measured on this machine.
//!
//! A [`MachineProfile`] holds samples: one op class (the op's name, plus the operand layout for
//! matmuls), the work of one call (its FLOPs, or for ops that report none the bytes it reads and
//! writes) and the seconds it took. A node's time is interpolated from the samples of its class,
//! piecewise linear in log(work)–log(seconds), and at constant throughput beyond the measured
//! range. Classes never measured fall back to the GEMM peak (FLOPs) or the memory bandwidth
//! (bytes). A step is the sum of its nodes over the micro-batches, with the optimizer counted
//! once: on CPU the kernels run one after another, so the sum is the step.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use snug_graph::ops::Op;
use snug_graph::{Graph, NodeId, StepGraph};

/// Bumped when the meaning of samples changes, so stale caches are remeasured.
pub const PROFILE_VERSION: u32 = 1;

/// One kernel call as measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub class: String,
    pub work: f64,
    pub seconds: f64,
}

/// What this machine's kernels cost, measured once and cached.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MachineProfile {
    pub version: u32,
    /// Worker threads the samples were measured with.
    pub threads: usize,
    pub cpu: String,
    /// Best FLOP/s of the GEMM probe: the peak MFU is reported against.
    pub gemm_peak_flops: f64,
    /// Bytes per second of a large copy (read + write counted).
    pub bandwidth: f64,
    /// Seconds a kernel costs however small its work (launch, thread wake-up).
    pub overhead: f64,
    pub samples: Vec<Sample>,
    #[serde(skip)]
    curves: BTreeMap<String, Vec<(f64, f64)>>,
}

impl MachineProfile {
    pub fn new(
        threads: usize,
        cpu: String,
        gemm_peak_flops: f64,
        bandwidth: f64,
        overhead: f64,
        samples: Vec<Sample>,
    ) -> MachineProfile {
        let mut p = MachineProfile {
            version: PROFILE_VERSION,
            threads,
            cpu,
            gemm_peak_flops,
            bandwidth,
            overhead,
            samples,
            curves: BTreeMap::new(),
        };
        p.index();
        p
    }

    /// Round figures for an unmeasured machine (50 GFLOP/s per thread, 20 GB/s): enough to
    /// rank candidates by their work, not to predict this machine's seconds.
    pub fn nominal(threads: usize) -> MachineProfile {
        MachineProfile::new(
            threads,
            "nominal".into(),
            50e9 * threads.max(1) as f64,
            20e9,
            5e-6,
            Vec::new(),
        )
    }

    /// Parses a cached profile (check [`MachineProfile::version`] against [`PROFILE_VERSION`]).
    pub fn from_json(text: &str) -> Result<MachineProfile, serde_json::Error> {
        let mut p: MachineProfile = serde_json::from_str(text)?;
        p.index();
        Ok(p)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Whether samples were measured (not [`MachineProfile::nominal`]).
    pub fn is_measured(&self) -> bool {
        !self.samples.is_empty()
    }

    fn index(&mut self) {
        let mut by_class: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for s in &self.samples {
            if s.work > 0.0 && s.seconds > 0.0 {
                by_class
                    .entry(s.class.clone())
                    .or_default()
                    .push((s.work.ln(), s.seconds.ln()));
            }
        }
        for points in by_class.values_mut() {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            // Calls of equal work (a layer's repeats) become their median.
            let mut merged: Vec<(f64, f64)> = Vec::new();
            let mut i = 0;
            while i < points.len() {
                let mut j = i;
                while j < points.len() && (points[j].0 - points[i].0).abs() < 1e-9 {
                    j += 1;
                }
                let mut times: Vec<f64> = points[i..j].iter().map(|p| p.1).collect();
                times.sort_by(f64::total_cmp);
                merged.push((points[i].0, times[times.len() / 2]));
                i = j;
            }
            *points = merged;
        }
        self.curves = by_class;
    }

    /// Predicted seconds of one call of `class` doing `work` (`flops` tells which unit work is
    /// in, for the fallback of an unmeasured class).
    pub fn seconds(&self, class: &str, work: f64, flops: bool) -> f64 {
        if work <= 0.0 {
            return 0.0;
        }
        let Some(curve) = self.curves.get(class).filter(|c| !c.is_empty()) else {
            let rate = if flops {
                self.gemm_peak_flops
            } else {
                self.bandwidth
            };
            return self.overhead + work / rate.max(1.0);
        };
        let x = work.ln();
        let (first, last) = (curve[0], curve[curve.len() - 1]);
        if x <= first.0 {
            // Below the smallest call measured: its throughput, but never under the overhead.
            return (first.1 + x - first.0).exp().max(self.overhead);
        }
        if x >= last.0 {
            return (last.1 + x - last.0).exp();
        }
        let i = curve.partition_point(|p| p.0 <= x);
        let (a, b) = (curve[i - 1], curve[i]);
        let t = (x - a.0) / (b.0 - a.0);
        (a.1 + t * (b.1 - a.1)).exp()
    }

    /// Predicted seconds of one node of `graph`.
    pub fn node_seconds(&self, graph: &Graph, node: NodeId) -> f64 {
        let (class, work, flops) = node_work(graph, node);
        self.seconds(&class, work, flops)
    }

    /// Predicted seconds of one optimizer step of `step` run in `schedule` order: every node
    /// once per micro-batch, the optimizer update once.
    pub fn step_seconds(&self, step: &StepGraph, schedule: &[NodeId]) -> f64 {
        let micro = step.micro_steps.max(1) as f64;
        schedule
            .iter()
            .map(|&n| {
                let t = self.node_seconds(&step.graph, n);
                if once_per_step(&step.graph.node(n).op) {
                    t
                } else {
                    t * micro
                }
            })
            .sum()
    }
}

/// Optimizer updates run on the last micro-batch only.
fn once_per_step(op: &Op) -> bool {
    matches!(op, Op::AdamW(_) | Op::Sgd(_))
}

/// A node's cost class, its work, and whether the work is FLOPs (else bytes moved).
pub fn node_work(graph: &Graph, node: NodeId) -> (String, f64, bool) {
    let n = graph.node(node);
    let ins: Vec<_> = n.inputs.iter().map(|&i| graph.tensor(i)).collect();
    let outs: Vec<_> = n.outputs.iter().map(|&i| graph.tensor(i)).collect();
    let class = match &n.op {
        Op::MatMul(m) => format!(
            "matmul{}{}",
            if m.ta { "_ta" } else { "" },
            if m.tb { "_tb" } else { "" }
        ),
        op => op.name().to_string(),
    };
    // Views alias their input and run no kernel.
    if outs.iter().all(|t| t.view_of.is_some()) {
        return (class, 0.0, false);
    }
    let flops = n.op.flops(&ins, &outs);
    if flops > 0 {
        return (class, flops as f64, true);
    }
    let bytes: usize = ins.iter().chain(&outs).map(|t| t.size_bytes()).sum();
    (class, bytes as f64, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(samples: &[(&str, f64, f64)]) -> MachineProfile {
        MachineProfile::new(
            2,
            "test".into(),
            100e9,
            10e9,
            1e-6,
            samples
                .iter()
                .map(|&(c, w, s)| Sample {
                    class: c.into(),
                    work: w,
                    seconds: s,
                })
                .collect(),
        )
    }

    #[test]
    fn interpolates_between_samples_and_extrapolates_at_the_end_rates() {
        // 1 GFLOP in 20 ms (50 GFLOP/s), 16 GFLOP in 160 ms (100 GFLOP/s).
        let p = profile(&[("matmul", 1e9, 0.02), ("matmul", 16e9, 0.16)]);
        assert!((p.seconds("matmul", 1e9, true) - 0.02).abs() < 1e-12);
        // Halfway in log(work): the geometric mean of the two times.
        let mid = p.seconds("matmul", 4e9, true);
        assert!((mid - (0.02f64 * 0.16).sqrt()).abs() < 1e-9, "{mid}");
        // Beyond the largest sample: its throughput.
        assert!((p.seconds("matmul", 32e9, true) - 0.32).abs() < 1e-9);
        // Below the smallest: its throughput, floored at the overhead.
        assert!((p.seconds("matmul", 0.5e9, true) - 0.01).abs() < 1e-9);
        assert!((p.seconds("matmul", 1.0, true) - 1e-6).abs() < 1e-12);
    }

    #[test]
    fn repeated_calls_take_their_median_and_unknown_classes_use_the_roofline() {
        let p = profile(&[
            ("add", 1e6, 3e-4),
            ("add", 1e6, 1e-4),
            ("add", 1e6, 2e-4),
        ]);
        assert!((p.seconds("add", 1e6, false) - 2e-4).abs() < 1e-12);
        // 1 GB at 10 GB/s, plus the overhead.
        assert!((p.seconds("gelu", 1e9, false) - (0.1 + 1e-6)).abs() < 1e-9);
        assert!((p.seconds("attention", 1e11, true) - (1.0 + 1e-6)).abs() < 1e-9);
    }

    #[test]
    fn profile_round_trips_through_json() {
        let p = profile(&[("matmul", 1e9, 0.02), ("matmul", 16e9, 0.16)]);
        let q = MachineProfile::from_json(&p.to_json()).expect("parses");
        assert_eq!(p, q);
        assert_eq!(q.seconds("matmul", 4e9, true), p.seconds("matmul", 4e9, true));
    }
}
