//! Securing peer links: TLS (optional, [`crate::tls::PeerTls`]) and the
//! cluster-secret handshake, run on every new connection before its first
//! request.
//!
//! The handshake is a challenge-response in both directions, in postcard
//! frames on the connection's own length-delimited codec (the frames are
//! [`crate::wire::Handshake`]; this file runs the exchange and checks it):
//!
//! 1. the dialling node sends `ClientHello { nonce_c, secret }`;
//! 2. the accepting node answers `ServerHello { nonce_s, proof_s }` where
//!    `proof_s = HMAC-SHA256(secret, "fief-peer-server" ‖ nonce_c ‖ nonce_s)`;
//! 3. the dialling node checks `proof_s` (so it never forwards a key's
//!    message to an impostor) and sends `ClientProof { proof_c }` with the
//!    label `"fief-peer-client"`;
//! 4. the accepting node checks it and answers `Accepted`, or `Refused`
//!    with the reason, logs a warning naming the peer's address, and closes.
//!
//! Fresh 32-byte nonces on both sides make a recorded handshake useless
//! for replay, and proofs are checked in constant time
//! (`hmac::Mac::verify_slice`). Both sides must agree on whether a secret
//! is configured at all: a node with a secret refuses one without, and the
//! other way round, so a half-configured cluster fails loudly. Without a
//! secret the handshake still runs (it then proves nothing), so the frame
//! layout does not depend on configuration.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use crate::config::NodeConfig;
use crate::error::{Error, Result};
use crate::line_budget::LineBudget;
use crate::tls::PeerTlsConfig;
use crate::wire::Handshake;

/// Shortest cluster secret accepted, in bytes.
pub const MIN_SECRET_BYTES: usize = 16;
/// How long a peer handshake (TLS and secret) may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Version of the handshake; both sides must speak the same.
const HANDSHAKE_VERSION: u32 = 1;

/// A peer connection's byte stream: plain TCP or TLS over it.
pub(crate) trait PeerIo: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> PeerIo for T {}

/// A framed peer connection.
pub(crate) type PeerFramed = Framed<Box<dyn PeerIo>, LengthDelimitedCodec>;

/// The cluster secret; its `Debug` never shows it.
#[derive(Clone)]
pub struct ClusterSecret(Vec<u8>);

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(<redacted>)")
    }
}

impl ClusterSecret {
    /// A secret from its bytes (surrounding ASCII whitespace dropped).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if shorter than [`MIN_SECRET_BYTES`].
    pub fn new(bytes: &[u8]) -> Result<Self> {
        let bytes = bytes.trim_ascii();
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(Error::Config(format!(
                "the cluster secret is {} bytes; use at least {MIN_SECRET_BYTES} (e.g. `fief token new > secret`)",
                bytes.len()
            )));
        }
        Ok(ClusterSecret(bytes.to_vec()))
    }

    fn proof(&self, label: &[u8], nonce_c: &[u8; 32], nonce_s: &[u8; 32]) -> Hmac<Sha256> {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(label);
        mac.update(nonce_c);
        mac.update(nonce_s);
        mac
    }

    fn sign(&self, label: &[u8], nonce_c: &[u8; 32], nonce_s: &[u8; 32]) -> [u8; 32] {
        self.proof(label, nonce_c, nonce_s)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Constant-time check of a proof.
    fn verify(&self, label: &[u8], nonce_c: &[u8; 32], nonce_s: &[u8; 32], proof: &[u8]) -> bool {
        self.proof(label, nonce_c, nonce_s)
            .verify_slice(proof)
            .is_ok()
    }
}

const SERVER_LABEL: &[u8] = b"fief-peer-server";
const CLIENT_LABEL: &[u8] = b"fief-peer-client";

/// How this node secures its peer links.
pub(crate) struct PeerSecurity {
    secret: Option<ClusterSecret>,
    tls: Option<PeerTlsConfig>,
    /// The rate of this node's lines about peer connections it refused or
    /// dropped: anyone who reaches the peer port can make one per connection.
    refusals: LineBudget,
}

/// Lines about refused peer connections a node may make per second, once
/// [`REFUSAL_LINE_BURST`] is spent.
const REFUSAL_LINES_PER_SECOND: f64 = 10.0;

/// Lines about refused peer connections a node may make at once.
const REFUSAL_LINE_BURST: f64 = 100.0;

impl Default for PeerSecurity {
    /// No cluster secret, no peer TLS.
    fn default() -> Self {
        PeerSecurity {
            secret: None,
            tls: None,
            refusals: LineBudget::new(REFUSAL_LINES_PER_SECOND, REFUSAL_LINE_BURST),
        }
    }
}

