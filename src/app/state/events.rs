//! How engine events change the [`App`]: streaming text split into reasoning and answer, turn
//! reports, command answers routed by purpose, figures for the panes, a loaded session's
//! history, and the worker stopping. Events of cancelled or unknown turns are dropped here.

use super::{
    session_in, summary, App, Effect, Item, Phase, Purpose, Reply, ReplyKind, ReplyState,
    SPARK_POINTS,
};
use crate::app::config::Cmd;
use crate::app::protocol::{EngineEvent, HistoryView, Request, SessionRow, TurnId};
use crate::session::chat::{Entry, Mode, Stop, TurnReport};
use crate::session::commands::{Command, Think};
use crate::stream::stats::StatsSnapshot;
use std::collections::VecDeque;

/// Bring `shown` up to `parsed`, which only ever grows at its end: append the new tail
/// (replace the whole text should it ever not line up).
pub(super) fn sync_tail(shown: &mut String, parsed: &str) {
    match parsed.get(shown.len()..) {
        Some(tail) => shown.push_str(tail),
        None => {
            shown.clear();
            shown.push_str(parsed);
        }
    }
}

impl App {
    // ---------------------------------------------------------------------------------------
    // Engine events
    // ---------------------------------------------------------------------------------------

    pub(super) fn reply_mut(&mut self, turn: TurnId) -> Option<&mut Reply> {
        self.items.iter_mut().rev().find_map(|i| match i {
            Item::Reply(r) if r.turn == turn => Some(r),
            _ => None,
        })
    }

    pub(super) fn finish_parser(&mut self, turn: TurnId) {
        if let Some((t, mut p)) = self.parser.take() {
            if t == turn {
                p.finish();
                let (reasoning, content) = (p.reasoning().to_string(), p.content().to_string());
                if let Some(r) = self.reply_mut(turn) {
                    r.reasoning = reasoning;
                    r.content = content;
                }
            } else {
                self.parser = Some((t, p));
            }
        }
    }

    /// Returns whether anything visible changed.
    pub(super) fn engine(&mut self, ev: EngineEvent, fx: &mut Vec<Effect>) -> bool {
        match ev {
            EngineEvent::Loading { done, total } => {
                self.loading = Some((done, total));
                return true;
            }
            EngineEvent::Ready { info } => self.ready(info, fx),
            // The client already knows the mode it sent the turn in; the limit in force (chat
            // or raw, as `/set` left it) bounds the estimate of the time left.
            EngineEvent::TurnStarted {
                turn, max_tokens, ..
            } => {
                if self.live_turn() == Some(turn) && max_tokens > 0 {
                    self.max_tokens = max_tokens;
                }
                return false;
            }
            EngineEvent::Token {
                turn,
                id,
                text,
                position,
            } => return self.token(turn, id, &text, position),
            EngineEvent::Stats { turn, stats } => return self.engine_stats(turn, *stats),
            EngineEvent::TurnDone { turn, report } => {
                if self.is_cancelled(turn) {
                    return false;
                }
                match self.take_pending(turn) {
                    Some(Purpose::Reply(kind)) => {
                        if let Some(r) = &mut self.remote {
                            r.first_token_seconds = report.prefill_seconds;
                            r.cached_tokens = report.reused_tokens;
                            r.prompt_tokens = report.reused_tokens + report.prefilled_tokens;
                        }
                        self.turn_done(turn, kind, &report);
                        let ended = self.phase == Phase::Idle;
                        if ended {
                            // Sent after a reply that ended by itself; given back after one
                            // that was stopped or filled the context.
                            let by_itself = matches!(report.stop, Stop::End(_) | Stop::MaxTokens);
                            self.release_queued(by_itself, fx);
                        }
                        let secs = report.prefill_seconds + report.decode_seconds;
                        if secs >= super::NOTIFY_AFTER_S {
                            fx.push(Effect::Notify(format!(
                                "k3: the reply is ready ({}, {secs:.0} s)",
                                crate::app::words::count(report.generated_tokens as u64, "token")
                            )));
                        }
                    }
                    _ => return false,
                }
            }
            EngineEvent::History { turn, history } => {
                if self.take_pending(turn) != Some(Purpose::History) {
                    return false;
                }
                self.show_history(*history);
            }
            EngineEvent::Sessions { turn, rows } => {
                if self.take_pending(turn) != Some(Purpose::Sessions) {
                    return false;
                }
                self.session_rows(Ok(rows));
            }
            EngineEvent::Named { name } => self.session = Some(name),
            EngineEvent::Notice { turn, text } => {
                if self.is_cancelled(turn) {
                    return false;
                }
                match self.take_pending(turn) {
                    Some(p) => self.answer(turn, p, Ok(text), fx),
                    None => return false,
                }
            }
            EngineEvent::Failed { turn, message } => {
                if turn == 0 {
                    self.last_error = Some(message.clone());
                    self.items.push(Item::Error(message));
                } else if self.is_cancelled(turn) {
                    return false;
                } else {
                    match self.take_pending(turn) {
                        Some(p) => self.answer(turn, p, Err(message), fx),
                        None => return false,
                    }
                }
            }
            EngineEvent::Stopped { exit_code } => self.worker_stopped(exit_code),
        }
        true
    }

