//! Advisory locks on session names.

use super::format::*;
use crate::session::naming::{validate_name, NameError};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::Path;

#[cfg(unix)]
pub(super) fn same_file(a: &fs::Metadata, b: &fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

#[cfg(not(unix))]
pub(super) fn same_file(_: &fs::Metadata, _: &fs::Metadata) -> bool {
    true
}

/// Opens (creating if needed) a lock file without following a link planted at its path.
pub(super) fn open_lock_file(path: &Path) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
    }
    match o.open(path) {
        Ok(f) => return Ok(f),
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
        Err(_) => {}
    }
    let meta = fs::symlink_metadata(path)?;
    if !meta.file_type().is_file() {
        return Err(io::Error::other(format!(
            "lock file {path:?} is not a regular file"
        )));
    }
    let f = OpenOptions::new().read(true).write(true).open(path)?;
    if !same_file(&meta, &f.metadata()?) {
        return Err(io::Error::other(format!(
            "lock file {path:?} changed while it was opened"
        )));
    }
    Ok(f)
}

pub(super) enum Lock {
    Held(File),
    InUse(String),
    Unsupported,
}

pub(super) fn holder_of(f: &File) -> String {
    let mut s = String::new();
    let parsed = f.take(64).read_to_string(&mut s).ok().and_then(|_| {
        let rest = s.trim_end().strip_prefix("pid=")?;
        let (pid, since) = rest.split_once(" since=")?;
        Some((pid.parse::<u32>().ok()?, since.parse::<u64>().ok()?))
    });
    match parsed {
        Some((pid, since)) => format!("pid {pid} since unix time {since}"),
        None => "another process".into(),
    }
}

pub(super) fn acquire_lock(path: &Path) -> io::Result<Lock> {
    let f = open_lock_file(path)?;
    match f.try_lock() {
        Ok(()) => {
            // Best effort: who holds it, for the second writer's message.
            let stamp = format!("pid={} since={}\n", std::process::id(), now_unix());
            if f.set_len(0).is_ok() {
                let mut w = &f;
                let _ = w.write_all(stamp.as_bytes());
            }
            Ok(Lock::Held(f))
        }
        Err(fs::TryLockError::WouldBlock) => Ok(Lock::InUse(holder_of(&f))),
        Err(fs::TryLockError::Error(e)) if e.kind() == io::ErrorKind::Unsupported => {
            Ok(Lock::Unsupported)
        }
        Err(fs::TryLockError::Error(e)) => Err(e),
    }
}

/// A process's claim on one session name, held from the moment the process opens the session
/// (resumes, loads or first saves it) until it lets go of it: an exclusive advisory lock
/// (`flock`) on the hidden file `.NAME.lock` beside the session, which records the holder's pid
/// and start time for the message a second process gets. The kernel drops the lock however the
/// process ends (`kill -9` included), so a lock never goes stale; the small file stays, because
/// removing a lock file races with a process that is opening it.
#[derive(Debug)]
pub struct SessionLock {
    pub(super) name: String,
    /// `None` where the file system offers no locks (saves are then atomic but unguarded).
    pub(super) file: Option<File>,
}

impl SessionLock {
    /// A claim on `name` that holds no lock, for a session that is open where no lock could be
    /// taken (a read-only session directory): saves through it are still atomic.
    pub fn unlocked(name: &str) -> Result<SessionLock, NameError> {
        validate_name(name)?;
        Ok(SessionLock {
            name: name.to_string(),
            file: None,
        })
    }

    /// The session name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether an advisory lock is held (false where none could be taken).
    #[must_use]
    pub fn is_held(&self) -> bool {
        self.file.is_some()
    }
}
