//! Key processes: one component instance per live key, in its own store,
//! driven by one task that takes messages from a bounded mailbox one at a time.
//!
//! This module owns a key's life: activation on the first message
//! ([`ModuleSlot::deliver`]), the message loop (calls, casts, timer and pub/sub
//! infos, graceful stops, in arrival order), the idle timeout, and death. A key
//! dies when its guest traps, when it overruns its CPU budget, when it grows
//! past its memory limit, or when the host kills it. The kill path (contract
//! §2): set the key's kill flag, bump the engine's epoch so running guest code
//! traps at its next check, and drop the store — a poisoned instance is never
//! entered again. A dead key's timers are cancelled and its subscriptions
//! removed when its store is dropped, so nothing it armed fires afterwards.
//!
//! Single ownership on one node: a key has at most one entry in its module's
//! table, and the entry is removed only by the key's own task after its store
//! has been dropped, so a fresh process for the key can only start once the
//! old one is gone.
//!
//! The parts, one concept each:
//! - this file: the small types every part shares — a key's kill switch
//!   ([`KeyControl`]), the messages it takes ([`Envelope`], [`Via`]), the
//!   life events it reports ([`KeyLife`]). It
//!   must not run guest code or hold a key's process;
//! - `services.rs`: the layer's one way up to its node — the parts of the
//!   node a key shares with it (`KeyServices`) and the node operations it
//!   may ask for (`KeyNode`); nothing in `key/` names the node;
//! - `process.rs`: the process itself — its store (`KeyCtx`), the side-effect
//!   gate, the epoch callback, the guest's callbacks, why it died;
//! - `slot.rs`: a module's table of live keys (`ModuleSlot`): delivery and
//!   activation, the fence sweep, kills, retirement;
//! - `eviction.rs`: which idle key retires when a module's or the node's
//!   budget of live keys is reached (least recently used first);
//! - `linear_memory.rs`: the linear memory of the node's live keys,
//!   counted together (the `max_guest_memory` budget);
//! - `inline.rs`: a routed call run on its caller's task while the key is
//!   idle (or, when it has no process, starting one there), and its
//!   hand-over to the key's task;
//! - `task.rs`: the task that owns one key process and runs its message loop;
//! - `storage.rs`: a process's durable state and its output gate.

mod eviction;
mod inline;
mod linear_memory;
mod process;
mod services;
mod slot;
mod storage;
mod task;

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fief_core::alarm::{FireOutcome, Firing};
use tokio::sync::futures::Notified;
use tokio::sync::{Notify, oneshot};

use crate::bindings::types::{Info, StopReason};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::tick_wakes::{TickWake, TickWakes};
use crate::trace::TraceContext;
use crate::wire::ConnEvent;

use inline::Orphan;
pub(crate) use linear_memory::GuestMemory;
pub(crate) use process::{KeyCtx, KeyEnv, arm_timer, reserve_timer, spawn_timer};
pub use services::KeyLifeObserver;
pub(crate) use services::{KeyNode, KeyServices, NodeFuture};
pub use slot::LiveKey;
pub(crate) use slot::ModuleSlot;

pub(crate) use storage::Output;

/// Why a key process was killed: a fixed sentence (no allocation at a kill,
/// however many keys it kills), and whether it was one of many.
#[derive(Clone, Copy, Debug)]
struct KillReason {
    why: &'static str,
    one_of_many: bool,
}

/// Why a `terminate` key ends at its node's fence, whoever noticed first:
/// the fence's sweep or the key itself ([`KeyControl::kill_for_fence`]).
pub(crate) const FENCED: &str = "the node fenced";