    pub(super) fn ready(&mut self, info: String, fx: &mut Vec<Effect>) {
        let first = info.lines().next().unwrap_or("");
        if self.session.is_none() {
            self.session = session_in(first);
        }
        if first.ends_with("raw mode") {
            self.mode = Mode::Raw;
        }
        if let Some((server, model)) = super::remote_in(first) {
            self.model = model;
            self.remote = Some(super::RemoteView {
                server,
                ..super::RemoteView::default()
            });
        }
        self.items.push(Item::Info(info));
        self.items.push(Item::Info(format!(
            "{} help · type a message and press Enter · /help lists the slash commands",
            self.keys.of(Cmd::Help)
        )));
        self.phase = Phase::Idle;
        if self.resume {
            self.fetch_history(fx);
        }
        if let Some(gb) = self.budget_gb.take() {
            let bytes = (gb * 1e9) as u64;
            self.budget_request(gb, bytes, fx);
        }
    }

    pub(super) fn fetch_history(&mut self, fx: &mut Vec<Effect>) {
        let turn = self.turn(Purpose::History);
        fx.push(Effect::Send(Request::History { turn }));
    }

    /// Ask the worker for the saved sessions (the dialog shows them when they arrive).
    pub(super) fn fetch_sessions(&mut self, fx: &mut Vec<Effect>) {
        let turn = self.turn(Purpose::Sessions);
        fx.push(Effect::Send(Request::ListSessions { turn }));
    }

    /// The session list (or why it cannot be read) for an open session dialog.
    pub(super) fn session_rows(&mut self, rows: Result<Vec<SessionRow>, String>) {
        if let Some(super::Dialog::Sessions(d)) = &mut self.dialog {
            let n = rows.as_ref().map_or(0, Vec::len);
            d.selected = d.selected.min(n.saturating_sub(1));
            d.rows = Some(rows);
        }
    }

    pub(super) fn token(&mut self, turn: TurnId, id: u32, text: &str, position: u64) -> bool {
        if self.is_cancelled(turn) || self.live_turn() != Some(turn) {
            return false;
        }
        // The status bar's position moves with every token.
        if let (Some(s), true) = (&mut self.stats.last, position > 0) {
            s.positions = position;
        }
        if id != u32::MAX {
            let tokens = match self.phase {
                Phase::Streaming { tokens, .. } => tokens + 1,
                _ => 1,
            };
            self.phase = Phase::Streaming { turn, tokens };
        }
        let Some(r) = self.items.iter_mut().rev().find_map(|i| match i {
            Item::Reply(r) if r.turn == turn => Some(r),
            _ => None,
        }) else {
            return true;
        };
        match &mut self.parser {
            Some((t, p)) if *t == turn => {
                p.push(text);
                // The parser only appends: copy what is new, not the whole reply per token.
                sync_tail(&mut r.reasoning, p.reasoning());
                sync_tail(&mut r.content, p.content());
            }
            _ => r.content.push_str(text),
        }
        true
    }

