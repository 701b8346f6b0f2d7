//! Popups over the main screen: help (every key and slash command), the session dialog,
//! the unsaved-session questions, and the engine-stopped notice.

use super::panes::bytes;
use super::text::{clean, fit, one_line, str_width, wrap_line};
use crate::app::config::Cmd;
use crate::app::state::{App, SessionDialog};
use crate::session::commands::HELP;
use crate::ui::theme::Theme;
use ratatui::buffer::Buffer;
use ratatui::layout::Rect;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Clear, Paragraph, Widget};

/// A centred rectangle of at most `w` × `h` inside `area`.
fn centered(area: Rect, w: u16, h: u16) -> Rect {
    let w = w.min(area.width);
    let h = h.min(area.height);
    Rect {
        x: area.x + (area.width - w) / 2,
        y: area.y + (area.height - h) / 2,
        width: w,
        height: h,
    }
}

fn frame<'a>(title: &'a str, theme: &Theme) -> Block<'a> {
    Block::bordered()
        .title(Span::styled(format!(" {title} "), theme.title))
        .border_style(theme.focus)
}

fn popup(
    title: &str,
    lines: Vec<Line<'static>>,
    w: u16,
    area: Rect,
    theme: &Theme,
    buf: &mut Buffer,
) {
    let h = u16::try_from(lines.len())
        .unwrap_or(u16::MAX)
        .saturating_add(2);
    let r = centered(area, w, h);
    Clear.render(r, buf);
    let b = frame(title, theme);
    let inner = b.inner(r);
    b.render(r, buf);
    Paragraph::new(lines).render(inner, buf);
}

/// Every key (with the configured bindings) and every slash command.
pub fn help(app: &App, theme: &Theme, area: Rect, buf: &mut Buffer) {
    let k = |c: Cmd| app.keys.of(c).to_string();
    let rows: Vec<(String, &str)> = vec![
        ("Enter".into(), "send the message (or /command)"),
        (k(Cmd::Newline), Cmd::Newline.describe()),
        (
            "Up / Down".into(),
            "input history; move between input lines",
        ),
        (
            "Left Right Home End".into(),
            "move in the input (Ctrl-A / Ctrl-E too)",
        ),
        ("Ctrl-U".into(), "clear the input"),
        (k(Cmd::Stop), Cmd::Stop.describe()),
        (
            "Ctrl-C".into(),
            "stop the reply; clear the input; quit when idle",
        ),
        (k(Cmd::Quit), Cmd::Quit.describe()),
        (
            "PgUp / PgDn".into(),
            "scroll the conversation (also Shift-Up/Down, wheel)",
        ),
        (k(Cmd::Follow), Cmd::Follow.describe()),
        (k(Cmd::Thinking), Cmd::Thinking.describe()),
        (k(Cmd::Mode), Cmd::Mode.describe()),
        (k(Cmd::Copy), Cmd::Copy.describe()),
        (k(Cmd::Sessions), Cmd::Sessions.describe()),
        (k(Cmd::New), Cmd::New.describe()),
        (k(Cmd::AnswerNow), Cmd::AnswerNow.describe()),
        (k(Cmd::Effort), Cmd::Effort.describe()),
        (k(Cmd::Select), Cmd::Select.describe()),
        (k(Cmd::Panes), Cmd::Panes.describe()),
        (
            format!("{} / {}", k(Cmd::BudgetDown), k(Cmd::BudgetUp)),
            "memory budget down / up (input empty)",
        ),
        (k(Cmd::Focus), Cmd::Focus.describe()),
        (
            "mouse".into(),
            "wheel scrolls; click or wheel on budget moves it",
        ),
        (
            "Shift + mouse".into(),
            "select text with the terminal (mouse captured)",
        ),
        (k(Cmd::Help), Cmd::Help.describe()),
    ];
    let key_w = rows
        .iter()
        .map(|(k, _)| str_width(k))
        .max()
        .unwrap_or(0)
        .min(28);
    let width = area.width.saturating_sub(4).min(96);
    let inner_w = usize::from(width.saturating_sub(2));
    let mut lines: Vec<Line<'static>> = rows
        .into_iter()
        .map(|(key, what)| {
            let key = format!("{:<key_w$}  ", fit(&key, key_w));
            let what = fit(what, inner_w.saturating_sub(key_w + 2)).to_string();
            Line::from(vec![
                Span::styled(key, theme.user),
                Span::styled(what, theme.text),
            ])
        })
        .collect();
    lines.push(Line::default());
    lines.push(Line::styled("slash commands", theme.title));
    for l in HELP.lines() {
        lines.push(Line::styled(fit(l, inner_w).to_string(), theme.text));
    }
    let room = usize::from(area.height.saturating_sub(2));
    if lines.len() > room && room > 1 {
        // Scrolled by Up/Down/PgUp/PgDn; the last row says there is more.
        let first = app.help_scroll.min(lines.len() - (room - 1));
        let rest = lines.len() - first - (room - 1);
        lines.drain(..first);
        lines.truncate(room - 1);
        lines.push(Line::styled(
            if rest > 0 {
                format!("↓ {rest} more lines (Down / PgDn)")
            } else {
                "↑ (Up / PgUp)".to_string()
            },
            theme.dim,
        ));
    }
    popup(
        "help · arrows scroll · any other key closes",
        lines,
        width,
        area,
        theme,
        buf,
    );
}

