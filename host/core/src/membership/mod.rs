//! The whole ownership protocol of one node, without I/O: its lease and
//! coordination round, its copy of the partition table and the order in
//! which it adopts a newer one, the partitions it is draining or unsure of,
//! its graceful moves out, its fence, its rejoin and its leave, and the
//! routing decision that follows from all of them.
//!
//! [`Membership`] is a state machine. Its inputs are the node's clock
//! ([`Membership::on_tick`]) and answers: the arbiter's (to the round's
//! requests, [`Membership::on_reply`]; to its own, [`Membership::on_op_reply`]),
//! a peer's ([`Membership::on_peer_done`]), and the executor's own
//! (keys stopped for a handoff, survivors reaped); plus requests from outside
//! (a leader asks for a move, a leave, a fence, a table refresh). Its outputs
//! are a closed set of [`Effect`]s for the caller to carry out. It never waits:
//! [`Membership::wake_at`] says when it must be ticked next. The node
//! (`host/src/node/coordination.rs`) executes it; the simulation
//! (`sim`) drives it unchanged, so what the simulation checks is this code.
//!
//! It must not read a clock, do I/O or decide anything about keys' code: it
//! names partitions, the executor finds their keys.
//!
//! The rules it holds, each also a check of the simulation:
//! - **Adoption in order**: a newer table is adopted only after every
//!   survivor in limbo of a partition it gains was reaped ([`Effect::Reap`]),
//!   and only under the lease it was read under.
//! - **Draining**: a partition being handed off is refused by routing from
//!   the moment the move begins ([`RoutingView`]) until it ends.
//! - **Unsure**: after a transfer whose answer was lost, its partitions are
//!   refused until a table read sent after the failure settles them.
//! - **Fence**: the table, the moves, the pending adoptions and the drains
//!   are forgotten at once; the next tick rejoins with a fresh lease.
//! - **Leave**: the lease is fenced before it is released.

mod leave;
mod moves;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use crate::arbiter::{LeaseId, Member, Term};
use crate::coordinator::{Action, Coordinator, Reply, Request, RequestId, gained_partitions};
use crate::history::Regression;
use crate::lease::{FenceGate, LeaseStatus, LeaseTiming, RenewalCounts};
use crate::ownership::{NodeId, OwnershipTable, Route, RouteRefusal};
use crate::partition::{PartitionCount, PartitionId};
use crate::time::Instant;

pub use leave::{LEAVE_RETRY, LeaveOutcome};

/// Why a node fenced when asked to from outside the round.
pub const FENCE_REQUESTED: &str = "requested";

/// Names one asynchronous effect, so its answer (or a late duplicate of it)
/// is matched to the step that asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpId(pub u64);

/// A fire-and-forget message to a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerMessage {
    /// As leader: hand these partitions of yours to these nodes.
    Move(Vec<(PartitionId, NodeId)>),
    /// Read the table now (a move changed it).
    Nudge,
}

/// How a graceful move to one target ended, for the handoff states the
/// executor collected for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveOutcome {
    /// The partitions are the target's: the states went with them.
    Handed,
    /// The partitions stay here: keep the states for the keys' next process.
    Kept,
    /// The ownership they were for ended (a fence, a leave): drop them.
    Dropped,
}

