//! The node's executor of its ownership protocol, and the coordination loop.
//!
//! `fief_core::Membership` decides everything about the lease, the table,
//! moves, the fence and the leave; this file carries its effects out. Every
//! input goes through [`NodeShared::apply`]: under the membership's lock it
//! feeds the input and publishes the routing view and the members for
//! lock-free readers; then, in emission order (under the `executing` lock,
//! taken before the membership's and held until the effects are carried
//! out, so feeds never interleave), it carries out the effects:
//! arbiter requests and reaps as tasks on the coordination thread, key stops
//! and handoffs as tasks on the node's runtime (`moves.rs`), the fence
//! (every `terminate` key killed, survivors to limbo, the cache and waiting
//! handoff states forgotten) and a table change (keys of lost partitions
//! killed) at once. Answers come back as further inputs. The coordination
//! loop (`coordinate`) only ticks the membership at the instant it asks for.
//! **Invariant: the loop and the arbiter requests run on the coordination
//! thread**, so guest code cannot delay a renewal or the fence. It must not
//! decide anything about time or ownership itself (the membership does),
//! nor run guest code on that thread, nor feed an input while carrying out
//! an effect (the tasks it spawns do, later).

use std::sync::Arc;
use std::time::Duration;

use fief_core::coordinator::{Reply, Request, lost};
use fief_core::membership::Effect;
use fief_core::{Instant, LeaseStatus, Membership, OwnershipTable};
use tokio::runtime::Handle;

use super::NodeShared;
use crate::arbiter::ArbiterError;
use crate::dedicated::DedicatedRuntime;
use crate::event_log::NodeEventKind;
use crate::sync::lock;

impl NodeShared {
    /// Feed one input to the membership and carry out the effects it
    /// returns (see the file header). Callable from any thread, never from
    /// an effect's execution.
    pub(crate) fn apply(
        self: &Arc<Self>,
        input: impl FnOnce(&mut Membership, Instant) -> Vec<Effect>,
    ) {
        self.apply_with(|m, now| ((), input(m, now)));
    }

    /// As [`apply`](Self::apply), for an input with a result of its own
    /// (the op id a caller waits on). The result is returned after the
    /// effects were carried out; register a waiter for it inside `input`.
    pub(crate) fn apply_with<R>(
        self: &Arc<Self>,
        input: impl FnOnce(&mut Membership, Instant) -> (R, Vec<Effect>),
    ) -> R {
        let result = self.feed(input);
        // The next tick may have moved (a request sent, a deadline set).
        self.wake.notify_one();
        result
    }

    /// The body of [`apply_with`](Self::apply_with), without waking the
    /// coordination loop (which calls it for its own ticks).
    fn feed<R>(
        self: &Arc<Self>,
        input: impl FnOnce(&mut Membership, Instant) -> (R, Vec<Effect>),
    ) -> R {
        // `executing` first, then the membership: effects run in the order
        // the membership emitted them, and a reader of the membership
        // (`status`, say from an observer the fence reports to) never waits
        // for effects to finish.
        let executing = lock(&self.executing);
        let mut m = lock(&self.membership);
        let now = self.clock.now();
        let (result, effects) = input(&mut m, now);
        let view = m.view();
        let view_changed = !Arc::ptr_eq(&self.view(), &view);
        if view_changed {
            self.view.store(view);
        }
        if effects.iter().any(|e| matches!(e, Effect::MembersChanged)) {
            *self
                .members
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = m.members().clone();
        }
        drop(m);
        let lease_current = matches!(self.gate_status(), LeaseStatus::Current { .. });
        self.alarms
            .partitions_may_have_changed(view_changed, lease_current);
        for effect in effects {
            self.execute(effect);
        }
        drop(executing);
        result
    }

