//! Rendering of `&App`: layout and composition of the conversation pane, the input box, the
//! status bar, the live panes and the popups. Reads the model only; returns what it measured
//! (how far the conversation can scroll, where the mouse regions are) for the driver.
//!
//! Every string that did not originate in this client (model output, engine messages, pasted
//! text, session names) passes through [`text::clean`] before it reaches the buffer.

pub mod conversation;
pub mod markdown;
#[cfg(test)]
mod md_tests;
pub mod panes;
pub mod popups;
#[cfg(test)]
mod tests;
pub mod text;

use crate::app::config::Cmd;
use crate::app::state::{App, Dialog, Focus, Phase};
use crate::session::chat::Mode;
use crate::ui::input::Regions;
use crate::ui::theme::Theme;
use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Layout, Position, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph, Widget};
use ratatui::Frame;
use text::{char_width, clean, fit, one_line, str_width, SPINNER};

/// Smallest terminal the client draws its screen in; below it says so.
pub const MIN_WIDTH: u16 = 40;
/// Smallest terminal height (see [`MIN_WIDTH`]).
pub const MIN_HEIGHT: u16 = 10;
/// Width of the pane column in the wide layout.
const COLUMN_W: u16 = 40;

/// What a draw measured, for the driver.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Measure {
    /// Lines the conversation can scroll up.
    pub max_scroll: usize,
    /// Visible conversation lines.
    pub page: usize,
    /// Mouse regions.
    pub regions: Regions,
    /// Where the terminal cursor goes (in the input box).
    pub cursor: Option<Position>,
}

/// Where the live panes go.
enum PanesAt {
    /// Too little room: none.
    None,
    /// A column on the right.
    Column(Rect),
    /// A row under the conversation.
    Row(Rect),
}

/// Draw the whole screen into a frame; sets the cursor in the input box.
pub fn draw(frame: &mut Frame<'_>, app: &App) -> Measure {
    let area = frame.area();
    let m = render(app, area, frame.buffer_mut());
    if let Some(p) = m.cursor {
        frame.set_cursor_position(p);
    }
    m
}

/// Draw the whole screen into `buf` at `area`.
pub fn render(app: &App, area: Rect, buf: &mut Buffer) -> Measure {
    let theme = Theme::new(app.theme);
    let mut m = Measure::default();
    if area.width < MIN_WIDTH || area.height < MIN_HEIGHT {
        too_small(area, &theme, buf);
        return m;
    }
    let input_rows = input_rows(app, usize::from(area.width.saturating_sub(2)));
    let max_input = (area.height / 3).clamp(1, 8);
    let input_h = u16::try_from(input_rows.rows.len())
        .unwrap_or(u16::MAX)
        .clamp(1, max_input)
        + 2;
    let [main, input, status] = Layout::vertical([
        Constraint::Min(1),
        Constraint::Length(input_h),
        Constraint::Length(1),
    ])
    .areas(area);
    let (conv, panes_at) = if app.hide_panes {
        (main, PanesAt::None)
    } else if main.width >= 110 && main.height >= 18 {
        let [c, p] =
            Layout::horizontal([Constraint::Min(1), Constraint::Length(COLUMN_W)]).areas(main);
        (c, PanesAt::Column(p))
    } else if main.width >= 60 && main.height >= 14 {
        let [c, p] = Layout::vertical([Constraint::Min(1), Constraint::Length(6)]).areas(main);
        (c, PanesAt::Row(p))
    } else {
        (main, PanesAt::None)
    };
    let (max_scroll, page) = conversation(app, &theme, conv, buf);
    m.max_scroll = max_scroll;
    m.page = page;
    m.cursor = input_box(app, &theme, &input_rows, input, buf);
    status_bar(app, &theme, status, buf);
    let budget_area = match panes_at {
        _ if app.remote.is_some() => {
            // One pane for a remote engine: memory, disk, experts and budget are local-only.
            match panes_at {
                PanesAt::None => {}
                PanesAt::Column(r) | PanesAt::Row(r) => panes::remote(app, &theme, r, buf),
            }
            None
        }
        PanesAt::None => None,
        PanesAt::Column(r) => {
            let n_layers = app.stats.last.as_ref().map_or(0, |s| s.layers.len());
            let strip = u16::try_from(n_layers.div_ceil(usize::from(COLUMN_W - 2)))
                .unwrap_or(4)
                .min(4);
            let [t, mem, d, e, b] = Layout::vertical([
                Constraint::Fill(2),
                Constraint::Length(5),
                Constraint::Fill(1),
                Constraint::Length(6 + strip),
                Constraint::Length(8),
            ])
            .areas(r);
            draw_panes(app, &theme, [t, mem, d, e, b], buf);
            Some(b)
        }
        PanesAt::Row(r) => {
            let [t, mem, d, e, b] = Layout::horizontal([Constraint::Ratio(1, 5); 5]).areas(r);
            draw_panes(app, &theme, [t, mem, d, e, b], buf);
            Some(b)
        }
    };
    m.regions = Regions {
        budget_track: budget_area.and_then(panes::budget_track),
        budget_pane: budget_area,
    };
    popups(app, &theme, area, buf);
    m
}

