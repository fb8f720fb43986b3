//! The simulation's tests: the CI seed budget, one seed on demand, the
//! soak, the mutation check, the drift bound, and the durable-state rules
//! of the checker on a history written by hand.

use super::checker::{Checker, Rule};
use super::store::{Commit, Value};
use super::*;
use crate::ownership::NodeId;

/// Seeds per CI run (`FIEF_SEEDS` overrides it: the long soak).
const CI_SEEDS: u64 = 1_000;

fn seeds() -> u64 {
    std::env::var("FIEF_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(CI_SEEDS)
}

/// First seed of a run (`FIEF_SEED_BASE`), so soaks can cover new ground.
fn base() -> u64 {
    std::env::var("FIEF_SEED_BASE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Run `count` seeds from `base` with `make`; the failing reports. The
/// sweep stops early once a report satisfies `enough`.
fn sweep(
    base: u64,
    count: u64,
    enough: impl Fn(&Report) -> bool + Sync,
    make: impl Fn(u64) -> Config + Sync,
) -> (Vec<Report>, Stats, u64) {
    let enough = &enough;
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let make = &make;
    let found = std::sync::atomic::AtomicBool::new(false);
    let found = &found;
    let results: Vec<(Vec<Report>, Stats, u64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                scope.spawn(move || {
                    let mut failed = Vec::new();
                    let mut stats = Stats::default();
                    let mut events = 0;
                    let mut seed = base + w;
                    while seed < base + count && !found.load(std::sync::atomic::Ordering::Relaxed) {
                        let report = run(make(seed));
                        stats.add(&report.stats);
                        events += report.events;
                        if enough(&report) {
                            found.store(true, std::sync::atomic::Ordering::Relaxed);
                        }
                        if !report.violations.is_empty() {
                            failed.push(report);
                        }
                        seed += workers;
                    }
                    (failed, stats, events)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a sweep worker panicked"))
            .collect()
    });
    let mut failed = Vec::new();
    let mut stats = Stats::default();
    let mut events = 0;
    for (f, s, e) in results {
        failed.extend(f);
        stats.add(&s);
        events += e;
    }
    failed.sort_by_key(|r| r.seed);
    (failed, stats, events)
}

/// The CI budget: 1,000 seeds (or `FIEF_SEEDS`), zero violations. A
/// failure prints each failing seed's report (the first in full).
#[test]
fn seeds_find_no_violation() {
    let (count, base) = (seeds(), base());
    let started = std::time::Instant::now();
    let (failed, stats, events) = sweep(base, count, |_| false, Config::new);
    eprintln!(
        "simulated {count} seeds from {base} in {:.1?}: {events} events, {stats:?}, {} failing",
        started.elapsed(),
        failed.len()
    );
    if let Some(first) = failed.first() {
        let seeds: Vec<u64> = failed.iter().map(|r| r.seed).collect();
        panic!("failing seeds {seeds:?}; the first:\n{}", first.render());
    }
    // The runs did something worth checking.
    assert!(stats.processed > count * 1_000, "{stats:?}");
    assert!(stats.fences > count / 2, "{stats:?}");
    assert!(stats.handoffs > count, "{stats:?}");
    assert!(stats.retries > count, "{stats:?}");
    assert!(stats.windows > count * 9 / 10, "{stats:?}");
    assert!(stats.states > count, "{stats:?}");
    assert!(stats.claimed > count, "{stats:?}");
    assert!(stats.waited > count, "{stats:?}");
    // Every process loaded its key and committed; stale owners' commits
    // reached the store and were refused.
    assert!(stats.loads > count * 50, "{stats:?}");
    assert!(stats.commits > count * 1_000, "{stats:?}");
    assert!(stats.stale_commits > count * 10, "{stats:?}");
}

/// `FIEF_SEED=<n>`: run one seed and print its report and whole trace.
#[test]
fn one_seed() {
    let Some(seed) = std::env::var("FIEF_SEED").ok().and_then(|s| s.parse().ok()) else {
        return;
    };
    let mut cfg = Config::new(seed);
    cfg.trace_len = usize::MAX;
    if let Ok(m) = std::env::var("FIEF_SIM_MUTATION") {
        cfg.mutation = Some(match m.as_str() {
            "fence-at-ttl" => Mutation::FenceAtTtl,
            "skip-owner-recheck" => Mutation::SkipOwnerRecheck,
            "arbiter-early-expiry" => Mutation::ArbiterEarlyExpiry,
            "reap-hangs" => Mutation::ReapHangs,
            "drain-released-at-transfer" => Mutation::DrainReleasedAtTransfer,
            "adopt-without-reap" => Mutation::AdoptWithoutReap,
            "handoff-drops-waiting" => Mutation::HandoffDropsWaiting,
            "release-before-ack" => Mutation::ReleaseBeforeAck,
            "idle-entry-removed-early" => Mutation::IdleEntryRemovedEarly,
            "store-skips-fence" => Mutation::StoreSkipsFence,
            other => panic!(
                "unknown FIEF_SIM_MUTATION {other:?}: fence-at-ttl, skip-owner-recheck, arbiter-early-expiry, reap-hangs, drain-released-at-transfer, adopt-without-reap, handoff-drops-waiting, release-before-ack, idle-entry-removed-early or store-skips-fence"
            ),
        });
    }
    if let Some(ppm) = std::env::var("FIEF_SIM_DRIFT_PPM")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        cfg.drift_ppm = Some(ppm);
    }
    let report = run(cfg);
    println!("{}", report.render());
    assert!(report.violations.is_empty(), "seed {seed} failed");
}

/// The same seed gives the same history, event for event.
#[test]
fn a_seed_reproduces_exactly() {
    for seed in [1, 17, 4242] {
        let a = run(Config::new(seed));
        let b = run(Config::new(seed));
        assert_eq!(a.trace, b.trace);
        assert_eq!(a.stats, b.stats);
        assert_eq!(a.events, b.events);
    }
}

/// The first seed of the CI budget whose run under `mutation` and
/// `drift_ppm` breaks one of `rules`.
fn catches(mutation: Option<Mutation>, drift_ppm: Option<u32>, rules: &[Rule]) -> Option<Report> {
    let caught = |r: &Report| r.violations.iter().any(|v| rules.contains(&v.rule));
    let (failed, _, _) = sweep(0, CI_SEEDS, caught, |seed| Config {
        mutation,
        drift_ppm,
        ..Config::new(seed)
    });
    failed.into_iter().find(|r| caught(r))
}

/// Assert that the checker finds `mutation` as a breach of one of `rules`
/// within the CI seed budget, and print the first such report.
fn assert_caught(mutation: Mutation, rules: &[Rule]) {
    let report = catches(Some(mutation), None, rules)
        .unwrap_or_else(|| panic!("the checker missed {mutation:?}"));
    eprintln!("{}", report.render());
}

/// Mutation check: fencing at the TTL instead of TTL − margin is caught,
/// as a node processing on a lease the arbiter judged expired.
#[test]
fn mutation_fence_at_ttl_is_caught() {
    assert_caught(Mutation::FenceAtTtl, &[Rule::FencedProcessing]);
}

/// Mutation check: an owner that skips the re-check is caught, as two
/// live processes of a key or a fenced node processing.
#[test]
fn mutation_skip_owner_recheck_is_caught() {
    assert_caught(
        Mutation::SkipOwnerRecheck,
        &[Rule::TwoLiveProcesses, Rule::FencedProcessing],
    );
}

/// Mutation check: an arbiter that expires leases early is caught, as a
/// partition moved while its owner's lease was current.
#[test]
fn mutation_arbiter_early_expiry_is_caught() {
    assert_caught(Mutation::ArbiterEarlyExpiry, &[Rule::EarlyMove]);
}

/// Mutation check: an executor whose reap hangs on survivors is caught by
/// the liveness rule (the node never adopts a table that gives it their
/// partition back).
#[test]
fn mutation_reap_hangs_is_caught() {
    assert_caught(Mutation::ReapHangs, &[Rule::Liveness]);
}

/// Mutation check: a move that serves its partitions again while its
/// transfer is in flight is caught (the target serves them too once the
/// transfer commits).
#[test]
fn mutation_drain_released_at_transfer_is_caught() {
    assert_caught(
        Mutation::DrainReleasedAtTransfer,
        &[Rule::TwoLiveProcesses, Rule::TwoOwners],
    );
}

/// Mutation check: adopting a table without reaping the survivors of the
/// partitions it gains is caught, as a key started beside its own
/// survivor.
#[test]
fn mutation_adopt_without_reap_is_caught() {
    assert_caught(Mutation::AdoptWithoutReap, &[Rule::BesideSurvivor]);
}

/// Mutation check: a handoff that drops the states waiting on its node
/// for keys of its partitions, instead of sending them on, is caught (a
/// partition handed on without a state its owner held for it, or a key
/// started fresh while its state was held).
#[test]
fn mutation_handoff_drops_waiting_is_caught() {
    assert_caught(Mutation::HandoffDropsWaiting, &[Rule::HandoffState]);
}

/// Mutation check: a sender that lets go of a move's states once it sent
/// them, before the target acked, is caught when the handoff is lost: the
/// move keeps its partitions, and a key's next process there starts fresh
/// while its state was held.
#[test]
fn mutation_release_before_ack_is_caught() {
    assert_caught(Mutation::ReleaseBeforeAck, &[Rule::HandoffState]);
}

/// Mutation check: an idle key's entry removed before its
/// `terminate(idle)` ran (the old bug) is caught, as a second process of
/// the key started on the node beside the retiring one.
#[test]
fn mutation_idle_entry_removed_early_is_caught() {
    assert_caught(Mutation::IdleEntryRemovedEarly, &[Rule::TwoLiveProcesses]);
}

/// Drift within the configured bound (1%) is safe — that is the CI sweep —
/// and drift far beyond it (30%: a slow node's fence point falls after the
/// arbiter's expiry) is what breaks single ownership.
#[test]
fn drift_beyond_the_bound_breaks_ownership() {
    let report = catches(
        None,
        Some(300_000),
        &[
            Rule::FencedProcessing,
            Rule::TwoLiveProcesses,
            Rule::EarlyMove,
        ],
    )
    .expect("30% drift should break single ownership");
    eprintln!("{}", report.render());
}

/// Mutation check: a store that lands commits without the fence check is
/// caught, as a stale owner's commit (a survivor in limbo, or a commit
/// still on its way when its process lost the partition) applied after a
/// newer owner's load raised the partition's fence token — or, failing
/// that, as a later load missing a commit acknowledged before it.
#[test]
fn mutation_store_skips_fence_is_caught() {
    assert_caught(
        Mutation::StoreSkipsFence,
        &[Rule::StaleCommitApplied, Rule::AcknowledgedCommitLost],
    );
}

/// The durable-state rules on a history written by hand: a load that
/// misses an acknowledged commit (a stale owner's commit landed on an
/// older value and replaced the newer owner's) is an acknowledged commit
/// lost, and the stale commit itself a stale commit applied; the history
/// without it is clean.
#[test]
fn the_checker_finds_a_stale_commit_and_a_lost_acknowledged_commit() {
    let (a, b) = (NodeId::new("n1"), NodeId::new("n2"));
    let commit = |id, token, parent, count| Commit {
        id,
        life: token,
        key: "k".to_owned(),
        partition: 3,
        token,
        parent,
        count,
    };
    let value = |count, commit| Ok(Value { count, commit });
    let history = |stale: bool| {
        let mut c = Checker::new(timing().lease_ttl());
        c.store_loaded(1, &a, "k", 3, 4, value(0, 0));
        c.store_committed(2, &a, &commit(1, 4, 0, 1), true);
        // A new owner loads under 7 and commits on what n1 committed.
        c.store_loaded(3, &b, "k", 3, 7, value(1, 1));
        c.store_committed(4, &b, &commit(2, 7, 1, 2), true);
        if stale {
            // n1's next commit lands anyway, on its own old copy.
            c.store_committed(5, &a, &commit(3, 4, 1, 2), true);
            c.store_loaded(6, &b, "k", 3, 9, value(2, 3));
        } else {
            c.store_committed(5, &a, &commit(3, 4, 1, 2), false);
            c.store_loaded(6, &b, "k", 3, 9, value(2, 2));
        }
        c.violations
    };
    assert_eq!(history(false), vec![]);
    let rules: Vec<Rule> = history(true).iter().map(|v| v.rule).collect();
    assert_eq!(
        rules,
        vec![Rule::StaleCommitApplied, Rule::AcknowledgedCommitLost]
    );
}
