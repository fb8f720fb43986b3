//! The node's snapshot: [`Status`], as `fief status` and `GET /v1/status`
//! report it.
//!
//! This file owns what a status says (the lease, the table, moves, handoff
//! states, host memory, CPU, members, keys, cache, topics, modules) and how
//! it is read from the node's state, and the node's [`Readiness`] (what
//! `GET /v1/ready` answers a load balancer, [`crate::probes`]). It must not
//! change anything it reads.

use std::time::SystemTime;

use fief_core::LeaseStatus;
use serde::Serialize;

use super::Instance;
use crate::cache::CacheStats;
use crate::config::ModuleOptions;
use crate::key::ModuleSlot;
use crate::sync::lock;

/// What `status` reports about the node's lease.
#[derive(Clone, Debug, Serialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum LeaseState {
    /// Not granted yet.
    Pending,
    /// Current; the node serves.
    Current,
    /// Fenced; the node serves nothing.
    Fenced,
}

/// Why a node is or is not ready to serve, as `GET /v1/ready` reports it.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReadyState {
    /// The lease is current and the node has read the partition table: it
    /// serves (its own keys, and forwards the others to their owners).
    Serving,
    /// The node has no lease yet, or has not yet read the partition table
    /// since it got one.
    Joining,
    /// The node cannot prove its lease current (it fenced, and has not yet
    /// been granted a new lease): it refuses every key with `503 fenced`.
    Fenced,
    /// The node is leaving the cluster: its keys are moving to other nodes.
    Leaving,
    /// The node was asked to stop and is shutting down.
    Stopping,
}

/// The answer of `GET /v1/ready`: whether a load balancer should send this
/// node requests, and why not.
#[derive(Clone, Debug, Serialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct Readiness {
    /// Whether the node serves (`state` is `serving`); `200` if so, `503`
    /// otherwise.
    pub ready: bool,
    /// What the node is doing.
    pub state: ReadyState,
    /// The lease as `status` reports it.
    pub lease: LeaseState,
    /// Why, in words.
    pub reason: String,
}

impl Readiness {
    /// The readiness of a node in `lease`, given whether it has read the
    /// table since it joined (`table_read`), is leaving, or was asked to
    /// stop. A stop outranks a leave, a leave a fence, a fence a join.
    pub(crate) fn of(lease: LeaseState, table_read: bool, leaving: bool, stopping: bool) -> Self {
        let (state, reason) = if stopping {
            (ReadyState::Stopping, "the node is shutting down")
        } else if leaving {
            (
                ReadyState::Leaving,
                "the node is leaving the cluster: its keys are moving to other nodes",
            )
        } else {
            match lease {
                LeaseState::Fenced => (
                    ReadyState::Fenced,
                    "the node is fenced: it cannot prove its lease current and serves no key until the arbiter grants it a new one",
                ),
                LeaseState::Pending => (
                    ReadyState::Joining,
                    "the node is joining: the arbiter has not granted it a lease yet",
                ),
                LeaseState::Current if !table_read => (
                    ReadyState::Joining,
                    "the node is joining: it holds a lease but has not read the partition table yet",
                ),
                LeaseState::Current => (
                    ReadyState::Serving,
                    "the lease is current and the node serves",
                ),
            }
        };
        Readiness {
            ready: state == ReadyState::Serving,
            state,
            lease,
            reason: reason.to_owned(),
        }
    }
}

/// A deployed module, as reported by `status`.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ModuleInfo {
    /// Module name.
    pub name: String,
    /// Version number of the version new activations use.
    pub version: u64,
    /// Component size in bytes.
    pub size_bytes: usize,
    /// Compile time of that version, in milliseconds (the load time when it
    /// came from the compile cache).
    pub compile_ms: u128,
    /// Whether that version was loaded from the compile cache instead of
    /// being compiled.
    pub compile_cached: bool,
    /// SHA-256 of the component, lowercase hex.
    pub content_hash: String,
    /// When that version was deployed (RFC 3339, UTC).
    #[serde(with = "humantime_serde")]
    #[schema(value_type = String)]
    pub deployed_at: SystemTime,
    /// Live keys of the module on this node.
    pub live_keys: usize,
    /// Its options.
    pub options: ModuleOptions,
    /// Seconds its keys' guest code has run on this node (in `status`).
    pub cpu_seconds: f64,
    /// Seconds its keys have waited because they were over their
    /// `cpu_budget`, on this node (in `status`).
    pub throttled_seconds: f64,
}

/// A live node of the namespace, as `status` reports it.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct NodeStatus {
    /// Its id.
    pub id: String,
    /// Where its peers reach it.
    pub peer_addr: Option<String>,
    /// Whether it leads.
    pub leader: bool,
    /// Whether it is leaving.
    pub leaving: bool,
    /// Time left on its lease as the arbiter judged it (when last polled).
    pub lease_remaining_ms: u128,
    /// Partitions it owns per this node's table.
    pub partitions: usize,
}

