//! The peer link's wire types: every value one node sends another, in one
//! place, so the format a peer must speak reads in one file.
//!
//! A frame is one length-delimited payload ([`codec`]: at most the node's
//! `max_message_size` plus [`FRAME_OVERHEAD`]) holding one postcard value:
//! first the handshake's [`Handshake`] frames (`peer_auth.rs`), then
//! [`Frame`]s, each a request ([`PeerRequest`]) or the response to one. A
//! response body is postcard too: a [`CacheOutcome`], a [`LoadedModules`],
//! a call's reply as sent, or a [`WireError`].
//!
//! Postcard has no field names and no tags beyond variant indices, so the
//! format is the order of variants and fields: a change here is a change of
//! the protocol, and it must keep what older peers send readable (a new
//! field goes last and an older sender's frame, which ends before it, is
//! read as without it: see [`decode_frame`]). The tests below and `fuzz/`
//! pin it.
//!
//! This module must not do I/O, decide anything, or import any other part
//! of the node but [`crate::error`]: the transport (`transport.rs`) and the
//! handshake (`peer_auth.rs`) move these values, the node (`node/`), the
//! cache and the deploys act on them. The cache's value types
//! ([`CacheEntry`], [`Expect`]) live here because they cross the wire;
//! `crate::cache` re-exports them as its API.

use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio_util::codec::LengthDelimitedCodec;

use crate::error::{Error, Result};

/// Room for everything in a frame besides the message itself.
pub(crate) const FRAME_OVERHEAD: usize = 8 * 1024;
/// What one node asks another.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum PeerRequest {
    /// The first frame on a connection: who is calling, for which
    /// namespace, and what it speaks beyond the requests every version
    /// does ([`FEATURE_TOPICS`]). `features` is last: an older receiver
    /// ignores it (postcard leaves trailing bytes unread), and an older
    /// sender's hello, which ends before it, reads as speaking none
    /// ([`decode_frame`]).
    Hello {
        namespace: String,
        node: String,
        features: u64,
    },
    /// Call a key; the response carries its reply. `trace`, the caller's
    /// trace context, is last: an older receiver ignores it, and an older
    /// sender's call, which ends before it, reads as carrying none
    /// ([`decode_frame`]).
    Call {
        module: String,
        key: String,
        message: Vec<u8>,
        timeout_ms: u64,
        trace: Option<WireTrace>,
    },
    /// Cast to a key; `trace` as in [`PeerRequest::Call`].
    Cast {
        module: String,
        key: String,
        message: Vec<u8>,
        trace: Option<WireTrace>,
    },
    /// Graceful move, step 1: the old owner hands over the state of the keys
    /// it stopped, before it gives the partitions away (in as many frames as
    /// the states need, each under the frame limit; see `handoff.rs`), and
    /// names the move attempt each partition's states belong to: at least
    /// one frame an attempt, states or none.
    Handoff {
        entries: Vec<HandoffEntry>,
        /// The attempt's rows for this frame's states, and (in its first
        /// frames) for the attempt's other partitions. Last, so a receiver
        /// of an older version ignores them, and a frame of a sender of an
        /// older version, which ends where they would begin, is read as
        /// sending none ([`decode_frame`]).
        manifest: Vec<HandoffRow>,
    },
    /// The leader asks the owner to hand these partitions to these nodes.
    Move { moves: Vec<(u32, String)> },
    /// The table changed: refresh it now rather than at the next renewal.
    Nudge,
    /// A cache operation for a key the receiver owns; the response carries
    /// the postcard-encoded outcome.
    Cache(CacheOp),
    /// Which module versions the receiver has loaded; the response carries
    /// them postcard-encoded (see `node/deploy.rs`).
    LoadedModules,
    /// Cluster-wide pub/sub: the sender's subscriber counts by topic, as
    /// changed (`pubsub/interest.rs`); the response is an [`InterestAck`].
    /// Sent only to a peer whose hello said [`FEATURE_TOPICS`].
    Interest(InterestUpdate),
    /// Cluster-wide pub/sub: publications for the receiver's own
    /// subscribers, in the order they were published on the sender. The
    /// receiver delivers them and never forwards them again; the response
    /// is empty. Sent only to a peer whose hello said [`FEATURE_TOPICS`].
    Publish { publications: Vec<Publication> },
    /// WebSocket connections: events of connections the sender holds, for
    /// the key `module`/`key` the receiver owns, in the order they
    /// happened; the response is a [`ConnAck`]. Sent only to a peer whose
    /// hello said [`FEATURE_CONNECTIONS`].
    ConnEvents {
        module: String,
        key: String,
        /// The number of the first event's frame (frames and closes are
        /// numbered from 1 per connection; `opened` is 0), the next ones
        /// following: the owner does not handle a number twice.
        seq: u64,
        events: Vec<ConnEvent>,
        /// Passed before, its answer lost: maybe handled already.
        again: bool,
    },
    /// WebSocket connections: frames and closes a key on the sender sent
    /// to connections the receiver holds, in order; the response is empty.
    /// Sent only to a peer whose hello said [`FEATURE_CONNECTIONS`].
    ConnSend { sends: Vec<ConnSend> },
    /// WebSocket connections: with a graceful move, the connections
    /// attached to the moving keys, for their next owner (before it serves
    /// them); the response is empty.
    Attach { attachments: Vec<WireAttachment> },
    /// The dashboard: the receiver's last minutes of figures, one sample a
    /// second, oldest first (at most `dashboard_history::HISTORY_SAMPLES`);
    /// the response is a [`WireHistory`]. Sent only to a peer whose hello
    /// said [`FEATURE_HISTORY`].
    History,
}

