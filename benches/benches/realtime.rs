//! Realtime keys (issue 21 item 5, `docs/realtime.md`): fan-out of one
//! publication to many subscribers, across a cluster and on one node; and a
//! WebSocket echo through keys beside a raw echo server. A table-printing
//! harness (one line per figure).
//!
//! - `fanout`: `SUBSCRIBERS` keys of the `probe` test guest, each subscribed
//!   to the topic `fanout`, spread by key hash over **3 in-process nodes**
//!   (one shared in-process arbiter, the peer links on real loopback
//!   sockets; the bench `Cluster` of `common/mod.rs`) — beside the same
//!   number of subscribers on **one node** (the baseline: no peer hop),
//!   measured in the same process and the same run, sample by sample
//!   interleaved (the order alternating), so load drifts fall on both
//!   alike. Once a publication counts every subscriber (the interest of
//!   every node has reached the publisher's), each sample publishes one
//!   payload from a key that is not a subscriber (`publish fanout
//!   <payload>`, a call to the probe deployed a second time as the module
//!   `publishing`, through its owner's node, from a runtime worker) and
//!   measures the time from the call to the moment the **last subscriber's
//!   key task has taken the publication out of its mailbox** (p50 / p99).
//!
//! How "the last subscriber has it" is seen, without touching the keys: a
//! queued message holds host bytes on its key's ledger until the key task
//! takes it out of the mailbox (`host/src/mailbox.rs`), and a node reports
//! the sum per tenant in [`fief::Instance::status`]. So a node is done with
//! a sample when (1) the publication has reached it — its subscribers'
//! guest CPU time (`status().modules`' `cpu_seconds` of `probe`, which
//! nothing else moves) has grown since the publish, or on the publisher's
//! node the publisher's call has returned (its `publish` import, which
//! fills that node's mailboxes, is over), or on another node its host bytes
//! went up — and (2) its host bytes are back at their level between
//! samples. This thread polls the nodes' `status()` while the call runs,
//! with a short sleep between polls (a spinning poller would take a core
//! from the keys being measured; the guest threads run at nice 10), and
//! takes the time of the poll that saw a node done: each figure is an
//! upper bound, within one poll step (printed) of the event. After a
//! publication is taken out, the key's `handle-info` runs (a few µs of
//! guest code), not included. At the end every subscriber's `events` are
//! read (untimed) to check that each sampled publication reached every
//! subscriber exactly once.
//!
//! Also printed: the publisher's callback time (`cpu_seconds` of
//! `publishing`: the wall time of its polls, the `publish` import that
//! fills its node's mailboxes and queues one copy per peer included), and
//! when its call returned (late: a callback still running at its first
//! epoch tick is handed from the caller to the key's task, which waits for
//! its turn behind the subscribers just woken). The publisher's
//! `cpu_limit` is raised to 10 s: a `publish` to 10 000 local subscribers
//! can pass the default 100 ms of wall time on a loaded machine (seen at
//! load average 10: the publisher was killed).
//!
//! Sizes (full / `-- --quick` / `cargo test --benches`): `SUBSCRIBERS`
//! 10 000 / 2 000 / 200, samples 100 / 30 / 3 per side. 10 000 subscribers
//! on both sides (four nodes in one process, about 23 000 live-key slots)
//! need `vm.max_map_count` raised (`sysctl -w vm.max_map_count=262144`);
//! without it the bench says so and measures 2 000.
//!
//! - `echo` (the second row of item 5): 1 000 WebSocket clients,
//!   each sending a 32-byte text frame and awaiting its echo in a closed
//!   loop, for a fixed time (per-message round trip p50 / p99, and
//!   messages/s), on three sides measured in the same run: `echo_raw`, a
//!   raw echo server (axum's WebSocket, the library Fief's API uses, on
//!   `axum::serve`: no key); `echo_keys`, through one in-process node's
//!   HTTP API (`GET /v1/keys/echo/c<i>/connect`), one key of the probe per
//!   connection (its `handle_connection` sends each frame back); and
//!   `echo_rooms`, the same clients on 10 keys (`rooms/r0`…`r9`). The node
//!   (embedded arbiter, `max_frames_per_second` 100 000), its API and the
//!   raw server run on a 2-worker runtime, `SERVER_THREADS` (as `fief node`
//!   on this machine); the clients on another 2-worker runtime,
//!   `CLIENT_THREADS`, in the same process: **clients and servers share
//!   the machine's cores**. Sides take turns, round by round in a rotating
//!   order; only the side being measured has connections open (each round
//!   connects, waits until the node has attached every connection to its
//!   key, warms up, measures, closes and waits until the node has let every
//!   socket go). Also printed, per side: CPU time per message of each
//!   thread group (`/proc/self/task`: the clients, the server runtime, the
//!   node's guest threads), the share in the kernel, context switches per
//!   message, the keys' `handle_connection` wall time (`cpu_seconds`), and
//!   the CPU with every connection open and none sending (once per side);
//!   then the ratio to raw (the target: ≥ 0.5× raw's messages/s), and the
//!   load average before and after.
//!
//! Sizes of `echo` (full / `--quick` / `cargo test --benches`):
//! connections 1 000 / 200 / 20, rounds 3 / 1 / 1 of 3 s / 1 s / 0.2 s
//! per side (~40 s / ~5 s / ~2 s in all); `FIEF_BENCH_ECHO_CONNECTIONS=n`
//! sets the connections (1: one client's round trip, nothing queued). It
//! raises the soft open-file limit to the hard one (as `fief node` does;
//! 2 000 sockets a side).
//!
//! Run with `cargo bench -p fief-benches --bench realtime`; a filter picks
//! sections (`-- fanout`, `-- echo`, or one side: `-- echo_keys`); figures
//! are in `docs/benchmarks.md`.

