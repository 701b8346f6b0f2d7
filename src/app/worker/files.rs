//! Session files: saving, loading, listing, renaming, deleting and exporting.

use super::{unix_now, Base, Claim, Ctx, SavedTranscript};
use crate::app::protocol::{EngineEvent, Request, SessionRow, TurnId};
use crate::engine::weights::LoadInfo;
use crate::session::chat::{self, Entry, Settings};
use crate::session::commands::ExportFormat;
use crate::session::naming;
use crate::session::store::{
    self, LockError, ModelIdentity, SessionLock, SessionRecord, SessionStore, Summary,
};
use std::path::Path;

/// The files a model's identity digests were accepted when the model was loaded (each well
/// under this); read again here, they are held to the same rule: regular files, sizes checked.
const MAX_IDENTITY_FILE_BYTES: u64 = 256 << 20;

pub(super) fn model_identity(dir: &Path, info: &LoadInfo) -> std::io::Result<ModelIdentity> {
    let read = |name: &str| crate::stream::read_capped(&dir.join(name), MAX_IDENTITY_FILE_BYTES);
    let config = read("config.json")?;
    let ranks = read("tiktoken.model")?;
    let tok_cfg = read("tokenizer_config.json")?;
    Ok(ModelIdentity::compute(
        &config,
        &[&ranks, &tok_cfg],
        &info.index_digest,
    ))
}

/// Why `/export` could not write `path`, in words: a missing folder or a refused permission
/// is named, with the path.
pub(super) fn export_error(path: &str, e: &std::io::Error) -> String {
    let p = Path::new(path);
    let dir = p
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let why = match e.kind() {
        std::io::ErrorKind::NotFound => format!("the folder {} does not exist", dir.display()),
        std::io::ErrorKind::PermissionDenied => {
            format!("permission to write in {} was refused", dir.display())
        }
        std::io::ErrorKind::IsADirectory => format!("{path} is a folder"),
        _ => e.to_string(),
    };
    format!("/export: the transcript was NOT written to {path}: {why}")
}

/// The answer to [`Request::RenameSession`] and [`Request::DeleteSession`]: the files moved or
/// removed under the session's lock (so no other process has it open meanwhile), or why not.
/// `open` is the session this process has open, which is refused.
pub(super) fn session_file_op(
    store: &SessionStore,
    open: Option<&str>,
    req: Request,
) -> EngineEvent {
    let (turn, result) = match req {
        Request::RenameSession { turn, from, to } => {
            (turn, rename_session(store, open, &from, &to))
        }
        Request::DeleteSession { turn, name } => (turn, delete_session(store, open, &name)),
        _ => {
            return EngineEvent::Notice {
                turn: 0,
                text: String::new(),
            }
        }
    };
    match result {
        Ok(text) => EngineEvent::Notice { turn, text },
        Err(message) => EngineEvent::Failed { turn, message },
    }
}

pub(super) fn rename_session(
    store: &SessionStore,
    open: Option<&str>,
    from: &str,
    to: &str,
) -> Result<String, String> {
    let why = |e: &dyn std::fmt::Display| format!("rename {from:?} to {to:?}: {e}");
    store::validate_name(to).map_err(|e| why(&e))?;
    if from == to {
        return Ok(format!("session {from:?} keeps its name"));
    }
    if open == Some(from) {
        return Err(why(
            &"it is the session open here; /save NAME saves it under a new name",
        ));
    }
    if !store.exists(from) {
        return Err(why(&"there is no saved session of that name"));
    }
    let taken = || store.exists(to) || store.has_journal(to) || open == Some(to);
    if taken() {
        return Err(why(&format!("a session {to:?} exists already")));
    }
    let _old = store.lock(from).map_err(|e| why(&e))?;
    let _new = store.lock(to).map_err(|e| why(&e))?;
    if taken() {
        return Err(why(&format!("a session {to:?} exists already")));
    }
    let path = |n: &str| store.path_of(n).map_err(|e| why(&e));
    std::fs::rename(path(from)?, path(to)?).map_err(|e| why(&e))?;
    if store.has_journal(from) {
        let journal = |n: &str| store.journal_path(n).map_err(|e| why(&e));
        std::fs::rename(journal(from)?, journal(to)?).map_err(|e| why(&e))?;
    }
    Ok(format!("session {from:?} renamed to {to:?}"))
}

