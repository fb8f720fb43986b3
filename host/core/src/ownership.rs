//! The partition table and the routing decision for one key.
//!
//! The table maps each partition to the node that owns it and to the
//! [`OwnershipToken`] it was granted under. It is versioned by an epoch that
//! strictly increases with every change; a node only ever replaces its copy
//! with a newer one. The leader alone writes it, through the arbiter.
//!
//! [`OwnershipTable::route`] is the routing decision (guarantee 2): a node
//! serves a key only if its lease is current *and* the table says it owns the
//! key's partition; a fenced node serves nothing.

use std::fmt;
use std::sync::Arc;

use crate::lease::LeaseStatus;
use crate::partition::{PartitionCount, PartitionId};

/// A node's identity within a namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(Arc<str>);

impl NodeId {
    /// A node id from its name.
    pub fn new(name: impl AsRef<str>) -> Self {
        NodeId(Arc::from(name.as_ref()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A number that strictly increases each time a partition gets a new owner.
///
/// It is the table epoch at which the partition was granted to its owner, so
/// it is also comparable across partitions. Keys read it (`ownership-token`)
/// and attach it to external writes so a store can reject a stale owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OwnershipToken(pub u64);

/// One partition's owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// The owning node.
    pub node: NodeId,
    /// The token it owns the partition under.
    pub token: OwnershipToken,
    /// When the partition came to `node` by a graceful handoff: the token
    /// its previous owner held it under. `None` when the leader assigned it
    /// (after a release, an expiry or a rejoin). The new owner accepts the
    /// handoff states it was sent only when they were sent under this token,
    /// so a state from a transfer that never committed is never served.
    pub handed_from: Option<OwnershipToken>,
}

/// Where a message for a key should go, as decided by one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// This node owns the key's partition under a current lease: serve it.
    Local {
        /// The key's partition.
        partition: PartitionId,
        /// The token the partition is owned under.
        token: OwnershipToken,
    },
    /// Another node owns the partition: forward the message there.
    Forward {
        /// The key's partition.
        partition: PartitionId,
        /// The owner, per this node's copy of the table.
        owner: NodeId,
        /// The token it owns the partition under, per that copy: a new one
        /// after every owner change, including the owner's own fence and
        /// rejoin (what it held before is gone, its connections' attachments
        /// too).
        token: OwnershipToken,
    },
    /// Nobody may serve the message here.
    Refuse(RouteRefusal),
}

/// Why a message was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteRefusal {
    /// This node's lease is not current (it fenced, or never got one).
    Fenced,
    /// The partition has no owner at the moment (a move is under way, or its
    /// owner's lease has not yet expired at the arbiter).
    Unowned(PartitionId),
}

/// The partition table: partition → owner, with its epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnershipTable {
    epoch: u64,
    partitions: PartitionCount,
    owners: Vec<Option<Assignment>>,
}

impl OwnershipTable {
    /// An empty table (epoch 0, no owners).
    pub fn new(partitions: PartitionCount) -> Self {
        OwnershipTable {
            epoch: 0,
            partitions,
            owners: vec![None; partitions.get() as usize],
        }
    }

    /// A table from stored parts (an arbiter's rows).
    ///
    /// # Errors
    ///
    /// A message when `owners` does not have one entry per partition, or a
    /// token is above the epoch.
    pub fn from_parts(
        partitions: PartitionCount,
        epoch: u64,
        owners: Vec<Option<Assignment>>,
    ) -> Result<Self, String> {
        if owners.len() != partitions.get() as usize {
            return Err(format!(
                "the table has {} partitions, expected {}",
                owners.len(),
                partitions.get()
            ));
        }
        if owners.iter().flatten().any(|a| a.token.0 > epoch) {
            return Err(format!("a token is above the table's epoch {epoch}"));
        }
        Ok(OwnershipTable {
            epoch,
            partitions,
            owners,
        })
    }

    /// The table's epoch: bumped by every change.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The partition count.
    pub fn partitions(&self) -> PartitionCount {
        self.partitions
    }

