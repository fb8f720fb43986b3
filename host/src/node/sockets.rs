//! WebSocket connections to keys, the node's side (`docs/realtime.md`):
//! accepting a connection, the socket task that holds it, routing its
//! events to the key's owner, serving a peer's events and sends, and the
//! feeds that carry what this node's keys send to sockets other nodes hold.
//!
//! A socket is held by the node that accepted it. Its task passes each
//! event (opened, a frame, closed) to the key's owner, one at a time and
//! waiting for each, so they arrive in order: to the key's mailbox if this
//! node owns it, else over the peer link. A mailbox that is full makes the
//! task wait and retry (the client's frames wait in TCP: backpressure, not
//! loss). When the key's owner changes (a graceful move, a takeover after a
//! failure) the task attaches the connection to the new owner first
//! (`opened`, `resumed`); if no owner takes it for [`NO_OWNER_LIMIT`], or
//! the module stops taking connections, it closes it (1011). When this node
//! fences or stops, its sockets close with 1012: reconnect.
//!
//! The tables are `crate::connections`'s; this file does the I/O.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Weak};
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::response::{IntoResponse, Response};
use fief_core::{NodeId, OwnershipToken, PartitionId, Route};
use tokio::time::Instant;

use super::{AbortOnDrop, Instance, NodeShared};
use crate::connections::{Admit, Attachment, SocketGuard, SocketRefusal, close};
use crate::error::{Error, Result};
use crate::key::{ConnDelivery, Envelope};
use crate::token_bucket::TokenBucket;
use crate::wire::{ConnAck, ConnEvent, ConnSend, FEATURE_CONNECTIONS, PeerRequest, WireAttachment};

/// How often a socket task checks its node's lease and its key's owner.
const CHECK: Duration = Duration::from_millis(250);
/// How long a socket task keeps trying to reach an owner for its key
/// before it closes the connection (1011).
const NO_OWNER_LIMIT: Duration = Duration::from_secs(30);
/// How long it waits between two tries.
const RETRY: Duration = Duration::from_millis(20);
/// Each socket's read buffer.
const SOCKET_READ_BUFFER: usize = 8 * 1024;
/// How often the outbox loop looks for peers to feed.
const RECONCILE: Duration = Duration::from_millis(200);

impl Instance {
    /// Accept a WebSocket connection to `module`/`key` (`GET
    /// /v1/keys/{module}/{key}/connect`): checked before the upgrade (the
    /// module takes connections; the node's and the tenant's limits), then
    /// held by a task of this node until it closes.
    ///
    /// # Errors
    ///
    /// The refusal, answered instead of the upgrade.
    pub(crate) fn accept_socket(
        &self,
        module: &str,
        key: &str,
        upgrade: WebSocketUpgrade,
    ) -> Result<Response> {
        crate::config::validate_key(key)?;
        let node = &self.shared;
        let slot = node.module(module)?;
        if slot.peek().connection_handler.is_none() {
            return Err(Error::NotConnectable(module.to_owned()));
        }
        if !node.may_act() {
            return Err(Error::Fenced);
        }
        let config = &node.config;
        let tenant = crate::auth::tenant_of(module);
        let guard = node
            .connections
            .sockets
            .register(
                tenant,
                config.max_connections as usize,
                config.max_connections_per_tenant as usize,
            )
            .map_err(|refusal| match refusal {
                SocketRefusal::Node(limit) => Error::TooManySockets {
                    scope: "this node".to_owned(),
                    limit,
                    option: "max_connections",
                },
                SocketRefusal::Tenant(limit) => Error::TooManySockets {
                    scope: format!("tenant {}", tenant.unwrap_or_default()),
                    limit,
                    option: "max_connections_per_tenant",
                },
            })?;
        // A client's frame: at most the module's max_message_size (itself
        // at most the node's).
        let max = slot
            .peek()
            .options
            .max_message_size
            .unwrap_or(config.max_message_size)
            .min(config.max_message_size)
            .as_u64() as usize;
        let shared = Arc::downgrade(node);
        let (module, key) = (module.to_owned(), key.to_owned());
        // tungstenite's default read buffer is 128 KiB per connection (1.2
        // GiB for 10 000 idle sockets) and is zero-filled before each read;
        // frames larger than it are read in several reads.
        Ok(upgrade
            .read_buffer_size(SOCKET_READ_BUFFER)
            .max_message_size(max)
            .max_frame_size(max)
            .on_upgrade(move |socket| async move {
                let task = SocketTask {
                    node: shared,
                    module,
                    key,
                    guard,
                    owner: None,
                    seq: 0,
                };
                task.run(socket).await;
            })
            .into_response())
    }
}

