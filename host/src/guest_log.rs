//! What a guest logs — the `log` import, and its stdout and stderr — as log
//! lines tagged with the module and key, within bounds a hostile guest
//! cannot lift.
//!
//! One [`GuestLogger`] per key process takes all three. Each is turned into
//! `tracing` events of target `fief::guest` with the module and key, so a
//! guest's `println!` shows up in the node's log attributed to it. The bounds:
//!
//! - **One line** is at most [`MAX_LOG_LINE`] bytes: a longer one is cut at a
//!   character boundary and marked `… [truncated: N bytes]` with its length.
//!   Stdout and stderr are split into lines at `\n`; of a line longer than
//!   the cap only the cap is kept (the rest is counted, not stored), so a
//!   huge write without a newline costs at most [`MAX_LOG_LINE`] bytes of
//!   host memory per stream.
//! - **A rate per key**, shared by the three and by the host's warnings
//!   about what the key did ([`GuestLogger::host_warning`]): two token buckets, lines
//!   (`max_log_lines_per_second`) and bytes (`max_log_bytes_per_second`),
//!   each with a burst of [`LOG_BURST_SECONDS`] seconds' worth (their
//!   defaults and ceilings are configuration's, `config/module.rs`). A line
//!   over either is dropped and counted (the `fief_guest_log_lines_dropped`
//!   metric), and the next line let through, at most once per
//!   [`DROP_NOTE_INTERVAL`], or the key's end, is preceded by a note saying
//!   how many were dropped.
//! - **Host time**: writing to stdout or stderr is host work done for the
//!   guest; its time is added up here ([`GuestLogger::take_host_nanos`]) and
//!   charged to the callback's CPU budget by the key's epoch callback (the
//!   `log` import charges its own, [`crate::key`]).
//!
//! [`bounded`] also cuts the other text a guest hands the host (errors,
//! refusals, fence reasons) to [`MAX_GUEST_ERROR`].

use std::borrow::Cow;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use prometheus_client::metrics::counter::Counter;
use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

use crate::bindings::types::LogLevel;
use crate::config::ByteSize;
use crate::sync::lock;
use crate::token_bucket::TokenBucket;
use crate::trace::TraceContext;

/// Longest log line a guest can make, in bytes (the truncation mark comes
/// on top).
pub const MAX_LOG_LINE: usize = 8 * 1024;

/// Longest error text a guest can hand the host (a `handle-call` error, an
/// `init` refusal, a fence stop reason), in bytes, before the truncation
/// mark: what a caller, the log, the event log and peers get at most.
pub const MAX_GUEST_ERROR: usize = 4 * 1024;

/// The log buckets' burst, in seconds of their rate.
pub const LOG_BURST_SECONDS: u32 = 10;

/// Least time between two "lines dropped" notes of one key.
pub const DROP_NOTE_INTERVAL: Duration = Duration::from_secs(1);

/// The most a WASI `write` to stdout or stderr may carry (its `check-write`
/// permit), as wasmtime's own streams.
const WRITE_PERMIT: usize = 64 * 1024;

/// `text` cut to at most `max` bytes at a character boundary, with a mark
/// naming its original length when it was cut.
pub(crate) fn bounded(text: String, max: usize) -> String {
    match bounded_str(&text, max) {
        Cow::Borrowed(_) => text,
        Cow::Owned(cut) => cut,
    }
}

fn bounded_str(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return Cow::Borrowed(text);
    }
    let head = &text[..text.floor_char_boundary(max)];
    Cow::Owned(format!("{head}… [truncated: {} bytes]", text.len()))
}

/// The rate limits of one key's log (from its module's options).
#[derive(Clone, Copy, Debug)]
pub(crate) struct LogLimits {
    pub(crate) lines_per_second: u32,
    pub(crate) bytes_per_second: u64,
}

/// A full bucket of `per_second` with a burst of [`LOG_BURST_SECONDS`] seconds'
/// worth, on real time (the node's log is real, whatever clock the node
/// runs on).
fn bucket(per_second: f64, now: Instant) -> TokenBucket<Instant> {
    TokenBucket::full(per_second, per_second * f64::from(LOG_BURST_SECONDS), now)
}

