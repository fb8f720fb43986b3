//! A Fief cluster on etcd (issue 23, item 1): three real `fief node`
//! processes whose arbiter is a real three-member etcd cluster
//! (`--arbiter etcd://…/prefix`), their modules and keys' state in
//! PostgreSQL (`--storage postgres://…`, which an etcd arbiter requires).
//! They serve calls with one owner per key, and keep serving (after at most
//! a rejoin) when etcd's raft leader is killed and when a Fief node is.
//!
//! Runs with the other process tests one at a time (`processes::SERIAL`);
//! PostgreSQL on 127.0.0.1:5432 and `/usr/bin/etcd` are needed.

use std::time::{Duration, Instant};

use fief::Instance;
use fief_tests::etcd::EtcdCluster;
use fief_tests::guests;
use fief_tests::multiprocess::{
    ClusterNode, NodeSpec, PG_ADDR, arbiter_url, drop_namespace, test_database, unique_namespace,
};

use crate::processes::{SERIAL, start_nodes, wait_settled};

/// How long the cluster may take to serve again after a failure (an etcd
/// election, a lease expiry, a rejoin).
const RECOVERY: Duration = Duration::from_secs(20);

/// Lease timings with a fence 7 s after the last renewal: longer than an
/// etcd election takes even on a loaded machine (its followers wait an
/// election timeout, 1 s by default, then vote; a split vote takes another
/// round), so losing etcd's leader costs renewals, not leases. The
/// defaults' 4 s hold an election of about 2 s; beside the other tests in
/// CI one took longer (`etcd_faults.rs`). (With `FAST_TIMINGS`, fencing
/// 1.5 s after the last renewal, every node fences during the election,
/// and rejoins.)
const TIMINGS: [&str; 6] = [
    "--lease-ttl",
    "8s",
    "--renew-interval",
    "1s",
    "--fence-margin",
    "1s",
];

fn spec(namespace: &str, node_id: &str, etcd: &EtcdCluster) -> NodeSpec {
    let mut extra_args: Vec<String> = TIMINGS.iter().map(|s| (*s).to_owned()).collect();
    extra_args.extend(["--storage".to_owned(), arbiter_url(PG_ADDR)]);
    NodeSpec {
        node_id: node_id.to_owned(),
        namespace: namespace.to_owned(),
        arbiter: etcd.url("fief-test"),
        deploy: vec![("counter".to_owned(), guests::COUNTER.to_owned())],
        extra_args,
    }
}

/// `incr` of `key` through `via` until it answers (at most [`RECOVERY`]).
async fn incr_eventually(via: &ClusterNode, key: &str) -> u64 {
    let deadline = Instant::now() + RECOVERY;
    loop {
        match via
            .call_within("counter", key, "incr", Duration::from_secs(2))
            .await
        {
            Ok(reply) => return reply.parse().expect("a count"),
            Err(e) => assert!(
                Instant::now() < deadline,
                "incr {key} via {} kept failing for {RECOVERY:?}: {e:?}",
                via.node_id
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Calls round-robin over `nodes` reach one process per key: each `incr`
/// is one more than the last.
async fn one_owner_counts(nodes: &[&ClusterNode], key: &str, calls: usize) {
    let first = incr_eventually(nodes[0], key).await;
    for i in 1..calls {
        let via = nodes[i % nodes.len()];
        let count = incr_eventually(via, key).await;
        assert_eq!(
            count,
            first + i as u64,
            "incr #{i} of {key} via {}: a second process counted",
            via.node_id
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fief_cluster_on_etcd_serves_calls_through_etcd_and_node_failures() {
    let _serial = SERIAL.lock().await;
    let db = test_database().await;
    let mut etcd = EtcdCluster::start(3).await;
    let namespace = unique_namespace("etcd-cluster");
    let specs: Vec<NodeSpec> = (1..=3)
        .map(|i| spec(&namespace, &format!("n{i}"), &etcd))
        .collect();
    let mut nodes = start_nodes(&specs).await;
    let all: Vec<&ClusterNode> = nodes.iter().collect();
    for key in ["alice", "bob", "carol"] {
        one_owner_counts(&all, key, 9).await;
    }

    // etcd loses its raft leader: the nodes' renewals wait for an election,
    // within their leases; no node fences, and the keys keep their processes.
    let leader = etcd.leader().await.expect("etcd has a leader");
    let before = incr_eventually(all[1], "alice").await;
    etcd.kill(leader);
    etcd.wait_healthy().await;
    // A renewal round after the election, in every node.
    tokio::time::sleep(Duration::from_secs(2)).await;
    wait_settled(&nodes).await;
    for node in &nodes {
        let status = node.status().await.expect("the node answers");
        assert_eq!(
            status["fences"], 0,
            "{} fenced while etcd elected a leader",
            node.node_id
        );
    }
    assert_eq!(incr_eventually(all[2], "alice").await, before + 1);
    one_owner_counts(&all, "alice", 6).await;
    etcd.restart(leader).await;

    // A Fief node is killed: its partitions move once etcd expires its
    // lease, and the survivors serve every key.
    nodes[0].kill9();
    let survivors: Vec<&ClusterNode> = nodes[1..].iter().collect();
    for key in ["alice", "bob", "carol"] {
        incr_eventually(survivors[0], key).await;
    }
    wait_settled(&nodes[1..]).await;
    for key in ["alice", "bob", "carol"] {
        one_owner_counts(&survivors, key, 4).await;
    }
    drop(nodes);
    drop(etcd);
    drop_namespace(&db, &namespace).await;
}

/// An etcd arbiter keeps no modules: a node without PostgreSQL storage
/// refuses to start, saying so; a malformed `etcd://` URL is refused with
/// what is wrong. Neither reaches etcd.
#[tokio::test]
async fn a_node_on_etcd_needs_postgres_storage_and_a_well_formed_url() {
    async fn start(arbiter: &str, storage: Option<&str>) -> String {
        let config = fief::NodeConfig {
            arbiter: arbiter.to_owned(),
            storage: storage.map(str::to_owned),
            ..fief_tests::test_config()
        };
        match Instance::start_embedded(config).await {
            Ok(_) => panic!("a node started on {arbiter} with storage {storage:?}"),
            Err(e) => e.to_string(),
        }
    }
    for storage in [None, Some("embedded"), Some("memory")] {
        let err = start("etcd://127.0.0.1:1/fief", storage).await;
        assert!(
            err.contains("etcd is not a blob store") && err.contains("--storage postgres://"),
            "storage {storage:?}: {err}"
        );
    }
    let err = start("etcd://127.0.0.1/fief", Some(&arbiter_url(PG_ADDR))).await;
    assert!(
        err.contains("not host:port") && err.contains("etcd://host:port"),
        "{err}"
    );
    let err = start("etcd://127.0.0.1:2379", Some(&arbiter_url(PG_ADDR))).await;
    assert!(err.contains("no key prefix"), "{err}");
}
