//! The two-node sections of the scale bench (the module header of
//! `scale.rs` says what they measure): `cross_node`, calls from `n0` to a
//! key `n1` owns through the TCP transport, alone and under load; and
//! `failover`, an owner's crash and a graceful `leave`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fief::{ModuleOptions, NodeConfig};

use crate::common::{
    COUNTER_WASM, Cluster, Raw, RawTcpConn, drive, fmt_duration, guest, keys_owned_by, quantile,
    raw_keys, serve_raw_tcp,
};
use crate::{Mode, Report, Row, runtime, us};

/// Node `n<i>` of a two-node bench cluster.
fn cluster_config(i: usize) -> NodeConfig {
    NodeConfig {
        node_id: format!("n{i}"),
        partitions: 64,
        max_live_keys: 1024,
        ..NodeConfig::default()
    }
}

/// Concurrent callers in the loaded cross-node figure.
const CROSS_CALLERS: usize = 32;

pub(crate) fn cross_node(report: &mut Report, mode: Mode) {
    let calls = mode.pick(20_000u64, 4_000, 200);
    let loaded_calls = mode.pick(200_000u64, 40_000, 500);
    let rt = runtime();
    let counter = guest(COUNTER_WASM);
    let modules = [("counter", counter.as_slice(), ModuleOptions::default())];
    let cluster = Arc::new(rt.block_on(Cluster::start(2, cluster_config, &modules)));
    let keys = Arc::new(rt.block_on(keys_owned_by(
        cluster.node(0),
        cluster.node(1),
        "counter",
        "remote",
        64,
    )));
    let raw = Raw::new(&cluster_config(0), &counter);
    let raw_keys = rt.block_on(raw_keys(&raw, &keys));
    let raw_addr = rt.block_on(serve_raw_tcp(raw_keys));

    let fief_run = |callers: usize, total: u64| {
        let (cluster, keys) = (cluster.clone(), keys.clone());
        rt.block_on(rt.spawn(async move {
            drive(callers, total, move |i, n| {
                let (cluster, keys) = (cluster.clone(), keys.clone());
                async move {
                    let key = &keys[(i + n as usize * callers) % keys.len()];
                    let reply = cluster.node(0).call("counter", key, b"incr".to_vec()).await;
                    std::hint::black_box(reply.expect("cross-node call"));
                }
            })
            .await
        }))
        .expect("cross-node run")
    };
    let raw_run = |callers: usize, total: u64| {
        let keys = keys.clone();
        rt.block_on(rt.spawn(async move {
            let mut conns = Vec::new();
            for _ in 0..callers {
                conns.push(Arc::new(tokio::sync::Mutex::new(
                    RawTcpConn::open(raw_addr).await,
                )));
            }
            let conns = Arc::new(conns);
            drive(callers, total, move |i, n| {
                let (conns, keys) = (conns.clone(), keys.clone());
                async move {
                    let key = &keys[(i + n as usize * callers) % keys.len()];
                    let reply = conns[i].lock().await.call(key, b"incr").await;
                    std::hint::black_box(reply);
                }
            })
            .await
        }))
        .expect("raw TCP run")
    };

    // Warm up both paths (connections, caches).
    fief_run(4, 2000.min(calls));
    raw_run(4, 2000.min(calls));

    let (_, mut f1) = fief_run(1, calls);
    let (_, mut r1) = raw_run(1, calls);
    let (f50, r50) = (quantile(&mut f1, 0.5), quantile(&mut r1, 0.5));
    let (f99, r99) = (quantile(&mut f1, 0.99), quantile(&mut r1, 0.99));
    report.add(
        Row::new("cross-node call, one caller, p50", fmt_duration(f50))
            .raw(fmt_duration(r50) + " (raw TCP hop)", us(f50) / us(r50))
            .target("p50 ≤ 100 µs", f50 <= Duration::from_micros(100)),
    );
    report.add(
        Row::new("cross-node call, one caller, p99", fmt_duration(f99))
            .raw(fmt_duration(r99), us(f99) / us(r99)),
    );
    let (fe, mut fl) = fief_run(CROSS_CALLERS, loaded_calls);
    let (re, mut rl) = raw_run(CROSS_CALLERS, loaded_calls);
    let (frate, rrate) = (
        loaded_calls as f64 / fe.as_secs_f64(),
        loaded_calls as f64 / re.as_secs_f64(),
    );
    report.add(
        Row::new(
            format!("cross-node throughput, {CROSS_CALLERS} callers"),
            format!("{:.0} k calls/s", frate / 1e3),
        )
        .raw(format!("{:.0} k calls/s", rrate / 1e3), rrate / frate)
        .target("≥ 100 k calls/s", frate >= 100e3),
    );
    let (fl50, rl50) = (quantile(&mut fl, 0.5), quantile(&mut rl, 0.5));
    let (fl99, rl99) = (quantile(&mut fl, 0.99), quantile(&mut rl, 0.99));
    report.add(
        Row::new(
            "cross-node call under that load, p50 / p99",
            format!("{} / {}", fmt_duration(fl50), fmt_duration(fl99)),
        )
        .raw(
            format!("{} / {}", fmt_duration(rl50), fmt_duration(rl99)),
            us(fl50) / us(rl50),
        )
        .target("p50 ≤ 100 µs", fl50 <= Duration::from_micros(100)),
    );
    let Ok(cluster) = Arc::try_unwrap(cluster) else {
        return;
    };
    rt.block_on(async move {
        for node in cluster.nodes.into_iter().flatten() {
            node.shutdown().await;
        }
    });
}

