//! Graceful moves out of this node, as a step machine: per target, drain
//! (routing refuses the partitions) → stop their keys for handoff → send the
//! states → transfer at the arbiter → adopt the transfer's table → release
//! the drain. One target at a time, move requests in order.
//!
//! What a failed step means is decided here, once: a failed handoff keeps
//! the partitions (served again at once, the states kept for the keys' next
//! process); a failed transfer may have committed all the same (its answer
//! lost), so its partitions are *unsure* until a round's table read sent
//! later settles them. A target the arbiter lists no peer address for is
//! skipped, and the move goes on with the next target. A fence drops the
//! move. It must not touch keys or states itself: it names partitions and
//! moves, the executor does the rest.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::{Effect, Membership, MoveOutcome, OpKind, PeerMessage, Then};
use crate::coordinator::{Reply, Request};
use crate::ownership::NodeId;
use crate::partition::PartitionId;
use crate::time::Instant;

use super::OpId;
use crate::arbiter::LeaseId;

/// The moves of one node: the requests waiting, the one in progress.
#[derive(Debug, Default)]
pub(super) struct Moves {
    queue: VecDeque<Vec<(PartitionId, NodeId)>>,
    current: Option<MoveOut>,
}

/// One move request in progress.
#[derive(Debug)]
struct MoveOut {
    lease: LeaseId,
    targets: VecDeque<(NodeId, BTreeSet<PartitionId>)>,
    step: Option<Target>,
}

/// The move to one target.
#[derive(Debug)]
struct Target {
    /// Names the move (its states) in effects.
    id: OpId,
    to: NodeId,
    addr: String,
    partitions: BTreeSet<PartitionId>,
    step: Step,
}

#[derive(Debug, PartialEq, Eq)]
enum Step {
    Stopping,
    Handing(OpId),
    Transferring(OpId),
    Adopting,
}

impl Moves {
    /// Whether `move_id` names the move to the current target.
    pub(super) fn is_current(&self, move_id: OpId) -> bool {
        self.target().is_some_and(|t| t.id == move_id)
    }

    /// Whether `op` is the current target's handoff.
    pub(super) fn is_handing(&self, op: OpId) -> bool {
        self.target().is_some_and(|t| t.step == Step::Handing(op))
    }

    fn target(&self) -> Option<&Target> {
        self.current.as_ref().and_then(|m| m.step.as_ref())
    }
}

impl Membership {
    /// Queue a move request; start it if none is in progress.
    pub(super) fn request_moves(
        &mut self,
        now: Instant,
        moves: Vec<(PartitionId, NodeId)>,
        out: &mut Vec<Effect>,
    ) {
        if self.lease.is_none() || self.stopped {
            return;
        }
        self.moves.queue.push_back(moves);
        if self.moves.current.is_none() {
            self.next_request(now, out);
        }
    }

    /// Take the next request: group what this node still owns by target.
    fn next_request(&mut self, now: Instant, out: &mut Vec<Effect>) {
        while let Some(moves) = self.moves.queue.pop_front() {
            let Some(lease) = self.lease else {
                self.moves.queue.clear();
                return;
            };
            let mut by_target: BTreeMap<NodeId, BTreeSet<PartitionId>> = BTreeMap::new();
            for (partition, to) in moves {
                let mine = self
                    .table
                    .owner(partition)
                    .is_some_and(|a| a.node == self.cfg.me);
                if mine && to != self.cfg.me {
                    by_target.entry(to).or_default().insert(partition);
                }
            }
            self.moves.current = Some(MoveOut {
                lease,
                targets: by_target.into_iter().collect(),
                step: None,
            });
            if self.next_target(now, out) {
                return;
            }
        }
    }

    /// Start the move to the next target; `false` when the request is done.
    fn next_target(&mut self, now: Instant, out: &mut Vec<Effect>) -> bool {
        loop {
            let Some(current) = self.moves.current.as_mut() else {
                return false;
            };
            let Some((to, partitions)) = current.targets.pop_front() else {
                self.moves.current = None;
                return false;
            };
            // No address for the target: skip it, not the whole request.
            let Some(addr) = self.addr_of(&to) else {
                continue;
            };
            // Only what is still this node's (an adoption since the request
            // may have taken some away), and sure to be: an unsure one's
            // transfer may have committed, and the target used its states
            // since (moved again, they would be served a second time).
            let partitions: BTreeSet<PartitionId> = partitions
                .into_iter()
                .filter(|p| self.table.owner(*p).is_some_and(|a| a.node == self.cfg.me))
                .filter(|p| !self.unsure.contains_key(p))
                .collect();
            if partitions.is_empty() {
                continue;
            }
            self.draining.extend(partitions.iter().copied());
            self.view_dirty = true;
            let id = self.op(OpKind::Move, None);
            out.push(Effect::StopForHandoff {
                op: id,
                partitions: partitions.clone(),
            });
            let _ = now;
            if let Some(current) = self.moves.current.as_mut() {
                current.step = Some(Target {
                    id,
                    to,
                    addr,
                    partitions,
                    step: Step::Stopping,
                });
            }
            return true;
        }
    }