impl PeerSecurity {
    /// Log that the connection from `peer` was refused or dropped, and
    /// why, at a bounded rate (anyone who reaches the peer port can make
    /// one such line per connection): over it the line is withheld, and
    /// the next one let through says how many were.
    pub(crate) fn refused(&self, peer: SocketAddr, what: std::fmt::Arguments<'_>) {
        if let Some(withheld) = self.refusals.admit(std::time::Instant::now()) {
            tracing::warn!(%peer, withheld, "{what}");
        }
    }

    /// Read the cluster secret and peer TLS files named in `config`.
    pub(crate) fn load(config: &NodeConfig) -> Result<Self> {
        let secret = match &config.cluster_secret_file {
            Some(path) => {
                let bytes = std::fs::read(path).map_err(|e| {
                    Error::Config(format!(
                        "cannot read the cluster secret file {}: {e}",
                        path.display()
                    ))
                })?;
                Some(ClusterSecret::new(&bytes).map_err(|e| {
                    Error::Config(format!("cluster secret file {}: {e}", path.display()))
                })?)
            }
            None => None,
        };
        let tls = config.peer_tls.as_ref().map(|t| t.load()).transpose()?;
        Ok(PeerSecurity {
            secret,
            tls,
            ..PeerSecurity::default()
        })
    }

    /// Secure a connection this node opened to `addr`: TLS if configured,
    /// then the handshake. Errors say why the link cannot be used.
    pub(crate) async fn connect(
        &self,
        addr: &str,
        stream: TcpStream,
        codec: LengthDelimitedCodec,
    ) -> Result<PeerFramed> {
        let unreachable = |why: String| Error::OwnerUnreachable {
            owner: addr.to_owned(),
            why,
        };
        let work =
            async {
                let io: Box<dyn PeerIo> =
                    match &self.tls {
                        Some(tls) => {
                            let name = crate::tls::server_name(addr)?;
                            let connector = tokio_rustls::TlsConnector::from(tls.client.clone());
                            Box::new(connector.connect(name, stream).await.map_err(|e| {
                                unreachable(format!("TLS with the peer failed: {e}"))
                            })?)
                        }
                        None => Box::new(stream),
                    };
                let mut framed = Framed::new(io, codec);
                self.client_handshake(&mut framed)
                    .await
                    .map_err(unreachable)?;
                Ok(framed)
            };
        tokio::time::timeout(HANDSHAKE_TIMEOUT, work)
            .await
            .map_err(|_| unreachable("the peer handshake timed out".to_owned()))?
    }