pub(super) fn delete_session(
    store: &SessionStore,
    open: Option<&str>,
    name: &str,
) -> Result<String, String> {
    let why = |e: &dyn std::fmt::Display| format!("delete {name:?}: {e}");
    store::validate_name(name).map_err(|e| why(&e))?;
    if open == Some(name) {
        return Err(why(&"it is the session open here; /new first"));
    }
    if !store.exists(name) && !store.has_journal(name) {
        return Err(why(&"there is no saved session of that name"));
    }
    let _lock = store.lock(name).map_err(|e| why(&e))?;
    if store.exists(name) {
        let p = store.path_of(name).map_err(|e| why(&e))?;
        std::fs::remove_file(p).map_err(|e| why(&e))?;
    }
    if store.has_journal(name) {
        let p = store.journal_path(name).map_err(|e| why(&e))?;
        std::fs::remove_file(p).map_err(|e| why(&e))?;
    }
    Ok(format!("session {name:?} deleted"))
}

/// The answer to [`Request::ListSessions`]: the rows, or why the directory cannot be read.
pub(super) fn session_rows(store: &SessionStore, turn: TurnId) -> EngineEvent {
    match listing(store) {
        Ok(rows) => EngineEvent::Sessions { turn, rows },
        Err(e) => EngineEvent::Failed {
            turn,
            message: format!("{}: {e}", store.dir().display()),
        },
    }
}

/// The saved sessions and the conversations only journaled, newest first: a saved session
/// with a journal is marked unsaved (and dated by its journal's last write); a conversation
/// never saved is listed from its journal, with the turns its last record holds.
pub(super) fn listing(store: &SessionStore) -> std::io::Result<Vec<SessionRow>> {
    let mut rows: Vec<SessionRow> = store
        .list()?
        .into_iter()
        .map(|s| SessionRow {
            name: s.name,
            saved_unix: s.saved_unix,
            saved: naming::local_time(s.saved_unix),
            turns: s.turns,
            bytes: s.bytes,
            problem: s.problem,
            unsaved: false,
        })
        .collect();
    for j in store.journals()? {
        if let Some(row) = rows.iter_mut().find(|r| r.name == j.name) {
            row.unsaved = true;
            row.saved_unix = row.saved_unix.max(j.modified_unix);
            continue;
        }
        let turns = store
            .journal_path(&j.name)
            .ok()
            .and_then(|p| super::journaled::journal_turns(&p))
            .unwrap_or(0);
        rows.push(SessionRow {
            saved: "not saved".into(),
            name: j.name,
            saved_unix: j.modified_unix,
            turns,
            bytes: j.bytes,
            problem: None,
            unsaved: true,
        });
    }
    rows.sort_by(|a, b| {
        b.saved_unix
            .cmp(&a.saved_unix)
            .then_with(|| a.name.cmp(&b.name))
    });
    Ok(rows)
}

