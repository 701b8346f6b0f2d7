//! Screen snapshots (ratatui `TestBackend` + insta) at 80×24 and 160×48 with deterministic
//! figures, widget frame tests with literal buffers, and a render sweep over every size from
//! 1×1 to 200×60.

use super::*;
use crate::app::config::{KeysConfig, ThemeName};
use crate::app::protocol::{EngineEvent, Request, TurnId};
use crate::app::protocol::{LayerResidency, Residency, StatsSnapshot};
use crate::app::state::{Action, AppInit, Effect, Msg, SessionRow};
use crate::session::chat::{Stop, TurnReport};
use crate::ui::input::KeyMap;
use ratatui::backend::TestBackend;
use ratatui::Terminal;

fn init() -> AppInit {
    let keys = KeyMap::new(KeysConfig::default().bindings().unwrap_or_default());
    AppInit {
        model: "tiny".into(),
        session: None,
        resume: false,
        thinking: true,
        effort: "max".into(),
        context_limit: 32_768,
        max_tokens: 512,
        history: Vec::new(),
        budget_gb: None,
        keys: keys.labels(),
        theme: ThemeName::Dark,
    }
}

fn ev(app: &mut App, e: EngineEvent) -> Vec<Effect> {
    app.update(Msg::Engine(e))
}

fn send(app: &mut App, text: &str) -> TurnId {
    for c in text.chars() {
        app.update(Msg::Action(Action::Char(c)));
    }
    app.update(Msg::Action(Action::Submit))
        .into_iter()
        .find_map(|e| match e {
            Effect::Send(Request::Send { turn, .. }) => Some(turn),
            _ => None,
        })
        .unwrap_or(0)
}

fn token(app: &mut App, turn: TurnId, text: &str) {
    ev(
        app,
        EngineEvent::Token {
            turn,
            id: 1,
            text: text.into(),
            position: 0,
        },
    );
}

/// Figures shaped like the streaming engine's: a budget in force, four layers on the
/// read-ahead ring, some experts evicted, reads and I/O waits.
fn figures(_turn: TurnId, tps: f64, tokens: u64) -> Box<StatsSnapshot> {
    let layers = (0..13u32)
        .map(|il| LayerResidency {
            trunk: if il % 3 == 2 {
                Residency::Ring
            } else {
                Residency::Pinned
            },
            experts_resident: if il == 0 { 0 } else { 16 - (il % 4) * 4 },
            experts_total: if il == 0 { 0 } else { 16 },
        })
        .collect();
    Box::new(StatsSnapshot {
        tokens_per_second: tps,
        turn_tokens: tokens,
        turn_seconds: tokens as f64 / 20.0,
        rss_bytes: 41_200_000,
        peak_rss_bytes: 45_100_000,
        budget_bytes: Some(60_000_000),
        model_bytes: 3_800_000,
        disk_bytes_read: 9_600_000,
        turn_disk_bytes: 2_100_000,
        disk_mb_per_s: tps * 2.5,
        expert_hits: 912,
        expert_misses: 85,
        layers,
        compute_seconds: 1.25,
        io_wait_seconds: 0.31,
        positions: 117,
        context_limit: 32_768,
        ..StatsSnapshot::default()
    })
}

fn done(reply: &str, reasoning: Option<&str>) -> Box<TurnReport> {
    Box::new(TurnReport {
        mode: crate::session::chat::Mode::Chat,
        prompt_ids: vec![1; 30],
        generated_ids: vec![2; 40],
        generated_tokens: 40,
        reply: reply.into(),
        reasoning: reasoning.map(str::to_string),
        reused_tokens: 0,
        prefilled_tokens: 30,
        stop: Stop::End(3),
        accepted: true,
        rejected_because: None,
        prefill_seconds: 0.1,
        decode_seconds: 2.0,
        context_warning: None,
    })
}

