//! The dashboard's plots: each node's last minutes of figures.
//!
//! Every node samples itself once a [`SAMPLE_EVERY`] (a task started with
//! the node, [`run`]) into a [`History`], a ring buffer of the last
//! [`HISTORY_SAMPLES`] samples (five minutes). A sample holds, for the
//! second before it:
//!
//! - the calls the node served (all modules; local and peer routes, so a
//!   call routed on is counted once, where it ran);
//! - their p99 latency, read from the differences of the call latency
//!   histogram's buckets (`metrics/striped.rs`, 100 µs doubling): the
//!   *upper bound of the bucket* holding the 99th-percentile call, so it is
//!   exact to within a factor of two and never under the true value; `None`
//!   in a second without calls;
//! - the node's live keys and its fences so far, as read at the sample.
//!
//! The node serving the dashboard asks each live peer that announced
//! [`FEATURE_HISTORY`](crate::wire::FEATURE_HISTORY) for its buffer over the
//! peer link ([`PeerRequest::History`](crate::wire::PeerRequest::History),
//! answered from the buffer without waiting on anything), with a short
//! timeout; a peer that does not answer is shown as *no data*.
//!
//! This module owns the buffer's arithmetic; it must not decide anything
//! about ownership, and it reads no clock itself (the sampler passes the
//! time in). The figures are node-wide, across tenants, so only an admin's
//! (or an open node's) dashboard view carries them (`dashboard.rs`).

use std::collections::VecDeque;
use std::sync::Weak;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::metrics::{LATENCY_BUCKETS, LatencyHistogram};
use crate::node::NodeShared;
use crate::sync::lock;
use crate::wire::WireSample;

/// How often a node samples itself.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// Samples a node keeps (and at most sends a peer): five minutes' worth.
pub const HISTORY_SAMPLES: usize = 300;

/// What the sampler reads from the node, cumulative where it says so.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reading {
    /// Wall-clock time of the reading, in Unix milliseconds.
    pub(crate) at_ms: u64,
    /// Calls served so far (cumulative).
    pub(crate) served: u64,
    /// The served calls' latency bucket counts so far (cumulative).
    pub(crate) latency: [u64; LATENCY_BUCKETS],
    /// Live keys now.
    pub(crate) live_keys: u64,
    /// Fences so far.
    pub(crate) fences: u64,
}

/// The last samples of one node, oldest first, at most `capacity`.
#[derive(Debug)]
pub(crate) struct History {
    samples: VecDeque<WireSample>,
    capacity: usize,
    /// The previous reading's cumulative counts, the baseline of the next
    /// sample's differences.
    last: Option<(u64, [u64; LATENCY_BUCKETS])>,
}

impl History {
    /// An empty history keeping at most `capacity` samples.
    pub(crate) fn new(capacity: usize) -> Self {
        History {
            samples: VecDeque::with_capacity(capacity),
            capacity,
            last: None,
        }
    }

    /// Record a reading. The first one only sets the baseline; each next
    /// one adds a sample of what changed since, dropping the oldest sample
    /// when full.
    pub(crate) fn record(&mut self, reading: Reading) {
        let Some((served, latency)) = self.last.replace((reading.served, reading.latency)) else {
            return;
        };
        let calls = reading.served.saturating_sub(served);
        let diff: [u64; LATENCY_BUCKETS] =
            std::array::from_fn(|i| reading.latency[i].saturating_sub(latency[i]));
        if self.samples.len() == self.capacity {
            self.samples.pop_front();
        }
        if self.capacity > 0 {
            self.samples.push_back(WireSample {
                at_ms: reading.at_ms,
                calls,
                p99_us: p99_us(&diff),
                live_keys: reading.live_keys,
                fences: reading.fences,
            });
        }
    }

    /// The samples, oldest first.
    pub(crate) fn samples(&self) -> Vec<WireSample> {
        self.samples.iter().copied().collect()
    }
}

/// The upper bound, in microseconds, of the latency bucket holding the
/// 99th-percentile observation of `counts` (each bucket's own count, +Inf
/// last; an observation in +Inf reads as twice the last finite bound), or
/// `None` if there are none.
pub(crate) fn p99_us(counts: &[u64; LATENCY_BUCKETS]) -> Option<u64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    // The rank (from 1) of the 99th-percentile observation.
    let rank = (total * 99).div_ceil(100);
    let mut seen = 0;
    for (i, n) in counts.iter().enumerate() {
        seen += n;
        if seen >= rank {
            return Some(LatencyHistogram::bound_us(i).unwrap_or_else(|| {
                LatencyHistogram::bound_us(LATENCY_BUCKETS - 2).unwrap_or(0) * 2
            }));
        }
    }
    None
}

