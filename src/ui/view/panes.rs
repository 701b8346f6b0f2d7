//! The live engine panes (`tokens/s`, `memory`, `disk`, `experts`) and the `budget` slider.
//! Every figure comes from the engine's last stats snapshot; where the engine reports nothing
//! (no budget, no expert lookups) the pane says so instead of showing a number.

use super::text::{clean, fit, str_width, wrap_line};
use crate::app::protocol::{Residency, StatsSnapshot};
use crate::app::state::{App, Focus, Phase, BUDGET_STEPS};
use crate::app::words::count;
use crate::ui::theme::Theme;
use ratatui::buffer::Buffer;
use ratatui::layout::Rect;
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph, Sparkline, Widget};

/// Bytes in the largest unit that keeps the number short (decimal units).
#[must_use]
pub fn bytes(n: u64) -> String {
    let x = n as f64;
    if n < 1000 {
        format!("{n} B")
    } else if x < 1e6 {
        format!("{:.1} KB", x / 1e3)
    } else if x < 1e9 {
        format!("{:.1} MB", x / 1e6)
    } else {
        format!("{:.2} GB", x / 1e9)
    }
}

/// A bar of `width` cells, `fraction` filled.
fn bar(fraction: f64, width: usize, theme: &Theme) -> Vec<Span<'static>> {
    let f = if fraction.is_finite() {
        fraction.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let full = ((f * width as f64).round() as usize).min(width);
    vec![
        Span::styled("█".repeat(full), theme.fill),
        Span::styled("░".repeat(width - full), theme.empty),
    ]
}

fn block<'a>(title: &'a str, theme: &Theme, focused: bool) -> Block<'a> {
    Block::bordered()
        .title(Span::styled(format!(" {title} "), theme.title))
        .border_style(if focused { theme.focus } else { theme.border })
}

/// Draw `lines` at the top of `inner` and a sparkline of `data` in the rows left below.
fn text_and_spark(
    lines: Vec<Line<'static>>,
    data: &[f64],
    theme: &Theme,
    inner: Rect,
    buf: &mut Buffer,
) {
    let n = u16::try_from(lines.len())
        .unwrap_or(u16::MAX)
        .min(inner.height);
    Paragraph::new(lines).render(Rect { height: n, ..inner }, buf);
    let spark = Rect {
        y: inner.y + n,
        height: inner.height - n,
        ..inner
    };
    if spark.height == 0 || spark.width == 0 || data.is_empty() {
        return;
    }
    // The newest points that fit, scaled to integers (0.1 resolution).
    let from = data.len().saturating_sub(usize::from(spark.width));
    let points: Vec<u64> = data[from..].iter().map(|v| (v * 10.0) as u64).collect();
    Sparkline::default()
        .data(&points)
        .style(theme.spark)
        .render(spark, buf);
}

fn last(app: &App) -> Option<&StatsSnapshot> {
    app.stats.last.as_ref()
}

fn waiting(theme: &Theme) -> Vec<Line<'static>> {
    vec![Line::styled("waiting…", theme.dim)]
}

/// Below this inner width the panes use their short forms.
const NARROW: usize = 24;

