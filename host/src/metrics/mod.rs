//! The node's Prometheus metrics: the counters and histograms every layer
//! moves, and their OpenMetrics text.
//!
//! Two kinds of figure. *Counters and histograms* are kept by [`Metrics`]
//! (one per node, so several embedded instances in one process never mix
//! their figures) and moved by small hooks where things happen: a fence
//! (`NodeShared::fence`), a key process starting or ending (the key task), a
//! call finishing, a module compiling, a key's CPU meter, an API connection.
//! *Gauges* are not kept at all: [`Metrics::render`] sets them from the
//! [`Readings`] the node takes of its state at scrape time (lease time left,
//! partitions owned, epoch, term, live keys and mailbox depth per module,
//! limbo, the cache's figures; `node/metrics_page.rs`), so they can never
//! drift from what `GET /v1/status` says. Lease renewals are counted by the
//! lease bookkeeping itself ([`fief_core::Lease::renewal_counts`]); a fence
//! folds the counts of the lease it gives up into [`Metrics`].
//!
//! This file sits below the node and below key processes, beside the meters
//! and ledgers that move it: it must not read the node (its readings come in
//! as plain values) nor import anything above the ledgers' row.
//!
//! The text is OpenMetrics (`prometheus-client`), which Prometheus scrapes
//! natively. Every name starts with `fief_`; `docs/operations.md` lists them
//! with what to alert on.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fief_core::RenewalCounts;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::sync::lock;

mod alarms;
mod readings;
mod striped;
mod topics;

pub(crate) use alarms::AlarmMetrics;
pub(crate) use readings::Readings;
use striped::StripedU64;
pub(crate) use striped::{CallCounter, SecondsCounter};

