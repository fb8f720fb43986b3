//! The node's durable alarms (`docs/alarms.md`): the schedule of the
//! partitions this node serves, the loop that fires what is due, and the
//! outcomes that come back.
//!
//! This file owns [`NodeAlarms`]: one `fief_core::alarm::AlarmSchedule`
//! (sans-IO) behind a lock, fed by the storage writer (landed commits' alarm
//! changes and partitions' alarm loads, in the order the store applied them:
//! [`AlarmSink`]), by the loop's reconciliation with the routing view (a
//! partition owned here under token `T` is loaded under `T`, which raises its
//! fence, then served; one no longer owned under `T` is stopped), and by the
//! keys' outcomes ([`AlarmTicket`]). It delivers a due alarm as an
//! [`Envelope::Alarm`] through the key table, activating the key (an evicted
//! one too). It must not decide ownership: routing refuses a delivery the
//! node may not make, the key refuses a firing its own state disagrees with,
//! and the storage fence refuses a stale commit; the schedule only keeps
//! this node from asking when it need not.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use fief_core::alarm::{AlarmChange, AlarmSchedule, FireOutcome, Firing, RetryPolicy, StoredAlarm};
use fief_core::{LeaseStatus, Route};
use tokio::sync::Notify;

use super::NodeShared;
use crate::key::{AlarmTicket, Envelope};
use crate::metrics::AlarmMetrics;
use crate::storage::writer::AlarmSink;
use crate::storage::{BackendError, Fence, KeyScope, Outcome};
use crate::storage_api::wall_ms;
use crate::sync::lock;

/// Most firings in flight on one node at once; more wait for the next turn
/// of the loop (a bound on the mailbox slots and activations an alarm flood
/// can make the node spend at once).
pub(crate) const MAX_FIRINGS_IN_FLIGHT: usize = 4096;

/// How often the loop looks at the routing view when nothing wakes it.
/// The coordination wakes it when the routing view is republished or the
/// lease turns current or stops being so ([`NodeAlarms::partitions_may_have_changed`]);
/// the period only backs that up (a failed load's retry, a lease that ran
/// out between two inputs).
pub(crate) const RECONCILE_PERIOD: Duration = Duration::from_millis(250);

/// After a partition's alarm load failed, how long before it is asked again.
const LOAD_RETRY: Duration = Duration::from_secs(1);

/// The node's alarms (see the module header).
pub(crate) struct NodeAlarms {
    schedule: Mutex<AlarmSchedule>,
    /// Partitions owned and served here, by the loop's last look, with
    /// their tokens.
    owned: Mutex<BTreeMap<u32, u64>>,
    /// Partition alarm loads asked and not answered, by partition, with
    /// their tokens.
    loading: Mutex<BTreeMap<u32, u64>>,
    /// When a failed load may be asked again (wall-clock milliseconds).
    retry_loads_at: std::sync::atomic::AtomicU64,
    in_flight: AtomicUsize,
    wake: Notify,
    /// The loop is to look at the routing view at its next turn.
    reconcile_asked: AtomicBool,
    /// Whether the lease was current at the coordination's last input.
    lease_was_current: AtomicBool,
    /// The loop's period when nothing wakes it ([`RECONCILE_PERIOD`]).
    reconcile_period: Duration,
    pub(crate) metrics: AlarmMetrics,
}

impl NodeAlarms {
    pub(crate) fn new(metrics: AlarmMetrics, reconcile_period: Duration) -> Self {
        NodeAlarms {
            schedule: Mutex::new(AlarmSchedule::new(RetryPolicy::default())),
            owned: Mutex::new(BTreeMap::new()),
            loading: Mutex::new(BTreeMap::new()),
            retry_loads_at: std::sync::atomic::AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            wake: Notify::new(),
            reconcile_asked: AtomicBool::new(false),
            lease_was_current: AtomicBool::new(false),
            reconcile_period,
            metrics,
        }
    }

    /// Told by the coordination after each input: whether it republished
    /// the routing view, and whether the lease is current now. If either
    /// may have changed what this node serves, the loop looks at once, so a
    /// partition just taken has its alarms loaded (and its fence raised, in
    /// one round for all of them) before its keys' first loads would each
    /// raise it in a round of their own, and its due alarms fire without
    /// waiting for the period.
    pub(crate) fn partitions_may_have_changed(&self, view_changed: bool, lease_current: bool) {
        let lease_changed = self
            .lease_was_current
            .swap(lease_current, Ordering::Relaxed)
            != lease_current;
        if view_changed || lease_changed {
            self.reconcile_asked.store(true, Ordering::Release);
            self.wake.notify_one();
        }
    }

    /// Alarms the schedule holds (waiting, retrying or in flight).
    pub(crate) fn pending(&self) -> usize {
        lock(&self.schedule).len()
    }

    /// Firings in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// What became of `firing`.
    fn finished(&self, firing: &Firing, outcome: FireOutcome) {
        self.metrics.outcome(&outcome);
        lock(&self.schedule).finished(firing, outcome, wall_ms());
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.wake.notify_one();
    }
}

impl AlarmSink for NodeAlarms {
    fn committed(&self, fence: Fence, scope: &KeyScope, changes: &[AlarmChange]) {
        lock(&self.schedule).committed(
            fence.partition,
            fence.token,
            &scope.module,
            &scope.key,
            changes,
        );
        self.wake.notify_one();
    }

