//! The page: every section the inputs allow, its charts inline as SVG, the figures drawn
//! embedded as JSON (`<script type="application/json" id="snug-figures">`) for the hover
//! details and for anyone who wants the numbers back, and nothing fetched from anywhere.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use snug_plan::memory_plan::human_bytes;

use crate::charts::{self, Chart};
use crate::device::DeviceTable;
use crate::fit_doc::FitDocument;
use crate::metrics::RunMetrics;
use crate::plan_doc::PlanDocument;
use crate::ReportError;

/// The version of [`Figures`]' layout.
pub const FIGURES_VERSION: u32 = 1;

/// What to report on. Every part is optional; the page says which were not given.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub title: String,
    pub plan: Option<PlanDocument>,
    pub fit: Option<FitDocument>,
    pub run: Option<RunMetrics>,
    /// The device's memory: what the size is (e.g. `--device-memory 12GiB`), and bytes.
    pub device: Option<(String, usize)>,
    /// Where the inputs came from, and anything else the reader should know.
    pub notes: Vec<String>,
    /// The run a page of `snug train --report` is of, marked in its head, so that run's next
    /// `--report` knows the page as its own (see [`is_page_of_run`]).
    pub run_id: Option<String>,
}

/// The head's mark of a run's page.
fn run_mark(run_id: &str) -> String {
    format!("<meta name=\"snug-run\" content=\"{}\">", esc(run_id))
}

/// Whether `html` is a page [`Report::html`] made of the run `run_id`: one that run's
/// `--report` may replace. Anything else at its path is someone's file.
pub fn is_page_of_run(html: &str, run_id: &str) -> bool {
    let head = html.split("</head>").next().unwrap_or("");
    html.starts_with("<!DOCTYPE html>") && head.contains(&run_mark(run_id))
}

/// The numbers a page draws: embedded in it, and what `snug report --json` prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    pub format_version: u32,
    pub title: String,
    pub plan: Option<PlanDocument>,
    pub fit: Option<FitDocument>,
    pub run: Option<RunMetrics>,
    pub device: Option<DeviceTable>,
    pub notes: Vec<String>,
}

impl Report {
    pub fn figures(&self) -> Figures {
        let device = match (&self.device, &self.plan) {
            (Some((label, bytes)), Some(plan)) => {
                Some(DeviceTable::new(label, *bytes, &plan.breakdown))
            }
            _ => None,
        };
        let mut notes = self.notes.clone();
        if self.device.is_some() && self.plan.is_none() {
            notes.push("the device table needs a plan".into());
        }
        Figures {
            format_version: FIGURES_VERSION,
            title: self.title.clone(),
            plan: self.plan.clone(),
            fit: self.fit.clone(),
            run: self.run.clone(),
            device,
            notes,
        }
    }

    /// The whole page.
    pub fn html(&self) -> Result<String, ReportError> {
        let figures = self.figures();
        let mut body = String::new();
        if let Some(plan) = &figures.plan {
            plan_sections(&mut body, plan)?;
        } else {
            missing(
                &mut body,
                "Memory timeline",
                "no plan given (--plan-json FILE, --run DIR with a checkpoint, or model flags)",
            );
        }
        if let Some(fit) = &figures.fit {
            fit_section(&mut body, fit)?;
        } else {
            missing(
                &mut body,
                "fit's candidates",
                "no fit table given (--fit-json FILE from `snug fit --json`)",
            );
        }
        if let Some(run) = &figures.run {
            run_section(&mut body, run)?;
        } else {
            missing(
                &mut body,
                "Run",
                "no run given (--run DIR with a metrics.jsonl)",
            );
        }
        if let Some(device) = &figures.device {
            device_section(&mut body, device);
        } else {
            missing(
                &mut body,
                "Device memory",
                "no device memory given (--device-memory SIZE) or no plan",
            );
        }
        let json = serde_json::to_string(&figures).map_err(ReportError::Encode)?;
        // Inside <script>, only `</` could end the element early; `<\/` is the same JSON.
        let json = json.replace("</", "<\\/");
        let mut notes = String::new();
        if !figures.notes.is_empty() {
            notes.push_str("<ul class=\"notes\">");
            for n in &figures.notes {
                let _ = write!(notes, "<li>{}</li>", esc(n));
            }
            notes.push_str("</ul>");
        }
        Ok(format!(
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
             <meta name=\"viewport\" content=\"width=device-width\">{mark}\
             <title>{title}</title><style>{STYLE}</style></head>\n<body>\
             <h1>{title}</h1>{notes}{body}\
             <script type=\"application/json\" id=\"snug-figures\">{json}</script>\
             <script>{SCRIPT}</script></body></html>\n",
            title = esc(&figures.title),
            mark = self.run_id.as_deref().map(run_mark).unwrap_or_default(),
        ))
    }
}

