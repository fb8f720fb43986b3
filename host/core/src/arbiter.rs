//! The embedded arbiter's decisions, without I/O: leases judged on the
//! arbiter's clock, leadership terms, and the partition table's writes.
//!
//! [`ArbiterState`] is one namespace of the in-process arbiter (contract §3).
//! Every method takes the arbiter's `now` as an argument; the caller (the
//! host's `LocalArbiter`, or the simulation) reads its own clock and carries
//! the state behind whatever lock or message queue it uses. The rules that
//! keep ownership single live here: a lease is current until
//! `committed + ttl` on the arbiter's clock; the leader of the current term
//! alone writes the table, and never gives away a partition whose owner's
//! lease is still current; a graceful move ([`ArbiterState::transfer`]) is
//! made by the owner itself under its current lease.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::ownership::{NodeId, OwnershipTable};
use crate::partition::{PartitionCount, PartitionId};
use crate::time::Instant;

/// Identifies one lease of one node; a node that rejoins gets a new one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub u64);

/// A leadership term; strictly increases with every change of leader.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Term(pub u64);

/// A live node as the arbiter knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The node's id.
    pub node: NodeId,
    /// Where its peers reach it (node-to-node transport), if it listens.
    pub peer_addr: Option<String>,
    /// The node is leaving: it gets no partitions and hands off its own.
    pub leaving: bool,
    /// The node holds the leadership.
    pub leader: bool,
    /// Time left on its lease, as the arbiter judges it.
    pub lease_remaining: Duration,
    /// The node has used this lease since it was granted (renewed it, or
    /// campaigned with it), so it knows it. A lease whose grant never
    /// reached its node (the answer to its join was lost, and its next
    /// joins are refused until this one expires) is live but not
    /// confirmed: the leader gives no partition to it, since nothing would
    /// serve it and a state handed to it would be dropped.
    pub confirmed: bool,
}

/// Why the arbiter state refused a request (the host maps these onto its
/// `ArbiterError`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The lease has expired (or was released); the node must rejoin.
    LeaseExpired(LeaseId),
    /// The caller is not the current leader; the current term.
    NotLeader(Term),
    /// Refused, with the reason.
    Refused(String),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::LeaseExpired(l) => write!(f, "lease {l:?} has expired"),
            Refusal::NotLeader(t) => write!(f, "not the leader (current term {t:?})"),
            Refusal::Refused(why) => f.write_str(why),
        }
    }
}

/// One node's lease, as the arbiter holds it.
#[derive(Clone, Debug)]
struct LeaseRecord {
    id: LeaseId,
    peer_addr: Option<String>,
    leaving: bool,
    /// Used by its node since the grant (see [`Member::confirmed`]).
    confirmed: bool,
    committed_at: Instant,
    ttl: Duration,
    /// Renewals recorded so far: the renewal mark.
    renewals: u64,
}

/// One namespace of the embedded arbiter: leases, leader, term and table.
#[derive(Clone, Debug)]
pub struct ArbiterState {
    leases: BTreeMap<NodeId, LeaseRecord>,
    table: OwnershipTable,
    leader: Option<(NodeId, LeaseId)>,
    term: u64,
    /// Test-only fault: judge expiry at this fraction (in percent) of the
    /// TTL. 100 in every real build.
    expiry_percent: u32,
}

impl ArbiterState {
    /// An empty namespace of `partitions`.
    pub fn new(partitions: PartitionCount) -> Self {
        ArbiterState {
            leases: BTreeMap::new(),
            table: OwnershipTable::new(partitions),
            leader: None,
            term: 0,
            expiry_percent: 100,
        }
    }

