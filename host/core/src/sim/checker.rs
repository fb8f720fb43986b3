//! The simulation's checker: single ownership judged on the global clock.
//!
//! The checker keeps its own record of what the arbiter committed (lease
//! grants and renewals, releases, table changes) and of every key life and
//! message processed, and judges each against contract §1–§3 with the
//! contract's TTL — not with the arbiter's own (possibly mutated) judgement:
//!
//! - **two live `terminate` processes for one key**: when a process of a key
//!   starts (or a node resumes from a pause), no other node may hold a live
//!   `terminate` process of that key that can still act (its node is up, not
//!   paused, and its lease is current on its own clock — the side-effect
//!   gate's test); and no process of it may be running on the same node (an
//!   idle one still in its `terminate(idle)` included: `lives`);
//! - **a message processed by two owners**;
//! - **a fenced node processing anything**: a node processes a message only
//!   while its own lease is current *and* its lease at the arbiter is current
//!   (`committed + ttl` on the arbiter's clock, which is the global clock);
//! - **a partition moved before the arbiter judged the old lease expired**:
//!   every table change that takes a partition from a node does so by that
//!   node's own handoff, or after its lease expired or was released;
//! - a node hosting a limbo survivor and a fresh process of one key;
//! - **handoff states**: a key's process starts from the newest state the
//!   key was handed off with, unless that was legitimately lost (its
//!   holder crashed or fenced), and never from an older one; a partition
//!   is never handed on without a state its owner holds for it (`lives`);
//! - **durable state** (told of every load and commit the store served,
//!   and what it did): a commit under a token lower than one a served load
//!   of its partition had already raised the partition to never lands
//!   (a stale commit applied), and every served load — a new owner's first
//!   among them — reads a value whose commit history holds every commit
//!   the store acknowledged before it (an acknowledged commit lost). The
//!   history is the checker's own, from each landed commit's parent (the
//!   commit the process's copy was at), not the store's;
//! - **liveness**: once the faults are over (the last one ended at least
//!   [`SETTLE`] before the window) and some node can take partitions, every
//!   key sent a message in the final [`WINDOW`] of the run gets one
//!   processed in it, and every partition is owned by a live node at some
//!   probe of the window.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

use crate::arbiter::LeaseId;
use crate::ownership::{NodeId, OwnershipTable, OwnershipToken};
use crate::partition::PartitionId;

use super::lives::Lives;
use super::show_us;
use super::store::{Commit, Value};

/// How long after the last fault ended the liveness window may begin.
pub const SETTLE: Duration = Duration::from_secs(4);

/// The liveness window: the last this much of the run.
pub const WINDOW: Duration = Duration::from_secs(2);

/// Which rule a violation breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Two live `terminate` processes of one key that can act.
    TwoLiveProcesses,
    /// A message processed by two owners.
    TwoOwners,
    /// A node processing while fenced (by its own lease or the arbiter's).
    FencedProcessing,
    /// A partition moved before the arbiter judged the old lease expired.
    EarlyMove,
    /// A key started beside a survivor of it in the node's limbo.
    BesideSurvivor,
    /// A key's process started from another state than its newest
    /// handed-off one still held (an older one, or none while one was
    /// held), or a partition was handed on without a state held for it.
    HandoffState,
    /// After the faults, a key or a partition not served.
    Liveness,
    /// A commit landed under a token lower than one a served load of its
    /// partition had raised it to.
    StaleCommitApplied,
    /// A load read a value that misses a commit acknowledged before it.
    AcknowledgedCommitLost,
}

/// One breach of single ownership, with the instant it happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Global time, microseconds.
    pub at_us: u64,
    /// The rule broken.
    pub rule: Rule,
    /// What went wrong, naming nodes, keys and leases.
    pub what: String,
}

/// The arbiter's committed view of one lease, as the checker records it.
#[derive(Clone, Copy, Debug)]
struct LeaseRecord {
    committed_us: u64,
    released: bool,
}

/// What the liveness window saw, once it began.
#[derive(Debug, Default)]
struct Window {
    from_us: u64,
    /// Keys sent a message (at a node that has not left) in the window.
    asked: BTreeSet<String>,
    /// Keys with a message processed in the window.
    served: BTreeSet<String>,
    /// Per partition, the first probe that found no live node owning it.
    unowned: BTreeMap<PartitionId, u64>,
}

