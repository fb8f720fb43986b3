//! Helpers for failure tests that run real `fief node` processes against the
//! PostgreSQL arbiter: the test database, unique namespaces, a TCP proxy that
//! can cut a node off from PostgreSQL (or slow its link), and node child
//! processes with their logs captured to files. Used by
//! `tests/all/processes.rs` and the other multi-process tests.

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// Where the tests expect PostgreSQL (CI starts it there).
pub const PG_ADDR: &str = "127.0.0.1:5432";
/// The database the tests use (created if missing).
pub const TEST_DATABASE: &str = "fief_test";

/// The fast but valid timings these tests use: TTL 2 s, renewal every
/// 400 ms, fence margin 500 ms (renewal ≤ (TTL − margin) / 2; drift of
/// 1% of 2 s ≤ half the margin; handle-fence deadline 50 ms + kill bound
/// 10 ms + drift 20 ms ≤ margin).
pub const FAST_TIMINGS: [&str; 6] = [
    "--lease-ttl",
    "2s",
    "--renew-interval",
    "400ms",
    "--fence-margin",
    "500ms",
];

/// The arbiter URL of the test database, reached through `addr`
/// (PostgreSQL itself, or a [`PgProxy`]).
pub fn arbiter_url(addr: &str) -> String {
    format!("postgres://postgres@{addr}/{TEST_DATABASE}")
}

