//! The API's workers shared fairly between tenants' requests: how many of a
//! tenant's key requests (`call`, `cast`) the node serves at once.
//!
//! [`crate::inline_share`] moves a tenant's guest code off the callers'
//! workers when it takes more than its share of them; what its clients cost
//! outside their keys' calls, it cannot move. Four clients flooding a key
//! with calls that each end at once (a publish refused by its rate limit)
//! spend the node's two workers on reading, routing and answering their
//! requests, and another tenant's request waits behind theirs in the
//! runtime's run queue: a victim's p50 over HTTP 2× its quiet figure, p99 2–5×
//! (issue 17, `docs/benchmarks.md`, "Issue 17, sixth pass").
//!
//! So every key request takes a *turn* of its module's tenant before its
//! body is read, and holds it until its answer is built; the time its
//! handler spends on the workers (every poll, timed) is charged to the
//! tenant. Once a window ([`crate::inline_share::WINDOW`]) the node marks
//! *over its share* a tenant whose smoothed share of the requests' time is
//! above an equal share, when two or more tenants sent requests and the
//! workers were busy more than three quarters of the time ([`mark`]); a
//! marked tenant stays marked while its share is above half of that. A
//! marked tenant is served at most `workers / tenants` requests at once (at
//! least one), and its requests' handlers may use an *allowance* of each
//! window, set as TCP sets its congestion window: a quarter less than it
//! used while the workers are still contended, a quarter more while they
//! are not, never under a twentieth of the workers' time. Its other
//! requests wait for a turn, first come first served, and cost the node
//! nothing while they wait (a connection waiting for its answer sends no
//! next request). So a flooding tenant gets what the workers have to spare
//! below contention, and another tenant's request finds a worker free.
//! Turns alone (no allowance) took the victim's p50 under a flood from 32
//! connections from 10–14× to 5×, not under 2× (one turn served back to
//! back still kept a worker busy); the allowance took it to 1.0×.
//! An unmarked tenant's requests never wait, and a tenant alone is never
//! marked: one tenant cannot starve itself. Every request is still served;
//! only when changes. A request that waited is counted in
//! `fief_tenant_requests_waited_total{tenant}`.
//!
//! What a request costs before its turn (its head read and parsed, its
//! token checked, its route found) is not held back: a connection waiting
//! for a turn sends no further request, so that part is bounded by the
//! tenant's connections. Requests to a module that is not deployed take no
//! turn (they are refused at once, and a name that is no tenant's must not
//! make the node keep anything for it).
//!
//! This module must not decide where a request's guest code runs (that is
//! [`crate::inline_share`]'s) nor refuse a request: it only orders them.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use prometheus_client::metrics::counter::Counter;
use tokio::sync::Notify;

use crate::inline_share::{WHOLE, WINDOW, is_active, is_contended, millionths, smooth};

/// One tenant's requests: how many are being served, the limit while it is
/// over its share, and what they used since the last decision.
pub(crate) struct TenantRequests {
    /// Requests holding a turn.
    in_flight: AtomicU64,
    /// Requests waiting for a turn.
    waiting: AtomicU64,
    /// Most requests served at once; 0: not over its share, no limit.
    limit: AtomicU64,
    /// While over its share: nanoseconds of the workers its requests'
    /// handlers may use in a window ([`mark`]).
    allowance: AtomicU64,
    /// Nanoseconds its requests' handlers spent on the workers since the
    /// last decision.
    spent_nanos: AtomicU64,
    /// Its share of all the requests' time, in millionths, smoothed over
    /// windows.
    load: AtomicU64,
    /// Notified when a turn is given back (or the limit lifted).
    freed: Notify,
    /// `fief_tenant_requests_waited_total{tenant}`.
    waited: Counter,
}

impl TenantRequests {
    /// A tenant's requests, counting those that wait in `waited`.
    pub(crate) fn new(waited: Counter) -> Self {
        TenantRequests {
            in_flight: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            limit: AtomicU64::new(0),
            allowance: AtomicU64::new(u64::MAX),
            spent_nanos: AtomicU64::new(0),
            load: AtomicU64::new(0),
            freed: Notify::new(),
            waited,
        }
    }

