//! How a guest thread gives way to the node's other threads at the OS.
//!
//! Guest code runs on the guest threads (`crate::scheduler::GuestPool`);
//! the HTTP API, the peer links and the lease renewals run on the node's
//! own threads. When the cores are contended, the kernel must run the
//! node's threads first, and soon: a victim's request waits for a worker
//! the kernel has woken but not yet run. Each guest thread sets this once,
//! for itself, when it starts ([`lower_this_thread`]):
//!
//! - [`GuestThreadPolicy::Nice`] (the default): the thread's niceness goes
//!   up by `guest_thread_nice`, and it asks for a short time slice
//!   (`sched_attr::sched_runtime` of a `SCHED_OTHER` thread; Linux 6.12 and
//!   later, ignored before; [`guest_slice`]: 0.3 ms at niceness 10 beside
//!   the node's threads' 1.4 ms on two cores). Niceness alone did not do it: Linux's
//!   EEVDF scheduler lets the thread it is running finish a slice of its own
//!   (about 1.4 ms on two cores) before a thread it wakes there runs, however
//!   low the running thread's priority; traced with `perf sched`, a woken
//!   API worker waited up to 0.9 ms behind a guest thread
//!   (`docs/benchmarks.md`, "Issue 17, fifth pass").
//! - [`GuestThreadPolicy::Idle`]: Linux's `SCHED_IDLE`. A woken thread of
//!   the node preempts a guest thread at once, and the kernel counts a core
//!   running only guest threads as idle when it places a woken thread (with
//!   a niceness, a woken worker could queue behind another worker on one
//!   core while the other core ran guest code). The cost: guest threads get
//!   almost nothing of a core anything else wants, another process's too.
//!
//! This module must not decide where or when guest code runs (that is the
//! scheduler's and the key table's); it only sets the calling thread's
//! standing with the OS, and a failure is logged, never fatal.

use std::time::Duration;

use crate::config::GuestThreadPolicy;

/// The shortest OS time slice Linux grants.
pub(crate) const MIN_SLICE: Duration = Duration::from_micros(100);

/// Give the calling thread (a guest thread, as it starts) its standing under
/// `policy`: see the module header. What the OS refuses is logged and the
/// thread runs as it was.
pub(crate) fn lower_this_thread(policy: GuestThreadPolicy, nice: u8) {
    match policy {
        GuestThreadPolicy::Nice => {
            let tid = rustix::thread::gettid();
            let before = rustix::process::getpriority_process(Some(tid)).unwrap_or(0);
            // The slice this thread was born with: the node's threads'.
            let base = this_threads_scheduling().map_or(Duration::ZERO, |(_, slice)| slice);
            raise_niceness(nice);
            let after = rustix::process::getpriority_process(Some(tid)).unwrap_or(before);
            if let Some(slice) = guest_slice(base, before, after) {
                set_scheduling(libc::SCHED_OTHER, slice);
            }
        }
        GuestThreadPolicy::Idle => set_scheduling(libc::SCHED_IDLE, MIN_SLICE),
    }
}

/// The kernel's weight of each niceness from 0 to 19 (`sched_prio_to_weight`;
/// each step is about 1.25×).
const WEIGHTS: [u64; 20] = [
    1024, 820, 655, 526, 423, 335, 272, 215, 172, 137, 110, 87, 70, 56, 45, 36, 29, 23, 18, 15,
];

/// The kernel's weight of niceness `nice` (-20 to 19; below 0, the weight
/// of 0 times 1.25 a step, enough for a ratio).
fn weight(nice: i32) -> u64 {
    match usize::try_from(nice) {
        Ok(n) => WEIGHTS[n.min(19)],
        Err(_) => (0..nice.unsigned_abs().min(20)).fold(1024, |w, _| w * 5 / 4),
    }
}

/// The slice a guest thread at niceness `to` asks for, the node's threads
/// at `from` having slices of `base`: short, so that a guest thread the
/// kernel is running gives way to a woken thread of the node within it, but
/// no shorter in the scheduler's virtual time than twice the node's threads'
/// slice (`base` scaled by the weights), or a woken guest thread, having the
/// earlier virtual deadline, would preempt them. `None` where the kernel
/// reports no slice (before Linux 6.12): nothing to set.
fn guest_slice(base: Duration, from: i32, to: i32) -> Option<Duration> {
    if base.is_zero() {
        return None;
    }
    let scaled = base * 2 * u32::try_from(weight(to)).unwrap_or(u32::MAX)
        / u32::try_from(weight(from)).unwrap_or(1).max(1);
    Some(scaled.clamp(MIN_SLICE, base.max(MIN_SLICE)))
}

/// Raise the calling thread's niceness by `nice` (on Linux a thread's
/// priority is its own: `setpriority(PRIO_PROCESS, tid)`).
fn raise_niceness(nice: u8) {
    if nice == 0 {
        return;
    }
    let tid = rustix::thread::gettid();
    let result = rustix::process::getpriority_process(Some(tid)).and_then(|now| {
        rustix::process::setpriority_process(Some(tid), (now + i32::from(nice)).min(19))
    });
    if let Err(e) = result {
        tracing::warn!(nice, error = %e, "cannot lower a guest thread's priority; it runs at the process's");
    }
}

