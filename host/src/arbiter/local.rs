//! The in-process arbiter: the embedded default for one node, and the shared
//! arbiter for several nodes in one process (tests, a one-machine demo).
//!
//! It judges lease expiry on its own [`Clock`] (a stepped clock in tests).
//! It can be told that a node cannot reach it, or that it is down for
//! everyone, which is how tests cut node ↔ arbiter links.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fief_core::{Clock, Instant, NodeId, OwnershipTable, PartitionCount, PartitionId};

use super::{
    Arbiter, ArbiterError, ArbiterFuture, LeaseId, Member, ModuleVersionRecord, NewModuleVersion,
    StoredModule, Term,
};
use crate::key::lock;

struct LeaseRecord {
    id: LeaseId,
    peer_addr: Option<String>,
    leaving: bool,
    committed_at: Instant,
    ttl: Duration,
}

impl LeaseRecord {
    fn is_current(&self, now: Instant) -> bool {
        now < self.committed_at + self.ttl
    }
}

struct Namespace {
    leases: BTreeMap<NodeId, LeaseRecord>,
    table: OwnershipTable,
    leader: Option<(NodeId, LeaseId)>,
    term: u64,
    /// The module store: name → its versions.
    modules: BTreeMap<String, ModuleEntry>,
}

/// One module name in the store. `current` is `None` once undeployed; the
/// entry stays so its version numbers are never reused.
#[derive(Default)]
struct ModuleEntry {
    last_version: u64,
    current: Option<u64>,
    versions: BTreeMap<u64, (ModuleVersionRecord, bytes::Bytes)>,
}

impl ModuleEntry {
    fn stored(&self, name: &str) -> Option<StoredModule> {
        Some(StoredModule {
            name: name.to_owned(),
            current: self.current?,
            versions: self.versions.values().map(|(r, _)| r.clone()).collect(),
        })
    }
}

impl Namespace {
    fn lease_current(&self, node: &NodeId, lease: LeaseId, now: Instant) -> bool {
        self.leases
            .get(node)
            .is_some_and(|r| r.id == lease && r.is_current(now))
    }
}

#[derive(Default)]
struct State {
    namespaces: HashMap<String, Namespace>,
    unreachable: HashSet<NodeId>,
    down: bool,
    next_lease: u64,
}

/// The in-process arbiter. Cheap to clone; clones share state.
#[derive(Clone)]
pub struct LocalArbiter {
    clock: Arc<dyn Clock>,
    partitions: PartitionCount,
    state: Arc<Mutex<State>>,
}

impl LocalArbiter {
    /// An arbiter judging time on `clock`, for namespaces of `partitions`.
    pub fn new(clock: Arc<dyn Clock>, partitions: PartitionCount) -> Self {
        LocalArbiter {
            clock,
            partitions,
            state: Arc::new(Mutex::new(State::default())),
        }
    }

    /// Make `node` unable (or able again) to reach the arbiter.
    pub fn set_reachable(&self, node: &NodeId, reachable: bool) {
        let mut state = lock(&self.state);
        if reachable {
            state.unreachable.remove(node);
        } else {
            state.unreachable.insert(node.clone());
        }
    }

    /// Take the arbiter down for everyone, or bring it back.
    pub fn set_down(&self, down: bool) {
        lock(&self.state).down = down;
    }

    fn with<T: Send + 'static>(
        &self,
        namespace: &str,
        node: Option<&NodeId>,
        f: impl FnOnce(&mut State, Instant) -> Result<T, ArbiterError>,
    ) -> ArbiterFuture<'static, T> {
        let now = self.clock.now();
        let mut state = lock(&self.state);
        let result = if state.down {
            Err(ArbiterError::Unreachable("the arbiter is down".to_owned()))
        } else if node.is_some_and(|n| state.unreachable.contains(n)) {
            Err(ArbiterError::Unreachable(
                "this node is cut off from the arbiter".to_owned(),
            ))
        } else {
            let partitions = self.partitions;
            state
                .namespaces
                .entry(namespace.to_owned())
                .or_insert_with(|| Namespace {
                    leases: BTreeMap::new(),
                    table: OwnershipTable::new(partitions),
                    leader: None,
                    term: 0,
                    modules: BTreeMap::new(),
                });
            f(&mut state, now)
        };
        Box::pin(std::future::ready(result))
    }
}

