//! The API's accept loop and its connections, held to [`HttpLimits`]: the
//! connection cap, the header-read and idle timeouts, and the limits on a
//! request's head (see [`crate::http_limits`] for the numbers).
//!
//! Each accepted connection gets one task that runs the TLS handshake (if
//! any) and hyper's HTTP/1.1 connection, raced against a *watchdog* that
//! closes the connection when its phase has lasted too long:
//!
//! | phase | from | closed after |
//! |---|---|---|
//! | fresh | the accept | `header_read_timeout` (the TLS handshake and the first head included) |
//! | idle | the last response was written | `idle_timeout` |
//! | head | the first byte of a kept-alive connection's next request | `header_read_timeout` |
//! | busy, reading the body | a request's head was read, until its body ended (or was dropped) | `body_read_timeout`, plus 1 s per [`MIN_BODY_RATE`](crate::http_limits::MIN_BODY_RATE) bytes received |
//! | busy | its body was read, until its response is written | never by the watchdog (the handlers have their own limits) |
//!
//! The phase is followed by wrapping the connection's I/O ([`Watched`]: a
//! read starts a head, a flush after the last response body ends it) and the
//! service (a request in flight makes it busy until its response body is
//! dropped). While not busy, [`Watched`] also follows the head's bytes
//! ([`HeadScan`]): over the limits it takes the connection from hyper and
//! answers `414` or `431` itself, with a JSON body like every API error
//! (hyper's own answers to heads over its limits have none).
//!
//! At the cap, the connection that has not been busy the longest is closed
//! to admit the new one; with every connection busy the new one is answered
//! `503 too_many_connections` and closed. Descriptors of connections being
//! closed or refused are bounded ([`MAX_EVICTING`], [`MAX_REFUSING`]), within
//! [`RESERVED_FDS`](crate::http_limits::RESERVED_FDS).

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use bytes::Bytes;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore, oneshot, watch};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::error::Error;
use crate::http_limits::{HeadRefusal, HeadScan, HttpLimits, MAX_HEAD_BYTES, error_response};
use crate::node::Instance;
use crate::sync::lock;

/// Most connections being closed to admit new ones at the cap at once;
/// beyond, new connections are refused.
const MAX_EVICTING: usize = 32;
/// Most refused connections being answered `503` at once; beyond, they are
/// closed without an answer.
const MAX_REFUSING: usize = 32;
/// How long a connection answered with an error before the router (`414`,
/// `431`, `503`) is given to take the answer: what it still sends is read
/// and dropped meanwhile, so that closing does not reset the connection
/// before the answer arrives.
const LINGER: Duration = Duration::from_secs(1);
/// The most bytes read and dropped while lingering.
const LINGER_BYTES: usize = 1 << 20;
/// hyper's read buffer per connection: a whole head within the limits and
/// room to spare (hyper's own default is about 400 KiB).
const READ_BUFFER: usize = MAX_HEAD_BYTES + 16 * 1024;
/// At most one warning about the cap per this long.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Where a connection is in its life (see the module's table).
#[derive(Clone, Copy, Debug)]
enum Phase {
    Fresh(Instant),
    Head(Instant),
    Idle(Instant),
    Busy,
}

struct ConnState {
    phase: Phase,
    /// Requests whose response body has not been dropped.
    in_flight: u32,
    /// The last response body was dropped but not yet flushed.
    unflushed: bool,
    /// Closed by the accept loop to admit another connection.
    evicted: bool,
    /// Upgraded to a WebSocket (a `101` went out): from then on its bytes
    /// are the socket's, no HTTP head is scanned or timed.
    upgraded: bool,
    /// While a request's body is being received: when it must have ended.
    body_deadline: Option<Instant>,
}

/// One connection's phase, shared by its I/O, its service and its
/// watchdog (and the accept loop, which may evict it).
struct Conn {
    state: Mutex<ConnState>,
    /// Wakes the watchdog when its deadline may have moved earlier.
    wake: Notify,
}

impl Conn {
    fn new() -> Self {
        Conn {
            state: Mutex::new(ConnState {
                phase: Phase::Fresh(Instant::now()),
                in_flight: 0,
                unflushed: false,
                evicted: false,
                upgraded: false,
                body_deadline: None,
            }),
            wake: Notify::new(),
        }
    }
}

/// How a connection ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// The client or hyper closed it, or the node shut down.
    Done,
    /// Closed to admit another at the cap.
    Evicted,
    /// Its head took longer than `header_read_timeout`.
    HeaderTimeout,
    /// Idle for longer than `idle_timeout`.
    IdleTimeout,
    /// Its request's body took longer than `body_read_timeout` allows.
    BodyTimeout,
    /// Its head was over the limits (answered `414` or `431`).
    HeadRefused(HeadRefusal),
}

