//! One simulated node: its [`Membership`] (the real ownership protocol,
//! unchanged) and the executor that carries out its effects as the node's
//! I/O would — arbiter requests over the node's ordered link, peer messages
//! over the lossy network, the key processes' lives (each with its state: a
//! number each message processed replaces; started at a routed message from
//! the handoff state waiting for it, if any; stopped for a handoff, reaped
//! from limbo, killed when the table takes their partition, killed or sent
//! to limbo by a fence, retired when idle), and each message routed by
//! `Membership::route` and forwarded to the owner it names. The handoffs
//! themselves (their states' way from a stop to the next process) are
//! `handoff`'s; a process's loads and commits to the durable store are
//! `store`'s (a process loads when it starts and commits at each message;
//! a survivor writes on from limbo).
//!
//! An idle process retires as the node's key table retires one: its
//! `terminate(idle)` runs 0.1–50 ms, its entry stays (retiring) until it
//! ended, and a message arriving meanwhile waits for the end and then goes
//! to the next process (routed again: it may be refused by then).
//!
//! It must not decide anything about ownership: when to move, what to adopt,
//! what to refuse, when to fence or leave are the membership's. This file
//! only executes, with the delays a real executor has (a stop or a reap is
//! answered 0–5 ms later, by an event), and feeds every answer back.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::Mutation;
use super::handoff::States;
use super::store::Stored;
use super::timing;
use super::world::{Call, Ev, NodeClock, World, node_name};
use crate::coordinator::lost;
use crate::membership::{Effect, Membership, MembershipConfig, Mutations, OpId, PeerMessage};
use crate::ownership::{NodeId, Route};
use crate::partition::{PartitionCount, PartitionId};
use crate::time::Instant;

/// How long a leave may take.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a move's handoff or transfer may take (the node's call timeout).
const STEP_TIMEOUT: Duration = Duration::from_secs(1);

/// The longest an executor takes to stop keys for a handoff or to reap
/// survivors, µs.
pub(super) const EXECUTOR_DELAY_US: u64 = 5_000;

/// How long an idle process's `terminate(idle)` runs, µs.
const RETIRE_US: std::ops::Range<u64> = 100..50_000;

/// How a key module answers the fence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    Terminate,
    Continue,
    /// `handle-fence` answers continue (true) or stop (false).
    Callback(bool),
}

/// A key process, as the node's key table holds it.
#[derive(Debug)]
pub(super) struct Life {
    /// Names the process (unique in the run).
    pub(super) id: u64,
    pub(super) mode: Mode,
    /// Its state: the number its last message wrote, or the handoff state
    /// it started from (`None`: fresh, nothing processed yet).
    pub(super) state: Option<u64>,
    /// Retiring: when its `terminate(idle)` ends (global µs), and the
    /// messages that arrived meanwhile, waiting for its next process.
    pub(super) retiring: Option<(u64, Vec<u64>)>,
    /// Its durable state, as it knows it.
    pub(super) stored: Stored,
}

#[derive(Debug)]
pub(super) struct SimNode {
    pub(super) id: NodeId,
    pub(super) up: bool,
    pub(super) incarnation: u64,
    pub(super) paused_until: Option<u64>,
    pub(super) clock: NodeClock,
    pub(super) membership: Membership,
    /// The key table: live processes, by key.
    pub(super) keys: BTreeMap<String, Life>,
    /// Survivors of a fence, until reaped: their processes, by key.
    pub(super) limbo: BTreeMap<String, Life>,
    /// Handoff states: collected by moves, and waiting for their keys.
    pub(super) states: States,
    /// Forwarded messages their receiver did not serve, waiting for the
    /// table refresh they asked for: (message, key, the epoch routed on).
    retries: BTreeMap<OpId, (u64, String, u64)>,
    pub(super) wake_gen: u64,
    /// No tick before this global instant (µs): its coordination loop
    /// crashed and waits to be restarted.
    pub(super) ticks_held_until: u64,
    /// What reached the node while it was paused.
    pub(super) deferred: Vec<Ev>,
}