    /// Whether a request may take a turn now: the tenant is not over its
    /// share, or one of its turns is free and it has not used its allowance
    /// of the window.
    fn may_enter(&self, in_flight: u64) -> bool {
        let limit = self.limit.load(Ordering::Relaxed);
        limit == 0
            || (in_flight < limit
                && self.spent_nanos.load(Ordering::Relaxed)
                    < self.allowance.load(Ordering::Relaxed))
    }

    /// Take one of the tenant's turns, waiting while it is over its share
    /// and all of its turns are taken or its allowance of the window is
    /// used; `decide` decides the next window if it is due (a request that
    /// waits out a window asks, so a tenant whose requests all wait is not
    /// left waiting for someone else's). Cancel-safe: a request dropped
    /// while it waits takes no turn.
    async fn enter(&self, decide: &(dyn Fn() + Send + Sync)) {
        let mut waited = false;
        loop {
            let in_flight = self.in_flight.load(Ordering::Relaxed);
            if self.may_enter(in_flight) {
                if self
                    .in_flight
                    .compare_exchange(
                        in_flight,
                        in_flight + 1,
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    )
                    .is_ok()
                {
                    if waited {
                        self.waited.inc();
                    }
                    return;
                }
                continue;
            }
            // Register before looking again, so a turn given back between
            // the look and the wait is not missed.
            let freed = self.freed.notified();
            let mut freed = std::pin::pin!(freed);
            freed.as_mut().enable();
            let _waiting = Waiting::new(&self.waiting);
            if self.may_enter(self.in_flight.load(Ordering::Relaxed)) {
                continue;
            }
            // Keep its place in the queue across windows.
            loop {
                tokio::select! {
                    () = freed.as_mut() => break,
                    () = tokio::time::sleep(WINDOW) => {
                        decide();
                        if self.may_enter(self.in_flight.load(Ordering::Relaxed)) {
                            break;
                        }
                    }
                }
            }
            waited = true;
        }
    }

    /// Give a turn back, and wake the first request waiting for one.
    fn leave(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        if self.waiting.load(Ordering::Acquire) > 0 {
            self.freed.notify_one();
        }
    }

    /// Charge the tenant `nanos` of its requests' time on the workers.
    fn charge(&self, nanos: u64) {
        self.spent_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// What its requests used since the last decision, and its load and
    /// mark before it (for [`mark`]).
    pub(crate) fn take_load(&self) -> RequestLoad {
        RequestLoad {
            spent: self.spent_nanos.swap(0, Ordering::Relaxed),
            smoothed: self.load.load(Ordering::Relaxed),
            limit: self.limit.load(Ordering::Relaxed),
            allowance: self.allowance.load(Ordering::Relaxed),
        }
    }

    /// Keep a decision: its load, its limit (0: none) and its allowance
    /// for the new window. A new window, or a lifted limit, lets the waiting
    /// requests look again.
    pub(crate) fn apply(&self, load: RequestLoad) {
        self.load.store(load.smoothed, Ordering::Relaxed);
        self.allowance.store(load.allowance, Ordering::Relaxed);
        let before = self.limit.swap(load.limit, Ordering::AcqRel);
        if load.limit > 0 || before > 0 {
            self.freed.notify_waiters();
        }
    }
}

/// A request counted as waiting while this lives.
struct Waiting<'a>(&'a AtomicU64);

impl<'a> Waiting<'a> {
    fn new(count: &'a AtomicU64) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Waiting(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Where a tenant's [`TenantRequests`] live: its CPU meter
/// ([`crate::cpu_budget::TenantCpu`]), shared by the turn.
pub(crate) trait HasRequests: Send + Sync + 'static {
    /// The tenant's requests.
    fn requests(&self) -> &TenantRequests;
}

/// A request's turn: held from before its body is read until its answer is
/// built; given back when dropped. A request to no deployed module holds
/// none.
pub(crate) struct RequestTurn {
    tenant: Option<Arc<dyn HasRequests>>,
}

impl RequestTurn {
    /// No turn (the request's module is not deployed here).
    pub(crate) fn none() -> Self {
        RequestTurn { tenant: None }
    }

    /// Take a turn of `tenant`, waiting for one if it is over its share;
    /// `decide` decides the next window if it is due.
    pub(crate) async fn take(
        tenant: Arc<dyn HasRequests>,
        decide: &(dyn Fn() + Send + Sync),
    ) -> Self {
        tenant.requests().enter(decide).await;
        RequestTurn {
            tenant: Some(tenant),
        }
    }

