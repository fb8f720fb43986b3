//! The simulated durable store, and the key processes' side of it.
//!
//! [`Store`] keeps what a backend of `fief::storage` keeps, reduced to what
//! the checker needs: one fence token per partition, one committed value
//! per key (a counter, and the commit that wrote it), and the list of the
//! commits it acknowledged (landed). It judges every load and commit by the
//! core's rule, [`storage_fence`] — the very code the node's backends run —
//! one request a round, in the order the requests reach it; under
//! [`Mutation::StoreSkipsFence`](super::Mutation::StoreSkipsFence) it lands every commit, stale or not.
//!
//! The processes' side, as the node's key layer does it: a process loads its
//! key when it starts, under the ownership token its node's table holds the
//! key's partition by (raising the partition's fence token); each message it
//! processes commits an increment of its counter under that token (made
//! before the load answered, they are committed together once it does). A
//! survivor of a fence keeps committing from limbo every 20–500 ms until it
//! is reaped: a stale owner, its node fenced and its lease lost. The node
//! refuses a survivor's commit locally before it reaches the store
//! (`KeyStorage::commit`); the simulation sends it on, so the store's fence
//! is all that stands between it and the key's state — which is what is
//! judged. (The trace shows loads and refused commits; a landed commit is
//! not logged, it would cost the sweep a fifth of its time.) Requests and
//! answers travel over each node's ordered link
//! (`World::send_store`); a request already sent lands even if its node
//! crashes or fences meanwhile. Commits are not answered (a simulated process
//! does nothing with the answer: the node would end a process whose commit
//! was refused), and a process whose load was refused never commits.
//!
//! Every load and commit, with what the store did with it, is told to the
//! checker, which judges them from its own record (no stale commit landed
//! after a newer owner loaded; every load sees every commit acknowledged
//! before it). This file must not decide the fence rule (the core does) nor
//! anything about ownership (the token is the node's table's).

use std::collections::BTreeMap;

use super::node::{Life, SimNode};
use super::world::{Ev, World, node_name};
use crate::storage_fence;

/// How often a survivor in limbo writes, µs.
const SURVIVOR_WRITES_US: std::ops::Range<u64> = 20_000..500_000;

/// A key's committed value: its counter, and the commit that wrote it (0:
/// none yet).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Value {
    pub(super) count: u64,
    pub(super) commit: u64,
}

/// One commit: a key's counter, written under its process's token.
#[derive(Clone, Debug)]
pub(super) struct Commit {
    /// Names the commit (unique in the run, from 1).
    pub(super) id: u64,
    /// The process that made it.
    pub(super) life: u64,
    pub(super) key: String,
    pub(super) partition: u32,
    pub(super) token: u64,
    /// The commit the process's copy was at when it made this one (0:
    /// none): the value it increments.
    pub(super) parent: u64,
    /// The counter it writes.
    pub(super) count: u64,
}

/// A node's request to the store.
#[derive(Clone, Debug)]
pub(super) enum Request {
    /// Process `life` (of the node's incarnation `inc`) loads `key` of
    /// `partition` under `token`.
    Load {
        inc: u64,
        life: u64,
        key: String,
        partition: u32,
        token: u64,
    },
    Commit(Commit),
}

/// The simulated durable store.
#[derive(Debug)]
pub(super) struct Store {
    /// Per partition, its fence token (absent: 0).
    fences: BTreeMap<u32, u64>,
    /// Per key, its committed value (absent: none committed).
    values: BTreeMap<String, Value>,
    /// The commits it acknowledged, in order.
    acked: Vec<Commit>,
    /// [`Mutation::StoreSkipsFence`](super::Mutation::StoreSkipsFence).
    skip_fence: bool,
    /// The last commit id given.
    next_commit: u64,
}

impl Store {
    /// An empty store (`skip_fence`: the mutation).
    pub(super) fn new(skip_fence: bool) -> Self {
        Store {
            fences: BTreeMap::new(),
            values: BTreeMap::new(),
            acked: Vec::new(),
            skip_fence,
            next_commit: 0,
        }
    }

    /// Load `key` of `partition` under `token`: its value (raising the
    /// partition's fence token to `token`), or the fence token that
    /// refuses it as stale.
    pub(super) fn load(&mut self, key: &str, partition: u32, token: u64) -> Result<Value, u64> {
        let d = storage_fence::decide(std::iter::empty(), [(partition, token)], &self.fences);
        if let Some(current) = d.loads[0] {
            return Err(current);
        }
        self.fences.extend(d.raised);
        Ok(self.values.get(key).copied().unwrap_or_default())
    }

    /// Apply `commit` if it lands: its acknowledgement, the last of the
    /// list; or refuse it with the partition's fence token.
    pub(super) fn commit(&mut self, commit: Commit) -> Result<&Commit, Commit> {
        let d = storage_fence::decide(
            [(commit.partition, commit.token)],
            std::iter::empty(),
            &self.fences,
        );
        if d.commits[0].is_some() && !self.skip_fence {
            return Err(commit);
        }
        let value = Value {
            count: commit.count,
            commit: commit.id,
        };
        match self.values.get_mut(&commit.key) {
            Some(v) => *v = value,
            None => {
                self.values.insert(commit.key.clone(), value);
            }
        }
        self.acked.push(commit);
        Ok(self.acked.last().expect("just pushed"))
    }

    fn fresh_commit(&mut self) -> u64 {
        self.next_commit += 1;
        self.next_commit
    }
}

/// What a process knows of its key's stored state.
#[derive(Clone, Copy, Debug)]
pub(super) struct Stored {
    /// The key's partition, and the token its node's table held it by when
    /// the process started.
    pub(super) partition: u32,
    pub(super) token: u64,
    /// Its copy of the key's value: as loaded, then as it committed (`None`:
    /// the load has not answered, or was refused).
    pub(super) copy: Option<Value>,
    /// Increments made before the load answered.
    pending: u64,
}

