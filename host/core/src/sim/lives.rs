//! The checker's record of key processes and of the handoff states between
//! them, kept from what happened (a process started, ended, went to limbo;
//! a key stopped for handoff with a state; a node received states; a node
//! crashed or fenced; the arbiter committed a table) — never from the
//! executor's own bookkeeping (its key table, its limbo, its handoff store),
//! which is what it judges.
//!
//! - **One process of a key per node**: a process of a key starts on a node
//!   only once every earlier process of the key there has ended (an idle
//!   one's `terminate(idle)` included); one that survives a fence in limbo
//!   is a *survivor* (rule `BesideSurvivor`), any other a second live
//!   process (rule `TwoLiveProcesses`).
//! - **Handoff states**: the newest handed-off state of a key that no
//!   process has started from since is *held*. It travels with the
//!   ownership its partition had at the arbiter when its key was stopped:
//!   a `transfer` from that ownership passes it to the target, if the target
//!   received it in a handoff under that token (else, if its holder still
//!   had it, the partition moved on without it: a violation at once). It is
//!   lost — legitimately — when its holder (the node owning that ownership
//!   since it got the state; the target only once the transfer committed)
//!   crashed or fenced since, or the ownership ended other than by a
//!   `transfer` (which the contract allows only once the owner's lease
//!   expired or was released, so after its fence). A key's next process must
//!   start from the held state while it is not lost, and never from any
//!   other state (an older one, or one a process already started from).
//!
//! Not judged: a state nobody claims (a key with no next process); a
//! process's state that was never handed off (a kill, a fence, an idle
//! retirement end it: un-persisted state dies with it); a process starting
//! from a copy of the newest state after it was judged lost (a stale copy of
//! the newest state is not an older state).

use std::collections::HashMap;

use super::checker::Rule;
use crate::ownership::{Assignment, NodeId, OwnershipTable, OwnershipToken};
use crate::partition::PartitionId;

/// A process that has not ended.
#[derive(Debug)]
struct Running {
    node: NodeId,
    key: String,
    in_limbo: bool,
}

/// The newest handed-off state of a key that no process started from.
#[derive(Debug)]
struct Held {
    state: u64,
    partition: PartitionId,
    /// The arbiter's ownership of the partition it travels with.
    token: OwnershipToken,
    /// The node owning that ownership, and its memory epoch when it got
    /// the state.
    holder: NodeId,
    since: u64,
    /// Nodes that received it in a handoff, by the token it was sent under:
    /// each one's memory epoch then (the latest receipt).
    received: HashMap<(NodeId, OwnershipToken), u64>,
    /// Why it is gone, if it legitimately is.
    lost: Option<String>,
}

/// A breach found: the rule and what happened.
pub(super) type Breach = (Rule, String);

/// Key processes and handoff states, as they happened.
#[derive(Debug, Default)]
pub(super) struct Lives {
    running: HashMap<u64, Running>,
    /// Per node, how often it lost its handoff states: each crash (its
    /// memory is gone) and each fence (it drops them).
    epochs: HashMap<NodeId, u64>,
    held: HashMap<String, Held>,
    /// The arbiter's table, as last committed.
    table: Option<OwnershipTable>,
}

impl Lives {
    fn epoch(&self, node: &NodeId) -> u64 {
        self.epochs.get(node).copied().unwrap_or(0)
    }

    fn alive(&self, h: &Held) -> bool {
        h.lost.is_none() && self.epoch(&h.holder) == h.since
    }

    /// Process `life` of `key` started on `node`: no earlier process of
    /// the key may still run there.
    pub(super) fn started(&mut self, node: &NodeId, key: &str, life: u64) -> Vec<Breach> {
        let mut earlier: Vec<(u64, bool)> = self
            .running
            .iter()
            .filter(|(_, r)| &r.node == node && r.key == key)
            .map(|(id, r)| (*id, r.in_limbo))
            .collect();
        earlier.sort_unstable();
        let breaches = earlier
            .into_iter()
            .map(|(id, in_limbo)| if in_limbo {
                (
                    Rule::BesideSurvivor,
                    format!("{key} started on {node} beside a survivor of it in the same node's limbo (process {id})"),
                )
            } else {
                (
                    Rule::TwoLiveProcesses,
                    format!("{key} started on {node} (process {life}) while its process {id} there had not ended"),
                )
            })
            .collect();
        let running = Running {
            node: node.clone(),
            key: key.to_owned(),
            in_limbo: false,
        };
        self.running.insert(life, running);
        breaches
    }