mod common;
#[path = "realtime/echo.rs"]
mod echo;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Cluster, Mode, fmt_duration, guest, map_count, max_map_count, quantile, rss_bytes};
use fief::config::ByteSize;
use fief::{Instance, ModuleOptions, NodeConfig};

/// The probe test guest, built from source by `build.rs`.
const PROBE_WASM: &str = env!("FIEF_GUEST_PROBE");
/// The subscribers' module (the probe).
const PROBE: &str = "probe";
/// The publisher's module: the probe again, deployed under another name so
/// that its guest CPU time is not the subscribers' (topics are shared by the
/// modules of one tenant, here of none).
const PUBLISHING: &str = "publishing";
/// The topic every subscriber is subscribed to.
const TOPIC: &str = "fanout";
/// The publishing key (of [`PUBLISHING`]: not a subscriber).
const PUBLISHER: &str = "publisher";
/// The publisher's `cpu_limit` (see [`publisher_options`]).
const PUBLISHER_CPU_LIMIT: Duration = Duration::from_secs(10);
/// Nodes of the cross-node side.
const NODES: usize = 3;
/// Partitions of the namespace (as the other cluster benches).
const PARTITIONS: u32 = 64;
/// Largest linear memory of a key: sizes each pool slot's reservation.
const KEY_MEMORY: ByteSize = ByteSize::mib(64);
/// Concurrent callers while subscribing and checking.
const CALLERS: usize = 8;
/// Sleep between two polls of the nodes' status.
const POLL_SLEEP: Duration = Duration::from_micros(100);
/// Longest a sample may take before the bench gives up.
const SAMPLE_LIMIT: Duration = Duration::from_secs(30);
/// Unmeasured publications per side before the samples.
const WARMUP: usize = 3;
/// Memory mappings the runtime counts per live-key slot, and spare per node
/// (`host/src/runtime.rs`).
const MAPPINGS_PER_KEY: u64 = 6;
const MAPPINGS_SPARE: u64 = 4096;

fn key_name(i: usize) -> String {
    format!("s{i}")
}

/// Live-key slots of one node holding `keys` of the subscribers (a quarter
/// more than its even share: key hashes do not spread evenly) and the
/// publisher.
fn slots(keys: usize) -> u32 {
    u32::try_from(keys + keys / 4 + 64).expect("fits")
}