    /// Serve `work` in this turn: every poll of it is timed and charged to
    /// the tenant; the turn is given back when it is done (or dropped).
    pub(crate) async fn serve<F: Future>(self, work: F) -> F::Output {
        let mut work = std::pin::pin!(work);
        let Some(tenant) = &self.tenant else {
            return work.await;
        };
        std::future::poll_fn(|cx| {
            let start = Instant::now();
            let poll = work.as_mut().poll(cx);
            let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
            tenant.requests().charge(nanos);
            poll
        })
        .await
    }
}

impl Drop for RequestTurn {
    fn drop(&mut self) {
        if let Some(tenant) = &self.tenant {
            tenant.requests().leave();
        }
    }
}

/// One tenant's requests, as one decision sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RequestLoad {
    /// Nanoseconds its requests' handlers ran in the window.
    pub(crate) spent: u64,
    /// Its share of all the requests' time, in millionths, smoothed over
    /// windows: before the window, then after it.
    pub(crate) smoothed: u64,
    /// Its limit (requests served at once; 0: not over), before the window,
    /// then after it.
    pub(crate) limit: u64,
    /// Its allowance (nanoseconds of handlers per window while over; no
    /// bound otherwise), before the window, then after it.
    pub(crate) allowance: u64,
}

impl RequestLoad {
    /// A tenant not over its share that used `spent` in the window.
    #[cfg(test)]
    fn unmarked(spent: u64) -> Self {
        RequestLoad {
            spent,
            smoothed: 0,
            limit: 0,
            allowance: u64::MAX,
        }
    }
}

/// The least allowance of a window: a twentieth of the workers' time, so a
/// tenant over its share is slowed, never stopped.
const LEAST_ALLOWANCE: u64 = WHOLE / 20;

