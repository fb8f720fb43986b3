//! Giving the host heap back to the OS after many keys end at once.
//!
//! A key's store, its context and its messages live on the host heap. When
//! thousands of keys end together (a fence, an undeploy, an idle sweep) the
//! allocator keeps their freed pages in its arenas for reuse: after a fence
//! of 10 000 keys about 190 MiB stayed resident that no key used
//! (`docs/benchmarks.md`, "Fence: memory reclaimed"). [`HeapTrimmer`] is a
//! thread that looks once a `period` at how many component instances the
//! engine's pool holds, and when that fell by at least `min_drop` since the
//! most it held after the last trim, asks the allocator to return its free
//! pages (`malloc_trim(0)` on glibc; a no-op elsewhere).
//!
//! It runs on a thread of its own: a trim walks the arenas and may take
//! milliseconds, which must never delay the epoch ticker (kills) or a key.
//! This module must not free, move or look into anything a key holds: it
//! only tells the allocator that free memory may go.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use wasmtime::Engine;

/// How often the trimmer looks.
pub(crate) const TRIM_PERIOD: Duration = Duration::from_millis(250);

/// The drop in live instances that is worth a trim: below it the arenas'
/// free pages are few, and the next keys reuse them.
pub(crate) const TRIM_MIN_DROP: u64 = 256;

/// Whether to trim now, and the new high-water mark: `peak` is the most
/// instances seen since the last trim, `live` how many there are now.
pub(crate) fn should_trim(peak: u64, live: u64, min_drop: u64) -> (bool, u64) {
    if peak.saturating_sub(live) >= min_drop {
        (true, live)
    } else {
        (false, peak.max(live))
    }
}

/// Return the allocator's free pages to the OS.
#[allow(unsafe_code, reason = "one FFI call into the C allocator")]
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
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
    pub(crate) fn start(engine: &Engine, period: Duration, min_drop: u64) -> HeapTrimmer {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = engine.pooling_allocator_metrics().map(|metrics| {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("fief-heap-trim".to_owned())
                .spawn(move || {
                    let mut peak = 0;
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::park_timeout(period);
                        let live = metrics.component_instances();
                        let (trim, next) = should_trim(peak, live, min_drop);
                        peak = next;
                        if trim {
                            let started = std::time::Instant::now();
                            trim_heap();
                            tracing::debug!(
                                live,
                                took = ?started.elapsed(),
                                "many keys ended: host heap trimmed"
                            );
                        }
                    }
                })
                .expect("spawning the heap trimmer thread")
        });
        HeapTrimmer { stop, thread }
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
    fn a_trim_follows_a_large_drop_and_only_once() {
        // Keys come: no trim, the mark rises.
        assert_eq!(should_trim(0, 5000, 1024), (false, 5000));
        // A few end: under the threshold, the mark stays.
        assert_eq!(should_trim(5000, 4500, 1024), (false, 5000));
        // A fence ends most: trim, and the mark restarts from what is left.
        assert_eq!(should_trim(5000, 100, 1024), (true, 100));
        // Nothing more ended: no second trim.
        assert_eq!(should_trim(100, 100, 1024), (false, 100));
    }
}
