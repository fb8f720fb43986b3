//! The simulated world around the nodes: the event queue on the global
//! clock, the nodes' drifting clocks, the network (lossy, delaying,
//! duplicating and reordering links between nodes, with cuts; one ordered
//! link per node to the arbiter, which loses and delays but never reorders;
//! calm after the faults' time), the load, the arbiter's side of every
//! request (the real [`ArbiterState`], each commit recorded for the
//! checker), the ordered link from each node to the durable store (the
//! store itself and its side of each request are `store`'s), and the
//! liveness window's probes. The faults themselves are `faults`'s.
//!
//! It owns what no node decides: when things happen and what reaches whom.
//! It must not decide anything a node decides — every input a node gets goes
//! to its `Membership`, and its effects are carried out by the executor
//! (`node`); nothing here looks at a node's table, moves or leave.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Duration;

use super::checker::{Checker, SETTLE, TableWrite, WINDOW};
use super::faults::Heal;
use super::handoff::Entry;
use super::node::{Mode, SimNode};
use super::store::{Request as StoreRequest, Store, Value};
use super::{Config, Mutation, Report, show_us, timing};
use crate::arbiter::{ArbiterState, LeaseId, Refusal};
use crate::coordinator::{Reply, Request, RequestId};
use crate::handoff::Row;
use crate::membership::{OpId, PeerMessage};
use crate::ownership::NodeId;
use crate::partition::PartitionCount;
use crate::time::Instant;

/// How often the liveness window probes the arbiter's table, µs.
const PROBE_US: u64 = 100_000;

/// A node's clock: `offset + global * (1 + ppm / 10^6)`.
#[derive(Clone, Copy, Debug)]
pub(super) struct NodeClock {
    offset_us: u64,
    pub(super) ppm: i64,
}

impl NodeClock {
    pub(super) fn at(&self, global_us: u64) -> Instant {
        let g = global_us as i128;
        let t = self.offset_us as i128 + g + g * self.ppm as i128 / 1_000_000;
        Instant::from_origin(Duration::from_micros(t.max(0) as u64))
    }

    /// The first global instant at which this clock reads `t` or later.
    pub(super) fn global_of(&self, t: Instant, now_us: u64) -> u64 {
        let t_us = t.since_origin().as_micros() as i128;
        let local = t_us - self.offset_us as i128;
        let mut g = (local * 1_000_000 / (1_000_000 + self.ppm as i128)).max(now_us as i128) as u64;
        while self.at(g) < t {
            g += 1;
        }
        g
    }
}

/// Which of a node's arbiter requests an answer is for.
#[derive(Clone, Copy, Debug)]
pub(super) enum Call {
    /// The coordination round's (`Membership::on_reply`).
    Round(RequestId),
    /// A move's, a leave's or a refresh's (`Membership::on_op_reply`).
    Op(OpId),
}