/// What the caller must do. Effects that carry an [`OpId`] must be answered
/// through the input the variant names; the others are done at once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// A request of the coordination round: answer with
    /// [`Membership::on_reply`].
    Arbiter {
        /// The id to answer with.
        id: RequestId,
        /// The request.
        request: Request,
    },
    /// A request of a move, a leave or a refresh: answer with
    /// [`Membership::on_op_reply`].
    ArbiterOp {
        /// The id to answer with.
        op: OpId,
        /// The request.
        request: Request,
    },
    /// Send a message to a peer; no answer is awaited.
    Peer {
        /// The peer.
        to: NodeId,
        /// Its address, as the arbiter lists it.
        addr: String,
        /// What to send.
        message: PeerMessage,
    },
    /// Stop every live key of `partitions` with `handoff` and keep their
    /// states under `move_id`; answer with [`Membership::on_keys_stopped`]
    /// once none is live. The partitions are already refused by routing.
    StopForHandoff {
        /// The id to answer with, and the move's id.
        op: OpId,
        /// The partitions being handed off.
        partitions: BTreeSet<PartitionId>,
    },
    /// Send the states kept under `move_id` (and any states waiting here for
    /// keys of `partitions`) to `to`; answer with
    /// [`Membership::on_peer_done`].
    SendHandoff {
        /// The id to answer with.
        op: OpId,
        /// The move the states were kept under.
        move_id: OpId,
        /// The target.
        to: NodeId,
        /// Its address.
        addr: String,
        /// The partitions handed off.
        partitions: BTreeSet<PartitionId>,
    },
    /// The move `move_id` ended: hand, keep or drop its states.
    MoveEnded {
        /// The move.
        move_id: OpId,
        /// How it ended.
        outcome: MoveOutcome,
    },
    /// Reap the survivors in limbo of `partitions` (a newer table gives them
    /// to this node); answer with [`Membership::on_reaped`] once they are
    /// gone. The table is adopted only then.
    Reap {
        /// The id to answer with.
        op: OpId,
        /// The partitions gained.
        partitions: BTreeSet<PartitionId>,
    },
    /// A lease was granted.
    LeaseGranted(LeaseId),
    /// The arbiter answered from before what this node has seen (it lost
    /// commits): report it to the operator. A [`Effect::Fence`] follows, and
    /// the node asks the arbiter for nothing for one lease TTL.
    ArbiterRegressed(Regression),
    /// Fence now: kill `terminate` keys, put survivors in limbo, drop the
    /// cache and waiting handoff states. The routing view is already empty.
    Fence {
        /// Why.
        cause: &'static str,
        /// The fenced lease's renewals (for the metrics).
        renewals: RenewalCounts,
        /// The fenced lease's fence point, if it had one: when the node
        /// stopped acting, if that has passed (say, during a pause).
        fence_point: Option<Instant>,
    },
    /// The table changed ([`Membership::table`]): kill the keys of
    /// partitions no longer owned, drop what is kept for them.
    TableChanged,
    /// The live members changed ([`Membership::members`]).
    MembersChanged,
    /// The refresh `op` ended; `changed`: a newer table was adopted.
    Refreshed {
        /// The refresh.
        op: OpId,
        /// Whether the table changed.
        changed: bool,
    },
    /// The leave ended.
    LeaveDone(LeaveOutcome),
    /// A round finished: the node has a table to route with.
    Ready,
}

/// What one node's membership runs with.
#[derive(Clone, Debug)]
pub struct MembershipConfig {
    /// This node.
    pub me: NodeId,
    /// The lease's timing.
    pub timing: LeaseTiming,
    /// The namespace's partition count.
    pub partitions: PartitionCount,
    /// How long a move's handoff or transfer may take before it is given up.
    pub step_timeout: Duration,
}

/// What routing needs, published as one value after every change: the
/// table, and the partitions it owns but must not serve (draining or
/// unsure). The routing rule lives here, once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutingView {
    table: OwnershipTable,
    held: BTreeSet<PartitionId>,
}

impl RoutingView {
    /// Nothing owned.
    pub fn new(partitions: PartitionCount) -> Self {
        RoutingView {
            table: OwnershipTable::new(partitions),
            held: BTreeSet::new(),
        }
    }

    /// The table.
    pub fn table(&self) -> &OwnershipTable {
        &self.table
    }

    /// Partitions owned but not served: being handed off, or unsure.
    pub fn held(&self) -> &BTreeSet<PartitionId> {
        &self.held
    }

    /// Where a message for `key` goes from `me`, with the lease `lease`:
    /// the table's decision ([`OwnershipTable::route`]), with a partition
    /// held here refused as unowned.
    pub fn route(&self, me: &NodeId, lease: LeaseStatus, key: &str) -> Route {
        match self.table.route(me, lease, key) {
            Route::Local { partition, .. } if self.held.contains(&partition) => {
                Route::Refuse(RouteRefusal::Unowned(partition))
            }
            route => route,
        }
    }
}

/// What an asynchronous effect in flight is for.
#[derive(Clone, Debug)]
enum OpKind {
    /// A step of the current move.
    Move,
    /// A reap before an adoption.
    Reap,
    /// A table read outside the round, under a lease.
    Refresh(Option<LeaseId>),
    /// A step of the leave.
    Leave,
}

