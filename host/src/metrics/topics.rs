//! The cluster-wide pub/sub series of a node's metrics (`docs/realtime.md`):
//! publications forwarded to peers, received from them, and dropped on the
//! way, by reason.
//!
//! This file owns the series and their names; the publish import and the
//! peer feeds (`node/topics.rs`) move them. It must not read pub/sub.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// The cluster-wide pub/sub series.
#[derive(Clone)]
pub(crate) struct TopicMetrics {
    forwarded: Counter,
    received: Counter,
    dropped: Family<[(&'static str, &'static str); 1], Counter>,
}

impl TopicMetrics {
    /// Fresh series, registered in `registry`.
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let metrics = TopicMetrics {
            forwarded: Counter::default(),
            received: Counter::default(),
            dropped: Family::default(),
        };
        registry.register(
            "publications_forwarded",
            "Publications queued for a peer with subscribers (one per peer)",
            metrics.forwarded.clone(),
        );
        registry.register(
            "publications_received",
            "Publications a peer forwarded here for this node's subscribers",
            metrics.received.clone(),
        );
        registry.register(
            "publications_dropped",
            "Publications a peer with subscribers missed, by reason: queue_full (its queue, or the publisher's host bytes), link (the forward failed), fenced (the receiver was not current)",
            metrics.dropped.clone(),
        );
        metrics
    }

    /// A publication made here was queued for `forwarded` peers and
    /// missed `dropped` peers with subscribers (their queues were full).
    pub(crate) fn published(&self, forwarded: u32, dropped: u32) {
        self.forwarded.inc_by(u64::from(forwarded));
        if dropped > 0 {
            self.dropped(Dropped::QueueFull, dropped as usize);
        }
    }

    /// `n` publications were received from a peer.
    pub(crate) fn received(&self, n: usize) {
        self.received.inc_by(n as u64);
    }

    /// `n` publications were dropped on the way to a peer.
    pub(crate) fn dropped(&self, why: Dropped, n: usize) {
        let label = match why {
            Dropped::QueueFull => "queue_full",
            Dropped::Link => "link",
            Dropped::Fenced => "fenced",
        };
        self.dropped
            .get_or_create(&[("reason", label)])
            .inc_by(n as u64);
    }
}

/// Why publications missed a peer.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Dropped {
    /// The peer's queue was full, or the publisher's host bytes were.
    QueueFull,
    /// The forward failed or went unanswered.
    Link,
    /// The receiving node was not current and refused them.
    Fenced,
}
