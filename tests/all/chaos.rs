//! Chaos against real processes (issue 8, item 5; contract §5 rows 1–5):
//! three `fief node` processes share a namespace in a PostgreSQL server of
//! the test's own and carry a steady load of calls and casts, while on a
//! schedule the test SIGKILLs a node (and restarts it), pauses one past its
//! TTL (SIGSTOP, SIGCONT), cuts one off from PostgreSQL, cuts node ↔ node
//! links, and restarts PostgreSQL. Every node writes an event log
//! (`--event-log`); at the end the history checker (`fief_tests::history`)
//! merges the logs on one time line and must find no two live processes of
//! one key, no message processed twice, no fenced node processing anything
//! and no ownership token going back.
//!
//! Topology, all on 127.0.0.1: each node reaches PostgreSQL through a TCP
//! proxy of its own (cut it: that node alone loses its arbiter), and each
//! node's peer listener sits behind a proxy whose address the node
//! advertises (`--peer-advertise`), so cutting it cuts every link *into*
//! that node (forwarded calls and casts, handoffs, move requests) while its
//! own requests to the others still go through. The PostgreSQL server is a
//! throwaway cluster ([`ScratchPostgres`]): restarting the shared server
//! would break the tests running beside this one.
//!
//! The schedule is fixed; which node suffers which fault is drawn from a
//! seed, printed at the start (`FIEF_CHAOS_SEED=<n>` picks the same victims
//! again; the rest of a real-process run is not reproducible). A run takes
//! about a minute. The event logs are kept under `target/test-logs/chaos/`
//! when the test fails (with the node logs' tails printed), and deleted when
//! it passes. See `docs/testing.md`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fief::event_log::{EventRecord, MessageKind, RecordedEvent};
use fief_tests::history::{self, NodeRun, Note, Violation};
use fief_tests::multiprocess::{
    CallError, ClusterNode, FAST_TIMINGS, NodeSpec, TcpProxy, call_url, post_key, unique_namespace,
};
use fief_tests::scratch_postgres::ScratchPostgres;
use fief_tests::{free_port, guests};

use crate::processes::{SERIAL, wait_settled};

/// Nodes in the cluster.
const NODES: usize = 3;
/// Keys the load spreads over (`k0` … `k23`: partitions on every node).
const KEYS: usize = 24;
/// Concurrent load workers.
const WORKERS: usize = 3;
/// Pause between one worker's requests.
const LOAD_PACE: Duration = Duration::from_millis(15);
/// How long one request of the load may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// The lease TTL of `FAST_TIMINGS`.
const LEASE_TTL: Duration = Duration::from_secs(2);
/// How long a node may take to start.
const START_LIMIT: Duration = Duration::from_secs(30);
/// How long the cluster may take to serve every key again after the chaos.
const RECOVERY_LIMIT: Duration = Duration::from_secs(30);

/// Wall-clock microseconds, the event logs' clock.
fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// A small deterministic generator (xorshift64*), for the victims and the
/// load's choices.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }
}

/// One node of the cluster: its proxies and which process is current.
struct Slot {
    node_id: String,
    /// Its way to PostgreSQL.
    pg_proxy: TcpProxy,
    /// In front of its peer listener; its address is the one it advertises.
    peer_proxy: TcpProxy,
    /// Where its peer listener binds (the same for each of its processes).
    peer_listen: String,
    /// The current process's index in [`Chaos::runs`].
    run: usize,
    /// Processes so far, the current one included.
    incarnations: usize,
}

/// One node process's record: its label (`n2#1`), event log, and when it
/// was known gone.
struct Run {
    label: String,
    event_log: PathBuf,
    gone_at_us: Option<u64>,
}

/// The cluster under test, the load's view of it, and the record.
struct Chaos {
    namespace: String,
    /// Event logs go here.
    dir: PathBuf,
    pg: Arc<ScratchPostgres>,
    slots: Vec<Slot>,
    /// Each slot's current process.
    nodes: Vec<ClusterNode>,
    /// Killed processes, kept so that a failing test still shows their logs.
    retired: Vec<ClusterNode>,
    runs: Vec<Run>,
    /// The HTTP API of each slot's current process, for the load.
    urls: Arc<RwLock<Vec<String>>>,
    /// What the test did, and when.
    notes: Mutex<Vec<Note>>,
    started: Instant,
}