fn draw_panes(app: &App, theme: &Theme, r: [Rect; 5], buf: &mut Buffer) {
    panes::tokens(app, theme, r[0], buf);
    panes::memory(app, theme, r[1], buf);
    panes::disk(app, theme, r[2], buf);
    panes::experts(app, theme, r[3], buf);
    panes::budget(app, theme, r[4], buf);
}

fn popups(app: &App, theme: &Theme, area: Rect, buf: &mut Buffer) {
    if let Phase::Failed { message, code } = &app.phase {
        popups::failed(message, *code, theme, area, buf);
        return;
    }
    match &app.dialog {
        None => {}
        Some(Dialog::Help) => popups::help(app, theme, area, buf),
        Some(Dialog::Sessions(d)) => popups::sessions(app, d, theme, area, buf),
        Some(Dialog::ConfirmQuit) => popups::confirm_quit(app, theme, area, buf),
        Some(Dialog::ConfirmNew) => popups::confirm_new(theme, area, buf),
        Some(Dialog::ConfirmThink(t)) => popups::confirm_think(app, *t, theme, area, buf),
        Some(Dialog::ConfirmReplace(name)) => popups::confirm_replace(name, theme, area, buf),
        Some(Dialog::ConfirmLoad(name)) => popups::confirm_load(name, theme, area, buf),
    }
}

fn too_small(area: Rect, theme: &Theme, buf: &mut Buffer) {
    let lines = vec![
        Line::styled("terminal too small", theme.error),
        Line::styled(
            format!(
                "{}×{}, need {MIN_WIDTH}×{MIN_HEIGHT}",
                area.width, area.height
            ),
            theme.dim,
        ),
    ];
    let y = area.y + area.height.saturating_sub(2) / 2;
    let r = Rect {
        y,
        height: area.height - (y - area.y),
        ..area
    };
    Paragraph::new(lines).centered().render(r, buf);
}

/// The conversation pane; returns (max scroll, visible lines).
fn conversation(app: &App, theme: &Theme, area: Rect, buf: &mut Buffer) -> (usize, usize) {
    let (lines, marked) = conversation::conversation_marked(app, usize::from(area.width), theme);
    let h = usize::from(area.height);
    let total = lines.len();
    let max_scroll = total.saturating_sub(h);
    let mut scroll = app.scroll.min(max_scroll);
    if let Some(r) = marked {
        // Select mode: scrolled as little as needed to show the highlight (its top first).
        if r.end > total - scroll {
            scroll = total - r.end;
        }
        if r.start < (total - scroll).saturating_sub(h) {
            scroll = total.saturating_sub(r.start + h);
        }
        scroll = scroll.min(max_scroll);
    }
    let end = total - scroll;
    let start = end.saturating_sub(h);
    let visible: Vec<Line<'static>> = lines[start..end].to_vec();
    Paragraph::new(visible).render(area, buf);
    if scroll > 0 && area.width > 10 {
        let note = format!(" ↓ {scroll} more lines ({}) ", app.keys.of(Cmd::Follow));
        let note = fit(&note, usize::from(area.width)).to_string();
        let w = u16::try_from(str_width(&note)).unwrap_or(area.width);
        let r = Rect {
            x: area.right().saturating_sub(w),
            y: area.bottom().saturating_sub(1),
            width: w,
            height: 1,
        };
        Paragraph::new(Line::styled(note, theme.selected)).render(r, buf);
    }
    (max_scroll, h)
}

