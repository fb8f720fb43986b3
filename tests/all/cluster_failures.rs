//! Cluster ownership and failure tests on the in-process cluster of
//! `cluster.rs` (several nodes sharing the embedded arbiter and one stepped
//! clock, over real loopback sockets): calls reach one owner, and contract
//! §5 rows 1–4 and 8 (crash, node ↔ arbiter and node ↔ node partitions,
//! arbiter down, graceful leave); guarantees 1–4. Every test walks an exact
//! clock timeline and ends with [`Cluster::check`], the single-ownership
//! checks (see the module header of `cluster.rs`).

use std::sync::Mutex;
use std::time::Duration;

use fief::core::NodeId;
use fief::{Error, LeaseState, Status};
use fief_tests::{eventually, eventually_async, guests};

use crate::cluster::{COUNTER, Cluster, MARGIN, PARTITIONS, REACT, RENEW, STEP, TTL, secs};

/// Node `status` is not current and shows at least `fences` fences: it
/// serves nothing and holds no key. (After a fence the node at once starts
/// rejoining with a fresh lease, so `status` reports `Pending` until the
/// arbiter grants one; `Fenced` shows only in between.)
fn assert_fenced(status: &Status, fences: u64) {
    assert_ne!(
        status.lease,
        LeaseState::Current,
        "{} must not be current",
        status.node_id
    );
    assert!(
        status.fences >= fences,
        "{} fenced {} times, expected at least {fences}",
        status.node_id,
        status.fences
    );
    assert_eq!(status.lease_remaining_ms, 0);
    assert_eq!(status.live_keys, 0, "{} has live keys", status.node_id);
}

/// Wait (real time, bounded) until a call of `key` via node `i` succeeds;
/// return its reply.
async fn first_success(c: &Cluster, i: usize, key: &str, message: &str) -> String {
    let reply = Mutex::new(None);
    eventually_async(
        REACT,
        &format!("a call of {key} via n{i} succeeds"),
        || async {
            match c.call(i, key, message).await {
                Ok(r) => {
                    *reply.lock().unwrap() = Some(r);
                    true
                }
                Err(_) => false,
            }
        },
    )
    .await;
    reply.into_inner().unwrap().unwrap()
}

/// Calls through every node reach the one owner (guarantee 2, routing
/// single ownership; guarantee 1 by the checker), and nothing moves while
/// every node renews on time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_through_every_node_reach_one_owner() {
    let c = Cluster::start(3, &[COUNTER]).await;
    c.stabilize().await;
    assert!(
        c.owned().iter().all(|&n| n > 0),
        "every node owns partitions once settled: {:?}",
        c.owned()
    );
    for owner in 0..3 {
        let key = c.key_owned_by(owner).await;
        for i in 0..9 {
            let reply = c.call(i % 3, &key, "incr").await.unwrap();
            assert_eq!(reply, (i + 1).to_string(), "{key} via n{}", i % 3);
        }
        assert_eq!(
            c.live_on(&key),
            vec![owner],
            "{key} lives on its owner only"
        );
    }
    // Leases are renewed on time: nothing moves, nobody fences.
    let table = c.arbiter_table().await;
    c.advance(secs(12.0)).await;
    assert_eq!(c.arbiter_table().await, table);
    for (i, node) in c.running() {
        let status = node.status();
        assert_eq!(status.lease, LeaseState::Current, "n{i}");
        assert_eq!(status.fences, 0, "n{i}");
    }
    let summary = c.check();
    assert_eq!(summary.lives, 3, "one process per key, never restarted");
}

