//! Advisory locks on session names.

use super::format::*;
use crate::session::naming::{validate_name, NameError};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

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
    Held(HeldLock),
    InUse(String),
    Unsupported,
}

/// An advisory lock held on a lock file. The file is removed when the lock is let go (so lock
/// files do not pile up beside the sessions): it is unlinked while the lock is still held, and
/// a process that opened it before that finds, once it has the lock, that the path no longer
/// names its file ([`acquire_lock`] then starts again on a new one).
#[derive(Debug)]
pub(super) struct HeldLock {
    path: PathBuf,
    file: File,
}

impl Drop for HeldLock {
    fn drop(&mut self) {
        let ours = match (fs::symlink_metadata(&self.path), self.file.metadata()) {
            (Ok(at_path), Ok(held)) => same_file(&at_path, &held),
            _ => false,
        };
        if ours {
            let _ = fs::remove_file(&self.path);
        }
        // The lock goes with the file descriptor, after the unlink.
    }
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

/// Times a lock file removed by its holder between our open and our lock is opened again.
const LOCK_ATTEMPTS: usize = 64;

pub(super) fn acquire_lock(path: &Path) -> io::Result<Lock> {
    for _ in 0..LOCK_ATTEMPTS {
        let f = open_lock_file(path)?;
        match f.try_lock() {
            Ok(()) => {
                // The holder before us may have removed the file after we opened it: the lock
                // is on the file the path names, or it is no lock at all.
                let current = match fs::symlink_metadata(path) {
                    Ok(m) => same_file(&m, &f.metadata()?),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => false,
                    Err(e) => return Err(e),
                };
                if !current {
                    continue;
                }
                // Best effort: who holds it, for the second writer's message.
                let stamp = format!("pid={} since={}\n", std::process::id(), now_unix());
                if f.set_len(0).is_ok() {
                    let mut w = &f;
                    let _ = w.write_all(stamp.as_bytes());
                }
                return Ok(Lock::Held(HeldLock {
                    path: path.to_path_buf(),
                    file: f,
                }));
            }
            Err(fs::TryLockError::WouldBlock) => return Ok(Lock::InUse(holder_of(&f))),
            Err(fs::TryLockError::Error(e)) if e.kind() == io::ErrorKind::Unsupported => {
                return Ok(Lock::Unsupported)
            }
            Err(fs::TryLockError::Error(e)) => return Err(e),
        }
    }
    Err(io::Error::other(format!(
        "lock file {} was replaced {LOCK_ATTEMPTS} times while it was being locked",
        path.display()
    )))
}

/// A process's claim on one session name, held from the moment the process opens the session
/// (resumes, loads or first saves it) until it lets go of it: an exclusive advisory lock
/// (`flock`) on the hidden file `.NAME.lock` beside the session, which records the holder's pid
/// and start time for the message a second process gets. The kernel drops the lock however the
/// process ends (`kill -9` included), so a lock never goes stale; the file is removed when the
/// claim is let go (see [`HeldLock`]; only one left by a killed process stays, and is reused).
#[derive(Debug)]
pub struct SessionLock {
    pub(super) name: String,
    /// `None` where the file system offers no locks (saves are then atomic but unguarded).
    pub(super) file: Option<HeldLock>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_file_goes_with_its_lock_and_a_waiter_on_the_old_file_starts_again() {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let path = dir.path().join(".s.lock");
        let Ok(Lock::Held(first)) = acquire_lock(&path) else {
            panic!("the first lock");
        };
        assert!(path.is_file());
        // A second claim while it is held is refused, naming the holder.
        match acquire_lock(&path) {
            Ok(Lock::InUse(holder)) => {
                assert!(
                    holder.contains(&format!("pid {}", std::process::id())),
                    "{holder}"
                )
            }
            _ => panic!("a second lock on a held file"),
        }
        // A process that opened the file before the holder let go of it.
        let stale = open_lock_file(&path).expect("open the lock file");
        drop(first);
        assert!(
            !path.exists(),
            "the lock file stays after its lock is let go"
        );
        // Its lock would be on a file no longer at the path: acquire_lock makes a new one.
        assert!(stale.try_lock().is_ok());
        let Ok(Lock::Held(second)) = acquire_lock(&path) else {
            panic!("the lock after the first was let go");
        };
        assert!(path.is_file());
        drop(stale);
        drop(second);
        assert!(!path.exists());
    }
}