/// The kill switch of one key process.
///
/// The key's task learns of a kill or a fence order through `changed`, which
/// is notified with `notify_waiters`: the task keeps one registered waiter
/// for its whole life and reads the flags (atomics) when it fires, so a
/// message costs no waiter registration and no lock here.
pub(crate) struct KeyControl {
    killed: AtomicBool,
    reason: Mutex<Option<KillReason>>,
    /// Notified when `killed` or `fence_order` is set.
    changed: Notify,
    /// Set at the fence for `continue`/`callback` keys: the process lives on
    /// in limbo and takes no routed message again.
    survivor: AtomicBool,
    /// A pending `handle-fence` order (callback mode): its deadline.
    fence_order: Mutex<Option<Duration>>,
    /// Whether `fence_order` holds an order (read without the lock).
    fence_ordered: AtomicBool,
    /// Set once `handle-fence` returned.
    fence_answered: AtomicBool,
    /// Set by the key's task once its store has been dropped.
    exited: tokio::sync::watch::Sender<bool>,
    /// Set by the key's task from just before it takes a message out of its
    /// mailbox until it has processed it: while set, a caller does not run a
    /// call inline (it would overtake that message).
    receiving: AtomicBool,
    /// An inline call whose caller went away before it finished: the key's
    /// task finishes it (a half-run call must not be dropped, that would
    /// poison the instance).
    orphan: Mutex<Option<Orphan>>,
    has_orphan: AtomicBool,
    /// Why the process died during an inline call (its store is dropped).
    death: Mutex<Option<String>>,
    /// Why the process's start failed (on the key's task, or on a caller's:
    /// `inline.rs`, `run_activation`): the key's task fails its queued
    /// messages with it.
    start_error: Mutex<Option<Error>>,
    /// Set once `death` or `start_error` is: read on every inline call's
    /// end without taking either lock.
    failed: AtomicBool,
    /// Inline calls so far (the idle timeout counts them as messages).
    inline_calls: AtomicU64,
    /// Set by the epoch callback when an inline call used its first slice:
    /// its caller hands it to the key's task (see [`InlineCall`](inline::InlineCall)).
    demote: AtomicBool,
    /// An eviction order ([`Eviction`] as a number; 0: none), set under
    /// the key-table lock by the slot that chose the key as the least
    /// recently used idle one (see `slot.rs`, `evict_one`).
    evict: AtomicU8,
    /// The spawn of the key's task, while deferred: a key activated on its
    /// caller's task needs its own task only once the caller lets go, so
    /// the spawn (a wake of a parked guest thread) waits for the next epoch
    /// tick or for the first thing that needs the task, whichever comes
    /// first ([`KeyControl::start_task`]).
    deferred_task: Mutex<Option<DeferredTask>>,
    /// Whether `deferred_task` holds a spawn (read without the lock).
    task_deferred: AtomicBool,
}

/// A key task's spawn, made at most once.
pub(crate) type DeferredTask = Box<dyn FnOnce() + Send>;

/// Why a live key was evicted: the `cause` of `fief_keys_evicted_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Eviction {
    /// Its `idle_timeout` passed with no message.
    Idle = 1,
    /// Its module's `max_live_keys` was reached by another key's activation.
    ModuleBudget = 2,
    /// The node's instance pool (`max_live_keys` of the node) was full.
    NodeBudget = 3,
    /// The node's live keys held `max_guest_memory` of linear memory.
    MemoryBudget = 4,
}

impl Eviction {
    /// The metric label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Eviction::Idle => "idle",
            Eviction::ModuleBudget => "module_budget",
            Eviction::NodeBudget => "node_budget",
            Eviction::MemoryBudget => "memory_budget",
        }
    }

    fn from_u8(n: u8) -> Option<Eviction> {
        match n {
            1 => Some(Eviction::Idle),
            2 => Some(Eviction::ModuleBudget),
            3 => Some(Eviction::NodeBudget),
            4 => Some(Eviction::MemoryBudget),
            _ => None,
        }
    }
}

impl Default for KeyControl {
    fn default() -> Self {
        KeyControl {
            killed: AtomicBool::new(false),
            reason: Mutex::new(None),
            changed: Notify::new(),
            survivor: AtomicBool::new(false),
            fence_order: Mutex::new(None),
            fence_ordered: AtomicBool::new(false),
            fence_answered: AtomicBool::new(false),
            exited: tokio::sync::watch::channel(false).0,
            receiving: AtomicBool::new(false),
            orphan: Mutex::new(None),
            has_orphan: AtomicBool::new(false),
            death: Mutex::new(None),
            start_error: Mutex::new(None),
            failed: AtomicBool::new(false),
            inline_calls: AtomicU64::new(0),
            demote: AtomicBool::new(false),
            evict: AtomicU8::new(0),
            deferred_task: Mutex::new(None),
            task_deferred: AtomicBool::new(false),
        }
    }
}

/// A deferred eviction order's wake (`KeyControl::order_eviction`), or a
/// deferred task's spawn (`KeyControl::defer_task`).
impl TickWake for KeyControl {
    fn wake(&self) {
        self.notify();
    }
}

