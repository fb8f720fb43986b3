//! Unit tests of the membership state machine: each rule of the module
//! header, step by step on a hand-driven clock.

use std::time::Duration;

use super::*;
use crate::partition::PartitionCount;

fn at(ms: u64) -> Instant {
    Instant::from_origin(Duration::from_millis(ms))
}

fn member(name: &str, addr: Option<&str>) -> Member {
    Member {
        node: NodeId::new(name),
        peer_addr: addr.map(str::to_owned),
        leaving: false,
        confirmed: true,
        leader: false,
        lease_remaining: Duration::from_secs(5),
    }
}

fn round_request(effects: &[Effect]) -> Option<(RequestId, Request)> {
    effects.iter().find_map(|e| match e {
        Effect::Arbiter { id, request } => Some((*id, request.clone())),
        _ => None,
    })
}

fn op_request(effects: &[Effect]) -> Option<(OpId, Request)> {
    effects.iter().find_map(|e| match e {
        Effect::ArbiterOp { op, request } => Some((*op, request.clone())),
        _ => None,
    })
}

/// A table of 4 partitions: `a` owns 0 and 1, `b` owns 2, `c` owns 3.
fn table() -> OwnershipTable {
    let mut t = OwnershipTable::new(PartitionCount::new(4).unwrap());
    t.reassign([
        (PartitionId(0), Some(NodeId::new("a"))),
        (PartitionId(1), Some(NodeId::new("a"))),
        (PartitionId(2), Some(NodeId::new("b"))),
        (PartitionId(3), Some(NodeId::new("c"))),
    ]);
    t
}

/// Node `a`, joined under lease 1 at 0 ms, one round done with `members`
/// and `table` (nothing to reap: a fresh node has no survivors, but the
/// gained partitions are reaped once all the same).
fn joined(members: Vec<Member>, table: OwnershipTable) -> Membership {
    let mut m = Membership::new(MembershipConfig {
        me: NodeId::new("a"),
        timing: LeaseTiming::default(), // ttl 5 s, margin 1 s, renew 1 s
        partitions: table.partitions(),
        step_timeout: Duration::from_secs(1),
    });
    let (id, req) = round_request(&m.on_tick(at(0))).unwrap();
    assert_eq!(req, Request::Register);
    let e = m.on_reply(at(1), id, Reply::Registered(LeaseId(1)));
    assert!(e.contains(&Effect::LeaseGranted(LeaseId(1))));
    let (id, _) = round_request(&e).unwrap();
    let (id, _) = round_request(&m.on_reply(at(2), id, Reply::Campaign(None))).unwrap();
    let e = m.on_reply(at(3), id, Reply::Members(members));
    assert!(e.contains(&Effect::MembersChanged));
    let (id, req) = round_request(&e).unwrap();
    assert_eq!(req, Request::Table);
    let e = m.on_reply(at(4), id, Reply::Table(table));
    let op = reap_of(&e).expect("the gained partitions are reaped first");
    assert!(
        !e.contains(&Effect::TableChanged),
        "adopted before the reap"
    );
    assert!(!e.contains(&Effect::Ready), "ready before the table");
    let e = m.on_reaped(at(5), op);
    assert!(e.contains(&Effect::TableChanged));
    assert!(e.contains(&Effect::Ready));
    m
}

fn reap_of(effects: &[Effect]) -> Option<OpId> {
    effects.iter().find_map(|e| match e {
        Effect::Reap { op, .. } => Some(*op),
        _ => None,
    })
}

fn local(m: &mut Membership, now: Instant, partition: u32) -> bool {
    // A key of the partition: find one by the hash.
    let key = (0..)
        .map(|i| format!("k{i}"))
        .find(|k| m.table().partitions().of(k) == PartitionId(partition))
        .unwrap();
    matches!(m.route(now, &key), Route::Local { .. })
}

fn three() -> Vec<Member> {
    vec![
        member("a", Some("a:1")),
        member("b", Some("b:1")),
        member("c", Some("c:1")),
    ]
}

