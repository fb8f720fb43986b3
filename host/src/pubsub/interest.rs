//! Cluster-wide pub/sub bookkeeping, one entry per peer: what the peer
//! advertised of its subscribers, what this node still owes it of its own
//! interest, and the publications waiting to be forwarded to it.
//!
//! Interest is a count of subscriber processes per topic. A node sends each
//! peer the changes of its counts as numbered updates of a *stream*
//! ([`InterestUpdate`]); a receiver applies an update only if it is the next
//! of the stream it holds, or if it starts one (`reset`, followed by the
//! sender's whole interest). Anything else — a lost or reordered update, a
//! receiver that restarted, or fenced and forgot — is answered
//! [`InterestAck::Resync`], and the sender starts a new stream with its
//! whole interest. A heartbeat (an empty update) finds a receiver that
//! forgot even when nothing changes. So a peer's view of this node's
//! interest converges to the truth, whatever the link lost.
//!
//! This module is pure: no I/O, no clock, no locks. [`super::PubSub`] holds
//! it under its lock; `node/topics.rs` moves what it decides over the peer
//! links and decides when (heartbeats, membership, the fence).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::host_bytes::Held;
use crate::wire::{InterestAck, InterestUpdate, Publication};

/// Most publications waiting to be forwarded to one peer.
pub const MAX_QUEUED_PUBLICATIONS: usize = 8192;
/// Most bytes of publications (topics and payloads) waiting to be
/// forwarded to one peer.
pub const MAX_QUEUED_BYTES: usize = 64 << 20;
/// Most topics a peer may advertise; past it, its new topics are ignored
/// (it is not sent their publications).
pub const MAX_ADVERTISED_TOPICS: usize = 1 << 20;

/// A publication on its way to one peer. Its payload and its charge to the
/// publishing key's host bytes are shared by every peer it goes to.
struct Forward {
    topic: Arc<str>,
    payload: Arc<[u8]>,
    _held: Arc<Held>,
}

/// What one peer advertised: the stream it is on and its counts.
#[derive(Default)]
struct Advertised {
    /// The stream and the next update expected of it; `None` until a
    /// stream starts.
    stream: Option<(u64, u64)>,
    counts: HashMap<String, u32>,
}

/// What this node owes one peer of its own interest.
#[derive(Default)]
struct Owed {
    /// The stream being sent and its next update's number; `None`: a new
    /// stream (with the whole interest) is owed.
    stream: Option<(u64, u64)>,
    /// The rest of a stream's opening snapshot, still to be sent.
    snapshot: VecDeque<(String, u32)>,
    /// Counts changed since the last update sent.
    changes: HashMap<String, u32>,
}

/// One peer, as cluster-wide pub/sub sees it.
#[derive(Default)]
pub(crate) struct Peer {
    advertised: Advertised,
    owed: Owed,
    queue: VecDeque<Forward>,
    queued_bytes: usize,
}

/// What [`Peer::enqueue`] did with a publication.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Enqueued {
    /// Queued for the peer, whose subscribers number this many.
    Queued(u32),
    /// The peer advertised no subscriber of the topic.
    NotInterested,
    /// The peer's queue is full: dropped.
    Full,
}

impl Peer {
    /// How many subscribers of `topic` the peer advertised.
    pub(crate) fn subscribers(&self, topic: &str) -> u32 {
        self.advertised.counts.get(topic).copied().unwrap_or(0)
    }

    /// How many topics the peer advertised subscribers for.
    pub(crate) fn topic_count(&self) -> usize {
        self.advertised.counts.len()
    }

    /// Apply an update the peer sent.
    pub(crate) fn apply(&mut self, update: InterestUpdate) -> InterestAck {
        let next = match self.advertised.stream {
            _ if update.reset && update.seq == 0 => {
                self.advertised.counts.clear();
                (update.stream, 1)
            }
            Some((stream, seq)) if stream == update.stream && seq == update.seq => {
                (stream, seq + 1)
            }
            _ => return InterestAck::Resync,
        };
        self.advertised.stream = Some(next);
        let counts = &mut self.advertised.counts;
        for (topic, count) in update.counts {
            if count == 0 {
                counts.remove(&topic);
            } else if counts.len() < MAX_ADVERTISED_TOPICS || counts.contains_key(&topic) {
                counts.insert(topic, count);
            }
        }
        InterestAck::Applied
    }

    /// This node's count of `topic` changed to `count`: owe it to the peer.
    pub(crate) fn changed(&mut self, topic: &str, count: u32) {
        if self.owed.stream.is_some() {
            self.owed.changes.insert(topic.to_owned(), count);
        }
    }

