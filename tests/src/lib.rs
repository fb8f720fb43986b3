//! Shared helpers for Fief's integration tests: the guest components (built
//! from source by `build.rs`), small conveniences for starting nodes, polling,
//! serving the HTTP API on a real socket, and running the `fief` binary.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use fief::{Instance, ModuleOptions, NodeConfig};

pub mod etcd;
pub mod failure;
pub mod history;
pub mod multiprocess;
pub mod scratch_postgres;
pub mod storage_backend;
pub mod ws;

/// Send process `pid` (`what`, for the messages) `signal`, a name `kill(1)`
/// knows (`STOP`, `CONT`, `TERM`, ...), with `kill -<signal> <pid>`; panics
/// if `kill` fails.
pub fn send_signal(pid: u32, signal: &str, what: &str) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .unwrap_or_else(|e| panic!("running kill -{signal} {pid} ({what}): {e}"));
    assert!(
        status.success(),
        "kill -{signal} {pid} ({what}) failed: {status}"
    );
}

/// The guest components, built from source for these tests.
pub mod guests {
    /// `examples/counter`: `incr`, `get`, `tick-every <ms>`.
    pub const COUNTER: &str = env!("FIEF_GUEST_COUNTER");
    /// `examples/room`: pub/sub history.
    pub const ROOM: &str = env!("FIEF_GUEST_ROOM");
    /// `tests/guests/probe`: exercises every host import and export.
    pub const PROBE: &str = env!("FIEF_GUEST_PROBE");
    /// `tests/guests/spin`: infinite loops in callbacks.
    pub const SPIN: &str = env!("FIEF_GUEST_SPIN");
    /// `tests/guests/bomb`: memory, recursion, reply and flood bombs.
    pub const BOMB: &str = env!("FIEF_GUEST_BOMB");
    /// `tests/guests/quiet`: subscribes in `init`, unsubscribes and answers
    /// `continue` in `handle-fence` (the fence-mode page's sanctioned pairing).
    pub const QUIET: &str = env!("FIEF_GUEST_QUIET");
    /// `tests/guests/hostile`: an attack from every callback and import, for
    /// the hostile-guest suite.
    pub const HOSTILE: &str = env!("FIEF_GUEST_HOSTILE");
    /// `tests/guests/keeper`: one blob of state of any size, handed off
    /// as it is.
    pub const KEEPER: &str = env!("FIEF_GUEST_KEEPER");
    /// `examples/stored-counter`: `incr`, `get`, `reset`, kept in storage.
    pub const STORED_COUNTER: &str = env!("FIEF_GUEST_STORED_COUNTER");
    /// `examples/reminders`: durable alarms (`set`, `cancel`, `alarms`,
    /// `fired`), their firings logged in storage.
    pub const REMINDERS: &str = env!("FIEF_GUEST_REMINDERS");
    /// `examples/chat`: a chat room over WebSocket connections (every text
    /// frame sent to every connection; `history`, `connections`, `say`).
    pub const CHAT: &str = env!("FIEF_GUEST_CHAT");
    /// `tests/guests/vault`: every storage import and the output gate,
    /// driven by text commands.
    pub const VAULT: &str = env!("FIEF_GUEST_VAULT");
    /// `tests/guests/legacy`: a counter built against the frozen
    /// `fief:key@0.1.0` WIT, without the SDK.
    pub const LEGACY: &str = env!("FIEF_GUEST_LEGACY");
    /// `examples/counter-py`: `counter` in Python (componentize-py).
    pub const COUNTER_PY: &str = env!("FIEF_GUEST_COUNTER_PY");
    /// `examples/counter-js`: `counter` in JavaScript (componentize-js).
    pub const COUNTER_JS: &str = env!("FIEF_GUEST_COUNTER_JS");
    /// `examples/room-js`: `room` in JavaScript (pub/sub history).
    pub const ROOM_JS: &str = env!("FIEF_GUEST_ROOM_JS");
    /// `examples/chat-js`: `chat` in JavaScript (a chat room over WebSocket
    /// connections, its history kept as the Rust one keeps it).
    pub const CHAT_JS: &str = env!("FIEF_GUEST_CHAT_JS");
    /// `examples/chat-py`: `chat` in Python (the same room, its history kept
    /// as the Rust and JavaScript ones keep it).
    pub const CHAT_PY: &str = env!("FIEF_GUEST_CHAT_PY");
    /// `tests/polyglot/probe-py`: the Python SDK driven by text commands
    /// (`call`, `spin`, `fail`, `crash`, ...); its WebSocket connections
    /// echo each frame, as the Rust probe's do.
    pub const PROBE_PY: &str = env!("FIEF_GUEST_PROBE_PY");
    /// `tests/polyglot/probe-js`: the same commands (and echo) in JavaScript.
    pub const PROBE_JS: &str = env!("FIEF_GUEST_PROBE_JS");

