//! The coordination loop's decisions, without I/O: join, renew, campaign,
//! lead, follow the table, fence, rejoin.
//!
//! [`Coordinator`] is a state machine driven by two inputs — the node's clock
//! ([`Coordinator::on_tick`]) and the arbiter's answers
//! ([`Coordinator::on_reply`]) — that returns [`Action`]s for the caller to
//! carry out: send one [`Request`] to the arbiter, fence, adopt a table,
//! start graceful moves. It never waits: [`Coordinator::wake_at`] says when
//! it must be ticked next (the fence point, a request's deadline, the next
//! renewal). The node's async driver (`host/src/node/coordination.rs`) and the
//! deterministic simulation (`sim`) run this same code.
//!
//! One round, as in contract §2–§3: renew if due (a refusal fences: the
//! arbiter says the lease expired); campaign; as leader, give orphaned
//! partitions to live nodes and ask owners above their share to move some;
//! read the members and the table. At most one request is outstanding; each
//! has a deadline of one renewal interval. A renewal that falls due while a
//! round is in progress goes before the round's next step (which follows it
//! if it succeeds; a failed renewal starts the round again), so a failing
//! or hanging arbiter costs at most one step's deadline between renewal
//! attempts, not a whole round's. The fence point is checked before
//! every step and before every answer is used, so a slow or silent arbiter
//! can delay a renewal, never the fence. Every change to the lease is also
//! published through [`Coordinator::gate`], for checks that must not wait
//! for the lock the caller keeps the coordinator under (the node's
//! side-effect gate).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::arbiter::{LeaseId, Member, Term};
use crate::assignment::{orphan_assignment, rebalance_moves};
use crate::history::{ArbiterHistory, Regression};
use crate::lease::{FenceGate, Lease, LeaseStatus, LeaseTiming, Renewal, RenewalCounts};
use crate::ownership::{NodeId, OwnershipTable};
use crate::partition::PartitionId;
use crate::time::Instant;

/// Most graceful moves the leader starts per round.
pub const MOVES_PER_ROUND: usize = 256;

/// Why the node fenced because its fence point passed.
pub const FENCE_POINT_PASSED: &str = "the lease could not be renewed before the fence point";
/// Why the node fenced because the arbiter refused its renewal.
pub const LEASE_EXPIRED: &str = "the arbiter says the lease expired";
/// Why the node fenced because the arbiter answered from before what the
/// node had seen (see [`Regression`]).
pub const ARBITER_REGRESSED: &str = "the arbiter went back in time";

/// Identifies one request, so a late or duplicated answer is recognised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

/// A request for the arbiter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Register a fresh lease.
    Register,
    /// Renew the lease.
    Renew(LeaseId),
    /// Campaign for leadership under the lease.
    Campaign(LeaseId),
    /// Read the live members.
    LiveNodes,
    /// Read the table.
    Table,
    /// Write the table as the leader of the term.
    WriteTable(Term, Vec<(PartitionId, Option<NodeId>)>),
    /// Hand partitions this node owns under the lease to other nodes (a
    /// graceful move's last step). Sent by [`Membership`](crate::Membership),
    /// never by the round.
    Transfer(LeaseId, Vec<(PartitionId, NodeId)>),
    /// Mark this node as leaving under the lease (the start of a leave).
    SetLeaving(LeaseId),
    /// Give the lease up (the end of a leave).
    Release(LeaseId),
}

/// The arbiter's answer to a [`Request`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// `Register` succeeded.
    Registered(LeaseId),
    /// `Renew` succeeded; the lease's renewal mark (strictly higher at
    /// every renewal of the lease, see [`ArbiterHistory::renewed`]).
    Renewed(u64),
    /// `Campaign`: the term if this node leads.
    Campaign(Option<Term>),
    /// `LiveNodes`.
    Members(Vec<Member>),
    /// `Table`, `WriteTable` or `Transfer`: the table as it now stands.
    Table(OwnershipTable),
    /// `SetLeaving` or `Release` succeeded.
    Done,
    /// The lease has expired at the arbiter.
    LeaseExpired,
    /// Any other failure (unreachable, refused, not the leader).
    Failed(String),
}

