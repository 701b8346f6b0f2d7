//! The expert slot arena: the memory of the routed-expert cache, mapped and faulted in when
//! the plan is made rather than page by page inside the forward pass.
//!
//! One anonymous mapping per growth step (a *segment*), 2 MiB-aligned and advised for
//! transparent huge pages, is carved into fixed-size slots: each slot holds the aligned read
//! window of the largest expert, back to back, so every 2 MiB page of a segment but its last
//! can be a huge page (slots are not rounded up to 2 MiB: that would cost up to 2 MiB per
//! expert). Slots are numbered across segments; those below [`Arena::slots`] are usable.
//!
//! An expert read takes a free slot ([`Arena::take`]: a free-list pop under a lock held for
//! nothing else) and its bytes give the slot back when dropped. A smaller plan retires the
//! slots above its count: free ones are released to the system at once (`MADV_DONTNEED`),
//! live ones when their expert is dropped or moved into a slot below the count
//! (`bytes::rehome`), so resident memory follows the budget down. A larger plan
//! faults in the retired slots again and maps a new segment for the rest.

#![allow(unsafe_code)]

use serde::Serialize;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Page size the slots are aligned to (the `O_DIRECT` requirement of 4Kn devices).
pub const PAGE: usize = 4096;

/// A transparent huge page; segments start on this boundary.
pub const HUGE_PAGE: usize = 2 << 20;

/// Bytes of one slot for experts of `expert_bytes`: the page-aligned window a direct read of
/// an expert at any file offset fills (its length rounded up to pages, plus the lead of at
/// most one page before an unaligned start).
#[must_use]
pub fn slot_bytes(expert_bytes: u64) -> u64 {
    expert_bytes.next_multiple_of(PAGE as u64) + PAGE as u64
}

/// How the arena's memory was faulted in when the plan was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Prefault {
    /// Nothing faulted in yet (no slot).
    #[default]
    None,
    /// `MADV_POPULATE_WRITE` (Linux 5.14 and later): the kernel faulted every page in.
    Populate,
    /// One byte written per 4 KiB page (where `MADV_POPULATE_WRITE` was refused).
    Touch,
}

/// The arena's figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ArenaStats {
    /// Bytes of one slot.
    pub slot_bytes: u64,
    /// Usable slots (the plan's expert slots plus room for reads in flight).
    pub slots: u64,
    /// Slots holding an expert or a read now.
    pub in_use: u64,
    /// How the slots were faulted in the last time the plan grew the arena.
    pub prefault: Prefault,
    /// Resident bytes of the arena's mappings (`Rss` in `/proc/self/smaps`), measured when
    /// the plan was last applied.
    pub resident_bytes: u64,
    /// Of those, bytes in transparent huge pages (`AnonHugePages`).
    pub huge_page_bytes: u64,
    /// Expert reads that found no free slot and went to a heap allocation instead.
    pub heap_fallbacks: u64,
    /// Experts copied from a retired slot into a usable one after a smaller plan.
    pub moved: u64,
}

/// One anonymous mapping holding slots `first..first + slots`, with an inaccessible guard
/// before and after them.
///
/// The guards keep the slots a mapping of their own: the kernel merges adjacent anonymous
/// mappings of equal protection and advice into one, so two arenas mapped side by side in
/// one process (or a heap mapping advised alike) would show up in `/proc/self/smaps` as one
/// range and each be measured with the other's pages.
struct Segment {
    map: memmap2::MmapMut,
    /// Offset of the first slot in `map` (past the front guard, on a huge-page boundary).
    lead: usize,
    /// Bytes of the slots (`slots * slot_len`).
    body: usize,
    /// Address of the first slot.
    base: *mut u8,
    first: usize,
    slots: usize,
}

// SAFETY: `base` points into `map`, which lives as long as the segment; the segment itself
// never reads or writes through it. Bytes are only accessed through a `Slot`, which owns its
// slot exclusively (the free list hands each index to one owner at a time).
unsafe impl Send for Segment {}
// SAFETY: as above; shared access only issues `madvise` calls on ranges no owner uses.
unsafe impl Sync for Segment {}

