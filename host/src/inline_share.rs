//! The callers' workers, shared fairly between tenants: which tenants' routed
//! calls may still run inline, on their callers' tasks.
//!
//! A routed call to an idle key runs on its caller's task (`key/inline.rs`):
//! for an HTTP request or a peer link that is one of the node's own workers,
//! the threads that also poll every socket. Its first slice is bounded (a
//! call still running at an epoch tick half a tick after its poll began is
//! demoted to the guest threads), but nothing bounded how many short calls one tenant could run
//! there back to back: four clients flooding a key with calls that each end
//! in well under a tick kept the workers busy, and another tenant's request
//! waited behind them in the runtime's run queue (issue 17: a victim's p50
//! over HTTP 4.5× its quiet figure under a publish flood, while spinning keys,
//! which are demoted, cost it nothing). The guest threads give turns fairly
//! between tenants (`crate::scheduler`); the callers' workers have no turns.
//!
//! So this module gives each tenant a fair share of them. Time is cut into
//! windows of [`WINDOW`] (counted in epoch ticks: one tick if a tick is
//! longer); at the first routed call of a window, one caller looks at how
//! busy the node's runtime's workers were (tokio's busy time) and at what
//! each tenant's keys used (their CPU time, inline and on the guest threads:
//! `fief_tenant_cpu_seconds_total`), each as a share of the workers' time,
//! smoothed over windows. When two or more tenants used any and the workers
//! were busy more than three quarters of the time, it marks *over its share*
//! each tenant whose load is above an equal share (all the workers' time
//! divided by the tenants that used any), and, busy workers or not, each
//! tenant whose demoted inline calls held the workers a twentieth of the
//! window (a demoted call held its caller's worker until its first epoch tick, with
//! whatever was queued behind it: memory bombs, each a fresh activation
//! filling its memory for a tick every few milliseconds, left the workers
//! under three quarters busy and a victim's p99 over HTTP 3–5×, traced in
//! `docs/benchmarks.md`, "Issue 17, fifth pass"); a tenant so marked stays marked
//! while its load is above half of that, busy workers or not (its calls no
//! longer run on them), so it does not flip in and out every window. A
//! marked tenant's routed calls go through its keys' mailboxes to the guest
//! threads (and its absent keys are started by their own tasks there, not by
//! their callers), where they take fair turns with everyone's and run at the
//! guest threads' lower priority; the others' still run inline. A tenant
//! alone on the node is never marked: one tenant cannot starve itself. A call
//! is still served either way; only where it runs changes. What a tenant's
//! clients cost the workers outside its keys' calls (an HTTP request's
//! parsing, routing) is not moved: the guest threads cannot take it; the same
//! decision, once a window, sets how many of each tenant's API requests are
//! served at once ([`crate::request_turns`]).
//!
//! The hot path reads three atomics (the module's tenant, found once, the
//! window decided and the tenant's mark);
//! the decision takes one clock read, the workers' busy times and a short
//! walk of the tenants once a window. This module must not decide anything
//! else about a call: whether its key is idle and may run inline at all is
//! the key table's (`key/slot.rs`), budgets over time are
//! [`crate::cpu_budget`]'s.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::runtime::RuntimeMetrics;

use crate::cpu_budget::TenantCpuMeters;
use crate::request_turns::{self, HasRequests, RequestLoad};

/// The length of a window: 10 ms, or one epoch tick if that is longer.
pub(crate) const WINDOW: Duration = Duration::from_millis(10);

/// One tenant's mark: over its share of the callers' workers.
pub(crate) struct TenantShare {
    over: AtomicBool,
    /// What the tenant had used (its CPU counter) at the last decision.
    seen_nanos: AtomicU64,
    /// Its load: the smoothed share of the workers' time it used, in
    /// millionths ([`Load`]).
    load: AtomicU64,
    /// Nanoseconds its inline calls that were then demoted held their
    /// callers' workers, since the last decision.
    demoted_nanos: AtomicU64,
}

impl TenantShare {
    /// The share of a tenant whose CPU counter reads `used_nanos` now.
    pub(crate) fn new(used_nanos: u64) -> Self {
        TenantShare {
            over: AtomicBool::new(false),
            seen_nanos: AtomicU64::new(used_nanos),
            load: AtomicU64::new(0),
            demoted_nanos: AtomicU64::new(0),
        }
    }