/// The [`PeerRequest::Hello`] feature bit of the dashboard's history
/// ([`PeerRequest::History`]).
pub(crate) const FEATURE_HISTORY: u64 = 4;

/// One second of a node's figures, as one peer tells another (see
/// `dashboard_history.rs`, which converts it).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct WireSample {
    pub(crate) at_ms: u64,
    pub(crate) calls: u64,
    pub(crate) p99_us: Option<u64>,
    pub(crate) live_keys: u64,
    pub(crate) fences: u64,
}

/// The answer to [`PeerRequest::History`]: the samples, oldest first.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct WireHistory(pub(crate) Vec<WireSample>);

/// A W3C trace context as it crosses the wire (`crate::trace` converts it
/// and refuses all-zero ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WireTrace {
    pub(crate) trace_id: [u8; 16],
    pub(crate) parent_id: [u8; 8],
    pub(crate) flags: u8,
}

/// A connection attached to a key, handed to the key's next owner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WireAttachment {
    pub(crate) module: String,
    pub(crate) key: String,
    pub(crate) id: u64,
    pub(crate) via: String,
    pub(crate) handled: u64,
    pub(crate) known_from: u64,
}

/// The [`PeerRequest::Hello`] feature bit of WebSocket connections
/// ([`PeerRequest::ConnEvents`] and [`PeerRequest::ConnSend`]).
pub(crate) const FEATURE_CONNECTIONS: u64 = 2;

/// Something that happened to a WebSocket connection, for its key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ConnEvent {
    /// The connection is attached to the key: it opened (`resumed` false),
    /// or it is handed to a new owner. `via`: the node holding it.
    Opened { id: u64, via: String, resumed: bool },
    /// A text frame from the client.
    Text { id: u64, text: String },
    /// A binary frame from the client.
    Binary { id: u64, data: Vec<u8> },
    /// The connection closed.
    Closed { id: u64, code: u16, reason: String },
}

impl ConnEvent {
    /// The bytes of payload it carries.
    pub(crate) fn payload_bytes(&self) -> usize {
        match self {
            ConnEvent::Opened { via, .. } => via.len(),
            ConnEvent::Text { text, .. } => text.len(),
            ConnEvent::Binary { data, .. } => data.len(),
            ConnEvent::Closed { reason, .. } => reason.len(),
        }
    }
}

