//! Routing: where a message for a key goes, and getting it there.
//!
//! This file owns the node's side of guarantee 2: the routing decision as of
//! now (`route`: the core's decision, with partitions being drained or unsure
//! refused), the admission of a new key process under the key table's lock
//! (`admit_activation`), local delivery, calls and casts on whichever node
//! owns the key (forwarded to the owner, with one bounded retry on a stale
//! table), and serving a peer's forwarded request, which is routed again and
//! never forwarded; each carries its request's trace context (`crate::trace`)
//! to the owner and into the key's message. It must not change ownership
//! itself: the lease, the table and moves are `coordination.rs`'s and
//! `moves.rs`'s, which it only reads or asks (a stale table is refreshed
//! through `coordination.rs`).

use std::sync::Arc;
use std::time::Duration;

use fief_core::{NodeId, OwnershipToken, PartitionId, Route, RouteRefusal};

use super::NodeShared;
use crate::config::validate_key;
use crate::error::{Error, Result};
use crate::key::{Envelope, KeyNode, ModuleSlot, NodeFuture, Via};
use crate::sync::lock;
use crate::trace::TraceContext;
use crate::wire::{CacheOp, CacheOutcome, PeerRequest, WireTrace};

impl NodeShared {
    /// Decide where a message for `key` goes, as of now. A partition being
    /// handed off is not served by anyone until the move completes.
    pub(crate) fn route(&self, key: &str) -> Route {
        self.view().route(&self.node_id, self.gate_status(), key)
    }

    /// Where the peers of `owner` reach it.
    pub(super) fn peer_addr_of(&self, owner: &NodeId) -> Result<String> {
        self.members
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(owner)
            .and_then(|m| m.peer_addr.clone())
            .ok_or_else(|| Error::OwnerUnreachable {
                owner: owner.to_string(),
                why: "the arbiter lists no peer address for it".to_owned(),
            })
    }

    /// Put `envelope` in the key's mailbox on this node, if this node owns
    /// the key right now; never forwards.
    pub(super) fn deliver_local(
        self: &Arc<Self>,
        module: &str,
        key: &str,
        envelope: Envelope,
    ) -> Result<()> {
        validate_key(key)?;
        let slot = self.module(module)?;
        if let Envelope::Call { message, .. } | Envelope::Cast { message, .. } = &envelope {
            check_module_message(&slot, message)?;
        }
        match self.route(key) {
            Route::Local { partition, token } => {
                slot.deliver(&self.services, key, partition, token, envelope)
            }
            Route::Forward { owner, .. } => Err(Error::NotOwner {
                owner: owner.to_string(),
            }),
            Route::Refuse(refusal) => Err(refused(refusal)),
        }
    }

    /// Call a key and wait for its reply, at most `timeout`, on whichever
    /// node owns it.
    pub(crate) async fn call_with_timeout(
        self: &Arc<Self>,
        module: &str,
        key: &str,
        message: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        self.check_message(&message)?;
        validate_key(key)?;
        let started = std::time::Instant::now();
        // The trace of the request served (`crate::trace`): the owner's
        // serving and the key's log lines and calls carry it.
        let trace = crate::trace::current();
        let span = tracing::debug_span!(
            "call",
            node = %self.node_id,
            module,
            key,
            trace_id = trace.map(|t| tracing::field::display(t.trace_hex()))
        );
        let (reply, route) = tracing::Instrument::instrument(
            async {
                let request = || PeerRequest::Call {
                    module: module.to_owned(),
                    key: key.to_owned(),
                    message: message.clone(),
                    timeout_ms: timeout.as_millis() as u64,
                    trace: trace.map(Into::into),
                };
                // Routed once here: a local call (the common case) goes
                // straight on with this route; `forward` routes for itself.
                let here = self.route(key);
                if matches!(here, Route::Forward { .. })
                    && let Some(reply) = self.forward(key, request, timeout).await
                {
                    return (reply, crate::metrics::CallRoute::Routed);
                }
                let here = match here {
                    // The table changed between the two routes: ask again.
                    Route::Forward { .. } => self.route(key),
                    here => here,
                };
                (
                    self.call_local(module, key, message, timeout, here, trace)
                        .await,
                    crate::metrics::CallRoute::Local,
                )
            },
            span,
        )
        .await;
        self.metrics
            .call_done(module, route, reply.is_ok(), started.elapsed(), || {
                self.modules.load().contains_key(module)
            });
        reply
    }