impl KeyControl {
    /// Hold the spawn of the key's task until the next epoch tick
    /// (`wakes`) or until something needs the task first
    /// ([`start_task`](Self::start_task)). Called under the key-table lock
    /// that put the key in its table, so no one can need the task before
    /// this returns.
    pub(crate) fn defer_task(self: &Arc<Self>, spawn: DeferredTask, wakes: &TickWakes) {
        *lock(&self.deferred_task) = Some(spawn);
        self.task_deferred.store(true, Ordering::SeqCst);
        wakes.defer(self.clone());
    }

    /// Spawn the key's task now if its spawn was deferred: a message was
    /// queued for it, or an order (kill, fence, eviction, a demoted or
    /// failed inline call) must reach it. One atomic load otherwise.
    pub(crate) fn start_task(&self) {
        if self.task_deferred.load(Ordering::SeqCst)
            && self.task_deferred.swap(false, Ordering::SeqCst)
        {
            let spawn = lock(&self.deferred_task).take();
            if let Some(spawn) = spawn {
                spawn();
            }
        }
    }

    /// Wake the key's task for a changed flag, spawning it first if its
    /// spawn was deferred.
    fn notify(&self) {
        self.start_task();
        self.changed.notify_waiters();
    }

    /// Make the key a survivor; for a callback key, also order it to run
    /// `handle-fence` with `deadline`.
    pub(crate) fn fence(&self, callback_deadline: Option<Duration>) {
        self.survivor.store(true, Ordering::SeqCst);
        if let Some(deadline) = callback_deadline {
            *lock(&self.fence_order) = Some(deadline);
            self.fence_ordered.store(true, Ordering::SeqCst);
            self.notify();
        }
    }

    /// Order the key's task to retire the key at its next idle moment. The
    /// order holds at once (a message that wakes the task finds it); the
    /// task is woken for it at the next epoch tick, not by the caller
    /// (`tick_wakes.rs`).
    fn order_eviction(self: &Arc<Self>, cause: Eviction, wakes: &TickWakes) {
        self.evict.store(cause as u8, Ordering::SeqCst);
        wakes.defer(self.clone());
    }

    /// The pending eviction order, if any.
    fn eviction(&self) -> Option<Eviction> {
        Eviction::from_u8(self.evict.load(Ordering::SeqCst))
    }

    /// Drop a pending eviction order (the key cannot retire: see
    /// `ModuleSlot::eviction_abandoned`).
    fn cancel_eviction(&self) {
        self.evict.store(0, Ordering::SeqCst);
    }

    pub(crate) fn is_survivor(&self) -> bool {
        self.survivor.load(Ordering::SeqCst)
    }

    /// Take the deadline of a pending `handle-fence` order, if any.
    fn take_fence_order(&self) -> Option<Duration> {
        if !self.fence_ordered.load(Ordering::SeqCst) {
            return None;
        }
        let order = lock(&self.fence_order).take();
        self.fence_ordered.store(false, Ordering::SeqCst);
        order
    }

    /// Resolves once the key's store has been dropped.
    pub(crate) async fn exited(&self) {
        let mut rx = self.exited.subscribe();
        let _ = rx.wait_for(|exited| *exited).await;
    }
    /// Set the kill flag: this key alone is killed (an operator's kill, a
    /// deadline of its own), and its end is logged as its own line. The
    /// caller bumps the engine epoch afterwards so a running guest notices at
    /// once. Returns false if it was already killed.
    pub(crate) fn kill(&self, reason: &'static str) -> bool {
        self.kill_for(KillReason {
            why: reason,
            one_of_many: false,
        })
    }

    /// [`kill`](Self::kill), as one of many keys killed at once (a fence, a
    /// move, an undeploy, a shutdown): whoever kills them logs one line with
    /// the count, and each key's end is logged at `debug` only (the fence of
    /// 100 000 keys wrote 100 000 lines at `info`).
    pub(crate) fn kill_one_of_many(&self, reason: &'static str) -> bool {
        self.kill_for(KillReason {
            why: reason,
            one_of_many: true,
        })
    }

    /// Kill a `terminate` key for its node's fence ([`FENCED`]), as one of
    /// many. Returns whether the fence ended it: killed now, or killed
    /// already by the key itself on finding the node fenced (a running
    /// guest's epoch check, its task's next message, an activation), which
    /// can come before the fence's sweep reaches it; not a key killed
    /// earlier for another reason.
    pub(crate) fn kill_for_fence(&self) -> bool {
        self.kill_one_of_many(FENCED) || self.reason() == Some(FENCED)
    }

