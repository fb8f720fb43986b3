//! A Fief instance: one node of one namespace, embeddable in any tokio program.
//!
//! [`Instance`] ties the parts together: the module registry, the key
//! runtime, pub/sub, and the *coordination loop* that holds the node's lease
//! at the arbiter, leads when it can, keeps the local copy of the partition
//! table, and fences the node when it cannot prove its lease current. Every
//! decision about time and ownership is made by `fief-core` from readings of
//! the node's [`TokioClock`](crate::TokioClock); this module carries the
//! decisions out. The coordination loop runs on a thread of its own
//! ([`DedicatedRuntime`](crate::dedicated::DedicatedRuntime)), so guest code
//! keeping the node's runtime busy cannot delay a renewal or the fence.
//!
//! Routing (guarantee 2): a message is served only if, at the moment it is
//! routed, the node's lease is current and the table gives it the key's
//! partition. The fence (guarantee 3) is checked three times: by the
//! coordination loop at the fence point (kills every key), by routing (refuses
//! every message), and by the side-effect gate in every host import.
//!
//! The parts, one concept each:
//! - this file: the [`Instance`] facade (the public API an embedder calls)
//!   and [`NodeShared`], the state the instance and its coordination loop
//!   share (around the [`KeyServices`] it shares with its key processes,
//!   which reach the node only through them and `KeyNode`), with its small
//!   accessors. It must not decide routing, coordination or moves itself: it
//!   calls the parts below;
//! - `start.rs`: [`InstanceBuilder`], starting a node;
//! - `routing.rs`: where a message goes and its delivery: route, admit an
//!   activation, call, cast, forward to the owner, serve a peer's request;
//!   and the node's side of the key layer's `KeyNode`;
//! - `cache_routing.rs`: where a cache operation runs (the node's side of
//!   the cache handle's `CacheNode`);
//! - `coordination.rs`: the coordination loop on its own thread, and what it
//!   carries out: the fence and the adoption of a newer table;
//! - `deploy.rs`: cluster-wide deploys through the arbiter's module store,
//!   and the module follower every node runs;
//! - `moves.rs`: graceful moves out (stop keys for handoff, send states,
//!   transfer at the arbiter), the leader's move requests, and `leave`;
//! - `topics.rs`: cluster-wide pub/sub over the peer links (interest and
//!   forwarded publications);
//! - `sockets.rs`: WebSocket connections to keys (accepting, holding,
//!   routing their events, the outbox feeds);
//! - `status.rs`: the node's snapshot ([`Status`]) and its parts;
//! - `metrics_page.rs`: what `GET /metrics` reads of the node at scrape
//!   time (the gauges' readings; the counters are `crate::metrics`'s).

mod alarms;
mod cache_routing;
mod coordination;
mod deploy;
mod metrics_page;
mod moves;
mod routing;
mod sockets;
mod start;
mod status;
mod topics;

use arc_swap::ArcSwap;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use fief_core::membership::{LeaveOutcome, OpId};
use fief_core::{Membership, NodeId, OwnershipTable, RoutingView};
use tokio::runtime::Handle;
use tokio::sync::{oneshot, watch};

use crate::arbiter::{ANONYMOUS, Arbiter, Member};
use crate::bindings::types::StopReason;
use crate::cache::{Cache, CacheStore};
use crate::config::{ModuleOptions, NodeConfig};
use crate::error::{Error, Result};
use crate::handoff::{HandoffStates, LostState};
use crate::key::{Envelope, KeyServices, LiveKey, ModuleSlot, Via};
use crate::limbo::LimboEntry;
use crate::scheduler::GuestPool;
use crate::sync::lock;
use crate::transport::PeerPool;
use crate::wire::HandoffEntry;

use coordination::Coordination;
pub use deploy::ModuleListing;
pub use moves::LeaveReport;
pub(crate) use routing::refused;
pub use start::InstanceBuilder;
pub(crate) use status::module_info;
pub use status::{LeaseState, ModuleInfo, NodeStatus, Readiness, ReadyState, Status};

/// The deployed modules by name. Hashed with foldhash, not SipHash: it is
/// read on every call (SipHash was 2 % of a warm call), and its keys are
/// module names an operator chose, not an attacker.
pub(crate) type ModuleMap = HashMap<String, Arc<ModuleSlot>, foldhash::fast::RandomState>;