    pub(super) fn engine_stats(&mut self, turn: TurnId, s: StatsSnapshot) -> bool {
        // A cancelled turn's figures still describe the engine (memory, positions), but they
        // add no points to the sparklines and never move the conversation's phase.
        let stale = turn != 0 && (self.is_cancelled(turn) || self.live_turn() != Some(turn));
        if let Phase::Prefill { turn: t, .. } = self.phase {
            if t == turn && s.prefill_total > 0 {
                self.phase = Phase::Prefill {
                    turn,
                    done: s.prefill_done,
                    total: s.prefill_total,
                };
            }
        }
        let push = |q: &mut VecDeque<f64>, v: f64| {
            if q.len() >= SPARK_POINTS {
                q.pop_front();
            }
            q.push_back(if v.is_finite() { v.max(0.0) } else { 0.0 });
        };
        if turn != 0 && !stale && s.prefill_total == 0 {
            push(&mut self.stats.tps, s.tokens_per_second);
            push(&mut self.stats.disk, s.disk_mb_per_s);
        }
        if s.context_limit > 0 {
            self.context_limit = s.context_limit;
        }
        // Figures from the prefill hook carry no residency or budget; keep the last full
        // picture's.
        let keep_layers = s.layers.is_empty() && s.prefill_total > 0;
        if !keep_layers {
            self.budget
                .observe(s.model_bytes, s.budget_bytes, s.floor_bytes);
        }
        let mut s = s;
        if keep_layers {
            if let Some(prev) = &self.stats.last {
                s.layers.clone_from(&prev.layers);
                if s.positions == 0 {
                    s.positions = prev.positions;
                }
                s.budget_bytes = prev.budget_bytes;
            }
        }
        self.stats.last = Some(s);
        true
    }

    pub(super) fn turn_done(&mut self, turn: TurnId, kind: ReplyKind, report: &TurnReport) {
        self.finish_parser(turn);
        // The prefill speed under this budget, for what a re-read would cost (a prompt of a
        // few tokens says little).
        if report.prefilled_tokens >= 16 && report.prefill_seconds > 0.0 {
            self.prefill_rate = Some(report.prefilled_tokens as f64 / report.prefill_seconds);
        }
        let disk_read = match (self.disk_at_start.take(), &self.stats.last) {
            (Some(a), Some(s)) => Some(s.disk_bytes_read.saturating_sub(a)),
            _ => None,
        };
        let live = self.live_turn() == Some(turn);
        if let Some(r) = self.reply_mut(turn) {
            if report.accepted || r.raw {
                r.content.clone_from(&report.reply);
                if let Some(reasoning) = &report.reasoning {
                    r.reasoning.clone_from(reasoning);
                }
            }
            r.state = if report.stop == Stop::Cancelled {
                ReplyState::Stopped
            } else {
                ReplyState::Done
            };
            let mut line = summary(report, disk_read);
            if let Some(w) = &report.context_warning {
                line.push_str(" · ");
                line.push_str(w);
            }
            r.summary = Some(line);
            r.note = report
                .rejected_because
                .as_ref()
                .map(|why| format!("not added to the history: {why}"));
        }
        if live {
            self.phase = Phase::Idle;
        }
        self.dirty = true;
        if report.accepted && kind != ReplyKind::Send {
            self.drop_superseded(turn, kind);
        }
    }