/// What the caller must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send `request` to the arbiter and report the answer with `id`.
    Send {
        /// The id to answer with.
        id: RequestId,
        /// The request.
        request: Request,
    },
    /// A lease was granted: the node may serve (once the table says so).
    LeaseGranted(LeaseId),
    /// The arbiter answered from before what this node has seen: tell the
    /// operator. A [`Action::Fence`] follows at once, and the node rejoins
    /// no sooner than one lease TTL later.
    Regressed(Regression),
    /// Fence now: kill `terminate` keys, serve nothing, forget the table.
    /// The lease is already fenced; the next tick starts a rejoin.
    Fence {
        /// Why.
        cause: &'static str,
    },
    /// This node leads in the term (or does not lead).
    Leader(Option<Term>),
    /// The live members, as the arbiter reported them.
    Members(Vec<Member>),
    /// Adopt this table if it is newer (see [`gained_partitions`]). It was
    /// asked for at `asked_at`: it reflects every table change the arbiter
    /// committed before then (which settles a handoff whose answer was lost).
    AdoptTable {
        /// The arbiter's table.
        table: OwnershipTable,
        /// When the read was sent, on the node's clock.
        asked_at: Instant,
    },
    /// As leader: ask each owner to hand the listed partitions to the
    /// listed nodes (graceful moves).
    StartMoves(Vec<(NodeId, Vec<(PartitionId, NodeId)>)>),
    /// A round finished: the node has a table to route with.
    Ready,
}

/// A request in flight.
#[derive(Clone, Debug)]
struct Outstanding {
    id: RequestId,
    sent: Instant,
    /// The highest table epoch seen when it was sent: a table answer below
    /// it is a regression (see [`ArbiterHistory::table`]).
    asked_after: Option<u64>,
    deadline: Instant,
    stage: Stage,
}

/// What the outstanding request is for.
#[derive(Clone, Debug)]
enum Stage {
    Register(Renewal),
    /// A renewal; with the step of the round it went before, if it fell
    /// due in the middle of a round (sent once the renewal succeeds).
    Renew(Renewal, Option<Box<(Request, Stage)>>),
    Campaign,
    LeaderMembers(Term),
    LeaderTable {
        term: Term,
        live: Vec<NodeId>,
        targets: Vec<NodeId>,
    },
    LeaderWrite {
        targets: Vec<NodeId>,
    },
    Members,
    Table,
}

#[derive(Clone, Debug)]
enum Phase {
    /// Fenced: the next tick replaces the lease and rejoins.
    Fenced,
    /// Registering a lease; retry at `retry_at` when nothing is in flight.
    Joining {
        retry_at: Instant,
        waiting: Option<Outstanding>,
    },
    /// Holding `lease`; `waiting` is the round's request in flight, if any.
    Member {
        lease: LeaseId,
        waiting: Option<Outstanding>,
    },
}

/// The node's coordination state: its lease and the round in progress.
#[derive(Debug)]
pub struct Coordinator {
    lease: Lease,
    phase: Phase,
    next_id: u64,
    sync_now: bool,
    /// What the node has seen of the arbiter's history: kept across fences
    /// and rejoins.
    history: ArbiterHistory,
    /// After a regression: no rejoin before this.
    quarantine_until: Option<Instant>,
    /// The lease's fence point for lock-free readers, published by every
    /// method that can change the lease (see [`FenceGate`]).
    gate: Arc<FenceGate>,
    /// The simulation's mutation: every new lease fences at the TTL.
    #[cfg(any(test, feature = "sim"))]
    fence_at_ttl: bool,
}

/// A clone has a gate of its own (publishing the same fence point): two
/// coordinators never publish to one gate.
impl Clone for Coordinator {
    fn clone(&self) -> Self {
        let gate = FenceGate::default();
        gate.publish(self.lease.current_until());
        Coordinator {
            lease: self.lease.clone(),
            phase: self.phase.clone(),
            next_id: self.next_id,
            sync_now: self.sync_now,
            history: self.history.clone(),
            quarantine_until: self.quarantine_until,
            gate: Arc::new(gate),
            #[cfg(any(test, feature = "sim"))]
            fence_at_ttl: self.fence_at_ttl,
        }
    }
}