    /// Send `request` to the owner of `key` if another node owns it, and
    /// return its answer; `None` when this node is the one to serve it (or
    /// refuse it), which the caller does locally.
    ///
    /// One bounded retry: if the owner per our table is gone or says it is
    /// not the owner, our table may be stale; refresh it and route once more.
    pub(crate) async fn forward(
        self: &Arc<Self>,
        key: &str,
        request: impl Fn() -> PeerRequest,
        timeout: Duration,
    ) -> Option<Result<Vec<u8>>> {
        for attempt in 0..2 {
            let epoch = self.table().epoch();
            let Route::Forward { owner, .. } = self.route(key) else {
                return None;
            };
            let addr = match self.peer_addr_of(&owner) {
                Ok(addr) => addr,
                Err(e) => return Some(Err(e)),
            };
            match self.peers.request(&addr, request(), timeout).await {
                // Retry once the table is newer than the one this route was
                // decided on, whether this refresh or the coordination loop
                // (nudged by the same move) adopted it.
                Err(e)
                    if attempt == 0
                        && stale_route(&e)
                        && (self.refresh_table().await || self.table().epoch() > epoch) =>
                {
                    continue;
                }
                result => return Some(result.map_err(|e| name_owner(e, &owner, &addr))),
            }
        }
        unreachable!("the loop returns on its second attempt")
    }

