//! Trace context: the W3C `traceparent` of the request being served, so one
//! id follows a request from the client through the node that took it, the
//! peer link to the key's owner, the key's own calls to other keys, and the
//! guest's log lines.
//!
//! This module owns [`TraceContext`] — its parse and format per W3C Trace
//! Context level 1 (version `00`, lowercase hex, all-zero ids refused) and
//! the making of new ids — and the task-local that carries the context of
//! the request a task serves ([`scope`], [`current`]). The edges put it
//! there and take it out: the HTTP API (`http.rs`, which answers with the
//! `traceparent` header), the peer link (`wire.rs`'s `WireTrace`, converted
//! here), and the key's message envelope (`key/`), which carries it
//! explicitly because a queued message is handled on another task.
//!
//! It must not do I/O, export anything (OTLP export is not implemented), or
//! refuse a request: a `traceparent` that does not parse is ignored and a
//! new trace started in its place. Ids come from `fastrand`'s thread-local
//! generator: they need to be unique, not unpredictable.

use std::fmt;

/// The trace-flags bit that says the caller sampled the trace.
pub(crate) const SAMPLED: u8 = 0x01;

/// Where a request is in a trace: the trace's id, the id of the span that
/// made the request (the parent of whatever serves it), and the flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TraceContext {
    pub(crate) trace_id: [u8; 16],
    pub(crate) parent_id: [u8; 8],
    pub(crate) flags: u8,
}

impl TraceContext {
    /// A new trace (no caller sent one, or what it sent did not parse).
    pub(crate) fn new_root() -> Self {
        TraceContext {
            trace_id: nonzero_id(),
            parent_id: nonzero_id(),
            flags: SAMPLED,
        }
    }

    /// The context of a new span of the same trace, a child of `self`'s:
    /// what this node passes on, and answers with.
    pub(crate) fn child(&self) -> Self {
        TraceContext {
            parent_id: nonzero_id(),
            ..*self
        }
    }

    /// Parse a `traceparent` header value (W3C Trace Context level 1):
    /// `00-<32 hex trace-id>-<16 hex parent-id>-<2 hex flags>`, lowercase
    /// hex only, neither id all zeros. `None` for anything else, which the
    /// caller ignores (and starts a new trace).
    pub(crate) fn parse(header: &str) -> Option<Self> {
        let bytes = header.as_bytes();
        // Version 00 is exactly 55 characters; a later version may add
        // fields, but this node speaks 00 only.
        if bytes.len() != 55 || &bytes[..3] != b"00-" || bytes[35] != b'-' || bytes[52] != b'-' {
            return None;
        }
        let trace_id: [u8; 16] = hex(&bytes[3..35])?;
        let parent_id: [u8; 8] = hex(&bytes[36..52])?;
        let [flags] = hex::<1>(&bytes[53..55])?;
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return None;
        }
        Some(TraceContext {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// The trace id as 32 lowercase hex digits (what guest log lines and
    /// spans carry as `trace_id`).
    pub(crate) fn trace_hex(&self) -> TraceIdHex {
        TraceIdHex(self.trace_id)
    }

    /// The `traceparent` header value, `00-<trace-id>-<parent-id>-<flags>`
    /// (55 ASCII bytes), written without the formatting machinery: every
    /// API response carries one.
    pub(crate) fn traceparent(&self) -> [u8; 55] {
        let mut out = [b'-'; 55];
        out[..2].copy_from_slice(b"00");
        encode_hex(&self.trace_id, &mut out[3..35]);
        encode_hex(&self.parent_id, &mut out[36..52]);
        encode_hex(&[self.flags], &mut out[53..55]);
        out
    }
}

/// `traceparent` form: `00-<trace-id>-<parent-id>-<flags>`.
impl fmt::Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(ascii(&self.traceparent()))
    }
}

/// A trace id, displayed as 32 lowercase hex digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TraceIdHex([u8; 16]);

impl fmt::Display for TraceIdHex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = [0; 32];
        encode_hex(&self.0, &mut out);
        f.write_str(ascii(&out))
    }
}

/// `bytes` as lowercase hex into `out` (twice as long).
fn encode_hex(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (b, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0x0f)];
    }
}

/// The text of bytes this module wrote (hex digits and dashes: ASCII).
fn ascii(bytes: &[u8]) -> &str {
    std::str::from_utf8(bytes).expect("hex digits and dashes are ASCII")
}

/// The trace's form on the peer link.
impl From<TraceContext> for crate::wire::WireTrace {
    fn from(t: TraceContext) -> Self {
        crate::wire::WireTrace {
            trace_id: t.trace_id,
            parent_id: t.parent_id,
            flags: t.flags,
        }
    }
}