impl Segment {
    /// Map room for `slots` slots of `slot_len` bytes, advised for huge pages, between two
    /// guards.
    fn map(first: usize, slots: usize, slot_len: usize) -> std::io::Result<Segment> {
        let body = slots
            .checked_mul(slot_len)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
        // A page of front guard, up to a huge page less one page of alignment, the slots,
        // and at least a page of back guard.
        let len = body
            .checked_add(HUGE_PAGE + PAGE)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
        let mut map = memmap2::MmapOptions::new().len(len).map_anon()?;
        let start = map.as_mut_ptr();
        // `start` is page-aligned, so `lead` lies in `PAGE..=HUGE_PAGE` and the back guard
        // `len - lead - body` is at least a page.
        let lead = PAGE + start.wrapping_add(PAGE).align_offset(HUGE_PAGE);
        // THP in `madvise` mode backs only advised ranges; where THP is off this is refused
        // or ignored, and the slots are ordinary pages.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        // SAFETY: `0..lead` and `lead + body..len` are whole pages inside the mapping that
        // nothing refers to (slots start at `lead` and end at `lead + body`); making them
        // inaccessible changes no byte anyone reads. A refusal leaves them accessible, which
        // only lets the kernel merge the mapping with a neighbour.
        unsafe {
            let _ = rustix::mm::mprotect(start.cast(), lead, rustix::mm::MprotectFlags::empty());
            let _ = rustix::mm::mprotect(
                start.add(lead + body).cast(),
                len - lead - body,
                rustix::mm::MprotectFlags::empty(),
            );
        }
        // SAFETY: `lead + body <= len`, so the offset stays inside the mapping.
        let base = unsafe { start.add(lead) };
        Ok(Segment {
            map,
            lead,
            body,
            base,
            first,
            slots,
        })
    }

    fn holds(&self, id: usize) -> bool {
        (self.first..self.first + self.slots).contains(&id)
    }

    /// Offset in the mapping of slot `id`.
    fn offset(&self, id: usize, slot_len: usize) -> usize {
        self.lead + (id - self.first) * slot_len
    }

    /// The address range of the slots (the guards excluded).
    fn range(&self) -> (usize, usize) {
        let start = self.base as usize;
        (start, start + self.body)
    }
}

struct State {
    /// Usable slots that hold nothing, faulted in.
    free: Vec<u32>,
    /// Per slot (all segments): handed out now.
    in_use: Vec<bool>,
    /// Slots below this index are usable.
    slots: usize,
    segments: Vec<Arc<Segment>>,
    prefault: Prefault,
    resident_bytes: u64,
    huge_page_bytes: u64,
}

/// The expert slot arena (see the module documentation).
pub struct Arena {
    slot_len: usize,
    state: Mutex<State>,
    /// Serialises [`Arena::set_slots`] calls.
    resize: Mutex<()>,
    fallbacks: AtomicU64,
    moved: AtomicU64,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = lock(&self.state);
        f.debug_struct("Arena")
            .field("slot_len", &self.slot_len)
            .field("slots", &s.slots)
            .field("free", &s.free.len())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update of the state completes before its lock is released (no code in between
    // can panic), so a poisoned lock still guards a consistent state.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A slot handed out: `len` bytes at a page-aligned address, owned until dropped, when it
/// goes back to its arena.
pub struct Slot {
    arena: Arc<Arena>,
    seg: Arc<Segment>,
    id: usize,
    ptr: *mut u8,
}

// SAFETY: a slot owns its bytes exclusively (the free list hands an index to one owner at a
// time, and the index returns to it only when this value is dropped); the segment it points
// into is kept alive by `seg`.
unsafe impl Send for Slot {}
// SAFETY: shared access only reads the bytes (`as_slice`); writing needs `&mut self`, or the
// caller's guarantee of `area_shared` that nothing reads them meanwhile.
unsafe impl Sync for Slot {}

impl Slot {
    /// Bytes of the slot.
    #[must_use]
    pub fn len(&self) -> usize {
        self.arena.slot_len
    }

    /// Whether the slot is empty (never: slots are at least a page).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.arena.slot_len == 0
    }

    /// The slot's index in its arena.
    #[must_use]
    pub fn id(&self) -> usize {
        self.id
    }

    /// Whether this slot belongs to `arena`.
    #[must_use]
    pub fn is_in(&self, arena: &Arc<Arena>) -> bool {
        Arc::ptr_eq(&self.arena, arena)
    }

    /// The slot's memory, for reads to write into.
    pub fn area(&mut self) -> &mut [MaybeUninit<u8>] {
        // SAFETY: `ptr..ptr + slot_len` lies inside the live mapping `seg`, is owned by this
        // slot alone, and `&mut self` makes this the only reference to it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast(), self.arena.slot_len) }
    }

    /// The slot's memory for writing, through a shared reference: the slot of a buffer that
    /// is refilled in place while values holding ranges of it are kept ([`super::ring`]).
    ///
    /// # Safety
    /// Until the returned area is dropped, nothing may read the slot's bytes (no
    /// [`Slot::as_slice`] on any thread) and no other area of it may exist.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn area_shared(&self) -> &mut [MaybeUninit<u8>] {
        // SAFETY: `ptr..ptr + slot_len` lies inside the live mapping `seg` and is owned by
        // this slot alone (it is a raw mapping, never a Rust allocation); the caller
        // guarantees that nothing else reads or writes it while the area lives.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast(), self.arena.slot_len) }
    }

