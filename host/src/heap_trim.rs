//! The host heap: the process's allocator, and giving its pages back to the
//! OS after many keys end at once.
//!
//! A key's store, its context and its messages live on the host heap. With
//! the default feature `mimalloc` the process allocates with mimalloc 3
//! (declared here as the global allocator): a key's store is allocated on
//! the thread that activated it and freed on a guest thread, and glibc made
//! every such free take the allocating thread's arena lock: after a fence
//! of 100 000 keys the guest threads spent 28 % of their time in glibc and
//! 9 % more waking threads blocked on those locks, and dropped the stores in
//! 1.6–2.1 s; mimalloc frees a block into its page without a lock and gives
//! a page whose blocks were all freed by other threads back to its arena at
//! once: 0.9–1.2 s (`docs/benchmarks.md`, "Issue 17, ninth pass").
//!
//! Either allocator keeps freed pages for reuse: after a fence of 10 000
//! keys glibc kept about 190 MiB resident that no key used, and mimalloc
//! purges freed pages only after a delay and only when some thread next
//! allocates or frees, which an idle node may not do for minutes.
//! [`HeapTrimmer`] is a thread that looks once a `period` at how many
//! component instances the engine's pool holds, and when that fell by at
//! least `min_drop` since the most it held after the last trim, asks the
//! allocator to return its free pages (`mi_collect(true)` with mimalloc,
//! which purges every arena's freed pages whichever thread freed them;
//! `malloc_trim(0)` on glibc; a no-op elsewhere). One process trims at most
//! once a second with glibc (once a look's period with mimalloc, whose purge
//! blocks no allocating thread), and waits twenty times a trim's duration
//! before the next.
//!
//! It runs on a thread of its own: a trim walks the arenas and may take
//! milliseconds, which must never delay the epoch ticker (kills) or a key.
//! This module must not free, move or look into anything a key holds: it
//! only chooses the allocator and tells it that free memory may go.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use wasmtime::Engine;

use crate::error::{Error, Result};

/// The process's allocator (see the module header). An embedding program
/// that declares its own turns off the crate's default feature `mimalloc`.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How often the trimmer looks.
pub(crate) const TRIM_PERIOD: Duration = Duration::from_millis(250);

/// The drop in live instances that is worth a trim: below it the arenas'
/// free pages are few, and the next keys reuse them.
pub(crate) const TRIM_MIN_DROP: u64 = 256;

/// The least time between two trims in one process (several nodes may share
/// it), and how many times a trim's own duration the next one waits at
/// least, so that a process spends at most a twentieth of its time trimming.
/// glibc's `malloc_trim` holds each arena's lock while it walks it
/// (measured: 3 ms after 1k keys ended, 39 ms after 10k), so threads that
/// allocate meanwhile wait: a second between trims. mimalloc's purge takes
/// no lock an allocating thread needs: one look's period, so that a trim
/// made while a fence's drops were still under way is followed by one soon
/// after they end (with a second's wait the keys' memory once came back
/// 2.1 s after a fence of 100k keys instead of 1.1–1.2 s).
#[cfg(feature = "mimalloc")]
const TRIM_MIN_INTERVAL: Duration = TRIM_PERIOD;
#[cfg(not(feature = "mimalloc"))]
const TRIM_MIN_INTERVAL: Duration = Duration::from_secs(1);
const TRIM_INTERVAL_PER_TRIM: u32 = 20;

/// When a process last trimmed, and for how long: the pacing of trims.
struct TrimPacing {
    last: Mutex<Option<(Instant, Duration)>>,
}

/// This process's trims.
static PACING: TrimPacing = TrimPacing::new();

impl TrimPacing {
    const fn new() -> TrimPacing {
        TrimPacing {
            last: Mutex::new(None),
        }
    }

    /// Whether the process may trim at `now`; if so, the trim is taken as
    /// begun (with no duration yet: [`took`](Self::took) records it).
    fn may_trim_now(&self, now: Instant) -> bool {
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((at, took)) = *last {
            let wait = TRIM_MIN_INTERVAL.max(took * TRIM_INTERVAL_PER_TRIM);
            if now.saturating_duration_since(at) < wait {
                return false;
            }
        }
        *last = Some((now, Duration::ZERO));
        true
    }

    /// The trim begun at the last [`may_trim_now`](Self::may_trim_now)
    /// took `took`.
    fn took(&self, took: Duration) {
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, recorded)) = last.as_mut() {
            *recorded = took;
        }
    }
}