impl SimNode {
    /// A process that has not started (`up` once the world starts it).
    pub(super) fn new(
        id: NodeId,
        clock: NodeClock,
        incarnation: u64,
        cfg: &super::Config,
        partitions: PartitionCount,
    ) -> Self {
        let mut membership = Membership::new(MembershipConfig {
            me: id.clone(),
            timing: timing(),
            partitions,
            step_timeout: STEP_TIMEOUT,
        });
        match cfg.mutation {
            Some(Mutation::FenceAtTtl) => membership.mutate_fence_at_ttl(),
            Some(Mutation::DrainReleasedAtTransfer) => membership.mutate(Mutations {
                drain_released_at_transfer: true,
                ..Mutations::default()
            }),
            Some(Mutation::AdoptWithoutReap) => membership.mutate(Mutations {
                adopt_without_reap: true,
                ..Mutations::default()
            }),
            _ => {}
        }
        SimNode {
            id,
            up: false,
            incarnation,
            paused_until: None,
            clock,
            membership,
            keys: BTreeMap::new(),
            limbo: BTreeMap::new(),
            states: States::default(),
            retries: BTreeMap::new(),
            wake_gen: 0,
            ticks_held_until: 0,
            deferred: Vec::new(),
        }
    }
}

/// The keys of `map` whose partition (of `p`) is one of `partitions`.
pub(super) fn keys_in<V>(
    map: &BTreeMap<String, V>,
    p: PartitionCount,
    partitions: &BTreeSet<PartitionId>,
) -> Vec<String> {
    map.keys()
        .filter(|k| partitions.contains(&p.of(k)))
        .cloned()
        .collect()
}

impl World {
    /// Give node `i`'s membership one input at the node's now, carry out
    /// its effects, and schedule its next tick.
    pub(super) fn input(
        &mut self,
        i: usize,
        f: impl FnOnce(&mut Membership, Instant) -> Vec<Effect>,
    ) {
        let now = self.node_now(i);
        let effects = f(&mut self.nodes[i].membership, now);
        self.carry_out(i, effects);
    }

    /// Carry out `effects` of node `i`'s membership, then schedule its next
    /// tick.
    fn carry_out(&mut self, i: usize, effects: Vec<Effect>) {
        for effect in effects {
            self.execute(i, effect);
        }
        self.schedule_wake(i);
    }

    /// An event that reached node `i` (up, not paused, this incarnation).
    pub(super) fn deliver(&mut self, ev: Ev) {
        match ev {
            Ev::Wake { node, nr } => {
                if self.nodes[node].wake_gen == nr {
                    self.input(node, |m, now| m.on_tick(now));
                }
            }
            Ev::FromArbiter {
                node, call, reply, ..
            } => match call {
                Call::Round(id) => self.input(node, |m, now| m.on_reply(now, id, reply)),
                Call::Op(op) => self.input(node, |m, now| m.on_op_reply(now, op, reply)),
            },
            Ev::Client { msg, key, node } => {
                if !self.nodes[node].membership.is_stopped() {
                    self.checker.asked(&key);
                }
                self.route(node, msg, key, false);
            }
            Ev::Forward {
                msg,
                key,
                from,
                from_inc,
                to,
                epoch,
                retried,
            } => {
                if self.cfg.mutation == Some(Mutation::SkipOwnerRecheck) {
                    return self.process(to, msg, &key);
                }
                // The owner's re-check: route again, never forward.
                let now = self.node_now(to);
                match self.nodes[to].membership.route(now, &key) {
                    Route::Local { .. } => self.process(to, msg, &key),
                    // "Not the owner" (or "fenced"): the sender may retry.
                    _ if !retried => {
                        let inc = from_inc;
                        let answer = Ev::NotOwner {
                            node: from,
                            inc,
                            msg,
                            key,
                            epoch,
                        };
                        self.call(to, from, answer);
                    }
                    _ => {}
                }
            }
            Ev::NotOwner {
                node,
                msg,
                key,
                epoch,
                ..
            } => {
                // As the node's `forward`: refresh the table, and route once
                // more if it is newer than the one the message was sent on.
                let now = self.node_now(node);
                let (op, effects) = self.nodes[node].membership.refresh_table(now);
                self.nodes[node].retries.insert(op, (msg, key, epoch));
                self.carry_out(node, effects);
            }
            Ev::Peer { to, message } => match message {
                PeerMessage::Move(moves) => {
                    self.input(to, |m, now| m.on_move_request(now, moves));
                }
                PeerMessage::Nudge => {
                    self.nodes[to].membership.nudge();
                    self.schedule_wake(to);
                }
            },
            Ev::Handoff {
                from,
                from_inc,
                to,
                op,
                manifest,
                entries,
            } => self.receive_handoff(from, from_inc, to, op, &manifest, &entries),
            Ev::HandoffAck { node, op, .. } => {
                self.input(node, |m, now| m.on_peer_done(now, op, Ok(())));
            }
            Ev::KeysStopped {
                node, op, entries, ..
            } => self.keys_stopped(node, op, entries),
            Ev::Reaped { node, op, .. } => self.input(node, |m, now| m.on_reaped(now, op)),
            Ev::Leave { node } => {
                let n = &self.nodes[node];
                if !n.up || n.paused_until.is_some() || n.membership.is_stopped() {
                    return;
                }
                self.log(|| format!("{}: leaving", node_name(node)));
                self.fault_until(self.now + LEAVE_TIMEOUT.as_micros() as u64);
                self.input(node, |m, now| m.begin_leave(now, LEAVE_TIMEOUT));
            }
            Ev::IdleStop {
                node,
                inc,
                key,
                life,
            } => self.retire(node, inc, key, life),
            Ev::Retired {
                node, key, life, ..
            } => self.retired(node, &key, life),
            Ev::FromStore {
                node,
                key,
                life,
                loaded,
                ..
            } => self.loaded(node, &key, life, loaded),
            Ev::SurvivorWrites {
                node, key, life, ..
            } => self.survivor_writes(node, &key, life),
            other => unreachable!("not a node's event: {other:?}"),
        }
    }

