//! The engine worker: one thread that loads the model, owns the session and answers
//! [`Request`]s with [`EngineEvent`]s. The front end never touches weights; the worker never
//! draws. Cancelling is a flag the worker checks between tokens.

mod figures;
mod files;
mod journaled;

use files::{model_identity, session_file_op, session_rows};
use journaled::{Journaled, RecordKind};

use super::protocol::{EngineEvent, HistoryView, Request, TurnId};
use crate::engine::Model;
use crate::session::chat::{Entry, Mode, Session, Settings, Stop};
use crate::session::commands::{Command, Setting, HELP};
use crate::session::defaults::{Source, Sources};
use crate::session::store::{ModelIdentity, SessionLock, SessionStore};
use crate::session::tokenizer::Tokenizer;
use crate::stream::stats::{self, StatsSnapshot};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// What the worker needs to start.
#[derive(Clone, Debug)]
pub struct ChatConfig {
    /// Checkpoint directory.
    pub model_dir: PathBuf,
    /// How the start-up line names the model (the directory, or "the demo model" for the
    /// built-in one rather than its cache path).
    pub model_label: String,
    /// Initial settings.
    pub settings: Settings,
    /// Initial system message.
    pub system: Option<String>,
    /// Session to resume.
    pub resume: Option<String>,
    /// Name to save under (default: chosen at the first save from the conversation's first
    /// words and the date).
    pub session_name: Option<String>,
    /// Session directory (default: the data directory).
    pub session_dir: Option<PathBuf>,
    /// Memory budget to open the model under.
    pub budget: crate::stream::budget::BudgetRequest,
    /// A packed trunk to read layers from.
    pub trunk: Option<PathBuf>,
    /// How replies are decoded (speculation never changes a token).
    pub spec: crate::engine::spec::SpecMode,
    /// Lines for the start-up info (what the model's generation_config.json had that k3 does
    /// not use, why the model opens under the budget it does).
    pub start_note: Option<String>,
    /// Where each sampling value came from (`/stats` shows it; `/set` changes it).
    pub sources: crate::session::defaults::Sources,
    /// The values given by command-line flags: they win over a loaded session's settings.
    pub flags: crate::session::defaults::SamplingLayer,
}

/// Handle on a running worker.
pub struct Worker {
    tx: Sender<Request>,
    rx: Receiver<EngineEvent>,
    cancel: Arc<AtomicBool>,
    answer_now: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Worker {
    /// Start the worker thread; it loads the model and sends `Ready` (or `Stopped` on failure).
    #[must_use]
    pub fn spawn(cfg: ChatConfig) -> Worker {
        let (tx, rx_req) = channel::<Request>();
        let (tx_ev, rx) = channel::<EngineEvent>();
        let cancel = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&cancel);
        let answer_now = Arc::new(AtomicBool::new(false));
        let answer = Arc::clone(&answer_now);
        let handle = std::thread::Builder::new()
            .name("k3-engine".into())
            .spawn(move || run(&cfg, &rx_req, &tx_ev, &flag, answer))
            .ok();
        Worker {
            tx,
            rx,
            cancel,
            answer_now,
            handle,
        }
    }