impl Coordinator {
    /// A node that has not joined yet; the first tick registers.
    pub fn new(timing: LeaseTiming) -> Self {
        Coordinator {
            lease: Lease::new(timing),
            phase: Phase::Joining {
                retry_at: Instant::ZERO,
                waiting: None,
            },
            next_id: 0,
            sync_now: false,
            history: ArbiterHistory::new(),
            quarantine_until: None,
            gate: Arc::default(),
            #[cfg(any(test, feature = "sim"))]
            fence_at_ttl: false,
        }
    }

    /// The lease's fence point as published for readers that do not hold
    /// the coordinator (the node's side-effect gate): current while the
    /// clock reads before [`FenceGate::current_until`]. It follows every
    /// lease this coordinator holds, across fences and rejoins.
    pub fn gate(&self) -> Arc<FenceGate> {
        self.gate.clone()
    }

    fn publish(&self) {
        self.gate.publish(self.lease.current_until());
    }

    /// Mutation for the simulation's checker test: every lease fences at
    /// `sent + ttl` instead of `sent + ttl - margin`.
    #[cfg(any(test, feature = "sim"))]
    pub fn mutate_fence_at_ttl(&mut self) {
        self.fence_at_ttl = true;
        self.lease.mutate_fence_at_ttl();
        self.publish();
    }

    /// The lease's timing.
    pub fn timing(&self) -> &LeaseTiming {
        self.lease.timing()
    }

    /// The lease's status at `now` (see [`Lease::status`]).
    pub fn status(&mut self, now: Instant) -> LeaseStatus {
        let status = self.lease.status(now);
        self.publish();
        status
    }

    /// The current lease's fence point, if any renewal succeeded.
    pub fn fence_point(&self) -> Option<Instant> {
        self.lease.fence_point()
    }

    /// Fence the lease now (terminal for this lease); the next tick emits
    /// [`Action::Fence`] and rejoins. A node still joining holds no lease
    /// to fence: its registration goes on (fencing it would only discard a
    /// lease the arbiter grants anyway, and lock the node out until that
    /// lease expires there; found by the simulation, seed 188 with a crash
    /// of the coordination loop while the node was rejoining).
    pub fn fence_now(&mut self, now: Instant) {
        if matches!(self.phase, Phase::Joining { .. }) {
            return;
        }
        self.lease.fence_now(now);
        self.publish();
    }

    /// The current lease's renewals so far (see [`Lease::renewal_counts`]).
    pub fn renewal_counts(&self) -> RenewalCounts {
        self.lease.renewal_counts()
    }

    /// Take the current lease's renewal counts (see
    /// [`Lease::take_renewal_counts`]).
    pub fn take_renewal_counts(&mut self) -> RenewalCounts {
        self.lease.take_renewal_counts()
    }

    /// An answer outside the round (a transfer's, a refresh's, a leave's),
    /// to a request sent when the highest epoch seen was `asked_after`
    /// ([`Coordinator::highest_epoch_seen`] then), brought `table`: judge it
    /// against the arbiter's history as seen.
    ///
    /// # Errors
    ///
    /// The [`Regression`], recorded nowhere: call
    /// [`Coordinator::regressed`] with it.
    pub fn check_table(
        &mut self,
        table: &OwnershipTable,
        asked_after: Option<u64>,
    ) -> Result<(), Regression> {
        self.history.table(table, asked_after)
    }

    /// The arbiter went back in time: fence now (if the node holds a lease)
    /// and rejoin no sooner than one lease TTL from `now`, so every lease
    /// the lost commits renewed has passed its fence point on its node's
    /// clock before this node asks the arbiter for anything again.
    pub fn regressed(&mut self, now: Instant, regression: Regression) -> Vec<Action> {
        let mut out = vec![Action::Regressed(regression)];
        self.quarantine_until = Some(now + self.lease.timing().lease_ttl());
        if matches!(self.phase, Phase::Member { .. }) {
            self.fence(now, ARBITER_REGRESSED, &mut out);
        }
        self.publish();
        out
    }

    /// The highest table epoch this node has read from the arbiter.
    pub fn highest_epoch_seen(&self) -> Option<u64> {
        self.history.epoch()
    }

    /// The lease held at the arbiter, once joined (until the fence).
    pub fn lease_id(&self) -> Option<LeaseId> {
        match self.phase {
            Phase::Member { lease, .. } => Some(lease),
            _ => None,
        }
    }

