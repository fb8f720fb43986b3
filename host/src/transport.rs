//! The node-to-node transport: key messages forwarded to their owner over TCP.
//!
//! Frames are length-delimited and serialized with `postcard` (serde); no
//! byte is parsed by hand. Their types and their encoding are
//! [`crate::wire`]'s; this file moves them and must not define any. One
//! connection per peer, opened lazily and reopened after a failure; requests
//! on it are multiplexed by id, each answered by one response. Queues are
//! bounded: a connection's outgoing queue holds [`OUTGOING_QUEUE`] frames,
//! and a frame is at most the node's `max_message_size` plus
//! [`FRAME_OVERHEAD`](crate::wire::FRAME_OVERHEAD).
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
use futures_util::stream::SplitSink;
use futures_util::{SinkExt, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};
use crate::node::NodeShared;
use crate::peer_auth::{PeerFramed, PeerSecurity};
use crate::sync::lock;
use crate::wire::{
    FEATURE_CONNECTIONS, FEATURE_HISTORY, FEATURE_TOPICS, Frame, PeerRequest, WireError, codec,
    decode_frame, encode,
};

/// Frames that may wait to be written on one connection.
pub const OUTGOING_QUEUE: usize = 1024;
/// How long connecting to a peer may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

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
                serve_connection(node, framed, peer, &security).await;
            }
        });
    }
}

/// At most the first 128 characters of a name a peer sent, for a log line
/// (a frame may carry a megabyte of it).
fn shown(name: &str) -> &str {
    name.char_indices()
        .nth(128)
        .map_or(name, |(at, _)| &name[..at])
}

async fn serve_connection(
    node: Weak<NodeShared>,
    framed: PeerFramed,
    peer: SocketAddr,
    security: &PeerSecurity,
) {
    let (sink, mut stream) = framed.split();
    let (out_tx, out_rx) = mpsc::channel::<Frame>(OUTGOING_QUEUE);
    let writer = tokio::spawn(write_queued(sink, out_rx));
    let mut greeted = false;
    while let Some(Ok(bytes)) = stream.next().await {
        let Ok(Frame::Request { id, body }) = decode_frame(&bytes) else {
            security.refused(
                peer,
                format_args!("dropping a peer connection: undecodable frame"),
            );
            break;
        };
        let Some(shared) = node.upgrade() else { break };
        match body {
            PeerRequest::Hello {
                namespace,
                node: from,
                features,
            } => {
                if namespace != shared.config.namespace {
                    security.refused(
                        peer,
                        format_args!(
                            "refusing a peer of another namespace: {} of {}",
                            shown(from.as_str()),
                            shown(&namespace)
                        ),
                    );
                    break;
                }
                shared.peers.greeted(&from, features);
                greeted = true;
            }
            _ if !greeted => {
                security.refused(
                    peer,
                    format_args!("dropping a peer connection that did not say hello"),
                );
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

/// Write the frames queued on `queue` to `sink` until the queue closes or a
/// write fails. Every frame already queued is fed before one flush, so a busy
/// connection makes one write per batch of frames, not one per frame (the
/// codec still writes whenever its buffer passes its backpressure boundary,
/// so a long batch does not grow the buffer without bound).
async fn write_queued(mut sink: SplitSink<PeerFramed, Bytes>, mut queue: mpsc::Receiver<Frame>) {
    while let Some(first) = queue.recv().await {
        let mut next = Some(first);
        while let Some(frame) = next {
            if let Ok(bytes) = encode(&frame)
                && sink.feed(bytes).await.is_err()
            {
                return;
            }
            next = queue.try_recv().ok();
        }
        if sink.flush().await.is_err() {
            return;
        }
    }
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
    /// Open connections by peer address: a plain lock, held only to look
    /// one up or put one in, so the call path never waits on an async lock.
    conns: Mutex<HashMap<String, Arc<PeerConn>>>,
    /// Held while a connection is being opened, so two callers to a peer
    /// that has none open one, not two.
    opening: tokio::sync::Mutex<()>,
    /// Peer addresses this node is cut off from (fault injection).
    cut: Mutex<std::collections::HashSet<String>>,
    /// What each peer said it speaks in its hello (`wire::FEATURE_*`), by
    /// node name: newer requests go only to peers that speak them.
    features: Mutex<HashMap<String, u64>>,
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
            conns: Mutex::default(),
            opening: tokio::sync::Mutex::new(()),
            cut: Mutex::default(),
            features: Mutex::default(),
        }
    }

    /// The peer `node` said hello, speaking `features`.
    pub(crate) fn greeted(&self, node: &str, features: u64) {
        lock(&self.features).insert(node.to_owned(), features);
    }

    /// Whether the peer `node` said, in its hello, that it speaks `feature`.
    pub(crate) fn speaks(&self, node: &str, feature: u64) -> bool {
        lock(&self.features)
            .get(node)
            .is_some_and(|features| features & feature != 0)
    }

    /// Cut (or restore) this node's link to the peer at `addr`: while cut,
    /// every request to it fails as if the network dropped it.
    pub(crate) async fn set_link(&self, addr: &str, up: bool) {
        if up {
            lock(&self.cut).remove(addr);
        } else {
            lock(&self.cut).insert(addr.to_owned());
            if let Some(conn) = lock(&self.conns).remove(addr) {
                lock(&conn.pending).clear();
            }
        }
    }

    /// The connection to `addr`, if one is open.
    fn open_connection(&self, addr: &str) -> Option<Arc<PeerConn>> {
        lock(&self.conns)
            .get(addr)
            .filter(|conn| !conn.is_closed())
            .cloned()
    }

    /// The open connection to `addr`, or a new one.
    async fn connection(&self, addr: &str) -> Result<Arc<PeerConn>> {
        if let Some(conn) = self.open_connection(addr) {
            return Ok(conn);
        }
        let _opening = self.opening.lock().await;
        if let Some(conn) = self.open_connection(addr) {
            return Ok(conn);
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
        let (sink, mut stream) = framed.split();
        let (out, out_rx) = mpsc::channel::<Frame>(OUTGOING_QUEUE);
        let pending: Pending = Arc::default();
        // The hello goes first.
        out.try_send(Frame::Request {
            id: 0,
            body: PeerRequest::Hello {
                namespace: self.namespace.clone(),
                node: self.me.clone(),
                features: FEATURE_TOPICS | FEATURE_CONNECTIONS | FEATURE_HISTORY,
            },
        })
        .map_err(|_| Error::Internal("a new peer queue is full".to_owned()))?;
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (writer_closed, writer_pending) = (closed.clone(), pending.clone());
        tokio::spawn(async move {
            write_queued(sink, out_rx).await;
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
        lock(&self.conns).insert(addr.to_owned(), conn.clone());
        Ok(conn)
    }

    /// Open the link to the peer at `addr` if it is not open (its hello
    /// tells the peer who this node is and what it speaks).
    pub(crate) async fn connect(&self, addr: &str) -> Result<()> {
        if lock(&self.cut).contains(addr) {
            return Err(Error::OwnerUnreachable {
                owner: addr.to_owned(),
                why: "the link to it is cut".to_owned(),
            });
        }
        self.connection(addr).await.map(drop)
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