    /// One of the tenant's inline calls (or activations) was still running
    /// at its first epoch tick, after holding its caller's worker for
    /// `held` (up to a tick: the first slice ends at the next tick).
    pub(crate) fn note_demoted(&self, held: Duration) {
        let nanos = u64::try_from(held.as_nanos()).unwrap_or(u64::MAX);
        self.demoted_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Whether the tenant's routed calls must go through the guest threads.
    pub(crate) fn is_over(&self) -> bool {
        self.over.load(Ordering::Relaxed)
    }
}

/// The node's decision of which tenants are over their share (see the
/// module header).
pub(crate) struct InlineShares {
    /// The window last decided (`ticks / window_ticks`).
    decided: AtomicU64,
    /// Epoch ticks per window.
    window_ticks: u64,
    /// The callers' runtime (the node's own): its workers and how busy
    /// they were.
    workers: RuntimeMetrics,
    /// The last decision; held while one is made.
    last: Mutex<Decision>,
}

/// When the last decision was made, and how busy the workers had been.
struct Decision {
    at: Instant,
    busy_nanos: u64,
    /// The workers' smoothed busy share, in millionths of all of them.
    busy: u64,
}

impl InlineShares {
    /// Shares of the runtime of `workers`, on a node whose epoch ticks
    /// every `epoch_tick`.
    pub(crate) fn new(workers: RuntimeMetrics, epoch_tick: Duration) -> Self {
        let per_tick = epoch_tick.as_nanos().max(1);
        let busy_nanos = busy_nanos(&workers);
        InlineShares {
            decided: AtomicU64::new(0),
            window_ticks: u64::try_from(WINDOW.as_nanos() / per_tick).map_or(1, |n| n.max(1)),
            workers,
            last: Mutex::new(Decision {
                at: Instant::now(),
                busy_nanos,
                busy: 0,
            }),
        }
    }

    /// May a routed call of `tenant` run inline at `ticks`? Decides the
    /// window first if no one has yet.
    pub(crate) fn may_run_inline(
        &self,
        tenant: &TenantShare,
        ticks: u64,
        meters: &TenantCpuMeters,
    ) -> bool {
        self.decide_if_due(ticks, meters);
        !tenant.is_over()
    }

    /// Decide the window of `ticks` if no one has yet (an API request
    /// about to take its turn asks too: [`crate::request_turns`]).
    pub(crate) fn decide_if_due(&self, ticks: u64, meters: &TenantCpuMeters) {
        let window = ticks / self.window_ticks;
        if self.decided.load(Ordering::Relaxed) != window {
            self.decide(window, meters);
        }
    }

    /// Mark the tenants over their share for `window`, from what each used
    /// since the last decision. Whoever finds the lock taken leaves the
    /// decision to its holder.
    fn decide(&self, window: u64, meters: &TenantCpuMeters) {
        let Ok(mut last) = self.last.try_lock() else {
            return;
        };
        if self.decided.swap(window, Ordering::Relaxed) == window {
            return;
        }
        let now = Instant::now();
        let elapsed = u64::try_from(now.duration_since(last.at).as_nanos()).unwrap_or(u64::MAX);
        let workers = u64::try_from(self.workers.num_workers().max(1)).unwrap_or(1);
        let capacity = elapsed.saturating_mul(workers);
        let busy_now = busy_nanos(&self.workers);
        last.busy = smooth(
            last.busy,
            millionths(busy_now.saturating_sub(last.busy_nanos), capacity),
        );
        (last.at, last.busy_nanos) = (now, busy_now);
        let tenants = meters.all();
        let mut loads: Vec<Load> = tenants
            .iter()
            .map(|tenant| {
                let (share, nanos) = (tenant.inline_share(), tenant.used_nanos());
                let before = share.seen_nanos.swap(nanos, Ordering::Relaxed);
                Load {
                    spent: nanos.saturating_sub(before),
                    held_by_demoted: share.demoted_nanos.swap(0, Ordering::Relaxed),
                    smoothed: share.load.load(Ordering::Relaxed),
                    over: share.is_over(),
                }
            })
            .collect();
        mark(capacity, last.busy, &mut loads);
        let mut requests: Vec<RequestLoad> =
            tenants.iter().map(|t| t.requests().take_load()).collect();
        request_turns::mark(last.busy, workers, capacity, &mut requests);
        for ((tenant, load), requests) in tenants.iter().zip(loads).zip(requests) {
            let share = tenant.inline_share();
            share.load.store(load.smoothed, Ordering::Relaxed);
            share.over.store(load.over, Ordering::Relaxed);
            tenant.requests().apply(requests);
        }
    }
}

/// How long the runtime's workers have been busy so far, together.
fn busy_nanos(workers: &RuntimeMetrics) -> u64 {
    (0..workers.num_workers())
        .map(|w| u64::try_from(workers.worker_total_busy_duration(w).as_nanos()).unwrap_or(0))
        .sum()
}

/// `part` of `whole`, in millionths (at most four wholes).
pub(crate) fn millionths(part: u64, whole: u64) -> u64 {
    u64::try_from(u128::from(part) * u128::from(WHOLE) / u128::from(whole.max(1)))
        .unwrap_or(u64::MAX)
        .min(4 * WHOLE)
}

/// `before` moved a quarter of the way to `now`: one window's figure swings
/// with whatever the OS ran in it, on a loaded machine most of all.
pub(crate) fn smooth(before: u64, now: u64) -> u64 {
    (3 * before + now) / 4
}

/// One tenant's use of the workers, as one decision sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Load {
    /// Nanoseconds its keys ran in the window.
    spent: u64,
    /// Nanoseconds its inline calls that were demoted held callers'
    /// workers in the window.
    held_by_demoted: u64,
    /// Its load before the window, then after it: the share of the workers'
    /// time it used, in millionths, smoothed over windows ([`smooth`]).
    smoothed: u64,
    /// Over its share, before the window, then after it.
    over: bool,
}

