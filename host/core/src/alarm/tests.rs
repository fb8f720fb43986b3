//! The rules of `AlarmSchedule`, one test each (`docs/alarms.md`), and a
//! seeded randomized run against a model of the store.

use super::*;

const P: u32 = 3;
const T: u64 = 10;

fn id(partition: u32, key: &str, name: &str) -> AlarmId {
    AlarmId {
        partition,
        module: "acme/m".to_owned(),
        key: key.to_owned(),
        name: name.to_owned(),
    }
}

fn stored(partition: u32, key: &str, name: &str, at_ms: u64) -> StoredAlarm {
    StoredAlarm {
        id: id(partition, key, name),
        at_ms,
    }
}

fn set(name: &str, at_ms: u64) -> AlarmChange {
    AlarmChange::Set {
        name: name.to_owned(),
        at_ms,
    }
}

fn cancel(name: &str) -> AlarmChange {
    AlarmChange::Cancel {
        name: name.to_owned(),
    }
}

/// A schedule serving partition `P` under `T` with `alarms` (key, name, at).
fn serving(alarms: &[(&str, &str, u64)]) -> AlarmSchedule {
    let mut s = AlarmSchedule::new(RetryPolicy::default());
    s.serve(P, T, alarms.iter().map(|(k, n, at)| stored(P, k, n, *at)));
    s
}

/// The (key, name, attempt) of each firing.
fn fired(firings: &[Firing]) -> Vec<(String, String, u32)> {
    firings
        .iter()
        .map(|f| (f.alarm.key.clone(), f.alarm.name.clone(), f.attempt))
        .collect()
}

fn one(key: &str, name: &str, attempt: u32) -> Vec<(String, String, u32)> {
    vec![(key.to_owned(), name.to_owned(), attempt)]
}

/// Fire the single alarm due at `now`.
fn fire_one(s: &mut AlarmSchedule, now: u64) -> Firing {
    let mut f = s.due(now, usize::MAX);
    assert_eq!(f.len(), 1, "one firing at {now}: {f:?}");
    f.remove(0)
}

#[test]
fn never_fires_before_its_time() {
    let mut s = serving(&[("k", "a", 1_000)]);
    assert!(s.due(999, usize::MAX).is_empty());
    assert_eq!(s.next_wake(), Some(1_000));
    let f = fire_one(&mut s, 1_000);
    assert_eq!((f.at_ms, f.token, f.attempt), (1_000, T, 1));
    // An alarm set in the past fires at once.
    s.committed(P, T, "acme/m", "k", &[set("b", 5)]);
    assert_eq!(fired(&s.due(1_000, usize::MAX)), one("k", "b", 1));
}

#[test]
fn fires_earliest_first_at_most_max_per_call() {
    let mut s = serving(&[("k", "c", 30), ("k", "a", 10), ("j", "b", 20)]);
    assert_eq!(
        fired(&s.due(100, 2)),
        [one("k", "a", 1), one("j", "b", 1)].concat()
    );
    assert_eq!(s.next_wake(), Some(30));
    assert_eq!(fired(&s.due(100, 2)), one("k", "c", 1));
    assert_eq!(s.in_flight(), 3);
}

#[test]
fn fires_only_for_served_partitions_under_their_token() {
    let mut s = serving(&[]);
    // A commit in a partition not served here, or under another token,
    // schedules nothing.
    s.committed(P + 1, T, "acme/m", "k", &[set("a", 1)]);
    s.committed(P, T - 1, "acme/m", "k", &[set("b", 1)]);
    s.committed(P, T + 1, "acme/m", "k", &[set("c", 1)]);
    assert!(s.due(u64::MAX, usize::MAX).is_empty());
    // A load's alarm of another partition is not taken.
    s.serve(
        P + 2,
        4,
        [stored(P + 1, "k", "d", 1), stored(P + 2, "k", "e", 1)],
    );
    let f = fire_one(&mut s, 1);
    assert_eq!((f.alarm.partition, f.token), (P + 2, 4));
}

