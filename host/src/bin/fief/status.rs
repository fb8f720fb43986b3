//! `fief status`: a node's view of its cluster as a terminal summary (nodes
//! with lease bars, the leader, the epoch, partitions per node, limbo,
//! modules), as JSON for scripts (`--json`: the node's `GET /v1/status`
//! object with its limbo entries added as `limbo`), and refreshed every
//! `--interval` with `--watch` (JSON: one object per line).

use std::fmt::Write as _;
use std::time::Duration;

use clap::Args;
use serde_json::Value;

/// Arguments of `fief status`.
#[derive(Args)]
pub(crate) struct StatusArgs {
    /// Print the status as JSON (with `--watch`: one object per line).
    #[arg(long)]
    json: bool,
    /// Refresh until interrupted.
    #[arg(long, short)]
    watch: bool,
    /// How often `--watch` refreshes, e.g. `500ms`.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// The node's HTTP address.
    #[arg(long, env = "FIEF_NODE", default_value = "http://127.0.0.1:7070")]
    node: String,
}

/// Run `fief status`.
pub(crate) async fn run(args: StatusArgs) -> anyhow::Result<()> {
    if args.interval.is_zero() {
        anyhow::bail!("--interval must be above zero, e.g. 1s");
    }
    loop {
        let status = fetch(&args.node).await;
        let status = match status {
            Ok(status) => status,
            // A watch outlives a node restart: say so and keep trying.
            Err(e) if args.watch && !args.json => {
                print!("\x1b[2J\x1b[H{e:#}\n(retrying every {:?})\n", args.interval);
                tokio::time::sleep(args.interval).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        if args.json {
            if args.watch {
                println!("{}", serde_json::to_string(&status)?);
            } else {
                println!("{}", serde_json::to_string_pretty(&status)?);
            }
        } else {
            let text = render(&status);
            if args.watch {
                // Clear the screen and go home, then draw.
                print!("\x1b[2J\x1b[H{text}");
            } else {
                print!("{text}");
            }
        }
        if !args.watch {
            return Ok(());
        }
        tokio::time::sleep(args.interval).await;
    }
}

/// The node's status with its limbo entries added as `limbo` (left out if
/// the node would not list them).
async fn fetch(node: &str) -> anyhow::Result<Value> {
    let client = crate::client::node(node)?;
    let mut status = client.status().await?;
    if let Ok(limbo) = client.limbo().await
        && let Some(object) = status.as_object_mut()
    {
        object.insert("limbo".to_owned(), limbo);
    }
    Ok(status)
}

/// A lease bar of `width` cells: `remaining` of `ttl` filled.
pub(crate) fn lease_bar(remaining_ms: f64, ttl_ms: f64, width: usize) -> String {
    let share = if ttl_ms > 0.0 {
        (remaining_ms / ttl_ms).clamp(0.0, 1.0)
    } else {
        0.0
    };
    let filled = (share * width as f64).round() as usize;
    format!("[{}{}]", "#".repeat(filled), "-".repeat(width - filled))
}

/// The terminal summary of a status object (as `GET /v1/status` returns it,
/// optionally with `limbo`).
pub(crate) fn render(status: &Value) -> String {
    let mut out = String::new();
    let text = |v: &Value| v.as_str().unwrap_or("?").to_owned();
    let num = |v: &Value| v.as_f64().unwrap_or(0.0);
    let me = text(&status["node_id"]);
    let ttl = num(&status["lease_ttl_ms"]);
    let nodes = status["nodes"].as_array().cloned().unwrap_or_default();
    let leader = nodes
        .iter()
        .find(|n| n["leader"].as_bool() == Some(true))
        .map_or_else(|| "none".to_owned(), |n| text(&n["id"]));
    let term = match status["leader_term"].as_u64() {
        Some(term) => format!(" (this node, term {term})"),
        None => String::new(),
    };
    let _ = writeln!(
        out,
        "namespace {} · node {me} · leader {leader}{term} · table epoch {} · {} partitions",
        text(&status["namespace"]),
        status["epoch"],
        status["partitions"],
    );
    let _ = writeln!(
        out,
        "this node: lease {} ({} ms to fence point), fences so far: {}{}",
        text(&status["lease"]),
        status["lease_remaining_ms"],
        status["fences"],
        if status["leaving"].as_bool() == Some(true) {
            ", leaving"
        } else {
            ""
        }
    );
    if let Some(regression) = status["arbiter_regression"].as_str() {
        let _ = writeln!(
            out,
            "ARBITER WENT BACK IN TIME (the node fenced): {regression}"
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "  {:<16} {:<8} {:<30} {:>10}  PEER",
        "NODE", "STATE", "LEASE (time to expiry)", "PARTITIONS"
    );
    for node in &nodes {
        let id = text(&node["id"]);
        let mut state = if node["leaving"].as_bool() == Some(true) {
            "leaving".to_owned()
        } else {
            "live".to_owned()
        };
        // This node's own lease is known exactly; the others' as the arbiter
        // judged them when this node last asked.
        let remaining = if id == me {
            state = text(&status["lease"]);
            num(&status["lease_remaining_ms"])
        } else {
            num(&node["lease_remaining_ms"])
        };
        let name = if node["leader"].as_bool() == Some(true) {
            format!("{id} (leader)")
        } else {
            id.clone()
        };
        let _ = writeln!(
            out,
            "  {:<16} {:<8} {} {:>5.1}s {:>10}  {}",
            name,
            state,
            lease_bar(remaining, ttl, 20),
            remaining / 1000.0,
            node["partitions"],
            node["peer_addr"].as_str().unwrap_or("-"),
        );
    }
    if nodes.is_empty() {
        let _ = writeln!(
            out,
            "  (no live node known: the node has not reached the arbiter)"
        );
    }
    let _ = writeln!(out);
    let limbo = match status["limbo"].as_array() {
        Some(entries) => entries.len().to_string(),
        None => "?".to_owned(),
    };
    let _ = writeln!(
        out,
        "  partitions: {} of {} owned by this node; live keys: {}; in limbo: {limbo}; topics: {}",
        status["partitions_owned"], status["partitions"], status["live_keys"], status["topics"]
    );
    let cache = &status["cache"];
    let _ = writeln!(
        out,
        "  cache: {} entries, {} of {} bytes; {} hits, {} misses, {} evictions, {} dropped at ownership changes",
        cache["entries"],
        cache["bytes"],
        cache["max_bytes"],
        cache["hits"],
        cache["misses"],
        cache["evictions"],
        cache["ownership_drops"]
    );
    if let Some(storage) = status["storage"].as_str() {
        let _ = writeln!(out, "  storage: {storage}");
    }
    for tenant in status["host_bytes"].as_array().into_iter().flatten() {
        let name = match tenant["tenant"].as_str() {
            Some("") | None => "modules of no tenant".to_owned(),
            Some(t) => format!("tenant {t}"),
        };
        let _ = writeln!(
            out,
            "  host memory, {name}: {} of {} bytes; {} refused",
            tenant["bytes"], tenant["limit"], tenant["refused"]
        );
    }
    for tenant in status["tenant_cpu"].as_array().into_iter().flatten() {
        let name = match tenant["tenant"].as_str() {
            Some("") | None => "modules of no tenant".to_owned(),
            Some(t) => format!("tenant {t}"),
        };
        let budget = match tenant["budget"].as_str() {
            Some(cores) => format!(" (budget {cores})"),
            None => String::new(),
        };
        let _ = writeln!(
            out,
            "  cpu, {name}: {:.3} s, throttled {:.3} s{budget}",
            tenant["cpu_seconds"].as_f64().unwrap_or(0.0),
            tenant["throttled_seconds"].as_f64().unwrap_or(0.0)
        );
    }
    for module in status["modules"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "  module {} v{}: {} live keys, {} bytes, on_fence {}, cpu {:.3} s, throttled {:.3} s",
            text(&module["name"]),
            module["version"],
            module["live_keys"],
            module["size_bytes"],
            module["options"]["on_fence"].as_str().unwrap_or("?"),
            module["cpu_seconds"].as_f64().unwrap_or(0.0),
            module["throttled_seconds"].as_f64().unwrap_or(0.0)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_bars_fill_with_time_left() {
        assert_eq!(lease_bar(2500.0, 5000.0, 10), "[#####-----]");
        assert_eq!(lease_bar(0.0, 5000.0, 4), "[----]");
        assert_eq!(lease_bar(9000.0, 5000.0, 4), "[####]");
        assert_eq!(lease_bar(1.0, 0.0, 4), "[----]");
    }

    #[test]
    fn the_summary_names_nodes_leader_and_limbo() {
        let status = serde_json::json!({
            "namespace": "default", "node_id": "a", "lease": "current",
            "lease_remaining_ms": 3000, "lease_ttl_ms": 5000, "leader_term": 4,
            "epoch": 9, "partitions": 8, "partitions_owned": 5, "fences": 1,
            "leaving": false, "live_keys": 2, "topics": 0,
            "nodes": [
                {"id": "a", "peer_addr": "127.0.0.1:1", "leader": true, "leaving": false,
                 "lease_remaining_ms": 4000, "partitions": 5},
                {"id": "b", "peer_addr": null, "leader": false, "leaving": false,
                 "lease_remaining_ms": 1000, "partitions": 3}
            ],
            "cache": {}, "modules": [{"name": "counter", "version": 1, "live_keys": 2,
                "size_bytes": 10, "options": {"on_fence": "terminate"}}],
            "limbo": [{"module": "m", "key": "k"}],
            "host_bytes": [{"tenant": "acme", "bytes": 2048, "limit": 4096, "refused": 3}],
            "tenant_cpu": [{"tenant": "acme", "cpu_seconds": 1.5, "throttled_seconds": 0.25,
                "budget": "500m"}]
        });
        let text = render(&status);
        assert!(text.contains("leader a (this node, term 4)"), "{text}");
        assert!(text.contains("a (leader)"), "{text}");
        assert!(text.contains("[############--------]"), "{text}");
        assert!(text.contains("[####----------------]"), "{text}");
        assert!(text.contains("in limbo: 1"), "{text}");
        assert!(text.contains("module counter v1"), "{text}");
        assert!(
            text.contains("cpu, tenant acme: 1.500 s, throttled 0.250 s (budget 500m)"),
            "{text}"
        );
        assert!(
            text.contains("host memory, tenant acme: 2048 of 4096 bytes; 3 refused"),
            "{text}"
        );
        assert!(text.contains("throttled 0.000 s"), "{text}");
        assert!(!text.contains("BACK IN TIME"), "{text}");
    }

    #[test]
    fn an_arbiter_that_went_back_in_time_is_shown_first() {
        let status = serde_json::json!({
            "node_id": "a", "lease": "fenced", "fences": 2,
            "arbiter_regression": "the arbiter went back in time: its partition table is at epoch 1, but this node has read epoch 3"
        });
        let text = render(&status);
        assert!(
            text.contains("ARBITER WENT BACK IN TIME (the node fenced): the arbiter went back in time: its partition table is at epoch 1"),
            "{text}"
        );
    }
}