    /// The slot's first `mid` bytes to read and the rest to write into, at once: a read that
    /// continues past what has arrived while the arrived bytes are used.
    pub fn split_at_mut(&mut self, mid: usize) -> (&[u8], &mut [MaybeUninit<u8>]) {
        let len = self.arena.slot_len;
        let mid = mid.min(len);
        // SAFETY: `ptr..ptr + len` lies inside the live mapping `seg` and is owned by this
        // slot alone; `&mut self` makes these the only references to it, and the two do not
        // overlap. The first part is initialised as in `as_slice` (anonymous memory is
        // zero-filled by the kernel).
        unsafe {
            (
                std::slice::from_raw_parts(self.ptr, mid),
                std::slice::from_raw_parts_mut(self.ptr.add(mid).cast(), len - mid),
            )
        }
    }

    /// The slot's bytes.
    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as in `area`; anonymous memory is zero-filled by the kernel, so every byte
        // is initialised, and no mutable reference exists while `&self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.ptr, self.arena.slot_len) }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.arena.put(&self.seg, self.id);
    }
}

impl Arena {
    /// An arena of slots of `slot_len` bytes (rounded up to a page), with no slot yet.
    #[must_use]
    pub fn new(slot_len: usize) -> Arc<Arena> {
        Arc::new(Arena {
            slot_len: slot_len.max(1).next_multiple_of(PAGE),
            state: Mutex::new(State {
                free: Vec::new(),
                in_use: Vec::new(),
                slots: 0,
                segments: Vec::new(),
                prefault: Prefault::None,
                resident_bytes: 0,
                huge_page_bytes: 0,
            }),
            resize: Mutex::new(()),
            fallbacks: AtomicU64::new(0),
            moved: AtomicU64::new(0),
        })
    }

    /// Bytes of one slot.
    #[must_use]
    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// Usable slots.
    #[must_use]
    pub fn slots(&self) -> usize {
        lock(&self.state).slots
    }

    /// A free slot, or None when every usable one is taken.
    #[must_use]
    pub fn take(self: &Arc<Self>) -> Option<Slot> {
        let mut s = lock(&self.state);
        let id = *s.free.last()? as usize;
        let seg = s.segments.iter().find(|g| g.holds(id)).map(Arc::clone)?;
        s.free.pop();
        s.in_use[id] = true;
        drop(s);
        // SAFETY: slot `id` lies inside `seg`: `offset(id) + slot_len <= lead + slots *
        // slot_len`, within the mapping.
        let ptr = unsafe { seg.base.add((id - seg.first) * self.slot_len) };
        Some(Slot {
            arena: Arc::clone(self),
            seg,
            id,
            ptr,
        })
    }

    /// Count a read that found no free slot.
    pub fn count_fallback(&self) {
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
    }