async fn connect(dbname: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let mut config = tokio_postgres::Config::new();
    config
        .host("127.0.0.1")
        .port(5432)
        .user("postgres")
        .dbname(dbname)
        .connect_timeout(Duration::from_secs(5));
    let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

fn unreachable(e: &tokio_postgres::Error) -> ! {
    panic!(
        "PostgreSQL is not reachable at {PG_ADDR} as user postgres: {e:?}. \
         These tests need a running PostgreSQL (trust auth for user postgres); CI starts \
         one. Locally, start PostgreSQL on {PG_ADDR}."
    )
}

/// A connection to the test database, creating the database first if it
/// is missing (a concurrent create by another test is fine). Panics with
/// a clear message if PostgreSQL cannot be reached: these tests fail
/// rather than skip without it.
pub async fn test_database() -> tokio_postgres::Client {
    match connect(TEST_DATABASE).await {
        Ok(client) => return client,
        // 3D000 invalid_catalog_name: the database does not exist.
        Err(e) if e.as_db_error().map(|d| d.code().code()) == Some("3D000") => {}
        Err(e) => unreachable(&e),
    }
    let admin = connect("postgres")
        .await
        .unwrap_or_else(|e| unreachable(&e));
    if let Err(e) = admin
        .batch_execute(&format!("CREATE DATABASE {TEST_DATABASE}"))
        .await
    {
        // 42P04 duplicate_database; 23505 unique_violation when two
        // creates race on the catalog's unique index.
        let code = e.as_db_error().map(|d| d.code().code().to_owned());
        if !matches!(code.as_deref(), Some("42P04" | "23505")) {
            panic!("creating the database {TEST_DATABASE}: {e:?}");
        }
    }
    connect(TEST_DATABASE)
        .await
        .unwrap_or_else(|e| unreachable(&e))
}

/// A namespace no other test (in this run, a concurrent run or an
/// earlier one) uses: the test name, the process id, a counter and the
/// time.
pub fn unique_namespace(test: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or_default();
    format!("{test}-{}-{n}-{micros}", std::process::id())
}

/// Delete a namespace's rows from the arbiter's and the storage's tables
/// (best effort; for the end of a passing test, once its nodes are gone),
/// so a long-lived test database does not grow with every run.
pub async fn drop_namespace(db: &tokio_postgres::Client, namespace: &str) {
    for table in [
        "fief_storage_entries",
        "fief_storage_alarms",
        "fief_storage_usage",
        "fief_storage_fences",
        "fief_module_versions",
        "fief_modules",
        "fief_partitions",
        "fief_leases",
        "fief_namespaces",
    ] {
        let _ = db
            .execute(
                &format!("DELETE FROM {table} WHERE namespace = $1"),
                &[&namespace],
            )
            .await;
    }
}

/// A TCP proxy from a local port to a target address that can be cut:
/// while cut, it copies no bytes in either direction on any connection,
/// old or new, and closes none, so requests through it hang until they
/// time out (a network partition, not a refused connection). Uncut, it
/// resumes every connection where it stopped, like a healed network whose
/// TCP retransmissions get through. It can also add latency. A
/// connection whose target refuses it is closed. Stops when dropped.
pub struct TcpProxy {
    /// `127.0.0.1:<port>`, where the proxy listens.
    pub addr: String,
    link: watch::Sender<Link>,
    task: JoinHandle<()>,
}

/// A [`TcpProxy`] to PostgreSQL ([`TcpProxy::start`]), to cut a node off
/// from its arbiter.
pub type PgProxy = TcpProxy;

/// The state of a [`PgProxy`]'s link.
#[derive(Clone, Copy, Debug, Default)]
struct Link {
    /// Copy nothing.
    cut: bool,
    /// Hold every chunk this long before passing it on (each way).
    delay: Duration,
}

impl TcpProxy {
    /// Start a proxy to PostgreSQL at [`PG_ADDR`] on a free port (in the
    /// current tokio runtime, which must keep running: use a
    /// multi-threaded test runtime and never block it).
    pub async fn start() -> TcpProxy {
        TcpProxy::start_to(PG_ADDR).await
    }

    /// Start a proxy to `target` (`host:port`) on a free port, like
    /// [`TcpProxy::start`].
    pub async fn start_to(target: &str) -> TcpProxy {
        let target: Arc<str> = Arc::from(target);
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the proxy on 127.0.0.1:0");
        let addr = listener
            .local_addr()
            .expect("the proxy's address")
            .to_string();
        let (link, link_rx) = watch::channel(Link::default());
        let task = tokio::spawn(async move {
            // Owned by this task: aborting it drops every connection.
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        connections.spawn(proxy_connection(
                            client,
                            target.clone(),
                            link_rx.clone(),
                        ));
                    }
                    Some(_) = connections.join_next() => {}
                }
            }
        });
        TcpProxy { addr, link, task }
    }

    /// The arbiter URL of the test database through this proxy (for a
    /// proxy to [`PG_ADDR`]).
    pub fn arbiter_url(&self) -> String {
        arbiter_url(&self.addr)
    }

    /// Stop (`true`) or resume (`false`) forwarding.
    pub fn set_cut(&self, cut: bool) {
        self.link.send_modify(|link| link.cut = cut);
    }

    /// Hold every chunk of bytes `delay` before passing it on, in each
    /// direction (a round trip takes `2 × delay` longer).
    pub fn set_delay(&self, delay: Duration) {
        self.link.send_modify(|link| link.delay = delay);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Wait while the proxy is cut; the delay to apply, or `None` if the
/// proxy is gone.
async fn while_cut(link: &mut watch::Receiver<Link>) -> Option<Duration> {
    loop {
        let now = *link.borrow_and_update();
        if !now.cut {
            return Some(now.delay);
        }
        link.changed().await.ok()?;
    }
}

async fn proxy_connection(client: TcpStream, target: Arc<str>, mut link: watch::Receiver<Link>) {
    // Accepted while cut: the client waits, unanswered.
    if while_cut(&mut link).await.is_none() {
        return;
    }
    let Ok(server) = TcpStream::connect(&*target).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pump(client_read, server_write, link.clone());
    let down = pump(server_read, client_write, link);
    let _ = tokio::join!(up, down);
}

/// Copy `from` to `to` until either closes, pausing (reading nothing,
/// writing nothing) while cut.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut link: watch::Receiver<Link>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if while_cut(&mut link).await.is_none() {
            return;
        }
        tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => {
                    // Bytes read just as the cut came wait for the heal.
                    let Some(delay) = while_cut(&mut link).await else {
                        return;
                    };
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    if to.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            },
            changed = link.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
    }
}

/// Settings of one `fief node` child.
#[derive(Clone, Debug)]
pub struct NodeSpec {
    /// `--node-id`.
    pub node_id: String,
    /// `--namespace`.
    pub namespace: String,
    /// `--arbiter`.
    pub arbiter: String,
    /// `--deploy NAME=PATH` entries.
    pub deploy: Vec<(String, String)>,
    /// Further arguments (e.g. [`FAST_TIMINGS`]).
    pub extra_args: Vec<String>,
}

/// A `fief node` child process (HTTP API and peer transport on free
/// ports) with its stdout and stderr captured to a log file under
/// `target/test-logs/` ([`super::test_logs_dir`]). SIGKILLed when
/// dropped; if the thread is panicking (a failed test), prints where its
/// log is and the log's tail and keeps the log, otherwise deletes it.
pub struct ClusterNode {
    child: Child,
    /// Its node id.
    pub node_id: String,
    /// `http://127.0.0.1:<port>`: the HTTP API.
    pub url: String,
    /// The log file (`RUST_LOG=info`, and `debug` for the key tasks).
    pub log: PathBuf,
    client: reqwest::Client,
}