    /// The bytes of a guest component.
    pub fn bytes(path: &str) -> Vec<u8> {
        std::fs::read(path).unwrap_or_else(|e| panic!("reading guest {path}: {e}"))
    }
}

/// A node configuration for tests: a random free port is not needed (the
/// library API does not listen), small pools so engines are cheap.
pub fn test_config() -> NodeConfig {
    NodeConfig {
        max_live_keys: 256,
        max_memory_per_key: fief::config::ByteSize::mib(128),
        // Tests of the other kill paths (kill_key, the fence, the table
        // limit) give their spinning keys a CPU limit they never reach.
        module_ceilings: fief::ModuleCeilings {
            cpu_limit: Duration::from_secs(3600),
            ..fief::ModuleCeilings::default()
        },
        ..NodeConfig::default()
    }
}

/// Start an embedded node and deploy `modules` (name, guest path) with
/// default options.
pub async fn node_with(modules: &[(&str, &str)]) -> Instance {
    let modules: Vec<_> = modules
        .iter()
        .map(|(name, path)| (*name, *path, ModuleOptions::default()))
        .collect();
    node_with_options(test_config(), &modules).await
}

/// Start an embedded node with `config` and deploy `modules` (name, guest
/// path, options).
pub async fn node_with_options(
    config: NodeConfig,
    modules: &[(&str, &str, ModuleOptions)],
) -> Instance {
    let node = Instance::start_embedded(config).await.expect("node starts");
    for (name, path, options) in modules {
        node.deploy(name, &guests::bytes(path), options.clone())
            .await
            .unwrap_or_else(|e| panic!("deploying {name}: {e}"));
    }
    node
}

/// The value of the metric line of `text` (OpenMetrics, as `/metrics` and
/// `Instance::metrics_text` render it) that starts with `series` (name and
/// labels exactly as rendered), if there is one.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
}

/// Call `key` of `module` with a text message and return the reply as text;
/// panics (naming the call) if the call fails.
pub async fn call_text(node: &Instance, module: &str, key: &str, message: &str) -> String {
    let reply = node
        .call(module, key, message.as_bytes().to_vec())
        .await
        .unwrap_or_else(|e| panic!("call {module}/{key} {message:?} failed: {e}"));
    String::from_utf8(reply).expect("the reply is UTF-8")
}

/// Whether `key` of `module` has a live process on `node`.
pub fn is_live(node: &Instance, module: &str, key: &str) -> bool {
    node.keys()
        .iter()
        .any(|k| k.module == module && k.key == key)
}