impl End {
    /// The metrics' reason, for the ends that are a limit's.
    fn reason(self) -> Option<&'static str> {
        match self {
            End::Done => None,
            End::Evicted => Some("evicted"),
            End::HeaderTimeout => Some("header_timeout"),
            End::IdleTimeout => Some("idle_timeout"),
            End::BodyTimeout => Some("body_timeout"),
            End::HeadRefused(_) => Some("head_too_large"),
        }
    }
}

struct Registry {
    conns: HashMap<u64, Arc<Conn>>,
    next: u64,
    /// Evicted connections whose task has not ended yet.
    evicting: usize,
    /// When the cap was last warned about.
    warned: Option<Instant>,
}

struct Shared {
    limits: HttpLimits,
    registry: Mutex<Registry>,
    refusing: Arc<Semaphore>,
    instance: Arc<Instance>,
}

enum Admission {
    Admit(u64, Arc<Conn>),
    Refuse,
}

impl Shared {
    fn metrics(&self) -> &crate::metrics::Metrics {
        &self.instance.shared().metrics
    }

    /// A slot for a new connection: a free one, or the one of the
    /// connection idle the longest, which is closed.
    fn admit(&self) -> Admission {
        let mut registry = lock(&self.registry);
        if registry.conns.len() >= self.limits.max_connections {
            let now = Instant::now();
            if registry
                .warned
                .is_none_or(|at| now.duration_since(at) >= WARN_EVERY)
            {
                registry.warned = Some(now);
                tracing::warn!(
                    max_connections = self.limits.max_connections,
                    "the API is at its connection cap: closing idle connections to admit new ones, refusing them when every one is busy (http_max_connections)"
                );
            }
            if registry.evicting >= MAX_EVICTING {
                return Admission::Refuse;
            }
            let victim = registry
                .conns
                .iter()
                .filter_map(|(id, conn)| match lock(&conn.state).phase {
                    Phase::Fresh(t) | Phase::Head(t) | Phase::Idle(t) => Some((t, *id)),
                    Phase::Busy => None,
                })
                .min();
            let Some((_, id)) = victim else {
                return Admission::Refuse;
            };
            let conn = registry.conns[&id].clone();
            {
                let mut state = lock(&conn.state);
                if matches!(state.phase, Phase::Busy) {
                    // It took a request since: refuse rather than search again.
                    return Admission::Refuse;
                }
                state.evicted = true;
            }
            conn.wake.notify_one();
            registry.conns.remove(&id);
            registry.evicting += 1;
        }
        let id = registry.next;
        registry.next += 1;
        let conn = Arc::new(Conn::new());
        registry.conns.insert(id, conn.clone());
        Admission::Admit(id, conn)
    }

    /// The connection's task ended: free its slot.
    fn release(&self, id: u64, conn: &Conn) {
        let mut registry = lock(&self.registry);
        if lock(&conn.state).evicted {
            registry.evicting -= 1;
        } else {
            registry.conns.remove(&id);
        }
    }
}

/// Serve `app` on `listener` (over TLS with `tls`) within `limits` until
/// `shutdown` resolves; then stop accepting, let every connection finish its
/// request in flight, and return once all have closed.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    limits: HttpLimits,
    instance: Arc<Instance>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let shared = Arc::new(Shared {
        limits,
        registry: Mutex::new(Registry {
            conns: HashMap::new(),
            next: 0,
            evicting: 0,
            warned: None,
        }),
        refusing: Arc::new(Semaphore::new(MAX_REFUSING)),
        instance,
    });
    tracing::info!(
        max_connections = limits.max_connections,
        open_file_limit = %crate::http_limits::shown(limits.open_file_limit),
        header_read_timeout = ?limits.header_read_timeout,
        idle_timeout = ?limits.idle_timeout,
        "serving the API"
    );
    let (stop, stopped) = watch::channel(false);
    let tracker = TaskTracker::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of descriptors (or memory): wait for some to close.
                    tracing::warn!(error = %e, "accepting an API connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        match shared.admit() {
            Admission::Admit(id, conn) => {
                shared.metrics().api_connection_opened();
                tracker.spawn(connection(
                    stream,
                    peer,
                    id,
                    conn,
                    shared.clone(),
                    acceptor.clone(),
                    app.clone(),
                    stopped.clone(),
                ));
            }
            Admission::Refuse => {
                shared.metrics().api_connection_limited("refused");
                tracing::debug!(%peer, "API connection refused: every connection is busy");
                // A TLS client would not understand a plain answer; a
                // handshake per refusal is what a flood would want.
                if acceptor.is_none()
                    && let Ok(permit) = shared.refusing.clone().try_acquire_owned()
                {
                    let error = Error::TooManyConnections {
                        limit: shared.limits.max_connections,
                    };
                    tracker.spawn(async move {
                        refuse(stream, &error).await;
                        drop(permit);
                    });
                }
            }
        }
    }
    drop(listener);
    stop.send_replace(true);
    tracker.close();
    tracker.wait().await;
    Ok(())
}