/// The owner's answer to [`PeerRequest::ConnEvents`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ConnAck {
    /// Every event was handled by the key (its handler ran).
    Delivered,
    /// The connection was refused (a limit, or the module takes no
    /// connections): close it with this code and reason.
    Refused { code: u16, reason: String },
    /// A frame of a connection the owner does not have attached (it became
    /// the owner since): attach it (`opened`, `resumed`) and send again.
    Unattached,
    /// Not handled (the key stopped, moved or died before it): send it
    /// again, to whichever node owns the key then.
    Retry,
}

/// A frame or a close, from a key to one of its connections.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ConnSend {
    /// A text frame.
    Text { id: u64, text: String },
    /// A binary frame.
    Binary { id: u64, data: Vec<u8> },
    /// Close it.
    Close { id: u64, code: u16, reason: String },
}

impl ConnSend {
    /// The connection it is for.
    pub(crate) fn id(&self) -> u64 {
        match self {
            ConnSend::Text { id, .. }
            | ConnSend::Binary { id, .. }
            | ConnSend::Close { id, .. } => *id,
        }
    }

    /// The bytes it holds.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            ConnSend::Text { text, .. } => text.len(),
            ConnSend::Binary { data, .. } => data.len(),
            ConnSend::Close { reason, .. } => reason.len(),
        }
    }
}

/// The [`PeerRequest::Hello`] feature bit of cluster-wide pub/sub
/// ([`PeerRequest::Interest`] and [`PeerRequest::Publish`]).
pub(crate) const FEATURE_TOPICS: u64 = 1;

/// A change of the sender's interest: for each topic, how many subscriber
/// processes it has now (0: none left).
///
/// Updates of one *stream* are numbered from 0; the receiver applies one
/// only if it is the next of the stream it holds, or if it starts a stream
/// (`reset`: forget what the sender said before; the sender's whole
/// interest follows, in as many updates as it needs). Anything else is
/// answered [`InterestAck::Resync`] and the sender starts a new stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct InterestUpdate {
    /// The sender's node name.
    pub(crate) node: String,
    pub(crate) stream: u64,
    pub(crate) seq: u64,
    pub(crate) reset: bool,
    pub(crate) counts: Vec<(String, u32)>,
}

/// The receiver's answer to an [`InterestUpdate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum InterestAck {
    /// Applied.
    Applied,
    /// Not the next update of the stream the receiver holds: start a new
    /// stream.
    Resync,
}

/// One publication forwarded to a peer: the topic (already scoped to its
/// tenant) and the payload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Publication {
    pub(crate) topic: String,
    pub(crate) payload: Vec<u8>,
}

/// One key's handoff state, on its way to the new owner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HandoffEntry {
    pub(crate) module: String,
    pub(crate) key: String,
    /// The key's partition.
    pub(crate) partition: u32,
    /// The token the sender holds the partition under: the receiver serves
    /// the state only if it gets the partition by a handoff from it.
    pub(crate) token: u64,
    pub(crate) state: Vec<u8>,
}

/// One partition of a handoff attempt (`fief_core::handoff::Row`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HandoffRow {
    pub(crate) partition: u32,
    /// The token the sender holds the partition under.
    pub(crate) token: u64,
    /// The sender's move attempt: a newer one supersedes the older ones'
    /// states of the partition under the token.
    pub(crate) attempt: u64,
}

/// An error as it crosses the wire.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct WireError {
    code: String,
    message: String,
}

impl From<&Error> for WireError {
    fn from(e: &Error) -> Self {
        let message = match e {
            Error::Rejected(why) => why.clone(),
            other => other.to_string(),
        };
        WireError {
            code: e.code().to_owned(),
            message,
        }
    }
}