/// `tokens/s`: now, turn average, sparkline; prefill progress while a prompt is read.
pub fn tokens(app: &App, theme: &Theme, area: Rect, buf: &mut Buffer) {
    let b = block("tokens/s", theme, false);
    let inner = b.inner(area);
    b.render(area, buf);
    let w = usize::from(inner.width);
    let mut lines = Vec::new();
    match last(app) {
        None => lines = waiting(theme),
        Some(s) => {
            let avg = if s.turn_seconds > 0.0 {
                s.turn_tokens as f64 / s.turn_seconds
            } else {
                0.0
            };
            let full = format!("now {:.1} · avg {avg:.1}", s.tokens_per_second);
            if full.chars().count() <= w {
                lines.push(Line::styled(full, theme.text));
            } else {
                lines.push(Line::styled(
                    format!("now {:.1}", s.tokens_per_second),
                    theme.text,
                ));
                lines.push(Line::styled(format!("avg {avg:.1}"), theme.text));
            }
            if let Phase::Prefill { done, total, .. } = app.phase {
                if total > 0 {
                    let f = done as f64 / total as f64;
                    let label = format!(" {:.0}%", f * 100.0);
                    let mut spans = bar(f, w.saturating_sub(label.len()), theme);
                    spans.push(Span::styled(label, theme.text));
                    lines.push(Line::styled(format!("prefill {done}/{total}"), theme.dim));
                    lines.push(Line::from(spans));
                }
            } else if w >= NARROW {
                lines.push(Line::styled(
                    format!("{} this turn", count(s.turn_tokens, "token")),
                    theme.dim,
                ));
                if s.spec_proposed > 0 {
                    lines.push(Line::styled(
                        format!(
                            "spec {:.2} tok/pass, {}/{} used",
                            s.tokens_per_pass(),
                            s.spec_accepted,
                            s.spec_proposed
                        ),
                        theme.dim,
                    ));
                }
            }
        }
    }
    let data: Vec<f64> = app.stats.tps.iter().copied().collect();
    text_and_spark(lines, &data, theme, inner, buf);
}

/// `memory`: RSS against the budget (or "resident"), peak, model size.
/// The pane of a remote engine: the server, the model, and the last reply's time to first
/// token, tokens/s and cached prompt tokens (the server's `usage`).
pub fn remote(app: &App, theme: &Theme, area: Rect, buf: &mut Buffer) {
    let Some(r) = &app.remote else { return };
    let b = block("remote engine", theme, false);
    let inner = b.inner(area);
    b.render(area, buf);
    let w = usize::from(inner.width);
    let mut rows = vec![
        (clean(&r.server).into_owned(), theme.text),
        (format!("model {}", clean(&app.model)), theme.text),
    ];
    match last(app) {
        None => rows.push(("no reply yet".to_owned(), theme.dim)),
        Some(s) => {
            rows.push((
                format!(
                    "first token {:.2} s · {:.1} tokens/s",
                    r.first_token_seconds, s.tokens_per_second
                ),
                theme.text,
            ));
            rows.push((
                format!("prompt {} · cached {}", r.prompt_tokens, r.cached_tokens),
                theme.dim,
            ));
        }
    }
    rows.push((
        "memory, disk, experts, budget: local-only".to_owned(),
        theme.dim,
    ));
    let lines: Vec<Line<'_>> = rows
        .iter()
        .map(|(t, style)| Line::styled(fit(t, w).to_owned(), *style))
        .collect();
    Paragraph::new(lines).render(inner, buf);
}

pub fn memory(app: &App, theme: &Theme, area: Rect, buf: &mut Buffer) {
    let b = block("memory", theme, false);
    let inner = b.inner(area);
    b.render(area, buf);
    let w = usize::from(inner.width);
    let Some(s) = last(app) else {
        Paragraph::new(waiting(theme)).render(inner, buf);
        return;
    };
    let wide = w >= NARROW;
    let rss = format!("RSS {}", bytes(s.rss_bytes));
    let mut lines = Vec::new();
    match s.budget_bytes {
        Some(budget) => {
            let first = if wide {
                format!("{rss} of {}", bytes(budget))
            } else {
                rss
            };
            lines.push(Line::styled(first, theme.text));
            let f = s.rss_bytes as f64 / budget.max(1) as f64;
            let label = format!(" {:.0}%", f * 100.0);
            let mut spans = bar(f, w.saturating_sub(label.len()), theme);
            spans.push(Span::styled(label, theme.text));
            lines.push(Line::from(spans));
            if !wide {
                lines.push(Line::styled(format!("of {}", bytes(budget)), theme.text));
            }
        }
        None => {
            lines.push(Line::styled(rss, theme.text));
            let what = if wide {
                "resident (no budget)"
            } else {
                "resident"
            };
            lines.push(Line::styled(what, theme.text));
        }
    }
    let peak = if wide {
        format!(
            "peak {} · model {}",
            bytes(s.peak_rss_bytes),
            bytes(s.model_bytes)
        )
    } else {
        format!("peak {}", bytes(s.peak_rss_bytes))
    };
    lines.push(Line::styled(peak, theme.dim));
    Paragraph::new(lines).render(inner, buf);
}

