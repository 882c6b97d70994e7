//! Predicted step time from kernel timings measured on this machine.
//!
//! A [`MachineProfile`] holds samples: one op class (the op's name, plus the operand layout for
//! matmuls), its family (the operands' inner dimensions, which stay fixed when only the batch
//! changes), the work of one call (its FLOPs, or for ops that report none the bytes it reads and
//! writes) and the seconds it took. Within a family measured at two or more sizes, a node's time
//! is a fixed cost plus a cost per unit of work, fitted by least squares on relative error
//! through each size's median call. Otherwise it is interpolated from the class's samples,
//! piecewise linear in log(work)–log(seconds), and at constant throughput beyond the measured
//! range. Classes never measured fall back to the GEMM peak (FLOPs) or the memory bandwidth
//! (bytes). A step is the sum of its nodes over the micro-batches, with the optimizer counted
//! once: on CPU the kernels run one after another, so the sum is the step.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use snug_graph::ops::Op;
use snug_graph::{Graph, NodeId, StepGraph};

/// Bumped when the meaning of samples changes (or the kernels they time), so stale caches are
/// remeasured. 10: large f32 GEMMs run snug's AVX-512 kernel. 11: it deals work to threads by
/// demand. 12: it makes LayerNorm and GELU as it packs, and adds biases as it stores. 13: CPUs
/// with AVX2 but not AVX-512 run it too. 14: ops reading or writing bf16 are classes of their
/// own (`half_…`).
pub const PROFILE_VERSION: u32 = 14;

/// One kernel call as measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The op class and the inputs' innermost dimensions (see [`node_work`]).
    pub class: String,
    pub family: String,
    pub work: f64,
    pub seconds: f64,
}

fn one() -> f64 {
    1.0
}

/// A cached profile that cannot be trusted: the field (a JSON path such as
/// `samples[3].seconds`) and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{field}` {detail}")]
pub struct ProfileError {
    pub field: String,
    pub detail: String,
}

impl ProfileError {
    fn new(field: impl Into<String>, detail: impl Into<String>) -> ProfileError {
        ProfileError {
            field: field.into(),
            detail: detail.into(),
        }
    }
}

