//! Atomic file and directory writes, on `tempfile`: a file is written under a unique temporary
//! name in its own directory, synced, renamed over its final name (`NamedTempFile::persist`),
//! and the directory synced, so a reader sees the old file or the new one, never a part, and a
//! crash leaves at most a temporary file behind. A directory is filled under a unique temporary
//! name beside its final one (`tempfile::TempDir`) and renamed into place whole. Files are
//! readable by their owner only unless asked otherwise; a write dropped before its commit removes what it wrote.
//!
//! Every file or directory k3 replaces goes through here. Session files perform the same steps
//! through a seam that tests fail at each step (`session::store::SaveIo`), on a file from
//! [`temp_file_in`].

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use tempfile::{NamedTempFile, TempDir};

/// Prefix of every temporary name: hidden, and recognisable as ours.
const PREFIX: &str = ".k3-";

/// The directory `path` lives in (`.` for a bare name).
fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Writes `bytes` to `path` atomically, creating the parent directory if needed.
///
/// # Errors
/// Whatever creating, writing, syncing or renaming returned; `path` is then unchanged and the
/// temporary file is removed.
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    std::fs::create_dir_all(parent_of(path))?;
    let mut f = PendingFile::new(path)?;
    f.file().write_all(bytes)?;
    f.commit()
}

/// A file being written under a temporary name beside `path`; [`PendingFile::commit`] puts it
/// in place, dropping it removes it.
pub struct PendingFile {
    tmp: NamedTempFile,
    path: PathBuf,
}

impl PendingFile {
    /// A new, empty temporary file in `path`'s directory (which must exist), readable by its
    /// owner only.
    ///
    /// # Errors
    /// Creating the file failed.
    pub fn new(path: &Path) -> io::Result<Self> {
        Self::with_mode(path, 0o600)
    }

    /// [`PendingFile::new`] for a file others may read: the mode an ordinary new file gets
    /// (0o666 less the umask).
    ///
    /// # Errors
    /// Creating the file failed.
    pub fn shared(path: &Path) -> io::Result<Self> {
        Self::with_mode(path, 0o666)
    }

    fn with_mode(path: &Path, mode: u32) -> io::Result<Self> {
        let mut b = tempfile::Builder::new();
        b.prefix(PREFIX).suffix(".tmp");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            b.permissions(std::fs::Permissions::from_mode(mode));
        }
        #[cfg(not(unix))]
        let _ = mode;
        let tmp = b.tempfile_in(parent_of(path))?;
        Ok(PendingFile {
            tmp,
            path: path.to_path_buf(),
        })
    }

    /// The open file, to write into.
    pub fn file(&mut self) -> &mut File {
        self.tmp.as_file_mut()
    }

    /// Syncs the file, renames it over its final path and syncs the directory.
    ///
    /// # Errors
    /// Syncing or renaming failed; the final path is then unchanged and the temporary file is
    /// removed.
    pub fn commit(self) -> io::Result<()> {
        self.tmp.as_file().sync_all()?;
        self.tmp.persist(&self.path).map_err(|e| e.error)?;
        sync_dir(parent_of(&self.path));
        Ok(())
    }
}

/// A directory being filled under a temporary name beside `path`; [`PendingDir::commit`]
/// renames it into place, dropping it removes it and everything in it.
pub struct PendingDir {
    tmp: TempDir,
    path: PathBuf,
}

impl PendingDir {
    /// A new, empty temporary directory in `path`'s parent (which must exist), with the mode
    /// an ordinary new directory gets (0o777 less the umask).
    ///
    /// # Errors
    /// Creating the directory failed.
    pub fn new(path: &Path) -> io::Result<Self> {
        let mut b = tempfile::Builder::new();
        b.prefix(PREFIX);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            b.permissions(std::fs::Permissions::from_mode(0o777));
        }
        let tmp = b.tempdir_in(parent_of(path))?;
        Ok(PendingDir {
            tmp,
            path: path.to_path_buf(),
        })
    }

    /// The temporary directory, to write into.
    #[must_use]
    pub fn path(&self) -> &Path {
        self.tmp.path()
    }

    /// Renames the directory to its final path (which must be absent or an empty directory)
    /// and syncs the parent directory. The files in it are the writer's to sync.
    ///
    /// # Errors
    /// The rename failed (the final path is then unchanged and the temporary directory
    /// removed).
    pub fn commit(self) -> io::Result<()> {
        std::fs::rename(self.tmp.path(), &self.path)?;
        // Renamed away: nothing is left for the guard to remove.
        let _ = self.tmp.keep();
        sync_dir(parent_of(&self.path));
        Ok(())
    }
}

/// A new file in `dir` named `prefix` followed by six random letters or digits, readable by
/// its owner only, created exclusively (never following a link), kept when dropped: for a
/// writer that performs the steps of [`PendingFile`] itself (the session store's saves, whose
/// steps tests fail one by one).
///
/// # Errors
/// Creating the file failed.
pub fn temp_file_in(dir: &Path, prefix: &str) -> io::Result<(File, PathBuf)> {
    let mut b = tempfile::Builder::new();
    b.prefix(prefix).rand_bytes(6);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        b.permissions(std::fs::Permissions::from_mode(0o600));
    }
    b.tempfile_in(dir)?.keep().map_err(|e| e.error)
}

/// Makes a rename in `dir` durable (best effort: not every file system can sync a directory).
fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    #[cfg(not(unix))]
    let _ = dir;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_whole_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("f.json");
        write(&path, b"first").unwrap();
        write(&path, b"second, longer").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second, longer");
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f.json")]);
    }

    #[test]
    fn a_failed_write_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        write(&path, b"old").unwrap();
        // A directory cannot be replaced by a file: the rename fails, the target stays.
        let target = dir.path().join("d");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("inside"), b"x").unwrap();
        assert!(write(&target, b"new").is_err());
        assert!(target.is_dir());
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn a_directory_appears_whole_or_not_at_all() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("out");
        // Dropped before its commit: nothing is left.
        let d = PendingDir::new(&target).unwrap();
        std::fs::write(d.path().join("a"), b"1").unwrap();
        drop(d);
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
        // Committed: the directory is there with its files, and nothing else.
        let d = PendingDir::new(&target).unwrap();
        std::fs::write(d.path().join("a"), b"1").unwrap();
        d.commit().unwrap();
        assert_eq!(std::fs::read(target.join("a")).unwrap(), b"1");
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
        // A non-empty directory in the way is not replaced, and the new one is removed.
        let d = PendingDir::new(&target).unwrap();
        std::fs::write(d.path().join("b"), b"2").unwrap();
        assert!(d.commit().is_err());
        assert!(!target.join("b").exists());
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_pending_file_dropped_before_its_commit_leaves_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        write(&path, b"old").unwrap();
        let mut f = PendingFile::new(&path).unwrap();
        f.file().write_all(b"new").unwrap();
        drop(f);
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