    /// Serve a call here, on `route` (this node's routing of `key`, just
    /// decided), in `trace`.
    async fn call_local(
        self: &Arc<Self>,
        module: &str,
        key: &str,
        message: Vec<u8>,
        timeout: Duration,
        route: Route,
        trace: Option<TraceContext>,
    ) -> Result<Vec<u8>> {
        validate_key(key)?;
        let slot = self.module(module)?;
        check_module_message(&slot, &message)?;
        let (partition, token) = match route {
            Route::Local { partition, token } => (partition, token),
            Route::Forward { owner, .. } => {
                return Err(Error::NotOwner {
                    owner: owner.to_string(),
                });
            }
            Route::Refuse(refusal) => return Err(refused(refusal)),
        };
        let delay = self
            .route_delay_ms
            .load(std::sync::atomic::Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        // An idle key runs the call on this task; a busy one queues it
        // (`ModuleSlot::call`). A timeout abandons the wait, not the call:
        // the key finishes it either way. The timer is made only once the
        // call is pending: an inline call usually finishes in its first
        // poll, and making a timer reads the clock and clones the runtime's
        // handle (a reference count every core calling at once would share).
        // The first poll is under one and a half slices (an inline call
        // still running at an epoch tick half a tick into its poll moves to
        // the key's task), so the wait is bounded by `timeout` plus that.
        // A `Pending` goes back to the executor before the call is polled
        // again: the call may have yielded on purpose (`yield_after_inline`).
        let mut call = std::pin::pin!(slot.call(
            &self.services,
            key,
            partition,
            token,
            message,
            Via::Routed,
            trace
        ));
        let mut timer = std::pin::pin!(None::<tokio::time::Sleep>);
        let reply = std::future::poll_fn(|cx| {
            if let std::task::Poll::Ready(reply) = call.as_mut().poll(cx) {
                return std::task::Poll::Ready(Some(reply));
            }
            if timer.is_none() {
                timer.set(Some(tokio::time::sleep(timeout)));
            }
            match timer.as_mut().as_pin_mut().map(|t| t.poll(cx)) {
                Some(std::task::Poll::Ready(())) => std::task::Poll::Ready(None),
                _ => std::task::Poll::Pending,
            }
        })
        .await
        .ok_or(Error::Timeout(timeout))??;
        let module_limit = slot.peek().options.max_reply_size;
        let limit = module_limit
            .map_or(self.config.max_message_size, |l| {
                l.min(self.config.max_message_size)
            })
            .as_u64() as usize;
        if reply.len() > limit {
            return Err(Error::ReplyTooLarge {
                size: reply.len(),
                limit,
            });
        }
        Ok(reply)
    }

    /// Send a key a one-way message, on whichever node owns it. A cast to
    /// another node is sent in the background; its failure is logged.
    pub(crate) fn cast(self: &Arc<Self>, module: &str, key: &str, message: Vec<u8>) -> Result<()> {
        self.check_message(&message)?;
        validate_key(key)?;
        let trace = crate::trace::current();
        if let Route::Forward { owner, .. } = self.route(key) {
            let addr = self.peer_addr_of(&owner)?;
            let request = PeerRequest::Cast {
                module: module.to_owned(),
                key: key.to_owned(),
                message,
                trace: trace.map(Into::into),
            };
            let node = self.clone();
            let timeout = self.config.call_timeout;
            tokio::spawn(async move {
                if let Err(error) = node.peers.request(&addr, request, timeout).await {
                    tracing::warn!(%owner, %error, "a forwarded cast failed");
                }
            });
            return Ok(());
        }
        self.deliver_local(module, key, Envelope::Cast { message, trace })
    }

    /// Serve a request forwarded by a peer: only if this node owns the key
    /// now (the owner's re-check); never forward it again.
    pub(crate) async fn serve_peer_request(
        self: &Arc<Self>,
        request: PeerRequest,
    ) -> Result<Vec<u8>> {
        match request {
            PeerRequest::Call {
                module,
                key,
                message,
                timeout_ms,
                trace,
            } => {
                self.check_message(&message)?;
                let timeout = Duration::from_millis(timeout_ms).min(self.config.call_timeout);
                let started = std::time::Instant::now();
                // The caller's trace, in a span of this node's own.
                let trace = served_trace(trace);
                let span = tracing::debug_span!(
                    "serve",
                    node = %self.node_id,
                    module = %module,
                    key = %key,
                    from = "peer",
                    trace_id = trace.map(|t| tracing::field::display(t.trace_hex()))
                );
                let reply = tracing::Instrument::instrument(
                    self.call_local(&module, &key, message, timeout, self.route(&key), trace),
                    span,
                )
                .await;
                self.metrics.call_done(
                    &module,
                    crate::metrics::CallRoute::Peer,
                    reply.is_ok(),
                    started.elapsed(),
                    || self.modules.load().contains_key(&module),
                );
                reply
            }
            PeerRequest::Cast {
                module,
                key,
                message,
                trace,
            } => {
                self.check_message(&message)?;
                let trace = served_trace(trace);
                self.deliver_local(&module, &key, Envelope::Cast { message, trace })
                    .map(|()| Vec::new())
            }
            PeerRequest::Handoff { entries, manifest } => {
                let receipt = lock(&self.handoffs).receive(&manifest, entries, &self.host_bytes);
                self.metrics.handoff_states("received", receipt.kept);
                if receipt.superseded > 0 {
                    // Copies an earlier attempt of the sender's left: the
                    // newer attempt carries what the sender still holds.
                    tracing::debug!(node = %self.node_id, dropped = receipt.superseded, "handoff states of an earlier attempt were dropped");
                    self.metrics
                        .handoff_states("dropped_stale", receipt.superseded);
                }
                Ok(Vec::new())
            }
            PeerRequest::Move { moves } => {
                let moves = moves
                    .into_iter()
                    .map(|(p, to)| (PartitionId(p), NodeId::new(to)))
                    .collect();
                self.apply(|m, now| m.on_move_request(now, moves));
                Ok(Vec::new())
            }
            PeerRequest::Nudge => {
                lock(&self.membership).nudge();
                self.wake.notify_one();
                self.deploys.wake();
                Ok(Vec::new())
            }
            PeerRequest::LoadedModules => Ok(self.loaded_modules()),
            PeerRequest::History => Ok(postcard::to_allocvec(&crate::wire::WireHistory(
                lock(&self.history).samples(),
            ))
            .unwrap_or_default()),
            PeerRequest::Cache(op) => self.cache_local(op).map(|outcome| outcome.encode()),
            PeerRequest::Hello { .. } => Ok(Vec::new()),
            PeerRequest::Interest(update) => self.serve_interest(update),
            PeerRequest::Publish { publications } => self.serve_publications(publications),
            PeerRequest::ConnEvents {
                module,
                key,
                seq,
                events,
                again,
            } => {
                let ack = self
                    .take_conn_events(&module, &key, seq, again, events)
                    .await?;
                postcard::to_stdvec(&ack)
                    .map_err(|e| Error::Internal(format!("encoding a connection ack: {e}")))
            }
            PeerRequest::ConnSend { sends } => Ok(self.serve_conn_sends(sends)),
            PeerRequest::Attach { attachments } => Ok(self.adopt_attachments(attachments)),
        }
    }
}

/// What the node does for its key processes ([`KeyNode`]): the key layer's
/// only calls up into the node.
impl KeyNode for NodeShared {
    /// Called by the key table (`ModuleSlot::deliver`) under its lock, so a
    /// drain that marked the partition either sees the new process or
    /// refuses it here. Refuses when the partition is no longer served here
    /// under `token` (a move began, the node fenced, the table changed).
    fn admit_activation(
        &self,
        module: &str,
        key: &str,
        partition: PartitionId,
        token: OwnershipToken,
    ) -> Result<Option<Vec<u8>>> {
        match self.route(key) {
            Route::Local {
                partition: p,
                token: t,
            } if p == partition && t == token => {}
            Route::Local { partition: p, .. } => return Err(Error::Unowned(p)),
            Route::Forward { owner, .. } => {
                return Err(Error::NotOwner {
                    owner: owner.to_string(),
                });
            }
            Route::Refuse(refusal) => return Err(refused(refusal)),
        }
        let (state, lost) = {
            let table = self.table();
            lock(&self.handoffs).take_for_activation(module, key, &table, &self.node_id)
        };
        if state.is_some() {
            self.metrics.handoff_states("delivered", 1);
        }
        if let Some(lost) = lost {
            self.handoff_dropped("dropped_stale", &[lost]);
        }
        Ok(state)
    }