    /// Start a worker that talks to an OpenAI-compatible server instead of a local engine; it
    /// answers the same requests with the same events.
    #[must_use]
    pub fn spawn_remote(cfg: super::remote::RemoteConfig) -> Worker {
        let (tx, rx_req) = channel::<Request>();
        let (tx_ev, rx) = channel::<EngineEvent>();
        let cancel = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&cancel);
        let handle = std::thread::Builder::new()
            .name("k3-remote".into())
            .spawn(move || super::remote::run(cfg, &rx_req, &tx_ev, &flag))
            .ok();
        Worker {
            tx,
            rx,
            cancel,
            answer_now: Arc::new(AtomicBool::new(false)),
            handle,
        }
    }

    /// The flag that stops the current reply at the next token.
    #[must_use]
    pub fn cancel_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.cancel)
    }

    /// The flag that closes the reply's thinking channel at the next token ("answer now";
    /// a remote worker ignores it).
    #[must_use]
    pub fn answer_now_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.answer_now)
    }

    /// Send a request; false when the worker is gone.
    pub fn send(&self, r: Request) -> bool {
        // The one place the cancel flag is cleared: when a turn is asked for, before it is
        // queued. A stop (Esc, Ctrl-C) after this call stops that turn, one before it does not;
        // the worker never clears the flag itself, so a stop that arrives between this call and
        // the worker taking the request up is not lost.
        if matches!(r, Request::Send { .. } | Request::Command { .. }) {
            self.cancel.store(false, Ordering::Relaxed);
        }
        self.tx.send(r).is_ok()
    }

    /// Wait for the next event; `None` when the worker is gone.
    #[must_use]
    pub fn recv(&self) -> Option<EngineEvent> {
        self.rx.recv().ok()
    }

    /// Next event if one is waiting.
    #[must_use]
    pub fn try_recv(&self) -> Option<EngineEvent> {
        self.rx.try_recv().ok()
    }

    /// Ask the worker to stop once the requests sent so far are answered, and wait for it;
    /// returns every event it sent meanwhile, up to and including `Stopped`, whose exit status
    /// is the one a non-interactive run should end with.
    #[must_use]
    pub fn finish(mut self) -> Vec<EngineEvent> {
        let mut events = Vec::new();
        if self.tx.send(Request::Shutdown).is_ok() {
            while let Ok(ev) = self.rx.recv() {
                let stopped = matches!(ev, EngineEvent::Stopped { .. });
                events.push(ev);
                if stopped {
                    break;
                }
            }
        }
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        events
    }

    /// Ask the worker to stop and wait for it.
    pub fn shutdown(mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        let _ = self.tx.send(Request::Shutdown);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The transcript section of a saved session (JSON, readable on its own).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct SavedTranscript {
    system: Option<String>,
    mode: Mode,
    entries: Vec<Entry>,
    /// A sampled id the engine has not been fed yet.
    pending: Option<u32>,
}

/// What identifies the saved version of a session a journal continues: its transcript text
/// (which every saved turn changes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Base {
    transcript_len: u64,
    transcript_crc: u32,
}

