//! The etcd arbiter's ownership-table calls: table, write_table, transfer,
//! and the table key's creation at connect.
//!
//! The table is one key, changed only by a transaction that compares its
//! mod revision with the one read (and whatever else the decision rested
//! on: the leader key's create revision, that no member key — a dead
//! owner's come back — was created since the read, the presence of the
//! targets'), retried a few times on a conflict. Changes are made with `fief_core`'s [`OwnershipTable`]
//! (`reassign`, `hand_over`), so epochs and tokens strictly increase as in
//! every other arbiter, under the rules of the core's `ArbiterState`: the
//! leader of the current term alone writes the table, and never gives away
//! a partition whose owner's lease is live; a graceful move is made by the
//! owner under its current lease, to live nodes only.
//!
//! This file decides table changes only; it must not touch leases or
//! member records (`presence.rs` does), nor speak HTTP (`gateway.rs`).

use std::collections::{BTreeMap, BTreeSet};

use fief_core::{NodeId, OwnershipTable, PartitionId};

use super::gateway::{Compare, KeyValue, Op, TxnResponse};
use super::records::{Keys, decode_table, encode_table};
use super::{CAS_ATTEMPTS, Etcd, backoff, first};
use crate::arbiter::{ArbiterError, LeaseId, Term};

/// The live members of a members range: node → its etcd lease.
fn live(keys: &Keys, read: &TxnResponse, range: usize) -> BTreeMap<NodeId, i64> {
    read.ranges
        .get(range)
        .into_iter()
        .flatten()
        .filter_map(|kv| Some((keys.node_of(&kv.key)?, kv.lease)))
        .collect()
}

impl Etcd {
    /// A namespace's table before anything was stored: numbered after the
    /// epoch the arbiter was given (see `EtcdOptions::numbered_after`).
    fn empty_table(&self) -> OwnershipTable {
        let owners = vec![None; self.partitions.get() as usize];
        OwnershipTable::from_parts(self.partitions, self.numbered_after, owners)
            .expect("no owners, one entry per partition")
    }

    /// The table a read of the table key found, with the key's mod
    /// revision (0: nothing stored yet).
    pub(super) fn table_from(
        &self,
        keys: &Keys,
        kv: Option<&KeyValue>,
    ) -> Result<(OwnershipTable, i64), ArbiterError> {
        match kv {
            Some(kv) => Ok((
                decode_table(&keys.table(), &kv.value, self.partitions)?,
                kv.mod_revision,
            )),
            None => Ok((self.empty_table(), 0)),
        }
    }

    /// At connect: store the namespace's empty table if it has none, and
    /// check the partition count of the one stored.
    pub(super) async fn ensure_table(&self, namespace: &str) -> Result<(), ArbiterError> {
        let keys = Keys::new(&self.prefix, namespace);
        let answer = self
            .gateway
            .txn(
                &[Compare::VersionIs(keys.table(), 0)],
                &[Op::Put(keys.table(), encode_table(&self.empty_table()), 0)],
                &[Op::Get(keys.table())],
            )
            .await?;
        if !answer.succeeded {
            self.table_from(&keys, first(&answer, 0))?;
        }
        Ok(())
    }

    /// Ownership table: the current table.
    pub(super) async fn table(&self, namespace: &str) -> Result<OwnershipTable, ArbiterError> {
        let keys = Keys::new(&self.prefix, namespace);
        let read = self.gateway.read(&[Op::Get(keys.table())]).await?;
        Ok(self.table_from(&keys, first(&read, 0))?.0)
    }