/// State shared by the instance and its coordination loop.
///
/// The parts its key processes use too are its [`KeyServices`], which the
/// key layer reaches without naming the node; `NodeShared` derefs to them.
pub(crate) struct NodeShared {
    /// What the node shares with its keys (config, engine, pub/sub, limbo,
    /// clock, ledgers, meters, metrics, storage, observers, the fence gate).
    pub(crate) services: Arc<KeyServices>,
    pub(crate) arbiter: Arc<dyn Arbiter>,
    /// The durable alarms of the partitions this node serves
    /// (`node/alarms.rs`).
    pub(crate) alarms: Arc<alarms::NodeAlarms>,
    /// Live members as the membership last reported them, published for
    /// readers that must not wait for its lock (forwarding, deploys).
    pub(crate) members: RwLock<BTreeMap<NodeId, Member>>,
    pub(crate) peers: PeerPool,
    peer_addr: Option<String>,
    /// The ownership protocol (`fief_core::Membership`): the lease and the
    /// round, the table, drains, moves, the fence, the leave. Every change
    /// goes through `NodeShared::apply` (coordination.rs), which publishes
    /// `view` and `members` under this lock and carries out the effects.
    membership: Mutex<Membership>,
    /// The routing view (table and held partitions) as last published.
    /// Read on every call: an `ArcSwap`, so the cores routing calls at once
    /// do not bounce a lock's or a reference count's cache line.
    view: ArcSwap<RoutingView>,
    /// Held by each input from before `membership` is taken until its
    /// effects are carried out: effects run in the order the membership
    /// emitted them, and readers of `membership` never wait for effects.
    executing: Mutex<()>,
    /// Handoff states collected by a move out, until it ends.
    move_states: Mutex<HashMap<OpId, Vec<HandoffEntry>>>,
    /// Callers waiting for a table refresh, by its op.
    refreshes: Mutex<HashMap<OpId, oneshot::Sender<bool>>>,
    /// The caller of a leave in progress, waiting for its outcome.
    leave_waiter: Mutex<Option<oneshot::Sender<LeaveOutcome>>>,
    /// Wakes the coordination loop: an input may have moved its next tick.
    wake: tokio::sync::Notify,
    /// The node's runtime (key stops and handoffs run there) and the
    /// coordination thread's (arbiter requests and reaps), once started.
    main: Handle,
    coordination_rt: std::sync::OnceLock<Handle>,
    /// Set once the first round finished.
    ready: watch::Sender<bool>,
    /// The deployed modules by name, replaced whole on a deploy or an
    /// undeploy (rare) and read without a lock on every call.
    pub(crate) modules: ArcSwap<ModuleMap>,
    /// Cluster-wide deploys: the module follower's bookkeeping.
    pub(crate) deploys: deploy::Deploys,
    fences: Mutex<u64>,
    /// The last time the arbiter went back in time, for the operator
    /// ([`Status::arbiter_regression`]).
    arbiter_regression: Mutex<Option<String>>,
    /// Handoff states waiting for their keys' next process here: received
    /// from a previous owner, or kept after a move out failed.
    handoffs: Mutex<HandoffStates>,
    /// States a leave in progress could not hand on, for its report.
    leave_losses: Mutex<Vec<LostState>>,
    /// Fault injection: the coordination loop panics when it sees this.
    coordination_crash: std::sync::atomic::AtomicBool,
    /// Fault injection: milliseconds every call waits between its routing
    /// decision and its delivery (0: none), as a preempted thread would.
    route_delay_ms: std::sync::atomic::AtomicU64,
    /// Set when someone asked the node's host program to stop (after a
    /// leave through the API).
    stop_requested: watch::Sender<bool>,
    /// The coherent cache's entries this node holds as owner.
    pub(crate) cache: Mutex<CacheStore>,
    /// The dashboard's last minutes of this node's figures
    /// (`dashboard_history.rs`).
    pub(crate) history: Mutex<crate::dashboard_history::History>,
}

/// The table of a published [`RoutingView`], held by its `Arc`.
pub(crate) struct TableRef(Arc<RoutingView>);

impl std::ops::Deref for TableRef {
    type Target = OwnershipTable;
    fn deref(&self) -> &OwnershipTable {
        self.0.table()
    }
}