impl Base {
    fn of(transcript_json: &[u8]) -> Base {
        Base {
            transcript_len: transcript_json.len() as u64,
            transcript_crc: crc32fast::hash(transcript_json),
        }
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Re-plan `model` for a total budget of `gb` (between two forward passes).
fn apply_budget(model: &Model, gb: f64, context: u64) -> Result<String, String> {
    use crate::stream::budget::{self, BudgetRequest};
    let Some((sizes, _)) = model.store().planned() else {
        return Err(format!(
            "/budget {gb}: the model was opened fully resident; start k3 chat with --mem to \
             stream it under a budget"
        ));
    };
    let req = BudgetRequest::Total((gb * 1e9) as u64);
    let states = 1 + crate::session::chat::SNAPSHOTS as u64;
    let plan = budget::plan_states(sizes, req, context, states, budget::cgroup_limit())
        .map_err(|e| format!("/budget: {e}"))?;
    let line = format!(
        "budget {}: {} of {} layers pinned, {} expert slots, output head {}",
        budget::gb(plan.budget_bytes.unwrap_or(0)),
        plan.n_pinned(),
        plan.pinned.len(),
        plan.expert_slots,
        if plan.head_resident {
            "resident"
        } else {
            "streamed"
        }
    );
    model
        .store()
        .set_plan(plan)
        .map_err(|e| format!("/budget: {e}"))?;
    Ok(line)
}

/// Everything the worker loop holds.
struct Ctx<'a> {
    session: Session<'a>,
    store: SessionStore,
    identity: ModelIdentity,
    /// The session's name; `None` until it is first saved without one given (it is then named
    /// from its first words and the date).
    name: Option<String>,
    /// The session this process has open (resumed, loaded or saved to), locked against every
    /// other process until another one is opened or the worker ends.
    open: Option<SessionLock>,
    created: u64,
    tx: &'a Sender<EngineEvent>,
    /// Requests, read between tokens too (a budget change applies at the next token).
    rx: &'a Receiver<Request>,
    /// Requests that arrived during a turn and wait for it to end.
    deferred: std::collections::VecDeque<Request>,
    cancel: &'a AtomicBool,
    /// The turn being served (read by the prefill-progress hook).
    current_turn: Arc<AtomicU64>,
    /// Seconds spent in forward passes (prefill and decode) since start.
    busy_seconds: f64,
    /// Failures that decide a non-interactive run's exit status.
    outcome: Outcome,
    /// The conversation changed since it was last saved or loaded.
    changed: bool,
    /// Turns run since it was last saved or loaded.
    unsaved_turns: usize,
    /// The journal of changes since the last save or load, from the first such change on.
    journal: Option<Journaled>,
    /// The saved version the conversation continues (`None`: it started empty).
    base: Option<Base>,
    /// Why the journal is not being written, if it is not (said when the worker ends).
    journal_problem: Option<String>,
    /// Where each sampling value came from.
    sources: Sources,
    /// The command line's values, put over a loaded session's settings.
    flags: crate::session::defaults::SamplingLayer,
}

/// What went wrong during a session, for the exit status of a run whose stdin is not a
/// terminal (docs/reliability.md#exit-codes): the front end ends interactive runs with 0 after showing each
/// failure, and scripts get the code.
#[derive(Clone, Copy, Debug, Default)]
struct Outcome {
    /// The last save attempted failed (the session is not saved).
    unsaved: bool,
    /// A turn failed on non-finite logits.
    unsound: bool,
    /// A session file was refused as damaged (its state, or all of it).
    damaged: bool,
    /// A turn was abandoned on a read error (the weights could not be read).
    aborted: bool,
    /// A command failed on an I/O error (a session that could not be read).
    failed: bool,
    /// A command was refused (a `/load` of a session that does not exist).
    refused: bool,
}

impl Outcome {
    /// 5 when the session is not saved, else 1 for a turn abandoned on a read error (or a
    /// command failed on one), else 4 for unsound output, else 3 for a damaged session file,
    /// else 2 for a refused command, else 0: the failure that most needs the user first.
    fn exit_code(self) -> i32 {
        if self.unsaved {
            5
        } else if self.aborted || self.failed {
            1
        } else if self.unsound {
            4
        } else if self.damaged {
            3
        } else if self.refused {
            2
        } else {
            0
        }
    }
}

/// A session's lock, and a warning when it holds none.
type Claim = (SessionLock, Option<String>);

/// Least time between two `Stats` events while a turn runs.
const STATS_INTERVAL_S: f64 = 0.2;

/// The worker thread: loads the model, opens or recovers the session, then answers requests
/// until shut down. Over 100 lines: the start-up steps run once, in order, and each can end
/// the worker with its own event.
fn run(
    cfg: &ChatConfig,
    rx: &Receiver<Request>,
    tx: &Sender<EngineEvent>,
    cancel: &AtomicBool,
    answer_now: Arc<AtomicBool>,
) {
    let fail = |msg: String, code: i32| {
        let _ = tx.send(EngineEvent::Failed {
            turn: 0,
            message: msg,
        });
        let _ = tx.send(EngineEvent::Stopped { exit_code: code });
    };
    let progress: std::sync::Arc<dyn Fn(u64, u64) + Send + Sync> = {
        let tx = std::sync::Mutex::new(tx.clone());
        let bar = std::sync::Mutex::new(LoadProgress::default());
        std::sync::Arc::new(move |done, total| {
            let shown = bar
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .next(done, total, Instant::now());
            if let Some((done, total)) = shown {
                let tx = tx.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let _ = tx.send(EngineEvent::Loading { done, total });
            }
        })
    };
    let opts = crate::engine::weights::OpenOptions {
        budget: cfg.budget,
        context: cfg.settings.context_limit as u64,
        states: 1 + crate::session::chat::SNAPSHOTS as u64,
        trunk: cfg.trunk.clone(),
        progress: Some(progress),
        ..Default::default()
    };
    let (model, info) = match Model::open_with(&cfg.model_dir, &opts) {
        Ok(m) => m,
        Err(e) => {
            let e: crate::Error = e.into();
            return fail(e.to_string(), e.exit_code());
        }
    };
    #[cfg(feature = "fault-injection")]
    if let Err(e) = arm_fault_from_env(&model) {
        return fail(e, 2);
    }
    let vocab = u32::try_from(model.cfg.vocab_size).unwrap_or(u32::MAX);
    let tok = match Tokenizer::load_expecting(&cfg.model_dir, vocab) {
        Ok(t) => t,
        Err(e) => return fail(e.to_string(), 3),
    };
    let identity = match model_identity(&cfg.model_dir, &info) {
        Ok(i) => i,
        Err(e) => return fail(format!("{}: {e}", crate::stream::shown(&cfg.model_dir)), 3),
    };
    let store = match &cfg.session_dir {
        Some(d) => SessionStore::new(d.clone()),
        None => SessionStore::new(SessionStore::default_dir()),
    };
    let stale = store.remove_stale_temps().unwrap_or(0);
    let session = match Session::new(&model, &tok, cfg.settings.clone()) {
        Ok(s) => s,
        Err(e) => return fail(e.to_string(), 2),
    };
    let current_turn = Arc::new(AtomicU64::new(0));
    let mut session = session;
    session.set_speculation(cfg.spec.or_env_off());
    session.set_answer_now_flag(answer_now);
    {
        let tx = tx.clone();
        let turn = Arc::clone(&current_turn);
        let mut last = Instant::now();
        let (positions_limit, model_bytes) = (cfg.settings.context_limit as u64, info.bytes_read);
        let held = session.positions_counter();
        session.on_prefill(Box::new(move |done, total| {
            if done < total && last.elapsed().as_secs_f64() < STATS_INTERVAL_S {
                return;
            }
            last = Instant::now();
            let (rss, peak) = stats::rss_bytes();
            let snap = StatsSnapshot {
                prefill_done: done as u64,
                prefill_total: total as u64,
                rss_bytes: rss,
                peak_rss_bytes: peak,
                model_bytes,
                disk_bytes_read: model_bytes,
                context_limit: positions_limit,
                positions: held.load(Ordering::Relaxed) as u64,
                ..StatsSnapshot::default()
            };
            let t = turn.load(Ordering::Relaxed);
            let _ = tx.send(EngineEvent::Stats {
                turn: t,
                stats: Box::new(snap),
            });
        }));
    }
    let mut ctx = Ctx {
        session,
        store,
        identity,
        name: cfg.session_name.clone(),
        open: None,
        created: unix_now(),
        tx,
        rx,
        deferred: std::collections::VecDeque::new(),
        cancel,
        current_turn,
        busy_seconds: 0.0,
        outcome: Outcome::default(),
        changed: false,
        unsaved_turns: 0,
        journal: None,
        base: None,
        journal_problem: None,
        sources: cfg.sources,
        flags: cfg.flags.clone(),
    };
    ctx.session.system.clone_from(&cfg.system);
    let mut resumed = None;
    if let Some(name) = &cfg.resume {
        match ctx.load(name) {
            Ok(msg) => resumed = Some(msg),
            Err((msg, code)) => return fail(msg, code),
        }
    }
    let session_label = match &ctx.name {
        Some(n) => format!("session {n:?}"),
        None => "new session (named at its first turn, and journaled until saved)".to_string(),
    };
    let mut info_line = format!(
        "k3: {} ({} layers, vocabulary {}), {session_label}, {} mode",
        cfg.model_label,
        model.cfg.num_hidden_layers,
        model.cfg.vocab_size,
        ctx.session.mode.name()
    );
    if let Some(msg) = resumed {
        info_line.push('\n');
        info_line.push_str(&msg);
    } else if let Some(n) = ctx.name.as_ref().filter(|n| ctx.store.exists(n)) {
        info_line.push_str(&format!(
            "\nsession {n:?} exists already and is not replaced by /save: --resume {n} \
             continues it, /save! replaces it"
        ));
    } else if let Some(n) = ctx.name.as_ref().filter(|n| ctx.store.has_journal(n)) {
        info_line.push_str(&format!(
            "\nsession {n:?} has unsaved turns in its journal: --resume {n} recovers them"
        ));
    }
    info_line.push('\n');
    info_line.push_str(&ctx.sources.line(&ctx.session.settings));
    if let Some(note) = &cfg.start_note {
        info_line.push('\n');
        info_line.push_str(note);
    }
    if stale > 0 {
        info_line.push_str(&format!(
            "\nremoved {stale} unfinished save file(s) left by a crash"
        ));
    }
    if tx.send(EngineEvent::Ready { info: info_line }).is_err() {
        return;
    }
    let _ = tx.send(EngineEvent::Stats {
        turn: 0,
        stats: Box::new(ctx.stats_snapshot(0, 0.0, 0.0)),
    });
    while let Some(req) = ctx.deferred.pop_front().or_else(|| rx.recv().ok()) {
        let ok = match req {
            Request::Shutdown => break,
            Request::Send { turn, text } => {
                ctx.current_turn.store(turn, Ordering::Relaxed);
                ctx.send(turn, &text)
            }
            Request::Command { turn, command } => {
                ctx.current_turn.store(turn, Ordering::Relaxed);
                ctx.command(turn, command)
            }
            Request::History { turn } => ctx.event(EngineEvent::History {
                turn,
                history: Box::new(ctx.history()),
            }),
            Request::ListSessions { turn } => ctx.event(session_rows(&ctx.store, turn)),
            r @ (Request::RenameSession { .. } | Request::DeleteSession { .. }) => {
                ctx.event(session_file_op(&ctx.store, ctx.name.as_deref(), r))
            }
        };
        if !ok {
            break; // the front end is gone
        }
    }
    ctx.drop_empty_journal();
    if let Some(text) = ctx.unsaved_notice() {
        let _ = tx.send(EngineEvent::Notice { turn: 0, text });
    }
    let _ = tx.send(EngineEvent::Stopped {
        exit_code: ctx.outcome.exit_code(),
    });
}

impl Ctx<'_> {
    fn history(&self) -> HistoryView {
        let s = &self.session;
        HistoryView {
            name: self.name.clone(),
            system: s.system.clone(),
            mode: s.mode,
            entries: s.entries.clone(),
            unsaved: self.changed,
        }
    }

