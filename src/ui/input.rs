//! Terminal input → [`Msg`]: crossterm key, mouse, paste and resize events mapped through the
//! configured key bindings. Context (is the input box empty, is a popup open) is decided by
//! `App::update`, not here.

use crate::app::config::{Cmd, KeyChord, KeyName};
use crate::app::state::{Action, KeyLabels, Msg};
use crossterm::event::{
    Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers, MouseButton, MouseEvent, MouseEventKind,
};
use ratatui::layout::{Position, Rect};

/// The configured key bindings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyMap {
    bindings: Vec<(Cmd, KeyChord)>,
}

impl KeyMap {
    /// A key map over parsed bindings.
    #[must_use]
    pub fn new(bindings: Vec<(Cmd, KeyChord)>) -> KeyMap {
        KeyMap { bindings }
    }

    /// Labels for the help popup and status bar, with the built-in alternatives.
    #[must_use]
    pub fn labels(&self) -> KeyLabels {
        let extra = |cmd: Cmd| match cmd {
            Cmd::Help => " / ?",
            Cmd::Newline => " / Shift-Enter",
            _ => "",
        };
        KeyLabels(
            self.bindings
                .iter()
                .map(|(cmd, chord)| (*cmd, format!("{chord}{}", extra(*cmd))))
                .collect(),
        )
    }

    fn find(&self, chord: &KeyChord) -> Option<Cmd> {
        self.bindings
            .iter()
            .find(|(_, c)| c == chord)
            .map(|(cmd, _)| *cmd)
    }
}

/// Screen regions the mouse acts on, as last drawn.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Regions {
    /// The budget slider's track (one row).
    pub budget_track: Option<Rect>,
    /// The whole budget pane.
    pub budget_pane: Option<Rect>,
}

fn chord_of(k: &KeyEvent) -> Option<KeyChord> {
    let m = k.modifiers;
    let key = match k.code {
        KeyCode::Char(c) => KeyName::Char(c),
        KeyCode::F(n) => KeyName::F(n),
        KeyCode::Enter => KeyName::Enter,
        KeyCode::Esc => KeyName::Esc,
        KeyCode::Tab | KeyCode::BackTab => KeyName::Tab,
        KeyCode::Backspace => KeyName::Backspace,
        KeyCode::Delete => KeyName::Delete,
        KeyCode::Insert => KeyName::Insert,
        KeyCode::Home => KeyName::Home,
        KeyCode::End => KeyName::End,
        KeyCode::PageUp => KeyName::PageUp,
        KeyCode::PageDown => KeyName::PageDown,
        KeyCode::Up => KeyName::Up,
        KeyCode::Down => KeyName::Down,
        KeyCode::Left => KeyName::Left,
        KeyCode::Right => KeyName::Right,
        _ => return None,
    };
    let ctrl = m.contains(KeyModifiers::CONTROL);
    let alt = m.contains(KeyModifiers::ALT);
    let mut chord = KeyChord {
        key,
        ctrl,
        alt,
        shift: m.contains(KeyModifiers::SHIFT) || k.code == KeyCode::BackTab,
    };
    if let KeyName::Char(c) = key {
        // A character already carries its shift; with Ctrl or Alt letters compare lowercase.
        chord.shift = false;
        if ctrl || alt {
            chord.key = KeyName::Char(c.to_ascii_lowercase());
        }
    }
    Some(chord)
}