impl std::ops::Deref for NodeShared {
    type Target = KeyServices;

    /// The node reads what it shares with its keys as its own
    /// (`self.config`, `self.metrics`); the key layer reaches the same
    /// through [`KeyServices`] without naming the node.
    fn deref(&self) -> &KeyServices {
        &self.services
    }
}

impl NodeShared {
    /// Kill every live key of every module, as one of many (their ends are
    /// logged at `debug`: the caller logs the count). Returns how many.
    fn kill_every_key(&self, reason: &'static str) -> usize {
        self.slots()
            .iter()
            .map(|slot| slot.kill_where(reason, |_| true))
            .sum()
    }

    /// Renewals the current lease has settled (for the metrics).
    pub(crate) fn renewal_counts(&self) -> fief_core::RenewalCounts {
        lock(&self.membership).renewal_counts()
    }

    /// The routing view as last published: the table, and the partitions
    /// held back (draining or unsure).
    pub(crate) fn view(&self) -> arc_swap::Guard<Arc<RoutingView>> {
        self.view.load()
    }

    /// The table as last published.
    pub(crate) fn table(&self) -> TableRef {
        TableRef(self.view.load_full())
    }

    pub(crate) fn module(&self, name: &str) -> Result<Arc<ModuleSlot>> {
        self.modules
            .load()
            .get(name)
            .cloned()
            .ok_or_else(|| Error::UnknownModule(name.to_owned()))
    }

    pub(crate) fn slots(&self) -> Vec<Arc<ModuleSlot>> {
        self.modules.load().values().cloned().collect()
    }
}

/// How long [`Instance::kill_key_and_wait`] waits for a killed process to
/// be gone (it traps at the next epoch tick; one stuck in a host call takes
/// longer, and then the kill answers without waiting further).
pub const KILL_REAP_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// One stored alarm of a key, as operators see it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct StoredAlarmView {
    /// The alarm's name.
    pub name: String,
    /// When it is due, milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// Milliseconds until it is due on this node's clock (negative: overdue,
    /// its partition not served or its handler retrying).
    pub due_in_ms: i64,
}

/// A task aborted when this is dropped.
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One Fief node: start it, deploy modules, call keys, stop it.
///
/// ```no_run
/// # async fn demo(wasm: Vec<u8>) -> Result<(), fief::Error> {
/// use fief::{Instance, ModuleOptions, NodeConfig};
///
/// let node = Instance::start_embedded(NodeConfig::default()).await?;
/// node.deploy("counter", &wasm, ModuleOptions::default()).await?;
/// let reply = node.call("counter", "alice", b"incr".to_vec()).await?;
/// assert_eq!(reply, b"1");
/// node.shutdown().await;
/// # Ok(()) }
/// ```
pub struct Instance {
    pub(crate) shared: Arc<NodeShared>,
    /// The coordination loop's thread; `abort` stops it and waits until the
    /// loop has stopped.
    coordination: Coordination,
    peer_server: Option<tokio::task::JoinHandle<()>>,
    /// The alarm loop (`node/alarms.rs`), stopped with the node.
    alarm_loop: AbortOnDrop,
    /// The topics loop and its peer feeds (`node/topics.rs`), stopped with
    /// the node.
    topics_loop: AbortOnDrop,
    /// The connection outbox loop and its feeds (`node/sockets.rs`).
    sockets_loop: AbortOnDrop,
    /// Samples the node for the dashboard's plots.
    history_loop: AbortOnDrop,
    /// The guest threads. Dropped last (after a shutdown has waited for the
    /// key tasks), it drops whatever key task is left: a node dropped
    /// without a shutdown ends like a crash, and its threads with it.
    _guest_pool: GuestPool,
}

impl Instance {
    /// The node's configuration.
    pub fn config(&self) -> &NodeConfig {
        &self.shared.config
    }

    /// The state shared with the node's tasks (for the metrics and the
    /// dashboard, which read it at request time).
    pub(crate) fn shared(&self) -> &Arc<NodeShared> {
        &self.shared
    }

