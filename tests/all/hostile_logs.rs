//! Hostile guests against the node's log and its error paths (issue
//! "Hostile tenants cannot hurt the node or each other", findings 6 and 7).
//!
//! The `hostile` guest logs a 40 MB line, floods the log with lines, writes
//! 40 MB to stdout without a newline, logs one 60 MB string again and again
//! (the host's work, not the guest's), and hands the host 30 MB errors from
//! `handle-call`, `init` and `handle-fence`. Each test captures what the
//! node logs (a `tracing` subscriber on every thread of the test's own
//! runtime) and checks that it stays within a bound, that the attack is cut,
//! rate-limited or killed at its CPU limit, and that another module's key
//! answers during the attack and after it. No test asserts a speed. The
//! node's own lines that others can make it write as fast as they act (a
//! module's dead keys, refused peer connections) are bounded here too.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fief::config::ByteSize;
use fief::core::OnFence;
use fief::{Error, ModuleOptions};
use fief_tests::{HttpServer, eventually, guests, is_live};

use crate::fence_modes::{Lives, PATIENCE, observed_node, steady_config};
use crate::hostile::{during, hostile_options, node_with_config, stop};

/// The most one attack may add to the node's log here: a cut line (8 KiB
/// and its mark) and the node's own few lines, with room to spare.
const LOG_BOUND: usize = 64 * 1024;

/// Bytes of one truncation mark and a number, at most.
const MARK: usize = 64;

/// What the test's runtime logged (INFO and above), as `fmt` lines.
#[derive(Clone, Default)]
pub(crate) struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// The log from byte `from` on.
    pub(crate) fn since(&self, from: usize) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()[from..]).into_owned()
    }
}

/// The process's global subscriber while these tests run: it logs nothing
/// and decides nothing ahead. `tracing` caches each call site's interest,
/// and a call site first reached while no test's subscriber exists (or
/// while one is being made) would otherwise be cached as "never" and stay
/// silent for every later capture, so a test would miss lines (it did).
/// With this one every call site asks the thread's subscriber each time.
struct Undecided;

