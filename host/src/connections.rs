//! WebSocket connections to keys: the tables, on both sides.
//!
//! A client's connection is held by the node that accepted it (its
//! *socket*, [`Sockets`]): that node passes the client's frames to the key's
//! owner as events, and writes what the key sends. The owner keeps, per key,
//! which connections are *attached* to it and which node holds each
//! ([`Attached`]), at the node (not in the key's process), so a connection
//! outlives the key's eviction; what a key sends to a connection held by
//! another node waits in that peer's outbox ([`Outbox`]) until the node's
//! feed carries it, in order.
//!
//! This module must not do I/O: `node/sockets.rs` runs the sockets and the
//! feeds, and routes events; the `connections` imports (`connections_api.rs`)
//! read and queue here.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, mpsc};

use crate::sync::lock;
use crate::wire::ConnSend;

/// Frames (and a close) that may wait for one socket's writer.
pub const SOCKET_QUEUE: usize = 256;
/// Frames that may wait in one peer's outbox.
pub const MAX_OUTBOX: usize = 8192;
/// Bytes that may wait in one peer's outbox.
pub const MAX_OUTBOX_BYTES: usize = 64 << 20;

/// Close codes Fief sends (docs/realtime.md, "Close codes").
pub mod close {
    /// Normal closure (a key's `close` with no code of its own).
    pub const NORMAL: u16 = 1000;
    /// A limit of the connection's key or module: frames per second, or
    /// connections per key.
    pub const POLICY: u16 = 1008;
    /// A frame over `max_message_size`.
    pub const TOO_BIG: u16 = 1009;
    /// The key cannot take it: its module takes no connections, was
    /// undeployed, or no owner could be reached for too long.
    pub const UNAVAILABLE: u16 = 1011;
    /// The node holding the connection fenced or is stopping: reconnect
    /// (to any node).
    pub const RECONNECT: u16 = 1012;
}

/// The code a key's `close` sends: its own if it may (1000, 3000–4999),
/// otherwise 1000.
pub(crate) fn key_close_code(code: u16) -> u16 {
    if code == close::NORMAL || (3000..=4999).contains(&code) {
        code
    } else {
        close::NORMAL
    }
}

/// A socket this node holds, as the table knows it.
struct Socket {
    tenant: Option<String>,
    out: mpsc::Sender<ConnSend>,
}

/// Why a socket could not be registered.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum SocketRefusal {
    /// The node holds `max_connections` already.
    Node(usize),
    /// The tenant holds `max_connections_per_tenant` already.
    Tenant(usize),
}

/// The sockets this node holds.
pub(crate) struct Sockets {
    table: Mutex<SocketTable>,
    next_id: AtomicU64,
}

#[derive(Default)]
struct SocketTable {
    sockets: HashMap<u64, Socket>,
    per_tenant: HashMap<String, usize>,
}

/// A registered socket: its id and the queue of what to write to it. Drop
/// it to unregister.
pub(crate) struct SocketGuard {
    pub(crate) id: u64,
    pub(crate) out: mpsc::Receiver<ConnSend>,
    sockets: Arc<Sockets>,
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        self.sockets.unregister(self.id);
    }
}

impl Sockets {
    /// An empty table; ids start at a random point, so one node's ids do
    /// not repeat another's (an id is the connection's name cluster-wide).
    pub(crate) fn new() -> Arc<Self> {
        use std::hash::{BuildHasher, Hasher};
        let seed = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        Arc::new(Sockets {
            table: Mutex::default(),
            next_id: AtomicU64::new(seed >> 16),
        })
    }