/// A module's inline-call counters: `fief_calls_inline_total` and
/// `fief_calls_demoted_total`.
#[derive(Clone, Default)]
pub(crate) struct InlineCounters {
    /// Calls served on their caller's task.
    pub(crate) calls: CallCounter,
    /// Of those, the ones demoted to the guest threads.
    pub(crate) demoted: CallCounter,
}
pub(crate) use striped::{LATENCY_BUCKETS, LatencyHistogram};
pub(crate) use topics::{Dropped, TopicMetrics};

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// One label.
type Labels1 = [(&'static str, String); 1];
/// Two labels.
type Labels2 = [(&'static str, String); 2];
/// Three labels.
type Labels3 = [(&'static str, String); 3];

/// Which way a call went, for [`Metrics::call_done`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CallRoute {
    /// Arrived here (API or embedding program) and served here.
    Local,
    /// Arrived here and was forwarded to the owner.
    Routed,
    /// Forwarded here by a peer and served here.
    Peer,
}

impl CallRoute {
    fn label(self) -> &'static str {
        match self {
            CallRoute::Local => "local",
            CallRoute::Routed => "routed",
            CallRoute::Peer => "peer",
        }
    }
}

/// One module's call series, indexed by [`CallRoute`] (its discriminant).
struct CallSeries {
    ok: [CallCounter; 3],
    error: [CallCounter; 3],
    seconds: [LatencyHistogram; 3],
    /// Calls served here (local and for peers).
    served: StripedU64,
}

/// The causes [`kill_cause`] gives, and the key's idle end: the causes of
/// `fief_key_kills_total` whose counters a module finds without a lookup.
const KILL_CAUSES: [&str; 9] = [
    "fence",
    "moved",
    "operator",
    "shutdown",
    "other",
    "cpu_limit",
    "memory_limit",
    "trap",
    "idle",
];

/// One module's kill counters, indexed as [`KILL_CAUSES`], each made at its
/// first kill.
type KillSeries = [std::sync::OnceLock<Counter>; KILL_CAUSES.len()];

/// A node's counters and histograms (gauges are read at scrape time).
pub(crate) struct Metrics {
    registry: Registry,
    fences: Family<Labels1, Counter>,
    arbiter_regressions: Family<Labels1, Counter>,
    renewals: Family<Labels1, Counter>,
    /// Renewal counts of leases given up (a fence folds them in).
    renewals_past: Mutex<RenewalCounts>,
    activations: Family<Labels1, Counter>,
    inline_calls: Family<Labels1, CallCounter>,
    demoted_calls: Family<Labels1, CallCounter>,
    kills: Family<Labels2, Counter>,
    evictions: Family<Labels2, Counter>,
    reactivations: Family<Labels1, Counter>,
    calls: Family<Labels3, CallCounter>,
    call_seconds: Family<Labels1, LatencyHistogram>,
    compile_seconds: Family<Labels1, Histogram>,
    options_lowered: Family<Labels1, Counter>,
    coordination_restarts: Counter,
    cache: Family<Labels1, Counter>,
    handoff_states: Family<Labels1, Counter>,
    guest_log_dropped: Family<Labels1, Counter>,
    guest_log_truncated: Family<Labels1, Counter>,
    key_cpu_seconds: Family<Labels1, SecondsCounter>,
    key_throttled_seconds: Family<Labels1, SecondsCounter>,
    tenant_cpu_seconds: Family<Labels1, SecondsCounter>,
    tenant_throttled_seconds: Family<Labels1, SecondsCounter>,
    tenant_requests_waited: Family<Labels1, Counter>,
    /// API connections open now (kept by the connection loop, not read at
    /// scrape time: it is the loop's own figure).
    api_connections: Gauge,
    api_connections_closed: Family<Labels1, Counter>,
    storage: crate::storage::writer::StorageMetrics,
    alarms: AlarmMetrics,
    topics: TopicMetrics,
    gauges: Gauges,
    /// Each module's call series, looked up once (see [`CallSeries`]), with
    /// the calls it served here (local and for peers) for the dashboard's
    /// call rates.
    /// Read on every call without a lock; a module's series are added once.
    call_series: SeriesMap<CallSeries>,
    /// Each module's kill counters (see [`Metrics::killed`]).
    kill_series: SeriesMap<KillSeries>,
}

/// Gauges, set from the node's [`Readings`] by [`Metrics::render`].
#[derive(Default)]
struct Gauges {
    lease_remaining: Gauge<f64, AtomicU64>,
    lease_ttl: Gauge<f64, AtomicU64>,
    lease_state: Family<Labels1, Gauge>,
    partitions: Gauge,
    partitions_owned: Gauge,
    epoch: Gauge,
    leader_term: Gauge,
    leader: Gauge,
    nodes: Gauge,
    live_keys: Family<Labels1, Gauge>,
    mailbox_depth: Family<Labels1, Gauge>,
    limbo: Gauge,
    cache_entries: Gauge,
    cache_bytes: Gauge,
    host_bytes: Family<Labels1, Gauge>,
    host_bytes_limit: Family<Labels1, Gauge>,
    host_bytes_refused: Family<Labels1, Counter>,
}

fn compile_histogram() -> Histogram {
    // 1 ms .. ~131 s (a Python component takes seconds to compile).
    Histogram::new(exponential_buckets(0.001, 2.0, 18))
}

/// One tenant's counters ([`Metrics::tenant_counters`]).
#[derive(Default)]
pub(crate) struct TenantCounters {
    /// `fief_tenant_cpu_seconds_total{tenant}`.
    pub(crate) cpu: SecondsCounter,
    /// `fief_tenant_throttled_seconds_total{tenant}`.
    pub(crate) throttled: SecondsCounter,
    /// `fief_tenant_requests_waited_total{tenant}`.
    pub(crate) requests_waited: Counter,
}

impl Metrics {
    /// The storage writer's series.
    pub(crate) fn storage(&self) -> crate::storage::writer::StorageMetrics {
        self.storage.clone()
    }

    /// The alarm series, for the node's alarm loop.
    pub(crate) fn alarms(&self) -> AlarmMetrics {
        self.alarms.clone()
    }

    /// The cluster-wide pub/sub series.
    pub(crate) fn topics(&self) -> &TopicMetrics {
        &self.topics
    }

    /// Fresh metrics, every series registered.
    pub(crate) fn new() -> Self {
        let mut registry = Registry::with_prefix("fief");
        let fences = Family::<Labels1, Counter>::default();
        let arbiter_regressions = Family::<Labels1, Counter>::default();
        let renewals = Family::<Labels1, Counter>::default();
        let activations = Family::<Labels1, Counter>::default();
        let inline_calls = Family::<Labels1, CallCounter>::default();
        let demoted_calls = Family::<Labels1, CallCounter>::default();
        let kills = Family::<Labels2, Counter>::default();
        let evictions = Family::<Labels2, Counter>::default();
        let reactivations = Family::<Labels1, Counter>::default();
        let calls = Family::<Labels3, CallCounter>::default();
        let call_seconds = Family::<Labels1, LatencyHistogram>::default();
        let compile_seconds =
            Family::<Labels1, Histogram>::new_with_constructor(compile_histogram as fn() -> _);
        let options_lowered = Family::<Labels1, Counter>::default();
        let coordination_restarts = Counter::default();
        let cache = Family::<Labels1, Counter>::default();
        let handoff_states = Family::<Labels1, Counter>::default();
        let guest_log_dropped = Family::<Labels1, Counter>::default();
        let guest_log_truncated = Family::<Labels1, Counter>::default();
        let key_cpu_seconds = Family::<Labels1, SecondsCounter>::default();
        let key_throttled_seconds = Family::<Labels1, SecondsCounter>::default();
        let tenant_cpu_seconds = Family::<Labels1, SecondsCounter>::default();
        let tenant_throttled_seconds = Family::<Labels1, SecondsCounter>::default();
        let tenant_requests_waited = Family::<Labels1, Counter>::default();
        let api_connections = Gauge::default();
        let api_connections_closed = Family::<Labels1, Counter>::default();
        let gauges = Gauges::default();
        let storage = crate::storage::writer::StorageMetrics::register(&mut registry);
        let alarms = AlarmMetrics::register(&mut registry);
        let topics = TopicMetrics::register(&mut registry);
        let r = &mut registry;
        r.register("fences", "Times this node fenced, by cause", fences.clone());
        r.register(
            "arbiter_regressions",
            "Times the arbiter answered from before what this node had seen (it lost commits), by what went back; the node fenced each time",
            arbiter_regressions.clone(),
        );
        r.register(
            "lease_renewals",
            "Lease renewals (the registration included) by outcome: ok, or failed (refused, unanswered, or answered after the fence point)",
            renewals.clone(),
        );
        r.register(
            "key_activations",
            "Key processes started, by module",
            activations.clone(),
        );
        r.register(
            "calls_inline",
            "Calls served on their caller's task because the key was idle, or absent and started there (no hop to the key's task), by module; counted among the calls too",
            inline_calls.clone(),
        );
        r.register(
            "calls_demoted",
            "Inline calls (or activations) still running half a tick after their poll began, at an epoch tick: finished on the guest threads, by module",
            demoted_calls.clone(),
        );
        r.register(
            "key_kills",
            "Key processes ended by the host or by their limits, by module and cause (fence, cpu_limit, memory_limit, idle, moved, operator, shutdown, trap, other)",
            kills.clone(),
        );
        r.register(
            "keys_evicted",
            "Idle key processes retired with their state kept, by module and cause (idle: its idle_timeout; module_budget: the module's max_live_keys; node_budget: the node's instance pool; memory_budget: the node's max_guest_memory)",
            evictions.clone(),
        );
        r.register(
            "keys_reactivated",
            "Activations of keys this node evicted lately (the last 4096 per module), by module",
            reactivations.clone(),
        );
        r.register(
            "calls",
            "Calls finished, by module, route (local: served here; routed: forwarded to the owner; peer: served here for a peer) and outcome (ok, error)",
            calls.clone(),
        );
        r.register(
            "call_duration_seconds",
            "Call latency by route (local, routed, peer)",
            call_seconds.clone(),
        );
        r.register(
            "module_compile_seconds",
            "Time to make a deployed component runnable, by whether it came from the compile cache",
            compile_seconds.clone(),
        );
        r.register(
            "coordination_restarts",
            "Times the coordination loop crashed and was restarted (the node fenced, then rejoined with a fresh lease)",
            coordination_restarts.clone(),
        );
        r.register(
            "module_options_lowered",
            "Options of module versions loaded from the store that were over this node's ceiling and run lowered to it, by option",
            options_lowered.clone(),
        );
        r.register(
            "cache_operations",
            "The coherent cache's owner-side events on this node: hit, miss, eviction, expiration, ownership_drop",
            cache.clone(),
        );
        r.register(
            "handoff_states",
            "Handoff states on this node, by event: sent (to a new owner), received, delivered (to the key's next process), kept (a move failed; they stay for the next one), and the losses: dropped_stale (sent for a transfer that did not commit, or an ownership that ended), dropped_fence (waiting when the node fenced), too_large (over the module's max_handoff_size), key_died (handoff trapped)",
            handoff_states.clone(),
        );
        r.register(
            "guest_log_lines_dropped",
            "Guest log lines (log import, stdout, stderr), and the host's warnings about a key, dropped by the key's log rate limit (max_log_lines_per_second, max_log_bytes_per_second), by module",
            guest_log_dropped.clone(),
        );
        r.register(
            "guest_log_lines_truncated",
            "Guest log lines cut at the line cap (8 KiB), by module",
            guest_log_truncated.clone(),
        );
        r.register(
            "key_cpu_seconds",
            "Time keys' guest code ran (inside the polls of their callbacks), by module",
            key_cpu_seconds.clone(),
        );
        r.register(
            "key_throttled_seconds",
            "Time keys waited because they were over their cpu_budget, by module",
            key_throttled_seconds.clone(),
        );
        r.register(
            "tenant_cpu_seconds",
            "Time a tenant's keys ran on this node (the sum of its modules' key_cpu_seconds), by tenant (\"\": modules of no tenant)",
            tenant_cpu_seconds.clone(),
        );
        r.register(
            "tenant_throttled_seconds",
            "Time a tenant's keys waited because they were over their cpu_budget or the tenant's cpu_budget_per_tenant, by tenant",
            tenant_throttled_seconds.clone(),
        );
        r.register(
            "tenant_requests_waited",
            "Key requests (call, cast) over the API that waited for a turn because their tenant was over its share of the API's workers, by tenant",
            tenant_requests_waited.clone(),
        );
        r.register(
            "api_connections",
            "HTTP API connections open now (at most http_max_connections, besides those being closed)",
            api_connections.clone(),
        );
        r.register(
            "api_connections_closed",
            "HTTP API connections the node closed at a limit, by reason: refused (at the connection cap with every connection busy; answered 503), evicted (idle the longest, closed at the cap to admit a new one), header_timeout, idle_timeout, head_too_large (answered 414 or 431)",
            api_connections_closed.clone(),
        );
        r.register(
            "lease_remaining_seconds",
            "Time left before this node's fence point (0 unless its lease is current)",
            gauges.lease_remaining.clone(),
        );
        r.register(
            "lease_ttl_seconds",
            "The configured lease time-to-live",
            gauges.lease_ttl.clone(),
        );
        r.register(
            "lease_state",
            "1 for the lease's state (pending, current, fenced), 0 for the others",
            gauges.lease_state.clone(),
        );
        r.register(
            "partitions",
            "Partitions in the namespace",
            gauges.partitions.clone(),
        );
        r.register(
            "partitions_owned",
            "Partitions this node owns per its table",
            gauges.partitions_owned.clone(),
        );
        r.register(
            "table_epoch",
            "Epoch of the partition table this node knows",
            gauges.epoch.clone(),
        );
        r.register(
            "leader_term",
            "The leader's term if this node leads, else 0",
            gauges.leader_term.clone(),
        );
        r.register("leader", "1 if this node leads", gauges.leader.clone());
        r.register(
            "cluster_nodes",
            "Live nodes of the namespace as this node last heard from the arbiter",
            gauges.nodes.clone(),
        );
        r.register(
            "live_keys",
            "Live key processes on this node, by module",
            gauges.live_keys.clone(),
        );
        r.register(
            "mailbox_depth",
            "Messages waiting in the mailboxes of a module's live keys on this node",
            gauges.mailbox_depth.clone(),
        );
        r.register(
            "limbo_entries",
            "Survivors in limbo (continue/callback keys that outlived a fence)",
            gauges.limbo.clone(),
        );
        r.register(
            "cache_entries",
            "Coherent cache entries held as owner",
            gauges.cache_entries.clone(),
        );
        r.register(
            "cache_bytes",
            "Bytes charged to the coherent cache's entries",
            gauges.cache_bytes.clone(),
        );
        r.register(
            "host_bytes",
            "Host memory held for a tenant's keys outside their linear memories (queued messages, timer tags, subscriptions, waiting handoff states), by tenant (\"\": modules of no tenant)",
            gauges.host_bytes.clone(),
        );
        r.register(
            "host_bytes_limit",
            "The tenant's host-memory budget on this node (max_host_bytes_per_tenant)",
            gauges.host_bytes_limit.clone(),
        );
        r.register(
            "host_bytes_refused",
            "Messages, timers, subscriptions and publications refused because the tenant's host-memory budget was full, by tenant",
            gauges.host_bytes_refused.clone(),
        );
        Metrics {
            registry,
            fences,
            arbiter_regressions,
            renewals,
            renewals_past: Mutex::new(RenewalCounts::default()),
            activations,
            inline_calls,
            demoted_calls,
            kills,
            evictions,
            reactivations,
            calls,
            call_seconds,
            compile_seconds,
            options_lowered,
            coordination_restarts,
            cache,
            handoff_states,
            guest_log_dropped,
            guest_log_truncated,
            key_cpu_seconds,
            key_throttled_seconds,
            tenant_cpu_seconds,
            tenant_throttled_seconds,
            tenant_requests_waited,
            api_connections,
            api_connections_closed,
            storage,
            alarms,
            topics,
            gauges,
            call_series: arc_swap::ArcSwap::default(),
            kill_series: arc_swap::ArcSwap::default(),
        }
    }

    /// The coordination loop crashed and is being restarted.
    pub(crate) fn coordination_restart(&self) {
        self.coordination_restarts.inc();
    }

    /// The node fenced for `cause`, giving up a lease that settled
    /// `renewals`.
    pub(crate) fn fenced(&self, cause: &str, renewals: RenewalCounts) {
        self.fences
            .get_or_create(&[("cause", fence_cause(cause))])
            .inc();
        let mut past = lock(&self.renewals_past);
        past.ok += renewals.ok;
        past.failed += renewals.failed;
    }

    /// The arbiter answered from before what the node had seen (`what`:
    /// renewal, term or epoch).
    pub(crate) fn arbiter_regressed(&self, what: &'static str) {
        self.arbiter_regressions
            .get_or_create(&[("what", what.to_owned())])
            .inc();
    }

    /// A key process of `module` started.
    pub(crate) fn activated(&self, module: &str) {
        self.activations
            .get_or_create(&[("module", module.to_owned())])
            .inc();
    }

    /// The counters of `module`'s calls served inline and of those
    /// demoted, for its slot to keep (one atomic add each, no lookup).
    pub(crate) fn inline_calls(&self, module: &str) -> InlineCounters {
        let labels = [("module", module.to_owned())];
        InlineCounters {
            calls: self.inline_calls.get_or_create(&labels).clone(),
            demoted: self.demoted_calls.get_or_create(&labels).clone(),
        }
    }

    /// A key of `module` was evicted (retired idle, its state kept) for
    /// `cause` (`idle`, `module_budget`, `node_budget`).
    pub(crate) fn evicted(&self, module: &str, cause: &'static str) {
        self.evictions
            .get_or_create(&[("module", module.to_owned()), ("cause", cause.to_owned())])
            .inc();
    }

    /// A key of `module` this node evicted lately was activated again.
    pub(crate) fn reactivated(&self, module: &str) {
        self.reactivations
            .get_or_create(&[("module", module.to_owned())])
            .inc();
    }

    /// A key process of `module` ended for `cause` (see [`kill_cause`]).
    ///
    /// A fence ends every key at once: each cause's counter is found once
    /// per module, then with no allocation, hashing of label sets or lock
    /// (these were 1.6 % of the guest threads' time in a fence of 100 000
    /// keys).
    pub(crate) fn killed(&self, module: &str, cause: &'static str) {
        let labels = || [("module", module.to_owned()), ("cause", cause.to_owned())];
        let Some(at) = KILL_CAUSES.iter().position(|c| *c == cause) else {
            self.kills.get_or_create(&labels()).inc();
            return;
        };
        let known = self.kill_series.load();
        let series = match known.get(module) {
            Some(series) => series.clone(),
            None => add_series(&self.kill_series, module, KillSeries::default()),
        };
        series[at]
            .get_or_init(|| self.kills.get_or_create(&labels()).clone())
            .inc();
    }

    /// A call to `module` finished after `elapsed`.
    ///
    /// Called on every call: the module's series are made once and then
    /// found with one lock-free lookup, with no allocation and no shared
    /// reference count touched (building the label sets each time cost more
    /// than the rest of a warm call's bookkeeping; a read lock and an `Arc`
    /// clone per call made the cores calling at once bounce their cache
    /// lines).
    ///
    /// A module's series are made at its first call, and only if
    /// `deployed()` says it is deployed here: a client's made-up module
    /// names (refused as unknown, or forwarded to an owner that could not
    /// be reached) must not add series of their own, without bound.
    pub(crate) fn call_done(
        &self,
        module: &str,
        route: CallRoute,
        ok: bool,
        elapsed: Duration,
        deployed: impl FnOnce() -> bool,
    ) {
        let known = self.call_series.load();
        let made;
        let series = match known.get(module) {
            Some(series) => series,
            None if deployed() => {
                made = self.new_call_series(module);
                &made
            }
            None => return,
        };
        let at = route as usize;
        let counters = if ok { &series.ok } else { &series.error };
        counters[at].inc();
        series.seconds[at].observe(elapsed);
        if route != CallRoute::Routed {
            series.served.add(1);
        }
    }

    /// Make the call series of `module` (the first call's), or take the
    /// ones a concurrent first call made.
    fn new_call_series(&self, module: &str) -> Arc<CallSeries> {
        let routes = [CallRoute::Local, CallRoute::Routed, CallRoute::Peer];
        let counter = |route: CallRoute, outcome: &str| {
            self.calls
                .get_or_create(&[
                    ("module", module.to_owned()),
                    ("route", route.label().to_owned()),
                    ("outcome", outcome.to_owned()),
                ])
                .clone()
        };
        let series = CallSeries {
            ok: routes.map(|r| counter(r, "ok")),
            error: routes.map(|r| counter(r, "error")),
            seconds: routes.map(|r| {
                self.call_seconds
                    .get_or_create(&[("route", r.label().to_owned())])
                    .clone()
            }),
            served: StripedU64::default(),
        };
        add_series(&self.call_series, module, series)
    }

    /// `n` handoff states went through `event` (see the series' help).
    pub(crate) fn handoff_states(&self, event: &'static str, n: usize) {
        if n > 0 {
            self.handoff_states
                .get_or_create(&[("event", event.to_owned())])
                .inc_by(n as u64);
        }
    }

    /// The counters of `module`'s guest log lines dropped and truncated, for
    /// a key's logger to move without a label lookup per line.
    pub(crate) fn guest_log_counters(&self, module: &str) -> (Counter, Counter) {
        let labels = [("module", module.to_owned())];
        (
            self.guest_log_dropped.get_or_create(&labels).clone(),
            self.guest_log_truncated.get_or_create(&labels).clone(),
        )
    }

    /// The counters of `module`'s guest CPU time and time throttled, for a
    /// key's CPU meter to move without a label lookup per callback.
    pub(crate) fn key_cpu_counters(&self, module: &str) -> (SecondsCounter, SecondsCounter) {
        let labels = [("module", module.to_owned())];
        (
            self.key_cpu_seconds.get_or_create(&labels).clone(),
            self.key_throttled_seconds.get_or_create(&labels).clone(),
        )
    }

    /// `tenant`'s counters: its keys' CPU used and throttled, and its
    /// requests that waited for a turn.
    pub(crate) fn tenant_counters(&self, tenant: &str) -> TenantCounters {
        let labels = [("tenant", tenant.to_owned())];
        TenantCounters {
            cpu: self.tenant_cpu_seconds.get_or_create(&labels).clone(),
            throttled: self.tenant_throttled_seconds.get_or_create(&labels).clone(),
            requests_waited: self.tenant_requests_waited.get_or_create(&labels).clone(),
        }
    }

    /// Seconds `module`'s keys have run guest code and been throttled (for
    /// `fief status`).
    pub(crate) fn cpu_seconds(&self, module: &str) -> (f64, f64) {
        let labels = [("module", module.to_owned())];
        (
            self.key_cpu_seconds.get_or_create(&labels).get(),
            self.key_throttled_seconds.get_or_create(&labels).get(),
        )
    }

    /// A module version was made runnable in `elapsed`.
    pub(crate) fn compiled(&self, cached: bool, elapsed: Duration) {
        self.compile_seconds
            .get_or_create(&[("cached", cached.to_string())])
            .observe(elapsed.as_secs_f64());
    }

    /// A stored module version's `option` was lowered to this node's
    /// ceiling when it was loaded.
    pub(crate) fn module_option_lowered(&self, option: &str) {
        self.options_lowered
            .get_or_create(&[("option", option.to_owned())])
            .inc();
    }

    /// An API connection was admitted.
    pub(crate) fn api_connection_opened(&self) {
        self.api_connections.inc();
    }

    /// An admitted API connection closed.
    pub(crate) fn api_connection_ended(&self) {
        self.api_connections.dec();
    }

    /// An API connection was closed at a limit, for `reason` (see the
    /// series' help).
    pub(crate) fn api_connection_limited(&self, reason: &'static str) {
        self.api_connections_closed
            .get_or_create(&[("reason", reason.to_owned())])
            .inc();
    }

    /// The latency histogram's bucket counts so far of the calls this node
    /// served (local and peer routes; a routed call is counted where it
    /// was served), as [`LatencyHistogram::counts`].
    pub(crate) fn served_latency_counts(&self) -> [u64; LATENCY_BUCKETS] {
        let mut total = [0u64; LATENCY_BUCKETS];
        for route in [CallRoute::Local, CallRoute::Peer] {
            if let Some(histogram) = self
                .call_seconds
                .get(&[("route", route.label().to_owned())])
            {
                for (sum, n) in total.iter_mut().zip(histogram.counts()) {
                    *sum += n;
                }
            }
        }
        total
    }

    /// Calls served on this node so far, per module.
    pub(crate) fn served(&self) -> std::collections::BTreeMap<String, u64> {
        let mut served = std::collections::BTreeMap::new();
        for (module, series) in self.call_series.load().iter() {
            served.insert(module.clone(), series.served.get());
        }
        served
    }
}

/// Per-module series, found with one lock-free lookup.
type SeriesMap<S> =
    arc_swap::ArcSwap<std::collections::HashMap<String, Arc<S>, foldhash::fast::RandomState>>;

/// Add `series` as `module`'s in `map`, or take the ones a concurrent first
/// use added.
fn add_series<S>(map: &SeriesMap<S>, module: &str, series: S) -> Arc<S> {
    let series = Arc::new(series);
    let mut kept = series.clone();
    map.rcu(|known| {
        let mut known = std::collections::HashMap::clone(known);
        kept = known
            .entry(module.to_owned())
            .or_insert_with(|| series.clone())
            .clone();
        known
    });
    kept
}

/// A short label for a fence cause (the causes `NodeShared::fence` is given);
/// an unknown cause is kept as it is.
fn fence_cause(cause: &str) -> String {
    let short = if cause.contains("before the fence point") {
        "renewal_timeout"
    } else if cause.contains("expired") {
        "lease_expired"
    } else if cause.contains("coordination") {
        "coordination_crash"
    } else if cause.contains("back in time") {
        "arbiter_regressed"
    } else if cause == "requested" {
        "requested"
    } else {
        return cause.to_owned();
    };
    short.to_owned()
}

/// The `cause` label of a key's end, from the host's kill reason or the
/// guest's death.
pub(crate) fn kill_cause(killed_for: Option<&str>, died_of: Option<&str>) -> &'static str {
    if let Some(reason) = killed_for {
        return if reason.contains("fence") {
            "fence"
        } else if reason.contains("moved") {
            "moved"
        } else if reason.contains("operator") {
            "operator"
        } else if reason.contains("shutting down") || reason.contains("crashed") {
            "shutdown"
        } else {
            "other"
        };
    }
    match died_of {
        Some(why) if why.starts_with("CPU limit") => "cpu_limit",
        Some(why) if why.starts_with("memory limit") => "memory_limit",
        Some(_) => "trap",
        None => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kills_are_counted_by_module_and_cause() {
        let m = Metrics::new();
        for (module, cause) in [
            ("a", "fence"),
            ("a", "fence"),
            ("a", "trap"),
            ("b", "fence"),
            ("a", "a cause not listed"),
        ] {
            m.killed(module, cause);
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &m.registry).expect("encoded");
        for (series, n) in [
            (r#"fief_key_kills_total{module="a",cause="fence"}"#, 2),
            (r#"fief_key_kills_total{module="a",cause="trap"}"#, 1),
            (r#"fief_key_kills_total{module="b",cause="fence"}"#, 1),
            (
                r#"fief_key_kills_total{module="a",cause="a cause not listed"}"#,
                1,
            ),
        ] {
            assert!(
                text.contains(&format!("{series} {n}\n")),
                "{series} {n}:\n{text}"
            );
        }
        // Every cause a key's end is given has its counter found by index.
        for reason in [
            "the node fenced",
            "the partition moved",
            "killed by an operator",
        ] {
            assert!(KILL_CAUSES.contains(&kill_cause(Some(reason), None)));
        }
        for death in ["CPU limit", "memory limit", "a trap"] {
            assert!(KILL_CAUSES.contains(&kill_cause(None, Some(death))));
        }
    }

    #[test]
    fn causes_get_short_labels() {
        assert_eq!(
            fence_cause("the lease could not be renewed before the fence point"),
            "renewal_timeout"
        );
        assert_eq!(
            fence_cause("the arbiter says the lease expired"),
            "lease_expired"
        );
        assert_eq!(
            fence_cause("the coordination loop crashed"),
            "coordination_crash"
        );
        assert_eq!(fence_cause("something new"), "something new");
        assert_eq!(kill_cause(Some("the node is fenced"), None), "fence");
        assert_eq!(
            kill_cause(None, Some("CPU limit exceeded: the callback ran")),
            "cpu_limit"
        );
        assert_eq!(
            kill_cause(None, Some("memory limit exceeded: the key tried")),
            "memory_limit"
        );
        assert_eq!(kill_cause(None, Some("trapped: unreachable")), "trap");
    }
}
