//! `k3 chat`'s front end: the terminal interface or the plain REPL, on the worker that
//! [`crate::app::chat::start`] started.

use crate::app::chat::{self, ChatArgs};
use crate::app::state::AppInit;
use crate::ui::input::KeyMap;
use crate::ui::repl::{self, ReplOptions};
use crate::ui::tui::{self, TuiOptions};

/// Run `k3 chat`; returns the exit status.
pub fn run(args: &ChatArgs) -> crate::Result<i32> {
    let s = chat::start(args)?;
    if s.tui {
        let keys = KeyMap::new(s.bindings);
        let init = AppInit {
            model: s.model,
            session: s.session,
            resume: s.resume,
            thinking: s.settings.thinking,
            context_limit: s.settings.context_limit as u64,
            max_tokens: s.settings.max_tokens as u64,
            budget_gb: s.budget_gb,
            keys: keys.labels(),
            theme: s.theme,
        };
        return Ok(tui::run(s.worker, TuiOptions { init, keys }));
    }
    Ok(repl::run(
        s.worker,
        &ReplOptions {
            jsonl: s.jsonl,
            history_file: s.history_file,
        },
    ))
}
