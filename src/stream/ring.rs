//! A slot of the read-ahead ring: memory for one streamed layer, refilled in place with
//! whichever layer comes next, and the values bound to it.
//!
//! A streamed layer's weights are read into a slot and multiplied in place. The first time
//! layer `k` is read into a slot, a value (the engine's bound `Layer`) is made from the slot's
//! bytes — its matrices are ranges of the slot, its small vectors widened copies — and kept
//! with the slot. The next time `k` comes to the same slot, its bytes are read to the same
//! places and the kept value is handed out again: after every (slot, layer) pair has been
//! seen once, streaming a layer allocates nothing.
//!
//! Soundness rests on one rule the type keeps: every range of a slot's memory outside the
//! slot lives in a value bound here (only `bind` makes them, from the slot's bytes), and the
//! memory is written only while no bound value is lent out (every `Arc` is unique, and
//! `&mut self` keeps one from being lent while the write runs).

#![allow(unsafe_code)]

use super::arena::{Arena, Slot};
use super::bytes::Bytes;
use std::mem::MaybeUninit;
use std::sync::Arc;

/// One slot of the ring, holding values of `T` bound to its bytes, one per key (layer).
pub struct RingSlot<T> {
    mem: Bytes,
    bound: Vec<Option<Arc<T>>>,
    holds: Option<usize>,
}

impl<T> std::fmt::Debug for RingSlot<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingSlot")
            .field("bytes", &self.mem.len())
            .field("holds", &self.holds)
            .field("bound", &self.bound.iter().flatten().count())
            .finish()
    }
}

impl<T> RingSlot<T> {
    /// A slot of `arena` for values of keys `0..keys`; None when the arena has no free slot.
    #[must_use]
    pub fn new(arena: &Arc<Arena>, keys: usize) -> Option<RingSlot<T>> {
        let slot: Slot = arena.take()?;
        let mut bound = Vec::with_capacity(keys);
        bound.resize_with(keys, || None);
        Some(RingSlot {
            mem: Bytes::whole_slot(slot),
            bound,
            holds: None,
        })
    }

    /// Bytes the slot holds.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.mem.len()
    }

    /// The key whose bytes the slot holds (None before the first fill, and after a failed
    /// one).
    #[must_use]
    pub fn holds(&self) -> Option<usize> {
        self.holds
    }

    /// Whether a value bound to the slot is lent out (its memory may be being read).
    #[must_use]
    pub fn is_lent(&self) -> bool {
        self.bound
            .iter()
            .flatten()
            .any(|v| Arc::strong_count(v) > 1)
    }

    /// Refill the slot with key `k`'s bytes, which `read` writes into its memory, and return
    /// the value bound to them: made by `bind` from the slot's bytes the first time `k` is
    /// held here, the kept one the next times (`read` must then put the bytes where they
    /// were). None, with nothing written, while a bound value is lent out.
    pub fn fill<E>(
        &mut self,
        k: usize,
        read: impl FnOnce(&mut [MaybeUninit<u8>]) -> Result<(), E>,
        bind: impl FnOnce(&Bytes) -> Result<T, E>,
    ) -> Option<Result<Arc<T>, E>> {
        if self.is_lent() || k >= self.bound.len() {
            return None;
        }
        self.holds = None;
        {
            // SAFETY: every range of `mem` outside this slot lives in a value of `bound` (only
            // `bind` below makes them, from `mem`), none of those is lent (checked above; the
            // `&mut self` borrow keeps one from being lent while this runs), and `mem` itself
            // is not read here until the area is dropped: nothing reads the memory while
            // `read` writes it.
            let area = unsafe { self.mem.refill_area() }?;
            if let Err(e) = read(area) {
                return Some(Err(e));
            }
        }
        let value = match &self.bound[k] {
            Some(v) => Arc::clone(v),
            None => match bind(&self.mem) {
                Ok(v) => {
                    let v = Arc::new(v);
                    self.bound[k] = Some(Arc::clone(&v));
                    v
                }
                Err(e) => return Some(Err(e)),
            },
        };
        self.holds = Some(k);
        Some(Ok(value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value bound to a range of the slot, as a layer's matrix is.
    struct View(Bytes);

    #[test]
    fn a_refill_reuses_the_bound_value_and_waits_while_it_is_lent() {
        let arena = Arena::new(4096);
        arena.set_slots(1).unwrap();
        let mut slot: RingSlot<View> = RingSlot::new(&arena, 2).unwrap();
        let fill_with = |b: u8| {
            move |area: &mut [MaybeUninit<u8>]| -> Result<(), ()> {
                for x in &mut area[..8] {
                    x.write(b);
                }
                Ok(())
            }
        };
        let bind = |mem: &Bytes| mem.slice(0, 8).map(View).ok_or(());
        let a = slot.fill(0, fill_with(1), bind).unwrap().unwrap();
        assert_eq!(a.0.as_slice(), &[1; 8]);
        assert_eq!(slot.holds(), Some(0));
        // Lent: nothing is written.
        assert!(slot.fill(1, fill_with(2), bind).is_none());
        assert_eq!(a.0.as_slice(), &[1; 8]);
        drop(a);
        let b = slot.fill(1, fill_with(2), bind).unwrap().unwrap();
        assert_eq!(b.0.as_slice(), &[2; 8]);
        drop(b);
        // Key 0 again: the kept value, bound to the refilled bytes; `bind` is not called.
        let again = slot
            .fill(0, fill_with(3), |_: &Bytes| Err(()))
            .unwrap()
            .unwrap();
        assert_eq!(again.0.as_slice(), &[3; 8]);
        // A failed read leaves the slot holding nothing.
        drop(again);
        assert!(slot.fill(1, |_| Err(()), bind).unwrap().is_err());
        assert_eq!(slot.holds(), None);
    }
}
