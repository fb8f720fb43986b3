//! CPU budgets over time: how much of a core one key may use over a sliding
//! window (issue 16 finding 9), and the meter that measures what it used.
//!
//! `cpu_limit` bounds one callback; nothing bounded a key that runs many
//! short ones (a timer re-armed at 0 ms ran 300k callbacks a second and used
//! a core forever). This module owns the per-key [`CpuBudget`]: a token
//! bucket of CPU time that fills at the module's `cpu_budget` (a
//! [`CpuShare`] of one core) up to one `cpu_budget_window`'s worth, and that
//! every nanosecond the key's guest code runs drains. A key whose bucket is
//! empty is *throttled*: its next callback (or the rest of the running one,
//! at its next epoch tick) waits until the bucket is back at zero. It is
//! never killed for it. So over any window of length `W` a key uses at most
//! `cpu_budget × W` plus one slice (an epoch tick, or one callback shorter
//! than a tick) of CPU.
//!
//! The meter ([`poll_metered`]) times every poll of the key's task, and of an
//! inline call on its caller's task: guest code, the host imports it calls
//! and the host's work on the key's messages run inside those polls; time
//! the key spends waiting (on a host call to another key, for its turn, for
//! its budget, for a message) is outside them and is not charged.
//! A key under a budget (its own `cpu_budget` or its tenant's) is metered in
//! its thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`, read before and after
//! each poll), so a guest thread the OS preempts mid-slice is not charged
//! the time someone else ran: under CPU contention a light tenant is not
//! throttled for the machine's load (measured: 1.5 s throttled in 2 s for a
//! tenant calling a counter every 20 ms, with wall-clock metering on a
//! loaded 2-core machine). The two system calls cost about 0.5 µs each
//! here, so a key under no budget, whose figure only feeds the metrics, is
//! metered in wall-clock time inside the poll (two vDSO clock reads, about
//! 20 ns): it is charged a preempted thread's wait too.
//!
//! A tenant may also have a budget of its own (the node's
//! `cpu_budget_per_tenant`, a number of cores over
//! `cpu_budget_per_tenant_window`): every key's meter also drains its
//! tenant's [`TenantCpu`] bucket, and a key whose tenant is in debt is
//! throttled like a key in debt of its own, so one tenant's keys together use
//! at most that many cores over the window, plus one slice per key running
//! when the tenant's credit ran out. Every tenant's use and throttling are
//! counted (`fief_tenant_cpu_seconds_total`,
//! `fief_tenant_throttled_seconds_total`, `fief status`), budget or not.
//!
//! This module must not decide who runs next among keys that are all within
//! their budgets: that is [`crate::scheduler`]'s fair share.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::config::{CpuCores, CpuShare};
use crate::inline_share::TenantShare;
use crate::metrics::{SecondsCounter, TenantCounters};
use crate::request_turns::{HasRequests, TenantRequests};
use crate::sync::lock;

/// What a key's guest code has used, moved by [`metered`] while the store
/// is borrowed by the call (so it lives beside the store, not in it).
pub(crate) struct CpuMeter {
    used_nanos: AtomicU64,
    /// The module's `fief_key_cpu_seconds_total`.
    module_used: SecondsCounter,
    /// The module's `fief_key_throttled_seconds_total`.
    module_throttled: SecondsCounter,
    /// The key's tenant, charged everything the key is.
    tenant: Arc<TenantCpu>,
    /// Metered in thread CPU time (the key or its tenant has a budget), not
    /// wall time (see the module header).
    thread_cpu: bool,
}

impl CpuMeter {
    /// A meter that also moves its module's counters and its tenant's, for
    /// a key with a `cpu_budget` of its own if `budgeted`.
    pub(crate) fn new(
        (module_used, module_throttled): (SecondsCounter, SecondsCounter),
        tenant: Arc<TenantCpu>,
        budgeted: bool,
    ) -> Self {
        let thread_cpu = budgeted || tenant.has_budget();
        CpuMeter {
            used_nanos: AtomicU64::new(0),
            module_used,
            module_throttled,
            tenant,
            thread_cpu,
        }
    }

