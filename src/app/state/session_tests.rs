//! Transition tests of what the client says about the conversation it has open: its name
//! after `/new` and its first turn, recovered turns marked unsaved, the session dialog's
//! refusals, the token limit behind the time-left estimate, the cost of a thinking change and
//! the panes key. The tests play the worker's part, as in `tests.rs`.

use super::*;
use crate::app::config::Cmd;
use crate::app::protocol::HistoryView;
use crate::session::chat::Entry;
use crate::session::commands::Think;

fn start(resume: bool) -> App {
    let mut app = App::new(AppInit {
        model: "tiny".into(),
        session: None,
        resume,
        thinking: false,
        effort: "high".into(),
        context_limit: 4096,
        max_tokens: 512,
        history: Vec::new(),
        budget_gb: None,
        keys: KeyLabels(vec![
            (Cmd::New, "Ctrl-N".into()),
            (Cmd::Effort, "F2".into()),
        ]),
        theme: ThemeName::Dark,
    });
    app.update(Msg::Engine(EngineEvent::Ready {
        info: "k3: tiny (13 layers, vocabulary 512), new session (named at its first turn, \
               and journaled until saved), chat mode"
            .into(),
    }));
    app
}

fn act(app: &mut App, a: Action) -> Vec<Effect> {
    app.update(Msg::Action(a))
}

fn ev(app: &mut App, e: EngineEvent) -> Vec<Effect> {
    app.update(Msg::Engine(e))
}

fn type_text(app: &mut App, text: &str) {
    for c in text.chars() {
        act(app, Action::Char(c));
    }
}

/// The requests among `fx`.
fn requests(fx: &[Effect]) -> Vec<Request> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Send(r) => Some(r.clone()),
            _ => None,
        })
        .collect()
}

/// The turn and command of the single command request among `fx`.
fn command(fx: &[Effect]) -> (TurnId, Command) {
    match &requests(fx)[..] {
        [Request::Command { turn, command }] => (*turn, command.clone()),
        other => panic!("one command expected: {other:?}"),
    }
}

/// Answer a command as the worker would.
fn answer(app: &mut App, turn: TurnId, text: &str) -> Vec<Effect> {
    ev(
        app,
        EngineEvent::Notice {
            turn,
            text: text.into(),
        },
    )
}

fn report(prefilled: usize, prefill_seconds: f64) -> Box<TurnReport> {
    Box::new(TurnReport {
        mode: Mode::Chat,
        prompt_ids: vec![1, 2, 3],
        generated_ids: vec![4, 5],
        generated_tokens: 2,
        reply: "ok".into(),
        reasoning: None,
        reused_tokens: 0,
        prefilled_tokens: prefilled,
        stop: Stop::End(0),
        accepted: true,
        rejected_because: None,
        prefill_seconds,
        decode_seconds: 0.2,
        context_warning: None,
    })
}

/// Send `text` and finish its reply (the worker names a new conversation at its first turn:
/// `named`); the reply read `prefilled` prompt tokens in `prefill_seconds`.
fn chat(app: &mut App, text: &str, named: Option<&str>, prefilled: usize, prefill_seconds: f64) {
    type_text(app, text);
    let fx = act(app, Action::Submit);
    let turn = match &requests(&fx)[..] {
        [Request::Send { turn, .. }] => *turn,
        other => panic!("a message expected: {other:?}"),
    };
    if let Some(name) = named {
        ev(app, EngineEvent::Named { name: name.into() });
    }
    ev(
        app,
        EngineEvent::Stats {
            turn,
            stats: Box::new(StatsSnapshot {
                positions: 40,
                ..StatsSnapshot::default()
            }),
        },
    );
    ev(
        app,
        EngineEvent::TurnDone {
            turn,
            report: report(prefilled, prefill_seconds),
        },
    );
    assert_eq!(app.phase, Phase::Idle);
}

fn row(name: &str, unsaved: bool) -> SessionRow {
    SessionRow {
        name: name.into(),
        saved_unix: 1_800_000_000,
        saved: if unsaved {
            "not saved"
        } else {
            "2027-01-15 08:00"
        }
        .into(),
        turns: 1,
        bytes: 1_000,
        problem: None,
        unsaved,
    }
}

/// Ctrl-S with the worker's listing `rows`.
fn open_dialog(app: &mut App, rows: Vec<SessionRow>) {
    let fx = act(app, Action::Cmd(Cmd::Sessions));
    let turn = match &requests(&fx)[..] {
        [Request::ListSessions { turn }] => *turn,
        other => panic!("a listing expected: {other:?}"),
    };
    ev(app, EngineEvent::Sessions { turn, rows });
}

fn dialog(app: &App) -> &SessionDialog {
    match &app.dialog {
        Some(Dialog::Sessions(d)) => d,
        other => panic!("no session dialog: {other:?}"),
    }
}

