//! Transition tests of `App::update` against a fake engine: the tests play the worker's part by
//! feeding `EngineEvent`s as messages and checking the effects that come back.

use super::*;
use crate::app::config::Cmd;
use crate::app::protocol::HistoryView;
use crate::session::chat::Entry;
use crate::session::commands::{Setting, Think};
use crate::stream::stats::{LayerResidency, Residency};

const MODEL_BYTES: u64 = 4_000_000_000;

fn init() -> AppInit {
    AppInit {
        model: "tiny".into(),
        session: None,
        resume: false,
        thinking: false,
        effort: "max".into(),
        context_limit: 4096,
        max_tokens: 512,
        history: Vec::new(),
        budget_gb: None,
        keys: KeyLabels(vec![
            (Cmd::Help, "F1".into()),
            (Cmd::Thinking, "Ctrl-T".into()),
        ]),
        theme: ThemeName::Dark,
    }
}

fn ready_app_with(init: AppInit) -> App {
    let mut app = App::new(init);
    assert_eq!(app.phase, Phase::Loading);
    app.update(Msg::Engine(EngineEvent::Ready {
        info: "k3: tiny (13 layers, vocabulary 512), session \"s1\", chat mode".into(),
    }));
    app
}

/// Answer the session dialog's request for the saved sessions, as the worker would.
fn list_sessions(app: &mut App, rows: Vec<SessionRow>) {
    let turn = app
        .pending
        .iter()
        .rev()
        .find(|(_, p)| *p == Purpose::Sessions)
        .map(|(t, _)| *t)
        .expect("a pending session list");
    app.update(Msg::Engine(EngineEvent::Sessions { turn, rows }));
}

fn ready_app() -> App {
    ready_app_with(init())
}

fn act(app: &mut App, a: Action) -> Vec<Effect> {
    app.update(Msg::Action(a))
}

fn type_text(app: &mut App, text: &str) {
    for c in text.chars() {
        act(app, Action::Char(c));
    }
}

fn ev(app: &mut App, e: EngineEvent) -> Vec<Effect> {
    app.update(Msg::Engine(e))
}

fn token(app: &mut App, turn: TurnId, text: &str) -> Vec<Effect> {
    ev(
        app,
        EngineEvent::Token {
            turn,
            id: 7,
            text: text.into(),
            position: 0,
        },
    )
}

fn stats(turn: TurnId, tps: f64) -> StatsSnapshot {
    StatsSnapshot {
        tokens_per_second: tps,
        turn_tokens: 3,
        turn_seconds: 0.5,
        rss_bytes: 3_000_000_000,
        peak_rss_bytes: 3_500_000_000,
        budget_bytes: None,
        model_bytes: MODEL_BYTES,
        disk_bytes_read: MODEL_BYTES,
        layers: vec![
            LayerResidency {
                trunk: Residency::Pinned,
                experts_resident: 16,
                experts_total: 16,
            };
            4
        ],
        positions: 40 + turn,
        context_limit: 4096,
        ..StatsSnapshot::default()
    }
}

fn report(reply: &str, stop: Stop, accepted: bool) -> Box<TurnReport> {
    Box::new(TurnReport {
        mode: Mode::Chat,
        prompt_ids: vec![1, 2, 3],
        generated_ids: vec![4, 5, 6, 7],
        generated_tokens: 4,
        reply: reply.into(),
        reasoning: None,
        reused_tokens: 1,
        prefilled_tokens: 2,
        stop,
        accepted,
        rejected_because: (!accepted).then(|| "malformed".to_string()),
        prefill_seconds: 0.01,
        decode_seconds: 0.5,
        context_warning: None,
    })
}

/// The turn of the single `Send` request among `fx`.
fn sent(fx: &[Effect]) -> (TurnId, String) {
    let sends: Vec<_> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::Send(Request::Send { turn, text }) => Some((*turn, text.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(sends.len(), 1, "{fx:?}");
    sends[0].clone()
}

/// The turn and command of the single `Command` request among `fx`.
fn command(fx: &[Effect]) -> (TurnId, Command) {
    let cmds: Vec<_> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::Send(Request::Command { turn, command }) => Some((*turn, command.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(cmds.len(), 1, "{fx:?}");
    cmds[0].clone()
}

fn send_message(app: &mut App, text: &str) -> TurnId {
    type_text(app, text);
    let fx = act(app, Action::Submit);
    let (turn, sent_text) = sent(&fx);
    assert_eq!(sent_text, text);
    turn
}

fn last_reply(app: &App) -> &Reply {
    app.items
        .iter()
        .rev()
        .find_map(|i| match i {
            Item::Reply(r) => Some(r),
            _ => None,
        })
        .expect("a reply")
}

fn has_error(app: &App, needle: &str) -> bool {
    app.items
        .iter()
        .any(|i| matches!(i, Item::Error(t) if t.contains(needle)))
}

fn is_quit(fx: &[Effect]) -> Option<i32> {
    fx.iter().find_map(|e| match e {
        Effect::Quit { code } => Some(*code),
        _ => None,
    })
}

#[test]
fn ready_names_the_session_and_goes_idle() {
    let app = ready_app();
    assert_eq!(app.phase, Phase::Idle);
    assert_eq!(app.session.as_deref(), Some("s1"));
    assert_eq!(app.mode, Mode::Chat);
    assert!(!app.dirty);
}

#[test]
fn submit_streams_and_finishes() {
    let mut app = ready_app();
    let turn = send_message(&mut app, "hello");
    assert!(app.input.is_empty());
    assert!(matches!(app.phase, Phase::Prefill { turn: t, .. } if t == turn));
    let prefill = StatsSnapshot {
        prefill_done: 64,
        prefill_total: 256,
        ..StatsSnapshot::default()
    };
    ev(
        &mut app,
        EngineEvent::Stats {
            turn,
            stats: Box::new(prefill),
        },
    );
    assert_eq!(
        app.phase,
        Phase::Prefill {
            turn,
            done: 64,
            total: 256
        }
    );
    token(&mut app, turn, "Hel");
    token(&mut app, turn, "lo!");
    assert_eq!(app.phase, Phase::Streaming { turn, tokens: 2 });
    assert_eq!(last_reply(&app).content, "Hello!");
    assert_eq!(last_reply(&app).state, ReplyState::Live);
    ev(
        &mut app,
        EngineEvent::Stats {
            turn,
            stats: Box::new(stats(turn, 12.5)),
        },
    );
    assert_eq!(app.stats.tps.back(), Some(&12.5));
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn,
            report: report("Hello!", Stop::End(2), true),
        },
    );
    let r = last_reply(&app);
    assert_eq!(r.state, ReplyState::Done);
    assert!(
        r.summary.as_deref().unwrap_or("").contains("8.0 tokens/s"),
        "{r:?}"
    );
    assert_eq!(app.phase, Phase::Idle);
    assert!(app.dirty);
    assert_eq!(app.last_reply(), Some("Hello!"));
}

#[test]
fn thinking_text_is_split_from_the_answer() {
    let mut app = ready_app_with(AppInit {
        thinking: true,
        ..init()
    });
    let turn = send_message(&mut app, "why?");
    for piece in [
        "Let me ",
        "think.<|close|>th",
        "ink<|sep|><|open|>response<|sep|>",
        "Because.",
    ] {
        token(&mut app, turn, piece);
    }
    let r = last_reply(&app);
    assert_eq!(r.reasoning, "Let me think.");
    assert_eq!(r.content, "Because.");
    act(&mut app, Action::Cmd(Cmd::Thinking));
    assert!(!app.show_thinking);
}

#[test]
fn cancel_stops_within_the_turn_and_drops_its_stale_events() {
    let mut app = ready_app();
    let turn = send_message(&mut app, "go");
    token(&mut app, turn, "partial");
    let fx = act(&mut app, Action::Cmd(Cmd::Stop));
    assert!(fx.iter().any(|e| matches!(e, Effect::Cancel)), "{fx:?}");
    assert_eq!(app.phase, Phase::Idle);
    assert_eq!(last_reply(&app).state, ReplyState::Stopped);
    // Late events of the cancelled turn change nothing.
    let before = app.items.clone();
    let rev = app.revision;
    token(&mut app, turn, " more");
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn,
            report: report("partial more", Stop::Cancelled, false),
        },
    );
    ev(
        &mut app,
        EngineEvent::Failed {
            turn,
            message: "late".into(),
        },
    );
    assert_eq!(app.items, before);
    assert_eq!(app.revision, rev);
    // Its figures still describe the engine, but add nothing to the sparklines.
    ev(
        &mut app,
        EngineEvent::Stats {
            turn,
            stats: Box::new(stats(turn, 99.0)),
        },
    );
    assert!(app.stats.tps.is_empty());
    assert_eq!(app.phase, Phase::Idle);
    assert_eq!(
        app.stats.last.as_ref().map(|s| s.positions),
        Some(40 + turn)
    );
    // The session goes on: the next message gets a new turn and streams.
    let next = send_message(&mut app, "again");
    assert!(next > turn);
    token(&mut app, next, "fresh");
    assert_eq!(last_reply(&app).content, "fresh");
}