/// A message on the network or a scheduled step.
#[derive(Clone, Debug)]
pub(super) enum Ev {
    /// Tick the node's membership (if `nr` is still its latest wake).
    Wake {
        node: usize,
        nr: u64,
    },
    ToArbiter {
        node: usize,
        inc: u64,
        call: Call,
        req: Request,
    },
    FromArbiter {
        node: usize,
        inc: u64,
        call: Call,
        reply: Reply,
    },
    /// A client's message for `key`, arriving at `node`.
    Client {
        msg: u64,
        key: String,
        node: usize,
    },
    /// A message forwarded by `from` to the owner it routed it to, under
    /// its table of `epoch`; `retried`: the second and last attempt.
    Forward {
        msg: u64,
        key: String,
        from: usize,
        from_inc: u64,
        to: usize,
        epoch: u64,
        retried: bool,
    },
    /// The receiver of a forwarded message does not serve it (it is not
    /// the owner, or refuses): the sender refreshes its table and routes
    /// the message once more.
    NotOwner {
        node: usize,
        inc: u64,
        msg: u64,
        key: String,
        epoch: u64,
    },
    /// A peer message of the protocol (a move request, a nudge).
    Peer {
        to: usize,
        message: PeerMessage,
    },
    /// A move's handoff states, to the target, with the rows naming the
    /// move's attempt.
    Handoff {
        from: usize,
        from_inc: u64,
        to: usize,
        op: OpId,
        manifest: Vec<Row>,
        entries: Vec<Entry>,
    },
    /// The target took the states.
    HandoffAck {
        node: usize,
        inc: u64,
        op: OpId,
    },
    /// The executor stopped the keys of a handoff, with their states.
    KeysStopped {
        node: usize,
        inc: u64,
        op: OpId,
        entries: Vec<Entry>,
    },
    /// The executor reaped the survivors of a reap.
    Reaped {
        node: usize,
        inc: u64,
        op: OpId,
    },
    Leave {
        node: usize,
    },
    Crash {
        node: usize,
    },
    /// The node's coordination loop crashes: it fences, and its ticks stop
    /// for a renewal interval (the node's supervisor restarts the loop
    /// then); answers to what it asked still arrive.
    CoordinationCrash {
        node: usize,
    },
    Restart {
        node: usize,
    },
    Pause {
        node: usize,
        for_us: u64,
    },
    Resume {
        node: usize,
    },
    CutArbiter {
        node: usize,
        to: bool,
        from: bool,
        for_us: u64,
    },
    CutPeer {
        a: usize,
        b: usize,
        for_us: u64,
    },
    ArbiterDown {
        for_us: u64,
    },
    Heal {
        what: Heal,
    },
    Load,
    /// Process `life` of `key` has been idle long enough: it retires.
    IdleStop {
        node: usize,
        inc: u64,
        key: String,
        life: u64,
    },
    /// Process `life` of `key` ended its `terminate(idle)`.
    Retired {
        node: usize,
        inc: u64,
        key: String,
        life: u64,
    },
    /// The faults' time is over: the network calms down (no loss, slow tail
    /// or duplication) and no new fault starts.
    Calm,
    /// The liveness window may begin (if the faults are long enough over).
    Window,
    /// Which partitions live nodes own, during the window.
    Probe,
    /// A node's load or commit, to the durable store.
    ToStore {
        node: usize,
        req: StoreRequest,
    },
    /// The store's answer to process `life`'s load of `key`: the key's
    /// value, or the fence token that refused it as stale.
    FromStore {
        node: usize,
        inc: u64,
        key: String,
        life: u64,
        loaded: Result<Value, u64>,
    },
    /// Survivor `life` of `key`, in its node's limbo, writes to its state
    /// (a `continue` process's own timer, say).
    SurvivorWrites {
        node: usize,
        inc: u64,
        key: String,
        life: u64,
    },
}

impl Ev {
    /// The node an event is delivered to, and the incarnation it is for
    /// (`None`: whichever is up). Events for a node that is down, or for an
    /// incarnation since replaced, are lost; for a paused node, held.
    fn recipient(&self) -> Option<(usize, Option<u64>)> {
        match self {
            Ev::Wake { node, .. } | Ev::Client { node, .. } => Some((*node, None)),
            Ev::Forward { to, .. } | Ev::Peer { to, .. } | Ev::Handoff { to, .. } => {
                Some((*to, None))
            }
            Ev::FromArbiter { node, inc, .. }
            | Ev::HandoffAck { node, inc, .. }
            | Ev::KeysStopped { node, inc, .. }
            | Ev::Reaped { node, inc, .. }
            | Ev::NotOwner { node, inc, .. }
            | Ev::IdleStop { node, inc, .. }
            | Ev::Retired { node, inc, .. }
            | Ev::FromStore { node, inc, .. }
            | Ev::SurvivorWrites { node, inc, .. } => Some((*node, Some(*inc))),
            _ => None,
        }
    }
}

/// The network's behaviour for this seed.
#[derive(Clone, Copy, Debug)]
struct NetProfile {
    /// Base one-way delay, µs.
    delay_us: u64,
    /// Extra delay: up to this, µs, on a fraction `slow_pct` of messages.
    tail_us: u64,
    slow_pct: u32,
    loss_pct: u32,
    dup_pct: u32,
}

