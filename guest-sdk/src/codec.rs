//! Typed messages: encode Rust values to the bytes the WIT interface carries,
//! and back.
//!
//! Messages, replies, tags, payloads and handoff state are all `list<u8>` in
//! the WIT contract; the node never looks inside. A [`Codec`] fixes the byte
//! form on both ends: [`Json`] (readable, self-describing, good for handoff
//! state and anything an operator may inspect) or [`Binary`] (postcard:
//! compact and fast, but both ends must agree on the exact type).
//!
//! This module is pure: no host import, so it is tested natively.
//!
//! ```
//! use fief_guest::{Binary, Codec, Json};
//!
//! let bytes = Json::encode(&vec!["hello", "world"])?;
//! assert_eq!(bytes, br#"["hello","world"]"#);
//! let back: Vec<String> = Json::decode(&bytes)?;
//! assert_eq!(back, ["hello", "world"]);
//!
//! let bytes = Binary::encode(&(7u32, "x"))?;
//! let back: (u32, String) = Binary::decode(&bytes)?;
//! assert_eq!(back, (7, "x".to_string()));
//! # Ok::<(), fief_guest::CodecError>(())
//! ```

#![forbid(unsafe_code)]

use core::fmt;

use serde::Serialize;
use serde::de::DeserializeOwned;

/// A byte encoding for typed messages.
pub trait Codec {
    /// The codec's name, used in error messages (`"json"`, `"binary"`).
    const NAME: &'static str;

    /// Encodes `value`.
    ///
    /// # Errors
    ///
    /// [`CodecError`] when the value cannot be represented in this encoding
    /// (for example a map with non-string keys in JSON).
    fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CodecError>;

    /// Decodes a `T` from all of `bytes`.
    ///
    /// # Errors
    ///
    /// [`CodecError`] when `bytes` is not a valid encoding of a `T`, including
    /// when bytes are left over after the value.
    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError>;
}

/// JSON through `serde_json`: readable and self-describing.
#[derive(Clone, Copy, Debug, Default)]
pub struct Json;

impl Codec for Json {
    const NAME: &'static str = "json";

    fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CodecError> {
        serde_json::to_vec(value).map_err(CodecError::encode::<Self>)
    }

    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
        // `from_slice` already rejects anything but whitespace after the value.
        serde_json::from_slice(bytes).map_err(CodecError::decode::<Self>)
    }
}

/// A compact binary form through `postcard`: small and fast, not
/// self-describing (both ends must use the same type).
#[derive(Clone, Copy, Debug, Default)]
pub struct Binary;

impl Codec for Binary {
    const NAME: &'static str = "binary";

    fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CodecError> {
        postcard::to_allocvec(value).map_err(CodecError::encode::<Self>)
    }

    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
        let (value, rest) = postcard::take_from_bytes(bytes).map_err(CodecError::decode::<Self>)?;
        if !rest.is_empty() {
            return Err(CodecError::decode::<Self>(format_args!(
                "{} trailing bytes after the value",
                rest.len()
            )));
        }
        Ok(value)
    }
}

/// Which way a codec failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Turning a value into bytes.
    Encode,
    /// Turning bytes into a value.
    Decode,
}

/// A value did not encode, or bytes did not decode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodecError {
    codec: &'static str,
    direction: Direction,
    message: String,
}

impl CodecError {
    fn encode<C: Codec>(error: impl fmt::Display) -> Self {
        Self {
            codec: C::NAME,
            direction: Direction::Encode,
            message: error.to_string(),
        }
    }

    fn decode<C: Codec>(error: impl fmt::Display) -> Self {
        Self {
            codec: C::NAME,
            direction: Direction::Decode,
            message: error.to_string(),
        }
    }

    /// The name of the codec that failed ([`Codec::NAME`]).
    #[must_use]
    pub fn codec(&self) -> &'static str {
        self.codec
    }

    /// Whether encoding or decoding failed.
    #[must_use]
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// The underlying library's description of the failure.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let direction = match self.direction {
            Direction::Encode => "encode",
            Direction::Decode => "decode",
        };
        write!(f, "{} {direction} failed: {}", self.codec, self.message)
    }
}

impl std::error::Error for CodecError {}

#[cfg(test)]
mod tests {
    //! Round trips through both codecs, and the failures they must report.

    use std::collections::BTreeMap;

    use serde::{Deserialize, Serialize};

    use super::*;

    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
    enum Command {
        Incr { by: u64 },
        Say(String),
        Reset,
    }

    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
    struct State {
        value: i64,
        history: Vec<Command>,
        tags: BTreeMap<String, Vec<u8>>,
        note: Option<String>,
    }

    fn sample() -> State {
        State {
            value: -42,
            history: vec![
                Command::Incr { by: 3 },
                Command::Say("héllo\nworld".into()),
                Command::Reset,
            ],
            tags: BTreeMap::from([("a".into(), vec![0, 255]), ("b".into(), Vec::new())]),
            note: None,
        }
    }

    fn round_trip<C: Codec>() {
        let state = sample();
        let bytes = C::encode(&state).unwrap();
        assert_eq!(C::decode::<State>(&bytes).unwrap(), state);

        let text = C::encode("just a str").unwrap();
        assert_eq!(C::decode::<String>(&text).unwrap(), "just a str");

        let empty = C::encode(&Vec::<u8>::new()).unwrap();
        assert_eq!(C::decode::<Vec<u8>>(&empty).unwrap(), Vec::<u8>::new());

        let number = C::encode(&u64::MAX).unwrap();
        assert_eq!(C::decode::<u64>(&number).unwrap(), u64::MAX);
    }

    #[test]
    fn json_round_trips() {
        round_trip::<Json>();
    }

    #[test]
    fn binary_round_trips() {
        round_trip::<Binary>();
    }

    #[test]
    fn json_is_plain_json() {
        assert_eq!(
            Json::encode(&Command::Incr { by: 1 }).unwrap(),
            br#"{"Incr":{"by":1}}"#
        );
        assert_eq!(
            Json::decode::<Command>(br#" "Reset" "#).unwrap(),
            Command::Reset
        );
    }

    #[test]
    fn binary_is_smaller_than_json() {
        let state = sample();
        assert!(Binary::encode(&state).unwrap().len() < Json::encode(&state).unwrap().len());
    }

    #[test]
    fn decode_errors_name_codec_and_direction() {
        let error = Json::decode::<State>(b"{not json").unwrap_err();
        assert_eq!(error.codec(), "json");
        assert_eq!(error.direction(), Direction::Decode);
        assert!(
            error.to_string().starts_with("json decode failed: "),
            "{error}"
        );

        let error = Binary::decode::<State>(&[0xff]).unwrap_err();
        assert_eq!(error.codec(), "binary");
        assert_eq!(error.direction(), Direction::Decode);
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let mut bytes = Binary::encode(&7u32).unwrap();
        bytes.push(0);
        let error = Binary::decode::<u32>(&bytes).unwrap_err();
        assert!(error.message().contains("1 trailing bytes"), "{error}");

        assert!(Json::decode::<u32>(b"7 8").is_err());
    }

    #[test]
    fn unrepresentable_values_fail_to_encode() {
        let map = BTreeMap::from([((1, 2), "tuple keys are not JSON object keys")]);
        let error = Json::encode(&map).unwrap_err();
        assert_eq!(error.direction(), Direction::Encode);
    }

    #[test]
    fn type_mismatch_fails_to_decode() {
        let bytes = Json::encode(&"text").unwrap();
        assert!(Json::decode::<u64>(&bytes).is_err());
    }
}