/// Which stream a [`GuestLog`] stands for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Stream {
    Stdout,
    Stderr,
}

/// The line a stream is in the middle of: at most [`MAX_LOG_LINE`] bytes of
/// it, and its whole length so far.
#[derive(Default)]
struct PartialLine {
    kept: Vec<u8>,
    len: usize,
}

impl PartialLine {
    fn push(&mut self, piece: &[u8]) {
        let room = MAX_LOG_LINE.saturating_sub(self.kept.len());
        self.kept.extend_from_slice(&piece[..piece.len().min(room)]);
        self.len += piece.len();
    }

    /// The line as text (marked if it was cut), leaving `self` empty.
    fn take(&mut self) -> String {
        let len = std::mem::take(&mut self.len);
        let kept = std::mem::take(&mut self.kept);
        if len <= kept.len() {
            return String::from_utf8_lossy(&kept).into_owned();
        }
        // Cut where the cap fell, without half a character at the end.
        let end = match std::str::from_utf8(&kept) {
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            _ => kept.len(),
        };
        format!(
            "{}… [truncated: {len} bytes]",
            String::from_utf8_lossy(&kept[..end])
        )
    }
}

struct LogState {
    lines: TokenBucket<Instant>,
    bytes: TokenBucket<Instant>,
    /// Lines dropped since the last note, and their bytes.
    dropped_lines: u64,
    dropped_bytes: u64,
    last_note: Option<Instant>,
    stdout: PartialLine,
    stderr: PartialLine,
    /// The trace of the message being handled: its lines carry its id.
    trace: Option<TraceContext>,
}

/// The log of one key process: the `log` import, stdout and stderr.
pub(crate) struct GuestLogger {
    module: Arc<str>,
    key: Arc<str>,
    limits: LogLimits,
    state: Mutex<LogState>,
    /// Host time spent on stdout and stderr writes not yet charged to the
    /// callback, in nanoseconds.
    host_nanos: AtomicU64,
    /// `fief_guest_log_lines_dropped{module}`.
    dropped: Counter,
    /// `fief_guest_log_lines_truncated{module}`.
    truncated: Counter,
}

/// How a line is emitted.
#[derive(Clone, Copy)]
enum Level {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

impl From<LogLevel> for Level {
    fn from(level: LogLevel) -> Self {
        match level {
            LogLevel::Trace => Level::Trace,
            LogLevel::Debug => Level::Debug,
            LogLevel::Info => Level::Info,
            LogLevel::Warn => Level::Warn,
            LogLevel::Error => Level::Error,
        }
    }
}

fn enabled(level: Level) -> bool {
    match level {
        Level::Trace => tracing::enabled!(target: "fief::guest", tracing::Level::TRACE),
        Level::Debug => tracing::enabled!(target: "fief::guest", tracing::Level::DEBUG),
        Level::Info => tracing::enabled!(target: "fief::guest", tracing::Level::INFO),
        Level::Warn => tracing::enabled!(target: "fief::guest", tracing::Level::WARN),
        Level::Error => tracing::enabled!(target: "fief::guest", tracing::Level::ERROR),
    }
}

impl GuestLogger {
    pub(crate) fn new(
        module: Arc<str>,
        key: Arc<str>,
        limits: LogLimits,
        (dropped, truncated): (Counter, Counter),
    ) -> Self {
        let now = Instant::now();
        GuestLogger {
            module,
            key,
            limits,
            state: Mutex::new(LogState {
                lines: bucket(f64::from(limits.lines_per_second), now),
                bytes: bucket(limits.bytes_per_second as f64, now),
                dropped_lines: 0,
                dropped_bytes: 0,
                last_note: None,
                stdout: PartialLine::default(),
                stderr: PartialLine::default(),
                trace: None,
            }),
            host_nanos: AtomicU64::new(0),
            dropped,
            truncated,
        }
    }