#[test]
fn a_move_drains_stops_hands_transfers_adopts_then_releases_the_drain() {
    let mut m = joined(three(), table());
    assert!(local(&mut m, at(10), 0));
    let e = m.on_move_request(at(10), vec![(PartitionId(0), NodeId::new("b"))]);
    let Some(Effect::StopForHandoff {
        op: stop,
        partitions,
    }) = e.first().cloned()
    else {
        panic!("{e:?}")
    };
    assert_eq!(partitions, BTreeSet::from([PartitionId(0)]));
    assert!(!local(&mut m, at(11), 0), "drained from the move's start");
    assert!(local(&mut m, at(11), 1), "other partitions served");
    let e = m.on_keys_stopped(at(12), stop);
    let Some(Effect::SendHandoff {
        op: send,
        move_id,
        to,
        addr,
        ..
    }) = e.first().cloned()
    else {
        panic!("{e:?}")
    };
    assert_eq!((move_id, to.as_str(), addr.as_str()), (stop, "b", "b:1"));
    let e = m.on_peer_done(at(13), send, Ok(()));
    let (transfer, req) = op_request(&e).unwrap();
    assert_eq!(
        req,
        Request::Transfer(LeaseId(1), vec![(PartitionId(0), NodeId::new("b"))])
    );
    let mut after = table();
    after.hand_over([(PartitionId(0), NodeId::new("b"))]);
    let e = m.on_op_reply(at(14), transfer, Reply::Table(after.clone()));
    assert!(e.contains(&Effect::TableChanged));
    assert!(e.contains(&Effect::MoveEnded {
        move_id: stop,
        outcome: MoveOutcome::Handed
    }));
    assert!(e.contains(&Effect::Peer {
        to: NodeId::new("b"),
        addr: "b:1".to_owned(),
        message: PeerMessage::Nudge
    }));
    assert_eq!(m.table(), &after);
    assert!(m.view().held().is_empty());
}

/// The drift the issue found: one target without an address abandoned the
/// whole request in the node, only that target in the old simulation.
#[test]
fn a_target_without_an_address_is_skipped_and_the_others_still_move() {
    let mut members = three();
    members[1].peer_addr = None; // b
    let mut m = joined(members, table());
    let e = m.on_move_request(
        at(10),
        vec![
            (PartitionId(0), NodeId::new("b")),
            (PartitionId(1), NodeId::new("c")),
        ],
    );
    let Some(Effect::StopForHandoff { partitions, .. }) = e.first() else {
        panic!("{e:?}")
    };
    assert_eq!(
        partitions,
        &BTreeSet::from([PartitionId(1)]),
        "c's move goes on"
    );
    assert!(local(&mut m, at(11), 0), "b's partition is not drained");
}

#[test]
fn a_lost_transfer_answer_leaves_its_partitions_unsure_until_a_later_read() {
    let mut m = joined(three(), table());
    let e = m.on_move_request(at(10), vec![(PartitionId(0), NodeId::new("b"))]);
    let Some(Effect::StopForHandoff { op: stop, .. }) = e.first().cloned() else {
        panic!()
    };
    let Some(Effect::SendHandoff { op: send, .. }) =
        m.on_keys_stopped(at(11), stop).first().cloned()
    else {
        panic!()
    };
    let (transfer, _) = op_request(&m.on_peer_done(at(12), send, Ok(()))).unwrap();
    // No answer within the step timeout (1 s): the transfer is given up.
    assert_eq!(m.wake_at(), Some(at(12 + 1000)).min(m.wake_at()));
    let e = m.on_tick(at(1012));
    assert!(
        e.contains(&Effect::MoveEnded {
            move_id: stop,
            outcome: MoveOutcome::Kept
        }),
        "{e:?}"
    );
    assert!(!local(&mut m, at(1013), 0), "unsure: not served");
    // A late answer changes nothing.
    let mut after = table();
    after.hand_over([(PartitionId(0), NodeId::new("b"))]);
    m.on_op_reply(at(1014), transfer, Reply::Table(after.clone()));
    assert_eq!(m.table(), &table());
    // The renewal round at 1 s started before the failure: its read does
    // not settle it. Drive rounds until one sent after 1012 ms answers.
    let mut settled = false;
    let mut now = 1015;
    let mut renewals = 0;
    while now < 3500 && !settled {
        let e = m.on_tick(at(now));
        let mut pending = round_request(&e);
        while let Some((id, req)) = pending {
            let reply = match req {
                Request::Table => Reply::Table(table()),
                Request::LiveNodes => Reply::Members(three()),
                Request::Campaign(_) => Reply::Campaign(None),
                _ => {
                    renewals += 1;
                    Reply::Renewed(renewals)
                }
            };
            now += 1;
            pending = round_request(&m.on_reply(at(now), id, reply));
        }
        settled = local(&mut m, at(now), 0);
        now += 100;
    }
    assert!(
        settled,
        "a later read settles it (the table says it is still ours)"
    );
}