/// The checker's history.
#[derive(Debug)]
pub struct Checker {
    ttl_us: u64,
    leases: HashMap<(NodeId, LeaseId), LeaseRecord>,
    /// message id → the node that processed it first.
    processed_by: HashMap<u64, NodeId>,
    window: Option<Window>,
    /// Key processes and handoff states.
    lives: Lives,
    /// Loads and commits, as the store served them.
    stored: StoreRecord,
    /// Violations found so far.
    pub violations: Vec<Violation>,
    /// Counters for the run's summary.
    pub stats: Stats,
}

/// What a run did, for the summary and the soak's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Messages processed by an owner.
    pub processed: u64,
    /// Key processes started.
    pub lives: u64,
    /// Fences.
    pub fences: u64,
    /// Table changes that moved a partition to a new owner.
    pub moves: u64,
    /// Graceful handoffs committed.
    pub handoffs: u64,
    /// Leases granted.
    pub leases: u64,
    /// Runs whose liveness window was judged.
    pub windows: u64,
    /// Forwarded messages routed once more after their receiver said it
    /// was not the owner and a table refresh found a newer table.
    pub retries: u64,
    /// Keys stopped for a handoff with a state.
    pub states: u64,
    /// Processes started from a handed-off state.
    pub claimed: u64,
    /// Messages that arrived while their key's idle process retired, and
    /// waited for its end.
    pub waited: u64,
    /// Loads the store served.
    pub loads: u64,
    /// Loads the store refused as stale.
    pub stale_loads: u64,
    /// Commits the store acknowledged.
    pub commits: u64,
    /// Commits the store refused as stale.
    pub stale_commits: u64,
}

impl Stats {
    /// Add another run's counts.
    pub fn add(&mut self, other: &Stats) {
        self.processed += other.processed;
        self.lives += other.lives;
        self.fences += other.fences;
        self.moves += other.moves;
        self.handoffs += other.handoffs;
        self.leases += other.leases;
        self.retries += other.retries;
        self.windows += other.windows;
        self.states += other.states;
        self.claimed += other.claimed;
        self.waited += other.waited;
        self.loads += other.loads;
        self.stale_loads += other.stale_loads;
        self.commits += other.commits;
        self.stale_commits += other.stale_commits;
    }
}

/// A commit that landed, as the checker records it.
#[derive(Clone, Copy, Debug)]
struct Landed {
    parent: u64,
    token: u64,
    at_us: u64,
}

/// One key's landed commits.
#[derive(Debug, Default)]
struct KeyHistory {
    /// The last commit that landed (0: none).
    head: u64,
    /// Every landed (acknowledged) commit, in order.
    acked: Vec<u64>,
    /// The acknowledged commits `head` does not descend from.
    lost: BTreeSet<u64>,
    /// The highest token a load of the key was served under.
    loaded: u64,
}

/// The checker's record of durable state: what the store served.
#[derive(Debug, Default)]
struct StoreRecord {
    /// Per partition, the highest token a served load raised it to.
    raised: HashMap<u32, u64>,
    /// Every landed commit, by id (ids are dense: the store numbers them).
    landed: Vec<Option<Landed>>,
    keys: HashMap<String, KeyHistory>,
}

impl StoreRecord {
    fn landed(&self, id: u64) -> Option<Landed> {
        self.landed.get(id as usize).copied().flatten()
    }

    /// `head` and every commit it descends from.
    fn lineage(&self, head: u64) -> HashSet<u64> {
        let mut out = HashSet::new();
        let mut at = head;
        while at != 0 && out.insert(at) {
            at = self.landed(at).map_or(0, |l| l.parent);
        }
        out
    }
}

/// How a partition's owner changed at the arbiter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableWrite {
    /// The leader's write (orphans).
    Leader,
    /// The owner's own graceful handoff.
    Transfer,
    /// A node registered a new lease; its old partitions went back.
    Register,
}