/// A snapshot of a node, for `fief status` and `GET /v1/status`.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct Status {
    /// The namespace.
    pub namespace: String,
    /// This node's id.
    pub node_id: String,
    /// Lease state.
    pub lease: LeaseState,
    /// Time left before the fence point, in milliseconds (0 unless current).
    pub lease_remaining_ms: u128,
    /// The lease time-to-live, in milliseconds (for lease bars).
    pub lease_ttl_ms: u128,
    /// The leader's term, if this node leads.
    pub leader_term: Option<u64>,
    /// Partition table epoch known to this node.
    pub epoch: u64,
    /// Partitions in the namespace.
    pub partitions: u32,
    /// Partitions this node owns.
    pub partitions_owned: usize,
    /// Owned partitions not served for now: being handed off, or waiting
    /// for a table read to settle a transfer whose outcome is unknown.
    pub partitions_moving: usize,
    /// Handoff states waiting here for their keys' next process.
    pub handoff_states: usize,
    /// Their bytes.
    pub handoff_bytes: usize,
    /// Host memory held for each tenant's keys here (queued messages, timer
    /// tags, subscriptions, waiting handoff states), with its budget.
    pub host_bytes: Vec<crate::host_bytes::TenantHostBytes>,
    /// Each tenant's CPU here since the node started, with its budget.
    pub tenant_cpu: Vec<crate::cpu_budget::TenantCpuReport>,
    /// How many times this node has fenced.
    pub fences: u64,
    /// The last time the arbiter answered from before what this node had
    /// seen (it lost commits: a standby promoted after asynchronous
    /// replication, a restored backup), what went back and what to do; the
    /// node fenced then. `null` if it never did since the node started.
    pub arbiter_regression: Option<String>,
    /// Whether the node is leaving the cluster.
    pub leaving: bool,
    /// The live nodes of the namespace, as this node last heard from the
    /// arbiter.
    pub nodes: Vec<NodeStatus>,
    /// Live key processes on this node.
    pub live_keys: usize,
    /// Linear memory the live keys hold together, in bytes (against
    /// `max_guest_memory`, if set).
    pub guest_memory_bytes: u64,
    /// The coherent cache's counters on this node.
    pub cache: CacheStats,
    /// Topics with subscribers on this node.
    pub topics: usize,
    /// Topics with subscribers on other nodes, as each peer advertised them
    /// here (summed over the peers): the publications made here that are
    /// forwarded.
    pub remote_topics: usize,
    /// Publications waiting to be forwarded to peers.
    pub publications_queued: usize,
    /// WebSocket connections this node holds (their clients connected
    /// here, whoever owns their keys).
    pub sockets: usize,
    /// WebSocket connections attached to the keys this node owns (held
    /// here or by other nodes).
    pub attached_connections: usize,
    /// Deployed modules.
    pub modules: Vec<ModuleInfo>,
    /// Where keys' durable state is kept (the storage backend, no secret).
    pub storage: String,
}

impl Instance {
    /// A snapshot of the node.
    pub fn status(&self) -> Status {
        let shared = &self.shared;
        let now = shared.clock.now();
        let (lease, rejoining, leader_term, leaving) = {
            let mut m = lock(&shared.membership);
            (
                m.status(now),
                m.fenced_this_lease(),
                m.leader().map(|t| t.0),
                m.is_leaving(),
            )
        };
        let (state, remaining) = match lease {
            // Between a fence and the next lease grant the node is fenced,
            // however its fresh (pending) lease reads.
            LeaseStatus::Pending if rejoining => (LeaseState::Fenced, 0),
            LeaseStatus::Pending => (LeaseState::Pending, 0),
            LeaseStatus::Current { fence_point } => (
                LeaseState::Current,
                fence_point.saturating_duration_since(now).as_millis(),
            ),
            LeaseStatus::Fenced { .. } => (LeaseState::Fenced, 0),
        };
        let handoffs = lock(&shared.handoffs).size();
        let table = shared.table();
        let mut modules: Vec<ModuleInfo> = shared.slots().iter().map(|s| module_info(s)).collect();
        for module in &mut modules {
            (module.cpu_seconds, module.throttled_seconds) =
                shared.metrics.cpu_seconds(&module.name);
        }
        modules.sort_by(|a, b| a.name.cmp(&b.name));
        Status {
            namespace: shared.config.namespace.clone(),
            node_id: shared.node_id.to_string(),
            lease: state,
            lease_remaining_ms: remaining,
            lease_ttl_ms: shared.config.lease_ttl.as_millis(),
            leader_term,
            epoch: table.epoch(),
            partitions: table.partitions().get(),
            partitions_owned: table.count_owned_by(&shared.node_id),
            partitions_moving: shared.view().held().len(),
            handoff_states: handoffs.0,
            handoff_bytes: handoffs.1,
            host_bytes: shared.host_bytes.report(),
            tenant_cpu: shared.tenant_cpu.report(),
            storage: shared.storage.backend().describe(),
            fences: *lock(&shared.fences),
            arbiter_regression: lock(&shared.arbiter_regression).clone(),
            leaving,
            nodes: shared
                .members
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .values()
                .map(|m| NodeStatus {
                    id: m.node.to_string(),
                    peer_addr: m.peer_addr.clone(),
                    leader: m.leader,
                    leaving: m.leaving,
                    lease_remaining_ms: m.lease_remaining.as_millis(),
                    partitions: table.count_owned_by(&m.node),
                })
                .collect(),
            live_keys: modules.iter().map(|m| m.live_keys).sum(),
            guest_memory_bytes: self.shared.guest_memory.bytes(),
            cache: shared.cache_stats(),
            topics: shared.pubsub.topic_count(),
            remote_topics: shared.pubsub.remote_topic_count(),
            publications_queued: shared.pubsub.queued(),
            sockets: shared.connections.sockets.count(),
            attached_connections: shared.connections.attached.count(),
            modules,
        }
    }
}

