//! The linear memory and the stores of a node's live keys, counted
//! together, for the node's `max_guest_memory` and `max_live_keys` (eviction
//! triggers, `docs/eviction.md`).
//!
//! Every key's store has a [`KeyLimiter`]: the sandbox's limits
//! (`StoreLimits`: the key's `memory_limit`, tables, instances), which it
//! applies unchanged, and a count of the bytes its memories hold, added to
//! the node's [`GuestMemory`] as they grow and taken back when the store is
//! dropped; the store itself is counted from the limiter's making to its
//! drop (the instance-pool slot it may hold). It must not refuse anything
//! the sandbox's limits allow: the node's budgets evict idle keys, they never
//! fail a running one.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use wasmtime::{ResourceLimiter, StoreLimits};

/// Bytes of linear memory the node's live keys hold together, and how many
/// key stores exist (each holds, or is about to take, a slot of the
/// instance pool).
#[derive(Debug, Default)]
pub(crate) struct GuestMemory {
    bytes: AtomicU64,
    stores: AtomicUsize,
}

impl GuestMemory {
    /// The bytes held now.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// The key stores that exist now (starting, live, or ending but not yet
    /// dropped).
    pub(crate) fn stores(&self) -> usize {
        self.stores.load(Ordering::Relaxed)
    }
}

/// A key's store limiter: the sandbox's limits, and its share of the node's
/// [`GuestMemory`] (see the module header).
pub(crate) struct KeyLimiter {
    limits: StoreLimits,
    node: Arc<GuestMemory>,
    /// Bytes this store's memories hold, as counted.
    held: u64,
    /// The last growth allowed, undone if it then failed.
    last_growth: u64,
}

impl KeyLimiter {
    pub(crate) fn new(limits: StoreLimits, node: Arc<GuestMemory>) -> Self {
        node.stores.fetch_add(1, Ordering::Relaxed);
        KeyLimiter {
            limits,
            node,
            held: 0,
            last_growth: 0,
        }
    }
}

impl ResourceLimiter for KeyLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let allowed = self.limits.memory_growing(current, desired, maximum)?;
        self.last_growth = 0;
        if allowed {
            let growth = desired.saturating_sub(current) as u64;
            self.held += growth;
            self.last_growth = growth;
            self.node.bytes.fetch_add(growth, Ordering::Relaxed);
        }
        Ok(allowed)
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        let undone = std::mem::take(&mut self.last_growth);
        self.held -= undone;
        self.node.bytes.fetch_sub(undone, Ordering::Relaxed);
        self.limits.memory_grow_failed(error)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.limits.table_growing(current, desired, maximum)
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.limits.table_grow_failed(error)
    }

    fn instances(&self) -> usize {
        self.limits.instances()
    }

    fn tables(&self) -> usize {
        self.limits.tables()
    }

    fn memories(&self) -> usize {
        self.limits.memories()
    }
}

impl Drop for KeyLimiter {
    fn drop(&mut self) {
        self.node.bytes.fetch_sub(self.held, Ordering::Relaxed);
        self.node.stores.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stores_growth_and_the_store_are_counted_and_given_back_when_it_fails_or_drops() {
        let node = Arc::new(GuestMemory::default());
        let limits = wasmtime::StoreLimitsBuilder::new()
            .memory_size(1 << 20)
            .build();
        let mut a = KeyLimiter::new(limits.clone(), node.clone());
        let mut b = KeyLimiter::new(limits, node.clone());
        assert_eq!(node.stores(), 2);
        assert!(a.memory_growing(0, 65_536, None).unwrap());
        assert!(b.memory_growing(0, 131_072, None).unwrap());
        assert_eq!(node.bytes(), 196_608);
        // Past the key's own limit: refused by the sandbox, not counted.
        assert!(!a.memory_growing(65_536, 2 << 20, None).unwrap());
        assert_eq!(node.bytes(), 196_608);
        // Allowed, then failed: undone.
        assert!(a.memory_growing(65_536, 131_072, None).unwrap());
        a.memory_grow_failed(wasmtime::Error::msg("no")).unwrap();
        assert_eq!(node.bytes(), 196_608);
        drop(b);
        assert_eq!((node.bytes(), node.stores()), (65_536, 1));
        drop(a);
        assert_eq!((node.bytes(), node.stores()), (0, 0));
    }
}
