//! TLS (rustls, with the `ring` provider) for the HTTP API and for peer
//! links; both optional.
//!
//! - The API: `fief node --tls-cert CERT.pem --tls-key KEY.pem` serves HTTPS
//!   only ([`server_config`]; the handshake runs in the API's connection
//!   loop, within its header-read timeout, see [`crate::http_limits`]); a
//!   plaintext client gets no answer. The CLI trusts the system's roots plus
//!   `--ca-cert FILE`.
//! - Peer links: [`PeerTls`] (`--peer-tls-cert/-key/-ca`, or `[peer_tls]` in
//!   the config file) makes every node-to-node connection mutual TLS: each
//!   node presents its certificate and accepts only peers whose certificate
//!   the cluster's CA signed. The cluster secret handshake
//!   ([`crate::transport`]) still runs inside the TLS session.
//!
//! Certificates and keys are PEM files; the key may be PKCS#8, PKCS#1 or
//! SEC1. Every load error names the file and what is wrong with it.
//! [`PeerTls`], which files a node is configured with, is a configuration
//! value (`crate::config`), re-exported here; this file loads them.

use std::path::Path;
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

pub use crate::config::PeerTls;
use crate::error::{Error, Result};

/// The crypto provider every TLS configuration here uses (`ring`).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Fill `buf` from the system's secure random source.
///
/// # Errors
///
/// [`Error::Internal`] if the system has no randomness to give.
pub fn fill_random(buf: &mut [u8]) -> Result<()> {
    rustls::crypto::ring::default_provider()
        .secure_random
        .fill(buf)
        .map_err(|_| Error::Internal("the system's random source failed".to_owned()))
}

fn tls_error(path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Config(format!("{what} {}: {e}", path.display()))
}

/// The certificates in a PEM file.
///
/// # Errors
///
/// [`Error::Config`] if the file cannot be read or holds no certificate.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| tls_error(path, "cannot read the certificate file", e))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| tls_error(path, "the certificate file is not valid PEM", e))?;
    if certs.is_empty() {
        return Err(tls_error(
            path,
            "no certificate in",
            "expected -----BEGIN CERTIFICATE-----",
        ));
    }
    Ok(certs)
}

/// The private key in a PEM file.
///
/// # Errors
///
/// [`Error::Config`] if the file cannot be read or holds no key.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        tls_error(
            path,
            "cannot read a private key (PEM: PKCS#8, PKCS#1 or SEC1) from",
            e,
        )
    })
}

fn roots(ca: &Path) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(ca)? {
        roots
            .add(cert)
            .map_err(|e| tls_error(ca, "a CA certificate is unusable in", e))?;
    }
    Ok(roots)
}

/// A server configuration for the HTTP API from PEM files.
///
/// # Errors
///
/// [`Error::Config`] naming the file when a certificate or key is unusable
/// or they do not match.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>> {
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Config(format!("TLS: {e}")))?
        .with_no_client_auth()
        .with_single_cert(load_certs(cert)?, load_key(key)?)
        .map_err(|e| tls_error(cert, "the certificate and key do not fit", e))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Both halves of mutual TLS for peer links.
pub(crate) struct PeerTlsConfig {
    /// For connections this node accepts.
    pub(crate) server: Arc<ServerConfig>,
    /// For connections this node opens.
    pub(crate) client: Arc<ClientConfig>,
}

impl PeerTls {
    /// Load the files into rustls configurations.
    pub(crate) fn load(&self) -> Result<PeerTlsConfig> {
        let certs = load_certs(&self.cert)?;
        let key = load_key(&self.key)?;
        let roots = Arc::new(roots(&self.ca)?);
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(|e| tls_error(&self.ca, "cannot verify peers with", e))?;
        let server = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Config(format!("TLS: {e}")))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(|e| tls_error(&self.cert, "the peer certificate and key do not fit", e))?;
        let client = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Config(format!("TLS: {e}")))?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key)
            .map_err(|e| tls_error(&self.cert, "the peer certificate and key do not fit", e))?;
        Ok(PeerTlsConfig {
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }
}

/// The name to check a peer's certificate against: the host part of
/// `host:port` (a DNS name or an IP address).
pub(crate) fn server_name(addr: &str) -> Result<rustls::pki_types::ServerName<'static>> {
    let host = match addr.rsplit_once(':') {
        Some((host, _)) => host.trim_start_matches('[').trim_end_matches(']'),
        None => addr,
    };
    rustls::pki_types::ServerName::try_from(host.to_owned()).map_err(|e| Error::OwnerUnreachable {
        owner: addr.to_owned(),
        why: format!("{host:?} is not a name TLS can check a certificate against: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_come_from_host_port() {
        assert!(server_name("127.0.0.1:7071").is_ok());
        assert!(server_name("node-2.internal:7071").is_ok());
        assert!(server_name("[::1]:7071").is_ok());
    }

    #[test]
    fn missing_files_are_named() {
        let err = server_config(
            Path::new("/nonexistent/c.pem"),
            Path::new("/nonexistent/k.pem"),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("/nonexistent/c.pem"), "{err}");
    }
}
