//! Self-fencing on a stepped clock (`docs/fencing.md`; the fence-mode page,
//! "The fence itself. The mode changes what survives the fence, never
//! whether the fence happens or when"; contract §1 guarantee 3, §2 timing,
//! §5 rows 2 and 5).
//!
//! One node and a [`LocalArbiter`] read the same [`SteppedClock`], which
//! moves only when a test steps it, so the tests walk an exact timeline: the
//! node registers at 0, renews on whole seconds, and its fence point is
//! `last successful renewal send + lease_ttl - fence_margin`; the arbiter
//! expires the lease at `last commit + lease_ttl`. Real time only bounds the
//! polling.

use std::future::Future;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use fief::arbiter::{Arbiter, ArbiterFuture, LeaseId, LocalArbiter, Member, Term};
use fief::core::{Clock, NodeId, OnFence, OwnershipTable, PartitionCount, PartitionId};
use fief::{Error, Instance, KeyLifeEvent, LeaseState, ModuleOptions, NodeConfig, SteppedClock};
use fief_tests::{eventually, eventually_async, guests, is_live};
use tokio::sync::watch;

use crate::fence_modes::{Lives, PATIENCE, in_limbo, local, local_ok, mode, spin_options};

/// Partitions per namespace in these tests.
const PARTITIONS: u32 = 16;
/// The namespace.
const NAMESPACE: &str = "default";
/// One clock step.
const STEP: Duration = Duration::from_millis(100);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Node `n0` with the default lease timing (TTL 5 s, renewal every 1 s,
/// fence margin 1 s: fence point 4 s after a renewal is sent).
fn config() -> NodeConfig {
    NodeConfig {
        node_id: "n0".to_owned(),
        namespace: NAMESPACE.to_owned(),
        partitions: PARTITIONS,
        max_live_keys: 64,
        max_memory_per_key: fief::config::ByteSize::mib(64),
        call_timeout: Duration::from_secs(30),
        // The spinning keys here must outlast the fence, not their CPU limit.
        module_ceilings: fief_tests::test_config().module_ceilings,
        ..NodeConfig::default()
    }
}

fn n0() -> NodeId {
    NodeId::new("n0")
}

/// A fresh stepped clock and a local arbiter judging time on it.
fn clock_and_arbiter() -> (SteppedClock, LocalArbiter) {
    let clock = SteppedClock::default();
    let arbiter = LocalArbiter::new(
        Arc::new(clock.clone()),
        PartitionCount::new(PARTITIONS).unwrap(),
    );
    (clock, arbiter)
}

/// Start `config`'s node on `clock` with `arbiter`, recording key lives in
/// `lives`, with `modules` deployed before it joins.
async fn start(
    config: NodeConfig,
    clock: &SteppedClock,
    arbiter: Arc<dyn Arbiter>,
    lives: &Lives,
    modules: &[(&str, &str, ModuleOptions)],
) -> Instance {
    let mut builder = Instance::builder(config)
        .arbiter(arbiter)
        .clock(Arc::new(clock.clone()))
        .observer(lives.observer());
    for (name, path, options) in modules {
        builder = builder.module(name, guests::bytes(path), options.clone());
    }
    let node = builder.start().await.expect("the node starts");
    assert_eq!(node.status().lease, LeaseState::Current, "n0 joined");
    node
}

/// The clock's reading, in milliseconds since it started.
fn now_ms(clock: &SteppedClock) -> u64 {
    clock.now().since_origin().as_millis() as u64
}

/// Whether the arbiter counts `n0`'s lease as current, asked through the
/// [`Arbiter`] trait.
async fn arbiter_lists_n0(arbiter: &LocalArbiter) -> bool {
    let members: Vec<Member> = Arbiter::live_nodes(arbiter, NAMESPACE)
        .await
        .expect("the arbiter answers live_nodes");
    members.iter().any(|m| m.node == n0())
}

/// A routed call; the reply as text.
async fn routed(node: &Instance, module: &str, key: &str, message: &str) -> fief::Result<String> {
    node.call(module, key, message.as_bytes().to_vec())
        .await
        .map(|reply| String::from_utf8(reply).expect("a UTF-8 reply"))
}

/// Step the clock to `to_ms`, [`STEP`] at a time, letting the node react:
/// at each whole second (when a renewal is due) wait until the coordination
/// loop has made its renewal attempt, and, if `reachable`, until the renewal
/// succeeded (the fence point is then 4 s away). So renewals are sent exactly
/// on the second, and the loop never lags behind the clock.
async fn step_to(
    clock: &SteppedClock,
    node: &Instance,
    arbiter: &HoldingArbiter,
    to_ms: u64,
    reachable: bool,
) {
    while now_ms(clock) < to_ms {
        clock.advance(STEP.min(ms(to_ms - now_ms(clock))));
        let now = now_ms(clock);
        if now.is_multiple_of(1000) {
            let attempts = u32::try_from(now / 1000).unwrap();
            eventually(PATIENCE, "the node attempts its renewal", || {
                arbiter.renewal_attempts() >= attempts
            })
            .await;
            if reachable {
                eventually(PATIENCE, "the node renews on the second", || {
                    node.status().lease_remaining_ms == 4000
                })
                .await;
            }
        }
    }
}

/// Step the clock [`STEP`] at a time, pausing briefly (real time) after
/// each step, until `done` holds; fail if the clock would pass `limit_ms`.
/// For waits the node's own retries decide (a rejoin): a retry is scheduled
/// from the clock reading after the failed attempt, so only a clock that
/// keeps moving is sure to reach it.
async fn step_until(
    clock: &SteppedClock,
    limit_ms: u64,
    what: &str,
    mut done: impl FnMut() -> bool,
) {
    while !done() {
        assert!(
            now_ms(clock) < limit_ms,
            "the clock reached {limit_ms} ms before: {what}"
        );
        clock.advance(STEP);
        tokio::time::sleep(ms(5)).await;
    }
}

/// Guarantee 3 and contract §2: "The node measures its lease from the
/// instant it sent the last renewal that succeeded … Its fence point is
/// `sent + lease_ttl - fence_margin` … The arbiter … judges expiry at
/// `committed + lease_ttl`"; the page: "it stops serving before any other
/// node is allowed to take over" (row 2, node ↔ arbiter partition).
///
/// n0 renews at 1 s and 2 s, then is cut off the arbiter. Stepping 100 ms at
/// a time, it is `Current` at every step before 6 s (= 2 s + 5 s − 1 s), with
/// exactly the time left to 6 s, and serves its key; its failed renewals at
/// 3, 4 and 5 s move nothing. At 6 s it is no longer current, refuses every
/// call, and kills its key — while the arbiter still lists it live, until
/// 7 s (= 2 s + 5 s). Reconnected, it rejoins with a fresh lease and the key
/// comes back as a fresh process: the cast queued before the fence died with
/// the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_fences_at_ttl_minus_margin_before_the_arbiter_expires_its_lease() {
    let (clock, arbiter) = clock_and_arbiter();
    let counting = Arc::new(HoldingArbiter::new(arbiter.clone()));
    let lives = Lives::default();
    let node = start(
        config(),
        &clock,
        counting.clone(),
        &lives,
        &[("probe", guests::PROBE, ModuleOptions::default())],
    )
    .await;
    assert_eq!(routed(&node, "probe", "a", "ping").await.unwrap(), "pong");
    step_to(&clock, &node, &counting, 2000, true).await;
    assert_eq!(node.status().lease_remaining_ms, 4000, "renewed at 2 s");
    assert!(arbiter_lists_n0(&arbiter).await);
    node.cast("probe", "a", b"record before".to_vec()).unwrap();

    arbiter.set_reachable(&n0(), false);
    let fence_point = 6000;
    while now_ms(&clock) < fence_point - STEP.as_millis() as u64 {
        step_to(&clock, &node, &counting, now_ms(&clock) + 100, false).await;
        let now = now_ms(&clock);
        let status = node.status();
        assert_eq!(status.lease, LeaseState::Current, "at {now} ms");
        assert_eq!(
            status.lease_remaining_ms,
            u128::from(fence_point - now),
            "at {now} ms the fence point is still {fence_point} ms"
        );
        assert!(arbiter_lists_n0(&arbiter).await, "at {now} ms");
        if now.is_multiple_of(500) {
            assert_eq!(
                routed(&node, "probe", "a", "events").await.unwrap(),
                "cast:record before",
                "at {now} ms the key is served"
            );
        }
    }
    assert_eq!(node.status().fences, 0);

    // The fence point.
    // (No settling here: at the fence point the loop fences instead of
    // attempting the renewal due then.)
    clock.advance(STEP);
    assert_eq!(now_ms(&clock), fence_point);
    assert_eq!(counting.renewal_attempts(), 5, "renewals tried at 1 to 5 s");
    assert_ne!(node.status().lease, LeaseState::Current);
    assert_eq!(node.status().lease_remaining_ms, 0);
    assert_eq!(
        routed(&node, "probe", "a", "ping").await,
        Err(Error::Fenced)
    );
    eventually(PATIENCE, "n0 fenced once and killed its key", || {
        node.status().fences == 1 && node.keys().is_empty() && lives.ended("probe", "a")
    })
    .await;
    // The arbiter has not expired the lease: nobody else could take over yet.
    assert!(arbiter_lists_n0(&arbiter).await, "at the fence point");
    // From here the node is fenced and makes no renewal attempt.
    clock.advance(ms(900));
    assert!(arbiter_lists_n0(&arbiter).await, "at 6.9 s");
    clock.advance(STEP);
    assert!(!arbiter_lists_n0(&arbiter).await, "expired at 7 s");
    assert_ne!(node.status().lease, LeaseState::Current);

    // Reconnected, n0 rejoins with a fresh lease at its next attempt.
    arbiter.set_reachable(&n0(), true);
    step_until(&clock, 20_000, "n0 rejoins", || {
        node.status().lease == LeaseState::Current
    })
    .await;
    eventually(PATIENCE, "n0 owns every partition again", || {
        node.status().partitions_owned == PARTITIONS as usize
    })
    .await;
    assert_eq!(node.status().fences, 1);
    eventually_async(PATIENCE, "a is served again", || async {
        routed(&node, "probe", "a", "ping").await.is_ok()
    })
    .await;
    assert_eq!(
        routed(&node, "probe", "a", "events").await.unwrap(),
        "",
        "a fresh process: nothing of the fenced one survives"
    );
    assert_eq!(
        lives.of("probe", "a"),
        vec![
            KeyLifeEvent::Started,
            KeyLifeEvent::Ended,
            KeyLifeEvent::Started
        ]
    );
    node.shutdown().await;
}

