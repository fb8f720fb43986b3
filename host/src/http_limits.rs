//! What an API client may hold of a node: connections, time, and the size of
//! a request's head.
//!
//! | limit | default | ceiling |
//! |---|---|---|
//! | open connections (`http_max_connections`) | the lowest of 4096, ¾ of the open-file limit, and the limit less [`RESERVED_FDS`] | the open-file limit less [`RESERVED_FDS`] |
//! | time to send a request's head (`http_header_read_timeout`) | 10 s | 5 min |
//! | time a kept-alive connection may wait for its next request (`http_idle_timeout`) | 60 s | 1 h |
//! | time to send a request's body (`http_body_read_timeout`), from the node's first read of it, plus 1 s per [`MIN_BODY_RATE`] bytes received | 30 s | 5 min |
//! | request line | [`MAX_REQUEST_LINE_BYTES`] (`414`) | fixed |
//! | request head (request line and headers) | [`MAX_HEAD_BYTES`], [`MAX_HEADER_FIELDS`] fields (`431`) | fixed |
//!
//! At the cap a new connection is not refused while some connection is
//! idle: the one idle the longest (waiting for a request, or part way
//! through sending a head) is closed to admit it, so idle and slow-header
//! connections cannot lock callers out. Only when every connection is busy
//! with a request is the new one answered `503 too_many_connections` and
//! closed. `fief node` raises the soft open-file limit to the hard one at
//! start ([`raise_open_file_limit`]) and logs the limits; the connection
//! loop itself is [`crate::listener`]. The timeouts' defaults and ceilings,
//! and their check, are configuration's (`config/http.rs`), re-exported
//! here; this file resolves what depends on the process (the cap against the
//! open-file limit) and scans heads.

use std::time::Duration;

use crate::config::NodeConfig;
pub use crate::config::http::{
    DEFAULT_BODY_READ_TIMEOUT, DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_IDLE_TIMEOUT,
    MAX_BODY_READ_TIMEOUT, MAX_HEADER_READ_TIMEOUT, MAX_IDLE_TIMEOUT,
};
use crate::error::{Error, Result};

/// The slowest body a client may send past `http_body_read_timeout`, in
/// bytes per second: every byte received moves the body's deadline later
/// by `1 / MIN_BODY_RATE` s, so a large upload at a fair rate is never
/// cut, and a dribbling or stalled one is cut soon after the timeout.
pub const MIN_BODY_RATE: u64 = 16 * 1024;
/// The most connections the automatic `http_max_connections` allows.
pub const AUTO_MAX_CONNECTIONS: u64 = 4096;
/// File descriptors the connection cap leaves for everything else: peer
/// links, the arbiter, the compile cache and event log, granted
/// directories, and connections being closed or refused.
pub const RESERVED_FDS: u64 = 256;
/// Longest request line (method, URI, version), in bytes; over it: `414`.
pub const MAX_REQUEST_LINE_BYTES: usize = 8 * 1024;
/// Largest request head (request line and headers), in bytes; over it:
/// `431`.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most header fields in a request; over it: `431`.
pub const MAX_HEADER_FIELDS: usize = 100;

/// The API's connection limits, resolved against the open-file limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// `http_header_read_timeout`.
    pub header_read_timeout: Duration,
    /// `http_idle_timeout`.
    pub idle_timeout: Duration,
    /// `http_body_read_timeout`.
    pub body_read_timeout: Duration,
    /// The connection cap: `http_max_connections`, or the automatic one.
    pub max_connections: usize,
    /// The soft open-file limit it was resolved against (`None`: unlimited).
    pub open_file_limit: Option<u64>,
}

impl HttpLimits {
    /// The limits of `config` under this process's open-file limit now.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the numbers when the cap does not fit the
    /// open-file limit (see [`HttpLimits::for_open_file_limit`]).
    pub fn for_node(config: &NodeConfig) -> Result<Self> {
        Self::for_open_file_limit(config, open_file_limit().soft)
    }

    /// The limits of `config` under a soft open-file limit of `soft`
    /// (`None`: unlimited).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the numbers when `http_max_connections`
    /// leaves fewer than [`RESERVED_FDS`] descriptors of the limit, or the
    /// limit is too low for any connection.
    pub fn for_open_file_limit(config: &NodeConfig, soft: Option<u64>) -> Result<Self> {
        config.validate_http()?;
        let ceiling = soft.map(|soft| soft.saturating_sub(RESERVED_FDS));
        let max = match (config.http_max_connections, soft, ceiling) {
            (Some(n), Some(soft), Some(ceiling)) if u64::from(n) > ceiling => {
                return Err(Error::Config(format!(
                    "http_max_connections ({n}) does not fit the open-file limit ({soft}): the node keeps \
                     {RESERVED_FDS} file descriptors for peers, the arbiter, files and connections being \
                     closed, so at most {ceiling}; lower it or raise the limit (ulimit -n, LimitNOFILE=)"
                )));
            }
            (Some(n), _, _) => u64::from(n),
            (None, None, _) => AUTO_MAX_CONNECTIONS,
            (None, Some(soft), Some(ceiling)) => {
                let auto = AUTO_MAX_CONNECTIONS.min(soft / 4 * 3).min(ceiling);
                if auto == 0 {
                    return Err(Error::Config(format!(
                        "the open-file limit ({soft}) is too low to serve the API: the node keeps \
                         {RESERVED_FDS} file descriptors for peers, the arbiter and files; raise it to \
                         at least {} (ulimit -n, LimitNOFILE=)",
                        RESERVED_FDS + 64
                    )));
                }
                auto
            }
            (None, Some(_), None) => unreachable!("a soft limit always has a ceiling"),
        };
        Ok(HttpLimits {
            header_read_timeout: config.http_header_read_timeout,
            idle_timeout: config.http_idle_timeout,
            body_read_timeout: config.http_body_read_timeout,
            max_connections: usize::try_from(max).unwrap_or(usize::MAX),
            open_file_limit: soft,
        })
    }
}

