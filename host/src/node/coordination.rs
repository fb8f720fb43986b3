//! The coordination loop and what it carries out.
//!
//! This file owns the node's driver of `fief_core`'s `Coordinator`: the loop
//! on its own thread (`supervise`, `coordinate`) that carries the
//! coordinator's requests to the arbiter one at a time and carries out its
//! actions; the fence (`fence`: nothing served, every `terminate` key killed,
//! the table, the cache and waiting handoff states forgotten); and the
//! adoption of a newer partition table (survivors of gained partitions reaped
//! first, keys of lost partitions killed). **Invariant: the loop runs on its
//! own thread**, so guest code cannot delay a renewal or the fence. It must
//! not decide anything about time or ownership itself (the coordinator does),
//! nor run guest code on that thread: moves go to the node's runtime
//! (`moves.rs`).

use std::sync::Arc;
use std::time::Duration;

use fief_core::OwnershipTable;
use fief_core::coordinator::{Action, Reply, Request, gained_partitions, lost};
use tokio::runtime::Handle;
use tokio::sync::watch;

use super::NodeShared;
use super::moves::start_moves;
use crate::arbiter::ArbiterError;
use crate::dedicated::DedicatedRuntime;
use crate::error::Result;
use crate::event_log::NodeEventKind;
use crate::key::lock;

impl NodeShared {
    /// Read the table from the arbiter now. Returns whether it changed.
    ///
    /// Partitions this node gains are *initialized*: survivors of them still
    /// in limbo are reaped (and gone) before the new table routes anything
    /// to this node, so one node never hosts a survivor and a fresh process
    /// for one key.
    pub(super) async fn refresh_table(&self) -> bool {
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
    pub(super) async fn adopt_table(&self, newer: OwnershipTable) -> bool {
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

    /// Fence: from now on nothing is served, and every `terminate` key is
    /// killed. Idempotent.
    pub(super) fn fence(&self, cause: &str) {
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

/// The coordination loop's thread, as the instance holds it.
pub(super) struct Coordination(pub(super) DedicatedRuntime);

impl Coordination {
    /// Stop the coordination loop (and the module follower it started), and
    /// wait until it has stopped: once this returns it takes no further
    /// step (shutdown, leave, crash). Idempotent.
    pub(super) fn abort(&self) {
        self.0.stop();
    }
}

/// Run the coordination loop; if it ever ends or panics, the node fences
/// (contract §1.3: "its own coordination crashed").
///
/// This is the root of the coordination thread (a [`DedicatedRuntime`],
/// started by [`InstanceBuilder::start`](super::InstanceBuilder::start));
/// `main` is the node's runtime, for the work the loop starts that belongs
/// there. Stopping the thread drops this future, which aborts the loop and
/// the follower.
pub(super) async fn supervise(shared: Arc<NodeShared>, ready: watch::Sender<bool>, main: Handle) {
    /// Aborts the coordination task when the supervisor is dropped or
    /// aborted (shutdown, leave), so the two never outlive each other.
    struct AbortOnDrop(tokio::task::AbortHandle);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    // The module follower loads and compiles modules: the node's runtime.
    let follower = main.spawn(crate::deploy::follow_modules(shared.clone()));
    let _follower_guard = AbortOnDrop(follower.abort_handle());
    loop {
        // A task of the coordination thread's runtime, so that its panic is
        // caught here.
        let task = tokio::spawn(coordinate(shared.clone(), ready.clone(), main.clone()));
        let guard = AbortOnDrop(task.abort_handle());
        let outcome = task.await;
        drop(guard);
        match outcome {
            Err(e) if e.is_panic() => {
                {
                    let _main = main.enter();
                    shared.fence("the coordination loop crashed");
                }
                // Restart it, and so rejoin with a fresh lease, once the
                // lease it held has expired at the arbiter: what a restarted
                // process would do, without losing the survivors in limbo
                // (they live on as after any fence). A loop that crashes
                // again waits again: at most one crash per lease TTL.
                let wait = shared.config.lease_ttl;
                tracing::error!(
                    node = %shared.node_id,
                    restart_in = ?wait,
                    "the coordination loop crashed: the node fenced; the loop restarts and \
                     rejoins with a fresh lease"
                );
                shared.metrics.coordination_restart();
                tokio::time::sleep(wait).await;
            }
            // The loop ended (a leave) or was cancelled (shutdown).
            _ => return,
        }
    }
}

/// The coordination loop: a thin driver of `fief_core`'s
/// [`Coordinator`](fief_core::Coordinator).
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
        // Fault injection: one crash per injection.
        if shared
            .coordination_crash
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            panic!("coordination crash injected");
        }
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

/// Wait for an arbiter answer at most `limit`.
pub(super) async fn bounded<T>(
    limit: Duration,
    f: crate::arbiter::ArbiterFuture<'_, T>,
) -> Result<T, ArbiterError> {
    tokio::time::timeout(limit, f)
        .await
        .unwrap_or_else(|_| Err(ArbiterError::Unreachable("no answer in time".to_owned())))
}
