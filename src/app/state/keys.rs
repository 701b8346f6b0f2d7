//! How keys, the mouse, pastes and dialog choices change the [`App`]: the input box, sending
//! messages and slash commands, cancelling, quitting, the budget slider and the popups.

use super::editor::{self, Editor};
use super::{
    round_sig3, Action, App, Dialog, Effect, Focus, Item, Phase, Purpose, Reply, ReplyKind,
    ReplyState, SessionDialog, BUDGET_STEPS, CANCELLED_KEEP,
};
use crate::app::config::Cmd;
use crate::app::protocol::{Request, TurnId};
use crate::session::chat::Mode;
use crate::session::commands::{self, Command, Think};
use crate::session::template::{Phase as Channel, TolerantParser};

impl App {
    // ---------------------------------------------------------------------------------------
    // Keys
    // ---------------------------------------------------------------------------------------

    pub(super) fn action(&mut self, a: Action, fx: &mut Vec<Effect>) {
        if let Phase::Failed { code, .. } = self.phase {
            // Any key leaves once the engine has stopped.
            if !matches!(
                a,
                Action::Scroll(_) | Action::PageUp | Action::PageDown | Action::BudgetWheel(_)
            ) {
                self.phase = Phase::Exiting;
                fx.push(Effect::Quit { code });
            }
            return;
        }
        if self.phase == Phase::Exiting {
            return;
        }
        if self.dialog.is_some() {
            self.dialog_action(a, fx);
            return;
        }
        if self.selected.is_some() && self.select_action(&a, fx) {
            return;
        }
        if self.focus == Focus::Budget && self.budget_focus_action(&a, fx) {
            return;
        }
        match a {
            Action::Cmd(c) => self.command_key(c, fx),
            Action::CharOr(ch, c) => {
                if self.input.is_empty() {
                    self.command_key(c, fx);
                } else {
                    self.type_char(ch);
                }
            }
            Action::Char(ch) => {
                let empty = self.input.is_empty();
                match ch {
                    '?' if empty => self.open_help(),
                    _ => self.type_char(ch),
                }
            }
            Action::Submit => self.submit(fx),
            Action::Backspace => self.input.backspace(),
            Action::Delete => self.input.delete(),
            Action::Left => self.input.left(),
            Action::Right => self.input.right(),
            Action::Home => self.input.home(),
            Action::End => self.input.end(),
            Action::Up => {
                if !self.input.up() {
                    if let Some(t) = self.history.older(self.input.text()) {
                        let t = t.to_string();
                        self.input.set(&t);
                    }
                }
            }
            Action::Down => {
                if !self.input.down() {
                    if let Some(t) = self.history.newer() {
                        let t = t.to_string();
                        self.input.set(&t);
                    }
                }
            }
            Action::ClearInput => {
                self.input.take();
            }
            Action::PageUp => self.scroll_by(self.page.max(2) as i64 - 1),
            Action::PageDown => self.scroll_by(-(self.page.max(2) as i64 - 1)),
            Action::Scroll(n) => self.scroll_by(i64::from(n)),
            Action::BudgetWheel(n) => self.budget_move(i64::from(n), fx),
            Action::BudgetAt(f) => self.budget_at(f, fx),
            Action::Interrupt => {
                if self.busy() {
                    self.cancel(fx);
                } else if !self.input.is_empty() {
                    self.input.take();
                } else {
                    self.request_quit(fx);
                }
            }
        }
    }

    /// Keys while the budget slider has the focus; true when consumed.
    pub(super) fn budget_focus_action(&mut self, a: &Action, fx: &mut Vec<Effect>) -> bool {
        match a {
            Action::Left | Action::Down | Action::Char('[' | '-') => self.budget_move(-1, fx),
            Action::Right | Action::Up | Action::Char(']' | '+') => self.budget_move(1, fx),
            Action::Home => self.budget_set(0, fx),
            Action::End => self.budget_set(BUDGET_STEPS, fx),
            Action::Cmd(Cmd::Stop | Cmd::Focus) | Action::Submit => self.focus = Focus::Input,
            _ => return false,
        }
        true
    }

