//! Graceful moves: handing partitions and their keys' states to other nodes.
//!
//! This file owns a move out of this node (`move_out`, one at a time): stop
//! routing the partitions, stop their keys with `handoff`, send the states to
//! the target in frames, transfer the partitions at the arbiter, and keep the
//! states here if a step fails. Also the leader's requests to the owners to
//! move (`start_moves`), the bookkeeping of dropped handoff states, and a
//! graceful [`Instance::leave`]. It must not decide which partitions move (the
//! core's coordinator does); a partition it drains is refused by routing
//! until the move has ended.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use fief_core::{NodeId, PartitionId};
use serde::Serialize;
use tokio::runtime::Handle;

use super::coordination::bounded;
use super::{Instance, NodeShared};
use crate::arbiter::ArbiterError;
use crate::bindings::types::StopReason;
use crate::config::ModuleOptions;
use crate::error::{Error, Result};
use crate::handoff::LostState;
use crate::key::lock;
use crate::transport::{HandoffEntry, PeerRequest};

impl NodeShared {
    /// Log and count handoff states this node had to drop.
    pub(super) fn handoff_dropped(&self, event: &'static str, lost: &[LostState]) {
        for l in lost {
            tracing::warn!(node = %self.node_id, module = %l.module, key = %l.key, reason = %l.reason, "a handoff state was dropped");
        }
        self.metrics.handoff_states(event, lost.len());
    }