/// One socket this node holds.
struct SocketTask {
    node: Weak<NodeShared>,
    module: String,
    key: String,
    guard: SocketGuard,
    /// The owner the connection is attached to, and the token it owned the
    /// key's partition under, as far as this task knows. A new token is a
    /// new owner even on the same node: one that fenced and rejoined forgot
    /// its attachments.
    owner: Option<Owner>,
    /// The number of the last frame (or close) passed to the key.
    seq: u64,
}

/// How a socket ends: the close to send the client, if any, and whether
/// the key is to be told.
struct End {
    close: Option<(u16, String)>,
    tell_key: Option<(u16, String)>,
}

impl SocketTask {
    async fn run(mut self, mut socket: WebSocket) {
        let id = self.guard.id;
        let end = self.serve(&mut socket).await;
        if let Some((code, reason)) = end.tell_key {
            // Best effort: the key learns its connection closed.
            let closed = ConnEvent::Closed { id, code, reason };
            let _ = self
                .deliver(closed, Instant::now() + Duration::from_secs(2))
                .await;
        }
        if let Some((code, reason)) = end.close {
            let frame = CloseFrame {
                code,
                reason: Utf8Bytes::from(reason),
            };
            let _ = socket.send(Message::Close(Some(frame))).await;
        }
    }

    async fn serve(&mut self, socket: &mut WebSocket) -> End {
        let id = self.guard.id;
        let Some(me) = self.node.upgrade().map(|n| n.node_id.to_string()) else {
            return reconnect("the node is stopping");
        };
        let opened = ConnEvent::Opened {
            id,
            via: me.clone(),
            resumed: false,
        };
        if let Err(end) = self.deliver(opened, Instant::now() + NO_OWNER_LIMIT).await {
            return end;
        }
        let mut frames = FrameBucket::new(self.frames_per_second());
        let mut check = tokio::time::interval(CHECK);
        loop {
            tokio::select! {
                incoming = socket.recv() => {
                    let event = match incoming {
                        Some(Ok(Message::Text(text))) => ConnEvent::Text { id, text: text.to_string() },
                        Some(Ok(Message::Binary(data))) => ConnEvent::Binary { id, data: data.to_vec() },
                        Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                        Some(Ok(Message::Close(frame))) => {
                            let (code, reason) = frame
                                .map_or((1005, String::new()), |f| (f.code, f.reason.to_string()));
                            return End { close: None, tell_key: Some((code, reason)) };
                        }
                        Some(Err(e)) => {
                            let (code, why) = if e.to_string().contains("too long") || e.to_string().contains("too big") {
                                (close::TOO_BIG, "a frame over max_message_size".to_owned())
                            } else {
                                (1006, format!("the connection failed: {e}"))
                            };
                            return End { close: Some((code, why.clone())), tell_key: Some((code, why)) };
                        }
                        None => return End { close: None, tell_key: Some((1006, "the connection dropped".to_owned())) },
                    };
                    if !frames.take() {
                        let why = format!("more than {} frames a second (max_frames_per_second)", frames.0.per_second());
                        return End { close: Some((close::POLICY, why.clone())), tell_key: Some((close::POLICY, why)) };
                    }
                    if let Err(end) = self.deliver(event, Instant::now() + NO_OWNER_LIMIT).await {
                        return end;
                    }
                }
                outgoing = self.guard.out.recv() => {
                    let Some(send) = outgoing else { return reconnect("the node is stopping") };
                    let message = match send {
                        ConnSend::Text { text, .. } => Message::Text(text.into()),
                        ConnSend::Binary { data, .. } => Message::Binary(data.into()),
                        ConnSend::Close { code, reason, .. } => {
                            return End { close: Some((code, reason.clone())), tell_key: Some((code, reason)) };
                        }
                    };
                    if socket.send(message).await.is_err() {
                        return End { close: None, tell_key: Some((1006, "the connection dropped".to_owned())) };
                    }
                }
                _ = check.tick() => {
                    let Some(node) = self.node.upgrade() else { return reconnect("the node is stopping") };
                    if !node.may_act() {
                        // Nobody is told: the key's owner learns when the
                        // client reconnects elsewhere, or never.
                        return reconnect("the node holding this connection fenced; reconnect");
                    }
                    let owner = owner_of(&node, &self.key);
                    drop(node);
                    if owner.is_some() && owner != self.owner {
                        let resumed = ConnEvent::Opened { id, via: me.clone(), resumed: true };
                        if let Err(end) = self.deliver(resumed, Instant::now() + NO_OWNER_LIMIT).await {
                            return end;
                        }
                    }
                }
            }
        }
    }

