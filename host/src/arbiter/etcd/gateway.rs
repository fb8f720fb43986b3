//! The etcd v3 client: etcd's JSON gRPC-gateway over HTTP (`POST /v3/…`),
//! with `reqwest` and serde, so the build needs no `protoc`.
//!
//! This file owns the wire: the endpoints tried in turn (the one that last
//! answered first; on a connection error, a timeout or a 5xx the next one),
//! the per-request timeout, the JSON shapes (keys and values base64, int64
//! fields as JSON strings, zero values left out of answers), and the mapping
//! of failures onto [`GatewayError`]. It must not decide anything about
//! leases, leadership or the table (the adapter does); it knows no Fief key
//! layout.
//!
//! The paths were checked against etcd 3.4 (Debian's `etcd-server`
//! 3.4.23): `/v3/kv/range`, `/v3/kv/txn`, `/v3/lease/grant`,
//! `/v3/lease/keepalive` (a stream: one request in, one `{"result": …}`
//! out), `/v3/lease/revoke`, `/v3/lease/timetolive`,
//! `/v3/maintenance/status`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use serde::Deserialize;
use serde::de::{DeserializeOwned, Deserializer};
use serde_json::{Value, json};

/// Why a request failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum GatewayError {
    /// No endpoint answered (each one's failure, in the order tried).
    Unreachable(String),
    /// An endpoint answered with an error status that another endpoint
    /// would answer alike (a bad request, a lease not found): the gRPC code
    /// and etcd's message.
    Status { code: i64, message: String },
}

impl std::fmt::Display for GatewayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GatewayError::Unreachable(why) => write!(f, "no etcd endpoint answered: {why}"),
            GatewayError::Status { code, message } => {
                write!(f, "etcd answered: {message} (gRPC code {code})")
            }
        }
    }
}

/// gRPC's `NOT_FOUND` (a lease that does not exist).
pub(super) const NOT_FOUND: i64 = 5;

/// An int64 field: etcd's gateway writes them as JSON strings (and leaves
/// zeros out, hence `#[serde(default)]` wherever this is used).
fn int<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    match Value::deserialize(d)? {
        Value::String(s) => s.parse().map_err(serde::de::Error::custom),
        Value::Number(n) => n
            .as_i64()
            .or_else(|| n.as_u64().map(|u| u as i64))
            .ok_or_else(|| serde::de::Error::custom(format!("{n} is not an int64"))),
        Value::Null => Ok(0),
        other => Err(serde::de::Error::custom(format!(
            "expected an int64, got {other}"
        ))),
    }
}

/// Base64 bytes (keys and values).
fn b64<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let s = Option::<String>::deserialize(d)?.unwrap_or_default();
    B64.decode(s).map_err(serde::de::Error::custom)
}

