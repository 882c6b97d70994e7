//! `snug train --dashboard`: a full-screen terminal view of the run while it trains: progress,
//! loss (and evaluations) over steps, memory held over steps against the planned peak, and the
//! run's events. Drawn on standard error's alternate screen with ratatui; the terminal is given
//! back as it was when the view is dropped, including on an error or a panic.

use std::collections::VecDeque;
use std::io::{self, Stderr};
use std::time::{Duration, Instant};

use ratatui::backend::{Backend, CrosstermBackend};
use ratatui::crossterm::{cursor, execute, terminal};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::symbols::Marker;
use ratatui::text::Line;
use ratatui::widgets::{Axis, Block, Chart, Dataset, Gauge, GraphType, List, ListItem, Paragraph};
use ratatui::{Frame, Terminal};
use snug_train::{EvalStats, StepStats};

use snug_plan::memory_plan::human_bytes;

/// Events kept in the log pane.
const LOG_LINES: usize = 64;
/// Redraws at most this often, so drawing never slows a run of fast steps.
const FRAME: Duration = Duration::from_millis(100);

/// What the view shows: everything it draws comes from here, so it can be drawn to any backend
/// (the tests draw it into a buffer and read the figures back).
#[derive(Debug, Clone, Default)]
pub struct DashboardState {
    pub title: String,
    pub total_steps: u64,
    /// The step the run started after (non-zero when resumed).
    pub start_step: u64,
    pub planned_peak_bytes: usize,
    /// `(step, loss)` of every step run.
    pub losses: Vec<(f64, f64)>,
    /// `(step, validation loss)` of every evaluation.
    pub evals: Vec<(f64, f64)>,
    /// `(step, bytes held at the step's end)`.
    pub held: Vec<(f64, f64)>,
    /// The highest measured peak of any step.
    pub measured_peak_bytes: usize,
    pub last: Option<StepStats>,
    pub log: VecDeque<String>,
}

impl DashboardState {
    pub fn step(&mut self, s: &StepStats) {
        let x = s.step as f64;
        if s.loss.is_finite() {
            self.losses.push((x, f64::from(s.loss)));
        }
        self.held.push((x, s.active_bytes as f64));
        self.measured_peak_bytes = self.measured_peak_bytes.max(s.peak_bytes);
        self.last = Some(*s);
    }

    pub fn eval(&mut self, e: &EvalStats) {
        if e.val_loss.is_finite() {
            self.evals.push((e.step as f64, f64::from(e.val_loss)));
        }
        self.say(format!(
            "eval {}: train loss {:.4}, val loss {:.4}",
            e.step, e.train_loss, e.val_loss
        ));
    }

    pub fn say(&mut self, line: String) {
        if self.log.len() == LOG_LINES {
            self.log.pop_front();
        }
        self.log.push_back(line);
    }

    fn steps_done(&self) -> u64 {
        self.last.as_ref().map_or(self.start_step, |s| s.step)
    }
}

/// Draws the whole view into `frame`.
pub fn draw(frame: &mut Frame, s: &DashboardState) {
    let [head, gauge, charts, log] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Length(1),
        Constraint::Min(8),
        Constraint::Length(8),
    ])
    .areas(frame.area());
    frame.render_widget(Paragraph::new(header(s)), head);
    let done = s.steps_done();
    let ratio = if s.total_steps == 0 {
        0.0
    } else {
        (done as f64 / s.total_steps as f64).clamp(0.0, 1.0)
    };
    frame.render_widget(
        Gauge::default()
            .gauge_style(Style::default().fg(Color::Cyan))
            .ratio(ratio)
            .label(format!("step {done}/{}", s.total_steps)),
        gauge,
    );
    let [left, right] =
        Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(charts);
    loss_chart(frame, left, s);
    memory_chart(frame, right, s);
    let items: Vec<ListItem> = s
        .log
        .iter()
        .rev()
        .take(log.height.saturating_sub(2) as usize)
        .rev()
        .map(|l| ListItem::new(l.as_str()))
        .collect();
    frame.render_widget(
        List::new(items).block(Block::bordered().title("events")),
        log,
    );
}

fn header(s: &DashboardState) -> Vec<Line<'static>> {
    let mut lines = vec![Line::from(s.title.clone())];
    let figures = match &s.last {
        Some(l) => format!(
            "loss {:.4} | lr {:.2e} | norm {} | {:.0} tok/s | {:.1} ms/step | held {} | peak {} (planned {}) | cache {}",
            l.loss,
            l.lr,
            l.grad_norm.map_or("-".into(), |n| format!("{n:.3}")),
            l.tokens_per_s,
            l.ms,
            human_bytes(l.active_bytes),
            human_bytes(s.measured_peak_bytes),
            human_bytes(s.planned_peak_bytes),
            human_bytes(l.cache_bytes),
        ),
        None => format!(
            "waiting for the first step | planned peak {}",
            human_bytes(s.planned_peak_bytes)
        ),
    };
    lines.push(Line::from(figures));
    lines
}