/// Contract §2: the fence point is `sent + lease_ttl - fence_margin` of the
/// last renewal that succeeded, and the node fences when it passes — not
/// before (the page: the mode changes what survives the fence, "never
/// whether the fence happens or when"). n0 renews at 1 s and 2 s (fence
/// point 6 s); then its coordination loop wakes late, with the clock already
/// at 5.5 s (one clock step standing for a loop descheduled for 3.5 s). Its
/// lease is current for another 500 ms, so it must not fence: it renews
/// instead, and keeps serving its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loop_that_wakes_late_does_not_fence_before_the_fence_point() {
    let (clock, arbiter) = clock_and_arbiter();
    let counting = Arc::new(HoldingArbiter::new(arbiter.clone()));
    let lives = Lives::default();
    let node = start(
        config(),
        &clock,
        counting.clone(),
        &lives,
        &[("probe", guests::PROBE, ModuleOptions::default())],
    )
    .await;
    assert_eq!(routed(&node, "probe", "a", "ping").await.unwrap(), "pong");
    step_to(&clock, &node, &counting, 2000, true).await;
    assert_eq!(node.status().lease_remaining_ms, 4000, "fence point at 6 s");

    clock.advance(ms(3500));
    assert_eq!(node.status().lease, LeaseState::Current, "at 5.5 s");
    eventually(PATIENCE, "the loop reacts: it renews, or fences", || {
        counting.renewal_attempts() >= 3 || node.status().fences > 0
    })
    .await;
    assert_eq!(node.status().fences, 0, "no fence before the fence point");
    eventually(PATIENCE, "renewed at 5.5 s", || {
        node.status().lease_remaining_ms == 4000
    })
    .await;
    assert_eq!(routed(&node, "probe", "a", "ping").await.unwrap(), "pong");
    assert_eq!(lives.of("probe", "a"), vec![KeyLifeEvent::Started]);
    node.shutdown().await;
}

