//! Durable key state on an in-process cluster with a controlled clock
//! (`cluster.rs`): the fence of storage commits by the ownership token
//! (issue "Durable per-key state, fenced by the ownership token", items 3
//! and 5). Each node reaches one shared store through a gate of its own
//! (`ControlledBackend::over`), so a test can hold one node's commits while
//! the cluster moves on.

use std::sync::Arc;

use fief::Error;
use fief::storage::{Backend, EmbeddedBackend};
use fief_tests::storage_backend::ControlledBackend;
use fief_tests::{eventually, guests};

use crate::cluster::{Cluster, MARGIN, PARTITIONS, REACT, RENEW, STEP};

const STORED: (&str, &str) = ("stored", guests::STORED_COUNTER);

/// Call the stored counter's `key` via node `i`.
async fn call(c: &Cluster, i: usize, key: &str, message: &str) -> Result<String, Error> {
    c.node(i)
        .call("stored", key, message.as_bytes().to_vec())
        .await
        .map(|reply| String::from_utf8(reply).expect("a UTF-8 reply"))
}

/// Two nodes over one store, each through its own gate.
async fn gated_cluster() -> (Cluster, Vec<Arc<ControlledBackend>>) {
    let shared: Arc<dyn Backend> =
        Arc::new(EmbeddedBackend::in_memory().expect("an in-memory store"));
    let gates: Vec<Arc<ControlledBackend>> = (0..2)
        .map(|_| ControlledBackend::over(shared.clone()))
        .collect();
    let stores = gates
        .iter()
        .map(|g| g.clone() as Arc<dyn Backend>)
        .collect();
    let c = Cluster::start_with_storage(&[STORED], stores).await;
    c.stabilize().await;
    (c, gates)
}

/// A stale owner's commit never lands once the new owner has loaded the
/// key. n0 counts a key to 2; its third `incr` is written and its commit
/// held in n0's gate; n0 is cut from the arbiter, fences (the held call
/// fails: no reply for an uncommitted write), and after expiry n1 takes the
/// key over, loads 2 (raising the partition's fence token in the store) and
/// counts to 4. Released, n0's commit of 3 is refused as stale: the count
/// stays 4. Without the fence token the late commit would set it back to 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_owners_held_commit_never_lands_after_the_new_owner_loaded() {
    let (c, gates) = gated_cluster().await;
    let key = c.key_owned_by(0).await;
    assert_eq!(call(&c, 0, &key, "incr").await.unwrap(), "1");
    assert_eq!(call(&c, 1, &key, "incr").await.unwrap(), "2");
    let expiry = c.arbiter_expiry(0);

    gates[0].set_held(true);
    let commits = gates[0].commits();
    let late = c.node(0).call("stored", &key, b"incr".to_vec());
    tokio::pin!(late);
    for _ in 0..500 {
        if gates[0].commits() > commits {
            break;
        }
        tokio::select! {
            early = &mut late => panic!("answered before its commit: {early:?}"),
            () = tokio::time::sleep(std::time::Duration::from_millis(20)) => {}
        }
    }
    assert!(gates[0].commits() > commits, "n0's commit reached its gate");
    c.set_arbiter_reachable(0, false);
    // The call may run inline on this task: keep polling it while the
    // clock reaches n0's fence point.
    let (refused, ()) = tokio::join!(
        tokio::time::timeout(REACT, &mut late),
        c.advance_to(expiry - MARGIN)
    );
    let refused = refused
        .expect("the held call ends at the fence, not when the store answers")
        .unwrap_err();
    eprintln!("the held incr failed at the fence: {refused}");
    assert!(c.node(0).keys().is_empty(), "n0 fenced and killed its key");

    // After n0's expiry n1 owns every partition and serves the key from the
    // store: what n0 committed, not what it held.
    c.advance_to(expiry + RENEW).await;
    eventually(REACT, "n1 owns every partition", || {
        c.node(1).status().partitions_owned == PARTITIONS as usize
    })
    .await;
    let mut first = call(&c, 1, &key, "get").await;
    for _ in 0..100 {
        if first.is_ok() {
            break;
        }
        c.advance(STEP).await;
        first = call(&c, 1, &key, "get").await;
    }
    assert_eq!(
        first.unwrap(),
        "2",
        "the new owner reads every acknowledged commit"
    );
    assert_eq!(call(&c, 1, &key, "incr").await.unwrap(), "3");
    assert_eq!(call(&c, 1, &key, "incr").await.unwrap(), "4");

    // n0's held commit goes to the store now, and is refused.
    gates[0].set_held(false);
    let mut metrics = String::new();
    for _ in 0..200 {
        metrics = c.node(0).metrics_text().await;
        if metrics.contains("fief_storage_commits_total{outcome=\"stale\"} 1") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        metrics.contains("fief_storage_commits_total{outcome=\"stale\"} 1"),
        "n0 counts its refused commit:\n{metrics}"
    );
    // The key's process on n1 is still live; a fresh one loads from the store.
    assert_eq!(call(&c, 1, &key, "get").await.unwrap(), "4");
    assert!(c.node(1).kill_key("stored", &key), "killing the key");
    let n1 = c.node(1);
    eventually(REACT, "the killed process is gone", || {
        !fief_tests::is_live(n1, "stored", &key)
    })
    .await;
    assert_eq!(
        call(&c, 1, &key, "get").await.unwrap(),
        "4",
        "the stale commit of 3 did not land"
    );
    c.check();
}