    /// Carry out one effect of node `i`'s membership.
    fn execute(&mut self, i: usize, effect: Effect) {
        let inc = self.nodes[i].incarnation;
        let name = node_name(i);
        match effect {
            Effect::Arbiter { id, request } => self.request_arbiter(i, Call::Round(id), request),
            Effect::ArbiterOp { op, request } => self.request_arbiter(i, Call::Op(op), request),
            Effect::Peer { addr, message, .. } => {
                if let Some(to) = self.by_addr(&addr) {
                    self.send(i, to, Ev::Peer { to, message });
                }
            }
            Effect::StopForHandoff { op, partitions } => self.stop_for_handoff(i, op, &partitions),
            Effect::SendHandoff {
                op,
                move_id,
                to,
                addr,
                partitions,
            } => self.send_handoff(i, op, move_id, &to, &addr, &partitions),
            Effect::MoveEnded { move_id, outcome } => self.move_ended(i, move_id, outcome),
            Effect::Reap { op, partitions } => {
                let p = self.partitions;
                let node = &mut self.nodes[i];
                let reaped = keys_in(&node.limbo, p, &partitions);
                if self.cfg.mutation == Some(Mutation::ReapHangs) && !reaped.is_empty() {
                    return self.log(|| format!("{name}: reaping {partitions:?} hangs"));
                }
                for k in &reaped {
                    let life = node.limbo.remove(k).expect("listed above");
                    self.checker.life_ended(life.id);
                }
                let reaped = reaped.len();
                self.log(|| format!("{name}: reaping {partitions:?}: {reaped} survivors"));
                let delay = self.rng.u64(0..=EXECUTOR_DELAY_US);
                self.after(delay, Ev::Reaped { node: i, inc, op });
            }
            Effect::LeaseGranted(lease) => {
                self.log(|| format!("{name}: lease {} granted", lease.0));
            }
            // The simulated arbiter never loses a commit: a regression here
            // is a bug the checker must see.
            Effect::ArbiterRegressed(r) => panic!("{name}: {r}"),
            Effect::Fence { cause, .. } => self.fence(i, cause),
            Effect::TableChanged => {
                let p = self.partitions;
                let node = &mut self.nodes[i];
                let table = node.membership.table();
                let killed: Vec<String> = node
                    .keys
                    .keys()
                    .filter(|k| lost(table, &node.id, p.of(k)))
                    .cloned()
                    .collect();
                for k in &killed {
                    let life = node.keys.remove(k).expect("listed above");
                    self.checker.life_ended(life.id);
                }
                let epoch = table.epoch();
                let stale = node.states.sweep(table, &node.id);
                self.log(|| {
                    format!("{name}: adopted table epoch {epoch}, killed {killed:?}, stale states dropped {stale:?}")
                });
            }
            Effect::MembersChanged => {
                let members: Vec<String> = self.nodes[i]
                    .membership
                    .members()
                    .keys()
                    .map(NodeId::to_string)
                    .collect();
                self.log(|| format!("{name}: members [{}]", members.join(" ")));
            }
            Effect::Refreshed { op, changed } => {
                self.log(|| format!("{name}: refresh {} ended, changed {changed}", op.0));
                let Some((msg, key, epoch)) = self.nodes[i].retries.remove(&op) else {
                    return;
                };
                if changed || self.nodes[i].membership.table().epoch() > epoch {
                    self.checker.stats.retries += 1;
                    self.log(|| format!("{name}: routes message {msg} for {key} once more"));
                    self.route(i, msg, key, true);
                }
            }
            Effect::LeaveDone(outcome) => self.log(|| format!("{name}: leave ended: {outcome:?}")),
            Effect::Ready => {}
        }
    }

