//! The journal: an append-only file beside a session (`NAME.k3journal` in the session
//! directory) that keeps every change made since the session was last saved or loaded, so that a
//! crash, `kill -9`, a signal or a closed terminal loses nothing. Written only by the process
//! that holds the session's lock; fsynced after each record. This module owns the framing; what
//! a record says is the caller's (the chat worker writes JSON).
//!
//! # File format, version 1
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 0 | 8 | magic `89 4B 33 4A 52 4E 4C 0A` (`\x89K3JRNL\n`) |
//!
//! Then records, each `length u32 · CRC32 u32 · payload`, little-endian, where the CRC covers
//! the four length bytes and the payload. The first record is the header. A record that runs
//! past the end of the file or fails its CRC is *torn* (a write cut short by a crash): it and
//! anything after it are ignored, with a notice, and the records before it are used.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

/// First eight bytes of every journal.
pub const MAGIC: [u8; 8] = *b"\x89K3JRNL\n";
/// File-name extension of journals inside the session directory.
pub const EXTENSION: &str = "k3journal";
/// Largest record accepted (a record holds one conversation's transcript).
pub const MAX_RECORD: u32 = 64 << 20;
/// Largest journal read.
pub const MAX_JOURNAL: u64 = 1 << 30;

const RECORD_HEAD: usize = 8;

/// A journal that cannot be used at all (a torn tail is not an error: see [`Recovered`]).
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The file could not be read.
    #[error("journal {path}: {source}")]
    Io {
        /// The journal.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The first bytes are not a journal's.
    #[error("journal {path}: not a k3 journal (the first 8 bytes are {found:02x?})")]
    Magic {
        /// The journal.
        path: PathBuf,
        /// What was found.
        found: Vec<u8>,
    },
    /// The file is larger than any journal k3 writes.
    #[error("journal {path}: {len} bytes is more than the limit of {MAX_JOURNAL}")]
    TooLarge {
        /// The journal.
        path: PathBuf,
        /// Its size.
        len: u64,
    },
}

/// Where the usable records end and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Torn {
    /// Byte offset of the first record that was ignored.
    pub at: u64,
    /// Bytes ignored from there to the end of the file.
    pub bytes: u64,
    /// What was wrong with it.
    pub why: String,
}

/// The records of a journal, in order, and a torn tail if there was one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recovered {
    /// Every complete record (the header first).
    pub records: Vec<Vec<u8>>,
    /// The tail that was ignored.
    pub torn: Option<Torn>,
    /// Bytes of the file that hold complete records (the magic included).
    pub good_len: u64,
}

fn record_crc(len: [u8; 4], payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&len);
    h.update(payload);
    h.finalize()
}

/// Split journal bytes into records. `Err` holds the first 8 bytes when the magic is wrong.
/// Nothing is allocated beyond the records themselves, each checked against what is left of
/// the input before it is copied.
pub fn decode(bytes: &[u8]) -> Result<Recovered, Vec<u8>> {
    if bytes.len() < MAGIC.len() || bytes[..MAGIC.len()] != MAGIC {
        return Err(bytes[..bytes.len().min(MAGIC.len())].to_vec());
    }
    let mut at = MAGIC.len();
    let mut records = Vec::new();
    let torn = loop {
        let rest = &bytes[at..];
        if rest.is_empty() {
            break None;
        }
        let tear = |why: String| {
            Some(Torn {
                at: at as u64,
                bytes: rest.len() as u64,
                why,
            })
        };
        if rest.len() < RECORD_HEAD {
            break tear(format!(
                "{} bytes, shorter than a record header",
                rest.len()
            ));
        }
        let len_bytes = [rest[0], rest[1], rest[2], rest[3]];
        let len = u32::from_le_bytes(len_bytes);
        let crc = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
        if len > MAX_RECORD {
            break tear(format!(
                "record length {len} is above the limit {MAX_RECORD}"
            ));
        }
        let Some(payload) = rest.get(RECORD_HEAD..RECORD_HEAD + len as usize) else {
            break tear(format!(
                "record of {len} bytes, only {} left in the file",
                rest.len() - RECORD_HEAD
            ));
        };
        let computed = record_crc(len_bytes, payload);
        if computed != crc {
            break tear(format!(
                "record checksum mismatch (stored {crc:08x}, computed {computed:08x})"
            ));
        }
        records.push(payload.to_vec());
        at += RECORD_HEAD + payload.len();
    };
    Ok(Recovered {
        records,
        good_len: torn.as_ref().map_or(bytes.len() as u64, |t| t.at),
        torn,
    })
}

/// Read the journal at `path`; `None` when there is none.
pub fn read(path: &Path) -> Result<Option<Recovered>, JournalError> {
    let io_err = |source| JournalError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(e)),
    };
    if !meta.is_file() {
        return Err(io_err(io::Error::other("not a regular file")));
    }
    if meta.len() > MAX_JOURNAL {
        return Err(JournalError::TooLarge {
            path: path.to_path_buf(),
            len: meta.len(),
        });
    }
    let bytes = crate::stream::read_capped(path, MAX_JOURNAL).map_err(io_err)?;
    decode(&bytes)
        .map(Some)
        .map_err(|found| JournalError::Magic {
            path: path.to_path_buf(),
            found,
        })
}