    /// The owner of `partition`, if any.
    pub fn owner(&self, partition: PartitionId) -> Option<&Assignment> {
        self.owners
            .get(partition.0 as usize)
            .and_then(Option::as_ref)
    }

    /// Every partition with its owner.
    pub fn iter(&self) -> impl Iterator<Item = (PartitionId, Option<&Assignment>)> {
        self.owners
            .iter()
            .enumerate()
            .map(|(i, a)| (PartitionId(i as u32), a.as_ref()))
    }

    /// How many partitions `node` owns.
    pub fn count_owned_by(&self, node: &NodeId) -> usize {
        self.owners
            .iter()
            .filter(|a| a.as_ref().is_some_and(|a| &a.node == node))
            .count()
    }

    /// Give each listed partition a new owner (or none) in one change: the
    /// epoch is bumped once and each newly owned partition's token is the new
    /// epoch. Returns the new epoch. Assigning a partition to the node that
    /// already owns it changes nothing for that partition.
    pub fn reassign(
        &mut self,
        changes: impl IntoIterator<Item = (PartitionId, Option<NodeId>)>,
    ) -> u64 {
        let next = self.epoch + 1;
        let mut changed = false;
        for (partition, node) in changes {
            let Some(slot) = self.owners.get_mut(partition.0 as usize) else {
                continue;
            };
            let same = match (&*slot, &node) {
                (Some(a), Some(n)) => &a.node == n,
                (None, None) => true,
                _ => false,
            };
            if same {
                continue;
            }
            *slot = node.map(|node| Assignment {
                node,
                token: OwnershipToken(next),
                handed_from: None,
            });
            changed = true;
        }
        if changed {
            self.epoch = next;
        }
        self.epoch
    }

    /// Hand each listed partition from its owner to a new one in one change
    /// (a graceful move): as [`OwnershipTable::reassign`], and each moved
    /// partition records the token its previous owner held it under
    /// ([`Assignment::handed_from`]). A partition with no owner, or handed to
    /// the node that owns it, is left as it is.
    pub fn hand_over(&mut self, moves: impl IntoIterator<Item = (PartitionId, NodeId)>) -> u64 {
        let next = self.epoch + 1;
        let mut changed = false;
        for (partition, to) in moves {
            let Some(Some(slot)) = self.owners.get_mut(partition.0 as usize) else {
                continue;
            };
            if slot.node == to {
                continue;
            }
            *slot = Assignment {
                node: to,
                token: OwnershipToken(next),
                handed_from: Some(slot.token),
            };
            changed = true;
        }
        if changed {
            self.epoch = next;
        }
        self.epoch
    }

    /// Replace this copy with `newer` if its epoch is higher. Returns whether
    /// it was replaced.
    pub fn update_from(&mut self, newer: &OwnershipTable) -> bool {
        if newer.epoch > self.epoch {
            *self = newer.clone();
            true
        } else {
            false
        }
    }