#[derive(Clone, Debug)]
struct Op {
    kind: OpKind,
    /// Past it, the op is answered as failed ("no answer in time").
    deadline: Option<Instant>,
    /// The highest table epoch seen when it began: a table in its answer
    /// below it is a regression, one below a newer table seen since is not.
    asked_after: Option<u64>,
}

/// What follows an adoption once it is done.
#[derive(Clone, Copy, Debug)]
enum Then {
    /// The round's read: the round's [`Effect::Ready`] waits for it.
    Round,
    Refreshed(OpId),
    /// The current move's transfer was adopted.
    Moved,
}

/// A newer table waiting for its reap.
#[derive(Clone, Debug)]
struct Adoption {
    table: OwnershipTable,
    lease: Option<LeaseId>,
    reaping: BTreeSet<PartitionId>,
    then: Then,
}

/// One node's ownership protocol (see the module header).
#[derive(Debug)]
pub struct Membership {
    cfg: MembershipConfig,
    coord: Coordinator,
    lease: Option<LeaseId>,
    fenced_this_lease: bool,
    table: OwnershipTable,
    draining: BTreeSet<PartitionId>,
    unsure: BTreeMap<PartitionId, Instant>,
    view: Arc<RoutingView>,
    view_dirty: bool,
    members: BTreeMap<NodeId, Member>,
    leader: Option<Term>,
    /// Partitions whose survivors were reaped under this lease: no new
    /// survivor of them can appear before the next fence.
    reaped: BTreeSet<PartitionId>,
    adoptions: BTreeMap<OpId, Adoption>,
    ops: BTreeMap<OpId, Op>,
    next_op: u64,
    moves: moves::Moves,
    leave: Option<leave::Leave>,
    /// The node left: its coordinator is never ticked again.
    stopped: bool,
    /// A round ended while its table waited for a reap: say ready after.
    ready_pending: bool,
    /// The table read of a refresh in flight, and the refreshes waiting
    /// for its answer.
    refresh_in_flight: Option<(OpId, Vec<OpId>)>,
    /// The simulation's mutations of this state machine's rules (none
    /// outside it: only the `sim` feature can set them).
    mutations: Mutations,
}

/// Deliberate bugs in the rules above, for the simulation's mutation
/// checks: each must be caught by the checker. Only the `sim` feature (or
/// the crate's tests) can set them ([`Membership::mutate`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Mutations {
    /// A move serves its partitions again as soon as it sends the
    /// transfer, instead of after the transfer's table is adopted.
    pub drain_released_at_transfer: bool,
    /// A newer table is adopted without reaping its gained partitions'
    /// survivors first.
    pub adopt_without_reap: bool,
}

impl Membership {
    /// A node that has not joined yet; the first tick registers.
    pub fn new(cfg: MembershipConfig) -> Self {
        let coord = Coordinator::new(cfg.timing);
        Membership {
            table: OwnershipTable::new(cfg.partitions),
            view: Arc::new(RoutingView::new(cfg.partitions)),
            cfg,
            coord,
            lease: None,
            fenced_this_lease: false,
            draining: BTreeSet::new(),
            unsure: BTreeMap::new(),
            view_dirty: false,
            members: BTreeMap::new(),
            leader: None,
            reaped: BTreeSet::new(),
            adoptions: BTreeMap::new(),
            ops: BTreeMap::new(),
            next_op: 0,
            moves: moves::Moves::default(),
            leave: None,
            stopped: false,
            ready_pending: false,
            refresh_in_flight: None,
            mutations: Mutations::default(),
        }
    }

    /// Mutation for the simulation's checker test (see
    /// [`Coordinator::mutate_fence_at_ttl`]).
    #[cfg(any(test, feature = "sim"))]
    pub fn mutate_fence_at_ttl(&mut self) {
        self.coord.mutate_fence_at_ttl();
    }

    /// Break the rules named in `mutations` (the simulation's checks).
    #[cfg(any(test, feature = "sim"))]
    pub fn mutate(&mut self, mutations: Mutations) {
        self.mutations = mutations;
    }

    fn mutated(&self, pick: impl Fn(&Mutations) -> bool) -> bool {
        pick(&self.mutations)
    }

    // ---- Reading. ----

    /// This node.
    pub fn me(&self) -> &NodeId {
        &self.cfg.me
    }