fn stopped_partitions(effects: &[Effect]) -> Option<BTreeSet<PartitionId>> {
    effects.iter().find_map(|e| match e {
        Effect::StopForHandoff { partitions, .. } => Some(partitions.clone()),
        _ => None,
    })
}

/// Move partition 0 of `m` to `b`; its transfer fails (no answer): the
/// partition is unsure.
fn lose_transfer_of_0(m: &mut Membership) {
    let e = m.on_move_request(at(10), vec![(PartitionId(0), NodeId::new("b"))]);
    let Some(Effect::StopForHandoff { op: stop, .. }) = e.first().cloned() else {
        panic!("{e:?}")
    };
    let Some(Effect::SendHandoff { op: send, .. }) =
        m.on_keys_stopped(at(11), stop).first().cloned()
    else {
        panic!()
    };
    let (transfer, _) = op_request(&m.on_peer_done(at(12), send, Ok(()))).unwrap();
    m.on_op_reply(at(13), transfer, Reply::Failed("no answer".to_owned()));
    assert!(!local(m, at(14), 0), "unsure");
    assert_eq!(m.table().owner(PartitionId(0)).unwrap().node.as_str(), "a");
}

/// Seed 34461's bug: an unsure partition is not moved again. Its transfer
/// may have committed (the answer was lost) and the target served its keys
/// from the states since; moved again, the sender's kept copies would be
/// valid there a second time. The others of the request move.
#[test]
fn an_unsure_partition_is_not_moved_until_a_read_settles_it() {
    let mut m = joined(three(), table());
    lose_transfer_of_0(&mut m);
    let again = vec![
        (PartitionId(0), NodeId::new("b")),
        (PartitionId(1), NodeId::new("b")),
    ];
    let e = m.on_move_request(at(15), again);
    assert_eq!(
        stopped_partitions(&e),
        Some(BTreeSet::from([PartitionId(1)])),
        "only the sure one moves: {e:?}"
    );
    // A request of the unsure one alone starts nothing.
    let mut m = joined(three(), table());
    lose_transfer_of_0(&mut m);
    let e = m.on_move_request(at(15), vec![(PartitionId(0), NodeId::new("b"))]);
    assert_eq!(stopped_partitions(&e), None, "{e:?}");
}

#[test]
fn a_newer_table_is_adopted_only_after_its_gained_partitions_are_reaped() {
    let mut m = joined(three(), table());
    // A refresh reads a table that gives `a` partition 3.
    let (op, e) = m.refresh_table(at(10));
    let (read, req) = op_request(&e).unwrap();
    assert_eq!((read, req), (op, Request::Table));
    let mut newer = table();
    newer.reassign([(PartitionId(3), Some(NodeId::new("a")))]);
    let e = m.on_op_reply(at(11), op, Reply::Table(newer.clone()));
    let Some(Effect::Reap {
        op: reap,
        partitions,
    }) = e.first().cloned()
    else {
        panic!("{e:?}")
    };
    assert_eq!(partitions, BTreeSet::from([PartitionId(3)]));
    assert_eq!(m.table(), &table(), "not adopted before the reap");
    assert!(!local(&mut m, at(12), 3));
    let e = m.on_reaped(at(12), reap);
    assert!(e.contains(&Effect::TableChanged));
    assert!(e.contains(&Effect::Refreshed { op, changed: true }));
    assert!(local(&mut m, at(13), 3));
}