impl Chaos {
    /// Make the proxies and start the nodes one after the other; wait until
    /// they agree on the table.
    async fn start(namespace: String, pg: Arc<ScratchPostgres>) -> Chaos {
        let dir = fief_tests::test_logs_dir().join("chaos").join(&namespace);
        std::fs::create_dir_all(&dir).expect("creating the event log directory");
        let mut chaos = Chaos {
            namespace,
            dir,
            pg,
            slots: Vec::new(),
            nodes: Vec::new(),
            retired: Vec::new(),
            runs: Vec::new(),
            urls: Arc::new(RwLock::new(Vec::new())),
            notes: Mutex::new(Vec::new()),
            started: Instant::now(),
        };
        for i in 1..=NODES {
            let node_id = format!("n{i}");
            let pg_proxy = TcpProxy::start_to(&chaos.pg.addr()).await;
            let peer_listen = format!("127.0.0.1:{}", free_port());
            let peer_proxy = TcpProxy::start_to(&peer_listen).await;
            let (node, run) = chaos
                .spawn(&node_id, 0, &pg_proxy.addr, &peer_proxy.addr, &peer_listen)
                .await;
            chaos.urls.write().expect("urls").push(node.url.clone());
            chaos.nodes.push(node);
            chaos.slots.push(Slot {
                node_id,
                pg_proxy,
                peer_proxy,
                peer_listen,
                run,
                incarnations: 1,
            });
        }
        wait_settled(&chaos.nodes).await;
        chaos
    }

    /// Start process `incarnation` of `node_id` and wait until its lease is
    /// current; returns it and its index in `runs`.
    async fn spawn(
        &mut self,
        node_id: &str,
        incarnation: usize,
        pg_addr: &str,
        advertise: &str,
        peer_listen: &str,
    ) -> (ClusterNode, usize) {
        let label = format!("{node_id}#{incarnation}");
        let event_log = self.dir.join(format!("{label}.events.jsonl"));
        let mut extra_args: Vec<String> = FAST_TIMINGS.iter().map(|s| (*s).to_owned()).collect();
        extra_args.extend([
            "--peer-advertise".to_owned(),
            advertise.to_owned(),
            "--event-log".to_owned(),
            event_log.to_str().expect("a UTF-8 path").to_owned(),
        ]);
        let spec = NodeSpec {
            node_id: node_id.to_owned(),
            namespace: self.namespace.clone(),
            arbiter: ScratchPostgres::url_via(pg_addr),
            deploy: vec![("probe".to_owned(), guests::PROBE.to_owned())],
            extra_args,
        };
        let mut node = ClusterNode::spawn_with_peer_listen(&spec, peer_listen).await;
        node.wait_current(START_LIMIT).await;
        self.note(format!("{label} started, lease current ({})", node.url));
        self.runs.push(Run {
            label,
            event_log,
            gone_at_us: None,
        });
        (node, self.runs.len() - 1)
    }

    fn note(&self, text: String) {
        println!(
            "chaos {:>6.2}s: {text}",
            self.started.elapsed().as_secs_f64()
        );
        self.notes.lock().expect("notes").push(Note {
            t_us: now_us(),
            text,
        });
    }

    fn label(&self, i: usize) -> String {
        self.runs[self.slots[i].run].label.clone()
    }

    /// SIGKILL slot `i`'s process; it is known gone once reaped.
    fn kill9(&mut self, i: usize) {
        self.note(format!("SIGKILL {}", self.label(i)));
        self.nodes[i].kill9();
        self.runs[self.slots[i].run].gone_at_us = Some(now_us());
    }

    /// Start a new process for slot `i`: same node id, same addresses.
    async fn restart(&mut self, i: usize) {
        // The node log is named by namespace and node id: move the killed
        // process's aside before the new process writes its own.
        self.nodes[i].rename_log(&format!("run{}", self.slots[i].incarnations - 1));
        let slot = &self.slots[i];
        let (node_id, incarnation) = (slot.node_id.clone(), slot.incarnations);
        let (pg_addr, advertise, peer_listen) = (
            slot.pg_proxy.addr.clone(),
            slot.peer_proxy.addr.clone(),
            slot.peer_listen.clone(),
        );
        let (node, run) = self
            .spawn(&node_id, incarnation, &pg_addr, &advertise, &peer_listen)
            .await;
        self.urls.write().expect("urls")[i] = node.url.clone();
        let old = std::mem::replace(&mut self.nodes[i], node);
        self.retired.push(old);
        self.slots[i].run = run;
        self.slots[i].incarnations += 1;
    }