    /// The oldest idle key of all modules goes: each module's table is
    /// looked at on its own (never two locked at once), and the one whose
    /// least recently used idle key was used longest ago evicts it.
    fn evict_oldest_idle(&self, cause: crate::key::Eviction) -> bool {
        let modules = self.modules.load();
        let mut by_age: Vec<_> = modules
            .values()
            .filter_map(|slot| slot.oldest_idle().map(|used| (used, slot)))
            .collect();
        by_age.sort_by_key(|(used, _)| *used);
        // The oldest may have been used since it was looked at: the next.
        let wakes = &self.services.runtime.tick_wakes;
        by_age
            .iter()
            .any(|(_, slot)| slot.evict_oldest(cause, wakes))
    }

    fn evictions_in_flight(&self) -> usize {
        let modules = self.modules.load();
        modules
            .values()
            .map(|slot| slot.evictions_in_flight())
            .sum()
    }

    fn has_module(&self, module: &str) -> bool {
        self.module(module).is_ok()
    }

    fn call_key(
        self: Arc<Self>,
        module: String,
        key: String,
        message: Vec<u8>,
        timeout: Duration,
    ) -> NodeFuture<Vec<u8>> {
        Box::pin(async move {
            self.call_with_timeout(&module, &key, message, timeout)
                .await
        })
    }

    fn cast_key(self: Arc<Self>, module: &str, key: &str, message: Vec<u8>) -> Result<()> {
        self.cast(module, key, message)
    }

    fn cache(self: Arc<Self>, op: CacheOp) -> NodeFuture<CacheOutcome> {
        Box::pin(async move { self.cache_op(op).await })
    }
}

/// The module's own message limit (`max_message_size` of its options), under
/// the node's, which the caller checked already. Every local delivery path
/// (the mailbox and the inline call of an idle key) checks it.
fn check_module_message(slot: &ModuleSlot, message: &[u8]) -> Result<()> {
    match slot.peek().options.max_message_size {
        Some(limit) if message.len() as u64 > limit.as_u64() => Err(Error::MessageTooLarge {
            size: message.len(),
            limit: limit.as_u64() as usize,
        }),
        _ => Ok(()),
    }
}

/// The trace a peer's request carries, in a span of this node's own; none
/// if it carries none or an invalid one (never a refusal).
fn served_trace(trace: Option<WireTrace>) -> Option<TraceContext> {
    trace
        .as_ref()
        .and_then(TraceContext::from_wire)
        .map(|t| t.child())
}

/// Whether a forwarding error suggests this node's table is stale.
/// Only errors that say the message was not processed: an answer lost on a
/// closed connection (`AnswerLost`) or a timeout may follow processing, and
/// a retry on a newer table would then process the message twice.
fn stale_route(error: &Error) -> bool {
    match error {
        Error::OwnerUnreachable { .. } => true,
        Error::Remote { code, .. } => code == "not_owner" || code == "fenced",
        _ => false,
    }
}

/// Name the owner by its node id (the transport only knows its address).
fn name_owner(error: Error, owner: &NodeId, addr: &str) -> Error {
    match error {
        Error::AnswerLost { .. } => Error::AnswerLost {
            owner: format!("{owner} (peer address {addr})"),
        },
        Error::OwnerUnreachable { why, .. } => Error::OwnerUnreachable {
            owner: owner.to_string(),
            why: format!("{why} (peer address {addr})"),
        },
        other => other,
    }
}

pub(crate) fn refused(refusal: RouteRefusal) -> Error {
    match refusal {
        RouteRefusal::Fenced => Error::Fenced,
        RouteRefusal::Unowned(p) => Error::Unowned(p),
    }
}
