//! The callers' workers, shared fairly between tenants: which tenants' routed
//! calls may still run inline, on their callers' tasks.
//!
//! A routed call to an idle key runs on its caller's task (`key/inline.rs`):
//! for an HTTP request or a peer link that is one of the node's own workers,
//! the threads that also poll every socket. Its first slice is bounded (a
//! call still running at its first epoch tick is demoted to the guest
//! threads), but nothing bounded how many short calls one tenant could run
//! there back to back: four clients flooding a key with calls that each end
//! in well under a tick kept the workers busy, and another tenant's request
//! waited behind them in the runtime's run queue (issue 17: a victim's p50
//! over HTTP 4.5× its quiet figure under a publish flood, while spinning keys,
//! which are demoted, cost it nothing). The guest threads give turns fairly
//! between tenants (`crate::scheduler`); the callers' workers have no turns.
//!
//! So this module gives each tenant a fair share of them. Time is cut into
//! windows of [`WINDOW`] (counted in epoch ticks: one tick if a tick is
//! longer); at the first routed call of a
//! window, one caller looks at what each tenant's keys used over the window
//! before (their CPU time, inline and on the guest threads:
//! `fief_tenant_cpu_seconds_total`) and, when two or more tenants used any,
//! if together they used more than three quarters of the window's length
//! times the callers' workers (the workers are contended), marks *over its
//! share* each tenant that used more than that time divided by the number of
//! tenants that used any; a tenant so marked stays marked while it uses more
//! than half of its share and the tenants together more than half the
//! workers' time (so it does not flip in and out every window). A marked tenant's
//! routed calls go through its keys' mailboxes to the guest threads (and its
//! absent keys are started by their own tasks there, not by their callers),
//! where they take fair turns with everyone's and run at the guest threads'
//! lower priority; the others' still run inline. A tenant alone on the node is
//! never marked: one tenant cannot starve itself. A call is still served
//! either way; only where it runs changes.
//!
//! The hot path reads two atomics (the window decided and the tenant's mark);
//! the decision takes one clock read and a short walk of the tenants once a
//! window. This module must not decide anything else about a call: whether
//! its key is idle and may run inline at all is the key table's
//! (`key/slot.rs`), budgets over time are [`crate::cpu_budget`]'s.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::cpu_budget::TenantCpuMeters;

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
}

impl TenantShare {
    /// The share of a tenant whose CPU counter reads `used_nanos` now.
    pub(crate) fn new(used_nanos: u64) -> Self {
        TenantShare {
            over: AtomicBool::new(false),
            seen_nanos: AtomicU64::new(used_nanos),
            load: AtomicU64::new(0),
        }
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
    /// How many workers run the callers' tasks (the node's own runtime's).
    workers: u64,
    /// When the last decision was made; held while one is made.
    last: Mutex<Instant>,
}

impl InlineShares {
    /// Shares of a runtime with `workers` workers, on a node whose epoch
    /// ticks every `epoch_tick`.
    pub(crate) fn new(workers: usize, epoch_tick: Duration) -> Self {
        let per_tick = epoch_tick.as_nanos().max(1);
        InlineShares {
            decided: AtomicU64::new(0),
            window_ticks: u64::try_from(WINDOW.as_nanos() / per_tick).map_or(1, |n| n.max(1)),
            workers: u64::try_from(workers.max(1)).unwrap_or(1),
            last: Mutex::new(Instant::now()),
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
        let window = ticks / self.window_ticks;
        if self.decided.load(Ordering::Relaxed) != window {
            self.decide(window, meters);
        }
        !tenant.is_over()
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
        let elapsed = u64::try_from(now.duration_since(*last).as_nanos()).unwrap_or(u64::MAX);
        *last = now;
        let tenants = meters.all();
        let capacity = elapsed.saturating_mul(self.workers);
        let mut loads: Vec<Load> = tenants
            .iter()
            .map(|tenant| {
                let (share, nanos) = (tenant.inline_share(), tenant.used_nanos());
                let before = share.seen_nanos.swap(nanos, Ordering::Relaxed);
                Load {
                    spent: nanos.saturating_sub(before),
                    smoothed: share.load.load(Ordering::Relaxed),
                    over: share.is_over(),
                }
            })
            .collect();
        mark(capacity, &mut loads);
        for (tenant, load) in tenants.iter().zip(loads) {
            let share = tenant.inline_share();
            share.load.store(load.smoothed, Ordering::Relaxed);
            share.over.store(load.over, Ordering::Relaxed);
        }
    }
}

/// One tenant's use of the workers, as one decision sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Load {
    /// Nanoseconds its keys ran in the window.
    spent: u64,
    /// Its load before the window, then after it: the share of the workers'
    /// time it used, in millionths, smoothed over windows (each window
    /// counts a quarter), since on a loaded machine one window's figure
    /// swings with whatever the OS ran in it.
    smoothed: u64,
    /// Over its share, before the window, then after it.
    over: bool,
}

/// Millionths: a whole worker's time over the window.
const WHOLE: u64 = 1_000_000;

/// Decide every tenant's load and mark from what each used of `capacity`
/// (nanoseconds of the callers' workers over the window; see the module
/// header).
fn mark(capacity: u64, loads: &mut [Load]) {
    for load in loads.iter_mut() {
        let now =
            u64::try_from(u128::from(load.spent) * u128::from(WHOLE) / u128::from(capacity.max(1)))
                .unwrap_or(u64::MAX)
                .min(4 * WHOLE);
        load.smoothed = (3 * load.smoothed + now) / 4;
    }
    // Active: used some in this window, or lately (a load above a
    // thousandth of a worker).
    let active = loads
        .iter()
        .filter(|l| l.spent > 0 || l.smoothed >= WHOLE / 1000)
        .count() as u64;
    let total: u64 = loads.iter().map(|l| l.smoothed).sum();
    let fair = WHOLE / active.max(1);
    // Contended: the tenants together used most of the workers' time.
    let (contended, still_contended) = (total > WHOLE / 4 * 3, total > WHOLE / 2);
    for load in loads.iter_mut() {
        load.over = active >= 2
            && ((contended && load.smoothed > fair)
                || (load.over && still_contended && load.smoothed > fair / 2));
    }
}

#[cfg(test)]
mod tests {
    use super::{Load, WHOLE, mark};

