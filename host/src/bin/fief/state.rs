//! `fief state get|list` and `fief alarms`: a key's committed durable state
//! and alarms from the command line, read-only (`GET /v1/state/{module}/{key}`,
//! `GET /v1/alarms/{module}/{key}`).

use anyhow::bail;
use clap::{Args, Subcommand};

use crate::client::node;

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
    url: &str,
    module: &str,
    key: &str,
    prefix: &str,
    limit: u32,
) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let entries = node(url)?.state(module, key, prefix, limit).await?;
    entries
        .into_iter()
        .map(|e| {
            let bytes = e
                .bytes()
                .ok_or_else(|| anyhow::anyhow!("entry {:?} has no readable value", e.name))?;
            Ok((e.name, bytes))
        })
        .collect()
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
            match entries.into_iter().find(|(n, _)| *n == name) {
                Some((_, value)) => println!("{}", text(&value)),
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
            for (name, value) in read(&node, &module, &key, &prefix, limit).await? {
                println!("{name}\t{}", text(&value));
            }
        }
    }
    Ok(())
}

/// `fief alarms MODULE KEY`.
#[derive(Args)]
pub(crate) struct AlarmsArgs {
    /// The module.
    module: String,
    /// The key.
    key: String,
    /// The node's HTTP address.
    #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
    node: String,
    /// Print the node's JSON answer instead of lines.
    #[arg(long)]
    json: bool,
}

/// Print a key's alarms: `name<TAB>time (UTC)<TAB>due in / overdue by`,
/// sorted by name.
pub(crate) async fn alarms(args: AlarmsArgs) -> anyhow::Result<()> {
    let alarms = node(&args.node)?.alarms(&args.module, &args.key).await?;
    if args.json {
        println!("{}", serde_json::json!({ "alarms": alarms }));
        return Ok(());
    }
    for alarm in alarms {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(alarm.at_ms);
        let due = std::time::Duration::from_millis(alarm.due_in_ms.unsigned_abs());
        let when = if alarm.due_in_ms >= 0 {
            format!("due in {}", humantime::format_duration(due))
        } else {
            format!("overdue by {}", humantime::format_duration(due))
        };
        println!(
            "{}\t{}\t{when}",
            alarm.name,
            humantime::format_rfc3339_millis(at)
        );
    }
    Ok(())
}
