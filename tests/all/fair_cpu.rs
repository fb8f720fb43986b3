//! Guest CPU shared fairly, and short calls kept short (issue 17 item 1;
//! issue 16 finding 9; design.md "Guest CPU: threads, fair share, budgets").
//!
//! - Over real HTTP, a victim key answers while keys of another module spin:
//!   guest code runs on the guest threads, never on the API's workers.
//! - Turns go fairly between tenants: a tenant with one spinning key gets
//!   about as much of the guest threads as a tenant with four; a tenant of
//!   weight 3 about three times as much as one of weight 1.
//! - A key whose timer re-arms at 0 ms is held to its `cpu_budget`, and is
//!   throttled, not killed, while another key's calls keep answering.
//! - A tenant's keys together are held to the node's `cpu_budget_per_tenant`,
//!   and another tenant is not throttled for it.
//! - A tenant whose short calls take more than its share of the callers'
//!   workers is served on the guest threads; another tenant's calls still
//!   run inline, and a tenant alone is never held back.
//!
//! Bounds are generous (a loaded 2-core machine holds them); no speed is
//! asserted.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fief::{Instance, ModuleOptions, NodeConfig};
use fief_tests::{HttpServer, call_text, guests, node_with_options, test_config};

/// The longest any victim call may take, attacked or not: a generous bound
/// (a victim starved behind guest code waits for seconds).
const VICTIM_BOUND: Duration = Duration::from_secs(1);

/// The tests here either measure shares of the machine's CPU or burn most
/// of it (`a_tenant_over_its_share_...` keeps both workers of its runtime
/// busy): run beside each other on a loaded 2-core machine, one's load
/// starved another's guest threads (a tenant budget never reached, a 1 ms
/// ticker a third as fast). They take this lock, so they run one at a time
/// (the rest of the suite still runs beside them).
static CPU_TESTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Wait for the other CPU tests of this file to finish (see [`CPU_TESTS`]).
pub(crate) async fn one_cpu_test_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    CPU_TESTS.lock().await
}

/// Options for spinning keys: they loop in `handle-cast` until `cpu_limit`.
fn spinner_options(cpu_limit: Duration) -> ModuleOptions {
    ModuleOptions {
        cpu_limit,
        ..ModuleOptions::default()
    }
}

