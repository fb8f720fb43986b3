//! Handoff states between a key's processes on different nodes, as this
//! node holds and sends them.
//!
//! A graceful move stops a partition's keys with `handoff` and sends their
//! states to the partition's next owner, which gives each one to that key's
//! next process (contract §3, §5 row 8: "handoff state arrives"). Which of
//! the states waiting here belong to an ownership of this node, and which a
//! newer move attempt superseded, is `fief_core::handoff`'s (one copy of the
//! rules, which the simulation runs too). This module owns what is the
//! host's: the waiting states' bytes, charged to their tenants' host-memory
//! ledgers and counted; the [`LostState`] each drop is reported as; the wire
//! shapes (`HandoffEntry`, `HandoffRow`); and the cutting of an attempt into
//! frames under the peer frame limit, at least one frame an attempt.
//!
//! The rules, each held by a test (`docs/design.md`, "Graceful handoff"):
//! - A waiting state stays until its key's next process takes it, however
//!   long that is, and travels on with any later move of its partition
//!   ([`HandoffStates::take_partitions`]): it never expires.
//! - A state sent to this node is served only if the table says this node got
//!   the partition *by that very transfer* ([`fief_core::Assignment::handed_from`]
//!   equals the token the sender held it under), and only if no later attempt
//!   of the sender's under that token superseded it. A state from a transfer
//!   that never committed, or from an ownership that has since moved
//!   elsewhere, is dropped when the table shows it, never served (it would be
//!   old).
//! - A fence drops every waiting state (un-persisted state dies with the
//!   ownership, guarantee 4). Every drop is logged and counted
//!   (`fief_handoff_states`).
//!
//! It must not do I/O or wait: the node calls it under its own locks.

use std::collections::{BTreeSet, HashSet};

use fief_core::handoff::{self, Attempt, Entry, Row, Store, Taken};
use fief_core::{NodeId, OwnershipTable, OwnershipToken, PartitionId};

use crate::host_bytes::{Held, TenantLedgers};
use crate::wire::{HandoffEntry, HandoffRow};

/// A waiting state's key: (module, key).
type Name = (String, String);

/// A waiting state's bytes, charged to its tenant's host-memory ledger
/// whatever its limit: refusing a state that already exists would lose it
/// ([`crate::host_bytes`]).
#[derive(Debug)]
struct HeldState {
    state: Vec<u8>,
    _held: Held,
}

/// A state this node could not keep or pass on, for logs and the leave's
/// report.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct LostState {
    /// The key's module.
    pub module: String,
    /// The key.
    pub key: String,
    /// Why its state was lost.
    pub reason: String,
}

/// What one handoff frame received did.
#[derive(Debug)]
pub(crate) struct Receipt {
    /// How many of its states wait here now.
    pub(crate) kept: usize,
    /// Copies made stale by a newer attempt of their sender: its own states
    /// that came late, and older ones it did not carry again (their keys
    /// ran on the sender since). Not losses: the newer attempt carries what
    /// the sender holds.
    pub(crate) superseded: usize,
}

/// The handoff states waiting on one node, by (module, key).
#[derive(Debug, Default)]
pub(crate) struct HandoffStates {
    store: Store<Name, HeldState>,
}

impl HandoffStates {
    /// A frame received from a peer: its rows and states (see
    /// [`Store::receive`]).
    pub(crate) fn receive(
        &mut self,
        manifest: &[HandoffRow],
        entries: Vec<HandoffEntry>,
        ledgers: &TenantLedgers,
    ) -> Receipt {
        let rows: Vec<Row> = manifest.iter().map(row_from_wire).collect();
        let entries = entries.into_iter().map(|e| held(e, ledgers)).collect();
        let received = self.store.receive(&rows, entries);
        Receipt {
            kept: received.kept,
            superseded: received.ignored.len() + received.superseded.len(),
        }
    }

