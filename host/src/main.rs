//! The `fief` command: run a node, deploy modules, call keys, read status.
//!
//! A thin layer over the `fief` library and its HTTP API. Every failure prints
//! one line saying what went wrong and exits non-zero.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bytesize::ByteSize;
use clap::{Args, Parser, Subcommand};
use fief::{Instance, ModuleOptions, NodeConfig};

mod cli_modules;
mod cli_status;

/// Fief: WebAssembly key processes with strict single ownership.
#[derive(Parser)]
#[command(
    name = "fief",
    version,
    about = "Fief: a runtime for WebAssembly key processes with strict single ownership."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// The API token client commands send (`Authorization: Bearer`), for a
    /// node started with tokens; prefer the environment variable.
    #[arg(long, global = true, env = "FIEF_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// A PEM CA certificate to trust, besides the system's, when `--node`
    /// is an `https://` URL (e.g. a node's self-signed certificate).
    #[arg(long, global = true, env = "FIEF_CA_CERT", value_name = "FILE")]
    ca_cert: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Run a node (with the embedded arbiter) and its HTTP API.
    Node(Box<NodeArgs>),
    /// Deploy a .wasm component as a module, to the whole cluster (shows
    /// progress on stderr: upload, validation, compilation, loading).
    Deploy(DeployArgs),
    /// List the cluster's modules: versions, the current one, where loaded.
    Modules(cli_modules::ModulesArgs),
    /// Make a stored version of a module current again (new activations).
    Rollback(cli_modules::RollbackArgs),
    /// Remove a module from the cluster, stopping its keys everywhere.
    Undeploy(cli_modules::UndeployArgs),
    /// Call a key and print its reply.
    Call(KeyArgs),
    /// Send a key a one-way message.
    Cast(KeyArgs),
    /// Show a node's view of its cluster: nodes, leases, leader, partitions,
    /// limbo, modules (`--json` for scripts, `--watch` to refresh).
    Status(cli_status::StatusArgs),
    /// Make a node leave its cluster gracefully (its keys hand off), then stop.
    Leave(NodeUrl),
    /// List the survivors in a node's limbo.
    Limbo(StatusArgs),
    /// Read and write the coherent cache.
    #[command(subcommand)]
    Cache(CacheCommand),
    /// Make and hash API tokens and cluster secrets.
    #[command(subcommand)]
    Token(TokenCommand),
    /// Compile the component on stdin to stdout (the node runs this).
    #[command(hide = true)]
    CompileWorker(CompileWorkerArgs),
}

#[derive(Args)]
struct CompileWorkerArgs {
    /// The address space this worker may use, in bytes.
    #[arg(long)]
    memory_limit: u64,
    /// The node's max_memory_per_key, in bytes (an engine setting).
    #[arg(long)]
    max_memory_per_key: u64,
}

#[derive(Subcommand)]
enum TokenCommand {
    /// Print a new random token (64 hex digits) and, on stderr, its SHA-256
    /// for a tokens file's `token_sha256`.
    New,
    /// Print the SHA-256 of the token read from standard input.
    Hash,
}

#[derive(Subcommand)]
enum CacheCommand {
    /// Print an entry's value (fails if there is none).
    Get {
        #[command(flatten)]
        entry: CacheEntryArgs,
        /// Also print the version and time left (to stderr).
        #[arg(long, short)]
        verbose: bool,
    },
    /// Write an entry and print its new version.
    Put {
        #[command(flatten)]
        entry: CacheEntryArgs,
        /// The value, as UTF-8 bytes.
        value: String,
        /// Drop the entry after this long, e.g. `10s`.
        #[arg(long, value_parser = humantime::parse_duration)]
        ttl: Option<Duration>,
        #[command(flatten)]
        expect: CacheExpectArgs,
    },
    /// Delete an entry.
    Delete {
        #[command(flatten)]
        entry: CacheEntryArgs,
        #[command(flatten)]
        expect: CacheExpectArgs,
    },
}

#[derive(Args)]
struct CacheEntryArgs {
    /// The cache namespace.
    namespace: String,
    /// The key.
    key: String,
    /// The node's HTTP address.
    #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
    node: String,
}

#[derive(Args)]
struct CacheExpectArgs {
    /// Only if the entry's version is this one (compare-and-set).
    #[arg(long, value_name = "VERSION", conflicts_with = "if_absent")]
    if_version: Option<u64>,
    /// Only if there is no entry.
    #[arg(long)]
    if_absent: bool,
}