/// One second of a node's figures, as the dashboard's view shows it.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Sample {
    /// When the sample was taken, in Unix milliseconds (the sampling
    /// node's clock).
    pub at_ms: u64,
    /// Calls the node served in the second before (all modules).
    pub calls: u64,
    /// Their p99 latency in milliseconds: the upper bound of the latency
    /// histogram bucket (100 µs doubling) holding the 99th-percentile call;
    /// `null` in a second without calls.
    pub p99_ms: Option<f64>,
    /// The node's live keys at the sample.
    pub live_keys: u64,
    /// The node's fences so far at the sample.
    pub fences: u64,
}

impl From<WireSample> for Sample {
    fn from(s: WireSample) -> Self {
        Sample {
            at_ms: s.at_ms,
            calls: s.calls,
            p99_ms: s.p99_us.map(|us| us as f64 / 1000.0),
            live_keys: s.live_keys,
            fences: s.fences,
        }
    }
}

/// One node's history in a dashboard view.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct NodeHistory {
    /// The node.
    pub node: String,
    /// Its samples, oldest first (at most [`HISTORY_SAMPLES`]); `null` if
    /// the node did not answer in time or does not keep a history (an
    /// older version): the page shows *no data*.
    pub samples: Option<Vec<Sample>>,
}

/// Sample the node every [`SAMPLE_EVERY`] until it is dropped.
pub(crate) async fn run(node: Weak<NodeShared>) {
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(shared) = node.upgrade() else { return };
        let at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let reading = shared.dashboard_reading(at_ms);
        lock(&shared.history).record(reading);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(at_ms: u64, served: u64, latency: [u64; LATENCY_BUCKETS]) -> Reading {
        Reading {
            at_ms,
            served,
            latency,
            live_keys: at_ms / 1000,
            fences: 0,
        }
    }

    #[test]
    fn the_first_reading_is_only_a_baseline_then_each_adds_the_difference() {
        let mut h = History::new(4);
        let mut latency = [0; LATENCY_BUCKETS];
        latency[0] = 10;
        h.record(reading(1000, 10, latency));
        assert!(h.samples().is_empty());
        latency[0] = 12;
        latency[3] = 1;
        h.record(reading(2000, 13, latency));
        let s = h.samples();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].calls, 3);
        assert_eq!(s[0].live_keys, 2);
        // 3 calls this second: the 99th percentile is the slowest, in
        // bucket 3 (≤ 800 µs).
        assert_eq!(s[0].p99_us, Some(800));
        // A quiet second: no calls, no latency.
        h.record(reading(3000, 13, latency));
        assert_eq!(h.samples()[1].calls, 0);
        assert_eq!(h.samples()[1].p99_us, None);
    }

    #[test]
    fn the_ring_keeps_only_the_newest_samples() {
        let mut h = History::new(3);
        for i in 0..10u64 {
            h.record(reading(i * 1000, i * 2, [0; LATENCY_BUCKETS]));
        }
        let at: Vec<u64> = h.samples().iter().map(|s| s.at_ms).collect();
        assert_eq!(at, vec![7000, 8000, 9000]);
        assert!(h.samples().iter().all(|s| s.calls == 2));
        let mut none = History::new(0);
        none.record(reading(0, 0, [0; LATENCY_BUCKETS]));
        none.record(reading(1000, 5, [0; LATENCY_BUCKETS]));
        assert!(none.samples().is_empty());
    }

    #[test]
    fn p99_is_the_upper_bound_of_the_bucket_of_the_99th_percentile_call() {
        let mut counts = [0; LATENCY_BUCKETS];
        assert_eq!(p99_us(&counts), None);
        counts[0] = 99;
        counts[5] = 1;
        // 100 calls: the 99th is still in bucket 0.
        assert_eq!(p99_us(&counts), Some(100));
        counts[5] = 2;
        // 101 calls: rank 100 is in bucket 5 (≤ 3.2 ms).
        assert_eq!(p99_us(&counts), Some(3200));
        let mut slow = [0; LATENCY_BUCKETS];
        slow[LATENCY_BUCKETS - 1] = 1;
        assert_eq!(p99_us(&slow), Some((100u64 << 17) * 2));
        // A counter that went backwards (it cannot, but) gives no sample
        // of negative calls.
        let mut h = History::new(2);
        h.record(reading(0, 5, [0; LATENCY_BUCKETS]));
        h.record(reading(1000, 3, [0; LATENCY_BUCKETS]));
        assert_eq!(h.samples()[0].calls, 0);
    }
}