#[test]
fn ctrl_c_stops_then_clears_then_quits() {
    let mut app = ready_app();
    let turn = send_message(&mut app, "go");
    token(&mut app, turn, "x");
    let fx = act(&mut app, Action::Interrupt);
    assert!(fx.iter().any(|e| matches!(e, Effect::Cancel)));
    assert!(is_quit(&fx).is_none());
    type_text(&mut app, "draft");
    act(&mut app, Action::Interrupt);
    assert!(app.input.is_empty());
    // Unsaved: asks first.
    act(&mut app, Action::Interrupt);
    assert_eq!(app.dialog, Some(Dialog::ConfirmQuit));
    let fx = act(&mut app, Action::Char('q'));
    assert_eq!(is_quit(&fx), Some(0));
    assert_eq!(app.phase, Phase::Exiting);
}

#[test]
fn events_for_unknown_turns_are_dropped() {
    let mut app = ready_app();
    let rev = app.revision;
    let n = app.items.len();
    token(&mut app, 42, "ghost");
    ev(
        &mut app,
        EngineEvent::Notice {
            turn: 42,
            text: "ghost".into(),
        },
    );
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn: 42,
            report: report("ghost", Stop::End(1), true),
        },
    );
    assert_eq!(app.items.len(), n);
    assert_eq!(app.revision, rev);
}

#[test]
fn a_failed_turn_shows_the_error_and_keeps_the_session() {
    let mut app = ready_app();
    let turn = send_message(&mut app, "too long");
    ev(
        &mut app,
        EngineEvent::Failed {
            turn,
            message: "the context is full".into(),
        },
    );
    assert_eq!(app.phase, Phase::Idle);
    assert!(has_error(&app, "context is full"));
    assert!(!app.items.iter().any(|i| matches!(i, Item::Reply(_))));
    send_message(&mut app, "shorter");
}

#[test]
fn a_load_failure_shows_the_reason_and_any_key_leaves_with_its_status() {
    let mut app = App::new(init());
    ev(
        &mut app,
        EngineEvent::Failed {
            turn: 0,
            message: "config.json: missing".into(),
        },
    );
    ev(&mut app, EngineEvent::Stopped { exit_code: 3 });
    assert_eq!(
        app.phase,
        Phase::Failed {
            message: "config.json: missing".into(),
            code: 3
        }
    );
    assert!(is_quit(&act(&mut app, Action::Scroll(1))).is_none());
    assert_eq!(is_quit(&act(&mut app, Action::Char('x'))), Some(3));
}

#[test]
fn a_worker_that_vanishes_is_reported() {
    let mut app = ready_app();
    send_message(&mut app, "hi");
    app.update(Msg::WorkerGone);
    assert!(matches!(app.phase, Phase::Failed { code: 1, .. }));
}

#[test]
fn requests_while_busy_or_loading_are_refused_with_a_notice() {
    let mut app = App::new(init());
    type_text(&mut app, "early");
    assert!(act(&mut app, Action::Submit).is_empty());
    assert_eq!(app.input.text(), "early");
    assert!(app.toast.as_ref().is_some_and(|t| t.0.contains("loading")));
    // While a reply is written a command is refused and kept in the input box (a message
    // waits for the reply instead: see the queue test).
    let mut app = ready_app();
    send_message(&mut app, "one");
    type_text(&mut app, "/undo");
    assert!(act(&mut app, Action::Submit).is_empty());
    assert_eq!(app.input.text(), "/undo");
    assert!(app
        .toast
        .as_ref()
        .is_some_and(|t| t.0.contains("being generated")));
}

fn with_figures(app: &mut App) {
    ev(
        app,
        EngineEvent::Stats {
            turn: 0,
            stats: Box::new(stats(0, 0.0)),
        },
    );
}

/// The `/budget` argument the slider sends for its position `step`.
fn gb_at(app: &App, step: u32) -> f64 {
    round_sig3(app.budget.bytes_at(step) as f64 / 1e9)
}

#[test]
fn the_budget_slider_scale_is_logarithmic_around_the_model() {
    let mut b = Budget::default();
    assert!(!b.ready());
    b.observe(MODEL_BYTES, None, 0);
    assert_eq!(b.bytes_at(0), MODEL_BYTES / 16);
    assert_eq!(b.bytes_at(BUDGET_STEPS), MODEL_BYTES / 4 * 5);
    assert_eq!(b.step, BUDGET_STEPS, "no budget: the knob sits at the top");
    for step in 0..=BUDGET_STEPS {
        assert_eq!(b.step_of(b.bytes_at(step)), step);
    }
    // A budget in force above what helps sits at the top, which stays where everything is
    // held; an untouched knob follows the budget in force.
    b.observe(MODEL_BYTES, Some(16_000_000_000), 0);
    assert_eq!(b.bytes_at(BUDGET_STEPS), MODEL_BYTES / 4 * 5);
    assert_eq!(b.step, BUDGET_STEPS);
    b.observe(MODEL_BYTES, Some(MODEL_BYTES / 2), 0);
    assert_eq!(b.step, b.step_of(MODEL_BYTES / 2));
    assert!(b.step > 0 && b.step < BUDGET_STEPS);
    // With the plan's floor known, the lowest position is the floor: nothing below it runs.
    b.observe(MODEL_BYTES, Some(MODEL_BYTES / 2), MODEL_BYTES / 5);
    assert_eq!(b.bytes_at(0), MODEL_BYTES / 5);
    assert_eq!(b.step_of(MODEL_BYTES / 100), 0);
    // A floor above what helps still leaves a range.
    b.observe(MODEL_BYTES, None, MODEL_BYTES * 2);
    assert_eq!(b.bytes_at(BUDGET_STEPS), MODEL_BYTES * 4);
}