impl CacheExpectArgs {
    fn apply(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match (self.if_version, self.if_absent) {
            (Some(version), _) => request.header("if-match", format!("\"{version}\"")),
            (None, true) => request.header("if-none-match", "*"),
            (None, false) => request,
        }
    }
}

/// How `fief node` writes its log (to stderr).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, with the spans it happened in (a call's
    /// `call`/`serve` span names the module and key).
    Json,
}

#[derive(Args)]
struct NodeArgs {
    /// Log format: `text` or `json`. The level comes from `RUST_LOG`
    /// (default `info`), e.g. `RUST_LOG=fief=debug`.
    #[arg(long, env = "FIEF_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// A TOML file with node settings (the keys of `NodeConfig`).
    #[arg(long, env = "FIEF_CONFIG")]
    config: Option<PathBuf>,
    /// The arbiter: `local` (embedded) or `postgres://user@host:5432/db`.
    #[arg(long, env = "FIEF_ARBITER")]
    arbiter: Option<String>,
    /// Address of the HTTP API.
    #[arg(long, env = "FIEF_LISTEN")]
    listen: Option<SocketAddr>,
    /// Address of the node-to-node transport (needed in a cluster).
    #[arg(long, env = "FIEF_PEER_LISTEN")]
    peer_listen: Option<SocketAddr>,
    /// The address peers are told to reach this node at, `host:port`
    /// (default: the --peer-listen address); for a node behind a proxy.
    #[arg(long, env = "FIEF_PEER_ADVERTISE")]
    peer_advertise: Option<String>,
    /// Append an event log to FILE: JSON lines of key processes started and
    /// ended, routed messages processed, leases granted and fences, stamped
    /// with wall-clock microseconds (for single-ownership checkers).
    #[arg(long, env = "FIEF_EVENT_LOG", value_name = "FILE")]
    event_log: Option<PathBuf>,
    /// The namespace (every node of a cluster uses the same).
    #[arg(long, env = "FIEF_NAMESPACE")]
    namespace: Option<String>,
    /// This node's id.
    #[arg(long, env = "FIEF_NODE_ID")]
    node_id: Option<String>,
    /// Lease time-to-live, e.g. `5s`.
    #[arg(long, env = "FIEF_LEASE_TTL", value_parser = humantime::parse_duration)]
    lease_ttl: Option<Duration>,
    /// Lease renewal period, e.g. `1s`.
    #[arg(long, env = "FIEF_RENEW_INTERVAL", value_parser = humantime::parse_duration)]
    renew_interval: Option<Duration>,
    /// Fence margin, e.g. `1s`.
    #[arg(long, env = "FIEF_FENCE_MARGIN", value_parser = humantime::parse_duration)]
    fence_margin: Option<Duration>,
    /// Partitions in the namespace.
    #[arg(long, env = "FIEF_PARTITIONS")]
    partitions: Option<u32>,
    /// Largest message or reply, e.g. `1MiB`.
    #[arg(long, env = "FIEF_MAX_MESSAGE_SIZE")]
    max_message_size: Option<ByteSize>,
    /// Most live keys on this node.
    #[arg(long, env = "FIEF_MAX_LIVE_KEYS")]
    max_live_keys: Option<u32>,
    /// Host memory one tenant's keys may make this node hold outside their
    /// linear memories (queued messages, timer tags, subscriptions, waiting
    /// handoff states), e.g. `512MiB` (the default).
    #[arg(long, env = "FIEF_MAX_HOST_BYTES_PER_TENANT")]
    max_host_bytes_per_tenant: Option<ByteSize>,
    /// Cores one tenant's keys may use together on this node over
    /// `--cpu-budget-per-tenant-window` (`1500m`, `1.5`, `50%`); past it
    /// they are throttled. Default: none (tenants get fair turns only).
    #[arg(long, env = "FIEF_CPU_BUDGET_PER_TENANT")]
    cpu_budget_per_tenant: Option<fief::CpuCores>,
    /// The window of `--cpu-budget-per-tenant` (10ms to 1m; default 1s).
    #[arg(long, env = "FIEF_CPU_BUDGET_PER_TENANT_WINDOW", value_parser = humantime::parse_duration)]
    cpu_budget_per_tenant_window: Option<Duration>,
    /// Threads that run guest code, apart from the API's (default 0: one
    /// per core).
    #[arg(long, env = "FIEF_GUEST_THREADS")]
    guest_threads: Option<u32>,
    /// Niceness of the guest threads, 0 to 19 (default 10): the API, peer
    /// links and lease renewals go ahead of guest code under contention.
    #[arg(long, env = "FIEF_GUEST_THREAD_NICE")]
    guest_thread_nice: Option<u8>,
    /// A ceiling over every module's option, `NAME=VALUE` (repeatable; in
    /// the environment, comma-separated), e.g. `cpu_limit=5s`: a deploy
    /// asking for more is refused. Names: cpu_limit (default 10s),
    /// idle_timeout (24h), max_live_keys (1000000), mailbox_depth (65536),
    /// max_timers_per_key (65536), max_subscriptions_per_key (4096),
    /// max_publishes_per_second (100000), max_host_bytes_per_key (1GiB),
    /// cpu_budget (1000m, a whole core).
    #[arg(
        long = "module-ceiling",
        env = "FIEF_MODULE_CEILINGS",
        value_name = "NAME=VALUE",
        value_delimiter = ','
    )]
    module_ceilings: Vec<String>,
    /// How long an API client has to send a request's head, e.g. `10s`.
    #[arg(long, env = "FIEF_HTTP_HEADER_READ_TIMEOUT", value_parser = humantime::parse_duration)]
    http_header_read_timeout: Option<Duration>,
    /// How long a kept-alive API connection may wait for its next request,
    /// e.g. `60s`.
    #[arg(long, env = "FIEF_HTTP_IDLE_TIMEOUT", value_parser = humantime::parse_duration)]
    http_idle_timeout: Option<Duration>,
    /// How long an API client has to send a request's body, e.g. `30s`
    /// (plus a second per 16 KiB it sent).
    #[arg(long, env = "FIEF_HTTP_BODY_READ_TIMEOUT", value_parser = humantime::parse_duration)]
    http_body_read_timeout: Option<Duration>,
    /// Most API connections open at once (default: the lowest of 4096, 3/4
    /// of the open-file limit, and the limit less 256).
    #[arg(long, env = "FIEF_HTTP_MAX_CONNECTIONS")]
    http_max_connections: Option<u32>,
    /// Longest a deploy's compile may take, e.g. `60s` (the compile worker
    /// is killed at it).
    #[arg(long, env = "FIEF_COMPILE_TIMEOUT", value_parser = humantime::parse_duration)]
    compile_timeout: Option<Duration>,
    /// The memory (address space) one compile may use, e.g. `4GiB`.
    #[arg(long, env = "FIEF_COMPILE_MEMORY_LIMIT")]
    compile_memory_limit: Option<ByteSize>,
    /// Directory of compiled components, so a restart does not recompile
    /// (default: `$XDG_CACHE_HOME/fief` or `~/.cache/fief`).
    #[arg(long, env = "FIEF_COMPILE_CACHE", conflicts_with = "no_compile_cache")]
    compile_cache: Option<PathBuf>,
    /// Compile every deploy; keep no compile cache.
    #[arg(long)]
    no_compile_cache: bool,
    /// Deploy a module at start: `NAME=PATH.wasm` (repeatable).
    #[arg(long = "deploy", value_name = "NAME=PATH")]
    deploy: Vec<String>,
    /// A tokens file (TOML, or JSON if `.json`): admin and tenant API
    /// tokens. With no tokens file and no `FIEF_ADMIN_TOKEN`, the API is
    /// open to anyone who can reach it. See docs/security.md.
    #[arg(long, env = "FIEF_TOKENS_FILE", value_name = "FILE")]
    tokens: Option<PathBuf>,
    /// Serve the API over HTTPS with this PEM certificate (with --tls-key).
    #[arg(long, env = "FIEF_TLS_CERT", value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "FIEF_TLS_KEY", value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// A file holding the cluster secret: peers must prove they know it.
    #[arg(long, env = "FIEF_CLUSTER_SECRET_FILE", value_name = "FILE")]
    cluster_secret_file: Option<PathBuf>,
    /// Mutual TLS for peer links: this node's PEM certificate (with
    /// --peer-tls-key and --peer-tls-ca).
    #[arg(long, env = "FIEF_PEER_TLS_CERT", value_name = "FILE", requires_all = ["peer_tls_key", "peer_tls_ca"])]
    peer_tls_cert: Option<PathBuf>,
    /// The PEM private key of --peer-tls-cert.
    #[arg(
        long,
        env = "FIEF_PEER_TLS_KEY",
        value_name = "FILE",
        requires = "peer_tls_cert"
    )]
    peer_tls_key: Option<PathBuf>,
    /// The PEM CA certificate that signed every node's peer certificate.
    #[arg(
        long,
        env = "FIEF_PEER_TLS_CA",
        value_name = "FILE",
        requires = "peer_tls_cert"
    )]
    peer_tls_ca: Option<PathBuf>,
}

