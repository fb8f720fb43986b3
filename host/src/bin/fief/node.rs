//! `fief node`: its arguments, the node configuration they make (defaults,
//! a config file, flags and environment variables, in that order), the
//! API's tokens, and running the node with its HTTP API until a signal or
//! a leave. It must not talk to another node's API (that is the client
//! commands').

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bytesize::ByteSize;
use clap::Args;
use fief::{Instance, ModuleOptions, NodeConfig};

/// How `fief node` writes its log (to stderr).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, with the spans it happened in (a call's
    /// `call`/`serve` span names the module and key).
    Json,
}

#[derive(Args)]
#[command(after_help = fief::config::option_table::ceilings_help())]
pub(crate) struct NodeArgs {
    /// Log format: `text` or `json`. The level comes from `RUST_LOG`
    /// (default `info`), e.g. `RUST_LOG=fief=debug`.
    #[arg(long, env = "FIEF_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub(crate) log_format: LogFormat,
    /// A TOML file with node settings (the keys of `NodeConfig`).
    #[arg(long, env = "FIEF_CONFIG")]
    pub(crate) config: Option<PathBuf>,
    /// The arbiter: `local` (embedded), `postgres://user@host:5432/db`, or
    /// `etcd://host:2379[,host:2379…]/prefix` (an etcd v3 cluster, 3.4 or
    /// newer: leases, leadership and the table; needs --storage
    /// postgres://…, where the modules are kept).
    #[arg(long, env = "FIEF_ARBITER")]
    pub(crate) arbiter: Option<String>,
    /// Where keys' durable state is kept: `embedded` (a redb file in
    /// --data-dir; in memory without one), `memory`, or a `postgres://` URL.
    /// Default: the arbiter's database if it is PostgreSQL, else `embedded`
    /// (an etcd arbiter needs a `postgres://` URL here: its modules are
    /// kept there too).
    #[arg(long, env = "FIEF_STORAGE")]
    pub(crate) storage: Option<String>,
    /// The node's own files (embedded storage's `state.redb`). Without it
    /// embedded storage is in memory and lost when the node stops.
    #[arg(long, env = "FIEF_DATA_DIR")]
    pub(crate) data_dir: Option<PathBuf>,
    /// Address of the HTTP API.
    #[arg(long, env = "FIEF_LISTEN")]
    pub(crate) listen: Option<SocketAddr>,
    /// Address of the node-to-node transport (needed in a cluster).
    #[arg(long, env = "FIEF_PEER_LISTEN")]
    pub(crate) peer_listen: Option<SocketAddr>,
    /// The address peers are told to reach this node at, `host:port`
    /// (default: the --peer-listen address); for a node behind a proxy.
    #[arg(long, env = "FIEF_PEER_ADVERTISE")]
    pub(crate) peer_advertise: Option<String>,
    /// Append an event log to FILE: JSON lines of key processes started and
    /// ended, routed messages processed, leases granted and fences, stamped
    /// with wall-clock microseconds (for single-ownership checkers).
    #[arg(long, env = "FIEF_EVENT_LOG", value_name = "FILE")]
    pub(crate) event_log: Option<PathBuf>,
    /// The namespace (every node of a cluster uses the same).
    #[arg(long, env = "FIEF_NAMESPACE")]
    pub(crate) namespace: Option<String>,
    /// This node's id.
    #[arg(long, env = "FIEF_NODE_ID")]
    pub(crate) node_id: Option<String>,
    /// Lease time-to-live, e.g. `5s`.
    #[arg(long, env = "FIEF_LEASE_TTL", value_parser = humantime::parse_duration)]
    pub(crate) lease_ttl: Option<Duration>,
    /// Lease renewal period, e.g. `1s`.
    #[arg(long, env = "FIEF_RENEW_INTERVAL", value_parser = humantime::parse_duration)]
    pub(crate) renew_interval: Option<Duration>,
    /// Fence margin, e.g. `1s`.
    #[arg(long, env = "FIEF_FENCE_MARGIN", value_parser = humantime::parse_duration)]
    pub(crate) fence_margin: Option<Duration>,
    /// Partitions in the namespace.
    #[arg(long, env = "FIEF_PARTITIONS")]
    pub(crate) partitions: Option<u32>,
    /// Largest message or reply, e.g. `1MiB`.
    #[arg(long, env = "FIEF_MAX_MESSAGE_SIZE")]
    pub(crate) max_message_size: Option<ByteSize>,
    /// Most live keys on this node.
    #[arg(long, env = "FIEF_MAX_LIVE_KEYS")]
    pub(crate) max_live_keys: Option<u32>,
    /// Linear memory the live keys may hold together before each new key
    /// evicts the least recently used idle one, e.g. `4GiB` (default: none).
    #[arg(long, env = "FIEF_MAX_GUEST_MEMORY")]
    pub(crate) max_guest_memory: Option<ByteSize>,
    /// Most WebSocket connections this node holds (default 10000).
    #[arg(long, env = "FIEF_MAX_CONNECTIONS")]
    pub(crate) max_connections: Option<u32>,
    /// Most WebSocket connections one tenant's clients hold on this node
    /// (default 1000).
    #[arg(long, env = "FIEF_MAX_CONNECTIONS_PER_TENANT")]
    pub(crate) max_connections_per_tenant: Option<u32>,
    /// Host memory one tenant's keys may make this node hold outside their
    /// linear memories (queued messages, timer tags, subscriptions, waiting
    /// handoff states), e.g. `512MiB` (the default).
    #[arg(long, env = "FIEF_MAX_HOST_BYTES_PER_TENANT")]
    pub(crate) max_host_bytes_per_tenant: Option<ByteSize>,
    /// Cores one tenant's keys may use together on this node over
    /// `--cpu-budget-per-tenant-window` (`1500m`, `1.5`, `50%`); past it
    /// they are throttled. Default: none (tenants get fair turns only).
    #[arg(long, env = "FIEF_CPU_BUDGET_PER_TENANT")]
    pub(crate) cpu_budget_per_tenant: Option<fief::CpuCores>,
    /// The window of `--cpu-budget-per-tenant` (10ms to 1m; default 1s).
    #[arg(long, env = "FIEF_CPU_BUDGET_PER_TENANT_WINDOW", value_parser = humantime::parse_duration)]
    pub(crate) cpu_budget_per_tenant_window: Option<Duration>,
    /// A tenant's weight when tenants contend for the guest threads,
    /// `TENANT=WEIGHT` (1 to 1000; repeatable; in the environment,
    /// comma-separated); a tenant not named weighs 1.
    #[arg(
        long = "tenant-cpu-weight",
        env = "FIEF_TENANT_CPU_WEIGHTS",
        value_name = "TENANT=WEIGHT",
        value_delimiter = ','
    )]
    pub(crate) tenant_cpu_weights: Vec<String>,
    /// Threads that run guest code, apart from the API's (default 0: one
    /// per core).
    #[arg(long, env = "FIEF_GUEST_THREADS")]
    pub(crate) guest_threads: Option<u32>,
    /// Niceness of the guest threads, 0 to 19 (default 10): the API, peer
    /// links and lease renewals go ahead of guest code under contention.
    #[arg(long, env = "FIEF_GUEST_THREAD_NICE")]
    pub(crate) guest_thread_nice: Option<u8>,
    /// How the guest threads give way to the node's other threads: `nice`
    /// (default: at the niceness above, with a short OS time slice)
    /// or `idle` (Linux SCHED_IDLE: only on cores nothing else wants; for a
    /// node alone on its machine).
    #[arg(long, env = "FIEF_GUEST_THREAD_POLICY")]
    pub(crate) guest_thread_policy: Option<fief::config::GuestThreadPolicy>,
    /// How each key's memory gets its module's initial data:
    /// `copy-on-write` (default: the data image mapped, shared until
    /// written; for Python and JavaScript guests) or `copy` (copied at each
    /// activation: faster under heavy activation churn for guests with
    /// small images, such as Rust's).
    #[arg(long, env = "FIEF_MEMORY_INIT")]
    pub(crate) memory_init: Option<fief::config::MemoryInit>,
    /// A ceiling over every module's option, `NAME=VALUE` (repeatable; in
    /// the environment, comma-separated), e.g. `cpu_limit=5s`: a deploy
    /// asking for more is refused. Every ceiling and its default is listed
    /// below.
    #[arg(
        long = "module-ceiling",
        env = "FIEF_MODULE_CEILINGS",
        value_name = "NAME=VALUE",
        value_delimiter = ','
    )]
    pub(crate) module_ceilings: Vec<String>,
    /// How long an API client has to send a request's head, e.g. `10s`.
    #[arg(long, env = "FIEF_HTTP_HEADER_READ_TIMEOUT", value_parser = humantime::parse_duration)]
    pub(crate) http_header_read_timeout: Option<Duration>,
    /// How long a kept-alive API connection may wait for its next request,
    /// e.g. `60s`.
    #[arg(long, env = "FIEF_HTTP_IDLE_TIMEOUT", value_parser = humantime::parse_duration)]
    pub(crate) http_idle_timeout: Option<Duration>,
    /// How long an API client has to send a request's body, e.g. `30s`
    /// (plus a second per 16 KiB it sent).
    #[arg(long, env = "FIEF_HTTP_BODY_READ_TIMEOUT", value_parser = humantime::parse_duration)]
    pub(crate) http_body_read_timeout: Option<Duration>,
    /// Most API connections open at once (default: the lowest of 4096, 3/4
    /// of the open-file limit, and the limit less 256).
    #[arg(long, env = "FIEF_HTTP_MAX_CONNECTIONS")]
    pub(crate) http_max_connections: Option<u32>,
    /// Longest a deploy's compile may take, e.g. `60s` (the compile worker
    /// is killed at it).
    #[arg(long, env = "FIEF_COMPILE_TIMEOUT", value_parser = humantime::parse_duration)]
    pub(crate) compile_timeout: Option<Duration>,
    /// The memory (address space) one compile may use, e.g. `4GiB`.
    #[arg(long, env = "FIEF_COMPILE_MEMORY_LIMIT")]
    pub(crate) compile_memory_limit: Option<ByteSize>,
    /// Directory of compiled components, so a restart does not recompile
    /// (default: `$XDG_CACHE_HOME/fief` or `~/.cache/fief`).
    #[arg(long, env = "FIEF_COMPILE_CACHE", conflicts_with = "no_compile_cache")]
    pub(crate) compile_cache: Option<PathBuf>,
    /// Compile every deploy; keep no compile cache.
    #[arg(long)]
    pub(crate) no_compile_cache: bool,
    /// Deploy a module at start: `NAME=PATH.wasm` (repeatable).
    #[arg(long = "deploy", value_name = "NAME=PATH")]
    pub(crate) deploy: Vec<String>,
    /// A tokens file (TOML, or JSON if `.json`): admin and tenant API
    /// tokens. With no tokens file and no `FIEF_ADMIN_TOKEN`, the API is
    /// open to anyone who can reach it. See docs/security.md.
    #[arg(long, env = "FIEF_TOKENS_FILE", value_name = "FILE")]
    pub(crate) tokens: Option<PathBuf>,
    /// Serve the API over HTTPS with this PEM certificate (with --tls-key).
    #[arg(long, env = "FIEF_TLS_CERT", value_name = "FILE", requires = "tls_key")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "FIEF_TLS_KEY", value_name = "FILE", requires = "tls_cert")]
    pub(crate) tls_key: Option<PathBuf>,
    /// A file holding the cluster secret: peers must prove they know it.
    #[arg(long, env = "FIEF_CLUSTER_SECRET_FILE", value_name = "FILE")]
    pub(crate) cluster_secret_file: Option<PathBuf>,
    /// Mutual TLS for peer links: this node's PEM certificate (with
    /// --peer-tls-key and --peer-tls-ca).
    #[arg(long, env = "FIEF_PEER_TLS_CERT", value_name = "FILE", requires_all = ["peer_tls_key", "peer_tls_ca"])]
    pub(crate) peer_tls_cert: Option<PathBuf>,
    /// The PEM private key of --peer-tls-cert.
    #[arg(
        long,
        env = "FIEF_PEER_TLS_KEY",
        value_name = "FILE",
        requires = "peer_tls_cert"
    )]
    pub(crate) peer_tls_key: Option<PathBuf>,
    /// The PEM CA certificate that signed every node's peer certificate.
    #[arg(
        long,
        env = "FIEF_PEER_TLS_CA",
        value_name = "FILE",
        requires = "peer_tls_cert"
    )]
    pub(crate) peer_tls_ca: Option<PathBuf>,
}

