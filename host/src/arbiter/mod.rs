//! The arbiter: the one authority on who is alive, who leads and who owns what.
//!
//! Three contracts behind one trait (contract §3): *presence* (node leases,
//! expiry judged on the arbiter's own clock), the *ownership table*
//! (partition → node, versioned by a strictly increasing epoch) and
//! *leadership* (one leader at a time, with strictly increasing terms; the
//! leader alone writes the table). It also keeps the namespace's *module
//! store* ([`StoredModule`]): every deployed module's versions, their bytes
//! and which version is current, which every node follows. Adapters:
//! [`LocalArbiter`] (in-process, the embedded default),
//! [`PostgresArbiter`] and [`EtcdArbiter`] (presence, leadership and the
//! table in etcd; its module store another arbiter's). Every method is
//! scoped to a namespace, so several instances can share one arbiter.

mod etcd;
mod local;
mod modules;
mod postgres;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use fief_core::{NodeId, OwnershipTable, PartitionId};

use crate::error::Error;

/// The bytes of a stored component (cheap to clone).
pub use bytes::Bytes;
pub use etcd::{DEFAULT_REQUEST_TIMEOUT, EtcdArbiter, EtcdOptions, EtcdUrl};
pub use local::LocalArbiter;
pub use modules::{ANONYMOUS, ModuleVersionRecord, NewModuleVersion, StoredModule};
pub use postgres::PostgresArbiter;

/// A boxed future, so the trait stays object-safe.
pub type ArbiterFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, ArbiterError>> + Send + 'a>>;

/// Lease ids, terms and members are `fief-core`'s (the coordinator and the
/// simulation speak them too).
pub use fief_core::{LeaseId, Member, Term};

/// Why the arbiter refused or could not answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArbiterError {
    /// The arbiter could not be reached.
    #[error("the arbiter is unreachable: {0}")]
    Unreachable(String),
    /// The lease has expired (or was released); the node must rejoin.
    #[error("lease {0:?} has expired at the arbiter; the node must rejoin with a new lease")]
    LeaseExpired(LeaseId),
    /// The caller is not the current leader.
    #[error("not the leader (current term {0:?})")]
    NotLeader(Option<Term>),
    /// The arbiter refused the request.
    #[error("the arbiter refused: {0}")]
    Refused(String),
}

/// The one mapping of an [`ArbiterError`] to the public [`Error`]: the
/// module store's. The arbiter calls whose errors reach a caller are all the
/// module store's (deploy, rollback, undeploy, listings): the coordination
/// loop's become answers to the membership, a leave's failure reaches its
/// caller through the membership's outcome, and a start's failed connect is
/// a configuration error with its context. So an arbiter error a caller sees
/// is [`Error::ModuleStore`] (`module_store_unavailable`, 503): nothing was
/// changed, retry when the arbiter is reachable.
impl From<ArbiterError> for Error {
    fn from(e: ArbiterError) -> Error {
        Error::ModuleStore(e.to_string())
    }
}

/// The arbiter's three contracts. Every call is scoped to a namespace.
pub trait Arbiter: Send + Sync + 'static {
    /// Presence: register `node` with a fresh lease of `ttl`, reachable by
    /// its peers at `peer_addr`.
    fn register<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        ttl: Duration,
        peer_addr: Option<&'a str>,
    ) -> ArbiterFuture<'a, LeaseId>;

    /// Presence: renew a lease. Fails with [`ArbiterError::LeaseExpired`] if
    /// the arbiter already judged it expired. Returns the lease's *renewal
    /// mark*: strictly higher at every renewal of the lease the arbiter
    /// records, so a node sees an arbiter that lost its renewals (and
    /// fences, see [`fief_core::ArbiterHistory`]).
    fn renew<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, u64>;

    /// Presence: give up a lease now (graceful leave).
    fn release<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()>;

    /// Presence: mark `node` as leaving, so the leader gives it nothing and
    /// moves its partitions out.
    fn set_leaving<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()>;

    /// Presence: the nodes whose leases are current, on the arbiter's clock.
    fn live_nodes<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<Member>>;

    /// Leadership: become (or stay) leader if there is no live leader.
    /// Returns the term if `node` leads.
    fn campaign<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, Option<Term>>;

    /// Ownership table: the current table.
    fn table<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, OwnershipTable>;

    /// Ownership table: a graceful move. `from`, under its current lease,
    /// gives each listed partition it owns to the listed live node, in one
    /// change (one epoch bump). Refused if `from` does not own one of them or
    /// its lease is not current, or a target is not live.
    fn transfer<'a>(
        &'a self,
        namespace: &'a str,
        from: &'a NodeId,
        lease: LeaseId,
        moves: Vec<(PartitionId, NodeId)>,
    ) -> ArbiterFuture<'a, OwnershipTable>;

    /// Ownership table: apply `changes` as the leader of `term`. The arbiter
    /// refuses to give a partition to a node while another node's lease on
    /// it is still current (contract §3: a move only after release or
    /// arbiter-judged expiry).
    fn write_table<'a>(
        &'a self,
        namespace: &'a str,
        term: Term,
        changes: Vec<(PartitionId, Option<NodeId>)>,
    ) -> ArbiterFuture<'a, OwnershipTable>;

    /// Module store: store `module` as the next version of its name and make
    /// it current. If the current version already has the same content hash
    /// and options, nothing is added and that version is returned (so every
    /// node of a cluster may deploy the same module at start).
    fn put_module<'a>(
        &'a self,
        namespace: &'a str,
        module: NewModuleVersion,
    ) -> ArbiterFuture<'a, ModuleVersionRecord>;

    /// Module store: every deployed module with its versions (no bytes),
    /// sorted by name.
    fn modules<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<StoredModule>>;

    /// Module store: the bytes of one stored version, `None` if there is no
    /// such module or version.
    fn module_bytes<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, Option<bytes::Bytes>>;

    /// Module store: make a stored `version` current (a rollback, or a roll
    /// forward again). Refused if there is no such module or version.
    fn set_current_module<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, StoredModule>;

    /// Module store: remove a module and all its versions (an undeploy).
    /// Returns whether it was deployed. Its version counter is kept, so a
    /// later deploy of the name continues the numbering.
    fn remove_module<'a>(&'a self, namespace: &'a str, name: &'a str) -> ArbiterFuture<'a, bool>;
}