impl Ctx<'_> {
    /// The record to save: the session's state and snapshots are moved into it (no copy);
    /// [`Worker::return_state`] gives them back.
    pub(super) fn record(&mut self, name: &str) -> Result<SessionRecord, String> {
        let s = &self.session;
        let transcript = SavedTranscript {
            system: s.system.clone(),
            mode: s.mode,
            entries: s.entries.clone(),
            pending: s.pending(),
        };
        let transcript_json = serde_json::to_vec(&transcript).map_err(|e| e.to_string())?;
        let settings_json = serde_json::to_vec(&s.settings).map_err(|e| e.to_string())?;
        let (turns, mode, sampler, rng_state) = (
            s.turns() as u32,
            s.mode.name().to_string(),
            s.settings.sampler(),
            s.rng_state(),
        );
        let (tokens, state, snapshots) = self.session.lend_state();
        Ok(SessionRecord {
            name: name.to_string(),
            created_unix: self.created,
            saved_unix: unix_now(),
            identity: self.identity,
            summary: Summary { turns, mode },
            transcript_json,
            settings_json,
            tokens,
            state,
            snapshots,
            sampler,
            rng_state,
        })
    }

    /// Give the session back the state [`Worker::record`] moved into `rec`.
    pub(super) fn return_state(&mut self, rec: &mut SessionRecord) {
        let state = std::mem::replace(
            &mut rec.state,
            crate::engine::SeqState {
                n_pos: 0,
                layers: Vec::new(),
            },
        );
        self.session.put_back(
            std::mem::take(&mut rec.tokens),
            state,
            std::mem::take(&mut rec.snapshots),
        );
    }

    pub(super) fn apply_transcript(&mut self, json: &[u8]) -> Result<Option<u32>, String> {
        let t: SavedTranscript =
            serde_json::from_slice(json).map_err(|e| format!("transcript: {e}"))?;
        self.session.system = t.system;
        self.session.entries = t.entries;
        self.session.mode = t.mode;
        Ok(t.pending)
    }

    /// Load `name`: full restore, or the transcript alone when the state is refused. The
    /// session is locked first, and stays locked while it is open here; one that another
    /// process has open is refused with that process's pid. The error carries the exit status
    /// a non-interactive caller should use.
    pub(super) fn load(&mut self, name: &str) -> Result<String, (String, i32)> {
        let claim = self.claim_to_open(name)?;
        self.drop_empty_journal();
        let mut msg = if !self.store.exists(name) && self.store.has_journal(name) {
            self.start_from_journal(name)?
        } else {
            let loaded = self.load_inner(name);
            self.session.ensure_state();
            loaded?
        };
        // The journal of what was open before stays on disk: its turns are recovered when
        // that session is resumed.
        self.journal = None;
        self.journal_problem = None;
        if let Some((lock, warning)) = claim {
            if let Some(w) = warning {
                msg.push('\n');
                msg.push_str(&w);
            }
            self.open = Some(lock);
        }
        if let Some(recovered) = self.recover(name) {
            msg.push('\n');
            msg.push_str(&recovered);
        }
        self.sources =
            crate::session::defaults::Sources::all(crate::session::defaults::Source::Session);
        let mut s = self.session.settings.clone();
        if let Some(line) = self.flags.over_session(&mut s, &mut self.sources) {
            // Every flag value was accepted at start, as the session's were at save.
            self.session
                .set_settings(s)
                .map_err(|e| (e.to_string(), 2))?;
            msg.push('\n');
            msg.push_str(&line);
        }
        Ok(msg)
    }

    /// The lock to hold once `name` is opened: `None` when it is open here already or there is
    /// no such session (the load then says so). Where no lock can be taken for another reason
    /// (a read-only session directory) the session opens unguarded, with a warning.
    pub(super) fn claim_to_open(&self, name: &str) -> Result<Option<Claim>, (String, i32)> {
        let absent = !self.store.exists(name) && !self.store.has_journal(name);
        if self.open.as_ref().is_some_and(|l| l.name() == name) || absent {
            return Ok(None);
        }
        match self.store.lock(name) {
            Ok(lock) => Ok(Some((lock, None))),
            Err(e @ LockError::Io { .. }) => {
                let lock = SessionLock::unlocked(name).map_err(|n| (n.to_string(), 2))?;
                let warning = format!(
                    "warning: {e}; the session is open without a lock, so another process could \
                     save over it"
                );
                Ok(Some((lock, Some(warning))))
            }
            Err(e) => Err((e.to_string(), e.exit_code())),
        }
    }

    pub(super) fn load_inner(&mut self, name: &str) -> Result<String, (String, i32)> {
        let refused = |m: String| (m, 3);
        // The state held now goes before the saved one is read, so that no more states are
        // held than the plan reserves (the transcript stays until the load succeeds).
        self.session.release_state();
        match self
            .store
            .load(name, &self.session.model().cfg, &self.identity)
        {
            Ok(rec) => {
                // The plan reserved state for this process's context limit: it wins over the
                // saved one, and a session longer than it is refused before anything changes.
                let limit = self.session.settings.context_limit;
                if rec.tokens.len() > limit {
                    return Err((
                        format!(
                            "session {name:?} holds {} positions, more than the context limit \
                             of {limit} (--context); resume it with --context {} or more",
                            rec.tokens.len(),
                            rec.tokens.len()
                        ),
                        2,
                    ));
                }
                let mut settings: Settings = serde_json::from_slice(&rec.settings_json)
                    .map_err(|e| refused(format!("session {name:?}: settings: {e}")))?;
                settings.context_limit = limit;
                self.session
                    .set_settings(settings)
                    .map_err(|e| refused(e.to_string()))?;
                let pending = self
                    .apply_transcript(&rec.transcript_json)
                    .map_err(refused)?;
                self.session
                    .restore(rec.tokens, rec.state, pending, rec.rng_state, rec.snapshots)
                    .map_err(|e| refused(e.to_string()))?;
                self.base = Some(Base::of(&rec.transcript_json));
                self.name = Some(rec.name);
                self.created = rec.created_unix;
                Ok(format!(
                    "loaded session {name:?}: {} turns, {} positions, no re-prefill needed",
                    self.session.turns(),
                    self.session.tokens().len()
                ))
            }
            Err(store::LoadError::StateRefused {
                reason,
                transcript_json,
            }) => {
                self.outcome.damaged |= reason.is_damage();
                self.session.reset().map_err(|e| refused(e.to_string()))?;
                self.apply_transcript(&transcript_json).map_err(refused)?;
                self.base = Some(Base::of(&transcript_json));
                self.name = Some(name.to_string());
                Ok(format!(
                    "session {name:?}: the saved state was refused ({reason}); its transcript \
                     is loaded and the next turn re-reads the history"
                ))
            }
            Err(e) => Err((e.to_string(), e.exit_code())),
        }
    }

    /// Save under `name` (default: the session's name, or a new one from its first words and
    /// the date). A session saved to for the first time is locked first (refused, unsaved, when
    /// another process has it open) and stays locked; a different saved session of that name
    /// is replaced only when `replace` is set (`/save!`).
    pub(super) fn save(&mut self, name: Option<String>, replace: bool) -> Result<String, String> {
        let (target, claim) = match name.or_else(|| self.name.clone()) {
            Some(target) => match &self.open {
                Some(l) if l.name() == target => (target, None),
                // The journal's own name: a fresh conversation journaled there.
                _ if self
                    .journal
                    .as_ref()
                    .is_some_and(|j| j.name == target && j.own_lock.is_some()) =>
                {
                    let lock = self.journal.as_mut().and_then(|j| j.own_lock.take());
                    (target, lock)
                }
                _ => {
                    let lock = self
                        .store
                        .lock(&target)
                        .map_err(|e| e.into_save_error().to_string())?;
                    if !replace && self.store.exists(&target) {
                        return Err(format!(
                            "session {target:?} NOT saved: a different saved session has that \
                             name; /save! {target} replaces it, /save OTHER-NAME keeps both"
                        ));
                    }
                    (target, Some(lock))
                }
            },
            None => {
                let base = naming::default_name(&self.first_text(), unix_now());
                let lock = self
                    .store
                    .claim_new(&base)
                    .map_err(|e| e.into_save_error().to_string())?
                    .ok_or_else(|| {
                        format!(
                            "session NOT saved: {base} and its numbered variants up to -{} are \
                             all taken; /save NAME picks another name",
                            naming::MAX_SUFFIX
                        )
                    })?;
                (lock.name().to_string(), Some(lock))
            }
        };
        let mut rec = self.record(&target)?;
        let t0 = std::time::Instant::now();
        let saved = match claim.as_ref().or(self.open.as_ref()) {
            Some(lock) => self.store.save_locked(&rec, lock),
            None => self.store.save(&rec),
        };
        let positions = rec.tokens.len();
        let snapshots = rec.snapshots.len();
        self.return_state(&mut rec);
        let bytes = saved.map_err(|e| e.to_string())?;
        // Everything journaled is in the saved file now (removed before a lock it is under
        // is let go).
        let journal_note = self.drop_journal();
        self.base = Some(Base::of(&rec.transcript_json));
        if let Some(lock) = claim {
            self.open = Some(lock);
        }
        let mut answer = format!(
            "saved session {target:?} ({positions} positions and {snapshots} snapshot{}, {:.1} \
             KB, {:.0} ms)",
            if snapshots == 1 { "" } else { "s" },
            bytes as f64 / 1e3,
            t0.elapsed().as_secs_f64() * 1e3
        );
        if let Some(note) = journal_note {
            answer.push_str(&format!("; {note}"));
        }
        self.name = Some(target);
        Ok(answer)
    }

    /// The first message (or raw text) of the conversation, for its default name.
    pub(super) fn first_text(&self) -> String {
        self.session
            .entries
            .iter()
            .find_map(|e| match e {
                Entry::Message { role, content, .. } if role == "user" => Some(content.clone()),
                Entry::Raw { prompt, .. } => Some(prompt.clone()),
                _ => None,
            })
            .unwrap_or_default()
    }

    pub(super) fn sessions(&self) -> Result<String, String> {
        let list = self.store.list().map_err(|e| e.to_string())?;
        let journals = self.store.journals().map_err(|e| e.to_string())?;
        if list.is_empty() && journals.is_empty() {
            return Ok(format!(
                "no saved sessions in {}",
                self.store.dir().display()
            ));
        }
        let mut out = format!(
            "{} saved session(s) in {}:",
            list.len(),
            self.store.dir().display()
        );
        for s in &list {
            let journaled = journals.iter().any(|j| j.name == s.name);
            out.push_str(&format!(
                "\n  {:<24} saved {}  {} turns  {} positions  {:.1} KB  {:.0} B/position{}",
                s.name,
                naming::local_time(s.saved_unix),
                s.turns,
                s.positions,
                s.bytes as f64 / 1e3,
                s.bytes_per_position,
                if journaled {
                    "  + unsaved changes (journaled)"
                } else {
                    ""
                }
            ));
        }
        let unsaved: Vec<_> = journals
            .iter()
            .filter(|j| !list.iter().any(|s| s.name == j.name))
            .collect();
        if !unsaved.is_empty() {
            out.push_str(&format!(
                "\n{} conversation(s) never saved, kept in their journals (--resume NAME or \
                 /load NAME opens one):",
                unsaved.len()
            ));
            for j in unsaved {
                let turns = self
                    .store
                    .journal_path(&j.name)
                    .ok()
                    .and_then(|p| super::journaled::journal_turns(&p))
                    .unwrap_or(0);
                out.push_str(&format!(
                    "\n  {:<24} unsaved, last written {}  {turns} turns",
                    j.name,
                    naming::local_time(j.modified_unix),
                ));
            }
        }
        Ok(out)
    }

    pub(super) fn export(&self, fmt: ExportFormat, path: &str) -> Result<String, String> {
        let s = &self.session;
        let text = match fmt {
            ExportFormat::Json => {
                let t = SavedTranscript {
                    system: s.system.clone(),
                    mode: s.mode,
                    entries: s.entries.clone(),
                    pending: None,
                };
                serde_json::to_string_pretty(&t).map_err(|e| e.to_string())?
            }
            ExportFormat::Markdown => {
                chat::markdown(self.name.as_deref(), s.system.as_deref(), &s.entries)
            }
        };
        std::fs::write(path, text).map_err(|e| export_error(path, &e))?;
        Ok(format!("transcript written to {path}"))
    }
}

#[cfg(test)]
mod tests {
    use super::export_error;

    #[test]
    fn an_export_that_cannot_be_written_says_why_in_words() {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let missing = dir.path().join("nonexistent").join("x.md");
        let path = missing.to_string_lossy().into_owned();
        let e = std::fs::write(&missing, "x").expect_err("no such folder");
        let msg = export_error(&path, &e);
        assert!(msg.contains("NOT written"), "{msg}");
        assert!(
            msg.contains(&format!(
                "the folder {} does not exist",
                dir.path().join("nonexistent").display()
            )),
            "{msg}"
        );
        assert!(!msg.contains("os error"), "{msg}");
        let folder = dir.path().to_string_lossy().into_owned();
        let e = std::fs::write(dir.path(), "x").expect_err("a folder");
        let msg = export_error(&folder, &e);
        assert!(msg.contains("is a folder"), "{msg}");
    }
}