/// One connection, from its accept to its close.
#[allow(
    clippy::too_many_arguments,
    reason = "one connection's limits and handles, passed once at accept"
)]
async fn connection(
    stream: TcpStream,
    peer: std::net::SocketAddr,
    id: u64,
    conn: Arc<Conn>,
    shared: Arc<Shared>,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    app: Router,
    stop: watch::Receiver<bool>,
) {
    let body_timeout = shared.limits.body_read_timeout;
    let work = async {
        match acceptor {
            None => serve_io(stream, &conn, app, body_timeout, stop).await,
            Some(acceptor) => match acceptor.accept(stream).await {
                Ok(tls) => serve_io(tls, &conn, app, body_timeout, stop).await,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed (a plaintext client?)");
                    End::Done
                }
            },
        }
    };
    let end = tokio::select! {
        biased;
        end = work => end,
        end = watchdog(&conn, &shared.limits) => end,
    };
    if let Some(reason) = end.reason() {
        tracing::debug!(%peer, reason, "API connection closed at a limit");
        shared.metrics().api_connection_limited(reason);
    }
    shared.release(id, &conn);
    shared.metrics().api_connection_ended();
}

/// Resolves when `conn`'s phase has outlasted its limit, or it was evicted.
async fn watchdog(conn: &Conn, limits: &HttpLimits) -> End {
    loop {
        let (deadline, end) = {
            let state = lock(&conn.state);
            if state.evicted {
                return End::Evicted;
            }
            match state.phase {
                Phase::Fresh(t) | Phase::Head(t) => {
                    (Some(t + limits.header_read_timeout), End::HeaderTimeout)
                }
                Phase::Idle(t) => (Some(t + limits.idle_timeout), End::IdleTimeout),
                Phase::Busy => (state.body_deadline, End::BodyTimeout),
            }
        };
        match deadline {
            Some(deadline) if Instant::now() >= deadline => return end,
            Some(deadline) => {
                tokio::select! {
                    () = tokio::time::sleep_until(deadline) => {}
                    () = conn.wake.notified() => {}
                }
            }
            None => conn.wake.notified().await,
        }
    }
}

/// HTTP/1.1 on `io` until it closes, the node stops, or its head is refused.
async fn serve_io<IO>(
    io: IO,
    conn: &Arc<Conn>,
    app: Router,
    body_read_timeout: Duration,
    mut stop: watch::Receiver<bool>,
) -> End
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (taken_tx, mut taken) = oneshot::channel();
    let watched = Watched {
        io: Some(io),
        conn: conn.clone(),
        scan: HeadScan::default(),
        taken: Some(taken_tx),
    };
    let service = {
        let conn = conn.clone();
        hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let guard = InFlight::new(conn.clone());
            let request = request.map(|body| TimedBody::new(body, conn.clone(), body_read_timeout));
            let mut app = app.clone();
            async move {
                let Ok(response) = tower_service::Service::call(&mut app, request).await;
                if response.status() == hyper::StatusCode::SWITCHING_PROTOCOLS {
                    lock(&guard.0.state).upgraded = true;
                }
                Ok::<_, Infallible>(response.map(|body| Tracked {
                    body,
                    _guard: guard,
                }))
            }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    // The watchdog keeps the time; hyper's own header timer would also cut
    // kept-alive connections at the header timeout.
    builder.max_buf_size(READ_BUFFER).header_read_timeout(None);
    // A WebSocket connect (`/v1/keys/{module}/{key}/connect`) hands the
    // connection to its socket task once the `101` is out: this loop then
    // ends and frees the connection's slot (sockets have their own limits).
    let mut http = std::pin::pin!(
        builder
            .serve_connection(TokioIo::new(watched), service)
            .with_upgrades()
    );
    let mut stopping = false;
    let (io, refusal) = loop {
        tokio::select! {
            biased;
            taken = &mut taken => match taken {
                Ok(pair) => break pair,
                Err(_) => return End::Done,
            },
            result = http.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "an API connection ended with an error");
                }
                return End::Done;
            }
            _ = stop.changed(), if !stopping => {
                // Idle connections close now, busy ones after their response.
                stopping = true;
                http.as_mut().graceful_shutdown();
            }
        }
    };
    // hyper waits for a head that will not come; the answer is ours.
    answer_and_close(io, &refusal.error()).await;
    End::HeadRefused(refusal)
}