    fn event(&self, e: EngineEvent) -> bool {
        self.tx.send(e).is_ok()
    }

    fn notice(&self, turn: TurnId, text: impl Into<String>) -> bool {
        self.event(EngineEvent::Notice {
            turn,
            text: text.into(),
        })
    }

    fn failed(&self, turn: TurnId, message: impl Into<String>) -> bool {
        self.event(EngineEvent::Failed {
            turn,
            message: message.into(),
        })
    }

    /// `/budget GB`: re-plan between tokens.
    fn budget(&mut self, gb: f64) -> Result<String, String> {
        apply_budget(
            self.session.model(),
            gb,
            self.session.settings.context_limit as u64,
        )
    }

    /// Run a generating call and report it. Over 100 lines: the stats hook, the deferral
    /// of requests that arrive mid-turn and the report share the turn's state.
    fn turn_result(
        &mut self,
        turn: TurnId,
        f: impl FnOnce(
            &mut Session<'_>,
            &AtomicBool,
            &mut dyn FnMut(u32, &str),
        )
            -> Result<crate::session::chat::TurnReport, crate::session::chat::TurnError>,
    ) -> bool {
        let tx = self.tx;
        let mut alive = true;
        let start = Instant::now();
        let mut last_token = Instant::now();
        let mut last_stats: Option<Instant> = None;
        let mut n = 0u64;
        let base = self.stats_snapshot(0, 0.0, 0.0);
        let model = self.session.model();
        let mut last_read = base.disk_bytes_read;
        let mut last_stats_at = Instant::now();
        let rx = self.rx;
        let store = &self.store;
        let open = self.name.clone();
        let cancel = self.cancel;
        let context = self.session.settings.context_limit as u64;
        let held = self.session.positions_counter();
        let mut deferred = Vec::new();
        let mut emit = |id: u32, text: &str| {
            // The token just sampled is held once it is fed: count it now.
            let position = held.load(Ordering::Relaxed) as u64 + u64::from(id != u32::MAX);
            let token = EngineEvent::Token {
                turn,
                id,
                text: text.to_string(),
                position,
            };
            alive &= tx.send(token).is_ok();
            // Between tokens: a budget change is applied now; anything else waits.
            while let Ok(req) = rx.try_recv() {
                match req {
                    Request::Command {
                        turn: t,
                        command: Command::Budget(gb),
                    } => {
                        let ev = match apply_budget(model, gb, context) {
                            Ok(text) => EngineEvent::Notice { turn: t, text },
                            Err(message) => EngineEvent::Failed { turn: t, message },
                        };
                        alive &= tx.send(ev).is_ok();
                    }
                    Request::ListSessions { turn: t } => {
                        alive &= tx.send(session_rows(store, t)).is_ok();
                    }
                    r @ (Request::RenameSession { .. } | Request::DeleteSession { .. }) => {
                        alive &= tx.send(session_file_op(store, open.as_deref(), r)).is_ok();
                    }
                    Request::Shutdown => {
                        cancel.store(true, Ordering::Relaxed);
                        deferred.push(Request::Shutdown);
                    }
                    other => deferred.push(other),
                }
            }
            if id == u32::MAX {
                return; // a flushed UTF-8 tail, not a token
            }
            n += 1;
            let dt = last_token.elapsed().as_secs_f64();
            last_token = Instant::now();
            if last_stats.is_none_or(|t| t.elapsed().as_secs_f64() >= STATS_INTERVAL_S) {
                last_stats = Some(Instant::now());
                let (rss, peak) = stats::rss_bytes();
                let e = model.stats();
                let read = e.disk_bytes_read;
                let since = last_stats_at.elapsed().as_secs_f64();
                let mb_s = if since > 0.0 {
                    (read - last_read) as f64 / 1e6 / since
                } else {
                    0.0
                };
                last_read = read;
                last_stats_at = Instant::now();
                let mut snap = StatsSnapshot {
                    tokens_per_second: if n > 1 && dt > 0.0 { 1.0 / dt } else { 0.0 },
                    turn_tokens: n,
                    turn_seconds: start.elapsed().as_secs_f64(),
                    rss_bytes: rss,
                    peak_rss_bytes: peak,
                    disk_mb_per_s: mb_s,
                    turn_disk_bytes: read - base.disk_bytes_read,
                    positions: position,
                    ..base.clone()
                };
                snap.disk_bytes_read = e.disk_bytes_read;
                snap.expert_hits = e.expert_hits;
                snap.expert_misses = e.expert_misses;
                snap.layers = e.layers;
                snap.io_wait_seconds = e.io_wait_seconds;
                // The compute figure moves during the turn: the time of this turn so far,
                // less what it waited for reads, on top of the figure at its start.
                let waited = (snap.io_wait_seconds - base.io_wait_seconds).max(0.0);
                snap.compute_seconds =
                    base.compute_seconds + (start.elapsed().as_secs_f64() - waited).max(0.0);
                alive &= tx
                    .send(EngineEvent::Stats {
                        turn,
                        stats: Box::new(snap),
                    })
                    .is_ok();
            }
        };
        let raw = self.session.mode == crate::session::chat::Mode::Raw;
        let settings = &self.session.settings;
        let started = EngineEvent::TurnStarted {
            turn,
            raw,
            thinking: settings.thinking,
            max_tokens: if raw {
                settings.raw_max_tokens
            } else {
                settings.max_tokens
            } as u64,
        };
        let _ = tx.send(started);
        let result = f(&mut self.session, self.cancel, &mut emit);
        self.deferred.extend(deferred);
        let named_before = self.name.clone();
        if result.is_ok() {
            self.changed = true;
            self.unsaved_turns += 1;
        }
        // Durable before the front end hears of it.
        match &result {
            Ok(r) if r.stop == Stop::Cancelled => {
                self.journal(RecordKind::Stopped, Some(r.reply.clone()));
            }
            Ok(_) => self.journal(RecordKind::Turn, None),
            Err(_) => self.journal(RecordKind::Change, None),
        }
        // The first turn of a new conversation names it: the front end learns the name now.
        if let Some(name) = self.name.clone().filter(|_| self.name != named_before) {
            alive &= self.event(EngineEvent::Named { name });
        }
        if let Ok(r) = &result {
            self.busy_seconds += r.prefill_seconds + r.decode_seconds;
        }
        let (n_tok, secs) = match &result {
            Ok(r) => (r.generated_ids.len() as u64, r.decode_seconds),
            Err(_) => (0, start.elapsed().as_secs_f64()),
        };
        let tps = if secs > 0.0 { n_tok as f64 / secs } else { 0.0 };
        let mut snap = self.stats_snapshot(n_tok, secs, tps);
        snap.turn_disk_bytes = snap.disk_bytes_read.saturating_sub(base.disk_bytes_read);
        alive &= self.event(EngineEvent::Stats {
            turn,
            stats: Box::new(snap),
        });
        match result {
            Ok(report) => {
                alive
                    && self.event(EngineEvent::TurnDone {
                        turn,
                        report: Box::new(report),
                    })
            }
            Err(e) => {
                match e {
                    crate::session::chat::TurnError::Sample(_) => self.outcome.unsound = true,
                    crate::session::chat::TurnError::Stream(_) => self.outcome.aborted = true,
                    _ => {}
                }
                alive && self.failed(turn, e.to_string())
            }
        }
    }

