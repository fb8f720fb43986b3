//! The node's clock: tokio's monotonic clock, read through the core's
//! [`Clock`] trait.
//!
//! In production this is the OS monotonic clock. Under tokio's paused test
//! time (`#[tokio::test(start_paused = true)]`, `tokio::time::advance`) it is
//! stepped by the test, together with every sleep the node does, which is how
//! node-level fence tests control time.

use fief_core::{Clock, Instant};

/// A [`Clock`] over `tokio::time::Instant`, counted from its creation.
#[derive(Clone, Copy, Debug)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

impl TokioClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        TokioClock {
            origin: tokio::time::Instant::now(),
        }
    }

    /// The tokio instant matching a core instant of this clock.
    pub fn to_tokio(&self, instant: Instant) -> tokio::time::Instant {
        self.origin + instant.since_origin()
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        TokioClock::new()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        Instant::from_origin(self.origin.elapsed())
    }
}
