//! The etcd arbiter: presence, leadership and the ownership table in an
//! etcd (v3) cluster, through etcd's JSON gRPC-gateway over HTTP.
//!
//! The parts: this file, [`EtcdArbiter`], its URL and options, and its I/O
//! thread (every etcd call is carried there); `gateway.rs`, the HTTP/JSON
//! client (endpoints tried in turn, a timeout per request); `records.rs`,
//! the key layout and the JSON records; `presence.rs`, leases, members and
//! leadership; `table.rs`, the ownership table.
//!
//! Time is etcd's: a node's lease is an etcd lease of the node's TTL
//! rounded up to whole seconds (etcd may grant more: its minimum TTL),
//! renewed by a keepalive that etcd's leader measures when it gets it, after
//! the node sent it; the keys attached to it (the member record, the leader
//! key) disappear when etcd revokes it at expiry (or at a release). So a
//! node's partitions are given away only after etcd judged its lease
//! expired, never before the node's own fence point (contract §2). Every
//! write that rests on a read is a transaction comparing what it read
//! (contract §3); the term is the revision that created the leader key, the
//! renewal mark the revision of the renewal's write, both strictly
//! increasing in an etcd that lost nothing.
//!
//! etcd is not a blob store: the module store (deployed modules, their
//! bytes) is another arbiter's, given at connect (the node uses a
//! [`PostgresArbiter`](super::PostgresArbiter) on its `--storage` database),
//! and every module-store call is passed to it unchanged.
//!
//! It must not decide anything itself beyond carrying calls: the rules are
//! in `presence.rs` and `table.rs`, the wire in `gateway.rs`.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fief_core::{NodeId, OwnershipTable, PartitionCount, PartitionId};

use super::{
    Arbiter, ArbiterError, ArbiterFuture, LeaseId, Member, ModuleVersionRecord, NewModuleVersion,
    StoredModule, Term,
};
pub use crate::config::EtcdUrl;
use crate::dedicated::DedicatedRuntime;

mod gateway;
mod presence;
mod records;
mod table;

use gateway::{Gateway, GatewayError, KeyValue, TxnResponse};
use records::MemberRecord;

/// How many times a transaction whose compares failed is read and tried
/// again before the call is refused (the caller retries at its next round).
const CAS_ATTEMPTS: u32 = 5;

/// The default bound on one HTTP request to etcd.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_millis(500);

/// How an [`EtcdArbiter`] talks to etcd and numbers a new namespace.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// Bound on one HTTP request to one endpoint (then the next is tried).
    /// Keep it well below the node's renewal interval: a renewal is two
    /// requests (the keepalive, the member record's write).
    pub request_timeout: Duration,
    /// A namespace the arbiter creates gets a table numbered after this
    /// epoch, so every token it grants is above those a durable store has
    /// seen (see `Backend::highest_fence_token`).
    pub numbered_after: u64,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            numbered_after: 0,
        }
    }
}

/// What the arbiter knows of a member record it wrote or read last, so a
/// renewal can write without reading first (the write compares it).
#[derive(Clone, Debug)]
struct MemberSnapshot {
    lease: i64,
    mod_revision: i64,
    record: MemberRecord,
}

/// The arbiter's state on its I/O thread.
struct Etcd {
    gateway: Gateway,
    /// The URL's key prefix.
    prefix: String,
    partitions: PartitionCount,
    numbered_after: u64,
    /// Member key → the record as last written or read here.
    members: Mutex<HashMap<String, MemberSnapshot>>,
}

impl From<GatewayError> for ArbiterError {
    fn from(e: GatewayError) -> ArbiterError {
        match e {
            GatewayError::Unreachable(_) => ArbiterError::Unreachable(e.to_string()),
            GatewayError::Status { .. } => ArbiterError::Refused(e.to_string()),
        }
    }
}

/// The `i`th range's first key-value of a transaction's answer.
fn first(answer: &TxnResponse, i: usize) -> Option<&KeyValue> {
    answer.ranges.get(i).and_then(|kvs| kvs.first())
}