#[test]
fn a_typed_budget_moves_the_slider() {
    let mut app = ready_app();
    with_figures(&mut app);
    type_text(&mut app, "/budget 2");
    let fx = act(&mut app, Action::Submit);
    let (turn, cmd) = command(&fx);
    assert_eq!(cmd, Command::Budget(2.0));
    ev(
        &mut app,
        EngineEvent::Notice {
            turn,
            text: "budget 2.0 GB: 1 of 4 layers pinned".into(),
        },
    );
    assert_eq!(app.budget.step, app.budget.step_of(2_000_000_000));
    assert!(app.budget.step < BUDGET_STEPS);
}

#[test]
fn the_budget_slider_asks_the_engine_and_shows_its_answer() {
    let mut app = ready_app();
    // No figures yet: the slider cannot move.
    assert!(act(&mut app, Action::CharOr('[', Cmd::BudgetDown)).is_empty());
    with_figures(&mut app);
    assert!(app.budget.ready());
    assert_eq!(app.budget.in_force, None);
    assert_eq!(app.budget.step, BUDGET_STEPS);
    let fx = act(&mut app, Action::CharOr('[', Cmd::BudgetDown));
    let (turn, cmd) = command(&fx);
    assert_eq!(cmd, Command::Budget(gb_at(&app, BUDGET_STEPS - 1)));
    // A second move while the first is in flight waits for its answer.
    assert!(act(&mut app, Action::CharOr('[', Cmd::BudgetDown)).is_empty());
    assert_eq!(app.budget.step, BUDGET_STEPS - 2);
    let fx = ev(
        &mut app,
        EngineEvent::Failed {
            turn,
            message: "/budget: below the floor".into(),
        },
    );
    // A refused value is not left on the slider: it goes back to the budget in force.
    assert!(fx.is_empty(), "{fx:?}");
    assert_eq!(app.budget.step, BUDGET_STEPS);
    assert!(
        matches!(&app.budget.answer, Some((b, Err(t))) if *b == app.budget.asked_at(BUDGET_STEPS - 1) && t.contains("floor"))
    );
    // The answer is not a conversation error.
    assert!(!has_error(&app, "floor"));
    act(&mut app, Action::CharOr('[', Cmd::BudgetDown));
    let fx = act(&mut app, Action::CharOr('[', Cmd::BudgetDown));
    assert!(fx.is_empty(), "one request at a time: {fx:?}");
    let fx = ev(
        &mut app,
        EngineEvent::Notice {
            turn: turn + 1,
            text: "budget 4.5 GB".into(),
        },
    );
    let (turn2, cmd2) = command(&fx);
    assert_eq!(cmd2, Command::Budget(gb_at(&app, BUDGET_STEPS - 2)));
    ev(
        &mut app,
        EngineEvent::Notice {
            turn: turn2,
            text: "budget 4.1 GB: 3 of 4 layers pinned".into(),
        },
    );
    assert!(app.budget.asked.is_none());
    assert!(matches!(&app.budget.answer, Some((_, Ok(t))) if t.starts_with("budget 4.1 GB")));
    // The engine's figures report the new budget; the knob stays where the user put it, and
    // the slider, "in force" and the engine's answer are one number.
    let asked = app.budget.asked_at(BUDGET_STEPS - 2);
    assert_eq!(app.budget.value_bytes(), asked);
    assert_eq!(app.budget.in_force, Some(asked));
    let mut s = stats(0, 0.0);
    s.budget_bytes = Some(asked);
    ev(
        &mut app,
        EngineEvent::Stats {
            turn: 0,
            stats: Box::new(s),
        },
    );
    assert_eq!(app.budget.in_force, Some(asked));
    assert_eq!(app.budget.value_bytes(), asked);
    assert_eq!(app.budget.step, BUDGET_STEPS - 2);
    // The mouse sets it directly; a bracket with text in the input box is typed instead.
    let fx = act(&mut app, Action::BudgetAt(0.5));
    assert_eq!(
        command(&fx).1,
        Command::Budget(gb_at(&app, BUDGET_STEPS / 2))
    );
    type_text(&mut app, "a");
    assert!(act(&mut app, Action::CharOr(']', Cmd::BudgetUp)).is_empty());
    assert_eq!(app.input.text(), "a]");
}

#[test]
fn the_budget_slider_has_keys_when_focused() {
    let mut app = ready_app();
    with_figures(&mut app);
    act(&mut app, Action::Cmd(Cmd::Focus));
    assert_eq!(app.focus, Focus::Budget);
    let fx = act(&mut app, Action::Left);
    assert_eq!(
        command(&fx).1,
        Command::Budget(gb_at(&app, BUDGET_STEPS - 1))
    );
    assert_eq!(app.budget.step, BUDGET_STEPS - 1);
    act(&mut app, Action::Cmd(Cmd::Stop));
    assert_eq!(app.focus, Focus::Input);
}

#[test]
fn a_budget_from_the_config_is_asked_for_at_start() {
    let mut app = App::new(AppInit {
        budget_gb: Some(24.0),
        ..init()
    });
    let fx = ev(
        &mut app,
        EngineEvent::Ready {
            info: "k3: x, session \"a\", chat mode".into(),
        },
    );
    assert_eq!(command(&fx).1, Command::Budget(24.0));
}

#[test]
fn the_mode_key_switches_to_raw_and_back() {
    let mut app = ready_app();
    let fx = act(&mut app, Action::Cmd(Cmd::Mode));
    let (turn, cmd) = command(&fx);
    assert_eq!(cmd, Command::Raw);
    assert_eq!(app.mode, Mode::Chat, "changes only once the engine agrees");
    ev(
        &mut app,
        EngineEvent::Notice {
            turn,
            text: "raw mode".into(),
        },
    );
    assert_eq!(app.mode, Mode::Raw);
    let t = send_message(&mut app, "Once upon");
    token(&mut app, t, " a time<|open|>");
    let r = last_reply(&app);
    assert!(r.raw);
    assert_eq!(r.content, " a time<|open|>", "raw text is not parsed");
    assert!(app
        .items
        .iter()
        .any(|i| matches!(i, Item::User { raw: true, .. })));
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn: t,
            report: report(" a time<|open|>", Stop::MaxTokens, true),
        },
    );
    let fx = act(&mut app, Action::Cmd(Cmd::Mode));
    assert_eq!(command(&fx).1, Command::Chat);
}

fn rows() -> Vec<SessionRow> {
    vec![
        SessionRow {
            name: "alpha".into(),
            saved_unix: 1_800_000_000,
            saved: "2027-01-15 08:00".into(),
            turns: 3,
            bytes: 12_345,
            problem: None,
        },
        SessionRow {
            name: "beta".into(),
            saved_unix: 1_700_000_000,
            saved: "2023-11-14 22:13".into(),
            turns: 1,
            bytes: 999,
            problem: None,
        },
    ]
}