    pub(super) fn open_help(&mut self) {
        self.help_scroll = 0;
        self.dialog = Some(Dialog::Help);
    }

    pub(super) fn type_char(&mut self, ch: char) {
        if !self.input.insert_char(ch) {
            self.toast("the input box is full");
        }
    }

    pub(super) fn paste(&mut self, text: &str) {
        if self.dialog.is_some() || matches!(self.phase, Phase::Failed { .. } | Phase::Exiting) {
            return;
        }
        self.focus = Focus::Input;
        let dropped = self.input.insert_str(text);
        if dropped > 0 {
            self.toast(format!(
                "paste cut to fit the input box ({} KB max): {dropped} bytes dropped",
                editor::MAX_INPUT_BYTES / 1024
            ));
        }
    }

    pub(super) fn command_key(&mut self, c: Cmd, fx: &mut Vec<Effect>) {
        match c {
            Cmd::Help => self.open_help(),
            Cmd::Quit => self.request_quit(fx),
            Cmd::Stop => {
                if self.busy() {
                    self.cancel(fx);
                }
            }
            Cmd::Copy => match self.last_reply().map(str::to_string) {
                Some(text) => {
                    self.toast(format!(
                        "copied the last reply ({} characters)",
                        text.chars().count()
                    ));
                    fx.push(Effect::Copy(text));
                }
                None => self.toast("no reply to copy yet"),
            },
            Cmd::Mode => {
                let cmd = match self.mode {
                    Mode::Chat => Command::Raw,
                    Mode::Raw => Command::Chat,
                };
                self.send_command(cmd, fx);
            }
            Cmd::Thinking => {
                self.show_thinking = !self.show_thinking;
                self.toast(if self.show_thinking {
                    "thinking shown"
                } else {
                    "thinking collapsed"
                });
            }
            Cmd::Sessions => {
                self.dialog = Some(Dialog::Sessions(SessionDialog::default()));
                self.fetch_sessions(fx);
            }
            Cmd::BudgetDown => self.budget_move(-1, fx),
            Cmd::BudgetUp => self.budget_move(1, fx),
            Cmd::Newline => self.type_char('\n'),
            Cmd::Follow => self.scroll = 0,
            Cmd::Focus => {
                // The slider is in a pane: focusing it shows the panes.
                self.hide_panes = false;
                self.focus = Focus::Budget;
            }
            Cmd::New => self.new_conversation(fx),
            Cmd::AnswerNow => self.answer_now(fx),
            Cmd::Effort => {
                // off → low → high → max → off, from what the changes already asked for will
                // leave (two presses step twice); the engine applies it to the next reply.
                let next = step_effort(self.wanted_thinking());
                self.change_thinking(next, fx);
            }
            Cmd::Select => self.enter_select(),
            Cmd::Panes => {
                self.hide_panes = !self.hide_panes;
                if self.hide_panes && self.focus == Focus::Budget {
                    self.focus = Focus::Input;
                }
                self.toast(if self.hide_panes {
                    format!("panes hidden ({})", self.keys.of(Cmd::Panes))
                } else {
                    "panes shown".to_string()
                });
            }
        }
    }

    /// Thinking and its effort as they will be once the thinking changes sent are applied.
    pub(super) fn wanted_thinking(&self) -> (bool, String) {
        let mut state = (self.thinking, self.effort.clone());
        for (_, p) in &self.pending {
            if let Purpose::Command(Command::Think(t)) = p {
                state = thinking_after(*t, state);
            }
        }
        state
    }

    /// Change thinking: at once in a conversation without turns, else after saying what it
    /// costs (the conversation is read again) and asking.
    pub(super) fn change_thinking(&mut self, t: Think, fx: &mut Vec<Effect>) {
        if self.held_positions() > 0 && !self.busy() {
            self.dialog = Some(Dialog::ConfirmThink(t));
        } else {
            self.send_command(Command::Think(t), fx);
        }
    }