impl WireError {
    /// The error as the caller sees it, naming the owner `peer` that sent
    /// it (a refusal the caller may act on keeps its code and status).
    pub(crate) fn into_error(self, peer: &str) -> Error {
        match self.code.as_str() {
            "rejected" => Error::Rejected(self.message),
            "unknown_module" => Error::Remote {
                code: "unknown_module".to_owned(),
                status: 404,
                message: self.message,
            },
            code => Error::Remote {
                status: code_status(code),
                code: code.to_owned(),
                message: format!("{} (from the owner, node {peer})", self.message),
            },
        }
    }
}

fn code_status(code: &str) -> u16 {
    match code {
        "invalid_key" | "invalid_module_name" => 400,
        "message_too_large" | "cache_entry_too_large" => 413,
        "init_refused" => 422,
        "overloaded" | "too_many_keys" | "cache_full" | "compile_busy" => 429,
        "key_died" | "internal" => 500,
        "timeout" => 504,
        _ => 503,
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Frame {
    Request {
        id: u64,
        body: PeerRequest,
    },
    Response {
        id: u64,
        body: std::result::Result<Vec<u8>, WireError>,
    },
}

pub(crate) fn codec(max_message: usize) -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .max_frame_length(max_message + FRAME_OVERHEAD)
        .new_codec()
}

pub(crate) fn encode(frame: &Frame) -> Result<Bytes> {
    postcard::to_stdvec(frame)
        .map(Bytes::from)
        .map_err(|e| Error::Internal(format!("encoding a peer frame: {e}")))
}

/// Decode the payload of one length-delimited frame from a peer: with the
/// codec, the only parser of bytes a peer sends (fuzzed by
/// `fuzz/fuzz_targets/peer_frames.rs` through [`crate::fuzz`]).
///
/// A handoff from a sender of the version before move attempts has no
/// `manifest`: postcard has no field names, so its frame simply ends where
/// the field would begin. Only that reads as no rows — a frame that is
/// exactly an [`OlderFrame`] handoff, to its last byte. Anything else that
/// fails (a bad length, rows cut short or malformed) is a corrupt frame,
/// refused like any other. A hello without `features` and a call or cast
/// without `trace` are read the same way.
///
/// # Errors
///
/// postcard's error for a frame that is not one.
pub(crate) fn decode_frame(bytes: &[u8]) -> std::result::Result<Frame, postcard::Error> {
    match postcard::from_bytes(bytes) {
        Err(postcard::Error::DeserializeUnexpectedEnd) => older_handoff(bytes)
            .or_else(|| older_hello(bytes))
            .or_else(|| untraced(bytes))
            .ok_or(postcard::Error::DeserializeUnexpectedEnd),
        read => read,
    }
}

/// `bytes` as an older sender's handoff, if that is all they are.
fn older_handoff(bytes: &[u8]) -> Option<Frame> {
    match postcard::take_from_bytes(bytes) {
        Ok((
            OlderFrame::Request {
                id,
                body: OlderRequest::Handoff { entries },
            },
            [],
        )) => Some(Frame::Request {
            id,
            body: PeerRequest::Handoff {
                entries,
                manifest: Vec::new(),
            },
        }),
        _ => None,
    }
}

/// `bytes` as an older sender's hello (no `features`), if that is all
/// they are: a peer that speaks none of the newer requests.
fn older_hello(bytes: &[u8]) -> Option<Frame> {
    match postcard::take_from_bytes(bytes) {
        Ok((
            OlderHelloFrame::Request {
                id,
                body: OlderHello::Hello { namespace, node },
            },
            [],
        )) => Some(Frame::Request {
            id,
            body: PeerRequest::Hello {
                namespace,
                node,
                features: 0,
            },
        }),
        _ => None,
    }
}

/// `bytes` as an older sender's call or cast (no `trace`), if that is all
/// they are.
fn untraced(bytes: &[u8]) -> Option<Frame> {
    let (OlderFrame::Request { id, body }, []) = postcard::take_from_bytes(bytes).ok()? else {
        return None;
    };
    let body = match body {
        OlderRequest::Call {
            module,
            key,
            message,
            timeout_ms,
        } => PeerRequest::Call {
            module,
            key,
            message,
            timeout_ms,
            trace: None,
        },
        OlderRequest::Cast {
            module,
            key,
            message,
        } => PeerRequest::Cast {
            module,
            key,
            message,
            trace: None,
        },
        OlderRequest::Hello | OlderRequest::Handoff { .. } => return None,
    };
    Some(Frame::Request { id, body })
}

/// A hello as a sender of the version before `features` wrote it.
#[derive(Debug, Serialize, Deserialize)]
enum OlderHelloFrame {
    Request { id: u64, body: OlderHello },
}

/// [`PeerRequest::Hello`] as [`OlderHelloFrame`] reads it.
#[derive(Debug, Serialize, Deserialize)]
enum OlderHello {
    Hello { namespace: String, node: String },
}

/// A frame as a sender of an older version wrote a call or a cast (before
/// `trace`), or a handoff (before move attempts: no `manifest`). `Hello`
/// only holds its place (postcard numbers variants in order).
#[derive(Debug, Serialize, Deserialize)]
enum OlderFrame {
    Request { id: u64, body: OlderRequest },
}

/// [`PeerRequest`] as [`OlderFrame`] reads it.
#[derive(Debug, Serialize, Deserialize)]
enum OlderRequest {
    Hello,
    Call {
        module: String,
        key: String,
        message: Vec<u8>,
        timeout_ms: u64,
    },
    Cast {
        module: String,
        key: String,
        message: Vec<u8>,
    },
    Handoff {
        entries: Vec<HandoffEntry>,
    },
}

/// A cached value and its version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheEntry {
    /// The value, as put.
    pub value: Vec<u8>,
    /// Its version: strictly increasing over every write of the partition,
    /// across owners. Never 0.
    pub version: u64,
    /// Time left before it expires, if it was put with a time-to-live.
    pub expires_in: Option<Duration>,
}