/// This process's open-file limit; `None` is unlimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenFileLimit {
    /// The soft limit: what the process may open now.
    pub soft: Option<u64>,
    /// The hard limit: how far the soft one may be raised.
    pub hard: Option<u64>,
}

/// The open-file limit now.
pub fn open_file_limit() -> OpenFileLimit {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    OpenFileLimit {
        soft: limit.current,
        hard: limit.maximum,
    }
}

/// What [`raise_open_file_limit`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RaisedLimit {
    /// The limit before.
    pub before: OpenFileLimit,
    /// The limit after.
    pub after: OpenFileLimit,
    /// Why it could not be raised as far as the hard limit, if it could not.
    pub refused: Option<String>,
}

/// Raise the soft open-file limit to the hard one, where the system allows
/// (some refuse an unlimited soft limit: then the highest of 2^20 and 2^16
/// it takes). Never lowers it.
pub fn raise_open_file_limit() -> RaisedLimit {
    use rustix::process::{Resource, Rlimit, setrlimit};
    let before = open_file_limit();
    let mut refused = None;
    let below = |target: Option<u64>| match (before.soft, target) {
        (None, _) => false,
        (Some(_), None) => true,
        (Some(soft), Some(target)) => target > soft,
    };
    let targets = [before.hard, Some(1 << 20), Some(1 << 16)];
    for target in targets {
        let target = match (target, before.hard) {
            (Some(t), Some(hard)) => Some(t.min(hard)),
            (t, _) => t,
        };
        if !below(target) {
            break;
        }
        match setrlimit(
            Resource::Nofile,
            Rlimit {
                current: target,
                maximum: before.hard,
            },
        ) {
            Ok(()) => break,
            Err(e) => {
                refused.get_or_insert_with(|| {
                    format!(
                        "raising the open-file limit to {} was refused: {e}",
                        shown(target)
                    )
                });
            }
        }
    }
    RaisedLimit {
        before,
        after: open_file_limit(),
        refused,
    }
}

/// A limit as text: the number, or `unlimited`.
pub fn shown(limit: Option<u64>) -> String {
    limit.map_or_else(|| "unlimited".to_owned(), |n| n.to_string())
}

/// Why a request head was refused before it reached the router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeadRefusal {
    /// The request line is over [`MAX_REQUEST_LINE_BYTES`].
    UriTooLong,
    /// The head is over [`MAX_HEAD_BYTES`] or [`MAX_HEADER_FIELDS`].
    TooLarge,
}

impl HeadRefusal {
    /// The error answered.
    pub(crate) fn error(self) -> Error {
        match self {
            HeadRefusal::UriTooLong => Error::UriTooLong {
                limit: MAX_REQUEST_LINE_BYTES,
            },
            HeadRefusal::TooLarge => Error::HeadersTooLarge {
                limit: MAX_HEAD_BYTES,
                fields: MAX_HEADER_FIELDS,
            },
        }
    }
}

/// Follows the bytes of one request head as they arrive, to refuse one over
/// the limits before it is buffered whole. A head ends at an empty line
/// (`\r\n\r\n`, or a bare `\n\n` as the parser also accepts); empty lines
/// before the request line are skipped, as the parser skips them.
#[derive(Clone, Debug, Default)]
pub(crate) struct HeadScan {
    /// Bytes of the head so far.
    bytes: usize,
    /// Non-empty lines ended so far (the request line, then header fields).
    lines: usize,
    /// Bytes of the current line, its `\r` included.
    line: usize,
    /// The last byte of the current line was `\r`.
    cr: bool,
    /// The head has ended: nothing more to follow until [`HeadScan::reset`].
    done: bool,
}

impl HeadScan {
    /// Start over, for the next request's head.
    pub(crate) fn reset(&mut self) {
        *self = HeadScan::default();
    }