/// Poll `check` every 10 ms until it is true, failing after `limit`.
pub async fn eventually(limit: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Like [`eventually`], for checks that must await (for example a call).
pub async fn eventually_async<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Wait (at most 10 s) until `key`, a `slow-terminate…` key of the hostile
/// guest, has begun its `terminate` (which then blocks for 1.5 s): it says
/// so in cache namespace `terminating` first.
pub async fn slow_terminate_begun(node: &Instance, key: &str) {
    let cache = node.cache();
    eventually_async(
        Duration::from_secs(10),
        "the key's terminate to begin",
        || {
            let cache = cache.clone();
            async move {
                cache
                    .get("terminating", key)
                    .await
                    .expect("cache get")
                    .is_some()
            }
        },
    )
    .await;
}

/// The node's HTTP API served on a real socket (127.0.0.1, a free port) until
/// dropped.
pub struct HttpServer {
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl HttpServer {
    /// Serve `instance` with [`fief::http::serve`] in a spawned task.
    pub async fn start(instance: Arc<Instance>) -> HttpServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding 127.0.0.1:0");
        let addr = listener.local_addr().expect("the listener's address");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(fief::http::serve(instance, listener, async {
            let _ = rx.await;
        }));
        HttpServer {
            base: format!("http://{addr}"),
            shutdown: Some(tx),
        }
    }

    /// `base` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// A core module in the WebAssembly text format, made a component of the
/// `fief:key/key-module` world with wit-component from the repository's
/// WIT: for hostile and malformed guests Rust cannot emit (`table.grow`, an
/// initial memory or data segment of any size).
pub fn component_from_wat(text: &str) -> Vec<u8> {
    let root = workspace_root();
    let mut module = wat::parse_str(text).expect("the WAT parses");
    let mut resolve = wit_parser::Resolve::default();
    let (package, _) = resolve.push_dir(root.join("wit")).expect("the WIT package");
    let world = resolve
        .select_world(&[package], Some("key-module"))
        .expect("the key-module world");
    wit_component::embed_component_metadata(
        &mut module,
        &resolve,
        world,
        wit_component::StringEncoding::UTF8,
        false,
    )
    .expect("embedding the world");
    wit_component::ComponentEncoder::default()
        .module(&module)
        .expect("a core module with the world's metadata")
        .validate(true)
        .encode()
        .expect("a component")
}

/// The workspace root (the parent of `tests/`).
pub fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
}

/// Where the tests keep the logs of the processes they run:
/// `target/test-logs/` of the workspace (created if missing).
pub fn test_logs_dir() -> PathBuf {
    // Whoever keeps logs here prints their tails on a panic; the panic's
    // message is kept to be repeated after them.
    failure::keep_panic_messages();
    let dir = workspace_root().join("target").join("test-logs");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

/// The `fief` binary the CLI and multi-process tests run: this package's
/// `fief-cli` bin (built from `host/src/main.rs` in the same build as the
/// tests; cargo builds a package's binaries before running its integration
/// tests, so it is never stale), or `$FIEF_BIN` if set.
///
/// Cargo gives the bin's path to integration tests as `CARGO_BIN_EXE_fief-cli`,
/// which this library (compiled as their dependency) cannot see at compile
/// time: it takes it from the environment when cargo sets it there, and
/// otherwise finds the bin next to the running test executable
/// (`<target>/<profile>/deps/all-<hash>` → `<target>/<profile>/fief-cli`).
pub fn fief_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        let name = format!("fief-cli{}", std::env::consts::EXE_SUFFIX);
        let binary = std::env::var_os("FIEF_BIN")
            .or_else(|| std::env::var_os("CARGO_BIN_EXE_fief-cli"))
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                let test_exe = std::env::current_exe().expect("the test executable's path");
                let deps = test_exe.parent().expect("the test executable's directory");
                let profile_dir = if deps.ends_with("deps") {
                    deps.parent().expect("deps/ has a parent")
                } else {
                    deps
                };
                profile_dir.join(&name)
            });
        assert!(
            binary.exists(),
            "{} does not exist: the CLI and process tests run the `fief-cli` bin of \
             fief-tests, which `cargo test -p fief-tests` builds (or set FIEF_BIN)",
            binary.display()
        );
        binary
    })
}

/// A command running [`fief_binary`] as `fief`: its `argv[0]` is `fief`, so
/// clap's usage lines and errors name the command as users see it, not the
/// bin's file name `fief-cli`.
pub fn fief_command() -> Command {
    use std::os::unix::process::CommandExt as _;
    let mut command = Command::new(fief_binary());
    command.arg0("fief");
    command
}

/// Run `fief <args>` to completion.
pub fn fief_cli(args: &[&str]) -> Output {
    fief_command()
        .args(args)
        .env_remove("FIEF_NODE")
        .env("RUST_LOG", "warn")
        .output()
        .expect("running the fief binary")
}

/// A free TCP port on 127.0.0.1 (bound, then released for a child to take).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a: SocketAddr| a.port())
        .expect("binding 127.0.0.1:0")
}

/// A `fief node` child process, killed when dropped (also when a test panics).
pub struct NodeProcess {
    child: Child,
    log: PathBuf,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
}

impl NodeProcess {
    /// Start `fief node --listen 127.0.0.1:<free port> <extra args>` and wait
    /// (at most 60 s) until `fief status` reaches it. Its stderr goes to a log
    /// file under `target/test-logs/`, shown if it fails to start. Retries
    /// with another port if the one picked was taken meanwhile.
    pub fn start(extra_args: &[&str]) -> NodeProcess {
        let mut last_failure = String::new();
        for _attempt in 0..3 {
            match NodeProcess::try_start(extra_args) {
                Ok(node) => return node,
                Err(failure) => last_failure = failure,
            }
        }
        panic!("fief node did not start: {last_failure}");
    }

    fn try_start(extra_args: &[&str]) -> Result<NodeProcess, String> {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let log = test_logs_dir().join(format!("node-{}-{port}.log", std::process::id()));
        let stderr = std::fs::File::create(&log).expect("creating the node's log file");
        let child = fief_command()
            .args(["node", "--listen", &listen])
            .args(extra_args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("starting fief node");
        let mut node = NodeProcess {
            child,
            log,
            url: format!("http://{listen}"),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if fief_cli(&["status", "--node", &node.url]).status.success() {
                return Ok(node);
            }
            if let Ok(Some(exit)) = node.child.try_wait() {
                return Err(format!("it exited ({exit}); its log:\n{}", node.log_text()));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "`fief status` did not reach it within 60 s; its log:\n{}",
                    node.log_text()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What the node has logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The node's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}