/// The session dialog: saved sessions (name, date, turns, size), save-as, new.
/// Over 100 lines: the session dialog drawn top to bottom (list, rename field, keys, message),
/// one block each.
pub fn sessions(app: &App, d: &SessionDialog, theme: &Theme, area: Rect, buf: &mut Buffer) {
    let width = area.width.saturating_sub(4).min(90);
    let inner_w = usize::from(width.saturating_sub(2));
    let name_w = inner_w.saturating_sub(38).clamp(4, 40);
    let mut lines = vec![Line::styled(
        fit(
            &format!(
                "current: {}{}",
                one_line(app.session.as_deref().unwrap_or("(unnamed)")),
                if app.dirty { " (unsaved changes)" } else { "" }
            ),
            inner_w,
        )
        .to_string(),
        theme.dim,
    )];
    lines.push(Line::styled(
        fit(
            &format!(
                "  {:<name_w$} {:<16} {:>5} {:>10}",
                "name", "saved", "turns", "size"
            ),
            inner_w,
        )
        .to_string(),
        theme.title,
    ));
    let room = usize::from(area.height.saturating_sub(8)).max(1);
    match &d.rows {
        None => lines.push(Line::styled("  reading…", theme.dim)),
        Some(Err(e)) => lines.push(Line::styled(
            fit(&one_line(e), inner_w).to_string(),
            theme.error,
        )),
        Some(Ok(rows)) if rows.is_empty() => {
            lines.push(Line::styled("  no saved sessions yet", theme.dim));
        }
        Some(Ok(_)) if d.visible().is_empty() => {
            lines.push(Line::styled("  no saved session matches", theme.dim));
        }
        Some(Ok(_)) => {
            let rows = d.visible();
            let first = d.selected.saturating_sub(room - 1);
            for (i, r) in rows.iter().enumerate().skip(first).take(room) {
                let name = fit(&one_line(&r.name), name_w).to_string();
                // `*`: changes kept in a journal and not saved (all of it when "not saved").
                let mark = if r.unsaved { "* " } else { "  " };
                let text = match &r.problem {
                    Some(p) => format!("{mark}{name:<name_w$} {}", one_line(p)),
                    None => format!(
                        "{mark}{name:<name_w$} {:<16} {:>5} {:>10}",
                        one_line(&r.saved),
                        r.turns,
                        bytes(r.bytes)
                    ),
                };
                let style = if i == d.selected {
                    theme.selected
                } else {
                    theme.text
                };
                lines.push(Line::styled(fit(&text, inner_w).to_string(), style));
            }
        }
    }
    lines.push(if d.filtering || !d.filter.is_empty() {
        Line::from(vec![
            Span::styled("filter: ", theme.title),
            Span::styled(
                format!(
                    "{}{}",
                    one_line(&d.filter),
                    if d.filtering { "▌" } else { "" }
                ),
                theme.text,
            ),
        ])
    } else {
        Line::default()
    });
    if let Some((from, name)) = &d.renaming {
        lines.push(Line::from(vec![
            Span::styled(
                fit(&format!("rename {}: ", one_line(from)), inner_w / 2).to_string(),
                theme.title,
            ),
            Span::styled(format!("{}▌", one_line(name.text())), theme.text),
        ]));
        lines.push(Line::styled("Enter renames · Esc back", theme.dim));
    } else if let Some(name) = &d.deleting {
        lines.push(Line::styled(
            fit(
                &format!(
                    "delete {} and its journal? y deletes · any other key keeps it",
                    one_line(name)
                ),
                inner_w,
            )
            .to_string(),
            theme.warn,
        ));
    } else if d.filtering {
        lines.push(Line::styled(
            fit(
                "type to filter · Enter load · Esc clears the filter",
                inner_w,
            )
            .to_string(),
            theme.dim,
        ));
    } else if let Some(name) = &d.naming {
        lines.push(Line::from(vec![
            Span::styled("save as: ", theme.title),
            Span::styled(format!("{}▌", one_line(name.text())), theme.text),
        ]));
        lines.push(Line::styled("Enter saves · Esc back", theme.dim));
    } else {
        let keys = "Enter/l load · s save as · e rename · d delete · / filter · n new · \
                    r refresh · Esc close";
        for piece in wrap_line(keys, inner_w.max(1)) {
            lines.push(Line::styled(piece, theme.dim));
        }
    }
    if let Some(m) = &d.message {
        for piece in wrap_line(&one_line(m), inner_w.max(1)) {
            lines.push(Line::styled(piece, theme.warn));
        }
    }
    popup("sessions", lines, width, area, theme, buf);
}

