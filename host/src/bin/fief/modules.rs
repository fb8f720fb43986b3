//! The `fief` commands for the cluster's modules (part of the binary, not
//! the library): `deploy` with progress, `modules`, `rollback`, `undeploy`.
//!
//! `deploy` reports its phases on stderr: the upload (a byte count that
//! updates in place on a terminal, a line per quarter otherwise), the
//! node's validation and compilation, the version stored, and how many of
//! the cluster's nodes have loaded it. The one result line goes to stdout.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;

use std::path::PathBuf;

use crate::client::node;

/// How long `deploy` waits for every node to load the new version.
const LOAD_WAIT: Duration = Duration::from_secs(60);

/// `fief deploy`.
#[derive(Args)]
#[command(after_help = fief::config::option_table::options_help())]
pub(crate) struct DeployArgs {
    /// The component to deploy.
    pub(crate) file: PathBuf,
    /// The module name.
    #[arg(long)]
    pub(crate) module: String,
    /// Module options as `name=value` (repeatable), e.g. `memory_limit=32MiB`;
    /// every option, its default and its bound are listed below.
    #[arg(long = "option", short = 'o', value_name = "NAME=VALUE")]
    pub(crate) options: Vec<String>,
    /// The node's HTTP address.
    #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
    pub(crate) node: String,
}

/// `fief modules`.
#[derive(Args)]
pub(crate) struct ModulesArgs {
    /// Print the listing as JSON.
    #[arg(long)]
    json: bool,
    /// Also show every stored version with its options and deployer.
    #[arg(long, short)]
    verbose: bool,
    /// The node's HTTP address.
    #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
    node: String,
}

/// `fief rollback MODULE VERSION`.
#[derive(Args)]
pub(crate) struct RollbackArgs {
    /// The module.
    module: String,
    /// The stored version to make current again.
    version: u64,
    /// The node's HTTP address.
    #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
    node: String,
}

/// `fief undeploy MODULE`.
#[derive(Args)]
pub(crate) struct UndeployArgs {
    /// The module.
    module: String,
    /// The node's HTTP address.
    #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
    node: String,
}

/// Progress lines on stderr: rewritten in place on a terminal, one line per
/// step otherwise (logs, CI, tests).
struct Progress {
    tty: bool,
}

impl Progress {
    fn new() -> Self {
        Progress {
            tty: std::io::stderr().is_terminal(),
        }
    }

    /// A line that a later one may replace (on a terminal).
    fn update(&self, line: &str) {
        if self.tty {
            eprint!("\r\x1b[2K{line}");
            let _ = std::io::stderr().flush();
        } else {
            eprintln!("{line}");
        }
    }