#[test]
fn a_stopped_partition_fires_nothing_and_its_outcomes_are_ignored() {
    let mut s = serving(&[("k", "a", 10), ("k", "b", 20)]);
    s.serve(P + 1, 7, [stored(P + 1, "k", "a", 10)]);
    let firing = s.due(10, 1).remove(0);
    assert_eq!(firing.alarm.partition, P);
    s.stop(P);
    assert!(s.served().get(&P).is_none());
    s.finished(&firing, FireOutcome::Trapped, 10);
    // Only the other partition's alarm is left.
    assert_eq!(s.len(), 1);
    let rest = s.due(u64::MAX, usize::MAX);
    assert_eq!(rest.len(), 1);
    assert_eq!(rest[0].alarm.partition, P + 1);
    // The partition's highest number stops too (no overflow at the edge).
    s.serve(u32::MAX, 1, [stored(u32::MAX, "k", "z", 1)]);
    s.stop(u32::MAX);
    assert_eq!(s.len(), 1);
}

#[test]
fn one_firing_in_flight_per_alarm() {
    let mut s = serving(&[("k", "a", 10)]);
    let first = fire_one(&mut s, 10);
    assert!(
        s.due(u64::MAX, usize::MAX).is_empty(),
        "fired again in flight"
    );
    // Set again while in flight: still not fired a second time until the
    // first firing's outcome is in.
    s.committed(P, T, "acme/m", "k", &[set("a", 5)]);
    assert!(s.due(u64::MAX, usize::MAX).is_empty());
    assert_eq!(s.next_wake(), None);
    s.finished(&first, FireOutcome::Trapped, 20);
    assert_eq!(fired(&s.due(20, usize::MAX)), one("k", "a", 1));
}

#[test]
fn a_trap_retries_with_capped_exponential_backoff_and_the_next_attempt() {
    let policy = RetryPolicy {
        first_ms: 100,
        max_ms: 350,
    };
    let mut s = AlarmSchedule::new(policy);
    s.serve(P, T, [stored(P, "k", "a", 1_000)]);
    let mut now = 1_000;
    for (attempt, delay) in [(1, 100), (2, 200), (3, 350), (4, 350)] {
        let f = fire_one(&mut s, now);
        assert_eq!(f.attempt, attempt);
        s.finished(&f, FireOutcome::Trapped, now);
        assert_eq!(s.next_wake(), Some(now + delay), "after attempt {attempt}");
        assert!(
            s.due(now + delay - 1, usize::MAX).is_empty(),
            "retried early"
        );
        now += delay;
    }
    // The alarm is still there (the trapped callbacks committed nothing).
    assert_eq!(fire_one(&mut s, now).at_ms, 1_000);
}

#[test]
fn a_refused_commit_retries_like_a_trap() {
    let mut s = serving(&[("k", "a", 10)]);
    let f = fire_one(&mut s, 10);
    s.finished(&f, FireOutcome::CommitRefused, 10);
    assert_eq!(s.next_wake(), Some(10 + RetryPolicy::default().first_ms));
    assert_eq!(fire_one(&mut s, u64::MAX).attempt, 2);
}

#[test]
fn a_handler_that_did_not_run_retries_with_the_same_attempt() {
    let mut s = serving(&[("k", "a", 10)]);
    let f = fire_one(&mut s, 10);
    s.finished(&f, FireOutcome::NotRun, 10);
    assert_eq!(s.next_wake(), Some(10 + RetryPolicy::default().first_ms));
    assert_eq!(fire_one(&mut s, u64::MAX).attempt, 1);
}

#[test]
fn a_committed_firing_deletes_its_alarm() {
    let mut s = serving(&[("k", "a", 10), ("k", "b", 10)]);
    let firings = s.due(10, usize::MAX);
    // "a" was deleted by its callback's commit, reported first; "b"'s
    // commit carried no alarm change: its completion deletes it all the same.
    s.committed(P, T, "acme/m", "k", &[cancel("a")]);
    for f in &firings {
        s.finished(f, FireOutcome::Committed, 11);
    }
    assert!(s.is_empty());
    assert!(s.due(u64::MAX, usize::MAX).is_empty());
}

#[test]
fn an_alarm_set_again_while_it_fires_survives_its_completion() {
    let mut s = serving(&[("k", "a", 10)]);
    let f = fire_one(&mut s, 10);
    // The handler's commit: the fired alarm's delete, then its own set.
    s.committed(P, T, "acme/m", "k", &[cancel("a"), set("a", 50)]);
    s.finished(&f, FireOutcome::Committed, 12);
    assert_eq!(s.next_wake(), Some(50));
    assert_eq!(fired(&s.due(50, usize::MAX)), one("k", "a", 1));
    // The same after a trap: the new setting fires on its own time, from
    // attempt 1.
    let mut s = serving(&[("k", "a", 10)]);
    let f = fire_one(&mut s, 10);
    s.committed(P, T, "acme/m", "k", &[set("a", 70)]);
    s.finished(&f, FireOutcome::Trapped, 12);
    assert_eq!(s.next_wake(), Some(70));
}