const STYLE: &str = "body{font-family:sans-serif;margin:24px;color:#222;max-width:1240px}\
h1{font-size:24px}h2{font-size:19px;margin-top:32px;border-bottom:1px solid #ccc}\
table{border-collapse:collapse;margin:8px 0}td,th{padding:3px 10px;border-bottom:1px solid #e4e4e4;text-align:left}\
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}tr.grey td{color:#999}tr.chosen td{font-weight:bold}\
.chart{position:relative}.chart svg{max-width:100%;height:auto}.grid{display:grid;grid-template-columns:1fr 1fr;gap:8px}\
.missing{color:#777;font-style:italic}.notes li{color:#8a4b00}\
#timeline-tip{position:absolute;display:none;background:#fffff0;border:1px solid #888;padding:6px;\
font:12px monospace;white-space:pre;pointer-events:none}";

/// Hover details on the timeline: the op at the pointer's position and the bytes each role
/// holds there, read from the embedded figures.
const SCRIPT: &str = r#"(function(){
var f=JSON.parse(document.getElementById('snug-figures').textContent);
var el=document.getElementById('timeline-chart'),tip=document.getElementById('timeline-tip');
if(!el||!f.plan)return;var d=f.plan.timeline_detail,n=d.ops.length;
function fmt(b){var u=['B','KiB','MiB','GiB','TiB'],i=0;while(b>=1024&&i<4){b/=1024;i++;}return(i?b.toFixed(2):b)+' '+u[i];}
function phase(p){for(var i=0;i<d.phases.length;i++){var s=d.phases[i];if(s.first<=p&&p<=s.last)return s.phase;}return'';}
el.addEventListener('mousemove',function(e){var r=el.querySelector('svg').getBoundingClientRect();
var x=(e.clientX-r.left)*(+el.dataset.width)/r.width,p=Math.floor((x-el.dataset.x0)/(el.dataset.x1-el.dataset.x0)*n);
if(p<0||p>=n){tip.style.display='none';return;}
var t='#'+p+' '+d.ops[p]+' ('+phase(p)+')\n  writes '+d.outputs[p]+'\n',s=0;
d.by_role.forEach(function(r){s+=r.bytes[p];t+=r.role+': '+fmt(r.bytes[p])+'\n';});
tip.textContent=t+'total: '+fmt(s);tip.style.display='block';
tip.style.left=(e.clientX-el.getBoundingClientRect().left+14)+'px';tip.style.top=(e.clientY-el.getBoundingClientRect().top+14)+'px';});
el.addEventListener('mouseleave',function(){tip.style.display='none';});})();"#;

/// Text for HTML.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// An SVG for inline use: HTML needs no namespace declaration, and the page names no address.
fn inline(chart: &Chart) -> String {
    chart
        .svg
        .replace(" xmlns=\"http://www.w3.org/2000/svg\"", "")
        .replace(" xmlns:xlink=\"http://www.w3.org/1999/xlink\"", "")
}

fn missing(out: &mut String, title: &str, why: &str) {
    let _ = write!(
        out,
        "<h2>{}</h2><p class=\"missing\">{}</p>",
        esc(title),
        esc(why)
    );
}

/// A table cell for a byte count: readable, with the exact figure in `data-bytes`.
fn bytes_cell(field: &str, bytes: usize) -> String {
    format!(
        "<td class=\"n\" data-field=\"{}\" data-bytes=\"{bytes}\" title=\"{bytes} bytes\">{}</td>",
        esc(field),
        human_bytes(bytes)
    )
}

const TIMELINE_SIZE: (u32, u32) = (1200, 540);

