//! Weight bytes read once and borrowed by the kernels: a [`Bytes`] is a range of one aligned,
//! reference-counted allocation that a positioned read filled directly. The six tensors of an
//! expert, or the tensors of a packed trunk layer, are ranges of the one allocation their read
//! filled, so a streamed byte is written once (by the kernel's read) and never copied. A
//! routed expert's allocation is a slot of the expert arena ([`super::arena`]) when one is
//! free.

#![allow(unsafe_code)]

use super::arena::{Arena, Slot};
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex};

#[cfg(target_endian = "big")]
compile_error!(
    "k3 multiplies little-endian BF16 weights in place and needs a little-endian target"
);

/// Alignment of every allocation: the `O_DIRECT` requirement of 4Kn devices.
pub const ALIGN: usize = super::arena::PAGE;

/// One aligned allocation; `raw[base..base + len]` is the usable, initialised part. It goes
/// back to its pool, if it came from one, when the last range of it is dropped. A slab can
/// instead be a file mapping (`map`), whose bytes are `map[base..base + len]`, or an arena
/// slot (`slot`), whose bytes are `slot[base..base + len]` and which goes back to its arena.
struct Slab {
    raw: Vec<u8>,
    base: usize,
    len: usize,
    pool: Option<Arc<Pool>>,
    map: Option<Arc<super::mapped::MappedFile>>,
    slot: Option<Slot>,
}

impl Drop for Slab {
    fn drop(&mut self) {
        if let Some(map) = &self.map {
            map.release(self.base, self.len);
        }
        if let Some(pool) = self.pool.take() {
            pool.put(std::mem::take(&mut self.raw));
        }
    }
}

/// Allocations kept for the next read of a similar size: memory that is already mapped, so a
/// large read (a streamed trunk layer) costs no page faults and no kernel zeroing. At most
/// `keep` idle allocations are kept; one too small for the next read is freed.
#[derive(Debug)]
pub struct Pool {
    free: Mutex<Vec<Vec<u8>>>,
    keep: usize,
}

impl Pool {
    /// A pool that keeps up to `keep` idle allocations.
    #[must_use]
    pub fn new(keep: usize) -> Arc<Pool> {
        Arc::new(Pool {
            free: Mutex::new(Vec::new()),
            keep,
        })
    }

    fn take(&self, cap: usize) -> Option<Vec<u8>> {
        let mut free = self
            .free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let i = free.iter().position(|v| v.capacity() >= cap);
        match i {
            Some(i) => Some(free.swap_remove(i)),
            None => {
                // Nothing fits: free one idle allocation before a new one is made.
                free.pop();
                None
            }
        }
    }

    /// Free every idle allocation (after a smaller plan: the memory goes back to the system).
    pub fn release(&self) {
        self.free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
    }

    /// Idle allocations kept.
    #[must_use]
    pub fn idle(&self) -> usize {
        self.free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    fn put(&self, mut raw: Vec<u8>) {
        let mut free = self
            .free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if free.len() < self.keep {
            raw.clear();
            free.push(raw);
        }
    }
}

impl Slab {
    fn bytes(&self) -> &[u8] {
        match (&self.map, &self.slot) {
            (Some(m), _) => &m.as_slice()[self.base..self.base + self.len],
            (None, Some(s)) => &s.as_slice()[self.base..self.base + self.len],
            (None, None) => &self.raw[self.base..self.base + self.len],
        }
    }
}

/// Immutable bytes: a range of a shared aligned allocation. Cloning shares the allocation.
#[derive(Clone)]
pub struct Bytes {
    slab: Arc<Slab>,
    start: usize,
    len: usize,
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes({} bytes)", self.len)
    }
}

