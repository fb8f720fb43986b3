//! Handoff states between a key's processes on different nodes.
//!
//! A graceful move stops a partition's keys with `handoff` and sends their
//! states to the partition's next owner, which gives each one to that key's
//! next process (contract §3, §5 row 8: "handoff state arrives"). This module
//! owns the states that wait here for that: the ones this node was sent, and
//! the ones it kept after a move that failed. It decides which of them still
//! belong to an ownership of this node, and cuts outgoing states into frames.
//!
//! The rules, each held by a test (`docs/design.md`, "Graceful handoff"):
//! - A waiting state stays until its key's next process takes it, however
//!   long that is, and travels on with any later move of its partition
//!   ([`HandoffStates::take_partitions`]): it never expires.
//! - A state sent to this node is served only if the table says this node got
//!   the partition *by that very transfer* ([`fief_core::Assignment::handed_from`]
//!   equals the token the sender held it under). A state from a transfer that
//!   never committed, or from an ownership that has since moved elsewhere, is
//!   dropped when the table shows it, never served (it would be old).
//! - A fence drops every waiting state (un-persisted state dies with the
//!   ownership, guarantee 4). Every drop is logged and counted
//!   (`fief_handoff_states`).
//!
//! It must not do I/O or wait: the node calls it under its own locks.

use std::collections::HashMap;

use fief_core::{NodeId, OwnershipTable, OwnershipToken, PartitionId};

use crate::host_bytes::{Held, TenantLedgers};
use crate::transport::HandoffEntry;

/// Why a waiting state may (or may not) be given to a process here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Basis {
    /// Sent by the previous owner, which held the partition under this
    /// token: valid once this node owns it by a handoff from that token.
    Sent { from: OwnershipToken },
    /// Kept by this node under its own ownership with this token (a move
    /// out that failed, or a sent state already confirmed).
    Owned { token: OwnershipToken },
}

/// What the table says of one waiting state.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// It belongs to this node's current ownership of its partition.
    Valid(OwnershipToken),
    /// This node's table is not yet as new as the state: keep it.
    Wait,
    /// The ownership it was meant for never began or has ended.
    Stale,
}

#[derive(Debug)]
struct Waiting {
    partition: PartitionId,
    basis: Basis,
    state: Vec<u8>,
    /// The state's bytes, charged to its tenant's host-memory ledger
    /// whatever its limit: refusing a state that already exists would lose
    /// it ([`crate::host_bytes`]).
    _held: Held,
}

impl Waiting {
    fn verdict(&self, table: &OwnershipTable, me: &NodeId) -> Verdict {
        let owner = table.owner(self.partition);
        let newer_than = |t: OwnershipToken| match owner {
            Some(a) => a.token > t,
            None => table.epoch() >= t.0,
        };
        match self.basis {
            Basis::Owned { token } => match owner {
                Some(a) if &a.node == me && a.token == token => Verdict::Valid(token),
                _ if newer_than(token) => Verdict::Stale,
                _ => Verdict::Wait,
            },
            Basis::Sent { from } => match owner {
                Some(a) if &a.node == me && a.handed_from == Some(from) => Verdict::Valid(a.token),
                _ if newer_than(from) => Verdict::Stale,
                _ => Verdict::Wait,
            },
        }
    }
}

/// A state this node could not keep or pass on, for logs and the leave's
/// report.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LostState {
    /// The key's module.
    pub module: String,
    /// The key.
    pub key: String,
    /// Why its state was lost.
    pub reason: String,
}

/// The handoff states waiting on one node, by (module, key).
#[derive(Debug, Default)]
pub(crate) struct HandoffStates {
    waiting: HashMap<(String, String), Waiting>,
    bytes: usize,
}

impl HandoffStates {
    /// States received from a peer: each replaces any older one of its key.
    pub(crate) fn receive(&mut self, entries: Vec<HandoffEntry>, ledgers: &TenantLedgers) -> usize {
        let n = entries.len();
        self.insert_all(entries, ledgers, |token| Basis::Sent { from: token });
        n
    }

    /// States this node keeps for its own ownership of their partitions
    /// under the tokens the entries name (a move that failed).
    pub(crate) fn keep(&mut self, entries: Vec<HandoffEntry>, ledgers: &TenantLedgers) {
        self.insert_all(entries, ledgers, |token| Basis::Owned { token });
    }

    /// Insert `entries`, each waiting on the basis its token gives.
    fn insert_all(
        &mut self,
        entries: Vec<HandoffEntry>,
        ledgers: &TenantLedgers,
        basis: impl Fn(OwnershipToken) -> Basis,
    ) {
        for entry in entries {
            let tenant = crate::auth::tenant_of(&entry.module).unwrap_or("");
            let held = ledgers
                .of(tenant)
                .force(entry.state.len() + entry.module.len() + entry.key.len());
            let waiting = Waiting {
                partition: PartitionId(entry.partition),
                basis: basis(OwnershipToken(entry.token)),
                state: entry.state,
                _held: held,
            };
            self.insert(entry.module, entry.key, waiting);
        }
    }

