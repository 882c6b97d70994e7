//! Chrome's trace-event format (the JSON object form that Perfetto and `chrome://tracing`
//! open): one complete (`X`) slice per op with its measured duration, nested in one slice per
//! step, and a counter (`C`) track of the bytes the plan holds at each op, by role.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::timeline::TimelineDetail;
use crate::ReportError;

const PID: u32 = 1;
const TID: u32 = 1;

/// One trace event. Times are microseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cat: Option<String>,
    /// `X` (complete slice), `C` (counter) or `M` (metadata).
    pub ph: String,
    pub ts: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    pub pid: u32,
    pub tid: u32,
    #[serde(default)]
    pub args: Value,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    #[serde(rename = "traceEvents")]
    pub trace_events: Vec<TraceEvent>,
    #[serde(rename = "displayTimeUnit")]
    pub display_time_unit: String,
}

impl Trace {
    /// The trace of profiled steps: `steps[s][p]` is the seconds op `p` of the schedule took
    /// in step `s`; `detail` names the ops and gives the bytes held at each.
    pub fn of_profile(detail: &TimelineDetail, steps: &[Vec<f64>]) -> Trace {
        let meta = |name: &str, value: &str| TraceEvent {
            name: name.into(),
            cat: None,
            ph: "M".into(),
            ts: 0.0,
            dur: None,
            pid: PID,
            tid: TID,
            args: json!({ "name": value }),
        };
        let mut events = vec![
            meta("process_name", "snug training step"),
            meta("thread_name", "ops (schedule order)"),
        ];
        let mut now = 0.0f64;
        for (s, times) in steps.iter().enumerate() {
            let start = now;
            let first_event = events.len();
            for (p, &secs) in times.iter().enumerate() {
                let dur = secs * 1e6;
                let mut held = Map::new();
                let mut total = 0usize;
                for r in &detail.by_role {
                    let b = r.bytes.get(p).copied().unwrap_or(0);
                    total += b;
                    held.insert(r.role.name().to_string(), json!(b));
                }
                events.push(TraceEvent {
                    name: "bytes held (plan)".into(),
                    cat: Some("memory".into()),
                    ph: "C".into(),
                    ts: now,
                    dur: None,
                    pid: PID,
                    tid: TID,
                    args: Value::Object(held),
                });
                events.push(TraceEvent {
                    name: detail
                        .ops
                        .get(p)
                        .cloned()
                        .unwrap_or_else(|| format!("op {p}")),
                    cat: detail.phase_at(p).map(|ph| ph.name().to_string()),
                    ph: "X".into(),
                    ts: now,
                    dur: Some(dur),
                    pid: PID,
                    tid: TID,
                    args: json!({
                        "position": p,
                        "output": detail.outputs.get(p).cloned().unwrap_or_default(),
                        "bytes_held": total,
                    }),
                });
                now += dur;
            }
            events.insert(
                first_event,
                TraceEvent {
                    name: format!("step {}", s + 1),
                    cat: Some("step".into()),
                    ph: "X".into(),
                    ts: start,
                    dur: Some(now - start),
                    pid: PID,
                    tid: TID,
                    args: json!({ "ops": times.len() }),
                },
            );
        }
        Trace {
            trace_events: events,
            display_time_unit: "ms".into(),
        }
    }

    pub fn to_json(&self) -> Result<String, ReportError> {
        serde_json::to_string(self).map_err(ReportError::Encode)
    }
}