#[test]
fn the_session_dialog_loads_and_shows_the_history() {
    let mut app = ready_app();
    let fx = act(&mut app, Action::Cmd(Cmd::Sessions));
    assert!(fx
        .iter()
        .any(|e| matches!(e, Effect::Send(Request::ListSessions { .. }))));
    assert!(matches!(
        app.dialog,
        Some(Dialog::Sessions(SessionDialog { rows: None, .. }))
    ));
    list_sessions(&mut app, rows());
    act(&mut app, Action::Down);
    act(&mut app, Action::Down);
    let fx = act(&mut app, Action::Submit);
    let (turn, cmd) = command(&fx);
    assert_eq!(cmd, Command::Load("beta".into()));
    assert!(app.dialog.is_none());
    let fx = ev(
        &mut app,
        EngineEvent::Notice {
            turn,
            text: "loaded session \"beta\"".into(),
        },
    );
    assert_eq!(app.session.as_deref(), Some("beta"));
    let history_turn = match &fx[..] {
        [Effect::Send(Request::History { turn })] => *turn,
        other => panic!("{other:?}"),
    };
    let history = HistoryView {
        name: Some("beta".into()),
        system: None,
        mode: Mode::Chat,
        entries: vec![
            Entry::Message {
                role: "user".into(),
                content: "old question".into(),
                reasoning: None,
            },
            Entry::Message {
                role: "assistant".into(),
                content: "old answer".into(),
                reasoning: Some("hm".into()),
            },
        ],
    };
    ev(
        &mut app,
        EngineEvent::History {
            turn: history_turn,
            history: Box::new(history),
        },
    );
    assert!(app
        .items
        .iter()
        .any(|i| matches!(i, Item::User { text, .. } if text == "old question")));
    assert_eq!(last_reply(&app).content, "old answer");
    assert_eq!(last_reply(&app).reasoning, "hm");
    assert!(!app.dirty);
    // A history the worker cannot send is an error line, not a crash.
    app.fetch_history(&mut Vec::new());
    let turn = app.pending.last().map(|p| p.0).unwrap_or_default();
    ev(
        &mut app,
        EngineEvent::Failed {
            turn,
            message: "gone".into(),
        },
    );
    assert!(has_error(&app, "cannot show the saved history: gone"));
}

#[test]
fn saving_over_another_listed_session_asks_first() {
    let mut app = ready_app();
    act(&mut app, Action::Cmd(Cmd::Sessions));
    list_sessions(&mut app, rows());
    act(&mut app, Action::Char('s'));
    act(&mut app, Action::ClearInput);
    for _ in 0..2 {
        act(&mut app, Action::Backspace);
    }
    type_text(&mut app, "beta");
    let fx = act(&mut app, Action::Submit);
    assert!(fx.is_empty(), "{fx:?}");
    assert_eq!(app.dialog, Some(Dialog::ConfirmReplace("beta".into())));
    // No keeps it; yes replaces it with /save!.
    assert!(act(&mut app, Action::Char('n')).is_empty());
    assert_eq!(app.dialog, None);
    app.dialog = Some(Dialog::ConfirmReplace("beta".into()));
    let fx = act(&mut app, Action::Char('y'));
    let (turn, cmd) = command(&fx);
    assert_eq!(cmd, Command::SaveOver(Some("beta".into())));
    ev(
        &mut app,
        EngineEvent::Notice {
            turn,
            text: "saved session \"beta\" (3 positions)".into(),
        },
    );
    assert_eq!(app.session.as_deref(), Some("beta"));
    // The session's own name is saved over without asking.
    act(&mut app, Action::Cmd(Cmd::Sessions));
    list_sessions(&mut app, rows());
    act(&mut app, Action::Char('s'));
    let fx = act(&mut app, Action::Submit);
    assert_eq!(command(&fx).1, Command::Save(Some("beta".into())));
}

#[test]
fn a_save_under_the_default_name_learns_it_from_the_answer() {
    let mut app = ready_app_with(init());
    app.session = None;
    type_text(&mut app, "/save");
    let fx = act(&mut app, Action::Submit);
    let (turn, cmd) = command(&fx);
    assert_eq!(cmd, Command::Save(None));
    ev(
        &mut app,
        EngineEvent::Notice {
            turn,
            text: "saved session \"hello-2026-12-01\" (9 positions, 1.0 KB, 2 ms)".into(),
        },
    );
    assert_eq!(app.session.as_deref(), Some("hello-2026-12-01"));
}

#[test]
fn the_session_dialog_saves_under_a_new_name() {
    let mut app = ready_app();
    act(&mut app, Action::Cmd(Cmd::Sessions));
    list_sessions(&mut app, Vec::new());
    act(&mut app, Action::Char('s'));
    match &app.dialog {
        Some(Dialog::Sessions(d)) => assert_eq!(d.naming.as_ref().map(Editor::text), Some("s1")),
        other => panic!("{other:?}"),
    }
    act(&mut app, Action::ClearInput);
    for _ in 0..2 {
        act(&mut app, Action::Backspace);
    }
    // A name the store refuses is explained in the dialog.
    type_text(&mut app, "../x");
    act(&mut app, Action::Submit);
    match &app.dialog {
        Some(Dialog::Sessions(d)) => assert!(d.message.is_some()),
        other => panic!("{other:?}"),
    }
    for _ in 0..4 {
        act(&mut app, Action::Backspace);
    }
    type_text(&mut app, "keep-me");
    let fx = act(&mut app, Action::Submit);
    let (turn, cmd) = command(&fx);
    assert_eq!(cmd, Command::Save(Some("keep-me".into())));
    app.dirty = true;
    ev(
        &mut app,
        EngineEvent::Notice {
            turn,
            text: "saved session \"keep-me\"".into(),
        },
    );
    assert!(!app.dirty);
    assert_eq!(app.session.as_deref(), Some("keep-me"));
}

#[test]
fn new_from_the_dialog_asks_when_unsaved() {
    let mut app = ready_app();
    let t = send_message(&mut app, "x");
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn: t,
            report: report("y", Stop::End(1), true),
        },
    );
    act(&mut app, Action::Cmd(Cmd::Sessions));
    act(&mut app, Action::Char('n'));
    assert_eq!(app.dialog, Some(Dialog::ConfirmNew));
    let fx = act(&mut app, Action::Char('y'));
    let (turn, cmd) = command(&fx);
    assert_eq!(cmd, Command::New);
    ev(
        &mut app,
        EngineEvent::Notice {
            turn,
            text: "new conversation".into(),
        },
    );
    assert!(!app.items.iter().any(|i| matches!(i, Item::Reply(_))));
    assert!(!app.dirty);
}

#[test]
fn quitting_unsaved_asks_and_can_save_first() {
    let mut app = ready_app();
    let t = send_message(&mut app, "x");
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn: t,
            report: report("y", Stop::End(1), true),
        },
    );
    assert!(app.dirty);
    let fx = act(&mut app, Action::Cmd(Cmd::Quit));
    assert!(is_quit(&fx).is_none());
    assert_eq!(app.dialog, Some(Dialog::ConfirmQuit));
    act(&mut app, Action::Cmd(Cmd::Stop));
    assert_eq!(app.dialog, None, "Esc stays");
    act(&mut app, Action::Cmd(Cmd::Quit));
    let fx = act(&mut app, Action::Char('s'));
    let (turn, cmd) = command(&fx);
    assert_eq!(cmd, Command::Save(None));
    assert!(is_quit(&fx).is_none());
    // A failed save does not quit.
    let fx = ev(
        &mut app,
        EngineEvent::Failed {
            turn,
            message: "disk full".into(),
        },
    );
    assert!(is_quit(&fx).is_none());
    assert!(has_error(&app, "not quitting"));
    act(&mut app, Action::Cmd(Cmd::Quit));
    let fx = act(&mut app, Action::Char('s'));
    let (turn, _) = command(&fx);
    let fx = ev(
        &mut app,
        EngineEvent::Notice {
            turn,
            text: "saved".into(),
        },
    );
    assert_eq!(is_quit(&fx), Some(0));
}

#[test]
fn quitting_a_clean_session_does_not_ask() {
    let mut app = ready_app();
    type_text(&mut app, "/quit");
    assert_eq!(is_quit(&act(&mut app, Action::Submit)), Some(0));
}

