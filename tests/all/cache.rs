//! The coherent single-owner cache (issue "Coherent single-owner cache"):
//! the library API, HTTP and CLI on one node; guest imports; and, on three
//! nodes over real sockets, coherence under concurrent writers (a
//! linearizability check of every key's history), compare-and-set under
//! contention, and entries dropped at every ownership change (handoff,
//! fence, takeover) with no stale read from a fenced node.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fief::cache::{Expect, PutOptions};
use fief::{Cache, Error};
use fief_tests::{
    HttpServer, NodeProcess, call_text, eventually, eventually_async, fief_cli, guests, node_with,
};

use crate::cluster::Cluster;
use crate::linearizability::{self, Answer, Event, Op};

fn cas(version: u64) -> PutOptions {
    PutOptions {
        expect: Expect::Version(version),
        ..PutOptions::default()
    }
}

// ---- one node ----

#[tokio::test]
async fn a_client_reads_its_own_writes_and_versions_rise() {
    let node = node_with(&[]).await;
    let cache = node.cache();
    assert_eq!(cache.get("s", "alice").await.unwrap(), None);
    let v1 = cache
        .put("s", "alice", b"one".to_vec(), PutOptions::default())
        .await
        .unwrap();
    let entry = cache.get("s", "alice").await.unwrap().expect("written");
    assert_eq!(
        (entry.value, entry.version, entry.expires_in),
        (b"one".to_vec(), v1, None)
    );
    let v2 = cache
        .put("s", "alice", b"two".to_vec(), PutOptions::default())
        .await
        .unwrap();
    assert!(v2 > v1, "{v2} > {v1}");
    // Namespaces are separate.
    assert_eq!(cache.get("other", "alice").await.unwrap(), None);
    assert!(cache.delete("s", "alice", Expect::Any).await.unwrap());
    assert!(!cache.delete("s", "alice", Expect::Any).await.unwrap());
    assert_eq!(cache.get("s", "alice").await.unwrap(), None);
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.misses, stats.entries), (1, 3, 0));
    node.shutdown().await;
}

#[tokio::test]
async fn compare_and_set_writes_only_over_the_expected_version() {
    let node = node_with(&[]).await;
    let cache = node.cache();
    let absent = PutOptions {
        expect: Expect::Absent,
        ..PutOptions::default()
    };
    let v1 = cache.put("s", "k", b"a".to_vec(), absent).await.unwrap();
    assert_eq!(
        cache.put("s", "k", b"b".to_vec(), absent).await,
        Err(Error::VersionConflict { current: Some(v1) })
    );
    let v2 = cache.put("s", "k", b"b".to_vec(), cas(v1)).await.unwrap();
    assert_eq!(
        cache.put("s", "k", b"c".to_vec(), cas(v1)).await,
        Err(Error::VersionConflict { current: Some(v2) })
    );
    assert_eq!(
        cache.delete("s", "k", Expect::Version(v1)).await,
        Err(Error::VersionConflict { current: Some(v2) })
    );
    let entry = cache.get("s", "k").await.unwrap().unwrap();
    assert_eq!(entry.value, b"b", "failed writes changed nothing");
    assert!(cache.delete("s", "k", Expect::Version(v2)).await.unwrap());
    node.shutdown().await;
}

#[tokio::test]
async fn entries_expire_after_their_ttl() {
    let node = node_with(&[]).await;
    let cache = node.cache();
    let short = PutOptions {
        ttl: Some(Duration::from_millis(50)),
        ..PutOptions::default()
    };
    let long = PutOptions {
        ttl: Some(Duration::from_secs(3600)),
        ..PutOptions::default()
    };
    cache.put("s", "short", b"x".to_vec(), short).await.unwrap();
    cache.put("s", "long", b"y".to_vec(), long).await.unwrap();
    let entry = cache.get("s", "long").await.unwrap().unwrap();
    let left = entry.expires_in.expect("a ttl was set");
    assert!(
        left <= Duration::from_secs(3600) && left > Duration::from_secs(3000),
        "{left:?}"
    );
    eventually_async(
        Duration::from_secs(10),
        "the short entry expires",
        || async { cache.get("s", "short").await.unwrap().is_none() },
    )
    .await;
    assert!(cache.get("s", "long").await.unwrap().is_some());
    assert_eq!(cache.stats().expirations, 1);
    node.shutdown().await;
}