    /// Deploy (or replace) a module in the whole cluster, as `"anonymous"`
    /// (see [`Instance::deploy_as`]). Live keys of a replaced module finish
    /// on their version; new activations use the new one.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidModuleName`], [`Error::InvalidOptions`] or
    /// [`Error::InvalidModule`] saying what is wrong (nothing is stored or
    /// changed), or [`Error::ModuleStore`] if the arbiter cannot store it.
    pub async fn deploy(
        &self,
        name: &str,
        wasm: impl AsRef<[u8]>,
        options: ModuleOptions,
    ) -> Result<ModuleInfo> {
        self.deploy_as(name, wasm.as_ref().to_vec(), options, ANONYMOUS)
            .await
    }

    /// Call `key` of `module` with `message` and wait for its reply (at most
    /// the node's `call_timeout`). Activates the key if it is not live.
    ///
    /// # Errors
    ///
    /// Any [`Error`]: bad input, routing refusals (fenced, unowned), a full
    /// mailbox, the key's own error, its death, or a timeout.
    pub async fn call(&self, module: &str, key: &str, message: Vec<u8>) -> Result<Vec<u8>> {
        let timeout = self.shared.config.call_timeout;
        self.shared
            .call_with_timeout(module, key, message, timeout)
            .await
    }

    /// A turn for an API request to `module`'s keys, taken before its body
    /// is read: it waits while the module's tenant is over its share of the
    /// API's workers and its turns are taken ([`crate::request_turns`]). A
    /// module not deployed here gives no turn (the request is refused at
    /// once after).
    pub(crate) async fn request_turn(&self, module: &str) -> crate::request_turns::RequestTurn {
        use crate::request_turns::{HasRequests, RequestTurn};
        let Ok(slot) = self.shared.module(module) else {
            return RequestTurn::none();
        };
        let services = &self.shared.services;
        let decide = || {
            services
                .inline_shares
                .decide_if_due(services.runtime.ticks(), &services.tenant_cpu);
        };
        decide();
        let tenant: Arc<dyn HasRequests> = slot.tenant(services).clone();
        RequestTurn::take(tenant, &decide).await
    }

    /// Send `key` of `module` a one-way message. Returns once it is in the
    /// key's mailbox.
    ///
    /// # Errors
    ///
    /// As [`Instance::call`], except those about the reply.
    pub fn cast(&self, module: &str, key: &str, message: Vec<u8>) -> Result<()> {
        self.shared.cast(module, key, message)
    }

    /// Kill a key's process now (it traps at once, even mid-callback). The
    /// next message starts a fresh process. Returns whether it was live.
    pub fn kill_key(&self, module: &str, key: &str) -> bool {
        let killed = self
            .shared
            .module(module)
            .is_ok_and(|slot| slot.kill(key, "killed by an operator"));
        self.shared.runtime.engine.increment_epoch();
        killed
    }

    /// [`kill_key`](Self::kill_key), then wait (at most [`KILL_REAP_WAIT`])
    /// until the killed process is gone, so that a message sent after this
    /// returns starts a fresh process. Without the wait it could be queued
    /// on the dying process and fail with `key_died` (found by Schemathesis:
    /// a call, a kill, a call answered `500`).
    pub async fn kill_key_and_wait(&self, module: &str, key: &str) -> bool {
        let Ok(slot) = self.shared.module(module) else {
            return false;
        };
        let Some(generation) = slot.kill_generation(key, "killed by an operator") else {
            self.shared.runtime.engine.increment_epoch();
            return false;
        };
        self.shared.runtime.engine.increment_epoch();
        let deadline = tokio::time::Instant::now() + KILL_REAP_WAIT;
        while slot.holds_generation(key, generation) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        true
    }

    /// Stop a key gracefully: `handoff` (if `with_handoff`), then
    /// `terminate`. Returns the handoff state. `Ok(None)` if it was not live.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownModule`], or [`Error::KeyDied`] if it died stopping.
    pub async fn stop_key(
        &self,
        module: &str,
        key: &str,
        reason: StopReason,
    ) -> Result<Option<Vec<u8>>> {
        let slot = self.shared.module(module)?;
        match slot.stop(key, reason) {
            None => Ok(None),
            Some(rx) => rx
                .await
                .map_err(|_| Error::KeyDied("the key went away while stopping".to_owned()))?,
        }
    }

    /// Every live key on this node.
    pub fn keys(&self) -> Vec<LiveKey> {
        self.shared.slots().iter().flat_map(|s| s.list()).collect()
    }

