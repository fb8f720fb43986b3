//! Handoff states waiting on one node for their keys' next process: their
//! bookkeeping, once, for the node (`host/src/handoff.rs`) and for the
//! simulation's model of it (`sim/handoff.rs`).
//!
//! A graceful move stops a partition's keys with `handoff` and sends their
//! states to the partition's next owner, which gives each one to that key's
//! next process. [`Store`] owns what waits on one node for that: the states
//! it was sent and the ones it kept after a move out failed, by key name,
//! each with its [`Basis`]; the [`Verdict`] the node's table gives each; and,
//! per partition and sender token, the newest move [`Attempt`] heard of.
//!
//! The rules (`docs/design.md`, "Graceful handoff"):
//! - A *sent* state is valid once the table gives this node the partition by
//!   a handoff from the very token it was sent under
//!   ([`Assignment::handed_from`](crate::Assignment::handed_from)); a *kept*
//!   one while this node owns the partition under the token it was kept
//!   under. Either is stale once the table shows a newer ownership of its
//!   partition, and waits otherwise: it never expires. A state received or
//!   kept replaces any other of its key.
//! - Every attempt of a move sends a [`Row`] for each of its partitions (its
//!   sender token and attempt), states or none. One owner's attempts share
//!   its token, so the token alone cannot tell the attempt whose `transfer`
//!   committed from an earlier one that failed: a newer attempt drops the
//!   states older attempts under that token sent for that partition (the
//!   newer one carries everything the sender still holds for it; a key whose
//!   state it lacks has run on the sender since), and states of an older
//!   attempt that arrive late are ignored.
//! - A fence drops every waiting state (un-persisted state dies with the
//!   ownership, guarantee 4) but keeps the attempt marks: they are facts
//!   about the senders, and a late state of an old attempt must stay
//!   ignored after it. A mark goes once the table shows its token stale.
//!
//! It must not do I/O, read a clock, charge memory, count bytes or log (the
//! payload is the caller's: bytes charged to their tenant on the node, a
//! number in the simulation), and it decides no ownership: the table it is
//! handed does.

use std::collections::{BTreeMap, BTreeSet};

use crate::membership::OpId;
use crate::ownership::{NodeId, OwnershipTable, OwnershipToken};
use crate::partition::PartitionId;

/// One attempt of one owner's graceful move to one target: the move's
/// [`OpId`], which increases with every move of that owner's process (and a
/// token belongs to one process: a node that registers a new lease owns
/// nothing from before). `Attempt(0)` is no attempt: a sender that names
/// none (an older version).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Attempt(pub u64);

impl From<OpId> for Attempt {
    fn from(op: OpId) -> Self {
        Attempt(op.0)
    }
}

/// One partition of a handoff attempt, as every frame of it names them: a
/// newer attempt from `token` supersedes the older ones for `partition`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    /// The partition.
    pub partition: PartitionId,
    /// The token the sender holds it by.
    pub token: OwnershipToken,
    /// The attempt.
    pub attempt: Attempt,
}

/// One key's state on its way, or taken to travel on: its key's name `N`
/// (module and key on the node), its partition and the token the state
/// belongs to, and the caller's payload `P`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry<N, P> {
    /// The key's name.
    pub name: N,
    /// The key's partition.
    pub partition: PartitionId,
    /// The token the sender held the partition by (or this node, for a
    /// state it keeps).
    pub token: OwnershipToken,
    /// The state.
    pub state: P,
}

/// The rows of one attempt to hand `partitions` away with states of the
/// partitions and tokens `sent` names: one for each partition `table` shows
/// `me` owning, under that token, and one for each other pair `sent` names.
pub fn manifest(
    attempt: Attempt,
    partitions: &BTreeSet<PartitionId>,
    table: &OwnershipTable,
    me: &NodeId,
    sent: impl IntoIterator<Item = (PartitionId, OwnershipToken)>,
) -> Vec<Row> {
    let owned = partitions.iter().filter_map(|p| {
        let a = table.owner(*p).filter(|a| &a.node == me)?;
        Some((*p, a.token))
    });
    let pairs: BTreeSet<(PartitionId, OwnershipToken)> = owned.chain(sent).collect();
    pairs
        .into_iter()
        .map(|(partition, token)| Row {
            partition,
            token,
            attempt,
        })
        .collect()
}

