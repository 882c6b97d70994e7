//! The report's charts, drawn by `plotters` into SVG strings. Byte axes are scaled to one unit
//! (KiB, MiB or GiB) chosen from the largest value drawn.

use std::error::Error;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use snug_graph::Role;

use crate::fit_doc::FitDocument;
use crate::metrics::RunMetrics;
use crate::plan_doc::{PassSaving, PlanDocument};
use crate::timeline::Phase;
use crate::ReportError;

type Drawn<T> = Result<T, Box<dyn Error>>;

/// One chart: its SVG and where its plotting area lies, in pixels, for hover lookups.
#[derive(Debug, Clone)]
pub struct Chart {
    pub svg: String,
    pub plot_x: (i32, i32),
    pub plot_y: (i32, i32),
}

const FONT: &str = "sans-serif";

/// A byte count's display unit: the divisor and its name.
pub fn byte_unit(max_bytes: f64) -> (f64, &'static str) {
    const UNITS: [(f64, &str); 4] = [
        (1_073_741_824.0, "GiB"),
        (1_048_576.0, "MiB"),
        (1024.0, "KiB"),
        (1.0, "bytes"),
    ];
    UNITS
        .into_iter()
        .find(|(div, _)| max_bytes >= 2.0 * div)
        .unwrap_or((1.0, "bytes"))
}

pub fn role_color(role: Role) -> RGBColor {
    match role {
        Role::Parameter => RGBColor(31, 119, 180),
        Role::Gradient => RGBColor(255, 127, 14),
        Role::OptimizerState => RGBColor(44, 160, 44),
        Role::GradAccumulator => RGBColor(148, 103, 189),
        Role::Activation => RGBColor(214, 39, 40),
        Role::Temporary => RGBColor(140, 86, 75),
        Role::Input => RGBColor(227, 119, 194),
        Role::KvCache => RGBColor(188, 189, 34),
    }
}

fn phase_color(phase: Phase) -> RGBAColor {
    match phase {
        Phase::Forward => RGBColor(120, 170, 255).mix(0.18),
        Phase::Backward => RGBColor(255, 170, 90).mix(0.18),
        Phase::Update => RGBColor(90, 200, 120).mix(0.30),
    }
}

const GREY: RGBColor = RGBColor(170, 170, 170);

fn render(
    name: &'static str,
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<SVGBackend<'_>, Shift>) -> Drawn<(i32, i32, i32, i32)>,
) -> Result<Chart, ReportError> {
    let mut svg = String::new();
    let area = {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        let drawn = root
            .fill(&WHITE)
            .map_err(Box::<dyn Error>::from)
            .and_then(|()| draw(&root))
            .and_then(|a| root.present().map(|()| a).map_err(Box::<dyn Error>::from));
        drawn.map_err(|e| ReportError::Chart {
            chart: name,
            detail: e.to_string(),
        })?
    };
    Ok(Chart {
        svg,
        plot_x: (area.0, area.1),
        plot_y: (area.2, area.3),
    })
}