    /// The "answer now" key: while a chat reply is in its thinking channel, close it.
    pub(super) fn answer_now(&mut self, fx: &mut Vec<Effect>) {
        let in_thinking = matches!(
            &self.parser,
            Some((t, p)) if Some(*t) == self.live_turn() && p.phase() == Channel::Reasoning
        );
        if in_thinking {
            fx.push(Effect::AnswerNow);
            self.toast("answering now: the thinking ends at the next token");
        } else if self.busy() {
            self.toast("the reply is not in its thinking channel");
        } else {
            self.toast("answer now ends a reply's thinking while it is written");
        }
    }

    pub(super) fn scroll_by(&mut self, n: i64) {
        let s = (self.scroll as i64 + n).clamp(0, self.max_scroll as i64);
        self.scroll = usize::try_from(s).unwrap_or(0);
    }

    pub(super) fn viewport(&mut self, max_scroll: usize, page: usize) -> bool {
        let before = (self.scroll, self.max_scroll, self.page);
        if self.scroll > 0 && max_scroll > self.max_scroll {
            // Keep the lines being read in place while new text arrives below them.
            self.scroll += max_scroll - self.max_scroll;
        }
        self.max_scroll = max_scroll;
        self.page = page;
        self.scroll = self.scroll.min(max_scroll);
        // Only a change of the scroll position changes what is drawn.
        before.0 != self.scroll
    }

    pub(super) fn tick(&mut self) -> bool {
        self.ticks += 1;
        let mut visible = matches!(
            self.phase,
            Phase::Loading | Phase::Prefill { .. } | Phase::Streaming { .. }
        );
        if let Some((_, left)) = &mut self.toast {
            *left = left.saturating_sub(1);
            if *left == 0 {
                self.toast = None;
                visible = true;
            }
        }
        visible
    }

    // ---------------------------------------------------------------------------------------
    // Sending
    // ---------------------------------------------------------------------------------------

    /// Refuse a request the engine cannot take now; true when refused.
    pub(super) fn refuse_now(&mut self) -> bool {
        let why = match self.phase {
            Phase::Loading => "the model is still loading",
            Phase::Prefill { .. } | Phase::Streaming { .. } => {
                "a reply is being generated; Esc stops it"
            }
            _ => return false,
        };
        self.toast(why);
        true
    }

    pub(super) fn submit(&mut self, fx: &mut Vec<Effect>) {
        let text = self.input.text().to_string();
        if text.trim().is_empty() {
            return;
        }
        match commands::parse(&text) {
            Some(Err(msg)) => {
                // The refused line is shown above its error, like any command line.
                self.history.push(&text);
                self.input.take();
                self.items.push(Item::Info(format!("› {}", text.trim())));
                self.items.push(Item::Error(msg));
            }
            Some(Ok(Command::Quit)) => {
                self.input.take();
                self.request_quit(fx);
            }
            Some(Ok(Command::Help)) => {
                self.input.take();
                self.open_help();
            }
            Some(Ok(Command::Think(t))) if self.held_positions() > 0 && !self.busy() => {
                self.history.push(&text);
                self.input.take();
                self.dialog = Some(Dialog::ConfirmThink(t));
            }
            Some(Ok(Command::Load(name))) if self.dirty && !self.busy() => {
                self.history.push(&text);
                self.input.take();
                self.dialog = Some(Dialog::ConfirmLoad(name));
            }
            Some(Ok(cmd)) => {
                if self.refuse_now() {
                    return;
                }
                self.history.push(&text);
                self.input.take();
                self.items.push(Item::Info(format!("› {}", text.trim())));
                self.send_command(cmd, fx);
            }
            None => {
                // A message sent while a reply is written waits for that reply to end.
                if matches!(self.phase, Phase::Prefill { .. } | Phase::Streaming { .. }) {
                    if self.queued.is_some() {
                        self.toast("a message is already waiting for this reply to end");
                        return;
                    }
                    self.history.push(&text);
                    self.input.take();
                    self.queued = Some(text);
                    self.toast(
                        "queued: sent when this reply ends (Esc stops the reply and gives it back)",
                    );
                    return;
                }
                if self.refuse_now() {
                    return;
                }
                self.history.push(&text);
                self.input.take();
                self.send_message(&text, fx);
            }
        }
        self.scroll = 0;
    }

