//! The directory of session files: atomic saves, loads, listing, stale temporary files.

use super::decode::*;
use super::encode::*;
use super::error::*;
use super::format::*;
use super::lock::*;
use crate::session::naming::{validate_name, NameError};
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::engine::config::ModelConfig;

// ---------------------------------------------------------------------------------------------
// File operations of a save
// ---------------------------------------------------------------------------------------------

/// The file operations a save performs, in order: create the temporary file, write it (one or
/// more calls), fsync it, rename it over the session file, fsync the directory; `remove` deletes
/// the temporary file after a failure. [`OsIo`] is the real implementation; tests substitute one
/// that fails or stops at any step.
pub trait SaveIo {
    /// An open temporary file.
    type File;
    /// Creates a new file in `dir` whose name is `prefix` and a unique tail of letters and
    /// digits (never following a link), readable by the owner only; its path and the open file.
    fn create_temp(&mut self, dir: &Path, prefix: &str) -> io::Result<(PathBuf, Self::File)>;
    /// Writes all of `buf`.
    fn write(&mut self, file: &mut Self::File, buf: &[u8]) -> io::Result<()>;
    /// Flushes the file's data and metadata to the device.
    fn sync(&mut self, file: &mut Self::File) -> io::Result<()>;
    /// Atomically replaces `to` (a link there is replaced, not followed) with `from`.
    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()>;
    /// Flushes the directory entry changes of `dir`.
    fn sync_dir(&mut self, dir: &Path) -> io::Result<()>;
    /// Deletes `path`.
    fn remove(&mut self, path: &Path) -> io::Result<()>;
}

/// The operating system's file operations.
#[derive(Clone, Copy, Debug, Default)]
pub struct OsIo;

impl SaveIo for OsIo {
    type File = File;

    fn create_temp(&mut self, dir: &Path, prefix: &str) -> io::Result<(PathBuf, File)> {
        let (file, path) = crate::stream::atomic::temp_file_in(dir, prefix)?;
        Ok((path, file))
    }

    fn write(&mut self, file: &mut File, buf: &[u8]) -> io::Result<()> {
        file.write_all(buf)
    }

    fn sync(&mut self, file: &mut File) -> io::Result<()> {
        file.sync_all()
    }

    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn sync_dir(&mut self, dir: &Path) -> io::Result<()> {
        #[cfg(unix)]
        {
            File::open(dir)?.sync_all()
        }
        #[cfg(not(unix))]
        {
            let _ = dir;
            Ok(())
        }
    }

    fn remove(&mut self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }
}

/// `Write` over a [`SaveIo`] file, so the encoder's buffered output goes through the trait.
pub(super) struct IoWriter<'a, I: SaveIo> {
    pub(super) io: &'a mut I,
    pub(super) file: &'a mut I::File,
}

impl<I: SaveIo> Write for IoWriter<'_, I> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.io.write(self.file, buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The store
// ---------------------------------------------------------------------------------------------

/// A journal as [`SessionStore::journals`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JournalInfo {
    /// The conversation's name (from the file name).
    pub name: String,
    /// When the journal was last written, Unix seconds.
    pub modified_unix: u64,
    /// Its size in bytes.
    pub bytes: u64,
}

/// One session as `list` shows it, read from the header and summary only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionInfo {
    /// Session name (from the file name).
    pub name: String,
    /// When it was saved, Unix seconds.
    pub saved_unix: u64,
    /// Completed turns.
    pub turns: u32,
    /// Interaction mode.
    pub mode: String,
    /// File size.
    pub bytes: u64,
    /// Positions the state covers.
    pub positions: u64,
    /// Bytes each further position adds (token id plus MLA cache rows); 0 with no positions.
    pub bytes_per_position: u64,
    /// The model it was saved with.
    pub identity: Option<ModelIdentity>,
    /// Why the header or summary could not be read, if so (the other fields are then 0).
    pub problem: Option<String>,
}