    fn send(&mut self, turn: TurnId, text: &str) -> bool {
        self.turn_result(turn, |s, c, e| s.send(text, c, e))
    }

    fn set(&mut self, setting: Setting, v: f64) -> Result<String, String> {
        let mut s = self.session.settings.clone();
        let line = setting.apply(v, &mut s);
        self.session.set_settings(s).map_err(|e| e.to_string())?;
        self.sources.set(setting.name(), Source::Set);
        Ok(line)
    }

    /// Answers one slash command. Over 100 lines: one arm per command, most a line or two.
    fn command(&mut self, turn: TurnId, command: Command) -> bool {
        let changes = matches!(
            command,
            Command::System(_)
                | Command::Raw
                | Command::Chat
                | Command::Think(_)
                | Command::Undo
                | Command::Set(..)
        );
        let replaces = matches!(
            command,
            Command::New | Command::Save(_) | Command::SaveOver(_) | Command::Load(_)
        );
        let moves_positions = matches!(command, Command::New | Command::Load(_) | Command::Undo);
        let answer: Result<String, String> = match command {
            Command::Regen => return self.turn_result(turn, |s, c, e| s.regen(c, e)),
            Command::Edit(text) => return self.turn_result(turn, |s, c, e| s.edit(&text, c, e)),
            Command::New => self.new_conversation(),
            Command::System(text) => {
                let cleared = text.is_empty();
                self.session.system = (!cleared).then_some(text);
                Ok(if cleared {
                    "system message cleared"
                } else {
                    "system message set"
                }
                .into())
            }
            Command::Raw => {
                self.session.set_mode(Mode::Raw);
                Ok("raw mode: text continues with no template (the context is kept)".into())
            }
            Command::Chat => {
                self.session.set_mode(Mode::Chat);
                Ok("chat mode".into())
            }
            Command::Think(t) => {
                let mut s = self.session.settings.clone();
                let line = t.apply(&mut s);
                self.session
                    .set_settings(s)
                    .map(|()| line)
                    .map_err(|e| e.to_string())
            }
            Command::Undo => self
                .session
                .undo()
                .map(|()| "last exchange removed".into())
                .map_err(|e| e.to_string()),
            Command::Save(name) => {
                let r = self.save(name, false);
                self.outcome.unsaved = r.is_err();
                r
            }
            Command::SaveOver(name) => {
                let r = self.save(name, true);
                self.outcome.unsaved = r.is_err();
                r
            }
            Command::Load(name) => self.load(&name).map_err(|(m, code)| {
                match code {
                    3 => self.outcome.damaged = true,
                    2 => self.outcome.refused = true,
                    _ => self.outcome.failed = true,
                }
                m
            }),
            Command::Sessions => self.sessions(),
            Command::Export(fmt, path) => self.export(fmt, &path),
            Command::Set(setting, v) => self.set(setting, v),
            Command::Budget(gb) => {
                let r = self.budget(gb);
                let snap = self.stats_snapshot(0, 0.0, 0.0);
                let _ = self.event(EngineEvent::Stats {
                    turn,
                    stats: Box::new(snap),
                });
                r
            }
            Command::Stats => Ok(self.stats()),
            Command::Help => Ok(HELP.to_string()),
            Command::Quit => Ok("bye".into()),
        };
        if answer.is_ok() {
            if replaces {
                self.changed = false;
                self.unsaved_turns = 0;
            }
            self.changed |= changes;
            if changes {
                self.journal(RecordKind::Change, None);
            }
            if moves_positions {
                // Positions and state changed (a load, a new conversation, an undo): the
                // front end's figures follow at once.
                let snap = self.stats_snapshot(0, 0.0, 0.0);
                let _ = self.event(EngineEvent::Stats {
                    turn,
                    stats: Box::new(snap),
                });
            }
        }
        match answer {
            Ok(text) => self.notice(turn, text),
            Err(msg) => self.failed(turn, msg),
        }
    }

