//! The store's locks are leaves: none is taken while another of them is held.
//!
//! Every mutex of the weight store is a [`Leaf`]. Code that needs two of them takes one,
//! copies or moves what it needs out, and lets it go before taking the next, so no order
//! between them exists to be kept, and no two threads can wait on each other through them.
//! Builds with the `lock-checks` feature (the tests') count the leaves each thread holds and
//! panic when a second one is taken, so a nesting is a failing test, not a comment to keep.
//! The locks below the store (the expert arena's, in `stream`) are taken inside a leaf (a
//! freed slot goes back to its arena) and take nothing of the store's.

use std::ops::{Deref, DerefMut};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

#[cfg(any(test, feature = "lock-checks"))]
thread_local! {
    /// Leaves this thread holds.
    static HELD: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// One more leaf held by this thread; panics (in checked builds) if it already held one.
#[inline]
fn enter() {
    #[cfg(any(test, feature = "lock-checks"))]
    HELD.with(|h| {
        assert!(
            h.get() == 0,
            "a lock of the weight store was taken while this thread held another"
        );
        h.set(1);
    });
}

/// The leaf this thread held is let go.
#[inline]
fn leave() {
    #[cfg(any(test, feature = "lock-checks"))]
    HELD.with(|h| h.set(0));
}

/// A mutex of the weight store, taken alone.
#[derive(Default)]
pub(super) struct Leaf<T>(Mutex<T>);

impl<T: std::fmt::Debug> std::fmt::Debug for Leaf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Debug output takes no lock (a caller may hold one).
        f.write_str("Leaf(..)")
    }
}

impl<T> Leaf<T> {
    pub(super) const fn new(value: T) -> Leaf<T> {
        Leaf(Mutex::new(value))
    }

    /// Take the lock. A panic while it was held cannot leave what it guards half-updated in
    /// a way that matters for correctness (the store only caches reads and counts), so a
    /// poisoned lock is used as is.
    pub(super) fn lock(&self) -> Held<'_, T> {
        enter();
        Held(Some(self.0.lock().unwrap_or_else(PoisonError::into_inner)))
    }
}

/// A [`Leaf`] held.
pub(super) struct Held<'a, T>(Option<MutexGuard<'a, T>>);

impl<T> Held<'_, T> {
    /// Let the lock go until `cv` is notified, then hold it again.
    pub(super) fn wait(mut self, cv: &Condvar) -> Self {
        let Some(g) = self.0.take() else {
            return self;
        };
        leave();
        let g = cv.wait(g).unwrap_or_else(PoisonError::into_inner);
        enter();
        Held(Some(g))
    }
}

impl<T> Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match &self.0 {
            Some(g) => g,
            None => unreachable!("a held lock always has its guard"),
        }
    }
}

impl<T> DerefMut for Held<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        match &mut self.0 {
            Some(g) => g,
            None => unreachable!("a held lock always has its guard"),
        }
    }
}

impl<T> Drop for Held<'_, T> {
    fn drop(&mut self) {
        if self.0.take().is_some() {
            leave();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_leaf_at_a_time_and_a_wait_lets_it_go() {
        let a = Leaf::new(1);
        let b = Leaf::new(2);
        let x = *a.lock();
        let y = *b.lock();
        assert_eq!(x + y, 3, "one after the other");
        let cv = Condvar::new();
        let flag = std::sync::Arc::new(Leaf::new(false));
        let f2 = std::sync::Arc::clone(&flag);
        std::thread::scope(|s| {
            let mut g = flag.lock();
            s.spawn(|| {
                *f2.lock() = true;
                cv.notify_all();
            });
            while !*g {
                g = g.wait(&cv);
            }
        });
        let nested = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ga = a.lock();
            let _gb = b.lock();
        }));
        assert!(nested.is_err(), "a second leaf taken while one is held");
        // After the panic the thread holds none again.
        assert_eq!(*a.lock(), 1);
    }
}
