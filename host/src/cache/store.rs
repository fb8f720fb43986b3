//! The cache's entries on their owner: pure bookkeeping (no I/O, no clock
//! reads; the caller passes `now`), tested directly.
//!
//! It owns versions (`token << 32 | sequence` per partition), expiry, and
//! the bounds: bytes per node, per tenant and per namespace, each entry
//! charged for its namespace, key, value and [`ENTRY_OVERHEAD`]. Least
//! recently used entries are evicted, but only the writer namespace's own:
//! a put never evicts another namespace's entries (another tenant's or the
//! same tenant's), and is refused (`cache_full`) when the room it needs is
//! held by others. It must not route, lock or wait: [`super`] does that.

use std::collections::HashMap;
use std::time::Duration;

use fief_core::time::Instant;
use fief_core::{OwnershipToken, PartitionId};
use lru::LruCache;

use super::CacheStats;
use crate::error::{Error, Result};
use crate::wire::{CacheEntry, CacheOp, CacheOutcome, Expect};

/// Bytes charged per entry on top of its namespace, key and value (the
/// store's own bookkeeping), so many tiny entries still respect the bound.
const ENTRY_OVERHEAD: usize = 96;

struct Stored {
    /// When it was last read or written, on the store's use counter: the
    /// oldest head among a tenant's namespaces is its least recently used.
    used: u64,
    value: Vec<u8>,
    version: u64,
    partition: PartitionId,
    token: OwnershipToken,
    expires_at: Option<Instant>,
}

impl Stored {
    fn charge(namespace: &str, key: &str, value: &[u8]) -> usize {
        namespace.len() + key.len() + value.len() + ENTRY_OVERHEAD
    }
}

/// One namespace's entries, least recently used first out.
#[derive(Default)]
struct Pool {
    entries: Option<LruCache<(String, String), Stored>>,
    bytes: usize,
}

impl Pool {
    fn entries(&mut self) -> &mut LruCache<(String, String), Stored> {
        self.entries.get_or_insert_with(LruCache::unbounded)
    }

    fn len(&self) -> usize {
        self.entries.as_ref().map_or(0, LruCache::len)
    }
}

/// Whose an entry of `namespace` is: the tenant of a `tenant/…` namespace,
/// or `""` outside any tenant.
fn owner_of(namespace: &str) -> &str {
    namespace.split_once('/').map_or("", |(tenant, _)| tenant)
}

/// What one tenant (or the namespaces outside tenants, `""`) holds.
#[derive(Default)]
struct Tally {
    bytes: usize,
    namespaces: std::collections::BTreeSet<String>,
}

/// The entries this node holds as owner. Pure bookkeeping: no I/O, no
/// clock reads (the caller passes `now`), so it is tested directly.
pub(crate) struct CacheStore {
    /// By namespace.
    pools: HashMap<String, Pool>,
    /// By owner of the namespace (see [`owner_of`]).
    owners: HashMap<String, Tally>,
    /// The use counter (see [`Stored::used`]).
    uses: u64,
    /// Per partition: the token of the current ownership and the last
    /// sequence number issued under it.
    sequences: std::collections::HashMap<PartitionId, (OwnershipToken, u32)>,
    bytes: usize,
    max_bytes: usize,
    /// The bound on one tenant's entries (not on those outside tenants).
    tenant_max_bytes: usize,
    /// The bound on one namespace's entries.
    namespace_max_bytes: usize,
    stats: CacheStats,
}

impl CacheStore {
    /// An empty store bounded to `max_bytes`, to `tenant_max_bytes` for each
    /// tenant's entries and to `namespace_max_bytes` for each namespace's.
    pub(crate) fn new(
        max_bytes: usize,
        tenant_max_bytes: usize,
        namespace_max_bytes: usize,
    ) -> Self {
        CacheStore {
            pools: HashMap::new(),
            owners: HashMap::new(),
            uses: 0,
            sequences: HashMap::new(),
            bytes: 0,
            max_bytes,
            tenant_max_bytes: tenant_max_bytes.min(max_bytes),
            namespace_max_bytes: namespace_max_bytes.min(max_bytes),
            stats: CacheStats::default(),
        }
    }

    /// The bound on the entries of `owner`.
    fn limit_of(&self, owner: &str) -> usize {
        if owner.is_empty() {
            self.max_bytes
        } else {
            self.tenant_max_bytes
        }
    }