    /// The `log` import: one line at `level`, cut and rate-limited.
    pub(crate) fn log(&self, level: LogLevel, message: &str) {
        let level = Level::from(level);
        if !enabled(level) {
            return;
        }
        let line = bounded_str(message, MAX_LOG_LINE);
        if matches!(line, Cow::Owned(_)) {
            self.truncated.inc();
        }
        let mut state = lock(&self.state);
        if self.admit(&mut state, line.len(), Instant::now()) {
            self.emit(level, None, &line, state.trace);
        }
    }

    /// A host warning this key's doing caused (a timer of its dropped at a
    /// full mailbox, an output held for its commit dropped): a `warn` line
    /// of target `fief::key` naming the module and key, under the key's log
    /// rate like its own lines, so a guest cannot flood the node's log
    /// through the host either (a key arming thousands of timers while its
    /// mailbox is full wrote a line per timer). Dropped lines are counted
    /// and noted as the guest's are.
    pub(crate) fn host_warning(&self, text: std::fmt::Arguments<'_>) {
        if !tracing::enabled!(target: "fief::key", tracing::Level::WARN) {
            return;
        }
        let text = text.to_string();
        let mut state = lock(&self.state);
        if self.admit(&mut state, text.len(), Instant::now()) {
            let (module, key) = (&*self.module, &*self.key);
            tracing::warn!(target: "fief::key", module, key, "{text}");
        }
    }

    /// What the guest wrote to `stream`: every line it completes is emitted
    /// (cut and rate-limited); an unfinished one waits, at most
    /// [`MAX_LOG_LINE`] bytes of it.
    pub(crate) fn write(&self, stream: Stream, mut bytes: &[u8]) {
        let mut state = lock(&self.state);
        while let Some(end) = bytes.iter().position(|&b| b == b'\n') {
            let partial = match stream {
                Stream::Stdout => &mut state.stdout,
                Stream::Stderr => &mut state.stderr,
            };
            partial.push(&bytes[..end]);
            bytes = &bytes[end + 1..];
            self.finish_line(&mut state, stream);
        }
        match stream {
            Stream::Stdout => state.stdout.push(bytes),
            Stream::Stderr => state.stderr.push(bytes),
        }
    }

    /// The trace of the callback about to run (`None` between messages and
    /// for those that carry none): each line after this names its id as
    /// `trace_id`.
    pub(crate) fn set_trace(&self, trace: Option<TraceContext>) {
        lock(&self.state).trace = trace;
    }

    /// Add `spent` to the host time of stream writes.
    fn spent(&self, spent: Duration) {
        let nanos = u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX);
        self.host_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Host time spent on stdout and stderr writes since the last call.
    pub(crate) fn take_host_nanos(&self) -> u64 {
        self.host_nanos.swap(0, Ordering::Relaxed)
    }

    fn finish_line(&self, state: &mut LogState, stream: Stream) {
        let (partial, level) = match stream {
            Stream::Stdout => (&mut state.stdout, Level::Info),
            Stream::Stderr => (&mut state.stderr, Level::Warn),
        };
        let cut = partial.len > MAX_LOG_LINE;
        if !enabled(level) {
            partial.kept.clear();
            partial.len = 0;
            return;
        }
        let line = partial.take();
        if cut {
            self.truncated.inc();
        }
        if self.admit(state, line.len(), Instant::now()) {
            self.emit(level, Some(stream), &line, state.trace);
        }
    }

    /// Whether a line of `len` bytes fits the key's rate; counts it dropped
    /// if not. A line let through is preceded by the note of earlier drops
    /// when one is due.
    fn admit(&self, state: &mut LogState, len: usize, now: Instant) -> bool {
        state.lines.refill(now);
        state.bytes.refill(now);
        let len_tokens = len as f64;
        if !state.lines.holds(1.0) || !state.bytes.holds(len_tokens) {
            state.dropped_lines += 1;
            state.dropped_bytes += len as u64;
            self.dropped.inc();
            return false;
        }
        state.lines.spend(1.0);
        state.bytes.spend(len_tokens);
        if state.dropped_lines > 0
            && state
                .last_note
                .is_none_or(|at| now.saturating_duration_since(at) >= DROP_NOTE_INTERVAL)
        {
            self.note_dropped(state);
            state.last_note = Some(now);
        }
        true
    }