#[tokio::test]
async fn bad_cache_requests_are_refused_and_change_nothing() {
    let node = node_with(&[]).await;
    let cache = node.cache();
    cache
        .put("s", "k", b"kept".to_vec(), PutOptions::default())
        .await
        .unwrap();
    // One `/` separates a tenant from its namespace (`acme/sessions`, as
    // the admin names a tenant's namespace); more is never a namespace.
    let err = cache.get("a/b/c", "k").await.unwrap_err();
    assert_eq!(err.code(), "invalid_key", "{err}");
    assert!(err.to_string().contains("cache namespace"), "{err}");
    let err = cache.get("s", "").await.unwrap_err();
    assert_eq!(err.code(), "invalid_key", "{err}");
    let limit = node.config().max_message_size.as_u64() as usize;
    let err = cache
        .put("s", "k", vec![0; limit + 1], PutOptions::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), "message_too_large", "{err}");
    assert_eq!(cache.get("s", "k").await.unwrap().unwrap().value, b"kept");
    node.shutdown().await;
}

#[tokio::test]
async fn the_memory_bound_evicts_least_recently_used_entries() {
    let config = fief::NodeConfig {
        cache_max_bytes: fief::config::ByteSize::kib(64),
        ..fief_tests::test_config()
    };
    let node = fief_tests::node_with_options(config, &[]).await;
    let cache = node.cache();
    for i in 0..100 {
        cache
            .put("s", &format!("k{i}"), vec![0; 1024], PutOptions::default())
            .await
            .unwrap();
    }
    let stats = cache.stats();
    assert!(stats.bytes <= 64 * 1024, "{stats:?}");
    assert!(stats.evictions > 0 && stats.entries < 100, "{stats:?}");
    assert_eq!(stats.entries + stats.evictions, 100, "{stats:?}");
    assert!(
        cache.get("s", "k99").await.unwrap().is_some(),
        "the newest stays"
    );
    assert!(
        cache.get("s", "k0").await.unwrap().is_none(),
        "the oldest went"
    );
    node.shutdown().await;
}

#[tokio::test]
async fn a_fenced_node_serves_no_cache_and_keeps_nothing() {
    let node = node_with(&[]).await;
    let cache = node.cache();
    cache
        .put("s", "k", b"v".to_vec(), PutOptions::default())
        .await
        .unwrap();
    node.fence_now();
    assert_eq!(cache.get("s", "k").await, Err(Error::Fenced));
    assert_eq!(
        cache
            .put("s", "k", b"w".to_vec(), PutOptions::default())
            .await,
        Err(Error::Fenced)
    );
    let stats = cache.stats();
    assert_eq!((stats.entries, stats.bytes), (0, 0), "{stats:?}");
    // After it rejoins, the partition is owned anew: the entry is gone.
    eventually_async(Duration::from_secs(10), "the node serves again", || async {
        cache.get("s", "k").await.is_ok()
    })
    .await;
    assert_eq!(cache.get("s", "k").await.unwrap(), None);
    node.shutdown().await;
}