/// A failed HTTP call: status and the error's `code`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallError {
    /// HTTP status; 0 if no response came (refused, timed out).
    pub status: u16,
    /// The API's machine-readable code (`no response` if none came).
    pub code: String,
    /// The body, or the transport error.
    pub body: String,
}

impl ClusterNode {
    /// Spawn `fief node` ([`super::fief_command`]). Does not wait: see
    /// [`ClusterNode::wait_current`].
    pub async fn spawn(spec: &NodeSpec) -> ClusterNode {
        let peer_listen = format!("127.0.0.1:{}", super::free_port());
        ClusterNode::spawn_with_peer_listen(spec, &peer_listen).await
    }

    /// [`ClusterNode::spawn`] with the peer transport on `peer_listen`
    /// (`127.0.0.1:<port>`), for a test that puts a [`TcpProxy`] in
    /// front of it or restarts the node on the same address.
    pub async fn spawn_with_peer_listen(spec: &NodeSpec, peer_listen: &str) -> ClusterNode {
        let listen = format!("127.0.0.1:{}", super::free_port());
        let log = super::test_logs_dir().join(format!("{}-{}.log", spec.namespace, spec.node_id));
        let file = std::fs::File::create(&log).expect("creating the node's log file");
        let stdout = file.try_clone().expect("cloning the log file handle");
        let mut command = super::fief_command();
        command
            .arg("node")
            .args(["--arbiter", &spec.arbiter])
            .args(["--namespace", &spec.namespace])
            .args(["--node-id", &spec.node_id])
            .args(["--listen", &listen])
            .args(["--peer-listen", peer_listen])
            .args(["--max-live-keys", "64"]);
        for (name, path) in &spec.deploy {
            command.arg("--deploy").arg(format!("{name}={path}"));
        }
        let child = command
            .args(&spec.extra_args)
            // A key's end is logged by its task, at `debug` when the key
            // was one of many killed at once (a fence's): the tests read
            // those lines too.
            .env(
                "RUST_LOG",
                "info,fief::key::task=debug,fief::node::sockets=debug",
            )
            .env("NO_COLOR", "1")
            .env_remove("FIEF_CONFIG")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(file)
            .spawn()
            .expect("starting fief node");
        ClusterNode {
            child,
            node_id: spec.node_id.clone(),
            url: format!("http://{listen}"),
            log,
            client: reqwest::Client::new(),
        }
    }

    /// Send `token` (`Authorization: Bearer`) with every request this
    /// handle makes from now on: for a node started with `--tokens`.
    pub fn use_token(&mut self, token: &str) {
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(
            reqwest::header::AUTHORIZATION,
            format!("Bearer {token}")
                .parse()
                .expect("a token fits a header"),
        );
        self.client = reqwest::Client::builder()
            .default_headers(headers)
            .build()
            .expect("an HTTP client");
    }

    /// `GET /v1/status`, or `None` if no answer came within 2 s.
    pub async fn status(&self) -> Option<serde_json::Value> {
        self.status_within(Duration::from_secs(2)).await
    }

    /// `GET /v1/status`, or `None` if no answer came within `timeout`.
    pub async fn status_within(&self, timeout: Duration) -> Option<serde_json::Value> {
        let response = self
            .client
            .get(format!("{}/v1/status", self.url))
            .timeout(timeout)
            .send()
            .await
            .ok()?;
        response.json().await.ok()
    }

    /// Wait (at most `limit`) until the node reports a current lease;
    /// panics, showing its log, if it exits or does not get there.
    pub async fn wait_current(&mut self, limit: Duration) -> serde_json::Value {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(status) = self.status().await
                && status["lease"] == "current"
            {
                return status;
            }
            if let Ok(Some(exit)) = self.child.try_wait() {
                panic!(
                    "fief node {} exited before its lease was current ({exit}); log {}",
                    self.node_id,
                    self.log.display(),
                );
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "fief node {} had no current lease within {limit:?}; log {}",
                self.node_id,
                self.log.display()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// `POST /v1/keys/{module}/{key}/call` with `message`: the reply as
    /// text, or the failure (no answer within 5 s is a failure too).
    pub async fn call(&self, module: &str, key: &str, message: &str) -> Result<String, CallError> {
        self.call_within(module, key, message, Duration::from_secs(5))
            .await
    }

    /// [`ClusterNode::call`], retrying (for up to 10 s) the refusals the
    /// API documents as "retry": `unowned` (a move is under way),
    /// `not_owner` and `fenced`, all answered before the key processed
    /// anything (contract §5 row 8: "calls see at most brief errors").
    /// Any other error is returned at once.
    pub async fn call_settled(
        &self,
        module: &str,
        key: &str,
        message: &str,
    ) -> Result<String, CallError> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match self.call(module, key, message).await {
                Err(e)
                    if e.status == 503
                        && matches!(e.code.as_str(), "unowned" | "not_owner" | "fenced")
                        && std::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                result => return result,
            }
        }
    }

