//! The etcd arbiter (issue 23, item 1) against real etcd clusters of three
//! members (`fief_tests::etcd::EtcdCluster`): the arbiter contract
//! (contract §3), and what etcd adds — leases judged by etcd and their keys
//! gone with them, terms that are etcd revisions, a table and terms that
//! survive the loss of etcd's leader and a restart of every member, and
//! endpoints tried in turn when a member hangs.
//!
//! Expiry is etcd's, in real time: the TTLs are whole seconds (etcd's
//! minimum lease TTL is 2 s with default settings), and the waits are
//! generous.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fief::SteppedClock;
use fief::arbiter::{Arbiter, ArbiterError, EtcdArbiter, EtcdOptions, LocalArbiter, Term};
use fief::core::{NodeId, PartitionCount, PartitionId};
use fief_tests::etcd::EtcdCluster;
use fief_tests::multiprocess::unique_namespace;

use crate::arbiter::{PARTITIONS, Wait, contract};

/// A lease etcd grants as asked (its minimum with default settings).
const TTL: Duration = Duration::from_secs(2);

fn partitions() -> PartitionCount {
    PartitionCount::new(PARTITIONS).unwrap()
}

/// An etcd arbiter on `url` whose module store is in-process (a node uses
/// PostgreSQL's; these tests store no modules).
async fn connect_url(url: &str, ns: &str) -> EtcdArbiter {
    let modules = Arc::new(LocalArbiter::new(
        Arc::new(SteppedClock::default()),
        partitions(),
    ));
    let options = EtcdOptions {
        request_timeout: Duration::from_millis(500),
        ..EtcdOptions::default()
    };
    EtcdArbiter::connect(url, ns, partitions(), options, modules)
        .await
        .unwrap_or_else(|e| panic!("connecting to etcd at {url}: {e}"))
}

async fn connect(cluster: &EtcdCluster, ns: &str) -> EtcdArbiter {
    connect_url(&cluster.url("fief-test"), ns).await
}

