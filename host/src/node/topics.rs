//! Cluster-wide pub/sub over the peer links: the node's side of
//! [`crate::pubsub`].
//!
//! The *topics loop* keeps pub/sub's peers equal to the other current
//! members (none while this node is not current: a fenced node forgets what
//! its peers advertised, drops what it queued for them, and sends nothing),
//! and runs one *feed* per peer. A feed opens the link (its hello says the
//! node speaks cluster-wide pub/sub), and once the peer's own hello said so
//! too, sends, one request at a time so they arrive in order: interest
//! updates owed first, then queued publications in batches, and an empty
//! update as a heartbeat every [`HEARTBEAT`] (which finds a peer that
//! forgot this node's interest). A peer whose hello did not say so (an
//! older version) is sent nothing.
//!
//! Receiving: an interest update is applied to the sender's link (see
//! `pubsub/interest.rs`); a batch of publications is delivered to this
//! node's subscribers in order, only while this node is current, and never
//! forwarded again.
//!
//! This file decides when and to whom; what is owed and queued is
//! pub/sub's. It must not deliver to a key itself or route anything.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::Notify;

use super::{AbortOnDrop, NodeShared};
use crate::error::{Error, Result};
use crate::metrics::Dropped;
use crate::wire::{FEATURE_TOPICS, InterestAck, InterestUpdate, PeerRequest, Publication};

/// How often the loop looks at the membership and the lease.
const RECONCILE: Duration = Duration::from_millis(200);
/// How often a feed sends a heartbeat when it has nothing else to send.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// How long a feed waits before trying a link that failed again.
const RETRY: Duration = Duration::from_millis(250);

/// Run the topics loop until the node stops.
pub(super) async fn run(node: Weak<NodeShared>) {
    let mut feeds: HashMap<String, (String, AbortOnDrop)> = HashMap::new();
    loop {
        let Some(shared) = node.upgrade() else { return };
        let peers = if shared.may_act() {
            shared.peer_members()
        } else {
            Vec::new()
        };
        let names: Vec<String> = peers.iter().map(|(name, _)| name.clone()).collect();
        let wakes: HashMap<String, Arc<Notify>> =
            shared.pubsub.set_peers(&names).into_iter().collect();
        drop(shared);
        feeds.retain(|name, (addr, _)| peers.iter().any(|(n, a)| n == name && a == addr));
        for (name, addr) in peers {
            if feeds.contains_key(&name) {
                continue;
            }
            let wake = wakes.get(&name).cloned().unwrap_or_default();
            let task = tokio::spawn(feed(node.clone(), name.clone(), addr.clone(), wake));
            feeds.insert(name, (addr, AbortOnDrop(task)));
        }
        tokio::time::sleep(RECONCILE).await;
    }
}

/// Feed the link to the peer `peer` at `addr` until aborted.
async fn feed(node: Weak<NodeShared>, peer: String, addr: String, wake: Arc<Notify>) {
    let mut last_interest = tokio::time::Instant::now();
    loop {
        let Some(shared) = node.upgrade() else { return };
        if let Err(error) = shared.peers.connect(&addr).await {
            tracing::debug!(%peer, %error, "pub/sub: no link to the peer yet");
            drop(shared);
            tokio::time::sleep(RETRY).await;
            continue;
        }
        if !shared.peers.speaks(&peer, FEATURE_TOPICS) {
            drop(shared);
            let _ = tokio::time::timeout(RETRY, wake.notified()).await;
            continue;
        }
        let max = shared.config.max_message_size.as_u64() as usize;
        let heartbeat = last_interest.elapsed() >= HEARTBEAT;
        if let Some(update) = shared.pubsub.next_interest(&peer, max, heartbeat) {
            last_interest = tokio::time::Instant::now();
            if !shared.send_interest(&peer, &addr, update).await {
                shared.pubsub.resync(&peer);
                drop(shared);
                tokio::time::sleep(RETRY).await;
            }
            continue;
        }
        let batch = shared.pubsub.next_publications(&peer, max);
        if !batch.is_empty() {
            shared.send_publications(&peer, &addr, batch).await;
            continue;
        }
        let has_work = shared.pubsub.has_work(&peer);
        drop(shared);
        if !has_work {
            let until_beat = HEARTBEAT.saturating_sub(last_interest.elapsed());
            let _ = tokio::time::timeout(until_beat, wake.notified()).await;
        }
    }
}

impl NodeShared {
    /// Every other member with a peer address, by name.
    fn peer_members(&self) -> Vec<(String, String)> {
        self.members
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|(id, _)| **id != self.node_id)
            .filter_map(|(id, m)| Some((id.to_string(), m.peer_addr.clone()?)))
            .collect()
    }

    /// Send `update` to `peer`; whether it applied it.
    async fn send_interest(&self, peer: &str, addr: &str, update: InterestUpdate) -> bool {
        let request = PeerRequest::Interest(update);
        match self
            .peers
            .request(addr, request, self.config.call_timeout)
            .await
        {
            Ok(body) => matches!(postcard::from_bytes(&body), Ok(InterestAck::Applied)),
            Err(error) => {
                tracing::debug!(%peer, %error, "pub/sub: an interest update was not applied");
                false
            }
        }
    }

    /// Send `batch` to `peer`; a failure loses it (best effort: never sent
    /// twice, so never delivered twice).
    async fn send_publications(&self, peer: &str, addr: &str, batch: Vec<Publication>) {
        let n = batch.len();
        let request = PeerRequest::Publish {
            publications: batch,
        };
        match self
            .peers
            .request(addr, request, self.config.call_timeout)
            .await
        {
            Ok(_) => {}
            Err(Error::Remote { code, .. }) if code == "fenced" => {
                self.metrics.topics().dropped(Dropped::Fenced, n);
            }
            Err(error) => {
                tracing::debug!(%peer, %error, n, "pub/sub: forwarded publications were lost");
                self.metrics.topics().dropped(Dropped::Link, n);
            }
        }
    }

    /// Serve a peer's interest update.
    pub(super) fn serve_interest(&self, update: InterestUpdate) -> Result<Vec<u8>> {
        let ack = if self.may_act() {
            let from = update.node.clone();
            self.pubsub.apply_interest(&from, update)
        } else {
            InterestAck::Resync
        };
        postcard::to_stdvec(&ack).map_err(|e| Error::Internal(format!("encoding an ack: {e}")))
    }

    /// Serve a peer's batch of publications: deliver each to this node's
    /// subscribers, in order, only while this node is current.
    pub(super) fn serve_publications(&self, publications: Vec<Publication>) -> Result<Vec<u8>> {
        if !self.may_act() {
            return Err(Error::Fenced);
        }
        self.metrics.topics().received(publications.len());
        for publication in publications {
            self.pubsub
                .deliver(&publication.topic, &publication.payload);
        }
        Ok(Vec::new())
    }
}