    /// Like [`ClusterNode::call`], failing if no answer came within
    /// `timeout`.
    pub async fn call_within(
        &self,
        module: &str,
        key: &str,
        message: &str,
        timeout: Duration,
    ) -> Result<String, CallError> {
        call_url(&self.client, &self.url, module, key, message, timeout).await
    }

    /// SIGKILL the process and reap it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The node's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of the node's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            eprintln!(
                "---- log of fief node {} ({}), last lines:\n{}\n----",
                self.node_id,
                self.log.display(),
                self.log_tail(40)
            );
            eprintln!("{}", crate::failure::why_the_test_failed());
        } else {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

// -----------------------------------------------------------------------
// Signals, exits and restarts (pause/resume, graceful leave, rolling
// restart tests)
// -----------------------------------------------------------------------

impl ClusterNode {
    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Send the child `signal` (a name `kill(1)` knows: `STOP`, `CONT`,
    /// `TERM`, ...) with `kill -<signal> <pid>`; panics if `kill` fails.
    pub fn signal(&self, signal: &str) {
        crate::send_signal(self.pid(), signal, &format!("fief node {}", self.node_id));
    }

    /// `fief leave --node <this node>`, then wait at most `limit` for the
    /// process to exit on its own. Panics, with the CLI's output, if the
    /// leave fails, the node still runs after `limit`, or it exits
    /// unsuccessfully.
    pub async fn leave_and_exit(&mut self, limit: Duration) {
        let url = self.url.clone();
        let output =
            tokio::task::spawn_blocking(move || crate::fief_cli(&["leave", "--node", &url]))
                .await
                .expect("running fief leave");
        assert!(
            output.status.success(),
            "fief leave --node {} failed ({}): {}{}",
            self.url,
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let exit = self.wait_exit(limit).await.unwrap_or_else(|| {
            panic!(
                "{} still runs {limit:?} after `fief leave` returned; it must stop on its own",
                self.node_id
            )
        });
        assert!(
            exit.success(),
            "{} exited with {exit} after leaving",
            self.node_id
        );
    }

    /// Wait at most `limit` for the child to exit on its own: its exit
    /// status, or `None` if it is still running.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Ok(Some(exit)) = self.child.try_wait() {
                return Some(exit);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Move the log file to `<log>.<suffix>.log` (kept or deleted like
    /// any node's log), so a node started again with the same id and
    /// namespace writes its own log at the usual path.
    pub fn rename_log(&mut self, suffix: &str) {
        let renamed = self.log.with_extension(format!("{suffix}.log"));
        std::fs::rename(&self.log, &renamed).unwrap_or_else(|e| {
            panic!(
                "renaming {} to {}: {e}",
                self.log.display(),
                renamed.display()
            )
        });
        self.log = renamed;
    }
}

/// `POST {url}/v1/keys/{module}/{key}/call` with `message` through
/// `client`, as [`ClusterNode::call_within`] does, for callers that must
/// not borrow a [`ClusterNode`] (one restarted while they run).
pub async fn call_url(
    client: &reqwest::Client,
    url: &str,
    module: &str,
    key: &str,
    message: &str,
    timeout: Duration,
) -> Result<String, CallError> {
    post_key(client, url, module, key, "call", message, timeout).await
}

/// `POST {url}/v1/keys/{module}/{key}/{verb}` (`call` or `cast`) with
/// `message`: the body of a `2xx` answer (a cast's `202` means the node
/// accepted it; it may still be lost), or the failure.
pub async fn post_key(
    client: &reqwest::Client,
    url: &str,
    module: &str,
    key: &str,
    verb: &str,
    message: &str,
    timeout: Duration,
) -> Result<String, CallError> {
    let response = client
        .post(format!("{url}/v1/keys/{module}/{key}/{verb}"))
        .body(message.to_owned())
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| CallError {
            status: 0,
            code: "no response".to_owned(),
            body: e.to_string(),
        })?;
    let status = response.status().as_u16();
    let body = response.text().await.unwrap_or_default();
    if (200..300).contains(&status) {
        return Ok(body);
    }
    let code = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
        .unwrap_or_default();
    Err(CallError { status, code, body })
}
