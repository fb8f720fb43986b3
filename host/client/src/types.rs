//! The API's answers the client reads into types. Answers with many fields
//! that change as the node grows (status, listings) stay
//! [`serde_json::Value`], described by the node's `/v1/openapi.json`. Must
//! not hold behaviour.

use serde::{Deserialize, Serialize};

/// A deployed module version (`PUT /v1/modules/{name}`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Deployed {
    /// The module's name as stored (a tenant's is qualified, `acme/counter`).
    pub name: String,
    /// The version stored.
    pub version: u64,
    /// Compile (or compile-cache load) time, in milliseconds.
    pub compile_ms: u64,
    /// Whether it came from the compile cache.
    pub compile_cached: bool,
    /// SHA-256 of the component, lowercase hex.
    pub content_hash: String,
}

/// What a graceful leave did (`POST /v1/leave`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LeaveReport {
    /// Keys whose handoff state could not travel, with why.
    pub lost_states: Vec<serde_json::Value>,
    /// There was no other node to hand to: the keys stopped with their state.
    pub no_other_node: bool,
    /// Whether the arbiter confirmed the release (else the fenced lease
    /// lapses at its TTL).
    #[serde(default = "yes")]
    pub released: bool,
}

fn yes() -> bool {
    true
}

/// One committed entry of a key's durable state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredEntry {
    /// The entry's name.
    pub name: String,
    /// Its value: `{"utf8": "..."}` or `{"hex": "..."}`.
    pub value: serde_json::Value,
}

impl StoredEntry {
    /// The value's bytes (`None` if the node sent neither form).
    pub fn bytes(&self) -> Option<Vec<u8>> {
        if let Some(text) = self.value["utf8"].as_str() {
            return Some(text.as_bytes().to_vec());
        }
        let hex = self.value["hex"].as_str()?;
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
            .collect()
    }
}

/// One committed alarm of a key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredAlarm {
    /// The alarm's name.
    pub name: String,
    /// When it is due, milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// Milliseconds until it is due on the node's clock (negative: overdue).
    pub due_in_ms: i64,
}

/// A cache entry (`GET /v1/cache/{namespace}/{key}`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheEntry {
    /// The value.
    pub value: Vec<u8>,
    /// Its version (compare-and-set with [`CacheExpect::Version`]).
    pub version: u64,
    /// Milliseconds until it expires, if it has a TTL.
    pub expires_in_ms: Option<u64>,
}

/// A condition on a cache write (compare-and-set).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CacheExpect {
    /// Write whatever is there.
    #[default]
    Any,
    /// Only if there is no entry.
    Absent,
    /// Only if the entry is at this version.
    Version(u64),
}