    /// Guest time used so far, in nanoseconds.
    pub(crate) fn used_nanos(&self) -> u64 {
        self.used_nanos.load(Ordering::Relaxed)
    }

    /// The key's tenant's meter.
    pub(crate) fn tenant(&self) -> &TenantCpu {
        &self.tenant
    }

    fn charge(&self, spent: Duration) {
        let nanos = u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX);
        self.used_nanos.fetch_add(nanos, Ordering::Relaxed);
        self.module_used.inc_by(spent);
        self.tenant.used.inc_by(spent);
    }

    /// Wait out `wait`, the key's throttling for its budget or its
    /// tenant's, counting the time as it passes: in steps of at most
    /// [`THROTTLE_COUNT_STEP`], so `fief status` and `/metrics` lag a wait of
    /// seconds by one step, not by the whole wait, and a key killed while it
    /// waits is still counted what it waited.
    pub(crate) async fn sit_out(&self, wait: Duration) {
        let mut left = wait;
        while !left.is_zero() {
            let step = Instant::now();
            tokio::time::sleep(left.min(THROTTLE_COUNT_STEP)).await;
            // A timer that fires late kept the key waiting: count that too.
            let waited = step.elapsed();
            self.module_throttled.inc_by(waited);
            self.tenant.throttled.inc_by(waited);
            left = left.saturating_sub(waited);
        }
    }
}

/// The longest stretch of a throttled key's wait counted at once (see
/// [`CpuMeter::sit_out`]).
const THROTTLE_COUNT_STEP: Duration = Duration::from_millis(50);

/// One tenant's CPU on this node: what its keys used, what they waited, and
/// its `cpu_budget_per_tenant` (see the module header).
pub(crate) struct TenantCpu {
    /// `fief_tenant_cpu_seconds_total{tenant}`, and what the tenant's
    /// budget is charged.
    used: SecondsCounter,
    /// `fief_tenant_throttled_seconds_total{tenant}`.
    throttled: SecondsCounter,
    /// The tenant's budget; `None`: the node sets none.
    budget: Option<Mutex<CpuBudget>>,
    limit: Option<CpuCores>,
    /// Whether its routed calls may run on their callers' workers
    /// ([`crate::inline_share`]).
    inline: TenantShare,
    /// Its key requests over the API, and their turns
    /// ([`crate::request_turns`]).
    requests: TenantRequests,
}

impl TenantCpu {
    /// How long the tenant's keys must wait until its credit is back at
    /// zero, if it is in debt.
    pub(crate) fn wait(&self, now: Instant) -> Option<Duration> {
        let budget = self.budget.as_ref()?;
        lock(budget).wait(self.used.nanos(), now)
    }

    /// Whether the node gives this tenant a budget.
    pub(crate) fn has_budget(&self) -> bool {
        self.budget.is_some()
    }

    /// Nanoseconds its keys have run on this node so far.
    pub(crate) fn used_nanos(&self) -> u64 {
        self.used.nanos()
    }

    /// Its share of the callers' workers ([`crate::inline_share`]).
    pub(crate) fn inline_share(&self) -> &TenantShare {
        &self.inline
    }
}

impl HasRequests for TenantCpu {
    fn requests(&self) -> &TenantRequests {
        &self.requests
    }
}

/// Every tenant's [`TenantCpu`] on one node, made on first use.
pub(crate) struct TenantCpuMeters {
    meters: Mutex<HashMap<String, Arc<TenantCpu>>>,
    /// The node's `cpu_budget_per_tenant` and its window.
    budget: Option<(CpuCores, Duration)>,
}

