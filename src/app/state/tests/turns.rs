//! Turns: a reply streamed, thought and finished; cancel and Ctrl-C; events for turns nobody
//! asked for; failures; regen; a message queued behind a reply; the position in the context;
//! and a random message sequence that must never panic.

use super::*;

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
fn one_token_is_counted_in_the_singular() {
    let mut app = ready_app();
    let turn = send_message(&mut app, "hi");
    token(&mut app, turn, "x");
    assert_eq!(app.phase, Phase::Streaming { turn, tokens: 1 });
    let mut one = report("x", Stop::MaxTokens, true);
    one.generated_tokens = 1;
    one.decode_seconds = 12.0;
    let fx = ev(&mut app, EngineEvent::TurnDone { turn, report: one });
    assert_eq!(
        last_reply(&app).summary.as_deref(),
        Some("1 token · 0.1 tokens/s · prompt 1 reused + 2 read · 12.0 s · token limit")
    );
    assert!(
        fx.iter().any(|e| matches!(
            e,
            Effect::Notify(t) if t == "k3: the reply is ready (1 token, 12 s)"
        )),
        "{fx:?}"
    );
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
