//! The leader's assignment: which live node should own each partition.
//!
//! Deterministic and minimal: a partition keeps its owner while that owner is
//! live; only partitions with no owner, or whose owner the arbiter no longer
//! counts as live, are given out, each to the live node that owns the fewest
//! partitions at that point (ties broken by node id). Live-to-live moves for
//! rebalancing are graceful handoffs and are not decided here.

use std::collections::BTreeMap;

use crate::ownership::{NodeId, OwnershipTable};
use crate::partition::PartitionId;

/// The changes that give every orphaned partition to a live node.
///
/// ```
/// use fief_core::{NodeId, OwnershipTable, PartitionCount};
/// use fief_core::assignment::orphan_assignment;
///
/// let table = OwnershipTable::new(PartitionCount::new(4).unwrap());
/// let live = [NodeId::new("a"), NodeId::new("b")];
/// let changes = orphan_assignment(&table, &live);
/// assert_eq!(changes.len(), 4);
/// assert_eq!(changes.iter().filter(|(_, n)| n == &Some(NodeId::new("a"))).count(), 2);
/// ```
pub fn orphan_assignment(
    table: &OwnershipTable,
    live: &[NodeId],
) -> Vec<(PartitionId, Option<NodeId>)> {
    if live.is_empty() {
        return Vec::new();
    }
    let mut load: BTreeMap<&NodeId, usize> = live.iter().map(|n| (n, 0)).collect();
    let mut orphans = Vec::new();
    for (partition, owner) in table.iter() {
        match owner.and_then(|a| load.get_mut(&a.node)) {
            Some(count) => *count += 1,
            None => orphans.push(partition),
        }
    }
    orphans
        .into_iter()
        .map(|partition| {
            let (&node, count) = load
                .iter_mut()
                .min_by_key(|(node, count)| (**count, (**node).clone()))
                .expect("live is not empty");
            *count += 1;
            (partition, Some(node.clone()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::PartitionCount;

    #[test]
    fn live_owners_keep_their_partitions() {
        let partitions = PartitionCount::new(6).unwrap();
        let (a, b, c) = (NodeId::new("a"), NodeId::new("b"), NodeId::new("c"));
        let mut table = OwnershipTable::new(partitions);
        table.reassign(orphan_assignment(
            &table,
            &[a.clone(), b.clone(), c.clone()],
        ));
        assert_eq!(table.count_owned_by(&a), 2);
        // c dies: only its two partitions move, one each to a and b.
        let changes = orphan_assignment(&table, &[a.clone(), b.clone()]);
        assert_eq!(changes.len(), 2);
        table.reassign(changes);
        assert_eq!(table.count_owned_by(&a), 3);
        assert_eq!(table.count_owned_by(&b), 3);
    }
}