    /// Start a round as soon as nothing is in flight (someone changed the
    /// table: a handoff arrived, or a leave is waiting for its moves).
    pub fn nudge(&mut self) {
        self.sync_now = true;
    }

    /// When [`Coordinator::on_tick`] must be called next, at the latest.
    pub fn wake_at(&self) -> Instant {
        match &self.phase {
            Phase::Fenced => Instant::ZERO,
            Phase::Joining {
                waiting: Some(o), ..
            } => o.deadline,
            Phase::Joining { retry_at, .. } => *retry_at,
            Phase::Member { waiting, .. } => {
                let fence = self.lease.fence_point().unwrap_or(Instant::ZERO);
                let next = match waiting {
                    Some(o) => o.deadline,
                    None if self.sync_now => Instant::ZERO,
                    None => self.lease.next_renewal_at(),
                };
                fence.min(next)
            }
        }
    }

    /// Time has passed: fence if the fence point came, give up on a request
    /// past its deadline, start what is due.
    pub fn on_tick(&mut self, now: Instant) -> Vec<Action> {
        let mut actions = Vec::new();
        self.step(now, None, &mut actions);
        self.publish();
        actions
    }

    /// The arbiter answered request `id`. Answers to requests given up on,
    /// and duplicates, are ignored.
    pub fn on_reply(&mut self, now: Instant, id: RequestId, reply: Reply) -> Vec<Action> {
        let mut actions = Vec::new();
        self.step(now, Some((id, reply)), &mut actions);
        self.publish();
        actions
    }

    fn send(
        &mut self,
        now: Instant,
        request: Request,
        stage: Stage,
        out: &mut Vec<Action>,
    ) -> Outstanding {
        self.next_id += 1;
        let id = RequestId(self.next_id);
        out.push(Action::Send { id, request });
        Outstanding {
            id,
            sent: now,
            asked_after: self.history.epoch(),
            deadline: now + self.lease.timing().renew_interval(),
            stage,
        }
    }

    fn fence(&mut self, now: Instant, cause: &'static str, out: &mut Vec<Action>) {
        self.lease.fence_now(now);
        self.publish();
        self.phase = Phase::Fenced;
        out.push(Action::Fence { cause });
    }

    fn step(&mut self, now: Instant, mut reply: Option<(RequestId, Reply)>, out: &mut Vec<Action>) {
        match std::mem::replace(&mut self.phase, Phase::Fenced) {
            Phase::Fenced => {
                // The caller has carried out the fence: rejoin with a fresh
                // lease (only now, so the fence never touches the new one).
                let timing = *self.lease.timing();
                self.lease = Lease::new(timing);
                #[cfg(any(test, feature = "sim"))]
                if self.fence_at_ttl {
                    self.lease.mutate_fence_at_ttl();
                }
                // After a regression, not before its quarantine ends.
                let retry_at = match self.quarantine_until {
                    Some(until) if until > now => until,
                    _ => now,
                };
                self.phase = Phase::Joining {
                    retry_at,
                    waiting: None,
                };
                self.step(now, None, out);
            }
            Phase::Joining { retry_at, waiting } => {
                let retry = now + self.lease.timing().renew_interval();
                match waiting {
                    Some(o) => match reply.take() {
                        Some((id, answer)) if id == o.id => {
                            let Stage::Register(renewal) = o.stage else {
                                unreachable!("joining waits only for a registration")
                            };
                            match answer {
                                Reply::Registered(lease) => {
                                    self.lease.renewal_succeeded(renewal, now);
                                    self.phase = Phase::Member {
                                        lease,
                                        waiting: None,
                                    };
                                    out.push(Action::LeaseGranted(lease));
                                    // The first round starts at once.
                                    self.sync_now = true;
                                    self.step(now, None, out);
                                }
                                _ => {
                                    self.phase = Phase::Joining {
                                        retry_at: retry,
                                        waiting: None,
                                    }
                                }
                            }
                        }
                        _ if now >= o.deadline => {
                            self.phase = Phase::Joining {
                                retry_at: retry,
                                waiting: None,
                            }
                        }
                        _ => {
                            self.phase = Phase::Joining {
                                retry_at,
                                waiting: Some(o),
                            }
                        }
                    },
                    None if now >= retry_at => {
                        let renewal = self.lease.begin_renewal(now);
                        let o = self.send(now, Request::Register, Stage::Register(renewal), out);
                        self.phase = Phase::Joining {
                            retry_at,
                            waiting: Some(o),
                        };
                    }
                    None => {
                        self.phase = Phase::Joining {
                            retry_at,
                            waiting: None,
                        }
                    }
                }
            }
            Phase::Member { lease, waiting } => {
                // The fence point comes before anything else, answers too.
                if !self.lease.status(now).is_current() {
                    self.fence(now, FENCE_POINT_PASSED, out);
                    return;
                }
                self.phase = Phase::Member {
                    lease,
                    waiting: None,
                };
                let next = match waiting {
                    Some(o) => match reply.take() {
                        Some((id, answer)) if id == o.id => {
                            self.advance(now, lease, &o, answer, out)
                        }
                        _ if now >= o.deadline => {
                            let answer = Reply::Failed("no answer in time".to_owned());
                            self.advance(now, lease, &o, answer, out)
                        }
                        _ => Some(o),
                    },
                    None if self.sync_now || now >= self.lease.next_renewal_at() => {
                        self.sync_now = false;
                        if now >= self.lease.next_renewal_at() {
                            let renewal = self.lease.begin_renewal(now);
                            Some(self.send(
                                now,
                                Request::Renew(lease),
                                Stage::Renew(renewal, None),
                                out,
                            ))
                        } else {
                            Some(self.send(now, Request::Campaign(lease), Stage::Campaign, out))
                        }
                    }
                    None => None,
                };
                // A fence during the step replaced the phase; otherwise the
                // round goes on with `next`.
                if let Phase::Member { waiting, .. } = &mut self.phase {
                    *waiting = next;
                }
            }
        }
    }