    fn insert(&mut self, module: String, key: String, waiting: Waiting) {
        self.bytes += waiting.state.len();
        if let Some(old) = self.waiting.insert((module, key), waiting) {
            self.bytes -= old.state.len();
        }
    }

    fn remove(&mut self, module: &str, key: &str) -> Option<Waiting> {
        // Activations are common and handoffs rare: no allocation when
        // nothing waits.
        if self.waiting.is_empty() {
            return None;
        }
        let waiting = self.waiting.remove(&(module.to_owned(), key.to_owned()))?;
        self.bytes -= waiting.state.len();
        Some(waiting)
    }

    /// The state for `module`/`key`'s next process on this node, if one
    /// waits and belongs to this node's ownership per `table`. A stale one
    /// is dropped (and returned as lost); one the table is not yet new
    /// enough for stays.
    pub(crate) fn take_for_activation(
        &mut self,
        module: &str,
        key: &str,
        table: &OwnershipTable,
        me: &NodeId,
    ) -> (Option<Vec<u8>>, Option<LostState>) {
        let Some(waiting) = self.remove(module, key) else {
            return (None, None);
        };
        match waiting.verdict(table, me) {
            Verdict::Valid(_) => (Some(waiting.state), None),
            Verdict::Stale => (None, Some(stale(module, key))),
            Verdict::Wait => {
                self.insert(module.to_owned(), key.to_owned(), waiting);
                (None, None)
            }
        }
    }

    /// Take every waiting state of `partitions` that belongs to this node's
    /// ownership, to travel with a move out: as entries under the token this
    /// node holds each partition by.
    pub(crate) fn take_partitions(
        &mut self,
        partitions: &std::collections::BTreeSet<PartitionId>,
        table: &OwnershipTable,
        me: &NodeId,
    ) -> Vec<HandoffEntry> {
        if self.waiting.is_empty() {
            return Vec::new();
        }
        let names: Vec<(String, String)> = self
            .waiting
            .iter()
            .filter(|(_, w)| partitions.contains(&w.partition))
            .filter(|(_, w)| matches!(w.verdict(table, me), Verdict::Valid(_)))
            .map(|(name, _)| name.clone())
            .collect();
        let mut entries = Vec::with_capacity(names.len());
        for (module, key) in names {
            let waiting = self.remove(&module, &key).expect("listed above");
            let Verdict::Valid(token) = waiting.verdict(table, me) else {
                unreachable!("filtered above")
            };
            entries.push(HandoffEntry {
                module,
                key,
                partition: waiting.partition.0,
                token: token.0,
                state: waiting.state,
            });
        }
        entries
    }

    /// Drop every state `table` shows to be stale; returns them.
    pub(crate) fn sweep(&mut self, table: &OwnershipTable, me: &NodeId) -> Vec<LostState> {
        if self.waiting.is_empty() {
            return Vec::new();
        }
        let names: Vec<(String, String)> = self
            .waiting
            .iter()
            .filter(|(_, w)| w.verdict(table, me) == Verdict::Stale)
            .map(|(name, _)| name.clone())
            .collect();
        names
            .into_iter()
            .map(|(module, key)| {
                self.remove(&module, &key);
                stale(&module, &key)
            })
            .collect()
    }

    /// Drop everything (the node fenced); returns how many were dropped.
    pub(crate) fn clear(&mut self) -> usize {
        let n = self.waiting.len();
        self.waiting.clear();
        self.bytes = 0;
        n
    }

    /// How many states wait, and their bytes.
    pub(crate) fn size(&self) -> (usize, usize) {
        (self.waiting.len(), self.bytes)
    }
}

fn stale(module: &str, key: &str) -> LostState {
    LostState {
        module: module.to_owned(),
        key: key.to_owned(),
        reason: "its handoff was for an ownership that never began or has ended".to_owned(),
    }
}

/// Cut `entries` into batches of at most `budget` bytes each (a state's
/// bytes plus its names), each sent as one frame; an entry alone over the
/// budget gets a batch of its own (the caller bounds states below it).
pub(crate) fn batches(entries: Vec<HandoffEntry>, budget: usize) -> Vec<Vec<HandoffEntry>> {
    let mut out: Vec<Vec<HandoffEntry>> = Vec::new();
    let mut used = 0;
    for entry in entries {
        let cost = entry_cost(&entry);
        if out.is_empty() || used + cost > budget {
            out.push(Vec::new());
            used = 0;
        }
        used += cost;
        out.last_mut().expect("pushed above").push(entry);
    }
    out
}

/// A generous estimate of an entry's encoded size.
fn entry_cost(entry: &HandoffEntry) -> usize {
    entry.state.len() + entry.module.len() + entry.key.len() + 32
}

#[cfg(test)]
mod tests {
    use super::*;
    use fief_core::PartitionCount;