/// Contract §5 row 1, node crash: the crashed node's partitions (it is
/// also the leader) move only after the arbiter judges its lease expired;
/// until then its keys are served by nobody; then they come back on the
/// other nodes with their un-persisted state lost (guarantees 3 and 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_row1_node_crash_moves_partitions_only_after_arbiter_expiry() {
    let mut c = Cluster::start(3, &[COUNTER]).await;
    c.stabilize().await;
    assert!(c.node(0).status().leader_term.is_some(), "n0 leads");
    let key = c.key_owned_by(0).await;
    let other_key = c.key_owned_by(1).await;
    for i in 0..3 {
        assert_eq!(c.call(i, &key, "incr").await.unwrap(), (i + 1).to_string());
    }
    assert_eq!(c.live_on(&key), vec![0]);
    // n0 renewed just now: the arbiter expires it one TTL from now.
    let expiry = c.arbiter_expiry(0);
    assert_eq!(expiry, c.now() + TTL);
    let table = c.arbiter_table().await;

    c.crash(0).await;
    c.advance_to(expiry - secs(0.5)).await;
    // Just before expiry: nothing has moved and nobody serves n0's key...
    assert!(c.arbiter_live().await.contains(&"n0".to_owned()));
    assert_eq!(c.arbiter_table().await, table);
    for i in [1, 2] {
        let err = c.call(i, &key, "incr").await.unwrap_err();
        assert!(
            // A call on a connection the crash closes under it may have
            // been sent: `AnswerLost` (it says "maybe processed").
            matches!(
                err,
                Error::OwnerUnreachable { .. } | Error::AnswerLost { .. } | Error::Timeout(_)
            ),
            "via n{i}: {err}"
        );
    }
    assert!(c.live_on(&key).is_empty(), "no other node serves {key}");
    // ...while the other nodes' keys are served as usual.
    assert_eq!(c.call(2, &other_key, "incr").await.unwrap(), "1");

    // At expiry the survivors' renewal round elects a leader, which hands
    // n0's partitions out; one more round and every survivor knows.
    c.advance_to(expiry + RENEW).await;
    let owners = c.arbiter_owners().await;
    assert!(!owners.contains_key("n0"), "{owners:?}");
    assert_eq!(owners.values().sum::<usize>(), PARTITIONS as usize);
    eventually(REACT, "n1 and n2 own every partition", || {
        c.owned().iter().sum::<usize>() == PARTITIONS as usize
    })
    .await;

    // n0's key comes back on a survivor, from scratch.
    assert_eq!(first_success(&c, 1, &key, "incr").await, "1");
    assert_eq!(c.call(2, &key, "incr").await.unwrap(), "2");
    let owner = c.live_on(&key);
    assert!(owner == vec![1] || owner == vec![2], "{owner:?}");
    assert_eq!(c.lives.started_on("counter", &key).len(), 2);
    assert_eq!(c.call(1, &other_key, "incr").await.unwrap(), "2");
    c.check();
}

/// Contract §5 row 2, node ↔ arbiter partition: the node (also the leader)
/// fences at `TTL - margin` after its last good renewal and its keys die;
/// nobody takes over until the arbiter's expiry; reconnected, it rejoins
/// with a fresh lease and owns only what it is given anew (guarantee 3;
/// contract §2).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_row2_node_cut_from_arbiter_fences_before_takeover() {
    let c = Cluster::start(3, &[COUNTER]).await;
    c.stabilize().await;
    let key = c.key_owned_by(0).await;
    for i in 0..3 {
        assert_eq!(c.call(i, &key, "incr").await.unwrap(), (i + 1).to_string());
    }
    // n0 renewed just now: fence point 4 s from now, arbiter expiry 5 s.
    let expiry = c.arbiter_expiry(0);
    let fence_point = expiry - MARGIN;
    assert_eq!(fence_point, c.now() + TTL - MARGIN);
    let table = c.arbiter_table().await;
    let before = c.owned();
    c.set_arbiter_reachable(0, false);

    // Until its fence point n0 still serves: its lease is current.
    c.advance_to(fence_point - STEP).await;
    let status = c.node(0).status();
    assert_eq!(status.lease, LeaseState::Current);
    assert_eq!(status.lease_remaining_ms, STEP.as_millis());
    assert_eq!(c.call(0, &key, "incr").await.unwrap(), "4");
    assert_eq!(c.call(1, &key, "incr").await.unwrap(), "5");

    // At the fence point: fenced, the key killed, every call refused...
    c.advance_to(fence_point).await;
    assert_fenced(&c.node(0).status(), 1);
    assert!(c.node(0).keys().is_empty());
    assert_eq!(c.call(0, &key, "incr").await, Err(Error::Fenced));
    // ...and nothing reassigned: the arbiter still counts n0's lease.
    assert!(c.arbiter_live().await.contains(&"n0".to_owned()));
    assert_eq!(c.arbiter_table().await, table);
    for i in [1, 2] {
        assert!(c.call(i, &key, "incr").await.is_err(), "via n{i}");
        assert_eq!(c.node(i).status().partitions_owned, before[i], "n{i}");
    }
    assert!(c.live_on(&key).is_empty());

    // Still nothing just before the arbiter's expiry.
    c.advance_to(expiry - STEP).await;
    assert_eq!(c.arbiter_table().await, table);
    assert!(c.call(1, &key, "incr").await.is_err());
    assert!(c.live_on(&key).is_empty());

    // At expiry, n1 and n2 take over; the key starts from scratch.
    c.advance_to(expiry + RENEW).await;
    let takeover = c.arbiter_table().await;
    assert_eq!(takeover.count_owned_by(&NodeId::new("n0")), 0);
    eventually(REACT, "n1 and n2 own every partition", || {
        c.node(1).status().partitions_owned + c.node(2).status().partitions_owned
            == PARTITIONS as usize
    })
    .await;
    assert_eq!(first_success(&c, 1, &key, "incr").await, "1");
    assert_eq!(c.call(2, &key, "incr").await.unwrap(), "2");

    // Reconnected, n0 rejoins with a fresh lease; whatever it owns again was
    // given to it anew (a newer ownership token than the takeover's table).
    c.set_arbiter_reachable(0, true);
    c.advance(secs(2.0)).await;
    eventually(REACT, "n0 current again", || {
        c.node(0).status().lease == LeaseState::Current
    })
    .await;
    assert_eq!(c.node(0).status().fences, 1);
    assert!(c.arbiter_live().await.contains(&"n0".to_owned()));
    c.stabilize().await;
    let n0 = NodeId::new("n0");
    for (partition, owner) in c.arbiter_table().await.iter() {
        if let Some(owner) = owner.filter(|a| a.node == n0) {
            assert!(
                owner.token.0 > takeover.epoch(),
                "n0 owns {partition} under token {:?}, not newer than the takeover (epoch {})",
                owner.token,
                takeover.epoch()
            );
        }
    }
    // Through every node the calls reach the one live key, state intact.
    assert_eq!(first_success(&c, 0, &key, "incr").await, "3");
    assert_eq!(c.call(1, &key, "incr").await.unwrap(), "4");
    assert_eq!(c.live_on(&key).len(), 1);
    c.check();
}

