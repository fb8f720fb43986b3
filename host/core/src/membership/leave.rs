//! A graceful leave, as a step machine: mark this node as leaving at the
//! arbiter → read the live members → if another node can take over, let the
//! leader move every partition away (rounds every 50 ms) until this node owns
//! nothing, the leave's deadline passes, or a fence cuts it short → fence the
//! lease → release it. **The lease is fenced before it is released**: once
//! released, the arbiter lets others take whatever this node still owns. It
//! must not stop keys itself (the moves do, as every move).
//!
//! Every arbiter step is idempotent (a mark, a read, a release), so one that
//! is not answered in time or fails is sent again every [`LEAVE_RETRY`]: a
//! slow or briefly unreachable arbiter delays a leave, it does not fail it.
//! The mark and the read are retried until the leave's deadline; the release
//! for one lease TTL (past that the fenced lease lapses on its own).

use std::time::Duration;

use super::{Effect, Membership, OpId, OpKind};
use crate::arbiter::LeaseId;
use crate::coordinator::{Reply, Request};
use crate::time::Instant;

/// How often a leave waiting for its moves asks for a round.
pub const LEAVE_POLL: Duration = Duration::from_millis(50);

/// How long a leave waits before it sends a failed arbiter step again.
pub const LEAVE_RETRY: Duration = Duration::from_millis(200);

/// How a leave ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaveOutcome {
    /// The node left: its lease is fenced and released (or, if the arbiter
    /// never answered the release, fenced and left to lapse at its TTL).
    /// `no_other_node`: no other live node could take over, so nothing was
    /// handed off.
    Left {
        /// Whether no other live node could take over.
        no_other_node: bool,
        /// Whether the arbiter confirmed the release (else the lease lapses
        /// at its TTL, and others take over then).
        released: bool,
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
    /// The arbiter refused or did not answer the mark or the read until the
    /// leave's deadline: the node still holds its lease and serves, and may
    /// be marked as leaving.
    ArbiterFailed(String),
}

/// A leave in progress.
#[derive(Debug)]
pub(super) struct Leave {
    lease: LeaseId,
    deadline: Instant,
    phase: Phase,
    /// Why the last failed step failed (for the outcome, if none succeeds).
    failure: Option<String>,
}

#[derive(Debug)]
enum Phase {
    Marking(Step),
    Reading(Step),
    Handing {
        next_check: Instant,
    },
    Releasing {
        step: Step,
        /// The lease to give up (a fence during the leave may have been
        /// followed by a rejoin).
        release: LeaseId,
        /// Until when the release is sent again.
        until: Instant,
        others: bool,
        fenced: bool,
    },
}

/// One arbiter step: in flight as `op`, or waiting to be sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Sent(OpId),
    RetryAt(Instant),
}

impl Step {
    fn is(&self, op: OpId) -> bool {
        *self == Step::Sent(op)
    }
}