/// Looks in a row a drop may still be under way before the trimmer trims
/// anyway (keys that keep ending would otherwise put it off for ever).
const SETTLE_LOOKS: u32 = 4;

/// What the trimmer has seen of the pool's live instances (pure: the
/// thread feeds it one count per look).
#[derive(Debug, Default)]
pub(crate) struct TrimWatch {
    /// The most instances since the last trim.
    peak: u64,
    /// The count at the previous look.
    last: u64,
    /// Looks since a large drop was first seen, while it went on.
    waited: u32,
}

impl TrimWatch {
    /// Take in the count of a look: whether a trim is due, that is, the
    /// count fell by at least `min_drop` from its mark and has stopped
    /// falling (or kept falling for [`SETTLE_LOOKS`] looks). A trim due is
    /// done by the caller, who then calls [`trimmed`](Self::trimmed).
    pub(crate) fn look(&mut self, live: u64, min_drop: u64) -> bool {
        self.peak = self.peak.max(live);
        let settled = live == self.last;
        self.last = live;
        if self.peak.saturating_sub(live) < min_drop {
            self.waited = 0;
            return false;
        }
        if settled || self.waited >= SETTLE_LOOKS {
            return true;
        }
        self.waited += 1;
        false
    }

    /// The heap was trimmed with `live` instances: the mark restarts there.
    pub(crate) fn trimmed(&mut self, live: u64) {
        self.peak = live;
        self.waited = 0;
    }
}

/// Return the allocator's free pages to the OS.
#[allow(unsafe_code, reason = "one FFI call into the C allocator")]
fn trim_heap() {
    #[cfg(feature = "mimalloc")]
    // SAFETY: `mi_collect` frees nothing live: it collects this thread's
    // heap and, forced, purges the pages every arena holds free (taking
    // mimalloc's own purge guard); any thread may call it at any time.
    unsafe {
        libmimalloc_sys::mi_collect(true);
    }
    #[cfg(all(not(feature = "mimalloc"), target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only releases memory the allocator holds free;
    // it takes the arenas' locks itself and touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The trimmer thread (see the module header); stopped and joined on drop.
pub(crate) struct HeapTrimmer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HeapTrimmer {
    /// Start watching `engine`'s instance pool. Without a pooling allocator
    /// there is nothing to watch and no thread is started.
    ///
    /// # Errors
    ///
    /// [`Error::Internal`] if the OS refuses the thread.
    pub(crate) fn start(engine: &Engine, period: Duration, min_drop: u64) -> Result<HeapTrimmer> {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = engine.pooling_allocator_metrics().map(|metrics| {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("fief-heap-trim".to_owned())
                .spawn(move || {
                    let mut watch = TrimWatch::default();
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::park_timeout(period);
                        let live = metrics.component_instances();
                        // A trim put off (one was recent) stays due, and
                        // happens at the next look allowed.
                        if !watch.look(live, min_drop) || !PACING.may_trim_now(Instant::now()) {
                            continue;
                        }
                        watch.trimmed(live);
                        let started = Instant::now();
                        trim_heap();
                        let took = started.elapsed();
                        PACING.took(took);
                        if took > Duration::from_millis(50) {
                            tracing::info!(
                                live,
                                ?took,
                                "many keys ended: host heap trimmed (slowly)"
                            );
                        } else {
                            tracing::debug!(live, ?took, "many keys ended: host heap trimmed");
                        }
                    }
                })
        });
        let thread = thread
            .transpose()
            .map_err(|e| Error::Internal(format!("cannot start the heap trimmer thread: {e}")))?;
        Ok(HeapTrimmer { stop, thread })
    }
}