    fn kill_for(&self, reason: KillReason) -> bool {
        let mut slot = lock(&self.reason);
        if self.killed.swap(true, Ordering::SeqCst) {
            return false;
        }
        *slot = Some(reason);
        drop(slot);
        self.notify();
        true
    }

    pub(crate) fn is_killed(&self) -> bool {
        self.killed.load(Ordering::SeqCst)
    }

    /// Why the key was killed, if it was.
    fn reason(&self) -> Option<&'static str> {
        lock(&self.reason).map(|r| r.why)
    }

    /// Whether the key was killed as one of many (see
    /// [`kill_one_of_many`](Self::kill_one_of_many)).
    fn killed_with_many(&self) -> bool {
        lock(&self.reason).is_some_and(|r| r.one_of_many)
    }

    /// Resolves once the key is killed.
    async fn killed(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.is_killed() {
                return;
            }
            changed.await;
        }
    }

    /// Resolves once the key is killed, re-arming `changed` (the task's
    /// registered waiter) each time it fires.
    async fn killed_with<'a>(&'a self, changed: &mut Pin<&mut Notified<'a>>) {
        while !self.is_killed() {
            changed.as_mut().await;
            rearm(self, changed);
        }
    }

    /// Hand a half-run inline call to the key's task.
    fn adopt(&self, orphan: Orphan) {
        *lock(&self.orphan) = Some(orphan);
        self.has_orphan.store(true, Ordering::SeqCst);
        self.notify();
    }

    fn take_orphan(&self) -> Option<Orphan> {
        if !self.has_orphan.load(Ordering::SeqCst) {
            return None;
        }
        self.has_orphan.store(false, Ordering::SeqCst);
        lock(&self.orphan).take()
    }

    /// The process died during an inline call (its store is dropped).
    fn died(&self, why: String) {
        lock(&self.death).get_or_insert(why);
        self.failed.store(true, Ordering::SeqCst);
        self.notify();
    }

    fn death(&self) -> Option<String> {
        lock(&self.death).clone()
    }

    /// The process's start failed with `error`.
    fn start_failed(&self, error: Error) {
        lock(&self.start_error).get_or_insert(error);
        self.failed.store(true, Ordering::SeqCst);
        self.notify();
    }

    fn start_error(&self) -> Option<Error> {
        lock(&self.start_error).clone()
    }

    /// Whether the process died during an inline call or its start failed
    /// ([`death`](Self::death) or [`start_error`](Self::start_error) is set).
    fn has_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// Count an inline call (for the idle timeout).
    fn touch(&self) {
        self.inline_calls.fetch_add(1, Ordering::Relaxed);
    }

    fn inline_calls(&self) -> u64 {
        self.inline_calls.load(Ordering::Relaxed)
    }
}

/// Register a fresh waiter for `control`'s changes in `changed` (after the
/// previous one fired). Check the flags after this, not before.
fn rearm<'a>(control: &'a KeyControl, changed: &mut Pin<&mut Notified<'a>>) {
    changed.set(control.changed.notified());
    changed.as_mut().enable();
}

/// A message for a key process.
pub(crate) enum Envelope {
    /// A request; the reply goes back on `reply`. `trace`: the trace of
    /// the request it serves (`crate::trace`), which the key's log lines
    /// and its own calls carry while it handles the message.
    Call {
        message: Vec<u8>,
        reply: oneshot::Sender<Result<Vec<u8>>>,
        via: Via,
        trace: Option<TraceContext>,
    },
    /// A one-way message, with its trace as a call's.
    Cast {
        message: Vec<u8>,
        trace: Option<TraceContext>,
    },
    /// A timer fired or a publication arrived.
    Info(Info),
    /// Stop gracefully: `handoff` first if asked, then `terminate(reason)`.
    Stop {
        reason: StopReason,
        reply: oneshot::Sender<Result<Option<Vec<u8>>>>,
    },
    /// A durable alarm of the key is due (from the node's alarm loop);
    /// boxed, so that a queued message stays small.
    Alarm(Box<AlarmTicket>),
    /// Something happened to one of the key's WebSocket connections.
    Connection(Box<ConnDelivery>),
}

