//! Deterministic simulation of a Fief cluster: the real coordination code
//! under a seeded fault scheduler, with a single-ownership checker.
//!
//! A run is one seed. From the seed, a [`fastrand::Rng`] picks the cluster
//! (3–7 nodes, 4–32 partitions, clock drift within the configured bound)
//! and, event by event, everything that happens: message delays, loss,
//! duplication and reordering on every link; node ↔ arbiter and node ↔ node
//! partitions, one-way cuts included; crashes and restarts; pauses longer
//! than the TTL; arbiter outages; graceful leaves during faults; and the
//! load (messages for keys sent to random nodes). Every node runs the real
//! [`Coordinator`] on its own drifting clock, the arbiter is the real
//! [`ArbiterState`] on the global clock, and every message is routed by the
//! real [`OwnershipTable::route`]. What the simulation adds is only what the
//! node's I/O does: a network with faults, the key processes' lives (start
//! at the first routed message, end at a kill, fence, handoff or idle
//! timeout; `continue`/`callback` survivors in limbo, reaped when the node
//! gains their partition again), and the owner's side of a graceful move
//! (`move_out`: drain, stop for handoff, send the states, transfer at the
//! arbiter).
//!
//! Every step is recorded in a trace; the [`checker`] judges the history on
//! the global clock. [`run`] returns a [`Report`]; [`Report::render`]
//! prints the seed, the cluster, the violations and the last events.
//! `FIEF_SEED=<n>` reproduces one seed exactly (see `docs/testing.md`).

pub mod checker;
#[cfg(test)]
mod tests;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::fmt::Write as _;
use std::time::Duration;

use crate::arbiter::{ArbiterState, LeaseId, Member, Refusal};
use crate::coordinator::{Action, Coordinator, Reply, Request, RequestId, gained_partitions, lost};
use crate::lease::LeaseTiming;
use crate::ownership::{NodeId, OwnershipTable, Route, RouteRefusal};
use crate::partition::{PartitionCount, PartitionId};
use crate::time::Instant;
use checker::{Checker, Stats, TableWrite, Violation};

/// A deliberate bug, to show the checker finds it (the mutation check).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// Nodes fence at `sent + ttl` instead of `sent + ttl - margin`.
    FenceAtTtl,
    /// An owner serves a forwarded message without routing it again.
    SkipOwnerRecheck,
    /// The arbiter judges a lease expired after half its TTL.
    ArbiterEarlyExpiry,
}

/// What one run simulates.
#[derive(Clone, Debug)]
pub struct Config {
    /// The seed everything else follows from.
    pub seed: u64,
    /// Simulated time per run.
    pub duration: Duration,
    /// Bound on each node's clock-rate drift against the arbiter's, in ppm;
    /// `None`: the lease timing's own bound (the configured, safe one).
    pub drift_ppm: Option<u32>,
    /// A deliberate bug, if any.
    pub mutation: Option<Mutation>,
    /// How many events the failure trace shows.
    pub trace_len: usize,
}

impl Config {
    /// The default run for `seed`: 20 s of simulated time, drift within
    /// the bound, no mutation.
    pub fn new(seed: u64) -> Self {
        Config {
            seed,
            duration: Duration::from_secs(20),
            drift_ppm: None,
            mutation: None,
            trace_len: 80,
        }
    }
}

/// The lease timing every simulated node runs under: TTL 2 s, renewal every
/// 400 ms, fence margin 500 ms, drift bound 1% (as in the chaos test).
pub fn timing() -> LeaseTiming {
    LeaseTiming::new(
        Duration::from_millis(2000),
        Duration::from_millis(400),
        Duration::from_millis(500),
        10_000,
    )
    .expect("the simulation's timing is valid")
}

/// The outcome of one run.
#[derive(Debug)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// The cluster and faults the seed chose, one line.
    pub setup: String,
    /// Breaches found (the run stops at the first instant with any).
    pub violations: Vec<Violation>,
    /// The last events before the end of the run.
    pub trace: Vec<String>,
    /// What the run did.
    pub stats: Stats,
    /// Events executed.
    pub events: u64,
}

impl Report {
    /// The seed, the setup, the violations and the trace, readable.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "seed {} ({})", self.seed, self.setup);
        let _ = writeln!(
            s,
            "reproduce: FIEF_SEED={} cargo test -p fief-core --lib sim::tests::one_seed -- --nocapture",
            self.seed
        );
        for v in &self.violations {
            let _ = writeln!(s, "VIOLATION at {}: {}", show_us(v.at_us), v.what);
        }
        let _ = writeln!(s, "last {} events:", self.trace.len());
        for line in &self.trace {
            let _ = writeln!(s, "  {line}");
        }
        let _ = writeln!(s, "stats: {:?}, {} events", self.stats, self.events);
        s
    }
}

fn show_us(us: u64) -> String {
    format!("{}.{:06}s", us / 1_000_000, us % 1_000_000)
}

/// How a key module answers the fence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Terminate,
    Continue,
    /// `handle-fence` answers continue (true) or stop (false).
    Callback(bool),
}

/// A node's clock: `offset + global * (1 + ppm / 10^6)`.
#[derive(Clone, Copy, Debug)]
struct NodeClock {
    offset_us: u64,
    ppm: i64,
}

impl NodeClock {
    fn at(&self, global_us: u64) -> Instant {
        let g = global_us as i128;
        let t = self.offset_us as i128 + g + g * self.ppm as i128 / 1_000_000;
        Instant::from_origin(Duration::from_micros(t.max(0) as u64))
    }