    /// Whether a new stream is owed (the caller then calls
    /// [`start_stream`](Self::start_stream) with the whole interest).
    pub(crate) fn needs_stream(&self) -> bool {
        self.owed.stream.is_none()
    }

    /// Start stream `stream` with this node's whole interest, `counts`.
    pub(crate) fn start_stream(&mut self, stream: u64, counts: Vec<(String, u32)>) {
        self.owed = Owed {
            stream: Some((stream, 0)),
            snapshot: counts.into(),
            changes: HashMap::new(),
        };
    }

    /// The next update to send, with at most about `max_bytes` of topics:
    /// the rest of the stream's snapshot, else the changes; an empty one if
    /// `heartbeat`; `None` if there is nothing to send (or a stream is owed
    /// first).
    pub(crate) fn next_update(
        &mut self,
        max_bytes: usize,
        heartbeat: bool,
    ) -> Option<InterestUpdate> {
        let (stream, seq) = self.owed.stream?;
        let mut counts = Vec::new();
        let mut bytes = 0;
        let from_snapshot = !self.owed.snapshot.is_empty();
        while bytes < max_bytes {
            let next = if from_snapshot {
                self.owed.snapshot.pop_front()
            } else {
                let topic = self.owed.changes.keys().next().cloned();
                topic.and_then(|t| self.owed.changes.remove_entry(&t))
            };
            let Some((topic, count)) = next else { break };
            bytes += topic.len() + 8;
            counts.push((topic, count));
        }
        if counts.is_empty() && !heartbeat && seq > 0 {
            return None;
        }
        self.owed.stream = Some((stream, seq + 1));
        Some(InterestUpdate {
            node: String::new(),
            stream,
            seq,
            reset: seq == 0,
            counts,
        })
    }

    /// The peer did not apply an update (it answered
    /// [`InterestAck::Resync`], or the update may not have arrived): owe a
    /// new stream.
    pub(crate) fn resync(&mut self) {
        self.owed = Owed::default();
    }

    /// Queue a publication of `topic` for the peer if it has subscribers.
    pub(crate) fn enqueue(
        &mut self,
        topic: &Arc<str>,
        payload: &Arc<[u8]>,
        held: &Arc<Held>,
    ) -> Enqueued {
        let subscribers = self.subscribers(topic);
        if subscribers == 0 {
            return Enqueued::NotInterested;
        }
        let bytes = topic.len() + payload.len();
        if self.queue.len() >= MAX_QUEUED_PUBLICATIONS
            || self.queued_bytes + bytes > MAX_QUEUED_BYTES
        {
            return Enqueued::Full;
        }
        self.queued_bytes += bytes;
        self.queue.push_back(Forward {
            topic: topic.clone(),
            payload: payload.clone(),
            _held: held.clone(),
        });
        Enqueued::Queued(subscribers)
    }

    /// The publications to send next, in their order, with at most about
    /// `max_bytes` of topics and payloads (at least one, if any waits).
    pub(crate) fn next_publications(&mut self, max_bytes: usize) -> Vec<Publication> {
        let mut batch = Vec::new();
        let mut bytes = 0;
        while let Some(next) = self.queue.front() {
            let size = next.topic.len() + next.payload.len();
            if !batch.is_empty() && bytes + size > max_bytes {
                break;
            }
            bytes += size;
            self.queued_bytes -= size;
            let next = self.queue.pop_front().expect("a front");
            batch.push(Publication {
                topic: next.topic.to_string(),
                payload: next.payload.to_vec(),
            });
        }
        batch
    }

    /// Whether anything waits to be sent to the peer (an update or a
    /// publication), a heartbeat aside.
    pub(crate) fn has_work(&self) -> bool {
        self.owed.stream.is_none_or(|(_, seq)| seq == 0)
            || !self.owed.snapshot.is_empty()
            || !self.owed.changes.is_empty()
            || !self.queue.is_empty()
    }