impl TraceContext {
    /// A peer's trace, if it is a valid one (a peer is held to the rules a
    /// client is: all-zero ids are none).
    pub(crate) fn from_wire(t: &crate::wire::WireTrace) -> Option<Self> {
        (t.trace_id != [0; 16] && t.parent_id != [0; 8]).then_some(TraceContext {
            trace_id: t.trace_id,
            parent_id: t.parent_id,
            flags: t.flags,
        })
    }
}

/// `N` bytes from `2N` lowercase hex digits.
fn hex<const N: usize>(digits: &[u8]) -> Option<[u8; N]> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    if digits.len() != 2 * N {
        return None;
    }
    let mut out = [0; N];
    for (i, pair) in digits.chunks_exact(2).enumerate() {
        out[i] = nibble(pair[0])? << 4 | nibble(pair[1])?;
    }
    Some(out)
}

/// `N` random bytes, not all zero.
fn nonzero_id<const N: usize>() -> [u8; N] {
    loop {
        let mut id = [0; N];
        id.iter_mut().for_each(|b| *b = fastrand::u8(..));
        if id != [0; N] {
            return id;
        }
    }
}

tokio::task_local! {
    /// The trace of the request this task serves.
    static CURRENT: Option<TraceContext>;
}

/// Run `future` with `trace` as the task's current trace.
pub(crate) async fn scope<F: Future>(trace: Option<TraceContext>, future: F) -> F::Output {
    CURRENT.scope(trace, future).await
}

/// Run `f` with `trace` as the current trace (for synchronous work, a cast).
pub(crate) fn sync_scope<R>(trace: Option<TraceContext>, f: impl FnOnce() -> R) -> R {
    CURRENT.sync_scope(trace, f)
}

/// The trace of the request this task serves, if any.
pub(crate) fn current() -> Option<TraceContext> {
    CURRENT.try_with(|t| *t).ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_parses_and_formats_back_the_same() {
        let t = TraceContext::parse(VALID).expect("valid");
        assert_eq!(t.trace_id[0], 0x4b);
        assert_eq!(t.parent_id[7], 0xb7);
        assert_eq!(t.flags, SAMPLED);
        assert_eq!(t.to_string(), VALID);
        assert_eq!(
            t.trace_hex().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        let unsampled = VALID.replace("-01", "-00");
        assert_eq!(TraceContext::parse(&unsampled).unwrap().flags, 0);
    }

    #[test]
    fn new_contexts_format_as_traceparents_that_parse_back() {
        for _ in 0..1000 {
            let t = TraceContext::new_root().child();
            let text = t.to_string();
            assert_eq!(TraceContext::parse(&text), Some(t), "{text}");
            assert_eq!(text.as_bytes(), t.traceparent());
            assert_eq!(&text[3..35], t.trace_hex().to_string());
        }
    }

    #[test]
    fn invalid_traceparents_are_refused() {
        let refused = [
            ("empty", String::new()),
            ("garbage", "hello".to_owned()),
            ("uppercase hex", VALID.to_uppercase()),
            ("wrong version", VALID.replacen("00", "01", 1)),
            ("version ff", VALID.replacen("00", "ff", 1)),
            (
                "all-zero trace id",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01".to_owned(),
            ),
            (
                "all-zero parent id",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01".to_owned(),
            ),
            ("too short", VALID[..54].to_owned()),
            ("too long", format!("{VALID}-extra")),
            ("not hex", VALID.replace("4bf9", "4bg9")),
            ("a separator missing", VALID.replacen('-', "_", 2)),
            ("a sign in the flags", VALID.replace("-01", "-+1")),
        ];
        for (what, header) in refused {
            assert_eq!(TraceContext::parse(&header), None, "{what}: {header:?}");
        }
    }

    #[test]
    fn new_traces_and_children_are_valid_and_distinct() {
        let root = TraceContext::new_root();
        assert_eq!(TraceContext::parse(&root.to_string()), Some(root));
        let child = root.child();
        assert_eq!(child.trace_id, root.trace_id);
        assert_ne!(child.parent_id, root.parent_id);
        assert_ne!(TraceContext::new_root().trace_id, root.trace_id);
        let wire = crate::wire::WireTrace::from(child);
        assert_eq!(TraceContext::from_wire(&wire), Some(child));
        let zero = crate::wire::WireTrace {
            trace_id: [0; 16],
            ..wire
        };
        assert_eq!(TraceContext::from_wire(&zero), None);
    }

    #[tokio::test]
    async fn the_current_trace_is_the_scope_s() {
        assert_eq!(current(), None);
        let t = TraceContext::new_root();
        assert_eq!(scope(Some(t), async { current() }).await, Some(t));
        assert_eq!(sync_scope(Some(t), current), Some(t));
        assert_eq!(current(), None);
    }
}