    /// Register a socket of `tenant` (none: an open node), within
    /// `max_node` sockets on the node and `max_tenant` per tenant.
    pub(crate) fn register(
        self: &Arc<Self>,
        tenant: Option<&str>,
        max_node: usize,
        max_tenant: usize,
    ) -> Result<SocketGuard, SocketRefusal> {
        let mut table = lock(&self.table);
        if table.sockets.len() >= max_node {
            return Err(SocketRefusal::Node(max_node));
        }
        if let Some(tenant) = tenant {
            let held = table.per_tenant.get(tenant).copied().unwrap_or(0);
            if held >= max_tenant {
                return Err(SocketRefusal::Tenant(max_tenant));
            }
            *table.per_tenant.entry(tenant.to_owned()).or_default() += 1;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(SOCKET_QUEUE);
        table.sockets.insert(
            id,
            Socket {
                tenant: tenant.map(str::to_owned),
                out: tx,
            },
        );
        Ok(SocketGuard {
            id,
            out: rx,
            sockets: self.clone(),
        })
    }

    fn unregister(&self, id: u64) {
        let mut table = lock(&self.table);
        if let Some(socket) = table.sockets.remove(&id)
            && let Some(tenant) = socket.tenant
            && let Some(held) = table.per_tenant.get_mut(&tenant)
        {
            *held -= 1;
            if *held == 0 {
                table.per_tenant.remove(&tenant);
            }
        }
    }

    /// Queue `send` for the socket it names; false if there is no such
    /// socket or its queue is full.
    pub(crate) fn send(&self, send: ConnSend) -> bool {
        let out = match lock(&self.table).sockets.get(&send.id()) {
            Some(socket) => socket.out.clone(),
            None => return false,
        };
        out.try_send(send).is_ok()
    }

    /// How many sockets this node holds.
    pub(crate) fn count(&self) -> usize {
        lock(&self.table).sockets.len()
    }
}

/// A key, as `(module, key)`.
type KeyName = (Arc<str>, Arc<str>);

/// A key's attached connections, in the order they attached.
type KeyConnections = Vec<Attachment>;

/// One connection attached to a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Attachment {
    /// The connection.
    pub(crate) id: u64,
    /// The node holding its socket.
    pub(crate) via: Arc<str>,
    /// The number of the last of its frames the key handled (frames are
    /// numbered from 1 by the holding node; 0: none yet): a frame passed
    /// again with a number at most this is not handled again.
    pub(crate) handled: u64,
    /// The first frame number whose fate this owner (or a previous owner
    /// that handed the attachment over) knows: 1 for a connection that
    /// opened here or was handed here by a move; for one re-attached after
    /// its owner failed, the first frame passed here afresh (none yet:
    /// `u64::MAX`). A frame passed *again* (its answer lost) numbered below
    /// it may have been handled by the failed owner, so it is not handled
    /// (at most once).
    pub(crate) known_from: u64,
    /// When it was handed here by the key's previous owner (a graceful
    /// move), until this node owns the key: kept that long even though
    /// the key is not this node's yet ([`Attached::retain`]).
    pub(crate) adopted_at: Option<std::time::Instant>,
}

/// What [`Attached::admit`] says of a frame (or a close).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    /// New: have the key handle it.
    Handle,
    /// Handled already (passed again after a lost answer): do not.
    Duplicate,
    /// The connection is not attached here.
    Unattached,
}

/// The connections attached to the keys this node owns, by key.
#[derive(Default)]
pub(crate) struct Attached {
    keys: Mutex<HashMap<KeyName, KeyConnections>>,
}

impl Attached {
    /// Attach connection `id`, held by `via`, to `module`/`key`, unless the
    /// key has `max` already (then how many it has).
    ///
    /// A connection that opened just now (`resumed` false) has its whole
    /// history here; one re-attached (`resumed`) without a handover does
    /// not ([`Attachment::known_from`]).
    pub(crate) fn attach(
        &self,
        module: &str,
        key: &str,
        id: u64,
        via: &str,
        resumed: bool,
        max: usize,
    ) -> Result<(), usize> {
        let mut keys = lock(&self.keys);
        let list = keys.entry((Arc::from(module), Arc::from(key))).or_default();
        if let Some(entry) = list.iter_mut().find(|a| a.id == id) {
            entry.via = Arc::from(via);
            return Ok(());
        }
        if list.len() >= max {
            let n = list.len();
            if n == 0 {
                keys.remove(&(Arc::from(module), Arc::from(key)));
            }
            return Err(n);
        }
        list.push(Attachment {
            id,
            via: Arc::from(via),
            handled: 0,
            known_from: if resumed { u64::MAX } else { 1 },
            adopted_at: None,
        });
        Ok(())
    }