    /// Whether the head has ended.
    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    /// Follow `data`, the next bytes read; past the head's end they are the
    /// body's and are ignored.
    pub(crate) fn feed(&mut self, data: &[u8]) -> std::result::Result<(), HeadRefusal> {
        for &b in data {
            if self.done {
                return Ok(());
            }
            self.bytes += 1;
            if b == b'\n' {
                let empty = self.line == 0 || (self.line == 1 && self.cr);
                if !empty {
                    self.lines += 1;
                } else if self.lines > 0 {
                    self.done = true;
                }
                self.line = 0;
                self.cr = false;
            } else {
                self.line += 1;
                self.cr = b == b'\r';
            }
            if self.lines == 0 && self.line > MAX_REQUEST_LINE_BYTES {
                return Err(HeadRefusal::UriTooLong);
            }
            if self.bytes > MAX_HEAD_BYTES || self.lines > MAX_HEADER_FIELDS + 1 {
                return Err(HeadRefusal::TooLarge);
            }
        }
        Ok(())
    }
}

/// A whole HTTP/1.1 response for `error` with its JSON body
/// (`{"error":{"code","message"}}`, as every API error), closing the
/// connection; for answers written before or instead of the router.
pub(crate) fn error_response(error: &Error) -> Vec<u8> {
    let status = error.http_status();
    let reason = axum::http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Error");
    let body = serde_json::json!({"error": {"code": error.code(), "message": error.to_string()}})
        .to_string();
    let retry = if status == 503 {
        "retry-after: 1\r\n"
    } else {
        ""
    };
    format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{retry}connection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_cap(cap: Option<u32>) -> NodeConfig {
        NodeConfig {
            http_max_connections: cap,
            ..NodeConfig::default()
        }
    }

    #[test]
    fn the_automatic_cap_stays_below_the_open_file_limit() {
        let cap = |soft| {
            HttpLimits::for_open_file_limit(&with_cap(None), soft)
                .unwrap()
                .max_connections
        };
        assert_eq!(cap(Some(1024)), 768);
        assert_eq!(cap(Some(400)), 144);
        assert_eq!(cap(Some(1 << 20)), 4096);
        assert_eq!(cap(None), 4096);
        let err = HttpLimits::for_open_file_limit(&with_cap(None), Some(200))
            .unwrap_err()
            .to_string();
        assert!(err.contains("open-file limit (200)"), "{err}");
    }

    #[test]
    fn a_cap_over_the_open_file_limit_or_of_zero_is_refused_with_numbers() {
        let err = HttpLimits::for_open_file_limit(&with_cap(Some(1000)), Some(1024))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("http_max_connections (1000)")
                && err.contains("open-file limit (1024)")
                && err.contains("at most 768"),
            "{err}"
        );
        let ok = HttpLimits::for_open_file_limit(&with_cap(Some(768)), Some(1024)).unwrap();
        assert_eq!(ok.max_connections, 768);
        let err = with_cap(Some(0)).validate().unwrap_err().to_string();
        assert!(err.contains("http_max_connections (0)"), "{err}");
        let config = NodeConfig {
            http_idle_timeout: Duration::ZERO,
            ..NodeConfig::default()
        };
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("http_idle_timeout (0ns)"), "{err}");
        let config = NodeConfig {
            http_header_read_timeout: Duration::from_secs(301),
            ..NodeConfig::default()
        };
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("http_header_read_timeout (301s)"), "{err}");
    }

    #[test]
    fn heads_are_followed_to_their_end_and_refused_over_the_limits() {
        let mut scan = HeadScan::default();
        let head = b"\r\nGET /v1/status HTTP/1.1\r\nhost: x\r\n\r\n";
        assert_eq!(scan.feed(head), Ok(()));
        assert!(scan.done);
        // The body after the head is not the head's.
        assert_eq!(scan.feed(&vec![b'x'; MAX_HEAD_BYTES * 2]), Ok(()));
        scan.reset();
        assert_eq!(scan.feed(b"GET / HTTP/1.1\nhost: x\n\n"), Ok(()));
        assert!(scan.done, "bare newlines end a head too");

        let mut scan = HeadScan::default();
        let line = format!("GET /{} HTTP/1.1", "a".repeat(MAX_REQUEST_LINE_BYTES));
        assert_eq!(scan.feed(line.as_bytes()), Err(HeadRefusal::UriTooLong));

        let mut scan = HeadScan::default();
        assert_eq!(scan.feed(b"GET / HTTP/1.1\r\n"), Ok(()));
        let field = format!("x-big: {}\r\n", "b".repeat(1000));
        let mut result = Ok(());
        for _ in 0..MAX_HEAD_BYTES / 1000 + 1 {
            result = result.and(scan.feed(field.as_bytes()));
        }
        assert_eq!(result, Err(HeadRefusal::TooLarge));

        let mut scan = HeadScan::default();
        assert_eq!(scan.feed(b"GET / HTTP/1.1\r\n"), Ok(()));
        for i in 0..MAX_HEADER_FIELDS {
            assert_eq!(scan.feed(format!("x-{i}: 1\r\n").as_bytes()), Ok(()));
        }
        assert_eq!(scan.feed(b"x-one-more: 1\r\n"), Err(HeadRefusal::TooLarge));
    }

    #[test]
    fn error_responses_are_json_and_close() {
        let text = String::from_utf8(error_response(&HeadRefusal::TooLarge.error())).unwrap();
        assert!(
            text.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
            "{text}"
        );
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains("connection: close"), "{head}");
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(json["error"]["code"], "headers_too_large", "{json}");
    }
}
