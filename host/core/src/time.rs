//! Time as the core sees it: a monotonic [`Instant`] passed in by the caller.
//!
//! The core never reads a clock. The node's outer layer reads one through the
//! [`Clock`] trait (a monotonic system clock in production, a [`ManualClock`]
//! stepped by hand in tests and simulation) and passes the reading to the core.
//! Contract §2: a node measures its lease on its own monotonic clock.

use std::ops::{Add, Sub};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A point on one node's monotonic clock, as an offset from that clock's origin.
///
/// Instants from different clocks are not comparable; the core only ever
/// compares instants of the node that produced them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(Duration);

impl Instant {
    /// The clock's origin.
    pub const ZERO: Instant = Instant(Duration::ZERO);

    /// The instant `since_origin` after the clock's origin.
    pub const fn from_origin(since_origin: Duration) -> Self {
        Instant(since_origin)
    }

    /// Time since the clock's origin.
    pub const fn since_origin(self) -> Duration {
        self.0
    }

    /// Time from `earlier` to `self`, or zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        self.0.saturating_sub(earlier.0)
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, rhs: Duration) -> Instant {
        Instant(self.0 + rhs)
    }
}

impl Sub<Duration> for Instant {
    type Output = Instant;
    fn sub(self, rhs: Duration) -> Instant {
        Instant(self.0.saturating_sub(rhs))
    }
}

/// A monotonic clock. Implemented outside the core.
pub trait Clock: Send + Sync + 'static {
    /// The current instant. Never goes backwards.
    fn now(&self) -> Instant;
}

/// A clock that moves only when told to: for tests and simulation.
///
/// Clones share the same time.
///
/// ```
/// use fief_core::{Clock, ManualClock};
/// use std::time::Duration;
///
/// let clock = ManualClock::default();
/// clock.advance(Duration::from_millis(1500));
/// assert_eq!(clock.now().since_origin(), Duration::from_millis(1500));
/// ```
#[derive(Clone, Debug, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// Move the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(by, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        Instant(Duration::from_nanos(self.nanos.load(Ordering::SeqCst)))
    }
}