    /// Send `text` as the next message (`//text` sends a literal `/text`).
    pub(super) fn send_message(&mut self, text: &str, fx: &mut Vec<Effect>) {
        let literal = text
            .strip_prefix('/')
            .filter(|t| t.starts_with('/'))
            .unwrap_or(text)
            .to_string();
        let turn = self.start_reply(Some(literal.clone()), ReplyKind::Send);
        fx.push(Effect::Send(Request::Send {
            turn,
            text: literal,
        }));
    }

    /// The reply ended: send the message waiting for it (`sent`), or, when the reply was
    /// stopped or failed, give it back to the input box (prepended to what is typed there).
    pub(super) fn release_queued(&mut self, sent: bool, fx: &mut Vec<Effect>) {
        let Some(text) = self.queued.take() else {
            return;
        };
        if sent {
            self.send_message(&text, fx);
        } else {
            let typed = self.input.take();
            let back = if typed.is_empty() {
                text
            } else {
                format!("{text}\n{typed}")
            };
            self.input.set(&back);
            self.toast("the queued message is back in the input box");
        }
    }

    /// Add the user's text (if any) and an empty live reply; returns the turn.
    pub(super) fn start_reply(&mut self, user: Option<String>, kind: ReplyKind) -> TurnId {
        let raw = self.mode == Mode::Raw;
        if let Some(text) = user {
            self.items.push(Item::User { text, raw });
        }
        let turn = self.turn(Purpose::Reply(kind));
        self.items.push(Item::Reply(Reply {
            turn,
            reasoning: String::new(),
            content: String::new(),
            raw,
            state: ReplyState::Live,
            summary: None,
            note: None,
        }));
        self.parser = (!raw).then(|| (turn, TolerantParser::new(self.thinking)));
        self.disk_at_start = self.stats.last.as_ref().map(|s| s.disk_bytes_read);
        self.phase = Phase::Prefill {
            turn,
            done: 0,
            total: 0,
        };
        self.dirty = true;
        turn
    }

    pub(super) fn send_command(&mut self, cmd: Command, fx: &mut Vec<Effect>) {
        if self.refuse_now() {
            return;
        }
        let turn = match &cmd {
            Command::Regen => self.start_reply(None, ReplyKind::Regen),
            Command::Edit(text) => self.start_reply(Some(text.clone()), ReplyKind::Edit),
            _ => self.turn(Purpose::Command(cmd.clone())),
        };
        fx.push(Effect::Send(Request::Command { turn, command: cmd }));
    }

    pub(super) fn cancel(&mut self, fx: &mut Vec<Effect>) {
        let Some(turn) = self.live_turn() else {
            return;
        };
        fx.push(Effect::Cancel);
        self.take_pending(turn);
        self.cancelled.push_back(turn);
        if self.cancelled.len() > CANCELLED_KEEP {
            self.cancelled.pop_front();
        }
        self.finish_parser(turn);
        if let Some(r) = self.reply_mut(turn) {
            r.state = ReplyState::Stopped;
            r.summary = Some("stopped; the session is kept".into());
        }
        self.phase = Phase::Idle;
        self.release_queued(false, fx);
    }

    pub(super) fn request_quit(&mut self, fx: &mut Vec<Effect>) {
        if self.dirty {
            self.dialog = Some(Dialog::ConfirmQuit);
        } else {
            self.quit(fx);
        }
    }

    pub(super) fn quit(&mut self, fx: &mut Vec<Effect>) {
        if self.busy() {
            fx.push(Effect::Cancel);
        }
        self.dialog = None;
        self.phase = Phase::Exiting;
        fx.push(Effect::Quit { code: 0 });
    }

    // ---------------------------------------------------------------------------------------
    // Budget slider
    // ---------------------------------------------------------------------------------------

