//! Fence modes and the fence budget.
//!
//! The fence-mode page (`docs/fencing.md`) is the contract: a module chooses
//! what happens to its key processes when their node fences —
//! [`OnFence::Terminate`] (the default: killed at the fence point),
//! [`OnFence::Continue`] (survive in limbo) or [`OnFence::Callback`] (the key
//! decides in `handle-fence`, under a deadline). The mode changes what
//! survives the fence, never whether or when the fence happens.
//!
//! [`FenceBudget`] checks, at deploy and at node start, that a callback
//! deadline plus the kill bound plus clock drift fits inside the fence margin
//! (contract §2), and refuses a misfit with the numbers.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::lease::{LeaseTiming, TimingError};

/// Default deadline for `handle-fence` (contract §2).
pub const DEFAULT_HANDLE_FENCE_DEADLINE: Duration = Duration::from_millis(50);
/// Default bound on the time from "kill" to "no guest code runs": the epoch
/// tick is 1 ms and a spinning guest traps within about 2 ticks; 10 ms leaves
/// room for a loaded machine.
pub const DEFAULT_KILL_BOUND: Duration = Duration::from_millis(10);

/// What happens to a module's key processes when their node fences.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OnFence {
    /// Killed at the fence point. The only mode under which guarantee 1 covers
    /// live processes and their side effects.
    #[default]
    Terminate,
    /// Survive the fence in limbo; routing to them stops. Forfeits guarantee 1.
    Continue,
    /// `handle-fence(deadline-ms)` decides: stop, or continue as a survivor.
    Callback,
}

impl OnFence {
    /// The mode's name as written in options and on the wire.
    pub fn as_str(&self) -> &'static str {
        match self {
            OnFence::Terminate => "terminate",
            OnFence::Continue => "continue",
            OnFence::Callback => "callback",
        }
    }
}

impl fmt::Display for OnFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for OnFence {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "terminate" => Ok(OnFence::Terminate),
            "continue" => Ok(OnFence::Continue),
            "callback" => Ok(OnFence::Callback),
            other => Err(format!(
                "unknown on_fence mode {other:?}: expected terminate, continue or callback"
            )),
        }
    }
}

/// The pieces of the fence margin: what must fit between a node's fence point
/// and the arbiter's expiry of its lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FenceBudget {
    /// Longest time any key process may run after the fence point before it
    /// is certainly dead (the kill bound).
    pub kill_bound: Duration,
}

impl Default for FenceBudget {
    fn default() -> Self {
        FenceBudget {
            kill_bound: DEFAULT_KILL_BOUND,
        }
    }
}

impl FenceBudget {
    /// Check that a module's `handle_fence_deadline` fits the lease timing:
    /// `deadline + kill_bound + drift allowance <= fence_margin`.
    ///
    /// # Errors
    ///
    /// A [`TimingError`] naming every number in the sum.
    ///
    /// ```
    /// use fief_core::{FenceBudget, LeaseTiming};
    /// use std::time::Duration;
    ///
    /// let timing = LeaseTiming::default(); // margin 1 s, drift 50 ms over 5 s
    /// let budget = FenceBudget::default(); // kill bound 10 ms
    /// assert!(budget.check(&timing, Duration::from_millis(50)).is_ok());
    /// assert!(budget.check(&timing, Duration::from_millis(990)).is_err());
    /// ```
    pub fn check(
        &self,
        timing: &LeaseTiming,
        handle_fence_deadline: Duration,
    ) -> Result<(), TimingError> {
        let drift = timing.drift_allowance();
        let need = handle_fence_deadline + self.kill_bound + drift;
        if need > timing.fence_margin() {
            return Err(TimingError::new(format!(
                "handle_fence_deadline ({handle_fence_deadline:?}) + kill bound ({:?}) + clock drift allowance ({drift:?}) = {need:?}, which does not fit inside fence_margin ({:?}); lower handle_fence_deadline or raise fence_margin",
                self.kill_bound,
                timing.fence_margin()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misfit_names_every_number() {
        let err = FenceBudget::default()
            .check(&LeaseTiming::default(), Duration::from_millis(960))
            .unwrap_err()
            .to_string();
        for needle in ["960ms", "10ms", "50ms", "1.02s", "1s"] {
            assert!(err.contains(needle), "{needle} missing from: {err}");
        }
    }

    #[test]
    fn modes_parse_and_print() {
        for mode in [OnFence::Terminate, OnFence::Continue, OnFence::Callback] {
            assert_eq!(mode.as_str().parse::<OnFence>(), Ok(mode));
        }
        assert!("kill".parse::<OnFence>().unwrap_err().contains("terminate"));
    }
}