/// The input text laid out in rows of at most `width` columns, and the cursor's row and column.
struct InputRows {
    rows: Vec<String>,
    cursor: (usize, usize),
}

fn input_rows(app: &App, width: usize) -> InputRows {
    let width = width.max(1);
    let text = app.input.text();
    let at = app.input.cursor();
    let mut rows = vec![String::new()];
    let mut col = 0;
    let mut cursor = (0, 0);
    for (i, c) in text.char_indices() {
        if i == at {
            cursor = (rows.len() - 1, col);
        }
        if c == '\n' {
            rows.push(String::new());
            col = 0;
            continue;
        }
        let mut tmp = [0u8; 4];
        let shown = clean(c.encode_utf8(&mut tmp)).into_owned();
        for d in shown.chars() {
            let w = char_width(d);
            if col + w > width && col > 0 {
                rows.push(String::new());
                col = 0;
            }
            if let Some(r) = rows.last_mut() {
                r.push(d);
            }
            col += w;
        }
    }
    if at >= text.len() {
        if col >= width {
            rows.push(String::new());
            col = 0;
        }
        cursor = (rows.len() - 1, col);
    }
    InputRows { rows, cursor }
}

fn input_box(
    app: &App,
    theme: &Theme,
    rows: &InputRows,
    area: Rect,
    buf: &mut Buffer,
) -> Option<Position> {
    let title = match (&app.phase, app.mode) {
        _ if app.selected.is_some() => format!(
            " select · ↑↓ or j k move · y copies · {} leaves ",
            app.keys.of(Cmd::Stop).split(" / ").next().unwrap_or("Esc")
        ),
        (Phase::Loading, _) => " loading the model… ".to_string(),
        (Phase::Prefill { .. } | Phase::Streaming { .. }, _) => {
            format!(
                " generating · {} stops ",
                app.keys.of(Cmd::Stop).split(" / ").next().unwrap_or("Esc")
            )
        }
        (_, Mode::Raw) => " raw text · Enter sends ".to_string(),
        (_, Mode::Chat) => format!(
            " message · Enter sends · {} new line ",
            app.keys
                .of(Cmd::Newline)
                .split(" / ")
                .next()
                .unwrap_or("Alt-Enter")
        ),
    };
    let focused = app.focus == Focus::Input && app.dialog.is_none();
    let b = Block::bordered()
        .title(Span::styled(title, theme.title))
        .border_style(if focused { theme.focus } else { theme.border });
    let inner = b.inner(area);
    b.render(area, buf);
    if inner.height == 0 || inner.width == 0 {
        return None;
    }
    if app.input.is_empty() {
        let hint = if app.phase == Phase::Idle {
            format!(
                "type here · {} help · / for commands",
                app.keys.of(Cmd::Help).split(" / ").next().unwrap_or("F1")
            )
        } else {
            String::new()
        };
        Paragraph::new(Line::styled(
            fit(&hint, usize::from(inner.width)).to_string(),
            theme.dim,
        ))
        .render(inner, buf);
    } else {
        let h = usize::from(inner.height);
        let first = (rows.cursor.0 + 1).saturating_sub(h);
        let shown: Vec<Line<'static>> = rows.rows[first..]
            .iter()
            .take(h)
            .map(|r| Line::styled(r.clone(), theme.text))
            .collect();
        Paragraph::new(shown).render(inner, buf);
    }
    if !focused {
        return None;
    }
    let first = (rows.cursor.0 + 1).saturating_sub(usize::from(inner.height));
    let y = u16::try_from(rows.cursor.0 - first).unwrap_or(0);
    let x = u16::try_from(rows.cursor.1)
        .unwrap_or(u16::MAX)
        .min(inner.width - 1);
    Some(Position::new(inner.x + x, inner.y + y))
}