    /// States this node keeps for its own ownership of their partitions
    /// under the tokens the entries name (a move that failed).
    pub(crate) fn keep(&mut self, entries: Vec<HandoffEntry>, ledgers: &TenantLedgers) {
        let entries = entries.into_iter().map(|e| held(e, ledgers)).collect();
        self.store.keep(entries);
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
        // Activations are common and handoffs rare: no allocation when
        // nothing waits.
        if self.store.is_empty() {
            return (None, None);
        }
        let name = (module.to_owned(), key.to_owned());
        match self.store.take_for_activation(&name, table, me) {
            Taken::State(s) => (Some(s.state), None),
            Taken::Stale(_) => (None, Some(stale(name))),
            Taken::Nothing => (None, None),
        }
    }

    /// Take every waiting state of `partitions` that belongs to this node's
    /// ownership, to travel with a move out: as entries under the token this
    /// node holds each partition by.
    pub(crate) fn take_partitions(
        &mut self,
        partitions: &BTreeSet<PartitionId>,
        table: &OwnershipTable,
        me: &NodeId,
    ) -> Vec<HandoffEntry> {
        if self.store.is_empty() {
            return Vec::new();
        }
        let taken = self.store.take_partitions(partitions, table, me);
        taken
            .into_iter()
            .map(|e| {
                let (module, key) = e.name;
                HandoffEntry {
                    module,
                    key,
                    partition: e.partition.0,
                    token: e.token.0,
                    state: e.state.state,
                }
            })
            .collect()
    }

    /// Drop every state `table` shows to be stale; returns them.
    pub(crate) fn sweep(&mut self, table: &OwnershipTable, me: &NodeId) -> Vec<LostState> {
        let dropped = self.store.sweep(table, me);
        dropped.into_iter().map(|(name, _)| stale(name)).collect()
    }

    /// Drop every state (the node fenced); returns how many were dropped.
    pub(crate) fn clear(&mut self) -> usize {
        self.store.clear()
    }

    /// How many states wait, and their bytes.
    pub(crate) fn size(&self) -> (usize, usize) {
        let bytes = self.store.states().map(|s| s.state.len()).sum();
        (self.store.len(), bytes)
    }
}

/// `entry`, its bytes charged to its tenant.
fn held(entry: HandoffEntry, ledgers: &TenantLedgers) -> Entry<Name, HeldState> {
    let tenant = crate::auth::tenant_of(&entry.module).unwrap_or("");
    let charge = entry.state.len() + entry.module.len() + entry.key.len();
    let state = HeldState {
        state: entry.state,
        _held: ledgers.of(tenant).force(charge),
    };
    Entry {
        name: (entry.module, entry.key),
        partition: PartitionId(entry.partition),
        token: OwnershipToken(entry.token),
        state,
    }
}

fn row_from_wire(row: &HandoffRow) -> Row {
    Row {
        partition: PartitionId(row.partition),
        token: OwnershipToken(row.token),
        attempt: Attempt(row.attempt),
    }
}

fn stale((module, key): Name) -> LostState {
    LostState {
        module,
        key,
        reason: "its handoff was for an ownership that never began or has ended".to_owned(),
    }
}

/// The rows of move `attempt` handing `partitions` away with `entries`, as
/// `table` shows them ([`handoff::manifest`]).
pub(crate) fn manifest(
    attempt: Attempt,
    partitions: &BTreeSet<PartitionId>,
    table: &OwnershipTable,
    me: &NodeId,
    entries: &[HandoffEntry],
) -> Vec<HandoffRow> {
    let sent = entries
        .iter()
        .map(|e| (PartitionId(e.partition), OwnershipToken(e.token)));
    handoff::manifest(attempt, partitions, table, me, sent)
        .into_iter()
        .map(|r| HandoffRow {
            partition: r.partition.0,
            token: r.token.0,
            attempt: r.attempt.0,
        })
        .collect()
}

/// One frame of a handoff attempt: its rows and its states.
pub(crate) type Frame = (Vec<HandoffRow>, Vec<HandoffEntry>);

