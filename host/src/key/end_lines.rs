//! The node's `warn` lines about a module's keys that died or failed to
//! start, at a bounded rate per module.
//!
//! Each such end is a line (`key died`, `key failed to start`), and a
//! module's keys can end as fast as callers activate them: a tenant calling
//! its own module whose every call traps, over HTTP, made the node write a
//! warning per request. [`EndLines`] lets a module's ends through a token
//! bucket ([`END_LINES_PER_SECOND`], a burst of [`END_LINE_BURST`]); the
//! rest are counted, and the next line let through is preceded by a note of
//! how many were not logged. Every end is still counted in
//! `fief_key_kills_total` (a death) whatever its line.
//!
//! This module decides only whether to log: it must not log, count metrics
//! or touch a key.

use std::sync::Mutex;
use std::time::Instant;

use crate::sync::lock;

/// Lines about ended keys one module may make per second, once its burst
/// is spent.
pub(crate) const END_LINES_PER_SECOND: f64 = 10.0;

/// Lines about ended keys one module may make at once.
pub(crate) const END_LINE_BURST: f64 = 100.0;

/// A module's budget of lines about keys that ended badly.
pub(crate) struct EndLines {
    state: Mutex<State>,
}

struct State {
    tokens: f64,
    refilled: Instant,
    /// Ends not logged since the last line let through.
    withheld: u64,
}

impl Default for EndLines {
    fn default() -> Self {
        EndLines {
            state: Mutex::new(State {
                tokens: END_LINE_BURST,
                refilled: Instant::now(),
                withheld: 0,
            }),
        }
    }
}

impl EndLines {
    /// Whether a line about one more ended key may be logged at `now`: if
    /// so, `Some` of how many were withheld since the last one let through
    /// (to note before it); if not, `None`, and it is counted as withheld.
    pub(crate) fn admit(&self, now: Instant) -> Option<u64> {
        let mut state = lock(&self.state);
        let earned = now.saturating_duration_since(state.refilled).as_secs_f64();
        state.tokens = (state.tokens + earned * END_LINES_PER_SECOND).min(END_LINE_BURST);
        state.refilled = now;
        if state.tokens < 1.0 {
            state.withheld += 1;
            return None;
        }
        state.tokens -= 1.0;
        Some(std::mem::take(&mut state.withheld))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_passes_then_the_rate_and_the_withheld_are_noted() {
        let lines = EndLines::default();
        let t0 = Instant::now();
        for _ in 0..END_LINE_BURST as usize {
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
