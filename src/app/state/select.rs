//! Select mode: a highlight that moves over the conversation's messages and over the code
//! blocks inside the replies; `y` copies what it is on (a message as its text, a code block as
//! its code without the fences) through [`Effect::Copy`], which the driver writes as OSC 52.
//!
//! Code blocks are found with the same Markdown parser and options the view renders replies
//! with ([`markdown_options`]), so the n-th block here is the n-th block on the screen.

use super::{Action, App, Effect, Item};
use crate::app::config::Cmd;
use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};

/// The Markdown extensions replies are read with: tables, strikethrough, task lists and
/// footnotes (CommonMark otherwise).
#[must_use]
pub fn markdown_options() -> Options {
    Options::ENABLE_TABLES
        | Options::ENABLE_STRIKETHROUGH
        | Options::ENABLE_TASKLISTS
        | Options::ENABLE_FOOTNOTES
}

/// The code of every code block (fenced or indented) in `text`, in order, without fences,
/// info strings or the indentation of an indented block.
#[must_use]
pub fn code_blocks(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur: Option<String> = None;
    for ev in Parser::new_ext(text, markdown_options()) {
        match ev {
            Event::Start(Tag::CodeBlock(_)) => cur = Some(String::new()),
            Event::End(TagEnd::CodeBlock) => out.extend(cur.take()),
            Event::Text(t) => {
                if let Some(c) = cur.as_mut() {
                    c.push_str(&t);
                }
            }
            _ => {}
        }
    }
    out
}

/// What the select-mode highlight is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// A whole message (`App::items[_]`: a user message or a reply).
    Message(usize),
    /// Code block `block` (0-based, in order) of the reply at `App::items[item]`.
    Code {
        /// The reply's index in `App::items`.
        item: usize,
        /// The block's index in the reply.
        block: usize,
    },
}

impl App {
    /// Everything the select-mode highlight can be on, top to bottom: each message, then the
    /// code blocks of a reply right after it. Raw continuations are shown as plain text, so
    /// they have no code blocks.
    #[must_use]
    pub fn targets(&self) -> Vec<Target> {
        let mut out = Vec::new();
        for (i, item) in self.items.iter().enumerate() {
            match item {
                Item::User { text, .. } if !text.is_empty() => out.push(Target::Message(i)),
                Item::Reply(r) if !r.content.is_empty() => {
                    out.push(Target::Message(i));
                    if !r.raw {
                        let n = code_blocks(&r.content).len();
                        out.extend((0..n).map(|block| Target::Code { item: i, block }));
                    }
                }
                _ => {}
            }
        }
        out
    }

    /// The text `y` copies for `target`: a message as it was written (a reply's Markdown
    /// source, without its thinking channel), a code block as its code.
    #[must_use]
    pub fn target_text(&self, target: Target) -> Option<String> {
        match target {
            Target::Message(i) => match self.items.get(i)? {
                Item::User { text, .. } => Some(text.clone()),
                Item::Reply(r) => Some(r.content.clone()),
                _ => None,
            },
            Target::Code { item, block } => match self.items.get(item)? {
                Item::Reply(r) if !r.raw => code_blocks(&r.content).into_iter().nth(block),
                _ => None,
            },
        }
    }

    /// Enter select mode on the newest message (or say there is nothing to select).
    pub(super) fn enter_select(&mut self) {
        let targets = self.targets();
        let start = targets
            .iter()
            .rev()
            .find(|t| matches!(t, Target::Message(_)))
            .copied();
        match start {
            Some(t) => {
                self.selected = Some(t);
                let k = |c: Cmd| {
                    self.keys
                        .of(c)
                        .split(" / ")
                        .next()
                        .unwrap_or("?")
                        .to_string()
                };
                self.toast(format!(
                    "select: ↑/↓ or j/k move · y copies · {} leaves",
                    k(Cmd::Stop)
                ));
            }
            None => self.toast("nothing to select yet"),
        }
    }

