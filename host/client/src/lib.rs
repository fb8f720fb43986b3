//! `fief-client`: an async client for the Fief HTTP API, the one the `fief`
//! CLI itself uses.
//!
//! - **Typed errors**: [`Error::Api`] carries the node's stable `code`
//!   (`fenced`, `unknown_module`, ...), its status and message;
//!   [`Error::Unreachable`] says no answer came.
//! - **Retries on refusals**: a request the node refused without acting on
//!   it ([`ApiError::is_refusal`]: fenced, unowned, overloaded, ...) or that
//!   could not connect is sent again, with backoff, up to
//!   [`RetryPolicy::attempts`]; nothing that may have been processed
//!   (`answer_lost`, `timeout`) is ever resent.
//! - **TLS and tokens**: `https://` nodes, an extra CA certificate
//!   ([`ClientBuilder::ca_cert_pem`]), a bearer token
//!   ([`ClientBuilder::token`]) that is marked sensitive.
//!
//! ```no_run
//! # async fn run() -> Result<(), fief_client::Error> {
//! let node = fief_client::Client::builder("http://127.0.0.1:7070")
//!     .token("my-token")
//!     .build()?;
//! let reply = node.call("counter", "alice", "incr").await?;
//! println!("{}", String::from_utf8_lossy(&reply));
//! # Ok(()) }
//! ```
//!
//! This crate owns the HTTP plumbing and the retry rule; it must not know
//! how a node works beyond the API's documented answers.

mod error;
mod ops;
mod types;

use std::time::Duration;

pub use error::{ApiError, Error, REFUSAL_CODES};
pub use types::{CacheEntry, CacheExpect, Deployed, LeaveReport, StoredAlarm, StoredEntry};

/// A client of one node's API (any node of a cluster routes to every key).
#[derive(Clone, Debug)]
pub struct Client {
    http: reqwest::Client,
    base: reqwest::Url,
    retry: RetryPolicy,
}

/// How refusals are retried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (1: never retry).
    pub attempts: u32,
    /// The wait before the first retry; doubled for each one after.
    pub backoff: Duration,
}

impl Default for RetryPolicy {
    /// Three attempts, 100 ms then 200 ms apart: long enough for a move or
    /// a fence's takeover to settle its routing, short enough for a CLI.
    fn default() -> Self {
        RetryPolicy {
            attempts: 3,
            backoff: Duration::from_millis(100),
        }
    }
}

/// Builds a [`Client`].
#[derive(Debug)]
pub struct ClientBuilder {
    node: String,
    token: Option<String>,
    ca_pems: Vec<Vec<u8>>,
    retry: RetryPolicy,
    timeout: Option<Duration>,
}

impl Client {
    /// Start building a client of the node at `node` (`http://host:port` or
    /// `https://...`).
    pub fn builder(node: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            node: node.into(),
            token: None,
            ca_pems: Vec::new(),
            retry: RetryPolicy::default(),
            timeout: None,
        }
    }

    /// A client of `node` with no token, the system's CAs and the default
    /// retries.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] if `node` is not an HTTP(S) URL.
    pub fn new(node: impl Into<String>) -> Result<Self, Error> {
        Client::builder(node).build()
    }

    /// The node's base URL.
    pub fn node(&self) -> &str {
        self.base.as_str().trim_end_matches('/')
    }

    /// `self` with a different retry policy.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// The URL of `segments` under the node's, each percent-encoded.
    pub(crate) fn url(&self, segments: &[&str]) -> reqwest::Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        url
    }

    /// The underlying HTTP client (token and CAs set), for requests this
    /// crate has no method for.
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// Send the request `make` builds, again while it is refused (per the
    /// retry policy), and return the successful response.
    pub(crate) async fn send(
        &self,
        make: impl Fn(&reqwest::Client) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, Error> {
        let mut wait = self.retry.backoff;
        let mut attempt = 1;
        loop {
            let result = self.send_once(make(&self.http)).await;
            match result {
                Err(e) if e.is_retryable() && attempt < self.retry.attempts.max(1) => {
                    tokio::time::sleep(wait).await;
                    wait = wait.saturating_mul(2);
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// Send `request` once.
    pub(crate) async fn send_once(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, Error> {
        let response = request.send().await.map_err(|source| Error::Unreachable {
            node: self.node().to_owned(),
            source,
        })?;
        if response.status().is_success() {
            return Ok(response);
        }
        let status = response.status().as_u16();
        let body = response.text().await.unwrap_or_default();
        Err(Error::Api(ApiError::from_body(status, &body)))
    }
}

impl ClientBuilder {
    /// Send `token` as `Authorization: Bearer` (empty: none).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        let token = token.into();
        self.token = (!token.trim().is_empty()).then(|| token.trim().to_owned());
        self
    }

    /// Trust the PEM certificates in `pem` besides the system's roots (a
    /// node's self-signed certificate, a private CA).
    pub fn ca_cert_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_pems.push(pem.into());
        self
    }

    /// How refusals are retried ([`RetryPolicy::default`]: three attempts).
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// A bound on each request, answer included (none by default: a call
    /// waits as long as its key takes, within the node's own limits).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The client.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for a URL that is not HTTP(S), a token that
    /// is not printable ASCII, or a CA that is not PEM.
    pub fn build(self) -> Result<Client, Error> {
        let bad = |m: String| Error::InvalidInput(m);
        let base = reqwest::Url::parse(&self.node)
            .map_err(|e| bad(format!("--node {:?} is not a URL: {e}", self.node)))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            return Err(bad(format!(
                "--node {:?} must be an http:// or https:// URL",
                self.node
            )));
        }
        let mut builder = reqwest::Client::builder();
        if let Some(token) = &self.token {
            let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))
                .map_err(|_| bad("the token must be printable ASCII".to_owned()))?;
            value.set_sensitive(true);
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(reqwest::header::AUTHORIZATION, value);
            builder = builder.default_headers(headers);
        }
        for pem in &self.ca_pems {
            let certs = reqwest::Certificate::from_pem_bundle(pem)
                .map_err(|e| bad(format!("the CA certificate is not PEM: {e}")))?;
            if certs.is_empty() {
                return Err(bad(
                    "the CA certificate file holds no PEM certificate".to_owned()
                ));
            }
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        if let Some(timeout) = self.timeout {
            builder = builder.timeout(timeout);
        }
        let http = builder
            .build()
            .map_err(|e| bad(format!("building the HTTP client: {e}")))?;
        Ok(Client {
            http,
            base,
            retry: self.retry,
        })
    }
}
