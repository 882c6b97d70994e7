//! The report's figures against the plan they come from, the page's self-containment, the
//! plan document's version check, and the trace's schema.

use std::path::Path;

use snug_graph::ops::AdamW;
use snug_graph::{OptimizerSpec, Role, StepGraph, Target};
use snug_nn::GptConfig;
use snug_plan::{plan, MemoryPlan, PlanOptions};
use snug_report::{
    Figures, FitDocument, PassSaving, Phase, PlanDocument, Report, ReportError, RunMetrics, Trace,
    PLAN_FORMAT_VERSION,
};

/// The tiny GPT's training step with AdamW, and its plan.
fn tiny_step() -> (StepGraph, MemoryPlan) {
    let model = GptConfig::preset("tiny").unwrap();
    let g = model.build(2, 32, Target::default()).unwrap();
    let step = StepGraph::build(g.graph, g.loss, OptimizerSpec::AdamW(AdamW::default())).unwrap();
    let p = plan(&step, &PlanOptions::default()).unwrap();
    (step, p)
}

fn tiny_doc() -> (StepGraph, MemoryPlan, PlanDocument) {
    let (step, p) = tiny_step();
    let doc = PlanDocument::from_plan(&p, &step.graph, step.forward_nodes);
    (step, p, doc)
}

#[test]
fn the_roles_add_up_to_the_plans_timeline_at_every_position() {
    let (step, p, doc) = tiny_doc();
    let d = &doc.timeline_detail;
    assert_eq!(d.len(), p.schedule.len());
    for pos in 0..d.len() {
        assert_eq!(d.total_at(pos), p.timeline[pos], "position {pos}");
    }
    // Persistent roles hold their buffers' bytes everywhere.
    let params: usize = p
        .persistent
        .iter()
        .filter(|b| b.role == Role::Parameter)
        .map(|b| b.size)
        .sum();
    let series = d
        .by_role
        .iter()
        .find(|s| s.role == Role::Parameter)
        .unwrap();
    assert!(series.bytes.iter().all(|&b| b == params));
    // The most held at once is the persistent buffers plus the arena's lower bound.
    let most = (0..d.len()).map(|i| d.total_at(i)).max().unwrap();
    assert_eq!(most, p.persistent_bytes + p.lower_bound_bytes);
    // Phases cover the schedule in order; the forward pass comes first and ends where the
    // graph's forward nodes do.
    assert_eq!(d.phases[0].phase, Phase::Forward);
    assert_eq!(d.phases[0].first, 0);
    let mut next = 0;
    for s in &d.phases {
        assert_eq!(s.first, next);
        next = s.last + 1;
    }
    assert_eq!(next, d.len());
    let forward = d
        .phases
        .iter()
        .filter(|s| s.phase == Phase::Forward)
        .map(|s| s.last - s.first + 1)
        .sum::<usize>();
    assert_eq!(forward, step.forward_nodes);
    // Every AdamW update is in the update phase.
    let updates = (0..d.len()).filter(|&i| d.ops[i] == "adamw").count();
    assert_eq!(updates, step.params.len());
    assert!((0..d.len())
        .filter(|&i| d.ops[i] == "adamw")
        .all(|i| d.phase_at(i) == Some(Phase::Update)));
    // The tensors live at the peak are the plan's own largest there.
    let live: Vec<(String, usize)> = d
        .peak_live
        .iter()
        .map(|t| (t.name.clone(), t.bytes))
        .collect();
    let expect: Vec<(String, usize)> = p
        .peak
        .largest_live
        .iter()
        .map(|(n, _, b)| (n.clone(), *b))
        .collect();
    assert_eq!(live, expect);
    for t in &d.peak_live {
        assert!(t.first <= p.peak_position && p.peak_position <= t.last);
        assert_eq!(t.producer, d.ops[t.first]);
    }
}