#[test]
fn slash_commands_from_the_input_box() {
    let mut app = ready_app();
    type_text(&mut app, "/set temperature 0.5");
    let (_, cmd) = command(&act(&mut app, Action::Submit));
    assert_eq!(cmd, Command::Set(Setting::Temperature, 0.5));
    type_text(&mut app, "/frobnicate");
    assert!(act(&mut app, Action::Submit).is_empty());
    assert!(has_error(&app, "unknown command /frobnicate"));
    type_text(&mut app, "/help");
    act(&mut app, Action::Submit);
    assert_eq!(app.dialog, Some(Dialog::Help));
    act(&mut app, Action::Char('x'));
    assert_eq!(app.dialog, None);
    type_text(&mut app, "//literal");
    assert_eq!(sent(&act(&mut app, Action::Submit)).1, "/literal");
}

#[test]
fn regen_replaces_the_last_reply_once_accepted() {
    let mut app = ready_app();
    let t = send_message(&mut app, "q");
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn: t,
            report: report("first", Stop::End(1), true),
        },
    );
    type_text(&mut app, "/regen");
    let (t2, cmd) = command(&act(&mut app, Action::Submit));
    assert_eq!(cmd, Command::Regen);
    token(&mut app, t2, "second");
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn: t2,
            report: report("second", Stop::End(1), true),
        },
    );
    let replies: Vec<&str> = app
        .items
        .iter()
        .filter_map(|i| match i {
            Item::Reply(r) => Some(r.content.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(replies, vec!["second"]);
}

#[test]
fn input_history_and_multiline_editing() {
    let mut app = ready_app();
    let t = send_message(&mut app, "first");
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn: t,
            report: report("r", Stop::End(1), true),
        },
    );
    type_text(&mut app, "a");
    act(&mut app, Action::Cmd(Cmd::Newline));
    type_text(&mut app, "b");
    assert_eq!(app.input.text(), "a\nb");
    // Up moves between lines first, then into the history.
    act(&mut app, Action::Up);
    assert_eq!(app.input.text(), "a\nb");
    act(&mut app, Action::Up);
    assert_eq!(app.input.text(), "first");
    act(&mut app, Action::Down);
    assert_eq!(app.input.text(), "a\nb");
}

#[test]
fn paste_is_one_insert_and_huge_pastes_are_cut_with_a_notice() {
    let mut app = ready_app();
    app.update(Msg::Paste("line 1\r\nline 2\u{1b}[31m".into()));
    assert_eq!(app.input.text(), "line 1\nline 2\u{1b}[31m");
    assert_eq!(app.phase, Phase::Idle, "a paste never submits");
    app.update(Msg::Paste("x".repeat(editor::MAX_INPUT_BYTES)));
    assert!(app.input.text().len() <= editor::MAX_INPUT_BYTES);
    assert!(app.toast.as_ref().is_some_and(|t| t.0.contains("dropped")));
}

#[test]
fn question_mark_opens_help_only_on_an_empty_input() {
    let mut app = ready_app();
    act(&mut app, Action::Char('?'));
    assert_eq!(app.dialog, Some(Dialog::Help));
    act(&mut app, Action::Cmd(Cmd::Stop));
    type_text(&mut app, "why?");
    assert_eq!(app.input.text(), "why?");
    assert_eq!(app.dialog, None);
}

#[test]
fn scrolling_is_clamped_and_keeps_its_place_as_text_arrives() {
    let mut app = ready_app();
    app.update(Msg::Viewport {
        max_scroll: 100,
        page: 20,
    });
    act(&mut app, Action::PageUp);
    assert_eq!(app.scroll, 19);
    act(&mut app, Action::Scroll(1000));
    assert_eq!(app.scroll, 100);
    app.update(Msg::Viewport {
        max_scroll: 110,
        page: 20,
    });
    assert_eq!(app.scroll, 110, "anchored while new lines arrive below");
    act(&mut app, Action::Cmd(Cmd::Follow));
    assert_eq!(app.scroll, 0);
    act(&mut app, Action::Scroll(-5));
    assert_eq!(app.scroll, 0);
    // Measuring without a change is not a visible change.
    let rev = app.revision;
    app.update(Msg::Viewport {
        max_scroll: 110,
        page: 20,
    });
    assert_eq!(app.revision, rev);
}

#[test]
fn idle_ticks_do_not_redraw_but_busy_ones_do() {
    let mut app = ready_app();
    let t0 = Instant::now();
    let rev = app.revision;
    app.update(Msg::Tick(t0));
    assert_eq!(app.revision, rev);
    send_message(&mut app, "x");
    let rev = app.revision;
    app.update(Msg::Tick(t0));
    assert!(app.revision > rev);
}

#[test]
fn copy_puts_the_last_reply_on_the_clipboard() {
    let mut app = ready_app();
    let fx = act(&mut app, Action::Cmd(Cmd::Copy));
    assert!(fx.is_empty());
    let t = send_message(&mut app, "q");
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn: t,
            report: report("the answer", Stop::End(1), true),
        },
    );
    let fx = act(&mut app, Action::Cmd(Cmd::Copy));
    assert!(matches!(&fx[..], [Effect::Copy(t)] if t == "the answer"));
}

#[test]
fn resuming_fetches_the_history_once_ready() {
    let mut app = App::new(AppInit {
        resume: true,
        session: Some("old".into()),
        ..init()
    });
    let fx = ev(
        &mut app,
        EngineEvent::Ready {
            info: "k3: tiny, session \"old\", raw mode\nloaded session \"old\"".into(),
        },
    );
    assert!(
        matches!(&fx[..], [Effect::Send(Request::History { .. })]),
        "{fx:?}"
    );
    assert_eq!(app.mode, Mode::Raw);
    assert_eq!(app.session.as_deref(), Some("old"));
}

#[test]
fn no_message_sequence_panics() {
    // A small deterministic walk over many messages in odd orders.
    let actions = [
        Action::Char('a'),
        Action::Submit,
        Action::Cmd(Cmd::Stop),
        Action::Interrupt,
        Action::Cmd(Cmd::Sessions),
        Action::Down,
        Action::Up,
        Action::Char('s'),
        Action::Backspace,
        Action::Cmd(Cmd::Quit),
        Action::Char('n'),
        Action::CharOr('[', Cmd::BudgetDown),
        Action::BudgetAt(f64::NAN),
        Action::BudgetWheel(-100),
        Action::Scroll(i32::MIN),
        Action::Scroll(i32::MAX),
        Action::PageDown,
        Action::Cmd(Cmd::Mode),
        Action::Cmd(Cmd::Focus),
        Action::Left,
        Action::Delete,
        Action::Home,
        Action::End,
    ];
    let mut app = ready_app();
    with_figures(&mut app);
    let mut seed = 12_345u64;
    for i in 0..5000u64 {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let pick = (seed >> 33) as usize;
        let msg = match pick % 7 {
            0 => Msg::Engine(EngineEvent::Token {
                turn: (pick % 5) as u64,
                id: 1,
                text: "t\u{1b}".into(),
                position: (pick % 11) as u64,
            }),
            1 => Msg::Engine(EngineEvent::Notice {
                turn: (pick % 9) as u64,
                text: "n".into(),
            }),
            2 => Msg::Engine(EngineEvent::TurnDone {
                turn: (pick % 9) as u64,
                report: report("r", Stop::End(1), i % 2 == 0),
            }),
            3 => Msg::Viewport {
                max_scroll: pick % 50,
                page: pick % 30,
            },
            _ => Msg::Action(actions[pick % actions.len()].clone()),
        };
        let _ = app.update(msg);
        if app.phase == Phase::Exiting {
            app = ready_app();
        }
    }
}

