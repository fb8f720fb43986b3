//! `fief state get|list`: a key's committed durable state from the command
//! line, read-only (`GET /v1/state/{module}/{key}`).

use anyhow::bail;
use clap::Subcommand;

use crate::client::{api_url, client, send};

#[derive(Subcommand)]
pub(crate) enum StateCommand {
    /// Print one stored value (fails if there is none).
    Get {
        /// The module.
        module: String,
        /// The key.
        key: String,
        /// The entry's name.
        name: String,
        /// The node's HTTP address.
        #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
        node: String,
    },
    /// Print a key's entries, `name<TAB>value` per line, sorted by name.
    List {
        /// The module.
        module: String,
        /// The key.
        key: String,
        /// Only names that start with this.
        #[arg(default_value = "")]
        prefix: String,
        /// At most this many entries (1 to 1000).
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// The node's HTTP address.
        #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
        node: String,
    },
}

/// The entries the node answers for `module`/`key` under `prefix`.
async fn read(
    node: &str,
    module: &str,
    key: &str,
    prefix: &str,
    limit: u32,
) -> anyhow::Result<Vec<fief::storage::StoredEntry>> {
    let url = api_url(node, &["v1", "state", module, key])?;
    let request = client()
        .get(url)
        .query(&[("prefix", prefix.to_owned()), ("limit", limit.to_string())]);
    let mut reply: serde_json::Value = send(node, request).await?.json().await?;
    Ok(serde_json::from_value(reply["entries"].take())?)
}

fn text(value: &[u8]) -> String {
    String::from_utf8_lossy(value).into_owned()
}

pub(crate) async fn state(command: StateCommand) -> anyhow::Result<()> {
    match command {
        StateCommand::Get {
            module,
            key,
            name,
            node,
        } => {
            let entries = read(&node, &module, &key, &name, 1).await?;
            match entries.into_iter().find(|e| e.name == name) {
                Some(entry) => println!("{}", text(&entry.value)),
                None => bail!("key {key:?} of module {module:?} stores nothing under {name:?}"),
            }
        }
        StateCommand::List {
            module,
            key,
            prefix,
            limit,
            node,
        } => {
            for entry in read(&node, &module, &key, &prefix, limit).await? {
                println!("{}\t{}", entry.name, text(&entry.value));
            }
        }
    }
    Ok(())
}