    /// The module's `max_frames_per_second`, as deployed now.
    fn frames_per_second(&self) -> u32 {
        self.node
            .upgrade()
            .and_then(|node| node.module(&self.module).ok())
            .map_or(1, |slot| slot.peek().options.max_frames_per_second)
    }

    /// Pass `event` to the key's owner, retrying what may pass later (a
    /// full mailbox, no owner yet) until `deadline`; attaches the
    /// connection to a new owner first when the owner changed.
    async fn deliver(
        &mut self,
        event: ConnEvent,
        deadline: Instant,
    ) -> std::result::Result<(), End> {
        let id = self.guard.id;
        // Frames and the close are numbered, so one passed again after a
        // lost answer is not handled twice; `opened` (idempotent) is 0.
        let seq = if matches!(event, ConnEvent::Opened { .. }) {
            0
        } else {
            self.seq += 1;
            self.seq
        };
        // Set once it was sent and its answer lost.
        let mut again = false;
        loop {
            let Some(node) = self.node.upgrade() else {
                return Err(reconnect("the node is stopping"));
            };
            if !node.may_act() {
                return Err(reconnect(
                    "the node holding this connection fenced; reconnect",
                ));
            }
            let owner = owner_of(&node, &self.key);
            if owner.is_some() && owner != self.owner && !matches!(event, ConnEvent::Opened { .. })
            {
                // A new owner: attach the connection there first.
                let via = node.node_id.to_string();
                drop(node);
                let attach = ConnEvent::Opened {
                    id,
                    via,
                    resumed: true,
                };
                Box::pin(self.deliver(attach, deadline)).await?;
                continue;
            }
            let outcome = node
                .pass_conn_events(&self.module, &self.key, seq, again, vec![event.clone()])
                .await;
            drop(node);
            if !matches!(outcome, Ok(ConnAck::Delivered)) {
                tracing::debug!(
                    module = %self.module, key = %self.key, id, seq, again,
                    owner = ?owner, outcome = ?outcome,
                    "a connection event was not delivered; passed again"
                );
            }
            match outcome {
                Ok(ConnAck::Delivered) => {
                    self.owner = owner;
                    return Ok(());
                }
                Ok(ConnAck::Refused { code, reason }) => {
                    return Err(End {
                        close: Some((code, reason)),
                        tell_key: None,
                    });
                }
                // Passed again and again until the deadline, then given
                // up on: a connection is never left open with its frames
                // going nowhere.
                Ok(ack @ (ConnAck::Unattached | ConnAck::Retry)) if Instant::now() >= deadline => {
                    let why = match ack {
                        ConnAck::Retry => "the key did not take the connection's event in time (it keeps failing to start, or moving); the owner's log says why".to_owned(),
                        _ => "the key's owner did not take the connection in time".to_owned(),
                    };
                    return Err(End {
                        close: Some((close::UNAVAILABLE, crate::guest_log::bounded(why, 123))),
                        tell_key: None,
                    });
                }
                // The owner does not know the connection (it changed
                // between our look and its): attach it again.
                Ok(ConnAck::Unattached) => self.owner = None,
                // Not handled: the key moved or stopped first. Again, to
                // whoever owns it next.
                Ok(ConnAck::Retry) => tokio::time::sleep(RETRY).await,
                // Sent, and maybe handled: passed again under the same
                // number, which an owner that handled it (or took its
                // attachment in a move) does not handle twice.
                Err(Error::AnswerLost { .. } | Error::Timeout(_)) if Instant::now() < deadline => {
                    again = true;
                    self.owner = None;
                    tokio::time::sleep(RETRY).await;
                }
                Err(Error::UnknownModule(module)) => {
                    let why = format!("module {module} was undeployed");
                    return Err(End {
                        close: Some((close::UNAVAILABLE, why)),
                        tell_key: None,
                    });
                }
                Err(error) if Instant::now() >= deadline => {
                    let why = format!("no owner of the key took the connection: {error}");
                    return Err(End {
                        close: Some((close::UNAVAILABLE, crate::guest_log::bounded(why, 123))),
                        tell_key: None,
                    });
                }
                Err(_) => tokio::time::sleep(RETRY).await,
            }
        }
    }
}