fn enc(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

/// Every answer's header.
#[derive(Clone, Debug, Default, Deserialize)]
pub(super) struct Header {
    /// The store's revision when the request was served (after a write:
    /// the write's revision).
    #[serde(default, deserialize_with = "int")]
    pub revision: i64,
}

/// One stored key.
#[derive(Clone, Debug, Default, Deserialize)]
pub(super) struct KeyValue {
    #[serde(default, deserialize_with = "b64")]
    pub key: Vec<u8>,
    /// The revision of its creation (since it last did not exist).
    #[serde(default, deserialize_with = "int")]
    pub create_revision: i64,
    /// The revision of its last change.
    #[serde(default, deserialize_with = "int")]
    pub mod_revision: i64,
    #[serde(default, deserialize_with = "b64")]
    pub value: Vec<u8>,
    /// The lease it is attached to (0: none).
    #[serde(default, deserialize_with = "int")]
    pub lease: i64,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub(super) struct RangeResponse {
    #[serde(default)]
    pub kvs: Vec<KeyValue>,
}

#[derive(Debug, Default, Deserialize)]
struct ResponseOp {
    #[serde(default)]
    response_range: Option<RangeResponse>,
}

#[derive(Debug, Default, Deserialize)]
struct RawTxnResponse {
    #[serde(default)]
    header: Header,
    #[serde(default)]
    succeeded: bool,
    #[serde(default)]
    responses: Vec<ResponseOp>,
}

/// A transaction's answer.
#[derive(Debug, Default)]
pub(super) struct TxnResponse {
    pub header: Header,
    /// Whether every compare held (the success branch ran).
    pub succeeded: bool,
    /// The key-values each range of the branch that ran found, in order
    /// (puts and deletes give an empty entry).
    pub ranges: Vec<Vec<KeyValue>>,
}

/// A compare of a transaction.
#[derive(Clone, Debug)]
pub(super) enum Compare {
    /// The key's version (0: absent) equals.
    VersionIs(String, i64),
    /// The key exists.
    Exists(String),
    /// The key's create revision (0: absent) equals.
    CreatedAt(String, i64),
    /// The key's mod revision (0: absent) equals.
    ModifiedAt(String, i64),
    /// The key is attached to this lease (0: none, or absent).
    LeaseIs(String, i64),
    /// No key from the first to the second (excluded) was created after
    /// this revision (one compare, however many keys: etcd compares every
    /// key of the range that exists).
    NoneCreatedAfter(String, String, i64),
}

impl Compare {
    fn json(&self) -> Value {
        if let Compare::NoneCreatedAfter(start, end, revision) = self {
            return json!({
                "key": enc(start.as_bytes()), "range_end": enc(end.as_bytes()),
                "target": "CREATE", "result": "LESS",
                "create_revision": (revision + 1).to_string(),
            });
        }
        let (key, target, result, field, value) = match self {
            Compare::NoneCreatedAfter(..) => unreachable!("handled above"),
            Compare::VersionIs(k, v) => (k, "VERSION", "EQUAL", "version", *v),
            Compare::Exists(k) => (k, "VERSION", "GREATER", "version", 0),
            Compare::CreatedAt(k, v) => (k, "CREATE", "EQUAL", "create_revision", *v),
            Compare::ModifiedAt(k, v) => (k, "MOD", "EQUAL", "mod_revision", *v),
            Compare::LeaseIs(k, v) => (k, "LEASE", "EQUAL", "lease", *v),
        };
        let mut c = json!({"key": enc(key.as_bytes()), "target": target, "result": result});
        c[field] = Value::String(value.to_string());
        c
    }
}

/// An operation of a transaction.
#[derive(Clone, Debug)]
pub(super) enum Op {
    /// Read one key.
    Get(String),
    /// Read every key from the first to the second (excluded).
    Range(String, String),
    /// Write a key, attached to a lease (0: none).
    Put(String, Vec<u8>, i64),
}

impl Op {
    fn json(&self) -> Value {
        match self {
            Op::Get(k) => json!({"request_range": {"key": enc(k.as_bytes())}}),
            Op::Range(k, end) => json!({"request_range": {
                "key": enc(k.as_bytes()), "range_end": enc(end.as_bytes())}}),
            Op::Put(k, v, lease) => json!({"request_put": {
                "key": enc(k.as_bytes()), "value": enc(v), "lease": lease.to_string()}}),
        }
    }
}

/// A lease as etcd granted or renewed it.
#[derive(Debug, Default, Deserialize)]
pub(super) struct LeaseAnswer {
    #[serde(default, rename = "ID", deserialize_with = "int")]
    pub id: i64,
    /// Seconds: the TTL granted, or (`timetolive`) left, rounded down; 0
    /// from a keepalive, −1 from `timetolive`, when there is no such lease.
    #[serde(default, rename = "TTL", deserialize_with = "int")]
    pub ttl: i64,
}

/// The client: the endpoints and how long each request may take.
pub(super) struct Gateway {
    client: reqwest::Client,
    /// `http://host:port`, as configured.
    endpoints: Vec<String>,
    /// The endpoint that answered last; tried first.
    preferred: AtomicUsize,
}

impl Gateway {
    /// A client of `endpoints` (`host:port`), each request bounded by
    /// `timeout`.
    pub(super) fn new(endpoints: &[String], timeout: Duration) -> Result<Self, GatewayError> {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .no_proxy()
            .build()
            .map_err(|e| GatewayError::Unreachable(format!("cannot build an HTTP client: {e}")))?;
        Ok(Gateway {
            client,
            endpoints: endpoints.iter().map(|e| format!("http://{e}")).collect(),
            preferred: AtomicUsize::new(0),
        })
    }

    /// The endpoints, for messages.
    pub(super) fn describe(&self) -> String {
        self.endpoints.join(", ")
    }

    /// `POST path` with `body` to each endpoint in turn until one answers;
    /// the answer's body.
    async fn post(&self, path: &str, body: &Value) -> Result<bytes::Bytes, GatewayError> {
        let first = self.preferred.load(Ordering::Relaxed);
        let mut failures = Vec::new();
        for i in 0..self.endpoints.len() {
            let at = (first + i) % self.endpoints.len();
            let endpoint = &self.endpoints[at];
            let answer = match self
                .client
                .post(format!("{endpoint}{path}"))
                .json(body)
                .send()
                .await
            {
                Ok(answer) => answer,
                Err(e) => {
                    failures.push(format!("{endpoint}: {}", describe(&e)));
                    continue;
                }
            };
            let status = answer.status();
            let bytes = match answer.bytes().await {
                Ok(bytes) => bytes,
                Err(e) => {
                    failures.push(format!("{endpoint}: {}", describe(&e)));
                    continue;
                }
            };
            if status.is_success() {
                self.preferred.store(at, Ordering::Relaxed);
                return Ok(bytes);
            }
            let error = grpc_error(&bytes);
            // Unavailable, timed out, overloaded, no leader: another member
            // may do better.
            if status.is_server_error() || status.as_u16() == 429 {
                failures.push(format!(
                    "{endpoint}: HTTP {status}: {}",
                    error.map_or_else(|| String::from_utf8_lossy(&bytes).into_owned(), |e| e.1)
                ));
                continue;
            }
            self.preferred.store(at, Ordering::Relaxed);
            return Err(match error {
                Some((code, message)) => GatewayError::Status { code, message },
                None => GatewayError::Status {
                    code: -1,
                    message: format!(
                        "HTTP {status} from {endpoint}{path} (is it etcd 3.4 or newer, with its \
                         gRPC-gateway on the client URL?): {}",
                        String::from_utf8_lossy(&bytes)
                    ),
                },
            });
        }
        Err(GatewayError::Unreachable(failures.join("; ")))
    }

    async fn call<T: DeserializeOwned>(&self, path: &str, body: &Value) -> Result<T, GatewayError> {
        let bytes = self.post(path, body).await?;
        parse(path, &bytes)
    }

    /// A transaction: if every compare holds, `success` runs, else
    /// `failure`.
    pub(super) async fn txn(
        &self,
        compare: &[Compare],
        success: &[Op],
        failure: &[Op],
    ) -> Result<TxnResponse, GatewayError> {
        let body = json!({
            "compare": compare.iter().map(Compare::json).collect::<Vec<_>>(),
            "success": success.iter().map(Op::json).collect::<Vec<_>>(),
            "failure": failure.iter().map(Op::json).collect::<Vec<_>>(),
        });
        let raw: RawTxnResponse = self.call("/v3/kv/txn", &body).await?;
        Ok(TxnResponse {
            header: raw.header,
            succeeded: raw.succeeded,
            ranges: raw
                .responses
                .into_iter()
                .map(|r| r.response_range.map(|r| r.kvs).unwrap_or_default())
                .collect(),
        })
    }

    /// Read `ops` (gets and ranges) at one revision: a transaction with no
    /// compares (linearizable, like every read here).
    pub(super) async fn read(&self, ops: &[Op]) -> Result<TxnResponse, GatewayError> {
        self.txn(&[], ops, &[]).await
    }

    /// Grant a lease of `ttl_secs` seconds (etcd may grant more: its
    /// minimum TTL).
    pub(super) async fn grant(&self, ttl_secs: i64) -> Result<LeaseAnswer, GatewayError> {
        self.call("/v3/lease/grant", &json!({"TTL": ttl_secs.to_string()}))
            .await
    }

    /// Renew a lease; the answer's TTL is 0 when etcd has no such lease
    /// (expired or revoked).
    pub(super) async fn keepalive(&self, lease: i64) -> Result<LeaseAnswer, GatewayError> {
        // A stream answer: `{"result": {…}}` or `{"error": {…}}`, one per
        // request sent (we send one).
        #[derive(Deserialize)]
        struct Item {
            result: Option<LeaseAnswer>,
            error: Option<Value>,
        }
        let bytes = self
            .post("/v3/lease/keepalive", &json!({"ID": lease.to_string()}))
            .await?;
        let first = serde_json::Deserializer::from_slice(&bytes)
            .into_iter::<Item>()
            .next();
        match first {
            Some(Ok(Item {
                result: Some(answer),
                ..
            })) => Ok(answer),
            Some(Ok(Item {
                error: Some(error), ..
            })) => Err(GatewayError::Unreachable(format!(
                "the lease keepalive failed: {error}"
            ))),
            _ => Err(GatewayError::Unreachable(format!(
                "the lease keepalive's answer is not understood: {}",
                String::from_utf8_lossy(&bytes)
            ))),
        }
    }

    /// Revoke a lease (its keys are deleted with it).
    pub(super) async fn revoke(&self, lease: i64) -> Result<(), GatewayError> {
        self.call::<Value>("/v3/lease/revoke", &json!({"ID": lease.to_string()}))
            .await
            .map(|_| ())
    }

    /// The time left on a lease (−1: no such lease).
    pub(super) async fn time_to_live(&self, lease: i64) -> Result<LeaseAnswer, GatewayError> {
        self.call("/v3/lease/timetolive", &json!({"ID": lease.to_string()}))
            .await
    }

    /// Whether a member answers (its status, read and dropped).
    pub(super) async fn status(&self) -> Result<(), GatewayError> {
        self.call::<Value>("/v3/maintenance/status", &json!({}))
            .await
            .map(|_| ())
    }
}

/// An answer's JSON as `T`.
fn parse<T: DeserializeOwned>(path: &str, bytes: &[u8]) -> Result<T, GatewayError> {
    serde_json::from_slice(bytes).map_err(|e| GatewayError::Status {
        code: -1,
        message: format!(
            "the answer to {path} is not understood ({e}): {}",
            String::from_utf8_lossy(bytes)
        ),
    })
}

/// The gRPC code and message of an error answer, if it is one.
fn grpc_error(bytes: &[u8]) -> Option<(i64, String)> {
    let v: Value = serde_json::from_slice(bytes).ok()?;
    let code = v.get("code")?.as_i64()?;
    let message = v
        .get("message")
        .or_else(|| v.get("error"))
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    Some((code, message))
}

/// A request failure, with its cause (reqwest's `Display` leaves it out).
fn describe(e: &reqwest::Error) -> String {
    let what = if e.is_timeout() {
        "no answer in time".to_owned()
    } else if e.is_connect() {
        "cannot connect".to_owned()
    } else {
        e.to_string()
    };
    match std::error::Error::source(e) {
        Some(cause) if !e.is_timeout() => format!("{what} ({cause})"),
        _ => what,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int64_fields_are_strings_and_zeros_are_left_out() {
        let kv: KeyValue = serde_json::from_str(
            r#"{"key":"L3QvbQ==","create_revision":"4","mod_revision":"7","version":"1","value":"cmVj","lease":"4111120458160790818"}"#,
        )
        .unwrap();
        assert_eq!(kv.key, b"/t/m");
        assert_eq!((kv.create_revision, kv.mod_revision), (4, 7));
        assert_eq!(kv.value, b"rec");
        assert_eq!(kv.lease, 4111120458160790818);
        let answer: LeaseAnswer = serde_json::from_str(r#"{"header":{},"ID":"12"}"#).unwrap();
        assert_eq!((answer.id, answer.ttl), (12, 0), "TTL 0 is left out");
        let raw: RawTxnResponse = serde_json::from_str(
            r#"{"header":{"revision":"9"},"responses":[{"response_range":{"header":{}}}]}"#,
        )
        .unwrap();
        assert!(!raw.succeeded, "false is left out");
        assert_eq!(raw.header.revision, 9);
    }

    #[test]
    fn compares_name_etcds_fields() {
        let c = Compare::LeaseIs("/k".to_owned(), 42).json();
        assert_eq!(c["target"], "LEASE");
        assert_eq!(c["lease"], "42");
        let c = Compare::Exists("/k".to_owned()).json();
        assert_eq!(
            (&c["result"], &c["version"]),
            (&json!("GREATER"), &json!("0"))
        );
        let c = Compare::CreatedAt("/k".to_owned(), 7).json();
        assert_eq!(c["create_revision"], "7");
        let c = Compare::NoneCreatedAfter("/m/".to_owned(), "/m0".to_owned(), 9).json();
        assert_eq!(
            (&c["target"], &c["result"]),
            (&json!("CREATE"), &json!("LESS"))
        );
        assert_eq!(
            (&c["create_revision"], &c["range_end"]),
            (&json!("10"), &json!("L20w"))
        );
    }

    #[test]
    fn a_grpc_error_answer_is_read() {
        let body = br#"{"error":"etcdserver: requested lease not found","message":"etcdserver: requested lease not found","code":5}"#;
        assert_eq!(
            grpc_error(body),
            Some((
                NOT_FOUND,
                "etcdserver: requested lease not found".to_owned()
            ))
        );
        assert_eq!(grpc_error(b"404 page not found"), None);
    }
}