#[test]
fn a_fence_drops_the_move_the_table_and_pending_adoptions_and_rejoins() {
    let mut m = joined(three(), table());
    let e = m.on_move_request(at(10), vec![(PartitionId(0), NodeId::new("b"))]);
    let Some(Effect::StopForHandoff { op: stop, .. }) = e.first().cloned() else {
        panic!()
    };
    assert!(m.is_moving(stop));
    let e = m.fence_now(at(20), FENCE_REQUESTED);
    assert!(e.contains(&Effect::MoveEnded {
        move_id: stop,
        outcome: MoveOutcome::Dropped
    }));
    assert!(!m.is_moving(stop), "ended: its states must not be kept");
    assert!(
        e.iter()
            .any(|e| matches!(e, Effect::Fence { cause, .. } if *cause == FENCE_REQUESTED))
    );
    assert_eq!(round_request(&e).map(|r| r.1), Some(Request::Register));
    assert_eq!(m.lease_id(), None);
    assert_eq!(m.view().table().count_owned_by(&NodeId::new("a")), 0);
    assert!(m.view().held().is_empty());
    // The stop's late answer starts nothing.
    assert!(m.on_keys_stopped(at(21), stop).is_empty());
    // Fenced once per lease: a second request changes nothing.
    assert!(
        !m.fence_now(at(22), FENCE_REQUESTED)
            .iter()
            .any(|e| matches!(e, Effect::Fence { .. }))
    );
}

#[test]
fn a_leave_waits_for_the_moves_then_fences_the_lease_before_releasing_it() {
    let mut m = joined(three(), table());
    let e = m.begin_leave(at(10), Duration::from_secs(3));
    let (op, req) = op_request(&e).unwrap();
    assert_eq!(req, Request::SetLeaving(LeaseId(1)));
    let (op, req) = op_request(&m.on_op_reply(at(11), op, Reply::Done)).unwrap();
    assert_eq!(req, Request::LiveNodes);
    let e = m.on_op_reply(at(12), op, Reply::Members(three()));
    assert!(op_request(&e).is_none(), "waits: a still owns partitions");
    assert!(m.is_leaving());
    // The leader moved everything away.
    let mut gone = table();
    gone.hand_over([
        (PartitionId(0), NodeId::new("b")),
        (PartitionId(1), NodeId::new("c")),
    ]);
    let (op, _) = m.refresh_table(at(20));
    m.on_op_reply(at(21), op, Reply::Table(gone));
    let e = m.on_tick(at(70));
    let (op, req) = op_request(&e).unwrap();
    assert_eq!(req, Request::Release(LeaseId(1)));
    assert!(
        m.gate().current_until().is_none_or(|u| at(70) >= u),
        "fenced before the release"
    );
    assert!(m.is_stopped());
    let e = m.on_op_reply(at(71), op, Reply::Done);
    assert_eq!(
        e,
        vec![Effect::LeaveDone(LeaveOutcome::Left {
            no_other_node: false,
            released: true,
        })]
    );
    assert_eq!(m.wake_at(), None);
    // A node that left reads no table any more.
    let (op, e) = m.refresh_table(at(80));
    assert_eq!(e, vec![Effect::Refreshed { op, changed: false }]);
}

#[test]
fn a_leave_that_cannot_finish_in_time_times_out_and_the_node_stays() {
    let mut m = joined(three(), table());
    let (op, _) = op_request(&m.begin_leave(at(10), Duration::from_millis(200))).unwrap();
    let (op, _) = op_request(&m.on_op_reply(at(11), op, Reply::Done)).unwrap();
    m.on_op_reply(at(12), op, Reply::Members(three()));
    let mut now = 12;
    let mut outcome = None;
    while outcome.is_none() && now < 1000 {
        now = m.wake_at().unwrap().since_origin().as_millis() as u64;
        outcome = m.on_tick(at(now)).into_iter().find_map(|e| match e {
            Effect::LeaveDone(o) => Some(o),
            _ => None,
        });
    }
    assert_eq!(outcome, Some(LeaveOutcome::TimedOut));
    assert!(!m.is_stopped());
    assert!(local(&mut m, at(now), 0));
}

/// The leave's outcome among `effects`, if it ended.
fn leave_done(effects: &[Effect]) -> Option<LeaveOutcome> {
    effects.iter().find_map(|e| match e {
        Effect::LeaveDone(o) => Some(o.clone()),
        _ => None,
    })
}