/// Cut one attempt into frames of at most `budget` bytes each (a state's
/// bytes plus its names and its row): first the rows no state names, as
/// many a frame as fit; then the states, each frame with the rows of its
/// own states. Never none: an attempt with neither rows nor states is one
/// empty frame, so every attempt reaches the target before its transfer.
/// An entry alone over the budget gets a frame of its own (the caller
/// bounds states below it).
pub(crate) fn frames(
    manifest: Vec<HandoffRow>,
    entries: Vec<HandoffEntry>,
    budget: usize,
) -> Vec<Frame> {
    let named: HashSet<(u32, u64)> = entries.iter().map(|e| (e.partition, e.token)).collect();
    let (tied, untied): (Vec<HandoffRow>, Vec<HandoffRow>) = manifest
        .into_iter()
        .partition(|r| named.contains(&(r.partition, r.token)));
    let mut out: Vec<Frame> = untied
        .chunks((budget / ROW_COST).max(1))
        .map(|rows| (rows.to_vec(), Vec::new()))
        .collect();
    for batch in batches(entries, budget) {
        let pairs: HashSet<(u32, u64)> = batch.iter().map(|e| (e.partition, e.token)).collect();
        let rows = tied
            .iter()
            .filter(|r| pairs.contains(&(r.partition, r.token)))
            .copied()
            .collect();
        out.push((rows, batch));
    }
    if out.is_empty() {
        out.push((Vec::new(), Vec::new()));
    }
    out
}

