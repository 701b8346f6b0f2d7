//! The journal: every change since the last save, appended as it happens, and the recovery
//! that applies it after a crash.

use super::{unix_now, Base, Ctx, SavedTranscript};
use crate::session::chat::{Entry, Settings};
use crate::session::journal::{self, Journal};
use crate::session::naming;
use crate::session::store::{SessionLock, SessionStore};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The format a journal's first record names.
pub(super) const JOURNAL_FORMAT: &str = "k3-journal/1";

/// A journal's first record: whose changes it holds, on top of which saved version.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct JournalHead {
    pub(super) format: String,
    pub(super) name: String,
    /// The saved version the changes apply to; `None`: an empty conversation.
    pub(super) base: Option<Base>,
    pub(super) created_unix: u64,
}

/// Why a journal record was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum RecordKind {
    /// A turn finished.
    Turn,
    /// A turn was stopped part-way (its partial reply is in the record).
    Stopped,
    /// A command changed the conversation, or a turn failed.
    Change,
}

/// One journal record: the conversation as it stands after a change. The ids are a delta on
/// the previous record's (`keep` of them stay, `add` follow; the first record keeps none).
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct JournalRecord {
    pub(super) kind: RecordKind,
    pub(super) keep: usize,
    pub(super) add: Vec<u32>,
    pub(super) pending: Option<u32>,
    pub(super) rng: u64,
    pub(super) transcript: SavedTranscript,
    pub(super) settings: Settings,
    /// The reply as far as it got, for a stopped turn.
    #[serde(default)]
    pub(super) partial: Option<String>,
    /// The ids of each snapshot the session held, oldest first, each as a prefix of this
    /// record's ids and the ids after it (recovery rebuilds them; older journals have none).
    #[serde(default)]
    pub(super) snapshots: Vec<SnapshotIds>,
}

/// A snapshot's ids: the first `keep` of the record's ids, then `add`.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct SnapshotIds {
    pub(super) keep: usize,
    pub(super) add: Vec<u32>,
}

/// The journal this process writes.
pub(super) struct Journaled {
    pub(super) name: String,
    pub(super) file: Journal,
    /// The name's lock, when it is not the open session's (a conversation whose `--session`
    /// name belongs to another saved session is journaled under a name of its own).
    pub(super) own_lock: Option<SessionLock>,
    /// The ids as of the last record.
    pub(super) tokens: Vec<u32>,
}

/// Rename a journal that cannot be applied out of the way, keeping it; the name it now has.
pub(super) fn set_aside(path: &Path) -> String {
    let kept = PathBuf::from(format!("{}.kept-{}", path.display(), unix_now()));
    match std::fs::rename(path, &kept) {
        Ok(()) => kept.display().to_string(),
        Err(e) => format!("{} (it could not be renamed: {e})", path.display()),
    }
}

/// The turns of the conversation a journal holds (as its last readable record has it), for a
/// listing; `None` when the journal cannot be read.
pub(super) fn journal_turns(path: &Path) -> Option<u32> {
    let read = journal::read(path).ok()??;
    let last = read
        .records
        .iter()
        .skip(1)
        .rev()
        .find_map(|r| serde_json::from_slice::<JournalRecord>(r).ok())?;
    let turns = last
        .transcript
        .entries
        .iter()
        .filter(|e| match e {
            Entry::Message { role, .. } => role == "user",
            Entry::Raw { .. } => true,
            Entry::Mode { .. } => false,
        })
        .count();
    u32::try_from(turns).ok()
}