    /// After an accepted `/regen` or `/edit`, the reply (and message) it replaced go away.
    pub(super) fn drop_superseded(&mut self, turn: TurnId, kind: ReplyKind) {
        let Some(at) = self
            .items
            .iter()
            .position(|i| matches!(i, Item::Reply(r) if r.turn == turn))
        else {
            return;
        };
        // An edit added its new message just before the new reply.
        let search_end = if kind == ReplyKind::Edit {
            at.saturating_sub(1)
        } else {
            at
        };
        let Some(old) = self.items[..search_end]
            .iter()
            .rposition(|i| matches!(i, Item::Reply(_)))
        else {
            return;
        };
        self.items.remove(old);
        if kind == ReplyKind::Edit {
            if let Some(u) = self.items[..old]
                .iter()
                .rposition(|i| matches!(i, Item::User { .. }))
            {
                self.items.remove(u);
            }
        }
    }

    /// Route the answer to a request.
    pub(super) fn answer(
        &mut self,
        turn: TurnId,
        purpose: Purpose,
        answer: Result<String, String>,
        fx: &mut Vec<Effect>,
    ) {
        match purpose {
            Purpose::Budget => self.budget_answer(turn, answer, fx),
            Purpose::History => {
                let e = match answer {
                    Ok(t) | Err(t) => t,
                };
                self.items
                    .push(Item::Error(format!("cannot show the saved history: {e}")));
            }
            Purpose::Sessions => self.session_rows(Err(match answer {
                Ok(t) | Err(t) => t,
            })),
            Purpose::SessionFile => {
                // The dialog says what happened and lists the sessions again.
                if let Some(super::Dialog::Sessions(d)) = &mut self.dialog {
                    d.message = Some(match answer {
                        Ok(t) | Err(t) => t,
                    });
                    d.rows = None;
                    self.fetch_sessions(fx);
                } else if let Err(e) = answer {
                    self.items.push(Item::Error(e));
                }
            }
            Purpose::Reply(_) => {
                // A reply that failed before or while generating.
                self.parser = None;
                if let Some(i) = self
                    .items
                    .iter()
                    .rposition(|i| matches!(i, Item::Reply(r) if r.turn == turn))
                {
                    let empty = matches!(&self.items[i], Item::Reply(r) if r.content.is_empty() && r.reasoning.is_empty());
                    if empty {
                        self.items.remove(i);
                    } else if let Item::Reply(r) = &mut self.items[i] {
                        r.state = ReplyState::Stopped;
                    }
                }
                if self.live_turn() == Some(turn) {
                    self.phase = Phase::Idle;
                    self.release_queued(false, fx);
                }
                let text = match answer {
                    Ok(t) | Err(t) => t,
                };
                self.items.push(Item::Error(text));
            }
            Purpose::Command(cmd) => self.command_answer(turn, cmd, answer, fx),
        }
    }

    pub(super) fn command_answer(
        &mut self,
        turn: TurnId,
        cmd: Command,
        answer: Result<String, String>,
        fx: &mut Vec<Effect>,
    ) {
        let quitting = self.quit_after_save == Some(turn);
        if let Command::Budget(gb) = cmd {
            let bytes = (gb * 1e9) as u64;
            self.budget.answer = Some((bytes, answer.clone()));
            // A typed `/budget` moves the slider to what is now in force.
            if answer.is_ok() {
                self.prefill_rate = None;
            }
            if answer.is_ok() && self.budget.ready() {
                self.budget.step = self.budget.step_of(bytes);
                self.budget.touched = true;
                self.budget.in_force = Some(bytes);
                self.budget.exact = Some(bytes);
            }
        }
        let text = match answer {
            Err(e) => {
                if quitting {
                    self.quit_after_save = None;
                    self.items.push(Item::Error(format!("{e} (not quitting)")));
                } else {
                    self.items.push(Item::Error(e));
                }
                return;
            }
            Ok(t) => t,
        };
        match &cmd {
            Command::Save(name) | Command::SaveOver(name) => {
                self.dirty = false;
                // A session saved under its default name learns it from the answer.
                if let Some(n) = name.clone().or_else(|| session_in(&text)) {
                    self.session = Some(n);
                }
            }
            Command::Load(name) => {
                self.session = Some(name.clone());
                self.dirty = false;
                self.fetch_history(fx);
            }
            Command::New => {
                // The new conversation is named at its first turn (`EngineEvent::Named`).
                self.session = None;
                // A thinking change kept for it applies now (nothing to read again).
                if let Some(t) = self.next_think.take() {
                    self.send_command(Command::Think(t), fx);
                }
                self.items.clear();
                self.dirty = false;
                self.scroll = 0;
            }
            Command::Raw => {
                self.mode = Mode::Raw;
                self.dirty = true;
            }
            Command::Chat => {
                self.mode = Mode::Chat;
                self.dirty = true;
            }
            Command::Think(t) => {
                self.thinking = !matches!(t, Think::Off);
                match t {
                    Think::Low => self.effort = "low".into(),
                    Think::High => self.effort = "high".into(),
                    Think::Max => self.effort = "max".into(),
                    Think::On | Think::Off => {}
                }
                self.dirty = true;
            }
            Command::Undo => {
                self.undo_last_exchange();
                self.dirty = true;
            }
            Command::System(_) | Command::Set(..) => self.dirty = true,
            _ => {}
        }
        self.items.push(Item::Info(text));
        if quitting {
            self.quit(fx);
        }
    }