/// A [`LocalArbiter`] that counts the node's renewal attempts and can stall
/// the node's coordination loop inside a renewal: while held, `renew` blocks
/// the calling thread, which is the coordination loop's own. The loop then
/// cannot notice anything, not even its own fence point, while the node's
/// key processes run on: the coordination loop alone is paused, as if
/// descheduled.
struct HoldingArbiter {
    local: LocalArbiter,
    hold: Mutex<bool>,
    released: Condvar,
    /// How many renewals have been held so far.
    held: watch::Sender<u32>,
    /// How many renewals the node has attempted (held or not).
    attempts: watch::Sender<u32>,
}

impl HoldingArbiter {
    fn new(local: LocalArbiter) -> Self {
        HoldingArbiter {
            local,
            hold: Mutex::new(false),
            released: Condvar::new(),
            held: watch::channel(0).0,
            attempts: watch::channel(0).0,
        }
    }

    /// How many renewals the node has attempted so far.
    fn renewal_attempts(&self) -> u32 {
        *self.attempts.borrow()
    }

    /// Hold renewals from now on, or release them (a held one proceeds).
    fn set_hold(&self, hold: bool) {
        *self.hold.lock().unwrap() = hold;
        self.released.notify_all();
    }

    /// Resolves once a renewal is being held.
    fn renewal_held(&self) -> impl Future<Output = ()> + '_ {
        let mut held = self.held.subscribe();
        async move {
            let _ = held.wait_for(|n| *n > 0).await;
        }
    }
}