pub(super) struct World {
    pub(super) cfg: Config,
    pub(super) rng: fastrand::Rng,
    pub(super) now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64, usize)>>,
    slots: Vec<Option<Ev>>,
    free: Vec<usize>,
    pub(super) nodes: Vec<SimNode>,
    arbiter: ArbiterState,
    next_lease: u64,
    pub(super) arbiter_down: bool,
    /// (node) cannot send to the arbiter / cannot hear from it.
    pub(super) cut_to_arbiter: Vec<bool>,
    pub(super) cut_from_arbiter: Vec<bool>,
    /// cut[a][b]: a cannot send to b.
    pub(super) cut: Vec<Vec<bool>>,
    /// Per node, the last delivery time on its arbiter connection (down, up).
    arbiter_link: Vec<[u64; 2]>,
    net: NetProfile,
    pub(super) keys: Vec<(String, Mode)>,
    pub(super) partitions: PartitionCount,
    pub(super) checker: Checker,
    trace: VecDeque<String>,
    next_msg: u64,
    /// The last id given to a key process or a state.
    pub(super) next_id: u64,
    events: u64,
    /// The node that registers without a peer address in its first
    /// incarnation, if any (one seed in four).
    pub(super) no_addr: Option<usize>,
    /// When the last fault so far ends (heals, resumes, restarts, times
    /// out), µs.
    quiet_from: u64,
    /// The network is calm (see [`Ev::Calm`]).
    pub(super) calm: bool,
    /// The durable store the key processes load from and commit to.
    pub(super) store: Store,
    /// The store's own draws (its links' delays, the survivors' writes),
    /// apart from `rng`: adding the store left every seed's history of
    /// the rest as it was.
    pub(super) store_rng: fastrand::Rng,
    /// Per node, the last delivery time on its link to the store (down, up).
    store_link: Vec<[u64; 2]>,
}

impl World {
    pub(super) fn new(cfg: Config) -> Self {
        let mut rng = fastrand::Rng::with_seed(cfg.seed);
        let n = rng.usize(3..=7);
        let partitions = PartitionCount::new(rng.u32(4..=32)).expect("at least one partition");
        let bound = i64::from(cfg.drift_ppm.unwrap_or(timing().max_clock_drift_ppm()));
        let mut arbiter = ArbiterState::new(partitions);
        if cfg.mutation == Some(Mutation::ArbiterEarlyExpiry) {
            arbiter.mutate_early_expiry(50);
        }
        let net = NetProfile {
            delay_us: rng.u64(50..2_000),
            tail_us: rng.u64(1_000..600_000),
            slow_pct: rng.u32(0..15),
            loss_pct: rng.u32(0..10),
            dup_pct: rng.u32(0..5),
        };
        let nodes = (0..n)
            .map(|i| {
                // Drift at the bound's edges as often as inside it.
                let ppm = match rng.u8(0..3) {
                    0 => -bound,
                    1 => bound,
                    _ => rng.i64(-bound..=bound),
                };
                let clock = NodeClock {
                    offset_us: rng.u64(0..10_000_000),
                    ppm,
                };
                // Started by the run's first events.
                SimNode::new(NodeId::new(node_name(i)), clock, 0, &cfg, partitions)
            })
            .collect();
        let keys = (0..rng.usize(6..40))
            .map(|i| {
                let mode = match i % 4 {
                    0 => Mode::Continue,
                    1 => Mode::Callback(rng.bool()),
                    _ => Mode::Terminate,
                };
                (format!("k{i}"), mode)
            })
            .collect();
        let no_addr = (rng.u8(0..4) == 0).then(|| rng.usize(0..n));
        let store = Store::new(cfg.mutation == Some(Mutation::StoreSkipsFence));
        let store_rng = fastrand::Rng::with_seed(cfg.seed ^ 0x5704_e5ee_d000_0001);
        World {
            checker: Checker::new(timing().lease_ttl()),
            trace: VecDeque::new(),
            cut_to_arbiter: vec![false; n],
            cut_from_arbiter: vec![false; n],
            cut: vec![vec![false; n]; n],
            arbiter_link: vec![[0; 2]; n],
            cfg,
            rng,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            nodes,
            arbiter,
            next_lease: 0,
            arbiter_down: false,
            net,
            keys,
            partitions,
            next_msg: 0,
            next_id: 0,
            events: 0,
            no_addr,
            quiet_from: 0,
            calm: false,
            store,
            store_rng,
            store_link: vec![[0; 2]; n],
        }
    }