    /// `/new`: a new conversation, unnamed until its first turn. The one before is let go;
    /// its journal stays on disk (its name's `--resume` recovers its unsaved turns).
    fn new_conversation(&mut self) -> Result<String, String> {
        self.drop_empty_journal();
        self.session.reset().map_err(|e| e.to_string())?;
        let kept = self
            .journal
            .take()
            .filter(|_| self.changed)
            .map(|j| (j.name, j.file.path().display().to_string()));
        self.journal_problem = None;
        self.name = None;
        self.open = None;
        self.base = None;
        self.created = unix_now();
        Ok(match kept {
            Some((name, path)) => format!(
                "new conversation; the unsaved turns of the last one are kept in {path}: \
                 --resume {name} recovers them"
            ),
            None => "new conversation".into(),
        })
    }

    /// What is lost if the worker stops now: `None` when nothing changed since the last save
    /// or load (or since a new conversation began).
    fn unsaved_notice(&self) -> Option<String> {
        if !self.changed {
            return None;
        }
        let mut text = self.unsaved_text();
        match (&self.journal, &self.journal_problem) {
            (_, Some(problem)) => text.push_str(&format!("; {problem}")),
            (Some(j), None) => text.push_str(&format!(
                "; they are kept in the journal {}: `k3 chat --resume {}` recovers them",
                j.file.path().display(),
                j.name
            )),
            (None, None) => {}
        }
        Some(text)
    }