impl PartialEq for Bytes {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Default for Bytes {
    fn default() -> Self {
        Bytes::copy_from(&[])
    }
}

/// Allocations at least this large are backed by transparent huge pages where the system
/// allows it.
const HUGE_FROM: usize = 4 << 20;

/// An empty vector with room for `cap` bytes. From [`HUGE_FROM`] up, its 2 MiB-aligned interior
/// is advised into transparent huge pages (THP in `madvise` mode backs only advised ranges).
/// A direct read pins its destination pages and hands the device one segment per physically
/// contiguous run, so a read into 4 KiB pages is split into many small requests: measured on
/// the streamed `k3mini-2048` trunk (`--mem 1`), 1.49–1.75 s/token on ordinary pages against
/// 0.96–1.07 on huge pages, with the same bytes read. Where THP is off the advice is refused
/// or ignored and the pages are ordinary.
fn large_allocation(cap: usize) -> Vec<u8> {
    let v: Vec<u8> = Vec::with_capacity(cap);
    #[cfg(target_os = "linux")]
    if let Some((lo, hi)) = huge_interior(v.as_ptr() as usize, v.capacity()) {
        // SAFETY: `lo..hi` lies inside the vector's allocation (`huge_interior`), which is
        // mapped and owned by `v`; MADV_HUGEPAGE only changes how the kernel backs those
        // pages, never their contents or the mapping's extent.
        let _ = unsafe {
            rustix::mm::madvise(lo as *mut _, hi - lo, rustix::mm::Advice::LinuxHugepage)
        };
    }
    v
}

/// The whole huge pages inside the allocation of `cap` bytes at `start`, from [`HUGE_FROM`]
/// bytes up.
fn huge_interior(start: usize, cap: usize) -> Option<(usize, usize)> {
    use super::arena::HUGE_PAGE;
    if cap < HUGE_FROM {
        return None;
    }
    let lo = start.checked_next_multiple_of(HUGE_PAGE)?;
    let hi = start.checked_add(cap)? / HUGE_PAGE * HUGE_PAGE;
    (hi > lo).then_some((lo, hi))
}

/// An allocation being filled by reads: `len` bytes starting at an [`ALIGN`]-aligned
/// address, none of them initialised until a read or [`Filling::zero_from`] writes them.
pub struct Filling {
    raw: Vec<u8>,
    base: usize,
    len: usize,
    pool: Option<Arc<Pool>>,
    /// The arena slot being filled instead of `raw` (at its start: slots are aligned).
    slot: Option<Slot>,
}

impl Filling {
    /// Room for `len` bytes at an aligned address; nothing is zeroed (the alignment lead of
    /// at most `ALIGN − 1` bytes excepted).
    #[must_use]
    pub fn new(len: usize) -> Filling {
        Self::from_raw(large_allocation(len + ALIGN), len, None)
    }

    /// [`Filling::new`] in an allocation from `pool` when one fits; the allocation goes back
    /// to the pool when the bytes are dropped.
    #[must_use]
    pub fn new_in(len: usize, pool: &Arc<Pool>) -> Filling {
        let raw = pool
            .take(len + ALIGN)
            .unwrap_or_else(|| large_allocation(len + ALIGN));
        Self::from_raw(raw, len, Some(Arc::clone(pool)))
    }

    /// [`Filling::new`] in a free slot of `arena` (which goes back to it when the bytes are
    /// dropped); a heap allocation, counted by the arena, when none is free or `len` does not
    /// fit a slot.
    #[must_use]
    pub fn new_in_arena(len: usize, arena: &Arc<Arena>) -> Filling {
        match arena.take().filter(|s| s.len() >= len) {
            Some(slot) => Filling {
                raw: Vec::new(),
                base: 0,
                len,
                pool: None,
                slot: Some(slot),
            },
            None => {
                arena.count_fallback();
                Filling::new(len)
            }
        }
    }

    /// Lay out `len` bytes at an aligned address in `raw` (empty, capacity at least
    /// `len + ALIGN`).
    fn from_raw(mut raw: Vec<u8>, len: usize, pool: Option<Arc<Pool>>) -> Filling {
        raw.clear();
        let base = raw.as_ptr().align_offset(ALIGN).min(ALIGN);
        raw.resize(base, 0);
        Filling {
            raw,
            base,
            len,
            pool,
            slot: None,
        }
    }

    /// Length of the area.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the area is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The area, uninitialised, for reads to write into.
    pub fn area(&mut self) -> &mut [MaybeUninit<u8>] {
        let len = self.len;
        match &mut self.slot {
            Some(s) => &mut s.area()[..len],
            None => &mut self.raw.spare_capacity_mut()[..len],
        }
    }

