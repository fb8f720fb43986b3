//! The `echo` rows of the realtime bench (issue 21 item 5, second row;
//! the module header of `realtime.rs` says what they measure): WebSocket
//! echo through keys beside a raw echo server, clients and server in one
//! process on the machine's cores.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fief::{Instance, ModuleOptions, NodeConfig};
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::common::{Mode, fmt_duration, guest, quantile, rss_bytes};
use crate::{KEY_MEMORY, PROBE_WASM, load_average, module_cpu};

/// A client's WebSocket connection.
type Client = WebSocketStream<MaybeTlsStream<tokio::net::TcpStream>>;

/// The echo's modules: the probe (its `handle_connection` echoes each
/// frame), deployed twice so that each shape's guest CPU time is its own.
/// [`ECHO`]: one connection per key.
const ECHO: &str = "echo";
/// [`ROOMS`]: the connections shared by [`ROOM_KEYS`] keys.
const ROOMS: &str = "rooms";
/// Keys of [`ROOMS`].
const ROOM_KEYS: usize = 10;
/// Bytes of each frame (text).
const FRAME_LEN: usize = 32;
/// Connects in flight at once while setting up.
const CONNECTING: usize = 64;
/// Longest a client waits for one echo before the bench gives up.
const ECHO_PATIENCE: Duration = Duration::from_secs(30);
/// Worker threads of the server runtime (the node's API, its socket tasks
/// and the raw echo server: as `fief node` on this machine) and of the
/// clients' runtime.
const SERVER_WORKERS: usize = 2;
const CLIENT_WORKERS: usize = 2;
/// Thread names, to split the process's CPU time.
const SERVER_THREADS: &str = "ws-server";
const CLIENT_THREADS: &str = "ws-client";
const GUEST_THREADS: &str = "fief-guest";

/// Where one side's clients connect.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// The raw echo server (axum's WebSocket, no key).
    Raw,
    /// A key each: `echo/c<i>`.
    Keys,
    /// [`ROOM_KEYS`] keys: `rooms/r<i % 10>`.
    Rooms,
}

impl Target {
    fn path(self, i: usize) -> String {
        match self {
            Target::Raw => format!("/v1/keys/raw/c{i}/connect"),
            Target::Keys => format!("/v1/keys/{ECHO}/c{i}/connect"),
            Target::Rooms => format!("/v1/keys/{ROOMS}/r{}/connect", i % ROOM_KEYS),
        }
    }

    /// The module whose guest CPU time is this side's.
    fn module(self) -> Option<&'static str> {
        match self {
            Target::Raw => None,
            Target::Keys => Some(ECHO),
            Target::Rooms => Some(ROOMS),
        }
    }
}

/// This process's threads: CPU seconds by group (the clients' runtime, the
/// server runtime, the node's guest threads, the rest), of which in the
/// kernel, and context switches.
#[derive(Clone, Copy, Default)]
struct ThreadCpu {
    groups: [f64; 4],
    sys: f64,
    switches: f64,
}

impl ThreadCpu {
    const GROUPS: [&'static str; 4] = ["clients", "server runtime", "guest threads", "other"];

    /// Now, from `/proc/self/task/*/stat` (utime and stime, in USER_HZ =
    /// 100 ticks a second: 10 ms steps) and `status` (voluntary and
    /// involuntary context switches).
    fn now() -> ThreadCpu {
        let mut cpu = ThreadCpu::default();
        let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
            return cpu;
        };
        for task in tasks.flatten() {
            let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
                continue;
            };
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                continue;
            };
            let name = &stat[open + 1..close];
            // Fields after the name start at field 3 (state): utime is 14,
            // stime 15.
            let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
            let ticks = |i: usize| -> f64 {
                fields
                    .get(i)
                    .and_then(|f| f.parse::<u64>().ok())
                    .map_or(0.0, |t| t as f64 / 100.0)
            };
            let group = if name.starts_with(CLIENT_THREADS) {
                0
            } else if name.starts_with(SERVER_THREADS) {
                1
            } else if name.starts_with(GUEST_THREADS) {
                2
            } else {
                3
            };
            cpu.groups[group] += ticks(11) + ticks(12);
            cpu.sys += ticks(12);
            let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
            cpu.switches += status
                .lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
                .sum::<f64>();
        }
        cpu
    }

    fn since(self, before: ThreadCpu) -> ThreadCpu {
        let mut d = ThreadCpu::default();
        for (i, v) in d.groups.iter_mut().enumerate() {
            *v = (self.groups[i] - before.groups[i]).max(0.0);
        }
        d.sys = (self.sys - before.sys).max(0.0);
        d.switches = (self.switches - before.switches).max(0.0);
        d
    }

    fn add(&mut self, other: ThreadCpu) {
        for (i, v) in self.groups.iter_mut().enumerate() {
            *v += other.groups[i];
        }
        self.sys += other.sys;
        self.switches += other.switches;
    }

    fn total(self) -> f64 {
        self.groups.iter().sum()
    }
}