/// `call` retried while etcd is unreachable (an election, a restart), for
/// at most `limit`; any other outcome at once.
async fn through_outage<T, F, Fut>(
    limit: Duration,
    what: &str,
    mut call: F,
) -> Result<T, ArbiterError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ArbiterError>>,
{
    let deadline = Instant::now() + limit;
    loop {
        match call().await {
            Err(ArbiterError::Unreachable(e)) if Instant::now() < deadline => {
                eprintln!("{what}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            outcome => return outcome,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_arbiter_keeps_the_contract() {
    let cluster = EtcdCluster::start(3).await;
    let ns = unique_namespace("etcd-contract");
    let arbiter = connect(&cluster, &ns).await;
    let wait: Wait = Box::new(|d| Box::pin(tokio::time::sleep(d)));
    contract(&arbiter, &ns, wait, TTL).await;
}

/// The leader key is attached to the leader's etcd lease: when the lease
/// expires the key is gone, another node's campaign wins, and its term (the
/// revision that created its key) is higher; the old term writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_key_vanishes_with_its_lease_and_the_next_campaign_gets_a_higher_term() {
    let cluster = EtcdCluster::start(3).await;
    let ns = unique_namespace("etcd-leader");
    let arbiter = connect(&cluster, &ns).await;
    let (a, b) = (NodeId::new("a"), NodeId::new("b"));
    // etcd measures a's lease from when the grant reaches it: after this.
    let expired = Instant::now() + TTL;
    let lease_a = arbiter.register(&ns, &a, TTL, None).await.unwrap();
    let lease_b = arbiter.register(&ns, &b, TTL, None).await.unwrap();
    let term1 = arbiter.campaign(&ns, &a, lease_a).await.unwrap().unwrap();
    assert_eq!(arbiter.campaign(&ns, &b, lease_b).await.unwrap(), None);
    let all: Vec<_> = (0..PARTITIONS)
        .map(|p| (PartitionId(p), Some(a.clone())))
        .collect();
    let epoch1 = arbiter.write_table(&ns, term1, all).await.unwrap().epoch();

    // a stops renewing; b goes on until etcd has revoked a's lease.
    let deadline = Instant::now() + TTL * 5;
    loop {
        arbiter.renew(&ns, &b, lease_b).await.unwrap();
        let live = arbiter.live_nodes(&ns).await.unwrap();
        if !live.iter().any(|m| m.node == a) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a's lease never expired: {live:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        Instant::now() >= expired,
        "a's member key went before its TTL was up"
    );
    assert_eq!(
        arbiter.renew(&ns, &a, lease_a).await,
        Err(ArbiterError::LeaseExpired(lease_a))
    );

    let term2 = arbiter
        .campaign(&ns, &b, lease_b)
        .await
        .unwrap()
        .expect("b leads once a's leader key is gone");
    assert!(term2 > term1, "terms rise: {term1:?} then {term2:?}");
    let live = arbiter.live_nodes(&ns).await.unwrap();
    assert!(live.iter().any(|m| m.node == b && m.leader), "{live:?}");
    let old = arbiter
        .write_table(&ns, term1, vec![(PartitionId(0), Some(b.clone()))])
        .await;
    assert_eq!(old, Err(ArbiterError::NotLeader(Some(term2))));
    // The new leader takes the dead node's partitions, at a higher epoch.
    let table = arbiter
        .write_table(&ns, term2, vec![(PartitionId(0), Some(b.clone()))])
        .await
        .unwrap();
    assert_eq!(table.owner(PartitionId(0)).unwrap().node, b);
    assert!(table.epoch() > epoch1);
    assert_eq!(table.owner(PartitionId(0)).unwrap().token.0, table.epoch());
}

/// Killing etcd's raft leader loses nothing the arbiter acknowledged: the
/// lease (etcd extends leases at an election), the leader key and its term,
/// the table and its epoch; renewal marks, terms and epochs only rise.
/// The same after every member is stopped and started again on its data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_survives_the_etcd_leader_being_killed() {
    const LONG_TTL: Duration = Duration::from_secs(6);
    const OUTAGE: Duration = Duration::from_secs(20);
    let mut cluster = EtcdCluster::start(3).await;
    let ns = unique_namespace("etcd-leader-killed");
    let arbiter = connect(&cluster, &ns).await;
    let (a, b) = (NodeId::new("a"), NodeId::new("b"));
    let lease_a = arbiter.register(&ns, &a, LONG_TTL, None).await.unwrap();
    let lease_b = arbiter.register(&ns, &b, LONG_TTL, None).await.unwrap();
    let term = arbiter.campaign(&ns, &a, lease_a).await.unwrap().unwrap();
    let all: Vec<_> = (0..PARTITIONS)
        .map(|p| (PartitionId(p), Some(a.clone())))
        .collect();
    let table = arbiter.write_table(&ns, term, all).await.unwrap();
    let mark = arbiter.renew(&ns, &a, lease_a).await.unwrap();

    let leader = cluster.leader().await.expect("the cluster has a leader");
    cluster.kill(leader);
    let mark2 = through_outage(OUTAGE, "renewing after the kill", || {
        arbiter.renew(&ns, &a, lease_a)
    })
    .await
    .expect("the lease survives the loss of etcd's leader");
    assert!(mark2 > mark, "renewal marks rise: {mark} then {mark2}");
    assert_eq!(
        arbiter.campaign(&ns, &a, lease_a).await.unwrap(),
        Some(term),
        "the leader key and its term survive"
    );
    assert_eq!(arbiter.table(&ns).await.unwrap(), table);
    through_outage(OUTAGE, "renewing b", || arbiter.renew(&ns, &b, lease_b))
        .await
        .expect("b's lease survives too");
    let table2 = arbiter
        .transfer(&ns, &a, lease_a, vec![(PartitionId(0), b.clone())])
        .await
        .unwrap();
    assert!(table2.epoch() > table.epoch());
    cluster.restart(leader).await;

    // Every member stopped and started again on its data.
    cluster.stop_all();
    assert!(matches!(
        arbiter.renew(&ns, &a, lease_a).await,
        Err(ArbiterError::Unreachable(_))
    ));
    cluster.start_all().await;
    let mark3 = through_outage(OUTAGE, "renewing after the restart", || {
        arbiter.renew(&ns, &a, lease_a)
    })
    .await
    .expect("the lease survives a restart of every member");
    assert!(mark3 > mark2, "renewal marks rise: {mark2} then {mark3}");
    assert_eq!(arbiter.table(&ns).await.unwrap(), table2);
    assert_eq!(
        arbiter.campaign(&ns, &a, lease_a).await.unwrap(),
        Some(term)
    );

    // A later leader's term and epochs are above everything before.
    arbiter.release(&ns, &a, lease_a).await.unwrap();
    through_outage(OUTAGE, "renewing b after the restart", || {
        arbiter.renew(&ns, &b, lease_b)
    })
    .await
    .expect("b's lease survives the restart");
    let term_b = arbiter.campaign(&ns, &b, lease_b).await.unwrap().unwrap();
    assert!(term_b > term, "terms rise: {term:?} then {term_b:?}");
    let table3 = arbiter
        .write_table(&ns, term_b, vec![(PartitionId(1), Some(b.clone()))])
        .await
        .unwrap();
    assert!(table3.epoch() > table2.epoch());
    assert!(table3.owner(PartitionId(1)).unwrap().token.0 > table2.epoch());
}

/// Two arbiters (two nodes' processes) on one etcd: a node id is refused
/// while its etcd lease is live, whichever process asks, and free again once
/// etcd has judged the lease expired, or at once after a release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_id_is_unique_while_its_etcd_lease_is_live() {
    let cluster = EtcdCluster::start(3).await;
    let ns = unique_namespace("etcd-unique");
    let (first, second) = (connect(&cluster, &ns).await, connect(&cluster, &ns).await);
    let a = NodeId::new("a");
    let lease1 = first.register(&ns, &a, TTL, None).await.unwrap();
    for _ in 0..3 {
        let err = second.register(&ns, &a, TTL, None).await.unwrap_err();
        assert!(
            matches!(&err, ArbiterError::Refused(why) if why.contains("unique")),
            "{err}"
        );
        first.renew(&ns, &a, lease1).await.unwrap();
        tokio::time::sleep(TTL / 2).await;
    }
    // The first stops renewing: the id is free once etcd expires the lease,
    // not before.
    // etcd measures the lease from when the keepalive reaches it: after this.
    let renewed = Instant::now();
    first.renew(&ns, &a, lease1).await.unwrap();
    let deadline = renewed + TTL * 5;
    let lease2 = loop {
        match second.register(&ns, &a, TTL, None).await {
            Ok(lease) => break lease,
            Err(ArbiterError::Refused(_)) => {
                assert!(Instant::now() < deadline, "the id never became free");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("registering a again: {e}"),
        }
    };
    assert!(
        renewed.elapsed() >= TTL,
        "the id was free {:?} after the last renewal, before the TTL",
        renewed.elapsed()
    );
    assert_ne!(lease2, lease1);
    assert_eq!(
        first.renew(&ns, &a, lease1).await,
        Err(ArbiterError::LeaseExpired(lease1))
    );
    // A release frees it at once; releasing again (or an old lease) is fine.
    second.release(&ns, &a, lease2).await.unwrap();
    second.release(&ns, &a, lease2).await.unwrap();
    first.release(&ns, &a, lease1).await.unwrap();
    let lease3 = first.register(&ns, &a, TTL, None).await.unwrap();
    // The old lease releases nothing of the new one.
    second.release(&ns, &a, lease2).await.unwrap();
    first.renew(&ns, &a, lease3).await.unwrap();
}

/// A member that hangs (SIGSTOP: its sockets accept and answer nothing) is
/// skipped after one request's timeout: renewals go on through the next
/// endpoint, each in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_go_on_through_the_next_endpoint_when_a_member_hangs() {
    let cluster = EtcdCluster::start(3).await;
    let ns = unique_namespace("etcd-hang");
    let leader = cluster.leader().await.expect("a leader");
    let hung = (leader + 1) % cluster.len();
    // The hung member first in the URL: every request tries it first.
    let mut order = vec![hung];
    order.extend((0..cluster.len()).filter(|i| *i != hung));
    let endpoints: Vec<String> = order.iter().map(|i| cluster.endpoint(*i)).collect();
    let url = format!("etcd://{}/fief-test", endpoints.join(","));
    let arbiter = connect_url(&url, &ns).await;
    let a = NodeId::new("a");
    let lease = arbiter.register(&ns, &a, TTL, None).await.unwrap();
    cluster.pause(hung);
    let mut mark = 0;
    for _ in 0..6 {
        let started = Instant::now();
        let next = arbiter.renew(&ns, &a, lease).await.unwrap();
        assert!(next > mark);
        mark = next;
        assert!(
            started.elapsed() < Duration::from_millis(1500),
            "a renewal took {:?} with one member hung",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cluster.resume(hung);
    let term: Option<Term> = arbiter.campaign(&ns, &a, lease).await.unwrap();
    assert!(term.is_some());
}
