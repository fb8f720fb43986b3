//! A Fief instance: one node of one namespace, embeddable in any tokio program.
//!
//! [`Instance`] ties the parts together: the module registry, the key
//! runtime, pub/sub, and the *coordination loop* that holds the node's lease
//! at the arbiter, leads when it can, keeps the local copy of the partition
//! table, and fences the node when it cannot prove its lease current. Every
//! decision about time and ownership is made by `fief-core` from readings of
//! the node's [`TokioClock`]; this module carries the decisions out. The
//! coordination loop runs on a thread of its own ([`DedicatedRuntime`]), so
//! guest code keeping the node's runtime busy cannot delay a renewal or the
//! fence.
//!
//! Routing (guarantee 2): a message is served only if, at the moment it is
//! routed, the node's lease is current and the table gives it the key's
//! partition. The fence (guarantee 3) is checked three times: by the
//! coordination loop at the fence point (kills every key), by routing (refuses
//! every message), and by the side-effect gate in every host import.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use fief_core::coordinator::{Action, Reply, Request, gained_partitions, lost};
use fief_core::{
    Coordinator, LeaseStatus, NodeId, OwnershipTable, PartitionId, Route, RouteRefusal,
};
use serde::Serialize;
use tokio::runtime::Handle;
use tokio::sync::{oneshot, watch};
use tokio_util::task::TaskTracker;

use crate::arbiter::{
    ANONYMOUS, Arbiter, ArbiterError, LeaseId, LocalArbiter, Member, PostgresArbiter, Term,
};
use crate::bindings::types::StopReason;
use crate::cache::{Cache, CacheStats, CacheStore};
use crate::clock::{NodeClock, TokioClock};
use crate::config::{ModuleOptions, NodeConfig, validate_key};
use crate::dedicated::DedicatedRuntime;
use crate::error::{Error, Result};
use crate::event_log::{NodeEvent, NodeEventKind, NodeEventObserver};
use crate::handoff::{HandoffStates, LostState};
use crate::host_bytes::TenantLedgers;
use crate::key::{Envelope, KeyLife, KeyLifeEvent, LiveKey, ModuleSlot, Via, lock};
use crate::limbo::{Limbo, LimboEntry};
use crate::pubsub::PubSub;
use crate::runtime::Runtime;
use crate::scheduler::GuestPool;
use crate::transport::{HandoffEntry, PeerPool, PeerRequest};

/// State shared by the instance, its coordination loop and its key processes.
pub(crate) struct NodeShared {
    pub(crate) config: NodeConfig,
    pub(crate) node_id: NodeId,
    pub(crate) runtime: Runtime,
    /// The guest threads' runtime, where key tasks are spawned (the pool
    /// itself is the instance's: see [`Instance`]).
    pub(crate) guest: Handle,
    pub(crate) pubsub: PubSub,
    pub(crate) tasks: TaskTracker,
    pub(crate) limbo: Limbo,
    pub(crate) clock: Arc<dyn NodeClock>,
    pub(crate) arbiter: Arc<dyn Arbiter>,
    /// Live members as the arbiter last reported them.
    pub(crate) members: RwLock<BTreeMap<NodeId, Member>>,
    pub(crate) peers: PeerPool,
    peer_addr: Option<String>,
    /// The coordination state machine: the lease (routing reads its status)
    /// and the coordination round in progress.
    lease: Mutex<Coordinator>,
    /// The lease's fence point as the coordinator publishes it, read by the
    /// side-effect gate without taking `lease`'s lock.
    fence_gate: Arc<fief_core::FenceGate>,
    leader_term: Mutex<Option<Term>>,
    table: RwLock<OwnershipTable>,
    pub(crate) modules: RwLock<HashMap<String, Arc<ModuleSlot>>>,
    /// Cluster-wide deploys: the module follower's bookkeeping.
    pub(crate) deploys: crate::deploy::Deploys,
    fences: Mutex<u64>,
    observer: Option<KeyLifeObserver>,
    /// Receives leases granted, fences and routed messages processed (the
    /// event log).
    events: Option<NodeEventObserver>,
    /// The current lease's id at the arbiter, once joined.
    lease_id: Mutex<Option<LeaseId>>,
    /// Partitions being handed off: owned, but not served.
    draining: Mutex<BTreeSet<PartitionId>>,
    /// Partitions whose transfer failed with its outcome unknown, with when
    /// it failed: not served until a table read sent later settles them.
    unsure: Mutex<BTreeMap<PartitionId, fief_core::Instant>>,
    /// Handoff states waiting for their keys' next process here: received
    /// from a previous owner, or kept after a move out failed.
    handoffs: Mutex<HandoffStates>,
    /// Host memory held for each tenant's keys ([`crate::host_bytes`]).
    pub(crate) host_bytes: TenantLedgers,
    /// Each tenant's CPU here, and its budget ([`crate::cpu_budget`]).
    pub(crate) tenant_cpu: crate::cpu_budget::TenantCpuMeters,
    /// States a leave in progress could not hand on, for its report.
    leave_losses: Mutex<Vec<LostState>>,
    /// Serializes graceful moves out of this node.
    moving: tokio::sync::Mutex<()>,
    /// Set by `leave`: the node hands off everything and takes nothing.
    pub(crate) leaving: std::sync::atomic::AtomicBool,
    /// Wakes the coordination loop to refresh the table now.
    sync_now: tokio::sync::Notify,
    /// Whether the current lease has been fenced (reset on join).
    fenced_this_lease: std::sync::atomic::AtomicBool,
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
    /// Counters and histograms for `GET /metrics`.
    pub(crate) metrics: crate::metrics::Metrics,
}

/// Receives every key process's start and end (see [`KeyLife`]).
pub type KeyLifeObserver = Arc<dyn Fn(KeyLife) + Send + Sync>;

impl NodeShared {
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

    /// Whether this node may act for its keys right now: its lease is current.
    /// Lock-free (every host import's gate and every running guest's epoch
    /// callback ask): the fence point as the coordinator last published it,
    /// read before the clock, so past the fence point this is false.
    pub(crate) fn may_act(&self) -> bool {
        let until = self.fence_gate.current_until();
        until.is_some_and(|until| self.clock.now() < until)
    }

    fn lease_status(&self) -> LeaseStatus {
        lock(&self.lease).status(self.clock.now())
    }

    /// Renewals the current lease has settled (for the metrics).
    pub(crate) fn renewal_counts(&self) -> fief_core::RenewalCounts {
        lock(&self.lease).renewal_counts()
    }

    pub(crate) fn table(&self) -> std::sync::RwLockReadGuard<'_, OwnershipTable> {
        self.table
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn module(&self, name: &str) -> Result<Arc<ModuleSlot>> {
        self.modules
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(name)
            .cloned()
            .ok_or_else(|| Error::UnknownModule(name.to_owned()))
    }