    /// An empty namespace whose tables are numbered after `epoch`: the
    /// first table it makes has epoch `epoch + 1`, so every ownership token
    /// it grants is above `epoch`. For an arbiter that starts afresh on a
    /// store that has seen tokens up to `epoch` (see `fief`'s
    /// `Backend::highest_fence_token`).
    pub fn numbered_after(partitions: PartitionCount, epoch: u64) -> Self {
        let owners = vec![None; partitions.get() as usize];
        ArbiterState {
            table: OwnershipTable::from_parts(partitions, epoch, owners)
                .expect("no owners, one entry per partition"),
            ..ArbiterState::new(partitions)
        }
    }

    /// Mutation for the simulation's checker test: judge a lease expired
    /// after `percent`% of its TTL instead of all of it.
    #[cfg(any(test, feature = "sim"))]
    pub fn mutate_early_expiry(&mut self, percent: u32) {
        self.expiry_percent = percent;
    }

    fn expires_at(&self, r: &LeaseRecord) -> Instant {
        let ttl = if self.expiry_percent == 100 {
            r.ttl
        } else {
            r.ttl * self.expiry_percent / 100
        };
        r.committed_at + ttl
    }

    fn current(&self, r: &LeaseRecord, now: Instant) -> bool {
        now < self.expires_at(r)
    }

    /// Whether `node` holds `lease` and it is current at `now`.
    pub fn lease_current(&self, node: &NodeId, lease: LeaseId, now: Instant) -> bool {
        self.leases
            .get(node)
            .is_some_and(|r| r.id == lease && self.current(r, now))
    }

    /// Whether `node` holds any lease that is current at `now`.
    pub fn node_current(&self, node: &NodeId, now: Instant) -> bool {
        self.leases.get(node).is_some_and(|r| self.current(r, now))
    }

    /// The table as it stands.
    pub fn table(&self) -> &OwnershipTable {
        &self.table
    }

    /// Presence: register `node` with the fresh lease `id` of `ttl`.
    /// Partitions still listed under the node's previous lease go back to
    /// the leader (a new lease owns nothing).
    ///
    /// # Errors
    ///
    /// Refused while the node holds a current lease (node ids are unique).
    pub fn register(
        &mut self,
        now: Instant,
        node: &NodeId,
        id: LeaseId,
        ttl: Duration,
        peer_addr: Option<String>,
    ) -> Result<LeaseId, Refusal> {
        if self.node_current(node, now) {
            return Err(Refusal::Refused(format!(
                "node {node} already holds a current lease; a node id must be unique in its namespace"
            )));
        }
        let stale: Vec<_> = self
            .table
            .iter()
            .filter(|(_, owner)| owner.is_some_and(|a| &a.node == node))
            .map(|(p, _)| (p, None))
            .collect();
        self.table.reassign(stale);
        self.leases.insert(
            node.clone(),
            LeaseRecord {
                id,
                peer_addr,
                leaving: false,
                confirmed: false,
                committed_at: now,
                ttl,
                renewals: 0,
            },
        );
        Ok(id)
    }

    /// Presence: renew `lease`, measured from `now`. Returns the lease's
    /// renewal mark, one higher at every renewal (see
    /// [`ArbiterHistory::renewed`](crate::ArbiterHistory::renewed)).
    ///
    /// # Errors
    ///
    /// [`Refusal::LeaseExpired`] if the arbiter already judged it expired.
    pub fn renew(&mut self, now: Instant, node: &NodeId, lease: LeaseId) -> Result<u64, Refusal> {
        if !self.lease_current(node, lease, now) {
            return Err(Refusal::LeaseExpired(lease));
        }
        let r = self
            .leases
            .get_mut(node)
            .expect("a current lease has its record");
        r.committed_at = now;
        r.confirmed = true;
        r.renewals += 1;
        Ok(r.renewals)
    }

    /// Presence: give up `lease` now (graceful leave).
    pub fn release(&mut self, node: &NodeId, lease: LeaseId) {
        if self.leases.get(node).is_some_and(|r| r.id == lease) {
            self.leases.remove(node);
        }
    }