    /// A line that stays.
    fn done(&self, line: &str) {
        if self.tty {
            eprintln!("\r\x1b[2K{line}");
        } else {
            eprintln!("{line}");
        }
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// `fief deploy FILE --module NAME`.
pub(crate) async fn deploy(args: DeployArgs) -> anyhow::Result<()> {
    let wasm =
        std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let mut query = Vec::new();
    for option in &args.options {
        let Some((k, v)) = option.split_once('=') else {
            bail!("--option {option:?}: expected NAME=VALUE");
        };
        query.push((k.to_owned(), v.to_owned()));
    }
    // Refuse malformed options before uploading (the node checks them again,
    // with its own limits).
    fief::ModuleOptions::from_pairs(query.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
    let client = node(&args.node)?;
    let progress = Progress::new();
    let total = wasm.len() as u64;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
    let sending = tokio::spawn({
        let module = args.module.clone();
        let client = client.clone();
        async move {
            let options: Vec<(&str, &str)> = query
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            client
                .deploy_with_progress(&module, wasm, &options, move |sent, _| {
                    let _ = tx.send(sent);
                })
                .await
        }
    });
    let name = args.file.display().to_string();
    let mut quarter = 0;
    progress.update(&format!("uploading {name}: 0 of {}", mib(total)));
    while let Some(sent) = rx.recv().await {
        let reached = (sent * 4).checked_div(total).unwrap_or(4);
        if progress.tty || reached > quarter {
            quarter = reached;
            progress.update(&format!(
                "uploading {name}: {} of {} ({}%)",
                mib(sent),
                mib(total),
                (sent * 100).checked_div(total).unwrap_or(100)
            ));
        }
        if sent >= total {
            break;
        }
    }
    progress.done(&format!("uploaded {} to {}", mib(total), args.node));
    progress.update("validating and compiling on the node…");
    let info = sending.await.context("the upload task failed")??;
    let version = info.version;
    let how = if info.compile_cached {
        "loaded from the compile cache"
    } else {
        "compiled"
    };
    progress.done(&format!(
        "validated and {how} in {} ms; stored as version {version}",
        info.compile_ms
    ));
    // The deployed name as the node reports it (a tenant's node may qualify
    // it); the listing is asked for under the name the user gave.
    let loaded = wait_loaded(&client, &args.module, version, &progress).await;
    println!(
        "deployed {} version {version} ({how} in {} ms){loaded}",
        args.module, info.compile_ms
    );
    Ok(())
}

/// Poll the module's listing until every live node has loaded `version` (at
/// most [`LOAD_WAIT`]), reporting "loaded on N/M nodes" as it changes.
/// Returns a note for the result line.
async fn wait_loaded(
    client: &fief_client::Client,
    module: &str,
    version: u64,
    progress: &Progress,
) -> String {
    let started = Instant::now();
    let mut last = None;
    loop {
        let Ok(listing) = client.module(module).await else {
            progress.done("cannot read the module's listing to follow its loading");
            return String::new();
        };
        let nodes = listing["nodes"].as_u64().unwrap_or(1);
        let loaded = listing["loaded_on"].as_object().map_or(0, |m| {
            m.values().filter(|v| v.as_u64() == Some(version)).count()
        }) as u64;
        if last != Some((loaded, nodes)) {
            progress.update(&format!("loaded on {loaded}/{nodes} nodes"));
            last = Some((loaded, nodes));
        }
        if loaded >= nodes {
            progress.done(&format!("loaded on {loaded}/{nodes} nodes"));
            return format!(", loaded on {loaded}/{nodes} nodes");
        }
        if started.elapsed() > LOAD_WAIT {
            progress.done(&format!(
                "loaded on {loaded}/{nodes} nodes after {}s; the others load it when they next read the module store",
                LOAD_WAIT.as_secs()
            ));
            return format!(", loaded on {loaded}/{nodes} nodes so far");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `fief modules`.
pub(crate) async fn modules(args: ModulesArgs) -> anyhow::Result<()> {
    let listing = node(&args.node)?.modules().await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&listing)?);
        return Ok(());
    }
    let modules = listing.as_array().cloned().unwrap_or_default();
    if modules.is_empty() {
        println!("no modules are deployed");
    }
    for module in modules {
        let current = module["current"].as_u64().unwrap_or_default();
        let nodes = module["nodes"].as_u64().unwrap_or(1);
        let loaded = module["loaded_on"].as_object().map_or(0, |m| {
            m.values().filter(|v| v.as_u64() == Some(current)).count()
        });
        let versions: Vec<String> = module["versions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| {
                let n = v["version"].as_u64().unwrap_or_default();
                if n == current {
                    format!("v{n}*")
                } else {
                    format!("v{n}")
                }
            })
            .collect();
        println!(
            "{}  current v{current}, loaded on {loaded}/{nodes} nodes, {} live keys here; versions {}",
            module["name"].as_str().unwrap_or("?"),
            module["live_keys"],
            versions.join(" ")
        );
        if args.verbose {
            for v in module["versions"].as_array().into_iter().flatten() {
                println!(
                    "  v{}  {} bytes  sha256 {}  by {}  at {}",
                    v["version"],
                    v["size_bytes"],
                    v["content_hash"].as_str().unwrap_or("?"),
                    v["deployed_by"].as_str().unwrap_or("?"),
                    v["deployed_at"].as_str().unwrap_or("?"),
                );
                match serde_json::from_value::<fief::ModuleOptions>(v["options"].clone()) {
                    Ok(options) => {
                        for (name, value) in options.limits_and_capabilities() {
                            println!("      {name}: {value}");
                        }
                    }
                    Err(_) => println!("      options {}", v["options"]),
                }
            }
        }
    }
    Ok(())
}

/// `fief rollback MODULE VERSION`.
pub(crate) async fn rollback(args: RollbackArgs) -> anyhow::Result<()> {
    node(&args.node)?
        .rollback(&args.module, args.version)
        .await?;
    println!(
        "{} is at version {} for new activations; live keys finish on theirs",
        args.module, args.version
    );
    Ok(())
}

/// `fief undeploy MODULE`.
pub(crate) async fn undeploy(args: UndeployArgs) -> anyhow::Result<()> {
    node(&args.node)?.undeploy(&args.module).await?;
    println!(
        "undeployed {}: its keys are stopped on every node",
        args.module
    );
    Ok(())
}
