//! The etcd arbiter's presence and leadership calls: register, renew,
//! release, set_leaving, live_nodes and campaign.
//!
//! A node's lease is an etcd lease, its TTL judged by etcd: the member key
//! (`members/<node>`) is attached to it and disappears with it, so "the key
//! exists" is "the lease has not been revoked". Every change of a member
//! record is a transaction comparing the key's lease and mod revision with
//! the ones read, retried a few times on a conflict. The leader key is
//! attached to the leader's lease; the term is its create revision.
//!
//! This file decides presence and leadership only; it must not change the
//! ownership table except to clear a re-registering node's partitions
//! (`table.rs` does the rest), nor speak HTTP (`gateway.rs` does).

use std::time::Duration;

use fief_core::{NodeId, PartitionId};

use super::gateway::{Compare, GatewayError, KeyValue, NOT_FOUND, Op, TxnResponse};
use super::records::{Keys, LeaderRecord, MemberRecord, decode, encode, encode_table};
use super::{CAS_ATTEMPTS, Etcd, MemberSnapshot, backoff, first};
use crate::arbiter::{ArbiterError, LeaseId, Member, Term};
use crate::sync::lock;

/// The etcd lease TTL for a node's `ttl`: whole seconds, rounded up, so etcd
/// never judges the lease expired before the node's own fence point. etcd
/// may grant more (its minimum TTL, 1.5 election timeouts: 2 s with default
/// settings); a longer lease at the arbiter only makes it later to give the
/// node's partitions away, never earlier.
pub(super) fn lease_seconds(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
}

fn member_record(kv: &KeyValue) -> Result<MemberRecord, ArbiterError> {
    let key = String::from_utf8_lossy(&kv.key);
    decode("member record", &key, &kv.value)
}

fn already_registered(node: &NodeId) -> ArbiterError {
    ArbiterError::Refused(format!(
        "node {node} already holds a current lease; a node id must be unique in its namespace"
    ))
}

impl Etcd {
    /// The cached record of a member key, if it is under `lease`.
    fn cached(&self, key: &str, lease: i64) -> Option<MemberSnapshot> {
        lock(&self.members)
            .get(key)
            .filter(|s| s.lease == lease)
            .cloned()
    }

    fn remember(&self, key: &str, snapshot: Option<MemberSnapshot>) {
        let mut members = lock(&self.members);
        match snapshot {
            Some(s) => members.insert(key.to_owned(), s),
            None => members.remove(key),
        };
    }

    /// A member key's record as read, if it is under `lease`.
    fn snapshot(
        &self,
        kv: Option<&KeyValue>,
        lease: i64,
    ) -> Result<Option<MemberSnapshot>, ArbiterError> {
        match kv {
            Some(kv) if kv.lease == lease => Ok(Some(MemberSnapshot {
                lease,
                mod_revision: kv.mod_revision,
                record: member_record(kv)?,
            })),
            _ => Ok(None),
        }
    }

    /// Change `node`'s member record under `lease` (always writing it, so
    /// the write has a revision of its own), comparing its lease and mod
    /// revision with the ones known. Returns the write's revision.
    /// `known` is the record as just read, if it was; else the cache's, or
    /// a read.
    async fn update_member(
        &self,
        keys: &Keys,
        node: &NodeId,
        lease: i64,
        known: Option<MemberSnapshot>,
        change: impl Fn(&mut MemberRecord),
    ) -> Result<i64, ArbiterError> {
        let key = keys.member(node);
        let expired = || ArbiterError::LeaseExpired(LeaseId(lease as u64));
        let mut known = known.or_else(|| self.cached(&key, lease));
        for attempt in 0..CAS_ATTEMPTS {
            let snapshot = match known.take() {
                Some(s) => s,
                None => {
                    let read = self.gateway.read(&[Op::Get(key.clone())]).await?;
                    match self.snapshot(first(&read, 0), lease)? {
                        Some(s) => s,
                        None => {
                            self.remember(&key, None);
                            return Err(expired());
                        }
                    }
                }
            };
            let mut record = snapshot.record.clone();
            change(&mut record);
            let answer = self
                .gateway
                .txn(
                    &[
                        Compare::LeaseIs(key.clone(), lease),
                        Compare::ModifiedAt(key.clone(), snapshot.mod_revision),
                    ],
                    &[Op::Put(key.clone(), encode(&record), lease)],
                    &[Op::Get(key.clone())],
                )
                .await?;
            if answer.succeeded {
                let revision = answer.header.revision;
                self.remember(
                    &key,
                    Some(MemberSnapshot {
                        lease,
                        mod_revision: revision,
                        record,
                    }),
                );
                return Ok(revision);
            }
            // Changed since (or gone): go on from what the failure read.
            match self.snapshot(first(&answer, 0), lease)? {
                Some(s) => known = Some(s),
                None => {
                    self.remember(&key, None);
                    return Err(expired());
                }
            }
            if attempt > 0 {
                backoff(attempt).await;
            }
        }
        Err(ArbiterError::Refused(format!(
            "the member record of {node} kept changing under {CAS_ATTEMPTS} attempts to update \
             it; the node retries at its next round"
        )))
    }