fn plan_sections(out: &mut String, plan: &PlanDocument) -> Result<(), ReportError> {
    out.push_str("<h2>Planned step</h2><table id=\"plan-summary\">");
    let rows = [
        ("peak_bytes", "planned peak", plan.peak_bytes),
        (
            "persistent_bytes",
            "persistent buffers",
            plan.persistent_bytes,
        ),
        ("arena_bytes", "arena", plan.arena_bytes),
        (
            "lower_bound_bytes",
            "arena lower bound (most bytes live at once)",
            plan.lower_bound_bytes,
        ),
    ];
    for (field, label, bytes) in rows {
        let _ = write!(
            out,
            "<tr><th>{}</th>{}</tr>",
            esc(label),
            bytes_cell(field, bytes)
        );
    }
    if let Some(ms) = plan.predicted_step_ms {
        let _ = write!(
            out,
            "<tr><th>predicted step time</th><td class=\"n\">{ms:.1} ms</td></tr>"
        );
    }
    out.push_str("</table>");

    let chart = charts::timeline(plan, TIMELINE_SIZE)?;
    let _ = write!(
        out,
        "<h2>Memory timeline</h2><p>Bytes held while each op of the schedule runs, stacked by \
         role; forward, backward and update shaded. The line above the bands is the planned \
         peak: the arena as placed (fixed offsets cost fragmentation) plus persistent buffers. \
         Hover for the op at a position.</p>\
         <div class=\"chart\" id=\"timeline-chart\" data-x0=\"{}\" data-x1=\"{}\" data-width=\"{}\">{}\
         <div id=\"timeline-tip\"></div></div>",
        chart.plot_x.0,
        chart.plot_x.1,
        TIMELINE_SIZE.0,
        inline(&chart)
    );
    let _ = write!(
        out,
        "<h3>At the peak: op {} <code>{}</code> writing <code>{}</code></h3>\
         <table id=\"peak-live\"><tr><th>tensor</th><th>role</th><th class=\"n\">bytes</th>\
         <th>written by (position)</th><th>last read by (position)</th></tr>",
        plan.peak.position,
        esc(&plan.peak.op),
        esc(&plan.peak.output)
    );
    for t in &plan.timeline_detail.peak_live {
        let _ = write!(
            out,
            "<tr><td><code>{}</code></td><td>{}</td>{}<td>{} ({})</td><td>{} ({})</td></tr>",
            esc(&t.name),
            t.role.name(),
            bytes_cell("live", t.bytes),
            esc(&t.producer),
            t.first,
            esc(&t.last_reader),
            t.last
        );
    }
    out.push_str(
        "</table><table id=\"breakdown\"><tr><th>at the peak</th><th class=\"n\">bytes</th></tr>",
    );
    for (name, bytes) in plan.breakdown.rows() {
        let _ = write!(out, "<tr><td>{name}</td>{}</tr>", bytes_cell(name, bytes));
    }
    out.push_str("</table>");

    if plan.passes.is_empty() {
        missing(
            out,
            "What each pass saved",
            "no pass savings in this plan (they come with `snug plan --json`)",
        );
        return Ok(());
    }
    let chart = charts::passes(&plan.passes, (1200, 380))?;
    let _ = write!(
        out,
        "<h2>What each pass saved</h2><p>Each pass, precision and remat mode applied in turn: \
         the planned peak before and after it.</p><div class=\"chart\">{}</div>\
         <table id=\"passes\"><tr><th>pass</th><th class=\"n\">before</th><th class=\"n\">after</th>\
         <th class=\"n\">saved</th></tr>",
        inline(&chart)
    );
    for p in &plan.passes {
        let saved = if p.saved_bytes >= 0 {
            human_bytes(p.saved_bytes as usize)
        } else {
            format!("−{}", human_bytes(p.saved_bytes.unsigned_abs() as usize))
        };
        let _ = write!(
            out,
            "<tr><td>{}</td>{}{}<td class=\"n\" data-field=\"saved\" data-bytes=\"{}\">{saved}</td></tr>",
            esc(&p.pass),
            bytes_cell("before", p.peak_before_bytes),
            bytes_cell("after", p.peak_after_bytes),
            p.saved_bytes
        );
    }
    out.push_str("</table>");
    Ok(())
}