    fn note_dropped(&self, state: &mut LogState) {
        let (lines, bytes) = (state.dropped_lines, state.dropped_bytes);
        state.dropped_lines = 0;
        state.dropped_bytes = 0;
        let (module, key) = (&*self.module, &*self.key);
        tracing::warn!(
            target: "fief::guest",
            module,
            key,
            dropped_lines = lines,
            "{lines} log lines ({bytes} bytes) of this key were dropped: over its log rate \
             limit (max_log_lines_per_second = {}, max_log_bytes_per_second = {})",
            self.limits.lines_per_second,
            ByteSize::b(self.limits.bytes_per_second),
        );
    }

    fn emit(&self, level: Level, stream: Option<Stream>, text: &str, trace: Option<TraceContext>) {
        let (module, key) = (&*self.module, &*self.key);
        // Absent (not empty) on a line of no trace.
        let trace_id = trace.map(|t| tracing::field::display(t.trace_hex()));
        match (level, stream) {
            (Level::Trace, _) => {
                tracing::trace!(target: "fief::guest", module, key, trace_id, "{text}")
            }
            (Level::Debug, _) => {
                tracing::debug!(target: "fief::guest", module, key, trace_id, "{text}")
            }
            (Level::Info, None) => {
                tracing::info!(target: "fief::guest", module, key, trace_id, "{text}")
            }
            (Level::Warn, None) => {
                tracing::warn!(target: "fief::guest", module, key, trace_id, "{text}")
            }
            (Level::Error, _) => {
                tracing::error!(target: "fief::guest", module, key, trace_id, "{text}")
            }
            (Level::Info, Some(_)) => tracing::info!(
                target: "fief::guest",
                module,
                key,
                trace_id,
                stream = "stdout",
                "{text}"
            ),
            (Level::Warn, Some(_)) => tracing::warn!(
                target: "fief::guest",
                module,
                key,
                trace_id,
                stream = "stderr",
                "{text}"
            ),
        }
    }
}

impl Drop for GuestLogger {
    /// The key's end: what is left of its stdout and stderr lines, and the
    /// note of lines dropped since the last one.
    fn drop(&mut self) {
        let mut state = lock(&self.state);
        for stream in [Stream::Stdout, Stream::Stderr] {
            let partial = match stream {
                Stream::Stdout => &state.stdout,
                Stream::Stderr => &state.stderr,
            };
            if partial.len > 0 {
                self.finish_line(&mut state, stream);
            }
        }
        if state.dropped_lines > 0 {
            self.note_dropped(&mut state);
        }
    }
}

/// A guest's stdout or stderr, writing to its [`GuestLogger`]. Every WASI
/// stream the guest opens on it shares the logger's line of that stream.
#[derive(Clone)]
pub(crate) struct GuestLog {
    logger: Arc<GuestLogger>,
    stream: Stream,
}

impl GuestLog {
    pub(crate) fn new(logger: Arc<GuestLogger>, stream: Stream) -> Self {
        GuestLog { logger, stream }
    }