/// A conversation with one finished exchange (thinking, a code block, an escape sequence from
/// the model) and a second reply half streamed; the budget slider moved once and refused.
fn mid_reply() -> App {
    let mut app = App::new(init());
    ev(
        &mut app,
        EngineEvent::Ready {
            info:
                "k3: tests/fixtures/tiny (13 layers, vocabulary 512), session \"demo\", chat mode"
                    .into(),
        },
    );
    ev(
        &mut app,
        EngineEvent::Stats {
            turn: 0,
            stats: figures(0, 0.0, 0),
        },
    );
    let t1 = send(&mut app, "Write a function that adds two numbers.");
    for (i, tps) in [18.0, 19.5, 21.0, 20.2, 22.4].into_iter().enumerate() {
        ev(
            &mut app,
            EngineEvent::Stats {
                turn: t1,
                stats: figures(t1, tps, 5 * (i as u64 + 1)),
            },
        );
    }
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn: t1,
            report: done(
                "Here it is:\n```rust\nfn add(a: i32, b: i32) -> i32 { a + b }\n```\nIt adds \u{1b}[31mred\u{1b}[0m numbers.",
                Some("The user wants a simple function. Rust fits."),
            ),
        },
    );
    // Slider: one step down, answered with the engine's new plan.
    let fx = app.update(Msg::Action(Action::CharOr('[', Cmd::BudgetDown)));
    if let Some(turn) = fx.iter().find_map(|e| match e {
        Effect::Send(Request::Command { turn, .. }) => Some(*turn),
        _ => None,
    }) {
        ev(
            &mut app,
            EngineEvent::Notice {
                turn,
                text: "budget 0.05 GB: 9 of 13 layers pinned, 96 expert slots, output head \
                       resident"
                    .into(),
            },
        );
    }
    let t2 = send(&mut app, "Now explain how it works, step by step.");
    for piece in [
        "First ",
        "it takes",
        "<|close|>think<|sep|><|open|>response<|sep|>",
        "The function ",
        "takes two",
        " integers and",
    ] {
        token(&mut app, t2, piece);
    }
    ev(
        &mut app,
        EngineEvent::Stats {
            turn: t2,
            stats: figures(t2, 19.8, 6),
        },
    );
    for c in "and then?".chars() {
        app.update(Msg::Action(Action::Char(c)));
    }
    app
}

#[track_caller]
fn screen(app: &App, w: u16, h: u16) -> Terminal<TestBackend> {
    let mut t = Terminal::new(TestBackend::new(w, h)).expect("test terminal");
    t.draw(|f| {
        draw(f, app);
    })
    .expect("draw");
    t
}

macro_rules! snap {
    ($name:literal, $app:expr) => {
        let app = $app;
        insta::assert_snapshot!(concat!($name, "_80x24"), screen(&app, 80, 24).backend());
        insta::assert_snapshot!(concat!($name, "_160x48"), screen(&app, 160, 48).backend());
    };
}

#[test]
fn main_screen_mid_reply() {
    snap!("main_mid_reply", mid_reply());
}

#[test]
fn help_popup() {
    let mut app = mid_reply();
    app.update(Msg::Action(Action::Cmd(Cmd::Help)));
    snap!("help", app);
}

#[test]
fn session_dialog() {
    let mut app = mid_reply();
    app.update(Msg::Action(Action::Cmd(Cmd::Stop)));
    let fx = app.update(Msg::Action(Action::Cmd(Cmd::Sessions)));
    let turn = fx
        .iter()
        .find_map(|e| match e {
            Effect::Send(Request::ListSessions { turn }) => Some(*turn),
            _ => None,
        })
        .expect("the session dialog asks for the list");
    app.update(Msg::Engine(EngineEvent::Sessions {
        turn,
        rows: vec![
            SessionRow {
                name: "demo".into(),
                saved_unix: 1_795_946_400,
                saved: "2026-11-29 10:00".into(),
                turns: 4,
                bytes: 134_313,
                problem: None,
                unsaved: false,
            },
            SessionRow {
                name: "notes".into(),
                saved_unix: 1_795_000_000,
                saved: "2026-11-18 11:06".into(),
                turns: 12,
                bytes: 2_500_000,
                problem: None,
                unsaved: false,
            },
            SessionRow {
                name: "broken".into(),
                saved_unix: 0,
                saved: "1970-01-01 00:00".into(),
                turns: 0,
                bytes: 0,
                problem: Some("bad magic".into()),
                unsaved: false,
            },
        ],
    }));
    app.update(Msg::Action(Action::Down));
    snap!("sessions", app);
}