/// A connection event on its way to its key, with where to say it was
/// handled. Dropped before its handler began (the key died or moved first,
/// its mailbox closed, the node refused it), it says so by dropping its
/// sender: the socket's node then passes the event again, to whichever
/// process or owner has the key next, so an event is handled once however
/// the key moves. Dropped once its handler began (a kill, a fence, in the
/// middle of it) it counts as handled, as a trap does: the handler may
/// have committed its writes already (a commit in the writer's queue lands
/// even if its process is killed), so passing it again could handle it
/// twice.
pub(crate) struct ConnDelivery {
    /// The event.
    pub(crate) event: ConnEvent,
    /// Whether its handler began.
    began: bool,
    handled: Option<oneshot::Sender<()>>,
    /// Run by the key's task as soon as the handler ran, before its next
    /// message (a stop for a move, say): records the frame as handled.
    on_handled: Option<Box<dyn FnOnce() + Send>>,
}

impl ConnDelivery {
    /// A delivery of `event`, and what resolves once a process handled it
    /// (an error: dropped unhandled).
    pub(crate) fn new(
        event: ConnEvent,
        on_handled: Box<dyn FnOnce() + Send>,
    ) -> (Self, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        let delivery = ConnDelivery {
            event,
            began: false,
            handled: Some(tx),
            on_handled: Some(on_handled),
        };
        (delivery, rx)
    }

    /// Its handler begins: from here on it is not passed again.
    pub(crate) fn begin(&mut self) {
        self.began = true;
    }

    /// The key's handler ran on it (to its end, or to a trap: an event
    /// that kills its key is not passed again).
    pub(crate) fn handled(mut self) {
        self.record();
    }

    fn record(&mut self) {
        if let Some(record) = self.on_handled.take() {
            record();
        }
        if let Some(tx) = self.handled.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for ConnDelivery {
    fn drop(&mut self) {
        if self.began {
            self.record();
        }
    }
}

/// A due alarm on its way to its key, with where its outcome goes.
/// Dropped without an outcome (the key died first, its mailbox closed, the
/// node refused the delivery) it reports `NotRun`, so no alarm is left in
/// flight: the node's schedule retries it.
pub(crate) struct AlarmTicket {
    /// The firing, as the schedule gave it.
    pub(crate) firing: Firing,
    report: Option<AlarmReport>,
}

/// Where an [`AlarmTicket`]'s outcome goes.
pub(crate) type AlarmReport = Box<dyn FnOnce(&Firing, FireOutcome) + Send>;

impl AlarmTicket {
    /// A ticket for `firing` whose outcome goes to `report`.
    pub(crate) fn new(firing: Firing, report: AlarmReport) -> Self {
        AlarmTicket {
            firing,
            report: Some(report),
        }
    }

    /// Report what became of the firing.
    pub(crate) fn finish(mut self, outcome: FireOutcome) {
        if let Some(report) = self.report.take() {
            report(&self.firing, outcome);
        }
    }
}

impl Drop for AlarmTicket {
    fn drop(&mut self) {
        if let Some(report) = self.report.take() {
            report(&self.firing, FireOutcome::NotRun);
        }
    }
}

impl Envelope {
    /// Whether the message came through routing (not a timer, a
    /// publication, a stop or a local handle).
    fn is_routed(&self) -> bool {
        matches!(
            self,
            Envelope::Call {
                via: Via::Routed,
                ..
            } | Envelope::Cast { .. }
                | Envelope::Alarm(_)
                | Envelope::Connection(_)
        )
    }

    /// The bytes of payload it makes the host hold while it waits in a
    /// mailbox (charged to the key's host-memory ledger).
    pub(crate) fn payload_bytes(&self) -> usize {
        crate::host_bytes::MESSAGE_OVERHEAD
            + match self {
                Envelope::Call { message, .. } | Envelope::Cast { message, .. } => message.len(),
                Envelope::Info(Info::Timer(fired)) => fired.tag.len(),
                Envelope::Info(Info::Published(p)) => p.topic.len() + p.payload.len(),
                Envelope::Stop { .. } => 0,
                Envelope::Alarm(ticket) => ticket.firing.alarm.name.len(),
                Envelope::Connection(delivery) => delivery.event.payload_bytes(),
            }
    }

    /// Answer the envelope's sender (if it has one) with `error`.
    fn fail(self, error: Error) {
        match self {
            Envelope::Call { reply, .. } => {
                let _ = reply.send(Err(error));
            }
            Envelope::Stop { reply, .. } => {
                let _ = reply.send(Err(error));
            }
            // A dropped ticket reports that its handler did not run.
            Envelope::Cast { .. }
            | Envelope::Info(_)
            | Envelope::Alarm(_)
            | Envelope::Connection(_) => {}
        }
    }
}

/// How a call reached a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Via {
    /// Routed to the key's owner: refused once the key is a survivor.
    Routed,
    /// Through a local handle on this node: reaches survivors too.
    LocalHandle,
}

/// A point in a key process's life, reported to the instance's observer.
///
/// `Started` is reported before the store is created and `Ended` after it
/// was dropped, so the interval between them covers every instant at which
/// the process could run guest code or act. Failure tests collect these from
/// every node and check that no two intervals of one key overlap.
#[derive(Clone, Debug)]
pub struct KeyLife {
    /// The node hosting the process.
    pub node: String,
    /// The module.
    pub module: String,
    /// The key.
    pub key: String,
    /// Which end of the life this is.
    pub event: KeyLifeEvent,
    /// When, on this process's monotonic clock.
    pub at: std::time::Instant,
}

/// Which end of a key process's life a [`KeyLife`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyLifeEvent {
    /// The process is about to be created.
    Started,
    /// The process's store has been dropped.
    Ended,
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::{DeferredTask, Error, FENCED, KeyControl, Orphan};
    use crate::tick_wakes::TickWakes;