    /// Write on the guest's behalf, timing it as host work.
    fn write(&self, bytes: &[u8]) {
        let start = Instant::now();
        self.logger.write(self.stream, bytes);
        self.logger.spent(start.elapsed());
    }
}

impl IsTerminal for GuestLog {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for GuestLog {
    /// The WASI 0.2 stream: written synchronously, in the guest's import
    /// call, so its host time is the callback's (not a worker task's).
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

impl OutputStream for GuestLog {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        GuestLog::write(self, &bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(WRITE_PERMIT)
    }
}

impl Pollable for GuestLog {
    /// Always ready: a write never waits.
    fn ready<'a, 'b>(&'a mut self) -> Pin<Box<dyn Future<Output = ()> + Send + 'b>>
    where
        'a: 'b,
        Self: 'b,
    {
        Box::pin(std::future::ready(()))
    }
}

impl AsyncWrite for GuestLog {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        GuestLog::write(&self, buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logger(lines: u32, bytes: u64) -> GuestLogger {
        GuestLogger::new(
            Arc::from("m"),
            Arc::from("k"),
            LogLimits {
                lines_per_second: lines,
                bytes_per_second: bytes,
            },
            (Counter::default(), Counter::default()),
        )
    }

    #[test]
    fn long_text_is_cut_at_a_character_boundary_and_marked() {
        assert_eq!(bounded("short".to_owned(), 8), "short");
        // 'é' is two bytes: a cut at 3 would split the second one.
        let cut = bounded("éééé".to_owned(), 3);
        assert_eq!(cut, "é… [truncated: 8 bytes]");
        let huge = "x".repeat(40_000_000);
        let cut = bounded(huge, MAX_LOG_LINE);
        assert!(cut.starts_with(&"x".repeat(MAX_LOG_LINE)));
        assert!(cut.ends_with("… [truncated: 40000000 bytes]"), "{cut:.20}");
        assert!(cut.len() < MAX_LOG_LINE + 64);
    }

    #[test]
    fn a_stream_keeps_at_most_one_capped_line_and_marks_its_length() {
        let mut line = PartialLine::default();
        for _ in 0..1000 {
            line.push(&[b'y'; 10_000]);
        }
        assert_eq!(line.kept.len(), MAX_LOG_LINE, "bounded in memory");
        let text = line.take();
        assert!(
            text.ends_with("… [truncated: 10000000 bytes]"),
            "{text:.20}"
        );
        assert_eq!(line.len, 0);
        // Half a character at the cap is left out.
        let mut line = PartialLine::default();
        line.push(&vec![b'a'; MAX_LOG_LINE - 1]);
        line.push("é".as_bytes());
        let text = line.take();
        assert!(!text.contains('\u{FFFD}'), "no half character");
        assert!(text.ends_with("a… [truncated: 8193 bytes]"));
    }

    #[test]
    fn lines_over_the_rate_are_dropped_counted_and_noted() {
        let log = logger(10, 1 << 20);
        let t0 = Instant::now();
        let mut state = lock(&log.state);
        // The burst: ten seconds' worth.
        for _ in 0..100 {
            assert!(log.admit(&mut state, 10, t0));
        }
        assert!(!log.admit(&mut state, 10, t0));
        assert!(!log.admit(&mut state, 10, t0));
        assert_eq!(state.dropped_lines, 2);
        assert_eq!(log.dropped.get(), 2);
        // A tenth of a second brings one line back; letting it through
        // notes the drops (and clears them).
        let t1 = t0 + Duration::from_millis(101);
        assert!(log.admit(&mut state, 10, t1));
        assert_eq!(state.dropped_lines, 0);
        assert_eq!(log.dropped.get(), 2, "the metric keeps counting");
    }

    #[test]
    fn bytes_over_the_rate_are_dropped_too() {
        let log = logger(1000, 100);
        let t0 = Instant::now();
        let mut state = lock(&log.state);
        // A burst of 1000 bytes.
        assert!(log.admit(&mut state, 600, t0));
        assert!(!log.admit(&mut state, 600, t0));
        assert_eq!((state.dropped_lines, state.dropped_bytes), (1, 600));
        // What is left still takes a smaller line (which notes the drop).
        assert!(log.admit(&mut state, 400, t0));
        assert_eq!(state.dropped_lines, 0);
        assert!(!log.admit(&mut state, 1, t0));
        assert_eq!(log.dropped.get(), 2);
    }

    #[test]
    fn stream_writes_split_into_lines_and_time_is_counted() {
        let log = Arc::new(logger(1000, 1 << 20));
        let out = GuestLog::new(log.clone(), Stream::Stdout);
        out.write(b"one\ntw");
        out.write(b"o\n");
        {
            let state = lock(&log.state);
            assert_eq!(state.stdout.len, 0);
        }
        out.write(&vec![b'z'; 100_000]);
        assert_eq!(lock(&log.state).stdout.kept.len(), MAX_LOG_LINE);
        assert_eq!(lock(&log.state).stdout.len, 100_000);
        assert!(log.take_host_nanos() > 0);
        assert_eq!(log.take_host_nanos(), 0, "taken once");
    }
}
