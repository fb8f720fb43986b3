//! The small client commands: `call` and `cast` to a key, `limbo` (the
//! survivors in a node's limbo) and `leave` (a node leaves its cluster).

use clap::Args;

use crate::client::node;

#[derive(Args)]
pub(crate) struct KeyArgs {
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
pub(crate) struct NodeUrl {
    /// The node's HTTP address.
    #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
    node: String,
}

#[derive(Args)]
pub(crate) struct StatusArgs {
    /// Print the status as JSON.
    #[arg(long)]
    json: bool,
    /// The node's HTTP address.
    #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
    node: String,
}

pub(crate) async fn call(args: KeyArgs, verb: &str) -> anyhow::Result<()> {
    let client = node(&args.node)?;
    if verb == "call" {
        let reply = client.call(&args.module, &args.key, args.message).await?;
        println!("{}", String::from_utf8_lossy(&reply));
    } else {
        client.cast(&args.module, &args.key, args.message).await?;
    }
    Ok(())
}

pub(crate) async fn limbo(args: StatusArgs) -> anyhow::Result<()> {
    let entries = node(&args.node)?.limbo().await?;
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

pub(crate) async fn leave(args: NodeUrl) -> anyhow::Result<()> {
    let report = node(&args.node)?.leave().await?;
    println!("the node left the cluster and is stopping");
    if report.no_other_node {
        println!("there was no other node to hand to: its keys stopped with their state");
    }
    if !report.released {
        println!(
            "the arbiter never confirmed the release: the lease is fenced and lapses at its TTL, when others take what it still held"
        );
    }
    let lost = report.lost_states;
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