/// Millionths: all the workers' time over the window.
pub(crate) const WHOLE: u64 = 1_000_000;

/// Whether a tenant counts in a window's shares: it used some in the window,
/// or lately (a smoothed share above a thousandth).
pub(crate) fn is_active(spent: u64, smoothed: u64) -> bool {
    spent > 0 || smoothed >= WHOLE / 1000
}

/// Whether workers busy `busy` (millionths, smoothed) are contended: busy
/// more than three quarters of the time.
pub(crate) fn is_contended(busy: u64) -> bool {
    busy > WHOLE / 4 * 3
}

/// The share of the workers' time (millionths) a tenant's demoted inline
/// calls may hold in a window before it is over, busy workers or not: a
/// twentieth, a tick of 1 ms in a window of two workers for 10 ms. A
/// demoted call held its caller's worker up to a tick in one go, with
/// whatever was queued behind it (memory bombs, each a new activation
/// filling its memory until its first tick, every few milliseconds: a
/// victim's p99 over HTTP 3–5×, with the workers busy under three quarters
/// of the time). Counted in time held, not in calls: a short call that
/// happened to straddle a tick is demoted after microseconds.
const HELD_BY_DEMOTED_OVER: u64 = WHOLE / 20;

/// Decide every tenant's load and mark from what each used of `capacity`
/// (nanoseconds of the callers' workers over the window), given how busy
/// the workers were (`busy`, smoothed, in millionths; see the module
/// header).
fn mark(capacity: u64, busy: u64, loads: &mut [Load]) {
    for load in loads.iter_mut() {
        load.smoothed = smooth(load.smoothed, millionths(load.spent, capacity));
    }
    let active = loads
        .iter()
        .filter(|l| is_active(l.spent, l.smoothed))
        .count() as u64;
    let fair = WHOLE / active.max(1);
    let contended = is_contended(busy);
    for load in loads.iter_mut() {
        let holds_workers = millionths(load.held_by_demoted, capacity) >= HELD_BY_DEMOTED_OVER;
        load.over = active >= 2
            && ((contended && load.smoothed > fair)
                || holds_workers
                || (load.over && load.smoothed > fair / 2));
    }
}

#[cfg(test)]
mod tests {
    use super::{Load, WHOLE, mark};

    /// `windows` windows of `capacity`, with the workers `busy` (millionths)
    /// and each tenant using what `spent` gives it; the marks after each.
    fn run(capacity: u64, busy: u64, spent: &[u64], windows: usize) -> Vec<Vec<bool>> {
        let mut loads: Vec<Load> = spent
            .iter()
            .map(|&spent| Load {
                spent,
                held_by_demoted: 0,
                smoothed: 0,
                over: false,
            })
            .collect();
        (0..windows)
            .map(|_| {
                mark(capacity, busy, &mut loads);
                loads.iter().map(|l| l.over).collect()
            })
            .collect()
    }

    // Two workers for 10 ms.
    const CAPACITY: u64 = 20_000_000;
    // Busy workers: contended.
    const BUSY: u64 = WHOLE / 10 * 9;

    #[test]
    fn a_tenant_alone_is_never_over() {
        assert!(
            run(CAPACITY, BUSY, &[CAPACITY], 20)
                .iter()
                .all(|m| m == &[false])
        );
    }