    /// Publications waiting for the peer.
    pub(crate) fn queued(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(update: &InterestUpdate) -> Vec<(String, u32)> {
        let mut counts = update.counts.clone();
        counts.sort();
        counts
    }

    fn topic(name: &str) -> Arc<str> {
        Arc::from(name)
    }

    /// A sender and a receiver, as two nodes hold them, passing every
    /// update the sender produces through `link` (which may lose it).
    fn pump(sender: &mut Peer, receiver: &mut Peer, mut link: impl FnMut(u64) -> bool) {
        let mut n = 0;
        loop {
            if sender.needs_stream() {
                sender.start_stream(7 + n, vec![("a".into(), 1), ("b".into(), 2)]);
            }
            let Some(update) = sender.next_update(64, false) else {
                return;
            };
            n += 1;
            if !link(n) || receiver.apply(update) == InterestAck::Resync {
                sender.resync();
            }
            assert!(n < 100, "no convergence");
        }
    }

    #[test]
    fn a_stream_opens_with_the_whole_interest_and_then_carries_changes() {
        let (mut sender, mut receiver) = (Peer::default(), Peer::default());
        assert!(sender.needs_stream());
        sender.changed("lost", 9); // owed nothing yet: the snapshot will say it
        sender.start_stream(1, vec![("a".into(), 1), ("b".into(), 2)]);
        let first = sender.next_update(1024, false).unwrap();
        assert!(first.reset);
        assert_eq!(counts(&first), vec![("a".into(), 1), ("b".into(), 2)]);
        assert_eq!(receiver.apply(first), InterestAck::Applied);
        assert_eq!(sender.next_update(1024, false), None, "nothing changed");
        sender.changed("a", 0);
        sender.changed("c", 3);
        let next = sender.next_update(1024, false).unwrap();
        assert_eq!((next.seq, next.reset), (1, false));
        assert_eq!(receiver.apply(next), InterestAck::Applied);
        assert_eq!(
            (
                receiver.subscribers("a"),
                receiver.subscribers("b"),
                receiver.subscribers("c")
            ),
            (0, 2, 3)
        );
        let beat = sender.next_update(1024, true).unwrap();
        assert!(beat.counts.is_empty());
        assert_eq!(receiver.apply(beat), InterestAck::Applied);
    }

    #[test]
    fn a_lost_or_reordered_update_is_refused_and_a_new_stream_repairs_it() {
        let (mut sender, mut receiver) = (Peer::default(), Peer::default());
        sender.start_stream(1, vec![("a".into(), 1)]);
        receiver.apply(sender.next_update(1024, false).unwrap());
        sender.changed("b", 1);
        let _lost = sender.next_update(1024, false).unwrap();
        sender.changed("c", 1);
        let after = sender.next_update(1024, false).unwrap();
        assert_eq!(receiver.apply(after.clone()), InterestAck::Resync);
        assert_eq!(receiver.subscribers("c"), 0, "not applied out of order");
        // A replay of an old stream's update is refused too.
        sender.resync();
        sender.start_stream(2, vec![("a".into(), 1), ("b".into(), 1), ("c".into(), 1)]);
        assert_eq!(
            receiver.apply(sender.next_update(1024, false).unwrap()),
            InterestAck::Applied
        );
        assert_eq!(receiver.apply(after), InterestAck::Resync);
        assert_eq!(receiver.topic_count(), 3);
    }

    #[test]
    fn a_snapshot_larger_than_one_update_goes_in_order_and_converges_through_losses() {
        let (mut sender, mut receiver) = (Peer::default(), Peer::default());
        // Every third update lost: each loss costs a new stream, and the
        // receiver still ends with exactly the sender's interest.
        pump(&mut sender, &mut receiver, |n| n % 3 != 0);
        assert_eq!(
            (receiver.subscribers("a"), receiver.subscribers("b")),
            (1, 2)
        );
        let mut forgetful = Peer::default(); // a receiver that restarted
        sender.changed("b", 0);
        let update = sender.next_update(64, false).unwrap();
        assert_eq!(forgetful.apply(update), InterestAck::Resync);
    }

    #[test]
    fn publications_queue_only_for_interested_peers_in_order_and_bounded() {
        let mut peer = Peer::default();
        peer.apply(InterestUpdate {
            node: "n1".into(),
            stream: 1,
            seq: 0,
            reset: true,
            counts: vec![("t".into(), 4)],
        });
        let held = Arc::new(Held::none());
        let payload: Arc<[u8]> = Arc::from(vec![0u8; 1000]);
        assert_eq!(
            peer.enqueue(&topic("u"), &payload, &held),
            Enqueued::NotInterested
        );
        for _ in 0..3 {
            assert_eq!(
                peer.enqueue(&topic("t"), &payload, &held),
                Enqueued::Queued(4)
            );
        }
        let batch = peer.next_publications(1500);
        assert_eq!(batch.len(), 1, "a batch stays under its size but holds one");
        assert_eq!(peer.next_publications(1 << 20).len(), 2);
        let big: Arc<[u8]> = Arc::from(vec![0u8; MAX_QUEUED_BYTES / 2]);
        assert_eq!(peer.enqueue(&topic("t"), &big, &held), Enqueued::Queued(4));
        assert_eq!(peer.enqueue(&topic("t"), &big, &held), Enqueued::Full);
        assert_eq!(peer.queued(), 1);
    }
}