    /// A key in select mode; returns false when the key is not select mode's (the caller
    /// handles it as usual).
    pub(super) fn select_action(&mut self, a: &Action, fx: &mut Vec<Effect>) -> bool {
        let Some(current) = self.selected else {
            return false;
        };
        let targets = self.targets();
        if targets.is_empty() {
            // The conversation was cleared under the highlight (a new conversation, a load).
            self.selected = None;
            return false;
        }
        let at = targets.iter().position(|t| *t == current);
        let last = targets.len() - 1;
        let go = |i: usize| Some(targets[i.min(last)]);
        match a {
            // The wheel and the page keys move the highlight too (the view keeps it in sight).
            Action::Up | Action::Char('k') | Action::PageUp => {
                self.selected = go(at.map_or(last, |i| i.saturating_sub(1)));
            }
            Action::Scroll(n) if *n > 0 => {
                self.selected = go(at.map_or(last, |i| i.saturating_sub(1)));
            }
            Action::Down | Action::Char('j') | Action::PageDown | Action::Scroll(_) => {
                self.selected = go(at.map_or(last, |i| i + 1));
            }
            Action::Home | Action::Char('g') => self.selected = go(0),
            Action::End | Action::Char('G') => self.selected = go(last),
            Action::Char('y') | Action::Submit | Action::Cmd(Cmd::Copy) => {
                let target = at.map_or(targets[last], |i| targets[i]);
                self.selected = None;
                match self.target_text(target) {
                    Some(text) => {
                        let what = match target {
                            Target::Message(_) => "the message",
                            Target::Code { .. } => "the code block",
                        };
                        self.toast(format!(
                            "copied {what} ({} characters)",
                            text.chars().count()
                        ));
                        fx.push(Effect::Copy(text));
                    }
                    None => self.toast("nothing to copy there"),
                }
            }
            Action::Cmd(Cmd::Stop | Cmd::Select) | Action::Char('q') | Action::Interrupt => {
                self.selected = None;
                self.toast("select mode left");
            }
            // Quitting, help and the other commands leave the mode and do their work.
            Action::Cmd(_) | Action::CharOr(..) => {
                self.selected = None;
                return false;
            }
            // Nothing is typed while selecting.
            _ => {}
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::app::config::{KeyChord, KeysConfig, ThemeName};
    use crate::app::protocol::{EngineEvent, Request, TurnId};
    use crate::app::state::{AppInit, KeyLabels, Msg, Phase};
    use crate::session::chat::{Mode, Stop, TurnReport};

    fn app() -> App {
        let labels = KeysConfig::default()
            .bindings()
            .unwrap_or_default()
            .into_iter()
            .map(|(c, k): (Cmd, KeyChord)| (c, k.to_string()))
            .collect();
        let mut app = App::new(AppInit {
            model: "tiny".into(),
            session: None,
            resume: false,
            thinking: false,
            effort: "max".into(),
            context_limit: 4096,
            max_tokens: 64,
            budget_gb: None,
            keys: KeyLabels(labels),
            theme: ThemeName::Dark,
            history: Vec::new(),
        });
        app.update(Msg::Engine(EngineEvent::Ready {
            info: "k3: tiny, session \"s\", chat mode".into(),
        }));
        app
    }

    fn act(app: &mut App, a: Action) -> Vec<Effect> {
        app.update(Msg::Action(a))
    }

    fn send(app: &mut App, text: &str) -> TurnId {
        for c in text.chars() {
            act(app, Action::Char(c));
        }
        act(app, Action::Submit)
            .into_iter()
            .find_map(|e| match e {
                Effect::Send(Request::Send { turn, .. }) => Some(turn),
                _ => None,
            })
            .unwrap_or(0)
    }

    fn reply(app: &mut App, turn: TurnId, text: &str) {
        app.update(Msg::Engine(EngineEvent::TurnDone {
            turn,
            report: Box::new(TurnReport {
                mode: Mode::Chat,
                prompt_ids: vec![1; 4],
                generated_ids: vec![2; 4],
                generated_tokens: 4,
                reply: text.into(),
                reasoning: None,
                reused_tokens: 0,
                prefilled_tokens: 4,
                stop: Stop::End(3),
                accepted: true,
                rejected_because: None,
                prefill_seconds: 0.1,
                decode_seconds: 0.1,
                context_warning: None,
            }),
        }));
    }

    fn copied(fx: &[Effect]) -> Option<&str> {
        fx.iter().find_map(|e| match e {
            Effect::Copy(t) => Some(t.as_str()),
            _ => None,
        })
    }

    const TWO_BLOCKS: &str = "Two ways:\n\n```sh\nls -l\n```\n\nor\n\n    cat x\n    wc -l x\n";

    #[test]
    fn code_blocks_are_found_without_their_fences() {
        assert_eq!(code_blocks(TWO_BLOCKS), vec!["ls -l\n", "cat x\nwc -l x\n"]);
        assert_eq!(
            code_blocks("~~~\na\n~~~\n- item\n\n  ```\n  b\n  ```\n"),
            vec!["a\n", "b\n"]
        );
        // A fence still open (a reply streaming) is a block up to the end.
        assert_eq!(code_blocks("x\n```rust\nfn f() {"), vec!["fn f() {"]);
        assert!(code_blocks("no `code` block").is_empty());
    }

    #[test]
    fn select_mode_moves_over_messages_and_code_blocks_and_copies() {
        let mut app = app();
        let base = app.items.len();
        let t = send(&mut app, "first question");
        reply(&mut app, t, TWO_BLOCKS);
        let t = send(&mut app, "second");
        reply(&mut app, t, "plain answer");
        let (u1, r1, u2, r2) = (base, base + 1, base + 2, base + 3);
        assert_eq!(
            app.targets(),
            vec![
                Target::Message(u1),
                Target::Message(r1),
                Target::Code { item: r1, block: 0 },
                Target::Code { item: r1, block: 1 },
                Target::Message(u2),
                Target::Message(r2),
            ]
        );
        assert!(act(&mut app, Action::Cmd(Cmd::Select)).is_empty());
        assert_eq!(app.selected, Some(Target::Message(r2)));
        // Up/Down and k/j move; nothing is typed.
        act(&mut app, Action::Up);
        act(&mut app, Action::Char('k'));
        assert_eq!(app.selected, Some(Target::Code { item: r1, block: 1 }));
        act(&mut app, Action::Char('k'));
        act(&mut app, Action::Char('j'));
        assert_eq!(app.selected, Some(Target::Code { item: r1, block: 1 }));
        act(&mut app, Action::Scroll(3));
        assert_eq!(app.selected, Some(Target::Code { item: r1, block: 0 }));
        act(&mut app, Action::PageDown);
        assert!(app.input.is_empty());
        // The code is copied without its indentation, and select mode ends.
        let fx = act(&mut app, Action::Char('y'));
        assert_eq!(copied(&fx), Some("cat x\nwc -l x\n"));
        assert_eq!(app.selected, None);
        assert!(app
            .toast
            .as_ref()
            .is_some_and(|t| t.0.contains("code block")));
        // A reply is copied as its Markdown source; Home goes to the top.
        act(&mut app, Action::Cmd(Cmd::Select));
        act(&mut app, Action::Home);
        assert_eq!(app.selected, Some(Target::Message(u1)));
        act(&mut app, Action::Down);
        let fx = act(&mut app, Action::Cmd(Cmd::Copy));
        assert_eq!(copied(&fx), Some(TWO_BLOCKS));
        // End goes to the bottom and stays there; Up at the top stays at the top.
        act(&mut app, Action::Cmd(Cmd::Select));
        act(&mut app, Action::End);
        act(&mut app, Action::Down);
        assert_eq!(app.selected, Some(Target::Message(r2)));
        act(&mut app, Action::Char('g'));
        act(&mut app, Action::Up);
        let fx = act(&mut app, Action::Submit);
        assert_eq!(copied(&fx), Some("first question"));
        // Esc leaves without copying; the next keys type again.
        act(&mut app, Action::Cmd(Cmd::Select));
        let fx = act(&mut app, Action::Cmd(Cmd::Stop));
        assert!(copied(&fx).is_none());
        assert_eq!(app.selected, None);
        act(&mut app, Action::Char('j'));
        assert_eq!(app.input.text(), "j");
    }

    #[test]
    fn select_mode_with_nothing_to_select_says_so() {
        let mut app = app();
        act(&mut app, Action::Cmd(Cmd::Select));
        assert_eq!(app.selected, None);
        assert!(app.toast.as_ref().is_some_and(|t| t.0.contains("nothing")));
    }

    #[test]
    fn select_mode_works_while_a_reply_streams_and_other_commands_leave_it() {
        let mut app = app();
        let t = send(&mut app, "go");
        let r = app.items.len() - 1;
        app.update(Msg::Engine(EngineEvent::Token {
            turn: t,
            id: 5,
            text: "```py\nprint(1)\n".into(),
            position: 0,
        }));
        assert!(matches!(app.phase, Phase::Streaming { .. }));
        act(&mut app, Action::Cmd(Cmd::Select));
        act(&mut app, Action::Down);
        assert_eq!(app.selected, Some(Target::Code { item: r, block: 0 }));
        let fx = act(&mut app, Action::Char('y'));
        assert_eq!(copied(&fx), Some("print(1)\n"));
        // Esc in select mode leaves it and does not stop the reply.
        act(&mut app, Action::Cmd(Cmd::Select));
        let fx = act(&mut app, Action::Cmd(Cmd::Stop));
        assert!(!fx.iter().any(|e| matches!(e, Effect::Cancel)));
        assert!(app.busy());
        // Another command key leaves select mode and does its work.
        act(&mut app, Action::Cmd(Cmd::Select));
        act(&mut app, Action::Cmd(Cmd::Help));
        assert_eq!(app.selected, None);
        assert!(app.dialog.is_some());
    }
}