/// Two significant digits (`0.0012`, `0.5`, `12`, `340`).
fn sig2(x: f64) -> String {
    if !x.is_finite() || x <= 0.0 {
        return "0".into();
    }
    let decimals = (1 - x.log10().floor() as i32).max(0) as usize;
    format!("{x:.decimals$}")
}

/// Seconds as `45 s`, `12 min`, `3.5 h`.
fn duration(s: f64) -> String {
    if s < 90.0 {
        format!("{:.0} s", s.max(0.0))
    } else if s < 5400.0 {
        format!("{:.0} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

fn status_bar(app: &App, theme: &Theme, area: Rect, buf: &mut Buffer) {
    let w = usize::from(area.width);
    let session = app
        .session
        .as_deref()
        .map_or_else(|| "(unnamed)".to_string(), one_line);
    let (pos, limit) = app.stats.last.as_ref().map_or((0, app.context_limit), |s| {
        (s.positions, app.context_limit.max(s.context_limit))
    });
    let phase = match &app.phase {
        Phase::Loading => format!("{} loading", SPINNER[(app.ticks % 10) as usize]),
        Phase::Idle => "ready".to_string(),
        Phase::Prefill { .. } => format!("{} reading prompt", SPINNER[(app.ticks % 10) as usize]),
        Phase::Streaming { tokens, .. } => {
            format!(
                "{} {}",
                SPINNER[(app.ticks % 10) as usize],
                crate::app::words::count(*tokens, "token")
            )
        }
        Phase::Failed { .. } => "stopped".to_string(),
        Phase::Exiting => "leaving".to_string(),
    };
    let left = format!(
        " k3 │ {} │ {}{} │ {}{} │ pos {pos}/{limit} │ {phase} ",
        one_line(&app.model),
        session,
        if app.dirty { "*" } else { "" },
        app.mode.name(),
        if app.thinking && app.mode == Mode::Chat {
            "+think"
        } else {
            ""
        },
    );
    let right = match &app.toast {
        Some((t, _)) => format!(" {} ", one_line(t)),
        None => {
            let k = |c: Cmd| {
                app.keys
                    .of(c)
                    .split(" / ")
                    .next()
                    .unwrap_or("?")
                    .to_string()
            };
            format!(
                " {} help · {} panes · {} stop · {} sessions · {} quit ",
                k(Cmd::Help),
                k(Cmd::Panes),
                k(Cmd::Stop),
                k(Cmd::Sessions),
                k(Cmd::Quit)
            )
        }
    };
    let left = fit(&left, w).to_string();
    let room = w.saturating_sub(str_width(&left));
    // While a reply streams, its pace replaces the key hints: the longest form that fits.
    let pace = app
        .pace()
        .filter(|_| app.toast.is_none())
        .and_then(|(spt, left)| {
            let (spt, left) = (sig2(spt), duration(left));
            [
                format!(" {spt} s/token · at most {left} left "),
                format!(" {spt} s/token · ≤{left} "),
                format!(" ≤{left} left "),
            ]
            .into_iter()
            .find(|t| str_width(t) <= room)
        });
    let right = pace.unwrap_or(right);
    let right = if str_width(&right) <= room {
        right
    } else {
        fit(&right, room).to_string()
    };
    let pad = room.saturating_sub(str_width(&right));
    let line = Line::from(vec![
        Span::styled(left, theme.status),
        Span::styled(" ".repeat(pad), theme.status),
        Span::styled(right, theme.status),
    ]);
    Paragraph::new(line).render(area, buf);
}