    /// Presence: grant an etcd lease and put the member record under it,
    /// unless the node already has a live member key. Partitions still
    /// listed under the node go back to the leader (a new lease owns
    /// nothing), in the same transaction.
    pub(super) async fn register(
        &self,
        namespace: &str,
        node: &NodeId,
        ttl: Duration,
        peer_addr: Option<&str>,
    ) -> Result<LeaseId, ArbiterError> {
        let keys = Keys::new(&self.prefix, namespace);
        let reads = [Op::Get(keys.member(node)), Op::Get(keys.table())];
        let read = self.gateway.read(&reads).await?;
        if first(&read, 0).is_some() {
            return Err(already_registered(node));
        }
        let asked = lease_seconds(ttl);
        let granted = self.gateway.grant(asked).await?;
        if granted.ttl > asked {
            tracing::warn!(
                node = %node, asked_s = asked, granted_s = granted.ttl,
                "etcd granted a longer lease than the node's TTL (its minimum lease TTL, 1.5 \
                 election timeouts): safe, but a failed node's partitions move only once the \
                 longer lease has expired"
            );
        }
        let lease = granted.id;
        let outcome = self
            .register_under(&keys, node, peer_addr, lease, read)
            .await;
        if outcome.is_err() {
            // Not ours after all: give the grant back (it expires anyway).
            let _ = self.gateway.revoke(lease).await;
        }
        outcome
    }

    async fn register_under(
        &self,
        keys: &Keys,
        node: &NodeId,
        peer_addr: Option<&str>,
        lease: i64,
        mut read: TxnResponse,
    ) -> Result<LeaseId, ArbiterError> {
        let key = keys.member(node);
        let record = MemberRecord::new(node, peer_addr);
        for attempt in 0..CAS_ATTEMPTS {
            if attempt > 0 {
                backoff(attempt).await;
                read = self
                    .gateway
                    .read(&[Op::Get(key.clone()), Op::Get(keys.table())])
                    .await?;
            }
            if first(&read, 0).is_some() {
                return Err(already_registered(node));
            }
            let (table, table_revision) = self.table_from(keys, first(&read, 1))?;
            let stale: Vec<(PartitionId, Option<NodeId>)> = table
                .iter()
                .filter(|(_, owner)| owner.is_some_and(|a| &a.node == node))
                .map(|(p, _)| (p, None))
                .collect();
            let mut writes = vec![Op::Put(key.clone(), encode(&record), lease)];
            if !stale.is_empty() {
                let mut next = table.clone();
                next.reassign(stale);
                writes.push(Op::Put(keys.table(), encode_table(&next), 0));
            }
            let answer = self
                .gateway
                .txn(
                    &[
                        Compare::VersionIs(key.clone(), 0),
                        Compare::ModifiedAt(keys.table(), table_revision),
                    ],
                    &writes,
                    &[Op::Get(key.clone())],
                )
                .await?;
            if answer.succeeded {
                self.remember(
                    &key,
                    Some(MemberSnapshot {
                        lease,
                        mod_revision: answer.header.revision,
                        record,
                    }),
                );
                return Ok(LeaseId(lease as u64));
            }
            if first(&answer, 0).is_some() {
                return Err(already_registered(node));
            }
        }
        Err(ArbiterError::Refused(format!(
            "the ownership table kept changing while {node} registered ({CAS_ATTEMPTS} \
             attempts); the node retries its join"
        )))
    }

    /// Presence: keep the etcd lease alive, then rewrite the member record
    /// (confirmed) under it; the rewrite's revision is the renewal mark.
    pub(super) async fn renew(
        &self,
        namespace: &str,
        node: &NodeId,
        lease: LeaseId,
    ) -> Result<u64, ArbiterError> {
        let keys = Keys::new(&self.prefix, namespace);
        let id = lease.0 as i64;
        if self.gateway.keepalive(id).await?.ttl <= 0 {
            self.remember(&keys.member(node), None);
            return Err(ArbiterError::LeaseExpired(lease));
        }
        let revision = self
            .update_member(&keys, node, id, None, |r| r.confirmed = true)
            .await?;
        Ok(revision as u64)
    }