/// `disk`: MB/s now and its sparkline, bytes read this turn and since start.
pub fn disk(app: &App, theme: &Theme, area: Rect, buf: &mut Buffer) {
    let b = block("disk", theme, false);
    let inner = b.inner(area);
    b.render(area, buf);
    let lines = match last(app) {
        None => waiting(theme),
        Some(s) => vec![
            Line::styled(format!("{:.1} MB/s", s.disk_mb_per_s), theme.text),
            Line::styled(format!("turn {}", bytes(s.turn_disk_bytes)), theme.text),
            Line::styled(format!("total {}", bytes(s.disk_bytes_read)), theme.dim),
        ],
    };
    let data: Vec<f64> = app.stats.disk.iter().copied().collect();
    text_and_spark(lines, &data, theme, inner, buf);
}

fn percent(num: u64, den: u64) -> String {
    if den == 0 {
        "—".into()
    } else {
        format!("{:.1}%", num as f64 * 100.0 / den as f64)
    }
}

/// `experts`: hit rate, true-resident rate, compute vs I/O, and the per-layer heat strip.
pub fn experts(app: &App, theme: &Theme, area: Rect, buf: &mut Buffer) {
    let b = block("experts", theme, false);
    let inner = b.inner(area);
    b.render(area, buf);
    let Some(s) = last(app) else {
        Paragraph::new(waiting(theme)).render(inner, buf);
        return;
    };
    let w = usize::from(inner.width).max(1);
    let lookups = s.expert_hits + s.expert_misses;
    let (resident, total) = s.layers.iter().fold((0u64, 0u64), |(r, t), l| {
        (
            r + u64::from(l.experts_resident),
            t + u64::from(l.experts_total),
        )
    });
    let busy = s.compute_seconds + s.io_wait_seconds;
    let hit = percent(s.expert_hits, lookups);
    let res = percent(resident, total);
    let mut lines = if w >= NARROW {
        vec![
            Line::styled(format!("hit {hit} · resident {res}"), theme.text),
            Line::styled(
                format!(
                    "compute {:.1}s · I/O {:.1}s ({})",
                    s.compute_seconds,
                    s.io_wait_seconds,
                    if s.compute_seconds > 0.0 && busy > 0.0 {
                        format!("{:.0}% I/O", s.io_wait_seconds * 100.0 / busy)
                    } else {
                        "—".into()
                    }
                ),
                theme.dim,
            ),
        ]
    } else {
        vec![
            Line::styled(format!("hit {hit}"), theme.text),
            Line::styled(format!("res {res}"), theme.text),
            Line::styled(
                format!("cpu {:.1} io {:.1}", s.compute_seconds, s.io_wait_seconds),
                theme.dim,
            ),
        ]
    };
    // The heat strip: one cell per layer, wrapped to the pane's width.
    let cells: Vec<Span<'static>> = s
        .layers
        .iter()
        .map(|l| {
            let glyph = match l.trunk {
                Residency::Pinned => "█",
                Residency::Ring => "▒",
            };
            let style: Style = if l.experts_total == 0 {
                theme.heat_dense
            } else if l.experts_resident >= l.experts_total {
                theme.heat_full
            } else if l.experts_resident == 0 {
                theme.heat_none
            } else {
                theme.heat_part
            };
            Span::styled(glyph, style)
        })
        .collect();
    let pinned = s
        .layers
        .iter()
        .filter(|l| l.trunk == Residency::Pinned)
        .count();
    if w >= NARROW {
        lines.push(Line::styled(
            format!("layers: {pinned} pinned · {} ring", s.layers.len() - pinned),
            theme.dim,
        ));
    }
    for chunk in cells.chunks(w) {
        lines.push(Line::from(chunk.to_vec()));
    }
    if w >= NARROW {
        lines.push(Line::styled(
            fit("█ pinned ▒ ring · green: all in RAM", w).to_string(),
            theme.dim,
        ));
    }
    Paragraph::new(lines).render(inner, buf);
}

