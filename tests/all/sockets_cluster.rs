//! WebSocket connections across the in-process cluster (`cluster.rs`: one
//! embedded arbiter, one stepped clock, real loopback sockets): what the
//! node holding a connection does when the key's owner changes in a way
//! only the ownership token shows. Cross-node rooms through graceful moves
//! and crashes of real processes are in `sockets_processes.rs`.

use std::time::Duration;

use fief::LeaseState;
use fief::core::{OwnershipToken, PartitionCount};
use fief_tests::{eventually_async, guests, ws};

use crate::cluster::{Cluster, PARTITIONS, STEP};

/// Real time for an outcome that takes a few socket checks (250 ms each).
const PATIENCE: Duration = Duration::from_secs(10);

/// How long before node `n1`'s expiry the leader is cut off the arbiter
/// (after its last renewal before it).
const TTL_SLACK: Duration = Duration::from_millis(500);

/// The owner of `key`'s partition per the arbiter, and its token.
async fn owner(c: &Cluster, key: &str) -> Option<(String, OwnershipToken)> {
    let partition = PartitionCount::new(PARTITIONS).unwrap().of(key);
    c.arbiter_table()
        .await
        .owner(partition)
        .map(|a| (a.node.to_string(), a.token))
}

/// The room's connections, as its owner `n<i>` counts them.
async fn connections(c: &Cluster, i: usize, room: &str) -> String {
    let reply = c.node(i).call("chat", room, b"connections".to_vec()).await;
    reply.map_or_else(|e| e.to_string(), |r| String::from_utf8_lossy(&r).into())
}

/// The room's owner fences and rejoins, and the leader gives the room back
/// to it: the same node, a new token. The fence made it forget the
/// connections attached to it, and the node holding one sees no other
/// owner in between (the partition is unowned meanwhile), so only the token
/// says the connection must be attached again. Without that (found by the
/// chat browser test on a loaded machine: a fence under a slow arbiter),
/// the room's messages missed the connection until its client next spoke.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_is_attached_again_when_its_owner_fences_and_gets_the_key_back() {
    let c = Cluster::start(2, &[("chat", guests::CHAT)]).await;
    c.stabilize().await;
    let room = c.key_owned_by(1).await;
    let said = c.node(0).call("chat", &room, b"say welcome".to_vec()).await;
    assert_eq!(said.map(String::from_utf8), Ok(Ok("0".to_owned())));
    let holder = c.serve_http(0).await;
    let mut ann = ws::connect(&holder.base, "chat", &room).await;
    // The history comes once the room took the connection.
    assert_eq!(ws::next_text(&mut ann, PATIENCE).await, "welcome");
    assert_eq!(c.node(1).status().attached_connections, 1);
    let (_, before) = owner(&c, &room).await.expect("n1 owns the room");

    // n1 fences just after its renewal; its lease expires at the arbiter,
    // and it may rejoin, one TTL later. The leader (n0) is cut off the
    // arbiter from just before then until n1 has rejoined (well within
    // its own lease), so n1 rejoins before the leader sees its partitions
    // orphaned: they go back unowned, and the leader, reconnected, gives
    // them to the least loaded node, n1.
    let expiry = c.arbiter_expiry(1);
    c.node(1).fence_now();
    c.advance_to(expiry - TTL_SLACK).await;
    c.set_arbiter_reachable(0, false);
    let rejoined = || c.node(1).status().lease == LeaseState::Current;
    for _ in 0..30 {
        if rejoined() {
            break;
        }
        c.advance(STEP).await;
    }
    assert!(rejoined(), "n1 rejoined within 3 s of its expiry");
    assert_eq!(
        owner(&c, &room).await,
        None,
        "n1's old partitions are unowned"
    );
    let status = c.node(1).status();
    assert_eq!(
        status.attached_connections, 0,
        "a fence forgets: {status:?}"
    );
    c.set_arbiter_reachable(0, true);
    for _ in 0..50 {
        if owner(&c, &room).await.is_some() {
            break;
        }
        c.advance(STEP).await;
    }
    let (node, after) = owner(&c, &room).await.expect("the room has an owner again");
    assert_eq!(node, "n1", "the leader gave the room back to n1");
    assert!(
        after > before,
        "under a new token: {after:?} after {before:?}"
    );

    // The holder attaches the connection again without a word from its
    // client, and the room's messages reach it.
    // (The clock moves on meanwhile, so that the holder learns the table.)
    eventually_async(PATIENCE, "the connection attached at n1 again", || async {
        c.advance(STEP).await;
        connections(&c, 1, &room).await == "1"
    })
    .await;
    let said = c.node(0).call("chat", &room, b"say hello".to_vec()).await;
    assert_eq!(said.map(String::from_utf8), Ok(Ok("1".to_owned())));
    assert_eq!(ws::next_text(&mut ann, PATIENCE).await, "hello");
    c.check();
}