/// Cut `entries` into batches of at most `budget` bytes each.
fn batches(entries: Vec<HandoffEntry>, budget: usize) -> Vec<Vec<HandoffEntry>> {
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

/// A generous estimate of a row's encoded size (three varints).
const ROW_COST: usize = 32;

/// A generous estimate of an entry's encoded size, with a row for it.
fn entry_cost(entry: &HandoffEntry) -> usize {
    entry.state.len() + entry.module.len() + entry.key.len() + 32 + ROW_COST
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

    fn row(partition: u32, token: u64, attempt: u64) -> HandoffRow {
        HandoffRow {
            partition,
            token,
            attempt,
        }
    }

    /// A table where `a` owns partition 0, and after `a` handed it to `b`.
    fn handed() -> (OwnershipTable, u64) {
        let mut table = OwnershipTable::new(PartitionCount::new(2).unwrap());
        table.reassign([(PartitionId(0), Some(NodeId::new("a")))]);
        let from = table.owner(PartitionId(0)).unwrap().token.0;
        table.hand_over([(PartitionId(0), NodeId::new("b"))]);
        (table, from)
    }

    /// The host's side of the core's rules: bytes counted and charged, a
    /// stale state reported by name, attempts read off the wire.
    #[test]
    fn states_are_counted_charged_and_reported_by_name() {
        let (after, from) = handed();
        let b = NodeId::new("b");
        let ledgers = TenantLedgers::new(1 << 20);
        let mut states = HandoffStates::default();
        let first = states.receive(
            &[row(0, from, 1)],
            vec![
                entry("k", 0, from, b"old-state"),
                entry("j", 0, from, b"jj"),
            ],
            &ledgers,
        );
        assert_eq!((first.kept, first.superseded), (2, 0));
        assert_eq!(states.size(), (2, 11));
        assert!(ledgers.of("").used() > 0, "charged to the tenant");
        // Attempt 2 carries k again and not j: j's copy is superseded.
        let second = states.receive(
            &[row(0, from, 2)],
            vec![entry("k", 0, from, b"new")],
            &ledgers,
        );
        assert_eq!((second.kept, second.superseded), (1, 1));
        assert_eq!(states.size(), (1, 3));
        // A late frame of attempt 1 changes nothing.
        let late = states.receive(
            &[row(0, from, 1)],
            vec![entry("k", 0, from, b"old")],
            &ledgers,
        );
        assert_eq!((late.kept, late.superseded), (0, 1));
        assert_eq!(
            states.take_for_activation("m", "k", &after, &b),
            (Some(b"new".to_vec()), None)
        );
        assert_eq!(states.size(), (0, 0));
        assert_eq!(ledgers.of("").used(), 0, "released with the states");
        // Sent to b, found on c: stale, by name.
        let mut states = HandoffStates::default();
        states.receive(&[], vec![entry("k", 0, from, b"5")], &ledgers);
        let lost = states
            .take_for_activation("m", "k", &after, &NodeId::new("c"))
            .1;
        assert_eq!(
            lost.map(|l| (l.module, l.key)),
            Some(("m".to_owned(), "k".to_owned()))
        );
    }

    #[test]
    fn kept_states_go_out_as_entries_and_a_fence_drops_them() {
        let (after, _) = handed();
        let token = after.owner(PartitionId(0)).unwrap().token.0;
        let b = NodeId::new("b");
        let mut states = HandoffStates::default();
        states.keep(
            vec![entry("k", 0, token, b"7"), entry("j", 1, 1, b"x")],
            &ledgers(),
        );
        let moving = [PartitionId(0)].into_iter().collect();
        let out = states.take_partitions(&moving, &after, &b);
        assert_eq!(out.len(), 1);
        assert_eq!(
            (out[0].key.as_str(), out[0].token, out[0].state.as_slice()),
            ("k", token, &b"7"[..])
        );
        // j's partition is unowned at an epoch past its token: stale.
        assert_eq!(states.sweep(&after, &b).len(), 1);
        states.keep(out, &ledgers());
        assert_eq!(states.clear(), 1);
        assert_eq!(states.size(), (0, 0));
    }

    #[test]
    fn the_manifest_names_the_moved_partitions_in_their_rows() {
        let (after, _) = handed();
        let token = after.owner(PartitionId(0)).unwrap().token.0;
        let moving = [PartitionId(0), PartitionId(1)].into_iter().collect();
        let rows = manifest(Attempt(7), &moving, &after, &NodeId::new("b"), &[]);
        assert_eq!(rows, vec![row(0, token, 7)], "b owns partition 0 only");
    }

    #[test]
    fn frames_stay_under_the_budget_and_keep_every_entry_and_row() {
        let entries: Vec<HandoffEntry> = (0..10)
            .map(|i| entry(&format!("k{i}"), i % 2, 1, &vec![0; 300]))
            .collect();
        let manifest = vec![row(0, 1, 3), row(1, 1, 3), row(2, 1, 3)];
        let out = frames(manifest.clone(), entries, 1000);
        // The row no state names first, alone; then the states, two a
        // frame (367 bytes an entry: two fit in 1000, three do not).
        assert_eq!(out[0], (vec![row(2, 1, 3)], Vec::new()));
        assert_eq!(out.len(), 6);
        assert_eq!(out.iter().map(|f| f.1.len()).sum::<usize>(), 10);
        for (rows, batch) in &out[1..] {
            assert!(batch.iter().map(entry_cost).sum::<usize>() <= 1000);
            // Each frame names the rows of its own states.
            for e in batch {
                assert!(
                    rows.iter()
                        .any(|r| (r.partition, r.token) == (e.partition, e.token))
                );
            }
        }
        // An entry over the budget alone still goes, in a frame of its own.
        let big = frames(
            Vec::new(),
            vec![entry("a", 0, 1, b"x"), entry("b", 0, 1, &[0; 2000])],
            1000,
        );
        assert_eq!(big.len(), 2);
        // An attempt with no state is still a frame; with nothing at all too.
        assert_eq!(frames(manifest[..1].to_vec(), Vec::new(), 1000).len(), 1);
        assert_eq!(
            frames(Vec::new(), Vec::new(), 1000),
            vec![(Vec::new(), Vec::new())]
        );
        // Many rows are cut too.
        let rows: Vec<HandoffRow> = (0..100).map(|p| row(p, 1, 3)).collect();
        assert_eq!(frames(rows, Vec::new(), 1000).len(), 4);
    }
}