    /// The bound on the entries of `namespace` (never above its owner's).
    fn namespace_limit(&self, owner: &str) -> usize {
        self.namespace_max_bytes.min(self.limit_of(owner))
    }

    fn next_use(&mut self) -> u64 {
        self.uses += 1;
        self.uses
    }

    /// Apply `op` as owner of `partition` under `token`, at `now`.
    pub(crate) fn apply(
        &mut self,
        op: CacheOp,
        partition: PartitionId,
        token: OwnershipToken,
        now: Instant,
    ) -> Result<CacheOutcome> {
        match op {
            CacheOp::Get { namespace, key } => {
                let id = (namespace, key);
                let found = self.live(&id, token, now).map(|stored| CacheEntry {
                    value: stored.value.clone(),
                    version: stored.version,
                    expires_in: stored
                        .expires_at
                        .map(|at| at.saturating_duration_since(now)),
                });
                match found {
                    Some(_) => self.stats.hits += 1,
                    None => self.stats.misses += 1,
                }
                Ok(CacheOutcome::Found(found))
            }
            CacheOp::Put {
                namespace,
                key,
                value,
                ttl_ms,
                expect,
            } => {
                let id = (namespace, key);
                let current = self.live(&id, token, now).map(|s| s.version);
                if !holds(expect, current) {
                    return Ok(CacheOutcome::Conflict { current });
                }
                let charge = Stored::charge(&id.0, &id.1, &value);
                let owner = owner_of(&id.0).to_owned();
                let limit = self.namespace_limit(&owner);
                if charge > limit {
                    return Err(Error::CacheEntryTooLarge {
                        size: charge,
                        limit,
                    });
                }
                // The room this put needs may come only from the writer
                // tenant's own entries (its namespace's first): refused,
                // before anything changes, when the rest of the bound is
                // held by others. A namespace over its own bound frees room
                // from its own entries, which are the tenant's too.
                let replaced = self
                    .pools
                    .get(&id.0)
                    .and_then(|pool| pool.entries.as_ref()?.peek(&id))
                    .map_or(0, |old| Stored::charge(&id.0, &id.1, &old.value));
                let tenant_others = self.owners.get(&owner).map_or(0, |t| t.bytes) - replaced;
                let must_free = (tenant_others + charge)
                    .saturating_sub(self.limit_of(&owner))
                    .max((self.bytes - replaced + charge).saturating_sub(self.max_bytes));
                if must_free > tenant_others {
                    return Err(Error::CacheFull {
                        size: charge,
                        limit: self.max_bytes,
                    });
                }
                let version = self.next_version(partition, token)?;
                let expires_at = ttl_ms
                    .map(|ms| Instant::from_origin(now.since_origin() + Duration::from_millis(ms)));
                self.remove(&id);
                self.bytes += charge;
                let tally = self.owners.entry(owner.clone()).or_default();
                tally.bytes += charge;
                if !tally.namespaces.contains(&id.0) {
                    tally.namespaces.insert(id.0.clone());
                }
                let used = self.next_use();
                let namespace = id.0.clone();
                let pool = self.pools.entry(namespace.clone()).or_default();
                pool.bytes += charge;
                pool.entries().push(
                    id,
                    Stored {
                        used,
                        value,
                        version,
                        partition,
                        token,
                        expires_at,
                    },
                );
                self.evict_to_bound(&namespace, &owner);
                Ok(CacheOutcome::Written { version })
            }
            CacheOp::Delete {
                namespace,
                key,
                expect,
            } => {
                let id = (namespace, key);
                let current = self.live(&id, token, now).map(|s| s.version);
                if !holds(expect, current) {
                    return Ok(CacheOutcome::Conflict { current });
                }
                Ok(CacheOutcome::Deleted(self.remove(&id)))
            }
        }
    }

    /// The entry `id` if it is live: written under `token` (the partition's
    /// current ownership) and not expired. A dead entry is dropped.
    fn live(
        &mut self,
        id: &(String, String),
        token: OwnershipToken,
        now: Instant,
    ) -> Option<&Stored> {
        let pool = self.pools.get_mut(&id.0)?;
        let dead = match pool.entries().peek(id) {
            None => return None,
            Some(stored) if stored.token != token => Some(false),
            Some(stored) if stored.expires_at.is_some_and(|at| at <= now) => Some(true),
            Some(_) => None,
        };
        match dead {
            Some(expired) => {
                self.remove(id);
                if expired {
                    self.stats.expirations += 1;
                } else {
                    self.stats.ownership_drops += 1;
                }
                None
            }
            None => {
                let used = self.next_use();
                let stored = self.pools.get_mut(&id.0)?.entries().get_mut(id)?;
                stored.used = used;
                Some(stored)
            }
        }
    }

