//! Wake-ups made at the epoch ticker's next tick instead of by their
//! caller: how an eviction orders its victim to retire without the
//! activating caller paying for the wake.
//!
//! Waking a parked task wakes a parked thread (a futex wake, or an eventfd
//! write to a worker parked in the I/O driver, and on a VM an interrupt to
//! its vCPU): ~5 µs of an evicted key's ~70 µs reactivation, on the caller's
//! path, measured (docs/benchmarks.md, "Issue 20, sixteenth pass"). A
//! victim has no hurry: it holds a pool slot of the reserve kept for keys
//! retiring, and a message for it wakes it anyway. So the eviction sets the
//! victim's order (an atomic) at once and [`TickWakes::defer`]s the wake;
//! the epoch ticker thread, which runs every tick whatever happens, makes
//! the deferred wakes after bumping the epoch ([`TickWakes::flush`]): one
//! tick (1 ms by default) at most, many victims per thread wake-up. A start
//! that must wait for a pool slot flushes at once.
//!
//! The spawn of a key's task, when its caller starts the process and runs
//! the first call itself, waits here too (`KeyControl::defer_task`): the
//! spawn wakes a parked guest thread (~8 µs of a reactivation, measured in
//! docs/benchmarks.md, "Issue 20, seventeenth pass"), and the task has
//! nothing to do until the caller lets go. A message or an order for the
//! key spawns it sooner.
//!
//! A leaf: it knows nothing of what it wakes ([`TickWake`]); it must not
//! wait, nor hold its lock while waking.

use std::sync::{Arc, Mutex};

use crate::sync::lock;

/// Something to wake at the next tick.
pub(crate) trait TickWake: Send + Sync {
    /// Wake it (called on the ticker thread, or by a start that flushes).
    fn wake(&self);
}

/// The wakes deferred to the next tick (see the module header).
#[derive(Default)]
pub(crate) struct TickWakes {
    queue: Mutex<Vec<Arc<dyn TickWake>>>,
}

impl TickWakes {
    /// Wake `what` at the next tick.
    pub(crate) fn defer(&self, what: Arc<dyn TickWake>) {
        lock(&self.queue).push(what);
    }

    /// Make every deferred wake now. Returns how many there were.
    pub(crate) fn flush(&self) -> usize {
        let due = std::mem::take(&mut *lock(&self.queue));
        for what in &due {
            what.wake();
        }
        due.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    struct Counted(AtomicUsize);

    impl TickWake for Counted {
        fn wake(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_deferred_wake_happens_at_the_flush_once() {
        let wakes = TickWakes::default();
        let woken = Arc::new(Counted(AtomicUsize::new(0)));
        wakes.defer(woken.clone());
        wakes.defer(woken.clone());
        assert_eq!(woken.0.load(Ordering::SeqCst), 0, "not before the flush");
        assert_eq!(wakes.flush(), 2);
        assert_eq!(woken.0.load(Ordering::SeqCst), 2);
        assert_eq!(wakes.flush(), 0, "each wake once");
        assert_eq!(woken.0.load(Ordering::SeqCst), 2);
    }
}