/// Decide every tenant's load, limit and allowance from what each tenant's
/// requests used in the window (`capacity`: nanoseconds of all the
/// `workers` over it), given how busy the workers were (`busy`, smoothed,
/// in millionths of all of them).
///
/// A tenant above an equal share of the requests' time while the workers
/// are contended (busy more than three quarters of the time), beside
/// another tenant, is marked (the share among the tenants not marked
/// already: a marked tenant's requests, held back, leave the others a larger
/// share of a smaller whole); it stays marked while above half of an equal
/// share of all. A
/// marked tenant is served `workers / tenants` requests at once (at least
/// one), and its handlers may use an allowance of the window set as TCP
/// sets its window: a quarter less than it used while the workers are
/// still contended, a quarter more while they are not, never under
/// [`LEAST_ALLOWANCE`]. So its requests take what the workers have to spare
/// below contention, and the others' are not queued behind them.
pub(crate) fn mark(busy: u64, workers: u64, capacity: u64, loads: &mut [RequestLoad]) {
    let total: u64 = loads.iter().map(|l| l.spent).sum();
    for load in loads.iter_mut() {
        load.smoothed = smooth(load.smoothed, millionths(load.spent, total));
    }
    let active = loads
        .iter()
        .filter(|l| is_active(l.spent, l.smoothed))
        .count() as u64;
    let fair = WHOLE / active.max(1);
    // Among the tenants not held back: a tenant held back leaves the others
    // a larger share of a smaller whole, which is not theirs to be held for.
    let free: Vec<u64> = loads
        .iter()
        .filter(|l| l.limit == 0 && is_active(l.spent, l.smoothed))
        .map(|l| l.smoothed)
        .collect();
    let all: u64 = loads.iter().map(|l| l.smoothed).sum();
    let free_fair = u64::try_from(
        u128::from(WHOLE) * u128::from(free.iter().sum::<u64>())
            / u128::from(all.max(1))
            / (free.len() as u128).max(1),
    )
    .unwrap_or(WHOLE);
    let contended = is_contended(busy);
    let turns = (workers / active.max(1)).max(1);
    let least =
        u64::try_from(u128::from(capacity) * u128::from(LEAST_ALLOWANCE) / u128::from(WHOLE))
            .unwrap_or(u64::MAX)
            .max(1);
    for load in loads.iter_mut() {
        let over = if load.limit == 0 {
            free.len() >= 2 && contended && load.smoothed > free_fair
        } else {
            active >= 2 && load.smoothed > fair / 2
        };
        (load.limit, load.allowance) = if !over {
            (0, u64::MAX)
        } else if contended {
            (turns, (load.spent / 4 * 3).max(least))
        } else {
            (turns, (load.allowance.min(capacity) / 4 * 5).max(least))
        };
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use prometheus_client::metrics::counter::Counter;

    use super::{HasRequests, RequestLoad, RequestTurn, TenantRequests, WHOLE, mark};

    /// `windows` windows with the workers `busy` and each tenant's requests
    /// using what `spent` gives it; the limits after each.
    fn run(busy: u64, workers: u64, spent: &[u64], windows: usize) -> Vec<Vec<u64>> {
        let mut loads: Vec<RequestLoad> = spent.iter().map(|&s| RequestLoad::unmarked(s)).collect();
        (0..windows)
            .map(|_| {
                mark(busy, workers, capacity(workers), &mut loads);
                loads.iter().map(|l| l.limit).collect()
            })
            .collect()
    }

    const BUSY: u64 = WHOLE / 10 * 9;

    /// `workers` for a window of 10 ms, in nanoseconds.
    fn capacity(workers: u64) -> u64 {
        workers * 10_000_000
    }

    #[test]
    fn a_tenant_alone_is_never_held_back() {
        assert!(run(BUSY, 2, &[10_000_000], 20).iter().all(|l| l == &[0]));
    }

    #[test]
    fn a_tenant_above_an_equal_share_of_busy_workers_gets_its_share_of_turns() {
        let limits = run(BUSY, 2, &[9_000_000, 1_000_000], 20);
        assert_eq!(limits[0], [0, 0], "one window is not enough to mark");
        assert_eq!(limits[19], [1, 0]);
        // Eight workers, two tenants: four turns; three tenants: two.
        assert_eq!(run(BUSY, 8, &[9_000_000, 1_000_000], 20)[19], [4, 0]);
        assert_eq!(
            run(BUSY, 8, &[8_000_000, 1_000_000, 1_000_000], 20)[19],
            [2, 0, 0]
        );
        // Under an equal share: never.
        assert!(
            run(BUSY, 2, &[4_500_000, 5_500_000], 20)
                .iter()
                .all(|l| l[0] == 0)
        );
    }

    #[test]
    fn no_tenant_is_held_back_while_the_workers_have_time_to_spare() {
        assert!(
            run(WHOLE / 10 * 6, 2, &[9_000_000, 1_000_000], 20)
                .iter()
                .all(|l| l == &[0, 0])
        );
    }

    #[test]
    fn a_tenant_held_back_stays_so_until_it_uses_under_half_its_share() {
        let held = |smoothed: u64, spent: u64| RequestLoad {
            smoothed,
            limit: 1,
            allowance: 1_000_000,
            ..RequestLoad::unmarked(spent)
        };
        let idle = WHOLE / 10;
        // Held back, at 40 % of the requests' time with the workers idle:
        // still held; at 20 %, not.
        let mut loads = [held(WHOLE / 10 * 4, 4), held(WHOLE / 10 * 6, 6)];
        loads[1].limit = 0;
        mark(idle, 2, capacity(2), &mut loads);
        assert_eq!([loads[0].limit, loads[1].limit], [1, 0]);
        let mut loads = [held(WHOLE / 10 * 2, 2), held(WHOLE / 10 * 8, 8)];
        loads[1].limit = 0;
        mark(idle, 2, capacity(2), &mut loads);
        assert_eq!(loads[0].limit, 0);
        // Alone again: not held.
        let mut loads = [held(WHOLE, 10)];
        mark(BUSY, 2, capacity(2), &mut loads);
        assert_eq!(loads[0].limit, 0);
    }

    #[test]
    fn a_tenant_held_back_does_not_get_the_others_held_for_the_share_it_left() {
        // `mallory` held back, down to 30 % of the requests' time; the
        // victim, alone among the tenants not held, has the other 70 %: it
        // is not held, however busy the workers.
        let mut loads = [
            RequestLoad {
                smoothed: WHOLE / 10 * 3,
                limit: 1,
                allowance: 1_000_000,
                ..RequestLoad::unmarked(300_000)
            },
            RequestLoad {
                smoothed: WHOLE / 10 * 7,
                ..RequestLoad::unmarked(700_000)
            },
        ];
        for _ in 0..20 {
            mark(BUSY, 2, capacity(2), &mut loads);
            assert_eq!([loads[0].limit, loads[1].limit], [1, 0], "{loads:?}");
        }
        // Two tenants not held, one above an equal share of theirs: held.
        let mut loads = [
            loads[0],
            RequestLoad {
                smoothed: WHOLE / 10 * 5,
                ..RequestLoad::unmarked(500_000)
            },
            RequestLoad {
                smoothed: WHOLE / 10 * 2,
                ..RequestLoad::unmarked(200_000)
            },
        ];
        mark(BUSY, 2, capacity(2), &mut loads);
        assert_eq!(
            [loads[0].limit, loads[1].limit, loads[2].limit],
            [1, 1, 0],
            "{loads:?}"
        );
    }

    #[test]
    fn a_held_tenants_allowance_falls_while_the_workers_are_contended_and_grows_when_not() {
        let held = |spent: u64, allowance: u64| RequestLoad {
            smoothed: WHOLE / 10 * 9,
            limit: 1,
            allowance,
            ..RequestLoad::unmarked(spent)
        };
        let victim = RequestLoad {
            smoothed: WHOLE / 10,
            ..RequestLoad::unmarked(1_000_000)
        };
        // Contended: a quarter less than it used.
        let mut loads = [held(8_000_000, 9_000_000), victim];
        mark(BUSY, 2, capacity(2), &mut loads);
        assert_eq!(loads[0].allowance, 6_000_000);
        assert_eq!(
            loads[1].allowance,
            u64::MAX,
            "the other tenant has no bound"
        );
        // Never under a twentieth of the workers' time (1 ms of 20).
        let mut loads = [held(400_000, 9_000_000), victim];
        mark(BUSY, 2, capacity(2), &mut loads);
        assert_eq!(loads[0].allowance, 1_000_000);
        // Time to spare: a quarter more than it was allowed, up to the
        // window's whole.
        let mut loads = [held(4_000_000, 4_000_000), victim];
        mark(WHOLE / 2, 2, capacity(2), &mut loads);
        assert_eq!(loads[0].allowance, 5_000_000);
        let mut loads = [held(4_000_000, u64::MAX / 2), victim];
        mark(WHOLE / 2, 2, capacity(2), &mut loads);
        assert_eq!(loads[0].allowance, 25_000_000);
        // Unmarked: no bound.
        let mut loads = [held(4_000_000, 4_000_000)];
        mark(BUSY, 2, capacity(2), &mut loads);
        assert_eq!((loads[0].limit, loads[0].allowance), (0, u64::MAX));
    }

    struct Tenant(TenantRequests);

    impl HasRequests for Tenant {
        fn requests(&self) -> &TenantRequests {
            &self.0
        }
    }

    fn tenant() -> Arc<Tenant> {
        Arc::new(Tenant(TenantRequests::new(Counter::default())))
    }

    /// A decision holding `tenant` to `limit` turns (0: none) and an
    /// allowance of `allowance` nanoseconds.
    fn held_to(tenant: &Tenant, limit: u64, allowance: u64) {
        tenant.0.apply(RequestLoad {
            smoothed: WHOLE,
            limit,
            allowance,
            ..RequestLoad::unmarked(0)
        });
    }

    /// No decision is due.
    fn no_decision() {}

    #[tokio::test]
    async fn a_tenant_held_to_one_turn_serves_one_request_at_a_time_in_order() {
        let tenant = tenant();
        held_to(&tenant, 1, u64::MAX);
        let first = RequestTurn::take(tenant.clone(), &no_decision).await;
        // The second and third wait.
        let (order_tx, mut order) = tokio::sync::mpsc::unbounded_channel();
        let mut waiting = Vec::new();
        for i in 0..2 {
            let (tenant, order_tx) = (tenant.clone(), order_tx.clone());
            waiting.push(tokio::spawn(async move {
                let turn = RequestTurn::take(tenant, &no_decision).await;
                order_tx.send(i).expect("the test listens");
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(turn);
            }));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(order.try_recv().is_err(), "a request got a second turn");
        assert_eq!(
            tenant.0.waiting.load(std::sync::atomic::Ordering::Relaxed),
            2
        );
        drop(first);
        for task in waiting {
            task.await.expect("a waiting request");
        }
        assert_eq!((order.recv().await, order.recv().await), (Some(0), Some(1)));
        assert_eq!(tenant.0.waited.get(), 2);
        assert_eq!(
            tenant
                .0
                .in_flight
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
    }

    #[tokio::test]
    async fn a_held_tenant_that_used_its_allowance_waits_for_the_next_window() {
        let tenant = tenant();
        held_to(&tenant, 2, 1_000);
        // One request uses its 1 µs allowance (and more).
        let turn = RequestTurn::take(tenant.clone(), &no_decision).await;
        turn.serve(async { std::thread::sleep(Duration::from_millis(1)) })
            .await;
        // A turn is free, but the next request waits for a new window: it
        // waits one out and asks for the decision itself (no one else
        // sends requests), which starts the window afresh.
        let decided = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let decide = {
            let (tenant, decided) = (tenant.clone(), decided.clone());
            move || {
                tenant.0.take_load();
                decided.store(true, std::sync::atomic::Ordering::SeqCst);
                held_to(&tenant, 2, 1_000);
            }
        };
        let next = tokio::time::timeout(
            Duration::from_secs(5),
            RequestTurn::take(tenant.clone(), &decide),
        )
        .await
        .expect("the next window lets it in");
        assert!(
            decided.load(std::sync::atomic::Ordering::SeqCst),
            "it went before the window was decided"
        );
        assert_eq!(tenant.0.waited.get(), 1);
        drop(next);
    }

    #[tokio::test]
    async fn lifting_the_limit_lets_every_waiting_request_go() {
        let tenant = tenant();
        held_to(&tenant, 1, u64::MAX);
        let first = RequestTurn::take(tenant.clone(), &no_decision).await;
        let waiting: Vec<_> = (0..3)
            .map(|_| tokio::spawn(RequestTurn::take(tenant.clone(), &no_decision)))
            .collect();
        tokio::time::sleep(Duration::from_millis(5)).await;
        held_to(&tenant, 0, u64::MAX);
        let turns: Vec<RequestTurn> = futures_util::future::join_all(waiting)
            .await
            .into_iter()
            .map(|t| t.expect("a waiting request"))
            .collect();
        assert_eq!(
            tenant
                .0
                .in_flight
                .load(std::sync::atomic::Ordering::Relaxed),
            4
        );
        drop((first, turns));
        assert_eq!(
            tenant
                .0
                .in_flight
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
    }

    #[tokio::test]
    async fn a_request_dropped_while_it_waits_takes_no_turn() {
        let tenant = tenant();
        held_to(&tenant, 1, u64::MAX);
        let first = RequestTurn::take(tenant.clone(), &no_decision).await;
        let gave_up = tokio::time::timeout(
            Duration::from_millis(5),
            RequestTurn::take(tenant.clone(), &no_decision),
        )
        .await;
        assert!(gave_up.is_err());
        assert_eq!(
            tenant.0.waiting.load(std::sync::atomic::Ordering::Relaxed),
            0
        );
        drop(first);
        // The next one is served at once.
        let next = tokio::time::timeout(
            Duration::from_secs(5),
            RequestTurn::take(tenant.clone(), &no_decision),
        )
        .await
        .expect("a free turn is taken at once");
        drop(next);
        assert_eq!(tenant.0.waited.get(), 0);
    }

    #[tokio::test]
    async fn a_tenant_not_held_back_never_waits_and_is_charged_its_handlers_time() {
        let tenant = tenant();
        let turns: Vec<RequestTurn> = futures_util::future::join_all(
            (0..10).map(|_| RequestTurn::take(tenant.clone(), &no_decision)),
        )
        .await;
        assert_eq!(
            tenant
                .0
                .in_flight
                .load(std::sync::atomic::Ordering::Relaxed),
            10
        );
        drop(turns);
        let turn = RequestTurn::take(tenant.clone(), &no_decision).await;
        turn.serve(async { std::thread::sleep(Duration::from_millis(2)) })
            .await;
        let load = tenant.0.take_load();
        assert!(load.spent >= 2_000_000, "charged {} ns", load.spent);
        assert_eq!(
            tenant
                .0
                .in_flight
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
    }
}