/// Process `life` of `key` on `node`, live or a survivor in limbo.
fn life_mut<'a>(node: &'a mut SimNode, key: &str, life: u64) -> Option<&'a mut Life> {
    if node.keys.get(key).is_some_and(|l| l.id == life) {
        return node.keys.get_mut(key);
    }
    node.limbo.get_mut(key).filter(|l| l.id == life)
}

impl World {
    /// What a process of `key` starting on node `i` stores under: its
    /// partition and the token the node's table holds it by (0 if the
    /// table does not give it to the node: a mutation served it anyway).
    pub(super) fn stored_for(&self, i: usize, key: &str) -> Stored {
        let p = self.partitions.of(key);
        let node = &self.nodes[i];
        let token = node
            .membership
            .table()
            .owner(p)
            .filter(|a| a.node == node.id)
            .map_or(0, |a| a.token.0);
        Stored {
            partition: p.0,
            token,
            copy: None,
            pending: 0,
        }
    }

    /// Process `life` of `key` on node `i` started: it loads its key.
    pub(super) fn load(&mut self, i: usize, key: &str, life: u64) {
        let Some(l) = life_mut(&mut self.nodes[i], key, life) else {
            return;
        };
        let (partition, token) = (l.stored.partition, l.stored.token);
        let req = Request::Load {
            inc: self.nodes[i].incarnation,
            life,
            key: key.to_owned(),
            partition,
            token,
        };
        self.send_store(i, true, Ev::ToStore { node: i, req });
    }

    /// Process `life` of `key` on node `i` increments its counter: it
    /// commits (or, before its load answered, will).
    pub(super) fn write(&mut self, i: usize, key: &str, life: u64) {
        if let Some(l) = life_mut(&mut self.nodes[i], key, life) {
            l.stored.pending += 1;
        }
        self.commit_pending(i, key, life);
    }

    /// Commit what process `life` of `key` wrote and has not committed, if
    /// its load answered.
    fn commit_pending(&mut self, i: usize, key: &str, life: u64) {
        let Some(l) = life_mut(&mut self.nodes[i], key, life) else {
            return;
        };
        let s = &mut l.stored;
        let (Some(copy), n) = (s.copy, s.pending) else {
            return;
        };
        if n == 0 {
            return;
        }
        let (partition, token) = (s.partition, s.token);
        s.pending = 0;
        let id = self.store.fresh_commit();
        let count = copy.count + n;
        let l = life_mut(&mut self.nodes[i], key, life).expect("found above");
        l.stored.copy = Some(Value { count, commit: id });
        let commit = Commit {
            id,
            life,
            key: key.to_owned(),
            partition,
            token,
            parent: copy.commit,
            count,
        };
        let req = Request::Commit(commit);
        self.send_store(i, true, Ev::ToStore { node: i, req });
    }

    /// The store's answer to process `life`'s load of `key` reached node
    /// `i`: the process takes the value and commits what it wrote
    /// meanwhile (if it still runs).
    pub(super) fn loaded(&mut self, i: usize, key: &str, life: u64, loaded: Result<Value, u64>) {
        let Some(l) = life_mut(&mut self.nodes[i], key, life) else {
            return;
        };
        if let Ok(value) = loaded {
            l.stored.copy = Some(value);
            self.commit_pending(i, key, life);
        }
    }

    /// Survivor `life` of `key` went to node `i`'s limbo: it will write.
    pub(super) fn survivor_writes_later(&mut self, i: usize, key: &str, life: u64) {
        let inc = self.nodes[i].incarnation;
        let delay = self.store_rng.u64(SURVIVOR_WRITES_US);
        let key = key.to_owned();
        self.after(
            delay,
            Ev::SurvivorWrites {
                node: i,
                inc,
                key,
                life,
            },
        );
    }

    /// Survivor `life` of `key` writes, if it is still in node `i`'s limbo,
    /// and will again.
    pub(super) fn survivor_writes(&mut self, i: usize, key: &str, life: u64) {
        if self.nodes[i].limbo.get(key).is_none_or(|l| l.id != life) {
            return;
        }
        self.log(|| format!("{}: survivor {life} of {key} writes", node_name(i)));
        self.write(i, key, life);
        self.survivor_writes_later(i, key, life);
    }

    /// The store serves node `i`'s request, tells the checker, and answers
    /// a load over the node's link.
    pub(super) fn store_request(&mut self, i: usize, req: Request) {
        let node = self.nodes[i].id.clone();
        match req {
            Request::Load {
                inc,
                life,
                key,
                partition,
                token,
            } => {
                let loaded = self.store.load(&key, partition, token);
                self.checker
                    .store_loaded(self.now, &node, &key, partition, token, loaded);
                self.log(|| {
                    format!("store: {node} process {life} loads {key} of p{partition} under token {token}: {loaded:?}")
                });
                let answer = Ev::FromStore {
                    node: i,
                    inc,
                    key,
                    life,
                    loaded,
                };
                self.send_store(i, false, answer);
            }
            Request::Commit(commit) => match self.store.commit(commit) {
                Ok(acked) => self.checker.store_committed(self.now, &node, acked, true),
                Err(refused) => {
                    self.checker
                        .store_committed(self.now, &node, &refused, false);
                    let Commit {
                        id,
                        life,
                        key,
                        partition,
                        token,
                        ..
                    } = refused;
                    self.log(|| {
                        format!("store: {node} process {life}'s commit {id} of {key} under token {token} to p{partition} refused")
                    });
                }
            },
        }
    }
}