    fn ledgers() -> TenantLedgers {
        TenantLedgers::new(usize::MAX)
    }

    fn entry(key: &str, partition: u32, token: u64, state: &[u8]) -> HandoffEntry {
        HandoffEntry {
            module: "m".to_owned(),
            key: key.to_owned(),
            partition,
            token,
            state: state.to_vec(),
        }
    }

    /// A table where `a` owns partition 0, and the same table after `a`
    /// handed it to `b`.
    fn tables() -> (OwnershipTable, OwnershipTable, OwnershipToken) {
        let mut before = OwnershipTable::new(PartitionCount::new(2).unwrap());
        before.reassign([
            (PartitionId(0), Some(NodeId::new("a"))),
            (PartitionId(1), Some(NodeId::new("a"))),
        ]);
        let from = before.owner(PartitionId(0)).unwrap().token;
        let mut after = before.clone();
        after.hand_over([(PartitionId(0), NodeId::new("b"))]);
        (before, after, from)
    }

    #[test]
    fn a_sent_state_waits_for_the_transfer_then_is_served_once() {
        let (before, after, from) = tables();
        let b = NodeId::new("b");
        let mut states = HandoffStates::default();
        states.receive(vec![entry("k", 0, from.0, b"5")], &ledgers());
        // The table does not show the transfer yet: nothing, and it stays.
        assert_eq!(
            states.take_for_activation("m", "k", &before, &b),
            (None, None)
        );
        assert!(states.sweep(&before, &b).is_empty());
        assert_eq!(states.size(), (1, 1));
        assert_eq!(
            states.take_for_activation("m", "k", &after, &b),
            (Some(b"5".to_vec()), None)
        );
        assert_eq!(states.size(), (0, 0));
    }

    #[test]
    fn a_state_from_a_transfer_that_did_not_commit_is_never_served() {
        let (before, _, from) = tables();
        let b = NodeId::new("b");
        let mut states = HandoffStates::default();
        states.receive(vec![entry("k", 0, from.0, b"5")], &ledgers());
        // The partition went to b by the leader (an expiry), not by this
        // transfer: the state is old.
        let mut expired = before.clone();
        expired.reassign([(PartitionId(0), None)]);
        expired.reassign([(PartitionId(0), Some(b.clone()))]);
        let (state, lost) = states.take_for_activation("m", "k", &expired, &b);
        assert_eq!(state, None);
        assert_eq!(lost.map(|l| l.key), Some("k".to_owned()));
        // Or to a third node: dropped at the next sweep.
        states.receive(vec![entry("k", 0, from.0, b"5")], &ledgers());
        let mut elsewhere = before.clone();
        elsewhere.hand_over([(PartitionId(0), NodeId::new("c"))]);
        assert_eq!(states.sweep(&elsewhere, &b).len(), 1);
        assert_eq!(states.size(), (0, 0));
    }

    #[test]
    fn kept_states_travel_with_the_next_move_and_only_for_the_owner() {
        let (before, after, from) = tables();
        let a = NodeId::new("a");
        let mut states = HandoffStates::default();
        states.keep(
            vec![entry("k", 0, from.0, b"7"), entry("j", 1, 1, b"x")],
            &ledgers(),
        );
        let moving = [PartitionId(0)].into_iter().collect();
        // Only partition 0's state, under a's token (both have the same).
        let out = states.take_partitions(&moving, &before, &a);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].key.as_str(), out[0].token), ("k", from.0));
        // Once the table shows partition 0 gone, a kept state of it is stale.
        states.keep(out, &ledgers());
        assert_eq!(states.sweep(&after, &a).len(), 1);
    }

    #[test]
    fn a_newer_state_replaces_an_older_one_and_bytes_add_up() {
        let mut states = HandoffStates::default();
        states.receive(vec![entry("k", 0, 1, b"old-state")], &ledgers());
        states.receive(
            vec![entry("k", 0, 1, b"new"), entry("j", 0, 1, b"jj")],
            &ledgers(),
        );
        assert_eq!(states.size(), (2, 5));
        assert_eq!(states.clear(), 2);
        assert_eq!(states.size(), (0, 0));
    }

    #[test]
    fn batches_stay_under_the_budget_and_keep_every_entry() {
        let entries: Vec<HandoffEntry> = (0..10)
            .map(|i| entry(&format!("k{i}"), 0, 1, &vec![0; 300]))
            .collect();
        let out = batches(entries, 1000);
        assert_eq!(out.iter().map(Vec::len).sum::<usize>(), 10);
        assert!(
            out.iter()
                .all(|b| b.iter().map(entry_cost).sum::<usize>() <= 1000)
        );
        // 335 bytes an entry: two fit in 1000, three do not.
        assert_eq!(out.len(), 5);
        // An entry over the budget alone still goes, in a batch of its own.
        let big = batches(
            vec![entry("a", 0, 1, b"x"), entry("b", 0, 1, &[0; 2000])],
            1000,
        );
        assert_eq!(big.len(), 2);
    }
}