/// Why a waiting state may (or may not) be given to a process here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Basis {
    /// Sent by the previous owner, which held the partition under `from`,
    /// by its move attempt `attempt`: valid once this node owns the
    /// partition by a handoff from that token.
    Sent {
        /// The sender's token.
        from: OwnershipToken,
        /// The sender's attempt.
        attempt: Attempt,
    },
    /// Kept by this node under its own ownership with this token (a move
    /// out that failed).
    Owned {
        /// This node's token.
        token: OwnershipToken,
    },
}

/// What the table says of one waiting state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// It belongs to this node's current ownership of its partition, held
    /// under this token.
    Valid(OwnershipToken),
    /// This node's table is not yet as new as the state: keep it.
    Wait,
    /// The ownership it was meant for never began or has ended.
    Stale,
}

/// The verdict of `table` on a state of `partition` waiting on node `me` on
/// `basis`.
pub fn verdict(
    partition: PartitionId,
    basis: Basis,
    table: &OwnershipTable,
    me: &NodeId,
) -> Verdict {
    let owner = table.owner(partition);
    let newer_than = |t: OwnershipToken| match owner {
        Some(a) => a.token > t,
        None => table.epoch() >= t.0,
    };
    match basis {
        Basis::Owned { token } => match owner {
            Some(a) if &a.node == me && a.token == token => Verdict::Valid(token),
            _ if newer_than(token) => Verdict::Stale,
            _ => Verdict::Wait,
        },
        Basis::Sent { from, .. } => match owner {
            Some(a) if &a.node == me && a.handed_from == Some(from) => Verdict::Valid(a.token),
            _ if newer_than(from) => Verdict::Stale,
            _ => Verdict::Wait,
        },
    }
}

#[derive(Debug)]
struct Waiting<P> {
    partition: PartitionId,
    basis: Basis,
    state: P,
}

impl<P> Waiting<P> {
    fn verdict(&self, table: &OwnershipTable, me: &NodeId) -> Verdict {
        verdict(self.partition, self.basis, table, me)
    }
}

/// What one received handoff frame did.
#[derive(Debug, PartialEq, Eq)]
pub struct Received<N, P> {
    /// How many of its states wait here now.
    pub kept: usize,
    /// Its states of an attempt older than one already heard from their
    /// sender token for their partition: not kept (a late delivery).
    pub ignored: Vec<Entry<N, P>>,
    /// States that older attempts sent for its partitions and that it did
    /// not carry again: dropped (their keys ran on the sender since).
    pub superseded: Vec<(N, P)>,
}

/// What waited for a key's next process.
#[derive(Debug, PartialEq, Eq)]
pub enum Taken<P> {
    /// Nothing, or nothing the table is new enough for yet (it stays).
    Nothing,
    /// Its state, for the process.
    State(P),
    /// A stale state: dropped.
    Stale(P),
}

/// The handoff states waiting on one node, by key name, and the newest
/// attempt heard of per partition and sender token.
#[derive(Debug)]
pub struct Store<N, P> {
    waiting: BTreeMap<N, Waiting<P>>,
    marks: BTreeMap<(PartitionId, OwnershipToken), Attempt>,
}

impl<N, P> Default for Store<N, P> {
    fn default() -> Self {
        Store {
            waiting: BTreeMap::new(),
            marks: BTreeMap::new(),
        }
    }
}

impl<N: Ord, P> Store<N, P> {
    /// A handoff frame from a peer: its `manifest` (the rows of its attempt)
    /// and its states. A row newer than its mark raises it and drops what
    /// older attempts sent for its partition under its token (after this
    /// frame's states are kept, so those it carries again are not counted);
    /// a state of a row older than its mark is ignored; a state no row names
    /// is taken as of no attempt. Each state kept replaces any other of its
    /// key.
    pub fn receive(&mut self, manifest: &[Row], entries: Vec<Entry<N, P>>) -> Received<N, P> {
        let rows: BTreeMap<(PartitionId, OwnershipToken), Attempt> = manifest
            .iter()
            .map(|r| ((r.partition, r.token), r.attempt))
            .collect();
        let mut newer = BTreeMap::new();
        for (&pair, &attempt) in &rows {
            if self.marks.get(&pair).is_none_or(|m| *m < attempt) {
                self.marks.insert(pair, attempt);
                newer.insert(pair, attempt);
            }
        }
        let mut received = Received {
            kept: 0,
            ignored: Vec::new(),
            superseded: Vec::new(),
        };
        for entry in entries {
            let pair = (entry.partition, entry.token);
            let attempt = rows.get(&pair).copied().unwrap_or_default();
            if self.marks.get(&pair).is_some_and(|m| *m > attempt) {
                received.ignored.push(entry);
                continue;
            }
            let basis = Basis::Sent {
                from: entry.token,
                attempt,
            };
            self.insert(entry.name, entry.partition, basis, entry.state);
            received.kept += 1;
        }
        if !newer.is_empty() {
            let older = |w: &Waiting<P>| match w.basis {
                Basis::Sent { from, attempt } => newer
                    .get(&(w.partition, from))
                    .is_some_and(|a| attempt < *a),
                Basis::Owned { .. } => false,
            };
            received.superseded = self.remove_where(older);
        }
        received
    }