    /// A message for `key` reached node `i`: route it as the node does
    /// (`retried`: a second attempt, after a refresh).
    fn route(&mut self, i: usize, msg: u64, key: String, retried: bool) {
        let now = self.node_now(i);
        match self.nodes[i].membership.route(now, &key) {
            Route::Local { .. } => self.process(i, msg, &key),
            Route::Forward { owner, .. } => {
                // The node forwards to the address the arbiter lists.
                let addr = self.nodes[i]
                    .membership
                    .members()
                    .get(&owner)
                    .and_then(|m| m.peer_addr.clone());
                if let Some(to) = addr.and_then(|a| self.by_addr(&a)) {
                    let forward = Ev::Forward {
                        msg,
                        key,
                        from: i,
                        from_inc: self.nodes[i].incarnation,
                        to,
                        epoch: self.nodes[i].membership.table().epoch(),
                        retried,
                    };
                    self.call(i, to, forward);
                }
            }
            Route::Refuse(_) => {}
        }
    }

    /// `NodeShared::fence`: terminate keys die, survivors go to limbo (a
    /// retiring one ends: its `terminate(idle)` is under way, and the
    /// messages waiting for it are dropped), the waiting handoff states are
    /// dropped.
    fn fence(&mut self, i: usize, cause: &str) {
        let node = &mut self.nodes[i];
        let mut survivors = Vec::new();
        for (key, life) in std::mem::take(&mut node.keys) {
            let survives = matches!(life.mode, Mode::Continue | Mode::Callback(true));
            if survives && life.retiring.is_none() {
                self.checker.survived(life.id);
                survivors.push((key.clone(), life.id));
                node.limbo.insert(key, life);
            } else {
                self.checker.life_ended(life.id);
            }
        }
        let dropped = node.states.clear();
        self.checker.fenced(&node.id);
        self.log(|| {
            format!(
                "{}: FENCED ({cause}), {dropped} waiting states dropped",
                node_name(i)
            )
        });
        for (key, life) in survivors {
            self.survivor_writes_later(i, &key, life);
        }
    }

    /// Whether node `i` can act now: up, not paused, lease current on its
    /// own clock (the side-effect gate's test).
    fn can_act(&mut self, i: usize) -> bool {
        let now = self.node_now(i);
        let node = &mut self.nodes[i];
        node.up && node.paused_until.is_none() && node.membership.status(now).is_current()
    }