    fn unsaved_text(&self) -> String {
        let what = match self.unsaved_turns {
            0 => "changes".to_string(),
            1 => "1 turn".to_string(),
            n => format!("{n} turns"),
        };
        match (&self.name, &self.open) {
            (Some(n), Some(open)) if open.name() == n && self.store.exists(n) => format!(
                "session {n:?}: {what} since it was last saved or loaded were NOT saved (/save \
                 before leaving keeps them)"
            ),
            _ => format!(
                "this conversation ({what}) was NOT saved (/save [NAME] before leaving keeps it)"
            ),
        }
    }
}

/// What the loading bar is told as weight bytes are read: the most counted so far (several
/// threads read at once, and their counts can arrive out of order, so it never moves back),
/// at most every 0.1 s, the end once, and nothing after it (the checkpoint keeps counting
/// the reads of streamed weights).
#[derive(Default)]
struct LoadProgress {
    shown_at: Option<Instant>,
    seen: u64,
    finished: bool,
}

impl LoadProgress {
    /// The `(done, total)` to show for a count of `done` of `total` at `now`, if any.
    fn next(&mut self, done: u64, total: u64, now: Instant) -> Option<(u64, u64)> {
        if self.finished {
            return None;
        }
        self.seen = self.seen.max(done);
        let end = self.seen >= total;
        if !end
            && self
                .shown_at
                .is_some_and(|t| now.duration_since(t).as_secs_f64() < 0.1)
        {
            return None;
        }
        self.shown_at = Some(now);
        self.finished = end;
        Some((self.seen, total))
    }
}