impl tracing::Subscriber for Undecided {
    fn register_callsite(&self, _: &tracing::Metadata<'_>) -> tracing::subscriber::Interest {
        tracing::subscriber::Interest::sometimes()
    }
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        false
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Run `test` on a two-worker runtime whose every thread (and this one)
/// logs into the capture it is given.
pub(crate) fn run_captured<F: Future<Output = ()>>(test: impl FnOnce(Captured) -> F) {
    static UNDECIDED: std::sync::Once = std::sync::Once::new();
    UNDECIDED.call_once(|| {
        // Another global subscriber would do as well, if one was set.
        let _ = tracing::subscriber::set_global_default(Undecided);
        tracing::callsite::rebuild_interest_cache();
    });
    let captured = Captured::default();
    let writer = captured.clone();
    let dispatch = tracing::Dispatch::new(
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish(),
    );
    let for_threads = dispatch.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .on_thread_start(move || {
            // For the thread's whole life.
            std::mem::forget(tracing::dispatcher::set_default(&for_threads));
        })
        .build()
        .expect("a runtime");
    let _guard = tracing::dispatcher::set_default(&dispatch);
    // A call site whose registration began before `Undecided` was set and
    // ended after: asked again now.
    tracing::callsite::rebuild_interest_cache();
    runtime.block_on(test(captured));
}

/// The hostile module's options for these tests: room for its 30–60 MB
/// strings (128 MiB of memory) and the test's own log rate.
/// A node with `hostile` (with `options`) and `probe`, whose calls wait up
/// to [`PATIENCE`]: pushing 40 MB through a guest's stdout, or a 30 MB
/// error through the host, takes a debug build seconds on a loaded machine
/// (the default 5 s timed out under `stress-ng --cpu 6`).
async fn node(options: ModuleOptions) -> Arc<fief::Instance> {
    let config = fief::NodeConfig {
        call_timeout: PATIENCE,
        ..fief_tests::test_config()
    };
    node_with_config(config, options).await
}

fn options(cpu_limit: Duration, lines_per_second: u32) -> ModuleOptions {
    ModuleOptions {
        memory_limit: ByteSize::mib(128),
        cpu_limit,
        max_log_lines_per_second: lines_per_second,
        ..hostile_options()
    }
}

/// Lines of `log` that contain `text`.
pub(crate) fn count(log: &str, text: &str) -> usize {
    log.lines().filter(|l| l.contains(text)).count()
}

/// The sum of the "N log lines (… bytes) of this key were dropped" notes.
fn noted_drops(log: &str) -> u64 {
    log.lines()
        .filter(|l| l.contains("were dropped: over its log rate limit"))
        .map(|l| {
            let (_, rest) = l.split_once("fief::guest: ").expect("a guest line");
            let (n, _) = rest.split_once(' ').expect("a count");
            n.parse::<u64>().expect("a number")
        })
        .sum()
}

/// The sum of the `withheld=N` fields of `log`'s lines: lines a
/// line budget withheld and the next line let through noted.
fn withheld(log: &str) -> u64 {
    log.lines()
        .filter_map(|l| {
            l.split_once("withheld=")?
                .1
                .split(' ')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// The value of `series` in the node's metrics text.
async fn metric(node: &fief::Instance, series: &str) -> u64 {
    let text = node.metrics_text().await;
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
}

fn text(reply: fief::Result<Vec<u8>>) -> String {
    String::from_utf8(reply.expect("a reply")).expect("UTF-8")
}

async fn attack(node: &Arc<fief::Instance>, key: &str, message: &str) -> fief::Result<Vec<u8>> {
    let (n, key, message) = (node.clone(), key.to_owned(), message.as_bytes().to_vec());
    during(node, async move { n.call("hostile", &key, message).await }).await
}

#[test]
fn a_huge_log_line_is_cut_to_the_line_cap_and_marked() {
    run_captured(|log| async move {
        let node = node(options(Duration::from_secs(5), 100)).await;
        let before = log.len();
        assert_eq!(text(attack(&node, "h", "log 40000000").await), "ok");
        let grown = log.since(before);
        assert!(
            grown.len() < LOG_BOUND,
            "the log grew {} bytes",
            grown.len()
        );
        let line = grown
            .lines()
            .find(|l| l.contains("[truncated: 40000000 bytes]"))
            .unwrap_or_else(|| panic!("no marked line in {grown:.2000}"));
        assert!(line.contains("key=\"h\""), "{line:.200}");
        assert!(line.len() < 8192 + 256, "{} bytes", line.len());
        assert_eq!(
            metric(
                &node,
                "fief_guest_log_lines_truncated_total{module=\"hostile\"}"
            )
            .await,
            1
        );
        stop(node).await;
    });
}

/// Send key `h` the flood `attack` (it answers `reply`), then kill it and
/// wait for its end (which notes the drops not noted yet); returns what was
/// logged meanwhile and the attack's whole seconds.
async fn flood_and_end(
    node: &Arc<fief::Instance>,
    log: &Captured,
    attack_message: &str,
    reply: &str,
) -> (String, u64) {
    let before = log.len();
    let started = Instant::now();
    assert_eq!(text(attack(node, "h", attack_message).await), reply);
    let elapsed = started.elapsed().as_secs();
    assert!(node.kill_key("hostile", "h"));
    eventually(PATIENCE, "the key ended", || !is_live(node, "hostile", "h")).await;
    (log.since(before), elapsed)
}

/// The host's own warnings about what a key did are under the key's log
/// rate too: 2 000 timers fired into a mailbox of 16 while the key is busy
/// wrote a `timer dropped` line each (nearly 2 000 lines from one callback,
/// and a module may arm 65 536); now at most the burst and the rate, and
/// the rest are counted and noted like the guest's own lines.
#[test]
fn the_hosts_warnings_about_a_key_are_under_its_log_rate() {
    run_captured(|log| async move {
        let node = node(ModuleOptions {
            max_timers_per_key: 2_000,
            mailbox_depth: 16,
            ..options(Duration::from_secs(30), 10)
        })
        .await;
        let (grown, elapsed) = flood_and_end(&node, &log, "timer-flood 2000", "2000").await;
        let logged = count(&grown, "dropped: the key's mailbox is full") as u64;
        let bound = 100 + 10 * (elapsed + 1);
        assert!(
            (1..=bound).contains(&logged),
            "{logged} `timer dropped` lines in {elapsed} s (burst and rate: {bound}):\n{grown:.3000}"
        );
        let dropped = metric(
            &node,
            "fief_guest_log_lines_dropped_total{module=\"hostile\"}",
        )
        .await;
        assert_eq!(
            noted_drops(&grown),
            dropped,
            "the notes add up:\n{grown:.3000}"
        );
        assert!(
            logged + dropped >= 2_000 - 16 - 2,
            "every timer past the mailbox's room is logged or counted: {logged} + {dropped}"
        );
        stop(node).await;
    });
}

/// A module whose every call traps, called as fast as a client can: each
/// death was a `key died` line, so a tenant could make the node log one
/// warning per request. Now a module's lines about dead keys pass at most
/// its burst and rate, and the next line let through notes how many were
/// withheld: lines and notes add up to every death, which the metric
/// counts too.
#[test]
fn a_module_whose_keys_keep_dying_is_logged_at_a_bounded_rate() {
    const DEATHS: u64 = 300;
    run_captured(|log| async move {
        let node = node(options(Duration::from_secs(5), 100)).await;
        let before = log.len();
        let started = Instant::now();
        for _ in 0..DEATHS {
            let reply = node.call("hostile", "r", b"recurse".to_vec()).await;
            assert!(matches!(reply, Err(Error::KeyDied(_))), "{reply:?}");
        }
        let elapsed = started.elapsed().as_secs();
        // A line is earned every 100 ms: the next death's line notes the
        // ones withheld.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let reply = node.call("hostile", "r", b"recurse".to_vec()).await;
        assert!(matches!(reply, Err(Error::KeyDied(_))), "{reply:?}");
        let grown = log.since(before);
        let logged = count(&grown, "key died") as u64;
        let bound = 100 + 10 * (elapsed + 1) + 1;
        assert!(
            logged <= bound,
            "{logged} `key died` lines in {elapsed} s (burst and rate: {bound})"
        );
        let withheld = withheld(&grown);
        assert_eq!(logged + withheld, DEATHS + 1, "{grown:.3000}");
        assert_eq!(
            metric(
                &node,
                "fief_key_kills_total{module=\"hostile\",cause=\"trap\"}"
            )
            .await,
            DEATHS + 1
        );
        stop(node).await;
    });
}

/// Not a guest, but the same flood from outside: anyone who reaches the
/// peer port can make the node refuse a connection, and each refusal was a
/// `warn` line. 300 connections that send a frame that is no handshake:
/// their lines pass at most the burst and the rate, and the next one let
/// through says how many were withheld.
#[test]
fn refused_peer_connections_are_logged_at_a_bounded_rate() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const CONNECTIONS: u64 = 300;
    run_captured(|log| async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let addr = listener.local_addr().expect("its address");
        let node = fief::Instance::builder(fief_tests::test_config())
            .peer_listener(listener)
            .start()
            .await
            .expect("node starts");
        let refuse = || async {
            let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
            stream.write_all(b"\0\0\0\x04junk").await.expect("send");
            // The node closes it once refused: one at a time.
            let mut buf = [0u8; 64];
            let _ = tokio::time::timeout(PATIENCE, stream.read(&mut buf)).await;
        };
        let before = log.len();
        let started = Instant::now();
        for _ in 0..CONNECTIONS {
            refuse().await;
        }
        let elapsed = started.elapsed().as_secs();
        tokio::time::sleep(Duration::from_millis(200)).await;
        refuse().await;
        let grown = log.since(before);
        let logged = count(&grown, "refusing a peer connection") as u64;
        let bound = 100 + 10 * (elapsed + 1) + 1;
        assert!(
            (1..=bound).contains(&logged),
            "{logged} refusal lines in {elapsed} s (burst and rate: {bound})"
        );
        let withheld = withheld(&grown);
        assert_eq!(logged + withheld, CONNECTIONS + 1, "{grown:.3000}");
        node.shutdown().await;
    });
}

#[test]
fn a_flood_of_log_lines_is_rate_limited_and_the_drops_counted() {
    run_captured(|log| async move {
        // 10 lines per second: a burst of 100.
        let node = node(options(Duration::from_secs(30), 10)).await;
        let (grown, elapsed) = flood_and_end(&node, &log, "log-lines 20000", "ok").await;
        let logged = count(&grown, "hostile line ") as u64;
        let bound = 100 + 10 * (elapsed + 1);
        assert!(
            logged <= bound,
            "{logged} lines logged in {elapsed} s, over the burst and the rate ({bound})"
        );
        assert!(logged >= 100, "the burst passed: {logged}");
        let dropped = metric(
            &node,
            "fief_guest_log_lines_dropped_total{module=\"hostile\"}",
        )
        .await;
        assert_eq!(logged + dropped, 20_000, "every line logged or counted");
        assert_eq!(
            noted_drops(&grown),
            dropped,
            "the notes add up:\n{grown:.3000}"
        );
        assert!(
            grown.len() < 20 * LOG_BOUND,
            "the log grew {} bytes",
            grown.len()
        );
        stop(node).await;
    });
}

#[test]
fn a_huge_stdout_line_is_cut_and_a_stdout_flood_rate_limited() {
    run_captured(|log| async move {
        let node = node(options(Duration::from_secs(30), 10)).await;
        let before = log.len();
        // 40 MB in 10 000 writes without a newline, then one.
        assert_eq!(text(attack(&node, "h", "print 4096 10000").await), "ok");
        let grown = log.since(before);
        assert!(
            grown.len() < LOG_BOUND,
            "the log grew {} bytes",
            grown.len()
        );
        let line = grown
            .lines()
            .find(|l| l.contains("[truncated: 40960000 bytes]"))
            .unwrap_or_else(|| panic!("no marked line in {grown:.2000}"));
        assert!(line.contains("stream=\"stdout\""), "{line:.200}");
        let started = Instant::now();
        assert_eq!(text(attack(&node, "h", "print-lines 20000").await), "ok");
        let elapsed = started.elapsed().as_secs();
        let logged = count(&log.since(before), "hostile stdout line ") as u64;
        // The burst less the line above, and the rate.
        assert!(
            logged <= 100 + 10 * (elapsed + 1),
            "{logged} lines in {elapsed} s"
        );
        assert!(
            metric(
                &node,
                "fief_guest_log_lines_dropped_total{module=\"hostile\"}"
            )
            .await
                > 0
        );
        stop(node).await;
    });
}

/// The host's work for a guest is the guest's: logging one 60 MB string a
/// hundred times costs the guest almost nothing (the string is made once),
/// but copying it out of its memory and cutting it costs the host, and that
/// time kills it at its 200 ms CPU limit (before: the hundred calls ran to
/// the end, seconds of host time).
#[test]
fn host_time_in_the_log_import_counts_against_the_cpu_limit() {
    run_captured(|log| async move {
        let node = node(options(Duration::from_millis(200), 100)).await;
        let before = log.len();
        let why = match attack(&node, "h", "log 60000000 100").await {
            Err(Error::KeyDied(why)) => why,
            other => panic!(
                "expected the CPU limit, got {:?}",
                other.map(String::from_utf8)
            ),
        };
        assert!(why.contains("CPU limit exceeded"), "{why}");
        assert!(why.contains("host imports"), "{why}");
        let logged = count(&log.since(before), "[truncated: 60000000 bytes]");
        assert!(logged < 100, "killed before the hundredth call: {logged}");
        // The key's next message starts a fresh process.
        assert_eq!(
            text(node.call("hostile", "h", b"ping".to_vec()).await),
            "pong"
        );
        stop(node).await;
    });
}

#[test]
fn a_huge_error_from_handle_call_comes_back_bounded() {
    run_captured(|log| async move {
        let node = node(options(Duration::from_secs(5), 100)).await;
        let before = log.len();
        let why = match attack(&node, "h", "error 30000000").await {
            Err(Error::Rejected(why)) => why,
            other => panic!(
                "expected a rejection, got {:?}",
                other.map(String::from_utf8)
            ),
        };
        assert!(why.len() <= 4096 + MARK, "{} bytes", why.len());
        assert!(why.starts_with("eeee"), "{why:.20}");
        assert!(why.ends_with("… [truncated: 30000000 bytes]"), "{why:.20}");
        // Over HTTP: the body is as bounded.
        let api = HttpServer::start(node.clone()).await;
        let response = reqwest::Client::new()
            .post(api.url("/v1/keys/hostile/h/call"))
            .body("error 30000000")
            .send()
            .await
            .expect("the API answers");
        assert!(response.status().is_client_error(), "{}", response.status());
        let body = response.text().await.expect("a body");
        assert!(body.len() < 8192, "a body of {} bytes", body.len());
        assert!(body.contains("[truncated: 30000000 bytes]"), "{body:.300}");
        assert!(log.since(before).len() < LOG_BOUND);
        drop(api);
        stop(node).await;
    });
}

#[test]
fn a_huge_init_refusal_is_bounded_in_the_reply_and_the_log() {
    run_captured(|log| async move {
        let node = node(options(Duration::from_secs(5), 100)).await;
        let before = log.len();
        for _ in 0..2 {
            // Each activation refuses again.
            let why = match attack(&node, "refuse-init-30000000", "ping").await {
                Err(Error::InitRefused(why)) => why,
                other => panic!("expected a refusal, got {:?}", other.map(String::from_utf8)),
            };
            assert!(why.len() <= 4096 + MARK, "{} bytes", why.len());
            assert!(why.ends_with("… [truncated: 30000000 bytes]"), "{why:.20}");
        }
        let grown = log.since(before);
        assert_eq!(count(&grown, "key failed to start"), 2, "{grown:.2000}");
        assert!(
            grown.len() < LOG_BOUND,
            "the log grew {} bytes",
            grown.len()
        );
        stop(node).await;
    });
}

/// `handle-fence`'s stop reason is cut where it enters the host, before it
/// goes anywhere (here: back to the key's `terminate`, which logs its length).
#[test]
fn a_huge_fence_stop_reason_is_cut_where_it_enters_the_host() {
    run_captured(|log| async move {
        let lives = Lives::default();
        // Room for a deadline of 10 s inside the fence margin.
        let config = fief::NodeConfig {
            fence_margin: Duration::from_secs(15),
            ..steady_config()
        };
        let node = observed_node(
            config,
            &lives,
            &[(
                "hostile",
                guests::HOSTILE,
                ModuleOptions {
                    on_fence: OnFence::Callback,
                    // Handing the host the 30 MB reason takes a while on a
                    // loaded machine: the default 50 ms deadline killed the
                    // key before it answered (under a load average of 7-8),
                    // and 1 s did under `stress-ng --cpu 6`.
                    handle_fence_deadline: Duration::from_secs(10),
                    ..options(Duration::from_secs(5), 100)
                },
            )],
        )
        .await;
        let key = "fence-stop-30000000";
        assert_eq!(
            text(node.call("hostile", key, b"ping".to_vec()).await),
            "pong"
        );
        node.fence_now();
        eventually(PATIENCE, "the key stopped", || lives.ended("hostile", key)).await;
        let logged = log.since(0);
        let line = logged
            .lines()
            .find(|l| l.contains("terminate: fenced, "))
            .unwrap_or_else(|| panic!("terminate logged nothing:\n{logged:.3000}"));
        let (_, rest) = line.split_once("terminate: fenced, ").unwrap();
        let bytes: usize = rest.split(' ').next().unwrap().parse().unwrap();
        assert!(
            bytes <= 4096 + MARK,
            "terminate got a reason of {bytes} bytes"
        );
    });
}