fn fit_section(out: &mut String, fit: &FitDocument) -> Result<(), ReportError> {
    let chart = charts::fit(fit, (1200, 500))?;
    let _ = write!(
        out,
        "<h2>fit's candidates</h2><p>Budget {} for {} sequences of {} tokens per step; {} \
         predictions.</p><div class=\"chart\">{}</div><table id=\"fit\"><tr><th>micro</th>\
         <th>acc</th><th>remat</th><th>passes</th><th>precision</th><th class=\"n\">peak</th>\
         <th class=\"n\">predicted</th><th>verdict</th></tr>",
        human_bytes(fit.budget),
        fit.effective_batch,
        fit.block,
        if fit.calibrated {
            "calibrated"
        } else {
            "nominal"
        },
        inline(&chart)
    );
    for c in &fit.candidates {
        let class = match c.verdict.as_str() {
            "chosen" => "chosen",
            "over_budget" | "over_lower_bound" | "failed" => "grey",
            _ => "",
        };
        let verdict = match (c.verdict.as_str(), c.ratio, &c.reason) {
            ("slower", Some(r), _) => format!("fits, {r:.2}× slower"),
            ("failed", _, Some(why)) => format!("failed: {why}"),
            ("over_lower_bound", _, _) => match c.lower_bound_bytes {
                Some(b) => format!(
                    "over budget: parameters + optimizer state alone {} (not planned)",
                    human_bytes(b)
                ),
                None => "over budget (not planned)".into(),
            },
            (v, _, _) => v.replace('_', " "),
        };
        let _ = write!(
            out,
            "<tr class=\"{class}\"><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td>\
             <td>{}</td><td>{}</td>{}<td class=\"n\">{}</td><td>{}</td></tr>",
            c.config.micro_batch,
            c.config.accumulation,
            esc(&c.config.remat),
            esc(&c.config.passes.join(",")),
            esc(&c.config.precision),
            c.peak_bytes.map_or_else(
                || "<td class=\"n\">-</td>".to_string(),
                |b| bytes_cell("peak", b)
            ),
            c.predicted_seconds
                .map_or("-".to_string(), |s| format!("{:.1} ms", s * 1e3)),
            esc(&verdict)
        );
    }
    out.push_str("</table>");
    Ok(())
}

fn run_section(out: &mut String, run: &RunMetrics) -> Result<(), ReportError> {
    out.push_str("<h2>Run</h2>");
    if !run.skipped.is_empty() {
        out.push_str("<ul class=\"notes\" id=\"skipped\">");
        for s in &run.skipped {
            let _ = write!(
                out,
                "<li data-line=\"{}\">metrics.jsonl line {} skipped: {}</li>",
                s.line,
                s.line,
                esc(&s.reason)
            );
        }
        out.push_str("</ul>");
    }
    let _ = write!(
        out,
        "<p id=\"run-summary\" data-steps=\"{}\" data-evals=\"{}\">{} steps, {} evaluations, {} \
         out-of-memory recoveries.</p><div class=\"grid\">",
        run.steps.len(),
        run.evals.len(),
        run.steps.len(),
        run.evals.len(),
        run.recoveries.len()
    );
    for chart in charts::run(run, (600, 330))? {
        let _ = write!(out, "<div class=\"chart\">{}</div>", inline(&chart));
    }
    out.push_str("</div>");
    if !run.recoveries.is_empty() {
        out.push_str("<table id=\"recoveries\"><tr><th>step</th><th class=\"n\">peak before</th><th class=\"n\">peak after</th></tr>");
        for r in &run.recoveries {
            let _ = write!(
                out,
                "<tr><td>{}</td>{}{}</tr>",
                r.step,
                bytes_cell("from", r.from_peak_bytes),
                bytes_cell("to", r.to_peak_bytes)
            );
        }
        out.push_str("</table>");
    }
    Ok(())
}

fn device_section(out: &mut String, d: &DeviceTable) {
    let _ = write!(
        out,
        "<h2>Device memory: {} ({})</h2><table id=\"device\" data-device-bytes=\"{}\">\
         <tr><th>component</th><th class=\"n\">bytes</th><th class=\"n\">share</th></tr>",
        esc(&d.device),
        human_bytes(d.device_bytes),
        d.device_bytes
    );
    for r in &d.rows {
        let _ = write!(
            out,
            "<tr><td>{}</td>{}<td class=\"n\">{:.1}%</td></tr>",
            esc(&r.component),
            bytes_cell(&r.component, r.bytes),
            100.0 * r.share
        );
    }
    let share = |b: f64| {
        if d.device_bytes == 0 {
            0.0
        } else {
            100.0 * b / d.device_bytes as f64
        }
    };
    let _ = write!(
        out,
        "<tr class=\"chosen\"><td>planned peak</td>{}<td class=\"n\">{:.1}%</td></tr>",
        bytes_cell("peak", d.peak_bytes),
        share(d.peak_bytes as f64)
    );
    let left = if d.left_bytes >= 0 {
        format!("left: {}", human_bytes(d.left_bytes as usize))
    } else {
        format!(
            "over by {}: this step does not fit",
            human_bytes(d.left_bytes.unsigned_abs() as usize)
        )
    };
    let _ = write!(
        out,
        "<tr><td>{left}</td><td class=\"n\" data-field=\"left\" data-bytes=\"{}\">{}</td>\
         <td class=\"n\">{:.1}%</td></tr></table>",
        d.left_bytes,
        human_bytes(d.left_bytes.unsigned_abs() as usize),
        share(d.left_bytes as f64)
    );
}