/// The step's memory timeline: bytes held at each schedule position stacked by role, the
/// phases shaded, the planned peak (arena with its fragmentation) as a line and the position
/// of the peak marked with its op.
pub fn timeline(plan: &PlanDocument, size: (u32, u32)) -> Result<Chart, ReportError> {
    render("timeline", size, |root| {
        let d = &plan.timeline_detail;
        let n = d.len().max(1);
        let most = plan
            .timeline
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(plan.peak_bytes) as f64;
        let (div, unit) = byte_unit(most);
        // Headroom above the bands for the legend and the peak's label.
        let top = most / div * 1.9;
        let mut chart = ChartBuilder::on(root)
            .caption(
                "Memory held while each op runs, by role",
                (FONT, 22).into_font(),
            )
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(72)
            .build_cartesian_2d(0f64..n as f64, 0f64..top.max(1e-9))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc("schedule position (one op each)")
            .y_desc(unit)
            .label_style((FONT, 14))
            .draw()?;
        for phase in [Phase::Forward, Phase::Backward, Phase::Update] {
            let spans: Vec<_> = d.phases.iter().filter(|s| s.phase == phase).collect();
            if spans.is_empty() {
                continue;
            }
            let color = phase_color(phase);
            chart
                .draw_series(spans.into_iter().map(|s| {
                    Rectangle::new(
                        [(s.first as f64, 0.0), ((s.last + 1) as f64, top)],
                        color.filled(),
                    )
                }))?
                .label(format!("{} phase", phase.name()))
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled())
                });
        }
        // Each role's band is the area under the running sum up to it; drawing the largest
        // sum first leaves every band visible.
        let mut sum = vec![0f64; d.len()];
        let mut layers = Vec::new();
        for s in &d.by_role {
            for (acc, &b) in sum.iter_mut().zip(&s.bytes) {
                *acc += b as f64 / div;
            }
            layers.push((s.role, sum.clone()));
        }
        for (role, heights) in layers.iter().rev() {
            let color = role_color(*role);
            let steps = heights
                .iter()
                .enumerate()
                .flat_map(|(p, &h)| [(p as f64, h), ((p + 1) as f64, h)]);
            chart
                .draw_series(AreaSeries::new(steps, 0.0, color.mix(0.85).filled()))?
                .label(role.name())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled())
                });
        }
        let planned = plan.peak_bytes as f64 / div;
        chart
            .draw_series(LineSeries::new(
                [(0.0, planned), (n as f64, planned)],
                BLACK.stroke_width(1),
            ))?
            .label("planned peak (arena with its fragmentation)")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 14, y)], BLACK));
        let at = plan.peak.position as f64 + 0.5;
        chart.draw_series(LineSeries::new(
            [(at, 0.0), (at, top)],
            RGBColor(200, 0, 0).stroke_width(2),
        ))?;
        let label = format!(
            "peak at op {}: {} `{}`",
            plan.peak.position, plan.peak.op, plan.peak.output
        );
        // The label sits just above the planned peak, on the side of the marker with more
        // room; the legend takes the top right.
        let (x, anchor) = if at < n as f64 * 0.5 {
            (at + n as f64 * 0.005, Pos::new(HPos::Left, VPos::Bottom))
        } else {
            (at - n as f64 * 0.005, Pos::new(HPos::Right, VPos::Bottom))
        };
        chart.draw_series(std::iter::once(Text::new(
            label,
            (x, planned + top * 0.01),
            (FONT, 15)
                .into_font()
                .color(&RGBColor(160, 0, 0))
                .pos(anchor),
        )))?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .margin(8)
            .label_font((FONT, 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .draw()?;
        let (xs, ys) = chart.plotting_area().get_pixel_range();
        Ok((xs.start, xs.end, ys.start, ys.end))
    })
}

/// Each pass's planned peak before and after it, cumulatively in the order applied: a pair
/// of bars per pass, named above them.
pub fn passes(passes: &[PassSaving], size: (u32, u32)) -> Result<Chart, ReportError> {
    render("passes", size, |root| {
        let k = passes.len().max(1) as f64;
        let most = passes
            .iter()
            .map(|p| p.peak_before_bytes.max(p.peak_after_bytes))
            .max()
            .unwrap_or(0) as f64;
        let (div, unit) = byte_unit(most);
        let top = (most / div * 1.25).max(1e-9);
        let mut chart = ChartBuilder::on(root)
            .caption(
                "Planned peak before → after each pass",
                (FONT, 20).into_font(),
            )
            .margin(12)
            .x_label_area_size(12)
            .y_label_area_size(72)
            .build_cartesian_2d(0f64..k, 0f64..top)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_desc(unit)
            .label_style((FONT, 14))
            .draw()?;
        let before = RGBColor(150, 150, 150);
        let after = RGBColor(31, 119, 180);
        let bar = |i: usize, left: bool, bytes: usize, color: RGBColor| {
            let x = i as f64 + if left { 0.1 } else { 0.5 };
            Rectangle::new([(x, 0.0), (x + 0.4, bytes as f64 / div)], color.filled())
        };
        chart
            .draw_series(
                passes
                    .iter()
                    .enumerate()
                    .map(|(i, p)| bar(i, true, p.peak_before_bytes, before)),
            )?
            .label("before")
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], before.filled()));
        chart
            .draw_series(
                passes
                    .iter()
                    .enumerate()
                    .map(|(i, p)| bar(i, false, p.peak_after_bytes, after)),
            )?
            .label("after")
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], after.filled()));
        chart.draw_series(passes.iter().enumerate().map(|(i, p)| {
            let height = p.peak_before_bytes.max(p.peak_after_bytes) as f64 / div;
            Text::new(
                p.pass.clone(),
                (i as f64 + 0.5, height + top * 0.02),
                TextStyle::from((FONT, 15).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom)),
            )
        }))?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FONT, 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .draw()?;
        let (xs, ys) = chart.plotting_area().get_pixel_range();
        Ok((xs.start, xs.end, ys.start, ys.end))
    })
}

