//! Unit tests of the coordination round (`coordinator.rs`), on a
//! hand-driven clock.

use super::*;
use std::time::Duration;

fn at(ms: u64) -> Instant {
    Instant::from_origin(Duration::from_millis(ms))
}

fn sent(actions: &[Action]) -> Option<(RequestId, Request)> {
    actions.iter().find_map(|a| match a {
        Action::Send { id, request } => Some((*id, request.clone())),
        _ => None,
    })
}

#[test]
fn joins_then_runs_a_round_and_fences_at_the_fence_point() {
    let mut c = Coordinator::new(LeaseTiming::default()); // ttl 5 s, margin 1 s, renew 1 s
    let (id, req) = sent(&c.on_tick(at(0))).unwrap();
    assert_eq!(req, Request::Register);
    let actions = c.on_reply(at(10), id, Reply::Registered(LeaseId(7)));
    assert!(actions.contains(&Action::LeaseGranted(LeaseId(7))));
    let (id, req) = sent(&actions).unwrap();
    assert_eq!(req, Request::Campaign(LeaseId(7)));
    let actions = c.on_reply(at(20), id, Reply::Campaign(None));
    let (id, req) = sent(&actions).unwrap();
    assert_eq!(req, Request::LiveNodes);
    let (id, req) = sent(&c.on_reply(at(30), id, Reply::Members(vec![]))).unwrap();
    assert_eq!(req, Request::Table);
    let actions = c.on_reply(at(40), id, Reply::Failed("down".to_owned()));
    assert_eq!(actions, vec![Action::Ready]);
    assert_eq!(c.wake_at(), at(1000));
    // Every renewal from now on goes unanswered: the fence comes at 4 s.
    let mut now = 1000;
    while now < 4000 {
        c.on_tick(at(now));
        now = c.wake_at().since_origin().as_millis() as u64;
    }
    assert_eq!(now, 4000);
    let actions = c.on_tick(at(4000));
    assert_eq!(
        actions,
        vec![Action::Fence {
            cause: FENCE_POINT_PASSED
        }]
    );
    // The next tick rejoins with a fresh lease.
    let (_, req) = sent(&c.on_tick(at(4000))).unwrap();
    assert_eq!(req, Request::Register);
    assert_eq!(c.status(at(4000)), LeaseStatus::Pending);
}

#[test]
fn an_answer_after_the_fence_point_is_not_used() {
    let mut c = Coordinator::new(LeaseTiming::default());
    let (id, _) = sent(&c.on_tick(at(0))).unwrap();
    let (id2, _) = sent(&c.on_reply(at(0), id, Reply::Registered(LeaseId(1)))).unwrap();
    // The campaign's answer comes back after the fence point (4 s).
    let actions = c.on_reply(at(4001), id2, Reply::Campaign(Some(Term(1))));
    assert_eq!(
        actions,
        vec![Action::Fence {
            cause: FENCE_POINT_PASSED
        }]
    );
}

/// A fence asked while the node is still joining does not poison the
/// registration in flight: its grant is used.
#[test]
fn a_fence_while_joining_keeps_the_registration_in_flight() {
    let mut c = Coordinator::new(LeaseTiming::default());
    let (id, req) = sent(&c.on_tick(at(0))).unwrap();
    assert_eq!(req, Request::Register);
    c.fence_now(at(5));
    let actions = c.on_reply(at(10), id, Reply::Registered(LeaseId(3)));
    assert!(
        actions.contains(&Action::LeaseGranted(LeaseId(3))),
        "{actions:?}"
    );
    assert!(!actions.iter().any(|a| matches!(a, Action::Fence { .. })));
    assert!(c.status(at(10)).is_current());
}

#[test]
fn a_refused_renewal_fences() {
    let mut c = Coordinator::new(LeaseTiming::default());
    let (id, _) = sent(&c.on_tick(at(0))).unwrap();
    let (id2, _) = sent(&c.on_reply(at(0), id, Reply::Registered(LeaseId(1)))).unwrap();
    // The round ends without answers; the renewal is due at 1 s.
    let mut now = 0;
    let mut pending = Some(id2);
    while let Some(id) = pending {
        let actions = c.on_reply(at(now), id, Reply::Failed("x".to_owned()));
        pending = sent(&actions).map(|(id, _)| id);
        now += 1;
    }
    let (id, req) = sent(&c.on_tick(at(1000))).unwrap();
    assert_eq!(req, Request::Renew(LeaseId(1)));
    let actions = c.on_reply(at(1001), id, Reply::LeaseExpired);
    assert_eq!(
        actions,
        vec![Action::Fence {
            cause: LEASE_EXPIRED
        }]
    );
    assert!(!c.status(at(1001)).is_current());
}

