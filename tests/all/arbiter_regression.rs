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

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fief_tests::history::{self, NodeRun, Note};
use fief_tests::multiprocess::{ClusterNode, NodeSpec, call_url, post_key, unique_namespace};
use fief_tests::scratch_postgres::ScratchPostgres;
use fief_tests::{free_port, guests};

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
const KEYS: usize = 16;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
const START_LIMIT: Duration = Duration::from_secs(40);

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The nodes, their event logs, and what the test did.
struct Cluster {
    dir: tempfile::TempDir,
    namespace: String,
    arbiter: String,
    peer_ports: Vec<u16>,
    nodes: Vec<ClusterNode>,
    /// (label, event log, when known gone) per process.
    runs: Vec<(String, PathBuf, Option<u64>)>,
    notes: Vec<Note>,
    started: Instant,
}

impl Cluster {
    fn note(&mut self, text: impl Into<String>) {
        let text = text.into();
        println!("{:>6.2}s: {text}", self.started.elapsed().as_secs_f64());
        self.notes.push(Note {
            t_us: now_us(),
            text,
        });
    }

    /// Start node `i` (`n{i+1}`), a new process of it if it ran before.
    async fn spawn(&mut self, i: usize) {
        let label = format!("n{}#{}", i + 1, self.runs.len());
        let log = self.dir.path().join(format!("{label}.events.jsonl"));
        let mut extra_args: Vec<String> = TIMINGS.iter().map(|s| (*s).to_owned()).collect();
        extra_args.extend(["--event-log".to_owned(), log.display().to_string()]);
        let spec = NodeSpec {
            node_id: format!("n{}", i + 1),
            namespace: self.namespace.clone(),
            arbiter: self.arbiter.clone(),
            deploy: vec![("probe".to_owned(), guests::PROBE.to_owned())],
            extra_args,
        };
        let peer = format!("127.0.0.1:{}", self.peer_ports[i]);
        let mut node = ClusterNode::spawn_with_peer_listen(&spec, &peer).await;
        node.wait_current(START_LIMIT).await;
        if i < self.nodes.len() {
            let old = std::mem::replace(&mut self.nodes[i], node);
            drop(old);
        } else {
            self.nodes.push(node);
        }
        self.runs.push((label.clone(), log, None));
        self.note(format!("{label} started"));
    }

    /// SIGKILL every process; the run of each is closed.
    fn kill_all(&mut self) {
        for node in &mut self.nodes {
            node.kill9();
        }
        let gone = now_us();
        for run in &mut self.runs {
            run.2.get_or_insert(gone);
        }
        self.note("every node SIGKILLed");
    }

    async fn statuses(&self) -> Vec<serde_json::Value> {
        let mut all = Vec::new();
        for node in &self.nodes {
            all.push(node.status().await.unwrap_or_default());
        }
        all
    }
}

/// Calls (`echo`) and casts (`record`) over every key through every node,
/// each message unique (`tag` tells loads apart), until `stop`; counts the
/// answers.
async fn load(tag: &'static str, urls: Vec<String>, stop: Arc<AtomicBool>, ok: Arc<AtomicU64>) {
    let client = reqwest::Client::new();
    let mut n = 0usize;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let (key, url) = (format!("k{}", n % KEYS), &urls[n % urls.len()]);
        let answered = if n % 4 == 0 {
            let message = format!("record {tag}{n}");
            post_key(
                &client,
                url,
                "probe",
                &key,
                "cast",
                &message,
                REQUEST_TIMEOUT,
            )
            .await
            .is_ok()
        } else {
            let message = format!("echo {tag}{n}");
            call_url(&client, url, "probe", &key, &message, REQUEST_TIMEOUT)
                .await
                .is_ok()
        };
        if answered {
            ok.fetch_add(1, Ordering::Relaxed);
        } else {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_replaced_by_an_earlier_copy_is_refused_and_nobody_double_owns() {
    let _serial = SERIAL.lock().await;
    let pg = Arc::new(
        tokio::task::spawn_blocking(ScratchPostgres::start)
            .await
            .unwrap(),
    );
    let mut cluster = Cluster {
        dir: tempfile::tempdir().unwrap(),
        namespace: unique_namespace("regression"),
        arbiter: ScratchPostgres::url_via(&pg.addr()),
        peer_ports: (0..3).map(|_| free_port()).collect(),
        nodes: Vec::new(),
        runs: Vec::new(),
        notes: Vec::new(),
        started: Instant::now(),
    };
    cluster.spawn(0).await;
    cluster.spawn(1).await;
    wait_settled(&cluster.nodes).await;
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let urls = |c: &Cluster| c.nodes.iter().map(|n| n.url.clone()).collect::<Vec<_>>();
    let first_load = tokio::spawn(load("a", urls(&cluster), stop.clone(), ok.clone()));

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
    let before = ok.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let served = ok.load(Ordering::Relaxed) - before;
    assert_eq!(served, 0, "served while the arbiter is behind");
    stop.store(true, Ordering::Relaxed);
    first_load.await.unwrap();

    // The operator accepts the loss: every node stopped and started again.
    cluster.kill_all();
    let before_restart = cluster.runs.len();
    for i in 0..3 {
        cluster.spawn(i).await;
    }
    wait_settled(&cluster.nodes).await;
    let stop = Arc::new(AtomicBool::new(false));
    let second_load = tokio::spawn(load("b", urls(&cluster), stop.clone(), ok.clone()));
    let before = ok.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(ok.load(Ordering::Relaxed) > before, "served again");
    stop.store(true, Ordering::Relaxed);
    second_load.await.unwrap();
    for s in cluster.statuses().await {
        assert!(s["arbiter_regression"].is_null(), "a new process: {s}");
    }
    cluster.kill_all();

    // Judged in two eras: the new processes took the arbiter as it is, so
    // its numbering goes on from the copy's and the tokens of the lost
    // commits are forgotten (every process that held them is dead; durable
    // state is fenced by the store's own tokens, docs/operations.md).
    let mut runs: Vec<NodeRun> = cluster
        .runs
        .iter()
        .map(|(label, log, gone)| NodeRun::read(label, log, *gone))
        .collect();
    let after = runs.split_off(before_restart);
    let summary = history::assert_single_ownership(&runs, &cluster.notes);
    println!("history up to the restart: {summary:?}");
    let summary = history::assert_single_ownership(&after, &cluster.notes);
    println!("history after it: {summary:?}");
}
