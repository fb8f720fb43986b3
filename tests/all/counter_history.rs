//! A linearizability checker for stored counters (issue "Durable per-key
//! state, fenced by the ownership token", item 9).
//!
//! A history is what clients asked one counter key (`incr`, answered with
//! the new value; `get`, answered with the value), each operation with the
//! real time it was invoked and, if an answer came, the real time it came.
//! An `incr` whose outcome is unknown (no answer, a timeout, a node that
//! died, `storage_unavailable`) may have taken effect at any time after it
//! was invoked, or never; a `get` without an answer says nothing and is
//! left out. The history is linearizable if some of the unknown `incr`s and
//! all of the answered operations can be put in one order that respects
//! real time (an operation answered before another was invoked comes first)
//! and in which every answer is what one counter starting at 0 would give.
//!
//! The search is Wing and Gong's with Lowe's memoization, as in
//! `linearizability.rs`. Unknown `incr`s differ only in when they were
//! invoked, so the search only ever places the earliest one not yet
//! placed (any order using a later one can use the earliest instead): a
//! dead end is remembered by the answered operations placed and how many
//! unknown ones, which keeps the search small when many calls time out.

use std::collections::HashSet;
use std::time::Instant;

/// What a client asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Add one; answered with the new value.
    Incr,
    /// Read; answered with the value.
    Get,
}

/// One operation a client ran on the key.
#[derive(Clone, Debug)]
pub struct Event {
    /// Which client ran it (for the report).
    pub client: usize,
    /// The operation.
    pub op: Op,
    /// Its answer, or `None` if its outcome is unknown.
    pub answer: Option<u64>,
    /// When it was invoked.
    pub invoked: Instant,
    /// When its answer came (for an unknown outcome: when the client gave up).
    pub returned: Instant,
}

/// At most this many answered operations per key (the search's set is a
/// `u128`); operations of unknown outcome are not bounded.
pub const MAX_OPS: usize = 128;

/// Check one key's `history`; `Err` shows why it is not linearizable.
pub fn check(history: &[Event]) -> Result<(), String> {
    let answered: Vec<&Event> = history.iter().filter(|e| e.answer.is_some()).collect();
    assert!(
        answered.len() <= MAX_OPS,
        "the checker takes at most {MAX_OPS} answered operations per key, got {}",
        answered.len()
    );
    // An unanswered get constrains nothing; unknown incrs differ only in
    // when they were invoked, so the search places the earliest first.
    let mut unknown: Vec<Instant> = history
        .iter()
        .filter(|e| e.answer.is_none() && e.op == Op::Incr)
        .map(|e| e.invoked)
        .collect();
    unknown.sort();
    let search = Search {
        answered: &answered,
        unknown: &unknown,
    };
    if search.run(0, 0, 0, &mut HashSet::new()) {
        return Ok(());
    }
    let mut events: Vec<&Event> = history.iter().collect();
    events.sort_by_key(|e| e.invoked);
    let origin = events.first().map(|e| e.invoked);
    let at = |t: Instant| origin.map_or(0, |o| t.duration_since(o).as_micros());
    let trace: Vec<String> = events
        .iter()
        .map(|e| {
            format!(
                "  client {} [{:>8} µs .. {:>8} µs] {:?} -> {}",
                e.client,
                at(e.invoked),
                at(e.returned),
                e.op,
                e.answer.map_or("unknown".to_owned(), |v| v.to_string())
            )
        })
        .collect();
    Err(format!(
        "the counter's history of {} operations is not linearizable:\n{}",
        history.len(),
        trace.join("\n")
    ))
}

/// The search over one key's operations.
struct Search<'h> {
    answered: &'h [&'h Event],
    /// When each unknown incr was invoked, earliest first.
    unknown: &'h [Instant],
}

impl Search<'_> {
    /// Can the answered operations not in `done` be placed, `placed`
    /// unknown incrs already placed and the counter at `value`?
    fn run(
        &self,
        done: u128,
        placed: usize,
        value: u64,
        dead_ends: &mut HashSet<(u128, usize)>,
    ) -> bool {
        let pending = || (0..self.answered.len()).filter(|i| done & (1 << i) == 0);
        let Some(first_return) = pending().map(|i| self.answered[i].returned).min() else {
            return true;
        };
        if dead_ends.contains(&(done, placed)) {
            return false;
        }
        for i in pending() {
            let e = self.answered[i];
            let next = match e.op {
                Op::Incr => value + 1,
                Op::Get => value,
            };
            if e.invoked <= first_return
                && e.answer == Some(next)
                && self.run(done | (1 << i), placed, next, dead_ends)
            {
                return true;
            }
        }
        if self
            .unknown
            .get(placed)
            .is_some_and(|invoked| *invoked <= first_return)
            && self.run(done, placed + 1, value + 1, dead_ends)
        {
            return true;
        }
        dead_ends.insert((done, placed));
        false
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn event(t0: Instant, from: u64, to: u64, op: Op, answer: Option<u64>) -> Event {
        Event {
            client: 0,
            op,
            answer,
            invoked: t0 + Duration::from_millis(from),
            returned: t0 + Duration::from_millis(to),
        }
    }

    #[test]
    fn a_lost_acknowledged_increment_is_caught() {
        let t0 = Instant::now();
        let history = [
            event(t0, 0, 1, Op::Incr, Some(1)),
            event(t0, 2, 3, Op::Incr, Some(2)),
            // A failover that lost the second increment.
            event(t0, 4, 5, Op::Get, Some(1)),
        ];
        assert!(check(&history).is_err());
    }

    #[test]
    fn an_increment_answered_twice_with_one_value_is_caught() {
        let t0 = Instant::now();
        let history = [
            event(t0, 0, 3, Op::Incr, Some(1)),
            event(t0, 1, 2, Op::Incr, Some(1)),
        ];
        assert!(check(&history).is_err());
    }

    #[test]
    fn a_stale_read_after_an_answer_is_caught() {
        let t0 = Instant::now();
        let history = [
            event(t0, 0, 1, Op::Incr, Some(1)),
            event(t0, 2, 3, Op::Get, Some(0)),
        ];
        assert!(check(&history).is_err());
    }

    #[test]
    fn an_unknown_increment_may_have_landed_or_not() {
        let t0 = Instant::now();
        let landed = [
            event(t0, 0, 1, Op::Incr, None),
            event(t0, 2, 3, Op::Incr, Some(2)),
        ];
        assert_eq!(check(&landed), Ok(()));
        let lost = [
            event(t0, 0, 1, Op::Incr, None),
            event(t0, 2, 3, Op::Incr, Some(1)),
        ];
        assert_eq!(check(&lost), Ok(()));
        // But not before it was invoked.
        let early = [
            event(t0, 0, 1, Op::Incr, Some(1)),
            event(t0, 2, 3, Op::Get, Some(2)),
            event(t0, 4, 5, Op::Incr, None),
        ];
        assert!(check(&early).is_err());
    }

    #[test]
    fn concurrent_increments_may_take_effect_in_either_order() {
        let t0 = Instant::now();
        let history = [
            event(t0, 0, 10, Op::Incr, Some(2)),
            event(t0, 1, 9, Op::Incr, Some(1)),
            event(t0, 11, 12, Op::Get, Some(2)),
        ];
        assert_eq!(check(&history), Ok(()));
    }
}
