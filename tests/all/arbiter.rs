//! The arbiter's contracts (contract §3: presence, ownership table,
//! leadership), run against the adapters: the in-process `LocalArbiter` on a
//! stepped clock, and the `PostgresArbiter` against a real PostgreSQL server,
//! where expiry is judged on the database's clock (so its test waits in real
//! time, with generous margins). `arbiter_etcd.rs` runs the same contract on
//! the `EtcdArbiter` (whole-second TTLs: etcd's leases are).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use fief::SteppedClock;
use fief::arbiter::{Arbiter, ArbiterError, LocalArbiter, PostgresArbiter};
use fief::core::{NodeId, PartitionCount, PartitionId};
use fief_tests::multiprocess::{PG_ADDR, arbiter_url, test_database, unique_namespace};

/// Lets time pass for the arbiter under test (stepped or real).
pub(crate) type Wait =
    Box<dyn Fn(Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// The lease TTL of the contract on the local arbiter (a stepped clock).
const TTL: Duration = Duration::from_millis(600);

/// The lease TTL of the contract on the PostgreSQL arbiter, judged on the
/// database's clock in real time: every step between a registration and the
/// next look, and each renewal gap (a third of it plus a round trip), must
/// fit in it on a loaded 2-core machine running the whole suite. At 600 ms a
/// stalled round trip let `a`'s fresh lease expire before the first look
/// (`live.len()` 1, not 2) in a fresh-clone run.
const PG_TTL: Duration = Duration::from_secs(3);
pub(crate) const PARTITIONS: u32 = 8;

/// The whole contract, on one arbiter and one namespace, with leases of
/// `ttl`.
pub(crate) async fn contract(arbiter: &dyn Arbiter, ns: &str, wait: Wait, ttl: Duration) {
    let (a, b) = (NodeId::new("a"), NodeId::new("b"));

    // Presence: a lease is live until the arbiter judges it expired.
    let lease_a = arbiter
        .register(ns, &a, ttl, Some("127.0.0.1:1"))
        .await
        .unwrap();
    let lease_b = arbiter.register(ns, &b, ttl, None).await.unwrap();
    let live = arbiter.live_nodes(ns).await.unwrap();
    assert_eq!(live.len(), 2);
    assert_eq!(live[0].peer_addr.as_deref(), Some("127.0.0.1:1"));
    let err = arbiter.register(ns, &a, ttl, None).await.unwrap_err();
    assert!(
        matches!(err, ArbiterError::Refused(_)),
        "a node id is unique while its lease is current: {err}"
    );
    // A grant is confirmed once its node uses it (a campaign or a renewal):
    // the leader gives partitions only to confirmed leases, so a grant whose
    // answer was lost on its way to the node gets none.
    let confirmed = |live: &[fief::arbiter::Member], n: &NodeId| {
        live.iter().find(|m| &m.node == n).map(|m| m.confirmed)
    };
    assert_eq!(confirmed(&live, &a), Some(false), "granted, not yet used");
    arbiter.renew(ns, &b, lease_b).await.unwrap();
    let live = arbiter.live_nodes(ns).await.unwrap();
    assert_eq!(confirmed(&live, &a), Some(false));
    assert_eq!(confirmed(&live, &b), Some(true), "a renewal confirms");

    // Leadership: one leader at a time.
    let term = arbiter
        .campaign(ns, &a, lease_a)
        .await
        .unwrap()
        .expect("a leads");
    assert_eq!(
        arbiter.campaign(ns, &b, lease_b).await.unwrap(),
        None,
        "b cannot lead while a does"
    );
    assert_eq!(
        arbiter.campaign(ns, &a, lease_a).await.unwrap(),
        Some(term),
        "a keeps its term"
    );
    let live = arbiter.live_nodes(ns).await.unwrap();
    assert_eq!(confirmed(&live, &a), Some(true), "a campaign confirms");

    // Table: the leader writes; every change bumps the epoch.
    let all: Vec<_> = (0..PARTITIONS)
        .map(|p| (PartitionId(p), Some(a.clone())))
        .collect();
    let table = arbiter.write_table(ns, term, all).await.unwrap();
    assert_eq!(table.count_owned_by(&a), PARTITIONS as usize);
    let epoch = table.epoch();
    assert!(epoch >= 1);
    let stale = fief::arbiter::Term(term.0 + 100);
    assert!(matches!(
        arbiter
            .write_table(ns, stale, vec![(PartitionId(0), Some(b.clone()))])
            .await,
        Err(ArbiterError::NotLeader(_))
    ));
    // A partition of a live owner cannot be given away by the leader...
    let refused = arbiter
        .write_table(ns, term, vec![(PartitionId(0), Some(b.clone()))])
        .await;
    assert!(
        matches!(refused, Err(ArbiterError::Refused(_))),
        "{refused:?}"
    );
    // ...only by its owner, gracefully.
    let table = arbiter
        .transfer(ns, &a, lease_a, vec![(PartitionId(0), b.clone())])
        .await
        .unwrap();
    let token = table.owner(PartitionId(0)).unwrap().token;
    assert_eq!(table.owner(PartitionId(0)).unwrap().node, b);
    assert!(
        table.epoch() > epoch && token.0 == table.epoch(),
        "the new owner's token is the new epoch"
    );
    assert!(
        arbiter
            .transfer(ns, &a, lease_a, vec![(PartitionId(0), a.clone())])
            .await
            .is_err(),
        "a no longer owns p0"
    );

    // Expiry: b stops renewing; a keeps renewing. Every renewal returns a
    // higher mark (how a node sees an arbiter that lost its renewals).
    let mut mark = 0;
    for _ in 0..4 {
        wait(ttl / 3).await;
        let next = arbiter.renew(ns, &a, lease_a).await.unwrap();
        assert!(next > mark, "renewal marks rise: {mark} then {next}");
        mark = next;
    }
    assert_eq!(
        arbiter.renew(ns, &b, lease_b).await,
        Err(ArbiterError::LeaseExpired(lease_b)),
        "a renewal after expiry fails"
    );
    let live = arbiter.live_nodes(ns).await.unwrap();
    assert_eq!(
        live.iter().map(|m| m.node.clone()).collect::<Vec<_>>(),
        vec![a.clone()]
    );
    // Now the leader may reassign b's partition.
    let table = arbiter
        .write_table(ns, term, vec![(PartitionId(0), Some(a.clone()))])
        .await
        .unwrap();
    assert_eq!(table.owner(PartitionId(0)).unwrap().node, a);
    assert!(
        table.owner(PartitionId(0)).unwrap().token > token,
        "tokens only increase"
    );

    // Rejoin: b registers anew and owns nothing from before.
    let table = arbiter
        .transfer(ns, &a, lease_a, vec![(PartitionId(1), a.clone())])
        .await;
    assert!(table.is_ok(), "a transfer to itself is allowed: {table:?}");
    arbiter.release(ns, &a, lease_a).await.unwrap();
    assert!(
        arbiter.live_nodes(ns).await.unwrap().is_empty(),
        "a released lease is gone at once"
    );
    let lease_a2 = arbiter.register(ns, &a, ttl, None).await.unwrap();
    assert_ne!(lease_a2, lease_a);
    let table = arbiter.table(ns).await.unwrap();
    assert_eq!(
        table.count_owned_by(&a),
        0,
        "a new lease owns nothing until the leader gives it something"
    );
    // And the old leader's term is over: a new campaign gets a higher term.
    let term2 = arbiter
        .campaign(ns, &a, lease_a2)
        .await
        .unwrap()
        .expect("a leads again");
    assert!(term2 > term);
}

#[tokio::test]
async fn the_local_arbiter_keeps_the_contract() {
    let clock = SteppedClock::default();
    let arbiter = LocalArbiter::new(
        Arc::new(clock.clone()),
        PartitionCount::new(PARTITIONS).unwrap(),
    );
    let wait: Wait = Box::new(move |d| {
        clock.advance(d);
        Box::pin(async {})
    });
    contract(&arbiter, "ns", wait, TTL).await;
}

#[tokio::test]
async fn the_postgres_arbiter_keeps_the_contract() {
    drop(test_database().await);
    let ns = unique_namespace("arbiter-contract");
    let arbiter = PostgresArbiter::connect(
        &arbiter_url(PG_ADDR),
        &ns,
        PartitionCount::new(PARTITIONS).unwrap(),
    )
    .await
    .unwrap();
    let wait: Wait = Box::new(|d| Box::pin(tokio::time::sleep(d)));
    contract(&arbiter, &ns, wait, PG_TTL).await;
}

#[tokio::test]
async fn the_postgres_migration_is_idempotent_and_namespaces_share_a_database() {
    drop(test_database().await);
    let url = arbiter_url(PG_ADDR);
    let partitions = PartitionCount::new(PARTITIONS).unwrap();
    let (ns1, ns2) = (unique_namespace("mig-a"), unique_namespace("mig-b"));
    // Several nodes connecting at once run the migration concurrently.
    let connects = (0..4).map(|i| {
        let (url, ns) = (
            url.clone(),
            if i % 2 == 0 { ns1.clone() } else { ns2.clone() },
        );
        tokio::spawn(async move { PostgresArbiter::connect(&url, &ns, partitions).await })
    });
    for c in connects {
        c.await.unwrap().unwrap();
    }
    // A namespace's partition count is fixed.
    let err = PostgresArbiter::connect(&url, &ns1, PartitionCount::new(PARTITIONS + 1).unwrap())
        .await
        .err()
        .expect("a different partition count is refused");
    assert!(err.to_string().contains("partitions"), "{err}");
}

/// A node's start does not hold up the other nodes' renewals. The
/// migration used to run `ALTER TABLE fief_leases ADD COLUMN IF NOT EXISTS`
/// on every start, which takes an `ACCESS EXCLUSIVE` lock on the lease table
/// before it looks whether the column is there: behind any open transaction
/// that had read the table it waited, and every node's renewal queued behind
/// it (a renewal gap of 3 s, and a fence, in
/// `load_fence::nodes_whose_cores_are_busy_keep_renewing_and_never_fence`
/// while other tests started nodes). Here a transaction that read
/// `fief_leases` stays open while a second node connects and the first
/// renews: both answer. With the unconditional `ALTER`, both wait until that
/// transaction ends, past the bound (they take milliseconds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starting_node_does_not_hold_up_the_others_renewals() {
    const BOUND: Duration = Duration::from_secs(10);
    let db = test_database().await;
    let url = arbiter_url(PG_ADDR);
    let partitions = PartitionCount::new(PARTITIONS).unwrap();
    let ns = unique_namespace("start-no-stall");
    let a = NodeId::new("a");
    let first = PostgresArbiter::connect(&url, &ns, partitions)
        .await
        .unwrap();
    let lease = first
        .register(&ns, &a, Duration::from_secs(60), None)
        .await
        .unwrap();
    // Another session reads the lease table and keeps its transaction open:
    // it holds `ACCESS SHARE` on it, which only `ACCESS EXCLUSIVE` waits for.
    db.batch_execute("BEGIN; SELECT count(*) FROM fief_leases")
        .await
        .unwrap();
    let second = {
        let (url, ns) = (url.clone(), ns.clone());
        tokio::spawn(async move { PostgresArbiter::connect(&url, &ns, partitions).await })
    };
    // Let the second node's migration reach the lease table (if it waits
    // there, the renewal queues behind it).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let renewed = tokio::time::timeout(BOUND, first.renew(&ns, &a, lease)).await;
    let started = tokio::time::timeout(BOUND, second).await;
    db.batch_execute("COMMIT").await.unwrap();
    assert!(
        matches!(renewed, Ok(Ok(_))),
        "the renewal answers while another node starts: {renewed:?}"
    );
    assert!(
        matches!(started, Ok(Ok(Ok(_)))),
        "the second node's migration does not wait for a reader of the lease table"
    );
}