/// A directory of session files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionStore {
    pub(super) dir: PathBuf,
}

pub(super) fn sessions_dir_from(data_dir_env: Option<OsString>) -> PathBuf {
    let base = match data_dir_env {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => directories::ProjectDirs::from("", "", "k3")
            .map_or_else(|| PathBuf::from(".k3"), |p| p.data_dir().to_path_buf()),
    };
    base.join("sessions")
}

/// The session name and writer pid of one of our temporary files.
pub(super) fn parse_temp_name(file_name: &str) -> Option<(&str, u32)> {
    let rest = file_name.strip_prefix('.')?;
    let marker = format!(".{EXTENSION}.tmp.");
    let (name, tail) = rest.split_once(marker.as_str())?;
    let (pid, seq) = tail.split_once('.')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let tail = !seq.is_empty() && seq.bytes().all(|b| b.is_ascii_alphanumeric());
    if !digits(pid) || !tail || validate_name(name).is_err() {
        return None;
    }
    Some((name, pid.parse().ok()?))
}

impl SessionStore {
    /// A store over `dir` (created on the first save).
    #[must_use]
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        SessionStore { dir: dir.into() }
    }

    /// The per-user default: `$K3_DATA_DIR/sessions` when that variable is set and non-empty,
    /// else the platform data directory for `k3` plus `sessions` (on Linux
    /// `~/.local/share/k3/sessions`); `.k3/sessions` under the working directory when no home
    /// directory can be determined.
    #[must_use]
    pub fn default_dir() -> PathBuf {
        sessions_dir_from(std::env::var_os(DATA_DIR_ENV))
    }

    /// The store's directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file a session of this name lives in.
    pub fn path_of(&self, name: &str) -> Result<PathBuf, NameError> {
        validate_name(name)?;
        Ok(self.dir.join(format!("{name}.{EXTENSION}")))
    }

    /// The journal of session `name` (see [`crate::session::journal`]): unsaved changes, kept
    /// beside the session file.
    pub fn journal_path(&self, name: &str) -> Result<PathBuf, NameError> {
        validate_name(name)?;
        Ok(self
            .dir
            .join(format!("{name}.{}", crate::session::journal::EXTENSION)))
    }

    /// Whether session `name` has a journal (unsaved changes of a process that ended).
    #[must_use]
    pub fn has_journal(&self, name: &str) -> bool {
        self.journal_path(name)
            .is_ok_and(|p| fs::symlink_metadata(p).is_ok())
    }

    pub(super) fn lock_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!(".{name}.lock"))
    }

    /// Saves `rec` under `rec.name` atomically; returns the bytes written.
    pub fn save(&self, rec: &SessionRecord) -> Result<u64, SaveError> {
        self.save_with(rec, &mut OsIo)
    }

    /// [`SessionStore::save`] through the given file operations: lock, temporary file in the
    /// same directory, write, fsync, rename, fsync of the directory. On failure the temporary
    /// file is removed and the previous session file is left as it was (unless the failure is
    /// the directory fsync after the rename, which the error reports).
    pub fn save_with<I: SaveIo>(&self, rec: &SessionRecord, io: &mut I) -> Result<u64, SaveError> {
        self.save_inner(rec, None, io)
    }

    /// [`SessionStore::save`] for a process that holds the session's lock (see
    /// [`SessionStore::lock`]): the save goes through that lock instead of taking its own.
    /// A lock on another name is not used; the save then takes its own as `save` does.
    pub fn save_locked(&self, rec: &SessionRecord, lock: &SessionLock) -> Result<u64, SaveError> {
        self.save_inner(rec, Some(lock), &mut OsIo)
    }

    /// [`SessionStore::save_locked`] through the given file operations.
    pub fn save_locked_with<I: SaveIo>(
        &self,
        rec: &SessionRecord,
        lock: &SessionLock,
        io: &mut I,
    ) -> Result<u64, SaveError> {
        self.save_inner(rec, Some(lock), io)
    }

    pub(super) fn save_inner<I: SaveIo>(
        &self,
        rec: &SessionRecord,
        held: Option<&SessionLock>,
        io: &mut I,
    ) -> Result<u64, SaveError> {
        let target = self.path_of(&rec.name)?;
        let name = rec.name.clone();
        let plan = plan_record(rec).map_err(|problem| SaveError::Record {
            name: name.clone(),
            problem,
        })?;
        let need = plan.total;
        let fail = |step: SaveStep, replaced: bool, source: io::Error| SaveError::Io {
            name: name.clone(),
            step,
            need,
            replaced,
            source,
        };
        let mut db = fs::DirBuilder::new();
        db.recursive(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::DirBuilderExt;
            db.mode(0o700);
        }
        db.create(&self.dir)
            .map_err(|e| fail(SaveStep::CreateDir, false, e))?;
        let held = held.filter(|l| l.name == rec.name);
        let _lock = match held {
            Some(_) => None,
            None => match acquire_lock(&self.lock_path(&rec.name)) {
                Ok(Lock::Held(f)) => Some(f),
                Ok(Lock::Unsupported) => None,
                Ok(Lock::InUse(holder)) => {
                    return Err(SaveError::InUse {
                        name: name.clone(),
                        holder,
                    })
                }
                Err(e) => return Err(fail(SaveStep::Lock, false, e)),
            },
        };

        let (tmp, mut file) = self
            .create_temp(&rec.name, io)
            .map_err(|e| fail(SaveStep::CreateTemp, false, e))?;
        let written = {
            let mut w = IoWriter {
                io: &mut *io,
                file: &mut file,
            };
            write_planned(rec, &plan, &mut w)
        };
        let synced = match written {
            Ok(_) => io.sync(&mut file).map_err(|e| (SaveStep::SyncFile, e)),
            Err(e) => Err((SaveStep::Write, e)),
        };
        drop(file);
        let renamed =
            synced.and_then(|()| io.rename(&tmp, &target).map_err(|e| (SaveStep::Rename, e)));
        if let Err((step, e)) = renamed {
            // Never retry an fsync or a rename; drop the partial file and keep the old one.
            let _ = io.remove(&tmp);
            return Err(fail(step, false, e));
        }
        io.sync_dir(&self.dir)
            .map_err(|e| fail(SaveStep::SyncDir, true, e))?;
        Ok(need)
    }

    /// Takes the lock of session `name` for as long as the returned claim lives (see
    /// [`SessionLock`]), creating the session directory if needed. Refused with the holder's pid
    /// when another process has the session open; where the file system has no locks the claim
    /// holds none.
    pub fn lock(&self, name: &str) -> Result<SessionLock, LockError> {
        validate_name(name)?;
        let io_err = |step, source| LockError::Io {
            name: name.to_string(),
            step,
            source,
        };
        let mut db = fs::DirBuilder::new();
        db.recursive(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::DirBuilderExt;
            db.mode(0o700);
        }
        db.create(&self.dir)
            .map_err(|e| io_err(SaveStep::CreateDir, e))?;
        let file = match acquire_lock(&self.lock_path(name)) {
            Ok(Lock::Held(f)) => Some(f),
            Ok(Lock::Unsupported) => None,
            Ok(Lock::InUse(holder)) => {
                return Err(LockError::InUse {
                    name: name.to_string(),
                    holder,
                })
            }
            Err(e) => return Err(io_err(SaveStep::Lock, e)),
        };
        Ok(SessionLock {
            name: name.to_string(),
            file,
        })
    }

    /// Claims the first free name of `base`, `base-2`, … `base-999` (see
    /// [`crate::session::naming`]); `None` when all are taken. Free means that no session file
    /// or journal of that name exists and no other process has it locked. The lock is taken
    /// before the name is checked, so two processes never pick the same one.
    pub fn claim_new(&self, base: &str) -> Result<Option<SessionLock>, LockError> {
        use crate::session::naming::{with_suffix, MAX_SUFFIX};
        validate_name(&with_suffix(base, MAX_SUFFIX))?;
        for k in 1..=MAX_SUFFIX {
            let name = with_suffix(base, k);
            match self.lock(&name) {
                Ok(lock) if !self.exists(&name) && !self.has_journal(&name) => {
                    return Ok(Some(lock))
                }
                Ok(_) | Err(LockError::InUse { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Whether something (a session file, or anything else) is at session `name`'s path.
    #[must_use]
    pub fn exists(&self, name: &str) -> bool {
        self.path_of(name)
            .is_ok_and(|p| fs::symlink_metadata(p).is_ok())
    }

    pub(super) fn create_temp<I: SaveIo>(
        &self,
        name: &str,
        io: &mut I,
    ) -> io::Result<(PathBuf, I::File)> {
        let prefix = format!(".{name}.{EXTENSION}.tmp.{}.", std::process::id());
        io.create_temp(&self.dir, &prefix)
    }

    /// Loads the session `name` and checks it against the current model (see [`decode`]). The
    /// returned record's `name` is `name` (the file may have been copied from another name). A
    /// symbolic link or other non-regular file at the session's path is refused.
    pub fn load(
        &self,
        name: &str,
        expect: &ModelConfig,
        identity: &ModelIdentity,
    ) -> Result<SessionRecord, LoadError> {
        let path = self.path_of(name)?;
        let (file, len) = self.open_regular(name, &path)?;
        let mut r = io::BufReader::with_capacity(IO_CHUNK, file);
        let mut rec = decode_labeled(&mut r, len, expect, identity, name)?;
        rec.name = name.to_string();
        Ok(rec)
    }

    /// Open the session file, checking it is a regular file and not a link. A save that
    /// renames a new version into place between the check and the open is retried: the
    /// reader then sees the new, complete file.
    pub(super) fn open_regular(&self, name: &str, path: &Path) -> Result<(File, u64), LoadError> {
        let mut attempt = 0;
        loop {
            match self.open_regular_once(name, path) {
                Err(LoadError::NotRegular { what, .. })
                    if what.contains("replaced") && attempt < 8 =>
                {
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    pub(super) fn open_regular_once(
        &self,
        name: &str,
        path: &Path,
    ) -> Result<(File, u64), LoadError> {
        let io_err = |source| LoadError::Io {
            name: name.to_string(),
            source,
        };
        let not_regular = |what| LoadError::NotRegular {
            name: name.to_string(),
            path: path.to_path_buf(),
            what,
        };
        let meta = match fs::symlink_metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(LoadError::NotFound {
                    name: name.to_string(),
                    path: path.to_path_buf(),
                })
            }
            Err(e) => return Err(io_err(e)),
        };
        if meta.file_type().is_symlink() {
            return Err(not_regular("a symbolic link"));
        }
        if !meta.is_file() {
            return Err(not_regular("not a regular file"));
        }
        let file = File::open(path).map_err(io_err)?;
        let fmeta = file.metadata().map_err(io_err)?;
        if !fmeta.is_file() || !same_file(&meta, &fmeta) {
            return Err(not_regular("a file that was replaced while it was opened"));
        }
        Ok((file, fmeta.len()))
    }

    /// Every session file in the store, newest first, read from headers and summaries only.
    /// A file that cannot be read is listed with `problem` set. A missing directory is empty.
    pub fn list(&self) -> io::Result<Vec<SessionInfo>> {
        let mut out: Vec<SessionInfo> = self
            .named_entries(EXTENSION)?
            .iter()
            .map(|(name, _)| self.info(name))
            .collect();
        out.sort_by(|a, b| {
            b.saved_unix
                .cmp(&a.saved_unix)
                .then_with(|| a.name.cmp(&b.name))
        });
        Ok(out)
    }

    /// Every journal in the store (the unsaved changes of a conversation: all of it for one
    /// never saved), newest first by the time it was last written. A missing directory has
    /// none.
    pub fn journals(&self) -> io::Result<Vec<JournalInfo>> {
        let mut out = Vec::new();
        for (name, path) in self.named_entries(crate::session::journal::EXTENSION)? {
            let Ok(meta) = fs::symlink_metadata(&path) else {
                continue; // removed meanwhile
            };
            if !meta.is_file() {
                continue;
            }
            let modified_unix = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs());
            out.push(JournalInfo {
                name,
                modified_unix,
                bytes: meta.len(),
            });
        }
        out.sort_by(|a, b| {
            b.modified_unix
                .cmp(&a.modified_unix)
                .then_with(|| a.name.cmp(&b.name))
        });
        Ok(out)
    }

    /// The store's files named `NAME.extension` with a valid NAME: (NAME, path), in directory
    /// order. A missing directory has none.
    fn named_entries(&self, extension: &str) -> io::Result<Vec<(String, PathBuf)>> {
        let rd = match fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let suffix = format!(".{extension}");
        let mut out = Vec::new();
        for entry in rd {
            let entry = entry?;
            let file_name = entry.file_name();
            if let Some(name) = file_name
                .to_str()
                .and_then(|f| f.strip_suffix(suffix.as_str()))
                .filter(|n| validate_name(n).is_ok())
            {
                out.push((name.to_string(), entry.path()));
            }
        }
        Ok(out)
    }

    pub(super) fn info(&self, name: &str) -> SessionInfo {
        let mut info = SessionInfo {
            name: name.to_string(),
            saved_unix: 0,
            turns: 0,
            mode: String::new(),
            bytes: 0,
            positions: 0,
            bytes_per_position: 0,
            identity: None,
            problem: None,
        };
        let path = self.dir.join(format!("{name}.{EXTENSION}"));
        let (file, len) = match self.open_regular(name, &path) {
            Ok(x) => x,
            Err(e) => {
                info.problem = Some(e.to_string());
                return info;
            }
        };
        info.bytes = len;
        let mut r = io::BufReader::with_capacity(4096, file);
        let mut d = Decoder::new(&mut r, len);
        let read = d
            .header(len)
            .and_then(|h| Ok((h, d.identity()?, d.summary()?)));
        match read {
            Ok((h, id, (_, summary))) => {
                info.saved_unix = h.saved;
                info.turns = summary.turns;
                info.mode = summary.mode;
                info.positions = h.n_pos;
                info.bytes_per_position = h.bpp;
                info.identity = Some(id);
            }
            Err(Fail::Refused(r)) => info.problem = Some(r.to_string()),
            Err(Fail::Io(e)) => info.problem = Some(format!("read failed: {e}")),
            Err(Fail::NoMemory(b)) => info.problem = Some(format!("cannot allocate {b} bytes")),
        }
        info
    }

    /// Deletes temporary files left by interrupted saves (a crash or kill during a save) and
    /// returns how many were removed. A temporary file whose session is locked by a running
    /// save is left alone.
    pub fn remove_stale_temps(&self) -> io::Result<usize> {
        let rd = match fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(e),
        };
        let mut removed = 0;
        for entry in rd {
            let entry = entry?;
            let file_name = entry.file_name();
            let Some((name, pid)) = file_name.to_str().and_then(parse_temp_name) else {
                continue;
            };
            let _guard = match acquire_lock(&self.lock_path(name))? {
                Lock::Held(f) => Some(f),
                Lock::InUse(_) => continue,
                Lock::Unsupported if pid == std::process::id() => continue,
                Lock::Unsupported => None,
            };
            match fs::remove_file(entry.path()) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(removed)
    }
}