    /// The first global instant at which this clock reads `t` or later.
    fn global_of(&self, t: Instant, now_us: u64) -> u64 {
        let t_us = t.since_origin().as_micros() as i128;
        let local = t_us - self.offset_us as i128;
        let mut g = (local * 1_000_000 / (1_000_000 + self.ppm as i128)).max(now_us as i128) as u64;
        while self.at(g) < t {
            g += 1;
        }
        g
    }
}

/// A graceful move out in progress on its owner (one at a time, like the
/// node's `moving` lock).
#[derive(Clone, Debug)]
struct MoveOut {
    lease: LeaseId,
    /// Per target, the partitions still to hand over.
    queue: VecDeque<(NodeId, BTreeSet<PartitionId>)>,
    /// The step in flight.
    step: MoveStep,
    /// Bumped per step, so a timeout of an old step is ignored.
    nr: u64,
}

#[derive(Clone, Debug)]
enum MoveStep {
    Idle,
    /// The handoff states went to the target; waiting for its ack.
    Handoff(NodeId, BTreeSet<PartitionId>),
    /// Waiting for the arbiter's answer to the transfer.
    Transfer(BTreeSet<PartitionId>),
}

#[derive(Debug)]
struct SimNode {
    id: NodeId,
    up: bool,
    incarnation: u64,
    paused_until: Option<u64>,
    clock: NodeClock,
    coord: Coordinator,
    lease_id: Option<LeaseId>,
    table: OwnershipTable,
    members: Vec<Member>,
    draining: BTreeSet<PartitionId>,
    /// Partitions whose transfer's outcome is unknown, since when (node
    /// clock): not served until a table read sent later settles it.
    unsure: BTreeMap<PartitionId, Instant>,
    keys: BTreeMap<String, Mode>,
    limbo: BTreeSet<String>,
    moving: Option<MoveOut>,
    move_queue: VecDeque<Vec<(PartitionId, NodeId)>>,
    leaving: Option<u64>,
    /// The coordination loop was stopped (the node left).
    stopped: bool,
    wake_gen: u64,
    deferred: Vec<Ev>,
}

/// A message on the network or a scheduled step.
#[derive(Clone, Debug)]
enum Ev {
    Wake {
        node: usize,
        nr: u64,
    },
    ToArbiter {
        node: usize,
        inc: u64,
        id: RequestId,
        req: Request,
    },
    FromArbiter {
        node: usize,
        inc: u64,
        id: RequestId,
        reply: Reply,
    },
    Client {
        msg: u64,
        key: String,
        node: usize,
    },
    Peer {
        msg: u64,
        key: String,
        from: usize,
        to: usize,
    },
    MoveRequest {
        to: usize,
        moves: Vec<(PartitionId, NodeId)>,
    },
    Handoff {
        from: usize,
        from_inc: u64,
        to: usize,
        nr: u64,
    },
    HandoffAck {
        node: usize,
        inc: u64,
        nr: u64,
    },
    Transfer {
        node: usize,
        inc: u64,
        nr: u64,
        lease: LeaseId,
        moves: Vec<(PartitionId, NodeId)>,
    },
    TransferReply {
        node: usize,
        inc: u64,
        nr: u64,
        table: Option<OwnershipTable>,
    },
    MoveTimeout {
        node: usize,
        inc: u64,
        nr: u64,
    },
    Leave {
        node: usize,
    },
    LeaveCheck {
        node: usize,
        inc: u64,
    },
    LeaveArbiter {
        node: usize,
        inc: u64,
        release: bool,
        lease: LeaseId,
    },
    LeaveReply {
        node: usize,
        inc: u64,
        release: bool,
        ok: bool,
    },
    Crash {
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
    IdleStop {
        node: usize,
        inc: u64,
        key: String,
    },
}

#[derive(Clone, Copy, Debug)]
enum Heal {
    Arbiter(usize, bool, bool),
    Peer(usize, usize),
    ArbiterUp,
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

struct World {
    cfg: Config,
    rng: fastrand::Rng,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64, usize)>>,
    slots: Vec<Option<Ev>>,
    free: Vec<usize>,
    nodes: Vec<SimNode>,
    arbiter: ArbiterState,
    next_lease: u64,
    arbiter_down: bool,
    /// (node) cannot send to the arbiter / cannot hear from it.
    cut_to_arbiter: Vec<bool>,
    cut_from_arbiter: Vec<bool>,
    /// cut[a][b]: a cannot send to b.
    cut: Vec<Vec<bool>>,
    /// Per node, the last delivery time on its arbiter connection (down, up).
    arbiter_link: Vec<[u64; 2]>,
    net: NetProfile,
    keys: Vec<(String, Mode)>,
    partitions: PartitionCount,
    checker: Checker,
    trace: VecDeque<String>,
    next_msg: u64,
    events: u64,
    call_timeout_us: u64,
}

/// Run one seed.
pub fn run(cfg: Config) -> Report {
    let mut world = World::new(cfg);
    world.run();
    world.report()
}

impl World {
    fn new(cfg: Config) -> Self {
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
                let mut node = SimNode::new(
                    NodeId::new(format!("n{}", i + 1)),
                    clock,
                    cfg.mutation,
                    partitions,
                );
                // Started by the run's first events.
                node.up = false;
                node
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
            events: 0,
            call_timeout_us: 1_000_000,
        }
    }

