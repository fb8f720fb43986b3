//! The client's errors: what the node answered (its stable `code`, status
//! and message), or why no answer came, and which of them are *refusals* —
//! requests the node did not process, so sending them again is safe. Must
//! not retry anything itself (that is `Client`'s job).

use std::fmt;

/// What went wrong with a request.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The node answered with an error.
    #[error("{0}")]
    Api(ApiError),
    /// The node could not be reached, or sent no answer.
    #[error("cannot reach the node at {node} (is `fief node` running? pass --node URL)")]
    Unreachable {
        /// The node's base URL.
        node: String,
        /// The transport's error.
        #[source]
        source: reqwest::Error,
    },
    /// The client was given something it cannot use (a malformed URL, a
    /// token that is not printable ASCII, a CA file that is not PEM).
    #[error("{0}")]
    InvalidInput(String),
    /// The node's answer was not what the API describes.
    #[error("unexpected answer from the node: {0}")]
    Decode(String),
}

impl Error {
    /// The API's error code (`fenced`, `unknown_module`, ...), if the node
    /// answered with one.
    pub fn code(&self) -> Option<&str> {
        match self {
            Error::Api(e) => Some(&e.code),
            _ => None,
        }
    }

    /// Whether the request certainly was not processed and may be sent
    /// again as it is: a refusal (see [`ApiError::is_refusal`]) or a
    /// connection that could not be made at all.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Api(e) => e.is_refusal(),
            Error::Unreachable { source, .. } => source.is_connect(),
            _ => false,
        }
    }
}

/// An error answer of the API: `{"error": {"code", "message"}}` and its
/// HTTP status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: u16,
    /// The stable, machine-readable code (`fenced`, `unowned`, ...).
    pub code: String,
    /// What is wrong and what to do, in words.
    pub message: String,
}

/// The codes of refusals: the node did not process the request (no key
/// saw the message, nothing was stored) and says to try again — on this
/// node shortly, or on another. `answer_lost`, `timeout` and
/// `storage_unavailable` are *not* here: their request may have been
/// processed.
pub const REFUSAL_CODES: &[&str] = &[
    "fenced",
    "unowned",
    "not_owner",
    "owner_unreachable",
    "shutting_down",
    "overloaded",
    "too_many_connections",
    "too_many_keys",
    "host_memory",
    "compile_busy",
    "module_store_unavailable",
];

impl ApiError {
    /// Whether this is a refusal the node did not act on
    /// ([`REFUSAL_CODES`]): safe to send again.
    pub fn is_refusal(&self) -> bool {
        REFUSAL_CODES.contains(&self.code.as_str())
    }

    /// Read an error answer: its JSON body, or its text when it is not JSON.
    pub(crate) fn from_body(status: u16, body: &str) -> Self {
        let parsed = serde_json::from_str::<serde_json::Value>(body).ok();
        let field = |name: &str| {
            parsed
                .as_ref()
                .and_then(|v| v["error"][name].as_str())
                .map(str::to_owned)
        };
        ApiError {
            status,
            code: field("code").unwrap_or_else(|| format!("http_{status}")),
            message: field("message").unwrap_or_else(|| body.trim().to_owned()),
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let reason = reqwest::StatusCode::from_u16(self.status)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("");
        write!(f, "{} (HTTP {} {reason})", self.message, self.status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_body_is_read_and_refusals_are_told_apart() {
        let fenced = ApiError::from_body(
            503,
            r#"{"error":{"code":"fenced","message":"this node is fenced"}}"#,
        );
        assert_eq!(fenced.code, "fenced");
        assert!(fenced.is_refusal());
        assert_eq!(
            fenced.to_string(),
            "this node is fenced (HTTP 503 Service Unavailable)"
        );
        let lost = ApiError::from_body(502, r#"{"error":{"code":"answer_lost","message":"m"}}"#);
        assert!(!lost.is_refusal(), "it may have been processed");
        let plain = ApiError::from_body(502, "bad gateway\n");
        assert_eq!(
            (plain.code.as_str(), plain.message.as_str()),
            ("http_502", "bad gateway")
        );
    }
}