/// A slow or briefly unreachable arbiter delays a leave, it does not fail
/// it: a mark and a read not answered in time are sent again, and the leave
/// goes on.
#[test]
fn a_leave_sends_an_unanswered_mark_or_read_again_and_goes_on() {
    let mut m = joined(three(), table());
    let (op, req) = op_request(&m.begin_leave(at(10), Duration::from_secs(30))).unwrap();
    assert_eq!(req, Request::SetLeaving(LeaseId(1)));
    // No answer within the step's bound (the renewal interval, 1 s).
    let e = m.on_tick(at(1010));
    assert_eq!(leave_done(&e), None, "the leave goes on: {e:?}");
    assert!(op_request(&e).is_none(), "not at once: after LEAVE_RETRY");
    assert_eq!(m.wake_at(), Some(at(1010) + LEAVE_RETRY).min(m.wake_at()));
    let e = m.on_tick(at(1010) + LEAVE_RETRY);
    let (op2, req) = op_request(&e).expect("the mark, again");
    assert_eq!(req, Request::SetLeaving(LeaseId(1)));
    // The first attempt's late answer is not taken for the second's.
    assert!(op_request(&m.on_op_reply(at(1300), op, Reply::Done)).is_none());
    let (op, req) = op_request(&m.on_op_reply(at(1301), op2, Reply::Done)).unwrap();
    assert_eq!(req, Request::LiveNodes);
    // The read fails outright: read again.
    let e = m.on_op_reply(at(1302), op, Reply::Failed("connection reset".into()));
    assert_eq!(leave_done(&e), None);
    let (op, req) = op_request(&m.on_tick(at(1302) + LEAVE_RETRY)).unwrap();
    assert_eq!(req, Request::LiveNodes);
    let e = m.on_op_reply(at(1600), op, Reply::Members(three()));
    assert_eq!(leave_done(&e), None, "waits for the moves");
    assert!(m.is_leaving());
}

/// A mark that never gets through ends the leave at its deadline with the
/// arbiter's last error; a lease the arbiter says expired ends it at once.
#[test]
fn a_leave_the_arbiter_never_answers_fails_at_its_deadline() {
    let mut m = joined(three(), table());
    m.begin_leave(at(10), Duration::from_secs(2));
    let mut now = 10;
    let mut outcome = None;
    let mut marks = 0;
    while outcome.is_none() && now < 10_000 {
        now = m.wake_at().unwrap().since_origin().as_millis() as u64;
        let e = m.on_tick(at(now));
        if let Some((op, Request::SetLeaving(_))) = op_request(&e) {
            marks += 1;
            let e = m.on_op_reply(at(now), op, Reply::Failed("unreachable".into()));
            outcome = leave_done(&e);
        }
        outcome = outcome.or(leave_done(&e));
    }
    assert_eq!(
        outcome,
        Some(LeaveOutcome::ArbiterFailed("unreachable".into()))
    );
    assert!((2010..2010 + 300).contains(&now), "at the deadline: {now}");
    assert!(marks >= 4, "sent again meanwhile: {marks}");
    assert!(!m.is_stopped() && !m.is_leaving());

    let mut m = joined(three(), table());
    let (op, _) = op_request(&m.begin_leave(at(10), Duration::from_secs(30))).unwrap();
    assert_eq!(
        leave_done(&m.on_op_reply(at(11), op, Reply::LeaseExpired)),
        Some(LeaveOutcome::ArbiterFailed(
            "the arbiter says the lease expired".into()
        ))
    );
}

/// The release is sent again until it is answered; one the arbiter never
/// answers for a lease TTL ends the leave all the same (the lease is fenced
/// here and lapses at its TTL), said as `released: false`.
#[test]
fn a_release_the_arbiter_never_answers_is_retried_then_left_to_lapse() {
    let mut m = joined(three(), table());
    let (op, _) = op_request(&m.begin_leave(at(10), Duration::from_secs(30))).unwrap();
    let (op, _) = op_request(&m.on_op_reply(at(11), op, Reply::Done)).unwrap();
    // No other live node: straight to the release.
    let e = m.on_op_reply(at(12), op, Reply::Members(vec![member("a", None)]));
    let (op, req) = op_request(&e).unwrap();
    assert_eq!(req, Request::Release(LeaseId(1)));
    assert!(m.is_stopped());
    let e = m.on_op_reply(at(13), op, Reply::Failed("unreachable".into()));
    assert_eq!(leave_done(&e), None);
    let (op, req) = op_request(&m.on_tick(at(13) + LEAVE_RETRY)).unwrap();
    assert_eq!(req, Request::Release(LeaseId(1)));
    // Answered this time.
    assert_eq!(
        leave_done(&m.on_op_reply(at(300), op, Reply::Done)),
        Some(LeaveOutcome::Left {
            no_other_node: true,
            released: true
        })
    );

    let mut m = joined(three(), table());
    let (op, _) = op_request(&m.begin_leave(at(10), Duration::from_secs(30))).unwrap();
    let (op, _) = op_request(&m.on_op_reply(at(11), op, Reply::Done)).unwrap();
    m.on_op_reply(at(12), op, Reply::Members(vec![member("a", None)]));
    let mut now = 12;
    let mut outcome = None;
    while outcome.is_none() && now < 20_000 {
        now = m.wake_at().unwrap().since_origin().as_millis() as u64;
        outcome = leave_done(&m.on_tick(at(now)));
    }
    assert_eq!(
        outcome,
        Some(LeaveOutcome::Left {
            no_other_node: true,
            released: false
        })
    );
    // A lease TTL (5 s) after the first release, give or take a retry.
    assert!((5012..5012 + 1300).contains(&now), "{now}");
    assert_eq!(m.wake_at(), None);
}

