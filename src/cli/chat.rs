//! `k3 chat`'s front end: the terminal interface or the plain REPL, on the worker that
//! [`crate::app::chat::start`] started.

use crate::app::chat::{self, ChatArgs};
use crate::app::state::AppInit;
use crate::ui::input::KeyMap;
use crate::ui::repl::{self, ReplOptions};
use crate::ui::tui::{self, TuiOptions};

/// Largest input-history file read.
const MAX_HISTORY_BYTES: u64 = 64 << 20;

/// The terminal client's input history from earlier runs (a JSON list of strings); a missing
/// or unreadable file (or one that is not a regular file, or above 64 MiB) is an empty history.
fn load_history(path: &std::path::Path) -> Vec<String> {
    crate::stream::read_capped(path, MAX_HISTORY_BYTES)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Keep the input history for the next run (written atomically); a failure is reported, not
/// fatal.
fn save_history(path: &std::path::Path, history: &[String]) {
    let bytes = serde_json::to_vec(history).unwrap_or_default();
    if let Err(e) = crate::stream::atomic::write(path, &bytes) {
        eprintln!(
            "k3: the input history was not saved to {}: {e}",
            crate::stream::shown(path)
        );
    }
}

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
            effort: s.settings.effort.clone(),
            context_limit: s.settings.context_limit as u64,
            max_tokens: s.settings.max_tokens as u64,
            history: s
                .tui_history
                .as_deref()
                .map(load_history)
                .unwrap_or_default(),
            budget_gb: s.budget_gb,
            keys: keys.labels(),
            theme: s.theme,
        };
        let out = tui::run(s.worker, TuiOptions { init, keys });
        if let Some(path) = &s.tui_history {
            save_history(path, &out.history);
        }
        return Ok(out.code);
    }
    Ok(repl::run(
        s.worker,
        &ReplOptions {
            jsonl: s.jsonl,
            history_file: s.history_file,
        },
    ))
}
