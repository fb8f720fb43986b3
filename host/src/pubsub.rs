//! Pub/sub between the keys of one node: topics and their subscribers.
//!
//! A key subscribes through `host.subscribe`; a publication is put in each
//! subscriber's mailbox as a `published` info. A subscription belongs to one
//! key *process* (module, key, generation): it is removed when that process's
//! store is dropped, so a dead process never receives anything. Delivery is
//! best effort, like every Fief message (guarantee 4): a subscriber whose
//! mailbox is full, or who holds its whole host-memory budget
//! ([`crate::host_bytes`]), misses the publication, and the publisher's count
//! says how many got it. Publications reach subscribers on the same node.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::bindings::types::{Info, Publication};
use crate::key::Envelope;
use crate::mailbox::WeakMailbox;
use crate::sync::lock;

/// Longest topic name, in bytes.
pub const MAX_TOPIC_BYTES: usize = 256;

#[derive(Clone, PartialEq, Eq, Hash)]
struct Subscriber {
    module: Arc<str>,
    key: Arc<str>,
    generation: u64,
}

/// The topics of one node.
#[derive(Default)]
pub(crate) struct PubSub {
    topics: Mutex<HashMap<String, HashMap<Subscriber, WeakMailbox>>>,
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
        lock(&self.topics)
            .entry(topic.to_owned())
            .or_default()
            .insert(subscriber, mailbox);
    }

    pub(crate) fn unsubscribe(
        &self,
        topic: &str,
        module: &Arc<str>,
        key: &Arc<str>,
        generation: u64,
    ) {
        let mut topics = lock(&self.topics);
        if let Some(subscribers) = topics.get_mut(topic) {
            subscribers.remove(&Subscriber {
                module: module.clone(),
                key: key.clone(),
                generation,
            });
            if subscribers.is_empty() {
                topics.remove(topic);
            }
        }
    }

    /// Deliver `payload` to every subscriber of `topic`; returns how many got it.
    pub(crate) fn publish(&self, topic: &str, payload: &[u8]) -> u32 {
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

    /// How many keys subscribe to `topic` now (what a publication held by
    /// the output gate answers: it is delivered once its commit lands).
    pub(crate) fn subscribers(&self, topic: &str) -> u32 {
        lock(&self.topics).get(topic).map_or(0, |subscribers| {
            u32::try_from(subscribers.len()).unwrap_or(u32::MAX)
        })
    }

    /// How many topics have at least one subscriber.
    pub(crate) fn topic_count(&self) -> usize {
        lock(&self.topics).len()
    }
}
