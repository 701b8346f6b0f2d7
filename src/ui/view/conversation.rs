//! The conversation pane's lines: message labels, the dimmed thinking channel, replies
//! rendered from Markdown, raw continuations as plain text with code blocks set apart, and
//! select mode's highlight.

use super::markdown;
use super::text::{clean, hard_wrap, str_width, wrap_line, SPINNER};
use crate::app::state::{App, Item, Phase, Reply, ReplyState, Target};
use crate::ui::theme::Theme;
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use std::ops::Range;

/// Builds the conversation pane's lines at a fixed width.
struct Lines<'t> {
    out: Vec<Line<'static>>,
    width: usize,
    theme: &'t Theme,
    /// The lines of each code block of the reply added last.
    code: Vec<Range<usize>>,
}

impl Lines<'_> {
    /// Add `text` (escaped here) with `prefix` on every line, word-wrapped.
    fn text(&mut self, text: &str, prefix: &str, style: Style) {
        let room = self.width.saturating_sub(str_width(prefix)).max(1);
        let cleaned = clean(text);
        for raw in cleaned.split('\n') {
            for piece in wrap_line(raw, room) {
                self.out.push(Line::from(vec![
                    Span::styled(prefix.to_string(), style),
                    Span::styled(piece, style),
                ]));
            }
        }
    }

    /// Add a reply's answer: prose word-wrapped, fenced code blocks set apart.
    fn answer(&mut self, text: &str, style: Style) {
        let cleaned = clean(text);
        let mut in_code = false;
        for raw in cleaned.split('\n') {
            let fence = raw.trim_start().starts_with("```");
            if fence || in_code {
                let room = self.width.saturating_sub(4).max(1);
                let st = if fence {
                    self.theme.dim
                } else {
                    self.theme.code
                };
                for piece in hard_wrap(raw, room) {
                    self.out.push(Line::from(vec![
                        Span::styled("  ▎ ", self.theme.dim),
                        Span::styled(piece, st),
                    ]));
                }
                if fence {
                    in_code = !in_code;
                }
            } else {
                let room = self.width.saturating_sub(2).max(1);
                for piece in wrap_line(raw, room) {
                    self.out.push(Line::from(vec![
                        Span::raw("  "),
                        Span::styled(piece, style),
                    ]));
                }
            }
        }
    }

    fn label(&mut self, text: &str, style: Style, extra: Option<Span<'static>>) {
        let mut spans = vec![Span::styled(text.to_string(), style)];
        spans.extend(extra);
        self.out.push(Line::from(spans));
    }

    fn reply(&mut self, r: &Reply, app: &App) {
        let live = r.state == ReplyState::Live;
        let spinner = live.then(|| {
            Span::styled(
                format!(" {}", SPINNER[(app.ticks % 10) as usize]),
                self.theme.dim,
            )
        });
        self.label(
            if r.raw { "continuation" } else { "k3" },
            self.theme.assistant,
            spinner,
        );
        if !r.reasoning.trim().is_empty() {
            if app.show_thinking {
                self.label(
                    "  ▾ thinking",
                    self.theme.reasoning,
                    Some(Span::styled(
                        format!(
                            "  ({} hides)",
                            app.keys.of(crate::app::config::Cmd::Thinking)
                        ),
                        self.theme.dim,
                    )),
                );
                self.text(r.reasoning.trim_end(), "  │ ", self.theme.reasoning);
            } else {
                let words = r.reasoning.split_whitespace().count();
                self.label(
                    &format!(
                        "  ▸ thinking ({words} words, {} shows)",
                        app.keys.of(crate::app::config::Cmd::Thinking)
                    ),
                    self.theme.reasoning,
                    None,
                );
            }
        }
        if live && r.content.is_empty() {
            let waiting = match app.phase {
                Phase::Prefill { done, total, .. } if total > 0 => format!(
                    "  reading the prompt: {done} / {} ({:.0}%)",
                    crate::app::words::count(total, "token"),
                    done as f64 * 100.0 / total as f64
                ),
                Phase::Prefill { .. } => "  reading the prompt…".to_string(),
                _ if r.reasoning.is_empty() => "  waiting for the first token…".to_string(),
                _ => String::new(),
            };
            if !waiting.is_empty() {
                self.label(&waiting, self.theme.dim, None);
            }
        } else if r.raw {
            self.answer(&r.content, self.theme.text);
        } else {
            let md = markdown::render_cached(&r.content, self.width, self.theme, app.theme, !live);
            let at = self.out.len();
            self.code = md.code.iter().map(|c| c.start + at..c.end + at).collect();
            self.out.extend(md.lines.iter().cloned());
        }
        if live {
            if let Some(last) = self.out.last_mut() {
                last.spans.push(Span::styled("▌", self.theme.dim));
            }
        }
        if let Some(note) = &r.note {
            self.text(note, "  ", self.theme.warn);
        }
        if let Some(s) = &r.summary {
            self.text(&format!("[{s}]"), "  ", self.theme.dim);
        }
    }
}

