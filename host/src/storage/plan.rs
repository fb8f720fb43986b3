//! The decisions of one round that every backend takes the same way, on
//! values it has read (and locked) in the round's transaction: which commits
//! land and which loads (of keys and of partitions' alarms) are stale against
//! the partitions' fence tokens, which tokens the loads raise (the rule itself is the core's
//! `fief_core::storage_fence`, which the simulation's store runs too), and
//! the tenants' usage after each commit. It owns only these pure functions;
//! it must not read or write a store (the backends do, in their
//! transaction).

use std::collections::BTreeMap;

use fief_core::storage_fence;

use super::{Commit, Loaded, Outcome, Round, RoundResult, StoredAlarm};

/// What the fence check decided for one round.
#[derive(Debug, Default)]
pub(super) struct Decisions {
    /// Per commit, in order: `None` if it lands, `Some(current)` if stale.
    pub commits: Vec<Option<u64>>,
    /// Per load, in order: `None` if it is served, `Some(current)` if stale.
    pub loads: Vec<Option<u64>>,
    /// Per partition's alarm load, in order, as for `loads`.
    pub partition_alarms: Vec<Option<u64>>,
    /// The fence tokens the loads raised: partition → new token.
    pub raised: BTreeMap<u32, u64>,
}

impl Decisions {
    /// The commits that land, in order.
    pub fn landed<'r>(&self, round: &'r Round) -> impl Iterator<Item = &'r Commit> {
        round
            .commits
            .iter()
            .zip(&self.commits)
            .filter(|(_, stale)| stale.is_none())
            .map(|(commit, _)| commit)
    }

    /// The partitions whose alarm loads are served, in order.
    pub fn alarm_partitions(&self, round: &Round) -> Vec<u32> {
        round
            .partition_alarms
            .iter()
            .zip(&self.partition_alarms)
            .filter(|(_, stale)| stale.is_none())
            .map(|(fence, _)| fence.partition)
            .collect()
    }
}

/// Every partition the round touches, ascending and without repeats (the
/// order in which a backend locks their fence rows).
pub(super) fn partitions(round: &Round) -> Vec<u32> {
    let mut out: Vec<u32> = round
        .commits
        .iter()
        .map(|c| c.fence.partition)
        .chain(round.loads.iter().map(|l| l.fence.partition))
        .chain(round.partition_alarms.iter().map(|f| f.partition))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// The fence check, on the stored `tokens` (a partition absent from it has
/// token 0): the core's rule (`fief_core::storage_fence`, which the
/// simulation's store runs too) — commits first, each landing only on its
/// own token; then loads in order, each refused when the token is already
/// higher and raising it otherwise: the key loads, then the partitions'
/// alarm loads, which are loads like any other.
pub(super) fn decide(round: &Round, tokens: &BTreeMap<u32, u64>) -> Decisions {
    let d = storage_fence::decide(
        round
            .commits
            .iter()
            .map(|c| (c.fence.partition, c.fence.token)),
        round
            .loads
            .iter()
            .map(|l| l.fence)
            .chain(round.partition_alarms.iter().copied())
            .map(|f| (f.partition, f.token)),
        tokens,
    );
    let mut loads = d.loads;
    let partition_alarms = loads.split_off(round.loads.len());
    Decisions {
        commits: d.commits,
        loads,
        partition_alarms,
        raised: d.raised,
    }
}

/// Every tenant whose usage the landed commits change, ascending and without
/// repeats (the order in which a backend locks their usage rows).
pub(super) fn landed_tenants(round: &Round, decisions: &Decisions) -> Vec<String> {
    let mut out: Vec<String> = decisions
        .landed(round)
        .map(|c| c.scope.tenant().to_owned())
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// A tenant's usage after a commit of `delta` bytes (never below zero nor
/// past `u64::MAX`).
pub(super) fn add(bytes: u64, delta: i64) -> u64 {
    bytes.saturating_add_signed(delta)
}

/// Apply the landed commits' byte deltas in order to `usage` (tenant →
/// bytes; a tenant absent from it has 0): the tenant's usage after each
/// commit, `None` for a stale one.
pub(super) fn usage_after(
    round: &Round,
    decisions: &Decisions,
    usage: &mut BTreeMap<String, u64>,
) -> Vec<Option<u64>> {
    round
        .commits
        .iter()
        .zip(&decisions.commits)
        .map(|(c, stale)| {
            if stale.is_some() {
                return None;
            }
            let bytes = usage.entry(c.scope.tenant().to_owned()).or_insert(0);
            *bytes = add(*bytes, c.bytes_delta);
            Some(*bytes)
        })
        .collect()
}

/// The round's answer: the commits' outcomes from `decisions` and
/// `after` (see [`usage_after`]), the loads' from `decisions` and
/// `loaded` (one per served load, in order), and the partitions' alarm
/// loads' from `decisions` and `alarms` (one per served one, in order).
pub(super) fn result(
    decisions: &Decisions,
    after: Vec<Option<u64>>,
    loaded: impl IntoIterator<Item = Loaded>,
    alarms: impl IntoIterator<Item = Vec<StoredAlarm>>,
) -> RoundResult {
    let commits = decisions
        .commits
        .iter()
        .zip(after)
        .map(|(stale, bytes)| match (stale, bytes) {
            (None, Some(bytes)) => Outcome::Done(bytes),
            (stale, _) => Outcome::Stale {
                current: stale.unwrap_or(0),
            },
        })
        .collect();
    RoundResult {
        commits,
        loads: answers(&decisions.loads, loaded),
        partition_alarms: answers(&decisions.partition_alarms, alarms),
    }
}

/// Per load: `Stale` as decided, or the next of `served`.
fn answers<T: Default>(
    decided: &[Option<u64>],
    served: impl IntoIterator<Item = T>,
) -> Vec<Outcome<T>> {
    let mut served = served.into_iter();
    decided
        .iter()
        .map(|stale| match stale {
            Some(current) => Outcome::Stale { current: *current },
            None => Outcome::Done(served.next().unwrap_or_default()),
        })
        .collect()
}

/// The first string after every string that starts with `prefix`, in byte
/// order (`None`: no such bound, every later string starts with it). UTF-8
/// never holds `0xff`, so incrementing the last byte is enough; the result
/// may not be UTF-8 and is meant for byte comparisons only.
pub(super) fn prefix_end(prefix: &str) -> Option<Vec<u8>> {
    let mut end = prefix.as_bytes().to_vec();
    let last = end.pop()?;
    end.push(last + 1);
    Some(end)
}