#[test]
fn an_alarm_cancelled_while_it_fires_is_gone_after_its_outcome() {
    let mut s = serving(&[("k", "a", 10)]);
    let f = fire_one(&mut s, 10);
    s.committed(P, T, "acme/m", "k", &[cancel("a")]);
    assert_eq!(s.len(), 1, "kept until the firing's outcome");
    s.finished(&f, FireOutcome::Trapped, 10);
    assert!(s.is_empty());
    assert!(s.due(u64::MAX, usize::MAX).is_empty());
}

#[test]
fn stale_outcomes_are_ignored() {
    let mut s = serving(&[("k", "a", 10)]);
    let old = fire_one(&mut s, 10);
    s.finished(&old, FireOutcome::Trapped, 10);
    let current = fire_one(&mut s, u64::MAX);
    // The older firing's outcome, again: nothing changes.
    s.finished(&old, FireOutcome::Committed, 20);
    assert_eq!(s.len(), 1);
    assert!(s.due(u64::MAX, usize::MAX).is_empty(), "still in flight");
    // An outcome under another token than the partition's: ignored.
    let forged = Firing {
        token: T + 1,
        ..current.clone()
    };
    s.finished(&forged, FireOutcome::Committed, 20);
    assert_eq!(s.len(), 1);
    s.finished(&current, FireOutcome::Committed, 20);
    assert!(s.is_empty());
    // After the partition is served again under a newer token, the old
    // token's firing is not the one in flight.
    let mut s = serving(&[("k", "a", 10)]);
    let before = fire_one(&mut s, 10);
    s.stop(P);
    s.serve(P, T + 1, [stored(P, "k", "a", 10)]);
    let after = fire_one(&mut s, 10);
    s.finished(&before, FireOutcome::Committed, 11);
    assert_eq!(s.len(), 1);
    assert_eq!(after.token, T + 1);
}

#[test]
fn a_late_or_repeated_load_does_not_replace_a_newer_one() {
    let mut s = serving(&[("k", "a", 10)]);
    let f = fire_one(&mut s, 10);
    s.serve(P, T - 1, [stored(P, "k", "old", 1)]);
    s.serve(P, T, [stored(P, "k", "a", 10)]);
    assert!(s.due(u64::MAX, usize::MAX).is_empty(), "in flight twice");
    s.finished(&f, FireOutcome::Committed, 11);
    assert!(s.is_empty());
    // A newer token replaces the partition's alarms.
    s.serve(P, T + 1, [stored(P, "k", "b", 10)]);
    assert_eq!(fired(&s.due(10, usize::MAX)), one("k", "b", 1));
}

#[test]
fn a_superseded_firing_takes_the_keys_view() {
    let mut s = serving(&[("k", "a", 10), ("k", "b", 10), ("k", "c", 10)]);
    let f = s.due(10, usize::MAX);
    s.finished(&f[0], FireOutcome::Superseded { at_ms: Some(40) }, 11);
    s.finished(&f[1], FireOutcome::Superseded { at_ms: None }, 11);
    // The schedule heard of a newer setting itself: it wins.
    s.committed(P, T, "acme/m", "k", &[set("c", 60)]);
    s.finished(&f[2], FireOutcome::Superseded { at_ms: None }, 11);
    assert_eq!(s.len(), 2);
    assert_eq!(fired(&s.due(59, usize::MAX)), one("k", "a", 1));
    assert_eq!(fired(&s.due(60, usize::MAX)), one("k", "c", 1));
}

#[test]
fn a_new_setting_forgets_the_retries() {
    let mut s = serving(&[("k", "a", 10)]);
    let f = fire_one(&mut s, 10);
    s.finished(&f, FireOutcome::Trapped, 10);
    let f = fire_one(&mut s, 2_000);
    s.finished(&f, FireOutcome::Trapped, 2_000);
    s.committed(P, T, "acme/m", "k", &[set("a", 2_001)]);
    let f = fire_one(&mut s, 2_001);
    assert_eq!(f.attempt, 1);
}

#[test]
fn retry_delays_double_to_their_cap() {
    let p = RetryPolicy {
        first_ms: 1_000,
        max_ms: 300_000,
    };
    let delays: Vec<u64> = (1..=10).map(|a| p.delay_ms(a)).collect();
    assert_eq!(
        delays,
        [
            1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 128_000, 256_000, 300_000
        ]
    );
    assert_eq!(p.delay_ms(u32::MAX), 300_000);
    assert_eq!(p.delay_ms(0), 1_000);
}