    pub(crate) fn slots(&self) -> Vec<Arc<ModuleSlot>> {
        self.modules
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

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

    /// Decide where a message for `key` goes, as of now. A partition being
    /// handed off is not served by anyone until the move completes.
    pub(crate) fn route(&self, key: &str) -> Route {
        let route = self.table().route(&self.node_id, self.lease_status(), key);
        match route {
            Route::Local { partition, .. }
                if lock(&self.draining).contains(&partition)
                    || lock(&self.unsure).contains_key(&partition) =>
            {
                Route::Refuse(RouteRefusal::Unowned(partition))
            }
            route => route,
        }
    }

    /// May a new process of `module`/`key` start here now, for `partition`
    /// under `token`? Called by the key table (`ModuleSlot::deliver`) under
    /// its lock, so a drain that marked the partition either sees the new
    /// process or refuses it here. Gives the handoff state waiting for the
    /// key, if one belongs to this ownership.
    ///
    /// # Errors
    ///
    /// The routing refusal when the partition is no longer served here
    /// under `token` (a move began, the node fenced, the table changed).
    pub(crate) fn admit_activation(
        &self,
        module: &str,
        key: &str,
        partition: PartitionId,
        token: fief_core::OwnershipToken,
    ) -> Result<Option<Vec<u8>>> {
        match self.route(key) {
            Route::Local {
                partition: p,
                token: t,
            } if p == partition && t == token => {}
            Route::Local { partition: p, .. } => return Err(Error::Unowned(p)),
            Route::Forward { owner, .. } => {
                return Err(Error::NotOwner {
                    owner: owner.to_string(),
                });
            }
            Route::Refuse(refusal) => return Err(refused(refusal)),
        }
        let (state, lost) = {
            let table = self.table();
            lock(&self.handoffs).take_for_activation(module, key, &table, &self.node_id)
        };
        if state.is_some() {
            self.metrics.handoff_states("delivered", 1);
        }
        if let Some(lost) = lost {
            self.handoff_dropped("dropped_stale", &[lost]);
        }
        Ok(state)
    }

    /// Log and count handoff states this node had to drop.
    fn handoff_dropped(&self, event: &'static str, lost: &[LostState]) {
        for l in lost {
            tracing::warn!(node = %self.node_id, module = %l.module, key = %l.key, reason = %l.reason, "a handoff state was dropped");
        }
        self.metrics.handoff_states(event, lost.len());
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

    /// Stop every live key of `partitions` with `handoff`, collecting their
    /// states under the tokens this node holds the partitions by, and the
    /// keys whose states could not be had. Repeats until none is live (a
    /// message routed just before the partitions started draining may have
    /// activated one before the drain's mark: see `admit_activation`).
    async fn stop_for_handoff(
        &self,
        partitions: &BTreeSet<PartitionId>,
    ) -> (Vec<HandoffEntry>, Vec<LostState>) {
        let tokens: BTreeMap<u32, u64> = {
            let table = self.table();
            partitions
                .iter()
                .filter_map(|p| {
                    let a = table.owner(*p)?;
                    (a.node == self.node_id).then_some((p.0, a.token.0))
                })
                .collect()
        };
        let mut entries = Vec::new();
        let mut lost = Vec::new();
        // A process stopped in one round may still be listed in the next
        // (its task removes its entry just after answering): stop each key
        // once. No new process of these partitions starts meanwhile (see
        // `admit_activation`).
        let mut stopped: std::collections::HashSet<(String, String)> = Default::default();
        for _round in 0..10 {
            let mut stops = Vec::new();
            for slot in self.slots() {
                for live in slot.list() {
                    if partitions.contains(&PartitionId(live.partition))
                        && stopped.insert((live.module.clone(), live.key.clone()))
                        && let Some(rx) = slot.stop(&live.key, StopReason::Handoff)
                    {
                        stops.push((live.module, live.key, live.partition, rx));
                    }
                }
            }
            if stops.is_empty() {
                break;
            }
            for (module, key, partition, rx) in stops {
                match (rx.await, tokens.get(&partition)) {
                    (Ok(Ok(Some(state))), Some(&token)) => entries.push(HandoffEntry {
                        module,
                        key,
                        partition,
                        token,
                        state,
                    }),
                    (Ok(Ok(None)), _) | (Err(_), _) => {}
                    (Ok(Ok(Some(_))), None) => lost.push(LostState {
                        module,
                        key,
                        reason: "its partition was lost during the handoff".to_owned(),
                    }),
                    (Ok(Err(e)), _) => {
                        let event = match e {
                            Error::HandoffTooLarge { .. } => "too_large",
                            _ => "key_died",
                        };
                        let reason = e.to_string();
                        self.metrics.handoff_states(event, 1);
                        tracing::warn!(%module, %key, error = %reason, "a key's handoff state cannot travel");
                        lost.push(LostState {
                            module,
                            key,
                            reason,
                        });
                    }
                }
            }
        }
        (entries, lost)
    }

    /// Graceful move out: hand `moves` (partitions this node owns) to their
    /// targets. Per target: stop routing the partitions, stop their keys with
    /// `handoff`, send the states to the target, then give the partitions
    /// away at the arbiter. If a step fails the partitions stay here and the
    /// states are kept for the keys' next activation.
    pub(crate) async fn move_out(
        self: &Arc<Self>,
        moves: Vec<(PartitionId, NodeId)>,
    ) -> Result<()> {
        let _one_at_a_time = self.moving.lock().await;
        let lease = (*lock(&self.lease_id)).ok_or(Error::Fenced)?;
        let mut by_target: BTreeMap<NodeId, BTreeSet<PartitionId>> = BTreeMap::new();
        {
            let table = self.table();
            for (partition, to) in moves {
                let mine = table
                    .owner(partition)
                    .is_some_and(|a| a.node == self.node_id);
                if mine && to != self.node_id {
                    by_target.entry(to).or_default().insert(partition);
                }
            }
        }
        let ns = &self.config.namespace;
        let limit = self.config.call_timeout;
        // A frame holds a state of up to `max_message_size` with its names.
        let budget =
            self.config.max_message_size.as_u64() as usize + crate::transport::FRAME_OVERHEAD / 2;
        for (to, partitions) in by_target {
            let addr = self.peer_addr_of(&to)?;
            lock(&self.draining).extend(partitions.iter().copied());
            let (mut entries, lost) = self.stop_for_handoff(&partitions).await;
            // States that wait here for keys not activated since they came
            // (or since a move failed) travel too.
            entries.extend({
                let table = self.table();
                lock(&self.handoffs).take_partitions(&partitions, &table, &self.node_id)
            });
            if self.leaving.load(std::sync::atomic::Ordering::SeqCst) {
                lock(&self.leave_losses).extend(lost);
            }
            // Once the transfer is sent, a failure leaves its outcome
            // unknown: the arbiter may have committed it, its answer lost.
            let mut transfer_sent = false;
            let handed = async {
                // In frames under the peer frame limit: however many states,
                // none is too large to send (each is at most the module's
                // max_handoff_size, at most max_message_size).
                for batch in crate::handoff::batches(entries.clone(), budget) {
                    let request = PeerRequest::Handoff { entries: batch };
                    self.peers.request(&addr, request, limit).await?;
                }
                transfer_sent = true;
                let changes = partitions.iter().map(|p| (*p, to.clone())).collect();
                bounded(
                    limit,
                    self.arbiter.transfer(ns, &self.node_id, lease, changes),
                )
                .await
                .map_err(|e| Error::Internal(format!("the arbiter refused the handoff: {e}")))
            }
            .await;
            match handed {
                Ok(table) => {
                    // Adopted only under the lease the move was made under
                    // (after a fence, and maybe a rejoin, it is not this
                    // node's table), and like any adoption: survivors of
                    // partitions it gains are reaped first (found by the
                    // simulation).
                    if *lock(&self.lease_id) == Some(lease) {
                        self.adopt_table(table).await;
                    }
                    self.metrics.handoff_states("sent", entries.len());
                    tracing::info!(node = %self.node_id, to = %to, partitions = partitions.len(), keys = entries.len(), "partitions handed off");
                    let _ = self.peers.request(&addr, PeerRequest::Nudge, limit).await;
                }
                Err(e) => {
                    tracing::warn!(node = %self.node_id, to = %to, error = %e, "handoff failed; keeping the partitions");
                    if transfer_sent {
                        // Not served again until a table read sent after
                        // now says whose they are (found by the simulation:
                        // serving them at once double-owns them when the
                        // transfer did commit).
                        let now = self.clock.now();
                        lock(&self.unsure).extend(partitions.iter().map(|p| (*p, now)));
                    }
                    // Kept for this node's ownership: the keys' next process
                    // here takes them, or the next move carries them on. If
                    // the transfer did commit, the table will show them stale
                    // here, and the target has its copies.
                    self.metrics.handoff_states("kept", entries.len());
                    lock(&self.handoffs).keep(entries, &self.host_bytes);
                }
            }
            let mut draining = lock(&self.draining);
            for p in &partitions {
                draining.remove(p);
            }
        }
        Ok(())
    }

    /// Where the peers of `owner` reach it.
    fn peer_addr_of(&self, owner: &NodeId) -> Result<String> {
        self.members
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(owner)
            .and_then(|m| m.peer_addr.clone())
            .ok_or_else(|| Error::OwnerUnreachable {
                owner: owner.to_string(),
                why: "the arbiter lists no peer address for it".to_owned(),
            })
    }

    /// Put `envelope` in the key's mailbox on this node, if this node owns
    /// the key right now; never forwards.
    fn deliver_local(self: &Arc<Self>, module: &str, key: &str, envelope: Envelope) -> Result<()> {
        validate_key(key)?;
        let slot = self.module(module)?;
        if let Envelope::Call { message, .. } | Envelope::Cast { message, .. } = &envelope {
            check_module_message(&slot, message)?;
        }
        match self.route(key) {
            Route::Local { partition, token } => {
                slot.deliver(self, key, partition, token, envelope)
            }
            Route::Forward { owner, .. } => Err(Error::NotOwner {
                owner: owner.to_string(),
            }),
            Route::Refuse(refusal) => Err(refused(refusal)),
        }
    }

    /// Call a key and wait for its reply, at most `timeout`, on whichever
    /// node owns it.
    pub(crate) async fn call_with_timeout(
        self: &Arc<Self>,
        module: &str,
        key: &str,
        message: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        self.check_message(&message)?;
        validate_key(key)?;
        let started = std::time::Instant::now();
        let span = tracing::debug_span!("call", node = %self.node_id, module, key);
        let (reply, route) = tracing::Instrument::instrument(
            async {
                let request = || PeerRequest::Call {
                    module: module.to_owned(),
                    key: key.to_owned(),
                    message: message.clone(),
                    timeout_ms: timeout.as_millis() as u64,
                };
                match self.forward(key, request, timeout).await {
                    Some(reply) => (reply, crate::metrics::CallRoute::Routed),
                    None => (
                        self.call_local(module, key, message, timeout).await,
                        crate::metrics::CallRoute::Local,
                    ),
                }
            },
            span,
        )
        .await;
        self.metrics
            .call_done(module, route, reply.is_ok(), started.elapsed());
        reply
    }

    /// Send `request` to the owner of `key` if another node owns it, and
    /// return its answer; `None` when this node is the one to serve it (or
    /// refuse it), which the caller does locally.
    ///
    /// One bounded retry: if the owner per our table is gone or says it is
    /// not the owner, our table may be stale; refresh it and route once more.
    pub(crate) async fn forward(
        self: &Arc<Self>,
        key: &str,
        request: impl Fn() -> PeerRequest,
        timeout: Duration,
    ) -> Option<Result<Vec<u8>>> {
        for attempt in 0..2 {
            let epoch = self.table().epoch();
            let Route::Forward { owner, .. } = self.route(key) else {
                return None;
            };
            let addr = match self.peer_addr_of(&owner) {
                Ok(addr) => addr,
                Err(e) => return Some(Err(e)),
            };
            match self.peers.request(&addr, request(), timeout).await {
                // Retry once the table is newer than the one this route was
                // decided on, whether this refresh or the coordination loop
                // (nudged by the same move) adopted it.
                Err(e)
                    if attempt == 0
                        && stale_route(&e)
                        && (self.refresh_table().await || self.table().epoch() > epoch) =>
                {
                    continue;
                }
                result => return Some(result.map_err(|e| name_owner(e, &owner, &addr))),
            }
        }
        unreachable!("the loop returns on its second attempt")
    }

    /// Read the table from the arbiter now. Returns whether it changed.
    ///
    /// Partitions this node gains are *initialized*: survivors of them still
    /// in limbo are reaped (and gone) before the new table routes anything
    /// to this node, so one node never hosts a survivor and a fresh process
    /// for one key.
    async fn refresh_table(&self) -> bool {
        let limit = self.config.renew_interval;
        let lease = *lock(&self.lease_id);
        let Ok(newer) = bounded(limit, self.arbiter.table(&self.config.namespace)).await else {
            return false;
        };
        // Only under the lease it was read under: a table read across a
        // fence lists partitions of the old lease.
        if lease.is_none() || *lock(&self.lease_id) != lease {
            return false;
        }
        self.adopt_table(newer).await
    }

    /// Adopt `newer` if it is newer than this node's copy (the decisions
    /// are `fief_core::coordinator`'s: which partitions are gained, which
    /// keys are lost). Returns whether it changed.
    async fn adopt_table(&self, newer: OwnershipTable) -> bool {
        let Some(gained) = gained_partitions(&self.table(), &newer, &self.node_id) else {
            return false;
        };
        if !gained.is_empty() {
            let reaped = self.limbo.reap(gained).await;
            if reaped > 0 {
                tracing::info!(node = %self.node_id, reaped, "survivors reaped: their partitions are initialized again");
            }
        }
        let changed = self
            .table
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .update_from(&newer);
        if changed {
            self.kill_lost_keys(&newer);
            self.drop_unowned_cache();
            let stale = lock(&self.handoffs).sweep(&newer, &self.node_id);
            self.handoff_dropped("dropped_stale", &stale);
        }
        changed
    }

    async fn call_local(
        self: &Arc<Self>,
        module: &str,
        key: &str,
        message: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        validate_key(key)?;
        let slot = self.module(module)?;
        check_module_message(&slot, &message)?;
        let (partition, token) = match self.route(key) {
            Route::Local { partition, token } => (partition, token),
            Route::Forward { owner, .. } => {
                return Err(Error::NotOwner {
                    owner: owner.to_string(),
                });
            }
            Route::Refuse(refusal) => return Err(refused(refusal)),
        };
        let delay = self
            .route_delay_ms
            .load(std::sync::atomic::Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        // An idle key runs the call on this task; a busy one queues it
        // (`ModuleSlot::call`). A timeout abandons the wait, not the call:
        // the key finishes it either way.
        let call = slot.call(self, key, partition, token, message, Via::Routed);
        let reply = match tokio::time::timeout(timeout, call).await {
            Err(_) => return Err(Error::Timeout(timeout)),
            Ok(reply) => reply?,
        };
        let module_limit = self
            .module(module)
            .ok()
            .and_then(|slot| slot.current().options.max_reply_size);
        let limit = module_limit
            .map_or(self.config.max_message_size, |l| {
                l.min(self.config.max_message_size)
            })
            .as_u64() as usize;
        if reply.len() > limit {
            return Err(Error::ReplyTooLarge {
                size: reply.len(),
                limit,
            });
        }
        Ok(reply)
    }

    /// Send a key a one-way message, on whichever node owns it. A cast to
    /// another node is sent in the background; its failure is logged.
    pub(crate) fn cast(self: &Arc<Self>, module: &str, key: &str, message: Vec<u8>) -> Result<()> {
        self.check_message(&message)?;
        validate_key(key)?;
        if let Route::Forward { owner, .. } = self.route(key) {
            let addr = self.peer_addr_of(&owner)?;
            let request = PeerRequest::Cast {
                module: module.to_owned(),
                key: key.to_owned(),
                message,
            };
            let node = self.clone();
            let timeout = self.config.call_timeout;
            tokio::spawn(async move {
                if let Err(error) = node.peers.request(&addr, request, timeout).await {
                    tracing::warn!(%owner, %error, "a forwarded cast failed");
                }
            });
            return Ok(());
        }
        self.deliver_local(module, key, Envelope::Cast { message })
    }

    /// Serve a request forwarded by a peer: only if this node owns the key
    /// now (the owner's re-check); never forward it again.
    pub(crate) async fn serve_peer_request(
        self: &Arc<Self>,
        request: PeerRequest,
    ) -> Result<Vec<u8>> {
        match request {
            PeerRequest::Call {
                module,
                key,
                message,
                timeout_ms,
            } => {
                self.check_message(&message)?;
                let timeout = Duration::from_millis(timeout_ms).min(self.config.call_timeout);
                let started = std::time::Instant::now();
                let span = tracing::debug_span!(
                    "serve",
                    node = %self.node_id,
                    module = %module,
                    key = %key,
                    from = "peer"
                );
                let reply = tracing::Instrument::instrument(
                    self.call_local(&module, &key, message, timeout),
                    span,
                )
                .await;
                self.metrics.call_done(
                    &module,
                    crate::metrics::CallRoute::Peer,
                    reply.is_ok(),
                    started.elapsed(),
                );
                reply
            }
            PeerRequest::Cast {
                module,
                key,
                message,
            } => {
                self.check_message(&message)?;
                self.deliver_local(&module, &key, Envelope::Cast { message })
                    .map(|()| Vec::new())
            }
            PeerRequest::Handoff { entries } => {
                let n = lock(&self.handoffs).receive(entries, &self.host_bytes);
                self.metrics.handoff_states("received", n);
                Ok(Vec::new())
            }
            PeerRequest::Move { moves } => {
                let moves = moves
                    .into_iter()
                    .map(|(p, to)| (PartitionId(p), NodeId::new(to)))
                    .collect();
                let node = self.clone();
                tokio::spawn(async move {
                    if let Err(e) = node.move_out(moves).await {
                        tracing::warn!(node = %node.node_id, error = %e, "moving partitions out failed");
                    }
                });
                Ok(Vec::new())
            }
            PeerRequest::Nudge => {
                self.sync_now.notify_one();
                self.deploys.wake();
                Ok(Vec::new())
            }
            PeerRequest::LoadedModules => Ok(self.loaded_modules()),
            PeerRequest::Cache(op) => self.cache_local(op).map(|outcome| outcome.encode()),
            PeerRequest::Hello { .. } => Ok(Vec::new()),
        }
    }

    /// Fence: from now on nothing is served, and every `terminate` key is
    /// killed. Idempotent.
    fn fence(&self, cause: &str) {
        // Once per lease: `fence_now` and the loop noticing the fenced lease
        // are one fence, not two.
        if self
            .fenced_this_lease
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        let now = self.clock.now();
        // For the event log: the instant the node stopped acting, which is
        // the lease's fence point if that has passed (say, during a pause).
        let stopped_acting = std::time::Instant::now().checked_sub(
            lock(&self.lease)
                .fence_point()
                .map_or(Duration::ZERO, |p| now.saturating_duration_since(p)),
        );
        lock(&self.lease).fence_now(now);
        // Running guest code stops now, not after the sweep below (which is
        // O(live keys)): past the fence point the epoch callback interrupts
        // every `terminate` key, flagged or not (key/process.rs, `KeyProcess::start`).
        self.runtime.engine.increment_epoch();
        let renewals = lock(&self.lease).take_renewal_counts();
        self.metrics.fenced(cause, renewals);
        *lock(&self.leader_term) = None;
        lock(&self.unsure).clear();
        // Forget the table: after a rejoin every partition this node gets is
        // initialized anew (and its survivors reaped first).
        *self
            .table
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            OwnershipTable::new(self.config.partition_count());
        let killed: usize = self
            .slots()
            .iter()
            .map(|slot| slot.fence_keys(&self.limbo))
            .sum();
        // Running guests notice the kill flag at their next epoch check.
        self.runtime.engine.increment_epoch();
        // A fenced node serves no cache entry, and keeps none to serve later.
        lock(&self.cache).clear();
        // Nor handoff states: they die with the ownership they were for.
        let dropped = lock(&self.handoffs).clear();
        if dropped > 0 {
            tracing::warn!(node = %self.node_id, dropped, "handoff states waiting here were dropped by the fence");
            self.metrics.handoff_states("dropped_fence", dropped);
        }
        *lock(&self.fences) += 1;
        tracing::warn!(node = %self.node_id, cause, killed, "node fenced");
        let at = std::time::Instant::now();
        self.report(
            at,
            NodeEventKind::Fenced {
                fence_point: stopped_acting.unwrap_or(at),
                cause: cause.to_owned(),
            },
        );
    }

    /// Drop cache entries of partitions this node no longer owns under the
    /// token they were written with (their reads would miss anyway).
    fn drop_unowned_cache(&self) {
        let table = self.table();
        let me = &self.node_id;
        let dropped = lock(&self.cache).retain_owned(|p, token| {
            table
                .owner(p)
                .is_some_and(|a| &a.node == me && a.token == token)
        });
        if dropped > 0 {
            tracing::debug!(node = %self.node_id, dropped, "cache entries dropped at an ownership change");
        }
    }

    /// Kill keys whose partitions this node no longer owns per `table`.
    fn kill_lost_keys(&self, table: &OwnershipTable) {
        let me = &self.node_id;
        let mut killed = 0;
        for slot in self.slots() {
            killed += slot.kill_where("the partition moved to another node", |p| {
                lost(table, me, p)
            });
        }
        if killed > 0 {
            self.runtime.engine.increment_epoch();
        }
    }
}

/// Whether a forwarding error suggests this node's table is stale.
/// The module's own message limit (`max_message_size` of its options), under
/// the node's, which the caller checked already. Every local delivery path
/// (the mailbox and the inline call of an idle key) checks it.
fn check_module_message(slot: &ModuleSlot, message: &[u8]) -> Result<()> {
    match slot.current().options.max_message_size {
        Some(limit) if message.len() as u64 > limit.as_u64() => Err(Error::MessageTooLarge {
            size: message.len(),
            limit: limit.as_u64() as usize,
        }),
        _ => Ok(()),
    }
}

fn stale_route(error: &Error) -> bool {
    match error {
        Error::OwnerUnreachable { .. } => true,
        Error::Remote { code, .. } => code == "not_owner" || code == "fenced",
        _ => false,
    }
}

/// Name the owner by its node id (the transport only knows its address).
fn name_owner(error: Error, owner: &NodeId, addr: &str) -> Error {
    match error {
        Error::OwnerUnreachable { why, .. } => Error::OwnerUnreachable {
            owner: owner.to_string(),
            why: format!("{why} (peer address {addr})"),
        },
        other => other,
    }
}

pub(crate) fn refused(refusal: RouteRefusal) -> Error {
    match refusal {
        RouteRefusal::Fenced => Error::Fenced,
        RouteRefusal::Unowned(p) => Error::Unowned(p),
    }
}

/// What `status` reports about the node's lease.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LeaseState {
    /// Not granted yet.
    Pending,
    /// Current; the node serves.
    Current,
    /// Fenced; the node serves nothing.
    Fenced,
}

/// A deployed module, as reported by `status`.
#[derive(Clone, Debug, Serialize)]
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
    /// When that version was deployed.
    #[serde(with = "humantime_serde")]
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
#[derive(Clone, Debug, Serialize)]
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
#[derive(Clone, Debug, Serialize)]
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
    /// Whether the node is leaving the cluster.
    pub leaving: bool,
    /// The live nodes of the namespace, as this node last heard from the
    /// arbiter.
    pub nodes: Vec<NodeStatus>,
    /// Live key processes on this node.
    pub live_keys: usize,
    /// The coherent cache's counters on this node.
    pub cache: CacheStats,
    /// Topics with subscribers on this node.
    pub topics: usize,
    /// Deployed modules.
    pub modules: Vec<ModuleInfo>,
}

/// What a graceful [`Instance::leave`] did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LeaveReport {
    /// Keys whose handoff state could not travel, by name, with why; every
    /// other key's state went with its partition.
    pub lost_states: Vec<LostState>,
    /// There was no other live node to hand to: the keys stopped here, and
    /// their states ended with them.
    pub no_other_node: bool,
}