    /// Finish after reads wrote bytes `0..filled` of the area: the rest is zeroed (a read
    /// window that ran past the end of its file), and the area becomes immutable [`Bytes`].
    #[must_use]
    pub fn finish(mut self, filled: usize) -> Bytes {
        let len = self.len;
        if let Some(mut slot) = self.slot.take() {
            for b in &mut slot.area()[filled.min(len)..len] {
                b.write(0);
            }
            // The allocation is the whole slot (its bytes past `len` are initialised too: the
            // arena's memory is), so the slot can later be read again in place with a window
            // of another length ([`Bytes::refill_parts`]).
            let slab = Slab {
                raw: Vec::new(),
                base: 0,
                len: slot.len(),
                pool: None,
                map: None,
                slot: Some(slot),
            };
            return Bytes {
                slab: Arc::new(slab),
                start: 0,
                len,
            };
        }
        for b in &mut self.raw.spare_capacity_mut()[filled.min(len)..len] {
            b.write(0);
        }
        // SAFETY: `raw` has capacity at least `base + len` (`from_raw` is given at least
        // `len + ALIGN` and `base <= ALIGN`); bytes `0..base` were initialised by `resize`,
        // bytes `base..base + filled` by the reads the caller reports, and the rest just above.
        unsafe { self.raw.set_len(self.base + len) };
        let slab = Slab {
            raw: std::mem::take(&mut self.raw),
            base: self.base,
            len,
            pool: self.pool.take(),
            map: None,
            slot: None,
        };
        Bytes {
            slab: Arc::new(slab),
            start: 0,
            len,
        }
    }
}

impl Bytes {
    /// The whole of an arena slot as bytes (zeroed now), to be refilled in place
    /// ([`super::ring::RingSlot`]).
    #[must_use]
    pub(crate) fn whole_slot(slot: Slot) -> Bytes {
        let len = slot.len();
        Filling {
            raw: Vec::new(),
            base: 0,
            len,
            pool: None,
            slot: Some(slot),
        }
        .finish(0)
    }

    /// The whole allocation of bytes made by [`Bytes::whole_slot`], writable, for a refill in
    /// place; None for any other allocation.
    ///
    /// # Safety
    /// Until the returned area is dropped, no range of this allocation may be read (no
    /// `as_slice` or deref of any `Bytes` sharing it, on any thread), and no other area of it
    /// may exist.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn refill_area(&self) -> Option<&mut [MaybeUninit<u8>]> {
        let slot = self.slab.slot.as_ref()?;
        (self.slab.base == 0 && self.start == 0 && self.len == slot.len()).then_some(())?;
        // SAFETY: the caller's guarantee, which is `area_shared`'s.
        Some(unsafe { slot.area_shared() })
    }

    /// The whole arena slot that `parts` are ranges of, writable, when these handles are the
    /// only ones to it: a slot read again in place (a cached expert's slot given to the next
    /// expert read into it). None when the parts lie in different allocations, in one that is
    /// not an arena slot, or when any other handle to it exists. While the area lives, the
    /// parts cannot be read (they are borrowed here); afterwards [`Bytes::reslice`] points
    /// them at the new contents.
    pub fn refill_parts<'a>(parts: &'a mut [&mut Bytes]) -> Option<&'a mut [MaybeUninit<u8>]> {
        let first = parts.first()?;
        let slab = &first.slab;
        if !parts.iter().all(|p| Arc::ptr_eq(&p.slab, slab))
            || Arc::strong_count(slab) != parts.len()
            || Arc::weak_count(slab) != 0
        {
            return None;
        }
        let slot = slab.slot.as_ref()?;
        if slab.base != 0 || slab.len != slot.len() {
            return None;
        }
        // SAFETY: every handle to this allocation is one of `parts` (the count says so, and
        // no weak handle exists to make another), and `parts` is mutably borrowed for as long
        // as the area lives, so nothing reads or writes the slot's bytes meanwhile.
        Some(unsafe { slot.area_shared() })
    }

    /// Point this handle at bytes `start..start + len` of its allocation; false (unchanged)
    /// when the range runs past it.
    pub fn reslice(&mut self, start: usize, len: usize) -> bool {
        if start.checked_add(len).is_none_or(|e| e > self.slab.len) {
            return false;
        }
        self.start = start;
        self.len = len;
        true
    }

    /// An aligned copy of `src` (for weights that were not read from a file).
    #[must_use]
    pub fn copy_from(src: &[u8]) -> Bytes {
        let mut f = Filling::new(src.len());
        for (d, &s) in f.area().iter_mut().zip(src) {
            d.write(s);
        }
        f.finish(src.len())
    }

    /// The bytes `off..off + len` of a file mapping, in place (no copy); None when the range
    /// runs past the mapping. The mapping stays alive while any range of it does.
    #[must_use]
    pub fn mapped(map: &Arc<super::mapped::MappedFile>, off: usize, len: usize) -> Option<Bytes> {
        off.checked_add(len).filter(|&e| e <= map.len())?;
        let slab = Slab {
            raw: Vec::new(),
            base: off,
            len,
            pool: None,
            map: Some(Arc::clone(map)),
            slot: None,
        };
        Some(Bytes {
            slab: Arc::new(slab),
            start: 0,
            len,
        })
    }

    /// Whether these bytes are a range of a file mapping.
    #[must_use]
    pub fn is_mapped(&self) -> bool {
        self.slab.map.is_some()
    }

    /// BF16 (or any u16) values as little-endian bytes.
    #[must_use]
    pub fn from_u16(v: &[u16]) -> Bytes {
        Bytes::copy_from(bytemuck::cast_slice(v))
    }

    /// The bytes.
    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        &self.slab.bytes()[self.start..self.start + self.len]
    }

    /// Number of bytes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no bytes.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sub-range `off..off + len`, sharing the allocation; None when it runs past the end.
    #[must_use]
    pub fn slice(&self, off: usize, len: usize) -> Option<Bytes> {
        let end = off.checked_add(len).filter(|&e| e <= self.len)?;
        Some(Bytes {
            slab: Arc::clone(&self.slab),
            start: self.start + off,
            len: end - off,
        })
    }

    /// Bytes of the whole allocation this range belongs to (what holding it keeps in memory).
    #[must_use]
    pub fn allocation_len(&self) -> usize {
        self.slab.len
    }

    /// The arena slot these bytes live in, if they are in one.
    #[must_use]
    pub fn arena_slot(&self) -> Option<usize> {
        self.slab.slot.as_ref().map(Slot::id)
    }
}