/// The leader's round, to its plan: `members` live, every partition of
/// `table` owned by "a" (the leader). Returns the moves it starts.
fn leader_plan(members: Vec<Member>, table: OwnershipTable) -> Vec<(PartitionId, NodeId)> {
    let mut c = Coordinator::new(LeaseTiming::default());
    let (id, _) = sent(&c.on_tick(at(0))).unwrap();
    let (id, _) = sent(&c.on_reply(at(1), id, Reply::Registered(LeaseId(1)))).unwrap();
    let (id, req) = sent(&c.on_reply(at(2), id, Reply::Campaign(Some(Term(1))))).unwrap();
    assert_eq!(req, Request::LiveNodes);
    let (id, req) = sent(&c.on_reply(at(3), id, Reply::Members(members))).unwrap();
    assert_eq!(req, Request::Table);
    c.on_reply(at(4), id, Reply::Table(table))
        .into_iter()
        .find_map(|a| match a {
            Action::StartMoves(moves) => Some(moves),
            _ => None,
        })
        .expect("the leader plans its moves")
        .into_iter()
        .flat_map(|(_, moves)| moves)
        .collect()
}

/// The leader moves partitions only to nodes that have used their
/// lease: a node whose join was granted but whose answer was lost holds
/// a live lease it does not know (its next joins are refused until that
/// one expires); a partition moved to it would be served by nobody, and
/// the states handed to it dropped (found by
/// `processes_fence::fenced_node_answers_and_rejoins_when_the_cut_heals`).
#[test]
fn the_leader_moves_nothing_to_a_lease_its_node_never_used() {
    let member = |name: &str, confirmed| Member {
        node: NodeId::new(name),
        peer_addr: Some(format!("{name}:1")),
        leaving: false,
        confirmed,
        leader: name == "a",
        lease_remaining: Duration::from_secs(5),
    };
    let table = || {
        let mut t = OwnershipTable::new(crate::PartitionCount::new(4).unwrap());
        let a = NodeId::new("a");
        t.reassign((0..4).map(|p| (PartitionId(p), Some(a.clone()))));
        t
    };
    let moves = leader_plan(vec![member("a", true), member("b", false)], table());
    assert!(moves.is_empty(), "moved to an unconfirmed lease: {moves:?}");
    let moves = leader_plan(vec![member("a", true), member("b", true)], table());
    assert!(
        !moves.is_empty() && moves.iter().all(|(_, to)| to.as_str() == "b"),
        "a confirmed member gets its share: {moves:?}"
    );
}

/// Fail every request of the round in progress, from `id` on.
fn end_round(c: &mut Coordinator, mut id: RequestId, now: u64) {
    while let Some((next, _)) = sent(&c.on_reply(at(now), id, Reply::Failed("x".to_owned()))) {
        id = next;
    }
}