    /// SIGKILL every process (each is gone once reaped) and read the
    /// record.
    fn finish(&mut self) -> Vec<NodeRun> {
        for (slot, node) in self.slots.iter().zip(&mut self.nodes) {
            node.kill9();
            self.runs[slot.run].gone_at_us = Some(now_us());
        }
        self.note("every node SIGKILLed; checking the history".to_owned());
        self.runs
            .iter()
            .map(|run| NodeRun::read(&run.label, &run.event_log, run.gone_at_us))
            .collect()
    }
}

/// What the load saw.
#[derive(Default)]
struct Tally {
    calls_ok: AtomicU64,
    casts_ok: AtomicU64,
    /// Failures by error code (`no response` for timeouts).
    failures: Mutex<BTreeMap<String, u64>>,
}

impl Tally {
    fn failed(&self, error: &CallError) {
        *self
            .failures
            .lock()
            .expect("tally")
            .entry(error.code.clone())
            .or_default() += 1;
    }
}

/// One load worker: until `stop`, call `echo w<worker>-<n>` (every message
/// unique, so the checker can tell a message processed twice) or cast
/// `record w<worker>-<n>` to a random key through a random node. A reply
/// must be the echo of its own message.
async fn load(
    worker: usize,
    seed: u64,
    urls: Arc<RwLock<Vec<String>>>,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) {
    let client = reqwest::Client::new();
    let mut rng = Rng::new(seed.wrapping_add(worker as u64 * 7919));
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let key = format!("k{}", rng.below(KEYS));
        let url = {
            let urls = urls.read().expect("urls");
            urls[rng.below(urls.len())].clone()
        };
        let text = format!("w{worker}-{n}");
        if rng.below(4) == 0 {
            let message = format!("record {text}");
            match post_key(
                &client,
                &url,
                "probe",
                &key,
                "cast",
                &message,
                REQUEST_TIMEOUT,
            )
            .await
            {
                Ok(_) => {
                    tally.casts_ok.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => tally.failed(&e),
            }
        } else {
            let message = format!("echo {text}");
            match call_url(&client, &url, "probe", &key, &message, REQUEST_TIMEOUT).await {
                Ok(reply) => {
                    assert_eq!(
                        reply, text,
                        "the reply to {message:?} (key {key}, via {url})"
                    );
                    tally.calls_ok.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => tally.failed(&e),
            }
        }
        tokio::time::sleep(LOAD_PACE).await;
    }
}

/// After the chaos: every key answers a call again, through some node,
/// within [`RECOVERY_LIMIT`]. Every attempt is a new message.
async fn every_key_answers(urls: &[String]) {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + RECOVERY_LIMIT;
    for k in 0..KEYS {
        let key = format!("k{k}");
        let mut attempt = 0;
        loop {
            attempt += 1;
            let text = format!("final-{key}-{attempt}");
            let url = &urls[attempt % urls.len()];
            let reply = call_url(
                &client,
                url,
                "probe",
                &key,
                &format!("echo {text}"),
                REQUEST_TIMEOUT,
            )
            .await;
            match reply {
                Ok(reply) => {
                    assert_eq!(reply, text);
                    break;
                }
                Err(e) => assert!(
                    Instant::now() < deadline,
                    "{key} did not answer within {RECOVERY_LIMIT:?} of the end of the chaos: {e:?}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The seed of the victims: `FIEF_CHAOS_SEED`, or the clock.
fn seed() -> u64 {
    std::env::var("FIEF_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(now_us)
}

/// Issue 8 item 5, contract §5 rows 1–5 against real processes and a real
/// PostgreSQL: under load, SIGKILL and restart a node, pause one past its
/// TTL, cut one from PostgreSQL, cut the links into one node and then
/// between all of them, restart PostgreSQL; the history checker finds no
/// double ownership in the nodes' event logs, and afterwards every key is
/// served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_against_three_processes_and_postgres_finds_no_double_ownership() {
    let _serial = SERIAL.lock().await;
    let seed = seed();
    let mut rng = Rng::new(seed);
    println!("chaos: seed {seed} (FIEF_CHAOS_SEED={seed} picks the same victims)");
    let pg = Arc::new(
        tokio::task::spawn_blocking(ScratchPostgres::start)
            .await
            .expect("starting PostgreSQL"),
    );
    let mut chaos = Chaos::start(unique_namespace("chaos"), pg.clone()).await;
    chaos.note("cluster settled; load starts".to_owned());

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            tokio::spawn(load(
                w,
                seed,
                chaos.urls.clone(),
                stop.clone(),
                tally.clone(),
            ))
        })
        .collect();
    let pause = |d: Duration| tokio::time::sleep(d);
    pause(Duration::from_secs(3)).await;

    // Row 1: a node crashes; its keys come back elsewhere after expiry, and
    // it comes back (same id, a fresh lease) and gets partitions again.
    let victim = rng.below(NODES);
    chaos.kill9(victim);
    pause(LEASE_TTL + Duration::from_secs(1)).await;
    chaos.restart(victim).await;
    pause(Duration::from_secs(2)).await;

    // Row 5: a node paused past its TTL, then resumed.
    let victim = rng.below(NODES);
    chaos.note(format!("SIGSTOP {}", chaos.label(victim)));
    chaos.nodes[victim].signal("STOP");
    pause(LEASE_TTL * 2).await;
    chaos.note(format!("SIGCONT {}", chaos.label(victim)));
    chaos.nodes[victim].signal("CONT");
    pause(Duration::from_secs(3)).await;

    // Row 2: a node cut off from PostgreSQL past its TTL, then healed.
    let victim = rng.below(NODES);
    chaos.note(format!("cut {} from PostgreSQL", chaos.label(victim)));
    chaos.slots[victim].pg_proxy.set_cut(true);
    pause(LEASE_TTL * 2).await;
    chaos.note(format!("heal {} to PostgreSQL", chaos.label(victim)));
    chaos.slots[victim].pg_proxy.set_cut(false);
    pause(Duration::from_secs(3)).await;

    // Row 3: links into one node cut (the arbiter reachable), then every
    // node ↔ node link.
    let victim = rng.below(NODES);
    chaos.note(format!("cut the links into {}", chaos.label(victim)));
    chaos.slots[victim].peer_proxy.set_cut(true);
    pause(Duration::from_secs(3)).await;
    chaos.note(format!("heal the links into {}", chaos.label(victim)));
    chaos.slots[victim].peer_proxy.set_cut(false);
    pause(Duration::from_secs(2)).await;
    chaos.note("cut every node ↔ node link".to_owned());
    for slot in &chaos.slots {
        slot.peer_proxy.set_cut(true);
    }
    pause(Duration::from_secs(2)).await;
    chaos.note("heal every node ↔ node link".to_owned());
    for slot in &chaos.slots {
        slot.peer_proxy.set_cut(false);
    }
    pause(Duration::from_secs(2)).await;

    // Row 4: the arbiter goes away for everyone (past the TTL) and returns.
    chaos.note("stop PostgreSQL".to_owned());
    let stopping = pg.clone();
    tokio::task::spawn_blocking(move || stopping.stop())
        .await
        .expect("stopping PostgreSQL");
    pause(LEASE_TTL + Duration::from_secs(1)).await;
    chaos.note("start PostgreSQL".to_owned());
    let starting = pg.clone();
    tokio::task::spawn_blocking(move || starting.start_again())
        .await
        .expect("starting PostgreSQL");
    pause(Duration::from_secs(4)).await;

    chaos.note("faults over; waiting for every key to answer".to_owned());
    let urls = chaos.urls.read().expect("urls").clone();
    every_key_answers(&urls).await;
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.await.expect("a load worker panicked");
    }
    chaos.note("load stopped".to_owned());

    let runs = chaos.finish();
    let notes = chaos.notes.lock().expect("notes").clone();
    let summary = history::assert_single_ownership(&runs, &notes);
    let failures = tally.failures.lock().expect("tally").clone();
    println!(
        "chaos: passed in {:.1}s (seed {seed}): {summary}; load: {} calls and {} casts \
         answered, failures by code {failures:?}",
        chaos.started.elapsed().as_secs_f64(),
        tally.calls_ok.load(Ordering::Relaxed),
        tally.casts_ok.load(Ordering::Relaxed),
    );
    assert!(
        summary.processed > 0 && summary.fences > 0,
        "the run must have processed messages and fenced nodes: {summary}"
    );
    let _ = std::fs::remove_dir_all(&chaos.dir);
}

// ===========================================================================
// The checker bites: synthetic histories (times in ms from an origin)
// ===========================================================================

/// An origin for synthetic histories, in µs.
const T0: u64 = 1_700_000_000_000_000;

fn at(ms: u64, event: RecordedEvent) -> EventRecord {
    EventRecord {
        t_us: T0 + ms * 1000,
        node: String::new(),
        event,
    }
}

fn granted(ms: u64) -> EventRecord {
    at(ms, RecordedEvent::LeaseGranted { lease: ms })
}

/// A fence carried out at `ms` whose fence point was `fence_point_ms`.
fn fenced(ms: u64, fence_point_ms: u64) -> EventRecord {
    at(
        ms,
        RecordedEvent::Fenced {
            fence_point_us: T0 + fence_point_ms * 1000,
            cause: "the lease could not be renewed before the fence point".to_owned(),
        },
    )
}

fn started(ms: u64, key: &str) -> EventRecord {
    at(
        ms,
        RecordedEvent::KeyStarted {
            module: "probe".to_owned(),
            key: key.to_owned(),
        },
    )
}

fn ended(ms: u64, key: &str) -> EventRecord {
    at(
        ms,
        RecordedEvent::KeyEnded {
            module: "probe".to_owned(),
            key: key.to_owned(),
        },
    )
}

fn processed(ms: u64, key: &str, token: u64, digest: &str) -> EventRecord {
    at(
        ms,
        RecordedEvent::Processing {
            module: "probe".to_owned(),
            key: key.to_owned(),
            token,
            kind: MessageKind::Call,
            digest: digest.to_owned(),
        },
    )
}

/// A node process's history; `gone_ms` is when it was SIGKILLed.
fn run(label: &str, gone_ms: Option<u64>, mut records: Vec<EventRecord>) -> NodeRun {
    for record in &mut records {
        record.node = label.split('#').next().unwrap_or(label).to_owned();
    }
    NodeRun {
        label: label.to_owned(),
        records,
        gone_at_us: gone_ms.map(|ms| T0 + ms * 1000),
    }
}

/// `k1` lives on `n1#0` (SIGKILLed at 100 ms) and, from 3 s on, on `n2#0`;
/// each processes one message: `first` on n1, `second` on n2.
fn takeover_after_crash(first: EventRecord, second: EventRecord) -> [NodeRun; 2] {
    [
        run(
            "n1#0",
            Some(100),
            vec![granted(0), started(10, "k1"), first],
        ),
        run("n2#0", None, vec![granted(0), started(3000, "k1"), second]),
    ]
}

/// `k1` lives on `n1#0`, which is paused (SIGSTOP) at about 100 ms past
/// its fence point at 1500 ms and fences (and kills `k1`) when resumed at
/// 5000 ms; `k1` starts on `n2#0` at `takeover_ms`.
fn takeover_after_pause(takeover_ms: u64) -> [NodeRun; 2] {
    [
        run(
            "n1#0",
            None,
            vec![
                granted(0),
                started(10, "k1"),
                processed(20, "k1", 5, "a"),
                fenced(5000, 1500),
                ended(5001, "k1"),
            ],
        ),
        run(
            "n2#0",
            None,
            vec![
                granted(0),
                started(takeover_ms, "k1"),
                processed(takeover_ms + 10, "k1", 9, "b"),
            ],
        ),
    ]
}

fn violations(runs: &[NodeRun]) -> Vec<Violation> {
    history::check(runs, &[])
        .expect_err("the checker must reject this history")
        .violations
}

/// A crashed owner's key comes back on another node after the crash, with
/// a newer token; a paused owner's key comes back after its fence point,
/// though the paused node reports its fence (and kills the key) only when
/// resumed, long after.
#[test]
fn chaos_checker_accepts_takeovers_after_a_crash_and_after_a_pause() {
    let crash = takeover_after_crash(processed(20, "k1", 5, "a"), processed(3010, "k1", 9, "b"));
    let summary = history::check(&crash, &[]).expect("a clean history");
    assert_eq!((summary.lives, summary.processed), (2, 2));
    assert_eq!(
        summary.closest.after_crash,
        Some((2_900_000, "probe/k1".to_owned()))
    );

    let pause = takeover_after_pause(2100);
    let summary =
        history::check(&pause, &[]).expect("a paused owner replaced after its fence point is fine");
    assert_eq!(summary.lives_cut_at_fence, 1);
    assert_eq!(
        summary.closest.after_fence_point,
        Some((600_000, "probe/k1".to_owned()))
    );
}

/// The checker bites: two lives of one key on two nodes at once, with the
/// report naming both and tracing the key.
#[test]
fn chaos_checker_rejects_two_live_processes_of_one_key() {
    let runs = [
        run(
            "n1#0",
            None,
            vec![granted(0), started(10, "k1"), ended(1000, "k1")],
        ),
        run(
            "n2#0",
            None,
            vec![granted(0), started(500, "k1"), ended(600, "k1")],
        ),
    ];
    let failure = history::check(
        &runs,
        &[Note {
            t_us: T0 + 400_000,
            text: "cut n1 from PostgreSQL".to_owned(),
        }],
    )
    .expect_err("overlapping lives must fail the check");
    assert!(
        matches!(
            failure.violations.as_slice(),
            [Violation::Overlap { key, first, second }]
                if key == "probe/k1" && first.0 == "n1#0" && second.0 == "n2#0"
        ),
        "{failure}"
    );
    let report = failure.to_string();
    println!("{report}");
    for expected in [
        "two live processes of probe/k1: one started on n2#0",
        "key started probe/k1",
        "test   cut n1 from PostgreSQL",
    ] {
        assert!(report.contains(expected), "{expected:?} in:\n{report}");
    }
    let panic = std::panic::catch_unwind(|| history::assert_single_ownership(&runs, &[]))
        .expect_err("assert_single_ownership panics");
    let message = panic.downcast_ref::<String>().expect("a formatted message");
    assert!(message.contains("single ownership violated"), "{message}");
}

/// The checker bites: a takeover before the old owner's fence point (the
/// owner was paused and fenced late), and a takeover before a crashed
/// process was gone.
#[test]
fn chaos_checker_rejects_takeovers_before_the_fence_point_or_the_crash() {
    let early_after_pause = takeover_after_pause(1400);
    assert!(matches!(
        violations(&early_after_pause).as_slice(),
        [Violation::Overlap { .. }]
    ));
    let early_after_crash = [
        run("n1#0", Some(2000), vec![granted(0), started(10, "k1")]),
        run("n2#0", None, vec![granted(0), started(1000, "k1")]),
    ];
    assert!(matches!(
        violations(&early_after_crash).as_slice(),
        [Violation::Overlap { .. }]
    ));
}

/// The checker bites: one message handed to guests on two nodes.
#[test]
fn chaos_checker_rejects_a_message_processed_twice() {
    let runs = takeover_after_crash(processed(20, "k1", 5, "m"), processed(3010, "k1", 9, "m"));
    assert!(matches!(
        violations(&runs).as_slice(),
        [Violation::ProcessedTwice { first, second, .. }]
            if first.0 == "n1#0" && second.0 == "n2#0"
    ));
}

/// The checker bites: a node processing past its fence point (before the
/// fence was carried out), or before it ever had a lease.
#[test]
fn chaos_checker_rejects_processing_while_fenced() {
    let past_fence_point = [run(
        "n1#0",
        None,
        vec![
            granted(0),
            started(10, "k1"),
            processed(1100, "k1", 5, "a"),
            fenced(1200, 1000),
            ended(1201, "k1"),
        ],
    )];
    assert!(matches!(
        violations(&past_fence_point).as_slice(),
        [Violation::ProcessedWhileFenced { .. }]
    ));
    let before_any_lease = [run(
        "n1#0",
        None,
        vec![started(10, "k1"), processed(20, "k1", 5, "a"), granted(30)],
    )];
    assert!(
        violations(&before_any_lease)
            .iter()
            .any(|v| matches!(v, Violation::ProcessedWhileFenced { .. }))
    );
}

/// The checker bites: a later owner with an older token, or a new owner
/// with the same token.
#[test]
fn chaos_checker_rejects_a_token_that_goes_back() {
    for later_token in [5, 4] {
        let runs = takeover_after_crash(
            processed(20, "k1", 5, "a"),
            processed(3010, "k1", later_token, "b"),
        );
        assert!(matches!(
            violations(&runs).as_slice(),
            [Violation::TokenWentBack { .. }]
        ));
    }
}

/// The event log a node writes is what the checker reads; a line torn by a
/// kill mid-write at the end of a log is ignored.
#[test]
fn chaos_checker_reads_event_logs_with_a_torn_last_line() {
    let dir = fief_tests::test_logs_dir()
        .join("chaos")
        .join(unique_namespace("torn-line"));
    std::fs::create_dir_all(&dir).expect("creating a directory");
    let path = dir.join("n1#0.events.jsonl");
    let records = [granted(0), started(10, "k1"), processed(20, "k1", 5, "a")];
    let mut text: String = records
        .iter()
        .map(|r| serde_json::to_string(r).expect("a record serializes") + "\n")
        .collect();
    text.push_str("{\"t_us\":17000");
    std::fs::write(&path, text).expect("writing the log");
    let read = NodeRun::read("n1#0", &path, None);
    assert_eq!(read.records, records.to_vec());
    let _ = std::fs::remove_dir_all(&dir);
}