    /// The answer to the round's request at `stage`: the round's next
    /// request, sent, if the round goes on. A renewal that is due goes
    /// before it; the round goes on from that step once the renewal
    /// succeeds (see [`Self::next_step`]).
    fn advance(
        &mut self,
        now: Instant,
        lease: LeaseId,
        asked: &Outstanding,
        answer: Reply,
        out: &mut Vec<Action>,
    ) -> Option<Outstanding> {
        let (request, stage) = self.next_step(now, lease, asked, answer, out)?;
        if now >= self.lease.next_renewal_at() && !matches!(stage, Stage::Renew(..)) {
            // The lease before the rest of the round: while the arbiter
            // fails or hangs (an etcd election: every request waits out its
            // deadline), each step can take a whole renewal interval, and a
            // round of five would hold the next renewal back for most of
            // the fence budget.
            let renewal = self.lease.begin_renewal(now);
            let then = Some(Box::new((request, stage)));
            let stage = Stage::Renew(renewal, then);
            return Some(self.send(now, Request::Renew(lease), stage, out));
        }
        Some(self.send(now, request, stage, out))
    }

    /// The answer to the round's request at `stage`, acted on: the round's
    /// next request and its stage, if the round goes on.
    fn next_step(
        &mut self,
        now: Instant,
        lease: LeaseId,
        asked: &Outstanding,
        answer: Reply,
        out: &mut Vec<Action>,
    ) -> Option<(Request, Stage)> {
        let (sent, stage) = (asked.sent, asked.stage.clone());
        if let Reply::Table(table) = &answer
            && let Err(r) = self.history.table(table, asked.asked_after)
        {
            out.extend(self.regressed(now, r));
            return None;
        }
        match (stage, answer) {
            (Stage::Renew(renewal, then), Reply::Renewed(mark)) => {
                if let Err(r) = self.history.renewed(lease, mark) {
                    out.extend(self.regressed(now, r));
                    return None;
                }
                if !self.lease.renewal_succeeded(renewal, now).is_current() {
                    self.fence(now, FENCE_POINT_PASSED, out);
                    return None;
                }
                // The step the renewal went before, if any; else the round
                // goes on as after any renewal.
                Some(then.map_or((Request::Campaign(lease), Stage::Campaign), |then| *then))
            }
            (Stage::Renew(..), Reply::LeaseExpired) => {
                self.fence(now, LEASE_EXPIRED, out);
                None
            }
            // A failed renewal starts the round again (the next renewal
            // goes first if it is due already: the arbiter held this one
            // to its deadline).
            (Stage::Renew(..), _) => Some((Request::Campaign(lease), Stage::Campaign)),
            (Stage::Campaign, Reply::Campaign(Some(term))) => {
                if let Err(r) = self.history.term(term) {
                    out.extend(self.regressed(now, r));
                    return None;
                }
                out.push(Action::Leader(Some(term)));
                Some((Request::LiveNodes, Stage::LeaderMembers(term)))
            }
            (Stage::Campaign, Reply::Campaign(None)) => {
                out.push(Action::Leader(None));
                Some((Request::LiveNodes, Stage::Members))
            }
            (Stage::LeaderMembers(term), Reply::Members(members)) => {
                // Only nodes that have used their lease get partitions: a
                // lease whose grant never reached its node is live but
                // serves nothing (see `Member::confirmed`).
                let targets = members
                    .iter()
                    .filter(|m| !m.leaving && m.confirmed)
                    .map(|m| m.node.clone())
                    .collect();
                let live = members.iter().map(|m| m.node.clone()).collect();
                Some((
                    Request::Table,
                    Stage::LeaderTable {
                        term,
                        live,
                        targets,
                    },
                ))
            }
            (
                Stage::LeaderTable {
                    term,
                    live,
                    targets,
                },
                Reply::Table(table),
            ) => {
                let changes = orphan_assignment(&table, &live, &targets);
                if changes.is_empty() {
                    out.push(Action::StartMoves(moves_by_owner(&table, &targets)));
                    Some((Request::LiveNodes, Stage::Members))
                } else {
                    Some((
                        Request::WriteTable(term, changes),
                        Stage::LeaderWrite { targets },
                    ))
                }
            }
            (Stage::LeaderWrite { targets }, Reply::Table(table)) => {
                out.push(Action::StartMoves(moves_by_owner(&table, &targets)));
                Some((Request::LiveNodes, Stage::Members))
            }
            (
                Stage::Campaign
                | Stage::LeaderMembers(_)
                | Stage::LeaderTable { .. }
                | Stage::LeaderWrite { .. },
                _,
            ) => Some((Request::LiveNodes, Stage::Members)),
            (Stage::Members, answer) => {
                if let Reply::Members(members) = answer {
                    out.push(Action::Members(members));
                }
                Some((Request::Table, Stage::Table))
            }
            (Stage::Table, answer) => {
                if let Reply::Table(table) = answer {
                    out.push(Action::AdoptTable {
                        table,
                        asked_at: sent,
                    });
                }
                out.push(Action::Ready);
                None
            }
            (Stage::Register(_), _) => unreachable!("a member does not register"),
        }
    }
}