#[derive(Args)]
struct DeployArgs {
    /// The component to deploy.
    file: PathBuf,
    /// The module name.
    #[arg(long)]
    module: String,
    /// Module options as `name=value` (repeatable), e.g. `memory_limit=32MiB`.
    #[arg(long = "option", short = 'o', value_name = "NAME=VALUE")]
    options: Vec<String>,
    /// The node's HTTP address.
    #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
    node: String,
}

#[derive(Args)]
struct KeyArgs {
    /// The module.
    module: String,
    /// The key.
    key: String,
    /// The message, sent as UTF-8 bytes.
    message: String,
    /// The node's HTTP address.
    #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
    node: String,
}

#[derive(Args)]
struct NodeUrl {
    /// The node's HTTP address.
    #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
    node: String,
}

#[derive(Args)]
struct StatusArgs {
    /// Print the status as JSON.
    #[arg(long)]
    json: bool,
    /// The node's HTTP address.
    #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
    node: String,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::CompileWorker(args) = &cli.command {
        // Before any thread or runtime: the worker limits its own memory.
        return fief::compile_worker::serve(args.memory_limit, args.max_memory_per_key);
    }
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    match &cli.command {
        Command::Node(args) if args.log_format == LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init(),
        _ => tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("fief: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fief: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    CLIENT
        .set(build_client(cli.token.as_deref(), cli.ca_cert.as_deref())?)
        .map_err(|_| anyhow::anyhow!("the HTTP client was built twice"))?;
    match cli.command {
        Command::Node(args) => node(*args).await,
        Command::Deploy(args) => cli_modules::deploy(args).await,
        Command::Modules(args) => cli_modules::modules(args).await,
        Command::Rollback(args) => cli_modules::rollback(args).await,
        Command::Undeploy(args) => cli_modules::undeploy(args).await,
        Command::Call(args) => call(args, "call").await,
        Command::Cast(args) => call(args, "cast").await,
        Command::Status(args) => cli_status::run(args).await,
        Command::Leave(args) => leave(args).await,
        Command::Limbo(args) => limbo(args).await,
        Command::Cache(command) => cache(command).await,
        Command::Token(command) => token(command),
        Command::CompileWorker(_) => bail!("the compile worker runs before the async runtime"),
    }
}

fn node_config(args: &NodeArgs) -> anyhow::Result<NodeConfig> {
    let mut config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?
        }
        None => NodeConfig::default(),
    };
    macro_rules! layer {
        ($($field:ident),*) => { $( if let Some(v) = args.$field.clone() { config.$field = v; } )* };
    }
    layer!(
        arbiter,
        listen,
        namespace,
        node_id,
        lease_ttl,
        renew_interval,
        fence_margin,
        partitions,
        max_message_size,
        max_live_keys,
        max_host_bytes_per_tenant,
        cpu_budget_per_tenant_window,
        guest_threads,
        guest_thread_nice,
        http_header_read_timeout,
        http_idle_timeout,
        http_body_read_timeout,
        compile_timeout,
        compile_memory_limit
    );
    if let Some(cores) = args.cpu_budget_per_tenant {
        config.cpu_budget_per_tenant = Some(cores);
    }
    if config.compile_worker.is_none() {
        // Compile in a process of this binary the node can kill and cap.
        config.compile_worker =
            Some(std::env::current_exe().context("finding this executable for compile_worker")?);
    }
    for ceiling in &args.module_ceilings {
        let (name, value) = ceiling
            .split_once('=')
            .with_context(|| format!("--module-ceiling {ceiling:?}: expected NAME=VALUE"))?;
        config.module_ceilings.set(name.trim(), value.trim())?;
    }
    if let Some(n) = args.http_max_connections {
        config.http_max_connections = Some(n);
    }
    if let Some(addr) = args.peer_listen {
        config.peer_listen = Some(addr);
    }
    if let Some(addr) = args.peer_advertise.clone() {
        config.peer_advertise = Some(addr);
    }
    if let Some(path) = args.cluster_secret_file.clone() {
        config.cluster_secret_file = Some(path);
    }
    if let (Some(cert), Some(key), Some(ca)) = (
        args.peer_tls_cert.clone(),
        args.peer_tls_key.clone(),
        args.peer_tls_ca.clone(),
    ) {
        config.peer_tls = Some(fief::tls::PeerTls { cert, key, ca });
    }
    if args.no_compile_cache {
        config.compile_cache = None;
    } else if let Some(dir) = args.compile_cache.clone() {
        config.compile_cache = Some(dir);
    } else if config.compile_cache.is_none() {
        config.compile_cache = default_compile_cache();
    }
    Ok(config)
}

