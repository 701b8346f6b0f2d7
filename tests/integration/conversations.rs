//! The terminal client's state machine (`App`) driven against the real worker on the tiny
//! model, as the terminal driver connects them: what the session dialog, the status bar and
//! the quit prompt say about a conversation's name and whether it is saved.

use crate::common::fixture;
use k3::app::config::{Cmd, ThemeName};
use k3::app::state::{Action, App, AppInit, Dialog, Effect, Item, KeyLabels, Msg, Phase};
use k3::app::worker::{ChatConfig, Worker};
use k3::session::chat::Settings;
use k3::session::store::SessionStore;
use std::path::Path;
use std::time::{Duration, Instant};

/// The client and its worker, connected as `ui::tui` connects them.
struct Client {
    app: App,
    worker: Worker,
}

fn settings() -> Settings {
    Settings {
        sampler: k3::engine::sampling::SamplerConfig {
            temperature: 0.0,
            seed: 7,
            ..Default::default()
        },
        max_tokens: 6,
        raw_max_tokens: 6,
        thinking: false,
        ..Settings::default()
    }
}

impl Client {
    fn start(dir: &Path, resume: Option<&str>) -> Client {
        let worker = Worker::spawn(ChatConfig {
            model_dir: fixture("tiny"),
            model_label: "tiny".into(),
            settings: settings(),
            system: None,
            resume: resume.map(str::to_string),
            session_name: resume.map(str::to_string),
            session_dir: Some(dir.to_path_buf()),
            budget: k3::stream::budget::BudgetRequest::Resident,
            trunk: None,
            spec: k3::engine::spec::SpecMode::Off,
            start_note: None,
            sources: k3::session::defaults::Sources::default(),
            flags: Default::default(),
        });
        let app = App::new(AppInit {
            model: "tiny".into(),
            session: resume.map(str::to_string),
            resume: resume.is_some(),
            thinking: false,
            effort: "high".into(),
            context_limit: 4096,
            budget_gb: None,
            keys: KeyLabels::default(),
            theme: ThemeName::Dark,
            max_tokens: 6,
            history: Vec::new(),
        });
        let mut c = Client { app, worker };
        c.until("the model is ready", |a| a.phase == Phase::Idle);
        c
    }

    fn run(&mut self, fx: Vec<Effect>) {
        for e in fx {
            if let Effect::Send(r) = e {
                assert!(self.worker.send(r), "the worker is gone");
            }
        }
    }

    fn act(&mut self, a: Action) {
        let fx = self.app.update(Msg::Action(a));
        self.run(fx);
    }

    fn type_text(&mut self, text: &str) {
        for c in text.chars() {
            self.act(Action::Char(c));
        }
    }

    /// Feed the worker's events to the client until `ok` holds (60 s at most).
    fn until(&mut self, what: &str, ok: impl Fn(&App) -> bool) {
        let end = Instant::now() + Duration::from_secs(60);
        while !ok(&self.app) {
            assert!(
                Instant::now() < end,
                "waited 60 s for {what}: {:?}",
                self.app.items
            );
            match self.worker.try_recv() {
                Some(ev) => {
                    let fx = self.app.update(Msg::Engine(ev));
                    self.run(fx);
                }
                None => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    /// Send a message and wait for its reply to end.
    fn chat(&mut self, text: &str) {
        self.type_text(text);
        self.act(Action::Submit);
        self.until("the reply", |a| {
            a.phase == Phase::Idle
                && a.items
                    .iter()
                    .any(|i| matches!(i, Item::User { text: t, .. } if t == text))
        });
    }

    /// The last info or error line.
    fn last_line(&self) -> String {
        self.app
            .items
            .iter()
            .rev()
            .find_map(|i| match i {
                Item::Info(t) | Item::Error(t) => Some(t.clone()),
                _ => None,
            })
            .unwrap_or_default()
    }

    /// Ctrl-S, `s`: the name "save as" is prefilled with.
    fn save_as_prefill(&mut self) -> String {
        self.act(Action::Cmd(Cmd::Sessions));
        self.until(
            "the session list",
            |a| matches!(&a.dialog, Some(Dialog::Sessions(d)) if d.rows.is_some()),
        );
        self.act(Action::Char('s'));
        match &self.app.dialog {
            Some(Dialog::Sessions(d)) => d.naming.as_ref().expect("save as").text().to_string(),
            other => panic!("no session dialog: {other:?}"),
        }
    }

    /// Enter in "save as", and the worker's answer.
    fn save_enter(&mut self) -> String {
        let before = self.app.items.len();
        self.act(Action::Submit);
        self.until("the save's answer", |a| {
            a.items.len() > before + 1 && a.phase == Phase::Idle
        });
        self.last_line()
    }
}

#[test]
fn a_new_conversation_gets_its_own_name_and_saves_under_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Client::start(dir.path(), None);
    c.chat("Hello there");
    // Save as priya-chat from the dialog.
    let prefill = c.save_as_prefill();
    assert!(prefill.starts_with("hello-there-"), "{prefill}");
    c.type_text("priya-chat");
    let saved = c.save_enter();
    assert!(saved.contains("saved session \"priya-chat\""), "{saved}");
    assert_eq!(c.app.session.as_deref(), Some("priya-chat"));
    // Ctrl-N, chat: the new conversation has a name of its own from its first turn.
    c.act(Action::Cmd(Cmd::New));
    c.until("the new conversation", |a| a.session.is_none());
    c.chat("My favourite colour is green");
    let name = c.app.session.clone().expect("named at its first turn");
    assert!(name.starts_with("my-favourite-colour-is-green-"), "{name}");
    let store = SessionStore::new(dir.path());
    assert!(store.has_journal(&name), "journaled as {name}");
    // The dialog offers that name, and saving under it works.
    assert_eq!(c.save_as_prefill(), name);
    let saved = c.save_enter();
    assert!(
        saved.contains(&format!("saved session {name:?}")),
        "{saved}"
    );
    assert!(!c.app.dirty);
    assert!(store.exists(&name) && store.exists("priya-chat"));
    assert!(!store.has_journal(&name));
    c.worker.shutdown();
}

/// Hidden lock files in `dir`.
fn lock_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with('.') && n.ends_with(".lock"))
        .collect()
}

