//! CPU budgets over time: how much of a core one key may use over a sliding
//! window (issue 16 finding 9), and the meter that measures what it used.
//!
//! `cpu_limit` bounds one callback; nothing bounded a key that runs many
//! short ones (a timer re-armed at 0 ms ran 300k callbacks a second and used
//! a core forever). This module owns the per-key [`CpuBudget`]: a token
//! bucket of CPU time that fills at the module's `cpu_budget` (a
//! [`CpuShare`] of one core) up to one `cpu_budget_window`'s worth, and that
//! every nanosecond the key's guest code runs drains. A key whose bucket is
//! empty is *throttled*: its next callback (or the rest of the running one,
//! at its next epoch tick) waits until the bucket is back at zero. It is
//! never killed for it. So over any window of length `W` a key uses at most
//! `cpu_budget × W` plus one slice (an epoch tick, or one callback shorter
//! than a tick) of CPU.
//!
//! The meter ([`poll_metered`]) times every poll of the key's task, and of an
//! inline call on its caller's task: guest code, the host imports it calls
//! and the host's work on the key's messages run inside those polls; time
//! the key spends waiting (on a host call to another key, for its turn, for
//! its budget, for a message) is outside them and is not charged.
//! The time is wall-clock time inside the poll, so a thread the OS preempts
//! is charged its wait too: a key is throttled early under CPU contention,
//! never late.
//!
//! This module must not decide who runs next among keys that are all within
//! their budgets: that is [`crate::scheduler`]'s fair share.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::metrics::SecondsCounter;

/// A share of one core, in thousandths (millicores): `250m` is a quarter of
/// a core. Written `250m`, `0.25`, `25%` or `1`; between `1m` and `1`
/// (`1000m`, a whole core: a key runs one callback at a time, so it never
/// uses more, and a budget of a whole core throttles nothing).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct CpuShare(u32);

impl CpuShare {
    /// A whole core: no throttling.
    pub const WHOLE_CORE: CpuShare = CpuShare(1000);

    /// A share of `millicores` thousandths of a core.
    ///
    /// # Errors
    ///
    /// A message naming the value when it is not between 1 and 1000.
    pub fn from_millicores(millicores: u32) -> Result<CpuShare, String> {
        if (1..=1000).contains(&millicores) {
            Ok(CpuShare(millicores))
        } else {
            Err(format!(
                "a CPU share of {millicores}m is not between 1m and 1000m (one whole core)"
            ))
        }
    }

    /// The share in thousandths of a core.
    pub fn millicores(self) -> u32 {
        self.0
    }
}

impl std::str::FromStr for CpuShare {
    type Err = String;

    fn from_str(text: &str) -> Result<CpuShare, String> {
        let t = text.trim();
        let bad = || {
            format!(
                "{text:?} is not a CPU share; write thousandths of a core (250m), a fraction \
                 (0.25) or a percentage (25%), between 1m and one core (1)"
            )
        };
        let millicores = if let Some(m) = t.strip_suffix('m') {
            m.parse::<u32>().map_err(|_| bad())?
        } else {
            let (number, scale) = match t.strip_suffix('%') {
                Some(p) => (p, 10.0),
                None => (t, 1000.0),
            };
            let value: f64 = number.parse().map_err(|_| bad())?;
            if !value.is_finite() || value < 0.0 {
                return Err(bad());
            }
            (value * scale).round().min(f64::from(u32::MAX)) as u32
        };
        CpuShare::from_millicores(millicores)
    }
}

impl std::fmt::Display for CpuShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}m", self.0)
    }
}

impl std::fmt::Debug for CpuShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl TryFrom<String> for CpuShare {
    type Error = String;
    fn try_from(text: String) -> Result<CpuShare, String> {
        text.parse()
    }
}

impl From<CpuShare> for String {
    fn from(share: CpuShare) -> String {
        share.to_string()
    }
}

/// What a key's guest code has used, moved by [`metered`] while the store
/// is borrowed by the call (so it lives beside the store, not in it).
pub(crate) struct CpuMeter {
    used_nanos: AtomicU64,
    /// The module's `fief_key_cpu_seconds_total`.
    module_used: SecondsCounter,
    /// The module's `fief_key_throttled_seconds_total`.
    module_throttled: SecondsCounter,
}

impl CpuMeter {
    /// A meter that also moves its module's counters.
    pub(crate) fn new((module_used, module_throttled): (SecondsCounter, SecondsCounter)) -> Self {
        CpuMeter {
            used_nanos: AtomicU64::new(0),
            module_used,
            module_throttled,
        }
    }

    /// Guest time used so far, in nanoseconds.
    pub(crate) fn used_nanos(&self) -> u64 {
        self.used_nanos.load(Ordering::Relaxed)
    }

