//! A graceful leave, as a step machine: mark this node as leaving at the
//! arbiter → read the live members → if another node can take over, let the
//! leader move every partition away (rounds every 50 ms) until this node owns
//! nothing, the leave's deadline passes, or a fence cuts it short → fence the
//! lease → release it. **The lease is fenced before it is released**: once
//! released, the arbiter lets others take whatever this node still owns. It
//! must not stop keys itself (the moves do, as every move).

use std::time::Duration;

use super::{Effect, Membership, OpId, OpKind};
use crate::arbiter::LeaseId;
use crate::coordinator::{Reply, Request};
use crate::time::Instant;

/// How often a leave waiting for its moves asks for a round.
pub const LEAVE_POLL: Duration = Duration::from_millis(50);

/// How a leave ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaveOutcome {
    /// The lease is released. `no_other_node`: no other live node could
    /// take over, so nothing was handed off.
    Left {
        /// Whether no other live node could take over.
        no_other_node: bool,
    },
    /// A fence came first: the lease is released, but the keys it still
    /// held were stopped by the fence, not handed off.
    FencedWhileLeaving,
    /// The partitions did not all move within the timeout; the node stays
    /// a member.
    TimedOut,
    /// The node holds no lease (not joined, or fenced).
    NotMember,
    /// A leave is already under way.
    AlreadyLeaving,
    /// The arbiter refused or did not answer.
    ArbiterFailed(String),
}

/// A leave in progress.
#[derive(Debug)]
pub(super) struct Leave {
    lease: LeaseId,
    deadline: Instant,
    phase: Phase,
}

#[derive(Debug)]
enum Phase {
    Marking(OpId),
    Reading(OpId),
    Handing {
        next_check: Instant,
    },
    Releasing {
        op: OpId,
        others: bool,
        fenced: bool,
    },
}

impl Leave {
    /// When the leave must look again, if it is waiting for moves.
    pub(super) fn next_check(&self) -> Option<Instant> {
        match self.phase {
            Phase::Handing { next_check } => Some(next_check),
            _ => None,
        }
    }
}

impl Membership {
    pub(super) fn start_leave(&mut self, now: Instant, timeout: Duration, out: &mut Vec<Effect>) {
        if self.leave.is_some() {
            return out.push(Effect::LeaveDone(LeaveOutcome::AlreadyLeaving));
        }
        let (Some(lease), false) = (self.lease, self.stopped) else {
            return out.push(Effect::LeaveDone(LeaveOutcome::NotMember));
        };
        let op = self.leave_request(now, Request::SetLeaving(lease), out);
        self.leave = Some(Leave {
            lease,
            deadline: now + timeout,
            phase: Phase::Marking(op),
        });
    }

    fn leave_request(&mut self, now: Instant, request: Request, out: &mut Vec<Effect>) -> OpId {
        let op = self.op(OpKind::Leave, Some(now + self.cfg.timing.renew_interval()));
        out.push(Effect::ArbiterOp { op, request });
        op
    }

    pub(super) fn leave_answered(
        &mut self,
        now: Instant,
        op: OpId,
        reply: Reply,
        out: &mut Vec<Effect>,
    ) {
        let Some(leave) = self.leave.as_mut() else {
            return;
        };
        let failed = |reply: Reply| match reply {
            Reply::Failed(why) => why,
            Reply::LeaseExpired => "the arbiter says the lease expired".to_owned(),
            other => format!("unexpected answer {other:?}"),
        };
        match (&leave.phase, reply) {
            (Phase::Marking(o), Reply::Done) if *o == op => {
                let read = self.leave_request(now, Request::LiveNodes, out);
                if let Some(leave) = self.leave.as_mut() {
                    leave.phase = Phase::Reading(read);
                }
            }
            (Phase::Reading(o), Reply::Members(members)) if *o == op => {
                let me = &self.cfg.me;
                let others = members.iter().any(|m| &m.node != me && !m.leaving);
                if others {
                    leave.phase = Phase::Handing { next_check: now };
                    self.leave_check(now, out);
                } else {
                    self.finish_leave(now, false, out);
                }
            }
            (
                Phase::Releasing {
                    op: o,
                    others,
                    fenced,
                },
                reply,
            ) if *o == op => {
                let outcome = match reply {
                    Reply::Done if *fenced => LeaveOutcome::FencedWhileLeaving,
                    Reply::Done => LeaveOutcome::Left {
                        no_other_node: !*others,
                    },
                    reply => LeaveOutcome::ArbiterFailed(failed(reply)),
                };
                self.leave = None;
                out.push(Effect::LeaveDone(outcome));
            }
            (Phase::Marking(o) | Phase::Reading(o), reply) if *o == op => {
                self.leave = None;
                out.push(Effect::LeaveDone(LeaveOutcome::ArbiterFailed(failed(
                    reply,
                ))));
            }
            _ => {}
        }
    }

    /// Waiting for the moves: done once nothing is owned here (or a fence
    /// forgot the table); given up at the deadline; else ask for a round.
    pub(super) fn leave_check(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let Some(leave) = self.leave.as_mut() else {
            return;
        };
        let Phase::Handing { next_check } = &mut leave.phase else {
            return;
        };
        if now < *next_check {
            return;
        }
        let fenced = self.lease != Some(leave.lease) || self.fenced_this_lease;
        if fenced || self.table.count_owned_by(&self.cfg.me) == 0 {
            return self.finish_leave(now, true, out);
        }
        if now >= leave.deadline {
            self.leave = None;
            return out.push(Effect::LeaveDone(LeaveOutcome::TimedOut));
        }
        *next_check = now + LEAVE_POLL;
        self.coord.nudge();
    }

    /// A fence came while the leave waited for its moves: finish it now
    /// (as fenced), without rejoining.
    pub(super) fn leave_fenced(&mut self, now: Instant, out: &mut Vec<Effect>) {
        if let Some(Leave {
            phase: Phase::Handing { next_check },
            ..
        }) = self.leave.as_mut()
        {
            *next_check = now;
            self.leave_check(now, out);
        }
    }

    /// Stop coordinating and serving (the lease fenced first), then release.
    fn finish_leave(&mut self, now: Instant, others: bool, out: &mut Vec<Effect>) {
        let Some(lease) = self.leave.as_ref().map(|l| l.lease) else {
            return;
        };
        let fenced = self.lease != Some(lease) || self.fenced_this_lease;
        self.coord.fence_now(now);
        self.stopped = true;
        self.abandon_moves(out);
        // A fence during the leave may have been followed by a rejoin: the
        // lease to give up is the one held now.
        let release = self.lease.unwrap_or(lease);
        let op = self.leave_request(now, Request::Release(release), out);
        if let Some(leave) = self.leave.as_mut() {
            leave.phase = Phase::Releasing { op, others, fenced };
        }
    }
}