    /// The lease's fence point as published for lock-free readers (the
    /// side-effect gate); it follows every lease across fences and rejoins.
    pub fn gate(&self) -> Arc<FenceGate> {
        self.coord.gate()
    }

    /// The lease's status at `now`.
    pub fn status(&mut self, now: Instant) -> LeaseStatus {
        self.coord.status(now)
    }

    /// The lease's timing.
    pub fn timing(&self) -> &LeaseTiming {
        self.coord.timing()
    }

    /// The current lease's fence point, if any renewal succeeded.
    pub fn fence_point(&self) -> Option<Instant> {
        self.coord.fence_point()
    }

    /// The current lease's renewals so far.
    pub fn renewal_counts(&self) -> RenewalCounts {
        self.coord.renewal_counts()
    }

    /// Take the current lease's renewal counts (for the fence's metrics).
    pub fn take_renewal_counts(&mut self) -> RenewalCounts {
        self.coord.take_renewal_counts()
    }

    /// The lease this node holds, once granted and until its fence.
    pub fn lease_id(&self) -> Option<LeaseId> {
        self.lease
    }

    /// Whether the current lease was fenced (reset when a new one is
    /// granted).
    pub fn fenced_this_lease(&self) -> bool {
        self.fenced_this_lease
    }

    /// The term this node leads in, if it leads.
    pub fn leader(&self) -> Option<Term> {
        self.leader
    }

    /// The live members as the arbiter last reported them.
    pub fn members(&self) -> &BTreeMap<NodeId, Member> {
        &self.members
    }

    /// This node's copy of the table.
    pub fn table(&self) -> &OwnershipTable {
        &self.table
    }

    /// What routing reads: the table and the partitions held back. A new
    /// value after every change (compare with [`Arc::ptr_eq`]).
    pub fn view(&self) -> Arc<RoutingView> {
        self.view.clone()
    }

    /// Where a message for `key` goes as of `now` (the simulation's router;
    /// the node routes on the published [`view`](Self::view) and gate).
    pub fn route(&mut self, now: Instant, key: &str) -> Route {
        let status = self.coord.status(now);
        self.view.route(&self.cfg.me, status, key)
    }

    /// Whether `move_id` (a [`Effect::StopForHandoff`]'s op) is still in
    /// progress: false once its [`Effect::MoveEnded`] was emitted.
    pub fn is_moving(&self, move_id: OpId) -> bool {
        self.moves.is_current(move_id)
    }

    /// Whether a leave is under way, or done.
    pub fn is_leaving(&self) -> bool {
        self.leave.is_some() || self.stopped
    }

    /// Whether the node left (nothing is coordinated any more).
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// When [`on_tick`](Self::on_tick) must be called next, at the latest;
    /// `None` once nothing is left to time (the node left and its release
    /// was answered).
    pub fn wake_at(&self) -> Option<Instant> {
        let coord = (!self.stopped).then(|| self.coord.wake_at());
        let ops = self.ops.values().filter_map(|o| o.deadline).min();
        let leave = self.leave.as_ref().and_then(leave::Leave::next_check);
        [coord, ops, leave].into_iter().flatten().min()
    }

    // ---- Inputs. ----

    /// Time has passed.
    pub fn on_tick(&mut self, now: Instant) -> Vec<Effect> {
        self.input(now, |m, now, out| m.leave_check(now, out))
    }

    /// The arbiter answered the round's request `id`.
    pub fn on_reply(&mut self, now: Instant, id: RequestId, reply: Reply) -> Vec<Effect> {
        let mut out = Vec::new();
        if !self.stopped {
            let actions = self.coord.on_reply(now, id, reply);
            self.carry(now, actions, &mut out);
        }
        self.expire(now, &mut out);
        self.publish();
        out
    }

    /// The arbiter answered `op` (a move's transfer, a leave's step, a
    /// refresh). Late and duplicate answers are ignored.
    pub fn on_op_reply(&mut self, now: Instant, op: OpId, reply: Reply) -> Vec<Effect> {
        self.input(now, |m, now, out| m.op_answered(now, op, reply, out))
    }

    /// A peer answered `op` (a handoff's states): `Ok` if it took them.
    pub fn on_peer_done(
        &mut self,
        now: Instant,
        op: OpId,
        result: Result<(), String>,
    ) -> Vec<Effect> {
        self.input(now, |m, now, out| {
            if m.ops.remove(&op).is_some() {
                m.handoff_answered(now, op, result.is_ok(), out);
            }
        })
    }

