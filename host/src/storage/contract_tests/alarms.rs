//! The alarm rules of the storage contract (`docs/alarms.md`), run against
//! every backend by `super`'s `contract!`: alarm writes land with their
//! commit and load with their key, a stale commit applies none, and a
//! partition's alarm load sees what landed before it and raises the fence.
//! It owns these rules and their helpers only; it must not hold backend
//! code.

use super::super::{AlarmId, Backend, Fence, KeyScope, Load, Outcome, Round, StoredAlarm, Write};
use super::{commit, commit_one, delete, delete_range, entries_of, fence, load, put, round, scope};

pub(super) fn set_alarm(name: &str, at_ms: u64) -> Write {
    Write::SetAlarm {
        name: name.to_owned(),
        at_ms,
    }
}

pub(super) fn cancel_alarm(name: &str) -> Write {
    Write::CancelAlarm {
        name: name.to_owned(),
    }
}

pub(super) fn stored_alarm(
    partition: u32,
    scope: &KeyScope,
    name: &str,
    at_ms: u64,
) -> StoredAlarm {
    StoredAlarm {
        id: AlarmId {
            partition,
            module: scope.module.clone(),
            key: scope.key.clone(),
            name: name.to_owned(),
        },
        at_ms,
    }
}

/// Load one key alone, which must be served: its alarms.
pub(super) async fn alarms_of(
    b: &dyn Backend,
    scope: &KeyScope,
    fence: Fence,
) -> Vec<(String, u64)> {
    match load(b, scope, fence).await {
        Outcome::Done(loaded) => loaded.alarms,
        stale => panic!("the load of {scope:?} was refused: {stale:?}"),
    }
}

/// Load one partition's alarms alone.
pub(super) async fn alarms_of_partition(
    b: &dyn Backend,
    fence: Fence,
) -> Outcome<Vec<StoredAlarm>> {
    let round = Round {
        partition_alarms: vec![fence],
        ..Round::default()
    };
    let mut result = b.round(round).await.expect("the round lands");
    result.partition_alarms.remove(0)
}

pub(super) fn alarms(pairs: &[(&str, u64)]) -> Vec<(String, u64)> {
    pairs.iter().map(|(n, at)| ((*n).to_owned(), *at)).collect()
}

// ---------------------------------------------------------------------------
// The rules.

pub(super) async fn alarms_land_with_their_commit_and_load_with_their_key(b: &dyn Backend) {
    let s = scope("acme/m", "k");
    let neighbours = [
        scope("acme/m", "k2"),
        scope("acme/m", "k/x"),
        scope("acme/n", "k"),
    ];
    load(b, &s, fence(2, 1)).await;
    let writes = vec![
        set_alarm("x", 100),
        set_alarm("y", 50),
        put("x", b"an entry, not an alarm"),
        set_alarm("x", 200),
        // Entry writes never touch alarms, even of the same name.
        delete("x"),
        delete_range("", None),
        set_alarm("gone", 7),
        cancel_alarm("gone"),
    ];
    let mut commits = vec![commit(&s, fence(2, 1), writes, 0)];
    for n in &neighbours {
        commits.push(commit(n, fence(2, 1), vec![set_alarm("x", 1)], 0));
    }
    round(b, commits, vec![]).await;
    assert_eq!(
        alarms_of(b, &s, fence(2, 1)).await,
        alarms(&[("x", 200), ("y", 50)])
    );
    assert_eq!(entries_of(b, &s, fence(2, 1)).await, vec![]);
    // Commits of one round apply in order; a cancel of no alarm is a no-op.
    let commits = vec![
        commit(
            &s,
            fence(2, 1),
            vec![cancel_alarm("y"), cancel_alarm("z")],
            0,
        ),
        commit(
            &s,
            fence(2, 1),
            vec![set_alarm("y", 60), set_alarm("é", 1)],
            0,
        ),
        commit(&s, fence(2, 1), vec![cancel_alarm("x")], 0),
    ];
    round(b, commits, vec![]).await;
    assert_eq!(
        alarms_of(b, &s, fence(2, 1)).await,
        alarms(&[("y", 60), ("é", 1)])
    );
    for n in &neighbours {
        assert_eq!(
            alarms_of(b, n, fence(2, 1)).await,
            alarms(&[("x", 1)]),
            "{n:?}"
        );
    }
    // An operator's read (`fief alarms`) sees the same, sorted, without
    // raising the fence; a key with none reads empty.
    assert_eq!(
        b.read_alarms(s.clone(), 2).await.expect("the read"),
        alarms(&[("y", 60), ("é", 1)])
    );
    assert_eq!(
        b.read_alarms(scope("acme/m", "none"), 2)
            .await
            .expect("the read"),
        vec![]
    );
}