pub(crate) fn node_config(args: &NodeArgs) -> anyhow::Result<NodeConfig> {
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
        guest_thread_policy,
        memory_init,
        http_header_read_timeout,
        http_idle_timeout,
        http_body_read_timeout,
        compile_timeout,
        compile_memory_limit
    );
    if let Some(storage) = args.storage.clone() {
        config.storage = Some(storage);
    }
    if let Some(dir) = args.data_dir.clone() {
        config.data_dir = Some(dir);
    }
    if let Some(bytes) = args.max_guest_memory {
        config.max_guest_memory = Some(bytes);
    }
    if let Some(n) = args.max_connections {
        config.max_connections = n;
    }
    if let Some(n) = args.max_connections_per_tenant {
        config.max_connections_per_tenant = n;
    }
    if let Some(cores) = args.cpu_budget_per_tenant {
        config.cpu_budget_per_tenant = Some(cores);
    }
    if config.compile_worker.is_none() {
        // Compile in a process of this binary the node can kill and cap.
        config.compile_worker =
            Some(std::env::current_exe().context("finding this executable for compile_worker")?);
    }
    for pair in &args.tenant_cpu_weights {
        let (tenant, weight) = pair
            .split_once('=')
            .with_context(|| format!("--tenant-cpu-weight {pair:?}: expected TENANT=WEIGHT"))?;
        let weight = weight.trim().parse().with_context(|| {
            format!("--tenant-cpu-weight {pair:?}: the weight must be a whole number, 1 to 1000")
        })?;
        config
            .tenant_cpu_weights
            .insert(tenant.trim().to_owned(), weight);
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
pub(crate) fn default_compile_cache() -> Option<PathBuf> {
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

pub(crate) async fn node(args: NodeArgs) -> anyhow::Result<()> {
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

/// The API's tokens: `--tokens FILE` plus `FIEF_ADMIN_TOKEN`; open if none.
pub(crate) fn api_auth(args: &NodeArgs) -> anyhow::Result<fief::auth::Auth> {
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