/// The published gate says what `status` says, through a grant, a
/// renewal, a refused renewal, a fence by hand and a rejoin.
#[test]
fn the_gate_follows_the_lease() {
    let mut c = Coordinator::new(LeaseTiming::default()); // fence point: sent + 4 s
    let gate = c.gate();
    assert_eq!(gate.current_until(), None, "pending");
    let (id, _) = sent(&c.on_tick(at(0))).unwrap();
    assert_eq!(gate.current_until(), None, "registering");
    let (id, _) = sent(&c.on_reply(at(5), id, Reply::Registered(LeaseId(1)))).unwrap();
    assert_eq!(gate.current_until(), Some(at(4000)), "granted");
    end_round(&mut c, id, 10);
    let (id, req) = sent(&c.on_tick(at(1000))).unwrap();
    assert_eq!(req, Request::Renew(LeaseId(1)));
    let (id, _) = sent(&c.on_reply(at(1003), id, Reply::Renewed(1))).unwrap();
    assert_eq!(gate.current_until(), Some(at(5000)), "renewed at 1 s");
    end_round(&mut c, id, 1010);

    // A clone publishes to a gate of its own.
    let mut refused = c.clone();
    assert!(!Arc::ptr_eq(&refused.gate(), &gate));
    assert_eq!(refused.gate().current_until(), Some(at(5000)));
    // A refused renewal fences at once, long before the fence point.
    let (id, req) = sent(&refused.on_tick(at(2000))).unwrap();
    assert_eq!(req, Request::Renew(LeaseId(1)));
    refused.on_reply(at(2001), id, Reply::LeaseExpired);
    assert_eq!(refused.gate().current_until(), None, "refused: fenced");
    assert_eq!(
        gate.current_until(),
        Some(at(5000)),
        "the original is untouched"
    );

    // Fenced by hand; the next ticks carry out the fence and rejoin.
    c.fence_now(at(1500));
    assert_eq!(gate.current_until(), None, "fenced by hand");
    let fenced = c.on_tick(at(1500));
    assert!(matches!(fenced[..], [Action::Fence { .. }]), "{fenced:?}");
    let (id, req) = sent(&c.on_tick(at(1500))).unwrap();
    assert_eq!(req, Request::Register);
    assert_eq!(gate.current_until(), None, "rejoining");
    c.on_reply(at(1600), id, Reply::Registered(LeaseId(2)));
    assert_eq!(
        gate.current_until(),
        Some(at(5500)),
        "the new lease, sent at 1.5 s"
    );
}

/// Tick `c` at every instant it asks for from `from` until `until`, the
/// arbiter answering nothing (every request waits out its deadline); the
/// requests sent, with when.
fn hang_until(c: &mut Coordinator, from: u64, until: u64) -> Vec<(u64, RequestId, Request)> {
    let mut sends = Vec::new();
    let mut now = from;
    while now < until {
        if let Some((id, request)) = sent(&c.on_tick(at(now))) {
            sends.push((now, id, request));
        }
        // A wake in the past (a renewal overdue) is now.
        now = now.max(c.wake_at().since_origin().as_millis() as u64);
    }
    sends
}

/// While the arbiter hangs (an etcd election: every request waits out its
/// deadline), a renewal goes out every renewal interval, before the rest of
/// the round, and the round goes on from where it was once one succeeds.
/// With the round finished first, the renewal after the grant waited for
/// the campaign, the members and the table: one attempt in the 4 s to the
/// fence point, at 3 s (the etcd fault test's fence during an election).
#[test]
fn a_renewal_due_mid_round_goes_before_the_rest_of_the_round() {
    let mut c = Coordinator::new(LeaseTiming::default()); // fence point: sent + 4 s
    let (id, _) = sent(&c.on_tick(at(0))).unwrap();
    let (_, req) = sent(&c.on_reply(at(0), id, Reply::Registered(LeaseId(1)))).unwrap();
    assert_eq!(req, Request::Campaign(LeaseId(1)));
    let sends = hang_until(&mut c, 0, 3100);
    let renewals: Vec<(u64, RequestId)> = sends
        .iter()
        .filter(|(_, _, r)| *r == Request::Renew(LeaseId(1)))
        .map(|(t, id, _)| (*t, *id))
        .collect();
    let times: Vec<u64> = renewals.iter().map(|(t, _)| *t).collect();
    assert_eq!(times, vec![1000, 2000, 3000], "{sends:?}");
    // The arbiter is back: the renewal sent at 3 s succeeds, and the round
    // goes on with the step that renewal went before.
    let (_, last) = renewals[2];
    let actions = c.on_reply(at(3100), last, Reply::Renewed(1));
    assert_eq!(c.fence_point(), Some(at(7000)));
    let (id, req) = sent(&actions).unwrap();
    assert_eq!(req, Request::Campaign(LeaseId(1)));
    let (_, req) = sent(&c.on_reply(at(3200), id, Reply::Campaign(None))).unwrap();
    assert_eq!(req, Request::LiveNodes);
    // The members' read hangs past the next renewal's time: the renewal
    // goes first, then the read that was next, the table's.
    let (id, req) = sent(&c.on_tick(at(4200))).unwrap();
    assert_eq!(req, Request::Renew(LeaseId(1)));
    let (_, req) = sent(&c.on_reply(at(4250), id, Reply::Renewed(2))).unwrap();
    assert_eq!(req, Request::Table);
    assert_eq!(c.fence_point(), Some(at(8200)));
}