    #[test]
    fn a_tenant_above_an_equal_share_is_over_while_others_are_not() {
        let marks = run(CAPACITY, BUSY, &[18_000_000, 100_000], 20);
        assert_eq!(marks[0], [false, false], "one window is not enough to mark");
        assert_eq!(marks[19], [true, false]);
        // Its metered time may be well under the workers' busy time (the
        // callers' own work on its calls is not metered).
        assert_eq!(
            run(CAPACITY, BUSY, &[13_000_000, 100_000], 20)[19],
            [true, false]
        );
        assert!(
            run(CAPACITY, BUSY, &[9_000_000, 100_000], 20)
                .iter()
                .all(|m| m == &[false, false])
        );
        // Three tenants that used some: a third each.
        assert_eq!(
            run(CAPACITY, BUSY, &[8_000_000, 6_000_000, 1], 20)[19],
            [true, false, false]
        );
    }

    #[test]
    fn no_tenant_is_over_while_the_workers_have_time_to_spare() {
        // Workers busy 60 % of the time: one tenant above half, but no one
        // waits long.
        assert!(
            run(CAPACITY, WHOLE / 10 * 6, &[11_000_000, 1_000_000], 20)
                .iter()
                .all(|m| m == &[false, false])
        );
    }

    #[test]
    fn a_tenant_over_stays_over_until_it_uses_under_half_its_share() {
        let over = |smoothed: u64| Load {
            spent: 0,
            held_by_demoted: 0,
            smoothed,
            over: true,
        };
        let steady = |permille: u64, was_over: bool| Load {
            spent: CAPACITY / 1000 * permille,
            held_by_demoted: 0,
            smoothed: WHOLE / 1000 * permille,
            over: was_over,
        };
        let idle = WHOLE / 10;
        // Marked, at 30 % of the workers beside another tenant at 10 %,
        // with the workers hardly busy (its calls no longer run on them):
        // still over; at 20 % (under half of its half), not.
        let mut loads = [steady(300, true), steady(100, false)];
        mark(CAPACITY, idle, &mut loads);
        assert_eq!([loads[0].over, loads[1].over], [true, false]);
        let mut loads = [steady(200, true), steady(100, false)];
        mark(CAPACITY, idle, &mut loads);
        assert_eq!([loads[0].over, loads[1].over], [false, false]);
        // Not marked before, 45 % (under its half) is not enough to be
        // marked, though it was enough to stay marked.
        let mut loads = [steady(450, false), steady(400, false)];
        mark(CAPACITY, BUSY, &mut loads);
        assert_eq!([loads[0].over, loads[1].over], [false, false]);
        // One quiet window does not unmark a tenant with a high load.
        let mut loads = [over(WHOLE), steady(100, false)];
        mark(CAPACITY, idle, &mut loads);
        assert!(loads[0].over, "one quiet window unmarked it: {loads:?}");
        // Alone again, it is not over.
        let mut loads = [over(WHOLE)];
        mark(CAPACITY, BUSY, &mut loads);
        assert!(!loads[0].over);
    }

    #[test]
    fn a_tenant_whose_demoted_inline_calls_held_the_workers_is_over_busy_or_not() {
        let idle = WHOLE / 10;
        let load = |held_ticks: u64| Load {
            spent: 2_000_000,
            held_by_demoted: held_ticks * 1_000_000,
            smoothed: WHOLE / 10,
            over: false,
        };
        // 1 ms held by demoted calls in a window of two workers for 10 ms:
        // over, though the workers were mostly idle and its load is low.
        let mut loads = [load(1), load(0)];
        mark(CAPACITY, idle, &mut loads);
        assert_eq!([loads[0].over, loads[1].over], [true, false]);
        // With eight workers, 1 ms is under a twentieth: not over; nor is a
        // short call demoted after 50 µs with two.
        let mut loads = [load(1), load(0)];
        mark(CAPACITY * 4, idle, &mut loads);
        assert_eq!([loads[0].over, loads[1].over], [false, false]);
        let mut loads = [
            Load {
                held_by_demoted: 50_000,
                ..load(0)
            },
            load(0),
        ];
        mark(CAPACITY, idle, &mut loads);
        assert_eq!([loads[0].over, loads[1].over], [false, false]);
        // Alone, never.
        let mut loads = [load(5)];
        mark(CAPACITY, idle, &mut loads);
        assert!(!loads[0].over);
        // A window with no tick held, at a low load: no longer over.
        let mut loads = [
            Load {
                over: true,
                ..load(0)
            },
            load(0),
        ];
        mark(CAPACITY, idle, &mut loads);
        assert_eq!([loads[0].over, loads[1].over], [false, false]);
    }
}