/// Chooses how an [`Instance`] starts: its arbiter, clock and peer listener.
pub struct InstanceBuilder {
    config: NodeConfig,
    arbiter: Option<Arc<dyn Arbiter>>,
    clock: Option<Arc<dyn NodeClock>>,
    peer_listener: Option<tokio::net::TcpListener>,
    observer: Option<KeyLifeObserver>,
    events: Option<NodeEventObserver>,
    modules: Vec<(String, Vec<u8>, ModuleOptions)>,
}

impl InstanceBuilder {
    /// Deploy a module before the node joins its cluster, so it never owns
    /// a partition without the module (repeatable).
    pub fn module(mut self, name: &str, wasm: Vec<u8>, options: ModuleOptions) -> Self {
        self.modules.push((name.to_owned(), wasm, options));
        self
    }

    /// Report every key process's start and end to `observer` (for
    /// single-ownership checkers and audits).
    pub fn observer(mut self, observer: KeyLifeObserver) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Report leases granted, fences and every routed message handed to a
    /// guest to `events` (see [`NodeEvent`]; `fief node --event-log` writes
    /// them to a file with [`crate::event_log::EventLog`]).
    pub fn events(mut self, events: NodeEventObserver) -> Self {
        self.events = Some(events);
        self
    }

    /// Use `arbiter` (default: a fresh [`LocalArbiter`] of the node's own).
    pub fn arbiter(mut self, arbiter: Arc<dyn Arbiter>) -> Self {
        self.arbiter = Some(arbiter);
        self
    }