/// One tenant's CPU, as `fief status` reports it.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct TenantCpuReport {
    /// The tenant (`""`: modules of no tenant).
    pub tenant: String,
    /// Seconds its keys ran on this node since it started.
    pub cpu_seconds: f64,
    /// Seconds its keys waited, over their budgets or the tenant's.
    pub throttled_seconds: f64,
    /// The tenant's `cpu_budget_per_tenant` (`1500m`), if the node sets one.
    pub budget: Option<String>,
}

impl TenantCpuMeters {
    /// Meters for a node whose tenants each get `budget` cores over its
    /// window (`None`: no tenant budget).
    pub(crate) fn new(budget: Option<(CpuCores, Duration)>) -> Self {
        TenantCpuMeters {
            meters: Mutex::new(HashMap::new()),
            budget,
        }
    }

    /// The meter of `tenant`, made with `counters` (its two metric series)
    /// when it is new.
    pub(crate) fn of(
        &self,
        tenant: &str,
        counters: impl FnOnce() -> TenantCounters,
    ) -> Arc<TenantCpu> {
        let mut meters = lock(&self.meters);
        if let Some(meter) = meters.get(tenant) {
            return meter.clone();
        }
        let TenantCounters {
            cpu: used,
            throttled,
            requests_waited,
        } = counters();
        // The budget is charged what the counter moves from now on (a
        // series the registry already had may not start at zero).
        let already = used.nanos();
        let meter = Arc::new(TenantCpu {
            used,
            throttled,
            budget: self.budget.map(|(cores, window)| {
                let mut budget =
                    CpuBudget::new(u64::from(cores.millicores()), window, Instant::now());
                budget.charged_nanos = already;
                Mutex::new(budget)
            }),
            limit: self.budget.map(|(cores, _)| cores),
            inline: TenantShare::new(already),
            requests: TenantRequests::new(requests_waited),
        });
        meters.insert(tenant.to_owned(), meter.clone());
        meter
    }

    /// Every tenant's meter.
    pub(crate) fn all(&self) -> Vec<Arc<TenantCpu>> {
        lock(&self.meters).values().cloned().collect()
    }

    /// Every tenant's figures, by name.
    pub(crate) fn report(&self) -> Vec<TenantCpuReport> {
        let mut out: Vec<_> = lock(&self.meters)
            .iter()
            .map(|(tenant, m)| TenantCpuReport {
                tenant: tenant.clone(),
                cpu_seconds: m.used.get(),
                throttled_seconds: m.throttled.get(),
                budget: m.limit.map(|c| c.to_string()),
            })
            .collect();
        out.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        out
    }
}

/// Poll `work` once, charging the time spent to `meter`.
pub(crate) fn poll_metered<F: Future + ?Sized>(
    meter: &CpuMeter,
    work: Pin<&mut F>,
    cx: &mut std::task::Context<'_>,
) -> std::task::Poll<F::Output> {
    poll_timed(meter, work, cx).0
}