impl Ctx<'_> {
    /// Open a session that was never saved but has a journal: an empty conversation, which
    /// the journal's turns then fill.
    pub(super) fn start_from_journal(&mut self, name: &str) -> Result<String, (String, i32)> {
        self.session.reset().map_err(|e| (e.to_string(), 2))?;
        self.name = Some(name.to_string());
        self.base = None;
        self.created = unix_now();
        Ok(format!("session {name:?} was never saved"))
    }

    /// Apply the journal of `name` (changes made after its last save by a process that ended
    /// without saving) on top of the session just loaded, and keep writing to it; what
    /// happened, to tell the user. A journal that does not continue the loaded version, or
    /// cannot be read, is renamed aside (never deleted) and not applied.
    pub(super) fn recover(&mut self, name: &str) -> Option<String> {
        let path = self.store.journal_path(name).ok()?;
        let shown = path.display().to_string();
        let read = match journal::read(&path) {
            Ok(None) => return None,
            Ok(Some(r)) => r,
            Err(e) => {
                let kept = set_aside(&path);
                return Some(format!("{e}; not applied (kept as {kept})"));
            }
        };
        let head = read
            .records
            .first()
            .and_then(|h| serde_json::from_slice::<JournalHead>(h).ok())
            .filter(|h| h.format == JOURNAL_FORMAT);
        let Some(head) = head else {
            let kept = set_aside(&path);
            return Some(format!(
                "journal {shown}: its header is not readable; not applied (kept as {kept})"
            ));
        };
        if head.base != self.base {
            let kept = set_aside(&path);
            return Some(format!(
                "journal {shown} continues another version of session {name:?} than the one \
                 saved; not applied (kept as {kept})"
            ));
        }
        let mut notes = Vec::new();
        if let Some(t) = &read.torn {
            notes.push(format!(
                "ignored a torn last record in {shown} ({} bytes at byte {}: {}; a write cut \
                 short)",
                t.bytes, t.at, t.why
            ));
        }
        let mut tokens: Vec<u32> = Vec::new();
        let mut last: Option<JournalRecord> = None;
        let mut turns = 0usize;
        let mut good_len = journal::MAGIC.len() as u64 + 8 + read.records[0].len() as u64;
        for (i, raw) in read.records.iter().enumerate().skip(1) {
            match serde_json::from_slice::<JournalRecord>(raw) {
                Ok(r) if r.keep <= tokens.len() => {
                    tokens.truncate(r.keep);
                    tokens.extend_from_slice(&r.add);
                    turns += usize::from(matches!(r.kind, RecordKind::Turn | RecordKind::Stopped));
                    last = Some(r);
                    good_len += 8 + raw.len() as u64;
                }
                _ => {
                    notes.push(format!(
                        "record {i} of {shown} does not follow the ones before it; it and \
                         the {} after it are ignored",
                        read.records.len() - 1 - i
                    ));
                    break;
                }
            }
        }
        if let Some(r) = last {
            let stopped = if r.kind == RecordKind::Stopped {
                ", the last one stopped part-way"
            } else {
                ""
            };
            if let Err(e) = self.apply_record(r, &tokens) {
                notes.push(format!("journal {shown}: {e}"));
            }
            notes.insert(
                0,
                format!(
                    "recovered {turns} unsaved turn{} from {shown}{stopped} (the saved session \
                     is unchanged until /save)",
                    if turns == 1 { "" } else { "s" }
                ),
            );
            self.changed = true;
            self.unsaved_turns = turns;
        }
        match Journal::reopen(&path, good_len) {
            Ok(file) => {
                self.journal = Some(Journaled {
                    name: name.to_string(),
                    file,
                    own_lock: None,
                    tokens,
                });
            }
            Err(e) => {
                self.journal_problem = Some(format!("journal {shown}: {e}"));
            }
        }
        (!notes.is_empty()).then(|| notes.join("\n"))
    }

    /// Make the conversation what a journal record says (ids `tokens`). When the ids are more
    /// than this process's context limit the transcript and settings are still taken, and the
    /// engine state is left as loaded (the next turn re-reads what it needs).
    pub(super) fn apply_record(&mut self, r: JournalRecord, tokens: &[u32]) -> Result<(), String> {
        let limit = self.session.settings.context_limit;
        let mut settings = r.settings;
        settings.context_limit = limit;
        self.session
            .set_settings(settings)
            .map_err(|e| e.to_string())?;
        self.session.system = r.transcript.system;
        self.session.entries = r.transcript.entries;
        self.session.mode = r.transcript.mode;
        if tokens.len() > limit {
            return Err(format!(
                "the recovered conversation holds {} positions, more than the context limit \
                 of {limit} (--context); its transcript is loaded and the next turn re-reads it",
                tokens.len()
            ));
        }
        let mut snapshots = Vec::with_capacity(r.snapshots.len());
        for s in &r.snapshots {
            let Some(head) = tokens.get(..s.keep) else {
                continue;
            };
            let mut ids = head.to_vec();
            ids.extend_from_slice(&s.add);
            snapshots.push(ids);
        }
        self.session
            .rebuild(tokens, r.pending, r.rng, &snapshots)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// Append the conversation as it stands to the journal (creating it, and naming a
    /// conversation that has no name yet, at the first change). A failure is kept to be
    /// reported and stops the journal; the conversation goes on.
    pub(super) fn journal(&mut self, kind: RecordKind, partial: Option<String>) {
        if self.journal_problem.is_some() {
            return;
        }
        // A setting changed before the first turn of a new conversation waits for that turn's
        // record (each record holds the whole conversation); the turn names the conversation.
        if self.journal.is_none() && kind == RecordKind::Change && self.open.is_none() {
            return;
        }
        if self.journal.is_none() {
            match self.open_journal() {
                Ok(j) => self.journal = Some(j),
                Err(e) => {
                    self.journal_problem = Some(e);
                    return;
                }
            }
        }
        let Some(j) = self.journal.as_mut() else {
            return;
        };
        let s = &self.session;
        let ids = s.tokens();
        let keep = j.tokens.iter().zip(ids).take_while(|(a, b)| a == b).count();
        let rec = JournalRecord {
            kind,
            keep,
            add: ids[keep..].to_vec(),
            pending: s.pending(),
            rng: s.rng_state(),
            transcript: SavedTranscript {
                system: s.system.clone(),
                mode: s.mode,
                entries: s.entries.clone(),
                pending: s.pending(),
            },
            settings: s.settings.clone(),
            partial,
            snapshots: s
                .snapshots()
                .iter()
                .map(|sn| {
                    let keep = sn
                        .tokens
                        .iter()
                        .zip(ids)
                        .take_while(|(a, b)| a == b)
                        .count();
                    SnapshotIds {
                        keep,
                        add: sn.tokens[keep..].to_vec(),
                    }
                })
                .collect(),
        };
        let written = serde_json::to_vec(&rec)
            .map_err(std::io::Error::other)
            .and_then(|bytes| j.file.append(&bytes));
        match written {
            Ok(()) => j.tokens = ids.to_vec(),
            Err(e) => {
                self.journal_problem = Some(format!(
                    "journal {}: {e}; later changes were not journaled",
                    j.file.path().display()
                ));
            }
        }
    }

    /// Create the journal for the conversation as it stands (its first record comes next).
    pub(super) fn open_journal(&mut self) -> Result<Journaled, String> {
        let (name, own_lock) = self.journal_home()?;
        let path = self.store.journal_path(&name).map_err(|e| e.to_string())?;
        // Never write over a journal this process has not read.
        if std::fs::symlink_metadata(&path).is_ok() {
            set_aside(&path);
        }
        let base = if own_lock.is_none() { self.base } else { None };
        let head = JournalHead {
            format: JOURNAL_FORMAT.into(),
            name: name.clone(),
            base,
            created_unix: unix_now(),
        };
        let bytes = serde_json::to_vec(&head).map_err(|e| e.to_string())?;
        let file = Journal::create(&path, &bytes)
            .map_err(|e| format!("journal {}: {e}", path.display()))?;
        Ok(Journaled {
            name,
            file,
            own_lock,
            tokens: Vec::new(),
        })
    }

    /// The name the journal is kept under, and its lock when that is not the open session's:
    /// the open session; else the session's name when it is free (it is locked and becomes
    /// the open session); else a new name from the conversation's first words and the date.
    pub(super) fn journal_home(&mut self) -> Result<(String, Option<SessionLock>), String> {
        if let Some(l) = &self.open {
            return Ok((l.name().to_string(), None));
        }
        let free = |st: &SessionStore, n: &str| !st.exists(n) && !st.has_journal(n);
        if let Some(n) = self.name.clone().filter(|n| free(&self.store, n)) {
            if let Ok(lock) = self.store.lock(&n) {
                if free(&self.store, &n) {
                    self.open = Some(lock);
                    return Ok((n, None));
                }
            }
        }
        let base = naming::default_name(&self.first_text(), unix_now());
        let lock = self
            .store
            .claim_new(&base)
            .map_err(|e| format!("journal: {e}"))?
            .ok_or_else(|| {
                format!(
                    "journal: {base} and its numbered variants up to -{} are all taken",
                    naming::MAX_SUFFIX
                )
            })?;
        let name = lock.name().to_string();
        if self.name.is_none() {
            self.name = Some(name.clone());
            self.open = Some(lock);
            Ok((name, None))
        } else {
            Ok((name, Some(lock)))
        }
    }

    /// A conversation never saved that holds no message leaves no journal: it goes, with the
    /// lock of its name (at the end of a run, at `/new` and before a load).
    pub(super) fn drop_empty_journal(&mut self) {
        let empty = !self
            .session
            .entries
            .iter()
            .any(|e| matches!(e, Entry::Message { .. } | Entry::Raw { .. }));
        if self.journal.is_some() && self.base.is_none() && empty {
            if let Some(problem) = self.drop_journal() {
                self.journal_problem = Some(problem);
            }
        }
    }

    /// The changes are saved: the journal goes (and a new one starts at the next change).
    pub(super) fn drop_journal(&mut self) -> Option<String> {
        self.journal_problem = None;
        let j = self.journal.take()?;
        let path = j.file.path().display().to_string();
        let removed = j.file.remove();
        drop(j.own_lock);
        removed
            .err()
            .map(|e| format!("the journal {path} could not be removed: {e}"))
    }
}