    /// Carry out one effect: at once, or as a task whose end is an input.
    fn execute(self: &Arc<Self>, effect: Effect) {
        match effect {
            Effect::Arbiter { id, request } => {
                self.ask(request, move |m, now, reply| m.on_reply(now, id, reply))
            }
            Effect::ArbiterOp { op, request } => {
                self.ask(request, move |m, now, reply| m.on_op_reply(now, op, reply))
            }
            Effect::Peer { to, addr, message } => self.send_peer(to, addr, message),
            Effect::StopForHandoff { op, partitions } => self.stop_move(op, partitions),
            Effect::SendHandoff {
                op,
                move_id,
                to,
                addr,
                partitions,
            } => self.send_handoff(op, move_id, to, addr, partitions),
            Effect::MoveEnded { move_id, outcome } => self.move_ended(move_id, outcome),
            Effect::Reap { op, partitions } => {
                let node = self.clone();
                self.coordination_handle().spawn(async move {
                    let reaped = node.limbo.reap(partitions).await;
                    if reaped > 0 {
                        tracing::info!(node = %node.node_id, reaped, "survivors reaped: their partitions are initialized again");
                    }
                    node.apply(|m, now| m.on_reaped(now, op));
                });
            }
            Effect::LeaseGranted(lease) => {
                tracing::info!(node = %self.node_id, lease = lease.0, "lease granted");
                self.report(
                    std::time::Instant::now(),
                    NodeEventKind::LeaseGranted { lease: lease.0 },
                );
            }
            Effect::ArbiterRegressed(regression) => {
                tracing::error!(node = %self.node_id, what = regression.what(), "{regression}");
                self.metrics.arbiter_regressed(regression.what());
                *lock(&self.arbiter_regression) = Some(regression.to_string());
            }
            Effect::Fence {
                cause,
                renewals,
                fence_point,
            } => self.fence(cause, renewals, fence_point),
            Effect::TableChanged => {
                let table = self.table();
                self.kill_lost_keys(&table);
                self.drop_unowned_cache();
                let stale = lock(&self.handoffs).sweep(&table, &self.node_id);
                self.handoff_dropped("dropped_stale", &stale);
            }
            // Published by `apply_with`, under the membership's lock.
            Effect::MembersChanged => {}
            Effect::Refreshed { op, changed } => {
                if let Some(waiter) = lock(&self.refreshes).remove(&op) {
                    let _ = waiter.send(changed);
                }
            }
            Effect::LeaveDone(outcome) => {
                if let Some(waiter) = lock(&self.leave_waiter).take() {
                    let _ = waiter.send(outcome);
                }
            }
            Effect::Ready => {
                self.ready.send_replace(true);
            }
        }
    }

    /// The coordination thread's runtime (the node's before it started).
    fn coordination_handle(&self) -> &Handle {
        self.coordination_rt.get().unwrap_or(&self.main)
    }

    /// Send `request` to the arbiter from the coordination thread, and feed
    /// its answer back with `answer`. The membership times requests out
    /// itself; the task is bounded too, so a hung connection holds nothing.
    fn ask(
        self: &Arc<Self>,
        request: Request,
        answer: impl FnOnce(&mut Membership, Instant, Reply) -> Vec<Effect> + Send + 'static,
    ) {
        let node = self.clone();
        let limit = match request {
            Request::Transfer(..) => self.config.call_timeout,
            _ => self.config.renew_interval,
        };
        self.coordination_handle().spawn(async move {
            let ns = node.config.namespace.clone();
            // Named before the request moves: a lease request that times
            // out is logged as its failures are (`ask_arbiter`).
            let lease_request = match &request {
                Request::Register => Some("join"),
                Request::Renew(_) => Some("renew"),
                _ => None,
            };
            let reply = tokio::time::timeout(limit, ask_arbiter(&node, &ns, request))
                .await
                .unwrap_or_else(|_| {
                    if let Some(what) = lease_request {
                        tracing::warn!(node = %node.node_id, after = ?limit, "{what} got no answer in time");
                    }
                    Reply::Failed("no answer in time".to_owned())
                });
            node.apply(|m, now| answer(m, now, reply));
        });
    }

    /// Read the table from the arbiter now and adopt it if newer (a
    /// forwarded call found its owner gone). Returns whether it changed.
    ///
    /// Partitions this node gains are *initialized*: survivors of them still
    /// in limbo are reaped (and gone) before the new table routes anything
    /// to this node, so one node never hosts a survivor and a fresh process
    /// for one key.
    pub(super) async fn refresh_table(self: &Arc<Self>) -> bool {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.apply_with(|m, now| {
            let (op, effects) = m.refresh_table(now);
            lock(&self.refreshes).insert(op, tx);
            ((), effects)
        });
        let limit = self.config.renew_interval * 2;
        matches!(tokio::time::timeout(limit, rx).await, Ok(Ok(true)))
    }

