//! The in-process arbiter: the embedded default for one node, and the shared
//! arbiter for several nodes in one process (tests, a one-machine demo).
//!
//! It judges lease expiry on its own [`Clock`] (a stepped clock in tests).
//! It can be told that a node cannot reach it, or that it is down for
//! everyone, which is how tests cut node ↔ arbiter links.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fief_core::arbiter::Refusal;
use fief_core::{
    ArbiterState, Clock, Instant, NodeId, OwnershipTable, PartitionCount, PartitionId,
};

use super::{
    Arbiter, ArbiterError, ArbiterFuture, LeaseId, Member, ModuleVersionRecord, NewModuleVersion,
    StoredModule, Term,
};
use crate::sync::lock;

struct Namespace {
    /// Leases, leader, term and table: `fief-core`'s sans-IO arbiter, the
    /// one the simulation checks.
    state: ArbiterState,
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
    /// Every namespace's tables are numbered after this epoch.
    numbered_after: u64,
    state: Arc<Mutex<State>>,
}

impl LocalArbiter {
    /// An arbiter judging time on `clock`, for namespaces of `partitions`.
    pub fn new(clock: Arc<dyn Clock>, partitions: PartitionCount) -> Self {
        LocalArbiter {
            clock,
            partitions,
            numbered_after: 0,
            state: Arc::new(Mutex::new(State::default())),
        }
    }

    /// Number every namespace's tables after `epoch`, so every ownership
    /// token this arbiter grants is above it. A node whose embedded arbiter
    /// starts afresh on a durable store passes the store's highest fence
    /// token: an earlier run may have granted tokens up to it (after a fence
    /// and rejoin, a restart), and a load under a lower token would be
    /// refused as stale forever.
    #[must_use]
    pub fn numbered_after(mut self, epoch: u64) -> Self {
        self.numbered_after = epoch;
        self
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
            let (partitions, after) = (self.partitions, self.numbered_after);
            state
                .namespaces
                .entry(namespace.to_owned())
                .or_insert_with(|| Namespace {
                    state: ArbiterState::numbered_after(partitions, after),
                    modules: BTreeMap::new(),
                });
            f(&mut state, now)
        };
        Box::pin(std::future::ready(result))
    }
}

/// The core's refusal as the trait's error.
fn refusal(r: Refusal) -> ArbiterError {
    match r {
        Refusal::LeaseExpired(lease) => ArbiterError::LeaseExpired(lease),
        Refusal::NotLeader(term) => ArbiterError::NotLeader(Some(term)),
        Refusal::Refused(why) => ArbiterError::Refused(why),
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
            ns(state, namespace)
                .state
                .register(now, &node2, id, ttl, peer_addr)
                .map_err(refusal)
        })
    }

    fn renew<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, u64> {
        let node2 = node.clone();
        self.with(namespace, Some(node), move |state, now| {
            ns(state, namespace)
                .state
                .renew(now, &node2, lease)
                .map_err(refusal)
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
            ns(state, namespace).state.release(&node2, lease);
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
            ns(state, namespace)
                .state
                .set_leaving(now, &node2, lease)
                .map_err(refusal)
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
            ns(state, namespace)
                .state
                .transfer(now, &from2, lease, moves)
                .map_err(refusal)
        })
    }

    fn live_nodes<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<Member>> {
        self.with(namespace, None, move |state, now| {
            Ok(ns(state, namespace).state.live_nodes(now))
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
            ns(state, namespace)
                .state
                .campaign(now, &node2, lease)
                .map_err(refusal)
        })
    }

    fn table<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, OwnershipTable> {
        self.with(namespace, None, move |state, _| {
            Ok(ns(state, namespace).state.table().clone())
        })
    }

    fn write_table<'a>(
        &'a self,
        namespace: &'a str,
        term: Term,
        changes: Vec<(PartitionId, Option<NodeId>)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        self.with(namespace, None, move |state, now| {
            ns(state, namespace)
                .state
                .write_table(now, term, changes)
                .map_err(refusal)
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