/// fit's candidates: planned peak against predicted step time, the budget as a line, the
/// chosen one marked and the ones over budget greyed. Candidates without both figures (failed
/// to compile) are left out of the chart; the table lists them.
pub fn fit(doc: &FitDocument, size: (u32, u32)) -> Result<Chart, ReportError> {
    render("fit", size, |root| {
        let points: Vec<(usize, f64, &str)> = doc
            .candidates
            .iter()
            .filter_map(|c| Some((c.peak_bytes?, c.predicted_seconds?, c.verdict.as_str())))
            .collect();
        let most = points
            .iter()
            .map(|p| p.0)
            .max()
            .unwrap_or(0)
            .max(doc.budget) as f64;
        let (div, unit) = byte_unit(most);
        let slowest = points.iter().map(|p| p.1).fold(0.0, f64::max) * 1e3;
        let mut chart = ChartBuilder::on(root)
            .caption(
                "fit's candidates: planned peak and predicted step time",
                (FONT, 20).into_font(),
            )
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(72)
            .build_cartesian_2d(
                0f64..(most / div * 1.1).max(1e-9),
                0f64..(slowest * 1.15).max(1e-9),
            )?;
        chart
            .configure_mesh()
            .x_desc(format!("planned peak ({unit})"))
            .y_desc("predicted step time (ms)")
            .label_style((FONT, 14))
            .draw()?;
        let budget = doc.budget as f64 / div;
        chart
            .draw_series(LineSeries::new(
                [(budget, 0.0), (budget, slowest * 1.15)],
                RGBColor(200, 0, 0).stroke_width(2),
            ))?
            .label("budget")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 14, y)], RGBColor(200, 0, 0)));
        let fits = RGBColor(31, 119, 180);
        let mut draw_kind =
            |keep: &dyn Fn(&str) -> bool, label: &str, color: RGBColor, radius: i32| -> Drawn<()> {
                let pts: Vec<_> = points.iter().filter(|p| keep(p.2)).collect();
                if pts.is_empty() {
                    return Ok(());
                }
                chart
                    .draw_series(pts.into_iter().map(|p| {
                        Circle::new((p.0 as f64 / div, p.1 * 1e3), radius, color.filled())
                    }))?
                    .label(label)
                    .legend(move |(x, y)| Circle::new((x + 7, y), radius, color.filled()));
                Ok(())
            };
        draw_kind(&|v| v == "over_budget", "over budget", GREY, 4)?;
        draw_kind(&|v| v == "slower", "fits", fits, 4)?;
        draw_kind(&|v| v == "chosen", "chosen", RGBColor(230, 120, 0), 8)?;
        if let Some(c) = doc.chosen() {
            if let (Some(p), Some(s)) = (c.peak_bytes, c.predicted_seconds) {
                chart.draw_series(std::iter::once(Text::new(
                    format!("chosen: {}", c.config.label()),
                    (p as f64 / div, s * 1e3),
                    TextStyle::from((FONT, 14).into_font()).pos(Pos::new(HPos::Left, VPos::Bottom)),
                )))?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FONT, 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .draw()?;
        let (xs, ys) = chart.plotting_area().get_pixel_range();
        Ok((xs.start, xs.end, ys.start, ys.end))
    })
}

/// One line of a run chart: its name, color and (step, value) points.
struct Curve<'a> {
    name: &'a str,
    color: RGBColor,
    points: Vec<(f64, f64)>,
}