    /// Ownership table: apply `changes` as the leader of `term`, refusing to
    /// take a partition from an owner whose member key (lease) is live.
    pub(super) async fn write_table(
        &self,
        namespace: &str,
        term: Term,
        changes: Vec<(PartitionId, Option<NodeId>)>,
    ) -> Result<OwnershipTable, ArbiterError> {
        let keys = Keys::new(&self.prefix, namespace);
        for attempt in 0..CAS_ATTEMPTS {
            if attempt > 0 {
                backoff(attempt).await;
            }
            let read = self
                .gateway
                .read(&[
                    Op::Get(keys.leader()),
                    Op::Get(keys.table()),
                    keys.members(),
                ])
                .await?;
            let current = first(&read, 0).map(|kv| Term(kv.create_revision as u64));
            if current != Some(term) {
                return Err(ArbiterError::NotLeader(current));
            }
            let (table, table_revision) = self.table_from(&keys, first(&read, 1))?;
            let live = live(&keys, &read, 2);
            // A partition moves only once its owner's lease is gone: those
            // owners' member keys, absent at the read, must still be when the
            // change lands, so no member key may have been created since.
            let mut takes_from_dead = false;
            for (partition, to) in &changes {
                let Some(owner) = table.owner(*partition) else {
                    continue;
                };
                if Some(&owner.node) == to.as_ref() {
                    continue;
                }
                if live.contains_key(&owner.node) {
                    return Err(ArbiterError::Refused(format!(
                        "partition {partition} is owned by {} whose lease is still current",
                        owner.node
                    )));
                }
                takes_from_dead = true;
            }
            let mut next = table.clone();
            next.reassign(changes.iter().cloned());
            if next.epoch() == table.epoch() {
                return Ok(table);
            }
            let mut compare = vec![
                Compare::CreatedAt(keys.leader(), term.0 as i64),
                Compare::ModifiedAt(keys.table(), table_revision),
            ];
            if takes_from_dead {
                let (start, end) = keys.members_bounds();
                compare.push(Compare::NoneCreatedAfter(start, end, read.header.revision));
            }
            let write = [Op::Put(keys.table(), encode_table(&next), 0)];
            if self.gateway.txn(&compare, &write, &[]).await?.succeeded {
                return Ok(next);
            }
        }
        Err(ArbiterError::Refused(format!(
            "the ownership table kept changing under {CAS_ATTEMPTS} attempts to write it; the \
             leader retries at its next round"
        )))
    }

    /// Ownership table: a graceful move by the owner `from` under `lease`,
    /// to live nodes, in one change.
    pub(super) async fn transfer(
        &self,
        namespace: &str,
        from: &NodeId,
        lease: LeaseId,
        moves: Vec<(PartitionId, NodeId)>,
    ) -> Result<OwnershipTable, ArbiterError> {
        let keys = Keys::new(&self.prefix, namespace);
        let id = lease.0 as i64;
        for attempt in 0..CAS_ATTEMPTS {
            if attempt > 0 {
                backoff(attempt).await;
            }
            let read = self
                .gateway
                .read(&[Op::Get(keys.table()), keys.members()])
                .await?;
            let live = live(&keys, &read, 1);
            if live.get(from) != Some(&id) {
                return Err(ArbiterError::LeaseExpired(lease));
            }
            let (table, table_revision) = self.table_from(&keys, first(&read, 0))?;
            for (partition, to) in &moves {
                if table.owner(*partition).is_none_or(|a| &a.node != from) {
                    return Err(ArbiterError::Refused(format!(
                        "{from} cannot hand off {partition}: it does not own it"
                    )));
                }
                if !live.contains_key(to) {
                    return Err(ArbiterError::Refused(format!(
                        "cannot hand {partition} to {to}: it has no current lease"
                    )));
                }
            }
            let mut next = table.clone();
            next.hand_over(moves.iter().cloned());
            if next.epoch() == table.epoch() {
                return Ok(table);
            }
            let targets: BTreeSet<&NodeId> = moves.iter().map(|(_, to)| to).collect();
            let mut compare = vec![
                Compare::LeaseIs(keys.member(from), id),
                Compare::ModifiedAt(keys.table(), table_revision),
            ];
            compare.extend(targets.into_iter().map(|n| Compare::Exists(keys.member(n))));
            let write = [Op::Put(keys.table(), encode_table(&next), 0)];
            if self.gateway.txn(&compare, &write, &[]).await?.succeeded {
                return Ok(next);
            }
        }
        Err(ArbiterError::Refused(format!(
            "the ownership table kept changing under {CAS_ATTEMPTS} attempts of {from}'s \
             handoff; retry"
        )))
    }
}