    /// The next version in `partition`: above every version any owner ever
    /// issued there, because `token` is above every earlier owner's token.
    fn next_version(&mut self, partition: PartitionId, token: OwnershipToken) -> Result<u64> {
        let high = u32::try_from(token.0).map_err(|_| {
            Error::Internal(format!(
                "ownership token {} is beyond the cache's version space (2^32 tokens)",
                token.0
            ))
        })?;
        let (seen, sequence) = self.sequences.entry(partition).or_insert((token, 0));
        if *seen != token {
            *seen = token;
            *sequence = 0;
        }
        *sequence = sequence.checked_add(1).ok_or_else(|| {
            Error::Internal(format!(
                "partition {partition} used up its 2^32 cache versions under this ownership; they renew at its next change of owner"
            ))
        })?;
        Ok(u64::from(high) << 32 | u64::from(*sequence))
    }

    fn remove(&mut self, id: &(String, String)) -> bool {
        let Some(stored) = self.pools.get_mut(&id.0).and_then(|p| p.entries().pop(id)) else {
            return false;
        };
        self.uncharge(id, &stored);
        true
    }

    /// Take `stored` (just popped from its namespace's pool) off the books;
    /// an emptied namespace is forgotten.
    fn uncharge(&mut self, id: &(String, String), stored: &Stored) {
        let charge = Stored::charge(&id.0, &id.1, &stored.value);
        self.bytes -= charge;
        let owner = owner_of(&id.0);
        let pool = self.pools.get_mut(&id.0).expect("the entry's pool");
        pool.bytes -= charge;
        let emptied = pool.len() == 0;
        if emptied {
            self.pools.remove(&id.0);
        }
        if let Some(tally) = self.owners.get_mut(owner) {
            tally.bytes -= charge;
            if emptied {
                tally.namespaces.remove(&id.0);
            }
            if tally.namespaces.is_empty() {
                self.owners.remove(owner);
            }
        }
    }

    /// Evict least recently used entries of `owner` until every bound holds
    /// (the caller checked that the owner's entries suffice): first
    /// `namespace`'s own while it is over its bound, then the owner's oldest
    /// across its namespaces while the owner or the store is over.
    fn evict_to_bound(&mut self, namespace: &str, owner: &str) {
        let namespace_limit = self.namespace_limit(owner);
        while self
            .pools
            .get(namespace)
            .is_some_and(|p| p.bytes > namespace_limit)
        {
            self.evict_from(namespace);
        }
        let limit = self.limit_of(owner);
        while self.owners.get(owner).is_some_and(|t| t.bytes > limit) || self.bytes > self.max_bytes
        {
            // The namespace whose least recently used entry is the oldest.
            let Some(oldest) = self.owners.get(owner).and_then(|tally| {
                tally
                    .namespaces
                    .iter()
                    .filter_map(|ns| {
                        Some((self.pools.get(ns)?.entries.as_ref()?.peek_lru()?.1.used, ns))
                    })
                    .min()
                    .map(|(_, ns)| ns.clone())
            }) else {
                break;
            };
            self.evict_from(&oldest);
        }
    }

    /// Evict the least recently used entry of `namespace`.
    fn evict_from(&mut self, namespace: &str) {
        if let Some((id, stored)) = self
            .pools
            .get_mut(namespace)
            .and_then(|p| p.entries().pop_lru())
        {
            self.uncharge(&id, &stored);
            self.stats.evictions += 1;
        }
    }

    /// Drop every entry whose partition is not owned under the same token
    /// any more (`owned` answers for a partition and token). Returns how many
    /// were dropped.
    pub(crate) fn retain_owned(
        &mut self,
        owned: impl Fn(PartitionId, OwnershipToken) -> bool,
    ) -> usize {
        let gone: Vec<(String, String)> = self
            .pools
            .values()
            .filter_map(|pool| pool.entries.as_ref())
            .flat_map(LruCache::iter)
            .filter(|(_, stored)| !owned(stored.partition, stored.token))
            .map(|(id, _)| id.clone())
            .collect();
        for id in &gone {
            self.remove(id);
        }
        self.sequences.retain(|p, (token, _)| owned(*p, *token));
        self.stats.ownership_drops += gone.len() as u64;
        gone.len()
    }