impl Checker {
    /// A checker for leases of `ttl` (the contract's, not the arbiter's).
    pub fn new(ttl: Duration) -> Self {
        Checker {
            ttl_us: ttl.as_micros() as u64,
            leases: HashMap::new(),
            processed_by: HashMap::new(),
            window: None,
            lives: Lives::default(),
            stored: StoreRecord::default(),
            violations: Vec::new(),
            stats: Stats::default(),
        }
    }

    fn fail(&mut self, at_us: u64, rule: Rule, what: String) {
        self.violations.push(Violation { at_us, rule, what });
    }

    fn fail_all(&mut self, at_us: u64, breaches: Vec<(Rule, String)>) {
        for (rule, what) in breaches {
            self.fail(at_us, rule, what);
        }
    }

    /// The arbiter committed a registration or renewal of `lease` at `at_us`.
    pub fn lease_committed(&mut self, at_us: u64, node: &NodeId, lease: LeaseId, new: bool) {
        if new {
            self.stats.leases += 1;
        }
        let r = self
            .leases
            .entry((node.clone(), lease))
            .or_insert(LeaseRecord {
                committed_us: at_us,
                released: false,
            });
        r.committed_us = r.committed_us.max(at_us);
    }

    /// The arbiter released `lease` at `at_us`.
    pub fn lease_released(&mut self, node: &NodeId, lease: LeaseId) {
        if let Some(r) = self.leases.get_mut(&(node.clone(), lease)) {
            r.released = true;
        }
    }

    /// Whether `node` holds some lease the arbiter must still count as
    /// current at `at_us` (by the contract's TTL).
    pub fn node_lease_current(&self, node: &NodeId, at_us: u64) -> bool {
        self.leases
            .iter()
            .any(|((n, _), r)| n == node && !r.released && at_us < r.committed_us + self.ttl_us)
    }

    /// Whether `lease` is current at the arbiter at `at_us`.
    pub fn lease_current(&self, node: &NodeId, lease: LeaseId, at_us: u64) -> bool {
        self.leases
            .get(&(node.clone(), lease))
            .is_some_and(|r| !r.released && at_us < r.committed_us + self.ttl_us)
    }

    /// The arbiter's table changed from `old` to `new` at `at_us` by `how`
    /// (by `by`, for a transfer).
    pub fn table_changed(
        &mut self,
        at_us: u64,
        old: &OwnershipTable,
        new: &OwnershipTable,
        how: TableWrite,
        by: Option<&NodeId>,
    ) {
        for (partition, before) in old.iter() {
            let after = new.owner(partition);
            let Some(before) = before else { continue };
            if after.is_some_and(|a| a.node == before.node) {
                continue;
            }
            if after.is_some() {
                self.stats.moves += 1;
            }
            let handed_off = how == TableWrite::Transfer && by == Some(&before.node);
            if handed_off {
                self.stats.handoffs += 1;
                continue;
            }
            if self.node_lease_current(&before.node, at_us) && how != TableWrite::Register {
                let to = after.map_or("nobody".to_owned(), |a| a.node.to_string());
                self.fail(
                    at_us,
                    Rule::EarlyMove,
                    format!(
                        "{partition} moved from {} to {to} ({how:?}) while {}'s lease was still current at the arbiter",
                        before.node, before.node
                    ),
                );
            }
        }
        let breaches = self.lives.table_changed(new, how == TableWrite::Transfer);
        self.fail_all(at_us, breaches);
    }

    /// `node` processed message `msg` for `key` at `at_us` under `lease`;
    /// `own_lease_current` is the node's own view at that instant.
    pub fn processed(
        &mut self,
        at_us: u64,
        node: &NodeId,
        lease: Option<LeaseId>,
        own_lease_current: bool,
        msg: u64,
        key: &str,
    ) {
        self.stats.processed += 1;
        if let Some(w) = &mut self.window {
            w.served.insert(key.to_owned());
        }
        if !own_lease_current {
            self.fail(
                at_us,
                Rule::FencedProcessing,
                format!("{node} processed message {msg} for {key} while fenced"),
            );
        }
        if !lease.is_some_and(|l| self.lease_current(node, l, at_us)) {
            self.fail(
                at_us,
                Rule::FencedProcessing,
                format!(
                    "{node} processed message {msg} for {key} while its lease {lease:?} was not current at the arbiter"
                ),
            );
        }
        match self.processed_by.get(&msg) {
            Some(first) if first != node => {
                let first = first.clone();
                self.fail(
                    at_us,
                    Rule::TwoOwners,
                    format!("message {msg} for {key} processed by two owners: {first} and {node}"),
                );
            }
            Some(_) => {}
            None => {
                self.processed_by.insert(msg, node.clone());
            }
        }
    }