impl Instance {
    /// Whether this node serves, for a load balancer's readiness probe
    /// (`GET /v1/ready`): ready only while its lease is current, it has read
    /// the partition table, and it is neither leaving nor stopping.
    pub fn readiness(&self) -> Readiness {
        let shared = &self.shared;
        let now = shared.clock.now();
        let (lease, rejoining, leaving) = {
            let mut m = lock(&shared.membership);
            (m.status(now), m.fenced_this_lease(), m.is_leaving())
        };
        let lease = match lease {
            LeaseStatus::Pending if rejoining => LeaseState::Fenced,
            LeaseStatus::Pending => LeaseState::Pending,
            LeaseStatus::Current { .. } => LeaseState::Current,
            LeaseStatus::Fenced { .. } => LeaseState::Fenced,
        };
        let table_read = *shared.ready.borrow();
        let stopping = *shared.stop_requested.borrow();
        Readiness::of(lease, table_read, leaving, stopping)
    }
}

pub(crate) fn module_info(slot: &ModuleSlot) -> ModuleInfo {
    let current = slot.current();
    ModuleInfo {
        name: slot.name.to_string(),
        version: current.version,
        size_bytes: current.size_bytes,
        compile_ms: current.compile_time.as_millis(),
        compile_cached: current.compile_cached,
        content_hash: current.content_hash.clone(),
        deployed_at: current.deployed_at,
        live_keys: slot.live_keys(),
        options: current.options.clone(),
        cpu_seconds: 0.0,
        throttled_seconds: 0.0,
    }
}

impl super::NodeShared {
    /// What the dashboard's sampler reads each second
    /// (`dashboard_history.rs`), at `at_ms` (Unix milliseconds).
    pub(crate) fn dashboard_reading(&self, at_ms: u64) -> crate::dashboard_history::Reading {
        let served = self.metrics.served().values().sum();
        let live_keys = self.slots().iter().map(|s| s.live_keys() as u64).sum();
        crate::dashboard_history::Reading {
            at_ms,
            served,
            latency: self.metrics.served_latency_counts(),
            live_keys,
            fences: *lock(&self.fences),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{LeaseState, Readiness, ReadyState};

    /// Ready only when serving; a stop outranks a leave, a leave a fence,
    /// and a lease without a table read is still joining (issue 22 item 6).
    #[test]
    fn readiness_says_why_a_node_does_not_serve() {
        let state = |lease, table_read, leaving, stopping| {
            let r = Readiness::of(lease, table_read, leaving, stopping);
            assert_eq!(r.ready, r.state == ReadyState::Serving);
            r.state
        };
        use LeaseState::{Current, Fenced, Pending};
        assert_eq!(state(Current, true, false, false), ReadyState::Serving);
        assert_eq!(state(Current, false, false, false), ReadyState::Joining);
        assert_eq!(state(Pending, false, false, false), ReadyState::Joining);
        assert_eq!(state(Pending, true, false, false), ReadyState::Joining);
        assert_eq!(state(Fenced, true, false, false), ReadyState::Fenced);
        assert_eq!(state(Fenced, true, true, false), ReadyState::Leaving);
        assert_eq!(state(Current, true, true, false), ReadyState::Leaving);
        assert_eq!(state(Current, true, true, true), ReadyState::Stopping);
    }
}
