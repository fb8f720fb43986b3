//! The executor's side of graceful handoffs, as the node does it
//! (`host/src/node/moves.rs`, and `host/src/handoff.rs`'s `HandoffStates`):
//! a move's stop collects its keys' states (a key retiring when idle is
//! waited for, and has none), the handoff sends them — with the states
//! waiting here for keys of its partitions, and the rows naming the move's
//! attempt for each of its partitions, states or none — to the target,
//! which keeps them for the keys' next process, and the move's end hands,
//! keeps or drops
//! what it collected (a stop answered after its move ended leaves nothing
//! behind). A state is a number (see [`Life::state`](super::node::Life)), so
//! the checker can tell one from another; every stop with a state, and every
//! handoff received, is told to the checker.
//!
//! The store, [`States`], owns the states a move collected (by the move's
//! id, until the move ends), as the node's `move_states` does; the states
//! waiting here for their keys' next process, and which of them belong to
//! the node's ownership, are the core's [`handoff::Store`] — the very
//! bookkeeping the node runs (`host/src/handoff.rs` wraps it), so this model
//! holds no copy of its rules. It must not decide anything about ownership:
//! the table it judges by is the node's `Membership`'s.

use std::collections::{BTreeMap, BTreeSet};

use super::Mutation;
use super::node::{EXECUTOR_DELAY_US, keys_in};
use super::world::{Ev, World, node_name};
use crate::handoff::{self, Row, Store, Taken};
use crate::membership::{MoveOutcome, OpId};
use crate::ownership::{NodeId, OwnershipTable};
use crate::partition::PartitionId;

/// One key's handoff state on its way, as a handoff carries it: the key's
/// name, and its state (a number).
pub(super) type Entry = handoff::Entry<String, u64>;

/// The handoff states of one node: those its moves collected, and those
/// waiting for their keys' next process.
#[derive(Debug, Default)]
pub(super) struct States {
    moves: BTreeMap<OpId, Vec<Entry>>,
    waiting: Store<String, u64>,
}

impl States {
    /// The states move `op`'s stop collected.
    pub(super) fn collected(&mut self, op: OpId, entries: Vec<Entry>) {
        self.moves.entry(op).or_default().extend(entries);
    }

    /// What move `move_id` collected, and those waiting here that belong
    /// to this node's ownership of `partitions` (taken: they travel with
    /// the move), as the handoff sends them. They stay under the move
    /// until it ends (`mutation` may break that, or drop those waiting).
    pub(super) fn take_to_send(
        &mut self,
        move_id: OpId,
        partitions: &BTreeSet<PartitionId>,
        table: &OwnershipTable,
        me: &NodeId,
        mutation: Option<Mutation>,
    ) -> Vec<Entry> {
        let mut waiting = self.waiting.take_partitions(partitions, table, me);
        if mutation == Some(Mutation::HandoffDropsWaiting) {
            waiting.clear();
        }
        let entries = self.moves.entry(move_id).or_default();
        entries.extend(waiting);
        if mutation == Some(Mutation::ReleaseBeforeAck) {
            return self.moves.remove(&move_id).unwrap_or_default();
        }
        entries.clone()
    }

    /// Move `move_id` ended: its states, to hand, keep or drop.
    pub(super) fn take_move(&mut self, move_id: OpId) -> Vec<Entry> {
        self.moves.remove(&move_id).unwrap_or_default()
    }

    /// A handoff received from a peer: the states it kept here (those of
    /// an attempt older than one already heard of are ignored).
    pub(super) fn receive(&mut self, manifest: &[Row], entries: &[Entry]) -> Vec<Entry> {
        let received = self.waiting.receive(manifest, entries.to_vec());
        entries
            .iter()
            .filter(|e| !received.ignored.iter().any(|i| i.name == e.name))
            .cloned()
            .collect()
    }

    /// States kept for this node's own ownership (a move that failed).
    pub(super) fn keep(&mut self, entries: Vec<Entry>) {
        self.waiting.keep(entries);
    }

    /// The state for `key`'s next process here, if one waits and belongs
    /// to this node's ownership; `true` if a stale one was dropped.
    pub(super) fn take_for_activation(
        &mut self,
        key: &str,
        table: &OwnershipTable,
        me: &NodeId,
    ) -> (Option<u64>, bool) {
        match self.waiting.take_for_activation(&key.to_owned(), table, me) {
            Taken::State(s) => (Some(s), false),
            Taken::Stale(_) => (None, true),
            Taken::Nothing => (None, false),
        }
    }

    /// Drop every waiting state `table` shows to be stale; their keys.
    pub(super) fn sweep(&mut self, table: &OwnershipTable, me: &NodeId) -> Vec<String> {
        let stale = self.waiting.sweep(table, me);
        stale.into_iter().map(|(k, _)| k).collect()
    }

    /// The fence: every waiting state dies with the ownership it was for.
    pub(super) fn clear(&mut self) -> usize {
        self.waiting.clear()
    }
}