/// `$XDG_CACHE_HOME/fief`, else `$HOME/.cache/fief`; none without either.
fn default_compile_cache() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|home| PathBuf::from(home).join(".cache"))
        })?;
    Some(base.join("fief"))
}

async fn node(args: NodeArgs) -> anyhow::Result<()> {
    let config = node_config(&args)?;
    // Every API connection is a file descriptor: take what the system
    // allows before sizing the connection cap on it.
    let raised = fief::http_limits::raise_open_file_limit();
    if let Some(why) = &raised.refused {
        tracing::warn!(
            "{why}; keeping {}",
            fief::http_limits::shown(raised.after.soft)
        );
    }
    let limits = fief::http_limits::HttpLimits::for_node(&config)?;
    println!(
        "API limits: at most {} connections (open-file limit {}{}), header read timeout {}, idle timeout {}",
        limits.max_connections,
        fief::http_limits::shown(raised.after.soft),
        if raised.after.soft == raised.before.soft {
            String::new()
        } else {
            format!(
                ", raised from {}",
                fief::http_limits::shown(raised.before.soft)
            )
        },
        humantime::format_duration(limits.header_read_timeout),
        humantime::format_duration(limits.idle_timeout),
    );
    let auth = Arc::new(api_auth(&args)?);
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(fief::tls::server_config(cert, key)?),
        _ => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let listen = config.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| {
            format!("cannot listen on {listen} (is another node running there? pass --listen)")
        })?;
    let event_log = match &args.event_log {
        Some(path) => Some(
            fief::event_log::EventLog::open(path, &config.node_id)
                .with_context(|| format!("opening the event log {}", path.display()))?,
        ),
        None => None,
    };
    let mut builder = Instance::builder(config);
    if let Some(log) = &event_log {
        builder = builder
            .observer(log.key_life_observer())
            .events(log.node_event_observer());
    }
    for spec in &args.deploy {
        let Some((name, path)) = spec.split_once('=') else {
            bail!("--deploy {spec:?}: expected NAME=PATH.wasm");
        };
        let wasm = std::fs::read(path).with_context(|| format!("reading {path}"))?;
        builder = builder.module(name, wasm, ModuleOptions::default());
        println!("deploying module {name} from {path}");
    }
    let instance = Arc::new(builder.start().await?);
    println!(
        "fief node {} listening on {scheme}://{listen}",
        instance.status().node_id
    );
    if auth.is_open() {
        println!("the API is open: no tokens configured (--tokens FILE, FIEF_ADMIN_TOKEN)");
    } else {
        println!("the API requires tokens: {auth:?}");
    }
    if let Some(name) = args
        .deploy
        .first()
        .and_then(|s| s.split_once('='))
        .map(|(n, _)| n)
    {
        let exe = std::env::current_exe()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| "fief".to_owned());
        let node = if listen == NodeConfig::default().listen {
            String::new()
        } else {
            format!(" --node {scheme}://{listen}")
        };
        println!("try: {exe} call{node} {name} alice incr");
    }
    let stop = instance.clone();
    let shutdown = async move {
        let mut sigterm =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        let terminate = async move {
            match sigterm.as_mut() {
                Some(signal) => {
                    signal.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        let signal = async {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                () = terminate => {}
            }
        };
        tokio::select! {
            () = signal => {
                // A graceful shutdown leaves the cluster first, so keys hand
                // off instead of waiting for the lease to expire.
                if stop.has_peers() {
                    match stop.leave(Duration::from_secs(60)).await {
                        Ok(report) => {
                            for lost in &report.lost_states {
                                tracing::warn!(module = %lost.module, key = %lost.key, reason = %lost.reason, "left without this key's handoff state");
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "leaving before shutdown failed"),
                    }
                }
            }
            () = stop.stop_requested() => {}
        }
        // Ends the dashboard's event streams, which would otherwise hold
        // the graceful shutdown open.
        stop.request_stop();
    };
    let options = fief::http::ApiOptions { auth, tls };
    fief::http::serve_with(instance.clone(), listener, options, shutdown).await?;
    match Arc::try_unwrap(instance) {
        Ok(instance) => instance.shutdown().await,
        Err(_) => tracing::warn!("requests still in flight at shutdown"),
    }
    Ok(())
}

/// Turn an API error response into a one-line error.
async fn api_error(response: reqwest::Response) -> anyhow::Error {
    let status = response.status();
    let text = response.text().await.unwrap_or_default();
    let message = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or(text);
    anyhow::anyhow!("{message} (HTTP {status})")
}

/// The client every command uses, built once by `run` from `--token` and
/// `--ca-cert`.
static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();

fn client() -> reqwest::Client {
    CLIENT.get().cloned().unwrap_or_default()
}

/// An HTTP client that sends `token` (marked sensitive, so never logged)
/// and trusts `ca_cert` besides the system's roots.
fn build_client(
    token: Option<&str>,
    ca_cert: Option<&std::path::Path>,
) -> anyhow::Result<reqwest::Client> {
    let mut builder = reqwest::Client::builder();
    if let Some(token) = token.map(str::trim).filter(|t| !t.is_empty()) {
        let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| anyhow::anyhow!("--token / FIEF_TOKEN must be printable ASCII"))?;
        value.set_sensitive(true);
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(reqwest::header::AUTHORIZATION, value);
        builder = builder.default_headers(headers);
    }
    if let Some(path) = ca_cert {
        let pem = std::fs::read(path)
            .with_context(|| format!("reading the CA certificate {}", path.display()))?;
        for cert in reqwest::Certificate::from_pem_bundle(&pem)
            .with_context(|| format!("{} is not a PEM certificate", path.display()))?
        {
            builder = builder.add_root_certificate(cert);
        }
    }
    builder.build().context("building the HTTP client")
}

/// `fief token new` / `fief token hash`.
fn token(command: TokenCommand) -> anyhow::Result<()> {
    match command {
        TokenCommand::New => {
            let token = fief::auth::new_token()?;
            println!("{token}");
            eprintln!("sha256: {}", fief::auth::hash_token(&token));
        }
        TokenCommand::Hash => {
            let mut line = String::new();
            std::io::stdin()
                .read_line(&mut line)
                .context("reading the token from standard input")?;
            let token = line.trim();
            if token.is_empty() {
                bail!("no token on standard input: `echo -n TOKEN | fief token hash`");
            }
            println!("{}", fief::auth::hash_token(token));
        }
    }
    Ok(())
}

/// The API's tokens: `--tokens FILE` plus `FIEF_ADMIN_TOKEN`; open if none.
fn api_auth(args: &NodeArgs) -> anyhow::Result<fief::auth::Auth> {
    let mut auth = match &args.tokens {
        Some(path) => fief::auth::Auth::from_file(path)?,
        None => fief::auth::Auth::open(),
    };
    if let Ok(token) = std::env::var("FIEF_ADMIN_TOKEN")
        && !token.trim().is_empty()
    {
        auth.add_token(&token, fief::auth::Identity::Admin)
            .map_err(|e| anyhow::anyhow!("FIEF_ADMIN_TOKEN: {e}"))?;
    }
    Ok(auth)
}

fn connect_error(node: &str) -> impl FnOnce(reqwest::Error) -> anyhow::Error + '_ {
    move |e| {
        anyhow::anyhow!(
            "cannot reach the node at {node}: {e} (is `fief node` running? pass --node URL)"
        )
    }
}