    fn charge(&self, spent: Duration) {
        let nanos = u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX);
        self.used_nanos.fetch_add(nanos, Ordering::Relaxed);
        self.module_used.inc_by(spent.as_secs_f64());
    }

    /// The key waited `waited` for its budget.
    pub(crate) fn throttled(&self, waited: Duration) {
        self.module_throttled.inc_by(waited.as_secs_f64());
    }
}

/// Poll `work` once, charging the time spent to `meter`.
pub(crate) fn poll_metered<F: Future + ?Sized>(
    meter: &CpuMeter,
    work: Pin<&mut F>,
    cx: &mut std::task::Context<'_>,
) -> std::task::Poll<F::Output> {
    let start = Instant::now();
    let poll = work.poll(cx);
    meter.charge(start.elapsed());
    poll
}

/// A key's CPU budget: a token bucket of CPU time (see the module header).
pub(crate) struct CpuBudget {
    /// Nanoseconds of CPU per second of wall time, in thousandths.
    millicores: u64,
    /// The most credit the bucket holds: one window's worth.
    capacity_nanos: i64,
    /// Credit at `at`, in nanoseconds; below zero the key is throttled.
    credit_nanos: i64,
    at: Instant,
    /// The meter's reading folded into `credit_nanos`.
    charged_nanos: u64,
}

impl CpuBudget {
    /// The budget of `share` over `window`, full at `now`; `None` for a whole
    /// core (nothing to throttle).
    pub(crate) fn new(share: CpuShare, window: Duration, now: Instant) -> Option<CpuBudget> {
        if share >= CpuShare::WHOLE_CORE {
            return None;
        }
        let millicores = u64::from(share.millicores());
        let window_nanos = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX);
        let capacity = window_nanos.saturating_mul(millicores) / 1000;
        let capacity_nanos = i64::try_from(capacity).unwrap_or(i64::MAX);
        Some(CpuBudget {
            millicores,
            capacity_nanos,
            credit_nanos: capacity_nanos,
            at: now,
            charged_nanos: 0,
        })
    }

    /// Fold in what the meter read (`used_nanos`, its running total) and the
    /// credit earned since the last look; how long the key must wait until
    /// its credit is back at zero, or `None` if it may run now.
    pub(crate) fn wait(&mut self, used_nanos: u64, now: Instant) -> Option<Duration> {
        let elapsed =
            u64::try_from(now.saturating_duration_since(self.at).as_nanos()).unwrap_or(u64::MAX);
        let earned =
            i64::try_from(elapsed.saturating_mul(self.millicores) / 1000).unwrap_or(i64::MAX);
        let spent =
            i64::try_from(used_nanos.saturating_sub(self.charged_nanos)).unwrap_or(i64::MAX);
        self.credit_nanos = self
            .credit_nanos
            .saturating_add(earned)
            .min(self.capacity_nanos)
            .saturating_sub(spent);
        self.at = now;
        self.charged_nanos = used_nanos;
        if self.credit_nanos >= 0 {
            return None;
        }
        // Credit comes back at `millicores` thousandths of a nanosecond per
        // nanosecond.
        let debt = self.credit_nanos.unsigned_abs();
        Some(Duration::from_nanos(
            debt.saturating_mul(1000).div_ceil(self.millicores),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_are_read_in_every_form_and_refused_past_one_core() {
        for (text, millicores) in [("250m", 250), ("0.25", 250), ("25%", 250), ("1", 1000)] {
            let share: CpuShare = text.parse().expect(text);
            assert_eq!(share.millicores(), millicores, "{text}");
        }
        for text in ["0", "1.5", "2000m", "-1", "lots", "NaN"] {
            let why = text.parse::<CpuShare>().expect_err(text);
            assert!(why.contains("CPU share"), "{text}: {why}");
        }
    }

    #[test]
    fn a_whole_core_is_never_throttled() {
        assert!(
            CpuBudget::new(CpuShare::WHOLE_CORE, Duration::from_secs(1), Instant::now()).is_none()
        );
    }

    #[test]
    fn a_key_over_its_budget_waits_until_its_credit_is_back() {
        let start = Instant::now();
        let share = CpuShare::from_millicores(100).unwrap();
        let mut budget = CpuBudget::new(share, Duration::from_secs(1), start).unwrap();
        // A full bucket holds 100 ms; using 90 ms leaves credit.
        assert_eq!(budget.wait(90_000_000, start), None);
        // 30 ms more is 20 ms of debt: 200 ms at a tenth of a core.
        let wait = budget.wait(120_000_000, start).expect("throttled");
        assert_eq!(wait, Duration::from_millis(200));
        // After those 200 ms it may run again.
        assert_eq!(budget.wait(120_000_000, start + wait), None);
        // Credit never grows past one window's worth.
        let later = start + Duration::from_secs(3600);
        assert_eq!(budget.wait(120_000_000, later), None);
        assert!(budget.wait(221_000_000, later).is_some());
    }
}