/// The close that tells the client to reconnect (1012).
fn reconnect(why: &str) -> End {
    End {
        close: Some((close::RECONNECT, why.to_owned())),
        tell_key: None,
    }
}

/// A key's owner: the node, and the token it owns the key's partition
/// under.
type Owner = (NodeId, OwnershipToken);

/// The owner of `key` now, if the routing view names one.
fn owner_of(node: &NodeShared, key: &str) -> Option<Owner> {
    match node.route(key) {
        Route::Local { token, .. } => Some((node.node_id.clone(), token)),
        Route::Forward { owner, token, .. } => Some((owner, token)),
        Route::Refuse(_) => None,
    }
}

/// A bucket of one second's worth of frames, on real time.
struct FrameBucket(TokenBucket<std::time::Instant>);

impl FrameBucket {
    fn new(rate: u32) -> Self {
        let rate = f64::from(rate);
        FrameBucket(TokenBucket::full(rate, rate, std::time::Instant::now()))
    }

    /// Take one frame's token; false if none is left.
    fn take(&mut self) -> bool {
        self.0.take_one(std::time::Instant::now())
    }
}

impl NodeShared {
    /// Pass a socket's events to the owner of `module`/`key`: here, or over
    /// the peer link.
    async fn pass_conn_events(
        self: &Arc<Self>,
        module: &str,
        key: &str,
        seq: u64,
        again: bool,
        events: Vec<ConnEvent>,
    ) -> Result<ConnAck> {
        match self.route(key) {
            Route::Local { .. } => self.take_conn_events(module, key, seq, again, events).await,
            Route::Forward { owner, .. } => {
                let addr = self.peer_addr_of(&owner)?;
                if !self.peers.speaks(owner.as_str(), FEATURE_CONNECTIONS) {
                    return Err(Error::OwnerUnreachable {
                        owner: owner.to_string(),
                        why: "it has not said it takes WebSocket connections (an older version, \
                              or its link is not up yet)"
                            .to_owned(),
                    });
                }
                let request = PeerRequest::ConnEvents {
                    module: module.to_owned(),
                    key: key.to_owned(),
                    seq,
                    events,
                    again,
                };
                let body = self
                    .peers
                    .request(&addr, request, self.config.call_timeout)
                    .await?;
                postcard::from_bytes(&body)
                    .map_err(|e| Error::Internal(format!("a connection ack from {owner}: {e}")))
            }
            Route::Refuse(refusal) => Err(super::refused(refusal)),
        }
    }