/// The budget slider's track inside the `budget` pane at `area` (for the mouse).
#[must_use]
pub fn budget_track(area: Rect) -> Option<Rect> {
    let inner = Block::bordered().inner(area);
    (inner.height > 0 && inner.width > 0).then_some(Rect { height: 1, ..inner })
}

/// `budget`: the slider, its value against the model's size, and the engine's answer.
pub fn budget(app: &App, theme: &Theme, area: Rect, buf: &mut Buffer) {
    let b = block("budget", theme, app.focus == Focus::Budget);
    let inner = b.inner(area);
    b.render(area, buf);
    let w = usize::from(inner.width);
    if w == 0 || inner.height == 0 {
        return;
    }
    let bd = &app.budget;
    let mut lines = Vec::new();
    if !bd.ready() {
        lines.push(Line::styled("waiting…", theme.dim));
        Paragraph::new(lines).render(inner, buf);
        return;
    }
    // Slider: a knob on a track; the track's cells map onto the (logarithmic) steps.
    let track = w.max(2);
    let knob =
        ((f64::from(bd.step) / f64::from(BUDGET_STEPS)) * (track - 1) as f64).round() as usize;
    let knob = knob.min(track - 1);
    lines.push(Line::from(vec![
        Span::styled("━".repeat(knob), theme.fill),
        Span::styled("●", theme.title),
        Span::styled("─".repeat(track - 1 - knob), theme.empty),
    ]));
    let in_force = bd.in_force.map_or_else(|| "resident".to_string(), bytes);
    let wide = format!(
        "slider {} · model {}",
        bytes(bd.value_bytes()),
        bytes(bd.model_bytes)
    );
    // Every line is whole: the long forms where they fit, else the short ones.
    if w >= NARROW && str_width(&wide) <= w {
        lines.push(Line::styled(wide, theme.text));
        lines.push(Line::styled(format!("in force: {in_force}"), theme.text));
    } else {
        lines.push(Line::styled(
            format!("set {}", bytes(bd.value_bytes())),
            theme.text,
        ));
        lines.push(Line::styled(format!("now {in_force}"), theme.dim));
    }
    let answer = match (&bd.asked, &bd.answer) {
        (Some((_, asked)), _) => Some((
            format!("asking for {}…", bytes(*asked)),
            "asking…",
            theme.dim,
        )),
        (None, Some((_, Ok(text)))) => {
            Some((format!("engine: {}", clean(text)), "engine: ok", theme.text))
        }
        (None, Some((_, Err(text)))) => {
            Some((format!("refused: {}", clean(text)), "refused", theme.warn))
        }
        (None, None) => None,
    };
    if let Some((text, short, style)) = answer {
        let room = usize::from(inner.height).saturating_sub(lines.len());
        let pieces = wrap_line(&text.replace('\n', " "), w);
        if pieces.len() <= room {
            lines.extend(pieces.into_iter().map(|p| Line::styled(p, style)));
        } else if room > 0 {
            // Not room for all of it: a short form that fits, never a cut sentence.
            for piece in wrap_line(short, w).into_iter().take(room) {
                lines.push(Line::styled(piece, style));
            }
        }
    }
    Paragraph::new(lines).render(inner, buf);
}
