//! Eviction: live processes as a cache of keys (issue 20 item 1,
//! `docs/eviction.md`).
//!
//! This file owns the choice of victims: the least recently used *idle* key
//! of a module's table (for the module's `max_live_keys`, `evict_one`) or of
//! the whole node (for the node's instance pool, `oldest_idle` and
//! `evict_oldest`, asked by the node for each module in turn), and the
//! bookkeeping of an eviction that cannot complete (`eviction_abandoned`).
//! An eviction is an order: the victim is marked under its table's lock (no
//! inline call runs on it again, messages for it queue), and its own task
//! retires it at its next idle moment exactly as an idle timeout does
//! (`terminate(idle)`, store dropped, entry removed, queued messages handed
//! to a fresh process: `task.rs`, `ModuleSlot::retired`). It must not run
//! guest code, drop a store, or wait: it is called under the table's lock
//! on the activation path.
//!
//! **Idle** means: no message queued or being taken out, the process lock
//! free (no callback running, no inline call), no timer armed (an armed
//! timer is the key's promise to be woken; it lives in the process), not
//! killed, not a fence survivor, no eviction already ordered.

use std::num::NonZeroUsize;
use std::sync::atomic::Ordering;

use super::slot::{KeyHandle, KeyTable, ModuleSlot};
use super::{Eviction, lock};
use crate::tick_wakes::TickWakes;

/// Entries looked at from the least recently used end for a victim: a
/// bound on the work under the table's lock when the oldest keys are busy.
const EVICTION_SCAN: usize = 64;

/// Keys a module remembers as evicted lately (to count reactivations).
pub(super) const RECENTLY_EVICTED: NonZeroUsize = NonZeroUsize::new(4096).expect("not zero");

/// Whether `handle`'s key is idle now (see the module header).
fn is_idle(handle: &KeyHandle) -> bool {
    if handle.evicting
        || handle.tx.capacity() != handle.tx.max_capacity()
        || handle.control.is_killed()
        || handle.control.is_survivor()
    {
        return false;
    }
    // As `try_inline` reads them: the mailbox, then the process lock, then
    // `receiving` (a message the task took out is still flagged).
    let Ok(process) = handle.process.try_lock() else {
        return false;
    };
    if handle.control.receiving.load(Ordering::SeqCst) {
        return false;
    }
    process.as_ref().is_some_and(|p| p.timers_armed() == 0)
}

/// The least recently used idle key among the first [`EVICTION_SCAN`]
/// from the table's old end.
fn victim(keys: &KeyTable) -> Option<(&str, &KeyHandle)> {
    keys.iter()
        .rev()
        .take(EVICTION_SCAN)
        .find(|(_, handle)| is_idle(handle))
        .map(|(name, handle)| (&**name, handle))
}

impl ModuleSlot {
    /// Order the least recently used idle key of `keys` (this slot's table,
    /// locked) to retire, for `cause`, its task woken through `wakes` (at
    /// the next tick: `tick_wakes.rs`). Returns false when none is idle.
    pub(super) fn evict_one(
        &self,
        keys: &mut KeyTable,
        cause: Eviction,
        wakes: &TickWakes,
    ) -> bool {
        let Some(name) = victim(keys).map(|(name, _)| Box::<str>::from(name)) else {
            return false;
        };
        let handle = keys.peek_mut(&name).expect("found above");
        handle.evicting = true;
        handle.control.order_eviction(cause, wakes);
        // Out of the way of the next victim's scan: it stays in the table
        // until its store is dropped, and with more than `EVICTION_SCAN`
        // retiring at once (a busy node's reserve holds hundreds) the scan
        // found only them at the old end and refused a start with thousands
        // of idle keys live (the 10-million-key bench: 88 % refused).
        keys.promote(&name);
        self.evicting.fetch_add(1, Ordering::Relaxed);
        lock(&self.recently_evicted).put(name, ());
        true
    }

    /// When this module's least recently used idle key was last used (an
    /// epoch tick), if it has one: the node compares modules by it.
    pub(crate) fn oldest_idle(&self) -> Option<u64> {
        victim(&lock(&self.keys)).map(|(_, handle)| handle.last_used)
    }

    /// Order this module's least recently used idle key to retire, for a
    /// node budget (`cause`), its task woken through `wakes`. Returns false
    /// when none is idle (any more).
    pub(crate) fn evict_oldest(&self, cause: Eviction, wakes: &TickWakes) -> bool {
        self.evict_one(&mut lock(&self.keys), cause, wakes)
    }

    /// Evictions ordered and not yet done.
    pub(crate) fn evictions_in_flight(&self) -> usize {
        self.evicting.load(Ordering::Relaxed)
    }

    /// The key's task cannot retire it (it armed a timer after it was
    /// chosen, or it is no longer the key's current process): it counts
    /// against the module's budget again.
    pub(super) fn eviction_abandoned(&self, key: &str, generation: u64) {
        let mut keys = lock(&self.keys);
        if let Some(handle) = keys.peek_mut(key)
            && handle.generation == generation
            && handle.evicting
        {
            handle.evicting = false;
            self.evicting.fetch_sub(1, Ordering::Relaxed);
            lock(&self.recently_evicted).pop(key);
        }
    }
}