    /// As the key's owner, take a socket's events, in order: attach or
    /// detach the connection, and have the key handle each (activating it),
    /// answering once it did — or [`ConnAck::Retry`] if it stopped, moved or
    /// died before it could (the socket's node passes the event again).
    pub(super) async fn take_conn_events(
        self: &Arc<Self>,
        module: &str,
        key: &str,
        seq: u64,
        again: bool,
        events: Vec<ConnEvent>,
    ) -> Result<ConnAck> {
        // Only the key's owner keeps its attachments: a holder whose view
        // is behind (it still sees this node as the owner after a fence, a
        // move) is told so before anything is attached here.
        match self.route(key) {
            Route::Local { .. } => {}
            Route::Forward { owner, .. } => {
                return Err(Error::NotOwner {
                    owner: owner.to_string(),
                });
            }
            Route::Refuse(refusal) => return Err(super::refused(refusal)),
        }
        let slot = self.module(module)?;
        let (has_handler, max) = {
            let current = slot.peek();
            (
                current.connection_handler.is_some(),
                current.options.max_connections_per_key as usize,
            )
        };
        drop(slot);
        if !has_handler {
            return Ok(ConnAck::Refused {
                code: close::UNAVAILABLE,
                reason: format!("module {module} takes no connections any more"),
            });
        }
        let attached = &self.connections.attached;
        for (n, event) in (0u64..).zip(events) {
            let seq = if seq == 0 { 0 } else { seq + n };
            let id = match &event {
                ConnEvent::Opened { id, via, resumed } => {
                    if let Err(n) = attached.attach(module, key, *id, via, *resumed, max) {
                        return Ok(ConnAck::Refused {
                            code: close::POLICY,
                            reason: format!(
                                "this key has {n} connections, its module's max_connections_per_key"
                            ),
                        });
                    }
                    *id
                }
                ConnEvent::Text { id, .. }
                | ConnEvent::Binary { id, .. }
                | ConnEvent::Closed { id, .. } => {
                    match attached.admit(module, key, *id, seq, again) {
                        Admit::Handle => *id,
                        Admit::Duplicate => {
                            tracing::debug!(
                                module,
                                key,
                                id,
                                seq,
                                again,
                                "a connection event handled before (or maybe, by a failed owner) is not handled again"
                            );
                            continue;
                        }
                        // A close of a connection not attached here: nothing
                        // to tell; a frame: attach it first.
                        Admit::Unattached if matches!(event, ConnEvent::Closed { .. }) => continue,
                        Admit::Unattached => return Ok(ConnAck::Unattached),
                    }
                }
            };
            let record: Box<dyn FnOnce() + Send> = {
                let (attached, module, key) = (attached.clone(), module.to_owned(), key.to_owned());
                let closed = matches!(event, ConnEvent::Closed { .. });
                Box::new(move || {
                    if closed {
                        attached.detach(&module, &key, id);
                    } else if seq != 0 {
                        attached.handled(&module, &key, id, seq);
                    }
                })
            };
            let (delivery, handled) = ConnDelivery::new(event, record);
            self.deliver_local(module, key, Envelope::Connection(Box::new(delivery)))?;
            match tokio::time::timeout(self.config.call_timeout, handled).await {
                Ok(Ok(())) => {}
                // Dropped unhandled: the key's next owner or process takes it.
                Ok(Err(_)) => return Ok(ConnAck::Retry),
                // Still queued or running: the socket's node passes it
                // again under the same number, not handled twice.
                Err(_) => return Err(Error::Timeout(self.config.call_timeout)),
            }
        }
        Ok(ConnAck::Delivered)
    }

    /// Take the attachments a key's previous owner handed over with a
    /// graceful move.
    pub(super) fn adopt_attachments(&self, attachments: Vec<WireAttachment>) -> Vec<u8> {
        for a in attachments {
            let attachment = Attachment {
                id: a.id,
                via: Arc::from(a.via.as_str()),
                handled: a.handled,
                known_from: a.known_from,
                adopted_at: Some(std::time::Instant::now()),
            };
            self.connections
                .attached
                .adopt(&a.module, &a.key, attachment);
        }
        Vec::new()
    }

    /// Hand the connections attached to the keys of `partitions` to `to`,
    /// their next owner (a graceful move, once the keys stopped), in frames
    /// under the frame limit. A failure is logged: the nodes holding the
    /// connections attach them to `to` themselves, later.
    pub(super) async fn hand_attachments(
        &self,
        to: &NodeId,
        addr: &str,
        partitions: &BTreeSet<PartitionId>,
    ) {
        if !self.peers.speaks(to.as_str(), FEATURE_CONNECTIONS) {
            return;
        }
        let budget = self.config.max_message_size.as_u64() as usize;
        let mut frames: Vec<Vec<WireAttachment>> = Vec::new();
        let mut bytes = budget;
        for a in self.attachments_of(partitions) {
            let size = a.module.len() + a.key.len() + a.via.len() + 32;
            if bytes + size > budget {
                frames.push(Vec::new());
                bytes = 0;
            }
            bytes += size;
            frames.last_mut().expect("pushed above").push(a);
        }
        for attachments in frames {
            let n = attachments.len();
            let request = PeerRequest::Attach { attachments };
            if let Err(error) = self
                .peers
                .request(addr, request, self.config.call_timeout)
                .await
            {
                tracing::warn!(node = %self.node_id, %to, %error, n,
                    "moving keys' connections were not handed over; their nodes attach them later");
                return;
            }
        }
    }