/// Answer a refused connection with `error` once its request's head is in
/// (waiting at most [`LINGER`]): a client reads an answer that comes before
/// its request as a broken connection, not as a response.
async fn refuse(mut stream: TcpStream, error: &Error) {
    let mut scan = HeadScan::default();
    let mut buf = vec![0u8; 8192];
    let head = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => {
                    if scan.feed(&buf[..n]).is_err() || scan.is_done() {
                        return true;
                    }
                }
            }
        }
    };
    if let Ok(true) = tokio::time::timeout(LINGER, head).await {
        answer_and_close(stream, error).await;
    }
}

/// Write `error` as a whole JSON response, close the writing side, and
/// read what the client still sends for a moment ([`LINGER`]).
async fn answer_and_close<IO: AsyncRead + AsyncWrite + Unpin>(mut io: IO, error: &Error) {
    let work = async {
        io.write_all(&error_response(error)).await?;
        io.shutdown().await?;
        let mut sink = vec![0u8; 8192];
        let mut total = 0;
        while total < LINGER_BYTES {
            match io.read(&mut sink).await? {
                0 => break,
                n => total += n,
            }
        }
        Ok::<_, io::Error>(())
    };
    let _ = tokio::time::timeout(LINGER, work).await;
}

/// A request in flight on a connection, until its response body is dropped.
struct InFlight(Arc<Conn>);

impl InFlight {
    fn new(conn: Arc<Conn>) -> Self {
        {
            let mut state = lock(&conn.state);
            state.in_flight += 1;
            state.phase = Phase::Busy;
        }
        InFlight(conn)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut state = lock(&self.0.state);
        state.in_flight = state.in_flight.saturating_sub(1);
        if state.in_flight == 0 {
            state.unflushed = true;
        }
    }
}

/// A request's body, held to its connection's body deadline: set when the
/// handler first reads it, moved later by every byte received, cleared when
/// the body ends or the handler drops it. The watchdog closes the connection
/// past it. Not set before the first read: a key request waiting for its
/// tenant's turn (`crate::request_turns`) has not started reading, and its
/// wait is not the client's slowness.
struct TimedBody {
    body: Incoming,
    conn: Arc<Conn>,
    /// The deadline not yet set: the time the client has for its body.
    unread: Option<Duration>,
    /// Whether the deadline is still set (the body has not ended).
    timing: bool,
}

impl TimedBody {
    fn new(body: Incoming, conn: Arc<Conn>, timeout: Duration) -> Self {
        let unread = (!http_body::Body::is_end_stream(&body)).then_some(timeout);
        TimedBody {
            body,
            conn,
            unread,
            timing: false,
        }
    }

    /// The handler reads the body: from now on the client has its time.
    fn start(&mut self) {
        if let Some(timeout) = self.unread.take() {
            lock(&self.conn.state).body_deadline = Some(Instant::now() + timeout);
            self.conn.wake.notify_one();
            self.timing = true;
        }
    }

    /// The body ended, failed or was dropped: no more deadline.
    fn done(&mut self) {
        if std::mem::take(&mut self.timing) {
            lock(&self.conn.state).body_deadline = None;
            self.conn.wake.notify_one();
        }
    }
}