#[tokio::test]
async fn keys_use_the_cache_through_host_imports() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    let version = call_text(&node, "probe", "alice", "cache-put s alice from-the-key").await;
    let version: u64 = version
        .parse()
        .unwrap_or_else(|_| panic!("a version: {version}"));
    // The host API sees what the key wrote, and the other way round.
    let entry = node.cache().get("s", "alice").await.unwrap().unwrap();
    assert_eq!(
        (entry.value.as_slice(), entry.version),
        (&b"from-the-key"[..], version)
    );
    let v2 = node
        .cache()
        .put("s", "bob", b"from-outside".to_vec(), PutOptions::default())
        .await
        .unwrap();
    assert_eq!(
        call_text(&node, "probe", "alice", "cache-get s bob").await,
        format!("{v2} from-outside")
    );
    assert_eq!(
        call_text(&node, "probe", "alice", "cache-get s nobody").await,
        "none"
    );
    // A compare-and-set conflict is a result the key can handle.
    let reply = call_text(
        &node,
        "probe",
        "alice",
        &format!("cache-cas s bob {} x", v2 + 1),
    )
    .await;
    assert!(
        reply.starts_with("error:") && reply.contains("Conflict"),
        "{reply}"
    );
    let reply = call_text(&node, "probe", "alice", &format!("cache-cas s bob {v2} x")).await;
    assert!(reply.parse::<u64>().is_ok_and(|v| v > v2), "{reply}");
    let reply = call_text(&node, "probe", "alice", "cache-get bad/ns k").await;
    assert!(
        reply.starts_with("error:") && reply.contains("Invalid"),
        "{reply}"
    );
    assert_eq!(
        call_text(&node, "probe", "alice", "cache-delete s bob").await,
        "true"
    );
    node.shutdown().await;
}

#[tokio::test]
async fn http_cache_api_speaks_etags_and_preconditions() {
    let node = Arc::new(node_with(&[]).await);
    let server = HttpServer::start(node.clone()).await;
    let client = reqwest::Client::new();
    let url = server.url("/v1/cache/sessions/alice");

    let miss = client.get(&url).send().await.unwrap();
    assert_eq!(miss.status(), 404);
    let body: serde_json::Value = miss.json().await.unwrap();
    assert_eq!(body["error"]["code"], "not_found");

    let put = client.put(&url).body("t1").send().await.unwrap();
    assert_eq!(put.status(), 200);
    let etag = put.headers()["etag"].to_str().unwrap().to_owned();
    let body: serde_json::Value = put.json().await.unwrap();
    assert_eq!(etag, format!("\"{}\"", body["version"]));

    let got = client.get(&url).send().await.unwrap();
    assert_eq!(got.status(), 200);
    assert_eq!(got.headers()["etag"].to_str().unwrap(), etag);
    assert_eq!(got.text().await.unwrap(), "t1");

    // If-None-Match: * refuses to overwrite; a stale If-Match too.
    let refused = client
        .put(&url)
        .header("if-none-match", "*")
        .body("t2")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 412);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "version_conflict");
    let updated = client
        .put(&url)
        .header("if-match", &etag)
        .body("t2")
        .send()
        .await
        .unwrap();
    assert_eq!(updated.status(), 200);
    let stale = client
        .put(&url)
        .header("if-match", &etag)
        .body("t3")
        .send()
        .await
        .unwrap();
    assert_eq!(stale.status(), 412);
    let stale_delete = client
        .delete(&url)
        .header("if-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(stale_delete.status(), 412);
    assert_eq!(
        client.get(&url).send().await.unwrap().text().await.unwrap(),
        "t2"
    );

    // A ttl shows as the time left.
    let with_ttl = client
        .put(server.url("/v1/cache/sessions/bob?ttl=1h"))
        .body("b")
        .send()
        .await
        .unwrap();
    assert_eq!(with_ttl.status(), 200);
    let got = client
        .get(server.url("/v1/cache/sessions/bob"))
        .send()
        .await
        .unwrap();
    let left: u64 = got.headers()["x-fief-expires-in-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(left > 3_000_000 && left <= 3_600_000, "{left}");

    // Bad input: a clear error, nothing changed.
    for (request, code) in [
        (
            client
                .put(server.url("/v1/cache/sessions/alice?ttl=soon"))
                .body("x"),
            "invalid_key",
        ),
        (
            client
                .put(server.url("/v1/cache/sessions/alice?color=red"))
                .body("x"),
            "invalid_key",
        ),
        (
            client.put(&url).header("if-match", "abc").body("x"),
            "invalid_key",
        ),
        (
            client.get(server.url("/v1/cache/bad%2Fns/alice")),
            "invalid_key",
        ),
    ] {
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 400);
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], code, "{body}");
    }
    let limit = node.config().max_message_size.as_u64() as usize;
    let too_big = client
        .put(&url)
        .body(vec![0; limit + 1])
        .send()
        .await
        .unwrap();
    assert_eq!(too_big.status(), 413);
    assert_eq!(
        client.get(&url).send().await.unwrap().text().await.unwrap(),
        "t2"
    );

    let deleted = client.delete(&url).send().await.unwrap();
    let body: serde_json::Value = deleted.json().await.unwrap();
    assert_eq!(body["deleted"], true);
    assert_eq!(client.get(&url).send().await.unwrap().status(), 404);

    let status: serde_json::Value = client
        .get(server.url("/v1/status"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["cache"]["entries"], 1, "bob is left: {status}");
    assert!(status["cache"]["hits"].as_u64().unwrap() >= 4, "{status}");
}

