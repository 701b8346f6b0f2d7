//! Checkpoint shards mapped read-only into memory (the weights a plan keeps resident; off with
//! `K3_MMAP=0`), and
//! the guard that turns a fault on such a mapping into an error exit.
//!
//! A mapped weight is used in place: no copy into the heap, a page cache shared with every
//! other process that maps or reads the file, and a second start that finds the bytes
//! already in memory. The hazard of a mapping is a file that changes under it: when a shard
//! is truncated while mapped, touching a page past its new end raises `SIGBUS`. Sizes are
//! checked against the headers when the checkpoint is opened; after that, a `SIGBUS` whose
//! address lies in a registered mapping prints one line naming the problem and exits with
//! status 3 (a checkpoint that changed, docs/reliability.md#exit-codes) instead of dumping core. A `SIGBUS`
//! anywhere else keeps its default action.

#![allow(unsafe_code)]

use std::fs::File;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;

/// Mappings the guard can watch at once; a shard beyond that is read instead of mapped.
const SLOTS: usize = 4096;

/// Registered ranges: `[start, end)` per slot; `end == 0` is a free slot.
static STARTS: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
static ENDS: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
static INSTALL: Once = Once::new();

const MESSAGE: &[u8] = b"\nk3: a mapped model file shrank or became unreadable while in use \
(was the checkpoint changed on disk?); stopping. Restart k3 once the files are complete \
(k3 verify checks them).\n";

/// A shard mapped read-only, registered with the fault guard for as long as it lives.
pub struct MappedFile {
    map: memmap2::Mmap,
    slot: usize,
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MappedFile({} bytes)", self.map.len())
    }
}

impl MappedFile {
    /// Map `file` (opened read-only; `expected_len` bytes long when the checkpoint was
    /// opened). `None` when the file no longer has that length, the mapping fails, or the
    /// guard has no free slot: the caller reads instead.
    pub fn map(file: &File, expected_len: u64) -> Option<MappedFile> {
        let len = file.metadata().ok()?.len();
        if len != expected_len || len == 0 {
            return None;
        }
        install_guard();
        // SAFETY: the file is open read-only and k3 never writes it. Another process may
        // truncate it while it is mapped; a touch past the new end then raises SIGBUS, which
        // the guard registered below turns into an error exit (see the module documentation)
        // rather than undefined behaviour reaching safe code: no reference into the mapping
        // outlives the fault.
        let map = unsafe { memmap2::Mmap::map(file) }.ok()?;
        let start = map.as_ptr() as usize;
        let end = start + map.len();
        let slot = (0..SLOTS).find(|&s| {
            ENDS[s]
                .compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })?;
        STARTS[slot].store(start, Ordering::Release);
        ENDS[slot].store(end, Ordering::Release);
        Some(MappedFile { map, slot })
    }

    /// Fault in `off..off + len` now (reading it from disk if it is not cached), so the
    /// forward pass never waits on a page fault.
    pub fn populate(&self, off: usize, len: usize) {
        let page = 4096;
        let start = off - off % page;
        let end = (off + len).min(self.map.len());
        if end > start {
            let _ = self
                .map
                .advise_range(memmap2::Advice::PopulateRead, start, end - start);
        }
    }

    /// Unmap the whole pages of `off..off + len` from this process (a weight no longer
    /// held): resident memory goes down; the page cache keeps them, and a later touch maps
    /// them again.
    pub fn release(&self, off: usize, len: usize) {
        let page = 4096;
        let start = off.next_multiple_of(page);
        let end = (off + len).min(self.map.len()) / page * page;
        if end > start {
            // SAFETY: the range lies inside this read-only file mapping, and no reference to
            // it is used again: the weight that held it is being dropped. Another weight
            // sharing one of these pages would only fault it in again from the page cache
            // (only whole pages of this range are released, so that does not happen).
            let _ = unsafe {
                self.map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start,
                    end - start,
                )
            };
        }
    }

    /// The mapped bytes.
    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        &self.map
    }

    /// Length of the mapping.
    #[must_use]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the mapping is empty (never: empty files are not mapped).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        ENDS[self.slot].store(usize::MAX, Ordering::Release);
        STARTS[self.slot].store(0, Ordering::Release);
        ENDS[self.slot].store(0, Ordering::Release);
    }
}

fn install_guard() {
    INSTALL.call_once(|| {
        // SAFETY: a zeroed `sigaction` is a valid value to fill in; the handler below only
        // reads atomics and calls async-signal-safe functions (`write`, `_exit`, `signal`).
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_sigbus as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&raw mut act.sa_mask);
            libc::sigaction(libc::SIGBUS, &raw const act, std::ptr::null_mut());
        }
    });
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for a handler installed with SA_SIGINFO.
    let addr = unsafe { (*info).si_addr() } as usize;
    let ours = (0..SLOTS).any(|s| {
        let end = ENDS[s].load(Ordering::Acquire);
        end != 0 && end != usize::MAX && addr >= STARTS[s].load(Ordering::Acquire) && addr < end
    });
    // SAFETY: `write`, `_exit` and `signal` are async-signal-safe.
    unsafe {
        if ours {
            libc::write(2, MESSAGE.as_ptr().cast(), MESSAGE.len());
            libc::_exit(3);
        }
        // Not a mapped checkpoint: the default action, on the fault's retry.
        libc::signal(libc::SIGBUS, libc::SIG_DFL);
    }
}