#[test]
fn after_new_the_conversation_is_saved_under_its_own_name() {
    let mut app = start(false);
    chat(
        &mut app,
        "Hello there",
        Some("hello-there-2026-12-04"),
        5,
        0.1,
    );
    assert_eq!(app.session.as_deref(), Some("hello-there-2026-12-04"));
    // Save as priya-chat from the dialog.
    open_dialog(&mut app, vec![row("hello-there-2026-12-04", true)]);
    act(&mut app, Action::Char('s'));
    type_text(&mut app, "priya-chat");
    let (turn, cmd) = command(&act(&mut app, Action::Submit));
    assert_eq!(cmd, Command::Save(Some("priya-chat".into())));
    answer(
        &mut app,
        turn,
        "saved session \"priya-chat\" (40 positions)",
    );
    assert_eq!(app.session.as_deref(), Some("priya-chat"));
    // Ctrl-N: a new conversation, unnamed until its first turn.
    let (turn, cmd) = command(&act(&mut app, Action::Cmd(Cmd::New)));
    assert_eq!(cmd, Command::New);
    answer(&mut app, turn, "new conversation");
    assert_eq!(app.session, None);
    let name = "my-favourite-colour-is-green-2026-12-04";
    chat(&mut app, "My favourite colour is green", Some(name), 9, 0.1);
    assert_eq!(app.session.as_deref(), Some(name));
    // Ctrl-S, s: the dialog offers the conversation's own name, and Enter saves under it
    // (never "a different saved session has that name").
    open_dialog(&mut app, vec![row("priya-chat", false), row(name, true)]);
    act(&mut app, Action::Char('s'));
    assert_eq!(dialog(&app).naming.as_ref().map(Editor::text), Some(name));
    let (_, cmd) = command(&act(&mut app, Action::Submit));
    assert_eq!(cmd, Command::Save(Some(name.into())));
    assert_eq!(app.dialog, None);
}

#[test]
fn recovered_turns_are_unsaved_and_quitting_asks() {
    let mut app = start(true);
    let turn = match &app.pending[..] {
        [(t, Purpose::History)] => *t,
        other => panic!("the history asked for: {other:?}"),
    };
    let entries = vec![
        Entry::Message {
            role: "user".into(),
            content: "hi".into(),
            reasoning: None,
        },
        Entry::Message {
            role: "assistant".into(),
            content: "hello".into(),
            reasoning: None,
        },
    ];
    ev(
        &mut app,
        EngineEvent::History {
            turn,
            history: Box::new(HistoryView {
                name: Some("kept".into()),
                system: None,
                mode: Mode::Chat,
                entries,
                unsaved: true,
            }),
        },
    );
    assert!(app.dirty, "recovered turns are not saved");
    let fx = act(&mut app, Action::Cmd(Cmd::Quit));
    assert!(requests(&fx).is_empty() && !fx.iter().any(|e| matches!(e, Effect::Quit { .. })));
    assert_eq!(app.dialog, Some(Dialog::ConfirmQuit));
}