/// `node`'s URL with `segments` appended, each percent-encoded.
fn api_url(node: &str, segments: &[&str]) -> anyhow::Result<reqwest::Url> {
    let mut url =
        reqwest::Url::parse(node).with_context(|| format!("--node {node:?} is not a URL"))?;
    url.path_segments_mut()
        .map_err(|()| anyhow::anyhow!("--node {node:?} cannot take a path"))?
        .pop_if_empty()
        .extend(segments);
    Ok(url)
}

async fn call(args: KeyArgs, verb: &str) -> anyhow::Result<()> {
    let url = api_url(&args.node, &["v1", "keys", &args.module, &args.key, verb])?;
    let response = send(&args.node, client().post(url).body(args.message)).await?;
    if verb == "call" {
        let reply = response.bytes().await?;
        println!("{}", String::from_utf8_lossy(&reply));
    }
    Ok(())
}

async fn cache(command: CacheCommand) -> anyhow::Result<()> {
    let entry_url = |entry: &CacheEntryArgs| {
        api_url(&entry.node, &["v1", "cache", &entry.namespace, &entry.key])
    };
    match command {
        CacheCommand::Get { entry, verbose } => {
            let url = entry_url(&entry)?;
            let response = client()
                .get(url)
                .send()
                .await
                .map_err(connect_error(&entry.node))?;
            if response.status() == reqwest::StatusCode::NOT_FOUND {
                bail!(
                    "no entry for key {:?} in cache namespace {:?}",
                    entry.key,
                    entry.namespace
                );
            }
            if !response.status().is_success() {
                return Err(api_error(response).await);
            }
            let header = |name: &str| {
                response
                    .headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(|v| v.trim_matches('"').to_owned())
            };
            let (version, left) = (header("etag"), header("x-fief-expires-in-ms"));
            if verbose {
                eprintln!(
                    "version {}{}",
                    version.as_deref().unwrap_or("?"),
                    left.map(|ms| format!(", expires in {ms} ms"))
                        .unwrap_or_default()
                );
            }
            println!("{}", String::from_utf8_lossy(&response.bytes().await?));
        }
        CacheCommand::Put {
            entry,
            value,
            ttl,
            expect,
        } => {
            let mut request = client().put(entry_url(&entry)?).body(value);
            if let Some(ttl) = ttl {
                request = request.query(&[("ttl", humantime::format_duration(ttl).to_string())]);
            }
            let reply: serde_json::Value = send(&entry.node, expect.apply(request))
                .await?
                .json()
                .await?;
            println!("version {}", reply["version"]);
        }
        CacheCommand::Delete { entry, expect } => {
            let request = expect.apply(client().delete(entry_url(&entry)?));
            let reply: serde_json::Value = send(&entry.node, request).await?.json().await?;
            if reply["deleted"].as_bool() == Some(true) {
                println!("deleted");
            } else {
                println!("there was no entry");
            }
        }
    }
    Ok(())
}