/// The precondition of a write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Expect {
    /// Write whatever is there.
    #[default]
    Any,
    /// Write only if there is no entry (`If-None-Match: *`).
    Absent,
    /// Write only if the entry's version is this one (`If-Match`).
    Version(u64),
}

/// One cache operation, as routed to the owner.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum CacheOp {
    Get {
        namespace: String,
        key: String,
    },
    Put {
        namespace: String,
        key: String,
        value: Vec<u8>,
        ttl_ms: Option<u64>,
        expect: Expect,
    },
    Delete {
        namespace: String,
        key: String,
        expect: Expect,
    },
}

impl CacheOp {
    /// The key the operation is for (it routes to the key's owner).
    pub(crate) fn key(&self) -> &str {
        let (CacheOp::Get { key, .. } | CacheOp::Put { key, .. } | CacheOp::Delete { key, .. }) =
            self;
        key
    }
}

/// What the owner answers to a [`CacheOp`] (sent back over the transport).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum CacheOutcome {
    Found(Option<CacheEntry>),
    Written {
        version: u64,
    },
    Deleted(bool),
    /// The precondition did not hold; carries the current version.
    Conflict {
        current: Option<u64>,
    },
}

impl CacheOutcome {
    pub(crate) fn encode(&self) -> Vec<u8> {
        postcard::to_stdvec(self).expect("cache outcomes always serialize")
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Self> {
        postcard::from_bytes(bytes)
            .map_err(|e| Error::Internal(format!("a peer sent a malformed cache reply: {e}")))
    }
}

/// The handshake's frames.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Handshake {
    ClientHello {
        version: u32,
        nonce: [u8; 32],
        secret: bool,
    },
    ServerHello {
        nonce: [u8; 32],
        proof: Option<[u8; 32]>,
    },
    ClientProof {
        proof: Option<[u8; 32]>,
    },
    Accepted,
    Refused {
        why: String,
    },
}