    /// Measure the lease on `clock` (default: [`TokioClock`]).
    pub fn clock(mut self, clock: Arc<dyn NodeClock>) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Serve peers on `listener` (default: bind `peer_listen` from the
    /// config, if set; otherwise the node takes no forwarded messages).
    pub fn peer_listener(mut self, listener: tokio::net::TcpListener) -> Self {
        self.peer_listener = Some(listener);
        self
    }

    /// Start the node. Returns once it holds a lease and knows the table, or
    /// after one lease TTL if the arbiter cannot be reached (the node keeps
    /// trying in the background and serves nothing meanwhile).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if the configuration cannot work or a listener
    /// cannot be bound.
    pub async fn start(self) -> Result<Instance> {
        let config = self.config;
        config.validate()?;
        let timing = config.lease_timing()?;
        let clock: Arc<dyn NodeClock> = self.clock.unwrap_or_else(|| Arc::new(TokioClock::new()));
        let arbiter: Arc<dyn Arbiter> = match self.arbiter {
            Some(arbiter) => arbiter,
            None if config.arbiter == "local" => {
                Arc::new(LocalArbiter::new(clock.clone(), config.partition_count()))
            }
            None => Arc::new(
                PostgresArbiter::connect(
                    &config.arbiter,
                    &config.namespace,
                    config.partition_count(),
                )
                .await
                .map_err(|e| Error::Config(format!("cannot use the arbiter: {e}")))?,
            ),
        };
        let peer_listener = match (self.peer_listener, config.peer_listen) {
            (Some(listener), _) => Some(listener),
            (None, Some(addr)) => {
                Some(tokio::net::TcpListener::bind(addr).await.map_err(|e| {
                    Error::Config(format!("cannot listen for peers on {addr}: {e}"))
                })?)
            }
            (None, None) => None,
        };
        let peer_addr = match &peer_listener {
            // The address registered for peers: the advertised one if set
            // (peers reach the node through a proxy), else the listener's.
            Some(_) if config.peer_advertise.is_some() => config.peer_advertise.clone(),
            Some(l) => Some(
                l.local_addr()
                    .map_err(|e| Error::Config(format!("peer listener: {e}")))?
                    .to_string(),
            ),
            None => None,
        };
        let runtime = Runtime::new(&config)?;
        // Guest code runs on threads of its own, never on this runtime's
        // workers (which serve the API and the peer links).
        let guest_pool = GuestPool::start(
            crate::scheduler::guest_threads(config.guest_threads),
            config.guest_thread_nice,
        )?;
        let limbo = Limbo::start(runtime.engine.clone());
        let cache_max_bytes =
            usize::try_from(config.cache_max_bytes.as_u64()).unwrap_or(usize::MAX);
        let cache_tenant_max_bytes =
            usize::try_from(config.cache_max_bytes_per_tenant.as_u64()).unwrap_or(usize::MAX);
        let cache_namespace_max_bytes =
            usize::try_from(config.cache_max_bytes_per_namespace.as_u64()).unwrap_or(usize::MAX);
        let host_bytes_per_tenant =
            usize::try_from(config.max_host_bytes_per_tenant.as_u64()).unwrap_or(usize::MAX);
        let tenant_cpu = crate::cpu_budget::TenantCpuMeters::new(
            config
                .cpu_budget_per_tenant
                .map(|cores| (cores, config.cpu_budget_per_tenant_window)),
        );
        let coordinator = Coordinator::new(timing);
        let shared = Arc::new(NodeShared {
            node_id: NodeId::new(&config.node_id),
            table: RwLock::new(OwnershipTable::new(config.partition_count())),
            fence_gate: coordinator.gate(),
            lease: Mutex::new(coordinator),
            peers: PeerPool::new(
                &config.namespace,
                &config.node_id,
                config.max_message_size.as_u64() as usize,
                crate::peer_auth::PeerSecurity::load(&config)?,
            ),
            config,
            runtime,
            guest: guest_pool.handle().clone(),
            pubsub: PubSub::default(),
            tasks: TaskTracker::new(),
            limbo,
            clock,
            arbiter,
            members: RwLock::new(BTreeMap::new()),
            peer_addr,
            leader_term: Mutex::new(None),
            modules: RwLock::new(HashMap::new()),
            deploys: crate::deploy::Deploys::default(),
            fences: Mutex::new(0),
            observer: self.observer,
            events: self.events,
            lease_id: Mutex::new(None),
            draining: Mutex::new(BTreeSet::new()),
            unsure: Mutex::new(BTreeMap::new()),
            handoffs: Mutex::new(HandoffStates::default()),
            host_bytes: TenantLedgers::new(host_bytes_per_tenant),
            tenant_cpu,
            leave_losses: Mutex::new(Vec::new()),
            moving: tokio::sync::Mutex::new(()),
            leaving: std::sync::atomic::AtomicBool::new(false),
            sync_now: tokio::sync::Notify::new(),
            coordination_crash: std::sync::atomic::AtomicBool::new(false),
            route_delay_ms: std::sync::atomic::AtomicU64::new(0),
            fenced_this_lease: std::sync::atomic::AtomicBool::new(false),
            stop_requested: watch::channel(false).0,
            cache: Mutex::new(CacheStore::new(
                cache_max_bytes,
                cache_tenant_max_bytes,
                cache_namespace_max_bytes,
            )),
            metrics: crate::metrics::Metrics::new(),
        });
        // Builder modules go through the module store like any deploy; then
        // the node loads everything the store has before it joins, so it
        // never owns a partition without its modules.
        for (name, wasm, options) in self.modules {
            shared.deploy_at_start(&name, wasm.into(), options).await?;
        }
        if let Err(e) = shared.sync_modules().await {
            tracing::warn!(node = %shared.node_id, error = %e, "cannot load the stored modules at start; the module follower keeps trying");
        }
        let peer_server = peer_listener.map(|listener| {
            tokio::spawn(crate::transport::serve(Arc::downgrade(&shared), listener))
        });
        let (ready_tx, mut ready_rx) = watch::channel(false);
        // The coordination loop runs on a thread of its own, so its timing
        // does not depend on how busy this runtime is with guest code; what
        // it starts that must run here goes through `main`.
        let coordination = {
            let (shared, main) = (shared.clone(), tokio::runtime::Handle::current());
            DedicatedRuntime::start("fief-coordinate", move || supervise(shared, ready_tx, main))
                .map_err(|e| {
                    Error::Internal(format!("cannot start the coordination thread: {e}"))
                })?
        };
        let ttl = shared.config.lease_ttl;
        let _ = tokio::time::timeout(ttl, ready_rx.wait_for(|ready| *ready)).await;
        tracing::info!(node = %shared.node_id, namespace = %shared.config.namespace, "node started");
        Ok(Instance {
            shared,
            coordination: Coordination(coordination),
            peer_server,
            _guest_pool: guest_pool,
        })
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
    /// The guest threads. Dropped last (after a shutdown has waited for the
    /// key tasks), it drops whatever key task is left: a node dropped
    /// without a shutdown ends like a crash, and its threads with it.
    _guest_pool: GuestPool,
}

impl Instance {
    /// Start a node with its own in-process arbiter (the embedded default):
    /// it is the namespace's only node and owns every partition.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if the configuration cannot work.
    pub async fn start_embedded(config: NodeConfig) -> Result<Instance> {
        Instance::builder(config).start().await
    }

    /// A builder, to choose the arbiter, the clock and the peer listener.
    pub fn builder(config: NodeConfig) -> InstanceBuilder {
        InstanceBuilder {
            config,
            arbiter: None,
            clock: None,
            peer_listener: None,
            observer: None,
            events: None,
            modules: Vec::new(),
        }
    }
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

    /// A snapshot of the node.
    pub fn status(&self) -> Status {
        let shared = &self.shared;
        let now = shared.clock.now();
        let lease = shared.lease_status();
        let rejoining = shared
            .fenced_this_lease
            .load(std::sync::atomic::Ordering::SeqCst);
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
            leader_term: lock(&shared.leader_term).map(|t| t.0),
            epoch: table.epoch(),
            partitions: table.partitions().get(),
            partitions_owned: table.count_owned_by(&shared.node_id),
            partitions_moving: lock(&shared.draining)
                .iter()
                .chain(lock(&shared.unsure).keys())
                .collect::<BTreeSet<_>>()
                .len(),
            handoff_states: handoffs.0,
            handoff_bytes: handoffs.1,
            host_bytes: shared.host_bytes.report(),
            tenant_cpu: shared.tenant_cpu.report(),
            fences: *lock(&shared.fences),
            leaving: shared.leaving.load(std::sync::atomic::Ordering::SeqCst),
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
            cache: shared.cache_stats(),
            topics: shared.pubsub.topic_count(),
            modules,
        }
    }

    /// The cluster's coherent cache, reached through this node: every
    /// operation goes to the owner of its key's partition.
    pub fn cache(&self) -> Cache {
        Cache {
            shared: self.shared.clone(),
        }
    }

    /// Fence the node now, as if its lease could not be renewed: every
    /// `terminate` key is killed and nothing is served until it rejoins.
    pub fn fence_now(&self) {
        self.shared.fence("requested");
    }

    /// Leave the cluster gracefully: mark this node as leaving at the
    /// arbiter, let the leader move every partition it owns to other nodes
    /// (each key stops with `handoff`, and its state travels to the new
    /// owner's `init`), then release the lease. The node serves nothing
    /// afterwards; stop it with [`Instance::shutdown`]. A node with no other
    /// live node to hand to just releases its lease.
    ///
    /// The report names every key whose handoff state could not travel (too
    /// large for its module's `max_handoff_size`, or its `handoff` trapped);
    /// every other key's state went with its partition.
    ///
    /// # Errors
    ///
    /// [`Error::Fenced`] if the node holds no lease, [`Error::Timeout`] if
    /// the partitions did not all move within `timeout`,
    /// [`Error::FencedWhileLeaving`] if a fence cut it short, or an arbiter
    /// error.
    pub async fn leave(&self, timeout: Duration) -> Result<LeaveReport> {
        let shared = &self.shared;
        let ns = &shared.config.namespace;
        let limit = shared.config.renew_interval;
        let lease = (*lock(&shared.lease_id)).ok_or(Error::Fenced)?;
        let arbiter_error = |e: ArbiterError| Error::OwnerUnreachable {
            owner: "the arbiter".to_owned(),
            why: e.to_string(),
        };
        lock(&shared.leave_losses).clear();
        shared
            .leaving
            .store(true, std::sync::atomic::Ordering::SeqCst);
        bounded(
            limit,
            shared.arbiter.set_leaving(ns, &shared.node_id, lease),
        )
        .await
        .map_err(arbiter_error)?;
        let members = bounded(limit, shared.arbiter.live_nodes(ns))
            .await
            .map_err(arbiter_error)?;
        let others = members
            .iter()
            .any(|m| m.node != shared.node_id && !m.leaving);
        // A fence during the leave forgets the table, so "owns nothing"
        // would then be true without one handoff: the keys it still held
        // were stopped by the fence. That is not a graceful leave; say so.
        let fenced_meanwhile = || {
            *lock(&shared.lease_id) != Some(lease)
                || shared
                    .fenced_this_lease
                    .load(std::sync::atomic::Ordering::SeqCst)
        };
        if others {
            tracing::info!(node = %shared.node_id, "leaving: handing off partitions");
            let deadline = tokio::time::Instant::now() + timeout;
            loop {
                // Nothing is left to hand off: finish leaving, then say so.
                if fenced_meanwhile() {
                    break;
                }
                if shared.table().count_owned_by(&shared.node_id) == 0 {
                    break;
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(Error::Timeout(timeout));
                }
                shared.sync_now.notify_one();
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        self.coordination.abort();
        let fenced = fenced_meanwhile();
        // Stop serving before the release: once released, the arbiter lets
        // others take whatever this node still owns (found by the
        // simulation, when a leave found no other node to hand off to).
        lock(&shared.lease).fence_now(shared.clock.now());
        bounded(limit, shared.arbiter.release(ns, &shared.node_id, lease))
            .await
            .map_err(arbiter_error)?;
        let report = LeaveReport {
            lost_states: std::mem::take(&mut *lock(&shared.leave_losses)),
            no_other_node: !others,
        };
        tracing::info!(node = %shared.node_id, lost_states = report.lost_states.len(), no_other_node = report.no_other_node, "left the cluster");
        if fenced {
            return Err(Error::FencedWhileLeaving);
        }
        Ok(report)
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
        self.shared.sync_now.notify_one();
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
        if let Some(server) = &self.peer_server {
            server.abort();
        }
        for slot in self.shared.slots() {
            slot.kill_where("the node crashed", |_| true);
        }
        self.shared.limbo.kill_all().await;
        self.shared.runtime.engine.increment_epoch();
        self.shared.tasks.close();
        self.shared.tasks.wait().await;
    }

    /// Stop the node: stop every key gracefully (`terminate(shutdown)`),
    /// kill what does not stop within a second, release the lease.
    pub async fn shutdown(self) {
        self.coordination.abort();
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
            for slot in self.shared.slots() {
                slot.kill_where("the node is shutting down", |_| true);
            }
            self.shared.runtime.engine.increment_epoch();
        }
        // Survivors die with the instance (after the drain, which does not
        // touch limbo).
        self.shared.limbo.kill_all().await;
        self.shared.tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.shared.tasks.wait()).await;
        tracing::info!(node = %self.shared.node_id, "node stopped");
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

/// The coordination loop's thread, as the instance holds it.
struct Coordination(DedicatedRuntime);

impl Coordination {
    /// Stop the coordination loop (and the module follower it started), and
    /// wait until it has stopped: once this returns it takes no further
    /// step (shutdown, leave, crash). Idempotent.
    fn abort(&self) {
        self.0.stop();
    }
}

/// Run the coordination loop; if it ever ends or panics, the node fences
/// (contract §1.3: "its own coordination crashed").
///
/// This is the root of the coordination thread (a [`DedicatedRuntime`],
/// started by [`InstanceBuilder::start`]); `main` is the node's runtime, for
/// the work the loop starts that belongs there. Stopping the thread drops
/// this future, which aborts the loop and the follower.
async fn supervise(shared: Arc<NodeShared>, ready: watch::Sender<bool>, main: Handle) {
    /// Aborts the coordination task when the supervisor is dropped or
    /// aborted (shutdown, leave), so the two never outlive each other.
    struct AbortOnDrop(tokio::task::AbortHandle);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    // A task of the coordination thread's runtime, so that its panic is
    // caught here.
    let task = tokio::spawn(coordinate(shared.clone(), ready, main.clone()));
    let _guard = AbortOnDrop(task.abort_handle());
    // The module follower loads and compiles modules: the node's runtime.
    let follower = main.spawn(crate::deploy::follow_modules(shared.clone()));
    let _follower_guard = AbortOnDrop(follower.abort_handle());
    let outcome = task.await;
    if let Err(e) = outcome
        && e.is_panic()
    {
        let _main = main.enter();
        shared.fence("the coordination loop crashed");
    }
}

/// The coordination loop: a thin driver of `fief_core`'s [`Coordinator`].
/// It carries out the coordinator's actions (one arbiter request at a
/// time, fences, table adoption, graceful moves) and ticks it at the
/// instant it asks for (the fence point, a request's deadline, the next
/// renewal). Every decision — when to renew, when to fence, what the
/// leader writes, which partitions move — is the coordinator's, so the
/// deterministic simulation (`fief_core::sim`) checks the code that runs
/// here.
///
/// It runs on the coordination thread, so its sleeps (the fence point, the
/// next renewal, a request's deadline) and its arbiter requests are not
/// queued behind guest code. It spawns nothing there: graceful moves go to
/// the node's runtime (`main`), and the fence, which spawns the timers of
/// `callback` keys' deadlines, runs in `main`'s context. A table adoption
/// runs here (it must lose the race with the fence point, as below); it only
/// waits for the node's runtime (limbo's bookkeeper, reaped keys' ends).
async fn coordinate(shared: Arc<NodeShared>, ready: watch::Sender<bool>, main: Handle) {
    let ns = shared.config.namespace.clone();
    let mut actions = lock(&shared.lease).on_tick(shared.clock.now());
    loop {
        assert!(
            !shared
                .coordination_crash
                .load(std::sync::atomic::Ordering::SeqCst),
            "coordination crash injected"
        );
        let mut request = None;
        for action in std::mem::take(&mut actions) {
            match action {
                Action::Send { id, request: r } => request = Some((id, r)),
                Action::LeaseGranted(id) => {
                    *lock(&shared.lease_id) = Some(id);
                    shared
                        .fenced_this_lease
                        .store(false, std::sync::atomic::Ordering::SeqCst);
                    tracing::info!(node = %shared.node_id, lease = id.0, "lease granted");
                    shared.report(
                        std::time::Instant::now(),
                        NodeEventKind::LeaseGranted { lease: id.0 },
                    );
                }
                Action::Fence { cause } => {
                    {
                        let _main = main.enter();
                        shared.fence(cause);
                    }
                    *lock(&shared.lease_id) = None;
                }
                Action::Leader(term) => *lock(&shared.leader_term) = term,
                Action::Members(members) => {
                    *shared
                        .members
                        .write()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) =
                        members.into_iter().map(|m| (m.node.clone(), m)).collect();
                }
                Action::AdoptTable { table, asked_at } => {
                    // Adoption may reap survivors; it races the fence too.
                    let fence_point = lock(&shared.lease).fence_point();
                    let fence_point = fence_point.unwrap_or(fief_core::Instant::ZERO);
                    tokio::select! {
                        biased;
                        () = shared.clock.sleep_until(fence_point) => {}
                        _ = shared.adopt_table(table) => {}
                    }
                    // A read sent after a transfer failed settles it.
                    lock(&shared.unsure).retain(|_, failed| *failed >= asked_at);
                }
                Action::StartMoves(by_owner) => start_moves(&shared, &main, by_owner),
                Action::Ready => {
                    ready.send_replace(true);
                }
            }
        }
        let wake = lock(&shared.lease).wake_at();
        actions = match request {
            Some((id, request)) => {
                let reply = tokio::select! {
                    biased;
                    () = shared.clock.sleep_until(wake) => None,
                    reply = ask_arbiter(&shared, &ns, request) => Some(reply),
                };
                let now = shared.clock.now();
                match reply {
                    Some(reply) => lock(&shared.lease).on_reply(now, id, reply),
                    None => lock(&shared.lease).on_tick(now),
                }
            }
            None => {
                tokio::select! {
                    () = shared.clock.sleep_until(wake) => {}
                    () = shared.sync_now.notified() => lock(&shared.lease).nudge(),
                }
                lock(&shared.lease).on_tick(shared.clock.now())
            }
        };
    }
}

/// Carry one coordinator request to the arbiter; its answer as the
/// coordinator reads it. (The coordinator bounds the wait.)
async fn ask_arbiter(shared: &NodeShared, ns: &str, request: Request) -> Reply {
    let arbiter = &shared.arbiter;
    let node = &shared.node_id;
    let failed = |what: &str, e: ArbiterError| {
        match what {
            "join" | "renew" => tracing::warn!(node = %node, error = %e, "{what} failed"),
            _ => tracing::debug!(node = %node, error = %e, "{what} failed"),
        }
        match e {
            ArbiterError::LeaseExpired(_) => Reply::LeaseExpired,
            e => Reply::Failed(e.to_string()),
        }
    };
    match request {
        Request::Register => {
            let ttl = shared.config.lease_ttl;
            match arbiter
                .register(ns, node, ttl, shared.peer_addr.as_deref())
                .await
            {
                Ok(id) => Reply::Registered(id),
                Err(e) => failed("join", e),
            }
        }
        Request::Renew(lease) => match arbiter.renew(ns, node, lease).await {
            Ok(()) => Reply::Renewed,
            Err(e) => failed("renew", e),
        },
        Request::Campaign(lease) => match arbiter.campaign(ns, node, lease).await {
            Ok(term) => Reply::Campaign(term),
            Err(e) => failed("campaign", e),
        },
        Request::LiveNodes => match arbiter.live_nodes(ns).await {
            Ok(members) => Reply::Members(members),
            Err(e) => failed("reading the members", e),
        },
        Request::Table => match arbiter.table(ns).await {
            Ok(table) => Reply::Table(table),
            Err(e) => failed("reading the table", e),
        },
        Request::WriteTable(term, changes) => match arbiter.write_table(ns, term, changes).await {
            Ok(table) => Reply::Table(table),
            Err(e) => {
                tracing::warn!(node = %node, error = %e, "table change refused");
                failed("writing the table", e)
            }
        },
    }
}

/// As leader: ask each owner to hand the listed partitions to the listed
/// nodes (the coordinator's graceful moves). Each owner moves its own. On
/// the node's runtime (`main`): a move runs guest `handoff`s.
fn start_moves(
    shared: &Arc<NodeShared>,
    main: &Handle,
    by_owner: Vec<(NodeId, Vec<(PartitionId, NodeId)>)>,
) {
    for (owner, moves) in by_owner {
        let node = shared.clone();
        main.spawn(async move {
            let result = if owner == node.node_id {
                node.move_out(moves).await
            } else {
                let request = PeerRequest::Move {
                    moves: moves
                        .into_iter()
                        .map(|(p, to)| (p.0, to.to_string()))
                        .collect(),
                };
                match node.peer_addr_of(&owner) {
                    Ok(addr) => node
                        .peers
                        .request(&addr, request, node.config.call_timeout)
                        .await
                        .map(|_| ()),
                    Err(e) => Err(e),
                }
            };
            if let Err(e) = result {
                tracing::debug!(node = %node.node_id, %owner, error = %e, "asking for a handoff failed");
            }
        });
    }
}

/// Wait for an arbiter answer at most `limit`.
async fn bounded<T>(
    limit: Duration,
    f: crate::arbiter::ArbiterFuture<'_, T>,
) -> Result<T, ArbiterError> {
    tokio::time::timeout(limit, f)
        .await
        .unwrap_or_else(|_| Err(ArbiterError::Unreachable("no answer in time".to_owned())))
}