    pub(super) fn budget_move(&mut self, delta: i64, fx: &mut Vec<Effect>) {
        let step = (i64::from(self.budget.step) + delta).clamp(0, i64::from(BUDGET_STEPS));
        self.budget_set(u32::try_from(step).unwrap_or(BUDGET_STEPS), fx);
    }

    pub(super) fn budget_at(&mut self, fraction: f64, fx: &mut Vec<Effect>) {
        let f = if fraction.is_finite() {
            fraction.clamp(0.0, 1.0)
        } else {
            1.0
        };
        let step = (f * f64::from(BUDGET_STEPS)).round() as u32;
        self.budget_set(step.min(BUDGET_STEPS), fx);
    }

    pub(super) fn budget_set(&mut self, step: u32, fx: &mut Vec<Effect>) {
        if self.remote.is_some() {
            self.toast("the memory budget is local-only: the remote server holds the model");
            return;
        }
        if !self.budget.ready() {
            self.toast("the budget slider waits for the engine's figures");
            return;
        }
        if step == self.budget.step && self.budget.touched {
            return;
        }
        self.budget.step = step;
        self.budget.touched = true;
        self.budget.exact = Some(self.budget.asked_at(step));
        self.budget_send(fx);
    }

    /// Ask the engine for the slider's value, unless a request is already in flight (its answer
    /// sends the newest value).
    pub(super) fn budget_send(&mut self, fx: &mut Vec<Effect>) {
        if self.budget.asked.is_some() || self.phase == Phase::Loading {
            return;
        }
        let bytes = self.budget.value_bytes();
        self.budget_request(round_sig3(bytes as f64 / 1e9), bytes, fx);
    }

    pub(super) fn budget_request(&mut self, gb: f64, bytes: u64, fx: &mut Vec<Effect>) {
        let turn = self.turn(Purpose::Budget);
        self.budget.asked = Some((turn, bytes));
        fx.push(Effect::Send(Request::Command {
            turn,
            command: Command::Budget(gb),
        }));
    }

    pub(super) fn budget_answer(
        &mut self,
        turn: TurnId,
        answer: Result<String, String>,
        fx: &mut Vec<Effect>,
    ) {
        let bytes = match self.budget.asked {
            Some((t, b)) if t == turn => b,
            _ => return,
        };
        self.budget.asked = None;
        let refused = answer.is_err();
        if let Err(why) = &answer {
            // The status bar has room for the whole reason where a narrow pane has not.
            self.toast(why.replace('\n', " "));
        }
        self.budget.answer = Some((bytes, answer));
        if refused {
            // The slider does not stay on a value the engine refused: back to the one in force.
            self.budget.step = self.budget.in_force_step();
            self.budget.exact = self.budget.in_force;
        } else if self.budget.touched && self.budget.value_bytes() != bytes {
            self.budget_send(fx);
        } else {
            // Accepted: this is the budget in force now, whatever figures come next; prefill
            // runs at another speed under it.
            self.prefill_rate = None;
            self.budget.in_force = Some(bytes);
            self.budget.exact = Some(bytes);
        }
    }

    // ---------------------------------------------------------------------------------------
    // Dialogs
    // ---------------------------------------------------------------------------------------