    /// A key control whose task's spawn is deferred, and how many times
    /// the spawn ran.
    fn deferred() -> (Arc<KeyControl>, TickWakes, Arc<AtomicUsize>) {
        let (control, wakes) = (Arc::new(KeyControl::default()), TickWakes::default());
        let spawned = Arc::new(AtomicUsize::new(0));
        let counter = spawned.clone();
        let spawn: DeferredTask = Box::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        });
        control.defer_task(spawn, &wakes);
        (control, wakes, spawned)
    }

    /// A deferred task is spawned once: at the tick, or before it by the
    /// first order that must reach it; never by nothing.
    #[test]
    fn a_deferred_task_is_spawned_once_by_the_tick_or_the_first_order() {
        let (control, wakes, spawned) = deferred();
        assert_eq!(spawned.load(Ordering::SeqCst), 0, "not at the activation");
        assert_eq!(wakes.flush(), 1);
        assert_eq!(spawned.load(Ordering::SeqCst), 1, "the tick spawns it");
        control.start_task();
        assert!(control.kill("again"));
        assert_eq!(spawned.load(Ordering::SeqCst), 1, "once");

        type Order = fn(&KeyControl);
        let orders: [(&str, Order); 6] = [
            ("a message", |c| c.start_task()),
            ("a kill", |c| assert!(c.kill("killed"))),
            ("a fence order", |c| c.fence(Some(Duration::from_secs(1)))),
            ("a death", |c| c.died("trapped".into())),
            ("a failed start", |c| {
                c.start_failed(Error::Internal("no".into()))
            }),
            ("a demoted call", |c| c.adopt(Orphan::for_test())),
        ];
        for (what, order) in orders {
            let (control, wakes, spawned) = deferred();
            order(&control);
            assert_eq!(spawned.load(Ordering::SeqCst), 1, "{what} spawns it");
            assert_eq!(wakes.flush(), 1);
            assert_eq!(
                spawned.load(Ordering::SeqCst),
                1,
                "{what}: the tick does not again"
            );
        }
    }

    /// The fence's count (`node fenced … killed=N`) holds every `terminate`
    /// key the fence ended, including one that found the node fenced and
    /// killed itself before the sweep reached it; not one killed before for
    /// another reason.
    #[test]
    fn the_fence_counts_the_keys_it_ended_whoever_noticed_first() {
        let swept = KeyControl::default();
        assert!(swept.kill_for_fence(), "a live key is killed by the sweep");
        assert!(swept.is_killed() && swept.killed_with_many());

        let noticed = KeyControl::default();
        assert!(noticed.kill_one_of_many(FENCED), "its own epoch check");
        assert!(noticed.kill_for_fence(), "the sweep still counts it");

        let operator = KeyControl::default();
        assert!(operator.kill("killed by an operator"));
        assert!(!operator.kill_for_fence(), "the fence did not end it");
        assert_eq!(operator.reason(), Some("killed by an operator"));
    }
}
