//! Deterministic simulation of a Fief cluster: the real ownership protocol
//! under a seeded fault scheduler, with a single-ownership checker.
//!
//! A run is one seed. From the seed, a [`fastrand::Rng`] picks the cluster
//! (3–7 nodes, 4–32 partitions, clock drift within the configured bound)
//! and, event by event, everything that happens: message delays, loss,
//! duplication and reordering on every link; node ↔ arbiter and node ↔ node
//! partitions, one-way cuts included; crashes and restarts; pauses longer
//! than the TTL; arbiter outages; graceful leaves during faults; and the
//! load (messages for keys sent to random nodes).
//!
//! Every node runs the real [`Membership`](crate::Membership) on its own
//! drifting clock — the coordination round, table adoption in order,
//! draining and unsure partitions, graceful moves, fence, rejoin, leave and
//! the routing rule — and the arbiter is the real
//! [`ArbiterState`](crate::ArbiterState) on the global clock. The simulation
//! holds no copy of a node's decisions; it supplies only what the node's I/O
//! does, in two parts:
//!
//! - `world`: the event queue on the global clock, the network (lossy,
//!   duplicating links between nodes; one ordered link per node to the
//!   arbiter), the clocks, the load, and the arbiter's side of every request
//!   (recorded for the checker); `faults`: the seeded faults, then the calm;
//! - `node`: the executor of each node's [`Effect`](crate::Effect)s — the key
//!   processes' lives (start at the first routed message, from the handoff
//!   state waiting for the key if any; end at a kill, fence, handoff stop or
//!   idle retirement — whose `terminate(idle)` takes a while, messages
//!   arriving meanwhile waiting for its end; `continue`/`callback` survivors
//!   in limbo until reaped), the stops and reaps (answered after a small
//!   random delay), and the forwarding of messages to their owner;
//!   `handoff`: the handoff states, each a number, from a key's stop to its
//!   next process, as the node keeps and sends them;
//! - `store`: the durable store (a fence token per partition, a counter per
//!   key, the commits it acknowledged) under the core's fence rule
//!   ([`storage_fence`](crate::storage_fence)), and the processes' side of
//!   it: each process loads its key under its ownership token when it
//!   starts and commits an increment for each message, and a survivor in
//!   limbo keeps committing under its old token (a stale owner), all over
//!   each node's ordered, delayed link to the store.
//!
//! Every step is recorded in a trace; the [`checker`] judges the history on
//! the global clock (with `lives`, its record of key processes and of the
//! handoff states between them). [`run`] returns a [`Report`]; [`Report::render`]
//! prints the seed, the cluster, the violations and the last events.
//! `FIEF_SEED=<n>` reproduces one seed exactly (see `docs/testing.md`).

pub mod checker;
mod faults;
mod handoff;
mod lives;
mod node;
mod store;
#[cfg(test)]
mod tests;
mod world;

use std::fmt::Write as _;
use std::time::Duration;

use crate::lease::LeaseTiming;
use checker::{Stats, Violation};

/// A deliberate bug, to show the checker finds it (the mutation check).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// Nodes fence at `sent + ttl` instead of `sent + ttl - margin`.
    FenceAtTtl,
    /// An owner serves a forwarded message without routing it again.
    SkipOwnerRecheck,
    /// The arbiter judges a lease expired after half its TTL.
    ArbiterEarlyExpiry,
    /// The executor's reap hangs when it finds survivors in limbo: it
    /// neither removes them nor answers, so the adoption waiting for it
    /// never comes (the node's executor side, which the liveness rule
    /// judges).
    ReapHangs,
    /// A move serves its partitions again once it sends the transfer,
    /// before the transfer's table is adopted (a `Membership` rule).
    DrainReleasedAtTransfer,
    /// A table is adopted without reaping the survivors of what it gains
    /// (a `Membership` rule).
    AdoptWithoutReap,
    /// A handoff drops the states waiting on its node for keys of its
    /// partitions instead of sending them on (the executor's side: a state
    /// not yet claimed must travel on with the next move).
    HandoffDropsWaiting,
    /// A move's sender lets go of the states it sends at once, not when
    /// the move ends: a handoff lost on the way (the move fails and keeps
    /// its partitions) loses them.
    ReleaseBeforeAck,
    /// An idle key's table entry is removed before its `terminate(idle)`
    /// runs, not after it ended (the old bug): a message arriving meanwhile
    /// starts a second process of the key beside the retiring one.
    IdleEntryRemovedEarly,
    /// The store applies every commit without the fence check: a stale
    /// owner's commit lands after a newer owner loaded the partition.
    StoreSkipsFence,
}

/// What one run simulates.
#[derive(Clone, Debug)]
pub struct Config {
    /// The seed everything else follows from.
    pub seed: u64,
    /// Simulated time with faults: until then the network loses, delays
    /// and duplicates messages and faults start; after it the network is
    /// calm and no fault starts. The run goes on until the liveness window
    /// ([`checker::WINDOW`], beginning [`checker::SETTLE`] after the last
    /// fault ended) is over.
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
            let _ = writeln!(
                s,
                "VIOLATION ({:?}) at {}: {}",
                v.rule,
                show_us(v.at_us),
                v.what
            );
        }
        let _ = writeln!(s, "last {} events:", self.trace.len());
        for line in &self.trace {
            let _ = writeln!(s, "  {line}");
        }
        let _ = writeln!(s, "stats: {:?}, {} events", self.stats, self.events);
        s
    }
}

/// Run one seed.
pub fn run(cfg: Config) -> Report {
    world::World::new(cfg).run()
}

fn show_us(us: u64) -> String {
    format!("{}.{:06}s", us / 1_000_000, us % 1_000_000)
}
