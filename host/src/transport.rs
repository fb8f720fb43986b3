//! The node-to-node transport: key messages forwarded to their owner over TCP.
//!
//! Frames are length-delimited ([`LengthDelimitedCodec`]) and serialized with
//! `postcard` (serde); no byte is parsed by hand. One connection per peer,
//! opened lazily and reopened after a failure; requests on it are
//! multiplexed by id, each answered by one response. Queues are bounded: a
//! connection's outgoing queue holds [`OUTGOING_QUEUE`] frames, and a frame is
//! at most the node's `max_message_size` plus [`FRAME_OVERHEAD`].
//!
//! Every connection is secured first ([`crate::peer_auth`]): TLS if the
//! node has peer TLS, then the cluster-secret handshake; only then are
//! frames exchanged.
//!
//! The transport decides nothing about ownership: the receiving node routes
//! every request again against its own lease and table (guarantee 2: the
//! owner re-checks before processing), so a stale sender gets an error, never
//! a second owner.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::LengthDelimitedCodec;

use crate::cache::CacheOp;
use crate::error::{Error, Result};
use crate::key::lock;
use crate::node::NodeShared;
use crate::peer_auth::{PeerFramed, PeerSecurity};

/// Room for everything in a frame besides the message itself.
pub const FRAME_OVERHEAD: usize = 8 * 1024;
/// Frames that may wait to be written on one connection.
pub const OUTGOING_QUEUE: usize = 1024;
/// How long connecting to a peer may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// What one node asks another.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum PeerRequest {
    /// The first frame on a connection: who is calling, for which namespace.
    Hello { namespace: String, node: String },
    /// Call a key; the response carries its reply.
    Call {
        module: String,
        key: String,
        message: Vec<u8>,
        timeout_ms: u64,
    },
    /// Cast to a key.
    Cast {
        module: String,
        key: String,
        message: Vec<u8>,
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
    /// them postcard-encoded (see `deploy.rs`).
    LoadedModules,
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
    fn into_error(self, peer: &str) -> Error {
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
/// refused like any other.
///
/// # Errors
///
/// postcard's error for a frame that is not one.
pub(crate) fn decode_frame(bytes: &[u8]) -> std::result::Result<Frame, postcard::Error> {
    match postcard::from_bytes(bytes) {
        Err(postcard::Error::DeserializeUnexpectedEnd) => {
            older_handoff(bytes).ok_or(postcard::Error::DeserializeUnexpectedEnd)
        }
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

/// A frame as a sender of the version before move attempts wrote a
/// handoff: a request whose handoff has no `manifest`. The variants before
/// `Handoff` only hold their places (postcard numbers variants in order).
#[derive(Debug, Serialize, Deserialize)]
enum OlderFrame {
    Request { id: u64, body: OlderRequest },
}

/// [`PeerRequest`] as [`OlderFrame`] reads it.
#[derive(Debug, Serialize, Deserialize)]
enum OlderRequest {
    Hello,
    Call,
    Cast,
    Handoff { entries: Vec<HandoffEntry> },
}

/// Accept peer connections on `listener` and serve their requests, each
/// after its TLS and cluster-secret handshake ([`crate::peer_auth`]).
pub(crate) async fn serve(node: Weak<NodeShared>, listener: TcpListener) {
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let Some(shared) = node.upgrade() else { return };
        let max = shared.config.max_message_size.as_u64() as usize;
        let security = shared.peers.security.clone();
        drop(shared);
        let _ = stream.set_nodelay(true);
        let node = node.clone();
        tokio::spawn(async move {
            if let Some(framed) = security.accept(peer, stream, codec(max)).await {
                serve_connection(node, framed, peer).await;
            }
        });
    }
}

async fn serve_connection(node: Weak<NodeShared>, framed: PeerFramed, peer: SocketAddr) {
    let (mut sink, mut stream) = framed.split();
    let (out_tx, mut out_rx) = mpsc::channel::<Frame>(OUTGOING_QUEUE);
    let writer = tokio::spawn(async move {
        while let Some(frame) = out_rx.recv().await {
            let Ok(bytes) = encode(&frame) else { continue };
            if sink.send(bytes).await.is_err() {
                return;
            }
        }
    });
    let mut greeted = false;
    while let Some(Ok(bytes)) = stream.next().await {
        let Ok(Frame::Request { id, body }) = decode_frame(&bytes) else {
            tracing::warn!(%peer, "dropping a peer connection: undecodable frame");
            break;
        };
        let Some(shared) = node.upgrade() else { break };
        match body {
            PeerRequest::Hello {
                namespace,
                node: from,
            } => {
                if namespace != shared.config.namespace {
                    tracing::warn!(%peer, %from, %namespace, "refusing a peer of another namespace");
                    break;
                }
                greeted = true;
            }
            _ if !greeted => {
                tracing::warn!(%peer, "dropping a peer connection that did not say hello");
                break;
            }
            request => {
                let out = out_tx.clone();
                tokio::spawn(async move {
                    let result = shared.serve_peer_request(request).await;
                    let body = result.map_err(|e| WireError::from(&e));
                    let _ = out.send(Frame::Response { id, body }).await;
                });
            }
        }
    }
    drop(out_tx);
    let _ = writer.await;
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<std::result::Result<Vec<u8>, WireError>>>>>;

/// One open connection to a peer.
struct PeerConn {
    out: mpsc::Sender<Frame>,
    pending: Pending,
    next_id: AtomicU64,
    closed: Arc<std::sync::atomic::AtomicBool>,
}

impl PeerConn {
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst) || self.out.is_closed()
    }
}

/// Mark a connection dead and fail everything waiting on it: dropping the
/// waiters' senders wakes them with an error at once.
fn close(closed: &std::sync::atomic::AtomicBool, pending: &Pending) {
    closed.store(true, Ordering::SeqCst);
    lock(pending).clear();
}

/// Connections to the peers of one node.
pub(crate) struct PeerPool {
    namespace: String,
    me: String,
    max_message: usize,
    /// TLS and the cluster secret for every link.
    security: Arc<PeerSecurity>,
    conns: tokio::sync::Mutex<HashMap<String, Arc<PeerConn>>>,
    /// Peer addresses this node is cut off from (fault injection).
    cut: Mutex<std::collections::HashSet<String>>,
}

impl PeerPool {
    pub(crate) fn new(
        namespace: &str,
        me: &str,
        max_message: usize,
        security: PeerSecurity,
    ) -> Self {
        PeerPool {
            namespace: namespace.to_owned(),
            me: me.to_owned(),
            max_message,
            security: Arc::new(security),
            conns: tokio::sync::Mutex::new(HashMap::new()),
            cut: Mutex::default(),
        }
    }

    /// Cut (or restore) this node's link to the peer at `addr`: while cut,
    /// every request to it fails as if the network dropped it.
    pub(crate) async fn set_link(&self, addr: &str, up: bool) {
        if up {
            lock(&self.cut).remove(addr);
        } else {
            lock(&self.cut).insert(addr.to_owned());
            if let Some(conn) = self.conns.lock().await.remove(addr) {
                lock(&conn.pending).clear();
            }
        }
    }

    async fn connection(&self, addr: &str) -> Result<Arc<PeerConn>> {
        let mut conns = self.conns.lock().await;
        if let Some(conn) = conns.get(addr)
            && !conn.is_closed()
        {
            return Ok(conn.clone());
        }
        let unreachable = |why: String| Error::OwnerUnreachable {
            owner: addr.to_owned(),
            why,
        };
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| unreachable("connecting timed out".to_owned()))?
            .map_err(|e| unreachable(format!("cannot connect: {e}")))?;
        let _ = stream.set_nodelay(true);
        let framed = self
            .security
            .connect(addr, stream, codec(self.max_message))
            .await?;
        let (mut sink, mut stream) = framed.split();
        let (out, mut out_rx) = mpsc::channel::<Frame>(OUTGOING_QUEUE);
        let pending: Pending = Arc::default();
        // The hello goes first.
        out.try_send(Frame::Request {
            id: 0,
            body: PeerRequest::Hello {
                namespace: self.namespace.clone(),
                node: self.me.clone(),
            },
        })
        .map_err(|_| Error::Internal("a new peer queue is full".to_owned()))?;
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (writer_closed, writer_pending) = (closed.clone(), pending.clone());
        tokio::spawn(async move {
            while let Some(frame) = out_rx.recv().await {
                let Ok(bytes) = encode(&frame) else { continue };
                if sink.send(bytes).await.is_err() {
                    break;
                }
            }
            close(&writer_closed, &writer_pending);
        });
        let (reader_closed, reader_pending) = (closed.clone(), pending.clone());
        tokio::spawn(async move {
            while let Some(Ok(bytes)) = stream.next().await {
                if let Ok(Frame::Response { id, body }) = decode_frame(&bytes)
                    && let Some(waiter) = lock(&reader_pending).remove(&id)
                {
                    let _ = waiter.send(body);
                }
            }
            // The connection is gone: fail everything still waiting, and
            // make the pool reconnect next time.
            close(&reader_closed, &reader_pending);
        });
        let conn = Arc::new(PeerConn {
            out,
            pending,
            next_id: AtomicU64::new(1),
            closed,
        });
        conns.insert(addr.to_owned(), conn.clone());
        Ok(conn)
    }

    /// Send `request` to the peer at `addr` and wait for its answer.
    pub(crate) async fn request(
        &self,
        addr: &str,
        request: PeerRequest,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        if lock(&self.cut).contains(addr) {
            return Err(Error::OwnerUnreachable {
                owner: addr.to_owned(),
                why: "the link to it is cut".to_owned(),
            });
        }
        let conn = self.connection(addr).await?;
        let id = conn.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&conn.pending).insert(id, tx);
        let frame = Frame::Request { id, body: request };
        if conn.is_closed() || conn.out.try_send(frame).is_err() {
            lock(&conn.pending).remove(&id);
            return Err(Error::OwnerUnreachable {
                owner: addr.to_owned(),
                why: "the connection's queue is full or closed".to_owned(),
            });
        }
        match tokio::time::timeout(timeout, rx).await {
            Err(_) => {
                lock(&conn.pending).remove(&id);
                Err(Error::Timeout(timeout))
            }
            // Sent, maybe processed: not the owner being unreachable.
            Ok(Err(_)) => Err(Error::AnswerLost {
                owner: addr.to_owned(),
            }),
            Ok(Ok(answer)) => answer.map_err(|e| e.into_error(addr)),
        }
    }
}

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
}