impl World {
    /// `Effect::StopForHandoff`: stop node `i`'s live keys of `partitions`
    /// with `handoff`, each giving its state under the token the node's
    /// table holds its partition by, and answer once none is live (a
    /// retiring key is waited for: it ends with no state).
    pub(super) fn stop_for_handoff(
        &mut self,
        i: usize,
        op: OpId,
        partitions: &BTreeSet<PartitionId>,
    ) {
        let p = self.partitions;
        let node = &mut self.nodes[i];
        let inc = node.incarnation;
        let mut entries = Vec::new();
        let mut stopped = Vec::new();
        let mut answer_at = self.now + 1;
        for key in keys_in(&node.keys, p, partitions) {
            if let Some((until, _)) = node.keys[&key].retiring {
                answer_at = answer_at.max(until + 1);
                continue;
            }
            let life = node.keys.remove(&key).expect("listed above");
            self.checker.life_ended(life.id);
            let partition = p.of(&key);
            let token = node
                .membership
                .table()
                .owner(partition)
                .filter(|a| a.node == node.id)
                .map(|a| a.token);
            if let (Some(state), Some(token)) = (life.state, token) {
                self.checker.handed_off(&node.id, &key, partition, state);
                entries.push(Entry {
                    name: key.clone(),
                    partition,
                    token,
                    state,
                });
            }
            stopped.push(key);
        }
        let name = node_name(i);
        self.log(|| format!("{name}: stopping {partitions:?} for handoff: {stopped:?}"));
        let at = answer_at.max(self.now + self.rng.u64(0..=EXECUTOR_DELAY_US));
        self.at(
            at,
            Ev::KeysStopped {
                node: i,
                inc,
                op,
                entries,
            },
        );
    }

    /// Node `i`'s stop for move `op` is done: its states go under the
    /// move's id, then the membership hears of it; if the move ended
    /// meanwhile (a fence), what the stop collected is dropped.
    pub(super) fn keys_stopped(&mut self, i: usize, op: OpId, entries: Vec<Entry>) {
        self.nodes[i].states.collected(op, entries);
        self.input(i, |m, now| m.on_keys_stopped(now, op));
        if !self.nodes[i].membership.is_moving(op) {
            let dropped = self.nodes[i].states.take_move(op);
            let name = node_name(i);
            self.log(|| {
                format!(
                    "{name}: move {} had ended: {} states dropped",
                    op.0,
                    dropped.len()
                )
            });
        }
    }

    /// `Effect::SendHandoff`: send what move `move_id` collected, and the
    /// states waiting on node `i` for keys of `partitions`, to `to`.
    pub(super) fn send_handoff(
        &mut self,
        i: usize,
        op: OpId,
        move_id: OpId,
        to: &NodeId,
        addr: &str,
        partitions: &BTreeSet<PartitionId>,
    ) {
        let mutation = self.cfg.mutation;
        let node = &mut self.nodes[i];
        let inc = node.incarnation;
        let entries = node.states.take_to_send(
            move_id,
            partitions,
            node.membership.table(),
            &node.id,
            mutation,
        );
        let sent = entries.iter().map(|e| (e.partition, e.token));
        let table = node.membership.table();
        let manifest = handoff::manifest(move_id.into(), partitions, table, &node.id, sent);
        let name = node_name(i);
        let states: Vec<(&str, u64)> = entries.iter().map(|e| (e.name.as_str(), e.state)).collect();
        self.log(|| {
            format!(
                "{name}: handing {partitions:?} to {to} (attempt {}) with states {states:?}",
                move_id.0
            )
        });
        if let Some(t) = self.by_addr(addr) {
            // Sent even with no state: its rows supersede what an earlier
            // attempt left at the target.
            let handoff = Ev::Handoff {
                from: i,
                from_inc: inc,
                to: t,
                op,
                manifest,
                entries,
            };
            // One request on a connection, as a forwarded call: never
            // duplicated (a copy delivered after its key's next process
            // took the state would give a later process that old state —
            // a transport fault no receiver can tell from a new handoff).
            self.call(i, t, handoff);
        }
    }

    /// Node `to` received a handoff: it keeps the states for their keys'
    /// next process here (the checker hears of those it kept), and acks.
    pub(super) fn receive_handoff(
        &mut self,
        from: usize,
        from_inc: u64,
        to: usize,
        op: OpId,
        manifest: &[Row],
        entries: &[Entry],
    ) {
        let node = &mut self.nodes[to];
        let kept = node.states.receive(manifest, entries);
        let states = kept.iter().map(|e| (e.name.as_str(), e.token, e.state));
        self.checker.received(&node.id, states);
        let name = node_name(to);
        self.log(|| {
            format!(
                "{name}: received {} handoff states from {}, kept {}",
                entries.len(),
                node_name(from),
                kept.len()
            )
        });
        let ack = Ev::HandoffAck {
            node: from,
            inc: from_inc,
            op,
        };
        self.send(to, from, ack);
    }

    /// `Effect::MoveEnded`: what the move collected went with the
    /// partitions, stays here for the keys' next process, or dies with the
    /// ownership it was for.
    pub(super) fn move_ended(&mut self, i: usize, move_id: OpId, outcome: MoveOutcome) {
        let node = &mut self.nodes[i];
        let entries = node.states.take_move(move_id);
        let n = entries.len();
        if outcome == MoveOutcome::Kept {
            node.states.keep(entries);
        }
        let name = node_name(i);
        self.log(|| format!("{name}: move {} ended: {outcome:?} ({n} states)", move_id.0));
    }
}
