//! The `fief` command: run a node, deploy modules, call keys, read status.
//!
//! A thin layer over the `fief` library and its HTTP API. Every failure prints
//! one line saying what went wrong and exits non-zero. This file holds the
//! command line and dispatches; each command lives in its own module.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::bail;
use clap::{Args, Parser, Subcommand};

mod cache;
mod client;
mod commands;
mod modules;
mod node;
mod state;
mod status;
mod token;

use cache::CacheCommand;
use commands::{KeyArgs, NodeUrl, StatusArgs};
use modules::DeployArgs;
use node::{LogFormat, NodeArgs};
use state::StateCommand;
use token::TokenCommand;

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
    Modules(modules::ModulesArgs),
    /// Make a stored version of a module current again (new activations).
    Rollback(modules::RollbackArgs),
    /// Remove a module from the cluster, stopping its keys everywhere.
    Undeploy(modules::UndeployArgs),
    /// Call a key and print its reply.
    Call(KeyArgs),
    /// Send a key a one-way message.
    Cast(KeyArgs),
    /// Show a node's view of its cluster: nodes, leases, leader, partitions,
    /// limbo, modules (`--json` for scripts, `--watch` to refresh).
    Status(status::StatusArgs),
    /// Make a node leave its cluster gracefully (its keys hand off), then stop.
    Leave(NodeUrl),
    /// List the survivors in a node's limbo.
    Limbo(StatusArgs),
    /// Read and write the coherent cache.
    #[command(subcommand)]
    Cache(CacheCommand),
    /// Read a key's committed durable state (read-only).
    #[command(subcommand)]
    State(StateCommand),
    /// List a key's durable alarms, as committed (read-only).
    Alarms(state::AlarmsArgs),
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
    /// The node's memory_init (an engine setting).
    #[arg(long, default_value = "copy-on-write")]
    memory_init: fief::config::MemoryInit,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::CompileWorker(args) = &cli.command {
        // Before any thread or runtime: the worker limits its own memory.
        let settings = fief::compile_worker::EngineSettings {
            max_memory_per_key: args.max_memory_per_key,
            memory_init: args.memory_init,
        };
        return fief::compile_worker::serve(args.memory_limit, settings);
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
    client::configure(cli.token.as_deref(), cli.ca_cert.as_deref())?;
    match cli.command {
        Command::Node(args) => node::node(*args).await,
        Command::Deploy(args) => modules::deploy(args).await,
        Command::Modules(args) => modules::modules(args).await,
        Command::Rollback(args) => modules::rollback(args).await,
        Command::Undeploy(args) => modules::undeploy(args).await,
        Command::Call(args) => commands::call(args, "call").await,
        Command::Cast(args) => commands::call(args, "cast").await,
        Command::Status(args) => status::run(args).await,
        Command::Leave(args) => commands::leave(args).await,
        Command::Limbo(args) => commands::limbo(args).await,
        Command::Cache(command) => cache::cache(command).await,
        Command::State(command) => state::state(command).await,
        Command::Alarms(args) => state::alarms(args).await,
        Command::Token(command) => token::token(command),
        Command::CompileWorker(_) => bail!("the compile worker runs before the async runtime"),
    }
}