/// A node cut off from PostgreSQL in the middle of one of its transactions
/// (which lock the namespace row) does not stop the others: the server ends
/// the silent session after a second and the lock goes with it, so another
/// node's campaign answers. Without the session timeout the lock stays until
/// the dead connection is noticed, and no node can lead or change the table
/// (the takeover that `processes::` saw stall under load).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_mid_transaction_does_not_hold_the_namespace_lock() {
    let db = test_database().await;
    let ns = unique_namespace("cut-mid-tx");
    let partitions = PartitionCount::new(PARTITIONS).unwrap();
    let proxy = fief_tests::multiprocess::PgProxy::start().await;
    let (a, b) = (NodeId::new("a"), NodeId::new("b"));
    let cut_node = PostgresArbiter::connect(&proxy.arbiter_url(), &ns, partitions)
        .await
        .unwrap();
    let ttl = Duration::from_secs(30);
    let lease_a = cut_node.register(&ns, &a, ttl, None).await.unwrap();
    let other = PostgresArbiter::connect(&arbiter_url(PG_ADDR), &ns, partitions)
        .await
        .unwrap();
    let lease_b = other.register(&ns, &b, ttl, None).await.unwrap();

    // Slow the cut node's link so its campaign sits between statements,
    // then cut it there: its session is idle inside a transaction that
    // holds the namespace row.
    proxy.set_delay(Duration::from_millis(400));
    let ns_a = ns.clone();
    let _campaign = tokio::spawn(async move {
        let _ = cut_node.campaign(&ns_a, &a, lease_a).await;
    });
    // The namespace row is locked once `FOR UPDATE … NOWAIT` from another
    // session is refused (SQLSTATE 55P03, lock_not_available).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let probe = db
            .query(
                "SELECT 1 FROM fief_namespaces WHERE namespace = $1 FOR UPDATE NOWAIT",
                &[&ns],
            )
            .await;
        match probe {
            Err(e) if e.code().is_some_and(|c| c.code() == "55P03") => break,
            Err(e) => panic!("probing the namespace row's lock: {e}"),
            Ok(_) => {}
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the slowed campaign never locked the namespace row"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.set_cut(true);

    let answered = tokio::time::timeout(Duration::from_secs(15), other.campaign(&ns, &b, lease_b))
        .await
        .expect("another node's campaign answers while the cut node's transaction is dead");
    answered.unwrap();
}