/// One side of the echo: where its clients connect and what they measured.
struct EchoSide {
    name: String,
    target: Target,
    addr: std::net::SocketAddr,
    latencies: Vec<Duration>,
    messages: u64,
    measured: Duration,
    /// Messages per second of each round.
    rounds: Vec<f64>,
    cpu: ThreadCpu,
    /// Seconds of its module's callbacks (`cpu_seconds`).
    guest: f64,
    /// The process's CPU with this side's connections open and none
    /// sending, over the at-rest interval (first round only).
    at_rest: Option<ThreadCpu>,
}

impl EchoSide {
    fn messages_per_second(&self) -> f64 {
        self.messages as f64 / self.measured.as_secs_f64().max(1e-9)
    }

    /// The p50 and p99 of the round trips.
    fn p50_p99(&mut self) -> (Duration, Duration) {
        (
            quantile(&mut self.latencies, 0.5),
            quantile(&mut self.latencies, 0.99),
        )
    }

    /// CPU time per message of each thread group, and the module's
    /// callbacks.
    fn cpu_line(&self) -> String {
        let per = |seconds: f64| {
            fmt_duration(Duration::from_secs_f64(
                seconds / (self.messages.max(1) as f64),
            ))
        };
        let mut parts: Vec<String> = ThreadCpu::GROUPS
            .iter()
            .zip(self.cpu.groups)
            .map(|(group, seconds)| format!("{group} {}", per(seconds)))
            .collect();
        parts.push(format!(
            "total {} (in the kernel {:.0}%)",
            per(self.cpu.total()),
            100.0 * self.cpu.sys / self.cpu.total().max(1e-9)
        ));
        let mut line = parts.join(", ");
        line.push_str(&format!(
            "; {:.1} context switches per message",
            self.cpu.switches / self.messages.max(1) as f64
        ));
        if self.target.module().is_some() {
            line.push_str(&format!(
                "; the keys' handle_connection wall time (cpu_seconds) {}",
                per(self.guest)
            ));
        }
        line
    }
}

/// The raw baseline: axum's WebSocket (the library Fief's API uses), served
/// by `axum::serve` as plain as Fief's API (no `TCP_NODELAY` either), each
/// text or binary frame sent straight back.
async fn serve_raw_echo() -> std::net::SocketAddr {
    use axum::extract::ws::{Message as AxumMessage, WebSocket, WebSocketUpgrade};

    async fn echo(mut socket: WebSocket) {
        while let Some(Ok(message)) = socket.recv().await {
            match message {
                AxumMessage::Text(_) | AxumMessage::Binary(_) => {
                    if socket.send(message).await.is_err() {
                        return;
                    }
                }
                AxumMessage::Close(_) => return,
                AxumMessage::Ping(_) | AxumMessage::Pong(_) => {}
            }
        }
    }

    let router = axum::Router::new().route(
        "/v1/keys/{module}/{key}/connect",
        axum::routing::get(|upgrade: WebSocketUpgrade| async move { upgrade.on_upgrade(echo) }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("binding");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    addr
}

/// Open `n` connections to `target` on `addr`, [`CONNECTING`] at a time
/// (the clients' side sets `TCP_NODELAY`).
async fn connect_all(addr: std::net::SocketAddr, target: Target, n: usize) -> Vec<Client> {
    let gate = Arc::new(tokio::sync::Semaphore::new(CONNECTING));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let gate = gate.clone();
            let url = format!("ws://{addr}{}", target.path(i));
            tokio::spawn(async move {
                let _permit = gate.acquire().await.expect("the gate stays open");
                let (client, _) = tokio_tungstenite::connect_async_with_config(&url, None, true)
                    .await
                    .unwrap_or_else(|e| panic!("connecting to {url}: {e}"));
                client
            })
        })
        .collect();
    let mut clients = Vec::with_capacity(n);
    for task in tasks {
        clients.push(task.await.expect("a connecting task"));
    }
    clients
}