#[test]
fn cli_gets_puts_and_deletes() {
    let node = NodeProcess::start(&[]);
    let run = |args: &[&str]| {
        let mut all = vec!["cache"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--node", &node.url]);
        let output = fief_cli(&all);
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).trim().to_owned(),
            String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        )
    };
    let (ok, out, err) = run(&["put", "s", "alice", "hello", "--ttl", "1h"]);
    assert!(ok, "{err}");
    let version: u64 = out
        .strip_prefix("version ")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("`version N`: {out}"));
    let (ok, out, err) = run(&["get", "s", "alice", "--verbose"]);
    assert!(ok, "{err}");
    assert_eq!(out, "hello");
    assert!(err.contains(&format!("version {version}")), "{err}");
    let (ok, _, err) = run(&["put", "s", "alice", "again", "--if-absent"]);
    assert!(!ok);
    assert!(err.contains("version conflict"), "{err}");
    let (ok, _, err) = run(&[
        "put",
        "s",
        "alice",
        "again",
        "--if-version",
        &version.to_string(),
    ]);
    assert!(ok, "{err}");
    let (ok, out, err) = run(&["delete", "s", "alice"]);
    assert!(ok, "{err}");
    assert_eq!(out, "deleted");
    let (ok, _, err) = run(&["get", "s", "alice"]);
    assert!(!ok, "a miss fails");
    assert!(err.contains("no entry"), "{err}");
}

// ---- three nodes ----