    /// A process of `key` started on `node` from the handed-off state
    /// `from` (`None`: fresh): the key's held state, if it is not lost.
    pub(super) fn claimed(
        &mut self,
        node: &NodeId,
        key: &str,
        from: Option<u64>,
    ) -> Option<Breach> {
        let held = self.held.remove(key);
        let what = match (from, &held) {
            (Some(s), Some(h)) if s == h.state => None,
            (Some(s), Some(h)) => Some(format!(
                "{key} started on {node} from state {s}, not from its newest handed-off state {} (held by {})",
                h.state, h.holder
            )),
            (Some(s), None) => Some(format!(
                "{key} started on {node} from state {s}, which is not its newest handed-off state (a process started since it was handed off)"
            )),
            (None, Some(h)) if self.alive(h) => Some(format!(
                "{key} started fresh on {node} while its handed-off state {} was held by {} ({} under token {})",
                h.state, h.holder, h.partition, h.token.0
            )),
            (None, _) => None,
        };
        what.map(|w| (Rule::HandoffState, w))
    }

    /// Process `life` ended (its entry may have gone before: that is what
    /// the one-process-per-node rule judges).
    pub(super) fn ended(&mut self, life: u64) {
        self.running.remove(&life);
    }

    /// Process `life` survived a fence: it lives on in its node's limbo.
    pub(super) fn survived(&mut self, life: u64) {
        if let Some(r) = self.running.get_mut(&life) {
            r.in_limbo = true;
        }
    }

    /// `node` crashed: its processes are gone, and its handoff states.
    pub(super) fn crashed(&mut self, node: &NodeId) {
        self.running.retain(|_, r| &r.node != node);
        *self.epochs.entry(node.clone()).or_default() += 1;
    }

    /// `node` fenced: it drops the handoff states it holds.
    pub(super) fn fenced(&mut self, node: &NodeId) {
        *self.epochs.entry(node.clone()).or_default() += 1;
    }

    /// `node` stopped `key` (of `partition`) for a handoff, with `state`:
    /// the key's held state from now on.
    pub(super) fn handed_off(
        &mut self,
        node: &NodeId,
        key: &str,
        partition: PartitionId,
        state: u64,
    ) {
        let owner = self.table.as_ref().and_then(|t| t.owner(partition));
        let (token, lost) = match owner {
            Some(a) if &a.node == node => (a.token, None),
            other => (
                other.map_or(OwnershipToken(0), |a| a.token),
                Some(format!(
                    "{node} stopped it without owning {partition} at the arbiter"
                )),
            ),
        };
        let held = Held {
            state,
            partition,
            token,
            holder: node.clone(),
            since: self.epoch(node),
            received: HashMap::new(),
            lost,
        };
        self.held.insert(key.to_owned(), held);
    }

    /// `node` received a handoff: (key, the token it was sent under, state).
    pub(super) fn received<'a>(
        &mut self,
        node: &NodeId,
        states: impl IntoIterator<Item = (&'a str, OwnershipToken, u64)>,
    ) {
        let epoch = self.epoch(node);
        for (key, token, state) in states {
            if let Some(h) = self.held.get_mut(key).filter(|h| h.state == state) {
                h.received.insert((node.clone(), token), epoch);
            }
        }
    }

    /// The arbiter committed `new` (by a `transfer` if `transfer`): held
    /// states travel with their ownerships, or are lost with them.
    pub(super) fn table_changed(&mut self, new: &OwnershipTable, transfer: bool) -> Vec<Breach> {
        let mut breaches = Vec::new();
        let mut keys: Vec<String> = self
            .held
            .iter()
            .filter(|(_, h)| h.lost.is_none())
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort_unstable();
        for key in keys {
            let h = &self.held[&key];
            let after = new.owner(h.partition);
            if after.is_some_and(|a| a.token == h.token) {
                continue;
            }
            let handed = after.filter(|a| transfer && a.handed_from == Some(h.token));
            let lost = match handed {
                Some(a) => self.passed_to(&key, h, a, &mut breaches),
                None => Some(format!(
                    "{} left the ownership it was held under without a handoff",
                    h.partition
                )),
            };
            let epoch = handed.map(|a| self.epoch(&a.node));
            let h = self.held.get_mut(&key).expect("listed above");
            if let (Some(a), Some(epoch)) = (handed, epoch) {
                h.holder = a.node.clone();
                h.since = epoch;
                h.token = a.token;
            }
            h.lost = lost;
        }
        self.table = Some(new.clone());
        breaches
    }

    /// `key`'s held state `h` is handed on to `a`: why it is lost, if it
    /// is (`a` lost it since it received it, or its holder had lost it and
    /// `a` never received it); a breach if `a` never received it while its
    /// holder still had it.
    fn passed_to(
        &self,
        key: &str,
        h: &Held,
        a: &Assignment,
        breaches: &mut Vec<Breach>,
    ) -> Option<String> {
        match h.received.get(&(a.node.clone(), h.token)) {
            Some(e) if *e == self.epoch(&a.node) => None,
            Some(_) => Some(format!("{} lost it after receiving it", a.node)),
            None if self.alive(h) => {
                breaches.push((
                    Rule::HandoffState,
                    format!(
                        "{} was handed from {} to {} without {key}'s state {}, which {} still held",
                        h.partition, h.holder, a.node, h.state, h.holder
                    ),
                ));
                Some("handed on without it".to_owned())
            }
            None => Some(format!("{} lost it before handing it on", h.holder)),
        }
    }
}