    /// Count an expert moved out of a retired slot.
    pub fn count_moved(&self) {
        self.moved.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether slot `id` is retired (above the usable count): its contents should move.
    #[must_use]
    pub fn is_retired(&self, id: usize) -> bool {
        id >= lock(&self.state).slots
    }

    fn put(&self, seg: &Segment, id: usize) {
        let mut s = lock(&self.state);
        s.in_use[id] = false;
        if id < s.slots {
            s.free.push(id as u32);
        } else {
            // A retired slot: its memory goes back to the system. Done under the lock so a
            // concurrent growth cannot hand the slot out before it is released.
            release(seg, seg.offset(id, self.slot_len), self.slot_len);
        }
    }

    /// Make `n` slots usable: more are faulted in now (mapping a new segment where needed),
    /// fewer release the free ones above `n` at once and the others when their bytes are
    /// dropped. An error (the mapping refused) leaves the arena with the slots it had
    /// mapped; reads beyond them go to the heap.
    pub fn set_slots(&self, n: usize) -> std::io::Result<()> {
        let _one = lock(&self.resize);
        let (old, mapped) = {
            let s = lock(&self.state);
            (s.slots, s.in_use.len())
        };
        if n < old {
            let drained: Vec<usize> = {
                let mut s = lock(&self.state);
                s.slots = n;
                let (keep, out): (Vec<u32>, Vec<u32>) =
                    s.free.iter().partition(|&&id| (id as usize) < n);
                s.free = keep;
                out.into_iter().map(|id| id as usize).collect()
            };
            // No one can take these (off the free list) or grow over them (the resize lock).
            self.for_runs(&drained, release);
            return Ok(());
        }
        if n == old {
            return Ok(());
        }
        // Retired slots that hold nothing come back, faulted in again.
        let back: Vec<usize> = {
            let mut s = lock(&self.state);
            s.slots = n;
            let ids: Vec<usize> = (old..n.min(mapped)).filter(|&i| !s.in_use[i]).collect();
            for &i in &ids {
                s.in_use[i] = true;
            }
            ids
        };
        let mut how = Prefault::None;
        self.for_runs(&back, |seg, off, len| how = prefault(seg, off, len));
        {
            let mut s = lock(&self.state);
            for &i in &back {
                s.in_use[i] = false;
                s.free.push(i as u32);
            }
        }
        if n > mapped {
            let seg = match Segment::map(mapped, n - mapped, self.slot_len) {
                Ok(seg) => seg,
                Err(e) => {
                    lock(&self.state).slots = mapped;
                    return Err(e);
                }
            };
            how = prefault(&seg, seg.lead, (n - mapped) * self.slot_len);
            let mut s = lock(&self.state);
            s.in_use.resize(n, false);
            s.free.extend((mapped..n).rev().map(|i| i as u32));
            s.segments.push(Arc::new(seg));
        }
        if how != Prefault::None {
            lock(&self.state).prefault = how;
        }
        Ok(())
    }

    /// Call `f(segment, offset, len)` for each run of consecutive slots of `ids` in one
    /// segment.
    fn for_runs(&self, ids: &[usize], mut f: impl FnMut(&Segment, usize, usize)) {
        let segments = lock(&self.state).segments.clone();
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        let mut i = 0;
        while i < ids.len() {
            let Some(seg) = segments.iter().find(|g| g.holds(ids[i])) else {
                i += 1;
                continue;
            };
            let mut j = i + 1;
            while j < ids.len() && ids[j] == ids[j - 1] + 1 && seg.holds(ids[j]) {
                j += 1;
            }
            f(
                seg,
                seg.offset(ids[i], self.slot_len),
                (j - i) * self.slot_len,
            );
            i = j;
        }
    }

    /// Measure the resident and huge-page bytes of the arena's mappings now (reads
    /// `/proc/self/smaps`; nothing is measured where it cannot be read).
    pub fn measure(&self) {
        let ranges: Vec<(usize, usize)> = lock(&self.state)
            .segments
            .iter()
            .map(|g| g.range())
            .collect();
        if ranges.is_empty() {
            return;
        }
        let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
            return;
        };
        let (rss, huge) = smaps_bytes(&smaps, &ranges);
        let mut s = lock(&self.state);
        s.resident_bytes = rss;
        s.huge_page_bytes = huge;
    }

