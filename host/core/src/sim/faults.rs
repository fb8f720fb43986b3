//! The seeded faults: which ones a run gets and when (2–13 in the first
//! `Config::duration`, then the calm), and what each does to the world —
//! crash and restart (a fresh process: a new `Membership`, nothing in
//! limbo), a crash of the coordination loop alone (the node fences, its
//! survivors live on, its ticks stop for a renewal interval), pause and resume (what reached the node waits), node ↔ arbiter
//! and node ↔ node cuts, an arbiter outage, the heals, and the calm. Every
//! fault records when it ends, which places the liveness window.
//!
//! It must not decide for a node: a restarted node's first tick and a
//! resumed node's waiting inputs go to its membership like any other.

use super::node::SimNode;
use super::show_us;
use super::timing;
use super::world::{Ev, World, node_name};

/// What a heal restores.
#[derive(Clone, Copy, Debug)]
pub(super) enum Heal {
    Arbiter(usize, bool, bool),
    Peer(usize, usize),
    ArbiterUp,
}

impl World {
    /// Schedule this run's faults, all before the calm.
    pub(super) fn schedule_faults(&mut self) {
        let n = self.nodes.len();
        let end = (self.cfg.duration.as_micros() as u64).max(1_000_001);
        let ttl = timing().lease_ttl().as_micros() as u64;
        let count = self.rng.usize(2..14);
        for _ in 0..count {
            let at = self.rng.u64(1_000_000..end);
            let node = self.rng.usize(0..n);
            let ev = match self.rng.u8(0..10) {
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
                8 => Ev::CoordinationCrash { node },
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
        // The node without a peer address has it from its next incarnation.
        if let Some(node) = self.no_addr {
            let at = self.rng.u64(1_000_000..end);
            self.at(at, Ev::Crash { node });
        }
    }

    /// A fault event, or its end.
    pub(super) fn fault(&mut self, ev: Ev) {
        match ev {
            Ev::Crash { node } => self.crash(node),
            Ev::CoordinationCrash { node } => {
                let n = &mut self.nodes[node];
                if !n.up || n.paused_until.is_some() || n.membership.is_stopped() {
                    return;
                }
                // As the node's supervisor: fence now, restart the loop one
                // renewal interval later; the rejoin waits for the arbiter
                // to expire the old lease (up to a TTL).
                let renew = timing().renew_interval().as_micros() as u64;
                let ttl = timing().lease_ttl().as_micros() as u64;
                n.ticks_held_until = self.now + renew;
                self.fault_until(self.now + ttl + renew);
                self.log(|| format!("{}: its coordination loop CRASHED", node_name(node)));
                self.input(node, |m, now| {
                    m.fence_now(now, "the coordination loop crashed")
                });
            }
            Ev::Restart { node } => self.restart(node),
            Ev::Pause { node, for_us } => {
                let n = &mut self.nodes[node];
                if !n.up || n.paused_until.is_some() {
                    return;
                }
                n.paused_until = Some(self.now + for_us);
                self.fault_until(self.now + for_us);
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
                self.fault_until(self.now + for_us);
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
                self.fault_until(self.now + for_us);
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
                self.fault_until(self.now + for_us);
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
            Ev::Calm => {
                self.calm = true;
                self.log(|| "the network calms down; no more faults".to_owned());
            }
            other => unreachable!("not a fault: {other:?}"),
        }
    }

    fn crash(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        if !node.up {
            return;
        }
        node.up = false;
        node.keys.clear();
        node.limbo.clear();
        self.checker.crashed(&node.id);
        node.deferred.clear();
        node.paused_until = None;
        let down = self.rng.u64(100_000..6_000_000);
        self.fault_until(self.now + down);
        self.log(|| format!("{}: CRASHED (restarts in {})", node_name(i), show_us(down)));
        self.after(down, Ev::Restart { node: i });
    }

    /// A fresh process: a new membership, nothing owned, nothing in limbo.
    fn restart(&mut self, i: usize) {
        if self.nodes[i].up {
            return;
        }
        let old = &self.nodes[i];
        let mut fresh = SimNode::new(
            old.id.clone(),
            old.clock,
            old.incarnation + 1,
            &self.cfg,
            self.partitions,
        );
        fresh.wake_gen = old.wake_gen;
        fresh.up = true;
        self.nodes[i] = fresh;
        self.log(|| format!("{}: started", node_name(i)));
        self.input(i, |m, now| m.on_tick(now));
    }

    fn resume(&mut self, i: usize) {
        if self.nodes[i].paused_until.take().is_none() {
            return;
        }
        self.log(|| format!("{}: resumed", node_name(i)));
        self.check_resumed(i);
        // The coordination loop runs first, then what waited in the sockets.
        let nr = self.nodes[i].wake_gen;
        self.handle(Ev::Wake { node: i, nr });
        let deferred = std::mem::take(&mut self.nodes[i].deferred);
        for ev in deferred {
            if !matches!(ev, Ev::Wake { .. }) {
                self.handle(ev);
            }
        }
        self.schedule_wake(i);
    }
}
