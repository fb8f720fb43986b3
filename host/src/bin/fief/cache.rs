//! `fief cache get|put|delete`: the coherent cache from the command line,
//! with compare-and-set (`--if-version`, `--if-absent`).

use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand};

use fief_client::CacheExpect;

use crate::client::node;

#[derive(Subcommand)]
pub(crate) enum CacheCommand {
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
pub(crate) struct CacheEntryArgs {
    /// The cache namespace.
    namespace: String,
    /// The key.
    key: String,
    /// The node's HTTP address.
    #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
    node: String,
}

#[derive(Args)]
pub(crate) struct CacheExpectArgs {
    /// Only if the entry's version is this one (compare-and-set).
    #[arg(long, value_name = "VERSION", conflicts_with = "if_absent")]
    if_version: Option<u64>,
    /// Only if there is no entry.
    #[arg(long)]
    if_absent: bool,
}

impl CacheExpectArgs {
    fn expect(&self) -> CacheExpect {
        match (self.if_version, self.if_absent) {
            (Some(version), _) => CacheExpect::Version(version),
            (None, true) => CacheExpect::Absent,
            (None, false) => CacheExpect::Any,
        }
    }
}

pub(crate) async fn cache(command: CacheCommand) -> anyhow::Result<()> {
    match command {
        CacheCommand::Get { entry, verbose } => {
            let client = node(&entry.node)?;
            let Some(found) = client.cache_get(&entry.namespace, &entry.key).await? else {
                bail!(
                    "no entry for key {:?} in cache namespace {:?}",
                    entry.key,
                    entry.namespace
                );
            };
            if verbose {
                eprintln!(
                    "version {}{}",
                    found.version,
                    found
                        .expires_in_ms
                        .map(|ms| format!(", expires in {ms} ms"))
                        .unwrap_or_default()
                );
            }
            println!("{}", String::from_utf8_lossy(&found.value));
        }
        CacheCommand::Put {
            entry,
            value,
            ttl,
            expect,
        } => {
            let version = node(&entry.node)?
                .cache_put(&entry.namespace, &entry.key, value, ttl, expect.expect())
                .await?;
            println!("version {version}");
        }
        CacheCommand::Delete { entry, expect } => {
            let deleted = node(&entry.node)?
                .cache_delete(&entry.namespace, &entry.key, expect.expect())
                .await?;
            if deleted {
                println!("deleted");
            } else {
                println!("there was no entry");
            }
        }
    }
    Ok(())
}