    /// The attachments of the keys of `partitions`, for their next owner.
    pub(super) fn attachments_of(&self, partitions: &BTreeSet<PartitionId>) -> Vec<WireAttachment> {
        let count = self.view().table().partitions();
        self.connections
            .attached
            .of_keys(|key| partitions.contains(&count.of(key)))
            .into_iter()
            .map(|(module, key, a)| WireAttachment {
                module,
                key,
                id: a.id,
                via: a.via.to_string(),
                handled: a.handled,
                known_from: a.known_from,
            })
            .collect()
    }

    /// Serve a peer's sends to sockets this node holds, in order; a send to
    /// a socket that closed, or whose queue is full, is dropped.
    pub(super) fn serve_conn_sends(&self, sends: Vec<ConnSend>) -> Vec<u8> {
        for send in sends {
            self.connections.sockets.send(send);
        }
        Vec::new()
    }

    /// Forget the attachments of keys this node does not own now (their
    /// next owner is told by the nodes holding the connections), and the
    /// outboxes of nodes that are no members.
    fn tidy_connections(&self) {
        let current = self.may_act();
        // Handed here by a move: kept for two lease lifetimes while the
        // transfer lands (a fenced node keeps nothing).
        let grace = 2 * self.config.lease_ttl;
        let since = std::time::Instant::now()
            .checked_sub(if current { grace } else { Duration::ZERO })
            .unwrap_or_else(std::time::Instant::now);
        // Kept while the key's partition is draining or unowned (a move
        // hands them over after its keys stopped): dropped once another
        // node owns it.
        self.connections.attached.retain(
            |_, key| current && !matches!(self.route(key), Route::Forward { .. }),
            since,
        );
    }
}

/// Run the outbox loop until the node stops: one feed per peer that keys
/// here sent something to, each sending that peer's sends in order.
pub(super) async fn run(node: Weak<NodeShared>) {
    let mut feeds: HashMap<String, AbortOnDrop> = HashMap::new();
    loop {
        let Some(shared) = node.upgrade() else { return };
        shared.tidy_connections();
        let current = shared.may_act();
        for peer in shared.connections.outbox.peers() {
            let addr = shared.peer_addr_of(&NodeId::new(&peer)).ok();
            match addr {
                Some(addr) if current && shared.peers.speaks(&peer, FEATURE_CONNECTIONS) => {
                    feeds.entry(peer.clone()).or_insert_with(|| {
                        let wake = shared.connections.outbox.wake(&peer);
                        AbortOnDrop(tokio::spawn(feed(node.clone(), peer, addr, wake)))
                    });
                }
                _ => {
                    shared.connections.outbox.drop_peer(&peer);
                    feeds.remove(&peer);
                }
            }
        }
        drop(shared);
        tokio::time::sleep(RECONCILE).await;
    }
}

/// Carry the outbox of `peer` (at `addr`) until aborted.
async fn feed(node: Weak<NodeShared>, peer: String, addr: String, wake: Arc<tokio::sync::Notify>) {
    loop {
        let Some(shared) = node.upgrade() else { return };
        let max = shared.config.max_message_size.as_u64() as usize;
        let sends = shared.connections.outbox.take(&peer, max);
        if sends.is_empty() {
            drop(shared);
            let _ = tokio::time::timeout(Duration::from_secs(1), wake.notified()).await;
            continue;
        }
        let n = sends.len();
        let request = PeerRequest::ConnSend { sends };
        if let Err(error) = shared
            .peers
            .request(&addr, request, shared.config.call_timeout)
            .await
        {
            tracing::debug!(%peer, %error, n, "frames for connections another node holds were lost");
        }
    }
}
