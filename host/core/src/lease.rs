//! A node's lease: the timing rules and the node's own view of it.
//!
//! Contract §2. A node holds one lease in the arbiter, renewed every
//! `renew_interval`. The node measures the lease from the instant it **sent**
//! the last renewal that succeeded, on its own monotonic clock; its *fence
//! point* is `sent + lease_ttl - fence_margin`. The arbiter measures from the
//! instant it **committed** that renewal (`committed >= sent`) and judges expiry
//! at `committed + lease_ttl`. So the node's fence point comes at least
//! `fence_margin` before any other node may take over, less clock-rate drift
//! over one TTL, which [`LeaseTiming::new`] requires the margin to cover.
//!
//! [`Lease`] is the node-side state machine. Once its fence point has passed it
//! is fenced for good: a renewal that succeeds afterwards does not revive it
//! (the arbiter refuses such renewals anyway); the node must rejoin with a new
//! lease.

use std::fmt;
use std::time::Duration;

use crate::time::Instant;

/// Default lease time-to-live (contract §2).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5);
/// Default renewal period.
pub const DEFAULT_RENEW_INTERVAL: Duration = Duration::from_secs(1);
/// Default margin between the node's fence point and the arbiter's expiry.
pub const DEFAULT_FENCE_MARGIN: Duration = Duration::from_secs(1);
/// Default bound on clock-rate drift between a node and the arbiter, in parts
/// per million (1% = 10,000 ppm).
pub const DEFAULT_MAX_CLOCK_DRIFT_PPM: u32 = 10_000;

/// A lease timing configuration that was proven safe when it was built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseTiming {
    lease_ttl: Duration,
    renew_interval: Duration,
    fence_margin: Duration,
    max_clock_drift_ppm: u32,
}

/// Why a timing configuration was refused. The message names the numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimingError(String);

impl TimingError {
    pub(crate) fn new(message: String) -> Self {
        TimingError(message)
    }
}

impl fmt::Display for TimingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TimingError {}

impl LeaseTiming {
    /// Build a timing configuration, refusing one that cannot be safe.
    ///
    /// # Errors
    ///
    /// Refuses, with a message naming the numbers and the rule:
    /// - a zero TTL, renewal interval or margin;
    /// - `fence_margin >= lease_ttl` (the node would fence before it ever
    ///   owned anything);
    /// - `renew_interval > (lease_ttl - fence_margin) / 2` (one lost renewal
    ///   would fence the node);
    /// - a drift bound whose drift over one TTL does not fit inside half the
    ///   margin (the margin must also leave room for the kill and for fence
    ///   callbacks, see [`crate::FenceBudget`]).
    ///
    /// ```
    /// use fief_core::LeaseTiming;
    /// use std::time::Duration;
    ///
    /// let s = Duration::from_secs;
    /// assert!(LeaseTiming::new(s(5), s(1), s(1), 10_000).is_ok());
    /// let err = LeaseTiming::new(s(5), s(1), s(5), 10_000).unwrap_err();
    /// assert!(err.to_string().contains("fence_margin (5s) must be shorter than lease_ttl (5s)"));
    /// ```
    pub fn new(
        lease_ttl: Duration,
        renew_interval: Duration,
        fence_margin: Duration,
        max_clock_drift_ppm: u32,
    ) -> Result<Self, TimingError> {
        let show = |d: Duration| format!("{d:?}");
        if lease_ttl.is_zero() || renew_interval.is_zero() || fence_margin.is_zero() {
            return Err(TimingError::new(format!(
                "lease_ttl ({}), renew_interval ({}) and fence_margin ({}) must all be above zero",
                show(lease_ttl),
                show(renew_interval),
                show(fence_margin)
            )));
        }
        if fence_margin >= lease_ttl {
            return Err(TimingError::new(format!(
                "fence_margin ({}) must be shorter than lease_ttl ({}): the node fences at lease_ttl - fence_margin after each renewal",
                show(fence_margin),
                show(lease_ttl)
            )));
        }
        let window = lease_ttl - fence_margin;
        if renew_interval * 2 > window {
            return Err(TimingError::new(format!(
                "renew_interval ({}) must be at most half of lease_ttl - fence_margin ({} - {} = {}), so that one lost renewal does not fence the node; lower renew_interval or raise lease_ttl",
                show(renew_interval),
                show(lease_ttl),
                show(fence_margin),
                show(window)
            )));
        }
        let timing = LeaseTiming {
            lease_ttl,
            renew_interval,
            fence_margin,
            max_clock_drift_ppm,
        };
        if timing.drift_allowance() * 2 > fence_margin {
            return Err(TimingError::new(format!(
                "clock drift of {} ppm over lease_ttl ({}) is {}, more than half of fence_margin ({}); raise fence_margin or lower the drift bound",
                max_clock_drift_ppm,
                show(lease_ttl),
                show(timing.drift_allowance()),
                show(fence_margin)
            )));
        }
        Ok(timing)
    }