    fn target_mut(&mut self) -> Option<&mut Target> {
        self.moves.current.as_mut().and_then(|m| m.step.as_mut())
    }

    /// The move's keys are stopped: send their states.
    pub(super) fn keys_stopped(&mut self, now: Instant, op: OpId, out: &mut Vec<Effect>) {
        if !self
            .moves
            .target()
            .is_some_and(|t| t.id == op && t.step == Step::Stopping)
        {
            return;
        }
        let send = self.op(OpKind::Move, Some(now + self.cfg.step_timeout));
        let Some(t) = self.target_mut() else { return };
        t.step = Step::Handing(send);
        out.push(Effect::SendHandoff {
            op: send,
            move_id: t.id,
            to: t.to.clone(),
            addr: t.addr.clone(),
            partitions: t.partitions.clone(),
        });
    }

    /// The target answered the handoff (`ok`: it keeps the states), or it
    /// timed out.
    pub(super) fn handoff_answered(
        &mut self,
        now: Instant,
        op: OpId,
        ok: bool,
        out: &mut Vec<Effect>,
    ) {
        if !self.moves.is_handing(op) {
            return;
        }
        if !ok {
            return self.step_failed(now, false, out);
        }
        let transfer = self.op(OpKind::Move, Some(now + self.cfg.step_timeout));
        let Some(lease) = self.moves.current.as_ref().map(|m| m.lease) else {
            return;
        };
        let early = self.mutated(|m| m.drain_released_at_transfer);
        let Some(t) = self.target_mut() else { return };
        t.step = Step::Transferring(transfer);
        let changes = t.partitions.iter().map(|p| (*p, t.to.clone())).collect();
        if early {
            let partitions = t.partitions.clone();
            for p in &partitions {
                self.draining.remove(p);
            }
            self.view_dirty = true;
        }
        out.push(Effect::ArbiterOp {
            op: transfer,
            request: Request::Transfer(lease, changes),
        });
    }

    /// The arbiter answered the transfer: on success adopt its table, and
    /// only then release the drain.
    pub(super) fn transfer_answered(
        &mut self,
        now: Instant,
        op: OpId,
        reply: Reply,
        out: &mut Vec<Effect>,
    ) {
        if !self
            .moves
            .target()
            .is_some_and(|t| t.step == Step::Transferring(op))
        {
            return;
        }
        match reply {
            Reply::Table(table) => {
                if let Some(t) = self.target_mut() {
                    t.step = Step::Adopting;
                }
                let lease = self.moves.current.as_ref().map(|m| m.lease);
                if lease.is_some() && lease == self.lease {
                    self.adopt(now, table, Then::Moved, out);
                } else {
                    self.moved(now, out);
                }
            }
            // Refused, or no answer: it may have committed all the same.
            _ => self.step_failed(now, true, out),
        }
    }

    /// The transfer's table is adopted: the partitions are the target's.
    pub(super) fn moved(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let Some(t) = self.moves.current.as_mut().and_then(|m| m.step.take()) else {
            return;
        };
        for p in &t.partitions {
            self.draining.remove(p);
        }
        self.view_dirty = true;
        out.push(Effect::MoveEnded {
            move_id: t.id,
            outcome: MoveOutcome::Handed,
        });
        out.push(Effect::Peer {
            to: t.to,
            addr: t.addr,
            message: PeerMessage::Nudge,
        });
        self.advance(now, out);
    }

    /// A step failed: the partitions stay here; after a transfer they are
    /// unsure (not served until a later table read settles them).
    fn step_failed(&mut self, now: Instant, unsure: bool, out: &mut Vec<Effect>) {
        let Some(t) = self.moves.current.as_mut().and_then(|m| m.step.take()) else {
            return;
        };
        for p in &t.partitions {
            self.draining.remove(p);
            if unsure {
                self.unsure.insert(*p, now);
            }
        }
        self.view_dirty = true;
        out.push(Effect::MoveEnded {
            move_id: t.id,
            outcome: MoveOutcome::Kept,
        });
        self.advance(now, out);
    }

    /// On to the next target, or the next request.
    fn advance(&mut self, now: Instant, out: &mut Vec<Effect>) {
        if !self.next_target(now, out) {
            self.next_request(now, out);
        }
    }

    /// The ownership ended (a fence, a leave): drop the move in progress
    /// and every request waiting.
    pub(super) fn abandon_moves(&mut self, out: &mut Vec<Effect>) {
        self.moves.queue.clear();
        if let Some(t) = self.moves.current.take().and_then(|m| m.step) {
            for op in [t.id].into_iter().chain(match t.step {
                Step::Handing(op) | Step::Transferring(op) => Some(op),
                Step::Stopping | Step::Adopting => None,
            }) {
                self.ops.remove(&op);
            }
            for p in &t.partitions {
                self.draining.remove(p);
            }
            self.view_dirty = true;
            out.push(Effect::MoveEnded {
                move_id: t.id,
                outcome: MoveOutcome::Dropped,
            });
        }
    }
}
