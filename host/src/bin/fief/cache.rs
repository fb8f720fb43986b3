//! `fief cache get|put|delete`: the coherent cache from the command line,
//! with compare-and-set (`--if-version`, `--if-absent`).

use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand};

use crate::client::{api_error, api_url, client, connect_error, send};

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
    fn apply(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match (self.if_version, self.if_absent) {
            (Some(version), _) => request.header("if-match", format!("\"{version}\"")),
            (None, true) => request.header("if-none-match", "*"),
            (None, false) => request,
        }
    }
}

pub(crate) async fn cache(command: CacheCommand) -> anyhow::Result<()> {
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
