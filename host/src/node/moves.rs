//! Graceful moves and leave, as the node carries them out.
//!
//! The steps and what a failure means are `fief_core::Membership`'s (its
//! `moves` and `leave` modules); this file does what they name: stop the
//! keys of partitions being handed off with `handoff` and keep their states
//! under the move's id (`stop_move`), send those states (and any waiting
//! here for keys of the partitions) to the target in frames
//! (`send_handoff`), hand, keep or drop them when the move ends
//! (`move_ended`), send a leader's move request or a nudge to a peer
//! (`send_peer`), and run a graceful [`Instance::leave`]. It must not decide
//! which partitions move, in which order, or what a failed step means.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use fief_core::membership::{LeaveOutcome, MoveOutcome, OpId, PeerMessage};
use fief_core::{NodeId, PartitionId};
use serde::Serialize;

use super::{Instance, NodeShared};
use crate::bindings::types::StopReason;
use crate::error::{Error, Result};
use crate::handoff::LostState;
use crate::sync::lock;
use crate::wire::{HandoffEntry, PeerRequest};

impl NodeShared {
    /// Log and count handoff states this node had to drop.
    pub(super) fn handoff_dropped(&self, event: &'static str, lost: &[LostState]) {
        for l in lost {
            tracing::warn!(node = %self.node_id, module = %l.module, key = %l.key, reason = %l.reason, "a handoff state was dropped");
        }
        self.metrics.handoff_states(event, lost.len());
    }

    /// Stop every live key of `partitions` with `handoff`, collecting their
    /// states under the tokens this node holds the partitions by, and the
    /// keys whose states could not be had. Repeats until none is live (a
    /// message routed just before the partitions started draining may have
    /// activated one before the drain's mark: see `admit_activation`).
    async fn stop_for_handoff(
        &self,
        partitions: &BTreeSet<PartitionId>,
    ) -> (Vec<HandoffEntry>, Vec<LostState>) {
        let tokens: BTreeMap<u32, u64> = {
            let table = self.table();
            partitions
                .iter()
                .filter_map(|p| {
                    let a = table.owner(*p)?;
                    (a.node == self.node_id).then_some((p.0, a.token.0))
                })
                .collect()
        };
        let mut entries = Vec::new();
        let mut lost = Vec::new();
        // A process stopped in one round may still be listed in the next
        // (its task removes its entry just after answering): stop each key
        // once. No new process of these partitions starts meanwhile (see
        // `admit_activation`).
        let mut stopped: std::collections::HashSet<(String, String)> = Default::default();
        for _round in 0..10 {
            let mut stops = Vec::new();
            for slot in self.slots() {
                for live in slot.list() {
                    if partitions.contains(&PartitionId(live.partition))
                        && stopped.insert((live.module.clone(), live.key.clone()))
                        && let Some(rx) = slot.stop(&live.key, StopReason::Handoff)
                    {
                        stops.push((live.module, live.key, live.partition, rx));
                    }
                }
            }
            if stops.is_empty() {
                break;
            }
            for (module, key, partition, rx) in stops {
                match (rx.await, tokens.get(&partition)) {
                    (Ok(Ok(Some(state))), Some(&token)) => entries.push(HandoffEntry {
                        module,
                        key,
                        partition,
                        token,
                        state,
                    }),
                    (Ok(Ok(None)), _) | (Err(_), _) => {}
                    (Ok(Ok(Some(_))), None) => lost.push(LostState {
                        module,
                        key,
                        reason: "its partition was lost during the handoff".to_owned(),
                    }),
                    (Ok(Err(e)), _) => {
                        let event = match e {
                            Error::HandoffTooLarge { .. } => "too_large",
                            _ => "key_died",
                        };
                        let reason = e.to_string();
                        self.metrics.handoff_states(event, 1);
                        tracing::warn!(%module, %key, error = %reason, "a key's handoff state cannot travel");
                        lost.push(LostState {
                            module,
                            key,
                            reason,
                        });
                    }
                }
            }
        }
        (entries, lost)
    }

    /// Stop the keys of a move's partitions and keep their states under
    /// the move's id; the membership hears of it when none is live.
    pub(super) fn stop_move(self: &Arc<Self>, op: OpId, partitions: BTreeSet<PartitionId>) {
        let node = self.clone();
        self.main.spawn(async move {
            let (entries, lost) = node.stop_for_handoff(&partitions).await;
            if lock(&node.membership).is_leaving() {
                lock(&node.leave_losses).extend(lost);
            }
            lock(&node.move_states).insert(op, entries);
            node.apply(|m, now| m.on_keys_stopped(now, op));
            node.drop_states_of_ended_move(op);
        });
    }