/// Every client sends a frame and awaits its echo, again and again, from a
/// common start for `length`; returns the clients and the round trips that
/// ended within it (a client's last, in flight at the end, is awaited but
/// not counted).
async fn echo_loop(
    clients: Vec<Client>,
    length: Duration,
    what: &str,
) -> (Vec<Client>, Vec<Duration>) {
    let start = tokio::time::Instant::now() + Duration::from_millis(20);
    let end = start + length;
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, mut client)| {
            let what = what.to_owned();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                tokio::time::sleep_until(start).await;
                let mut n = 0u64;
                while tokio::time::Instant::now() < end {
                    let text = format!("{i:06} {n:0width$}", width = FRAME_LEN - 7);
                    let sent = tokio::time::Instant::now();
                    client
                        .send(Message::text(text.clone()))
                        .await
                        .unwrap_or_else(|e| panic!("{what}: connection {i} failed to send: {e}"));
                    loop {
                        let frame = tokio::time::timeout(ECHO_PATIENCE, client.next())
                            .await
                            .unwrap_or_else(|_| {
                                panic!("{what}: connection {i} got no echo in {ECHO_PATIENCE:?}")
                            });
                        match frame {
                            Some(Ok(Message::Text(echo))) => {
                                assert_eq!(echo.as_str(), text, "{what}: connection {i}'s echo");
                                break;
                            }
                            Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                            other => panic!("{what}: connection {i} got {other:?} for an echo"),
                        }
                    }
                    let done = tokio::time::Instant::now();
                    if done <= end {
                        latencies.push(done - sent);
                    }
                    n += 1;
                }
                (client, latencies)
            })
        })
        .collect();
    let mut clients = Vec::with_capacity(tasks.len());
    let mut latencies = Vec::new();
    for task in tasks {
        let (client, l) = task.await.expect("a client task");
        clients.push(client);
        latencies.extend(l);
    }
    (clients, latencies)
}

/// Close every client (a close frame each, then the socket), concurrently.
async fn close_all(clients: Vec<Client>) {
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|mut client| {
            tokio::spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(5), client.close(None)).await;
            })
        })
        .collect();
    for task in tasks {
        let _ = task.await;
    }
}

