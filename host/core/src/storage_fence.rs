//! The fence rule of durable key state: which commits land and which loads
//! are served, against the partitions' stored *fence tokens*.
//!
//! A store keeps one fence token per partition (0 until a load raised it).
//! Every commit and load names its partition and the ownership token its
//! process was started under:
//!
//! - a **commit** lands only if the partition's stored token equals its own
//!   token; otherwise it is stale and none of its writes is applied;
//! - a **load** is refused as stale when the stored token is already higher
//!   than its own; otherwise it is served and raises the stored token to its
//!   own (a no-op when they are equal).
//!
//! In one round, commits are judged first, on the tokens as stored before
//! the round; then the loads in order, each on the token the loads before
//! it left.
//!
//! This module owns that rule only, on plain values (partition numbers and
//! tokens), so the node's backends (`fief`'s `storage/plan.rs`, inside each
//! backend's transaction) and the simulation's store (`sim/store.rs`) run
//! the very same code. It must not do I/O or read a clock, and it knows
//! nothing of the stores' own types (entries, scopes, tenants, usage).

use std::collections::BTreeMap;

/// A commit or a load was judged stale: the partition's stored fence token
/// is `current`, which is not the one it names (for a load: it is higher).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stale {
    /// The partition's fence token in the store.
    pub current: u64,
}

/// Whether a commit under `token` lands on a partition whose stored fence
/// token is `stored`.
pub fn commit(stored: u64, token: u64) -> Result<(), Stale> {
    if stored == token {
        Ok(())
    } else {
        Err(Stale { current: stored })
    }
}

/// Whether a load under `token` is served on a partition whose stored fence
/// token is `stored`: `Ok(Some(token))` when it raises the stored token to
/// its own, `Ok(None)` when the stored token already is its own.
pub fn load(stored: u64, token: u64) -> Result<Option<u64>, Stale> {
    match stored.cmp(&token) {
        std::cmp::Ordering::Greater => Err(Stale { current: stored }),
        std::cmp::Ordering::Equal => Ok(None),
        std::cmp::Ordering::Less => Ok(Some(token)),
    }
}

/// What the fence check decided for one round.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decisions {
    /// Per commit, in order: `None` if it lands, `Some(current)` if stale.
    pub commits: Vec<Option<u64>>,
    /// Per load, in order: `None` if it is served, `Some(current)` if stale.
    pub loads: Vec<Option<u64>>,
    /// The fence tokens the loads raised: partition → new token.
    pub raised: BTreeMap<u32, u64>,
}

/// The rule of the module header for one round: `commits` and `loads` as
/// (partition, token), in the round's order, on the stored `tokens` (a
/// partition absent from it has token 0).
pub fn decide(
    commits: impl IntoIterator<Item = (u32, u64)>,
    loads: impl IntoIterator<Item = (u32, u64)>,
    tokens: &BTreeMap<u32, u64>,
) -> Decisions {
    let stored = |p: u32| tokens.get(&p).copied().unwrap_or(0);
    let commits = commits
        .into_iter()
        .map(|(p, token)| commit(stored(p), token).err().map(|s| s.current))
        .collect();
    let mut raised = BTreeMap::new();
    let loads = loads
        .into_iter()
        .map(|(p, token)| {
            let current = raised.get(&p).copied().unwrap_or_else(|| stored(p));
            match load(current, token) {
                Err(s) => Some(s.current),
                Ok(raise) => {
                    if let Some(t) = raise {
                        raised.insert(p, t);
                    }
                    None
                }
            }
        })
        .collect();
    Decisions {
        commits,
        loads,
        raised,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commit_lands_only_on_its_own_token() {
        assert_eq!(commit(5, 5), Ok(()));
        assert_eq!(commit(6, 5), Err(Stale { current: 6 }));
        // Never loaded under its token: stale too.
        assert_eq!(commit(4, 5), Err(Stale { current: 4 }));
        assert_eq!(commit(0, 0), Ok(()));
    }

    #[test]
    fn a_load_raises_the_token_unless_it_is_higher() {
        assert_eq!(load(0, 3), Ok(Some(3)));
        assert_eq!(load(3, 3), Ok(None));
        assert_eq!(load(4, 3), Err(Stale { current: 4 }));
    }

    #[test]
    fn a_round_judges_commits_before_loads_and_loads_in_order() {
        let tokens = BTreeMap::from([(1, 5), (2, 7)]);
        let d = decide(
            [(1, 5), (1, 6), (2, 7), (3, 0)],
            [(1, 6), (1, 5), (2, 9), (2, 8), (3, 1)],
            &tokens,
        );
        // The load raising partition 1 to 6 does not make the commit under
        // 6 land: commits are judged on the tokens stored before the round.
        assert_eq!(d.commits, vec![None, Some(5), None, None]);
        // The second load of partition 1 sees the first one's raise.
        assert_eq!(d.loads, vec![None, Some(6), None, Some(9), None]);
        assert_eq!(d.raised, BTreeMap::from([(1, 6), (2, 9), (3, 1)]));
    }
}
