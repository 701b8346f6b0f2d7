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
            Action::Up | Action::Char('k') => {
                self.selected = go(at.map_or(last, |i| i.saturating_sub(1)));
            }
            Action::Down | Action::Char('j') => {
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
            // Scrolling works as usual; quitting, help and the other commands leave the mode.
            Action::Scroll(_) | Action::PageUp | Action::PageDown => return false,
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