    /// A move that ended (a fence) while its task was stopping keys or
    /// sending states: what that task kept under its id is dropped, not
    /// left behind (`move_ended` ran before the task put it there).
    fn drop_states_of_ended_move(&self, move_id: OpId) {
        if lock(&self.membership).is_moving(move_id) {
            return;
        }
        if let Some(entries) = lock(&self.move_states).remove(&move_id)
            && !entries.is_empty()
        {
            tracing::warn!(node = %self.node_id, dropped = entries.len(), "a move's handoff states were dropped by the fence");
            self.metrics.handoff_states("dropped_fence", entries.len());
        }
    }

    /// Send the states of move `move_id`, and those waiting here for keys
    /// of `partitions` (not activated since they came, or kept after a
    /// failed move), to `to` in frames under the peer frame limit, each
    /// naming the attempt (the move's id) its partitions' states belong to;
    /// at least one frame, states or none, so the attempt supersedes what
    /// an earlier one of this ownership left at the target.
    pub(super) fn send_handoff(
        self: &Arc<Self>,
        op: OpId,
        move_id: OpId,
        to: NodeId,
        addr: String,
        partitions: BTreeSet<PartitionId>,
    ) {
        let node = self.clone();
        self.main.spawn(async move {
            let table = node.table();
            let entries = {
                let waiting =
                    lock(&node.handoffs).take_partitions(&partitions, &table, &node.node_id);
                let mut states = lock(&node.move_states);
                let entries = states.entry(move_id).or_default();
                entries.extend(waiting);
                entries.clone()
            };
            let attempt = move_id.into();
            let manifest =
                crate::handoff::manifest(attempt, &partitions, &table, &node.node_id, &entries);
            drop(table);
            // A frame holds a state of up to `max_message_size` with its
            // names: however many states, none is too large to send (each is
            // at most the module's max_handoff_size, at most max_message_size).
            let budget = node.config.max_message_size.as_u64() as usize
                + crate::wire::FRAME_OVERHEAD / 2;
            let limit = node.config.call_timeout;
            let mut result = Ok(());
            for (manifest, entries) in crate::handoff::frames(manifest, entries, budget) {
                let request = PeerRequest::Handoff { entries, manifest };
                if let Err(e) = node.peers.request(&addr, request, limit).await {
                    tracing::warn!(node = %node.node_id, to = %to, error = %e, "handoff failed; keeping the partitions");
                    result = Err(e.to_string());
                    break;
                }
            }
            // The moving keys' WebSocket connections, so the target knows
            // them (and what of them was handled) before it serves a key:
            // none misses a frame the key sends meanwhile.
            if result.is_ok() {
                node.hand_attachments(&to, &addr, &partitions).await;
            }
            node.apply(|m, now| m.on_peer_done(now, op, result));
            node.drop_states_of_ended_move(move_id);
        });
    }

    /// A move ended: its states went with the partitions, stay here for
    /// the keys' next process, or die with the ownership they were for.
    pub(super) fn move_ended(&self, move_id: OpId, outcome: MoveOutcome) {
        let entries = lock(&self.move_states).remove(&move_id).unwrap_or_default();
        match outcome {
            MoveOutcome::Handed => {
                tracing::info!(node = %self.node_id, keys = entries.len(), "partitions handed off");
                self.metrics.handoff_states("sent", entries.len());
            }
            MoveOutcome::Kept => {
                // If the transfer did commit after all, the table will show
                // them stale here, and the target has its copies.
                self.metrics.handoff_states("kept", entries.len());
                lock(&self.handoffs).keep(entries, &self.host_bytes);
            }
            MoveOutcome::Dropped => {
                if !entries.is_empty() {
                    tracing::warn!(node = %self.node_id, dropped = entries.len(), "a move's handoff states were dropped by the fence");
                }
                self.metrics.handoff_states("dropped_fence", entries.len());
            }
        }
    }

