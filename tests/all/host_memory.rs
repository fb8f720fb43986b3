//! Host memory a key makes the node hold outside its linear memory (issue
//! 16, finding 3; `docs/security.md`): armed timers' tags and queued
//! messages are charged to the key (`max_host_bytes_per_key`) and to its
//! tenant (`max_host_bytes_per_tenant`); past either the host refuses with
//! an error naming the limit, gives the bytes back when they are freed, and
//! the other keys and tenants are served throughout.

use std::sync::Arc;
use std::time::Duration;

use fief::config::ByteSize;
use fief::{Error, Instance, ModuleOptions, NodeConfig};
use fief_tests::{call_text, eventually, guests, test_config};

use crate::hostile::hostile_options;

const MIB: usize = 1024 * 1024;

/// The hostile module's options with 4 MiB of host memory per key.
fn options() -> ModuleOptions {
    ModuleOptions {
        max_host_bytes_per_key: ByteSize::mib(4),
        max_timers_per_key: 1024,
        ..hostile_options()
    }
}

/// A node with `acme/hostile` (with [`options`]) and `globex/probe`.
async fn node(config: NodeConfig) -> Arc<Instance> {
    Arc::new(
        fief_tests::node_with_options(
            config,
            &[
                ("acme/hostile", guests::HOSTILE, options()),
                ("globex/probe", guests::PROBE, ModuleOptions::default()),
            ],
        )
        .await,
    )
}

/// `<count> <error>` from the hostile guest.
fn count_and_error(reply: &str) -> (usize, &str) {
    let (count, why) = reply.split_once(' ').expect("a count and an error");
    (count.parse().expect("a count"), why)
}

/// The bytes the node holds for `tenant`'s keys.
fn tenant_bytes(node: &Instance, tenant: &str) -> usize {
    node.status()
        .host_bytes
        .iter()
        .find(|t| t.tenant == tenant)
        .map_or(0, |t| t.bytes)
}

/// The other tenant is served: a call, and a timer with a 512 KiB tag.
async fn other_tenant_served(node: &Instance) {
    assert_eq!(
        call_text(node, "globex/probe", "bystander", "ping").await,
        "pong"
    );
    let tag = "t".repeat(MIB / 2);
    let armed = call_text(
        node,
        "globex/probe",
        "bystander",
        &format!("after 3600000 {tag}"),
    )
    .await;
    assert!(!armed.starts_with("error"), "{armed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timer_tags_are_bounded_by_the_keys_host_memory() {
    let node = node(test_config()).await;
    let reply = call_text(&node, "acme/hostile", "h", &format!("big-timers {MIB}")).await;
    let (armed, why) = count_and_error(&reply);
    // 4 MiB hold three 1 MiB tags with their bookkeeping, not four; without
    // the bound the key arms its 1,024 timers: 1 GiB of node memory.
    assert_eq!(armed, 3, "{reply}");
    assert!(why.contains("max_host_bytes_per_key"), "{why}");
    let key = node
        .keys()
        .into_iter()
        .find(|k| k.key == "h")
        .expect("h is live");
    assert!(
        key.host_bytes >= 3 * MIB && key.host_bytes <= 4 * MIB,
        "{key:?}"
    );
    assert!(tenant_bytes(&node, "acme") >= 3 * MIB);
    other_tenant_served(&node).await;
    // Refused, not killed; and the bytes come back with the key's store.
    assert_eq!(call_text(&node, "acme/hostile", "h", "ping").await, "pong");
    assert!(node.kill_key("acme/hostile", "h"));
    eventually(
        Duration::from_secs(10),
        "acme's timer tags are given back",
        || tenant_bytes(&node, "acme") == 0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_messages_are_bounded_by_the_keys_host_memory() {
    let node = node(test_config()).await;
    // The key blocks in a call (no CPU), so casts queue in its mailbox.
    let busy = {
        let node = node.clone();
        tokio::spawn(async move { node.call("acme/hostile", "h", b"sleep 3000".to_vec()).await })
    };
    eventually(Duration::from_secs(10), "h is live", || {
        node.keys().iter().any(|k| k.key == "h")
    })
    .await;
    let mut queued = 0;
    let refusal = loop {
        match node.cast("acme/hostile", "h", vec![b'c'; MIB]) {
            Ok(()) => queued += 1,
            Err(e) => break e,
        }
        // Without the bound the mailbox (1,024 deep) takes a GiB.
        assert!(queued <= 8, "casts of 1 MiB kept being queued");
    };
    // The first message went in before the key blocked; the sleep call
    // took its mailbox slot out, so 3 or 4 MiB-casts fit beside it.
    assert!(
        (3..=4).contains(&queued),
        "{queued} queued before {refusal}"
    );
    assert!(
        matches!(&refusal, Error::HostMemory { refusal, .. } if refusal.option == "max_host_bytes_per_key"),
        "{refusal}"
    );
    assert_eq!(refusal.http_status(), 429, "a retry-later refusal");
    let text = refusal.to_string();
    assert!(
        text.contains("max_host_bytes_per_key") && text.contains("retry"),
        "{text}"
    );
    other_tenant_served(&node).await;
    assert_eq!(
        busy.await.expect("the busy call").expect("it answers"),
        b"slept"
    );
    // Taken out of the mailbox, the casts' bytes come back.
    eventually(Duration::from_secs(10), "the mailbox drains", || {
        node.keys()
            .iter()
            .find(|k| k.key == "h")
            .is_some_and(|k| k.host_bytes == 0)
    })
    .await;
    node.cast("acme/hostile", "h", vec![b'c'; MIB])
        .expect("room again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_keys_share_one_budget_and_cannot_take_another_tenants() {
    let config = NodeConfig {
        max_host_bytes_per_tenant: ByteSize::mib(8),
        ..test_config()
    };
    let node = node(config).await;
    let mut armed = Vec::new();
    let mut last = String::new();
    for key in ["h1", "h2", "h3"] {
        last = call_text(&node, "acme/hostile", key, &format!("big-timers {MIB}")).await;
        armed.push(count_and_error(&last).0);
    }
    // Two keys take three tags each (their own 4 MiB); the third finds
    // acme's 8 MiB nearly spent.
    assert_eq!(armed[..2], [3, 3], "{armed:?}");
    assert!(armed[2] <= 1, "{armed:?}");
    let (_, why) = count_and_error(&last);
    assert!(
        why.contains("acme") && why.contains("max_host_bytes_per_tenant"),
        "{why}"
    );
    let acme = node
        .status()
        .host_bytes
        .into_iter()
        .find(|t| t.tenant == "acme")
        .expect("acme is accounted");
    assert!(acme.bytes <= 8 * MIB && acme.limit == 8 * MIB, "{acme:?}");
    assert!(acme.refused >= 1, "{acme:?}");
    // globex has a budget of its own.
    other_tenant_served(&node).await;
    let metrics = node.metrics_text().await;
    assert!(
        metrics.contains("fief_host_bytes{tenant=\"acme\"}"),
        "the gauge is exported"
    );
}