    /// Presence: mark `node` as leaving.
    ///
    /// # Errors
    ///
    /// [`Refusal::LeaseExpired`] if `lease` is not current.
    pub fn set_leaving(
        &mut self,
        now: Instant,
        node: &NodeId,
        lease: LeaseId,
    ) -> Result<(), Refusal> {
        if !self.lease_current(node, lease, now) {
            return Err(Refusal::LeaseExpired(lease));
        }
        if let Some(r) = self.leases.get_mut(node) {
            r.leaving = true;
        }
        Ok(())
    }

    /// Presence: the nodes whose leases are current at `now`.
    pub fn live_nodes(&self, now: Instant) -> Vec<Member> {
        self.leases
            .iter()
            .filter(|(_, r)| self.current(r, now))
            .map(|(node, r)| Member {
                node: node.clone(),
                peer_addr: r.peer_addr.clone(),
                leaving: r.leaving,
                confirmed: r.confirmed,
                leader: self.leader.as_ref() == Some(&(node.clone(), r.id)),
                lease_remaining: self.expires_at(r).saturating_duration_since(now),
            })
            .collect()
    }

    /// Leadership: become (or stay) leader if there is no live leader.
    /// Returns the term if `node` leads.
    ///
    /// # Errors
    ///
    /// [`Refusal::LeaseExpired`] if `lease` is not current.
    pub fn campaign(
        &mut self,
        now: Instant,
        node: &NodeId,
        lease: LeaseId,
    ) -> Result<Option<Term>, Refusal> {
        if !self.lease_current(node, lease, now) {
            return Err(Refusal::LeaseExpired(lease));
        }
        if let Some(r) = self.leases.get_mut(node) {
            r.confirmed = true;
        }
        let leader_alive = self
            .leader
            .as_ref()
            .is_some_and(|(n, l)| self.lease_current(n, *l, now));
        match &self.leader {
            Some((n, l)) if leader_alive && n == node && *l == lease => Ok(Some(Term(self.term))),
            _ if leader_alive => Ok(None),
            _ => {
                self.term += 1;
                self.leader = Some((node.clone(), lease));
                Ok(Some(Term(self.term)))
            }
        }
    }

    /// Ownership table: a graceful move by the owner `from` under `lease`,
    /// in one change.
    ///
    /// # Errors
    ///
    /// Refused if `from`'s lease is not current, it does not own one of the
    /// partitions, or a target has no current lease.
    pub fn transfer(
        &mut self,
        now: Instant,
        from: &NodeId,
        lease: LeaseId,
        moves: Vec<(PartitionId, NodeId)>,
    ) -> Result<OwnershipTable, Refusal> {
        if !self.lease_current(from, lease, now) {
            return Err(Refusal::LeaseExpired(lease));
        }
        for (partition, to) in &moves {
            if self.table.owner(*partition).is_none_or(|a| &a.node != from) {
                return Err(Refusal::Refused(format!(
                    "{from} cannot hand off {partition}: it does not own it"
                )));
            }
            if !self.node_current(to, now) {
                return Err(Refusal::Refused(format!(
                    "cannot hand {partition} to {to}: it has no current lease"
                )));
            }
        }
        self.table.hand_over(moves);
        Ok(self.table.clone())
    }