#[test]
fn a_plan_document_round_trips_and_another_version_is_refused_by_name() {
    let (_, _, doc) = tiny_doc();
    let text = serde_json::to_string(&doc).unwrap();
    assert_eq!(PlanDocument::from_json(&text).unwrap(), doc);

    let mut value: serde_json::Value = serde_json::from_str(&text).unwrap();
    value["format_version"] = serde_json::json!(PLAN_FORMAT_VERSION + 1);
    match PlanDocument::from_json(&value.to_string()) {
        Err(ReportError::PlanVersion { found, expected }) => {
            assert_eq!(found, Some(u64::from(PLAN_FORMAT_VERSION) + 1));
            assert_eq!(expected, PLAN_FORMAT_VERSION);
        }
        other => panic!("expected a version error, got {other:?}"),
    }
    value.as_object_mut().unwrap().remove("format_version");
    let err = PlanDocument::from_json(&value.to_string()).unwrap_err();
    assert!(
        matches!(err, ReportError::PlanVersion { found: None, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("format_version"), "{err}");

    // A timeline that disagrees with its roles is refused, not drawn.
    let mut value: serde_json::Value = serde_json::from_str(&text).unwrap();
    value["timeline"][3] = serde_json::json!(1);
    assert!(matches!(
        PlanDocument::from_json(&value.to_string()),
        Err(ReportError::PlanInconsistent(_))
    ));
}

const FIT: &str = r#"{"budget":1000000,"effective_batch":8,"block":32,"calibrated":false,"machine_speed":1.0,
"candidates":[
 {"config":{"micro_batch":8,"accumulation":1,"remat":"none","passes":["fused-ce","inplace"],"precision":"f32"},"peak_bytes":1500000,"predicted_seconds":0.010,"verdict":"over_budget"},
 {"config":{"micro_batch":4,"accumulation":2,"remat":"none","passes":["fused-ce","inplace"],"precision":"f32"},"peak_bytes":900000,"predicted_seconds":0.012,"verdict":"chosen"},
 {"config":{"micro_batch":2,"accumulation":4,"remat":"block","passes":["fused-ce","inplace"],"precision":"f32"},"peak_bytes":600000,"predicted_seconds":0.018,"verdict":"slower","ratio":1.5}],
"chosen":1,"search_seconds":0.01}"#;

fn metrics_text(steps: u64, truncated: bool) -> String {
    let mut s = String::new();
    for i in 1..=steps {
        s += &format!(
            "{{\"kind\":\"step\",\"step\":{i},\"loss\":{},\"lr\":0.001,\"grad_norm\":1.0,\"loss_scale\":null,\"skipped\":false,\"ms\":5.0,\"tokens_per_s\":{},\"tokens_seen\":{},\"active_bytes\":{},\"peak_bytes\":{},\"cache_bytes\":0,\"rss_bytes\":{}}}\n",
            4.0 - i as f64 * 0.1,
            1000 + i,
            64 * i,
            100_000 + i,
            200_000 + i,
            300_000 + i
        );
        if i % 5 == 0 {
            s += &format!(
                "{{\"kind\":\"eval\",\"step\":{i},\"train_loss\":{},\"val_loss\":{},\"ms\":1.0}}\n",
                3.0 - i as f64 * 0.05,
                3.1 - i as f64 * 0.05
            );
        }
    }
    if truncated {
        s += "{\"kind\":\"step\",\"step\":99,\"loss\":1.0,\"lr\":0.0";
    }
    s
}

/// `data-field`/`data-bytes` pairs of a table, read back from the page.
fn data_bytes(html: &str, table_id: &str) -> Vec<(String, i64)> {
    let start = html.find(&format!("<table id=\"{table_id}\"")).unwrap();
    let end = start + html[start..].find("</table>").unwrap();
    let mut out = Vec::new();
    let mut rest = &html[start..end];
    while let Some(i) = rest.find("data-field=\"") {
        rest = &rest[i + 12..];
        let field = rest[..rest.find('"').unwrap()].to_string();
        let j = rest.find("data-bytes=\"").unwrap() + 12;
        rest = &rest[j..];
        let bytes = rest[..rest.find('"').unwrap()].parse().unwrap();
        out.push((field, bytes));
    }
    out
}

fn embedded_figures(html: &str) -> Figures {
    let open = "<script type=\"application/json\" id=\"snug-figures\">";
    let start = html.find(open).unwrap() + open.len();
    let end = start + html[start..].find("</script>").unwrap();
    serde_json::from_str(&html[start..end]).unwrap()
}

#[test]
fn the_page_shows_the_plans_and_the_runs_figures_and_references_nothing_outside() {
    let (_, p, mut doc) = tiny_doc();
    doc.passes = vec![
        PassSaving {
            pass: "fused-ce".into(),
            peak_before_bytes: 9_000_000,
            peak_after_bytes: 7_000_000,
            saved_bytes: 2_000_000,
        },
        PassSaving {
            pass: "inplace".into(),
            peak_before_bytes: 7_000_000,
            peak_after_bytes: p.peak_bytes(),
            saved_bytes: 7_000_000 - p.peak_bytes() as i64,
        },
    ];
    let fit = FitDocument::from_json(FIT).unwrap();
    let run = RunMetrics::parse(&metrics_text(20, true), Path::new("metrics.jsonl")).unwrap();
    let report = Report {
        title: "tiny".into(),
        plan: Some(doc.clone()),
        fit: Some(fit.clone()),
        run: Some(run),
        device: Some(("--device-memory 12MiB".into(), 12 << 20)),
        notes: vec![],
        run_id: None,
    };
    let html = report.html().unwrap();
    for outside in ["http:", "https:", "src=", "href=", "@import", "url("] {
        assert!(!html.contains(outside), "the page contains `{outside}`");
    }
    let figures = embedded_figures(&html);
    assert_eq!(figures, report.figures());
    assert_eq!(figures.plan.as_ref(), Some(&doc));
    assert_eq!(figures.fit.as_ref(), Some(&fit));
    let run = figures.run.unwrap();
    assert_eq!(run.steps.len(), 20);
    assert_eq!(run.evals.len(), 4);
    assert_eq!(run.steps[19].peak_bytes, 200_020);
    assert_eq!(run.steps[19].rss_bytes, Some(300_020));
    assert_eq!(run.evals[3].val_loss, (3.1f64 - 1.0) as f32);
    assert_eq!(run.skipped.len(), 1);
    assert_eq!(run.skipped[0].line, 25);
    assert!(html.contains("metrics.jsonl line 25 skipped"));
    assert!(html.contains("data-steps=\"20\""));

    // The visible tables carry the plan's exact bytes.
    let summary = data_bytes(&html, "plan-summary");
    assert_eq!(
        summary,
        vec![
            ("peak_bytes".to_string(), p.peak_bytes() as i64),
            ("persistent_bytes".to_string(), p.persistent_bytes as i64),
            ("arena_bytes".to_string(), p.arena_bytes as i64),
            ("lower_bound_bytes".to_string(), p.lower_bound_bytes as i64),
        ]
    );
    let breakdown = data_bytes(&html, "breakdown");
    let expect: Vec<(String, i64)> = p
        .breakdown
        .rows()
        .iter()
        .map(|(n, b)| (n.to_string(), *b as i64))
        .collect();
    assert_eq!(breakdown, expect);
    // The device table: each component, the peak, and what is left of 12 MiB.
    let device = data_bytes(&html, "device");
    let components: i64 = p.breakdown.rows().iter().map(|r| r.1 as i64).sum();
    assert_eq!(
        device.iter().rev().nth(1),
        Some(&("peak".to_string(), p.peak_bytes() as i64))
    );
    assert_eq!(
        device.last(),
        Some(&("left".to_string(), (12 << 20) - p.peak_bytes() as i64))
    );
    assert_eq!(
        device[..device.len() - 2].iter().map(|r| r.1).sum::<i64>(),
        components
    );
    // Charts: inline SVG, drawn by plotters (its text and paths), one per section.
    assert_eq!(html.matches("<svg").count(), 1 + 1 + 1 + 4);
    let passes = data_bytes(&html, "passes");
    assert_eq!(
        passes[..3],
        [
            ("before".to_string(), 9_000_000),
            ("after".to_string(), 7_000_000),
            ("saved".to_string(), 2_000_000)
        ]
    );
    let fit_rows = data_bytes(&html, "fit");
    assert_eq!(
        fit_rows.iter().map(|r| r.1).collect::<Vec<_>>(),
        vec![1_500_000, 900_000, 600_000]
    );
}

#[test]
fn one_pass_draws_one_pair_of_bars() {
    let (_, _, doc) = tiny_doc();
    let chart = snug_report::charts::passes(
        &[PassSaving {
            pass: "inplace".into(),
            peak_before_bytes: doc.peak_bytes + 4096,
            peak_after_bytes: doc.peak_bytes,
            saved_bytes: 4096,
        }],
        (600, 300),
    )
    .unwrap();
    assert!(chart.svg.contains("\ninplace\n"), "{}", chart.svg);
    // Two bars side by side (the legend's swatches are 14 pixels wide).
    let bars: Vec<&str> = chart
        .svg
        .lines()
        .filter(|l| l.starts_with("<rect") && (l.contains("#969696") || l.contains("#1F77B4")))
        .filter(|l| !l.contains("width=\"14\""))
        .collect();
    assert_eq!(bars.len(), 2, "{bars:?}");
}

#[test]
fn sections_without_inputs_say_what_is_missing() {
    let html = Report {
        title: "nothing".into(),
        ..Default::default()
    }
    .html()
    .unwrap();
    assert!(html.contains("no plan given"));
    assert!(html.contains("no fit table given"));
    assert!(html.contains("no run given"));
    assert!(!html.contains("<svg"));
}

#[test]
fn the_trace_has_the_trace_event_fields_and_the_measured_times() {
    let (_, p, doc) = tiny_doc();
    let n = p.schedule.len();
    let steps: Vec<Vec<f64>> = (0..2)
        .map(|s| (0..n).map(|i| 1e-6 * (1 + i + s) as f64).collect())
        .collect();
    let text = Trace::of_profile(&doc.timeline_detail, &steps)
        .to_json()
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    for e in events {
        for field in ["name", "ph", "ts", "pid", "tid"] {
            assert!(e.get(field).is_some(), "event without `{field}`: {e}");
        }
        match e["ph"].as_str().unwrap() {
            "X" => assert!(e["dur"].as_f64().unwrap() >= 0.0),
            "C" => assert!(e["args"].as_object().unwrap().values().all(|v| v.is_u64())),
            "M" => {}
            other => panic!("unexpected phase {other}"),
        }
    }
    let ops: Vec<&serde_json::Value> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] != "step")
        .collect();
    assert_eq!(ops.len(), 2 * n);
    // Durations are the measured seconds in microseconds; ops follow each other.
    for (k, e) in ops.iter().enumerate() {
        let (s, i) = (k / n, k % n);
        assert_eq!(e["name"], doc.timeline_detail.ops[i]);
        let dur = e["dur"].as_f64().unwrap();
        assert!((dur - (1 + i + s) as f64).abs() < 1e-9, "{dur}");
        if k > 0 {
            let prev = ops[k - 1];
            let end = prev["ts"].as_f64().unwrap() + prev["dur"].as_f64().unwrap();
            assert!((e["ts"].as_f64().unwrap() - end).abs() < 1e-6);
        }
    }
    // The counter track's bytes are the plan's at each op.
    let counters: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "C").collect();
    assert_eq!(counters.len(), 2 * n);
    for (k, c) in counters.iter().enumerate() {
        let held: u64 = c["args"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum();
        assert_eq!(held as usize, p.timeline[k % n]);
    }
    let step_slices = events.iter().filter(|e| e["cat"] == "step").count();
    assert_eq!(step_slices, 2);
}