#[test]
fn error_in_the_conversation_and_engine_stopped() {
    let mut app = App::new(init());
    ev(
        &mut app,
        EngineEvent::Ready {
            info: "k3: tiny, session \"demo\", chat mode".into(),
        },
    );
    let t = send(&mut app, "a very long prompt");
    ev(
        &mut app,
        EngineEvent::Failed {
            turn: t,
            message: "the context is full (40000 positions needed, limit 32768); /new starts over"
                .into(),
        },
    );
    snap!("turn_error", app.clone());
    ev(
        &mut app,
        EngineEvent::Failed {
            turn: 0,
            message:
                "model-00002-of-000003.safetensors: read failed: Input/output error (os error 5)"
                    .into(),
        },
    );
    ev(&mut app, EngineEvent::Stopped { exit_code: 1 });
    snap!("engine_stopped", app);
}

#[test]
fn quit_question() {
    let mut app = mid_reply();
    app.update(Msg::Action(Action::Cmd(Cmd::Stop)));
    app.update(Msg::Action(Action::Cmd(Cmd::Quit)));
    snap!("quit", app);
}

#[test]
fn too_small_terminal() {
    let app = mid_reply();
    insta::assert_snapshot!("too_small_30x8", screen(&app, 30, 8).backend());
}

#[test]
fn loading_screen() {
    let app = App::new(init());
    insta::assert_snapshot!("loading_80x24", screen(&app, 80, 24).backend());
}

#[track_caller]
fn assert_widget(draw: impl Fn(Rect, &mut Buffer), expected: &[&str]) {
    let w = u16::try_from(expected[0].chars().count()).unwrap_or(0);
    let h = u16::try_from(expected.len()).unwrap_or(0);
    let area = Rect::new(0, 0, w, h);
    let mut buf = Buffer::empty(area);
    draw(area, &mut buf);
    let mut want = Buffer::with_lines(expected.iter().copied());
    // Compare symbols only: styles are the theme's business.
    for cell in buf.content.iter_mut() {
        cell.set_style(ratatui::style::Style::reset());
    }
    for cell in want.content.iter_mut() {
        cell.set_style(ratatui::style::Style::reset());
    }
    assert_eq!(buf, want);
}

#[test]
fn budget_pane_frame() {
    let app = mid_reply();
    let theme = Theme::new(ThemeName::Mono);
    assert_widget(
        |area, buf| panes::budget(&app, &theme, area, buf),
        &[
            "┌ budget ──────────────────────────┐",
            "│━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━●│",
            "│slider 60.0 MB · model 3.8 MB     │",
            "│in force: 60.0 MB                 │",
            "│engine: ok                        │",
            "│                                  │",
            "└──────────────────────────────────┘",
        ],
    );
}

#[test]
fn memory_pane_gauges_rss_against_the_budget() {
    let app = mid_reply();
    let theme = Theme::new(ThemeName::Mono);
    assert_widget(
        |area, buf| panes::memory(&app, &theme, area, buf),
        &[
            "┌ memory ────────────────────┐",
            "│RSS 41.2 MB of 60.0 MB      │",
            "│████████████████░░░░░░░░ 69%│",
            "│peak 45.1 MB · model 3.8 MB │",
            "└────────────────────────────┘",
        ],
    );
}

#[test]
fn memory_pane_says_resident_without_a_budget() {
    let mut app = mid_reply();
    let mut s = figures(0, 0.0, 0);
    s.budget_bytes = None;
    s.rss_bytes = 14_200_000;
    s.peak_rss_bytes = 15_100_000;
    ev(&mut app, EngineEvent::Stats { turn: 0, stats: s });
    let theme = Theme::new(ThemeName::Mono);
    assert_widget(
        |area, buf| panes::memory(&app, &theme, area, buf),
        &[
            "┌ memory ────────────────────┐",
            "│RSS 14.2 MB                 │",
            "│resident (no budget)        │",
            "│peak 15.1 MB · model 3.8 MB │",
            "└────────────────────────────┘",
        ],
    );
}

#[test]
fn model_escapes_never_reach_the_buffer() {
    let app = mid_reply();
    let t = screen(&app, 160, 48);
    let text: String = t
        .backend()
        .buffer()
        .content
        .iter()
        .map(ratatui::buffer::Cell::symbol)
        .collect();
    assert!(!text.contains('\u{1b}'), "raw ESC reached the screen");
    assert!(
        text.contains("\\u{1b}[31mred"),
        "the escape is shown escaped"
    );
}

