//! What a key process may use of its node: the key layer's one way up.
//!
//! Key processes sit below the node. They reach it only through what this
//! file defines: [`KeyServices`], the parts of the node its keys share (its
//! configuration, engine and guest threads, pub/sub, limbo, clock, ledgers,
//! meters and metrics, the callers' workers' shares, the observers, the
//! storage pipeline and the fence gate), read directly on the warm path; and
//! [`KeyNode`], the few operations that belong to the node itself (admitting
//! an activation, and a guest's routed calls, casts and cache operations),
//! behind a trait object.
//! The node (`node::NodeShared`) holds the services and implements
//! [`KeyNode`]; this layer never names it.
//!
//! It must not grow node behaviour: routing, ownership and moves stay in
//! `node/`. What is here is either shared state or a check that reads only
//! that state (`may_act`, a lock-free read of the fence gate; the message
//! and handoff limits; the observers).

use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::time::Duration;

use fief_core::{FenceGate, LeaseStatus, NodeId, OwnershipToken, PartitionId};
use tokio::runtime::Handle;
use tokio_util::task::TaskTracker;

use super::{KeyLife, KeyLifeEvent};
use crate::clock::NodeClock;
use crate::config::{ModuleOptions, NodeConfig};
use crate::cpu_budget::{TenantCpu, TenantCpuMeters};
use crate::error::{Error, Result};
use crate::event_log::{NodeEvent, NodeEventKind, NodeEventObserver};
use crate::host_bytes::TenantLedgers;
use crate::inline_share::InlineShares;
use crate::limbo::Limbo;
use crate::metrics::Metrics;
use crate::pubsub::PubSub;
use crate::runtime::Runtime;
use crate::storage::writer::StorageWriter;
use crate::wire::{CacheOp, CacheOutcome};

/// Receives every key process's start and end (see [`KeyLife`]).
pub type KeyLifeObserver = Arc<dyn Fn(KeyLife) + Send + Sync>;

/// A future a [`KeyNode`] operation answers with.
pub(crate) type NodeFuture<T> = Pin<Box<dyn Future<Output = Result<T>> + Send>>;

/// The node's own operations a key process needs. `NodeShared` implements
/// it (`node/routing.rs`); a key process holds it as a trait object, so this
/// layer does not depend on the node.
///
/// None of these is on a warm call's path: an activation, and the guest
/// imports that route (`call`, `cast`, the cache), each of which does
/// routing work far larger than the one indirect call (and, for the async
/// ones, the one boxed future) this costs.
pub(crate) trait KeyNode: Send + Sync {
    /// May a new process of `module`/`key` start here now, for `partition`
    /// under `token`? Called under the module's key-table lock; gives the
    /// handoff state waiting for the key, if one belongs to this ownership.
    ///
    /// # Errors
    ///
    /// The routing refusal when the partition is no longer served here under
    /// `token`.
    fn admit_activation(
        &self,
        module: &str,
        key: &str,
        partition: PartitionId,
        token: OwnershipToken,
    ) -> Result<Option<Vec<u8>>>;

    /// A node budget is reached (`cause`: `max_live_keys`, or
    /// `max_guest_memory`): order the least recently used idle key of any
    /// module to retire. Returns whether one was ordered; false when every
    /// live key is busy.
    fn evict_oldest_idle(&self, cause: super::Eviction) -> bool;

    /// Evictions ordered on this node and not yet done (their keys' stores
    /// not yet dropped, or just dropped).
    fn evictions_in_flight(&self) -> usize;

    /// Whether `module` is deployed here (a held cast is checked now, sent
    /// after its commit).
    fn has_module(&self, module: &str) -> bool;

    /// Call `key` of `module` on whichever node owns it, waiting at most
    /// `timeout` for the reply (a guest's `call`).
    fn call_key(
        self: Arc<Self>,
        module: String,
        key: String,
        message: Vec<u8>,
        timeout: Duration,
    ) -> NodeFuture<Vec<u8>>;

    /// Send `key` of `module` a one-way message on whichever node owns it (a
    /// guest's `cast`).
    ///
    /// # Errors
    ///
    /// As the node's cast: bad input, routing refusals, a full mailbox.
    fn cast_key(self: Arc<Self>, module: &str, key: &str, message: Vec<u8>) -> Result<()>;

    /// Run a cache operation on the owner of its key (a guest's cache
    /// imports).
    fn cache(self: Arc<Self>, op: CacheOp) -> NodeFuture<CacheOutcome>;
}