/// The x axis over the run's steps, so the charts do not rescale as it goes.
fn step_axis(s: &DashboardState) -> Axis<'static> {
    let (lo, hi) = (
        s.start_step as f64,
        s.total_steps.max(s.start_step + 1) as f64,
    );
    Axis::default()
        .title("step")
        .bounds([lo, hi])
        .labels([format!("{lo:.0}"), format!("{hi:.0}")])
}

/// `[min, max]` of the values, widened a little so a flat series still draws.
fn bounds(values: impl Iterator<Item = f64>) -> [f64; 2] {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() {
        return [0.0, 1.0];
    }
    let pad = ((hi - lo) * 0.05).max(hi.abs() * 1e-3).max(1e-6);
    [lo - pad, hi + pad]
}

fn loss_chart(frame: &mut Frame, area: Rect, s: &DashboardState) {
    let [lo, hi] = bounds(s.losses.iter().chain(&s.evals).map(|p| p.1));
    let mut sets = vec![Dataset::default()
        .name("train")
        .marker(Marker::Braille)
        .graph_type(GraphType::Line)
        .style(Style::default().fg(Color::Cyan))
        .data(&s.losses)];
    if !s.evals.is_empty() {
        sets.push(
            Dataset::default()
                .name("val")
                .marker(Marker::Dot)
                .graph_type(GraphType::Scatter)
                .style(Style::default().fg(Color::Yellow))
                .data(&s.evals),
        );
    }
    let chart = Chart::new(sets)
        .block(Block::bordered().title("loss"))
        .x_axis(step_axis(s))
        .y_axis(
            Axis::default()
                .bounds([lo, hi])
                .labels([format!("{lo:.3}"), format!("{hi:.3}")]),
        );
    frame.render_widget(chart, area);
}

fn memory_chart(frame: &mut Frame, area: Rect, s: &DashboardState) {
    let planned = s.planned_peak_bytes as f64;
    let x = [
        s.start_step as f64,
        s.total_steps.max(s.start_step + 1) as f64,
    ];
    let planned_line = [(x[0], planned), (x[1], planned)];
    let measured = s.measured_peak_bytes as f64;
    let measured_line = [(x[0], measured), (x[1], measured)];
    let top = planned.max(measured).max(1.0) * 1.1;
    let mut sets = vec![
        Dataset::default()
            .name("planned peak")
            .marker(Marker::Braille)
            .graph_type(GraphType::Line)
            .style(Style::default().fg(Color::Red))
            .data(&planned_line),
        Dataset::default()
            .name("held after step")
            .marker(Marker::Braille)
            .graph_type(GraphType::Line)
            .style(Style::default().fg(Color::Green))
            .data(&s.held),
    ];
    if s.measured_peak_bytes > 0 {
        sets.push(
            Dataset::default()
                .name("measured peak")
                .marker(Marker::Dot)
                .graph_type(GraphType::Line)
                .style(Style::default().fg(Color::Magenta))
                .data(&measured_line),
        );
    }
    let chart = Chart::new(sets)
        .block(Block::bordered().title("memory"))
        .x_axis(step_axis(s))
        .y_axis(
            Axis::default()
                .bounds([0.0, top])
                .labels(["0".to_string(), human_bytes(top as usize)]),
        );
    frame.render_widget(chart, area);
}

/// The view on the terminal. Dropping it gives the terminal back.
pub struct Dashboard<B: Backend = CrosstermBackend<Stderr>> {
    terminal: Terminal<B>,
    pub state: DashboardState,
    drawn: Option<Instant>,
    /// Whether this view switched the terminal to its alternate screen (and must switch back).
    owns_screen: bool,
}

impl Dashboard {
    /// Opens the view on standard error, or `None` when standard error is not a terminal.
    pub fn open(state: DashboardState) -> io::Result<Option<Self>> {
        if !std::io::IsTerminal::is_terminal(&io::stderr()) {
            return Ok(None);
        }
        let mut err = io::stderr();
        execute!(err, terminal::EnterAlternateScreen, cursor::Hide)?;
        let mut view = Dashboard {
            terminal: Terminal::new(CrosstermBackend::new(err))?,
            state,
            drawn: None,
            owns_screen: true,
        };
        view.terminal.clear()?;
        view.redraw(true)?;
        Ok(Some(view))
    }
}

impl<B: Backend> Dashboard<B> {
    /// A view over any ratatui backend (the tests draw into its test backend's buffer).
    #[cfg(test)]
    pub fn on(backend: B, state: DashboardState) -> io::Result<Self> {
        Ok(Dashboard {
            terminal: Terminal::new(backend)?,
            state,
            drawn: None,
            owns_screen: false,
        })
    }

