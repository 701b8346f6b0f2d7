//! Screen snapshots of a Markdown reply and of select mode at 80×24 and 160×48, recorded with
//! their styles: the text, then one letter per cell naming its style, then the legend of the
//! letters (foreground, background, modifiers). A change of colour or emphasis changes the
//! snapshot as surely as a change of text.

use super::*;
use crate::app::config::{KeysConfig, ThemeName};
use crate::app::protocol::{EngineEvent, Request, TurnId};
use crate::app::state::{Action, AppInit, Effect, Msg, Target};
use crate::session::chat::{Stop, TurnReport};
use crate::ui::input::KeyMap;
use ratatui::backend::TestBackend;
use ratatui::style::{Color, Modifier};
use ratatui::Terminal;
use std::fmt::Write as _;

fn init() -> AppInit {
    let keys = KeyMap::new(KeysConfig::default().bindings().unwrap_or_default());
    AppInit {
        model: "tiny".into(),
        session: Some("notes".into()),
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

fn finish(app: &mut App, turn: TurnId, reply: &str) {
    app.update(Msg::Engine(EngineEvent::TurnDone {
        turn,
        report: Box::new(TurnReport {
            mode: crate::session::chat::Mode::Chat,
            prompt_ids: vec![1; 30],
            generated_ids: vec![2; 96],
            generated_tokens: 96,
            reply: reply.into(),
            reasoning: None,
            reused_tokens: 0,
            prefilled_tokens: 30,
            stop: Stop::End(3),
            accepted: true,
            rejected_because: None,
            prefill_seconds: 0.1,
            decode_seconds: 4.0,
            context_warning: None,
        }),
    }));
}

/// A reply with a heading, a nested and numbered list, emphasis, a link, a table and a code
/// fence.
pub(super) const REPLY: &str = "\
## Reading a checkpoint

1. Open the **index** with *serde*
   - check `weight_map`
2. Map the shards, see [the docs](https://docs.rs/memmap2)

| shard | tensors | bytes |
|:------|:-------:|------:|
| 1 | 412 | 4.1 GB |
| 2 | 398 | 3.9 GB |

```rust
fn open(dir: &Path) -> io::Result<Index> {
    let text = fs::read_to_string(dir.join(\"index.json\"))?;
    Ok(serde_json::from_str(&text)?)
}
```
";

fn markdown_app() -> App {
    let mut app = App::new(init());
    app.update(Msg::Engine(EngineEvent::Ready {
        info: "k3: tiny, session \"notes\", chat mode".into(),
    }));
    let t = send(&mut app, "How do I read a checkpoint index?");
    finish(&mut app, t, REPLY);
    app
}

fn style_name(c: &ratatui::buffer::Cell) -> String {
    let mut parts = Vec::new();
    if c.fg != Color::Reset {
        parts.push(format!("fg={:?}", c.fg));
    }
    if c.bg != Color::Reset {
        parts.push(format!("bg={:?}", c.bg));
    }
    if c.modifier != Modifier::empty() {
        parts.push(format!("{:?}", c.modifier));
    }
    parts.join(" ")
}

/// The buffer as text, a style letter per cell (a space for the terminal's default), and the
/// letters' legend.
fn styled(buf: &Buffer) -> String {
    const LETTERS: &str = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let area = buf.area;
    let mut legend: Vec<String> = Vec::new();
    let mut text = String::new();
    let mut styles = String::new();
    for y in area.top()..area.bottom() {
        text.push('|');
        styles.push('|');
        let mut skip = 0;
        for x in area.left()..area.right() {
            let c = &buf[(x, y)];
            let name = style_name(c);
            let letter = if name.is_empty() {
                ' '
            } else {
                let i = legend.iter().position(|l| *l == name).unwrap_or_else(|| {
                    legend.push(name.clone());
                    legend.len() - 1
                });
                LETTERS.chars().nth(i).unwrap_or('?')
            };
            styles.push(letter);
            if skip > 0 {
                skip -= 1;
                continue;
            }
            text.push_str(c.symbol());
            skip = text::str_width(c.symbol()).saturating_sub(1);
        }
        text.push_str("|\n");
        styles.push_str("|\n");
    }
    let mut out = format!("{text}\n{styles}\n");
    for (i, l) in legend.iter().enumerate() {
        let _ = writeln!(out, "{} = {l}", LETTERS.chars().nth(i).unwrap_or('?'));
    }
    out
}

fn screen(app: &App, w: u16, h: u16) -> String {
    let mut t = Terminal::new(TestBackend::new(w, h)).expect("test terminal");
    t.draw(|f| {
        draw(f, app);
    })
    .expect("draw");
    styled(t.backend().buffer())
}

macro_rules! snap {
    ($name:literal, $app:expr) => {
        let app = $app;
        insta::assert_snapshot!(concat!($name, "_80x24"), screen(&app, 80, 24));
        insta::assert_snapshot!(concat!($name, "_160x48"), screen(&app, 160, 48));
    };
}

#[test]
fn markdown_reply() {
    let mut app = markdown_app();
    // At 80×24 the reply is taller than the pane: scrolled to show it from its label.
    let mut t = Terminal::new(TestBackend::new(80, 24)).expect("test terminal");
    let mut m = Measure::default();
    t.draw(|f| m = draw(f, &app)).expect("draw");
    app.update(Msg::Viewport {
        max_scroll: m.max_scroll,
        page: m.page,
    });
    let small = {
        let mut a = app.clone();
        a.update(Msg::Action(Action::Scroll(3)));
        a
    };
    insta::assert_snapshot!("markdown_reply_80x24", screen(&small, 80, 24));
    insta::assert_snapshot!("markdown_reply_160x48", screen(&app, 160, 48));
}

#[test]
fn select_mode_on_a_code_block() {
    let mut app = markdown_app();
    app.update(Msg::Action(Action::Cmd(Cmd::Select)));
    app.update(Msg::Action(Action::Down));
    assert_eq!(app.selected, Some(Target::Code { item: 3, block: 0 }));
    snap!("select_code_block", app);
}

#[test]
fn select_mode_on_a_message() {
    let mut app = markdown_app();
    app.update(Msg::Action(Action::Cmd(Cmd::Select)));
    app.update(Msg::Action(Action::Up));
    assert_eq!(app.selected, Some(Target::Message(2)));
    insta::assert_snapshot!("select_message_80x24", screen(&app, 80, 24));
}