// ---------------------------------------------------------------------------
// Failover
// ---------------------------------------------------------------------------

/// Lease timing of the failover clusters: the defaults (TTL 5 s, renewal
/// every 1 s, fence margin 1 s) in a full run; a short valid timing (TTL
/// 2 s, 400 ms, 500 ms) otherwise.
fn failover_config(mode: Mode) -> impl Fn(usize) -> NodeConfig {
    move |i| {
        let mut config = cluster_config(i);
        config.call_timeout = Duration::from_secs(2);
        if mode != Mode::Full {
            config.lease_ttl = Duration::from_secs(2);
            config.renew_interval = Duration::from_millis(400);
            config.fence_margin = Duration::from_millis(500);
        }
        config
    }
}

pub(crate) fn failover(report: &mut Report, mode: Mode) {
    let samples = mode.pick(3, 1, 1);
    let rt = runtime();
    let counter = guest(COUNTER_WASM);
    let ttl = failover_config(mode)(0).lease_ttl;
    let mut crash = Vec::new();
    let mut leave = Vec::new();
    let mut leave_call = Vec::new();
    for _ in 0..samples {
        // Crash: n1 owns the key and dies; n0 (the leader) takes over.
        let (took, left, first) = rt
            .block_on(rt.spawn({
                let counter = counter.clone();
                async move {
                    let modules = [("counter", counter.as_slice(), ModuleOptions::default())];
                    let mut cluster = Cluster::start(2, failover_config(mode), &modules).await;
                    let key = keys_owned_by(cluster.node(0), cluster.node(1), "counter", "f", 1)
                        .await
                        .remove(0);
                    let n1 = cluster.nodes[1].take().expect("n1");
                    let t0 = Instant::now();
                    // A crashed process takes its sockets with it; an
                    // in-process `crash` leaves n0's open connection to it
                    // served, so cut that link as the dead process would.
                    assert!(cluster.node(0).set_peer_link("n1", false).await);
                    n1.crash().await;
                    loop {
                        if cluster
                            .node(0)
                            .call("counter", &key, b"get".to_vec())
                            .await
                            .is_ok()
                        {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    let took = t0.elapsed();
                    for node in cluster.nodes.into_iter().flatten() {
                        node.shutdown().await;
                    }

                    // Leave: n1 owns the key (value 5) and leaves; the handoff is
                    // complete when `leave` returns; the first call on n0 then
                    // sees the value.
                    let mut cluster = Cluster::start(2, failover_config(mode), &modules).await;
                    let key = keys_owned_by(cluster.node(0), cluster.node(1), "counter", "l", 1)
                        .await
                        .remove(0);
                    for _ in 0..5 {
                        cluster
                            .node(0)
                            .call("counter", &key, b"incr".to_vec())
                            .await
                            .expect("incr");
                    }
                    let t0 = Instant::now();
                    cluster
                        .node(1)
                        .leave(Duration::from_secs(60))
                        .await
                        .expect("leaving");
                    let left = t0.elapsed();
                    let reply = cluster
                        .node(0)
                        .call("counter", &key, b"get".to_vec())
                        .await
                        .expect("the call after the handoff");
                    assert_eq!(reply, b"5", "the handoff carried the value");
                    let first = t0.elapsed();
                    let n1 = cluster.nodes[1].take().expect("n1");
                    n1.shutdown().await;
                    for node in cluster.nodes.into_iter().flatten() {
                        node.shutdown().await;
                    }
                    (took, left, first)
                }
            }))
            .expect("failover sample");
        crash.push(took);
        leave.push(left);
        leave_call.push(first);
    }
    let worst = *crash.iter().max().expect("a sample");
    report.add(
        Row::new(
            format!(
                "failover: owner crash → first successful call on the survivor (TTL {}, worst of {samples})",
                fmt_duration(ttl)
            ),
            fmt_duration(worst),
        )
        .target(
            format!("≤ TTL + 1 s = {}", fmt_duration(ttl + Duration::from_secs(1))),
            worst <= ttl + Duration::from_secs(1),
        ),
    );
    report.add(Row::new(
        format!("leave → handoff complete (`leave` returns), worst of {samples}"),
        fmt_duration(*leave.iter().max().expect("a sample")),
    ));
    report.add(Row::new(
        "leave → first call on the new owner answered with the handed-off state",
        fmt_duration(*leave_call.iter().max().expect("a sample")),
    ));
}