    /// The lease's time-to-live, as the arbiter judges it.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// How often the node renews.
    pub fn renew_interval(&self) -> Duration {
        self.renew_interval
    }

    /// How long before the arbiter's expiry the node fences itself.
    pub fn fence_margin(&self) -> Duration {
        self.fence_margin
    }

    /// The configured bound on clock-rate drift, in parts per million.
    pub fn max_clock_drift_ppm(&self) -> u32 {
        self.max_clock_drift_ppm
    }

    /// How far the node's and the arbiter's clocks may drift apart over one TTL.
    pub fn drift_allowance(&self) -> Duration {
        let nanos = self.lease_ttl.as_nanos() * u128::from(self.max_clock_drift_ppm) / 1_000_000;
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }
}

impl Default for LeaseTiming {
    fn default() -> Self {
        LeaseTiming::new(
            DEFAULT_LEASE_TTL,
            DEFAULT_RENEW_INTERVAL,
            DEFAULT_FENCE_MARGIN,
            DEFAULT_MAX_CLOCK_DRIFT_PPM,
        )
        .expect("the default lease timing is valid")
    }
}

/// A renewal the node has sent and not yet heard back about.
///
/// Carries the send instant, which is what the lease is measured from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "a renewal's outcome must be reported back to the lease"]
pub struct Renewal {
    sent_at: Instant,
}

impl Renewal {
    /// When the renewal was sent, on the node's clock.
    pub fn sent_at(&self) -> Instant {
        self.sent_at
    }
}

/// What the node may do now, according to its lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseStatus {
    /// No renewal has succeeded yet: the node owns nothing.
    Pending,
    /// The lease is current until `fence_point` (exclusive).
    Current {
        /// The first instant at which the node must no longer act.
        fence_point: Instant,
    },
    /// The fence point has passed. Terminal for this lease.
    Fenced {
        /// When it fenced (the fence point it crossed).
        at: Instant,
    },
}

impl LeaseStatus {
    /// True only while the lease is current.
    pub fn is_current(&self) -> bool {
        matches!(self, LeaseStatus::Current { .. })
    }
}

/// The node's view of its own lease.
///
/// ```
/// use fief_core::{Instant, Lease, LeaseStatus, LeaseTiming};
/// use std::time::Duration;
///
/// let mut lease = Lease::new(LeaseTiming::default()); // ttl 5 s, margin 1 s
/// let t0 = Instant::ZERO;
/// let renewal = lease.begin_renewal(t0);
/// lease.renewal_succeeded(renewal, t0 + Duration::from_millis(30));
/// let fence_point = t0 + Duration::from_secs(4);
/// assert_eq!(lease.status(fence_point - Duration::from_nanos(1)), LeaseStatus::Current { fence_point });
/// assert_eq!(lease.status(fence_point), LeaseStatus::Fenced { at: fence_point });
/// ```
#[derive(Clone, Debug)]
pub struct Lease {
    timing: LeaseTiming,
    last_good_send: Option<Instant>,
    last_attempt: Option<Instant>,
    fenced_at: Option<Instant>,
    /// Renewals settled so far (for metrics).
    renewals: RenewalCounts,
    /// A renewal was sent and has not succeeded yet.
    outstanding: bool,
    /// Test-only fault (the simulation's mutation check): fence at
    /// `sent + ttl`, without the margin. False in every real build.
    fence_at_ttl: bool,
}

