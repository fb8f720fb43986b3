//! The token bucket every rate limit on events is made of: a key's log
//! lines and bytes (`guest_log.rs`), its publications (`sandbox.rs`), a
//! WebSocket's frames (`node/sockets.rs`), the node's lines written on
//! someone else's behalf (`line_budget.rs`). A key's CPU budget is a bucket
//! of its own (`cpu_budget.rs`): it runs into debt, which this one never
//! does.
//!
//! [`TokenBucket`] earns tokens at a rate per second up to a burst, and is
//! spent a token (or a line's bytes) at a time. It reads no clock: its
//! owner passes the instant, on whichever clock it keeps ([`Moment`]: the
//! OS's for logs and sockets, the node's for what a guest does, so that
//! tests can step it).
//!
//! A leaf: it must not import the crate's other modules, log, or lock.

use std::time::Duration;

/// An instant on some monotonic clock: what a bucket needs of it.
pub(crate) trait Moment: Copy {
    /// Time from `earlier` to `self`, zero if `earlier` is later.
    fn since(self, earlier: Self) -> Duration;
}

impl Moment for std::time::Instant {
    fn since(self, earlier: Self) -> Duration {
        self.saturating_duration_since(earlier)
    }
}

impl Moment for fief_core::Instant {
    fn since(self, earlier: Self) -> Duration {
        self.saturating_duration_since(earlier)
    }
}

/// Tokens earned at `per_second`, at most `burst` of them held.
#[derive(Debug)]
pub(crate) struct TokenBucket<I> {
    per_second: f64,
    burst: f64,
    tokens: f64,
    refilled: I,
}

impl<I: Moment> TokenBucket<I> {
    /// A bucket holding its whole burst at `now`.
    pub(crate) fn full(per_second: f64, burst: f64, now: I) -> Self {
        TokenBucket {
            per_second,
            burst,
            tokens: burst,
            refilled: now,
        }
    }

    /// Tokens earned per second.
    pub(crate) fn per_second(&self) -> f64 {
        self.per_second
    }

    /// Add what the time since the last refill earned, up to the burst.
    /// An instant before the last refill (clocks read out of order by two
    /// threads) earns nothing and moves nothing back.
    pub(crate) fn refill(&mut self, now: I) {
        let elapsed = now.since(self.refilled);
        if elapsed.is_zero() {
            return;
        }
        let earned = elapsed.as_secs_f64() * self.per_second;
        self.tokens = (self.tokens + earned).min(self.burst);
        self.refilled = now;
    }

    /// Whether `n` tokens are there to spend (as of the last refill).
    pub(crate) fn holds(&self, n: f64) -> bool {
        self.tokens >= n
    }

    /// Spend `n` tokens the caller found there ([`holds`](Self::holds)).
    pub(crate) fn spend(&mut self, n: f64) {
        self.tokens -= n;
    }

    /// Refill at `now`, then spend one token if there is one: whether there
    /// was.
    pub(crate) fn take_one(&mut self, now: I) -> bool {
        self.refill(now);
        if !self.holds(1.0) {
            return false;
        }
        self.spend(1.0);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_the_rate_never_more_than_the_burst() {
        let t0 = fief_core::Instant::ZERO;
        let mut bucket = TokenBucket::full(10.0, 3.0, t0);
        for _ in 0..3 {
            assert!(bucket.take_one(t0));
        }
        assert!(!bucket.take_one(t0), "the burst is spent");
        // 150 ms earn one and a half tokens: one is taken, half is kept.
        let t1 = t0 + Duration::from_millis(150);
        assert!(bucket.take_one(t1));
        assert!(!bucket.take_one(t1));
        let t2 = t1 + Duration::from_millis(50);
        assert!(bucket.take_one(t2), "the kept half and 50 ms make one");
        // A long pause refills up to the burst, no more.
        let t3 = t2 + Duration::from_secs(60);
        for _ in 0..3 {
            assert!(bucket.take_one(t3));
        }
        assert!(!bucket.take_one(t3));
        // A clock read out of order earns nothing, and moves nothing back
        // for the next refill to earn twice.
        bucket.refill(t2);
        assert!(!bucket.holds(1.0));
        assert!(!bucket.take_one(t3));
    }

    #[test]
    fn a_large_spend_waits_for_its_tokens() {
        let t0 = std::time::Instant::now();
        let mut bytes = TokenBucket::full(1000.0, 1000.0, t0);
        assert!(bytes.holds(600.0));
        bytes.spend(600.0);
        assert!(!bytes.holds(600.0), "400 left");
        bytes.refill(t0 + Duration::from_millis(200));
        assert!(bytes.holds(600.0), "400 + 200 earned");
        assert_eq!(bytes.per_second(), 1000.0);
    }
}