/// Keep `keys` of `module` spinning: cast them `loop` again every 100 ms
/// (a cast that finds the mailbox full is dropped; the key is busy anyway).
fn keep_spinning(
    node: &Arc<Instance>,
    module: &str,
    keys: &[String],
) -> tokio::task::JoinHandle<()> {
    let (node, module, keys) = (node.clone(), module.to_owned(), keys.to_vec());
    tokio::spawn(async move {
        loop {
            for key in &keys {
                let _ = node.cast(&module, key, b"loop".to_vec());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Issue 17 item 1: the API never waits behind guest code. Four keys of
/// another module spin (the epoch tick is 100 ms, so each of their slices
/// holds a thread that long, and four guest threads give each spinner a
/// turn); the victim's calls over the node's HTTP API (a real socket) each
/// answer within a second. With guest code on the API's two workers they
/// waited seconds: each worker always has a spinner to run and polls its
/// sockets only every 61 task polls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_victim_answers_over_http_while_four_keys_of_another_module_spin() {
    let _alone = one_cpu_test_at_a_time().await;
    let config = NodeConfig {
        epoch_tick: Duration::from_millis(100),
        kill_bound: Duration::from_millis(250),
        guest_threads: 4,
        ..test_config()
    };
    let node = Arc::new(
        node_with_options(
            config,
            &[
                ("counter", guests::COUNTER, ModuleOptions::default()),
                (
                    "hostile",
                    guests::HOSTILE,
                    spinner_options(Duration::from_secs(2)),
                ),
            ],
        )
        .await,
    );
    let server = HttpServer::start(node.clone()).await;
    let client = reqwest::Client::new();
    let url = server.url("/v1/keys/counter/victim/call");
    let call = |client: &reqwest::Client| {
        let request = client.post(&url).body("incr").send();
        async move {
            let started = Instant::now();
            let response = tokio::time::timeout(Duration::from_secs(30), request)
                .await
                .expect("the victim answers at all")
                .expect("the request goes through");
            assert_eq!(response.status(), 200);
            started.elapsed()
        }
    };
    // Warm: the victim is live and idle.
    call(&client).await;
    let attackers = names("spinner", 4);
    let attack = keep_spinning(&node, "hostile", &attackers);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut took = Vec::new();
    for _ in 0..20 {
        took.push(call(&client).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    attack.abort();
    took.sort();
    eprintln!("victim calls over HTTP with four keys spinning, fastest to slowest: {took:?}");
    // With the API behind guest code every call waits; one call may be
    // slow on its own (in a run of the whole suite, one of twenty took
    // 1.2 s, the others milliseconds: likely a call that straddled an epoch
    // tick, was demoted to the guest threads, and waited there, at their
    // lower OS priority, beside the other tests' processes). The bound holds
    // for all but the slowest two.
    let p90 = took[took.len() * 9 / 10 - 1];
    assert!(
        p90 < VICTIM_BOUND,
        "victim calls took up to {p90:?} (all but the slowest two) while four keys spun \
         (bound {VICTIM_BOUND:?}): {took:?}"
    );
}

/// On one guest thread, keep `keys.0` keys of module `modules.0` and
/// `keys.1` of `modules.1` spinning (both modules deployed with no CPU
/// budget) and return the CPU seconds each module's keys used over two
/// seconds, after half a second for every key to start. Measured with the
/// node's per-module CPU counters.
async fn cpu_of_two_spinning_modules(
    config: NodeConfig,
    modules: (&str, &str),
    keys: (usize, usize),
) -> (f64, f64) {
    let config = NodeConfig {
        guest_threads: 1,
        ..config
    };
    let spin = spinner_options(Duration::from_secs(60));
    let node = Arc::new(
        node_with_options(
            config,
            &[
                (modules.0, guests::HOSTILE, spin.clone()),
                (modules.1, guests::HOSTILE, spin),
            ],
        )
        .await,
    );
    let first = keep_spinning(&node, modules.0, &names("a", keys.0));
    let second = keep_spinning(&node, modules.1, &names("b", keys.1));
    let cpu = |module: &str| {
        node.status()
            .modules
            .iter()
            .find(|m| m.name == module)
            .map_or(0.0, |m| m.cpu_seconds)
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (first_0, second_0) = (cpu(modules.0), cpu(modules.1));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let used = (cpu(modules.0) - first_0, cpu(modules.1) - second_0);
    first.abort();
    second.abort();
    used
}

/// Design.md "Guest CPU": turns go fairly between tenants. On one guest
/// thread, tenant `acme` keeps four keys spinning and tenant `globex` one;
/// `globex` gets about half the thread (a FIFO of yielding keys gives it a
/// fifth). Measured as a share, so load on the machine affects both
/// tenants alike.
#[tokio::test]
async fn a_tenant_with_one_spinning_key_gets_as_much_as_one_with_four() {
    let _alone = one_cpu_test_at_a_time().await;
    let (acme, globex) =
        cpu_of_two_spinning_modules(test_config(), ("acme/spin", "globex/spin"), (4, 1)).await;
    let share = globex / (acme + globex);
    eprintln!("CPU over 2 s: globex (one key) {globex:.3} s, acme (four keys) {acme:.3} s");
    assert!(
        acme + globex > 0.1,
        "the spinners hardly ran ({acme:.3} s, {globex:.3} s)"
    );
    assert!(
        share > 0.35,
        "globex's one key got {:.0} % of the guest thread against acme's four keys \
         ({globex:.3} s vs {acme:.3} s); a fair share is 50 %, a FIFO gives 20 %",
        share * 100.0
    );
}

/// Issue 17 item 1, weighted shares: on one guest thread, tenant `gold`
/// (weight 3 in `tenant_cpu_weights`) and tenant `bronze` (weight 1) each
/// keep one key spinning; `gold` gets about three quarters of the thread
/// (equal weights give half). Measured as a share, like the test above.
#[tokio::test]
async fn a_tenant_of_weight_three_gets_about_three_times_the_cpu_of_one_of_weight_one() {
    let _alone = one_cpu_test_at_a_time().await;
    let config = NodeConfig {
        tenant_cpu_weights: [("gold".to_owned(), 3)].into(),
        ..test_config()
    };
    let (gold, bronze) =
        cpu_of_two_spinning_modules(config, ("gold/spin", "bronze/spin"), (1, 1)).await;
    let share = gold / (gold + bronze);
    eprintln!("CPU over 2 s: gold (weight 3) {gold:.3} s, bronze (weight 1) {bronze:.3} s");
    assert!(
        gold + bronze > 0.1,
        "the spinners hardly ran ({gold:.3} s, {bronze:.3} s)"
    );
    assert!(
        share > 0.62,
        "gold (weight 3) got {:.0} % of the guest thread against bronze (weight 1) \
         ({gold:.3} s vs {bronze:.3} s); its weighted share is 75 %, an equal one 50 %",
        share * 100.0
    );
}

/// Issue 16 finding 9: a key whose timer re-arms at 0 ms runs short
/// callbacks forever, none near `cpu_limit` (about a thousand a second: the
/// timer wheel's millisecond; 0.03–0.07 s of CPU a second here). With
/// `cpu_budget = 5m` (a two-hundredth of a core over a one-second window) it
/// is throttled, not killed: over two seconds its CPU stays near 0.015 s
/// (the same key without a budget beside it in the same run is printed for
/// comparison); the throttled time
/// shows in `status` (and `fief_key_throttled_seconds_total`); and another
/// key's calls keep answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_whose_timer_rearms_at_zero_is_held_to_its_cpu_budget() {
    let _alone = one_cpu_test_at_a_time().await;
    let budgeted = ModuleOptions {
        cpu_budget: "5m".parse().expect("a share"),
        ..ModuleOptions::default()
    };
    let node = Arc::new(
        node_with_options(
            test_config(),
            &[
                ("counter", guests::COUNTER, ModuleOptions::default()),
                ("hostile", guests::HOSTILE, budgeted),
                ("unbudgeted", guests::HOSTILE, ModuleOptions::default()),
            ],
        )
        .await,
    );
    for module in ["hostile", "unbudgeted"] {
        assert_eq!(
            call_text(&node, module, "busy", "rearm-zero").await,
            "armed"
        );
    }
    let figures = |node: &Instance, name: &str| {
        let module = node
            .status()
            .modules
            .into_iter()
            .find(|m| m.name == name)
            .expect("deployed");
        (module.cpu_seconds, module.throttled_seconds)
    };
    let (used_0, throttled_0) = figures(&node, "hostile");
    let (free_0, _) = figures(&node, "unbudgeted");
    let begun = Instant::now();
    let mut slowest = Duration::ZERO;
    while begun.elapsed() < Duration::from_secs(2) {
        let call = Instant::now();
        call_text(&node, "counter", "victim", "incr").await;
        slowest = slowest.max(call.elapsed());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (used_1, throttled_1) = figures(&node, "hostile");
    let (free_1, _) = figures(&node, "unbudgeted");
    let (used, throttled, free) = (used_1 - used_0, throttled_1 - throttled_0, free_1 - free_0);
    eprintln!(
        "over 2 s: under 5m CPU {used:.3} s (throttled {throttled:.3} s), without a budget \
         {free:.3} s; slowest victim call {slowest:?}"
    );
    // The bound is what the budget allows (0.01 s earned, 0.005 s of burst)
    // plus slack for long polls; the key wanted more: it was throttled
    // (without the budget it never is). With 20m the key hardly wanted more
    // than its budget, and with CPU-time metering (`cpu_budget.rs`) it was
    // throttled 0–0.2 s.
    assert!(
        used < 0.05,
        "the key used {used:.3} s of CPU in 2 s under a 5m budget (about 0.015 s allowed), \
         the same key without a budget {free:.3} s"
    );
    assert!(
        throttled > 0.5,
        "the key was throttled only {throttled:.3} s in 2 s"
    );
    // Throttled, not killed: it still counts its timers and answers.
    let fired: u64 = call_text(&node, "hostile", "busy", "fired")
        .await
        .parse()
        .expect("a count");
    assert!(fired > 0, "its timer never fired");
    assert!(
        slowest < VICTIM_BOUND,
        "a victim call took {slowest:?} beside the throttled key"
    );
    let server = HttpServer::start(node.clone()).await;
    let metrics = reqwest::get(server.url("/metrics"))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("the metrics text");
    assert!(
        metrics.contains("fief_key_throttled_seconds_total{module=\"hostile\"}"),
        "no throttled-seconds series in the metrics"
    );
}

/// Issue 16 finding 9, per tenant: four keys of tenant `acme` spin (each
/// `loop` cast runs until a 60 s `cpu_limit`), none with a budget of its
/// own, on a node whose `cpu_budget_per_tenant` is 50m (a twentieth of a
/// core over one second). Over two seconds the tenant's keys together use
/// about what the budget allows (0.1 s earned, 0.05 s of burst, plus a tick
/// per key each time the credit runs out), against the guest threads' whole
/// capacity without it (two threads: 4 s of the 2 s); they wait, throttled,
/// for most of those two seconds each (without the tenant budget they are
/// never throttled); and tenant `globex` on the same node is never throttled
/// for `acme`, and its calls answer.
///
/// The bounds hold on a loaded machine. Keys under a budget are metered in
/// their thread's CPU time (`cpu_budget.rs`), so the OS preempting a guest
/// thread is charged to nobody: with wall-clock metering, on a 2-core
/// machine under `stress-ng --cpu 3`, globex's own 50m budget ran out for
/// calls preempted mid-poll and globex was throttled 1.5 s in 2 s (its
/// slowest call 0.8 s; most likely how it failed in CI, whose log cut the
/// message). `used` is held under 1 s,
/// a quarter of what the keys use without the budget, and `throttled` over
/// 3 s of the 8 s the four keys spent (the count lags a wait by at most
/// 50 ms per key, `CpuMeter::sit_out`; it used to lag by the whole wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_keys_together_are_held_to_the_cpu_budget_per_tenant() {
    let _alone = one_cpu_test_at_a_time().await;
    let config = NodeConfig {
        cpu_budget_per_tenant: Some("50m".parse().expect("cores")),
        ..test_config()
    };
    let node = Arc::new(
        node_with_options(
            config,
            &[
                (
                    "acme/spin",
                    guests::HOSTILE,
                    spinner_options(Duration::from_secs(60)),
                ),
                ("globex/counter", guests::COUNTER, ModuleOptions::default()),
            ],
        )
        .await,
    );
    let spinning = keep_spinning(&node, "acme/spin", &names("a", 4));
    let tenant = |name: &str| {
        node.status()
            .tenant_cpu
            .into_iter()
            .find(|t| t.tenant == name)
            .map_or((0.0, 0.0), |t| (t.cpu_seconds, t.throttled_seconds))
    };
    // Let the keys start and spend the burst, then measure over 2 s.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (used_0, throttled_0) = tenant("acme");
    let begun = Instant::now();
    let mut slowest = Duration::ZERO;
    while begun.elapsed() < Duration::from_secs(2) {
        let call = Instant::now();
        call_text(&node, "globex/counter", "victim", "incr").await;
        slowest = slowest.max(call.elapsed());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (used_1, throttled_1) = tenant("acme");
    spinning.abort();
    let (used, throttled) = (used_1 - used_0, throttled_1 - throttled_0);
    let (_, globex_throttled) = tenant("globex");
    eprintln!(
        "over 2 s: acme's four spinning keys under a 50m tenant budget used {used:.3} s of CPU, \
         throttled {throttled:.3} s; slowest globex call {slowest:?}"
    );
    assert!(
        used < 1.0,
        "acme's keys used {used:.3} s of CPU in 2 s under a 50m tenant budget (about 0.1 s \
         allowed)"
    );
    assert!(
        throttled > 3.0,
        "acme's four keys were throttled only {throttled:.3} s in 2 s together"
    );
    assert_eq!(globex_throttled, 0.0, "globex was throttled for acme");
    assert!(
        slowest < VICTIM_BOUND,
        "a globex call took {slowest:?} beside acme's throttled keys"
    );
}

/// Design.md "Guest CPU": callers looping over short inline calls yield
/// their workers. Each warm call to an idle key runs on its caller's task
/// and may finish without ever returning `Pending`; four tasks looping over
/// such calls on a two-worker runtime (an embedding program's, or a node's
/// API workers under a flood) would starve the other tasks there: measured
/// 182 ms at p99 for an HTTP call on the same node. With a yield after every
/// 100 µs of inline time, a 1 ms ticker task beside the loops keeps ticking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_looping_over_inline_calls_let_their_workers_serve_others() {
    let _alone = one_cpu_test_at_a_time().await;
    let node = Arc::new(
        node_with_options(
            test_config(),
            &[("counter", guests::COUNTER, ModuleOptions::default())],
        )
        .await,
    );
    let keys = names("hot", 4);
    for key in &keys {
        call_text(&node, "counter", key, "incr").await;
    }
    let ticks = Arc::new(AtomicU64::new(0));
    let ticker = {
        let ticks = ticks.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(1)).await;
                ticks.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    // The ticker alone for 300 ms: how often it ticks on this machine now.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let alone_0 = ticks.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = ticks.load(Ordering::Relaxed);
    let alone = before - alone_0;
    let loops: Vec<_> = keys
        .iter()
        .map(|key| {
            let (node, key) = (node.clone(), key.clone());
            tokio::spawn(async move {
                let begun = Instant::now();
                let mut calls = 0u64;
                while begun.elapsed() < Duration::from_millis(300) {
                    node.call("counter", &key, b"incr".to_vec())
                        .await
                        .expect("the call answers");
                    calls += 1;
                }
                calls
            })
        })
        .collect();
    let mut calls = 0;
    for l in loops {
        calls += l.await.expect("a caller");
    }
    let ticked = ticks.load(Ordering::Relaxed) - before;
    ticker.abort();
    eprintln!(
        "{calls} calls in 300 ms from 4 tasks; the 1 ms ticker beside them ticked {ticked} \
         times, {alone} times alone"
    );
    // Measured: about as often as alone with the yields (150 of 143, 147 of
    // 144), a seventh or less without them, and a third (48 of 145) when the
    // call path polled a yielded call again in the same turn (a timer made
    // after its first `Pending`), which the first bound here, a half, let
    // pass once.
    assert!(
        ticked * 3 >= alone * 2,
        "the ticker ticked {ticked} times while four tasks made {calls} inline calls for \
         300 ms, {alone} times in 300 ms alone"
    );
}

/// Inline calls counted for `module` so far.
async fn inline_calls(node: &Instance, module: &str) -> u64 {
    let series = format!("fief_calls_inline_total{{module=\"{module}\"}}");
    fief_tests::metric_value(&node.metrics_text().await, &series).unwrap_or(0.0) as u64
}

/// What `calls` and `module`'s inline counter moved over `period`.
async fn calls_and_inline_over(
    node: &Instance,
    module: &str,
    calls: &AtomicU64,
    period: Duration,
) -> (u64, u64) {
    let (calls_0, inline_0) = (
        calls.load(Ordering::Relaxed),
        inline_calls(node, module).await,
    );
    tokio::time::sleep(period).await;
    let (calls_1, inline_1) = (
        calls.load(Ordering::Relaxed),
        inline_calls(node, module).await,
    );
    (calls_1 - calls_0, inline_1 - inline_0)
}

/// Start two keys of `module` (the `spin` guest: two, enough to keep both
/// workers busy, and no more CPU taken from the tests beside), each called with `burn`
/// in a loop by a task of its own (counting into `burns`, until `stop`),
/// and measure them alone for 0.3 s: the tasks, the calls and the inline
/// calls.
async fn burn_alone(
    node: &Arc<Instance>,
    module: &'static str,
    burn: &'static [u8],
    stop: &Arc<AtomicBool>,
    burns: &Arc<AtomicU64>,
) -> (Vec<tokio::task::JoinHandle<()>>, u64, u64) {
    let burners = names("burner", 2);
    for key in &burners {
        node.call(module, key, b"ping".to_vec())
            .await
            .expect("a burner starts");
    }
    let tasks = burners
        .iter()
        .map(|key| keep_calling(node, (module, key, burn), None, stop, burns))
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (alone, alone_inline) =
        calls_and_inline_over(node, module, burns, Duration::from_millis(300)).await;
    (tasks, alone, alone_inline)
}

/// Call `message` to `key` of `module` until `stop`, every `pause`,
/// counting the calls answered in `calls`.
fn keep_calling(
    node: &Arc<Instance>,
    (module, key, message): (&str, &str, &'static [u8]),
    pause: Option<Duration>,
    stop: &Arc<AtomicBool>,
    calls: &Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    let (node, module, key) = (node.clone(), module.to_owned(), key.to_owned());
    let (stop, calls) = (stop.clone(), calls.clone());
    tokio::spawn(async move {
        while !stop.load(Ordering::Relaxed) {
            node.call(&module, &key, message.to_vec())
                .await
                .expect("the call answers");
            calls.fetch_add(1, Ordering::Relaxed);
            if let Some(pause) = pause {
                tokio::time::sleep(pause).await;
            }
        }
    })
}

/// Issue 17 item 1, design.md "Guest CPU": the callers' workers are shared
/// fairly between tenants. Two tasks of tenant `mallory` loop over calls
/// that each burn well under a tick of CPU (so none is demoted) on a
/// two-worker runtime. Alone, every one of them runs inline: one tenant is
/// never held back. Beside another tenant's calls (a victim calling every
/// millisecond), `mallory` uses more than its half of the two workers, and
/// its calls go through its keys' mailboxes to the guest threads (and its
/// new keys start on their own tasks there), while the victim's still run
/// inline. Without the shares, all of `mallory`'s calls
/// ran inline in both phases. Counted, not timed: the workers' busy time and
/// the keys' CPU are measured in wall time, so a loaded machine shows
/// `mallory`'s two callers using about both workers all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_share_of_the_callers_workers_is_served_on_the_guest_threads() {
    let _alone = one_cpu_test_at_a_time().await;
    const BURNER: &str = "mallory/spin";
    // Keys of `mallory` started by a call while it is over its share.
    const FRESH: &str = "mallory/fresh";
    // A call demoted at an epoch tick waits for the guest threads instead
    // of running on its caller: with long ticks, a burn is almost never
    // demoted, even when the loaded machine stretches it to milliseconds.
    let config = NodeConfig {
        epoch_tick: Duration::from_millis(50),
        kill_bound: Duration::from_millis(150),
        ..test_config()
    };
    let node = Arc::new(
        node_with_options(
            config,
            &[
                (BURNER, guests::SPIN, ModuleOptions::default()),
                (FRESH, guests::SPIN, ModuleOptions::default()),
                ("counter", guests::COUNTER, ModuleOptions::default()),
            ],
        )
        .await,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let (burns, victim_calls) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let measure = async |module: &str, calls: &AtomicU64, period: Duration| {
        calls_and_inline_over(&node, module, calls, period).await
    };

    // Alone: inline.
    let (mut tasks, alone, alone_inline) =
        burn_alone(&node, BURNER, b"burn 200000", &stop, &burns).await;

    // Beside a victim of another tenant.
    call_text(&node, "counter", "victim", "incr").await;
    let pause = Some(Duration::from_millis(1));
    let victim = ("counter", "victim", &b"incr"[..]);
    tasks.push(keep_calling(&node, victim, pause, &stop, &victim_calls));
    // And new keys of `mallory`, one every 20 ms: each call activates one.
    let fresh_calls = Arc::new(AtomicU64::new(0));
    tasks.push({
        let (node, stop, fresh_calls) = (node.clone(), stop.clone(), fresh_calls.clone());
        tokio::spawn(async move {
            for i in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                node.call(FRESH, &format!("fresh-{i}"), b"ping".to_vec())
                    .await
                    .expect("a fresh key starts");
                fresh_calls.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ((shared, shared_inline), (victim, victim_inline), (fresh, fresh_inline)) = tokio::join!(
        measure(BURNER, &burns, Duration::from_millis(600)),
        measure("counter", &victim_calls, Duration::from_millis(600)),
        measure(FRESH, &fresh_calls, Duration::from_millis(600)),
    );
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("a caller");
    }
    eprintln!(
        "alone: {alone_inline} of {alone} mallory calls inline; beside the victim: \
         {shared_inline} of {shared}, {fresh_inline} of {fresh} activations, and \
         {victim_inline} of {victim} victim calls"
    );
    assert!(alone > 0 && shared > 0 && victim > 0 && fresh > 0);
    assert!(
        alone_inline * 10 >= alone * 9,
        "alone, mallory's calls ran inline only {alone_inline} times of {alone}"
    );
    assert!(
        shared_inline * 2 <= shared,
        "beside another tenant, mallory's calls still ran inline {shared_inline} times of \
         {shared}"
    );
    assert!(
        fresh_inline * 2 <= fresh,
        "beside another tenant, mallory's new keys still started on their callers' tasks \
         {fresh_inline} times of {fresh}"
    );
    assert!(
        victim_inline * 10 >= victim * 9,
        "the victim's calls ran inline only {victim_inline} times of {victim}"
    );
}

/// Issue 17, the memory bombs: a tenant whose inline calls are demoted
/// (each held its caller's worker until its first epoch tick before moving
/// to the guest threads) is served on the guest threads while another
/// tenant is active, however idle the workers are otherwise. Two tasks of
/// tenant `mallory` loop over calls that each burn about 3 ms (three ticks
/// of the default 1 ms). Alone, every one of them starts inline. Beside a
/// victim calling every millisecond, they go through the keys' mailboxes,
/// and the victim's calls still run inline (a short call straddling a tick
/// is demoted too, after microseconds: counted by time held, it marks no
/// one). Without the rule every one of `mallory`'s calls still started
/// inline (the workers, busy up to a tick per call, stay under the three
/// quarters that mark a tenant by load). Counted, not timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_whose_inline_calls_keep_being_demoted_is_served_on_the_guest_threads() {
    let _alone = one_cpu_test_at_a_time().await;
    const BURNER: &str = "mallory/spin";
    let node = Arc::new(
        node_with_options(
            test_config(),
            &[
                (BURNER, guests::SPIN, ModuleOptions::default()),
                ("counter", guests::COUNTER, ModuleOptions::default()),
            ],
        )
        .await,
    );
    let (stop, burns) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let victim_calls = Arc::new(AtomicU64::new(0));

    // Alone: every call starts inline.
    let (mut tasks, alone, alone_inline) =
        burn_alone(&node, BURNER, b"burn 3000000", &stop, &burns).await;

    // Beside a victim of another tenant.
    call_text(&node, "counter", "victim", "incr").await;
    let victim = ("counter", "victim", &b"incr"[..]);
    let pause = Some(Duration::from_millis(1));
    tasks.push(keep_calling(&node, victim, pause, &stop, &victim_calls));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let ((shared, shared_inline), (victim, victim_inline)) = tokio::join!(
        calls_and_inline_over(&node, BURNER, &burns, Duration::from_millis(600)),
        calls_and_inline_over(&node, "counter", &victim_calls, Duration::from_millis(600)),
    );
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("a caller");
    }
    eprintln!(
        "alone: {alone_inline} of {alone} mallory calls inline; beside the victim: \
         {shared_inline} of {shared}, and {victim_inline} of {victim} victim calls"
    );
    assert!(alone > 0 && shared > 0 && victim > 0);
    assert!(
        alone_inline * 10 >= alone * 9,
        "alone, mallory's calls started inline only {alone_inline} times of {alone}"
    );
    assert!(
        shared_inline * 2 <= shared,
        "beside another tenant, mallory's calls still started inline {shared_inline} times \
         of {shared}"
    );
    assert!(
        victim_inline * 10 >= victim * 9,
        "the victim's calls ran inline only {victim_inline} times of {victim}"
    );
}

/// `fief node --tenant-cpu-weight`: a weight past its bounds, or not a
/// number, stops the node at start with a message naming the flag's rule.
#[tokio::test]
async fn a_tenant_cpu_weight_past_its_bounds_stops_the_node_at_start() {
    for (flag, says) in [
        ("acme=0", "between 1 and 1000"),
        ("acme=1001", "between 1 and 1000"),
        ("acme=many", "whole number"),
        ("acme", "TENANT=WEIGHT"),
    ] {
        let out = tokio::task::spawn_blocking(move || {
            fief_tests::fief_cli(&[
                "node",
                "--listen",
                "127.0.0.1:0",
                "--tenant-cpu-weight",
                flag,
            ])
        })
        .await
        .expect("the CLI ran");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag}: the node started");
        assert!(stderr.contains(says), "{flag}: {stderr}");
    }
}

/// `fief node --guest-thread-policy`: a policy that is not `nice` or `idle`
/// stops the node at start with a message naming both.
#[tokio::test]
async fn a_guest_thread_policy_that_is_not_one_stops_the_node_at_start() {
    let out = tokio::task::spawn_blocking(|| {
        fief_tests::fief_cli(&[
            "node",
            "--listen",
            "127.0.0.1:0",
            "--guest-thread-policy",
            "realtime",
        ])
    })
    .await
    .expect("the CLI ran");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the node started");
    assert!(
        stderr.contains("\"realtime\" is not a guest thread policy") && stderr.contains("idle"),
        "{stderr}"
    );
}

/// `fief_calls_demoted_total` of `module`.
async fn demoted_calls(node: &Instance, module: &str) -> u64 {
    let series = format!("fief_calls_demoted_total{{module=\"{module}\"}}");
    fief_tests::metric_value(&node.metrics_text().await, &series).unwrap_or(0.0) as u64
}

/// A short call that straddles an epoch tick stays on its caller's task: at
/// the tick its poll has run less than half a tick, so it runs on to the
/// next one and finishes inline, instead of waiting for a guest thread
/// behind long callbacks; a call still running half a tick after its poll
/// began is demoted as before. With a 100 ms tick, a burn of about 20 ms
/// sees the epoch bumped about 5 ms in (`kill_key` of a key that is not
/// live bumps it). A try whose burn the machine stretched past half a tick
/// may be demoted; one try of five that saw the bump inside the call and
/// was not demoted passes. With every tick demoting (the rule removed),
/// every try that saw the bump was demoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_call_that_straddles_a_tick_stays_on_its_callers_task() {
    let _alone = one_cpu_test_at_a_time().await;
    let config = NodeConfig {
        epoch_tick: Duration::from_millis(100),
        kill_bound: Duration::from_millis(250),
        ..test_config()
    };
    let node = Arc::new(
        node_with_options(
            config,
            &[(
                "spin",
                guests::SPIN,
                spinner_options(Duration::from_secs(60)),
            )],
        )
        .await,
    );
    // A burn of about 20 ms on this machine, now.
    call_text(&node, "spin", "short", "ping").await;
    let probe = 2_000_000u64;
    let started = Instant::now();
    call_text(&node, "spin", "short", &format!("burn {probe}")).await;
    let per_turn = started.elapsed().as_secs_f64() / probe as f64;
    let turns = ((0.02 / per_turn) as u64).max(probe);

    let mut tries = Vec::new();
    for _ in 0..5 {
        let before = demoted_calls(&node, "spin").await;
        let bumper = {
            let node = node.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(5));
                // Not live: only the epoch moves.
                assert!(!node.kill_key("spin", "nobody"));
                Instant::now()
            })
        };
        let began = Instant::now();
        let reply = call_text(&node, "spin", "short", &format!("burn {turns}")).await;
        let ended = Instant::now();
        let bumped = bumper.join().expect("the bumper");
        assert_eq!(reply, "burnt");
        let demoted = demoted_calls(&node, "spin").await - before;
        let inside = began < bumped && bumped < ended;
        tries.push((inside, demoted, ended - began));
        if inside && demoted == 0 {
            break;
        }
    }
    eprintln!("tries (bump inside the call, demotions, call took): {tries:?}");
    assert!(
        tries
            .iter()
            .any(|(inside, demoted, _)| *inside && *demoted == 0),
        "no try kept a call that straddled a tick on its caller's task: {tries:?}"
    );

    // A call still running half a tick after its poll began is demoted.
    let before = demoted_calls(&node, "spin").await;
    let spinning = tokio::spawn({
        let node = node.clone();
        async move { node.call("spin", "long", b"spin".to_vec()).await }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while demoted_calls(&node, "spin").await == before {
        assert!(
            Instant::now() < deadline,
            "a spinning inline call was never demoted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(node.kill_key("spin", "long"));
    assert!(spinning.await.expect("the spinning call").is_err());
}