#[test]
fn a_set_is_checked_for_its_name_and_how_far_ahead() {
    assert_eq!(check_set("a", 0, 1_000), Ok(()));
    assert_eq!(check_set(&"n".repeat(MAX_NAME_BYTES), 5, 0), Ok(()));
    assert_eq!(check_set("", 5, 0), Err(InvalidAlarm::Name { bytes: 0 }));
    let long = "n".repeat(MAX_NAME_BYTES + 1);
    assert_eq!(
        check_set(&long, 5, 0),
        Err(InvalidAlarm::Name {
            bytes: MAX_NAME_BYTES + 1
        })
    );
    assert_eq!(check_set("a", 7 + MAX_AHEAD_MS, 7), Ok(()));
    let e = check_set("a", 8 + MAX_AHEAD_MS, 7).unwrap_err();
    assert_eq!(
        e,
        InvalidAlarm::TooFar {
            at_ms: 8 + MAX_AHEAD_MS,
            latest_ms: 7 + MAX_AHEAD_MS
        }
    );
    assert!(e.to_string().contains("ten years"), "{e}");
    assert_eq!(check_set("a", u64::MAX, u64::MAX - 1), Ok(()));
}

// ---------------------------------------------------------------------------
// Randomized: the schedule against a model of the store, on seeded inputs.

/// A model of the store and of the keys: the alarm rows (every partition),
/// which partitions this node serves under which token, and the firings
/// delivered and not yet answered.
struct Model {
    rng: fastrand::Rng,
    rows: BTreeMap<AlarmId, u64>,
    served: BTreeMap<u32, u64>,
    pending: Vec<Firing>,
    next_token: u64,
    now: u64,
    completed: usize,
}

const KEYS: [&str; 2] = ["j", "k"];
const NAMES: [&str; 2] = ["x", "y"];

impl Model {
    fn pick<'a>(&mut self, of: &[&'a str]) -> &'a str {
        of[self.rng.usize(..of.len())]
    }

    /// Serve a partition under a fresh token from the rows (a load).
    fn serve(&mut self, s: &mut AlarmSchedule, p: u32) {
        self.next_token += 1;
        self.served.insert(p, self.next_token);
        let rows = self.rows.iter().filter(|(id, _)| id.partition == p);
        let loaded: Vec<StoredAlarm> = rows
            .map(|(id, at)| StoredAlarm {
                id: id.clone(),
                at_ms: *at,
            })
            .collect();
        s.serve(p, self.next_token, loaded);
    }

    /// Land `changes` on `module`/`key` of `p` under the current token, and
    /// report them.
    fn commit(&mut self, s: &mut AlarmSchedule, p: u32, key: &str, changes: &[AlarmChange]) {
        let token = self.served[&p];
        for change in changes {
            match change {
                AlarmChange::Set { name, at_ms } => {
                    self.rows.insert(id(p, key, name), *at_ms);
                }
                AlarmChange::Cancel { name } => {
                    self.rows.remove(&id(p, key, name));
                }
            }
        }
        s.committed(p, token, "acme/m", key, changes);
    }

    /// The key's side of a firing: run it (or find it superseded), commit
    /// and report; `ok`: the handler succeeds.
    fn answer(&mut self, s: &mut AlarmSchedule, f: &Firing, ok: bool) {
        let p = f.alarm.partition;
        if self.served.get(&p) != Some(&f.token) {
            // The process is gone with the partition; whatever it says is
            // ignored.
            s.finished(f, FireOutcome::Committed, self.now);
            return;
        }
        let row = self.rows.get(&f.alarm).copied();
        if row != Some(f.at_ms) {
            s.finished(f, FireOutcome::Superseded { at_ms: row }, self.now);
        } else if ok {
            let mut changes = vec![cancel(&f.alarm.name)];
            if self.rng.u8(..4) == 0 {
                changes.push(set(&f.alarm.name, self.now + self.rng.u64(..3_000)));
            }
            self.commit(s, p, &f.alarm.key.clone(), &changes);
            s.finished(f, FireOutcome::Committed, self.now);
            self.completed += 1;
        } else {
            let outcome = [
                FireOutcome::Trapped,
                FireOutcome::CommitRefused,
                FireOutcome::NotRun,
            ][self.rng.usize(..3)]
            .clone();
            s.finished(f, outcome, self.now);
        }
    }

    /// Fire what is due and check every firing against the rules.
    fn fire(&mut self, s: &mut AlarmSchedule) {
        let max = self.rng.usize(1..4);
        for f in s.due(self.now, max) {
            assert!(f.at_ms <= self.now, "early: {f:?} at {}", self.now);
            assert_eq!(self.served.get(&f.alarm.partition), Some(&f.token), "{f:?}");
            assert_eq!(self.rows.get(&f.alarm), Some(&f.at_ms), "not stored: {f:?}");
            let twice = self
                .pending
                .iter()
                .any(|p| p.alarm == f.alarm && p.token == f.token);
            assert!(!twice, "two firings in flight: {f:?}");
            self.pending.push(f);
        }
    }

    /// The schedule holds exactly the rows of the served partitions, and its
    /// queue exactly its waiting entries.
    fn check(&self, s: &AlarmSchedule) {
        let held: BTreeMap<AlarmId, u64> = s
            .alarms
            .iter()
            .filter_map(|(id, e)| e.at_ms.map(|at| (id.clone(), at)))
            .collect();
        let rows: BTreeMap<AlarmId, u64> = self
            .rows
            .iter()
            .filter(|(id, _)| self.served.contains_key(&id.partition))
            .map(|(id, at)| (id.clone(), *at))
            .collect();
        assert_eq!(held, rows);
        assert_eq!(s.served(), &self.served);
        let queue: BTreeSet<(u64, AlarmId)> = s
            .alarms
            .iter()
            .filter_map(|(id, e)| e.due_ms().map(|d| (d, id.clone())))
            .collect();
        assert_eq!(s.queue, queue);
    }
}

