//! Criterion benchmarks of the coherent cache (`docs/cache.md`): `get` and
//! `put` latency and throughput, local and routed.
//!
//! - `cache_local`: operations on an embedded node, which owns every
//!   partition: `get` of a present entry and `put` (overwrite) of a 64-byte
//!   value, one at a time (latency), and 32 tasks issuing `get`s at once over
//!   256 keys (throughput).
//! - `cache_routed`: the same through node `n0` of a two-node cluster, on
//!   keys that `n1` owns, so every operation crosses the TCP transport and
//!   back.
//!
//! Run with `cargo bench -p fief-benches --bench cache` (add `-- --quick`
//! for a smoke run); figures are in `docs/benchmarks.md`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Cluster, embedded_node};
use criterion::{Criterion, Throughput};
use fief::cache::PutOptions;
use fief::{Cache, NodeConfig};
use tokio::runtime::Runtime;

/// The cache namespace every bench uses.
const NS: &str = "bench";
/// Keys the throughput benches spread over.
const KEYS: usize = 256;
/// Concurrent tasks in the throughput benches.
const TASKS: usize = 32;
/// The value written.
const VALUE: [u8; 64] = [7; 64];

fn config(i: usize) -> NodeConfig {
    NodeConfig {
        node_id: format!("n{i}"),
        max_live_keys: 64,
        ..NodeConfig::default()
    }
}

/// Fill `keys` through `cache`.
async fn fill(cache: &Cache, keys: &[String]) {
    for key in keys {
        cache
            .put(NS, key, VALUE.to_vec(), PutOptions::default())
            .await
            .expect("filling the cache");
    }
}

/// `count` keys whose entries `owner` holds, found by writing through `via`.
async fn keys_held_by(via: &Cache, owner: &Cache, count: usize) -> Vec<String> {
    let mut found = Vec::new();
    for i in 0.. {
        if found.len() == count {
            break;
        }
        let key = format!("k{i}");
        let before = owner.stats().entries;
        fill(via, std::slice::from_ref(&key)).await;
        if owner.stats().entries > before {
            found.push(key);
        }
    }
    found
}

/// Benches of one cache handle: latency of a get and a put, and get
/// throughput from [`TASKS`] tasks over `keys`.
fn bench_cache(c: &mut Criterion, rt: &Runtime, group: &str, cache: Cache, keys: Vec<String>) {
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Elements(1));
    let key = keys[0].clone();
    g.bench_function("get", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    cache.get(NS, &key).await.expect("get").expect("a hit");
                }
                start.elapsed()
            })
        })
    });
    g.bench_function("put", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    cache
                        .put(NS, &key, VALUE.to_vec(), PutOptions::default())
                        .await
                        .expect("put");
                }
                start.elapsed()
            })
        })
    });
    let keys = Arc::new(keys);
    g.bench_function(format!("get_{TASKS}_tasks"), |b| {
        b.iter_custom(|iters| {
            let (cache, keys) = (cache.clone(), keys.clone());
            rt.block_on(async move {
                let start = Instant::now();
                let tasks: Vec<_> = (0..TASKS)
                    .map(|t| {
                        let (cache, keys) = (cache.clone(), keys.clone());
                        tokio::spawn(async move {
                            for n in 0..common::share(iters, TASKS, t) {
                                let key = &keys[(n as usize + t) % keys.len()];
                                cache.get(NS, key).await.expect("get");
                            }
                        })
                    })
                    .collect();
                for task in tasks {
                    task.await.expect("a bench task");
                }
                start.elapsed()
            })
        })
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");

    let node = rt.block_on(embedded_node(config(0), &[]));
    let keys: Vec<String> = (0..KEYS).map(|i| format!("k{i}")).collect();
    rt.block_on(fill(&node.cache(), &keys));
    bench_cache(c, &rt, "cache_local", node.cache(), keys);
    rt.block_on(node.shutdown());

    let cluster = rt.block_on(Cluster::start(2, config, &[]));
    let (via, owner) = (cluster.node(0).cache(), cluster.node(1).cache());
    let keys = rt.block_on(keys_held_by(&via, &owner, KEYS));
    bench_cache(c, &rt, "cache_routed", via, keys);
    rt.block_on(async {
        drop(cluster);
        // Let the nodes' tasks wind down before the runtime goes.
        tokio::time::sleep(Duration::from_millis(50)).await;
    });
}

// What `criterion_group!` + `criterion_main!` expand to, written out so that
// the entry point is not an undocumented `pub fn`.
fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    benches(&mut criterion);
    criterion.final_summary();
}