/// The leader's graceful moves for `table`, grouped by the owner that must
/// make them.
fn moves_by_owner(
    table: &OwnershipTable,
    targets: &[NodeId],
) -> Vec<(NodeId, Vec<(PartitionId, NodeId)>)> {
    let mut by_owner: BTreeMap<NodeId, Vec<(PartitionId, NodeId)>> = BTreeMap::new();
    for m in rebalance_moves(table, targets, MOVES_PER_ROUND) {
        by_owner
            .entry(m.from)
            .or_default()
            .push((m.partition, m.to));
    }
    by_owner.into_iter().collect()
}

/// The partitions `me` gains if it adopts `newer` over `current`, or `None`
/// if `newer` is not newer (it must not be adopted). Survivors of gained
/// partitions in limbo must be reaped before `newer` routes anything.
pub fn gained_partitions(
    current: &OwnershipTable,
    newer: &OwnershipTable,
    me: &NodeId,
) -> Option<std::collections::BTreeSet<PartitionId>> {
    if newer.epoch() <= current.epoch() {
        return None;
    }
    Some(
        newer
            .iter()
            .filter(|(p, owner)| {
                owner.is_some_and(|a| &a.node == me)
                    && current.owner(*p).is_none_or(|a| &a.node != me)
            })
            .map(|(p, _)| p)
            .collect(),
    )
}

/// Whether `me` must kill its keys of `partition` under `table` (it no
/// longer owns the partition).
pub fn lost(table: &OwnershipTable, me: &NodeId, partition: PartitionId) -> bool {
    table.owner(partition).is_none_or(|a| &a.node != me)
}

#[cfg(test)]
#[path = "coordinator_tests.rs"]
mod tests;
