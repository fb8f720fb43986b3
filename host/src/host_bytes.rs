//! Host memory a key makes the node hold on its behalf, outside its own
//! linear memory: queued mailbox payloads (calls, casts, publications, timer
//! infos), armed timers' tags, subscriptions' topic names, and handoff states
//! waiting for the key's next process (issue 16, finding 3).
//!
//! Every such byte is charged to two ledgers — the key process's and its
//! tenant's — each with a limit: the module option `max_host_bytes_per_key`
//! (under the node ceiling and the tenant's cap) and the node's
//! `max_host_bytes_per_tenant` (lowered by the tenant's `host_bytes` cap).
//! A charge is a [`Held`] value that travels with what it pays for and gives
//! the bytes back when dropped, so a message taken out of a mailbox, a timer
//! that fired or was cancelled, a subscription removed or a store dropped
//! cannot leak a charge on some path.
//!
//! What happens when a ledger is full is the caller's decision: a message is
//! refused with [`crate::Error::HostMemory`], a timer or subscription import
//! fails with `limit`, a publication misses that subscriber (best effort,
//! guarantee 4). Handoff states are the one exception: they already exist
//! and refusing them would lose them, so they are charged with
//! [`Ledger::force`] — counted, possibly past the limit, which then refuses
//! the tenant's next charges until it is back under.
//!
//! This module only counts: it must not allocate per byte, lock, or do I/O
//! (it is on the message path).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;

pub use crate::error::Refusal;
use crate::sync::lock;

/// Bytes charged for each queued message on top of its payload: the queue
/// slot and the envelope.
pub(crate) const MESSAGE_OVERHEAD: usize = 128;
/// Bytes charged for each armed timer on top of its tag: its task and its
/// entry in the key's timer table.
pub(crate) const TIMER_OVERHEAD: usize = 512;
/// Bytes charged for each subscription on top of its topic (held twice):
/// the entries in the key's and the node's topic tables.
pub(crate) const SUBSCRIPTION_OVERHEAD: usize = 256;

/// One account of host bytes: a key process's or a tenant's.
#[derive(Debug)]
pub(crate) struct Ledger {
    /// Who the bytes are held for, for refusals and status.
    scope: Scope,
    used: AtomicUsize,
    limit: usize,
    /// Charges refused because this ledger was full.
    refused: AtomicU64,
    /// The tenant's ledger, for a key's.
    parent: Option<Arc<Ledger>>,
}

/// Whose ledger it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Scope {
    /// One key process.
    Key,
    /// A tenant (`""`: the modules of no tenant).
    Tenant(String),
}

impl Ledger {
    /// A tenant's ledger.
    pub(crate) fn tenant(tenant: &str, limit: usize) -> Arc<Ledger> {
        Arc::new(Ledger {
            scope: Scope::Tenant(tenant.to_owned()),
            used: AtomicUsize::new(0),
            limit,
            refused: AtomicU64::new(0),
            parent: None,
        })
    }

    /// A key process's ledger, inside its tenant's.
    pub(crate) fn key(tenant: &Arc<Ledger>, limit: usize) -> Arc<Ledger> {
        Arc::new(Ledger {
            scope: Scope::Key,
            used: AtomicUsize::new(0),
            limit,
            refused: AtomicU64::new(0),
            parent: Some(tenant.clone()),
        })
    }

    /// Bytes held now.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Charges refused so far.
    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Charge `bytes` to this ledger and its parent, or refuse if either
    /// would pass its limit (then nothing is charged).
    pub(crate) fn hold(self: &Arc<Self>, bytes: usize) -> Result<Held, Refusal> {
        self.take(bytes)?;
        if let Some(parent) = &self.parent
            && let Err(refusal) = parent.take(bytes)
        {
            self.give_back(bytes);
            return Err(refusal);
        }
        Ok(Held {
            ledger: Some(self.clone()),
            bytes,
        })
    }

    /// Charge `bytes` whatever the limit (what refusing would lose).
    pub(crate) fn force(self: &Arc<Self>, bytes: usize) -> Held {
        let mut ledger = Some(self);
        while let Some(l) = ledger {
            l.used.fetch_add(bytes, Ordering::Relaxed);
            ledger = l.parent.as_ref();
        }
        Held {
            ledger: Some(self.clone()),
            bytes,
        }
    }

