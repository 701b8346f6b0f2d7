//! Front ends. `tui` is the terminal client (ratatui + crossterm): `tui` drives it, `view`
//! draws `&App`, `input` maps terminal events to messages, `theme` holds the styles. `repl` is
//! the plain line-mode client (rustyline, or plain stdin when not a terminal). Both talk to the
//! engine worker only through [`crate::app::protocol`].

pub mod input;
pub mod repl;
pub mod theme;
pub mod tui;
pub mod view;
