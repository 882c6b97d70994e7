//! Per-op time of one char-small training step (a quick look before `snug profile` exists).
use std::collections::BTreeMap;

use snug_plan::{plan, PlanOptions};
use snug_runtime::{Allocator, CpuSession, ExecCtx};
use snug_train::{trainer::compile_step, TrainConfig};

fn main() {
    let mut cfg = TrainConfig::default();
    cfg.batch = 16;
    cfg.block = 256;
    let mut model = snug_nn::GptConfig::preset("char-small").unwrap();
    model.vocab_size = 65;
    let (step, tokens, targets) = compile_step(&model, 16, 256, 2, &cfg).unwrap();
    let p = plan(&step.graph, &PlanOptions::default()).unwrap();
    let mut s = CpuSession::new(step.graph.clone(), p, Allocator::default(), 2).unwrap();
    for (slot, (_, v)) in step.params.iter().zip(model.init_parameters(0)) {
        s.write_f32(slot.param, &v).unwrap();
    }
    let ids: Vec<i32> = (0..16 * 256).map(|i| (i % 65) as i32).collect();
    s.write_i32(tokens, &ids, 65).unwrap();
    s.write_i32(targets, &ids, 65).unwrap();
    s.run(ExecCtx::default());
    let mut by_op: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    let reps = 3;
    for _ in 0..reps {
        let times = s.run_profiled(ExecCtx::default());
        for (nid, t) in p_sched(&s).into_iter().zip(times) {
            let node = &s.graph().nodes()[nid];
            let mut name = node.op.name().to_string();
            if let snug_graph::ops::Op::MatMul(m) = &node.op {
                let a = &s.graph().tensor(node.inputs[0]).shape;
                let b = &s.graph().tensor(node.inputs[1]).shape;
                name = format!("matmul ta={} tb={} {:?}x{:?}", m.ta as u8, m.tb as u8, a, b);
            }
            let e = by_op.entry(name).or_default();
            e.0 += t / reps as f64;
            e.1 += 1;
        }
    }
    let mut rows: Vec<_> = by_op.into_iter().collect();
    rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    let total: f64 = rows.iter().map(|r| r.1 .0).sum();
    println!("total {:.1} ms", total * 1e3);
    for (name, (t, n)) in rows {
        println!("{:>9.1} ms {:>5.1}%  x{:<4} {}", t * 1e3, 100.0 * t / total, n / reps, name);
    }
}

fn p_sched(s: &CpuSession) -> Vec<usize> {
    s.plan().schedule.iter().map(|n| n.index()).collect()
}
