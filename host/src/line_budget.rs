//! A budget of log lines: how the node keeps a line it writes on someone
//! else's behalf — a key's death, a peer connection it refused — at a
//! bounded rate, and says how many it withheld.
//!
//! [`LineBudget`] is a token bucket over lines (a rate per second, a burst):
//! a line over it is withheld and counted, and the next line let through is
//! told how many were withheld since the last one, to note them. The guest's
//! own lines have their own, richer buckets (`guest_log.rs`: bytes too, and
//! per key); this is for the node's lines that anyone outside it can make
//! it write as fast as they can act.
//!
//! A leaf: it decides only whether to log; it must not log or import the
//! crate's other modules beyond `sync` and `token_bucket`.

use std::sync::Mutex;
use std::time::Instant;

use crate::sync::lock;
use crate::token_bucket::TokenBucket;

/// A rate of log lines, with a burst.
pub(crate) struct LineBudget {
    state: Mutex<State>,
}

struct State {
    lines: TokenBucket<Instant>,
    /// Lines withheld since the last one let through.
    withheld: u64,
}

impl LineBudget {
    /// A budget of `per_second` lines a second once a burst of `burst` is
    /// spent.
    pub(crate) fn new(per_second: f64, burst: f64) -> Self {
        LineBudget {
            state: Mutex::new(State {
                lines: TokenBucket::full(per_second, burst, Instant::now()),
                withheld: 0,
            }),
        }
    }

    /// Lines per second once the burst is spent.
    pub(crate) fn per_second(&self) -> f64 {
        lock(&self.state).lines.per_second()
    }

    /// Whether one more line may be logged at `now`: if so, `Some` of how
    /// many were withheld since the last one let through (to note with
    /// it); if not, `None`, and it is counted as withheld.
    pub(crate) fn admit(&self, now: Instant) -> Option<u64> {
        let mut state = lock(&self.state);
        if !state.lines.take_one(now) {
            state.withheld += 1;
            return None;
        }
        Some(std::mem::take(&mut state.withheld))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_passes_then_the_rate_and_the_withheld_are_noted() {
        let lines = LineBudget::new(10.0, 100.0);
        let t0 = Instant::now();
        for _ in 0..100 {
            assert_eq!(lines.admit(t0), Some(0));
        }
        assert_eq!(lines.admit(t0), None);
        assert_eq!(lines.admit(t0), None);
        // 150 ms later one and a half lines are earned: one goes, carrying
        // the two withheld.
        let later = t0 + Duration::from_millis(150);
        assert_eq!(lines.admit(later), Some(2));
        assert_eq!(lines.admit(later), None);
    }
}