pub(super) async fn a_stale_commit_sets_and_cancels_no_alarm(b: &dyn Backend) {
    let s = scope("acme/m", "k");
    load(b, &s, fence(1, 1)).await;
    let c = commit(&s, fence(1, 1), vec![set_alarm("x", 10)], 0);
    assert_eq!(commit_one(b, c).await, Outcome::Done(0));
    // A new owner loads the partition's alarms under token 2: the old
    // owner's commit (its handler's deletion of the alarm, a new alarm) is
    // refused whole.
    let x = stored_alarm(1, &s, "x", 10);
    assert_eq!(
        alarms_of_partition(b, fence(1, 2)).await,
        Outcome::Done(vec![x.clone()])
    );
    let c = commit(
        &s,
        fence(1, 1),
        vec![cancel_alarm("x"), set_alarm("y", 5), put("a", b"1")],
        2,
    );
    assert_eq!(commit_one(b, c).await, Outcome::Stale { current: 2 });
    assert_eq!(
        alarms_of_partition(b, fence(1, 2)).await,
        Outcome::Done(vec![x])
    );
    assert_eq!(alarms_of(b, &s, fence(1, 2)).await, alarms(&[("x", 10)]));
    // Never loaded under any token: refused too.
    let c = commit(&s, fence(9, 3), vec![set_alarm("never", 1)], 0);
    assert_eq!(commit_one(b, c).await, Outcome::Stale { current: 0 });
    assert_eq!(
        alarms_of_partition(b, fence(9, 3)).await,
        Outcome::Done(vec![])
    );
}

pub(super) async fn a_partition_alarm_load_sees_the_commits_before_it_and_fences_older_owners(
    b: &dyn Backend,
) {
    let (k, j, other) = (
        scope("acme/m", "k"),
        scope("acme/b", "j"),
        scope("acme/m", "o"),
    );
    for s in [&k, &j] {
        load(b, s, fence(4, 1)).await;
    }
    load(b, &other, fence(5, 1)).await;
    let commits = vec![
        commit(
            &k,
            fence(4, 1),
            vec![set_alarm("b", 30), set_alarm("a", 40)],
            0,
        ),
        commit(&other, fence(5, 1), vec![set_alarm("a", 1)], 0),
    ];
    round(b, commits, vec![]).await;
    // In one round: a commit of the old owner, then the new owner's
    // partition load, which sees it (commits are judged and applied first).
    let r = b
        .round(Round {
            commits: vec![commit(&j, fence(4, 1), vec![set_alarm("z", 20)], 0)],
            partition_alarms: vec![fence(4, 2), fence(4, 1), fence(6, 2)],
            ..Round::default()
        })
        .await
        .expect("the round lands");
    assert_eq!(r.commits, vec![Outcome::Done(0)]);
    // Sorted by (module, key, name); partition 5's alarm is not there.
    let expected = vec![
        stored_alarm(4, &j, "z", 20),
        stored_alarm(4, &k, "a", 40),
        stored_alarm(4, &k, "b", 30),
    ];
    assert_eq!(
        r.partition_alarms,
        vec![
            Outcome::Done(expected),
            Outcome::Stale { current: 2 },
            Outcome::Done(vec![]),
        ]
    );
    // The load raised the fence: the old owner commits nothing more, and
    // the raise counts like a key load's.
    let c = commit(&k, fence(4, 1), vec![cancel_alarm("a")], 0);
    assert_eq!(commit_one(b, c).await, Outcome::Stale { current: 2 });
    assert_eq!(b.highest_fence_token().await.expect("the highest token"), 2);
    // A key load after it in the same round sees the raised token; a
    // partition load is judged after the round's key loads.
    let r = b
        .round(Round {
            loads: vec![Load {
                scope: other.clone(),
                fence: fence(5, 3),
            }],
            partition_alarms: vec![fence(5, 2)],
            ..Round::default()
        })
        .await
        .expect("the round lands");
    assert!(matches!(r.loads[0], Outcome::Done(_)));
    assert_eq!(r.partition_alarms, vec![Outcome::Stale { current: 3 }]);
}
