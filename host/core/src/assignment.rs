//! The leader's assignment: which live node should own each partition.
//!
//! Two deterministic decisions, both minimal in movement:
//!
//! - [`orphan_assignment`]: partitions with no owner, or whose owner the
//!   arbiter no longer counts as live, go to the least-loaded live nodes. The
//!   leader writes these itself (the arbiter has judged the old owner gone).
//! - [`rebalance_moves`]: when nodes join or leave, partitions move from
//!   nodes above their fair share to nodes below it. These are *graceful*
//!   moves: the leader asks the current owner to hand each partition off, and
//!   only the owner can give it away (contract §3).

use std::collections::BTreeMap;

use crate::ownership::{NodeId, OwnershipTable};
use crate::partition::PartitionId;

/// The changes that give every orphaned partition (no owner, or an owner not
/// in `live`) to the least-loaded node of `targets` (live nodes that take
/// partitions: not leaving).
///
/// ```
/// use fief_core::{NodeId, OwnershipTable, PartitionCount};
/// use fief_core::assignment::orphan_assignment;
///
/// let table = OwnershipTable::new(PartitionCount::new(4).unwrap());
/// let live = [NodeId::new("a"), NodeId::new("b")];
/// let changes = orphan_assignment(&table, &live, &live);
/// assert_eq!(changes.len(), 4);
/// assert_eq!(changes.iter().filter(|(_, n)| n == &Some(NodeId::new("a"))).count(), 2);
/// ```
pub fn orphan_assignment(
    table: &OwnershipTable,
    live: &[NodeId],
    targets: &[NodeId],
) -> Vec<(PartitionId, Option<NodeId>)> {
    if targets.is_empty() {
        return Vec::new();
    }
    let mut load: BTreeMap<&NodeId, usize> = targets.iter().map(|n| (n, 0)).collect();
    let mut orphans = Vec::new();
    for (partition, owner) in table.iter() {
        match owner {
            Some(a) if live.contains(&a.node) => {
                if let Some(count) = load.get_mut(&a.node) {
                    *count += 1;
                }
            }
            _ => orphans.push(partition),
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

/// One graceful move: `partition` from its live owner `from` to `to`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Move {
    /// The partition.
    pub partition: PartitionId,
    /// Its current owner.
    pub from: NodeId,
    /// Where it should go.
    pub to: NodeId,
}

/// The graceful moves that bring every node in `targets` to its fair share,
/// at most `max_moves` of them. Partitions owned by nodes *not* in `targets`
/// (leaving nodes) all move out. Fair share: `partitions / targets`, with the
/// remainder going to the nodes that already hold the most, so nothing moves
/// that need not.
///
/// ```
/// use fief_core::{NodeId, OwnershipTable, PartitionCount};
/// use fief_core::assignment::{orphan_assignment, rebalance_moves};
///
/// let (a, b) = (NodeId::new("a"), NodeId::new("b"));
/// let mut table = OwnershipTable::new(PartitionCount::new(8).unwrap());
/// table.reassign(orphan_assignment(&table, std::slice::from_ref(&a), std::slice::from_ref(&a)));
/// // b joins: half of a's partitions should move to it.
/// let moves = rebalance_moves(&table, &[a.clone(), b.clone()], usize::MAX);
/// assert_eq!(moves.len(), 4);
/// assert!(moves.iter().all(|m| m.from == a && m.to == b));
/// ```
pub fn rebalance_moves(table: &OwnershipTable, targets: &[NodeId], max_moves: usize) -> Vec<Move> {
    if targets.is_empty() {
        return Vec::new();
    }
    let mut targets: Vec<NodeId> = targets.to_vec();
    targets.sort();
    targets.dedup();
    let total = table.partitions().get() as usize;
    let mut load: BTreeMap<NodeId, usize> = targets.iter().map(|n| (n.clone(), 0)).collect();
    for (_, owner) in table.iter() {
        if let Some(count) = owner.and_then(|a| load.get_mut(&a.node)) {
            *count += 1;
        }
    }
    // Quotas: the remainder goes to the most loaded (then lowest id).
    let base = total / targets.len();
    let mut by_load: Vec<&NodeId> = targets.iter().collect();
    by_load.sort_by_key(|n| (std::cmp::Reverse(load[*n]), (*n).clone()));
    let quota: BTreeMap<NodeId, usize> = by_load
        .iter()
        .enumerate()
        .map(|(i, n)| ((*n).clone(), base + usize::from(i < total % targets.len())))
        .collect();
    let mut moves = Vec::new();
    for (partition, owner) in table.iter() {
        if moves.len() >= max_moves {
            break;
        }
        let Some(owner) = owner else { continue };
        let over = match load.get(&owner.node) {
            Some(&l) => l > quota[&owner.node],
            None => true, // not a target: leaving
        };
        if !over {
            continue;
        }
        let Some(to) = targets.iter().find(|n| load[*n] < quota[*n]).cloned() else {
            break;
        };
        if let Some(l) = load.get_mut(&owner.node) {
            *l -= 1;
        }
        *load.get_mut(&to).expect("a target") += 1;
        moves.push(Move {
            partition,
            from: owner.node.clone(),
            to,
        });
    }
    moves
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
        let abc = [a.clone(), b.clone(), c.clone()];
        table.reassign(orphan_assignment(&table, &abc, &abc));
        assert_eq!(table.count_owned_by(&a), 2);
        // c dies: only its two partitions move, one each to a and b.
        let ab = [a.clone(), b.clone()];
        let changes = orphan_assignment(&table, &ab, &ab);
        assert_eq!(changes.len(), 2);
        table.reassign(changes);
        assert_eq!(table.count_owned_by(&a), 3);
        assert_eq!(table.count_owned_by(&b), 3);
    }

    #[test]
    fn rebalancing_is_minimal_and_converges() {
        let partitions = PartitionCount::new(10).unwrap();
        let (a, b, c) = (NodeId::new("a"), NodeId::new("b"), NodeId::new("c"));
        let mut table = OwnershipTable::new(partitions);
        let ab = [a.clone(), b.clone()];
        table.reassign(orphan_assignment(&table, &ab, &ab));
        let all = [a.clone(), b.clone(), c.clone()];
        let moves = rebalance_moves(&table, &all, usize::MAX);
        // 5/5 -> 4/3/3 (or 3/4/3): exactly 3 partitions move, all to c.
        assert_eq!(moves.len(), 3);
        assert!(moves.iter().all(|m| m.to == c));
        table.reassign(moves.iter().map(|m| (m.partition, Some(m.to.clone()))));
        assert!(rebalance_moves(&table, &all, usize::MAX).is_empty());
        // a leaves: all of its partitions move out, nothing else does.
        let owned_by_a = table.count_owned_by(&a);
        let moves = rebalance_moves(&table, &[b.clone(), c.clone()], usize::MAX);
        assert_eq!(moves.len(), owned_by_a);
        assert!(moves.iter().all(|m| m.from == a));
    }

    #[test]
    fn a_leaving_owner_is_not_an_orphan() {
        let partitions = PartitionCount::new(4).unwrap();
        let (a, b) = (NodeId::new("a"), NodeId::new("b"));
        let mut table = OwnershipTable::new(partitions);
        table.reassign(orphan_assignment(
            &table,
            std::slice::from_ref(&a),
            std::slice::from_ref(&a),
        ));
        // a is leaving: still live, so its partitions are not orphans (they
        // move by handoff, not by reassignment).
        assert!(orphan_assignment(&table, &[a.clone(), b.clone()], &[b]).is_empty());
    }

    #[test]
    fn max_moves_bounds_a_round() {
        let partitions = PartitionCount::new(100).unwrap();
        let (a, b) = (NodeId::new("a"), NodeId::new("b"));
        let mut table = OwnershipTable::new(partitions);
        table.reassign(orphan_assignment(
            &table,
            std::slice::from_ref(&a),
            std::slice::from_ref(&a),
        ));
        assert_eq!(rebalance_moves(&table, &[a, b], 7).len(), 7);
    }
}