    /// Decide where a message for `key` goes, from `me`'s point of view.
    ///
    /// ```
    /// use fief_core::{Instant, NodeId, OwnershipTable, PartitionCount, Route, RouteRefusal};
    /// use fief_core::LeaseStatus;
    ///
    /// let me = NodeId::new("a");
    /// let partitions = PartitionCount::new(4).unwrap();
    /// let mut table = OwnershipTable::new(partitions);
    /// table.reassign(partitions.iter().map(|p| (p, Some(me.clone()))));
    /// let current = LeaseStatus::Current { fence_point: Instant::ZERO };
    /// assert!(matches!(table.route(&me, current, "alice"), Route::Local { .. }));
    /// let fenced = LeaseStatus::Fenced { at: Instant::ZERO };
    /// assert_eq!(table.route(&me, fenced, "alice"), Route::Refuse(RouteRefusal::Fenced));
    /// ```
    pub fn route(&self, me: &NodeId, lease: LeaseStatus, key: &str) -> Route {
        if !lease.is_current() {
            return Route::Refuse(RouteRefusal::Fenced);
        }
        let partition = self.partitions.of(key);
        match self.owner(partition) {
            Some(a) if &a.node == me => Route::Local {
                partition,
                token: a.token,
            },
            Some(a) => Route::Forward {
                partition,
                owner: a.node.clone(),
                token: a.token,
            },
            None => Route::Refuse(RouteRefusal::Unowned(partition)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::Instant;

    fn current() -> LeaseStatus {
        LeaseStatus::Current {
            fence_point: Instant::ZERO,
        }
    }

    #[test]
    fn tokens_strictly_increase_at_each_owner_change() {
        let partitions = PartitionCount::new(2).unwrap();
        let (a, b) = (NodeId::new("a"), NodeId::new("b"));
        let mut table = OwnershipTable::new(partitions);
        table.reassign([(PartitionId(0), Some(a.clone()))]);
        let t1 = table.owner(PartitionId(0)).unwrap().token;
        // Re-assigning to the same owner is not a change.
        assert_eq!(table.reassign([(PartitionId(0), Some(a.clone()))]), 1);
        table.reassign([(PartitionId(0), None)]);
        table.reassign([(PartitionId(0), Some(b.clone()))]);
        let t2 = table.owner(PartitionId(0)).unwrap().token;
        assert!(t2 > t1);
        assert_eq!(table.epoch(), 3);
    }

    #[test]
    fn a_handed_over_partition_records_its_previous_token() {
        let partitions = PartitionCount::new(2).unwrap();
        let (a, b) = (NodeId::new("a"), NodeId::new("b"));
        let mut table = OwnershipTable::new(partitions);
        table.reassign([(PartitionId(0), Some(a.clone()))]);
        let from = table.owner(PartitionId(0)).unwrap().token;
        assert_eq!(table.owner(PartitionId(0)).unwrap().handed_from, None);
        // Partition 1 has no owner: nothing to hand over.
        table.hand_over([(PartitionId(0), b.clone()), (PartitionId(1), b.clone())]);
        let moved = table.owner(PartitionId(0)).unwrap();
        assert_eq!((&moved.node, moved.handed_from), (&b, Some(from)));
        assert!(moved.token > from);
        assert!(table.owner(PartitionId(1)).is_none());
        // A leader's assignment is not a handoff.
        table.reassign([(PartitionId(0), Some(a.clone()))]);
        assert_eq!(table.owner(PartitionId(0)).unwrap().handed_from, None);
    }

    #[test]
    fn routes_to_the_owner_and_refuses_unowned() {
        let partitions = PartitionCount::new(1).unwrap();
        let (a, b) = (NodeId::new("a"), NodeId::new("b"));
        let mut table = OwnershipTable::new(partitions);
        assert_eq!(
            table.route(&a, current(), "k"),
            Route::Refuse(RouteRefusal::Unowned(PartitionId(0)))
        );
        table.reassign([(PartitionId(0), Some(b.clone()))]);
        let token = table.owner(PartitionId(0)).unwrap().token;
        assert_eq!(
            table.route(&a, current(), "k"),
            Route::Forward {
                partition: PartitionId(0),
                owner: b,
                token,
            }
        );
    }

    #[test]
    fn a_node_without_a_current_lease_routes_nothing() {
        let partitions = PartitionCount::new(1).unwrap();
        let a = NodeId::new("a");
        let mut table = OwnershipTable::new(partitions);
        table.reassign([(PartitionId(0), Some(a.clone()))]);
        assert_eq!(
            table.route(&a, LeaseStatus::Pending, "k"),
            Route::Refuse(RouteRefusal::Fenced)
        );
    }

    #[test]
    fn only_newer_tables_replace_older_ones() {
        let partitions = PartitionCount::new(1).unwrap();
        let mut old = OwnershipTable::new(partitions);
        let mut new = old.clone();
        new.reassign([(PartitionId(0), Some(NodeId::new("a")))]);
        assert!(old.update_from(&new));
        assert!(!old.update_from(&OwnershipTable::new(partitions)));
        assert_eq!(old.epoch(), 1);
    }
}
