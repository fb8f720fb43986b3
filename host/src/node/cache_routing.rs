//! The cache's routing, the node's side of [`CacheNode`]: a cache operation
//! goes to the owner of its key's partition (forwarded over the transport
//! if need be), and the owner re-checks that it owns the partition under
//! the token it routes with before it reads or writes its store.
//!
//! The cache's handle, names, values and store are `crate::cache`'s, below
//! the node; this file owns only where an operation runs. It must not keep
//! cache state of its own (the entries are the node's `CacheStore`).

use std::sync::Arc;

use fief_core::Route;

use super::{NodeShared, refused};
use crate::cache::{CacheFuture, CacheNode, CacheStats, validate_namespace};
use crate::config::validate_key;
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::wire::{CacheOp, CacheOutcome, PeerRequest};

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

    /// This node's cache counters (the entries it holds as owner).
    pub(crate) fn cache_stats(&self) -> CacheStats {
        lock(&self.cache).stats()
    }
}

impl CacheNode for NodeShared {
    fn run_here(&self, op: CacheOp) -> std::result::Result<Result<CacheOutcome>, CacheOp> {
        let (CacheOp::Get { namespace, key }
        | CacheOp::Put { namespace, key, .. }
        | CacheOp::Delete { namespace, key, .. }) = &op;
        if let Err(e) = validate_namespace(namespace).and_then(|()| validate_key(key)) {
            return Ok(Err(e));
        }
        match self.route(key) {
            Route::Local { partition, token } => {
                let now = self.clock.now();
                Ok(lock(&self.cache).apply(op, partition, token, now))
            }
            Route::Forward { .. } => Err(op),
            Route::Refuse(refusal) => Ok(Err(refused(refusal))),
        }
    }

    fn run(self: Arc<Self>, op: CacheOp) -> CacheFuture {
        Box::pin(async move { self.cache_op(op).await })
    }

    fn check_value(&self, value: &[u8]) -> Result<()> {
        self.check_message(value)
    }

    fn stats(&self) -> CacheStats {
        self.cache_stats()
    }
}