impl Arbiter for HoldingArbiter {
    fn register<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        ttl: Duration,
        peer_addr: Option<&'a str>,
    ) -> ArbiterFuture<'a, LeaseId> {
        self.local.register(namespace, node, ttl, peer_addr)
    }

    fn renew<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, u64> {
        self.attempts.send_modify(|n| *n += 1);
        if *self.hold.lock().unwrap() {
            self.held.send_modify(|n| *n += 1);
            let hold = self.hold.lock().unwrap();
            drop(self.released.wait_while(hold, |hold| *hold).unwrap());
        }
        // The renewal reaches the arbiter now, on the arbiter's clock.
        self.local.renew(namespace, node, lease)
    }

    fn release<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        self.local.release(namespace, node, lease)
    }

    fn set_leaving<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        self.local.set_leaving(namespace, node, lease)
    }

    fn live_nodes<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<Member>> {
        self.local.live_nodes(namespace)
    }

    fn campaign<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, Option<Term>> {
        self.local.campaign(namespace, node, lease)
    }

    fn table<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, OwnershipTable> {
        self.local.table(namespace)
    }

    fn transfer<'a>(
        &'a self,
        namespace: &'a str,
        from: &'a NodeId,
        lease: LeaseId,
        moves: Vec<(PartitionId, NodeId)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        self.local.transfer(namespace, from, lease, moves)
    }

    fn write_table<'a>(
        &'a self,
        namespace: &'a str,
        term: Term,
        changes: Vec<(PartitionId, Option<NodeId>)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        self.local.write_table(namespace, term, changes)
    }

    fn put_module<'a>(
        &'a self,
        namespace: &'a str,
        module: fief::arbiter::NewModuleVersion,
    ) -> ArbiterFuture<'a, fief::arbiter::ModuleVersionRecord> {
        self.local.put_module(namespace, module)
    }

    fn modules<'a>(
        &'a self,
        namespace: &'a str,
    ) -> ArbiterFuture<'a, Vec<fief::arbiter::StoredModule>> {
        self.local.modules(namespace)
    }

    fn module_bytes<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, Option<fief::arbiter::Bytes>> {
        self.local.module_bytes(namespace, name, version)
    }

    fn set_current_module<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, fief::arbiter::StoredModule> {
        self.local.set_current_module(namespace, name, version)
    }

    fn remove_module<'a>(&'a self, namespace: &'a str, name: &'a str) -> ArbiterFuture<'a, bool> {
        self.local.remove_module(namespace, name)
    }
}

/// Releases a [`HoldingArbiter`]'s hold when dropped, so that a failing
/// test never leaves the coordination loop's thread blocked for good.
struct ReleaseOnDrop<'a>(&'a HoldingArbiter);

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.set_hold(false);
    }
}

/// What [`stall_past_the_fence_point`] saw.
struct Stalled {
    /// The reply to the routed call that had `a` block in a host call.
    a: fief::Result<Vec<u8>>,
    /// The reply to the `publish` queued for `a` before the fence point.
    queued: fief::Result<Vec<u8>>,
    /// The reply to a `publish` sent to `b` through a local handle after the
    /// fence point.
    b: fief::Result<String>,
    /// The fences the node had counted once `a` and `b` were dead.
    fences_before_the_sweep: u64,
    /// The `continue` witness's events after everything.
    witness_events: String,
    /// The fences the node had counted at the end.
    fences_after: u64,
    /// Whether the witness was in limbo at the end.
    witness_in_limbo: bool,
    /// Whether `a` and `b` were still live when the clock had passed the
    /// fence point (the sweep had not run).
    alive_past_the_fence_point: bool,
}

