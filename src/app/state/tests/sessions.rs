//! The session dialog and unsaved turns: load, save, save as, rename, delete, filter, new,
//! and quitting, each through the worker and asking first where turns would be lost.

use super::*;

fn rows() -> Vec<SessionRow> {
    vec![
        SessionRow {
            name: "alpha".into(),
            saved_unix: 1_800_000_000,
            saved: "2027-01-15 08:00".into(),
            turns: 3,
            bytes: 12_345,
            problem: None,
            unsaved: false,
        },
        SessionRow {
            name: "beta".into(),
            saved_unix: 1_700_000_000,
            saved: "2023-11-14 22:13".into(),
            turns: 1,
            bytes: 999,
            problem: None,
            unsaved: false,
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
        unsaved: false,
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
