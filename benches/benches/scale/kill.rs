//! The `kill` section of the scale bench (the module header of `scale.rs`
//! says what it measures): kill → the spinning guest's store is dropped,
//! Fief beside raw wasmtime.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fief::{Instance, NodeConfig};

use crate::common::{Raw, SPIN_WASM, fmt_duration, guest, quantile};
use crate::{Ends, Mode, Report, Row, runtime, spin_options, us};

/// Start `spin` on `key` through `node` and give it time to be spinning.
/// The returned task ends when the spinning call returns (with the kill),
/// with the time it did.
async fn start_spinning(node: &Arc<Instance>, key: &str) -> tokio::task::JoinHandle<Instant> {
    let (node, key) = (node.clone(), key.to_owned());
    let call = tokio::spawn(async move {
        let reply = node.call("spin", &key, b"spin".to_vec()).await;
        assert!(reply.is_err(), "a spinning call returned");
        Instant::now()
    });
    // Activation takes tens of µs; 3 ms is several epoch ticks of spinning.
    tokio::time::sleep(Duration::from_millis(3)).await;
    call
}

pub(crate) fn kill(report: &mut Report, mode: Mode) {
    let samples = mode.pick(1000, 200, 5);
    let rt = runtime();
    let ends = Arc::new(Ends::default());
    let mut config = NodeConfig {
        max_live_keys: 256,
        // The spinning keys' CPU limit (spin_options) is over the default
        // ceiling on purpose: only the kill stops them.
        module_ceilings: fief::ModuleCeilings {
            cpu_limit: Duration::from_secs(600),
            ..fief::ModuleCeilings::default()
        },
        ..NodeConfig::default()
    };
    if let Some(ms) = std::env::var("FIEF_SCALE_EPOCH_TICK_MS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        config.epoch_tick = Duration::from_millis(ms);
        config.kill_bound = config.epoch_tick * 2;
    }
    let spin = guest(SPIN_WASM);
    let node = Arc::new(rt.block_on(async {
        let node = Instance::builder(config.clone())
            .observer(ends.observer("k"))
            .module("spin", spin.clone(), spin_options())
            .start()
            .await
            .expect("starting the node");
        node.call("spin", "warm-up", b"ping".to_vec())
            .await
            .expect("the node serves");
        node
    }));
    // Raw: the same guest spinning in a task; the killer sets the store's
    // kill flag and bumps the epoch; until the call returned and the store
    // is dropped. Sample i of Fief and of raw run back to back, so a burst
    // of load on the machine lands on both sides alike.
    let raw = Arc::new(Raw::new(&config, &spin));
    // Diagnostic: give the baseline Fief's 1 ms epoch ticker too.
    let ticking = Arc::new(AtomicBool::new(
        std::env::var_os("FIEF_SCALE_RAW_TICKER").is_some(),
    ));
    let ticker = {
        let (engine, ticking) = (raw.engine().clone(), ticking.clone());
        std::thread::spawn(move || {
            while ticking.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(1));
                engine.increment_epoch();
            }
        })
    };
    let mut fief = Vec::new();
    let mut fief_answered = Vec::new();
    let mut raw_samples = Vec::new();
    for i in 0..samples {
        let key = format!("k{i}");
        let latency = rt.block_on(rt.spawn({
            let (node, ends) = (node.clone(), ends.clone());
            async move {
                let call = start_spinning(&node, &key).await;
                let t0 = Instant::now();
                assert!(node.kill_key("spin", &key), "{key} was not live");
                let ended = ends.wait_for(&key, Duration::from_secs(10)).await;
                let answered = call.await.expect("the spinning call");
                (
                    ended.saturating_duration_since(t0),
                    answered.saturating_duration_since(t0),
                )
            }
        }));
        let (ended, answered) = latency.expect("kill sample");
        fief.push(ended);
        fief_answered.push(answered);
        let latency = rt.block_on(rt.spawn({
            let raw = raw.clone();
            async move {
                let flag = Arc::new(AtomicBool::new(false));
                let mut key = raw.start_killable("k", Some(flag.clone())).await;
                let (tx, rx) = tokio::sync::oneshot::channel();
                tokio::spawn(async move {
                    let result = key.try_call(b"spin").await;
                    assert!(result.is_err(), "a spinning call returned");
                    drop(key);
                    let _ = tx.send(Instant::now());
                });
                tokio::time::sleep(Duration::from_millis(3)).await;
                let t0 = Instant::now();
                flag.store(true, Ordering::SeqCst);
                raw.engine().increment_epoch();
                rx.await
                    .expect("the spinning task")
                    .saturating_duration_since(t0)
            }
        }));
        raw_samples.push(latency.expect("raw kill sample"));
    }
    ticking.store(false, Ordering::Relaxed);
    let _ = ticker.join();
    let (f50, f99, fmax) = (
        quantile(&mut fief, 0.5),
        quantile(&mut fief, 0.99),
        quantile(&mut fief, 1.0),
    );
    let (r50, r99, rmax) = (
        quantile(&mut raw_samples, 0.5),
        quantile(&mut raw_samples, 0.99),
        quantile(&mut raw_samples, 1.0),
    );
    report.add(
        Row::new(
            format!("kill → spinning guest's store dropped, p50 ({samples} kills)"),
            fmt_duration(f50),
        )
        .raw(fmt_duration(r50), us(f50) / us(r50)),
    );
    report.add(
        Row::new("kill → store dropped, p99", fmt_duration(f99))
            .raw(fmt_duration(r99), us(f99) / us(r99))
            .target("p99 ≤ 100 µs", f99 <= Duration::from_micros(100)),
    );
    report.add(
        Row::new("kill → store dropped, max", fmt_duration(fmax))
            .raw(fmt_duration(rmax), us(fmax) / us(rmax)),
    );
    report.add(Row::new(
        "kill → the spinning call's caller gets its error, p50 / p99",
        format!(
            "{} / {}",
            fmt_duration(quantile(&mut fief_answered, 0.5)),
            fmt_duration(quantile(&mut fief_answered, 0.99))
        ),
    ));
    let Ok(node) = Arc::try_unwrap(node) else {
        return;
    };
    rt.block_on(node.shutdown());
}