    pub(super) fn dialog_action(&mut self, a: Action, fx: &mut Vec<Effect>) {
        let Some(dialog) = self.dialog.take() else {
            return;
        };
        let ch = match &a {
            Action::Char(c) | Action::CharOr(c, _) => Some(c.to_ascii_lowercase()),
            _ => None,
        };
        let closes = matches!(
            a,
            Action::Cmd(Cmd::Stop | Cmd::Help | Cmd::Quit) | Action::Interrupt
        );
        match dialog {
            Dialog::Help => {
                // Scrolling keys scroll the help; any other key closes it.
                let delta: i64 = match a {
                    Action::Up => -1,
                    Action::Down => 1,
                    Action::PageUp => -10,
                    Action::PageDown => 10,
                    Action::Scroll(n) => -i64::from(n),
                    _ => return,
                };
                let s = (self.help_scroll as i64 + delta).clamp(0, 200);
                self.help_scroll = usize::try_from(s).unwrap_or(0);
                self.dialog = Some(Dialog::Help);
            }
            Dialog::ConfirmQuit => match (ch, &a) {
                (Some('s' | 'y'), _) => self.save_and_quit(fx),
                (Some('q' | 'n'), _) | (_, Action::Cmd(Cmd::Quit)) => self.quit(fx),
                _ if closes => {}
                _ => self.dialog = Some(Dialog::ConfirmQuit),
            },
            Dialog::ConfirmNew => match ch {
                Some('y') => self.send_command(Command::New, fx),
                Some('n') => {}
                _ if closes => {}
                _ => self.dialog = Some(Dialog::ConfirmNew),
            },
            Dialog::ConfirmLoad(name) => match ch {
                Some('y') => self.load_now(name, fx),
                Some('n') => {}
                _ if closes => {}
                _ => self.dialog = Some(Dialog::ConfirmLoad(name)),
            },
            Dialog::ConfirmThink(t) => match (&a, ch) {
                (Action::Submit, _) | (_, Some('y')) => {
                    self.items
                        .push(Item::Info(format!("› /think {}", think_word(t))));
                    self.send_command(Command::Think(t), fx);
                }
                // Another press steps on from the change shown.
                (Action::Cmd(Cmd::Effort), _) => {
                    let after = thinking_after(t, (self.thinking, self.effort.clone()));
                    self.dialog = Some(Dialog::ConfirmThink(step_effort(after)));
                }
                (Action::Cmd(Cmd::Stop), _) | (_, Some('n')) => {
                    self.next_think = Some(t);
                    self.toast(format!(
                        "thinking {} kept for the next new conversation ({})",
                        think_word(t),
                        self.keys.of(Cmd::New)
                    ));
                }
                _ if closes => {}
                _ => self.dialog = Some(Dialog::ConfirmThink(t)),
            },
            Dialog::ConfirmReplace(name) => match ch {
                Some('y') => {
                    self.items.push(Item::Info(format!("› /save! {name}")));
                    self.send_command(Command::SaveOver(Some(name)), fx);
                }
                Some('n') => {}
                _ if closes => {}
                _ => self.dialog = Some(Dialog::ConfirmReplace(name)),
            },
            Dialog::Sessions(mut d) => {
                if d.naming.is_some() || d.renaming.is_some() {
                    self.name_action(d, a, fx);
                } else if let Some(name) = d.deleting.take() {
                    // "Delete NAME?": y deletes, anything else keeps it.
                    if ch == Some('y') {
                        let turn = self.turn(Purpose::SessionFile);
                        fx.push(Effect::Send(Request::DeleteSession { turn, name }));
                    } else {
                        d.message = Some(format!("{name:?} kept"));
                    }
                    self.dialog = Some(Dialog::Sessions(d));
                } else if d.filtering {
                    self.filter_action(d, &a, fx);
                } else if !closes && self.sessions_action(&mut d, &a, ch, fx) {
                    self.dialog = Some(Dialog::Sessions(d));
                }
            }
        }
    }

    pub(super) fn save_and_quit(&mut self, fx: &mut Vec<Effect>) {
        if self.busy() {
            self.cancel(fx);
        }
        if self.phase == Phase::Loading {
            return self.quit(fx);
        }
        let turn = self.turn(Purpose::Command(Command::Save(None)));
        self.quit_after_save = Some(turn);
        self.items
            .push(Item::Info("saving before quitting…".into()));
        fx.push(Effect::Send(Request::Command {
            turn,
            command: Command::Save(None),
        }));
    }

    /// A new conversation: asks first when this one has unsaved turns.
    pub(super) fn new_conversation(&mut self, fx: &mut Vec<Effect>) {
        if self.refuse_now() {
            return;
        }
        if self.dirty {
            self.dialog = Some(Dialog::ConfirmNew);
        } else {
            self.send_command(Command::New, fx);
        }
    }

    /// Load `name` now (the user confirmed, or nothing is unsaved).
    pub(super) fn load_now(&mut self, name: String, fx: &mut Vec<Effect>) {
        self.items.push(Item::Info(format!("› /load {name}")));
        self.send_command(Command::Load(name), fx);
    }