    /// Draws the view if a frame's time has passed since the last, or when `now`.
    pub fn redraw(&mut self, now: bool) -> io::Result<()> {
        if !now && self.drawn.is_some_and(|t| t.elapsed() < FRAME) {
            return Ok(());
        }
        let state = &self.state;
        self.terminal.draw(|f| draw(f, state))?;
        self.drawn = Some(Instant::now());
        Ok(())
    }

    #[cfg(test)]
    pub fn backend(&self) -> &B {
        self.terminal.backend()
    }
}

impl<B: Backend> Drop for Dashboard<B> {
    fn drop(&mut self) {
        if self.owns_screen {
            // Nothing more can be done if giving the terminal back fails.
            let _ = execute!(io::stderr(), terminal::LeaveAlternateScreen, cursor::Show);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;

    fn step(step: u64, loss: f32, held: usize, peak: usize) -> StepStats {
        StepStats {
            step,
            loss,
            loss_tokens: 64,
            lr: 1e-3,
            grad_norm: Some(0.5),
            loss_scale: None,
            skipped: false,
            ms: 12.5,
            tokens_per_s: 5120.0,
            tokens_seen: 64 * step,
            active_bytes: held,
            peak_bytes: peak,
            cache_bytes: 0,
            rss_bytes: None,
        }
    }

    fn screen(view: &Dashboard<TestBackend>) -> String {
        let buf = view.backend().buffer();
        let w = buf.area.width as usize;
        buf.content
            .chunks(w)
            .map(|row| row.iter().map(|c| c.symbol()).collect::<String>())
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn the_view_shows_the_last_steps_figures_progress_and_events() {
        let state = DashboardState {
            title: "snug train: char-small".into(),
            total_steps: 20,
            planned_peak_bytes: 3 << 20,
            ..DashboardState::default()
        };
        let mut view = Dashboard::on(TestBackend::new(140, 30), state).unwrap();
        view.redraw(true).unwrap();
        let before = screen(&view);
        assert!(before.contains("waiting for the first step"), "{before}");
        assert!(before.contains("planned peak 3.00 MiB"), "{before}");

        for (i, loss) in [3.0f32, 2.5, 2.25, 2.0, 1.75].into_iter().enumerate() {
            view.state.step(&step(i as u64 + 1, loss, 1 << 20, 3 << 20));
        }
        view.state.eval(&EvalStats {
            step: 5,
            train_loss: 1.8,
            val_loss: 1.9,
            train_loss_tokens: 640,
            val_loss_tokens: 640,
            ms: 4.0,
        });
        view.redraw(true).unwrap();
        let after = screen(&view);
        for want in [
            "snug train: char-small",
            "loss 1.7500",
            "5120 tok/s",
            "12.5 ms/step",
            "held 1.00 MiB",
            "peak 3.00 MiB (planned 3.00 MiB)",
            "step 5/20",
            "eval 5: train loss 1.8000, val loss 1.9000",
            "loss",
            "memory",
        ] {
            assert!(after.contains(want), "missing {want:?} in\n{after}");
        }
        // The loss chart's axis spans the losses seen (padded), so its labels move with them.
        assert!(after.contains("3.0") && after.contains("1.6"), "{after}");
    }

    #[test]
    fn the_log_keeps_the_latest_events_only() {
        let mut s = DashboardState::default();
        for i in 0..(LOG_LINES + 10) {
            s.say(format!("event {i}"));
        }
        assert_eq!(s.log.len(), LOG_LINES);
        assert_eq!(s.log.front().map(String::as_str), Some("event 10"));
        assert_eq!(
            s.log.back().map(String::as_str),
            Some(format!("event {}", LOG_LINES + 9).as_str())
        );
    }

    #[test]
    fn frames_are_throttled_unless_asked_for_now() {
        let mut view = Dashboard::on(TestBackend::new(100, 24), DashboardState::default()).unwrap();
        view.redraw(true).unwrap();
        view.state.title = "changed".into();
        view.redraw(false).unwrap();
        assert!(!screen(&view).contains("changed"));
        view.redraw(true).unwrap();
        assert!(screen(&view).contains("changed"));
    }

    #[test]
    fn bounds_widen_a_flat_series_and_default_when_empty() {
        assert_eq!(bounds(std::iter::empty()), [0.0, 1.0]);
        let [lo, hi] = bounds([2.0, 2.0].into_iter());
        assert!(lo < 2.0 && hi > 2.0);
        let [lo, hi] = bounds([1.0, 3.0].into_iter());
        assert!((lo - 0.9).abs() < 1e-12 && (hi - 3.1).abs() < 1e-12);
    }
}