    /// The cluster's coherent cache, reached through this node: every
    /// operation goes to the owner of its key's partition.
    pub fn cache(&self) -> Cache {
        Cache::new(self.shared.clone())
    }

    /// Up to `limit` (at most [`MAX_STATE_READ`](crate::storage::MAX_STATE_READ))
    /// committed entries of `key` of `module` whose names start with
    /// `prefix`, sorted, read from the store (operators' view: a live
    /// owner's writes appear once committed).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] for a bad key, prefix or limit;
    /// [`Error::StorageUnavailable`] when the store cannot be read.
    pub async fn stored_state(
        &self,
        module: &str,
        key: &str,
        prefix: &str,
        limit: u32,
    ) -> Result<Vec<crate::storage::StoredEntry>> {
        crate::storage::read_for_operator(self.shared.storage.backend(), module, key, prefix, limit)
            .await
    }

    /// A key's durable alarms as committed in the store (read-only, no
    /// fence raised; `fief alarms`, `GET /v1/alarms/{module}/{key}`),
    /// sorted by name.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] for a bad key, [`Error::StorageUnavailable`]
    /// when the store cannot be read.
    pub async fn stored_alarms(&self, module: &str, key: &str) -> Result<Vec<StoredAlarmView>> {
        crate::config::validate_key(key)?;
        let partition = self.shared.config.partition_count().of(key).0;
        let scope = crate::storage::KeyScope {
            module: module.to_owned(),
            key: key.to_owned(),
        };
        let alarms = self
            .shared
            .storage
            .backend()
            .read_alarms(scope, partition)
            .await
            .map_err(|e| Error::StorageUnavailable(e.to_string()))?;
        let now = crate::storage_api::wall_ms();
        Ok(alarms
            .into_iter()
            .map(|(name, at_ms)| StoredAlarmView {
                name,
                at_ms,
                due_in_ms: i64::try_from(at_ms).unwrap_or(i64::MAX)
                    - i64::try_from(now).unwrap_or(i64::MAX),
            })
            .collect())
    }

    /// Fence the node now, as if its lease could not be renewed: every
    /// `terminate` key is killed and nothing is served until it rejoins.
    pub fn fence_now(&self) {
        self.shared
            .apply(|m, now| m.fence_now(now, fief_core::membership::FENCE_REQUESTED));
    }

    /// The survivors in this node's limbo (`continue`/`callback` keys that
    /// outlived a fence).
    pub async fn limbo(&self) -> Vec<LimboEntry> {
        self.shared.limbo.entries().await
    }

    /// Call a key through a *local handle* on this node: unlike
    /// [`Instance::call`] it is not routed, so it also reaches a survivor in
    /// limbo. This is the fence-mode page's "anything holding their handle
    /// can still talk to them" — outside guarantee 2 by construction.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownModule`] style errors: the key has no live process or
    /// survivor on this node, its mailbox is full, or it died.
    pub async fn call_local_handle(
        &self,
        module: &str,
        key: &str,
        message: Vec<u8>,
    ) -> Result<Vec<u8>> {
        let shared = &self.shared;
        shared.check_message(&message)?;
        let mailbox = match shared.limbo.mailbox(module, key).await {
            Some(mailbox) => mailbox,
            None => shared.module(module)?.mailbox(key).ok_or_else(|| {
                Error::KeyDied(format!("no live process of {module}/{key} on this node"))
            })?,
        };
        let (reply, rx) = oneshot::channel();
        let envelope = Envelope::Call {
            message,
            reply,
            via: Via::LocalHandle,
            trace: crate::trace::current(),
        };
        mailbox
            .try_send(envelope)
            .map_err(|refused| refused.into_error(module, key, &mailbox))?;
        let timeout = shared.config.call_timeout;
        match tokio::time::timeout(timeout, rx).await {
            Err(_) => Err(Error::Timeout(timeout)),
            Ok(Err(_)) => Err(Error::KeyDied("the key process went away".to_owned())),
            Ok(Ok(reply)) => reply,
        }
    }

    /// Make limbo's bookkeeper crash (fault injection: contract §5 row 7).
    /// Its survivors die with it.
    pub fn inject_limbo_crash(&self) {
        self.shared.limbo.crash();
    }