    /// A key in the session list; returns whether the dialog stays open.
    pub(super) fn sessions_action(
        &mut self,
        d: &mut SessionDialog,
        a: &Action,
        ch: Option<char>,
        fx: &mut Vec<Effect>,
    ) -> bool {
        let names: Vec<String> = d.visible().iter().map(|r| r.name.clone()).collect();
        d.message = None;
        match (a, ch) {
            (Action::Up, _) => d.selected = d.selected.saturating_sub(1),
            (Action::Down, _) => {
                d.selected = (d.selected + 1).min(names.len().saturating_sub(1));
            }
            (Action::Submit, _) | (_, Some('l')) => {
                let Some(name) = names.get(d.selected).cloned() else {
                    d.message = Some("no saved session selected".into());
                    return true;
                };
                if self.refuse_now() {
                    d.message = self.toast.as_ref().map(|t| t.0.clone());
                    return true;
                }
                if self.dirty {
                    self.dialog = Some(Dialog::ConfirmLoad(name));
                } else {
                    self.load_now(name, fx);
                }
                return false;
            }
            (_, Some('s')) => {
                let mut e = Editor::default();
                e.set(self.session.as_deref().unwrap_or(""));
                d.prefilled = !e.is_empty();
                d.naming = Some(e);
            }
            (_, Some('n')) => {
                if self.refuse_now() {
                    d.message = self.toast.as_ref().map(|t| t.0.clone());
                    return true;
                }
                self.new_conversation(fx);
                return false;
            }
            (_, Some('r')) => {
                d.rows = None;
                self.fetch_sessions(fx);
            }
            (_, Some('/')) => d.filtering = true,
            (_, Some('e')) => match names.get(d.selected) {
                Some(name) => {
                    let mut e = Editor::default();
                    e.set(name);
                    d.prefilled = true;
                    d.renaming = Some((name.clone(), e));
                }
                None => d.message = Some("no saved session selected".into()),
            },
            (Action::Delete, _) | (_, Some('d')) => match names.get(d.selected) {
                // The worker refuses the conversation open here: say so before asking.
                Some(name) if self.session.as_deref() == Some(name.as_str()) => {
                    d.message = Some(format!(
                        "{name:?} is the conversation open here: it cannot be deleted; {} \
                         starts a new one",
                        self.keys.of(Cmd::New)
                    ));
                }
                Some(name) => d.deleting = Some(name.clone()),
                None => d.message = Some("no saved session selected".into()),
            },
            _ => {}
        }
        true
    }

    /// A key while typing the filter: characters narrow the list, Backspace widens it, the
    /// arrows move, Enter loads the selected row, Esc ends the filter (and clears it).
    pub(super) fn filter_action(&mut self, mut d: SessionDialog, a: &Action, fx: &mut Vec<Effect>) {
        match a {
            Action::Char(c) | Action::CharOr(c, _) => {
                if d.filter.len() < 200 {
                    d.filter.push(*c);
                }
                d.selected = 0;
            }
            Action::Backspace => {
                d.filter.pop();
                d.selected = 0;
            }
            Action::Cmd(Cmd::Stop) | Action::Interrupt => {
                d.filtering = false;
                d.filter.clear();
                d.selected = 0;
            }
            Action::Up | Action::Down | Action::Submit => {
                d.filtering = !matches!(a, Action::Submit);
                if self.sessions_action(&mut d, a, None, fx) {
                    self.dialog = Some(Dialog::Sessions(d));
                }
                return;
            }
            _ => {}
        }
        self.dialog = Some(Dialog::Sessions(d));
    }