/// A short randomized pause before another attempt of a transaction whose
/// compares failed (several writers race).
async fn backoff(attempt: u32) {
    let ms = fastrand::u64(5..=20) * u64::from(attempt);
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

/// The etcd arbiter. Its etcd calls run on a thread of its own; its module
/// store is another arbiter's.
pub struct EtcdArbiter {
    etcd: Arc<Etcd>,
    io: DedicatedRuntime,
    modules: Arc<dyn Arbiter>,
}

impl EtcdArbiter {
    /// Connect to the etcd cluster of `url`
    /// (`etcd://host:port[,host:port…]/prefix`), make sure `namespace` has a
    /// table (of `partitions`), and keep modules in `modules`.
    ///
    /// # Errors
    ///
    /// [`ArbiterError::Refused`] for a malformed URL or a namespace stored
    /// with another partition count; [`ArbiterError::Unreachable`] when no
    /// endpoint answers.
    pub async fn connect(
        url: &str,
        namespace: &str,
        partitions: PartitionCount,
        options: EtcdOptions,
        modules: Arc<dyn Arbiter>,
    ) -> Result<Self, ArbiterError> {
        let parsed = EtcdUrl::parse(url).map_err(ArbiterError::Refused)?;
        let gateway = Gateway::new(&parsed.endpoints, options.request_timeout)?;
        let io = DedicatedRuntime::start("fief-etcd-io", std::future::pending).map_err(|e| {
            ArbiterError::Unreachable(format!("cannot start the etcd arbiter's I/O thread: {e}"))
        })?;
        let etcd = Arc::new(Etcd {
            gateway,
            prefix: parsed.prefix,
            partitions,
            numbered_after: options.numbered_after,
            members: Mutex::new(HashMap::new()),
        });
        let arbiter = EtcdArbiter { etcd, io, modules };
        let ns = namespace.to_owned();
        arbiter
            .run(|etcd| async move {
                etcd.gateway.status().await.map_err(|e| {
                    ArbiterError::Unreachable(format!(
                        "cannot reach etcd at {}: {e}",
                        etcd.gateway.describe()
                    ))
                })?;
                etcd.ensure_table(&ns).await
            })
            .await?;
        Ok(arbiter)
    }

    /// Run `call` (given the state) on the I/O thread; its answer. A caller
    /// that drops the answer's future cancels the call.
    fn run<T, F, C>(&self, call: C) -> ArbiterFuture<'static, T>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, ArbiterError>> + Send + 'static,
        C: FnOnce(Arc<Etcd>) -> F,
    {
        /// Cancels the call if the caller gives up on it.
        struct Abort(tokio::task::AbortHandle);
        impl Drop for Abort {
            fn drop(&mut self) {
                self.0.abort();
            }
        }
        let task = self.io.handle().spawn(call(self.etcd.clone()));
        Box::pin(async move {
            let _abort = Abort(task.abort_handle());
            task.await.unwrap_or_else(|e| {
                Err(ArbiterError::Unreachable(format!(
                    "the etcd arbiter's I/O thread dropped the call: {e}"
                )))
            })
        })
    }
}

/// Presence, leadership and the table carried to the I/O thread with owned
/// copies of their arguments; the module store passed to `modules`.
impl Arbiter for EtcdArbiter {
    fn register<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        ttl: Duration,
        peer_addr: Option<&'a str>,
    ) -> ArbiterFuture<'a, LeaseId> {
        let (ns, node, peer_addr) = (
            namespace.to_owned(),
            node.clone(),
            peer_addr.map(str::to_owned),
        );
        self.run(|e| async move { e.register(&ns, &node, ttl, peer_addr.as_deref()).await })
    }

    fn renew<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, u64> {
        let (ns, node) = (namespace.to_owned(), node.clone());
        self.run(|e| async move { e.renew(&ns, &node, lease).await })
    }

    fn release<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        let (ns, node) = (namespace.to_owned(), node.clone());
        self.run(|e| async move { e.release(&ns, &node, lease).await })
    }

    fn set_leaving<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        let (ns, node) = (namespace.to_owned(), node.clone());
        self.run(|e| async move { e.set_leaving(&ns, &node, lease).await })
    }

    fn live_nodes<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<Member>> {
        let ns = namespace.to_owned();
        self.run(|e| async move { e.live_nodes(&ns).await })
    }

    fn campaign<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, Option<Term>> {
        let (ns, node) = (namespace.to_owned(), node.clone());
        self.run(|e| async move { e.campaign(&ns, &node, lease).await })
    }

    fn table<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, OwnershipTable> {
        let ns = namespace.to_owned();
        self.run(|e| async move { e.table(&ns).await })
    }

    fn transfer<'a>(
        &'a self,
        namespace: &'a str,
        from: &'a NodeId,
        lease: LeaseId,
        moves: Vec<(PartitionId, NodeId)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        let (ns, from) = (namespace.to_owned(), from.clone());
        self.run(|e| async move { e.transfer(&ns, &from, lease, moves).await })
    }

    fn write_table<'a>(
        &'a self,
        namespace: &'a str,
        term: Term,
        changes: Vec<(PartitionId, Option<NodeId>)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        let ns = namespace.to_owned();
        self.run(|e| async move { e.write_table(&ns, term, changes).await })
    }

    fn put_module<'a>(
        &'a self,
        namespace: &'a str,
        module: NewModuleVersion,
    ) -> ArbiterFuture<'a, ModuleVersionRecord> {
        self.modules.put_module(namespace, module)
    }

    fn modules<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<StoredModule>> {
        self.modules.modules(namespace)
    }

    fn module_bytes<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, Option<bytes::Bytes>> {
        self.modules.module_bytes(namespace, name, version)
    }

    fn set_current_module<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, StoredModule> {
        self.modules.set_current_module(namespace, name, version)
    }

    fn remove_module<'a>(&'a self, namespace: &'a str, name: &'a str) -> ArbiterFuture<'a, bool> {
        self.modules.remove_module(namespace, name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_whole_seconds_never_shorter_than_the_nodes_ttl() {
        use presence::lease_seconds;
        assert_eq!(lease_seconds(Duration::from_millis(600)), 1);
        assert_eq!(lease_seconds(Duration::from_secs(2)), 2);
        assert_eq!(lease_seconds(Duration::from_millis(2001)), 3);
        assert_eq!(lease_seconds(Duration::from_millis(5500)), 6);
        assert_eq!(lease_seconds(Duration::ZERO), 1);
    }
}