/// How many renewals (the registration included) a [`Lease`] has seen
/// settle: accepted by the arbiter before the fence point, or failed (never
/// answered well before the next attempt or the fence, or answered too late).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RenewalCounts {
    /// Renewals the arbiter accepted in time.
    pub ok: u64,
    /// Renewals that failed, timed out or came back after the fence point.
    pub failed: u64,
}

impl Lease {
    /// A lease that has not been granted yet.
    pub fn new(timing: LeaseTiming) -> Self {
        Lease {
            timing,
            last_good_send: None,
            last_attempt: None,
            fenced_at: None,
            renewals: RenewalCounts::default(),
            outstanding: false,
            fence_at_ttl: false,
        }
    }

    /// Mutation for the simulation's checker test: fence at `sent + ttl`
    /// instead of `sent + ttl - margin`. Never used outside tests.
    #[cfg(any(test, feature = "sim"))]
    pub fn mutate_fence_at_ttl(&mut self) {
        self.fence_at_ttl = true;
    }

    /// The timing this lease runs under.
    pub fn timing(&self) -> &LeaseTiming {
        &self.timing
    }

    /// Record that a renewal (or the initial registration) is being sent now.
    pub fn begin_renewal(&mut self, now: Instant) -> Renewal {
        self.last_attempt = Some(now);
        if std::mem::replace(&mut self.outstanding, true) {
            // The previous renewal never succeeded: it failed.
            self.renewals.failed += 1;
        }
        Renewal { sent_at: now }
    }

    /// Record that the arbiter accepted `renewal`. Returns the new status.
    ///
    /// A success that arrives after the fence point does not revive the lease.
    pub fn renewal_succeeded(&mut self, renewal: Renewal, now: Instant) -> LeaseStatus {
        // Observe the fence first: if it passed while the renewal was in
        // flight, the lease is dead whatever the answer says.
        let status = self.status(now);
        if matches!(status, LeaseStatus::Fenced { .. }) {
            return status;
        }
        if std::mem::replace(&mut self.outstanding, false) {
            self.renewals.ok += 1;
        }
        let newer = self.last_good_send.is_none_or(|t| renewal.sent_at > t);
        if newer {
            self.last_good_send = Some(renewal.sent_at);
        }
        self.status(now)
    }

    /// The fence point of the lease as it stands, if any renewal succeeded.
    pub fn fence_point(&self) -> Option<Instant> {
        let margin = if self.fence_at_ttl {
            Duration::ZERO
        } else {
            self.timing.fence_margin
        };
        self.last_good_send
            .map(|sent| sent + self.timing.lease_ttl - margin)
    }

    /// The fence point while the lease may still be current: `None` before
    /// any renewal succeeded and once the lease is fenced. (Whether `now`
    /// has reached it is for the caller to compare; see [`FenceGate`].)
    pub fn current_until(&self) -> Option<Instant> {
        match self.fenced_at {
            Some(_) => None,
            None => self.fence_point(),
        }
    }

    /// When the next renewal should be sent.
    pub fn next_renewal_at(&self) -> Instant {
        match self.last_attempt {
            Some(t) => t + self.timing.renew_interval,
            None => Instant::ZERO,
        }
    }

