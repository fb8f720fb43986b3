//! A linearizability checker for the coherent cache's single-key histories
//! (issue "Coherent single-owner cache", item 5).
//!
//! A history is the operations clients ran on one cache key, each with the
//! real time it was invoked and the real time its answer came back. It is
//! linearizable if the operations can be put in one order that respects real
//! time (an operation that returned before another was invoked comes first)
//! and in which every answer is what a single register with versions would
//! have answered. The search is Wing and Gong's, with the memoization of
//! Lowe ("Testing for linearizability", 2017): depth first over the
//! operations that may go next, remembering (linearized set, state) pairs
//! already found to be dead ends.
//!
//! The register's model: an optional `(value, version)`; a write's version
//! must be above every version the key ever had (so a compare-and-set with an
//! old version can never match a newer value), reads see exactly the state,
//! and a conditional write or delete succeeds exactly when its condition
//! holds, else reports the current version.

use std::collections::HashSet;
use std::time::Instant;

use fief::cache::Expect;

/// What a client asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `get`.
    Get,
    /// `put` of a value under a precondition.
    Put { value: String, expect: Expect },
    /// `delete` under a precondition.
    Delete { expect: Expect },
}

/// What the client got back (only definite answers: a history with an
/// operation of unknown outcome is not checked here).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// A read's result.
    Read(Option<(String, u64)>),
    /// A write's new version.
    Written(u64),
    /// A delete's result: whether there was an entry.
    Deleted(bool),
    /// The precondition did not hold; the current version.
    Conflict(Option<u64>),
}

/// One completed operation.
#[derive(Clone, Debug)]
pub struct Event {
    /// Which client ran it (for the report).
    pub client: usize,
    /// The operation.
    pub op: Op,
    /// Its answer.
    pub answer: Answer,
    /// When it was invoked.
    pub invoked: Instant,
    /// When its answer arrived.
    pub returned: Instant,
}

/// The register's state: the entry, and the highest version ever written.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
struct Register {
    entry: Option<(String, u64)>,
    highest: u64,
}

impl Register {
    /// Apply `op`; `Some(next state)` if `answer` is what the register
    /// answers, `None` if it is impossible here.
    fn step(&self, op: &Op, answer: &Answer) -> Option<Register> {
        let current = self.entry.as_ref().map(|(_, v)| *v);
        let holds = |expect: &Expect| match expect {
            Expect::Any => true,
            Expect::Absent => current.is_none(),
            Expect::Version(v) => current == Some(*v),
        };
        match (op, answer) {
            (Op::Get, Answer::Read(seen)) => (seen == &self.entry).then(|| self.clone()),
            (Op::Put { value, expect }, Answer::Written(version)) => {
                (holds(expect) && *version > self.highest).then(|| Register {
                    entry: Some((value.clone(), *version)),
                    highest: *version,
                })
            }
            (Op::Delete { expect }, Answer::Deleted(existed)) => {
                (holds(expect) && *existed == current.is_some()).then_some(Register {
                    entry: None,
                    highest: self.highest,
                })
            }
            (Op::Put { expect, .. } | Op::Delete { expect }, Answer::Conflict(reported)) => {
                (!holds(expect) && *reported == current).then(|| self.clone())
            }
            _ => None,
        }
    }
}

/// Check `history` (one key's operations); `Err` describes why it is not
/// linearizable.
pub fn check(history: &[Event]) -> Result<(), String> {
    assert!(
        history.len() <= 128,
        "the checker takes at most 128 operations per key, got {}",
        history.len()
    );
    let mut dead_ends = HashSet::new();
    if search(history, 0, &Register::default(), &mut dead_ends) {
        return Ok(());
    }
    let mut events: Vec<&Event> = history.iter().collect();
    events.sort_by_key(|e| e.invoked);
    let origin = events.first().map(|e| e.invoked);
    let trace: Vec<String> = events
        .iter()
        .map(|e| {
            let at = |t: Instant| origin.map_or(0, |o| t.duration_since(o).as_micros());
            format!(
                "  client {} [{:>8} µs .. {:>8} µs] {:?} -> {:?}",
                e.client,
                at(e.invoked),
                at(e.returned),
                e.op,
                e.answer
            )
        })
        .collect();
    Err(format!(
        "the history of {} operations is not linearizable:\n{}",
        history.len(),
        trace.join("\n")
    ))
}