impl Drop for HeapTrimmer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trim_follows_a_large_drop_once_it_settles_and_only_once() {
        let mut watch = TrimWatch::default();
        // Keys come: no trim.
        assert!(!watch.look(5000, 1024));
        // A few end: under the threshold.
        assert!(!watch.look(4500, 1024));
        // A fence: most end, still ending at the next look; then settled.
        assert!(!watch.look(2000, 1024));
        assert!(watch.look(2000, 1024) || watch.look(2000, 1024));
        watch.trimmed(2000);
        // Nothing more ended: no second trim.
        assert!(!watch.look(2000, 1024));
        // Keys that keep ending: a trim after SETTLE_LOOKS looks anyway.
        let mut looks = 0;
        let mut live = 1900;
        while !watch.look(live, 100) {
            looks += 1;
            live -= 100;
        }
        assert_eq!(looks, SETTLE_LOOKS);
    }

    #[test]
    fn trims_are_paced_by_the_interval_and_by_their_own_duration() {
        let pacing = TrimPacing::new();
        let t0 = Instant::now();
        assert!(pacing.may_trim_now(t0));
        pacing.took(Duration::from_millis(1));
        // Within the interval: no second trim.
        assert!(!pacing.may_trim_now(t0 + TRIM_MIN_INTERVAL - Duration::from_millis(1)));
        assert!(pacing.may_trim_now(t0 + TRIM_MIN_INTERVAL));
        // A slow trim puts the next one off by twenty times its duration.
        let t1 = t0 + TRIM_MIN_INTERVAL;
        let slow = TRIM_MIN_INTERVAL;
        pacing.took(slow);
        assert!(!pacing.may_trim_now(t1 + slow * (TRIM_INTERVAL_PER_TRIM - 1)));
        assert!(pacing.may_trim_now(t1 + slow * TRIM_INTERVAL_PER_TRIM));
    }

    /// With mimalloc, whose purge blocks no allocating thread, a quick trim
    /// may be followed one look later: a trim made during a fence's drops
    /// does not put off the one after they end by a second.
    #[cfg(feature = "mimalloc")]
    #[test]
    fn with_mimalloc_a_quick_trim_may_be_followed_one_look_later() {
        let pacing = TrimPacing::new();
        let t0 = Instant::now();
        assert!(pacing.may_trim_now(t0));
        pacing.took(Duration::from_millis(1));
        assert!(pacing.may_trim_now(t0 + TRIM_PERIOD));
    }

    /// Set in the child process of [`freed_pages_go_back_to_the_os_on_a_trim`].
    const TRIM_CHILD: &str = "FIEF_TEST_HEAP_TRIM_CHILD";

    /// The process's resident memory, from `/proc/self/statm`.
    fn rss_bytes() -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").expect("reading /proc/self/statm");
        let pages: u64 = statm
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .expect("statm's resident pages");
        pages * 4096
    }

    #[cfg(feature = "mimalloc")]
    #[test]
    #[allow(unsafe_code, reason = "asks mimalloc whether it owns a block")]
    fn the_process_allocates_with_mimalloc() {
        let block = std::hint::black_box(vec![7_u8; 100]);
        // SAFETY: a query about an address; nothing is read or written.
        let owned = unsafe { libmimalloc_sys::mi_is_in_heap_region(block.as_ptr().cast()) };
        assert!(owned, "a Vec's buffer is not in mimalloc's heap");
    }

    /// Blocks allocated on one thread and freed on another (a store made on
    /// an activating worker, dropped on a guest thread at a fence) stay
    /// resident until a trim; a trim gives them back. Measured in a child
    /// process of this test binary that runs only this test, so no other
    /// test's memory moves the figures.
    #[cfg(target_os = "linux")]
    #[test]
    fn freed_pages_go_back_to_the_os_on_a_trim() {
        const BLOCK: usize = 16 * 1024;
        const BLOCKS: usize = 16 * 1024; // 256 MiB
        if std::env::var_os(TRIM_CHILD).is_none() {
            let exe = std::env::current_exe().expect("this test binary");
            let out = std::process::Command::new(exe)
                .args([
                    "heap_trim::tests::freed_pages_go_back_to_the_os_on_a_trim",
                    "--exact",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(TRIM_CHILD, "1")
                .output()
                .expect("running the child test");
            assert!(
                out.status.success(),
                "the child failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                String::from_utf8_lossy(&out.stdout).contains("trimmed:"),
                "the child did not run the test"
            );
            return;
        }
        let before = rss_bytes();
        let blocks = std::thread::spawn(|| {
            (0..BLOCKS)
                .map(|i| vec![u8::try_from(i % 251).unwrap_or(1) | 1; BLOCK])
                .collect::<Vec<_>>()
        })
        .join()
        .expect("the allocating thread");
        std::thread::spawn(move || drop(blocks))
            .join()
            .expect("the freeing thread");
        let freed = rss_bytes();
        trim_heap();
        let trimmed = rss_bytes();
        println!(
            "before {} MiB, freed {} MiB, trimmed: {} MiB",
            before >> 20,
            freed >> 20,
            trimmed >> 20
        );
        let used = (BLOCK * BLOCKS) as u64;
        assert!(
            trimmed < before + used / 4,
            "after the trim {} MiB of the {} MiB freed are still resident",
            trimmed.saturating_sub(before) >> 20,
            used >> 20
        );
    }
}