#[test]
fn every_size_renders_without_panic() {
    let states = {
        let main = mid_reply();
        let mut help = main.clone();
        help.update(Msg::Action(Action::Cmd(Cmd::Help)));
        let mut sessions = main.clone();
        sessions.update(Msg::Action(Action::Cmd(Cmd::Stop)));
        sessions.update(Msg::Action(Action::Cmd(Cmd::Sessions)));
        let mut scrolled = main.clone();
        scrolled.update(Msg::Viewport {
            max_scroll: 40,
            page: 10,
        });
        scrolled.update(Msg::Action(Action::PageUp));
        [main, help, sessions, scrolled, App::new(init())]
    };
    let mut buf = Buffer::empty(Rect::new(0, 0, 200, 60));
    for w in 1..=200u16 {
        for h in 1..=60u16 {
            let area = Rect::new(0, 0, w, h);
            buf.resize(area);
            let state = &states[usize::from(w * 7 + h) % states.len()];
            let m = render(state, area, &mut buf);
            if let Some(p) = m.cursor {
                assert!(area.contains(p), "cursor {p:?} outside {area:?}");
            }
        }
    }
}

#[test]
fn loading_shows_how_far_the_weights_are_read() {
    let mut app = App::new(init());
    app.update(Msg::Engine(EngineEvent::Loading {
        done: 1_500_000,
        total: 6_000_000,
    }));
    let t = screen(&app, 100, 10);
    let text: String = t
        .backend()
        .buffer()
        .content()
        .iter()
        .map(|c| c.symbol())
        .collect();
    assert!(text.contains("1.5 of 6.0 MB (25%)"), "{text}");
}

#[test]
fn the_budget_pane_at_80_columns_cuts_no_text() {
    // At 80×24 the pane is 16 columns by 6 rows: the engine's answer does not fit, so its
    // short form is shown, whole.
    let mut app = mid_reply();
    let theme = Theme::new(ThemeName::Mono);
    assert_widget(
        |area, buf| panes::budget(&app, &theme, area, buf),
        &[
            "┌ budget ──────┐",
            "│━━━━━━━━━━━━━●│",
            "│set 60.0 MB   │",
            "│now 60.0 MB   │",
            "│engine: ok    │",
            "└──────────────┘",
        ],
    );
    app.budget.answer = Some((1, Err("/budget: 0.01 GB is below the floor".into())));
    assert_widget(
        |area, buf| panes::budget(&app, &theme, area, buf),
        &[
            "┌ budget ──────┐",
            "│━━━━━━━━━━━━━●│",
            "│set 60.0 MB   │",
            "│now 60.0 MB   │",
            "│refused       │",
            "└──────────────┘",
        ],
    );
}

#[test]
fn a_remote_engine_has_one_pane_and_its_model_in_the_status_bar() {
    let mut app = App::new(AppInit {
        model: "remote".into(),
        ..init()
    });
    ev(
        &mut app,
        EngineEvent::Ready {
            info: "k3: remote https://gpu.example:8443/v1 (model \"moonshotai/Kimi-K3\"), new \
                   session (named at its first turn), chat mode"
                .into(),
        },
    );
    let turn = send(&mut app, "Hi");
    token(&mut app, turn, "Hello");
    ev(
        &mut app,
        EngineEvent::Stats {
            turn,
            stats: figures(turn, 41.5, 12),
        },
    );
    let mut r = done("Hello", None);
    r.reused_tokens = 30;
    r.prefilled_tokens = 12;
    r.prefill_seconds = 0.25;
    ev(&mut app, EngineEvent::TurnDone { turn, report: r });
    assert_eq!(app.model, "moonshotai/Kimi-K3");
    for (w, h) in [(160, 48), (80, 24)] {
        let t = screen(&app, w, h);
        let text: String = t
            .backend()
            .buffer()
            .content
            .iter()
            .map(ratatui::buffer::Cell::symbol)
            .collect();
        assert!(text.contains("remote engine"), "{w}x{h}");
        assert!(text.contains("moonshotai/Kimi-K3"), "{w}x{h}");
        assert!(!text.contains(" v1 "), "{w}x{h}");
        if w == 160 {
            assert!(
                text.contains("first token 0.25 s · 41.5 tokens/s"),
                "{text}"
            );
            assert!(text.contains("prompt 42 · cached 30"), "{text}");
        }
        // None of the local panes.
        assert!(!text.contains("RSS"), "{w}x{h}");
    }
    // The budget keys say it is local-only.
    app.update(Msg::Action(Action::Cmd(Cmd::BudgetUp)));
    assert!(
        app.toast
            .as_ref()
            .is_some_and(|(t, _)| t.contains("local-only")),
        "{:?}",
        app.toast
    );
}