    /// A key while typing a name in the session dialog: the name to save under ("save as",
    /// prefilled with the session's own name) or a saved session's new name ("rename",
    /// prefilled with its old one). Both edit the name alike ([`edit_name`]); Enter then
    /// saves or asks the worker to rename.
    pub(super) fn name_action(&mut self, mut d: SessionDialog, a: Action, fx: &mut Vec<Effect>) {
        let prefilled = std::mem::take(&mut d.prefilled);
        let name = match (&mut d.naming, &mut d.renaming) {
            (Some(name), _) | (None, Some((_, name))) => name,
            (None, None) => return,
        };
        match edit_name(name, prefilled, a) {
            NameKey::Editing => {}
            NameKey::Cancel => {
                d.naming = None;
                d.renaming = None;
            }
            NameKey::Refused(why) => d.message = Some(why),
            NameKey::Submit(_) if d.naming.is_some() && self.refuse_now() => {
                d.message = self.toast.as_ref().map(|t| t.0.clone());
            }
            NameKey::Submit(to) if d.naming.is_some() => {
                if self.session.as_deref() != Some(to.as_str())
                    && matches!(&d.rows, Some(Ok(rows)) if rows.iter().any(|r| r.name == to))
                {
                    // Another saved session has that name: ask before replacing it.
                    self.dialog = Some(Dialog::ConfirmReplace(to));
                } else {
                    self.items.push(Item::Info(format!("› /save {to}")));
                    self.send_command(Command::Save(Some(to)), fx);
                }
                return;
            }
            NameKey::Submit(to) => {
                if let Some((from, _)) = d.renaming.take() {
                    // The worker checks the name again.
                    let turn = self.turn(Purpose::SessionFile);
                    fx.push(Effect::Send(Request::RenameSession { turn, from, to }));
                }
            }
        }
        self.dialog = Some(Dialog::Sessions(d));
    }
}

/// Thinking and effort once `t` is applied to `(thinking, effort)`.
fn thinking_after(t: Think, (_, effort): (bool, String)) -> (bool, String) {
    match t {
        Think::Off => (false, effort),
        Think::On => (true, effort),
        Think::Low => (true, "low".into()),
        Think::High => (true, "high".into()),
        Think::Max => (true, "max".into()),
    }
}

/// The effort key's next step: off → low → high → max → off.
fn step_effort((thinking, effort): (bool, String)) -> Think {
    match (thinking, effort.as_str()) {
        (false, _) => Think::Low,
        (true, "low") => Think::High,
        (true, "high") => Think::Max,
        _ => Think::Off,
    }
}

/// `/think`'s word for `t`.
#[must_use]
pub fn think_word(t: Think) -> &'static str {
    match t {
        Think::On => "on",
        Think::Off => "off",
        Think::Low => "low",
        Think::High => "high",
        Think::Max => "max",
    }
}

/// Longest name, in bytes, typed in the session dialog: further characters are dropped (but
/// the first one still replaces a prefilled name).
const MAX_NAME_BYTES: usize = 200;

/// What a key did to a name being typed in the session dialog ("save as" or "rename").
enum NameKey {
    /// The name was edited, or the key means nothing here: keep typing.
    Editing,
    /// Esc: the name is given up.
    Cancel,
    /// Enter on a name the store accepts: the name, trimmed.
    Submit(String),
    /// Enter on a name the store refuses, as `/save` refuses it: why.
    Refused(String),
}

/// Apply a key to a session name being typed. `prefilled`: the name is the prefilled one,
/// untouched, so a character replaces it rather than extending it (editing keys keep it).
fn edit_name(name: &mut Editor, prefilled: bool, a: Action) -> NameKey {
    match a {
        Action::Char(c) | Action::CharOr(c, _)
            if name.text().len() < MAX_NAME_BYTES || prefilled =>
        {
            if prefilled {
                name.take();
            }
            name.insert_char(c);
        }
        Action::Backspace => name.backspace(),
        Action::Delete => name.delete(),
        Action::Left => name.left(),
        Action::Right => name.right(),
        Action::Home => name.home(),
        Action::End => name.end(),
        Action::Cmd(Cmd::Stop) | Action::Interrupt => return NameKey::Cancel,
        Action::Submit => {
            let text = name.text().trim().to_string();
            return match crate::session::store::validate_name(&text) {
                Ok(()) => NameKey::Submit(text),
                Err(e) => NameKey::Refused(e.to_string()),
            };
        }
        _ => {}
    }
    NameKey::Editing
}
