//! The gauges, set at a scrape: [`Readings`], the node's state now as plain
//! values (the node takes them, `node/metrics_page.rs`), and
//! [`Metrics::render`], which sets every gauge from them and encodes the
//! registry as OpenMetrics text.
//!
//! It must not read the node: its readings come in as arguments.

use std::sync::atomic::Ordering;
use std::time::Duration;

use fief_core::RenewalCounts;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::{Labels1, Metrics};
use crate::cache::CacheStats;
use crate::host_bytes::TenantHostBytes;
use crate::sync::lock;

/// The lease states `fief_lease_state` has a series for (1 for the
/// lease's, 0 for the others).
pub(crate) const LEASE_STATES: [&str; 3] = ["pending", "current", "fenced"];

/// What the gauges read at a scrape: the node's state now, as plain values.
/// The node takes them (`node/metrics_page.rs`); this file never reads the
/// node.
pub(crate) struct Readings {
    /// Time left before the fence point, in milliseconds (0 unless the lease
    /// is current).
    pub(crate) lease_remaining_ms: u128,
    /// The configured lease TTL.
    pub(crate) lease_ttl: Duration,
    /// The lease's state, one of [`LEASE_STATES`].
    pub(crate) lease_state: &'static str,
    /// Partitions in the namespace.
    pub(crate) partitions: u32,
    /// Partitions this node owns.
    pub(crate) partitions_owned: usize,
    /// The epoch of the table this node knows.
    pub(crate) epoch: u64,
    /// The leader's term, if this node leads.
    pub(crate) leader_term: Option<u64>,
    /// Live nodes of the namespace, as this node last heard.
    pub(crate) nodes: usize,
    /// Live keys per module.
    pub(crate) live_keys: Vec<(String, usize)>,
    /// Queued messages per module.
    pub(crate) mailbox_depth: Vec<(String, usize)>,
    /// Survivors in limbo.
    pub(crate) limbo: usize,
    /// The cache store's counters.
    pub(crate) cache: CacheStats,
    /// Host memory held for each tenant's keys, with its budget.
    pub(crate) host_bytes: Vec<TenantHostBytes>,
    /// The current lease's renewal counts.
    pub(crate) renewals: RenewalCounts,
}

impl Metrics {
    /// The metrics text: gauges set from `readings`, then every series
    /// encoded.
    pub(crate) fn render(&self, readings: Readings) -> String {
        debug_assert!(
            LEASE_STATES.contains(&readings.lease_state),
            "an unknown lease state {:?}",
            readings.lease_state
        );
        let g = &self.gauges;
        g.lease_remaining
            .set(readings.lease_remaining_ms as f64 / 1000.0);
        g.lease_ttl.set(readings.lease_ttl.as_secs_f64());
        for name in LEASE_STATES {
            g.lease_state
                .get_or_create(&[("state", name.to_owned())])
                .set(i64::from(readings.lease_state == name));
        }
        let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        g.partitions.set(i64::from(readings.partitions));
        g.partitions_owned
            .set(int(readings.partitions_owned as u64));
        g.epoch.set(int(readings.epoch));
        g.leader_term.set(int(readings.leader_term.unwrap_or(0)));
        g.leader.set(i64::from(readings.leader_term.is_some()));
        g.nodes.set(int(readings.nodes as u64));
        // Modules come and go (an undeploy): rebuild the per-module gauges.
        g.live_keys.clear();
        for (module, live) in &readings.live_keys {
            g.live_keys
                .get_or_create(&[("module", module.clone())])
                .set(int(*live as u64));
        }
        g.mailbox_depth.clear();
        for (module, depth) in &readings.mailbox_depth {
            g.mailbox_depth
                .get_or_create(&[("module", module.clone())])
                .set(int(*depth as u64));
        }
        g.limbo.set(int(readings.limbo as u64));
        g.cache_entries.set(int(readings.cache.entries));
        g.cache_bytes.set(int(readings.cache.bytes));
        for tenant in &readings.host_bytes {
            let label = [("tenant", tenant.tenant.clone())];
            g.host_bytes
                .get_or_create(&label)
                .set(int(tenant.bytes as u64));
            g.host_bytes_limit
                .get_or_create(&label)
                .set(int(tenant.limit as u64));
            g.host_bytes_refused
                .get_or_create(&label)
                .inner()
                .store(tenant.refused, Ordering::Relaxed);
        }
        let set_counter =
            |family: &Family<Labels1, Counter>, label: &'static str, v: &str, n: u64| {
                family
                    .get_or_create(&[(label, v.to_owned())])
                    .inner()
                    .store(n, Ordering::Relaxed);
            };
        let cache = &readings.cache;
        for (event, n) in [
            ("hit", cache.hits),
            ("miss", cache.misses),
            ("eviction", cache.evictions),
            ("expiration", cache.expirations),
            ("ownership_drop", cache.ownership_drops),
        ] {
            set_counter(&self.cache, "event", event, n);
        }
        let past = *lock(&self.renewals_past);
        set_counter(
            &self.renewals,
            "outcome",
            "ok",
            past.ok + readings.renewals.ok,
        );
        set_counter(
            &self.renewals,
            "outcome",
            "failed",
            past.failed + readings.renewals.failed,
        );
        let mut text = String::new();
        encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        text
    }
}