/// Rates beyond these are no machine's: 10 PFLOP/s is beyond any single device's f32 GEMM,
/// 100 TB/s beyond any memory's bandwidth. A sample's work per second gets the larger bound
/// (its work is FLOPs or bytes, and a small call's time is near the timer's resolution).
const MAX_FLOPS: f64 = 1e16;
const MAX_BYTES_PER_SECOND: f64 = 1e14;
const MAX_SAMPLE_RATE: f64 = 1e18;
/// A kernel that costs more than a second however small, or a probe call over an hour, was
/// not measured by a calibration.
const MAX_OVERHEAD_SECONDS: f64 = 1.0;
const MAX_SAMPLE_SECONDS: f64 = 3600.0;

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
    /// FLOP/s of the drift probe (one fixed GEMM) around the calibration: a probe taken later
    /// says how much faster or slower the machine runs now (see [`MachineProfile::rescaled`]).
    #[serde(default)]
    pub probe_flops: f64,
    /// How much faster than at calibration this profile assumes the machine runs now (1: as
    /// calibrated). Set by [`MachineProfile::rescaled`], never cached.
    #[serde(skip, default = "one")]
    pub speed: f64,
    /// (class, family) and class alone → (ln work, ln seconds), sorted by work.
    #[serde(skip)]
    curves: BTreeMap<(String, String), Vec<(f64, f64)>>,
    /// (class, family) → seconds = a + b · work, where measured at two sizes or more.
    #[serde(skip)]
    lines: BTreeMap<(String, String), (f64, f64)>,
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
            probe_flops: 0.0,
            speed: 1.0,
            curves: BTreeMap::new(),
            lines: BTreeMap::new(),
        };
        p.index();
        p
    }

    /// This profile with the drift probe's rate at calibration.
    pub fn with_probe(mut self, flops: f64) -> MachineProfile {
        self.probe_flops = flops;
        self
    }

    /// The profile for a machine running `speed` times as fast as when it was calibrated: every
    /// time divided by `speed` (every rate multiplied). A shared host's speed moves by tens of
    /// percent in spells of minutes; a drift probe's rate now over its rate at calibration
    /// measures the spell, so predictions follow it instead of the calibration's own spell.
    pub fn rescaled(&self, speed: f64) -> MachineProfile {
        let speed = if speed.is_finite() && speed > 0.0 {
            speed
        } else {
            1.0
        };
        let mut p = MachineProfile::new(
            self.threads,
            self.cpu.clone(),
            self.gemm_peak_flops * speed,
            self.bandwidth * speed,
            self.overhead / speed,
            self.samples
                .iter()
                .map(|s| Sample {
                    seconds: s.seconds / speed,
                    ..s.clone()
                })
                .collect(),
        )
        .with_probe(self.probe_flops);
        p.speed = self.speed * speed;
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

    /// Parses a cached profile and checks its figures ([`MachineProfile::check`]); the caller
    /// still checks [`MachineProfile::version`] against [`PROFILE_VERSION`]. A JSON `null` (how
    /// a NaN or an infinity is written) is named by its path.
    pub fn from_json(text: &str) -> Result<MachineProfile, ProfileError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| ProfileError::new("(file)", e.to_string()))?;
        if let Some(path) = first_null(&value, String::new()) {
            return Err(ProfileError::new(
                path,
                "is null (how JSON writes a NaN or an infinity): not a measurement",
            ));
        }
        // Serde names a missing or mistyped field itself.
        let mut p: MachineProfile = serde_json::from_value(value)
            .map_err(|e| ProfileError::new("(structure)", e.to_string()))?;
        p.check()?;
        p.index();
        Ok(p)
    }

    /// Whether every figure is one a machine could have: a positive thread count, rates that
    /// are positive and below any machine's ([`MAX_FLOPS`], [`MAX_BYTES_PER_SECOND`]), an
    /// overhead in [0, 1 s], and samples (some of the GEMM, which every calibration times)
    /// of positive work and time. The cost model divides by these; a cache that fails is
    /// measured again rather than used.
    pub fn check(&self) -> Result<(), ProfileError> {
        if self.threads == 0 {
            return Err(ProfileError::new("threads", "is 0"));
        }
        // `least` is where a measurement starts: above 0, or (with `zero_too`) at 0.
        let figure = |field: &str, v: f64, zero_too: bool, most: f64, unit: &str| {
            let low = if zero_too { v < 0.0 } else { v <= 0.0 };
            if v.is_nan() || low || v > most {
                let least = if zero_too { "at least 0" } else { "above 0" };
                return Err(ProfileError::new(
                    field,
                    format!("is {v:e}{unit}: a measurement is {least} and at most {most:e}{unit}"),
                ));
            }
            Ok(())
        };
        figure(
            "gemm_peak_flops",
            self.gemm_peak_flops,
            false,
            MAX_FLOPS,
            " FLOP/s",
        )?;
        figure(
            "bandwidth",
            self.bandwidth,
            false,
            MAX_BYTES_PER_SECOND,
            " B/s",
        )?;
        figure("overhead", self.overhead, true, MAX_OVERHEAD_SECONDS, " s")?;
        // 0: calibrated before the drift probe existed (no rescaling).
        figure("probe_flops", self.probe_flops, true, MAX_FLOPS, " FLOP/s")?;
        if self.samples.is_empty() {
            return Err(ProfileError::new(
                "samples",
                "is empty: a calibration times every kernel class",
            ));
        }
        if !self.samples.iter().any(|s| s.class.starts_with("matmul")) {
            return Err(ProfileError::new(
                "samples",
                "has no `matmul` entries: every calibration times the GEMM",
            ));
        }
        for (i, s) in self.samples.iter().enumerate() {
            if s.class.is_empty() {
                return Err(ProfileError::new(format!("samples[{i}].class"), "is empty"));
            }
            if !(s.work > 0.0 && s.work.is_finite()) {
                return Err(ProfileError::new(
                    format!("samples[{i}].work"),
                    format!("is {:e}: a call's work is above 0", s.work),
                ));
            }
            let seconds = format!("samples[{i}].seconds");
            figure(&seconds, s.seconds, false, MAX_SAMPLE_SECONDS, " s")?;
            let rate = s.work / s.seconds;
            if rate > MAX_SAMPLE_RATE {
                return Err(ProfileError::new(
                    seconds,
                    format!(
                        "is {:e} s for {:e} of work: {rate:e} a second is no machine's",
                        s.seconds, s.work
                    ),
                ));
            }
        }
        Ok(())
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Whether samples were measured (not [`MachineProfile::nominal`]).
    pub fn is_measured(&self) -> bool {
        !self.samples.is_empty()
    }

    fn index(&mut self) {
        let mut by_class: BTreeMap<(String, String), Vec<(f64, f64)>> = BTreeMap::new();
        for s in &self.samples {
            if s.work > 0.0 && s.seconds > 0.0 {
                let point = (s.work.ln(), s.seconds.ln());
                if !s.family.is_empty() {
                    by_class
                        .entry((s.class.clone(), s.family.clone()))
                        .or_default()
                        .push(point);
                }
                by_class
                    .entry((s.class.clone(), String::new()))
                    .or_default()
                    .push(point);
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
        self.lines = by_class
            .iter()
            .filter(|((_, family), _)| !family.is_empty())
            .filter_map(|(k, p)| {
                let p: Vec<(f64, f64)> = p.iter().map(|&(w, t)| (w.exp(), t.exp())).collect();
                Some((k.clone(), fit_line(&p)?))
            })
            .collect();
        self.curves = by_class;
    }

    /// Predicted seconds of one call of `class` doing `work` (`flops` tells which unit work is
    /// in, for the fallback of an unmeasured class). Samples of the same `family` (operands of
    /// the same inner dimensions: the same matmul at another batch size) are used when there
    /// are any; the class's samples of every family otherwise.
    pub fn seconds(&self, class: &str, family: &str, work: f64, flops: bool) -> f64 {
        if work <= 0.0 {
            return 0.0;
        }
        if let Some(&(a, b)) = self.lines.get(&(class.to_string(), family.to_string())) {
            return (a + b * work).max(self.overhead);
        }
        let curve = self
            .curves
            .get(&(class.to_string(), family.to_string()))
            .or_else(|| self.curves.get(&(class.to_string(), String::new())));
        let Some(curve) = curve.filter(|c| !c.is_empty()) else {
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
        let w = node_work(graph, node);
        self.seconds(&w.class, &w.family, w.work, w.flops)
    }

    /// Predicted seconds one node costs per optimizer step of `micro_steps` micro-batches:
    /// once per micro-batch, except the optimizer updates and the collectives that read summed
    /// gradients, which run on the last one only.
    pub fn node_step_seconds(&self, graph: &Graph, node: NodeId, micro_steps: usize) -> f64 {
        per_step(
            self.node_seconds(graph, node),
            once_per_step(&graph.node(node).op),
            micro_steps,
        )
    }

    /// Predicted seconds of one optimizer step of `step` run in `schedule` order.
    pub fn step_seconds(&self, step: &StepGraph, schedule: &[NodeId]) -> f64 {
        self.work_seconds(&StepWork::of(step, schedule))
    }

    /// Predicted seconds of one optimizer step made of `work`: each kind of call timed once,
    /// then every node's time summed in schedule order, as [`MachineProfile::step_seconds`]
    /// sums them (so the two agree to the bit).
    pub fn work_seconds(&self, work: &StepWork) -> f64 {
        let seconds: Vec<f64> = work
            .calls
            .iter()
            .map(|w| self.seconds(&w.class, &w.family, w.work, w.flops))
            .collect();
        work.nodes
            .iter()
            .map(|&(call, once)| per_step(seconds[call as usize], once, work.micro_steps))
            .sum()
    }
}

/// Whether `op` runs once per optimizer step (the updates, and the collectives that read
/// summed gradients) rather than once per micro-batch.
fn once_per_step(op: &Op) -> bool {
    match op {
        Op::AdamW(_) | Op::AdamW8bit(_) | Op::Sgd(_) | Op::ShardedAdamW(_) => true,
        Op::AllReduce(c) => c.once_per_step,
        Op::ReduceScatter(c) => c.once_per_step,
        Op::AllGather(c) => c.once_per_step,
        Op::CollectiveStart(c) => c.op.once_per_step(),
        Op::CollectiveWait(c) => c.op.once_per_step(),
        _ => false,
    }
}

/// A node's seconds per optimizer step of `micro_steps` micro-batches.
fn per_step(seconds: f64, once: bool, micro_steps: usize) -> f64 {
    if once {
        seconds
    } else {
        seconds * micro_steps.max(1) as f64
    }
}

/// What a step's predicted time is made of, in schedule order: kept so that another
/// machine's profile times it ([`MachineProfile::work_seconds`]) without compiling or
/// planning the step again. A model's repeated layers make few distinct kinds of call.
#[derive(Clone, PartialEq, Default)]
pub struct StepWork {
    /// Each distinct kind of call.
    calls: Vec<NodeWork>,
    /// Per node in schedule order: its call, and whether it runs once per step.
    nodes: Vec<(u32, bool)>,
    micro_steps: usize,
}

impl StepWork {
    /// `step`'s work run in `schedule` order.
    pub fn of(step: &StepGraph, schedule: &[NodeId]) -> StepWork {
        let mut index: std::collections::HashMap<(String, String, u64, bool), u32> =
            std::collections::HashMap::new();
        let mut calls = Vec::new();
        let nodes = schedule
            .iter()
            .map(|&n| {
                let w = node_work(&step.graph, n);
                let key = (w.class.clone(), w.family.clone(), w.work.to_bits(), w.flops);
                let call = *index.entry(key).or_insert_with(|| {
                    calls.push(w);
                    (calls.len() - 1) as u32
                });
                (call, once_per_step(&step.graph.node(n).op))
            })
            .collect();
        StepWork {
            calls,
            nodes,
            micro_steps: step.micro_steps,
        }
    }
}

impl std::fmt::Debug for StepWork {
    /// A summary: the nodes themselves would fill a test's failure message.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "StepWork({} nodes, {} kinds of call, {} micro-steps)",
            self.nodes.len(),
            self.calls.len(),
            self.micro_steps
        )
    }
}

/// The path of the first `null` in `value` (`samples[3].seconds`), if any.
fn first_null(value: &serde_json::Value, path: String) -> Option<String> {
    use serde_json::Value;
    match value {
        Value::Null => Some(if path.is_empty() {
            "(file)".into()
        } else {
            path
        }),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, v)| first_null(v, format!("{path}[{i}]"))),
        Value::Object(fields) => fields.iter().find_map(|(k, v)| {
            let at = if path.is_empty() {
                k.clone()
            } else {
                format!("{path}.{k}")
            };
            first_null(v, at)
        }),
        _ => None,
    }
}