    /// States this node keeps for its own ownership of their partitions,
    /// under the tokens the entries name (a move out that failed).
    pub fn keep(&mut self, entries: Vec<Entry<N, P>>) {
        for e in entries {
            let basis = Basis::Owned { token: e.token };
            self.insert(e.name, e.partition, basis, e.state);
        }
    }

    fn insert(&mut self, name: N, partition: PartitionId, basis: Basis, state: P) {
        let waiting = Waiting {
            partition,
            basis,
            state,
        };
        self.waiting.insert(name, waiting);
    }

    /// Remove every waiting state `doomed` picks; returns them.
    fn remove_where(&mut self, doomed: impl Fn(&Waiting<P>) -> bool) -> Vec<(N, P)> {
        self.waiting
            .extract_if(.., |_, w| doomed(w))
            .map(|(name, w)| (name, w.state))
            .collect()
    }

    /// The state for `name`'s next process on this node, if one waits and
    /// belongs to this node's ownership per `table`. A stale one is dropped
    /// (and returned); one the table is not yet new enough for stays.
    pub fn take_for_activation(
        &mut self,
        name: &N,
        table: &OwnershipTable,
        me: &NodeId,
    ) -> Taken<P> {
        let Some(w) = self.waiting.get(name) else {
            return Taken::Nothing;
        };
        let verdict = w.verdict(table, me);
        if verdict == Verdict::Wait {
            return Taken::Nothing;
        }
        let w = self.waiting.remove(name).expect("found above");
        match verdict {
            Verdict::Valid(_) => Taken::State(w.state),
            _ => Taken::Stale(w.state),
        }
    }

    /// Take every waiting state of `partitions` that belongs to this node's
    /// ownership, to travel with a move out: as entries under the token this
    /// node holds each partition by.
    pub fn take_partitions(
        &mut self,
        partitions: &BTreeSet<PartitionId>,
        table: &OwnershipTable,
        me: &NodeId,
    ) -> Vec<Entry<N, P>> {
        let valid = |w: &Waiting<P>| match w.verdict(table, me) {
            Verdict::Valid(token) => Some(token),
            _ => None,
        };
        self.waiting
            .extract_if(.., |_, w| {
                partitions.contains(&w.partition) && valid(w).is_some()
            })
            .map(|(name, w)| Entry {
                name,
                partition: w.partition,
                token: valid(&w).expect("picked as valid"),
                state: w.state,
            })
            .collect()
    }

    /// Drop every state `table` shows to be stale (returned), and the
    /// attempt marks of tokens it shows stale.
    pub fn sweep(&mut self, table: &OwnershipTable, me: &NodeId) -> Vec<(N, P)> {
        self.marks.retain(|(partition, from), attempt| {
            let basis = Basis::Sent {
                from: *from,
                attempt: *attempt,
            };
            verdict(*partition, basis, table, me) != Verdict::Stale
        });
        if self.waiting.is_empty() {
            return Vec::new();
        }
        self.remove_where(|w| w.verdict(table, me) == Verdict::Stale)
    }

    /// The fence: drop every waiting state (the attempt marks stay); how
    /// many were dropped.
    pub fn clear(&mut self) -> usize {
        let n = self.waiting.len();
        self.waiting.clear();
        n
    }