/// The text of a `w`×`h` buffer drawn by `draw`, rows joined by newlines.
fn drawn(w: u16, h: u16, draw: impl Fn(Rect, &mut Buffer)) -> String {
    let area = Rect::new(0, 0, w, h);
    let mut buf = Buffer::empty(area);
    draw(area, &mut buf);
    (0..h)
        .map(|y| (0..w).map(|x| buf[(x, y)].symbol()).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_tokens_pane_counts_one_token_in_the_singular() {
    let theme = Theme::new(ThemeName::Mono);
    for (n, want) in [(1, "1 token this turn "), (2, "2 tokens this turn")] {
        let mut app = mid_reply();
        ev(
            &mut app,
            EngineEvent::Stats {
                turn: 0,
                stats: figures(0, 4.0, n),
            },
        );
        let text = drawn(36, 6, |area, buf| panes::tokens(&app, &theme, area, buf));
        assert!(text.contains(want), "{text}");
    }
}

/// The screen's rows as text.
fn screen_rows(app: &App, w: u16, h: u16) -> Vec<String> {
    let t = screen(app, w, h);
    let buf = t.backend().buffer();
    (0..h)
        .map(|y| (0..w).map(|x| buf[(x, y)].symbol()).collect::<String>())
        .collect()
}

/// The conversation's rows: those above the input box (and above the panes, when shown).
fn conversation_rows(rows: &[String]) -> Vec<String> {
    rows.iter()
        .take_while(|r| !r.starts_with("┌ tokens/s") && !r.starts_with("┌ generating"))
        .cloned()
        .collect()
}

#[test]
fn the_panes_key_gives_the_conversation_the_whole_screen_at_80x24() {
    let mut app = mid_reply();
    let shown = screen_rows(&app, 80, 24);
    assert!(
        shown.iter().any(|r| r.starts_with("┌ tokens/s")),
        "{shown:#?}"
    );
    let conv_shown = conversation_rows(&shown);
    assert_eq!(conv_shown.len(), 14, "{shown:#?}");
    // F3 hides the panes: their six rows go to the conversation, which shows the same tail
    // and six more rows above it.
    app.update(Msg::Action(Action::Cmd(Cmd::Panes)));
    assert!(app.hide_panes);
    let hidden = screen_rows(&app, 80, 24);
    for pane in ["tokens/s", "memory", "disk", "experts", "budget"] {
        assert!(
            !hidden.iter().any(|r| r.contains(&format!("┌ {pane} "))),
            "{pane} is still drawn: {hidden:#?}"
        );
    }
    let conv_hidden = conversation_rows(&hidden);
    assert_eq!(conv_hidden.len(), 20, "{hidden:#?}");
    assert_eq!(conv_hidden[6..], conv_shown[..], "{hidden:#?}");
    assert!(
        hidden[23].ends_with(" panes hidden (F3) "),
        "{}",
        hidden[23]
    );
    // No mouse region for a budget pane that is not drawn.
    let mut buf = Buffer::empty(Rect::new(0, 0, 80, 24));
    assert_eq!(render(&app, buf.area, &mut buf).regions.budget_pane, None);
    // The same key shows them again, as they were.
    app.update(Msg::Action(Action::Cmd(Cmd::Panes)));
    assert!(!app.hide_panes);
    let again = screen_rows(&app, 80, 24);
    assert_eq!(again[..23], shown[..23]);
    // Focusing the budget slider shows the panes it is in.
    app.update(Msg::Action(Action::Cmd(Cmd::Panes)));
    app.update(Msg::Action(Action::Cmd(Cmd::Focus)));
    assert!(!app.hide_panes);
    assert_eq!(app.focus, crate::app::state::Focus::Budget);
    // Hiding them gives the keys back to the input.
    app.update(Msg::Action(Action::Cmd(Cmd::Panes)));
    assert_eq!(app.focus, crate::app::state::Focus::Input);
}

#[test]
fn the_key_hints_name_the_panes_key_at_80_columns() {
    let mut app = mid_reply();
    let turn = app.live_turn().unwrap();
    ev(
        &mut app,
        EngineEvent::TurnDone {
            turn,
            report: done("ok", None),
        },
    );
    app.toast = None;
    let rows = screen_rows(&app, 80, 24);
    assert!(rows[23].contains(" F1 help · F3 panes · "), "{}", rows[23]);
}
