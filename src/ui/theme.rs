//! Every style the terminal client draws with, in one place, for each colour scheme.

use crate::app::config::ThemeName;
use ratatui::style::{Color, Modifier, Style};

/// The styles of one colour scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Theme {
    /// Ordinary text.
    pub text: Style,
    /// Secondary text (info lines, summaries, hints).
    pub dim: Style,
    /// The user's messages and their label.
    pub user: Style,
    /// The model's label.
    pub assistant: Style,
    /// The thinking channel.
    pub reasoning: Style,
    /// Code-block lines.
    pub code: Style,
    /// Errors.
    pub error: Style,
    /// Warnings and notes (a reply not added to the history).
    pub warn: Style,
    /// Pane and popup borders.
    pub border: Style,
    /// The border of the focused widget.
    pub focus: Style,
    /// Titles.
    pub title: Style,
    /// The status bar.
    pub status: Style,
    /// A selected row.
    pub selected: Style,
    /// Filled part of a gauge or slider.
    pub fill: Style,
    /// Empty part of a gauge or slider.
    pub empty: Style,
    /// Sparklines.
    pub spark: Style,
    /// A layer with every expert resident.
    pub heat_full: Style,
    /// A layer with some experts resident.
    pub heat_part: Style,
    /// A layer with no expert resident.
    pub heat_none: Style,
    /// A dense layer (no routed experts).
    pub heat_dense: Style,
}

impl Theme {
    /// The styles of `name`.
    #[must_use]
    pub fn new(name: ThemeName) -> Theme {
        match name {
            ThemeName::Dark => Theme::colored(Color::Gray, Color::DarkGray, Color::Black),
            ThemeName::Light => Theme::colored(Color::Black, Color::Gray, Color::White),
            ThemeName::Mono => Theme::mono(),
        }
    }

    fn colored(fg: Color, dim: Color, _bg: Color) -> Theme {
        let s = Style::new();
        Theme {
            text: s.fg(fg),
            dim: s.fg(dim),
            user: s.fg(Color::Cyan).add_modifier(Modifier::BOLD),
            assistant: s.fg(Color::Green).add_modifier(Modifier::BOLD),
            reasoning: s.fg(dim).add_modifier(Modifier::ITALIC),
            code: s.fg(Color::Yellow),
            error: s.fg(Color::Red).add_modifier(Modifier::BOLD),
            warn: s.fg(Color::Yellow),
            border: s.fg(dim),
            focus: s.fg(Color::Cyan),
            title: s.fg(fg).add_modifier(Modifier::BOLD),
            status: s.add_modifier(Modifier::REVERSED),
            selected: s.add_modifier(Modifier::REVERSED),
            fill: s.fg(Color::Green),
            empty: s.fg(dim),
            spark: s.fg(Color::Cyan),
            heat_full: s.fg(Color::Green),
            heat_part: s.fg(Color::Yellow),
            heat_none: s.fg(Color::Red),
            heat_dense: s.fg(Color::Blue),
        }
    }

    fn mono() -> Theme {
        let s = Style::new();
        let dim = s.add_modifier(Modifier::DIM);
        let bold = s.add_modifier(Modifier::BOLD);
        Theme {
            text: s,
            dim,
            user: bold,
            assistant: bold,
            reasoning: dim.add_modifier(Modifier::ITALIC),
            code: s,
            error: bold,
            warn: s.add_modifier(Modifier::UNDERLINED),
            border: dim,
            focus: bold,
            title: bold,
            status: s.add_modifier(Modifier::REVERSED),
            selected: s.add_modifier(Modifier::REVERSED),
            fill: s,
            empty: dim,
            spark: s,
            heat_full: s,
            heat_part: s,
            heat_none: dim,
            heat_dense: dim,
        }
    }
}