/// Built-in keys, used when no binding matched.
fn builtin(k: &KeyEvent) -> Option<Action> {
    let m = k.modifiers;
    let ctrl = m.contains(KeyModifiers::CONTROL);
    let alt = m.contains(KeyModifiers::ALT);
    let shift = m.contains(KeyModifiers::SHIFT);
    Some(match k.code {
        KeyCode::Enter if shift || alt || ctrl => Action::Cmd(Cmd::Newline),
        KeyCode::Enter => Action::Submit,
        KeyCode::Char(c) if ctrl => match c.to_ascii_lowercase() {
            'c' => Action::Interrupt,
            'u' => Action::ClearInput,
            'a' => Action::Home,
            'e' => Action::End,
            'j' => Action::Cmd(Cmd::Newline),
            'd' => Action::Delete,
            'h' => Action::Backspace,
            _ => return None,
        },
        KeyCode::Char(_) if alt => return None,
        KeyCode::Char(c) => Action::Char(c),
        KeyCode::Tab => Action::Char('\t'),
        KeyCode::Esc => Action::Cmd(Cmd::Stop),
        KeyCode::Backspace => Action::Backspace,
        KeyCode::Delete => Action::Delete,
        KeyCode::Left => Action::Left,
        KeyCode::Right => Action::Right,
        KeyCode::Home => Action::Home,
        KeyCode::End => Action::End,
        KeyCode::Up if shift || ctrl => Action::Scroll(1),
        KeyCode::Down if shift || ctrl => Action::Scroll(-1),
        KeyCode::Up => Action::Up,
        KeyCode::Down => Action::Down,
        KeyCode::PageUp => Action::PageUp,
        KeyCode::PageDown => Action::PageDown,
        _ => return None,
    })
}

fn key(k: &KeyEvent, keys: &KeyMap) -> Option<Msg> {
    if k.kind == KeyEventKind::Release {
        return None;
    }
    if let Some(chord) = chord_of(k) {
        if let Some(cmd) = keys.find(&chord) {
            return Some(Msg::Action(match chord.key {
                KeyName::Char(c) if chord.is_printable() => Action::CharOr(c, cmd),
                _ => Action::Cmd(cmd),
            }));
        }
    }
    builtin(k).map(Msg::Action)
}

fn inside(r: Option<Rect>, col: u16, row: u16) -> Option<Rect> {
    r.filter(|r| r.contains(Position::new(col, row)))
}

fn mouse(m: &MouseEvent, regions: &Regions) -> Option<Msg> {
    let (col, row) = (m.column, m.row);
    let on_budget = inside(regions.budget_pane, col, row).is_some();
    let action = match m.kind {
        MouseEventKind::ScrollUp if on_budget => Action::BudgetWheel(1),
        MouseEventKind::ScrollDown if on_budget => Action::BudgetWheel(-1),
        MouseEventKind::ScrollUp => Action::Scroll(3),
        MouseEventKind::ScrollDown => Action::Scroll(-3),
        MouseEventKind::Down(MouseButton::Left) | MouseEventKind::Drag(MouseButton::Left) => {
            let track = inside(regions.budget_track, col, row)?;
            let span = f64::from(track.width.saturating_sub(1).max(1));
            Action::BudgetAt(f64::from(col - track.x) / span)
        }
        _ => return None,
    };
    Some(Msg::Action(action))
}

