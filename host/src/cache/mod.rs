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
//! The store ([`store`]) is bounded in bytes per node, per tenant and per
//! namespace, and evicts least recently used entries, but only the writer's
//! own: a put evicts only its namespace's entries past the namespace's
//! bound, and only its tenant's (its namespaces are `tenant/…`) past the
//! tenant's, and is refused when the room it needs is held by others. Entries may carry a
//! time-to-live judged on the node's clock.
//!
//! This module is the cache's public handle ([`Cache`]), its names and
//! values, and the owner's store; it sits below the node and must not route.
//! The handle reaches its node only through `CacheNode`; the routing
//! itself (forward to the owner, the owner's re-check, the node's store) is
//! the node's, `node/cache_routing.rs`.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::error::{Error, Result};
pub use crate::wire::{CacheEntry, Expect};
use crate::wire::{CacheOp, CacheOutcome};

mod store;
pub(crate) use store::CacheStore;

/// Longest cache namespace, in bytes.
pub const MAX_CACHE_NAMESPACE_BYTES: usize = 128;

/// Options of [`Cache::put`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PutOptions {
    /// Drop the entry after this long (judged on the owner's clock).
    pub ttl: Option<Duration>,
    /// The write's precondition.
    pub expect: Expect,
}

/// Counters of one node's cache store (the entries this node owns).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
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
    node: Arc<dyn CacheNode>,
}

/// A future a [`CacheNode`] operation answers with.
pub(crate) type CacheFuture = Pin<Box<dyn Future<Output = Result<CacheOutcome>> + Send>>;

/// What a [`Cache`] handle needs of its node: the routing of an operation to
/// the key's owner, the node's size limit, and its store's counters.
/// `NodeShared` implements it (`node/cache_routing.rs`); the handle holds it
/// as a trait object, so this module does not depend on the node.
pub(crate) trait CacheNode: Send + Sync {
    /// Run `op` here if this node owns its key's partition now (or refuse
    /// it: a bad name, a fenced node); give it back when it must go to
    /// another node. No future, no allocation: the local path of every
    /// operation.
    fn run_here(&self, op: CacheOp) -> std::result::Result<Result<CacheOutcome>, CacheOp>;

    /// Run `op` on the owner of its key, forwarding it if that is another
    /// node.
    fn run(self: Arc<Self>, op: CacheOp) -> CacheFuture;

    /// Refuse a value over the node's `max_message_size`.
    ///
    /// # Errors
    ///
    /// [`Error::MessageTooLarge`] with the sizes.
    fn check_value(&self, value: &[u8]) -> Result<()>;

    /// This node's cache counters (the entries it holds as owner).
    fn stats(&self) -> CacheStats;
}

impl Cache {
    /// A handle on the cache through `node`.
    pub(crate) fn new(node: Arc<dyn CacheNode>) -> Cache {
        Cache { node }
    }

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
        match self.run(op).await? {
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
        self.node.check_value(&value)?;
        let op = CacheOp::Put {
            namespace: namespace.to_owned(),
            key: key.to_owned(),
            value,
            ttl_ms: options
                .ttl
                .map(|ttl| u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)),
            expect: options.expect,
        };
        match self.run(op).await? {
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
        match self.run(op).await? {
            CacheOutcome::Deleted(existed) => Ok(existed),
            CacheOutcome::Conflict { current } => Err(Error::VersionConflict { current }),
            other => Err(unexpected_outcome(&other)),
        }
    }

    /// This node's cache counters (the entries it holds as owner).
    pub fn stats(&self) -> CacheStats {
        self.node.stats()
    }

    /// Run `op` on its key's owner: here without a future when this node
    /// owns it, else forwarded.
    async fn run(&self, op: CacheOp) -> Result<CacheOutcome> {
        match self.node.run_here(op) {
            Ok(outcome) => outcome,
            Err(op) => self.node.clone().run(op).await,
        }
    }
}

pub(crate) fn unexpected_outcome(outcome: &CacheOutcome) -> Error {
    Error::Internal(format!(
        "the owner answered a cache operation with {outcome:?}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

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