/// Contract §5 row 2 and §2 ("after fencing, a node rejoins with a fresh
/// lease and owns only what the leader assigns it anew"), guarantee 2: a
/// node that rejoins after its partitions moved never routes with the table
/// it had before it fenced. Here the arbiter is slow to answer the rejoined
/// node's first table sync, so it holds a current lease before it has
/// learned the new table.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_row2_rejoined_node_never_serves_from_its_stale_table() {
    let c = Cluster::start(3, &[COUNTER]).await;
    c.stabilize().await;
    let key = c.key_owned_by(0).await;
    assert_eq!(c.call(0, &key, "incr").await.unwrap(), "1");
    let expiry = c.arbiter_expiry(0);
    c.set_arbiter_reachable(0, false);
    c.advance_to(expiry + RENEW).await;
    assert_eq!(first_success(&c, 1, &key, "incr").await, "1");
    let owner = c.live_on(&key);
    assert!(owner == vec![1] || owner == vec![2], "{owner:?}");

    // n0 reconnects; the arbiter grants its lease but holds its table sync.
    c.hold_campaign(0, true);
    c.set_arbiter_reachable(0, true);
    c.advance(RENEW).await;
    eventually(REACT, "n0 holds a fresh lease", || {
        c.node(0).status().lease == LeaseState::Current
    })
    .await;
    // Whatever n0 does with a call now, it must not serve the key itself.
    let via_n0 = c.call(0, &key, "incr").await;
    assert!(
        matches!(via_n0.as_deref(), Err(_) | Ok("2")),
        "via n0: {via_n0:?}; the key lives on {owner:?}"
    );
    assert_eq!(c.live_on(&key), owner, "the key lives only on its owner");
    let expected = if via_n0.is_ok() { "2" } else { "1" };
    assert_eq!(c.call(1, &key, "get").await.unwrap(), expected);

    c.hold_campaign(0, false);
    c.stabilize().await;
    c.check();
}