    /// How many states wait.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// The waiting states' payloads.
    pub fn states(&self) -> impl Iterator<Item = &P> {
        self.waiting.values().map(|w| &w.state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::PartitionCount;

    type Names = Store<&'static str, u64>;

    const A: Attempt = Attempt(1);
    const B: Attempt = Attempt(2);

    fn entry(
        name: &'static str,
        partition: u32,
        token: OwnershipToken,
        state: u64,
    ) -> Entry<&'static str, u64> {
        Entry {
            name,
            partition: PartitionId(partition),
            token,
            state,
        }
    }

    fn row(partition: u32, token: OwnershipToken, attempt: Attempt) -> Row {
        Row {
            partition: PartitionId(partition),
            token,
            attempt,
        }
    }

    /// A table where `a` owns partitions 0 and 1 (under one token), and the
    /// same table after `a` handed both to `b`.
    fn tables() -> (OwnershipTable, OwnershipTable, OwnershipToken) {
        let mut before = OwnershipTable::new(PartitionCount::new(2).unwrap());
        before.reassign([
            (PartitionId(0), Some(NodeId::new("a"))),
            (PartitionId(1), Some(NodeId::new("a"))),
        ]);
        let from = before.owner(PartitionId(0)).unwrap().token;
        let mut after = before.clone();
        after.hand_over([
            (PartitionId(0), NodeId::new("b")),
            (PartitionId(1), NodeId::new("b")),
        ]);
        (before, after, from)
    }

    fn b() -> NodeId {
        NodeId::new("b")
    }

    #[test]
    fn a_sent_state_waits_for_its_transfer_then_is_served_once() {
        let (before, after, from) = tables();
        let mut store = Names::default();
        store.receive(&[row(0, from, A)], vec![entry("k", 0, from, 5)]);
        assert_eq!(
            store.take_for_activation(&"k", &before, &b()),
            Taken::Nothing
        );
        assert!(store.sweep(&before, &b()).is_empty());
        assert_eq!(store.len(), 1);
        assert_eq!(
            store.take_for_activation(&"k", &after, &b()),
            Taken::State(5)
        );
        assert!(store.is_empty());
        assert_eq!(
            store.take_for_activation(&"k", &after, &b()),
            Taken::Nothing
        );
    }

    #[test]
    fn verdicts_follow_the_table() {
        let (before, after, from) = tables();
        let (a, b) = (NodeId::new("a"), b());
        let p = PartitionId(0);
        let sent = Basis::Sent { from, attempt: A };
        let owned = Basis::Owned { token: from };
        assert_eq!(verdict(p, sent, &before, &b), Verdict::Wait);
        let to = after.owner(p).unwrap().token;
        assert_eq!(verdict(p, sent, &after, &b), Verdict::Valid(to));
        assert_eq!(verdict(p, owned, &before, &a), Verdict::Valid(from));
        assert_eq!(verdict(p, owned, &after, &a), Verdict::Stale);
        // Sent to the wrong node, or from a token the transfer was not from.
        assert_eq!(verdict(p, sent, &after, &a), Verdict::Stale);
        let other = Basis::Sent {
            from: OwnershipToken(from.0 - 1),
            attempt: A,
        };
        assert_eq!(verdict(p, other, &after, &b), Verdict::Stale);
        // The leader gave it to b anew (no handoff): old.
        let mut expired = before.clone();
        expired.reassign([(p, None)]);
        assert_eq!(verdict(p, sent, &expired, &b), Verdict::Stale);
        expired.reassign([(p, Some(b.clone()))]);
        assert_eq!(verdict(p, sent, &expired, &b), Verdict::Stale);
        // A table older than the state: wait.
        let empty = OwnershipTable::new(PartitionCount::new(2).unwrap());
        assert_eq!(verdict(p, sent, &empty, &b), Verdict::Wait);
        assert_eq!(verdict(p, owned, &empty, &a), Verdict::Wait);
    }

    #[test]
    fn a_stale_state_is_dropped_when_taken_or_swept() {
        let (before, _, from) = tables();
        let mut store = Names::default();
        store.receive(
            &[row(0, from, A)],
            vec![entry("k", 0, from, 5), entry("j", 0, from, 6)],
        );
        let mut elsewhere = before.clone();
        elsewhere.hand_over([(PartitionId(0), NodeId::new("c"))]);
        assert_eq!(
            store.take_for_activation(&"k", &elsewhere, &b()),
            Taken::Stale(5)
        );
        assert_eq!(store.sweep(&elsewhere, &b()), vec![("j", 6)]);
        assert!(store.is_empty());
        // The mark went with its token.
        assert!(store.marks.is_empty());
    }

    #[test]
    fn kept_states_travel_with_the_next_move_and_only_for_the_owner() {
        let (before, after, from) = tables();
        let a = NodeId::new("a");
        let mut store = Names::default();
        store.keep(vec![
            entry("k", 0, from, 7),
            entry("j", 1, OwnershipToken(1), 8),
        ]);
        let moving = [PartitionId(0)].into_iter().collect();
        let out = store.take_partitions(&moving, &before, &a);
        assert_eq!(out, vec![entry("k", 0, from, 7)]);
        assert_eq!(store.len(), 1);
        store.keep(out);
        assert_eq!(store.sweep(&after, &a).len(), 2);
    }

    #[test]
    fn an_older_attempt_arriving_late_is_ignored() {
        let (_, after, from) = tables();
        let mut store = Names::default();
        let newer = store.receive(&[row(0, from, B)], vec![entry("k", 0, from, 9)]);
        assert_eq!((newer.kept, newer.ignored.len()), (1, 0));
        // Attempt A's frame was delayed: its states are older than B's.
        let late = store.receive(
            &[row(0, from, A), row(1, from, A)],
            vec![entry("k", 0, from, 5), entry("j", 1, from, 6)],
        );
        assert_eq!(late.ignored, vec![entry("k", 0, from, 5)]);
        assert_eq!(late.kept, 1, "partition 1 had no newer attempt");
        assert_eq!(
            store.take_for_activation(&"k", &after, &b()),
            Taken::State(9)
        );
        // Another frame of B itself is kept beside the first.
        let more = store.receive(&[row(0, from, B)], vec![entry("i", 0, from, 3)]);
        assert_eq!((more.kept, more.superseded.len()), (1, 0));
        assert_eq!(
            store.take_for_activation(&"i", &after, &b()),
            Taken::State(3)
        );
    }

    #[test]
    fn a_newer_attempt_drops_older_states_of_its_partitions_only() {
        let (_, after, from) = tables();
        let mut store = Names::default();
        let other = OwnershipToken(from.0 + 50);
        store.receive(
            &[row(0, from, A), row(1, from, A)],
            vec![
                entry("k", 0, from, 5),
                entry("j", 1, from, 6),
                entry("i", 0, from, 7),
            ],
        );
        // A state of partition 0 from another sender token, and one kept.
        store.receive(&[row(0, other, A)], vec![entry("h", 0, other, 8)]);
        store.keep(vec![entry("g", 0, from, 1)]);
        // Attempt B moves partition 0 only, carrying i again.
        let b2 = store.receive(&[row(0, from, B)], vec![entry("i", 0, from, 70)]);
        assert_eq!(b2.kept, 1);
        assert_eq!(
            b2.superseded,
            vec![("k", 5)],
            "i came again; j is partition 1's"
        );
        assert_eq!(
            store.take_for_activation(&"k", &after, &b()),
            Taken::Nothing
        );
        assert_eq!(
            store.take_for_activation(&"j", &after, &b()),
            Taken::State(6)
        );
        assert_eq!(
            store.take_for_activation(&"i", &after, &b()),
            Taken::State(70)
        );
        assert_eq!(store.len(), 2, "h and g stay: another token, and kept");
    }

    /// Seed 931's bug: an attempt with no states still supersedes an
    /// older one's, and its transfer's table never serves them.
    #[test]
    fn an_attempt_with_no_state_supersedes_the_older_ones() {
        let (_, after, from) = tables();
        let mut store = Names::default();
        store.receive(&[row(0, from, A)], vec![entry("k", 0, from, 5)]);
        let empty = store.receive(&[row(0, from, B)], Vec::new());
        assert_eq!((empty.kept, empty.superseded), (0, vec![("k", 5)]));
        assert_eq!(
            store.take_for_activation(&"k", &after, &b()),
            Taken::Nothing
        );
        assert!(store.is_empty());
    }

    #[test]
    fn a_state_of_no_attempt_is_kept_as_before_and_a_fence_keeps_the_marks() {
        let (_, after, from) = tables();
        let mut store = Names::default();
        store.receive(&[], vec![entry("k", 0, from, 5)]);
        assert_eq!(
            store.take_for_activation(&"k", &after, &b()),
            Taken::State(5)
        );
        store.receive(&[row(0, from, B)], vec![entry("j", 0, from, 6)]);
        assert_eq!(store.clear(), 1);
        // After the fence an older attempt's late state is still ignored.
        let late = store.receive(&[row(0, from, A)], vec![entry("j", 0, from, 2)]);
        assert_eq!(late.ignored.len(), 1);
        assert!(store.is_empty());
    }

    #[test]
    fn the_manifest_names_every_owned_partition_and_every_entry_token() {
        let (before, _, from) = tables();
        let a = NodeId::new("a");
        let moving: BTreeSet<PartitionId> = [PartitionId(0), PartitionId(1)].into();
        let old = OwnershipToken(from.0 - 1);
        let sent = [(PartitionId(0), from), (PartitionId(1), old)];
        let rows = manifest(B, &moving, &before, &a, sent);
        assert_eq!(rows, vec![row(0, from, B), row(1, old, B), row(1, from, B)]);
        // Nothing owned and nothing sent: no row.
        assert!(manifest(B, &moving, &before, &b(), []).is_empty());
    }
}