/// `seconds = a + b · work` through `(work, seconds)` points, least squares on relative error;
/// `None` unless two distinct sizes give a positive slope.
fn fit_line(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let (min, max) = points.iter().fold((f64::MAX, f64::MIN), |(lo, hi), p| {
        (lo.min(p.0), hi.max(p.0))
    });
    if max <= min * 1.01 {
        return None;
    }
    let (mut s, mut sx, mut sxx, mut st, mut sxt) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x, t) in points {
        let w = 1.0 / (t * t);
        s += w;
        sx += w * x;
        sxx += w * x * x;
        st += w * t;
        sxt += w * x * t;
    }
    let b = (s * sxt - sx * st) / (s * sxx - sx * sx);
    let a = (st - b * sx) / s;
    let (a, b) = if a < 0.0 { (0.0, sxt / sxx) } else { (a, b) };
    (b > 0.0 && b.is_finite() && a.is_finite()).then_some((a, b))
}

/// What one node costs, in the cost model's terms.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeWork {
    /// The op's name, with the operand layout for matmuls.
    pub class: String,
    /// The inputs' and outputs' innermost dimensions: what stays fixed when only the batch
    /// changes.
    pub family: String,
    /// FLOPs, or bytes read and written for ops that report no FLOPs.
    pub work: f64,
    pub flops: bool,
}

