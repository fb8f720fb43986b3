//! The coherent single-owner cache: `get`/`put`/`delete` of byte values by
//! `(namespace, key)`, held and written only by the owner of the key's
//! partition.
//!
//! A cache key hashes to a partition exactly like a key process of the same
//! key, so a key's cache entries live beside its process. Every operation
//! routes to the partition's owner (forwarded over the transport if need be),
//! and the owner re-checks that it owns the partition before it reads or
//! writes: one writer per key, and a client reads its own writes.
//!
//! Entries never outlive an ownership change. Each entry remembers the
//! ownership token it was written under, and is served only while the node
//! still owns its partition under that same token; the node also drops
//! entries eagerly when it fences (all of them) and when its table changes
//! (those of partitions it no longer owns under the same token). So a fence,
//! a handoff or a takeover empties the partition's cache instead of letting a
//! stale value survive.
//!
//! Versions make read-modify-write safe: every write gets a version that is
//! higher than any version the partition ever had (`token << 32 | sequence`,
//! and tokens strictly increase at every change of owner), so a
//! compare-and-set against a version read before an ownership change can
//! never succeed against a value written after it.
//!
//! The store is bounded in bytes per node and per tenant, and evicts least
//! recently used entries, but only the writer's own: a tenant's put evicts
//! only that tenant's entries (its namespaces are `tenant/…`), and is
//! refused when the room it needs is held by others. Entries may carry a
//! time-to-live judged on the node's clock.

use std::sync::Arc;
use std::time::Duration;

use fief_core::time::Instant;
use fief_core::{OwnershipToken, PartitionId, Route};
use lru::LruCache;
use serde::{Deserialize, Serialize};

use crate::config::validate_key;
use crate::error::{Error, Result};
use crate::key::lock;
use crate::node::{NodeShared, refused};
use crate::transport::PeerRequest;

/// Longest cache namespace, in bytes.
pub const MAX_CACHE_NAMESPACE_BYTES: usize = 128;

/// Bytes charged per entry on top of its namespace, key and value (the
/// store's own bookkeeping), so many tiny entries still respect the bound.
const ENTRY_OVERHEAD: usize = 96;

/// A cached value and its version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheEntry {
    /// The value, as put.
    pub value: Vec<u8>,
    /// Its version: strictly increasing over every write of the partition,
    /// across owners. Never 0.
    pub version: u64,
    /// Time left before it expires, if it was put with a time-to-live.
    pub expires_in: Option<Duration>,
}

/// The precondition of a write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Expect {
    /// Write whatever is there.
    #[default]
    Any,
    /// Write only if there is no entry (`If-None-Match: *`).
    Absent,
    /// Write only if the entry's version is this one (`If-Match`).
    Version(u64),
}

/// Options of [`Cache::put`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PutOptions {
    /// Drop the entry after this long (judged on the owner's clock).
    pub ttl: Option<Duration>,
    /// The write's precondition.
    pub expect: Expect,
}

/// Counters of one node's cache store (the entries this node owns).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CacheStats {
    /// Reads that found a live entry.
    pub hits: u64,
    /// Reads that found none.
    pub misses: u64,
    /// Entries evicted to respect the memory bound.
    pub evictions: u64,
    /// Entries dropped because their time-to-live ran out.
    pub expirations: u64,
    /// Entries dropped because their partition changed owner or the node
    /// fenced.
    pub ownership_drops: u64,
    /// Entries held now.
    pub entries: u64,
    /// Bytes charged now (values, names and bookkeeping).
    pub bytes: u64,
    /// The bound on `bytes` (`cache_max_bytes`).
    pub max_bytes: u64,
}

/// One cache operation, as routed to the owner.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum CacheOp {
    Get {
        namespace: String,
        key: String,
    },
    Put {
        namespace: String,
        key: String,
        value: Vec<u8>,
        ttl_ms: Option<u64>,
        expect: Expect,
    },
    Delete {
        namespace: String,
        key: String,
        expect: Expect,
    },
}