/// A finished turn leaves the conversation with unsaved changes.
fn unsaved_app() -> App {
    let mut app = ready_app();
    let turn = send_message(&mut app, "hi");
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn,
            report: report("hello", Stop::End(1), true),
        },
    );
    assert!(app.dirty);
    app
}

#[test]
fn loading_over_unsaved_turns_asks_first() {
    // `/load`: nothing is sent until the user says yes.
    let mut app = unsaved_app();
    type_text(&mut app, "/load other");
    let fx = act(&mut app, Action::Submit);
    assert!(fx.is_empty(), "{fx:?}");
    assert_eq!(app.dialog, Some(Dialog::ConfirmLoad("other".into())));
    assert!(act(&mut app, Action::Char('n')).is_empty());
    assert_eq!(app.dialog, None);
    assert!(app.dirty);
    type_text(&mut app, "/load other");
    act(&mut app, Action::Submit);
    let fx = act(&mut app, Action::Char('y'));
    assert_eq!(command(&fx).1, Command::Load("other".into()));
    // The session dialog's Enter on a row asks the same question.
    let mut app = unsaved_app();
    act(&mut app, Action::Cmd(Cmd::Sessions));
    list_sessions(&mut app, rows());
    let fx = act(&mut app, Action::Submit);
    assert!(fx.is_empty(), "{fx:?}");
    assert!(matches!(app.dialog, Some(Dialog::ConfirmLoad(_))));
    let fx = act(&mut app, Action::Char('y'));
    assert!(matches!(command(&fx).1, Command::Load(_)));
    // With nothing unsaved, no question.
    let mut app = ready_app();
    type_text(&mut app, "/load other");
    let fx = act(&mut app, Action::Submit);
    assert_eq!(command(&fx).1, Command::Load("other".into()));
}

#[test]
fn save_as_replaces_the_prefilled_name_and_the_status_follows() {
    let mut app = ready_app();
    act(&mut app, Action::Cmd(Cmd::Sessions));
    list_sessions(&mut app, Vec::new());
    act(&mut app, Action::Char('s'));
    // Typing replaces the prefilled "s1" instead of appending to it.
    type_text(&mut app, "fresh");
    match &app.dialog {
        Some(Dialog::Sessions(d)) => {
            assert_eq!(d.naming.as_ref().map(Editor::text), Some("fresh"));
        }
        other => panic!("{other:?}"),
    }
    let fx = act(&mut app, Action::Submit);
    let (turn, cmd) = command(&fx);
    assert_eq!(cmd, Command::Save(Some("fresh".into())));
    ev(
        &mut app,
        EngineEvent::Notice {
            turn,
            text: "saved session \"fresh\" (3 positions)".into(),
        },
    );
    assert_eq!(app.session.as_deref(), Some("fresh"));
    // Editing keys keep the prefill: Backspace then a character extends it.
    act(&mut app, Action::Cmd(Cmd::Sessions));
    list_sessions(&mut app, Vec::new());
    act(&mut app, Action::Char('s'));
    act(&mut app, Action::Backspace);
    type_text(&mut app, "2");
    match &app.dialog {
        Some(Dialog::Sessions(d)) => {
            assert_eq!(d.naming.as_ref().map(Editor::text), Some("fres2"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_refused_command_line_is_shown_above_its_error() {
    let mut app = ready_app();
    for line in ["/export pdf", "/frobnicate"] {
        type_text(&mut app, line);
        act(&mut app, Action::Submit);
        let n = app.items.len();
        assert!(
            matches!(&app.items[n - 2], Item::Info(t) if t == &format!("› {line}")),
            "{:?}",
            &app.items[n - 2..]
        );
        assert!(matches!(&app.items[n - 1], Item::Error(_)));
    }
}

#[test]
fn a_finished_reply_sums_up_what_the_engine_did() {
    let mut app = ready_app();
    ev(
        &mut app,
        EngineEvent::Stats {
            turn: 0,
            stats: Box::new(stats(0, 0.0)),
        },
    );
    let turn = send_message(&mut app, "hi");
    let mut after = stats(turn, 8.0);
    after.disk_bytes_read = MODEL_BYTES + 12_300_000;
    ev(
        &mut app,
        EngineEvent::Stats {
            turn,
            stats: Box::new(after),
        },
    );
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn,
            report: report("hello", Stop::End(1), true),
        },
    );
    assert_eq!(
        last_reply(&app).summary.as_deref(),
        Some(
            "4 tokens · 8.0 tokens/s · prompt 1 reused + 2 read · 0.5 s · 12.3 MB read · \
             end of message"
        )
    );
}

#[test]
fn the_new_key_starts_a_new_conversation_and_asks_over_unsaved_turns() {
    let mut app = ready_app();
    let fx = act(&mut app, Action::Cmd(Cmd::New));
    assert_eq!(command(&fx).1, Command::New);
    let mut app = unsaved_app();
    assert!(act(&mut app, Action::Cmd(Cmd::New)).is_empty());
    assert_eq!(app.dialog, Some(Dialog::ConfirmNew));
    let fx = act(&mut app, Action::Char('y'));
    assert_eq!(command(&fx).1, Command::New);
}

#[test]
fn a_long_reply_rings_when_it_ends_and_the_pace_is_shown_while_it_streams() {
    let mut app = ready_app();
    let turn = send_message(&mut app, "hi");
    for _ in 0..3 {
        token(&mut app, turn, "x");
    }
    // 0.25 tokens/s: 4 s a token, and (512 - 3) tokens at most left.
    ev(
        &mut app,
        EngineEvent::Stats {
            turn,
            stats: Box::new(stats(turn, 0.25)),
        },
    );
    assert_eq!(app.pace(), Some((4.0, 509.0 * 4.0)));
    let mut long = report("hello", Stop::End(1), true);
    long.decode_seconds = 12.0;
    let fx = ev(&mut app, EngineEvent::TurnDone { turn, report: long });
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::Notify(t) if t.contains("ready"))),
        "{fx:?}"
    );
    assert_eq!(app.pace(), None);
    // A quick one does not.
    let turn = send_message(&mut app, "again");
    let fx = ev(
        &mut app,
        EngineEvent::TurnDone {
            turn,
            report: report("ok", Stop::End(1), true),
        },
    );
    assert!(!fx.iter().any(|e| matches!(e, Effect::Notify(_))), "{fx:?}");
}

#[test]
fn the_input_history_of_earlier_runs_is_recalled_and_handed_back() {
    let mut app = ready_app_with(AppInit {
        history: vec!["first run".into(), "second run".into()],
        ..init()
    });
    act(&mut app, Action::Up);
    assert_eq!(app.input.text(), "second run");
    act(&mut app, Action::Up);
    assert_eq!(app.input.text(), "first run");
    act(&mut app, Action::ClearInput);
    send_message(&mut app, "this run");
    assert_eq!(
        app.history.entries(),
        ["first run", "second run", "this run"]
    );
}

/// The position the status bar shows.
fn pos(app: &App) -> u64 {
    app.stats.last.as_ref().map_or(0, |s| s.positions)
}