/// Run one client's operations on `keys` through `cache`, recording each
/// with its invocation and return times. Deterministic per `client`.
async fn client_ops(
    client: usize,
    cache: Cache,
    keys: Vec<String>,
    ops: usize,
) -> Vec<(String, Event)> {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ (client as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut last_seen: std::collections::HashMap<String, u64> = Default::default();
    let mut history = Vec::new();
    for n in 0..ops {
        let key = keys[next(keys.len() as u64) as usize].clone();
        let value = format!("c{client}-{n}");
        let roll = next(100);
        let expect = match (roll, last_seen.get(&key)) {
            (0..40, _) => None,
            (40..65, _) => Some(Expect::Any),
            (65..90, Some(v)) => Some(Expect::Version(*v)),
            (65..90, None) => Some(Expect::Absent),
            _ => Some(Expect::Any),
        };
        let delete = roll >= 95;
        let invoked = Instant::now();
        let (op, answer) = if delete {
            let result = cache.delete("lin", &key, Expect::Any).await;
            (
                Op::Delete {
                    expect: Expect::Any,
                },
                match result {
                    Ok(existed) => Answer::Deleted(existed),
                    Err(Error::VersionConflict { current }) => Answer::Conflict(current),
                    Err(e) => panic!("client {client}: delete {key} failed: {e}"),
                },
            )
        } else if let Some(expect) = expect {
            let options = PutOptions {
                expect,
                ..PutOptions::default()
            };
            let result = cache
                .put("lin", &key, value.clone().into_bytes(), options)
                .await;
            let answer = match result {
                Ok(version) => Answer::Written(version),
                Err(Error::VersionConflict { current }) => Answer::Conflict(current),
                Err(e) => panic!("client {client}: put {key} failed: {e}"),
            };
            (Op::Put { value, expect }, answer)
        } else {
            let result = cache.get("lin", &key).await;
            let entry = result.unwrap_or_else(|e| panic!("client {client}: get {key} failed: {e}"));
            if let Some(entry) = &entry {
                last_seen.insert(key.clone(), entry.version);
            }
            let seen = entry.map(|e| (String::from_utf8(e.value).unwrap(), e.version));
            (Op::Get, Answer::Read(seen))
        };
        if let Answer::Written(v) = &answer {
            last_seen.insert(key.clone(), *v);
        }
        let returned = Instant::now();
        history.push((
            key,
            Event {
                client,
                op,
                answer,
                invoked,
                returned,
            },
        ));
    }
    history
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_through_every_node_see_a_linearizable_cache() {
    let c = Cluster::start(3, &[]).await;
    c.stabilize().await;
    // Keys owned by each node, so every client reaches some keys locally
    // and some through the transport.
    let keys = vec![
        c.key_owned_by(0).await,
        c.key_owned_by(1).await,
        c.key_owned_by(2).await,
    ];
    let mut tasks = Vec::new();
    for client in 0..6 {
        let cache = c.node(client % 3).cache();
        tasks.push(tokio::spawn(client_ops(client, cache, keys.clone(), 40)));
    }
    let mut per_key: std::collections::BTreeMap<String, Vec<Event>> = Default::default();
    for task in tasks {
        for (key, event) in task.await.unwrap() {
            per_key.entry(key).or_default().push(event);
        }
    }
    let mut checked = 0;
    for (key, history) in &per_key {
        linearizability::check(history).unwrap_or_else(|e| panic!("key {key}: {e}"));
        checked += history.len();
    }
    assert_eq!(checked, 240);
    // Each key's entry lives on its owner only: one key per node at most.
    for i in 0..3 {
        let stats = c.node(i).cache().stats();
        assert!(stats.entries <= 1, "n{i} holds only its own key: {stats:?}");
    }
    c.check();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn compare_and_set_under_contention_loses_no_update() {
    let c = Cluster::start(3, &[]).await;
    c.stabilize().await;
    let key = c.key_owned_by(1).await;
    let mut tasks = Vec::new();
    for client in 0..6 {
        let cache = c.node(client % 3).cache();
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            let mut conflicts = 0;
            for _ in 0..15 {
                loop {
                    let current = cache.get("cas", &key).await.unwrap();
                    let (count, expect) = match &current {
                        Some(e) => (
                            String::from_utf8_lossy(&e.value).parse::<u64>().unwrap() + 1,
                            Expect::Version(e.version),
                        ),
                        None => (1, Expect::Absent),
                    };
                    let options = PutOptions {
                        expect,
                        ..PutOptions::default()
                    };
                    match cache
                        .put("cas", &key, count.to_string().into_bytes(), options)
                        .await
                    {
                        Ok(_) => break,
                        Err(Error::VersionConflict { .. }) => conflicts += 1,
                        Err(e) => panic!("client {client}: {e}"),
                    }
                }
            }
            conflicts
        }));
    }
    let mut conflicts = 0;
    for task in tasks {
        conflicts += task.await.unwrap();
    }
    let entry = c.node(0).cache().get("cas", &key).await.unwrap().unwrap();
    assert_eq!(
        String::from_utf8(entry.value).unwrap(),
        "90",
        "6 clients × 15 increments"
    );
    eprintln!("{conflicts} conflicts were retried");
    c.check();
}