    /// Make the coordination loop crash (fault injection: contract §5 row
    /// 6). The node fences; survivors in limbo live on.
    pub fn inject_coordination_crash(&self) {
        self.shared
            .coordination_crash
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.shared.wake.notify_one();
    }

    /// Make every call served here wait `delay` between its routing decision
    /// and its delivery to the key (fault injection: a thread preempted at
    /// the worst moment, so a move can begin in between). Zero turns it off.
    pub fn inject_route_delay(&self, delay: Duration) {
        self.shared.route_delay_ms.store(
            u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            std::sync::atomic::Ordering::SeqCst,
        );
    }

    /// Make the next `starts` key starts on this node wait for each other
    /// after the node's `max_live_keys` check, before their stores exist
    /// (fault injection: starts racing at the budget, each counting the
    /// stores before the other's exists).
    pub fn inject_start_rendezvous(&self, starts: usize) {
        *lock(&self.shared.services.start_rendezvous) =
            (starts > 0).then(|| (Arc::new(tokio::sync::Barrier::new(starts)), starts));
    }

    /// Ask the program hosting this node to stop it (the HTTP API does this
    /// after `POST /v1/leave`).
    pub fn request_stop(&self) {
        self.shared.stop_requested.send_replace(true);
    }

    /// Resolves once [`Instance::request_stop`] was called.
    pub async fn stop_requested(&self) {
        let mut rx = self.shared.stop_requested.subscribe();
        let _ = rx.wait_for(|stop| *stop).await;
    }

    /// Whether other live nodes share this node's namespace.
    pub fn has_peers(&self) -> bool {
        self.shared
            .members
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .keys()
            .any(|n| n != &self.shared.node_id)
    }

    /// Cut (or restore) this node's outgoing link to `peer` (fault injection
    /// for tests: contract §5 row 3). Returns false if `peer` is not a known
    /// live member with a peer address.
    pub async fn set_peer_link(&self, peer: &str, up: bool) -> bool {
        let Ok(addr) = self.shared.peer_addr_of(&NodeId::new(peer)) else {
            return false;
        };
        self.shared.peers.set_link(&addr, up).await;
        true
    }

    /// Stop the node abruptly, as if its process died: no key is stopped
    /// gracefully, the lease is not released, peers are dropped. The
    /// arbiter learns of it only when the lease expires. For failure tests
    /// and chaos.
    pub async fn crash(self) {
        self.coordination.abort();
        self.alarm_loop.0.abort();
        self.topics_loop.0.abort();
        self.sockets_loop.0.abort();
        self.history_loop.0.abort();
        if let Some(server) = &self.peer_server {
            server.abort();
        }
        let killed = self.shared.kill_every_key("the node crashed");
        tracing::warn!(node = %self.shared.node_id, killed, "node crashed: its keys were killed");
        self.shared.limbo.kill_all().await;
        self.shared.runtime.engine.increment_epoch();
        self.shared.tasks.close();
        self.shared.tasks.wait().await;
    }

    /// Stop the node: stop every key gracefully (`terminate(shutdown)`),
    /// kill what does not stop within a second, release the lease.
    pub async fn shutdown(self) {
        self.coordination.abort();
        self.alarm_loop.0.abort();
        self.topics_loop.0.abort();
        self.sockets_loop.0.abort();
        self.history_loop.0.abort();
        if let Some(server) = &self.peer_server {
            server.abort();
        }
        let mut stops = Vec::new();
        for slot in self.shared.slots() {
            for key in slot.live_key_names() {
                if let Some(rx) = slot.stop(&key, StopReason::Shutdown) {
                    stops.push(rx);
                }
            }
        }
        let graceful = async {
            for rx in stops {
                let _ = rx.await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(1), graceful)
            .await
            .is_err()
        {
            let killed = self.shared.kill_every_key("the node is shutting down");
            self.shared.runtime.engine.increment_epoch();
            tracing::info!(node = %self.shared.node_id, killed, "keys that did not stop within 1 s were killed");
        }
        // Survivors die with the instance (after the drain, which does not
        // touch limbo).
        self.shared.limbo.kill_all().await;
        self.shared.tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.shared.tasks.wait()).await;
        tracing::info!(node = %self.shared.node_id, "node stopped");
    }
}