    fn loaded(&self, fence: Fence, outcome: Result<Outcome<Vec<StoredAlarm>>, BackendError>) {
        {
            let mut loading = lock(&self.loading);
            if loading.get(&fence.partition) == Some(&fence.token) {
                loading.remove(&fence.partition);
            }
        }
        match outcome {
            Ok(Outcome::Done(alarms)) => {
                // Served only if still owned under that token (a late answer
                // for a partition lost meanwhile is dropped).
                let owned = lock(&self.owned).get(&fence.partition) == Some(&fence.token);
                if owned {
                    lock(&self.schedule).serve(fence.partition, fence.token, alarms);
                }
            }
            Ok(Outcome::Stale { current }) => {
                tracing::info!(
                    partition = fence.partition,
                    token = fence.token,
                    current,
                    "a partition's alarms were not loaded: a newer owner has loaded them"
                );
            }
            Err(error) => {
                tracing::warn!(partition = fence.partition, %error, "cannot load a partition's alarms; retrying");
                self.retry_loads_at
                    .store(wall_ms() + LOAD_RETRY.as_millis() as u64, Ordering::Relaxed);
            }
        }
        self.wake.notify_one();
    }
}

impl NodeShared {
    /// The partitions this node serves now, with their tokens: owned in the
    /// routing view, not held (moving or unsure), under a current lease.
    fn served_partitions(&self) -> BTreeMap<u32, u64> {
        if !matches!(self.gate_status(), LeaseStatus::Current { .. }) {
            return BTreeMap::new();
        }
        let view = self.view();
        view.table()
            .iter()
            .filter(|(p, a)| a.is_some_and(|a| a.node == self.node_id) && !view.held().contains(p))
            .filter_map(|(p, a)| a.map(|a| (p.0, a.token.0)))
            .collect()
    }

    /// Bring the schedule in line with what this node serves: stop
    /// partitions lost (or served under another token), ask the loads of
    /// partitions gained.
    fn reconcile_alarms(&self) {
        let alarms = &self.alarms;
        let owned = self.served_partitions();
        *lock(&alarms.owned) = owned.clone();
        let served: BTreeMap<u32, u64> = {
            let mut schedule = lock(&alarms.schedule);
            let served = schedule.served().clone();
            for (partition, token) in &served {
                if owned.get(partition) != Some(token) {
                    schedule.stop(*partition);
                }
            }
            served
        };
        if wall_ms() < alarms.retry_loads_at.load(Ordering::Relaxed) {
            return;
        }
        let mut loading = lock(&alarms.loading);
        loading.retain(|partition, token| owned.get(partition) == Some(token));
        for (partition, token) in owned {
            if served.get(&partition) == Some(&token) || loading.contains_key(&partition) {
                continue;
            }
            let fence = Fence { partition, token };
            if self.services.storage.load_partition_alarms(fence).is_ok() {
                loading.insert(partition, token);
            }
        }
    }

    /// Deliver `firing` to its key on this node (activating it), its
    /// outcome to come back through the ticket.
    fn fire(self: &Arc<Self>, firing: Firing, now_ms: u64) {
        self.alarms
            .metrics
            .fired(now_ms.saturating_sub(firing.at_ms));
        self.alarms.in_flight.fetch_add(1, Ordering::Relaxed);
        let node = Arc::downgrade(self);
        let ticket = AlarmTicket::new(
            firing,
            Box::new(move |firing, outcome| {
                if let Some(node) = node.upgrade() {
                    node.alarms.finished(firing, outcome);
                }
            }),
        );
        let alarm = &ticket.firing.alarm;
        let (key, token, partition) = (alarm.key.clone(), ticket.firing.token, alarm.partition);
        let Ok(slot) = self.module(&alarm.module) else {
            // Undeployed: retried with backoff until it is deployed again
            // (or cancelled by a new version's key).
            return;
        };
        match self.route(&key) {
            Route::Local {
                partition: p,
                token: t,
            } if p.0 == partition && t.0 == token => {
                if let Err(error) = slot.deliver(
                    &self.services,
                    &key,
                    p,
                    t,
                    Envelope::Alarm(Box::new(ticket)),
                ) {
                    tracing::debug!(module = %slot.name, %key, %error, "a due alarm was not delivered; retrying");
                }
            }
            // Not served here under the firing's token any more: the
            // reconciliation stops the partition.
            _ => {}
        }
    }
}

/// The alarm loop of the node `node`: until the node is gone.
pub(crate) async fn run(node: Weak<NodeShared>) {
    let mut last_reconcile: Option<std::time::Instant> = None;
    loop {
        let Some(shared) = node.upgrade() else {
            return;
        };
        // A wake-up while this turn works is kept (`notify_one` leaves a
        // permit) and ends the wait below at once.
        let alarms = shared.alarms.clone();
        let asked = alarms.reconcile_asked.swap(false, Ordering::Acquire);
        if asked || last_reconcile.is_none_or(|at| at.elapsed() >= alarms.reconcile_period) {
            shared.reconcile_alarms();
            last_reconcile = Some(std::time::Instant::now());
        }
        let now_ms = wall_ms();
        let room = MAX_FIRINGS_IN_FLIGHT.saturating_sub(alarms.in_flight());
        let (due, next) = {
            let mut schedule = lock(&alarms.schedule);
            let due = schedule.due(now_ms, room);
            (due, schedule.next_wake())
        };
        alarms.metrics.set_pending(alarms.pending());
        for firing in due {
            shared.fire(firing, now_ms);
        }
        // Not held while waiting: the node may go meanwhile.
        drop(shared);
        let full = alarms.in_flight() >= MAX_FIRINGS_IN_FLIGHT;
        let until_next = match next {
            Some(at) if !full => {
                Duration::from_millis(at.saturating_sub(wall_ms())).min(alarms.reconcile_period)
            }
            _ => alarms.reconcile_period,
        };
        tokio::select! {
            () = alarms.wake.notified() => {}
            () = tokio::time::sleep(until_next) => {}
        }
    }
}