thread_local! {
    /// When the metered poll running on this thread began (wall clock), for
    /// the epoch callback: see [`poll_running_for`].
    static POLL_STARTED: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// How long the metered poll running on this thread has run (wall clock),
/// if one is. The epoch callback reads it to tell an inline call that has
/// held its caller's worker for a while from one that began just before a
/// tick (`key/process.rs`).
pub(crate) fn poll_running_for() -> Option<Duration> {
    POLL_STARTED
        .with(|started| started.get())
        .map(|t| t.elapsed())
}

/// [`poll_metered`], also returning the time the poll took.
pub(crate) fn poll_timed<F: Future + ?Sized>(
    meter: &CpuMeter,
    work: Pin<&mut F>,
    cx: &mut std::task::Context<'_>,
) -> (std::task::Poll<F::Output>, Duration) {
    // A poll inside a poll (an inline call from a key's callback) restores
    // the outer one's start when it ends.
    let (poll, spent) = if meter.thread_cpu {
        let outer = POLL_STARTED.replace(Some(Instant::now()));
        let start = thread_cpu_time();
        let poll = work.poll(cx);
        let spent = thread_cpu_time().saturating_sub(start);
        POLL_STARTED.set(outer);
        (poll, spent)
    } else {
        let start = Instant::now();
        let outer = POLL_STARTED.replace(Some(start));
        let poll = work.poll(cx);
        POLL_STARTED.set(outer);
        (poll, start.elapsed())
    };
    meter.charge(spent);
    (poll, spent)
}

/// The CPU time the calling thread has used.
fn thread_cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

/// A key's CPU budget: a token bucket of CPU time (see the module header).
pub(crate) struct CpuBudget {
    /// Nanoseconds of CPU per second of wall time, in thousandths.
    millicores: u64,
    /// The most credit the bucket holds: one window's worth.
    capacity_nanos: i64,
    /// Credit at `at`, in nanoseconds; below zero the key is throttled.
    credit_nanos: i64,
    at: Instant,
    /// The meter's reading folded into `credit_nanos`.
    charged_nanos: u64,
}

impl CpuBudget {
    /// The budget of `share` of one core over `window` for a key, full at
    /// `now`; `None` for a whole core (nothing to throttle: a key runs one
    /// callback at a time).
    pub(crate) fn for_key(share: CpuShare, window: Duration, now: Instant) -> Option<CpuBudget> {
        if share >= CpuShare::WHOLE_CORE {
            return None;
        }
        Some(CpuBudget::new(u64::from(share.millicores()), window, now))
    }

    /// The budget of `millicores` thousandths of a core over `window`, full
    /// at `now`.
    fn new(millicores: u64, window: Duration, now: Instant) -> CpuBudget {
        let window_nanos = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX);
        let capacity = window_nanos.saturating_mul(millicores) / 1000;
        let capacity_nanos = i64::try_from(capacity).unwrap_or(i64::MAX);
        CpuBudget {
            millicores: millicores.max(1),
            capacity_nanos,
            credit_nanos: capacity_nanos,
            at: now,
            charged_nanos: 0,
        }
    }

    /// Fold in what the meter read (`used_nanos`, its running total) and the
    /// credit earned since the last look; how long the key must wait until
    /// its credit is back at zero, or `None` if it may run now.
    pub(crate) fn wait(&mut self, used_nanos: u64, now: Instant) -> Option<Duration> {
        let elapsed =
            u64::try_from(now.saturating_duration_since(self.at).as_nanos()).unwrap_or(u64::MAX);
        let earned =
            i64::try_from(elapsed.saturating_mul(self.millicores) / 1000).unwrap_or(i64::MAX);
        let spent =
            i64::try_from(used_nanos.saturating_sub(self.charged_nanos)).unwrap_or(i64::MAX);
        self.credit_nanos = self
            .credit_nanos
            .saturating_add(earned)
            .min(self.capacity_nanos)
            .saturating_sub(spent);
        self.at = now;
        self.charged_nanos = used_nanos;
        if self.credit_nanos >= 0 {
            return None;
        }
        // Credit comes back at `millicores` thousandths of a nanosecond per
        // nanosecond.
        let debt = self.credit_nanos.unsigned_abs();
        Some(Duration::from_nanos(
            debt.saturating_mul(1000).div_ceil(self.millicores),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_core_is_never_throttled() {
        assert!(
            CpuBudget::for_key(CpuShare::WHOLE_CORE, Duration::from_secs(1), Instant::now())
                .is_none()
        );
    }

    #[test]
    fn a_key_over_its_budget_waits_until_its_credit_is_back() {
        let start = Instant::now();
        let share = CpuShare::from_millicores(100).unwrap();
        let mut budget = CpuBudget::for_key(share, Duration::from_secs(1), start).unwrap();
        // A full bucket holds 100 ms; using 90 ms leaves credit.
        assert_eq!(budget.wait(90_000_000, start), None);
        // 30 ms more is 20 ms of debt: 200 ms at a tenth of a core.
        let wait = budget.wait(120_000_000, start).expect("throttled");
        assert_eq!(wait, Duration::from_millis(200));
        // After those 200 ms it may run again.
        assert_eq!(budget.wait(120_000_000, start + wait), None);
        // Credit never grows past one window's worth.
        let later = start + Duration::from_secs(3600);
        assert_eq!(budget.wait(120_000_000, later), None);
        assert!(budget.wait(221_000_000, later).is_some());
    }

    #[test]
    fn every_key_of_a_tenant_drains_one_tenant_budget() {
        let cores = CpuCores::from_millicores(100).unwrap();
        let meters = TenantCpuMeters::new(Some((cores, Duration::from_secs(1))));
        let counters = TenantCounters::default;
        let acme = meters.of("acme", counters);
        let module = || (SecondsCounter::default(), SecondsCounter::default());
        let (a, b) = (
            CpuMeter::new(module(), acme.clone(), false),
            CpuMeter::new(module(), meters.of("acme", counters), false),
        );
        let globex = CpuMeter::new(module(), meters.of("globex", counters), false);
        let now = Instant::now();
        // The bucket holds 100 ms: two keys' 60 ms each put the tenant 20 ms
        // in debt, which takes 200 ms to pay back at a tenth of a core.
        a.charge(Duration::from_millis(60));
        b.charge(Duration::from_millis(60));
        assert_eq!(a.tenant().wait(now), Some(Duration::from_millis(200)));
        assert_eq!(b.tenant().wait(now), Some(Duration::from_millis(200)));
        // Another tenant's budget is its own.
        assert_eq!(globex.tenant().wait(now), None);
        assert_eq!(acme.wait(now + Duration::from_millis(200)), None);
        let report = meters.report();
        assert_eq!(report.len(), 2);
        assert_eq!(report[0].tenant, "acme");
        assert!((report[0].cpu_seconds - 0.12).abs() < 1e-9);
        assert_eq!(report[0].budget.as_deref(), Some("100m"));
    }

    #[test]
    fn without_a_node_budget_tenants_are_metered_but_never_throttled() {
        let meters = TenantCpuMeters::new(None);
        let tenant = meters.of("acme", TenantCounters::default);
        let key = CpuMeter::new(
            (SecondsCounter::default(), SecondsCounter::default()),
            tenant.clone(),
            false,
        );
        key.charge(Duration::from_secs(100));
        assert_eq!(tenant.wait(Instant::now()), None);
        assert!((meters.report()[0].cpu_seconds - 100.0).abs() < 1e-9);
    }

    /// A poll whose thread is off the CPU for 50 ms (a sleep stands in for
    /// the OS preempting it): a key under a budget is charged the CPU it
    /// used, not those 50 ms; a key under none is charged the wall time.
    #[test]
    fn a_budgeted_key_is_not_charged_the_time_its_thread_was_off_the_cpu() {
        let meters = TenantCpuMeters::new(None);
        let counters = || (SecondsCounter::default(), SecondsCounter::default());
        let off_cpu = |meter: &CpuMeter| {
            let mut work = std::pin::pin!(std::future::poll_fn(|_| {
                std::thread::sleep(Duration::from_millis(50));
                std::task::Poll::Ready(())
            }));
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            poll_timed(meter, work.as_mut(), &mut cx).1
        };
        let budgeted = CpuMeter::new(counters(), meters.of("acme", TenantCounters::default), true);
        let spent = off_cpu(&budgeted);
        assert!(spent < Duration::from_millis(10), "charged {spent:?}");
        assert_eq!(budgeted.used_nanos(), spent.as_nanos() as u64);
        let unbudgeted = CpuMeter::new(
            counters(),
            meters.of("acme", TenantCounters::default),
            false,
        );
        assert!(off_cpu(&unbudgeted) >= Duration::from_millis(50));
    }
}
