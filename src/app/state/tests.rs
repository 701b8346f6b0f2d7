//! Transition tests of `App::update` against a fake engine: the tests play the worker's part by
//! feeding `EngineEvent`s as messages and checking the effects that come back.
//! This file holds the fake engine's helpers; the tests are grouped by concern below it.

mod budget;
mod input;
mod sessions;
mod turns;

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

fn with_figures(app: &mut App) {
    ev(
        app,
        EngineEvent::Stats {
            turn: 0,
            stats: Box::new(stats(0, 0.0)),
        },
    );
}