/// Depth-first search: can the operations not in `done` be linearized from
/// `state`?
fn search(
    history: &[Event],
    done: u128,
    state: &Register,
    dead_ends: &mut HashSet<(u128, Register)>,
) -> bool {
    let all = if history.len() == 128 {
        u128::MAX
    } else {
        (1u128 << history.len()) - 1
    };
    if done == all {
        return true;
    }
    if dead_ends.contains(&(done, state.clone())) {
        return false;
    }
    // An operation may go next if it was invoked before every pending
    // operation returned (none of them must precede it).
    let pending = || (0..history.len()).filter(|i| done & (1 << i) == 0);
    let first_return = pending()
        .map(|i| history[i].returned)
        .min()
        .expect("some operation is pending");
    for i in pending() {
        let event = &history[i];
        if event.invoked > first_return {
            continue;
        }
        if let Some(next) = state.step(&event.op, &event.answer)
            && search(history, done | (1 << i), &next, dead_ends)
        {
            return true;
        }
    }
    dead_ends.insert((done, state.clone()));
    false
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// An event invoked at `from` ms and answered at `to` ms after `t0`.
    fn event(t0: Instant, from: u64, to: u64, op: Op, answer: Answer) -> Event {
        Event {
            client: 0,
            op,
            answer,
            invoked: t0 + Duration::from_millis(from),
            returned: t0 + Duration::from_millis(to),
        }
    }

    fn put(value: &str) -> Op {
        Op::Put {
            value: value.to_owned(),
            expect: Expect::Any,
        }
    }

    fn read(value: &str, version: u64) -> Answer {
        Answer::Read(Some((value.to_owned(), version)))
    }

    #[test]
    fn concurrent_operations_may_take_effect_in_either_order() {
        let t0 = Instant::now();
        // Two overlapping writes, then reads that saw `b` and then `a`...
        // impossible; but a read overlapping both may see either.
        let history = vec![
            event(t0, 0, 10, put("a"), Answer::Written(1)),
            event(t0, 5, 15, put("b"), Answer::Written(2)),
            event(t0, 6, 8, Op::Get, read("a", 1)),
            event(t0, 20, 25, Op::Get, read("b", 2)),
        ];
        check(&history).expect("linearizable: a, read, b, read");
    }

    #[test]
    fn a_stale_read_after_a_completed_write_is_caught() {
        let t0 = Instant::now();
        let history = vec![
            event(t0, 0, 10, put("a"), Answer::Written(1)),
            event(t0, 20, 30, put("b"), Answer::Written(2)),
            event(t0, 40, 50, Op::Get, read("a", 1)),
        ];
        let err = check(&history).expect_err("the read must see b");
        assert!(err.contains("not linearizable"), "{err}");
    }

    #[test]
    fn a_lost_update_is_caught() {
        // Two compare-and-sets from the same version cannot both succeed.
        let t0 = Instant::now();
        let cas = |value: &str| Op::Put {
            value: value.to_owned(),
            expect: Expect::Version(1),
        };
        let history = vec![
            event(t0, 0, 5, put("a"), Answer::Written(1)),
            event(t0, 10, 20, cas("b"), Answer::Written(2)),
            event(t0, 10, 20, cas("c"), Answer::Written(3)),
        ];
        assert!(check(&history).is_err());
    }

    #[test]
    fn a_version_that_does_not_rise_is_caught() {
        // After a delete, a new write must still get a higher version.
        let t0 = Instant::now();
        let history = vec![
            event(t0, 0, 5, put("a"), Answer::Written(7)),
            event(
                t0,
                10,
                15,
                Op::Delete {
                    expect: Expect::Any,
                },
                Answer::Deleted(true),
            ),
            event(t0, 20, 25, put("b"), Answer::Written(7)),
        ];
        assert!(check(&history).is_err());
    }

    #[test]
    fn conflicts_must_report_the_current_version() {
        let t0 = Instant::now();
        let absent = Op::Put {
            value: "x".to_owned(),
            expect: Expect::Absent,
        };
        let good = vec![
            event(t0, 0, 5, put("a"), Answer::Written(1)),
            event(t0, 10, 15, absent.clone(), Answer::Conflict(Some(1))),
        ];
        check(&good).expect("the conflict is right");
        let bad = vec![
            event(t0, 0, 5, put("a"), Answer::Written(1)),
            event(t0, 10, 15, absent, Answer::Conflict(None)),
        ];
        assert!(check(&bad).is_err());
    }
}