    /// The largest handoff state a key of a module with `options` may hand
    /// on: its `max_handoff_size`, at most the node's `max_message_size`.
    pub(crate) fn max_handoff_size(&self, options: &ModuleOptions) -> usize {
        let node = self.config.max_message_size;
        options
            .max_handoff_size
            .map_or(node, |l| l.min(node))
            .as_u64() as usize
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

    /// Graceful move out: hand `moves` (partitions this node owns) to their
    /// targets. Per target: stop routing the partitions, stop their keys with
    /// `handoff`, send the states to the target, then give the partitions
    /// away at the arbiter. If a step fails the partitions stay here and the
    /// states are kept for the keys' next activation.
    pub(crate) async fn move_out(
        self: &Arc<Self>,
        moves: Vec<(PartitionId, NodeId)>,
    ) -> Result<()> {
        let _one_at_a_time = self.moving.lock().await;
        let lease = (*lock(&self.lease_id)).ok_or(Error::Fenced)?;
        let mut by_target: BTreeMap<NodeId, BTreeSet<PartitionId>> = BTreeMap::new();
        {
            let table = self.table();
            for (partition, to) in moves {
                let mine = table
                    .owner(partition)
                    .is_some_and(|a| a.node == self.node_id);
                if mine && to != self.node_id {
                    by_target.entry(to).or_default().insert(partition);
                }
            }
        }
        let ns = &self.config.namespace;
        let limit = self.config.call_timeout;
        // A frame holds a state of up to `max_message_size` with its names.
        let budget =
            self.config.max_message_size.as_u64() as usize + crate::transport::FRAME_OVERHEAD / 2;
        for (to, partitions) in by_target {
            let addr = self.peer_addr_of(&to)?;
            lock(&self.draining).extend(partitions.iter().copied());
            let (mut entries, lost) = self.stop_for_handoff(&partitions).await;
            // States that wait here for keys not activated since they came
            // (or since a move failed) travel too.
            entries.extend({
                let table = self.table();
                lock(&self.handoffs).take_partitions(&partitions, &table, &self.node_id)
            });
            if self.leaving.load(std::sync::atomic::Ordering::SeqCst) {
                lock(&self.leave_losses).extend(lost);
            }
            // Once the transfer is sent, a failure leaves its outcome
            // unknown: the arbiter may have committed it, its answer lost.
            let mut transfer_sent = false;
            let handed = async {
                // In frames under the peer frame limit: however many states,
                // none is too large to send (each is at most the module's
                // max_handoff_size, at most max_message_size).
                for batch in crate::handoff::batches(entries.clone(), budget) {
                    let request = PeerRequest::Handoff { entries: batch };
                    self.peers.request(&addr, request, limit).await?;
                }
                transfer_sent = true;
                let changes = partitions.iter().map(|p| (*p, to.clone())).collect();
                bounded(
                    limit,
                    self.arbiter.transfer(ns, &self.node_id, lease, changes),
                )
                .await
                .map_err(|e| Error::Internal(format!("the arbiter refused the handoff: {e}")))
            }
            .await;
            match handed {
                Ok(table) => {
                    // Adopted only under the lease the move was made under
                    // (after a fence, and maybe a rejoin, it is not this
                    // node's table), and like any adoption: survivors of
                    // partitions it gains are reaped first (found by the
                    // simulation).
                    if *lock(&self.lease_id) == Some(lease) {
                        self.adopt_table(table).await;
                    }
                    self.metrics.handoff_states("sent", entries.len());
                    tracing::info!(node = %self.node_id, to = %to, partitions = partitions.len(), keys = entries.len(), "partitions handed off");
                    let _ = self.peers.request(&addr, PeerRequest::Nudge, limit).await;
                }
                Err(e) => {
                    tracing::warn!(node = %self.node_id, to = %to, error = %e, "handoff failed; keeping the partitions");
                    if transfer_sent {
                        // Not served again until a table read sent after
                        // now says whose they are (found by the simulation:
                        // serving them at once double-owns them when the
                        // transfer did commit).
                        let now = self.clock.now();
                        lock(&self.unsure).extend(partitions.iter().map(|p| (*p, now)));
                    }
                    // Kept for this node's ownership: the keys' next process
                    // here takes them, or the next move carries them on. If
                    // the transfer did commit, the table will show them stale
                    // here, and the target has its copies.
                    self.metrics.handoff_states("kept", entries.len());
                    lock(&self.handoffs).keep(entries, &self.host_bytes);
                }
            }
            let mut draining = lock(&self.draining);
            for p in &partitions {
                draining.remove(p);
            }
        }
        Ok(())
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
}

impl Instance {
    /// Leave the cluster gracefully: mark this node as leaving at the
    /// arbiter, let the leader move every partition it owns to other nodes
    /// (each key stops with `handoff`, and its state travels to the new
    /// owner's `init`), then release the lease. The node serves nothing
    /// afterwards; stop it with [`Instance::shutdown`]. A node with no other
    /// live node to hand to just releases its lease.
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
        let ns = &shared.config.namespace;
        let limit = shared.config.renew_interval;
        let lease = (*lock(&shared.lease_id)).ok_or(Error::Fenced)?;
        let arbiter_error = |e: ArbiterError| Error::OwnerUnreachable {
            owner: "the arbiter".to_owned(),
            why: e.to_string(),
        };
        lock(&shared.leave_losses).clear();
        shared
            .leaving
            .store(true, std::sync::atomic::Ordering::SeqCst);
        bounded(
            limit,
            shared.arbiter.set_leaving(ns, &shared.node_id, lease),
        )
        .await
        .map_err(arbiter_error)?;
        let members = bounded(limit, shared.arbiter.live_nodes(ns))
            .await
            .map_err(arbiter_error)?;
        let others = members
            .iter()
            .any(|m| m.node != shared.node_id && !m.leaving);
        // A fence during the leave forgets the table, so "owns nothing"
        // would then be true without one handoff: the keys it still held
        // were stopped by the fence. That is not a graceful leave; say so.
        let fenced_meanwhile = || {
            *lock(&shared.lease_id) != Some(lease)
                || shared
                    .fenced_this_lease
                    .load(std::sync::atomic::Ordering::SeqCst)
        };
        if others {
            tracing::info!(node = %shared.node_id, "leaving: handing off partitions");
            let deadline = tokio::time::Instant::now() + timeout;
            loop {
                // Nothing is left to hand off: finish leaving, then say so.
                if fenced_meanwhile() {
                    break;
                }
                if shared.table().count_owned_by(&shared.node_id) == 0 {
                    break;
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(Error::Timeout(timeout));
                }
                shared.sync_now.notify_one();
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        self.coordination.abort();
        let fenced = fenced_meanwhile();
        // Stop serving before the release: once released, the arbiter lets
        // others take whatever this node still owns (found by the
        // simulation, when a leave found no other node to hand off to).
        lock(&shared.lease).fence_now(shared.clock.now());
        bounded(limit, shared.arbiter.release(ns, &shared.node_id, lease))
            .await
            .map_err(arbiter_error)?;
        let report = LeaveReport {
            lost_states: std::mem::take(&mut *lock(&shared.leave_losses)),
            no_other_node: !others,
        };
        tracing::info!(node = %shared.node_id, lost_states = report.lost_states.len(), no_other_node = report.no_other_node, "left the cluster");
        if fenced {
            return Err(Error::FencedWhileLeaving);
        }
        Ok(report)
    }
}

/// As leader: ask each owner to hand the listed partitions to the listed
/// nodes (the coordinator's graceful moves). Each owner moves its own. On
/// the node's runtime (`main`): a move runs guest `handoff`s.
pub(super) fn start_moves(
    shared: &Arc<NodeShared>,
    main: &Handle,
    by_owner: Vec<(NodeId, Vec<(PartitionId, NodeId)>)>,
) {
    for (owner, moves) in by_owner {
        let node = shared.clone();
        main.spawn(async move {
            let result = if owner == node.node_id {
                node.move_out(moves).await
            } else {
                let request = PeerRequest::Move {
                    moves: moves
                        .into_iter()
                        .map(|(p, to)| (p.0, to.to_string()))
                        .collect(),
                };
                match node.peer_addr_of(&owner) {
                    Ok(addr) => node
                        .peers
                        .request(&addr, request, node.config.call_timeout)
                        .await
                        .map(|_| ()),
                    Err(e) => Err(e),
                }
            };
            if let Err(e) = result {
                tracing::debug!(node = %node.node_id, %owner, error = %e, "asking for a handoff failed");
            }
        });
    }
}