    /// Ownership table: apply `changes` as the leader of `term`, never
    /// giving away a partition whose owner's lease is still current
    /// (contract §3: a move only after release or arbiter-judged expiry).
    ///
    /// # Errors
    ///
    /// [`Refusal::NotLeader`] if `term` is not the current term of a live
    /// leader; [`Refusal::Refused`] naming a partition whose owner is live.
    pub fn write_table(
        &mut self,
        now: Instant,
        term: Term,
        changes: Vec<(PartitionId, Option<NodeId>)>,
    ) -> Result<OwnershipTable, Refusal> {
        let leader_ok = self.term == term.0
            && self
                .leader
                .as_ref()
                .is_some_and(|(n, l)| self.lease_current(n, *l, now));
        if !leader_ok {
            return Err(Refusal::NotLeader(Term(self.term)));
        }
        for (partition, _) in &changes {
            if let Some(owner) = self.table.owner(*partition)
                && self.node_current(&owner.node, now)
            {
                return Err(Refusal::Refused(format!(
                    "partition {partition} is owned by {} whose lease is still current",
                    owner.node
                )));
            }
        }
        self.table.reassign(changes);
        Ok(self.table.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_origin(Duration::from_millis(ms))
    }

    /// A lease is confirmed once its node uses it (a renewal or a
    /// campaign); a grant whose answer never reached its node is live but
    /// not confirmed, and so gets no partition from the leader.
    #[test]
    fn a_lease_is_confirmed_only_once_its_node_uses_it() {
        let mut s = ArbiterState::new(PartitionCount::new(2).unwrap());
        let (a, b) = (NodeId::new("a"), NodeId::new("b"));
        let ttl = Duration::from_millis(1000);
        let confirmed = |s: &ArbiterState, n: &NodeId, now| {
            s.live_nodes(now)
                .iter()
                .find(|m| &m.node == n)
                .map(|m| m.confirmed)
        };
        let la = s.register(at(0), &a, LeaseId(1), ttl, None).unwrap();
        let lb = s.register(at(0), &b, LeaseId(2), ttl, None).unwrap();
        assert_eq!(
            confirmed(&s, &a, at(1)),
            Some(false),
            "granted, not yet used"
        );
        s.campaign(at(10), &a, la).unwrap();
        assert_eq!(confirmed(&s, &a, at(11)), Some(true), "a campaign uses it");
        s.renew(at(20), &b, lb).unwrap();
        assert_eq!(confirmed(&s, &b, at(21)), Some(true), "a renewal uses it");
        // A fresh lease after expiry starts unconfirmed again.
        let lb2 = s.register(at(1100), &b, LeaseId(3), ttl, None).unwrap();
        assert_eq!(confirmed(&s, &b, at(1101)), Some(false));
        s.renew(at(1200), &b, lb2).unwrap();
        assert_eq!(confirmed(&s, &b, at(1201)), Some(true));
    }

    #[test]
    fn expiry_is_judged_on_the_arbiters_clock_from_the_commit() {
        let mut s = ArbiterState::new(PartitionCount::new(2).unwrap());
        let a = NodeId::new("a");
        let ttl = Duration::from_millis(1000);
        let l = s.register(at(0), &a, LeaseId(1), ttl, None).unwrap();
        s.renew(at(900), &a, l).unwrap();
        assert!(s.lease_current(&a, l, at(1899)));
        assert!(!s.lease_current(&a, l, at(1900)));
        assert_eq!(s.renew(at(1900), &a, l), Err(Refusal::LeaseExpired(l)));
    }

    #[test]
    fn a_live_owner_keeps_its_partitions_against_the_leader() {
        let mut s = ArbiterState::new(PartitionCount::new(1).unwrap());
        let (a, b) = (NodeId::new("a"), NodeId::new("b"));
        let ttl = Duration::from_millis(1000);
        let la = s.register(at(0), &a, LeaseId(1), ttl, None).unwrap();
        s.register(at(0), &b, LeaseId(2), ttl, None).unwrap();
        let term = s.campaign(at(0), &a, la).unwrap().unwrap();
        s.write_table(at(0), term, vec![(PartitionId(0), Some(b.clone()))])
            .unwrap();
        // b is live: a (the leader) cannot take its partition.
        let err = s
            .write_table(at(10), term, vec![(PartitionId(0), Some(a.clone()))])
            .unwrap_err();
        assert!(matches!(err, Refusal::Refused(_)), "{err}");
        // Only b itself can hand it over.
        s.transfer(at(20), &b, LeaseId(2), vec![(PartitionId(0), a.clone())])
            .unwrap();
        assert_eq!(s.table().owner(PartitionId(0)).unwrap().node, a);
    }
}