    fn take(&self, bytes: usize) -> Result<(), Refusal> {
        let before = self.used.fetch_add(bytes, Ordering::Relaxed);
        if before.saturating_add(bytes) <= self.limit {
            return Ok(());
        }
        self.used.fetch_sub(bytes, Ordering::Relaxed);
        self.refused.fetch_add(1, Ordering::Relaxed);
        let (scope, option) = match &self.scope {
            Scope::Key => ("key process".to_owned(), "max_host_bytes_per_key"),
            Scope::Tenant(t) if t.is_empty() => (
                "modules of no tenant".to_owned(),
                "max_host_bytes_per_tenant",
            ),
            Scope::Tenant(t) => (format!("tenant {t:?}"), "max_host_bytes_per_tenant"),
        };
        Err(Refusal {
            scope,
            used: before,
            limit: self.limit,
            asked: bytes,
            option,
        })
    }

    fn give_back(&self, bytes: usize) {
        let before = self.used.fetch_sub(bytes, Ordering::Relaxed);
        debug_assert!(before >= bytes, "a ledger gave back more than it held");
    }
}

/// Bytes charged to a ledger (and its parent) until this is dropped.
#[derive(Debug, Default)]
#[must_use = "the charge is given back when this is dropped"]
pub(crate) struct Held {
    ledger: Option<Arc<Ledger>>,
    bytes: usize,
}

impl Held {
    /// No charge (for what is not counted, such as a stop order).
    pub(crate) fn none() -> Held {
        Held::default()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut ledger = self.ledger.as_deref();
        while let Some(l) = ledger {
            l.give_back(self.bytes);
            ledger = l.parent.as_deref();
        }
    }
}

/// The tenants' ledgers on one node, made on first use, each with the
/// node's `max_host_bytes_per_tenant`.
#[derive(Debug)]
pub(crate) struct TenantLedgers {
    ledgers: Mutex<HashMap<String, Arc<Ledger>>>,
    /// The node's `max_host_bytes_per_tenant`.
    default_limit: usize,
}

/// One tenant's host bytes, as `fief status` reports them.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct TenantHostBytes {
    /// The tenant (`""`: modules of no tenant).
    pub tenant: String,
    /// Bytes held now.
    pub bytes: usize,
    /// The tenant's limit.
    pub limit: usize,
    /// Charges refused because the tenant was full (since start).
    pub refused: u64,
}

impl TenantLedgers {
    pub(crate) fn new(default_limit: usize) -> Self {
        TenantLedgers {
            ledgers: Mutex::new(HashMap::new()),
            default_limit,
        }
    }

    /// The ledger of `tenant` (`""`: modules of no tenant).
    pub(crate) fn of(&self, tenant: &str) -> Arc<Ledger> {
        let mut ledgers = lock(&self.ledgers);
        if let Some(ledger) = ledgers.get(tenant) {
            return ledger.clone();
        }
        let ledger = Ledger::tenant(tenant, self.default_limit);
        ledgers.insert(tenant.to_owned(), ledger.clone());
        ledger
    }

    /// Every tenant's numbers, by name.
    pub(crate) fn report(&self) -> Vec<TenantHostBytes> {
        let mut out: Vec<_> = lock(&self.ledgers)
            .iter()
            .map(|(tenant, l)| TenantHostBytes {
                tenant: tenant.clone(),
                bytes: l.used(),
                limit: l.limit,
                refused: l.refused(),
            })
            .collect();
        out.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_charge_counts_in_key_and_tenant_until_dropped() {
        let tenant = Ledger::tenant("acme", 100);
        let key = Ledger::key(&tenant, 60);
        let a = key.hold(50).unwrap();
        assert_eq!((key.used(), tenant.used()), (50, 50));
        let refused = key.hold(11).unwrap_err();
        assert_eq!(refused.option, "max_host_bytes_per_key");
        assert_eq!((refused.used, refused.limit, refused.asked), (50, 60, 11));
        assert_eq!(
            (key.used(), tenant.used()),
            (50, 50),
            "a refusal charges nothing"
        );
        drop(a);
        assert_eq!((key.used(), tenant.used()), (0, 0));
    }

    #[test]
    fn the_tenant_limit_binds_across_its_keys() {
        let tenant = Ledger::tenant("acme", 100);
        let (k1, k2) = (Ledger::key(&tenant, 80), Ledger::key(&tenant, 80));
        let _a = k1.hold(70).unwrap();
        let refused = k2.hold(40).unwrap_err();
        assert_eq!(refused.scope, "tenant \"acme\"");
        assert_eq!(k2.used(), 0, "the key's own charge is undone");
        assert_eq!(tenant.refused(), 1);
        let _b = k2.hold(30).unwrap();
        assert_eq!(tenant.used(), 100);
    }

    #[test]
    fn a_forced_charge_passes_the_limit_and_blocks_the_next() {
        let tenant = Ledger::tenant("", 10);
        let state = tenant.force(25);
        assert_eq!(tenant.used(), 25);
        assert!(tenant.hold(1).is_err());
        drop(state);
        assert!(tenant.hold(10).is_ok());
    }
}