impl CacheOp {
    fn key(&self) -> &str {
        let (CacheOp::Get { key, .. } | CacheOp::Put { key, .. } | CacheOp::Delete { key, .. }) =
            self;
        key
    }
}

/// What the owner answers to a [`CacheOp`] (sent back over the transport).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum CacheOutcome {
    Found(Option<CacheEntry>),
    Written {
        version: u64,
    },
    Deleted(bool),
    /// The precondition did not hold; carries the current version.
    Conflict {
        current: Option<u64>,
    },
}

impl CacheOutcome {
    pub(crate) fn encode(&self) -> Vec<u8> {
        postcard::to_stdvec(self).expect("cache outcomes always serialize")
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Self> {
        postcard::from_bytes(bytes)
            .map_err(|e| Error::Internal(format!("a peer sent a malformed cache reply: {e}")))
    }
}

struct Stored {
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

/// One writer's entries (a tenant's, or those outside any tenant), least
/// recently used first out.
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

/// The entries this node holds as owner. Pure bookkeeping: no I/O, no
/// clock reads (the caller passes `now`), so it is tested directly.
pub(crate) struct CacheStore {
    pools: std::collections::HashMap<String, Pool>,
    /// Per partition: the token of the current ownership and the last
    /// sequence number issued under it.
    sequences: std::collections::HashMap<PartitionId, (OwnershipToken, u32)>,
    bytes: usize,
    max_bytes: usize,
    /// The bound on one tenant's entries (not on those outside tenants).
    tenant_max_bytes: usize,
    stats: CacheStats,
}

impl CacheStore {
    /// An empty store bounded to `max_bytes`, and to `tenant_max_bytes` for
    /// each tenant's entries.
    pub(crate) fn new(max_bytes: usize, tenant_max_bytes: usize) -> Self {
        CacheStore {
            pools: std::collections::HashMap::new(),
            sequences: std::collections::HashMap::new(),
            bytes: 0,
            max_bytes,
            tenant_max_bytes: tenant_max_bytes.min(max_bytes),
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
                let limit = self.limit_of(&owner);
                if charge > limit {
                    return Err(Error::CacheEntryTooLarge {
                        size: charge,
                        limit,
                    });
                }
                // The room this put needs may come only from the writer's
                // own entries: refused, before anything changes, when the
                // rest of the bound is held by others.
                let pool = self.pools.entry(owner.clone()).or_default();
                let replaced = pool
                    .entries()
                    .peek(&id)
                    .map_or(0, |old| Stored::charge(&id.0, &id.1, &old.value));
                let own_others = pool.bytes - replaced;
                let must_free = (own_others + charge)
                    .saturating_sub(limit)
                    .max((self.bytes - replaced + charge).saturating_sub(self.max_bytes));
                if must_free > own_others {
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
                let pool = self.pools.entry(owner.clone()).or_default();
                pool.bytes += charge;
                pool.entries().push(
                    id,
                    Stored {
                        value,
                        version,
                        partition,
                        token,
                        expires_at,
                    },
                );
                self.evict_to_bound(&owner);
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
        let pool = self.pools.get_mut(owner_of(&id.0))?;
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
            None => self.pools.get_mut(owner_of(&id.0))?.entries().get(id),
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
        let Some(pool) = self.pools.get_mut(owner_of(&id.0)) else {
            return false;
        };
        match pool.entries().pop(id) {
            Some(stored) => {
                let charge = Stored::charge(&id.0, &id.1, &stored.value);
                self.bytes -= charge;
                pool.bytes -= charge;
                true
            }
            None => false,
        }
    }

    /// Evict `owner`'s least recently used entries until both its bound and
    /// the store's hold (the caller checked that its own entries suffice).
    fn evict_to_bound(&mut self, owner: &str) {
        let limit = self.limit_of(owner);
        let Some(pool) = self.pools.get_mut(owner) else {
            return;
        };
        while pool.bytes > limit || self.bytes > self.max_bytes {
            let Some((id, stored)) = pool.entries().pop_lru() else {
                break;
            };
            let charge = Stored::charge(&id.0, &id.1, &stored.value);
            self.bytes -= charge;
            pool.bytes -= charge;
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

/// Check a cache namespace: 1 to 128 bytes of ASCII letters, digits, `-`,
/// `_` and `.`; a tenant's namespaces are stored as `tenant/namespace`
/// ([`crate::auth`]), each part so.
pub(crate) fn validate_namespace(namespace: &str) -> Result<()> {
    let part_ok = |part: &str| {
        !part.is_empty()
            && part.len() <= MAX_CACHE_NAMESPACE_BYTES
            && part
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    };
    let ok = match namespace.split_once('/') {
        None => part_ok(namespace),
        Some((tenant, rest)) => part_ok(tenant) && part_ok(rest),
    };
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidKey(format!(
            "cache namespace {namespace:?} must be 1 to {MAX_CACHE_NAMESPACE_BYTES} bytes of ASCII letters, digits, '-', '_' and '.'"
        )))
    }
}

/// A handle on the cluster's coherent cache, from [`Instance::cache`]
/// (crate::Instance::cache). Operations go to the owner of the key's
/// partition, wherever it is.
///
/// # Examples
///
/// ```
/// # async fn example() -> fief::Result<()> {
/// use fief::cache::{Expect, PutOptions};
/// let node = fief::Instance::start_embedded(fief::NodeConfig::default()).await?;
/// let cache = node.cache();
/// let version = cache.put("sessions", "alice", b"token-1".to_vec(), PutOptions::default()).await?;
/// let entry = cache.get("sessions", "alice").await?.expect("a client reads its own write");
/// assert_eq!((entry.value.as_slice(), entry.version), (&b"token-1"[..], version));
/// // A compare-and-set against a version that is no longer current fails.
/// let stale = PutOptions { expect: Expect::Version(version), ..PutOptions::default() };
/// cache.put("sessions", "alice", b"token-2".to_vec(), stale).await?;
/// assert!(cache.put("sessions", "alice", b"token-3".to_vec(), stale).await.is_err());
/// # node.shutdown().await;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Cache {
    pub(crate) shared: Arc<NodeShared>,
}

impl Cache {
    /// Read an entry. `Ok(None)` when there is none (never put, deleted,
    /// expired, evicted, or dropped at an ownership change).
    ///
    /// # Errors
    ///
    /// Bad names ([`Error::InvalidKey`]), routing refusals ([`Error::Fenced`],
    /// [`Error::Unowned`]) or an unreachable owner.
    pub async fn get(&self, namespace: &str, key: &str) -> Result<Option<CacheEntry>> {
        let op = CacheOp::Get {
            namespace: namespace.to_owned(),
            key: key.to_owned(),
        };
        match self.shared.cache_op(op).await? {
            CacheOutcome::Found(entry) => Ok(entry),
            other => Err(unexpected_outcome(&other)),
        }
    }

    /// Write an entry; returns its new version.
    ///
    /// # Errors
    ///
    /// [`Error::VersionConflict`] when `options.expect` does not hold (nothing
    /// is written), a value over `max_message_size` or the cache bound, and
    /// the errors of [`Cache::get`].
    pub async fn put(
        &self,
        namespace: &str,
        key: &str,
        value: Vec<u8>,
        options: PutOptions,
    ) -> Result<u64> {
        self.shared.check_message(&value)?;
        let op = CacheOp::Put {
            namespace: namespace.to_owned(),
            key: key.to_owned(),
            value,
            ttl_ms: options
                .ttl
                .map(|ttl| u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)),
            expect: options.expect,
        };
        match self.shared.cache_op(op).await? {
            CacheOutcome::Written { version } => Ok(version),
            CacheOutcome::Conflict { current } => Err(Error::VersionConflict { current }),
            other => Err(unexpected_outcome(&other)),
        }
    }

    /// Delete an entry if `expect` holds; returns whether there was one.
    ///
    /// # Errors
    ///
    /// [`Error::VersionConflict`] when `expect` does not hold, and the errors
    /// of [`Cache::get`].
    pub async fn delete(&self, namespace: &str, key: &str, expect: Expect) -> Result<bool> {
        let op = CacheOp::Delete {
            namespace: namespace.to_owned(),
            key: key.to_owned(),
            expect,
        };
        match self.shared.cache_op(op).await? {
            CacheOutcome::Deleted(existed) => Ok(existed),
            CacheOutcome::Conflict { current } => Err(Error::VersionConflict { current }),
            other => Err(unexpected_outcome(&other)),
        }
    }

    /// This node's cache counters (the entries it holds as owner).
    pub fn stats(&self) -> CacheStats {
        self.shared.cache_stats()
    }
}

pub(crate) fn unexpected_outcome(outcome: &CacheOutcome) -> Error {
    Error::Internal(format!(
        "the owner answered a cache operation with {outcome:?}"
    ))
}

impl NodeShared {
    /// Run a cache operation on the owner of its key: here, or forwarded.
    pub(crate) async fn cache_op(self: &Arc<Self>, op: CacheOp) -> Result<CacheOutcome> {
        let (CacheOp::Get { namespace, key }
        | CacheOp::Put { namespace, key, .. }
        | CacheOp::Delete { namespace, key, .. }) = &op;
        validate_namespace(namespace)?;
        validate_key(key)?;
        let request = || PeerRequest::Cache(op.clone());
        match self.forward(key, request, self.config.call_timeout).await {
            Some(reply) => CacheOutcome::decode(&reply?),
            None => self.cache_local(op),
        }
    }