    /// Send a leader's move request or a nudge to a peer; a failure is
    /// only logged (the leader asks again next round; a missed nudge is a
    /// later table read).
    pub(super) fn send_peer(self: &Arc<Self>, to: NodeId, addr: String, message: PeerMessage) {
        let node = self.clone();
        self.main.spawn(async move {
            let request = match message {
                PeerMessage::Move(moves) => PeerRequest::Move {
                    moves: moves
                        .into_iter()
                        .map(|(p, to)| (p.0, to.to_string()))
                        .collect(),
                },
                PeerMessage::Nudge => PeerRequest::Nudge,
            };
            let limit = node.config.call_timeout;
            if let Err(e) = node.peers.request(&addr, request, limit).await {
                tracing::debug!(node = %node.node_id, %to, error = %e, "a message to a peer failed");
            }
        });
    }
}

/// What a graceful [`Instance::leave`] did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LeaveReport {
    /// Keys whose handoff state could not travel, by name, with why; every
    /// other key's state went with its partition.
    pub lost_states: Vec<LostState>,
    /// There was no other live node to hand to: the keys stopped here, and
    /// their states ended with them.
    pub no_other_node: bool,
    /// The arbiter confirmed the lease's release. When false it never
    /// answered (for a lease TTL): the lease, fenced here, lapses at its
    /// TTL and others take the partitions it still held then.
    pub released: bool,
}

impl Instance {
    /// Leave the cluster gracefully: mark this node as leaving at the
    /// arbiter, let the leader move every partition it owns to other nodes
    /// (each key stops with `handoff`, and its state travels to the new
    /// owner's `init`), then fence and release the lease. The node serves
    /// nothing afterwards; stop it with [`Instance::shutdown`]. A node with
    /// no other live node to hand to just releases its lease.
    ///
    /// The report names every key whose handoff state could not travel (too
    /// large for its module's `max_handoff_size`, or its `handoff` trapped);
    /// every other key's state went with its partition.
    ///
    /// # Errors
    ///
    /// [`Error::Fenced`] if the node holds no lease, [`Error::Timeout`] if
    /// the partitions did not all move within `timeout`,
    /// [`Error::FencedWhileLeaving`] if a fence cut it short, or an arbiter
    /// error.
    pub async fn leave(&self, timeout: Duration) -> Result<LeaveReport> {
        let shared = &self.shared;
        let (tx, rx) = tokio::sync::oneshot::channel();
        {
            // One leave at a time: a second must not take the first's
            // waiter (its caller would never hear how the leave ended).
            let mut waiter = lock(&shared.leave_waiter);
            if waiter.is_some() {
                return Err(Error::AlreadyLeaving);
            }
            *waiter = Some(tx);
        }
        lock(&shared.leave_losses).clear();
        shared.apply(|m, now| m.begin_leave(now, timeout));
        // The mark, the read and the moves are bounded by `timeout`; the
        // release by a lease TTL (each step retried every LEAVE_RETRY).
        let slack = shared.config.lease_ttl + shared.config.renew_interval * 4;
        let outcome = match tokio::time::timeout(timeout + slack, rx).await {
            Ok(Ok(outcome)) => outcome,
            _ => {
                // No answer: let a later leave ask again.
                lock(&shared.leave_waiter).take();
                return Err(Error::Timeout(timeout));
            }
        };
        let (no_other_node, released) = match outcome {
            LeaveOutcome::Left {
                no_other_node,
                released,
            } => (no_other_node, released),
            LeaveOutcome::FencedWhileLeaving => {
                self.coordination.abort();
                return Err(Error::FencedWhileLeaving);
            }
            LeaveOutcome::TimedOut => return Err(Error::Timeout(timeout)),
            LeaveOutcome::NotMember => return Err(Error::Fenced),
            LeaveOutcome::AlreadyLeaving => return Err(Error::AlreadyLeaving),
            LeaveOutcome::ArbiterFailed(why) => {
                if lock(&shared.membership).is_stopped() {
                    self.coordination.abort();
                }
                return Err(Error::ArbiterUnavailable(why));
            }
        };
        // The membership coordinates nothing any more: stop its thread.
        self.coordination.abort();
        let report = LeaveReport {
            lost_states: std::mem::take(&mut *lock(&shared.leave_losses)),
            no_other_node,
            released,
        };
        if !released {
            tracing::warn!(node = %shared.node_id, "the arbiter never confirmed the lease's release: it is fenced here and lapses at its TTL");
        }
        tracing::info!(node = %shared.node_id, lost_states = report.lost_states.len(), no_other_node = report.no_other_node, "left the cluster");
        Ok(report)
    }
}