/// A node's cost class, family and work.
pub fn node_work(graph: &Graph, node: NodeId) -> NodeWork {
    let n = graph.node(node);
    let ins: Vec<_> = n.inputs.iter().map(|&i| graph.tensor(i)).collect();
    let outs: Vec<_> = n.outputs.iter().map(|&i| graph.tensor(i)).collect();
    // An op reading or writing bf16 (a bf16 run's products and fused ops) is a class of its
    // own: where the CPU has bf16 tiles its products compute on them, at several times f32's
    // rate (AMX), and elsewhere it widens as it packs. Pooled with f32's samples, a char-small
    // bf16 step on AMX was predicted at 1.9 times its measured time.
    let product = match &n.op {
        Op::MatMul(m) => Some(("matmul", m)),
        Op::HalfIo(h) => h.product().map(|m| ("half_matmul", m)),
        _ => None,
    };
    let class = match (&n.op, product) {
        (_, Some((name, m))) => format!(
            "{name}{}{}",
            if m.ta { "_ta" } else { "" },
            if m.tb { "_tb" } else { "" }
        ),
        // Rounding down and widening up are different loops.
        (Op::Cast(c), _) => format!("cast_{}", c.to),
        (op, _) => op.name().to_string(),
    };
    let last = |ts: &[&snug_graph::TensorMeta]| {
        ts.iter()
            .map(|t| t.shape.last().map_or("-".into(), |d| d.to_string()))
            .collect::<Vec<_>>()
            .join("|")
    };
    // Inputs and outputs both: the LM head ([.., 768]·[50257, 768]ᵀ) and a 768 × 768
    // projection share their inputs' inner dimensions but not their outputs'.
    let family = format!("{}>{}", last(&ins), last(&outs));
    let (work, flops) = if graph.is_view(n) {
        // Views alias their input and run no kernel (updates in place have no outputs at all).
        (0.0, false)
    } else {
        match n.op.flops(&ins, &outs) {
            0 => (
                ins.iter()
                    .chain(&outs)
                    .map(|t| t.size_bytes())
                    .sum::<usize>() as f64,
                false,
            ),
            f => (f as f64, true),
        }
    };
    NodeWork {
        class,
        family,
        work,
        flops,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(samples: &[(&str, f64, f64)]) -> MachineProfile {
        profile_with(
            &samples
                .iter()
                .map(|&(c, w, s)| (c, "", w, s))
                .collect::<Vec<_>>(),
        )
    }

    fn profile_with(samples: &[(&str, &str, f64, f64)]) -> MachineProfile {
        MachineProfile::new(
            2,
            "test".into(),
            100e9,
            10e9,
            1e-6,
            samples
                .iter()
                .map(|&(c, f, w, s)| Sample {
                    class: c.into(),
                    family: f.into(),
                    work: w,
                    seconds: s,
                })
                .collect(),
        )
    }

    #[test]
    fn a_rescaled_profile_divides_every_prediction_by_the_speed() {
        let p = profile_with(&[
            ("matmul", "a", 1e9, 0.02),
            ("matmul", "a", 16e9, 0.16),
            ("gelu", "", 1e6, 0.002),
        ])
        .with_probe(100e9);
        let fast = p.rescaled(2.0);
        for (class, family, work, flops) in [
            ("matmul", "a", 4e9, true),
            ("gelu", "", 4e6, false),
            ("never measured", "", 1e9, true),
            ("never measured", "", 1e9, false),
        ] {
            let (then, now) = (
                p.seconds(class, family, work, flops),
                fast.seconds(class, family, work, flops),
            );
            assert!((then / now - 2.0).abs() < 1e-9, "{class}: {then} vs {now}");
        }
        assert_eq!((fast.speed, fast.probe_flops), (2.0, 100e9));
        // Rescaling composes, and nonsense speeds leave the profile as it is.
        assert!((fast.rescaled(1.5).speed - 3.0).abs() < 1e-12);
        assert_eq!(p.rescaled(f64::NAN).speed, 1.0);
        assert_eq!(p.rescaled(0.0).speed, 1.0);
    }

    #[test]
    fn interpolates_between_samples_and_extrapolates_at_the_end_rates() {
        // 1 GFLOP in 20 ms (50 GFLOP/s), 16 GFLOP in 160 ms (100 GFLOP/s).
        let p = profile(&[("matmul", 1e9, 0.02), ("matmul", 16e9, 0.16)]);
        assert!((p.seconds("matmul", "", 1e9, true) - 0.02).abs() < 1e-12);
        // Halfway in log(work): the geometric mean of the two times.
        let mid = p.seconds("matmul", "", 4e9, true);
        assert!((mid - (0.02f64 * 0.16).sqrt()).abs() < 1e-9, "{mid}");
        // Beyond the largest sample: its throughput.
        assert!((p.seconds("matmul", "", 32e9, true) - 0.32).abs() < 1e-9);
        // Below the smallest: its throughput, floored at the overhead.
        assert!((p.seconds("matmul", "", 0.5e9, true) - 0.01).abs() < 1e-9);
        assert!((p.seconds("matmul", "", 1.0, true) - 1e-6).abs() < 1e-12);
    }

    #[test]
    fn repeated_calls_take_their_median_and_unknown_classes_use_the_roofline() {
        let p = profile_with(&[
            ("add", "384", 1e6, 3e-4),
            ("add", "384", 1e6, 1e-4),
            ("add", "384", 1e6, 2e-4),
        ]);
        assert!((p.seconds("add", "384", 1e6, false) - 2e-4).abs() < 1e-12);
        assert!((p.seconds("add", "768", 1e6, false) - 2e-4).abs() < 1e-12);
        // 1 GB at 10 GB/s, plus the overhead.
        assert!((p.seconds("gelu", "", 1e9, false) - (0.1 + 1e-6)).abs() < 1e-9);
        assert!((p.seconds("attention", "", 1e11, true) - (1.0 + 1e-6)).abs() < 1e-9);
    }

    #[test]
    fn a_family_with_samples_is_preferred_to_the_whole_class() {
        // Same work, different operand shapes: 2× apart.
        let p = profile_with(&[
            ("matmul", "384|1536", 1e9, 0.02),
            ("matmul", "768|3072", 1e9, 0.01),
        ]);
        assert!((p.seconds("matmul", "384|1536", 2e9, true) - 0.04).abs() < 1e-12);
        assert!((p.seconds("matmul", "768|3072", 2e9, true) - 0.02).abs() < 1e-12);
        // An unseen family: the class's median at that work.
        let t = p.seconds("matmul", "64|64", 1e9, true);
        assert!((t - 0.02).abs() < 1e-12, "{t}");
    }

    #[test]
    fn a_family_measured_at_several_sizes_gets_a_fixed_plus_linear_cost() {
        // 1.1 ms fixed + 1 ns per unit, measured at three sizes, three calls of the largest.
        let p = profile_with(&[
            ("gelu", "1536", 1e6, 0.0021),
            ("gelu", "1536", 4e6, 0.0051),
            ("gelu", "1536", 16e6, 0.0171 * 0.8),
            ("gelu", "1536", 16e6, 0.0171),
            ("gelu", "1536", 16e6, 0.0171 * 1.5),
        ]);
        let t = p.seconds("gelu", "1536", 8e6, false);
        assert!((t - 0.0091).abs() < 1e-9, "{t}");
        // Far beyond the samples the line still holds.
        let t = p.seconds("gelu", "1536", 64e6, false);
        assert!((t - 0.0651).abs() < 1e-9, "{t}");
    }

    #[test]
    fn profile_round_trips_through_json() {
        let p = profile(&[("matmul", 1e9, 0.02), ("matmul", 16e9, 0.16)]);
        let q = MachineProfile::from_json(&p.to_json()).expect("parses");
        assert_eq!(p, q);
        assert_eq!(
            q.seconds("matmul", "", 4e9, true),
            p.seconds("matmul", "", 4e9, true)
        );
    }
}