/// Stall node n0's coordination task inside its renewal at 40 s (lease TTL
/// 120 s, renewal every 40 s, margin 3 s: fence point 117 s), then:
///
/// 1. terminate key `probe/a` blocks in a host `call` to `spin/s`, which
///    spins, and a `publish T queued` call is queued for `a` behind it;
/// 2. the clock passes the fence point (the sweep cannot run);
/// 3. `s` is killed, so `a`'s host call returns, after the fence point;
/// 4. terminate key `probe/b` is sent `publish T direct` through a local
///    handle;
/// 5. the stall ends; the sweep runs.
///
/// A `continue` witness, `witness/w`, is subscribed to `T` throughout.
async fn stall_past_the_fence_point() -> Stalled {
    let (clock, local_arbiter) = clock_and_arbiter();
    let arbiter = Arc::new(HoldingArbiter::new(local_arbiter));
    let config = NodeConfig {
        lease_ttl: Duration::from_secs(120),
        renew_interval: Duration::from_secs(40),
        fence_margin: Duration::from_secs(3),
        ..config()
    };
    let lives = Lives::default();
    let node = Arc::new(
        start(
            config,
            &clock,
            arbiter.clone(),
            &lives,
            &[
                ("probe", guests::PROBE, ModuleOptions::default()),
                ("spin", guests::SPIN, spin_options(OnFence::Terminate)),
                ("witness", guests::PROBE, mode(OnFence::Continue)),
            ],
        )
        .await,
    );
    assert_eq!(
        routed(&node, "witness", "w", "subscribe T").await.unwrap(),
        "ok"
    );
    assert_eq!(routed(&node, "probe", "b", "ping").await.unwrap(), "pong");

    // The coordination task enters its renewal at 40 s and stalls there.
    let release = ReleaseOnDrop(&arbiter);
    arbiter.set_hold(true);
    clock.advance(Duration::from_secs(40));
    tokio::time::timeout(PATIENCE, arbiter.renewal_held())
        .await
        .expect("the node's renewal at 40 s is held");
    assert_eq!(node.status().lease, LeaseState::Current);

    // 1. `a` blocks in a host call to a spinning key...
    let blocked = tokio::spawn({
        let node = node.clone();
        async move { node.call("probe", "a", b"call spin s spin".to_vec()).await }
    });
    eventually(PATIENCE, "a waits on the spinning s", || {
        is_live(&node, "spin", "s")
    })
    .await;
    // ...and a publish is queued behind that call (routed and delivered to
    // a's mailbox at the first poll, before the fence point).
    let mut queued = Box::pin(node.call("probe", "a", b"publish T queued".to_vec()));
    tokio::select! {
        biased;
        early = &mut queued => panic!("the queued call was answered early: {early:?}"),
        () = std::future::ready(()) => {}
    }

    // 2. Past the fence point; the sweep cannot run while the task stalls.
    clock.advance(Duration::from_secs(77));
    assert_eq!(now_ms(&clock), 117_000);
    assert_ne!(node.status().lease, LeaseState::Current);
    let alive_past_the_fence_point = is_live(&node, "probe", "a") && is_live(&node, "probe", "b");

    // 3. a's host call returns: s is killed. It may have stopped itself
    // already: a spinning `terminate` key past the fence point kills itself
    // at its next epoch check, which on a loaded machine can come before
    // this line (its epoch ticks are real time, the fence point is on the
    // stepped clock).
    node.kill_key("spin", "s");
    eventually(PATIENCE, "s is dead", || lives.ended("spin", "s")).await;
    let a = tokio::time::timeout(PATIENCE, blocked)
        .await
        .expect("a's caller is answered")
        .unwrap();
    let queued = tokio::time::timeout(PATIENCE, queued)
        .await
        .expect("the queued call is answered");
    // 4. b, through a local handle.
    let b = local(&node, "probe", "b", "publish T direct").await;
    eventually(PATIENCE, "a and b are dead", || {
        lives.ended("probe", "a") && lives.ended("probe", "b")
    })
    .await;
    let fences_before_the_sweep = node.status().fences;

    // 5. Released, the renewal lands after the fence point: the lease stays
    // fenced, and the sweep runs.
    drop(release);
    eventually(PATIENCE, "the sweep runs", || node.status().fences >= 1).await;
    assert_ne!(node.status().lease, LeaseState::Current);
    assert!(node.keys().is_empty());
    let witness_events = local_ok(&node, "witness", "w", "events").await;
    Stalled {
        a,
        queued,
        b,
        fences_before_the_sweep,
        witness_events,
        fences_after: node.status().fences,
        witness_in_limbo: in_limbo(&node, "witness", "w").await.is_some(),
        alive_past_the_fence_point,
    }
}

