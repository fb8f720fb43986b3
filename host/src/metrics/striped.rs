//! The metrics every call moves, striped so that cores adding at once never
//! share a cache line.
//!
//! A plain atomic that every call adds to (a module's CPU time, its call
//! count, the node's latency histogram) is one cache line each core must own
//! in turn to add: on the 8-caller throughput bench those adds, not the
//! work, were the hottest instructions, and prometheus-client's histogram
//! takes a mutex per observation. A [`StripedU64`] keeps one padded cell per
//! *stripe* and a thread always adds to its own stripe; a read sums the
//! stripes (reads are rare: a scrape, a status page, a budget check). The
//! metric types here ([`SecondsCounter`], [`CallCounter`],
//! [`LatencyHistogram`]) encode as ordinary OpenMetrics counters and
//! histograms.
//!
//! This file owns the types, not the series: which series exist and who moves
//! them is `metrics/mod.rs`'s.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// Stripes per counter: threads beyond this share stripes (correct, only
/// slower). Guest threads and API workers are one per core by default.
const STRIPES: usize = 16;

/// One stripe, alone on its cache line (128 bytes: two lines, for CPUs
/// that fetch lines in pairs).
#[derive(Default)]
#[repr(align(128))]
struct Stripe(AtomicU64);

/// A `u64` counter striped over cache lines (see the module header).
#[derive(Default)]
pub(crate) struct StripedU64 {
    stripes: [Stripe; STRIPES],
}

impl StripedU64 {
    /// Add `n`, on this thread's stripe.
    pub(crate) fn add(&self, n: u64) {
        self.stripes[this_threads_stripe()]
            .0
            .fetch_add(n, Ordering::Relaxed);
    }

    /// The sum of every add so far.
    pub(crate) fn get(&self) -> u64 {
        self.stripes
            .iter()
            .fold(0u64, |sum, s| sum.wrapping_add(s.0.load(Ordering::Relaxed)))
    }
}

impl std::fmt::Debug for StripedU64 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("StripedU64").field(&self.get()).finish()
    }
}

/// A counter of seconds, kept as whole nanoseconds and shown as seconds.
///
/// Moved by every poll of every key (its CPU time): an add is one atomic
/// add on the adding thread's own cache line ([`StripedU64`]).
/// prometheus-client's `f64` counter adds by a compare-and-swap loop on one
/// shared line, which the cores charging CPU time at once kept retrying
/// against each other (7 % of the samples of the 8-caller throughput bench).
#[derive(Clone, Debug, Default)]
pub(crate) struct SecondsCounter(Arc<StripedU64>);

impl SecondsCounter {
    /// Add `time`.
    pub(crate) fn inc_by(&self, time: Duration) {
        self.0
            .add(u64::try_from(time.as_nanos()).unwrap_or(u64::MAX));
    }

    /// The nanoseconds counted so far.
    pub(crate) fn nanos(&self) -> u64 {
        self.0.get()
    }

    /// The seconds counted so far.
    pub(crate) fn get(&self) -> f64 {
        self.nanos() as f64 / 1e9
    }
}