    /// Whether frame `seq` of connection `id` is to be handled; `again`:
    /// it was passed before and its answer was lost.
    pub(crate) fn admit(&self, module: &str, key: &str, id: u64, seq: u64, again: bool) -> Admit {
        let mut keys = lock(&self.keys);
        let entry = keys
            .get_mut(&(Arc::from(module), Arc::from(key)))
            .and_then(|list| list.iter_mut().find(|a| a.id == id));
        match entry {
            None => Admit::Unattached,
            Some(a) if seq != 0 && seq <= a.handled => Admit::Duplicate,
            // Maybe handled by an owner that failed before handing over.
            Some(a) if again && seq < a.known_from => Admit::Duplicate,
            Some(a) => {
                a.known_from = a.known_from.min(seq.max(1));
                Admit::Handle
            }
        }
    }

    /// The key handled frame `seq` of connection `id`.
    pub(crate) fn handled(&self, module: &str, key: &str, id: u64, seq: u64) {
        let mut keys = lock(&self.keys);
        if let Some(entry) = keys
            .get_mut(&(Arc::from(module), Arc::from(key)))
            .and_then(|list| list.iter_mut().find(|a| a.id == id))
        {
            entry.handled = entry.handled.max(seq);
        }
    }

    /// The attachments of the keys for which `pick` is true, to hand to
    /// their next owner with a graceful move.
    pub(crate) fn of_keys(
        &self,
        mut pick: impl FnMut(&str) -> bool,
    ) -> Vec<(String, String, Attachment)> {
        lock(&self.keys)
            .iter()
            .filter(|((_, key), _)| pick(key))
            .flat_map(|((module, key), list)| {
                list.iter()
                    .map(|a| (module.to_string(), key.to_string(), a.clone()))
            })
            .collect()
    }

    /// Take attachments handed over by a key's previous owner (a graceful
    /// move): each joins its key's list, or updates the entry there.
    pub(crate) fn adopt(&self, module: &str, key: &str, attachment: Attachment) {
        let mut keys = lock(&self.keys);
        let list = keys.entry((Arc::from(module), Arc::from(key))).or_default();
        match list.iter_mut().find(|a| a.id == attachment.id) {
            Some(entry) => {
                entry.handled = entry.handled.max(attachment.handled);
                entry.known_from = entry.known_from.min(attachment.known_from);
            }
            None => list.push(attachment),
        }
    }

    /// Detach connection `id` from `module`/`key`.
    pub(crate) fn detach(&self, module: &str, key: &str, id: u64) {
        let mut keys = lock(&self.keys);
        let name = (Arc::from(module), Arc::from(key));
        if let Some(list) = keys.get_mut(&name) {
            list.retain(|a| a.id != id);
            if list.is_empty() {
                keys.remove(&name);
            }
        }
    }

    /// The node holding connection `id` of `module`/`key`, if it is
    /// attached.
    pub(crate) fn via(&self, module: &str, key: &str, id: u64) -> Option<Arc<str>> {
        lock(&self.keys)
            .get(&(Arc::from(module), Arc::from(key)))?
            .iter()
            .find(|a| a.id == id)
            .map(|a| a.via.clone())
    }

    /// Whether connection `id` is attached to `module`/`key`.
    pub(crate) fn is_attached(&self, module: &str, key: &str, id: u64) -> bool {
        self.via(module, key, id).is_some()
    }

    /// The connections of `module`/`key`, in the order they attached.
    pub(crate) fn list(&self, module: &str, key: &str) -> Vec<u64> {
        lock(&self.keys)
            .get(&(Arc::from(module), Arc::from(key)))
            .map(|list| list.iter().map(|a| a.id).collect())
            .unwrap_or_default()
    }

    /// Forget the attachments of every key for which `owned` is false
    /// (keys this node does not own: their next owner is told by the nodes
    /// holding the connections), except those adopted after `since` (handed
    /// here by a move whose transfer may not have landed yet). Attachments
    /// of keys it owns stop being "adopted".
    pub(crate) fn retain(
        &self,
        mut owned: impl FnMut(&str, &str) -> bool,
        since: std::time::Instant,
    ) {
        lock(&self.keys).retain(|(module, key), list| {
            if owned(module, key) {
                for a in list.iter_mut() {
                    a.adopted_at = None;
                }
                return true;
            }
            list.retain(|a| a.adopted_at.is_some_and(|at| at > since));
            !list.is_empty()
        });
    }

