//! The input box and the view: slash commands, history and multi-line editing, paste, help,
//! the mode key, scrolling, redraws on ticks, and the clipboard.

use super::*;

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