fn ns<'a>(state: &'a mut State, namespace: &str) -> &'a mut Namespace {
    state
        .namespaces
        .get_mut(namespace)
        .expect("namespace created by LocalArbiter::with")
}

impl Arbiter for LocalArbiter {
    fn register<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        ttl: Duration,
        peer_addr: Option<&'a str>,
    ) -> ArbiterFuture<'a, LeaseId> {
        let node2 = node.clone();
        let peer_addr = peer_addr.map(str::to_owned);
        self.with(namespace, Some(node), move |state, now| {
            state.next_lease += 1;
            let id = LeaseId(state.next_lease);
            let ns = ns(state, namespace);
            if ns.leases.get(&node2).is_some_and(|r| r.is_current(now)) {
                return Err(ArbiterError::Refused(format!(
                    "node {node2} already holds a current lease; a node id must be unique in its namespace"
                )));
            }
            // A new lease owns nothing yet: partitions still listed under
            // this node's previous (dead) lease go back to the leader, who
            // gives them out anew with fresh tokens.
            let stale: Vec<_> = ns
                .table
                .iter()
                .filter(|(_, owner)| owner.is_some_and(|a| a.node == node2))
                .map(|(p, _)| (p, None))
                .collect();
            ns.table.reassign(stale);
            ns.leases.insert(
                node2,
                LeaseRecord {
                    id,
                    peer_addr,
                    leaving: false,
                    committed_at: now,
                    ttl,
                },
            );
            Ok(id)
        })
    }

    fn renew<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        let node2 = node.clone();
        self.with(namespace, Some(node), move |state, now| {
            let ns = ns(state, namespace);
            match ns.leases.get_mut(&node2) {
                Some(r) if r.id == lease && r.is_current(now) => {
                    r.committed_at = now;
                    Ok(())
                }
                _ => Err(ArbiterError::LeaseExpired(lease)),
            }
        })
    }

    fn release<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        let node2 = node.clone();
        self.with(namespace, Some(node), move |state, _| {
            let ns = ns(state, namespace);
            if ns.leases.get(&node2).is_some_and(|r| r.id == lease) {
                ns.leases.remove(&node2);
            }
            Ok(())
        })
    }

    fn set_leaving<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        let node2 = node.clone();
        self.with(namespace, Some(node), move |state, now| {
            let ns = ns(state, namespace);
            match ns.leases.get_mut(&node2) {
                Some(r) if r.id == lease && r.is_current(now) => {
                    r.leaving = true;
                    Ok(())
                }
                _ => Err(ArbiterError::LeaseExpired(lease)),
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
        let from2 = from.clone();
        self.with(namespace, Some(from), move |state, now| {
            let ns = ns(state, namespace);
            if !ns.lease_current(&from2, lease, now) {
                return Err(ArbiterError::LeaseExpired(lease));
            }
            for (partition, to) in &moves {
                if ns.table.owner(*partition).is_none_or(|a| a.node != from2) {
                    return Err(ArbiterError::Refused(format!(
                        "{from2} cannot hand off {partition}: it does not own it"
                    )));
                }
                if !ns.leases.get(to).is_some_and(|r| r.is_current(now)) {
                    return Err(ArbiterError::Refused(format!(
                        "cannot hand {partition} to {to}: it has no current lease"
                    )));
                }
            }
            ns.table
                .reassign(moves.into_iter().map(|(p, to)| (p, Some(to))));
            Ok(ns.table.clone())
        })
    }

    fn live_nodes<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<Member>> {
        self.with(namespace, None, move |state, now| {
            let ns = ns(state, namespace);
            let leader = ns.leader.clone();
            Ok(ns
                .leases
                .iter()
                .filter(|(_, r)| r.is_current(now))
                .map(|(node, r)| Member {
                    node: node.clone(),
                    peer_addr: r.peer_addr.clone(),
                    leaving: r.leaving,
                    leader: leader.as_ref() == Some(&(node.clone(), r.id)),
                    lease_remaining: (r.committed_at + r.ttl).saturating_duration_since(now),
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
        let node2 = node.clone();
        self.with(namespace, Some(node), move |state, now| {
            let ns = ns(state, namespace);
            if !ns.lease_current(&node2, lease, now) {
                return Err(ArbiterError::LeaseExpired(lease));
            }
            let leader_alive = ns
                .leader
                .as_ref()
                .is_some_and(|(n, l)| ns.lease_current(n, *l, now));
            match &ns.leader {
                Some((n, l)) if leader_alive && n == &node2 && *l == lease => {
                    Ok(Some(Term(ns.term)))
                }
                _ if leader_alive => Ok(None),
                _ => {
                    ns.term += 1;
                    ns.leader = Some((node2, lease));
                    Ok(Some(Term(ns.term)))
                }
            }
        })
    }

    fn table<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, OwnershipTable> {
        self.with(namespace, None, move |state, _| {
            Ok(ns(state, namespace).table.clone())
        })
    }

    fn write_table<'a>(
        &'a self,
        namespace: &'a str,
        term: Term,
        changes: Vec<(PartitionId, Option<NodeId>)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        self.with(namespace, None, move |state, now| {
            let ns = ns(state, namespace);
            let leader_ok = ns.term == term.0
                && ns
                    .leader
                    .as_ref()
                    .is_some_and(|(n, l)| ns.lease_current(n, *l, now));
            if !leader_ok {
                return Err(ArbiterError::NotLeader(Some(Term(ns.term))));
            }
            for (partition, _) in &changes {
                if let Some(owner) = ns.table.owner(*partition)
                    && ns
                        .leases
                        .get(&owner.node)
                        .is_some_and(|r| r.is_current(now))
                {
                    return Err(ArbiterError::Refused(format!(
                        "partition {partition} is owned by {} whose lease is still current",
                        owner.node
                    )));
                }
            }
            ns.table.reassign(changes);
            Ok(ns.table.clone())
        })
    }

    fn put_module<'a>(
        &'a self,
        namespace: &'a str,
        module: NewModuleVersion,
    ) -> ArbiterFuture<'a, ModuleVersionRecord> {
        self.with(namespace, None, move |state, _| {
            let entry = ns(state, namespace)
                .modules
                .entry(module.name.clone())
                .or_default();
            if let Some((record, _)) = entry.current.and_then(|c| entry.versions.get(&c))
                && record.content_hash == module.content_hash
                && record.options == module.options
            {
                return Ok(record.clone());
            }
            entry.last_version += 1;
            let record = ModuleVersionRecord {
                version: entry.last_version,
                content_hash: module.content_hash,
                size_bytes: module.bytes.len() as u64,
                options: module.options,
                deployed_by: module.deployed_by,
                deployed_at: std::time::SystemTime::now(),
            };
            entry
                .versions
                .insert(record.version, (record.clone(), module.bytes));
            entry.current = Some(record.version);
            Ok(record)
        })
    }

    fn modules<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<StoredModule>> {
        self.with(namespace, None, move |state, _| {
            Ok(ns(state, namespace)
                .modules
                .iter()
                .filter_map(|(name, entry)| entry.stored(name))
                .collect())
        })
    }

    fn module_bytes<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, Option<bytes::Bytes>> {
        self.with(namespace, None, move |state, _| {
            Ok(ns(state, namespace)
                .modules
                .get(name)
                .and_then(|e| e.versions.get(&version))
                .map(|(_, bytes)| bytes.clone()))
        })
    }

    fn set_current_module<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, StoredModule> {
        self.with(namespace, None, move |state, _| {
            let entry = ns(state, namespace)
                .modules
                .get_mut(name)
                .filter(|e| e.current.is_some())
                .ok_or_else(|| {
                    ArbiterError::Refused(format!("no module named {name:?} is deployed"))
                })?;
            if !entry.versions.contains_key(&version) {
                let known: Vec<String> = entry.versions.keys().map(u64::to_string).collect();
                return Err(ArbiterError::Refused(format!(
                    "module {name:?} has no version {version} (stored versions: {})",
                    known.join(", ")
                )));
            }
            entry.current = Some(version);
            Ok(entry.stored(name).expect("current was just set"))
        })
    }

    fn remove_module<'a>(&'a self, namespace: &'a str, name: &'a str) -> ArbiterFuture<'a, bool> {
        self.with(namespace, None, move |state, _| {
            Ok(match ns(state, namespace).modules.get_mut(name) {
                Some(entry) if entry.current.is_some() => {
                    entry.current = None;
                    entry.versions.clear();
                    true
                }
                _ => false,
            })
        })
    }
}