    /// The lease's status at `now`. Once fenced, always fenced.
    pub fn status(&mut self, now: Instant) -> LeaseStatus {
        if let Some(at) = self.fenced_at {
            return LeaseStatus::Fenced { at };
        }
        match self.fence_point() {
            None => LeaseStatus::Pending,
            Some(fence_point) if now >= fence_point => {
                self.fenced_at = Some(fence_point);
                LeaseStatus::Fenced { at: fence_point }
            }
            Some(fence_point) => LeaseStatus::Current { fence_point },
        }
    }

    /// Renewals settled so far; one still in flight is in neither count.
    pub fn renewal_counts(&self) -> RenewalCounts {
        self.renewals
    }

    /// Take the renewal counts (a renewal still in flight counts as failed:
    /// the lease is being given up) and start again from zero. The node
    /// calls this when it fences, before it replaces the lease.
    pub fn take_renewal_counts(&mut self) -> RenewalCounts {
        if std::mem::replace(&mut self.outstanding, false) {
            self.renewals.failed += 1;
        }
        std::mem::take(&mut self.renewals)
    }

    /// Fence now, whatever the timing says (the node's coordination crashed,
    /// or an operator asked). Terminal.
    pub fn fence_now(&mut self, now: Instant) {
        if self.fenced_at.is_none() {
            self.fenced_at = Some(now);
        }
    }
}

/// A lease's fence point, published for readers that must not wait for
/// the lock around the lease's owner: the side-effect gate of every host
/// import and the epoch callback of every running guest ask it on every
/// check. The owner ([`crate::Coordinator`]) publishes after every change
/// it makes to its lease, inside the same `&mut` call, so a reader never
/// sees a lease as current after the owner has fenced it.
///
/// It holds the fence point as nanoseconds since the clock's origin, or 0
/// when the lease is not current (pending or fenced); a fence point is
/// never at the origin (it is at least `lease_ttl - fence_margin` after it).
///
/// ```
/// use fief_core::lease::FenceGate;
/// use fief_core::Instant;
/// use std::time::Duration;
///
/// let gate = FenceGate::default();
/// assert_eq!(gate.current_until(), None);
/// let fence_point = Instant::from_origin(Duration::from_secs(4));
/// gate.publish(Some(fence_point));
/// // Current strictly before the fence point, never at or after it.
/// let current = |now: Instant| gate.current_until().is_some_and(|until| now < until);
/// assert!(current(fence_point - Duration::from_nanos(1)));
/// assert!(!current(fence_point));
/// gate.publish(None);
/// assert!(!current(Instant::ZERO));
/// ```
#[derive(Debug, Default)]
pub struct FenceGate(std::sync::atomic::AtomicU64);

impl FenceGate {
    /// Publish the lease's [`Lease::current_until`].
    pub fn publish(&self, current_until: Option<Instant>) {
        let nanos = current_until.map_or(0, |until| {
            u64::try_from(until.since_origin().as_nanos())
                .unwrap_or(u64::MAX)
                .max(1)
        });
        self.0.store(nanos, std::sync::atomic::Ordering::SeqCst);
    }