/// Contract §5 row 3, node ↔ node partition with the arbiter reachable,
/// injected with `Instance::set_peer_link`: routing fails closed (the call
/// errs), the cut-off node never serves the key itself, the owner keeps
/// serving it directly, and the link's return restores service (guarantee
/// 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_row3_peer_link_cut_fails_closed() {
    let c = Cluster::start(3, &[COUNTER]).await;
    c.stabilize().await;
    let key = c.key_owned_by(0).await;
    for i in 0..3 {
        assert_eq!(c.call(i, &key, "incr").await.unwrap(), (i + 1).to_string());
    }
    assert!(c.node(1).set_peer_link("n0", false).await);
    for attempt in 0..3 {
        let err = c.call(1, &key, "incr").await.unwrap_err();
        assert!(
            matches!(err, Error::OwnerUnreachable { .. }),
            "attempt {attempt} via n1: {err}"
        );
    }
    assert_eq!(c.live_on(&key), vec![0], "n1 never serves n0's key");
    // The owner still serves it directly, and n2 still reaches it.
    assert_eq!(c.call(0, &key, "incr").await.unwrap(), "4");
    assert_eq!(c.call(2, &key, "incr").await.unwrap(), "5");
    // The arbiter still counts everyone: nothing moves.
    let table = c.arbiter_table().await;
    c.advance(secs(3.0)).await;
    assert_eq!(c.arbiter_table().await, table);
    assert!(c.call(1, &key, "incr").await.is_err());

    assert!(c.node(1).set_peer_link("n0", true).await);
    assert_eq!(first_success(&c, 1, &key, "incr").await, "6");
    assert_eq!(c.live_on(&key), vec![0]);
    c.check();
}

/// Contract §5 row 3, node ↔ node partition with the arbiter reachable,
/// injected at the network level (a proxy in front of n0 drops every peer
/// connection and refuses new ones): calls via the other nodes fail closed
/// (an error, never a second owner), the owner keeps serving directly,
/// nothing moves while the arbiter still counts n0, and service through
/// the peers returns with the network (guarantee 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_row3_node_partition_fails_closed() {
    let c = Cluster::start_proxied(3, &[COUNTER]).await;
    c.stabilize().await;
    let key = c.key_owned_by(0).await;
    let other_key = c.key_owned_by(1).await;
    for i in 0..3 {
        assert_eq!(c.call(i, &key, "incr").await.unwrap(), (i + 1).to_string());
    }
    c.set_peer_reachable(0, false);
    for i in [1, 2] {
        for attempt in 0..2 {
            let err = c.call(i, &key, "incr").await.unwrap_err();
            assert!(
                // The first call may be sent on a connection the cut is
                // closing: `AnswerLost`; the count below shows it was not.
                matches!(
                    err,
                    Error::OwnerUnreachable { .. } | Error::AnswerLost { .. } | Error::Timeout(_)
                ),
                "attempt {attempt} via n{i}: {err}"
            );
        }
    }
    assert_eq!(c.live_on(&key), vec![0], "no peer serves n0's key");
    assert_eq!(c.call(0, &key, "incr").await.unwrap(), "4");
    // Keys of the other nodes are unaffected (n0's outgoing links work).
    assert_eq!(c.call(2, &other_key, "incr").await.unwrap(), "1");
    assert_eq!(c.call(0, &other_key, "incr").await.unwrap(), "2");

    // The arbiter still counts n0: nothing moves, peers keep failing closed.
    let table = c.arbiter_table().await;
    c.advance(secs(6.0)).await;
    assert_eq!(c.arbiter_table().await, table);
    assert!(c.call(1, &key, "incr").await.is_err());
    assert_eq!(c.call(0, &key, "incr").await.unwrap(), "5");
    assert_eq!(c.live_on(&key), vec![0]);

    c.set_peer_reachable(0, true);
    assert_eq!(first_success(&c, 1, &key, "incr").await, "6");
    assert_eq!(first_success(&c, 2, &key, "incr").await, "7");
    assert_eq!(c.live_on(&key), vec![0]);
    assert_eq!(c.lives.started_on("counter", &key), vec!["n0"]);
    c.check();
}