/// Arm the read fault `K3_FAULT` names (test builds only: the tests drive the failure paths
/// through the binary with it).
#[cfg(feature = "fault-injection")]
fn arm_fault_from_env(model: &Model) -> Result<(), String> {
    use crate::stream::checkpoint::{Fault, FAULT_ENV};
    let Some(spec) = std::env::var_os(FAULT_ENV) else {
        return Ok(());
    };
    let spec = spec.to_string_lossy();
    let Some((fault, n)) = Fault::parse_spec(&spec) else {
        return Err(format!(
            "{FAULT_ENV}={spec:?}: expected KIND@N, KIND one of eintr, short, eio, eio-once"
        ));
    };
    if let Some(ck) = model.store().checkpoint() {
        ck.inject_fault(ck.reads_issued() + n, fault);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_loading_bar_never_moves_back_and_ends_once() {
        use super::LoadProgress;
        use std::time::{Duration, Instant};
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut p = LoadProgress::default();
        assert_eq!(p.next(10, 100, at(0)), Some((10, 100)));
        // Within 0.1 s: not shown.
        assert_eq!(p.next(20, 100, at(50)), None);
        // A count that arrives late shows the most seen so far.
        assert_eq!(p.next(15, 100, at(200)), Some((20, 100)));
        // The end is shown at once, however soon, and only once.
        assert_eq!(p.next(100, 100, at(210)), Some((100, 100)));
        assert_eq!(p.next(90, 100, at(500)), None);
        assert_eq!(p.next(150, 100, at(900)), None);
    }
}