    /// Apply a cache operation here, only if this node owns the key's
    /// partition now (the owner's re-check); never forwards.
    pub(crate) fn cache_local(&self, op: CacheOp) -> Result<CacheOutcome> {
        match self.route(op.key()) {
            Route::Local { partition, token } => {
                let now = self.clock.now();
                lock(&self.cache).apply(op, partition, token, now)
            }
            Route::Forward { owner, .. } => Err(Error::NotOwner {
                owner: owner.to_string(),
            }),
            Route::Refuse(refusal) => Err(refused(refusal)),
        }
    }

    pub(crate) fn cache_stats(&self) -> CacheStats {
        lock(&self.cache).stats()
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
        let mut store = CacheStore::new(1 << 20, 1 << 20);
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
        let mut store = CacheStore::new(1 << 20, 1 << 20);
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
        let mut store = CacheStore::new(1 << 20, 1 << 20);
        store
            .apply(put("a", b"old", Expect::Any), P, T1, at(0))
            .unwrap();
        assert_eq!(found(store.apply(get("a"), P, T2, at(0)).unwrap()), None);
        assert_eq!(store.stats().ownership_drops, 1);
        assert_eq!(store.stats().entries, 0);
    }

    #[test]
    fn compare_and_set_checks_the_current_version() {
        let mut store = CacheStore::new(1 << 20, 1 << 20);
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
        let mut store = CacheStore::new(1 << 20, 1 << 20);
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
        let mut store = CacheStore::new(charge * 2, charge * 2);
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
        let mut store = CacheStore::new(unit * 10, unit * 4);
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

    #[test]
    fn retain_and_clear_drop_what_is_no_longer_owned() {
        let mut store = CacheStore::new(1 << 20, 1 << 20);
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

    #[test]
    fn namespaces_are_checked() {
        assert!(validate_namespace("sessions.v1").is_ok());
        assert!(validate_namespace("tenant/sessions").is_ok());
        for bad in ["", "a/b/c", "/b", "white space", &"x".repeat(129)] {
            let err = validate_namespace(bad).unwrap_err().to_string();
            assert!(err.contains("cache namespace"), "{err}");
        }
    }
}
