//! Pub/sub: topics, their subscribers on this node, and the cluster-wide
//! part — which topics each peer has subscribers for, and the
//! publications waiting to be forwarded to it.
//!
//! A key subscribes through `host.subscribe`; a publication is put in each
//! subscriber's mailbox as a `published` info. A subscription belongs to one
//! key *process* (module, key, generation): it is removed when that process's
//! store is dropped, so a dead process never receives anything.
//!
//! Cluster-wide: each node tells its peers how many subscriber processes it
//! has per topic ([`interest`]), and a publication is delivered here and
//! queued once for each peer that advertised subscribers of its topic; the
//! peer delivers it to its own subscribers and never forwards it again. So
//! each subscriber process gets a publication at most once.
//!
//! Delivery is best effort, like every Fief message (guarantee 4): a
//! subscriber whose mailbox is full, or who holds its whole host-memory
//! budget ([`crate::host_bytes`]), misses the publication, as does a peer
//! whose queue is full or whose link fails, and a subscription takes effect
//! on other nodes once its interest reached them (milliseconds). The
//! publisher's count is the subscribers here that got it plus, for each
//! peer it was queued for, the subscribers that peer last advertised.
//!
//! This module must not do I/O: `node/topics.rs` moves the interest updates
//! and the queued publications over the peer links, and tells this table
//! which peers there are.

mod interest;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::bindings::types::{Info, Publication};
use crate::host_bytes::Ledger;
use crate::key::Envelope;
use crate::mailbox::WeakMailbox;
use crate::sync::lock;
use crate::wire::{InterestAck, InterestUpdate};

use interest::{Enqueued, Peer};

/// Longest topic name, in bytes.
pub const MAX_TOPIC_BYTES: usize = 256;

#[derive(Clone, PartialEq, Eq, Hash)]
struct Subscriber {
    module: Arc<str>,
    key: Arc<str>,
    generation: u64,
}

/// The subscribers of each topic on this node.
type Topics = HashMap<String, HashMap<Subscriber, WeakMailbox>>;

/// One peer's cluster-wide pub/sub state, and the signal that wakes the
/// task feeding its link.
struct Link {
    peer: Peer,
    wake: Arc<tokio::sync::Notify>,
}

/// The topics of one node, and what it knows of its peers' topics.
pub(crate) struct PubSub {
    topics: Mutex<Topics>,
    /// The current members' links, by node name. Taken after `topics`
    /// when both are held.
    links: Mutex<HashMap<String, Link>>,
    /// This node's name, as its interest updates say.
    me: String,
    /// The next interest stream's number: random at start, so a restarted
    /// node's streams are not taken for its previous run's.
    next_stream: std::sync::atomic::AtomicU64,
}

impl PubSub {
    /// The topics of the node `me`.
    pub(crate) fn new(me: &str) -> Self {
        use std::hash::{BuildHasher, Hasher};
        let seed = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        PubSub {
            me: me.to_owned(),
            topics: Mutex::default(),
            links: Mutex::default(),
            next_stream: std::sync::atomic::AtomicU64::new(seed),
        }
    }
}

/// What became of one publication (`PubSub::publish`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Published {
    /// Subscribers on this node that got it, plus the subscribers each peer
    /// it was queued for last advertised.
    pub(crate) count: u32,
    /// Peers it was queued for.
    pub(crate) forwarded: u32,
    /// Peers with subscribers whose queue was full (or whose share of host
    /// bytes the publisher could not pay): they miss it.
    pub(crate) dropped: u32,
}

impl PubSub {
    pub(crate) fn subscribe(
        &self,
        topic: &str,
        module: &Arc<str>,
        key: &Arc<str>,
        generation: u64,
        mailbox: WeakMailbox,
    ) {
        let subscriber = Subscriber {
            module: module.clone(),
            key: key.clone(),
            generation,
        };
        let mut topics = lock(&self.topics);
        let subscribers = topics.entry(topic.to_owned()).or_default();
        if subscribers.insert(subscriber, mailbox).is_none() {
            let count = count_of(subscribers);
            self.changed(topic, count);
        }
    }

    pub(crate) fn unsubscribe(
        &self,
        topic: &str,
        module: &Arc<str>,
        key: &Arc<str>,
        generation: u64,
    ) {
        let mut topics = lock(&self.topics);
        let Some(subscribers) = topics.get_mut(topic) else {
            return;
        };
        let subscriber = Subscriber {
            module: module.clone(),
            key: key.clone(),
            generation,
        };
        if subscribers.remove(&subscriber).is_some() {
            let count = count_of(subscribers);
            if count == 0 {
                topics.remove(topic);
            }
            self.changed(topic, count);
        }
    }

    /// This node's count of `topic` changed: every peer is owed it. Called
    /// with `topics` held, so a stream's snapshot and its changes agree.
    fn changed(&self, topic: &str, count: u32) {
        let mut links = lock(&self.links);
        for link in links.values_mut() {
            link.peer.changed(topic, count);
            link.wake.notify_one();
        }
    }