impl http_body::Body for TimedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        this.start();
        let frame = ready!(Pin::new(&mut this.body).poll_frame(cx));
        match &frame {
            Some(Ok(frame)) if this.timing => {
                if let Some(data) = frame.data_ref() {
                    let credit = Duration::from_secs_f64(
                        data.len() as f64 / crate::http_limits::MIN_BODY_RATE as f64,
                    );
                    if let Some(deadline) = lock(&this.conn.state).body_deadline.as_mut() {
                        *deadline += credit;
                    }
                }
                if this.body.is_end_stream() {
                    this.done();
                }
            }
            Some(Ok(_)) => {}
            Some(Err(_)) | None => this.done(),
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

impl Drop for TimedBody {
    fn drop(&mut self) {
        self.done();
    }
}

/// A response body that keeps its request in flight.
struct Tracked {
    body: Body,
    _guard: InFlight,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// A connection's I/O, watched: reads move it into a head and follow the
/// head's bytes, a flush after the last response ends its busy phase. When
/// a head is over the limits it hands the I/O to the connection's task
/// (through `taken`) and stalls hyper from then on: every call is pending,
/// so hyper neither fails nor closes before the task answers.
struct Watched<IO> {
    io: Option<IO>,
    conn: Arc<Conn>,
    scan: HeadScan,
    taken: Option<oneshot::Sender<(IO, HeadRefusal)>>,
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncRead for Watched<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let Some(io) = this.io.as_mut() else {
            // Taken: the connection's task drops hyper next.
            return Poll::Pending;
        };
        let before = buf.filled().len();
        ready!(Pin::new(io).poll_read(cx, buf))?;
        if buf.filled().len() == before {
            return Poll::Ready(Ok(()));
        }
        let in_head = {
            let mut state = lock(&this.conn.state);
            if state.upgraded {
                return Poll::Ready(Ok(()));
            }
            match state.phase {
                Phase::Busy => false,
                Phase::Idle(_) => {
                    state.phase = Phase::Head(Instant::now());
                    this.conn.wake.notify_one();
                    true
                }
                Phase::Fresh(_) | Phase::Head(_) => true,
            }
        };
        if in_head && let Err(refusal) = this.scan.feed(&buf.filled()[before..]) {
            // hyper never sees these bytes.
            buf.set_filled(before);
            if let (Some(io), Some(taken)) = (this.io.take(), this.taken.take()) {
                let _ = taken.send((io, refusal));
            }
            return Poll::Pending;
        }
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Watched<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut().io.as_mut() {
            Some(io) => Pin::new(io).poll_write(cx, buf),
            None => Poll::Pending,
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut().io.as_mut() {
            Some(io) => Pin::new(io).poll_write_vectored(cx, bufs),
            None => Poll::Pending,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.as_ref().is_some_and(AsyncWrite::is_write_vectored)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let Some(io) = this.io.as_mut() else {
            return Poll::Pending;
        };
        ready!(Pin::new(io).poll_flush(cx))?;
        // hyper flushes the I/O only once its buffer is written: a flush
        // after the last response body ended means the response is out.
        let mut state = lock(&this.conn.state);
        if state.in_flight == 0 && state.unflushed {
            state.unflushed = false;
            state.phase = Phase::Idle(Instant::now());
            this.scan.reset();
            this.conn.wake.notify_one();
        }
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut().io.as_mut() {
            Some(io) => Pin::new(io).poll_shutdown(cx),
            None => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use axum::Router;
    use axum::body::Body;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use crate::config::{ByteSize, NodeConfig};
    use crate::http_limits::HttpLimits;
    use crate::node::Instance;

    /// A request whose handler waits before it reads its body (as a key
    /// request waits for its tenant's turn, `crate::request_turns`) longer
    /// than the body-read timeout is served, its body sent whole at once:
    /// the client's time starts at the first read. With the deadline set
    /// when the head came in, the connection was closed as a slow body.
    #[tokio::test]
    async fn a_body_read_late_by_its_handler_is_not_cut_at_the_body_timeout() {
        let config = NodeConfig {
            max_live_keys: 4,
            max_memory_per_key: ByteSize::mib(64),
            http_body_read_timeout: Duration::from_millis(300),
            ..NodeConfig::default()
        };
        let limits = HttpLimits::for_node(&config).expect("the limits fit");
        let instance = Arc::new(Instance::start_embedded(config).await.expect("a node"));
        // Every request (a fallback: this file serves no routes of the API).
        let app = Router::new().fallback(|body: Body| async move {
            tokio::time::sleep(Duration::from_millis(900)).await;
            let bytes = axum::body::to_bytes(body, 1024).await.expect("the body");
            format!("read {}", bytes.len())
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(super::serve(
            listener,
            app,
            None,
            limits,
            instance.clone(),
            async {
                let _ = stopped.await;
            },
        ));
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        client
            .write_all(b"POST /late HTTP/1.1\r\nHost: fief\r\nContent-Length: 5\r\n\r\nhello")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let mut buf = [0u8; 1024];
        let read = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                match client.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        answer.extend_from_slice(&buf[..n]);
                        if answer.ends_with(b"read 5") {
                            break;
                        }
                    }
                }
            }
        })
        .await;
        assert!(read.is_ok(), "no answer within 30 s");
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with("read 5"),
            "the connection was closed or refused: {answer:?}"
        );
        drop(stop);
        server.await.expect("the server").expect("it served");
        if let Ok(instance) = Arc::try_unwrap(instance) {
            instance.shutdown().await;
        }
    }
}