#[test]
fn the_position_moves_during_a_turn_and_follows_load_new_and_undo() {
    let mut app = ready_app();
    with_figures(&mut app);
    let start = pos(&app);
    let turn = send_message(&mut app, "hello");
    // Prefill figures carry the positions read so far (and no residency picture).
    let prefill = StatsSnapshot {
        prefill_done: 64,
        prefill_total: 100,
        positions: start + 64,
        ..StatsSnapshot::default()
    };
    ev(
        &mut app,
        EngineEvent::Stats {
            turn,
            stats: Box::new(prefill),
        },
    );
    assert_eq!(pos(&app), start + 64);
    for (i, text) in ["a", "b", "c"].iter().enumerate() {
        ev(
            &mut app,
            EngineEvent::Token {
                turn,
                id: 9,
                text: (*text).into(),
                position: start + 101 + i as u64,
            },
        );
        assert_eq!(pos(&app), start + 101 + i as u64, "after token {i}");
    }
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn,
            report: report("abc", Stop::End(2), true),
        },
    );
    // `/undo`, `/new` and `/load`: the worker's figures that follow each answer set it.
    for (cmd, after) in [
        (Command::Undo, 40),
        (Command::New, 0),
        (Command::Load("s1".into()), 310),
    ] {
        app.dirty = false;
        let fx = {
            app.send_command(cmd.clone(), &mut Vec::new());
            app.pending.last().map(|(t, _)| *t).unwrap()
        };
        let mut snap = stats(0, 0.0);
        snap.positions = after;
        ev(
            &mut app,
            EngineEvent::Stats {
                turn: fx,
                stats: Box::new(snap),
            },
        );
        ev(
            &mut app,
            EngineEvent::Notice {
                turn: fx,
                text: "ok".into(),
            },
        );
        assert_eq!(pos(&app), after, "{cmd:?}");
    }
}

#[test]
fn the_slider_shows_the_budget_in_force_exactly() {
    let mut app = ready_app();
    // The engine opened under a budget that is no slider step (80% of the memory, say).
    let mut s = stats(0, 0.0);
    s.budget_bytes = Some(1_234_567_890);
    s.floor_bytes = 300_000_000;
    ev(
        &mut app,
        EngineEvent::Stats {
            turn: 0,
            stats: Box::new(s),
        },
    );
    assert_eq!(app.budget.value_bytes(), 1_234_567_890);
    assert_eq!(app.budget.in_force, Some(1_234_567_890));
    // A move asks for the step's value to three digits, and that value is what the slider
    // shows while asked, and what is in force once the engine accepts it.
    let fx = act(&mut app, Action::CharOr('[', Cmd::BudgetDown));
    let (turn, cmd) = command(&fx);
    let Command::Budget(gb) = cmd else {
        panic!("{cmd:?}")
    };
    let asked = (gb * 1e9).round() as u64;
    assert_eq!(app.budget.value_bytes(), asked);
    // Figures sent before the answer (the old budget) do not move the knob back.
    let mut old = stats(0, 0.0);
    old.budget_bytes = Some(1_234_567_890);
    old.floor_bytes = 300_000_000;
    ev(
        &mut app,
        EngineEvent::Stats {
            turn: 0,
            stats: Box::new(old),
        },
    );
    assert_eq!(app.budget.value_bytes(), asked);
    ev(
        &mut app,
        EngineEvent::Notice {
            turn,
            text: format!("budget {}: 1 of 4 layers pinned", short_bytes(asked)),
        },
    );
    assert_eq!(app.budget.in_force, Some(asked));
    assert_eq!(app.budget.value_bytes(), asked);
    // The engine's line names the same number the pane shows.
    let shown = short_bytes(app.budget.value_bytes());
    assert!(
        matches!(&app.budget.answer, Some((_, Ok(t))) if t.contains(&shown)),
        "{:?} vs {shown}",
        app.budget.answer
    );
}

#[test]
fn answer_now_closes_the_thinking_and_the_effort_key_cycles() {
    let mut app = ready_app_with(AppInit {
        thinking: true,
        ..init()
    });
    // Idle: nothing to close.
    assert!(act(&mut app, Action::Cmd(Cmd::AnswerNow)).is_empty());
    let turn = send_message(&mut app, "hello");
    token(&mut app, turn, "Let me think");
    let fx = act(&mut app, Action::Cmd(Cmd::AnswerNow));
    assert!(matches!(fx.as_slice(), [Effect::AnswerNow]), "{fx:?}");
    // The engine's next tokens close the channel: what follows is the answer.
    token(
        &mut app,
        turn,
        "<|close|>think<|sep|><|open|>response<|sep|>",
    );
    token(&mut app, turn, "Hi!");
    assert_eq!(last_reply(&app).reasoning, "Let me think");
    assert_eq!(last_reply(&app).content, "Hi!");
    // Answering already: the key does nothing more.
    assert!(act(&mut app, Action::Cmd(Cmd::AnswerNow)).is_empty());
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn,
            report: report("Hi!", Stop::End(2), true),
        },
    );
    // Effort: max → off → low → high → max, each a /think the engine confirms.
    for (want, thinking, effort) in [
        (Think::Off, false, "max"),
        (Think::Low, true, "low"),
        (Think::High, true, "high"),
        (Think::Max, true, "max"),
    ] {
        let fx = act(&mut app, Action::Cmd(Cmd::Effort));
        let (turn, cmd) = command(&fx);
        assert_eq!(cmd, Command::Think(want));
        ev(
            &mut app,
            EngineEvent::Notice {
                turn,
                text: "thinking".into(),
            },
        );
        assert_eq!((app.thinking, app.effort.as_str()), (thinking, effort));
    }
}

#[test]
fn the_session_dialog_renames_deletes_and_filters_through_the_worker() {
    let mut app = ready_app();
    act(&mut app, Action::Cmd(Cmd::Sessions));
    list_sessions(&mut app, rows());
    let dialog = |app: &App| match &app.dialog {
        Some(Dialog::Sessions(d)) => d.clone(),
        other => panic!("{other:?}"),
    };
    let all = dialog(&app).visible().len();
    assert!(all >= 2);
    // Filter: `/` then type; only matching names are listed and Enter acts on them.
    act(&mut app, Action::Char('/'));
    let first = rows()[1].name.clone();
    type_text(&mut app, &first[..first.len().min(4)].to_uppercase());
    let d = dialog(&app);
    assert!(d.visible().iter().all(|r| r
        .name
        .to_lowercase()
        .contains(&first[..first.len().min(4)].to_lowercase())));
    assert!(d.visible().len() < all || all == 1, "{:?}", d.visible());
    act(&mut app, Action::Cmd(Cmd::Stop));
    let d = dialog(&app);
    assert!(!d.filtering && d.filter.is_empty());
    assert_eq!(d.visible().len(), all);
    // Rename: `e` prefills the name, typing replaces it, a bad name is refused here, a good
    // one goes to the worker, whose answer is shown and the list read again.
    act(&mut app, Action::Down);
    act(&mut app, Action::Char('e'));
    type_text(&mut app, "../x");
    assert!(act(&mut app, Action::Submit).is_empty());
    assert!(dialog(&app).message.is_some());
    for _ in 0..4 {
        act(&mut app, Action::Backspace);
    }
    type_text(&mut app, "renamed");
    let fx = act(&mut app, Action::Submit);
    let (turn, from, to) = fx
        .iter()
        .find_map(|e| match e {
            Effect::Send(Request::RenameSession { turn, from, to }) => {
                Some((*turn, from.clone(), to.clone()))
            }
            _ => None,
        })
        .expect("a rename request");
    assert_eq!(
        (from.as_str(), to.as_str()),
        (rows()[1].name.as_str(), "renamed")
    );
    let fx = ev(
        &mut app,
        EngineEvent::Notice {
            turn,
            text: format!("session {from:?} renamed to \"renamed\""),
        },
    );
    assert!(fx
        .iter()
        .any(|e| matches!(e, Effect::Send(Request::ListSessions { .. }))));
    assert!(dialog(&app)
        .message
        .as_deref()
        .unwrap_or("")
        .contains("renamed"));
    list_sessions(&mut app, rows());
    // Delete asks first: any key but y keeps it; y asks the worker.
    act(&mut app, Action::Char('d'));
    assert!(dialog(&app).deleting.is_some());
    assert!(act(&mut app, Action::Char('n')).is_empty());
    assert!(dialog(&app).deleting.is_none());
    act(&mut app, Action::Char('d'));
    let fx = act(&mut app, Action::Char('y'));
    let (turn, name) = fx
        .iter()
        .find_map(|e| match e {
            Effect::Send(Request::DeleteSession { turn, name }) => Some((*turn, name.clone())),
            _ => None,
        })
        .expect("a delete request");
    assert_eq!(name, rows()[1].name);
    // A refusal (the session open here) is shown in the dialog.
    ev(
        &mut app,
        EngineEvent::Failed {
            turn,
            message: "delete: it is the session open here; /new first".into(),
        },
    );
    assert!(dialog(&app)
        .message
        .as_deref()
        .unwrap_or("")
        .contains("open here"));
}