/// Set the calling thread's scheduling policy to `policy` (`SCHED_OTHER` or
/// `SCHED_IDLE`), keeping its niceness, with a time slice of `slice`.
#[allow(unsafe_code, reason = "one system call on the calling thread")]
fn set_scheduling(policy: libc::c_int, slice: Duration) {
    let tid = rustix::thread::gettid();
    let nice = rustix::process::getpriority_process(Some(tid)).unwrap_or(0);
    let attr = libc::sched_attr {
        size: u32::try_from(std::mem::size_of::<libc::sched_attr>()).unwrap_or(u32::MAX),
        sched_policy: u32::try_from(policy).unwrap_or(0),
        sched_flags: 0,
        sched_nice: nice,
        sched_priority: 0,
        sched_runtime: u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX),
        sched_deadline: 0,
        sched_period: 0,
    };
    // SAFETY: `attr` is a valid `sched_attr` of the size it states, alive
    // for the call; pid 0 is the calling thread; flags 0.
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &raw const attr, 0) };
    if rc != 0 {
        let error = std::io::Error::last_os_error();
        tracing::warn!(policy, %error, "cannot set a guest thread's scheduling; it runs as it was");
    }
}

/// The calling thread's scheduling policy and time slice, as the OS reports
/// them (`sched_getattr`; the slice of a `SCHED_OTHER` or `SCHED_IDLE`
/// thread is its `sched_runtime` on Linux 6.12 and later, 0 before).
#[allow(unsafe_code, reason = "one system call on the calling thread")]
pub(crate) fn this_threads_scheduling() -> std::io::Result<(libc::c_int, Duration)> {
    // SAFETY: all-zero is a valid `sched_attr` (plain integers).
    let mut attr: libc::sched_attr = unsafe { std::mem::zeroed() };
    let size = u32::try_from(std::mem::size_of::<libc::sched_attr>()).unwrap_or(u32::MAX);
    // SAFETY: `attr` is writable and `size` bytes long; pid 0 is the calling
    // thread; flags 0.
    let rc = unsafe { libc::syscall(libc::SYS_sched_getattr, 0, &raw mut attr, size, 0) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let policy = libc::c_int::try_from(attr.sched_policy).unwrap_or(-1);
    Ok((policy, Duration::from_nanos(attr.sched_runtime)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::GuestPool;

    /// What a guest thread of a pool started with `policy` and `nice`
    /// reports: its niceness, policy and time slice.
    fn on_a_guest_thread(policy: GuestThreadPolicy, nice: u8) -> (i32, libc::c_int, Duration) {
        let pool = GuestPool::start(1, nice, policy).expect("a guest thread");
        let (tx, rx) = std::sync::mpsc::channel();
        pool.handle().spawn(async move {
            let nice = rustix::process::getpriority_process(Some(rustix::thread::gettid()))
                .expect("getpriority on the guest thread");
            let (policy, slice) = this_threads_scheduling().expect("sched_getattr");
            let _ = tx.send((nice, policy, slice));
        });
        rx.recv_timeout(Duration::from_secs(30))
            .expect("the task ran")
    }

    /// Whether this kernel reports a fair thread's own slice (6.12 and
    /// later): where it does not, the slice cannot be checked.
    fn kernel_reports_slices() -> bool {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut parts = release.split(|c: char| !c.is_ascii_digit());
        let mut next = || {
            parts
                .next()
                .and_then(|p| p.parse::<u32>().ok())
                .unwrap_or(0)
        };
        let (major, minor) = (next(), next());
        (major, minor) >= (6, 12)
    }

    #[test]
    fn guest_threads_run_at_the_niceness_asked_above_the_process_with_a_short_slice() {
        let own = rustix::process::getpriority_process(None).expect("getpriority");
        let (_, base) = this_threads_scheduling().expect("sched_getattr");
        let (nice, policy, slice) = on_a_guest_thread(GuestThreadPolicy::Nice, 10);
        assert_eq!(nice, (own + 10).min(19), "the process runs at {own}");
        assert_eq!(policy, libc::SCHED_OTHER);
        if kernel_reports_slices() {
            assert_eq!(Some(slice), guest_slice(base, own, nice));
            if own < 9 {
                assert!(slice < base / 2, "{slice:?} of {base:?}");
            }
        }
        assert_eq!(
            rustix::process::getpriority_process(None).expect("getpriority"),
            own,
            "the calling thread's niceness changed"
        );
        let (policy, _) = this_threads_scheduling().expect("sched_getattr");
        assert_eq!(
            policy,
            libc::SCHED_OTHER,
            "the calling thread's policy changed"
        );
    }

    #[test]
    fn a_guest_slice_is_short_but_never_shorter_than_the_node_threads_in_virtual_time() {
        let ms = Duration::from_millis;
        let base = Duration::from_micros(1400);
        // Niceness 10 above 0: weights 110 and 1024; twice the node's
        // virtual slice is 1.4 ms × 2 × 110 / 1024, 0.3 ms of wall time.
        assert_eq!(
            guest_slice(base, 0, 10),
            Some(Duration::from_nanos(1_400_000 * 2 * 110 / 1024))
        );
        // Niceness 19: clamped to the least Linux grants.
        assert_eq!(guest_slice(base, 0, 19), Some(MIN_SLICE));
        // No niceness: never longer than the node's own.
        assert_eq!(guest_slice(base, 0, 0), Some(base));
        // A process at -5 lowering its guest threads to 5.
        assert!(guest_slice(ms(3), -5, 5).is_some_and(|s| s < ms(1)));
        // A kernel that reports no slice: nothing set.
        assert_eq!(guest_slice(Duration::ZERO, 0, 10), None);
    }

    #[test]
    fn guest_threads_run_under_sched_idle_when_asked() {
        let (_, policy, _) = on_a_guest_thread(GuestThreadPolicy::Idle, 10);
        assert_eq!(policy, libc::SCHED_IDLE);
        let (policy, _) = this_threads_scheduling().expect("sched_getattr");
        assert_eq!(
            policy,
            libc::SCHED_OTHER,
            "the calling thread's policy changed"
        );
    }
}