    fn setup(&self) -> String {
        let drift: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("{:+}", n.clock.ppm))
            .collect();
        format!(
            "{} nodes, {} partitions, {} keys, drift ppm [{}], net {:?}, mutation {:?}",
            self.nodes.len(),
            self.partitions.get(),
            self.keys.len(),
            drift.join(" "),
            self.net,
            self.cfg.mutation
        )
    }

    fn log(&mut self, line: impl FnOnce() -> String) {
        if self.trace.len() >= self.cfg.trace_len {
            self.trace.pop_front();
        }
        let line = format!("{} {}", show_us(self.now), line());
        self.trace.push_back(line);
    }

    fn at(&mut self, at_us: u64, ev: Ev) {
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

    fn after(&mut self, us: u64, ev: Ev) {
        self.at(self.now + us, ev);
    }

    /// Send over node `node`'s connection to the arbiter (`up`: towards
    /// it): lost or delayed, but in order and never duplicated — one
    /// ordered connection, as to PostgreSQL.
    fn send_arbiter(&mut self, node: usize, up: bool, ev: Ev) {
        if self.rng.u32(0..100) < self.net.loss_pct {
            self.log(|| format!("lost {ev:?}"));
            return;
        }
        let mut delay = self.net.delay_us + self.rng.u64(0..=self.net.delay_us);
        if self.rng.u32(0..100) < self.net.slow_pct {
            delay += self.rng.u64(0..=self.net.tail_us);
        }
        let last = &mut self.arbiter_link[node][usize::from(up)];
        let at = (self.now + delay).max(*last);
        *last = at;
        self.at(at, ev);
    }

    /// Send over the network: lost, delayed, maybe duplicated.
    fn send(&mut self, ev: Ev) {
        if self.rng.u32(0..100) < self.net.loss_pct {
            self.log(|| format!("lost {ev:?}"));
            return;
        }
        let copies = if self.rng.u32(0..100) < self.net.dup_pct {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut delay = self.net.delay_us + self.rng.u64(0..=self.net.delay_us);
            if self.rng.u32(0..100) < self.net.slow_pct {
                delay += self.rng.u64(0..=self.net.tail_us);
            }
            self.after(delay, ev.clone());
        }
    }

    fn node_now(&self, i: usize) -> Instant {
        self.nodes[i].clock.at(self.now)
    }

    fn arbiter_now(&self) -> Instant {
        Instant::from_origin(Duration::from_micros(self.now))
    }

    fn run(&mut self) {
        self.schedule_faults();
        for i in 0..self.nodes.len() {
            let at = self.rng.u64(0..500_000);
            self.at(at, Ev::Restart { node: i });
        }
        self.after(1_000, Ev::Load);
        let end = self.cfg.duration.as_micros() as u64;
        while let Some(Reverse((at, _, slot))) = self.queue.pop() {
            if at > end {
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
    }

    fn report(self) -> Report {
        Report {
            seed: self.cfg.seed,
            setup: self.setup(),
            violations: self.checker.violations,
            trace: self.trace.into_iter().collect(),
            stats: self.checker.stats,
            events: self.events,
        }
    }

    fn schedule_faults(&mut self) {
        let n = self.nodes.len();
        let end = self.cfg.duration.as_micros() as u64;
        let ttl = timing().lease_ttl().as_micros() as u64;
        let count = self.rng.usize(2..14);
        for _ in 0..count {
            let at = self.rng.u64(1_000_000..end);
            let node = self.rng.usize(0..n);
            let ev = match self.rng.u8(0..9) {
                0 => Ev::Crash { node },
                1 => Ev::Pause {
                    node,
                    for_us: self.rng.u64(100_000..3 * ttl),
                },
                2 => Ev::CutArbiter {
                    node,
                    to: self.rng.bool(),
                    from: self.rng.bool(),
                    for_us: self.rng.u64(100_000..3 * ttl),
                },
                3 => {
                    let b = (node + self.rng.usize(1..n)) % n;
                    Ev::CutPeer {
                        a: node,
                        b,
                        for_us: self.rng.u64(100_000..3 * ttl),
                    }
                }
                4 => Ev::ArbiterDown {
                    for_us: self.rng.u64(100_000..2 * ttl),
                },
                5 => Ev::Leave { node },
                6 => Ev::CutArbiter {
                    node,
                    to: true,
                    from: true,
                    for_us: self.rng.u64(ttl..3 * ttl),
                },
                7 => Ev::Pause {
                    node,
                    for_us: self.rng.u64(ttl..3 * ttl),
                },
                _ => {
                    // A partition cutting a node from every peer (both ways).
                    for b in 0..n {
                        if b != node {
                            let for_us = self.rng.u64(100_000..2 * ttl);
                            self.at(at, Ev::CutPeer { a: node, b, for_us });
                            self.at(
                                at,
                                Ev::CutPeer {
                                    a: b,
                                    b: node,
                                    for_us,
                                },
                            );
                        }
                    }
                    continue;
                }
            };
            self.at(at, ev);
        }
    }

    fn schedule_wake(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        if !node.up || node.stopped {
            return;
        }
        node.wake_gen += 1;
        let nr = node.wake_gen;
        let wake = node.coord.wake_at();
        let at = node.clock.global_of(wake, self.now);
        self.at(at, Ev::Wake { node: i, nr });
    }

    /// Events for a node that is down are lost; for a paused one, held.
    fn deliverable(&mut self, i: usize, ev: &Ev) -> bool {
        let node = &mut self.nodes[i];
        if !node.up {
            return false;
        }
        if node.paused_until.is_some() {
            node.deferred.push(ev.clone());
            return false;
        }
        true
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Wake { node: i, nr } => {
                if self.nodes[i].wake_gen != nr || !self.deliverable(i, &Ev::Wake { node: i, nr }) {
                    return;
                }
                if self.nodes[i].stopped {
                    return;
                }
                let now = self.node_now(i);
                let actions = self.nodes[i].coord.on_tick(now);
                self.carry_out(i, actions);
            }
            Ev::ToArbiter { node, inc, id, req } => self.arbiter_request(node, inc, id, req),
            Ev::FromArbiter {
                node: i,
                inc,
                id,
                reply,
            } => {
                let ev = Ev::FromArbiter {
                    node: i,
                    inc,
                    id,
                    reply: reply.clone(),
                };
                if self.nodes[i].incarnation != inc
                    || self.nodes[i].stopped
                    || !self.deliverable(i, &ev)
                {
                    return;
                }
                let now = self.node_now(i);
                let actions = self.nodes[i].coord.on_reply(now, id, reply);
                self.carry_out(i, actions);
            }
            Ev::Client { msg, key, node } => {
                let ev = Ev::Client {
                    msg,
                    key: key.clone(),
                    node,
                };
                if !self.deliverable(node, &ev) {
                    return;
                }
                match self.route(node, &key) {
                    Route::Local { .. } => self.process(node, msg, &key),
                    Route::Forward { owner, .. } => {
                        // The node forwards to the owner it knows a member entry for.
                        let Some(to) = self.index_of(&owner) else {
                            return;
                        };
                        if !self.nodes[node].members.iter().any(|m| m.node == owner) {
                            return;
                        }
                        if self.cut[node][to] {
                            return;
                        }
                        self.send(Ev::Peer {
                            msg,
                            key,
                            from: node,
                            to,
                        });
                    }
                    Route::Refuse(_) => {}
                }
            }
            Ev::Peer { msg, key, from, to } => {
                let ev = Ev::Peer {
                    msg,
                    key: key.clone(),
                    from,
                    to,
                };
                if !self.deliverable(to, &ev) {
                    return;
                }
                if self.cfg.mutation == Some(Mutation::SkipOwnerRecheck) {
                    self.process(to, msg, &key);
                    return;
                }
                // The owner's re-check: route again, never forward.
                if let Route::Local { .. } = self.route(to, &key) {
                    self.process(to, msg, &key);
                }
            }
            Ev::MoveRequest { to, moves } => {
                let ev = Ev::MoveRequest {
                    to,
                    moves: moves.clone(),
                };
                if !self.deliverable(to, &ev) {
                    return;
                }
                self.nodes[to].move_queue.push_back(moves);
                self.start_move(to);
            }
            Ev::Handoff {
                from,
                from_inc,
                to,
                nr,
            } => {
                let ev = Ev::Handoff {
                    from,
                    from_inc,
                    to,
                    nr,
                };
                if !self.deliverable(to, &ev) {
                    return;
                }
                // The target keeps the states for the keys' next activation
                // (not modelled: state is not what the checker judges).
                if !self.cut[to][from] {
                    self.send(Ev::HandoffAck {
                        node: from,
                        inc: from_inc,
                        nr,
                    });
                }
            }
            Ev::HandoffAck { node, inc, nr } => {
                let ev = Ev::HandoffAck { node, inc, nr };
                if self.nodes[node].incarnation != inc || !self.deliverable(node, &ev) {
                    return;
                }
                self.handoff_acked(node, nr);
            }
            Ev::Transfer {
                node,
                inc,
                nr,
                lease,
                moves,
            } => {
                if self.arbiter_down {
                    return;
                }
                let id = self.nodes[node].id.clone();
                let old = self.arbiter.table().clone();
                let now = self.arbiter_now();
                let result = self.arbiter.transfer(now, &id, lease, moves);
                self.log(|| {
                    format!(
                        "arbiter: transfer by {id}: {:?}",
                        result.as_ref().map(OwnershipTable::epoch)
                    )
                });
                let table = match result {
                    Ok(table) => {
                        self.checker.table_changed(
                            self.now,
                            &old,
                            &table,
                            TableWrite::Transfer,
                            Some(&id),
                        );
                        Some(table)
                    }
                    Err(_) => None,
                };
                if !self.cut_from_arbiter[node] {
                    self.send_arbiter(
                        node,
                        false,
                        Ev::TransferReply {
                            node,
                            inc,
                            nr,
                            table,
                        },
                    );
                }
            }
            Ev::TransferReply {
                node,
                inc,
                nr,
                table,
            } => {
                let ev = Ev::TransferReply {
                    node,
                    inc,
                    nr,
                    table: table.clone(),
                };
                if self.nodes[node].incarnation != inc || !self.deliverable(node, &ev) {
                    return;
                }
                self.transfer_answered(node, nr, table);
            }
            Ev::MoveTimeout { node, inc, nr } => {
                let ev = Ev::MoveTimeout { node, inc, nr };
                if self.nodes[node].incarnation != inc || !self.deliverable(node, &ev) {
                    return;
                }
                if self.nodes[node].moving.as_ref().is_some_and(|m| m.nr == nr) {
                    self.log(|| format!("{}: move step timed out", node_name(node)));
                    self.move_step_failed(node);
                }
            }
            Ev::Leave { node } => self.leave(node),
            Ev::LeaveCheck { node, inc } => {
                let ev = Ev::LeaveCheck { node, inc };
                if self.nodes[node].incarnation != inc || !self.deliverable(node, &ev) {
                    return;
                }
                self.leave_check(node);
            }
            Ev::LeaveArbiter {
                node,
                inc,
                release,
                lease,
            } => {
                if self.arbiter_down {
                    return;
                }
                let id = self.nodes[node].id.clone();
                let now = self.arbiter_now();
                let ok = if release {
                    self.arbiter.release(&id, lease);
                    self.checker.lease_released(&id, lease);
                    true
                } else {
                    self.arbiter.set_leaving(now, &id, lease).is_ok()
                };
                self.log(|| {
                    format!(
                        "arbiter: {id} {} -> {ok}",
                        if release { "released" } else { "set leaving" }
                    )
                });
                if !self.cut_from_arbiter[node] {
                    self.send_arbiter(
                        node,
                        false,
                        Ev::LeaveReply {
                            node,
                            inc,
                            release,
                            ok,
                        },
                    );
                }
            }
            Ev::LeaveReply {
                node,
                inc,
                release,
                ok,
            } => {
                let ev = Ev::LeaveReply {
                    node,
                    inc,
                    release,
                    ok,
                };
                if self.nodes[node].incarnation != inc || !self.deliverable(node, &ev) {
                    return;
                }
                self.leave_answered(node, release, ok);
            }
            Ev::Crash { node } => self.crash(node),
            Ev::Restart { node } => self.restart(node),
            Ev::Pause { node, for_us } => {
                let n = &mut self.nodes[node];
                if !n.up || n.paused_until.is_some() {
                    return;
                }
                n.paused_until = Some(self.now + for_us);
                self.log(|| format!("{}: paused for {}", node_name(node), show_us(for_us)));
                self.after(for_us, Ev::Resume { node });
            }
            Ev::Resume { node } => self.resume(node),
            Ev::CutArbiter {
                node,
                to,
                from,
                for_us,
            } => {
                self.cut_to_arbiter[node] |= to;
                self.cut_from_arbiter[node] |= from;
                self.log(|| {
                    format!(
                        "{}: cut from the arbiter (requests {to}, replies {from}) for {}",
                        node_name(node),
                        show_us(for_us)
                    )
                });
                self.after(
                    for_us,
                    Ev::Heal {
                        what: Heal::Arbiter(node, to, from),
                    },
                );
            }
            Ev::CutPeer { a, b, for_us } => {
                self.cut[a][b] = true;
                self.log(|| {
                    format!(
                        "{} -> {} cut for {}",
                        node_name(a),
                        node_name(b),
                        show_us(for_us)
                    )
                });
                self.after(
                    for_us,
                    Ev::Heal {
                        what: Heal::Peer(a, b),
                    },
                );
            }
            Ev::ArbiterDown { for_us } => {
                self.arbiter_down = true;
                self.log(|| format!("arbiter down for {}", show_us(for_us)));
                self.after(
                    for_us,
                    Ev::Heal {
                        what: Heal::ArbiterUp,
                    },
                );
            }
            Ev::Heal { what } => {
                match what {
                    Heal::Arbiter(node, to, from) => {
                        if to {
                            self.cut_to_arbiter[node] = false;
                        }
                        if from {
                            self.cut_from_arbiter[node] = false;
                        }
                    }
                    Heal::Peer(a, b) => self.cut[a][b] = false,
                    Heal::ArbiterUp => self.arbiter_down = false,
                }
                self.log(|| format!("healed {what:?}"));
            }
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
            Ev::IdleStop { node, inc, key } => {
                let ev = Ev::IdleStop {
                    node,
                    inc,
                    key: key.clone(),
                };
                if self.nodes[node].incarnation != inc || !self.deliverable(node, &ev) {
                    return;
                }
                if self.nodes[node].keys.remove(&key).is_some() {
                    self.log(|| format!("{}: {key} stopped (idle)", node_name(node)));
                }
            }
        }
    }

    fn index_of(&self, id: &NodeId) -> Option<usize> {
        self.nodes.iter().position(|n| &n.id == id)
    }

    /// The node's routing decision, as `NodeShared::route` makes it.
    fn route(&mut self, i: usize, key: &str) -> Route {
        let now = self.node_now(i);
        let node = &mut self.nodes[i];
        let status = node.coord.status(now);
        match node.table.route(&node.id, status, key) {
            Route::Local { partition, .. }
                if node.draining.contains(&partition) || node.unsure.contains_key(&partition) =>
            {
                Route::Refuse(RouteRefusal::Unowned(partition))
            }
            route => route,
        }
    }

    /// Whether node `i` can act now: up, not paused, lease current on its
    /// own clock (the side-effect gate's test).
    fn can_act(&mut self, i: usize) -> bool {
        let now = self.node_now(i);
        let node = &mut self.nodes[i];
        node.up && node.paused_until.is_none() && node.coord.status(now).is_current()
    }

    fn process(&mut self, i: usize, msg: u64, key: &str) {
        if !self.nodes[i].keys.contains_key(key) {
            let mut others = Vec::new();
            for j in 0..self.nodes.len() {
                if j != i
                    && self.nodes[j].keys.get(key) == Some(&Mode::Terminate)
                    && self.can_act(j)
                {
                    others.push(self.nodes[j].id.clone());
                }
            }
            let survivor = self.nodes[i].limbo.contains(key);
            let id = self.nodes[i].id.clone();
            self.checker
                .life_started(self.now, &id, key, &others, survivor);
            let mode = self
                .keys
                .iter()
                .find(|(k, _)| k == key)
                .map_or(Mode::Terminate, |(_, m)| *m);
            self.nodes[i].keys.insert(key.to_owned(), mode);
            self.log(|| format!("{id}: {key} started"));
            if self.rng.u32(0..100) < 20 {
                let inc = self.nodes[i].incarnation;
                let idle = self.rng.u64(10_000..3_000_000);
                self.after(
                    idle,
                    Ev::IdleStop {
                        node: i,
                        inc,
                        key: key.to_owned(),
                    },
                );
            }
        }
        let now = self.node_now(i);
        let current = self.nodes[i].coord.status(now).is_current();
        let lease = self.nodes[i].lease_id;
        let id = self.nodes[i].id.clone();
        self.checker
            .processed(self.now, &id, lease, current, msg, key);
        self.log(|| format!("{id}: processed message {msg} for {key}"));
    }

    fn carry_out(&mut self, i: usize, actions: Vec<Action>) {
        let mut again = false;
        for action in actions {
            match action {
                Action::Send { id, request } => {
                    let inc = self.nodes[i].incarnation;
                    if self.cut_to_arbiter[i] {
                        self.log(|| format!("{}: {request:?} cut", node_name(i)));
                        continue;
                    }
                    self.send_arbiter(
                        i,
                        true,
                        Ev::ToArbiter {
                            node: i,
                            inc,
                            id,
                            req: request,
                        },
                    );
                }
                Action::LeaseGranted(lease) => {
                    self.nodes[i].lease_id = Some(lease);
                    self.log(|| format!("{}: lease {} granted", node_name(i), lease.0));
                }
                Action::Fence { cause } => {
                    self.fence(i, cause);
                    again = true;
                }
                Action::Leader(_) => {}
                Action::Members(members) => self.nodes[i].members = members,
                Action::AdoptTable { table, asked_at } => {
                    self.adopt_table(i, &table);
                    // A read sent after a transfer failed settles it.
                    let node = &mut self.nodes[i];
                    let settled: Vec<PartitionId> = node
                        .unsure
                        .iter()
                        .filter(|(_, at)| **at < asked_at)
                        .map(|(p, _)| *p)
                        .collect();
                    for p in settled {
                        node.unsure.remove(&p);
                    }
                }
                Action::StartMoves(by_owner) => {
                    for (owner, moves) in by_owner {
                        let Some(to) = self.index_of(&owner) else {
                            continue;
                        };
                        if to == i {
                            self.nodes[i].move_queue.push_back(moves);
                            self.start_move(i);
                        } else if !self.cut[i][to]
                            && self.nodes[i].members.iter().any(|m| m.node == owner)
                        {
                            self.send(Ev::MoveRequest { to, moves });
                        }
                    }
                }
                Action::Ready => {}
            }
        }
        if again {
            // After a fence the coordinator rejoins at the next tick.
            let now = self.node_now(i);
            let actions = self.nodes[i].coord.on_tick(now);
            self.carry_out(i, actions);
            return;
        }
        self.schedule_wake(i);
    }

    /// `refresh_table`'s adoption: reap survivors of gained partitions,
    /// take the newer table, kill the keys of partitions lost.
    fn adopt_table(&mut self, i: usize, newer: &OwnershipTable) {
        let node = &mut self.nodes[i];
        let Some(gained) = gained_partitions(&node.table, newer, &node.id) else {
            return;
        };
        let partitions = self.partitions;
        node.limbo.retain(|k| !gained.contains(&partitions.of(k)));
        node.table.update_from(newer);
        let table = node.table.clone();
        let id = node.id.clone();
        let killed: Vec<String> = node
            .keys
            .keys()
            .filter(|k| lost(&table, &id, partitions.of(k)))
            .cloned()
            .collect();
        for k in &killed {
            node.keys.remove(k);
        }
        self.log(|| {
            format!(
                "{id}: adopted table epoch {} (gained {gained:?}, killed {killed:?})",
                table.epoch()
            )
        });
    }

    /// `NodeShared::fence`: terminate keys die, survivors go to limbo, the
    /// table is forgotten.
    fn fence(&mut self, i: usize, cause: &str) {
        let partitions = self.partitions;
        let node = &mut self.nodes[i];
        let keys = std::mem::take(&mut node.keys);
        for (key, mode) in keys {
            match mode {
                Mode::Terminate | Mode::Callback(false) => {}
                Mode::Continue | Mode::Callback(true) => {
                    node.limbo.insert(key);
                }
            }
        }
        node.table = OwnershipTable::new(partitions);
        node.lease_id = None;
        node.unsure.clear();
        self.checker.stats.fences += 1;
        let id = node.id.clone();
        self.log(|| format!("{id}: FENCED ({cause})"));
    }

    fn arbiter_request(&mut self, i: usize, inc: u64, id: RequestId, req: Request) {
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
        let reply = match req.clone() {
            Request::Register => {
                self.next_lease += 1;
                let lease = LeaseId(self.next_lease);
                let old = self.arbiter.table().clone();
                match self.arbiter.register(now, &node, lease, ttl, None) {
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
                Ok(()) => {
                    self.checker.lease_committed(self.now, &node, lease, false);
                    Reply::Renewed
                }
                Err(r) => refusal(r),
            },
            Request::Campaign(lease) => match self.arbiter.campaign(now, &node, lease) {
                Ok(term) => Reply::Campaign(term),
                Err(r) => refusal(r),
            },
            Request::LiveNodes => Reply::Members(self.arbiter.live_nodes(now)),
            Request::Transfer(..) | Request::SetLeaving(_) | Request::Release(_) => {
                unreachable!("not sent by the round")
            }
            Request::Table => Reply::Table(self.arbiter.table().clone()),
            Request::WriteTable(term, changes) => {
                let old = self.arbiter.table().clone();
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
                id,
                reply,
            },
        );
    }

    // ---- The owner's side of a graceful move (`NodeShared::move_out`). ----

    fn start_move(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        if node.moving.is_some() {
            return;
        }
        let Some(moves) = node.move_queue.pop_front() else {
            return;
        };
        let Some(lease) = node.lease_id else { return };
        let mut by_target: BTreeMap<NodeId, BTreeSet<PartitionId>> = BTreeMap::new();
        for (partition, to) in moves {
            let mine = node
                .table
                .owner(partition)
                .is_some_and(|a| a.node == node.id);
            if mine && to != node.id {
                by_target.entry(to).or_default().insert(partition);
            }
        }
        node.moving = Some(MoveOut {
            lease,
            queue: by_target.into_iter().collect(),
            step: MoveStep::Idle,
            nr: 0,
        });
        self.next_move_step(i);
    }

    fn next_move_step(&mut self, i: usize) {
        let Some(mut m) = self.nodes[i].moving.take() else {
            return;
        };
        let Some((to, partitions)) = m.queue.pop_front() else {
            // Done: take the next request.
            self.start_move(i);
            return;
        };
        let inc = self.nodes[i].incarnation;
        let Some(t) = self.index_of(&to) else {
            self.nodes[i].moving = Some(m);
            return self.next_move_step(i);
        };
        if !self.nodes[i].members.iter().any(|mm| mm.node == to) {
            // No peer address for the target: this target's move fails.
            self.nodes[i].moving = Some(m);
            return self.next_move_step(i);
        }
        // Drain, then stop the partitions' keys with `handoff`.
        let partitions_count = self.partitions;
        let node = &mut self.nodes[i];
        node.draining.extend(partitions.iter().copied());
        let stopped: Vec<String> = node
            .keys
            .keys()
            .filter(|k| partitions.contains(&partitions_count.of(k)))
            .cloned()
            .collect();
        for k in &stopped {
            node.keys.remove(k);
        }
        let id = node.id.clone();
        self.log(|| format!("{id}: handing {partitions:?} to {to}, stopped {stopped:?}"));
        m.nr += 1;
        let nr = m.nr;
        m.step = MoveStep::Handoff(to, partitions);
        self.nodes[i].moving = Some(m);
        if !self.cut[i][t] {
            self.send(Ev::Handoff {
                from: i,
                from_inc: inc,
                to: t,
                nr,
            });
        }
        self.after(self.call_timeout_us, Ev::MoveTimeout { node: i, inc, nr });
    }

    fn handoff_acked(&mut self, i: usize, nr: u64) {
        let inc = self.nodes[i].incarnation;
        let Some(m) = self.nodes[i].moving.as_mut() else {
            return;
        };
        if m.nr != nr {
            return;
        }
        let MoveStep::Handoff(to, partitions) = std::mem::replace(&mut m.step, MoveStep::Idle)
        else {
            return;
        };
        m.nr += 1;
        let nr = m.nr;
        let lease = m.lease;
        let moves = partitions.iter().map(|p| (*p, to.clone())).collect();
        m.step = MoveStep::Transfer(partitions);
        if !self.cut_to_arbiter[i] {
            self.send_arbiter(
                i,
                true,
                Ev::Transfer {
                    node: i,
                    inc,
                    nr,
                    lease,
                    moves,
                },
            );
        }
        self.after(self.call_timeout_us, Ev::MoveTimeout { node: i, inc, nr });
    }

    fn transfer_answered(&mut self, i: usize, nr: u64, table: Option<OwnershipTable>) {
        let Some(m) = self.nodes[i].moving.as_mut() else {
            return;
        };
        if m.nr != nr {
            return;
        }
        match table {
            Some(table) => {
                let MoveStep::Transfer(partitions) = std::mem::replace(&mut m.step, MoveStep::Idle)
                else {
                    return;
                };
                let lease = m.lease;
                // Only under the lease the move was made under (after a
                // fence, and maybe a rejoin, this table is not the node's),
                // and as any adoption: survivors of gained partitions are
                // reaped first.
                if self.nodes[i].lease_id == Some(lease) {
                    self.adopt_table(i, &table);
                }
                let node = &mut self.nodes[i];
                for p in &partitions {
                    node.draining.remove(p);
                }
                let id = node.id.clone();
                self.log(|| {
                    format!(
                        "{id}: handed off {partitions:?} (table epoch {})",
                        table.epoch()
                    )
                });
                self.next_move_step(i);
            }
            None => self.move_step_failed(i),
        }
    }

    /// A step failed (refused, or no answer in time): the partitions stay
    /// here. After a failed handoff they are served again at once; after a
    /// failed transfer the arbiter may have committed it all the same (the
    /// answer was lost), so they stay drained until a later table read.
    fn move_step_failed(&mut self, i: usize) {
        let now = self.node_now(i);
        let Some(m) = self.nodes[i].moving.as_mut() else {
            return;
        };
        let (partitions, unsure) = match std::mem::replace(&mut m.step, MoveStep::Idle) {
            MoveStep::Handoff(_, p) => (p, false),
            MoveStep::Transfer(p) => (p, true),
            MoveStep::Idle => (BTreeSet::new(), false),
        };
        for p in &partitions {
            if unsure {
                self.nodes[i].unsure.insert(*p, now);
            }
            self.nodes[i].draining.remove(p);
        }
        self.log(|| {
            format!(
                "{}: handoff of {partitions:?} failed; keeping them",
                node_name(i)
            )
        });
        self.next_move_step(i);
    }

    // ---- Graceful leave (`Instance::leave`). ----

    fn leave(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        if !node.up || node.paused_until.is_some() || node.leaving.is_some() || node.stopped {
            return;
        }
        let Some(lease) = node.lease_id else { return };
        node.leaving = Some(self.now + 5_000_000);
        let inc = node.incarnation;
        self.log(|| format!("{}: leaving", node_name(i)));
        if !self.cut_to_arbiter[i] {
            self.send_arbiter(
                i,
                true,
                Ev::LeaveArbiter {
                    node: i,
                    inc,
                    release: false,
                    lease,
                },
            );
        }
        self.after(self.call_timeout_us, Ev::LeaveCheck { node: i, inc });
    }

    fn leave_answered(&mut self, i: usize, release: bool, ok: bool) {
        if release {
            self.log(|| format!("{}: left the cluster", node_name(i)));
            return;
        }
        if !ok {
            self.nodes[i].leaving = None;
        }
    }

    fn leave_check(&mut self, i: usize) {
        let Some(deadline) = self.nodes[i].leaving else {
            return;
        };
        let inc = self.nodes[i].incarnation;
        let node = &self.nodes[i];
        let others = node.members.iter().any(|m| m.node != node.id && !m.leaving);
        let owned = node.table.count_owned_by(&node.id);
        if others && owned > 0 {
            if self.now >= deadline {
                // `leave` gives up with a timeout; the node stays a member.
                self.nodes[i].leaving = None;
                self.log(|| format!("{}: leave timed out", node_name(i)));
                return;
            }
            self.nodes[i].coord.nudge();
            self.schedule_wake(i);
            self.after(50_000, Ev::LeaveCheck { node: i, inc });
            return;
        }
        // Stop coordinating, stop serving (the lease is fenced before it
        // is released: once released, others may take what it still owns),
        // then release the lease.
        let Some(lease) = self.nodes[i].lease_id else {
            return;
        };
        let now = self.node_now(i);
        self.nodes[i].coord.fence_now(now);
        self.nodes[i].stopped = true;
        self.log(|| format!("{}: releasing its lease (owns {owned})", node_name(i)));
        if !self.cut_to_arbiter[i] {
            self.send_arbiter(
                i,
                true,
                Ev::LeaveArbiter {
                    node: i,
                    inc,
                    release: true,
                    lease,
                },
            );
        }
    }

    // ---- Crash, restart, pause. ----

    fn crash(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        if !node.up {
            return;
        }
        node.up = false;
        node.keys.clear();
        node.limbo.clear();
        node.deferred.clear();
        node.paused_until = None;
        let down = self.rng.u64(100_000..6_000_000);
        self.log(|| format!("{}: CRASHED (restarts in {})", node_name(i), show_us(down)));
        self.after(down, Ev::Restart { node: i });
    }

    fn restart(&mut self, i: usize) {
        if self.nodes[i].up && !self.nodes[i].stopped {
            return;
        }
        let old = &self.nodes[i];
        let mut fresh = SimNode::new(
            old.id.clone(),
            old.clock,
            self.cfg.mutation,
            self.partitions,
        );
        fresh.incarnation = old.incarnation + 1;
        fresh.wake_gen = old.wake_gen;
        self.nodes[i] = fresh;
        self.log(|| format!("{}: started", node_name(i)));
        let now = self.node_now(i);
        let actions = self.nodes[i].coord.on_tick(now);
        self.carry_out(i, actions);
    }

    fn resume(&mut self, i: usize) {
        if self.nodes[i].paused_until.take().is_none() {
            return;
        }
        self.log(|| format!("{}: resumed", node_name(i)));
        // Can its surviving terminate processes act beside another node's?
        if self.can_act(i) {
            let mut overlaps = BTreeMap::new();
            let keys: Vec<String> = self.nodes[i]
                .keys
                .iter()
                .filter(|(_, m)| **m == Mode::Terminate)
                .map(|(k, _)| k.clone())
                .collect();
            for key in keys {
                for j in 0..self.nodes.len() {
                    if j != i
                        && self.nodes[j].keys.get(&key) == Some(&Mode::Terminate)
                        && self.can_act(j)
                    {
                        overlaps.insert(key.clone(), self.nodes[j].id.clone());
                    }
                }
            }
            let id = self.nodes[i].id.clone();
            self.checker.resumed(self.now, &id, &overlaps);
        }
        // The coordination loop runs first, then what waited in the sockets.
        let nr = self.nodes[i].wake_gen;
        self.handle(Ev::Wake { node: i, nr });
        let deferred = std::mem::take(&mut self.nodes[i].deferred);
        for ev in deferred {
            let ev = match ev {
                Ev::Wake { .. } => continue,
                ev => ev,
            };
            self.handle(ev);
        }
        self.schedule_wake(i);
    }
}

impl SimNode {
    fn new(
        id: NodeId,
        clock: NodeClock,
        mutation: Option<Mutation>,
        partitions: PartitionCount,
    ) -> Self {
        let mut coord = Coordinator::new(timing());
        if mutation == Some(Mutation::FenceAtTtl) {
            coord.mutate_fence_at_ttl();
        }
        SimNode {
            id,
            up: true,
            incarnation: 0,
            paused_until: None,
            clock,
            coord,
            lease_id: None,
            table: OwnershipTable::new(partitions),
            members: Vec::new(),
            draining: BTreeSet::new(),
            unsure: BTreeMap::new(),
            keys: BTreeMap::new(),
            limbo: BTreeSet::new(),
            moving: None,
            move_queue: VecDeque::new(),
            leaving: None,
            stopped: false,
            wake_gen: 0,
            deferred: Vec::new(),
        }
    }
}

fn node_name(i: usize) -> String {
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