    /// Presence: revoke the etcd lease (the member key and, if it leads,
    /// the leader key go with it). A lease etcd no longer has is released
    /// already; a lease that is not the node's current one is left alone.
    pub(super) async fn release(
        &self,
        namespace: &str,
        node: &NodeId,
        lease: LeaseId,
    ) -> Result<(), ArbiterError> {
        let keys = Keys::new(&self.prefix, namespace);
        let key = keys.member(node);
        let id = lease.0 as i64;
        self.remember(&key, None);
        let read = self.gateway.read(&[Op::Get(key)]).await?;
        if first(&read, 0).is_some_and(|kv| kv.lease != id) {
            return Ok(());
        }
        match self.gateway.revoke(id).await {
            Ok(()) => Ok(()),
            Err(GatewayError::Status { code, .. }) if code == NOT_FOUND => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Presence: mark the node as leaving, under its current lease.
    pub(super) async fn set_leaving(
        &self,
        namespace: &str,
        node: &NodeId,
        lease: LeaseId,
    ) -> Result<(), ArbiterError> {
        let keys = Keys::new(&self.prefix, namespace);
        self.update_member(&keys, node, lease.0 as i64, None, |r| r.leaving = true)
            .await
            .map(|_| ())
    }

    /// Presence: the member keys, each with the time left on its lease as
    /// etcd judges it (whole seconds, rounded down). A key whose lease etcd
    /// has just revoked is left out; one whose lease has expired but is not
    /// yet revoked (etcd revokes within about half a second) is listed,
    /// with no time left: the safe side, since the table's writes treat it
    /// as live too.
    pub(super) async fn live_nodes(&self, namespace: &str) -> Result<Vec<Member>, ArbiterError> {
        let keys = Keys::new(&self.prefix, namespace);
        let read = self
            .gateway
            .read(&[keys.members(), Op::Get(keys.leader())])
            .await?;
        let leader = match first(&read, 1) {
            Some(kv) => Some(decode::<LeaderRecord>(
                "leader record",
                &keys.leader(),
                &kv.value,
            )?),
            None => None,
        };
        let kvs = read.ranges.first().cloned().unwrap_or_default();
        let records = kvs
            .iter()
            .map(|kv| Ok((member_record(kv)?, kv.lease)))
            .collect::<Result<Vec<_>, ArbiterError>>()?;
        let ttls = futures_util::future::join_all(
            records
                .iter()
                .map(|(_, lease)| self.gateway.time_to_live(*lease)),
        )
        .await;
        let mut members = Vec::new();
        for ((record, lease), ttl) in records.into_iter().zip(ttls) {
            let ttl = ttl?.ttl;
            if ttl < 0 {
                continue;
            }
            members.push(Member {
                leader: leader
                    .as_ref()
                    .is_some_and(|l| l.node == record.node && l.lease == lease),
                node: NodeId::new(record.node),
                peer_addr: record.peer_addr,
                leaving: record.leaving,
                confirmed: record.confirmed,
                lease_remaining: Duration::from_secs(ttl as u64),
            });
        }
        members.sort_by(|a, b| a.node.cmp(&b.node));
        Ok(members)
    }

    /// Leadership: create the leader key under the node's lease if there is
    /// none (the term is the revision that created it), or report the term
    /// if the node already leads under this lease. A campaign confirms the
    /// lease, as a renewal does.
    pub(super) async fn campaign(
        &self,
        namespace: &str,
        node: &NodeId,
        lease: LeaseId,
    ) -> Result<Option<Term>, ArbiterError> {
        let keys = Keys::new(&self.prefix, namespace);
        let (key, leader_key) = (keys.member(node), keys.leader());
        let id = lease.0 as i64;
        for attempt in 0..CAS_ATTEMPTS {
            if attempt > 0 {
                backoff(attempt).await;
            }
            let read = self
                .gateway
                .read(&[Op::Get(key.clone()), Op::Get(leader_key.clone())])
                .await?;
            let Some(me) = self.snapshot(first(&read, 0), id)? else {
                self.remember(&key, None);
                return Err(ArbiterError::LeaseExpired(lease));
            };
            if let Some(kv) = first(&read, 1) {
                let leader: LeaderRecord = decode("leader record", &leader_key, &kv.value)?;
                let mine = leader.node == node.as_str() && kv.lease == id;
                let term = Term(kv.create_revision as u64);
                if !me.record.confirmed {
                    self.update_member(&keys, node, id, Some(me), |r| r.confirmed = true)
                        .await?;
                }
                return Ok(mine.then_some(term));
            }
            let leader = LeaderRecord {
                format: super::records::FORMAT,
                node: node.as_str().to_owned(),
                lease: id,
            };
            let mut writes = vec![Op::Put(leader_key.clone(), encode(&leader), id)];
            let mut record = me.record.clone();
            if !record.confirmed {
                record.confirmed = true;
                writes.push(Op::Put(key.clone(), encode(&record), id));
            }
            let answer = self
                .gateway
                .txn(
                    &[
                        Compare::LeaseIs(key.clone(), id),
                        Compare::ModifiedAt(key.clone(), me.mod_revision),
                        Compare::VersionIs(leader_key.clone(), 0),
                    ],
                    &writes,
                    &[],
                )
                .await?;
            if answer.succeeded {
                let revision = answer.header.revision;
                if writes.len() > 1 {
                    self.remember(
                        &key,
                        Some(MemberSnapshot {
                            lease: id,
                            mod_revision: revision,
                            record,
                        }),
                    );
                }
                return Ok(Some(Term(revision as u64)));
            }
        }
        Err(ArbiterError::Refused(format!(
            "the leadership or {node}'s member record kept changing under {CAS_ATTEMPTS} \
             campaign attempts; the node campaigns again at its next round"
        )))
    }
}