fn node_config(node_id: String, slots: u32) -> NodeConfig {
    NodeConfig {
        node_id,
        partitions: PARTITIONS,
        max_live_keys: slots,
        max_memory_per_key: KEY_MEMORY,
        // The publisher's cpu_limit is over the default ceiling.
        module_ceilings: fief::ModuleCeilings {
            cpu_limit: PUBLISHER_CPU_LIMIT,
            ..fief::ModuleCeilings::default()
        },
        ..NodeConfig::default()
    }
}

fn probe_options(slots: u32) -> ModuleOptions {
    ModuleOptions {
        max_live_keys: slots,
        memory_limit: KEY_MEMORY,
        // Keys idle between samples must not be retired (their
        // subscriptions would go with them).
        idle_timeout: Duration::from_secs(3600),
        ..ModuleOptions::default()
    }
}

/// The publisher's: a publish import that fills 10 000 mailboxes is
/// charged to its callback, which can pass the default 100 ms under load.
fn publisher_options() -> ModuleOptions {
    ModuleOptions {
        cpu_limit: PUBLISHER_CPU_LIMIT,
        ..probe_options(16)
    }
}

/// Mapping slots both sides need at `subscribers` (as the nodes check them).
fn mappings_needed(subscribers: usize) -> u64 {
    let cross = NODES as u64 * u64::from(slots(subscribers / NODES));
    let local = u64::from(slots(subscribers));
    (cross + local) * MAPPINGS_PER_KEY + (NODES as u64 + 1) * MAPPINGS_SPARE + map_count() as u64
}

async fn call(node: &Instance, module: &str, key: &str, message: String) -> String {
    let reply = node
        .call(module, key, message.clone().into_bytes())
        .await
        .unwrap_or_else(|e| panic!("{module}/{key} {message:?}: {e}"));
    String::from_utf8(reply).expect("a UTF-8 reply")
}

/// Host bytes a node holds for its keys, over every tenant.
fn host_bytes(status: &fief::Status) -> usize {
    status.host_bytes.iter().map(|t| t.bytes).sum()
}

/// Seconds the keys of `module` have run on a node (their callbacks' polls,
/// host imports included).
fn module_cpu(status: &fief::Status, module: &str) -> f64 {
    status
        .modules
        .iter()
        .filter(|m| m.name == module)
        .map(|m| m.cpu_seconds)
        .sum()
}

/// Seconds the subscribers' guest code has run on a node.
fn guest_cpu(status: &fief::Status) -> f64 {
    module_cpu(status, PROBE)
}

/// One publication's timings.
#[derive(Clone, Copy)]
struct Sample {
    /// Until `publish` (the publisher's call) returned.
    returned: Duration,
    /// The publisher's callback time (its `publish` import, which fills the
    /// mailboxes of its node's subscribers and queues one copy per peer,
    /// included).
    publisher_cpu: Duration,
    /// Until the publisher's node was done.
    home: Duration,
    /// Until the last other node was done (zero on one node).
    remote: Duration,
    /// Until every node was done: the last delivery.
    last: Duration,
}

/// Nodes holding `subscribers` subscribers of [`TOPIC`], one of which holds
/// the publisher.
struct Side {
    name: &'static str,
    nodes: Arc<Vec<Instance>>,
    subscribers: usize,
    /// The node that owns [`PUBLISHER`].
    home: usize,
    /// Each node's host bytes between samples.
    baseline: Vec<usize>,
    /// Time spent polling, and polls made (the poll step).
    polling: Duration,
    polls: u64,
}