/// Contract §5 row 4, arbiter down for everyone: every node fences at its
/// fence point and nothing is served anywhere; when the arbiter returns,
/// the nodes rejoin and service resumes, with un-persisted state lost
/// (guarantees 3 and 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_row4_arbiter_down_fences_everyone_until_it_returns() {
    let c = Cluster::start(3, &[COUNTER]).await;
    c.stabilize().await;
    let keys = [
        c.key_owned_by(0).await,
        c.key_owned_by(1).await,
        c.key_owned_by(2).await,
    ];
    for key in &keys {
        assert_eq!(c.call(0, key, "incr").await.unwrap(), "1");
    }
    // Every node renewed just now: they all fence 4 s from now.
    let fence_point = c.arbiter_expiry(0) - MARGIN;
    c.set_arbiter_down(true);

    c.advance_to(fence_point - STEP).await;
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(c.call((i + 1) % 3, key, "incr").await.unwrap(), "2");
    }

    c.advance_to(fence_point).await;
    for (i, node) in c.running() {
        assert_fenced(&node.status(), 1);
        for key in &keys {
            assert_eq!(
                c.call(i, key, "incr").await,
                Err(Error::Fenced),
                "n{i} {key}"
            );
        }
    }
    assert!(keys.iter().all(|key| c.live_on(key).is_empty()));

    // Long past every expiry: still nobody serves (nobody can rejoin).
    c.advance(secs(5.0)).await;
    for (i, node) in c.running() {
        assert_fenced(&node.status(), 1);
        assert_eq!(
            c.call(i, &keys[0], "incr").await,
            Err(Error::Fenced),
            "n{i}"
        );
    }

    c.set_arbiter_down(false);
    c.advance(secs(2.0)).await;
    eventually(REACT, "every node current, every partition owned", || {
        c.running()
            .all(|(_, n)| n.status().lease == LeaseState::Current)
            && c.owned().iter().sum::<usize>() == PARTITIONS as usize
    })
    .await;
    c.stabilize().await;
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(first_success(&c, i, key, "incr").await, "1", "{key}");
        assert_eq!(c.call((i + 1) % 3, key, "incr").await.unwrap(), "2");
        assert_eq!(c.live_on(key).len(), 1);
    }
    c.check();
}

/// Contract §5 row 8, graceful leave: the leaving node's partitions move by
/// handoff (its keys stop with `handoff()` and their state reaches the new
/// owner's `init`); no key is ever served by two nodes, and a caller sees at
/// most brief errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_row8_leave_hands_keys_off_with_no_double_serve() {
    let c = Cluster::start(3, &[("counter", guests::COUNTER)]).await;
    c.stabilize().await;
    let key = c.key_owned_by(0).await;
    for n in 1..=5 {
        assert_eq!(c.call(1, &key, "incr").await.unwrap(), n.to_string());
    }
    assert_eq!(c.live_on(&key), vec![0]);

    // n0 leaves while the clock keeps moving (the leader plans the moves at
    // its rounds; the handoffs themselves run in real time).
    let leave = c.node(0).leave(Duration::from_secs(30));
    let clock = async {
        for _ in 0..100 {
            c.clock.advance(STEP);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let (left, ()) = tokio::join!(leave, clock);
    left.expect("n0 leaves");
    assert_eq!(c.node(0).status().partitions_owned, 0);
    assert!(
        !c.arbiter_live().await.contains(&"n0".to_owned()),
        "n0 released its lease"
    );
    assert!(c.node(0).keys().is_empty(), "n0 hosts nothing");

    // The count goes on where it was: the handoff state arrived.
    assert_eq!(c.call(1, &key, "incr").await.unwrap(), "6");
    assert_eq!(c.call(2, &key, "incr").await.unwrap(), "7");
    assert_eq!(c.live_on(&key).len(), 1);
    c.check();
}

/// A node that fences while it leaves does not report a graceful leave: the
/// fence forgets its table (so it "owns nothing") but its keys were stopped
/// by the fence, not handed off. Here its handoffs cannot happen (its links
/// to the other node are cut), so it is still leaving when it fences.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_that_fences_while_leaving_says_so() {
    let c = Cluster::start(2, &[("counter", guests::COUNTER)]).await;
    c.stabilize().await;
    let key = c.key_owned_by(0).await;
    assert_eq!(c.call(0, &key, "incr").await.unwrap(), "1");
    assert!(c.node(0).set_peer_link("n1", false).await);

    let leave = c.node(0).leave(Duration::from_secs(30));
    let fence = async {
        // Let the leave start waiting for its handoffs, then fence.
        for _ in 0..10 {
            c.clock.advance(STEP);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        c.node(0).fence_now();
    };
    let (left, ()) = tokio::join!(leave, fence);
    let err = left.expect_err("a leave cut short by a fence is not a graceful leave");
    assert!(matches!(err, fief::Error::FencedWhileLeaving), "{err}");
    assert!(err.to_string().contains("not handed off"), "{err}");
    // It has left all the same: its lease is released.
    assert!(
        !c.arbiter_live().await.contains(&"n0".to_owned()),
        "n0 released its lease"
    );
}