    /// Process `life` of `key` started on `node` at `at_us`, from the
    /// handed-off state `from` (`None`: fresh). `others` lists the other
    /// nodes holding a live `terminate` process of the key that can still
    /// act.
    pub fn life_started(
        &mut self,
        at_us: u64,
        node: &NodeId,
        key: &str,
        life: u64,
        others: &[NodeId],
        from: Option<u64>,
    ) {
        self.stats.lives += 1;
        if from.is_some() {
            self.stats.claimed += 1;
        }
        if !others.is_empty() {
            self.fail(
                at_us,
                Rule::TwoLiveProcesses,
                format!(
                    "{key} started on {node} while {} still held a live terminate process of it",
                    others
                        .iter()
                        .map(NodeId::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
        }
        let breaches = self.lives.started(node, key, life);
        self.fail_all(at_us, breaches);
        if let Some((rule, what)) = self.lives.claimed(node, key, from) {
            self.fail(at_us, rule, what);
        }
    }

    /// Process `life` ended: killed, stopped, its idle retirement over, or
    /// reaped from limbo.
    pub fn life_ended(&mut self, life: u64) {
        self.lives.ended(life);
    }

    /// Process `life` survived a fence, in its node's limbo.
    pub fn survived(&mut self, life: u64) {
        self.lives.survived(life);
    }

    /// `node` crashed: its processes and handoff states are gone.
    pub fn crashed(&mut self, node: &NodeId) {
        self.lives.crashed(node);
    }

    /// `node` fenced: it drops every handoff state it holds.
    pub fn fenced(&mut self, node: &NodeId) {
        self.stats.fences += 1;
        self.lives.fenced(node);
    }

    /// `node` stopped `key` of `partition` for a handoff, with `state`.
    pub fn handed_off(&mut self, node: &NodeId, key: &str, partition: PartitionId, state: u64) {
        self.stats.states += 1;
        self.lives.handed_off(node, key, partition, state);
    }

    /// `node` received a handoff's states: (key, the token it was sent
    /// under, state).
    pub fn received<'a>(
        &mut self,
        node: &NodeId,
        states: impl IntoIterator<Item = (&'a str, OwnershipToken, u64)>,
    ) {
        self.lives.received(node, states);
    }

    /// The store served (`Ok`: the key's value) or refused (`Err`: the
    /// fence token) `node`'s load of `key` of `partition` under `token`
    /// at `at_us`.
    pub(super) fn store_loaded(
        &mut self,
        at_us: u64,
        node: &NodeId,
        key: &str,
        partition: u32,
        token: u64,
        loaded: Result<Value, u64>,
    ) {
        let Ok(value) = loaded else {
            self.stats.stale_loads += 1;
            return;
        };
        self.stats.loads += 1;
        let raised = self.stored.raised.entry(partition).or_default();
        *raised = (*raised).max(token);
        let history = self.stored.keys.entry(key.to_owned()).or_default();
        let first = token > history.loaded;
        history.loaded = history.loaded.max(token);
        let missed: Vec<u64> = if value.commit == history.head {
            history.lost.iter().copied().collect()
        } else {
            let acked = history.acked.clone();
            let lineage = self.stored.lineage(value.commit);
            acked.into_iter().filter(|c| !lineage.contains(c)).collect()
        };
        let Some(&lost) = missed.first() else {
            return;
        };
        let l = self
            .stored
            .landed(lost)
            .expect("an acknowledged commit landed");
        let whose = if first {
            "a new owner's first load"
        } else {
            "a load"
        };
        self.fail(
            at_us,
            Rule::AcknowledgedCommitLost,
            format!(
                "{whose} of {key} (p{partition}) by {node} under token {token} read {} (commit {}), which misses commit {lost} (token {}, acknowledged at {}){}",
                value.count,
                value.commit,
                l.token,
                show_us(l.at_us),
                if missed.len() > 1 {
                    format!(" and {} more", missed.len() - 1)
                } else {
                    String::new()
                }
            ),
        );
    }

    /// The store served `node`'s `commit` at `at_us`: it landed
    /// (acknowledged) or was refused as stale.
    pub(super) fn store_committed(
        &mut self,
        at_us: u64,
        node: &NodeId,
        commit: &Commit,
        landed: bool,
    ) {
        if !landed {
            self.stats.stale_commits += 1;
            return;
        }
        self.stats.commits += 1;
        let raised = self
            .stored
            .raised
            .get(&commit.partition)
            .copied()
            .unwrap_or(0);
        if commit.token < raised {
            self.fail(
                at_us,
                Rule::StaleCommitApplied,
                format!(
                    "{node}'s commit {} of {} (process {}) under token {} landed on p{} after a load had raised it to token {raised}",
                    commit.id, commit.key, commit.life, commit.token, commit.partition
                ),
            );
        }
        let record = Landed {
            parent: commit.parent,
            token: commit.token,
            at_us,
        };
        let slot = commit.id as usize;
        if self.stored.landed.len() <= slot {
            self.stored.landed.resize(slot + 1, None);
        }
        self.stored.landed[slot] = Some(record);
        // A fork (the new head does not descend from the last one): the
        // acknowledged commits it does not descend from are lost.
        let lost = self
            .stored
            .keys
            .get(&commit.key)
            .filter(|h| h.head != commit.parent)
            .map(|h| {
                let lineage = self.stored.lineage(commit.id);
                h.acked
                    .iter()
                    .copied()
                    .filter(|c| !lineage.contains(c))
                    .collect()
            });
        if !self.stored.keys.contains_key(&commit.key) {
            let history = KeyHistory::default();
            self.stored.keys.insert(commit.key.clone(), history);
        }
        let history = self
            .stored
            .keys
            .get_mut(&commit.key)
            .expect("entered above");
        if let Some(lost) = lost {
            history.lost = lost;
        }
        history.head = commit.id;
        history.acked.push(commit.id);
    }

    /// A node resumed from a pause at `at_us` holding live `terminate`
    /// processes that can act, of keys that other nodes also run:
    /// `overlaps` lists (key, other node).
    pub fn resumed(&mut self, at_us: u64, node: &NodeId, overlaps: &BTreeMap<String, NodeId>) {
        for (key, other) in overlaps {
            self.fail(
                at_us,
                Rule::TwoLiveProcesses,
                format!("{node} resumed with a live terminate process of {key} that can act while {other} runs one"),
            );
        }
    }

    /// The liveness window begins at `at_us`: the faults are over and some
    /// node can take partitions.
    pub fn window_begins(&mut self, at_us: u64) {
        self.stats.windows += 1;
        self.window = Some(Window {
            from_us: at_us,
            ..Window::default()
        });
    }

    /// A message for `key` reached a node that has not left.
    pub fn asked(&mut self, key: &str) {
        if let Some(w) = &mut self.window {
            w.asked.insert(key.to_owned());
        }
    }

    /// A probe of the window at `at_us` found `partitions` owned by no
    /// live node.
    pub fn unowned(&mut self, at_us: u64, partitions: impl IntoIterator<Item = PartitionId>) {
        if let Some(w) = &mut self.window {
            for p in partitions {
                w.unowned.entry(p).or_insert(at_us);
            }
        }
    }

    /// The run ends at `at_us`: judge the window, if it began.
    pub fn window_ends(&mut self, at_us: u64) {
        let Some(w) = self.window.take() else {
            return;
        };
        let span = format!("{}..{}", show_us(w.from_us), show_us(at_us));
        for key in w.asked.difference(&w.served) {
            self.fail(
                at_us,
                Rule::Liveness,
                format!(
                    "{key} was sent messages in the final window ({span}) but none was processed"
                ),
            );
        }
        for (p, probe_us) in w.unowned {
            self.fail(
                at_us,
                Rule::Liveness,
                format!(
                    "{p} was owned by no live node at {}, in the final window ({span})",
                    show_us(probe_us)
                ),
            );
        }
    }
}