    /// The fence, as the node carries it out: from now on nothing is
    /// served (the gate and the routing view say so already), every
    /// `terminate` key is killed, survivors go to limbo.
    fn fence(&self, cause: &str, renewals: fief_core::RenewalCounts, fence_point: Option<Instant>) {
        // Running guest code stops now, not after the sweep below (which is
        // O(live keys)): past the fence point the epoch callback interrupts
        // every `terminate` key, flagged or not (key/process.rs, `KeyProcess::start`).
        self.runtime.engine.increment_epoch();
        let now = self.clock.now();
        // For the event log: the instant the node stopped acting, which is
        // the lease's fence point if that has passed (say, during a pause).
        let stopped_acting = std::time::Instant::now()
            .checked_sub(fence_point.map_or(Duration::ZERO, |p| now.saturating_duration_since(p)));
        self.metrics.fenced(cause, renewals);
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
        // Nor the connections attached to its keys: each one's holder
        // attaches it to the key's next owner, known by its token (even if
        // that is this node again, after it rejoined).
        self.connections.attached.clear();
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
    /// Only while the lease is current: once fenced, the fence's sweep
    /// decides each key's end (survivors go to limbo, not to a kill).
    fn kill_lost_keys(&self, table: &OwnershipTable) {
        if !self.may_act() {
            return;
        }
        let me = &self.node_id;
        let mut killed = 0;
        for slot in self.slots() {
            killed += slot.kill_where("the partition moved to another node", |p| {
                lost(table, me, p)
            });
        }
        if killed > 0 {
            self.runtime.engine.increment_epoch();
            tracing::info!(node = %self.node_id, killed, "keys of partitions now owned elsewhere were killed");
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

/// Run the coordination loop; if it ever panics, the node fences (contract
/// §1.3: "its own coordination crashed") and the loop starts again, so the
/// node rejoins with a fresh lease once its old one has expired at the
/// arbiter (which refuses a second lease for one node until then).
///
/// This is the root of the coordination thread (a [`DedicatedRuntime`],
/// started by [`InstanceBuilder::start`](super::InstanceBuilder::start));
/// `main` is the node's runtime, for the work the loop starts that belongs
/// there. Stopping the thread drops this future, which aborts the loop and
/// the follower.
pub(super) async fn supervise(shared: Arc<NodeShared>, main: Handle) {
    /// Aborts the coordination task when the supervisor is dropped or
    /// aborted (shutdown, leave), so the two never outlive each other.
    struct AbortOnDrop(tokio::task::AbortHandle);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let _ = shared.coordination_rt.set(Handle::current());
    // The module follower loads and compiles modules: the node's runtime.
    let follower = main.spawn(super::deploy::follow_modules(shared.clone()));
    let _follower_guard = AbortOnDrop(follower.abort_handle());
    loop {
        // A task of the coordination thread's runtime, so that its panic is
        // caught here.
        let task = tokio::spawn(coordinate(shared.clone()));
        let guard = AbortOnDrop(task.abort_handle());
        let outcome = task.await;
        drop(guard);
        match outcome {
            Err(e) if e.is_panic() => {
                {
                    let _main = main.enter();
                    shared.apply(|m, now| m.fence_now(now, "the coordination loop crashed"));
                }
                // Survivors live on in limbo, as after any fence. A loop
                // that crashes again waits again: at most one crash per
                // renewal interval.
                let wait = shared.config.renew_interval;
                tracing::error!(
                    node = %shared.node_id,
                    restart_in = ?wait,
                    "the coordination loop crashed: the node fenced; the loop restarts and \
                     rejoins with a fresh lease once the old one has expired"
                );
                shared.metrics.coordination_restart();
                tokio::time::sleep(wait).await;
            }
            // The loop was cancelled (shutdown, leave).
            _ => return,
        }
    }
}

/// The coordination loop: ticks the membership at the instant it asks for
/// (the fence point, a request's deadline, the next renewal, a leave's next
/// look), or sooner when an input moved that instant. Every decision is the
/// membership's, so the deterministic simulation (`fief_core::sim`) checks
/// the code that runs here.
async fn coordinate(shared: Arc<NodeShared>) {
    loop {
        // Fault injection: one crash per injection.
        if shared
            .coordination_crash
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            panic!("coordination crash injected");
        }
        shared.feed(|m, now| ((), m.on_tick(now)));
        let wake = lock(&shared.membership).wake_at();
        match wake {
            Some(wake) => {
                tokio::select! {
                    biased;
                    () = shared.clock.sleep_until(wake) => {}
                    () = shared.wake.notified() => {}
                }
            }
            None => shared.wake.notified().await,
        }
    }
}

/// Carry one membership request to the arbiter; its answer as the
/// membership reads it.
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
            Ok(mark) => Reply::Renewed(mark),
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
        Request::Transfer(lease, changes) => match arbiter.transfer(ns, node, lease, changes).await
        {
            Ok(table) => Reply::Table(table),
            Err(e) => {
                tracing::warn!(node = %node, error = %e, "the arbiter refused the handoff");
                failed("transferring partitions", e)
            }
        },
        Request::SetLeaving(lease) => match arbiter.set_leaving(ns, node, lease).await {
            Ok(()) => Reply::Done,
            Err(e) => failed("marking the node as leaving", e),
        },
        Request::Release(lease) => match arbiter.release(ns, node, lease).await {
            Ok(()) => Reply::Done,
            Err(e) => failed("releasing the lease", e),
        },
    }
}