    /// Forget every attachment (the node fenced).
    pub(crate) fn clear(&self) {
        lock(&self.keys).clear();
    }

    /// Attached connections, over every key.
    pub(crate) fn count(&self) -> usize {
        lock(&self.keys).values().map(Vec::len).sum()
    }
}

/// What keys here sent to connections other nodes hold, by node.
#[derive(Default)]
pub(crate) struct Outbox {
    peers: Mutex<HashMap<String, PeerOutbox>>,
}

#[derive(Default)]
struct PeerOutbox {
    queue: VecDeque<ConnSend>,
    bytes: usize,
    wake: Arc<Notify>,
}

impl Outbox {
    /// Queue `send` for the node `via`; false if its outbox is full.
    pub(crate) fn push(&self, via: &str, send: ConnSend) -> bool {
        let mut peers = lock(&self.peers);
        let outbox = peers.entry(via.to_owned()).or_default();
        if outbox.queue.len() >= MAX_OUTBOX || outbox.bytes + send.bytes() > MAX_OUTBOX_BYTES {
            return false;
        }
        outbox.bytes += send.bytes();
        outbox.queue.push_back(send);
        outbox.wake.notify_one();
        true
    }

    /// The signal that wakes the feed of `via`'s outbox.
    pub(crate) fn wake(&self, via: &str) -> Arc<Notify> {
        lock(&self.peers)
            .entry(via.to_owned())
            .or_default()
            .wake
            .clone()
    }

    /// The next sends for `via`, in order, about `max_bytes` at most (at
    /// least one, if any waits).
    pub(crate) fn take(&self, via: &str, max_bytes: usize) -> Vec<ConnSend> {
        let mut peers = lock(&self.peers);
        let Some(outbox) = peers.get_mut(via) else {
            return Vec::new();
        };
        let mut batch = Vec::new();
        let mut bytes = 0;
        while let Some(next) = outbox.queue.front() {
            if !batch.is_empty() && bytes + next.bytes() > max_bytes {
                break;
            }
            bytes += next.bytes();
            outbox.bytes -= next.bytes();
            batch.push(outbox.queue.pop_front().expect("a front"));
        }
        batch
    }

    /// The nodes with an outbox, for the feeds.
    pub(crate) fn peers(&self) -> Vec<String> {
        lock(&self.peers).keys().cloned().collect()
    }

    /// Drop `via`'s outbox (it is no member any more, or this node fenced).
    pub(crate) fn drop_peer(&self, via: &str) {
        lock(&self.peers).remove(via);
    }
}

/// A node's connection tables.
pub(crate) struct Connections {
    /// The sockets this node holds.
    pub(crate) sockets: Arc<Sockets>,
    /// The connections attached to the keys this node owns.
    pub(crate) attached: Arc<Attached>,
    /// What keys here sent to sockets other nodes hold.
    pub(crate) outbox: Outbox,
}

