//! The alarm series of a node's metrics (`docs/alarms.md`): alarms pending,
//! fired, their lateness, and what became of each firing.
//!
//! This file owns the series and their names; the node's alarm loop
//! (`node/alarms.rs`) moves them. It must not read the schedule itself.

use fief_core::alarm::FireOutcome;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The alarm series.
#[derive(Clone)]
pub(crate) struct AlarmMetrics {
    pending: Gauge,
    fired: Counter,
    lateness: Histogram,
    outcomes: Family<[(&'static str, &'static str); 1], Counter>,
}

impl AlarmMetrics {
    /// Fresh series, registered in `registry`.
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let metrics = AlarmMetrics {
            pending: Gauge::default(),
            fired: Counter::default(),
            // 1 ms doubling to about 4.6 hours.
            lateness: Histogram::new(exponential_buckets(0.001, 2.0, 24)),
            outcomes: Family::default(),
        };
        registry.register(
            "alarms_pending",
            "Durable alarms of the partitions this node serves: waiting, retrying or in flight",
            metrics.pending.clone(),
        );
        registry.register(
            "alarms_fired",
            "Alarm firings delivered to their keys (retries included)",
            metrics.fired.clone(),
        );
        registry.register(
            "alarm_lateness_seconds",
            "How late an alarm fired: the firing node's wall clock minus the alarm's time, at delivery",
            metrics.lateness.clone(),
        );
        registry.register(
            "alarm_outcomes",
            "What became of alarm firings: committed (handled, deleted), trapped and commit_refused (retried with backoff), not_run (not delivered: retried), superseded (the key's own state disagreed)",
            metrics.outcomes.clone(),
        );
        metrics
    }

    /// An alarm was delivered `late_ms` after its time.
    pub(crate) fn fired(&self, late_ms: u64) {
        self.fired.inc();
        self.lateness.observe(late_ms as f64 / 1000.0);
    }

    /// A firing ended with `outcome`.
    pub(crate) fn outcome(&self, outcome: &FireOutcome) {
        let label = match outcome {
            FireOutcome::Committed => "committed",
            FireOutcome::Trapped => "trapped",
            FireOutcome::CommitRefused => "commit_refused",
            FireOutcome::NotRun => "not_run",
            FireOutcome::Superseded { .. } => "superseded",
        };
        self.outcomes.get_or_create(&[("outcome", label)]).inc();
    }

    /// The schedule holds `n` alarms.
    pub(crate) fn set_pending(&self, n: usize) {
        self.pending.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}