    /// Drop everything (the node fenced).
    pub(crate) fn clear(&mut self) -> usize {
        self.retain_owned(|_, _| false)
    }

    /// The store's counters.
    pub(crate) fn stats(&self) -> CacheStats {
        CacheStats {
            entries: self.pools.values().map(Pool::len).sum::<usize>() as u64,
            bytes: self.bytes as u64,
            max_bytes: self.max_bytes as u64,
            ..self.stats.clone()
        }
    }
}

fn holds(expect: Expect, current: Option<u64>) -> bool {
    match expect {
        Expect::Any => true,
        Expect::Absent => current.is_none(),
        Expect::Version(v) => current == Some(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: PartitionId = PartitionId(7);
    const T1: OwnershipToken = OwnershipToken(1);
    const T2: OwnershipToken = OwnershipToken(2);

    fn at(ms: u64) -> Instant {
        Instant::from_origin(Duration::from_millis(ms))
    }

    fn put(key: &str, value: &[u8], expect: Expect) -> CacheOp {
        CacheOp::Put {
            namespace: "ns".into(),
            key: key.into(),
            value: value.to_vec(),
            ttl_ms: None,
            expect,
        }
    }

    fn get(key: &str) -> CacheOp {
        CacheOp::Get {
            namespace: "ns".into(),
            key: key.into(),
        }
    }

    fn version(outcome: CacheOutcome) -> u64 {
        match outcome {
            CacheOutcome::Written { version } => version,
            other => panic!("expected a write, got {other:?}"),
        }
    }

    fn found(outcome: CacheOutcome) -> Option<CacheEntry> {
        match outcome {
            CacheOutcome::Found(entry) => entry,
            other => panic!("expected a read, got {other:?}"),
        }
    }

    #[test]
    fn reads_its_own_writes_and_counts_hits_and_misses() {
        let mut store = CacheStore::new(1 << 20, 1 << 20, 1 << 20);
        assert_eq!(found(store.apply(get("a"), P, T1, at(0)).unwrap()), None);
        let v = version(
            store
                .apply(put("a", b"x", Expect::Any), P, T1, at(0))
                .unwrap(),
        );
        let entry = found(store.apply(get("a"), P, T1, at(0)).unwrap()).unwrap();
        assert_eq!((entry.value, entry.version), (b"x".to_vec(), v));
        let stats = store.stats();
        assert_eq!((stats.hits, stats.misses, stats.entries), (1, 1, 1));
    }

    #[test]
    fn versions_rise_across_ownership_changes() {
        let mut store = CacheStore::new(1 << 20, 1 << 20, 1 << 20);
        let v1 = version(
            store
                .apply(put("a", b"1", Expect::Any), P, T1, at(0))
                .unwrap(),
        );
        let v2 = version(
            store
                .apply(put("a", b"2", Expect::Any), P, T1, at(0))
                .unwrap(),
        );
        assert!(v2 > v1);
        // A new owner (higher token) starts above everything the old one
        // issued, so a CAS with an old version can never match a new value.
        let v3 = version(
            store
                .apply(put("b", b"3", Expect::Any), P, T2, at(0))
                .unwrap(),
        );
        assert!(v3 > v2, "{v3} > {v2}");
        assert_eq!(
            v1 & 0xffff_ffff,
            1,
            "sequences start at 1: versions are never 0"
        );
    }

    #[test]
    fn entries_of_an_earlier_ownership_are_never_served() {
        let mut store = CacheStore::new(1 << 20, 1 << 20, 1 << 20);
        store
            .apply(put("a", b"old", Expect::Any), P, T1, at(0))
            .unwrap();
        assert_eq!(found(store.apply(get("a"), P, T2, at(0)).unwrap()), None);
        assert_eq!(store.stats().ownership_drops, 1);
        assert_eq!(store.stats().entries, 0);
    }

    #[test]
    fn compare_and_set_checks_the_current_version() {
        let mut store = CacheStore::new(1 << 20, 1 << 20, 1 << 20);
        let v = version(
            store
                .apply(put("a", b"1", Expect::Absent), P, T1, at(0))
                .unwrap(),
        );
        assert_eq!(
            store
                .apply(put("a", b"2", Expect::Absent), P, T1, at(0))
                .unwrap(),
            CacheOutcome::Conflict { current: Some(v) }
        );
        let v2 = version(
            store
                .apply(put("a", b"2", Expect::Version(v)), P, T1, at(0))
                .unwrap(),
        );
        assert_eq!(
            store
                .apply(put("a", b"3", Expect::Version(v)), P, T1, at(0))
                .unwrap(),
            CacheOutcome::Conflict { current: Some(v2) }
        );
        let delete = |expect| CacheOp::Delete {
            namespace: "ns".into(),
            key: "a".into(),
            expect,
        };
        assert_eq!(
            store
                .apply(delete(Expect::Version(v)), P, T1, at(0))
                .unwrap(),
            CacheOutcome::Conflict { current: Some(v2) }
        );
        assert_eq!(
            store
                .apply(delete(Expect::Version(v2)), P, T1, at(0))
                .unwrap(),
            CacheOutcome::Deleted(true)
        );
    }

    #[test]
    fn entries_expire_on_the_given_clock() {
        let mut store = CacheStore::new(1 << 20, 1 << 20, 1 << 20);
        let op = CacheOp::Put {
            namespace: "ns".into(),
            key: "a".into(),
            value: b"x".to_vec(),
            ttl_ms: Some(100),
            expect: Expect::Any,
        };
        store.apply(op, P, T1, at(1_000)).unwrap();
        let entry = found(store.apply(get("a"), P, T1, at(1_040)).unwrap()).unwrap();
        assert_eq!(entry.expires_in, Some(Duration::from_millis(60)));
        assert_eq!(
            found(store.apply(get("a"), P, T1, at(1_100)).unwrap()),
            None
        );
        assert_eq!(store.stats().expirations, 1);
    }

    #[test]
    fn the_memory_bound_evicts_the_least_recently_used() {
        let charge = Stored::charge("ns", "a", &[0; 100]);
        let mut store = CacheStore::new(charge * 2, charge * 2, charge * 2);
        store
            .apply(put("a", &[0; 100], Expect::Any), P, T1, at(0))
            .unwrap();
        store
            .apply(put("b", &[0; 100], Expect::Any), P, T1, at(0))
            .unwrap();
        // Touch `a`, so `b` is the least recently used.
        store.apply(get("a"), P, T1, at(0)).unwrap();
        store
            .apply(put("c", &[0; 100], Expect::Any), P, T1, at(0))
            .unwrap();
        assert!(found(store.apply(get("a"), P, T1, at(0)).unwrap()).is_some());
        assert!(found(store.apply(get("b"), P, T1, at(0)).unwrap()).is_none());
        let stats = store.stats();
        assert_eq!((stats.evictions, stats.entries), (1, 2));
        assert!(stats.bytes <= stats.max_bytes);
        let err = store
            .apply(put("d", &[0; 1000], Expect::Any), P, T1, at(0))
            .unwrap_err();
        assert!(matches!(err, Error::CacheEntryTooLarge { .. }), "{err}");
    }

    fn put_in(namespace: &str, key: &str, size: usize) -> CacheOp {
        CacheOp::Put {
            namespace: namespace.into(),
            key: key.into(),
            value: vec![0; size],
            ttl_ms: None,
            expect: Expect::Any,
        }
    }

    fn has(store: &mut CacheStore, namespace: &str, key: &str) -> bool {
        let op = CacheOp::Get {
            namespace: namespace.into(),
            key: key.into(),
        };
        found(store.apply(op, P, T1, at(0)).unwrap()).is_some()
    }

    /// Issue 16, finding 8: one pool's LRU crossed tenants, so tenant A
    /// writing 100 MB evicted tenant B's entries. A tenant's writes now evict
    /// only its own entries, within its own bound, and a write that needs
    /// room others hold is refused.
    #[test]
    fn a_tenant_evicts_only_its_own_entries() {
        let unit = Stored::charge("acme/ns", "k00", &[0; 1000]);
        // Room for 10 entries; 4 per tenant.
        let mut store = CacheStore::new(unit * 10, unit * 4, unit * 4);
        for i in 0..3 {
            store
                .apply(put_in("globex/ns", &format!("k{i:02}"), 1000), P, T1, at(0))
                .unwrap();
        }
        // acme writes far more than its bound: it evicts its own oldest.
        for i in 0..50 {
            store
                .apply(put_in("acme/ns", &format!("k{i:02}"), 1000), P, T1, at(0))
                .unwrap();
        }
        for i in 0..3 {
            assert!(
                has(&mut store, "globex/ns", &format!("k{i:02}")),
                "globex lost k{i:02}"
            );
        }
        assert!(has(&mut store, "acme/ns", "k49") && !has(&mut store, "acme/ns", "k45"));
        assert_eq!(store.stats().entries, 7);
        // Outside tenants (an open node's namespaces) fill the rest of the
        // store; then a tenant with nothing of its own to evict is refused,
        // and nobody's entries are touched.
        for i in 0..3 {
            store
                .apply(put_in("ns", &format!("k{i:02}"), 1000), P, T1, at(0))
                .unwrap();
        }
        let err = store
            .apply(put_in("initech/ns", "k00", 1000), P, T1, at(0))
            .unwrap_err();
        assert!(matches!(err, Error::CacheFull { .. }), "{err}");
        assert_eq!(store.stats().entries, 10);
        assert!(has(&mut store, "globex/ns", "k00") && has(&mut store, "ns", "k00"));
        // One entry over a tenant's bound is too large for any tenant.
        let err = store
            .apply(put_in("acme/ns", "big", 5000), P, T1, at(0))
            .unwrap_err();
        assert!(matches!(err, Error::CacheEntryTooLarge { .. }), "{err}");
        assert!(store.stats().bytes <= store.stats().max_bytes);
    }

    /// Issue 16, finding 8: per-namespace quotas. A namespace over its own
    /// bound evicts only its own entries; under the tenant's bound the
    /// tenant's least recently used entry goes, whichever namespace holds it.
    #[test]
    fn a_namespace_evicts_only_its_own_entries_past_its_bound() {
        let unit = Stored::charge("acme/a", "k0", &[0; 100]);
        // Room for 10 entries; 6 per tenant; 3 per namespace.
        let mut store = CacheStore::new(unit * 10, unit * 6, unit * 3);
        for i in 0..3 {
            store
                .apply(put_in("acme/b", &format!("k{i}"), 100), P, T1, at(0))
                .unwrap();
        }
        for i in 0..5 {
            store
                .apply(put_in("acme/a", &format!("k{i}"), 100), P, T1, at(0))
                .unwrap();
        }
        // `a` keeps its newest three; `b`, under its bound, lost nothing.
        assert!((0..2).all(|i| !has(&mut store, "acme/a", &format!("k{i}"))));
        assert!((2..5).all(|i| has(&mut store, "acme/a", &format!("k{i}"))));
        assert!((0..3).all(|i| has(&mut store, "acme/b", &format!("k{i}"))));
        // A third namespace passes the tenant's bound: the tenant's least
        // recently used entry goes (`a`'s k2, read before `b`'s above).
        store
            .apply(put_in("acme/c", "k0", 100), P, T1, at(0))
            .unwrap();
        assert!(!has(&mut store, "acme/a", "k2"));
        assert!(has(&mut store, "acme/b", "k0") && has(&mut store, "acme/c", "k0"));
        assert_eq!(store.stats().bytes as usize, unit * 6);
        // One entry over a namespace's bound is too large.
        let err = store
            .apply(put_in("acme/a", "big", 700), P, T1, at(0))
            .unwrap_err();
        assert!(matches!(err, Error::CacheEntryTooLarge { .. }), "{err}");
    }

    #[test]
    fn retain_and_clear_drop_what_is_no_longer_owned() {
        let mut store = CacheStore::new(1 << 20, 1 << 20, 1 << 20);
        store
            .apply(put("a", b"1", Expect::Any), PartitionId(1), T1, at(0))
            .unwrap();
        store
            .apply(put("b", b"2", Expect::Any), PartitionId(2), T1, at(0))
            .unwrap();
        assert_eq!(store.retain_owned(|p, _| p == PartitionId(1)), 1);
        assert_eq!(store.stats().entries, 1);
        assert_eq!(store.clear(), 1);
        let stats = store.stats();
        assert_eq!(
            (stats.entries, stats.bytes, stats.ownership_drops),
            (0, 0, 2)
        );
    }
}