impl Default for Connections {
    fn default() -> Self {
        Connections {
            sockets: Sockets::new(),
            attached: Arc::default(),
            outbox: Outbox::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockets_are_bounded_per_node_and_per_tenant_and_counted_back() {
        let sockets = Sockets::new();
        let a = sockets.register(Some("acme"), 3, 2).unwrap();
        let _b = sockets.register(Some("acme"), 3, 2).unwrap();
        assert_eq!(
            sockets.register(Some("acme"), 3, 2).err(),
            Some(SocketRefusal::Tenant(2))
        );
        let _c = sockets.register(None, 3, 2).unwrap();
        assert_eq!(
            sockets.register(Some("umbrella"), 3, 2).err(),
            Some(SocketRefusal::Node(3))
        );
        assert_ne!(a.id, _b.id);
        drop(a);
        assert_eq!(sockets.count(), 2);
        assert!(sockets.register(Some("acme"), 3, 2).is_ok());
    }

    #[test]
    fn a_key_has_at_most_its_limit_of_connections_in_the_order_they_came() {
        let attached = Attached::default();
        attached.attach("m", "k", 7, "n1", false, 2).unwrap();
        attached.attach("m", "k", 3, "n2", false, 2).unwrap();
        attached.attach("m", "k", 7, "n3", true, 2).unwrap(); // moved: same one
        assert_eq!(attached.attach("m", "k", 9, "n1", false, 2), Err(2));
        assert_eq!(attached.list("m", "k"), vec![7, 3]);
        assert_eq!(attached.via("m", "k", 7).as_deref(), Some("n3"));
        assert_eq!(attached.admit("m", "k", 7, 1, false), Admit::Handle);
        attached.handled("m", "k", 7, 1);
        let again = attached.admit("m", "k", 7, 1, true);
        assert_eq!(again, Admit::Duplicate, "passed again");
        let fresh = attached.admit("m", "k", 7, 2, true);
        assert_eq!(fresh, Admit::Handle, "its history is here");
        assert_eq!(attached.admit("m", "k", 8, 1, false), Admit::Unattached);
        // Handed to the next owner with what was handled.
        let moving = attached.of_keys(|key| key == "k");
        let next = Attached::default();
        for (module, key, a) in moving {
            next.adopt(&module, &key, a);
        }
        assert_eq!(next.list("m", "k"), vec![7, 3]);
        assert_eq!(next.admit("m", "k", 7, 1, true), Admit::Duplicate);
        assert_eq!(
            next.admit("m", "k", 7, 2, true),
            Admit::Handle,
            "handed with its history"
        );
        attached.detach("m", "k", 7);
        assert_eq!(attached.list("m", "k"), vec![3]);
        let now = std::time::Instant::now();
        attached.retain(|_, key| key != "k", now);
        assert_eq!(attached.count(), 0);
        // Adopted attachments wait for the transfer, but not forever.
        let adopted = Attachment {
            id: 5,
            via: Arc::from("n2"),
            handled: 0,
            known_from: 1,
            adopted_at: Some(now),
        };
        attached.adopt("m", "moving", adopted);
        attached.retain(|_, _| false, now - std::time::Duration::from_secs(1));
        assert_eq!(attached.list("m", "moving"), vec![5]);
        attached.retain(|_, _| false, now);
        assert_eq!(attached.count(), 0);
        assert_eq!(attached.attach("m", "k", 1, "n1", false, 0), Err(0));
        assert_eq!(attached.count(), 0, "a refusal leaves no empty entry");
    }

    /// After its owner failed, a connection re-attached elsewhere: a frame
    /// passed again (its answer lost) may have been handled by the failed
    /// owner, so it is not handled again (at most once); frames passed
    /// afresh are, and from the first of them on, so are those passed again.
    #[test]
    fn after_a_failure_a_frame_passed_again_is_not_handled_twice() {
        let attached = Attached::default();
        attached.attach("m", "k", 7, "n1", true, 8).unwrap();
        assert_eq!(attached.admit("m", "k", 7, 4, true), Admit::Duplicate);
        assert_eq!(attached.admit("m", "k", 7, 5, false), Admit::Handle);
        attached.handled("m", "k", 7, 5);
        assert_eq!(attached.admit("m", "k", 7, 6, true), Admit::Handle);
        assert_eq!(attached.admit("m", "k", 7, 4, true), Admit::Duplicate);
    }

    #[test]
    fn an_outbox_keeps_order_and_its_bounds() {
        let outbox = Outbox::default();
        for id in 0..3 {
            assert!(outbox.push(
                "n1",
                ConnSend::Binary {
                    id,
                    data: vec![0; 10]
                }
            ));
        }
        let batch = outbox.take("n1", 15);
        assert_eq!(batch.iter().map(ConnSend::id).collect::<Vec<_>>(), vec![0]);
        let rest = outbox.take("n1", 1 << 20);
        assert_eq!(
            rest.iter().map(ConnSend::id).collect::<Vec<_>>(),
            vec![1, 2]
        );
        let big = ConnSend::Binary {
            id: 9,
            data: vec![0; MAX_OUTBOX_BYTES],
        };
        assert!(outbox.push("n1", big.clone()));
        assert!(!outbox.push("n1", big), "past its bytes");
    }
}