/// Contract §2: "Every host import that causes a side effect checks the
/// fence first, so even a node resumed after a long pause (SIGSTOP, VM
/// freeze) cannot act for a key after its fence point"; §5 row 5 "node
/// paused past its TTL, then resumed: it performs no side effect and answers
/// nothing for keys it lost"; the page: terminate is "the only mode under
/// which guarantee 1 covers live processes and their side effects".
///
/// The coordination loop's sweep normally kills every terminate key at the
/// fence point (each of its rounds races the fence point), so the gate is a
/// second line: for a node whose coordination task has not run since before
/// its fence point, because after a pause nothing orders the tasks that
/// resume. [`stall_past_the_fence_point`] stalls the coordination task in a
/// renewal while the clock passes the fence point, so the keys are still
/// alive when they next try to act:
///
/// - `a`, blocked in a host `call` since before the fence point, gets its
///   callee's answer after it: the host refuses its next step (the gate
///   after a host call) and `a` dies — before any sweep;
/// - the `publish` queued for `a` before the fence point is never
///   processed, and its caller is told so;
/// - a local-handle message to terminate key `b` after the fence point is
///   refused with `fenced` before it reaches the guest, and `b` dies;
/// - the `continue` witness subscribed to the topic received nothing; it
///   becomes a survivor once the stall ends and the sweep runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_terminate_key_cannot_act_after_the_fence_point_even_before_the_sweep() {
    let seen = stall_past_the_fence_point().await;
    assert!(
        seen.alive_past_the_fence_point,
        "the sweep had not run when the clock passed the fence point"
    );
    assert!(
        matches!(&seen.a, Err(Error::KeyDied(why)) if !why.starts_with("killed")),
        "a died of the gate's refusal, not a kill: {:?}",
        seen.a
    );
    assert!(
        matches!(&seen.queued, Err(Error::KeyDied(why)) if why.contains("not processed")),
        "the queued publish was never processed: {:?}",
        seen.queued
    );
    assert_eq!(seen.b, Err(Error::Fenced));
    assert_eq!(
        seen.fences_before_the_sweep, 0,
        "all of that before the sweep"
    );
    assert_eq!(seen.witness_events, "", "no publication got through");
    assert_eq!(seen.fences_after, 1);
    assert!(seen.witness_in_limbo);
}

/// The error a caller sees names its cause (`host/src/error.rs`: "Every
/// variant says what is wrong"): when the side-effect gate refuses a key's
/// host import after the fence point, the key dies and its caller's
/// `KeyDied` should carry the gate's refusal, "effect refused: the node is
/// fenced". Scenario as in
/// `a_terminate_key_cannot_act_after_the_fence_point_even_before_the_sweep`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_refused_by_the_gate_reports_the_refusal() {
    let seen = stall_past_the_fence_point().await;
    assert!(
        matches!(&seen.a, Err(Error::KeyDied(why)) if why.contains("effect refused: the node is fenced")),
        "{:?}",
        seen.a
    );
}

/// `Instance::fence_now` is one fence: "Fence the node now, as if its lease
/// could not be renewed", and `Status::fences` is "How many times this node
/// has fenced". The coordination loop, when it next wakes and finds the
/// lease fenced, does not count (or sweep) that fence a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_now_counts_one_fence() {
    let (clock, arbiter) = clock_and_arbiter();
    let lives = Lives::default();
    let node = start(config(), &clock, Arc::new(arbiter.clone()), &lives, &[]).await;
    clock.advance(ms(500));
    node.fence_now();
    assert_eq!(node.status().fences, 1);
    // The next renewal was due at 1 s; the old lease expires at the arbiter
    // at 5 s, and the node rejoins at its next attempt after that.
    step_until(&clock, 20_000, "n0 rejoins", || {
        node.status().lease == LeaseState::Current
    })
    .await;
    assert!(now_ms(&clock) >= 5000, "not before the arbiter's expiry");
    assert_eq!(node.status().fences, 1, "one fence_now, one fence");
    node.shutdown().await;
}