fn run_seed(seed: u64) -> usize {
    let mut m = Model {
        rng: fastrand::Rng::with_seed(seed),
        rows: BTreeMap::new(),
        served: BTreeMap::new(),
        pending: Vec::new(),
        next_token: 0,
        now: 1_000,
        completed: 0,
    };
    let mut s = AlarmSchedule::new(RetryPolicy {
        first_ms: 50,
        max_ms: 400,
    });
    for p in 0..3 {
        m.serve(&mut s, p);
    }
    for _ in 0..400 {
        match m.rng.u8(..10) {
            0 => {
                let p = m.rng.u32(..3);
                if m.served.contains_key(&p) && m.rng.bool() {
                    m.served.remove(&p);
                    s.stop(p);
                } else {
                    m.serve(&mut s, p);
                }
            }
            1..=3 => {
                let p = m.rng.u32(..3);
                let (key, name) = (m.pick(&KEYS), m.pick(&NAMES));
                if let Some(&token) = m.served.get(&p) {
                    let change = if m.rng.u8(..3) == 0 {
                        cancel(name)
                    } else {
                        set(name, m.now + m.rng.u64(..2_000) - 500)
                    };
                    if m.rng.u8(..5) == 0 {
                        // A stale owner's commit: refused by the store,
                        // and its report ignored.
                        s.committed(p, token - 1, "acme/m", key, &[change]);
                    } else {
                        m.commit(&mut s, p, key, &[change]);
                    }
                }
            }
            4..=6 => {
                if !m.pending.is_empty() {
                    let f = m.pending.remove(m.rng.usize(..m.pending.len()));
                    let ok = m.rng.u8(..3) != 0;
                    m.answer(&mut s, &f, ok);
                }
            }
            _ => {
                m.now += m.rng.u64(..300);
                m.fire(&mut s);
            }
        }
        m.check(&s);
    }
    // Quiet phase: every handler succeeds, time goes on; every alarm of a
    // served partition fires and is gone (at least once, nothing lost).
    for p in 0..3 {
        if !m.served.contains_key(&p) {
            m.serve(&mut s, p);
        }
    }
    for _ in 0..1_000 {
        for f in std::mem::take(&mut m.pending) {
            m.answer(&mut s, &f, true);
        }
        m.check(&s);
        if s.is_empty() {
            break;
        }
        m.now += 100;
        m.fire(&mut s);
    }
    assert!(
        s.is_empty(),
        "seed {seed}: alarms never fired: {:?}",
        s.alarms
    );
    assert!(m.rows.is_empty(), "seed {seed}: rows left: {:?}", m.rows);
    m.completed
}

#[test]
fn random_inputs_keep_every_rule() {
    let mut completed = 0;
    for seed in 0..300 {
        completed += run_seed(seed);
    }
    assert!(completed > 3_000, "too few handlers completed: {completed}");
}