fn run_chart(
    name: &'static str,
    title: &str,
    y_desc: &str,
    curves: &[Curve<'_>],
    recoveries: &[f64],
    size: (u32, u32),
) -> Result<Chart, ReportError> {
    render(name, size, |root| {
        let all = curves.iter().flat_map(|c| c.points.iter());
        let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0f64);
        for &(x, y) in all {
            x0 = x0.min(x);
            x1 = x1.max(x);
            if y.is_finite() {
                y1 = y1.max(y);
            }
        }
        if !x0.is_finite() {
            (x0, x1) = (0.0, 1.0);
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        let y1 = if y1 > 0.0 { y1 * 1.1 } else { 1.0 };
        let mut chart = ChartBuilder::on(root)
            .caption(title, (FONT, 18).into_font())
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(72)
            .build_cartesian_2d(x0..x1, 0f64..y1)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(y_desc)
            .label_style((FONT, 13))
            .draw()?;
        for c in curves {
            let color = c.color;
            let pts: Vec<_> = c
                .points
                .iter()
                .copied()
                .filter(|p| p.1.is_finite())
                .collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
                .label(c.name)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 14, y)], color.stroke_width(2))
                });
            if pts.len() <= 60 {
                chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
            }
        }
        if !recoveries.is_empty() {
            let red = RGBColor(200, 0, 0);
            chart
                .draw_series(
                    recoveries
                        .iter()
                        .map(|&s| PathElement::new([(s, 0.0), (s, y1)], red.stroke_width(2))),
                )?
                .label("out-of-memory recovery")
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], red));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FONT, 12))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .draw()?;
        let (xs, ys) = chart.plotting_area().get_pixel_range();
        Ok((xs.start, xs.end, ys.start, ys.end))
    })
}

/// A run's curves: losses, learning rate, tokens/s, and memory per step, recoveries marked.
pub fn run(metrics: &RunMetrics, size: (u32, u32)) -> Result<Vec<Chart>, ReportError> {
    let steps = &metrics.steps;
    let recoveries: Vec<f64> = metrics.recoveries.iter().map(|r| r.step as f64).collect();
    let series = |f: &dyn Fn(&crate::metrics::StepLine) -> Option<f64>| -> Vec<(f64, f64)> {
        steps
            .iter()
            .filter_map(|s| Some((s.step as f64, f(s)?)))
            .collect()
    };
    let losses = [
        Curve {
            name: "train loss (step)",
            color: RGBColor(31, 119, 180),
            points: series(&|s| Some(f64::from(s.loss))),
        },
        Curve {
            name: "train loss (eval)",
            color: RGBColor(44, 160, 44),
            points: metrics
                .evals
                .iter()
                .map(|e| (e.step as f64, f64::from(e.train_loss)))
                .collect(),
        },
        Curve {
            name: "validation loss",
            color: RGBColor(214, 39, 40),
            points: metrics
                .evals
                .iter()
                .map(|e| (e.step as f64, f64::from(e.val_loss)))
                .collect(),
        },
    ];
    let losses: Vec<Curve<'_>> = losses
        .into_iter()
        .filter(|c| !c.points.is_empty())
        .collect();
    let most = steps
        .iter()
        .map(|s| {
            s.peak_bytes
                .max(s.active_bytes)
                .max(s.rss_bytes.unwrap_or(0))
        })
        .max()
        .unwrap_or(0) as f64;
    let (div, unit) = byte_unit(most);
    let mut memory = vec![
        Curve {
            name: "active",
            color: RGBColor(31, 119, 180),
            points: series(&|s| Some(s.active_bytes as f64 / div)),
        },
        Curve {
            name: "peak",
            color: RGBColor(214, 39, 40),
            points: series(&|s| Some(s.peak_bytes as f64 / div)),
        },
    ];
    let rss = series(&|s| s.rss_bytes.map(|b| b as f64 / div));
    if !rss.is_empty() {
        memory.push(Curve {
            name: "RSS",
            color: RGBColor(120, 120, 120),
            points: rss,
        });
    }
    Ok(vec![
        run_chart("loss", "Loss", "loss", &losses, &recoveries, size)?,
        run_chart(
            "learning rate",
            "Learning rate",
            "lr",
            &[Curve {
                name: "learning rate",
                color: RGBColor(148, 103, 189),
                points: series(&|s| Some(f64::from(s.lr))),
            }],
            &recoveries,
            size,
        )?,
        run_chart(
            "tokens/s",
            "Throughput",
            "tokens/s",
            &[Curve {
                name: "tokens/s",
                color: RGBColor(44, 160, 44),
                points: series(&|s| Some(s.tokens_per_s)),
            }],
            &recoveries,
            size,
        )?,
        run_chart(
            "memory",
            "Memory per step (allocator and OS)",
            unit,
            &memory,
            &recoveries,
            size,
        )?,
    ])
}