impl Leave {
    /// When the leave must look again: it waits for moves, or to send a
    /// failed step again.
    pub(super) fn next_check(&self) -> Option<Instant> {
        match self.phase {
            Phase::Handing { next_check } => Some(next_check),
            Phase::Marking(Step::RetryAt(at))
            | Phase::Reading(Step::RetryAt(at))
            | Phase::Releasing {
                step: Step::RetryAt(at),
                ..
            } => Some(at),
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
            phase: Phase::Marking(Step::Sent(op)),
            failure: None,
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
        let releasing = matches!(leave.phase, Phase::Releasing { .. });
        let (step, succeeded) = match (&mut leave.phase, &reply) {
            (Phase::Marking(step), Reply::Done) | (Phase::Reading(step), Reply::Members(_)) => {
                (step, true)
            }
            // A lease the arbiter already let expire is as good as released.
            (Phase::Releasing { step, .. }, Reply::Done | Reply::LeaseExpired) => (step, true),
            (Phase::Marking(step) | Phase::Reading(step) | Phase::Releasing { step, .. }, _) => {
                (step, false)
            }
            (Phase::Handing { .. }, _) => return,
        };
        if !step.is(op) {
            return;
        }
        if !succeeded {
            // Refused for good: this lease is not the arbiter's any more.
            if reply == Reply::LeaseExpired && !releasing {
                self.leave = None;
                return out.push(Effect::LeaveDone(LeaveOutcome::ArbiterFailed(
                    "the arbiter says the lease expired".to_owned(),
                )));
            }
            leave.failure = Some(match reply {
                Reply::Failed(why) => why,
                Reply::LeaseExpired => "the arbiter says the lease expired".to_owned(),
                other => format!("unexpected answer {other:?}"),
            });
            *step = Step::RetryAt(now + LEAVE_RETRY);
            return self.leave_check(now, out);
        }
        match (&leave.phase, reply) {
            (Phase::Marking(_), _) => {
                let read = self.leave_request(now, Request::LiveNodes, out);
                if let Some(leave) = self.leave.as_mut() {
                    leave.phase = Phase::Reading(Step::Sent(read));
                }
            }
            (Phase::Reading(_), Reply::Members(members)) => {
                let me = &self.cfg.me;
                let others = members.iter().any(|m| &m.node != me && !m.leaving);
                if others {
                    leave.phase = Phase::Handing { next_check: now };
                    self.leave_check(now, out);
                } else {
                    self.finish_leave(now, false, out);
                }
            }
            (Phase::Releasing { others, fenced, .. }, _) => {
                let outcome = released(*others, *fenced, true);
                self.leave = None;
                out.push(Effect::LeaveDone(outcome));
            }
            _ => {}
        }
    }

    /// Time passed: send a failed step again (or give up past its
    /// deadline); while waiting for the moves, finish once nothing is owned
    /// here (or a fence forgot the table), give up at the deadline, else
    /// ask for a round.
    pub(super) fn leave_check(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let Some(leave) = self.leave.as_mut() else {
            return;
        };
        let lease = leave.lease;
        match &mut leave.phase {
            Phase::Marking(Step::RetryAt(at)) | Phase::Reading(Step::RetryAt(at)) => {
                if now < *at {
                    return;
                }
                if now >= leave.deadline {
                    let why = leave.failure.take().unwrap_or_default();
                    self.leave = None;
                    return out.push(Effect::LeaveDone(LeaveOutcome::ArbiterFailed(why)));
                }
                let request = match leave.phase {
                    Phase::Marking(_) => Request::SetLeaving(lease),
                    _ => Request::LiveNodes,
                };
                let op = self.leave_request(now, request, out);
                if let Some(Phase::Marking(step) | Phase::Reading(step)) =
                    self.leave.as_mut().map(|l| &mut l.phase)
                {
                    *step = Step::Sent(op);
                }
            }
            Phase::Releasing {
                step: Step::RetryAt(at),
                release,
                until,
                others,
                fenced,
            } => {
                if now < *at {
                    return;
                }
                if now >= *until {
                    // The lease is fenced here and lapses at its TTL.
                    let outcome = released(*others, *fenced, false);
                    self.leave = None;
                    return out.push(Effect::LeaveDone(outcome));
                }
                let request = Request::Release(*release);
                let op = self.leave_request(now, request, out);
                if let Some(Phase::Releasing { step, .. }) =
                    self.leave.as_mut().map(|l| &mut l.phase)
                {
                    *step = Step::Sent(op);
                }
            }
            Phase::Handing { next_check } => {
                if now < *next_check {
                    return;
                }
                let fenced = self.lease != Some(lease) || self.fenced_this_lease;
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
            _ => {}
        }
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
        let until = now + self.cfg.timing.lease_ttl();
        if let Some(leave) = self.leave.as_mut() {
            leave.phase = Phase::Releasing {
                step: Step::Sent(op),
                release,
                until,
                others,
                fenced,
            };
        }
    }
}

/// How a leave that reached its release ended.
fn released(others: bool, fenced: bool, released: bool) -> LeaveOutcome {
    if fenced {
        LeaveOutcome::FencedWhileLeaving
    } else {
        LeaveOutcome::Left {
            no_other_node: !others,
            released,
        }
    }
}