    /// Deliver `payload` to every subscriber of `topic` on this node, and
    /// queue it for every peer that has subscribers of it, charging the
    /// bytes it holds while queued to `ledger` (the publishing key's).
    pub(crate) fn publish(&self, topic: &str, payload: &[u8], ledger: &Arc<Ledger>) -> Published {
        let mut published = Published {
            count: self.deliver(topic, payload),
            ..Published::default()
        };
        let mut links = lock(&self.links);
        if links.values().all(|link| link.peer.subscribers(topic) == 0) {
            return published;
        }
        let held = match ledger.hold(topic.len() + payload.len()) {
            Ok(held) => Arc::new(held),
            Err(_) => {
                published.dropped = links
                    .values()
                    .filter(|link| link.peer.subscribers(topic) > 0)
                    .count() as u32;
                return published;
            }
        };
        let (topic, payload): (Arc<str>, Arc<[u8]>) = (Arc::from(topic), Arc::from(payload));
        for link in links.values_mut() {
            match link.peer.enqueue(&topic, &payload, &held) {
                Enqueued::Queued(subscribers) => {
                    published.count = published.count.saturating_add(subscribers);
                    published.forwarded += 1;
                    link.wake.notify_one();
                }
                Enqueued::Full => published.dropped += 1,
                Enqueued::NotInterested => {}
            }
        }
        published
    }

    /// Deliver `payload` to every subscriber of `topic` on this node (a
    /// publication made here, or forwarded by a peer); returns how many got
    /// it.
    pub(crate) fn deliver(&self, topic: &str, payload: &[u8]) -> u32 {
        let mailboxes: Vec<_> = match lock(&self.topics).get(topic) {
            Some(subscribers) => subscribers.values().cloned().collect(),
            None => return 0,
        };
        let mut delivered = 0;
        for mailbox in mailboxes {
            let Some(tx) = mailbox.upgrade() else {
                continue;
            };
            let info = Info::Published(Publication {
                topic: topic.to_owned(),
                payload: payload.to_vec(),
            });
            if tx.try_send(Envelope::Info(info)).is_ok() {
                delivered += 1;
            }
        }
        delivered
    }

    /// How many subscribers `topic` has now: here, and on the peers as they
    /// last advertised (what a publication held by the output gate
    /// answers: it is delivered once its commit lands).
    pub(crate) fn subscribers(&self, topic: &str) -> u32 {
        let here = lock(&self.topics).get(topic).map_or(0, count_of);
        lock(&self.links).values().fold(here, |sum, link| {
            sum.saturating_add(link.peer.subscribers(topic))
        })
    }

    /// How many topics have at least one subscriber on this node.
    pub(crate) fn topic_count(&self) -> usize {
        lock(&self.topics).len()
    }

    /// How many topics the peers advertised, summed over the peers.
    pub(crate) fn remote_topic_count(&self) -> usize {
        lock(&self.links)
            .values()
            .map(|link| link.peer.topic_count())
            .sum()
    }

    /// Publications waiting to be forwarded, over every peer.
    pub(crate) fn queued(&self) -> usize {
        lock(&self.links)
            .values()
            .map(|link| link.peer.queued())
            .sum()
    }

    /// The peers are now `members` (every other current member; none while
    /// this node is not current): a member that is new gets a fresh link (a
    /// new stream owed both ways), a peer that is gone takes what it
    /// advertised and its queue with it. Returns each member's wake signal.
    pub(crate) fn set_peers(&self, members: &[String]) -> Vec<(String, Arc<tokio::sync::Notify>)> {
        let mut links = lock(&self.links);
        links.retain(|name, _| members.contains(name));
        members
            .iter()
            .map(|name| {
                let link = links.entry(name.clone()).or_insert_with(|| Link {
                    peer: Peer::default(),
                    wake: Arc::new(tokio::sync::Notify::new()),
                });
                (name.clone(), link.wake.clone())
            })
            .collect()
    }

    /// Apply an interest update from the peer `node`. A node that is not
    /// (yet) a peer here is told to start again: it will be, once the
    /// membership says so.
    pub(crate) fn apply_interest(&self, node: &str, update: InterestUpdate) -> InterestAck {
        match lock(&self.links).get_mut(node) {
            Some(link) => link.peer.apply(update),
            None => InterestAck::Resync,
        }
    }

    /// The next interest update owed to `node` (opening a new stream with
    /// this node's whole interest if one is owed), with at most about
    /// `max_bytes` of topics; an empty one if `heartbeat`.
    pub(crate) fn next_interest(
        &self,
        node: &str,
        max_bytes: usize,
        heartbeat: bool,
    ) -> Option<InterestUpdate> {
        let topics = lock(&self.topics);
        let mut links = lock(&self.links);
        let link = links.get_mut(node)?;
        if link.peer.needs_stream() {
            let counts = topics
                .iter()
                .map(|(topic, subscribers)| (topic.clone(), count_of(subscribers)))
                .collect();
            let stream = self
                .next_stream
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            link.peer.start_stream(stream, counts);
        }
        drop(topics);
        let mut update = link.peer.next_update(max_bytes, heartbeat)?;
        update.node = self.me.clone();
        Some(update)
    }

    /// The peer `node` did not apply the last update: owe it a new stream.
    pub(crate) fn resync(&self, node: &str) {
        if let Some(link) = lock(&self.links).get_mut(node) {
            link.peer.resync();
        }
    }

    /// The next publications to forward to `node`, in order, with at most
    /// about `max_bytes` of topics and payloads.
    pub(crate) fn next_publications(
        &self,
        node: &str,
        max_bytes: usize,
    ) -> Vec<crate::wire::Publication> {
        lock(&self.links)
            .get_mut(node)
            .map(|link| link.peer.next_publications(max_bytes))
            .unwrap_or_default()
    }

    /// Whether anything waits to be sent to `node`, a heartbeat aside.
    pub(crate) fn has_work(&self, node: &str) -> bool {
        lock(&self.links)
            .get(node)
            .is_some_and(|link| link.peer.has_work())
    }
}

/// How many subscribers a topic's table holds.
fn count_of<V>(subscribers: &HashMap<Subscriber, V>) -> u32 {
    u32::try_from(subscribers.len()).unwrap_or(u32::MAX)
}