#[test]
fn deleting_the_open_conversation_is_refused_before_asking() {
    let mut app = start(false);
    chat(
        &mut app,
        "Hello there",
        Some("hello-there-2026-12-04"),
        5,
        0.1,
    );
    open_dialog(
        &mut app,
        vec![row("hello-there-2026-12-04", true), row("other", false)],
    );
    let fx = act(&mut app, Action::Char('d'));
    assert!(requests(&fx).is_empty());
    let d = dialog(&app);
    assert_eq!(
        d.deleting, None,
        "no question for a delete the worker refuses"
    );
    let msg = d.message.clone().unwrap_or_default();
    assert!(msg.contains("open here") && msg.contains("Ctrl-N"), "{msg}");
    // Another row is asked about, and deleted on y.
    act(&mut app, Action::Down);
    act(&mut app, Action::Char('d'));
    assert_eq!(dialog(&app).deleting.as_deref(), Some("other"));
    match &requests(&act(&mut app, Action::Char('y')))[..] {
        [Request::DeleteSession { name, .. }] => assert_eq!(name, "other"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_time_left_counts_to_the_limit_of_the_turn() {
    // Started with 512; the raw-mode turn runs under a limit of 1,500.
    let mut app = start(false);
    type_text(&mut app, "Once upon a time");
    let turn = match &requests(&act(&mut app, Action::Submit))[..] {
        [Request::Send { turn, .. }] => *turn,
        other => panic!("{other:?}"),
    };
    ev(
        &mut app,
        EngineEvent::TurnStarted {
            turn,
            raw: true,
            thinking: false,
            max_tokens: 1_500,
        },
    );
    for _ in 0..500 {
        ev(
            &mut app,
            EngineEvent::Token {
                turn,
                id: 7,
                text: "a".into(),
                position: 0,
            },
        );
    }
    ev(
        &mut app,
        EngineEvent::Stats {
            turn,
            stats: Box::new(StatsSnapshot {
                tokens_per_second: 10.0,
                ..StatsSnapshot::default()
            }),
        },
    );
    let (per_token, left) = app.pace().expect("a pace while streaming");
    assert!((per_token - 0.1).abs() < 1e-9, "{per_token}");
    // 1,000 tokens to go at 10 tokens/s (with the start-up 512 it said 1.2 s).
    assert!((left - 100.0).abs() < 1e-9, "{left}");
}

/// The engine's figures outside a turn: the conversation holds `positions`.
fn holds(app: &mut App, positions: u64) {
    ev(
        app,
        EngineEvent::Stats {
            turn: 0,
            stats: Box::new(StatsSnapshot {
                positions,
                ..StatsSnapshot::default()
            }),
        },
    );
}

#[test]
fn a_thinking_change_says_what_it_costs_before_it_takes_effect() {
    let mut app = start(false);
    // The reply read 400 prompt tokens in 2 s: 200 tokens/s under this budget.
    chat(
        &mut app,
        "Hello there",
        Some("hello-there-2026-12-04"),
        400,
        2.0,
    );
    holds(&mut app, 1_062);
    // F2 (off → low): nothing is sent; the cost is shown first.
    let fx = act(&mut app, Action::Cmd(Cmd::Effort));
    assert!(requests(&fx).is_empty(), "{fx:?}");
    assert_eq!(app.dialog, Some(Dialog::ConfirmThink(Think::Low)));
    assert_eq!(
        app.think_cost(),
        "re-reads 1,062 tokens, about 5.3 s at this budget"
    );
    // A second press steps on (low → high); Enter applies it.
    act(&mut app, Action::Cmd(Cmd::Effort));
    assert_eq!(app.dialog, Some(Dialog::ConfirmThink(Think::High)));
    let (turn, cmd) = command(&act(&mut app, Action::Submit));
    assert_eq!(cmd, Command::Think(Think::High));
    // Before its answer, F2 steps from what was asked (high → max); Esc keeps that for the
    // next new conversation and sends nothing.
    act(&mut app, Action::Cmd(Cmd::Effort));
    assert_eq!(app.dialog, Some(Dialog::ConfirmThink(Think::Max)));
    assert!(requests(&act(&mut app, Action::Cmd(Cmd::Stop))).is_empty());
    assert_eq!(app.next_think, Some(Think::Max));
    answer(&mut app, turn, "thinking on, effort high");
    assert_eq!((app.thinking, app.effort.as_str()), (true, "high"));
    // A typed /think asks the same way.
    type_text(&mut app, "/think off");
    assert!(requests(&act(&mut app, Action::Submit)).is_empty());
    assert_eq!(app.dialog, Some(Dialog::ConfirmThink(Think::Off)));
    act(&mut app, Action::Char('n'));
    assert_eq!(app.next_think, Some(Think::Off));
    // The new conversation takes the change kept for it.
    act(&mut app, Action::Cmd(Cmd::New));
    assert_eq!(app.dialog, Some(Dialog::ConfirmNew));
    let (turn, cmd) = command(&act(&mut app, Action::Char('y')));
    assert_eq!(cmd, Command::New);
    let (_, cmd) = command(&answer(&mut app, turn, "new conversation"));
    assert_eq!(cmd, Command::Think(Think::Off));
    assert_eq!(app.next_think, None);
}

#[test]
fn the_cost_is_unknown_before_a_prompt_is_read_and_after_the_budget_changes() {
    let mut app = start(false);
    chat(&mut app, "Hi", Some("hi-2026-12-04"), 3, 0.01);
    holds(&mut app, 40);
    assert!(
        app.think_cost()
            .starts_with("re-reads 40 tokens, time unknown"),
        "{}",
        app.think_cost()
    );
    holds(&mut app, 1);
    assert!(
        app.think_cost()
            .starts_with("re-reads 1 token, time unknown"),
        "{}",
        app.think_cost()
    );
    holds(&mut app, 40);
    chat(&mut app, "Tell me more", None, 400, 2.0);
    assert!(
        app.think_cost().contains("about 0.2 s"),
        "{}",
        app.think_cost()
    );
    type_text(&mut app, "/budget 2");
    let (turn, _) = command(&act(&mut app, Action::Submit));
    answer(&mut app, turn, "budget 2 GB");
    assert!(
        app.think_cost().contains("time unknown"),
        "{}",
        app.think_cost()
    );
}

#[test]
fn two_effort_presses_in_a_new_conversation_step_twice() {
    let mut app = start(false);
    // No turns: nothing to re-read, so each press is sent at once, the second from where the
    // first leaves thinking although its answer has not come yet.
    let (_, first) = command(&act(&mut app, Action::Cmd(Cmd::Effort)));
    let (_, second) = command(&act(&mut app, Action::Cmd(Cmd::Effort)));
    assert_eq!(
        (first, second),
        (Command::Think(Think::Low), Command::Think(Think::High))
    );
    assert_eq!(app.dialog, None);
}
