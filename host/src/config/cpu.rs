//! CPU shares as a configuration writes them: [`CpuShare`] (a module's
//! `cpu_budget`, a share of one core) and [`CpuCores`] (a tenant's
//! `cpu_budget_per_tenant`, a number of cores), each in thousandths of a
//! core, read from `250m`, `0.25`, `25%` or `1` and refused outside its
//! range with the value named; and [`GuestThreadPolicy`], how the guest
//! threads yield the cores to the node's other threads.
//!
//! Plain values: what a budget does with them (the token buckets, the
//! meter, throttling) is `crate::cpu_budget`'s, which imports them. This
//! file must not measure or throttle anything.

use serde::{Deserialize, Serialize};

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
        CpuShare::from_millicores(parse_millicores(text, "between 1m and one core (1)")?)
    }
}

/// Thousandths of a core from `250m`, `0.25`, `25%` or `2`; `range` ends the
/// message of a refusal ("between 1m and one core (1)").
fn parse_millicores(text: &str, range: &str) -> Result<u32, String> {
    let t = text.trim();
    let bad = || {
        format!(
            "{text:?} is not a CPU share; write thousandths of a core (250m), a fraction \
             (0.25) or a percentage (25%), {range}"
        )
    };
    if let Some(m) = t.strip_suffix('m') {
        return m.parse::<u32>().map_err(|_| bad());
    }
    let (number, scale) = match t.strip_suffix('%') {
        Some(p) => (p, 10.0),
        None => (t, 1000.0),
    };
    let value: f64 = number.parse().map_err(|_| bad())?;
    if !value.is_finite() || value < 0.0 {
        return Err(bad());
    }
    Ok((value * scale).round().min(f64::from(u32::MAX)) as u32)
}

/// A number of cores, in thousandths: a tenant's `cpu_budget_per_tenant`
/// (`1500m` or `1.5` is a core and a half). Between `1m` and 1024 cores.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct CpuCores(u32);

impl CpuCores {
    /// The most a tenant's budget may be: 1024 cores.
    pub const MAX_MILLICORES: u32 = 1_024_000;

    /// `millicores` thousandths of a core.
    ///
    /// # Errors
    ///
    /// A message naming the value when it is not between 1m and 1024 cores.
    pub fn from_millicores(millicores: u32) -> Result<CpuCores, String> {
        if (1..=Self::MAX_MILLICORES).contains(&millicores) {
            Ok(CpuCores(millicores))
        } else {
            Err(format!(
                "a CPU budget of {millicores}m is not between 1m and 1024 cores"
            ))
        }
    }

    /// The number in thousandths of a core.
    pub fn millicores(self) -> u32 {
        self.0
    }
}

impl std::str::FromStr for CpuCores {
    type Err = String;

    fn from_str(text: &str) -> Result<CpuCores, String> {
        CpuCores::from_millicores(parse_millicores(text, "between 1m and 1024 cores")?)
    }
}

/// Text forms of a millicore newtype: shown as `250m`, read through its
/// `FromStr` (serde goes through both).
macro_rules! millicore_text {
    ($t:ty) => {
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}m", self.0)
            }
        }

        impl std::fmt::Debug for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                std::fmt::Display::fmt(self, f)
            }
        }

        impl TryFrom<String> for $t {
            type Error = String;
            fn try_from(text: String) -> Result<$t, String> {
                text.parse()
            }
        }

        impl From<$t> for String {
            fn from(value: $t) -> String {
                value.to_string()
            }
        }
    };
}

millicore_text!(CpuShare);
millicore_text!(CpuCores);

/// How the guest threads give way to the node's other threads (the API, the
/// peer links, the lease renewals) when the cores are contended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GuestThreadPolicy {
    /// At `guest_thread_nice` above the process's niceness, each asking
    /// the OS for a short time slice (0.3 ms at niceness 10, Linux 6.12 and later),
    /// so that a thread of the node woken on a core a guest thread holds
    /// runs within that slice. Guest code keeps a share of a contended
    /// core by its weight (about a tenth at niceness 10).
    #[default]
    Nice,
    /// Linux's `SCHED_IDLE`: guest threads run only on cores nothing else
    /// wants, and the kernel treats a core running only them as idle when
    /// it places a woken thread. The node's threads never wait behind guest
    /// code, but guest code beyond an inline call's first slice (demoted
    /// callbacks, timers, mailboxes) nearly stops while anything else on
    /// the machine keeps the cores busy: for nodes that have the machine
    /// to themselves. An unprivileged process cannot leave it again.
    Idle,
}

impl std::str::FromStr for GuestThreadPolicy {
    type Err = String;

    fn from_str(text: &str) -> Result<GuestThreadPolicy, String> {
        match text.trim() {
            "nice" => Ok(GuestThreadPolicy::Nice),
            "idle" => Ok(GuestThreadPolicy::Idle),
            other => Err(format!(
                "{other:?} is not a guest thread policy: write nice (the default: guest \
                 threads at guest_thread_nice) or idle (SCHED_IDLE, for a node alone on its \
                 machine)"
            )),
        }
    }
}

impl std::fmt::Display for GuestThreadPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GuestThreadPolicy::Nice => "nice",
            GuestThreadPolicy::Idle => "idle",
        })
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
    fn guest_thread_policies_are_read_by_name_and_others_refused() {
        for policy in [GuestThreadPolicy::Nice, GuestThreadPolicy::Idle] {
            assert_eq!(policy.to_string().parse::<GuestThreadPolicy>(), Ok(policy));
        }
        let why = "realtime"
            .parse::<GuestThreadPolicy>()
            .expect_err("no such policy");
        assert!(
            why.contains("\"realtime\"") && why.contains("idle"),
            "{why}"
        );
    }

    #[test]
    fn tenant_budgets_are_read_in_cores_and_refused_past_1024() {
        let cores: CpuCores = "1.5".parse().expect("cores");
        assert_eq!(cores.millicores(), 1500);
        assert_eq!(cores.to_string(), "1500m");
        assert_eq!("250m".parse::<CpuCores>().unwrap().millicores(), 250);
        for text in ["0", "1025", "-2", "much"] {
            let why = text.parse::<CpuCores>().expect_err(text);
            assert!(why.contains("1024 cores"), "{text}: {why}");
        }
    }
}