/// The parts of a node its key processes share, and the checks that read
/// only them. The node holds one (`Arc`) for as long as it runs, and so does
/// each key task (beside the node itself); a key's store holds it weakly.
pub(crate) struct KeyServices {
    pub(crate) node_id: NodeId,
    pub(crate) config: NodeConfig,
    pub(crate) runtime: Runtime,
    /// The guest threads' runtime, where key tasks are spawned (the pool
    /// itself is the instance's).
    pub(crate) guest: Handle,
    pub(crate) pubsub: PubSub,
    /// WebSocket connections: the sockets this node holds, the connections
    /// attached to its keys, and what its keys send to other nodes'.
    pub(crate) connections: crate::connections::Connections,
    /// Every key task (and the node's other tasks), waited for at shutdown.
    pub(crate) tasks: TaskTracker,
    pub(crate) limbo: Limbo,
    pub(crate) clock: Arc<dyn NodeClock>,
    /// Host memory held for each tenant's keys ([`crate::host_bytes`]).
    pub(crate) host_bytes: TenantLedgers,
    /// Each tenant's CPU here, and its budget ([`crate::cpu_budget`]).
    pub(crate) tenant_cpu: TenantCpuMeters,
    /// Which tenants' routed calls may run on their callers' workers
    /// ([`crate::inline_share`]).
    pub(crate) inline_shares: InlineShares,
    /// Counters and histograms for `GET /metrics`.
    pub(crate) metrics: Metrics,
    /// The linear memory the node's live keys hold together
    /// (`max_guest_memory`).
    pub(crate) guest_memory: Arc<super::GuestMemory>,
    /// Notified when a key's store is dropped (a pool slot freed), for the
    /// starts waiting for one (`task.rs`, `start_in_pool`).
    pub(crate) pool_freed: tokio::sync::Notify,
    /// Fault injection (`Instance::inject_start_rendezvous`): the barrier
    /// the next starts meet at after the node's budget check, and how many
    /// more starts join it.
    pub(crate) start_rendezvous: std::sync::Mutex<Option<(Arc<tokio::sync::Barrier>, usize)>>,
    /// The pipeline to the store of keys' durable state (group commit).
    pub(crate) storage: Arc<StorageWriter>,
    /// The lease's fence point as the membership publishes it, read by the
    /// side-effect gate and routing without taking the membership's lock
    /// (through [`may_act`](Self::may_act) and
    /// [`gate_status`](Self::gate_status)).
    pub(crate) fence_gate: Arc<FenceGate>,
    /// Receives key lives ([`observe`](Self::observe)).
    pub(crate) observer: Option<KeyLifeObserver>,
    /// Receives leases granted, fences and routed messages processed (the
    /// event log; [`report`](Self::report)).
    pub(crate) events: Option<NodeEventObserver>,
    /// The node itself, for [`KeyNode`]'s operations: its weak self, as
    /// `Arc::new_cyclic` gives it.
    pub(crate) node: Weak<dyn KeyNode>,
}

impl KeyServices {
    /// The node, unless it has stopped.
    pub(crate) fn node(&self) -> Option<Arc<dyn KeyNode>> {
        self.node.upgrade()
    }

    /// Whether this node may act for its keys right now: its lease is current.
    /// Lock-free (every host import's gate and every running guest's epoch
    /// callback ask): the fence point as the coordinator last published it,
    /// read before the clock, so past the fence point this is false.
    pub(crate) fn may_act(&self) -> bool {
        let until = self.fence_gate.current_until();
        until.is_some_and(|until| self.clock.now() < until)
    }

    /// The lease as routing needs it, lock-free like [`may_act`](Self::may_act):
    /// current until the published fence point, otherwise not (`Pending`
    /// stands for both "no renewal yet" and "fenced": routing refuses either).
    /// Routing asks on every call; the coordinator's lock is for its loop.
    pub(crate) fn gate_status(&self) -> LeaseStatus {
        match self.fence_gate.current_until() {
            Some(until) if self.clock.now() < until => LeaseStatus::Current { fence_point: until },
            _ => LeaseStatus::Pending,
        }
    }

    /// May a routed call of a key of `tenant` run inline on its caller's
    /// task at `ticks`, or is the tenant over its share of the callers'
    /// workers ([`crate::inline_share`])?
    pub(crate) fn may_run_inline(&self, tenant: &TenantCpu, ticks: u64) -> bool {
        self.inline_shares
            .may_run_inline(tenant.inline_share(), ticks, &self.tenant_cpu)
    }

    /// Report a key life event to the observer, if there is one.
    pub(crate) fn observe(&self, module: &str, key: &str, event: KeyLifeEvent) {
        if event == KeyLifeEvent::Started {
            self.metrics.activated(module);
        }
        if let Some(observer) = &self.observer {
            observer(KeyLife {
                node: self.node_id.to_string(),
                module: module.to_owned(),
                key: key.to_owned(),
                event,
                at: std::time::Instant::now(),
            });
        }
    }

    /// Whether a [`NodeEventObserver`] is installed (so callers skip the
    /// work of building events nobody reads).
    pub(crate) fn reports_events(&self) -> bool {
        self.events.is_some()
    }

    /// Report a [`NodeEvent`] that happened `at` to the observer, if any.
    pub(crate) fn report(&self, at: std::time::Instant, kind: NodeEventKind) {
        if let Some(events) = &self.events {
            events(NodeEvent {
                node: self.node_id.to_string(),
                at,
                kind,
            });
        }
    }

    /// Refuse a message over the node's `max_message_size`.
    ///
    /// # Errors
    ///
    /// [`Error::MessageTooLarge`] with the sizes.
    pub(crate) fn check_message(&self, message: &[u8]) -> Result<()> {
        let limit = self.config.max_message_size.as_u64() as usize;
        if message.len() > limit {
            return Err(Error::MessageTooLarge {
                size: message.len(),
                limit,
            });
        }
        Ok(())
    }

    /// The largest handoff state a key of a module with `options` may hand
    /// on: its `max_handoff_size`, at most the node's `max_message_size`.
    pub(crate) fn max_handoff_size(&self, options: &ModuleOptions) -> usize {
        let node = self.config.max_message_size;
        options
            .max_handoff_size
            .map_or(node, |l| l.min(node))
            .as_u64() as usize
    }
}