/// A fence while the leave waits for its moves ends the leave at once, as
/// fenced, and the node does not rejoin: it releases and is done.
#[test]
fn a_fence_during_a_leave_ends_it_as_fenced_without_a_rejoin() {
    let mut m = joined(three(), table());
    let (op, _) = op_request(&m.begin_leave(at(10), Duration::from_secs(30))).unwrap();
    let (op, _) = op_request(&m.on_op_reply(at(11), op, Reply::Done)).unwrap();
    m.on_op_reply(at(12), op, Reply::Members(three()));
    let e = m.fence_now(at(20), FENCE_REQUESTED);
    assert!(
        !e.iter().any(|e| matches!(
            e,
            Effect::Arbiter {
                request: Request::Register,
                ..
            }
        )),
        "no rejoin: {e:?}"
    );
    let (op, req) = op_request(&e).unwrap();
    assert_eq!(req, Request::Release(LeaseId(1)));
    assert!(m.is_stopped());
    assert_eq!(
        m.on_op_reply(at(21), op, Reply::Done),
        vec![Effect::LeaveDone(LeaveOutcome::FencedWhileLeaving)]
    );
}

/// Many calls refused at once after a move each ask for a refresh: one
/// table read goes out, and its answer answers them all.
#[test]
fn refreshes_asked_while_one_is_in_flight_share_its_read() {
    let mut m = joined(three(), table());
    let (first, e) = m.refresh_table(at(10));
    assert_eq!(op_request(&e), Some((first, Request::Table)));
    let (second, e) = m.refresh_table(at(11));
    let (third, e3) = m.refresh_table(at(12));
    assert!(
        op_request(&e).is_none() && op_request(&e3).is_none(),
        "no second read"
    );
    let e = m.on_op_reply(at(13), first, Reply::Table(table()));
    for op in [first, second, third] {
        assert!(
            e.contains(&Effect::Refreshed { op, changed: false }),
            "{op:?}: {e:?}"
        );
    }
    // The next refresh reads again.
    let (fourth, e) = m.refresh_table(at(14));
    assert_eq!(op_request(&e), Some((fourth, Request::Table)));
}

/// Drives one round from `now` (a renewal is due) with the given answers;
/// returns every effect.
fn round(m: &mut Membership, now: u64, renewed: u64, table: OwnershipTable) -> Vec<Effect> {
    let mut all = Vec::new();
    let mut pending = round_request(&m.on_tick(at(now)));
    let mut t = now;
    while let Some((id, req)) = pending {
        let reply = match req {
            Request::Renew(_) => Reply::Renewed(renewed),
            Request::Campaign(_) => Reply::Campaign(None),
            Request::LiveNodes => Reply::Members(three()),
            Request::Table => Reply::Table(table.clone()),
            other => panic!("unexpected {other:?}"),
        };
        t += 1;
        let e = m.on_reply(at(t), id, reply);
        pending = round_request(&e);
        all.extend(e);
    }
    all
}

fn regressed(effects: &[Effect]) -> Option<Regression> {
    effects.iter().find_map(|e| match e {
        Effect::ArbiterRegressed(r) => Some(r.clone()),
        _ => None,
    })
}

fn fenced_for(effects: &[Effect]) -> Option<&'static str> {
    effects.iter().find_map(|e| match e {
        Effect::Fence { cause, .. } => Some(*cause),
        _ => None,
    })
}