    /// The keys of the move `op` are stopped and their states kept.
    pub fn on_keys_stopped(&mut self, now: Instant, op: OpId) -> Vec<Effect> {
        self.input(now, |m, now, out| {
            if m.ops.remove(&op).is_some() {
                m.keys_stopped(now, op, out);
            }
        })
    }

    /// The survivors of the reap `op` are gone.
    pub fn on_reaped(&mut self, now: Instant, op: OpId) -> Vec<Effect> {
        self.input(now, |m, now, out| {
            m.ops.remove(&op);
            let Some(adoption) = m.adoptions.remove(&op) else {
                return;
            };
            if adoption.lease != m.lease || m.fenced_this_lease {
                // Read under a lease since fenced: not this node's table.
                m.then(now, adoption.then, false, out);
                return;
            }
            m.reaped.extend(adoption.reaping);
            m.adopt(now, adoption.table, adoption.then, out);
        })
    }

    /// A leader asks this node to hand `moves` (partitions it owns) to
    /// their targets. Moves run one target at a time, requests in order.
    pub fn on_move_request(
        &mut self,
        now: Instant,
        moves: Vec<(PartitionId, NodeId)>,
    ) -> Vec<Effect> {
        self.input(now, |m, now, out| m.request_moves(now, moves, out))
    }

    /// Start a round as soon as nothing is in flight (a peer changed the
    /// table).
    pub fn nudge(&mut self) {
        self.coord.nudge();
    }

    /// Read the table now, outside the round (a forwarded call found the
    /// owner gone): answered by [`Effect::Refreshed`] with the returned id.
    /// One read at a time: a refresh asked while one is in flight (many
    /// calls refused at once after a move) waits for that one's answer
    /// instead of sending its own.
    pub fn refresh_table(&mut self, now: Instant) -> (OpId, Vec<Effect>) {
        let mut id = OpId(0);
        let out = self.input(now, |m, now, out| {
            m.next_op += 1;
            id = OpId(m.next_op);
            // Nothing to adopt without a lease, or once the node left.
            if m.lease.is_none() || m.stopped {
                out.push(Effect::Refreshed {
                    op: id,
                    changed: false,
                });
            } else if let Some((_, followers)) = m.refresh_in_flight.as_mut() {
                followers.push(id);
            } else {
                let deadline = now + m.cfg.timing.renew_interval();
                m.ops.insert(
                    id,
                    Op {
                        kind: OpKind::Refresh(m.lease),
                        deadline: Some(deadline),
                        asked_after: m.coord.highest_epoch_seen(),
                    },
                );
                m.refresh_in_flight = Some((id, Vec::new()));
                out.push(Effect::ArbiterOp {
                    op: id,
                    request: Request::Table,
                });
            }
        });
        (id, out)
    }

    /// The refresh `op` ended: answer it and every refresh that waited on it.
    fn refreshed(&mut self, op: OpId, changed: bool, out: &mut Vec<Effect>) {
        out.push(Effect::Refreshed { op, changed });
        if self
            .refresh_in_flight
            .as_ref()
            .is_some_and(|(o, _)| *o == op)
            && let Some((_, followers)) = self.refresh_in_flight.take()
        {
            for f in followers {
                out.push(Effect::Refreshed { op: f, changed });
            }
        }
    }

    /// Fence now (an operator asked, the coordination loop crashed): as at
    /// the fence point. The next tick rejoins.
    pub fn fence_now(&mut self, now: Instant, cause: &'static str) -> Vec<Effect> {
        self.input(now, |m, now, out| {
            m.coord.fence_now(now);
            m.fence(now, cause, out);
            m.rejoin(now, out);
        })
    }

    /// Leave the cluster gracefully within `timeout`: mark this node as
    /// leaving, let the leader move every partition away, fence the lease,
    /// release it. Answered by [`Effect::LeaveDone`].
    pub fn begin_leave(&mut self, now: Instant, timeout: Duration) -> Vec<Effect> {
        self.input(now, |m, now, out| m.start_leave(now, timeout, out))
    }

    // ---- The machinery. ----