    fn setup(&self) -> String {
        let drift: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("{:+}", n.clock.ppm))
            .collect();
        format!(
            "{} nodes, {} partitions, {} keys, drift ppm [{}], net {:?}, no peer address {}, mutation {:?}",
            self.nodes.len(),
            self.partitions.get(),
            self.keys.len(),
            drift.join(" "),
            self.net,
            self.no_addr.map_or("-".to_owned(), node_name),
            self.cfg.mutation
        )
    }

    pub(super) fn log(&mut self, line: impl FnOnce() -> String) {
        if self.trace.len() >= self.cfg.trace_len {
            self.trace.pop_front();
        }
        let line = format!("{} {}", show_us(self.now), line());
        self.trace.push_back(line);
    }

    pub(super) fn at(&mut self, at_us: u64, ev: Ev) {
        let slot = match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(ev);
                i
            }
            None => {
                self.slots.push(Some(ev));
                self.slots.len() - 1
            }
        };
        self.seq += 1;
        self.queue.push(Reverse((at_us, self.seq, slot)));
    }

    pub(super) fn after(&mut self, us: u64, ev: Ev) {
        self.at(self.now + us, ev);
    }

    /// Send over node `node`'s connection to the arbiter (`up`: towards
    /// it): lost or delayed, but in order and never duplicated — one
    /// ordered connection, as to PostgreSQL.
    fn send_arbiter(&mut self, node: usize, up: bool, ev: Ev) {
        if self.net_fault(self.net.loss_pct) {
            self.log(|| format!("lost {ev:?}"));
            return;
        }
        let mut delay = self.net.delay_us + self.rng.u64(0..=self.net.delay_us);
        if self.net_fault(self.net.slow_pct) {
            delay += self.rng.u64(0..=self.net.tail_us);
        }
        let last = &mut self.arbiter_link[node][usize::from(up)];
        let at = (self.now + delay).max(*last);
        *last = at;
        self.at(at, ev);
    }

    /// Send over node `node`'s link to the store (`up`: towards it):
    /// delayed as the network delays (with its slow tail until the calm),
    /// but in order, never lost nor duplicated — the node's one storage
    /// pipeline (`host/src/storage/writer.rs`) on one connection. A lost
    /// request or answer is a timeout in the node, which ends the process:
    /// not modelled.
    pub(super) fn send_store(&mut self, node: usize, up: bool, ev: Ev) {
        let rng = &mut self.store_rng;
        let mut delay = self.net.delay_us + rng.u64(0..=self.net.delay_us);
        if rng.u32(0..100) < self.net.slow_pct && !self.calm {
            delay += rng.u64(0..=self.net.tail_us);
        }
        let last = &mut self.store_link[node][usize::from(up)];
        let at = (self.now + delay).max(*last);
        *last = at;
        self.at(at, ev);
    }

    /// Node `node`'s request to the arbiter, unless its link is cut.
    pub(super) fn request_arbiter(&mut self, node: usize, call: Call, req: Request) {
        if self.cut_to_arbiter[node] {
            self.log(|| format!("{}: {req:?} cut", node_name(node)));
            return;
        }
        let inc = self.nodes[node].incarnation;
        self.send_arbiter(
            node,
            true,
            Ev::ToArbiter {
                node,
                inc,
                call,
                req,
            },
        );
    }

    /// Send a protocol message (a move request, a nudge, a handoff or its
    /// ack) from node `from` to node `to`, unless the link is cut: lost,
    /// delayed, reordered, maybe duplicated.
    pub(super) fn send(&mut self, from: usize, to: usize, ev: Ev) {
        self.transmit(from, to, ev, true);
    }

    /// Send a forwarded call or its answer: lost, delayed or reordered but
    /// never duplicated — a call is one request on a connection. (A call
    /// duplicated by the network, one copy served by the old owner and the
    /// other refused and retried at the new one, would be served twice: a
    /// transport's fault the protocol cannot see.)
    pub(super) fn call(&mut self, from: usize, to: usize, ev: Ev) {
        self.transmit(from, to, ev, false);
    }

    fn transmit(&mut self, from: usize, to: usize, ev: Ev, duplicates: bool) {
        if self.cut[from][to] {
            self.log(|| format!("cut {ev:?}"));
            return;
        }
        if self.net_fault(self.net.loss_pct) {
            self.log(|| format!("lost {ev:?}"));
            return;
        }
        let copies = if duplicates && self.net_fault(self.net.dup_pct) {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut delay = self.net.delay_us + self.rng.u64(0..=self.net.delay_us);
            if self.net_fault(self.net.slow_pct) {
                delay += self.rng.u64(0..=self.net.tail_us);
            }
            self.after(delay, ev.clone());
        }
    }

    pub(super) fn node_now(&self, i: usize) -> Instant {
        self.nodes[i].clock.at(self.now)
    }

    fn arbiter_now(&self) -> Instant {
        Instant::from_origin(Duration::from_micros(self.now))
    }

    /// The node listening at `addr`, a peer address the arbiter lists.
    pub(super) fn by_addr(&self, addr: &str) -> Option<usize> {
        self.nodes
            .iter()
            .position(|n| addr.strip_suffix(":peer") == Some(n.id.as_str()))
    }

    /// A fault lasts until `until_us`.
    pub(super) fn fault_until(&mut self, until_us: u64) {
        self.quiet_from = self.quiet_from.max(until_us);
    }

    /// Where the liveness window begins: [`SETTLE`] after the network
    /// calmed and the last fault ended.
    fn window_from(&self) -> u64 {
        let duration = self.cfg.duration.as_micros() as u64;
        duration.max(self.quiet_from) + SETTLE.as_micros() as u64
    }

    /// Whether a network fault of this seed's `pct` hits a message (never
    /// once the network is calm; the draw is made all the same).
    fn net_fault(&mut self, pct: u32) -> bool {
        self.rng.u32(0..100) < pct && !self.calm
    }

    pub(super) fn run(mut self) -> Report {
        self.schedule_faults();
        for i in 0..self.nodes.len() {
            let at = self.rng.u64(0..500_000);
            self.at(at, Ev::Restart { node: i });
        }
        self.after(1_000, Ev::Load);
        let window = WINDOW.as_micros() as u64;
        self.at(self.cfg.duration.as_micros() as u64, Ev::Calm);
        self.at(self.window_from(), Ev::Window);
        // The end moves with the faults (a crash's restart is known when it
        // crashes); all of them start before the calm.
        while let Some(Reverse((at, _, slot))) = self.queue.pop() {
            if at > self.window_from() + window {
                break;
            }
            self.now = at;
            let ev = self.slots[slot].take().expect("each slot is popped once");
            self.free.push(slot);
            self.events += 1;
            self.handle(ev);
            if !self.checker.violations.is_empty() {
                break;
            }
        }
        if self.checker.violations.is_empty() {
            self.now = self.window_from() + window;
            self.checker.window_ends(self.now);
        }
        Report {
            seed: self.cfg.seed,
            setup: self.setup(),
            violations: self.checker.violations,
            trace: self.trace.into_iter().collect(),
            stats: self.checker.stats,
            events: self.events,
        }
    }

    /// Schedule the node's next tick at its membership's `wake_at` (on the
    /// node's clock); earlier wakes are void.
    pub(super) fn schedule_wake(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        if !node.up {
            return;
        }
        node.wake_gen += 1;
        let nr = node.wake_gen;
        let Some(wake) = node.membership.wake_at() else {
            return;
        };
        let at = node
            .clock
            .global_of(wake, self.now)
            .max(node.ticks_held_until);
        self.at(at, Ev::Wake { node: i, nr });
    }

    pub(super) fn handle(&mut self, ev: Ev) {
        if let Some((i, inc)) = ev.recipient() {
            let node = &mut self.nodes[i];
            if !node.up || inc.is_some_and(|inc| inc != node.incarnation) {
                return;
            }
            if node.paused_until.is_some() {
                node.deferred.push(ev);
                return;
            }
        }
        match ev {
            Ev::ToArbiter {
                node,
                inc,
                call,
                req,
            } => self.arbiter_request(node, inc, call, req),
            ev @ (Ev::Crash { .. }
            | Ev::CoordinationCrash { .. }
            | Ev::Restart { .. }
            | Ev::Pause { .. }
            | Ev::Resume { .. }
            | Ev::CutArbiter { .. }
            | Ev::CutPeer { .. }
            | Ev::ArbiterDown { .. }
            | Ev::Heal { .. }
            | Ev::Calm) => self.fault(ev),
            Ev::Load => {
                for _ in 0..self.rng.usize(1..4) {
                    self.next_msg += 1;
                    let msg = self.next_msg;
                    let key = self.keys[self.rng.usize(0..self.keys.len())].0.clone();
                    let node = self.rng.usize(0..self.nodes.len());
                    let delay = self.rng.u64(0..200);
                    self.after(delay, Ev::Client { msg, key, node });
                }
                let gap = self.rng.u64(500..4_000);
                self.after(gap, Ev::Load);
            }
            Ev::Window => {
                let from = self.window_from();
                if self.now < from {
                    return self.at(from, Ev::Window);
                }
                // Judged only if some node can take partitions: up, not
                // left, and not marked leaving at the arbiter.
                let now = self.arbiter_now();
                let members = self.arbiter.live_nodes(now);
                let capacity = self.nodes.iter().any(|n| {
                    n.up && !n.membership.is_stopped()
                        && members.iter().any(|m| m.node == n.id && !m.leaving)
                });
                self.log(|| format!("liveness window begins (judged: {capacity})"));
                if capacity {
                    self.checker.window_begins(self.now);
                    self.handle(Ev::Probe);
                }
            }
            Ev::ToStore { node, req } => self.store_request(node, req),
            Ev::Probe => {
                let unowned: Vec<_> = self
                    .arbiter
                    .table()
                    .iter()
                    .filter(|(_, owner)| {
                        !owner.is_some_and(|a| {
                            self.nodes
                                .iter()
                                .any(|n| n.id == a.node && n.up && !n.membership.is_stopped())
                                && self.checker.node_lease_current(&a.node, self.now)
                        })
                    })
                    .map(|(p, _)| p)
                    .collect();
                self.checker.unowned(self.now, unowned);
                self.after(PROBE_US, Ev::Probe);
            }
            // What a node receives, its executor handles.
            ev => self.deliver(ev),
        }
    }

    /// The arbiter serves node `i`'s request and answers over its link.
    fn arbiter_request(&mut self, i: usize, inc: u64, call: Call, req: Request) {
        if self.arbiter_down {
            return;
        }
        let node = self.nodes[i].id.clone();
        let now = self.arbiter_now();
        let ttl = timing().lease_ttl();
        let refusal = |r: Refusal| match r {
            Refusal::LeaseExpired(_) => Reply::LeaseExpired,
            other => Reply::Failed(other.to_string()),
        };
        let old = self.arbiter.table().clone();
        let reply = match req.clone() {
            Request::Register => {
                self.next_lease += 1;
                let lease = LeaseId(self.next_lease);
                // One node's first incarnation has no peer address.
                let addr = (self.no_addr != Some(i) || inc > 1).then(|| format!("{node}:peer"));
                match self.arbiter.register(now, &node, lease, ttl, addr) {
                    Ok(lease) => {
                        self.checker.lease_committed(self.now, &node, lease, true);
                        let new = self.arbiter.table().clone();
                        self.checker.table_changed(
                            self.now,
                            &old,
                            &new,
                            TableWrite::Register,
                            None,
                        );
                        Reply::Registered(lease)
                    }
                    Err(r) => refusal(r),
                }
            }
            Request::Renew(lease) => match self.arbiter.renew(now, &node, lease) {
                Ok(mark) => {
                    self.checker.lease_committed(self.now, &node, lease, false);
                    Reply::Renewed(mark)
                }
                Err(r) => refusal(r),
            },
            Request::Campaign(lease) => match self.arbiter.campaign(now, &node, lease) {
                Ok(term) => Reply::Campaign(term),
                Err(r) => refusal(r),
            },
            Request::LiveNodes => Reply::Members(self.arbiter.live_nodes(now)),
            Request::Table => Reply::Table(self.arbiter.table().clone()),
            Request::WriteTable(term, changes) => {
                match self.arbiter.write_table(now, term, changes) {
                    Ok(table) => {
                        self.checker.table_changed(
                            self.now,
                            &old,
                            &table,
                            TableWrite::Leader,
                            None,
                        );
                        Reply::Table(table)
                    }
                    Err(r) => refusal(r),
                }
            }
            Request::Transfer(lease, moves) => {
                match self.arbiter.transfer(now, &node, lease, moves) {
                    Ok(table) => {
                        self.checker.table_changed(
                            self.now,
                            &old,
                            &table,
                            TableWrite::Transfer,
                            Some(&node),
                        );
                        Reply::Table(table)
                    }
                    Err(r) => refusal(r),
                }
            }
            Request::SetLeaving(lease) => match self.arbiter.set_leaving(now, &node, lease) {
                Ok(()) => Reply::Done,
                Err(r) => refusal(r),
            },
            Request::Release(lease) => {
                self.arbiter.release(&node, lease);
                self.checker.lease_released(&node, lease);
                Reply::Done
            }
        };
        self.log(|| format!("arbiter: {node} {req:?} -> {}", short(&reply)));
        if self.cut_from_arbiter[i] {
            return;
        }
        self.send_arbiter(
            i,
            false,
            Ev::FromArbiter {
                node: i,
                inc,
                call,
                reply,
            },
        );
    }
}

pub(super) fn node_name(i: usize) -> String {
    format!("n{}", i + 1)
}

fn short(reply: &Reply) -> String {
    match reply {
        Reply::Table(t) => format!("table epoch {}", t.epoch()),
        Reply::Members(m) => format!(
            "members [{}]",
            m.iter()
                .map(|m| m.node.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        ),
        other => format!("{other:?}"),
    }
}