#[test]
fn unsaved_conversations_are_listed_resumed_as_unsaved_and_leave_no_lock_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Client::start(dir.path(), None);
    c.chat("Hello there");
    let name = c.app.session.clone().expect("named at its first turn");
    // The session dialog lists the conversation, marked unsaved, with its turn.
    c.act(Action::Cmd(Cmd::Sessions));
    c.until(
        "the session list",
        |a| matches!(&a.dialog, Some(Dialog::Sessions(d)) if d.rows.is_some()),
    );
    let row = match &c.app.dialog {
        Some(Dialog::Sessions(d)) => d.visible().into_iter().find(|r| r.name == name).cloned(),
        _ => None,
    }
    .expect("the unsaved conversation is listed");
    assert!(
        row.unsaved && row.saved == "not saved" && row.turns == 1,
        "{row:?}"
    );
    c.act(Action::Cmd(Cmd::Stop));
    // So does /sessions.
    c.type_text("/sessions");
    c.act(Action::Submit);
    c.until("the listing", |a| {
        a.items
            .last()
            .is_some_and(|i| matches!(i, Item::Info(t) if t.contains("never saved")))
    });
    let listing = c.last_line();
    assert!(
        listing.contains(&name) && listing.contains("1 turns"),
        "{listing}"
    );
    c.worker.shutdown();
    let store = SessionStore::new(dir.path());
    assert!(store.has_journal(&name));
    assert_eq!(lock_files(dir.path()), Vec::<String>::new());
    // Resumed, its recovered turn is unsaved: the status bar marks it and quitting asks.
    let mut c = Client::start(dir.path(), Some(&name));
    c.until("the history", |a| {
        a.items
            .iter()
            .any(|i| matches!(i, Item::Info(t) if t.starts_with("── history of")))
    });
    assert!(c.app.dirty, "recovered turns are not saved");
    c.act(Action::Cmd(Cmd::Quit));
    assert_eq!(c.app.dialog, Some(Dialog::ConfirmQuit));
    // Saved, the journal goes; the lock goes with the worker.
    c.act(Action::Char('s'));
    c.until("the save", |a| a.phase == Phase::Exiting);
    c.worker.shutdown();
    assert!(store.exists(&name) && !store.has_journal(&name));
    assert_eq!(lock_files(dir.path()), Vec::<String>::new());
}

#[test]
fn a_conversation_left_empty_leaves_no_journal() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Client::start(dir.path(), None);
    c.chat("Hello there");
    let name = c.app.session.clone().expect("named at its first turn");
    let store = SessionStore::new(dir.path());
    assert!(store.has_journal(&name));
    c.type_text("/undo");
    c.act(Action::Submit);
    c.until("the undo", |a| {
        a.last_reply().is_none() && a.phase == Phase::Idle
    });
    c.worker.shutdown();
    assert!(
        !store.has_journal(&name),
        "an empty conversation's journal stays"
    );
    assert_eq!(lock_files(dir.path()), Vec::<String>::new());
    assert!(store.journals().unwrap().is_empty());
}
