//! An arbiter that goes back in time (issue 23, item 2): the PostgreSQL
//! primary is crashed and replaced by a copy of itself taken a few seconds
//! earlier — what a failover to an asynchronously replicated standby that
//! missed the last commits does, or a restore from a backup. In those seconds
//! a third node joined and took partitions (the table's epoch rose) and every
//! lease renewed. The copy knows none of it.
//!
//! Each node remembers the highest renewal mark, term and table epoch it has
//! seen (`fief_core::ArbiterHistory`); the copy answers below them, so every
//! node fences, reports the regression (status `arbiter_regression`, the
//! `fief_arbiter_regressions_total` metric) and serves nothing while the
//! arbiter is behind. The operator's way out (docs/operations.md): stop every
//! node and start them again; they serve again. A steady load of calls and
//! casts runs throughout, every node writes an event log, and the history
//! checker must find no two live processes of one key, nothing processed
//! twice or while fenced, and no ownership token going back.
//!
//! Honestly: with the detection taken out (every check of `ArbiterHistory`
//! passing), this test fails on its own assertions — no node reports the
//! regression, and the nodes go on serving (154 answers in the 3 s the
//! test expects none) — but in that run the history checker found no two
//! owners: the nodes kept their newer tables (an older table is never
//! adopted) and n3's lease was unknown to the copy, so it fenced. The window
//! that detection closes (a lease judged expired by the copy while its node
//! still serves) needs the copy to take over faster than this test can
//! replace a server; `docs/operations.md` says what is and is not seen.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fief_tests::multiprocess::unique_namespace;
use fief_tests::scratch_postgres::ScratchPostgres;

use crate::logged_cluster::{Load, LoggedCluster};
use crate::processes::{SERIAL, wait_settled};

/// Long enough a TTL that the copy is taken, the third node joins and the
/// copy replaces the primary while the leases the copy holds are current
/// (so the nodes' renewals succeed there and only the renewal marks show
/// what was lost).
const TIMINGS: [&str; 6] = [
    "--lease-ttl",
    "6s",
    "--renew-interval",
    "1s",
    "--fence-margin",
    "1s",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_replaced_by_an_earlier_copy_is_refused_and_nobody_double_owns() {
    let _serial = SERIAL.lock().await;
    let pg = Arc::new(
        tokio::task::spawn_blocking(ScratchPostgres::start)
            .await
            .unwrap(),
    );
    let mut cluster = LoggedCluster::new(
        3,
        unique_namespace("regression"),
        ScratchPostgres::url_via(&pg.addr()),
        &TIMINGS,
    );
    cluster.spawn(0).await;
    cluster.spawn(1).await;
    wait_settled(&cluster.nodes).await;
    let load = Load::start("a", cluster.urls());

    // The copy, then what it will miss: n3 joins and takes partitions.
    let copy = {
        let pg = pg.clone();
        tokio::task::spawn_blocking(move || pg.copy())
            .await
            .unwrap()
    };
    cluster.note("primary copied");
    let copied_at = Instant::now();
    cluster.spawn(2).await;
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        let owned = cluster.nodes[2].status().await.unwrap_or_default()["partitions_owned"]
            .as_u64()
            .unwrap_or(0);
        if owned > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen_epoch = cluster
        .statuses()
        .await
        .iter()
        .filter_map(|s| s["epoch"].as_u64())
        .max()
        .unwrap();
    cluster.note(format!("n3 owns partitions; epoch {seen_epoch}"));
    {
        let pg = pg.clone();
        tokio::task::spawn_blocking(move || pg.replace_with_copy(copy))
            .await
            .unwrap();
    }
    cluster.note(format!(
        "primary crashed and replaced by the copy taken {:.1}s earlier",
        copied_at.elapsed().as_secs_f64()
    ));

    // Every node sees the regression and fences.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let statuses = cluster.statuses().await;
        let regressed = statuses
            .iter()
            .filter(|s| {
                s["arbiter_regression"]
                    .as_str()
                    .is_some_and(|r| r.contains("went back in time"))
            })
            .count();
        if regressed == statuses.len() {
            for s in &statuses {
                println!("{}: {}", s["node_id"], s["arbiter_regression"]);
                assert!(s["fences"].as_u64().unwrap() >= 1, "{s}");
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "every node should have reported the regression: {statuses:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cluster.note("every node reported the regression");
    let metrics = reqwest::get(format!("{}/metrics", cluster.nodes[0].url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("fief_arbiter_regressions_total{what="),
        "the metric counts it"
    );

    // While the arbiter is behind what they saw, nothing is served.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let served = load.answered_within(Duration::from_secs(3)).await;
    assert_eq!(served, 0, "served while the arbiter is behind");
    load.stop().await;

    // The operator accepts the loss: every node stopped and started again.
    cluster.kill_all();
    let before_restart = cluster.runs_so_far();
    for i in 0..3 {
        cluster.spawn(i).await;
    }
    wait_settled(&cluster.nodes).await;
    let load = Load::start("b", cluster.urls());
    let served = load.answered_within(Duration::from_secs(2)).await;
    assert!(served > 0, "served again");
    load.stop().await;
    for s in cluster.statuses().await {
        assert!(s["arbiter_regression"].is_null(), "a new process: {s}");
    }
    cluster.kill_all();

    // Judged in two eras: the new processes took the arbiter as it is, so
    // its numbering goes on from the copy's and the tokens of the lost
    // commits are forgotten (every process that held them is dead; durable
    // state is fenced by the store's own tokens, docs/operations.md).
    let summary = cluster.judge(0..before_restart);
    println!("history up to the restart: {summary:?}");
    let summary = cluster.judge(before_restart..cluster.runs_so_far());
    println!("history after it: {summary:?}");
}
