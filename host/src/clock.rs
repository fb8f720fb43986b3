//! The node's clocks: a monotonic clock it reads, and sleeps it can take on it.
//!
//! The core reasons in [`fief_core::Instant`]s and never reads a clock; the
//! node reads one through [`NodeClock`], which adds the one thing the outer
//! layer needs besides `now`: sleeping until an instant. Two clocks:
//!
//! - [`TokioClock`]: the OS monotonic clock (through tokio), for production.
//! - [`SteppedClock`]: moves only when a test calls [`SteppedClock::advance`],
//!   waking every sleeper whose instant has come. Tests share one stepped clock
//!   between nodes and the local arbiter to walk a cluster through lease
//!   expiry, fences and takeovers without waiting and without luck, while
//!   sockets and tasks run in real time.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use fief_core::{Clock, Instant, ManualClock};
use tokio::sync::watch;

/// A clock the node can read and sleep on.
///
/// The coordination loop sleeps on a runtime of its own (its thread's), the
/// rest of the node on the node's runtime: a sleep must work on whichever
/// runtime polls it. [`TokioClock`]'s uses the timer of that runtime;
/// [`SteppedClock`]'s is woken by a channel, from any thread.
pub trait NodeClock: Clock {
    /// Resolve once the clock reads `deadline` or later.
    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

/// The OS monotonic clock, through tokio, counted from the clock's creation.
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

impl NodeClock for TokioClock {
    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(tokio::time::sleep_until(
            self.origin + deadline.since_origin(),
        ))
    }
}

/// A clock that only moves when told to. Clones share the same time.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use fief::{NodeClock, SteppedClock};
/// use fief_core::{Clock, Instant};
/// use std::time::Duration;
///
/// let clock = SteppedClock::default();
/// let woken = tokio::spawn({
///     let clock = clock.clone();
///     async move { clock.sleep_until(Instant::ZERO + Duration::from_secs(5)).await }
/// });
/// clock.advance(Duration::from_secs(5));
/// woken.await.unwrap();
/// assert_eq!(clock.now().since_origin(), Duration::from_secs(5));
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct SteppedClock {
    inner: ManualClock,
    ticks: Arc<watch::Sender<Instant>>,
}

impl Default for SteppedClock {
    fn default() -> Self {
        SteppedClock {
            inner: ManualClock::default(),
            ticks: Arc::new(watch::channel(Instant::ZERO).0),
        }
    }
}

impl SteppedClock {
    /// Move the clock forward by `by`, waking sleepers whose time has come.
    pub fn advance(&self, by: Duration) {
        self.inner.advance(by);
        self.ticks.send_replace(self.inner.now());
    }
}

impl Clock for SteppedClock {
    fn now(&self) -> Instant {
        self.inner.now()
    }
}

impl NodeClock for SteppedClock {
    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        let mut ticks = self.ticks.subscribe();
        Box::pin(async move {
            let _ = ticks.wait_for(|now| *now >= deadline).await;
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sleep on a stepped clock taken on one runtime (another thread's)
    /// is woken by `advance` from anywhere, and not before its instant.
    #[test]
    fn a_stepped_clock_wakes_a_sleeper_on_another_runtime() {
        let clock = SteppedClock::default();
        let (woken_tx, woken_rx) = std::sync::mpsc::channel();
        let sleeper = std::thread::spawn({
            let clock = clock.clone();
            move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap();
                runtime.block_on(clock.sleep_until(Instant::ZERO + Duration::from_secs(5)));
                woken_tx.send(clock.now()).unwrap();
            }
        });
        clock.advance(Duration::from_secs(4));
        let early = woken_rx.recv_timeout(Duration::from_millis(100));
        assert!(early.is_err(), "woken before its instant: {early:?}");
        clock.advance(Duration::from_secs(1));
        let woken = woken_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(woken.since_origin(), Duration::from_secs(5));
        sleeper.join().unwrap();
    }
}
