//! The arbiter's statements, one method per [`Arbiter`] call, each in one
//! transaction where it reads before it writes (the namespace row locked
//! `FOR UPDATE`). Time is the server's (`clock_timestamp()`). It must not
//! open connections itself (`db.rs` does).

use std::time::Duration;

use fief_core::{NodeId, OwnershipTable, PartitionId};
use tokio_postgres::types::Type;

use super::db::{Conn, Db, version_record};
use crate::arbiter::{
    Arbiter, ArbiterError, ArbiterFuture, LeaseId, Member, ModuleVersionRecord, NewModuleVersion,
    StoredModule, Term,
};

impl Arbiter for Db {
    fn register<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        ttl: Duration,
        peer_addr: Option<&'a str>,
    ) -> ArbiterFuture<'a, LeaseId> {
        Box::pin(async move {
            let ttl_ms = ttl.as_millis() as i64;
            let row = self
                .with(Conn::Lease, async |c| {
                    let tx = c.transaction().await?;
                    let row = tx.query_opt(
                        "INSERT INTO fief_leases (namespace, node_id, lease_id, ttl_ms, peer_addr, confirmed, expires_at)
                         VALUES ($1, $2, nextval('fief_lease_ids'), $3::bigint, $4, false, clock_timestamp() + $3::bigint * interval '1 millisecond')
                         ON CONFLICT (namespace, node_id) DO UPDATE
                            SET lease_id = EXCLUDED.lease_id, ttl_ms = EXCLUDED.ttl_ms,
                                peer_addr = EXCLUDED.peer_addr, expires_at = EXCLUDED.expires_at,
                                leaving = false, confirmed = false
                            WHERE fief_leases.expires_at <= clock_timestamp()
                         RETURNING lease_id",
                        &[&namespace, &node.as_str(), &ttl_ms, &peer_addr],
                    )
                    .await?;
                    if row.is_some() {
                        // A new lease owns nothing yet: partitions still
                        // listed under this node's previous (dead) lease go
                        // back to the leader, who gives them out anew.
                        tx.execute(
                            "WITH bumped AS (
                                 UPDATE fief_namespaces SET epoch = epoch + 1 WHERE namespace = $1
                                 AND EXISTS (SELECT 1 FROM fief_partitions WHERE namespace = $1 AND node_id = $2)
                                 RETURNING epoch)
                             UPDATE fief_partitions SET node_id = NULL, token = (SELECT epoch FROM bumped), handed_from = NULL
                             WHERE namespace = $1 AND node_id = $2",
                            &[&namespace, &node.as_str()],
                        )
                        .await?;
                    }
                    tx.commit().await?;
                    Ok(row)
                })
                .await?;
            match row {
                Some(row) => Ok(LeaseId(row.get::<_, i64>(0) as u64)),
                None => Err(ArbiterError::Refused(format!(
                    "node {node} already holds a current lease; a node id must be unique in its namespace"
                ))),
            }
        })
    }

    fn renew<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, u64> {
        Box::pin(async move {
            let row = self
                .with(Conn::Lease, async |c| {
                    // Typed parameters: one round trip (a text statement
                    // with untyped parameters is prepared first, two).
                    c.query_typed_opt(
                        "UPDATE fief_leases SET expires_at = clock_timestamp() + ttl_ms * interval '1 millisecond',
                                confirmed = true, renewals = renewals + 1
                         WHERE namespace = $1 AND node_id = $2 AND lease_id = $3 AND expires_at > clock_timestamp()
                         RETURNING renewals",
                        &[
                            (&namespace, Type::TEXT),
                            (&node.as_str(), Type::TEXT),
                            (&(lease.0 as i64), Type::INT8),
                        ],
                    )
                    .await
                })
                .await?;
            match row {
                Some(row) => Ok(row.get::<_, i64>(0) as u64),
                None => Err(ArbiterError::LeaseExpired(lease)),
            }
        })
    }

    fn release<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        Box::pin(async move {
            self.with(Conn::Lease, async |c| {
                c.execute(
                    "UPDATE fief_leases SET expires_at = clock_timestamp()
                     WHERE namespace = $1 AND node_id = $2 AND lease_id = $3",
                    &[&namespace, &node.as_str(), &(lease.0 as i64)],
                )
                .await
            })
            .await
            .map(|_| ())
        })
    }

    fn set_leaving<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        Box::pin(async move {
            let updated = self
                .with(Conn::Lease, async |c| {
                    c.execute(
                        "UPDATE fief_leases SET leaving = true
                         WHERE namespace = $1 AND node_id = $2 AND lease_id = $3 AND expires_at > clock_timestamp()",
                        &[&namespace, &node.as_str(), &(lease.0 as i64)],
                    )
                    .await
                })
                .await?;
            if updated == 1 {
                Ok(())
            } else {
                Err(ArbiterError::LeaseExpired(lease))
            }
        })
    }

    fn transfer<'a>(
        &'a self,
        namespace: &'a str,
        from: &'a NodeId,
        lease: LeaseId,
        moves: Vec<(PartitionId, NodeId)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        Box::pin(async move {
            let partitions = self.partitions;
            let outcome = self
                .with(Conn::Table, async |c| {
                    let tx = c.transaction().await?;
                    let epoch: i64 = tx
                        .query_one("SELECT epoch FROM fief_namespaces WHERE namespace = $1 FOR UPDATE", &[&namespace])
                        .await?
                        .get(0);
                    let me_alive = tx
                        .query_opt(
                            "SELECT 1 FROM fief_leases WHERE namespace = $1 AND node_id = $2 AND lease_id = $3
                             AND expires_at > clock_timestamp()",
                            &[&namespace, &from.as_str(), &(lease.0 as i64)],
                        )
                        .await?
                        .is_some();
                    if !me_alive {
                        return Ok(Err(ArbiterError::LeaseExpired(lease)));
                    }
                    let next = epoch + 1;
                    let wanted: Vec<i32> = moves.iter().map(|(p, _)| p.0 as i32).collect();
                    let targets: Vec<&str> = moves.iter().map(|(_, to)| to.as_str()).collect();
                    // One statement for the whole batch: a move applies only
                    // if `from` owns the partition and the target is live.
                    let moved = tx
                        .execute(
                            "UPDATE fief_partitions p SET node_id = m.target, token = $5, handed_from = p.token
                             FROM unnest($2::int[], $3::text[]) AS m(partition, target)
                             WHERE p.namespace = $1 AND p.partition = m.partition AND p.node_id = $4
                             AND EXISTS (SELECT 1 FROM fief_leases l WHERE l.namespace = $1
                                         AND l.node_id = m.target AND l.expires_at > clock_timestamp())",
                            &[&namespace, &wanted, &targets, &from.as_str(), &next],
                        )
                        .await?;
                    if moved as usize != moves.len() {
                        return Ok(Err(ArbiterError::Refused(format!(
                            "{from} cannot hand off these partitions: it does not own all of them, or a target has no current lease"
                        ))));
                    }
                    tx.execute("UPDATE fief_namespaces SET epoch = $2 WHERE namespace = $1", &[&namespace, &next])
                        .await?;
                    tx.commit().await?;
                    Ok(Ok(()))
                })
                .await?;
            outcome?;
            self.with(Conn::Table, async |c| {
                Self::read_table(c, namespace, partitions).await
            })
            .await?
            .map_err(ArbiterError::Refused)
        })
    }

    fn live_nodes<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<Member>> {
        Box::pin(async move {
            let rows = self
                .with(Conn::Table, async |c| {
                    c.query(
                        "SELECT l.node_id, l.peer_addr, l.leaving,
                                COALESCE(n.leader_node = l.node_id AND n.leader_lease = l.lease_id, false),
                                (EXTRACT(EPOCH FROM (l.expires_at - clock_timestamp())) * 1000)::bigint,
                                l.confirmed
                         FROM fief_leases l JOIN fief_namespaces n USING (namespace)
                         WHERE l.namespace = $1 AND l.expires_at > clock_timestamp() ORDER BY l.node_id",
                        &[&namespace],
                    )
                    .await
                })
                .await?;
            Ok(rows
                .iter()
                .map(|r| Member {
                    node: NodeId::new(r.get::<_, String>(0)),
                    peer_addr: r.get(1),
                    leaving: r.get(2),
                    leader: r.get(3),
                    lease_remaining: Duration::from_millis(r.get::<_, i64>(4).max(0) as u64),
                    confirmed: r.get(5),
                })
                .collect())
        })
    }

    fn campaign<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, Option<Term>> {
        Box::pin(async move {
            self
                .with(Conn::Table, async |c| {
                    let tx = c.transaction().await?;
                    let row = tx
                        .query_one(
                            "SELECT n.term, n.leader_node, n.leader_lease,
                                    EXISTS (SELECT 1 FROM fief_leases l WHERE l.namespace = n.namespace
                                            AND l.node_id = n.leader_node AND l.lease_id = n.leader_lease
                                            AND l.expires_at > clock_timestamp()) AS leader_alive,
                                    EXISTS (SELECT 1 FROM fief_leases l WHERE l.namespace = n.namespace
                                            AND l.node_id = $2 AND l.lease_id = $3
                                            AND l.expires_at > clock_timestamp()) AS me_alive
                             FROM fief_namespaces n WHERE n.namespace = $1 FOR UPDATE",
                            &[&namespace, &node.as_str(), &(lease.0 as i64)],
                        )
                        .await?;
                    let term: i64 = row.get(0);
                    let leader: Option<String> = row.get(1);
                    let leader_lease: Option<i64> = row.get(2);
                    let leader_alive: bool = row.get(3);
                    let me_alive: bool = row.get(4);
                    if me_alive {
                        // Campaigning with the lease proves its node knows
                        // it (the first round after a join campaigns
                        // before it renews). Updates, and locks, the row
                        // only the first time.
                        tx.execute(
                            "UPDATE fief_leases SET confirmed = true
                             WHERE namespace = $1 AND node_id = $2 AND lease_id = $3 AND NOT confirmed",
                            &[&namespace, &node.as_str(), &(lease.0 as i64)],
                        )
                        .await?;
                    }
                    let outcome = if !me_alive {
                        Err(ArbiterError::LeaseExpired(lease))
                    } else if leader_alive {
                        let me = leader.as_deref() == Some(node.as_str()) && leader_lease == Some(lease.0 as i64);
                        Ok(me.then_some(Term(term as u64)))
                    } else {
                        tx.execute(
                            "UPDATE fief_namespaces SET term = term + 1, leader_node = $2, leader_lease = $3 WHERE namespace = $1",
                            &[&namespace, &node.as_str(), &(lease.0 as i64)],
                        )
                        .await?;
                        Ok(Some(Term(term as u64 + 1)))
                    };
                    tx.commit().await?;
                    Ok(outcome)
                })
                .await?
        })
    }

    fn table<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, OwnershipTable> {
        Box::pin(async move {
            let partitions = self.partitions;
            self.with(Conn::Table, async |c| {
                Self::read_table(c, namespace, partitions).await
            })
            .await?
            .map_err(ArbiterError::Refused)
        })
    }

    fn write_table<'a>(
        &'a self,
        namespace: &'a str,
        term: Term,
        changes: Vec<(PartitionId, Option<NodeId>)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        Box::pin(async move {
            let partitions = self.partitions;
            let outcome = self
                .with(Conn::Table, async |c| {
                    let tx = c.transaction().await?;
                    let row = tx
                        .query_one(
                            "SELECT n.term, n.epoch,
                                    EXISTS (SELECT 1 FROM fief_leases l WHERE l.namespace = n.namespace
                                            AND l.node_id = n.leader_node AND l.lease_id = n.leader_lease
                                            AND l.expires_at > clock_timestamp())
                             FROM fief_namespaces n WHERE n.namespace = $1 FOR UPDATE",
                            &[&namespace],
                        )
                        .await?;
                    let (current_term, epoch, leader_alive): (i64, i64, bool) = (row.get(0), row.get(1), row.get(2));
                    if current_term as u64 != term.0 || !leader_alive {
                        return Ok(Err(ArbiterError::NotLeader(Some(Term(current_term as u64)))));
                    }
                    // A partition moves only once its owner's lease has expired.
                    let wanted: Vec<i32> = changes.iter().map(|(p, _)| p.0 as i32).collect();
                    let held = tx
                        .query(
                            "SELECT p.partition, p.node_id FROM fief_partitions p
                             JOIN fief_leases l ON l.namespace = p.namespace AND l.node_id = p.node_id
                             WHERE p.namespace = $1 AND p.partition = ANY($2) AND l.expires_at > clock_timestamp()",
                            &[&namespace, &wanted],
                        )
                        .await?;
                    let mut held_by = std::collections::HashMap::new();
                    for r in &held {
                        held_by.insert(r.get::<_, i32>(0), r.get::<_, String>(1));
                    }
                    let next = epoch + 1;
                    for (partition, node) in &changes {
                        let owner = held_by.get(&(partition.0 as i32));
                        if owner.is_some_and(|o| Some(o.as_str()) != node.as_ref().map(NodeId::as_str)) {
                            return Ok(Err(ArbiterError::Refused(format!(
                                "partition {partition} is owned by {} whose lease is still current",
                                owner.map(String::as_str).unwrap_or("?")
                            ))));
                        }
                    }
                    let (parts, nodes): (Vec<i32>, Vec<Option<&str>>) = changes
                        .iter()
                        .filter(|(p, _)| !held_by.contains_key(&(p.0 as i32)))
                        .map(|(p, n)| (p.0 as i32, n.as_ref().map(NodeId::as_str)))
                        .unzip();
                    // One statement for the whole change, however many partitions.
                    let n = tx
                        .execute(
                            "INSERT INTO fief_partitions (namespace, partition, node_id, token)
                             SELECT $1, c.partition, c.node_id, $4 FROM unnest($2::int[], $3::text[]) AS c(partition, node_id)
                             ON CONFLICT (namespace, partition) DO UPDATE SET node_id = EXCLUDED.node_id, token = EXCLUDED.token, handed_from = NULL
                             WHERE fief_partitions.node_id IS DISTINCT FROM EXCLUDED.node_id",
                            &[&namespace, &parts, &nodes, &next],
                        )
                        .await?;
                    let changed = n > 0;
                    if changed {
                        tx.execute("UPDATE fief_namespaces SET epoch = $2 WHERE namespace = $1", &[&namespace, &next])
                            .await?;
                    }
                    tx.commit().await?;
                    Ok(Ok(()))
                })
                .await?;
            outcome?;
            self.with(Conn::Table, async |c| {
                Self::read_table(c, namespace, partitions).await
            })
            .await?
            .map_err(ArbiterError::Refused)
        })
    }

    fn put_module<'a>(
        &'a self,
        namespace: &'a str,
        module: NewModuleVersion,
    ) -> ArbiterFuture<'a, ModuleVersionRecord> {
        Box::pin(async move {
            let options = serde_json::to_string(&module.options)
                .map_err(|e| ArbiterError::Refused(format!("module options: {e}")))?;
            self.with(Conn::Table, async |c| {
                let tx = c.transaction().await?;
                // Lock the name's row (creating it), so two deploys of one
                // name are numbered one after the other.
                tx.execute(
                    "INSERT INTO fief_modules (namespace, name, last_version) VALUES ($1, $2, 0)
                     ON CONFLICT DO NOTHING",
                    &[&namespace, &module.name],
                )
                .await?;
                let current = tx
                    .query_opt(
                        "SELECT v.version, v.content_hash, v.size_bytes, v.options, v.deployed_by, v.deployed_at
                         FROM fief_modules m JOIN fief_module_versions v
                           ON v.namespace = m.namespace AND v.name = m.name AND v.version = m.current_version
                         WHERE m.namespace = $1 AND m.name = $2 FOR UPDATE OF m",
                        &[&namespace, &module.name],
                    )
                    .await?
                    .map(|row| version_record(&row, 0));
                if let Some(record) = current
                    && record.content_hash == module.content_hash
                    && record.options == module.options
                {
                    tx.commit().await?;
                    return Ok(record);
                }
                let version: i64 = tx
                    .query_one(
                        "UPDATE fief_modules SET last_version = last_version + 1
                         WHERE namespace = $1 AND name = $2 RETURNING last_version",
                        &[&namespace, &module.name],
                    )
                    .await?
                    .get(0);
                let row = tx
                    .query_one(
                        "INSERT INTO fief_module_versions
                            (namespace, name, version, content_hash, size_bytes, options, deployed_by, bytes)
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                         RETURNING version, content_hash, size_bytes, options, deployed_by, deployed_at",
                        &[
                            &namespace,
                            &module.name,
                            &version,
                            &module.content_hash,
                            &(module.bytes.len() as i64),
                            &options,
                            &module.deployed_by,
                            &&module.bytes[..],
                        ],
                    )
                    .await?;
                tx.execute(
                    "UPDATE fief_modules SET current_version = $3 WHERE namespace = $1 AND name = $2",
                    &[&namespace, &module.name, &version],
                )
                .await?;
                tx.commit().await?;
                Ok(version_record(&row, 0))
            })
            .await
        })
    }

    fn modules<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<StoredModule>> {
        Box::pin(async move {
            self.with(Conn::Table, async |c| {
                Self::read_modules(c, namespace).await
            })
            .await
        })
    }

    fn module_bytes<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, Option<bytes::Bytes>> {
        Box::pin(async move {
            let row = self
                .with(Conn::Table, async |c| {
                    c.query_opt(
                        "SELECT v.bytes FROM fief_module_versions v JOIN fief_modules m USING (namespace, name)
                         WHERE v.namespace = $1 AND v.name = $2 AND v.version = $3
                         AND m.current_version IS NOT NULL",
                        &[&namespace, &name, &(version as i64)],
                    )
                    .await
                })
                .await?;
            Ok(row.map(|row| bytes::Bytes::from(row.get::<_, Vec<u8>>(0))))
        })
    }

    fn set_current_module<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, StoredModule> {
        Box::pin(async move {
            let updated = self
                .with(Conn::Table, async |c| {
                    c.execute(
                        "UPDATE fief_modules m SET current_version = $3
                         WHERE m.namespace = $1 AND m.name = $2 AND m.current_version IS NOT NULL
                         AND EXISTS (SELECT 1 FROM fief_module_versions v WHERE v.namespace = $1
                                     AND v.name = $2 AND v.version = $3)",
                        &[&namespace, &name, &(version as i64)],
                    )
                    .await
                })
                .await?;
            let modules = self
                .with(Conn::Table, async |c| {
                    Self::read_modules(c, namespace).await
                })
                .await?;
            let module = modules.into_iter().find(|m| m.name == name);
            match (updated, module) {
                (1, Some(module)) => Ok(module),
                (_, None) => Err(ArbiterError::Refused(format!(
                    "no module named {name:?} is deployed"
                ))),
                (_, Some(module)) => {
                    let known: Vec<String> = module
                        .versions
                        .iter()
                        .map(|v| v.version.to_string())
                        .collect();
                    Err(ArbiterError::Refused(format!(
                        "module {name:?} has no version {version} (stored versions: {})",
                        known.join(", ")
                    )))
                }
            }
        })
    }

    fn remove_module<'a>(&'a self, namespace: &'a str, name: &'a str) -> ArbiterFuture<'a, bool> {
        Box::pin(async move {
            self.with(Conn::Table, async |c| {
                let tx = c.transaction().await?;
                let removed = tx
                    .execute(
                        "UPDATE fief_modules SET current_version = NULL
                         WHERE namespace = $1 AND name = $2 AND current_version IS NOT NULL",
                        &[&namespace, &name],
                    )
                    .await?;
                tx.execute(
                    "DELETE FROM fief_module_versions WHERE namespace = $1 AND name = $2",
                    &[&namespace, &name],
                )
                .await?;
                tx.commit().await?;
                Ok(removed == 1)
            })
            .await
        })
    }
}