    /// Secure a connection this node accepted from `peer`; `None` (after a
    /// warning in the log) if the peer is refused.
    pub(crate) async fn accept(
        &self,
        peer: SocketAddr,
        stream: TcpStream,
        codec: LengthDelimitedCodec,
    ) -> Option<PeerFramed> {
        let work = async {
            let io: Box<dyn PeerIo> = match &self.tls {
                Some(tls) => {
                    let acceptor = tokio_rustls::TlsAcceptor::from(tls.server.clone());
                    Box::new(
                        acceptor
                            .accept(stream)
                            .await
                            .map_err(|e| format!("TLS handshake failed: {e}"))?,
                    )
                }
                None => Box::new(stream),
            };
            let mut framed = Framed::new(io, codec);
            self.server_handshake(&mut framed).await?;
            Ok::<_, String>(framed)
        };
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, work).await {
            Ok(Ok(framed)) => Some(framed),
            Ok(Err(why)) => {
                self.refused(peer, format_args!("refusing a peer connection: {why}"));
                None
            }
            Err(_) => {
                self.refused(
                    peer,
                    format_args!("refusing a peer connection: its handshake timed out"),
                );
                None
            }
        }
    }

    async fn client_handshake(&self, framed: &mut PeerFramed) -> std::result::Result<(), String> {
        let mut nonce_c = [0u8; 32];
        crate::tls::fill_random(&mut nonce_c).map_err(|e| e.to_string())?;
        send(
            framed,
            &Handshake::ClientHello {
                version: HANDSHAKE_VERSION,
                nonce: nonce_c,
                secret: self.secret.is_some(),
            },
        )
        .await?;
        let (nonce_s, proof_s) = match receive(framed).await? {
            Handshake::ServerHello { nonce, proof } => (nonce, proof),
            Handshake::Refused { why } => return Err(format!("the peer refused the link: {why}")),
            other => return Err(format!("unexpected handshake frame {other:?}")),
        };
        let proof = match &self.secret {
            Some(secret) => {
                let ok =
                    proof_s.is_some_and(|p| secret.verify(SERVER_LABEL, &nonce_c, &nonce_s, &p));
                if !ok {
                    return Err(
                        "the peer did not prove it knows the cluster secret; check --cluster-secret-file on every node".to_owned(),
                    );
                }
                Some(secret.sign(CLIENT_LABEL, &nonce_c, &nonce_s))
            }
            None => None,
        };
        send(framed, &Handshake::ClientProof { proof }).await?;
        match receive(framed).await? {
            Handshake::Accepted => Ok(()),
            Handshake::Refused { why } => Err(format!("the peer refused the link: {why}")),
            other => Err(format!("unexpected handshake frame {other:?}")),
        }
    }

    async fn server_handshake(&self, framed: &mut PeerFramed) -> std::result::Result<(), String> {
        let (nonce_c, has_secret) = match receive(framed).await? {
            Handshake::ClientHello {
                version: HANDSHAKE_VERSION,
                nonce,
                secret,
            } => (nonce, secret),
            Handshake::ClientHello { version, .. } => {
                return refuse(
                    framed,
                    format!("handshake version {version}, this node speaks {HANDSHAKE_VERSION}"),
                )
                .await;
            }
            _ => return Err("the first frame was not a handshake".to_owned()),
        };
        match (&self.secret, has_secret) {
            (Some(_), false) => {
                return refuse(
                    framed,
                    "this node requires the cluster secret and the peer has none configured"
                        .to_owned(),
                )
                .await;
            }
            (None, true) => {
                return refuse(
                    framed,
                    "the peer has a cluster secret and this node has none configured".to_owned(),
                )
                .await;
            }
            _ => {}
        }
        let mut nonce_s = [0u8; 32];
        crate::tls::fill_random(&mut nonce_s).map_err(|e| e.to_string())?;
        let proof = self
            .secret
            .as_ref()
            .map(|s| s.sign(SERVER_LABEL, &nonce_c, &nonce_s));
        send(
            framed,
            &Handshake::ServerHello {
                nonce: nonce_s,
                proof,
            },
        )
        .await?;
        let proof_c = match receive(framed).await? {
            Handshake::ClientProof { proof } => proof,
            Handshake::Refused { why } => return Err(format!("the peer refused: {why}")),
            _ => return Err("unexpected handshake frame".to_owned()),
        };
        if let Some(secret) = &self.secret {
            let ok = proof_c.is_some_and(|p| secret.verify(CLIENT_LABEL, &nonce_c, &nonce_s, &p));
            if !ok {
                return refuse(framed, "wrong cluster secret".to_owned()).await;
            }
        }
        send(framed, &Handshake::Accepted).await
    }
}

async fn refuse(framed: &mut PeerFramed, why: String) -> std::result::Result<(), String> {
    let _ = send(framed, &Handshake::Refused { why: why.clone() }).await;
    Err(why)
}

async fn send(framed: &mut PeerFramed, frame: &Handshake) -> std::result::Result<(), String> {
    let bytes = postcard::to_stdvec(frame).map_err(|e| format!("encoding a handshake: {e}"))?;
    framed
        .send(bytes::Bytes::from(bytes))
        .await
        .map_err(|e| format!("the connection failed during the handshake: {e}"))
}

async fn receive(framed: &mut PeerFramed) -> std::result::Result<Handshake, String> {
    match framed.next().await {
        Some(Ok(bytes)) => postcard::from_bytes(&bytes)
            .map_err(|_| "an undecodable handshake frame (not a fief peer?)".to_owned()),
        Some(Err(e)) => Err(format!("the connection failed during the handshake: {e}")),
        None => Err("the connection closed during the handshake".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_checked_and_redacted() {
        assert!(ClusterSecret::new(b"short").is_err());
        let s = ClusterSecret::new(b"  a-cluster-secret-of-some-length\n").unwrap();
        assert_eq!(format!("{s:?}"), "ClusterSecret(<redacted>)");
        let (c, n) = ([1u8; 32], [2u8; 32]);
        let proof = s.sign(SERVER_LABEL, &c, &n);
        assert!(s.verify(SERVER_LABEL, &c, &n, &proof));
        assert!(!s.verify(CLIENT_LABEL, &c, &n, &proof), "labels differ");
        assert!(!s.verify(SERVER_LABEL, &n, &c, &proof), "nonces bind");
        let other = ClusterSecret::new(b"another-secret-of-some-length").unwrap();
        assert!(!other.verify(SERVER_LABEL, &c, &n, &proof));
    }
}