    /// The published fence point; `None` if the lease is not current. Read
    /// it *before* reading the clock to compare with, so that the reading is
    /// never older than the fence point it is compared with.
    pub fn current_until(&self) -> Option<Instant> {
        match self.0.load(std::sync::atomic::Ordering::SeqCst) {
            0 => None,
            nanos => Some(Instant::from_origin(Duration::from_nanos(nanos))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn renewals_are_counted_ok_or_failed() {
        let mut lease = Lease::new(LeaseTiming::default());
        let t0 = Instant::ZERO;
        let first = lease.begin_renewal(t0);
        lease.renewal_succeeded(first, t0 + ms(10));
        // Sent, never answered, superseded by the next attempt: failed.
        let _lost = lease.begin_renewal(t0 + ms(1000));
        let third = lease.begin_renewal(t0 + ms(2000));
        lease.renewal_succeeded(third, t0 + ms(2010));
        assert_eq!(lease.renewal_counts(), RenewalCounts { ok: 2, failed: 1 });
        // One in flight when the lease is given up counts as failed.
        let _in_flight = lease.begin_renewal(t0 + ms(3000));
        assert_eq!(
            lease.take_renewal_counts(),
            RenewalCounts { ok: 2, failed: 2 }
        );
        assert_eq!(lease.renewal_counts(), RenewalCounts::default());
        // An answer after the fence point is a failure too.
        let late = lease.begin_renewal(t0 + ms(3500));
        lease.renewal_succeeded(late, t0 + ms(9000));
        assert_eq!(
            lease.take_renewal_counts(),
            RenewalCounts { ok: 0, failed: 1 }
        );
    }

    #[test]
    fn timing_rules_name_the_numbers() {
        let err = LeaseTiming::new(ms(5000), ms(2500), ms(1000), 0).unwrap_err();
        assert!(err.to_string().contains("renew_interval (2.5s)"), "{err}");
        let err = LeaseTiming::new(ms(0), ms(1), ms(1), 0).unwrap_err();
        assert!(err.to_string().contains("above zero"), "{err}");
        let err = LeaseTiming::new(ms(5000), ms(1000), ms(100), 50_000).unwrap_err();
        assert!(err.to_string().contains("50000 ppm"), "{err}");
    }

    #[test]
    fn fence_point_is_measured_from_the_send_instant() {
        let mut lease = Lease::new(LeaseTiming::default());
        let sent = Instant::ZERO + ms(100);
        let r = lease.begin_renewal(sent);
        // The answer arrives late: the fence point still counts from `sent`.
        lease.renewal_succeeded(r, sent + ms(900));
        assert_eq!(lease.fence_point(), Some(sent + ms(4000)));
    }

    #[test]
    fn an_old_success_never_moves_the_fence_point_back() {
        let mut lease = Lease::new(LeaseTiming::default());
        let a = lease.begin_renewal(Instant::ZERO);
        let b = lease.begin_renewal(Instant::ZERO + ms(1000));
        lease.renewal_succeeded(b, Instant::ZERO + ms(1010));
        lease.renewal_succeeded(a, Instant::ZERO + ms(1020));
        assert_eq!(lease.fence_point(), Some(Instant::ZERO + ms(5000)));
    }

    #[test]
    fn fenced_is_terminal() {
        let mut lease = Lease::new(LeaseTiming::default());
        let r = lease.begin_renewal(Instant::ZERO);
        lease.renewal_succeeded(r, Instant::ZERO);
        let late = lease.begin_renewal(Instant::ZERO + ms(3900));
        // The fence point (4 s) passes before the answer arrives.
        let status = lease.renewal_succeeded(late, Instant::ZERO + ms(4100));
        assert_eq!(
            status,
            LeaseStatus::Fenced {
                at: Instant::ZERO + ms(4000)
            }
        );
        assert!(!lease.status(Instant::ZERO + ms(4200)).is_current());
    }

    #[test]
    fn pending_until_the_first_success() {
        let mut lease = Lease::new(LeaseTiming::default());
        assert_eq!(lease.status(Instant::ZERO), LeaseStatus::Pending);
        let _ = lease.begin_renewal(Instant::ZERO);
        assert_eq!(lease.status(Instant::ZERO + ms(1)), LeaseStatus::Pending);
    }

    #[test]
    fn fence_now_is_terminal() {
        let mut lease = Lease::new(LeaseTiming::default());
        let r = lease.begin_renewal(Instant::ZERO);
        lease.renewal_succeeded(r, Instant::ZERO);
        lease.fence_now(Instant::ZERO + ms(10));
        assert_eq!(
            lease.status(Instant::ZERO + ms(11)),
            LeaseStatus::Fenced {
                at: Instant::ZERO + ms(10)
            }
        );
    }
}