/// One record's bytes as written.
fn frame(payload: &[u8]) -> io::Result<Vec<u8>> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|&l| l <= MAX_RECORD)
        .ok_or_else(|| io::Error::other(format!("record of {} bytes", payload.len())))?;
    let len_bytes = len.to_le_bytes();
    let mut out = Vec::with_capacity(RECORD_HEAD + payload.len());
    out.extend_from_slice(&len_bytes);
    out.extend_from_slice(&record_crc(len_bytes, payload).to_le_bytes());
    out.extend_from_slice(payload);
    Ok(out)
}

fn sync_dir(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => File::open(dir)?.sync_all(),
        _ => Ok(()),
    }
}

/// A journal open for appending.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: File,
    len: u64,
}

impl Journal {
    /// Create the journal at `path` (replacing one there) with `header` as its first record,
    /// durable (file and directory fsynced) before this returns.
    pub fn create(path: &Path, header: &[u8]) -> io::Result<Journal> {
        let mut opts = OpenOptions::new();
        opts.write(true).create(true).truncate(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.mode(0o600)
                .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32);
        }
        let file = opts.open(path)?;
        let mut j = Journal {
            path: path.to_path_buf(),
            file,
            len: 0,
        };
        j.write_at_end(&MAGIC)?;
        j.append(header)?;
        sync_dir(path)?;
        Ok(j)
    }

    /// Open the journal at `path` to append after its first `good_len` bytes (what
    /// [`decode`] found complete; a torn tail is cut off).
    pub fn reopen(path: &Path, good_len: u64) -> io::Result<Journal> {
        let mut opts = OpenOptions::new();
        opts.write(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32);
        }
        let file = opts.open(path)?;
        if file.metadata()?.len() != good_len {
            file.set_len(good_len)?;
            file.sync_all()?;
        }
        Ok(Journal {
            path: path.to_path_buf(),
            file,
            len: good_len,
        })
    }

    fn write_at_end(&mut self, bytes: &[u8]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.write_all_at(bytes, self.len)?;
        self.len += bytes.len() as u64;
        Ok(())
    }

    /// Append one record and fsync it. On failure the file is cut back to the records before
    /// (best effort: a partial record left by a failed cut is torn and ignored when read).
    pub fn append(&mut self, payload: &[u8]) -> io::Result<()> {
        let rec = frame(payload)?;
        let before = self.len;
        let done = self.write_at_end(&rec).and_then(|()| self.file.sync_data());
        if done.is_err() {
            self.len = before;
            let _ = self.file.set_len(before);
        }
        done
    }

    /// The journal's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Delete the journal (its changes are saved), durably.
    pub fn remove(self) -> io::Result<()> {
        match fs::remove_file(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        sync_dir(&self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_a_torn_tail_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.k3journal");
        let mut j = Journal::create(&path, b"head").unwrap();
        j.append(b"one").unwrap();
        j.append(b"").unwrap();
        j.append(b"three").unwrap();
        let full = fs::read(&path).unwrap();
        let r = decode(&full).unwrap();
        assert_eq!(
            r.records,
            vec![b"head".to_vec(), b"one".to_vec(), vec![], b"three".to_vec()]
        );
        assert_eq!((r.torn, r.good_len), (None, full.len() as u64));
        // Every cut inside the last record keeps the three before it.
        let last_start = full.len() - (RECORD_HEAD + 5);
        for cut in last_start + 1..full.len() {
            let r = decode(&full[..cut]).unwrap();
            assert_eq!(r.records.len(), 3, "cut at {cut}");
            let torn = r.torn.unwrap();
            assert_eq!(
                (torn.at, r.good_len),
                (last_start as u64, last_start as u64)
            );
        }
        // A flipped payload byte tears that record.
        let mut bad = full.clone();
        *bad.last_mut().unwrap() ^= 1;
        let r = decode(&bad).unwrap();
        assert_eq!(r.records.len(), 3);
        assert!(r.torn.unwrap().why.contains("checksum"));
        // Reopening cuts the torn tail and appends after the good records.
        fs::write(&path, &full[..full.len() - 2]).unwrap();
        let r = read(&path).unwrap().unwrap();
        let mut j = Journal::reopen(&path, r.good_len).unwrap();
        j.append(b"four").unwrap();
        let r = read(&path).unwrap().unwrap();
        assert_eq!(r.records.last().unwrap(), b"four");
        assert_eq!((r.records.len(), r.torn), (4, None));
        j.remove().unwrap();
        assert!(read(&path).unwrap().is_none());
    }

    #[test]
    fn wrong_magic_and_huge_lengths_are_refused_without_allocating() {
        assert!(decode(b"").is_err());
        assert_eq!(
            decode(b"\x89K3SESS\nxx").unwrap_err(),
            b"\x89K3SESS\n".to_vec()
        );
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        b.extend_from_slice(&[0; 4]);
        let r = decode(&b).unwrap();
        assert!(r.records.is_empty());
        assert!(r.torn.unwrap().why.contains("above the limit"));
    }
}