/// Wait (polling, up to a minute) until `done`.
fn wait_for(side: &str, what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "echo, {side}: not {what} after 60 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// This process's peak resident set size (`VmHWM`), in bytes.
fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

fn echo_node_config(connections: usize) -> NodeConfig {
    let sockets = u32::try_from(connections + 64).expect("fits");
    NodeConfig {
        node_id: "echo".to_owned(),
        max_live_keys: u32::try_from(connections + ROOM_KEYS + 64).expect("fits"),
        max_memory_per_key: KEY_MEMORY,
        max_connections: sockets,
        max_connections_per_tenant: sockets,
        ..NodeConfig::default()
    }
}

fn echo_options(connections: usize) -> ModuleOptions {
    let keys = u32::try_from(connections + ROOM_KEYS + 64).expect("fits");
    ModuleOptions {
        max_live_keys: keys,
        memory_limit: KEY_MEMORY,
        idle_timeout: Duration::from_secs(3600),
        // A closed loop on loopback sends far more than the default 100
        // frames a second per connection.
        max_frames_per_second: 100_000,
        // `rooms`: all the connections on 10 keys.
        max_connections_per_key: u32::try_from(connections.max(64)).expect("fits"),
        ..ModuleOptions::default()
    }
}

/// CPU seconds of `module`'s callbacks on `node`.
fn callbacks(node: &Instance, module: Option<&str>) -> f64 {
    module.map_or(0.0, |m| module_cpu(&node.status(), m))
}

/// The echo's sides, by the filter that names each.
pub(crate) const ECHO_SIDES: [(&str, Target); 3] = [
    ("echo_raw", Target::Raw),
    ("echo_keys", Target::Keys),
    ("echo_rooms", Target::Rooms),
];

/// `echo`: `connections` clients in a closed loop through keys (one key
/// each; and all on [`ROOM_KEYS`] keys) beside the same clients against a
/// raw echo server, round by round in a rotating order. `wanted` picks the
/// sides (`echo_raw`, `echo_keys`, `echo_rooms`; `echo` all three).
pub(crate) fn echo(mode: Mode, wanted: &dyn Fn(&str) -> bool) -> Vec<String> {
    let connections = std::env::var("FIEF_BENCH_ECHO_CONNECTIONS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or_else(|| mode.pick(1_000usize, 200, 20));
    let rounds = mode.pick(3usize, 1, 1);
    let length = mode.pick(
        Duration::from_secs(3),
        Duration::from_secs(1),
        Duration::from_millis(200),
    );
    let warmup = mode.pick(
        Duration::from_millis(500),
        Duration::from_millis(300),
        Duration::from_millis(100),
    );
    let idle = mode.pick(
        Duration::from_secs(1),
        Duration::from_millis(300),
        Duration::from_millis(100),
    );
    let load_before = load_average();
    let files = fief::http_limits::raise_open_file_limit();
    let mut lines = Vec::new();
    let setup = Instant::now();
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(SERVER_WORKERS)
        .thread_name(SERVER_THREADS)
        .enable_all()
        .build()
        .expect("the server runtime");
    let clients_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(CLIENT_WORKERS)
        .thread_name(CLIENT_THREADS)
        .enable_all()
        .build()
        .expect("the clients' runtime");
    let probe = guest(PROBE_WASM);
    let node = Arc::new(
        server
            .block_on(
                Instance::builder(echo_node_config(connections))
                    .module(ECHO, probe.clone(), echo_options(connections))
                    .module(ROOMS, probe, echo_options(connections))
                    .start(),
            )
            .expect("the echo node starts"),
    );
    let (stop_api, api_stopped) = tokio::sync::oneshot::channel::<()>();
    let (fief_addr, api) = server.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding");
        let addr = listener.local_addr().expect("address");
        let api = tokio::spawn(fief::http::serve(node.clone(), listener, async move {
            let _ = api_stopped.await;
        }));
        (addr, api)
    });
    let raw_addr = server.block_on(serve_raw_echo());
    let mut sides: Vec<EchoSide> = ECHO_SIDES
        .iter()
        .filter(|(name, _)| wanted(name))
        .map(|&(_, target)| {
            let (name, addr) = match target {
                Target::Raw => ("raw echo (axum WebSocket, no key)".to_owned(), raw_addr),
                Target::Keys => (
                    format!("through keys, {connections} keys (one connection each)"),
                    fief_addr,
                ),
                Target::Rooms => (
                    format!(
                        "through keys, {} keys ({} connections each)",
                        ROOM_KEYS.min(connections),
                        connections.div_ceil(ROOM_KEYS)
                    ),
                    fief_addr,
                ),
            };
            EchoSide {
                name,
                target,
                addr,
                latencies: Vec::new(),
                messages: 0,
                measured: Duration::ZERO,
                rounds: Vec::new(),
                cpu: ThreadCpu::default(),
                guest: 0.0,
                at_rest: None,
            }
        })
        .collect();
    let setup = setup.elapsed();
    // Only the side being measured has connections open: the others' idle
    // sockets would cost it CPU (the node's socket tasks check their key's
    // owner every 250 ms).
    let mut between = Duration::ZERO;
    let measuring = Instant::now();
    for round in 0..rounds {
        for s in 0..sides.len() {
            let n = sides.len();
            let side = &mut sides[(s + round) % n];
            let opening = Instant::now();
            let clients = clients_rt.block_on(connect_all(side.addr, side.target, connections));
            if side.target != Target::Raw {
                // Every socket attached to its key (its `opened` handled).
                wait_for(&side.name, "every connection attached", || {
                    node.status().attached_connections >= connections
                });
            }
            let what = format!("{} (warm-up)", side.name);
            let clients = clients_rt.block_on(echo_loop(clients, warmup, &what)).0;
            if side.at_rest.is_none() {
                let before = ThreadCpu::now();
                std::thread::sleep(idle);
                side.at_rest = Some(ThreadCpu::now().since(before));
            }
            between += opening.elapsed();
            let (cpu, guest) = (ThreadCpu::now(), callbacks(&node, side.target.module()));
            let (clients, latencies) = clients_rt.block_on(echo_loop(clients, length, &side.name));
            side.cpu.add(ThreadCpu::now().since(cpu));
            side.guest += callbacks(&node, side.target.module()) - guest;
            side.rounds
                .push(latencies.len() as f64 / length.as_secs_f64());
            side.messages += latencies.len() as u64;
            side.measured += length;
            side.latencies.extend(latencies);
            let closing = Instant::now();
            clients_rt.block_on(close_all(clients));
            // The node has let every socket go and told the keys.
            wait_for(&side.name, "every connection closed", || {
                let status = node.status();
                status.sockets == 0 && status.attached_connections == 0
            });
            between += closing.elapsed();
        }
    }
    let measuring = measuring.elapsed();
    let load_after = load_average();
    let mut figures = Vec::new();
    for side in &mut sides {
        let (p50, p99) = side.p50_p99();
        figures.push((side.target, side.messages_per_second(), p50, p99));
        lines.push(format!(
            "echo, {}, {connections} connections, {rounds} × {:.1} s: {:.1} k messages/s \
             (rounds: {}) · round trip p50 {} p99 {} · CPU per message: {}",
            side.name,
            length.as_secs_f64(),
            side.messages_per_second() / 1e3,
            side.rounds
                .iter()
                .map(|r| format!("{:.1} k", r / 1e3))
                .collect::<Vec<_>>()
                .join(" / "),
            fmt_duration(p50),
            fmt_duration(p99),
            side.cpu_line(),
        ));
        if let Some(rest) = side.at_rest {
            let core = |seconds: f64| 100.0 * seconds / idle.as_secs_f64();
            lines.push(format!(
                "echo, {}, at rest ({connections} connections open, none sending, {:.1} s): \
                 server runtime {:.0}% of a core, guest threads {:.0}%, clients {:.0}%",
                side.name,
                idle.as_secs_f64(),
                core(rest.groups[1]),
                core(rest.groups[2]),
                core(rest.groups[0]),
            ));
        }
    }
    if let Some(&(_, raw_rate, raw_p50, raw_p99)) =
        figures.iter().find(|(target, ..)| *target == Target::Raw)
    {
        let ratios: Vec<String> = figures
            .iter()
            .filter(|(target, ..)| *target != Target::Raw)
            .map(|&(target, rate, p50, p99)| {
                let shape = match target {
                    Target::Rooms => format!("{} keys", ROOM_KEYS.min(connections)),
                    _ => format!("{connections} keys"),
                };
                format!(
                    "{shape} {:.2}× messages/s, p50 {:.2}×, p99 {:.2}×",
                    rate / raw_rate,
                    p50.as_secs_f64() / raw_p50.as_secs_f64().max(1e-9),
                    p99.as_secs_f64() / raw_p99.as_secs_f64().max(1e-9),
                )
            })
            .collect();
        if !ratios.is_empty() {
            lines.push(format!(
                "echo, through keys / raw: {} (target ≥ 0.5× messages/s)",
                ratios.join(" · ")
            ));
        }
    }
    lines.push(format!(
        "echo: load average before {load_before}, after {load_after}; set-up {:.1} s, \
         measuring {:.1} s (of which connecting, warming up, at rest and closing {:.1} s); \
         open-file limit {}; RSS {} MiB at the end (peak {} MiB); {SERVER_WORKERS} server \
         workers, {CLIENT_WORKERS} client workers, {FRAME_LEN}-byte text frames",
        setup.as_secs_f64(),
        measuring.as_secs_f64(),
        between.as_secs_f64(),
        fief::http_limits::shown(files.after.soft),
        rss_bytes() >> 20,
        peak_rss_bytes() >> 20,
    ));
    // Stop the API, then the node.
    drop(clients_rt);
    let _ = stop_api.send(());
    server.block_on(async {
        let _ = tokio::time::timeout(Duration::from_secs(10), api).await;
        if let Ok(node) = Arc::try_unwrap(node) {
            node.shutdown().await;
        }
    });
    lines
}