    /// Every input but a round's answer: the coordinator first (so the
    /// fence point is never missed), then ops past their deadline, then
    /// the input itself.
    fn input(
        &mut self,
        now: Instant,
        f: impl FnOnce(&mut Self, Instant, &mut Vec<Effect>),
    ) -> Vec<Effect> {
        let mut out = Vec::new();
        if !self.stopped {
            let actions = self.coord.on_tick(now);
            self.carry(now, actions, &mut out);
        }
        self.expire(now, &mut out);
        f(self, now, &mut out);
        self.publish();
        out
    }

    fn op(&mut self, kind: OpKind, deadline: Option<Instant>) -> OpId {
        self.next_op += 1;
        let id = OpId(self.next_op);
        let asked_after = self.coord.highest_epoch_seen();
        self.ops.insert(
            id,
            Op {
                kind,
                deadline,
                asked_after,
            },
        );
        id
    }

    /// Answer every op past its deadline as failed.
    fn expire(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let due: Vec<(OpId, OpKind)> = self
            .ops
            .iter()
            .filter(|(_, o)| o.deadline.is_some_and(|d| now >= d))
            .map(|(id, o)| (*id, o.kind.clone()))
            .collect();
        for (id, kind) in due {
            let failed = Reply::Failed("no answer in time".to_owned());
            match kind {
                OpKind::Move if self.moves.is_handing(id) => {
                    self.ops.remove(&id);
                    self.handoff_answered(now, id, false, out);
                }
                _ => self.op_answered(now, id, failed, out),
            }
        }
    }

    fn op_answered(&mut self, now: Instant, op: OpId, reply: Reply, out: &mut Vec<Effect>) {
        let Some(o) = self.ops.remove(&op) else {
            return;
        };
        // A table from before what this node has seen is no answer: the op
        // fails as if it were lost, then the node fences.
        let regression = match &reply {
            Reply::Table(table) => self.coord.check_table(table, o.asked_after).err(),
            _ => None,
        };
        let reply = match &regression {
            Some(r) => Reply::Failed(r.to_string()),
            None => reply,
        };
        self.op_kind_answered(now, op, o.kind, reply, out);
        if let Some(r) = regression {
            let actions = self.coord.regressed(now, r);
            self.carry(now, actions, out);
        }
    }

    fn op_kind_answered(
        &mut self,
        now: Instant,
        op: OpId,
        kind: OpKind,
        reply: Reply,
        out: &mut Vec<Effect>,
    ) {
        match kind {
            OpKind::Move => self.transfer_answered(now, op, reply, out),
            OpKind::Leave => self.leave_answered(now, op, reply, out),
            OpKind::Refresh(lease) => match reply {
                Reply::Table(table) if lease.is_some() && lease == self.lease => {
                    self.adopt(now, table, Then::Refreshed(op), out);
                }
                _ => self.refreshed(op, false, out),
            },
            OpKind::Reap => {}
        }
    }

    /// Carry out the coordinator's actions.
    fn carry(&mut self, now: Instant, actions: Vec<Action>, out: &mut Vec<Effect>) {
        let mut fenced = false;
        for action in actions {
            match action {
                Action::Send { id, request } => out.push(Effect::Arbiter { id, request }),
                Action::LeaseGranted(lease) => {
                    self.lease = Some(lease);
                    self.fenced_this_lease = false;
                    self.reaped.clear();
                    out.push(Effect::LeaseGranted(lease));
                }
                Action::Regressed(r) => out.push(Effect::ArbiterRegressed(r)),
                Action::Fence { cause } => {
                    self.fence(now, cause, out);
                    fenced = true;
                }
                Action::Leader(term) => self.leader = term,
                Action::Members(members) => {
                    let members: BTreeMap<NodeId, Member> =
                        members.into_iter().map(|m| (m.node.clone(), m)).collect();
                    if members != self.members {
                        self.members = members;
                        out.push(Effect::MembersChanged);
                    }
                }
                Action::AdoptTable { table, asked_at } => {
                    // A read sent after a transfer failed settles it: it
                    // reflects every change the arbiter committed before.
                    let before = self.unsure.len();
                    self.unsure.retain(|_, failed| *failed >= asked_at);
                    self.view_dirty |= self.unsure.len() != before;
                    self.adopt(now, table, Then::Round, out);
                }
                Action::StartMoves(by_owner) => {
                    for (owner, moves) in by_owner {
                        if owner == self.cfg.me {
                            self.request_moves(now, moves, out);
                        } else if let Some(addr) = self.addr_of(&owner) {
                            out.push(Effect::Peer {
                                to: owner,
                                addr,
                                message: PeerMessage::Move(moves),
                            });
                        }
                    }
                }
                // Ready once the round's table is adopted, reap and all.
                Action::Ready if self.round_adoption_pending() => self.ready_pending = true,
                Action::Ready => out.push(Effect::Ready),
            }
        }
        if fenced {
            self.rejoin(now, out);
        }
    }