/// After a smaller plan: when `parts` are ranges of one slot of `arena` that the plan
/// retired, copy that slot's bytes into a free usable slot and return the same ranges of the
/// copy (the caller drops the originals, which releases the retired slot). None when there
/// is nothing to move (not one retired slot of `arena`) or no slot is free.
#[must_use]
pub fn rehome(parts: &[&Bytes], arena: &Arc<Arena>) -> Option<Vec<Bytes>> {
    let first = parts.first()?;
    let old = first.slab.slot.as_ref()?;
    if !old.is_in(arena) || !arena.is_retired(old.id()) {
        return None;
    }
    if !parts.iter().all(|p| Arc::ptr_eq(&p.slab, &first.slab)) {
        return None;
    }
    let mut slot = arena.take()?;
    let (base, len) = (first.slab.base, first.slab.len);
    for (d, &s) in slot.area()[base..base + len]
        .iter_mut()
        .zip(&old.as_slice()[base..base + len])
    {
        d.write(s);
    }
    arena.count_moved();
    let slab = Arc::new(Slab {
        raw: Vec::new(),
        base,
        len,
        pool: None,
        map: None,
        slot: Some(slot),
    });
    Some(
        parts
            .iter()
            .map(|p| Bytes {
                slab: Arc::clone(&slab),
                start: p.start,
                len: p.len,
            })
            .collect(),
    )
}

/// Little-endian u16 values (BF16 weights) borrowed in place: always 2-byte aligned and of
/// even length, so the kernels read them as `&[u16]` without a copy.
#[derive(Clone, Debug, PartialEq)]
pub struct U16s(Bytes);

impl U16s {
    /// View `b` as u16 values: in place when it is aligned, else an aligned copy; a trailing
    /// odd byte is dropped.
    #[must_use]
    pub fn new(b: Bytes) -> U16s {
        let even = b.len() & !1;
        let b = b.slice(0, even).unwrap_or_default();
        if bytemuck::try_cast_slice::<u8, u16>(b.as_slice()).is_ok() {
            U16s(b)
        } else {
            U16s(Bytes::copy_from(b.as_slice()))
        }
    }

    /// The bytes the values are read from.
    #[must_use]
    pub fn bytes(&self) -> &Bytes {
        &self.0
    }

    /// Owned values.
    #[must_use]
    pub fn from_vec(v: &[u16]) -> U16s {
        U16s(Bytes::from_u16(v))
    }

    /// The values.
    #[must_use]
    pub fn as_slice(&self) -> &[u16] {
        // `new` guarantees 2-byte alignment and an even length, so the cast cannot fail.
        bytemuck::try_cast_slice(self.0.as_slice()).unwrap_or(&[])
    }

    /// Number of values.
    #[must_use]
    pub fn len(&self) -> usize {
        self.0.len() / 2
    }