    /// Node `i` resumed from a pause: can its surviving terminate processes
    /// act beside another node's?
    pub(super) fn check_resumed(&mut self, i: usize) {
        if !self.can_act(i) {
            return;
        }
        let mut overlaps = BTreeMap::new();
        let keys: Vec<String> = self.nodes[i]
            .keys
            .iter()
            .filter(|(_, l)| l.mode == Mode::Terminate)
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            for j in 0..self.nodes.len() {
                if j != i && self.runs_terminate(j, &key) && self.can_act(j) {
                    overlaps.insert(key.clone(), self.nodes[j].id.clone());
                }
            }
        }
        let id = self.nodes[i].id.clone();
        self.checker.resumed(self.now, &id, &overlaps);
    }

    /// Whether node `j`'s table holds a `terminate` process of `key`.
    fn runs_terminate(&self, j: usize, key: &str) -> bool {
        self.nodes[j]
            .keys
            .get(key)
            .is_some_and(|l| l.mode == Mode::Terminate)
    }

    /// A fresh id, for a process or a state.
    fn fresh_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Node `i` serves message `msg`: start the key's process if it has
    /// none (from the handoff state waiting for it, if any belongs to this
    /// ownership), then process, which gives the key a new state. If the
    /// key's process is retiring, the message waits for its end.
    fn process(&mut self, i: usize, msg: u64, key: &str) {
        let name = node_name(i);
        if let Some((_, waiting)) = self.nodes[i]
            .keys
            .get_mut(key)
            .and_then(|l| l.retiring.as_mut())
        {
            waiting.push(msg);
            self.checker.stats.waited += 1;
            return self
                .log(|| format!("{name}: message {msg} for {key} waits: {key} is retiring"));
        }
        if !self.nodes[i].keys.contains_key(key) {
            let mut others = Vec::new();
            for j in 0..self.nodes.len() {
                if j != i && self.runs_terminate(j, key) && self.can_act(j) {
                    others.push(self.nodes[j].id.clone());
                }
            }
            let node = &mut self.nodes[i];
            let (from, stale) =
                node.states
                    .take_for_activation(key, node.membership.table(), &node.id);
            let id = node.id.clone();
            let life = self.fresh_id();
            self.checker
                .life_started(self.now, &id, key, life, &others, from);
            let mode = self
                .keys
                .iter()
                .find(|(k, _)| k == key)
                .map_or(Mode::Terminate, |(_, m)| *m);
            let l = Life {
                id: life,
                mode,
                state: from,
                retiring: None,
                stored: self.stored_for(i, key),
            };
            self.nodes[i].keys.insert(key.to_owned(), l);
            self.load(i, key, life);
            self.log(|| format!("{id}: {key} started (process {life}) from {from:?}, stale state dropped {stale}"));
            if self.rng.u32(0..100) < 20 {
                let inc = self.nodes[i].incarnation;
                let idle = self.rng.u64(10_000..3_000_000);
                let key = key.to_owned();
                self.after(
                    idle,
                    Ev::IdleStop {
                        node: i,
                        inc,
                        key,
                        life,
                    },
                );
            }
        }
        let state = self.fresh_id();
        if let Some(l) = self.nodes[i].keys.get_mut(key) {
            l.state = Some(state);
            let life = l.id;
            self.write(i, key, life);
        }
        let current = self.can_act(i);
        let lease = self.nodes[i].membership.lease_id();
        let id = self.nodes[i].id.clone();
        self.checker
            .processed(self.now, &id, lease, current, msg, key);
        self.log(|| format!("{id}: processed message {msg} for {key}: state {state}"));
    }

    /// Process `life` of `key` on node `i` was idle: it retires. Its
    /// `terminate(idle)` runs for a while, and its entry stays (retiring)
    /// until it ended — except under the mutation
    /// [`Mutation::IdleEntryRemovedEarly`], the old bug, which removes the
    /// entry at once.
    fn retire(&mut self, i: usize, inc: u64, key: String, life: u64) {
        let early = self.cfg.mutation == Some(Mutation::IdleEntryRemovedEarly);
        let until = self.now + self.rng.u64(RETIRE_US);
        let node = &mut self.nodes[i];
        let Some(l) = node.keys.get_mut(&key).filter(|l| l.id == life) else {
            return;
        };
        if l.retiring.is_some() {
            return;
        }
        if early {
            node.keys.remove(&key);
        } else {
            l.retiring = Some((until, Vec::new()));
        }
        let name = node_name(i);
        self.log(|| {
            format!(
                "{name}: {key} retires (idle, process {life}) until {}",
                super::show_us(until)
            )
        });
        self.at(
            until,
            Ev::Retired {
                node: i,
                inc,
                key,
                life,
            },
        );
    }

    /// Process `life` of `key` on node `i` ended its `terminate(idle)`:
    /// its entry goes, and the messages that waited for it go to the key's
    /// next process (routed again: the partition may have moved since).
    fn retired(&mut self, i: usize, key: &str, life: u64) {
        self.checker.life_ended(life);
        let node = &mut self.nodes[i];
        if node.keys.get(key).is_none_or(|l| l.id != life) {
            return;
        }
        let l = node.keys.remove(key).expect("checked above");
        let waiting = l.retiring.map(|(_, w)| w).unwrap_or_default();
        let name = node_name(i);
        self.log(|| {
            format!(
                "{name}: {key} retired (process {life}); {} messages waited",
                waiting.len()
            )
        });
        for msg in waiting {
            let now = self.node_now(i);
            match self.nodes[i].membership.route(now, key) {
                Route::Local { .. } => self.process(i, msg, key),
                _ => self.log(|| {
                    format!("{name}: message {msg} for {key} dropped: no longer served here")
                }),
            }
        }
    }
}