/// Ticks from `from` to `to` (ms, every 100 ms): whether a registration
/// was sent.
fn registers_between(m: &mut Membership, from: u64, to: u64) -> Option<u64> {
    (from..to).step_by(100).find(|&t| {
        m.on_tick(at(t)).iter().any(|e| {
            matches!(
                e,
                Effect::Arbiter {
                    request: Request::Register,
                    ..
                }
            )
        })
    })
}

#[test]
fn a_renewal_mark_that_does_not_rise_fences_and_the_node_waits_a_ttl_to_rejoin() {
    let mut m = joined(three(), table());
    let e = round(&mut m, 1000, 4, table());
    assert_eq!(regressed(&e), None);
    assert!(local(&mut m, at(1500), 0));
    // The arbiter lost this lease's last renewal: the next one returns the
    // mark of the one before.
    let e = round(&mut m, 2000, 4, table());
    let r = regressed(&e).expect("the regression is reported");
    assert_eq!(
        r,
        Regression::Renewal {
            lease: LeaseId(1),
            seen: 4,
            got: 4
        }
    );
    assert_eq!(fenced_for(&e), Some(crate::coordinator::ARBITER_REGRESSED));
    assert!(!local(&mut m, at(2001), 0), "fenced: serves nothing");
    // No rejoin for one lease TTL (5 s): every lease the lost commits
    // renewed passes its fence point meanwhile.
    assert_eq!(registers_between(&mut m, 2002, 7000), None);
    assert!(registers_between(&mut m, 7000, 7200).is_some());
}

#[test]
fn a_table_below_the_epoch_seen_is_refused_and_fences() {
    let mut m = joined(three(), table());
    // A promoted standby that lost the table's last change: epoch 0.
    let e = round(&mut m, 1000, 1, OwnershipTable::new(table().partitions()));
    assert_eq!(regressed(&e), Some(Regression::Epoch { seen: 1, got: 0 }));
    assert_eq!(fenced_for(&e), Some(crate::coordinator::ARBITER_REGRESSED));
    assert!(!e.contains(&Effect::TableChanged), "never adopted");
    assert!(!local(&mut m, at(1100), 0));
    // Rejoined after the quarantine, an arbiter still behind is refused
    // again; one that has caught up is served by.
    let (id, _) = round_request(&m.on_tick(at(6100))).expect("rejoins");
    let e = m.on_reply(at(6101), id, Reply::Registered(LeaseId(2)));
    assert!(e.contains(&Effect::LeaseGranted(LeaseId(2))));
    let mut newer = table();
    newer.reassign([(PartitionId(3), Some(NodeId::new("b")))]);
    let mut pending = round_request(&e);
    while let Some((id, req)) = pending {
        let reply = match req {
            Request::Campaign(_) => Reply::Campaign(None),
            Request::LiveNodes => Reply::Members(three()),
            Request::Table => Reply::Table(newer.clone()),
            other => panic!("unexpected {other:?}"),
        };
        let e = m.on_reply(at(6102), id, reply);
        if let Some(op) = reap_of(&e) {
            m.on_reaped(at(6103), op);
        }
        assert_eq!(regressed(&e), None);
        pending = round_request(&e);
    }
    assert!(local(&mut m, at(6200), 0), "epoch 2 is past what it saw");
}

#[test]
fn a_read_overtaken_by_a_newer_table_is_no_regression() {
    let mut m = joined(three(), table());
    // A refresh reads the table at epoch 1 …
    let (refresh, e) = m.refresh_table(at(900));
    let (op, req) = op_request(&e).expect("the refresh reads the table");
    assert_eq!(req, Request::Table);
    // … the round meanwhile reads epoch 2 (another node's change) …
    let mut newer = table();
    newer.reassign([(PartitionId(3), Some(NodeId::new("b")))]);
    let e = round(&mut m, 1000, 1, newer);
    assert_eq!(regressed(&e), None);
    assert_eq!(m.table().epoch(), 2);
    // … and then the refresh answers with what it read: older, not lost.
    let e = m.on_op_reply(at(1100), op, Reply::Table(table()));
    assert_eq!(regressed(&e), None, "{e:?}");
    assert_eq!(fenced_for(&e), None);
    assert!(e.contains(&Effect::Refreshed {
        op: refresh,
        changed: false
    }));
    assert!(local(&mut m, at(1200), 0), "still serving");
}