/// What a node has loaded, as one peer tells another: (module, version).
#[derive(Serialize, Deserialize)]
pub(crate) struct LoadedModules(pub(crate) Vec<(String, u64)>);

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> HandoffEntry {
        HandoffEntry {
            module: "m".to_owned(),
            key: "k".to_owned(),
            partition: 3,
            token: 9,
            state: b"5".to_vec(),
        }
    }

    fn row() -> HandoffRow {
        HandoffRow {
            partition: 3,
            token: 9,
            attempt: 4,
        }
    }

    fn handoff(id: u64, manifest: Vec<HandoffRow>) -> Frame {
        Frame::Request {
            id,
            body: PeerRequest::Handoff {
                entries: vec![entry()],
                manifest,
            },
        }
    }

    /// The manifest `bytes` decode to, or why they do not.
    fn manifest_of(bytes: &[u8]) -> std::result::Result<Vec<HandoffRow>, postcard::Error> {
        match decode_frame(bytes)? {
            Frame::Request {
                body: PeerRequest::Handoff { manifest, .. },
                ..
            } => Ok(manifest),
            other => panic!("not a handoff: {other:?}"),
        }
    }

    #[test]
    fn a_handoff_without_a_manifest_still_reads_and_an_older_receiver_reads_one_with() {
        let old = OlderFrame::Request {
            id: 1,
            body: OlderRequest::Handoff {
                entries: vec![entry()],
            },
        };
        let bytes = postcard::to_stdvec(&old).unwrap();
        let Frame::Request {
            id: 1,
            body: PeerRequest::Handoff { entries, manifest },
        } = decode_frame(&bytes).unwrap()
        else {
            panic!("not a handoff")
        };
        assert_eq!((entries.len(), manifest.len()), (1, 0));
        let bytes = encode(&handoff(2, vec![row()])).unwrap();
        assert_eq!(manifest_of(&bytes).unwrap(), vec![row()]);
        let OlderFrame::Request {
            id: 2,
            body: OlderRequest::Handoff { entries },
        } = postcard::from_bytes(&bytes).unwrap()
        else {
            panic!("not a handoff")
        };
        assert_eq!(entries[0].state, b"5");
    }

    /// Only a frame that ends exactly where the manifest begins reads as
    /// one without; a manifest that is there but corrupt is refused, never
    /// taken for none (which would lose the attempt's rows and serve its
    /// states as if no attempt had named them).
    #[test]
    fn a_handoff_whose_manifest_is_corrupt_is_refused_not_read_as_none() {
        let bytes = encode(&handoff(3, vec![row(), row()])).unwrap();
        // The manifest is the frame's last field: its length (one byte
        // here), then its rows.
        let rows = 2 * postcard::to_stdvec(&row()).unwrap().len();
        let before = &bytes[..bytes.len() - rows - 1];
        assert_eq!(manifest_of(&bytes).unwrap(), vec![row(), row()]);
        assert_eq!(manifest_of(before).unwrap(), vec![], "an older sender");
        let corrupt: [(&str, Vec<u8>); 5] = [
            ("a length that is no varint", [before, &[0xFF; 11]].concat()),
            ("a length cut short", [before, &[0x80]].concat()),
            ("rows cut short", bytes[..bytes.len() - 1].to_vec()),
            (
                "a row missing",
                [before, &[2], &bytes[bytes.len() - rows / 2..]].concat(),
            ),
            ("a malformed row", [before, &[1, 3], &[0xFF; 11]].concat()),
        ];
        for (what, frame) in corrupt {
            assert!(
                manifest_of(&frame).is_err(),
                "{what}: read as {:?}",
                manifest_of(&frame)
            );
        }
    }

    fn a_trace() -> WireTrace {
        WireTrace {
            trace_id: [0x4b; 16],
            parent_id: [7; 8],
            flags: 1,
        }
    }

    /// Issue 22 item 4: an older sender's call and cast (no `trace`) read
    /// as untraced, a newer one's carry the trace, an older receiver reads
    /// a newer call, and a trace cut short is refused, not read as none.
    #[test]
    fn a_call_or_cast_without_a_trace_reads_as_untraced_and_one_with_keeps_it() {
        let old_call = OlderFrame::Request {
            id: 5,
            body: OlderRequest::Call {
                module: "m".to_owned(),
                key: "k".to_owned(),
                message: b"hi".to_vec(),
                timeout_ms: 100,
            },
        };
        let bytes = postcard::to_stdvec(&old_call).unwrap();
        let Frame::Request {
            id: 5,
            body:
                PeerRequest::Call {
                    key,
                    timeout_ms,
                    trace,
                    ..
                },
        } = decode_frame(&bytes).unwrap()
        else {
            panic!("not a call")
        };
        assert_eq!((key.as_str(), timeout_ms, trace), ("k", 100, None));
        let old_cast = OlderFrame::Request {
            id: 6,
            body: OlderRequest::Cast {
                module: "m".to_owned(),
                key: "k".to_owned(),
                message: b"hi".to_vec(),
            },
        };
        let bytes = postcard::to_stdvec(&old_cast).unwrap();
        let Frame::Request {
            body: PeerRequest::Cast { trace: None, .. },
            ..
        } = decode_frame(&bytes).unwrap()
        else {
            panic!("not an untraced cast")
        };
        let new = Frame::Request {
            id: 7,
            body: PeerRequest::Call {
                module: "m".to_owned(),
                key: "k".to_owned(),
                message: b"hi".to_vec(),
                timeout_ms: 100,
                trace: Some(a_trace()),
            },
        };
        let bytes = encode(&new).unwrap();
        let Frame::Request {
            body: PeerRequest::Call { trace: got, .. },
            ..
        } = decode_frame(&bytes).unwrap()
        else {
            panic!("not a call")
        };
        assert_eq!(got, Some(a_trace()));
        let OlderFrame::Request {
            body: OlderRequest::Call { message, .. },
            ..
        } = postcard::from_bytes(&bytes).unwrap()
        else {
            panic!("an older receiver did not read a call")
        };
        assert_eq!(message, b"hi");
        assert!(
            decode_frame(&bytes[..bytes.len() - 3]).is_err(),
            "a trace cut short is refused"
        );
    }

    #[test]
    fn a_hello_without_features_reads_as_speaking_none_and_an_older_receiver_reads_one_with() {
        let old = OlderHelloFrame::Request {
            id: 0,
            body: OlderHello::Hello {
                namespace: "ns".to_owned(),
                node: "n1".to_owned(),
            },
        };
        let bytes = postcard::to_stdvec(&old).unwrap();
        let Frame::Request {
            id: 0,
            body: PeerRequest::Hello { node, features, .. },
        } = decode_frame(&bytes).unwrap()
        else {
            panic!("not a hello")
        };
        assert_eq!((node.as_str(), features), ("n1", 0));
        let new = Frame::Request {
            id: 0,
            body: PeerRequest::Hello {
                namespace: "ns".to_owned(),
                node: "n2".to_owned(),
                features: FEATURE_TOPICS,
            },
        };
        let bytes = encode(&new).unwrap();
        let OlderHelloFrame::Request {
            body: OlderHello::Hello { node, .. },
            ..
        } = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(node, "n2");
        // A cut-short hello is still refused.
        assert!(decode_frame(&bytes[..bytes.len() - 3]).is_err());
    }

    #[test]
    fn the_history_request_and_answer_round_trip_and_its_feature_bit_is_its_own() {
        assert_eq!(FEATURE_HISTORY & (FEATURE_TOPICS | FEATURE_CONNECTIONS), 0);
        let bytes = encode(&Frame::Request {
            id: 7,
            body: PeerRequest::History,
        })
        .unwrap();
        assert!(matches!(
            decode_frame(&bytes).unwrap(),
            Frame::Request {
                id: 7,
                body: PeerRequest::History
            }
        ));
        let answer = WireHistory(vec![WireSample {
            at_ms: 1,
            calls: 2,
            p99_us: Some(3),
            live_keys: 4,
            fences: 5,
        }]);
        let bytes = postcard::to_allocvec(&answer).unwrap();
        assert_eq!(postcard::from_bytes::<WireHistory>(&bytes).unwrap(), answer);
    }
}