/// Send `request` to the node at `node`; a connection failure or an API
/// error becomes a one-line error.
async fn send(node: &str, request: reqwest::RequestBuilder) -> anyhow::Result<reqwest::Response> {
    let response = request.send().await.map_err(connect_error(node))?;
    if !response.status().is_success() {
        return Err(api_error(response).await);
    }
    Ok(response)
}

/// `GET {node}{path}` as JSON.
async fn get_json(node: &str, path: &str) -> anyhow::Result<serde_json::Value> {
    let url = format!("{}{path}", node.trim_end_matches('/'));
    Ok(send(node, client().get(&url)).await?.json().await?)
}

async fn limbo(args: StatusArgs) -> anyhow::Result<()> {
    let entries = get_json(&args.node, "/v1/limbo").await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&entries)?);
        return Ok(());
    }
    let entries = entries.as_array().cloned().unwrap_or_default();
    if entries.is_empty() {
        println!("limbo is empty");
    }
    for e in entries {
        println!(
            "{}/{}  partition {}  mode {}  since {}",
            e["module"].as_str().unwrap_or("?"),
            e["key"].as_str().unwrap_or("?"),
            e["partition"],
            e["mode"].as_str().unwrap_or("?"),
            e["since"].as_str().unwrap_or("?")
        );
    }
    Ok(())
}

async fn leave(args: NodeUrl) -> anyhow::Result<()> {
    let url = format!("{}/v1/leave", args.node.trim_end_matches('/'));
    let report: serde_json::Value = send(&args.node, client().post(&url)).await?.json().await?;
    println!("the node left the cluster and is stopping");
    if report["no_other_node"] == true {
        println!("there was no other node to hand to: its keys stopped with their state");
    }
    let lost = report["lost_states"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if !lost.is_empty() {
        println!("{} key(s) left without their handoff state:", lost.len());
        for l in &lost {
            println!(
                "  {}/{}: {}",
                l["module"].as_str().unwrap_or("?"),
                l["key"].as_str().unwrap_or("?"),
                l["reason"].as_str().unwrap_or("?")
            );
        }
    }
    Ok(())
}