#[test]
fn a_message_sent_while_a_reply_is_written_waits_for_it_and_a_stop_gives_it_back() {
    let mut app = ready_app();
    let turn = send_message(&mut app, "first");
    token(&mut app, turn, "partial");
    // Typed and sent while the reply streams: queued, nothing sent yet.
    type_text(&mut app, "second");
    let fx = act(&mut app, Action::Submit);
    assert!(!fx.iter().any(|e| matches!(e, Effect::Send(_))), "{fx:?}");
    assert_eq!(app.queued.as_deref(), Some("second"));
    assert!(app.input.text().is_empty());
    // Only one waits.
    type_text(&mut app, "third");
    act(&mut app, Action::Submit);
    assert_eq!(app.queued.as_deref(), Some("second"));
    assert_eq!(app.input.text(), "third");
    // The reply ends by itself: the queued message is sent as the next turn.
    let fx = ev(
        &mut app,
        EngineEvent::TurnDone {
            turn,
            report: report("partial", Stop::End(2), true),
        },
    );
    let (next, text) = sent(&fx);
    assert_eq!(text, "second");
    assert!(app.queued.is_none());
    assert!(matches!(
        app.phase,
        Phase::Prefill { .. } | Phase::Streaming { .. }
    ));
    // Queued again, then the reply is stopped: the message comes back to the input box,
    // before what was typed since, and is not sent.
    app.input.take();
    type_text(&mut app, "fourth");
    act(&mut app, Action::Submit);
    type_text(&mut app, "fifth");
    token(&mut app, next, "x");
    let fx = act(&mut app, Action::Cmd(Cmd::Stop));
    assert!(!fx.iter().any(|e| matches!(e, Effect::Send(_))), "{fx:?}");
    assert!(app.queued.is_none());
    assert_eq!(app.input.text(), "fourth\nfifth");
    // A command is still refused while a reply is written.
    app.input.take();
    let turn = send_message(&mut app, "sixth");
    token(&mut app, turn, "y");
    type_text(&mut app, "/undo");
    let fx = act(&mut app, Action::Submit);
    assert!(!fx.iter().any(|e| matches!(e, Effect::Send(_))), "{fx:?}");
    assert!(app.queued.is_none());
}

#[test]
fn save_as_and_rename_edit_a_name_the_same_way() {
    // The name field as a key leaves it (text, cursor, the dialog's message); `None` once
    // it is closed.
    type Field = Option<(String, usize, Option<String>)>;
    fn field(app: &App, renaming: bool) -> Field {
        let Some(Dialog::Sessions(d)) = &app.dialog else {
            return None;
        };
        let e = if renaming {
            d.renaming.as_ref().map(|(_, e)| e)
        } else {
            d.naming.as_ref()
        };
        e.map(|e| (e.text().to_string(), e.cursor(), d.message.clone()))
    }
    // Open "save as" (`s`) or "rename" (`e`) on a session named as the row selected, so both
    // start from the same prefilled name.
    fn open(renaming: bool) -> App {
        let mut app = ready_app();
        app.session = Some("alpha".into());
        act(&mut app, Action::Cmd(Cmd::Sessions));
        list_sessions(&mut app, rows());
        act(&mut app, Action::Char(if renaming { 'e' } else { 's' }));
        assert_eq!(field(&app, renaming).unwrap().0, "alpha");
        app
    }
    let long = "x".repeat(250);
    let sequences: Vec<Vec<Action>> = vec![
        // A character replaces the prefilled name; then editing inside it.
        vec![
            Action::CharOr('n', Cmd::Quit),
            Action::Char('m'),
            Action::Home,
            Action::Char('<'),
            Action::Right,
            Action::Delete,
            Action::End,
            Action::Left,
            Action::Backspace,
            Action::Char('é'),
            Action::Up,
            Action::ClearInput,
        ],
        // An editing key keeps the prefill, so a character then extends it.
        vec![Action::End, Action::Backspace, Action::Char('2')],
        // A name the store refuses stays, with the reason; fixed, it is accepted.
        vec![
            Action::Home,
            Action::Char('/'),
            Action::Submit,
            Action::Backspace,
            Action::Submit,
        ],
        // Only so much is typed; Enter on a blank name is refused; Esc gives the name up.
        long.chars()
            .map(Action::Char)
            .chain([Action::Submit])
            .collect(),
        vec![Action::Char(' '), Action::Submit, Action::Interrupt],
        vec![Action::Left, Action::Cmd(Cmd::Stop)],
    ];
    for (n, keys) in sequences.iter().enumerate() {
        let (mut save, mut rename) = (open(false), open(true));
        for (i, a) in keys.iter().enumerate() {
            let (s_fx, r_fx) = (act(&mut save, a.clone()), act(&mut rename, a.clone()));
            let (s, r) = (field(&save, false), field(&rename, true));
            assert_eq!(s, r, "sequence {n}, key {i} ({a:?})");
            if s.is_some() {
                assert!(s_fx.is_empty() && r_fx.is_empty(), "{s_fx:?} {r_fx:?}");
                continue;
            }
            // Gone from the field: given up (the list again), or sent under the same name.
            let sent = |fx: &[Effect]| {
                fx.iter().find_map(|e| match e {
                    Effect::Send(Request::RenameSession { to, .. }) => Some(to.clone()),
                    Effect::Send(Request::Command {
                        command: Command::Save(Some(to)),
                        ..
                    }) => Some(to.clone()),
                    _ => None,
                })
            };
            assert_eq!(sent(&s_fx), sent(&r_fx), "sequence {n}, key {i} ({a:?})");
            if sent(&s_fx).is_none() {
                assert!(matches!(save.dialog, Some(Dialog::Sessions(_))));
                assert!(matches!(rename.dialog, Some(Dialog::Sessions(_))));
            }
            break;
        }
    }
    // The long name stopped at the bound.
    let mut app = open(true);
    type_text(&mut app, &long);
    assert_eq!(field(&app, true).unwrap().0.len(), 200);
}