    /// Whether there are none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::ops::Deref for U16s {
    type Target = [u16];
    fn deref(&self) -> &[u16] {
        self.as_slice()
    }
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

/// An initialised buffer as the uninitialised type reads write into.
pub(crate) fn as_uninit(buf: &mut [u8]) -> &mut [MaybeUninit<u8>] {
    // SAFETY: `MaybeUninit<u8>` has the size and alignment of `u8`, and callers only store
    // initialised bytes through the result (reads write what the kernel returned), so `buf`
    // stays initialised.
    unsafe { &mut *(std::ptr::from_mut::<[u8]>(buf) as *mut [MaybeUninit<u8>]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_allocation_advises_only_whole_huge_pages_inside_it() {
        const H: usize = 2 << 20;
        assert_eq!(
            huge_interior(H + 16, HUGE_FROM - 1),
            None,
            "below the threshold"
        );
        // An unaligned start: the interior begins at the next huge page, ends at the last.
        assert_eq!(huge_interior(H + 16, 8 * H), Some((2 * H, 9 * H)));
        assert_eq!(huge_interior(4 * H, 3 * H), Some((4 * H, 7 * H)));
        // Less than one whole huge page inside.
        assert_eq!(
            huge_interior(H + 4096, HUGE_FROM - 4096 + H - 8192),
            Some((2 * H, 3 * H))
        );
        assert_eq!(huge_interior(usize::MAX - H, 8 * H), None, "no overflow");
        for start in [4096usize, H - 1, H, 3 * H + 4096 * 7] {
            for cap in [HUGE_FROM, HUGE_FROM + 1, 5 * H + 12_345, 64 * H] {
                if let Some((lo, hi)) = huge_interior(start, cap) {
                    assert!(lo >= start && hi <= start + cap && lo < hi);
                    assert_eq!((lo % H, hi % H), (0, 0));
                    assert!(
                        lo - start < H && start + cap - hi < H,
                        "every whole page taken"
                    );
                }
            }
        }
        // Read into such an allocation: the bytes are what was written, nothing zeroed.
        let n = HUGE_FROM + 12_345;
        let mut f = Filling::new(n);
        for (i, b) in f.area().iter_mut().enumerate() {
            b.write((i % 251) as u8);
        }
        let b = f.finish(n);
        assert_eq!(b.len(), n);
        assert!(b
            .as_slice()
            .iter()
            .enumerate()
            .all(|(i, &v)| v == (i % 251) as u8));
    }

    #[test]
    fn filling_is_aligned_and_finish_zeroes_the_unread_tail() {
        let mut f = Filling::new(10_000);
        assert_eq!(f.area().as_ptr().align_offset(ALIGN), 0);
        for (i, b) in f.area()[..100].iter_mut().enumerate() {
            b.write(i as u8 + 1);
        }
        let b = f.finish(100);
        assert_eq!(b.len(), 10_000);
        assert_eq!(b[0], 1);
        assert_eq!(b[99], 100);
        assert!(b[100..].iter().all(|&x| x == 0));
        assert_eq!(b.as_ptr().align_offset(ALIGN), 0);
    }

    #[test]
    fn pooled_allocations_are_reused_once_dropped() {
        let pool = Pool::new(1);
        let a = Filling::new_in(100_000, &pool).finish(0);
        let addr = a.as_ptr() as usize;
        drop(a);
        // Reused in place, its old bytes overwritten or zeroed like a fresh one.
        let mut f = Filling::new_in(90_000, &pool);
        f.area()[0].write(7);
        let b = f.finish(1);
        assert_eq!(b.as_ptr() as usize, addr);
        assert_eq!(b[0], 7);
        assert!(b[1..].iter().all(|&x| x == 0));
        // Too small for a larger read: a new allocation is made.
        drop(b);
        let c = Filling::new_in(200_000, &pool).finish(0);
        assert_eq!(c.len(), 200_000);
        assert_eq!(c.as_ptr().align_offset(ALIGN), 0);
    }

    #[test]
    fn a_released_pool_keeps_nothing() {
        let pool = Pool::new(2);
        drop(Filling::new_in(100_000, &pool).finish(0));
        drop(Filling::new_in(100_000, &pool).finish(0));
        assert_eq!(
            pool.idle(),
            1,
            "the second read reused the first allocation"
        );
        pool.release();
        assert_eq!(pool.idle(), 0);
    }

    #[test]
    fn expert_reads_fill_arena_slots_and_fall_back_when_none_is_free() {
        let arena = Arena::new(2 * ALIGN);
        arena.set_slots(2).unwrap();
        let fill = |n: usize, v: u8| {
            let mut f = Filling::new_in_arena(n, &arena);
            for b in &mut f.area()[..n / 2] {
                b.write(v);
            }
            f.finish(n / 2)
        };
        let a = fill(ALIGN, 1);
        let b = fill(2 * ALIGN, 2);
        assert_eq!(
            (a.arena_slot().is_some(), b.arena_slot().is_some()),
            (true, true)
        );
        assert_ne!(a.arena_slot(), b.arena_slot());
        assert_eq!(a.as_ptr().align_offset(ALIGN), 0);
        assert!(a[..ALIGN / 2].iter().all(|&x| x == 1) && a[ALIGN / 2..].iter().all(|&x| x == 0));
        assert!(b[..ALIGN].iter().all(|&x| x == 2) && b[ALIGN..].iter().all(|&x| x == 0));
        // Exhausted: the heap, counted.
        let c = fill(ALIGN, 3);
        assert!(c.arena_slot().is_none());
        assert_eq!(c.as_ptr().align_offset(ALIGN), 0);
        // Too large for a slot: the heap, counted.
        drop(a);
        let d = fill(3 * ALIGN, 4);
        assert!(d.arena_slot().is_none());
        assert_eq!(arena.stats().heap_fallbacks, 2);
        // A range keeps its slot; dropping the last range gives it back.
        let part = b.slice(ALIGN / 2, 16).unwrap();
        let slot = b.arena_slot();
        drop(b);
        assert_eq!(arena.stats().in_use, 1);
        assert_eq!(part.arena_slot(), slot);
        drop(part);
        assert_eq!(arena.stats().in_use, 0);
        assert!(c[..ALIGN / 2].iter().all(|&x| x == 3));
        assert!(d[..ALIGN * 3 / 2].iter().all(|&x| x == 4));
    }

    #[test]
    fn rehome_moves_a_retired_slot_below_the_new_count() {
        let arena = Arena::new(ALIGN);
        arena.set_slots(3).unwrap();
        let held: Vec<Bytes> = (0..3u8)
            .map(|v| {
                let mut f = Filling::new_in_arena(100, &arena);
                for b in f.area() {
                    b.write(v + 10);
                }
                f.finish(100)
            })
            .collect();
        // Keep the expert in the top slot; free one below.
        let top = held.iter().position(|b| b.arena_slot() == Some(2)).unwrap();
        let low = (0..3).find(|&i| i != top).unwrap();
        let mut held = held;
        let kept = held.remove(top);
        held.remove(if low > top { low - 1 } else { low });
        arena.set_slots(2).unwrap();
        assert!(arena.is_retired(2));
        let parts = [kept.slice(0, 40).unwrap(), kept.slice(40, 60).unwrap()];
        // Only retired slots move; the other one stays.
        assert!(rehome(&[&held[0]], &arena).is_none());
        let moved = rehome(&[&parts[0], &parts[1]], &arena).unwrap();
        assert_eq!(&*moved[0], &*parts[0]);
        assert_eq!(&*moved[1], &*parts[1]);
        assert!(moved[0].arena_slot().unwrap() < 2);
        assert_eq!(moved[0].arena_slot(), moved[1].arena_slot());
        drop((kept, parts));
        let s = arena.stats();
        assert_eq!((s.in_use, s.moved), (2, 1), "{s:?}");
    }

    #[test]
    fn slices_share_and_bound_check() {
        let b = Bytes::copy_from(&[1, 2, 3, 4, 5]);
        let s = b.slice(1, 3).expect("in range");
        assert_eq!(&*s, &[2, 3, 4]);
        assert_eq!(s.allocation_len(), 5);
        assert!(b.slice(3, 3).is_none());
        assert!(b.slice(usize::MAX, 2).is_none());
        assert_eq!(&*s.slice(2, 1).expect("in range"), &[4]);
    }

    #[test]
    fn u16s_in_place_or_copied_when_odd() {
        let b = Bytes::from_u16(&[0x3f80, 0x4000, 0xbf80]);
        let v = U16s::new(b.clone());
        assert_eq!(&*v, &[0x3f80, 0x4000, 0xbf80]);
        assert_eq!(v.as_ptr() as usize, b.as_ptr() as usize);
        // An odd start forces an aligned copy with the same values.
        let raw = Bytes::copy_from(&[0, 0x80, 0x3f, 0x00, 0x40, 9]);
        let odd = U16s::new(raw.slice(1, 5).expect("in range"));
        assert_eq!(&*odd, &[0x3f80, 0x4000]);
        assert_eq!(odd.len(), 2);
    }
}
