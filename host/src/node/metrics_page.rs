//! `GET /metrics` on the node's side: the readings the gauges are set from,
//! taken from the node's state at scrape time.
//!
//! The counters, histograms and their text are [`crate::metrics`]'s, below
//! the node, moved where things happen. This file owns only what a scrape
//! reads of the node: its [`Status`](super::Status), the mailboxes' depths,
//! limbo and the current lease's renewal counts, put into the
//! [`Readings`] the gauges are set from, so the figures can never drift from
//! what `GET /v1/status` says. It must not keep a figure of its own nor move
//! a counter.

use super::{Instance, LeaseState};
use crate::metrics::Readings;

impl Instance {
    /// The node's metrics as OpenMetrics text (what `GET /metrics` serves):
    /// counters and histograms as they stand, gauges read from the node now.
    pub async fn metrics_text(&self) -> String {
        let shared = self.shared();
        let status = self.status();
        let mailbox_depth = shared
            .slots()
            .iter()
            .map(|slot| (slot.name.to_string(), slot.queued()))
            .collect();
        let readings = Readings {
            lease_remaining_ms: status.lease_remaining_ms,
            lease_ttl: shared.config.lease_ttl,
            lease_state: match status.lease {
                LeaseState::Pending => "pending",
                LeaseState::Current => "current",
                LeaseState::Fenced => "fenced",
            },
            partitions: status.partitions,
            partitions_owned: status.partitions_owned,
            epoch: status.epoch,
            leader_term: status.leader_term,
            nodes: status.nodes.len(),
            live_keys: status
                .modules
                .iter()
                .map(|module| (module.name.clone(), module.live_keys))
                .collect(),
            mailbox_depth,
            limbo: self.limbo().await.len(),
            cache: status.cache,
            host_bytes: status.host_bytes,
            renewals: shared.renewal_counts(),
        };
        shared.metrics.render(readings)
    }
}