/// Put entries for five keys that `n<owner>` owns, via `n<via>`; returns
/// (key, version) for each.
async fn fill(c: &Cluster, owner: usize, via: usize) -> Vec<(String, u64)> {
    let partitions = fief::core::PartitionCount::new(crate::cluster::PARTITIONS).unwrap();
    let table = c.arbiter_table().await;
    let owner_id = fief::core::NodeId::new(format!("n{owner}"));
    let keys: Vec<String> = (0..1000)
        .map(|k| format!("fill-{k}"))
        .filter(|k| {
            table
                .owner(partitions.of(k))
                .is_some_and(|a| a.node == owner_id)
        })
        .take(5)
        .collect();
    assert_eq!(keys.len(), 5, "n{owner} owns some partitions");
    let mut written = Vec::new();
    for key in keys {
        let version = c
            .node(via)
            .cache()
            .put("fill", &key, b"before".to_vec(), PutOptions::default())
            .await
            .unwrap();
        written.push((key, version));
    }
    written
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handoff_drops_the_partitions_entries() {
    let c = Cluster::start(3, &[]).await;
    c.stabilize().await;
    let written = fill(&c, 0, 1).await;
    assert!(c.node(0).cache().stats().entries >= written.len() as u64);

    let leave = c.node(0).leave(Duration::from_secs(30));
    let clock = async {
        for _ in 0..100 {
            c.clock.advance(Duration::from_millis(100));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let (left, ()) = tokio::join!(leave, clock);
    left.expect("n0 leaves");
    let stats = c.node(0).cache().stats();
    assert_eq!(
        stats.entries, 0,
        "n0 keeps nothing it handed off: {stats:?}"
    );
    assert!(stats.ownership_drops >= written.len() as u64, "{stats:?}");
    for (key, version) in &written {
        for i in [1, 2] {
            assert_eq!(
                c.node(i).cache().get("fill", key).await.unwrap(),
                None,
                "{key} via n{i}"
            );
        }
        // A compare-and-set against the old owner's version cannot succeed.
        assert_eq!(
            c.node(1)
                .cache()
                .put("fill", key, b"after".to_vec(), cas(*version))
                .await,
            Err(Error::VersionConflict { current: None })
        );
        let fresh = c
            .node(2)
            .cache()
            .put("fill", key, b"after".to_vec(), PutOptions::default())
            .await
            .unwrap();
        assert!(
            fresh > *version,
            "versions rise across owners: {fresh} > {version}"
        );
    }
    c.check();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fenced_node_serves_no_stale_entry_and_the_takeover_starts_empty() {
    let c = Cluster::start(3, &[]).await;
    c.stabilize().await;
    let written = fill(&c, 0, 2).await;
    let key = written[0].0.clone();
    let expiry = c.arbiter_expiry(0);
    c.set_arbiter_reachable(0, false);
    c.advance_to(expiry - Duration::from_secs(1)).await;

    // Fenced: n0 answers nothing from its cache, and dropped it all.
    assert_eq!(
        c.node(0).cache().get("fill", &key).await,
        Err(Error::Fenced)
    );
    assert_eq!(c.node(0).cache().stats().entries, 0);
    // Until the arbiter's expiry nobody serves the key.
    assert!(c.node(1).cache().get("fill", &key).await.is_err());

    c.advance_to(expiry + Duration::from_secs(1)).await;
    eventually(
        Duration::from_secs(10),
        "n1 and n2 own every partition",
        || {
            c.node(1).status().partitions_owned + c.node(2).status().partitions_owned
                == crate::cluster::PARTITIONS as usize
        },
    )
    .await;
    // The takeover starts empty: no value from before the fence survives.
    for (key, version) in &written {
        let cache = c.node(1).cache();
        let got = loop_until_ok(|| cache.get("fill", key)).await;
        assert_eq!(got, None, "{key}");
        assert_eq!(
            c.node(2)
                .cache()
                .put("fill", key, b"x".to_vec(), cas(*version))
                .await,
            Err(Error::VersionConflict { current: None })
        );
    }
    c.check();
}

/// Retry `op` until it succeeds (bounded): routing settles after a takeover.
async fn loop_until_ok<T, F, Fut>(mut op: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match op().await {
            Ok(value) => return value,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("still failing after 10 s: {e}"),
        }
    }
}