    pub(super) fn undo_last_exchange(&mut self) {
        if let Some(r) = self.items.iter().rposition(|i| matches!(i, Item::Reply(_))) {
            self.items.remove(r);
            if let Some(u) = self.items[..r]
                .iter()
                .rposition(|i| matches!(i, Item::User { .. }))
            {
                self.items.remove(u);
            }
        }
    }

    pub(super) fn show_history(&mut self, t: HistoryView) {
        // Keep what was shown before the history (start-up lines), then the history.
        let keep: Vec<Item> = self
            .items
            .drain(..)
            .filter(|i| matches!(i, Item::Info(_) | Item::Error(_)))
            .collect();
        let n = t.entries.len();
        if t.name.is_some() {
            self.session = t.name;
        }
        self.items = keep;
        self.items.push(Item::Info(format!(
            "── history of {}: {n} {} ──",
            self.session.as_deref().unwrap_or("the session"),
            if n == 1 { "entry" } else { "entries" }
        )));
        if let Some(sys) = t.system {
            self.items.push(Item::Info(format!("system: {sys}")));
        }
        for e in t.entries {
            self.push_entry(e);
        }
        self.mode = t.mode;
        // Turns recovered from a journal are not saved: the status bar says so and quitting
        // asks first.
        self.dirty = t.unsaved;
        self.scroll = 0;
    }

    pub(super) fn push_entry(&mut self, e: Entry) {
        let reply = |content: String, reasoning: Option<String>, raw: bool| {
            Item::Reply(Reply {
                turn: 0,
                reasoning: reasoning.unwrap_or_default(),
                content,
                raw,
                state: ReplyState::Done,
                summary: None,
                note: None,
            })
        };
        match e {
            Entry::Message {
                role,
                content,
                reasoning,
            } => match role.as_str() {
                "user" => self.items.push(Item::User {
                    text: content,
                    raw: false,
                }),
                "assistant" => self.items.push(reply(content, reasoning, false)),
                other => self.items.push(Item::Info(format!("{other}: {content}"))),
            },
            Entry::Raw { prompt, output, .. } => {
                self.items.push(Item::User {
                    text: prompt,
                    raw: true,
                });
                self.items.push(reply(output, None, true));
            }
            Entry::Mode { mode } => self
                .items
                .push(Item::Info(format!("── {} mode ──", mode.name()))),
        }
    }

    pub(super) fn worker_stopped(&mut self, code: i32) {
        if self.phase == Phase::Exiting {
            return;
        }
        let message = self
            .last_error
            .clone()
            .unwrap_or_else(|| "the engine stopped".into());
        self.dialog = None;
        self.parser = None;
        self.phase = Phase::Failed {
            message,
            code: if code == 0 { 1 } else { code },
        };
    }
}