impl TypedMetric for SecondsCounter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for SecondsCounter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_counter::<NoLabelSet, _, u64>(&self.get(), None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// A count (calls), striped: [`CallCounter::inc`] is one add on the
/// thread's own line.
#[derive(Clone, Debug, Default)]
pub(crate) struct CallCounter(Arc<StripedU64>);

impl CallCounter {
    /// Add one.
    pub(crate) fn inc(&self) {
        self.0.add(1);
    }

    /// The count so far.
    pub(crate) fn get(&self) -> u64 {
        self.0.get()
    }
}

impl TypedMetric for CallCounter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for CallCounter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_counter::<NoLabelSet, _, u64>(&self.get(), None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// Bounded buckets of [`LatencyHistogram`]: 100 µs doubling to ~13 s; one
/// more, +Inf, follows them.
const LATENCY_BOUNDS: usize = 18;

/// How many buckets [`LatencyHistogram::counts`] returns (the bounded ones
/// and +Inf).
pub(crate) const LATENCY_BUCKETS: usize = LATENCY_BOUNDS + 1;

/// A latency histogram (100 µs doubling to ~13 s), striped: an observation
/// is two adds on the thread's own lines, with no lock.
#[derive(Clone, Debug, Default)]
pub(crate) struct LatencyHistogram(Arc<LatencyStripes>);

/// The sum in nanoseconds and each bucket's own count (not cumulative; the
/// count is their sum); the last bucket is +Inf.
#[derive(Debug, Default)]
struct LatencyStripes {
    sum_nanos: StripedU64,
    buckets: [StripedU64; LATENCY_BOUNDS + 1],
}

impl LatencyHistogram {
    /// The upper bound of bucket `i`, in seconds (`i` < [`LATENCY_BOUNDS`]).
    fn bound(i: usize) -> f64 {
        0.0001 * f64::from(1u32 << i)
    }

    /// The upper bound of bucket `i` in microseconds, `None` for the last
    /// (+Inf) one.
    pub(crate) fn bound_us(i: usize) -> Option<u64> {
        (i < LATENCY_BOUNDS).then(|| 100u64 << i)
    }

    /// Each bucket's own count so far (not cumulative), +Inf last.
    pub(crate) fn counts(&self) -> [u64; LATENCY_BUCKETS] {
        std::array::from_fn(|i| self.0.buckets[i].get())
    }

    /// Count one observation of `elapsed`.
    pub(crate) fn observe(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        let bucket = (0..LATENCY_BOUNDS)
            .find(|&i| seconds <= Self::bound(i))
            .unwrap_or(LATENCY_BOUNDS);
        let stripes = &self.0;
        stripes
            .sum_nanos
            .add(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX));
        stripes.buckets[bucket].add(1);
    }
}

impl TypedMetric for LatencyHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for LatencyHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let stripes = &self.0;
        let buckets: Vec<(f64, u64)> = stripes
            .buckets
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let bound = if i < LATENCY_BOUNDS {
                    Self::bound(i)
                } else {
                    f64::INFINITY
                };
                (bound, b.get())
            })
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        encoder.encode_histogram::<NoLabelSet>(
            stripes.sum_nanos.get() as f64 / 1e9,
            count,
            &buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// The stripe of the calling thread: threads take stripes in turn as they
/// first add.
fn this_threads_stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
    }
    STRIPE.with(|s| *s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;
    use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
    use prometheus_client::registry::Registry;

    #[test]
    fn adds_from_many_threads_sum_exactly() {
        let counter = Arc::new(StripedU64::default());
        let threads: Vec<_> = (0..STRIPES + 3)
            .map(|i| {
                let counter = counter.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        counter.add(i as u64 + 1);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("an adding thread");
        }
        let n = (STRIPES + 3) as u64;
        assert_eq!(counter.get(), 1000 * n * (n + 1) / 2);
    }

    #[test]
    fn each_stripe_has_a_cache_line_of_its_own() {
        assert!(std::mem::align_of::<Stripe>() >= 128);
        assert_eq!(std::mem::size_of::<StripedU64>(), STRIPES * 128);
    }

    /// The text of `metric` registered alone as `m`, without the `# EOF`.
    fn text_of(
        metric: impl EncodeMetric + TypedMetric + std::fmt::Debug + Send + Sync + 'static,
    ) -> String {
        let mut registry = Registry::default();
        registry.register("m", "M.", metric);
        let mut text = String::new();
        encode(&mut text, &registry).expect("encoding");
        text
    }

    #[test]
    fn the_latency_histogram_reads_as_prometheus_clients_own() {
        // Whole milliseconds, so that the sums agree to the last digit.
        let seen = [0.0, 0.001, 0.003, 0.003, 0.2, 30.0];
        let ours = LatencyHistogram::default();
        let theirs = Histogram::new(exponential_buckets(0.0001, 2.0, 18));
        for s in seen {
            ours.observe(Duration::from_secs_f64(s));
            theirs.observe(s);
        }
        assert_eq!(text_of(ours), text_of(theirs));
    }

    #[test]
    fn counters_read_as_counters_of_what_was_added() {
        let calls = CallCounter::default();
        calls.inc();
        calls.clone().inc();
        assert!(text_of(calls).contains("m_total 2\n"));
        let seconds = SecondsCounter::default();
        seconds.inc_by(Duration::from_millis(1500));
        seconds.clone().inc_by(Duration::from_nanos(250));
        assert_eq!(seconds.get(), 1.500_000_25);
        let text = text_of(seconds);
        assert!(
            text.contains("# TYPE m counter") && text.contains("m_total 1.50000025\n"),
            "{text}"
        );
    }
}