    /// After a fence the coordinator rejoins at its next tick: now.
    fn rejoin(&mut self, now: Instant, out: &mut Vec<Effect>) {
        if !self.stopped {
            let actions = self.coord.on_tick(now);
            self.carry(now, actions, out);
        }
    }

    fn round_adoption_pending(&self) -> bool {
        self.adoptions
            .values()
            .any(|a| matches!(a.then, Then::Round))
    }

    /// Where the peers of `node` reach it, if the arbiter lists it.
    fn addr_of(&self, node: &NodeId) -> Option<String> {
        self.members.get(node).and_then(|m| m.peer_addr.clone())
    }

    /// Adopt `newer` if it is newer: reap the survivors of what it gains
    /// first (unless reaped already under this lease), then take it.
    fn adopt(&mut self, now: Instant, newer: OwnershipTable, then: Then, out: &mut Vec<Effect>) {
        let Some(gained) = gained_partitions(&self.table, &newer, &self.cfg.me) else {
            return self.then(now, then, false, out);
        };
        let reaping: BTreeSet<PartitionId> = gained.difference(&self.reaped).copied().collect();
        if !reaping.is_empty() && !self.mutated(|m| m.adopt_without_reap) {
            let op = self.op(OpKind::Reap, None);
            out.push(Effect::Reap {
                op,
                partitions: reaping.clone(),
            });
            self.adoptions.insert(
                op,
                Adoption {
                    table: newer,
                    lease: self.lease,
                    reaping,
                    then,
                },
            );
            return;
        }
        let changed = self.table.update_from(&newer);
        if changed {
            self.view_dirty = true;
            out.push(Effect::TableChanged);
        }
        self.then(now, then, changed, out);
    }

    fn then(&mut self, now: Instant, then: Then, changed: bool, out: &mut Vec<Effect>) {
        match then {
            Then::Round => {
                if std::mem::take(&mut self.ready_pending) {
                    out.push(Effect::Ready);
                }
            }
            Then::Refreshed(op) => self.refreshed(op, changed, out),
            Then::Moved => self.moved(now, out),
        }
    }

    /// Forget everything owned (idempotent per lease).
    fn fence(&mut self, now: Instant, cause: &'static str, out: &mut Vec<Effect>) {
        if self.fenced_this_lease {
            return;
        }
        self.fenced_this_lease = true;
        let fence_point = self.coord.fence_point();
        self.coord.fence_now(now);
        let renewals = self.coord.take_renewal_counts();
        self.lease = None;
        self.leader = None;
        self.unsure.clear();
        self.draining.clear();
        self.reaped.clear();
        self.ready_pending = false;
        self.table = OwnershipTable::new(self.cfg.partitions);
        self.view_dirty = true;
        // Pending adoptions and refreshes were under the ended lease.
        for (op, adoption) in std::mem::take(&mut self.adoptions) {
            self.ops.remove(&op);
            if let Then::Refreshed(r) = adoption.then {
                self.refreshed(r, false, out);
            }
        }
        self.abandon_moves(out);
        out.push(Effect::Fence {
            cause,
            renewals,
            fence_point,
        });
        // A leave waiting for its moves ends now: they cannot happen.
        self.leave_fenced(now, out);
    }

    /// Publish a new routing view if anything it shows changed.
    fn publish(&mut self) {
        if !std::mem::take(&mut self.view_dirty) {
            return;
        }
        let held = self
            .draining
            .iter()
            .chain(self.unsure.keys())
            .copied()
            .collect();
        let view = RoutingView {
            table: self.table.clone(),
            held,
        };
        if *self.view != view {
            self.view = Arc::new(view);
        }
    }
}