    /// The arena's figures.
    #[must_use]
    pub fn stats(&self) -> ArenaStats {
        let s = lock(&self.state);
        ArenaStats {
            slot_bytes: self.slot_len as u64,
            slots: s.slots as u64,
            in_use: s.in_use.iter().filter(|&&u| u).count() as u64,
            prefault: s.prefault,
            resident_bytes: s.resident_bytes,
            huge_page_bytes: s.huge_page_bytes,
            heap_fallbacks: self.fallbacks.load(Ordering::Relaxed),
            moved: self.moved.load(Ordering::Relaxed),
        }
    }
}

/// Give `off..off + len` of `seg` back to the system (the range holds nothing anyone reads).
fn release(seg: &Segment, off: usize, len: usize) {
    // SAFETY: the range lies inside the segment's mapping and belongs to slots that are not
    // handed out (free, or retired and just returned), so no reference into it exists; the
    // next owner of these pages finds zeroes, which it overwrites before reading.
    let _ = unsafe {
        seg.map
            .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, off, len)
    };
}

/// Fault `off..off + len` of `seg` in now, by `MADV_POPULATE_WRITE` or, where that is
/// refused, by writing one byte of each page. One thread does it: splitting the range over
/// two threads was slower on the two-core machine it was measured on (the kernel's fresh-page
/// cost does not parallelise there).
fn prefault(seg: &Segment, off: usize, len: usize) -> Prefault {
    #[cfg(target_os = "linux")]
    if seg
        .map
        .advise_range(memmap2::Advice::PopulateWrite, off, len)
        .is_ok()
    {
        return Prefault::Populate;
    }
    let start = seg.map.as_ptr() as usize + off;
    for p in (start..start + len).step_by(PAGE) {
        // SAFETY: `p` lies inside the segment's writable mapping, in slots no owner holds
        // (being added to the free list by the caller), so the write races with nothing; it
        // stores the zero anonymous memory already reads as.
        unsafe { std::ptr::write_volatile(p as *mut u8, 0) };
    }
    Prefault::Touch
}