    /// `windows` windows of `capacity`, each tenant using what `spent`
    /// gives it; the marks after each.
    fn run(capacity: u64, spent: &[u64], windows: usize) -> Vec<Vec<bool>> {
        let mut loads: Vec<Load> = spent
            .iter()
            .map(|&spent| Load {
                spent,
                smoothed: 0,
                over: false,
            })
            .collect();
        (0..windows)
            .map(|_| {
                mark(capacity, &mut loads);
                loads.iter().map(|l| l.over).collect()
            })
            .collect()
    }

    // Two workers for 10 ms.
    const CAPACITY: u64 = 20_000_000;

    #[test]
    fn a_tenant_alone_is_never_over() {
        assert!(run(CAPACITY, &[CAPACITY], 20).iter().all(|m| m == &[false]));
    }

    #[test]
    fn a_tenant_above_an_equal_share_is_over_while_others_are_not() {
        let marks = run(CAPACITY, &[18_000_000, 100_000], 20);
        assert_eq!(marks[0], [false, false], "one window is not enough to mark");
        assert_eq!(marks[19], [true, false]);
        assert!(
            run(CAPACITY, &[9_000_000, 100_000], 20)
                .iter()
                .all(|m| m == &[false, false])
        );
        // Three tenants that used some: a third each.
        assert_eq!(
            run(CAPACITY, &[10_000_000, 6_000_000, 1], 20)[19],
            [true, false, false]
        );
    }

    #[test]
    fn no_tenant_is_over_while_the_workers_have_time_to_spare() {
        // 12 ms of 20 used together: one tenant above half, but no one waits.
        assert!(
            run(CAPACITY, &[11_000_000, 1_000_000], 20)
                .iter()
                .all(|m| m == &[false, false])
        );
    }

    #[test]
    fn a_tenant_over_stays_over_until_it_uses_under_half_its_share() {
        let over = |smoothed: u64| Load {
            spent: 0,
            smoothed,
            over: true,
        };
        let steady = |permille: u64, was_over: bool| Load {
            spent: CAPACITY / 1000 * permille,
            smoothed: WHOLE / 1000 * permille,
            over: was_over,
        };
        // Marked at 60 % of the workers beside another tenant at 40 %: still
        // over; at 20 % (under half of its half) beside 40 %, not.
        let mut loads = [steady(600, true), steady(400, false)];
        mark(CAPACITY, &mut loads);
        assert_eq!([loads[0].over, loads[1].over], [true, false]);
        let mut loads = [steady(200, true), steady(400, false)];
        mark(CAPACITY, &mut loads);
        assert_eq!([loads[0].over, loads[1].over], [false, false]);
        // Not marked before, 45 % (under its half) is not enough to be
        // marked, though it was enough to stay marked.
        let mut loads = [steady(450, false), steady(400, false)];
        mark(CAPACITY, &mut loads);
        assert_eq!([loads[0].over, loads[1].over], [false, false]);
        // One quiet window does not unmark a tenant with a high load.
        let mut loads = [over(WHOLE), steady(100, false)];
        mark(CAPACITY, &mut loads);
        assert!(loads[0].over, "one quiet window unmarked it: {loads:?}");
    }
}