/// Map one terminal event to a message (`None`: nothing to do).
#[must_use]
pub fn translate(ev: &Event, keys: &KeyMap, regions: &Regions) -> Option<Msg> {
    match ev {
        Event::Key(k) => key(k, keys),
        Event::Mouse(m) => mouse(m, regions),
        Event::Paste(text) => Some(Msg::Paste(text.clone())),
        Event::Resize(width, height) => Some(Msg::Resize {
            width: *width,
            height: *height,
        }),
        Event::FocusGained | Event::FocusLost => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::app::config::KeysConfig;

    fn keymap() -> KeyMap {
        KeyMap::new(KeysConfig::default().bindings().unwrap())
    }

    fn press(code: KeyCode, m: KeyModifiers) -> Option<Msg> {
        translate(
            &Event::Key(KeyEvent::new(code, m)),
            &keymap(),
            &Regions::default(),
        )
    }

    fn action(code: KeyCode, m: KeyModifiers) -> Action {
        match press(code, m) {
            Some(Msg::Action(a)) => a,
            other => panic!("{code:?} {m:?}: {other:?}"),
        }
    }

    #[test]
    fn keys_map_to_actions() {
        let none = KeyModifiers::NONE;
        let ctrl = KeyModifiers::CONTROL;
        assert_eq!(action(KeyCode::Enter, none), Action::Submit);
        assert_eq!(
            action(KeyCode::Enter, KeyModifiers::SHIFT),
            Action::Cmd(Cmd::Newline)
        );
        assert_eq!(
            action(KeyCode::Enter, KeyModifiers::ALT),
            Action::Cmd(Cmd::Newline)
        );
        assert_eq!(action(KeyCode::Char('j'), ctrl), Action::Cmd(Cmd::Newline));
        assert_eq!(action(KeyCode::Char('c'), ctrl), Action::Interrupt);
        assert_eq!(action(KeyCode::Char('y'), ctrl), Action::Cmd(Cmd::Copy));
        assert_eq!(action(KeyCode::Char('Y'), ctrl), Action::Cmd(Cmd::Copy));
        assert_eq!(action(KeyCode::Esc, none), Action::Cmd(Cmd::Stop));
        assert_eq!(action(KeyCode::F(1), none), Action::Cmd(Cmd::Help));
        assert_eq!(
            action(KeyCode::Char('['), none),
            Action::CharOr('[', Cmd::BudgetDown)
        );
        assert_eq!(action(KeyCode::Char('x'), none), Action::Char('x'));
        assert_eq!(
            action(KeyCode::Char('X'), KeyModifiers::SHIFT),
            Action::Char('X')
        );
        assert_eq!(action(KeyCode::Tab, none), Action::Cmd(Cmd::Focus));
        assert_eq!(action(KeyCode::Up, KeyModifiers::SHIFT), Action::Scroll(1));
        assert!(press(KeyCode::Char('z'), KeyModifiers::ALT).is_none());
        assert!(press(KeyCode::CapsLock, none).is_none());
        let release = KeyEvent::new_with_kind(KeyCode::Char('a'), none, KeyEventKind::Release);
        assert!(translate(&Event::Key(release), &keymap(), &Regions::default()).is_none());
    }

    #[test]
    fn mouse_scrolls_and_moves_the_slider() {
        let regions = Regions {
            budget_track: Some(Rect::new(10, 5, 11, 1)),
            budget_pane: Some(Rect::new(9, 3, 13, 5)),
        };
        let ev = |kind, column, row| {
            translate(
                &Event::Mouse(MouseEvent {
                    kind,
                    column,
                    row,
                    modifiers: KeyModifiers::NONE,
                }),
                &keymap(),
                &regions,
            )
        };
        assert!(matches!(
            ev(MouseEventKind::ScrollUp, 0, 0),
            Some(Msg::Action(Action::Scroll(3)))
        ));
        assert!(matches!(
            ev(MouseEventKind::ScrollDown, 10, 4),
            Some(Msg::Action(Action::BudgetWheel(-1)))
        ));
        match ev(MouseEventKind::Down(MouseButton::Left), 15, 5) {
            Some(Msg::Action(Action::BudgetAt(f))) => assert!((f - 0.5).abs() < 1e-9),
            other => panic!("{other:?}"),
        }
        assert!(ev(MouseEventKind::Down(MouseButton::Left), 0, 0).is_none());
        assert!(ev(MouseEventKind::Moved, 15, 5).is_none());
    }

    #[test]
    fn paste_and_resize_pass_through() {
        let km = keymap();
        let r = Regions::default();
        assert!(matches!(
            translate(&Event::Paste("a\u{1b}[31mb".into()), &km, &r),
            Some(Msg::Paste(t)) if t == "a\u{1b}[31mb"
        ));
        assert!(matches!(
            translate(&Event::Resize(3, 4), &km, &r),
            Some(Msg::Resize {
                width: 3,
                height: 4
            })
        ));
        assert!(translate(&Event::FocusLost, &km, &r).is_none());
        assert!(km.labels().of(Cmd::Help).starts_with("F1"));
    }
}