/// Sum `Rss` and `AnonHugePages` (bytes) over the mappings in `smaps` (the text of
/// `/proc/<pid>/smaps`) that overlap any of `ranges` (`[start, end)` addresses).
#[must_use]
pub fn smaps_bytes(smaps: &str, ranges: &[(usize, usize)]) -> (u64, u64) {
    let (mut rss, mut huge) = (0u64, 0u64);
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                inside = ranges.iter().any(|&(s, e)| a < e && s < b);
                continue;
            }
        }
        if !inside {
            continue;
        }
        let kb = |key: &str| -> Option<u64> {
            line.strip_prefix(key)?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        };
        if let Some(k) = kb("Rss:") {
            rss += k * 1024;
        } else if let Some(k) = kb("AnonHugePages:") {
            huge += k * 1024;
        }
    }
    (rss, huge)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_handed_out_once_and_come_back() {
        let arena = Arena::new(3 * PAGE);
        arena.set_slots(3).unwrap();
        let s = arena.stats();
        assert_eq!((s.slots, s.in_use, s.slot_bytes), (3, 0, 3 * PAGE as u64));
        assert_ne!(s.prefault, Prefault::None);
        let mut taken: Vec<Slot> = (0..3).map(|_| arena.take().unwrap()).collect();
        assert!(arena.take().is_none(), "a fourth slot out of three");
        let mut ids: Vec<usize> = taken.iter().map(Slot::id).collect();
        ids.sort_unstable();
        assert_eq!(ids, [0, 1, 2], "each slot handed out once");
        let mut addrs: Vec<usize> = taken
            .iter()
            .map(|s| s.as_slice().as_ptr() as usize)
            .collect();
        addrs.sort_unstable();
        for w in addrs.windows(2) {
            assert!(w[1] - w[0] >= 3 * PAGE, "slots overlap: {addrs:?}");
        }
        for a in &addrs {
            assert_eq!(a % PAGE, 0, "slot at {a:#x} not page-aligned");
        }
        assert_eq!(addrs[0] % HUGE_PAGE, 0, "the first slot starts a huge page");
        // Each slot's bytes are its own.
        for (i, s) in taken.iter_mut().enumerate() {
            for b in s.area().iter_mut() {
                b.write(i as u8 + 1);
            }
        }
        for (i, s) in taken.iter().enumerate() {
            assert!(s.as_slice().iter().all(|&b| b == i as u8 + 1));
        }
        assert_eq!(arena.stats().in_use, 3);
        let back = taken.pop().unwrap().id();
        assert_eq!(arena.stats().in_use, 2);
        assert_eq!(
            arena.take().unwrap().id(),
            back,
            "a returned slot is reused"
        );
    }

    #[test]
    fn growing_maps_more_and_shrinking_retires_the_top() {
        let arena = Arena::new(PAGE);
        arena.set_slots(2).unwrap();
        arena.set_slots(5).unwrap();
        let held: Vec<Slot> = (0..5).map(|_| arena.take().unwrap()).collect();
        assert!(arena.take().is_none());
        arena.set_slots(2).unwrap();
        assert_eq!(arena.slots(), 2);
        // Everything is still held: nothing is free below the new count.
        assert!(arena.take().is_none());
        let retired: Vec<bool> = held.iter().map(|s| arena.is_retired(s.id())).collect();
        assert_eq!(retired.iter().filter(|&&r| r).count(), 3);
        drop(held);
        assert_eq!(arena.stats().in_use, 0);
        // Only the two usable slots come back.
        let again: Vec<Slot> = std::iter::from_fn(|| arena.take()).collect();
        assert_eq!(again.len(), 2);
        assert!(again.iter().all(|s| s.id() < 2));
        drop(again);
        // Growing again brings the retired slots back, empty.
        arena.set_slots(4).unwrap();
        let mut all: Vec<Slot> = std::iter::from_fn(|| arena.take()).collect();
        assert_eq!(all.len(), 4);
        let top = all.iter_mut().find(|s| s.id() >= 2).unwrap();
        assert!(
            top.as_slice().iter().all(|&b| b == 0),
            "a released slot reads zero"
        );
    }

    #[test]
    fn smaps_sums_only_the_overlapping_mappings() {
        let smaps = "\
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
Size:               4096 kB
Rss:                4096 kB
AnonHugePages:      2048 kB
7f0000400000-7f0000500000 rw-p 00000000 00:00 0
Rss:                1024 kB
AnonHugePages:         0 kB
";
        let ours = [(0x7f00_0000_0000, 0x7f00_0040_0000)];
        assert_eq!(smaps_bytes(smaps, &ours), (4096 << 10, 2048 << 10));
        assert_eq!(
            smaps_bytes(smaps, &[(0x7f00_0000_1000, 0x7f00_0045_0000)]),
            (5120 << 10, 2048 << 10)
        );
        assert_eq!(smaps_bytes(smaps, &[(0x1000, 0x2000)]), (0, 0));
    }

    #[test]
    fn arenas_mapped_side_by_side_are_measured_apart() {
        // Consecutive anonymous mappings are usually placed next to each other; without the
        // guards the kernel merges them and each arena would count the other's pages.
        let arenas: Vec<Arc<Arena>> = (0..4).map(|_| Arena::new(64 * PAGE)).collect();
        for a in &arenas {
            a.set_slots(8).unwrap();
        }
        let own = (8 * 64 * PAGE).next_multiple_of(HUGE_PAGE) as u64;
        for a in &arenas {
            a.measure();
            let s = a.stats();
            if std::path::Path::new("/proc/self/smaps").exists() {
                assert!(
                    s.resident_bytes >= 8 * 64 * PAGE as u64 && s.resident_bytes <= own,
                    "an arena measured beside others: {s:?}"
                );
            }
        }
    }

    #[test]
    fn a_measured_arena_is_resident() {
        let arena = Arena::new(64 * PAGE);
        arena.set_slots(8).unwrap();
        arena.measure();
        let s = arena.stats();
        if std::path::Path::new("/proc/self/smaps").exists() {
            assert!(
                s.resident_bytes >= 8 * 64 * PAGE as u64,
                "pre-faulted slots not resident: {s:?}"
            );
        }
        arena.set_slots(1).unwrap();
        arena.measure();
        let t = arena.stats();
        if std::path::Path::new("/proc/self/smaps").exists() {
            assert!(
                t.resident_bytes <= (64 * PAGE + HUGE_PAGE) as u64,
                "released slots still resident: {t:?}"
            );
        }
    }
}