/// "Quit with unsaved turns?"
pub fn confirm_quit(app: &App, theme: &Theme, area: Rect, buf: &mut Buffer) {
    let name = one_line(app.session.as_deref().unwrap_or("(unnamed)"));
    let lines = vec![
        Line::styled(format!("session {name} has unsaved changes"), theme.text),
        Line::default(),
        Line::from(vec![
            Span::styled("s", theme.user),
            Span::styled(" save and quit   ", theme.text),
            Span::styled("q", theme.user),
            Span::styled(" quit without saving   ", theme.text),
            Span::styled("Esc", theme.user),
            Span::styled(" stay", theme.text),
        ]),
    ];
    popup("quit?", lines, 64, area, theme, buf);
}

/// "Start a new conversation and drop unsaved turns?"
pub fn confirm_new(theme: &Theme, area: Rect, buf: &mut Buffer) {
    let lines = vec![
        Line::styled("the current conversation has unsaved changes", theme.text),
        Line::styled("y start a new one   n / Esc keep this one", theme.text),
    ];
    popup("new conversation?", lines, 52, area, theme, buf);
}

/// "Change thinking? It re-reads the conversation": what it costs, before it takes effect.
pub fn confirm_think(
    app: &App,
    t: crate::session::commands::Think,
    theme: &Theme,
    area: Rect,
    buf: &mut Buffer,
) {
    let word = crate::app::state::think_word(t);
    let lines = vec![
        Line::styled(format!("thinking {word}: {}", app.think_cost()), theme.text),
        Line::default(),
        Line::from(vec![
            Span::styled("Enter", theme.user),
            Span::styled(" apply it now   ", theme.text),
            Span::styled("Esc", theme.user),
            Span::styled(" keep it for new conversations", theme.text),
        ]),
    ];
    popup("change thinking?", lines, 76, area, theme, buf);
}

/// "Load another session over unsaved changes?"
pub fn confirm_load(name: &str, theme: &Theme, area: Rect, buf: &mut Buffer) {
    let lines = vec![
        Line::styled("the current conversation has unsaved changes", theme.text),
        Line::styled(
            format!(
                "y load {} and lose them   n / Esc keep this one",
                one_line(name)
            ),
            theme.text,
        ),
    ];
    popup("load another session?", lines, 64, area, theme, buf);
}

/// "Replace a different saved session of this name?"
pub fn confirm_replace(name: &str, theme: &Theme, area: Rect, buf: &mut Buffer) {
    let lines = vec![
        Line::styled(
            format!("another saved session is named {}", one_line(name)),
            theme.text,
        ),
        Line::styled("y replace it   n / Esc keep it", theme.text),
    ];
    popup("replace it?", lines, 56, area, theme, buf);
}

/// The engine stopped: why, and how to leave.
pub fn failed(message: &str, code: i32, theme: &Theme, area: Rect, buf: &mut Buffer) {
    let width = area.width.saturating_sub(4).min(80);
    let inner_w = usize::from(width.saturating_sub(2)).max(1);
    let mut lines: Vec<Line<'static>> = Vec::new();
    for raw in clean(message).split('\n') {
        for piece in wrap_line(raw, inner_w) {
            lines.push(Line::styled(piece, theme.error));
        }
    }
    lines.push(Line::default());
    lines.push(Line::styled(
        format!("press any key to leave (exit status {code})"),
        theme.dim,
    ));
    popup("the engine stopped", lines, width, area, theme, buf);
}