impl Side {
    /// Subscribe `subscribers` keys through the nodes in turn (each call is
    /// routed to the key's owner), place the publisher, and wait until a
    /// publication counts them all.
    async fn new(name: &'static str, nodes: Vec<Instance>, subscribers: usize) -> Side {
        let nodes = Arc::new(nodes);
        let tasks: Vec<_> = (0..CALLERS)
            .map(|t| {
                let nodes = nodes.clone();
                tokio::spawn(async move {
                    for i in (t..subscribers).step_by(CALLERS) {
                        let node = &nodes[i % nodes.len()];
                        let reply =
                            call(node, PROBE, &key_name(i), format!("subscribe {TOPIC}")).await;
                        assert_eq!(reply, "ok", "subscribing {}", key_name(i));
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("a subscribing task");
        }
        call(&nodes[0], PUBLISHING, PUBLISHER, "ping".to_owned()).await;
        let home = nodes
            .iter()
            .position(|n| n.keys().iter().any(|k| k.key == PUBLISHER))
            .expect("the publisher is live on a node");
        let want = subscribers.to_string();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let count = call(
                &nodes[home],
                PUBLISHING,
                PUBLISHER,
                format!("publish {TOPIC} ready"),
            )
            .await;
            if count == want {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{name}: a publication still counts {count} of {want} subscribers after 60 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut side = Side {
            name,
            nodes,
            subscribers,
            home,
            baseline: Vec::new(),
            polling: Duration::ZERO,
            polls: 0,
        };
        side.settle().await;
        side
    }

    /// Wait until every node's host bytes and guest CPU time stay still for
    /// 100 ms, and take those host bytes as the level between samples.
    async fn settle(&mut self) {
        let read = |nodes: &[Instance]| -> Vec<(usize, f64)> {
            nodes
                .iter()
                .map(|n| {
                    let s = n.status();
                    (host_bytes(&s), guest_cpu(&s))
                })
                .collect()
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut before = read(&self.nodes);
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = read(&self.nodes);
            if now == before {
                self.baseline = now.iter().map(|(bytes, _)| *bytes).collect();
                return;
            }
            assert!(Instant::now() < deadline, "{}: never settled", self.name);
            before = now;
        }
    }

    /// Subscribers live on each node (the publisher aside).
    fn spread(&self) -> String {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let live = n.keys().iter().filter(|k| k.key != PUBLISHER).count();
                let home = if i == self.home { " (publisher)" } else { "" };
                format!("{live}{home}")
            })
            .collect::<Vec<_>>()
            .join(" + ")
    }

    /// Publish `payload` and time it until every node is done with it. The
    /// publisher's call runs on a runtime worker (as a call from the API or
    /// a peer link would) while this thread polls the nodes, so a late
    /// reply delays nothing measured.
    async fn sample(&mut self, payload: &str) -> Sample {
        let nodes = self.nodes.clone();
        let cpu_before: Vec<f64> = nodes.iter().map(|n| guest_cpu(&n.status())).collect();
        let publisher_before = module_cpu(&nodes[self.home].status(), PUBLISHING);
        let returned = Arc::new(AtomicBool::new(false));
        let start = Instant::now();
        let publish = {
            let (nodes, returned, home) = (nodes.clone(), returned.clone(), self.home);
            let message = format!("publish {TOPIC} {payload}");
            tokio::spawn(async move {
                let count = call(&nodes[home], PUBLISHING, PUBLISHER, message).await;
                let at = start.elapsed();
                returned.store(true, Ordering::SeqCst);
                (count, at)
            })
        };
        let mut arrived = vec![false; nodes.len()];
        let mut done: Vec<Option<Duration>> = vec![None; nodes.len()];
        loop {
            let poll = Instant::now();
            for (i, node) in nodes.iter().enumerate() {
                if done[i].is_some() {
                    continue;
                }
                let at = start.elapsed();
                // Read before the status: true means the publish import
                // (which fills this node's mailboxes) has returned.
                let home_filled = i == self.home && returned.load(Ordering::SeqCst);
                let status = node.status();
                let bytes = host_bytes(&status);
                // Subscribers' guest code ran, or (on another node, where
                // nothing else is queued) messages wait: it has arrived.
                arrived[i] |= home_filled
                    || guest_cpu(&status) > cpu_before[i]
                    || (i != self.home && bytes > self.baseline[i]);
                if arrived[i] && bytes == self.baseline[i] {
                    done[i] = Some(at);
                }
            }
            self.polling += poll.elapsed();
            self.polls += 1;
            if done.iter().all(Option::is_some) {
                break;
            }
            assert!(
                start.elapsed() < SAMPLE_LIMIT,
                "{}: {payload} not taken by every subscriber within {SAMPLE_LIMIT:?}: {done:?}, \
                 host bytes {:?} (between samples {:?})",
                self.name,
                nodes
                    .iter()
                    .map(|n| host_bytes(&n.status()))
                    .collect::<Vec<_>>(),
                self.baseline,
            );
            // Not a spin: the keys being measured need the cores.
            std::thread::sleep(POLL_SLEEP);
        }
        let (count, returned) = publish.await.expect("the publishing task");
        let publisher_cpu = Duration::from_secs_f64(
            (module_cpu(&nodes[self.home].status(), PUBLISHING) - publisher_before).max(0.0),
        );
        assert_eq!(
            count,
            self.subscribers.to_string(),
            "{}: {payload} counted",
            self.name
        );
        let done: Vec<Duration> = done.into_iter().map(Option::unwrap_or_default).collect();
        let remote = done
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != self.home)
            .map(|(_, d)| *d)
            .max()
            .unwrap_or_default();
        Sample {
            returned,
            publisher_cpu,
            home: done[self.home],
            remote,
            last: done.iter().copied().max().unwrap_or_default(),
        }
    }

    /// Check (untimed) that every subscriber got each of `payloads` once;
    /// returns how many did not.
    async fn check(&self, payloads: &[String]) -> usize {
        let payloads = Arc::new(payloads.to_vec());
        let subscribers = self.subscribers;
        let tasks: Vec<_> = (0..CALLERS)
            .map(|t| {
                let (nodes, payloads) = (self.nodes.clone(), payloads.clone());
                tokio::spawn(async move {
                    let mut wrong = 0;
                    for i in (t..subscribers).step_by(CALLERS) {
                        let node = &nodes[i % nodes.len()];
                        let events = call(node, PROBE, &key_name(i), "events".to_owned()).await;
                        let got: Vec<&str> = events
                            .lines()
                            .filter_map(|e| e.strip_prefix("pub:fanout:"))
                            .collect();
                        if payloads
                            .iter()
                            .any(|p| got.iter().filter(|g| **g == p.as_str()).count() != 1)
                        {
                            wrong += 1;
                        }
                    }
                    wrong
                })
            })
            .collect();
        let mut wrong = 0;
        for task in tasks {
            wrong += task.await.expect("a checking task");
        }
        wrong
    }

    async fn shutdown(self) {
        let nodes = Arc::try_unwrap(self.nodes)
            .ok()
            .expect("no task holds the nodes");
        for node in nodes {
            node.shutdown().await;
        }
    }
}

/// The p50 / p99 of one field of the samples.
fn p50_p99(samples: &[Sample], field: impl Fn(&Sample) -> Duration) -> (Duration, Duration) {
    let mut v: Vec<Duration> = samples.iter().map(field).collect();
    (quantile(&mut v, 0.5), quantile(&mut v, 0.99))
}

fn pair((p50, p99): (Duration, Duration)) -> String {
    format!("p50 {} p99 {}", fmt_duration(p50), fmt_duration(p99))
}

/// `fanout`: one publication to `SUBSCRIBERS` subscribers over three nodes,
/// beside one node.
async fn fanout(mode: Mode) -> Vec<String> {
    let mut lines = Vec::new();
    let mut subscribers = mode.pick(10_000usize, 2_000, 200);
    let samples = mode.pick(100usize, 30, 3);
    let (needed, limit) = (mappings_needed(subscribers), max_map_count());
    if limit > 0 && needed > limit {
        lines.push(format!(
            "fanout: {subscribers} subscribers on both sides need about {needed} memory \
             mappings, but vm.max_map_count is {limit} (raise it: `sysctl -w \
             vm.max_map_count=262144`); measuring 2000 instead"
        ));
        subscribers = 2_000;
    }
    let setup = Instant::now();
    let probe = guest(PROBE_WASM);
    let cluster = Cluster::start(
        NODES,
        |i| node_config(format!("n{i}"), slots(subscribers / NODES)),
        &[
            (
                PROBE,
                probe.as_slice(),
                probe_options(slots(subscribers / NODES)),
            ),
            (PUBLISHING, probe.as_slice(), publisher_options()),
        ],
    )
    .await;
    let nodes: Vec<Instance> = cluster.nodes.into_iter().flatten().collect();
    let mut cross = Side::new("cross-node", nodes, subscribers).await;
    let single = Instance::builder(node_config("solo".to_owned(), slots(subscribers)))
        .module(PROBE, probe.clone(), probe_options(slots(subscribers)))
        .module(PUBLISHING, probe.clone(), publisher_options())
        .start()
        .await
        .expect("the single node starts");
    let mut local = Side::new("one node", vec![single], subscribers).await;
    let setup = setup.elapsed();
    for w in 0..WARMUP {
        cross.sample(&format!("warm{w}")).await;
        local.sample(&format!("warm{w}")).await;
    }
    // The warm-ups and the interest checks are done: take the level again.
    cross.settle().await;
    local.settle().await;
    let (mut c, mut l) = (Vec::new(), Vec::new());
    let mut payloads = Vec::new();
    let measuring = Instant::now();
    for s in 0..samples {
        let payload = format!("p{s}");
        // Alternate which side goes first.
        if s % 2 == 0 {
            c.push(cross.sample(&payload).await);
            l.push(local.sample(&payload).await);
        } else {
            l.push(local.sample(&payload).await);
            c.push(cross.sample(&payload).await);
        }
        payloads.push(payload);
        // Let the last handle-info callbacks finish.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let measuring = measuring.elapsed();
    let rss = rss_bytes();
    let (cross_wrong, local_wrong) = (cross.check(&payloads).await, local.check(&payloads).await);
    let (c_last, l_last) = (p50_p99(&c, |s| s.last), p50_p99(&l, |s| s.last));
    lines.push(format!(
        "fanout, {subscribers} subscribers over {NODES} nodes ({}), {samples} samples: \
         last delivery {} · publisher's callback time {} · publish returned {} · \
         publisher's node done {} · other nodes done {}",
        cross.spread(),
        pair(c_last),
        pair(p50_p99(&c, |s| s.publisher_cpu)),
        pair(p50_p99(&c, |s| s.returned)),
        pair(p50_p99(&c, |s| s.home)),
        pair(p50_p99(&c, |s| s.remote)),
    ));
    lines.push(format!(
        "fanout, {subscribers} subscribers on one node, {samples} samples: last delivery {} · \
         publisher's callback time {} · publish returned {}",
        pair(l_last),
        pair(p50_p99(&l, |s| s.publisher_cpu)),
        pair(p50_p99(&l, |s| s.returned)),
    ));
    lines.push(format!(
        "fanout, cross-node / one node: {:.2}× (p50), {:.2}× (p99)",
        c_last.0.as_secs_f64() / l_last.0.as_secs_f64(),
        c_last.1.as_secs_f64() / l_last.1.as_secs_f64(),
    ));
    let step = |side: &Side| {
        fmt_duration(side.polling / u32::try_from(side.polls.max(1)).unwrap_or(u32::MAX))
    };
    lines.push(format!(
        "fanout: poll step {} (cross-node) / {} (one node) plus a {} sleep; \
         subscribers that missed a sampled publication or got one twice: {cross_wrong} \
         (cross-node), {local_wrong} (one node); set-up {:.1} s, measuring {:.1} s, RSS {} MiB",
        step(&cross),
        step(&local),
        fmt_duration(POLL_SLEEP),
        setup.as_secs_f64(),
        measuring.as_secs_f64(),
        rss >> 20,
    ));
    assert_eq!(
        (cross_wrong, local_wrong),
        (0, 0),
        "every subscriber gets every publication once"
    );
    cross.shutdown().await;
    local.shutdown().await;
    lines
}

pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = Mode::from_args(&args);
    let wanted = common::sections(&args[1..]);
    if wanted("fanout") {
        println!(
            "realtime figures, fanout ({mode:?} mode; load average {})",
            load_average()
        );
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        for line in runtime.block_on(fanout(mode)) {
            println!("{line}");
        }
        drop(runtime);
        println!("(load average after: {})", load_average());
    }
    if echo::ECHO_SIDES.iter().any(|(name, _)| wanted(name)) {
        println!("realtime figures, echo ({mode:?} mode)");
        for line in echo::echo(mode, &wanted) {
            println!("{line}");
        }
    }
}