/// Every line of the conversation pane at `width` columns, oldest first.
#[must_use]
pub fn conversation(app: &App, width: usize, theme: &Theme) -> Vec<Line<'static>> {
    conversation_marked(app, width, theme).0
}

/// Show `lines` as select mode's highlight: a bar in the left margin (the gutter of a code
/// block in the focus style too), a message's label reversed.
fn mark(lines: &mut [Line<'static>], theme: &Theme) {
    for line in lines {
        let Some(first) = line.spans.first_mut() else {
            *line = Line::from(Span::styled("▌", theme.focus));
            continue;
        };
        if let Some(rest) = first.content.strip_prefix(' ') {
            let rest = Span::styled(rest.to_string(), first.style);
            *first = Span::styled("▌", theme.focus);
            line.spans.insert(1, rest);
        } else {
            first.style = first.style.patch(theme.selected);
        }
        for s in &mut line.spans {
            if s.content == markdown::GUTTER {
                s.style = theme.focus;
            }
        }
    }
}

/// [`conversation`], and the lines select mode's highlight is on (marked), if it is on.
#[must_use]
pub fn conversation_marked(
    app: &App,
    width: usize,
    theme: &Theme,
) -> (Vec<Line<'static>>, Option<Range<usize>>) {
    let mut l = Lines {
        out: Vec::new(),
        width: width.max(1),
        theme,
        code: Vec::new(),
    };
    if app.phase == Phase::Loading {
        let spin = SPINNER[(app.ticks % 10) as usize];
        let read = match app.loading {
            Some((done, total)) if total > 0 => format!(
                ": reading weights, {:.1} of {:.1} MB ({:.0}%)",
                done as f64 / 1e6,
                total as f64 / 1e6,
                done as f64 * 100.0 / total as f64
            ),
            _ => String::new(),
        };
        l.text(
            &format!(
                "{spin} loading {}{read} … {:.1} s",
                app.model,
                app.ticks as f64 / 10.0
            ),
            "",
            theme.dim,
        );
    }
    let mut marked = None;
    for (i, item) in app.items.iter().enumerate() {
        if i > 0 && !matches!(item, Item::Info(_)) {
            l.out.push(Line::default());
        }
        let start = l.out.len();
        l.code.clear();
        match item {
            Item::Info(t) => l.text(t, "", theme.dim),
            Item::Error(t) => l.text(&format!("error: {t}"), "", theme.error),
            Item::User { text, raw } => {
                l.label(
                    if *raw { "you (raw text)" } else { "you" },
                    theme.user,
                    None,
                );
                l.text(text, "  ", theme.text);
            }
            Item::Reply(r) => l.reply(r, app),
        }
        marked = match app.selected {
            Some(Target::Message(m)) if m == i => Some(start..l.out.len()),
            Some(Target::Code { item, block }) if item == i => l.code.get(block).cloned(),
            _ => marked,
        };
    }
    if let Some(r) = &marked {
        let end = r.end.min(l.out.len());
        mark(&mut l.out[r.start.min(end)..end], theme);
    }
    (l.out, marked)
}
